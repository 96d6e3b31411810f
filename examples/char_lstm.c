/* char_lstm.c — a character-level LSTM language model (one LSTM layer, one-hot input, softmax
   output, truncated BPTT) on English text from the Debian package fortunes, trained
   data-parallel: each rank takes its shard of the training text, rank 0's initial parameters go to
   every rank, then synchronous SGD (gradients averaged in fp32 or through a compressor), local SGD,
   or CELGC (each worker steps min(η, γ/‖g‖) on its own gradient, models averaged every --period
   steps; at --period 1 that takes --average models, since period 1 averages the gradients by
   default, and CELGC then clips their average: synchronous clipped SGD). The lines marked
   "distopt" are what a host adds to its own loop; the rest is a plain C training loop with
   OpenBLAS sgemm over one flat parameter array and one flat gradient array.

       OPENBLAS_NUM_THREADS=1 build/char_lstm --transport shm --workers 2 --celgc 30,3 --period 4
       OPENBLAS_NUM_THREADS=1 build/char_lstm --transport shm --workers 2 --celgc 30,3 --period 1 --average models
       OPENBLAS_NUM_THREADS=1 build/char_lstm --transport shm --workers 2 --lr 30        (diverges)
       OPENBLAS_NUM_THREADS=1 build/char_lstm --transport shm --workers 2 --lr 30 --clip 0.1
       build/char_lstm --gradcheck                     (finite differences against the backward pass)

   experiments/celgc_lstm.sh runs the CELGC comparison over TCP.

   Its own flags, beside common.h's: --hidden H (128), --bptt T (32 characters per window),
   --val-limit N (validate on the first N held-out characters, 0: all), --gradcheck, --overlap
   on|off (on: backward marks each tensor's gradient final as it finishes it, Wy and by first, so
   that the driver averages it while backward goes on; off, the default: the whole average after
   backward; the same numbers either way), --elastic on|off (on: local SGD over TCP or shm with
   DOPT_ON_PEER_LOST=shrink goes on without a lost worker, the survivors sharing its text; a worker
   started again with DOPT_JOIN=1 and the same flags is taken back at a round's end, with the job's
   state and epoch: TCP only).
   --train-limit N trains on the first N characters. --batch is the number of windows per
   micro-batch.

   Data: /usr/share/games/fortunes/{fortunes,wisdom,literature,...} (plain text, "%" lines between
   fortunes; the .dat indexes are skipped); the last 5% of each file is held out for validation.
   The vocabulary is newline plus printable ASCII (96 symbols); tabs become spaces, other bytes
   are dropped. Each window of T+1 characters starts from a zero state; the loss is the mean
   cross-entropy of its T predictions.

   One line per epoch: train loss (nats/char, mean over ranks and steps), validation loss of the
   averaged model (nats/char and bits/char), averaging rounds, payload bytes this rank handed to
   the transport during training (the communicator's traffic counter, evaluation excluded),
   training wall time (evaluation excluded); the CSV file (--csv) has the same columns. A
   non-finite loss is reported as "diverged" (with a CSV row of nan) and ends the run. At the end:
   how many of rank 0's steps were clipped (with --celgc or --clip), then the final validation loss
   against two bars: a unigram model of the training text (add-one smoothed) and a uniform guess
   (ln 96), an FNV-1a hash of the final parameters ("params fnv1a ...", to compare runs bit for
   bit) and the timing line (common.h: STEP TIMING). Exit status 0 when it beats the unigram
   model; 1 otherwise, with "DIVERGED" when the loss went non-finite or ended worse than the
   uniform guess (a step too large can hold the loss at hundreds of nats, finite), "NOT
   CONVERGED" otherwise. */
#define DISTOPT_IMPLEMENTATION
#include "distopt.h"
#include "transport_shm.h"
#include "transport_tcp.h"
#include "localsgd.h" /* brings clip.h and compress.h */
#include "common.h"

#include <cblas.h>
#include <math.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#define TEXT_DIR "/usr/share/games/fortunes/"
#define HOLDOUT 0.05 /* the last 5% of every file is validation text */

enum { VOCAB = 96, NTENSORS = 5, EVAL_BATCH = 64 };

static const char *const text_files[] = {"fortunes", "wisdom",     "literature", "riddles",
                                         "humorists", "platitudes", "people",     "science"};

/* The parameters (and gradients) are one flat array: Wx (V × 4H, a row per input symbol: the
   one-hot input times Wx), Wh (H × 4H), b (4H), Wy (H × V), by (V). The 4H gate columns are
   i, f, g, o. */
typedef struct lstm {
    int V, H;
    size_t off_wx, off_wh, off_b, off_wy, off_by, n;
    size_t sizes[NTENSORS];
} lstm;

/* What one forward pass over B windows of T steps keeps for the backward pass. */
typedef struct lstm_work {
    int B, T;             /* capacity */
    float *h, *c;         /* (T+1) × B × H: states, row 0 the zero initial state */
    float *gates;         /* T × B × 4H: i, f, g, o after their nonlinearity */
    float *tanh_c;        /* T × B × H */
    float *logits;        /* T × B × V: softmax, then d loss / d logits */
    float *dh_out, *dz;   /* T × B × H from the output layer; T × B × 4H gate gradients */
    float *dh_next, *dc_next; /* B × H */
} lstm_work;

/* ===================================================================== DATA */

static float *alloc_floats(size_t n) {
    float *p = calloc(n ? n : 1, sizeof(float));
    if (p == NULL) { fprintf(stderr, "out of memory\n"); exit(1); }
    return p;
}

static void *alloc_bytes(size_t n) {
    void *p = malloc(n ? n : 1);
    if (p == NULL) { fprintf(stderr, "out of memory\n"); exit(1); }
    return p;
}

/* A byte as a symbol: 0 for newline, 1..95 for ' '..'~'; -1 for a byte to drop. */
static int symbol_of(int byte) {
    if (byte == '\n') return 0;
    if (byte == '\t') byte = ' ';
    return byte >= ' ' && byte <= '~' ? byte - ' ' + 1 : -1;
}

/* One fortune file as symbols; a "%" separator line becomes an empty line. */
static size_t load_file_symbols(const char *name, unsigned char **out) {
    char path[256], line[4096];
    FILE *f;
    size_t len = 0, cap = 1 << 16;
    unsigned char *s;
    snprintf(path, sizeof path, TEXT_DIR "%s", name);
    if ((f = fopen(path, "r")) == NULL) return 0;
    s = alloc_bytes(cap);
    while (fgets(line, sizeof line, f) != NULL) {
        const char *q = strcmp(line, "%\n") == 0 ? "\n" : line;
        for (; *q; q++) {
            int sym = symbol_of((unsigned char)*q);
            if (sym < 0) continue;
            if (len == cap && (s = realloc(s, cap *= 2)) == NULL) { fprintf(stderr, "out of memory\n"); exit(1); }
            s[len++] = (unsigned char)sym;
        }
    }
    fclose(f);
    *out = s;
    return len;
}

static void append(unsigned char **dst, size_t *len, const unsigned char *src, size_t n) {
    if ((*dst = realloc(*dst, *len + n + 1)) == NULL) { fprintf(stderr, "out of memory\n"); exit(1); }
    memcpy(*dst + *len, src, n);
    *len += n;
}

/* The training and validation text: every file of text_files that exists, each split at the
   first line break after 95% of it. Exits when none exists. */
static void load_corpus(unsigned char **train, size_t *ntrain, unsigned char **val, size_t *nval, int *nfiles) {
    size_t k;
    *train = *val = NULL;
    *ntrain = *nval = 0;
    *nfiles = 0;
    for (k = 0; k < sizeof text_files / sizeof text_files[0]; k++) {
        unsigned char *s;
        size_t n = load_file_symbols(text_files[k], &s), cut;
        if (n == 0) continue;
        cut = (size_t)((1.0 - HOLDOUT) * (double)n);
        while (cut > 0 && cut < n && s[cut - 1] != 0) cut++; /* end at a line break */
        append(train, ntrain, s, cut);
        append(val, nval, s + cut, n - cut);
        (*nfiles)++;
        free(s);
    }
    if (*nfiles == 0 || *nval < 2) {
        fprintf(stderr, "no text under " TEXT_DIR " (apt-get install fortunes)\n");
        exit(1);
    }
}

/* Cross-entropy (nats/char) on val of a unigram model of train, add-one smoothed: the bar a
   language model must beat to have learned more than symbol frequencies. */
static double unigram_baseline(const unsigned char *train, size_t ntrain, const unsigned char *val, size_t nval) {
    double count[VOCAB], loss = 0;
    size_t i;
    for (i = 0; i < VOCAB; i++) count[i] = 1;
    for (i = 0; i < ntrain; i++) count[train[i]] += 1;
    for (i = 0; i < nval; i++) loss -= log(count[val[i]] / (double)(ntrain + VOCAB));
    return loss / (double)nval;
}

/* ===================================================================== MODEL */

static void lstm_layout(lstm *m, int V, int H) {
    size_t G = 4 * (size_t)H;
    m->V = V, m->H = H;
    m->sizes[0] = (size_t)V * G, m->sizes[1] = (size_t)H * G, m->sizes[2] = G;
    m->sizes[3] = (size_t)H * V, m->sizes[4] = (size_t)V;
    m->off_wx = 0;
    m->off_wh = m->off_wx + m->sizes[0];
    m->off_b = m->off_wh + m->sizes[1];
    m->off_wy = m->off_b + m->sizes[2];
    m->off_by = m->off_wy + m->sizes[3];
    m->n = m->off_by + m->sizes[4];
}

/* Weights uniform in ±scale/√H, biases 0 except the forget gate's 1 (remember by default). */
static void lstm_init(const lstm *m, float *p, uint64_t seed, float scale) {
    dopt_rng rng;
    size_t i;
    float a = scale / sqrtf((float)m->H);
    dopt_rng_init(&rng, seed, 0, 0);
    dopt_rng_uniform(&rng, 0, p, m->n);
    for (i = 0; i < m->n; i++) p[i] = (2 * p[i] - 1) * a;
    for (i = 0; i < (size_t)4 * m->H; i++) p[m->off_b + i] = i >= (size_t)m->H && i < (size_t)2 * m->H ? 1.0f : 0.0f;
    for (i = 0; i < (size_t)m->V; i++) p[m->off_by + i] = 0;
}

static void work_init(lstm_work *w, const lstm *m, int B, int T) {
    size_t rows = (size_t)B * T, H = (size_t)m->H;
    w->B = B, w->T = T;
    w->h = alloc_floats((rows + B) * H);
    w->c = alloc_floats((rows + B) * H);
    w->gates = alloc_floats(rows * 4 * H);
    w->tanh_c = alloc_floats(rows * H);
    w->logits = alloc_floats(rows * (size_t)m->V);
    w->dh_out = alloc_floats(rows * H);
    w->dz = alloc_floats(rows * 4 * H);
    w->dh_next = alloc_floats((size_t)B * H);
    w->dc_next = alloc_floats((size_t)B * H);
}

static void work_free(lstm_work *w) {
    free(w->h), free(w->c), free(w->gates), free(w->tanh_c), free(w->logits), free(w->dh_out), free(w->dz);
    free(w->dh_next), free(w->dc_next);
}

/* A step too large saturates the gates, and the products of their tiny derivatives become
   subnormal floats, which x86 processes a hundred times slower (an unclipped run took 3x longer
   for the same numbers). Flush them to zero in this thread (and in the shm workers it forks). */
static void flush_subnormals(void) {
#if defined(__SSE__)
    _mm_setcsr(_mm_getcsr() | 0x8040); /* FTZ | DAZ */
#endif
}

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* One time step for B rows: z = Wx[x] + b + h_prev·Wh, then the gates, c and h. */
static void lstm_cell(const lstm *m, const float *p, const unsigned char *text, const size_t *starts, int t, int B,
                      lstm_work *w) {
    int H = m->H, G = 4 * H, r, j;
    const float *h_prev = w->h + (size_t)t * B * H, *c_prev = w->c + (size_t)t * B * H;
    float *z = w->gates + (size_t)t * B * G, *h = w->h + (size_t)(t + 1) * B * H, *c = w->c + (size_t)(t + 1) * B * H;
    float *tc = w->tanh_c + (size_t)t * B * H;
    for (r = 0; r < B; r++) {
        const float *wx = p + m->off_wx + (size_t)text[starts[r] + (size_t)t] * G;
        for (j = 0; j < G; j++) z[(size_t)r * G + j] = wx[j] + p[m->off_b + j];
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, G, H, 1.0f, h_prev, H, p + m->off_wh, G, 1.0f, z, G);
    for (r = 0; r < B; r++) {
        float *zr = z + (size_t)r * G;
        for (j = 0; j < H; j++) {
            size_t k = (size_t)r * H + j;
            float i = sigmoid(zr[j]), f = sigmoid(zr[H + j]), g = tanhf(zr[2 * H + j]), o = sigmoid(zr[3 * H + j]);
            zr[j] = i, zr[H + j] = f, zr[2 * H + j] = g, zr[3 * H + j] = o;
            c[k] = f * c_prev[k] + i * g;
            tc[k] = tanhf(c[k]);
            h[k] = o * tc[k];
        }
    }
}

/* Forward over B windows (window r: symbols starts[r] .. starts[r] + T) from a zero state; the
   summed cross-entropy of the B·T predictions, in nats. With grad_scale > 0, w->logits ends as
   grad_scale · d loss_sum / d logits, ready for lstm_backward. */
static double lstm_forward(const lstm *m, const float *p, const unsigned char *text, const size_t *starts, int B, int T,
                           lstm_work *w, float grad_scale) {
    int V = m->V, t, r, k;
    size_t rows = (size_t)B * T;
    double loss = 0;
    memset(w->h, 0, (size_t)B * m->H * sizeof(float));
    memset(w->c, 0, (size_t)B * m->H * sizeof(float));
    for (t = 0; t < T; t++) lstm_cell(m, p, text, starts, t, B, w);
    /* every step's output at once: logits = h[1..T] · Wy + by */
    for (r = 0; r < (int)rows; r++) memcpy(w->logits + (size_t)r * V, p + m->off_by, (size_t)V * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, V, m->H, 1.0f, w->h + (size_t)B * m->H, m->H,
                p + m->off_wy, V, 1.0f, w->logits, V);
    for (t = 0; t < T; t++)
        for (r = 0; r < B; r++) {
            float *z = w->logits + ((size_t)t * B + r) * V, max = z[0], sum = 0;
            int y = text[starts[r] + (size_t)t + 1];
            for (k = 1; k < V; k++) max = z[k] > max ? z[k] : max;
            loss += (double)max - z[y];
            for (k = 0; k < V; k++) sum += (z[k] = expf(z[k] - max));
            loss += log(sum);
            if (grad_scale > 0)
                for (k = 0; k < V; k++) z[k] = (z[k] / sum - (k == y)) * grad_scale;
        }
    return loss;
}

/* Backward through time after lstm_forward: g (all m->n elements written) from w->logits. Each
   tensor is final where the hooks get it: Wy and by first, Wx after the recurrence, Wh and b. */
static void lstm_backward(const lstm *m, const float *p, const unsigned char *text, const size_t *starts, int B, int T,
                          lstm_work *w, float *g, backward_hooks *h) {
    int H = m->H, G = 4 * H, V = m->V, t, r, j;
    size_t rows = (size_t)B * T, k;
    float *gwx = g + m->off_wx, *gb = g + m->off_b, *gby = g + m->off_by;
    /* output layer, every step at once */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, V, (int)rows, 1.0f, w->h + (size_t)B * H, H, w->logits, V,
                0.0f, g + m->off_wy, V);
    memset(gby, 0, (size_t)V * sizeof(float));
    for (k = 0; k < rows; k++)
        for (j = 0; j < V; j++) gby[j] += w->logits[k * V + j];
    tensor_final(h, 3);
    tensor_final(h, 4);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, H, V, 1.0f, w->logits, V, p + m->off_wy, V, 0.0f,
                w->dh_out, H);
    /* the recurrence, last step first */
    memset(w->dh_next, 0, (size_t)B * H * sizeof(float));
    memset(w->dc_next, 0, (size_t)B * H * sizeof(float));
    memset(gwx, 0, m->sizes[0] * sizeof(float));
    for (t = T - 1; t >= 0; t--) {
        const float *a = w->gates + (size_t)t * B * G, *tc = w->tanh_c + (size_t)t * B * H;
        const float *c_prev = w->c + (size_t)t * B * H, *dh_out = w->dh_out + (size_t)t * B * H;
        float *dz = w->dz + (size_t)t * B * G;
        for (r = 0; r < B; r++) {
            const float *ar = a + (size_t)r * G;
            float *dzr = dz + (size_t)r * G, *gx = gwx + (size_t)text[starts[r] + (size_t)t] * G;
            for (j = 0; j < H; j++) {
                size_t q = (size_t)r * H + j;
                float i = ar[j], f = ar[H + j], gg = ar[2 * H + j], o = ar[3 * H + j];
                float dh = dh_out[q] + w->dh_next[q];
                float dc = w->dc_next[q] + dh * o * (1 - tc[q] * tc[q]);
                dzr[j] = dc * gg * i * (1 - i);
                dzr[H + j] = dc * c_prev[q] * f * (1 - f);
                dzr[2 * H + j] = dc * i * (1 - gg * gg);
                dzr[3 * H + j] = dh * tc[q] * o * (1 - o);
                w->dc_next[q] = dc * f;
            }
            for (j = 0; j < G; j++) gx[j] += dzr[j];
        }
        if (t > 0) /* d loss / d h_{t-1} through Wh */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, H, G, 1.0f, dz, G, p + m->off_wh, G, 0.0f,
                        w->dh_next, H);
    }
    tensor_final(h, 0);
    /* Wh and b, every step at once: h[0..T-1]ᵀ · dz */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, G, (int)rows, 1.0f, w->h, H, w->dz, G, 0.0f,
                g + m->off_wh, G);
    tensor_final(h, 1);
    memset(gb, 0, (size_t)G * sizeof(float));
    for (k = 0; k < rows; k++)
        for (j = 0; j < G; j++) gb[j] += w->dz[k * G + j];
    tensor_final(h, 2);
}

/* The mean cross-entropy (nats/char) of B windows and its gradient g; h (or NULL) times the
   backward pass and hands each tensor over. */
static double loss_and_gradient(const lstm *m, const float *p, const unsigned char *text, const size_t *starts, int B,
                                int T, lstm_work *w, float *g, backward_hooks *h) {
    float scale = 1.0f / (float)((size_t)B * T);
    double loss = lstm_forward(m, p, text, starts, B, T, w, scale), t0 = wall_seconds();
    lstm_backward(m, p, text, starts, B, T, w, g, h);
    if (h) h->backward_secs += wall_seconds() - t0;
    return loss / (double)((size_t)B * T);
}

/* Summed loss (nats) and predictions over windows [first, last) of T+1 symbols, stride T. */
static void evaluate(const lstm *m, const float *p, const unsigned char *text, size_t first, size_t last, int T,
                     lstm_work *w, double sums[2]) {
    size_t starts[EVAL_BATCH], i;
    int r, b;
    for (i = first; i < last; i += (size_t)b) {
        b = last - i < EVAL_BATCH ? (int)(last - i) : EVAL_BATCH;
        for (r = 0; r < b; r++) starts[r] = (i + (size_t)r) * (size_t)T;
        sums[0] += lstm_forward(m, p, text, starts, b, T, w, 0.0f);
        sums[1] += (double)b * T;
    }
}

/* ===================================================================== GRADIENT CHECK */

/* Central differences of the mean loss of a tiny model against lstm_backward, for every
   parameter. In float the difference quotient is good to about 1e-3 relative; a wrong term in
   the backward pass is off by its own size. Returns 0 when the check passes. */
static int gradient_check(const unsigned char *text, size_t ntext) {
    enum { GC_H = 5, GC_B = 3, GC_T = 6 };
    const float eps = 1e-2f;
    lstm m;
    lstm_work w;
    size_t starts[GC_B], i, bad = 0;
    float *p, *g;
    double diff2 = 0, sum2 = 0, worst = 0, rel;
    int r;
    lstm_layout(&m, VOCAB, GC_H);
    work_init(&w, &m, GC_B, GC_T);
    p = alloc_floats(m.n);
    g = alloc_floats(m.n);
    lstm_init(&m, p, 12345, 3.0f); /* larger than training's: gates away from their linear range */
    for (i = 0; i < (size_t)4 * GC_H; i++) p[m.off_b + i] = 0.3f * (float)((int)(i % 7) - 3);
    for (r = 0; r < GC_B; r++) starts[r] = ((size_t)r * 977) % (ntext - GC_T - 1);
    loss_and_gradient(&m, p, text, starts, GC_B, GC_T, &w, g, NULL);
    for (i = 0; i < m.n; i++) {
        float keep = p[i];
        double up, down, num, err;
        p[i] = keep + eps;
        up = lstm_forward(&m, p, text, starts, GC_B, GC_T, &w, 0.0f);
        p[i] = keep - eps;
        down = lstm_forward(&m, p, text, starts, GC_B, GC_T, &w, 0.0f);
        p[i] = keep;
        num = (up - down) / (2.0 * eps * GC_B * GC_T);
        err = fabs(num - g[i]);
        diff2 += err * err;
        sum2 += num * num + (double)g[i] * g[i];
        if (err > worst) worst = err;
        if (err > 2e-4 + 2e-2 * fabs(num)) bad++;
    }
    rel = sqrt(diff2 / (sum2 > 0 ? sum2 : 1));
    printf("char_lstm gradcheck: %zu parameters (V %d, H %d, %d windows of %d), relative error %.2e, "
           "largest difference %.2e, %zu outside tolerance: %s\n",
           m.n, VOCAB, GC_H, GC_B, GC_T, rel, worst, bad, rel < 1e-2 && bad == 0 ? "ok" : "FAILED");
    free(p), free(g);
    work_free(&w);
    return rel < 1e-2 && bad == 0 ? 0 : 1;
}

/* ===================================================================== TRAINING */

typedef struct lstm_options {
    int hidden, bptt, gradcheck;
    long val_limit;
    int overlap; /* 1: backward hands each tensor to the driver as it is final */
    int elastic; /* 1: a lost worker does not end the run (local SGD; localsgd.h: ELASTIC) */
} lstm_options;

/* This program's own flags (parse_options_extra hands them here). */
static int lstm_flag(void *user, const char *f, const char *v) {
    lstm_options *lo = (lstm_options *)user;
    if (!strcmp(f, "--gradcheck")) {
        lo->gradcheck = 1;
        return 1;
    }
    if (!strcmp(f, "--overlap")) {
        lo->overlap = overlap_flag(f, v);
        return 2;
    }
    if (!strcmp(f, "--elastic")) {
        lo->elastic = overlap_flag(f, v); /* on|off */
        return 2;
    }
    if (strcmp(f, "--hidden") && strcmp(f, "--bptt") && strcmp(f, "--val-limit")) return 0;
    if (v == NULL) flag_error("%s needs a value", f);
    if (!strcmp(f, "--hidden")) lo->hidden = (int)flag_long(f, v, 1, 4096);
    else if (!strcmp(f, "--bptt")) lo->bptt = (int)flag_long(f, v, 1, 4096);
    else lo->val_limit = flag_long(f, v, 0, 1L << 40);
    return 2;
}

static void shuffle(size_t *order, size_t n, uint64_t *state) { /* Fisher-Yates */
    size_t i;
    for (i = n; i > 1; i--) {
        size_t j, t;
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        j = (size_t)(*state >> 33) % i;
        t = order[i - 1], order[i - 1] = order[j], order[j] = t;
    }
}

/* The epoch's figures: training loss averaged over ranks (*loss: this rank's, then the mean);
   validation loss of the averaged model (identical to every replica at period 1, where every
   step ends averaged; between local averages, an extra fp32 average of a copy, which the
   training does not see), each rank taking its share [vbegin, vend) of the validation windows.
   One status for the three collectives: after a failure the later ones fail too. */
static dopt_status epoch_figures(dopt_comm *comm, int sync, const lstm *m, const float *params, float *eval,
                                 const unsigned char *val, size_t vbegin, size_t vend, int bptt, lstm_work *w,
                                 double *loss, double *val_loss) {
    double sums[2] = {0, 0};
    dopt_status st;
    memcpy(eval, params, m->n * sizeof(float));
    *loss = dopt_mean(comm, *loss);
    if (!sync) dopt_allreduce(comm, eval, m->n, DOPT_F32, DOPT_MEAN);
    evaluate(m, eval, val, vbegin, vend, bptt, w, sums);
    if ((st = dopt_allreduce(comm, sums, 2, DOPT_F64, DOPT_SUM)) == DOPT_OK) *val_loss = sums[0] / sums[1];
    return st;
}

static void print_row(FILE *f, const char *fmt, int epoch, double loss, double val, size_t rounds, double bytes,
                      double secs, size_t batch) {
    if (isnan(loss)) loss = fabs(loss); /* "nan", not "-nan" */
    if (isnan(val)) val = fabs(val);
    fprintf(f, fmt, epoch, loss, val, val / log(2.0), (unsigned long long)rounds, bytes, secs, batch);
}

/* This rank's share of the training text and of the validation windows for comm (distopt:
   dopt_shard), and room for its window order; every rank runs the same number of windows. */
typedef struct text_shard {
    size_t begin, end, per_rank, nwin, vbegin, vend;
    size_t *order;
} text_shard;

static void take_text_shard(const dopt_comm *comm, size_t ntrain, size_t nval_win, int bptt, text_shard *sh) {
    dopt_shard(ntrain, comm->rank, comm->size, &sh->begin, &sh->end);
    sh->per_rank = ntrain / (size_t)comm->size;
    sh->nwin = sh->per_rank > (size_t)bptt ? (sh->per_rank - 1) / (size_t)bptt : 0; /* more with fewer workers */
    dopt_shard(nval_win, comm->rank, comm->size, &sh->vbegin, &sh->vend);
    free(sh->order);
    sh->order = alloc_bytes((sh->nwin ? sh->nwin : 1) * sizeof(size_t));
}

int main(int argc, char **argv) {
    options o = {NULL, 0, "none", 0, 0, 0, 1, 1, 0, 3, 32, 1.0f, 0, "off", NULL, 0, 0, 0, 0, NULL, 0, 0, 0, 0, NULL, NULL, 0};
    lstm_options lo = {128, 32, 0, 0, 0, 0};
    lstm m;
    lstm_work work;
    unsigned char *train, *val;
    size_t ntrain, nval, nval_win, i, units, rounds = 0;
    size_t *starts;
    text_shard sh = {0, 0, 0, 0, 0, 0, NULL};
    float *params, *grads, *micro, *eval;
    dopt_comm *comm;
    dopt_segment segs[NTENSORS];
    int compress, sync, adaptive, epoch, nfiles, failed = 0, diverged = 0, joined;
    dopt_compressor cz;
    dopt_compressor_config ccfg;
    dopt_batch bc;
    dopt_batch_config bcfg;
    batch_report brep = {0, NAN, NAN};
    dopt_dp ls;
    dopt_dp_config lcfg;
    dopt_buf gdesc;
    backward_hooks hooks;
    step_timing tm;
    dopt_status st = DOPT_OK;
    uint64_t step = 0, shuffle_rng, skipped = 0, clipped = 0, shrinks_seen, grows_seen;
    double train_secs = 0, train_bytes = 0, baseline, val_loss = NAN;
    FILE *csv = NULL;
    const char *row_fmt = "%5d %10.5g %10.5g %8.5g %8llu %12.0f %8.1f %6zu\n";
    const char *csv_fmt = "%d,%.7g,%.7g,%.7g,%llu,%.0f,%.3f,%zu\n";

    flush_subnormals();
    parse_options_extra(&o, argc, argv, lstm_flag, &lo, "[--hidden H] [--bptt T] [--val-limit N] [--gradcheck] [--overlap on|off] [--elastic on|off]");
    load_corpus(&train, &ntrain, &val, &nval, &nfiles);
    if (lo.gradcheck) {
        failed = gradient_check(train, ntrain);
        free(train), free(val);
        return failed;
    }
    if (o.train_limit > 0 && (size_t)o.train_limit < ntrain) ntrain = (size_t)o.train_limit;
    if (lo.val_limit > 0 && (size_t)lo.val_limit < nval) nval = (size_t)lo.val_limit;
    adaptive = batch_config_from_options(&o, &bcfg);
    baseline = unigram_baseline(train, ntrain, val, nval);
    if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1; /* distopt: one process per rank from here on */

    nval_win = (nval - 1) / (size_t)lo.bptt;
    take_text_shard(comm, ntrain, nval_win, lo.bptt, &sh); /* distopt: this rank's text and validation windows */
    if (sh.nwin < (size_t)o.batch || nval_win == 0) {
        if (comm->rank == 0)
            fprintf(stderr, "char_lstm: %zu characters per worker make %zu windows of %d, fewer than a batch of %d\n",
                    sh.per_rank, sh.nwin, lo.bptt, o.batch);
        return dopt_comm_finish(comm, 1);
    }

    lstm_layout(&m, VOCAB, lo.hidden);
    work_init(&work, &m, o.batch > EVAL_BATCH ? o.batch : EVAL_BATCH, lo.bptt);
    params = alloc_floats(m.n);
    grads = alloc_floats(m.n);
    micro = alloc_floats(m.n);
    eval = alloc_floats(m.n);
    starts = alloc_bytes((size_t)o.batch * sizeof(size_t));
    lstm_init(&m, params, o.seed + 1000003u * (uint64_t)comm->rank, 1.0f); /* different on purpose: the broadcast fixes it */

    /* distopt: the method. Synchronous steps (--period 1) average the gradients, in fp32 or
       compressed; local steps average the models every --period steps, the deltas compressed
       with --compress; --period 1 --average models averages the models after every step (CELGC
       then clips each worker's own gradient, as the paper's method does at I = 1). Adaptive
       batches grow the micro-batches per step. Check once: a refusal here comes back from every
       later call of the driver and from dopt_dp_close, so the loop tests one status per step. */
    compress = method_configs(&o, &cz, &ccfg, &lcfg);
    sync = o.period == 1; /* an average after every step: the replicas are the averaged model */
    dopt_segments_from_sizes(segs, m.sizes, NTENSORS, NULL);
    gdesc = dopt_buf_flat(grads, m.n, segs, NTENSORS); /* distopt layout: the compressor's table, the buckets' */
    lcfg.batch = adaptive ? &bc : NULL;
    lcfg.grads = lo.overlap ? &gdesc : NULL; /* distopt option: buckets averaged during backward */
    lcfg.elastic = lo.elastic;               /* distopt option: go on without a lost worker (DOPT_ON_PEER_LOST=shrink) */
    if (compress) dopt_compressor_init(&cz, &ccfg, segs, NTENSORS);
    if (adaptive) dopt_batch_init(&bc, m.n, &bcfg);
    dopt_dp_init(&ls, comm, m.n, &lcfg);
    joined = ls.joining;                     /* distopt (--elastic): a worker started again with DOPT_JOIN=1 */
    dopt_dp_broadcast(&ls, params);          /* ... takes the job's state here, not rank 0's model */
    /* CELGC's own rule (sync_grads 0) averages models, never gradients: nothing to mark */
    hooks = (backward_hooks){.dp = lo.overlap && (!o.celgc || lcfg.sync_grads) ? &ls : NULL, .segs = segs, .grads = grads, .micro = micro};
    timing_init(&tm, (size_t)o.epochs * (sh.nwin / (size_t)o.batch));

    if (comm->rank == 0) {
        printf("char_lstm: %s, %d worker(s), %zu training characters from %d files (%zu per worker), %zu validation "
               "characters; LSTM hidden %d, %zu parameters, BPTT %d, batch %d windows per worker; ",
               comm->vt->name, comm->size, ntrain, nfiles, sh.per_rank, nval, lo.hidden, m.n, lo.bptt, o.batch);
        if (o.celgc)
            printf("celgc eta %g gamma %g", o.celgc_eta, o.celgc_gamma);
        else
            printf("sgd lr %g clip %g", o.lr, o.clip);
        printf(", period %zu, average %s, compress %s, adaptive batch %s; unigram baseline %.4f nats/char\n", o.period,
               o.average, o.compress, o.adaptive, baseline);
        printf("%5s %10s %10s %8s %8s %12s %8s %6s\n", "epoch", "train_nats", "val_nats", "val_bpc", "rounds",
               "bytes_sent", "time_s", "batch");
        if (o.csv && (csv = fopen(o.csv, "w")) != NULL)
            fprintf(csv, "epoch,train_loss,val_loss,val_bpc,rounds,bytes_sent,time_s,batch\n");
        fflush(stdout);
    }
    shuffle_rng = dopt_seed_for_rank(o.seed, comm->rank);
    epoch = 1;
    if (joined) { /* distopt (--elastic): go on with the members, from the job's step, in their epoch */
        double e = INFINITY;
        if (ls.comm != comm) { /* a member was lost while this one came in */
            dopt_comm_destroy(comm);
            comm = ls.comm;
            take_text_shard(comm, ntrain, nval_win, lo.bptt, &sh);
        }
        step = ls.step;
        st = dopt_allreduce(comm, &e, 1, DOPT_F64, DOPT_MIN); /* the members' own, after they took this one in */
        if (st == DOPT_OK) epoch = (int)e;
        printf("char_lstm: taken back as rank %d of %d, from step %llu in epoch %d\n", comm->rank, comm->size,
               (unsigned long long)step, epoch);
    }
    shrinks_seen = ls.shrinks, grows_seen = ls.grows; /* distopt (--elastic): what a change of world did */
    for (; epoch <= o.epochs && st == DOPT_OK; epoch++) {
        double loss = 0, t0 = wall_seconds();
        size_t pos = 0, batches = 0, u;
        uint64_t traffic_before = dopt_comm_traffic_total(comm);
        for (i = 0; i < sh.nwin; i++) sh.order[i] = i;
        shuffle(sh.order, sh.nwin, &shuffle_rng);
        if (!step_fits(&o, adaptive ? dopt_batch_units(&bc) : 1, sh.nwin, comm, epoch)) break;
        while (st == DOPT_OK) {
            units = adaptive ? dopt_batch_units(&bc) : 1;
            if (pos + units * (size_t)o.batch > sh.nwin) break;
            timing_begin(&tm);
            memset(grads, 0, m.n * sizeof(float));
            hooks.scale = 1.0f / (float)units, hooks.backward_secs = 0;
            for (u = 0; u < units; u++) { /* one micro-batch of --batch windows each */
                int r;
                for (r = 0; r < o.batch; r++) starts[r] = sh.begin + sh.order[pos++] * (size_t)lo.bptt;
                hooks.mark = hooks.dp && u + 1 == units; /* the last micro-batch makes the gradient final */
                loss += loss_and_gradient(&m, params, train, starts, o.batch, lo.bptt, &work, micro, &hooks);
                batches++;
                if (adaptive) dopt_batch_observe(&bc, &(dopt_buf){.data = micro, .n = m.n}, 1.0f); /* distopt: gradient variance */
                if (!hooks.mark) dopt_axpy(grads, 1.0f / (float)units, micro, m.n); /* else backward added it */
            }
            if (dopt_dp_should_sync(&ls, step)) rounds++;
            timing_wait_begin(&tm);
            if (o.celgc) { /* distopt: x -= min(η, γ/‖g‖)·g, and the average when due */
                const dopt_celgc rule = {.eta = o.celgc_eta, .gamma = o.celgc_gamma};
                /* with --overlap on, the descriptor the driver marked (celgc takes the parameters in its layout) */
                dopt_buf xb = lo.overlap ? dopt_buf_flat(params, m.n, segs, NTENSORS) : (dopt_buf){.data = params, .n = m.n};
                dopt_buf gb = lo.overlap ? gdesc : (dopt_buf){.data = grads, .n = m.n};
                float used = o.celgc_eta;
                st = dopt_dp_celgc_step(&ls, &xb, &gb, &rule);
                timing_waited(&tm);
                if (st == DOPT_ERR_NONFINITE) st = DOPT_OK, skipped++; /* this worker skipped its update */
                else if (st == DOPT_OK) dopt_celgc_step_size(&gb, &rule, &used);
                clipped += used < o.celgc_eta; /* the step the rule chose was γ/‖g‖ */
            } else {
                dopt_clip_norm clip = {.max_norm = o.clip};
                dopt_dp_after_backward_buf(&ls, &gdesc); /* distopt: the mean (fp32 or compressed) when synchronous */
                timing_waited(&tm);
                if (o.clip > 0 && dopt_clip_global_norm(NULL, &(dopt_buf){.data = grads, .n = m.n}, &clip) ==
                                      DOPT_ERR_NONFINITE)
                    memset(grads, 0, m.n * sizeof(float)), skipped++; /* distopt: clip; skip a NaN step */
                clipped += o.clip > 0 && clip.norm > o.clip;
                dopt_axpy(params, -o.lr, grads, m.n);
                st = dopt_dp_after_step(&ls, params); /* distopt: model average when due */
            }
            timing_end(&tm, hooks.backward_secs);
            step++;
            if (ls.comm != comm) { /* distopt (--elastic): a worker was lost (or came back); the job goes on */
                int lost = ls.shrinks > shrinks_seen, back = ls.grows > grows_seen; /* one call may do both */
                shrinks_seen = ls.shrinks, grows_seen = ls.grows;
                double e = (double)epoch;
                if (comm->size > 1) train_bytes += (double)(dopt_comm_traffic_total(comm) - traffic_before);
                dopt_comm_destroy(comm);
                comm = ls.comm;
                traffic_before = dopt_comm_traffic_total(comm);
                take_text_shard(comm, ntrain, nval_win, lo.bptt, &sh); /* a share of the lost one's, or one for the new */
                for (i = 0; i < sh.nwin; i++) sh.order[i] = i;
                shuffle(sh.order, sh.nwin, &shuffle_rng); /* the epoch starts over on the new shard */
                pos = 0, loss = 0, batches = 0;
                step = ls.step;
                /* a survivor a round ahead may have begun the next epoch: all go on in the earliest (a
                   worker taken back gives +inf: it learns the epoch here) */
                st = lost_worker_later(lo.elastic, dopt_allreduce(comm, &e, 1, DOPT_F64, DOPT_MIN));
                if (st == DOPT_OK) epoch = (int)e;
                if (comm->rank == 0)
                    printf("%s: %d go on, from step %llu\n",
                           lost && back ? "lost a worker, and one came back" : back ? "a worker came back" : "lost a worker",
                           comm->size, (unsigned long long)step);
            }
            if (adaptive) batch_report_step(&brep, &bc);
        }
        if (st != DOPT_OK) break;
        train_secs += wall_seconds() - t0;
        if (comm->size > 1) train_bytes += (double)(dopt_comm_traffic_total(comm) - traffic_before);
        loss /= (double)(batches ? batches : 1);
        st = epoch_figures(comm, sync, &m, params, eval, val, sh.vbegin, sh.vend, lo.bptt, &work, &loss, &val_loss);
        if (st != DOPT_OK && (st = lost_worker_later(lo.elastic, st)) == DOPT_OK)
            continue; /* distopt (--elastic): no figures this epoch; the driver's next call takes the loss up */
        if (st != DOPT_OK) break;
        diverged = !isfinite(loss) || !isfinite(val_loss);
        if (comm->rank == 0) {
            size_t batch = (adaptive ? dopt_batch_units(&bc) : 1) * (size_t)o.batch;
            print_row(stdout, row_fmt, epoch, loss, val_loss, rounds, train_bytes, train_secs, batch);
            if (csv) print_row(csv, csv_fmt, epoch, loss, val_loss, rounds, train_bytes, train_secs, batch);
            if (diverged) printf("char_lstm: diverged at epoch %d (non-finite loss); stopping\n", epoch);
            fflush(stdout);
        }
        if (diverged) break;
    }
    if (lo.elastic && st == DOPT_OK) { /* distopt (--elastic): a loss the last figures met is taken up here */
        st = dopt_dp_sync(&ls, &(dopt_buf){.data = params, .n = m.n}, NULL);
        if (st == DOPT_OK && ls.comm != comm) { /* the validation loss again, on the survivors */
            double loss = NAN;
            dopt_comm_destroy(comm);
            comm = ls.comm;
            take_text_shard(comm, ntrain, nval_win, lo.bptt, &sh);
            st = epoch_figures(comm, sync, &m, params, eval, val, sh.vbegin, sh.vend, lo.bptt, &work, &loss, &val_loss);
            if (comm->rank == 0 && st == DOPT_OK)
                printf("lost a worker: %d went on to the end; validation %.5g nats/char\n", comm->size, val_loss);
        }
    }
    if (dopt_dp_close(&ls, params) != DOPT_OK || st != DOPT_OK) { /* distopt: the last round averaged, replicas checked */
        failed = 1;
    } else {
        /* worse than a uniform guess over the vocabulary counts as diverged too: a step too
           large can drive the loss to hundreds of nats and keep it there, finite */
        diverged = diverged || val_loss > log((double)VOCAB);
        failed = diverged || !(val_loss < baseline);
        if (comm->rank == 0 && (o.celgc || o.clip > 0))
            printf("char_lstm: rank 0 clipped %llu of %llu steps (%.1f%%)\n", (unsigned long long)clipped,
                   (unsigned long long)step, step ? 100.0 * (double)clipped / (double)step : 0.0);
        if (isnan(val_loss)) val_loss = fabs(val_loss); /* "nan", not "-nan" */
        if (comm->rank == 0)
            printf("char_lstm: final validation loss %.5g nats/char (%.5g bits/char), unigram baseline %.4f, uniform "
                   "%.4f: %s%s\n",
                   val_loss, val_loss / log(2.0), baseline, log((double)VOCAB),
                   diverged ? "DIVERGED" : failed ? "NOT CONVERGED" : "converged",
                   skipped ? " (some steps skipped for a non-finite gradient)" : "");
        if (comm->rank == 0) printf("params fnv1a %016llx\n", params_fnv1a(params, m.n));
        if (comm->rank == 0) timing_print(&tm, lo.overlap);
    }
    if (adaptive && comm->rank == 0 && st == DOPT_OK) batch_report_print(&brep, &bc);
    timing_free(&tm);
    if (csv) fclose(csv);
    if (adaptive) dopt_batch_free(&bc);
    if (compress) dopt_compressor_free(&cz);
    free(train), free(val), free(params), free(grads), free(micro), free(eval), free(sh.order), free(starts);
    work_free(&work);
    return dopt_comm_finish(comm, failed); /* distopt: other ranks exit; rank 0 gets the job's status; a failure's
                                              detail is printed */
}
