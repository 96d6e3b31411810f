/* One rank of tests/check_keepalive.sh's jobs: a host that goes silent (its link cut, then its rank
   killed, so that no FIN or RST ever leaves it) and what the survivors see. Started from DOPT_*
   variables, one rank per simulated host. Every rank allreduces once, prints "ready", then:
     silent_host idle S     the survivors stay idle S ms, then allreduce 16 floats;
     silent_host waiting    the survivors allreduce 1 MiB at once (a ring: the silent host's next
                            rank waits for it on a link that has nothing of its own to send).
   The rank to be silenced (DOPT_SILENT_RANK, default the last) sleeps until it is killed. Each
   survivor prints one line, "silent_host: rank R: status S (name) after T ms at W: DETAIL" (T: in
   the allreduce; W: the wall clock when it returned, ms since the epoch), and exits 0
   whatever the status (the script judges it). With DOPT_DEAD_AFTER_MS, a survivor also prints when
   its heartbeat gave up on the silent rank (log_line). */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_tcp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Log lines to stderr; the heartbeat's verdict on a silent peer (DOPT_DEAD_AFTER_MS) also to
   stdout with the wall clock, "silent_host: rank R: heard at W: DETAIL", for the script's times. */
static int my_rank = -1;

static void log_line(void *user, dopt_log_level level, const char *message) {
    struct timespec wall;
    (void)user;
    fprintf(stderr, "%c %s\n", "EWID"[level], message);
    if (strstr(message, "not heard from") == NULL) return;
    clock_gettime(CLOCK_REALTIME, &wall);
    printf("silent_host: rank %d: heard at %lld: %s\n", my_rank, (long long)wall.tv_sec * 1000 + wall.tv_nsec / 1000000,
           message);
    fflush(stdout);
}

int main(int argc, char **argv) {
    static float big[1 << 18];
    float small[16] = {0};
    dopt_comm *c = NULL;
    dopt_status s;
    const char *silent_env = getenv("DOPT_SILENT_RANK");
    int idle = argc > 1 && strcmp(argv[1], "idle") == 0, silent;
    long idle_ms = argc > 2 ? atol(argv[2]) : 6000;
    double t0;
    struct timespec wall;
    dopt_tcp_config base;
    if (argc < 2 || (!idle && strcmp(argv[1], "waiting") != 0)) {
        fprintf(stderr, "usage: silent_host idle MS | silent_host waiting\n");
        return 2;
    }
    memset(&base, 0, sizeof base);
    base.log_fn = log_line;
    if (dopt_tcp_create_from_env(&c, &base) != DOPT_OK) return 1;
    my_rank = c->rank;
    silent = silent_env ? atoi(silent_env) : c->size - 1;
    if ((s = dopt_allreduce(c, small, 16, DOPT_F32, DOPT_SUM)) != DOPT_OK) {
        fprintf(stderr, "silent_host: rank %d: the first allreduce failed: %s\n", c->rank, dopt_comm_detail(c));
        return 1;
    }
    printf("silent_host: rank %d: ready\n", c->rank);
    fflush(stdout);
    if (c->rank == silent)
        for (;;) pause(); /* until killed */
    if (idle) {
        struct timespec ts = {idle_ms / 1000, (idle_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    t0 = dopt__now_ms();
    s = idle ? dopt_allreduce(c, small, 16, DOPT_F32, DOPT_SUM) : dopt_allreduce(c, big, 1 << 18, DOPT_F32, DOPT_SUM);
    clock_gettime(CLOCK_REALTIME, &wall);
    printf("silent_host: rank %d: status %d (%s) after %.0f ms at %lld: %s\n", c->rank, (int)s, dopt_status_str(s),
           dopt__now_ms() - t0, (long long)wall.tv_sec * 1000 + wall.tv_nsec / 1000000, dopt_comm_detail(c));
    fflush(stdout);
    dopt_comm_destroy(c);
    return 0;
}
