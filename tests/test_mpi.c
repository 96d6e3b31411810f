/* Tests of transport_mpi.h, run by tests/run.sh as
       mpirun --allow-run-as-root --oversubscribe -np 2 (and -np 3) build/test_mpi

   dtest's DTEST_MAIN forks a process per test, which MPI forbids after MPI_Init, so this file has
   its own main: the tests run in order in one process on every rank. A test's checks report and
   carry on (so every rank keeps calling the same collectives); at the end of each test the ranks
   add up their failures, and rank 0 prints "ok   name" or "FAIL name". Checks that cannot carry
   on (dtest's DT_* and conformance.h's) end the rank with status 1, which ends the job.
   Every rank prints the "dtest-summary" line; tests/run.sh counts the first.

   The first test creates the communicator that initialises MPI; the last destroys it, which
   finalizes MPI. The tests in between find MPI running when they create their communicators, as
   in a program that initialised MPI itself (distopt must then neither initialise nor finalize it).

   DOPT_MPI_MAX_COUNT is lowered to 1000 so that communicators created with the default limit cut
   every transfer above 1000 elements (or bytes) into pieces, as they would above INT_MAX. */
#define DOPT_MPI_MAX_COUNT 1000
#define DOPT_MALLOC(sz) mpi_test_malloc(sz)
#define DOPT_FREE(p) free(p)
#include <stdlib.h>
static long mpi_test_allocs; /* the allocator is counted: steady-state calls must not allocate */
static void *mpi_test_malloc(size_t n) {
    mpi_test_allocs++;
    return malloc(n);
}
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_mpi.h"
#include "../compress.h"
#include "../localsgd.h"

#include "dtest.h" /* its checks; this file has its own main, since MPI and fork do not mix */
#include "conformance.h"
#include "groups.h"
#include "links.h"

#include <limits.h>
#include <stdint.h>

#define PIECE 1000 /* DOPT_MPI_MAX_COUNT above */

static int world_rank, world_size; /* known once MPI is initialised (first test) */
static int check_failures;         /* failed checks of the current test on this rank */
static dopt_comm *world;           /* owns MPI: created by the first test, destroyed by the last */

static void check_failed(const char *file, int line, const char *fmt, ...) DOPT_PRINTF(3, 4);
static void check_failed(const char *file, int line, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "  %s:%d: [%s rank %d] %s\n", file, line, dtest_current, world_rank, msg);
    fflush(stderr);
    check_failures++;
}

/* A check that reports and lets the test go on. */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) check_failed(__FILE__, __LINE__, __VA_ARGS__);                                \
    } while (0)

#define CHECK_STATUS(expr, want, c)                                                                \
    do {                                                                                           \
        dopt_status got_ = (expr);                                                                 \
        CHECK(got_ == (want), "%s gave %d (%s), expected %d (%s); detail: %s", #expr, (int)got_, \
              dopt_status_str(got_), (int)(want), dopt_status_str(want), dopt_comm_detail(c));    \
    } while (0)

/* ------------------------------------------------------------------ a log that remembers */

typedef struct captured_log {
    char text[4096];
    int errors;
} captured_log;

static void capture_log(void *user, dopt_log_level level, const char *message) {
    captured_log *log = (captured_log *)user;
    size_t used = strlen(log->text);
    if (level == DOPT_LOG_ERROR) log->errors++;
    snprintf(log->text + used, sizeof log->text - used, "%s\n", message);
}

static dopt_mpi_config config_logging_to(captured_log *log) {
    dopt_mpi_config cfg;
    memset(&cfg, 0, sizeof cfg);
    memset(log, 0, sizeof *log);
    cfg.log_fn = capture_log;
    cfg.log_user = log;
    return cfg;
}

static dopt_comm *create_or_die(const dopt_mpi_config *cfg) {
    dopt_comm *c = NULL;
    DT_OK(dopt_mpi_create(&c, cfg));
    return c;
}

/* ------------------------------------------------------------------ ownership of MPI */

static void create_initialises_mpi_when_needed(void) {
    static captured_log log; /* world logs to it until the last test destroys it */
    dopt_mpi_config cfg = config_logging_to(&log);
    int initialized = 1, level = -1;
    const char *check_env;
    char saved[64];
    MPI_Initialized(&initialized);
    DT_CHECKF(!initialized, "MPI is already initialised before the first create");
    cfg.max_count = (size_t)INT_MAX; /* the production limit: one MPI call per collective */
    check_env = getenv("DOPT_MPI_CHECK"); /* a config never reads the environment by itself */
    if (check_env) snprintf(saved, sizeof saved, "%s", check_env);
    setenv("DOPT_MPI_CHECK", "1", 1);
    world = create_or_die(&cfg);
    if (check_env) setenv("DOPT_MPI_CHECK", saved, 1);
    else unsetenv("DOPT_MPI_CHECK");
    MPI_Initialized(&initialized);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    MPI_Query_thread(&level);
    CHECK(initialized, "MPI not initialised after create");
    CHECK(level >= MPI_THREAD_FUNNELED, "thread level %d below MPI_THREAD_FUNNELED", level);
    CHECK(world->rank == world_rank && world->size == world_size, "communicator is rank %d of %d, MPI says %d of %d",
          world->rank, world->size, world_rank, world_size);
    CHECK(strstr(log.text, "initialised MPI") != NULL, "log does not say create initialised MPI: %s", log.text);
    CHECK(strstr(log.text, "mismatch check off") != NULL, "check should be off by default: %s", log.text);
}

static void mpi_running_before_create_is_left_running(void) {
    captured_log log;
    dopt_mpi_config cfg = config_logging_to(&log);
    dopt_comm *c = create_or_die(&cfg);
    int initialized = 0, finalized = 1, sum = world_rank, want = world_size * (world_size - 1) / 2;
    int64_t x = world_rank;
    CHECK(strstr(log.text, "joined MPI") != NULL, "log does not say create joined a running MPI: %s", log.text);
    CHECK_STATUS(dopt_allreduce(c, &x, 1, DOPT_I64, DOPT_SUM), DOPT_OK, c);
    CHECK(x == want, "sum of ranks %lld, expected %d", (long long)x, want);
    dopt_comm_destroy(c);
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    CHECK(initialized && !finalized, "after destroy: initialized %d finalized %d", initialized, finalized);
    CHECK(MPI_Allreduce(MPI_IN_PLACE, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD) == MPI_SUCCESS && sum == want,
          "the program's own MPI_Allreduce after destroy gave %d, expected %d", sum, want);
    CHECK_STATUS(dopt_barrier(world), DOPT_OK, world);
}

/* ------------------------------------------------------------------ conformance */

static void conformance_on_world(void) { conformance_run(world); }

static void conformance_in_small_pieces(void) {
    captured_log log;
    dopt_mpi_config cfg = config_logging_to(&log);
    dopt_comm *c = create_or_die(&cfg);
    CHECK(strstr(log.text, "at most 1000 per MPI call") != NULL, "DOPT_MPI_MAX_COUNT not honoured: %s", log.text);
    conformance_run(c);
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ pieces against a reference */

static int64_t value_at(int rank, size_t i) { return (int64_t)((i * 2654435761u + (size_t)rank * 977u) % 100003u) - 50000; }

static void allreduce_in_pieces_matches_reference(dopt_comm *c, size_t n) {
    static const dopt_op ops[3] = {DOPT_SUM, DOPT_MAX, DOPT_MIN};
    int64_t *x = (int64_t *)malloc(n * sizeof *x);
    double *y = (double *)malloc(n * sizeof *y);
    int o, r;
    size_t i, bad = 0;
    for (o = 0; o < 3; o++) {
        for (i = 0; i < n; i++) x[i] = value_at(c->rank, i), y[i] = (double)value_at(c->rank, i) * 0.5;
        CHECK_STATUS(dopt_allreduce(c, x, n, DOPT_I64, ops[o]), DOPT_OK, c);
        CHECK_STATUS(dopt_allreduce(c, y, n, DOPT_F64, ops[o]), DOPT_OK, c);
        for (i = 0; i < n; i++) {
            int64_t want = value_at(0, i);
            for (r = 1; r < c->size; r++) {
                int64_t v = value_at(r, i);
                want = ops[o] == DOPT_SUM ? want + v : ops[o] == DOPT_MAX ? (v > want ? v : want) : (v < want ? v : want);
            }
            bad += x[i] != want || y[i] != (double)want * 0.5;
        }
        CHECK(bad == 0, "allreduce %s of %zu elements: %zu elements differ from the reference", dopt_op_name(ops[o]), n, bad);
    }
    free(x);
    free(y);
}

static unsigned char byte_at(int rank, size_t i) { return (unsigned char)(i * 37 + (size_t)rank * 59 + 11); }

/* Rank r sends blocks[r] bytes; checks every byte of every block, and the sizes. */
static void allgatherv_matches_reference(dopt_comm *c, const size_t *blocks, int in_place) {
    size_t total = 0, mine = 0, off = 0, i, bad = 0;
    size_t *sizes = (size_t *)malloc((size_t)c->size * sizeof *sizes);
    unsigned char *send, *recv;
    int r;
    for (r = 0; r < c->size; r++) {
        if (r == c->rank) mine = total;
        total += blocks[r];
    }
    recv = (unsigned char *)malloc(total + 1);
    memset(recv, 0xEE, total + 1);
    send = in_place ? recv + mine : (unsigned char *)malloc(blocks[c->rank] + 1);
    for (i = 0; i < blocks[c->rank]; i++) send[i] = byte_at(c->rank, i);
    CHECK_STATUS(dopt_allgatherv(c, send, blocks[c->rank], recv, total, sizes), DOPT_OK, c);
    for (r = 0; r < c->size; r++) {
        CHECK(sizes[r] == blocks[r], "rank %d's block is %zu bytes, expected %zu", r, sizes[r], blocks[r]);
        for (i = 0; i < blocks[r]; i++) bad += recv[off + i] != byte_at(r, i);
        off += blocks[r];
    }
    CHECK(bad == 0 && recv[total] == 0xEE, "allgatherv of %zu bytes%s: %zu bytes wrong, guard byte %#x", total,
          in_place ? " in place" : "", bad, recv[total]);
    if (!in_place) free(send);
    free(recv);
    free(sizes);
}

static void broadcast_matches_reference(dopt_comm *c, size_t n, int root) {
    unsigned char *buf = (unsigned char *)malloc(n + 1);
    size_t i, bad = 0;
    for (i = 0; i <= n; i++) buf[i] = c->rank == root ? byte_at(root, i) : 0xEE;
    CHECK_STATUS(dopt_broadcast(c, buf, n, root), DOPT_OK, c);
    for (i = 0; i < n; i++) bad += buf[i] != byte_at(root, i);
    CHECK(bad == 0 && buf[n] == (c->rank == root ? byte_at(root, n) : 0xEE), "broadcast of %zu bytes from %d: %zu wrong",
          n, root, bad);
    free(buf);
}

static void pieces_match_reference(void) {
    dopt_comm *c = create_or_die(NULL);
    size_t *blocks = (size_t *)malloc((size_t)c->size * sizeof *blocks);
    int r;
    allreduce_in_pieces_matches_reference(c, PIECE);
    allreduce_in_pieces_matches_reference(c, PIECE + 1);
    allreduce_in_pieces_matches_reference(c, 3 * PIECE + 7);
    /* every block spans several pieces (one broadcast per rank), one rank sends nothing */
    for (r = 0; r < c->size; r++) blocks[r] = r == 1 ? 0 : 2 * PIECE + 333 * (size_t)r + 1;
    allgatherv_matches_reference(c, blocks, 0);
    allgatherv_matches_reference(c, blocks, 1);
    /* small blocks whose total exceeds one piece: displacements past the limit */
    for (r = 0; r < c->size; r++) blocks[r] = PIECE / 2 + (size_t)r;
    allgatherv_matches_reference(c, blocks, 0);
    /* a total that fits one piece: one MPI_Allgatherv */
    for (r = 0; r < c->size; r++) blocks[r] = PIECE / (size_t)c->size - (size_t)r;
    allgatherv_matches_reference(c, blocks, 0);
    allgatherv_matches_reference(c, blocks, 1);
    broadcast_matches_reference(c, PIECE, 0);
    broadcast_matches_reference(c, 5 * PIECE + 1, c->size - 1);
    broadcast_matches_reference(c, 2 * PIECE - 1, 1);
    CHECK_STATUS(dopt_barrier(c), DOPT_OK, c);
    dopt_comm_destroy(c);
    free(blocks);
}

/* ------------------------------------------------------------------ the program's communicators */

/* dopt_comm_split on MPI: groups by parity ranked backwards, DOPT_UNDEFINED on rank 0, and the
   host group (the ranks MPI_COMM_TYPE_SHARED puts on this node: all of them on one machine, two
   per simulated host in check_cluster_mpi). */
static void dopt_comm_split_makes_groups(void) {
    dopt_comm *g, *none, *host;
    int r, want = 0;
    int64_t x = world_rank;
    CHECK_STATUS(dopt_comm_split(world, world_rank % 2, -world_rank, &g), DOPT_OK, world);
    CHECK(g != NULL && g->size == (world_size + 1 - world_rank % 2) / 2 && g->rank == g->size - 1 - world_rank / 2,
          "rank %d: group rank %d of %d", world_rank, g ? g->rank : -1, g ? g->size : -1);
    for (r = world_rank % 2; r < world_size; r += 2) want += r;
    if (g) CHECK_STATUS(dopt_allreduce(g, &x, 1, DOPT_I64, DOPT_SUM), DOPT_OK, g);
    CHECK(x == want, "sum over the group %lld, expected %d", (long long)x, want);
    CHECK_STATUS(dopt_comm_split(world, world_rank == 0 ? DOPT_UNDEFINED : 0, 0, &none), DOPT_OK, world);
    CHECK((world_rank == 0) == (none == NULL), "rank %d: DOPT_UNDEFINED gave a group, or another color none",
          world_rank);
    CHECK_STATUS(dopt_comm_split_host(world, &host), DOPT_OK, world);
    { /* the same ranks as MPI's own view of the node */
        MPI_Comm node;
        int node_rank = -1, node_size = -1;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node);
        MPI_Comm_rank(node, &node_rank);
        MPI_Comm_size(node, &node_size);
        MPI_Comm_free(&node);
        CHECK(host != NULL && host->size == node_size && host->rank == node_rank,
              "rank %d: host group rank %d of %d, MPI's node says %d of %d", world_rank, host ? host->rank : -1,
              host ? host->size : -1, node_rank, node_size);
    }
    if (host) CHECK_STATUS(dopt_barrier(host), DOPT_OK, host);
    dopt_comm_destroy(host);
    dopt_comm_destroy(none);
    dopt_comm_destroy(g);
    CHECK_STATUS(dopt_barrier(world), DOPT_OK, world);
}

static void works_on_a_split_communicator(void) {
    MPI_Comm half;
    MPI_Errhandler handler;
    dopt_mpi_config cfg;
    dopt_comm *c;
    int color = world_rank % 2, half_rank, half_size, r, sum = 0, want = 0;
    int64_t x;
    MPI_Comm_split(MPI_COMM_WORLD, color, world_rank, &half);
    MPI_Comm_rank(half, &half_rank);
    MPI_Comm_size(half, &half_size);
    memset(&cfg, 0, sizeof cfg);
    cfg.comm = &half;
    c = create_or_die(&cfg);
    CHECK(c->rank == half_rank && c->size == half_size, "rank %d of %d, the split says %d of %d", c->rank, c->size,
          half_rank, half_size);
    for (r = color; r < world_size; r += 2) want += r;
    /* the program's own collectives on the same communicator interleave with distopt's */
    sum = world_rank;
    MPI_Allreduce(MPI_IN_PLACE, &sum, 1, MPI_INT, MPI_SUM, half);
    x = world_rank;
    CHECK_STATUS(dopt_allreduce(c, &x, 1, DOPT_I64, DOPT_SUM), DOPT_OK, c);
    CHECK(x == want && sum == want, "sums over the half %d: distopt %lld, MPI %d, expected %d", color, (long long)x, sum,
          want);
    CHECK_STATUS(dopt_barrier(world), DOPT_OK, world); /* the world communicator is not disturbed */
    /* distopt sets MPI_ERRORS_RETURN on its duplicate only */
    MPI_Comm_get_errhandler(half, &handler);
    CHECK(handler == MPI_ERRORS_ARE_FATAL, "the program's communicator lost its error handler");
    MPI_Errhandler_free(&handler);
    dopt_comm_destroy(c);
    MPI_Comm_free(&half);
}

/* ------------------------------------------------------------------ errors */

static void invalid_arguments_are_reported(void) {
    captured_log log;
    dopt_mpi_config cfg = config_logging_to(&log);
    MPI_Comm null_comm = MPI_COMM_NULL, half, inter;
    dopt_comm *c = world; /* a failing create must set it to NULL */
    size_t sizes[8];
    float x[4] = {0};
    CHECK(dopt_mpi_create(NULL, NULL) == DOPT_ERR_INVALID, "create with out = NULL");
    cfg.comm = &null_comm;
    CHECK(dopt_mpi_create(&c, &cfg) == DOPT_ERR_INVALID && c == NULL, "create on MPI_COMM_NULL");
    CHECK(log.errors == 1 && strstr(log.text, "MPI_COMM_NULL") != NULL, "the log does not say why: %s", log.text);
    /* an intercommunicator between the even and the odd world ranks */
    MPI_Comm_split(MPI_COMM_WORLD, world_rank % 2, world_rank, &half);
    MPI_Intercomm_create(half, 0, MPI_COMM_WORLD, world_rank % 2 == 0 ? 1 : 0, 7, &inter);
    cfg.comm = &inter;
    CHECK(dopt_mpi_create(&c, &cfg) == DOPT_ERR_INVALID && c == NULL, "create on an intercommunicator");
    MPI_Comm_free(&inter);
    MPI_Comm_free(&half);

    c = create_or_die(NULL);
    CHECK_STATUS(dopt_allreduce(c, x, 4, (dopt_dtype)9, DOPT_SUM), DOPT_ERR_INVALID, c);
    CHECK(strstr(dopt_comm_detail(c), "allreduce #1") != NULL, "detail: %s", dopt_comm_detail(c));
    CHECK_STATUS(dopt_barrier(c), DOPT_ERR_INVALID, c); /* poisoned */
    dopt_comm_destroy(c);
    c = create_or_die(NULL);
    CHECK_STATUS(dopt_broadcast(c, x, sizeof x, c->size), DOPT_ERR_INVALID, c);
    dopt_comm_destroy(c);
    c = create_or_die(NULL);
    CHECK_STATUS(dopt_allreduce(c, NULL, 4, DOPT_F32, DOPT_SUM), DOPT_ERR_INVALID, c);
    dopt_comm_destroy(c);
    c = create_or_die(NULL);
    CHECK_STATUS(dopt_allgatherv(c, x, sizeof x, x, sizeof x, sizes), DOPT_ERR_INVALID, c); /* too small */
    dopt_comm_destroy(c);
}

static void mpi_errors_become_statuses_with_mpi_text(void) {
    char text[MPI_MAX_ERROR_STRING];
    int cls = dopt__mpi_describe_error(MPI_ERR_TRUNCATE, text);
    CHECK(cls == MPI_ERR_TRUNCATE && strstr(text, "truncated") != NULL, "class %d text %s", cls, text);
    CHECK(dopt__mpi_status_of_class(MPI_ERR_TRUNCATE) == DOPT_ERR_MISMATCH, "truncate");
    CHECK(dopt__mpi_status_of_class(MPI_ERR_NO_MEM) == DOPT_ERR_NOMEM, "no mem");
    CHECK(dopt__mpi_status_of_class(MPI_ERR_COUNT) == DOPT_ERR_INVALID, "count");
    CHECK(dopt__mpi_status_of_class(MPI_ERR_UNSUPPORTED_OPERATION) == DOPT_ERR_UNSUPPORTED, "unsupported");
    CHECK(dopt__mpi_status_of_class(MPI_ERR_INTERN) == DOPT_ERR_IO, "intern");
    CHECK(dopt__mpi_status_of_class(MPI_ERR_OTHER) == DOPT_ERR_IO, "other");
}

/* ------------------------------------------------------------------ mismatches */

static dopt_comm *create_checking(void) {
    dopt_mpi_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.check = 1;
    return create_or_die(&cfg);
}

static void mismatches_detected_with_the_check(void) {
    dopt_comm *c = create_checking();
    int last = c->size - 1;
    float buf[17] = {0};
    char want[128];
    conformance_mismatch_count(c);
    /* each side names the other and what it called */
    if (c->rank == last)
        snprintf(want, sizeof want, "(f32 sum, 17 elems): rank 0 called allreduce #2 (f32 sum, 16 elems)");
    else
        snprintf(want, sizeof want, "(f32 sum, 16 elems): rank %d called allreduce #2 (f32 sum, 17 elems)", last);
    CHECK(strstr(dopt_comm_detail(c), want) != NULL, "detail: %s", dopt_comm_detail(c));
    dopt_comm_destroy(c);
    c = create_checking();
    conformance_mismatch_op(c);
    dopt_comm_destroy(c);
    c = create_checking();
    conformance_mismatch_kind(c);
    dopt_comm_destroy(c);
    /* the last rank skips a barrier: its allreduce meets the others' barrier */
    c = create_checking();
    CHECK_STATUS(dopt_barrier(c), DOPT_OK, c);
    if (c->rank == last) {
        CHECK_STATUS(dopt_allreduce(c, buf, 16, DOPT_F32, DOPT_SUM), DOPT_ERR_MISMATCH, c);
    } else {
        CHECK_STATUS(dopt_barrier(c), DOPT_ERR_MISMATCH, c);
        CHECK(strstr(dopt_comm_detail(c), "called allreduce #2") != NULL, "detail: %s", dopt_comm_detail(c));
    }
    dopt_comm_destroy(c);
    /* ranks one collective apart with otherwise identical calls (the last rank's count of calls
       is one ahead, as after a call that failed on it alone): only the sequence number differs */
    c = create_checking();
    CHECK_STATUS(dopt_barrier(c), DOPT_OK, c);
    if (c->rank == last) c->seq++;
    CHECK_STATUS(dopt_allreduce(c, buf, 16, DOPT_F32, DOPT_SUM), DOPT_ERR_MISMATCH, c);
    CHECK(strstr(dopt_comm_detail(c), c->rank == last ? "called allreduce #2" : "called allreduce #3") != NULL,
          "detail: %s", dopt_comm_detail(c));
    dopt_comm_destroy(c);
    /* matched calls pass the check */
    c = create_checking();
    buf[0] = 1.0f;
    CHECK_STATUS(dopt_allreduce(c, buf, 17, DOPT_F32, DOPT_SUM), DOPT_OK, c);
    CHECK(buf[0] == (float)c->size, "sum %g", (double)buf[0]);
    dopt_comm_destroy(c);
}

/* Settings that change which MPI calls a collective makes are agreed at create: one rank asking
   for the check (through the environment) turns it on everywhere, and the smallest limit wins. */
static void settings_are_agreed_at_create(void) {
    captured_log log;
    dopt_mpi_config cfg = config_logging_to(&log);
    dopt_comm *c;
    float buf[16] = {0};
    if (world_rank == 0) setenv("DOPT_MPI_CHECK", "1", 1);
    if (world_rank == 0) cfg.max_count = 500;
    CHECK(dopt_mpi_config_from_env(&cfg) == DOPT_OK, "config_from_env failed: %s", log.text);
    c = create_or_die(&cfg);
    unsetenv("DOPT_MPI_CHECK");
    CHECK(strstr(log.text, "mismatch check on, at most 500 per MPI call") != NULL, "log: %s", log.text);
    /* an op mismatch, which MPI itself does not notice, now fails everywhere */
    CHECK_STATUS(dopt_allreduce(c, buf, 16, DOPT_F32, c->rank == c->size - 1 ? DOPT_MAX : DOPT_SUM), DOPT_ERR_MISMATCH,
                 c);
    dopt_comm_destroy(c);
    /* DOPT_MPI_CHECK=0 turns it off; a value that is not 0 or 1 is refused and named */
    setenv("DOPT_MPI_CHECK", "0", 1);
    cfg = config_logging_to(&log);
    cfg.check = 1;
    CHECK(dopt_mpi_config_from_env(&cfg) == DOPT_OK && cfg.check == -1, "check %d", cfg.check);
    c = create_or_die(&cfg);
    CHECK(strstr(log.text, "mismatch check off") != NULL, "log: %s", log.text);
    dopt_comm_destroy(c);
    setenv("DOPT_MPI_CHECK", "yes", 1);
    CHECK(dopt_mpi_config_from_env(&cfg) == DOPT_ERR_INVALID, "DOPT_MPI_CHECK=yes accepted");
    CHECK(strstr(log.text, "DOPT_MPI_CHECK=\"yes\" is not 0 or 1") != NULL, "log: %s", log.text);
    unsetenv("DOPT_MPI_CHECK");
}

/* ------------------------------------------------------------------ the engine over MPI links */

static dopt_comm *create_engine(void) {
    dopt_mpi_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.engine = 1;
    return create_or_die(&cfg);
}

/* engine = 1: every collective on distopt.h's engine over MPI_Isend/MPI_Irecv links; the
   suite, groups beside their parent, and requests in flight. */
static void engine_over_links_passes_conformance(void) {
    dopt_comm *c = create_engine();
    CHECK(c->vt->link_send != NULL && c->vt->provides == 0, "not on the engine");
    conformance_run(c);
    groups_of_parity(c);
    dopt_comm_destroy(c);
}

/* The link contract below the engine (links.h), every pair at once. */
static void engine_links_keep_order_and_bytes(void) {
    dopt_comm *c = create_engine();
    links_conformance(c);
    dopt_comm_destroy(c);
}

/* One round of every collective, blocking and in flight. */
static void steady_round(dopt_comm *c, float *big, size_t n, unsigned char *all) {
    float small[5] = {1, 2, 3, 4, 5};
    size_t got[16];
    int x = c->rank;
    dopt_request r[3];
    DT_OK(dopt_allreduce(c, small, 5, DOPT_F32, DOPT_SUM));
    DT_OK(dopt_allreduce(c, big, n, DOPT_F32, DOPT_MAX));
    DT_OK(dopt_allgather(c, &x, all, sizeof x));
    DT_OK(dopt_allgatherv(c, big, (size_t)(c->rank + 1) * 100, all, 100 * sizeof(float) * 16, got));
    DT_OK(dopt_broadcast(c, big, n * sizeof(float), c->size - 1));
    DT_OK(dopt_barrier(c));
    DT_OK(dopt_allreduce_start(c, big, n, DOPT_F32, DOPT_SUM, &r[0]));
    DT_OK(dopt_allreduce_start(c, small, 5, DOPT_F32, DOPT_MEAN, &r[1]));
    DT_OK(dopt_broadcast_start(c, &x, sizeof x, 0, &r[2]));
    DT_OK(dopt_wait(&r[2]));
    DT_OK(dopt_wait(&r[0]));
    DT_OK(dopt_wait(&r[1]));
}

/* After a first round, later rounds of the same calls allocate nothing: MPI's collectives and
   the engine over MPI links alike. */
static void collectives_allocate_nothing_after_the_first_call(void) {
    size_t n = 100000;
    float *big = (float *)calloc(n, sizeof(float));
    unsigned char *all = (unsigned char *)malloc(100 * sizeof(float) * 16);
    dopt_comm *c[2];
    int k, round;
    DT_CHECK(big != NULL && all != NULL && world_size <= 16);
    c[0] = create_or_die(NULL);
    c[1] = create_engine();
    for (k = 0; k < 2; k++) {
        long before;
        steady_round(c[k], big, n, all);
        before = mpi_test_allocs;
        for (round = 0; round < 3; round++) steady_round(c[k], big, n, all);
        CHECK(mpi_test_allocs == before, "%s: %ld allocations after the first round", k ? "engine" : "mpi",
              mpi_test_allocs - before);
    }
    dopt_comm_destroy(c[1]);
    dopt_comm_destroy(c[0]);
    free(big);
    free(all);
}

/* Mismatches are named from the frames (no extra collective), and a peer that does not call
   times out instead of hanging: rank 0 waits 300 ms for the others, who learn of it when they
   come to the same call (which may still complete: rank 0's data came first) or the next. */
static void engine_over_links_names_mismatches_and_timeouts(void) {
    captured_log log;
    dopt_mpi_config cfg = config_logging_to(&log);
    dopt_comm *c = create_engine();
    float x[4] = {0};
    conformance_mismatch_count(c);
    dopt_comm_destroy(c);
    c = create_engine();
    conformance_mismatch_in_flight(c);
    dopt_comm_destroy(c);
    cfg.engine = world_rank == 0; /* agreed: any rank asking turns it on for all */
    c = create_or_die(&cfg);
    CHECK(strstr(log.text, "collectives on the engine over links") != NULL, "log: %s", log.text);
    if (c->rank == 0) {
        c->timeout_ms = 300;
        dopt_status s = dopt_allreduce(c, x, 4, DOPT_F32, DOPT_SUM); /* rank 0's data came before its abort */
        CHECK(s == DOPT_OK || s == DOPT_ERR_TIMEOUT, "allreduce gave %d: %s", (int)s, dopt_comm_detail(c));
        CHECK_STATUS(dopt_barrier(c), DOPT_ERR_TIMEOUT, c);
        CHECK(strstr(dopt_comm_detail(c), "no progress for 300 ms") != NULL, "detail: %s", dopt_comm_detail(c));
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (c->rank != 0) {
        dopt_status s = dopt_allreduce(c, x, 4, DOPT_F32, DOPT_SUM); /* rank 0's data came before its abort */
        CHECK(s == DOPT_OK || s == DOPT_ERR_TIMEOUT, "allreduce gave %d: %s", (int)s, dopt_comm_detail(c));
        CHECK_STATUS(dopt_barrier(c), DOPT_ERR_TIMEOUT, c);
        CHECK(strstr(dopt_comm_detail(c), "(reported by rank 0)") != NULL, "detail: %s", dopt_comm_detail(c));
    }
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ the driver's non-finite rule */

#define NF_CHECK(cond, ...) CHECK(cond, __VA_ARGS__)
#include "nonfinite.h"

/* tests/nonfinite.h's cases over MPI's own collectives (test_nonfinite runs every case on shm and
   TCP): fp32 and codecs on both paths of the compressed allreduce, a model average, an overflow. */
static void non_finite_averages_stop_or_skip_on_every_rank(void) {
    static const nf_case cases[] = {
        {NF_GRADS, -1, DOPT_AGG_AUTO, DOPT_NONFINITE_FAIL, 0, 0, 0},
        {NF_GRADS, -1, DOPT_AGG_AUTO, DOPT_NONFINITE_SKIP, 1, 0, 0},
        {NF_GRADS, DOPT_CODEC_TERNARY, DOPT_AGG_RING, DOPT_NONFINITE_SKIP, 0, 0, 0},
        {NF_GRADS, DOPT_CODEC_TERNARY, DOPT_AGG_ALLGATHER, DOPT_NONFINITE_FAIL, 1, 0, 0},
        {NF_GRADS, DOPT_CODEC_FP16, DOPT_AGG_AUTO, DOPT_NONFINITE_FAIL, 0, 0, 0},
        {NF_GRADS, DOPT_CODEC_POWERSGD, DOPT_AGG_AUTO, DOPT_NONFINITE_SKIP, 0, 0, 0},
        {NF_CELGC, -1, DOPT_AGG_AUTO, DOPT_NONFINITE_SKIP, 1, 0, 0},
        {NF_MODELS, -1, DOPT_AGG_AUTO, DOPT_NONFINITE_SKIP, 0, 0, 0},
        {NF_MODELS, -1, DOPT_AGG_AUTO, DOPT_NONFINITE_FAIL, 1, 0, 1},
        {NF_OVERFLOW, -1, DOPT_AGG_AUTO, DOPT_NONFINITE_FAIL, 0, 0, 0},
    };
    dopt_comm *c = create_or_die(NULL);
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) nf_run(c, &cases[i]);
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ buckets during backward */

/* MPI initialised with MPI_THREAD_FUNNELED: only this thread may call the communicator, so the
   driver's buckets run in after_backward on it (no worker), and give the whole buffer's mean. */
static void buckets_run_on_the_calling_thread(void) {
    enum { NSEG = 3 };
    static const size_t sizes[NSEG] = {5000, 7, 3000};
    dopt_comm *c = create_or_die(NULL);
    dopt_segment segs[NSEG];
    float g[8007], want[8007];
    size_t total = 0, i;
    int step;
    dopt_dp dp;
    dopt_buf b;
    CHECK(c->one_thread == 1, "one_thread is %d under MPI_THREAD_FUNNELED", c->one_thread);
    DT_OK(dopt_segments_from_sizes(segs, sizes, NSEG, &total));
    b = dopt_buf_flat(g, total, segs, NSEG);
    DT_OK(dopt_dp_init(&dp, c, total, &(dopt_dp_config){.grads = &b, .bucket_bytes = 8 << 10}));
    for (step = 0; step < 3; step++) {
        for (i = 0; i < total; i++) g[i] = want[i] = (float)((i * 7 + (size_t)step * 13 + (size_t)c->rank * 31) % 97) / 97.0f;
        for (i = NSEG; i-- > 0;) DT_OK(dopt_dp_grad_ready(&dp, i));
        DT_OK(dopt_dp_after_backward(&dp, g));
        DT_OK(dopt_allreduce(c, want, total, DOPT_F32, DOPT_MEAN));
        for (i = 0; i < total; i++)
            CHECK(fabsf(g[i] - want[i]) <= 1e-6f, "step %d, element %zu: %.9g, the whole mean %.9g", step, i, g[i], want[i]);
    }
    CHECK(dp.ov.worker == NULL && dp.ov.nbuckets > 1, "worker %p, %zu buckets", (void *)dp.ov.worker, dp.ov.nbuckets);
    dopt_dp_free(&dp);
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ the end of MPI */

/* Destroying the communicator that initialised MPI finalizes it; a communicator still alive then
   reports DOPT_ERR_CLOSED instead of calling into a finalized MPI. */
static void destroying_the_owner_finalizes_mpi(void) {
    dopt_comm *late = create_or_die(NULL);
    int finalized = 0;
    dopt_comm_destroy(world);
    world = NULL;
    MPI_Finalized(&finalized);
    CHECK(finalized, "MPI is not finalized after destroying the communicator that initialised it");
    CHECK_STATUS(dopt_barrier(late), DOPT_ERR_CLOSED, late);
    CHECK(strstr(dopt_comm_detail(late), "finalized") != NULL, "detail: %s", dopt_comm_detail(late));
    dopt_comm_destroy(late);
}

/* ------------------------------------------------------------------ runner */

typedef struct mpi_test {
    const char *name;
    void (*fn)(void);
} mpi_test;

#define MPI_TEST(fn) {#fn, fn}

int main(void) {
    static const mpi_test tests[] = {
        MPI_TEST(create_initialises_mpi_when_needed),
        MPI_TEST(mpi_running_before_create_is_left_running),
        MPI_TEST(conformance_on_world),
        MPI_TEST(conformance_in_small_pieces),
        MPI_TEST(pieces_match_reference),
        MPI_TEST(works_on_a_split_communicator),
        MPI_TEST(dopt_comm_split_makes_groups),
        MPI_TEST(invalid_arguments_are_reported),
        MPI_TEST(mpi_errors_become_statuses_with_mpi_text),
        MPI_TEST(mismatches_detected_with_the_check),
        MPI_TEST(settings_are_agreed_at_create),
        MPI_TEST(engine_over_links_passes_conformance),
        MPI_TEST(engine_links_keep_order_and_bytes),
        MPI_TEST(collectives_allocate_nothing_after_the_first_call),
        MPI_TEST(engine_over_links_names_mismatches_and_timeouts),
        MPI_TEST(non_finite_averages_stop_or_skip_on_every_rank),
        MPI_TEST(buckets_run_on_the_calling_thread),
        MPI_TEST(destroying_the_owner_finalizes_mpi),
    };
    const int ntests = (int)(sizeof tests / sizeof tests[0]);
    int i, passed = 0, failed = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (i = 0; i < ntests; i++) {
        double t0 = dtest_now_ms();
        int bad, finalized = 0;
        dtest_current = tests[i].name;
        check_failures = 0;
        tests[i].fn();
        bad = check_failures;
        /* after the last test MPI is gone: each rank judges alone */
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        if (bad) failed++;
        else passed++;
        if (world_rank == 0 || (finalized && bad)) {
            if (bad)
                printf("FAIL %s (%d failed checks)\n", tests[i].name, bad);
            else
                printf("ok   %s (%.0f ms)\n", tests[i].name, dtest_now_ms() - t0);
        }
    }
    printf("dtest-summary test_mpi passed=%d failed=%d\n", passed, failed);
    return failed ? 1 : 0;
}
