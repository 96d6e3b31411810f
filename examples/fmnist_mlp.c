/* fmnist_mlp.c — an MLP 784-256-128-10 (ReLU, softmax cross-entropy) on Fashion-MNIST, trained
   data-parallel: each rank takes its shard of the training set, rank 0's initial parameters go to
   every rank, then either synchronous SGD (gradients averaged in fp32 or through a compressor) or
   local SGD / CELGC averaging the models every --period steps. The lines marked "distopt" are
   what a host adds to its own loop; the rest is a plain C training loop with OpenBLAS sgemm.

       OPENBLAS_NUM_THREADS=1 build/fmnist_mlp --transport shm --workers 2 --epochs 3
       OPENBLAS_NUM_THREADS=1 build/fmnist_mlp --transport shm --workers 2 --compress ternary \
           --period 4 --clip 5 --adaptive-batch norm --csv tern.csv

       mpirun --allow-run-as-root -n 2 -x OPENBLAS_NUM_THREADS=1 build/fmnist_mlp --transport mpi

   --compress powersgd (with --powersgd-rank R, default 2) sends rank-R factors of W1 and W2, the
   weight matrices the segment table gives a shape; the biases and W3 (1280 elements, below
   PowerSGD's 4096) go as fp32.

   Data: the Debian package dataset-fashion-mnist (gzip IDX files, read with zlib). One line per
   evaluation (at the end of every epoch, and --evals-per-epoch E times per epoch): epoch (a
   fraction between epoch ends), train loss since the previous evaluation (mean over ranks), test
   accuracy, averaging rounds, payload bytes this rank handed to the transport during training
   (the communicator's traffic counter), training wall time, samples per step, steps. Evaluation
   is excluded from the bytes and the time: every rank waits at a barrier while rank 0 evaluates,
   and that pause is taken off the clock.

   Flags of this example beyond those of common.h:
     --tern-clip C        TernGrad's per-layer clipping to ±C·σ before ternarizing (the library's
                          default is 2.5); "off" disables it
     --batch-nu X         adaptive batch, aip: the orthogonality test's ν (library default 0.1)
     --evals-per-epoch E  evaluate E times per epoch (at the first step past each 1/E), default 1
     --target-acc A       report the first evaluation whose test accuracy reaches A percent: its
                          epoch, step, rounds, bytes and training time ("target ... reached")
     --overlap on|off     on: backward marks each tensor's gradient final as it finishes it (W3
                          and b3 first), so that the driver averages it while backward goes on;
                          off (default): the whole average after backward. Same numbers either way.
     --elastic on|off     on (local SGD over TCP or shm with DOPT_ON_PEER_LOST=shrink): a lost worker does
                          not end the run; the survivors take its samples and start the epoch over
                          on their new shards. A worker started again with DOPT_JOIN=1 (same flags)
                          is taken back at the end of a round: it takes the job's state in its
                          dopt_dp_broadcast, learns the epoch from the members and goes on with
                          them, everybody on the shards of the larger world.
   At the end rank 0 prints an FNV-1a hash of the final parameters ("params fnv1a ...", to compare
   runs bit for bit) and the timing line (common.h: STEP TIMING). */
#define DISTOPT_IMPLEMENTATION
#include "distopt.h"
#include "transport_shm.h"
#include "transport_tcp.h"
#include "localsgd.h" /* brings clip.h and compress.h */
#include "common.h"

#include <cblas.h>
#include <math.h>
#include "fashion_mnist.h"


enum { IN = 784, H1 = 256, H2 = 128, OUT = 10, NTENSORS = 6 };

/* The parameters (and gradients) are one flat array: W1 b1 W2 b2 W3 b3, W row-major in × out. */
static const size_t tensor_sizes[NTENSORS] = {IN * H1, H1, H1 * H2, H2, H2 * OUT, OUT};
enum { OFF_W1 = 0, OFF_B1 = OFF_W1 + IN * H1, OFF_W2 = OFF_B1 + H1, OFF_B2 = OFF_W2 + H1 * H2,
       OFF_W3 = OFF_B2 + H2, OFF_B3 = OFF_W3 + H2 * OUT, NPARAMS = OFF_B3 + OUT };

typedef struct activations { float *h1, *h2, *out, *d1, *d2; } activations;

/* ===================================================================== DATA */

static float *pixels_to_floats(const unsigned char *px, size_t count) {
    float *x = malloc(count * IN * sizeof(float));
    size_t i;
    for (i = 0; i < count * IN; i++) x[i] = px[i] / 255.0f;
    return x;
}

/* ===================================================================== MODEL */

static float *alloc_floats(size_t n) {
    float *p = calloc(n, sizeof(float));
    if (p == NULL) { fprintf(stderr, "out of memory\n"); exit(1); }
    return p;
}

static void init_params(float *p, uint64_t seed) { /* He-uniform weights, zero biases */
    dopt_rng rng;
    size_t i;
    dopt_rng_init(&rng, seed, 0, 0);
    dopt_rng_uniform(&rng, 0, p, NPARAMS);
    for (i = 0; i < NPARAMS; i++) {
        float fan_in = i < OFF_B1 ? IN : i < OFF_W2 ? 0 : i < OFF_B2 ? H1 : i < OFF_W3 ? 0 : i < OFF_B3 ? H2 : 0;
        p[i] = fan_in > 0 ? (2 * p[i] - 1) * sqrtf(6.0f / fan_in) : 0.0f;
    }
}

/* out = act(in · W + bias) for a batch of B rows. */
static void dense(const float *in, int B, int nin, const float *W, const float *bias, int nout, float *out, int relu) {
    int i;
    for (i = 0; i < B; i++) memcpy(out + (size_t)i * nout, bias, nout * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, nout, nin, 1.0f, in, nin, W, nout, 1.0f, out, nout);
    if (relu)
        for (i = 0; i < B * nout; i++) out[i] = out[i] > 0 ? out[i] : 0;
}

static void forward(const float *p, const float *x, int B, activations *a) {
    dense(x, B, IN, p + OFF_W1, p + OFF_B1, H1, a->h1, 1);
    dense(a->h1, B, H1, p + OFF_W2, p + OFF_B2, H2, a->h2, 1);
    dense(a->h2, B, H2, p + OFF_W3, p + OFF_B3, OUT, a->out, 0);
}

/* Backward through one dense layer: dW = inᵀ·dout, db = Σ rows of dout, both final then
   (tensors w and w + 1: the hooks may hand them over), and (when din is not NULL) din = dout·Wᵀ
   masked by the ReLU of in. */
static void dense_backward(const float *in, int B, int nin, const float *W, const float *dout, int nout, float *gW,
                           float *gb, float *din, backward_hooks *h, size_t w) {
    int i, j;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nin, nout, B, 1.0f, in, nin, dout, nout, 0.0f, gW, nout);
    for (j = 0; j < nout; j++) gb[j] = 0;
    for (i = 0; i < B; i++)
        for (j = 0; j < nout; j++) gb[j] += dout[(size_t)i * nout + j];
    tensor_final(h, w);
    tensor_final(h, w + 1);
    if (din == NULL) return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, nin, nout, 1.0f, dout, nout, W, nout, 0.0f, din, nin);
    for (i = 0; i < B * nin; i++)
        if (in[i] <= 0) din[i] = 0;
}

/* The mean cross-entropy of a batch and its gradient g (all NPARAMS elements written), the
   last layer first; h (or NULL) times the backward pass and hands each tensor over. */
static double loss_and_gradient(const float *p, const float *x, const unsigned char *y, int B, activations *a,
                                float *g, backward_hooks *h) {
    double loss = 0, t0;
    int i, k;
    forward(p, x, B, a);
    t0 = wall_seconds();
    for (i = 0; i < B; i++) { /* softmax, then out becomes d loss / d logits */
        float *z = a->out + (size_t)i * OUT, max = z[0], sum = 0;
        for (k = 1; k < OUT; k++) max = z[k] > max ? z[k] : max;
        for (k = 0; k < OUT; k++) sum += (z[k] = expf(z[k] - max));
        loss -= log(z[y[i]] / sum);
        for (k = 0; k < OUT; k++) z[k] = (z[k] / sum - (k == y[i])) / B;
    }
    dense_backward(a->h2, B, H2, p + OFF_W3, a->out, OUT, g + OFF_W3, g + OFF_B3, a->d2, h, 4);
    dense_backward(a->h1, B, H1, p + OFF_W2, a->d2, H2, g + OFF_W2, g + OFF_B2, a->d1, h, 2);
    dense_backward(x, B, IN, p + OFF_W1, a->d1, H1, g + OFF_W1, g + OFF_B1, NULL, h, 0);
    if (h) h->backward_secs += wall_seconds() - t0;
    return loss / B;
}

static double accuracy(const float *p, const float *x, const unsigned char *y, size_t count, activations *a, int B) {
    size_t i, correct = 0;
    for (i = 0; i < count; i += (size_t)B) {
        int b = count - i < (size_t)B ? (int)(count - i) : B, r, k;
        forward(p, x + i * IN, b, a);
        for (r = 0; r < b; r++) {
            const float *z = a->out + (size_t)r * OUT;
            int best = 0;
            for (k = 1; k < OUT; k++) best = z[k] > z[best] ? k : best;
            correct += best == y[i + (size_t)r];
        }
    }
    return (double)correct / (double)count;
}

/* ===================================================================== FLAGS */

/* The flags above that common.h does not know (parse_options_extra hands them here). */
typedef struct local_options {
    float tern_clip; /* 0: the library's default */
    int evals_per_epoch;
    double target_acc; /* percent, 0: none */
    int overlap;       /* 1: backward hands each tensor to the driver as it is final */
    int elastic;       /* 1: a lost worker does not end the run (local SGD; localsgd.h: ELASTIC) */
} local_options;

static int local_flag(void *user, const char *f, const char *v) {
    local_options *lo = (local_options *)user;
    if (!strcmp(f, "--overlap")) {
        lo->overlap = overlap_flag(f, v);
        return 2;
    }
    if (!strcmp(f, "--elastic")) {
        lo->elastic = overlap_flag(f, v); /* on|off */
        return 2;
    }
    if (strcmp(f, "--tern-clip") && strcmp(f, "--evals-per-epoch") && strcmp(f, "--target-acc")) return 0;
    if (v == NULL) flag_error("%s needs a value", f);
    if (!strcmp(f, "--tern-clip")) lo->tern_clip = !strcmp(v, "off") ? DOPT_CLIP_OFF : (float)flag_double(f, v, 0, 1e6, 0);
    else if (!strcmp(f, "--evals-per-epoch")) lo->evals_per_epoch = (int)flag_long(f, v, 1, 1000);
    else lo->target_acc = flag_double(f, v, 0, 100, 0);
    return 2;
}

/* ===================================================================== TRAINING */

/* Where the clock, the traffic counter and the train loss stand, and what an evaluation took. */
typedef struct progress {
    double t0, eval_secs, eval_bytes, train_bytes_start;
    double loss_sum;
    size_t batches;
    int target_hit;
    double target_epoch, target_secs, target_bytes;
    uint64_t target_step, target_rounds;
} progress;

/* What one evaluation needs besides the parameters. */
typedef struct evaluation {
    dopt_comm *comm;
    int sync;
    const float *test_x;
    const unsigned char *test_y;
    size_t ntest;
    activations *act;
    float *eval; /* NPARAMS floats: the averaged model */
    FILE *csv;
    double target_acc;
} evaluation;

/* An evaluation on every rank: the train loss since the last one (mean over ranks), the test
   accuracy of the averaged model on rank 0 (identical to every replica at period 1, where every
   step ends averaged; between local averages, an extra fp32 average of a copy, which the training
   does not see), one line of output. Its time and bytes go to pr->eval_secs and pr->eval_bytes,
   not to training. */
static dopt_status evaluate(const evaluation *ev, const float *params, progress *pr, double epoch, uint64_t step,
                            uint64_t rounds, size_t batch) {
    double t_begin = wall_seconds(), loss = pr->loss_sum / (double)(pr->batches ? pr->batches : 1);
    double traffic_begin = (double)dopt_comm_traffic_total(ev->comm), secs, bytes, acc;
    dopt_status st;
    memcpy(ev->eval, params, NPARAMS * sizeof(float));
    secs = t_begin - pr->t0 - pr->eval_secs;
    bytes = ev->comm->size > 1 ? traffic_begin - pr->train_bytes_start - pr->eval_bytes : 0;
    loss = dopt_mean(ev->comm, loss); /* every rank's mean training loss, averaged */
    if (!ev->sync && (st = dopt_allreduce(ev->comm, ev->eval, NPARAMS, DOPT_F32, DOPT_MEAN)) != DOPT_OK) return st;
    if (ev->comm->rank == 0) {
        acc = 100 * accuracy(ev->eval, ev->test_x, ev->test_y, ev->ntest, ev->act, 1000);
        printf("%7.4g %10.4f %8.2f%% %8llu %12.0f %8.2f %6zu %8llu\n", epoch, loss, acc, (unsigned long long)rounds,
               bytes, secs, batch, (unsigned long long)step);
        fflush(stdout);
        if (ev->csv)
            fprintf(ev->csv, "%.4g,%.6f,%.4f,%llu,%.0f,%.3f,%zu,%llu\n", epoch, loss, acc, (unsigned long long)rounds,
                    bytes, secs, batch, (unsigned long long)step);
        if (ev->target_acc > 0 && !pr->target_hit && acc >= ev->target_acc) {
            pr->target_hit = 1;
            pr->target_epoch = epoch, pr->target_step = step, pr->target_rounds = rounds;
            pr->target_secs = secs, pr->target_bytes = bytes;
        }
    }
    pr->loss_sum = 0, pr->batches = 0;
    st = dopt_barrier(ev->comm); /* the others wait here while rank 0 evaluates */
    pr->eval_secs += wall_seconds() - t_begin;
    pr->eval_bytes += (double)dopt_comm_traffic_total(ev->comm) - traffic_begin;
    return st;
}

/* This rank's shard of the first ntrain images for comm (distopt: dopt_shard), as floats, and room
   for its order; per_rank: the samples every rank runs. What *train_x and *order held is freed. */
static void take_shard(const dopt_comm *comm, const unsigned char *train_px, size_t ntrain, size_t *begin,
                       size_t *end, size_t *per_rank, float **train_x, size_t **order) {
    dopt_shard(ntrain, comm->rank, comm->size, begin, end);
    free(*train_x);
    *train_x = pixels_to_floats(train_px + *begin * IN, *end - *begin);
    *per_rank = ntrain / (size_t)comm->size; /* every rank runs the same number of steps */
    free(*order);
    *order = malloc(*per_rank * sizeof(size_t));
}

/* A shuffled order of this rank's per_rank samples (Fisher-Yates). */
static void shuffle_shard(size_t *order, size_t per_rank, uint64_t *rng) {
    size_t i;
    for (i = 0; i < per_rank; i++) order[i] = i;
    for (i = per_rank; i > 1; i--) {
        size_t j, t;
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        j = (size_t)(*rng >> 33) % i;
        t = order[i - 1], order[i - 1] = order[j], order[j] = t;
    }
}

int main(int argc, char **argv) {
    options o = {NULL, 0, "none", 0, 0, 0, 1, 1, 0, 3, 64, 0.1f, 0, "off", NULL, 0, 0, 0, 0, NULL, 0, 0, 0, 0, NULL, NULL, 0};
    size_t ntrain, ntest, nlabels, begin, end, per_rank, units;
    unsigned char *train_px, *test_px, *train_y, *test_y, *batch_y;
    float *train_x = NULL, *test_x, *params, *grads, *micro, *eval, *batch_x;
    size_t *order = NULL;
    activations act;
    dopt_comm *comm;
    dopt_segment segs[NTENSORS];
    int compress, sync, adaptive, epoch, joined, failed = 0;
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
    uint64_t step = 0, rounds = 0, shuffle_rng;
    local_options lo = {0, 1, 0, 0, 0};
    progress pr;
    evaluation ev;
    FILE *csv = NULL;

    parse_options_extra(&o, argc, argv, local_flag, &lo, "[--tern-clip C|off] [--evals-per-epoch E] [--target-acc A] [--overlap on|off] [--elastic on|off]");
    adaptive = batch_config_from_options(&o, &bcfg);
    if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1; /* distopt: one process per rank from here on */

    train_px = load_idx("train-images-idx3-ubyte.gz", 2051, IN, &ntrain);
    train_y = load_idx("train-labels-idx1-ubyte.gz", 2049, 1, &nlabels);
    test_px = load_idx("t10k-images-idx3-ubyte.gz", 2051, IN, &ntest);
    test_y = load_idx("t10k-labels-idx1-ubyte.gz", 2049, 1, &nlabels);
    if (o.train_limit > 0 && (size_t)o.train_limit < ntrain) ntrain = (size_t)o.train_limit;
    take_shard(comm, train_px, ntrain, &begin, &end, &per_rank, &train_x, &order); /* distopt: this rank's samples */
    test_x = pixels_to_floats(test_px, ntest);

    params = alloc_floats(NPARAMS);
    grads = alloc_floats(NPARAMS);
    micro = alloc_floats(NPARAMS);
    eval = alloc_floats(NPARAMS);
    batch_x = alloc_floats((size_t)o.batch * IN);
    batch_y = malloc((size_t)o.batch);
    act.h1 = alloc_floats(1000 * H1);
    act.h2 = alloc_floats(1000 * H2);
    act.out = alloc_floats(1000 * OUT);
    act.d1 = alloc_floats((size_t)o.batch * H1);
    act.d2 = alloc_floats((size_t)o.batch * H2);
    if (o.batch > 1000) flag_error("--batch must be <= 1000 here (got %d)", o.batch);
    init_params(params, o.seed + 1000003u * (uint64_t)comm->rank); /* different on purpose: the broadcast fixes it */

    /* distopt: the method. Synchronous steps (--period 1) average the gradients, in fp32 or
       compressed; local steps average the models every --period steps, the deltas compressed
       with --compress (at --period 1 too with --average models). Adaptive batches grow the
       micro-batches per step by the norm test. Check once: a refusal here comes back from every
       later call of the driver and from dopt_dp_close, so the loop tests one status per step. */
    compress = method_configs(&o, &cz, &ccfg, &lcfg);
    sync = o.period == 1;
    ccfg.clip_c = lo.tern_clip;
    dopt_segments_from_sizes(segs, tensor_sizes, NTENSORS, NULL);
    segs[0].rows = IN, segs[2].rows = H1, segs[4].rows = H2; /* distopt: W's shapes, in × out (PowerSGD's matrices) */
    gdesc = dopt_buf_flat(grads, NPARAMS, segs, NTENSORS); /* distopt layout: the compressor's table, the buckets' */
    lcfg.batch = adaptive ? &bc : NULL;
    lcfg.grads = lo.overlap ? &gdesc : NULL; /* distopt option: buckets averaged during backward */
    lcfg.elastic = lo.elastic;               /* distopt option: go on without a lost worker (DOPT_ON_PEER_LOST=shrink) */
    if (compress) dopt_compressor_init(&cz, &ccfg, segs, NTENSORS);
    if (adaptive) dopt_batch_init(&bc, NPARAMS, &bcfg);
    dopt_dp_init(&ls, comm, NPARAMS, &lcfg);
    joined = ls.joining;                     /* distopt (--elastic): a worker started again with DOPT_JOIN=1 */
    dopt_dp_broadcast(&ls, params);          /* ... takes the job's state here, not rank 0's model */
    /* CELGC's own rule (sync_grads 0) averages models, never gradients: nothing to mark */
    hooks = (backward_hooks){.dp = lo.overlap && (!o.celgc || lcfg.sync_grads) ? &ls : NULL, .segs = segs, .grads = grads, .micro = micro};
    timing_init(&tm, (size_t)o.epochs * (per_rank / (size_t)o.batch));

    if (comm->rank == 0) {
        printf("fmnist_mlp: %s, %d worker(s), %zu training images (%zu per worker), batch %d per worker, lr %g, "
               "compress %s, %s, period %zu, clip %g, adaptive batch %s\n",
               comm->vt->name, comm->size, ntrain, per_rank, o.batch, o.lr, o.compress, o.celgc ? "celgc" : "sgd",
               o.period, o.clip, o.adaptive);
        printf("%7s %10s %9s %8s %12s %8s %6s %8s\n", "epoch", "loss", "test_acc", "rounds", "bytes_sent", "time_s",
               "batch", "steps");
        if (o.csv && (csv = fopen(o.csv, "w")) != NULL)
            fprintf(csv, "epoch,loss,test_acc,rounds,bytes_sent,time_s,batch,steps\n");
        fflush(stdout); /* the job has formed: a watcher (tests/elastic_trials.c) reads it now */
    }
    ev.comm = comm, ev.sync = sync, ev.test_x = test_x, ev.test_y = test_y, ev.ntest = ntest, ev.act = &act;
    ev.eval = eval, ev.csv = csv, ev.target_acc = lo.target_acc;
    memset(&pr, 0, sizeof pr);
    shuffle_rng = dopt_seed_for_rank(o.seed, comm->rank);
    pr.train_bytes_start = (double)dopt_comm_traffic_total(comm);
    pr.t0 = wall_seconds();
    epoch = 1;
    if (joined) { /* distopt (--elastic): go on with the members, from the job's step, in their epoch */
        double e = INFINITY;
        if (ls.comm != comm) { /* a member was lost while this one came in */
            dopt_comm_destroy(comm);
            comm = ev.comm = ls.comm;
            take_shard(comm, train_px, ntrain, &begin, &end, &per_rank, &train_x, &order);
        }
        step = ls.step;
        st = dopt_allreduce(comm, &e, 1, DOPT_F64, DOPT_MIN); /* the members' own, after they took this one in */
        if (st == DOPT_OK) epoch = (int)e;
        printf("fmnist_mlp: taken back as rank %d of %d, from step %llu in epoch %d\n", comm->rank, comm->size,
               (unsigned long long)step, epoch);
    }
    for (; epoch <= o.epochs && st == DOPT_OK; epoch++) {
        size_t pos = 0, u;
        int evals_done = 0;
        shuffle_shard(order, per_rank, &shuffle_rng);
        if (!step_fits(&o, adaptive ? dopt_batch_units(&bc) : 1, per_rank, comm, epoch)) break;
        while (st == DOPT_OK) {
            units = adaptive ? dopt_batch_units(&bc) : 1;
            if (pos + units * (size_t)o.batch > per_rank) break;
            timing_begin(&tm);
            memset(grads, 0, NPARAMS * sizeof(float));
            hooks.scale = 1.0f / (float)units, hooks.backward_secs = 0;
            for (u = 0; u < units; u++) { /* one micro-batch of --batch samples each */
                int r;
                for (r = 0; r < o.batch; r++, pos++) {
                    memcpy(batch_x + (size_t)r * IN, train_x + order[pos] * IN, IN * sizeof(float));
                    batch_y[r] = train_y[begin + order[pos]];
                }
                hooks.mark = hooks.dp && u + 1 == units; /* the last micro-batch makes the gradient final */
                pr.loss_sum += loss_and_gradient(params, batch_x, batch_y, o.batch, &act, micro, &hooks);
                pr.batches++;
                if (adaptive) dopt_batch_observe(&bc, &(dopt_buf){.data = micro, .n = NPARAMS}, 1.0f); /* distopt: gradient variance */
                if (!hooks.mark) dopt_axpy(grads, 1.0f / (float)units, micro, NPARAMS); /* else backward added it */
            }
            if (dopt_dp_should_sync(&ls, step)) rounds++;
            timing_wait_begin(&tm);
            if (o.celgc) { /* distopt: x -= min(η, γ/‖g‖)·g, and the average when due */
                /* with --overlap on, the descriptor the driver marked (celgc takes the parameters in its layout) */
                dopt_buf xb = lo.overlap ? dopt_buf_flat(params, NPARAMS, segs, NTENSORS) : (dopt_buf){.data = params, .n = NPARAMS};
                dopt_buf gb = lo.overlap ? gdesc : (dopt_buf){.data = grads, .n = NPARAMS};
                st = dopt_dp_celgc_step(&ls, &xb, &gb, &(dopt_celgc){.eta = o.celgc_eta, .gamma = o.celgc_gamma});
                if (st == DOPT_ERR_NONFINITE) st = DOPT_OK; /* this worker skipped its update; the average happened */
                timing_waited(&tm);
            } else {
                dopt_dp_after_backward_buf(&ls, &gdesc); /* distopt: the mean (fp32 or compressed) when synchronous */
                timing_waited(&tm);
                if (o.clip > 0 && dopt_clip_global_norm(NULL, &(dopt_buf){.data = grads, .n = NPARAMS},
                                                        &(dopt_clip_norm){.max_norm = o.clip}) == DOPT_ERR_NONFINITE)
                    memset(grads, 0, NPARAMS * sizeof(float)); /* distopt: clip; skip a NaN step */
                dopt_axpy(params, -o.lr, grads, NPARAMS);
                st = dopt_dp_after_step(&ls, params); /* distopt: model average when due */
            }
            timing_end(&tm, hooks.backward_secs);
            step++;
            if (ls.comm != comm) { /* distopt (--elastic): a worker was lost (or came back); the job goes on */
                int grew = ls.comm->size > comm->size;
                dopt_comm_destroy(comm);
                comm = ev.comm = ls.comm;
                take_shard(comm, train_px, ntrain, &begin, &end, &per_rank, &train_x, &order); /* a share of the lost one's */
                shuffle_shard(order, per_rank, &shuffle_rng); /* the epoch starts over on the new shard */
                pos = 0;
                step = ls.step;
                { /* a survivor that was a round ahead may have begun the next epoch: all go on in the earliest
                     (a worker taken back gives +inf: it learns the epoch here) */
                    double e = (double)epoch;
                    st = lost_worker_later(lo.elastic, dopt_allreduce(comm, &e, 1, DOPT_F64, DOPT_MIN));
                    if (st == DOPT_OK) epoch = (int)e;
                    evals_done = 0;
                }
                if (comm->rank == 0)
                    printf("%s: %d go on, from step %llu (monotonic clock %.0f ms)\n",
                           grew ? "a worker came back" : "lost a worker", comm->size, (unsigned long long)step,
                           wall_seconds() * 1e3);
            }
            if (adaptive) batch_report_step(&brep, &bc);
            /* Between epoch ends: evaluate at the first step past each 1/E of the shard (every
               rank holds the same pos, so all of them get here together). */
            if (st == DOPT_OK && evals_done + 1 < lo.evals_per_epoch &&
                pos * (size_t)lo.evals_per_epoch >= per_rank * (size_t)(evals_done + 1)) {
                evals_done++;
                st = evaluate(&ev, params, &pr, epoch - 1 + (double)evals_done / lo.evals_per_epoch, step, rounds,
                              (adaptive ? dopt_batch_units(&bc) : 1) * (size_t)o.batch);
                st = lost_worker_later(lo.elastic, st);
            }
        }
        if (st == DOPT_OK)
            st = lost_worker_later(lo.elastic, evaluate(&ev, params, &pr, epoch, step, rounds,
                                                 (adaptive ? dopt_batch_units(&bc) : 1) * (size_t)o.batch));
    }
    if (lo.elastic && st == DOPT_OK) { /* distopt (--elastic): a loss the last evaluation met is taken up here */
        st = dopt_dp_sync(&ls, &(dopt_buf){.data = params, .n = NPARAMS}, NULL);
        if (ls.comm != comm) {
            dopt_comm_destroy(comm);
            comm = ls.comm;
        }
    }
    if (comm->rank == 0 && lo.target_acc > 0 && st == DOPT_OK) {
        if (pr.target_hit)
            printf("target %.2f%% reached: epoch %.4g step %llu rounds %llu bytes %.0f time_s %.3f\n", lo.target_acc,
                   pr.target_epoch, (unsigned long long)pr.target_step, (unsigned long long)pr.target_rounds,
                   pr.target_bytes, pr.target_secs);
        else
            printf("target %.2f%% not reached\n", lo.target_acc);
    }
    failed = dopt_dp_close(&ls, params) != DOPT_OK || st != DOPT_OK; /* distopt: the last round averaged, replicas checked */
    if (adaptive && comm->rank == 0 && !failed) batch_report_print(&brep, &bc);
    if (comm->rank == 0 && !failed) printf("params fnv1a %016llx\n", params_fnv1a(params, NPARAMS));
    if (comm->rank == 0 && !failed) timing_print(&tm, lo.overlap);
    timing_free(&tm);
    if (csv) fclose(csv);
    if (adaptive) dopt_batch_free(&bc);
    if (compress) dopt_compressor_free(&cz);
    free(train_px), free(train_y), free(test_px), free(test_y), free(train_x), free(test_x);
    free(params), free(grads), free(micro), free(eval), free(batch_x), free(batch_y), free(order);
    free(act.h1), free(act.h2), free(act.out), free(act.d1), free(act.d2);
    return dopt_comm_finish(comm, failed); /* distopt: other ranks exit; rank 0 gets the job's status; a failure's
                                              detail is printed */
}
