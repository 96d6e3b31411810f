/* bench_kernels — distopt's vector kernels, single thread, beside the memory bandwidth this process
   measures at the same sizes, and beside OpenBLAS's nearest routine.

   For each size (1e3, 1e5, 1e7 floats) the limits come first: "read" streams the array once
   (an integer sum of its words, which any compiler vectorizes and which does no other work) and
   "copy" is memcpy (counted as bytes read plus bytes written, as STREAM does). Each kernel line
   gives Gelem/s, GB/s of its own traffic, and the ratio of that to the matching limit: read for
   kernels that only read (sumsq, maxabs, mean_var, dot), copy for kernels that also write (axpy,
   scale, and rng_uniform, which writes Philox uniforms). Timing, pairing and medians as
   bench_pair.h describes.

   Last line: "bench kernels sumsq_ratio=<x> maxabs_ratio=<y>" at 1e7 (goal ≥ 0.8).
   Run: OPENBLAS_NUM_THREADS=1 build/bench_kernels   (make bench does this) */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"

#include "bench_pair.h"

#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- distopt ---- */
static void k_sumsq(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    a->sink = dopt_sumsq(a->x, a->n);
}
static void k_dot(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    a->sink = dopt_dot(a->x, a->y, a->n);
}
static void k_maxabs(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    a->sink = dopt_maxabs(a->x, a->n);
}
static void k_mean_var(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    double m, v;
    dopt_mean_var(a->x, a->n, &m, &v);
    a->sink = m + v;
}
static void k_uniform(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    dopt_rng rng;
    dopt_rng_init(&rng, 42, 0, 7);
    dopt_rng_uniform(&rng, 0, a->y, a->n);
}
static void k_axpy(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    dopt_axpy(a->y, 1e-7f, a->x, a->n);
}
static void k_scale(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    dopt_scale(a->y, 0.9999999f, a->n);
}

/* ---- OpenBLAS, the peer ---- */
static void b_snrm2(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    a->sink = cblas_snrm2((blasint)a->n, a->x, 1);
}
static void b_dsdot(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    a->sink = cblas_dsdot((blasint)a->n, a->x, 1, a->y, 1);
}
static void b_isamax(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    a->sink = (double)cblas_isamax((blasint)a->n, a->x, 1);
}
static void b_saxpy(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    cblas_saxpy((blasint)a->n, 1e-7f, a->x, 1, a->y, 1);
}
static void b_sscal(void *ctx) {
    bench_arrays *a = (bench_arrays *)ctx;
    cblas_sscal((blasint)a->n, 0.9999999f, a->y, 1);
}

typedef struct bench_case {
    const char *name;
    bench_fn fn;
    int bytes_per_elem; /* traffic: 4 per array read, 4 per array written */
    int writes;         /* compared with copy bandwidth rather than read */
} bench_case;

static const bench_case cases[] = {
    {"sumsq", k_sumsq, 4, 0},          {"blas_snrm2", b_snrm2, 4, 0}, {"maxabs", k_maxabs, 4, 0},
    {"blas_isamax", b_isamax, 4, 0},   {"mean_var", k_mean_var, 4, 0}, {"dot", k_dot, 8, 0},
    {"blas_dsdot", b_dsdot, 8, 0},     {"axpy", k_axpy, 12, 1},       {"blas_saxpy", b_saxpy, 12, 1},
    {"scale", k_scale, 8, 1},          {"blas_sscal", b_sscal, 8, 1},   {"rng_uniform", k_uniform, 4, 1},
};

int main(void) {
    static const size_t sizes[3] = {1000, 100000, 10000000};
    double sumsq_ratio = 0, maxabs_ratio = 0;
    int s;
    size_t c;
    printf("# single thread; median [min, max] of %d repetitions; ratio = kernel GB/s / limit GB/s, paired\n", BENCH_REPS);
    for (s = 0; s < 3; s++) {
        bench_arrays a;
        size_t i;
        a.n = sizes[s];
        a.x = (float *)malloc(a.n * sizeof(float));
        a.y = (float *)malloc(a.n * sizeof(float));
        for (i = 0; i < a.n; i++) {
            a.x[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
            a.y[i] = 1.0f;
        }
        for (c = 0; c < sizeof cases / sizeof *cases; c++) {
            double t[3], tl[3], ratio[3], limit_bytes = cases[c].writes ? 8.0 : 4.0;
            bench_time_pair(cases[c].fn, cases[c].writes ? bench_copy_limit : bench_read_limit, &a, t, tl, ratio,
                      cases[c].bytes_per_elem / limit_bytes);
            printf("n=%-9zu %-12s %7.3f Gelem/s [%.3f, %.3f] %7.2f GB/s  limit_%s %7.2f GB/s  ratio=%.2f [%.2f, %.2f]\n",
                   a.n, cases[c].name, (double)a.n / t[0] * 1e-9, (double)a.n / t[2] * 1e-9, (double)a.n / t[1] * 1e-9,
                   cases[c].bytes_per_elem * (double)a.n / t[0] * 1e-9, cases[c].writes ? "copy" : "read",
                   limit_bytes * (double)a.n / tl[0] * 1e-9, ratio[0], ratio[1], ratio[2]);
            if (a.n == 10000000 && strcmp(cases[c].name, "sumsq") == 0) sumsq_ratio = ratio[0];
            if (a.n == 10000000 && strcmp(cases[c].name, "maxabs") == 0) maxabs_ratio = ratio[0];
        }
        free(a.x);
        free(a.y);
    }
    printf("bench kernels sumsq_ratio=%.2f maxabs_ratio=%.2f\n", sumsq_ratio, maxabs_ratio);
    return 0;
}
