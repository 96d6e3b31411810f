/* Zero allocations per call after the first, over real worlds of 2 and 3 processes on every
   transport of worlds.h (shared memory direct and on the engine over its links, TCP), and on
   groups of each: every collective, blocking and not (allreduce in every dtype and op, small
   and large, allgather, allgatherv, broadcast, barrier, the _start forms with several requests
   in flight); the compressed allreduce with every codec of compress.h, gathered and on the
   rings; and the steps of the local SGD driver (period 1 averaging the gradients, fp32 or
   through TernGrad, a flat buffer in place or a scatter list packed, in buckets during backward;
   period 4 averaging the
   models, plain, weighted, through DiLoCo's outer step, through top-k, with extra state
   buffers); and clip.h's calls with a communicator, and CELGC's step through the driver.

   The allocator is counted (DOPT_MALLOC / DOPT_FREE, defined before the headers). Each shape
   runs one round to warm up (buffers are sized at first use), then three more rounds of the
   same calls, which must not allocate: a failure names the rank, the shape, how many
   allocations, and the first call that made one. */
#define DOPT_MALLOC(sz) allocs_test_malloc(sz)
#define DOPT_FREE(p) allocs_test_free(p)
#include <stdlib.h>
static long allocs_counted;
static void *allocs_test_malloc(size_t n) {
    allocs_counted++;
    return malloc(n);
}
static void allocs_test_free(void *p) { free(p); }

#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "../compress.h"
#include "../localsgd.h"
#include "dtest.h"
#include "worlds.h"

#include <stdint.h>

/* ------------------------------------------------------------------ the steady-state watch */

#define STEADY_ROUNDS 4 /* the warm-up, then three that must not allocate */

typedef struct steady {
    dopt_comm *c;
    int round;              /* 0: the warm-up */
    long mark;              /* the counter when round 1 began */
    const char *first_call; /* the first call that allocated after the warm-up */
    long first_count;
    int first_round;
} steady;

typedef void (*steady_round)(steady *w, void *arg);

/* Records which call allocated after the warm-up; the total is checked at the end, so that every
   rank finishes the rounds with its peers instead of leaving them waiting. */
static void steady_note(steady *w, const char *call, long allocs) {
    if (w->round == 0 || allocs == 0 || w->first_call != NULL) return;
    w->first_call = call;
    w->first_count = allocs;
    w->first_round = w->round;
}

/* A call of a round: it must succeed, and after the warm-up it must not allocate. */
#define STEADY_OK(w, call)                                                                         \
    do {                                                                                           \
        long before_ = allocs_counted;                                                             \
        DT_OK(call);                                                                               \
        steady_note(w, #call, allocs_counted - before_);                                           \
    } while (0)

static void steady_run(dopt_comm *c, const char *shape, steady_round round, void *arg) {
    steady w;
    long after;
    memset(&w, 0, sizeof w);
    w.c = c;
    for (w.round = 0; w.round < STEADY_ROUNDS; w.round++) {
        if (w.round == 1) w.mark = allocs_counted;
        round(&w, arg);
    }
    after = allocs_counted - w.mark;
    DT_CHECKF(after == 0, "rank %d of %d, %s: %ld allocations in rounds 2-%d (round 1 warms up); the first, in round %d: %ld by %s",
              c->rank, c->size, shape, after, STEADY_ROUNDS, w.first_round + 1, w.first_count,
              w.first_call ? w.first_call : "code outside the watched calls");
}

/* Deterministic data that differs by rank and by round, from a 64-bit LCG: values in [-1, 1). */
static void fill_floats(float *x, size_t n, uint64_t seed) {
    uint64_t s = seed * 2654435761u + 1;
    size_t i;
    for (i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(s >> 11) / 4503599627370496.0 - 1.0);
    }
}

static uint64_t round_seed(const steady *w) { return (uint64_t)w->c->rank * 1000 + (uint64_t)w->round; }

/* ------------------------------------------------------------------ collectives */

#define SMALL 5
#define BIG (((size_t)1 << 20) + 3)       /* floats: 4 MiB and a tail that fills no vector */
#define BIG_F64 (((size_t)1 << 19) + 3)   /* doubles */
#define GATHER_BIG (((size_t)1 << 18) + 3) /* bytes per rank */
#define GATHERV_CAP (80 * 3)

typedef struct coll_bufs {
    float *x, *y;            /* BIG each: reduced, broadcast */
    double *xd;              /* BIG_F64 */
    unsigned char *gathered; /* size * GATHER_BIG */
    float f[SMALL], fb[SMALL];
    double d[SMALL];
    int32_t i32[SMALL];
    int64_t i64[SMALL];
    unsigned char blk[4096], blk_all[4096 * 3], vout[GATHERV_CAP];
    size_t vgot[3];
} coll_bufs;

static void small_values(coll_bufs *b, int rank) {
    int k;
    for (k = 0; k < SMALL; k++) {
        b->f[k] = b->fb[k] = (float)(rank + k);
        b->d[k] = (double)(rank - k);
        b->i32[k] = rank * 7 - k;
        b->i64[k] = (int64_t)rank * 1000003 + k;
    }
}

static void blocking_round(steady *w, void *arg) {
    static const dopt_op ops[4] = {DOPT_SUM, DOPT_MAX, DOPT_MIN, DOPT_MEAN};
    coll_bufs *b = (coll_bufs *)arg;
    dopt_comm *c = w->c;
    int k;
    small_values(b, c->rank);
    for (k = 0; k < 4; k++) {
        STEADY_OK(w, dopt_allreduce(c, b->f, SMALL, DOPT_F32, ops[k]));
        STEADY_OK(w, dopt_allreduce(c, b->d, SMALL, DOPT_F64, ops[k]));
        STEADY_OK(w, dopt_allreduce(c, b->i32, SMALL, DOPT_I32, ops[k]));
        STEADY_OK(w, dopt_allreduce(c, b->i64, SMALL, DOPT_I64, ops[k]));
    }
    STEADY_OK(w, dopt_allreduce(c, b->x, BIG, DOPT_F32, DOPT_SUM));
    STEADY_OK(w, dopt_allreduce(c, b->x, BIG, DOPT_F32, DOPT_MEAN));
    STEADY_OK(w, dopt_allreduce(c, b->xd, BIG_F64, DOPT_F64, DOPT_MIN));
    STEADY_OK(w, dopt_allgather(c, b->blk, b->blk_all, sizeof b->blk));
    STEADY_OK(w, dopt_allgather(c, b->x, b->gathered, GATHER_BIG));
    STEADY_OK(w, dopt_allgatherv(c, b->blk, 64 + (size_t)c->rank * 7, b->vout, sizeof b->vout, b->vgot));
    STEADY_OK(w, dopt_broadcast(c, b->y, BIG * sizeof(float), 0));
    STEADY_OK(w, dopt_broadcast(c, b->fb, sizeof b->fb, c->size - 1));
    STEADY_OK(w, dopt_barrier(c));
}

/* Five requests in flight at once, on five buffers, waited for in another order. */
static void nonblocking_round(steady *w, void *arg) {
    coll_bufs *b = (coll_bufs *)arg;
    dopt_comm *c = w->c;
    dopt_request r[5];
    small_values(b, c->rank);
    STEADY_OK(w, dopt_allreduce_start(c, b->f, SMALL, DOPT_F32, DOPT_SUM, &r[0]));
    STEADY_OK(w, dopt_allreduce_start(c, b->x, BIG, DOPT_F32, DOPT_MAX, &r[1]));
    STEADY_OK(w, dopt_allgather_start(c, b->blk, b->blk_all, sizeof b->blk, &r[2]));
    STEADY_OK(w, dopt_broadcast_start(c, b->y, BIG * sizeof(float), c->size - 1, &r[3]));
    STEADY_OK(w, dopt_allreduce_start(c, b->i64, SMALL, DOPT_I64, DOPT_MEAN, &r[4]));
    STEADY_OK(w, dopt_wait(&r[3]));
    STEADY_OK(w, dopt_wait(&r[0]));
    STEADY_OK(w, dopt_wait(&r[4]));
    STEADY_OK(w, dopt_wait(&r[2]));
    STEADY_OK(w, dopt_wait(&r[1]));
    /* and one at a time, as a host overlapping one bucket with its backward pass does */
    STEADY_OK(w, dopt_allreduce_start(c, b->xd, BIG_F64, DOPT_F64, DOPT_SUM, &r[0]));
    STEADY_OK(w, dopt_wait(&r[0]));
    STEADY_OK(w, dopt_allgather_start(c, b->x, b->gathered, GATHER_BIG, &r[0]));
    STEADY_OK(w, dopt_wait(&r[0]));
    STEADY_OK(w, dopt_broadcast_start(c, b->fb, sizeof b->fb, 0, &r[0]));
    STEADY_OK(w, dopt_wait(&r[0]));
}

static void collectives_steady(dopt_comm *c, void *arg) {
    coll_bufs *b = (coll_bufs *)calloc(1, sizeof *b);
    size_t i;
    (void)arg;
    DT_CHECK(b != NULL && c->size <= 3);
    b->x = (float *)malloc(BIG * sizeof(float));
    b->y = (float *)malloc(BIG * sizeof(float));
    b->xd = (double *)malloc(BIG_F64 * sizeof(double));
    b->gathered = (unsigned char *)malloc(GATHER_BIG * (size_t)c->size);
    DT_CHECK(b->x != NULL && b->y != NULL && b->xd != NULL && b->gathered != NULL);
    fill_floats(b->x, BIG, (uint64_t)c->rank);
    fill_floats(b->y, BIG, (uint64_t)c->rank + 10);
    for (i = 0; i < BIG_F64; i++) b->xd[i] = (double)b->x[i];
    memset(b->blk, c->rank + 1, sizeof b->blk);
    steady_run(c, "blocking collectives", blocking_round, b);
    steady_run(c, "nonblocking collectives", nonblocking_round, b);
    free(b->x);
    free(b->y);
    free(b->xd);
    free(b->gathered);
    free(b);
}

DTEST_WORLDS(collectives_allocate_nothing_after_the_first_call, collectives_steady, NULL, 2, 3);

/* The same on a group of every rank (ranked backwards), which runs on the engine over the
   parent's links whichever way the parent's own collectives run. */
static void group_collectives_steady(dopt_comm *c, void *arg) {
    dopt_comm *g;
    DT_OK(dopt_comm_split(c, 0, -c->rank, &g));
    collectives_steady(g, arg);
    dopt_comm_destroy(g);
}

DTEST_WORLDS(group_collectives_allocate_nothing_after_the_first_call, group_collectives_steady, NULL, 2, 3);

/* ------------------------------------------------------------------ the compressed allreduce */

/* Three tensors with gaps between them, one of them smaller than fp32_below below; w1 is a
   256 × 256 matrix (only PowerSGD reads the shape). */
#define CZ_ELEMS (65536 + 5 + 64 + 4099 + 2)
static const dopt_segment cz_segs[3] = {{0, 65536, "w1", 256}, {65536 + 5, 64, "b1"}, {65536 + 5 + 64, 4099, "w2"}};

typedef struct codec_case {
    const char *name;
    dopt_compressor_config cfg;
} codec_case;

static const codec_case codec_cases[] = {
    {"ternary (TernGrad, scale sharing)", {.codec = DOPT_CODEC_TERNARY, .seed = 42}},
    {"ternary, own scales", {.codec = DOPT_CODEC_TERNARY, .seed = 42, .no_scale_sharing = 1}},
    {"ternary, small segments as fp32", {.codec = DOPT_CODEC_TERNARY, .seed = 42, .fp32_below = 100}},
    {"ternary, error feedback", {.codec = DOPT_CODEC_TERNARY, .seed = 42, .error_feedback = DOPT_EF_ON}},
    {"qsgd 4-bit", {.codec = DOPT_CODEC_QSGD, .seed = 42}},
    {"qsgd 8-bit", {.codec = DOPT_CODEC_QSGD, .seed = 42, .qsgd_levels = 127, .qsgd_bucket = 256}},
    {"top-k (error feedback)", {.codec = DOPT_CODEC_TOPK, .topk_ratio = 0.01}},
    {"top-k, no error feedback", {.codec = DOPT_CODEC_TOPK, .topk_ratio = 0.05, .error_feedback = DOPT_EF_OFF}},
    {"sign (error feedback)", {.codec = DOPT_CODEC_SIGN}},
    {"fp16", {.codec = DOPT_CODEC_FP16}},
    {"bf16", {.codec = DOPT_CODEC_BF16}},
    {"fp32", {.codec = DOPT_CODEC_FP32}},
    {"powersgd (w1 compressed)", {.codec = DOPT_CODEC_POWERSGD, .seed = 42, .powersgd_rank = 4}},
    {"ternary on the integer ring", {.codec = DOPT_CODEC_TERNARY, .seed = 42, .aggregate = DOPT_AGG_RING}},
    {"ternary on the ring, small segments as fp32",
     {.codec = DOPT_CODEC_TERNARY, .seed = 42, .fp32_below = 100, .aggregate = DOPT_AGG_RING}},
    {"majority on the ring", {.codec = DOPT_CODEC_MAJORITY, .aggregate = DOPT_AGG_RING}},
    {"majority gathered", {.codec = DOPT_CODEC_MAJORITY, .majority_l1 = 1, .aggregate = DOPT_AGG_ALLGATHER}},
    {"fp16 on the ring", {.codec = DOPT_CODEC_FP16, .aggregate = DOPT_AGG_RING}},
};

typedef struct compress_run {
    dopt_compressor cz;
    float g[CZ_ELEMS];
} compress_run;

static void compress_round(steady *w, void *arg) {
    compress_run *run = (compress_run *)arg;
    fill_floats(run->g, CZ_ELEMS, round_seed(w));
    STEADY_OK(w, dopt_compress_allreduce(&run->cz, w->c, run->g, CZ_ELEMS));
}

static void compress_steady(dopt_comm *c, void *arg) {
    compress_run *run = (compress_run *)malloc(sizeof *run);
    size_t k;
    (void)arg;
    DT_CHECK(run != NULL);
    for (k = 0; k < sizeof codec_cases / sizeof codec_cases[0]; k++) {
        DT_OK(dopt_compressor_init(&run->cz, &codec_cases[k].cfg, cz_segs, 3));
        steady_run(c, codec_cases[k].name, compress_round, run);
        dopt_compressor_free(&run->cz);
    }
    free(run);
}

DTEST_WORLDS(compress_allreduce_allocates_nothing_after_the_first_call, compress_steady, NULL, 2, 3);

/* ------------------------------------------------------------------ local SGD steps */

#define LS_N ((size_t)16384 + 3)
#define LS_STEPS_PER_ROUND 4 /* a round is one period at period 4: its last step averages */

typedef enum ls_codec { LS_FP32, LS_TERNARY, LS_TOPK } ls_codec;

typedef struct ls_case {
    const char *name;
    size_t period;
    int sync_grads;
    int weighted;
    ls_codec grads_via;  /* grad_compressor */
    ls_codec models_via; /* compressor of the model deltas */
    double outer_lr, outer_momentum;
    int with_states; /* momentum averaged, a buffer reset: the _buf forms */
    int scatter_grads; /* the gradients as a scatter list (packed), not flat (averaged in place) */
    int buckets;       /* the gradients marked final segment by segment (dopt_dp_grad_ready) */
} ls_case;

static const ls_case ls_cases[] = {
    {"period 1, gradients averaged", 1, 1, 0, LS_FP32, LS_FP32, 0.0, 0.0, 0},
    {"period 1, gradients averaged, weighted", 1, 1, 1, LS_FP32, LS_FP32, 0.0, 0.0, 0},
    {"period 1, gradients averaged through TernGrad", 1, 1, 0, LS_TERNARY, LS_FP32, 0.0, 0.0, 0},
    {"period 1, gradients of a scatter list averaged", 1, 1, 0, LS_FP32, LS_FP32, 0.0, 0.0, 0, 1},
    {"period 1, gradients of a scatter list averaged, weighted", 1, 1, 1, LS_FP32, LS_FP32, 0.0, 0.0, 0, 1},
    {"period 1, gradients of a scatter list averaged through TernGrad", 1, 1, 0, LS_TERNARY, LS_FP32, 0.0, 0.0, 0, 1},
    {"period 1, gradients averaged in buckets during backward", 1, 1, 0, LS_FP32, LS_FP32, 0.0, 0.0, 0, 0, 1},
    {"period 1, gradients of a scatter list averaged in buckets, weighted", 1, 1, 1, LS_FP32, LS_FP32, 0.0, 0.0, 0, 1, 1},
    {"period 4 after a warm-up, gradients in buckets", 4, 1, 0, LS_FP32, LS_FP32, 0.0, 0.0, 0, 0, 1},
    {"period 1, gradients through TernGrad in buckets", 1, 1, 0, LS_TERNARY, LS_FP32, 0.0, 0.0, 0, 0, 1},
    {"period 1, gradients of a scatter list through top-k in buckets", 1, 1, 0, LS_TOPK, LS_FP32, 0.0, 0.0, 0, 1, 1},
    {"period 1, models averaged", 1, 0, 0, LS_FP32, LS_FP32, 0.0, 0.0, 0},
    {"period 4, models averaged", 4, 0, 0, LS_FP32, LS_FP32, 0.0, 0.0, 0},
    {"period 4, models averaged, weighted", 4, 0, 1, LS_FP32, LS_FP32, 0.0, 0.0, 0},
    {"period 4, DiLoCo's outer Nesterov step", 4, 0, 0, LS_FP32, LS_FP32, 0.7, 0.9, 0},
    {"period 4, model deltas through top-k", 4, 0, 0, LS_FP32, LS_TOPK, 0.0, 0.0, 0},
    {"period 4, with momentum averaged and a buffer reset", 4, 0, 0, LS_FP32, LS_FP32, 0.0, 0.0, 1},
};

typedef struct ls_run {
    const ls_case *lc;
    dopt_dp ls;
    float params[LS_N], grads[LS_N], momentum[LS_N], accum[LS_N];
    dopt_buf states[2];
    dopt_span grad_spans[2]; /* the gradients as two spans, for scatter_grads */
    dopt_segment grad_segs[2]; /* ... or two segments of the flat buffer, for buckets */
    dopt_buf grads_buf;        /* what buckets mark */
} ls_run;

/* A compressor over the packed parameters, or NULL for fp32; in two segments (the buckets'). */
static dopt_compressor *ls_compressor(dopt_compressor *cz, ls_codec via, int halves) {
    static const dopt_segment whole = {0, LS_N, "params"};
    static const dopt_segment two[2] = {{0, LS_N / 2, "first"}, {LS_N / 2, LS_N - LS_N / 2, "second"}};
    dopt_compressor_config cfg;
    if (via == LS_FP32) return NULL;
    memset(&cfg, 0, sizeof cfg);
    cfg.codec = via == LS_TERNARY ? DOPT_CODEC_TERNARY : DOPT_CODEC_TOPK;
    cfg.seed = 7;
    DT_OK(halves ? dopt_compressor_init(cz, &cfg, two, 2) : dopt_compressor_init(cz, &cfg, &whole, 1));
    return cz;
}

/* One period of the host's loop: backward, the driver, SGD with momentum, the driver. */
static void ls_round(steady *w, void *arg) {
    ls_run *run = (ls_run *)arg;
    int k;
    for (k = 0; k < LS_STEPS_PER_ROUND; k++) {
        fill_floats(run->grads, LS_N, round_seed(w) * 16 + (uint64_t)k);
        if (run->lc->buckets) {
            STEADY_OK(w, dopt_dp_grad_ready(&run->ls, 1));
            STEADY_OK(w, dopt_dp_grad_ready(&run->ls, 0));
        }
        if (run->lc->scatter_grads) {
            dopt_buf g = dopt_buf_scatter(run->grad_spans, 2);
            STEADY_OK(w, dopt_dp_after_backward_buf(&run->ls, &g));
        } else {
            STEADY_OK(w, dopt_dp_after_backward(&run->ls, run->grads));
        }
        if (run->lc->with_states) {
            dopt_buf p = dopt_buf_flat(run->params, LS_N, NULL, 0);
            dopt_scale(run->momentum, 0.9f, LS_N);
            dopt_axpy(run->momentum, 1.0f, run->grads, LS_N);
            dopt_axpy(run->params, -0.01f, run->momentum, LS_N);
            dopt_axpy(run->accum, 1.0f, run->grads, LS_N);
            STEADY_OK(w, dopt_dp_after_step_buf(&run->ls, &p, run->states));
        } else {
            dopt_axpy(run->params, -0.01f, run->grads, LS_N);
            STEADY_OK(w, dopt_dp_after_step(&run->ls, run->params));
        }
    }
}

static void localsgd_steady(dopt_comm *c, void *arg) {
    ls_run *run = (ls_run *)calloc(1, sizeof *run);
    size_t k;
    (void)arg;
    DT_CHECK(run != NULL);
    for (k = 0; k < sizeof ls_cases / sizeof ls_cases[0]; k++) {
        const ls_case *lc = &ls_cases[k];
        dopt_state_desc descs[2] = {{LS_N, DOPT_STATE_AVERAGE, "momentum"}, {LS_N, DOPT_STATE_RESET, "accum"}};
        dopt_compressor grads_cz, models_cz;
        dopt_dp_config cfg;
        memset(&cfg, 0, sizeof cfg);
        memset(&grads_cz, 0, sizeof grads_cz);
        memset(&models_cz, 0, sizeof models_cz);
        cfg.period = lc->period;
        cfg.sync_grads = lc->sync_grads;
        cfg.weighted = lc->weighted;
        cfg.grad_compressor = ls_compressor(&grads_cz, lc->grads_via, lc->buckets);
        cfg.compressor = ls_compressor(&models_cz, lc->models_via, 0);
        cfg.outer_lr = lc->outer_lr;
        cfg.outer_momentum = lc->outer_momentum;
        if (lc->with_states) {
            cfg.states = descs;
            cfg.nstates = 2;
        }
        run->lc = lc;
        run->states[0] = dopt_buf_flat(run->momentum, LS_N, NULL, 0);
        run->states[1] = dopt_buf_flat(run->accum, LS_N, NULL, 0);
        run->grad_spans[0].ptr = run->grads;
        run->grad_spans[0].count = LS_N / 2;
        run->grad_spans[1].ptr = run->grads + LS_N / 2;
        run->grad_spans[1].count = LS_N - LS_N / 2;
        run->grad_segs[0] = (dopt_segment){0, LS_N / 2, "first", 0};
        run->grad_segs[1] = (dopt_segment){LS_N / 2, LS_N - LS_N / 2, "second", 0};
        if (lc->buckets) {
            run->grads_buf = lc->scatter_grads ? dopt_buf_scatter(run->grad_spans, 2)
                                               : dopt_buf_flat(run->grads, LS_N, run->grad_segs, 2);
            cfg.grads = &run->grads_buf;
            cfg.bucket_bytes = 16 << 10; /* one segment per bucket */
            cfg.warmup_steps = lc->period > 1 ? 2 : 0;
        }
        fill_floats(run->params, LS_N, (uint64_t)c->rank + 99);
        memset(run->momentum, 0, sizeof run->momentum);
        memset(run->accum, 0, sizeof run->accum);
        DT_OK(dopt_dp_init(&run->ls, c, LS_N, &cfg));
        if (lc->weighted) DT_OK(dopt_dp_set_step_samples(&run->ls, 8.0 + c->rank));
        if (lc->with_states) {
            dopt_buf p = dopt_buf_flat(run->params, LS_N, NULL, 0);
            DT_OK(dopt_dp_broadcast_buf(&run->ls, &p, run->states));
        } else {
            DT_OK(dopt_dp_broadcast(&run->ls, run->params));
        }
        steady_run(c, lc->name, ls_round, run);
        dopt_dp_free(&run->ls);
        dopt_compressor_free(&grads_cz);
        dopt_compressor_free(&models_cz);
    }
    free(run);
}

DTEST_WORLDS(localsgd_steps_allocate_nothing_after_the_first_period, localsgd_steady, NULL, 2, 3);

/* ------------------------------------------------------------------ clipping and CELGC */

#define CL_N ((size_t)4096 + 5)
static const dopt_segment cl_segs[2] = {{0, 4096, "w"}, {4096 + 1, 4, "b"}};

typedef struct clip_run {
    dopt_dp ls;
    float g[CL_N], w[CL_N], x[CL_N], momentum[CL_N];
    double norms[2];
} clip_run;

/* Every clipping call on the communicator, then one period of CELGC through the driver (with a
   state buffer, carried by the rule). */
static void clip_round(steady *w, void *arg) {
    clip_run *run = (clip_run *)arg;
    dopt_buf gb = dopt_buf_flat(run->g, CL_N, cl_segs, 2), wb = dopt_buf_flat(run->w, CL_N, cl_segs, 2);
    dopt_buf xb = dopt_buf_flat(run->x, CL_N, NULL, 0), flat_g = dopt_buf_flat(run->g, CL_N, NULL, 0);
    dopt_buf mb = dopt_buf_flat(run->momentum, CL_N, NULL, 0);
    dopt_clip_norm o = {.max_norm = 0.5f, .measure_only = 1};
    const size_t cols[2] = {64, 0};
    int k;
    fill_floats(run->g, CL_N, round_seed(w));
    STEADY_OK(w, dopt_clip_global_norm(w->c, &gb, &o));
    o.measure_only = 0;
    STEADY_OK(w, dopt_clip_global_norm(w->c, &gb, &o));
    STEADY_OK(w, dopt_clip_segment_norms(w->c, &gb, &(dopt_clip_norm){.max_norm = 0.1f, .scale = 0.5f}, run->norms));
    STEADY_OK(w, dopt_clip_value(w->c, &gb, 1.0f, 0.01f));
    STEADY_OK(w, dopt_clip_sigma(w->c, &gb, DOPT_CLIP_SIGMA_DEFAULT));
    STEADY_OK(w, dopt_clip_agc(w->c, &gb, &wb, &(dopt_agc){.lambda = 0.01f, .cols = cols}));
    for (k = 0; k < LS_STEPS_PER_ROUND; k++) {
        fill_floats(run->g, CL_N, round_seed(w) * 16 + (uint64_t)k);
        STEADY_OK(w, dopt_dp_celgc_step(&run->ls, &xb, &flat_g,
                                        &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f, .states = &mb}));
    }
}

static void clip_steady(dopt_comm *c, void *arg) {
    clip_run *run = (clip_run *)calloc(1, sizeof *run);
    dopt_state_desc desc = {CL_N, DOPT_STATE_AVERAGE, "momentum"};
    dopt_dp_config cfg;
    dopt_buf xb, mb;
    (void)arg;
    DT_CHECK(run != NULL);
    memset(&cfg, 0, sizeof cfg);
    cfg.period = LS_STEPS_PER_ROUND;
    cfg.states = &desc;
    cfg.nstates = 1;
    fill_floats(run->w, CL_N, (uint64_t)c->rank + 7);
    fill_floats(run->x, CL_N, (uint64_t)c->rank + 99);
    xb = dopt_buf_flat(run->x, CL_N, NULL, 0);
    mb = dopt_buf_flat(run->momentum, CL_N, NULL, 0);
    DT_OK(dopt_dp_init(&run->ls, c, CL_N, &cfg));
    DT_OK(dopt_dp_broadcast_buf(&run->ls, &xb, &mb));
    steady_run(c, "clipping and CELGC", clip_round, run);
    dopt_dp_free(&run->ls);
    free(run);
}

DTEST_WORLDS(clipping_allocates_nothing_after_the_first_call, clip_steady, NULL, 2, 3);

/* ------------------------------------------------------------------ the counter itself */

/* Each header's allocations reach the counter: a library allocating some other way would pass
   every test above without this one. */
DTEST(the_counter_sees_every_header_allocate) {
    dopt_compressor cz;
    dopt_dp ls;
    dopt_comm *c;
    long before = allocs_counted;
    DT_OK(dopt_comm_create_self(&c));
    DT_CHECKF(allocs_counted > before, "dopt_comm_create_self: no allocation counted");
    before = allocs_counted;
    DT_OK(dopt_compressor_init(&cz, NULL, cz_segs, 3));
    DT_CHECKF(allocs_counted > before, "dopt_compressor_init: no allocation counted");
    before = allocs_counted;
    DT_OK(dopt_dp_init(&ls, c, LS_N, NULL));
    DT_CHECKF(allocs_counted > before, "dopt_dp_init: no allocation counted");
    dopt_dp_free(&ls);
    dopt_compressor_free(&cz);
    dopt_comm_destroy(c);
}

DTEST_MAIN()
