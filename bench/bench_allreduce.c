/* bench_allreduce — distopt's allreduce beside MPI_Allreduce, in the same MPI job.

   Launch with mpirun (bench/run_allreduce.sh does, twice: Open MPI's default transports, then
   Open MPI forced onto TCP):

       mpirun -np 2 build/bench_allreduce [RAW_NAME [BACKENDS]]
       DOPT_RANK=r DOPT_WORLD_SIZE=n DOPT_MASTER_ADDR=a DOPT_MASTER_PORT=p build/bench_allreduce --from-env

   RAW_NAME    name printed for plain MPI_Allreduce on MPI_COMM_WORLD (default mpi-raw; the TCP run
               says mpi-raw-tcp). Every other backend's ratio is against it.
   BACKENDS    comma-separated, default all: mpi (dopt-mpi: transport_mpi.h), mpi-check (the same
               with its mismatch check on), mpi-engine (dopt-mpi-engine: the engine over the MPI
               backend's point-to-point links), iallreduce (mpi-iallreduce: MPI_Iallreduce polled with
               MPI_Test, what a timeout on the MPI backend would cost), shm (dopt-shm), tcp
               (dopt-tcp), shm-engine (dopt-shm-engine: shm with every collective on the engine over
               its per-pair links instead of its direct collectives), shm-nb and tcp-nb (dopt-shm-nb, dopt-tcp-nb: the same transports with
               8 allreduces started with dopt_allreduce_start, then waited for; us is per
               allreduce, and blocking_ratio the time of the same 8 allreduces on the same 8
               buffers as blocking calls one after another, measured right after each
               repetition, over this one's: >= 1 when 8 in flight take no longer than 8 blocking
               calls), and two limits no allreduce can beat by much:
                 memcpy (limit-memcpy): every rank copies the buffer to another at the same
                   moment — an allreduce reads its input and writes its output at least once;
                 stream (limit-tcp-stream): every rank streams 2(N-1)/N of the buffer to the next
                   rank over a raw loopback TCP socket while receiving as much from the previous
                   one — what a ring allreduce must move, with no framing, reduction or protocol.

   For each size (4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB of f32, SUM in place) and backend: a
   warm-up, then a call count found to last at least 20 ms, then REPS repetitions of that many
   calls. The repetitions of all backends alternate (raw, b1, b2, raw, b1, ...), so each backend's
   repetition is paired with a raw MPI one measured just before it on a shared, noisy machine.
   A repetition's time is the slowest rank's, between barriers. One line per backend and size:

       bench allreduce backend=B bytes=N us=MEDIAN us_min=MIN us_max=MAX busbw_GBps=X ratio=R
                       [limit_ratio=L] [in_flight=8 blocking_ratio=Q]

   us: microseconds per call; busbw = 2(N-1)/N · bytes / time (the traffic a bandwidth-optimal
   allreduce puts on each rank's link, comparable across world sizes); ratio: the median over the
   paired repetitions of raw time / backend time, i.e. backend busbw / raw MPI busbw (1 for raw);
   limit_ratio (dopt-shm beside limit-memcpy, dopt-tcp beside limit-tcp-stream, when both run):
   the median of limit time / backend time over the same paired repetitions.
   The shm backend's job name is agreed through MPI_Bcast, the TCP port picked by rank 0 and
   shared the same way; ranks and world size come from MPI.

   --from-env: no MPI at all (MPI is never initialised), for ranks started one by one by any
   launcher (bench/cluster.sh starts them on simulated hosts): dopt-tcp alone, joined through
   dopt_tcp_create_from_env (TCP's ENVIRONMENT), and timed through that communicator's own
   barrier and max-allreduce; its ratio is 1. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_mpi.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define REPS 9
#define MAX_BACKENDS 10
#define MIN_REP_SECONDS 0.02

typedef enum bench_kind { BENCH_RAW, BENCH_IALLREDUCE, BENCH_DOPT, BENCH_DOPT_NB, BENCH_MEMCPY, BENCH_STREAM } bench_kind;

#define NB_IN_FLIGHT 8 /* the nonblocking backends keep this many allreduces in flight */

typedef struct bench_backend {
    const char *name;
    bench_kind kind;
    dopt_comm *comm; /* BENCH_DOPT */
    long calls;      /* per repetition, at the current size */
    int limit;       /* index of the limit this backend is held against, -1: none */
    double blocking[REPS]; /* BENCH_DOPT_NB: the same NB_IN_FLIGHT allreduces on the same buffers,
                              one blocking call after another, paired with seconds[] */
    double seconds[REPS];
    double ratio[REPS];
} bench_backend;

static int world_rank, world_size;
static dopt_comm *env_world; /* --from-env: the TCP communicator that also times; NULL: MPI times */
static float *copy_dst;      /* limit-memcpy's destination */
static int stream_next = -1, stream_prev = -1; /* limit-tcp-stream's sockets */
static char *stream_sink;    /* where the received stream lands */
static float *nb_bufs;       /* BENCH_DOPT_NB: NB_IN_FLIGHT buffers of the largest size */
static size_t nb_stride;     /* elements between two of them */
static int nb_one_by_one;    /* run BENCH_DOPT_NB's allreduces blocking, one after another */

static void die(const char *what, dopt_comm *c) {
    fprintf(stderr, "bench_allreduce rank %d: %s: %s\n", world_rank, what, c ? dopt_comm_detail(c) : "");
    if (env_world == NULL) MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

/* Errors only: a backend that cannot start says why before the job aborts. */
static void log_errors(void *user, dopt_log_level level, const char *message) {
    (void)user;
    if (level != DOPT_LOG_ERROR) return;
    if (world_rank < 0) /* --from-env, before the communicator exists: the message names the rank */
        fprintf(stderr, "bench_allreduce: %s\n", message);
    else
        fprintf(stderr, "bench_allreduce rank %d: %s\n", world_rank, message);
}

/* limit-tcp-stream: send `bytes` to the next rank while receiving as many from the previous. */
static void stream_ring(const char *src, size_t bytes) {
    size_t sent = 0, got = 0;
    while (sent < bytes || got < bytes) {
        struct pollfd p[2];
        p[0].fd = stream_next, p[0].events = sent < bytes ? POLLOUT : 0;
        p[1].fd = stream_prev, p[1].events = got < bytes ? POLLIN : 0;
        if (poll(p, 2, -1) < 0 && errno != EINTR) die("poll", NULL);
        if (p[0].revents & (POLLOUT | POLLERR | POLLHUP)) {
            ssize_t k = send(stream_next, src + sent, bytes - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (k > 0) sent += (size_t)k;
            else if (k < 0 && errno != EAGAIN && errno != EINTR) die("send", NULL);
        }
        if (p[1].revents & (POLLIN | POLLERR | POLLHUP)) {
            ssize_t k = recv(stream_prev, stream_sink + got, bytes - got, MSG_DONTWAIT);
            if (k > 0) got += (size_t)k;
            else if (k == 0 || (errno != EAGAIN && errno != EINTR)) die("recv", NULL);
        }
    }
}

static void run_calls(bench_backend *b, float *buf, size_t n, long calls) {
    long k;
    for (k = 0; k < calls; k++) {
        if (b->kind == BENCH_MEMCPY) {
            memcpy(copy_dst, buf, n * sizeof(float));
        } else if (b->kind == BENCH_STREAM) {
            stream_ring((const char *)buf, 2 * (world_size - 1) * (n * sizeof(float)) / (size_t)world_size);
        } else if (b->kind == BENCH_RAW) {
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        } else if (b->kind == BENCH_IALLREDUCE) {
            MPI_Request req;
            int done = 0;
            MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
            while (!done) MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        } else if (b->kind == BENCH_DOPT_NB && nb_one_by_one) { /* the blocking reference */
            int i;
            for (i = 0; i < NB_IN_FLIGHT; i++)
                if (dopt_allreduce(b->comm, nb_bufs + (size_t)i * nb_stride, n, DOPT_F32, DOPT_SUM) != DOPT_OK)
                    die("allreduce failed", b->comm);
        } else if (b->kind == BENCH_DOPT_NB) { /* NB_IN_FLIGHT started, then waited for */
            dopt_request req[NB_IN_FLIGHT];
            int i;
            for (i = 0; i < NB_IN_FLIGHT; i++)
                if (dopt_allreduce_start(b->comm, nb_bufs + (size_t)i * nb_stride, n, DOPT_F32, DOPT_SUM, &req[i]) != DOPT_OK)
                    die("allreduce_start failed", b->comm);
            for (i = 0; i < NB_IN_FLIGHT; i++)
                if (dopt_wait(&req[i]) != DOPT_OK) die("wait failed", b->comm);
        } else if (dopt_allreduce(b->comm, buf, n, DOPT_F32, DOPT_SUM) != DOPT_OK) {
            die("allreduce failed", b->comm);
        }
    }
}

static void world_barrier(void) {
    if (env_world == NULL)
        MPI_Barrier(MPI_COMM_WORLD);
    else if (dopt_barrier(env_world) != DOPT_OK)
        die("barrier failed", env_world);
}

static double world_max(double t) {
    if (env_world == NULL)
        MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    else if (dopt_allreduce(env_world, &t, 1, DOPT_F64, DOPT_MAX) != DOPT_OK)
        die("max of the times failed", env_world);
    return t;
}

static double now_seconds(void) {
    struct timespec ts;
    if (env_world == NULL) return MPI_Wtime();
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Seconds per call over `calls` calls, as the slowest rank saw it (the same value on every rank). */
static double time_calls(bench_backend *b, float *buf, size_t n, long calls) {
    double t0;
    world_barrier();
    t0 = now_seconds();
    run_calls(b, buf, n, calls);
    return world_max((now_seconds() - t0) / (double)calls / (b->kind == BENCH_DOPT_NB ? NB_IN_FLIGHT : 1));
}

/* Every rank takes the same decisions because time_calls agrees on the time. */
static long calibrate(bench_backend *b, float *buf, size_t n) {
    long calls = 1;
    run_calls(b, buf, n, 2); /* warm-up: connections, registration, first-touch */
    while (time_calls(b, buf, n, calls) * (double)calls * (b->kind == BENCH_DOPT_NB ? NB_IN_FLIGHT : 1) < MIN_REP_SECONDS)
        calls *= 2;
    return calls;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(const double *v, double *lo, double *hi) {
    double s[REPS];
    memcpy(s, v, sizeof s);
    qsort(s, REPS, sizeof *s, cmp_double);
    if (lo) *lo = s[0];
    if (hi) *hi = s[REPS - 1];
    return s[REPS / 2];
}

static void bench_size(bench_backend *bs, int nb, float *buf, size_t bytes) {
    size_t n = bytes / sizeof(float);
    double factor = 2.0 * (double)(world_size - 1) / (double)world_size;
    int b, r;
    for (b = 0; b < nb; b++) bs[b].calls = calibrate(&bs[b], buf, n);
    for (r = 0; r < REPS; r++)
        for (b = 0; b < nb; b++) {
            bs[b].seconds[r] = time_calls(&bs[b], buf, n, bs[b].calls);
            if (bs[b].kind != BENCH_DOPT_NB) continue;
            nb_one_by_one = 1;
            bs[b].blocking[r] = time_calls(&bs[b], buf, n, bs[b].calls);
            nb_one_by_one = 0;
        }
    for (b = 0; b < nb; b++) {
        double lo, hi, t = median(bs[b].seconds, &lo, &hi), limit[REPS];
        char extra[96] = "";
        size_t used = 0;
        for (r = 0; r < REPS; r++) bs[b].ratio[r] = bs[0].seconds[r] / bs[b].seconds[r];
        if (bs[b].limit >= 0) {
            for (r = 0; r < REPS; r++) limit[r] = bs[bs[b].limit].seconds[r] / bs[b].seconds[r];
            used += (size_t)snprintf(extra, sizeof extra, " limit_ratio=%.3f", median(limit, NULL, NULL));
        }
        if (bs[b].kind == BENCH_DOPT_NB) {
            for (r = 0; r < REPS; r++) limit[r] = bs[b].blocking[r] / bs[b].seconds[r];
            snprintf(extra + used, sizeof extra - used, " in_flight=%d blocking_ratio=%.3f", NB_IN_FLIGHT,
                     median(limit, NULL, NULL));
        }
        if (world_rank == 0)
            printf("bench allreduce backend=%s bytes=%zu us=%.1f us_min=%.1f us_max=%.1f busbw_GBps=%.3f ratio=%.3f%s\n",
                   bs[b].name, bytes, t * 1e6, lo * 1e6, hi * 1e6, factor * (double)bytes / t / 1e9,
                   median(bs[b].ratio, NULL, NULL), extra);
    }
    fflush(stdout);
}

static int wanted(const char *list, const char *name) {
    size_t len = strlen(name);
    const char *p = list;
    if (list == NULL) return 1;
    while ((p = strstr(p, name)) != NULL) {
        if ((p == list || p[-1] == ',') && (p[len] == ',' || p[len] == '\0')) return 1;
        p += len;
    }
    return 0;
}

static dopt_comm *create_mpi(int check, int engine) {
    dopt_mpi_config cfg;
    dopt_comm *c = NULL;
    memset(&cfg, 0, sizeof cfg);
    cfg.check = check ? 1 : -1;
    cfg.engine = engine;
    cfg.log_fn = log_errors;
    if (dopt_mpi_create(&c, &cfg) != DOPT_OK) die("dopt_mpi_create failed", NULL);
    return c;
}

/* Rank 0 names the job; MPI tells the others. */
static dopt_comm *create_shm(int engine) {
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    char name[64];
    snprintf(name, sizeof name, "bench-allreduce-%ld", (long)getpid());
    MPI_Bcast(name, (int)sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
    memset(&cfg, 0, sizeof cfg);
    cfg.name = name;
    cfg.rank = world_rank;
    cfg.size = world_size;
    cfg.engine = engine;
    cfg.log_fn = log_errors;
    if (dopt_shm_create(&c, &cfg) != DOPT_OK) die("dopt_shm_create failed", NULL);
    return c;
}

/* Rank 0 listens on a port the kernel picks and tells the others through MPI. */
static void share_port(void *user, int port) {
    (void)user;
    MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
}

static dopt_comm *create_tcp(void) {
    dopt_tcp_config cfg;
    dopt_comm *c = NULL;
    memset(&cfg, 0, sizeof cfg);
    cfg.rank = world_rank;
    cfg.world_size = world_size;
    cfg.log_fn = log_errors;
    if (world_rank == 0)
        cfg.on_listen = share_port;
    else
        MPI_Bcast(&cfg.master_port, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (dopt_tcp_create(&c, &cfg) != DOPT_OK) die("dopt_tcp_create failed", NULL);
    return c;
}

/* limit-tcp-stream's ring of raw loopback connections: each rank listens on a port the kernel
   picks, the ports go round through MPI, each connects to the next and accepts the previous. */
static void open_stream_ring(size_t max_bytes) {
    struct sockaddr_in sa;
    socklen_t len = sizeof sa;
    int lfd = socket(AF_INET, SOCK_STREAM, 0), one = 1, *ports;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(lfd, 4) < 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &len) < 0)
        die("stream: listen", NULL);
    ports = (int *)calloc((size_t)world_size, sizeof(int));
    ports[world_rank] = ntohs(sa.sin_port);
    MPI_Allgather(MPI_IN_PLACE, 1, MPI_INT, ports, 1, MPI_INT, MPI_COMM_WORLD);
    stream_next = socket(AF_INET, SOCK_STREAM, 0);
    sa.sin_port = htons((uint16_t)ports[(world_rank + 1) % world_size]);
    if (stream_next < 0 || connect(stream_next, (struct sockaddr *)&sa, sizeof sa) < 0) die("stream: connect", NULL);
    stream_prev = accept(lfd, NULL, NULL);
    if (stream_prev < 0) die("stream: accept", NULL);
    setsockopt(stream_next, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    close(lfd);
    free(ports);
    stream_sink = (char *)malloc(max_bytes);
    if (stream_sink == NULL) die("out of memory", NULL);
}

/* --from-env: dopt-tcp is the only backend and the one that times. */
static int start_from_env(bench_backend *bs) {
    dopt_tcp_config base;
    const char *two_level;
    memset(&base, 0, sizeof base);
    base.log_fn = log_errors;
    world_rank = -1; /* until the environment says */
    if (dopt_tcp_create_from_env(&env_world, &base) != DOPT_OK) exit(1);
    world_rank = env_world->rank;
    world_size = env_world->size;
    two_level = getenv("DOPT_TWO_LEVEL");
    bs[0].name = two_level && strcmp(two_level, "off") == 0 ? "dopt-tcp-flat" : "dopt-tcp";
    bs[0].kind = BENCH_DOPT;
    bs[0].comm = env_world;
    return 1;
}

int main(int argc, char **argv) {
    static const size_t sizes[] = {4u << 10, 64u << 10, 1u << 20, 16u << 20, 64u << 20};
    const int from_env = argc > 1 && strcmp(argv[1], "--from-env") == 0;
    const char *raw_name = argc > 1 ? argv[1] : "mpi-raw";
    const char *list = argc > 2 ? argv[2] : NULL;
    bench_backend bs[MAX_BACKENDS];
    int nb = 0, provided, b;
    size_t k;
    float *buf;
    memset(bs, 0, sizeof bs);
    for (b = 0; b < MAX_BACKENDS; b++) bs[b].limit = -1;
    if (from_env) {
        nb = start_from_env(bs);
        list = ""; /* no other backend */
    } else {
        MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
        MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
        MPI_Comm_size(MPI_COMM_WORLD, &world_size);
        bs[nb].name = raw_name;
        bs[nb++].kind = BENCH_RAW;
    }
    if (wanted(list, "mpi")) {
        bs[nb].name = "dopt-mpi";
        bs[nb].kind = BENCH_DOPT;
        bs[nb++].comm = create_mpi(0, 0);
    }
    if (wanted(list, "mpi-check")) {
        bs[nb].name = "dopt-mpi-check";
        bs[nb].kind = BENCH_DOPT;
        bs[nb++].comm = create_mpi(1, 0);
    }
    if (wanted(list, "mpi-engine")) {
        bs[nb].name = "dopt-mpi-engine";
        bs[nb].kind = BENCH_DOPT;
        bs[nb++].comm = create_mpi(0, 1);
    }
    if (wanted(list, "iallreduce")) {
        bs[nb].name = "mpi-iallreduce";
        bs[nb++].kind = BENCH_IALLREDUCE;
    }
    if (wanted(list, "shm")) {
        bs[nb].name = "dopt-shm";
        bs[nb].kind = BENCH_DOPT;
        bs[nb++].comm = create_shm(0);
    }
    if (wanted(list, "shm-engine")) {
        bs[nb].name = "dopt-shm-engine";
        bs[nb].kind = BENCH_DOPT;
        bs[nb++].comm = create_shm(1);
    }
    if (wanted(list, "tcp")) {
        bs[nb].name = "dopt-tcp";
        bs[nb].kind = BENCH_DOPT;
        bs[nb++].comm = create_tcp();
    }
    if (wanted(list, "shm-nb") || wanted(list, "tcp-nb")) {
        nb_stride = sizes[sizeof sizes / sizeof sizes[0] - 1] / sizeof(float);
        nb_bufs = (float *)calloc(nb_stride * NB_IN_FLIGHT, sizeof(float));
        if (nb_bufs == NULL) die("out of memory", NULL);
    }
    if (wanted(list, "shm-nb")) {
        bs[nb].name = "dopt-shm-nb";
        bs[nb].kind = BENCH_DOPT_NB;
        bs[nb++].comm = create_shm(0);
    }
    if (wanted(list, "tcp-nb")) {
        bs[nb].name = "dopt-tcp-nb";
        bs[nb].kind = BENCH_DOPT_NB;
        bs[nb++].comm = create_tcp();
    }
    if (wanted(list, "memcpy")) {
        copy_dst = (float *)calloc(sizes[sizeof sizes / sizeof sizes[0] - 1] / sizeof(float), sizeof(float));
        if (copy_dst == NULL) die("out of memory", NULL);
        for (b = 0; b < nb; b++)
            if (!strcmp(bs[b].name, "dopt-shm")) bs[b].limit = nb;
        bs[nb].name = "limit-memcpy";
        bs[nb++].kind = BENCH_MEMCPY;
    }
    if (wanted(list, "stream")) {
        open_stream_ring(sizes[sizeof sizes / sizeof sizes[0] - 1]);
        for (b = 0; b < nb; b++)
            if (!strcmp(bs[b].name, "dopt-tcp")) bs[b].limit = nb;
        bs[nb].name = "limit-tcp-stream";
        bs[nb++].kind = BENCH_STREAM;
    }
    /* Zeros: the sums stay finite however many calls run, and cost the same as any value. */
    buf = (float *)calloc(sizes[sizeof sizes / sizeof sizes[0] - 1] / sizeof(float), sizeof(float));
    if (buf == NULL) die("out of memory", NULL);
    if (world_rank == 0) {
        printf("bench allreduce: %d ranks, f32 sum in place, %d repetitions of >= %.0f ms per size and backend\n",
               world_size, REPS, MIN_REP_SECONDS * 1e3);
        fflush(stdout);
    }
    for (k = 0; k < sizeof sizes / sizeof sizes[0]; k++) bench_size(bs, nb, buf, sizes[k]);
    for (b = 0; b < nb; b++) dopt_comm_destroy(bs[b].comm);
    if (stream_next >= 0) close(stream_next), close(stream_prev);
    free(stream_sink);
    free(copy_dst);
    free(nb_bufs);
    free(buf);
    if (!from_env) MPI_Finalize();
    return 0;
}
