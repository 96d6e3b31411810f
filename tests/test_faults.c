/* Tests of what every survivor is told when a rank is killed in the middle of a run of large
   allreduces, over every transport of worlds.h: shared memory (direct, and the engine over its
   links) and TCP on loopback.

   Each trial starts a world of real processes (worlds.h), lets every rank enter a loop of ring
   allreduces, and SIGKILLs one rank other than 0 after a delay drawn from a fixed-seed generator
   (so a failing trial comes back on the next run). Every survivor sends the parent its status and
   detail; the detail must name the killed rank first, after "rank R: allreduce #N (...): ", on
   every survivor, whichever ring position it holds: the rank downstream of the dead one, the
   ranks that hear of it only through a neighbour's abort, and rank 0. A summary line per world
   says how many trials and survivors were checked. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "dtest.h"
#include "worlds.h"

#include <fcntl.h>

#define FAULT_ELEMS ((size_t)1 << 20) /* 4 MiB of f32: the ring path, frames larger than a stage */
#define FAULT_DELAY_US 40000          /* the kill comes 0 .. 40 ms after every rank has joined */
#define FAULT_BUDGET_S 60             /* bound on one trial, from fork to the last exit */

typedef struct fault_report {
    int rank;
    int status;
    char detail[DOPT_DETAIL_MAX];
} fault_report;

typedef struct fault_trial {
    world w;
    int ready_pipe[2];  /* each rank: its rank, once its communicator is made */
    int report_pipe[2]; /* each survivor: one fault_report (shorter than PIPE_BUF: one write) */
} fault_trial;

static uint64_t fault_next(uint64_t *state) { /* splitmix64 */
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A rank: joins, reports ready, runs allreduces until one fails, and reports how. The victim is
   killed inside the loop; survivors fail in it. */
static void fault_rank(fault_trial *ft, int rank) {
    dopt_comm *c = world_join(&ft->w, rank);
    float *buf = (float *)calloc(FAULT_ELEMS, sizeof(float));
    fault_report rep;
    dopt_status s = DOPT_OK;
    long it;
    DT_CHECK(buf != NULL);
    dtest_write_int(ft->ready_pipe[1], rank);
    for (it = 0; it < 1000000 && s == DOPT_OK; it++) s = dopt_allreduce(c, buf, FAULT_ELEMS, DOPT_F32, DOPT_SUM);
    memset(&rep, 0, sizeof rep);
    rep.rank = rank;
    rep.status = (int)s;
    snprintf(rep.detail, sizeof rep.detail, "%s", dopt_comm_detail(c));
    DT_CHECK(write(ft->report_pipe[1], &rep, sizeof rep) == (ssize_t)sizeof rep);
    free(buf);
    dopt_comm_destroy(c);
}

/* The rank a detail names first after its "rank R: <collective>: " prefix, or -1. */
static int fault_named_rank(const char *detail) {
    const char *p = strstr(detail, "elems): ");
    int r;
    if (p == NULL || (p = strstr(p, "rank ")) == NULL || sscanf(p, "rank %d", &r) != 1) return -1;
    return r;
}

/* Waits for every rank (at most FAULT_BUDGET_S); returns how many survivors did not exit 0. */
static int fault_reap(const pid_t *pids, int n, int victim) {
    double deadline = dtest_now_ms() + FAULT_BUDGET_S * 1e3;
    int left = n, bad = 0, status, r;
    pid_t p;
    while (left > 0) {
        p = waitpid(-1, &status, WNOHANG);
        for (r = 0; p > 0 && r < n; r++)
            if (pids[r] == p) {
                left--;
                if (r != victim && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) bad++;
            }
        if (p > 0) continue;
        if (dtest_now_ms() > deadline) {
            fprintf(stderr, "  a trial ran longer than %d s\n", FAULT_BUDGET_S);
            return n;
        }
        usleep(1000);
    }
    return bad;
}

/* One trial: returns the number of survivors whose report is wrong (printed), or n when the
   trial itself failed. */
static int fault_trial_run(world_via via, int n, int victim, unsigned delay_us) {
    fault_trial ft;
    fault_report rep;
    pid_t pids[8];
    struct timespec ts;
    int r, wrong = 0, reports = 0, bad;
    DT_CHECK(n >= 2 && n <= (int)(sizeof pids / sizeof pids[0]) && victim > 0 && victim < n);
    memset(&ft, 0, sizeof ft);
    ft.w.via = via;
    ft.w.n = n;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    snprintf(ft.w.shm_name, sizeof ft.w.shm_name, "dtest-fault-%d-%lld", (int)getpid(), (long long)ts.tv_nsec);
    DT_CHECK(pipe(ft.w.port_pipe) == 0 && pipe(ft.ready_pipe) == 0 && pipe(ft.report_pipe) == 0);
    fflush(stdout);
    fflush(stderr);
    for (r = 0; r < n; r++) {
        pids[r] = fork();
        DT_CHECK(pids[r] >= 0);
        if (pids[r] == 0) {
            fault_rank(&ft, r);
            _exit(0);
        }
    }
    for (r = 0; r < n; r++) dtest_read_int(ft.ready_pipe[0], "a rank's ready signal");
    usleep(delay_us);
    kill(pids[victim], SIGKILL);
    bad = fault_reap(pids, n, victim);
    for (r = 0; r < n; r++) kill(pids[r], SIGKILL); /* after a failed reap: whatever is left */
    fcntl(ft.report_pipe[0], F_SETFL, O_NONBLOCK);
    while (read(ft.report_pipe[0], &rep, sizeof rep) == (ssize_t)sizeof rep) {
        int named = fault_named_rank(rep.detail);
        reports++;
        if (rep.status != DOPT_ERR_PEER_LOST || named != victim) {
            wrong++;
            printf("  %s, world of %d, rank %d killed after %u us: rank %d got %d (%s): %s\n",
                   world_via_name(via), n, victim, delay_us, rep.rank, rep.status,
                   dopt_status_str((dopt_status)rep.status), rep.detail);
        }
    }
    close(ft.w.port_pipe[0]);
    close(ft.w.port_pipe[1]);
    close(ft.ready_pipe[0]);
    close(ft.ready_pipe[1]);
    close(ft.report_pipe[0]);
    close(ft.report_pipe[1]);
    if (bad || reports != n - 1) {
        printf("  %s, world of %d, rank %d killed after %u us: %d survivors failed, %d of %d reported\n",
               world_via_name(via), n, victim, delay_us, bad, reports, n - 1);
        return n;
    }
    return wrong;
}

/* trials per killed rank, for every rank but 0 of a world of n */
static void fault_world(world_via via, int n, int trials, uint64_t seed) {
    int victim, t, wrong = 0;
    for (victim = 1; victim < n; victim++)
        for (t = 0; t < trials; t++) wrong += fault_trial_run(via, n, victim, (unsigned)(fault_next(&seed) % FAULT_DELAY_US));
    printf("  %s, world of %d: %d trials (%d per killed rank), %d survivor reports, %d wrong\n",
           world_via_name(via), n, trials * (n - 1), trials, trials * (n - 1) * (n - 1), wrong);
    DT_EQ_INT(wrong, 0);
}

/* 16 trials per killed rank; 5 on the engine, whose survivors fail about 0.7 s after the death
   where direct shm's fail within 0.2 s and TCP's at once (a link that ends mid-frame is blamed
   only after DOPT__BLAME_MS, in case a peer's abort says more): the same checks in less time. */
static void fault_worlds(world_via via, int n) { fault_world(via, n, via == WORLD_SHM_ENGINE ? 5 : 16, (uint64_t)n); }

DTEST_WORLDS_RUN(killed_rank_is_named_by_every_survivor, fault_worlds, 3, 4);

DTEST_MAIN()
