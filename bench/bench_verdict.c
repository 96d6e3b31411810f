/* bench_verdict — what the marks' verdict (localsgd.h, OVERLAP: one 8-byte allreduce MIN at the
   end of every step that marks segments) costs, beside the bucketed step it is part of, on a
   2-rank TCP loopback world (two processes forked here).

       build/bench_verdict

   verdict: the verdict's collective alone, dopt_allreduce of one i64 MIN, per call;
   step:    a bucketed synchronous step of 8 segments (353286 floats, 1.41 MB, buckets of 64 KiB):
            every segment marked final at once (backward takes no time), then after_backward,
            which waits for the buckets and runs the verdict; per step. The step is pure
            communication, so share = verdict / step is the most the verdict can add to a step.
   Each figure: the median (and the min, max) of BENCH_REPS repetitions of many calls, timed on
   rank 0 between barriers, after a warm-up. One line:

       bench verdict transport=tcp ranks=2 verdict_us=V verdict_min=a verdict_max=b step_us=S
                     step_min=c step_max=d share=V/S */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_tcp.h"
#include "../compress.h"
#include "../localsgd.h"
#include "bench_pair.h"

#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERDICT_CALLS 1000
#define STEP_CALLS 50
#define NSEG 8

static const size_t seg_sizes[NSEG] = {3000, 17, 40000, 5, 9000, 300000, 64, 1200};

static int port_pipe[2];

static void on_listen(void *user, int port) {
    (void)user;
    if (write(port_pipe[1], &port, sizeof port) != (ssize_t)sizeof port) _exit(2);
}

static dopt_comm *join(int rank) {
    dopt_tcp_config cfg;
    dopt_comm *c = NULL;
    memset(&cfg, 0, sizeof cfg);
    cfg.rank = rank;
    cfg.world_size = 2;
    cfg.timeout_ms = 60000;
    cfg.token = "bench-verdict";
    if (rank == 0) {
        cfg.on_listen = on_listen;
    } else if (read(port_pipe[0], &cfg.master_port, sizeof cfg.master_port) != (ssize_t)sizeof cfg.master_port) {
        return NULL;
    }
    return dopt_tcp_create(&c, &cfg) == DOPT_OK ? c : NULL;
}

/* Seconds per call of `calls` verdict allreduces, timed between barriers. */
static double time_verdicts(dopt_comm *c, int calls) {
    int64_t w = c->rank == 0 ? INT64_MAX : (int64_t)1 << 40;
    double t0;
    int i;
    if (dopt_barrier(c) != DOPT_OK) return -1.0;
    t0 = bench_now_s();
    for (i = 0; i < calls; i++)
        if (dopt_allreduce(c, &w, 1, DOPT_I64, DOPT_MIN) != DOPT_OK) return -1.0;
    return (bench_now_s() - t0) / calls;
}

/* Seconds per bucketed step of `calls` steps. */
static double time_steps(dopt_dp *dp, const dopt_buf *g, int calls) {
    double t0;
    int i;
    size_t s;
    if (dopt_barrier(dp->comm) != DOPT_OK) return -1.0;
    t0 = bench_now_s();
    for (i = 0; i < calls; i++) {
        for (s = NSEG; s-- > 0;)
            if (dopt_dp_grad_ready(dp, s) != DOPT_OK) return -1.0;
        if (dopt_dp_after_backward_buf(dp, g) != DOPT_OK) return -1.0;
    }
    return (bench_now_s() - t0) / calls;
}

static int run_rank(int rank) {
    dopt_comm *c = join(rank);
    dopt_segment segs[NSEG];
    double tv[BENCH_REPS], ts[BENCH_REPS], v[3], st[3];
    size_t n = 0, i;
    float *grads;
    dopt_buf g;
    dopt_dp dp;
    int r;
    if (c == NULL) return 1;
    for (i = 0; i < NSEG; i++) {
        segs[i] = (dopt_segment){n, seg_sizes[i], NULL, 0};
        n += seg_sizes[i];
    }
    grads = (float *)calloc(n, sizeof(float));
    g = dopt_buf_flat(grads, n, segs, NSEG);
    if (grads == NULL || dopt_dp_init(&dp, c, n, &(dopt_dp_config){.grads = &g, .bucket_bytes = 64 << 10}) != DOPT_OK)
        return 1;
    if (time_verdicts(c, VERDICT_CALLS / 10) < 0 || time_steps(&dp, &g, 5) < 0) return 1; /* warm-up, rebuild */
    for (r = 0; r < BENCH_REPS; r++) {
        tv[r] = time_verdicts(c, VERDICT_CALLS);
        ts[r] = time_steps(&dp, &g, STEP_CALLS);
        if (tv[r] < 0 || ts[r] < 0) return 1;
    }
    bench_median_min_max(tv, BENCH_REPS, v);
    bench_median_min_max(ts, BENCH_REPS, st);
    if (rank == 0)
        printf("bench verdict transport=tcp ranks=2 verdict_us=%.1f verdict_min=%.1f verdict_max=%.1f step_us=%.1f "
               "step_min=%.1f step_max=%.1f share=%.4f\n",
               v[0] * 1e6, v[1] * 1e6, v[2] * 1e6, st[0] * 1e6, st[1] * 1e6, st[2] * 1e6, v[0] / st[0]);
    dopt_dp_free(&dp);
    free(grads);
    return dopt_comm_finish(c, 0) != 0;
}

int main(void) {
    pid_t kid;
    int status = 0, mine;
    if (pipe(port_pipe) != 0) return 1;
    fflush(stdout);
    kid = fork();
    if (kid < 0) return 1;
    if (kid == 0) _exit(run_rank(1));
    mine = run_rank(0);
    if (waitpid(kid, &status, 0) != kid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) mine = 1;
    if (mine) fprintf(stderr, "bench_verdict: a rank failed\n");
    return mine;
}
