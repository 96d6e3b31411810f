/* Tests of transport_shm.h: the shared conformance suite at world sizes 1..4 through the fork
   helper, with the direct collectives and with the engine over the per-pair links, the link
   contract itself (links.h), groups,
   mismatches, dead and stuck peers (a failure crossing from the direct collectives to the links
   and back), stale and live segments, the launcher path through the environment, and pipelining
   with chunks smaller than the message. Every multi-rank test runs real processes over real
   shared memory. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "dtest.h"

#include <errno.h>
#include "conformance.h"
#include "groups.h"
#include "links.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/stat.h>

/* ------------------------------------------------------------------ helpers */

typedef struct captured_log {
    char text[8192];
} captured_log;

static void capture_log(void *user, dopt_log_level level, const char *message) {
    captured_log *log = (captured_log *)user;
    size_t used = strlen(log->text);
    (void)level;
    snprintf(log->text + used, sizeof log->text - used, "%s\n", message);
}

static dopt_shm_config config_for(const char *name, int rank, int size, int timeout_ms, captured_log *log) {
    dopt_shm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.name = name;
    cfg.rank = rank;
    cfg.size = size;
    cfg.timeout_ms = timeout_ms;
    if (log) {
        cfg.log_fn = capture_log;
        cfg.log_user = log;
    }
    return cfg;
}

/* A job name no other test (or concurrent run of this binary) uses. */
static void unique_name(char *out, size_t cap, const char *what) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    snprintf(out, cap, "test-%s-%d-%lld", what, (int)getpid(), (long long)ts.tv_nsec);
}

static int segment_exists(const char *name) {
    char path[256];
    snprintf(path, sizeof path, "/dev/shm/dopt.%s", name);
    return access(path, F_OK) == 0;
}

/* Polls until the named segment holds its header's magic, which its creator stores last. */
static void wait_for_segment(const char *name) {
    char path[256];
    unsigned char head[4096];
    int i;
    snprintf(path, sizeof path, "/dev/shm/dopt.%s", name);
    for (i = 0; i < 10000; i++) {
        int fd = open(path, O_RDONLY);
        ssize_t got = fd >= 0 ? pread(fd, head, sizeof head, 0) : -1;
        if (fd >= 0) close(fd);
        if (got > 8 && memmem(head, (size_t)got, "DOPTSHM1", 8) != NULL) return;
        usleep(1000);
    }
    DT_CHECKF(0, "segment %s never got its header", path);
}

static void run_conformance(int nranks, size_t chunk_bytes) {
    dopt_shm_config cfg = config_for(NULL, 0, 0, 60000, NULL);
    dopt_comm *c;
    cfg.chunk_bytes = chunk_bytes;
    DT_OK(dopt_shm_fork(&c, nranks, &cfg));
    DT_EQ_INT(c->size, nranks);
    conformance_run(c);
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

/* ------------------------------------------------------------------ conformance */

DTEST(conformance_world_1) { run_conformance(1, 0); }
DTEST(conformance_world_2) { run_conformance(2, 0); }
DTEST(conformance_world_3) { run_conformance(3, 0); }
DTEST(conformance_world_4_oversubscribed) { run_conformance(4, 0); }
/* 1000-byte chunks: every length above 1000 bytes is pipelined through many odd-sized windows. */
DTEST(conformance_world_2_chunk_1000_bytes) { run_conformance(2, 1000); }

/* ------------------------------------------------------------------ links: the engine and groups */

/* body on every rank of a forked job whose collectives run directly (engine 0) or on the engine
   over the per-pair links (engine 1). */
static void run_body(int nranks, int engine, void (*body)(dopt_comm *c)) {
    dopt_shm_config cfg = config_for(NULL, 0, 0, 60000, NULL);
    dopt_comm *c;
    cfg.engine = engine;
    DT_OK(dopt_shm_fork(&c, nranks, &cfg));
    body(c);
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

/* The link contract below the engine (links.h), every pair at once, rings wrapping many times. */
DTEST(links_keep_order_and_bytes_at_every_size_worlds_2_to_4) {
    int n;
    for (n = 2; n <= 4; n++) run_body(n, 1, links_conformance);
}

DTEST(conformance_on_the_engine_over_links_worlds_1_to_4) {
    int n;
    for (n = 1; n <= 4; n++) run_body(n, 1, conformance_run);
}

DTEST(exchange_mismatches_fail_whichever_way_collectives_run) {
    run_body(3, 0, conformance_mismatch_exchange);
    run_body(3, 1, conformance_mismatch_exchange);
    run_body(3, 0, conformance_exchange_size);
    run_body(2, 1, conformance_exchange_size);
}

DTEST(mismatches_on_the_engine_over_links_fail_every_rank) {
    run_body(3, 1, conformance_mismatch_count);
    run_body(3, 1, conformance_mismatch_kind);
    run_body(2, 1, conformance_mismatch_in_flight);
}

/* Groups share the links whichever way the parent's own collectives run (bodies in groups.h). */
DTEST(groups_pass_conformance_beside_their_parent) {
    run_body(4, 0, groups_of_parity);
    run_body(3, 1, groups_of_parity);
}

DTEST(groups_and_parent_in_flight_together) {
    run_body(4, 0, groups_in_flight);
    run_body(4, 1, groups_in_flight);
}

DTEST(split_colors_and_host_groups) {
    run_body(3, 0, split_colors);
    run_body(4, 0, groups_of_hosts);
}

DTEST(mismatch_between_parent_and_group_is_named) {
    run_body(2, 0, mismatch_across_groups);
    run_body(2, 0, group_failure_poisons_parent);
}

/* Ranks 0 and 1 allreduce on a group of all three (the engine, over links) while rank 2 waits
   in a direct barrier of the parent: rank 2 sees their frames arrive while they do not arrive at
   its barrier, names the mismatch, and ranks 0 and 1 learn it from the segment, with both calls. */
static void direct_mismatch_reaches_the_links(dopt_comm *c) {
    dopt_comm *g;
    float x[4] = {0};
    DT_OK(dopt_comm_split(c, 0, 0, &g));
    if (c->rank == 2) {
        DT_EQ_INT(dopt_barrier(c), DOPT_ERR_MISMATCH);
        DT_CHECKF(strstr(dopt_comm_detail(c), "called allreduce #1 in group 1") != NULL, "%s", dopt_comm_detail(c));
    } else {
        dopt_status s = dopt_allreduce(g, x, 4, DOPT_F32, DOPT_SUM);
        DT_CHECKF(s == DOPT_ERR_MISMATCH && strstr(dopt_comm_detail(g), "rank 2 barrier") != NULL &&
                      strstr(dopt_comm_detail(g), "(reported by rank 2)") != NULL,
                  "rank %d: %d: %s", c->rank, (int)s, dopt_comm_detail(g));
    }
    dopt_comm_destroy(g);
}

/* The other way: rank 2 waits on the group's links for a broadcast from rank 0 (a leaf of the
   tree: it sends nothing) and times out; ranks 0 and 1, in a direct barrier, learn it from the
   segment while rank 2 is still there. */
static void links_failure_reaches_direct(dopt_comm *c) {
    dopt_comm *g;
    float x[4] = {0};
    DT_OK(dopt_comm_split(c, 0, 0, &g));
    if (c->rank == 2) {
        g->timeout_ms = 500;
        DT_EQ_INT(dopt_broadcast(g, x, sizeof x, 0), DOPT_ERR_TIMEOUT);
        DT_EQ_INT(dopt_barrier(c), DOPT_ERR_TIMEOUT); /* the parent shares the failure */
    } else {
        DT_EQ_INT(dopt_barrier(c), DOPT_ERR_TIMEOUT);
        DT_CHECKF(strstr(dopt_comm_detail(c), "(reported by rank 2)") != NULL, "rank %d: %s", c->rank,
                  dopt_comm_detail(c));
    }
    dopt_comm_destroy(g);
}

/* A link that ends reads the segment first: rank 1 times out on the engine, records its failure
   in the segment, sends its abort and ends its link to rank 0, and stays alive; rank 0 reads that
   link through the link contract itself (no engine in between to look at the segment first):
   after the abort's bytes, the end must come as the failure rank 1 recorded (ECONNABORTED, and
   rank 0's detail "reported by rank 1"), not as a bare end of stream. */
static void link_end_reads_the_recorded_failure(dopt_comm *c) {
    float x[4] = {0};
    if (c->rank == 1) {
        c->timeout_ms = 300;
        DT_EQ_INT(dopt_broadcast(c, x, sizeof x, 0), DOPT_ERR_TIMEOUT);
        usleep(1500 * 1000); /* alive while rank 0 reads the ended link */
    } else {
        unsigned char buf[4096];
        long n;
        int err = 0, reads = 0;
        usleep(800 * 1000);
        do n = c->vt->link_recv(c, 1, buf, sizeof buf, &err);
        while (n > 0 && ++reads < 100);
        DT_CHECKF(n == -1 && err == ECONNABORTED, "link_recv gave %ld, err %d", n, err);
        DT_CHECKF(strstr(dopt_comm_detail(c), "(reported by rank 1)") != NULL, "%s", dopt_comm_detail(c));
    }
}

DTEST(a_failure_crosses_between_direct_collectives_and_links) {
    run_body(3, 0, direct_mismatch_reaches_the_links);
    run_body(3, 0, links_failure_reaches_direct);
    run_body(2, 1, link_end_reads_the_recorded_failure);
}

/* Rank 1 writes the header and half the payload of a broadcast into its link to rank 0, then is
   killed: rank 0 names it as dead instead of waiting for the rest. */
DTEST(peer_dying_mid_message_on_a_link_is_named) {
    dopt_shm_config cfg = config_for(NULL, 0, 0, 60000, NULL);
    dopt_comm *c;
    size_t n = 4096;
    float *x = (float *)calloc(n, sizeof(float));
    dopt_status s;
    DT_CHECK(x != NULL);
    cfg.engine = 1;
    DT_OK(dopt_shm_fork(&c, 2, &cfg));
    DT_OK(dopt_barrier(c));
    if (c->rank == 1) {
        unsigned char hdr[DOPT_FRAME_BYTES];
        dopt_coll_desc d;
        dopt_iov parts[2];
        int err = 0;
        memset(&d, 0, sizeof d);
        d.kind = DOPT_COLL_BROADCAST;
        d.root = 1;
        d.seq = c->seq + 1;
        d.count = n * sizeof(float);
        dopt__frame_encode(hdr, DOPT__FRAME_DATA, &d, 1, 0, d.count);
        parts[0].base = hdr;
        parts[0].len = sizeof hdr;
        parts[1].base = x;
        parts[1].len = d.count / 2;
        DT_CHECK(c->vt->link_send(c, 0, parts, 2, &err) == (long)(sizeof hdr + d.count / 2));
        kill(getpid(), SIGKILL);
    }
    s = dopt_broadcast(c, x, n * sizeof(float), 1);
    DT_EQ_INT(s, DOPT_ERR_PEER_LOST);
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 1") != NULL, "%s", dopt_comm_detail(c));
    DT_EQ_INT(dopt_comm_finish(c, 0), 128 + SIGKILL);
    free(x);
}

/* ------------------------------------------------------------------ mismatches */

/* Every rank fails with MISMATCH (strictly: this backend detects it on every rank itself), and
   the detail names the other side: the last rank for the others, rank 0 for the last. */
static void run_mismatch(int nranks, void (*check)(dopt_comm *)) {
    dopt_comm *c;
    char want[32];
    DT_OK(dopt_shm_fork(&c, nranks, NULL));
    check(c);
    DT_CHECKF(c->error == DOPT_ERR_MISMATCH, "rank %d: %s", c->rank, dopt_comm_detail(c));
    snprintf(want, sizeof want, "rank %d called", c->rank == nranks - 1 ? 0 : nranks - 1);
    DT_CHECKF(strstr(dopt_comm_detail(c), want) != NULL, "rank %d: detail does not name the other side: %s", c->rank,
              dopt_comm_detail(c));
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

DTEST(mismatch_count_world_2_fails_on_every_rank) { run_mismatch(2, conformance_mismatch_count); }
DTEST(mismatch_count_world_3_fails_on_every_rank) { run_mismatch(3, conformance_mismatch_count); }
DTEST(mismatch_op_world_2_fails_on_every_rank) { run_mismatch(2, conformance_mismatch_op); }
DTEST(mismatch_op_world_3_fails_on_every_rank) { run_mismatch(3, conformance_mismatch_op); }
DTEST(mismatch_kind_world_3_fails_on_every_rank) { run_mismatch(3, conformance_mismatch_kind); }
DTEST(mismatch_in_flight_world_3_fails_every_later_request) { run_mismatch(3, conformance_mismatch_in_flight); }

/* Large and small paths disagree (one rank one-shot, the others pipelined): still a mismatch,
   not a hang. */
DTEST(mismatch_between_oneshot_and_pipelined_sizes) {
    dopt_comm *c;
    float *buf = (float *)calloc(100000, sizeof(float));
    dopt_status s;
    DT_OK(dopt_shm_fork(&c, 3, NULL));
    s = dopt_allreduce(c, buf, c->rank == 1 ? 10 : 100000, DOPT_F32, DOPT_SUM);
    DT_CHECKF(s == DOPT_ERR_MISMATCH, "rank %d: %s", c->rank, dopt_comm_detail(c));
    free(buf);
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

/* ------------------------------------------------------------------ dead and stuck peers */

static void *kill_self_soon(void *arg) {
    usleep((useconds_t)(size_t)arg);
    raise(SIGKILL);
    return NULL;
}

/* World of 3, 2 s timeout; rank 2 is killed by SIGKILL while the ranks run 64 MiB allreduces.
   Every survivor fails with PEER_LOST (or TIMEOUT) naming rank 2 — in far less than the test's
   20 s budget — and a later call fails at once with the same status; rank 0's finish reports
   the killed rank. */
DTEST(peer_killed_mid_allreduce_reports_rank) {
    enum { N = 16 << 20 };
    captured_log log;
    dopt_shm_config cfg;
    dopt_comm *c;
    float *buf = NULL;
    dopt_status s = DOPT_OK;
    int it;
    memset(&log, 0, sizeof log);
    cfg = config_for(NULL, 0, 0, 2000, &log);
    DT_OK(dopt_shm_fork(&c, 3, &cfg));
    buf = (float *)malloc((size_t)N * sizeof(float));
    DT_CHECK(buf != NULL);
    for (it = 0; it < N; it++) buf[it] = 1.0f;
    if (c->rank == 2) {
        pthread_t t;
        DT_CHECK(pthread_create(&t, NULL, kill_self_soon, (void *)(size_t)50000) == 0);
    }
    for (it = 0; it < 1000 && s == DOPT_OK; it++) s = dopt_allreduce(c, buf, N, DOPT_F32, DOPT_MEAN);
    DT_CHECKF(c->rank != 2, "rank 2 outlived its SIGKILL");
    DT_CHECKF(s == DOPT_ERR_PEER_LOST || s == DOPT_ERR_TIMEOUT, "rank %d: status %d: %s", c->rank, (int)s,
              dopt_comm_detail(c));
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 2 ") != NULL, "rank %d: detail does not name rank 2: %s", c->rank,
              dopt_comm_detail(c));
    DT_EQ_INT(dopt_barrier(c), s);
    DT_EQ_INT(dopt_allreduce(c, buf, 4, DOPT_F32, DOPT_SUM), s);
    free(buf);
    DT_EQ_INT(dopt_comm_finish(c, 0), 128 + SIGKILL);
    DT_CHECKF(strstr(log.text, "rank 2 (pid") != NULL && strstr(log.text, "killed by signal 9") != NULL, "log: %s",
              log.text);
}

/* A rank that forked a helper process of its own (which outlives it) is still seen to die:
   the child inherits neither the rank's lock nor its mapping. */
DTEST(dead_rank_with_forked_helper_is_still_seen_dead) {
    dopt_shm_config cfg = config_for(NULL, 0, 0, 20000, NULL);
    dopt_comm *c;
    dopt_status s;
    DT_OK(dopt_shm_fork(&c, 2, &cfg));
    if (c->rank == 1) {
        if (fork() == 0) {
            sleep(30); /* the test's process group is killed at the end */
            _exit(0);
        }
        raise(SIGKILL);
    }
    s = dopt_barrier(c);
    DT_EQ_INT(s, DOPT_ERR_PEER_LOST);
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 1 (pid") != NULL && strstr(dopt_comm_detail(c), "died") != NULL, "%s",
              dopt_comm_detail(c));
    DT_EQ_INT(dopt_comm_finish(c, 0), 128 + SIGKILL);
}

/* A rank that is alive but never calls: the waiting rank times out naming it, and the late rank
   learns of the failure when it finally calls. */
DTEST(stuck_peer_gives_timeout_naming_it) {
    dopt_shm_config cfg = config_for(NULL, 0, 0, 1000, NULL);
    dopt_comm *c;
    dopt_status s;
    DT_OK(dopt_shm_fork(&c, 2, &cfg));
    if (c->rank == 1) usleep(2500000);
    s = dopt_barrier(c);
    DT_EQ_INT(s, DOPT_ERR_TIMEOUT);
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 1 did not arrive within 1000 ms") != NULL, "rank %d: %s", c->rank,
              dopt_comm_detail(c));
    if (c->rank == 1) DT_CHECKF(strstr(dopt_comm_detail(c), "reported by rank 0") != NULL, "%s", dopt_comm_detail(c));
    dopt_comm_set_timeout(c, 10000); /* finish waits this long for rank 1, still asleep */
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

DTEST(rank_that_never_joins_times_out_and_name_is_removed) {
    captured_log log;
    char name[96];
    dopt_shm_config cfg;
    dopt_comm *c = (dopt_comm *)&log; /* must be reset to NULL */
    memset(&log, 0, sizeof log);
    unique_name(name, sizeof name, "nojoin");
    cfg = config_for(name, 0, 2, 500, &log);
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_TIMEOUT);
    DT_CHECK(c == NULL);
    DT_CHECKF(strstr(log.text, "rank 1 did not join within 500 ms") != NULL, "log: %s", log.text);
    DT_CHECK(!segment_exists(name));
}

/* While a job forms, the ranks that have not joined are named every 5 s, and at the timeout. */
DTEST(waiting_for_missing_ranks_names_them_until_the_timeout) {
    captured_log log;
    char name[96];
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    memset(&log, 0, sizeof log);
    unique_name(name, sizeof name, "waiting");
    cfg = config_for(name, 0, 3, 5600, &log);
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_TIMEOUT);
    DT_CHECKF(strstr(log.text, "waiting for ranks 1, 2 (1 of 3 joined, 5 s)") != NULL, "log: %s", log.text);
    DT_CHECKF(strstr(log.text, "ranks 1, 2 did not join within 5600 ms (1 of 3 joined)") != NULL, "log: %s", log.text);
}

DTEST(peer_that_leaves_gives_peer_lost) {
    dopt_comm *c;
    dopt_status s;
    DT_OK(dopt_shm_fork(&c, 2, NULL));
    if (c->rank == 1) dopt_comm_finish(c, 0);
    s = dopt_barrier(c);
    DT_EQ_INT(s, DOPT_ERR_PEER_LOST);
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 1 (pid") != NULL, "%s", dopt_comm_detail(c));
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

/* A rank poisoned by its own bad call (never reaching the backend) tells the others when it
   leaves, instead of leaving them to the timeout. */
DTEST(rank_failing_locally_releases_its_peers) {
    dopt_shm_config cfg = config_for(NULL, 0, 0, 60000, NULL);
    dopt_comm *c;
    dopt_status s;
    DT_OK(dopt_shm_fork(&c, 3, &cfg));
    if (c->rank == 2) {
        DT_EQ_INT(dopt_allreduce(c, NULL, 5, DOPT_F32, DOPT_SUM), DOPT_ERR_INVALID);
        dopt_comm_finish(c, 0);
    }
    s = dopt_allreduce(c, &cfg, 0, DOPT_F32, DOPT_SUM);
    DT_EQ_INT(s, DOPT_ERR_PEER_LOST);
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 2 left the job after an error") != NULL, "%s", dopt_comm_detail(c));
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

/* ------------------------------------------------------------------ segments and names */

DTEST(formed_job_leaves_no_name_behind) {
    char name[96];
    dopt_shm_config cfg;
    dopt_comm *c;
    unique_name(name, sizeof name, "formed");
    cfg = config_for(name, 0, 0, 10000, NULL);
    DT_OK(dopt_shm_fork(&c, 2, &cfg));
    DT_CHECK(!segment_exists(name)); /* so a job killed from now on leaves nothing behind */
    DT_OK(dopt_barrier(c));
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

/* A job killed with SIGKILL while forming leaves its segment; the next job under the same name
   removes it and runs. */
DTEST(stale_segment_from_killed_job_is_replaced) {
    char name[96];
    captured_log log;
    dopt_shm_config cfg;
    dopt_comm *c;
    float x[3] = {1, 2, 3};
    pid_t victim;
    memset(&log, 0, sizeof log);
    unique_name(name, sizeof name, "stale");
    victim = fork();
    if (victim == 0) {
        dopt_shm_config alone = config_for(name, 0, 2, 60000, NULL);
        dopt_comm *never;
        dopt_shm_create(&never, &alone); /* waits for a rank 1 that never comes */
        _exit(0);
    }
    wait_for_segment(name);
    kill(victim, SIGKILL);
    waitpid(victim, NULL, 0);
    DT_CHECK(segment_exists(name));
    cfg = config_for(name, 0, 0, 10000, &log);
    DT_OK(dopt_shm_fork(&c, 2, &cfg));
    DT_OK(dopt_allreduce(c, x, 3, DOPT_F32, DOPT_SUM));
    DT_CHECK(x[0] == 2 && x[1] == 4 && x[2] == 6);
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
    DT_CHECK(!segment_exists(name));
}

/* While a job forms, a second job under its name is refused (not joined, not taken over), and
   a rank of another world size is refused too; the forming job is not disturbed. */
DTEST(live_job_name_is_refused_to_second_job) {
    char name[96];
    captured_log log;
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    pid_t first;
    int status = 0;
    memset(&log, 0, sizeof log);
    unique_name(name, sizeof name, "live");
    first = fork();
    if (first == 0) {
        dopt_shm_config own = config_for(name, 0, 2, 60000, NULL);
        dopt_comm *mine;
        if (dopt_shm_create(&mine, &own) != DOPT_OK) _exit(2);
        if (dopt_barrier(mine) != DOPT_OK) _exit(3);
        dopt_comm_destroy(mine);
        _exit(0);
    }
    wait_for_segment(name);
    cfg = config_for(name, 0, 2, 3000, &log);
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "rank 0 of job") != NULL && strstr(log.text, "already held by live process") != NULL,
              "log: %s", log.text);
    log.text[0] = '\0';
    cfg = config_for(name, 1, 3, 3000, &log);
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "was created for 2 ranks") != NULL, "log: %s", log.text);
    /* the rightful rank 1 still joins the first job */
    cfg = config_for(name, 1, 2, 10000, NULL);
    DT_OK(dopt_shm_create(&c, &cfg));
    DT_OK(dopt_barrier(c));
    dopt_comm_destroy(c);
    waitpid(first, &status, 0);
    DT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* A segment of another protocol version is refused, not overwritten, while a live process
   holds it; once nobody does (and it is a few seconds old), a new job replaces it. */
DTEST(segment_of_other_protocol_version_is_refused_while_held) {
    char name[96], path[128];
    captured_log log;
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    struct flock fl;
    uint32_t *words;
    int fd;
    memset(&log, 0, sizeof log);
    unique_name(name, sizeof name, "version");
    snprintf(path, sizeof path, "/dopt.%s", name);
    fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    DT_CHECK(fd >= 0);
    DT_CHECK(ftruncate(fd, 1 << 20) == 0);
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = 0;
    fl.l_len = 1;
    DT_CHECK(fcntl(fd, F_OFD_SETLK, &fl) == 0);
    words = (uint32_t *)mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    DT_CHECK(words != MAP_FAILED);
    words[2] = 99; /* version */
    memcpy(words, "DOPTSHM1", 8);
    cfg = config_for(name, 1, 2, 2000, &log);
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_PROTOCOL);
    DT_CHECKF(strstr(log.text, "protocol version") != NULL, "log: %s", log.text);
    DT_CHECK(words[2] == 99);
    munmap(words, 4096); /* the mapping holds the open file too: both go to release the lock */
    close(fd);           /* the segment is now a dead job's */
    sleep(3);
    cfg = config_for(name, 0, 0, 30000, NULL); /* a bound on the join, not a figure: loaded machines are slow */
    DT_OK(dopt_shm_fork(&c, 2, &cfg));
    DT_OK(dopt_barrier(c));
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
    DT_CHECK(!segment_exists(name));
}

/* ------------------------------------------------------------------ configuration */

static void env_rank(int rank, void *arg) {
    char r[16];
    dopt_comm *c;
    int64_t v[3] = {rank, 1, -rank};
    snprintf(r, sizeof r, "%d", rank);
    setenv("DOPT_SHM_NAME", (const char *)arg, 1);
    setenv("DOPT_WORLD_SIZE", "3", 1);
    setenv("DOPT_RANK", r, 1);
    setenv("DOPT_TIMEOUT_MS", "1234", 1);
    DT_OK(dopt_shm_create(&c, NULL));
    DT_EQ_INT(c->rank, rank);
    DT_EQ_INT(c->size, 3);
    DT_EQ_INT(c->timeout_ms, 1234);
    DT_OK(dopt_allreduce(c, v, 3, DOPT_I64, DOPT_SUM));
    DT_CHECK(v[0] == 3 && v[1] == 3 && v[2] == -3);
    dopt_comm_destroy(c);
}

/* The launcher path: separately started processes join by name from the environment. */
DTEST(ranks_started_separately_join_through_environment) {
    char name[96];
    unique_name(name, sizeof name, "env");
    DT_EQ_INT(dtest_spawn(3, env_rank, name, 60), 0);
}

DTEST(bad_configuration_is_invalid_and_explained) {
    captured_log log;
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    memset(&log, 0, sizeof log);
    unsetenv("DOPT_WORLD_SIZE");
    unsetenv("DOPT_RANK");
    unsetenv("DOPT_SHM_NAME");
    cfg = config_for("ok", 0, 0, 0, &log);
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID); /* a config never reads the environment */
    DT_CHECKF(strstr(log.text, "size is 0") != NULL, "log: %s", log.text);
    setenv("DOPT_WORLD_SIZE", "2", 1);
    setenv("DOPT_RANK", "1", 1);
    setenv("DOPT_SHM_NAME", "from-env", 1);
    setenv("DOPT_TIMEOUT_MS", "4321", 1);
    DT_OK(dopt_shm_config_from_env(&cfg));
    DT_CHECK(cfg.size == 2 && cfg.rank == 1 && cfg.timeout_ms == 4321 && cfg.name == NULL &&
             !strcmp(cfg.env_name, "from-env"));
    unsetenv("DOPT_WORLD_SIZE");
    unsetenv("DOPT_RANK");
    unsetenv("DOPT_SHM_NAME");
    unsetenv("DOPT_TIMEOUT_MS");
    /* a launcher's variables say the same; ranks on several hosts cannot share memory */
    setenv("OMPI_COMM_WORLD_RANK", "3", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    setenv("OMPI_MCA_ess_base_jobid", "77", 1);
    cfg = config_for("ok", 0, 0, 0, &log);
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "2 of the 4 ranks on this one") != NULL, "log: %s", log.text);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1);
    DT_OK(dopt_shm_config_from_env(&cfg));
    DT_CHECKF(cfg.size == 4 && cfg.rank == 3 && !strcmp(cfg.env_name, "ompi-77"), "%d %d %s", cfg.size, cfg.rank,
              cfg.env_name);
    unsetenv("OMPI_COMM_WORLD_RANK");
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    unsetenv("OMPI_MCA_ess_base_jobid");
    cfg = config_for("ok", 0, 0, 0, &log);
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "DOPT_WORLD_SIZE is not set") != NULL, "log: %s", log.text);
    /* the launch variables: each mistake named with its value and the rule */
    setenv("DOPT_WORLD_SIZE", "abc", 1);
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "DOPT_WORLD_SIZE=\"abc\" is not a number") != NULL, "log: %s", log.text);
    setenv("DOPT_WORLD_SIZE", "2", 1);
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "DOPT_RANK is not set") != NULL, "log: %s", log.text);
    setenv("DOPT_RANK", "2", 1);
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "DOPT_RANK=2 is not below DOPT_WORLD_SIZE=2") != NULL, "log: %s", log.text);
    setenv("DOPT_RANK", "0", 1);
    setenv("DOPT_TIMEOUT_MS", "5s", 1);
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "DOPT_TIMEOUT_MS=\"5s\" is not a number") != NULL, "log: %s", log.text);
    unsetenv("DOPT_WORLD_SIZE");
    unsetenv("DOPT_RANK");
    unsetenv("DOPT_TIMEOUT_MS");
    cfg = config_for("bad/name", 0, 2, 0, &log);
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID);
    cfg = config_for(NULL, 0, 2, 0, &log);
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "no job name") != NULL, "log: %s", log.text);
    cfg = config_for("ok", 2, 2, 0, &log);
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID);
    cfg = config_for("ok", 0, 2, 0, &log);
    cfg.chunk_bytes = 10;
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_shm_create(NULL, &cfg), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_shm_fork(&c, 0, NULL), DOPT_ERR_INVALID);
    DT_CHECK(c == NULL);
    /* a world of one needs no name and no segment */
    cfg = config_for(NULL, 0, 1, 0, NULL);
    DT_OK(dopt_shm_create(&c, &cfg));
    DT_OK(dopt_barrier(c));
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ fork helper */

/* A configuration every rank rejects: the error comes back in the caller alone, every child has
   been reaped, and no segment is left behind. */
DTEST(failed_fork_returns_in_caller_with_children_reaped) {
    char name[96];
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    unique_name(name, sizeof name, "badfork");
    cfg = config_for(name, 0, 0, 5000, NULL);
    cfg.chunk_bytes = 10;
    DT_EQ_INT(dopt_shm_fork(&c, 3, &cfg), DOPT_ERR_INVALID);
    DT_CHECK(c == NULL);
    DT_CHECK(waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD);
    DT_CHECK(!segment_exists(name));
}

DTEST(fork_finish_reports_crashed_child) {
    captured_log log;
    dopt_shm_config cfg;
    dopt_comm *c;
    memset(&log, 0, sizeof log);
    cfg = config_for(NULL, 0, 0, 10000, &log);
    DT_OK(dopt_shm_fork(&c, 4, &cfg));
    if (c->rank == 1) _exit(3);
    if (c->rank == 2) {
        signal(SIGSEGV, SIG_DFL); /* AddressSanitizer would catch it */
        raise(SIGSEGV);
    }
    DT_EQ_INT(dopt_comm_finish(c, 0), 3); /* the lowest failed rank's status */
    DT_CHECKF(strstr(log.text, "rank 1 (pid") != NULL && strstr(log.text, "exited with status 3") != NULL, "log: %s",
              log.text);
    DT_CHECKF(strstr(log.text, "rank 2 (pid") != NULL && strstr(log.text, "killed by signal 11") != NULL, "log: %s",
              log.text);
    DT_CHECK(strstr(log.text, "rank 3 (pid") == NULL);
}

DTEST(fork_finish_returns_rank_0_status_first) {
    dopt_comm *c;
    DT_OK(dopt_shm_fork(&c, 2, NULL));
    DT_EQ_INT(dopt_comm_finish(c, c->rank == 1 ? 4 : 7), 7);
}

/* The old, transport-named finish is the same call; finish on a group destroys only the group;
   ranks that joined by name (worlds.h) end through it too. */
DTEST(finish_under_its_old_name_and_on_groups) {
    dopt_comm *c, *g;
    DT_OK(dopt_shm_fork(&c, 2, NULL));
    DT_OK(dopt_comm_split(c, 0, 0, &g));
    DT_EQ_INT(dopt_comm_finish(g, 5), 5);
    DT_OK(dopt_barrier(c));
    DT_EQ_INT(dopt_shm_fork_finish(c, c->rank == 1 ? 4 : 0), 4);
    DT_EQ_INT(dopt_comm_finish(NULL, 6), 6);
}

/* ------------------------------------------------------------------ edge sizes and pipelining */

DTEST(zero_length_calls_are_legal_and_still_checked) {
    dopt_comm *c;
    size_t sizes[3];
    char one = 'x';
    DT_OK(dopt_shm_fork(&c, 3, NULL));
    DT_OK(dopt_allreduce(c, NULL, 0, DOPT_F64, DOPT_MAX));
    DT_OK(dopt_allgather(c, NULL, NULL, 0));
    DT_OK(dopt_allgatherv(c, NULL, 0, NULL, 0, sizes));
    DT_CHECK(sizes[0] == 0 && sizes[1] == 0 && sizes[2] == 0);
    DT_OK(dopt_broadcast(c, NULL, 0, 2));
    DT_OK(dopt_barrier(c));
    /* zero against one byte is a mismatch, found on every rank */
    DT_EQ_INT(dopt_broadcast(c, &one, c->rank == 0 ? 1 : 0, 0), DOPT_ERR_MISMATCH);
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

static uint64_t fnv(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 1469598103934665603ull;
    while (n--) h = (h ^ *b++) * 1099511628211ull;
    return h;
}

/* Chunks of 1000 bytes (not a multiple of any element size or of 64) against messages of odd
   sizes: results exact for integer-valued inputs and bitwise equal on every rank. */
DTEST(pipelining_with_chunks_smaller_than_message) {
    static const size_t counts[] = {251, 252, 253, 1000, 4099, 100003};
    dopt_shm_config cfg = config_for(NULL, 0, 0, 30000, NULL);
    dopt_comm *c;
    size_t k, i;
    cfg.chunk_bytes = 1000;
    DT_OK(dopt_shm_fork(&c, 3, &cfg));
    for (k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        size_t n = counts[k], total = 0, sizes[3], off = 0;
        float *f = (float *)malloc(n * sizeof(float));
        double *g = (double *)malloc(n * sizeof(double));
        unsigned char *bytes = (unsigned char *)malloc(n), *all = (unsigned char *)malloc(3 * n);
        uint64_t hashes[3], mine;
        int r;
        for (i = 0; i < n; i++) {
            f[i] = (float)((int)(i % 1001) - 500 + c->rank);
            g[i] = (double)(i % 77) * (c->rank + 1);
        }
        DT_OK(dopt_allreduce(c, f, n, DOPT_F32, DOPT_SUM));
        DT_OK(dopt_allreduce(c, g, n, DOPT_F64, DOPT_MAX));
        for (i = 0; i < n; i++) {
            DT_CHECKF(f[i] == (float)(3 * ((int)(i % 1001) - 500) + 3), "n=%zu: f[%zu] = %g", n, i, f[i]);
            DT_CHECKF(g[i] == (double)(i % 77) * 3, "n=%zu: g[%zu] = %g", n, i, g[i]);
        }
        mine = fnv(f, n * sizeof(float));
        DT_OK(dopt_allgather(c, &mine, hashes, sizeof mine));
        DT_CHECK(hashes[0] == mine && hashes[1] == mine && hashes[2] == mine);
        /* broadcast from rank 1 */
        for (i = 0; i < n; i++) bytes[i] = c->rank == 1 ? (unsigned char)(i * 7 + 1) : 0;
        DT_OK(dopt_broadcast(c, bytes, n, 1));
        for (i = 0; i < n; i++) DT_CHECK(bytes[i] == (unsigned char)(i * 7 + 1));
        /* unequal blocks: n, 0 and n/2 + 1 bytes */
        {
            size_t send = c->rank == 0 ? n : c->rank == 1 ? 0 : n / 2 + 1;
            for (i = 0; i < send; i++) bytes[i] = (unsigned char)(i * 3 + c->rank);
            DT_OK(dopt_allgatherv(c, bytes, send, all, 3 * n, sizes));
        }
        for (r = 0; r < 3; r++) {
            DT_EQ_INT(sizes[r], r == 0 ? n : r == 1 ? 0 : n / 2 + 1);
            for (i = 0; i < sizes[r]; i++) DT_CHECK(all[off + i] == (unsigned char)(i * 3 + r));
            off += sizes[r];
            total += sizes[r];
        }
        DT_EQ_INT(total, n + n / 2 + 1);
        free(f);
        free(g);
        free(bytes);
        free(all);
    }
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

/* In place: send is this rank's own block of recv. */
DTEST(allgather_in_place) {
    dopt_comm *c;
    int v[4 * 1000], i, r;
    DT_OK(dopt_shm_fork(&c, 4, NULL));
    for (i = 0; i < 1000; i++) v[c->rank * 1000 + i] = c->rank * 100000 + i;
    DT_OK(dopt_allgather(c, v + c->rank * 1000, v, 1000 * sizeof(int)));
    for (r = 0; r < 4; r++)
        for (i = 0; i < 1000; i++) DT_EQ_INT(v[r * 1000 + i], r * 100000 + i);
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

int main(int argc, char **argv) {
    dtest_set_timeout("peer_killed_mid_allreduce_reports_rank", 20);
    dtest_set_timeout("stuck_peer_gives_timeout_naming_it", 20);
    dtest_set_timeout("rank_that_never_joins_times_out_and_name_is_removed", 10);
    return dtest_main(argc, argv);
}
