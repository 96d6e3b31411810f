/* Tests of compress.h: TernGrad exactly as DESIGN §5.1 (against a slow reference in double),
   its unbiasedness and variance bound, the 2-bit packing, determinism of the random rounding,
   scale sharing, QSGD, top-k, sign, fp16/bf16 rounding against references, error feedback, the
   wire-format validator against crafted bytes, state save/load, and the compressed allreduce
   over real worlds of 2-4 processes on every transport of worlds.h (shared memory direct and on
   the engine, TCP).

   Statistical tests use a fixed seed and a bound whose confidence is stated beside it. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../compress.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "dtest.h"
#include "worlds.h"

#include <float.h>

/* ------------------------------------------------------------------ helpers */

/* Deterministic test data: a Gaussian-ish mix with a few large outliers, from a 64-bit LCG. */
static uint64_t lcg_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}

static double lcg_unit(uint64_t *s) { return (double)lcg_next(s) / 9007199254740992.0; }

static void fill_grad(float *g, size_t n, uint64_t seed) {
    size_t i;
    uint64_t s = seed * 2654435761u + 1;
    for (i = 0; i < n; i++) {
        double v = lcg_unit(&s) + lcg_unit(&s) + lcg_unit(&s) - 1.5;
        if (lcg_next(&s) % 97 == 0) v *= 8.0; /* outliers that the c·σ clip cuts */
        g[i] = (float)(v * 1e-2);
    }
}

/* The suite also builds with -Ofast and with -ffast-math, under which the compiler may fold
   x != x, give either sign to a zero (-fno-signed-zeros), and contract, reassociate or take
   reciprocals differently in the library's loops and in a test's reference; the FPU flushes
   subnormal floats to zero. Hence NaN is told by its bits (dopt__is_nan), and: */

/* a and b are the same float: bit for bit, but for the sign of a zero in a -ffast-math build. */
static int same_bits(float a, float b) {
    uint32_t u = dopt__f32_bits(a), v = dopt__f32_bits(b);
#ifdef __FAST_MATH__
    if (((u | v) & 0x7FFFFFFFu) == 0) return 1;
#endif
    return u == v;
}

/* The same as a value computed in double by a test's reference: bit for bit in a strict build,
   within 2^-20 relative in a -ffast-math one. */
#ifdef __FAST_MATH__
#define REF_TOL (1.0 / 1048576.0)
#else
#define REF_TOL 0.0
#endif
static int same_as_ref(float a, float b) {
    return same_bits(a, b) || fabs((double)a - (double)b) <= REF_TOL * (fabs((double)a) + fabs((double)b));
}

/* A double equal to another bit for bit (either sign of zero under -ffast-math): comparisons
   with infinity may be folded there too. */
static int same_double(double a, double b) {
    uint64_t u, v;
    memcpy(&u, &a, 8);
    memcpy(&v, &b, 8);
#ifdef __FAST_MATH__
    if (((u | v) & 0x7FFFFFFFFFFFFFFFull) == 0) return 1;
#endif
    return u == v;
}

/* A float's value as a double, from its bits: the FPU's conversion flushes a subnormal float to
   zero in a -Ofast build. */
static double f32_exact(float f) {
    uint32_t u = dopt__f32_bits(f), e = (u >> 23) & 0xFFu, m = u & 0x7FFFFFu;
    double v = e == 0 ? ldexp((double)m, -149) : ldexp((double)(m | 0x800000u), (int)e - 150);
    if (e == 0xFFu) v = m ? NAN : INFINITY;
    return u >> 31 ? -v : v;
}

static dopt_compressor_config config_of(dopt_codec codec) {
    dopt_compressor_config c;
    memset(&c, 0, sizeof c);
    c.codec = codec;
    c.seed = 42;
    return c;
}

static void init_one_segment(dopt_compressor *cz, dopt_compressor_config *cfg, size_t n) {
    dopt_segment seg;
    seg.offset = 0;
    seg.count = n;
    seg.name = NULL;
    DT_OK(dopt_compressor_init(cz, cfg, &seg, 1));
}

/* Encodes g (one flat segment table from cz) and decodes the message with weight 1 into out. */
static void encode_decode(dopt_compressor *cz, float *g, size_t n, unsigned char *msg, float *out) {
    dopt_buf in = dopt_buf_flat(g, n, cz->segs, cz->nsegs), acc = dopt_buf_flat(out, n, cz->segs, cz->nsegs);
    size_t bytes = 0;
    memset(out, 0, n * sizeof(float));
    DT_OK(dopt_compress_encode(cz, &in, msg, dopt_compress_bound(cz), &bytes));
    DT_EQ_INT(bytes, dopt_compress_bound(cz));
    DT_OK(dopt_compress_decode(cz, msg, bytes, 1.0f, &acc));
}

/* The codes of a message's first ternary segment by the documented rule, read independently:
   block of m elements, q = ceil(m/4) bytes, element t at byte t % q, bits 2·(t / q). */
static int ref_code(const unsigned char *packed, size_t i, size_t n) {
    size_t block = i / 64, t = i % 64, m = n - block * 64 < 64 ? n - block * 64 : 64, q = (m + 3) / 4;
    unsigned code = (packed[block * 16 + t % q] >> (2 * (t / q))) & 3u;
    return code == 1 ? 1 : (code == 2 ? -1 : (code == 0 ? 0 : 99));
}

/* ------------------------------------------------------------------ 2-bit packing */

/* Whole arrays from the library's block functions, as its encoders and decoders use them; the
   full 2-bit block is read here the plain way (the library's decoder fuses it with the add). */
static void unpack2_full(const uint8_t *DOPT_RESTRICT in, uint8_t *DOPT_RESTRICT c) {
    int j, r;
    for (r = 0; r < 4; r++)
        for (j = 0; j < 16; j++) c[16 * r + j] = (uint8_t)((in[j] >> (2 * r)) & 3u);
}

static void pack_codes(const uint8_t *codes, size_t count, unsigned w, uint8_t *out) {
    size_t i, full = count - count % DOPT__BLOCK, qf = dopt__block_bytes(DOPT__BLOCK, w);
    for (i = 0; i < full; i += DOPT__BLOCK, out += qf) { /* the fast full-block packers */
        if (w == 1)
            dopt__pack1_full(codes + i, out);
        else if (w == 2)
            dopt__pack2_full(codes + i, out);
        else
            dopt__pack4_full(codes + i, out);
    }
    if (count > full) dopt__pack_block(codes + full, count - full, w, out);
}

static unsigned unpack_codes(const uint8_t *in, size_t count, unsigned w, uint8_t *codes) {
    size_t i, full = count - count % DOPT__BLOCK, qf = dopt__block_bytes(DOPT__BLOCK, w);
    unsigned bad = 0;
    for (i = 0; i < full; i += DOPT__BLOCK, in += qf) {
        if (w == 2)
            unpack2_full(in, codes + i);
        else
            bad |= dopt__unpack_block(in, DOPT__BLOCK, w, codes + i);
    }
    if (count > full) bad |= dopt__unpack_block(in, count - full, w, codes + full);
    return bad;
}


DTEST(pack_unpack_round_trip_every_length_0_to_67_and_large) {
    static const unsigned widths[3] = {1, 2, 4};
    static uint8_t codes[100003], back[100003], packed[60000];
    size_t lens[69], nl = 0, l, i;
    int w;
    uint64_t s = 7;
    for (l = 0; l <= 67; l++) lens[nl++] = l;
    lens[nl++] = 100003;
    for (w = 0; w < 3; w++) { /* the generic block packer on full blocks too */
        uint8_t a[32], b[32];
        for (i = 0; i < 64; i++) codes[i] = (uint8_t)(lcg_next(&s) & ((1u << widths[w]) - 1u));
        dopt__pack_block(codes, 64, widths[w], a);
        pack_codes(codes, 64, widths[w], b);
        DT_CHECKF(memcmp(a, b, 8 * widths[w]) == 0, "width %u: the full-block packer differs", widths[w]);
    }
    for (w = 0; w < 3; w++)
        for (l = 0; l < nl; l++) {
            size_t n = lens[l], bytes = dopt__packed_bytes(n, widths[w]);
            DT_EQ_INT(bytes, (n * widths[w] + 7) / 8 + (n / 64) * 0);
            for (i = 0; i < n; i++) codes[i] = (uint8_t)(lcg_next(&s) & ((1u << widths[w]) - 1u));
            memset(packed, 0xAB, sizeof packed);
            pack_codes(codes, n, widths[w], packed);
            DT_CHECKF(packed[bytes] == 0xAB, "width %u length %zu wrote past its %zu bytes", widths[w], n, bytes);
            memset(back, 0xFF, n);
            DT_EQ_INT(unpack_codes(packed, n, widths[w], back), 0);
            DT_CHECKF(memcmp(codes, back, n) == 0, "width %u length %zu does not round-trip", widths[w], n);
            if (widths[w] == 2)
                for (i = 0; i < n; i++) {
                    int c = ref_code(packed, i, n);
                    DT_CHECKF((c == 1 && codes[i] == 1) || (c == -1 && codes[i] == 2) || (c == 0 && codes[i] == 0) ||
                                  (codes[i] == 3 && c == 99),
                              "length %zu element %zu is not where the documented layout puts it", n, i);
                }
        }
}

DTEST(unpack_reports_set_unused_bits) {
    uint8_t codes[5] = {1, 2, 1, 0, 2}, packed[2], back[5];
    pack_codes(codes, 5, 2, packed); /* 10 bits of 16 */
    DT_EQ_INT(unpack_codes(packed, 5, 2, back), 0);
    packed[1] |= 0x80;
    DT_CHECK(unpack_codes(packed, 5, 2, back) != 0);
}

/* ------------------------------------------------------------------ random words */

/* ------------------------------------------------------------------ ternary */

/* The AVX-512 block kernels against the portable loops beside them, on random blocks with
   clipping bounds inside and outside the data's range, and every code including 11. */
DTEST(ternary_vector_blocks_match_portable) {
#ifdef DOPT__COMPRESS_AVX512
    uint64_t s = 3;
    int trial, j, nties = 0;
    for (trial = 0; trial < 20000; trial++) {
        float x[64], y1[64], y2[64], bound = trial % 3 == 0 ? FLT_MAX : (float)lcg_unit(&s);
        float k = dopt__tern_k((float)lcg_unit(&s) + 0.01f);
        uint32_t r[64];
        uint8_t c[64], p1[16], p2[16];
        uint64_t ties1, ties2;
        for (j = 0; j < 64; j++) {
            x[j] = (float)(lcg_unit(&s) * 2 - 1);
            r[j] = (uint32_t)lcg_next(&s);
            y1[j] = y2[j] = (float)lcg_unit(&s);
        }
        if (trial % 7 == 3) { /* -0, and |g| = s (A = 2^24 or just above: always kept) */
            x[5] = -0.0f;
            x[6] = (float)(16777216.0 / k);
            x[7] = -x[6];
        }
        if (trial % 5 == 1) /* words whose bytes tie with A's high part */
            for (j = 0; j < 64; j++) {
                float g = x[j] > bound ? bound : (x[j] < -bound ? -bound : x[j]);
                uint32_t hi = (uint32_t)ceilf(fabsf(g) * k) >> 16;
                if (lcg_next(&s) % 2) r[j / 4] = (r[j / 4] & ~(0xFFu << (8 * (j % 4)))) | (hi & 0xFFu) << (8 * (j % 4));
            }
        ties1 = dopt__tern_codes(x, r, 64, bound, k, c);
        dopt__pack2_full(c, p1);
        ties2 = dopt__tern_block_avx512(x, r, bound, k, p2);
        DT_CHECK(memcmp(p1, p2, 16) == 0);
        DT_CHECK(ties1 == ties2);
        nties += ties1 != 0;
        for (j = 0; j < 16; j++) p1[j] = (uint8_t)lcg_next(&s); /* any bytes, 11 included */
        if (trial % 4 == 0) y1[trial % 64] = y2[trial % 64] = -0.0f;
        DT_EQ_INT(dopt__tern_accum_full(y1, trial % 2 ? 0.37f : -0.37f, p1) != 0,
                  dopt__tern_accum_avx512(y2, trial % 2 ? 0.37f : -0.37f, p1) != 0);
        for (j = 0; j < 64; j++)
            if (((p1[j % 16] >> (2 * (j / 16))) & 3) != 3) DT_CHECK(same_bits(y1[j], y2[j])); /* -0 too */
    }
    DT_CHECKF(nties > 1000, "only %d blocks with ties", nties);
#else
    DT_SKIP("this build has no AVX-512 kernels (built for a CPU without AVX-512)");
#endif
}

/* The tie words of a batch, sixteen Philox blocks with their own counters in one AVX-512
   pass, against one scalar block each (dopt_rng_u32 of word 2^63 + e), for batches of 1 to
   16 and indices whose block counter carries into its high word. */
DTEST(ternary_tie_words_vector_match_scalar) {
#ifdef DOPT__COMPRESS_AVX512
    uint64_t s = 17, e[16];
    uint32_t a[16], b[16];
    int trial, i;
    dopt_rng rng;
    for (trial = 0; trial < 2000; trial++) {
        int cnt = trial % 16 + 1;
        dopt_rng_init(&rng, lcg_next(&s), trial % 5, lcg_next(&s));
        for (i = 0; i < cnt; i++)
            e[i] = trial % 3 == 0 ? ((uint64_t)1 << 34) - 8 + (lcg_next(&s) % 16) : lcg_next(&s) % 100000000;
        memset(a, 0, sizeof a);
        memset(b, 0, sizeof b);
        dopt__tie_words_avx512(&rng, e, cnt, a);
        dopt__tie_words_portable(&rng, e, cnt, b);
        for (i = 0; i < cnt; i++) {
            uint32_t want;
            dopt_rng_u32(&rng, ((uint64_t)1 << 63) + e[i], &want, 1);
            DT_CHECKF(a[i] == want && b[i] == want, "e %llu: vector %08x, portable %08x, stream %08x",
                      (unsigned long long)e[i], a[i], b[i], want);
        }
    }
#else
    DT_SKIP("this build has no AVX-512 kernels (built for a CPU without AVX-512)");
#endif
}

/* The validator finds a single 2-bit code 11 wherever it sits — in the word-at-a-time part,
   in the leftover bytes and in a tail block — and accepts every valid code. */
DTEST(ternary_check_finds_code_11_anywhere) {
    static const size_t sizes[4] = {64 * 40 + 17, 64 * 16, 64 * 3, 5};
    static uint8_t codes[64 * 40 + 17], packed[(64 * 40 + 17 + 3) / 4];
    uint64_t s = 29;
    size_t z, i;
    for (z = 0; z < 4; z++) {
        size_t n = sizes[z];
        for (i = 0; i < n; i++) codes[i] = (uint8_t)(lcg_next(&s) % 3);
        pack_codes(codes, n, 2, packed);
        DT_EQ_INT(dopt__tern_check(packed, n), 0);
        for (i = 0; i < n; i++) {
            uint8_t keep = codes[i];
            codes[i] = 3;
            pack_codes(codes, n, 2, packed);
            if (dopt__tern_check(packed, n) == 0) {
                DT_CHECKF(0, "n %zu: a code 11 at element %zu passed", n, i);
                break;
            }
            codes[i] = keep;
        }
    }
}

/* The AVX-512 statistics chunk against the portable loop: the same lanes, the same bits; the
   maxima of |x| as bits, NaN and ±inf included. */
DTEST(stats_vector_chunk_matches_portable) {
#ifdef DOPT__COMPRESS_AVX512
    static float x[16 * 64];
    uint64_t s = 5;
    int trial, j;
    for (trial = 0; trial < 200; trial++) {
        float a1[64], a2[64], b1[64], b2[64], shift;
        uint32_t m[64], bm[64];
        size_t chunk = (size_t)(trial % 16) + 1;
        for (j = 0; j < 16 * 64; j++) x[j] = (float)((lcg_unit(&s) * 2 - 1) * (trial % 7 + 1));
        shift = x[0];
        if (trial % 9 == 4) x[trial % 64] = NAN;
        if (trial % 9 == 5) x[trial % 64 + 64] = trial % 2 ? INFINITY : -INFINITY;
        for (j = 0; j < 64; j++) {
            a1[j] = b1[j] = (float)lcg_unit(&s);
            a2[j] = b2[j] = (float)lcg_unit(&s);
            m[j] = bm[j] = (uint32_t)lcg_next(&s) & 0x3FFFFFFFu;
        }
        dopt__stats_chunk_portable(x, chunk, shift, a1, a2, m);
        dopt__stats_chunk_avx512(x, chunk, shift, b1, b2, bm);
        DT_CHECK(memcmp(m, bm, sizeof m) == 0);
#ifdef __FAST_MATH__
        /* the portable loop may be contracted and its sums reordered: each lane agrees within
           the rounding of its terms (2^-18 of the sum of their magnitudes, the start below 1) */
        for (j = 0; j < 64; j++) {
            double t1 = 1.0, t2 = 1.0, d;
            size_t k;
            for (k = 0; k < chunk; k++) {
                d = fabs((double)x[64 * k + (size_t)j] - (double)shift);
                t1 += d;
                t2 += d * d;
            }
            DT_CHECK(same_bits(a1[j], b1[j]) || fabs((double)a1[j] - (double)b1[j]) <= t1 / 262144.0);
            DT_CHECK(same_bits(a2[j], b2[j]) || fabs((double)a2[j] - (double)b2[j]) <= t2 / 262144.0);
        }
#else
        DT_CHECK(memcmp(a1, b1, sizeof a1) == 0 && memcmp(a2, b2, sizeof a2) == 0);
#endif
    }
#else
    DT_SKIP("this build has no AVX-512 kernels (built for a CPU without AVX-512)");
#endif
}

/* The allreduce's integer sum of N messages' codes (AVX-512 with streaming stores for large
   segments, portable loop beside it): bitwise the same floats, and count · v exactly. */
DTEST(ternary_count_sum_vector_matches_portable) {
    static const size_t sizes[6] = {1, 63, 64, 65, 1000, (size_t)1 << 18};
    static uint8_t msgs[5][(((size_t)1 << 18) + 64) / 4];
    static float y1[((size_t)1 << 18) + 64], y2[((size_t)1 << 18) + 64];
    const uint8_t *ptr[5];
    uint64_t s = 9;
    size_t z, i;
    int r, nmsg;
    for (z = 0; z < 6; z++)
        for (nmsg = 1; nmsg <= 5; nmsg += 2) {
            size_t n = sizes[z], bytes = dopt__packed_bytes(n, 2);
            float *yy = y2 + (64 - (uintptr_t)(void *)y2 % 64) % 64 / 4 + (z % 2 ? 0 : 1); /* 64-byte aligned or not */
            for (r = 0; r < nmsg; r++) {
                uint8_t codes[64];
                size_t full = n - n % 64;
                for (i = 0; i < full; i += 64) {
                    size_t j;
                    for (j = 0; j < 64; j++) codes[j] = (uint8_t)(lcg_next(&s) % 3);
                    dopt__pack2_full(codes, msgs[r] + i / 4);
                }
                if (n > full) {
                    for (i = 0; i < n - full; i++) codes[i] = (uint8_t)(lcg_next(&s) % 3);
                    dopt__pack_block(codes, n - full, 2, msgs[r] + full / 4);
                }
                ptr[r] = msgs[r];
            }
            (void)bytes;
            dopt__tern_sum_portable(y1, n, 0.3f, ptr, nmsg);
            dopt__tern_sum(yy, n, 0.3f, ptr, nmsg);
            DT_CHECKF(memcmp(y1, yy, n * sizeof(float)) == 0, "n %zu, %d messages", n, nmsg);
            for (i = 0; i < n; i++) {
                int cnt = 0;
                for (r = 0; r < nmsg; r++) cnt += ref_code(msgs[r], i, n);
                if (y1[i] != (float)cnt * 0.3f) {
                    DT_CHECKF(0, "n %zu element %zu: %g, count %d", n, i, y1[i], cnt);
                    break;
                }
            }
        }
}

/* DESIGN §5.1 steps 1-5 in double, element by element, with the same Philox words. */
static void ternary_reference(const float *g, size_t n, float c, float *scale_out, int *t, uint64_t seed, int rank,
                              uint64_t step, size_t seg) {
    double mean = 0, var = 0, bound = DBL_MAX, s = 0;
    size_t i;
    dopt_rng rng;
    uint32_t *words = (uint32_t *)malloc(((n + 63) / 64 * 16 + 1) * sizeof(uint32_t));
    for (i = 0; i < n; i++) mean += g[i];
    mean /= (double)n;
    for (i = 0; i < n; i++) var += ((double)g[i] - mean) * ((double)g[i] - mean);
    var /= (double)n;
    if (c > 0 && var > 0) bound = (double)(float)(c * sqrt(var));
    for (i = 0; i < n; i++) {
        double a = fabs((double)g[i]) < bound ? fabs((double)g[i]) : bound;
        s = a > s ? a : s;
    }
    *scale_out = (float)s;
    dopt_rng_init(&rng, seed, rank, step << 32 | seg);
    dopt_rng_u32(&rng, 0, words, (n + 63) / 64 * 16);
    for (i = 0; i < n; i++) {
        double gc = g[i] > bound ? bound : (g[i] < -bound ? -bound : (double)g[i]);
        /* keep with probability |gc|/s: a uniform 24-bit u below A = ceil(|gc|·(2^24/s)) (the
           product in float, as the library documents it; 0 below a scale of 1e-30); u's high 8
           bits are byte i mod 4 of word i div 4, its low 16 bits those of word 2^63 + i */
        float k = s > 1e-30f ? (float)(16777216.0 / s) : 0.0f;
        uint32_t A = (uint32_t)ceilf(fabsf((float)gc) * k), low;
        uint32_t h = (words[i / 4] >> (8 * (i % 4))) & 0xFFu;
        int keep;
        dopt_rng_u32(&rng, ((uint64_t)1 << 63) + i, &low, 1);
        keep = ((uint64_t)h << 16 | (low & 0xFFFFu)) < (uint64_t)A;
        t[i] = keep ? (gc < 0 ? -1 : 1) : 0;
    }
    free(words);
}

DTEST(ternary_matches_reference_algorithm) {
    static const size_t sizes[4] = {5000, 64, 67, 1};
    size_t z;
    for (z = 0; z < 4; z++) {
        size_t n = sizes[z], i;
        dopt_compressor cz;
        dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
        float *g = (float *)malloc(n * sizeof(float)), ref_scale, scale;
        int *t = (int *)malloc(n * sizeof(int));
        unsigned char *msg;
        int step;
        cfg.rank = 3;
        fill_grad(g, n, 11 + z);
        init_one_segment(&cz, &cfg, n);
        msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
        for (step = 0; step < 3; step++) {
            dopt_buf in = dopt_buf_flat(g, n, NULL, 0);
            size_t bytes;
            DT_OK(dopt_compress_encode(&cz, &in, msg, dopt_compress_bound(&cz), &bytes));
            ternary_reference(g, n, 2.5f, &ref_scale, t, 42, 3, (uint64_t)step, 0);
            memcpy(&scale, msg + 32 + 12, 4);
            DT_CHECKF(fabs(scale - ref_scale) <= 1e-6 * ref_scale, "n %zu: scale %g, reference %g", n, scale, ref_scale);
            for (i = 0; i < n; i++)
                DT_CHECKF(ref_code(msg + 48, i, n) == t[i], "n %zu step %d element %zu: code %d, reference %d", n, step, i,
                          ref_code(msg + 48, i, n), t[i]);
        }
        dopt_compressor_free(&cz);
        free(g);
        free(t);
        free(msg);
    }
}

DTEST(ternary_clip_bounds_scale_to_c_sigma) {
    size_t n = 10000, i;
    float g[10000], scale, maxabs = 0;
    double mean = 0, var = 0;
    unsigned char *msg;
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    fill_grad(g, n, 5);
    for (i = 0; i < n; i++) mean += g[i];
    mean /= n;
    for (i = 0; i < n; i++) var += (g[i] - mean) * (g[i] - mean);
    var /= n;
    init_one_segment(&cz, &cfg, n);
    msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
    {
        dopt_buf in = dopt_buf_flat(g, n, NULL, 0);
        size_t bytes;
        DT_OK(dopt_compress_encode(&cz, &in, msg, dopt_compress_bound(&cz), &bytes));
    }
    memcpy(&scale, msg + 44, 4);
    for (i = 0; i < n; i++) maxabs = fabsf(g[i]) > maxabs ? fabsf(g[i]) : maxabs;
    DT_CHECK(maxabs > 2.5 * sqrt(var)); /* the outliers are there to be clipped */
    DT_NEAR(scale, 2.5 * sqrt(var), 1e-6 * scale);
    dopt_compressor_free(&cz);
    free(msg);
}

/* Mean of K encodings of g against g itself (clipping off, so s = max|g| and E[s·t] = g).
   Per element, s·t lies in [-s, s]; Hoeffding gives P(|mean - g| >= eps) <= 2 exp(-K eps² / 2s²),
   so eps = s·sqrt(2 ln(2d/δ)/K) holds for all d elements with probability 1 - δ, δ = 1e-9.
   Sharper, the normalised squared errors Σ K(mean - g)²/var over elements with 0 < p < 1 is
   ≈ χ² with d' degrees of freedom: below d' + 8·sqrt(2d') (beyond 5 sigma of the normal
   approximation; fixed seed). */
DTEST(ternary_is_unbiased) {
    enum { D = 1000, K = 4000 };
    static float g[D], out[D];
    static double sum[D];
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    unsigned char *msg;
    double s = 0, eps, chi = 0;
    int k, dof = 0;
    size_t i;
    cfg.clip_c = DOPT_CLIP_OFF;
    fill_grad(g, D, 3);
    for (i = 0; i < D; i++) s = fabs(g[i]) > s ? fabs(g[i]) : s;
    init_one_segment(&cz, &cfg, D);
    msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
    for (k = 0; k < K; k++) {
        encode_decode(&cz, g, D, msg, out);
        for (i = 0; i < D; i++) sum[i] += out[i];
    }
    eps = s * sqrt(2 * log(2.0 * D / 1e-9) / K);
    for (i = 0; i < D; i++) {
        double mean = sum[i] / K, p = fabs(g[i]) / s, var = s * s * p * (1 - p);
        DT_CHECKF(fabs(mean - g[i]) <= eps, "element %zu: mean %g, g %g, bound %g", i, mean, (double)g[i], eps);
        if (var > 0) {
            chi += K * (mean - g[i]) * (mean - g[i]) / var;
            dof++;
        }
    }
    DT_CHECKF(chi <= dof + 8 * sqrt(2.0 * dof), "chi² %g over %d elements", chi, dof);
    dopt_compressor_free(&cz);
    free(msg);
}

/* E‖s·t − g‖² = s‖g‖₁ − ‖g‖₂², which is the bound ‖g‖₁‖g‖∞ − ‖g‖₂² when s = ‖g‖∞. The mean of
   K = 2000 trials must lie within 5 standard errors of it (the standard error measured from the
   trials themselves, ~0.1% of the bound here; fixed seed). */
DTEST(ternary_variance_within_bound) {
    enum { D = 2000, K = 2000 };
    static float g[D], out[D];
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    unsigned char *msg;
    double l1 = 0, l2 = 0, linf = 0, acc = 0, accsq = 0, bound, se;
    size_t i;
    int k;
    cfg.clip_c = DOPT_CLIP_OFF;
    fill_grad(g, D, 4);
    for (i = 0; i < D; i++) {
        l1 += fabs(g[i]);
        l2 += (double)g[i] * g[i];
        linf = fabs(g[i]) > linf ? fabs(g[i]) : linf;
    }
    bound = l1 * linf - l2;
    init_one_segment(&cz, &cfg, D);
    msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
    for (k = 0; k < K; k++) {
        double e = 0;
        encode_decode(&cz, g, D, msg, out);
        for (i = 0; i < D; i++) e += ((double)out[i] - g[i]) * ((double)out[i] - g[i]);
        acc += e;
        accsq += e * e;
    }
    acc /= K;
    se = sqrt((accsq / K - acc * acc) / K);
    DT_CHECKF(fabs(acc - bound) <= 5 * se, "E|st-g|² = %g ± %g, bound %g", acc, se, bound);
    DT_CHECKF(se < 0.01 * bound, "standard error %g of a bound of %g: too few trials to test", se, bound);
    dopt_compressor_free(&cz);
    free(msg);
}

/* Same (seed, rank, step): the same bytes. Another rank: codes that agree no more often than
   independent draws would (the agreement rate of two independent ternarizations is
   Σ P(t=a)·P(t'=a); the observed rate must lie within 6 standard deviations of it). */
DTEST(ternary_same_key_same_bits_other_rank_independent) {
    enum { D = 20000 };
    static float g[D];
    static int t0[D], t1[D];
    dopt_compressor a, b, c;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    unsigned char *ma, *mb, *mc;
    size_t bytes, i, agree = 0;
    double expect = 0, var = 0, s;
    dopt_buf in;
    fill_grad(g, D, 9);
    in = dopt_buf_flat(g, D, NULL, 0);
    init_one_segment(&a, &cfg, D);
    init_one_segment(&b, &cfg, D);
    cfg.rank = 1;
    init_one_segment(&c, &cfg, D);
    ma = (unsigned char *)malloc(dopt_compress_bound(&a));
    mb = (unsigned char *)malloc(dopt_compress_bound(&a));
    mc = (unsigned char *)malloc(dopt_compress_bound(&a));
    DT_OK(dopt_compress_encode(&a, &in, ma, dopt_compress_bound(&a), &bytes));
    DT_OK(dopt_compress_encode(&b, &in, mb, dopt_compress_bound(&b), &bytes));
    DT_OK(dopt_compress_encode(&c, &in, mc, dopt_compress_bound(&c), &bytes));
    DT_CHECK(memcmp(ma, mb, bytes) == 0);
    {
        float sc; /* the segment's scale in the message */
        memcpy(&sc, ma + 44, 4);
        s = sc;
    }
    for (i = 0; i < D; i++) {
        double p = fmin(fabs(g[i]), s) / s, q = p * p + (1 - p) * (1 - p);
        t0[i] = ref_code(ma + 48, i, D);
        t1[i] = ref_code(mc + 48, i, D);
        agree += t0[i] == t1[i];
        expect += q;
        var += q * (1 - q);
    }
    DT_CHECKF(fabs((double)agree - expect) <= 6 * sqrt(var), "ranks 0 and 1 agree on %zu codes, independence gives %.0f ± %.0f",
              agree, expect, sqrt(var));
    /* the next step draws new bits too */
    DT_OK(dopt_compress_encode(&a, &in, ma, dopt_compress_bound(&a), &bytes));
    DT_CHECK(memcmp(ma, mb, bytes) != 0);
    dopt_compressor_free(&a);
    dopt_compressor_free(&b);
    dopt_compressor_free(&c);
    free(ma);
    free(mb);
    free(mc);
}

DTEST(ternary_small_segments_go_as_fp32) {
    dopt_segment segs[2] = {{0, 10, "bias"}, {10, 1000, "w"}};
    float g[1010], out[1010];
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    unsigned char *msg;
    size_t i;
    cfg.fp32_below = 100;
    fill_grad(g, 1010, 1);
    DT_OK(dopt_compressor_init(&cz, &cfg, segs, 2));
    msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
    DT_EQ_INT(dopt_compress_bound(&cz), 32 + 16 + 40 + 16 + 250 + 6);
    encode_decode(&cz, g, 1010, msg, out);
    for (i = 0; i < 10; i++) DT_CHECK(out[i] == g[i]);
    dopt_compressor_free(&cz);
    free(msg);
}

/* ------------------------------------------------------------------ QSGD */

/* Per element the value is norm·l/s or norm·(l+1)/s: a range of norm/s, so Hoeffding as in
   ternary_is_unbiased with that width (δ = 1e-9 over all elements), for s = 7 (4-bit codes)
   and s = 100 (8-bit codes). */
static void qsgd_unbiased(unsigned s_levels) {
    enum { D = 1000, K = 3000 };
    static float g[D], out[D];
    static double sum[D];
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_QSGD);
    unsigned char *msg;
    double norm_max = 0, eps;
    size_t i, b;
    int k;
    cfg.qsgd_levels = s_levels;
    cfg.qsgd_bucket = 100;
    fill_grad(g, D, 21);
    memset(sum, 0, sizeof sum);
    for (b = 0; b < D; b += 100) {
        double nn = sqrt(dopt_sumsq(g + b, 100));
        norm_max = nn > norm_max ? nn : norm_max;
    }
    init_one_segment(&cz, &cfg, D);
    msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
    for (k = 0; k < K; k++) {
        encode_decode(&cz, g, D, msg, out);
        for (i = 0; i < D; i++) sum[i] += out[i];
    }
    eps = (norm_max / s_levels) * sqrt(log(2.0 * D / 1e-9) / (2.0 * K)) + 1e-6 * norm_max;
    for (i = 0; i < D; i++)
        DT_CHECKF(fabs(sum[i] / K - g[i]) <= eps, "s %u element %zu: mean %g, g %g, bound %g", s_levels, i, sum[i] / K,
                  (double)g[i], eps);
    dopt_compressor_free(&cz);
    free(msg);
}

/* The levels of DESIGN §5.2 element by element with the same Philox words (word e for element
   e): l = floor(s|v|/‖v‖), plus one with probability s|v|/‖v‖ - l (a 24-bit uniform), never
   above s; decoded (‖v‖/s)·l with the sign. Every element of encode + decode must match, for
   4-bit and 8-bit codes, buckets smaller than, equal to and not a multiple of a 64-block, and
   lengths with a tail block. */
DTEST(qsgd_matches_reference_levels) {
    static const unsigned levels[2] = {7, 100};
    static const size_t buckets[3] = {30, 64, 512}, sizes[3] = {1000, 64, 1283};
    static float g[1283], out[1283];
    static uint32_t words[1283];
    static unsigned char msg[8192];
    int li, bi, zi;
    for (li = 0; li < 2; li++)
        for (bi = 0; bi < 3; bi++)
            for (zi = 0; zi < 3; zi++) {
                size_t n = sizes[zi], i;
                unsigned sl = levels[li];
                dopt_compressor cz;
                dopt_compressor_config cfg = config_of(DOPT_CODEC_QSGD);
                dopt_rng rng;
                cfg.qsgd_levels = sl;
                cfg.qsgd_bucket = buckets[bi];
                fill_grad(g, n, 70 + (uint64_t)zi);
                g[3] = 0.0f;
                init_one_segment(&cz, &cfg, n);
                DT_CHECK(dopt_compress_bound(&cz) <= sizeof msg);
                encode_decode(&cz, g, n, msg, out);
                dopt_rng_init(&rng, 42, 0, 0);
                dopt_rng_u32(&rng, 0, words, n);
                for (i = 0; i < n; i++) {
                    size_t b0 = i / buckets[bi] * buckets[bi], len = n - b0 < buckets[bi] ? n - b0 : buckets[bi];
                    float norm = (float)sqrt(dopt_sumsq(g + b0, len));
                    float inv = norm > 0.0f ? (float)sl / norm : 0.0f, a = fabsf(g[i]) * inv, want;
                    unsigned l = a < (float)sl ? (unsigned)a : sl;
                    if ((float)(words[i] >> 8) * (1.0f / 16777216.0f) < a - (float)l) l++;
                    if (l > sl) l = sl;
                    want = (norm / (float)sl) * (float)(g[i] < 0.0f ? -(int)l : (int)l);
                    if (!same_as_ref(out[i], want)) {
                        DT_CHECKF(0, "s %u bucket %zu n %zu element %zu: %.9g, reference %.9g", sl, buckets[bi], n, i,
                                  out[i], want);
                        break;
                    }
                }
                dopt_compressor_free(&cz);
            }
}

DTEST(qsgd_is_unbiased_4_bit) { qsgd_unbiased(7); }
DTEST(qsgd_is_unbiased_8_bit) { qsgd_unbiased(100); }

/* ------------------------------------------------------------------ top-k, sign, error feedback */

DTEST(topk_sends_the_k_largest_with_indices) {
    float g[1000], out[1000];
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TOPK);
    unsigned char *msg;
    size_t i, sent = 0;
    float smallest_sent = FLT_MAX, largest_kept = 0;
    cfg.topk_ratio = 0.05;
    cfg.error_feedback = DOPT_EF_OFF;
    fill_grad(g, 1000, 8);
    g[10] = g[11] = 0.5f; /* ties and zeros must not upset the selection */
    for (i = 500; i < 700; i++) g[i] = 0.0f;
    init_one_segment(&cz, &cfg, 1000);
    msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
    encode_decode(&cz, g, 1000, msg, out);
    for (i = 0; i < 1000; i++) {
        if (out[i] != 0.0f) {
            DT_CHECK(out[i] == g[i]);
            sent++;
            smallest_sent = fabsf(g[i]) < smallest_sent ? fabsf(g[i]) : smallest_sent;
        } else {
            largest_kept = fabsf(g[i]) > largest_kept ? fabsf(g[i]) : largest_kept;
        }
    }
    DT_EQ_INT(sent, 50);
    DT_CHECK(smallest_sent >= largest_kept);
    dopt_compressor_free(&cz);
    free(msg);
}

/* The message against a sort: the k largest |x|, ties to the lower index, indices increasing —
   for data with runs of equal values, zeros, ±FLT_MAX and values over 200 binades, lengths on
   and off the 64-block, k from 1 to n (the radix passes, the bucket boundaries and the block
   walk all get exercised). NaN and ±inf are refused before any selection. */
static const float *topk_ref_x;

static float topk_ref_key(float v) { return fabsf(v); }

static int topk_ref_cmp(const void *a, const void *b) {
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    float ki = topk_ref_key(topk_ref_x[i]), kj = topk_ref_key(topk_ref_x[j]);
    if (ki != kj) return ki > kj ? -1 : 1;
    return i < j ? -1 : (i > j);
}

static int size_cmp(const void *a, const void *b) {
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    return i < j ? -1 : (i > j);
}

DTEST(topk_matches_sorted_reference) {
    static float x[5000];
    static size_t order[5000];
    static unsigned char body[8 * 5000];
    static float work[5000];
    static const size_t sizes[4] = {5000, 64, 130, 1};
    uint64_t s = 13;
    int z, kind;
    for (z = 0; z < 4; z++)
        for (kind = 0; kind < 4; kind++) {
            size_t n = sizes[z], i, kk;
            for (i = 0; i < n; i++) {
                double u = lcg_unit(&s) * 2 - 1;
                x[i] = kind == 0 ? (float)u : (kind == 1 ? (float)((int)(u * 4)) : (float)(u * 1e-3));
                if (kind == 2 && i % 17 == 0) x[i] = -x[i - i % 34];
                if (kind == 3) x[i] = (float)ldexp(u, (int)(lcg_next(&s) % 200) - 100);
            }
            if (kind == 3 && n > 10) {
                x[3] = FLT_MAX;
                x[7] = -FLT_MAX;
                x[9] = 0.0f;
            }
            for (kk = 1; kk <= n; kk += (kk < 70 ? 1 : n / 7 + 1)) {
                topk_ref_x = x;
                for (i = 0; i < n; i++) order[i] = i;
                qsort(order, n, sizeof *order, topk_ref_cmp);
                qsort(order, kk, sizeof *order, size_cmp);
                DT_CHECK(dopt__topk_encode_segment(x, n, kk, work, body));
                for (i = 0; i < kk; i++) {
                    uint32_t idx;
                    memcpy(&idx, body + 4 * i, 4);
                    if (idx != order[i] || memcmp(body + 4 * kk + 4 * i, &x[order[i]], 4) != 0) {
                        DT_CHECKF(0, "n %zu kind %d k %zu: entry %zu is index %u, reference %zu", n, kind, kk, i, idx,
                                  order[i]);
                        break;
                    }
                }
            }
        }
}

/* With error feedback, after each step e == p − C(p) bit for bit, where p = g + e_prev and
   C(p) is what the message decodes to — for every codec, over several steps. */
DTEST(ef_residual_is_p_minus_decoded_exactly_for_every_codec) {
    enum { D = 777 };
    static float g[D], p[D], out[D], e_prev[D];
    int codec, step;
    size_t i;
    for (codec = 0; codec <= (int)DOPT_CODEC_MAJORITY; codec++) {
        dopt_compressor cz;
        dopt_compressor_config cfg = config_of((dopt_codec)codec);
        dopt_segment segs[3] = {{0, 300, NULL}, {300, 0, NULL}, {310, 467, NULL}};
        unsigned char *msg;
        cfg.error_feedback = DOPT_EF_ON;
        DT_OK(dopt_compressor_init(&cz, &cfg, segs, 3));
        msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
        memset(e_prev, 0, sizeof e_prev);
        for (step = 0; step < 4; step++) {
            dopt_buf acc = dopt_buf_flat(out, D, segs, 3), in = dopt_buf_flat(g, D, segs, 3);
            size_t bytes, k = 0;
            fill_grad(g, D, 100 + (uint64_t)step);
            DT_OK(dopt_compress_encode(&cz, &in, msg, dopt_compress_bound(&cz), &bytes));
            memset(out, 0, sizeof out);
            DT_OK(dopt_compress_decode(&cz, msg, bytes, 1.0f, &acc));
            for (i = 0; i < D; i++) {
                int in_seg = i < 300 || i >= 310;
                if (!in_seg) continue;
                p[i] = g[i] + e_prev[k];
                DT_CHECKF(cz.residual[k] == p[i] - out[i], "%s step %d element %zu: e %.9g, p - C(p) %.9g",
                          dopt_codec_name((dopt_codec)codec), step, i, cz.residual[k], p[i] - out[i]);
                k++;
            }
            memcpy(e_prev, cz.residual, cz.count * sizeof(float));
        }
        dopt_compressor_free(&cz);
        free(msg);
    }
}

DTEST(sign_sends_signs_and_l1_scale) {
    float g[200], out[200];
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_SIGN);
    unsigned char msg[4096];
    double l1 = 0;
    size_t i;
    fill_grad(g, 200, 6);
    for (i = 0; i < 200; i++) l1 += fabs(g[i]);
    init_one_segment(&cz, &cfg, 200);
    DT_EQ_INT(dopt_compress_bound(&cz), 32 + 16 + 32 - 7 + 7); /* 200 bits = 25 bytes, padded to 32 */
    DT_CHECK(cz.ef == 1);                                      /* on by default for sign */
    encode_decode(&cz, g, 200, msg, out);
    for (i = 0; i < 200; i++) DT_CHECK(out[i] == (g[i] < 0 ? -1.0f : 1.0f) * (float)(l1 / 200));
    dopt_compressor_free(&cz);
}

/* ------------------------------------------------------------------ fp16 / bf16 */

/* Nearest representable value with ties to even, in double: ulp = 2^(e - mant_bits) with the
   exponent clamped at the smallest normal; values beyond the largest finite round to infinity
   when they reach max + ulp/2. */
static double ref_round(double x, int mant_bits, int min_exp, double max_finite) {
    double a = fabs(x), ulp, q, r;
    int e;
    if (a == 0) return x;
    e = ilogb(a);
    if (e < min_exp) e = min_exp;
    ulp = ldexp(1.0, e - mant_bits);
    q = a / ulp;
    r = nearbyint(q) * ulp; /* the default rounding mode is to nearest, ties to even */
    if (r > max_finite) r = INFINITY;
    return x < 0 ? -r : r;
}

static float random_float(uint64_t *s) {
    uint32_t u = (uint32_t)lcg_next(s);
    float f;
    int kind = (int)(lcg_next(s) % 4);
    if (kind == 0) u = (u & 0x80000000u) | ((u & 0x07FFFFFFu) + (103u << 23)); /* fp16 range incl. subnormals */
    if (kind == 1) u = (u & 0x8FFFFFFFu) | (0x38u << 24);                      /* around 1 */
    if (kind == 2) u = (u & 0x80001FFFu) | ((uint32_t)(lcg_next(s) % 40 + 100) << 23) | 0x1000u; /* exact ties */
    memcpy(&f, &u, 4);
    return f;
}

DTEST(fp16_rounding_matches_reference) {
    uint64_t s = 99;
    int i;
    uint32_t h;
    for (h = 0; h < 65536; h++) { /* decoding: every half against its value */
        int e = (int)((h >> 10) & 31), m = (int)(h & 1023);
        double want = e == 0 ? ldexp(m, -24) : (e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25));
        float got = dopt__f16_to_f32((uint16_t)h);
        if (h & 0x8000) want = -want;
        DT_CHECKF((dopt__is_nan(want) && dopt__is_nan(got)) || same_double(f32_exact(got), want),
                  "half %04x decodes to %g, want %g", h, got, want);
    }
    for (i = 0; i < 2000000; i++) {
        float f = i < 6 ? (float[]){65504.0f, 65519.99f, 65520.0f, 5.96e-8f, 2.98e-8f, 2.99e-8f}[i] : random_float(&s);
        uint16_t port = dopt__f32_to_f16(f);
        double want;
        if (dopt__is_nan(f)) {
            DT_CHECK(dopt__is_nan(dopt__f16_to_f32(port)));
            continue;
        }
        want = ref_round(f32_exact(f), 10, -14, 65504.0);
        DT_CHECKF(same_double(f32_exact(dopt__f16_to_f32(port)), want), "%.9g -> %04x = %.9g, want %.9g", f, port,
                  dopt__f16_to_f32(port), want);
        if (dopt__f32_bits(f) >> 31) DT_CHECK(port & 0x8000);
    }
    DT_CHECK(dopt__is_nan(dopt__f16_to_f32(dopt__f32_to_f16(dopt__bits_f32(0x7FC00000u)))));
}

DTEST(fp16_vector_path_matches_portable) {
    enum { N = 100003 };
    static float x[N], a[N], b[N];
    static unsigned char h1[2 * N], h2[2 * N];
    uint64_t s = 5;
    size_t i;
    for (i = 0; i < N; i++) x[i] = random_float(&s);
    dopt__f16_encode(x, h1, N);
    dopt__f16_encode_portable(x, h2, N);
    for (i = 0; i < N; i++) { /* the same bits, but for NaN payloads: both NaN */
        uint16_t u, v;
        memcpy(&u, h1 + 2 * i, 2);
        memcpy(&v, h2 + 2 * i, 2);
        DT_CHECKF(u == v || (dopt__is_nan(x[i]) && (u & 0x7C00) == 0x7C00 && (u & 0x3FF) && (v & 0x3FF)),
                  "%.9g: vector %04x, portable %04x", x[i], u, v);
    }
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    dopt__f16_accum(a, 0.37f, h1, N); /* a weight whose products round: no path may fuse */
    dopt__f16_accum_portable(b, 0.37f, h1, N);
    for (i = 0; i < N; i++) /* (under -ffast-math the compiler may fuse either) */
        if (!dopt__is_nan(a[i]) && !same_as_ref(a[i], b[i])) DT_CHECKF(0, "element %zu: %a, %a", i, a[i], b[i]);
}

/* Finite values near FLT_MAX overflow the statistics' float lanes to +inf in some lanes and -inf
   in others: still finite data, encoded (no clipping: σ is not finite), not DOPT_ERR_NONFINITE. */
DTEST(ternary_huge_finite_values_are_not_nonfinite) {
    enum { N = 4096 };
    float g[N], y[N];
    size_t i, bytes;
    dopt_compressor cz;
    dopt_compressor_config cfg;
    dopt_segment seg = {0, N, "huge"};
    dopt_buf b = dopt_buf_flat(g, N, &seg, 1), yb = dopt_buf_flat(y, N, &seg, 1);
    unsigned char *msg;
    g[0] = 0.0f;
    for (i = 1; i < N; i++) g[i] = i % 2 ? -3e38f : 3e38f;
    memset(&cfg, 0, sizeof cfg);
    DT_OK(dopt_compressor_init(&cz, &cfg, &seg, 1));
    msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
    DT_OK(dopt_compress_encode(&cz, &b, msg, dopt_compress_bound(&cz), &bytes));
    memset(y, 0, sizeof y);
    DT_OK(dopt_compress_decode(&cz, msg, bytes, 1.0f, &yb));
    for (i = 0; i < N; i++) DT_CHECK(y[i] == 0.0f || fabsf(y[i]) == 3e38f);
    g[7] = NAN; /* and a NaN is still refused */
    DT_EQ_INT(dopt_compress_encode(&cz, &b, msg, dopt_compress_bound(&cz), &bytes), DOPT_ERR_NONFINITE);
    free(msg);
    dopt_compressor_free(&cz);
}

/* A segment whose scale (ternary) or bucket norm (QSGD) is so small that 2^24/s overflows a float:
   zeros decode as zeros (no code from inf·0 = NaN), whatever the build. */
DTEST(tiny_scales_send_zeros) {
    static const dopt_codec codecs[2] = {DOPT_CODEC_TERNARY, DOPT_CODEC_QSGD};
    enum { N = 200 };
    float g[N], y[N];
    size_t i, c;
    for (i = 0; i < N; i++) g[i] = i % 3 ? 0.0f : 8.6e-34f * (float)(i % 7 + 1);
    for (c = 0; c < 2; c++) {
        dopt_compressor cz;
        dopt_compressor_config cfg;
        dopt_segment seg = {0, N, "tiny"};
        dopt_buf b = dopt_buf_flat(g, N, &seg, 1), yb = dopt_buf_flat(y, N, &seg, 1);
        unsigned char *msg;
        int step;
        size_t bytes;
        memset(&cfg, 0, sizeof cfg);
        cfg.codec = codecs[c];
        cfg.clip_c = DOPT_CLIP_OFF;
        DT_OK(dopt_compressor_init(&cz, &cfg, &seg, 1));
        msg = (unsigned char *)malloc(dopt_compress_bound(&cz));
        for (step = 0; step < 5; step++) {
            DT_OK(dopt_compress_encode(&cz, &b, msg, dopt_compress_bound(&cz), &bytes));
            memset(y, 0, sizeof y);
            DT_OK(dopt_compress_decode(&cz, msg, dopt_compress_bound(&cz), 1.0f, &yb));
            for (i = 0; i < N; i++)
                DT_CHECKF(y[i] == 0.0f, "%s step %d: element %zu (%g) decoded as %g", dopt_codec_name(codecs[c]), step, i,
                          g[i], y[i]);
        }
        free(msg);
        dopt_compressor_free(&cz);
    }
}

/* The sign codec's full blocks: the AVX-512 mask + bit transpose against the byte packer,
   and the decoder's ±v adds against the portable loop (negative v, -0 in y). */
DTEST(sign_vector_blocks_match_portable) {
    uint64_t s = 23;
    int trial, j;
    for (trial = 0; trial < 20000; trial++) {
        float x[64], y1[64], y2[64], v = trial % 2 ? 0.37f : -0.37f;
        uint8_t p1[8], p2[8], in[8];
        for (j = 0; j < 64; j++) {
            x[j] = (float)(lcg_unit(&s) * 2 - 1);
            y1[j] = y2[j] = j % 5 == 0 ? -0.0f : (float)lcg_unit(&s);
        }
        x[trial % 64] = -0.0f;
        dopt__sign_block_portable(x, p1);
        dopt__sign_block(x, p2);
        DT_CHECK(memcmp(p1, p2, 8) == 0);
        for (j = 0; j < 8; j++) in[j] = (uint8_t)lcg_next(&s);
        dopt__sign_accum_block_portable(y1, v, in);
        dopt__sign_accum_block(y2, v, in);
        DT_CHECK(memcmp(y1, y2, sizeof y1) == 0);
    }
}

/* Array bf16 encode and decode (in blocks of 64 through a local array) against the scalar
   conversions, at every length around a block boundary and unaligned message offsets. */
DTEST(bf16_arrays_match_scalar) {
    enum { N = 1000 };
    static float x[N], y[N], want[N];
    static unsigned char h[2 * N + 1];
    uint64_t s = 41;
    size_t n, i;
    for (i = 0; i < N; i++) x[i] = random_float(&s);
    for (n = 0; n < N; n += n < 130 ? 1 : 97) {
        unsigned char *out = h + n % 2;
        dopt__bf16_encode(x, out, n);
        for (i = 0; i < n; i++) {
            uint16_t u;
            memcpy(&u, out + 2 * i, 2);
            if (u != dopt__f32_to_bf16(x[i])) {
                DT_CHECKF(0, "n %zu element %zu: %04x, want %04x", n, i, u, dopt__f32_to_bf16(x[i]));
                break;
            }
            y[i] = want[i] = (float)i;
            if (!dopt__is_nan(x[i])) want[i] += -0.5f * dopt__bf16_to_f32(u);
        }
        dopt__bf16_accum(y, -0.5f, out, n);
        for (i = 0; i < n; i++)
            if (!dopt__is_nan(x[i])) DT_CHECK(same_bits(y[i], want[i]));
    }
}

DTEST(bf16_rounding_matches_reference) {
    uint64_t s = 77;
    int i;
    for (i = 0; i < 2000000; i++) {
        float f = random_float(&s);
        uint16_t h = dopt__f32_to_bf16(f);
        double want;
        if (dopt__is_nan(f)) {
            DT_CHECK(dopt__is_nan(dopt__bf16_to_f32(h)));
            continue;
        }
        want = ref_round(f32_exact(f), 7, -126, 3.38953138925153547590e38);
        DT_CHECKF(same_double(f32_exact(dopt__bf16_to_f32(h)), want), "%.9g -> %04x, want %.9g", f, h, want);
    }
    DT_CHECK(dopt__is_nan(dopt__bf16_to_f32(dopt__f32_to_bf16(dopt__bits_f32(0x7FC00000u)))));
    DT_EQ_INT(dopt__f32_to_bf16(FLT_MAX), 0x7F80); /* rounds up to infinity */
}

/* ------------------------------------------------------------------ wire format validation */

static void encode_for(dopt_codec codec, dopt_compressor *cz, unsigned char **msg, size_t *bytes) {
    dopt_compressor_config cfg = config_of(codec);
    dopt_segment segs[3] = {{0, 130, NULL}, {130, 3, NULL}, {133, 900, NULL}};
    float g[1033];
    dopt_buf in = dopt_buf_flat(g, 1033, segs, 3);
    fill_grad(g, 1033, 31);
    cfg.fp32_below = 4;
    DT_OK(dopt_compressor_init(cz, &cfg, segs, 3));
    *msg = (unsigned char *)malloc(dopt_compress_bound(cz) + 64);
    DT_OK(dopt_compress_encode(cz, &in, *msg, dopt_compress_bound(cz) + 64, bytes));
}

/* Truncated, oversized, and every single-bit flip of a valid message: decode returns OK or
   DOPT_ERR_PROTOCOL and touches nothing outside accum (ASan build); a flip in the header, a
   record header, padding or a 2-bit code 11 is PROTOCOL, and a refused message leaves accum
   untouched. */
DTEST(decoder_refuses_truncated_oversized_and_corrupt_messages) {
    int codec;
    for (codec = 0; codec <= (int)DOPT_CODEC_MAJORITY; codec++) {
        dopt_compressor cz;
        unsigned char *msg, *bad;
        size_t bytes, cut, bit;
        static float out[1033];
        dopt_buf acc;
        encode_for((dopt_codec)codec, &cz, &msg, &bytes);
        acc = dopt_buf_flat(out, 1033, cz.segs, cz.nsegs);
        bad = (unsigned char *)malloc(bytes + 8);
        for (cut = 0; cut < bytes; cut += (cut < 64 ? 1 : 37)) {
            memcpy(bad, msg, cut);
            DT_EQ_INT(dopt_compress_decode(&cz, bad, cut, 1.0f, &acc), DOPT_ERR_PROTOCOL);
        }
        memcpy(bad, msg, bytes);
        memset(bad + bytes, 0, 8);
        DT_EQ_INT(dopt_compress_decode(&cz, bad, bytes + 8, 1.0f, &acc), DOPT_ERR_PROTOCOL);
        for (bit = 0; bit < 8 * bytes; bit++) {
            dopt_status s;
            size_t at = bit / 8;
            memcpy(bad, msg, bytes);
            bad[at] ^= (unsigned char)(1u << (bit % 8));
            memset(out, 0, sizeof out);
            s = dopt_compress_decode(&cz, bad, bytes, 1.0f, &acc);
            DT_CHECKF(s == DOPT_OK || s == DOPT_ERR_PROTOCOL, "%s bit %zu: %d", dopt_codec_name((dopt_codec)codec), bit, s);
            /* every header field but the sender's rank (checked by the allreduce), the first
               record's count and a, and b where it is not a scale */
            if ((at < 44 && (at < 12 || at >= 16)) ||
                (at >= 44 && at < 48 && codec != DOPT_CODEC_TERNARY && codec != DOPT_CODEC_SIGN &&
                 codec != DOPT_CODEC_MAJORITY))
                DT_CHECKF(s == DOPT_ERR_PROTOCOL, "%s header bit %zu accepted", dopt_codec_name((dopt_codec)codec), bit);
            if (s != DOPT_OK) {
                size_t i;
                for (i = 0; i < 1033; i++) DT_CHECK(out[i] == 0.0f);
            }
        }
        /* a 2-bit code 11 in a ternary segment */
        if (codec == DOPT_CODEC_TERNARY) {
            memcpy(bad, msg, bytes);
            bad[48] |= 3;
            DT_EQ_INT(dopt_compress_decode(&cz, bad, bytes, 1.0f, &acc), DOPT_ERR_PROTOCOL);
        }
        DT_OK(dopt_compress_decode(&cz, msg, bytes, 1.0f, &acc));
        dopt_compressor_free(&cz);
        free(msg);
        free(bad);
    }
}

DTEST(decoder_refuses_a_layout_it_was_not_made_for) {
    dopt_compressor a, b;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    float g[100], out[100];
    unsigned char msg[1024];
    size_t bytes;
    dopt_buf in = dopt_buf_flat(g, 100, NULL, 0), acc = dopt_buf_flat(out, 100, NULL, 0);
    dopt_segment two[2] = {{0, 50, NULL}, {50, 50, NULL}};
    fill_grad(g, 100, 1);
    init_one_segment(&a, &cfg, 100);
    DT_OK(dopt_compressor_init(&b, &cfg, two, 2));
    DT_OK(dopt_compress_encode(&a, &in, msg, sizeof msg, &bytes));
    {
        dopt_buf acc2 = dopt_buf_flat(out, 100, two, 2);
        DT_EQ_INT(dopt_compress_decode(&b, msg, bytes, 1.0f, &acc2), DOPT_ERR_PROTOCOL);
    }
    cfg.codec = DOPT_CODEC_SIGN;
    dopt_compressor_free(&b);
    init_one_segment(&b, &cfg, 100);
    DT_EQ_INT(dopt_compress_decode(&b, msg, bytes, 1.0f, &acc), DOPT_ERR_PROTOCOL);
    /* an accum of another shape is the caller's mistake, not the peer's */
    {
        dopt_buf acc3 = dopt_buf_flat(out, 99, NULL, 0);
        DT_EQ_INT(dopt_compress_decode(&a, msg, bytes, 1.0f, &acc3), DOPT_ERR_INVALID);
    }
    dopt_compressor_free(&a);
    dopt_compressor_free(&b);
}

/* ------------------------------------------------------------------ configuration and state */

DTEST(config_defaults_and_invalid_values) {
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    dopt_segment seg = {0, 10, NULL}, bad[2] = {{0, 10, NULL}, {5, 10, NULL}};
    DT_OK(dopt_compressor_init(&cz, NULL, &seg, 1));
    DT_CHECK(cz.cfg.codec == DOPT_CODEC_TERNARY && cz.cfg.clip_c == 2.5f && cz.ef == 0);
    dopt_compressor_free(&cz);
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, bad, 2), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, NULL, 0), DOPT_ERR_INVALID);
    cfg.codec = DOPT_CODEC_QSGD;
    cfg.qsgd_levels = 128;
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    cfg = config_of(DOPT_CODEC_TOPK);
    cfg.topk_ratio = 1.5;
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    cfg.topk_ratio = dopt__bits_f32(0x7FC00000u); /* NaN is no "zero: the default", in any build */
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    cfg = config_of(DOPT_CODEC_TERNARY);
    cfg.clip_c = dopt__bits_f32(0x7FC00000u);
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    cfg.clip_c = dopt__bits_f32(0x7F800000u);
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    cfg.clip_c = dopt__bits_f32(0xFF800000u); /* any negative value turns clipping off */
    DT_OK(dopt_compressor_init(&cz, &cfg, &seg, 1));
    DT_CHECK(cz.cfg.clip_c == DOPT_CLIP_OFF);
    dopt_compressor_free(&cz);
    cfg = config_of((dopt_codec)(DOPT_CODEC_POWERSGD + 1));
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    cfg = config_of(DOPT_CODEC_MAJORITY);
    cfg.majority_l1 = 2;
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    dopt_compressor_free(&cz); /* a zeroed object is fine */
}

DTEST(state_save_load_resumes_exactly) {
    enum { D = 500 };
    float g[D];
    dopt_compressor a, b;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TOPK);
    unsigned char ma[8192], mb[8192], *state;
    size_t bytes, sb;
    dopt_buf in = dopt_buf_flat(g, D, NULL, 0);
    int k;
    init_one_segment(&a, &cfg, D);
    init_one_segment(&b, &cfg, D);
    for (k = 0; k < 3; k++) {
        fill_grad(g, D, (uint64_t)k);
        DT_OK(dopt_compress_encode(&a, &in, ma, sizeof ma, &bytes));
    }
    sb = dopt_compress_state_bytes(&a);
    DT_EQ_INT(sb, 32 + 4 * D);
    state = (unsigned char *)malloc(sb);
    DT_EQ_INT(dopt_compress_state_save(&a, state, sb - 1), DOPT_ERR_INVALID);
    DT_OK(dopt_compress_state_save(&a, state, sb));
    DT_EQ_INT(dopt_compress_state_load(&b, state, sb - 1), DOPT_ERR_PROTOCOL);
    state[5] ^= 1;
    DT_EQ_INT(dopt_compress_state_load(&b, state, sb), DOPT_ERR_PROTOCOL);
    state[5] ^= 1;
    DT_OK(dopt_compress_state_load(&b, state, sb));
    fill_grad(g, D, 50);
    DT_OK(dopt_compress_encode(&a, &in, ma, sizeof ma, &bytes));
    DT_OK(dopt_compress_encode(&b, &in, mb, sizeof mb, &bytes));
    DT_CHECK(memcmp(ma, mb, bytes) == 0);
    DT_CHECK(memcmp(a.residual, b.residual, D * sizeof(float)) == 0 && a.step == b.step);
    dopt_compressor_free(&a);
    dopt_compressor_free(&b);
    free(state);
}

/* ------------------------------------------------------------------ compressed allreduce */

enum { AR_N = 70000 };

/* Gradient of rank r: the same shape everywhere, a different draw per rank and step. Segments
   with a gap (never touched) and an empty one; rank 2's first segment is 4× larger, so that
   scale sharing has something to share. */
static const dopt_segment ar_segs[4] = {{0, 40000, "w1"}, {40000, 0, "empty"}, {40100, 29000, "w2"}, {69100, 900, "b"}};

static void ar_grad(float *g, int rank, int step) {
    size_t i;
    fill_grad(g, AR_N, (uint64_t)(rank * 1000 + step));
    for (i = 40000; i < 40100; i++) g[i] = 1234.0f; /* the gap */
    if (rank == 2)
        for (i = 0; i < 40000; i++) g[i] *= 4.0f;
}

/* Every rank: the result equals the average of the decoded messages (in double, within float
   rounding), bitwise the same on all ranks, the gap untouched; ternary: every message carries
   the same scale per segment, the max of the ranks' local clipped maxima, and a coded segment
   is exactly (float)(Σ_r t_r) · ((1/N)·s) — the codes are summed as integers, so the result has
   one rounding, not the N of a float sum in rank order (the serial float sum of the decoded
   messages can differ from it in the last bit for N >= 3; the 1e-6 check covers both). With
   no_sharing, ternary's scales are each rank's own: only the average is checked. */
static void allreduce_check(dopt_comm *c, dopt_codec codec, int no_sharing) {
    static float g[AR_N], dec[AR_N], all[4 * AR_N];
    static double avg[AR_N];
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(codec);
    int step, r, shared_scales = codec == DOPT_CODEC_TERNARY && !no_sharing;
    size_t i;
    cfg.fp32_below = 1000;
    cfg.no_scale_sharing = no_sharing;
    DT_OK(dopt_compressor_init(&cz, &cfg, ar_segs, 4));
    for (step = 0; step < 2; step++) {
        dopt_buf acc = dopt_buf_flat(dec, AR_N, ar_segs, 4);
        ar_grad(g, c->rank, step);
        DT_OK(dopt_compress_allreduce(&cz, c, g, AR_N));
        memset(avg, 0, sizeof avg);
        for (r = 0; r < c->size; r++) {
            size_t bytes;
            const unsigned char *m = (const unsigned char *)dopt_compress_message(&cz, r, &bytes);
            DT_CHECK(m != NULL && bytes == dopt_compress_bound(&cz));
            memset(dec, 0, sizeof dec);
            DT_OK(dopt_compress_decode(&cz, m, bytes, 1.0f, &acc));
            for (i = 0; i < AR_N; i++) avg[i] += dec[i];
            if (shared_scales) {
                const unsigned char *m0 = (const unsigned char *)dopt_compress_message(&cz, 0, &bytes);
                DT_CHECK(memcmp(m + 32 + 12, m0 + 32 + 12, 4) == 0); /* segment 0's scale */
            }
        }
        for (i = 0; i < AR_N; i++) {
            if (i >= 40000 && i < 40100) {
                DT_CHECK(g[i] == 1234.0f);
                continue;
            }
            DT_CHECKF(fabs(g[i] - avg[i] / c->size) <= 1e-6 * (fabs(avg[i]) + 1e-3),
                      "rank %d %s element %zu: %.9g, serial average %.9g", c->rank, dopt_codec_name(codec), i, g[i],
                      avg[i] / c->size);
        }
        if (shared_scales) { /* coded segments: exactly (float)Σ_r t_r · ((1/N)·s) */
            size_t off = 32, sgi;
            for (sgi = 0; sgi < 4; sgi++) {
                size_t n = ar_segs[sgi].count, body = dopt__body_bytes(&cz.cfg, n), bytes;
                const unsigned char *m0 = (const unsigned char *)dopt_compress_message(&cz, 0, &bytes);
                float sc, v;
                memcpy(&sc, m0 + off + 12, 4);
                v = 1.0f / (float)c->size * sc;
                for (i = 0; n >= cfg.fp32_below && i < n; i++) {
                    int cnt = 0;
                    for (r = 0; r < c->size; r++)
                        cnt += ref_code((const unsigned char *)dopt_compress_message(&cz, r, &bytes) + off + 16, i, n);
                    if (g[ar_segs[sgi].offset + i] != (float)cnt * v) {
                        DT_CHECKF(0, "segment %zu element %zu: %.9g, count %d times %.9g", sgi, i,
                                  g[ar_segs[sgi].offset + i], cnt, v);
                        break;
                    }
                }
                off += 16 + dopt__pad8(body);
            }
        }
        DT_OK(dopt_allgather(c, g, all, sizeof g));
        for (r = 1; r < c->size; r++)
            DT_CHECKF(memcmp(all, all + (size_t)r * AR_N, sizeof g) == 0, "%s: rank %d differs from rank 0",
                      dopt_codec_name(codec), r);
    }
    if (shared_scales) { /* the shared scale is the largest local one: rank 2's */
        size_t bytes;
        float shared, local;
        const unsigned char *m = (const unsigned char *)dopt_compress_message(&cz, 0, &bytes);
        ar_grad(g, c->size > 2 ? 2 : c->size - 1, 1);
        {
            float bound;
            DT_CHECK(dopt__tern_segment_scale(g, 40000, 2.5f, &bound, &local));
        }
        memcpy(&shared, m + 44, 4);
        if (c->size > 2) DT_CHECKF(shared == local, "shared scale %g, rank 2's local %g", shared, local);
        else DT_CHECK(shared >= local);
    }
    dopt_compressor_free(&cz);
}

static void allreduce_all_codecs(dopt_comm *c, void *unused) {
    int codec;
    (void)unused;
    for (codec = 0; codec <= (int)DOPT_CODEC_FP32; codec++) allreduce_check(c, (dopt_codec)codec, 0);
    allreduce_check(c, DOPT_CODEC_TERNARY, 1); /* each rank's own scale: against the messages' average */
}

DTEST_WORLDS(allreduce_equals_serial_average_bitwise_on_all_ranks, allreduce_all_codecs, NULL, 2, 4);

DTEST(allreduce_self_and_scatter_list) {
    dopt_comm *c;
    float a[100], b[50], ref[150], out[150];
    dopt_span spans[2] = {{a, 100}, {b, 50}};
    dopt_segment segs[2] = {{0, 100, NULL}, {100, 50, NULL}};
    dopt_buf sb = dopt_buf_scatter(spans, 2);
    dopt_compressor cz, ref_cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    unsigned char msg[1024];
    DT_OK(dopt_comm_create_self(&c));
    fill_grad(ref, 150, 1);
    memcpy(a, ref, sizeof a);
    memcpy(b, ref + 100, sizeof b);
    DT_OK(dopt_compressor_init(&cz, &cfg, segs, 2));
    DT_OK(dopt_compressor_init(&ref_cz, &cfg, segs, 2));
    DT_OK(dopt_compress_allreduce_buf(&cz, c, &sb));
    encode_decode(&ref_cz, ref, 150, msg, out);
    DT_CHECK(memcmp(a, out, sizeof a) == 0 && memcmp(b, out + 100, sizeof b) == 0);
    dopt_compressor_free(&cz);
    dopt_compressor_free(&ref_cz);
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ non-finite gradients

   One rule for every codec: a NaN or ±inf in a rank's gradient (or, with error feedback, in
   p = g + e) is DOPT_ERR_NONFINITE on every rank, no rank's buffer changes, and neither does
   the step or the residual, so the step can be skipped and training goes on. The build runs
   these tests once more with -Ofast (GCC) and with -ffast-math (clang) too: the checks test
   bits, which no floating-point option removes. The bad values are made from their bits for
   the same reason. */

typedef struct nf_case {
    dopt_codec codec;
    int no_sharing;
} nf_case;

static const nf_case nf_cases[8] = {{DOPT_CODEC_TERNARY, 0}, {DOPT_CODEC_TERNARY, 1}, {DOPT_CODEC_QSGD, 0},
                                    {DOPT_CODEC_TOPK, 0},    {DOPT_CODEC_SIGN, 0},    {DOPT_CODEC_FP16, 0},
                                    {DOPT_CODEC_BF16, 0},    {DOPT_CODEC_FP32, 0}};

/* Error feedback on for every codec, so that there is a residual to keep; ternary's last
   segment (900 elements) goes as fp32. */
static dopt_compressor_config nf_config(const nf_case *k) {
    dopt_compressor_config cfg = config_of(k->codec);
    cfg.no_scale_sharing = k->no_sharing;
    cfg.fp32_below = 1000;
    cfg.error_feedback = DOPT_EF_ON;
    return cfg;
}

static const char *nf_name(const nf_case *k) { return k->no_sharing ? "ternary (scales not shared)" : dopt_codec_name(k->codec); }

/* NaN, +inf, -inf; the first element, one in the middle of segment w2, the last. */
static float nf_bad(int v) {
    static const uint32_t bits[3] = {0x7FC00000u, 0x7F800000u, 0xFF800000u};
    return dopt__bits_f32(bits[v]);
}

static const size_t nf_where[3] = {0, 40100 + 14500, AR_N - 1};

static void nf_expect_state(const dopt_compressor *cz, uint64_t step, const float *residual, const char *what) {
    DT_CHECKF(cz->step == step, "%s: step %llu, was %llu", what, (unsigned long long)cz->step, (unsigned long long)step);
    DT_CHECKF(memcmp(cz->residual, residual, cz->count * sizeof(float)) == 0, "%s: the residual changed", what);
}

/* out holds the flagged message: the header with the flag, zeros after it. */
static void nf_expect_flagged(const dopt_compressor *cz, const unsigned char *out, const char *what) {
    dopt__compress_view whole = dopt__whole(cz);
    DT_CHECKF(dopt__check_header(&whole, cz->cfg.codec, out, cz->msg_bytes) >= 0 && dopt__flagged_nonfinite(out),
              "%s: not a flagged message", what);
}

DTEST(encode_nonfinite_is_refused_flagged_and_state_kept_for_every_codec) {
    static float g[AR_N], out[AR_N], residual[AR_N];
    static unsigned char msg[4 * AR_N + 1024], twin_msg[4 * AR_N + 1024];
    int k, v, p;
    for (k = 0; k < 8; k++) {
        dopt_compressor_config cfg = nf_config(&nf_cases[k]);
        dopt_compressor cz, twin;
        dopt_buf in = dopt_buf_flat(g, AR_N, ar_segs, 4), acc = dopt_buf_flat(out, AR_N, ar_segs, 4);
        size_t bytes, twin_bytes;
        uint64_t step;
        char what[128];
        if (nf_cases[k].no_sharing) continue; /* no communicator here: the same encoder */
        DT_OK(dopt_compressor_init(&cz, &cfg, ar_segs, 4));
        DT_OK(dopt_compressor_init(&twin, &cfg, ar_segs, 4));
        DT_CHECK(dopt_compress_bound(&cz) <= sizeof msg);
        ar_grad(g, 0, 0); /* a finite step first: the residual and the step are not zero */
        DT_OK(dopt_compress_encode(&cz, &in, msg, sizeof msg, &bytes));
        DT_OK(dopt_compress_encode(&twin, &in, twin_msg, sizeof twin_msg, &twin_bytes));
        step = cz.step;
        memcpy(residual, cz.residual, cz.count * sizeof(float));
        for (v = 0; v < 3; v++)
            for (p = 0; p < 3; p++) {
                snprintf(what, sizeof what, "%s, %g at element %zu", nf_name(&nf_cases[k]), nf_bad(v), nf_where[p]);
                ar_grad(g, 0, 1);
                g[nf_where[p]] = nf_bad(v);
                memset(msg, 0xA5, sizeof msg);
                bytes = 0;
                DT_EQ_INT(dopt_compress_encode(&cz, &in, msg, sizeof msg, &bytes), DOPT_ERR_NONFINITE);
                DT_EQ_INT(bytes, dopt_compress_bound(&cz));
                nf_expect_flagged(&cz, msg, what);
                nf_expect_state(&cz, step, residual, what);
                memset(out, 0, sizeof out);
                DT_EQ_INT(dopt_compress_decode(&cz, msg, bytes, 1.0f, &acc), DOPT_ERR_NONFINITE);
                DT_CHECKF(dopt__absbits_max(out, AR_N) == 0, "%s: decoding the flagged message wrote", what);
            }
        /* the next finite step is the one a compressor that never saw the bad gradient takes */
        ar_grad(g, 0, 1);
        DT_OK(dopt_compress_encode(&cz, &in, msg, sizeof msg, &bytes));
        DT_OK(dopt_compress_encode(&twin, &in, twin_msg, sizeof twin_msg, &twin_bytes));
        DT_CHECKF(memcmp(msg, twin_msg, bytes) == 0, "%s: the step after differs", nf_name(&nf_cases[k]));
        DT_CHECK(cz.step == twin.step && memcmp(cz.residual, twin.residual, cz.count * sizeof(float)) == 0);
        dopt_compressor_free(&cz);
        dopt_compressor_free(&twin);
    }
}

/* Finite values a format cannot carry count as non-finite: fp16 from 65520 (which rounds to
   infinity; 65519.996 still rounds to 65504), bf16 from 0x7F7F8000, a QSGD bucket whose norm
   exceeds FLT_MAX. Error feedback's p = g + e that overflows is refused too. */
static dopt_status nf_encode_one(dopt_codec codec, dopt_ef_mode ef, const float *x, size_t n) {
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(codec);
    dopt_buf in = dopt_buf_flat((float *)x, n, NULL, 0);
    unsigned char msg[4096];
    size_t bytes;
    dopt_status s;
    cfg.error_feedback = ef;
    init_one_segment(&cz, &cfg, n);
    s = dopt_compress_encode(&cz, &in, msg, sizeof msg, &bytes);
    dopt_compressor_free(&cz);
    return s;
}

DTEST(encode_values_the_format_cannot_carry_are_nonfinite) {
    float x[100];
    memset(x, 0, sizeof x);
    x[50] = dopt__bits_f32(0x477FEFFFu); /* 65519.996 */
    DT_OK(nf_encode_one(DOPT_CODEC_FP16, DOPT_EF_OFF, x, 100));
    x[50] = -65520.0f;
    DT_EQ_INT(nf_encode_one(DOPT_CODEC_FP16, DOPT_EF_OFF, x, 100), DOPT_ERR_NONFINITE);
    x[50] = 0.0f;
    x[98] = 1e6f; /* past the last full group of 8 (F16C's) */
    DT_EQ_INT(nf_encode_one(DOPT_CODEC_FP16, DOPT_EF_OFF, x, 100), DOPT_ERR_NONFINITE);
    x[98] = 0.0f;
    x[50] = dopt__bits_f32(0x7F7F7FFFu);
    DT_OK(nf_encode_one(DOPT_CODEC_BF16, DOPT_EF_OFF, x, 100));
    x[50] = dopt__bits_f32(0xFF7F8000u);
    DT_EQ_INT(nf_encode_one(DOPT_CODEC_BF16, DOPT_EF_OFF, x, 100), DOPT_ERR_NONFINITE);
    x[50] = FLT_MAX;
    DT_OK(nf_encode_one(DOPT_CODEC_QSGD, DOPT_EF_OFF, x, 100));
    DT_OK(nf_encode_one(DOPT_CODEC_FP32, DOPT_EF_OFF, x, 100));
    x[51] = -FLT_MAX;
    DT_EQ_INT(nf_encode_one(DOPT_CODEC_QSGD, DOPT_EF_OFF, x, 100), DOPT_ERR_NONFINITE);
    DT_OK(nf_encode_one(DOPT_CODEC_TERNARY, DOPT_EF_OFF, x, 100));
    DT_OK(nf_encode_one(DOPT_CODEC_SIGN, DOPT_EF_OFF, x, 100));
    DT_OK(nf_encode_one(DOPT_CODEC_TOPK, DOPT_EF_OFF, x, 100));
    {
        /* EF: top-k keeps FLT_MAX in the residual at ratio 0.01 (x[50] goes, x[51] stays), and
           the next step's p = g + e overflows to -inf */
        dopt_compressor cz;
        dopt_compressor_config cfg = config_of(DOPT_CODEC_TOPK);
        dopt_buf in = dopt_buf_flat(x, 100, NULL, 0);
        unsigned char msg[4096];
        size_t bytes;
        init_one_segment(&cz, &cfg, 100);
        DT_OK(dopt_compress_encode(&cz, &in, msg, sizeof msg, &bytes));
        DT_CHECK(cz.residual[51] == -FLT_MAX);
        DT_EQ_INT(dopt_compress_encode(&cz, &in, msg, sizeof msg, &bytes), DOPT_ERR_NONFINITE);
        DT_CHECK(cz.residual[51] == -FLT_MAX && cz.step == 1);
        dopt_compressor_free(&cz);
    }
}

/* A message that carries a non-finite value comes from a stranger, not from this library (its
   encoders flag such a gradient instead): DOPT_ERR_PROTOCOL. A flagged message decodes to
   DOPT_ERR_NONFINITE; with anything but zeros after its header, or an unknown flag, it is
   malformed. */
static void nf_plant(unsigned char *m, size_t at, uint32_t bits, unsigned width) {
    if (width == 4) dopt__put_le32(m + at, bits);
    else dopt__put_le16(m + at, bits);
}

DTEST(decoder_refuses_nonfinite_values_and_reports_flagged_messages) {
    /* encode_for's layout: segments of 130, 3 (fp32 for ternary) and 900; segment 0's record
       at 32 (its b at 44), its body at 48; ternary's 3-element segment's values at
       48 + 40 (130 codes, padded) + 16 = 104 */
    static const struct {
        dopt_codec codec;
        size_t at;
        uint32_t bits;
        unsigned width;
    } plants[] = {{DOPT_CODEC_TERNARY, 44, 0x7F800000u, 4}, {DOPT_CODEC_TERNARY, 44, 0xFFC00000u, 4},
                  {DOPT_CODEC_TERNARY, 104, 0x7FC00000u, 4}, {DOPT_CODEC_TERNARY, 108, 0xFF800000u, 4},
                  {DOPT_CODEC_QSGD, 48, 0x7F800000u, 4},     {DOPT_CODEC_QSGD, 48, 0x7FC00001u, 4},
                  {DOPT_CODEC_TOPK, 56, 0x7FC00000u, 4},     {DOPT_CODEC_TOPK, 60, 0xFF800000u, 4},
                  {DOPT_CODEC_SIGN, 44, 0x7F800000u, 4},     {DOPT_CODEC_FP16, 48, 0x7C00u, 2},
                  {DOPT_CODEC_FP16, 50, 0xFE00u, 2},         {DOPT_CODEC_BF16, 48, 0x7F80u, 2},
                  {DOPT_CODEC_BF16, 50, 0xFFC0u, 2},         {DOPT_CODEC_FP32, 48, 0x7F800000u, 4},
                  {DOPT_CODEC_FP32, 52, 0xFFC00000u, 4}};
    static float out[1033];
    size_t i, j;
    for (i = 0; i < sizeof plants / sizeof plants[0]; i++) {
        dopt_compressor cz;
        unsigned char *msg;
        size_t bytes;
        dopt_buf acc;
        encode_for(plants[i].codec, &cz, &msg, &bytes);
        acc = dopt_buf_flat(out, 1033, cz.segs, cz.nsegs);
        nf_plant(msg, plants[i].at, plants[i].bits, plants[i].width);
        memset(out, 0, sizeof out);
        DT_CHECKF(dopt_compress_decode(&cz, msg, bytes, 1.0f, &acc) == DOPT_ERR_PROTOCOL, "%s: %08x at %zu accepted",
                  dopt_codec_name(plants[i].codec), (unsigned)plants[i].bits, plants[i].at);
        for (j = 0; j < 1033; j++) DT_CHECK(out[j] == 0.0f);
        dopt_compressor_free(&cz);
        free(msg);
    }
    for (i = 0; i <= (size_t)DOPT_CODEC_MAJORITY; i++) {
        dopt_compressor cz;
        unsigned char *msg;
        size_t bytes;
        dopt_buf acc;
        encode_for((dopt_codec)i, &cz, &msg, &bytes);
        acc = dopt_buf_flat(out, 1033, cz.segs, cz.nsegs);
        memset(out, 0, sizeof out);
        dopt__write_nonfinite(&cz, &cz.view, 0, msg);
        DT_EQ_INT(dopt_compress_decode(&cz, msg, bytes, 1.0f, &acc), DOPT_ERR_NONFINITE);
        msg[bytes - 1] = 1; /* a flagged message carries nothing */
        DT_EQ_INT(dopt_compress_decode(&cz, msg, bytes, 1.0f, &acc), DOPT_ERR_PROTOCOL);
        msg[bytes - 1] = 0;
        msg[6] = 3; /* an unknown flag */
        DT_EQ_INT(dopt_compress_decode(&cz, msg, bytes, 1.0f, &acc), DOPT_ERR_PROTOCOL);
        msg[6] = 1;
        msg[4] = 1; /* the first wire version had no flags */
        DT_EQ_INT(dopt_compress_decode(&cz, msg, bytes, 1.0f, &acc), DOPT_ERR_PROTOCOL);
        for (j = 0; j < 1033; j++) DT_CHECK(out[j] == 0.0f);
        dopt_compressor_free(&cz);
        free(msg);
    }
}

/* The compressed allreduce with one rank's NaN, +inf or -inf at the first, a middle or the last
   element (every rank takes its turn): every rank returns DOPT_ERR_NONFINITE, every rank's
   buffer is as it was, bit for bit, and so are the step and the residual; a NaN in the gap
   between segments is nobody's business; and the next finite step gives the bytes of a
   compressor that never saw a bad gradient. Every codec, ternary with and without scale
   sharing. */
static void nf_allreduce_case(dopt_comm *c, const nf_case *k) {
    static float g[AR_N], keep[AR_N], tg[AR_N], residual[AR_N];
    dopt_compressor_config cfg = nf_config(k);
    dopt_compressor cz, twin;
    uint64_t step;
    int v, p;
    char what[160];
    DT_OK(dopt_compressor_init(&cz, &cfg, ar_segs, 4));
    DT_OK(dopt_compressor_init(&twin, &cfg, ar_segs, 4));
    ar_grad(g, c->rank, 0);
    DT_OK(dopt_compress_allreduce(&cz, c, g, AR_N));
    ar_grad(tg, c->rank, 0);
    DT_OK(dopt_compress_allreduce(&twin, c, tg, AR_N));
    step = cz.step;
    memcpy(residual, cz.residual, cz.count * sizeof(float));
    for (v = 0; v < 3; v++)
        for (p = 0; p < 3; p++) {
            int culprit = (3 * v + p) % c->size;
            snprintf(what, sizeof what, "rank %d of %d, %s, rank %d's element %zu = %g", c->rank, c->size, nf_name(k),
                     culprit, nf_where[p], nf_bad(v));
            ar_grad(g, c->rank, 1);
            if (c->rank == culprit) g[nf_where[p]] = nf_bad(v);
            memcpy(keep, g, sizeof g);
            DT_CHECKF(dopt_compress_allreduce(&cz, c, g, AR_N) == DOPT_ERR_NONFINITE, "%s: not refused", what);
            DT_CHECKF(memcmp(g, keep, sizeof g) == 0, "%s: the gradient changed", what);
            nf_expect_state(&cz, step, residual, what);
        }
    ar_grad(g, c->rank, 1);
    g[40050] = nf_bad(0);
    DT_OK(dopt_compress_allreduce(&cz, c, g, AR_N));
    ar_grad(tg, c->rank, 1);
    DT_OK(dopt_compress_allreduce(&twin, c, tg, AR_N));
    DT_CHECK(dopt__f32_bits(g[40050]) == 0x7FC00000u); /* untouched */
    g[40050] = tg[40050];
    DT_CHECKF(memcmp(g, tg, sizeof g) == 0, "rank %d, %s: the step after differs", c->rank, nf_name(k));
    DT_CHECK(cz.step == twin.step && memcmp(cz.residual, twin.residual, cz.count * sizeof(float)) == 0);
    dopt_compressor_free(&cz);
    dopt_compressor_free(&twin);
}

static void nf_allreduce_body(dopt_comm *c, void *unused) {
    int k;
    (void)unused;
    for (k = 0; k < 8; k++) nf_allreduce_case(c, &nf_cases[k]);
}

DTEST_WORLDS(allreduce_nonfinite_on_one_rank_fails_every_rank_and_changes_nothing, nf_allreduce_body, NULL, 2, 3);

/* Without scale sharing the verdict rides in the messages: one allgather per step, no allreduce
   of a flag, also when a rank is not finite. */
static void nf_traffic_body(dopt_comm *c, void *unused) {
    static float g[AR_N];
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    dopt_compressor cz;
    (void)unused;
    cfg.no_scale_sharing = 1;
    DT_OK(dopt_compressor_init(&cz, &cfg, ar_segs, 4));
    memset(&c->traffic, 0, sizeof c->traffic);
    ar_grad(g, c->rank, 0);
    DT_OK(dopt_compress_allreduce(&cz, c, g, AR_N));
    ar_grad(g, c->rank, 1);
    if (c->rank == 1) g[7] = nf_bad(0);
    DT_EQ_INT(dopt_compress_allreduce(&cz, c, g, AR_N), DOPT_ERR_NONFINITE);
    DT_EQ_INT(c->traffic.calls[DOPT_COLL_ALLGATHER], 2);
    DT_EQ_INT(c->traffic.calls[DOPT_COLL_ALLREDUCE], 0);
    dopt_compressor_free(&cz);
}

DTEST_WORLDS(allreduce_without_scale_sharing_sends_the_verdict_in_the_messages, nf_traffic_body, NULL, 2, 2);

/* ------------------------------------------------------------------ details name the call

   A mismatch inside the compressed allreduce names it in the communicator's detail: ranks with
   different layouts (the message exchange), a rank that calls a plain allreduce while the other
   shares TernGrad's scales. A label the caller has set (localsgd.h sets its own) stays. */
static void mismatch_body(dopt_comm *c, void *arg) {
    int scenario = *(const int *)arg;
    static float g[1001];
    dopt_segment seg = {0, (size_t)(1000 + (scenario != 1 ? c->rank : 0)), NULL};
    dopt_compressor_config cfg = config_of(scenario == 1 ? DOPT_CODEC_TERNARY : DOPT_CODEC_FP16);
    dopt_compressor cz;
    dopt_status s;
    const char *want;
    fill_grad(g, 1001, 3);
    DT_OK(dopt_compressor_init(&cz, &cfg, &seg, 1));
    if (scenario == 2) dopt_comm_set_api(c, "host_step");
    if (scenario == 1 && c->rank == 1)
        s = dopt_allreduce(c, g, 1000, DOPT_F32, DOPT_SUM);
    else
        s = dopt_compress_allreduce(&cz, c, g, 1001);
    DT_CHECKF(s == DOPT_ERR_MISMATCH, "rank %d: %s (%s)", c->rank, dopt_status_str(s), dopt_comm_detail(c));
    want = scenario == 0   ? "dopt_compress_allreduce: allgather #"
           : scenario == 2 ? "host_step: allgather #"
           : c->rank == 0  ? "dopt_compress_allreduce: scale sharing: allreduce #"
                           : "rank 1: allreduce #";
    DT_CHECKF(strstr(dopt_comm_detail(c), want) != NULL, "rank %d: detail \"%s\" lacks \"%s\"", c->rank,
              dopt_comm_detail(c), want);
    if (scenario == 2)
        DT_CHECK(c->api != NULL && strcmp(c->api, "host_step") == 0); /* put back */
    else
        DT_CHECK(c->api == NULL);
    dopt_compressor_free(&cz);
}

/* ranks with other layouts, a plain allreduce against scale sharing, a label set by the caller */
static const int mismatch_scenarios[3] = {0, 1, 2};
DTEST_WORLDS_EACH(mismatch_inside_the_compressed_allreduce_names_it_in_the_detail, mismatch_body, mismatch_scenarios, 2,
                  2);

/* ------------------------------------------------------------------ buckets: segment calls and nonblocking starts

   The same gradients averaged on every rank by one whole call per step and by segment calls in
   buckets whose order is not the table's (reversed, cut in two and in three): where the manual
   says so, the same bits, the same residuals, and the step advances once per full set (a bucket
   keyed by its place in the call instead of its index in the table would draw other codes). A
   step where one rank's gradient holds a NaN fails in one of its buckets, and both compressors
   stay in step. The nonblocking starts give the blocking segment calls' bits. */

/* Matrices (PowerSGD compresses w1 and w2; the other codecs ignore rows), an empty segment, a gap. */
static const dopt_segment bk_segs[4] = {
    {0, 40000, "w1", 200}, {40000, 0, "empty", 0}, {40100, 29000, "w2", 100}, {69100, 900, "b", 0}};

typedef struct bk_case {
    dopt_codec codec;
    dopt_aggregate aggregate;
    int no_sharing;
    int bitwise; /* the manual: a bucket's results are the whole call's bits (at 2 ranks: every case) */
} bk_case;

static const bk_case bk_cases[] = {
    {DOPT_CODEC_TERNARY, DOPT_AGG_ALLGATHER, 0, 1}, {DOPT_CODEC_TERNARY, DOPT_AGG_RING, 0, 1},
    {DOPT_CODEC_TERNARY, DOPT_AGG_ALLGATHER, 1, 1}, {DOPT_CODEC_QSGD, DOPT_AGG_AUTO, 0, 1},
    {DOPT_CODEC_TOPK, DOPT_AGG_AUTO, 0, 1},         {DOPT_CODEC_SIGN, DOPT_AGG_AUTO, 0, 1},
    {DOPT_CODEC_MAJORITY, DOPT_AGG_ALLGATHER, 0, 1}, {DOPT_CODEC_MAJORITY, DOPT_AGG_RING, 0, 1},
    {DOPT_CODEC_FP16, DOPT_AGG_ALLGATHER, 0, 1},    {DOPT_CODEC_FP16, DOPT_AGG_RING, 0, 0},
    {DOPT_CODEC_BF16, DOPT_AGG_ALLGATHER, 0, 1},    {DOPT_CODEC_BF16, DOPT_AGG_RING, 0, 0},
    {DOPT_CODEC_FP32, DOPT_AGG_AUTO, 0, 1},         {DOPT_CODEC_POWERSGD, DOPT_AGG_AUTO, 0, 0},
};
#define BK_NCASES (sizeof bk_cases / sizeof bk_cases[0])

/* The buckets of step t (t mod 5): their sizes, then the segments one after another. Step 3
   plants a NaN in segment 3 on rank 0, so its second bucket fails. */
typedef struct bk_plan {
    int nb;
    size_t size[4];
    size_t seg[4];
} bk_plan;

static const bk_plan bk_plans[5] = {
    {2, {2, 2}, {3, 2, 1, 0}}, {3, {1, 2, 1}, {2, 0, 3, 1}}, {1, {4}, {3, 2, 1, 0}},
    {2, {2, 2}, {0, 1, 3, 2}}, {3, {2, 1, 1}, {1, 3, 0, 2}}};

static dopt_compressor_config bk_config(const bk_case *k) {
    dopt_compressor_config cfg = config_of(k->codec);
    cfg.aggregate = k->aggregate;
    cfg.no_scale_sharing = k->no_sharing;
    cfg.fp32_below = 1000; /* ternary's b goes as fp32 */
    cfg.ring_buckets = 3;  /* ternary's ring pipelines a bucket's groups in three */
    return cfg;
}

static const char *bk_name(const bk_case *k) {
    static char name[64];
    snprintf(name, sizeof name, "%s%s%s", dopt_codec_name(k->codec), k->aggregate == DOPT_AGG_RING ? " on the ring" : "",
             k->no_sharing ? " (scales not shared)" : "");
    return name;
}

static void bk_grad(float *g, int rank, int step) {
    ar_grad(g, rank, step);
    if (step == 3 && rank == 0) g[69100 + 17] = dopt__bits_f32(0x7FC00000u); /* NaN in b */
}

/* gp against gw over every segment: bitwise, or (where the manual says the bits may differ)
   within tol of the largest |gw| of the segment; the gap untouched either way. */
static void bk_compare(const bk_case *k, const float *gw, const float *gp, int rank, int size, int step, double tol) {
    size_t sgi, i;
    for (i = 40000; i < 40100; i++) DT_CHECK(gp[i] == 1234.0f);
    for (sgi = 0; sgi < 4; sgi++) {
        const float *w = gw + bk_segs[sgi].offset, *q = gp + bk_segs[sgi].offset;
        size_t n = bk_segs[sgi].count;
        double top = 0;
        if (k->bitwise || size == 2) { /* two addends give one float in either order: every codec */
            DT_CHECKF(memcmp(w, q, n * sizeof(float)) == 0, "rank %d %s step %d segment %zu: not the whole call's bits",
                      rank, bk_name(k), step, sgi);
            continue;
        }
        for (i = 0; i < n; i++) top = fabs(w[i]) > top ? fabs(w[i]) : top;
        for (i = 0; i < n; i++)
            if (fabs((double)w[i] - (double)q[i]) > tol * top + 1e-12) {
                DT_CHECKF(0, "rank %d %s step %d segment %zu element %zu: %.9g, whole call %.9g", rank, bk_name(k), step,
                          sgi, i, q[i], w[i]);
                break;
            }
    }
}

/* Every rank holds the same bytes of g. */
static void bk_same_everywhere(dopt_comm *c, const float *g, const char *what) {
    static float all[4 * AR_N];
    int r;
    DT_OK(dopt_allgather(c, g, all, AR_N * sizeof(float)));
    for (r = 1; r < c->size; r++)
        DT_CHECKF(memcmp(all, all + (size_t)r * AR_N, AR_N * sizeof(float)) == 0, "%s: rank %d differs from rank 0", what,
                  r);
}

static void bk_case_run(dopt_comm *c, const bk_case *k) {
    static float gw[AR_N], gp[AR_N];
    dopt_compressor whole, parts;
    dopt_compressor_config cfg = bk_config(k);
    dopt_buf bp = dopt_buf_flat(gp, AR_N, bk_segs, 4);
    int step, b;
    DT_OK(dopt_compressor_init(&whole, &cfg, bk_segs, 4));
    DT_OK(dopt_compressor_init(&parts, &cfg, bk_segs, 4));
    for (step = 0; step < 5; step++) {
        const bk_plan *pl = &bk_plans[step];
        const size_t *segs = pl->seg;
        dopt_status sw, sp, want = step == 3 ? DOPT_ERR_NONFINITE : DOPT_OK;
        uint64_t before = parts.step;
        bk_grad(gw, c->rank, step);
        memcpy(gp, gw, sizeof gw);
        sw = dopt_compress_allreduce(&whole, c, gw, AR_N);
        DT_CHECKF(sw == want, "rank %d %s step %d: the whole call gave %s", c->rank, bk_name(k), step, dopt_status_str(sw));
        for (b = 0; b < pl->nb; b++) {
            sp = dopt_compress_allreduce_segments(&parts, c, &bp, segs, pl->size[b]);
            DT_CHECKF(sp == (step == 3 && b == 1 ? DOPT_ERR_NONFINITE : DOPT_OK), "rank %d %s step %d bucket %d: %s (%s)",
                      c->rank, bk_name(k), step, b, dopt_status_str(sp), dopt_compress_detail(&parts));
            if (b < pl->nb - 1)
                DT_CHECKF(parts.step == before, "%s: the step advanced before every segment was given", bk_name(k));
            if (step == 1 && b == 0) { /* segment 2 again, an index beyond the table, the whole call: refused here */
                size_t again[2] = {0, 2}, beyond = 4;
                DT_EQ_INT(dopt_compress_allreduce_segments(&parts, c, &bp, again, 2), DOPT_ERR_INVALID);
                DT_CHECKF(strstr(dopt_compress_detail(&parts), "segment 2 (w2) given twice") != NULL, "detail: %s",
                          dopt_compress_detail(&parts));
                DT_EQ_INT(dopt_compress_allreduce_segments(&parts, c, &bp, &beyond, 1), DOPT_ERR_INVALID);
                DT_CHECKF(strstr(dopt_compress_detail(&parts), "index 4 is beyond") != NULL, "detail: %s",
                          dopt_compress_detail(&parts));
                DT_EQ_INT(dopt_compress_allreduce(&parts, c, gp, AR_N), DOPT_ERR_INVALID);
                DT_EQ_INT(dopt_compress_allreduce_segments(&parts, c, &bp, NULL, 0), DOPT_ERR_INVALID);
                { /* a descriptor whose w2 is one element short (b one longer): the refusal names w2 */
                    dopt_segment moved[4];
                    dopt_buf bm;
                    memcpy(moved, bk_segs, sizeof moved);
                    moved[2].count--;
                    moved[3].offset--;
                    moved[3].count++;
                    bm = dopt_buf_flat(gp, AR_N, moved, 4);
                    DT_EQ_INT(dopt_compress_allreduce_segments(&parts, c, &bm, again, 1), DOPT_ERR_INVALID);
                    DT_CHECKF(strstr(dopt_compress_detail(&parts), "segment 2 ('w2') has 28999 elements in the "
                                                                   "descriptor, 29000 elements in the layout") != NULL,
                              "detail: %s", dopt_compress_detail(&parts));
                }
            }
            segs += pl->size[b];
        }
        DT_CHECKF(parts.step == whole.step && parts.step == before + (step == 3 ? 0 : 1), "%s step %d: steps %llu and %llu",
                  bk_name(k), step, (unsigned long long)parts.step, (unsigned long long)whole.step);
        if (step == 3) continue; /* a failed step: the buffers hold whatever its buckets left */
        bk_compare(k, gw, gp, c->rank, c->size, step, k->codec == DOPT_CODEC_POWERSGD ? 1e-3 : 2e-2);
        bk_same_everywhere(c, gp, bk_name(k));
        if (parts.ef && (k->bitwise || c->size == 2))
            DT_CHECKF(memcmp(whole.residual, parts.residual, whole.count * sizeof(float)) == 0,
                      "rank %d %s step %d: the residuals differ", c->rank, bk_name(k), step);
        if (parts.ef) { /* and the step kept one: C(p) drops something of every segment here */
            size_t i, kept = 0;
            for (i = 0; i < parts.count; i++) kept += parts.residual[i] != 0.0f;
            DT_CHECKF(kept > 0, "%s step %d: no residual kept", bk_name(k), step);
        }
    }
    if (k->bitwise || c->size == 2) { /* the same state file: step, residual, PowerSGD's Q's */
        size_t bytes = dopt_compress_state_bytes(&whole);
        unsigned char *sw = (unsigned char *)malloc(bytes), *sp = (unsigned char *)malloc(bytes);
        DT_EQ_INT(dopt_compress_state_bytes(&parts), bytes);
        DT_OK(dopt_compress_state_save(&whole, sw, bytes));
        DT_OK(dopt_compress_state_save(&parts, sp, bytes));
        DT_CHECKF(memcmp(sw, sp, bytes) == 0, "rank %d %s: the states differ", c->rank, bk_name(k));
        free(sw);
        free(sp);
    }
    dopt_compressor_free(&whole);
    dopt_compressor_free(&parts);
}

static void bk_all_codecs(dopt_comm *c, void *unused) {
    size_t i;
    (void)unused;
    for (i = 0; i < BK_NCASES; i++) bk_case_run(c, &bk_cases[i]);
}

DTEST_WORLDS(buckets_in_any_order_give_the_whole_calls_bits_and_step, bk_all_codecs, NULL, 2, 3);

/* The same buckets blocking and started: run by start itself on a communicator only one thread
   may call, two in flight, the second waited (which completes the first), a third polled with
   test, the whole table started, and a blocking segment call behind a started one; every
   result, step and residual bit for bit the blocking calls', for every codec (the same calls:
   even where buckets differ from the whole call). */
static void nb_case_run(dopt_comm *c, const bk_case *k) {
    static float gb[AR_N], gn[AR_N];
    dopt_compressor blocking, started;
    dopt_compressor_config cfg = bk_config(k);
    dopt_buf bb = dopt_buf_flat(gb, AR_N, bk_segs, 4), bn = dopt_buf_flat(gn, AR_N, bk_segs, 4);
    dopt_compress_request req[4];
    int step, b, done;
    DT_OK(dopt_compressor_init(&blocking, &cfg, bk_segs, 4));
    DT_OK(dopt_compressor_init(&started, &cfg, bk_segs, 4));
    for (step = 0; step < 5; step++) {
        const bk_plan *pl = &bk_plans[step];
        const size_t *segs = pl->seg;
        dopt_status want = step == 3 ? DOPT_ERR_NONFINITE : DOPT_OK;
        bk_grad(gb, c->rank, step);
        memcpy(gn, gb, sizeof gb);
        for (b = 0, segs = pl->seg; b < pl->nb; segs += pl->size[b], b++)
            DT_CHECK(dopt_compress_allreduce_segments(&blocking, c, &bb, segs, pl->size[b]) ==
                     (step == 3 && b == 1 ? want : DOPT_OK));
        if (step == 0) { /* a communicator only its creating thread may call: start runs the call */
            c->one_thread = 1;
            for (b = 0, segs = pl->seg; b < pl->nb; segs += pl->size[b], b++) {
                DT_OK(dopt_compress_allreduce_start(&started, c, &bn, segs, pl->size[b], &req[b]));
                DT_CHECK(req[b].ticket == 0 && started.worker == NULL); /* complete, and no thread */
            }
            c->one_thread = 0;
            DT_OK(dopt_compress_wait(&req[0]));
        } else if (step == 2) { /* the whole table, started; then a blocking call behind it */
            DT_OK(dopt_compress_allreduce_start(&started, c, &bn, NULL, 0, &req[0]));
            DT_OK(dopt_compress_wait(&req[0]));
            DT_OK(dopt_compress_wait(&req[0])); /* again: the same status */
            memcpy(gn, gb, sizeof gb);          /* (the blocking side's one bucket is the whole table) */
        } else if (step == 1) { /* three in flight; the last polled until done */
            for (b = 0, segs = pl->seg; b < pl->nb; segs += pl->size[b], b++)
                DT_OK(dopt_compress_allreduce_start(&started, c, &bn, segs, pl->size[b], &req[b]));
            do DT_OK(dopt_compress_test(&req[2], &done));
            while (!done);
            DT_OK(dopt_compress_test(&req[0], &done));
            DT_CHECK(done);
            DT_OK(dopt_compress_wait(&req[1]));
        } else { /* two in flight, the second waited first; step 4 has a blocking call behind them */
            for (b = 0, segs = pl->seg; b < 2; segs += pl->size[b], b++) {
                /* (without threads start runs the call and returns its status) */
                dopt_status st = dopt_compress_allreduce_start(&started, c, &bn, segs, pl->size[b], &req[b]);
                DT_CHECK(st == DOPT_OK || (b == 1 && st == want));
            }
            if (pl->nb == 3) DT_OK(dopt_compress_allreduce_segments(&started, c, &bn, segs, pl->size[2]));
            if (step == 3) { /* the failing one polled, then waited: the same status */
                dopt_status st;
                do st = dopt_compress_test(&req[1], &done);
                while (!done && st == DOPT_OK);
                DT_EQ_INT(st, (int)want);
            }
            DT_EQ_INT(dopt_compress_wait(&req[1]), (int)want);
            DT_OK(dopt_compress_test(&req[0], &done));
            DT_CHECK(done);
            DT_EQ_INT(dopt_compress_wait(&req[1]), (int)want); /* again: the same status */
            DT_EQ_INT(dopt_compress_test(&req[1], &done), (int)want);
        }
        DT_CHECKF(started.step == blocking.step, "%s step %d: steps %llu and %llu", bk_name(k), step,
                  (unsigned long long)started.step, (unsigned long long)blocking.step);
        if (step == 3) continue;
        if (step != 2)
            DT_CHECKF(memcmp(gb, gn, sizeof gb) == 0, "rank %d %s step %d: started and blocking differ", c->rank, bk_name(k),
                      step);
        if (started.ef)
            DT_CHECKF(memcmp(blocking.residual, started.residual, blocking.count * sizeof(float)) == 0,
                      "rank %d %s step %d: the residuals differ", c->rank, bk_name(k), step);
    }
    dopt_compressor_free(&blocking);
    dopt_compressor_free(&started);
}

static void nb_all_codecs(dopt_comm *c, void *unused) {
    size_t i;
    (void)unused;
    for (i = 0; i < BK_NCASES; i++) nb_case_run(c, &bk_cases[i]);
}

DTEST_WORLDS(started_buckets_complete_in_order_with_the_blocking_bits, nb_all_codecs, NULL, 2, 3);

/* Ranks that list other segments (sizes 900 and 29000) fail together, for a codec on the
   allgather path, ternary's scale sharing and PowerSGD: nothing hangs. */
static void bk_other_lists(dopt_comm *c, void *unused) {
    static float g[AR_N];
    static const dopt_codec codecs[3] = {DOPT_CODEC_TOPK, DOPT_CODEC_TERNARY, DOPT_CODEC_POWERSGD};
    dopt_buf b = dopt_buf_flat(g, AR_N, bk_segs, 4);
    size_t mine = c->rank == 0 ? 3 : 2;
    int i;
    (void)unused;
    for (i = 0; i < 3; i++) {
        dopt_compressor cz;
        dopt_compressor_config cfg = config_of(codecs[i]);
        dopt_status s;
        DT_OK(dopt_compressor_init(&cz, &cfg, bk_segs, 4));
        ar_grad(g, c->rank, 0);
        s = dopt_compress_allreduce_segments(&cz, c, &b, &mine, 1);
        DT_CHECKF(s == DOPT_ERR_MISMATCH || s == DOPT_ERR_PROTOCOL, "rank %d %s: %s (%s)", c->rank,
                  dopt_codec_name(codecs[i]), dopt_status_str(s), dopt_comm_detail(c));
        dopt_compressor_free(&cz);
        if (s == DOPT_ERR_MISMATCH) break; /* the communicator is poisoned */
    }
}

DTEST_WORLDS(buckets_of_other_segments_on_two_ranks_fail_on_both, bk_other_lists, NULL, 2, 2);

/* Rank 2 leaves the job without a word while the others have two buckets in flight: both
   requests fail (the lost peer, or the short timeout where the transport cannot tell), nothing
   hangs, and the compressor frees its worker. */
static void nb_peer_lost(dopt_comm *c, void *unused) {
    static float g[AR_N];
    dopt_compressor cz;
    dopt_compressor_config cfg = config_of(DOPT_CODEC_TERNARY);
    dopt_buf b = dopt_buf_flat(g, AR_N, bk_segs, 4);
    dopt_compress_request req[2];
    static const size_t first[2] = {3, 2}, second[2] = {1, 0};
    dopt_status s0, s1;
    (void)unused;
    dopt_comm_set_timeout(c, 3000);
    DT_OK(dopt_compressor_init(&cz, &cfg, bk_segs, 4));
    ar_grad(g, c->rank, 0);
    DT_OK(dopt_barrier(c));
    if (c->rank == 2) _exit(0); /* no goodbye */
    s0 = dopt_compress_allreduce_start(&cz, c, &b, first, 2, &req[0]);
    s1 = dopt_compress_allreduce_start(&cz, c, &b, second, 2, &req[1]);
    DT_CHECK(s0 == DOPT_OK || s0 == dopt_compress_wait(&req[0])); /* without threads: the call's status */
    DT_CHECK(s1 == DOPT_OK || s1 == dopt_compress_wait(&req[1]));
    s1 = dopt_compress_wait(&req[1]);
    s0 = dopt_compress_wait(&req[0]);
    DT_CHECKF(s0 == DOPT_ERR_PEER_LOST || s0 == DOPT_ERR_TIMEOUT, "rank %d: the first bucket gave %s: %s", c->rank,
              dopt_status_str(s0), dopt_comm_detail(c));
    DT_CHECKF(s1 == s0, "rank %d: the second bucket gave %s, the first %s", c->rank, dopt_status_str(s1), dopt_status_str(s0));
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 2") != NULL, "rank %d: detail \"%s\" does not name rank 2", c->rank,
              dopt_comm_detail(c));
    DT_CHECK(cz.step == 0);
    dopt_compressor_free(&cz);
}

DTEST_WORLDS(peer_lost_with_buckets_in_flight_fails_every_request, nb_peer_lost, NULL, 3, 3);

DTEST_MAIN()
