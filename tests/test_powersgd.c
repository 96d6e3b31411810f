/* Tests of compress.h's PowerSGD (Vogels, Karimireddy, Jaggi 2019; DESIGN §5.7) over real worlds
   of 2-4 processes on every transport of worlds.h: a gradient of rank r comes back exactly, the
   output matches a slow reference in double (which pins the warm start and the order of
   Gram–Schmidt), the residual is exactly M − M̂, a run resumed from saved state gives the same
   bits, vectors and small matrices pass as the fp32 mean, a zero gradient does not stall the warm
   start, a non-finite gradient (or a product beyond 2^64) on one rank stops every rank with
   nothing changed, and the configuration and state checks. Built three ways (Makefile): with
   OpenBLAS's sgemm, without BLAS (the plain loops, multiply-adds fused where the compiler likes),
   and with -Ofast / -ffast-math. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../compress.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "dtest.h"
#include "worlds.h"

/* ------------------------------------------------------------------ the layout and its data */

/* A matrix PowerSGD compresses at r <= 4 (96 × 80), a vector, a gap, a matrix below the default
   powersgd_min (40 × 30), a matrix too flat to gain at r >= 2 (2 × 2500: 2·2502 > 5000; at r = 1
   it is compressed), and another compressed one (64 × 72). */
enum { PS_N = 7680 + 80 + 3 + 1200 + 5000 + 4608, PS_NSEGS = 5 };
static const dopt_segment ps_segs[PS_NSEGS] = {{0, 7680, "w1", 96},
                                               {7680, 80, "b1", 0},
                                               {7763, 1200, "w2", 40},
                                               {8963, 5000, "w3", 2},
                                               {13963, 4608, "w4", 64}};
enum { PS_COUNT = PS_N - 3 }; /* elements in segments: the residual's length */

/* The documented rule, written out again: a matrix is compressed when r·(rows + cols) < count
   and count >= powersgd_min. */
static int ps_compressed(const dopt_segment *s, size_t r, size_t min) {
    return s->rows != 0 && s->count >= min && r * (s->rows + s->count / s->rows) < s->count;
}

static uint64_t lcg_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}

static double lcg_unit(uint64_t *s) { return (double)lcg_next(s) / 9007199254740992.0; }

/* Gaussian-ish values of scale 1e-2, the same for the same key. */
static void fill_noise(float *g, size_t n, uint64_t key) {
    uint64_t s = key * 2654435761u + 7;
    size_t i;
    for (i = 0; i < n; i++) g[i] = (float)((lcg_unit(&s) + lcg_unit(&s) + lcg_unit(&s) - 1.5) * 1e-2);
}

/* Rank `rank`'s gradient at `step`: noise everywhere, the gap 1234. */
static void ps_grad(float *g, int rank, int step) {
    size_t i;
    fill_noise(g, PS_N, (uint64_t)rank * 1000 + (uint64_t)step + 1);
    for (i = 7760; i < 7763; i++) g[i] = 1234.0f;
}

static dopt_compressor_config ps_config(unsigned r) {
    dopt_compressor_config c;
    memset(&c, 0, sizeof c);
    c.codec = DOPT_CODEC_POWERSGD;
    c.seed = 42;
    c.powersgd_rank = r;
    return c;
}

/* The same float: bit for bit, but for the sign of a zero in a -ffast-math build. */
static int same_bits(float a, float b) {
    uint32_t u = dopt__f32_bits(a), v = dopt__f32_bits(b);
#ifdef __FAST_MATH__
    if (((u | v) & 0x7FFFFFFFu) == 0) return 1;
#endif
    return u == v;
}

/* A value the test recomputes from the same floats: bit for bit in a strict build; within 2^-20
   of the larger in a -ffast-math one, where the compiler may reassociate either side. */
static int same_as_recomputed(float a, float b) {
#ifdef __FAST_MATH__
    return same_bits(a, b) || fabs((double)a - (double)b) <= (fabs((double)a) + fabs((double)b)) / 1048576.0;
#else
    return same_bits(a, b);
#endif
}

/* The state as bytes (the caller frees them). */
static unsigned char *ps_state(const dopt_compressor *cz, size_t *bytes) {
    unsigned char *s;
    *bytes = dopt_compress_state_bytes(cz);
    s = (unsigned char *)malloc(*bytes);
    DT_CHECK(s != NULL);
    DT_OK(dopt_compress_state_save(cz, s, *bytes));
    return s;
}

/* Where the state keeps the residual (the segments one after another) and the Q's. */
static const float *ps_state_residual(const unsigned char *state) { return (const float *)(const void *)(state + 32); }

static size_t ps_nmat(size_t r, size_t min) {
    size_t i, k = 0;
    for (i = 0; i < PS_NSEGS; i++) k += (size_t)ps_compressed(&ps_segs[i], r, min);
    return k;
}

static size_t ps_state_q_offset(size_t r) { return 32 + 4 * (size_t)PS_COUNT + 8 + 16 * ps_nmat(r, 4096); }

/* Every rank's buf (n floats) is bitwise the same as rank 0's. */
static void ps_same_on_every_rank(dopt_comm *c, const float *buf, size_t n, const char *what) {
    float *all = (float *)malloc((size_t)c->size * n * sizeof(float));
    int r;
    DT_CHECK(all != NULL);
    DT_OK(dopt_allgather(c, buf, all, n * sizeof(float)));
    for (r = 1; r < c->size; r++)
        DT_CHECKF(memcmp(all, all + (size_t)r * n, n * sizeof(float)) == 0, "%s: rank %d differs from rank 0", what, r);
    free(all);
}

/* max |x| of a segment's floats. */
static double ps_maxabs(const float *x, size_t n) {
    double m = 0.0;
    size_t i;
    for (i = 0; i < n; i++) m = fabs((double)x[i]) > m ? fabs((double)x[i]) : m;
    return m;
}

/* Every rank's g, averaged in double into mean (PS_N), and the mean of |g| into ps_absmean. */
static double ps_absmean[PS_N];

static void ps_mean_of_ranks(int size, int step, double *mean) {
    static float g[PS_N];
    size_t i;
    int r;
    memset(mean, 0, PS_N * sizeof(double));
    memset(ps_absmean, 0, sizeof ps_absmean);
    for (r = 0; r < size; r++) {
        ps_grad(g, r, step);
        for (i = 0; i < PS_N; i++) mean[i] += (double)g[i] / size, ps_absmean[i] += fabs((double)g[i]) / size;
    }
}

/* out holds the fp32 mean of the ranks' segment: bit for bit at N = 2, where the sum of two is
   the same in any order and halving is exact; beyond, within the rounding of a float sum in
   some order (N units of 2^-24 of the mean of |g|) and of the scaling. */
static void ps_expect_mean(const dopt_comm *c, const float *out, const double *mean, const float *mine, size_t off,
                           size_t n, const char *what) {
    size_t i;
    for (i = 0; i < n; i++) {
        double tol = (c->size + 2) * 6e-8 * ps_absmean[off + i];
        if (c->size == 2) {
            float other = (float)(2.0 * mean[off + i] - (double)mine[off + i]); /* exact: the other rank's value */
            float want = (mine[off + i] + other) * 0.5f;
            DT_CHECKF(same_as_recomputed(out[off + i], want), "%s, element %zu: %a, mean %a", what, i, out[off + i], want);
        } else {
            DT_CHECKF(fabs((double)out[off + i] - mean[off + i]) <= tol, "%s, element %zu: %.9g, mean %.9g", what, i,
                      out[off + i], mean[off + i]);
        }
    }
}

/* ------------------------------------------------------------------ a gradient of rank r */

/* m = A·Bᵀ (rows × cols) of rank r, A uniform in (−1, 1) from key; B (cols × r) given, or drawn
   too when b is NULL. */
static void ps_low_rank(float *m, size_t rows, size_t cols, size_t r, uint64_t key, const float *b) {
    float a[96 * 4], drawn[2500 * 4];
    size_t i, j, k;
    uint64_t s = key;
    DT_CHECK(rows * r <= 96 * 4 && cols * r <= 2500 * 4);
    for (i = 0; i < rows * r; i++) a[i] = (float)(2.0 * lcg_unit(&s) - 1.0);
    for (i = 0; i < cols * r; i++) drawn[i] = (float)(2.0 * lcg_unit(&s) - 1.0);
    if (b == NULL) b = drawn;
    for (i = 0; i < rows; i++)
        for (j = 0; j < cols; j++) {
            double v = 0.0;
            for (k = 0; k < r; k++) v += (double)a[i * r + k] * (double)b[j * r + k];
            m[i * cols + j] = (float)v;
        }
}

/* Segment seg's Q in a saved state (PowerSGD's part: 8 bytes, a record per compressed matrix,
   then the Q's in segment order). */
static const float *ps_state_q(const unsigned char *state, size_t r, size_t seg) {
    size_t off = ps_state_q_offset(r), i;
    for (i = 0; i < seg; i++)
        if (ps_compressed(&ps_segs[i], r, 4096)) off += 4 * r * (ps_segs[i].count / ps_segs[i].rows);
    return (const float *)(const void *)(state + off);
}

/* Every rank's matrices are the same A·Bᵀ of rank r, the vector differs by rank. After one step a
   compressed matrix comes back as itself — P = M·Q spans M's columns, so P·Pᵀ·M = M — within
   1e-5 of its largest element, at r = 1, 2 and 4; the rest is the mean; every rank holds the
   same bits. The float rounding of P = A·(Bᵀ·Q) is multiplied by the condition number of Bᵀ·Q,
   which a random B against the random first Q makes as large as it likes (a draw here gave 30×):
   a compressed matrix takes B = its first Q, read from the saved state, which makes Bᵀ·Q close
   to a multiple of the identity, so that the tolerance measures the method, not the draw. */
static void rank_r_body(dopt_comm *c, void *unused) {
    static const unsigned ranks[3] = {1, 2, 4};
    static float g[PS_N], want[PS_N];
    static double mean[PS_N];
    size_t t, i, k;
    (void)unused;
    for (t = 0; t < 3; t++) {
        unsigned r = ranks[t];
        dopt_compressor_config cfg = ps_config(r);
        dopt_compressor cz;
        unsigned char *first;
        size_t sb;
        DT_OK(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS));
        first = ps_state(&cz, &sb);
        ps_grad(g, c->rank, 0); /* the vector: each rank its own */
        for (i = 0; i < PS_NSEGS; i++)
            if (ps_segs[i].rows)
                ps_low_rank(g + ps_segs[i].offset, ps_segs[i].rows, ps_segs[i].count / ps_segs[i].rows, r, 99 + i,
                            ps_compressed(&ps_segs[i], r, 4096) ? ps_state_q(first, r, i) : NULL);
        free(first);
        memcpy(want, g, sizeof g);
        ps_mean_of_ranks(c->size, 0, mean); /* the vector's mean; the matrices are every rank's */
        for (i = 0; i < PS_NSEGS; i++)
            if (ps_segs[i].rows)
                for (k = ps_segs[i].offset; k < ps_segs[i].offset + ps_segs[i].count; k++)
                    mean[k] = want[k], ps_absmean[k] = fabs((double)want[k]);
        DT_OK(dopt_compress_allreduce(&cz, c, g, PS_N));
        for (i = 0; i < PS_NSEGS; i++) {
            const dopt_segment *s = &ps_segs[i];
            char what[96];
            snprintf(what, sizeof what, "r = %u, rank %d of %d, segment %s", r, c->rank, c->size, s->name);
            if (ps_compressed(s, r, 4096)) {
                double m = ps_maxabs(want + s->offset, s->count), err = 0.0;
                for (k = 0; k < s->count; k++) {
                    double d = fabs((double)g[s->offset + k] - (double)want[s->offset + k]);
                    err = d > err ? d : err;
                }
                DT_CHECKF(err <= 1e-5 * m, "%s: max error %.3g, max |M| %.3g", what, err, m);
            } else {
                ps_expect_mean(c, g, mean, want, s->offset, s->count, what);
            }
        }
        for (k = 7760; k < 7763; k++) DT_CHECK(g[k] == 1234.0f); /* the gap */
        ps_same_on_every_rank(c, g, PS_N, "the output");
        dopt_compressor_free(&cz);
    }
}

DTEST_WORLDS(rank_r_gradient_comes_back_exactly_and_identical_on_every_rank, rank_r_body, NULL, 2, 4);

/* ------------------------------------------------------------------ against a reference in double */

/* The slow, obviously-correct version of one step for one compressed matrix, from every rank's
   gradient and residual and the Q every rank starts from: M_m = g_m + E_m (in float, as the
   library forms it), P = mean M_m·Q, Gram–Schmidt on columns 0, 1, ..., r−1, Q' = mean M_mᵀ·P,
   M̂ = P·Q'ᵀ, all in double. */
typedef struct ps_ref {
    size_t rows, cols, r;
    double *p, *q, *mhat;
} ps_ref;

static void ps_ref_step(ps_ref *f, int size, const float *const *g, const float *const *e, const float *q0) {
    size_t rows = f->rows, cols = f->cols, r = f->r, i, j, k, l;
    int m;
    memset(f->p, 0, rows * r * sizeof(double));
    memset(f->q, 0, cols * r * sizeof(double));
    for (m = 0; m < size; m++)
        for (i = 0; i < rows; i++)
            for (j = 0; j < cols; j++) {
                double x = (double)(g[m][i * cols + j] + e[m][i * cols + j]);
                for (k = 0; k < r; k++) f->p[i * r + k] += x * (double)q0[j * r + k] / size;
            }
    for (k = 0; k < r; k++) { /* Gram–Schmidt, column k against 0..k-1 */
        double n = 0.0;
        for (l = 0; l < k; l++) {
            double d = 0.0;
            for (i = 0; i < rows; i++) d += f->p[i * r + l] * f->p[i * r + k];
            for (i = 0; i < rows; i++) f->p[i * r + k] -= d * f->p[i * r + l];
        }
        for (i = 0; i < rows; i++) n += f->p[i * r + k] * f->p[i * r + k];
        DT_CHECK(n > 0.0);
        for (i = 0; i < rows; i++) f->p[i * r + k] /= sqrt(n);
    }
    for (m = 0; m < size; m++)
        for (i = 0; i < rows; i++)
            for (j = 0; j < cols; j++) {
                double x = (double)(g[m][i * cols + j] + e[m][i * cols + j]);
                for (k = 0; k < r; k++) f->q[j * r + k] += x * f->p[i * r + k] / size;
            }
    for (i = 0; i < rows; i++)
        for (j = 0; j < cols; j++) {
            double v = 0.0;
            for (k = 0; k < r; k++) v += f->p[i * r + k] * f->q[j * r + k];
            f->mhat[i * cols + j] = v;
        }
}

/* max |a − b| <= tol · max |b| over n values (float against double). */
static void ps_expect_close(const float *a, const double *b, size_t n, double tol, const char *what) {
    double m = 0.0, err = 0.0;
    size_t i;
    for (i = 0; i < n; i++) {
        m = fabs(b[i]) > m ? fabs(b[i]) : m;
        err = fabs((double)a[i] - b[i]) > err ? fabs((double)a[i] - b[i]) : err;
    }
    DT_CHECKF(err <= tol * m, "%s: max error %.3g, max %.3g", what, err, m);
}

/* Three steps at r = 2 and r = 4: every compressed matrix's output against the reference, and the
   Q the state keeps for the next step against the reference's Q' (the warm start: the basis, so
   Gram–Schmidt's order too). Every rank's gradient is known to all; the residuals and Q come from
   every rank's saved state. */
static void reference_body(dopt_comm *c, void *unused) {
    static const unsigned ranks[2] = {2, 4};
    static float g[PS_N], mine[PS_N], others[4][PS_N];
    size_t t, i, sb;
    int step, m;
    (void)unused;
    for (t = 0; t < 2; t++) {
        size_t r = ranks[t];
        dopt_compressor_config cfg = ps_config((unsigned)r);
        dopt_compressor cz;
        DT_OK(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS));
        sb = dopt_compress_state_bytes(&cz);
        for (step = 0; step < 3; step++) {
            unsigned char *before = (unsigned char *)malloc(sb * (size_t)c->size), *after;
            size_t roff = 0, qoff = ps_state_q_offset(r), ab;
            DT_CHECK(before != NULL);
            DT_OK(dopt_compress_state_save(&cz, before + sb * (size_t)c->rank, sb));
            DT_OK(dopt_allgather(c, before + sb * (size_t)c->rank, before, sb));
            for (m = 0; m < c->size; m++) ps_grad(others[m], m, step);
            ps_grad(g, c->rank, step);
            memcpy(mine, g, sizeof g);
            DT_OK(dopt_compress_allreduce(&cz, c, g, PS_N));
            after = ps_state(&cz, &ab);
            for (i = 0; i < PS_NSEGS; i++) {
                const dopt_segment *s = &ps_segs[i];
                if (ps_compressed(s, r, 4096)) {
                    const float *gs[4], *es[4], *q0 = (const float *)(const void *)(before + qoff);
                    ps_ref f;
                    char what[96];
                    f.rows = s->rows, f.cols = s->count / s->rows, f.r = r;
                    f.p = (double *)malloc(f.rows * r * sizeof(double));
                    f.q = (double *)malloc(f.cols * r * sizeof(double));
                    f.mhat = (double *)malloc(s->count * sizeof(double));
                    DT_CHECK(f.p && f.q && f.mhat);
                    for (m = 0; m < c->size; m++) {
                        gs[m] = others[m] + s->offset;
                        es[m] = (const float *)(const void *)(before + sb * (size_t)m + 32) + roff;
                        DT_CHECK(memcmp(before + sb * (size_t)m + qoff, q0, 4 * f.cols * r) == 0); /* one Q */
                    }
                    ps_ref_step(&f, c->size, gs, es, q0);
                    snprintf(what, sizeof what, "r = %zu, step %d, rank %d of %d, %s: output", r, step, c->rank, c->size,
                             s->name);
                    ps_expect_close(g + s->offset, f.mhat, s->count, 1e-4, what);
                    snprintf(what, sizeof what, "r = %zu, step %d, rank %d of %d, %s: the Q kept", r, step, c->rank,
                             c->size, s->name);
                    ps_expect_close((const float *)(const void *)(after + qoff), f.q, f.cols * r, 1e-4, what);
                    qoff += 4 * f.cols * r;
                    free(f.p), free(f.q), free(f.mhat);
                }
                roff += s->count;
            }
            free(before);
            free(after);
        }
        dopt_compressor_free(&cz);
    }
}

DTEST_WORLDS(output_and_warm_start_match_a_reference_in_double, reference_body, NULL, 2, 3);

/* ------------------------------------------------------------------ the residual, bit for bit */

/* E_new = (g + E_old) − output for every element of a compressed matrix, recomputed from the
   same floats (E_old and E_new from the saved state); 0 elsewhere, where the output is the fp32
   mean. Three steps, r = 2, noise gradients. */
static void residual_body(dopt_comm *c, void *unused) {
    static float g[PS_N], mine[PS_N];
    static double mean[PS_N];
    dopt_compressor_config cfg = ps_config(2);
    dopt_compressor cz;
    int step;
    (void)unused;
    DT_OK(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS));
    for (step = 0; step < 3; step++) {
        size_t b0, b1, i, k, roff = 0;
        unsigned char *before = ps_state(&cz, &b0), *after;
        const float *e0, *e1;
        ps_grad(g, c->rank, step);
        memcpy(mine, g, sizeof g);
        ps_mean_of_ranks(c->size, step, mean);
        DT_OK(dopt_compress_allreduce(&cz, c, g, PS_N));
        after = ps_state(&cz, &b1);
        e0 = ps_state_residual(before), e1 = ps_state_residual(after);
        for (i = 0; i < PS_NSEGS; i++) {
            const dopt_segment *s = &ps_segs[i];
            char what[96];
            snprintf(what, sizeof what, "step %d, rank %d of %d, %s", step, c->rank, c->size, s->name);
            for (k = 0; k < s->count; k++) {
                float m = mine[s->offset + k] + e0[roff + k];
                float want = ps_compressed(s, 2, 4096) ? m - g[s->offset + k] : 0.0f;
                if (!same_as_recomputed(e1[roff + k], want))
                    DT_CHECKF(0, "%s, element %zu: residual %a, (g + e) - output %a", what, k, e1[roff + k], want);
            }
            if (!ps_compressed(s, 2, 4096)) ps_expect_mean(c, g, mean, mine, s->offset, s->count, what);
            roff += s->count;
        }
        if (step > 0) DT_CHECK(ps_maxabs(e1, PS_COUNT) > 0.0); /* something to carry */
        free(before);
        free(after);
    }
    dopt_compressor_free(&cz);
}

DTEST_WORLDS(residual_is_g_plus_e_minus_output_bit_for_bit, residual_body, NULL, 2, 3);

/* ------------------------------------------------------------------ resume */

/* Three steps, save; three more, recording the outputs and the final state. A fresh compressor
   loaded from the saved state and given the same three gradients writes the same bits and ends
   in the same state. Two allreduces per step, nothing else. */
static void resume_body(dopt_comm *c, void *unused) {
    static float g[PS_N], out[3][PS_N];
    dopt_compressor_config cfg = ps_config(4);
    dopt_compressor a, b;
    unsigned char *saved, *end_a, *end_b;
    size_t sb, ea, eb;
    int step;
    (void)unused;
    DT_OK(dopt_compressor_init(&a, &cfg, ps_segs, PS_NSEGS));
    memset(&c->traffic, 0, sizeof c->traffic);
    for (step = 0; step < 3; step++) {
        ps_grad(g, c->rank, step);
        DT_OK(dopt_compress_allreduce(&a, c, g, PS_N));
    }
    DT_EQ_INT(c->traffic.calls[DOPT_COLL_ALLREDUCE], 6);
    DT_EQ_INT(c->traffic.calls[DOPT_COLL_ALLGATHER], 0);
    DT_CHECK(dopt_compress_message(&a, 0, NULL) == NULL); /* no messages */
    saved = ps_state(&a, &sb);
    for (step = 3; step < 6; step++) {
        ps_grad(out[step - 3], c->rank, step);
        DT_OK(dopt_compress_allreduce(&a, c, out[step - 3], PS_N));
    }
    end_a = ps_state(&a, &ea);
    DT_OK(dopt_compressor_init(&b, &cfg, ps_segs, PS_NSEGS));
    DT_OK(dopt_compress_state_load(&b, saved, sb));
    for (step = 3; step < 6; step++) {
        ps_grad(g, c->rank, step);
        DT_OK(dopt_compress_allreduce(&b, c, g, PS_N));
        DT_CHECKF(memcmp(g, out[step - 3], sizeof g) == 0, "rank %d: step %d after the resume differs", c->rank, step);
    }
    end_b = ps_state(&b, &eb);
    DT_CHECK(ea == eb && memcmp(end_a, end_b, ea) == 0);
    free(saved), free(end_a), free(end_b);
    dopt_compressor_free(&a);
    dopt_compressor_free(&b);
}

DTEST_WORLDS(resumed_from_saved_state_gives_the_same_bits, resume_body, NULL, 2, 3);

/* ------------------------------------------------------------------ a zero gradient */

/* A zero gradient makes every P and Q zero: with the warm start alone Q would stay zero for good
   (P = M·0). The column Gram–Schmidt cannot keep becomes a random one, the same on every rank, so
   the next step, a matrix of rank 1, already comes back in part, and Q is no longer zero. */
static void zero_body(dopt_comm *c, void *unused) {
    static float g[PS_N];
    dopt_compressor_config cfg = ps_config(2);
    dopt_compressor cz;
    unsigned char *state;
    size_t sb, i, qn = 0;
    const float *q;
    (void)unused;
    DT_OK(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS));
    memset(g, 0, sizeof g);
    DT_OK(dopt_compress_allreduce(&cz, c, g, PS_N));
    for (i = 0; i < PS_N; i++) DT_CHECK(g[i] == 0.0f);
    state = ps_state(&cz, &sb);
    q = (const float *)(const void *)(state + ps_state_q_offset(2));
    for (i = 0; i < PS_NSEGS; i++)
        if (ps_compressed(&ps_segs[i], 2, 4096)) qn += 2 * ps_segs[i].count / ps_segs[i].rows;
    DT_CHECK(ps_maxabs(q, qn) == 0.0 && ps_maxabs(ps_state_residual(state), PS_COUNT) == 0.0);
    free(state);
    memset(g, 0, sizeof g);
    for (i = 0; i < PS_NSEGS; i++)
        if (ps_segs[i].rows) ps_low_rank(g + ps_segs[i].offset, ps_segs[i].rows, ps_segs[i].count / ps_segs[i].rows, 1, 7 + i, NULL);
    DT_OK(dopt_compress_allreduce(&cz, c, g, PS_N));
    DT_CHECKF(ps_maxabs(g, 7680) > 1e-3, "rank %d: w1 came back as %g at most", c->rank, ps_maxabs(g, 7680));
    DT_CHECKF(ps_maxabs(g + 13963, 4608) > 1e-3, "rank %d: w4 came back as %g at most", c->rank, ps_maxabs(g + 13963, 4608));
    ps_same_on_every_rank(c, g, PS_N, "the step after a zero one");
    state = ps_state(&cz, &sb);
    DT_CHECK(ps_maxabs((const float *)(const void *)(state + ps_state_q_offset(2)), qn) > 0.0);
    free(state);
    dopt_compressor_free(&cz);
}

DTEST_WORLDS(zero_gradient_does_not_stall_the_warm_start, zero_body, NULL, 2, 2);

/* ------------------------------------------------------------------ non-finite gradients */

/* One rule for every codec: a NaN or ±inf in g + e on one rank — for PowerSGD also |x| >= 2^64 in
   a compressed matrix, where its products could overflow — is DOPT_ERR_NONFINITE on every rank,
   nothing written, step, residual and Q as they were; and the next finite step gives the bytes
   of a twin that never saw a bad one. The values are made from their bits (the suite builds with
   -Ofast and -ffast-math too). */
typedef struct ps_bad {
    uint32_t bits;
    size_t at;
} ps_bad;

static const ps_bad ps_bads[7] = {
    {0x7FC00000u, 5},            /* NaN in w1 */
    {0x7F800000u, 13963 + 100},  /* +inf in w4 */
    {0xFF800000u, 7683},         /* -inf in the vector */
    {0x5F800000u, 7679},         /* 2^64 in w1 */
    {0xE2800000u, 13963},        /* -2^70 in w4 */
    {0x7FC00000u, 7763 + 10},    /* NaN in w2 (sent as fp32) */
    {0x7F800000u, 8963 + 4999},  /* +inf in w3 (sent as fp32 at r = 2) */
};

static void ps_expect_refused(dopt_comm *c, dopt_compressor *cz, float *g, const char *what) {
    static float keep[PS_N];
    size_t before_bytes, after_bytes;
    unsigned char *before = ps_state(cz, &before_bytes), *after;
    dopt_status s;
    memcpy(keep, g, sizeof keep);
    s = dopt_compress_allreduce(cz, c, g, PS_N);
    DT_CHECKF(s == DOPT_ERR_NONFINITE, "%s: rank %d got %s", what, c->rank, dopt_status_str(s));
    DT_CHECKF(memcmp(g, keep, sizeof keep) == 0, "%s: rank %d's gradient changed", what, c->rank);
    after = ps_state(cz, &after_bytes);
    DT_CHECKF(memcmp(before, after, before_bytes) == 0, "%s: rank %d's state changed", what, c->rank);
    free(before), free(after);
}

static void nonfinite_body(dopt_comm *c, void *unused) {
    static float g[PS_N], tg[PS_N];
    dopt_compressor_config cfg = ps_config(2);
    dopt_compressor cz, twin;
    char what[128];
    size_t k;
    (void)unused;
    DT_OK(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS));
    DT_OK(dopt_compressor_init(&twin, &cfg, ps_segs, PS_NSEGS));
    ps_grad(g, c->rank, 0);
    DT_OK(dopt_compress_allreduce(&cz, c, g, PS_N));
    ps_grad(tg, c->rank, 0);
    DT_OK(dopt_compress_allreduce(&twin, c, tg, PS_N));
    for (k = 0; k < 7; k++) {
        int culprit = (int)(k % (size_t)c->size);
        snprintf(what, sizeof what, "rank %d's element %zu = %g (world of %d)", culprit, ps_bads[k].at,
                 dopt__bits_f32(ps_bads[k].bits), c->size);
        ps_grad(g, c->rank, 1);
        if (c->rank == culprit) g[ps_bads[k].at] = dopt__bits_f32(ps_bads[k].bits);
        ps_expect_refused(c, &cz, g, what);
    }
    ps_grad(g, c->rank, 1);
    g[7761] = dopt__bits_f32(0x7FC00000u); /* in the gap: nobody's business */
    DT_OK(dopt_compress_allreduce(&cz, c, g, PS_N));
    ps_grad(tg, c->rank, 1);
    DT_OK(dopt_compress_allreduce(&twin, c, tg, PS_N));
    DT_CHECK(dopt__f32_bits(g[7761]) == 0x7FC00000u);
    g[7761] = tg[7761];
    DT_CHECKF(memcmp(g, tg, sizeof g) == 0, "rank %d: the step after the refused ones differs", c->rank);
    {
        size_t a, b;
        unsigned char *sa = ps_state(&cz, &a), *sb = ps_state(&twin, &b);
        DT_CHECK(a == b && memcmp(sa, sb, a) == 0);
        free(sa), free(sb);
    }
    /* A value below 2^64 whose Q is not: every w1 element 1 (so P's first column is the constant
       one, 1/√96 each after Gram–Schmidt), the culprit's column 5 at 2^62 (4.6e18), whose P is
       kept ordinary by a Q whose row 5 is zero: Q = Mᵀ·P is then 2^62·√96 > 2^64 in row 5 on the
       culprit alone, and the second allreduce's flag stops every rank. */
    {
        size_t sbytes, i;
        unsigned char *st = ps_state(&cz, &sbytes);
        float zero = 0.0f;
        memset(st + 32, 0, 4 * (size_t)PS_COUNT); /* no residual: M = g */
        for (i = 0; i < 2; i++) memcpy(st + ps_state_q_offset(2) + 4 * (5 * 2 + i), &zero, 4);
        DT_OK(dopt_compress_state_load(&cz, st, sbytes));
        free(st);
        ps_grad(g, c->rank, 2);
        for (i = 0; i < 7680; i++) g[i] = 1.0f;
        if (c->rank == c->size - 1)
            for (i = 0; i < 96; i++) g[i * 80 + 5] = 4611686018427387904.0f; /* 2^62 */
        snprintf(what, sizeof what, "rank %d's Q beyond 2^64 (world of %d)", c->size - 1, c->size);
        ps_expect_refused(c, &cz, g, what);
    }
    dopt_compressor_free(&cz);
    dopt_compressor_free(&twin);
}

DTEST_WORLDS(nonfinite_on_one_rank_fails_every_rank_and_changes_nothing, nonfinite_body, NULL, 2, 3);

/* Values beyond 2^64 but finite in a segment sent as fp32 pass, as with the fp32 codec. */
static void big_vector_body(dopt_comm *c, void *unused) {
    static float g[PS_N];
    dopt_compressor_config cfg = ps_config(2);
    dopt_compressor cz;
    (void)unused;
    DT_OK(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS));
    ps_grad(g, c->rank, 0);
    g[7680] = 1e30f;
    DT_OK(dopt_compress_allreduce(&cz, c, g, PS_N));
    DT_CHECK(fabs((double)g[7680] - 1e30) <= 1e24);
    dopt_compressor_free(&cz);
}

DTEST_WORLDS(finite_values_beyond_2_64_pass_in_a_segment_sent_as_fp32, big_vector_body, NULL, 2, 2);

/* ------------------------------------------------------------------ configuration, layout, state */

/* 4 · (Σ r·(rows + cols) over the compressed matrices + the other elements + 2 flags). */
static size_t ps_bound(size_t r, size_t min) {
    size_t i, f = 2;
    for (i = 0; i < PS_NSEGS; i++) {
        const dopt_segment *s = &ps_segs[i];
        f += ps_compressed(s, r, min) ? r * (s->rows + s->count / s->rows) : s->count;
    }
    return 4 * f;
}

DTEST(configuration_defaults_limits_and_what_is_compressed) {
    static const unsigned ranks[4] = {1, 2, 4, 64};
    dopt_compressor cz;
    dopt_compressor_config cfg = ps_config(0);
    dopt_segment ragged = {0, 10, "w", 3};
    float g[PS_N], acc[PS_N];
    unsigned char msg[64];
    dopt_buf b = dopt_buf_flat(g, PS_N, ps_segs, PS_NSEGS), ab = dopt_buf_flat(acc, PS_N, ps_segs, PS_NSEGS);
    size_t bytes, t, i, q;
    int codec;
    DT_OK(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS));
    DT_CHECK(cz.cfg.powersgd_rank == 2 && cz.cfg.powersgd_min == 4096 && cz.ef == 1);
    DT_CHECK(strcmp(dopt_codec_name(DOPT_CODEC_POWERSGD), "powersgd") == 0);
    memset(g, 0, sizeof g);
    DT_EQ_INT(dopt_compress_encode(&cz, &b, msg, sizeof msg, &bytes), DOPT_ERR_UNSUPPORTED);
    DT_EQ_INT(dopt_compress_decode(&cz, msg, sizeof msg, 1.0f, &ab), DOPT_ERR_UNSUPPORTED);
    dopt_compressor_free(&cz);
    for (t = 0; t < 4; t++) /* the bound: the floats of the two allreduces, ×4; the state's size */
        for (i = 0; i < 2; i++) {
            size_t min = i ? 1000 : 4096;
            cfg = ps_config(ranks[t]);
            cfg.powersgd_min = min;
            DT_OK(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS));
            DT_EQ_INT(dopt_compress_bound(&cz), ps_bound(ranks[t], min));
            for (q = 0, bytes = 0; q < PS_NSEGS; q++)
                if (ps_compressed(&ps_segs[q], ranks[t], min)) bytes += 16 + 4 * ranks[t] * ps_segs[q].count / ps_segs[q].rows;
            DT_EQ_INT(dopt_compress_state_bytes(&cz), 32 + 4 * PS_COUNT + 8 + bytes);
            dopt_compressor_free(&cz);
        }
    DT_EQ_INT(ps_nmat(64, 4096), 0); /* at r = 64 nothing here gains */
    cfg = ps_config(65);
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS), DOPT_ERR_INVALID);
    cfg = ps_config(2);
    cfg.error_feedback = DOPT_EF_OFF;
    DT_EQ_INT(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS), DOPT_ERR_INVALID);
    cfg.error_feedback = DOPT_EF_ON;
    DT_OK(dopt_compressor_init(&cz, &cfg, ps_segs, PS_NSEGS));
    dopt_compressor_free(&cz);
    for (codec = 0; codec <= (int)DOPT_CODEC_POWERSGD; codec++) { /* count not rows × cols */
        cfg = ps_config(2);
        cfg.codec = (dopt_codec)codec;
        if (codec == (int)DOPT_CODEC_POWERSGD) {
            DT_EQ_INT(dopt_compressor_init(&cz, &cfg, &ragged, 1), DOPT_ERR_INVALID);
        } else { /* the others never read rows: a table made before it existed works as it did */
            DT_OK(dopt_compressor_init(&cz, &cfg, &ragged, 1));
            dopt_compressor_free(&cz);
        }
    }
}

/* The state names r, the compressed matrices and their rows: a state of another r, of a layout
   whose matrices have the same sizes but other shapes, with a record or a Q changed, is refused
   with DOPT_ERR_PROTOCOL and nothing changes. */
DTEST(state_load_checks_rank_layout_and_values) {
    static const dopt_segment x[2] = {{0, 7680, "a", 96}, {7680, 7680, "b", 80}};
    static const dopt_segment y[2] = {{0, 7680, "a", 80}, {7680, 7680, "b", 96}};
    static float g[2 * 7680];
    dopt_comm *c;
    dopt_compressor a, b, other_r;
    dopt_compressor_config cfg = ps_config(2), cfg4 = ps_config(4);
    unsigned char *sa, *sb, *sb2, *so;
    size_t na, nb, nb2, no, qoff = 32 + 4 * 2 * 7680 + 8 + 2 * 16;
    uint32_t nan = 0x7FC00000u;
    DT_OK(dopt_comm_create_self(&c));
    DT_OK(dopt_compressor_init(&a, &cfg, x, 2));
    DT_OK(dopt_compressor_init(&b, &cfg, y, 2));
    DT_OK(dopt_compressor_init(&other_r, &cfg4, x, 2));
    fill_noise(g, 2 * 7680, 5);
    DT_OK(dopt_compress_allreduce(&a, c, g, 2 * 7680));
    fill_noise(g, 2 * 7680, 6);
    DT_OK(dopt_compress_allreduce(&b, c, g, 2 * 7680));
    sa = ps_state(&a, &na);
    sb = ps_state(&b, &nb);
    so = ps_state(&other_r, &no);
    DT_EQ_INT(na, nb); /* the same sizes */
    DT_EQ_INT(dopt_compress_state_load(&b, sa, na), DOPT_ERR_PROTOCOL); /* other shapes */
    DT_EQ_INT(dopt_compress_state_load(&other_r, sa, na), DOPT_ERR_PROTOCOL);
    sb[32 + 4 * 2 * 7680] ^= 1; /* r */
    DT_EQ_INT(dopt_compress_state_load(&b, sb, nb), DOPT_ERR_PROTOCOL);
    sb[32 + 4 * 2 * 7680] ^= 1;
    sb[32 + 4 * 2 * 7680 + 8 + 4] ^= 1; /* a record's reserved word */
    DT_EQ_INT(dopt_compress_state_load(&b, sb, nb), DOPT_ERR_PROTOCOL);
    sb[32 + 4 * 2 * 7680 + 8 + 4] ^= 1;
    memcpy(sb + qoff + 4 * 17, &nan, 4); /* a NaN in Q */
    DT_EQ_INT(dopt_compress_state_load(&b, sb, nb), DOPT_ERR_PROTOCOL);
    sb2 = ps_state(&b, &nb2);
    DT_CHECK(nb2 == nb && memcmp(sb2, sb, qoff + 4 * 17) == 0 && memcmp(sb2 + qoff + 4 * 18, sb + qoff + 4 * 18, nb - qoff - 72) == 0);
    DT_CHECK(memcmp(sb2 + qoff + 4 * 17, &nan, 4) != 0); /* nothing taken */
    DT_OK(dopt_compress_state_load(&a, sa, na));
    free(sa), free(sb), free(sb2), free(so);
    dopt_compressor_free(&a);
    dopt_compressor_free(&b);
    dopt_compressor_free(&other_r);
    dopt_comm_destroy(c);
}

DTEST_MAIN()
