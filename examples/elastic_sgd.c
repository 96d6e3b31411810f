/* elastic_sgd.c — local SGD that survives a lost worker. The problem is least_squares.c's
   (min_x (1/2m)‖Ax − b‖², b = Ax*); the driver averages the models every --period steps, with
   elastic set (localsgd.h: ELASTIC). When an average fails because a worker died (or went silent
   for the timeout), the driver has the survivors agree on who is left and averages the round
   over them (or, when one of them had completed an average the others lost, gives every
   survivor that one's state), and returns with its communicator replaced by the survivors'. The
   host then takes the rows of its new shard and goes on from the driver's step. The lost
   worker's rows are redistributed: every survivor's shard grows. A worker started again with
   DOPT_JOIN=1 is taken back at the end of a round: it gets the job's model and step from rank 0
   in its dopt_dp_broadcast, and every rank takes its shard of the larger world. Lines marked
   "distopt" are what a host adds.

       DOPT_ON_PEER_LOST=shrink DOPT_RANK=r DOPT_WORLD_SIZE=4 DOPT_MASTER_PORT=29500 build/elastic_sgd
       DOPT_ON_PEER_LOST=shrink DOPT_JOIN=1 DOPT_MASTER_PORT=29500 build/elastic_sgd   (one comes back)
       (tests/elastic_trials.c starts four, kills one and starts it again: make elastic-test)
       DOPT_TRANSPORT=shm DOPT_SHM_NAME=job7 DOPT_RANK=r DOPT_WORLD_SIZE=4 build/elastic_sgd
       DOPT_TRANSPORT=shm DOPT_SHM_NAME=job7 DOPT_JOIN=1 build/elastic_sgd         (one comes back)
       (the ranks of one host through shared memory: the same, with the job's name for an address)

   Flags: --steps N (default 8000), --period N (4), --step-us N (a compute step's time, slept;
   0), --seed N. Prints, per rank, one line: "elastic_sgd: rank R of N (was rank O of W):
   |x - x*| = D, model <hash>, shrinks K, resumed_ms T, grows G, joined J, state_bytes B,
   state_ms S" (T: the wall clock, in ms since the epoch, when training went on after the last
   shrink, 0 without one; G: joiners taken in, by how many grows; J: 1 on a worker that came
   back; B, S: the last state transfer this rank sent or took). Exits 1 when it did not converge
   (|x - x*| ≥ 1e-3·|x*|) or could not go on. */
#define DISTOPT_IMPLEMENTATION
#include "distopt.h"
#include "transport_tcp.h"
#include "transport_shm.h"
#include "localsgd.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { DIM = 16, ROWS = 4096, BATCH = 4 };

static uint64_t next_random(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float uniform_pm1(uint64_t *s) { return (float)(next_random(s) >> 40) / (float)(1 << 23) - 1.0f; }

static double wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void gradient(const float *A, const float *b, const float *x, size_t begin, size_t end, uint64_t *rng,
                     float *g) {
    int k, j;
    memset(g, 0, DIM * sizeof(float));
    for (k = 0; k < BATCH; k++) {
        size_t i = begin + next_random(rng) % (end - begin);
        float r = -b[i];
        for (j = 0; j < DIM; j++) r += A[i * DIM + j] * x[j];
        for (j = 0; j < DIM; j++) g[j] += r * A[i * DIM + j] / BATCH;
    }
}

static void log_line(void *user, dopt_log_level level, const char *message) { /* the transport's words, on stderr */
    (void)user;
    (void)level;
    fprintf(stderr, "distopt: %s\n", message);
}

int main(int argc, char **argv) {
    static float A[ROWS * DIM], b[ROWS];
    float xstar[DIM], x[DIM], g[DIM];
    long steps = 8000, step, step_us = 0;
    size_t period = 4, begin = 0, end = ROWS;
    unsigned long long seed = 1;
    uint64_t data_rng, rng;
    int i, j, world, old_rank, failed, shrinks, joined;
    double dist = 0, ref = 0, resumed_ms = 0, state_ms;
    size_t state_bytes;
    int grows;
    char detail[DOPT_DETAIL_MAX];
    uint64_t hash;
    dopt_tcp_config base;
    dopt_comm *comm = NULL;
    dopt_dp dp;
    dopt_dp_config cfg;
    dopt_status st = DOPT_OK;

    for (i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--steps") == 0) steps = atol(argv[i + 1]);
        else if (strcmp(argv[i], "--period") == 0) period = (size_t)atol(argv[i + 1]);
        else if (strcmp(argv[i], "--step-us") == 0) step_us = atol(argv[i + 1]);
        else if (strcmp(argv[i], "--seed") == 0) seed = strtoull(argv[i + 1], NULL, 10);
        else {
            fprintf(stderr, "elastic_sgd: unknown flag %s (--steps, --period, --step-us, --seed)\n", argv[i]);
            return 2;
        }
    }
    memset(&base, 0, sizeof base);
    base.on_peer_lost = DOPT_SHRINK; /* distopt: DOPT_ON_PEER_LOST and DOPT_MIN_RANKS may say otherwise */
    base.timeout_ms = 10000;         /* a silent worker is taken for lost after 10 s (DOPT_TIMEOUT_MS) */
    base.log_fn = log_line;
    if (getenv("DOPT_TRANSPORT") && strcmp(getenv("DOPT_TRANSPORT"), "shm") == 0) { /* one host, shared memory */
        dopt_shm_config shm;
        memset(&shm, 0, sizeof shm);
        shm.on_peer_lost = base.on_peer_lost, shm.timeout_ms = base.timeout_ms, shm.log_fn = log_line;
        if (dopt_shm_config_from_env(&shm) != DOPT_OK || dopt_shm_create(&comm, &shm) != DOPT_OK) return 1;
    } else if (dopt_tcp_create_from_env(&comm, &base) != DOPT_OK) {
        return 1;
    }
    world = comm->size;
    old_rank = comm->rank;

    data_rng = seed; /* the same problem on every rank */
    for (j = 0; j < DIM; j++) xstar[j] = uniform_pm1(&data_rng);
    for (i = 0; i < ROWS; i++) {
        b[i] = 0;
        for (j = 0; j < DIM; j++) b[i] += (A[i * DIM + j] = uniform_pm1(&data_rng)) * xstar[j];
    }
    for (j = 0; j < DIM; j++) x[j] = 1.0f;
    rng = dopt_seed_for_rank(seed, comm->rank);

    memset(&cfg, 0, sizeof cfg);
    cfg.period = period; /* distopt: local SGD, models averaged every period steps */
    cfg.elastic = 1;     /* distopt: and a lost worker does not end it */
    dopt_dp_init(&dp, comm, DIM, &cfg);
    joined = dp.joining;
    st = dopt_dp_broadcast(&dp, x); /* distopt: rank 0's model; a worker that came back: the job's state */
    if (dp.comm != comm) {          /* (a member lost while it took it) */
        dopt_comm_destroy(comm);
        comm = dp.comm;
    }
    while (st == DOPT_OK && (step = (long)dp.step) < steps) { /* distopt: the driver's step (a survivor may move on) */
        dopt_shard(ROWS, comm->rank, comm->size, &begin, &end); /* distopt: this rank's rows, in this world */
        gradient(A, b, x, begin, end, &rng, g);
        if (step_us > 0) {
            struct timespec ts = {0, step_us * 1000L};
            nanosleep(&ts, NULL);
        }
        for (j = 0; j < DIM; j++) x[j] -= 0.05f * g[j];
        st = dopt_dp_after_step(&dp, x); /* distopt: the model average when due */
        if (dp.comm != comm) {           /* distopt: a worker was lost, or one came back */
            int grew = dp.comm->size > comm->size;
            fprintf(stderr, "elastic_sgd: rank %d: %s at step %ld; going on as rank %d of %d\n", comm->rank,
                    grew ? "took a worker back" : "lost a worker", step, dp.comm->rank, dp.comm->size);
            dopt_comm_destroy(comm);
            comm = dp.comm;
            if (!grew) resumed_ms = wall_ms();
        }
        if (st != DOPT_OK) break;
    }
    shrinks = (int)dp.shrinks;
    grows = (int)dp.grows;
    state_bytes = dp.state_bytes;
    state_ms = dp.state_ms;
    snprintf(detail, sizeof detail, "%s", st != DOPT_OK ? dopt_dp_detail(&dp) : "");
    if (st == DOPT_OK) st = dopt_dp_close(&dp, x); /* distopt: the last round averaged, replicas checked */
    else
        dopt_dp_free(&dp);
    for (j = 0; j < DIM; j++) {
        dist += (double)(x[j] - xstar[j]) * (x[j] - xstar[j]);
        ref += (double)xstar[j] * xstar[j];
    }
    dist = sqrt(dist);
    ref = sqrt(ref);
    hash = 14695981039346656037ull; /* FNV-1a of the model's bytes: equal on every replica */
    for (i = 0; i < (int)sizeof x; i++) hash = (hash ^ ((const unsigned char *)x)[i]) * 1099511628211ull;
    failed = st != DOPT_OK || !(dist < 1e-3 * ref);
    printf("elastic_sgd: rank %d of %d (was rank %d of %d): |x - x*| = %.3g, model %016llx, shrinks %d, "
           "resumed_ms %.1f, grows %d, joined %d, state_bytes %zu, state_ms %.3f%s%s\n",
           comm->rank, comm->size, old_rank, world, dist, (unsigned long long)hash, shrinks, resumed_ms, grows, joined,
           state_bytes, state_ms, failed ? ", FAILED: " : "",
           st != DOPT_OK ? (detail[0] ? detail : dopt_comm_detail(comm)) : failed ? "not converged" : "");
    fflush(stdout);
    return dopt_comm_finish(comm, failed);
}
