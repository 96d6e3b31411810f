/* fann_dp.c — FANN's own batch trainer, data-parallel. A 784-H-10 network (symmetric sigmoid
   hidden layer, sigmoid outputs, one-hot targets, FANN's MSE) trained on Fashion-MNIST with the
   loop of FANN's fann_train_epoch_batch cut into minibatches: per sample fann_run,
   fann_compute_MSE, fann_backpropagate_MSE, fann_update_slopes_batch; per minibatch
   fann_update_weights_batch, with the learning rate decayed linearly to 0 over the run. Debian's
   libfloatfann exports those internal functions (nm -D) and fann_internal.h declares them.

   distopt goes between the slope accumulation and the weight update: the workers' train_slopes
   (Σ over the minibatch of −∇ of FANN's error) are averaged — in fp32, or TernGrad-compressed per
   layer — and optionally clipped by their global norm; rank 0's initial weights go to every rank
   first. Every rank then applies the same update to the same weights, so the replicas stay
   bitwise identical, which the end of the run checks. The lines marked "distopt" are all that
   the data-parallel version adds to the single-process loop (examples/hosts/run.sh counts them).

       DOPT_WORLD_SIZE=2 build/fann_dp --epochs 3           (forks 2 workers over shared memory)
       DOPT_WORLD_SIZE=2 DOPT_MASTER_PORT=29500 DOPT_RANK=0 build/fann_dp &
       DOPT_WORLD_SIZE=2 DOPT_MASTER_PORT=29500 DOPT_RANK=1 build/fann_dp

   --batch is each worker's minibatch: 2 workers at --batch 32 take the steps of 1 process at
   --batch 64 (the update divides the averaged slopes by the minibatch, as FANN does). */
#define DISTOPT_IMPLEMENTATION /* distopt */
#include "transport_shm.h"     /* distopt */
#include "transport_tcp.h"     /* distopt */
#include "launch.h"            /* distopt: after the transports it may start */
#include "localsgd.h"          /* distopt: brings clip.h and compress.h */

#include <floatfann.h>
#include <fann_internal.h> /* fann_compute_MSE, fann_backpropagate_MSE, fann_update_*_batch */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "examples/fashion_mnist.h"
#include "examples/hosts/host_common.h"

enum { IN = 784, OUT = 10, MAX_LAYERS = 8 };

/* ===================================================================== DATA */

/* FANN's inputs (pixels in [0, 1]) and targets (one-hot) for images [first, first + count). */
static void to_fann(const unsigned char *px, const unsigned char *labels, size_t first, size_t count, fann_type **x,
                    fann_type **y) {
    size_t i, k;
    *x = malloc(count * IN * sizeof(fann_type));
    *y = calloc(count * OUT, sizeof(fann_type));
    if (*x == NULL || *y == NULL) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (i = 0; i < count; i++) {
        for (k = 0; k < IN; k++) (*x)[i * IN + k] = px[(first + i) * IN + k] / 255.0f;
        (*y)[i * OUT + labels[first + i]] = 1;
    }
}

static double test_accuracy(struct fann *ann, const fann_type *x, const unsigned char *labels, size_t count) {
    size_t i, correct = 0;
    for (i = 0; i < count; i++) {
        fann_type *out = fann_run(ann, (fann_type *)(x + i * IN));
        int k, best = 0;
        for (k = 1; k < OUT; k++) best = out[k] > out[best] ? k : best;
        correct += best == labels[i];
    }
    return 100.0 * (double)correct / (double)count;
}

/* ===================================================================== TRAINING */

int main(int argc, char **argv) {
    host_options o = {"none", 3, 64, 64, 1, 0.7f, 0, 20000, 1, 0, 0};
    size_t ntrain, ntest, nlabels, begin = 0, end, i, s, step = 0, steps;
    unsigned char *train_px, *train_labels, *test_px, *test_labels;
    fann_type *train_x, *train_y, *test_x, *test_y;
    size_t *order;
    struct fann *ann;
    struct fann_layer *l;
    unsigned long long shuffle;
    int epoch, tern, verbose = 1;
    dopt_comm *comm; dopt_dp dp; dopt_status st;                                            /* distopt */
    dopt_compressor cz = {0}; dopt_segment segs[MAX_LAYERS]; size_t nsegs = 0;              /* distopt option */

    host_parse_options(&o, argc, argv,
                       "[--epochs E] [--batch B (per worker)] [--lr LR]\n"
                       "          [--hidden H] [--train-limit N] [--seed S] [--compress none|ternary] [--clip C]");
    tern = !strcmp(o.compress, "ternary");
    shuffle = o.seed;
    if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1;                              /* distopt: says why */
    verbose = comm->rank == 0;                                                              /* distopt */

    train_px = load_idx("train-images-idx3-ubyte.gz", 2051, IN, &ntrain);
    train_labels = load_idx("train-labels-idx1-ubyte.gz", 2049, 1, &nlabels);
    test_px = load_idx("t10k-images-idx3-ubyte.gz", 2051, IN, &ntest);
    test_labels = load_idx("t10k-labels-idx1-ubyte.gz", 2049, 1, &nlabels);
    end = o.train_limit > 0 && (size_t)o.train_limit < ntrain ? (size_t)o.train_limit : ntrain;
    dopt_shard(end - end % comm->size, comm->rank, comm->size, &begin, &end);               /* distopt: this rank's images */
    to_fann(train_px, train_labels, begin, end - begin, &train_x, &train_y);
    to_fann(test_px, test_labels, 0, ntest, &test_x, &test_y);
    ntrain = end - begin;
    order = malloc(ntrain * sizeof(size_t));
    steps = (size_t)o.epochs * (ntrain / (size_t)o.batch);

    ann = fann_create_standard(3, IN, o.hidden, OUT);
    if (ann == NULL || order == NULL) { fprintf(stderr, "out of memory\n"); return 1; }
    fann_set_activation_function_hidden(ann, FANN_SIGMOID_SYMMETRIC);
    fann_set_activation_function_output(ann, FANN_SIGMOID);
    fann_set_train_error_function(ann, FANN_ERRORFUNC_LINEAR);
    /* FANN seeds rand() from /dev/urandom, so every process starts from other weights. This
       makes them reproducible and still different on each rank: only the broadcast makes them
       equal. (Test harness, not part of the drop-in.) */
    srand(o.seed + 7919u * (unsigned)comm->rank);
    fann_randomize_weights(ann, -0.1f, 0.1f);

    /* With TernGrad, a segment per layer (each gets its own scale) and the driver averages the
       slopes through it; then rank 0's weights everywhere. */
    for (l = ann->first_layer + 1; l != ann->last_layer; l++)                               /* distopt option */
        segs[nsegs++] = (dopt_segment){l->first_neuron->first_con, (l->last_neuron - 1)->last_con - l->first_neuron->first_con, NULL, 0}; /* distopt option */
    if (tern) dopt_compressor_init(&cz, &(dopt_compressor_config){.seed = o.seed}, segs, nsegs); /* distopt option */
    dopt_dp_init(&dp, comm, ann->total_connections, &(dopt_dp_config){.grad_compressor = tern ? &cz : NULL}); /* distopt */
    dopt_dp_broadcast(&dp, ann->weights);                                                   /* distopt */

    if (verbose)
        printf("fann_dp: %s, %zu training images, minibatch %d, lr %g, hidden %d, compress %s, clip %g\n", comm->vt->name,
               ntrain, o.batch, o.lr, o.hidden, o.compress, o.clip);
    for (epoch = 1; epoch <= o.epochs; epoch++) {
        for (i = 0; i < ntrain; i++) order[i] = i;
        for (i = ntrain; i > 1; i--) { /* Fisher-Yates */
            size_t j, t;
            shuffle = shuffle * 6364136223846793005ull + 1442695040888963407ull;
            j = (size_t)(shuffle >> 33) % i;
            t = order[i - 1], order[i - 1] = order[j], order[j] = t;
        }
        fann_reset_MSE(ann);
        for (s = 0; s + (size_t)o.batch <= ntrain; s += (size_t)o.batch) { /* fann_train_epoch_batch by minibatches */
            for (i = s; i < s + (size_t)o.batch; i++) {
                fann_run(ann, train_x + order[i] * IN);
                fann_compute_MSE(ann, train_y + order[i] * OUT);
                fann_backpropagate_MSE(ann);
                fann_update_slopes_batch(ann, ann->first_layer + 1, ann->last_layer - 1);
            }
            /* The mean of the workers' slopes (fp32, or TernGrad), then global-norm clipping: the
               slopes are -∇ summed over the minibatch, hence the scale -1/batch. */
            dopt_dp_after_backward(&dp, ann->train_slopes);                                 /* distopt */
            if (o.clip > 0)                                                                 /* distopt option */
                dopt_clip_global_norm(NULL, &(dopt_buf){.data = ann->train_slopes, .n = ann->total_connections},
                                      &(dopt_clip_norm){.max_norm = o.clip, .scale = -1.0f / (float)o.batch}); /* distopt option */
            fann_set_learning_rate(ann, o.lr * (1 - (float)step++ / (float)steps)); /* linear decay to 0 */
            fann_update_weights_batch(ann, (unsigned)o.batch, 0, ann->total_connections);
        }
        if (verbose)
            printf("epoch %d: train MSE %.5f, test accuracy %.2f%%\n", epoch, fann_get_MSE(ann),
                   test_accuracy(ann, test_x, test_labels, ntest));
        fflush(stdout);
    }
    st = dopt_dp_close(&dp, ann->weights);                                                  /* distopt: replicas identical? */
    /* Test harness: every rank's own hash of its weights, and the replica check's verdict. */
    printf("rank %d weights fnv1a %016llx\n", comm->rank, host_params_hash(&(dopt_buf){.data = ann->weights, .n = ann->total_connections}));
    if (verbose) printf("result: test_acc %.2f replicas %s\n", test_accuracy(ann, test_x, test_labels, ntest), st == DOPT_OK ? "identical" : "DIFFER");
    fann_destroy(ann);
    free(train_px), free(train_labels), free(test_px), free(test_labels), free(order);
    free(train_x), free(train_y), free(test_x), free(test_y);
    dopt_compressor_free(&cz);                                                              /* distopt option */
    return dopt_comm_finish(comm, st);                                                      /* distopt: ranks > 0 exit here */
}
