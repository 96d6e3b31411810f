/* darknet_dp.c — darknet's own training step, data-parallel. A small all-convolutional network in
   darknet's idiom (two strided 3×3 convolutions with batch normalisation and leaky ReLU, a 7×7
   convolution as the classifier, softmax) trained on Fashion-MNIST held in darknet's `data`
   struct in memory, one train_network call per minibatch, with darknet's SGD (momentum, weight
   decay) and its poly learning-rate policy.

   darknet keeps every layer's arrays apart and mixes momentum into its update buffers, so
   distopt does here what darknet's own multi-GPU training does (train_networks / sync_nets):
   local SGD, every worker stepping alone and the models averaged every --period steps. The
   parameters are a scatter list — every layer's weights, biases, batch-norm scales and rolling
   statistics, one span each — and rank 0's initial weights go to every rank first. The momentum
   buffers stay local. At the end the replicas must be bitwise identical, which the run checks.
   The lines marked "distopt" are all the data-parallel version adds (examples/hosts/run.sh
   counts them).

       DOPT_WORLD_SIZE=2 build/darknet_dp --batch 32         (forks 2 workers over shared memory)
       DOPT_WORLD_SIZE=2 DOPT_MASTER_PORT=29500 DOPT_RANK=0 build/darknet_dp &
       DOPT_WORLD_SIZE=2 DOPT_MASTER_PORT=29500 DOPT_RANK=1 build/darknet_dp

   --batch is each worker's minibatch: 2 workers at --batch 32 take the steps of 1 process at
   --batch 64. --epochs and the data set size fix the steps, and the poly policy's max_batches.

   --average grads (with --period 1) is synchronous SGD instead: every step averages darknet's
   update buffers between its backward pass and its update, both inside train_network. Each
   layer's weight_updates, bias_updates and scale_updates hold this step's gradient sums plus
   the momentum of the averaged ones before (momentum · the last average, and the weight decay
   darknet adds at its update: alike on every rank), so their average is the synchronous step;
   the rolling statistics of batch norm ride along (the same arrays as in the parameters: the
   gradients' scatter list parallels the parameters'), averaged every step as darknet's own
   sync_nets averages them. The average runs from a wrapper of layer 0's `backward` function
   pointer (the last that backward_network calls; darknet updates right after it returns).
   --overlap on (with --average grads) wraps every layer's `backward`: each layer's buffers are
   marked final (dopt_dp_grad_ready) as backward_network finishes that layer, the last layer
   first, so that their average starts while the layers below still run backward. Only the last
   subdivision's backward makes them final (darknet accumulates over subdivisions and updates
   when seen / batch is a multiple of subdivisions); this cfg has one. */
#define DISTOPT_IMPLEMENTATION /* distopt */
#include "transport_shm.h"     /* distopt */
#include "transport_tcp.h"     /* distopt */
#include "launch.h"            /* distopt: after the transports it may start */
#include "localsgd.h"          /* distopt */

#include <darknet.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "examples/fashion_mnist.h"
#include "examples/hosts/host_common.h"

enum { IN = 784, OUT = 10, MAX_LAYERS = 16 };

/* The network; batch, learning rate and max_batches are the run's. */
static const char cfg_text[] =
    "[net]\nbatch=%d\nsubdivisions=1\nheight=28\nwidth=28\nchannels=1\n"
    "learning_rate=%g\nmomentum=0.9\ndecay=0.0005\npolicy=poly\npower=1\nmax_batches=%zu\n\n"
    "[convolutional]\nbatch_normalize=1\nfilters=8\nsize=3\nstride=2\npad=1\nactivation=leaky\n\n"
    "[convolutional]\nbatch_normalize=1\nfilters=16\nsize=3\nstride=2\npad=1\nactivation=leaky\n\n"
    "[convolutional]\nfilters=10\nsize=7\nstride=1\npad=0\nactivation=linear\n\n"
    "[softmax]\ngroups=1\n";

/* ===================================================================== SYNCHRONOUS STEPS

   darknet calls each layer's backward as l.backward(l, net) with net.index = i and no pointer of
   the host's, so what the wrapper needs is file-scope state, set once before training. */
static struct {
    void (*backward[MAX_LAYERS])(struct layer, struct network); /* darknet's own, per layer */
    size_t first[MAX_LAYERS], count[MAX_LAYERS];                /* layer i's spans in grads */
    dopt_dp *dp;
    const dopt_buf *grads;
    int overlap;
} sync_steps;

/* Layer net.index's backward, then (the last subdivision only) its spans marked final; after
   layer 0, the last backward_network runs, the average, before darknet's update. */
static void backward_then_average(layer l, network net) {
    int i = net.index;
    size_t k;
    sync_steps.backward[i](l, net);
    if (((*net.seen) / (size_t)net.batch) % (size_t)net.subdivisions != 0) return; /* not final yet */
    for (k = 0; sync_steps.overlap && k < sync_steps.count[i]; k++)
        dopt_dp_grad_ready(sync_steps.dp, sync_steps.first[i] + k); /* distopt option: its bucket may start */
    if (i == 0) dopt_dp_after_backward_buf(sync_steps.dp, sync_steps.grads); /* distopt option: the average */
}

/* ===================================================================== DATA */

/* Images [first, first + count) as darknet's `data`: X rows of 784 pixels in [0, 1], y one-hot
   rows of 10. The rows point into two blocks (*xblock, *yblock, the caller frees them), so that
   shuffling the row pointers shuffles the set and a minibatch is a window of row pointers. */
static data to_darknet(const unsigned char *px, const unsigned char *labels, size_t first, size_t count,
                       float **xblock, float **yblock) {
    data d;
    size_t i, k;
    memset(&d, 0, sizeof d);
    d.X.rows = d.y.rows = (int)count;
    d.X.cols = IN;
    d.y.cols = OUT;
    d.X.vals = malloc(count * sizeof(float *));
    d.y.vals = malloc(count * sizeof(float *));
    *xblock = malloc(count * IN * sizeof(float));
    *yblock = calloc(count * OUT, sizeof(float));
    if (d.X.vals == NULL || d.y.vals == NULL || *xblock == NULL || *yblock == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (i = 0; i < count; i++) {
        d.X.vals[i] = *xblock + i * IN;
        d.y.vals[i] = *yblock + i * OUT;
        for (k = 0; k < IN; k++) d.X.vals[i][k] = px[(first + i) * IN + k] / 255.0f;
        d.y.vals[i][labels[first + i]] = 1;
    }
    return d;
}

static network *build_network(const host_options *o, size_t steps) {
    char path[] = "/tmp/darknet_dp_XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "w");
    network *net;
    if (f == NULL) { perror("darknet_dp: cfg file"); exit(1); }
    fprintf(f, cfg_text, o->batch, o->lr, steps);
    fclose(f);
    net = parse_network_cfg(path);
    unlink(path);
    if (net->n > MAX_LAYERS) { fprintf(stderr, "darknet_dp: more than %d layers\n", MAX_LAYERS); exit(1); } /* distopt layout */
    return net;
}

static double test_accuracy(network *net, data test) {
    matrix pred = network_predict_data(net, test);
    double acc = 100.0 * matrix_topk_accuracy(test.y, pred, 1);
    free_matrix(pred);
    return acc;
}

/* ===================================================================== TRAINING */

int main(int argc, char **argv) {
    host_options o = {"none", 3, 64, 1, 4, 0.1f, 0, 20000, 1, 0, 0};
    size_t ntrain, ntest, nlabels, begin = 0, end, i, s, steps;
    unsigned char *train_px, *train_labels, *test_px, *test_labels;
    float *train_xblock, *train_yblock, *test_xblock, *test_yblock;
    data train, test, batch;
    network *net;
    unsigned long long shuffle;
    int epoch, j, k, verbose = 1;
    float loss = 0;
    dopt_comm *comm; dopt_dp dp; dopt_status st;                                            /* distopt */
    dopt_span spans[5 * MAX_LAYERS]; dopt_buf params = {.spans = spans};                    /* distopt layout */
    dopt_span gspans[5 * MAX_LAYERS]; dopt_buf grads = {.spans = gspans};                   /* distopt option: --average grads */

    host_parse_options(&o, argc, argv,
                       "[--epochs E] [--batch B (per worker)] [--lr LR]\n"
                       "          [--period I] [--train-limit N] [--seed S] [--average grads|models]\n"
                       "          [--overlap on|off (with --average grads)]");
    shuffle = o.seed;
    if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1;                              /* distopt: says why */
    verbose = comm->rank == 0;                                                              /* distopt */

    train_px = load_idx("train-images-idx3-ubyte.gz", 2051, IN, &ntrain);
    train_labels = load_idx("train-labels-idx1-ubyte.gz", 2049, 1, &nlabels);
    test_px = load_idx("t10k-images-idx3-ubyte.gz", 2051, IN, &ntest);
    test_labels = load_idx("t10k-labels-idx1-ubyte.gz", 2049, 1, &nlabels);
    end = o.train_limit > 0 && (size_t)o.train_limit < ntrain ? (size_t)o.train_limit : ntrain;
    dopt_shard(end - end % comm->size, comm->rank, comm->size, &begin, &end);               /* distopt: this rank's images */
    train = to_darknet(train_px, train_labels, begin, end - begin, &train_xblock, &train_yblock);
    test = to_darknet(test_px, test_labels, 0, ntest, &test_xblock, &test_yblock);
    ntrain = end - begin;
    steps = (size_t)o.epochs * (ntrain / (size_t)o.batch);
    batch = train;

    /* darknet's weights come from rand(), which its programs seed from the clock. This makes them
       reproducible and still different on each rank: only the broadcast makes them equal. (Test
       harness, not part of the drop-in.) */
    srand(o.seed + 7919u * (unsigned)comm->rank);
    net = build_network(&o, steps);

    /* The parameters as a scatter list: every layer's weights, biases, batch-norm scales and
       rolling statistics (NULL where a layer has none), one span each; then rank 0's everywhere. */
    for (j = 0; j < net->n; j++) {                                                          /* distopt layout */
        layer *l = &net->layers[j];                                                         /* distopt layout */
        float *a[5] = {l->weights, l->biases, l->scales, l->rolling_mean, l->rolling_variance}; /* distopt layout */
        float *g[5] = {l->weight_updates, l->bias_updates, l->scale_updates, l->rolling_mean, l->rolling_variance}; /* distopt option */
        sync_steps.first[j] = grads.nspans;                                                 /* distopt option */
        for (k = 0; k < 5; k++)                                                             /* distopt layout */
            if (a[k]) spans[params.nspans++] = (dopt_span){a[k], (size_t)(k ? l->nbiases : l->nweights)}; /* distopt layout */
        for (k = 0; k < 5; k++)                                                             /* distopt option */
            if (a[k]) gspans[grads.nspans++] = (dopt_span){g[k], (size_t)(k ? l->nbiases : l->nweights)}; /* distopt option */
        sync_steps.count[j] = grads.nspans - sync_steps.first[j];                           /* distopt option */
        sync_steps.backward[j] = l->backward;                                               /* distopt option */
        if (o.average_grads && (j == 0 || o.overlap)) l->backward = backward_then_average;  /* distopt option */
    }                                                                                       /* distopt layout */
    sync_steps.dp = &dp, sync_steps.grads = &grads, sync_steps.overlap = o.overlap;         /* distopt option */
    dopt_dp_init(&dp, comm, dopt_buf_count(&params), &(dopt_dp_config){.period = (size_t)o.period, /* distopt */
                 .sync_grads = o.average_grads, .grads = o.overlap ? &grads : NULL});     /* distopt option */
    dopt_dp_broadcast_buf(&dp, &params, NULL);                                              /* distopt */

    if (verbose)
        printf("darknet_dp: %s, %zu training images, minibatch %d, lr %g (poly), period %d, %s averaged, overlap %s, "
               "%zu parameters in %zu arrays\n",
               comm->vt->name, ntrain, o.batch, o.lr, o.period, o.average_grads ? "gradients" : "models",
               o.overlap ? "on" : "off", dopt_buf_count(&params), params.nspans);
    for (epoch = 1; epoch <= o.epochs; epoch++) {
        for (i = ntrain; i > 1; i--) { /* Fisher-Yates on the rows */
            size_t r;
            float *t;
            shuffle = shuffle * 6364136223846793005ull + 1442695040888963407ull;
            r = (size_t)(shuffle >> 33) % i;
            t = train.X.vals[i - 1], train.X.vals[i - 1] = train.X.vals[r], train.X.vals[r] = t;
            t = train.y.vals[i - 1], train.y.vals[i - 1] = train.y.vals[r], train.y.vals[r] = t;
        }
        for (s = 0; s + (size_t)o.batch <= ntrain; s += (size_t)o.batch) {
            batch.X.vals = train.X.vals + s, batch.y.vals = train.y.vals + s;
            batch.X.rows = batch.y.rows = o.batch;
            loss = train_network(net, batch);
            dopt_dp_after_step_buf(&dp, &params, NULL);                                     /* distopt: average every I steps */
        }
        if (verbose) printf("epoch %d: loss %.4f (last minibatch), test accuracy %.2f%%\n", epoch, loss, test_accuracy(net, test));
        fflush(stdout);
    }
    /* The last round may be shorter than the period: close averages it once more (as darknet's
       own multi-GPU training syncs its nets before it saves weights) and checks the replicas. */
    st = dopt_dp_close_buf(&dp, &params, NULL);                                             /* distopt */
    /* Test harness: every rank's own hash of its parameters, and the replica check's verdict. */
    printf("rank %d params fnv1a %016llx\n", comm->rank, host_params_hash(&params));
    if (verbose) printf("result: test_acc %.2f replicas %s\n", test_accuracy(net, test), st == DOPT_OK ? "identical" : "DIFFER");
    free_network(net);
    free(train.X.vals), free(train.y.vals), free(test.X.vals), free(test.y.vals);
    free(train_xblock), free(train_yblock), free(test_xblock), free(test_yblock);
    free(train_px), free(train_labels), free(test_px), free(test_labels);
    return dopt_comm_finish(comm, st);                                                      /* distopt: ranks > 0 exit here */
}
