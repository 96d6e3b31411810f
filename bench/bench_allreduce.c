/* bench_allreduce — distopt's allreduce beside MPI_Allreduce, in the same MPI job.

   Launch with mpirun (bench/run_allreduce.sh does, twice: Open MPI's default transports, then
   Open MPI forced onto TCP):

       mpirun -np 2 build/bench_allreduce [RAW_NAME [BACKENDS]]
       DOPT_RANK=r DOPT_WORLD_SIZE=n DOPT_MASTER_ADDR=a DOPT_MASTER_PORT=p build/bench_allreduce --from-env

   RAW_NAME    name printed for plain MPI_Allreduce on MPI_COMM_WORLD (default mpi-raw; the TCP run
               says mpi-raw-tcp). Every other backend's ratio is against it.
   BACKENDS    comma-separated, default all: mpi (dopt-mpi: transport_mpi.h), mpi-check (the same
               with its mismatch check on), iallreduce (mpi-iallreduce: MPI_Iallreduce polled with
               MPI_Test, what a timeout on the MPI backend would cost), shm (dopt-shm), tcp
               (dopt-tcp). shm and tcp are there when their headers are in the tree.

   For each size (4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB of f32, SUM in place) and backend: a
   warm-up, then a call count found to last at least 20 ms, then REPS repetitions of that many
   calls. The repetitions of all backends alternate (raw, b1, b2, raw, b1, ...), so each backend's
   repetition is paired with a raw MPI one measured just before it on a shared, noisy machine.
   A repetition's time is the slowest rank's, between barriers. One line per backend and size:

       bench allreduce backend=B bytes=N us=MEDIAN us_min=MIN us_max=MAX busbw_GBps=X ratio=R

   us: microseconds per call; busbw = 2(N-1)/N · bytes / time (the traffic a bandwidth-optimal
   allreduce puts on each rank's link, comparable across world sizes); ratio: the median over the
   paired repetitions of raw time / backend time, i.e. backend busbw / raw MPI busbw (1 for raw).
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

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define REPS 9
#define MAX_BACKENDS 8
#define MIN_REP_SECONDS 0.02

typedef enum bench_kind { BENCH_RAW, BENCH_IALLREDUCE, BENCH_DOPT } bench_kind;

typedef struct bench_backend {
    const char *name;
    bench_kind kind;
    dopt_comm *comm; /* BENCH_DOPT */
    long calls;      /* per repetition, at the current size */
    double seconds[REPS];
    double ratio[REPS];
} bench_backend;

static int world_rank, world_size;
static dopt_comm *env_world; /* --from-env: the TCP communicator that also times; NULL: MPI times */

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

static void run_calls(bench_backend *b, float *buf, size_t n, long calls) {
    long k;
    for (k = 0; k < calls; k++) {
        if (b->kind == BENCH_RAW) {
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        } else if (b->kind == BENCH_IALLREDUCE) {
            MPI_Request req;
            int done = 0;
            MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
            while (!done) MPI_Test(&req, &done, MPI_STATUS_IGNORE);
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
    return world_max((now_seconds() - t0) / (double)calls);
}

/* Every rank takes the same decisions because time_calls agrees on the time. */
static long calibrate(bench_backend *b, float *buf, size_t n) {
    long calls = 1;
    run_calls(b, buf, n, 2); /* warm-up: connections, registration, first-touch */
    while (time_calls(b, buf, n, calls) * (double)calls < MIN_REP_SECONDS) calls *= 2;
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
        for (b = 0; b < nb; b++) bs[b].seconds[r] = time_calls(&bs[b], buf, n, bs[b].calls);
    for (b = 0; b < nb; b++) {
        double lo, hi, t = median(bs[b].seconds, &lo, &hi);
        for (r = 0; r < REPS; r++) bs[b].ratio[r] = bs[0].seconds[r] / bs[b].seconds[r];
        if (world_rank == 0)
            printf("bench allreduce backend=%s bytes=%zu us=%.1f us_min=%.1f us_max=%.1f busbw_GBps=%.3f ratio=%.3f\n",
                   bs[b].name, bytes, t * 1e6, lo * 1e6, hi * 1e6, factor * (double)bytes / t / 1e9,
                   median(bs[b].ratio, NULL, NULL));
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

static dopt_comm *create_mpi(int check) {
    dopt_mpi_config cfg;
    dopt_comm *c = NULL;
    memset(&cfg, 0, sizeof cfg);
    cfg.check = check ? 1 : -1;
    cfg.log_fn = log_errors;
    if (dopt_mpi_create(&c, &cfg) != DOPT_OK) die("dopt_mpi_create failed", NULL);
    return c;
}

/* Rank 0 names the job; MPI tells the others. */
static dopt_comm *create_shm(void) {
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    char name[64];
    snprintf(name, sizeof name, "bench-allreduce-%ld", (long)getpid());
    MPI_Bcast(name, (int)sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
    memset(&cfg, 0, sizeof cfg);
    cfg.name = name;
    cfg.rank = world_rank;
    cfg.size = world_size;
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

/* --from-env: dopt-tcp is the only backend and the one that times. */
static int start_from_env(bench_backend *bs) {
    dopt_tcp_config base;
    memset(&base, 0, sizeof base);
    base.log_fn = log_errors;
    world_rank = -1; /* until the environment says */
    if (dopt_tcp_create_from_env(&env_world, &base) != DOPT_OK) exit(1);
    world_rank = env_world->rank;
    world_size = env_world->size;
    bs[0].name = "dopt-tcp";
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
        bs[nb++].comm = create_mpi(0);
    }
    if (wanted(list, "mpi-check")) {
        bs[nb].name = "dopt-mpi-check";
        bs[nb].kind = BENCH_DOPT;
        bs[nb++].comm = create_mpi(1);
    }
    if (wanted(list, "iallreduce")) {
        bs[nb].name = "mpi-iallreduce";
        bs[nb++].kind = BENCH_IALLREDUCE;
    }
    if (wanted(list, "shm")) {
        bs[nb].name = "dopt-shm";
        bs[nb].kind = BENCH_DOPT;
        bs[nb++].comm = create_shm();
    }
    if (wanted(list, "tcp")) {
        bs[nb].name = "dopt-tcp";
        bs[nb].kind = BENCH_DOPT;
        bs[nb++].comm = create_tcp();
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
    free(buf);
    if (!from_env) MPI_Finalize();
    return 0;
}
