/* bench_nonfinite — what the data-parallel driver's non-finite verdict costs on the default path,
   beside the fp32 allreduce it guards, measured in the same run on 2 ranks over shared memory.

   dopt_dp_after_backward on a synchronous step averages a flat gradient buffer in place: its
   verdicts are two read-only scans (dopt_all_finite: this rank's input before the allreduce
   overwrites it, the average after). A scatter list is copied into the workspace, averaged and
   copied back, and there the verdicts ride on the copies (dopt_copy_finite: the input on the
   way in, the average on the way out); a local-SGD model average makes the same two copies, and
   one float more in its allreduce (every rank's flag). For 1, 16 and 64 MiB of f32, each rank
   at once:
   - allreduce: dopt_allreduce of the buffer, f32 MEAN (what the step must pay anyway);
   - copies: the two plain copies (memcpy in, memcpy out), the packed path without a verdict;
   - checked: the same two copies through dopt_copy_finite (the packed path's verdict);
   - scans: two dopt_all_finite passes over the gradient (the in-place path's verdict);
   - after_backward: the whole dopt_dp_after_backward of a flat buffer, fp32 at period 1.
   Each is timed 9 times (median, after a warm-up), the slowest rank's time between barriers,
   with the cases alternating so that a noisy moment hits all of them. One line per size:

       bench nonfinite bytes=N allreduce_us=A copies_us=C checked_us=K check_cost=X scans_us=S
             scan_cost=Y after_backward_us=B

   check_cost = (K − C) / A: the packed verdict's share of the allreduce (goal ≤ 0.02); it may come
   out negative when the difference is within the noise. scan_cost = S / A: the in-place verdict's
   share, which replaces the copies and their verdict (K) altogether. after_backward_us beside A
   is what the driver adds to the allreduce on the common path.
   Run: build/bench_nonfinite   (make bench does this) */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "../localsgd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define REPS 9
#define CASES 5

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct bufs {
    float *grad, *work;
    size_t n;
    dopt_dp dp; /* period 1, fp32: every after_backward averages */
    volatile int sink;
} bufs;

/* 0: the allreduce; 1: plain copies; 2: checked copies; 3: the in-place scans; 4: the driver's
   after_backward on the flat gradient. The slowest rank's microseconds. */
static double run_case(dopt_comm *c, bufs *b, int which) {
    double t0, dt;
    dopt_barrier(c);
    t0 = now_us();
    if (which == 0) {
        dopt_allreduce(c, b->work, b->n, DOPT_F32, DOPT_MEAN);
    } else if (which == 1) {
        memcpy(b->work, b->grad, b->n * sizeof(float));
        memcpy(b->grad, b->work, b->n * sizeof(float));
    } else if (which == 2) {
        b->sink += dopt_copy_finite(b->work, b->grad, b->n);
        b->sink += dopt_copy_finite(b->grad, b->work, b->n);
    } else if (which == 3) {
        b->sink += dopt_all_finite(b->grad, b->n);
        b->sink += dopt_all_finite(b->grad, b->n);
    } else {
        b->sink += (int)dopt_dp_after_backward(&b->dp, b->grad);
    }
    dt = now_us() - t0;
    dopt_allreduce(c, &dt, 1, DOPT_F64, DOPT_MAX);
    return dt;
}

int main(void) {
    static const size_t mib[] = {1, 16, 64};
    dopt_comm *c = NULL;
    size_t s, i;
    if (dopt_shm_fork(&c, 2, NULL) != DOPT_OK) return 1;
    for (s = 0; s < sizeof mib / sizeof mib[0]; s++) {
        bufs b;
        double t[CASES][REPS], med[CASES];
        int r, k;
        b.n = mib[s] << 18; /* MiB of f32 */
        b.grad = (float *)malloc(b.n * sizeof(float));
        b.work = (float *)malloc(b.n * sizeof(float));
        b.sink = 0;
        if (b.grad == NULL || b.work == NULL) return dopt_shm_fork_finish(c, 1);
        if (dopt_dp_init(&b.dp, c, b.n, NULL) != DOPT_OK) return dopt_shm_fork_finish(c, 1);
        for (i = 0; i < b.n; i++) b.grad[i] = b.work[i] = (float)(i % 1000) * 1e-3f;
        for (k = 0; k < CASES; k++) run_case(c, &b, k); /* warm-up: pages touched, paths taken */
        for (r = 0; r < REPS; r++)
            for (k = 0; k < CASES; k++) t[k][r] = run_case(c, &b, k);
        for (k = 0; k < CASES; k++) {
            qsort(t[k], REPS, sizeof(double), cmp_double);
            med[k] = t[k][REPS / 2];
        }
        if (c->rank == 0)
            printf("bench nonfinite bytes=%zu allreduce_us=%.0f copies_us=%.0f checked_us=%.0f check_cost=%.4f "
                   "scans_us=%.0f scan_cost=%.4f after_backward_us=%.0f\n",
                   b.n * sizeof(float), med[0], med[1], med[2], (med[2] - med[1]) / med[0], med[3], med[3] / med[0],
                   med[4]);
        dopt_dp_free(&b.dp);
        free(b.grad);
        free(b.work);
    }
    return dopt_shm_fork_finish(c, 0);
}
