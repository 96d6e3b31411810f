/* cluster_compress — the compressed allreduce across simulated hosts: every rank of a job started
   from the launcher's variables (bench/cluster.sh starts 8 on 4 hosts whose links are shaped to
   1 Gbit/s) averages a 64 MiB gradient (16 segments of 1 Mi floats) with each method in turn:

     fp32             dopt_allreduce, f32 mean: the baseline (the host-aware two-level ring when
                      the transport knows the hosts)
     ternary          dopt_compress_allreduce, TernGrad, the path compress.h chooses (the integer
                      ring, by host, at this size and world)
     ternary-allgather the same with aggregate = DOPT_AGG_ALLGATHER: every message to every rank
     ternary-ring, majority-ring   aggregate = DOPT_AGG_RING (where AUTO would not take it)
     ternary-ring-1-bucket   the ring without its pipeline (ring_buckets = 1): the encoder runs
                      whole before the ring starts
     majority, fp16, bf16   on their rings (where compress.h chooses them)
     sign, qsgd, topk       the other codecs (the allgather path)
     powersgd               rank 4 (its default r is 2) of each segment as a 1024 × 1024 matrix:
                            two fp32 allreduces of 4·(1024 + 1024) floats per matrix

   A warm-up, then the median of 5 repetitions, each the slowest rank's time between barriers.
   bits_per_elem is what a rank received per element during one call, from the communicator's
   traffic counters (payload bytes the engine read from peers, every collective of the call: the
   scale sharing too), the largest over the ranks. One line per method on rank 0:

     bench cluster-compress hosts=H ranks=N codec=C bytes=B us=T bits_per_elem=b speedup_fp32=s
           speedup_allgather=a path=P us_min=.. us_max=.. buckets=k

   speedup_fp32 = fp32's time / this method's; speedup_allgather = ternary-allgather's time /
   ternary's (na for the others); path: how compress.h combined the messages (fp32: the
   allreduce); buckets: how many the ring pipelined (0 off the ring). hosts comes from
   DOPT_BENCH_HOSTS (the script's layout; 0 when unset).
   Arguments: the methods to run (all but the forced rings when none is named; a ratio to one not
   run is "na").
   Run by bench/cluster.sh (root); by hand: DOPT_WORLD_SIZE=4 build/cluster_compress [METHOD...] */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../compress.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "../launch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NSEG 16
#define SEG ((size_t)1 << 20)
#define REPS 5

typedef struct method {
    const char *name;
    int fp32;
    dopt_codec codec;
    dopt_aggregate aggregate;
    int buckets; /* ring_buckets (0: compress.h's choice) */
    double us, us_min, us_max, bits;
    dopt_agg_path path;
    int used;    /* buckets the ring pipelined (cz->buckets) */
} method;

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(dopt_comm *c, dopt_status s, const char *what) {
    fprintf(stderr, "cluster_compress: %s: %s: %s\n", what, dopt_status_str(s), dopt_comm_detail(c));
    exit(dopt_comm_finish(c, s));
}

static uint64_t received(const dopt_comm *c) {
    uint64_t total = 0;
    size_t k;
    for (k = 0; k < sizeof c->traffic.received / sizeof c->traffic.received[0]; k++) total += c->traffic.received[k];
    return total;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void fill(float *g, size_t n, int rank) {
    uint64_t s = 0x9E3779B97F4A7C15ull * (uint64_t)(rank + 1);
    size_t i;
    for (i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        g[i] = (float)((double)(s >> 40) / 16777216.0 - 0.5) * 0.02f;
    }
}

static void run(dopt_comm *c, method *m, const dopt_segment *segs, const float *grad, float *work) {
    size_t n = NSEG * SEG;
    double t[REPS];
    int rep;
    dopt_compressor cz;
    dopt_compressor_config cfg;
    dopt_status s;
    memset(&cfg, 0, sizeof cfg);
    cfg.codec = m->codec;
    cfg.aggregate = m->aggregate;
    cfg.ring_buckets = m->buckets;
    cfg.seed = 7;
    cfg.powersgd_rank = 4;
    if (!m->fp32 && (s = dopt_compressor_init(&cz, &cfg, segs, NSEG)) != DOPT_OK) die(c, s, "init");
    for (rep = -1; rep < REPS; rep++) {
        uint64_t before;
        double t0, bits;
        memcpy(work, grad, n * sizeof(float));
        if ((s = dopt_barrier(c)) != DOPT_OK) die(c, s, "barrier");
        before = received(c);
        t0 = now_seconds();
        s = m->fp32 ? dopt_allreduce(c, work, n, DOPT_F32, DOPT_MEAN) : dopt_compress_allreduce(&cz, c, work, n);
        if (s != DOPT_OK) die(c, s, m->name);
        t0 = now_seconds() - t0;
        bits = 8.0 * (double)(received(c) - before) / (double)n;
        if ((s = dopt_allreduce(c, &t0, 1, DOPT_F64, DOPT_MAX)) != DOPT_OK) die(c, s, "time");
        if ((s = dopt_allreduce(c, &bits, 1, DOPT_F64, DOPT_MAX)) != DOPT_OK) die(c, s, "bits");
        if (rep >= 0) t[rep] = t0;
        m->bits = bits;
    }
    qsort(t, REPS, sizeof t[0], cmp_double);
    m->us = t[REPS / 2] * 1e6;
    m->us_min = t[0] * 1e6;
    m->us_max = t[REPS - 1] * 1e6;
    m->path = m->fp32 ? DOPT_PATH_NONE : cz.path;
    m->used = m->fp32 ? 0 : cz.buckets;
    if (!m->fp32) dopt_compressor_free(&cz);
}

static const char *path_name(const method *m) {
    if (m->fp32 || m->codec == DOPT_CODEC_POWERSGD) return "allreduce";
    switch (m->path) {
    case DOPT_PATH_ALLGATHER: return "allgather";
    case DOPT_PATH_RING: return "ring";
    case DOPT_PATH_RING_TWO_LEVEL: return "ring-two-level";
    case DOPT_PATH_NONE: break;
    }
    return "none";
}

static int wanted(int argc, char **argv, const char *name) {
    int i;
    for (i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0) return 1;
    return argc < 2;
}

int main(int argc, char **argv) {
    method ms[] = {
        {"fp32", 1, DOPT_CODEC_FP32, DOPT_AGG_AUTO, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"ternary", 0, DOPT_CODEC_TERNARY, DOPT_AGG_AUTO, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"ternary-allgather", 0, DOPT_CODEC_TERNARY, DOPT_AGG_ALLGATHER, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"majority", 0, DOPT_CODEC_MAJORITY, DOPT_AGG_AUTO, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"sign", 0, DOPT_CODEC_SIGN, DOPT_AGG_AUTO, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"fp16", 0, DOPT_CODEC_FP16, DOPT_AGG_AUTO, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"bf16", 0, DOPT_CODEC_BF16, DOPT_AGG_AUTO, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"qsgd", 0, DOPT_CODEC_QSGD, DOPT_AGG_AUTO, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"topk", 0, DOPT_CODEC_TOPK, DOPT_AGG_AUTO, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"powersgd", 0, DOPT_CODEC_POWERSGD, DOPT_AGG_AUTO, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"ternary-ring", 0, DOPT_CODEC_TERNARY, DOPT_AGG_RING, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"majority-ring", 0, DOPT_CODEC_MAJORITY, DOPT_AGG_RING, 0, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
        {"ternary-ring-1-bucket", 0, DOPT_CODEC_TERNARY, DOPT_AGG_RING, 1, 0, 0, 0, 0, DOPT_PATH_NONE, 0},
    };
    size_t nm = sizeof ms / sizeof ms[0], i, n = NSEG * SEG;
    dopt_segment segs[NSEG];
    dopt_comm *c;
    float *grad, *work;
    const char *hosts = getenv("DOPT_BENCH_HOSTS");
    dopt_status s = dopt_comm_create_from_env(&c);
    if (s != DOPT_OK) return 1;
    for (i = 0; i < NSEG; i++) segs[i].offset = i * SEG, segs[i].count = SEG, segs[i].name = NULL, segs[i].rows = 1024;
    grad = (float *)malloc(n * sizeof(float));
    work = (float *)malloc(n * sizeof(float));
    if (grad == NULL || work == NULL) die(c, DOPT_ERR_NOMEM, "malloc");
    fill(grad, n, c->rank);
    for (i = 0; i < nm; i++)
        if (wanted(argc, argv, ms[i].name) && (argc > 1 || strstr(ms[i].name, "-ring") == NULL))
            run(c, &ms[i], segs, grad, work);
    for (i = 0; c->rank == 0 && i < nm; i++) {
        char ag[32] = "na", f32[32] = "na";
        if (ms[i].us == 0) continue;
        if (ms[i].codec == DOPT_CODEC_TERNARY && !ms[i].fp32 && ms[2].us > 0)
            snprintf(ag, sizeof ag, "%.2f", ms[2].us / ms[i].us);
        if (ms[0].us > 0) snprintf(f32, sizeof f32, "%.2f", ms[0].us / ms[i].us);
        printf("bench cluster-compress hosts=%s ranks=%d codec=%s bytes=%zu us=%.0f bits_per_elem=%.2f "
               "speedup_fp32=%s speedup_allgather=%s path=%s us_min=%.0f us_max=%.0f buckets=%d\n",
               hosts ? hosts : "0", c->size, ms[i].name, n * sizeof(float), ms[i].us, ms[i].bits, f32, ag, path_name(&ms[i]),
               ms[i].us_min, ms[i].us_max, ms[i].used);
    }
    fflush(stdout);
    free(grad);
    free(work);
    return dopt_comm_finish(c, 0);
}
