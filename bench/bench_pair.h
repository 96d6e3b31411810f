/* bench_pair.h — the timing method every single-thread benchmark here shares.

   The machine is shared and noisy, so a figure is only trusted as a ratio to a limit measured in
   the same run: each repetition of a case is paired with a repetition of its limit run right
   before it, and the reported ratio is the median of those paired ratios. Every figure is the
   median of BENCH_REPS repetitions after a warm-up, each repetition long enough (≥ 20 ms) for the
   clock; min and max come with it.

   bench_time_pair(fn, limit, ctx, t_fn, t_limit, ratio, traffic_ratio)
     seconds per call of fn and of limit (median, min, max) and the paired ratio
     (limit time / fn time) · traffic_ratio, where traffic_ratio = fn's bytes / limit's bytes.
   bench_read_words(p, bytes)   the "read" limit: an integer sum of the words (vectorizes, no
                                other work); returns it so the compiler keeps the loop.
   memcpy is the "copy" limit (bytes read plus bytes written, as STREAM counts). */
#ifndef BENCH_PAIR_H
#define BENCH_PAIR_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BENCH_REPS 9
#define BENCH_MIN_SECONDS 0.02

typedef void (*bench_fn)(void *ctx);

static double bench_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* v[0..n) sorted; out = {median, min, max}. */
static void bench_median_min_max(double *v, int n, double out[3]) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    out[0] = v[n / 2];
    out[1] = v[0];
    out[2] = v[n - 1];
}

/* A call count that lasts at least BENCH_MIN_SECONDS (after one warm-up call). */
static long bench_calls_for(bench_fn fn, void *ctx) {
    long calls = 1, k;
    fn(ctx);
    for (;;) {
        double t0 = bench_now_s();
        for (k = 0; k < calls; k++) fn(ctx);
        if (bench_now_s() - t0 > BENCH_MIN_SECONDS) return calls;
        calls *= 2;
    }
}

static double bench_seconds_per_call(bench_fn fn, void *ctx, long calls) {
    double t0 = bench_now_s();
    long k;
    for (k = 0; k < calls; k++) fn(ctx);
    return (bench_now_s() - t0) / (double)calls;
}

__attribute__((unused)) static void bench_time_pair(bench_fn fn, bench_fn limit, void *ctx, double t_fn[3],
                                                    double t_limit[3], double ratio[3], double traffic_ratio) {
    double tf[BENCH_REPS], tl[BENCH_REPS], rr[BENCH_REPS];
    long cf = bench_calls_for(fn, ctx), cl = bench_calls_for(limit, ctx);
    int r;
    for (r = 0; r < BENCH_REPS; r++) {
        tl[r] = bench_seconds_per_call(limit, ctx, cl);
        tf[r] = bench_seconds_per_call(fn, ctx, cf);
        rr[r] = tl[r] / tf[r] * traffic_ratio;
    }
    bench_median_min_max(tf, BENCH_REPS, t_fn);
    bench_median_min_max(tl, BENCH_REPS, t_limit);
    bench_median_min_max(rr, BENCH_REPS, ratio);
}

__attribute__((unused)) static uint32_t bench_read_words(const void *p, size_t bytes) {
    uint32_t acc[16] = {0}, total = 0;
    const uint32_t *w = (const uint32_t *)p;
    size_t i, j, n = bytes / 4 - (bytes / 4) % 16;
    for (i = 0; i < n; i += 16)
        for (j = 0; j < 16; j++) acc[j] += w[i + j];
    for (j = 0; j < 16; j++) total += acc[j];
    return total;
}

/* Two arrays of n floats that the kernel and clipping benchmarks run their cases on, and the two
   limits they pair them with: reading x, and copying x to y. */
typedef struct bench_arrays {
    float *x, *y;
    size_t n;
    float scalar; /* a case's own value (bench_clip: the clipping threshold) */
    volatile double sink;
} bench_arrays;

__attribute__((unused)) static void bench_read_limit(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    a->sink = bench_read_words(a->x, a->n * sizeof(float));
}

__attribute__((unused)) static void bench_copy_limit(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    memcpy(a->y, a->x, a->n * sizeof(float));
}

#endif
