/* common.h — what the examples share and a real host would write its own way: command-line
   flags, opening the communicator the user asked for, the wall clock. Not part of distopt.
   Include after the distopt headers (launch.h last among them), in the file that defines
   DISTOPT_IMPLEMENTATION. Built with mpicc (the Makefile does), --transport mpi is there too:
   start the ranks with mpirun. */
#ifndef DOPT_EXAMPLES_COMMON_H
#define DOPT_EXAMPLES_COMMON_H

#if defined(__has_include)
#  if __has_include(<mpi.h>)
#    include "transport_mpi.h"
#    define EXAMPLES_HAVE_MPI 1
#  endif
#endif
#include "launch.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct options {
    const char *transport;   /* shm, tcp, mpi, self; NULL: as the environment says (launch.h) */
    int workers;             /* ranks to fork when no launcher started this one; 0: DOPT_WORLD_SIZE, else 1 */
    const char *compress;    /* none, ternary, qsgd, topk, sign, fp16, bf16, powersgd */
    int celgc;               /* 1 when --celgc eta,gamma was given */
    float celgc_eta, celgc_gamma;
    size_t period;
    unsigned long long seed;
    long steps;              /* least_squares */
    int epochs;              /* fmnist_mlp */
    int batch;
    float lr;
    float clip;              /* global-norm clipping threshold, 0: off */
    const char *adaptive;    /* off, norm, ip, aip */
    const char *csv;
    long train_limit;        /* the first N training samples (images, characters), 0: all */
    double eta;              /* adaptive batch: the test's η (θ for ip/aip), 0: the library default */
    size_t max_units;        /* adaptive batch: at most this many micro-batches per step, 0: 8 */
    double nu;               /* adaptive batch: the augmented test's ν, 0: the library default */
    const char *average;     /* grads (period 1 only) or models; NULL until parsed: grads at period 1,
                                models beyond */
    double history;          /* adaptive batch: weight of earlier rounds' statistics, 0: this round's alone */
    double outer_lr;         /* DiLoCo's outer step size on each model average, 0: 1 (plain average) */
    double outer_momentum;   /* its Nesterov momentum, 0: none */
    unsigned powersgd_rank;  /* --compress powersgd: the factors' rank r, 0: the library's default (2) */
    const char *grad_norm;   /* adaptive batch: plain (the paper's, default) or bias-corrected */
    const char *projection;  /* adaptive batch: auto (default), exact or previous */
    double max_growth;       /* adaptive batch: at most ×G per decision, 0: unbounded */
} options;

/* --transport and --workers are shorthands for the environment launch.h reads (DOPT_TRANSPORT,
   DOPT_WORLD_SIZE; a launcher's own variables still say where each rank is), so the programs
   start with dopt_comm_create_from_env alone. */
static inline void export_launch_flags(const options *o) {
    char n[16];
    if (o->transport && setenv("DOPT_TRANSPORT", o->transport, 1) != 0) {
        fprintf(stderr, "error: cannot set DOPT_TRANSPORT\n");
        exit(2);
    }
    snprintf(n, sizeof n, "%d", o->workers);
    if (o->workers > 0 && setenv("DOPT_WORLD_SIZE", n, 1) != 0) {
        fprintf(stderr, "error: cannot set DOPT_WORLD_SIZE\n");
        exit(2);
    }
}

/* A program's own flags: called first for every argument with the one after it (NULL at the
   end); returns how many arguments it took (1: a flag alone, 2: a flag and its value), or 0 for
   a flag that is not its own. */
typedef int (*extra_flag_fn)(void *user, const char *flag, const char *value);

/* A command-line mistake, as getopt-style tools report one: a line naming the flag and what it
   got, a hint, exit status 2. */
static inline void flag_error(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static inline void flag_error(const char *fmt, ...) {
    va_list ap;
    fputs("error: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("\n(--help lists the flags)\n", stderr);
    exit(2);
}

/* A flag's value as a whole number in [min, max], or a flag_error naming the flag. */
static inline long flag_long(const char *flag, const char *v, long min, long max) {
    char *end;
    long x;
    errno = 0;
    x = strtol(v, &end, 10);
    if (end == v || *end != '\0' || errno == ERANGE) flag_error("%s expects a whole number (got \"%s\")", flag, v);
    if (x < min) flag_error("%s must be >= %ld (got %ld)", flag, min, x);
    if (x > max) flag_error("%s must be <= %ld (got %ld)", flag, max, x);
    return x;
}

/* A flag's value as a finite number in [min, max] (max_open: below max). */
static inline double flag_double(const char *flag, const char *v, double min, double max, int max_open) {
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end != '\0' || !(x == x) || x - x != 0.0) flag_error("%s expects a number (got \"%s\")", flag, v);
    if (x < min) flag_error("%s must be >= %g (got %g)", flag, min, x);
    if (max_open ? !(x < max) : x > max) flag_error("%s must be %s %g (got %g)", flag, max_open ? "<" : "<=", max, x);
    return x;
}

/* A flag's value, which must be one of the NULL-terminated choices. */
static inline const char *flag_choice(const char *flag, const char *v, const char *const *choices) {
    char list[160] = "";
    size_t i;
    for (i = 0; choices[i]; i++) {
        if (!strcmp(v, choices[i])) return v;
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", choices[i]);
    }
    flag_error("%s must be one of %s (got \"%s\")", flag, list, v);
}

static inline void usage(const char *prog, const char *own) {
    printf("usage: %s [--transport shm|tcp|mpi|self] [--workers N]\n"
           "          [--compress none|ternary|qsgd|topk|sign|fp16|bf16|powersgd] [--powersgd-rank R]\n"
           "          [--celgc eta,gamma] [--period I] [--average grads|models] [--clip C] [--seed S]\n"
           "          [--steps N] [--epochs N] [--batch B] [--lr LR] [--adaptive-batch off|norm|ip|aip]\n"
           "          [--batch-eta X] [--max-batch-units U] [--batch-nu X] [--batch-history H]\n"
           "          [--batch-grad-norm plain|bias-corrected] [--batch-projection auto|exact|previous]\n"
           "          [--batch-max-growth G]\n"
           "          [--outer-lr X] [--outer-momentum M] [--csv FILE] [--train-limit N]\n"
           "          %s\n"
           "--average: at --period 1 with --celgc, grads (the default) averages the gradients before each step,\n"
           "models averages the models after it (CELGC's rule); longer periods take only models (their default).\n"
           "Without --transport the environment decides (DOPT_TRANSPORT; mpirun, srun, torchrun or DOPT_RANK\n"
           "variables; else --workers N ranks forked over shared memory, or one rank): see launch.h.\n"
           "mpi runs under mpirun (Open MPI as root: mpirun --allow-run-as-root -n 2 ...).\n",
           prog, own ? own : "");
    exit(0);
}

static const char *const transport_names[] = {"shm", "tcp", "mpi", "self", NULL};
static const char *const codec_names[] = {"none", "ternary", "qsgd", "topk", "sign", "fp16", "bf16", "majority", "powersgd", NULL};
static const char *const adaptive_names[] = {"off", "norm", "ip", "aip", NULL};
static const char *const average_names[] = {"grads", "models", NULL};
static const char *const grad_norm_names[] = {"plain", "bias-corrected", NULL};
static const char *const projection_names[] = {"auto", "exact", "previous", NULL};

/* One of the shared flags with its value v; 0 when f is not one of them. */
static inline int common_flag(options *o, const char *f, const char *v) {
    if (!strcmp(f, "--transport")) o->transport = flag_choice(f, v, transport_names);
    else if (!strcmp(f, "--workers")) o->workers = (int)flag_long(f, v, 1, 1024);
    else if (!strcmp(f, "--compress")) o->compress = flag_choice(f, v, codec_names);
    else if (!strcmp(f, "--powersgd-rank")) o->powersgd_rank = (unsigned)flag_long(f, v, 1, 64);
    else if (!strcmp(f, "--celgc")) {
        char *end;
        o->celgc_eta = strtof(v, &end);
        if (end == v || *end != ',' || !(o->celgc_eta > 0))
            flag_error("--celgc expects eta,gamma, two positive numbers (got \"%s\")", v);
        v = end + 1;
        o->celgc_gamma = strtof(v, &end);
        if (end == v || *end != '\0' || !(o->celgc_gamma > 0))
            flag_error("--celgc expects eta,gamma, two positive numbers (got gamma \"%s\")", v);
        o->celgc = 1;
    }
    else if (!strcmp(f, "--period")) o->period = (size_t)flag_long(f, v, 1, 1L << 30);
    else if (!strcmp(f, "--average")) o->average = flag_choice(f, v, average_names);
    else if (!strcmp(f, "--clip")) o->clip = (float)flag_double(f, v, 0, 1e30, 0);
    else if (!strcmp(f, "--seed")) o->seed = (unsigned long long)flag_long(f, v, 0, 0x7FFFFFFFL);
    else if (!strcmp(f, "--steps")) o->steps = flag_long(f, v, 1, 1L << 40);
    else if (!strcmp(f, "--epochs")) o->epochs = (int)flag_long(f, v, 1, 100000);
    else if (!strcmp(f, "--batch")) o->batch = (int)flag_long(f, v, 1, 1 << 20);
    else if (!strcmp(f, "--lr")) o->lr = (float)flag_double(f, v, 0, 1e30, 0);
    else if (!strcmp(f, "--adaptive-batch")) o->adaptive = flag_choice(f, v, adaptive_names);
    else if (!strcmp(f, "--csv")) o->csv = v;
    else if (!strcmp(f, "--train-limit")) o->train_limit = flag_long(f, v, 0, 1L << 40);
    else if (!strcmp(f, "--batch-eta")) o->eta = flag_double(f, v, 0, 1e30, 0);
    else if (!strcmp(f, "--max-batch-units")) o->max_units = (size_t)flag_long(f, v, 2, 1 << 20);
    else if (!strcmp(f, "--batch-nu")) o->nu = flag_double(f, v, 0, 1e30, 0);
    else if (!strcmp(f, "--batch-history")) o->history = flag_double(f, v, 0, 1, 1);
    else if (!strcmp(f, "--batch-grad-norm")) o->grad_norm = flag_choice(f, v, grad_norm_names);
    else if (!strcmp(f, "--batch-projection")) o->projection = flag_choice(f, v, projection_names);
    else if (!strcmp(f, "--batch-max-growth")) {
        o->max_growth = flag_double(f, v, 0, 1e30, 0);
        if (o->max_growth != 0.0 && o->max_growth < 1.0)
            flag_error("--batch-max-growth must be 0 (unbounded) or at least 1 (got %g)", o->max_growth);
    }
    else if (!strcmp(f, "--outer-lr")) o->outer_lr = flag_double(f, v, 0, 1e30, 0);
    else if (!strcmp(f, "--outer-momentum")) o->outer_momentum = flag_double(f, v, 0, 1, 1);
    else return 0;
    return 1;
}

/* Every flag, the program's own through extra (own: their usage line); a mistake stops the
   program with one line naming it. */
static inline void parse_options_extra(options *o, int argc, char **argv, extra_flag_fn extra, void *user,
                                       const char *own) {
    int i;
    for (i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int took;
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) usage(argv[0], own);
        took = extra ? extra(user, f, v) : 0;
        if (took > 0) {
            i += took - 1;
            continue;
        }
        if (strncmp(f, "--", 2)) flag_error("unexpected argument \"%s\"", f);
        if (v == NULL) flag_error("%s needs a value", f);
        if (!common_flag(o, f, v)) flag_error("unknown flag %s", f);
        i++;
    }
    export_launch_flags(o);
    if (o->average == NULL) o->average = o->period == 1 ? "grads" : "models";
    if (!strcmp(o->average, "grads") && o->period > 1)
        flag_error("--average grads needs --period 1 (at period %zu only the models are averaged)", o->period);
    if (!strcmp(o->average, "models") && o->period == 1 && !o->celgc)
        flag_error("--average models at --period 1 is CELGC's rule and needs --celgc (plain steps average the "
                   "gradients at period 1)");
}

static inline void parse_options(options *o, int argc, char **argv) {
    parse_options_extra(o, argc, argv, NULL, NULL, NULL);
}

/* --adaptive-batch NAME as a batch-size test configuration; 0 for "off". */
static inline int batch_config_from_options(const options *o, dopt_batch_config *bcfg) {
    memset(bcfg, 0, sizeof *bcfg);
    if (!strcmp(o->adaptive, "off")) return 0;
    if (!strcmp(o->adaptive, "norm")) {
        bcfg->test = DOPT_BATCH_NORM;
        bcfg->eta = o->eta;
    } else if (!strcmp(o->adaptive, "ip") || !strcmp(o->adaptive, "aip")) {
        bcfg->test = !strcmp(o->adaptive, "ip") ? DOPT_BATCH_INNER_PRODUCT : DOPT_BATCH_AUGMENTED;
        bcfg->theta = o->eta;
        bcfg->nu = o->nu;
    }
    bcfg->estimator = DOPT_BATCH_WITHIN;
    bcfg->unit_samples = o->batch > 0 ? (size_t)o->batch : 1;
    /* the variance is the spread of one step's micro-batches: two at least */
    bcfg->initial_units = 2;
    bcfg->max_units = o->max_units ? o->max_units : 8;
    bcfg->history = o->history;
    bcfg->bias_corrected = o->grad_norm && !strcmp(o->grad_norm, "bias-corrected");
    bcfg->projection = !o->projection || !strcmp(o->projection, "auto") ? DOPT_BATCH_PROJECT_AUTO
                       : !strcmp(o->projection, "exact")                 ? DOPT_BATCH_PROJECT_EXACT
                                                                         : DOPT_BATCH_PROJECT_PREVIOUS;
    bcfg->max_growth = o->max_growth;
    return 1;
}

/* What the batch-size test asked for, at its first and its last decision: the figure to choose
   --batch-eta by (see localsgd.h: choose eta from the batch you can afford). */
typedef struct batch_report {
    uint64_t seen;
    double first, last;
} batch_report;

static inline void batch_report_step(batch_report *r, const dopt_batch *bc) {
    double need;
    if (bc->decisions == r->seen) return;
    r->seen = bc->decisions;
    dopt_batch_next_units(&bc->cfg, bc->units, &bc->last, &need);
    if (r->seen == 1) r->first = need;
    r->last = need;
}

static inline void batch_report_print(const batch_report *r, const dopt_batch *bc) {
    printf("adaptive batch: %llu decisions (%llu could not decide); the test asked for %.4g samples at the first, "
           "%.4g at the last (Var %.4g, |grad F|^2 %.4g); now %zu x %zu samples\n",
           (unsigned long long)bc->decisions, (unsigned long long)bc->undecided, r->first, r->last, bc->last.var,
           bc->last.grad_norm2, bc->units, bc->cfg.unit_samples);
}

/* --compress NAME as a compressor configuration; 0 for "none" (fp32, no compressor), -1 for a
   name that is none of codec_names. */
static inline int codec_from_name(const char *name, dopt_codec *codec) {
    static const struct { const char *name; dopt_codec codec; } table[] = {
        {"ternary", DOPT_CODEC_TERNARY}, {"qsgd", DOPT_CODEC_QSGD}, {"topk", DOPT_CODEC_TOPK},
        {"sign", DOPT_CODEC_SIGN},       {"fp16", DOPT_CODEC_FP16}, {"bf16", DOPT_CODEC_BF16},
        {"majority", DOPT_CODEC_MAJORITY}, {"powersgd", DOPT_CODEC_POWERSGD}};
    size_t i;
    for (i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(name, table[i].name)) { *codec = table[i].codec; return 1; }
    return strcmp(name, "none") ? -1 : 0;
}

/* 1 when each step averages the gradients before the update (--period 1, --average grads: the
   synchronous method); 0 when the models are averaged after the update, every --period steps.
   At period 1 both communicate once per step, but only the first applies the update rule
   (CELGC's clipping, say) to the average gradient; the second applies it to each worker's own
   gradient, then averages the models. */
static inline int averages_gradients(const options *o) {
    return o->period == 1 && (o->average == NULL || strcmp(o->average, "models"));
}

/* The method --compress, --period and --average name, as the compressor's and the driver's
   configurations (the host adds its own fields, then initialises both); returns 0 for --compress
   none (then no compressor: do not initialise cz). Gradient averages go through cz when there is
   one; model averages send their deltas through it. */
static inline int method_configs(const options *o, dopt_compressor *cz, dopt_compressor_config *ccfg,
                                 dopt_dp_config *lcfg) {
    dopt_codec codec = DOPT_CODEC_FP32;
    int compress = codec_from_name(o->compress, &codec), sync = averages_gradients(o);
    memset(ccfg, 0, sizeof *ccfg);
    ccfg->codec = codec;
    ccfg->seed = o->seed;
    ccfg->powersgd_rank = o->powersgd_rank; /* PowerSGD compresses the segments that have rows */
    memset(lcfg, 0, sizeof *lcfg);
    lcfg->period = o->period;
    lcfg->sync_grads = sync;
    lcfg->compressor = compress && !sync ? cz : NULL;
    lcfg->grad_compressor = compress && sync ? cz : NULL;
    lcfg->outer_lr = o->outer_lr;            /* DiLoCo: each model average an outer Nesterov step */
    lcfg->outer_momentum = o->outer_momentum;
    return compress;
}

/* 1 when a step of `units` micro-batches of --batch items fits in the `have` items of a worker's
   shard; else rank 0 says so and it returns 0 on every rank alike (the batch outgrew the shard:
   an epoch would make no step), and the caller stops training. */
static inline int step_fits(const options *o, size_t units, size_t have, const dopt_comm *comm, int epoch) {
    if (units * (size_t)o->batch <= have) return 1;
    if (comm->rank == 0)
        fprintf(stderr, "a step of %zu items needs more than a worker's %zu; stopping at epoch %d\n",
                units * (size_t)o->batch, have, epoch);
    return 0;
}


static inline double wall_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* --elastic on: an evaluation's collectives that lost a worker are the driver's next call to take
   up (localsgd.h: ELASTIC), not the end of the run. */
static inline dopt_status lost_worker_later(int elastic, dopt_status st) {
    return elastic && (st == DOPT_ERR_PEER_LOST || st == DOPT_ERR_TIMEOUT) ? DOPT_OK : st;
}

/* --overlap on|off: whether backward hands each tensor to the driver as it becomes final. */
static inline int overlap_flag(const char *flag, const char *v) {
    static const char *const names[] = {"off", "on", NULL};
    if (v == NULL) flag_error("%s needs a value", flag);
    return !strcmp(flag_choice(flag, v, names), "on");
}

/* What backward does besides computing the gradient: it times itself and, with --overlap on, on
   the step's last micro-batch, adds each tensor of the micro-batch gradient into the step's
   gradient (grads[seg] += scale · micro[seg], the whole-buffer axpy cut by segment: the same
   bits) and marks it final, so that its bucket's average may start while backward goes on. */
typedef struct backward_hooks {
    dopt_dp *dp;              /* the driver, or NULL: nothing is marked (--overlap off) */
    const dopt_segment *segs; /* the gradients' table: the driver's, and the compressor's */
    float *grads;             /* the step's gradient */
    const float *micro;       /* the micro-batch gradient backward writes */
    float scale;              /* 1 / micro-batches per step */
    int mark;                 /* 1: this micro-batch is the step's last and dp is set */
    double backward_secs;     /* backward's time in this step, summed over its micro-batches */
} backward_hooks;

/* Tensor seg of the micro-batch gradient is final (h NULL: no hooks, as in a gradient check). */
static inline void tensor_final(backward_hooks *h, size_t seg) {
    if (h == NULL || !h->mark) return;
    dopt_axpy(h->grads + h->segs[seg].offset, h->scale, h->micro + h->segs[seg].offset, h->segs[seg].count);
    dopt_dp_grad_ready(h->dp, seg); /* distopt: its bucket may start (a no-op on local steps) */
}

/* FNV-1a of n floats' bytes: the final parameters' fingerprint, for comparing runs bit for bit. */
static inline unsigned long long params_fnv1a(const float *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    unsigned long long h = 0xcbf29ce484222325ull;
    size_t i;
    for (i = 0; i < n * sizeof(float); i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* ===================================================================== STEP TIMING

   The line the overlap benchmark parses, printed once at the end on rank 0:
     timing steps=<k> step_ms=<median> wait_ms=<median> backward_ms=<median> overlap=<on|off>
   medians over the steps after the first 3 (they pay the warm-up and the buckets' rebuild; nan
   without such steps). A
   step runs from the start of its forward pass to after the host's update (evaluations and
   logging fall outside); wait is the time inside the driver's averaging call
   (dopt_dp_after_backward, or dopt_dp_celgc_step), backward the backward pass. Fields may be
   added; none is renamed. A few clock reads per step, into arrays allocated once. */
enum { TIMING_WARMUP = 3 };

typedef struct step_timing {
    double *ms;          /* 3 × cap: each step's step, wait and backward time (ms) */
    size_t cap, n, seen; /* steps recorded, steps seen (the warm-up included) */
    double t0, t_wait, wait_secs;
} step_timing;

static inline void timing_init(step_timing *tm, size_t max_steps) {
    memset(tm, 0, sizeof *tm);
    tm->cap = max_steps;
    tm->ms = (double *)malloc((3 * max_steps + 1) * sizeof(double));
    if (tm->ms == NULL) { fprintf(stderr, "out of memory\n"); exit(1); }
}

static inline void timing_begin(step_timing *tm) {
    tm->wait_secs = 0;
    tm->t0 = wall_seconds();
}

/* Around the driver's averaging call. */
static inline void timing_wait_begin(step_timing *tm) { tm->t_wait = wall_seconds(); }

static inline void timing_waited(step_timing *tm) { tm->wait_secs += wall_seconds() - tm->t_wait; }

/* The step ends: its time, and the wait timed around the driver's call, the backward time the host summed. */
static inline void timing_end(step_timing *tm, double backward_secs) {
    double now = wall_seconds();
    if (tm->seen++ < TIMING_WARMUP || tm->n >= tm->cap) return;
    tm->ms[tm->n] = 1e3 * (now - tm->t0);
    tm->ms[tm->cap + tm->n] = 1e3 * tm->wait_secs;
    tm->ms[2 * tm->cap + tm->n] = 1e3 * backward_secs;
    tm->n++;
}

static inline int timing_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline double timing_median(double *x, size_t n) {
    if (n == 0) return NAN;
    qsort(x, n, sizeof *x, timing_cmp);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

/* Prints the line (on the caller's rank; the arrays are sorted in place). */
static inline void timing_print(step_timing *tm, int overlap) {
    printf("timing steps=%zu step_ms=%.3f wait_ms=%.3f backward_ms=%.3f overlap=%s\n", tm->n,
           timing_median(tm->ms, tm->n), timing_median(tm->ms + tm->cap, tm->n),
           timing_median(tm->ms + 2 * tm->cap, tm->n), overlap ? "on" : "off");
    fflush(stdout);
}

static inline void timing_free(step_timing *tm) {
    free(tm->ms);
    tm->ms = NULL;
}

#endif
