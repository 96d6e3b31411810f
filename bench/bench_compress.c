/* bench_compress — every compressor of compress.h, single thread: encode and
   decode-and-accumulate throughput beside the read bandwidth this process measures in the same
   run, the encoded bytes per element, and the end-to-end compressed allreduce over TCP.

   Sizes: a 64 MiB gradient (16 Mi floats, in 16 segments of 1 Mi like the large layers of a
   model) and a cache-resident 256 KiB one (64 Ki floats, one segment). "read" streams the
   gradient once (an integer sum of its words); each codec line gives Gelem/s, then the ratio of
   its time to read's time (ratio 1.0 = as fast as reading the gradient once). Every figure is the
   median of 9 repetitions after a warm-up, each repetition paired with a read run right before
   it; [min, max] follow. Encode is the whole encoder (ternary: statistics, clip, ternarize, pack);
   decode is validation plus accumulation into a float buffer. Decode's bandwidth bound is a
   read-modify-write of that buffer, not a read: "to y += c" is decode's paired ratio to the
   loop y[i] += c over the same buffer (1.0 = at that bound).

   Then two processes join a TCP world and allreduce a 64 MiB gradient: dopt_allreduce (f32
   mean) against dopt_compress_allreduce (ternary), alternating, median of 5. First on loopback,
   where the link is as fast as memory (encode and decode alone touch ~3x 64 MiB, so ternary
   cannot win by much there); then over the setting compression is for, a slow link: as root
   with iproute2, each rank runs in its own network namespace (created for the run, deleted on
   every path), the two joined by a veth pair rate-limited to 1 Gbit/s each way with tc tbf.
   Without root or ip/tc that part prints that it was skipped.

   Last line: "bench compress tern_encode_Gelems=<x> tern_allreduce_speedup=<y>" (64 MiB); y is
   the rate-limited link's speedup when it ran, loopback's otherwise (the line before says
   which). Goals (issue 5): ternary encode >= 2.0 Gelem/s at 64 MiB, decode >= 0.75 of its
   bandwidth bound, allreduce >= 5x faster than fp32 over the slow link.
   Run: OPENBLAS_NUM_THREADS=1 build/bench_compress   (make bench does this) */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../compress.h"
#include "../transport_tcp.h"
#include "bench_pair.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct bench_state {
    dopt_compressor cz;
    float *g, *acc;
    size_t n;
    dopt_buf gb, ab;
    unsigned char *msg;
    size_t bytes;
    volatile uint32_t sink;
} bench_state;


static void read_words(void *ctx) {
    bench_state *b = (bench_state *)ctx;
    b->sink = bench_read_words(b->g, b->n * sizeof(float));
}

/* The bandwidth bound of decode-and-accumulate: the same read-modify-write of the float
   accumulator with no decoding (decode also reads the message, 1/16 of that for ternary). */
static void rmw_accum(void *ctx) {
    bench_state *b = (bench_state *)ctx;
    float *y = b->acc;
    size_t i, j, n = b->n - b->n % 16;
    for (i = 0; i < n; i += 16) /* sixteen lanes: vectorized at -O2 (like bench_read_words) */
        for (j = 0; j < 16; j++) y[i + j] += 0.5f;
}

static void do_encode(void *ctx) {
    bench_state *b = (bench_state *)ctx;
    if (dopt_compress_encode(&b->cz, &b->gb, b->msg, dopt_compress_bound(&b->cz), &b->bytes) != DOPT_OK) exit(2);
}

static void do_decode(void *ctx) {
    bench_state *b = (bench_state *)ctx;
    if (dopt_compress_decode(&b->cz, b->msg, b->bytes, 0.5f, &b->ab) != DOPT_OK) exit(3);
}

/* Gelem/s of fn (median, min, max), its paired ratio to the read limit, and the read GB/s. */
static void time_pair(bench_fn fn, bench_state *b, double gel[3], double ratio[3], double *read_gbs) {
    double t[3], tr[3];
    bench_time_pair(fn, read_words, b, t, tr, ratio, 1.0);
    gel[0] = (double)b->n / t[0] * 1e-9;
    gel[1] = (double)b->n / t[2] * 1e-9;
    gel[2] = (double)b->n / t[1] * 1e-9;
    *read_gbs = 4.0 * (double)b->n / tr[0] * 1e-9;
}

static void fill(float *g, size_t n) {
    uint64_t s = 1;
    size_t i;
    for (i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        g[i] = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5) * 1e-2f;
    }
}

/* ------------------------------------------------------------------ single-thread codecs */

static double bench_size(size_t n, size_t seg, int print_header) {
    static const dopt_codec codecs[7] = {DOPT_CODEC_TERNARY, DOPT_CODEC_QSGD, DOPT_CODEC_TOPK, DOPT_CODEC_SIGN,
                                         DOPT_CODEC_FP16,    DOPT_CODEC_BF16, DOPT_CODEC_FP32};
    size_t nsegs = n / seg, i;
    dopt_segment *segs = (dopt_segment *)malloc(nsegs * sizeof *segs);
    bench_state b;
    double tern_encode = 0;
    int c;
    memset(&b, 0, sizeof b);
    b.n = n;
    b.g = (float *)malloc(n * sizeof(float));
    b.acc = (float *)malloc(n * sizeof(float));
    fill(b.g, n);
    memset(b.acc, 0, n * sizeof(float));
    for (i = 0; i < nsegs; i++) {
        segs[i].offset = i * seg;
        segs[i].count = seg;
        segs[i].name = NULL;
    }
    b.gb = dopt_buf_flat(b.g, n, segs, nsegs);
    b.ab = dopt_buf_flat(b.acc, n, segs, nsegs);
    if (print_header)
        printf("# single thread; Gelem/s median [min, max] of %d; ratio = read time / codec time, paired\n", BENCH_REPS);
    for (c = 0; c < 7; c++) {
        dopt_compressor_config cfg;
        double ge[3], re[3], gd[3], rd[3], read_gbs, t[3], tr[3], rm[3];
        memset(&cfg, 0, sizeof cfg);
        cfg.codec = codecs[c];
        cfg.seed = 42;
        cfg.error_feedback = DOPT_EF_OFF; /* the codec alone; EF adds one pass over p and e */
        if (dopt_compressor_init(&b.cz, &cfg, segs, nsegs) != DOPT_OK) exit(1);
        b.msg = (unsigned char *)malloc(dopt_compress_bound(&b.cz));
        time_pair(do_encode, &b, ge, re, &read_gbs);
        time_pair(do_decode, &b, gd, rd, &read_gbs);
        bench_time_pair(do_decode, rmw_accum, &b, t, tr, rm, 1.0);
        printf("n=%-9zu %-8s %6.2f bytes/elem  encode %6.3f Gelem/s [%.3f, %.3f] ratio %.2f  "
               "decode %6.3f Gelem/s [%.3f, %.3f] ratio %.2f (to y += c: %.2f)  read %6.2f GB/s\n",
               n, dopt_codec_name(codecs[c]), (double)dopt_compress_bound(&b.cz) / (double)n, ge[0], ge[1], ge[2], re[0],
               gd[0], gd[1], gd[2], rd[0], rm[0], read_gbs);
        if (codecs[c] == DOPT_CODEC_TERNARY) tern_encode = ge[0];
        free(b.msg);
        dopt_compressor_free(&b.cz);
    }
    free(b.g);
    free(b.acc);
    free(segs);
    return tern_encode;
}

/* ------------------------------------------------------------------ TCP allreduce, 2 ranks */

#define AR_N ((size_t)16 << 20)
#define AR_SEG ((size_t)1 << 20)
#define AR_REPS 5

/* Where the two ranks run: loopback in this namespace, or each rank in its own network
   namespace, the two joined by a veth pair whose both ends are rate-limited with tc. */
typedef struct ar_world {
    int port_pipe[2];
    int result_pipe[2];
    const char *netns[2];     /* NULL: loopback */
    const char *addr[2];      /* the ranks' addresses in their namespaces */
    const char *label;
} ar_world;

static void on_listen(void *user, int port) {
    ar_world *w = (ar_world *)user;
    if (write(w->port_pipe[1], &port, sizeof port) != (ssize_t)sizeof port) exit(4);
}

/* Moves this process into the named network namespace (what `ip netns exec` does first). */
static int enter_netns(const char *name) {
    char path[256];
    int fd, rc;
    snprintf(path, sizeof path, "/var/run/netns/%s", name);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    rc = setns(fd, CLONE_NEWNET);
    close(fd);
    return rc;
}

static void ar_rank(int rank, ar_world *w) {
    dopt_tcp_config cfg;
    dopt_comm *c = NULL;
    dopt_compressor cz;
    dopt_compressor_config zc;
    dopt_segment *segs = (dopt_segment *)malloc((AR_N / AR_SEG) * sizeof *segs);
    float *g = (float *)malloc(AR_N * sizeof(float));
    double tp[AR_REPS], tc[AR_REPS], res[2], m[3];
    size_t i;
    int r;
    if (w->netns[0] != NULL && enter_netns(w->netns[rank]) != 0) exit(11);
    memset(&cfg, 0, sizeof cfg);
    cfg.rank = rank;
    cfg.world_size = 2;
    cfg.token = "bench-compress";
    cfg.timeout_ms = 60000;
    if (w->netns[0] != NULL) {
        cfg.master_addr = w->addr[0];
        cfg.bind_addr = w->addr[rank];
    }
    if (rank == 0) {
        cfg.on_listen = on_listen;
        cfg.on_listen_user = w;
    } else if (read(w->port_pipe[0], &cfg.master_port, sizeof cfg.master_port) != (ssize_t)sizeof cfg.master_port) {
        exit(5);
    }
    if (dopt_tcp_create(&c, &cfg) != DOPT_OK) exit(6);
    for (i = 0; i < AR_N / AR_SEG; i++) {
        segs[i].offset = i * AR_SEG;
        segs[i].count = AR_SEG;
        segs[i].name = NULL;
    }
    memset(&zc, 0, sizeof zc);
    zc.seed = 42;
    if (dopt_compressor_init(&cz, &zc, segs, AR_N / AR_SEG) != DOPT_OK) exit(7);
    for (r = -1; r < AR_REPS; r++) { /* r = -1: warm-up (connections, gather buffer, page faults) */
        double t0;
        fill(g, AR_N);
        dopt_barrier(c);
        t0 = bench_now_s();
        if (dopt_allreduce(c, g, AR_N, DOPT_F32, DOPT_MEAN) != DOPT_OK) exit(8);
        if (r >= 0) tp[r] = bench_now_s() - t0;
        fill(g, AR_N);
        dopt_barrier(c);
        t0 = bench_now_s();
        if (dopt_compress_allreduce(&cz, c, g, AR_N) != DOPT_OK) exit(9);
        if (r >= 0) tc[r] = bench_now_s() - t0;
    }
    if (rank == 0) {
        bench_median_min_max(tp, AR_REPS, m);
        res[0] = m[0];
        printf("allreduce 64 MiB TCP 2 ranks, %s: fp32 dopt_allreduce %.1f ms [%.1f, %.1f] (%.2f Gbit/s each way)",
               w->label, m[0] * 1e3, m[1] * 1e3, m[2] * 1e3, 8.0 * (double)(AR_N * sizeof(float)) / m[0] * 1e-9);
        bench_median_min_max(tc, AR_REPS, m);
        res[1] = m[0];
        printf("  ternary dopt_compress_allreduce %.1f ms [%.1f, %.1f]  speedup %.2f\n", m[0] * 1e3, m[1] * 1e3,
               m[2] * 1e3, res[0] / res[1]);
        fflush(stdout);
        if (write(w->result_pipe[1], res, sizeof res) != (ssize_t)sizeof res) exit(10);
    }
    dopt_compressor_free(&cz);
    dopt_comm_destroy(c);
    free(g);
    free(segs);
}

/* Runs both ranks (median of AR_REPS each, alternating fp32 and ternary); returns fp32 time /
   ternary time, 0 when a rank failed. */
static double bench_allreduce(ar_world *w) {
    pid_t pids[2];
    double res[2] = {0, 0};
    int r, q, ok = 1, status;
    if (pipe(w->port_pipe) != 0 || pipe(w->result_pipe) != 0) return 0;
    fflush(stdout);
    for (r = 0; r < 2; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            /* only rank 0 writes the port: if it dies first, rank 1's read sees the end */
            close(w->port_pipe[r == 0 ? 0 : 1]);
            ar_rank(r, w);
            fflush(stdout);
            _exit(0);
        }
    }
    close(w->port_pipe[0]);
    close(w->port_pipe[1]);
    close(w->result_pipe[1]);
    for (r = 0; r < 2; r++) {
        status = -1;
        if (pids[r] < 0) {
            ok = 0;
            continue;
        }
        while (waitpid(pids[r], &status, 0) < 0) {
            if (errno != EINTR) break;
            for (q = 0; q < 2; q++) /* interrupted: stop both ranks, the caller cleans up */
                if (pids[q] > 0) kill(pids[q], SIGKILL);
        }
        ok = ok && status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    if (!ok || read(w->result_pipe[0], res, sizeof res) != (ssize_t)sizeof res || res[1] <= 0) res[0] = 0;
    close(w->result_pipe[0]);
    return res[1] > 0 ? res[0] / res[1] : 0;
}

/* ------------------------------------------------------------------ the rate-limited link */

/* Two namespaces and a veth pair, named after this process (unique, at most 15 characters),
   both directions shaped to LINK_RATE by a token bucket. Torn down on every path: deleting a
   namespace deletes its end of the pair, and with it the pair. */
#define LINK_RATE "1gbit"
#define LINK_RATE_TEXT "1 Gbit/s"

static char ns_name[2][32], veth_name[2][32];

static int run_quiet(const char *fmt, ...) {
    char cmd[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    strncat(cmd, " >/dev/null 2>&1", sizeof cmd - strlen(cmd) - 1);
    return system(cmd);
}

static void link_down(void) {
    int r;
    for (r = 0; r < 2; r++)
        if (ns_name[r][0]) run_quiet("ip netns del %s", ns_name[r]);
}

static volatile sig_atomic_t got_signal;

static void on_signal(int sig) { got_signal = sig; /* waitpid returns EINTR: ranks killed, link torn down */ }

static int link_up(void) {
    int r;
    for (r = 0; r < 2; r++) {
        snprintf(ns_name[r], sizeof ns_name[r], "dopt_bc%ld%c", (long)getpid(), 'a' + r);
        snprintf(veth_name[r], sizeof veth_name[r], "dbc%ld%c", (long)getpid() % 10000000L, 'a' + r);
        if (run_quiet("ip netns add %s", ns_name[r]) != 0) return -1;
    }
    if (run_quiet("ip link add %s netns %s type veth peer name %s netns %s", veth_name[0], ns_name[0], veth_name[1],
                  ns_name[1]) != 0)
        return -1;
    for (r = 0; r < 2; r++)
        if (run_quiet("ip -n %s addr add 10.77.0.%d/24 dev %s", ns_name[r], r + 1, veth_name[r]) != 0 ||
            run_quiet("ip -n %s link set %s up", ns_name[r], veth_name[r]) != 0 ||
            run_quiet("ip -n %s link set lo up", ns_name[r]) != 0 ||
            run_quiet("tc -n %s qdisc add dev %s root tbf rate %s burst 1mb latency 50ms", ns_name[r], veth_name[r],
                      LINK_RATE) != 0)
            return -1;
    return 0;
}

static int have_tool(const char *name) { return run_quiet("command -v %s", name) == 0; }

/* The ternary/fp32 speedup over the rate-limited link, or 0 when it was skipped (reason
   printed). */
static double bench_allreduce_link(void) {
    static const char *addr[2] = {"10.77.0.1", "10.77.0.2"};
    struct sigaction sa, old[3];
    static const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
    ar_world w;
    double speedup = 0;
    int i;
    if (geteuid() != 0 || !have_tool("ip") || !have_tool("tc")) {
        printf("# rate-limited link: skipped (needs root and iproute2's ip and tc)\n");
        return 0;
    }
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal; /* no SA_RESTART: waitpid returns, cleanup runs */
    sigemptyset(&sa.sa_mask);
    for (i = 0; i < 3; i++) sigaction(sigs[i], &sa, &old[i]);
    if (link_up() != 0) {
        printf("# rate-limited link: skipped (could not create the namespaces, veth pair or tc qdisc)\n");
    } else {
        memset(&w, 0, sizeof w);
        w.netns[0] = ns_name[0];
        w.netns[1] = ns_name[1];
        w.addr[0] = addr[0];
        w.addr[1] = addr[1];
        w.label = "two network namespaces, veth limited to " LINK_RATE_TEXT " each way (tc tbf)";
        speedup = bench_allreduce(&w);
        if (speedup <= 0) printf("# rate-limited link: a rank failed\n");
    }
    link_down();
    for (i = 0; i < 3; i++) sigaction(sigs[i], &old[i], NULL);
    if (got_signal) raise(got_signal); /* after the cleanup, die of it as we would have */
    return speedup;
}

int main(void) {
    double tern, speedup, link;
    ar_world w;
    tern = bench_size(AR_N, AR_SEG, 1);
    (void)bench_size((size_t)64 << 10, (size_t)64 << 10, 0);
    memset(&w, 0, sizeof w);
    w.label = "loopback";
    speedup = bench_allreduce(&w);
    link = bench_allreduce_link();
    if (link > 0)
        printf("# tern_allreduce_speedup below: the " LINK_RATE_TEXT " link (loopback: %.2f)\n", speedup);
    else
        printf("# tern_allreduce_speedup below: loopback (the rate-limited link did not run)\n");
    printf("bench compress tern_encode_Gelems=%.2f tern_allreduce_speedup=%.2f\n", tern, link > 0 ? link : speedup);
    return 0;
}
