/* least_squares.c — distopt's quick start: minibatch SGD on min_x (1/2m)‖Ax − b‖² with b = Ax*,
   so the optimum x* is known and every method should reach it. A plain C SGD loop; the lines
   marked "distopt" are all a host adds.

       build/least_squares --transport shm --workers 2 --compress ternary
       build/least_squares --transport shm --workers 4 --celgc 0.05,1.0 --period 4
       build/least_squares --transport self

   Prints the distance to x*, and exits 1 when it is not below 1e-3·‖x*‖. */
#define DISTOPT_IMPLEMENTATION
#include "distopt.h"
#include "transport_shm.h"
#include "transport_tcp.h"
#include "localsgd.h" /* brings clip.h and compress.h */
#include "common.h"

#include <math.h>

enum { DIM = 16, ROWS = 1024, BATCH = 4 };

static uint64_t next_random(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float uniform_pm1(uint64_t *s) { return (float)(next_random(s) >> 40) / (float)(1 << 23) - 1.0f; }

/* The mean gradient of BATCH rows drawn from [begin, end): (1/B) Σ a_i (a_i·x − b_i). */
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

int main(int argc, char **argv) {
    options o = {NULL, 0, "none", 0, 0, 0, 1, 1, 3000, 0, 0, 0.05f, 0, "off", NULL, 0, 0, 0, 0, NULL, 0, 0, 0, 0, NULL, NULL, 0};
    static float A[ROWS * DIM], b[ROWS];
    float xstar[DIM], x[DIM] = {0}, g[DIM];
    uint64_t data_rng, rng;
    size_t begin, end, i;
    long step;
    int j, failed = 0;
    double dist = 0, ref = 0;
    dopt_comm *comm;
    int compress;
    dopt_compressor cz;
    dopt_compressor_config ccfg;
    dopt_dp ls;
    dopt_dp_config lcfg;
    dopt_segment seg = {0, DIM, "x", 0};
    dopt_status st = DOPT_OK;
    uint64_t messages = 0; /* gradient or model averages */

    parse_options(&o, argc, argv);
    if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1; /* distopt: one process per rank from here on */

    data_rng = o.seed; /* the same problem on every rank */
    for (j = 0; j < DIM; j++) xstar[j] = uniform_pm1(&data_rng);
    for (i = 0; i < ROWS; i++) {
        b[i] = 0;
        for (j = 0; j < DIM; j++) b[i] += (A[i * DIM + j] = uniform_pm1(&data_rng)) * xstar[j];
    }
    for (j = 0; j < DIM; j++) x[j] = 1.0f; /* rank 0's start wins: see the broadcast */
    dopt_shard(ROWS, comm->rank, comm->size, &begin, &end); /* distopt: this rank's rows */
    rng = dopt_seed_for_rank(o.seed, comm->rank);

    /* distopt: synchronous steps average the gradients (fp32, or TernGrad-style compressed);
       local steps average the models every --period steps (deltas compressed with --compress).
       Check once: a refusal here comes back from every later call of the driver and from
       dopt_dp_close, so the loop tests one status per step. */
    compress = method_configs(&o, &cz, &ccfg, &lcfg);
    if (compress) dopt_compressor_init(&cz, &ccfg, &seg, 1);
    dopt_dp_init(&ls, comm, DIM, &lcfg);
    dopt_dp_broadcast(&ls, x);

    for (step = 0; step < o.steps && st == DOPT_OK; step++) {
        gradient(A, b, x, begin, end, &rng, g);
        if (dopt_dp_should_sync(&ls, (uint64_t)step)) messages++;
        if (o.celgc) { /* distopt: x -= min(η, γ/‖g‖)·g, and the average when due */
            st = dopt_dp_celgc_step(&ls, &(dopt_buf){.data = x, .n = DIM}, &(dopt_buf){.data = g, .n = DIM},
                                    &(dopt_celgc){.eta = o.celgc_eta, .gamma = o.celgc_gamma});
            continue;
        }
        dopt_dp_after_backward(&ls, g); /* distopt: the mean (fp32 or compressed) on synchronous steps */
        for (j = 0; j < DIM; j++) x[j] -= o.lr * g[j];
        st = dopt_dp_after_step(&ls, x); /* distopt: model average when due */
    }
    failed = dopt_dp_close(&ls, x) != DOPT_OK || st != DOPT_OK; /* distopt: the last round averaged, replicas checked */

    for (j = 0; j < DIM; j++) {
        dist += (double)(x[j] - xstar[j]) * (x[j] - xstar[j]);
        ref += (double)xstar[j] * xstar[j];
    }
    dist = sqrt(dist);
    ref = sqrt(ref);
    if (!failed && !(dist < 1e-3 * ref)) failed = 1;
    if (comm->rank == 0)
        printf("least_squares: %s, %d rank(s), compress %s, %s, period %zu: |x - x*| = %.3g (|x*| = %.3g) after %ld "
               "steps; %llu averaging rounds (%llu collectives), %llu bytes of gradient/model messages sent per rank; %s\n",
               comm->vt->name, comm->size, o.compress, o.celgc ? "celgc" : "sgd", o.period, dist, ref, step,
               (unsigned long long)messages, (unsigned long long)comm->seq,
               (unsigned long long)(comm->size == 1 ? 0 : messages * (compress ? dopt_compress_bound(&cz) : DIM * sizeof(float))),
               failed ? "NOT CONVERGED" : "converged");

    if (compress) dopt_compressor_free(&cz);
    return dopt_comm_finish(comm, failed); /* distopt: other ranks exit; rank 0 gets the job's status; a failure's
                                              detail is printed */
}
