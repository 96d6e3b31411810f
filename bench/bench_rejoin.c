/* bench_rejoin.c — how fast a worker taken back gets the job's state, against the link.

   A job of 2 members runs local SGD through the elastic driver (localsgd.h: ELASTIC) over TCP on
   loopback, with a model of MB megabytes (default 32); a third process starts with join = 1, the
   members take it in at the end of a round, and rank 0 sends it the job's state
   (dopt__dp_share: the model and counters). The joiner's dp.state_ms and dp.state_bytes give
   the transfer's rate; the limit is a raw TCP stream of the same bytes on loopback between two
   processes (on a connection warmed up by an eighth of them: write them all, a one-byte answer
   once they are read), measured in the same run, right before each job. Median of REPS (3) pairs. Prints

       bench rejoin state_MB=S state_MBps=R link_MBps=L ratio=R/L lead_MBps=M reps=3

   (lead_MBps: the same transfer as rank 0 timed it). The goal is ratio >= 0.8.
   With shm, the job runs over shared memory (transport_shm.h: the joiner asks in the job's join
   box) and the limit is the shm transport's own: a dopt_broadcast of the same bytes between two
   processes of a job of 2 (warmed up by an eighth of them, then the bytes and a barrier); the
   line then adds transport=shm.
   Usage: bench_rejoin [MB] [shm] */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_tcp.h"
#include "../transport_shm.h"
#include "../localsgd.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define REPS 3
#define MEMBERS 2

static size_t model_floats;
static int shm;               /* 1: over shared memory */
static char shm_name[64];     /* the job's name there (a fresh one per job) */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void die(const char *what) {
    fprintf(stderr, "bench_rejoin: %s\n", what);
    _exit(1);
}

#define CHUNK (256u << 10) /* the raw stream's writes and reads */

static void write_all(int fd, const void *p, size_t n) {
    const char *c = (const char *)p;
    while (n) {
        ssize_t k = write(fd, c, n < CHUNK ? n : CHUNK);
        if (k <= 0) die("write failed");
        c += k;
        n -= (size_t)k;
    }
}

static void read_all(int fd, void *p, size_t n) {
    char *c = (char *)p;
    while (n) {
        ssize_t k = read(fd, c, n < CHUNK ? n : CHUNK);
        if (k <= 0) die("read failed");
        c += k;
        n -= (size_t)k;
    }
}

/* The limit: bytes over a fresh loopback TCP connection to another process; MB/s. */
static double raw_stream(size_t bytes) {
    struct sockaddr_in sa;
    socklen_t len = sizeof sa;
    int lfd = socket(AF_INET, SOCK_STREAM, 0), fd;
    char *buf = (char *)calloc(bytes, 1), ack = 1;
    pid_t pid;
    double t0, t1;
    if (lfd < 0 || buf == NULL) die("no socket or memory");
    memset(buf, 1, bytes); /* touched: the link is measured, not first-touch page faults */
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(lfd, 1) != 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &len) != 0)
        die("cannot listen on loopback");
    pid = fork();
    if (pid == 0) { /* the reader: a warm-up, then the stream */
        int c, k;
        buf = (char *)malloc(bytes); /* its own, touched: the parent's pages would be copied on write */
        if (buf == NULL) die("no memory");
        memset(buf, 2, bytes);
        c = accept(lfd, NULL, NULL);
        if (c < 0) die("accept failed");
        for (k = 0; k < 2; k++) {
            read_all(c, buf, k ? bytes : bytes / 8);
            write_all(c, &ack, 1);
        }
        close(c);
        _exit(0);
    }
    close(lfd);
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) die("cannot connect");
    write_all(fd, buf, bytes / 8); /* the connection warmed up: its window open */
    read_all(fd, &ack, 1);
    t0 = dopt__now_ms();
    write_all(fd, buf, bytes);
    read_all(fd, &ack, 1);
    t1 = dopt__now_ms();
    close(fd);
    waitpid(pid, NULL, 0);
    free(buf);
    return (double)bytes / 1e3 / (t1 - t0);
}

/* The limit over shared memory: a broadcast of the same bytes in a job of 2; MB/s. */
static double raw_shm(size_t bytes) {
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    char *buf;
    double t0 = 0, t1;
    int k, status, rank;
    pid_t pid;
    static int jobs;
    memset(&cfg, 0, sizeof cfg);
    snprintf(shm_name, sizeof shm_name, "bench-rejoin-link-%d-%d", (int)getpid(), jobs++);
    cfg.name = shm_name, cfg.size = 2, cfg.timeout_ms = 60000;
    pid = fork();
    rank = pid == 0;
    buf = (char *)malloc(bytes); /* after the fork, touched: no page copied on write is timed */
    if (buf == NULL) die("no memory");
    memset(buf, 1 + rank, bytes);
    cfg.rank = rank;
    if (dopt_shm_create(&c, &cfg) != DOPT_OK) die("cannot create the shm communicator");
    for (k = 0; k < 2; k++) {
        if (k) t0 = dopt__now_ms();
        if (dopt_broadcast(c, buf, k ? bytes : bytes / 8, 0) != DOPT_OK || dopt_barrier(c) != DOPT_OK)
            die("the shm broadcast failed");
    }
    t1 = dopt__now_ms();
    dopt_comm_destroy(c);
    free(buf);
    if (rank == 1) _exit(0);
    waitpid(pid, &status, 0);
    return (double)bytes / 1e3 / (t1 - t0);
}

typedef struct report {
    double joiner_ms, lead_ms;
    size_t bytes;
    int ok;
} report;

/* A member (rank < MEMBERS) or the joiner: local SGD (a step that moves every coordinate a little),
   averaged every 4 steps, until the joiner came in and a few rounds more. */
static void on_listen(void *user, int port) {
    int *fds = (int *)user, k;
    for (k = 0; k < MEMBERS; k++) write_all(fds[1], &port, sizeof port); /* rank 1 and the joiner */
}

static void worker(int rank, int *port_pipe, int report_fd) {
    dopt_tcp_config cfg;
    dopt_comm *c = NULL;
    dopt_dp dp;
    dopt_dp_config dc;
    float *x = (float *)malloc(model_floats * sizeof(float));
    report rep;
    size_t i;
    int port = 0;
    dopt_status s;
    memset(&cfg, 0, sizeof cfg);
    memset(&rep, 0, sizeof rep);
    if (x == NULL) die("no memory for the model");
    for (i = 0; i < model_floats; i++) x[i] = (float)(i % 97);
    cfg.token = "bench-rejoin";
    cfg.on_peer_lost = DOPT_SHRINK;
    cfg.timeout_ms = 60000;
    cfg.rendezvous_timeout_ms = 60000;
    cfg.join = rank == MEMBERS;
    cfg.rank = rank;
    cfg.world_size = MEMBERS;
    if (shm) { /* the job's name; the joiner asks in its join box */
        dopt_shm_config sc;
        memset(&sc, 0, sizeof sc);
        sc.name = shm_name, sc.rank = rank < MEMBERS ? rank : 0, sc.size = MEMBERS, sc.timeout_ms = 60000;
        sc.on_peer_lost = DOPT_SHRINK, sc.join = rank == MEMBERS;
        if (dopt_shm_create(&c, &sc) != DOPT_OK) die("cannot create the shm communicator");
    } else {
        if (rank == 0) {
            cfg.on_listen = on_listen;
            cfg.on_listen_user = port_pipe;
        } else {
            read_all(port_pipe[0], &port, sizeof port);
            cfg.master_port = port;
        }
        if (dopt_tcp_create(&c, &cfg) != DOPT_OK) die("cannot create the communicator");
    }
    memset(&dc, 0, sizeof dc);
    dc.period = 4;
    dc.elastic = 1;
    if (dopt_dp_init(&dp, c, model_floats, &dc) != DOPT_OK) die(dopt_dp_detail(&dp));
    s = dopt_dp_broadcast(&dp, x);
    rep.joiner_ms = dp.joining ? -1 : 0;
    while (s == DOPT_OK && (dp.grows == 0 && rank < MEMBERS)) {
        x[dp.step % model_floats] += 1e-3f;
        s = dopt_dp_after_step(&dp, x);
        if (dp.comm != c) {
            dopt_comm_destroy(c);
            c = dp.comm;
        }
    }
    rep.ok = s == DOPT_OK;
    rep.bytes = dp.state_bytes;
    if (rank == 0) rep.lead_ms = dp.state_ms;
    if (rank == MEMBERS) rep.joiner_ms = dp.state_ms;
    if (s == DOPT_OK) s = dopt_barrier(c);
    rep.ok = rep.ok && s == DOPT_OK;
    if (rank != 1) write_all(report_fd, &rep, sizeof rep);
    dopt_dp_free(&dp);
    dopt_comm_destroy(c);
    free(x);
    _exit(rep.ok ? 0 : 1);
}

/* One job with a joiner: the joiner's and rank 0's transfer times (ms) and the bytes. */
static int one_job(double *joiner_ms, double *lead_ms, size_t *bytes) {
    int port_pipe[2], report_pipe[2], r, status, ok = 1;
    pid_t pids[MEMBERS + 1];
    report a, b;
    static int jobs;
    snprintf(shm_name, sizeof shm_name, "bench-rejoin-%d-%d", (int)getpid(), jobs++);
    if (pipe(port_pipe) != 0 || pipe(report_pipe) != 0) die("no pipe");
    for (r = 0; r <= MEMBERS; r++) {
        pids[r] = fork();
        if (pids[r] == 0) worker(r, port_pipe, report_pipe[1]);
    }
    close(report_pipe[1]);
    read_all(report_pipe[0], &a, sizeof a);
    read_all(report_pipe[0], &b, sizeof b);
    for (r = 0; r <= MEMBERS; r++) {
        waitpid(pids[r], &status, 0);
        ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    close(report_pipe[0]);
    close(port_pipe[0]);
    close(port_pipe[1]);
    if (a.joiner_ms == 0) {
        report t = a;
        a = b;
        b = t;
    }
    *joiner_ms = a.joiner_ms;
    *lead_ms = b.lead_ms;
    *bytes = a.bytes;
    return ok && a.ok && b.ok && a.joiner_ms > 0;
}

int main(int argc, char **argv) {
    double mb = argc > 1 ? atof(argv[1]) : 32.0, state[REPS], link[REPS], lead[REPS], ratio[REPS];
    size_t bytes = 0;
    int k;
    signal(SIGPIPE, SIG_IGN);
    shm = argc > 2 && strcmp(argv[2], "shm") == 0;
    if (!(mb > 0) || (argc > 2 && !shm)) die("usage: bench_rejoin [MB] [shm]");
    model_floats = (size_t)(mb * 1e6 / sizeof(float));
    for (k = 0; k < REPS; k++) {
        double jm, lm;
        link[k] = shm ? raw_shm(model_floats * sizeof(float)) : raw_stream(model_floats * sizeof(float));
        if (!one_job(&jm, &lm, &bytes)) die("a job with a joiner failed");
        state[k] = (double)bytes / 1e3 / jm;
        lead[k] = (double)bytes / 1e3 / lm;
        ratio[k] = state[k] / link[k];
    }
    qsort(state, REPS, sizeof(double), cmp_double);
    qsort(link, REPS, sizeof(double), cmp_double);
    qsort(lead, REPS, sizeof(double), cmp_double);
    qsort(ratio, REPS, sizeof(double), cmp_double);
    printf("bench rejoin state_MB=%.1f state_MBps=%.0f link_MBps=%.0f ratio=%.2f lead_MBps=%.0f reps=%d%s\n",
           (double)bytes / 1e6, state[REPS / 2], link[REPS / 2], ratio[REPS / 2], lead[REPS / 2], REPS,
           shm ? " transport=shm" : "");
    return 0;
}
