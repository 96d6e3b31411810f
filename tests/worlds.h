/* worlds.h — run a test body on every rank of a real multi-process world, over every transport the
   harness knows, each rank creating its communicator the way a user would. Include after dtest.h,
   transport_shm.h and transport_tcp.h.

   A multi-rank test is written once, as a body, and registered by one line:

       static void body_global_norm(dopt_comm *c, void *arg) { ... every rank runs this ... }
       DTEST_WORLDS(global_norm_is_bitwise_equal_on_every_rank, body_global_norm, NULL, 2, 4);

   registers one test per transport, named <transport>_<name>: shm_global_norm_is_..., where the
   collectives run directly on the shared segment; shm_engine_global_norm_is_..., where every
   collective runs on the engine over shm's per-pair links; tcp_global_norm_is_..., over TCP on
   loopback. Each runs the body in a fresh world of every size 2..4 on its transport, so that
   `./test_clip global_norm` runs all three, `./test_clip tcp_global_norm` one (and a filter
   `shm_` both shm's). A new transport added here reaches every such test. A body checks what
   must hold on every transport (bits, results, statuses, calls counted by c->traffic), never
   what one backend happens to do.

   DTEST_WORLDS(name, body, arg, lo, hi)        body(comm, arg) at world sizes lo..hi, per transport.
   DTEST_WORLDS_EACH(name, body, args, lo, hi)  the same for every element of the array args (a
                                                fresh world each: a case may poison its world).
   DTEST_WORLDS_ON(name, body, arg, lo, hi, mask), DTEST_WORLDS_EACH_ON(..., mask)
                                                only on the transports of mask (WORLD_MASK_SHM,
                                                WORLD_MASK_SHM_ENGINE, WORLD_MASK_TCP): for a body
                                                that cannot run on the others; say why beside it.
   DTEST_WORLDS_RUN(name, run, lo, hi)          run(via, n) per transport and size n = lo..hi, for
                                                a test that starts its worlds itself (test_faults.c
                                                kills ranks in them).
   DTEST_WORLDS_RUN_ON(name, run, lo, hi, mask) the same on the transports of mask only.
   arg (args) is an expression valid at file scope: NULL, or the address of a file-scope object.

   The lower layer:
   world_run(via, n, body, arg)   forks n processes; rank r creates its communicator (WORLD_SHM: by
                                  a unique job name; WORLD_SHM_ENGINE the same with every
                                  collective on the engine over shm's links; WORLD_TCP: rank 0
                                  listens on a port the kernel picks and hands it to the others
                                  through a pipe), runs body(comm, arg), ends it with
                                  dopt_comm_finish. Fails the test when a rank fails or outlives
                                  the budget (100 s).
   world_run_sizes(via, lo, hi, body, arg)   the same for every world size lo..hi.
   world_same_on_every_rank(c, x, bytes)   1 when every rank holds rank 0's bytes (an allgather).
   world_tmpdir(c, dir, cap), world_tmpdir_remove(c, dir)   a directory every rank of c shares
                                  (made by rank 0, its name broadcast), and its removal. */
#ifndef DOPT_TEST_WORLDS_H
#define DOPT_TEST_WORLDS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef enum world_via { WORLD_SHM, WORLD_SHM_ENGINE, WORLD_TCP, WORLD_NVIA } world_via;
#define WORLD_MASK_SHM (1u << WORLD_SHM)
#define WORLD_MASK_SHM_ENGINE (1u << WORLD_SHM_ENGINE)
#define WORLD_MASK_TCP (1u << WORLD_TCP)
#define WORLD_MASK_ALL (WORLD_MASK_SHM | WORLD_MASK_SHM_ENGINE | WORLD_MASK_TCP)
typedef void (*world_body)(dopt_comm *c, void *arg);
typedef void (*world_runner)(world_via via, int n);

typedef struct world {
    world_via via;
    int n;
    char shm_name[96];
    int port_pipe[2];
    world_body body;
    void *arg;
} world;

static void world_on_listen(void *user, int port) {
    world *w = (world *)user;
    int i;
    for (i = 1; i < w->n; i++) dtest_write_int(w->port_pipe[1], port);
}

static dopt_comm *world_join(world *w, int rank) {
    dopt_comm *c = NULL;
    if (w->via == WORLD_SHM || w->via == WORLD_SHM_ENGINE) {
        dopt_shm_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.name = w->shm_name;
        cfg.rank = rank;
        cfg.size = w->n;
        cfg.timeout_ms = 30000;
        cfg.engine = w->via == WORLD_SHM_ENGINE;
        DT_OK(dopt_shm_create(&c, &cfg));
    } else {
        dopt_tcp_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.rank = rank;
        cfg.world_size = w->n;
        cfg.timeout_ms = 30000;
        cfg.token = "distopt-test";
        if (rank == 0) {
            cfg.on_listen = world_on_listen;
            cfg.on_listen_user = w;
        } else {
            cfg.master_port = dtest_read_int(w->port_pipe[0], "rank 0's port");
        }
        DT_OK(dopt_tcp_create(&c, &cfg));
    }
    DT_CHECK(c != NULL && c->rank == rank && c->size == w->n);
    return c;
}

static void world_rank(int rank, void *arg) {
    world *w = (world *)arg;
    dopt_comm *c = world_join(w, rank);
    w->body(c, w->arg);
    DT_EQ_INT(dopt_comm_finish(c, 0), 0); /* a rank a launcher started: destroys, returns the status */
}

__attribute__((unused)) static void world_run(world_via via, int n, world_body body, void *arg) {
    world w;
    struct timespec ts;
    memset(&w, 0, sizeof w);
    w.via = via;
    w.n = n;
    w.body = body;
    w.arg = arg;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    snprintf(w.shm_name, sizeof w.shm_name, "dtest-%d-%lld", (int)getpid(), (long long)ts.tv_nsec);
    DT_CHECK(pipe(w.port_pipe) == 0);
    DT_EQ_INT(dtest_spawn(n, world_rank, &w, 100), 0);
    close(w.port_pipe[0]);
    close(w.port_pipe[1]);
}

__attribute__((unused)) static void world_run_sizes(world_via via, int lo, int hi, world_body body, void *arg) {
    int n;
    for (n = lo; n <= hi; n++) world_run(via, n, body, arg);
}

/* A directory every rank of c shares: rank 0 makes it, every rank gets its name. */
__attribute__((unused)) static void world_tmpdir(dopt_comm *c, char *dir, size_t cap) {
    char name[128];
    memset(name, 0, sizeof name);
    if (c->rank == 0) {
        snprintf(name, sizeof name, "/tmp/dtest-world-XXXXXX");
        DT_CHECK(mkdtemp(name) != NULL);
    }
    DT_OK(dopt_broadcast(c, name, sizeof name, 0));
    DT_CHECK(strlen(name) < cap);
    snprintf(dir, cap, "%s", name);
}

/* After every rank is done with it (a barrier), rank 0 removes it and what it holds. */
__attribute__((unused)) static void world_tmpdir_remove(dopt_comm *c, const char *dir) {
    char cmd[256];
    DT_OK(dopt_barrier(c));
    if (c->rank != 0) return;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    DT_CHECK(system(cmd) == 0);
}

/* 1 when every rank of c holds the same bytes x[0..bytes) as rank 0 (an allgather). */
__attribute__((unused)) static int world_same_on_every_rank(dopt_comm *c, const void *x, size_t bytes) {
    unsigned char *all = (unsigned char *)malloc(bytes * (size_t)c->size + 1);
    int r, same = 1;
    DT_CHECK(all != NULL);
    DT_OK(dopt_allgather(c, x, all, bytes));
    for (r = 1; r < c->size; r++)
        if (memcmp(all, all + (size_t)r * bytes, bytes) != 0) same = 0;
    free(all);
    return same;
}

/* ------------------------------------------------------------------ one line, every transport */

static const char *const world_via_names[WORLD_NVIA] = {"shm", "shm_engine", "tcp"};

__attribute__((unused)) static const char *world_via_name(world_via via) {
    return (unsigned)via < WORLD_NVIA ? world_via_names[via] : "?";
}

/* One registered test: a body over one transport at sizes lo..hi, once per case. */
typedef struct world_test {
    world_via via;
    world_runner run; /* or, for DTEST_WORLDS_RUN, run(via, n) starts the worlds itself */
    world_body body;
    char *args;      /* the cases, arg_size bytes apart */
    size_t arg_size; /* 0: one case, args itself */
    size_t nargs;
    int lo, hi;
} world_test;

__attribute__((unused)) static void world_test_run(const void *p) {
    const world_test *t = (const world_test *)p;
    int n;
    size_t k;
    for (n = t->lo; n <= t->hi; n++)
        if (t->run != NULL)
            t->run(t->via, n);
        else
            for (k = 0; k < t->nargs; k++) /* no arithmetic on a NULL argument (UBSan: a zero offset) */
                world_run(t->via, n, t->body, t->args ? t->args + k * t->arg_size : NULL);
}

/* Fills one world_test per transport of mask and registers them, named by the names given. */
__attribute__((unused)) static void world_register(world_test *tests, const char *const *names, unsigned mask,
                                                   world_runner run, world_body body, void *args, size_t arg_size,
                                                   size_t nargs, int lo, int hi) {
    int v;
    for (v = 0; v < WORLD_NVIA; v++) {
        if (!(mask & (1u << v))) continue;
        tests[v].via = (world_via)v;
        tests[v].run = run;
        tests[v].body = body;
        tests[v].args = (char *)args;
        tests[v].arg_size = arg_size;
        tests[v].nargs = nargs;
        tests[v].lo = lo;
        tests[v].hi = hi;
        dtest_register_arg(names[v], world_test_run, &tests[v]);
    }
}

#define DTEST_WORLDS__(name, run, body, args, arg_size, nargs, lo, hi, mask)                       \
    static world_test name##_worlds[WORLD_NVIA];                                                   \
    __attribute__((constructor)) static void name##_worlds_register(void) {                        \
        static const char *const names[WORLD_NVIA] = {"shm_" #name, "shm_engine_" #name, "tcp_" #name}; \
        world_register(name##_worlds, names, (mask), (run), (body), (void *)(args), (arg_size), (nargs), (lo), (hi)); \
    }                                                                                              \
    typedef int name##_worlds_semicolon

#define DTEST_WORLDS_ON(name, body, arg, lo, hi, mask) DTEST_WORLDS__(name, NULL, body, arg, 0, 1, lo, hi, mask)
#define DTEST_WORLDS(name, body, arg, lo, hi) DTEST_WORLDS_ON(name, body, arg, lo, hi, WORLD_MASK_ALL)
#define DTEST_WORLDS_EACH_ON(name, body, args, lo, hi, mask)                                       \
    DTEST_WORLDS__(name, NULL, body, args, sizeof((args)[0]), sizeof(args) / sizeof((args)[0]), lo, hi, mask)
#define DTEST_WORLDS_EACH(name, body, args, lo, hi) DTEST_WORLDS_EACH_ON(name, body, args, lo, hi, WORLD_MASK_ALL)
#define DTEST_WORLDS_RUN_ON(name, run, lo, hi, mask) DTEST_WORLDS__(name, run, NULL, NULL, 0, 1, lo, hi, mask)
#define DTEST_WORLDS_RUN(name, run, lo, hi) DTEST_WORLDS_RUN_ON(name, run, lo, hi, WORLD_MASK_ALL)

#endif
