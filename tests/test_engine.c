/* Tests of the collective engine (distopt.h) through the smallest backend there is: links over
   socketpairs made before the ranks fork. It is also the example of the backend contract: a
   backend that can connect its ranks, send and receive bytes without blocking, and wait for a
   link to become ready gets every collective, requests included, from the engine.

   The allocator is counted (DOPT_MALLOC / DOPT_FREE): after a collective's first call, later
   calls of the same shape allocate nothing, blocking or not. */
#define DOPT_MALLOC(sz) engine_test_malloc(sz)
#define DOPT_FREE(p) engine_test_free(p)
#include <stdlib.h>
static long engine_test_allocs;
static void *engine_test_malloc(size_t n) {
    engine_test_allocs++;
    return malloc(n);
}
static void engine_test_free(void *p) { free(p); }

#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../engine.h"
#include "dtest.h"
#include "conformance.h"
#include "groups.h"
#include "links.h"

#include <math.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* ------------------------------------------------------------------ the socketpair backend */

#define PAIR_MAX 8

typedef struct pair_links {
    int fd[PAIR_MAX]; /* fd[p]: this rank's end of the socketpair to rank p (-1 for itself) */
    struct pollfd pfd[PAIR_MAX];
    uint64_t sent[PAIR_MAX]; /* bytes written to each peer (the tests read it) */
} pair_links;

static long pair_send(dopt_comm *c, int peer, const dopt_iov *parts, int nparts, int *err) {
    pair_links *l = (pair_links *)c->impl;
    struct iovec iov[4];
    struct msghdr msg;
    ssize_t n;
    int i;
    for (i = 0; i < nparts && i < 4; i++) {
        iov[i].iov_base = (void *)(uintptr_t)parts[i].base;
        iov[i].iov_len = parts[i].len;
    }
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)i;
    n = sendmsg(l->fd[peer], &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) l->sent[peer] += (uint64_t)n;
    if (n >= 0) return (long)n;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    *err = errno;
    return -1;
}

static long pair_recv(dopt_comm *c, int peer, void *dst, size_t cap, int *err) {
    pair_links *l = (pair_links *)c->impl;
    ssize_t n = recv(l->fd[peer], dst, cap, MSG_DONTWAIT);
    if (n > 0) return (long)n;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    *err = n == 0 ? 0 : errno;
    return -1;
}

static int pair_wait(dopt_comm *c, dopt_link_poll *polls, int npolls, int timeout_ms, int *err) {
    pair_links *l = (pair_links *)c->impl;
    int i, n, ready = 0;
    for (i = 0; i < npolls; i++) {
        l->pfd[i].fd = l->fd[polls[i].peer];
        l->pfd[i].events = (short)(((polls[i].events & DOPT_LINK_IN) ? POLLIN : 0) |
                                   ((polls[i].events & DOPT_LINK_OUT) ? POLLOUT : 0));
        l->pfd[i].revents = 0;
    }
    n = poll(l->pfd, (nfds_t)npolls, timeout_ms);
    if (n < 0) {
        if (errno == EINTR) return 0;
        *err = errno;
        return -1;
    }
    if (n == 0 && timeout_ms == 0) sched_yield();
    for (i = 0; i < npolls; i++) {
        short re = l->pfd[i].revents;
        polls[i].revents = (short)(((re & (POLLIN | POLLHUP | POLLERR)) ? DOPT_LINK_IN : 0) |
                                   ((re & (POLLOUT | POLLERR)) ? DOPT_LINK_OUT : 0));
        ready += polls[i].revents != 0;
    }
    return ready;
}

static void pair_close(dopt_comm *c, int peer) { shutdown(((pair_links *)c->impl)->fd[peer], SHUT_WR); }

static void pair_destroy(dopt_comm *c) {
    pair_links *l = (pair_links *)c->impl;
    int p;
    if (l == NULL) return;
    dopt_links_goodbye(c, 1000);
    for (p = 0; p < c->size; p++)
        if (l->fd[p] >= 0) close(l->fd[p]);
    free(l);
    c->impl = NULL;
}

static const dopt_comm_vtable pair_vtable = {"pairs", NULL, NULL, NULL, NULL, pair_destroy, sizeof(dopt_comm_vtable),
                                             0u, pair_send, pair_recv, pair_wait, pair_close, NULL, NULL,
                                             dopt_engine_provider, NULL, NULL, NULL};

/* Every pair (i, j) of an n-rank world gets one socketpair before the fork: sv[i][j][0] is i's end. */
typedef struct pair_world {
    int n;
    int sv[PAIR_MAX][PAIR_MAX][2];
    void (*body)(dopt_comm *c);
} pair_world;

static void pair_rank(int rank, void *arg) {
    pair_world *w = (pair_world *)arg;
    pair_links *l = (pair_links *)malloc(sizeof *l);
    dopt_comm *c;
    int i, j;
    DT_CHECK(l != NULL);
    for (i = 0; i < w->n; i++)
        for (j = i + 1; j < w->n; j++) {
            if (i != rank) close(w->sv[i][j][0]);
            if (j != rank) close(w->sv[i][j][1]);
        }
    memset(l, 0, sizeof *l);
    for (j = 0; j < PAIR_MAX; j++) l->fd[j] = -1;
    for (j = 0; j < w->n; j++)
        if (j != rank) l->fd[j] = rank < j ? w->sv[rank][j][0] : w->sv[j][rank][1];
    DT_OK(dopt_comm_new(&c, rank, w->n, &pair_vtable, l));
    c->timeout_ms = 30000;
    w->body(c);
    dopt_comm_destroy(c);
}

static void pair_run(int n, void (*body)(dopt_comm *c)) {
    pair_world w;
    int i, j;
    memset(&w, 0, sizeof w);
    w.n = n;
    w.body = body;
    for (i = 0; i < n; i++)
        for (j = i + 1; j < n; j++) DT_CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, w.sv[i][j]) == 0);
    DT_EQ_INT(dtest_spawn(n, pair_rank, &w, 100), 0);
    for (i = 0; i < n; i++)
        for (j = i + 1; j < n; j++) close(w.sv[i][j][0]), close(w.sv[i][j][1]);
}

/* ------------------------------------------------------------------ conformance */

DTEST(conformance_over_socketpairs_worlds_of_1_to_4) {
    int n;
    for (n = 1; n <= 4; n++) pair_run(n, conformance_run);
}

DTEST(links_keep_order_and_bytes_at_every_size_over_socketpairs) {
    pair_run(2, links_conformance);
    pair_run(4, links_conformance);
}

DTEST(mismatch_fails_every_rank_over_socketpairs) {
    pair_run(2, conformance_mismatch_count);
    pair_run(3, conformance_mismatch_op);
    pair_run(3, conformance_mismatch_kind);
    pair_run(3, conformance_mismatch_in_flight);
}

/* ------------------------------------------------------------------ hosts */

/* The host of every rank for the next pair_run (fork passes it on), and when two-level runs. */
static int two_level_hosts[PAIR_MAX];
static int two_level_mode;

static void with_hosts(dopt_comm *c) { DT_OK(dopt_comm_set_hosts(c, two_level_hosts, two_level_mode)); }

static void two_level_conformance(dopt_comm *c) {
    with_hosts(c);
    conformance_run(c);
}

/* hosts × per_host ranks, rank r on host r / per_host */
static void pair_run_hosts(int hosts, int per_host, int mode, void (*body)(dopt_comm *c)) {
    int r;
    for (r = 0; r < hosts * per_host; r++) two_level_hosts[r] = r / per_host;
    two_level_mode = mode;
    pair_run(hosts * per_host, body);
}

DTEST(two_level_allreduce_passes_conformance_on_2x2_3x2_2x3_4x2) {
    pair_run_hosts(2, 2, DOPT_TWO_LEVEL_ON, two_level_conformance);
    pair_run_hosts(3, 2, DOPT_TWO_LEVEL_ON, two_level_conformance);
    pair_run_hosts(2, 3, DOPT_TWO_LEVEL_ON, two_level_conformance);
    pair_run_hosts(4, 2, DOPT_TWO_LEVEL_AUTO, two_level_conformance);
}

/* Hosts of 3 and 2 ranks: a large allreduce goes around the flat ring (rank r sends only to r + 1). */
static void uneven_hosts_run_flat(dopt_comm *c) {
    pair_links *l = (pair_links *)c->impl;
    size_t n = (size_t)1 << 18;
    float *x = (float *)calloc(n, sizeof(float));
    int p;
    DT_CHECK(x != NULL);
    with_hosts(c);
    memset(l->sent, 0, sizeof l->sent);
    DT_OK(dopt_allreduce(c, x, n, DOPT_F32, DOPT_SUM));
    for (p = 0; p < c->size; p++)
        DT_CHECKF((l->sent[p] > 0) == (p == (c->rank + 1) % c->size), "rank %d sent %llu bytes to rank %d", c->rank,
                  (unsigned long long)l->sent[p], p);
    free(x);
    conformance_run(c);
}

DTEST(uneven_hosts_fall_back_to_the_flat_ring) {
    static const int hosts[5] = {7, 7, 7, 3, 3};
    memcpy(two_level_hosts, hosts, sizeof hosts);
    two_level_mode = DOPT_TWO_LEVEL_ON;
    pair_run(5, uneven_hosts_run_flat);
}

/* The two-level schedule carries what it should where it should: of an allreduce of S bytes at
   hosts × local, a rank sends 2·(local−1)/local·S to its host's next rank and
   2·(hosts−1)/hosts·S/local to the next host's rank at its place, and nothing to anyone else;
   integer-valued inputs give the flat ring's bits and the serial sum. */
static void two_level_routes_and_matches_flat(dopt_comm *c) {
    pair_links *l = (pair_links *)c->impl;
    size_t n = (size_t)1 << 20, i;
    int hosts = 4, local = 2, p, host = c->rank / local, pos = c->rank % local;
    int host_next = host * local + (pos + 1) % local, cross_next = ((host + 1) % hosts) * local + pos;
    float *two = (float *)malloc(n * sizeof(float)), *flat = (float *)malloc(n * sizeof(float));
    double S = (double)n * sizeof(float);
    DT_CHECK(two != NULL && flat != NULL && c->size == hosts * local);
    for (i = 0; i < n; i++) two[i] = flat[i] = (float)((int)((i * 7 + (size_t)c->rank * 13) % 201) - 100);
    DT_OK(dopt_comm_set_hosts(c, two_level_hosts, DOPT_TWO_LEVEL_AUTO));
    DT_OK(dopt_barrier(c));
    memset(l->sent, 0, sizeof l->sent);
    DT_OK(dopt_allreduce(c, two, n, DOPT_F32, DOPT_SUM));
    for (p = 0; p < c->size; p++) {
        double want = p == host_next    ? 2.0 * (local - 1) / local * S
                      : p == cross_next ? 2.0 * (hosts - 1) / hosts * S / local
                                        : 0;
        DT_CHECKF(fabs((double)l->sent[p] - want) <= 4096.0, "rank %d sent %llu bytes to rank %d, %.0f expected", c->rank,
                  (unsigned long long)l->sent[p], p, want);
    }
    DT_OK(dopt_comm_set_hosts(c, two_level_hosts, DOPT_TWO_LEVEL_OFF));
    DT_OK(dopt_allreduce(c, flat, n, DOPT_F32, DOPT_SUM));
    DT_CHECKF(memcmp(two, flat, n * sizeof(float)) == 0, "rank %d: two-level and flat results differ", c->rank);
    for (i = 0; i < n; i++) {
        double want = 0;
        int r;
        for (r = 0; r < c->size; r++) want += (double)((int)((i * 7 + (size_t)r * 13) % 201) - 100);
        DT_CHECKF((double)two[i] == want, "rank %d: element %zu is %g, the serial sum %g", c->rank, i, (double)two[i], want);
    }
    free(two);
    free(flat);
}

DTEST(two_level_routes_through_host_and_cross_links_4x2) {
    pair_run_hosts(4, 2, DOPT_TWO_LEVEL_AUTO, two_level_routes_and_matches_flat);
}

/* ------------------------------------------------------------------ groups */

DTEST(groups_pass_conformance_beside_their_parent) {
    pair_run(4, groups_of_parity);
    pair_run(3, groups_of_parity);
}

DTEST(groups_and_parent_in_flight_together) { pair_run(4, groups_in_flight); }

DTEST(split_colors_undefined_and_invalid) { pair_run(3, split_colors); }

DTEST(mismatch_between_parent_and_group_is_named) {
    pair_run(2, mismatch_across_groups);
    pair_run(2, group_failure_poisons_parent);
}

/* The parent destroyed first: its group keeps working on its links, and destroying the group
   then closes them. */
static void parent_destroyed_first(dopt_comm *c) {
    dopt_comm *g;
    int x = 1;
    DT_OK(dopt_comm_split(c, 0, c->size - c->rank, &g));
    dopt_comm_destroy(c);
    DT_OK(dopt_allreduce(g, &x, 1, DOPT_I32, DOPT_SUM));
    DT_EQ_INT(x, g->size);
    conformance_run(g);
    dopt_comm_destroy(g);
    _exit(0); /* pair_rank would destroy c again */
}

DTEST(a_group_outlives_its_parent) { pair_run(3, parent_destroyed_first); }

DTEST(split_host_from_the_table_and_the_identity) { pair_run(4, groups_of_hosts); }

DTEST(self_splits_into_itself) {
    dopt_comm *c, *g, *none;
    float x = 2;
    DT_OK(dopt_comm_create_self(&c));
    DT_OK(dopt_comm_split(c, 3, 0, &g));
    DT_CHECK(g != NULL && g->size == 1);
    DT_OK(dopt_allreduce(g, &x, 1, DOPT_F32, DOPT_SUM));
    DT_OK(dopt_comm_split(c, DOPT_UNDEFINED, 0, &none));
    DT_CHECK(none == NULL);
    dopt_comm_destroy(g);
    dopt_comm_destroy(c);
}

/* ------------------------------------------------------------------ requests started late */

static int late_pipe[2]; /* rank 0 tells rank 2 to join */

/* Rank 2 holds back, so rank 0's first allreduce cannot finish; rank 0 polls it until everything
   it had for rank 1 is sent and received (its queues to rank 1 ran dry), and only then starts a
   second allreduce, whose frames to and from rank 1 must still flow. */
static void request_after_a_dry_link(dopt_comm *c) {
    float a[2] = {1, 1}, b[2] = {2, 2};
    dopt_request ra, rb;
    if (c->rank == 2) DT_EQ_INT(dtest_read_int(late_pipe[0], "rank 0's go-ahead"), 1);
    DT_OK(dopt_allreduce_start(c, a, 2, DOPT_F32, DOPT_SUM, &ra));
    if (c->rank == 0) {
        dopt__peer *P = &c->eng->peers[1];
        long polls = 0;
        int done = 0;
        while (P->tx_cur >= 0 || P->rx_cur >= 0) {
            DT_OK(dopt_test(&ra, &done));
            DT_CHECKF(++polls < 100000000, "rank 0 never finished its part with rank 1");
        }
        DT_CHECK(!done); /* rank 2 has not started */
    }
    DT_OK(dopt_allreduce_start(c, b, 2, DOPT_F32, DOPT_SUM, &rb));
    if (c->rank == 0) dtest_write_int(late_pipe[1], 1);
    DT_OK(dopt_wait(&rb));
    DT_OK(dopt_wait(&ra));
    DT_CHECK(a[0] == 3 && a[1] == 3 && b[0] == 6 && b[1] == 6);
}

DTEST(a_request_started_after_a_link_ran_dry_still_moves) {
    DT_CHECK(pipe(late_pipe) == 0);
    pair_run(3, request_after_a_dry_link);
    close(late_pipe[0]);
    close(late_pipe[1]);
}

/* ------------------------------------------------------------------ the progress thread */

static int progress_pipe[2]; /* rank 1 tells rank 0 that its allreduce completed */

/* Rank 0 starts an allreduce and then neither tests nor waits until rank 1 says its blocking
   allreduce completed, which needs rank 0's side to move: only rank 0's progress thread can do
   that. Rank 0's request is then complete at the first dopt_test. */
static void progress_without_waiting(dopt_comm *c) {
    size_t n = (size_t)1 << 20, i;
    float *x = (float *)malloc(n * sizeof(float));
    DT_CHECK(x != NULL);
    for (i = 0; i < n; i++) x[i] = (float)(c->rank + 1);
    if (c->rank == 0) {
        dopt_request r;
        int done = 0;
        DT_OK(dopt_comm_set_progress_thread(c, 0));
        DT_EQ_INT(dopt_comm_set_progress_thread(c, 0), DOPT_ERR_INVALID); /* one is enough */
        DT_OK(dopt_allreduce_start(c, x, n, DOPT_F32, DOPT_SUM, &r));
        DT_EQ_INT(dtest_read_int(progress_pipe[0], "rank 1's completed allreduce"), 1);
        DT_OK(dopt_test(&r, &done));
        DT_CHECKF(done, "rank 0's request is not complete although rank 1's is");
    } else {
        DT_OK(dopt_allreduce(c, x, n, DOPT_F32, DOPT_SUM));
        dtest_write_int(progress_pipe[1], 1);
    }
    for (i = 0; i < n; i++) DT_CHECKF(x[i] == 3.0f, "rank %d: element %zu is %g", c->rank, i, (double)x[i]);
    free(x);
}

/* Everything still right with the thread running beside the caller (and its groups). */
static void conformance_with_a_progress_thread(dopt_comm *c) {
    dopt_comm *g;
    DT_OK(dopt_comm_set_progress_thread(c, 10));
    conformance_run(c);
    DT_OK(dopt_comm_split(c, c->rank % 2, 0, &g));
    DT_EQ_INT(dopt_comm_set_progress_thread(g, 0), DOPT_ERR_INVALID); /* the root's thread serves it */
    conformance_run(g);
    dopt_comm_destroy(g);
}

DTEST(a_progress_thread_moves_requests_nobody_waits_for) {
    DT_CHECK(pipe(progress_pipe) == 0);
    pair_run(2, progress_without_waiting);
    close(progress_pipe[0]);
    close(progress_pipe[1]);
    pair_run(3, conformance_with_a_progress_thread);
}

/* ------------------------------------------------------------------ allocations */

/* Each shape called once to warm up, then three more times: the allocation count must not move. */
static void steady_state_allocates_nothing(dopt_comm *c) {
    size_t big = (1u << 20) + 3, i;
    float *x = (float *)malloc(big * sizeof(float)), small[5] = {1, 2, 3, 4, 5};
    unsigned char *all = (unsigned char *)malloc(4096 * (size_t)c->size), blk[4096], out[64 * 8];
    size_t got[PAIR_MAX];
    int round;
    long before = 0;
    DT_CHECK(x != NULL && all != NULL);
    for (i = 0; i < big; i++) x[i] = (float)(i % 13);
    memset(blk, c->rank, sizeof blk);
    for (round = 0; round < 4; round++) {
        dopt_request r[4];
        if (round == 1) before = engine_test_allocs;
        DT_OK(dopt_allreduce(c, small, 5, DOPT_F32, DOPT_MEAN));
        DT_OK(dopt_allreduce(c, x, big, DOPT_F32, DOPT_SUM));
        DT_OK(dopt_allgather(c, blk, all, sizeof blk));
        DT_OK(dopt_allgatherv(c, blk, 64 + (size_t)c->rank, out, sizeof out, got));
        DT_OK(dopt_broadcast(c, x, big * sizeof(float), 0));
        DT_OK(dopt_barrier(c));
        DT_OK(dopt_allreduce_start(c, small, 5, DOPT_F32, DOPT_SUM, &r[0]));
        DT_OK(dopt_allreduce_start(c, x, big, DOPT_F32, DOPT_MAX, &r[1]));
        DT_OK(dopt_allgather_start(c, blk, all, sizeof blk, &r[2]));
        DT_OK(dopt_broadcast_start(c, small, sizeof small, c->size - 1, &r[3]));
        DT_OK(dopt_wait(&r[3]));
        DT_OK(dopt_wait(&r[0]));
    }
    DT_CHECKF(engine_test_allocs == before, "rank %d: %ld allocations after the first round", c->rank,
              engine_test_allocs - before);
    free(x);
    free(all);
}

DTEST(collectives_allocate_nothing_after_the_first_call) {
    int n;
    for (n = 1; n <= 4; n++) pair_run(n, steady_state_allocates_nothing);
}

static void group_steady_state(dopt_comm *c) {
    dopt_comm *g;
    DT_OK(dopt_comm_split(c, c->rank % 2, 0, &g));
    steady_state_allocates_nothing(g);
    dopt_comm_destroy(g);
}

DTEST(group_collectives_allocate_nothing_after_the_first_call) { pair_run(4, group_steady_state); }

/* A rank that leaves after sending half a message: the other names it, at once. */
static void leaves_mid_message(dopt_comm *c) {
    size_t n = (size_t)4 << 20;
    float *x = (float *)calloc(n, sizeof(float));
    dopt_status s;
    DT_CHECK(x != NULL);
    DT_OK(dopt_barrier(c));
    if (c->rank == 1) {
        pair_links *l = (pair_links *)c->impl;
        unsigned char hdr[DOPT_FRAME_BYTES];
        dopt_coll_desc d;
        memset(&d, 0, sizeof d);
        d.kind = DOPT_COLL_BROADCAST;
        d.root = 1;
        d.seq = c->seq + 1;
        d.count = n * sizeof(float);
        dopt__frame_encode(hdr, DOPT__FRAME_DATA, &d, 1, 0, d.count);
        DT_CHECK(write(l->fd[0], hdr, sizeof hdr) == (ssize_t)sizeof hdr);
        DT_CHECK(write(l->fd[0], x, 1000) == 1000);
        /* no goodbye: a crash mid-message (shutdown, since the test's parent holds a copy of
           every socketpair end and a close would not end the stream) */
        shutdown(l->fd[0], SHUT_WR);
        _exit(0);
    }
    s = dopt_broadcast(c, x, n * sizeof(float), 1);
    DT_EQ_INT(s, DOPT_ERR_PEER_LOST);
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 1 closed the connection") != NULL, "detail: %s", dopt_comm_detail(c));
    free(x);
}

DTEST(peer_dying_mid_message_is_named) { pair_run(2, leaves_mid_message); }

/* Rank 1 never joins the allreduce (it only waits for rank 0's abort): rank 0, polling with
   dopt_test instead of waiting, must still reach the timeout — it counts from the last progress,
   not from each call. */
static void silent_peer_under_dopt_test(dopt_comm *c) {
    float x[4] = {0};
    if (c->rank == 0) {
        dopt_request r;
        dopt_status s = DOPT_OK;
        int done = 0;
        double give_up;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        give_up = (double)ts.tv_sec + 60.0; /* far beyond the 200 ms timeout: only a hang reaches it */
        c->timeout_ms = 200;
        DT_OK(dopt_allreduce_start(c, x, 4, DOPT_F32, DOPT_SUM, &r));
        while (!done && s == DOPT_OK) {
            s = dopt_test(&r, &done);
            clock_gettime(CLOCK_MONOTONIC, &ts);
            DT_CHECKF((double)ts.tv_sec < give_up, "dopt_test polled a silent peer for a minute without a timeout");
        }
        DT_EQ_INT(s, DOPT_ERR_TIMEOUT);
        DT_CHECKF(strstr(dopt_comm_detail(c), "waiting for data from rank 1") != NULL, "detail: %s", dopt_comm_detail(c));
    } else {
        unsigned char b[4096];
        /* reads (and drops) what rank 0 sends until rank 0 ends its side of the stream */
        while (read(((pair_links *)c->impl)->fd[0], b, sizeof b) > 0) continue;
    }
}

DTEST(dopt_test_reaches_the_timeout) { pair_run(2, silent_peer_under_dopt_test); }

DTEST_MAIN()
