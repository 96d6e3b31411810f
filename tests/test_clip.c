/* Tests of clip.h: every clipping rule against a slow double-precision reference (odd lengths,
   many segments, unaligned pointers, gaps), flat buffers against scatter lists, the scale
   convention, the argument structs' defaults (a zero scale is 1, a zero AGC eps the paper's,
   measure_only touches nothing), non-finite gradients and bad arguments (a NULL argument struct
   included), CELGC's rule against "clip to γ/η, step η", AGC against a hand computation, and,
   over real processes on every transport of worlds.h (shared memory direct and on the engine,
   TCP), norms and factors that are bitwise identical
   on every rank and equal to the norm of the concatenated gradients, and verdicts (NaN, invalid
   arguments) that every rank shares. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "../clip.h"
#include "dtest.h"
#include "worlds.h"

#include <float.h>
#include <stdint.h>

/* ------------------------------------------------------------------ helpers and references */

/* Uniform in [-amp, amp), reproducible from the seed. */
static void fill(float *x, size_t n, uint64_t seed, float amp) {
    dopt_rng rng;
    size_t i;
    dopt_rng_init(&rng, seed, 0, 0);
    dopt_rng_uniform(&rng, 0, x, n);
    for (i = 0; i < n; i++) x[i] = (2.0f * x[i] - 1.0f) * amp;
}

static float *alloc_floats(size_t n) {
    float *p = (float *)malloc((n ? n : 1) * sizeof(float));
    DT_CHECK(p != NULL);
    return p;
}

static float *copy_floats(const float *x, size_t n) {
    float *p = alloc_floats(n);
    if (n) memcpy(p, x, n * sizeof(float));
    return p;
}

/* Σ x², one element at a time, compensated (Neumaier): the slow, obviously correct reference. */
static double ref_sumsq(const float *x, size_t n) {
    double s = 0.0, c = 0.0;
    size_t i;
    for (i = 0; i < n; i++) {
        double v = (double)x[i] * (double)x[i], t = s + v;
        c += fabs(s) >= fabs(v) ? (s - t) + v : (v - t) + s;
        s = t;
    }
    return s + c;
}

static double rel_err(double got, double want) { return want == 0.0 ? fabs(got) : fabs(got - want) / fabs(want); }

static int same_bits_d(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }

/* A plain array of n floats as a descriptor (one segment). */
#define FLAT(data_, n_) (&(dopt_buf){.data = (data_), .n = (n_)})

/* x · f with the same kernel the library uses, to compare clipped buffers bit for bit. */
static float *scaled_copy(const float *x, size_t n, float f) {
    float *p = copy_floats(x, n);
    dopt_scale(p, f, n);
    return p;
}

/* ------------------------------------------------------------------ global norm: single process */

DTEST(global_norm_matches_double_reference_at_odd_lengths) {
    static const size_t lens[] = {0, 1, 3, 15, 16, 17, 31, 33, 1000, 100003};
    size_t k;
    for (k = 0; k < sizeof lens / sizeof *lens; k++) {
        size_t n = lens[k], off;
        for (off = 0; off < 3; off++) { /* unaligned starts */
            float *mem = alloc_floats(n + 3), *x = mem + off, *orig;
            double norm, want;
            dopt_clip_norm o = {.max_norm = 1.0f};
            fill(x, n, 7 + n, 3.0f);
            orig = copy_floats(x, n);
            want = sqrt(ref_sumsq(x, n));
            DT_OK(dopt_clip_global_norm(NULL, FLAT(x, n), &o));
            norm = o.norm;
            DT_CHECKF(rel_err(norm, want) < 1e-14, "n=%zu: norm %.17g, reference %.17g", n, norm, want);
            if (want > 1.0) {
                float f = (float)(1.0 / norm);
                float *expect = scaled_copy(orig, n, f);
                DT_CHECKF(memcmp(x, expect, n * sizeof(float)) == 0, "n=%zu: buffer is not orig * factor", n);
                DT_NEAR(sqrt(ref_sumsq(x, n)), 1.0, 1e-6);
                free(expect);
            } else {
                DT_CHECK(memcmp(x, orig, n * sizeof(float)) == 0);
            }
            free(orig);
            free(mem);
        }
    }
}

DTEST(norm_pass_equals_dopt_sumsq_bit_for_bit) {
    size_t n, off;
    float *mem = alloc_floats(5003);
    fill(mem, 5003, 11, 100.0f);
    for (n = 0; n < 5000; n += (n < 70 ? 1 : 997))
        for (off = 0; off < 3; off++) {
            dopt_clip_norm o = {.max_norm = 1.0f, .measure_only = 1};
            double norm;
            DT_OK(dopt_clip_global_norm(NULL, FLAT(mem + off, n), &o));
            norm = o.norm;
            DT_CHECKF(same_bits_d(norm, sqrt(dopt_sumsq(mem + off, n))), "n=%zu off=%zu: %.17g vs %.17g", n, off, norm,
                      sqrt(dopt_sumsq(mem + off, n)));
        }
    free(mem);
}

DTEST(factor_is_one_below_the_threshold_and_buffer_stays_bitwise) {
    float x[37], orig[37];
    dopt_clip_norm measure = {.max_norm = 1.0f, .measure_only = 1}, clip = {.max_norm = 1.0f},
                   never = {.max_norm = INFINITY};
    fill(x, 37, 3, 0.01f);
    memcpy(orig, x, sizeof x);
    DT_OK(dopt_clip_global_norm(NULL, FLAT(x, 37), &measure));
    DT_CHECK(measure.factor == 1.0f && measure.norm < 1.0);
    DT_OK(dopt_clip_global_norm(NULL, FLAT(x, 37), &clip));
    DT_CHECK(clip.factor == 1.0f && same_bits_d(clip.norm, measure.norm));
    DT_CHECK(memcmp(x, orig, sizeof x) == 0);
    /* an infinite threshold never clips, and still measures */
    fill(x, 37, 3, 1e30f);
    memcpy(orig, x, sizeof x);
    DT_OK(dopt_clip_global_norm(NULL, FLAT(x, 37), &never));
    DT_CHECK(memcmp(x, orig, sizeof x) == 0);
    DT_CHECK(never.factor == 1.0f && rel_err(never.norm, sqrt(ref_sumsq(x, 37))) < 1e-14);
}

DTEST(measure_only_leaves_buffer_untouched_and_predicts_the_clip) {
    size_t n = 1001;
    float *x = alloc_floats(n), *orig, *clipped;
    dopt_clip_norm measure = {.max_norm = 0.5f, .measure_only = 1}, clip = {.max_norm = 0.5f};
    fill(x, n, 5, 2.0f);
    orig = copy_floats(x, n);
    DT_OK(dopt_clip_global_norm(NULL, FLAT(x, n), &measure));
    DT_CHECK(memcmp(x, orig, n * sizeof(float)) == 0);
    DT_CHECK(measure.factor == (float)(0.5 / measure.norm));
    clipped = copy_floats(x, n);
    DT_OK(dopt_clip_global_norm(NULL, FLAT(clipped, n), &clip));
    DT_CHECK(same_bits_d(measure.norm, clip.norm) && measure.factor == clip.factor); /* the factor applied */
    dopt_scale(x, measure.factor, n);
    DT_CHECK(memcmp(x, clipped, n * sizeof(float)) == 0);
    free(x);
    free(orig);
    free(clipped);
}

DTEST(zero_gradient_has_norm_zero_and_is_not_divided_by_it) {
    float x[20] = {0};
    dopt_clip_norm o = {.max_norm = 1.0f, .measure_only = 1, .norm = -1.0, .factor = -1.0f};
    float step = -1.0f;
    size_t i;
    DT_OK(dopt_clip_global_norm(NULL, FLAT(x, 20), &o));
    DT_CHECK(o.norm == 0.0 && o.factor == 1.0f);
    DT_OK(dopt_clip_global_norm(NULL, FLAT(x, 20), &(dopt_clip_norm){.max_norm = 1e-30f}));
    for (i = 0; i < 20; i++) DT_CHECK(x[i] == 0.0f && !signbit(x[i]));
    DT_OK(dopt_celgc_step_size(FLAT(x, 20), &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}, &step));
    DT_CHECK(step == 0.1f);
    o.norm = -1.0;
    DT_OK(dopt_clip_global_norm(NULL, FLAT(NULL, 0), &o)); /* empty is a zero gradient too */
    DT_CHECK(o.norm == 0.0);
}

DTEST(elements_near_flt_max_do_not_overflow) {
    size_t n = 1000, i;
    float *x = alloc_floats(n);
    dopt_clip_norm o = {.max_norm = 1.0f};
    for (i = 0; i < n; i++) x[i] = (i % 3 == 0) ? -FLT_MAX : FLT_MAX;
    DT_OK(dopt_clip_global_norm(NULL, FLAT(x, n), &o));
    DT_CHECK(rel_err(o.norm, (double)FLT_MAX * sqrt((double)n)) < 1e-15);
    for (i = 0; i < n; i++) DT_CHECK(dopt__is_finite(x[i]) && fabsf(x[i]) > 0.0f);
    DT_CHECK(rel_err(sqrt(ref_sumsq(x, n)), 1.0) < 1e-6);
    free(x);
}

/* 16 double accumulators each add 6.25e6 squares: the error grows like that count times 2^-53
   at worst, and about 1e-12 of the norm is what random data gives. */
DTEST(norm_is_accurate_for_1e8_elements) {
    size_t n = 100000000;
    float *x = alloc_floats(n);
    dopt_clip_norm o = {.max_norm = 1.0f, .measure_only = 1};
    double want;
    fill(x, n, 99, 1.0f);
    want = sqrt(ref_sumsq(x, n));
    DT_OK(dopt_clip_global_norm(NULL, FLAT(x, n), &o));
    DT_CHECKF(rel_err(o.norm, want) < 1e-11, "norm %.17g, reference %.17g", o.norm, want);
    free(x);
}

/* ------------------------------------------------------------------ buffers: flat, segments, scatter */

#define NSEG 7
static const size_t seg_sizes[NSEG] = {1, 17, 0, 33, 1000, 7, 129};

/* A flat buffer with gaps of 3 elements between segments, and a scatter list of the same data. */
typedef struct two_layouts {
    float *flat;
    size_t flat_n;
    dopt_segment segs[NSEG];
    float *pieces[NSEG];
    dopt_span spans[NSEG];
} two_layouts;

static void layouts_make(two_layouts *t, uint64_t seed, float amp) {
    size_t i, off = 0;
    for (i = 0; i < NSEG; i++) off += seg_sizes[i] + 3;
    t->flat_n = off;
    t->flat = alloc_floats(off);
    fill(t->flat, off, seed, amp); /* gaps hold data too: it must be neither measured nor changed */
    for (off = 0, i = 0; i < NSEG; i++) {
        off += 3;
        t->segs[i].offset = off;
        t->segs[i].count = seg_sizes[i];
        t->segs[i].name = NULL;
        t->pieces[i] = copy_floats(t->flat + off, seg_sizes[i]);
        t->spans[i].ptr = t->pieces[i];
        t->spans[i].count = seg_sizes[i];
        off += seg_sizes[i];
    }
}

static void layouts_free(two_layouts *t) {
    size_t i;
    for (i = 0; i < NSEG; i++) free(t->pieces[i]);
    free(t->flat);
}

/* Every segment of the flat layout equals its scatter piece, and the gaps still hold `gaps`. */
static void layouts_check_same(const two_layouts *t, const float *gaps) {
    size_t i, off = 0;
    for (i = 0; i < NSEG; i++) {
        DT_CHECK(memcmp(t->flat + off, gaps + off, 3 * sizeof(float)) == 0);
        off += 3;
        DT_CHECKF(memcmp(t->flat + off, t->pieces[i], seg_sizes[i] * sizeof(float)) == 0, "segment %zu differs", i);
        off += seg_sizes[i];
    }
}

static double layouts_ref_sumsq(const two_layouts *t) {
    double s = 0.0;
    size_t i;
    for (i = 0; i < NSEG; i++) s += ref_sumsq(t->pieces[i], seg_sizes[i]);
    return s;
}

DTEST(scatter_list_and_flat_segments_give_identical_results) {
    two_layouts t;
    dopt_buf flat, scat;
    dopt_clip_norm of = {.max_norm = 2.0f, .scale = 1.0f}, os = {.max_norm = 2.0f, .scale = 1.0f};
    float *gaps;
    layouts_make(&t, 21, 1.0f);
    gaps = copy_floats(t.flat, t.flat_n);
    flat = dopt_buf_flat(t.flat, t.flat_n, t.segs, NSEG);
    scat = dopt_buf_scatter(t.spans, NSEG);
    DT_OK(dopt_clip_global_norm(NULL, &flat, &of));
    DT_OK(dopt_clip_global_norm(NULL, &scat, &os));
    DT_CHECK(same_bits_d(of.norm, os.norm) && of.factor == os.factor);
    DT_CHECK(of.norm > 2.0);
    layouts_check_same(&t, gaps);
    free(gaps);
    layouts_free(&t);
}

DTEST(global_norm_spans_all_segments_and_skips_gaps) {
    two_layouts t;
    dopt_buf scat;
    dopt_clip_norm o = {.max_norm = 1.0f};
    double norm, want;
    size_t i;
    float *orig[NSEG];
    layouts_make(&t, 22, 1.0f);
    scat = dopt_buf_scatter(t.spans, NSEG);
    want = sqrt(layouts_ref_sumsq(&t));
    for (i = 0; i < NSEG; i++) orig[i] = copy_floats(t.pieces[i], seg_sizes[i]);
    DT_OK(dopt_clip_global_norm(NULL, &scat, &o));
    norm = o.norm;
    DT_CHECK(rel_err(norm, want) < 1e-14);
    for (i = 0; i < NSEG; i++) { /* one factor for all segments */
        float *expect = scaled_copy(orig[i], seg_sizes[i], (float)(1.0 / norm));
        DT_CHECK(memcmp(expect, t.pieces[i], seg_sizes[i] * sizeof(float)) == 0);
        free(expect);
        free(orig[i]);
    }
    DT_CHECK(rel_err(sqrt(layouts_ref_sumsq(&t)), 1.0) < 1e-6);
    layouts_free(&t);
}

/* darknet and FANN hold -∇ summed over the batch: with scale = -1/batch the buffer is clipped as
   its mean would be. batch is a power of two, so sum = batch · mean holds exactly in float. */
DTEST(scale_clips_a_summed_buffer_as_its_mean) {
    size_t n = 777, i;
    float batch = 64.0f, *mean = alloc_floats(n), *sum = alloc_floats(n);
    dopt_clip_norm om = {.max_norm = 0.5f, .scale = 1.0f, .measure_only = 1};
    dopt_clip_norm os = {.max_norm = 0.5f, .scale = -1.0f / batch, .measure_only = 1};
    dopt_buf bm, bs;
    fill(mean, n, 31, 0.1f);
    for (i = 0; i < n; i++) sum[i] = -batch * mean[i];
    bm = dopt_buf_flat(mean, n, NULL, 0);
    bs = dopt_buf_flat(sum, n, NULL, 0);
    DT_OK(dopt_clip_global_norm(NULL, &bm, &om));
    DT_OK(dopt_clip_global_norm(NULL, &bs, &os));
    DT_CHECK(same_bits_d(om.norm, os.norm) && om.factor == os.factor && om.factor < 1.0f);
    DT_OK(dopt_clip_global_norm(NULL, &bm, &(dopt_clip_norm){.max_norm = 0.5f, .scale = 1.0f}));
    DT_OK(dopt_clip_global_norm(NULL, &bs, &(dopt_clip_norm){.max_norm = 0.5f, .scale = -1.0f / batch}));
    for (i = 0; i < n; i++) DT_CHECK(sum[i] == -batch * mean[i]);
    free(mean);
    free(sum);
}

DTEST(self_communicator_gives_the_local_result) {
    two_layouts a, b;
    dopt_comm *self;
    dopt_buf ba, bb;
    dopt_clip_norm oa = {.max_norm = 1.0f}, ob = {.max_norm = 1.0f};
    double nb, norms_a[NSEG], norms_b[NSEG];
    DT_OK(dopt_comm_create_self(&self));
    layouts_make(&a, 41, 1.0f);
    layouts_make(&b, 41, 1.0f);
    ba = dopt_buf_scatter(a.spans, NSEG);
    bb = dopt_buf_scatter(b.spans, NSEG);
    DT_OK(dopt_clip_global_norm(NULL, &ba, &oa));
    DT_OK(dopt_clip_global_norm(self, &bb, &ob));
    DT_CHECK(same_bits_d(oa.norm, ob.norm) && oa.factor == ob.factor);
    DT_OK(dopt_clip_segment_norms(NULL, &ba, &(dopt_clip_norm){.max_norm = 0.1f}, norms_a));
    DT_OK(dopt_clip_segment_norms(self, &bb, &(dopt_clip_norm){.max_norm = 0.1f}, norms_b));
    DT_CHECK(memcmp(norms_a, norms_b, sizeof norms_a) == 0);
    {
        size_t i;
        for (i = 0; i < NSEG; i++) DT_CHECK(memcmp(a.pieces[i], b.pieces[i], seg_sizes[i] * sizeof(float)) == 0);
    }
    /* a non-finite verdict does not poison the communicator */
    b.pieces[4][10] = NAN;
    DT_EQ_INT(dopt_clip_global_norm(self, &bb, &ob), DOPT_ERR_NONFINITE);
    DT_CHECK(dopt__is_nan(ob.norm) && ob.factor == 0.0f);
    b.pieces[4][10] = 0.0f;
    DT_OK(dopt_clip_global_norm(self, &bb, &ob));
    nb = ob.norm;
    DT_OK(dopt_allreduce(self, &nb, 1, DOPT_F64, DOPT_SUM));
    dopt_comm_destroy(self);
    layouts_free(&a);
    layouts_free(&b);
}

/* ------------------------------------------------------------------ per segment, by value, c·σ */

DTEST(segment_norms_clip_each_segment_to_its_threshold) {
    two_layouts t;
    dopt_buf scat;
    float limits[NSEG] = {0.01f, 1.0f, 5.0f, 2.0f, 3.0f, INFINITY, 0.5f};
    double norms[NSEG];
    float *orig[NSEG];
    size_t i;
    layouts_make(&t, 51, 1.0f);
    scat = dopt_buf_scatter(t.spans, NSEG);
    for (i = 0; i < NSEG; i++) orig[i] = copy_floats(t.pieces[i], seg_sizes[i]);
    DT_OK(dopt_clip_segment_norms(NULL, &scat, &(dopt_clip_norm){.max_norms = limits /* max_norm unused */}, norms));
    for (i = 0; i < NSEG; i++) {
        double want = sqrt(ref_sumsq(orig[i], seg_sizes[i]));
        DT_CHECKF(rel_err(norms[i], want) < 1e-14, "segment %zu: %.17g vs %.17g", i, norms[i], want);
        if (want > limits[i]) {
            float *expect = scaled_copy(orig[i], seg_sizes[i], (float)((double)limits[i] / norms[i]));
            DT_CHECK(memcmp(expect, t.pieces[i], seg_sizes[i] * sizeof(float)) == 0);
            DT_CHECK(rel_err(sqrt(ref_sumsq(t.pieces[i], seg_sizes[i])), limits[i]) < 1e-6);
            free(expect);
        } else {
            DT_CHECK(memcmp(orig[i], t.pieces[i], seg_sizes[i] * sizeof(float)) == 0);
        }
        free(orig[i]);
    }
    /* one threshold for all */
    layouts_free(&t);
    layouts_make(&t, 52, 1.0f);
    scat = dopt_buf_scatter(t.spans, NSEG);
    DT_OK(dopt_clip_segment_norms(NULL, &scat, &(dopt_clip_norm){.max_norm = 0.25f, .scale = 1.0f}, norms));
    for (i = 0; i < NSEG; i++) DT_CHECK(sqrt(ref_sumsq(t.pieces[i], seg_sizes[i])) <= 0.25 * (1 + 1e-6));
    layouts_free(&t);
}

DTEST(clip_by_value_bounds_every_element_in_scale_units) {
    two_layouts t;
    dopt_buf flat;
    float *orig, *gaps;
    size_t i, j, off = 0;
    layouts_make(&t, 61, 8.0f);
    orig = copy_floats(t.flat, t.flat_n);
    gaps = orig;
    flat = dopt_buf_flat(t.flat, t.flat_n, t.segs, NSEG);
    /* buffer holds -8·mean: |mean| ≤ 0.5 means |buffer| ≤ 4 */
    DT_OK(dopt_clip_value(NULL, &flat, -1.0f / 8.0f, 0.5f));
    for (i = 0; i < NSEG; i++) {
        DT_CHECK(memcmp(t.flat + off, gaps + off, 3 * sizeof(float)) == 0);
        off += 3;
        for (j = 0; j < seg_sizes[i]; j++) {
            float v = orig[off + j], want = v > 4.0f ? 4.0f : (v < -4.0f ? -4.0f : v);
            DT_CHECK(t.flat[off + j] == want);
        }
        off += seg_sizes[i];
    }
    free(orig);
    layouts_free(&t);
}

/* Two-pass population standard deviation in double. */
static double ref_sigma(const float *x, size_t n) {
    double mean = 0.0, var = 0.0;
    size_t i;
    if (n == 0) return 0.0;
    for (i = 0; i < n; i++) mean += x[i];
    mean /= (double)n;
    for (i = 0; i < n; i++) var += ((double)x[i] - mean) * ((double)x[i] - mean);
    return sqrt(var / (double)n);
}

DTEST(sigma_clipping_matches_terngrad_reference_per_segment) {
    two_layouts t;
    dopt_buf scat;
    float *orig[NSEG];
    size_t i, j;
    int clipped = 0;
    layouts_make(&t, 71, 1.0f);
    for (i = 0; i < NSEG; i++) /* heavy tails, so that c·σ bites */
        for (j = 0; j < seg_sizes[i]; j += 5) t.pieces[i][j] *= 10.0f;
    t.pieces[6][0] = 1e4f;
    scat = dopt_buf_scatter(t.spans, NSEG);
    for (i = 0; i < NSEG; i++) orig[i] = copy_floats(t.pieces[i], seg_sizes[i]);
    DT_OK(dopt_clip_sigma(NULL, &scat, DOPT_CLIP_SIGMA_DEFAULT));
    for (i = 0; i < NSEG; i++) {
        double bound = 2.5 * ref_sigma(orig[i], seg_sizes[i]);
        for (j = 0; j < seg_sizes[i]; j++) {
            double v = orig[i][j], want = v > bound ? bound : (v < -bound ? -bound : v);
            if (seg_sizes[i] == 1) want = v; /* σ = 0: left as it is */
            clipped += want != v;
            DT_CHECKF(fabs(t.pieces[i][j] - want) <= 1e-6 * bound, "segment %zu element %zu: %g vs %g", i, j,
                      (double)t.pieces[i][j], want);
        }
        free(orig[i]);
    }
    DT_CHECK(clipped > 10);
    layouts_free(&t);
}

DTEST(sigma_clipping_leaves_constant_segments_alone) {
    float x[5] = {3, 3, 3, 3, 3}, y[1] = {-7};
    dopt_span spans[2] = {{x, 5}, {y, 1}};
    dopt_buf b = dopt_buf_scatter(spans, 2);
    DT_OK(dopt_clip_sigma(NULL, &b, 2.5f));
    DT_CHECK(x[0] == 3 && x[4] == 3 && y[0] == -7);
}

/* ------------------------------------------------------------------ AGC */

/* Segment 0: a 2×3 weight matrix, one unit per row; segment 1: a bias, one unit (cols 0);
   segment 2: two elements with one unit each (cols 1). λ = 0.05, ε = 1e-3, and the buffer holds
   2·g with scale 0.5. By hand:
     row 0: ‖g‖ = ‖(0.3, 0.4, 0)‖ = 0.5 > 0.05·‖(3, 0, 4)‖ = 0.25 → g·0.5 = (0.15, 0.2, 0)
     row 1: ‖g‖ = 1 > 0.05·max(‖0‖, ε) = 5e-5 → (5e-5, 0, 0)
     bias:  ‖(0.04, 0.01)‖ ≈ 0.0412 ≤ 0.05·‖(0.6, 0.8)‖ = 0.05 → untouched (one unit; as
            units of one element, 0.04 > 0.05·0.6 would be clipped)
     unit:  |1| > 0.05·2 = 0.1 → 0.1;  |0.01| ≤ 0.05·1 → untouched */
DTEST(agc_matches_hand_computation) {
    float g0[6] = {0.6f, 0.8f, 0, 2, 0, 0}, w0[6] = {3, 0, 4, 0, 0, 0};
    float g1[2] = {0.08f, 0.02f}, w1[2] = {0.6f, 0.8f};
    float g2[2] = {2, 0.02f}, w2[2] = {2, -1};
    const float want0[6] = {0.15f, 0.2f, 0, 5e-5f, 0, 0}, want2[2] = {0.1f, 0.01f};
    dopt_span gs[3] = {{g0, 6}, {g1, 2}, {g2, 2}}, ws[3] = {{w0, 6}, {w1, 2}, {w2, 2}};
    dopt_buf gb = dopt_buf_scatter(gs, 3), wb = dopt_buf_scatter(ws, 3);
    size_t cols[3] = {3, 0, 1};
    int i;
    DT_OK(dopt_clip_agc(NULL, &gb, &wb, &(dopt_agc){.lambda = 0.05f, .eps = DOPT_AGC_EPS_DEFAULT, .scale = 0.5f, .cols = cols}));
    for (i = 0; i < 6; i++) DT_NEAR(0.5 * g0[i], want0[i], 1e-7 * (fabs(want0[i]) + 1e-3));
    DT_CHECK(g1[0] == 0.08f && g1[1] == 0.02f);
    for (i = 0; i < 2; i++) DT_NEAR(0.5 * g2[i], want2[i], 1e-7);
    DT_CHECK(w0[0] == 3 && w2[1] == -1); /* params are only read */
}

DTEST(agc_clipped_units_sit_exactly_on_the_bound) {
    size_t rows = 50, cols_n = 37, n = rows * cols_n, r;
    float *g = alloc_floats(n), *w = alloc_floats(n), *orig;
    dopt_buf gb = dopt_buf_flat(g, n, NULL, 0), wb = dopt_buf_flat(w, n, NULL, 0);
    size_t cols[1];
    int clipped = 0;
    cols[0] = cols_n;
    fill(g, n, 81, 1.0f);
    fill(w, n, 82, 1.0f);
    for (r = 0; r < rows; r += 2) dopt_scale(g + r * cols_n, 0.001f, cols_n); /* half the rows well inside */
    memset(w + 3 * cols_n, 0, cols_n * sizeof(float));                       /* a zero row: ε applies */
    orig = copy_floats(g, n);
    DT_OK(dopt_clip_agc(NULL, &gb, &wb, &(dopt_agc){.lambda = 0.02f, .scale = 1.0f, .cols = cols})); /* eps 0: 1e-3 */
    for (r = 0; r < rows; r++) {
        double gn = sqrt(ref_sumsq(orig + r * cols_n, cols_n)), wn = sqrt(ref_sumsq(w + r * cols_n, cols_n));
        double bound = 0.02 * (wn > 1e-3 ? wn : 1e-3), after = sqrt(ref_sumsq(g + r * cols_n, cols_n));
        if (gn > bound) {
            clipped++;
            DT_CHECKF(rel_err(after, bound) < 1e-6, "row %zu: %.9g vs bound %.9g", r, after, bound);
        } else {
            DT_CHECK(memcmp(g + r * cols_n, orig + r * cols_n, cols_n * sizeof(float)) == 0);
        }
    }
    DT_CHECK(clipped == 25);
    free(g);
    free(w);
    free(orig);
}

/* ------------------------------------------------------------------ CELGC */

DTEST(celgc_step_size_is_min_of_eta_and_gamma_over_norm) {
    size_t n = 1003;
    float *g = alloc_floats(n), step;
    double norm;
    fill(g, n, 91, 1.0f);
    norm = sqrt(ref_sumsq(g, n));
    DT_OK(dopt_celgc_step_size(FLAT(g, n), &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}, &step)); /* γ/‖g‖ ≈ 0.055 < η */
    DT_CHECK(rel_err(step, 1.0 / (norm + DOPT_CELGC_EPS)) < 1e-7);
    DT_OK(dopt_celgc_step_size(FLAT(g, n), &(dopt_celgc){.eta = 0.01f, .gamma = 1.0f}, &step)); /* η smaller */
    DT_CHECK(step == 0.01f);
    DT_OK(dopt_celgc_step_size(FLAT(g, n), &(dopt_celgc){.eta = 0.1f, .gamma = INFINITY}, &step)); /* plain SGD */
    DT_CHECK(step == 0.1f);
    DT_OK(dopt_celgc_step_size(FLAT(g, n), &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}, NULL)); /* step may be NULL */
    free(g);
}

/* x − min(η, γ/‖g‖)·g equals x − η·clip(g, γ/η), the form the paper states. */
DTEST(celgc_step_equals_clip_to_gamma_over_eta_then_step_eta) {
    size_t n = 2049, i;
    float *g = alloc_floats(n), *x = alloc_floats(n), *x2, *g2;
    float eta = 0.1f, gamma = 0.5f;
    int round;
    for (round = 0; round < 2; round++) { /* clipped, then not clipped */
        fill(g, n, 101 + round, round == 0 ? 1.0f : 1e-3f);
        fill(x, n, 103, 1.0f);
        x2 = copy_floats(x, n);
        g2 = copy_floats(g, n);
        DT_OK(dopt_celgc_step(FLAT(x, n), FLAT(g, n), &(dopt_celgc){.eta = eta, .gamma = gamma}));
        DT_OK(dopt_clip_global_norm(NULL, FLAT(g2, n), &(dopt_clip_norm){.max_norm = gamma / eta}));
        for (i = 0; i < n; i++) x2[i] -= eta * g2[i];
        for (i = 0; i < n; i++) DT_NEAR(x[i], x2[i], 1e-7);
        free(x2);
        free(g2);
    }
    free(g);
    free(x);
}

DTEST(celgc_weight_decay_joins_the_direction_not_the_norm) {
    size_t n = 517, i;
    float *g = alloc_floats(n), *x = alloc_floats(n), *x0;
    float eta = 0.5f, gamma = 0.2f, wd = 0.01f;
    double step;
    fill(g, n, 111, 1.0f);
    fill(x, n, 112, 5.0f); /* large weights: a norm that counted them would differ a lot */
    x0 = copy_floats(x, n);
    step = gamma / (sqrt(ref_sumsq(g, n)) + DOPT_CELGC_EPS);
    step = step < eta ? step : eta;
    DT_OK(dopt_celgc_step(FLAT(x, n), FLAT(g, n), &(dopt_celgc){.eta = eta, .gamma = gamma, .weight_decay = wd}));
    for (i = 0; i < n; i++) DT_NEAR(x[i], (double)x0[i] - step * ((double)g[i] + wd * (double)x0[i]), 1e-6);
    free(g);
    free(x);
    free(x0);
}

/* darknet layout (scatter list, -∇ summed over a batch of 16, scale -1/16) against the flat +∇
   mean form: the same step. */
DTEST(celgc_scatter_with_scale_equals_flat_mean_form) {
    two_layouts gl, xl;
    size_t i, j, off, total = 0;
    float *gmean, *xflat;
    dopt_span gs[NSEG], xs[NSEG];
    dopt_buf gb, xb;
    layouts_make(&gl, 121, 1.0f);
    layouts_make(&xl, 122, 1.0f);
    for (i = 0; i < NSEG; i++) total += seg_sizes[i];
    gmean = alloc_floats(total);
    xflat = alloc_floats(total);
    for (off = 0, i = 0; i < NSEG; i++) {
        for (j = 0; j < seg_sizes[i]; j++) {
            gmean[off + j] = gl.pieces[i][j];
            gl.pieces[i][j] *= -16.0f; /* exact: a power of two */
            xflat[off + j] = xl.pieces[i][j];
        }
        gs[i] = gl.spans[i];
        xs[i] = xl.spans[i];
        off += seg_sizes[i];
    }
    gb = dopt_buf_scatter(gs, NSEG);
    xb = dopt_buf_scatter(xs, NSEG);
    DT_OK(dopt_celgc_step(FLAT(xflat, total), FLAT(gmean, total),
                          &(dopt_celgc){.eta = 0.3f, .gamma = 1.0f, .weight_decay = 0.001f}));
    DT_OK(dopt_celgc_step(&xb, &gb, &(dopt_celgc){.eta = 0.3f, .gamma = 1.0f, .weight_decay = 0.001f, .scale = -1.0f / 16.0f}));
    for (off = 0, i = 0; i < NSEG; i++) {
        for (j = 0; j < seg_sizes[i]; j++) DT_NEAR(xl.pieces[i][j], xflat[off + j], 1e-7);
        off += seg_sizes[i];
    }
    free(gmean);
    free(xflat);
    layouts_free(&gl);
    layouts_free(&xl);
}

/* ------------------------------------------------------------------ the argument structs' defaults */

/* A zero scale (either sign) is 1: every call that takes a scale in a struct gives the same bits
   with scale 0, -0 and 1 — norms, factors, clipped buffers, AGC, CELGC's step size and step. */
DTEST(zero_scale_means_one) {
    static const float scales[3] = {1.0f, 0.0f, -0.0f};
    two_layouts t[3], p;
    dopt_buf bufs[3], params;
    dopt_clip_norm o[3];
    double norms[3][NSEG];
    size_t i, k;
    layouts_make(&p, 150, 1.0f);
    params = dopt_buf_scatter(p.spans, NSEG);
    /* global norm (clipping), segment norms, AGC, on three copies of the same data */
    for (k = 0; k < 3; k++) {
        layouts_make(&t[k], 151, 1.0f);
        bufs[k] = dopt_buf_scatter(t[k].spans, NSEG);
        o[k] = (dopt_clip_norm){.max_norm = 2.0f, .scale = scales[k]};
        DT_OK(dopt_clip_global_norm(NULL, &bufs[k], &o[k]));
        DT_OK(dopt_clip_segment_norms(NULL, &bufs[k], &(dopt_clip_norm){.max_norm = 0.3f, .scale = scales[k]}, norms[k]));
        DT_OK(dopt_clip_agc(NULL, &bufs[k], &params, &(dopt_agc){.lambda = 0.01f, .scale = scales[k]}));
    }
    DT_CHECK(o[0].factor < 1.0f); /* the global clip did bite */
    for (k = 1; k < 3; k++) {
        DT_CHECKF(same_bits_d(o[k].norm, o[0].norm) && o[k].factor == o[0].factor, "scale %g: norm %.17g vs %.17g",
                  (double)scales[k], o[k].norm, o[0].norm);
        DT_CHECK(memcmp(norms[k], norms[0], sizeof norms[0]) == 0);
        for (i = 0; i < NSEG; i++)
            DT_CHECKF(memcmp(t[k].pieces[i], t[0].pieces[i], seg_sizes[i] * sizeof(float)) == 0,
                      "scale %g: segment %zu differs", (double)scales[k], i);
    }
    /* CELGC: step size and step (γ/‖g‖ < η, so the scale would show in the step) */
    {
        float steps[3], *x[3];
        size_t n = 513;
        float *g = alloc_floats(n);
        fill(g, n, 152, 1.0f);
        for (k = 0; k < 3; k++) {
            const dopt_celgc rule = {.eta = 1.0f, .gamma = 0.5f, .weight_decay = 0.01f, .scale = scales[k]};
            x[k] = alloc_floats(n);
            fill(x[k], n, 153, 1.0f);
            DT_OK(dopt_celgc_step_size(FLAT(g, n), &rule, &steps[k]));
            DT_OK(dopt_celgc_step(FLAT(x[k], n), FLAT(g, n), &rule));
        }
        DT_CHECK(steps[0] < 1.0f);
        for (k = 1; k < 3; k++) {
            DT_CHECK(steps[k] == steps[0]);
            DT_CHECK(memcmp(x[k], x[0], n * sizeof(float)) == 0);
        }
        for (k = 0; k < 3; k++) free(x[k]);
        free(g);
    }
    for (k = 0; k < 3; k++) layouts_free(&t[k]);
    layouts_free(&p);
}

/* AGC's eps left 0 is DOPT_AGC_EPS_DEFAULT: a zero weight row (where eps is the bound) and
   ordinary rows clip to the same bits. */
DTEST(agc_zero_eps_means_the_default) {
    size_t rows = 8, cols_n = 5, n = rows * cols_n, cols[1];
    float *g0 = alloc_floats(n), *g1, *w = alloc_floats(n);
    dopt_buf wb = dopt_buf_flat(w, n, NULL, 0);
    cols[0] = cols_n;
    fill(g0, n, 161, 1.0f);
    fill(w, n, 162, 1.0f);
    memset(w, 0, cols_n * sizeof(float)); /* row 0: ‖w‖ = 0, so eps sets the bound */
    g1 = copy_floats(g0, n);
    DT_OK(dopt_clip_agc(NULL, FLAT(g0, n), &wb, &(dopt_agc){.lambda = 0.05f, .eps = DOPT_AGC_EPS_DEFAULT, .cols = cols}));
    DT_OK(dopt_clip_agc(NULL, FLAT(g1, n), &wb, &(dopt_agc){.lambda = 0.05f, .cols = cols}));
    DT_CHECK(memcmp(g0, g1, n * sizeof(float)) == 0);
    DT_CHECK(rel_err(sqrt(ref_sumsq(g1, cols_n)), 0.05 * 1e-3) < 1e-6); /* row 0 on the bound λ·eps */
    free(g0);
    free(g1);
    free(w);
}

/* measure_only on segments with gaps and on a scatter list: the buffer keeps every bit (gaps
   included), the norm and factor are reported, and they are what the clipping call then finds
   and applies. The per-segment call measures alike. */
DTEST(measure_only_leaves_every_layout_bitwise_and_reports_norm_and_factor) {
    two_layouts t;
    dopt_buf flat, scat;
    float *before;
    double norms[NSEG], clipped_norms[NSEG];
    size_t i;
    int k;
    layouts_make(&t, 171, 1.0f);
    before = copy_floats(t.flat, t.flat_n);
    flat = dopt_buf_flat(t.flat, t.flat_n, t.segs, NSEG);
    scat = dopt_buf_scatter(t.spans, NSEG);
    for (k = 0; k < 2; k++) {
        const dopt_buf *b = k == 0 ? &flat : &scat;
        dopt_clip_norm m = {.max_norm = 1.0f, .scale = -0.5f, .measure_only = 1}, c = {.max_norm = 1.0f, .scale = -0.5f};
        DT_OK(dopt_clip_global_norm(NULL, b, &m));
        DT_OK(dopt_clip_global_norm(NULL, b, &m)); /* twice: nothing moved in between */
        DT_CHECK(memcmp(t.flat, before, t.flat_n * sizeof(float)) == 0);
        layouts_check_same(&t, before);
        DT_CHECK(rel_err(m.norm, 0.5 * sqrt(layouts_ref_sumsq(&t))) < 1e-14);
        DT_CHECK(m.factor == (float)(1.0 / m.norm) && m.factor < 1.0f);
        DT_OK(dopt_clip_segment_norms(NULL, b, &(dopt_clip_norm){.max_norm = 1e-3f, .measure_only = 1}, norms));
        DT_CHECK(memcmp(t.flat, before, t.flat_n * sizeof(float)) == 0);
        layouts_check_same(&t, before);
        for (i = 0; i < NSEG; i++) DT_CHECK(rel_err(norms[i], sqrt(ref_sumsq(t.pieces[i], seg_sizes[i]))) < 1e-14);
        if (k == 1) { /* then the clips themselves, on the scatter list */
            DT_OK(dopt_clip_segment_norms(NULL, b, &(dopt_clip_norm){.max_norm = 1e3f}, clipped_norms));
            DT_CHECK(memcmp(norms, clipped_norms, sizeof norms) == 0);
            DT_OK(dopt_clip_global_norm(NULL, b, &c));
            DT_CHECK(same_bits_d(c.norm, m.norm) && c.factor == m.factor);
            DT_CHECK(rel_err(0.5 * sqrt(layouts_ref_sumsq(&t)), 1.0) < 1e-6);
        }
    }
    free(before);
    layouts_free(&t);
}

/* A field a call does not use is ignored: per-segment thresholds in a global-norm call, the
   driver's states in CELGC's own calls. */
DTEST(fields_a_call_does_not_use_are_ignored) {
    float x[33], y[33], step0, step1, bad_limits[1] = {-1.0f};
    dopt_buf states[1] = {{0}};
    dopt_clip_norm a = {.max_norm = 0.5f}, b = {.max_norm = 0.5f, .max_norms = bad_limits};
    fill(x, 33, 181, 1.0f);
    memcpy(y, x, sizeof x);
    DT_OK(dopt_clip_global_norm(NULL, FLAT(x, 33), &a));
    DT_OK(dopt_clip_global_norm(NULL, FLAT(y, 33), &b));
    DT_CHECK(memcmp(x, y, sizeof x) == 0 && same_bits_d(a.norm, b.norm));
    DT_OK(dopt_celgc_step_size(FLAT(x, 33), &(dopt_celgc){.eta = 1.0f, .gamma = 0.1f}, &step0));
    DT_OK(dopt_celgc_step_size(FLAT(x, 33), &(dopt_celgc){.eta = 1.0f, .gamma = 0.1f, .states = states}, &step1));
    DT_CHECK(step0 == step1);
}

/* ------------------------------------------------------------------ non-finite and bad arguments */

/* Runs every clipping call on a copy of `x` holding one bad value at `pos`; each must return
   DOPT_ERR_NONFINITE and leave the buffers as they were. */
static void expect_nonfinite_everywhere(size_t n, size_t pos, float bad) {
    float *x = alloc_floats(n), *w = alloc_floats(n), *orig, *worig, step = -1;
    dopt_buf b = dopt_buf_flat(x, n, NULL, 0), wb = dopt_buf_flat(w, n, NULL, 0);
    dopt_clip_norm clip = {.max_norm = 0.1f}, measure = {.max_norm = 0.1f, .measure_only = 1};
    const dopt_agc agc = {.lambda = 0.01f, .eps = 1e-3f, .scale = 1.0f};
    const dopt_celgc rule = {.eta = 0.1f, .gamma = 1.0f};
    double norms[1] = {0};
    fill(x, n, 131, 1.0f);
    fill(w, n, 132, 1.0f);
    x[pos] = bad;
    orig = copy_floats(x, n);
    worig = copy_floats(w, n);
    DT_EQ_INT(dopt_clip_global_norm(NULL, &b, &clip), DOPT_ERR_NONFINITE);
    DT_CHECK(dopt__is_nan(clip.norm) && clip.factor == 0.0f);
    DT_EQ_INT(dopt_clip_global_norm(NULL, &b, &measure), DOPT_ERR_NONFINITE);
    DT_CHECK(dopt__is_nan(measure.norm) && measure.factor == 0.0f);
    DT_EQ_INT(dopt_clip_segment_norms(NULL, &b, &clip, norms), DOPT_ERR_NONFINITE);
    DT_CHECK(dopt__is_nan(norms[0]));
    DT_EQ_INT(dopt_clip_value(NULL, &b, 1.0f, 0.1f), DOPT_ERR_NONFINITE);
    DT_EQ_INT(dopt_clip_sigma(NULL, &b, 2.5f), DOPT_ERR_NONFINITE);
    DT_EQ_INT(dopt_clip_agc(NULL, &b, &wb, &agc), DOPT_ERR_NONFINITE);
    DT_EQ_INT(dopt_clip_agc(NULL, &wb, &b, &agc), DOPT_ERR_NONFINITE); /* bad params */
    DT_EQ_INT(dopt_celgc_step_size(&b, &rule, &step), DOPT_ERR_NONFINITE);
    DT_CHECK(step == 0.0f);
    DT_EQ_INT(dopt_celgc_step(&wb, &b, &rule), DOPT_ERR_NONFINITE);
    DT_CHECKF(memcmp(x, orig, n * sizeof(float)) == 0, "n=%zu pos=%zu: gradient changed", n, pos);
    DT_CHECKF(memcmp(w, worig, n * sizeof(float)) == 0, "n=%zu pos=%zu: parameters changed", n, pos);
    free(x);
    free(w);
    free(orig);
    free(worig);
}

DTEST(nan_or_inf_anywhere_is_reported_and_nothing_is_touched) {
    static const size_t pos[] = {0, 5, 15, 16, 17, 500, 999};
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    size_t p;
    int b;
    for (p = 0; p < sizeof pos / sizeof *pos; p++)
        for (b = 0; b < 3; b++) expect_nonfinite_everywhere(1000, pos[p], bad[b]);
    for (b = 0; b < 3; b++) expect_nonfinite_everywhere(1, 0, bad[b]);
}

DTEST(bad_arguments_are_invalid_and_touch_nothing) {
    float x[40], w[40], orig[40], worig[40], wrong[3];
    dopt_segment overlap[2] = {{0, 20, NULL}, {10, 20, NULL}}, beyond[1] = {{30, 20, NULL}};
    dopt_span null_span[1] = {{NULL, 4}};
    dopt_buf b = dopt_buf_flat(x, 40, NULL, 0), wb = dopt_buf_flat(w, 40, NULL, 0);
    dopt_buf bad_overlap = dopt_buf_flat(x, 40, overlap, 2), bad_beyond = dopt_buf_flat(x, 40, beyond, 1);
    dopt_buf bad_span = dopt_buf_scatter(null_span, 1), short_w = dopt_buf_flat(wrong, 3, NULL, 0);
    dopt_buf null_data = dopt_buf_flat(NULL, 40, NULL, 0);
    const float bad_limits[5] = {-1.0f, 0.0f, NAN, -INFINITY, -0.0f};
    float limits[1], step = -1;
    dopt_clip_norm o;
    double norms[2];
    size_t cols[1] = {7}; /* does not divide 40 */
    int i;
    fill(x, 40, 141, 1.0f);
    fill(w, 40, 142, 1.0f);
    memcpy(orig, x, sizeof x);
    memcpy(worig, w, sizeof w);
    for (i = 0; i < 5; i++) {
        float t = bad_limits[i];
        limits[0] = t;
        o = (dopt_clip_norm){.max_norm = t};
        DT_EQ_INT(dopt_clip_global_norm(NULL, &b, &o), DOPT_ERR_INVALID);
        DT_CHECK(dopt__is_nan(o.norm) && o.factor == 0.0f);
        o = (dopt_clip_norm){.max_norm = t, .measure_only = 1, .factor = -1.0f};
        DT_EQ_INT(dopt_clip_global_norm(NULL, &b, &o), DOPT_ERR_INVALID);
        DT_CHECK(dopt__is_nan(o.norm) && o.factor == 0.0f);
        DT_EQ_INT(dopt_clip_segment_norms(NULL, &b, &(dopt_clip_norm){.max_norm = t}, norms), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_clip_segment_norms(NULL, &b, &(dopt_clip_norm){.max_norms = limits, .max_norm = 1.0f}, norms),
                  DOPT_ERR_INVALID);
        DT_CHECK(dopt__is_nan(norms[0]));
        DT_EQ_INT(dopt_clip_value(NULL, &b, 1.0f, t), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_clip_sigma(NULL, &b, t), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_clip_agc(NULL, &b, &wb, &(dopt_agc){.lambda = t, .eps = 1e-3f}), DOPT_ERR_INVALID);
        if (dopt__is_nan(t) || t != 0.0f) /* eps: zero is the default, any other of these is refused */
            DT_EQ_INT(dopt_clip_agc(NULL, &b, &wb, &(dopt_agc){.lambda = 0.01f, .eps = t}), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_celgc_step_size(&b, &(dopt_celgc){.eta = t, .gamma = 1.0f}, &step), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_celgc_step_size(&b, &(dopt_celgc){.eta = 0.1f, .gamma = t}, &step), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_celgc_step(&wb, &b, &(dopt_celgc){.eta = t, .gamma = 1.0f}), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_celgc_step(&wb, &b, &(dopt_celgc){.eta = 0.1f, .gamma = t}), DOPT_ERR_INVALID);
        if (t < 0 || dopt__is_nan(t)) { /* weight decay: zero is none, negative or NaN refused */
            const dopt_celgc wd = {.eta = 0.1f, .gamma = 1.0f, .weight_decay = t};
            DT_EQ_INT(dopt_celgc_step(&wb, &b, &wd), DOPT_ERR_INVALID);
            DT_EQ_INT(dopt_celgc_step_size(&b, &wd, &step), DOPT_ERR_INVALID); /* the whole rule is checked */
        }
    }
    /* scales: NaN, infinite (a zero scale means 1 in the structs; dopt_clip_value refuses it) */
    {
        const float bad_scales[3] = {NAN, INFINITY, -INFINITY};
        for (i = 0; i < 3; i++) {
            float s = bad_scales[i];
            o = (dopt_clip_norm){.max_norm = 1.0f, .scale = s};
            DT_EQ_INT(dopt_clip_global_norm(NULL, &b, &o), DOPT_ERR_INVALID);
            o.measure_only = 1;
            DT_EQ_INT(dopt_clip_global_norm(NULL, &b, &o), DOPT_ERR_INVALID);
            DT_CHECK(dopt__is_nan(o.norm) && o.factor == 0.0f);
            DT_EQ_INT(dopt_clip_segment_norms(NULL, &b, &o, norms), DOPT_ERR_INVALID);
            DT_EQ_INT(dopt_clip_value(NULL, &b, s, 1.0f), DOPT_ERR_INVALID);
            DT_EQ_INT(dopt_clip_agc(NULL, &b, &wb, &(dopt_agc){.lambda = 0.01f, .scale = s}), DOPT_ERR_INVALID);
            DT_EQ_INT(dopt_celgc_step_size(&b, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f, .scale = s}, &step),
                      DOPT_ERR_INVALID);
            DT_EQ_INT(dopt_celgc_step(&wb, &b, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f, .scale = s}),
                      DOPT_ERR_INVALID);
        }
        DT_EQ_INT(dopt_clip_value(NULL, &b, 0.0f, 1.0f), DOPT_ERR_INVALID);
        DT_EQ_INT(dopt_clip_value(NULL, &b, -0.0f, 1.0f), DOPT_ERR_INVALID);
    }
    /* NULL buffers and descriptors, bad segment tables, mismatched layouts */
    o = (dopt_clip_norm){.max_norm = 1.0f};
    DT_EQ_INT(dopt_clip_global_norm(NULL, &null_data, &o), DOPT_ERR_INVALID);
    DT_CHECK(dopt__is_nan(o.norm) && o.factor == 0.0f);
    DT_EQ_INT(dopt_clip_global_norm(NULL, NULL, &o), DOPT_ERR_INVALID);
    o.measure_only = 1;
    DT_EQ_INT(dopt_clip_global_norm(NULL, NULL, &o), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_global_norm(NULL, &bad_overlap, &o), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_global_norm(NULL, &bad_beyond, &o), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_global_norm(NULL, &bad_span, &o), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_segment_norms(NULL, NULL, &o, norms), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_segment_norms(NULL, &bad_overlap, &o, norms), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_segment_norms(NULL, &b, &o, NULL), DOPT_ERR_INVALID); /* norms required */
    DT_EQ_INT(dopt_clip_value(NULL, NULL, 1.0f, 1.0f), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_value(NULL, &bad_beyond, 1.0f, 1.0f), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_sigma(NULL, NULL, 2.5f), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_sigma(NULL, &bad_span, 2.5f), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_agc(NULL, &b, NULL, &(dopt_agc){.lambda = 0.01f}), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_agc(NULL, &b, &short_w, &(dopt_agc){.lambda = 0.01f}), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_agc(NULL, &b, &wb, &(dopt_agc){.lambda = 0.01f, .cols = cols}), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_agc(NULL, &b, &wb, &(dopt_agc){.lambda = 0.01f, .eps = INFINITY}), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_celgc_step_size(NULL, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}, &step), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_celgc_step_size(&null_data, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}, &step), DOPT_ERR_INVALID);
    step = -1;
    DT_EQ_INT(dopt_celgc_step_size(&b, &(dopt_celgc){.eta = INFINITY, .gamma = 1.0f}, &step), DOPT_ERR_INVALID);
    DT_CHECK(step == 0.0f); /* eta finite */
    DT_EQ_INT(dopt_celgc_step(NULL, &b, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_celgc_step(&wb, NULL, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_celgc_step(&null_data, &b, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_celgc_step(&wb, &b, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f, .weight_decay = INFINITY}),
              DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_celgc_step(&short_w, &b, &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}), DOPT_ERR_INVALID);
    DT_CHECK(memcmp(x, orig, sizeof x) == 0);
    DT_CHECK(memcmp(w, worig, sizeof w) == 0);
}

/* Every call that takes an argument struct refuses a NULL one, touches nothing, and (a step
   size) reports 0. */
DTEST(null_argument_struct_is_invalid_and_touches_nothing) {
    float x[40], w[40], orig[40], worig[40], step = -1;
    dopt_buf b = dopt_buf_flat(x, 40, NULL, 0), wb = dopt_buf_flat(w, 40, NULL, 0);
    double norms[1] = {0};
    dopt_comm *self;
    fill(x, 40, 143, 10.0f); /* a norm far above any threshold: a clip would show */
    fill(w, 40, 144, 1.0f);
    memcpy(orig, x, sizeof x);
    memcpy(worig, w, sizeof w);
    DT_EQ_INT(dopt_clip_global_norm(NULL, &b, NULL), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_segment_norms(NULL, &b, NULL, norms), DOPT_ERR_INVALID);
    DT_CHECK(dopt__is_nan(norms[0]));
    DT_EQ_INT(dopt_clip_agc(NULL, &b, &wb, NULL), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_celgc_step_size(&b, NULL, &step), DOPT_ERR_INVALID);
    DT_CHECK(step == 0.0f);
    DT_EQ_INT(dopt_celgc_step(&wb, &b, NULL), DOPT_ERR_INVALID);
    /* with a communicator too (the rank still takes part in the reduction: see the worlds below) */
    DT_OK(dopt_comm_create_self(&self));
    DT_EQ_INT(dopt_clip_global_norm(self, &b, NULL), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_segment_norms(self, &b, NULL, norms), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_agc(self, &b, &wb, NULL), DOPT_ERR_INVALID);
    DT_OK(dopt_barrier(self)); /* and the communicator is not poisoned */
    dopt_comm_destroy(self);
    DT_CHECK(memcmp(x, orig, sizeof x) == 0);
    DT_CHECK(memcmp(w, worig, sizeof w) == 0);
}

/* ------------------------------------------------------------------ worlds of 2..4 processes */

/* Rank r's gradient: MR_SEGS segments of sizes that differ by rank and segment (all odd), held
   flat with gaps on even ranks and as a scatter list on odd ones. Any rank can rebuild any
   other rank's data, which is how each computes the reference norm of the concatenation. */
#define MR_SEGS 4

static size_t mr_size(int rank, size_t l) { return 3 + 98 * l + 30 * (size_t)rank + (l == 3 ? 4000 : 0); }

static void mr_fill(float *x, int rank, size_t l) { fill(x, mr_size(rank, l), 1000 + 10 * (uint64_t)rank + l, 1.0f + (float)rank); }

typedef struct mr_grad {
    float *flat;
    dopt_segment segs[MR_SEGS];
    float *pieces[MR_SEGS];
    dopt_span spans[MR_SEGS];
    dopt_buf buf;
} mr_grad;

static void mr_make(mr_grad *g, int rank) {
    size_t l, off = 0, total = 0;
    memset(g, 0, sizeof *g);
    for (l = 0; l < MR_SEGS; l++) total += mr_size(rank, l) + 1;
    if (rank % 2 == 0) {
        g->flat = alloc_floats(total);
        for (l = 0; l < MR_SEGS; l++) {
            g->flat[off++] = 1e30f; /* a gap: would dominate the norm if it were counted */
            g->segs[l].offset = off;
            g->segs[l].count = mr_size(rank, l);
            mr_fill(g->flat + off, rank, l);
            off += mr_size(rank, l);
        }
        g->buf = dopt_buf_flat(g->flat, total, g->segs, MR_SEGS);
    } else {
        for (l = 0; l < MR_SEGS; l++) {
            g->pieces[l] = alloc_floats(mr_size(rank, l));
            mr_fill(g->pieces[l], rank, l);
            g->spans[l].ptr = g->pieces[l];
            g->spans[l].count = mr_size(rank, l);
        }
        g->buf = dopt_buf_scatter(g->spans, MR_SEGS);
    }
}

static void mr_free(mr_grad *g) {
    size_t l;
    free(g->flat);
    for (l = 0; l < MR_SEGS; l++) free(g->pieces[l]);
}

/* Σ over ranks of scale(r)² · ‖segment l of rank r‖², computed from scratch in double. */
static double mr_ref_seg_sumsq(int size, size_t l, float (*scale_of)(int)) {
    double s = 0.0;
    int r;
    for (r = 0; r < size; r++) {
        float *x = alloc_floats(mr_size(r, l));
        double sc = scale_of ? (double)scale_of(r) : 1.0;
        mr_fill(x, r, l);
        s += sc * sc * ref_sumsq(x, mr_size(r, l));
        free(x);
    }
    return s;
}

/* bytes equal on every rank: gathered and compared with rank 0's */
static void check_same_on_every_rank(dopt_comm *c, const void *bytes, size_t len) {
    unsigned char *all = (unsigned char *)malloc(len * (size_t)c->size);
    int r;
    DT_CHECK(all != NULL);
    DT_OK(dopt_allgather(c, bytes, all, len));
    for (r = 1; r < c->size; r++)
        DT_CHECKF(memcmp(all, all + (size_t)r * len, len) == 0, "rank %d differs from rank 0", r);
    free(all);
}

/* Snapshot of a rank's segments, to check them unchanged or scaled. */
static float **mr_snapshot(const mr_grad *g) {
    float **s = (float **)malloc(MR_SEGS * sizeof *s);
    size_t l;
    DT_CHECK(s != NULL);
    for (l = 0; l < MR_SEGS; l++) {
        dopt_span sp = dopt_buf_segment(&g->buf, l);
        s[l] = copy_floats(sp.ptr, sp.count);
    }
    return s;
}

static void mr_check_scaled(const mr_grad *g, float **snap, const float *factors) {
    size_t l;
    for (l = 0; l < MR_SEGS; l++) {
        dopt_span sp = dopt_buf_segment(&g->buf, l);
        float *want = scaled_copy(snap[l], sp.count, factors[l]);
        DT_CHECKF(memcmp(want, sp.ptr, sp.count * sizeof(float)) == 0, "segment %zu not scaled by %g", l,
                  (double)factors[l]);
        free(want);
    }
}

static void mr_snapshot_free(float **snap) {
    size_t l;
    for (l = 0; l < MR_SEGS; l++) free(snap[l]);
    free(snap);
}

static float mr_scale(int rank) { return 1.0f / (float)(rank + 1); }

static void body_global_norm(dopt_comm *c, void *unused) {
    (void)unused;
    mr_grad g;
    float **snap, factors[MR_SEGS];
    double want = 0.0, want_scaled = 0.0;
    size_t l;
    struct {
        double norm;
        float factor;
        float pad;
    } result;
    dopt_clip_norm o;
    mr_make(&g, c->rank);
    snap = mr_snapshot(&g);
    for (l = 0; l < MR_SEGS; l++) {
        want += mr_ref_seg_sumsq(c->size, l, NULL);
        want_scaled += mr_ref_seg_sumsq(c->size, l, mr_scale);
    }
    want = sqrt(want);
    want_scaled = sqrt(want_scaled);
    memset(&result, 0, sizeof result);
    /* the factor alone first: nothing moves */
    o = (dopt_clip_norm){.max_norm = (float)(want / 3), .measure_only = 1};
    DT_OK(dopt_clip_global_norm(c, &g.buf, &o));
    result.norm = o.norm;
    result.factor = o.factor;
    DT_CHECKF(rel_err(result.norm, want) < 1e-14, "rank %d: norm %.17g, concatenation %.17g", c->rank, result.norm, want);
    DT_CHECK(result.factor < 1.0f);
    check_same_on_every_rank(c, &result, sizeof result);
    for (l = 0; l < MR_SEGS; l++) factors[l] = 1.0f;
    mr_check_scaled(&g, snap, factors);
    /* each rank its own scale (unequal batches): the norm of the concatenated scale·g */
    o = (dopt_clip_norm){.max_norm = 1.0f, .scale = mr_scale(c->rank), .measure_only = 1};
    DT_OK(dopt_clip_global_norm(c, &g.buf, &o));
    result.norm = o.norm;
    result.factor = o.factor;
    DT_CHECKF(rel_err(result.norm, want_scaled) < 1e-14, "rank %d: scaled norm %.17g vs %.17g", c->rank,
              result.norm, want_scaled);
    check_same_on_every_rank(c, &result, sizeof result);
    /* then the clip: every rank scales by the same factor, the one measure_only predicted */
    o = (dopt_clip_norm){.max_norm = (float)(want / 3), .measure_only = 1};
    DT_OK(dopt_clip_global_norm(c, &g.buf, &o));
    result.factor = o.factor;
    o = (dopt_clip_norm){.max_norm = (float)(want / 3)};
    DT_OK(dopt_clip_global_norm(c, &g.buf, &o));
    result.norm = o.norm;
    DT_CHECK(o.factor == result.factor);
    check_same_on_every_rank(c, &result, sizeof result);
    for (l = 0; l < MR_SEGS; l++) factors[l] = result.factor;
    mr_check_scaled(&g, snap, factors);
    mr_snapshot_free(snap);
    mr_free(&g);
}

DTEST_WORLDS(global_norm_is_bitwise_equal_on_every_rank_and_of_the_concatenation, body_global_norm, NULL, 2, 4);

static void body_segment_norms(dopt_comm *c, void *unused) {
    (void)unused;
    mr_grad g;
    float **snap, limits[MR_SEGS] = {1.0f, 3.0f, 1e6f, 50.0f}, factors[MR_SEGS];
    double norms[MR_SEGS], measured[MR_SEGS];
    size_t l;
    mr_make(&g, c->rank);
    snap = mr_snapshot(&g);
    for (l = 0; l < MR_SEGS; l++) factors[l] = 1.0f;
    /* measured first: the same norms, nothing moves */
    DT_OK(dopt_clip_segment_norms(c, &g.buf, &(dopt_clip_norm){.max_norms = limits, .measure_only = 1}, measured));
    mr_check_scaled(&g, snap, factors);
    DT_OK(dopt_clip_segment_norms(c, &g.buf, &(dopt_clip_norm){.max_norms = limits}, norms));
    DT_CHECK(memcmp(norms, measured, sizeof norms) == 0);
    check_same_on_every_rank(c, norms, sizeof norms);
    for (l = 0; l < MR_SEGS; l++) {
        double want = sqrt(mr_ref_seg_sumsq(c->size, l, NULL));
        DT_CHECKF(rel_err(norms[l], want) < 1e-14, "segment %zu: %.17g vs %.17g", l, norms[l], want);
        factors[l] = norms[l] > limits[l] ? (float)((double)limits[l] / norms[l]) : 1.0f;
    }
    DT_CHECK(factors[0] < 1.0f && factors[2] == 1.0f);
    mr_check_scaled(&g, snap, factors);
    mr_snapshot_free(snap);
    mr_free(&g);
}

DTEST_WORLDS(segment_norms_are_over_every_rank_and_identical, body_segment_norms, NULL, 2, 4);

/* The last rank holds a NaN (then an infinity): every rank gets DOPT_ERR_NONFINITE from every
   call, no rank touches its buffer, and the communicator keeps working. */
static void body_nonfinite_on_one_rank(dopt_comm *c, void *unused) {
    (void)unused;
    mr_grad g, w;
    float **snap, ones[MR_SEGS] = {1, 1, 1, 1};
    double norms[MR_SEGS];
    dopt_clip_norm o;
    int bad = c->rank == c->size - 1, round;
    mr_make(&g, c->rank);
    mr_make(&w, c->rank);
    for (round = 0; round < 2; round++) {
        float *victim = (float *)dopt_buf_segment(&g.buf, 1).ptr + 7;
        float keep = *victim;
        if (bad) *victim = round == 0 ? NAN : -INFINITY;
        snap = mr_snapshot(&g);
        o = (dopt_clip_norm){.max_norm = 1.0f};
        DT_EQ_INT(dopt_clip_global_norm(c, &g.buf, &o), DOPT_ERR_NONFINITE);
        DT_CHECK(dopt__is_nan(o.norm) && o.factor == 0.0f);
        o = (dopt_clip_norm){.max_norm = 1.0f, .measure_only = 1};
        DT_EQ_INT(dopt_clip_global_norm(c, &g.buf, &o), DOPT_ERR_NONFINITE);
        DT_CHECK(dopt__is_nan(o.norm) && o.factor == 0.0f);
        DT_EQ_INT(dopt_clip_segment_norms(c, &g.buf, &(dopt_clip_norm){.max_norm = 1.0f}, norms), DOPT_ERR_NONFINITE);
        DT_EQ_INT(dopt_clip_value(c, &g.buf, 1.0f, 0.1f), DOPT_ERR_NONFINITE);
        DT_EQ_INT(dopt_clip_sigma(c, &g.buf, 2.5f), DOPT_ERR_NONFINITE);
        DT_EQ_INT(dopt_clip_agc(c, &g.buf, &w.buf, &(dopt_agc){.lambda = 0.01f, .eps = 1e-3f}), DOPT_ERR_NONFINITE);
        mr_check_scaled(&g, snap, ones);
        mr_snapshot_free(snap);
        *victim = keep;
        /* the next step is clean everywhere and goes through */
        DT_OK(dopt_clip_global_norm(c, &g.buf, &(dopt_clip_norm){.max_norm = 1e9f}));
    }
    mr_free(&g);
    mr_free(&w);
}

DTEST_WORLDS(nan_on_one_rank_makes_every_rank_skip, body_nonfinite_on_one_rank, NULL, 2, 4);

/* Rank 0 passes a NaN threshold (then a NaN scale, a negative one, a zero one, no argument
   struct at all): every rank gets DOPT_ERR_INVALID, nothing moves, and the communicator keeps
   working. */
static void body_invalid_on_one_rank(dopt_comm *c, void *unused) {
    (void)unused;
    mr_grad g, w;
    float **snap, ones[MR_SEGS] = {1, 1, 1, 1};
    double norms[MR_SEGS];
    dopt_clip_norm o = {.max_norm = 1.0f}, bad = {.max_norm = NAN};
    dopt_agc agc = {.lambda = 1e-6f};
    int odd = c->rank == 0;
    mr_make(&g, c->rank);
    mr_make(&w, c->rank);
    snap = mr_snapshot(&g);
    DT_EQ_INT(dopt_clip_global_norm(c, &g.buf, odd ? &bad : &o), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_segment_norms(c, &g.buf, &(dopt_clip_norm){.max_norm = 1.0f, .scale = odd ? NAN : 1.0f}, norms),
              DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_value(c, &g.buf, 1.0f, odd ? -1.0f : 1.0f), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_value(c, &g.buf, odd ? 0.0f : 1.0f, 1.0f), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_sigma(c, &g.buf, odd ? 0.0f : 2.5f), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_global_norm(c, &g.buf, odd ? NULL : &o), DOPT_ERR_INVALID);
    DT_CHECK(odd || (dopt__is_nan(o.norm) && o.factor == 0.0f));
    DT_EQ_INT(dopt_clip_segment_norms(c, &g.buf, odd ? NULL : &o, norms), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_clip_agc(c, &g.buf, &w.buf, odd ? NULL : &agc), DOPT_ERR_INVALID);
    mr_check_scaled(&g, snap, ones);
    DT_OK(dopt_clip_global_norm(c, &g.buf, &(dopt_clip_norm){.max_norm = 1e9f}));
    mr_snapshot_free(snap);
    mr_free(&g);
    mr_free(&w);
}

DTEST_WORLDS(invalid_argument_on_one_rank_fails_every_rank, body_invalid_on_one_rank, NULL, 2, 4);

/* Rank 0 passes no norms array, so it cannot take part with MR_SEGS sums: every rank fails (rank
   0 with DOPT_ERR_INVALID, its peers with the transport's mismatch) instead of waiting. */
static void body_missing_norms_on_one_rank(dopt_comm *c, void *unused) {
    (void)unused;
    mr_grad g;
    double norms[MR_SEGS];
    dopt_status s;
    mr_make(&g, c->rank);
    s = dopt_clip_segment_norms(c, &g.buf, &(dopt_clip_norm){.max_norm = 1.0f}, c->rank == 0 ? NULL : norms);
    if (c->rank == 0)
        DT_EQ_INT(s, DOPT_ERR_INVALID);
    else
        DT_CHECKF(s == DOPT_ERR_MISMATCH || s == DOPT_ERR_INVALID, "rank %d: %s", c->rank, dopt_status_str(s));
    mr_free(&g);
}

DTEST_WORLDS(rank_that_cannot_join_the_reduction_fails_every_rank, body_missing_norms_on_one_rank, NULL, 2, 4);

DTEST_MAIN()
