/* Tests of distopt.h: status codes, descriptors, the RNG, the vector kernels and the self backend. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "dtest.h"
#include "conformance.h"

#include <float.h>
#include <stdint.h>

/* ------------------------------------------------------------------ status and version */

DTEST(every_status_has_a_string) {
    int s;
    for (s = DOPT_OK; s >= DOPT_ERR_CLOSED; s--)
        DT_CHECKF(strcmp(dopt_status_str((dopt_status)s), "unknown status") != 0, "status %d has no string", s);
    DT_CHECK(strcmp(dopt_status_str((dopt_status)-999), "unknown status") == 0);
    DT_CHECK(strcmp(dopt_status_str((dopt_status)1), "unknown status") == 0);
}

DTEST(version_matches_macros) {
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", DOPT_VERSION_MAJOR, DOPT_VERSION_MINOR, DOPT_VERSION_PATCH);
    DT_CHECK(strcmp(dopt_version(), want) == 0);
}

/* ------------------------------------------------------------------ descriptors */

DTEST(segments_from_sizes_are_consecutive) {
    size_t sizes[4] = {3, 0, 5, 2}, total = 0;
    dopt_segment segs[4];
    DT_OK(dopt_segments_from_sizes(segs, sizes, 4, &total));
    DT_EQ_INT(total, 10);
    DT_EQ_INT(segs[0].offset, 0);
    DT_EQ_INT(segs[1].offset, 3);
    DT_EQ_INT(segs[2].offset, 3);
    DT_EQ_INT(segs[3].offset, 8);
    DT_EQ_INT(segs[3].count, 2);
    DT_EQ_INT(segs[0].rows + segs[1].rows + segs[2].rows + segs[3].rows, 0); /* vectors */
    DT_EQ_INT(dopt_segments_from_sizes(NULL, sizes, 4, &total), DOPT_ERR_INVALID);
    sizes[1] = SIZE_MAX;
    DT_EQ_INT(dopt_segments_from_sizes(segs, sizes, 4, &total), DOPT_ERR_INVALID);
}

DTEST(bad_segment_tables_are_invalid) {
    float data[10];
    dopt_segment ok[2] = {{0, 4, "w"}, {6, 4, "b"}};
    dopt_segment overlap[2] = {{0, 5, "w"}, {4, 2, "b"}};
    dopt_segment unordered[2] = {{6, 4, "w"}, {0, 4, "b"}};
    dopt_segment beyond[1] = {{8, 3, "w"}};
    dopt_segment huge[1] = {{SIZE_MAX, 2, "w"}};
    dopt_buf b = dopt_buf_flat(data, 10, ok, 2);
    DT_OK(dopt_buf_validate(&b));
    b = dopt_buf_flat(data, 10, overlap, 2);
    DT_EQ_INT(dopt_buf_validate(&b), DOPT_ERR_INVALID);
    b = dopt_buf_flat(data, 10, unordered, 2);
    DT_EQ_INT(dopt_buf_validate(&b), DOPT_ERR_INVALID);
    b = dopt_buf_flat(data, 10, beyond, 1);
    DT_EQ_INT(dopt_buf_validate(&b), DOPT_ERR_INVALID);
    b = dopt_buf_flat(data, 10, huge, 1);
    DT_EQ_INT(dopt_buf_validate(&b), DOPT_ERR_INVALID);
    b = dopt_buf_flat(NULL, 10, NULL, 0);
    DT_EQ_INT(dopt_buf_validate(&b), DOPT_ERR_INVALID);
    b = dopt_buf_flat(NULL, 0, NULL, 0);
    DT_OK(dopt_buf_validate(&b));
    DT_EQ_INT(dopt_buf_count(&b), 0);
    DT_EQ_INT(dopt_buf_validate(NULL), DOPT_ERR_INVALID);
}

/* rows, the last field: three-field initialisers leave it 0 (a vector), and only compressors
   that work on matrices read it, so a table filled field by field, without rows, validates as it
   did, whatever rows holds. */
DTEST(segment_rows_are_not_read_by_validation) {
    float data[12];
    dopt_segment vector = {0, 12, "v"}, ragged = {0, 12, "w", 5}, garbage;
    dopt_buf b = dopt_buf_flat(data, 12, &vector, 1);
    DT_EQ_INT(vector.rows, 0);
    DT_OK(dopt_buf_validate(&b));
    b = dopt_buf_flat(data, 12, &ragged, 1);
    DT_OK(dopt_buf_validate(&b));
    memset(&garbage, 0xA5, sizeof garbage);
    garbage.offset = 0, garbage.count = 12, garbage.name = NULL;
    b = dopt_buf_flat(data, 12, &garbage, 1);
    DT_OK(dopt_buf_validate(&b));
}

DTEST(flat_buffer_segments_and_gaps) {
    float data[10];
    dopt_segment segs[2] = {{0, 4, "w"}, {6, 4, "b"}};
    dopt_buf b = dopt_buf_flat(data, 10, segs, 2);
    dopt_span s;
    DT_EQ_INT(dopt_buf_nsegs(&b), 2);
    DT_EQ_INT(dopt_buf_count(&b), 8); /* the gap belongs to no segment */
    s = dopt_buf_segment(&b, 1);
    DT_CHECK(s.ptr == data + 6 && s.count == 4);
    b = dopt_buf_flat(data, 10, NULL, 0);
    DT_EQ_INT(dopt_buf_nsegs(&b), 1);
    s = dopt_buf_segment(&b, 0);
    DT_CHECK(s.ptr == data && s.count == 10);
}

DTEST(scatter_pack_unpack_round_trip) {
    float a[3] = {1, 2, 3}, b2[1] = {4}, c[5] = {5, 6, 7, 8, 9}, packed[9], back_a[3], back_b[1], back_c[5];
    dopt_span spans[4] = {{a, 3}, {NULL, 0}, {b2, 1}, {c, 5}};
    dopt_span back[4] = {{back_a, 3}, {NULL, 0}, {back_b, 1}, {back_c, 5}};
    dopt_buf s = dopt_buf_scatter(spans, 4), t = dopt_buf_scatter(back, 4);
    int i;
    DT_OK(dopt_buf_validate(&s));
    DT_EQ_INT(dopt_buf_count(&s), 9);
    DT_EQ_INT(dopt_buf_nsegs(&s), 4);
    dopt_buf_pack(&s, packed);
    for (i = 0; i < 9; i++) DT_EQ_INT(packed[i], i + 1);
    dopt_buf_unpack(&t, packed);
    DT_CHECK(memcmp(a, back_a, sizeof a) == 0 && back_b[0] == 4 && memcmp(c, back_c, sizeof c) == 0);
    spans[1].count = 2; /* NULL with a count */
    DT_EQ_INT(dopt_buf_validate(&s), DOPT_ERR_INVALID);
}

DTEST(flat_pack_skips_gaps) {
    float data[6] = {1, 2, 3, 4, 5, 6}, out[4];
    dopt_segment segs[2] = {{0, 2, NULL}, {4, 2, NULL}};
    dopt_buf b = dopt_buf_flat(data, 6, segs, 2);
    dopt_buf_pack(&b, out);
    DT_CHECK(out[0] == 1 && out[1] == 2 && out[2] == 5 && out[3] == 6);
    out[2] = 50;
    dopt_buf_unpack(&b, out);
    DT_CHECK(data[4] == 50 && data[2] == 3);
}

/* ------------------------------------------------------------------ RNG */

DTEST(philox_matches_random123_known_answers) {
    static const uint32_t ctr[3][4] = {{0, 0, 0, 0},
                                       {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                                       {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}};
    static const uint32_t key[3][2] = {{0, 0}, {0xffffffffu, 0xffffffffu}, {0xa4093822u, 0x299f31d0u}};
    static const uint32_t want[3][4] = {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u},
                                        {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu},
                                        {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}};
    int i, j;
    for (i = 0; i < 3; i++) {
        uint32_t out[4];
        dopt_philox4x32(ctr[i], key[i], out);
        for (j = 0; j < 4; j++) DT_CHECKF(out[j] == want[i][j], "vector %d word %d: %08x != %08x", i, j, out[j], want[i][j]);
    }
}

DTEST(rng_batched_path_equals_block_by_block) {
    dopt_rng rng;
    uint32_t whole[1000], part[300];
    size_t i;
    dopt_rng_init(&rng, 42, 3, 7);
    dopt_rng_u32(&rng, 0, whole, 1000);
    for (i = 0; i < 1000; i += 4) {
        uint32_t ctr[4] = {(uint32_t)(i / 4), 0, 7, 0}, out[4];
        size_t j;
        dopt_philox4x32(ctr, rng.key, out);
        for (j = 0; j < 4; j++) DT_CHECK(whole[i + j] == out[j]);
    }
    /* any starting point and length gives the same words as the whole stream */
    for (i = 0; i < 40; i++) {
        size_t first = (i * 37) % 500, n = 1 + (i * 53) % 299;
        dopt_rng_u32(&rng, first, part, n);
        DT_CHECK(memcmp(part, whole + first, n * sizeof(uint32_t)) == 0);
    }
}

/* Blocks whose low counter word wraps inside one batch take the carrying path of the vector code. */
DTEST(rng_counter_carry_into_high_word) {
    dopt_rng rng;
    uint32_t got[1024];
    uint64_t first_block = 0xFFFFFFFFull - 37, i;
    dopt_rng_init(&rng, 5, 1, 0x123456789ull);
    dopt_rng_u32(&rng, first_block * 4, got, 1024);
    for (i = 0; i < 256; i++) {
        uint64_t b = first_block + i;
        uint32_t ctr[4] = {(uint32_t)b, (uint32_t)(b >> 32), 0x23456789u, 0x1u}, out[4];
        int w;
        dopt_philox4x32(ctr, rng.key, out);
        for (w = 0; w < 4; w++) DT_CHECKF(got[4 * i + (uint64_t)w] == out[w], "block %llu word %d", (unsigned long long)b, w);
    }    /* and 64 words at a time, the size the compressors ask for */
    for (i = 0; i < 1024; i += 64) {
        uint32_t part[64];
        dopt_rng_u32(&rng, first_block * 4 + i, part, 64);
        DT_CHECK(memcmp(part, got + i, sizeof part) == 0);
    }
}

DTEST(rng_same_key_same_numbers) {
    dopt_rng a, b;
    float x[777], y[777];
    dopt_rng_init(&a, 1234, 2, 99);
    dopt_rng_init(&b, 1234, 2, 99);
    dopt_rng_uniform(&a, 5, x, 777);
    dopt_rng_uniform(&b, 5, y, 777);
    DT_CHECK(memcmp(x, y, sizeof x) == 0);
}

static double correlation(const float *x, const float *y, size_t n) {
    double mx = 0, my = 0, sxy = 0, sxx = 0, syy = 0;
    size_t i;
    for (i = 0; i < n; i++) mx += x[i], my += y[i];
    mx /= n;
    my /= n;
    for (i = 0; i < n; i++) {
        sxy += (x[i] - mx) * (y[i] - my);
        sxx += (x[i] - mx) * (x[i] - mx);
        syy += (y[i] - my) * (y[i] - my);
    }
    return sxy / sqrt(sxx * syy);
}

DTEST(rng_ranks_and_streams_are_independent) {
    enum { N = 1 << 20 };
    float *base = (float *)malloc(N * sizeof(float)), *other = (float *)malloc(N * sizeof(float));
    dopt_rng r;
    int k;
    /* For independent uniforms the sample correlation has sd 1/sqrt(N) ≈ 0.001; 0.006 is 6 sd. */
    dopt_rng_init(&r, 7, 0, 0);
    dopt_rng_uniform(&r, 0, base, N);
    for (k = 0; k < 4; k++) {
        if (k == 0) dopt_rng_init(&r, 7, 1, 0);     /* next rank */
        if (k == 1) dopt_rng_init(&r, 7, 0, 1);     /* next stream */
        if (k == 2) dopt_rng_init(&r, 8, 0, 0);     /* next seed */
        if (k == 3) dopt_rng_init(&r, 7, 0, 1ull << 32); /* high half of the stream */
        dopt_rng_uniform(&r, 0, other, N);
        DT_CHECKF(fabs(correlation(base, other, N)) < 0.006, "case %d: correlation %g", k, correlation(base, other, N));
        DT_CHECK(memcmp(base, other, 64 * sizeof(float)) != 0);
    }
    /* and neighbouring elements of one stream */
    DT_CHECK(fabs(correlation(base, base + 1, N - 1)) < 0.006);
    free(base);
    free(other);
}

DTEST(rng_uniform_passes_chi_square) {
    enum { N = 1 << 21, BINS = 128 };
    float *x = (float *)malloc(N * sizeof(float));
    double chi2 = 0, expect = (double)N / BINS, lo = 1, hi = 0;
    long counts[BINS] = {0};
    dopt_rng r;
    size_t i;
    dopt_rng_init(&r, 2024, 0, 0);
    dopt_rng_uniform(&r, 0, x, N);
    for (i = 0; i < N; i++) {
        int bin = (int)(x[i] * BINS);
        counts[bin]++;
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
    }
    for (i = 0; i < BINS; i++) chi2 += (counts[i] - expect) * (counts[i] - expect) / expect;
    /* 127 degrees of freedom: mean 127, sd 15.9; 200 is beyond the 0.9999 quantile (≈ 193). */
    DT_CHECKF(chi2 < 200, "chi-square %g over %d bins", chi2, BINS);
    DT_CHECK(lo >= 0.0 && hi < 1.0);
    free(x);
}

DTEST(seed_for_rank_gives_distinct_seeds) {
    uint64_t seen[1024];
    int i, j;
    for (i = 0; i < 1024; i++) {
        seen[i] = dopt_seed_for_rank(99, i);
        for (j = 0; j < i; j++) DT_CHECK(seen[i] != seen[j]);
    }
    DT_CHECK(dopt_seed_for_rank(99, 0) != dopt_seed_for_rank(100, 0));
}

/* ------------------------------------------------------------------ kernels against double references */

static const size_t kernel_lengths[] = {0, 1, 7, 16, 17, 1000003};

/* Deterministic test data with mixed signs and magnitudes, at an odd address (offset 1 float). */
static float *make_data(size_t n, uint64_t seed, float **block) {
    dopt_rng r;
    size_t i;
    *block = (float *)malloc((n + 1) * sizeof(float));
    dopt_rng_init(&r, seed, 0, 0);
    dopt_rng_uniform(&r, 0, *block + 1, n);
    for (i = 0; i < n; i++) (*block)[i + 1] = ((*block)[i + 1] - 0.5f) * (float)(1 + i % 13);
    return *block + 1;
}

DTEST(sumsq_and_dot_match_double_reference) {
    size_t k;
    for (k = 0; k < sizeof kernel_lengths / sizeof *kernel_lengths; k++) {
        size_t n = kernel_lengths[k], i;
        float *bx, *by, *x = make_data(n, 1, &bx), *y = make_data(n, 2, &by);
        long double ss = 0, dot = 0;
        for (i = 0; i < n; i++) ss += (long double)x[i] * x[i], dot += (long double)x[i] * y[i];
        DT_NEAR(dopt_sumsq(x, n), (double)ss, 1e-12 * (double)ss + 1e-300);
        DT_NEAR(dopt_dot(x, y, n), (double)dot, 1e-12 * (double)ss + 1e-300);
        free(bx);
        free(by);
    }
}

DTEST(axpy_and_scale_match_reference) {
    size_t k;
    for (k = 0; k < sizeof kernel_lengths / sizeof *kernel_lengths; k++) {
        size_t n = kernel_lengths[k], i;
        float *bx, *by, *x = make_data(n, 3, &bx), *y = make_data(n, 4, &by);
        float *y0 = (float *)malloc((n + 1) * sizeof(float));
        memcpy(y0, y, n * sizeof(float));
        dopt_axpy(y, -0.75f, x, n);
        for (i = 0; i < n; i++) DT_CHECK(y[i] == (float)(y0[i] + -0.75f * x[i]) || fabsf(y[i] - (y0[i] - 0.75f * x[i])) <= 1e-6f * (1 + fabsf(y[i])));
        memcpy(y, y0, n * sizeof(float));
        dopt_scale(y, 3.5f, n);
        for (i = 0; i < n; i++) DT_CHECK(y[i] == y0[i] * 3.5f);
        free(bx);
        free(by);
        free(y0);
    }
}

/* Every kernel with more than one implementation: each against the portable loop it replaces. */
DTEST(vector_and_blas_kernels_match_portable_loops) {
    size_t k;
    for (k = 0; k < sizeof kernel_lengths / sizeof *kernel_lengths; k++) {
        size_t n = kernel_lengths[k], i;
        float *bx, *by, *x = make_data(n, 7, &bx), *y = make_data(n, 8, &by);
        float *y1 = (float *)malloc((n + 1) * sizeof(float)), *y2 = (float *)malloc((n + 1) * sizeof(float));
        double ss = dopt__sumsq_portable(x, n), s1, s2, t1, t2;
        DT_NEAR(dopt_sumsq(x, n), ss, 1e-13 * ss);
        DT_NEAR(dopt_dot(x, y, n), dopt__dot_portable(x, y, n), 1e-12 * (ss + dopt_sumsq(y, n)));
        dopt__shifted_sums_portable(x, n, 0.25, &s1, &s2);
        DOPT__SHIFTED_SUMS(x, n, 0.25, &t1, &t2);
        DT_NEAR(t1, s1, 1e-12 * s2 + 1e-300);
        DT_NEAR(t2, s2, 1e-13 * s2 + 1e-300);
        memcpy(y1, y, n * sizeof(float));
        memcpy(y2, y, n * sizeof(float));
        dopt_axpy(y1, 0.3f, x, n);
        dopt__axpy_portable(y2, 0.3f, x, n);
        for (i = 0; i < n; i++) DT_NEAR(y1[i], y2[i], 1e-6 * (1 + fabs(y2[i]))); /* FMA or not */
        dopt_scale(y1, -1.5f, n);
        dopt__scale_portable(y2, -1.5f, n);
        for (i = 0; i < n; i++) DT_NEAR(y1[i], y2[i], 1e-6 * (1 + fabs(y2[i])));
        free(bx);
        free(by);
        free(y1);
        free(y2);
    }
}

DTEST(maxabs_matches_reference_and_skips_nan) {
    size_t k;
    for (k = 0; k < sizeof kernel_lengths / sizeof *kernel_lengths; k++) {
        size_t n = kernel_lengths[k], i;
        float *bx, *x = make_data(n, 5, &bx), m = 0;
        for (i = 0; i < n; i++) m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
        DT_CHECK(dopt_maxabs(x, n) == m);
        if (n > 3) {
            x[n / 2] = -1e30f; /* the extreme sits in the middle, negative */
            DT_CHECK(dopt_maxabs(x, n) == 1e30f);
            x[1] = NAN;
            DT_CHECK(dopt_maxabs(x, n) == 1e30f);
        }
        free(bx);
    }
    DT_CHECK(dopt_maxabs(NULL, 0) == 0.0f);
}

DTEST(mean_var_match_two_pass_reference) {
    size_t k;
    for (k = 0; k < sizeof kernel_lengths / sizeof *kernel_lengths; k++) {
        size_t n = kernel_lengths[k], i;
        float *bx, *x = make_data(n, 6, &bx);
        long double mean = 0, var = 0;
        double m, v;
        if (n == 0) {
            dopt_mean_var(x, n, &m, &v);
            DT_CHECK(m == 0 && v == 0);
            free(bx);
            continue;
        }
        for (i = 0; i < n; i++) x[i] += 1e4f; /* a large mean: the one-pass trap */
        for (i = 0; i < n; i++) mean += x[i];
        mean /= n;
        for (i = 0; i < n; i++) var += (x[i] - mean) * (x[i] - mean);
        var /= n;
        dopt_mean_var(x, n, &m, &v);
        DT_NEAR(m, (double)mean, 1e-12 * 1e4);
        DT_NEAR(v, (double)var, 1e-9 * (double)var + 1e-12);
        free(bx);
    }
}

DTEST(sumsq_is_accurate_for_1e8_elements_and_near_flt_max) {
    size_t n = 100000000, i;
    float *x = (float *)malloc(n * sizeof(float)), big[3] = {FLT_MAX, -FLT_MAX, 1.0f};
    double want;
    /* 0.1f squared summed 1e8 times: a float accumulator stalls near 2^24 ulp steps and is off by
       tens of percent; double accumulation is within 1e-12. */
    for (i = 0; i < n; i++) x[i] = 0.1f;
    want = (double)0.1f * (double)0.1f * (double)n;
    DT_NEAR(dopt_sumsq(x, n), want, 1e-10 * want);
    free(x);
    want = 2.0 * (double)FLT_MAX * (double)FLT_MAX + 1.0;
    DT_CHECK(isfinite(dopt_sumsq(big, 3)));
    DT_NEAR(dopt_sumsq(big, 3), want, 1e-15 * want);
}

DTEST(all_finite_finds_every_nan_and_inf) {
    float x[67];
    size_t pos, k;
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    for (pos = 0; pos < 67; pos++) x[pos] = (float)pos - 30.0f;
    DT_CHECK(dopt_all_finite(x, 67));
    DT_CHECK(dopt_all_finite(NULL, 0));
    for (k = 0; k < 3; k++)
        for (pos = 0; pos < 67; pos++) {
            float keep = x[pos];
            x[pos] = bad[k];
            DT_CHECKF(!dopt_all_finite(x, 67), "value %d at %zu not found", (int)k, pos);
            x[pos] = keep;
        }
    x[0] = FLT_MAX;
    x[1] = -FLT_MAX;
    x[2] = FLT_MIN / 2; /* subnormal */
    DT_CHECK(dopt_all_finite(x, 67));
    /* lanes keep the largest exponent field: exponents whose bits together make all ones, in one
       lane of different blocks, are still finite */
    x[3] = 1.7e38f;    /* exponent field 0x7F000000 */
    x[3 + 16] = 1.2e-38f; /* 0x00800000 */
    x[3 + 32] = 2.0f;
    DT_CHECK(dopt_all_finite(x, 67));
}

/* dopt_copy_finite copies every element bit for bit and gives dopt_all_finite's verdict, at every
   length to 200 from unaligned pointers, a NaN or an infinity at every place. */
DTEST(copy_finite_copies_and_finds_every_nan_and_inf) {
    float src[202], dst[202];
    unsigned char past[sizeof(float)];
    size_t n, pos;
    memset(src, 0, sizeof src);
    memset(past, 0xAB, sizeof past);
    for (n = 0; n <= 200; n++) {
        for (pos = 0; pos < n; pos++) src[1 + pos] = (float)pos * 0.37f - 20.0f;
        memset(dst, 0xAB, sizeof dst);
        DT_CHECK(dopt_copy_finite(dst + 1, src + 1, n) == 1);
        DT_CHECKF(memcmp(dst + 1, src + 1, n * sizeof(float)) == 0 && memcmp(dst + 1 + n, past, sizeof past) == 0,
                  "length %zu: not copied, or written past the end", n);
        for (pos = 0; pos < n; pos += 1 + pos / 8) {
            float keep = src[1 + pos];
            src[1 + pos] = pos % 2 ? NAN : -INFINITY;
            DT_CHECKF(dopt_copy_finite(dst + 1, src + 1, n) == 0, "length %zu: non-finite at %zu not found", n, pos);
            DT_CHECK(memcmp(dst + 1, src + 1, n * sizeof(float)) == 0);
            src[1 + pos] = keep;
        }
    }
}

DTEST(reduce_every_dtype_and_op) {
    float f[3] = {1, -2, 3}, fs[3] = {4, 5, -6};
    double d[2] = {1.5, -1}, ds[2] = {-2, 2};
    int32_t i32[2] = {INT32_MAX - 1, -5}, i32s[2] = {1, 7};
    int64_t i64[2] = {((int64_t)1 << 40), -1}, i64s[2] = {1, -((int64_t)1 << 40)};
    dopt_reduce(f, fs, 3, DOPT_F32, DOPT_SUM);
    DT_CHECK(f[0] == 5 && f[1] == 3 && f[2] == -3);
    dopt_reduce(f, fs, 3, DOPT_F32, DOPT_MAX);
    DT_CHECK(f[0] == 5 && f[1] == 5 && f[2] == -3);
    dopt_reduce(f, fs, 3, DOPT_F32, DOPT_MIN);
    DT_CHECK(f[0] == 4 && f[1] == 5 && f[2] == -6);
    dopt_reduce(f, fs, 3, DOPT_F32, DOPT_MEAN); /* reduces as a sum */
    DT_CHECK(f[0] == 8 && f[1] == 10 && f[2] == -12);
    dopt_reduce(d, ds, 2, DOPT_F64, DOPT_MIN);
    DT_CHECK(d[0] == -2 && d[1] == -1);
    dopt_reduce(i32, i32s, 2, DOPT_I32, DOPT_SUM);
    DT_CHECK(i32[0] == INT32_MAX && i32[1] == 2);
    dopt_reduce(i64, i64s, 2, DOPT_I64, DOPT_MAX);
    DT_CHECK(i64[0] == ((int64_t)1 << 40) && i64[1] == -1);
    DT_EQ_INT(dopt_dtype_size(DOPT_I64), 8);
    DT_EQ_INT(dopt_dtype_size((dopt_dtype)9), 0);
}

/* ------------------------------------------------------------------ self backend and the comm core */

typedef struct log_capture {
    int calls;
    char last[DOPT_DETAIL_MAX];
} log_capture;

static void capture_log(void *user, dopt_log_level level, const char *msg) {
    log_capture *lc = (log_capture *)user;
    (void)level;
    lc->calls++;
    snprintf(lc->last, sizeof lc->last, "%s", msg);
}

DTEST(self_backend_collectives_are_identities) {
    dopt_comm *c;
    float f[5] = {1, 2, 3, 4, 5};
    int64_t i64[2] = {-7, 9};
    char send[6] = "hello", recv[6] = {0};
    size_t sizes[1];
    DT_OK(dopt_comm_create_self(&c));
    DT_EQ_INT(c->rank, 0);
    DT_EQ_INT(c->size, 1);
    DT_OK(dopt_allreduce(c, f, 5, DOPT_F32, DOPT_SUM));
    DT_OK(dopt_allreduce(c, f, 5, DOPT_F32, DOPT_MEAN));
    DT_OK(dopt_allreduce(c, i64, 2, DOPT_I64, DOPT_MIN));
    DT_CHECK(f[0] == 1 && f[4] == 5 && i64[0] == -7 && i64[1] == 9);
    DT_OK(dopt_allreduce_weighted_mean(c, f, 5, DOPT_F32, 3.0));
    DT_CHECK(f[0] == 1 && f[4] == 5);
    DT_OK(dopt_allgather(c, send, recv, 6));
    DT_CHECK(strcmp(recv, "hello") == 0);
    memset(recv, 0, sizeof recv);
    DT_OK(dopt_allgatherv(c, send, 3, recv, sizeof recv, sizes));
    DT_CHECK(sizes[0] == 3 && memcmp(recv, "hel", 3) == 0 && recv[3] == 0);
    DT_OK(dopt_broadcast(c, f, sizeof f, 0));
    DT_OK(dopt_barrier(c));
    DT_OK(dopt_allreduce(c, NULL, 0, DOPT_F64, DOPT_MAX)); /* zero-length calls are legal */
    DT_OK(dopt_allgather(c, NULL, NULL, 0));
    DT_OK(dopt_broadcast(c, NULL, 0, 0));
    DT_CHECK(c->seq > 0 && c->error == DOPT_OK);
    dopt_comm_destroy(c);
    dopt_comm_destroy(NULL);
}

DTEST(self_backend_passes_conformance) {
    dopt_comm *c;
    DT_OK(dopt_comm_create_self(&c));
    conformance_run(c);
    dopt_comm_destroy(c);
}

DTEST(bad_arguments_poison_with_detail) {
    dopt_comm *c;
    float f[2] = {1, 2};
    log_capture lc;
    memset(&lc, 0, sizeof lc);
    DT_OK(dopt_comm_create_self(&c));
    dopt_comm_set_log(c, capture_log, &lc);
    DT_OK(dopt_allreduce(c, f, 2, DOPT_F32, DOPT_SUM));
    DT_EQ_INT(dopt_allreduce(c, NULL, 4, DOPT_F32, DOPT_SUM), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 0: allreduce #2 (f32 sum, 4 elems)") != NULL, "detail: %s",
              dopt_comm_detail(c));
    DT_EQ_INT(lc.calls, 1);
    DT_CHECK(strcmp(lc.last, dopt_comm_detail(c)) == 0);
    /* poisoned: later calls fail fast with the same status and the first detail */
    DT_EQ_INT(dopt_barrier(c), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_allreduce(c, f, 2, DOPT_F32, DOPT_SUM), DOPT_ERR_INVALID);
    DT_CHECK(strstr(dopt_comm_detail(c), "allreduce #2") != NULL);
    /* only the collective that completed is counted */
    DT_CHECK(c->traffic.calls[DOPT_COLL_ALLREDUCE] == 1 && dopt_comm_traffic_total(c) == 8);
    dopt_comm_destroy(c);

    DT_OK(dopt_comm_create_self(&c));
    DT_EQ_INT(dopt_allreduce(c, f, 2, (dopt_dtype)17, DOPT_SUM), DOPT_ERR_INVALID);
    dopt_comm_destroy(c);
    DT_OK(dopt_comm_create_self(&c));
    DT_EQ_INT(dopt_allreduce(c, f, 2, DOPT_F32, (dopt_op)17), DOPT_ERR_INVALID);
    dopt_comm_destroy(c);
    DT_OK(dopt_comm_create_self(&c));
    DT_EQ_INT(dopt_broadcast(c, f, 8, 1), DOPT_ERR_INVALID);
    DT_CHECK(strstr(dopt_comm_detail(c), "root 1") != NULL);
    dopt_comm_destroy(c);
    DT_OK(dopt_comm_create_self(&c));
    DT_EQ_INT(dopt_allgatherv(c, f, 8, f, 4, (size_t[1]){0}), DOPT_ERR_INVALID);
    DT_CHECK(strstr(dopt_comm_detail(c), "can receive 4") != NULL);
    dopt_comm_destroy(c);
    DT_OK(dopt_comm_create_self(&c));
    DT_EQ_INT(dopt_allreduce_weighted_mean(c, f, 2, DOPT_F32, 0.0), DOPT_ERR_INVALID);
    dopt_comm_destroy(c);
    DT_EQ_INT(dopt_allreduce(NULL, f, 2, DOPT_F32, DOPT_SUM), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_comm_new(&c, 2, 2, NULL, NULL), DOPT_ERR_INVALID);
}

DTEST(library_is_silent_without_a_log_callback) {
    dopt_comm *c;
    int fds[2], saved_out = dup(1), saved_err = dup(2);
    char buf[64];
    ssize_t got;
    DT_CHECK(pipe(fds) == 0);
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    DT_OK(dopt_comm_create_self(&c));
    (void)dopt_allreduce(c, NULL, 4, DOPT_F32, DOPT_SUM);
    (void)dopt_barrier(c);
    dopt_comm_destroy(c);
    fflush(stdout);
    fflush(stderr);
    dup2(saved_out, 1);
    dup2(saved_err, 2);
    close(fds[1]);
    got = read(fds[0], buf, sizeof buf);
    DT_EQ_INT(got, 0);
}

/* A backend that reports a mismatch the way a transport would, to check the detail's wording. */
static dopt_status mismatching_allreduce(dopt_comm *c, const dopt_coll_desc *d, void *buf) {
    dopt_coll_desc theirs = *d;
    (void)buf;
    theirs.count = d->count + 1;
    theirs.op = DOPT_MAX;
    return dopt_comm_fail_mismatch(c, d, &theirs, 3);
}
static dopt_status silent_failure(dopt_comm *c, const dopt_coll_desc *d) {
    (void)c;
    (void)d;
    return DOPT_ERR_PEER_LOST;
}
static void nothing_to_destroy(dopt_comm *c) { (void)c; }

DTEST(mismatch_detail_names_both_sides) {
    dopt_comm_vtable vt;
    dopt_comm *c;
    float f[4] = {0};
    memset(&vt, 0, sizeof vt);
    vt.name = "mock";
    vt.allreduce = mismatching_allreduce;
    vt.barrier = silent_failure;
    vt.destroy = nothing_to_destroy;
    DT_OK(dopt_comm_new(&c, 1, 4, &vt, NULL));
    DT_EQ_INT(dopt_allreduce(c, f, 4, DOPT_F32, DOPT_SUM), DOPT_ERR_MISMATCH);
    DT_CHECKF(strcmp(dopt_comm_detail(c),
                     "rank 1: allreduce #1 (f32 sum, 4 elems): rank 3 called allreduce #1 (f32 max, 5 elems)") == 0,
              "detail: %s", dopt_comm_detail(c));
    dopt_comm_destroy(c);
    DT_OK(dopt_comm_new(&c, 0, 2, &vt, NULL));
    DT_EQ_INT(dopt_barrier(c), DOPT_ERR_PEER_LOST); /* a backend that forgot the detail still gets one */
    DT_CHECK(strstr(dopt_comm_detail(c), "barrier #1") != NULL);
    dopt_comm_destroy(c);
}

DTEST(fingerprint_separates_collectives) {
    dopt_coll_desc a, b;
    memset(&a, 0, sizeof a);
    a.kind = DOPT_COLL_ALLREDUCE;
    a.count = 10;
    b = a;
    DT_CHECK(dopt_coll_fingerprint(&a) == dopt_coll_fingerprint(&b));
    b.seq = 99; /* the sequence number is compared separately */
    DT_CHECK(dopt_coll_fingerprint(&a) == dopt_coll_fingerprint(&b));
    b = a, b.count = 11;
    DT_CHECK(dopt_coll_fingerprint(&a) != dopt_coll_fingerprint(&b));
    b = a, b.op = DOPT_MAX;
    DT_CHECK(dopt_coll_fingerprint(&a) != dopt_coll_fingerprint(&b));
    b = a, b.dtype = DOPT_F64;
    DT_CHECK(dopt_coll_fingerprint(&a) != dopt_coll_fingerprint(&b));
    b = a, b.kind = DOPT_COLL_BROADCAST;
    DT_CHECK(dopt_coll_fingerprint(&a) != dopt_coll_fingerprint(&b));
    b = a, b.root = 1;
    DT_CHECK(dopt_coll_fingerprint(&a) != dopt_coll_fingerprint(&b));
}

/* ------------------------------------------------------------------ the ordered worker */

typedef struct worker_job {
    int *log, *n, id;
    dopt_status status;
} worker_job;

static dopt_status worker_record(void *arg) {
    worker_job *j = (worker_job *)arg;
    struct timespec ts = {0, 200000}; /* long enough that later posts queue behind it */
    if (j->id == 0) nanosleep(&ts, NULL);
    j->log[(*j->n)++] = j->id;
    return j->status;
}

/* Jobs run in post order, one at a time; each ticket gives its own job's status; waiting on a
   later ticket finishes the earlier ones; more jobs than the queue holds make post wait. */
DTEST(ordered_worker_runs_jobs_in_post_order) {
    enum { JOBS = 40 };
    dopt__worker *w;
    worker_job jobs[JOBS];
    uint64_t tickets[JOBS];
    int log[JOBS], n = 0, i, done;
    DT_EQ_INT(dopt__worker_new(&w, 0), DOPT_ERR_INVALID);
    DT_OK(dopt__worker_new(&w, 8));
    for (i = 0; i < JOBS; i++) {
        jobs[i].log = log;
        jobs[i].n = &n;
        jobs[i].id = i;
        jobs[i].status = i % 7 == 3 ? DOPT_ERR_NONFINITE : DOPT_OK;
        DT_OK(dopt__worker_post(w, worker_record, &jobs[i], &tickets[i]));
        DT_EQ_INT(tickets[i], i + 1);
    }
    DT_EQ_INT(dopt__worker_wait(w, tickets[JOBS - 2]), jobs[JOBS - 2].status);
    DT_EQ_INT(dopt__worker_test(w, tickets[JOBS - 3], &done), jobs[JOBS - 3].status);
    DT_CHECK(done);
    DT_EQ_INT(dopt__worker_wait(w, tickets[JOBS - 1]), jobs[JOBS - 1].status);
    DT_EQ_INT(n, JOBS);
    for (i = 0; i < JOBS; i++) DT_EQ_INT(log[i], i);
    for (i = JOBS - 8; i < JOBS; i++) DT_EQ_INT(dopt__worker_wait(w, tickets[i]), jobs[i].status);
    dopt__worker_free(w);
    /* free runs what is queued */
    n = 0;
    DT_OK(dopt__worker_new(&w, 4));
    for (i = 0; i < 3; i++) DT_OK(dopt__worker_post(w, worker_record, &jobs[i], &tickets[i]));
    dopt__worker_free(w);
    DT_EQ_INT(n, 3);
}

DTEST_MAIN()
