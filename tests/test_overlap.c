/* Tests of the gradient buckets averaged during backward (localsgd.h's OVERLAP), over real
   processes on every transport of worlds.h: the bucketed mean against the whole-buffer mean
   (bitwise at two ranks, where a + b = b + a; within the rounding of a sum's order beyond, and
   bitwise equal to the same buckets run on the host thread) for a flat buffer averaged in place,
   one with gaps and a scatter list, with buckets of a given size and of the size the rule
   chooses; buckets completed out of order; the order rebuilt once, the same on every rank; a
   rank marking in another order; a mistake in one rank's marks (a segment marked twice, never, or
   unknown; other gradients given) said on every rank; an unused segment averaged as
   zeros; every codec in buckets against its whole-buffer call (means and state, bitwise where
   compress.h says they must be); a NaN in one rank's bucket, fp32 or ternary; a peer lost with buckets in flight; a write after the mark
   caught by overlap_check; local steps, where marks do nothing; weighted means, the batch
   controller's statistics and save/load around bucketed steps against blocking ones. No test
   asserts a time. */
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

/* ------------------------------------------------------------------ a host with eight tensors */

#define OV_NSEG 8
static const size_t ov_sizes[OV_NSEG] = {3000, 17, 40000, 5, 9000, 300000, 64, 1200};
static const char *ov_names[OV_NSEG] = {"emb", "emb.b", "h0.w", "h0.b", "h1.w", "h1.w2", "h1.b", "out"};
static const size_t ov_rows[OV_NSEG] = {30, 0, 200, 0, 90, 500, 0, 0}; /* PowerSGD's matrices */

enum { OV_FLAT, OV_GAPS, OV_SCATTER };

typedef struct ov_host {
    int layout;
    size_t n, memn;
    float *mem;
    dopt_segment segs[OV_NSEG];
    dopt_span spans[OV_NSEG];
    dopt_buf buf;
} ov_host;

static void ov_host_init(ov_host *h, int layout) {
    size_t i, off = 0, gap = layout == OV_GAPS ? 3 : 0;
    memset(h, 0, sizeof *h);
    h->layout = layout;
    for (i = 0; i < OV_NSEG; i++) h->n += ov_sizes[i];
    h->memn = h->n + gap * OV_NSEG;
    h->mem = (float *)calloc(h->memn, sizeof(float));
    DT_CHECK(h->mem != NULL);
    for (i = 0; i < OV_NSEG; i++) {
        h->segs[i] = (dopt_segment){off, ov_sizes[i], ov_names[i], ov_rows[i]};
        off += ov_sizes[i] + gap;
    }
    if (layout == OV_SCATTER) { /* the spans in the memory in reverse order: nothing is contiguous as numbered */
        off = h->n;
        for (i = 0; i < OV_NSEG; i++) {
            off -= ov_sizes[i];
            h->spans[i] = (dopt_span){h->mem + off, ov_sizes[i]};
        }
        h->buf = dopt_buf_scatter(h->spans, OV_NSEG);
    } else {
        h->buf = dopt_buf_flat(h->mem, h->memn, h->segs, OV_NSEG);
    }
}

static float ov_value(int rank, int step, size_t seg, size_t e) {
    uint32_t x = (uint32_t)rank * 2654435761u ^ (uint32_t)step * 40503u ^ (uint32_t)seg * 97u ^ (uint32_t)e * 2246822519u;
    x ^= x >> 15;
    x *= 2654435761u;
    x ^= x >> 13;
    return ((float)(x >> 8) / 16777216.0f - 0.5f) * (float)(1 + rank) * (seg == 3 ? 1e-3f : 1.0f);
}

static void ov_fill(ov_host *h, size_t seg, int rank, int step) {
    dopt_span sp = dopt_buf_segment(&h->buf, seg);
    size_t e;
    for (e = 0; e < sp.count; e++) sp.ptr[e] = ov_value(rank, step, seg, e);
}

/* Backward, layer by layer: each segment written, then marked. order NULL: the last first. */
static void ov_backward(dopt_dp *dp, ov_host *h, int rank, int step, const size_t *order) {
    size_t j;
    for (j = 0; j < OV_NSEG; j++) {
        size_t i = order ? order[j] : OV_NSEG - 1 - j;
        ov_fill(h, i, rank, step);
        DT_OK(dopt_dp_grad_ready(dp, i));
    }
}

/* got against the whole-buffer mean of the inputs (want, averaged here): bitwise at two ranks;
   beyond, within a few roundings of the inputs' magnitude (the ring's order of a sum follows
   the message's cut), and the same bits on every rank either way. */
static void ov_check_mean(dopt_comm *c, const float *got, float *want, size_t n, const char *what) {
    size_t i;
    DT_OK(dopt_allreduce(c, want, n, DOPT_F32, DOPT_MEAN));
    if (c->size == 2) {
        for (i = 0; i < n; i++)
            DT_CHECKF(memcmp(&got[i], &want[i], sizeof(float)) == 0, "%s: element %zu: %.9g, the whole-buffer mean %.9g",
                      what, i, got[i], want[i]);
    } else {
        for (i = 0; i < n; i++)
            DT_CHECKF(fabsf(got[i] - want[i]) <= 4e-7f * (float)c->size, "%s: element %zu: %.9g, the whole-buffer mean %.9g",
                      what, i, got[i], want[i]);
    }
    DT_CHECKF(world_same_on_every_rank(c, got, n * sizeof(float)), "%s: the mean differs between ranks", what);
}

/* ------------------------------------------------------------------ the mean, bucket by bucket */

typedef struct ov_case {
    int layout;
    size_t bucket_bytes; /* 0: the rule's */
    int check;           /* overlap_check */
} ov_case;

static const ov_case ov_cases[] = {
    {OV_FLAT, 64 << 10, 0}, {OV_FLAT, 0, 0},         {OV_GAPS, 64 << 10, 0},
    {OV_SCATTER, 96 << 10, 0}, {OV_SCATTER, 0, 1}, {OV_FLAT, 16 << 10, 1},
};

static void body_bucketed_mean(dopt_comm *c, void *arg) {
    const ov_case *k = (const ov_case *)arg;
    ov_host h;
    dopt_dp dp;
    float *got, *want;
    size_t nb = 0;
    int step;
    ov_host_init(&h, k->layout);
    got = (float *)malloc(h.n * sizeof(float));
    want = (float *)malloc(h.n * sizeof(float));
    DT_OK(dopt_dp_init(&dp, c, h.n,
                       &(dopt_dp_config){.grads = &h.buf, .bucket_bytes = k->bucket_bytes, .overlap_check = k->check}));
    for (step = 0; step < 5; step++) {
        ov_backward(&dp, &h, c->rank, step, NULL);
        { /* the inputs again (the marked gradients belong to the buckets until after_backward) */
            size_t i, e, off = 0;
            for (i = 0; i < OV_NSEG; i++)
                for (e = 0; e < ov_sizes[i]; e++) want[off++] = ov_value(c->rank, step, i, e);
        }
        DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
        dopt_buf_pack(&h.buf, got);
        ov_check_mean(c, got, want, h.n, "bucketed mean");
        DT_CHECK(dp.ov.rebuilt);
        if (step == 1) nb = dp.ov.nbuckets;
        if (step > 1) DT_EQ_INT(dp.ov.nbuckets, nb); /* rebuilt once */
    }
    DT_CHECKF(dp.ov.nbuckets > 1, "%zu buckets", dp.ov.nbuckets);
    DT_CHECK(world_same_on_every_rank(c, dp.ov.order, OV_NSEG * sizeof(size_t)));
    DT_CHECK(world_same_on_every_rank(c, &dp.ov.cut_bytes, sizeof dp.ov.cut_bytes));
    DT_EQ_INT(dp.grads_step, 5); /* the fifth step averaged */
    dopt_dp_free(&dp);
    free(got);
    free(want);
    free(h.mem);
}

DTEST_WORLDS_EACH(bucketed_mean_equals_the_whole_buffer_mean, body_bucketed_mean, ov_cases, 2, 4);

/* The same buckets run by the worker and on the host thread (as on an MPI communicator that
   only its own thread may call): the same bits at every world size. */
static void body_worker_equals_host_thread(dopt_comm *c, void *arg) {
    ov_host h1, h2;
    dopt_dp a, b;
    int step;
    (void)arg;
    ov_host_init(&h1, OV_FLAT);
    ov_host_init(&h2, OV_FLAT);
    DT_OK(dopt_dp_init(&a, c, h1.n, &(dopt_dp_config){.grads = &h1.buf, .bucket_bytes = 40 << 10}));
    DT_OK(dopt_dp_init(&b, c, h2.n, &(dopt_dp_config){.grads = &h2.buf, .bucket_bytes = 40 << 10}));
    for (step = 0; step < 3; step++) {
        ov_backward(&a, &h1, c->rank, step, NULL);
        DT_OK(dopt_dp_after_backward_buf(&a, &h1.buf));
        c->one_thread = 1; /* b's first mark then runs its buckets in after_backward */
        ov_backward(&b, &h2, c->rank, step, NULL);
        c->one_thread = 0;
        DT_CHECK(b.ov.worker == NULL);
        DT_OK(dopt_dp_after_backward_buf(&b, &h2.buf));
        DT_CHECK(memcmp(h1.mem, h2.mem, h1.n * sizeof(float)) == 0);
    }
#ifdef DOPT__THREADS
    DT_CHECK(a.ov.worker != NULL);
#else
    DT_CHECK(a.ov.worker == NULL); /* a build without threads: every driver's buckets wait for after_backward */
#endif
    dopt_dp_free(&a);
    dopt_dp_free(&b);
    free(h1.mem);
    free(h2.mem);
}

DTEST_WORLDS(buckets_on_the_worker_equal_buckets_on_the_host_thread, body_worker_equals_host_thread, NULL, 2, 4);

/* After the rebuild, marks in another order every step (the same on every rank): a later
   bucket completes before an earlier one and waits for it; the mean is unchanged. */
static void body_out_of_order(dopt_comm *c, void *arg) {
    ov_host h;
    dopt_dp dp;
    float *want = NULL, *got = NULL;
    int step;
    (void)arg;
    ov_host_init(&h, OV_FLAT);
    want = (float *)malloc(h.n * sizeof(float));
    got = (float *)malloc(h.n * sizeof(float));
    DT_OK(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf, .bucket_bytes = 32 << 10}));
    for (step = 0; step < 6; step++) {
        size_t order[OV_NSEG], j;
        for (j = 0; j < OV_NSEG; j++) order[j] = j;
        if (step > 0)
            for (j = OV_NSEG - 1; j > 0; j--) { /* a permutation of the step's own */
                size_t r = ((size_t)step * 31 + j * 17) % (j + 1), t = order[j];
                order[j] = order[r];
                order[r] = t;
            }
        ov_backward(&dp, &h, c->rank, step, order);
        {
            size_t i, e, off = 0;
            for (i = 0; i < OV_NSEG; i++)
                for (e = 0; e < ov_sizes[i]; e++) want[off++] = ov_value(c->rank, step, i, e);
        }
        DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
        memcpy(got, h.mem, h.n * sizeof(float));
        ov_check_mean(c, got, want, h.n, "out of order");
        if (step == 0) {
            for (j = 0; j < OV_NSEG; j++) DT_EQ_INT(dp.ov.order[j], j); /* the order seen, agreed */
        }
    }
    for (step = 0; step < OV_NSEG; step++) DT_EQ_INT(dp.ov.order[step], step); /* rebuilt once only */
    dopt_dp_free(&dp);
    free(want);
    free(got);
    free(h.mem);
}

DTEST_WORLDS(buckets_completed_out_of_order_wait_for_the_ones_before, body_out_of_order, NULL, 2, 4);

/* ------------------------------------------------------------------ compressed buckets */

typedef struct ov_codec {
    dopt_codec codec;
    dopt_aggregate aggregate;
    int bitwise_beyond_two; /* 0: a float sum that follows the message's cut (compress.h says which) */
} ov_codec;

static const ov_codec ov_codecs[] = {
    {DOPT_CODEC_TERNARY, DOPT_AGG_AUTO, 1},   {DOPT_CODEC_TERNARY, DOPT_AGG_RING, 1},
    {DOPT_CODEC_TERNARY, DOPT_AGG_ALLGATHER, 1}, {DOPT_CODEC_QSGD, DOPT_AGG_AUTO, 1},
    {DOPT_CODEC_TOPK, DOPT_AGG_AUTO, 1},      {DOPT_CODEC_SIGN, DOPT_AGG_AUTO, 1},
    {DOPT_CODEC_MAJORITY, DOPT_AGG_RING, 1},  {DOPT_CODEC_FP16, DOPT_AGG_ALLGATHER, 1},
    {DOPT_CODEC_FP16, DOPT_AGG_RING, 0},      {DOPT_CODEC_BF16, DOPT_AGG_AUTO, 0},
    {DOPT_CODEC_POWERSGD, DOPT_AGG_AUTO, 0},
};

/* A compressor over the packed gradients with the host's segments (counts, matrices, names). */
static void ov_compressor(dopt_compressor *cz, const ov_codec *k, const ov_host *h) {
    dopt_segment packed[OV_NSEG];
    dopt_compressor_config cfg;
    size_t i, off = 0;
    for (i = 0; i < OV_NSEG; i++) {
        packed[i] = h->segs[i];
        packed[i].offset = off;
        off += packed[i].count;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.codec = k->codec;
    cfg.aggregate = k->aggregate;
    cfg.seed = 99;
    DT_OK(dopt_compressor_init(cz, &cfg, packed, OV_NSEG));
}

/* The same steps through two drivers with one compressor configuration each: one in buckets
   during backward, one whole after it. Their means, and the compressors' state files, agree bit
   for bit at two ranks for every codec, and beyond for every one whose sums are exact or in rank
   order; elsewhere the same bits on every rank. */
static void body_compressed_buckets(dopt_comm *c, void *arg) {
    const ov_codec *k = (const ov_codec *)arg;
    ov_host ha, hb;
    dopt_compressor ca, cb;
    dopt_dp a, b;
    int step, layout = k->codec == DOPT_CODEC_TOPK ? OV_SCATTER : k->codec == DOPT_CODEC_QSGD ? OV_GAPS : OV_FLAT;
    int bitwise = c->size == 2 || k->bitwise_beyond_two;
    float *ga, *gb;
    ov_host_init(&ha, layout);
    ov_host_init(&hb, layout);
    ov_compressor(&ca, k, &ha);
    ov_compressor(&cb, k, &hb);
    ga = (float *)malloc(ha.n * sizeof(float));
    gb = (float *)malloc(ha.n * sizeof(float));
    DT_OK(dopt_dp_init(&a, c, ha.n, &(dopt_dp_config){.grads = &ha.buf, .grad_compressor = &ca, .bucket_bytes = 48 << 10}));
    DT_OK(dopt_dp_init(&b, c, hb.n, &(dopt_dp_config){.grad_compressor = &cb}));
    for (step = 0; step < 4; step++) {
        size_t i;
        ov_backward(&a, &ha, c->rank, step, NULL);
        for (i = 0; i < OV_NSEG; i++) ov_fill(&hb, i, c->rank, step);
        DT_OK(dopt_dp_after_backward_buf(&a, &ha.buf));
        DT_OK(dopt_dp_after_backward_buf(&b, &hb.buf));
        dopt_buf_pack(&ha.buf, ga);
        dopt_buf_pack(&hb.buf, gb);
        if (bitwise)
            for (i = 0; i < ha.n; i++)
                DT_CHECKF(memcmp(&ga[i], &gb[i], sizeof(float)) == 0, "%s, step %d, element %zu: %.9g in buckets, %.9g whole",
                          dopt_codec_name(k->codec), step, i, ga[i], gb[i]);
        DT_CHECK(world_same_on_every_rank(c, ga, ha.n * sizeof(float)));
        DT_EQ_INT(ca.step, cb.step);
    }
    DT_CHECKF(a.ov.nbuckets > 2, "%zu buckets", a.ov.nbuckets);
    if (bitwise) {
        size_t bytes = dopt_compress_state_bytes(&ca);
        unsigned char *sa = (unsigned char *)malloc(bytes), *sb = (unsigned char *)malloc(bytes);
        DT_EQ_INT(dopt_compress_state_bytes(&cb), bytes);
        DT_OK(dopt_compress_state_save(&ca, sa, bytes));
        DT_OK(dopt_compress_state_save(&cb, sb, bytes));
        DT_CHECKF(memcmp(sa, sb, bytes) == 0, "%s: the state (residuals, step) differs", dopt_codec_name(k->codec));
        free(sa);
        free(sb);
    }
    dopt_dp_free(&a);
    dopt_dp_free(&b);
    dopt_compressor_free(&ca);
    dopt_compressor_free(&cb);
    free(ga);
    free(gb);
    free(ha.mem);
    free(hb.mem);
}

DTEST_WORLDS_EACH(compressed_buckets_equal_the_whole_compressed_mean, body_compressed_buckets, ov_codecs, 2, 3);

/* A gradient compressor whose table is not the gradients' is refused at init, naming the first
   segment that differs and both counts. */
static void body_compressor_table(dopt_comm *c, void *arg) {
    ov_host h;
    dopt_compressor cz;
    dopt_compressor_config cfg;
    dopt_segment whole;
    dopt_dp dp;
    (void)arg;
    ov_host_init(&h, OV_FLAT);
    whole = (dopt_segment){0, h.n, "all", 0};
    memset(&cfg, 0, sizeof cfg);
    DT_OK(dopt_compressor_init(&cz, &cfg, &whole, 1));
    DT_EQ_INT(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf, .grad_compressor = &cz}), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&dp), "compressor's table (1 segments) does not fit the gradients' (8): segment 0 "
                                          "('emb') has 353286 elements in the compressor's, 3000 elements in the gradients'"),
              "%s", dopt_dp_detail(&dp));
    dopt_compressor_free(&cz);
    { /* the same eight segments but h0.b one element longer, h1.w one shorter: segment 3 is named */
        dopt_segment moved[OV_NSEG];
        memcpy(moved, h.segs, sizeof moved);
        moved[3].count++;
        moved[4].offset++;
        moved[4].count--;
        DT_OK(dopt_compressor_init(&cz, &cfg, moved, OV_NSEG));
        DT_EQ_INT(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf, .grad_compressor = &cz}), DOPT_ERR_INVALID);
        DT_CHECKF(strstr(dopt_dp_detail(&dp), "segment 3 ('h0.b') has 6 elements in the compressor's, 5 elements in the "
                                              "gradients'"),
                  "%s", dopt_dp_detail(&dp));
        dopt_compressor_free(&cz);
    }
    free(h.mem);
}

DTEST_WORLDS(a_gradient_compressor_with_another_table_is_refused, body_compressor_table, NULL, 2, 2);

/* ------------------------------------------------------------------ weights, batch statistics, state files */

/* Weighted means (cfg.weighted: each rank weighs by its step's samples, unequal here) in buckets
   against the blocking whole-buffer weighted mean: the same bits at two ranks, within a few
   roundings beyond, the same on every rank either way. A bucket averaging plainly would differ. */
static void body_weighted(dopt_comm *c, void *arg) {
    ov_host ha, hb;
    dopt_dp a, b;
    float *ga, *gb;
    size_t i;
    int step;
    (void)arg;
    ov_host_init(&ha, OV_SCATTER);
    ov_host_init(&hb, OV_SCATTER);
    ga = (float *)malloc(ha.n * sizeof(float));
    gb = (float *)malloc(ha.n * sizeof(float));
    DT_OK(dopt_dp_init(&a, c, ha.n, &(dopt_dp_config){.grads = &ha.buf, .weighted = 1, .bucket_bytes = 64 << 10}));
    DT_OK(dopt_dp_init(&b, c, hb.n, &(dopt_dp_config){.weighted = 1}));
    for (step = 0; step < 4; step++) {
        double samples = (double)(1 + 3 * c->rank + step);
        DT_OK(dopt_dp_set_step_samples(&a, samples));
        DT_OK(dopt_dp_set_step_samples(&b, samples));
        ov_backward(&a, &ha, c->rank, step, NULL);
        for (i = 0; i < OV_NSEG; i++) ov_fill(&hb, i, c->rank, step);
        DT_OK(dopt_dp_after_backward_buf(&a, &ha.buf));
        DT_OK(dopt_dp_after_backward_buf(&b, &hb.buf));
        dopt_buf_pack(&ha.buf, ga);
        dopt_buf_pack(&hb.buf, gb);
        for (i = 0; i < ha.n; i++)
            DT_CHECKF(c->size == 2 ? memcmp(&ga[i], &gb[i], sizeof(float)) == 0 : fabsf(ga[i] - gb[i]) <= 2e-6f,
                      "step %d, element %zu: %.9g in buckets, %.9g whole", step, i, ga[i], gb[i]);
        DT_CHECK(world_same_on_every_rank(c, ga, ha.n * sizeof(float)));
    }
    DT_CHECK(a.ov.rebuilt && a.ov.nbuckets > 2);
    dopt_dp_free(&a);
    dopt_dp_free(&b);
    free(ga);
    free(gb);
    free(ha.mem);
    free(hb.mem);
}

DTEST_WORLDS(weighted_buckets_equal_the_whole_weighted_mean, body_weighted, NULL, 2, 3);

/* The adaptive batch controller after bucketed steps: each rank observes the same micro-batch
   gradients into two controllers, one driven by a bucketed driver, one by a blocking one; every
   decision's statistics (the averaged gradient's direction and norm among them) and the units
   come out the same: bitwise at two ranks, within roundings beyond. */
static void body_batch_stats(dopt_comm *c, void *arg) {
    ov_host ha, hb;
    dopt_batch ba, bb;
    dopt_batch_config bcfg;
    dopt_dp a, b;
    float *micro, *pa, *pb;
    size_t i, e, u;
    int step;
    (void)arg;
    ov_host_init(&ha, OV_FLAT);
    ov_host_init(&hb, OV_FLAT);
    micro = (float *)malloc(ha.n * sizeof(float));
    pa = (float *)calloc(ha.n, sizeof(float));
    pb = (float *)calloc(ha.n, sizeof(float));
    memset(&bcfg, 0, sizeof bcfg);
    bcfg.test = DOPT_BATCH_AUGMENTED;
    bcfg.estimator = DOPT_BATCH_WITHIN;
    bcfg.projection = DOPT_BATCH_PROJECT_EXACT;
    bcfg.unit_samples = 2;
    bcfg.initial_units = 2;
    bcfg.max_units = 8;
    DT_OK(dopt_batch_init(&ba, ha.n, &bcfg));
    DT_OK(dopt_batch_init(&bb, hb.n, &bcfg));
    DT_OK(dopt_dp_init(&a, c, ha.n, &(dopt_dp_config){.grads = &ha.buf, .batch = &ba, .bucket_bytes = 64 << 10}));
    DT_OK(dopt_dp_init(&b, c, hb.n, &(dopt_dp_config){.batch = &bb}));
    DT_OK(dopt_dp_broadcast(&a, pa));
    DT_OK(dopt_dp_broadcast(&b, pb));
    for (step = 0; step < 4; step++) {
        size_t units = dopt_batch_units(&ba);
        dopt_buf mb = dopt_buf_flat(micro, ha.n, NULL, 0);
        DT_EQ_INT(dopt_batch_units(&bb), units);
        memset(hb.mem, 0, hb.n * sizeof(float));
        for (u = 0; u < units; u++) { /* micro-batch u: its gradient, observed by both, into the step's mean */
            size_t off = 0;
            for (i = 0; i < OV_NSEG; i++)
                for (e = 0; e < ov_sizes[i]; e++, off++)
                    micro[off] = ov_value(c->rank, step * 8 + (int)u, i, e) + (float)((i + e) % 5) * 0.1f;
            DT_OK(dopt_batch_observe(&ba, &mb, 1.0f));
            DT_OK(dopt_batch_observe(&bb, &mb, 1.0f));
            dopt_axpy(hb.mem, 1.0f / (float)units, micro, hb.n);
        }
        for (i = OV_NSEG; i-- > 0;) { /* backward: each segment of the mean written, then marked */
            memcpy(ha.mem + ha.segs[i].offset, hb.mem + hb.segs[i].offset, ov_sizes[i] * sizeof(float));
            DT_OK(dopt_dp_grad_ready(&a, i));
        }
        DT_OK(dopt_dp_after_backward_buf(&a, &ha.buf));
        DT_OK(dopt_dp_after_backward_buf(&b, &hb.buf));
        if (c->size == 2) DT_CHECK(memcmp(ha.mem, hb.mem, ha.n * sizeof(float)) == 0);
        dopt_axpy(pa, -0.1f, ha.mem, ha.n);
        dopt_axpy(pb, -0.1f, hb.mem, hb.n);
        DT_OK(dopt_dp_after_step(&a, pa));
        DT_OK(dopt_dp_after_step(&b, pb));
        if (c->size == 2) {
            DT_CHECKF(memcmp(&ba.last, &bb.last, sizeof ba.last) == 0,
                      "step %d: var %.17g ip_var %.17g grad_norm2 %.17g in buckets; %.17g %.17g %.17g whole", step,
                      ba.last.var, ba.last.ip_var, ba.last.grad_norm2, bb.last.var, bb.last.ip_var, bb.last.grad_norm2);
        } else {
            DT_NEAR(ba.last.var, bb.last.var, 1e-5 * fabs(bb.last.var));
            DT_NEAR(ba.last.ip_var, bb.last.ip_var, 1e-5 * fabs(bb.last.var));
            DT_NEAR(ba.last.grad_norm2, bb.last.grad_norm2, 1e-5 * fabs(bb.last.grad_norm2));
        }
        DT_CHECK(ba.last.ip_var == ba.last.ip_var); /* projected on the averaged gradient: known */
        DT_NEAR(ba.last.workers, (double)c->size, 0.0);
    }
    DT_EQ_INT(ba.decisions, bb.decisions);
    DT_CHECK(ba.decisions > 0);
    dopt_dp_free(&a);
    dopt_dp_free(&b);
    dopt_batch_free(&ba);
    dopt_batch_free(&bb);
    free(micro);
    free(pa);
    free(pb);
    free(ha.mem);
    free(hb.mem);
}

DTEST_WORLDS(batch_statistics_after_bucketed_steps_equal_blocking_ones, body_batch_stats, NULL, 2, 3);

static unsigned char *ov_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    unsigned char *p;
    long end;
    DT_CHECK(f != NULL && fseek(f, 0, SEEK_END) == 0 && (end = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0);
    p = (unsigned char *)malloc((size_t)end);
    DT_CHECK(p != NULL && fread(p, 1, (size_t)end, f) == (size_t)end);
    fclose(f);
    *len = (size_t)end;
    return p;
}

/* Files equal byte for byte. */
static int ov_same_file(const char *x, const char *y) {
    size_t lx, ly;
    unsigned char *px = ov_read_file(x, &lx), *py = ov_read_file(y, &ly);
    int same = lx == ly && memcmp(px, py, lx) == 0;
    free(px);
    free(py);
    return same;
}

/* A ternary compressor with error feedback over the host's segments, for the state files. */
static void ov_ef_compressor(dopt_compressor *cz, const ov_host *h) {
    dopt_segment packed[OV_NSEG];
    dopt_compressor_config cfg;
    size_t i, off = 0;
    for (i = 0; i < OV_NSEG; i++) {
        packed[i] = h->segs[i];
        packed[i].offset = off;
        off += packed[i].count;
    }
    memset(&cfg, 0, sizeof cfg);
    cfg.codec = DOPT_CODEC_TERNARY;
    cfg.error_feedback = DOPT_EF_ON;
    cfg.seed = 7;
    DT_OK(dopt_compressor_init(cz, &cfg, packed, OV_NSEG));
}

static void ov_step(dopt_dp *dp, ov_host *h, float *params, int rank, int step) {
    ov_backward(dp, h, rank, step, NULL);
    DT_OK(dopt_dp_after_backward_buf(dp, &h->buf));
    dopt_axpy(params, -0.1f, h->mem, h->n);
    DT_OK(dopt_dp_after_step(dp, params));
}

/* dopt_dp_save and dopt_dp_load around bucketed steps with a gradient compressor whose error
   feedback is live: the file a fresh driver loads saves back byte for byte, and the next step
   from it gives the same gradients, parameters and file as the step the saving driver took. */
static void body_save_load(dopt_comm *c, void *arg) {
    ov_host h;
    dopt_compressor cz, cz2;
    dopt_dp a, r;
    char dir[128], s1[160], s1r[160], s2a[160], s2r[160];
    float *pa, *p1, *g2;
    int step;
    (void)arg;
    world_tmpdir(c, dir, sizeof dir);
    snprintf(s1, sizeof s1, "%s/s1.%d", dir, c->rank);
    snprintf(s1r, sizeof s1r, "%s/s1r.%d", dir, c->rank);
    snprintf(s2a, sizeof s2a, "%s/s2a.%d", dir, c->rank);
    snprintf(s2r, sizeof s2r, "%s/s2r.%d", dir, c->rank);
    ov_host_init(&h, OV_FLAT);
    pa = (float *)calloc(h.n, sizeof(float));
    p1 = (float *)malloc(h.n * sizeof(float));
    g2 = (float *)malloc(h.n * sizeof(float));
    ov_ef_compressor(&cz, &h);
    DT_OK(dopt_dp_init(&a, c, h.n, &(dopt_dp_config){.grads = &h.buf, .grad_compressor = &cz, .bucket_bytes = 64 << 10}));
    DT_OK(dopt_dp_broadcast(&a, pa));
    for (step = 0; step < 2; step++) ov_step(&a, &h, pa, c->rank, step);
    DT_CHECK(a.ov.rebuilt && dopt_sumsq(cz.residual, h.n) > 0.0); /* buckets agreed, error feedback live */
    DT_OK(dopt_dp_save(&a, s1));
    memcpy(p1, pa, h.n * sizeof(float));
    ov_step(&a, &h, pa, c->rank, 2);
    memcpy(g2, h.mem, h.n * sizeof(float));
    DT_OK(dopt_dp_save(&a, s2a));
    dopt_dp_free(&a);
    dopt_compressor_free(&cz);
    /* a new process: a fresh compressor and driver, the file loaded, the step taken again */
    ov_ef_compressor(&cz2, &h);
    DT_OK(dopt_dp_init(&r, c, h.n, &(dopt_dp_config){.grads = &h.buf, .grad_compressor = &cz2, .bucket_bytes = 64 << 10}));
    DT_OK(dopt_dp_load(&r, s1));
    DT_EQ_INT(r.step, 2);
    DT_OK(dopt_dp_save(&r, s1r));
    DT_CHECKF(ov_same_file(s1, s1r), "rank %d: the loaded state saves to other bytes", c->rank);
    ov_step(&r, &h, p1, c->rank, 2);
    DT_CHECKF(memcmp(h.mem, g2, h.n * sizeof(float)) == 0, "rank %d: step 2's gradients differ after the load", c->rank);
    DT_CHECK(memcmp(p1, pa, h.n * sizeof(float)) == 0);
    DT_OK(dopt_dp_save(&r, s2r));
    DT_CHECKF(ov_same_file(s2a, s2r), "rank %d: the state after step 2 differs after the load", c->rank);
    dopt_dp_free(&r);
    dopt_compressor_free(&cz2);
    world_tmpdir_remove(c, dir);
    free(pa);
    free(p1);
    free(g2);
    free(h.mem);
}

DTEST_WORLDS(save_and_load_around_bucketed_steps_resume_bit_for_bit, body_save_load, NULL, 2, 3);

/* ------------------------------------------------------------------ the host's mistakes, said */

/* Rank 1 marks two segments the other way round in the first step: every rank is told, with
   the position, both segments and both ranks, and nothing hangs. */
static void body_other_order(dopt_comm *c, void *arg) {
    ov_host h;
    dopt_dp dp;
    size_t order[OV_NSEG], j;
    (void)arg;
    ov_host_init(&h, OV_FLAT);
    for (j = 0; j < OV_NSEG; j++) order[j] = OV_NSEG - 1 - j;
    if (c->rank == 1) {
        order[2] = OV_NSEG - 4;
        order[3] = OV_NSEG - 3;
    }
    DT_OK(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf}));
    ov_backward(&dp, &h, c->rank, 0, order);
    DT_EQ_INT(dopt_dp_after_backward_buf(&dp, &h.buf), DOPT_ERR_MISMATCH);
    DT_CHECKF(strstr(dopt_dp_detail(&dp), "position 2") && strstr(dopt_dp_detail(&dp), "rank 1") &&
                  strstr(dopt_dp_detail(&dp), "segment 5 ('h1.w2')") && strstr(dopt_dp_detail(&dp), "segment 4 ('h1.w')"),
              "detail: %s", dopt_dp_detail(&dp));
    DT_EQ_INT(dopt_dp_grad_ready(&dp, 0), DOPT_ERR_MISMATCH); /* the driver stopped */
    DT_EQ_INT(dopt_dp_after_backward_buf(&dp, &h.buf), DOPT_ERR_MISMATCH);
    dopt_dp_free(&dp);
    free(h.mem);
}

DTEST_WORLDS(a_rank_marking_in_another_order_is_named_on_every_rank, body_other_order, NULL, 2, 3);

/* A mistake in one rank's marks (or two ranks' different mistakes) is said by every rank's
   after_backward alike: DOPT_ERR_INVALID and the same detail, naming the lowest rank that erred
   and what it did; every rank's gradients are zeros; nothing hangs; the communicator and the
   driver go on, and the next step is the plain bucketed mean. */
enum { OV_TWICE, OV_NEVER, OV_UNKNOWN, OV_OTHER_GRADS };

typedef struct ov_mistake {
    int step; /* the step it happens in (0: the first, before the rebuild) */
    int kind; /* OV_TWICE: segment 3 marked twice; OV_NEVER: segment 2 never marked; OV_UNKNOWN:
                 segment 9 marked; OV_OTHER_GRADS: after_backward given another buffer */
    int also; /* 1: the last rank makes another mistake too (segment 6 never marked) */
    const char *said;
} ov_mistake;

static const ov_mistake ov_mistakes[] = {
    {0, OV_TWICE, 0, "segment 3 ('h0.b') was marked twice"},
    {0, OV_NEVER, 0, "segment 2 ('h0.w') was never marked"},
    {2, OV_TWICE, 0, "segment 3 ('h0.b') was marked twice"},
    {2, OV_NEVER, 0, "segment 2 ('h0.w') was never marked"},
    {2, OV_UNKNOWN, 0, "dopt_dp_grad_ready was given segment 9, and the gradients have 8 segments"},
    {0, OV_UNKNOWN, 0, "dopt_dp_grad_ready was given segment 9, and the gradients have 8 segments"},
    {2, OV_OTHER_GRADS, 0, "after_backward was given other gradients"},
    {2, OV_TWICE, 1, "segment 3 ('h0.b') was marked twice"},
};

/* The step's marks on this rank, with the case's mistake where `erring`. */
static void ov_backward_mistaken(dopt_dp *dp, ov_host *h, int rank, int step, int kind, int erring, int also) {
    size_t i;
    for (i = OV_NSEG; i-- > 0;) {
        if ((erring && kind == OV_NEVER && i == 2) || (also && i == 6)) continue;
        ov_fill(h, i, rank, step);
        DT_OK(dopt_dp_grad_ready(dp, i));
        if (erring && kind == OV_TWICE && i == 3) {
            DT_EQ_INT(dopt_dp_grad_ready(dp, 3), DOPT_ERR_INVALID);
            DT_CHECKF(strstr(dopt_dp_detail(dp), "segment 3 ('h0.b') was marked already"), "%s", dopt_dp_detail(dp));
        }
        if (erring && kind == OV_UNKNOWN && i == 5) DT_EQ_INT(dopt_dp_grad_ready(dp, 9), DOPT_ERR_INVALID);
    }
}

static void body_mistake(dopt_comm *c, void *arg) {
    const ov_mistake *m = (const ov_mistake *)arg;
    ov_host h, other;
    dopt_dp dp;
    char detail[DOPT_DP_DETAIL_MAX], rank1[64];
    float *want, *got;
    size_t i, e, off = 0;
    int step, erring = c->rank == 1, also = m->also && c->rank == c->size - 1 && c->size > 2;
    ov_host_init(&h, OV_GAPS);
    ov_host_init(&other, OV_GAPS);
    want = (float *)malloc(h.n * sizeof(float));
    got = (float *)malloc(h.n * sizeof(float));
    DT_OK(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf, .bucket_bytes = 50 << 10}));
    for (step = 0; step < m->step; step++) {
        ov_backward(&dp, &h, c->rank, step, NULL);
        DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
    }
    ov_backward_mistaken(&dp, &h, c->rank, m->step, m->kind, erring, also);
    DT_EQ_INT(dopt_dp_after_backward_buf(&dp, erring && m->kind == OV_OTHER_GRADS ? &other.buf : &h.buf),
              DOPT_ERR_INVALID);
    snprintf(rank1, sizeof rank1, "step %d: rank 1: ", m->step);
    DT_CHECKF(strstr(dopt_dp_detail(&dp), rank1) && strstr(dopt_dp_detail(&dp), m->said), "%s", dopt_dp_detail(&dp));
    memset(detail, 0, sizeof detail);
    memcpy(detail, dopt_dp_detail(&dp), strnlen(dopt_dp_detail(&dp), sizeof detail - 1));
    DT_CHECKF(world_same_on_every_rank(c, detail, sizeof detail), "the detail differs between ranks: %s", detail);
    for (i = 0; i < h.memn; i++) DT_CHECKF(h.mem[i] == 0.0f, "element %zu: %g, not zero after the mistake", i, h.mem[i]);
    DT_EQ_INT(dopt__family_error(c), DOPT_OK); /* the communicator is not poisoned */
    DT_EQ_INT(dp.grads_step, (uint64_t)m->step + 1); /* the step counts, as zeros */
    ov_backward(&dp, &h, c->rank, m->step + 1, NULL); /* the next step goes on */
    for (i = 0; i < OV_NSEG; i++)
        for (e = 0; e < ov_sizes[i]; e++) want[off++] = ov_value(c->rank, m->step + 1, i, e);
    DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
    dopt_buf_pack(&h.buf, got);
    ov_check_mean(c, got, want, h.n, "the step after the mistake");
    DT_CHECK(dp.ov.rebuilt);
    DT_CHECK(world_same_on_every_rank(c, dp.ov.order, OV_NSEG * sizeof(size_t)));
    dopt_dp_free(&dp);
    free(want);
    free(got);
    free(h.mem);
    free(other.mem);
}

DTEST_WORLDS_EACH(a_mistake_in_one_ranks_marks_is_said_on_every_rank, body_mistake, ov_mistakes, 2, 3);

/* A segment declared unused on rank 0 counts as zeros there; the others' values are averaged
   with it. */
static void body_unused(dopt_comm *c, void *arg) {
    ov_host h;
    dopt_dp dp;
    float *want;
    size_t i, e, off = 0;
    (void)arg;
    ov_host_init(&h, OV_SCATTER);
    want = (float *)malloc(h.n * sizeof(float));
    DT_OK(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf, .bucket_bytes = 64 << 10}));
    for (i = OV_NSEG; i-- > 0;) {
        ov_fill(&h, i, c->rank, 0); /* rank 0 leaves garbage in segment 1: the call zeros it */
        if (c->rank == 0 && i == 1)
            DT_OK(dopt_dp_grad_unused(&dp, i));
        else
            DT_OK(dopt_dp_grad_ready(&dp, i));
    }
    for (i = 0; i < OV_NSEG; i++)
        for (e = 0; e < ov_sizes[i]; e++) want[off++] = c->rank == 0 && i == 1 ? 0.0f : ov_value(c->rank, 0, i, e);
    DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
    {
        float *got = (float *)malloc(h.n * sizeof(float));
        dopt_buf_pack(&h.buf, got);
        ov_check_mean(c, got, want, h.n, "with an unused segment");
        free(got);
    }
    dopt_dp_free(&dp);
    free(want);
    free(h.mem);
}

DTEST_WORLDS(an_unused_segment_is_averaged_as_zeros, body_unused, NULL, 2, 3);

/* overlap_check: a write to a marked segment before after_backward is named; without one the
   step is the plain bucketed mean. */
static void body_write_after_mark(dopt_comm *c, void *arg) {
    ov_host h;
    dopt_dp dp;
    (void)arg;
    ov_host_init(&h, OV_FLAT);
    DT_OK(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf, .bucket_bytes = 64 << 10, .overlap_check = 1}));
    ov_backward(&dp, &h, c->rank, 0, NULL);
    DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
    ov_backward(&dp, &h, c->rank, 1, NULL);
    if (c->rank == 1) h.mem[h.segs[4].offset + 17] += 1.0f; /* the host writes h1.w after marking it */
    DT_EQ_INT(dopt_dp_after_backward_buf(&dp, &h.buf), DOPT_ERR_INVALID); /* on every rank */
    DT_CHECKF(strstr(dopt_dp_detail(&dp), "rank 1: segment 4 ('h1.w') was written after dopt_dp_grad_ready marked it"),
              "%s", dopt_dp_detail(&dp));
    ov_backward(&dp, &h, c->rank, 2, NULL); /* the next step goes on */
    DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
    dopt_dp_free(&dp);
    free(h.mem);
}

DTEST_WORLDS(a_write_after_the_mark_is_caught_by_overlap_check, body_write_after_mark, NULL, 2, 2);

/* The driver's other calls refuse a step whose marks no after_backward completed (its buckets
   are averaging into the gradients); after_backward then completes it as usual. */
static void body_open_step(dopt_comm *c, void *arg) {
    ov_host h;
    dopt_dp dp;
    size_t i;
    (void)arg;
    ov_host_init(&h, OV_FLAT);
    DT_OK(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf, .bucket_bytes = 64 << 10}));
    for (i = OV_NSEG; i-- > 4;) {
        ov_fill(&h, i, c->rank, 0);
        DT_OK(dopt_dp_grad_ready(&dp, i));
    }
    DT_EQ_INT(dopt_dp_save(&dp, "/nonexistent/ov.state"), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&dp), "dopt_dp_save: 4 of the 8 gradient segments of step 0 are marked"), "%s",
              dopt_dp_detail(&dp));
    DT_EQ_INT(dopt_dp_after_step(&dp, h.mem), DOPT_ERR_INVALID);
    for (i = 4; i-- > 0;) {
        ov_fill(&h, i, c->rank, 0);
        DT_OK(dopt_dp_grad_ready(&dp, i));
    }
    DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
    DT_OK(dopt_dp_after_step(&dp, h.mem));
    dopt_dp_free(&dp);
    free(h.mem);
}

DTEST_WORLDS(other_driver_calls_refuse_a_step_with_marks_in_flight, body_open_step, NULL, 2, 2);

/* ------------------------------------------------------------------ non-finite, lost peers, local steps */

/* A NaN in rank 1's bucket, averaged in fp32 or through TernGrad (whose scale sharing tells
   every rank): under SKIP every rank zeros the step and names rank 1, and the next step goes on. */
static const ov_codec ov_nan_cases[] = {{DOPT_CODEC_FP32, DOPT_AGG_AUTO, 1}, {DOPT_CODEC_TERNARY, DOPT_AGG_AUTO, 1}};

static void body_nan_in_a_bucket(dopt_comm *c, void *arg) {
    const ov_codec *k = (const ov_codec *)arg;
    ov_host h;
    dopt_dp dp;
    dopt_compressor cz;
    size_t i;
    ov_host_init(&h, OV_FLAT);
    if (k->codec == DOPT_CODEC_TERNARY) ov_compressor(&cz, k, &h);
    DT_OK(dopt_dp_init(&dp, c, h.n,
                       &(dopt_dp_config){.grads = &h.buf, .bucket_bytes = 64 << 10, .nonfinite = DOPT_NONFINITE_SKIP,
                                         .grad_compressor = k->codec == DOPT_CODEC_TERNARY ? &cz : NULL}));
    ov_backward(&dp, &h, c->rank, 0, NULL);
    DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
    for (i = OV_NSEG; i-- > 0;) {
        ov_fill(&h, i, c->rank, 1);
        if (c->rank == 1 && i == 4) h.mem[h.segs[4].offset + 5] = NAN;
        DT_OK(dopt_dp_grad_ready(&dp, i));
    }
    DT_EQ_INT(dopt_dp_after_backward_buf(&dp, &h.buf), DOPT_ERR_NONFINITE);
    DT_CHECKF(strstr(dopt_dp_detail(&dp), "rank 1") != NULL, "%s", dopt_dp_detail(&dp));
    for (i = 0; i < h.n; i++) DT_CHECK(h.mem[i] == 0.0f);
    ov_backward(&dp, &h, c->rank, 2, NULL); /* the next step goes on */
    DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
    DT_EQ_INT(dp.skipped, 1);
    dopt_dp_free(&dp);
    if (k->codec == DOPT_CODEC_TERNARY) dopt_compressor_free(&cz);
    free(h.mem);
}

DTEST_WORLDS_EACH(a_nan_in_one_ranks_bucket_skips_the_step_on_every_rank, body_nan_in_a_bucket, ov_nan_cases, 2, 3);

/* The last rank dies after marking half its segments: every survivor's after_backward fails
   naming it, the step's average is not counted, and later calls fail at once. */
static void body_peer_lost(dopt_comm *c, void *arg) {
    ov_host h;
    dopt_dp dp;
    uint64_t grads_step, step;
    dopt_status s;
    size_t i;
    char who[32];
    (void)arg;
    ov_host_init(&h, OV_FLAT);
    DT_OK(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf, .bucket_bytes = 16 << 10}));
    ov_backward(&dp, &h, c->rank, 0, NULL);
    DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
    grads_step = dp.grads_step;
    step = dp.step;
    for (i = OV_NSEG; i-- > 0;) {
        ov_fill(&h, i, c->rank, 1);
        if (c->rank == c->size - 1 && i == OV_NSEG / 2) _exit(0); /* dies with buckets in flight */
        DT_OK(dopt_dp_grad_ready(&dp, i));
    }
    s = dopt_dp_after_backward_buf(&dp, &h.buf);
    DT_CHECKF(s == DOPT_ERR_PEER_LOST || s == DOPT_ERR_TIMEOUT, "%s", dopt_status_str(s));
    snprintf(who, sizeof who, "rank %d", c->size - 1);
    DT_CHECKF(strstr(dopt_dp_detail(&dp), who) != NULL, "%s", dopt_dp_detail(&dp));
    DT_EQ_INT(dp.grads_step, grads_step); /* step 1's average never happened */
    DT_CHECK(dp.step == step || dp.step == step + 1); /* step 0 counted or not: it ended before, either way */
    DT_EQ_INT(dopt_dp_grad_ready(&dp, 0), s);
    DT_EQ_INT(dopt_dp_after_backward_buf(&dp, &h.buf), s);
    dopt_dp_free(&dp);
    free(h.mem);
}

DTEST_WORLDS(a_peer_lost_with_buckets_in_flight_is_named_and_nothing_hangs, body_peer_lost, NULL, 3, 3);

/* Post-local SGD: marks on local steps do nothing; the warm-up's are averaged. */
static void body_local_steps(dopt_comm *c, void *arg) {
    ov_host h;
    dopt_dp dp;
    float *before;
    int step;
    (void)arg;
    ov_host_init(&h, OV_FLAT);
    before = (float *)malloc(h.n * sizeof(float));
    DT_OK(dopt_dp_init(&dp, c, h.n, &(dopt_dp_config){.grads = &h.buf, .period = 4, .warmup_steps = 2}));
    for (step = 0; step < 6; step++) {
        ov_backward(&dp, &h, c->rank, step, NULL);
        if (step >= 2) memcpy(before, h.mem, h.n * sizeof(float)); /* local: nothing was marked */
        DT_OK(dopt_dp_after_backward_buf(&dp, &h.buf));
        if (step >= 2) DT_CHECK(memcmp(before, h.mem, h.n * sizeof(float)) == 0); /* local: untouched */
        else DT_CHECK(world_same_on_every_rank(c, h.mem, h.n * sizeof(float)));
        DT_OK(dopt_dp_after_step(&dp, h.mem)); /* h.mem stands in for the parameters */
    }
    dopt_dp_free(&dp);
    free(before);
    free(h.mem);
}

DTEST_WORLDS(marks_on_local_steps_do_nothing, body_local_steps, NULL, 2, 2);

/* ------------------------------------------------------------------ the rule */

DTEST(bucket_rule_follows_its_formula) {
    /* communication that does not fit behind backward: sqrt(S·alpha·R) */
    DT_EQ_INT(dopt__dp_bucket_rule(100e6, 50e-6, 125e6, 0.1), (size_t)sqrt(100e6 * 50e-6 * 125e6));
    /* room to spare: the smallest size that keeps it behind backward, S·alpha/(Tb − S/R) */
    DT_EQ_INT(dopt__dp_bucket_rule(100e6, 1e-3, 10e9, 1.0), (size_t)(100e6 * 1e-3 / (1.0 - 100e6 / 10e9)));
    /* never below 64 KiB, never above the gradients */
    DT_EQ_INT(dopt__dp_bucket_rule(100e6, 1e-9, 1e9, 10.0), 64 << 10);
    DT_EQ_INT(dopt__dp_bucket_rule(1e6, 1.0, 1e9, 0.0), (size_t)1e6);
    DT_EQ_INT(dopt__dp_bucket_rule(1e6, NAN, 1e9, 0.0), 64 << 10);
}

DTEST_MAIN()
