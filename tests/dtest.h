/* dtest.h — the test runner distopt's test files share.

   A test file defines tests with DTEST(name) { ... } and ends with DTEST_MAIN() (worlds.h adds
   DTEST_WORLDS: one line registering a multi-rank test once per transport). Each test runs in
   its own forked process (its own process group), so a crash, an abort or a hang fails that test
   alone; a test that runs longer than its budget (DTEST_TIMEOUT_S, default 120 s, or
   dtest_set_timeout; DTEST_TIMEOUT_S=N in the environment gives every test N s, for a soak) is
   killed with its children. Checks print the file, the line and what failed
   and end the process with status 1, which works the same in a test and in the ranks it forks.

   Usage: ./test_x [substring]   runs the tests whose name contains substring (all without it).
   Output: "ok name (ms)", "FAIL name: reason" or "skip name: reason" per test, then one
   machine-readable line "dtest-summary <binary> passed=N failed=M skipped=K" that tests/run.sh
   adds up. A test skips with DT_SKIP("reason") at its top level (not inside forked ranks) when
   this machine lacks what it needs (root, a CPU feature): it then counts as skipped, never as
   passed. Exit status 1 on any failure. */
#ifndef DTEST_H
#define DTEST_H

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef DTEST_TIMEOUT_S
#define DTEST_TIMEOUT_S 120
#endif
#define DTEST_MAX 512

typedef void (*dtest_fn)(void);
typedef void (*dtest_fn_arg)(const void *arg);
typedef struct dtest_entry {
    const char *name;
    dtest_fn fn;         /* a DTEST(name) { ... } */
    dtest_fn_arg fn_arg; /* or a test made by a harness (worlds.h): fn_arg(arg) */
    const void *arg;
    int timeout_s;
} dtest_entry;

static dtest_entry dtest_list[DTEST_MAX];
static int dtest_count;
static int dtest_dropped; /* registrations beyond DTEST_MAX: the run fails, saying so */
static const char *dtest_current = "?";

static void dtest_add(const char *name, dtest_fn fn, dtest_fn_arg fn_arg, const void *arg) {
    if (dtest_count >= DTEST_MAX) {
        dtest_dropped++;
        return;
    }
    dtest_list[dtest_count].name = name;
    dtest_list[dtest_count].fn = fn;
    dtest_list[dtest_count].fn_arg = fn_arg;
    dtest_list[dtest_count].arg = arg;
    dtest_list[dtest_count].timeout_s = DTEST_TIMEOUT_S;
    dtest_count++;
}

__attribute__((unused)) static void dtest_register(const char *name, dtest_fn fn) { dtest_add(name, fn, NULL, NULL); }

/* A test that runs fn(arg): how a harness registers several tests from one line. */
__attribute__((unused)) static void dtest_register_arg(const char *name, dtest_fn_arg fn, const void *arg) {
    dtest_add(name, NULL, fn, arg);
}

#define DTEST(name)                                                                                \
    static void name(void);                                                                        \
    __attribute__((constructor)) static void name##_register(void) { dtest_register(#name, name); } \
    static void name(void)

__attribute__((unused)) static double dtest_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void dtest_failf(const char *file, int line, const char *fmt, ...) __attribute__((noreturn, format(printf, 3, 4)));
static void dtest_failf(const char *file, int line, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "  %s:%d: [%s pid %d] %s\n", file, line, dtest_current, (int)getpid(), msg);
    fflush(stderr);
    _exit(1);
}

/* The test cannot run here (the reason says why); it counts as skipped. */
#define DTEST_SKIP_STATUS 77
#define DT_SKIP(...)                                                                               \
    do {                                                                                           \
        printf("skip %s: ", dtest_current);                                                        \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
        fflush(stdout);                                                                            \
        _exit(DTEST_SKIP_STATUS);                                                                  \
    } while (0)

#define DT_CHECK(cond)                                                                             \
    do {                                                                                           \
        if (!(cond)) dtest_failf(__FILE__, __LINE__, "check failed: %s", #cond);                   \
    } while (0)

#define DT_CHECKF(cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond)) dtest_failf(__FILE__, __LINE__, __VA_ARGS__);                                 \
    } while (0)

#define DT_EQ_INT(a, b)                                                                            \
    do {                                                                                           \
        long long a_ = (long long)(a), b_ = (long long)(b);                                        \
        if (a_ != b_) dtest_failf(__FILE__, __LINE__, "%s == %lld, expected %s == %lld", #a, a_, #b, b_); \
    } while (0)

/* |a - b| <= tol, with NaN never near anything. */
#define DT_NEAR(a, b, tol)                                                                         \
    do {                                                                                           \
        double a_ = (double)(a), b_ = (double)(b), t_ = (double)(tol);                             \
        if (!(fabs(a_ - b_) <= t_))                                                                \
            dtest_failf(__FILE__, __LINE__, "%s = %.17g, %s = %.17g, differ by more than %g", #a, a_, #b, b_, t_); \
    } while (0)

/* The status of a distopt call must be DOPT_OK; prints the status string otherwise. */
#define DT_OK(expr)                                                                                \
    do {                                                                                           \
        int s_ = (int)(expr);                                                                      \
        if (s_ != 0) dtest_failf(__FILE__, __LINE__, "%s returned %d (%s)", #expr, s_, dopt_status_str((dopt_status)s_)); \
    } while (0)

/* One int through a pipe between test processes (a port, a go-ahead); reading waits at most 30 s,
   then fails the test saying what did not arrive. */
__attribute__((unused)) static void dtest_write_int(int fd, int v) {
    if (write(fd, &v, sizeof v) != (ssize_t)sizeof v) dtest_failf(__FILE__, __LINE__, "write to a pipe failed");
}

__attribute__((unused)) static int dtest_read_int(int fd, const char *what) {
    struct pollfd pf;
    int v = -1;
    pf.fd = fd;
    pf.events = POLLIN;
    pf.revents = 0;
    if (poll(&pf, 1, 30000) != 1) dtest_failf(__FILE__, __LINE__, "%s never arrived", what);
    if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) dtest_failf(__FILE__, __LINE__, "%s: short read", what);
    return v;
}

/* Forks n processes that run fn(rank, arg); returns how many did not exit with status 0 within
   timeout_s (those are killed). Output of a failing rank names its pid. */
__attribute__((unused)) static int dtest_spawn(int n, void (*fn)(int rank, void *arg), void *arg, int timeout_s) {
    pid_t pids[256];
    int r, bad = 0, left = n;
    double deadline = dtest_now_ms() + timeout_s * 1e3;
    if (n > 256) return n;
    fflush(stdout);
    fflush(stderr);
    for (r = 0; r < n; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            fn(r, arg);
            fflush(stdout);
            _exit(0);
        }
        if (pids[r] < 0) return n;
    }
    while (left > 0) {
        int status;
        pid_t p = waitpid(-1, &status, WNOHANG);
        if (p > 0) {
            for (r = 0; r < n; r++)
                if (pids[r] == p) {
                    pids[r] = 0;
                    left--;
                    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
                        bad++;
                        if (WIFSIGNALED(status)) fprintf(stderr, "  rank %d killed by signal %d\n", r, WTERMSIG(status));
                    }
                }
            continue;
        }
        if (dtest_now_ms() > deadline) {
            for (r = 0; r < n; r++)
                if (pids[r] > 0) {
                    fprintf(stderr, "  rank %d still running after %d s: killed\n", r, timeout_s);
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0);
                    bad++;
                    left--;
                }
            break;
        }
        usleep(1000);
    }
    return bad;
}

__attribute__((unused)) static void dtest_set_timeout(const char *name, int seconds) {
    int i;
    for (i = 0; i < dtest_count; i++)
        if (strcmp(dtest_list[i].name, name) == 0) dtest_list[i].timeout_s = seconds;
}

/* 1 passed, 0 failed, 2 skipped. */
__attribute__((unused)) static int dtest_run_one(const dtest_entry *t) {
    double t0 = dtest_now_ms(), deadline = t0 + t->timeout_s * 1e3;
    int status = 0, timed_out = 0;
    pid_t pid;
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        dtest_current = t->name;
        if (t->fn != NULL)
            t->fn();
        else
            t->fn_arg(t->arg);
        fflush(stdout);
        _exit(0);
    }
    if (pid < 0) {
        printf("FAIL %s: fork: %s\n", t->name, strerror(errno));
        return 0;
    }
    setpgid(pid, pid);
    for (;;) {
        pid_t p = waitpid(pid, &status, WNOHANG);
        if (p == pid) break;
        if (dtest_now_ms() > deadline) {
            kill(-pid, SIGKILL);
            waitpid(pid, &status, 0);
            timed_out = 1;
            break;
        }
        usleep(2000);
    }
    kill(-pid, SIGKILL); /* whatever the test forked and left behind */
    if (!timed_out && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        printf("ok   %s (%.0f ms)\n", t->name, dtest_now_ms() - t0);
        return 1;
    }
    if (!timed_out && WIFEXITED(status) && WEXITSTATUS(status) == DTEST_SKIP_STATUS) return 2; /* it said why */
    if (timed_out)
        printf("FAIL %s: still running after %d s\n", t->name, t->timeout_s);
    else if (WIFSIGNALED(status))
        printf("FAIL %s: killed by signal %d (%s)\n", t->name, WTERMSIG(status), strsignal(WTERMSIG(status)));
    else
        printf("FAIL %s\n", t->name);
    return 0;
}

__attribute__((unused)) static int dtest_main(int argc, char **argv) {
    int i, passed = 0, failed = 0, skipped = 0;
    const char *filter = argc > 1 ? argv[1] : NULL;
    const char *base = strrchr(argv[0], '/'), *budget = getenv("DTEST_TIMEOUT_S");
    base = base ? base + 1 : argv[0];
    for (i = 0; budget && atoi(budget) > 0 && i < dtest_count; i++) dtest_list[i].timeout_s = atoi(budget);
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGPIPE, SIG_IGN);
    if (dtest_dropped) { /* a test nobody would run must not pass unseen */
        printf("FAIL %s: %d tests beyond DTEST_MAX (%d) were not registered; raise DTEST_MAX\n", base, dtest_dropped,
               DTEST_MAX);
        failed++;
    }
    for (i = 0; i < dtest_count; i++) { /* names select tests (and tests/mutate.sh's filters): one each */
        int j;
        for (j = 0; j < i; j++)
            if (strcmp(dtest_list[i].name, dtest_list[j].name) == 0) {
                printf("FAIL %s: two tests are named %s\n", base, dtest_list[i].name);
                failed++;
            }
    }
    for (i = 0; i < dtest_count; i++) {
        if (filter && !strstr(dtest_list[i].name, filter)) continue;
        switch (dtest_run_one(&dtest_list[i])) {
        case 1: passed++; break;
        case 2: skipped++; break;
        default: failed++;
        }
    }
    printf("dtest-summary %s passed=%d failed=%d skipped=%d\n", base, passed, failed, skipped);
    return failed ? 1 : 0;
}

#define DTEST_MAIN()                                                                               \
    int main(int argc, char **argv) { return dtest_main(argc, argv); }

#endif
