/* Tests of compress.h's integer ring: the ternary codes of every rank summed exactly along rings
   of the engine, in widening integers.

   - The sums against a serial integer reference read from the ranks' own messages (this file's
     reader, not the library's decoder), at every world size 1..8, over every transport of
     worlds.h, on a flat ring and on every host layout the size allows (hosts of 2, 3, 4 ranks,
     numbered in blocks and interleaved); the result is bitwise the allgather path's.
   - The widths at every hop: the bytes each rank receives equal what the schedule's widths
     ceil(log2(2k + 1)) give, step by step, and gradients that push every sum to ±N at every hop
     still come out exact (one bit less would wrap them).
   - Segments sent as fp32, error feedback and the step carried across steps, a non-finite
     gradient, the choice between the paths, and the vector kernels against the portable ones. */
/* the pipeline's encoder pauses before each bucket: a ring that ran ahead of it would read stale planes */
#define DOPT__PIPE_TEST_DELAY_US 300
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../compress.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "dtest.h"
#include "worlds.h"

#include <math.h>

/* ------------------------------------------------------------------ helpers */

static uint64_t lcg_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}

static unsigned width_of(uint64_t k) { /* ceil(log2(2k + 1)), written as the spec says it */
    unsigned w = 0;
    while ((1ull << w) < 2 * k + 1) w++;
    return w;
}

/* The layout every world test uses: a run of segment sizes with partial groups, an empty one, a
   tiny one (fp32 when fp32_below = 10) and one of exactly a group. */
static const size_t seg_sizes[] = {1000, 64, 0, 130, 3, 5000, 1};
#define NSEGS (sizeof seg_sizes / sizeof seg_sizes[0])

static size_t make_segments(dopt_segment *segs) {
    size_t total;
    DT_OK(dopt_segments_from_sizes(segs, seg_sizes, NSEGS, &total));
    return total;
}

/* Rank r's gradient: random (kind 0) or saturating (kind 1: every element of segment i is
   ±1, the sign alternating with i, so that with clipping off every code is ±1 and every sum
   reaches ±N). */
static void fill(float *g, size_t n, const dopt_segment *segs, int rank, int step, int kind) {
    size_t i, e;
    uint64_t s = (uint64_t)rank * 7919u + (uint64_t)step * 104729u + 17u;
    for (i = 0; i < n; i++) g[i] = (float)((double)(lcg_next(&s) % 20001) / 10000.0 - 1.0) * 0.01f;
    if (kind == 1)
        for (i = 0; i < NSEGS; i++)
            for (e = 0; e < segs[i].count; e++) g[segs[i].offset + e] = i % 2 ? -1.0f : 1.0f;
}

/* Code of element e of a ternary body of n elements: blocks of 64, 16 bytes each (the last one
   ceil(m/4) bytes), element t of a block of m at byte t mod q, bits 2·(t div q). */
static int code_at(const unsigned char *body, size_t n, size_t e) {
    size_t blk = e / 64, t = e % 64, m = n - blk * 64 < 64 ? n - blk * 64 : 64, q = (m + 3) / 4;
    unsigned c = (body[blk * 16 + t % q] >> (2 * (t / q))) & 3u;
    DT_CHECK(c != 3);
    return c == 1 ? 1 : c == 2 ? -1 : 0;
}

static size_t pad8(size_t b) { return (b + 7) & ~(size_t)7; }

/* The expected average from the messages the allgather path gathered: a ternary segment's
   element is (float)Σ_r t_r · ((1/N)·s), an fp32 segment's the rank-order sum of (1/N)·x_r. */
static void reference(const dopt_compressor *ag, int N, const dopt_segment *segs, float *want, size_t n) {
    size_t off = DOPT_COMPRESS_HEADER_BYTES, i, e;
    float w = 1.0f / (float)N;
    memset(want, 0, n * sizeof(float));
    for (i = 0; i < NSEGS; i++) {
        size_t cnt = segs[i].count, body;
        int fp32 = cnt < ag->cfg.fp32_below, r;
        for (e = 0; e < cnt; e++) {
            long long sum = 0;
            float acc = 0.0f, scale = 0.0f;
            for (r = 0; r < N; r++) {
                const unsigned char *m = (const unsigned char *)dopt_compress_message(ag, r, NULL), *rec = m + off;
                DT_CHECK(m != NULL);
                if (fp32) {
                    float x;
                    memcpy(&x, rec + 16 + 4 * e, 4);
                    acc += w * x;
                } else {
                    memcpy(&scale, rec + 12, 4);
                    sum += code_at(rec + 16, cnt, e);
                }
            }
            DT_CHECK(sum >= -N && sum <= N);
            want[segs[i].offset + e] = fp32 ? acc : (float)sum * (w * scale);
        }
        body = fp32 ? 4 * cnt : (cnt / 64) * 16 + ((cnt % 64) * 2 + 7) / 8;
        off += 16 + pad8(body);
    }
}

/* ring_segment of distopt.h, written again: part i of count split into n near-equal parts. */
static void part(uint64_t count, int n, int i, uint64_t *first, uint64_t *len) {
    uint64_t q = count / (uint64_t)n, rem = count % (uint64_t)n, ui = (uint64_t)i;
    *first = ui * q + (ui < rem ? ui : rem);
    *len = q + (ui < rem ? 1 : 0);
}

static int mod(long long a, int n) { return (int)(((a % n) + n) % n); }

static int half_bits; /* 16: the widths below are fp16/bf16's; 0: the integer sums' */

/* Bytes a rank at position pos of a ring of n receives in a pass over `count` groups: a
   reduce-scatter (k0: the codes each member's sums hold) or an allgather of w(N)-bit sums. */
static uint64_t pass_bytes(uint64_t count, int n, int pos, int gather, uint64_t k0, int N) {
    uint64_t total = 0, f, len;
    int s;
    for (s = 0; s < n - 1; s++) {
        part(count, n, mod(gather ? (long long)pos - s : (long long)pos - s - 1, n), &f, &len);
        total += len * 8 * (half_bits ? 16u : gather ? width_of((uint64_t)N) : width_of((uint64_t)(s + 1) * k0));
    }
    return total;
}

/* What the spec says a rank receives: flat (L = 1), or hosts of L ranks (host h, place j). */
static uint64_t expected_bytes(uint64_t groups, int N, int L, int h, int j, int rank) {
    uint64_t cf, cl;
    int H = N / L;
    if (L == 1) return pass_bytes(groups, N, rank, 0, 1, N) + pass_bytes(groups, N, rank, 1, 1, N);
    part(groups, L, (j + 1) % L, &cf, &cl);
    return pass_bytes(groups, L, j, 0, 1, N) + pass_bytes(cl, H, h, 0, (uint64_t)L, N) +
           pass_bytes(cl, H, h, 1, 1, N) + pass_bytes(groups, L, j, 1, 1, N);
}

static uint64_t total_groups(size_t fp32_below) {
    uint64_t g = 0;
    size_t i;
    for (i = 0; i < NSEGS; i++)
        if (seg_sizes[i] >= fp32_below) g += (seg_sizes[i] + 63) / 64;
    return g;
}

/* ------------------------------------------------------------------ the ring against the reference */

typedef struct ring_case {
    size_t fp32_below;
    int kind;          /* fill's */
    dopt_ef_mode ef;
    int buckets;       /* ring_buckets (0: automatic, one bucket at these sizes) */
} ring_case;

/* Host tables for every layout of N ranks into hosts of L >= 2 ranks (H = N / L >= 2), in blocks
   (rank r on host r / L) and interleaved (host r % H); layout 0 is flat. Returns how many. */
static int layouts(int N, int (*host_of)[8], int *local) {
    int k = 0, L, r;
    local[k++] = 1;
    for (L = 2; L <= N / 2; L++) {
        if (N % L) continue;
        for (r = 0; r < N; r++) host_of[k][r] = r / L;
        local[k++] = L;
        for (r = 0; r < N; r++) host_of[k][r] = r % (N / L);
        local[k++] = L;
    }
    return k;
}

static void check_case(dopt_comm *c, const ring_case *rc, int layout_local, int steps) {
    dopt_segment segs[NSEGS];
    size_t n = make_segments(segs);
    float *g = (float *)malloc(n * sizeof(float)), *h = (float *)malloc(n * sizeof(float));
    float *want = (float *)malloc(n * sizeof(float));
    dopt_compressor ring, ag;
    dopt_compressor_config cfg;
    dopt_host_layout lay;
    int step, N = c->size;
    memset(&cfg, 0, sizeof cfg);
    cfg.seed = 99;
    cfg.fp32_below = rc->fp32_below;
    cfg.error_feedback = rc->ef;
    if (rc->kind == 1) cfg.clip_c = DOPT_CLIP_OFF;
    cfg.aggregate = DOPT_AGG_RING;
    cfg.ring_buckets = rc->buckets;
    DT_OK(dopt_compressor_init(&ring, &cfg, segs, NSEGS));
    cfg.aggregate = DOPT_AGG_ALLGATHER;
    DT_OK(dopt_compressor_init(&ag, &cfg, segs, NSEGS));
    DT_OK(dopt_comm_host_layout(c, &lay));
    for (step = 0; step < steps; step++) {
        uint64_t before = c->traffic.received[DOPT_COLL_EXCHANGE], got;
        fill(g, n, segs, c->rank, step, rc->kind);
        memcpy(h, g, n * sizeof(float));
        DT_OK(dopt_compress_allreduce(&ring, c, g, n));
        DT_OK(dopt_compress_allreduce(&ag, c, h, n));
        DT_CHECK(ag.path == DOPT_PATH_ALLGATHER);
        DT_CHECKF(ring.path == (N == 1 ? DOPT_PATH_ALLGATHER : layout_local > 1 ? DOPT_PATH_RING_TWO_LEVEL : DOPT_PATH_RING),
                  "rank %d of %d, hosts of %d: path %d", c->rank, N, layout_local, (int)ring.path);
        reference(&ag, N, segs, want, n);
        DT_CHECKF(memcmp(g, want, n * sizeof(float)) == 0, "rank %d of %d, hosts of %d, step %d: ring != reference",
                  c->rank, N, layout_local, step);
        DT_CHECKF(memcmp(h, want, n * sizeof(float)) == 0, "rank %d of %d: allgather != reference", c->rank, N);
        got = c->traffic.received[DOPT_COLL_EXCHANGE] - before;
        if (N > 1) { /* each bucket goes round the rings on its own */
            uint64_t w = 0, f, len;
            int nb = rc->buckets > 0 ? rc->buckets : 1, k;
            for (k = 0; k < nb; k++) {
                part(total_groups(rc->fp32_below), nb, k, &f, &len);
                w += expected_bytes(len, N, layout_local, layout_local > 1 ? lay.host : 0,
                                    layout_local > 1 ? lay.local_rank : 0, c->rank);
            }
            DT_CHECKF(ring.buckets == nb, "rank %d of %d: %d buckets, configured %d", c->rank, N, ring.buckets, nb);
            DT_CHECKF(got == w, "rank %d of %d, hosts of %d: received %llu bytes in exchanges, the widths give %llu",
                      c->rank, N, layout_local, (unsigned long long)got, (unsigned long long)w);
        }
    }
    DT_CHECK(ring.step == ag.step && ring.step == (uint64_t)steps);
    dopt_compressor_free(&ring);
    dopt_compressor_free(&ag);
    free(g);
    free(h);
    free(want);
}

static const ring_case ring_cases[] = {
    {0, 0, DOPT_EF_AUTO, 0},  /* every segment ternary, one bucket */
    {10, 0, DOPT_EF_ON, 3},   /* the 3- and 1-element segments as fp32; error feedback carried over steps;
                                 3 buckets of 33 or 34 groups, cutting segments inside and at a short block */
    {0, 1, DOPT_EF_AUTO, 13}, /* every sum at ±N; 13 buckets */
};

static void body_ring_reference(dopt_comm *c, void *arg) {
    const ring_case *rc = (const ring_case *)arg;
    int host_of[16][8], local[16], k, nl = layouts(c->size, host_of, local);
    for (k = 0; k < nl; k++) {
        DT_OK(dopt_comm_set_hosts(c, local[k] > 1 ? host_of[k] : NULL, local[k] > 1 ? DOPT_TWO_LEVEL_ON : DOPT_TWO_LEVEL_OFF));
        check_case(c, rc, local[k], 2);
    }
}
DTEST_WORLDS_EACH(integer_ring_equals_a_serial_integer_reference_flat_and_by_host, body_ring_reference, ring_cases, 1, 8);

/* 2 hosts of 2, 32769 groups: place 0 carries 16385 groups across hosts and place 1 16384, so
   the chunks of their cross-host rings hold 8193 and 8192 groups, on either side of a piece
   boundary (4096 groups). Every rank must still cut the same number of pieces: the exchanges
   are numbered on the whole communicator, and the host's rings that follow pair the places. */
static void body_ring_piece_boundary(dopt_comm *c, void *arg) {
    size_t n = (size_t)32769 * 64;
    dopt_segment seg = {0, n, "w"};
    float *g = (float *)malloc(n * sizeof(float)), *h = (float *)malloc(n * sizeof(float));
    int host_of[4] = {0, 0, 1, 1};
    dopt_compressor ring, ag;
    dopt_compressor_config cfg;
    (void)arg;
    memset(&cfg, 0, sizeof cfg);
    cfg.aggregate = DOPT_AGG_RING;
    cfg.ring_buckets = 1;
    DT_OK(dopt_compressor_init(&ring, &cfg, &seg, 1));
    cfg.aggregate = DOPT_AGG_ALLGATHER;
    DT_OK(dopt_compressor_init(&ag, &cfg, &seg, 1));
    DT_OK(dopt_comm_set_hosts(c, host_of, DOPT_TWO_LEVEL_ON));
    fill(g, n, &seg, c->rank, 0, 0);
    memcpy(h, g, n * sizeof(float));
    DT_OK(dopt_compress_allreduce(&ring, c, g, n));
    DT_OK(dopt_compress_allreduce(&ag, c, h, n));
    DT_CHECK(ring.path == DOPT_PATH_RING_TWO_LEVEL);
    DT_CHECK(memcmp(g, h, n * sizeof(float)) == 0);
    dopt_compressor_free(&ring);
    dopt_compressor_free(&ag);
    free(g);
    free(h);
}
DTEST_WORLDS_ON(integer_ring_cuts_as_many_pieces_on_every_ring, body_ring_piece_boundary, NULL, 4, 4, WORLD_MASK_TCP);

/* ------------------------------------------------------------------ majority vote, fp16, bf16 */

/* The majority's expected result from the gathered messages: S = Σ_r (1 - 2·bit_r), ±v by its
   sign, 0 on a tie; v = 1, or with majority_l1 the ranks' scales summed in rank order times 1/N. */
static void vote_reference(const dopt_compressor *ag, int N, const dopt_segment *segs, float *want) {
    size_t off = DOPT_COMPRESS_HEADER_BYTES, i, e;
    float w = 1.0f / (float)N;
    for (i = 0; i < NSEGS; i++) {
        size_t cnt = segs[i].count;
        float v = 0.0f;
        int r;
        for (r = 0; r < N; r++) {
            float sc;
            memcpy(&sc, (const unsigned char *)dopt_compress_message(ag, r, NULL) + off + 12, 4);
            v += sc;
        }
        v = ag->cfg.majority_l1 ? v * w : 1.0f;
        for (e = 0; e < cnt; e++) {
            int S = 0;
            for (r = 0; r < N; r++) {
                const unsigned char *body = (const unsigned char *)dopt_compress_message(ag, r, NULL) + off + 16;
                size_t blk = e / 64, t = e % 64, m = cnt - blk * 64 < 64 ? cnt - blk * 64 : 64, q = (m + 7) / 8;
                S += 1 - 2 * ((body[blk * 8 + t % q] >> (t / q)) & 1);
            }
            want[segs[i].offset + e] = S > 0 ? v : S < 0 ? -v : 0.0f;
        }
        off += 16 + pad8((cnt / 64) * 8 + ((cnt % 64) + 7) / 8);
    }
}

static float half_to_f32(dopt_codec codec, uint16_t h) {
    if (codec == DOPT_CODEC_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    } else {
        int e = (h >> 10) & 31, m = h & 1023;
        float f = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(m | 1024), e - 25);
        return h & 0x8000 ? -f : f;
    }
}

/* The flat ring's fp16/bf16 result, written as the spec says: element e of chunk c (the groups
   of chunk c of N) starts as rank c's value and takes ranks c + 1, c + 2, ... in turn, each fold
   the mean (m·k + x)/(k + 1) in fp32 rounded to 16 bits (by the library's own rounding, which
   tests/test_compress.c checks against a reference). */
static void half_reference(const dopt_compressor *ag, int N, const dopt_segment *segs, float *want) {
    size_t off = DOPT_COMPRESS_HEADER_BYTES, i, e, g0 = 0;
    uint64_t G = total_groups(0);
    int fmt = ag->cfg.codec == DOPT_CODEC_FP16 ? DOPT__RING_F16 : DOPT__RING_BF16;
    for (i = 0; i < NSEGS; i++) {
        size_t cnt = segs[i].count;
        for (e = 0; e < cnt; e++) {
            uint64_t g = g0 + e / 64, f, len;
            int c = 0, k, r;
            uint16_t m = 0, x;
            for (c = 0; c < N; c++) {
                part(G, N, c, &f, &len);
                if (g >= f && g < f + len) break;
            }
            for (k = 0; k < N; k++) {
                r = (c + k) % N;
                memcpy(&x, (const unsigned char *)dopt_compress_message(ag, r, NULL) + off + 16 + 2 * e, 2);
                if (k == 0) {
                    m = x;
                } else {
                    float a = half_to_f32(ag->cfg.codec, m) * (float)k, b = half_to_f32(ag->cfg.codec, x);
                    m = fmt == DOPT__RING_F16 ? dopt__f32_to_f16((a + b) / (float)(k + 1)) : dopt__f32_to_bf16((a + b) / (float)(k + 1));
                }
            }
            want[segs[i].offset + e] = half_to_f32(ag->cfg.codec, m);
        }
        g0 += (cnt + 63) / 64;
        off += 16 + pad8(2 * cnt);
    }
}

typedef struct codec_case {
    dopt_codec codec;
    int l1;
} codec_case;

static const codec_case codec_cases[] = {
    {DOPT_CODEC_MAJORITY, 0},
    {DOPT_CODEC_MAJORITY, 1},
    {DOPT_CODEC_FP16, 0},
    {DOPT_CODEC_BF16, 0},
};

/* Majority vote on the ring equals the vote over the gathered messages, bit for bit, on every
   layout; its bytes are ternary's widths. fp16 and bf16 on the flat ring equal the reference of
   the ring's order; on every layout the same bits on every rank, run after run, within the
   rounding of the mean. */
static void body_codecs(dopt_comm *c, void *arg) {
    const codec_case *cc = (const codec_case *)arg;
    int host_of[16][8], local[16], k, nl = layouts(c->size, host_of, local), N = c->size, step;
    dopt_segment segs[NSEGS];
    size_t n = make_segments(segs), e;
    float *g = (float *)malloc(n * sizeof(float)), *h = (float *)malloc(n * sizeof(float));
    float *want = (float *)malloc(n * sizeof(float)), *all = (float *)malloc(n * sizeof(float) * (size_t)N);
    for (k = 0; k < nl; k++) {
        dopt_compressor ring, ag;
        dopt_compressor_config cfg;
        dopt_host_layout lay;
        memset(&cfg, 0, sizeof cfg);
        cfg.codec = cc->codec;
        cfg.majority_l1 = cc->l1;
        cfg.aggregate = DOPT_AGG_RING;
        DT_OK(dopt_compressor_init(&ring, &cfg, segs, NSEGS));
        cfg.aggregate = DOPT_AGG_ALLGATHER;
        DT_OK(dopt_compressor_init(&ag, &cfg, segs, NSEGS));
        DT_OK(dopt_comm_set_hosts(c, local[k] > 1 ? host_of[k] : NULL, local[k] > 1 ? DOPT_TWO_LEVEL_ON : DOPT_TWO_LEVEL_OFF));
        DT_OK(dopt_comm_host_layout(c, &lay));
        for (step = 0; step < 2; step++) {
            uint64_t before = c->traffic.received[DOPT_COLL_EXCHANGE], got;
            fill(g, n, segs, c->rank, step, 0);
            if (c->rank % 2) /* some elements tie at even N */
                for (e = 0; e < n; e += 5) g[e] = -g[e];
            memcpy(h, g, n * sizeof(float));
            DT_OK(dopt_compress_allreduce(&ring, c, g, n));
            DT_OK(dopt_compress_allreduce(&ag, c, h, n));
            DT_CHECK(ring.path == (N == 1 ? DOPT_PATH_ALLGATHER : local[k] > 1 ? DOPT_PATH_RING_TWO_LEVEL : DOPT_PATH_RING));
            got = c->traffic.received[DOPT_COLL_EXCHANGE] - before;
            half_bits = cc->codec == DOPT_CODEC_MAJORITY ? 0 : 16;
            if (N > 1)
                DT_CHECKF(got == expected_bytes(total_groups(0), N, local[k], local[k] > 1 ? lay.host : 0,
                                                local[k] > 1 ? lay.local_rank : 0, c->rank),
                          "rank %d of %d, hosts of %d: %llu bytes received", c->rank, N, local[k], (unsigned long long)got);
            if (cc->codec == DOPT_CODEC_MAJORITY) {
                vote_reference(&ag, N, segs, want);
                DT_CHECKF(memcmp(g, want, n * sizeof(float)) == 0 && memcmp(h, want, n * sizeof(float)) == 0,
                          "rank %d of %d, hosts of %d: majority differs from the reference", c->rank, N, local[k]);
            } else {
                DT_OK(dopt_allgather(c, g, all, n * sizeof(float)));
                DT_CHECKF(memcmp(all, all + n * (size_t)(N - 1), n * sizeof(float)) == 0, "rank %d: ranks differ", c->rank);
                if (local[k] == 1) {
                    half_reference(&ag, N, segs, want);
                    for (e = 0; e < n; e++)
                        DT_CHECKF(memcmp(&g[e], &want[e], 4) == 0, "rank %d of %d: element %zu: %g, the ring's order gives %g",
                                  c->rank, N, e, (double)g[e], (double)want[e]);
                }
                for (e = 0; e < n; e++) /* the allgather path sums in rank order: close, not equal (the */
                    DT_CHECKF(fabsf(g[e] - h[e]) <= 1e-3f, /* inputs are at most 0.01; a bf16 step is 2^-7 of it */
                              "rank %d: element %zu: %g against %g", c->rank, e, (double)g[e], (double)h[e]);
            }
        }
        dopt_compressor_free(&ring);
        dopt_compressor_free(&ag);
    }
    free(g);
    free(h);
    free(want);
    free(all);
}
DTEST_WORLDS_EACH(majority_fp16_and_bf16_on_the_ring, body_codecs, codec_cases, 1, 8);

/* ------------------------------------------------------------------ failures and choices */

/* One rank's NaN: every rank returns NONFINITE before any exchange, grads and step untouched,
   whatever the codec (ternary learns it from the scale sharing, majority from the allgather of
   the scales, fp16 and bf16 from a reduced flag); the next step goes on. */
static const dopt_codec nonfinite_codecs[] = {DOPT_CODEC_TERNARY, DOPT_CODEC_MAJORITY, DOPT_CODEC_FP16, DOPT_CODEC_BF16};

static void body_ring_nonfinite(dopt_comm *c, void *arg) {
    dopt_segment segs[NSEGS];
    size_t n = make_segments(segs);
    float *g = (float *)malloc(n * sizeof(float)), *copy = (float *)malloc(n * sizeof(float));
    dopt_compressor ring;
    dopt_compressor_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.codec = *(const dopt_codec *)arg;
    cfg.aggregate = DOPT_AGG_RING;
    DT_OK(dopt_compressor_init(&ring, &cfg, segs, NSEGS));
    fill(g, n, segs, c->rank, 0, 0);
    if (c->rank == c->size - 1) g[segs[5].offset + 17] = NAN;
    memcpy(copy, g, n * sizeof(float));
    DT_EQ_INT(dopt_compress_allreduce(&ring, c, g, n), DOPT_ERR_NONFINITE);
    DT_CHECK(ring.path == DOPT_PATH_NONE && ring.step == 0 && c->traffic.calls[DOPT_COLL_EXCHANGE] == 0);
    DT_CHECK(memcmp(g, copy, n * sizeof(float)) == 0);
    fill(g, n, segs, c->rank, 1, 0);
    DT_OK(dopt_compress_allreduce(&ring, c, g, n));
    DT_CHECK(ring.path == DOPT_PATH_RING && ring.step == 1);
    dopt_compressor_free(&ring);
    free(g);
    free(copy);
}
DTEST_WORLDS_EACH(ring_agrees_on_a_non_finite_gradient, body_ring_nonfinite, nonfinite_codecs, 2, 3);

/* AUTO takes the allgather where it is predicted cheaper (2 ranks: 2 bits received per element
   against 2.5) and the ring where the allgather's 2·(N-1) bits grow past it (8 ranks, 4 Mi
   elements: 14 against 7.4); the counters say which ran. */
static void body_ring_auto(dopt_comm *c, void *arg) {
    size_t n = (size_t)1 << 22;
    dopt_segment seg = {0, n, "w"};
    float *g = (float *)malloc(n * sizeof(float));
    dopt_compressor cz;
    (void)arg;
    DT_OK(dopt_compressor_init(&cz, NULL, &seg, 1));
    fill(g, n, &seg, c->rank, 0, 0);
    DT_OK(dopt_compress_allreduce(&cz, c, g, n));
    if (c->size == 2) {
        DT_CHECK(cz.path == DOPT_PATH_ALLGATHER && c->traffic.calls[DOPT_COLL_EXCHANGE] == 0 && cz.buckets == 0);
    } else { /* 65536 groups: 4 automatic buckets of 16384 */
        DT_CHECK(cz.path == DOPT_PATH_RING && c->traffic.calls[DOPT_COLL_EXCHANGE] > 0);
        DT_CHECKF(cz.buckets == 4, "%d buckets", cz.buckets);
    }
    dopt_compressor_free(&cz);
    free(g);
}
DTEST_WORLDS_ON(integer_ring_is_chosen_where_it_is_predicted_cheaper, body_ring_auto, NULL, 2, 2, WORLD_MASK_TCP);
DTEST_WORLDS_ON(integer_ring_is_chosen_at_8_ranks, body_ring_auto, NULL, 8, 8, WORLD_MASK_TCP);

DTEST(predicted_costs_favour_the_allgather_for_few_ranks_and_the_ring_for_many) {
    size_t groups = 1u << 18; /* 16 Mi elements */
    double m = 32 + 16 + (double)groups * 16;
    DT_CHECK(dopt__ring_predict(DOPT__RING_INT, groups, 2, 1, 2, 1, m) > dopt__ring_predict(DOPT__RING_INT, groups, 2, 1, 2, 0, m));
    DT_CHECK(dopt__ring_predict(DOPT__RING_INT, groups, 8, 1, 8, 1, m) < dopt__ring_predict(DOPT__RING_INT, groups, 8, 1, 8, 0, m));
    DT_CHECK(dopt__ring_predict(DOPT__RING_INT, groups, 8, 2, 4, 1, m) < dopt__ring_predict(DOPT__RING_INT, groups, 8, 2, 4, 0, m));
    DT_CHECK(dopt__ring_predict(DOPT__RING_INT, groups, 64, 8, 8, 1, m) < dopt__ring_predict(DOPT__RING_INT, groups, 64, 8, 8, 0, m) / 4);
}

DTEST(aggregate_and_ring_buckets_out_of_range_are_refused) {
    dopt_segment seg = {0, 10, "w"};
    dopt_compressor cz;
    dopt_compressor_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.aggregate = (dopt_aggregate)3;
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    cfg.aggregate = DOPT_AGG_RING;
    cfg.ring_buckets = -1;
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    cfg.ring_buckets = 65;
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &seg, 1), DOPT_ERR_INVALID);
    cfg.ring_buckets = 64;
    DT_OK(dopt_compressor_init(&cz, &cfg, &seg, 1));
    dopt_compressor_free(&cz);
}

/* A world of one and a communicator without exchanges take the allgather path, RING or not. */
DTEST(ring_falls_back_where_there_is_no_ring) {
    dopt_segment seg = {0, 100, "w"};
    float g[100];
    dopt_compressor cz;
    dopt_compressor_config cfg;
    dopt_comm *self;
    memset(&cfg, 0, sizeof cfg);
    cfg.aggregate = DOPT_AGG_RING;
    DT_OK(dopt_comm_create_self(&self));
    DT_OK(dopt_compressor_init(&cz, &cfg, &seg, 1));
    fill(g, 100, &seg, 0, 0, 0);
    DT_OK(dopt_compress_allreduce(&cz, self, g, 100));
    DT_CHECK(cz.path == DOPT_PATH_ALLGATHER);
    dopt_compressor_free(&cz);
    dopt_comm_destroy(self);
}

/* ------------------------------------------------------------------ kernels */

/* The test's own planes: w words per group, word j holding bit j of the 64 values v = S + K. */
static void planes_of(const int *S, size_t groups, int K, unsigned w, unsigned char *out) {
    size_t g;
    unsigned j, t;
    for (g = 0; g < groups; g++)
        for (j = 0; j < w; j++) {
            uint64_t word = 0;
            for (t = 0; t < 64; t++) word |= (uint64_t)(((unsigned)(S[g * 64 + t] + K) >> j) & 1u) << t;
            memcpy(out + (g * w + j) * 8, &word, 8);
        }
}

/* The vector kernels give the portable ones' bits, and both the spec's values, at every width,
   bias and tail; a value beyond 2K is refused by both. */
DTEST(ring_kernels_vector_and_portable_agree) {
    enum { G = 37 };
    static int S[G * 64], T[G * 64];
    static unsigned char pa[G * 8 * 16], pb[G * 8 * 16], o1[G * 8 * 16], o2[G * 8 * 16], want[G * 8 * 16];
    static unsigned char body[G * 16], own1[G * 16], own2[G * 16], ownw[G * 16];
    static float y1[G * 64], y2[G * 64];
    uint64_t s = 5;
    unsigned w, j;
    int top;
    size_t i, n = G * 64 - 13;
    /* own: a ternary body of n elements (the last block partial) to planes of t + 1 */
    for (i = 0; i < sizeof body; i++) body[i] = (unsigned char)(lcg_next(&s) & 0xFF);
    for (i = 0; i < sizeof body; i++) body[i] = (unsigned char)(body[i] & ~(body[i] >> 1 & 0x55)); /* no code 11 */
    memset(body + (n / 64) * 16 + ((n % 64) * 2 + 7) / 8, 0, sizeof body - (n / 64) * 16 - ((n % 64) * 2 + 7) / 8);
    for (i = 0; i < G * 64; i++) T[i] = i < n ? code_at(body, n, i) : 0;
    planes_of(T, G, 1, 2, ownw);
    dopt__ring_own_portable(body, n, own1);
    dopt__ring_own(body, n, own2);
    DT_CHECK(memcmp(own1, ownw, sizeof ownw) == 0 && memcmp(own2, ownw, sizeof ownw) == 0);
    for (w = 2; w <= 15; w++)
        for (top = 0; top < 2; top++) {
            int K = top ? (1 << (w - 1)) - 1 : 1 << (w - 2); /* the largest and the smallest bias of width w */
            int Kb = 1 + (int)(w % 3), Ko = K + Kb;
            dopt__planes a = {pa, 0, w, K, 0}, b = {pb, 0, 0, Kb, 0}, out1 = {o1, 0, 0, Ko, 0}, out2 = {o2, 0, 0, Ko, 0};
            b.w = width_of((uint64_t)Kb), out1.w = out2.w = width_of((uint64_t)Ko);
            DT_CHECK(width_of((uint64_t)K) == w);
            for (i = 0; i < G * 64; i++) {
                S[i] = (int)(lcg_next(&s) % (uint64_t)(2 * K + 1)) - K;
                T[i] = (int)(lcg_next(&s) % (uint64_t)(2 * Kb + 1)) - Kb;
            }
            planes_of(S, G, K, w, pa);
            planes_of(T, G, Kb, b.w, pb);
            for (i = 0; i < G * 64; i++) T[i] += S[i];
            planes_of(T, G, Ko, out1.w, want);
            DT_CHECK(dopt__ring_fold_portable(&a, &b, &out1, 0, G) == 0);
            DT_CHECK(dopt__ring_fold(&a, &b, &out2, 0, G) == 0);
            DT_CHECKF(memcmp(o1, want, (size_t)G * 8 * out1.w) == 0 && memcmp(o2, want, (size_t)G * 8 * out1.w) == 0,
                      "fold, width %u", w);
            dopt__ring_decode_portable(y1, n, K, w, 0.25f, 0, pa);
            dopt__ring_decode(y2, n, K, w, 0.25f, 0, pa);
            DT_CHECKF(memcmp(y1, y2, n * sizeof(float)) == 0, "decode, width %u", w);
            for (i = 0; i < n; i++) DT_CHECK(y1[i] == (float)S[i] * 0.25f);
            dopt__ring_decode_portable(y1, n, K, w, 0.25f, 1, pa); /* majority: the sign, 0 on a tie */
            dopt__ring_decode(y2, n, K, w, 0.25f, 1, pa);
            DT_CHECKF(memcmp(y1, y2, n * sizeof(float)) == 0, "vote, width %u", w);
            for (i = 0; i < n; i++) DT_CHECK(y1[i] == (S[i] > 0 ? 0.25f : S[i] < 0 ? -0.25f : 0.0f));
            for (j = 0; j < w; j++) pa[5 * 8 * w + 8 * j + 7] |= 0x80; /* group 5, element 63: 2^w - 1 > 2K */
            DT_CHECK(dopt__ring_fold_portable(&a, &b, &out1, 0, G) != 0);
            DT_CHECK(dopt__ring_fold(&a, &b, &out2, 0, G) != 0);
        }
}

DTEST_MAIN()
