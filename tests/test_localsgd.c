/* Tests of localsgd.h: the averaging schedule; least squares with a known optimum reached by local
   SGD at periods 1, 4 and 16 over real processes on every transport of worlds.h (shared memory
   direct and on the engine, TCP: every multi-rank test below runs on all three), with replicas
   bitwise identical after every average and each extra state buffer treated by its policy;
   CELGC against a hand-written reference loop (periods 4 and 1), and on a quartic where
   fixed-step SGD diverges; DiLoCo's outer Nesterov step by hand, plain averaging bit for bit, on compressed
   pseudo-gradients; the batch-size tests against values computed by hand, the within-worker
   variance at one iterate (zero without noise under drift, known noise within a confidence
   interval, ‖∇F‖² unbiased), both projections against a double-precision reference, history,
   both variance estimators, the decision identical on every rank; the replica check; gradient
   averages of a flat buffer (in place, the workspace untouched) bitwise equal to those of a
   scatter list (packed); a run saved at step k and resumed, bitwise equal to the uninterrupted
   run; corrupt and mismatched state files refused. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "../clip.h"
#include "../compress.h"
#include "../localsgd.h"
#include "dtest.h"
#include "worlds.h"

#include <stdint.h>
#include <sys/stat.h>

/* ------------------------------------------------------------------ worlds of processes */

/* The flat arrays of these tests as the descriptors the replica check and the batch controller
   take. */
static dopt_status check_flat(dopt_dp *ls, const float *x, int *identical, double *max_diff) {
    dopt_buf b = dopt_buf_flat((float *)x, ls->n, NULL, 0); /* only read */
    return dopt_dp_check_replicas(ls, &b, identical, max_diff);
}

static dopt_status observe_flat(dopt_batch *bc, const float *g, size_t n) {
    dopt_buf b = dopt_buf_flat((float *)g, n, NULL, 0); /* only read */
    return dopt_batch_observe(bc, &b, 1.0f);
}

/* ------------------------------------------------------------------ least squares with a known optimum */

#define LS_D 16
#define LS_M 256
#define LS_BATCH 8

typedef struct lsq {
    float a[LS_M][LS_D];
    float b[LS_M];
    float xstar[LS_D];
} lsq;

/* A consistent system A x* = b: SGD converges to x* exactly (no noise at the optimum). */
static void lsq_make(lsq *p) {
    dopt_rng rng;
    int i, j;
    dopt_rng_init(&rng, 1234, 0, 0);
    dopt_rng_uniform(&rng, 0, &p->a[0][0], LS_M * LS_D);
    dopt_rng_uniform(&rng, LS_M * LS_D, p->xstar, LS_D);
    for (i = 0; i < LS_M; i++) {
        double s = 0.0;
        for (j = 0; j < LS_D; j++) {
            p->a[i][j] = 2.0f * p->a[i][j] - 1.0f;
            s += (double)p->a[i][j] * p->xstar[j];
        }
        p->b[i] = (float)s;
    }
    for (j = 0; j < LS_D; j++) p->xstar[j] = 4.0f * p->xstar[j] - 2.0f;
    for (i = 0; i < LS_M; i++) {
        double s = 0.0;
        for (j = 0; j < LS_D; j++) s += (double)p->a[i][j] * p->xstar[j];
        p->b[i] = (float)s;
    }
}

/* The mean gradient of `rows` rows of this rank's shard, picked by the rank's own generator at
   counter `ctr`: a pure function of (seed, rank, ctr), so two runs see the same batches. */
static void lsq_grad(const lsq *p, const float *x, float *g, int rank, int size, uint64_t ctr, int rows) {
    size_t begin, end, i;
    uint32_t pick[64];
    dopt_rng rng;
    int r, j;
    DT_OK(dopt_shard(LS_M, rank, size, &begin, &end));
    dopt_rng_init(&rng, dopt_seed_for_rank(99, rank), rank, 1);
    dopt_rng_u32(&rng, ctr * 64, pick, (size_t)rows);
    for (j = 0; j < LS_D; j++) g[j] = 0.0f;
    for (r = 0; r < rows; r++) {
        size_t row = begin + pick[r] % (end - begin);
        double res = -(double)p->b[row];
        for (i = 0; i < LS_D; i++) res += (double)p->a[row][i] * x[i];
        for (j = 0; j < LS_D; j++) g[j] += (float)(res * p->a[row][j] / rows);
    }
}

static double dist_to(const float *x, const float *y, size_t n) {
    double s = 0.0;
    size_t i;
    for (i = 0; i < n; i++) s += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
    return sqrt(s);
}

/* x equals a reference loop written beside the test, bit for bit. The suite also builds with
   -Ofast and -ffast-math, where the compiler may contract or reorder the reference and the
   library differently: there they agree within 2^-16 relative. */
static int same_as_reference(const float *x, const float *ref, size_t n) {
#ifdef __FAST_MATH__
    size_t i;
    for (i = 0; i < n; i++)
        if (!dopt__is_finite(x[i]) || fabs((double)x[i] - (double)ref[i]) > (1.0 + fabs((double)ref[i])) / 65536.0)
            return 0;
    return 1;
#else
    return memcmp(x, ref, n * sizeof(float)) == 0;
#endif
}

/* ------------------------------------------------------------------ schedule and helpers (one process) */

DTEST(schedule_averages_every_warmup_step_then_every_period) {
    dopt_comm *c;
    dopt_dp ls;
    dopt_dp_config cfg;
    uint64_t t;
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    cfg.warmup_steps = 3;
    DT_OK(dopt_comm_create_self(&c));
    DT_OK(dopt_dp_init(&ls, c, 4, &cfg));
    for (t = 0; t < 40; t++) {
        int want = t < 3 || (t + 1 - 3) % 4 == 0;
        DT_EQ_INT(dopt_dp_should_sync(&ls, t), want);
        DT_EQ_INT(dopt_dp_is_synchronous(&ls, t), t < 3);
    }
    DT_EQ_INT(dopt_dp_should_sync(&ls, 6), 1); /* after warm-up: steps 6, 10, 14, ... */
    dopt_dp_free(&ls);
    /* No warm-up: the average at the end of step kI - 1 is the reference's at the start of kI. */
    cfg.warmup_steps = 0;
    cfg.period = 8;
    DT_OK(dopt_dp_init(&ls, c, 4, &cfg));
    for (t = 0; t < 100; t++) DT_EQ_INT(dopt_dp_should_sync(&ls, t), (t + 1) % 8 == 0);
    dopt_dp_free(&ls);
    DT_OK(dopt_dp_init(&ls, c, 4, NULL)); /* defaults: period 1, every step */
    for (t = 0; t < 10; t++) DT_EQ_INT(dopt_dp_should_sync(&ls, t), 1);
    dopt_dp_free(&ls);
    dopt_comm_destroy(c);
}

DTEST(shard_covers_every_sample_once_with_sizes_within_one) {
    static const size_t totals[] = {0, 1, 7, 100, 1001};
    size_t k;
    int size;
    for (k = 0; k < sizeof totals / sizeof *totals; k++)
        for (size = 1; size <= 7; size++) {
            size_t expect = 0, lo = (size_t)-1, hi = 0, b, e;
            int r;
            for (r = 0; r < size; r++) {
                DT_OK(dopt_shard(totals[k], r, size, &b, &e));
                DT_EQ_INT(b, expect);
                DT_CHECK(e >= b);
                if (e - b < lo) lo = e - b;
                if (e - b > hi) hi = e - b;
                expect = e;
            }
            DT_EQ_INT(expect, totals[k]);
            DT_CHECK(hi - lo <= 1);
        }
    {
        size_t b, e;
        DT_EQ_INT(dopt_shard(10, 3, 3, &b, &e), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_shard(10, -1, 3, &b, &e), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_shard(10, 0, 0, &b, &e), DOPT_ERR_INVALID);
    }
}

DTEST(per_rank_seeds_are_distinct_and_reproducible) {
    uint64_t s[64];
    int i, j;
    for (i = 0; i < 64; i++) s[i] = dopt_seed_for_rank(7, i);
    for (i = 0; i < 64; i++) {
        DT_CHECK(s[i] == dopt_seed_for_rank(7, i));
        for (j = 0; j < i; j++) DT_CHECK(s[i] != s[j]);
    }
}

DTEST(bad_layouts_are_invalid_found_before_communication_and_not_counted) {
    dopt_comm *c;
    dopt_dp ls;
    dopt_dp_config cfg;
    dopt_state_desc st[1] = {{5, (dopt_state_policy)7, "bad"}};
    float x[10] = {0}, m[5] = {0};
    dopt_buf xb = dopt_buf_flat(x, 10, NULL, 0), short_x = dopt_buf_flat(x, 9, NULL, 0), mb = dopt_buf_flat(m, 4, NULL, 0);
    DT_OK(dopt_comm_create_self(&c));
    memset(&cfg, 0, sizeof cfg);
    DT_EQ_INT(dopt_dp_init(&ls, NULL, 10, &cfg), DOPT_ERR_INVALID);
    cfg.states = st;
    cfg.nstates = 1;
    DT_EQ_INT(dopt_dp_init(&ls, c, 10, &cfg), DOPT_ERR_INVALID); /* unknown policy */
    st[0].policy = DOPT_STATE_AVERAGE;
    DT_OK(dopt_dp_init(&ls, c, 10, &cfg));
    DT_EQ_INT(dopt_dp_after_step(&ls, x), DOPT_ERR_INVALID); /* flat form: states not passed */
    DT_EQ_INT(dopt_dp_after_step_buf(&ls, &short_x, &mb), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_dp_after_step_buf(&ls, &xb, &mb), DOPT_ERR_INVALID); /* state of 4, not 5 */
    DT_CHECKF(strstr(dopt_dp_detail(&ls), "bad") != NULL, "detail: %s", dopt_dp_detail(&ls));
    DT_EQ_INT(ls.step, 0);
    DT_EQ_INT(dopt_dp_celgc_step(&ls, &xb, &xb, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f, .states = &mb}),
              DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_dp_celgc_step(&ls, &xb, &xb, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}), DOPT_ERR_INVALID);
    mb.n = 5;
    DT_EQ_INT(dopt_dp_celgc_step(&ls, &xb, &xb, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f, .scale = NAN, .states = &mb}),
              DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_dp_celgc_step(&ls, &xb, &xb, &(dopt_celgc){.eta = INFINITY, .gamma = 1.0f, .states = &mb}),
              DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_dp_celgc_step(&ls, &xb, &xb, NULL), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&ls), "rule") != NULL, "detail: %s", dopt_dp_detail(&ls));
    DT_EQ_INT(ls.step, 0);
    DT_OK(dopt_dp_after_step_buf(&ls, &xb, &mb));
    DT_EQ_INT(ls.step, 1);
    DT_EQ_INT(dopt_dp_set_step_samples(&ls, -1.0), DOPT_ERR_INVALID);
    dopt_dp_free(&ls);
    dopt_dp_free(&ls); /* twice is harmless */
    dopt_comm_destroy(c);
    /* a driver with no error of its own tells the communicator's: the host prints one detail */
    DT_OK(dopt_comm_create_self(&c));
    DT_OK(dopt_dp_init(&ls, c, 10, NULL));
    DT_CHECK(strcmp(dopt_dp_detail(&ls), "") == 0);
    DT_EQ_INT(dopt_allreduce(c, NULL, 3, DOPT_F32, DOPT_SUM), DOPT_ERR_INVALID);
    DT_CHECK(strcmp(dopt_dp_detail(&ls), dopt_comm_detail(c)) == 0 && dopt_comm_detail(c)[0] != 0);
    dopt_dp_free(&ls);
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ local SGD on least squares, many ranks */

typedef struct lsgd_args {
    size_t period;
} lsgd_args;

#define LS_STEPS 600

/* Momentum SGD; the momentum is an AVERAGE state, a per-rank counter KEEP, a gradient
   accumulator RESET. Odd ranks describe their parameters as a scatter list. */
static void body_least_squares(dopt_comm *c, void *arg) {
    const lsgd_args *a = (const lsgd_args *)arg;
    static lsq p;
    float x[LS_D], g[LS_D], mom[LS_D], keep[3], acc[LS_D];
    dopt_span spans[2] = {{x, 7}, {x + 7, LS_D - 7}};
    dopt_state_desc sd[3] = {{LS_D, DOPT_STATE_AVERAGE, "momentum"}, {3, DOPT_STATE_KEEP, "counter"},
                             {LS_D, DOPT_STATE_RESET, "accumulator"}};
    dopt_buf xb = c->rank % 2 ? dopt_buf_scatter(spans, 2) : dopt_buf_flat(x, LS_D, NULL, 0);
    dopt_buf states[3];
    dopt_dp ls;
    dopt_dp_config cfg;
    int t, j, syncs = 0;
    double d0;
    lsq_make(&p);
    states[0] = dopt_buf_flat(mom, LS_D, NULL, 0);
    states[1] = dopt_buf_flat(keep, 3, NULL, 0);
    states[2] = dopt_buf_flat(acc, LS_D, NULL, 0);
    memset(&cfg, 0, sizeof cfg);
    cfg.period = a->period;
    cfg.states = sd;
    cfg.nstates = 3;
    DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
    for (j = 0; j < LS_D; j++) {
        x[j] = (float)(c->rank + 1) * 0.37f * (float)j; /* different on every rank until broadcast */
        mom[j] = acc[j] = 0.0f;
    }
    DT_OK(dopt_dp_broadcast_buf(&ls, &xb, states));
    for (j = 0; j < 3; j++) keep[j] = (float)c->rank; /* after the broadcast: rank-specific */
    d0 = dist_to(x, p.xstar, LS_D);
    for (t = 0; t < LS_STEPS; t++) {
        int sync = dopt_dp_should_sync(&ls, (uint64_t)t);
        lsq_grad(&p, x, g, c->rank, c->size, (uint64_t)t, LS_BATCH);
        for (j = 0; j < LS_D; j++) {
            mom[j] = 0.9f * mom[j] + g[j];
            x[j] -= 0.01f * mom[j];
            acc[j] += g[j];
        }
        keep[0] += 1.0f;
        DT_OK(dopt_dp_after_step_buf(&ls, &xb, states));
        if (sync) {
            int identical = 0;
            double diff = -1.0;
            syncs++;
            DT_OK(dopt_dp_check_replicas(&ls, &xb, &identical, &diff));
            DT_CHECKF(identical == 1 && diff == 0.0, "rank %d step %d: replicas differ by %g", c->rank, t, diff);
            DT_CHECKF(world_same_on_every_rank(c, mom, sizeof mom), "momentum (AVERAGE) differs after step %d", t);
            for (j = 0; j < LS_D; j++) DT_CHECK(acc[j] == 0.0f); /* RESET */
            DT_CHECK(keep[0] == (float)c->rank + (float)(t + 1) && keep[1] == (float)c->rank); /* KEEP */
        } else if (c->size > 1 && t < 50) { /* (later, at the exact optimum, they may meet) */
            int identical = 1;
            DT_OK(dopt_dp_check_replicas(&ls, &xb, &identical, NULL));
            DT_CHECKF(identical == 0, "step %d: local steps on different data should leave replicas apart", t);
        }
    }
    DT_EQ_INT(syncs, LS_STEPS / (int)a->period);
    DT_EQ_INT(ls.syncs, syncs);
    DT_CHECKF(dist_to(x, p.xstar, LS_D) < 1e-3 * d0, "period %zu rank %d: |x - x*| = %g from %g", a->period, c->rank,
              dist_to(x, p.xstar, LS_D), d0);
    dopt_dp_free(&ls);
}

static const lsgd_args ls_periods[3] = {{1}, {4}, {16}};
DTEST_WORLDS_EACH(local_sgd_converges_at_periods_1_4_16_and_replicas_identical_after_each_sync, body_least_squares,
                  ls_periods, 2, 4);

/* ------------------------------------------------------------------ replica check */

static void body_replica_spread(dopt_comm *c, void *arg) {
    float x[LS_D];
    dopt_dp ls;
    int identical = -1, j;
    double diff = -1.0;
    (void)arg;
    DT_OK(dopt_dp_init(&ls, c, LS_D, NULL));
    for (j = 0; j < LS_D; j++) x[j] = 1.0f + (float)j;
    DT_OK(check_flat(&ls, x, &identical, &diff));
    DT_CHECK(identical == 1 && diff == 0.0);
    x[3] += 0.25f * (float)c->rank; /* spread at element 3: 0.25 (size - 1) */
    x[9] -= 0.125f * (float)c->rank; /* spread at element 9: 0.125 (size - 1) */
    DT_OK(check_flat(&ls, x, &identical, &diff));
    DT_EQ_INT(identical, 0);
    DT_NEAR(diff, 0.25 * (c->size - 1), 1e-6);
    DT_CHECK(world_same_on_every_rank(c, &diff, sizeof diff));
    dopt_dp_free(&ls);
}

DTEST_WORLDS(replica_check_finds_the_largest_difference_between_ranks, body_replica_spread, NULL, 2, 4);

/* The library's own collectives name the call the user made: rank 0 checks the replicas while
   rank 1 averages after its step (period 1); each rank's detail names its own call. */
static void body_named_calls(dopt_comm *c, void *arg) {
    float x[4] = {1, 2, 3, 4};
    dopt_dp ls;
    dopt_status s;
    (void)arg;
    DT_OK(dopt_dp_init(&ls, c, 4, NULL));
    DT_OK(dopt_dp_broadcast(&ls, x));
    s = c->rank == 0 ? check_flat(&ls, x, NULL, NULL) : dopt_dp_after_step(&ls, x);
    DT_EQ_INT(s, DOPT_ERR_MISMATCH);
    DT_CHECKF(strstr(dopt_comm_detail(c), c->rank == 0 ? "rank 0: dopt_dp_check_replicas: allgather"
                                                       : "rank 1: dopt_dp_after_step: the average after step 0: "
                                                         "allreduce") != NULL,
              "detail: %s", dopt_comm_detail(c));
    dopt_dp_free(&ls);
}

DTEST_WORLDS(internal_collectives_name_the_users_call_in_a_mismatch, body_named_calls, NULL, 2, 2); /* a pair's roles */

/* Ranks a local step apart (period 4: no communication in between) meet in the replica check:
   every rank is told the steps, not a checksum. */
static void body_steps_apart(dopt_comm *c, void *arg) {
    float x[4] = {1, 2, 3, 4};
    dopt_dp ls;
    dopt_dp_config cfg;
    int identical = -1;
    (void)arg;
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    DT_OK(dopt_dp_init(&ls, c, 4, &cfg));
    DT_OK(dopt_dp_after_step(&ls, x));
    if (c->rank == 1) DT_OK(dopt_dp_after_step(&ls, x));
    DT_EQ_INT(check_flat(&ls, x, &identical, NULL), DOPT_ERR_MISMATCH);
    DT_EQ_INT(identical, 0);
    DT_CHECKF(strstr(dopt_dp_detail(&ls), "dopt_dp_check_replicas: ranks are at different steps: rank 0 "
                                                "at 1, rank 1 at 2") != NULL,
              "detail: %s", dopt_dp_detail(&ls));
    DT_EQ_INT(c->error, DOPT_OK); /* the communicator is fine: the ranks are out of step, not the transport */
    dopt_dp_free(&ls);
}

DTEST_WORLDS(replica_check_of_ranks_at_different_steps_names_the_steps, body_steps_apart, NULL, 2,
             2); /* a pair's detail */

/* Check once: after a failure every call on the communicator, and on a driver over it, returns
   the same status at once, whether or not it would communicate (a local step of local SGD
   included), and moves nothing: the traffic counters stand still and the detail keeps the first
   failure. Every rank poisons itself the same local way (a NULL buffer), so no rank waits for
   another; a call that did communicate would hang here, and one that ignored the failure would
   return something else. */
static void body_poisoned_calls(dopt_comm *c, void *arg) {
    enum { N = 64 };
    float x[N], g[N];
    double norms[1] = {0};
    dopt_clip_norm clip = {.max_norm = 1.0f}, measure = {.max_norm = 1.0f, .measure_only = 1};
    size_t got[8];
    dopt_segment seg = {0, N, "all"};
    dopt_buf bx = dopt_buf_flat(x, N, &seg, 1), bg = dopt_buf_flat(g, N, &seg, 1);
    dopt_dp ls, local;
    dopt_dp_config lc;
    dopt_compressor cz;
    dopt_compressor_config cc;
    dopt_request r;
    dopt_traffic before;
    char detail[DOPT_DETAIL_MAX];
    int same = -1, i;
    (void)arg;
    for (i = 0; i < N; i++) x[i] = g[i] = 1.0f + (float)i;
    memset(&lc, 0, sizeof lc);
    lc.period = 4;
    memset(&cc, 0, sizeof cc);
    cc.codec = DOPT_CODEC_TERNARY;
    DT_OK(dopt_dp_init(&ls, c, N, NULL));
    DT_OK(dopt_dp_init(&local, c, N, &lc));
    DT_OK(dopt_compressor_init(&cz, &cc, &seg, 1));
    DT_EQ_INT(dopt_allreduce(c, NULL, 5, DOPT_F32, DOPT_SUM), DOPT_ERR_INVALID);
    before = c->traffic;
    snprintf(detail, sizeof detail, "%s", dopt_comm_detail(c));
#define POISONED(call) DT_EQ_INT((call), DOPT_ERR_INVALID)
    POISONED(dopt_allreduce(c, x, N, DOPT_F32, DOPT_SUM));
    POISONED(dopt_allreduce_start(c, x, N, DOPT_F32, DOPT_SUM, &r));
    POISONED(dopt_allreduce_weighted_mean(c, x, N, DOPT_F32, 1.0));
    POISONED(dopt_allgather(c, x, g, sizeof(float)));
    POISONED(dopt_allgatherv(c, x, 4, g, sizeof g, got));
    POISONED(dopt_broadcast(c, x, sizeof x, 0));
    POISONED(dopt_barrier(c));
    POISONED(dopt_broadcast_buf(c, &bx, 0));
    POISONED(dopt_clip_global_norm(c, &bg, &clip));
    POISONED(dopt_clip_global_norm(c, &bg, &measure));
    POISONED(dopt_clip_segment_norms(c, &bg, &clip, norms));
    POISONED(dopt_clip_value(c, &bg, 1.0f, 0.5f));
    POISONED(dopt_clip_sigma(c, &bg, 3.0f));
    POISONED(dopt_clip_agc(c, &bg, &bx, &(dopt_agc){.lambda = 0.01f}));
    POISONED(dopt_compress_allreduce(&cz, c, g, N));
    POISONED(dopt_dp_after_backward(&ls, g));
    POISONED(dopt_dp_after_step(&ls, x));
    POISONED(dopt_dp_after_step(&local, x)); /* a local step: nothing to send, still refused */
    POISONED(dopt_dp_sync(&ls, &bx, NULL));
    POISONED(dopt_dp_broadcast(&ls, x));
    POISONED(dopt_dp_celgc_step(&ls, &bx, &bg, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}));
    POISONED(check_flat(&ls, x, &same, NULL));
    POISONED(dopt_dp_close(&ls, x));
#undef POISONED
    DT_CHECK(dopt__is_nan(dopt_mean(c, 1.0)) /* by its bits: fast-math builds too */);
    DT_CHECK(memcmp(&before, &c->traffic, sizeof before) == 0);
    DT_CHECKF(strcmp(detail, dopt_comm_detail(c)) == 0, "the first failure's detail changed: \"%s\" to \"%s\"", detail,
              dopt_comm_detail(c));
    dopt_compressor_free(&cz);
    dopt_dp_free(&local);
    dopt_dp_free(&ls);
}

DTEST_WORLDS(every_call_on_a_poisoned_communicator_fails_at_once_the_same_way, body_poisoned_calls, NULL, 2, 4);

/* ------------------------------------------------------------------ compressed model deltas */

/* Local SGD (period 4) whose averages send the model delta through a compressor: top-k (a
   quarter of the elements) with error feedback, or sign with error feedback. Replicas are
   bitwise identical after every average and the run still reaches x*. */
typedef struct compressed_args {
    dopt_codec codec;
    int outer; /* 1: DiLoCo's outer Nesterov step on the compressed pseudo-gradient */
} compressed_args;

static void body_compressed(dopt_comm *c, void *arg) {
    const compressed_args *a = (const compressed_args *)arg;
    const dopt_codec *codec = &a->codec;
    static lsq p;
    float x[LS_D], g[LS_D];
    dopt_segment segs[2] = {{0, 6, "w"}, {6, LS_D - 6, "b"}};
    dopt_compressor cz;
    dopt_compressor_config ccfg;
    dopt_dp ls;
    dopt_dp_config cfg;
    int t, j;
    double d0;
    lsq_make(&p);
    memset(&ccfg, 0, sizeof ccfg);
    ccfg.codec = *codec;
    ccfg.topk_ratio = 0.25;
    ccfg.error_feedback = DOPT_EF_ON;
    DT_OK(dopt_compressor_init(&cz, &ccfg, segs, 2));
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    cfg.compressor = &cz;
    if (a->outer) {
        cfg.outer_lr = 0.7;
        cfg.outer_momentum = 0.5;
    }
    DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
    for (j = 0; j < LS_D; j++) x[j] = 0.0f;
    DT_OK(dopt_dp_broadcast(&ls, x));
    d0 = dist_to(x, p.xstar, LS_D);
    memset(&c->traffic, 0, sizeof c->traffic);
    for (t = 0; t < 1200; t++) {
        lsq_grad(&p, x, g, c->rank, c->size, (uint64_t)t, LS_BATCH);
        dopt_axpy(x, -0.05f, g, LS_D);
        DT_OK(dopt_dp_after_step(&ls, x));
        if (dopt_dp_should_sync(&ls, (uint64_t)t)) {
            int identical = 0;
            DT_OK(check_flat(&ls, x, &identical, NULL));
            DT_CHECKF(identical, "rank %d step %d: replicas differ after a compressed average", c->rank, t);
        }
    }
    DT_CHECK(cz.step == 300); /* one compressed allreduce per average */
    /* each average is one allgather of the messages and nothing else (no state buffers); so is
       each replica check (every rank's checksum and step) */
    DT_CHECK(c->traffic.calls[DOPT_COLL_ALLGATHER] == 600 && c->traffic.calls[DOPT_COLL_ALLREDUCE] == 0);
    DT_CHECKF(dist_to(x, p.xstar, LS_D) < 1e-2 * d0, "codec %s rank %d: |x - x*| = %g from %g", dopt_codec_name(*codec),
              c->rank, dist_to(x, p.xstar, LS_D), d0);
    dopt_dp_free(&ls);
    dopt_compressor_free(&cz);
}

static const compressed_args plain_deltas[2] = {{DOPT_CODEC_TOPK, 0}, {DOPT_CODEC_SIGN, 0}};
static const compressed_args outer_deltas[2] = {{DOPT_CODEC_TOPK, 1}, {DOPT_CODEC_SIGN, 1}};
DTEST_WORLDS_EACH(compressed_deltas_with_error_feedback_converge_and_keep_replicas_identical, body_compressed,
                  plain_deltas, 2, 4);
DTEST_WORLDS_EACH(outer_nesterov_on_compressed_pseudo_gradients_converges_and_keeps_replicas_identical,
                  body_compressed, outer_deltas, 2, 4);

/* ------------------------------------------------------------------ DiLoCo's outer optimizer */

/* Period 1 on the models, deltas d_0 = (1, 2), d_1 = (3, −2) added every round, lr 0.7, μ 0.9,
   anchor 0. Round 1: mean (2, 0), Δ = (−2, 0), v = Δ, x = −0.7·(Δ + 0.9v) = (2.66, 0). Round 2:
   mean (4.66, 0), Δ = (−2, 0), v = 0.9·(−2) − 2 = −3.8, x = 2.66 + 0.7·(2 + 3.42) = 6.454. */
static void body_outer_hand(dopt_comm *c, void *arg) {
    static const float d[2][2] = {{1, 2}, {3, -2}};
    float x[2] = {0, 0};
    dopt_dp ls;
    dopt_dp_config cfg;
    int round;
    (void)arg;
    memset(&cfg, 0, sizeof cfg);
    cfg.outer_lr = 0.7;
    cfg.outer_momentum = 0.9;
    DT_OK(dopt_dp_init(&ls, c, 2, &cfg));
    DT_OK(dopt_dp_broadcast(&ls, x));
    for (round = 0; round < 2; round++) {
        x[0] += d[c->rank][0];
        x[1] += d[c->rank][1];
        DT_OK(dopt_dp_after_step(&ls, x));
        DT_NEAR(x[0], round == 0 ? 2.66 : 6.454, 1e-5);
        DT_NEAR(x[1], 0.0, 1e-6);
        DT_NEAR(ls.outer_v[0], round == 0 ? -2.0 : -3.8, 1e-6);
        DT_CHECK(world_same_on_every_rank(c, x, sizeof x));
        DT_CHECK(memcmp(x, ls.anchor, sizeof x) == 0); /* everyone continues from the new anchor */
    }
    dopt_dp_free(&ls);
}

DTEST_WORLDS(outer_nesterov_step_matches_hand_computation, body_outer_hand, NULL, 2, 2); /* two ranks' deltas */

/* Plain averaging is the outer step with lr 1 and no momentum: asking for it explicitly changes
   no bit of a noisy local-SGD run. */
static void body_outer_plain(dopt_comm *c, void *arg) {
    static lsq p;
    float x[2][LS_D], g[LS_D];
    int run, t, j;
    (void)arg;
    lsq_make(&p);
    for (run = 0; run < 2; run++) {
        dopt_dp ls;
        dopt_dp_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.period = 4;
        if (run == 1) {
            cfg.outer_lr = 1.0;
            cfg.outer_momentum = 0.0;
        }
        DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
        for (j = 0; j < LS_D; j++) x[run][j] = 0.0f;
        DT_OK(dopt_dp_broadcast(&ls, x[run]));
        for (t = 0; t < 42; t++) {
            lsq_grad(&p, x[run], g, c->rank, c->size, (uint64_t)t, 2);
            dopt_axpy(x[run], -0.05f, g, LS_D);
            DT_OK(dopt_dp_after_step(&ls, x[run]));
        }
        dopt_dp_free(&ls);
    }
    DT_CHECK(memcmp(x[0], x[1], sizeof x[0]) == 0);
}

DTEST_WORLDS(outer_lr_1_without_momentum_is_bitwise_plain_averaging, body_outer_plain, NULL, 2, 4);

DTEST(outer_optimizer_settings_out_of_range_are_invalid) {
    dopt_comm *c;
    dopt_dp ls;
    dopt_dp_config cfg;
    static const double bad[4][2] = {{-0.5, 0.0}, {NAN, 0.0}, {0.7, 1.0}, {0.7, -0.1}};
    int i;
    DT_OK(dopt_comm_create_self(&c));
    for (i = 0; i < 4; i++) {
        memset(&cfg, 0, sizeof cfg);
        cfg.outer_lr = bad[i][0];
        cfg.outer_momentum = bad[i][1];
        DT_EQ_INT(dopt_dp_init(&ls, c, 4, &cfg), DOPT_ERR_INVALID);
    }
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ average now */

/* Period 4, 6 local steps: the round after the average at step 3 is 2 steps long, the replicas
   differ; sync averages them (exactly: quarter steps, sums exact), is not a step, and a second
   sync right after is a no-op; the schedule goes on (the average after step 7 still happens). */
static void body_sync_now(dopt_comm *c, void *arg) {
    float x[8], before[8];
    dopt_span spans[2] = {{x, 3}, {x + 3, 5}};
    dopt_buf params = dopt_buf_scatter(spans, 2);
    dopt_dp ls;
    dopt_dp_config cfg;
    int identical = -1, j;
    uint64_t t, syncs;
    (void)arg;
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    DT_OK(dopt_dp_init(&ls, c, 8, &cfg));
    for (j = 0; j < 8; j++) x[j] = (float)j;
    DT_OK(dopt_dp_broadcast_buf(&ls, &params, NULL));
    for (t = 0; t < 6; t++) {
        for (j = 0; j < 8; j++) x[j] += 0.25f * (float)c->rank; /* each rank drifts its own way */
        DT_OK(dopt_dp_after_step_buf(&ls, &params, NULL));
    }
    DT_OK(dopt_dp_check_replicas(&ls, &params, &identical, NULL));
    DT_EQ_INT(identical, 0);
    memcpy(before, x, sizeof x);
    syncs = ls.syncs;
    DT_OK(dopt_dp_sync(&ls, &params, NULL));
    DT_OK(dopt_dp_check_replicas(&ls, &params, &identical, NULL));
    DT_EQ_INT(identical, 1);
    for (j = 0; j < 8; j++) /* the mean of the ranks' drifts over the round: 2 · 0.25 · (size-1)/2 */
        DT_CHECK(x[j] == before[j] - 0.5f * (float)c->rank + 0.25f * (float)(c->size - 1));
    DT_CHECK(ls.step == 6 && ls.syncs == syncs + 1);
    DT_CHECK(dopt_dp_sync(NULL, &params, NULL) == DOPT_ERR_INVALID);
    DT_OK(dopt_dp_sync(&ls, &params, NULL)); /* an empty round: nothing to average */
    DT_CHECK(ls.syncs == syncs + 1);
    for (t = 6; t < 8; t++) {
        for (j = 0; j < 8; j++) x[j] += 0.25f * (float)c->rank;
        DT_OK(dopt_dp_after_step_buf(&ls, &params, NULL));
    }
    DT_CHECK(ls.syncs == syncs + 2); /* the scheduled average after step 7 */
    DT_CHECK(world_same_on_every_rank(c, x, sizeof x));
    dopt_dp_free(&ls);
}

/* The closing call: a short last round of local SGD is averaged, the replicas are checked, the
   driver is released and refuses every later call; dopt_mean averages a scalar for reporting. */
static void body_close(dopt_comm *c, void *arg) {
    float x[8];
    dopt_dp ls;
    dopt_dp_config cfg;
    uint64_t reduces;
    int j, t;
    (void)arg;
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    DT_OK(dopt_dp_init(&ls, c, 8, &cfg));
    for (j = 0; j < 8; j++) x[j] = (float)j;
    for (t = 0; t < 6; t++) { /* one scheduled average (after step 3), then two local steps */
        for (j = 0; j < 8; j++) x[j] += 0.25f * (float)c->rank;
        DT_OK(dopt_dp_after_step(&ls, x));
    }
    reduces = c->traffic.calls[DOPT_COLL_ALLREDUCE];
    DT_OK(dopt_dp_close(&ls, x));
    DT_EQ_INT((int)(c->traffic.calls[DOPT_COLL_ALLREDUCE] - reduces), 1); /* the short round's average */
    for (j = 0; j < 8; j++) /* step 3's average, then the mean of two more drifts */
        DT_CHECK(x[j] == (float)j + 6 * 0.25f * (float)(c->size - 1) / 2);
    DT_CHECK(world_same_on_every_rank(c, x, sizeof x));
    DT_CHECK(ls.work == NULL && ls.anchor == NULL && ls.replica_words == NULL); /* released */
    DT_EQ_INT(dopt_dp_after_step(&ls, x), DOPT_ERR_CLOSED);
    DT_EQ_INT(dopt_dp_close(&ls, x), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&ls), "not open") != NULL, "detail: %s", dopt_dp_detail(&ls));
    dopt_dp_free(&ls); /* harmless after close */
    DT_CHECK(dopt_mean(c, (double)(c->rank + 1)) == (double)(c->size + 1) / 2);
    DT_EQ_INT(c->error, DOPT_OK);
}

DTEST_WORLDS(close_averages_the_short_last_round_checks_and_releases, body_close, NULL, 2, 4);

/* Replicas that differ at the end are named: which ranks, by how much; the status is a mismatch
   and the communicator's detail (which dopt_comm_finish prints) says the same, while the
   communicator stays usable. */
static void body_close_differ(dopt_comm *c, void *arg) {
    float x[8], g[8];
    dopt_dp ls;
    char want[200], others[64] = "";
    int j;
    (void)arg;
    for (j = 1; j < c->size; j++)
        snprintf(others + strlen(others), sizeof others - strlen(others), "%s%d", j > 1 ? ", " : "", j);
    DT_OK(dopt_dp_init(&ls, c, 8, NULL));
    for (j = 0; j < 8; j++) x[j] = g[j] = (float)j;
    DT_OK(dopt_dp_broadcast(&ls, x));
    DT_OK(dopt_dp_after_backward(&ls, g));
    dopt_axpy(x, -0.5f, g, 8);
    DT_OK(dopt_dp_after_step(&ls, x));
    if (c->rank > 0) x[5] += 0.5f * (float)c->rank; /* a bug of the host's: ranks 1.. drift after the step */
    DT_EQ_INT(dopt_dp_close(&ls, x), DOPT_ERR_MISMATCH);
    snprintf(want, sizeof want, "dopt_dp_close: the replicas differ after step 1: %d rank%s (%s) hold%s other parameters "
             "than rank 0, by at most %g", c->size - 1, c->size > 2 ? "s" : "", others,
             c->size > 2 ? "" : "s", 0.5 * (c->size - 1));
    DT_CHECKF(strcmp(dopt_dp_detail(&ls), want) == 0, "detail: %s\nwant:   %s", dopt_dp_detail(&ls), want);
    DT_CHECKF(strstr(dopt_comm_detail(c), want) != NULL, "communicator's detail: %s", dopt_comm_detail(c));
    DT_EQ_INT(c->error, DOPT_OK);
    DT_OK(dopt_barrier(c));
}

/* A refused init is checked once too: every later call returns its status, and the closing call
   returns it with the reason, which also goes to the communicator's detail for dopt_comm_finish. */
DTEST(a_refused_init_fails_every_later_call_and_close_names_why) {
    dopt_comm *c;
    dopt_dp ls;
    dopt_dp_config cfg;
    float x[4] = {1, 2, 3, 4};
    DT_OK(dopt_comm_create_self(&c));
    memset(&cfg, 0, sizeof cfg);
    cfg.outer_momentum = 1.5;
    DT_EQ_INT(dopt_dp_init(&ls, c, 4, &cfg), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_dp_broadcast(&ls, x), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_dp_after_backward(&ls, x), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_dp_after_step(&ls, x), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_dp_close(&ls, x), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&ls), "dopt_dp_init: outer_lr is negative or outer_momentum is outside [0, 1)"),
              "detail: %s", dopt_dp_detail(&ls));
    DT_CHECKF(strstr(dopt_comm_detail(c), "dopt_dp_init: outer_lr"), "communicator: %s", dopt_comm_detail(c));
    DT_EQ_INT(c->error, DOPT_OK);
    DT_EQ_INT(dopt_comm_finish(c, DOPT_ERR_INVALID), 1);
}

DTEST_WORLDS(close_names_the_ranks_whose_replicas_differ, body_close_differ, NULL, 2, 4);

/* Period 1 needs no second setting: dopt_dp_after_backward averages the gradients of a
   synchronous step (one allreduce per step, the step's model average then skipped), and a host
   that calls only dopt_dp_after_step gets its models averaged, sync_grads or not. */
static void body_period_one(dopt_comm *c, void *arg) {
    float x[8], g[8];
    dopt_dp ls;
    dopt_dp_config cfg;
    uint64_t reduces;
    int j, t, sync;
    (void)arg;
    for (sync = 0; sync < 2; sync++) {
        memset(&cfg, 0, sizeof cfg);
        cfg.sync_grads = sync;
        DT_OK(dopt_dp_init(&ls, c, 8, &cfg));
        for (j = 0; j < 8; j++) x[j] = 1.0f;
        for (t = 0; t < 3; t++) { /* gradients averaged: the mean of rank + j */
            for (j = 0; j < 8; j++) g[j] = (float)(c->rank + j);
            reduces = c->traffic.calls[DOPT_COLL_ALLREDUCE];
            DT_OK(dopt_dp_after_backward(&ls, g));
            for (j = 0; j < 8; j++) DT_CHECK(g[j] == (float)(c->size - 1) / 2 + (float)j);
            dopt_axpy(x, -0.125f, g, 8);
            DT_OK(dopt_dp_after_step(&ls, x));
            DT_EQ_INT((int)(c->traffic.calls[DOPT_COLL_ALLREDUCE] - reduces), 1);
        }
        for (t = 0; t < 3; t++) { /* no after_backward: the models are averaged */
            for (j = 0; j < 8; j++) x[j] -= 0.125f * (float)c->rank;
            reduces = c->traffic.calls[DOPT_COLL_ALLREDUCE];
            DT_OK(dopt_dp_after_step(&ls, x));
            DT_EQ_INT((int)(c->traffic.calls[DOPT_COLL_ALLREDUCE] - reduces), 1);
            DT_CHECK(world_same_on_every_rank(c, x, sizeof x));
        }
        DT_OK(dopt_dp_close(&ls, x));
    }
}

DTEST_WORLDS(period_one_averages_gradients_after_backward_and_models_otherwise, body_period_one, NULL, 2, 4);

DTEST_WORLDS(sync_now_averages_a_short_round_and_is_not_a_step, body_sync_now, NULL, 2, 4);

/* ------------------------------------------------------------------ compressed gradients */

/* Synchronous SGD whose gradient averages go through cfg.grad_compressor (ternary): each average
   is bitwise what dopt_compress_allreduce gives with a twin compressor, the replicas stay
   identical without any model average, and the run reaches x*. */
static void body_grad_compressed(dopt_comm *c, void *arg) {
    static lsq p;
    float x[LS_D], g[LS_D], twin_g[LS_D];
    dopt_segment segs[2] = {{0, 6, "w"}, {6, LS_D - 6, "b"}};
    dopt_compressor gz, twin, other;
    dopt_compressor_config ccfg;
    dopt_dp ls;
    dopt_dp_config cfg;
    int t, j, identical = 0;
    double d0;
    (void)arg;
    lsq_make(&p);
    memset(&ccfg, 0, sizeof ccfg);
    ccfg.codec = DOPT_CODEC_TERNARY;
    ccfg.seed = 5;
    DT_OK(dopt_compressor_init(&gz, &ccfg, segs, 2));
    DT_OK(dopt_compressor_init(&twin, &ccfg, segs, 2));
    DT_OK(dopt_compressor_init(&other, &ccfg, segs, 1)); /* covers 6 elements only */
    memset(&cfg, 0, sizeof cfg);
    cfg.grad_compressor = &gz;
    cfg.compressor = &gz; /* refused: one object cannot hold two error-feedback states */
    DT_EQ_INT(dopt_dp_init(&ls, c, LS_D, &cfg), DOPT_ERR_INVALID);
    cfg.compressor = NULL;
    cfg.grad_compressor = &other; /* refused: does not cover the n elements */
    DT_EQ_INT(dopt_dp_init(&ls, c, LS_D, &cfg), DOPT_ERR_INVALID);
    cfg.grad_compressor = &gz;
    DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
    for (j = 0; j < LS_D; j++) x[j] = 0.0f;
    DT_OK(dopt_dp_broadcast(&ls, x));
    d0 = dist_to(x, p.xstar, LS_D);
    for (t = 0; t < 600; t++) {
        lsq_grad(&p, x, g, c->rank, c->size, (uint64_t)t, LS_BATCH);
        memcpy(twin_g, g, sizeof g);
        DT_OK(dopt_dp_after_backward(&ls, g));
        DT_OK(dopt_compress_allreduce(&twin, c, twin_g, LS_D));
        DT_CHECKF(memcmp(g, twin_g, sizeof g) == 0, "rank %d step %d: driver's average differs from the compressor's",
                  c->rank, t);
        dopt_axpy(x, -0.05f, g, LS_D);
        DT_OK(dopt_dp_after_step(&ls, x));
    }
    DT_CHECK(gz.step == 600);
    DT_OK(check_flat(&ls, x, &identical, NULL));
    DT_CHECK(identical);
    DT_CHECKF(dist_to(x, p.xstar, LS_D) < 1e-2 * d0, "rank %d: |x - x*| = %g from %g", c->rank,
              dist_to(x, p.xstar, LS_D), d0);
    dopt_dp_free(&ls);
    dopt_compressor_free(&gz);
    dopt_compressor_free(&twin);
    dopt_compressor_free(&other);
}

DTEST_WORLDS(compressed_gradients_through_the_driver_equal_the_compressed_allreduce, body_grad_compressed, NULL, 2, 4);

/* ------------------------------------------------------------------ gradient shapes */

/* Three tensors of 1000 elements, and the same three with gaps between them (in 1006). */
#define SH_N 1000
#define SH_GAPPED_N 1006
#define SH_SHAPES 4 /* flat, flat with a table (both in place), a table with gaps, a scatter list */
static const dopt_segment sh_segs[3] = {{0, 200, "w1", 0}, {200, 700, "w2", 0}, {900, 100, "b", 0}};
static const dopt_segment sh_gapped[3] = {{1, 200, "w1", 0}, {203, 700, "w2", 0}, {906, 100, "b", 0}};

typedef enum sh_via { SH_FP32, SH_WEIGHTED, SH_TERNARY } sh_via;
static const sh_via sh_vias[] = {SH_FP32, SH_WEIGHTED, SH_TERNARY};

typedef struct sh_run {
    sh_via via;
    dopt_dp dp[SH_SHAPES];
    dopt_compressor cz[SH_SHAPES + 1]; /* the last: the twin beside the driver */
    float flat[SH_N], tabled[SH_N], gapped[SH_GAPPED_N], twin[SH_N], src[SH_N], sentinel[SH_N];
    float *spans_mem[3];
    dopt_span spans[3];
    dopt_buf shape[SH_SHAPES];
} sh_run;

static void sh_setup(dopt_comm *c, sh_run *r) {
    dopt_compressor_config ccfg;
    dopt_dp_config cfg;
    int k;
    for (k = 0; k < 3; k++) {
        r->spans_mem[k] = (float *)malloc(sh_segs[k].count * sizeof(float));
        r->spans[k].ptr = r->spans_mem[k];
        r->spans[k].count = sh_segs[k].count;
    }
    r->shape[0] = dopt_buf_flat(r->flat, SH_N, NULL, 0);
    r->shape[1] = dopt_buf_flat(r->tabled, SH_N, sh_segs, 3);
    r->shape[2] = dopt_buf_flat(r->gapped, SH_GAPPED_N, sh_gapped, 3);
    r->shape[3] = dopt_buf_scatter(r->spans, 3);
    memset(&ccfg, 0, sizeof ccfg);
    ccfg.codec = DOPT_CODEC_TERNARY;
    ccfg.seed = 11;
    memset(r->sentinel, 0x5A, sizeof r->sentinel); /* 1.5e16: no average of these gradients */
    for (k = 0; k < SH_SHAPES; k++) {
        memset(&cfg, 0, sizeof cfg);
        cfg.weighted = r->via == SH_WEIGHTED;
        if (r->via == SH_TERNARY) {
            DT_OK(dopt_compressor_init(&r->cz[k], &ccfg, sh_segs, 3));
            cfg.grad_compressor = &r->cz[k];
        }
        DT_OK(dopt_dp_init(&r->dp[k], c, SH_N, &cfg));
        if (r->via == SH_WEIGHTED) DT_OK(dopt_dp_set_step_samples(&r->dp[k], 3.0 + c->rank));
        memcpy(r->dp[k].work, r->sentinel, sizeof r->sentinel);
    }
    if (r->via == SH_TERNARY) DT_OK(dopt_compressor_init(&r->cz[SH_SHAPES], &ccfg, sh_segs, 3));
}

/* This rank's gradients of step t into every shape (the gapped buffer's gaps hold -7). */
static void sh_fill(dopt_comm *c, sh_run *r, int t) {
    int i, k;
    for (i = 0; i < SH_N; i++) r->src[i] = (float)((i * 37 + c->rank * 101 + t * 13) % 199 - 99) * 0.01f;
    memcpy(r->flat, r->src, sizeof r->src);
    memcpy(r->tabled, r->src, sizeof r->src);
    memcpy(r->twin, r->src, sizeof r->src);
    for (i = 0; i < SH_GAPPED_N; i++) r->gapped[i] = -7.0f;
    for (k = 0; k < 3; k++) {
        memcpy(r->gapped + sh_gapped[k].offset, r->src + sh_segs[k].offset, sh_segs[k].count * sizeof(float));
        memcpy(r->spans_mem[k], r->src + sh_segs[k].offset, sh_segs[k].count * sizeof(float));
    }
}

/* What the driver did before it averaged in place: the mean of a packed copy. */
static void sh_twin_mean(dopt_comm *c, sh_run *r) {
    if (r->via == SH_TERNARY)
        DT_OK(dopt_compress_allreduce(&r->cz[SH_SHAPES], c, r->twin, SH_N));
    else if (r->via == SH_WEIGHTED)
        DT_OK(dopt_allreduce_weighted_mean(c, r->twin, SH_N, DOPT_F32, 3.0 + c->rank));
    else
        DT_OK(dopt_allreduce(c, r->twin, SH_N, DOPT_F32, DOPT_MEAN));
}

/* Every shape's average equals the twin's, bit for bit; the gaps are not written; the in-place
   shapes leave the workspace as filled, the packed ones leave the average there. */
static void sh_check(dopt_comm *c, sh_run *r, int t) {
    int i, k;
    DT_CHECKF(memcmp(r->flat, r->twin, sizeof r->twin) == 0, "rank %d step %d: flat", c->rank, t);
    DT_CHECKF(memcmp(r->tabled, r->twin, sizeof r->twin) == 0, "rank %d step %d: flat with a table", c->rank, t);
    for (k = 0; k < 3; k++) {
        DT_CHECKF(memcmp(r->gapped + sh_gapped[k].offset, r->twin + sh_segs[k].offset,
                         sh_segs[k].count * sizeof(float)) == 0, "rank %d step %d: gapped, segment %d", c->rank, t, k);
        DT_CHECKF(memcmp(r->spans_mem[k], r->twin + sh_segs[k].offset, sh_segs[k].count * sizeof(float)) == 0,
                  "rank %d step %d: scatter, span %d", c->rank, t, k);
    }
    for (i = 0; i < SH_GAPPED_N; i++)
        DT_CHECKF(!(i == 0 || i == 201 || i == 202 || (i >= 903 && i < 906)) || r->gapped[i] == -7.0f,
                  "rank %d step %d: the gap element %d was written", c->rank, t, i);
    for (k = 0; k < SH_SHAPES; k++)
        DT_CHECKF(memcmp(r->dp[k].work, k < 2 ? r->sentinel : r->twin, sizeof r->twin) == 0,
                  "rank %d step %d, shape %d: the workspace %s", c->rank, t, k,
                  k < 2 ? "was written: the flat gradients were copied" : "does not hold the packed average");
}

/* A flat gradient buffer (with or without a segment table) is averaged in place, without a copy
   into the driver's workspace; a table with gaps and a scatter list go through the workspace.
   All four give bitwise what the mean of a packed copy gives (fp32, weighted, TernGrad). */
static void body_shapes(dopt_comm *c, void *arg) {
    sh_run *r = (sh_run *)calloc(1, sizeof *r);
    int t, k;
    DT_CHECK(r != NULL);
    r->via = *(const sh_via *)arg;
    sh_setup(c, r);
    for (t = 0; t < 5; t++) {
        sh_fill(c, r, t);
        for (k = 0; k < SH_SHAPES; k++) DT_OK(dopt_dp_after_backward_buf(&r->dp[k], &r->shape[k]));
        sh_twin_mean(c, r);
        sh_check(c, r, t);
    }
    for (k = 0; k < SH_SHAPES; k++) dopt_dp_free(&r->dp[k]);
    if (r->via == SH_TERNARY)
        for (k = 0; k <= SH_SHAPES; k++) dopt_compressor_free(&r->cz[k]);
    for (k = 0; k < 3; k++) free(r->spans_mem[k]);
    free(r);
}

DTEST_WORLDS_EACH(a_flat_gradient_is_averaged_in_place_bitwise_as_a_packed_one, body_shapes, sh_vias, 2, 3);

/* ------------------------------------------------------------------ CELGC */

#define CG_STEPS 120
#define CG_PERIOD 4

/* Noisy least squares started far away so that the clip binds early and not late. */
static void celgc_grad(const lsq *p, const float *x, float *g, int rank, int size, int t) {
    lsq_grad(p, x, g, rank, size, (uint64_t)t, 2);
}

/* The reference rule, written out: step = min(eta, gamma/(|g| + 1e-10)); x -= step g. */
static int ref_celgc_update(float *x, const float *g, float eta, float gamma) {
    double norm = sqrt(dopt_sumsq(g, LS_D)), lim = (double)gamma / (norm + 1e-10);
    float step = (float)(lim < eta ? lim : (double)eta), a = step * 1.0f;
    int j;
    for (j = 0; j < LS_D; j++) x[j] = 1.0f * x[j] - a * g[j];
    return lim < eta;
}

static void body_celgc_reference(dopt_comm *c, void *arg) {
    const int period = *(const int *)arg;
    static lsq p;
    float x[LS_D], xe[LS_D], xs[LS_D], g[LS_D];
    const float eta = 0.05f, gamma = 0.5f;
    dopt_dp ls;
    dopt_dp_config cfg;
    int t, j, clipped = 0, unclipped = 0;
    lsq_make(&p);
    memset(&cfg, 0, sizeof cfg);
    cfg.period = (size_t)period;
    DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
    for (j = 0; j < LS_D; j++) x[j] = xe[j] = xs[j] = p.xstar[j] + 3.0f;
    DT_OK(dopt_dp_broadcast(&ls, x));
    for (t = 0; t < CG_STEPS; t++) {
        /* reference 1: the paper's code, averaging at the start of steps 0, I, 2I, ... */
        if (t % period == 0) DT_OK(dopt_allreduce(c, xs, LS_D, DOPT_F32, DOPT_MEAN));
        celgc_grad(&p, xs, g, c->rank, c->size, t);
        ref_celgc_update(xs, g, eta, gamma);
        /* reference 2: the same, averaging at the end of steps I-1, 2I-1, ... */
        celgc_grad(&p, xe, g, c->rank, c->size, t);
        if (ref_celgc_update(xe, g, eta, gamma)) clipped++; else unclipped++;
        if ((t + 1) % period == 0) DT_OK(dopt_allreduce(c, xe, LS_D, DOPT_F32, DOPT_MEAN));
        /* the composition */
        celgc_grad(&p, x, g, c->rank, c->size, t);
        DT_OK(dopt_dp_celgc_step(&ls, &(dopt_buf){.data = x, .n = LS_D}, &(dopt_buf){.data = g, .n = LS_D},
                                 &(dopt_celgc){.eta = eta, .gamma = gamma}));
        DT_CHECKF(same_as_reference(x, xe, LS_D), "rank %d step %d: differs from the end-of-step reference", c->rank, t);
    }
    DT_OK(dopt_allreduce(c, xs, LS_D, DOPT_F32, DOPT_MEAN)); /* the start of step CG_STEPS */
    DT_CHECKF(clipped > 5 && unclipped > 5, "the clip should bind sometimes: %d clipped, %d not", clipped, unclipped);
    /* The start-of-step schedule differs only by the rounding of the mean of equal models at
       step 0 (once the reference has averaged at the start of the step after the last). */
    DT_CHECKF(dist_to(x, xs, LS_D) < 1e-4 * (1.0 + sqrt(dopt_sumsq(xs, LS_D))), "rank %d: start-of-step reference "
              "differs by %g", c->rank, dist_to(x, xs, LS_D));
    dopt_dp_free(&ls);
}

/* At period 1 without sync_grads this is CELGC at I = 1 as the paper runs it: each worker clips
   its own gradient, the models are averaged after every step. */
static const int celgc_periods[2] = {CG_PERIOD, 1};
DTEST_WORLDS_EACH(celgc_matches_hand_written_reference_loop_at_periods_4_and_1, body_celgc_reference, celgc_periods, 2,
                  4);

/* A NaN, +inf or -inf in the gradient: the worker skips its update and says so, the step still
   counts (the average comes when due), and the next finite step goes on. The values are made
   from their bits, as the -ffast-math builds of this suite need. */
DTEST(celgc_step_with_a_nonfinite_gradient_skips_the_update) {
    static const uint32_t bad[3] = {0x7FC00000u, 0x7F800000u, 0xFF800000u};
    dopt_comm *c;
    dopt_dp ls;
    dopt_dp_config cfg;
    float x[4] = {1, 2, 3, 4}, before[4], g[4];
    int i;
    DT_OK(dopt_comm_create_self(&c));
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 2;
    DT_OK(dopt_dp_init(&ls, c, 4, &cfg));
    for (i = 0; i < 3; i++) {
        g[0] = g[1] = g[2] = g[3] = 0.5f;
        memcpy(&g[i + 1], &bad[i], sizeof(float));
        memcpy(before, x, sizeof x);
        DT_EQ_INT(dopt_dp_celgc_step(&ls, &(dopt_buf){.data = x, .n = 4}, &(dopt_buf){.data = g, .n = 4},
                                     &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}), DOPT_ERR_NONFINITE);
        DT_CHECK(memcmp(x, before, sizeof x) == 0);
        DT_EQ_INT(ls.step, i + 1);
    }
    g[0] = g[1] = g[2] = g[3] = 0.5f;
    DT_OK(dopt_dp_celgc_step(&ls, &(dopt_buf){.data = x, .n = 4}, &(dopt_buf){.data = g, .n = 4},
                             &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}));
    DT_CHECK(x[0] == 1.0f - 0.05f && x[3] == 4.0f - 0.05f);
    dopt_dp_free(&ls);
    dopt_comm_destroy(c);
}

/* The rule's defaults and its states: a zero scale steps as scale 1 does, bit for bit; the
   driver's state buffers come with the rule (averaged with the model); a rule without them, or
   no rule, is refused before the step is counted. */
DTEST(celgc_rule_zero_scale_is_one_and_carries_the_states) {
    dopt_comm *c;
    dopt_dp a, b;
    dopt_dp_config cfg;
    dopt_state_desc st[1] = {{3, DOPT_STATE_AVERAGE, "momentum"}};
    float xa[6], xb[6], g[6], ma[3] = {1, 2, 3}, mb[3] = {1, 2, 3};
    dopt_buf sa = dopt_buf_flat(ma, 3, NULL, 0), sb = dopt_buf_flat(mb, 3, NULL, 0);
    int i, t;
    DT_OK(dopt_comm_create_self(&c));
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 2;
    cfg.states = st;
    cfg.nstates = 1;
    DT_OK(dopt_dp_init(&a, c, 6, &cfg));
    DT_OK(dopt_dp_init(&b, c, 6, &cfg));
    for (i = 0; i < 6; i++) xa[i] = xb[i] = 0.25f * (float)i - 0.5f;
    DT_EQ_INT(dopt_dp_celgc_step(&a, &(dopt_buf){.data = xa, .n = 6}, &(dopt_buf){.data = g, .n = 6}, NULL),
              DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&a), "rule") != NULL, "detail: %s", dopt_dp_detail(&a));
    DT_EQ_INT(dopt_dp_celgc_step(&a, &(dopt_buf){.data = xa, .n = 6}, &(dopt_buf){.data = g, .n = 6},
                                 &(dopt_celgc){.eta = 0.5f, .gamma = 0.1f}), DOPT_ERR_INVALID); /* states missing */
    DT_EQ_INT(a.step, 0);
    for (t = 0; t < 5; t++) {
        for (i = 0; i < 6; i++) g[i] = xa[i] + 0.1f * (float)(i + t);
        DT_OK(dopt_dp_celgc_step(&a, &(dopt_buf){.data = xa, .n = 6}, &(dopt_buf){.data = g, .n = 6},
                                 &(dopt_celgc){.eta = 0.5f, .gamma = 0.1f, .weight_decay = 0.01f, .states = &sa}));
        for (i = 0; i < 6; i++) g[i] = xb[i] + 0.1f * (float)(i + t);
        DT_OK(dopt_dp_celgc_step(&b, &(dopt_buf){.data = xb, .n = 6}, &(dopt_buf){.data = g, .n = 6},
                                 &(dopt_celgc){.eta = 0.5f, .gamma = 0.1f, .weight_decay = 0.01f, .scale = 1.0f,
                                               .states = &sb}));
    }
    DT_CHECK(memcmp(xa, xb, sizeof xa) == 0 && xa[0] != -0.5f);
    DT_EQ_INT(a.step, 5);
    dopt_dp_free(&a);
    dopt_dp_free(&b);
    dopt_comm_destroy(c);
}

/* The across-worker estimator reads a model delta as a gradient sum; CELGC's clipped steps are
   not one, and the driver refuses the pair before any communication. */
DTEST(celgc_with_the_across_worker_batch_estimator_is_refused) {
    dopt_comm *c;
    dopt_batch bc;
    dopt_batch_config bcfg;
    dopt_dp ls;
    dopt_dp_config cfg;
    float x[2] = {0, 0}, g[2] = {1, 1};
    DT_OK(dopt_comm_create_self(&c));
    memset(&bcfg, 0, sizeof bcfg);
    bcfg.estimator = DOPT_BATCH_ACROSS;
    DT_OK(dopt_batch_init(&bc, 0, &bcfg));
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 2;
    cfg.batch = &bc;
    DT_OK(dopt_dp_init(&ls, c, 2, &cfg));
    DT_EQ_INT(dopt_dp_celgc_step(&ls, &(dopt_buf){.data = x, .n = 2}, &(dopt_buf){.data = g, .n = 2},
                                 &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}), DOPT_ERR_INVALID);
    DT_CHECK(strstr(dopt_dp_detail(&ls), "DOPT_BATCH_WITHIN") != NULL);
    DT_CHECK(ls.step == 0 && x[0] == 0.0f);
    dopt_dp_free(&ls);
    dopt_batch_free(&bc);
    dopt_comm_destroy(c);
}

/* With I = 1 and sync_grads, every rank averages the gradient then takes the clipped step with
   the averaged gradient's norm: synchronous clipped SGD. */
static void body_celgc_synchronous(dopt_comm *c, void *arg) {
    static lsq p;
    float x[LS_D], xr[LS_D], g[LS_D], gr[LS_D];
    dopt_dp ls;
    dopt_dp_config cfg;
    int t, j;
    (void)arg;
    lsq_make(&p);
    memset(&cfg, 0, sizeof cfg);
    cfg.sync_grads = 1;
    DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
    for (j = 0; j < LS_D; j++) x[j] = xr[j] = p.xstar[j] + 3.0f;
    for (t = 0; t < 60; t++) {
        celgc_grad(&p, xr, gr, c->rank, c->size, t);
        DT_OK(dopt_allreduce(c, gr, LS_D, DOPT_F32, DOPT_MEAN));
        ref_celgc_update(xr, gr, 0.05f, 0.5f);
        celgc_grad(&p, x, g, c->rank, c->size, t);
        DT_OK(dopt_dp_celgc_step(&ls, &(dopt_buf){.data = x, .n = LS_D}, &(dopt_buf){.data = g, .n = LS_D},
                                 &(dopt_celgc){.eta = 0.05f, .gamma = 0.5f}));
        DT_CHECK(same_as_reference(x, xr, LS_D));
        DT_CHECK(same_as_reference(g, gr, LS_D)); /* the gradient was averaged in place */
    }
    DT_CHECK(world_same_on_every_rank(c, x, sizeof x));
    dopt_dp_free(&ls);
}

DTEST_WORLDS(celgc_period_1_with_gradient_averaging_is_synchronous_clipped_sgd, body_celgc_synchronous, NULL, 2, 4);

/* f(x) = Σ x_i⁴ / 4 (gradient x³: (L0, L1)-smooth, not L-smooth), gradients with noise. From x_i = 5
   a fixed step of 0.1 overshoots (0.1·3·25 > 2) and blows up; CELGC's step adapts. */
#define QD 10
static void quartic_grad(const float *x, float *g, int rank, int t) {
    dopt_rng rng;
    float u[QD];
    int j;
    dopt_rng_init(&rng, 5, rank, (uint64_t)t);
    dopt_rng_uniform(&rng, 0, u, QD);
    for (j = 0; j < QD; j++) g[j] = x[j] * x[j] * x[j] + 0.2f * (u[j] - 0.5f);
}

static double quartic(const float *x) {
    double f = 0.0;
    int j;
    for (j = 0; j < QD; j++) f += (double)x[j] * x[j] * x[j] * x[j] / 4.0;
    return f;
}

static void body_quartic(dopt_comm *c, void *arg) {
    float x[QD], y[QD], g[QD];
    dopt_dp ls, lf;
    dopt_dp_config cfg;
    dopt_status lf_status = DOPT_OK;
    int t, j, finite = 1;
    (void)arg;
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    DT_OK(dopt_dp_init(&ls, c, QD, &cfg));
    DT_OK(dopt_dp_init(&lf, c, QD, &cfg));
    for (j = 0; j < QD; j++) x[j] = y[j] = 5.0f;
    for (t = 0; t < 400; t++) {
        quartic_grad(x, g, c->rank, t);
        DT_OK(dopt_dp_celgc_step(&ls, &(dopt_buf){.data = x, .n = QD}, &(dopt_buf){.data = g, .n = QD},
                                 &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}));
        if (t < 40) { /* fixed-step local SGD with the same schedule */
            quartic_grad(y, g, c->rank, t);
            for (j = 0; j < QD; j++) y[j] -= 0.1f * g[j];
            lf_status = dopt_dp_after_step(&lf, y); /* the diverged average is refused: non-finite */
            DT_CHECKF(lf_status == DOPT_OK || lf_status == DOPT_ERR_NONFINITE, "%s", dopt_status_str(lf_status));
        }
    }
    for (j = 0; j < QD; j++)
        if (!dopt__is_finite(y[j]) || fabsf(y[j]) >= 1e6f) finite = 0; /* bits: -ffast-math folds NaN compares */
    DT_CHECKF(!finite, "rank %d: fixed-step SGD should have diverged, f = %g", c->rank, quartic(y));
    DT_CHECKF(dopt_all_finite(y, QD) || lf_status == DOPT_ERR_NONFINITE, "rank %d: a non-finite model went unnamed",
              c->rank);
    DT_CHECKF(quartic(x) < 1e-2, "rank %d: CELGC should converge: f = %g from %g", c->rank, quartic(x),
              QD * 625.0 / 4.0);
    DT_CHECK(world_same_on_every_rank(c, x, sizeof x)); /* the run ends on an average (400 = 100·4) */
    dopt_dp_free(&ls);
    dopt_dp_free(&lf);
}

DTEST_WORLDS(celgc_converges_on_a_quartic_where_fixed_step_sgd_diverges, body_quartic, NULL, 2, 4);

/* ------------------------------------------------------------------ the anchor before it is set */

/* Each reader of the anchor — compressed model deltas, the outer step, the across-worker batch
   estimator — refuses a step before a broadcast (or a load) set it, naming itself and the call
   that sets it; a broadcast lets the same step through. keep_anchor alone reads nothing. */
DTEST(a_step_that_needs_the_anchor_before_a_broadcast_is_refused_and_says_which_reader) {
    static const char *const who[4] = {"compressed model deltas", "outer optimizer", "across-worker", NULL};
    dopt_comm *c;
    dopt_compressor cz;
    dopt_compressor_config ccfg;
    dopt_segment seg = {0, 4, "x"};
    dopt_batch bc;
    dopt_batch_config bcfg;
    float x[4] = {1, 2, 3, 4}, g1[4] = {1, 1, 1, 1};
    int k;
    DT_OK(dopt_comm_create_self(&c));
    memset(&ccfg, 0, sizeof ccfg);
    ccfg.codec = DOPT_CODEC_TOPK;
    ccfg.topk_ratio = 0.5;
    DT_OK(dopt_compressor_init(&cz, &ccfg, &seg, 1));
    memset(&bcfg, 0, sizeof bcfg);
    bcfg.estimator = DOPT_BATCH_ACROSS;
    DT_OK(dopt_batch_init(&bc, 0, &bcfg));
    for (k = 0; k < 4; k++) {
        dopt_dp dp;
        dopt_dp_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.period = 2;
        cfg.compressor = k == 0 ? &cz : NULL;
        cfg.outer_lr = k == 1 ? 0.7 : 0.0;
        cfg.batch = k == 2 ? &bc : NULL;
        cfg.keep_anchor = k == 3;
        DT_OK(dopt_dp_init(&dp, c, 4, &cfg));
        if (who[k]) {
            DT_EQ_INT(dopt_dp_after_step(&dp, x), DOPT_ERR_INVALID);
            DT_CHECKF(strstr(dopt_dp_detail(&dp), who[k]) && strstr(dopt_dp_detail(&dp), "dopt_dp_broadcast") &&
                          strstr(dopt_dp_detail(&dp), "dopt_dp_after_step"),
                      "detail: %s", dopt_dp_detail(&dp));
            DT_EQ_INT(dopt_dp_after_backward(&dp, x), DOPT_ERR_INVALID);
            if (k != 2) { /* (CELGC refuses ACROSS first) the refusal comes before the step moves x */
                dopt_buf xb = dopt_buf_flat(x, 4, NULL, 0), gb = dopt_buf_flat(g1, 4, NULL, 0);
                DT_EQ_INT(dopt_dp_celgc_step(&dp, &xb, &gb, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}),
                          DOPT_ERR_INVALID);
                DT_CHECK(strstr(dopt_dp_detail(&dp), "dopt_dp_celgc_step") != NULL);
                DT_CHECK(x[0] == 1 && x[3] == 4);
            }
            DT_EQ_INT(dp.step, 0); /* nothing counted */
            DT_OK(dopt_dp_broadcast(&dp, x));
        }
        DT_OK(dopt_dp_after_step(&dp, x));
        DT_OK(dopt_dp_after_step(&dp, x)); /* the round's average */
        DT_EQ_INT(dp.syncs, 1);
        DT_CHECK(x[0] == 1 && x[3] == 4); /* one rank, no movement: the average is the model itself */
        dopt_dp_free(&dp);
    }
    dopt_batch_free(&bc);
    dopt_compressor_free(&cz);
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ batch-size tests: the rule */

/* The two projections, in the order the tests below index them. */
static const dopt_batch_projection proj_modes[2] = {DOPT_BATCH_PROJECT_EXACT, DOPT_BATCH_PROJECT_PREVIOUS};

static dopt_batch_stats stats(double samples, double g2, double var, double ip, double orth) {
    dopt_batch_stats s;
    s.samples = samples;
    s.grad_norm2 = g2;
    s.var = var;
    s.ip_var = ip;
    s.orth_var = orth;
    s.workers = 1.0;
    return s;
}

DTEST(norm_test_matches_hand_values_rounded_capped_and_monotone) {
    dopt_batch_config c;
    dopt_batch_stats s;
    double need;
    memset(&c, 0, sizeof c);
    c.test = DOPT_BATCH_NORM;
    c.eta = 0.5;
    c.unit_samples = 4;
    c.max_units = 100;
    c.multiple = 2;
    /* Var/b = 40/4 = 10 > η²‖g‖² = 1: b_needed = 40/(0.25·4) = 40 samples = 10 units */
    s = stats(4, 4, 40, NAN, NAN);
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, &need), 10);
    DT_NEAR(need, 40.0, 1e-12);
    s.var = 36; /* 36 samples = 9 units, rounded up to a multiple of 2 */
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, &need), 10);
    s.var = 42; /* 42 samples = 10.5 units: 11, then a multiple of 2 */
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, &need), 12);
    c.multiple = 1;
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, &need), 11); /* rounded up, not down */
    c.multiple = 2;
    s.var = 3; /* passes: 3 ≤ 4 samples */
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, &need), 1);
    DT_NEAR(need, 3.0, 1e-12);
    s.var = 4000; /* 1000 units, capped */
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, NULL), 100);
    s.var = 1e300; /* beyond size_t: still the cap */
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, NULL), 100);
    s.var = 40; /* monotone: 10 units needed, 20 held */
    DT_EQ_INT(dopt_batch_next_units(&c, 20, &s, NULL), 20);
    s.grad_norm2 = -0.5; /* the noise accounts for all of ‖ḡ‖²: no batch is enough, the cap */
    DT_EQ_INT(dopt_batch_next_units(&c, 3, &s, &need), 100);
    DT_CHECK(!dopt__is_finite(need) && need > 0.0);
    s.var = 0.0; /* no gradient and no noise: no decision */
    s.grad_norm2 = 0.0;
    DT_EQ_INT(dopt_batch_next_units(&c, 3, &s, &need), 3);
    DT_CHECK(dopt__is_nan(need));
    s = stats(4, 4, NAN, NAN, NAN);
    DT_EQ_INT(dopt_batch_next_units(&c, 3, &s, NULL), 3);
}

/* The communicator's warnings whose text holds every one of the needles (NULL ends the list). */
typedef struct warning_count {
    const char *needles[4];
    int count;
} warning_count;

static void count_warnings_with(void *user, dopt_log_level level, const char *msg) {
    warning_count *w = (warning_count *)user;
    int i;
    if (level != DOPT_LOG_WARN) return;
    for (i = 0; i < 4 && w->needles[i]; i++)
        if (!strstr(msg, w->needles[i])) return;
    w->count++;
}

/* max_growth bounds one decision (×G, rounded up, at least one unit more); a non-positive
   estimate of ‖∇F‖² (bias-corrected, noise larger than the gradient) goes to the cap, or ×G, and
   says so with a warning naming the decision and the estimate. */

DTEST(max_growth_bounds_a_decision_and_a_nonpositive_estimate_warns) {
    dopt_batch_config c;
    dopt_batch_stats s;
    dopt_comm *comm;
    dopt_batch bc;
    static const float v[2][1] = {{1}, {-1}}; /* mean 0, spread 2: bias-corrected ‖∇F‖² = 0 − 2/2 = −1 */
    double need;
    int i;
    memset(&c, 0, sizeof c);
    c.unit_samples = 1;
    c.max_units = 1000;
    c.eta = 1.0;
    s = stats(2, 1, 100, NAN, NAN); /* 100 samples needed */
    DT_EQ_INT(dopt_batch_next_units(&c, 2, &s, &need), 100);
    c.max_growth = 4.0;
    DT_EQ_INT(dopt_batch_next_units(&c, 2, &s, &need), 8);
    DT_NEAR(need, 100.0, 1e-12); /* the answer is still the test's */
    c.max_growth = 1.0; /* at least one unit more when the test asks for more */
    DT_EQ_INT(dopt_batch_next_units(&c, 2, &s, NULL), 3);
    c.max_growth = 4.0;
    s.workers = 10.0; /* a synchronous round of 10 workers: 10 samples each */
    DT_EQ_INT(dopt_batch_next_units(&c, 2, &s, NULL), 8);
    DT_EQ_INT(dopt_batch_next_units(&c, 4, &s, NULL), 10);
    c.multiple = 4; /* the ×G bound is rounded up to a multiple too: 4 × 1.5 = 6 → 8 */
    c.max_growth = 1.5;
    s.workers = 1.0;
    DT_EQ_INT(dopt_batch_next_units(&c, 4, &s, NULL), 8);
    s.var = 5; /* 5 units needed: 8, the next multiple */
    DT_EQ_INT(dopt_batch_next_units(&c, 4, &s, NULL), 8);
    c.multiple = 1;
    s.var = 100;
    c.max_growth = 0.5; /* below 1: refused by init */
    DT_EQ_INT(dopt_batch_init(&bc, 1, &c), DOPT_ERR_INVALID);
    for (i = 0; i < 2; i++) {
        warning_count growth_warnings = {{"decision 1:", "is -1 ", "from 2 to", NULL}, 0};
        DT_OK(dopt_comm_create_self(&comm));
        dopt_comm_set_log(comm, count_warnings_with, &growth_warnings);
        c.max_growth = i == 0 ? 0.0 : 4.0;
        c.bias_corrected = 1;
        c.initial_units = 2;
        DT_OK(dopt_batch_init(&bc, 1, &c));
        DT_OK(observe_flat(&bc, v[0], 1));
        DT_OK(observe_flat(&bc, v[1], 1));
        DT_OK(dopt_batch_decide(&bc, comm));
        DT_NEAR(bc.last.grad_norm2, -1.0, 1e-12);
        DT_EQ_INT(dopt_batch_units(&bc), i == 0 ? 1000 : 8);
        DT_EQ_INT(bc.nonpositive, 1);
        DT_EQ_INT(growth_warnings.count, 1);
        dopt_batch_free(&bc);
        dopt_comm_destroy(comm);
    }
}

/* AUTO: EXACT for the inner-product tests when its (max_units + 1)·n floats fit
   DOPT_BATCH_EXACT_BYTES, PREVIOUS beyond (one WARN at the first decision saying why and how to
   force EXACT); the norm test projects nothing and takes PREVIOUS's n floats, silently. */

DTEST(auto_projection_is_exact_where_it_fits_and_says_when_it_is_not) {
    enum { N = 1000 };
    static float v[N];
    dopt_batch_config c;
    dopt_batch bc;
    dopt_comm *comm;
    int k, t;
    DT_OK(dopt_comm_create_self(&comm));
    warning_count projection_warnings = {{"DOPT_BATCH_PROJECT_PREVIOUS", "DOPT_BATCH_EXACT_BYTES", NULL, NULL}, 0};
    dopt_comm_set_log(comm, count_warnings_with, &projection_warnings);
    for (k = 0; k < 3; k++) {
        memset(&c, 0, sizeof c);
        c.test = k == 2 ? DOPT_BATCH_NORM : DOPT_BATCH_INNER_PRODUCT;
        c.initial_units = 2;
        /* k = 1: (max_units + 1)·N floats one float beyond the limit */
        c.max_units = k == 0 ? 64 : DOPT_BATCH_EXACT_BYTES / sizeof(float) / N;
        projection_warnings.count = 0;
        DT_OK(dopt_batch_init(&bc, N, &c));
        DT_EQ_INT(bc.cfg.projection, k == 0 ? DOPT_BATCH_PROJECT_EXACT : DOPT_BATCH_PROJECT_PREVIOUS);
        DT_CHECK((bc.micro != NULL) == (k == 0));
        for (t = 0; t < 2; t++) {
            v[0] = (float)t + 1.0f;
            DT_OK(observe_flat(&bc, v, N));
            DT_OK(observe_flat(&bc, v, N));
            DT_OK(dopt_batch_decide(&bc, comm));
        }
        DT_EQ_INT(projection_warnings.count, k == 1 ? 1 : 0); /* once, not at every decision */
        dopt_batch_free(&bc);
    }
    dopt_comm_destroy(comm);
}

/* A step whose micro-batch gradients are not finite adds nothing to the round (it is counted in
   steps_dropped): the next decision is taken from the finite steps alone, even with history. */
DTEST(a_step_with_a_non_finite_micro_batch_is_left_out_of_the_statistics) {
    dopt_batch bc, ref;
    dopt_batch_config c;
    static const float a[2] = {1, 0}, b[2] = {3, 2}, bad[2] = {NAN, 1};
    int t;
    memset(&c, 0, sizeof c);
    c.unit_samples = 2;
    c.initial_units = 2;
    c.history = 0.5;
    DT_OK(dopt_batch_init(&bc, 2, &c));
    DT_OK(dopt_batch_init(&ref, 2, &c));
    for (t = 0; t < 3; t++) {
        DT_OK(observe_flat(&bc, a, 2));
        DT_OK(observe_flat(&bc, t == 1 ? bad : b, 2));
        dopt_batch_end_step(&bc);
        if (t != 1) { /* the reference never sees the bad step */
            DT_OK(observe_flat(&ref, a, 2));
            DT_OK(observe_flat(&ref, b, 2));
            dopt_batch_end_step(&ref);
        }
        DT_OK(dopt_batch_decide(&bc, NULL));
        DT_OK(dopt_batch_decide(&ref, NULL));
    }
    DT_EQ_INT(bc.steps_dropped, 1);
    DT_CHECK(dopt__is_finite(bc.last.var) && dopt__is_finite(bc.last.grad_norm2));
    DT_CHECK(bc.last.var == ref.last.var && bc.last.grad_norm2 == ref.last.grad_norm2);
    dopt_batch_free(&bc);
    dopt_batch_free(&ref);
}

/* The rule divides by the round's own workers: with history, a local round after synchronous
   ones compares each worker's batch at once (workers = 1), not a pooled mean of N and 1. */
DTEST(history_pools_the_statistics_but_not_the_workers_of_the_rule) {
    dopt_batch bc;
    dopt_batch_config c;
    static const float a[2] = {1, 0}, b[2] = {3, 2};
    int t;
    memset(&c, 0, sizeof c);
    c.unit_samples = 2;
    c.initial_units = 2;
    c.history = 0.9;
    DT_OK(dopt_batch_init(&bc, 2, &c));
    for (t = 0; t < 5; t++) {
        DT_OK(observe_flat(&bc, a, 2));
        DT_OK(observe_flat(&bc, b, 2));
        dopt_batch_averaged(&bc, 8);
        DT_OK(dopt_batch_decide(&bc, NULL));
        DT_NEAR(bc.last.workers, 8.0, 0.0);
    }
    DT_OK(observe_flat(&bc, a, 2));
    DT_OK(observe_flat(&bc, b, 2));
    DT_OK(dopt_batch_decide(&bc, NULL));
    DT_NEAR(bc.last.workers, 1.0, 0.0);
    dopt_batch_free(&bc);
}

DTEST(inner_product_and_augmented_tests_match_hand_values) {
    dopt_batch_config c;
    dopt_batch_stats s = stats(4, 4, 100, 10, 80);
    double need;
    memset(&c, 0, sizeof c);
    c.test = DOPT_BATCH_INNER_PRODUCT;
    c.theta = 0.5;
    c.nu = 0.5; /* θ, ν ≠ 1: squared, not as they are */
    c.unit_samples = 4;
    c.max_units = 100;
    c.multiple = 2;
    /* ip: 10/(0.25·4) = 10 samples → 3 units → 4 */
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, &need), 4);
    DT_NEAR(need, 10.0, 1e-12);
    /* augmented: max(10, 80/(0.25·4) = 80) = 80 samples → 20 units */
    c.test = DOPT_BATCH_AUGMENTED;
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, &need), 20);
    DT_NEAR(need, 80.0, 1e-12);
    s.orth_var = 4; /* orthogonality passes (4 samples), inner product decides */
    DT_EQ_INT(dopt_batch_next_units(&c, 1, &s, &need), 4);
    DT_NEAR(need, 10.0, 1e-12);
}

/* One step of three micro-batch gradients of 2 samples each, by hand: v = (1,0), (3,2), (2,1);
   mean (2,1), ‖mean‖² = 5; Σ‖v − mean‖² = 2 + 2 + 0 = 4, k − 1 = 2: τ² = 2 per micro-batch, so
   Var = 2·2 = 4 per sample. ‖∇F‖²: plain (a local step) 5; bias-corrected 5 − τ²/3 = 13/3; plain
   on a synchronous step of 4 workers 5 − (1 − 1/4)·τ²/3 = 4.5. Projections on the step's own
   direction (2,1)/√5: 2/√5, 8/√5, 5/√5 → Σ(p − p̄)² = 18/5: ip_var = 2·(18/5)/2 = 3.6, orth_var
   = 0.4. Norm test with η = 0.5: local, b_needed = 4/(0.25·5) = 3.2 > 2 → 2 units; bias-corrected
   4/(0.25·13/3) = 3.69 → 2 units; synchronous over 4 workers 4/(0.25·4.5) = 3.56 samples of the
   averaged gradient, 0.89 per worker ≤ 2: the size stays. */
DTEST(within_worker_estimator_matches_hand_computation) {
    dopt_batch bc;
    dopt_batch_config c;
    static const float r1[3][2] = {{1, 0}, {3, 2}, {2, 1}};
    float sum_form[2];
    dopt_buf sb = dopt_buf_flat(sum_form, 2, NULL, 0);
    int i;
    memset(&c, 0, sizeof c);
    c.eta = 0.5;
    c.theta = 0.5;
    c.unit_samples = 2;
    c.test = DOPT_BATCH_NORM;
    c.projection = DOPT_BATCH_PROJECT_EXACT;
    DT_OK(dopt_batch_init(&bc, 2, &c));
    DT_EQ_INT(dopt_batch_units(&bc), 1);
    /* through the _buf form with a scale: -2 times a summed buffer is the same mean */
    for (i = 0; i < 3; i++) {
        sum_form[0] = -r1[i][0] / 2.0f;
        sum_form[1] = -r1[i][1] / 2.0f;
        DT_OK(dopt_batch_observe(&bc, &sb, -2.0f));
    }
    DT_OK(dopt_batch_decide(&bc, NULL)); /* closes the open step */
    DT_NEAR(bc.last.grad_norm2, 5.0, 1e-12);
    DT_NEAR(bc.last.var, 4.0, 1e-12);
    DT_NEAR(bc.last.ip_var, 3.6, 1e-6);
    DT_NEAR(bc.last.orth_var, 0.4, 1e-6);
    DT_NEAR(bc.last.samples, 2.0, 0.0);
    DT_NEAR(bc.last.workers, 1.0, 0.0);
    DT_EQ_INT(dopt_batch_units(&bc), 2);
    DT_EQ_INT(observe_flat(&bc, r1[0], 3), DOPT_ERR_INVALID); /* another element count */
    dopt_batch_free(&bc);
    for (i = 0; i < 2; i++) { /* bias-corrected; then plain on a synchronous step of 4 workers */
        c.bias_corrected = i == 0;
        DT_OK(dopt_batch_init(&bc, 2, &c));
        DT_OK(dopt_batch_observe(&bc, &(dopt_buf){.data = (float *)r1[0], .n = 2}, 1.0f));
        DT_OK(dopt_batch_observe(&bc, &(dopt_buf){.data = (float *)r1[1], .n = 2}, 1.0f));
        DT_OK(dopt_batch_observe(&bc, &(dopt_buf){.data = (float *)r1[2], .n = 2}, 1.0f));
        if (i == 1) dopt_batch_averaged(&bc, 4);
        DT_OK(dopt_batch_decide(&bc, NULL));
        DT_NEAR(bc.last.grad_norm2, i == 0 ? 13.0 / 3.0 : 4.5, 1e-12);
        DT_NEAR(bc.last.workers, i == 0 ? 1.0 : 4.0, 0.0);
        DT_EQ_INT(dopt_batch_units(&bc), i == 0 ? 2 : 1);
        dopt_batch_free(&bc);
    }
}

/* No sampling noise at all (every micro-batch of a step is the same gradient) but the gradient
   moves between the local steps of a round: the variance is 0. An estimator that pooled the
   round's micro-batches around one mean would report the drift: here 0.333 per sample. */
DTEST(within_variance_is_zero_without_noise_when_the_iterates_move) {
    dopt_comm *c;
    dopt_batch bc;
    dopt_batch_config bcfg;
    dopt_dp ls;
    dopt_dp_config cfg;
    float x[2] = {0, 0}, g[2];
    int t, u, proj;
    DT_OK(dopt_comm_create_self(&c));
    for (proj = 0; proj < 2; proj++) {
        memset(&bcfg, 0, sizeof bcfg);
        bcfg.test = DOPT_BATCH_AUGMENTED;
        bcfg.initial_units = 2;
        bcfg.projection = proj_modes[proj];
        DT_OK(dopt_batch_init(&bc, 2, &bcfg));
        memset(&cfg, 0, sizeof cfg);
        cfg.period = 2;
        cfg.batch = &bc;
        DT_OK(dopt_dp_init(&ls, c, 2, &cfg));
        for (t = 0; t < 6; t++) {
            g[0] = 1.0f + (float)(t % 2); /* 1, 2, 1, 2, ...: a new gradient every step */
            g[1] = 0.5f * (float)t;
            for (u = 0; u < 2; u++) DT_OK(observe_flat(&bc, g, 2));
            DT_OK(dopt_dp_after_step(&ls, x));
        }
        DT_EQ_INT(bc.decisions, 3);
        DT_CHECKF(bc.last.var == 0.0, "projection %d: Var = %g without any noise", proj, bc.last.var);
        DT_CHECK(bc.last.ip_var == 0.0 && bc.last.orth_var == 0.0);
        /* steps 4 and 5, g = (1, 2) and (2, 2.5): the mean of ‖g_t‖² with nothing to subtract */
        DT_NEAR(bc.last.grad_norm2, (5.0 + 10.25) / 2.0, 1e-12);
        DT_EQ_INT(dopt_batch_units(&bc), 2); /* no noise: the batch stays */
        dopt_dp_free(&ls);
        dopt_batch_free(&bc);
    }
    dopt_comm_destroy(c);
}

/* Gaussian noise from the library's generator (Box-Muller on its uniforms). */
static void gauss(dopt_rng *rng, uint64_t ctr, float *out, size_t n) {
    float u[2];
    size_t i;
    for (i = 0; i < n; i++) {
        dopt_rng_uniform(rng, 2 * (ctr * n + i), u, 2);
        out[i] = (float)(sqrt(-2.0 * log(1.0 - (double)u[0])) * cos(6.283185307179586 * (double)u[1]));
    }
}

/* Known noise under drift: micro-batch gradients v = μ_t + τ·z (z standard normal, D
   coordinates) with the mean μ_t moving far between the T steps of a round. Over R rounds the
   variance estimates average to D·τ² per micro-batch and the bias-corrected ‖∇F‖² to the mean of
   ‖μ_t‖², each within 5 standard errors of the R estimates (fixed seed); the uncorrected mean of
   ‖v̄_t‖² is off by D·τ²/k, more than 10 standard errors, and it is what the plain estimate (the
   default) reports on these local steps, to rounding. */
#define NZ_D 8
#define NZ_K 4
#define NZ_T 4
#define NZ_R 2000
DTEST(within_variance_under_drift_estimates_known_noise_and_unbiased_gradient_norm) {
    dopt_batch bc;
    dopt_batch_config bcfg;
    dopt_rng rng;
    float v[NZ_D], z[NZ_D];
    double tau = 2.0, sum_var = 0, sumsq_var = 0, sum_g = 0, sumsq_g = 0, true_g = 0, naive = 0;
    double var_mean, var_se, g_mean, g_se, want_var = NZ_D * tau * tau;
    int r, t, k, i;
    dopt_batch plain;
    double sum_plain = 0;
    memset(&bcfg, 0, sizeof bcfg);
    bcfg.initial_units = NZ_K;
    DT_OK(dopt_batch_init(&plain, NZ_D, &bcfg));
    bcfg.bias_corrected = 1;
    DT_OK(dopt_batch_init(&bc, NZ_D, &bcfg));
    dopt_rng_init(&rng, 77, 0, 3);
    for (t = 0; t < NZ_T; t++)
        for (i = 0; i < NZ_D; i++) true_g += pow(i == 0 ? 3.0 * t : 0.5, 2) / NZ_T;
    for (r = 0; r < NZ_R; r++) {
        for (t = 0; t < NZ_T; t++) {
            double mean[NZ_D] = {0}, m2 = 0;
            for (k = 0; k < NZ_K; k++) {
                gauss(&rng, ((uint64_t)r * NZ_T + (uint64_t)t) * NZ_K + (uint64_t)k, z, NZ_D);
                for (i = 0; i < NZ_D; i++) {
                    v[i] = (float)((i == 0 ? 3.0 * t : 0.5) + tau * z[i]); /* μ_t moves by 3 a step */
                    mean[i] += (double)v[i] / NZ_K;
                }
                DT_OK(observe_flat(&bc, v, NZ_D));
                DT_OK(observe_flat(&plain, v, NZ_D));
            }
            for (i = 0; i < NZ_D; i++) m2 += mean[i] * mean[i];
            naive += m2 / NZ_T / NZ_R;
            dopt_batch_end_step(&bc);
            dopt_batch_end_step(&plain);
        }
        DT_OK(dopt_batch_decide(&bc, NULL));
        DT_OK(dopt_batch_decide(&plain, NULL));
        sum_plain += plain.last.grad_norm2 / NZ_R;
        sum_var += bc.last.var;
        sumsq_var += bc.last.var * bc.last.var;
        sum_g += bc.last.grad_norm2;
        sumsq_g += bc.last.grad_norm2 * bc.last.grad_norm2;
    }
    var_mean = sum_var / NZ_R;
    var_se = sqrt((sumsq_var / NZ_R - var_mean * var_mean) / NZ_R);
    g_mean = sum_g / NZ_R;
    g_se = sqrt((sumsq_g / NZ_R - g_mean * g_mean) / NZ_R);
    DT_CHECKF(fabs(var_mean - want_var) < 5 * var_se, "Var %g ± %g, noise %g", var_mean, var_se, want_var);
    DT_CHECKF(fabs(g_mean - true_g) < 5 * g_se, "|grad F|^2 %g ± %g, true %g", g_mean, g_se, true_g);
    DT_CHECKF(fabs(naive - true_g) > 10 * g_se, "the uncorrected %g should be off by %g", naive, want_var / NZ_K);
    DT_NEAR(sum_plain, naive, 1e-9 * naive);
    DT_CHECK(bc.undecided == 0);
    dopt_batch_free(&bc);
    dopt_batch_free(&plain);
}

/* ------------------------------------------------------------------ projections: exact and previous */

/* A slow reference in double over every micro-batch gradient kept: per step, the spread around
   the step's own mean, the projections on the step's own mean (exact) or on the previous step's
   mean (previous), pooled with Σ(k_t − 1) degrees of freedom. */
typedef struct proj_ref {
    double var, ip_var, orth_var, grad_norm2;
} proj_ref;

static proj_ref proj_reference(const float *v, const int *ks, int steps, int d, int exact, double s_unit,
                               const double *prev_dir_in) {
    double dof = 0, ss = 0, pdof = 0, pss = 0, ptot = 0, m2sum = 0, invk = 0, prev[64] = {0};
    proj_ref out;
    int t, j, i, have_prev = prev_dir_in != NULL;
    if (have_prev) memcpy(prev, prev_dir_in, (size_t)d * sizeof(double));
    for (t = 0; t < steps; t++) {
        double mean[64] = {0}, m2 = 0, sst = 0, dir[64], dn = 0, p[64], pbar = 0, psst = 0;
        int k = ks[t];
        for (j = 0; j < k; j++)
            for (i = 0; i < d; i++) mean[i] += (double)v[j * d + i] / k;
        for (i = 0; i < d; i++) m2 += mean[i] * mean[i];
        for (j = 0; j < k; j++)
            for (i = 0; i < d; i++) sst += pow((double)v[j * d + i] - mean[i], 2);
        for (i = 0; i < d; i++) dir[i] = exact ? mean[i] : prev[i];
        for (i = 0; i < d; i++) dn += dir[i] * dir[i];
        if ((exact || have_prev) && dn > 0) {
            for (j = 0; j < k; j++) {
                p[j] = 0;
                for (i = 0; i < d; i++) p[j] += (double)v[j * d + i] * dir[i] / sqrt(dn);
                pbar += p[j] / k;
            }
            for (j = 0; j < k; j++) psst += (p[j] - pbar) * (p[j] - pbar);
            pdof += k - 1;
            pss += psst;
            ptot += sst;
        }
        dof += k - 1;
        ss += sst;
        m2sum += m2;
        invk += 1.0 / k;
        for (i = 0; i < d; i++) prev[i] = (double)(float)mean[i]; /* the library keeps it in floats */
        have_prev = 1;
        v += k * d;
    }
    out.var = s_unit * ss / dof;
    out.ip_var = s_unit * pss / pdof;
    out.orth_var = s_unit * (ptot - pss) / pdof;
    out.grad_norm2 = (m2sum - ss / dof * invk) / steps;
    return out;
}

/* Random micro-batch gradients whose mean turns between steps, 4 steps of 3, 5, 2, 4; both
   projections against the reference. */
DTEST(current_direction_statistics_equal_the_reference_in_both_modes) {
    enum { D = 12, STEPS = 4 };
    static const int ks[STEPS] = {3, 5, 2, 4};
    float v[14 * D], dirs[STEPS][D];
    dopt_rng rng;
    int mode, t, j, i, off;
    dopt_rng_init(&rng, 5, 0, 9);
    dopt_rng_uniform(&rng, 0, v, 14 * D);
    dopt_rng_uniform(&rng, 14 * D, &dirs[0][0], STEPS * D);
    for (t = 0, off = 0; t < STEPS; off += ks[t], t++)
        for (j = 0; j < ks[t]; j++)
            for (i = 0; i < D; i++) v[(off + j) * D + i] = 4.0f * dirs[t][i] - 2.0f + 2.0f * v[(off + j) * D + i];
    for (mode = 0; mode < 2; mode++) {
        dopt_batch bc;
        dopt_batch_config c;
        proj_ref want = proj_reference(v, ks, STEPS, D, mode == 0, 3.0, NULL);
        memset(&c, 0, sizeof c);
        c.test = DOPT_BATCH_AUGMENTED;
        c.unit_samples = 3;
        c.max_units = 5;
        c.bias_corrected = 1; /* the reference's ‖∇F‖² */
        c.projection = proj_modes[mode];
        DT_OK(dopt_batch_init(&bc, D, &c));
        for (t = 0, off = 0; t < STEPS; off += ks[t], t++) {
            for (j = 0; j < ks[t]; j++) DT_OK(observe_flat(&bc, v + (off + j) * D, D));
            dopt_batch_end_step(&bc);
        }
        DT_OK(dopt_batch_decide(&bc, NULL));
        DT_NEAR(bc.last.var, want.var, 1e-9 * want.var);
        DT_NEAR(bc.last.grad_norm2, want.grad_norm2, 1e-9 * fabs(want.grad_norm2));
        DT_NEAR(bc.last.ip_var, want.ip_var, 1e-5 * want.var);
        DT_NEAR(bc.last.orth_var, want.orth_var, 1e-5 * want.var);
        if (proj_modes[mode] == DOPT_BATCH_PROJECT_EXACT) /* a sixth micro-batch in one step has no room */
            for (j = 0; j <= 5; j++)
                DT_EQ_INT(observe_flat(&bc, v, D), j < 5 ? DOPT_OK : DOPT_ERR_INVALID);
        dopt_batch_free(&bc);
    }
}

/* How far apart the two projections are: a direction that turns by 90 degrees between two steps
   (v = (1,0), (3,0), then (0,1), (0,3)); each step's Σ‖v − v̄‖² = 2, one degree of freedom, 2
   samples per unit. Exact: all the spread lies along each step's own mean, ip_var = 2·4/2 = 4,
   orth_var = 0. Previous: the first step has no direction, the second projects on (1,0), across
   its spread: ip_var = 0, orth_var = 2·2/1 = 4. And where the direction does
   not move (each step's mean along (1,2), noise that sums to zero within a step), they agree. */
DTEST(exact_and_previous_projections_differ_when_the_direction_turns_and_agree_when_it_does_not) {
    static const float turn[4][2] = {{1, 0}, {3, 0}, {0, 1}, {0, 3}};
    dopt_batch b[2];
    dopt_batch_config c;
    int mode, t, j;
    memset(&c, 0, sizeof c);
    c.test = DOPT_BATCH_INNER_PRODUCT;
    c.unit_samples = 2;
    for (mode = 0; mode < 2; mode++) {
        c.projection = proj_modes[mode];
        DT_OK(dopt_batch_init(&b[mode], 2, &c));
        for (t = 0; t < 2; t++) {
            for (j = 0; j < 2; j++) DT_OK(observe_flat(&b[mode], turn[2 * t + j], 2));
            dopt_batch_end_step(&b[mode]);
        }
        DT_OK(dopt_batch_decide(&b[mode], NULL));
    }
    DT_NEAR(b[0].last.ip_var, 4.0, 1e-12); /* exact */
    DT_NEAR(b[0].last.orth_var, 0.0, 1e-12);
    DT_NEAR(b[1].last.ip_var, 0.0, 1e-12); /* previous */
    DT_NEAR(b[1].last.orth_var, 4.0, 1e-12);
    /* a round on a fixed direction: both have a direction from the previous round now */
    for (t = 0; t < 5; t++) {
        float scale = 1.0f + 0.5f * (float)t, noise = 0.25f * (float)(t + 1);
        float v[4][2] = {{scale + noise, 2 * scale}, {scale - noise, 2 * scale}, {scale, 2 * scale + noise},
                         {scale, 2 * scale - noise}};
        for (mode = 0; mode < 2; mode++) {
            for (j = 0; j < 4; j++) DT_OK(observe_flat(&b[mode], v[j], 2));
            dopt_batch_end_step(&b[mode]);
        }
    }
    for (mode = 0; mode < 2; mode++) DT_OK(dopt_batch_decide(&b[mode], NULL));
    DT_CHECK(b[0].last.ip_var > 0.0 && b[0].last.orth_var > 0.0);
    DT_NEAR(b[0].last.ip_var, b[1].last.ip_var, 1e-12 * b[0].last.var);
    DT_NEAR(b[0].last.orth_var, b[1].last.orth_var, 1e-12 * b[0].last.var);
    DT_CHECK(b[0].last.var == b[1].last.var && b[0].last.grad_norm2 == b[1].last.grad_norm2);
    for (mode = 0; mode < 2; mode++) dopt_batch_free(&b[mode]);
}

/* history h: the second decision pools the first round's sums weighted h with its own. Round 1
   is the hand example above (ss 4, 2 dof, ‖v̄‖² 5, 1/k = 1/3); round 2 one step of (0,0),
   (2,0): ss 2, 1 dof, ‖v̄‖² 1, 1/k = 1/2. With h = 0.5: dof 2, ss 4, so τ² = 2 and Var = 4;
   ‖∇F‖² = (2.5 + 1)/1.5 = 7/3 plain, (2.5 + 1 − 2·(1/6 + 1/2)) / 1.5 = 13/9 bias-corrected. */
DTEST(history_pools_earlier_rounds_with_geometric_weights) {
    dopt_batch bc;
    dopt_batch_config c;
    static const float r1[3][2] = {{1, 0}, {3, 2}, {2, 1}}, r2[2][2] = {{0, 0}, {2, 0}};
    int i;
    memset(&c, 0, sizeof c);
    c.unit_samples = 2;
    c.history = 0.5;
    for (c.bias_corrected = 0; c.bias_corrected < 2; c.bias_corrected++) {
        DT_OK(dopt_batch_init(&bc, 2, &c));
        for (i = 0; i < 3; i++) DT_OK(observe_flat(&bc, r1[i], 2));
        DT_OK(dopt_batch_decide(&bc, NULL));
        DT_NEAR(bc.last.var, 4.0, 1e-12); /* nothing earlier: the round alone */
        for (i = 0; i < 2; i++) DT_OK(observe_flat(&bc, r2[i], 2));
        DT_OK(dopt_batch_decide(&bc, NULL));
        DT_NEAR(bc.last.var, 4.0, 1e-12);
        DT_NEAR(bc.last.grad_norm2, c.bias_corrected ? 13.0 / 9.0 : 7.0 / 3.0, 1e-12);
        dopt_batch_free(&bc);
    }
    c.history = 1.0; /* would never forget */
    DT_EQ_INT(dopt_batch_init(&bc, 2, &c), DOPT_ERR_INVALID);
}

/* A round whose steps have one micro-batch each cannot decide: the size stays, the controller
   counts it, and the communicator's log says why (once as a warning). */

DTEST(a_round_of_single_micro_batch_steps_cannot_decide_and_says_so) {
    dopt_comm *c;
    dopt_batch bc;
    float g[2] = {1, 2};
    int t;
    warning_count undecided_warnings = {{"could not decide", "2 micro-batches", NULL, NULL}, 0};
    DT_OK(dopt_comm_create_self(&c));
    dopt_comm_set_log(c, count_warnings_with, &undecided_warnings);
    DT_OK(dopt_batch_init(&bc, 2, NULL));
    for (t = 0; t < 3; t++) {
        g[0] += 1.0f;
        DT_OK(observe_flat(&bc, g, 2));
        dopt_batch_end_step(&bc);
        DT_OK(dopt_batch_decide(&bc, c));
    }
    DT_EQ_INT(bc.undecided, 3);
    DT_EQ_INT(undecided_warnings.count, 1);
    DT_EQ_INT(dopt_batch_units(&bc), 1);
    DT_CHECK(dopt__is_nan(bc.last.var));
    dopt_batch_free(&bc);
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ batch-size tests across ranks */

/* Each rank's delta and weight, by hand: d = (1,0), (0,1), (2,2) with B = 1, 1, 2 samples.
   Weighted mean d̄ = (5/4, 5/4), ‖d̄‖² = 25/8; Σ B‖d‖² = 18, W‖d̄‖² = 12.5 → Var = 5.5/2 = 2.75;
   B⟨d,d̄⟩²/‖d̄‖² = 0.5, 0.5, 16 → ip_var = (17 − 12.5)/2 = 2.25; orth_var = 0.5. ‖∇F‖² without
   the bias Var/W of a weighted mean: 25/8 − 2.75/4 = 2.4375.
   Norm test (η = 0.5, 1 sample per unit): 2.75/(0.25·2.4375) = 4.51 → 5 units on every rank. */
static void body_across_hand(dopt_comm *c, void *arg) {
    static const float d[3][2] = {{1, 0}, {0, 1}, {2, 2}};
    static const double w[3] = {1, 1, 2};
    float x[2] = {0, 0};
    dopt_batch bc;
    dopt_batch_config bcfg;
    dopt_dp ls;
    dopt_dp_config cfg;
    size_t units;
    (void)arg;
    memset(&bcfg, 0, sizeof bcfg);
    bcfg.estimator = DOPT_BATCH_ACROSS;
    bcfg.eta = 0.5;
    DT_OK(dopt_batch_init(&bc, 0, &bcfg));
    memset(&cfg, 0, sizeof cfg);
    cfg.batch = &bc;
    cfg.weighted = 1;
    DT_OK(dopt_dp_init(&ls, c, 2, &cfg));
    DT_OK(dopt_dp_broadcast(&ls, x)); /* anchor 0 */
    DT_OK(dopt_dp_set_step_samples(&ls, w[c->rank]));
    x[0] = d[c->rank][0];
    x[1] = d[c->rank][1];
    DT_OK(dopt_dp_after_step(&ls, x));
    DT_NEAR(x[0], 1.25, 1e-6);
    DT_NEAR(x[1], 1.25, 1e-6);
    DT_NEAR(bc.last.grad_norm2, 2.4375, 1e-5);
    DT_NEAR(bc.last.var, 2.75, 1e-5);
    DT_NEAR(bc.last.ip_var, 2.25, 1e-5);
    DT_NEAR(bc.last.orth_var, 0.5, 1e-5);
    units = dopt_batch_units(&bc);
    DT_EQ_INT(units, 5);
    DT_CHECK(world_same_on_every_rank(c, &bc.last, sizeof bc.last)); /* the inputs, bit for bit */
    dopt_dp_free(&ls);
    dopt_batch_free(&bc);
}

DTEST_WORLDS(across_worker_estimator_matches_hand_computation_with_weighted_mean, body_across_hand, NULL, 3,
             3); /* the hand values are three ranks' */

/* Local SGD with each test and estimator on noisy least squares, different data on every rank:
   every decision is the same on every rank, and the size only grows and stays under the cap. */
typedef struct growth_args {
    dopt_batch_test test;
    dopt_batch_estimator est;
    dopt_batch_projection proj;
} growth_args;

static void body_growth(dopt_comm *c, void *arg) {
    const growth_args *a = (const growth_args *)arg;
    static lsq p;
    float x[LS_D], g[LS_D], micro[LS_D];
    dopt_batch bc;
    dopt_batch_config bcfg;
    dopt_dp ls;
    dopt_dp_config cfg;
    size_t prev = 3, u;
    int t, j, grew = 0;
    lsq_make(&p);
    for (j = 0; j < LS_M; j++) p.b[j] += 0.3f * (float)((j * 7919) % 13 - 6); /* inconsistent: noise at x* */
    memset(&bcfg, 0, sizeof bcfg);
    bcfg.test = a->test;
    bcfg.estimator = a->est;
    bcfg.eta = 0.3;
    bcfg.theta = 0.3;
    bcfg.nu = 0.5;
    bcfg.unit_samples = 2;
    bcfg.initial_units = 3; /* WITHIN needs 2 micro-batches per step */
    bcfg.max_units = 12;
    bcfg.multiple = 3;
    bcfg.projection = a->proj;
    DT_OK(dopt_batch_init(&bc, LS_D, &bcfg));
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    cfg.batch = &bc;
    DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
    for (j = 0; j < LS_D; j++) x[j] = 0.0f;
    DT_OK(dopt_dp_broadcast(&ls, x));
    for (t = 0; t < 200; t++) {
        size_t units = dopt_batch_units(&bc);
        for (j = 0; j < LS_D; j++) g[j] = 0.0f;
        for (u = 0; u < units; u++) {
            lsq_grad(&p, x, micro, c->rank, c->size, (uint64_t)t * 16 + u, 2);
            if (a->est == DOPT_BATCH_WITHIN) DT_OK(observe_flat(&bc, micro, LS_D));
            dopt_axpy(g, 1.0f / (float)units, micro, LS_D);
        }
        dopt_axpy(x, -0.02f, g, LS_D);
        DT_OK(dopt_dp_after_step(&ls, x));
        u = dopt_batch_units(&bc);
        DT_CHECK(u >= prev && u <= 12 && u % 3 == 0);
        if (u > prev) grew = 1;
        prev = u;
        if (dopt_dp_should_sync(&ls, (uint64_t)t)) DT_CHECK(world_same_on_every_rank(c, &u, sizeof u));
    }
    DT_CHECKF(grew, "test %d estimator %d: the batch never grew (last var %g, g2 %g)", (int)a->test, (int)a->est,
              bc.last.var, bc.last.grad_norm2);
    dopt_dp_free(&ls);
    dopt_batch_free(&bc);
}

/* Each test with WITHIN under both projections (the norm test projects nothing) and ACROSS. */
static const growth_args growth_cases[8] = {
    {DOPT_BATCH_NORM, DOPT_BATCH_WITHIN, DOPT_BATCH_PROJECT_PREVIOUS},
    {DOPT_BATCH_NORM, DOPT_BATCH_ACROSS, DOPT_BATCH_PROJECT_PREVIOUS},
    {DOPT_BATCH_INNER_PRODUCT, DOPT_BATCH_WITHIN, DOPT_BATCH_PROJECT_PREVIOUS},
    {DOPT_BATCH_INNER_PRODUCT, DOPT_BATCH_WITHIN, DOPT_BATCH_PROJECT_EXACT},
    {DOPT_BATCH_INNER_PRODUCT, DOPT_BATCH_ACROSS, DOPT_BATCH_PROJECT_PREVIOUS},
    {DOPT_BATCH_AUGMENTED, DOPT_BATCH_WITHIN, DOPT_BATCH_PROJECT_PREVIOUS},
    {DOPT_BATCH_AUGMENTED, DOPT_BATCH_WITHIN, DOPT_BATCH_PROJECT_EXACT},
    {DOPT_BATCH_AUGMENTED, DOPT_BATCH_ACROSS, DOPT_BATCH_PROJECT_PREVIOUS},
};
DTEST_WORLDS_EACH(batch_decisions_identical_on_every_rank_monotone_capped_rounded, body_growth, growth_cases, 2, 4);
/* The driver tells the controller which steps averaged the gradients: a warm-up step's round
   compares the global batch (workers = N; the plain ‖∇F‖² is ‖global mean‖², the averaged
   gradient's own, not the mean of the ranks' ‖v̄‖²) and projects on the averaged gradient's
   direction (EXACT, as the reference's distributed tests); a local round each worker's own
   (workers = 1, plain ‖v̄‖²). Through a gradient compressor the averaged gradient is not the
   global mean: the plain estimate then comes from the ranks' ‖v̄‖² less (1 − 1/N)·τ²/k. */
static void body_sync_rounds(dopt_comm *c, void *arg) {
    static lsq p;
    float x[LS_D], g[LS_D], micro[2][LS_D];
    dopt_batch bc;
    dopt_batch_config bcfg;
    dopt_dp ls;
    dopt_dp_config cfg;
    dopt_compressor gz;
    dopt_compressor_config ccfg;
    dopt_segment seg = {0, LS_D, "x"};
    int t, j, u, compressed = *(const int *)arg;
    lsq_make(&p);
    memset(&bcfg, 0, sizeof bcfg);
    bcfg.test = DOPT_BATCH_AUGMENTED;
    bcfg.initial_units = 2;
    bcfg.unit_samples = 2;
    bcfg.max_units = 4;
    DT_OK(dopt_batch_init(&bc, LS_D, &bcfg));
    DT_EQ_INT(bc.cfg.projection, DOPT_BATCH_PROJECT_EXACT); /* AUTO: it fits */
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 3;
    cfg.warmup_steps = 2;
    cfg.batch = &bc;
    memset(&ccfg, 0, sizeof ccfg);
    ccfg.codec = DOPT_CODEC_TOPK;
    ccfg.topk_ratio = 0.3;
    DT_OK(dopt_compressor_init(&gz, &ccfg, &seg, 1));
    cfg.grad_compressor = compressed ? &gz : NULL;
    DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
    for (j = 0; j < LS_D; j++) x[j] = 0.0f;
    DT_OK(dopt_dp_broadcast(&ls, x));
    for (t = 0; t < 5; t++) {
        double m2 = 0.0, ss = 0.0, want, v[3], pj[2] = {0, 0}, gn = 0.0;
        float mean[LS_D] = {0};
        memset(g, 0, sizeof g);
        for (u = 0; u < 2; u++) {
            lsq_grad(&p, x, micro[u], c->rank, c->size, (uint64_t)t * 16 + (uint64_t)u, 2);
            DT_OK(observe_flat(&bc, micro[u], LS_D));
            dopt_axpy(mean, 0.5f, micro[u], LS_D);
            dopt_axpy(g, 0.5f, micro[u], LS_D);
            for (j = 0; j < LS_D; j++) ss += (double)micro[u][j] * micro[u][j];
        }
        for (j = 0; j < LS_D; j++) m2 += (double)mean[j] * mean[j];
        DT_OK(dopt_dp_after_backward(&ls, g)); /* averaged on the warm-up steps 0 and 1 */
        for (j = 0; j < LS_D; j++) { /* projections on the averaged gradient (warm-up steps) */
            gn += (double)g[j] * g[j];
            pj[0] += (double)micro[0][j] * g[j];
            pj[1] += (double)micro[1][j] * g[j];
        }
        dopt_axpy(x, -0.05f, g, LS_D);
        DT_OK(dopt_dp_after_step(&ls, x));
        if (t >= 2) continue;
        /* step t closed its own round: by hand over ranks (k = 2) */
        v[0] = m2;
        v[1] = ss - 2.0 * m2; /* Σ‖v_j − v̄‖² */
        v[2] = (pj[0] - pj[1]) * (pj[0] - pj[1]) / (2.0 * gn); /* Σ_j (p_j − p̄)², p on ĝ */
        DT_OK(dopt_allreduce(c, v, 3, DOPT_F64, DOPT_SUM));
        if (!compressed) DT_NEAR(bc.last.ip_var, 2.0 * v[2] / c->size, 1e-4 * bc.last.var); /* unit 2, N dof */
        DT_NEAR(bc.last.var, 2.0 * v[1] / c->size, 1e-4 * bc.last.var);                   /* τ² = v[1]/N */
        want = gn; /* ‖global mean‖²: g holds the average, each rank's the mean of its 2 */
        DT_CHECK(fabs(want - v[0] / c->size) > 1e-3 * want); /* not the ranks' mean ‖v̄‖² */
        /* compressed: each of the N ranks' steps takes (1 − 1/N)·τ²/2 off its ‖v̄‖², τ² = v[1]/N */
        if (compressed) want = (v[0] - (1.0 - 1.0 / c->size) * v[1] / 2.0) / c->size;
        DT_NEAR(bc.last.workers, (double)c->size, 0.0);
        DT_NEAR(bc.last.grad_norm2, want, 1e-4 * fabs(want));
    }
    DT_NEAR(bc.last.workers, 1.0, 0.0); /* steps 2..4: one local round */
    DT_EQ_INT(bc.decisions, 3);
    dopt_dp_free(&ls);
    dopt_batch_free(&bc);
    dopt_compressor_free(&gz);
}

static const int sync_round_cases[2] = {0, 1}; /* fp32 mean; top-k compressed */
DTEST_WORLDS_EACH(batch_compares_the_global_batch_on_synchronous_steps_and_the_worker_batch_on_local_ones,
                  body_sync_rounds, sync_round_cases, 2, 4);


/* ------------------------------------------------------------------ save, load, resume */

#define RS_STEPS 41

typedef struct resume_args {
    int stop_at;
    dopt_batch_estimator est;
    int compressed; /* 1: model deltas through top-k with error feedback (then unweighted);
                       2: also the warm-up's gradients through sign with error feedback */
    int outer;      /* DiLoCo's outer Nesterov step on the averages */
    dopt_batch_projection proj;
} resume_args;

typedef struct host_state {
    float x[LS_D], mom[LS_D];
} host_state;

static void resume_setup(dopt_comm *c, const resume_args *a, dopt_batch *bc, dopt_dp *ls,
                         const dopt_state_desc *sd, dopt_compressor *cz, dopt_compressor *gz) {
    dopt_batch_config bcfg;
    dopt_dp_config cfg;
    dopt_compressor_config ccfg;
    dopt_segment seg = {0, LS_D, "x"};
    memset(&ccfg, 0, sizeof ccfg);
    ccfg.codec = DOPT_CODEC_TOPK;
    ccfg.topk_ratio = 0.3;
    DT_OK(dopt_compressor_init(cz, &ccfg, &seg, 1));
    ccfg.codec = DOPT_CODEC_SIGN;
    DT_OK(dopt_compressor_init(gz, &ccfg, &seg, 1));
    memset(&bcfg, 0, sizeof bcfg);
    bcfg.estimator = a->est;
    bcfg.eta = 0.2;
    bcfg.unit_samples = 1;
    bcfg.initial_units = 2;
    bcfg.max_units = 8;
    bcfg.projection = a->proj;
    bcfg.history = a->proj == DOPT_BATCH_PROJECT_EXACT ? 0.5 : 0.0;
    DT_OK(dopt_batch_init(bc, LS_D, &bcfg));
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 3;
    cfg.warmup_steps = a->compressed == 2 ? 10 : 2;
    cfg.sync_grads = a->compressed == 2;
    cfg.grad_compressor = a->compressed == 2 ? gz : NULL;
    cfg.states = sd;
    cfg.nstates = 1;
    cfg.batch = bc;
    cfg.keep_anchor = 1;
    cfg.weighted = !a->compressed;
    cfg.compressor = a->compressed ? cz : NULL;
    cfg.outer_lr = a->outer ? 0.7 : 0.0;
    cfg.outer_momentum = a->outer ? 0.9 : 0.0;
    DT_OK(dopt_dp_init(ls, c, LS_D, &cfg));
}

/* The start every rank shares (zeros here): the anchor the deltas and the outer step read. */
static void resume_broadcast(dopt_dp *ls, host_state *h) {
    dopt_buf xb = dopt_buf_flat(h->x, LS_D, NULL, 0), mb = dopt_buf_flat(h->mom, LS_D, NULL, 0);
    DT_OK(dopt_dp_broadcast_buf(ls, &xb, &mb));
}

/* Runs steps [from, to) of noisy momentum local SGD with adaptive batches. */
static void resume_steps(dopt_comm *c, const lsq *p, host_state *h, dopt_batch *bc, dopt_dp *ls, int from, int to) {
    float g[LS_D], micro[LS_D];
    dopt_buf xb = dopt_buf_flat(h->x, LS_D, NULL, 0), mb = dopt_buf_flat(h->mom, LS_D, NULL, 0);
    int t, j;
    size_t u;
    for (t = from; t < to; t++) {
        size_t units = dopt_batch_units(bc);
        memset(g, 0, sizeof g);
        for (u = 0; u < units; u++) {
            lsq_grad(p, h->x, micro, c->rank, c->size, (uint64_t)t * 16 + u, 1);
            if (bc->cfg.estimator == DOPT_BATCH_WITHIN) DT_OK(observe_flat(bc, micro, LS_D));
            dopt_axpy(g, 1.0f / (float)units, micro, LS_D);
        }
        DT_OK(dopt_dp_after_backward(ls, g)); /* averages in the warm-up, a no-op after */
        for (j = 0; j < LS_D; j++) {
            h->mom[j] = 0.5f * h->mom[j] + g[j];
            h->x[j] -= 0.02f * h->mom[j];
        }
        DT_OK(dopt_dp_after_step_buf(ls, &xb, &mb));
    }
}

static void body_resume(dopt_comm *c, void *arg) {
    const resume_args *a = (const resume_args *)arg;
    static lsq p;
    dopt_state_desc sd[1] = {{LS_D, DOPT_STATE_AVERAGE, "momentum"}};
    host_state h, straight;
    dopt_batch bc;
    dopt_dp ls;
    dopt_compressor cz, gz;
    char dir[128], path[256], hpath[256];
    FILE *f;
    int j;
    lsq_make(&p);
    for (j = 0; j < LS_M; j++) p.b[j] += 0.5f * (float)((j * 31) % 7 - 3);
    world_tmpdir(c, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/state.%d", dir, c->rank);
    snprintf(hpath, sizeof hpath, "%s/host.%d", dir, c->rank);
    /* the uninterrupted run */
    resume_setup(c, a, &bc, &ls, sd, &cz, &gz);
    for (j = 0; j < LS_D; j++) h.x[j] = h.mom[j] = 0.0f;
    resume_broadcast(&ls, &h);
    resume_steps(c, &p, &h, &bc, &ls, 0, RS_STEPS);
    straight = h;
    dopt_dp_free(&ls);
    dopt_batch_free(&bc);
    dopt_compressor_free(&cz);
    dopt_compressor_free(&gz);
    /* stopped at step k: the library's state and the host's own, both to files, everything freed */
    resume_setup(c, a, &bc, &ls, sd, &cz, &gz);
    for (j = 0; j < LS_D; j++) h.x[j] = h.mom[j] = 0.0f;
    resume_broadcast(&ls, &h);
    resume_steps(c, &p, &h, &bc, &ls, 0, a->stop_at);
    DT_OK(dopt_dp_save(&ls, path));
    f = fopen(hpath, "wb");
    DT_CHECK(f && fwrite(&h, sizeof h, 1, f) == 1 && fclose(f) == 0);
    dopt_dp_free(&ls);
    dopt_batch_free(&bc);
    dopt_compressor_free(&cz);
    dopt_compressor_free(&gz);
    memset(&h, 0xFF, sizeof h);
    /* a new process would start here */
    resume_setup(c, a, &bc, &ls, sd, &cz, &gz);
    DT_OK(dopt_dp_load(&ls, path));
    DT_EQ_INT(ls.step, (uint64_t)a->stop_at);
    f = fopen(hpath, "rb");
    DT_CHECK(f && fread(&h, sizeof h, 1, f) == 1 && fclose(f) == 0);
    resume_steps(c, &p, &h, &bc, &ls, a->stop_at, RS_STEPS);
    DT_CHECKF(memcmp(&h, &straight, sizeof h) == 0, "rank %d: resumed at %d differs from the straight run", c->rank,
              a->stop_at);
    DT_CHECK(bc.decisions > 0);
    if (a->compressed) DT_CHECK(cz.step > 0 && dopt_sumsq(cz.residual, LS_D) > 0.0); /* EF state was live */
    if (a->compressed == 2) DT_CHECK(gz.step == 10 && dopt_sumsq(gz.residual, LS_D) > 0.0);
    if (a->outer) DT_CHECK(dopt_sumsq(ls.outer_v, LS_D) > 0.0); /* the outer momentum was live */
    dopt_dp_free(&ls);
    dopt_batch_free(&bc);
    dopt_compressor_free(&cz);
    dopt_compressor_free(&gz);
    world_tmpdir_remove(c, dir);
}

static void make_tmpdir(char *dir, size_t cap) {
    snprintf(dir, cap, "/tmp/test-localsgd-XXXXXX");
    DT_CHECK(mkdtemp(dir) != NULL);
}

static void remove_tmpdir(const char *dir) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    DT_CHECK(system(cmd) == 0);
}

/* Every stop below under six settings: each estimator plain (0, 1), with compressed deltas (2, 3;
   3 with compressed warm-up gradients too), the outer optimizer on compressed deltas (4), the
   exact projection (5). */
static resume_args resume_cases[6 * 6];
__attribute__((constructor)) static void resume_cases_fill(void) {
    static const int stops[6] = {1, 2, 4, 7, 17, 30};
    int e, k;
    for (e = 0; e < 6; e++)
        for (k = 0; k < 6; k++) {
            resume_args *a = &resume_cases[6 * e + k];
            a->stop_at = stops[k];
            a->est = e < 4 ? (dopt_batch_estimator)(e % 2) : DOPT_BATCH_WITHIN;
            a->compressed = e < 2 ? 0 : e < 4 ? e - 1 : e == 4;
            a->outer = e == 4;
            a->proj = e == 5 ? DOPT_BATCH_PROJECT_EXACT : DOPT_BATCH_PROJECT_PREVIOUS;
        }
}
DTEST_WORLDS_EACH(resume_at_step_k_is_bitwise_equal_to_the_uninterrupted_run, body_resume, resume_cases, 2, 2);

/* ------------------------------------------------------------------ corrupt and mismatched files */

static void write_bytes(const char *path, const unsigned char *b, size_t len) {
    FILE *f = fopen(path, "wb");
    DT_CHECK(f && (len == 0 || fwrite(b, 1, len, f) == len) && fclose(f) == 0);
}

static unsigned char *read_bytes(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    unsigned char *b = (unsigned char *)malloc(1 << 20);
    DT_CHECK(f && b);
    *len = fread(b, 1, 1 << 20, f);
    fclose(f);
    return b;
}

static void expect_refused(dopt_dp *ls, const char *path, dopt_status want, const char *words) {
    uint64_t step = ls->step;
    dopt_status s = dopt_dp_load(ls, path);
    DT_CHECKF(s == want, "load gave %s, expected %s (%s)", dopt_status_str(s), dopt_status_str(want),
              dopt_dp_detail(ls));
    DT_CHECKF(strstr(dopt_dp_detail(ls), words) != NULL, "detail \"%s\" lacks \"%s\"", dopt_dp_detail(ls),
              words);
    DT_EQ_INT(ls->step, step); /* unchanged */
}

/* The host's own bytes (dopt_dp_host_state: a data position, RNG counters) go into the state
   file and come back with the driver's state; a driver whose host state has another size
   refuses the file naming both sizes; bytes at NULL are refused. */
DTEST(host_bytes_are_saved_and_loaded_with_the_driver_and_another_size_is_named) {
    dopt_comm *c;
    dopt_dp ls, other;
    dopt_dp_config cfg;
    float x[LS_D] = {0};
    uint64_t pos[2] = {123456789012ull, 678}, small = 5;
    char dir[128], path[256];
    int i;
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/state", dir);
    DT_OK(dopt_comm_create_self(&c));
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    cfg.keep_anchor = 1;
    DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
    DT_OK(dopt_dp_host_state(&ls, pos, sizeof pos));
    for (i = 0; i < 5; i++) DT_OK(dopt_dp_after_step(&ls, x));
    DT_OK(dopt_dp_save(&ls, path));
    pos[0] = pos[1] = 0;
    ls.step = 1;
    DT_OK(dopt_dp_load(&ls, path));
    DT_CHECK(pos[0] == 123456789012ull && pos[1] == 678 && ls.step == 5);
    DT_OK(dopt_dp_init(&other, c, LS_D, &cfg));
    DT_OK(dopt_dp_host_state(&other, &small, sizeof small));
    expect_refused(&other, path, DOPT_ERR_INVALID, "host state bytes (dopt_dp_host_state) 16, this driver has 8");
    DT_CHECK(small == 5);
    DT_OK(dopt_dp_host_state(&other, NULL, 0)); /* none */
    expect_refused(&other, path, DOPT_ERR_INVALID, "host state bytes (dopt_dp_host_state) 16, this driver has 0");
    DT_EQ_INT(dopt_dp_host_state(&other, NULL, 8), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&other), "8 bytes at NULL") != NULL, "%s", dopt_dp_detail(&other));
    dopt_dp_free(&other);
    dopt_dp_free(&ls);
    dopt_comm_destroy(c);
    remove_tmpdir(dir);
}

DTEST(corrupt_truncated_other_version_and_other_layout_files_are_refused) {
    dopt_comm *c;
    dopt_dp ls, other;
    dopt_dp_config cfg;
    float x[LS_D] = {0};
    char dir[128], path[256], bad[256];
    unsigned char *b;
    size_t len;
    int i;
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/state", dir);
    snprintf(bad, sizeof bad, "%s/bad", dir);
    DT_OK(dopt_comm_create_self(&c));
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    cfg.keep_anchor = 1;
    DT_OK(dopt_dp_init(&ls, c, LS_D, &cfg));
    for (i = 0; i < 5; i++) DT_OK(dopt_dp_after_step(&ls, x));
    DT_OK(dopt_dp_save(&ls, path));
    b = read_bytes(path, &len);
    DT_OK(dopt_dp_init(&other, c, LS_D, &cfg));
    DT_OK(dopt_dp_after_step(&other, x));
    /* the good file loads */
    DT_OK(dopt_dp_load(&other, path));
    DT_EQ_INT(other.step, 5);
    other.step = 1;
    expect_refused(&other, "/nonexistent/dir/state", DOPT_ERR_IO, "cannot open");
    b[len / 2] ^= 0x10;
    write_bytes(bad, b, len);
    expect_refused(&other, bad, DOPT_ERR_PROTOCOL, "corrupt");
    b[len / 2] ^= 0x10;
    write_bytes(bad, b, len - 9);
    expect_refused(&other, bad, DOPT_ERR_PROTOCOL, "corrupt");
    write_bytes(bad, b, 10);
    expect_refused(&other, bad, DOPT_ERR_PROTOCOL, "not a distopt");
    b[8] = DOPT_DP_FILE_VERSION + 1; /* a newer format */
    write_bytes(bad, b, len);
    {
        char words[32];
        snprintf(words, sizeof words, "version %u", DOPT_DP_FILE_VERSION + 1);
        expect_refused(&other, bad, DOPT_ERR_PROTOCOL, words);
    }
    b[8] = DOPT_DP_FILE_VERSION - 1; /* an older one */
    write_bytes(bad, b, len);
    expect_refused(&other, bad, DOPT_ERR_PROTOCOL, "this build reads version");
    b[8] = DOPT_DP_FILE_VERSION;
    write_bytes(bad, b, len);
    DT_OK(dopt_dp_load(&other, bad));
    dopt_dp_free(&other);
    /* other layouts */
    DT_OK(dopt_dp_init(&other, c, LS_D + 1, &cfg));
    expect_refused(&other, path, DOPT_ERR_INVALID, "element count 16");
    dopt_dp_free(&other);
    cfg.period = 5;
    DT_OK(dopt_dp_init(&other, c, LS_D, &cfg));
    expect_refused(&other, path, DOPT_ERR_INVALID, "period 4");
    dopt_dp_free(&other);
    {
        dopt_state_desc sd[1] = {{3, DOPT_STATE_KEEP, "m"}};
        cfg.period = 4;
        cfg.states = sd;
        cfg.nstates = 1;
        DT_OK(dopt_dp_init(&other, c, LS_D, &cfg));
        expect_refused(&other, path, DOPT_ERR_INVALID, "number of states");
        dopt_dp_free(&other);
    }
    /* no temporary file is left behind */
    {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "test $(ls '%s' | wc -l) -eq 2", dir);
        DT_CHECK(system(cmd) == 0);
    }
    free(b);
    dopt_dp_free(&ls);
    dopt_comm_destroy(c);
    remove_tmpdir(dir);
}

static void body_other_world(dopt_comm *c, void *arg) {
    char dir[128], path[256];
    dopt_comm *self;
    dopt_dp ls, one;
    float x[4] = {0};
    (void)arg;
    world_tmpdir(c, dir, sizeof dir);
    DT_OK(dopt_dp_init(&ls, c, 4, NULL));
    DT_OK(dopt_dp_after_step(&ls, x));
    snprintf(path, sizeof path, "%s/w.%d", dir, c->rank);
    DT_OK(dopt_dp_save(&ls, path));
    DT_OK(dopt_comm_create_self(&self));
    DT_OK(dopt_dp_init(&one, self, 4, NULL));
    expect_refused(&one, path, DOPT_ERR_INVALID, "world size 2");
    if (c->rank == 1) {
        snprintf(path, sizeof path, "%s/w.0", dir);
        DT_OK(dopt_barrier(c));
        expect_refused(&ls, path, DOPT_ERR_INVALID, "rank 0");
    } else {
        DT_OK(dopt_barrier(c));
    }
    dopt_dp_free(&one);
    dopt_dp_free(&ls);
    dopt_comm_destroy(self);
    world_tmpdir_remove(c, dir);
}

DTEST_WORLDS(state_of_another_world_size_or_rank_is_refused, body_other_world, NULL, 2, 2); /* names size 2 */

DTEST_MAIN()
