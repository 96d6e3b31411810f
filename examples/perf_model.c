/* perf_model.c — predicts the wall time of one training step of each method distopt offers, from
   a few ingredients measured on this machine with this transport (or passed in), as TernGrad's
   paper does (Wen et al. 2017, §5): the host's compute per micro-batch, an α-β model of the
   collectives, the compressor's encode and decode times. It prints the ingredients, checks the
   communication part against the real collectives, and predicts each configuration given.

       OPENBLAS_NUM_THREADS=1 build/perf_model --transport shm --workers 2 \
           fp32=none:64:1 terngrad=ternary:64:1 local4=ternary:64:4 adaptive=none:512:4:adaptive

   A configuration is [LABEL=]CODEC:B:I[:adaptive]: CODEC none (fp32) or a compress.h codec
   (ternary, qsgd, topk, sign, fp16, bf16), B samples per worker and step (a multiple of --batch,
   the micro-batch; a mean over a run is fine, the model is linear in it), I the averaging period
   (1: synchronous gradient averaging; I > 1: local SGD averaging the models, or their deltas
   through CODEC, every I steps), "adaptive" when the batch-size test runs (fmnist_mlp's
   --adaptive-batch). The world is the one the transport gives (--workers N forks N ranks over
   shm): every ingredient is measured with all N ranks working at once, so N ranks sharing fewer
   cores show up in the figures, and each figure is the slowest rank's, which a synchronous step
   waits for.

   THE MODEL (n parameters, k = B / micro-batch micro-batches per step, N ranks)

       T_step  = k·(t_mb + a·t_obs) + t_upd + C / I
       t_mb    the host's work per micro-batch: gather its samples, forward, backward, add into the
               step's gradient (an MLP of --layers, timed here; or --sample-us × micro-batch)
       t_obs   dopt_batch_observe of one micro-batch gradient (a = 1 with adaptive, else 0)
       t_upd   zero the gradient, apply the update (memset + axpy over n)
       C       one averaging round, which fmnist_mlp runs through these calls:
         fp32, I = 1:   2·t_copy + T_ar(4n)                (localsgd packs and unpacks)
         codec, I = 1:  2·t_copy + E + T_ag(m) + N·t_dec   (the same around dopt_compress_allreduce)
         fp32, I > 1:   2·t_copy + T_ar(4n)                (pack, unpack; no anchor is kept)
         codec, I > 1:  5·t_copy + E + T_ag(m) + N·t_dec   (pack, delta, add back, unpack, anchor)
         adaptive:      + T_ar(small)                      (the batch test's scalars)
       E       t_enc, plus T_ar(4·(segments+1)) for ternary (the scale sharing)
       T_ar(x) = α_ar + x/β_ar,  T_ag(x) = α_ag + x/β_ag   (x payload bytes per rank), fitted by
               least squares in relative error to allreduce (f32 mean) and allgather times at
               4 KiB .. 4 MiB; m = dopt_compress_bound, the codec's message
       t_copy  a memcpy of n floats

   What it leaves out: evaluation (fmnist_mlp takes it off its clock), the steps' variation (the
   median is used), overlap (none in fmnist_mlp: every call blocks), and a world of one (N = 1: the
   self backend's collectives are copies, measured like any other).

   --project: no world, a projection instead. From this core's compute (the MLP per sample,
   TernGrad's encode and decode per element, a PowerSGD step) and an α-β model of the schedules
   (PROJECTION below), the samples per second of fp32, TernGrad's allgather, TernGrad's integer
   ring, PowerSGD and local SGD at N = 2 .. 1024 ranks on hosts of --ranks-per-host ranks, for each
   link rate of --gbits, as a table on stdout, DIR/projection.csv and (with gnuplot)
   DIR/projection.png:

       OPENBLAS_NUM_THREADS=1 build/perf_model --project --layers 4096,4096,4096,1000 --batch 32 \
           --ranks-per-host 8 --gbits 1,10 --out docs/img

   --overlap: no world either; the synchronous step whose gradient buckets are averaged while
   backward runs (OVERLAP below), from a host's measured compute, backward and (optionally) its
   blocking average's time, and its segments in the order backward finishes them. One line,
   which bench/overlap.sh reads:

       build/perf_model --overlap --hosts 2 --gbits 1 --link-us 50 --compute-ms 146.7 \
           --backward-ms 92.5 --comm-ms 19.6 --segments 128,128,65536,128,...
       overlap model_ms=.. blocking_model_ms=.. comm_model_ms=.. tail_ms=.. buckets=.. bucket_bytes=.. */
#define DISTOPT_IMPLEMENTATION
#include "distopt.h"
#include "transport_shm.h"
#include "transport_tcp.h"
#include "localsgd.h" /* brings clip.h and compress.h */
#include "common.h"

#include <cblas.h>
#include <math.h>

enum { MAX_LAYERS = 24, MAX_CONFIGS = 32, POOL_ROWS = 16384, REPEATS = 5 };

/* ===================================================================== FLAGS */

typedef struct model_options {
    options comm;        /* --transport, --workers: the launch's environment */
    int layers[MAX_LAYERS], nlayers;
    int micro;           /* --batch: samples per micro-batch */
    double sample_us;    /* --sample-us: compute per sample instead of timing the MLP, 0: time it */
    double alpha_us, beta_gbs; /* --alpha-us, --beta-gbs: the α-β model instead of fitting it */
    double seconds;      /* --seconds: time spent on each measurement */
    const char *csv;
    const char *configs[MAX_CONFIGS];
    int nconfigs;
    int project;         /* --project: the projection below instead of the measured model */
    int local, period, rank; /* --ranks-per-host, --period, --rank (PowerSGD's r) */
    double link_us, intra_gbs, intra_us; /* --link-us, --intra-gbs, --intra-us */
    const char *gbits, *out; /* --gbits 1,10; --out DIR */
    const char *layouts;     /* --layouts HxL,... */
    int same_box;            /* --same-box */
    int overlap;             /* --overlap: the overlapped step below instead of the measured model */
    int hosts;               /* --hosts H */
    double compute_ms, backward_ms, comm_ms; /* --compute-ms, --backward-ms, --comm-ms */
    const char *segments;    /* --segments: elements per segment, in the order backward finishes them */
    double bucket_bytes, first_bytes; /* --bucket-bytes, --first-bucket-bytes (0: the driver's choice) */
} model_options;

static void model_usage(const char *prog) {
    printf("usage: %s [--transport shm|tcp|mpi|self] [--workers N] [--layers 784,256,128,10] [--batch B]\n"
           "          [--sample-us X] [--alpha-us A --beta-gbs B] [--seconds S] [--csv FILE]\n"
           "          [LABEL=]CODEC:B:I[:adaptive] ...\n"
           "       %s --project [--layers ...] [--batch B] [--sample-us X] [--ranks-per-host L] [--gbits 1,10]\n"
           "          [--link-us A] [--intra-gbs G] [--intra-us A] [--period I] [--rank R] [--out DIR]\n"
           "          [--layouts HxL,...] [--same-box]\n"
           "       %s --overlap --hosts H --gbits R --link-us A --compute-ms C --backward-ms B\n"
           "          --segments n1,n2,... [--comm-ms M] [--bucket-bytes S] [--first-bucket-bytes F]\n",
           prog, prog, prog);
    exit(0);
}

static void parse_model_options(model_options *mo, int argc, char **argv) {
    int i;
    for (i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) model_usage(argv[0]);
        if (!strcmp(f, "--project") || !strcmp(f, "--same-box") || !strcmp(f, "--overlap")) { /* no value */
            if (!strcmp(f, "--project"))
                mo->project = 1;
            else if (!strcmp(f, "--overlap"))
                mo->overlap = 1;
            else
                mo->same_box = 1;
            continue;
        }
        if (strncmp(f, "--", 2)) {
            if (mo->nconfigs == MAX_CONFIGS) flag_error("at most %d configurations (got more)", MAX_CONFIGS);
            mo->configs[mo->nconfigs++] = f;
            continue;
        }
        if (v == NULL) flag_error("%s needs a value", f);
        i++;
        if (!strcmp(f, "--transport")) mo->comm.transport = flag_choice(f, v, transport_names);
        else if (!strcmp(f, "--workers")) mo->comm.workers = (int)flag_long(f, v, 1, 1024);
        else if (!strcmp(f, "--batch")) mo->micro = (int)flag_long(f, v, 1, 1 << 20);
        else if (!strcmp(f, "--sample-us")) mo->sample_us = flag_double(f, v, 0, 1e12, 0);
        else if (!strcmp(f, "--alpha-us")) mo->alpha_us = flag_double(f, v, 0, 1e12, 0);
        else if (!strcmp(f, "--beta-gbs")) mo->beta_gbs = flag_double(f, v, 0, 1e12, 0);
        else if (!strcmp(f, "--seconds")) mo->seconds = flag_double(f, v, 1e-6, 1e6, 0);
        else if (!strcmp(f, "--csv")) mo->csv = v;
        else if (!strcmp(f, "--ranks-per-host")) mo->local = (int)flag_long(f, v, 1, 1024);
        else if (!strcmp(f, "--period")) mo->period = (int)flag_long(f, v, 1, 1 << 20);
        else if (!strcmp(f, "--rank")) mo->rank = (int)flag_long(f, v, 1, 64);
        else if (!strcmp(f, "--link-us")) mo->link_us = flag_double(f, v, 0, 1e9, 0);
        else if (!strcmp(f, "--intra-gbs")) mo->intra_gbs = flag_double(f, v, 1e-6, 1e9, 0);
        else if (!strcmp(f, "--intra-us")) mo->intra_us = flag_double(f, v, 0, 1e9, 0);
        else if (!strcmp(f, "--gbits")) mo->gbits = v;
        else if (!strcmp(f, "--out")) mo->out = v;
        else if (!strcmp(f, "--layouts")) mo->layouts = v;
        else if (!strcmp(f, "--hosts")) mo->hosts = (int)flag_long(f, v, 1, 1 << 20);
        else if (!strcmp(f, "--compute-ms")) mo->compute_ms = flag_double(f, v, 0, 1e9, 0);
        else if (!strcmp(f, "--backward-ms")) mo->backward_ms = flag_double(f, v, 0, 1e9, 0);
        else if (!strcmp(f, "--comm-ms")) mo->comm_ms = flag_double(f, v, 0, 1e9, 0);
        else if (!strcmp(f, "--segments")) mo->segments = v;
        else if (!strcmp(f, "--bucket-bytes")) mo->bucket_bytes = flag_double(f, v, 0, 1e15, 0);
        else if (!strcmp(f, "--first-bucket-bytes")) mo->first_bytes = flag_double(f, v, 0, 1e15, 0);
        else if (!strcmp(f, "--layers")) {
            char *end = (char *)v;
            for (mo->nlayers = 0; mo->nlayers < MAX_LAYERS && *end; end += *end == ',') {
                long w = strtol(end, &end, 10);
                if ((*end != ',' && *end != '\0') || w < 1 || w > 1 << 20)
                    flag_error("--layers expects widths >= 1 separated by commas (got \"%s\")", v);
                mo->layers[mo->nlayers++] = (int)w;
            }
        } else flag_error("unknown flag %s", f);
    }
    if (mo->nlayers < 2) flag_error("--layers needs 2 widths at least (an input and an output)");
    if ((mo->alpha_us > 0) != (mo->beta_gbs > 0)) flag_error("--alpha-us and --beta-gbs go together");
}

/* ===================================================================== TIMING */

/* The slowest rank's median over REPEATS of the mean time of `reps` calls: a synchronous step
   waits for the slowest rank. Every rank must call it with the same reps. */
typedef void (*timed_fn)(void *ctx);

static double time_calls(dopt_comm *comm, timed_fn fn, void *ctx, int reps) {
    double t[REPEATS], tmp;
    int r, i, j;
    fn(ctx); /* warm up: first-touch pages, lazily sized buffers */
    for (r = 0; r < REPEATS; r++) {
        double t0;
        dopt_barrier(comm);
        t0 = wall_seconds();
        for (i = 0; i < reps; i++) fn(ctx);
        t[r] = (wall_seconds() - t0) / reps;
    }
    for (i = 1; i < REPEATS; i++) /* insertion sort, five elements */
        for (j = i; j > 0 && t[j - 1] > t[j]; j--) tmp = t[j], t[j] = t[j - 1], t[j - 1] = tmp;
    tmp = t[REPEATS / 2];
    dopt_allreduce(comm, &tmp, 1, DOPT_F64, DOPT_MAX);
    return tmp;
}

/* How many calls fill about `seconds` / REPEATS, from one probe call, agreed on by every rank. */
static int reps_for(dopt_comm *comm, timed_fn fn, void *ctx, double seconds) {
    double t0 = wall_seconds(), once;
    fn(ctx);
    once = wall_seconds() - t0;
    dopt_allreduce(comm, &once, 1, DOPT_F64, DOPT_MAX);
    once = seconds / REPEATS / (once > 1e-7 ? once : 1e-7);
    return once < 1 ? 1 : once > 100000 ? 100000 : (int)once;
}

static double measure(dopt_comm *comm, timed_fn fn, void *ctx, double seconds) {
    return time_calls(comm, fn, ctx, reps_for(comm, fn, ctx, seconds));
}

/* ===================================================================== THE HOST'S COMPUTE */

/* An MLP of the given widths (ReLU, softmax cross-entropy) doing what fmnist_mlp does per
   micro-batch: gather B random rows of a pool larger than the caches, forward, backward, and add
   the gradient into the step's. Same sgemm shapes as fmnist_mlp. */
typedef struct mlp {
    const int *w;
    int nl, B;
    size_t n;
    float *params, *grads, *step_grads, *pool, *x;
    float *act[MAX_LAYERS], *delta[MAX_LAYERS];
    unsigned char *labels;
    uint64_t rng;
} mlp;

static size_t mlp_params(const int *w, int nl) {
    size_t n = 0;
    int l;
    for (l = 0; l + 1 < nl; l++) n += (size_t)w[l] * (size_t)w[l + 1] + (size_t)w[l + 1];
    return n;
}

static void mlp_init(mlp *m, const int *w, int nl, int B, int rank) {
    dopt_rng rng;
    int l;
    memset(m, 0, sizeof *m);
    m->w = w, m->nl = nl, m->B = B, m->n = mlp_params(w, nl), m->rng = 12345u + (uint64_t)rank;
    m->params = calloc(m->n, sizeof(float)), m->grads = calloc(m->n, sizeof(float));
    m->step_grads = calloc(m->n, sizeof(float));
    m->pool = malloc((size_t)POOL_ROWS * (size_t)w[0] * sizeof(float));
    m->labels = malloc(POOL_ROWS);
    for (l = 0; l < nl; l++) {
        m->act[l] = calloc((size_t)B * (size_t)w[l], sizeof(float));
        m->delta[l] = calloc((size_t)B * (size_t)w[l], sizeof(float));
    }
    if (m->params == NULL || m->grads == NULL || m->step_grads == NULL || m->pool == NULL || m->labels == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    dopt_rng_init(&rng, 7, rank, 0);
    dopt_rng_uniform(&rng, 0, m->pool, (size_t)POOL_ROWS * (size_t)w[0]);
    dopt_rng_uniform(&rng, (size_t)POOL_ROWS * (size_t)w[0], m->params, m->n);
    for (l = 0; l < POOL_ROWS; l++) m->labels[l] = (unsigned char)(l % w[nl - 1]);
}

static void mlp_free(mlp *m) {
    int l;
    free(m->params), free(m->grads), free(m->step_grads), free(m->pool), free(m->labels);
    for (l = 0; l < m->nl; l++) free(m->act[l]), free(m->delta[l]);
}

static void mlp_micro_batch(void *ctx) {
    mlp *m = ctx;
    const int *w = m->w, B = m->B;
    size_t off[MAX_LAYERS], o = 0;
    int l, i, j;
    for (l = 0; l + 1 < m->nl; l++) off[l] = o, o += (size_t)w[l] * (size_t)w[l + 1] + (size_t)w[l + 1];
    for (i = 0; i < B; i++) { /* gather, as fmnist_mlp copies its shuffled samples */
        m->rng = m->rng * 6364136223846793005ull + 1442695040888963407ull;
        memcpy(m->act[0] + (size_t)i * w[0], m->pool + (size_t)(m->rng >> 33) % POOL_ROWS * w[0], w[0] * sizeof(float));
    }
    for (l = 0; l + 1 < m->nl; l++) { /* forward: act[l+1] = relu(act[l]·W + b), no relu on the logits */
        const float *W = m->params + off[l], *b = W + (size_t)w[l] * w[l + 1];
        float *out = m->act[l + 1];
        for (i = 0; i < B; i++) memcpy(out + (size_t)i * w[l + 1], b, w[l + 1] * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, w[l + 1], w[l], 1.0f, m->act[l], w[l], W, w[l + 1],
                    1.0f, out, w[l + 1]);
        if (l + 2 < m->nl)
            for (i = 0; i < B * w[l + 1]; i++) out[i] = out[i] > 0 ? out[i] : 0;
    }
    for (i = 0; i < B; i++) { /* softmax cross-entropy: delta of the logits */
        const int k = w[m->nl - 1];
        float *z = m->act[m->nl - 1] + (size_t)i * k, *d = m->delta[m->nl - 1] + (size_t)i * k, max = z[0], sum = 0;
        for (j = 1; j < k; j++) max = z[j] > max ? z[j] : max;
        for (j = 0; j < k; j++) sum += (d[j] = expf(z[j] - max));
        for (j = 0; j < k; j++) d[j] = (d[j] / sum - (j == m->labels[i])) / B;
    }
    for (l = m->nl - 2; l >= 0; l--) { /* backward: dW = actᵀ·delta, db, delta below masked by relu */
        float *gW = m->grads + off[l], *gb = gW + (size_t)w[l] * w[l + 1];
        const float *d = m->delta[l + 1];
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, w[l], w[l + 1], B, 1.0f, m->act[l], w[l], d, w[l + 1],
                    0.0f, gW, w[l + 1]);
        for (j = 0; j < w[l + 1]; j++) gb[j] = 0;
        for (i = 0; i < B; i++)
            for (j = 0; j < w[l + 1]; j++) gb[j] += d[(size_t)i * w[l + 1] + j];
        if (l == 0) break;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, w[l], w[l + 1], 1.0f, d, w[l + 1], m->params + off[l],
                    w[l + 1], 0.0f, m->delta[l], w[l]);
        for (i = 0; i < B * w[l]; i++)
            if (m->act[l][i] <= 0) m->delta[l][i] = 0;
    }
    dopt_axpy(m->step_grads, 0.5f, m->grads, m->n);
}

static void mlp_update(void *ctx) {
    mlp *m = ctx;
    memset(m->step_grads, 0, m->n * sizeof(float));
    dopt_axpy(m->params, -1e-9f, m->grads, m->n);
}

/* ===================================================================== THE INGREDIENTS */

typedef struct buffers {
    dopt_comm *comm;
    float *a, *b;
    size_t count; /* floats for allreduce and copy, bytes for allgather */
    dopt_batch *bc;
    dopt_compressor *cz;
    void *msg;
    size_t msg_bytes;
} buffers;

static void run_copy(void *ctx) { buffers *u = ctx; memcpy(u->b, u->a, u->count * sizeof(float)); }
static void run_allreduce(void *ctx) { buffers *u = ctx; dopt_allreduce(u->comm, u->a, u->count, DOPT_F32, DOPT_MEAN); }
static void run_allgather(void *ctx) { buffers *u = ctx; dopt_allgather(u->comm, u->a, u->b, u->count); }
static void run_observe(void *ctx) { buffers *u = ctx; dopt_batch_observe(u->bc, &(dopt_buf){.data = u->a, .n = u->count}, 1.0f); }
static void run_compress_allreduce(void *ctx) {
    buffers *u = ctx;
    memcpy(u->b, u->a, u->count * sizeof(float)); /* the allreduce overwrites: start from the same data */
    dopt_compress_allreduce(u->cz, u->comm, u->b, u->count);
}
static void run_encode(void *ctx) {
    buffers *u = ctx;
    dopt_buf g = dopt_buf_flat(u->a, u->count, u->cz->segs, u->cz->nsegs);
    size_t bytes;
    dopt_compress_encode(u->cz, &g, u->msg, u->msg_bytes, &bytes);
}
static void run_decode(void *ctx) {
    buffers *u = ctx;
    dopt_buf acc = dopt_buf_flat(u->b, u->count, u->cz->segs, u->cz->nsegs);
    dopt_compress_decode(u->cz, u->msg, u->msg_bytes, 0.5f, &acc);
}

/* T(x) = α + x/β: α in seconds, β in bytes per second. */
typedef struct alpha_beta { double alpha, beta; } alpha_beta;

static double ab_time(alpha_beta ab, double bytes) { return ab.alpha + bytes / ab.beta; }

/* Least squares in relative error: minimise Σ ((α + s·x_i − t_i)/t_i)², s = 1/β; α >= 0. */
static alpha_beta ab_fit(const double *x, const double *t, int k) {
    double sw = 0, sx = 0, sxx = 0, st = 0, sxt = 0, det, a, s;
    alpha_beta ab;
    int i;
    for (i = 0; i < k; i++) {
        double w = 1.0 / (t[i] * t[i]);
        sw += w, sx += w * x[i], sxx += w * x[i] * x[i], st += w * t[i], sxt += w * x[i] * t[i];
    }
    det = sw * sxx - sx * sx;
    a = (sxx * st - sx * sxt) / det;
    s = (sw * sxt - sx * st) / det;
    if (a < 0) a = 0, s = sxt / sxx; /* through the origin */
    ab.alpha = a, ab.beta = s > 0 ? 1.0 / s : INFINITY;
    return ab;
}

enum { NSIZES = 6 };
static const size_t fit_bytes[NSIZES] = {4096, 16384, 65536, 262144, 1048576, 4194304};

/* Times allreduce (f32 mean, bytes = 4·count) or allgather (bytes per rank) at fit_bytes and fits. */
static alpha_beta fit_collective(buffers *u, timed_fn fn, int floats, double seconds, double *t_out) {
    double x[NSIZES];
    int i;
    for (i = 0; i < NSIZES; i++) {
        x[i] = (double)fit_bytes[i];
        u->count = floats ? fit_bytes[i] / sizeof(float) : fit_bytes[i];
        t_out[i] = measure(u->comm, fn, u, seconds);
    }
    return ab_fit(x, t_out, NSIZES);
}

/* Everything T_step needs, in seconds and bytes. */
typedef struct ingredients {
    int N;
    size_t n, nsegs;
    int micro;
    double t_mb, t_obs, t_upd, t_copy;
    alpha_beta ar, ag;
} ingredients;

/* A codec's share: its message size and encode/decode times. */
typedef struct codec_cost {
    const char *name;
    dopt_codec codec;
    double msg_bytes, t_enc, t_dec, measured_allreduce;
} codec_cost;

/* ===================================================================== THE MODEL */

/* One averaging round's communication and codec time (C in the top comment). */
static double round_time(const ingredients *g, const codec_cost *cc, size_t period, int adaptive) {
    double c;
    if (cc == NULL) {
        c = 2 * g->t_copy + ab_time(g->ar, 4.0 * (double)g->n);
    } else {
        c = cc->t_enc + ab_time(g->ag, cc->msg_bytes) + g->N * cc->t_dec;
        if (cc->codec == DOPT_CODEC_TERNARY) c += ab_time(g->ar, 4.0 * (double)(g->nsegs + 1));
        c += (period > 1 ? 5 : 2) * g->t_copy;
    }
    if (adaptive) c += ab_time(g->ar, 64);
    return c;
}

/* T_step = k·(t_mb + a·t_obs) + t_upd + C/I, with k = batch / micro-batch. */
static double step_time(const ingredients *g, const codec_cost *cc, double batch, size_t period, int adaptive,
                        double *compute, double *comm) {
    double k = batch / g->micro;
    *compute = k * (g->t_mb + (adaptive ? g->t_obs : 0)) + g->t_upd;
    *comm = round_time(g, cc, period, adaptive) / (double)period;
    return *compute + *comm;
}

/* ===================================================================== MAIN */

typedef struct config {
    char label[64];
    char codec_name[16];
    double batch;
    size_t period;
    int adaptive;
    codec_cost *cc; /* NULL: fp32 */
} config;

static void parse_config(const char *spec, config *c) {
    const char *eq = strchr(spec, '='), *body = eq ? eq + 1 : spec;
    char flag[16] = "";
    int got;
    dopt_codec codec = DOPT_CODEC_FP32;
    memset(c, 0, sizeof *c);
    snprintf(c->label, sizeof c->label, "%.*s", eq ? (int)(eq - spec) : (int)strlen(spec), spec);
    got = sscanf(body, "%15[^:]:%lf:%zu:%15s", c->codec_name, &c->batch, &c->period, flag);
    if (got < 3 || c->batch <= 0 || c->period < 1 || (got == 4 && strcmp(flag, "adaptive")))
        flag_error("a configuration is [LABEL=]CODEC:B:I[:adaptive] with B > 0 and I >= 1 (got \"%s\")", spec);
    if (codec_from_name(c->codec_name, &codec) < 0)
        flag_error("configuration \"%s\": unknown codec \"%s\" (none, ternary, qsgd, topk, sign, fp16, bf16)", spec,
                   c->codec_name);
    if (codec == DOPT_CODEC_POWERSGD) /* two allreduces and matrix products, no message to time */
        flag_error("configuration \"%s\": the model has no powersgd (it times a codec's message)", spec);
    c->adaptive = got == 4;
}


/* ===================================================================== PROJECTION (--project)

   Samples per second of each method at N = 2 .. 1024 ranks on hosts of L ranks (H = N / L hosts;
   N < L: one host), for each link rate, from an α-β model of the schedules distopt runs and the
   compute this core measures (no world: it runs alone). Per step of b samples per rank:

     T = b·t_sample + C_method
     fp32        the allreduce of 4n bytes: within a host a ring (2(L-1)/L of the bytes at the
                 host's rate, 2(L-1) latencies), across hosts one ring per place carrying 1/L
                 each, so a host's link carries 2(H-1)/H of the bytes (2(H-1) latencies); flat
                 across hosts when L = 1
     tern-ag     TernGrad's message m (2 bits per element) to every rank: (N-1) messages over
                 each host's link (a ring through the ranks in host order), then N messages
                 checked and summed per element (a decode's float pass, and each further message's
                 2-bit codes read twice: 1/8 of that pass); plus the encode
     tern-ring   TernGrad's integer ring by host: within the host the sums of 1..L-1 ranks and
                 the final ones, across hosts those of L..(H-1)L and the final ones, each
                 ceil(log2(2k+1)) bits per element (compress.h: THE INTEGER RING); the encode's
                 statistics pass first, then the rest of the encode, a fold per element and step
                 and the decode overlapped with the wires, bucket by bucket (proj_ring_call)
     powersgd    two fp32 allreduces of r·(rows + cols) floats per matrix (and the vectors), plus
                 the products and orthonormalisation this core times
     local-I     the fp32 allreduce of the model every I steps
   Compute (encode, decode, folds, PowerSGD's products) is this core's; with --same-box, as on
   the simulated cluster, N ranks share this machine's cores and it is N/cores times slower.
   The schedule column says which each takes (two-level or flat). What it leaves out: overlap of
   compute and communication (but for the integer ring's own pipeline), congestion beyond one
   link per host, and the rates of real NICs and switches (give them: --gbits, --link-us,
   --intra-gbs). */

typedef struct projection {
    int L, period, rank, batch;
    double link_us, intra_gbs, intra_us, gbits[4];
    int ngbits;
    const char *out;
    double t_sample, c_enc, c_dec, t_psgd; /* measured here: seconds per sample, per element, per step */
    size_t n, nmat, psgd_floats_p, psgd_floats_q;
    int layouts[16][2], nlayouts;          /* --layouts HxL,...: these instead of N = 2 .. 1024 */
    int cores;                              /* --same-box: every rank on this machine's cores */
} projection;

/* What of a link's rate carries data: a 1500-byte frame holds 1448 bytes of TCP payload (IP's 20
   and TCP's 32 with timestamps besides) in the 1514 a shaper counts with the Ethernet header. */
#define PROJ_PAYLOAD (1448.0 / 1514.0)

/* Compute on N ranks: as on one core, or (--same-box) slowed by the ranks each core runs. */
static double proj_share(const projection *p, int N) { return p->cores > 0 && N > p->cores ? (double)N / p->cores : 1.0; }

static unsigned proj_width(double k) {
    unsigned w = 0;
    while ((double)(1ull << w) < 2 * k + 1) w++;
    return w;
}

/* Seconds of an allreduce of `bytes` over H hosts of L ranks, link R bytes/s. */
static double proj_allreduce(const projection *p, double bytes, int H, int L, double R) {
    double intra = L > 1 ? 2.0 * (L - 1) / L * bytes / (p->intra_gbs * 1e9) + 2.0 * (L - 1) * p->intra_us * 1e-6 : 0;
    double cross = H > 1 ? 2.0 * (H - 1) / H * bytes / R + 2.0 * (H - 1) * p->link_us * 1e-6 : 0;
    return intra + cross;
}

/* The integer ring's seconds on the wires: bytes each host link carries and each rank moves
   within its host. */
static double proj_ring(const projection *p, int H, int L, double R) {
    double n = (double)p->n, N = (double)H * L, wN = proj_width(N), cross = 0, intra = 0, steps = 0;
    int k;
    for (k = 1; k < L; k++) intra += proj_width(k);
    intra = (n / L) * (intra + (L - 1) * wN) / 8; /* bytes one rank receives within its host */
    for (k = 1; k < H; k++) cross += proj_width((double)k * L);
    cross = (n / H) * (cross + (H - 1) * wN) / 8; /* bytes a host's link carries (L places share it) */
    steps = 2.0 * (H - 1);
    return cross / R + steps * p->link_us * 1e-6 + intra / (p->intra_gbs * 1e9) + 2.0 * (L - 1) * p->intra_us * 1e-6;
}

/* The share of TernGrad's encode spent in its statistics pass (σ and max |g| per segment), which
   runs before the scales are shared and so before the ring: 0.28 in a profile of
   dopt_compress_encode on a 64 MiB gradient here (the generator 0.26, ternarize and pack 0.39,
   ties 0.07). */
#define PROJ_STATS_SHARE 0.28

/* The integer ring's call as compress.h pipelines it (THE INTEGER RING): the statistics pass
   first, then B buckets (one per 1 Mi elements, up to 16), each encoded, summed and decoded
   while the ones around it are: the wires' time W and the rest of the compute C (encode, a fold
   per element and step, decode) overlap, but for a bucket's worth of the smaller at either end. */
static double proj_ring_call(const projection *p, int H, int L, double R) {
    double n = (double)p->n, share = proj_share(p, H * L), B = floor(n / 1048576.0);
    double W = proj_ring(p, H, L, R);
    double C = n * ((1 - PROJ_STATS_SHARE) * p->c_enc + p->c_dec * (1 + (L - 1.0) / L + (H - 1.0) / (H * L))) * share;
    B = B < 1 ? 1 : B > 16 ? 16 : B;
    return n * PROJ_STATS_SHARE * p->c_enc * share + (W > C ? W : C) + (W > C ? C : W) / B;
}

/* C_method (seconds per step) and the schedule's name. */
static double proj_method(const projection *p, int m, int H, int L, double R, const char **schedule) {
    double n = (double)p->n, N = (double)H * L, msg = n / 4 + 32 + 16.0 * 2 * p->nmat, f32 = 4 * n;
    double share = proj_share(p, H * L);
    *schedule = H > 1 && L > 1 ? "two-level" : "flat";
    switch (m) {
    case 0: return proj_allreduce(p, f32, H, L, R);
    case 1:
        *schedule = "allgather";
        return (N - 1) * (msg / (H > 1 ? R : p->intra_gbs * 1e9) + (H > 1 ? p->link_us : p->intra_us) * 1e-6) +
               n * (p->c_enc + p->c_dec * (1 + (N - 1) / 8)) * share; /* one float pass; each further message's
                                                                          codes read twice (check, sum): 1/8 of one */
    case 2: return proj_ring_call(p, H, L, R);
    case 3:
        return proj_allreduce(p, 4.0 * (double)p->psgd_floats_p, H, L, R) +
               proj_allreduce(p, 4.0 * (double)p->psgd_floats_q, H, L, R) + p->t_psgd * share;
    default: return proj_allreduce(p, f32, H, L, R) / p->period;
    }
}

static const char *const proj_names[5] = {"fp32", "tern-allgather", "tern-ring", "powersgd", "local-sgd"};

static void run_psgd_step(void *ctx) {
    buffers *u = ctx;
    memcpy(u->b, u->a, u->count * sizeof(float));
    dopt_compress_allreduce(u->cz, u->comm, u->b, u->count);
}

/* The rows: --layouts, else N = 2, 4, ..., 1024 on hosts of L (one host below L). */
static int proj_rows(const projection *p) { return p->nlayouts ? p->nlayouts : 10; }

static int proj_layout(const projection *p, int i, int *H, int *L) {
    int N = 2 << i;
    if (p->nlayouts) {
        *H = p->layouts[i][0], *L = p->layouts[i][1];
        return *H * *L;
    }
    *L = N < p->L ? N : p->L;
    *H = N / *L;
    return N;
}

static int project_main(const model_options *mo, projection *p) {
    dopt_comm *self;
    mlp m;
    buffers u;
    dopt_compressor cz;
    dopt_compressor_config cfg;
    dopt_segment segs[MAX_LAYERS * 2];
    size_t i, nsegs = 2 * (size_t)(mo->nlayers - 1);
    int gi, N, meth, li;
    char path[1024];
    FILE *csv;
    if (dopt_comm_create_self(&self) != DOPT_OK) return 1;
    p->n = mlp_params(mo->layers, mo->nlayers);
    p->nmat = (size_t)(mo->nlayers - 1);
    for (i = 0; i + 1 < (size_t)mo->nlayers; i++) {
        segs[2 * i].count = (size_t)mo->layers[i] * (size_t)mo->layers[i + 1];
        segs[2 * i].rows = (size_t)mo->layers[i + 1]; /* W: outputs × inputs */
        segs[2 * i + 1].count = (size_t)mo->layers[i + 1];
        segs[2 * i + 1].rows = 0;
        segs[2 * i].name = segs[2 * i + 1].name = NULL;
    }
    for (i = 0; i < nsegs; i++) segs[i].offset = i ? segs[i - 1].offset + segs[i - 1].count : 0;
    /* this core: the MLP per sample, TernGrad's encode and decode per element, PowerSGD's step */
    mlp_init(&m, mo->layers, mo->nlayers, mo->micro, 0);
    p->t_sample = mo->sample_us > 0 ? mo->sample_us * 1e-6 : measure(self, mlp_micro_batch, &m, mo->seconds) / mo->micro;
    memset(&u, 0, sizeof u);
    u.comm = self, u.count = p->n;
    u.a = m.grads; /* the codecs timed on noise: a gradient of one short run may be mostly zeros */
    for (i = 0; i < p->n; i++) m.rng = m.rng * 6364136223846793005ull + 1442695040888963407ull,
                              u.a[i] = (float)((double)(m.rng >> 40) / 16777216.0 - 0.5) * 0.02f;
    u.b = malloc(p->n * sizeof(float));
    memset(&cfg, 0, sizeof cfg);
    cfg.seed = 1;
    if (u.b == NULL || dopt_compressor_init(&cz, &cfg, segs, nsegs) != DOPT_OK) return dopt_comm_finish(self, 1);
    u.cz = &cz, u.msg_bytes = dopt_compress_bound(&cz), u.msg = malloc(u.msg_bytes);
    p->c_enc = measure(self, run_encode, &u, mo->seconds / 2) / (double)p->n;
    p->c_dec = measure(self, run_decode, &u, mo->seconds / 2) / (double)p->n;
    free(u.msg);
    dopt_compressor_free(&cz);
    cfg.codec = DOPT_CODEC_POWERSGD;
    cfg.powersgd_rank = (unsigned)p->rank;
    if (dopt_compressor_init(&cz, &cfg, segs, nsegs) != DOPT_OK) return dopt_comm_finish(self, 1);
    u.cz = &cz;
    p->t_psgd = measure(self, run_psgd_step, &u, mo->seconds / 2);
    p->psgd_floats_p = p->psgd_floats_q = 0;
    for (i = 0; i < nsegs; i++) {
        size_t rows = segs[i].rows, n = segs[i].count;
        int squeezed = rows && (size_t)p->rank * (rows + n / rows) < n && n >= 4096;
        p->psgd_floats_p += squeezed ? (size_t)p->rank * rows : n;
        p->psgd_floats_q += squeezed ? (size_t)p->rank * (n / rows) : 0;
    }
    dopt_compressor_free(&cz);
    if (strlen(p->out) > 300) flag_error("--out: a directory name of at most 300 characters");
    snprintf(path, sizeof path, "%s/projection.csv", p->out);
    if ((csv = fopen(path, "w")) == NULL) {
        fprintf(stderr, "perf_model: cannot write %s (does the directory exist?)\n", path);
        return dopt_comm_finish(self, 1);
    }
    fprintf(csv, "gbits,ranks,hosts,local,method,schedule,comm_ms,step_ms,samples_per_s\n");
    printf("perf_model --project: MLP of %zu parameters, %d samples per rank and step, hosts of %d ranks\n", p->n,
           p->batch, p->L);
    printf("  measured on this core: %.2f us per sample, TernGrad encode %.2f ns and decode %.2f ns per element,\n"
           "  PowerSGD r = %d step %.1f us; links %.0f us per message, within a host %.1f GB/s and %.1f us\n",
           1e6 * p->t_sample, 1e9 * p->c_enc, 1e9 * p->c_dec, p->rank, 1e6 * p->t_psgd, p->link_us, p->intra_gbs,
           p->intra_us);
    for (gi = 0; gi < p->ngbits; gi++) { /* the table, a row per world size */
        double R = p->gbits[gi] * 1e9 / 8 * PROJ_PAYLOAD;
        printf("\n  %.0f Gbit/s: samples per second (schedule)\n  %6s %6s", p->gbits[gi], "ranks", "hosts");
        for (meth = 0; meth < 5; meth++) printf(" %24s", proj_names[meth]);
        printf("\n");
        for (li = 0; li < proj_rows(p); li++) {
            int H, L;
            N = proj_layout(p, li, &H, &L);
            printf("  %6d %6d", N, H);
            for (meth = 0; meth < 5; meth++) {
                const char *sched;
                double t = p->batch * p->t_sample + proj_method(p, meth, H, L, R, &sched);
                printf(" %12.0f %-11s", N * p->batch / t, sched);
            }
            printf("\n");
        }
    }
    for (gi = 0; gi < p->ngbits; gi++) /* the CSV, a run of rows per rate and method (the figure's lines) */
        for (meth = 0; meth < 5; meth++)
            for (li = 0; li < proj_rows(p); li++) {
                int H, L;
                const char *sched;
                N = proj_layout(p, li, &H, &L);
                double c = proj_method(p, meth, H, L, p->gbits[gi] * 1e9 / 8 * PROJ_PAYLOAD, &sched);
                double t = p->batch * p->t_sample + c;
                fprintf(csv, "%g,%d,%d,%d,%s,%s,%.4f,%.4f,%.1f\n", p->gbits[gi], N, H, L, proj_names[meth], sched,
                        1e3 * c, 1e3 * t, N * p->batch / t);
            }
    fclose(csv);
    printf("\n  table: %s\n", path);
    snprintf(path, sizeof path, "command -v gnuplot >/dev/null 2>&1 && cd '%s' && gnuplot -e \"set terminal pngcairo size 1000,420; "
             "set output 'projection.png'; set datafile separator ','; set logscale x 2; set logscale y 10; set format y '10^{%%L}'; set key top left; "
             "set xlabel 'ranks'; set ylabel 'samples per second'; set multiplot layout 1,2; "
             "do for [g in '%g %g'] { set title g.' Gbit/s between hosts, %d ranks per host'; "
             "plot for [m in 'fp32 tern-allgather tern-ring powersgd local-sgd'] 'projection.csv' "
             "using (\\$1 == g+0 && strcol(5) eq m ? \\$2 : NaN):9 with linespoints title m }; unset multiplot\"",
             p->out, p->gbits[0], p->gbits[p->ngbits > 1 ? 1 : 0], p->L);
    if (system(path) == 0) printf("  figure: %s/projection.png\n", p->out);
    free(u.b);
    mlp_free(&m);
    return dopt_comm_finish(self, 0);
}

/* ===================================================================== OVERLAP (--overlap)

   The synchronous step whose gradient buckets are averaged while backward runs (localsgd.h:
   SYNCHRONOUS STEPS: BUCKETS DURING BACKWARD), from what a run of the host measured: its step's
   compute C with no communication, backward's share B of it, and the gradient's segments in the
   order backward finishes them (n_1 .. n_m elements), on H hosts of one rank whose links carry R
   bytes/s of payload with A seconds per message:

     ready_j  = B · (n_1 + .. + n_j) / (n_1 + .. + n_m)   backward's work taken proportional to the
                                                          parameters it finishes (matrix products)
     buckets  cut as the driver cuts them after its first step: the first up to min(1 MiB, S_b),
              the others up to S_b, segments never split; S_b given, or the driver's rule itself
              (localsgd.h's dopt__dp_bucket_rule, called here so the two cannot drift) with the
              rates the model's allreduce has
     T_ar(x)  = 2(H-1)·A + 2(H-1)/H · x / R               the ring's latencies and bytes per link,
              or with --comm-ms M (the whole average measured alone): 2(H-1)·A + (M - 2(H-1)·A)·x / 4n
     start_k  = max(ready of bucket k's last segment, end_{k-1}),  end_k = start_k + T_ar(bytes_k)
     overlapped step = C + max(0, end_last - B)           the tail exposed after backward
     blocking step   = C + T_ar(4·n)                      the whole average after backward

   What it leaves out: the CPU the communication takes from the compute (the kernel's TCP and the
   driver's worker on cores the ranks share), the skew between ranks, and backward's work that
   finishes no parameter (attention's products): each shifts the ready times or stretches C. */

enum { OVERLAP_MAX_SEGS = 4096 };

typedef struct overlap_step {
    double model_s, blocking_s, comm_s, tail_s, bucket_bytes;
    int buckets;
} overlap_step;

/* The timeline of the buckets after the segments' ready times, as the driver runs them. */
static overlap_step overlap_predict(const double *n, int m, int H, double R, double link_s, double C, double B,
                                    double M, double bucket_bytes, double first_bytes) {
    overlap_step o;
    double total = 0, done = 0, alpha = 2.0 * (H - 1) * link_s, share = H > 1 ? 2.0 * (H - 1) / H : 0, end = 0;
    int j = 0;
    memset(&o, 0, sizeof o);
    for (j = 0; j < m; j++) total += n[j];
    if (M > alpha) R = share * 4 * total / (M - alpha); /* the rate the measured average had */
    o.comm_s = alpha + share * 4 * total / R;
    o.bucket_bytes = bucket_bytes > 0 ? bucket_bytes
                                      : (double)dopt__dp_bucket_rule(4 * total, alpha, share > 0 ? R / share : 1e12, B);
    first_bytes = first_bytes > 0 ? first_bytes : (double)DOPT__DP_FIRST_BUCKET;
    if (first_bytes > o.bucket_bytes) first_bytes = o.bucket_bytes;
    for (j = 0; j < m;) { /* one bucket a pass */
        double cap = o.buckets == 0 ? first_bytes : o.bucket_bytes, bytes = 0;
        do {
            done += n[j];
            bytes += 4 * n[j];
            j++;
        } while (j < m && bytes + 4 * n[j] <= cap);
        end = fmax(end, B * done / total) + alpha + share * bytes / R;
        o.buckets++;
    }
    o.tail_s = end > B ? end - B : 0;
    o.model_s = C + o.tail_s;
    o.blocking_s = C + o.comm_s;
    return o;
}

static int overlap_main(const model_options *mo) {
    double n[OVERLAP_MAX_SEGS], R = strtod(mo->gbits, NULL) * 1e9 / 8 * PROJ_PAYLOAD;
    const char *v = mo->segments;
    int m = 0;
    overlap_step o;
    if (v == NULL || mo->hosts < 1 || !(mo->compute_ms > 0) || !(R > 0))
        flag_error("--overlap needs --segments, --hosts, --gbits and --compute-ms");
    if (mo->backward_ms > mo->compute_ms) flag_error("--backward-ms exceeds --compute-ms (backward is part of the step)");
    while (*v && m < OVERLAP_MAX_SEGS) {
        char *end;
        n[m] = strtod(v, &end);
        if (!(n[m] > 0) || (*end != ',' && *end != '\0'))
            flag_error("--segments expects element counts > 0 separated by commas (got \"%s\")", mo->segments);
        m++;
        v = end + (*end == ',');
    }
    if (*v) flag_error("--segments: at most %d segments", OVERLAP_MAX_SEGS);
    o = overlap_predict(n, m, mo->hosts, R, mo->link_us * 1e-6, mo->compute_ms * 1e-3, mo->backward_ms * 1e-3,
                        mo->comm_ms * 1e-3, mo->bucket_bytes, mo->first_bytes);
    printf("perf_model --overlap: %d segments, %d hosts at %g Gbit/s, %.0f us per message: %d buckets of %.0f bytes\n",
           m, mo->hosts, strtod(mo->gbits, NULL), mo->link_us, o.buckets, o.bucket_bytes);
    printf("overlap model_ms=%.3f blocking_model_ms=%.3f comm_model_ms=%.3f tail_ms=%.3f buckets=%d bucket_bytes=%.0f\n",
           1e3 * o.model_s, 1e3 * o.blocking_s, 1e3 * o.comm_s, 1e3 * o.tail_s, o.buckets, o.bucket_bytes);
    return 0;
}

int main(int argc, char **argv) {
    model_options mo;
    ingredients g;
    codec_cost costs[MAX_CONFIGS];
    config cfgs[MAX_CONFIGS];
    int ncosts = 0, i, j;
    mlp m;
    buffers u;
    dopt_comm *comm;
    dopt_segment segs[MAX_LAYERS * 2];
    size_t sizes[MAX_LAYERS * 2];
    double t_ar[NSIZES], t_ag[NSIZES], fp32_measured;
    FILE *csv = NULL;

    memset(&mo, 0, sizeof mo);
    mo.comm.transport = NULL, mo.comm.workers = 0, mo.comm.compress = "none", mo.comm.period = 1;
    mo.comm.adaptive = "off";
    mo.layers[0] = 784, mo.layers[1] = 256, mo.layers[2] = 128, mo.layers[3] = 10, mo.nlayers = 4;
    mo.micro = 64, mo.seconds = 0.2;
    mo.local = 8, mo.period = 8, mo.rank = 4, mo.link_us = 50, mo.intra_gbs = 10, mo.intra_us = 5;
    mo.gbits = "1,10", mo.out = ".";
    parse_model_options(&mo, argc, argv);
    if (mo.overlap) return overlap_main(&mo);
    if (mo.project) {
        projection p;
        char *end = (char *)mo.gbits;
        memset(&p, 0, sizeof p);
        p.L = mo.local, p.period = mo.period, p.rank = mo.rank, p.batch = mo.micro;
        p.link_us = mo.link_us, p.intra_gbs = mo.intra_gbs, p.intra_us = mo.intra_us, p.out = mo.out;
        p.cores = mo.same_box ? (int)sysconf(_SC_NPROCESSORS_ONLN) : 0;
        for (end = (char *)mo.layouts; end && *end && p.nlayouts < 16; p.nlayouts++) {
            long h = strtol(end, &end, 10), l = *end == 'x' ? strtol(end + 1, &end, 10) : 0;
            if (h < 1 || l < 1 || h * l > 1 << 20 || (*end != ',' && *end != '\0'))
                flag_error("--layouts expects HOSTSxRANKS separated by commas (got \"%s\")", mo.layouts);
            p.layouts[p.nlayouts][0] = (int)h, p.layouts[p.nlayouts][1] = (int)l;
            end += *end == ',';
        }
        end = (char *)mo.gbits;
        while (*end && p.ngbits < 4) {
            double g = strtod(end, &end);
            if (!(g > 0) || (*end != ',' && *end != '\0')) flag_error("--gbits expects rates > 0 separated by commas (got \"%s\")", mo.gbits);
            p.gbits[p.ngbits++] = g;
            end += *end == ',';
        }
        return project_main(&mo, &p);
    }
    for (i = 0; i < mo.nconfigs; i++) parse_config(mo.configs[i], &cfgs[i]);
    export_launch_flags(&mo.comm);
    if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1;

    memset(&g, 0, sizeof g);
    g.N = comm->size, g.micro = mo.micro, g.n = mlp_params(mo.layers, mo.nlayers);
    for (i = 0; i + 1 < mo.nlayers; i++) {
        sizes[2 * i] = (size_t)mo.layers[i] * (size_t)mo.layers[i + 1];
        sizes[2 * i + 1] = (size_t)mo.layers[i + 1];
    }
    g.nsegs = 2 * (size_t)(mo.nlayers - 1);
    dopt_segments_from_sizes(segs, sizes, g.nsegs, NULL);

    /* The host's compute, all ranks at once. */
    mlp_init(&m, mo.layers, mo.nlayers, mo.micro, comm->rank);
    g.t_mb = mo.sample_us > 0 ? mo.sample_us * 1e-6 * mo.micro : measure(comm, mlp_micro_batch, &m, mo.seconds);
    g.t_upd = measure(comm, mlp_update, &m, mo.seconds / 2);

    /* Memory passes, the batch test's observation, the collectives. */
    memset(&u, 0, sizeof u);
    u.comm = comm;
    u.a = malloc((fit_bytes[NSIZES - 1] / sizeof(float) + g.n) * sizeof(float));
    u.b = malloc((size_t)comm->size * (fit_bytes[NSIZES - 1] + g.n * sizeof(float)));
    if (u.a == NULL || u.b == NULL) { fprintf(stderr, "out of memory\n"); return dopt_comm_finish(comm, 1); }
    memcpy(u.a, m.grads, g.n * sizeof(float));
    u.count = g.n;
    g.t_copy = measure(comm, run_copy, &u, mo.seconds / 2);
    {
        dopt_batch bc;
        dopt_batch_config bcfg;
        memset(&bcfg, 0, sizeof bcfg);
        bcfg.unit_samples = (size_t)mo.micro;
        if (dopt_batch_init(&bc, g.n, &bcfg) == DOPT_OK) {
            u.bc = &bc;
            g.t_obs = measure(comm, run_observe, &u, mo.seconds / 2);
            dopt_batch_free(&bc);
        }
    }
    if (mo.alpha_us > 0) {
        g.ar.alpha = g.ag.alpha = mo.alpha_us * 1e-6;
        g.ar.beta = g.ag.beta = mo.beta_gbs * 1e9;
        memset(t_ar, 0, sizeof t_ar), memset(t_ag, 0, sizeof t_ag);
    } else {
        g.ar = fit_collective(&u, run_allreduce, 1, mo.seconds / 2, t_ar);
        g.ag = fit_collective(&u, run_allgather, 0, mo.seconds / 2, t_ag);
    }
    memcpy(u.a, m.grads, g.n * sizeof(float));
    u.count = g.n;
    fp32_measured = measure(comm, run_allreduce, &u, mo.seconds / 2);

    /* Each codec the configurations name: its message, encode, decode, and the real allreduce. */
    for (i = 0; i < mo.nconfigs; i++) {
        dopt_codec codec;
        dopt_compressor cz;
        dopt_compressor_config ccfg;
        if (codec_from_name(cfgs[i].codec_name, &codec) != 1) continue; /* none: fp32 (unknown ones were refused) */
        for (j = 0; j < ncosts && strcmp(costs[j].name, cfgs[i].codec_name); j++) {}
        cfgs[i].cc = &costs[j];
        if (j < ncosts) continue;
        memset(&ccfg, 0, sizeof ccfg);
        ccfg.codec = codec, ccfg.seed = 1, ccfg.rank = comm->rank;
        if (dopt_compressor_init(&cz, &ccfg, segs, g.nsegs) != DOPT_OK) {
            fprintf(stderr, "cannot set up the %s compressor\n", cfgs[i].codec_name);
            return dopt_comm_finish(comm, 1);
        }
        costs[ncosts].name = cfgs[i].codec_name, costs[ncosts].codec = codec;
        u.cz = &cz, u.count = g.n, u.msg_bytes = dopt_compress_bound(&cz);
        u.msg = malloc(u.msg_bytes);
        memcpy(u.a, m.grads, g.n * sizeof(float));
        costs[ncosts].msg_bytes = (double)u.msg_bytes;
        costs[ncosts].t_enc = measure(comm, run_encode, &u, mo.seconds / 2);
        costs[ncosts].t_dec = measure(comm, run_decode, &u, mo.seconds / 2);
        costs[ncosts].measured_allreduce = measure(comm, run_compress_allreduce, &u, mo.seconds / 2);
        free(u.msg);
        dopt_compressor_free(&cz);
        ncosts++;
    }

    if (comm->rank == 0) {
        printf("perf_model: %s, %d rank(s), MLP", comm->vt->name, g.N);
        for (i = 0; i < mo.nlayers; i++) printf("%s%d", i ? "-" : " ", mo.layers[i]);
        printf(" (%zu parameters, %zu tensors), micro-batch %d\n\n", g.n, g.nsegs, g.micro);
        printf("ingredients (slowest rank, median of %d):\n", REPEATS);
        printf("  compute per micro-batch t_mb   %9.1f us  (%.2f us/sample%s)\n", 1e6 * g.t_mb, 1e6 * g.t_mb / g.micro,
               mo.sample_us > 0 ? ", given" : "");
        printf("  update t_upd                   %9.1f us\n", 1e6 * g.t_upd);
        printf("  copy of n floats t_copy        %9.1f us\n", 1e6 * g.t_copy);
        printf("  batch-test observe t_obs       %9.1f us\n", 1e6 * g.t_obs);
        printf("  allreduce  alpha %8.2f us  beta %9.3f GB/s%s\n", 1e6 * g.ar.alpha, g.ar.beta / 1e9,
               mo.alpha_us > 0 ? " (given)" : g.N == 1 ? " (a world of one: copies at most)" : "");
        printf("  allgather  alpha %8.2f us  beta %9.3f GB/s%s\n", 1e6 * g.ag.alpha, g.ag.beta / 1e9,
               mo.alpha_us > 0 ? " (given)" : g.N == 1 ? " (a world of one: copies at most)" : "");
        if (mo.alpha_us <= 0) {
            printf("  fit check (us)     bytes: ");
            for (i = 0; i < NSIZES; i++) printf(" %9zu", fit_bytes[i]);
            printf("\n    allreduce measured      ");
            for (i = 0; i < NSIZES; i++) printf(" %9.1f", 1e6 * t_ar[i]);
            printf("\n    allreduce fitted        ");
            for (i = 0; i < NSIZES; i++) printf(" %9.1f", 1e6 * ab_time(g.ar, (double)fit_bytes[i]));
            printf("\n    allgather measured      ");
            for (i = 0; i < NSIZES; i++) printf(" %9.1f", 1e6 * t_ag[i]);
            printf("\n    allgather fitted        ");
            for (i = 0; i < NSIZES; i++) printf(" %9.1f", 1e6 * ab_time(g.ag, (double)fit_bytes[i]));
            printf("\n");
        }
        printf("\none synchronous gradient average of n floats (us): model against the real call\n");
        printf("  %-10s %10s %10s %10s %10s %10s\n", "codec", "msg_bytes", "encode", "decode", "model", "measured");
        printf("  %-10s %10zu %10s %10s %10.1f %10.1f\n", "fp32", 4 * g.n, "-", "-",
               1e6 * ab_time(g.ar, 4.0 * (double)g.n), 1e6 * fp32_measured);
        for (i = 0; i < ncosts; i++) {
            double model = round_time(&g, &costs[i], 1, 0) - 2 * g.t_copy; /* the call alone: no pack, unpack */
            printf("  %-10s %10.0f %10.1f %10.1f %10.1f %10.1f\n", costs[i].name, costs[i].msg_bytes,
                   1e6 * costs[i].t_enc, 1e6 * costs[i].t_dec, 1e6 * model,
                   1e6 * (costs[i].measured_allreduce - g.t_copy)); /* its timing loop copies the input first */
        }
        if (mo.nconfigs) {
            printf("\npredicted step time (ms)\n  %-24s %6s %8s %4s %9s %9s %9s\n", "config", "ranks", "batch",
                   "I", "compute", "comm", "step");
            if (mo.csv && (csv = fopen(mo.csv, "w")) != NULL)
                fprintf(csv, "label,ranks,codec,batch,period,adaptive,compute_ms,comm_ms,step_ms\n");
        }
        for (i = 0; i < mo.nconfigs; i++) {
            double compute, comm_part, t = step_time(&g, cfgs[i].cc, cfgs[i].batch, cfgs[i].period,
                                                      cfgs[i].adaptive, &compute, &comm_part);
            printf("  %-24s %6d %8.1f %4zu %9.3f %9.3f %9.3f\n", cfgs[i].label, g.N, cfgs[i].batch, cfgs[i].period,
                   1e3 * compute, 1e3 * comm_part, 1e3 * t);
            if (csv)
                fprintf(csv, "%s,%d,%s,%.2f,%zu,%d,%.4f,%.4f,%.4f\n", cfgs[i].label, g.N, cfgs[i].codec_name,
                        cfgs[i].batch, cfgs[i].period, cfgs[i].adaptive, 1e3 * compute, 1e3 * comm_part, 1e3 * t);
        }
        if (csv) fclose(csv);
    }
    free(u.a), free(u.b);
    mlp_free(&m);
    return dopt_comm_finish(comm, 0);
}
