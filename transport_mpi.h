/* transport_mpi.h — distopt's collectives (dopt_comm) over an MPI communicator.
   Part of distopt 0.1.0. MIT licence (see the end of distopt.h).

   DO THIS in exactly one C or C++ file of your program, before including the headers:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "transport_mpi.h"

   Other files include the two headers without the macro. This header includes <mpi.h> itself, so
   build with the MPI compiler wrapper (any MPI-3 implementation; tested with Open MPI 4.1.4):

       mpicc -std=c11 -O2 -D_GNU_SOURCE train.c -lm -o train

   (add -DDOPT_USE_BLAS $(pkg-config --cflags --libs openblas) for distopt.h's BLAS kernels;
   mpicxx -std=c++11 for C++)

   In C++, the header defines OMPI_SKIP_MPICXX / MPICH_SKIP_MPICXX before including <mpi.h>
   (the old MPI-2 C++ bindings do not compile cleanly with -Wextra); a program that uses them
   includes <mpi.h> first.

   QUICK START
   Most programs do not call this header themselves: with it included before launch.h,
   dopt_comm_create_from_env(&comm) starts MPI when mpirun (or another PMI launcher) started the
   program, and dopt_comm_finish(comm, status) ends every rank (launch.h). Called directly:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "transport_mpi.h"

       int main(void) {
           float grads[1000] = {0};
           dopt_comm *comm;
           dopt_status st;
           if (dopt_mpi_create(&comm, NULL) != DOPT_OK) return 1;   // calls MPI_Init_thread
           grads[0] = (float)comm->rank;
           st = dopt_allreduce(comm, grads, 1000, DOPT_F32, DOPT_MEAN);
           return dopt_comm_finish(comm, st);                       // destroys comm: MPI_Finalize
       }

   LAUNCH

       mpirun -np 4 ./train
       mpirun --allow-run-as-root --oversubscribe -np 8 ./train   (as root; more ranks than cores)

   Every rank must create the communicator, call the same collectives in the same order, and
   destroy it (dopt_comm_finish does). With more ranks than cores, prefer Open MPI: it yields the
   processor while it waits when oversubscribed (MPICH's default busy-polling then slows
   everything down badly).

   BUILD OPTIONS (define before including, in the implementation file)

   | macro               | meaning                                                        | default |
   |---------------------|----------------------------------------------------------------|---------|
   | DOPT_MPI_MAX_COUNT  | largest count handed to one MPI call: allreduce elements, or   | INT_MAX |
   |                     | bytes for broadcast and allgatherv; larger transfers are cut   |         |
   |                     | into pieces of at most this many                              |         |

   CONFIGURATION (dopt_mpi_config; all zero, or a NULL pointer, means the defaults)

   | field            | meaning                                                          | zero means          |
   |------------------|------------------------------------------------------------------|---------------------|
   | comm             | pointer to the MPI_Comm to work on; read during create only      | MPI_COMM_WORLD      |
   | check            | 1: check before every collective that all ranks called the same  | off                 |
   |                  | one (see MISMATCHES); 0 or -1: never; agreed at create (any rank |                     |
   |                  | on: all on)                                                      |                     |
   | max_count        | as DOPT_MPI_MAX_COUNT, per communicator; the smallest of the     | DOPT_MPI_MAX_COUNT  |
   |                  | ranks' values is used; clamped to INT_MAX                        |                     |
   | argc, argv       | handed to MPI_Init_thread when this call initialises MPI        | NULL, NULL          |
   | log_fn, log_user | logging callback, installed on the communicator, and also told  | silent              |
   |                  | why a create failed (there is no communicator to ask then)       |                     |
   | allow_singleton  | 1: when this call initialises MPI in a process that no MPI       | refuse: a job of    |
   |                  | launcher started, run it as a job of one rank                    | one is a mistake    |
   | engine           | 1: every collective on distopt.h's engine over point-to-point    | MPI's collectives   |
   |                  | links (THE ENGINE OVER MPI, below); agreed at create (any rank   |                     |
   |                  | on: all on)                                                      |                     |

   ENVIRONMENT (dopt_mpi_config_from_env)
     DOPT_MPI_CHECK=1 or 0: the check (MISMATCHES below). Rank and size are MPI's own.

   FUNCTIONS

   dopt_status dopt_mpi_config_from_env(dopt_mpi_config *cfg)
     The one setting the environment may give: DOPT_MPI_CHECK=1 sets check to 1, =0 to -1;
     unset or empty leaves cfg alone; anything else is DOPT_ERR_INVALID, said through
     cfg->log_fn. A config is never read from the environment otherwise: dopt_mpi_create takes
     cfg as it is. (launch.h's dopt_comm_create_from_env calls this for you.)

   dopt_status dopt_mpi_create(dopt_comm **out, const dopt_mpi_config *cfg)
     Collective over the ranks of cfg->comm (MPI_COMM_WORLD by default). Initialises MPI if
     nobody has yet (MPI_Init_thread asking for MPI_THREAD_FUNNELED: the communicator may be used
     from the thread that created it while other threads compute), then duplicates the
     communicator with MPI_Comm_dup, so distopt's traffic never matches the program's own MPI
     calls, and sets MPI_ERRORS_RETURN on the duplicate only (the program's communicator keeps its
     error handler). comm->rank and comm->size are the rank and size in that communicator. On
     success *out owns the duplicate; release it with dopt_comm_finish (or dopt_comm_destroy).
     Errors (*out is NULL):
     DOPT_ERR_INVALID (out is NULL, the communicator is MPI_COMM_NULL or an intercommunicator;
     or, when this call would initialise MPI, no MPI launcher started the process — none of
     OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK, MPI_LOCALNRANKS is set — and allow_singleton is 0:
     "not started by an MPI launcher ...: start it with mpirun -n N"),
     DOPT_ERR_CLOSED (MPI was already finalized), DOPT_ERR_NOMEM, DOPT_ERR_IO or another status
     translated from an MPI error (below). If create initialised MPI and then failed, MPI stays
     initialised: MPI_Finalize is the program's to call (MPI_Initialized tells).

   dopt_comm_destroy(comm)      (from distopt.h)
     Frees the duplicate communicator; if this communicator's create initialised MPI, it then
     calls MPI_Finalize (collective: every rank must destroy it), unless MPI is already finalized.
     So destroy the communicator that initialised MPI last, or initialise MPI yourself: then
     distopt never finalizes it, and you may keep using MPI after destroy. A communicator whose
     MPI was finalized under it returns DOPT_ERR_CLOSED from every collective and may still be
     destroyed.

   The collectives are those of distopt.h (dopt_allreduce, dopt_allgather, dopt_allgatherv,
   dopt_broadcast, dopt_barrier, dopt_allreduce_weighted_mean), mapped to MPI_Allreduce with
   MPI_IN_PLACE (SUM, MAX, MIN; MEAN as SUM, then divided by distopt), MPI_Allgatherv,
   MPI_Bcast and MPI_Barrier. Transfers beyond the largest count are cut into pieces; an
   allgatherv whose total exceeds it becomes one chunked MPI_Bcast per rank. Results are
   bitwise identical on all ranks and from run to run as long as the MPI library picks the same
   algorithm for the same size and world (Open MPI's tuned collectives do).
   Threading: a communicator must be used by one thread at a time and, unless MPI was
   initialised with MPI_THREAD_SERIALIZED or more, by the thread that initialised MPI (then
   comm->one_thread is 1, and localsgd.h's gradient buckets and compress.h's nonblocking calls
   run on the calling thread instead of a worker).

   ERRORS A USER CAN SEE
     Every MPI error becomes a dopt_status and poisons the communicator; dopt_comm_detail names
     the rank, the collective and its sequence number, the MPI call and MPI's own error string:
       "rank 1: allreduce #12 (f32 sum, 4096 elems): MPI_Allreduce failed: MPI_ERR_TRUNCATE: message
        truncated (MPI error class 15)"
     MPI_ERR_TRUNCATE (a peer sent more than this rank expected) -> DOPT_ERR_MISMATCH
     MPI_ERR_NO_MEM                                               -> DOPT_ERR_NOMEM
     MPI_ERR_COUNT, _TYPE, _OP, _ARG, _BUFFER, _ROOT, _COMM, _RANK -> DOPT_ERR_INVALID
     MPI_ERR_UNSUPPORTED_OPERATION                                -> DOPT_ERR_UNSUPPORTED
     MPI(X)_ERR_PROC_FAILED, MPI(X)_ERR_REVOKED (fault-tolerant MPI) -> DOPT_ERR_PEER_LOST
     anything else                                                -> DOPT_ERR_IO
     MPI finalized before a collective                            -> DOPT_ERR_CLOSED
     the check (below) found ranks disagreeing                    -> DOPT_ERR_MISMATCH

   MISMATCHES
     With MPI's own collectives (engine = 0; the engine names mismatches from its frames) and
     the check on, every collective is first compared across the ranks in one small allreduce
     (how: REFERENCE FOR CONTRIBUTORS below). If they do not agree, every rank fails with
     DOPT_ERR_MISMATCH naming the first rank whose call differs from its own ("rank 1 called
     allreduce #5 (f32 max, 16 elems)"); no rank starts the real transfer, so nothing hangs and
     no buffer is touched. Detected: a different collective, dtype,
     op, root, element or byte count (and a different sequence number), hence also a rank that
     skipped or added a call, once that puts two different calls opposite each other. Not
     detected: a rank that stops calling collectives altogether (the others wait in the check,
     as MPI would), and different buffer contents or lengths behind the same count.
     The check costs one small allreduce per collective, which shows at small sizes (measured:
     REFERENCE FOR CONTRIBUTORS below). The goal is to stay within 5% of MPI_Allreduce, so the
     check is OFF by default: turn it on while developing
     (DOPT_MPI_CHECK=1 mpirun -x DOPT_MPI_CHECK ...), or keep it for large messages only.
     With the check off, mismatched calls are undefined behaviour in MPI and distopt does not
     see them. Seen with Open MPI 4.1.4 at 2 and 3 ranks: allreduce with different counts fails
     with MPI_ERR_TRUNCATE on some ranks only (they get DOPT_ERR_MISMATCH; the others return
     DOPT_OK with wrong results, or hang); allreduce with different ops completes everywhere with
     results that differ between ranks; allreduce on some ranks against broadcast on others
     hangs; a broadcast whose receivers ask for more bytes than the root sends completes and
     leaves the extra bytes untouched.

   THE ENGINE OVER MPI (engine = 1)
     Every collective then runs on distopt.h's engine over links made of MPI_Isend/MPI_Irecv on
     the duplicate (384 KiB of buffers per peer, allocated at create). What it gives over MPI's
     own collectives: comm->timeout_ms holds (a peer that does not call is named, DOPT_ERR_TIMEOUT,
     and the others learn of it; MPI never holds a caller's buffer after a failure), every frame
     carries its collective so mismatches are named at no extra cost (the check above is not
     used), requests progress inside dopt_test/dopt_wait and on a progress thread
     (dopt_comm_set_progress_thread), groups split over the same links, and results do not
     depend on which algorithm the MPI library picks. Dead peers are still the launcher's to
     report (MPI ends the job). It is slower than MPI's own collectives on small messages and
     faster on large ones here (measured, and how the links work: REFERENCE FOR CONTRIBUTORS
     below).

   TIMEOUTS AND DEAD PEERS
     With engine = 0, comm->timeout_ms is NOT enforced by this backend. MPI has no timeout on
     blocking collectives (why distopt does not poll a nonblocking one instead: REFERENCE FOR
     CONTRIBUTORS below).
     Rely on the launcher instead: when a rank dies, Open MPI's mpirun ends the other ranks of
     the job within about a second and names the one that failed ("mpirun noticed that process
     rank 1 with PID ... exited on signal 9 (Killed)"); the survivors see no status. For a stuck
     peer, bound the job with `mpirun --timeout SECONDS` or an outer `timeout`, or set engine = 1.
     DOPT_ERR_PEER_LOST comes only from an MPI that reports failed processes (ULFM).
     Surviving a lost rank (distopt.h: SURVIVING A LOST PEER) is not available here:
     dopt_comm_shrink returns DOPT_ERR_UNSUPPORTED (logged with why). It would need ULFM's
     revoke, shrink and agree, which Open MPI 4.1 does not have, and mpirun ends the whole job
     when a rank dies. A job that must survive one runs on TCP (DOPT_TRANSPORT=tcp under the same
     launcher) or shm with on_peer_lost = DOPT_SHRINK.
*/
#ifndef DISTOPT_TRANSPORT_MPI_H
#define DISTOPT_TRANSPORT_MPI_H

#define DOPT__WANT_POSIX 1 /* see the top of distopt.h: nanosleep, for the links' waits */
#include "distopt.h"
#include "engine.h"
/* The MPI-2 C++ bindings (removed in MPI-3) do not compile cleanly under -Wextra; distopt uses
   the C API only. A program that wants them includes <mpi.h> before this header. */
#if defined(__cplusplus) && !defined(MPI_VERSION)
#  ifndef OMPI_SKIP_MPICXX
#    define OMPI_SKIP_MPICXX 1
#  endif
#  ifndef MPICH_SKIP_MPICXX
#    define MPICH_SKIP_MPICXX 1
#  endif
#endif
#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dopt_mpi_config {
    const MPI_Comm *comm; /* NULL: MPI_COMM_WORLD */
    int check;            /* 1 on; 0 or -1 off (dopt_mpi_config_from_env reads DOPT_MPI_CHECK) */
    size_t max_count;     /* 0: DOPT_MPI_MAX_COUNT */
    int *argc;            /* for MPI_Init_thread; may be NULL */
    char ***argv;
    dopt_log_fn log_fn;   /* NULL: silent */
    void *log_user;
    int allow_singleton;  /* 1: initialise MPI even when no MPI launcher started this process */
    int engine;           /* 1: collectives on distopt.h's engine over point-to-point links */
} dopt_mpi_config;

DOPT_DEF dopt_status dopt_mpi_create(dopt_comm **out, const dopt_mpi_config *cfg);
DOPT_DEF dopt_status dopt_mpi_config_from_env(dopt_mpi_config *cfg);

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_TRANSPORT_MPI_H */

/* ==================== REFERENCE FOR CONTRIBUTORS ====================
   Not needed to use transport_mpi.h: how the mismatch check and the engine's links work, why the
   timeout is not enforced on MPI's own collectives, and what each measured.

   THE MISMATCH CHECK
     With the check on, every collective first allreduces (MAX) 4 words: the call's fingerprint
     (collective, dtype, op, root, count) and its sequence number, each beside its complement, so
     one MAX shows whether all ranks agree. If they do not, every rank gathers all ranks'
     descriptors and names the first rank whose call differs from its own.
     The check costs one small allreduce per collective, about 0.6-0.9 us on shared memory.
     Measured with Open MPI 4.1.4, 2 ranks on one 2-core machine (bench/bench_allreduce.c,
     backend dopt-mpi-check, busbw relative to MPI_Allreduce in the same run): 0.83-0.87 at
     4 KiB of f32, 0.97 at 64 KiB, 0.98-1.03 (noise) at 1 MiB and 16 MiB; without the check
     distopt's MPI backend measures 0.98-1.03 at every size.

   THE ENGINE'S LINKS
     The engine is engine.h's (its manual is the link contract). Its links
     here are messages of up to 64 KiB sent from buffers of the backend's own (4 in flight per
     peer) and received into 2 receives posted per peer (384 KiB per peer in all); an empty
     message ends a stream, and destroy reads every peer's stream to its end before freeing the
     duplicate. Measured, 2 ranks on one machine, Open MPI 4.1.4 (mpirun -np 2
     build/bench_allreduce mpi-raw mpi,mpi-engine; ratio = MPI_Allreduce's time over ours, a
     noisy run): 0.73 at 4 KiB, 0.91 at 64 KiB, 0.95 at 1 MiB, 1.13 at 16 MiB, 1.36 at 64 MiB.

   NO TIMEOUT ON MPI'S OWN COLLECTIVES
     MPI has no timeout on blocking collectives. A non-blocking one (MPI_Iallreduce) polled with
     MPI_Test against a deadline could stop waiting, but it cannot be cancelled, so MPI would still
     own the caller's buffer after the timeout; and it is slow: Open MPI 4.1.4's MPI_Iallreduce
     polled that way ran at 0.60-0.73 of MPI_Allreduce's busbw from 4 KiB to 64 MiB (bench backend
     mpi-iallreduce).

   TESTS
     The tests set DOPT_MPI_MAX_COUNT to 1000, so that chunking runs on small buffers.
*/

/* =====================================================================================
   IMPLEMENTATION — stop reading here if you only want the API.
   ===================================================================================== */

#if defined(DISTOPT_IMPLEMENTATION) && !defined(DOPT__MPI_IMPLEMENTED)
#define DOPT__MPI_IMPLEMENTED

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h> /* sysconf: the cores of this host */
#endif
#include <string.h>
#include <time.h>

#ifndef DOPT_MPI_MAX_COUNT
#define DOPT_MPI_MAX_COUNT INT_MAX
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ===================================================================== STATE */

/* One peer's link (engine = 1): messages of at most DOPT__MPI_LINK_BYTES, sent from slots of our
   own (so a caller's buffer is never MPI's after a failure) and received into two receives
   posted in turn; a zero-length message with DOPT__MPI_TAG_END ends the stream. */
#define DOPT__MPI_LINK_BYTES ((size_t)64 << 10)
#define DOPT__MPI_TX_SLOTS 4
#define DOPT__MPI_RX_SLOTS 2
#define DOPT__MPI_TAG_DATA 1
#define DOPT__MPI_TAG_END 2

typedef struct dopt__mpi_link {
    MPI_Request tx[DOPT__MPI_TX_SLOTS + 1]; /* the last: the end of the stream */
    MPI_Request rx[DOPT__MPI_RX_SLOTS];
    unsigned char *txbuf, *rxbuf;          /* TX_SLOTS and RX_SLOTS buffers of LINK_BYTES */
    int rx_cur;                            /* the receive whose bytes come next */
    size_t rx_len, rx_off;                 /* its message's length and what was read of it */
    int rx_done;                           /* it completed (rx_len valid) */
    int ended;                             /* the peer's end of stream arrived */
    int closed;                            /* we sent ours */
} dopt__mpi_link;

typedef struct dopt__mpi {
    MPI_Comm comm;     /* our duplicate of the user's communicator */
    int owns_mpi;      /* create called MPI_Init_thread, so destroy calls MPI_Finalize */
    int check;         /* the mismatch check runs before every collective */
    int engine;        /* collectives on the engine over links */
    size_t max_count;  /* largest count in one MPI call, the same on every rank */
    int *counts;       /* allgatherv: size entries each, allocated at create */
    int *displs;
    uint64_t *descs;   /* mismatch naming: 6 words per rank */
    dopt__mpi_link *links; /* [size] with engine, else NULL */
    int rank, size;
} dopt__mpi;

#define DOPT__MPI_DESC_WORDS 6

/* ===================================================================== ERRORS */

static dopt_status dopt__mpi_status_of_class(int cls) {
#ifdef MPI_ERR_PROC_FAILED
    if (cls == MPI_ERR_PROC_FAILED) return DOPT_ERR_PEER_LOST;
#endif
#ifdef MPIX_ERR_PROC_FAILED
    if (cls == MPIX_ERR_PROC_FAILED) return DOPT_ERR_PEER_LOST;
#endif
#ifdef MPI_ERR_REVOKED
    if (cls == MPI_ERR_REVOKED) return DOPT_ERR_PEER_LOST;
#endif
#ifdef MPIX_ERR_REVOKED
    if (cls == MPIX_ERR_REVOKED) return DOPT_ERR_PEER_LOST;
#endif
    switch (cls) {
    case MPI_ERR_TRUNCATE: return DOPT_ERR_MISMATCH; /* in a collective: a peer's count was larger */
    case MPI_ERR_NO_MEM: return DOPT_ERR_NOMEM;
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_OP:
    case MPI_ERR_ARG:
    case MPI_ERR_BUFFER:
    case MPI_ERR_ROOT:
    case MPI_ERR_COMM:
    case MPI_ERR_RANK: return DOPT_ERR_INVALID;
    case MPI_ERR_UNSUPPORTED_OPERATION: return DOPT_ERR_UNSUPPORTED;
    default: return DOPT_ERR_IO;
    }
}

/* MPI's class and text for an error code, in text[MPI_MAX_ERROR_STRING]. */
static int dopt__mpi_describe_error(int err, char *text) {
    int cls = err, len = 0;
    if (MPI_Error_class(err, &cls) != MPI_SUCCESS) cls = MPI_ERR_UNKNOWN;
    if (MPI_Error_string(err, text, &len) != MPI_SUCCESS || len <= 0 || len >= MPI_MAX_ERROR_STRING)
        snprintf(text, MPI_MAX_ERROR_STRING, "MPI error code %d", err);
    else
        text[len] = '\0';
    return cls;
}

/* Poisons c with the MPI error err returned by call. */
static dopt_status dopt__mpi_fail(dopt_comm *c, const dopt_coll_desc *d, const char *call, int err) {
    char text[MPI_MAX_ERROR_STRING];
    int cls = dopt__mpi_describe_error(err, text);
    return dopt_comm_fail(c, d, dopt__mpi_status_of_class(cls), "%s failed: %s (MPI error class %d)", call, text, cls);
}

/* Create has no communicator to hold a detail yet: tell the configured log, if any. */
static dopt_status dopt__mpi_create_fail(const dopt_mpi_config *cfg, dopt_status s, const char *fmt, ...)
    DOPT_PRINTF(3, 4);
static dopt_status dopt__mpi_create_fail(const dopt_mpi_config *cfg, dopt_status s, const char *fmt, ...) {
    char msg[DOPT_DETAIL_MAX];
    int used;
    va_list ap;
    if (cfg == NULL || cfg->log_fn == NULL) return s;
    used = snprintf(msg, sizeof msg, "mpi create: ");
    va_start(ap, fmt);
    vsnprintf(msg + used, sizeof msg - (size_t)used, fmt, ap);
    va_end(ap);
    cfg->log_fn(cfg->log_user, DOPT_LOG_ERROR, msg);
    return s;
}

static dopt_status dopt__mpi_create_fail_mpi(const dopt_mpi_config *cfg, const char *call, int err) {
    char text[MPI_MAX_ERROR_STRING];
    int cls = dopt__mpi_describe_error(err, text);
    return dopt__mpi_create_fail(cfg, dopt__mpi_status_of_class(cls), "%s failed: %s (MPI error class %d)", call, text,
                                 cls);
}

/* ===================================================================== MISMATCH CHECK */

static void dopt__mpi_desc_pack(const dopt_coll_desc *d, uint64_t *w) {
    w[0] = (uint64_t)d->kind;
    w[1] = (uint64_t)d->dtype;
    w[2] = (uint64_t)d->op;
    w[3] = (uint64_t)(uint32_t)d->root;
    w[4] = d->seq;
    w[5] = d->count;
}

static dopt_coll_desc dopt__mpi_desc_unpack(const uint64_t *w) {
    dopt_coll_desc d;
    memset(&d, 0, sizeof d);
    d.kind = (dopt_coll)w[0];
    d.dtype = (dopt_dtype)w[1];
    d.op = (dopt_op)w[2];
    d.root = (int)(uint32_t)w[3];
    d.seq = w[4];
    d.count = w[5];
    return d;
}

/* Every rank knows there is a mismatch (they all saw the same MAX); now they all gather every
   descriptor, a matched collective, so each can name a rank whose call differs from its own. */
static dopt_status dopt__mpi_name_mismatch(dopt_comm *c, const dopt_coll_desc *d) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    uint64_t mine[DOPT__MPI_DESC_WORDS];
    int r, err;
    dopt__mpi_desc_pack(d, mine);
    err = MPI_Allgather(mine, DOPT__MPI_DESC_WORDS, MPI_UINT64_T, m->descs, DOPT__MPI_DESC_WORDS, MPI_UINT64_T, m->comm);
    if (err != MPI_SUCCESS) return dopt__mpi_fail(c, d, "MPI_Allgather (naming a mismatch)", err);
    for (r = 0; r < c->size; r++) {
        const uint64_t *theirs = m->descs + (size_t)r * DOPT__MPI_DESC_WORDS;
        if (memcmp(theirs, mine, sizeof mine) != 0) {
            dopt_coll_desc other = dopt__mpi_desc_unpack(theirs);
            return dopt_comm_fail_mismatch(c, d, &other, r);
        }
    }
    /* Only reachable if two different descriptors share a fingerprint. */
    return dopt_comm_fail(c, d, DOPT_ERR_MISMATCH, "ranks disagree on the collective's fingerprint");
}

/* One MAX over {x, ~x} pairs: max(x) == x and max(~x) == ~x on every rank exactly when every rank
   holds the same x, so a single small allreduce tells all ranks at once whether they agree. */
static dopt_status dopt__mpi_check(dopt_comm *c, const dopt_coll_desc *d) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    uint64_t fp = dopt_coll_fingerprint(d);
    uint64_t v[4];
    int err;
    v[0] = fp;
    v[1] = ~fp;
    v[2] = d->seq;
    v[3] = ~d->seq;
    err = MPI_Allreduce(MPI_IN_PLACE, v, 4, MPI_UINT64_T, MPI_MAX, m->comm);
    if (err != MPI_SUCCESS) return dopt__mpi_fail(c, d, "MPI_Allreduce (mismatch check)", err);
    if (v[0] == fp && v[1] == ~fp && v[2] == d->seq && v[3] == ~d->seq) return DOPT_OK;
    return dopt__mpi_name_mismatch(c, d);
}

/* Every collective starts here. MPI forbids calls after MPI_Finalize (Open MPI aborts the
   process), so a communicator that outlived MPI reports DOPT_ERR_CLOSED instead. */
static dopt_status dopt__mpi_begin(dopt_comm *c, const dopt_coll_desc *d) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return dopt_comm_fail(c, d, DOPT_ERR_CLOSED, "MPI was finalized before this call");
    return m->check ? dopt__mpi_check(c, d) : DOPT_OK;
}

/* ===================================================================== COLLECTIVES */

static MPI_Datatype dopt__mpi_datatype(dopt_dtype dt) {
    switch (dt) {
    case DOPT_F32: return MPI_FLOAT;
    case DOPT_F64: return MPI_DOUBLE;
    case DOPT_I32: return MPI_INT32_T;
    case DOPT_I64: return MPI_INT64_T;
    }
    return MPI_DATATYPE_NULL;
}

static MPI_Op dopt__mpi_op(dopt_op op) {
    switch (op) {
    case DOPT_MAX: return MPI_MAX;
    case DOPT_MIN: return MPI_MIN;
    case DOPT_SUM:
    case DOPT_MEAN: break; /* MEAN is summed here; distopt divides afterwards */
    }
    return MPI_SUM;
}

static dopt_status dopt__mpi_allreduce(dopt_comm *c, const dopt_coll_desc *d, void *buf) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    MPI_Datatype type = dopt__mpi_datatype(d->dtype);
    MPI_Op op = dopt__mpi_op(d->op);
    size_t esize = dopt_dtype_size(d->dtype), left = (size_t)d->count;
    char *p = (char *)buf;
    dopt_status s = dopt__mpi_begin(c, d);
    if (s != DOPT_OK) return s;
    while (left > 0) {
        size_t n = left < m->max_count ? left : m->max_count;
        int err = MPI_Allreduce(MPI_IN_PLACE, p, (int)n, type, op, m->comm);
        if (err != MPI_SUCCESS) return dopt__mpi_fail(c, d, "MPI_Allreduce", err);
        p += n * esize;
        left -= n;
    }
    return DOPT_OK;
}

/* bytes bytes from root, in pieces MPI's int counts can carry. */
static dopt_status dopt__mpi_bcast_bytes(dopt_comm *c, const dopt_coll_desc *d, char *p, size_t bytes, int root) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    while (bytes > 0) {
        size_t n = bytes < m->max_count ? bytes : m->max_count;
        int err = MPI_Bcast(p, (int)n, MPI_BYTE, root, m->comm);
        if (err != MPI_SUCCESS) return dopt__mpi_fail(c, d, "MPI_Bcast", err);
        p += n;
        bytes -= n;
    }
    return DOPT_OK;
}

static dopt_status dopt__mpi_broadcast(dopt_comm *c, const dopt_coll_desc *d, void *buf) {
    dopt_status s = dopt__mpi_begin(c, d);
    if (s != DOPT_OK) return s;
    return dopt__mpi_bcast_bytes(c, d, (char *)buf, (size_t)d->count, d->root);
}

/* Blocks land in rank order. This rank's block is put in place first, so MPI always works in
   place (which also makes send == its own slot of recv legal). When the total fits one MPI call,
   one MPI_Allgatherv; otherwise displacements would overflow int, and each rank's block is
   broadcast from its owner in pieces instead. */
static dopt_status dopt__mpi_allgatherv(dopt_comm *c, const dopt_coll_desc *d, const void *send, void *recv,
                                        const size_t *bytes) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    char *out = (char *)recv;
    size_t total = 0, mine = 0;
    int r, err;
    dopt_status s = dopt__mpi_begin(c, d);
    if (s != DOPT_OK) return s;
    for (r = 0; r < c->size; r++) {
        if (r == c->rank) mine = total;
        total += bytes[r];
    }
    if (bytes[c->rank] > 0 && (const char *)send != out + mine) memmove(out + mine, send, bytes[c->rank]);
    if (total == 0 || c->size == 1) return DOPT_OK;
    if (total <= m->max_count) {
        size_t off = 0;
        for (r = 0; r < c->size; r++) {
            m->counts[r] = (int)bytes[r];
            m->displs[r] = (int)off;
            off += bytes[r];
        }
        err = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_BYTE, out, m->counts, m->displs, MPI_BYTE, m->comm);
        return err == MPI_SUCCESS ? DOPT_OK : dopt__mpi_fail(c, d, "MPI_Allgatherv", err);
    }
    for (r = 0; r < c->size; r++) {
        s = dopt__mpi_bcast_bytes(c, d, out, bytes[r], r);
        if (s != DOPT_OK) return s;
        out += bytes[r];
    }
    return DOPT_OK;
}

static dopt_status dopt__mpi_barrier(dopt_comm *c, const dopt_coll_desc *d) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    dopt_status s = dopt__mpi_begin(c, d);
    int err;
    if (s != DOPT_OK) return s;
    err = MPI_Barrier(m->comm);
    return err == MPI_SUCCESS ? DOPT_OK : dopt__mpi_fail(c, d, "MPI_Barrier", err);
}

/* ===================================================================== LINKS (engine = 1) */

/* MPI finalized under the communicator: it fails with DOPT_ERR_CLOSED, as without links. */
static int dopt__mpi_finalized_under(dopt_comm *c, int *err) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) return 0;
    dopt_comm_fail(c, c->eng ? dopt__eng_current(c->eng) : NULL, DOPT_ERR_CLOSED, "MPI was finalized");
    *err = ESHUTDOWN;
    return 1;
}

/* Starts receive k from peer q. */
static int dopt__mpi_post_rx(dopt__mpi *m, int q, int k) {
    dopt__mpi_link *L = &m->links[q];
    return MPI_Irecv(L->rxbuf + (size_t)k * DOPT__MPI_LINK_BYTES, (int)DOPT__MPI_LINK_BYTES, MPI_BYTE, q, MPI_ANY_TAG,
                     m->comm, &L->rx[k]);
}

/* The current receive from q wholly read: post it again, behind the other, and read the other next. */
static int dopt__mpi_rx_next(dopt__mpi *m, int q) {
    dopt__mpi_link *L = &m->links[q];
    int e = dopt__mpi_post_rx(m, q, L->rx_cur);
    L->rx_done = 0;
    L->rx_cur = (L->rx_cur + 1) % DOPT__MPI_RX_SLOTS;
    return e;
}

/* Whether the current receive from q completed; an end of stream marks the link ended. */
static int dopt__mpi_rx_ready(dopt__mpi *m, int q, int *err) {
    dopt__mpi_link *L = &m->links[q];
    MPI_Status st;
    int flag = 0, n = 0, e;
    if (L->rx_done || L->ended) return 1;
    e = MPI_Test(&L->rx[L->rx_cur], &flag, &st);
    if (e != MPI_SUCCESS) {
        *err = EIO;
        return -1;
    }
    if (!flag) return 0;
    if (st.MPI_TAG == DOPT__MPI_TAG_END) {
        L->ended = 1;
        return 1;
    }
    MPI_Get_count(&st, MPI_BYTE, &n);
    L->rx_done = 1;
    L->rx_len = (size_t)n;
    L->rx_off = 0;
    return 1;
}

/* A free send slot for q (-1: none), testing the busy ones. */
static int dopt__mpi_tx_slot(dopt__mpi *m, int q, int *err) {
    dopt__mpi_link *L = &m->links[q];
    int k, flag;
    for (k = 0; k < DOPT__MPI_TX_SLOTS; k++) {
        if (L->tx[k] == MPI_REQUEST_NULL) return k;
        if (MPI_Test(&L->tx[k], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
            *err = EIO;
            return -1;
        }
        if (flag) return k;
    }
    return -1;
}

static long dopt__mpi_link_send(dopt_comm *c, int peer, const dopt_iov *parts, int nparts, int *err) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    dopt__mpi_link *L = &m->links[peer];
    unsigned char *slot;
    size_t n = 0;
    int i, k;
    *err = 0;
    if (dopt__mpi_finalized_under(c, err)) return -1;
    if (L->closed) {
        *err = EPIPE;
        return -1;
    }
    k = dopt__mpi_tx_slot(m, peer, err);
    if (k < 0) return *err ? -1 : 0;
    slot = L->txbuf + (size_t)k * DOPT__MPI_LINK_BYTES;
    for (i = 0; i < nparts && n < DOPT__MPI_LINK_BYTES; i++) {
        size_t take = parts[i].len < DOPT__MPI_LINK_BYTES - n ? parts[i].len : DOPT__MPI_LINK_BYTES - n;
        memcpy(slot + n, parts[i].base, take);
        n += take;
    }
    if (n == 0) return 0;
    if (MPI_Isend(slot, (int)n, MPI_BYTE, peer, DOPT__MPI_TAG_DATA, m->comm, &L->tx[k]) != MPI_SUCCESS) {
        *err = EIO;
        return -1;
    }
    return (long)n;
}

static long dopt__mpi_link_recv(dopt_comm *c, int peer, void *dst, size_t cap, int *err) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    dopt__mpi_link *L = &m->links[peer];
    size_t n;
    int r;
    if (dopt__mpi_finalized_under(c, err)) return -1;
    if ((r = dopt__mpi_rx_ready(m, peer, err)) <= 0) return r;
    if (!L->rx_done) { /* the end of the stream, after everything before it */
        *err = 0;
        return -1;
    }
    n = L->rx_len - L->rx_off < cap ? L->rx_len - L->rx_off : cap;
    memcpy(dst, L->rxbuf + (size_t)L->rx_cur * DOPT__MPI_LINK_BYTES + L->rx_off, n);
    L->rx_off += n;
    if (L->rx_off == L->rx_len && dopt__mpi_rx_next(m, peer) != MPI_SUCCESS) {
        *err = EIO;
        return -1;
    }
    return (long)n;
}

/* MPI has no wait with a timeout across requests of different kinds: test them all, spinning
   for a few microseconds, then sleeping a little longer between rounds (up to 1 ms). */
static int dopt__mpi_link_wait(dopt_comm *c, dopt_link_poll *polls, int npolls, int timeout_ms, int *err) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    double start = dopt__now_ms(), nap_us = 0;
    if (dopt__mpi_finalized_under(c, err)) return -1;
    for (;;) {
        int i, ready = 0;
        for (i = 0; i < npolls; i++) {
            int q = polls[i].peer, r;
            short re = 0;
            if (polls[i].events & DOPT_LINK_IN) {
                if ((r = dopt__mpi_rx_ready(m, q, err)) < 0) return -1;
                if (r) re |= DOPT_LINK_IN;
            }
            if (polls[i].events & DOPT_LINK_OUT) {
                if ((r = dopt__mpi_tx_slot(m, q, err)) < 0 && *err) return -1;
                if (r >= 0) re |= DOPT_LINK_OUT;
            }
            polls[i].revents = re;
            ready += re != 0;
        }
        if (ready > 0 || dopt__now_ms() - start >= (double)timeout_ms) return ready;
        if (nap_us > 0) {
            struct timespec ts;
            ts.tv_sec = 0;
            ts.tv_nsec = (long)(nap_us * 1000.0);
            nanosleep(&ts, NULL);
        }
        if (dopt__now_ms() - start > 0.05) nap_us = nap_us < 20 ? 20 : (nap_us * 2 > 1000 ? 1000 : nap_us * 2);
    }
}

/* Ends our stream to peer: an empty message that comes after every one sent before it. */
static void dopt__mpi_link_close(dopt_comm *c, int peer) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    dopt__mpi_link *L = &m->links[peer];
    if (L->closed) return;
    L->closed = 1;
    MPI_Isend(NULL, 0, MPI_BYTE, peer, DOPT__MPI_TAG_END, m->comm, &L->tx[DOPT__MPI_TX_SLOTS]);
}

/* Buffers and the first receives of every link. */
static dopt_status dopt__mpi_links_open(dopt_comm *c, dopt__mpi *m) {
    int q, k;
    m->links = (dopt__mpi_link *)DOPT_MALLOC((size_t)m->size * sizeof *m->links);
    if (m->links == NULL) return dopt_comm_fail(c, NULL, DOPT_ERR_NOMEM, "out of memory for %d links", m->size);
    memset(m->links, 0, (size_t)m->size * sizeof *m->links);
    for (q = 0; q < m->size; q++) {
        dopt__mpi_link *L = &m->links[q];
        for (k = 0; k <= DOPT__MPI_TX_SLOTS; k++) L->tx[k] = MPI_REQUEST_NULL;
        for (k = 0; k < DOPT__MPI_RX_SLOTS; k++) L->rx[k] = MPI_REQUEST_NULL;
        if (q == m->rank) continue;
        L->txbuf = (unsigned char *)DOPT_MALLOC(DOPT__MPI_TX_SLOTS * DOPT__MPI_LINK_BYTES);
        L->rxbuf = (unsigned char *)DOPT_MALLOC(DOPT__MPI_RX_SLOTS * DOPT__MPI_LINK_BYTES);
        if (L->txbuf == NULL || L->rxbuf == NULL)
            return dopt_comm_fail(c, NULL, DOPT_ERR_NOMEM, "out of memory for %d links", m->size);
        for (k = 0; k < DOPT__MPI_RX_SLOTS; k++) {
            int e = dopt__mpi_post_rx(m, q, k);
            if (e != MPI_SUCCESS) return dopt__mpi_fail(c, NULL, "MPI_Irecv", e);
        }
    }
    return DOPT_OK;
}

/* Says goodbye and ends every stream; reads every peer's stream to its end (a message left
   unmatched could match a later communicator that reuses this one's context), waits for our
   sends, and withdraws the receives still posted, all within a bounded time, so that the
   duplicate can be freed. */
static void dopt__mpi_links_close(dopt_comm *c, dopt__mpi *m) {
    double deadline;
    int q, k, flag, err = 0;
    if (m->links == NULL) return;
    dopt_links_goodbye(c, c->timeout_ms < 5000 ? c->timeout_ms : 5000);
    for (q = 0; q < m->size; q++)
        if (q != m->rank) dopt__mpi_link_close(c, q);
    deadline = dopt__now_ms() + (c->timeout_ms < 5000 ? c->timeout_ms : 5000);
    for (q = 0; q < m->size; q++) {
        dopt__mpi_link *L = &m->links[q];
        while (q != m->rank && !L->ended && dopt__now_ms() < deadline) {
            int r = dopt__mpi_rx_ready(m, q, &err);
            if (r < 0) break;
            if (r && L->rx_done && dopt__mpi_rx_next(m, q) != MPI_SUCCESS) break; /* discarded */
        }
    }
    for (q = 0; q < m->size; q++) {
        dopt__mpi_link *L = &m->links[q];
        for (k = 0; k <= DOPT__MPI_TX_SLOTS; k++) {
            while (L->tx[k] != MPI_REQUEST_NULL && MPI_Test(&L->tx[k], &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS &&
                   !flag && dopt__now_ms() < deadline)
                continue;
            if (L->tx[k] != MPI_REQUEST_NULL) MPI_Request_free(&L->tx[k]);
        }
        for (k = 0; k < DOPT__MPI_RX_SLOTS; k++)
            if (L->rx[k] != MPI_REQUEST_NULL) {
                MPI_Cancel(&L->rx[k]);
                MPI_Wait(&L->rx[k], MPI_STATUS_IGNORE);
            }
    }
}

/* ===================================================================== CREATE AND DESTROY */

static void dopt__mpi_free_state(dopt__mpi *m) {
    int q;
    if (m == NULL) return;
    for (q = 0; m->links != NULL && q < m->size; q++) {
        DOPT_FREE(m->links[q].txbuf);
        DOPT_FREE(m->links[q].rxbuf);
    }
    DOPT_FREE(m->links);
    DOPT_FREE(m->counts);
    DOPT_FREE(m->displs);
    DOPT_FREE(m->descs);
    DOPT_FREE(m);
}

static void dopt__mpi_destroy(dopt_comm *c) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    int finalized = 0;
    if (m == NULL) return;
    MPI_Finalized(&finalized);
    if (!finalized) {
        dopt__mpi_links_close(c, m);
        if (m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
        if (m->owns_mpi) {
            dopt_comm_log(c, DOPT_LOG_DEBUG, "mpi rank %d: finalizing MPI, which this communicator initialised",
                          c->rank);
            MPI_Finalize();
        }
    }
    dopt__mpi_free_state(m);
    c->impl = NULL;
}

DOPT_DEF dopt_status dopt_mpi_create(dopt_comm **out, const dopt_mpi_config *cfg);

/* dopt_comm_split: MPI_Comm_split of our duplicate, and a communicator over that (which
   duplicates it again, with the parent's settings). */
static dopt_status dopt__mpi_split(dopt_comm *c, int color, int key, dopt_comm **out) {
    dopt__mpi *m = (dopt__mpi *)c->impl;
    dopt_mpi_config cfg;
    MPI_Comm group;
    dopt_status s;
    int err = MPI_Comm_split(m->comm, color < 0 ? MPI_UNDEFINED : color, key, &group);
    if (err != MPI_SUCCESS) return dopt__mpi_fail(c, NULL, "MPI_Comm_split", err);
    if (group == MPI_COMM_NULL) return DOPT_OK;
    memset(&cfg, 0, sizeof cfg);
    cfg.comm = &group;
    cfg.check = m->check;
    cfg.engine = m->engine;
    cfg.max_count = m->max_count;
    cfg.log_fn = c->log_fn;
    cfg.log_user = c->log_user;
    s = dopt_mpi_create(out, &cfg);
    MPI_Comm_free(&group);
    if (s == DOPT_OK) (*out)->timeout_ms = c->timeout_ms;
    return s;
}

static const dopt_comm_vtable dopt__mpi_vtable = {"mpi",
                                                  dopt__mpi_allreduce,
                                                  dopt__mpi_allgatherv,
                                                  dopt__mpi_broadcast,
                                                  dopt__mpi_barrier,
                                                  dopt__mpi_destroy,
                                                  sizeof(dopt_comm_vtable),
                                                  DOPT_PROVIDES_ALL,
                                                  NULL,
                                                  NULL,
                                                  NULL,
                                                  NULL,
                                                  dopt__mpi_split,
                                                  NULL,
                                                  NULL,
                                                  NULL,
                                                  NULL,
                                                  NULL};

/* engine = 1: links only; the engine runs every collective and makes groups over the links. */
static const dopt_comm_vtable dopt__mpi_engine_vtable = {
    "mpi", NULL, NULL, NULL, NULL, dopt__mpi_destroy, sizeof(dopt_comm_vtable), 0u,
    dopt__mpi_link_send, dopt__mpi_link_recv, dopt__mpi_link_wait, dopt__mpi_link_close, NULL, NULL,
    dopt_engine_provider, NULL, NULL, NULL};

/* The check setting this rank asks for: the config's, else the environment's. */
static int dopt__mpi_check_wanted(const dopt_mpi_config *cfg) { return cfg->check > 0; }

DOPT_DEF dopt_status dopt_mpi_config_from_env(dopt_mpi_config *cfg) {
    const char *env = getenv("DOPT_MPI_CHECK");
    if (cfg == NULL) return DOPT_ERR_INVALID;
    if (env == NULL || env[0] == '\0') return DOPT_OK;
    if (strcmp(env, "0") && strcmp(env, "1")) {
        if (cfg->log_fn) {
            char msg[160];
            snprintf(msg, sizeof msg, "DOPT_MPI_CHECK=\"%.40s\" is not 0 or 1", env);
            cfg->log_fn(cfg->log_user, DOPT_LOG_ERROR, msg);
        }
        return DOPT_ERR_INVALID;
    }
    cfg->check = env[0] == '1' ? 1 : -1;
    return DOPT_OK;
}

/* The settings change which MPI calls a collective makes, so every rank must use the same: the
   check and the engine if any rank wants them, the smallest count limit. One MAX over {check,
   -max_count, engine}. */
static int dopt__mpi_agree(MPI_Comm comm, int *check, size_t *max_count, int *engine) {
    int64_t v[3];
    int err;
    v[0] = *check;
    v[1] = -(int64_t)*max_count;
    v[2] = *engine;
    err = MPI_Allreduce(MPI_IN_PLACE, v, 3, MPI_INT64_T, MPI_MAX, comm);
    if (err != MPI_SUCCESS) return err;
    *check = v[0] != 0;
    *max_count = (size_t)(-v[1]);
    *engine = v[2] != 0;
    return MPI_SUCCESS;
}

/* The local part of create: MPI running, the communicator usable, our state allocated. */
/* 1 when a launcher of Open MPI, MPICH (Hydra), PMIx or Slurm's PMI started this process. */
static int dopt__mpi_launched(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"};
    size_t i;
    for (i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i]) != NULL) return 1;
    return 0;
}

static dopt_status dopt__mpi_prepare(const dopt_mpi_config *cfg, dopt__mpi **out, MPI_Comm *base, int *size) {
    dopt__mpi *m;
    int initialized = 0, finalized = 0, inter = 0, err, provided = 0;
    *out = NULL;
    MPI_Finalized(&finalized);
    if (finalized) return dopt__mpi_create_fail(cfg, DOPT_ERR_CLOSED, "MPI is already finalized");
    m = (dopt__mpi *)DOPT_MALLOC(sizeof *m);
    if (m == NULL) return dopt__mpi_create_fail(cfg, DOPT_ERR_NOMEM, "out of memory");
    memset(m, 0, sizeof *m);
    m->comm = MPI_COMM_NULL;
    *out = m;
    MPI_Initialized(&initialized);
    if (!initialized && !cfg->allow_singleton && !dopt__mpi_launched())
        return dopt__mpi_create_fail(cfg, DOPT_ERR_INVALID,
                                     "not started by an MPI launcher (none of OMPI_COMM_WORLD_SIZE, PMI_SIZE, "
                                     "PMIX_RANK, MPI_LOCALNRANKS is set), so MPI would make this process a job of "
                                     "one: start it with mpirun -n N, or set allow_singleton to run alone");
    if (!initialized) {
        err = MPI_Init_thread(cfg->argc, cfg->argv, MPI_THREAD_FUNNELED, &provided);
        if (err != MPI_SUCCESS) return dopt__mpi_create_fail_mpi(cfg, "MPI_Init_thread", err);
        m->owns_mpi = 1;
    }
    *base = cfg->comm ? *cfg->comm : MPI_COMM_WORLD;
    if (*base == MPI_COMM_NULL) return dopt__mpi_create_fail(cfg, DOPT_ERR_INVALID, "the communicator is MPI_COMM_NULL");
    err = MPI_Comm_test_inter(*base, &inter);
    if (err != MPI_SUCCESS) return dopt__mpi_create_fail_mpi(cfg, "MPI_Comm_test_inter", err);
    if (inter) return dopt__mpi_create_fail(cfg, DOPT_ERR_INVALID, "intercommunicators are not supported");
    err = MPI_Comm_size(*base, size);
    if (err != MPI_SUCCESS) return dopt__mpi_create_fail_mpi(cfg, "MPI_Comm_size", err);
    m->counts = (int *)DOPT_MALLOC((size_t)*size * sizeof(int));
    m->displs = (int *)DOPT_MALLOC((size_t)*size * sizeof(int));
    m->descs = (uint64_t *)DOPT_MALLOC((size_t)*size * DOPT__MPI_DESC_WORDS * sizeof(uint64_t));
    if (m->counts == NULL || m->displs == NULL || m->descs == NULL)
        return dopt__mpi_create_fail(cfg, DOPT_ERR_NOMEM, "out of memory for %d ranks", *size);
    m->check = dopt__mpi_check_wanted(cfg);
    m->engine = cfg->engine > 0;
    m->size = *size;
    m->max_count = cfg->max_count ? cfg->max_count : (size_t)DOPT_MPI_MAX_COUNT;
    if (m->max_count > (size_t)INT_MAX) m->max_count = (size_t)INT_MAX;
    return DOPT_OK;
}

/* The collective part: our own duplicate, errors returned, settings agreed. */
static dopt_status dopt__mpi_connect(const dopt_mpi_config *cfg, dopt__mpi *m, MPI_Comm base, int *rank) {
    int err = MPI_Comm_dup(base, &m->comm);
    if (err != MPI_SUCCESS) {
        m->comm = MPI_COMM_NULL;
        return dopt__mpi_create_fail_mpi(cfg, "MPI_Comm_dup", err);
    }
    err = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    if (err == MPI_SUCCESS) err = MPI_Comm_rank(m->comm, rank);
    if (err == MPI_SUCCESS) err = dopt__mpi_agree(m->comm, &m->check, &m->max_count, &m->engine);
    if (err != MPI_SUCCESS) return dopt__mpi_create_fail_mpi(cfg, "setting up the duplicate communicator", err);
    return DOPT_OK;
}

/* Ranks of comm on this node (MPI_COMM_TYPE_SHARED), 0 when MPI cannot tell. Collective. */
static int dopt__mpi_local_ranks(MPI_Comm comm) {
    MPI_Comm node;
    int n = 0;
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) != MPI_SUCCESS) return 0;
    if (MPI_Comm_size(node, &n) != MPI_SUCCESS) n = 0;
    MPI_Comm_free(&node);
    return n;
}

static int dopt__mpi_cores(void) {
#if defined(_SC_NPROCESSORS_ONLN)
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 && n < INT_MAX ? (int)n : 0;
#else
    return 0;
#endif
}

/* The job's identity for the flight recorder (every rank's file is named by it): rank 0's
   process and the time it made the communicator, broadcast, so that no two jobs share it. */
static void dopt__mpi_set_job(dopt_comm *c, MPI_Comm comm) {
    unsigned long long id[2] = {0, 0};
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    id[1] = (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
#if defined(__unix__) || defined(__APPLE__)
    id[0] = (unsigned long long)getpid();
#endif
    if (MPI_Bcast(id, 2, MPI_UNSIGNED_LONG_LONG, 0, comm) == MPI_SUCCESS) dopt_comm_set_job(c, id, sizeof id);
}

DOPT_DEF dopt_status dopt_mpi_create(dopt_comm **out, const dopt_mpi_config *cfg) {
    dopt_mpi_config defaults;
    dopt__mpi *m = NULL;
    dopt_comm *c = NULL;
    MPI_Comm base = MPI_COMM_NULL;
    int rank = 0, size = 0, local, provided = MPI_THREAD_SINGLE;
    dopt_status s;
    if (cfg == NULL) {
        memset(&defaults, 0, sizeof defaults);
        cfg = &defaults;
    }
    if (out == NULL) return dopt__mpi_create_fail(cfg, DOPT_ERR_INVALID, "out is NULL");
    *out = NULL;
    s = dopt__mpi_prepare(cfg, &m, &base, &size);
    if (s == DOPT_OK) s = dopt__mpi_connect(cfg, m, base, &rank);
    if (s == DOPT_OK) {
        m->rank = rank;
        s = dopt_comm_new(&c, rank, size, m->engine ? &dopt__mpi_engine_vtable : &dopt__mpi_vtable, m);
        if (s != DOPT_OK) dopt__mpi_create_fail(cfg, s, "cannot allocate the communicator");
    }
    if (s == DOPT_OK && m->engine) {
        dopt_comm_set_log(c, cfg->log_fn, cfg->log_user);
        s = dopt__mpi_links_open(c, m);
        if (s != DOPT_OK) {
            dopt_comm_destroy(c);
            return s;
        }
    }
    if (s != DOPT_OK) {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (m != NULL && m->comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&m->comm);
        dopt__mpi_free_state(m);
        return s;
    }
    dopt_comm_set_log(c, cfg->log_fn, cfg->log_user);
    dopt__mpi_set_job(c, m->comm);
    local = dopt__mpi_local_ranks(m->comm);
    dopt_comm_log(c, DOPT_LOG_INFO, "mpi rank %d of %d: %s MPI, %s, at most %zu per MPI call, %d ranks on this host%s",
                  rank, size, m->owns_mpi ? "initialised" : "joined",
                  m->engine ? "collectives on the engine over links" : m->check ? "mismatch check on" : "mismatch check off",
                  m->max_count, local, local ? "" : " (MPI cannot tell)");
    dopt_comm_set_host(c, local, dopt__mpi_cores());
    MPI_Query_thread(&provided);
    c->one_thread = provided < MPI_THREAD_SERIALIZED; /* another thread may call it only from SERIALIZED on */
    *out = c;
    return DOPT_OK;
}

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_IMPLEMENTATION && !DOPT__MPI_IMPLEMENTED */
