/* bench_clip — global-norm clipping, single thread, beside the memory bandwidth this process
   measures in the same run (the method of bench_kernels).

   For 1e5 and 1e7 floats:
   - norm: dopt_clip_global_norm with measure_only, the pass every clipping step makes (reads the
     gradient once; NaN/Inf detection comes from the sum itself), against the read limit;
   - sumsq: dopt_sumsq, distopt.h's kernel, which the norm pass equals bit for bit;
   - sumsq+finite: dopt_sumsq then dopt_all_finite, what a separate non-finite check would cost;
   - clip: dopt_clip_global_norm when it does clip (norm pass, then a scaling pass: 12 bytes of
     traffic per element), against the copy limit;
   - read_pf: the read limit's own loop with a software prefetch, to show how far the plain read
     loop is from what this machine streams, and norm once more against that stronger limit.
   "read" streams the array once (an integer sum of its words) and "copy" is memcpy (bytes read
   plus bytes written); timing, pairing and medians as bench_pair.h describes.

   Last line: "bench clip norm_ratio=<x>": the norm pass at 1e7 over read bandwidth (goal ≥ 0.8).
   Run: OPENBLAS_NUM_THREADS=1 build/bench_clip   (make bench does this) */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../clip.h"

#include "bench_pair.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the cases ---- */
static void k_norm(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    dopt_clip_norm o = {.max_norm = 1.0f, .measure_only = 1};
    dopt_clip_global_norm(NULL, &(dopt_buf){.data = a->x, .n = a->n}, &o);
    a->sink = o.norm + o.factor;
}
static void k_sumsq(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    a->sink = dopt_sumsq(a->x, a->n);
}
static void k_sumsq_finite(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    a->sink = dopt_sumsq(a->x, a->n) + dopt_all_finite(a->x, a->n);
}
static void k_clip(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    dopt_clip_norm o;
    a->scalar *= 0.99999f; /* the threshold, below the norm the previous call clipped the buffer to */
    o = (dopt_clip_norm){.max_norm = a->scalar};
    dopt_clip_global_norm(NULL, &(dopt_buf){.data = a->y, .n = a->n}, &o);
    a->sink = o.norm;
}
static void read_prefetch(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    uint32_t acc[16] = {0}, total = 0;
    const uint32_t *w = (const uint32_t *)(const void *)a->x;
    size_t i, j, n = a->n - a->n % 16;
    for (i = 0; i < n; i += 16) {
        __builtin_prefetch((const void *)((uintptr_t)(w + i) + 8192));
        for (j = 0; j < 16; j++) acc[j] += w[i + j];
    }
    for (j = 0; j < 16; j++) total += acc[j];
    a->sink = total;
}

typedef struct bench_case {
    const char *name;
    bench_fn fn;
    int bytes_per_elem; /* traffic: 4 per array read, 4 per array written */
    bench_fn limit;
    const char *limit_name;
    int limit_bytes; /* bytes per element the limit moves: read 4, copy 8 */
} bench_case;

static const bench_case cases[] = {
    {"norm", k_norm, 4, bench_read_limit, "read", 4},
    {"sumsq", k_sumsq, 4, bench_read_limit, "read", 4},
    {"sumsq+finite", k_sumsq_finite, 4, bench_read_limit, "read", 4},
    {"clip", k_clip, 12, bench_copy_limit, "copy", 8},
    {"read_pf", read_prefetch, 4, bench_read_limit, "read", 4},
    {"norm", k_norm, 4, read_prefetch, "read_pf", 4},
};

int main(void) {
    static const size_t sizes[2] = {100000, 10000000};
    double norm_ratio = 0;
    int s;
    size_t c;
    printf("# single thread; median [min, max] of %d repetitions; ratio = case GB/s / limit GB/s, paired\n", BENCH_REPS);
    for (s = 0; s < 2; s++) {
        bench_arrays a;
        size_t i;
        a.n = sizes[s];
        a.x = (float *)malloc(a.n * sizeof(float));
        a.y = (float *)malloc(a.n * sizeof(float));
        if (a.x == NULL || a.y == NULL) return 1;
        for (i = 0; i < a.n; i++) {
            a.x[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
            a.y[i] = a.x[i];
        }
        a.scalar = (float)sqrt(dopt_sumsq(a.y, a.n));
        for (c = 0; c < sizeof cases / sizeof *cases; c++) {
            double t[3], tl[3], ratio[3], limit_bytes = cases[c].limit_bytes;
            bench_time_pair(cases[c].fn, cases[c].limit, &a, t, tl, ratio, cases[c].bytes_per_elem / limit_bytes);
            printf("n=%-9zu %-13s %7.3f Gelem/s [%.3f, %.3f] %7.2f GB/s  limit_%-7s %7.2f GB/s  ratio=%.2f [%.2f, %.2f]\n",
                   a.n, cases[c].name, (double)a.n / t[0] * 1e-9, (double)a.n / t[2] * 1e-9, (double)a.n / t[1] * 1e-9,
                   cases[c].bytes_per_elem * (double)a.n / t[0] * 1e-9, cases[c].limit_name,
                   limit_bytes * (double)a.n / tl[0] * 1e-9, ratio[0], ratio[1], ratio[2]);
            if (a.n == 10000000 && c == 0) norm_ratio = ratio[0];
        }
        free(a.x);
        free(a.y);
    }
    printf("bench clip norm_ratio=%.2f\n", norm_ratio);
    return 0;
}
