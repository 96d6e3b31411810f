/* engine.h — distopt's collective engine: every collective written once over point-to-point links.
   Part of distopt 0.1.0. MIT licence (see the end of distopt.h).

   A program does not include this file itself: the transports with links (transport_tcp.h,
   transport_shm.h, transport_mpi.h) do. Read on if you write a backend, or a module that runs
   its own exchanges. In the file that defines DISTOPT_IMPLEMENTATION it emits its definitions
   after distopt.h's, as every distopt header does.

   LAYERS

       the user's training loop
            |  dopt_allreduce, dopt_wait, dopt_comm_split, ... (distopt.h, public)
            v
       distopt.h: checks, sequence numbers, fingerprints, requests, the detail, the family's fate
            |  c->provider: where the collectives run (dopt_coll_provider, installed at create)
            +--------------------------------+------------------------------------+
            v                                v                                    |
       engine.h (this file): schedules,  the backend's own collectives           |
       frames, timeouts, aborts over     (dopt_own_provider: MPI's, shm's direct  |
       links (dopt_engine_provider)       path, the self backend)                 |
            |  link_send / link_recv / link_wait / link_close (dopt_comm_vtable)  |
            v                                                                     |
       the transports' links: TCP sockets, shm rings, MPI_Isend/Irecv  <----------+

   A backend with links names dopt_engine_provider in its vtable; the engine then runs every
   collective the backend does not run itself (its DOPT_PROVIDES_* bits), exchanges and groups.
   For a kind the backend provides (shm's and MPI's allreduce, allgatherv, broadcast, barrier),
   the engine first finishes what it has in flight, then hands the call to the backend's own
   function, so that collectives complete in the order they started whichever runs them.

   THE LINK CONTRACT (dopt_comm_vtable's link_* fields; none of them may block)
     link_send(c, peer, parts, nparts, &err)  writes a prefix of the parts and returns its
        length; 0: no room now; -1 with *err (errno-style) when the link is broken.
     link_recv(c, peer, dst, cap, &err)  reads up to cap bytes: > 0 read, 0 nothing now, -1 the
        link ended (*err = 0: the peer closed it in order; else the reason).
     link_wait(c, polls, npolls, timeout_ms, &err)  sleeps until one of the polls may move or
        timeout_ms passes (0: look without sleeping; it may yield), sets revents and returns how
        many are ready, 0 on timeout, -1 with *err. An entry without DOPT_LINK_IN is a link the
        engine does not read now: a backend that can tell reports DOPT_LINK_IN on it when the
        peer ended its stream or the link failed (TCP: a FIN or a reset); one that cannot, nothing.
     link_close(c, peer)  ends this rank's writing to peer: the peer reads what was written, then
        the end of the stream; reading goes on. Called after an abort.
     Each link is one ordered, reliable byte stream per peer. The engine never asks a link about
     itself (peer == rank).

   WHAT THE ENGINE GUARANTEES
     - Ordering: collectives on a communicator and its groups complete in start order; results
       equal the blocking calls' bit for bit, and every rank gets the same bits.
     - Fingerprints: every frame's 48-byte header carries the sender's whole collective (kind,
       dtype, op, root, count, sequence number, group); a receiver checks it before it uses a byte
       of the payload, and a rank in another call is named with both calls (DOPT_ERR_MISMATCH).
     - Timeouts: a wait with no bytes moving for c->timeout_ms fails with DOPT_ERR_TIMEOUT naming
       the first rank waited for.
     - Poisoning: the first failure on any rank is sent to every peer in an ABORT frame naming
       the culprit, so every rank fails with the same culprit and nobody waits for the timeout;
       the root and its groups then fail fast with the same detail.
     - A link that ends without an abort is blamed on the right rank (A LINK THAT ENDS below).
     - Memory: the engine allocates at create, at the first use of a size (its tables and
       scratch grow to a high-water mark) and when groups are made; never in the steady state.

   HOW REQUESTS PROGRESS
     A collective's start only queues its frames (ops); bytes move inside dopt_test and dopt_wait
     (the engine's run: send what is ready, receive what has arrived, poll the links) or on the
     progress thread (dopt_comm_set_progress_thread), which makes a pass every interval while any
     request is in flight. With the thread running, every use of the engine holds its lock
     (dopt__eng_lock / dopt__eng_unlock, DOPT__LOCKED): a backend or module that touches the
     engine's state does the same.

   FOR BACKENDS (the calls a backend with links makes; private names at the end of the file)
     - the vtable: link_* fields, struct_size = sizeof(dopt_comm_vtable), provider =
       dopt_engine_provider, DOPT_PROVIDES_* for the collectives it runs itself;
     - dopt_comm_new as any backend; then dopt_comm_set_engine and dopt_comm_set_hosts to tune;
     - dopt_links_goodbye from its destroy, before closing the links.
   tests/test_engine.c is a complete backend over socketpairs (about 120 lines), run through the
   conformance suite. */

#ifndef DISTOPT_ENGINE_H
#define DISTOPT_ENGINE_H

#include "distopt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The provider that runs a communicator's collectives over its backend's links (name it in
   dopt_comm_vtable.provider). */
DOPT_DEF const dopt_coll_provider *dopt_engine_provider(void);
/* For backends with links: the engine's latency-path threshold in bytes (0: 65536) and how long
   it polls without sleeping after progress (0: 50 µs; negative: never). */
DOPT_DEF void dopt_comm_set_engine(dopt_comm *c, size_t small_bytes, int spin_us);
/* For backends with links: which host each rank runs on (host_of[r], r < size: ranks with equal
   values share a host; NULL: not known) and when the host-aware allreduce runs (two_level: one of
   DOPT_TWO_LEVEL_*). With more than one host, the same number of ranks on each and more than one
   on a host, an allreduce on the ring path (or any non-empty one, with ON) reduces within each
   host, then across hosts, then spreads within the host (see REFERENCE FOR CONTRIBUTORS below:
   HOSTS). Every rank must pass the same table. DOPT_ERR_NOMEM, or DOPT_ERR_INVALID for an unknown
   two_level. */
DOPT_DEF dopt_status dopt_comm_set_hosts(dopt_comm *c, const int *host_of, int two_level);
/* For a communicator with links (TCP, shm; not a group): a thread, started now and stopped at
   destroy, that moves the requests in flight of it and its groups while the caller computes: a
   pass over the links every interval_us (0: 100) while any is in flight, asleep otherwise. Every
   call on the communicator then takes a lock the thread shares. DOPT_ERR_UNSUPPORTED without
   links or threads; DOPT_ERR_INVALID on a group or when one runs already. */
DOPT_DEF dopt_status dopt_comm_set_progress_thread(dopt_comm *c, int interval_us);
/* For backends with links, from their destroy: tells every peer that this rank leaves on purpose
   (a GOODBYE frame), waiting at most wait_ms for room on a full link. Nothing after an error. */
DOPT_DEF void dopt_links_goodbye(dopt_comm *c, int wait_ms);


#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_ENGINE_H */

/* ==================== REFERENCE FOR CONTRIBUTORS ====================
   Not needed to write a backend: what the engine does over the links, and why.

   SCHEDULES
     Ring reduce-scatter/allgather pipelined at byte granularity for large messages (a send goes
     on as far as the receive it depends on has filled its buffer), direct exchange for small
     ones (every rank sends its buffer to every other; each combines in rank order, so all get
     the same bits), binomial tree (small) or pipelined chain (large) broadcast, dissemination
     barrier, ring or direct allgatherv, and exchanges queued all at once. The latency path is
     taken below small_bytes (dopt_comm_set_engine).

   HOSTS
     Given which host each rank runs on (dopt_comm_set_hosts), with H > 1 hosts of the same
     number L > 1 of ranks each, a large allreduce runs in two levels: a ring reduce-scatter among
     the host's ranks leaves each with 1/L of the host's sum; the ranks that hold the same 1/L on
     every host allreduce it in one ring across hosts; an allgather within the host spreads the
     result, block by block as the ring across hosts finishes it. A host's link then carries
     2·(H−1)/H of the buffer instead of the flat ring's 2·(N−1)/N (N = H·L), and every rank still
     ends with the same bits, run after run. DOPT_TWO_LEVEL_AUTO takes it on the ring path (above
     small_bytes/(N−1)), _ON for every non-empty allreduce, _OFF never; uneven hosts keep the flat
     ring. TCP passes the hosts its rendezvous found (ranks reached at one address share a host)
     and its config's two_level.

   GROUPS ON LINKS
     A group's collectives run on its root's engine with the group's number in every frame; that
     is how a rank that calls the parent while its peer calls a group they share is named. The
     engine keeps the family (the root and the groups that live on this rank) to tell, by its
     group number, whether a frame belongs to a collective not started yet (parked) or is wrong.

   FRAMES
     The frame header is transport_tcp.h's (REFERENCE FOR CONTRIBUTORS there: WIRE FORMAT);
     DOPT_FRAME_BYTES and DOPT_FRAME_VERSION are its size and version byte.
*/

/* =====================================================================================
   IMPLEMENTATION — stop reading here if you only want the API.
   ===================================================================================== */

#if defined(DISTOPT_IMPLEMENTATION) && !defined(DOPT__ENGINE_IMPLEMENTED)
#define DOPT__ENGINE_IMPLEMENTED

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ===================================================================== FRAMES

   Every message between two ranks is a frame: a 48-byte header (laid out in transport_tcp.h's
   WIRE FORMAT, the first backend to carry it) and a payload. The header carries the sender's collective whole, so a
   receiver checks that its peer is in the same call before it uses a byte of the payload. */

enum { DOPT__FRAME_DATA = 1, DOPT__FRAME_ABORT = 2, DOPT__FRAME_GOODBYE = 3 };

typedef struct dopt__frame {
    int type;            /* DATA, ABORT or GOODBYE */
    dopt_coll_desc desc; /* the sender's collective (an ABORT's carries no count) */
    int sender;
    int status;          /* ABORT: the error */
    int culprit;         /* ABORT: the rank whose failure it is */
    int reporter;        /* ABORT: the rank that saw it first */
    uint64_t bytes;      /* payload that follows */
} dopt__frame;

static void dopt__frame_encode(unsigned char *out, int type, const dopt_coll_desc *d, int sender, int status,
                               uint64_t bytes) {
    memset(out, 0, DOPT_FRAME_BYTES);
    memcpy(out, "DOPF", 4);
    out[4] = DOPT_FRAME_VERSION;
    out[5] = (unsigned char)type;
    out[6] = (unsigned char)d->kind;
    out[7] = (unsigned char)d->dtype;
    out[8] = (unsigned char)d->op;
    out[9] = (unsigned char)(d->group & 0xFF); /* 24 bits: 0 for a backend's own communicator */
    out[10] = (unsigned char)(d->group >> 8 & 0xFF);
    out[11] = (unsigned char)(d->group >> 16 & 0xFF);
    dopt__put_le32(out + 12, (uint32_t)sender);
    dopt__put_le32(out + 16, (uint32_t)d->root);
    dopt__put_le32(out + 20, (uint32_t)status);
    dopt__put_le64(out + 24, d->seq);
    dopt__put_le64(out + 32, d->count);
    dopt__put_le64(out + 40, bytes);
}

/* An ABORT header: the sender's collective without its count, whose field carries the culprit
   and the reporter instead. */
static void dopt__abort_encode(unsigned char *out, const dopt_coll_desc *d, int sender, int status, int culprit,
                               int reporter, uint64_t bytes) {
    dopt__frame_encode(out, DOPT__FRAME_ABORT, d, sender, status, bytes);
    dopt__put_le32(out + 32, (uint32_t)culprit);
    dopt__put_le32(out + 36, (uint32_t)reporter);
}

/* NULL when in[0..48) is a well-formed frame header, else why not. Only syntax is checked here;
   whether the frame is the one this rank expects is dopt__frame_check's job. */
static const char *dopt__frame_decode(const unsigned char *in, dopt__frame *f) {
    uint32_t kind = in[6], dtype = in[7], op = in[8], root = dopt__get_le32(in + 16);
    uint32_t sender = dopt__get_le32(in + 12);
    int32_t status = (int32_t)dopt__get_le32(in + 20);
    memset(f, 0, sizeof *f);
    if (memcmp(in, "DOPF", 4) != 0) return "bad magic";
    if (in[4] != DOPT_FRAME_VERSION) return "unknown protocol version";
    if (in[5] < DOPT__FRAME_DATA || in[5] > DOPT__FRAME_GOODBYE) return "unknown frame type";
    if (kind > DOPT_COLL_EXCHANGE || (kind == 0 && in[5] == DOPT__FRAME_DATA)) return "unknown collective";
    if (dtype > DOPT_I64 || op > DOPT_MEAN) return "unknown dtype or op";
    if (root > (uint32_t)INT_MAX || sender > (uint32_t)INT_MAX) return "rank out of range";
    f->type = in[5];
    f->desc.kind = (dopt_coll)kind;
    f->desc.dtype = (dopt_dtype)dtype;
    f->desc.op = (dopt_op)op;
    f->desc.root = (int)root;
    f->desc.group = (uint32_t)in[9] | (uint32_t)in[10] << 8 | (uint32_t)in[11] << 16;
    f->desc.seq = dopt__get_le64(in + 24);
    f->desc.count = dopt__get_le64(in + 32);
    f->sender = (int)sender;
    f->status = (int)status;
    f->bytes = dopt__get_le64(in + 40);
    if (f->type == DOPT__FRAME_ABORT) {
        uint32_t culprit = dopt__get_le32(in + 32), reporter = dopt__get_le32(in + 36);
        if (status >= 0 || status < (int32_t)DOPT_ERR_CLOSED) return "abort without an error status";
        if (f->bytes > DOPT_DETAIL_MAX) return "abort message too long";
        if (culprit > (uint32_t)INT_MAX || reporter > (uint32_t)INT_MAX) return "rank out of range";
        f->desc.count = 0;
        f->culprit = (int)culprit;
        f->reporter = (int)reporter;
    } else if (status != 0) {
        return "status on a frame that is not an abort";
    }
    if (f->type == DOPT__FRAME_GOODBYE && f->bytes != 0) return "goodbye with a payload";
    return NULL;
}

static int dopt__same_coll(const dopt_coll_desc *a, const dopt_coll_desc *b) {
    return a->kind == b->kind && a->dtype == b->dtype && a->op == b->op && a->root == b->root && a->seq == b->seq &&
           a->count == b->count && a->group == b->group;
}

/* A decoded DATA frame from peer against what this rank expects: the collective it is in (want)
   and the payload it has posted for this frame. Fails the communicator with MISMATCH (naming both
   calls) or PROTOCOL; never reads a payload. */
static dopt_status dopt__frame_check(dopt_comm *c, const dopt_coll_desc *want, int peer, const dopt__frame *f,
                                     uint64_t posted) {
    if (f->sender != peer)
        return dopt_comm_fail(c, want, DOPT_ERR_PROTOCOL, "the connection of rank %d carried a frame of rank %d", peer,
                              f->sender);
    if (!dopt__same_coll(want, &f->desc)) return dopt_comm_fail_mismatch(c, want, &f->desc, peer);
    if (f->bytes != posted)
        return dopt_comm_fail(c, want, DOPT_ERR_PROTOCOL, "rank %d's frame announces %llu payload bytes, %llu expected",
                              peer, (unsigned long long)f->bytes, (unsigned long long)posted);
    return DOPT_OK;
}

/* ===================================================================== STATE */

#define DOPT__STAGE_BYTES (256u << 10)  /* per-peer receive staging buffer */
#define DOPT__DIRECT_MIN (64u << 10)    /* copied payloads at least this long skip the stage */
#define DOPT__TX_PASS_BYTES (256u << 10) /* bytes written to one peer in one pass, at most */
#define DOPT__SMALL_DEFAULT (64u << 10)
#define DOPT__SPIN_DEFAULT_US 50
#define DOPT__FLUSH_MS 1000             /* an aborting rank writes its aborts for at most this long */
#define DOPT__BLAME_MS 500              /* a link that ends mid-frame waits this long for a culprit */

/* One unit of a collective's schedule: a frame sent to or received from one peer. A send may
   depend on a receive (dep): its header goes once that receive's header has arrived, and its
   payload only as far as that receive has filled its buffer from dep_off on, which pipelines
   rings and chains. A receive with a dep
   places nothing before that receive is whole: a later phase that combines into a region waits
   for the phase that finishes it. */
typedef struct dopt__op {
    unsigned char hdr[DOPT_FRAME_BYTES]; /* send: the encoded header */
    unsigned char *ptr;                  /* send: source; receive: destination */
    size_t bytes, done;                  /* payload bytes, and bytes sent / placed */
    size_t dep_off;                      /* send: where its source starts in dep's buffer */
    int peer, dep, next;                 /* next: the following op of the same queue, or -1 */
    unsigned hdr_done;                   /* header bytes sent (send) or validated (receive: all at once) */
    int reduce;                          /* receive: combine into ptr instead of copying */
    uint64_t req;                        /* the request it belongs to (its number, see dopt__engine) */
} dopt__op;

typedef struct dopt__peer {
    unsigned char *stage;       /* bytes received but not yet consumed are [lo, hi) */
    size_t lo, hi;
    int tx_cur, tx_tail, rx_cur, rx_tail; /* queues of ops, in the order of the requests */
    int tx_blocked;             /* the link has no room for more now */
    int tx_mid;                 /* a frame is partly sent: nothing else may be written */
    int parked;                 /* the stage holds a frame of a collective not started yet */
    int broken;                 /* nothing more may be written (after an abort) */
    int gone;                   /* said goodbye: destroyed its communicator */
    uint64_t goodbye_seq;
    int closed;                 /* its link ended without an abort: the order it was seen in (1, 2, ...) */
    int closed_mid;             /* ... in the middle of a frame to this rank */
    int close_err;              /* ... with this errno (0: an orderly end of stream) */
    int close_sending;          /* ... seen by a send */
    uint64_t skip;              /* payload bytes still to come of a frame dropped while reading past
                                   the end of a link (dopt__eng_link_ended) */
    size_t abort_sent;          /* bytes of this rank's ABORT frame written to it */
} dopt__peer;

/* A collective in flight. */
typedef struct dopt__req {
    dopt_coll_desc desc;
    dopt_comm *comm;            /* the communicator it runs on (the root or a group) */
    const char *api;            /* the label in force when it started */
    unsigned char *buf;         /* allreduce: the caller's buffer (finished at completion) */
    uint64_t payload;           /* bytes for the traffic counter */
    uint64_t sent, received;    /* payload bytes of its sends and of its receives */
    int direct;                 /* a small allreduce: combine the inputs in scratch at completion */
    int first_op, end_op;       /* its ops */
    unsigned char *scratch;     /* from the pool (pool index in `pooled`; -1: none) */
    int pooled;
    uint64_t rec;               /* its flight recorder entry (dopt__rec_current) */
} dopt__req;

/* Scratch buffers, lent to requests in flight and returned when they retire: grown only when no
   free one is large enough, so a steady state allocates nothing. */
typedef struct dopt__scratch {
    unsigned char *buf;
    size_t cap;
    int lent;
} dopt__scratch;

/* Requests are numbered 0, 1, 2, ... in start order; request k lives in slot k & (cap - 1), and
   [retired, started) are in flight. They complete in that order. */
typedef struct dopt__engine {
    int rank, size;
    dopt__peer *peers;
    dopt__op *ops;
    int nops, cap_ops;
    dopt__req *reqs;
    uint64_t retired, started, cap_reqs;
    dopt__scratch *pool;        /* cap_reqs entries */
    dopt_link_poll *polls;
    size_t *blk_off, *blk_len;
    size_t small_bytes;
    int spin_us;
    int closes;                 /* links seen ending */
    double blame_deadline;      /* one did: name the culprit by then (0: none) */
    double last_progress;       /* when bytes last moved, or progress was first asked for since
                                   (0: nothing in flight yet); the timeout counts from here */
    int hosts, local;           /* dopt_comm_set_hosts: `hosts` hosts of `local` ranks each (0: unknown
                                   or uneven, so no two-level schedule) */
    int host_pos, local_pos;    /* this rank's host, and its place among that host's ranks */
    int *host_ring;             /* `local` links: this host's ranks in rank order */
    int *cross_ring;            /* `hosts` links: the ranks at this rank's local_pos, in host order */
    int *host_table;            /* hosts · local links: host h's place j is host_table[h · local + j] */
    int two_level;              /* DOPT_TWO_LEVEL_* */
    int *host_of;               /* dopt_comm_set_hosts' table (size entries), NULL when not given */
    dopt_comm *root;            /* the backend's communicator, whose links these are */
    dopt_comm **family;         /* the root and the groups split from it that live on this rank */
    int nfamily, cap_family;
    int threaded;               /* a progress thread runs: every use of the engine takes `lock` */
#ifdef DOPT__THREADS
    pthread_mutex_t lock;
    pthread_cond_t wake;        /* a request started, or the thread is to stop */
    pthread_t thread;
    int stopping;
    int interval_us;            /* the thread's pause between two passes while requests are in flight */
#endif
    unsigned char abort_msg[DOPT_FRAME_BYTES + DOPT_DETAIL_MAX]; /* this rank's ABORT frame */
    size_t abort_len;           /* its length; 0 until this rank aborts */
} dopt__engine;

static dopt__req *dopt__eng_req(const dopt__engine *e, uint64_t k) { return &e->reqs[k & (e->cap_reqs - 1)]; }

/* The newest collective the engine has queued for the family member with the given group
   number; a group not made on this rank (yet) has queued none, so all its frames are later ones.
   (Not the member's seq: that moves before its request is queued, which a progress thread may
   see in between.) */
static uint64_t dopt__eng_queued(const dopt__engine *e, uint32_t group) {
    int i;
    for (i = 0; i < e->nfamily; i++)
        if (e->family[i]->group == group) return e->family[i]->started_seq;
    return 0;
}

/* With a progress thread, every use of the engine holds its lock (the thread's passes too). */
static void dopt__eng_lock(dopt__engine *e) {
#ifdef DOPT__THREADS
    if (e && e->threaded) pthread_mutex_lock(&e->lock);
#else
    (void)e;
#endif
}

/* Unlocks, waking the thread (a request may have started); returns s. */
static dopt_status dopt__eng_unlock(dopt__engine *e, dopt_status s) {
#ifdef DOPT__THREADS
    if (e && e->threaded) {
        pthread_cond_signal(&e->wake);
        pthread_mutex_unlock(&e->lock);
    }
#else
    (void)e;
#endif
    return s;
}

/* expr with the engine locked. */
#define DOPT__LOCKED(e, expr) (dopt__eng_lock(e), dopt__eng_unlock((e), (expr)))

static int dopt__has_links(const dopt_comm_vtable *vt) {
    return DOPT__VT_HAS(vt, link_send) && DOPT__VT_HAS(vt, link_recv) && DOPT__VT_HAS(vt, link_wait) &&
           DOPT__VT_HAS(vt, link_close);
}

/* 1 when the engine runs collective kind on c (the backend does not run it itself). */
static int dopt__engine_runs(const dopt_comm *c, dopt_coll kind) {
    static const unsigned bit[7] = {0, DOPT_PROVIDES_ALLREDUCE, DOPT_PROVIDES_ALLGATHERV, DOPT_PROVIDES_ALLGATHERV,
                                    DOPT_PROVIDES_BROADCAST, DOPT_PROVIDES_BARRIER, 0};
    return c->eng != NULL && !(c->vt->provides & bit[kind]);
}

static void dopt__eng_free(dopt__engine *e) {
    uint64_t k;
    int p;
    if (e == NULL) return;
    for (p = 0; e->peers && p < e->size; p++) DOPT_FREE(e->peers[p].stage);
    for (k = 0; e->pool && k < e->cap_reqs; k++) DOPT_FREE(e->pool[k].buf);
    DOPT_FREE(e->pool);
    DOPT_FREE(e->peers);
    DOPT_FREE(e->ops);
    DOPT_FREE(e->reqs);
    DOPT_FREE(e->polls);
    DOPT_FREE(e->blk_off);
    DOPT_FREE(e->blk_len);
    DOPT_FREE(e->host_ring);
    DOPT_FREE(e->cross_ring);
    DOPT_FREE(e->host_table);
    DOPT_FREE(e->family);
    DOPT_FREE(e->host_of);
    DOPT_FREE(e);
}

static dopt__engine *dopt__eng_new(dopt_comm *root) {
    dopt__engine *e = (dopt__engine *)DOPT_MALLOC(sizeof *e);
    int p, rank = root->rank, size = root->size;
    size_t n = (size_t)size;
    if (e == NULL) return NULL;
    memset(e, 0, sizeof *e);
    e->rank = rank;
    e->size = size;
    e->root = root;
    e->cap_family = 4;
    e->nfamily = 1;
    if ((e->family = (dopt_comm **)DOPT_MALLOC(sizeof(dopt_comm *) * 4)) != NULL) e->family[0] = root;
    e->small_bytes = DOPT__SMALL_DEFAULT;
    e->spin_us = DOPT__SPIN_DEFAULT_US;
    e->cap_ops = 4 * size + 64;
    e->cap_reqs = 8;
    e->peers = (dopt__peer *)DOPT_MALLOC(sizeof(dopt__peer) * n);
    e->ops = (dopt__op *)DOPT_MALLOC(sizeof(dopt__op) * (size_t)e->cap_ops);
    e->reqs = (dopt__req *)DOPT_MALLOC(sizeof(dopt__req) * (size_t)e->cap_reqs);
    e->pool = (dopt__scratch *)DOPT_MALLOC(sizeof(dopt__scratch) * (size_t)e->cap_reqs);
    if (e->pool) memset(e->pool, 0, sizeof(dopt__scratch) * (size_t)e->cap_reqs);
    e->polls = (dopt_link_poll *)DOPT_MALLOC(sizeof(dopt_link_poll) * n);
    e->blk_off = (size_t *)DOPT_MALLOC(sizeof(size_t) * n);
    e->blk_len = (size_t *)DOPT_MALLOC(sizeof(size_t) * n);
    if (e->peers) memset(e->peers, 0, sizeof(dopt__peer) * n);
    if (e->reqs) memset(e->reqs, 0, sizeof(dopt__req) * (size_t)e->cap_reqs);
    for (p = 0; e->peers && p < size; p++) {
        dopt__peer *P = &e->peers[p];
        P->tx_cur = P->tx_tail = P->rx_cur = P->rx_tail = -1;
        if (p != rank && (P->stage = (unsigned char *)DOPT_MALLOC(DOPT__STAGE_BYTES)) == NULL) break;
    }
    if (!e->peers || !e->ops || !e->reqs || !e->pool || !e->polls || !e->blk_off || !e->blk_len || !e->family ||
        p < size) {
        dopt__eng_free(e);
        return NULL;
    }
    return e;
}

/* ===================================================================== FAILING AND ABORTING */

/* The reason in this rank's detail: what follows its "rank R: <collective>: " prefix. */
static const char *dopt__eng_reason(const dopt_comm *c, const dopt_coll_desc *d) {
    char what[160], prefix[DOPT_DETAIL_MAX];
    int n;
    dopt_coll_describe(d, what, sizeof what);
    n = snprintf(prefix, sizeof prefix, "rank %d: %s%s%s: ", dopt__rank_named(c), c->api ? c->api : "",
                 c->api ? ": " : "", what);
    if (n > 0 && (size_t)n < sizeof prefix && strncmp(c->detail, prefix, (size_t)n) == 0) return c->detail + n;
    return c->detail;
}

/* Writes what is left for peer p once this rank aborts: the rest of a half-sent frame (whatever
   its source holds now: the receiver fails anyway, it only needs the frame to end so that the
   abort after it can be read), then the abort. 1: all written; 0: the link is full; -1: the
   link is gone. */
static int dopt__eng_flush_peer(dopt__engine *e, int p) {
    dopt__peer *P = &e->peers[p];
    for (;;) {
        dopt__op *o = P->tx_mid ? &e->ops[P->tx_cur] : NULL;
        size_t hdr_left = o ? DOPT_FRAME_BYTES - o->hdr_done : 0, body_left = o ? o->bytes - o->done : 0, sent, k;
        dopt_iov iov[3];
        long n;
        int nv = 0, err = 0;
        if (hdr_left) {
            iov[nv].base = o->hdr + o->hdr_done;
            iov[nv++].len = hdr_left;
        }
        if (body_left) {
            iov[nv].base = o->ptr + o->done;
            iov[nv++].len = body_left;
        }
        if (P->abort_sent < e->abort_len) {
            iov[nv].base = e->abort_msg + P->abort_sent;
            iov[nv++].len = e->abort_len - P->abort_sent;
        }
        if (nv == 0) return 1;
        n = e->root->vt->link_send(e->root, p, iov, nv, &err);
        if (n < 0) return -1;
        if (n == 0) return 0;
        sent = (size_t)n;
        if (o) {
            k = sent < hdr_left ? sent : hdr_left;
            o->hdr_done += (unsigned)k;
            sent -= k;
            k = sent < body_left ? sent : body_left;
            o->done += k;
            sent -= k;
            P->tx_mid = !(o->hdr_done == DOPT_FRAME_BYTES && o->done == o->bytes);
        }
        P->abort_sent += sent;
    }
}

/* The collective to name in a failure: the oldest one in flight, else the last one started. */
static const dopt_coll_desc *dopt__eng_current(const dopt__engine *e) {
    if (e->retired < e->started) return &dopt__eng_req(e, e->retired)->desc;
    return e->started ? &dopt__eng_req(e, e->started - 1)->desc : NULL;
}

/* After this rank failed: tell every peer why with an ABORT frame naming the culprit (the rank
   whose failure it is) and the reporter (the rank that saw it first), so that nobody waits for
   the timeout and everybody names the same rank. A frame half-sent to a peer is finished first;
   all peers are written at once, reading (and dropping) what they send meanwhile so that two
   aborting ranks never wait on each other. What cannot be written within
   min(timeout, DOPT__FLUSH_MS) is cut. Every link is then closed for writing, so that a peer
   still waiting for this rank reads the abort, or the end of the stream, at once. */
static dopt_status dopt__eng_abort_all(dopt_comm *c, const dopt_coll_desc *d, int culprit, int reporter,
                                       const char *why) {
    dopt__engine *e = c->eng;
    size_t len = strlen(why);
    double deadline = dopt__now_ms() + (c->timeout_ms < DOPT__FLUSH_MS ? c->timeout_ms : DOPT__FLUSH_MS);
    dopt_coll_desc none;
    int p;
    if (e->abort_len) return c->error; /* told them already */
    if (culprit >= 0 && culprit < e->size && culprit != e->rank) e->root->lost_rank = culprit; /* dopt_comm_shrink's */
    if (d == NULL) {
        memset(&none, 0, sizeof none);
        d = &none;
    }
    if (len > DOPT_DETAIL_MAX) len = DOPT_DETAIL_MAX;
    dopt__abort_encode(e->abort_msg, d, e->rank, (int)c->error, culprit, reporter, len);
    memcpy(e->abort_msg + DOPT_FRAME_BYTES, why, len);
    e->abort_len = DOPT_FRAME_BYTES + len;
    for (;;) {
        int np = 0, pending = 0, n, i, err = 0;
        for (p = 0; p < e->size; p++) {
            dopt__peer *P = &e->peers[p];
            short ev;
            if (p == e->rank) continue;
            if (!P->broken) {
                int r = dopt__eng_flush_peer(e, p);
                if (r != 0) P->broken = 1;
                pending |= r == 0;
            }
            ev = (short)((P->broken ? 0 : DOPT_LINK_OUT) | (P->closed ? 0 : DOPT_LINK_IN));
            if (!ev) continue;
            e->polls[np].peer = p;
            e->polls[np].events = ev;
            e->polls[np++].revents = 0;
        }
        if (!pending || dopt__now_ms() >= deadline) break;
        n = e->root->vt->link_wait(e->root, e->polls, np, dopt__ms_left(deadline), &err);
        if (n < 0) break;
        for (i = 0; i < np && n > 0; i++) {
            dopt__peer *P = &e->peers[e->polls[i].peer];
            long k;
            if (!(e->polls[i].revents & DOPT_LINK_IN) || P->closed) continue;
            k = e->root->vt->link_recv(e->root, e->polls[i].peer, P->stage, DOPT__STAGE_BYTES, &err);
            if (k < 0) P->closed = ++e->closes;
        }
    }
    for (p = 0; p < e->size; p++) {
        if (p != e->rank) e->root->vt->link_close(e->root, p);
        e->peers[p].broken = 1;
    }
    return c->error;
}

static dopt_status dopt__eng_fail(dopt_comm *c, const dopt_coll_desc *d, dopt_status s, int culprit, const char *fmt,
                                  ...) DOPT_PRINTF(5, 6);
static dopt_status dopt__eng_fail(dopt_comm *c, const dopt_coll_desc *d, dopt_status s, int culprit, const char *fmt,
                                  ...) {
    char msg[DOPT_DETAIL_MAX];
    va_list ap;
    if (dopt__family_error(c) != DOPT_OK) return c->error; /* the family's first failure stands */
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    dopt_comm_fail(c, d, s, "%s", msg);
    return dopt__eng_abort_all(c, d, culprit, c->eng->rank, msg);
}

/* This rank's detail was just set by a check of peer p's frame: abort naming p. A mismatch's
   abort carries this rank's call as well, so that p itself learns both sides. */
static dopt_status dopt__eng_abort_checked(dopt_comm *c, const dopt_coll_desc *d, int p) {
    char why[DOPT_DETAIL_MAX], mine[160];
    const char *reason = dopt__eng_reason(c, d);
    size_t n = strlen(reason);
    if (n >= sizeof why) n = sizeof why - 1;
    memcpy(why, reason, n);
    why[n] = '\0';
    if (c->error == DOPT_ERR_MISMATCH) {
        dopt_coll_describe(d, mine, sizeof mine);
        snprintf(why + n, sizeof why - n, " and rank %d %s", c->eng->rank, mine);
    }
    return dopt__eng_abort_all(c, d, p, c->eng->rank, why);
}

/* A peer's ABORT frame, whole in its stage: fail with its status, naming its culprit first and
   its reporter after ("rank 1 closed the connection (reported by rank 2)"), and pass it on. */
static dopt_status dopt__eng_peer_aborted(dopt_comm *c, const dopt_coll_desc *d, const dopt__frame *f,
                                          const unsigned char *text) {
    char why[DOPT_DETAIL_MAX + 1];
    size_t i, n = (size_t)f->bytes;
    if (c->error != DOPT_OK) return c->error;
    for (i = 0; i < n; i++) why[i] = (text[i] >= 0x20 && text[i] < 0x7F) ? (char)text[i] : '?';
    why[n] = '\0';
    dopt_comm_fail(c, d, (dopt_status)f->status, "%s (reported by rank %d)", why, f->reporter);
    return dopt__eng_abort_all(c, d, f->culprit, f->reporter, why);
}

/* ===================================================================== A LINK THAT ENDS */

/* 1 when p's link ended part-way through a frame to this rank: a header, a payload or an abort
   begun and not finished. */
static int dopt__eng_mid_frame(const dopt__engine *e, int p) {
    const dopt__peer *P = &e->peers[p];
    const dopt__op *o = P->rx_cur >= 0 ? &e->ops[P->rx_cur] : NULL;
    return P->hi > P->lo || P->skip > 0 || (o && o->hdr_done && o->done < o->bytes);
}

/* Peer p's link ended (err: 0 for an end of stream, else the reason) without an abort while a
   collective still needs p. The rank named must be the one that failed, and an end of stream
   does not say which: a rank that aborts because of another's death ends its links too. But it
   sends an abort first, finishing any half-sent frame to do so, and is cut mid-frame only when
   the receiver did not read for DOPT__FLUSH_MS. So an end at a frame boundary is p's own death
   (or exit): p is named once the other links have been read once more (an abort naming someone
   else may be there). An end in the middle of a frame waits up to DOPT__BLAME_MS for better
   evidence: an abort from another peer, or another link ending at a boundary. */
static void dopt__eng_mark_closed(const dopt_comm *c, dopt__engine *e, int p, int err, int sending) {
    dopt__peer *P = &e->peers[p];
    double by;
    if (P->closed) return;
    P->closed = ++e->closes;
    P->close_err = err;
    P->close_sending = sending;
    P->closed_mid = dopt__eng_mid_frame(e, p);
    by = dopt__now_ms();
    if (P->closed_mid) by += c->timeout_ms < DOPT__BLAME_MS ? c->timeout_ms : DOPT__BLAME_MS;
    if (e->blame_deadline == 0 || by < e->blame_deadline) e->blame_deadline = by;
}

static int dopt__eng_open_peers(const dopt__engine *e) {
    int p, n = 0;
    for (p = 0; p < e->size; p++) n += p != e->rank && !e->peers[p].closed;
    return n;
}

/* Names the rank whose link ended: the first seen ending at a frame boundary, else the first
   seen at all; the others that ended are listed after it. */
static dopt_status dopt__eng_blame(dopt_comm *c, dopt__engine *e) {
    const dopt_coll_desc *d = dopt__eng_current(e);
    char also[160] = "";
    size_t used = 0;
    int p, culprit = -1;
    const dopt__peer *C;
    for (p = 0; p < e->size; p++) {
        const dopt__peer *P = &e->peers[p];
        if (p == e->rank || !P->closed) continue;
        if (culprit < 0 || (e->peers[culprit].closed_mid && !P->closed_mid) ||
            (e->peers[culprit].closed_mid == P->closed_mid && P->closed < e->peers[culprit].closed))
            culprit = p;
    }
    for (p = 0; p < e->size && used + 32 < sizeof also; p++)
        if (p != e->rank && p != culprit && e->peers[p].closed)
            used += (size_t)snprintf(also + used, sizeof also - used, "; rank %d's is closed too", p);
    C = &e->peers[culprit];
    if (C->close_err)
        return dopt__eng_fail(c, d, DOPT_ERR_PEER_LOST, culprit, "connection to rank %d lost while %s: %s%s", culprit,
                              C->close_sending ? "sending" : "receiving", strerror(C->close_err), also);
    return dopt__eng_fail(c, d, DOPT_ERR_PEER_LOST, culprit, "rank %d closed the connection%s", culprit, also);
}

/* ===================================================================== SCHEDULES (RING, TREE, CHAIN, DISSEMINATION) */

static int dopt__eng_op(dopt__engine *e, int peer, int is_tx, unsigned char *ptr, size_t bytes) {
    dopt__peer *P = &e->peers[peer];
    int i = e->nops++;
    int *cur = is_tx ? &P->tx_cur : &P->rx_cur, *tail = is_tx ? &P->tx_tail : &P->rx_tail;
    dopt__op *o = &e->ops[i];
    DOPT_ASSERT(i < e->cap_ops && peer != e->rank);
    memset(o, 0, sizeof *o);
    o->ptr = ptr;
    o->bytes = bytes;
    o->peer = peer;
    o->dep = -1;
    o->next = -1;
    o->req = e->started;
    if (*tail >= 0) e->ops[*tail].next = i;
    if (*cur < 0) *cur = i; /* the queue was empty, or ran dry before this request started */
    *tail = i;
    if (!is_tx) P->parked = 0; /* a frame waiting in the stage may be this one's */
    return i;
}

static int dopt__eng_send(dopt__engine *e, const dopt_coll_desc *d, int peer, const void *src, size_t bytes, int dep) {
    int i = dopt__eng_op(e, peer, 1, (unsigned char *)(uintptr_t)src, bytes);
    e->ops[i].dep = dep;
    dopt__eng_req(e, e->started)->sent += bytes;
    dopt__frame_encode(e->ops[i].hdr, DOPT__FRAME_DATA, d, e->rank, 0, bytes);
    return i;
}

static int dopt__eng_recv(dopt__engine *e, int peer, void *dst, size_t bytes, int reduce) {
    int i = dopt__eng_op(e, peer, 0, (unsigned char *)dst, bytes);
    e->ops[i].reduce = reduce;
    dopt__eng_req(e, e->started)->received += bytes;
    dopt__rec_expect(e->root, dopt__eng_req(e, e->started)->rec, peer); /* FLIGHT RECORDER */
    return i;
}

static int dopt__eng_op_done(const dopt__op *o) {
    return o->done == o->bytes && o->hdr_done == DOPT_FRAME_BYTES;
}

/* A receive that may not place its payload yet (see dopt__op). */
static int dopt__eng_gated(const dopt__engine *e, const dopt__op *o) {
    return o->dep >= 0 && !dopt__eng_op_done(&e->ops[o->dep]);
}

/* base + off, where base may be NULL for a zero-length buffer (NULL + 0 is undefined in C). */
static unsigned char *dopt__at(void *base, size_t off) { return base ? (unsigned char *)base + off : NULL; }

/* Ring pass over the blocks e->blk_off/blk_len of base among n ranks in a ring: ring[i] is the
   link of position i (NULL: rank i itself, n = e->size), this rank is at pos. At step s send block
   first - s to the right neighbour and receive block first - s - 1 from the left one (combining it
   into place when reduce is set). Each send waits on the previous receive: the block it forwards
   is the one that receive produced. Returns the last receive, to chain a second pass on. */
static int dopt__eng_ring(dopt__engine *e, const dopt_coll_desc *d, unsigned char *base, int first, int reduce, int dep,
                          int n, int pos, const int *ring) {
    int right = (pos + 1) % n, left = (pos + n - 1) % n, s;
    if (ring) right = ring[right], left = ring[left];
    for (s = 0; s < n - 1; s++) {
        int out = dopt__mod((long long)first - s, n), in = dopt__mod((long long)first - s - 1, n);
        dopt__eng_send(e, d, right, dopt__at(base, e->blk_off[out]), e->blk_len[out], dep);
        dep = dopt__eng_recv(e, left, dopt__at(base, e->blk_off[in]), e->blk_len[in], reduce);
    }
    return dep;
}

/* The link of rank i of c: its rank in the root communicator. */
static int dopt__link(const dopt_comm *c, int i) { return c->members ? c->members[i] : i; }

/* Binomial tree (small) or pipelined chain (large) from the root, in c's ranks relative to it. */
static void dopt__eng_bcast(dopt__engine *e, const dopt_comm *c, const dopt_coll_desc *d, unsigned char *buf,
                            size_t bytes, int chain) {
    int n = c->size, r = c->rank, v = dopt__mod((long long)r - d->root, n), dep = -1;
    long long low = 1, m;
    if (chain) {
        if (v > 0) dep = dopt__eng_recv(e, dopt__link(c, dopt__mod((long long)r - 1, n)), buf, bytes, 0);
        if (v < n - 1) dopt__eng_send(e, d, dopt__link(c, dopt__mod((long long)r + 1, n)), buf, bytes, dep);
        return;
    }
    /* v's subtree is v .. v + low - 1, where low is v's lowest set bit (the root's: all ranks) */
    if (v > 0) {
        low = v & -v;
        dep = dopt__eng_recv(e, dopt__link(c, dopt__mod((long long)r - low, n)), buf, bytes, 0);
    } else {
        while (low < n) low <<= 1;
    }
    for (m = low >> 1; m >= 1; m >>= 1) /* the largest subtree first: it has the longest way to go */
        if (v + m < n) dopt__eng_send(e, d, dopt__link(c, dopt__mod((long long)r + m, n)), buf, bytes, dep);
}

/* Dissemination barrier: in round k send to rank + 2^k and hear from rank - 2^k; after
   ceil(log2 n) rounds every rank has heard, transitively, from every other. */
static void dopt__eng_barrier(dopt__engine *e, const dopt_comm *c, const dopt_coll_desc *d) {
    int n = c->size, r = c->rank, dep = -1;
    long long k;
    for (k = 1; k < n; k <<= 1) {
        dopt__eng_send(e, d, dopt__link(c, (int)((r + k) % n)), NULL, 0, dep);
        dep = dopt__eng_recv(e, dopt__link(c, (int)((r + n - k) % n)), NULL, 0, 0);
    }
}

/* ===================================================================== RECEIVING */

static void dopt__eng_rx_next(dopt__engine *e, dopt__peer *P, dopt__op *o) {
    const dopt__req *q = dopt__eng_req(e, o->req);
    if (o->done != o->bytes) return;
    P->rx_cur = o->next;
    dopt__rec_arrived(e->root, q->comm, q->rec, o->peer); /* FLIGHT RECORDER */
}

/* A DATA frame of a collective from a peer this rank expects nothing (more) from: another
   collective than ours is a mismatch, ours a protocol error. */
static dopt_status dopt__eng_unexpected(dopt_comm *c, dopt__engine *e, int p, const dopt__frame *f) {
    const dopt_coll_desc *d = dopt__eng_current(e);
    if (d && f->sender == p && !dopt__same_coll(d, &f->desc)) {
        dopt_comm_fail_mismatch(c, d, &f->desc, p);
        return dopt__eng_abort_checked(c, d, p);
    }
    return dopt__eng_fail(c, d, DOPT_ERR_PROTOCOL, p, "rank %d sent a frame this rank did not expect", p);
}

/* An ABORT frame at the head of p's stage: DOPT_OK while its words have not all arrived, else
   the failure it carries (a protocol error when it names ranks outside the world). */
static dopt_status dopt__eng_take_abort(dopt_comm *c, dopt__engine *e, int p, const dopt_coll_desc *d,
                                        const dopt__frame *f) {
    const dopt__peer *P = &e->peers[p];
    if (f->culprit >= e->size || f->reporter >= e->size)
        return dopt__eng_fail(c, d, DOPT_ERR_PROTOCOL, p, "rank %d sent an abort naming ranks %d and %d in a world of %d",
                              p, f->culprit, f->reporter, e->size);
    if (P->hi - P->lo < DOPT_FRAME_BYTES + f->bytes) return DOPT_OK;
    return dopt__eng_peer_aborted(c, d, f, P->stage + P->lo + DOPT_FRAME_BYTES);
}

/* Consumes what peer p's stage holds: frame headers (validated before anything of the payload is
   used), payload copied or combined into place, aborts and goodbyes. */
static dopt_status dopt__eng_consume(dopt_comm *c, dopt__engine *e, int p) {
    dopt__peer *P = &e->peers[p];
    for (;;) {
        dopt__op *o = P->rx_cur >= 0 ? &e->ops[P->rx_cur] : NULL;
        const dopt_coll_desc *d = o ? &dopt__eng_req(e, o->req)->desc : dopt__eng_current(e);
        size_t avail = P->hi - P->lo, take, es;
        if (o == NULL || !o->hdr_done) {
            dopt__frame f;
            const char *why;

            if (avail < DOPT_FRAME_BYTES || P->parked) return DOPT_OK;
            why = dopt__frame_decode(P->stage + P->lo, &f);
            if (why) return dopt__eng_fail(c, d, DOPT_ERR_PROTOCOL, p, "rank %d sent a malformed frame header: %s", p, why);
            if (o == NULL && f.desc.seq > dopt__eng_queued(e, f.desc.group) && f.type != DOPT__FRAME_GOODBYE) {
                P->parked = 1; /* a later collective's frame, an abort included: this one may still finish */
                return DOPT_OK;
            }
            if (f.type == DOPT__FRAME_ABORT) return dopt__eng_take_abort(c, e, p, d, &f);
            if (f.type == DOPT__FRAME_GOODBYE) {
                P->lo += DOPT_FRAME_BYTES;
                P->gone = 1;
                P->goodbye_seq = f.desc.seq;
                if (o)
                    return dopt__eng_fail(c, d, DOPT_ERR_PEER_LOST, p,
                                          "rank %d destroyed its communicator after its collective #%llu", p,
                                          (unsigned long long)f.desc.seq);
                continue;
            }
            if (o == NULL) return dopt__eng_unexpected(c, e, p, &f);
            if (dopt__frame_check(c, d, p, &f, o->bytes) != DOPT_OK) return dopt__eng_abort_checked(c, d, p);
            P->lo += DOPT_FRAME_BYTES;
            o->hdr_done = DOPT_FRAME_BYTES;
            avail -= DOPT_FRAME_BYTES;
        }
        if (dopt__eng_gated(e, o)) return DOPT_OK;
        es = d->kind == DOPT_COLL_ALLREDUCE ? dopt_dtype_size(d->dtype) : 1;
        take = avail < o->bytes - o->done ? avail : o->bytes - o->done;
        if (o->reduce) {
            take -= take % es;
            if (take > 0 && (uintptr_t)(P->stage + P->lo) % es != 0) { /* after an odd-sized frame */
                memmove(P->stage, P->stage + P->lo, avail);
                P->lo = 0;
                P->hi = avail;
            }
            if (take > 0) dopt_reduce(o->ptr + o->done, P->stage + P->lo, take / es, d->dtype, d->op);
        } else if (take > 0) {
            memcpy(o->ptr + o->done, P->stage + P->lo, take);
        }
        o->done += take;
        P->lo += take;
        if (P->lo == P->hi) P->lo = P->hi = 0;
        if (o->done < o->bytes) return DOPT_OK;
        dopt__eng_rx_next(e, P, o);
    }
}

/* Peer p said goodbye (destroyed its communicator) and then ended its link: fails the collective
   that needed it. */
static dopt_status dopt__eng_peer_left(dopt_comm *c, dopt__engine *e, int p) {
    const dopt__peer *P = &e->peers[p];
    return dopt__eng_fail(c, &dopt__eng_req(e, P->rx_cur >= 0 ? e->ops[P->rx_cur].req : e->retired)->desc,
                          DOPT_ERR_PEER_LOST, p, "rank %d destroyed its communicator after its collective #%llu", p,
                          (unsigned long long)P->goodbye_seq);
}

static dopt_status dopt__eng_pump_rx(dopt_comm *c, dopt__engine *e, int p, int *progress) {
    dopt__peer *P = &e->peers[p];
    int round;
    /* A few reads at most, so that sends to other peers are not starved; what was read is always
       consumed before returning, since the link will not report those bytes again. */
    for (round = 0;; round++) {
        dopt__op *o;
        unsigned char *dst;
        size_t room;
        long n;
        int direct = 0, err = 0;
        dopt_status s = dopt__eng_consume(c, e, p);
        if (s != DOPT_OK) return s;
        if (P->parked || round == 4) return DOPT_OK;
        o = P->rx_cur >= 0 ? &e->ops[P->rx_cur] : NULL;
        if (o && dopt__eng_gated(e, o)) return DOPT_OK; /* read on once the gate opens */
        if (o && o->hdr_done && !o->reduce && P->lo == P->hi && o->bytes - o->done >= DOPT__DIRECT_MIN) {
            direct = 1; /* large copies go straight into place */
            dst = o->ptr + o->done;
            room = o->bytes - o->done;
        } else {
            if (P->lo > 0 && DOPT__STAGE_BYTES - P->hi < DOPT__STAGE_BYTES / 2) {
                memmove(P->stage, P->stage + P->lo, P->hi - P->lo);
                P->hi -= P->lo;
                P->lo = 0;
            }
            dst = P->stage + P->hi;
            room = DOPT__STAGE_BYTES - P->hi;
            if (room == 0) { /* a stage full of a later collective's frame */
                P->parked = 1;
                return DOPT_OK;
            }
        }
        n = e->root->vt->link_recv(e->root, p, dst, room, &err);
        if (n > 0) {
            *progress = 1;
            if (direct) {
                o->done += (size_t)n;
                dopt__eng_rx_next(e, P, o);
            } else {
                P->hi += (size_t)n;
            }
            continue;
        }
        if (n == 0) return DOPT_OK;
        if (P->rx_cur < 0) {
            /* Nothing more is needed from p now, so the collectives in flight may finish; a
               later one that needs p finds the link closed. */
            P->parked = 1;
            return DOPT_OK;
        }
        if (P->gone) return dopt__eng_peer_left(c, e, p);
        dopt__eng_mark_closed(c, e, p, err, 0);
        return DOPT_OK;
    }
}

/* What is left of an ended link's stream, read and dropped: the rest of a frame in progress and
   every frame after it (a later collective's, parked), up to the stream's end. An abort there says
   who failed first: a peer that was a collective ahead sent it behind its next frame, which may
   be tens of MiB that this rank would never read otherwise. Waits for what has not arrived up to
   DOPT__BLAME_MS. Returns the abort's failure, else DOPT_OK (*err: how the stream ended). Only
   for a link a collective in flight needs and cannot have: what is dropped is never used. */
static dopt_status dopt__eng_read_past(dopt_comm *c, dopt__engine *e, int p, int *err) {
    dopt__peer *P = &e->peers[p];
    const dopt__op *o = P->rx_cur >= 0 ? &e->ops[P->rx_cur] : NULL;
    const dopt_coll_desc *d = dopt__eng_current(e);
    double until = dopt__now_ms() + DOPT__BLAME_MS;
    if (o && o->hdr_done) P->skip = o->bytes - o->done;
    for (;;) {
        size_t take = P->hi - P->lo < P->skip ? P->hi - P->lo : (size_t)P->skip;
        dopt_link_poll w;
        dopt__frame f;
        const char *why;
        long n;
        int wait_err = 0;
        P->lo += take;
        P->skip -= take;
        if (P->skip == 0 && P->hi - P->lo >= DOPT_FRAME_BYTES) {
            if ((why = dopt__frame_decode(P->stage + P->lo, &f)) != NULL)
                return dopt__eng_fail(c, d, DOPT_ERR_PROTOCOL, p, "rank %d sent a malformed frame header: %s", p, why);
            if (f.type == DOPT__FRAME_ABORT) {
                dopt_status s = dopt__eng_take_abort(c, e, p, d, &f);
                if (s != DOPT_OK) return s;
            } else {
                if (f.type == DOPT__FRAME_GOODBYE) {
                    P->gone = 1;
                    P->goodbye_seq = f.desc.seq;
                }
                P->lo += DOPT_FRAME_BYTES;
                P->skip = f.bytes;
                continue;
            }
        }
        memmove(P->stage, P->stage + P->lo, P->hi - P->lo);
        P->hi -= P->lo;
        P->lo = 0;
        n = e->root->vt->link_recv(e->root, p, P->stage + P->hi, DOPT__STAGE_BYTES - P->hi, err);
        if (n < 0) return DOPT_OK;
        if (n > 0) {
            P->hi += (size_t)n;
            continue;
        }
        w.peer = p;
        w.events = DOPT_LINK_IN;
        w.revents = 0;
        if (dopt__now_ms() >= until || e->root->vt->link_wait(e->root, &w, 1, dopt__ms_left(until), &wait_err) < 0)
            return DOPT_OK;
    }
}

/* Peer p's link ended (err: why, 0 for an end of stream) while a collective in flight needs it: a
   send to p failed, or p ended its stream while this rank still has frames for it (a peer that
   ended its writing reads no more: it aborted, left or died). Reads past what is left of the
   stream, then records the end for dopt__eng_blame. */
static dopt_status dopt__eng_link_ended(dopt_comm *c, dopt__engine *e, int p, int err, int sending) {
    int end_err = 0;
    dopt_status s = dopt__eng_read_past(c, e, p, &end_err);
    if (s != DOPT_OK) return s;
    if (e->peers[p].gone) return dopt__eng_peer_left(c, e, p);
    dopt__eng_mark_closed(c, e, p, err ? err : end_err, sending);
    return DOPT_OK;
}

/* ===================================================================== SENDING */

/* A peer that failed sends an abort and may close at once; our send then meets a reset before
   the abort was read. What the peer said explains more than "broken pipe", so read it first, past
   any frame parked before it; without one, the link has ended (dopt__eng_link_ended). */
static dopt_status dopt__eng_send_failed(dopt_comm *c, dopt__engine *e, int p, int err) {
    int progress = 0;
    dopt_status s = dopt__eng_pump_rx(c, e, p, &progress);
    dopt__peer *P = &e->peers[p];
    if (s == DOPT_OK && P->closed && P->close_err == 0 && (err == ETIMEDOUT || err == EHOSTUNREACH)) {
        /* The socket's error went to this send, and the read after it saw a bare end: the peer's
           host stopped answering (TCP keep-alive, transport_tcp.h), which is not a close. */
        P->close_err = err;
        P->close_sending = 1;
    }
    if (s != DOPT_OK || P->closed) return s;
    return dopt__eng_link_ended(c, e, p, err, 1);
}

/* Sends what is ready to peer p, at most DOPT__TX_PASS_BYTES in one pass: a rank with many
   requests in flight would otherwise fill the link before it reads anything, and both sides of
   a pair stall on full sockets in turn (8 allreduces of 64 KiB in flight over loopback TCP took
   1.25-1.5x as long as 8 blocking ones; with the cap, 0.9-1.0x). */
static dopt_status dopt__eng_pump_tx(dopt_comm *c, dopt__engine *e, int p, int *progress) {
    dopt__peer *P = &e->peers[p];
    size_t moved = 0;
    while (P->tx_cur >= 0 && moved < DOPT__TX_PASS_BYTES) {
        dopt__op *o = &e->ops[P->tx_cur];
        size_t ready = o->bytes, hdr_left, sent;
        dopt_iov iov[2];
        long n;
        int err = 0;
        if (o->dep >= 0) {
            const dopt__op *dep = &e->ops[o->dep];
            size_t have = dep->done > o->dep_off ? dep->done - o->dep_off : 0;
            if (!dep->hdr_done) return DOPT_OK;
            ready = have < o->bytes ? have : o->bytes;
        }
        hdr_left = DOPT_FRAME_BYTES - o->hdr_done;
        if (hdr_left == 0 && o->done == ready && o->done < o->bytes) return DOPT_OK;
        iov[0].base = o->hdr + o->hdr_done;
        iov[0].len = hdr_left;
        iov[1].base = dopt__at(o->ptr, o->done);
        iov[1].len = ready - o->done;
        n = e->root->vt->link_send(e->root, p, iov, 2, &err);
        if (n < 0) return dopt__eng_send_failed(c, e, p, err);
        if (n == 0) {
            P->tx_blocked = 1;
            return DOPT_OK;
        }
        sent = (size_t)n;
        moved += sent;
        *progress = 1;
        if (sent >= hdr_left) {
            o->hdr_done = DOPT_FRAME_BYTES;
            o->done += sent - hdr_left;
        } else {
            o->hdr_done += (unsigned)sent;
        }
        P->tx_mid = !(o->hdr_done == DOPT_FRAME_BYTES && o->done == o->bytes);
        if (P->tx_mid) continue; /* the link may take more: the next call says 0 if not */
        P->tx_cur = o->next;
    }
    return DOPT_OK;
}

/* ===================================================================== REQUESTS */

/* The small allreduce's inputs, combined in rank order (x0∘x1∘...): the same expression on every
   rank, so the same bits. */
static void dopt__eng_combine(dopt__req *q) {
    size_t bytes = (size_t)q->payload, count = (size_t)q->desc.count;
    int n = q->comm->size, r = q->comm->rank, i;
    unsigned char *acc = r == 0 ? q->buf : q->scratch;
    if (bytes == 0) return;
    for (i = 1; i < n; i++)
        dopt_reduce(acc, i == r ? q->buf : q->scratch + (size_t)(i < r ? i : i - 1) * bytes, count, q->desc.dtype,
                    q->desc.op);
    if (acc != q->buf) memcpy(q->buf, acc, bytes);
}

/* Ops [0, upto) belong to retired requests: drop them, renumbering the rest. */
static void dopt__eng_compact(dopt__engine *e, int upto) {
    uint64_t k;
    int i, p;
    if (upto == 0) return;
    memmove(e->ops, e->ops + upto, sizeof(dopt__op) * (size_t)(e->nops - upto));
    e->nops -= upto;
    for (i = 0; i < e->nops; i++) {
        if (e->ops[i].dep >= 0) e->ops[i].dep -= upto;
        if (e->ops[i].next >= 0) e->ops[i].next -= upto;
    }
    for (p = 0; p < e->size; p++) {
        dopt__peer *P = &e->peers[p];
        int *q[4];
        int j;
        q[0] = &P->tx_cur, q[1] = &P->tx_tail, q[2] = &P->rx_cur, q[3] = &P->rx_tail;
        for (j = 0; j < 4; j++)
            if (*q[j] >= 0) *q[j] = *q[j] >= upto ? *q[j] - upto : -1;
    }
    for (k = e->retired; k < e->started; k++) {
        dopt__eng_req(e, k)->first_op -= upto;
        dopt__eng_req(e, k)->end_op -= upto;
    }
}

/* Retires the oldest requests whose ops are all done, in start order: combines, divides a mean,
   counts the traffic. */
static void dopt__eng_retire(dopt__engine *e) {
    int drop = 0, p;
    while (e->retired < e->started) {
        dopt__req *q = dopt__eng_req(e, e->retired);
        int i;
        for (i = q->first_op; i < q->end_op; i++)
            if (!dopt__eng_op_done(&e->ops[i])) break;
        if (i < q->end_op) break;
        if (q->pooled >= 0) e->pool[q->pooled].lent = 0;
        if (q->comm != NULL) { /* NULL: its group was destroyed */
            if (q->direct) dopt__eng_combine(q);
            if (q->desc.kind == DOPT_COLL_ALLREDUCE && q->desc.op == DOPT_MEAN && q->comm->size > 1)
                dopt__divide(q->buf, (size_t)q->desc.count, q->desc.dtype, q->comm->size);
            q->comm->traffic.calls[q->desc.kind]++;
            q->comm->traffic.bytes[q->desc.kind] += q->payload;
            q->comm->traffic.sent[q->desc.kind] += q->sent;
            q->comm->traffic.received[q->desc.kind] += q->received;
            dopt__rec_end(e->root, q->comm, q->rec, DOPT_OK); /* FLIGHT RECORDER */
        }
        drop = q->end_op;
        e->retired++;
    }
    if (e->retired == e->started) { /* idle: the next collective starts afresh */
        e->nops = 0;
        e->blame_deadline = 0;
        e->last_progress = 0;
        for (p = 0; p < e->size; p++) {
            dopt__peer *P = &e->peers[p];
            P->tx_cur = P->tx_tail = P->rx_cur = P->rx_tail = -1;
        }
    } else if (drop > e->nops / 2) {
        dopt__eng_compact(e, drop);
    }
}

/* Room for one more request of up to `ops` ops: grows the tables (only at a new high-water mark,
   so a steady state allocates nothing). */
static dopt_status dopt__eng_reserve(dopt__engine *e, int ops) {
    if (e->nops + ops > e->cap_ops) {
        int cap = (e->nops + ops) * 2;
        dopt__op *grown = (dopt__op *)DOPT_MALLOC(sizeof(dopt__op) * (size_t)cap);
        if (grown == NULL) return DOPT_ERR_NOMEM;
        memcpy(grown, e->ops, sizeof(dopt__op) * (size_t)e->nops);
        DOPT_FREE(e->ops);
        e->ops = grown;
        e->cap_ops = cap;
    }
    if (e->started - e->retired == e->cap_reqs) {
        uint64_t cap = e->cap_reqs * 2, k;
        dopt__req *grown = (dopt__req *)DOPT_MALLOC(sizeof(dopt__req) * (size_t)cap);
        if (grown == NULL) return DOPT_ERR_NOMEM;
        memset(grown, 0, sizeof(dopt__req) * (size_t)cap);
        dopt__scratch *pool = (dopt__scratch *)DOPT_MALLOC(sizeof(dopt__scratch) * (size_t)cap);
        if (pool == NULL) {
            DOPT_FREE(grown);
            return DOPT_ERR_NOMEM;
        }
        memset(pool, 0, sizeof(dopt__scratch) * (size_t)cap);
        memcpy(pool, e->pool, sizeof(dopt__scratch) * (size_t)e->cap_reqs);
        for (k = e->retired; k < e->started; k++) grown[k & (cap - 1)] = *dopt__eng_req(e, k);
        DOPT_FREE(e->reqs);
        DOPT_FREE(e->pool);
        e->reqs = grown;
        e->pool = pool;
        e->cap_reqs = cap;
    }
    return DOPT_OK;
}

/* A free pool buffer of at least `bytes`: the smallest that fits, else the largest free one
   grown. -1 when memory runs out. */
static int dopt__eng_lend(dopt__engine *e, size_t bytes) {
    int i, best = -1, n = (int)e->cap_reqs;
    for (i = 0; i < n; i++) {
        const dopt__scratch *b = &e->pool[i];
        if (b->lent) continue;
        if (best < 0) best = i;
        else if (b->cap >= bytes ? (e->pool[best].cap < bytes || b->cap < e->pool[best].cap) : b->cap > e->pool[best].cap)
            best = i;
    }
    DOPT_ASSERT(best >= 0); /* cap_reqs buffers for at most cap_reqs requests in flight */
    if (e->pool[best].cap < bytes) {
        DOPT_FREE(e->pool[best].buf);
        e->pool[best].buf = (unsigned char *)DOPT_MALLOC(bytes);
        e->pool[best].cap = e->pool[best].buf ? bytes : 0;
        if (e->pool[best].buf == NULL) return -1;
    }
    e->pool[best].lent = 1;
    return best;
}

/* The next request's slot, with at least `scratch` bytes of scratch. */
static dopt__req *dopt__eng_begin(dopt_comm *c, dopt__engine *e, const dopt_coll_desc *d, int ops, size_t scratch) {
    dopt__req *q;
    dopt_status s = dopt__eng_reserve(e, ops);
    if (s != DOPT_OK) {
        dopt_comm_fail(c, d, s, "cannot grow the engine's tables");
        return NULL;
    }
    q = dopt__eng_req(e, e->started);
    q->scratch = NULL;
    q->pooled = -1;
    if (scratch > 0) {
        q->pooled = dopt__eng_lend(e, scratch);
        if (q->pooled < 0) {
            dopt_comm_fail(c, d, DOPT_ERR_NOMEM, "cannot allocate %llu bytes of scratch", (unsigned long long)scratch);
            return NULL;
        }
        q->scratch = e->pool[q->pooled].buf;
    }
    q->desc = *d;
    q->comm = c;
    q->rec = dopt__rec_current(e->root); /* FLIGHT RECORDER: the entry dopt__start began */
    q->api = c->api;
    q->buf = NULL;
    q->payload = 0;
    q->sent = q->received = 0;
    q->direct = 0;
    q->first_op = e->nops;
    return q;
}

static void dopt__eng_end(dopt__engine *e, dopt__req *q) {
    q->end_op = e->nops;
    q->comm->started_seq = q->desc.seq;
    e->started++;
}

/* ===================================================================== PROGRESS */

/* Nothing moved for the timeout: the culprit is the first rank waited for. */
static dopt_status dopt__eng_timed_out(dopt_comm *c, dopt__engine *e) {
    char who[160] = "";
    size_t used = 0;
    int p, culprit = -1;
    if (e->blame_deadline > 0) return dopt__eng_blame(c, e); /* a link ended: that says more */
    for (p = 0; p < e->size && used < sizeof who - 40; p++) {
        dopt__peer *P = &e->peers[p];
        int waited = 1;
        if (p == e->rank) continue;
        if (P->rx_cur >= 0)
            used += (size_t)snprintf(who + used, sizeof who - used, "%sdata from rank %d", used ? ", " : "", p);
        else if (P->tx_cur >= 0 && P->tx_blocked)
            used += (size_t)snprintf(who + used, sizeof who - used, "%srank %d to read", used ? ", " : "", p);
        else
            waited = 0;
        if (waited && culprit < 0) culprit = p;
    }
    return dopt__eng_fail(c, dopt__eng_current(e), DOPT_ERR_TIMEOUT, culprit < 0 ? e->rank : culprit,
                          "no progress for %d ms waiting for %s", c->timeout_ms, who);
}

/* A link ended (dopt__eng_mark_closed) and the links that remain were polled once since: name
   the culprit when its time has come or nobody is left to say more. */
static int dopt__eng_blame_due(const dopt__engine *e, int polled_since) {
    return polled_since && e->blame_deadline > 0 && (dopt__now_ms() >= e->blame_deadline || dopt__eng_open_peers(e) == 0);
}

/* One pass: sends whatever is ready, then asks the links what may move (waiting up to wait_ms)
   and receives what has arrived. *progress is set when bytes moved. The wait never outlasts a
   blame deadline: a send of this very pass may have found a link ended and set one after the
   caller computed wait_ms, and the links left may give no reason to wake (parked, or none). */
static dopt_status dopt__eng_pass(dopt_comm *c, dopt__engine *e, int wait_ms, int *progress, int *polled) {
    int p, np = 0, n, i, err = 0;
    dopt_status s;
    for (p = 0; p < e->size; p++) {
        dopt__peer *P = &e->peers[p];
        if (p == e->rank || P->tx_cur < 0 || P->tx_blocked || P->closed) continue;
        s = dopt__eng_pump_tx(c, e, p, progress);
        if (s != DOPT_OK) return s;
    }
    for (p = 0; p < e->size; p++) { /* payload staged while its receive was gated */
        dopt__peer *P = &e->peers[p];
        if (p != e->rank && !P->parked && P->hi > P->lo && P->rx_cur >= 0 && !dopt__eng_gated(e, &e->ops[P->rx_cur])) {
            size_t before = P->hi - P->lo;
            s = dopt__eng_consume(c, e, p);
            if (s != DOPT_OK) return s;
            if (P->hi - P->lo != before) *progress = 1;
        }
    }
    if (*progress) wait_ms = 0;
    for (p = 0; p < e->size; p++) {
        dopt__peer *P = &e->peers[p];
        short ev = 0;
        if (p == e->rank || P->closed) continue;
        if (!P->parked && !(P->rx_cur >= 0 && dopt__eng_gated(e, &e->ops[P->rx_cur]))) ev |= DOPT_LINK_IN;
        if (P->tx_cur >= 0 && P->tx_blocked) ev |= DOPT_LINK_OUT;
        if (!ev && !(P->parked && P->tx_cur >= 0)) continue; /* else watched for its end alone */
        e->polls[np].peer = p;
        e->polls[np].events = ev;
        e->polls[np++].revents = 0;
    }
    if (e->blame_deadline > 0 && wait_ms > dopt__ms_left(e->blame_deadline))
        wait_ms = dopt__ms_left(e->blame_deadline); /* a link ended in this pass: its verdict is due */
    *polled = 1;
    n = e->root->vt->link_wait(e->root, e->polls, np, wait_ms, &err);
    if (n < 0)
        return dopt__eng_fail(c, dopt__eng_current(e), DOPT_ERR_IO, e->rank, "waiting on links: %s", strerror(err));
    for (i = 0; i < np && n > 0; i++) {
        short re = e->polls[i].revents;
        p = e->polls[i].peer;
        if ((re & DOPT_LINK_IN) && !(e->polls[i].events & DOPT_LINK_IN)) { /* ended; its reads wait */
            s = dopt__eng_link_ended(c, e, p, 0, 1);
            if (s != DOPT_OK) return s;
            continue;
        }
        if (re & DOPT_LINK_OUT) e->peers[p].tx_blocked = 0;
        if (re & DOPT_LINK_IN) {
            e->peers[p].tx_blocked = 0; /* a failed link: the send says why */
            s = dopt__eng_pump_rx(c, e, p, progress);
            if (s != DOPT_OK) return s;
        }
    }
    return DOPT_OK;
}

/* Frames a fast peer sent before this rank started the collectives that take them. */
static dopt_status dopt__eng_consume_staged(dopt_comm *c, dopt__engine *e) {
    int q;
    for (q = 0; q < e->size; q++)
        if (q != e->rank && e->peers[q].hi > e->peers[q].lo && !e->peers[q].parked) {
            dopt_status s = dopt__eng_consume(c, e, q);
            if (s != DOPT_OK) return s;
        }
    return DOPT_OK;
}

/* Runs the requests in flight until request `until` has retired (block) or for one pass (test):
   sends whatever is ready, receives whatever has arrived, polls for spin_us without sleeping
   after progress, then sleeps in link_wait; fails when nothing moved for the communicator's
   timeout. A wait's timeout counts from its own start at the earliest (the caller may have
   computed for longer than the timeout since starting the request); a run of dopt_test calls
   counts from the last progress, so that polling a silent peer ends too. Every peer is watched
   for reading, so that an abort or a dead link is seen even from a peer no collective waits for. */
static dopt_status dopt__eng_run(dopt_comm *c, dopt__engine *e, uint64_t until, int block) {
    double entry = dopt__now_ms(), spin_end = entry + (e->spin_us > 0 ? e->spin_us / 1000.0 : 0.0), last;
    const char *api = c->api;
    dopt_status s = dopt__eng_consume_staged(c, e);
    if (e->last_progress == 0) e->last_progress = entry;
    last = block && entry > e->last_progress ? entry : e->last_progress;
    while (s == DOPT_OK) {
        int progress = 0, polled = 0, wait_ms = 0;
        dopt__eng_retire(e);
        if (e->retired > until) break;
        if (e->retired < e->started) c->api = dopt__eng_req(e, e->retired)->api; /* named in failures */
        if (block && dopt__now_ms() >= spin_end) {
            double until_ms = last + (double)c->timeout_ms;
            if (e->blame_deadline > 0 && e->blame_deadline < until_ms) until_ms = e->blame_deadline;
            wait_ms = dopt__ms_left(until_ms);
        }
        s = dopt__eng_pass(c, e, wait_ms, &progress, &polled);
        if (s != DOPT_OK) break;
        if (dopt__eng_blame_due(e, polled)) {
            s = dopt__eng_blame(c, e);
            break;
        }
        if (progress) {
            last = e->last_progress = dopt__now_ms();
            spin_end = last + (e->spin_us > 0 ? e->spin_us / 1000.0 : 0.0);
        } else if (dopt__now_ms() - last >= (double)c->timeout_ms) {
            s = dopt__eng_timed_out(c, e);
            break;
        }
        if (!block) {
            dopt__eng_retire(e);
            break;
        }
    }
    if (s != DOPT_OK) dopt__eng_retire(e); /* what completed before the failure did complete */
    c->api = api;
    return s == DOPT_OK ? dopt__family_error(c) : s;
}

/* Before a collective the backend runs itself: every request in flight finishes first, so that
   collectives complete in the order they started. */
static dopt_status dopt__eng_drain(dopt_comm *c) {
    dopt__engine *e = c->eng;
    dopt_status s;
    if (e == NULL) return c->error;
    dopt__eng_lock(e);
    s = e->retired == e->started ? dopt__family_error(c) : dopt__eng_run(c, e, e->started - 1, 1);
    return dopt__eng_unlock(e, s);
}

/* ===================================================================== COLLECTIVES */

/* Splits count elements of es bytes at byte offset off into n ring blocks (e->blk_off/blk_len). */
static void dopt__eng_blocks(dopt__engine *e, uint64_t count, size_t es, size_t off, int n) {
    int i;
    for (i = 0; i < n; i++) {
        uint64_t first, len;
        dopt__ring_segment(count, n, i, &first, &len);
        e->blk_off[i] = off + (size_t)first * es;
        e->blk_len[i] = (size_t)len * es;
    }
}

/* Host-aware allreduce (ranks on `hosts` hosts, `local` on each). The buffer is cut into local
   chunks and each chunk into `hosts` blocks. A ring reduce-scatter among the host's ranks leaves
   each with one chunk of the host's sum (local position j holds chunk j + 1); the ranks that hold
   the same chunk on every host allreduce it in a ring across hosts, each carrying 1/local of the
   buffer over the host's link; then, block by block as the ring across hosts finishes them, a
   ring allgather within the host spreads the chunks. Each element's sum is formed once, in a
   fixed order, and then copied, so every rank gets the same bits, run after run. The phases
   overlap: the ring across hosts sends a block as soon as the host's sum of it is there and
   combines into the chunk only once the chunk is whole (a gated receive); each block goes on
   within the host as soon as it is final. */
static void dopt__eng_two_level(dopt__engine *e, const dopt_coll_desc *d, unsigned char *buf, size_t es) {
    int L = e->local, H = e->hosts, j = e->local_pos, k = (j + 1) % L, hp = e->host_pos, t, i, host_sum, rs, ag;
    size_t chunk_off;
    uint64_t chunk_count;
    dopt__eng_blocks(e, d->count, es, 0, L);
    chunk_off = e->blk_off[k];
    chunk_count = e->blk_len[k] / es;
    host_sum = dopt__eng_ring(e, d, buf, j, 1, -1, L, j, e->host_ring);
    dopt__eng_blocks(e, chunk_count, es, chunk_off, H);
    rs = e->nops; /* step s's receive is op rs + 2s + 1, and so for ag */
    dopt__eng_ring(e, d, buf, hp, 1, host_sum, H, hp, e->cross_ring);
    e->ops[rs].dep_off = e->blk_off[hp] - chunk_off;
    e->ops[rs + 1].dep = host_sum;
    ag = e->nops;
    dopt__eng_ring(e, d, buf, hp + 1, 0, rs + 2 * (H - 2) + 1, H, hp, e->cross_ring);
    /* block b of every chunk, in the order the ring across hosts finishes this rank's: b = hp + 1
       (the reduce-scatter's last receive), then hp, hp - 1, ... (allgather step hp - b) */
    for (t = 0; t < H; t++) {
        int b = dopt__mod((long long)hp + 1 - t, H), done = t == 0 ? rs + 2 * (H - 2) + 1 : ag + 2 * (t - 1) + 1;
        for (i = 0; i < L; i++) { /* chunk i's block b */
            uint64_t cf, cl, bf, bl;
            dopt__ring_segment(d->count, L, i, &cf, &cl);
            dopt__ring_segment(cl, H, b, &bf, &bl);
            e->blk_off[i] = (size_t)(cf + bf) * es;
            e->blk_len[i] = (size_t)bl * es;
        }
        dopt__eng_ring(e, d, buf, k, 0, done, L, j, e->host_ring);
    }
}

static dopt_status dopt__eng_allreduce(dopt_comm *c, const dopt_coll_desc *d, void *buf) {
    dopt__engine *e = c->eng;
    size_t es = dopt_dtype_size(d->dtype), bytes = (size_t)d->count * es;
    int n = c->size, r = c->rank, i, last;
    int direct = bytes <= e->small_bytes / (size_t)(n > 1 ? n - 1 : 1) || d->count < (uint64_t)n;
    int two = c == e->root && e->hosts > 1 && e->local > 1 && d->count > 0 && e->two_level != DOPT_TWO_LEVEL_OFF &&
              (e->two_level == DOPT_TWO_LEVEL_ON || !direct);
    dopt__req *q;
    if (two) direct = 0;
    q = dopt__eng_begin(c, e, d, 4 * n, direct && n > 1 ? bytes * (size_t)(n - 1) : 0);
    if (q == NULL) return c->error;
    q->buf = (unsigned char *)buf;
    q->payload = bytes;
    if (n > 1 && direct) {
        /* Small: every rank sends its whole buffer to every other, each combines at completion. */
        q->direct = 1;
        for (i = 1; i < n; i++) {
            int p = (r + i) % n;
            dopt__eng_send(e, d, dopt__link(c, p), buf, bytes, -1);
            dopt__eng_recv(e, dopt__link(c, p), dopt__at(q->scratch, (size_t)(p < r ? p : p - 1) * bytes), bytes, 0);
        }
    } else if (two) {
        dopt__eng_two_level(e, d, (unsigned char *)buf, es);
    } else if (n > 1) {
        /* Large: ring reduce-scatter, then ring allgather of the reduced segments. */
        dopt__eng_blocks(e, d->count, es, 0, n);
        last = dopt__eng_ring(e, d, (unsigned char *)buf, r, 1, -1, n, r, c->members);
        dopt__eng_ring(e, d, (unsigned char *)buf, r + 1, 0, last, n, r, c->members);
    }
    dopt__eng_end(e, q);
    return DOPT_OK;
}

static dopt_status dopt__eng_allgatherv(dopt_comm *c, const dopt_coll_desc *d, const void *send, void *recv,
                                        const size_t *bytes) {
    dopt__engine *e = c->eng;
    unsigned char *out = (unsigned char *)recv;
    size_t total = 0;
    int i, n = c->size, r = c->rank;
    dopt__req *q = dopt__eng_begin(c, e, d, 2 * n, 0);
    if (q == NULL) return c->error;
    q->payload = bytes[r];
    for (i = 0; i < n; i++) {
        e->blk_off[i] = total;
        e->blk_len[i] = bytes[i];
        total += bytes[i];
    }
    if (bytes[r] > 0 && out + e->blk_off[r] != (const unsigned char *)send)
        memmove(out + e->blk_off[r], send, bytes[r]); /* bytes[r] > 0: out is not NULL */
    if (n > 1 && total <= e->small_bytes) {
        for (i = 1; i < n; i++) {
            int p = (r + i) % n;
            dopt__eng_send(e, d, dopt__link(c, p), dopt__at(out, e->blk_off[r]), bytes[r], -1);
            dopt__eng_recv(e, dopt__link(c, p), dopt__at(out, e->blk_off[p]), bytes[p], 0);
        }
    } else if (n > 1) {
        dopt__eng_ring(e, d, out, r, 0, -1, n, r, c->members);
    }
    dopt__eng_end(e, q);
    return DOPT_OK;
}

static dopt_status dopt__eng_broadcast(dopt_comm *c, const dopt_coll_desc *d, void *buf) {
    dopt__engine *e = c->eng;
    size_t bytes = (size_t)d->count;
    dopt__req *q = dopt__eng_begin(c, e, d, c->size, 0);
    if (q == NULL) return c->error;
    q->payload = bytes;
    if (c->size > 1) dopt__eng_bcast(e, c, d, (unsigned char *)buf, bytes, bytes > e->small_bytes);
    dopt__eng_end(e, q);
    return DOPT_OK;
}

static dopt_status dopt__eng_barrier_start(dopt_comm *c, const dopt_coll_desc *d) {
    dopt__engine *e = c->eng;
    dopt__req *q = dopt__eng_begin(c, e, d, 2 * 32, 0); /* two ops a round, ceil(log2 size) <= 31 rounds */
    if (q == NULL) return c->error;
    if (c->size > 1) dopt__eng_barrier(e, c, d);
    dopt__eng_end(e, q);
    return DOPT_OK;
}

/* Each rank's own messages, checked by dopt_exchange_start: every send and receive queued at
   once, the sends never waiting for a receive. */
static dopt_status dopt__eng_exchange(dopt_comm *c, const dopt_coll_desc *d, const dopt_xfer *sends, int nsends,
                                      const dopt_xfer *recvs, int nrecvs) {
    dopt__engine *e = c->eng;
    dopt__req *q = dopt__eng_begin(c, e, d, nsends + nrecvs, 0);
    int i;
    if (q == NULL) return c->error;
    for (i = 0; i < nsends; i++) {
        dopt__eng_send(e, d, dopt__link(c, sends[i].peer), sends[i].buf, sends[i].bytes, -1);
        q->payload += sends[i].bytes;
    }
    for (i = 0; i < nrecvs; i++) dopt__eng_recv(e, dopt__link(c, recvs[i].peer), recvs[i].buf, recvs[i].bytes, 0);
    dopt__eng_end(e, q);
    return DOPT_OK;
}

/* ===================================================================== SETTINGS, PROGRESS THREAD AND GOODBYE */

DOPT_DEF void dopt_comm_set_engine(dopt_comm *c, size_t small_bytes, int spin_us) {
    if (c == NULL || c->eng == NULL) return;
    c->eng->small_bytes = small_bytes ? small_bytes : DOPT__SMALL_DEFAULT;
    c->eng->spin_us = spin_us == 0 ? DOPT__SPIN_DEFAULT_US : spin_us;
}

DOPT_DEF dopt_status dopt_comm_set_hosts(dopt_comm *c, const int *host_of, int two_level) {
    dopt__engine *e;
    int n, r, count = 0;
    if (c == NULL || two_level < DOPT_TWO_LEVEL_OFF || two_level > DOPT_TWO_LEVEL_ON) return DOPT_ERR_INVALID;
    if ((e = c->eng) == NULL) return DOPT_OK; /* the backend's own collectives know their hosts */
    n = e->size;
    e->two_level = two_level;
    e->hosts = e->local = 0;
    DOPT_FREE(e->host_of);
    e->host_of = NULL;
    if (host_of == NULL) return DOPT_OK;
    if (e->host_ring == NULL) {
        e->host_ring = (int *)DOPT_MALLOC(sizeof(int) * (size_t)n);
        e->cross_ring = (int *)DOPT_MALLOC(sizeof(int) * (size_t)n);
        e->host_table = (int *)DOPT_MALLOC(sizeof(int) * (size_t)n);
        if (e->host_ring == NULL || e->cross_ring == NULL || e->host_table == NULL) return DOPT_ERR_NOMEM;
    }
    if ((e->host_of = (int *)DOPT_MALLOC(sizeof(int) * (size_t)n)) == NULL) return DOPT_ERR_NOMEM;
    memcpy(e->host_of, host_of, sizeof(int) * (size_t)n);
    /* hosts in the order of their lowest rank; this host's ranks in rank order */
    for (r = 0; r < n; r++)
        if (host_of[r] == host_of[e->rank]) {
            if (r == e->rank) e->local_pos = count;
            e->host_ring[count++] = r;
        }
    e->local = count;
    for (r = 0; r < n; r++) { /* each host once, at its lowest rank */
        int q, seen = 0, ranks = 0;
        for (q = 0; q < r && !seen; q++) seen = host_of[q] == host_of[r];
        if (seen) continue;
        for (q = r; q < n; q++)
            if (host_of[q] == host_of[r]) {
                if (ranks == e->local_pos) e->cross_ring[e->hosts] = q;
                if (ranks < count) e->host_table[e->hosts * count + ranks] = q;
                ranks++;
            }
        if (ranks != count) { /* uneven hosts: flat schedules only */
            e->hosts = e->local = 0;
            return DOPT_OK;
        }
        if (host_of[r] == host_of[e->rank]) e->host_pos = e->hosts;
        e->hosts++;
    }
    return DOPT_OK;
}

#ifdef DOPT__THREADS
/* The progress thread: one pass whenever requests are in flight, interval_us apart, holding the
   engine's lock only for the pass. */
static void *dopt__eng_thread(void *arg) {
    dopt__engine *e = (dopt__engine *)arg;
    pthread_mutex_lock(&e->lock);
    while (!e->stopping) {
        struct timespec until;
        if (e->retired < e->started && e->root->family_status == DOPT_OK) dopt__eng_run(e->root, e, e->started - 1, 0);
        if (e->retired == e->started || e->root->family_status != DOPT_OK) {
            pthread_cond_wait(&e->wake, &e->lock);
            continue;
        }
        timespec_get(&until, TIME_UTC);
        until.tv_nsec += (long)e->interval_us * 1000L;
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&e->wake, &e->lock, &until);
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}
#endif

static void dopt__eng_stop_thread(dopt__engine *e) {
#ifdef DOPT__THREADS
    if (e == NULL || !e->threaded) return;
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->lock);
    pthread_join(e->thread, NULL);
    e->threaded = 0;
    pthread_cond_destroy(&e->wake);
    pthread_mutex_destroy(&e->lock);
#else
    (void)e;
#endif
}

DOPT_DEF dopt_status dopt_comm_set_progress_thread(dopt_comm *c, int interval_us) {
    dopt__engine *e = c ? c->eng : NULL;
    if (c == NULL) return DOPT_ERR_INVALID;
#ifdef DOPT__THREADS
    if (e == NULL) return DOPT_ERR_UNSUPPORTED;
    if (c->root != NULL || e->threaded || interval_us < 0) return DOPT_ERR_INVALID;
    e->interval_us = interval_us ? interval_us : 100;
    e->stopping = 0;
    if (pthread_mutex_init(&e->lock, NULL) != 0) return DOPT_ERR_NOMEM;
    if (pthread_cond_init(&e->wake, NULL) != 0) {
        pthread_mutex_destroy(&e->lock);
        return DOPT_ERR_NOMEM;
    }
    e->threaded = 1; /* before the thread runs: it takes the lock */
    if (pthread_create(&e->thread, NULL, dopt__eng_thread, e) != 0) {
        e->threaded = 0;
        pthread_cond_destroy(&e->wake);
        pthread_mutex_destroy(&e->lock);
        return DOPT_ERR_NOMEM;
    }
    return DOPT_OK;
#else
    (void)interval_us;
    (void)e;
    return DOPT_ERR_UNSUPPORTED;
#endif
}

DOPT_DEF void dopt_links_goodbye(dopt_comm *c, int wait_ms) {
    dopt__engine *e = c ? c->eng : NULL;
    unsigned char hdr[DOPT_FRAME_BYTES];
    double deadline = dopt__now_ms() + wait_ms;
    dopt_coll_desc d;
    int p;
    if (e == NULL || c->error != DOPT_OK) return;
    memset(&d, 0, sizeof d);
    d.seq = c->seq;
    dopt__frame_encode(hdr, DOPT__FRAME_GOODBYE, &d, e->rank, 0, 0);
    for (p = 0; p < e->size; p++) {
        dopt__peer *P = &e->peers[p];
        size_t sent = 0;
        if (p == e->rank || P->tx_mid || P->broken || P->closed) continue;
        while (sent < DOPT_FRAME_BYTES) {
            dopt_iov iov;
            dopt_link_poll w;
            int err = 0;
            long n;
            iov.base = hdr + sent;
            iov.len = DOPT_FRAME_BYTES - sent;
            n = e->root->vt->link_send(e->root, p, &iov, 1, &err);
            if (n < 0) break;
            sent += (size_t)n;
            if (n > 0) continue;
            /* The last data of a collective may still fill the link: wait (bounded) for room. */
            w.peer = p;
            w.events = DOPT_LINK_OUT;
            w.revents = 0;
            if (e->root->vt->link_wait(e->root, &w, 1, dopt__ms_left(deadline), &err) <= 0) break;
        }
    }
}

/* ===================================================================== GROUPS

   A group split from a communicator with links shares them: its collectives run on the root's
   engine, with the group's number (agreed by dopt_comm_split) in every frame header, so a frame
   of another group, or of the parent, is a mismatch; its ranks are mapped to the root's links. */

static const dopt_comm_vtable dopt__group_vtable = {"group", NULL, NULL, NULL, NULL, NULL, sizeof(dopt_comm_vtable),
                                                    0u, NULL, NULL, NULL, NULL, NULL, NULL, dopt_engine_provider,
                                                    NULL, NULL, NULL};

/* This rank's part of the group: color's ranks of c in (key, rank) order, from all[3r..3r+2] =
   {color, key, next free number} of every rank r of c (the provider's split). */
static dopt_status dopt__group_new(dopt_comm *c, const int64_t *all, uint32_t number, dopt_comm **out) {
    dopt__engine *e = c->eng;
    dopt_comm *g;
    int *members = (int *)DOPT_MALLOC(sizeof(int) * (size_t)c->size), m = 0, r, i, me = 0;
    dopt_status s;
    if (members == NULL) return DOPT_ERR_NOMEM;
    for (r = 0; r < c->size; r++) { /* insertion by (key, rank): r comes after equal keys */
        if (all[3 * r] != all[3 * c->rank]) continue;
        for (i = m; i > 0 && all[3 * members[i - 1] + 1] > all[3 * r + 1]; i--) members[i] = members[i - 1];
        members[i] = r;
        m++;
    }
    for (i = 0; i < m; i++) {
        if (members[i] == c->rank) me = i;
        members[i] = dopt__link(c, members[i]); /* ranks of the root, whose links these are */
    }
    if (e->nfamily == e->cap_family) {
        dopt_comm **grown = (dopt_comm **)DOPT_MALLOC(sizeof(dopt_comm *) * (size_t)e->cap_family * 2);
        if (grown == NULL) {
            DOPT_FREE(members);
            return DOPT_ERR_NOMEM;
        }
        dopt__eng_lock(e);
        memcpy(grown, e->family, sizeof(dopt_comm *) * (size_t)e->nfamily);
        DOPT_FREE(e->family);
        e->family = grown;
        e->cap_family *= 2;
        dopt__eng_unlock(e, DOPT_OK);
    }
    s = dopt_comm_new(&g, me, m, &dopt__group_vtable, NULL);
    if (s != DOPT_OK) {
        DOPT_FREE(members);
        return s;
    }
    g->eng = e;
    g->root = e->root;
    g->members = members;
    g->group = number;
    g->timeout_ms = c->timeout_ms;
    g->log_fn = c->log_fn;
    g->log_user = c->log_user;
    g->one_thread = c->one_thread; /* MPI's links below SERIALIZED: the group's calls too */
    dopt__eng_lock(e);
    e->family[e->nfamily++] = g;
    dopt__eng_unlock(e, DOPT_OK);
    *out = g;
    return DOPT_OK;
}

/* ===================================================================== THE ENGINE AS A PROVIDER

   What distopt.h's public calls reach through c->provider (see dopt_coll_provider). */

/* A root gets an engine over its backend's links; a group (dopt__group_new) gets its root's. */
static dopt_status dopt__eng_attach(dopt_comm *c) {
    if (c->vt == &dopt__group_vtable) return DOPT_OK;
    if (!dopt__has_links(c->vt)) return DOPT_ERR_INVALID;
    return (c->eng = dopt__eng_new(c)) != NULL ? DOPT_OK : DOPT_ERR_NOMEM;
}

/* Queues d's schedule, the engine locked; *ticket names its request. */
static dopt_status dopt__eng_queue(dopt_comm *c, const dopt_coll_desc *d, const dopt_coll_args *a, uint64_t *ticket) {
    dopt_status s = DOPT_OK;
    switch (d->kind) {
    case DOPT_COLL_ALLREDUCE: s = dopt__eng_allreduce(c, d, a->buf); break;
    case DOPT_COLL_ALLGATHER:
    case DOPT_COLL_ALLGATHERV: s = dopt__eng_allgatherv(c, d, a->send, a->recv, a->bytes); break;
    case DOPT_COLL_BROADCAST: s = dopt__eng_broadcast(c, d, a->buf); break;
    case DOPT_COLL_BARRIER: s = dopt__eng_barrier_start(c, d); break;
    case DOPT_COLL_EXCHANGE: s = dopt__eng_exchange(c, d, a->sends, a->nsends, a->recvs, a->nrecvs); break;
    }
    if (s == DOPT_OK) *ticket = c->eng->started; /* the request's number + 1 */
    return s;
}

/* The kinds the backend runs itself go to it once the requests in flight have finished (so that
   collectives complete in the order they started); the engine queues the others. */
static dopt_status dopt__eng_start(dopt_comm *c, const dopt_coll_desc *d, const dopt_coll_args *a, uint64_t *ticket) {
    dopt_status s;
    *ticket = 0;
    if (!dopt__engine_runs(c, d->kind)) {
        s = dopt__eng_drain(c);
        return s != DOPT_OK ? s : dopt_own_provider()->start(c, d, a, ticket);
    }
    return DOPT__LOCKED(c->eng, dopt__eng_queue(c, d, a, ticket));
}

static dopt_status dopt__eng_progress(dopt_comm *c, uint64_t ticket, int block, int *done) {
    dopt__engine *e = c->eng;
    uint64_t k = ticket - 1;
    dopt__eng_lock(e);
    if (k >= e->retired && dopt__family_error(c) == DOPT_OK) dopt__eng_run(c, e, k, block);
    if (k < e->retired) return dopt__eng_unlock(e, DOPT_OK);
    *done = dopt__family_error(c) != DOPT_OK;
    return dopt__eng_unlock(e, c->error);
}

static int dopt__eng_host_of(const dopt_comm *c) {
    const dopt__engine *e = c->eng;
    return e && e->host_of ? e->host_of[dopt__link(c, c->rank)] & INT_MAX : -1;
}

static void dopt__eng_host_layout(const dopt_comm *c, dopt_host_layout *out) {
    const dopt__engine *e = c->eng;
    if (e == NULL) return;
    out->two_level = e->two_level;
    if (c != e->root || e->hosts == 0) return; /* groups: flat */
    out->hosts = e->hosts;
    out->local = e->local;
    out->host = e->host_pos;
    out->local_rank = e->local_pos;
}

static int dopt__eng_host_rank(const dopt_comm *c, int host, int local_rank) {
    const dopt__engine *e = c->eng;
    if (e == NULL || c != e->root || e->hosts == 0 || host < 0 || host >= e->hosts || local_rank < 0 ||
        local_rank >= e->local)
        return -1;
    return e->host_table[host * e->local + local_rank];
}

/* c leaves the family; the root's links stay while a group uses them. A group's requests finish
   first (or, after a failure, never will: they forget it). */
static dopt_comm *dopt__eng_leave(dopt_comm *c) {
    dopt__engine *e = c->eng;
    uint64_t k;
    int i, last;
    if (e == NULL) return c;
    if (c->root != NULL && dopt__family_error(c) == DOPT_OK) dopt__eng_drain(c);
    dopt__eng_lock(e);
    for (i = 0; i < e->nfamily && e->family[i] != c; i++) continue;
    if (i < e->nfamily) e->family[i] = e->family[--e->nfamily];
    for (k = e->retired; c->root != NULL && k < e->started; k++)
        if (dopt__eng_req(e, k)->comm == c) dopt__eng_req(e, k)->comm = NULL;
    if (c->root == NULL) c->destroyed = 1;
    last = e->nfamily == 0 && e->root->destroyed;
    dopt__eng_unlock(e, DOPT_OK);
    if (!last) return NULL;
    dopt__eng_stop_thread(e);
    return e->root;
}

static void dopt__eng_release(dopt_comm *c) { dopt__eng_free(c->eng); }

DOPT_DEF const dopt_coll_provider *dopt_engine_provider(void) {
    static const dopt_coll_provider engine = {"engine",
                                              1,
                                              dopt__eng_attach,
                                              dopt__eng_start,
                                              dopt__eng_progress,
                                              dopt__group_new,
                                              dopt__eng_host_of,
                                              dopt__eng_host_layout,
                                              dopt__eng_host_rank,
                                              dopt__eng_leave,
                                              dopt__eng_release};
    return &engine;
}

/* ===================================================================== SHRINK: THE SURVIVORS' AGREEMENT

   After a lost peer the survivors of a communicator of n ranks agree on who is gone (distopt.h:
   SURVIVING A LOST PEER), with no coordinator: the hierarchical consensus of Cachin, Guerraoui
   and Rodrigues (Introduction to Reliable and Secure Distributed Programming, 2011, §5.1.3) over
   the failure detector a transport provides (a link that ends, or silence for the timeout).
   Ranks take turns in rank order. Rank k waits until every rank below it has either told it
   its decision or is known to be gone; it then decides — the decision of the highest rank
   below it that told it one, or, having heard none, the set of ranks it knows are gone — and
   tells every rank above it. Why all deciders agree: take the lowest rank j that decides and
   tells its value D; every rank above j that decides waits for j (j is alive when it tells, so
   it is never taken for gone by a detector that only takes the dead) and adopts D, unless it
   heard a higher rank i < it, which adopted D the same way. A rank that dies while telling
   leaves some ranks with its value and some without; the next rank's value is then either
   its value (it heard it) or its own, and every rank above adopts that one. A detector that
   takes a live but slow rank for gone may break this for that rank: it then decides apart and
   finds its links to the others closed (transport_tcp.h says how that ends). The value is a
   set of ranks (a bitmap of n bits); the lowest survivor decides what it knows when it
   decides, so a rank lost after that stays a member, and the next communicator's first
   collective names it (a second shrink leaves it out). tests/test_shrink.c runs the rules
   below over random schedules of deaths and deliveries. */

typedef struct dopt__agree {
    int n, me;
    int words;      /* 64-bit words of a set of n ranks */
    uint64_t *gone; /* ranks this rank knows are gone */
    uint64_t *value; /* the decision adopted so far (from rank `from`), then the decision */
    uint64_t *heard; /* ranks below this one whose decision arrived */
    int from;       /* the rank whose decision value holds; -1: none heard */
    int decided;
} dopt__agree;

DOPT__MAYBE_UNUSED static int dopt__agree_has(const uint64_t *set, int r) { return (int)(set[r / 64] >> (r % 64)) & 1; }

DOPT__MAYBE_UNUSED static void dopt__agree_free(dopt__agree *a) {
    DOPT_FREE(a->gone);
    a->gone = a->value = a->heard = NULL;
}

/* Rank me of n, knowing nobody gone yet. DOPT_ERR_NOMEM. */
DOPT__MAYBE_UNUSED static dopt_status dopt__agree_init(dopt__agree *a, int n, int me) {
    memset(a, 0, sizeof *a);
    a->n = n;
    a->me = me;
    a->words = (n + 63) / 64;
    a->from = -1;
    a->gone = (uint64_t *)DOPT_MALLOC(3 * sizeof(uint64_t) * (size_t)a->words);
    if (a->gone == NULL) return DOPT_ERR_NOMEM;
    memset(a->gone, 0, 3 * sizeof(uint64_t) * (size_t)a->words);
    a->value = a->gone + a->words;
    a->heard = a->value + a->words;
    return DOPT_OK;
}

/* Rank r is gone (a link ended, silence, the failure's culprit). Never this rank itself. */
DOPT__MAYBE_UNUSED static void dopt__agree_lost(dopt__agree *a, int r) {
    if (r >= 0 && r < a->n && r != a->me) a->gone[r / 64] |= (uint64_t)1 << (r % 64);
}

/* Rank from (below this one) decided value (a words-long set). */
DOPT__MAYBE_UNUSED static void dopt__agree_heard(dopt__agree *a, int from, const uint64_t *value) {
    if (from < 0 || from >= a->me || a->decided) return;
    a->heard[from / 64] |= (uint64_t)1 << (from % 64);
    if (from > a->from) {
        memcpy(a->value, value, sizeof(uint64_t) * (size_t)a->words);
        a->from = from;
    }
}

/* The lowest rank below this one that it still waits for: neither heard nor gone; -1: none. */
DOPT__MAYBE_UNUSED static int dopt__agree_waiting_for(const dopt__agree *a) {
    int r;
    for (r = 0; r < a->me; r++)
        if (!dopt__agree_has(a->heard, r) && !dopt__agree_has(a->gone, r)) return r;
    return -1;
}

/* Decides when nobody below is waited for: 1 once decided (a->value is the decision), else 0. */
DOPT__MAYBE_UNUSED static int dopt__agree_step(dopt__agree *a) {
    if (a->decided) return 1;
    if (dopt__agree_waiting_for(a) >= 0) return 0;
    if (a->from < 0) memcpy(a->value, a->gone, sizeof(uint64_t) * (size_t)a->words);
    a->decided = 1;
    return 1;
}

/* ===================================================================== FOR BACKENDS

   The private names of this file that a transport (or a module that runs its own exchanges) may
   use, each declared once more here with what it guarantees: a reader lists every crossing from
   this block alone, and tests/check_hygiene.sh fails when a header uses a dopt__ or DOPT__ name
   of this file that is not here. Anything else private may change without notice.

   Macros: DOPT__FRAME_DATA (a DATA frame's type, dopt__frame.type); DOPT__LOCKED(e, expr) (expr
   with the engine locked).
   Types: dopt__engine, dopt__peer, dopt__frame (the engine's state, one peer's link, a frame's
   header decoded): read by a transport's links, never written; dopt__agree (the survivors'
   agreement): a transport's own. */

/* The collective the engine is running now (its descriptor names details), or NULL. */
static const dopt_coll_desc *dopt__eng_current(const dopt__engine *e);
/* A frame's header from its DOPT_FRAME_BYTES bytes: NULL when valid, else why it is not. */
static const char *dopt__frame_decode(const unsigned char *in, dopt__frame *f);
/* With a progress thread, every use of the engine holds its lock; unlock returns s (e may be NULL). */
static void dopt__eng_lock(dopt__engine *e);
static dopt_status dopt__eng_unlock(dopt__engine *e, dopt_status s);
/* SHRINK: THE SURVIVORS' AGREEMENT, the rules without the messages (a transport carries them):
   init for rank me of n (DOPT_ERR_NOMEM) and free; lost(r): r is gone; heard(from, value): rank
   from < me decided value; waiting_for: the rank below me still awaited, -1: none; step: 1 once
   decided (a->value, a set of a->words words, the ranks gone), after which nothing changes it;
   has(set, r): r in set. */
DOPT__MAYBE_UNUSED static dopt_status dopt__agree_init(dopt__agree *a, int n, int me);
DOPT__MAYBE_UNUSED static void dopt__agree_free(dopt__agree *a);
DOPT__MAYBE_UNUSED static void dopt__agree_lost(dopt__agree *a, int r);
DOPT__MAYBE_UNUSED static void dopt__agree_heard(dopt__agree *a, int from, const uint64_t *value);
DOPT__MAYBE_UNUSED static int dopt__agree_waiting_for(const dopt__agree *a);
DOPT__MAYBE_UNUSED static int dopt__agree_step(dopt__agree *a);
DOPT__MAYBE_UNUSED static int dopt__agree_has(const uint64_t *set, int r);

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_IMPLEMENTATION */
