/* nonfinite.h — the driver's non-finite rule, written once for every transport: a NaN or an
   infinity in one rank's gradient (or model) at step K of a loop that checks no status, as
   README's drop-in is written, under each policy, through fp32 and every codec.

   The includer defines NF_CHECK(cond, fmt, ...) (report a failed check; DT_CHECKF in the forked
   worlds, a carry-on check under MPI) and includes distopt.h, compress.h and localsgd.h first.

   nf_run(comm, &case) runs one case on every rank. What it checks:
   - FAIL: the steps before K return DOPT_OK; step K's call returns DOPT_ERR_NONFINITE on every
     rank, and so does every later call; dopt_dp_detail names the step, the segment ("layer1")
     and the rank whose input was not finite; the gradient buffer holds zeros on every rank; the
     closing call returns DOPT_ERR_NONFINITE and leaves the same words in the communicator's
     detail, which dopt_comm_finish prints.
   - SKIP: step K returns DOPT_ERR_NONFINITE on every rank and every other step DOPT_OK; the
     gradients of step K are zeros, dp.skipped is 1, the detail names step and rank; the closing
     call finds the replicas bitwise identical, and they are finite.
   - Model averages (local SGD, rank size-1's parameters made non-finite before a sync): FAIL
     stops the driver; SKIP continues every rank from the mean of the finite ranks (at 2 ranks:
     rank 0's parameters, bit for bit).
   - Finite inputs whose sum overflows: named as an overflow, no rank blamed; a model average that
     overflows stops the driver under either policy (the parameters hold it already).
   Gradients are a flat buffer with a segment table (averaged in place), or with `scatter` the same
   three tensors as a scatter list (packed into the driver's workspace): the rule is the same, and
   the place is named by span instead of by name. */
#ifndef DOPT_TEST_NONFINITE_H
#define DOPT_TEST_NONFINITE_H

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NF_N 4096    /* embed 1000, layer1 3000 (30 x 100: PowerSGD compresses it), bias 96 */
#define NF_STEPS 8
#define NF_K 3       /* the step whose input is not finite */
#define NF_BAD 1017  /* layer1's element 17 */

typedef enum nf_mode {
    NF_GRADS,           /* after_backward alone, as README's drop-in (steps counted there) */
    NF_GRADS_AND_STEP,  /* after_backward and after_step */
    NF_CELGC,           /* dopt_dp_celgc_step with sync_grads at period 1 */
    NF_MODELS,          /* local SGD, period 4: the non-finite value in a model */
    NF_OVERFLOW,        /* finite gradients whose sum overflows */
    NF_MODELS_OVERFLOW  /* local SGD: finite models whose sum overflows */
} nf_mode;

typedef struct nf_case {
    nf_mode mode;
    int codec;                   /* -1: no compressor (fp32) */
    dopt_aggregate aggregate;
    dopt_nonfinite_policy policy;
    int inf;                     /* 1: +infinity instead of NaN */
    int weighted, outer;         /* NF_MODELS: weighted averages; DiLoCo's outer step */
    int scatter;                 /* gradients as a scatter list of the three tensors, not flat */
} nf_case;

static const dopt_segment nf_segs[3] = {
    {0, 1000, "embed", 0}, {1000, 3000, "layer1", 30}, {4000, 96, "bias", 0}};

static void nf_grads(float *g, int rank, int step) {
    size_t i;
    for (i = 0; i < NF_N; i++) {
        unsigned h = (unsigned)(i * 2654435761u) ^ (unsigned)(rank * 40503 + step * 977);
        g[i] = (float)((int)(h % 2001u) - 1000) * 1e-4f;
    }
}

static float nf_bad_value(const nf_case *k) {
    float v;
    uint32_t u = k->inf ? 0x7F800000u : 0x7FC00000u; /* by bits: -ffast-math may fold NAN and INFINITY */
    memcpy(&v, &u, sizeof v);
    return v;
}

static int nf_all_zero(const float *g, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        if (g[i] != 0.0f) return 0;
    return 1;
}

/* Every rank's copy of x (bytes) equal to rank 0's, bit for bit. */
static int nf_same_everywhere(dopt_comm *c, const void *x, size_t bytes) {
    unsigned char *all = (unsigned char *)malloc(bytes * (size_t)c->size);
    int r, same = all != NULL && dopt_allgather(c, x, all, bytes) == DOPT_OK;
    for (r = 1; same && r < c->size; r++) same = memcmp(all, all + (size_t)r * bytes, bytes) == 0;
    free(all);
    return same;
}

static void nf_check_named(const nf_case *k, dopt_dp *dp, int size, const char *when) {
    const char *d = dopt_dp_detail(dp);
    char rank[64];
    snprintf(rank, sizeof rank, "the input of rank %d held", size - 1);
    NF_CHECK(strstr(d, when) != NULL, "the detail does not name '%s': %s", when, d);
    if (k->mode == NF_OVERFLOW || k->mode == NF_MODELS_OVERFLOW) {
        NF_CHECK(strstr(d, "overflowed") != NULL && strstr(d, "input of rank") == NULL, "overflow not named: %s", d);
        return;
    }
    NF_CHECK(strstr(d, rank) != NULL, "the detail does not name %s: %s", rank, d);
    NF_CHECK(strstr(d, k->mode == NF_MODELS ? "element 17"
                       : k->scatter          ? "span 1 (unnamed), element 17"
                                             : "(layer1), element 17") != NULL,
             "the detail does not name the first place: %s", d);
}

static void nf_init_compressor(dopt_compressor *cz, const nf_case *k, dopt_comm *c) {
    dopt_compressor_config cc;
    memset(&cc, 0, sizeof cc);
    cc.codec = (dopt_codec)k->codec;
    cc.seed = 7;
    cc.rank = c->rank;
    cc.aggregate = k->aggregate;
    if (k->codec == DOPT_CODEC_TOPK) cc.topk_ratio = 0.05;
    NF_CHECK(dopt_compressor_init(cz, &cc, nf_segs, 3) == DOPT_OK, "compressor init (codec %d)", k->codec);
}

/* Synchronous steps: the gradient average. */
static void nf_run_grads(dopt_comm *c, const nf_case *k) {
    float *x = (float *)calloc(NF_N, sizeof(float)), *g = (float *)malloc(NF_N * sizeof(float));
    dopt_span spans[3];
    dopt_buf xb = dopt_buf_flat(x, NF_N, nf_segs, 3), gb = dopt_buf_flat(g, NF_N, nf_segs, 3);
    dopt_compressor cz;
    dopt_dp dp;
    dopt_dp_config cfg;
    dopt_status st, close_st;
    int t, bad_rank = c->size - 1;
    for (t = 0; t < 3; t++) {
        spans[t].ptr = g + nf_segs[t].offset;
        spans[t].count = nf_segs[t].count;
    }
    if (k->scatter) gb = dopt_buf_scatter(spans, 3);
    memset(&cfg, 0, sizeof cfg);
    cfg.nonfinite = k->policy;
    cfg.sync_grads = k->mode == NF_CELGC;
    if (k->codec >= 0) {
        nf_init_compressor(&cz, k, c);
        cfg.grad_compressor = &cz;
    }
    dopt_dp_init(&dp, c, NF_N, &cfg);
    dopt_dp_broadcast_buf(&dp, &xb, NULL);
    for (t = 0; t < NF_STEPS; t++) {
        nf_grads(g, c->rank, t);
        if (t == NF_K && k->mode == NF_OVERFLOW) g[NF_BAD] = FLT_MAX;
        else if (t == NF_K && c->rank == bad_rank) g[NF_BAD] = nf_bad_value(k);
        if (k->mode == NF_CELGC) {
            st = dopt_dp_celgc_step(&dp, &xb, &gb, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f});
        } else {
            size_t i;
            st = dopt_dp_after_backward_buf(&dp, &gb);
            for (i = 0; i < NF_N; i++) x[i] -= 0.01f * g[i]; /* README's loop: no status checked */
            if (k->mode == NF_GRADS_AND_STEP && t != NF_K) dopt_dp_after_step_buf(&dp, &xb, NULL);
            if (k->mode == NF_GRADS_AND_STEP && t == NF_K) {
                dopt_status after = dopt_dp_after_step_buf(&dp, &xb, NULL);
                NF_CHECK(after == (k->policy == DOPT_NONFINITE_FAIL ? DOPT_ERR_NONFINITE : DOPT_OK),
                         "after_step of the skipped step: %s", dopt_status_str(after));
            }
        }
        if (t < NF_K) NF_CHECK(st == DOPT_OK, "step %d: %s (%s)", t, dopt_status_str(st), dopt_dp_detail(&dp));
        if (t == NF_K) {
            NF_CHECK(st == DOPT_ERR_NONFINITE, "step %d: %s, not DOPT_ERR_NONFINITE", t, dopt_status_str(st));
            NF_CHECK(k->mode == NF_CELGC || nf_all_zero(g, NF_N), "step %d: the gradients are not zeros", t);
            nf_check_named(k, &dp, c->size, "step 3");
        }
        if (t > NF_K)
            NF_CHECK(st == (k->policy == DOPT_NONFINITE_FAIL ? DOPT_ERR_NONFINITE : DOPT_OK), "step %d: %s (%s)", t,
                     dopt_status_str(st), dopt_dp_detail(&dp));
    }
    NF_CHECK(k->policy != DOPT_NONFINITE_SKIP || dp.skipped == 1, "skipped %llu", (unsigned long long)dp.skipped);
    close_st = dopt_dp_close_buf(&dp, &xb, NULL);
    if (k->policy == DOPT_NONFINITE_FAIL) {
        NF_CHECK(close_st == DOPT_ERR_NONFINITE, "close: %s", dopt_status_str(close_st));
        NF_CHECK(strstr(dopt_comm_detail(c), "step 3") != NULL, "the communicator's detail: %s", dopt_comm_detail(c));
    } else {
        NF_CHECK(close_st == DOPT_OK, "close: %s (%s)", dopt_status_str(close_st), dopt_dp_detail(&dp));
        NF_CHECK(dopt_all_finite(x, NF_N), "the replicas are not finite");
        NF_CHECK(nf_same_everywhere(c, x, NF_N * sizeof(float)), "the replicas differ");
    }
    if (k->codec >= 0) dopt_compressor_free(&cz);
    free(x);
    free(g);
}

/* Local SGD at period 4: rank size-1's model goes non-finite in the round that ends after step 7. */
static void nf_run_models(dopt_comm *c, const nf_case *k) {
    float *x = (float *)calloc(NF_N, sizeof(float)), *g = (float *)malloc(NF_N * sizeof(float));
    float *ref = (float *)malloc(NF_N * sizeof(float));
    dopt_buf xb = dopt_buf_flat(x, NF_N, nf_segs, 3);
    dopt_compressor cz;
    dopt_dp dp;
    dopt_dp_config cfg;
    dopt_status st;
    int t, i;
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 4;
    cfg.nonfinite = k->policy;
    cfg.weighted = k->weighted;
    if (k->outer) {
        cfg.outer_lr = 0.7;
        cfg.outer_momentum = 0.9;
    }
    if (k->codec >= 0) {
        nf_init_compressor(&cz, k, c);
        cfg.compressor = &cz;
    }
    dopt_dp_init(&dp, c, NF_N, &cfg);
    dopt_dp_broadcast_buf(&dp, &xb, NULL);
    for (t = 0; t < NF_STEPS; t++) {
        nf_grads(g, c->rank, t);
        for (i = 0; i < NF_N; i++) x[i] -= 0.01f * g[i];
        if (t == 5 && k->mode == NF_MODELS_OVERFLOW) x[NF_BAD] = FLT_MAX;
        else if (t == 5 && c->rank == c->size - 1) x[NF_BAD] = nf_bad_value(k);
        if (t == 7) memcpy(ref, x, NF_N * sizeof(float));
        if (t == 7) dopt_broadcast(c, ref, NF_N * sizeof(float), 0); /* rank 0's model before the sync */
        st = dopt_dp_after_step_buf(&dp, &xb, NULL);
        if (t < 7) NF_CHECK(st == DOPT_OK, "step %d: %s (%s)", t, dopt_status_str(st), dopt_dp_detail(&dp));
    }
    NF_CHECK(st == DOPT_ERR_NONFINITE, "the sync after step 7: %s", dopt_status_str(st));
    nf_check_named(k, &dp, c->size, "after step 7");
    if (k->mode == NF_MODELS_OVERFLOW) {
        NF_CHECK(strstr(dopt_dp_detail(&dp), "the driver stopped") != NULL, "not stopped: %s", dopt_dp_detail(&dp));
        NF_CHECK(dopt_dp_after_step_buf(&dp, &xb, NULL) == DOPT_ERR_NONFINITE, "a call after the stop");
        NF_CHECK(nf_same_everywhere(c, x, NF_N * sizeof(float)), "the overflowed models differ");
        NF_CHECK(dopt_dp_close_buf(&dp, &xb, NULL) == DOPT_ERR_NONFINITE, "close after the stop");
    } else if (k->policy == DOPT_NONFINITE_SKIP) {
        NF_CHECK(dp.skipped == 1, "skipped %llu", (unsigned long long)dp.skipped);
        NF_CHECK(dopt_all_finite(x, NF_N) && nf_same_everywhere(c, x, NF_N * sizeof(float)),
                 "the models after a skipped average are not identical and finite");
        if (c->size == 2) NF_CHECK(memcmp(x, ref, NF_N * sizeof(float)) == 0, "not rank 0's model, the finite one");
        NF_CHECK(dopt_dp_close_buf(&dp, &xb, NULL) == DOPT_OK, "close: %s", dopt_dp_detail(&dp));
    } else {
        st = dopt_dp_after_step_buf(&dp, &xb, NULL);
        NF_CHECK(st == DOPT_ERR_NONFINITE, "a call after the stop: %s", dopt_status_str(st));
        NF_CHECK(dopt_dp_close_buf(&dp, &xb, NULL) == DOPT_ERR_NONFINITE, "close after the stop");
    }
    if (k->codec >= 0) dopt_compressor_free(&cz);
    free(x);
    free(g);
    free(ref);
}

static void nf_run(dopt_comm *c, const nf_case *k) {
    if (k->mode == NF_MODELS || k->mode == NF_MODELS_OVERFLOW)
        nf_run_models(c, k);
    else
        nf_run_grads(c, k);
}

#endif /* DOPT_TEST_NONFINITE_H */
