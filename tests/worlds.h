/* worlds.h — run a test body on every rank of a real multi-process world, over shared memory or
   TCP on loopback, each rank creating its communicator the way a user would. Include after
   dtest.h, transport_shm.h and transport_tcp.h.

   world_run(via, n, body, arg)   forks n processes; rank r creates its communicator (shm: by a
                                  unique job name, WORLD_SHM_ENGINE with every collective on
                                  the engine over shm's links; TCP: rank 0 listens on a port the kernel picks
                                  and hands it to the others through a pipe), runs body(comm,
                                  arg), ends it with dopt_comm_finish. Fails the test when a rank
                                  fails or outlives the budget (100 s).
   world_run_sizes(via, lo, hi, body, arg)   the same for every world size lo..hi. */
#ifndef DOPT_TEST_WORLDS_H
#define DOPT_TEST_WORLDS_H

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef enum world_via { WORLD_SHM, WORLD_SHM_ENGINE, WORLD_TCP } world_via;
typedef void (*world_body)(dopt_comm *c, void *arg);

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

#endif
