/* transport_shm.h — distopt's collectives (dopt_comm) over POSIX shared memory between the
   processes of one machine, and a fork helper that runs a whole job from one command.
   Part of distopt 0.1.0. MIT licence (see the end of distopt.h). Linux only.

   DO THIS in exactly one C or C++ file of your program, before including the headers:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "transport_shm.h"

   Other files include the two headers without the macro. Under strict -std=c11 include this
   one first, before distopt.h and any system header (it then asks for POSIX itself), or compile
   with -D_GNU_SOURCE; link with -lrt on glibc older than 2.34:

       cc -std=c11 -D_GNU_SOURCE -O2 -march=native -o train train.c -lm -lrt

   QUICK START
   Most programs do not call this header themselves: with it included before launch.h,
   dopt_comm_create_from_env(&comm) forks the ranks (DOPT_WORLD_SIZE=4 ./train) or joins a job a
   launcher started on this host, and dopt_comm_finish(comm, status) ends every rank (launch.h).
   Called directly, one command runs 4 workers (the program forks them itself):

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "transport_shm.h"

       int main(void) {
           float grads[1000] = {0};
           dopt_comm *comm;
           dopt_status st;
           if (dopt_shm_fork(&comm, 4, NULL) != DOPT_OK) return 1;  (returns in 4 processes)
           grads[0] = (float)comm->rank;
           st = dopt_allreduce(comm, grads, 1000, DOPT_F32, DOPT_MEAN);
           return dopt_comm_finish(comm, st);          (ranks 1..3 exit here; rank 0 gets
       }                                                 the job's status: 0 when all ranks
                                                         finished with 0)

   Ranks started by a launcher instead (any launcher, or a shell loop) each call
   dopt_shm_create with the same job name and world size and their own rank:

       DOPT_SHM_NAME=job7 DOPT_WORLD_SIZE=2 DOPT_RANK=0 ./train &
       DOPT_SHM_NAME=job7 DOPT_WORLD_SIZE=2 DOPT_RANK=1 ./train

       dopt_comm *comm;
       if (dopt_shm_create(&comm, NULL) != DOPT_OK) return 1;   (NULL: the environment's configuration)
       ...
       return dopt_comm_finish(comm, st);                       (destroys the communicator)

   CONFIGURATION (dopt_shm_config; all zero, or a NULL pointer, means the defaults)

   | field        | meaning                                                     | zero means                  |
   |--------------|-------------------------------------------------------------|-----------------------------|
   | name         | job name: 1..200 of [A-Za-z0-9._-]; names the segment       | env_name (required when     |
   |              | /dev/shm/dopt.NAME while the job forms                      | size > 1); the fork helper  |
   |              |                                                             | makes a unique one          |
   | rank, size   | this process's rank and the world size (the fork helper     | size 0 is refused           |
   |              | sets both itself)                                           |                             |
   | timeout_ms   | bound on every wait, joining included (comm->timeout_ms)    | 300 s                       |
   | chunk_bytes  | bytes each rank moves per pipeline step; the segment holds  | 256 KiB                     |
   |              | 3 per rank, so memory is size·3·chunk_bytes whatever the    |                             |
   |              | message size; 64 B .. 1 GiB; every rank must give the same  |                             |
   | engine       | 1: every collective on distopt.h's engine over the links    | 0: the direct collectives,  |
   |              | (LINKS AND GROUPS below), so that requests move while the   | faster at every size        |
   |              | caller computes; 0 or 1, every rank must give the same      | measured (REFERENCE below)  |
   | log_fn,      | logging callback, installed on the communicator, and told   | silent                      |
   | log_user     | why a create failed (there is no communicator to ask then)  |                             |
   | on_peer_lost | DOPT_FAIL: a lost rank ends the job (every survivor names   | DOPT_FAIL                   |
   |              | it); DOPT_SHRINK: the survivors may go on without it        |                             |
   |              | (dopt_comm_shrink; SURVIVING A LOST RANK); worlds <= 64     |                             |
   | min_ranks    | with DOPT_SHRINK, fewer survivors than this end the job     | 0: any number               |
   |              | with DOPT_ERR_PEER_LOST on every survivor                   |                             |
   | join         | 1: this process asks the running DOPT_SHRINK job `name` to  | 0: a rank of a job that     |
   |              | take it in (rank and size ignored; TAKING A WORKER BACK)    | forms                       |

   A config is never read from the environment by itself; dopt_shm_config_from_env fills one.

   ENVIRONMENT (dopt_shm_config_from_env; dopt_shm_create with cfg NULL)
     DOPT_RANK, DOPT_WORLD_SIZE (or a launcher's: distopt.h's LAUNCH VARIABLES), DOPT_SHM_NAME
     (else the launcher's job name), DOPT_TIMEOUT_MS, DOPT_SHM_ENGINE (0 or 1: engine),
     DOPT_ON_PEER_LOST ("fail" or "shrink": on_peer_lost), DOPT_MIN_RANKS (min_ranks), DOPT_JOIN
     (0 or 1: join; with 1, DOPT_RANK and DOPT_WORLD_SIZE may be left out); the last three only
     when set.
     launch.h reads DOPT_SHM_ENGINE for the ranks it forks too.

   FUNCTIONS

   dopt_status dopt_shm_config_from_env(dopt_shm_config *cfg)
     Sets rank, size, env_name and timeout_ms from the environment (and name to NULL): rank and
     world size from the launch variables distopt.h reads (DOPT_RANK/DOPT_WORLD_SIZE, mpirun,
     srun or torchrun's; see LAUNCH VARIABLES there), the name from DOPT_SHM_NAME or else the
     job's name the launcher gives (Slurm's job and step, Open MPI's job id), DOPT_TIMEOUT_MS
     when set, engine from DOPT_SHM_ENGINE when set, on_peer_lost and min_ranks from
     DOPT_ON_PEER_LOST and DOPT_MIN_RANKS when set. DOPT_ERR_INVALID, said through cfg->log_fn,
     when no rank or size is given, a value is malformed (DOPT_SHM_ENGINE="2" is not 0 or 1,
     DOPT_ON_PEER_LOST="maybe" is not fail or shrink), or the launcher puts some of the job's
     ranks on other hosts.

   dopt_status dopt_shm_create(dopt_comm **out, const dopt_shm_config *cfg)
     Joins the job: the first of its ranks to arrive creates the segment (any rank may be first),
     the others attach to it, and the call returns once all size ranks have joined, so a
     communicator that comes back is complete. comm->rank and comm->size are the configured rank
     and size. Every rank must give the same name, size and chunk_bytes. As soon as every rank
     has joined the name is removed (the ranks keep their mappings), so a job that crashes later
     leaves nothing in /dev/shm, and the name can be reused at once by the next job. A segment
     left by a job that died while forming (every process that joined it has exited, or one of
     them died, or the job failed) is removed and replaced. A world of size 1 needs no name and
     no segment. cfg NULL takes the configuration from the environment (as
     dopt_shm_config_from_env, silent on failure). On success *out owns the mapping; release it
     with dopt_comm_finish (or dopt_comm_destroy). On failure *out is NULL and log_fn is told
     why. Errors:
       DOPT_ERR_INVALID   out is NULL; no name, a bad name or bad size/rank (size 0 included);
                          chunk_bytes or timeout_ms out of range; the
                          job's segment was made for another world size or chunk size; or this
                          rank is already held by a live process (another job is forming under
                          the same name — a live job is never taken over).
       DOPT_ERR_PROTOCOL  a segment under that name, held by a live process, that is not
                          distopt's or is of another protocol version (a program built from
                          another distopt release); an unheld one is replaced like a dead job's.
       DOPT_ERR_TIMEOUT   a rank did not join within timeout_ms (the detail names every missing
                          rank; while it waits, a DOPT_LOG_WARN line names them every 5 s:
                          "job 'j7' waiting for ranks 1, 2 (1 of 3 joined, 10 s)").
       DOPT_ERR_PEER_LOST a rank that had joined died, or left, before the job was complete.
       DOPT_ERR_IO        shm_open, fallocate (no room in /dev/shm), mmap or locking failed.
       DOPT_ERR_NOMEM     allocating the communicator failed.
     Threading: call once per rank; the communicator is then used by one thread at a time.

   dopt_status dopt_shm_fork(dopt_comm **out, int nranks, const dopt_shm_config *cfg)
     Starts a job of nranks processes from this one, with no launcher: the caller forks
     nranks - 1 children, becomes rank 0 itself, and every process (the caller and each child)
     returns from this call holding its own communicator (rank r of nranks) — the rest of the
     program runs in all of them. cfg->rank and cfg->size are ignored; cfg->name may be NULL (a
     unique name is made; DOPT_SHM_NAME is not used, so concurrent fork jobs never collide).
     Call it early in main, before starting threads (fork copies only the calling thread) and
     before opening files whose offsets the ranks would share; stdio buffers are flushed before
     forking so nothing is printed twice. Returns DOPT_OK in every process, or an error in the
     caller only: by then every child has been stopped and reaped (a child that cannot join
     exits with status 1 after telling log_fn why). Errors: those of dopt_shm_create, plus
     DOPT_ERR_INVALID for nranks outside 1..1024 and DOPT_ERR_IO when fork fails.

   int dopt_comm_finish(dopt_comm *comm, int status)   (from distopt.h)
     Ends a rank of a forked job: the one call every rank makes last, with its own exit status
     (0 for success). In a child it destroys the communicator, flushes stdio and calls
     _exit(status): it does not return (atexit handlers, which the child inherited from the
     parent, do not run). In rank 0 it waits for every child — at most comm->timeout_ms, then
     kills the laggards with SIGKILL — destroys the communicator and returns the job's status:
     status if it is not 0, else the exit status of the lowest rank that failed (128 + N for a
     rank killed by signal N, as the shell reports it), else 0. Each failed child is reported
     through the communicator's log callback at DOPT_LOG_ERROR ("rank 2 (pid 4242) was killed
     by signal 9"). On a communicator that dopt_shm_fork did not start, it destroys it and
     returns status. comm may be NULL (returns status).
     dopt_shm_fork_finish(comm, status), its name before it served every transport, is the same
     call; it stays for one release (deprecated).

   dopt_comm_destroy(comm)   (from distopt.h)
     Leaves the job: peers still waiting for this rank get DOPT_ERR_PEER_LOST at once ("rank 1
     (pid 4242) left the job"), unmaps the segment, and removes the name if the job never
     finished forming. In a forked job use dopt_comm_finish instead.

   COLLECTIVES
     Those of distopt.h. Results are bitwise identical on every rank (each element is reduced by
     one rank, in rank order) and the same from run to run. Zero-length calls synchronise like
     any other call. A request (dopt_allreduce_start, ...) runs its collective at start, after
     finishing any group request in flight. How they run: see REFERENCE FOR CONTRIBUTORS below
     (COLLECTIVES).

   LINKS AND GROUPS
     In worlds of 2..64 ranks the segment also holds a link per ordered pair of ranks (256 KiB
     each, halved while all of them together would pass 16 MiB, at least 4 KiB: 512 KiB in all at
     2 ranks, 14 MiB at 8, 16 MiB at 64). They carry dopt_comm_split and dopt_comm_split_host
     groups, and, with engine = 1, every collective: requests then progress in
     dopt_test/dopt_wait or on a progress thread (dopt_comm_set_progress_thread). Larger worlds
     have no links: dopt_comm_split returns DOPT_ERR_UNSUPPORTED, and engine = 1 is ignored (the
     direct collectives run).

   WAITING, TIMEOUTS AND DEAD PEERS
     A rank waiting for its peers spins briefly, then sleeps until they arrive: no processor is
     burnt while a peer computes for seconds. Every wait is bounded by comm->timeout_ms, and a
     peer that dies is found long before that: all ranks fail within about a quarter second of a
     peer's death, not at the timeout. The schedule of the waits: see REFERENCE FOR CONTRIBUTORS
     below (WAITING).

   SURVIVING A LOST RANK (on_peer_lost = DOPT_SHRINK; distopt.h: SURVIVING A LOST PEER)
     In worlds of up to 64 ranks, a job configured with on_peer_lost = DOPT_SHRINK (or
     DOPT_ON_PEER_LOST=shrink) goes on without a rank that died: after a collective failed with
     DOPT_ERR_PEER_LOST (or TIMEOUT), every survivor calls dopt_comm_shrink(comm, &next).

         if (dopt_allreduce(comm, g, n, DOPT_F32, DOPT_MEAN) == DOPT_ERR_PEER_LOST) {
             dopt_comm *next;
             if (dopt_comm_shrink(comm, &next) != DOPT_OK) return dopt_comm_finish(comm, 1);
             dopt_comm_destroy(comm);
             comm = next; // the survivors, renumbered in their old order; next->epoch counts shrinks
         }

     The survivors agree in the failed job's segment, with no coordinator (rank 0 may be the
     one lost): each says it is there, waits until every other rank is there too, dead, or
     silent for timeout_ms, and the first to see that writes the set of survivors in one
     compare-and-swap that every survivor then reads. They form a job of their own, named
     <name>.s<epoch> (a segment of the new size, removed from /dev/shm once all joined, like
     any job's), ranked in their old order; the engine and a progress thread carry over. A
     survivor lost after the decision fails every other's join at once (they watch the failed
     job's locks for members that have not joined), and they agree again without it
     (<name>.s<epoch>-<attempt>, up to 8 attempts). Below min_ranks, every survivor fails with
     "3 of 4 ranks survive (ranks 1 are gone), fewer than min_ranks 4: the job cannot go on";
     a survivor that came later than timeout_ms finds itself left out ("the survivors left this
     rank out"). A dead rank is found within DOPT__SHM_LIVENESS_MS (0.2 s) of its death by a rank
     waiting for it, and the shrink takes a few milliseconds after that (tests/test_shrink.c
     prints it: 4 to 8 ms for 4 ranks here). A job started by dopt_shm_fork keeps its children
     across a shrink (and a grow): rank 0's dopt_comm_finish on the new communicator still
     waits for them (and reports the dead one).

   TAKING A WORKER BACK (join = 1; distopt.h: TAKING A WORKER BACK)

       // the restarted process: the job's name, DOPT_JOIN=1 (or cfg.join = 1); no rank or size
       DOPT_SHM_NAME=job7 DOPT_JOIN=1 DOPT_ON_PEER_LOST=shrink ./train
       dopt_shm_create(&comm, NULL);     // returns once the members took it in
       // every member, at a moment all of them reach (localsgd.h's driver: a round's end):
       dopt_comm *next;
       if (dopt_comm_grow(comm, &next) == DOPT_OK && next) { dopt_comm_destroy(comm); comm = next; }

     The joiner asks in the job's join box, /dev/shm/dopt.<name>+join (mode 0600, the user's
     own: /dev/shm's permissions are shared memory's only authentication, as for the job's
     segment), named from the name the job started under, so it finds the job after any number
     of shrinks and grows. At most 8 joiners ask at once (a ninth waits for a free slot). The
     members' dopt_comm_grow takes in every joiner all of them saw waiting (one allreduce of 16
     numbers on the communicator: this is the cost of a grow when nobody asks), one of them
     writes each joiner its rank and the grown job's name and settings, and all form the grown
     job <name>.g<epoch>-<ticket> with the joiners ranked last, in the order of their slots;
     dopt_comm_joiners_held(c) reads the box (one shm_open that finds nothing while nobody
     asks). The grown communicator keeps the members' settings (timeout_ms, chunk_bytes,
     engine, on_peer_lost = DOPT_SHRINK, min_ranks); on the joiner, cfg.timeout_ms (0: 300 s)
     bounds the wait to be taken in, its other fields are not used. Worlds stay within 64
     ranks (joiners beyond wait). What can go wrong:
     - the joiner dies after the members admitted it, before it joined: the members watch its
       slot's lock and fail the grown job's join at once; dopt_comm_grow then returns DOPT_OK
       with no next and a DOPT_LOG_WARN line ("the grown job '...' did not form"): the job goes
       on as it was;
     - a member dies meanwhile: dopt_comm_grow returns DOPT_ERR_PEER_LOST (c failed, naming it):
       shrink c; the joiner sees the grown job fail and asks again (a new ticket);
     - nobody takes the joiner in within its timeout: DOPT_ERR_TIMEOUT, "join: no member of job
       'job7' took this process in within 300000 ms (...): is the job running with
       on_peer_lost = DOPT_SHRINK ..., and does it call dopt_comm_grow ...?". It leaves no box
       behind (the last joiner out removes it).

   MISMATCHES
     Every call is checked against every peer's before any data is reduced. If any differs, every rank
     fails with DOPT_ERR_MISMATCH naming the first rank that differs from it ("rank 2 called
     allreduce #7 (f32 max, 16 elems)"); no data is reduced.

   ERRORS A USER CAN SEE (from collectives; the communicator is poisoned after any of them)
     DOPT_ERR_MISMATCH   ranks called different collectives, counts, dtypes, ops or roots.
     DOPT_ERR_PEER_LOST  "rank 2 (pid 4242) died": its process exited or was killed;
                         "rank 2 (pid 4242) left the job": it destroyed its communicator.
     DOPT_ERR_TIMEOUT    "rank 2 did not arrive within 2000 ms": alive but not calling.
     A rank that learns of a failure from the segment reports the same status and reason, with
     "(reported by rank R)" appended.
*/
#ifndef DISTOPT_TRANSPORT_SHM_H
#define DISTOPT_TRANSPORT_SHM_H

#define DOPT__WANT_POSIX 1 /* see the top of distopt.h */
#include "distopt.h"
#include "engine.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_SHM_NAME_MAX 200 /* characters of a job name */

typedef struct dopt_shm_config {
    const char *name;   /* NULL: env_name when it is not empty */
    int rank;           /* with size; ignored by dopt_shm_fork */
    int size;           /* >= 1; ignored by dopt_shm_fork */
    int timeout_ms;     /* 0: DOPT_DEFAULT_TIMEOUT_MS */
    size_t chunk_bytes; /* 0: 256 KiB */
    int engine;         /* 1: every collective on distopt.h's engine over per-pair links; 0: direct */
    dopt_log_fn log_fn; /* NULL: silent */
    void *log_user;
    char env_name[DOPT_SHM_NAME_MAX + 1]; /* the name dopt_shm_config_from_env found */
    int on_peer_lost;   /* DOPT_FAIL (0): a lost rank ends the job; DOPT_SHRINK: the survivors may go
                           on (dopt_comm_shrink; worlds of up to 64 ranks; SURVIVING A LOST RANK) */
    int min_ranks;      /* with DOPT_SHRINK: fewer survivors than this end the job; 0: any */
    int join;           /* 1: a restarted worker asking the running job `name` to take it in (rank
                           and size ignored; TAKING A WORKER BACK); 0: a rank of a forming job */
} dopt_shm_config;

DOPT_DEF dopt_status dopt_shm_create(dopt_comm **out, const dopt_shm_config *cfg);
DOPT_DEF dopt_status dopt_shm_config_from_env(dopt_shm_config *cfg);
DOPT_DEF dopt_status dopt_shm_fork(dopt_comm **out, int nranks, const dopt_shm_config *cfg);
/* Deprecated: dopt_comm_finish (distopt.h) is the same call for every transport. */
DOPT_DEF int dopt_shm_fork_finish(dopt_comm *comm, int status);

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_TRANSPORT_SHM_H */

/* ==================== REFERENCE FOR CONTRIBUTORS ====================
   Not needed to use transport_shm.h: how the collectives, links, waits and mismatch checks work
   in the segment, and what they measured.

   COLLECTIVES
     Each rank's slot in the segment holds a control line and 3 areas of chunk_bytes. Allreduce up
     to 12 KiB (and at most one chunk) is one-shot: every rank copies its input into its slot, one
     barrier, every rank reduces all inputs in rank order. Larger allreduces are pipelined by
     chunks: rank r reduces the r-th of size slices of each chunk straight from the peers' slots, in
     rank order 0, 1, ..., size-1, and publishes it; every rank then copies the reduced slices out.
     One barrier per chunk; 3 areas let copy-out of chunk k-1, reduction of chunk k and copy-in of
     chunk k+1 overlap between two barriers. Broadcast and allgatherv are pipelined through the
     slots the same way.

   LINKS AND THE ENGINE
     Each link is a ring that one rank writes and the other reads without a lock. They are the links
     of engine.h's engine (its manual is the link contract). Waiting on
     links spins while the engine polls, then sleeps on a futex word of its own that a peer rings
     after moving a link. Failures cross between the two paths: a rank waiting in a direct
     collective for a peer that sends it frames of a group's collective fails with MISMATCH naming
     both calls (the peer learns it from the segment), and a failure of the engine is recorded in
     the segment for ranks waiting in a direct collective. The engine is slower here: 2 ranks,
     bench/bench_allreduce (mpirun -np 2 build/bench_allreduce mpi-raw shm,shm-engine,memcpy), 1.6
     against 1.1 µs at 4 KiB, 14.7 against 12.2 µs at 64 KiB, 168 against 90 µs at 1 MiB, 3.5
     against 1.8 ms at 16 MiB: a ring over links copies every byte into a link and out again, where
     the direct path reduces straight from the peers' slots.

   WAITING
     A barrier is one store of this rank's epoch (its count of barriers) on its own cache line;
     waiting is reading the peers' epochs — a flat sense-reversing barrier whose sense is a 64-bit
     count, so no reset and no shared counter, and a late rank is known by name. A waiter spins for
     20 µs, then polls with sched_yield between polls (from the start when there are more ranks than
     processors), up to 50 µs at a call's first barrier — the peers may still be computing — or 500
     µs between the pipeline steps of one call, where they are busy in the same call; then it sleeps
     on a futex that arriving ranks wake (waking costs ~65 µs on virtual machines; no processor is
     burnt while a peer computes for seconds). Every wait is bounded by comm->timeout_ms; while
     waiting it checks the ranks that have not arrived a few times per second: each rank holds a
     lock on its own byte of the segment, released by the kernel when the process dies, and its pid
     must exist. Any rank's failure is recorded in the segment (which rank, why) and wakes every
     waiter, so all ranks fail within about a quarter second of a peer's death, not at the timeout.

   MISMATCHES
     Each call publishes its sequence number and descriptor (collective, dtype, op, root, count)
     beside its epoch before its first barrier; after it every rank compares every peer's with
     its own.
*/

/* =====================================================================================
   IMPLEMENTATION — stop reading here if you only want the API.
   ===================================================================================== */

#if defined(DISTOPT_IMPLEMENTATION) && !defined(DOPT__SHM_IMPLEMENTED)
#define DOPT__SHM_IMPLEMENTED

#ifndef __linux__
#  error "transport_shm.h: Linux only (futex, open file description locks)"
#endif

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef CLOCK_MONOTONIC /* a system header came before this one without a POSIX feature macro */
#error "transport_shm.h needs POSIX.1-2008: compile with -D_GNU_SOURCE, or include it before any other header"
#endif

/* Open file description locks (Linux 3.15): owned by the open file, not the process, so two
   communicators in one process lock independently, and released when the holder dies. The
   values are the kernel's ABI, for C libraries that only define them under _GNU_SOURCE. */
#ifndef F_OFD_GETLK
#  define F_OFD_GETLK 36
#  define F_OFD_SETLK 37
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ===================================================================== SEGMENT LAYOUT

   offset 0                      header: identity, sizes, join bookkeeping       (one page)
            + 128                futex word and sleeper count
            + 256                abort word: the job's first failure
            + 512                the survivors' decisions: a 64-bit set of ranks per attempt (SHRINK)
   4096                          rank blocks, 512 bytes each:
            + 0                    hot line: epoch and the published descriptors
            + 128                  cold line: pid, left flag, link bell, the shrink attempt it is in
            + 256                  reason text, when this rank reports the job's failure
   4096 + round_up(size·512)     data: rank q's area a at ((q·3 + a) · area_stride)
   data + size·3·area_stride     links (worlds of 2..64 ranks): the link from rank i to rank j
                                 at index i·(size−1) + (j < i ? j : j − 1), link_stride each:
            + 0                    writer line: bytes written, closed flag
            + 128                  reader line: bytes read
            + 256                  a ring of link_bytes (a power of two)

   Rank q also holds an open-file-description lock on byte q of the segment file while it is a
   member: the kernel drops it when the process dies, which is how peers and newcomers tell a
   live rank from a dead one. Only the mapping keeps that open file (its descriptor is closed
   after joining) and the mapping is not inherited by fork, so a child the rank forks for its
   own purposes cannot keep a dead rank looking alive. */

#define DOPT__SHM_MAGIC 0x314d485354504f44ull /* "DOPTSHM1" as little-endian bytes */
#define DOPT__SHM_VERSION 3u /* 3: the survivors' agreement (SHRINK) */
#define DOPT__SHM_MAX_RANKS 1024
#define DOPT__SHM_AREAS 3
#define DOPT__SHM_PAGE 4096u
#define DOPT__SHM_HEADER_BYTES 4096u
#define DOPT__SHM_OFF_SYNC 128u
#define DOPT__SHM_OFF_ABORT 256u
#define DOPT__SHM_OFF_SHRINK 512u     /* the survivors' decisions, one word per attempt (SHRINK) */
#define DOPT__SHM_SHRINK_TRIES 8      /* attempts before the survivors give up forming their job */
#define DOPT__SHM_SHRINK_MAX_RANKS 64 /* a decision is a 64-bit set of ranks */
#define DOPT__SHM_RANK_BYTES 512u
#define DOPT__SHM_OFF_COLD 128u
#define DOPT__SHM_OFF_REASON 256u
#define DOPT__SHM_REASON_MAX 256
#define DOPT__SHM_NAME_MAX 200
#define DOPT__SHM_DEFAULT_CHUNK ((size_t)256 << 10)
#define DOPT__SHM_MIN_CHUNK ((size_t)64)
#define DOPT__SHM_MAX_CHUNK ((size_t)1 << 30)
#define DOPT__SHM_ONESHOT_BYTES ((size_t)12 << 10) /* measured crossover 8..16 KiB at 2 and 3 ranks */
#define DOPT__SHM_SPIN_US 50.0        /* spin before sleeping at a call's first barrier */
#define DOPT__SHM_SPIN_STEP_US 500.0  /* ... and at its later ones, where the peers are busy in
                                         the same call: a pipeline step is ~50 µs, and a sleep
                                         (~65 µs to wake) would make the peer sleep in turn */
#define DOPT__SHM_PURE_SPIN_US 20.0   /* then yield the processor between polls */
#define DOPT__SHM_LIVENESS_MS 200.0   /* check the ranks not arrived this often */
#define DOPT__SHM_REPORT_MS 5000.0    /* while the job forms, say who is missing this often */
#define DOPT__SHM_SLEEP_MS 50.0       /* longest single futex sleep */
#define DOPT__SHM_STALE_S 2           /* an uninitialised segment this old with no holder is dead */
#define DOPT__SHM_LINK_MAX_RANKS 64   /* worlds up to this size get links (groups, the engine) */
#define DOPT__SHM_LINK_BUDGET ((size_t)16 << 20) /* ring bytes of all links together, above 4 KiB each */
#define DOPT__SHM_LINK_MAX ((size_t)256 << 10)
#define DOPT__SHM_LINK_MIN ((size_t)4 << 10)
#define DOPT__SHM_LINK_CTRL 256u
#define DOPT__SHM_BOX_SLOTS 8         /* joiners asking at once (TAKING A WORKER BACK) */
#define DOPT__SHM_BOX_BYTES 4096u     /* the join box's size; its slots' locks are the bytes after it */

typedef struct dopt__shm_header {
    uint64_t magic; /* stored last by the creator: the header is complete */
    uint32_t version;
    int32_t size;
    uint64_t chunk_bytes;
    uint64_t area_stride;
    uint64_t total_bytes;
    int32_t creator_pid;
    uint32_t attached; /* ranks that have joined */
    uint32_t unlinked; /* 1 once the name has been removed */
    uint32_t reaped;   /* 1 once a newcomer found the job dead and removes its name */
    uint32_t engine;   /* the config's engine: every rank must run collectives the same way */
} dopt__shm_header;

typedef struct dopt__shm_sync {
    uint32_t wake;     /* futex word: bumped by every arrival that finds sleepers */
    uint32_t sleepers; /* waiters inside (or about to enter) a futex wait */
} dopt__shm_sync;

/* A collective as it is published: enough to compare and to describe it. */
typedef struct dopt__shm_wire {
    uint64_t seq;
    uint64_t count;
    uint32_t kind_dtype_op; /* kind | dtype << 8 | op << 16 */
    int32_t root;
} dopt__shm_wire;

typedef struct dopt__shm_hot {
    uint64_t epoch;            /* barriers this rank has arrived at */
    dopt__shm_wire desc[2];    /* by sequence parity: a fast peer may publish call k+1 while a
                                  slow one still reads call k, never call k+2 */
} dopt__shm_hot;

typedef struct dopt__shm_cold {
    int32_t pid;     /* 0 until the rank has joined */
    uint32_t left;   /* 1 once it destroyed its communicator */
    uint32_t bell;   /* futex word of its links: bumped by a peer that moved one while it sleeps */
    uint32_t asleep; /* its waiters inside (or about to enter) a futex wait on bell */
    uint32_t shrinking; /* 1 + the attempt of the survivors' agreement it is in (SHRINK); 0: none */
} dopt__shm_cold;

/* The control lines of one link; its ring follows at DOPT__SHM_LINK_CTRL. */
typedef struct dopt__shm_chan {
    uint64_t head;   /* bytes written, by the writer */
    uint32_t closed; /* 1 once the writer ended the stream (after its last head) */
    unsigned char pad[116];
    uint64_t tail;   /* bytes read, by the reader */
} dopt__shm_chan;

/* The private side of one communicator. */
typedef struct dopt__shm {
    unsigned char *base; /* the mapping, NULL when there is none */
    size_t map_len;      /* its length */
    size_t total;        /* the segment's size for this world size and chunk */
    int fd;              /* while joining: the open file that locks and maps; then a second
                            one that holds no lock, for probing peers' locks; -1 when closed */
    dev_t dev;           /* identity of our segment file, so we only ever unlink our own */
    ino_t ino;
    char path[DOPT__SHM_NAME_MAX + 8];
    const char *job;     /* the name part of path */
    int rank, size;
    size_t chunk, stride, oneshot_bytes, data_off;
    size_t links_off, link_bytes, link_stride; /* link_bytes 0: no links */
    int engine;          /* every collective on the engine over the links */
    unsigned char *gone; /* [size]: a peer this rank found dead (its links then end) */
    double next_probe;   /* when link_wait next checks the peers it waits for are alive */
    uint64_t epoch;      /* barriers this rank has arrived at */
    int spin;            /* 0 when there are more ranks than processors: yield from the start */
    int member;          /* joined: may record failures in the segment and remove its name */
    int left;
    int fork_child;      /* started by dopt_shm_fork as a child: finish _exits */
    pid_t *children;     /* dopt_shm_fork, rank 0: ranks 1..size-1 */
    int nchildren;
    char family[DOPT__SHM_NAME_MAX + 1]; /* the name the job started under: a shrink's names grow from it */
    const struct dopt__shm_watch *watch; /* joining a shrink's or a grow's job: who may be lost first */
} dopt__shm;

/* Joining a job that a shrink or a grow makes: where a rank that has not joined yet may be seen
   lost, so that the join fails at once instead of at the timeout. */
typedef struct dopt__shm_watch {
    const dopt__shm *job;  /* the members' communicator: a member there may be seen dead or gone */
    const int *rank;       /* [new rank]: its rank in job; or -1 - its slot in the join box (a joiner) */
    const void *box;       /* the join box (a grow), and an open file of it */
    int box_fd;
    const int64_t *ticket; /* [slot]: the ticket admitted in it */
    int own;               /* 1 on a joiner: its own slot says whether the members gave up */
} dopt__shm_watch;

static int dopt__shm_box_gone(const dopt__shm_watch *w, int slot);

static dopt__shm_header *dopt__shm_hdr(const dopt__shm *s) { return (dopt__shm_header *)(void *)s->base; }
static dopt__shm_sync *dopt__shm_sync_of(const dopt__shm *s) {
    return (dopt__shm_sync *)(void *)(s->base + DOPT__SHM_OFF_SYNC);
}
static uint64_t *dopt__shm_abort_word(const dopt__shm *s) { return (uint64_t *)(void *)(s->base + DOPT__SHM_OFF_ABORT); }
static unsigned char *dopt__shm_block(const dopt__shm *s, int q) {
    return s->base + DOPT__SHM_HEADER_BYTES + (size_t)q * DOPT__SHM_RANK_BYTES;
}
static dopt__shm_hot *dopt__shm_hot_of(const dopt__shm *s, int q) { return (dopt__shm_hot *)(void *)dopt__shm_block(s, q); }
static dopt__shm_cold *dopt__shm_cold_of(const dopt__shm *s, int q) {
    return (dopt__shm_cold *)(void *)(dopt__shm_block(s, q) + DOPT__SHM_OFF_COLD);
}
static char *dopt__shm_reason_of(const dopt__shm *s, int q) { return (char *)dopt__shm_block(s, q) + DOPT__SHM_OFF_REASON; }
static unsigned char *dopt__shm_area(const dopt__shm *s, int q, uint64_t phase) {
    return s->base + s->data_off + ((size_t)q * DOPT__SHM_AREAS + (size_t)(phase % DOPT__SHM_AREAS)) * s->stride;
}

static size_t dopt__shm_round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* Geometry from the world size and chunk: every rank computes the same, and attaching ranks
   check the header against it. */
static void dopt__shm_geometry(dopt__shm *s) {
    s->stride = dopt__shm_round_up(s->chunk, s->chunk >= DOPT__SHM_PAGE ? DOPT__SHM_PAGE : 64);
    s->data_off = DOPT__SHM_HEADER_BYTES + dopt__shm_round_up((size_t)s->size * DOPT__SHM_RANK_BYTES, DOPT__SHM_PAGE);
    s->total = s->data_off + (size_t)s->size * DOPT__SHM_AREAS * s->stride;
    s->oneshot_bytes = s->chunk < DOPT__SHM_ONESHOT_BYTES ? s->chunk : DOPT__SHM_ONESHOT_BYTES;
    s->link_bytes = 0;
    if (s->size > 1 && s->size <= DOPT__SHM_LINK_MAX_RANKS) {
        size_t pairs = (size_t)s->size * (size_t)(s->size - 1), each = DOPT__SHM_LINK_MAX;
        while (each > DOPT__SHM_LINK_MIN && each * pairs > DOPT__SHM_LINK_BUDGET) each /= 2;
        s->link_bytes = each;
        s->link_stride = DOPT__SHM_LINK_CTRL + each;
        s->links_off = s->total;
        s->total += pairs * s->link_stride;
    }
}

/* ===================================================================== CLOCK, FUTEX, CPU */

static void dopt__shm_sleep_ms(double ms) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ms / 1e3);
    ts.tv_nsec = (long)((ms - (double)ts.tv_sec * 1e3) * 1e6);
    nanosleep(&ts, NULL);
}

static void dopt__shm_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("pause" ::: "memory");
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
#endif
}

/* Shared (not FUTEX_PRIVATE): the word lives in memory mapped by several processes. */
static void dopt__shm_futex_wait(uint32_t *word, uint32_t seen, double ms) {
    struct timespec ts;
    if (ms < 0.001) ms = 0.001;
    ts.tv_sec = (time_t)(ms / 1e3);
    ts.tv_nsec = (long)((ms - (double)ts.tv_sec * 1e3) * 1e6);
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
}

static void dopt__shm_futex_wake_all(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

static int dopt__shm_cpus(void) {
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        return n > 0 ? (int)n : 1;
    }
}

/* ===================================================================== PEER LIVENESS */

static struct flock dopt__shm_flock(short type, off_t start, off_t len) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = start;
    fl.l_len = len;
    return fl;
}

/* Takes (F_WRLCK) or drops (F_UNLCK) an OFD lock on [start, start + len) without waiting: 0, or
   -1 with errno (EAGAIN: another open file holds it). */
static int dopt__shm_lock_range(int fd, off_t start, off_t len, short type) {
    struct flock fl = dopt__shm_flock(type, start, len);
    return fcntl(fd, F_OFD_SETLK, &fl);
}

static int dopt__shm_lock_byte(int fd, int q) { return dopt__shm_lock_range(fd, (off_t)q, 1, F_WRLCK); }

/* 1 when some other open file holds a lock in [start, start + len) (len 0: to the end and
   beyond); on an error, 1 as well: never declare a rank dead without proof. */
static int dopt__shm_lock_held(int fd, off_t start, off_t len) {
    struct flock fl = dopt__shm_flock(F_WRLCK, start, len);
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return 1;
    return fl.l_type != F_UNLCK;
}

/* 1 when rank q, which has joined, is gone: its lock is free or its pid does not exist. */
static int dopt__shm_rank_dead(const dopt__shm *s, int q) {
    int pid = __atomic_load_n(&dopt__shm_cold_of(s, q)->pid, __ATOMIC_ACQUIRE);
    if (pid == 0) return 0;
    if (!dopt__shm_lock_held(s->fd, (off_t)q, 1)) return 1;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

/* ===================================================================== FAILURES */

static void dopt__shm_wake_all(dopt__shm *s) {
    dopt__shm_sync *sync = dopt__shm_sync_of(s);
    __atomic_fetch_add(&sync->wake, 1u, __ATOMIC_SEQ_CST);
    dopt__shm_futex_wake_all(&sync->wake);
}

/* Wakes rank q if it sleeps on its links. The caller's store (a head, a tail, a flag) comes
   first; the fence pairs with the sleeper's count-then-recheck, as in the barrier. */
static void dopt__shm_ring_bell(dopt__shm *s, int q) {
    dopt__shm_cold *cold = dopt__shm_cold_of(s, q);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&cold->asleep, __ATOMIC_RELAXED) != 0) {
        __atomic_fetch_add(&cold->bell, 1u, __ATOMIC_SEQ_CST);
        dopt__shm_futex_wake_all(&cold->bell);
    }
}

static void dopt__shm_ring_all_bells(dopt__shm *s) {
    int q;
    for (q = 0; s->link_bytes > 0 && q < s->size; q++) dopt__shm_ring_bell(s, q);
}

/* Records the job's first failure: status, culprit and reporter in one word, the reason in the
   reporter's own block (written before the word, so a reader that sees the word sees it). */
static void dopt__shm_publish_abort(dopt__shm *s, dopt_status st, int culprit, const char *why) {
    uint64_t *word, expect = 0, w;
    if (!s->member || s->base == NULL) return;
    word = dopt__shm_abort_word(s);
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != 0) return;
    snprintf(dopt__shm_reason_of(s, s->rank), DOPT__SHM_REASON_MAX, "%s", why);
    w = (uint64_t)(uint8_t)(-(int)st) | (uint64_t)(uint16_t)(culprit + 1) << 8 | (uint64_t)(uint16_t)(s->rank + 1) << 24;
    __atomic_compare_exchange_n(word, &expect, w, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    dopt__shm_wake_all(s);
    dopt__shm_ring_all_bells(s);
}

static dopt_status dopt__shm_fail(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, dopt_status st, int culprit,
                                  const char *fmt, ...) DOPT_PRINTF(6, 7);

/* Poisons this communicator and records the failure for the peers. */
static dopt_status dopt__shm_fail(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, dopt_status st, int culprit,
                                  const char *fmt, ...) {
    char why[DOPT__SHM_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    dopt_comm_fail(c, d, st, "%s", why);
    if (culprit >= 0 && culprit < s->size && culprit != s->rank && c->lost_rank < 0) c->lost_rank = culprit;
    dopt__shm_publish_abort(s, st, culprit, why);
    return c->error;
}

/* A failure some rank recorded: fail the same way, saying who saw it. */
static dopt_status dopt__shm_check_abort(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d) {
    uint64_t w = __atomic_load_n(dopt__shm_abort_word(s), __ATOMIC_ACQUIRE);
    char why[DOPT__SHM_REASON_MAX];
    int reporter, culprit;
    if (w == 0) return DOPT_OK;
    reporter = (int)((w >> 24) & 0xFFFF) - 1;
    culprit = (int)((w >> 8) & 0xFFFF) - 1;
    if (reporter < 0 || reporter >= s->size) return dopt_comm_fail(c, d, DOPT_ERR_PROTOCOL, "damaged failure record");
    if (culprit >= 0 && culprit < s->size && culprit != s->rank && c->lost_rank < 0) c->lost_rank = culprit;
    memcpy(why, dopt__shm_reason_of(s, reporter), sizeof why);
    why[sizeof why - 1] = '\0';
    return dopt_comm_fail(c, d, (dopt_status)(-(int)(w & 0xFF)), "%s (reported by rank %d)", why, reporter);
}

/* ===================================================================== EPOCH BARRIER */

static void dopt__shm_wake_sleepers(dopt__shm *s) {
    dopt__shm_sync *sync = dopt__shm_sync_of(s);
    /* Pairs with the sleeper's increment-then-recheck: either we see it counted, or it sees our
       epoch (both sides are sequentially consistent). */
    if (__atomic_load_n(&sync->sleepers, __ATOMIC_SEQ_CST) != 0) dopt__shm_wake_all(s);
}

/* First rank at or after `from` whose epoch is below target (size when all have arrived). */
static int dopt__shm_first_late(const dopt__shm *s, int from, uint64_t target) {
    while (from < s->size && __atomic_load_n(&dopt__shm_hot_of(s, from)->epoch, __ATOMIC_SEQ_CST) >= target) from++;
    return from;
}

static int dopt__shm_aborted(const dopt__shm *s) { return __atomic_load_n(dopt__shm_abort_word(s), __ATOMIC_ACQUIRE) != 0; }

/* Ranks from `late` on that have not arrived: one that left or died fails the wait. The
   system calls (lock test, kill) only when `probe` is set, a few times per second. */
static dopt_status dopt__shm_check_late(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, int late,
                                        uint64_t target, int probe) {
    int q;
    for (q = late; q < s->size; q++) {
        dopt__shm_cold *cold = dopt__shm_cold_of(s, q);
        if (__atomic_load_n(&dopt__shm_hot_of(s, q)->epoch, __ATOMIC_SEQ_CST) >= target) continue;
        if (__atomic_load_n(&cold->left, __ATOMIC_ACQUIRE))
            return dopt__shm_fail(c, s, d, DOPT_ERR_PEER_LOST, q, "rank %d (pid %d) left the job", q, (int)cold->pid);
        if (probe && dopt__shm_rank_dead(s, q))
            return dopt__shm_fail(c, s, d, DOPT_ERR_PEER_LOST, q, "rank %d (pid %d) died", q, (int)cold->pid);
        if (probe && s->watch && __atomic_load_n(&cold->pid, __ATOMIC_ACQUIRE) == 0) {
            const dopt__shm_watch *w = s->watch;
            int was = w->rank[q];
            if (was >= 0 && w->job &&
                (dopt__shm_rank_dead(w->job, was) ||
                 __atomic_load_n(&dopt__shm_cold_of(w->job, was)->left, __ATOMIC_ACQUIRE)))
                return dopt__shm_fail(c, s, d, DOPT_ERR_PEER_LOST, q,
                                      "rank %d (rank %d before) was lost before it joined the job's new communicator",
                                      q, was);
            if (was < 0 && dopt__shm_box_gone(w, -1 - was))
                return dopt__shm_fail(c, s, d, DOPT_ERR_PEER_LOST, q,
                                      w->own ? "the members gave up forming the grown job (a member or a joiner was "
                                               "lost before rank %d joined)"
                                             : "rank %d, a joiner, was lost before it joined", q);
        }
    }
    return DOPT_OK;
}

/* The ranks whose epoch has not reached target, as "1, 3" (at most a line); returns how many. */
static int dopt__shm_list_late(dopt__shm *s, uint64_t target, char *out, size_t cap) {
    size_t used = 0;
    int q, n = 0;
    out[0] = '\0';
    for (q = 0; q < s->size; q++) {
        if (__atomic_load_n(&dopt__shm_hot_of(s, q)->epoch, __ATOMIC_SEQ_CST) >= target) continue;
        if (used + 16 < cap) used += (size_t)snprintf(out + used, cap - used, "%s%d", n ? ", " : "", q);
        else if (used + 4 < cap && out[used - 1] != '.') used += (size_t)snprintf(out + used, cap - used, "...");
        n++;
    }
    return n;
}

/* While the job forms (d is NULL), every DOPT__SHM_REPORT_MS: who is still missing. */
static void dopt__shm_report_wait(dopt_comm *c, dopt__shm *s, uint64_t target, double waited_ms) {
    char late[256];
    int n = dopt__shm_list_late(s, target, late, sizeof late);
    dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: job '%s' waiting for rank%s %s (%d of %d joined, %.0f s)", c->rank, s->job,
                  n > 1 ? "s" : "", late, s->size - n, s->size, waited_ms / 1e3);
}

static dopt_status dopt__shm_check_frames(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, int late,
                                          uint64_t target);

/* Waits until every rank's epoch reaches target: spin, then sleep on the futex; bounded by
   comm->timeout_ms. Completion is checked before failures, so a rank that passed the barrier
   and then failed (a mismatch found right after it) cannot make a slower rank miss it. */
static dopt_status dopt__shm_wait_all(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, uint64_t target,
                                      double spin_us) {
    dopt__shm_sync *sync = dopt__shm_sync_of(s);
    double start, now, deadline, next_probe, next_report, spin_end, yield_from;
    long spins;
    int late = dopt__shm_first_late(s, 0, target);
    dopt_status st;
    if (late == s->size) return DOPT_OK;
    start = dopt__now_ms();
    spin_end = start + spin_us / 1e3;
    yield_from = s->spin ? start + DOPT__SHM_PURE_SPIN_US / 1e3 : start;
    for (spins = 1;; spins++) {
        late = dopt__shm_first_late(s, late, target);
        if (late == s->size) return DOPT_OK;
        if ((spins & 63) == 0 || !s->spin) {
            now = dopt__now_ms();
            if (now >= spin_end || dopt__shm_aborted(s)) break;
            /* Past the first microseconds the peer may be off its processor: let whatever
               waits for ours run (a peer, when there are more ranks than processors). */
            if (now >= yield_from) sched_yield();
        }
        dopt__shm_cpu_relax();
    }
    deadline = start + (double)c->timeout_ms;
    next_probe = start + DOPT__SHM_LIVENESS_MS;
    next_report = start + DOPT__SHM_REPORT_MS;
    for (;;) {
        uint32_t seen;
        double nap;
        int probe;
        late = dopt__shm_first_late(s, late, target);
        if (late == s->size) return DOPT_OK;
        st = dopt__shm_check_abort(c, s, d);
        if (st != DOPT_OK) return st;
        now = dopt__now_ms();
        probe = now >= next_probe;
        if (probe) next_probe = now + DOPT__SHM_LIVENESS_MS;
        st = dopt__shm_check_late(c, s, d, late, target, probe);
        if (st == DOPT_OK && d != NULL) st = dopt__shm_check_frames(c, s, d, late, target);
        if (st != DOPT_OK) return st;
        if (d == NULL && now >= next_report) {
            dopt__shm_report_wait(c, s, target, now - start);
            next_report = now + DOPT__SHM_REPORT_MS;
        }
        if (now >= deadline) {
            char missing[256];
            int joined = __atomic_load_n(&dopt__shm_cold_of(s, late)->pid, __ATOMIC_ACQUIRE) != 0;
            int n = dopt__shm_list_late(s, target, missing, sizeof missing);
            if (d == NULL)
                return dopt__shm_fail(c, s, d, DOPT_ERR_TIMEOUT, late, "rank%s %s did not join within %d ms (%d of %d joined)",
                                      n > 1 ? "s" : "", missing, c->timeout_ms, s->size - n, s->size);
            return dopt__shm_fail(c, s, d, DOPT_ERR_TIMEOUT, late, "rank %d did not %s within %d ms", late,
                                  joined ? "arrive" : "join", c->timeout_ms);
        }
        nap = DOPT__SHM_SLEEP_MS;
        if (next_probe - now < nap) nap = next_probe - now;
        if (deadline - now < nap) nap = deadline - now;
        __atomic_fetch_add(&sync->sleepers, 1u, __ATOMIC_SEQ_CST);
        seen = __atomic_load_n(&sync->wake, __ATOMIC_SEQ_CST);
        late = dopt__shm_first_late(s, late, target);
        if (late < s->size && !dopt__shm_aborted(s)) dopt__shm_futex_wait(&sync->wake, seen, nap);
        __atomic_fetch_sub(&sync->sleepers, 1u, __ATOMIC_SEQ_CST);
    }
}

/* Arrive at the next barrier and wait for everyone. */
static dopt_status dopt__shm_arrive_wait(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, double spin_us) {
    uint64_t target = ++s->epoch;
    __atomic_store_n(&dopt__shm_hot_of(s, s->rank)->epoch, target, __ATOMIC_SEQ_CST);
    dopt__shm_wake_sleepers(s);
    return dopt__shm_wait_all(c, s, d, target, spin_us);
}

/* A call's first barrier: the peers may still be computing, so sleep soon. */
static dopt_status dopt__shm_barrier(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d) {
    return dopt__shm_arrive_wait(c, s, d, DOPT__SHM_SPIN_US);
}

/* A later barrier of the same call: the peers are working on the previous step. */
static dopt_status dopt__shm_step(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d) {
    return dopt__shm_arrive_wait(c, s, d, DOPT__SHM_SPIN_STEP_US);
}

/* ===================================================================== MISMATCH CHECK */

static dopt__shm_wire dopt__shm_pack(const dopt_coll_desc *d) {
    dopt__shm_wire w;
    memset(&w, 0, sizeof w);
    w.seq = d->seq;
    w.count = d->count;
    w.kind_dtype_op = (uint32_t)d->kind | (uint32_t)d->dtype << 8 | (uint32_t)d->op << 16;
    w.root = d->root;
    return w;
}

static dopt_coll_desc dopt__shm_unpack(const dopt__shm_wire *w) {
    dopt_coll_desc d;
    memset(&d, 0, sizeof d);
    d.seq = w->seq;
    d.count = w->count;
    d.kind = (dopt_coll)(w->kind_dtype_op & 0xFF);
    d.dtype = (dopt_dtype)((w->kind_dtype_op >> 8) & 0xFF);
    d.op = (dopt_op)((w->kind_dtype_op >> 16) & 0xFF);
    d.root = w->root;
    return d;
}

/* Every call starts here: fail at once if the job already failed, then publish the call. The
   first barrier makes it visible to the peers. */
static dopt_status dopt__shm_begin(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d) {
    dopt_status st = dopt__shm_check_abort(c, s, d);
    if (st != DOPT_OK) return st;
    dopt__shm_hot_of(s, s->rank)->desc[d->seq & 1] = dopt__shm_pack(d);
    return DOPT_OK;
}

/* After the call's first barrier: every rank compares every peer's call with its own, so if
   any two differ, every rank finds a peer that differs from it. */
static dopt_status dopt__shm_check_match(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d) {
    dopt__shm_wire mine = dopt__shm_pack(d);
    int q;
    for (q = 0; q < s->size; q++) {
        dopt__shm_wire theirs = dopt__shm_hot_of(s, q)->desc[d->seq & 1];
        dopt_coll_desc other;
        char what[160];
        if (q == s->rank || (theirs.seq == mine.seq && theirs.count == mine.count &&
                             theirs.kind_dtype_op == mine.kind_dtype_op && theirs.root == mine.root))
            continue;
        other = dopt__shm_unpack(&theirs);
        dopt_comm_fail_mismatch(c, d, &other, q);
        dopt_coll_describe(&other, what, sizeof what);
        {
            char why[DOPT__SHM_REASON_MAX];
            snprintf(why, sizeof why, "rank %d called %s", q, what);
            dopt__shm_publish_abort(s, DOPT_ERR_MISMATCH, q, why);
        }
        return c->error;
    }
    return DOPT_OK;
}

/* ===================================================================== ONE-SHOT ALLREDUCE

   Small messages: copy in, one barrier, every rank reduces every input in rank order. The area
   written in phase p (p = barriers so far) is read in phase p + 1 and next written in phase
   p + 3, so no second barrier is needed before the next call. */

static dopt_status dopt__shm_allreduce_oneshot(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, unsigned char *buf,
                                               size_t bytes) {
    uint64_t phase = s->epoch;
    dopt_status st;
    int q;
    if (bytes > 0) memcpy(dopt__shm_area(s, s->rank, phase), buf, bytes);
    st = dopt__shm_barrier(c, s, d);
    if (st == DOPT_OK) st = dopt__shm_check_match(c, s, d);
    if (st != DOPT_OK || bytes == 0) return st;
    /* Ask for every peer line at once: a transfer this short ends before the hardware
       prefetcher ramps up (16 KiB at 2 ranks: ~11 -> ~7.5 us). */
    for (q = 0; q < s->size; q++) {
        const unsigned char *src = dopt__shm_area(s, q, phase);
        size_t off;
        if (q != s->rank)
            for (off = 0; off < bytes; off += 64) __builtin_prefetch(src + off, 0, 3);
    }
    if (s->rank != 0) memcpy(buf, dopt__shm_area(s, 0, phase), bytes);
    for (q = 1; q < s->size; q++) dopt_reduce(buf, dopt__shm_area(s, q, phase), (size_t)d->count, d->dtype, d->op);
    return DOPT_OK;
}

/* ===================================================================== SLICED ALLREDUCE

   The message goes through in windows of chunk_bytes. Window k is copied in during phase
   e0 + k into area (e0 + k) % 3; in phase e0 + k + 1 rank r reduces slice r of it from every
   slot (rank order) into its own area and its buffer; in phase e0 + k + 2 every rank copies
   the other slices out. One barrier per window: between two barriers a rank copies out window
   k - 1, reduces window k and copies in window k + 1, each in its own area. */

/* Slice q of a window of n elements: cut at cache-line multiples so two ranks never write the
   same line; the last rank takes the remainder. */
static size_t dopt__shm_slice_start(size_t n, int q, int size, size_t es) {
    size_t align = 64 / es, lo;
    if (q >= size) return n;
    lo = (size_t)((uint64_t)n * (uint64_t)q / (uint64_t)size);
    return lo - lo % align;
}

/* Copy window k of buf into this rank's area, except this rank's own slice (only it reads it,
   and it reads it from buf). */
static void dopt__shm_window_in(dopt__shm *s, const unsigned char *win, size_t n, size_t es, uint64_t phase) {
    size_t lo = dopt__shm_slice_start(n, s->rank, s->size, es) * es;
    size_t hi = dopt__shm_slice_start(n, s->rank + 1, s->size, es) * es;
    unsigned char *area = dopt__shm_area(s, s->rank, phase);
    if (lo > 0) memcpy(area, win, lo);
    if (n * es > hi) memcpy(area + hi, win + hi, n * es - hi);
}

/* Slice r of the window, reduced in rank order into this rank's area (where the peers will copy
   it from) and into buf. */
static void dopt__shm_window_reduce(dopt__shm *s, const dopt_coll_desc *d, unsigned char *win, size_t n, size_t es,
                                    uint64_t phase) {
    size_t lo = dopt__shm_slice_start(n, s->rank, s->size, es), hi = dopt__shm_slice_start(n, s->rank + 1, s->size, es);
    unsigned char *dst = dopt__shm_area(s, s->rank, phase) + lo * es;
    int q;
    if (hi == lo) return;
    memcpy(dst, s->rank == 0 ? win + lo * es : dopt__shm_area(s, 0, phase) + lo * es, (hi - lo) * es);
    for (q = 1; q < s->size; q++) {
        const unsigned char *src = q == s->rank ? win + lo * es : dopt__shm_area(s, q, phase) + lo * es;
        dopt_reduce(dst, src, hi - lo, d->dtype, d->op);
    }
    memcpy(win + lo * es, dst, (hi - lo) * es);
}

static void dopt__shm_window_out(dopt__shm *s, unsigned char *win, size_t n, size_t es, uint64_t phase) {
    int q;
    for (q = 0; q < s->size; q++) {
        size_t lo = dopt__shm_slice_start(n, q, s->size, es) * es, hi = dopt__shm_slice_start(n, q + 1, s->size, es) * es;
        if (q != s->rank && hi > lo) memcpy(win + lo, dopt__shm_area(s, q, phase) + lo, hi - lo);
    }
}

static dopt_status dopt__shm_allreduce_sliced(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, unsigned char *buf,
                                              size_t es) {
    size_t count = (size_t)d->count, per = s->chunk / es, nwin = (count + per - 1) / per, k;
    uint64_t e0 = s->epoch;
    dopt_status st;
#define DOPT__SHM_WIN(k) (buf + (k) * per * es)
#define DOPT__SHM_WIN_N(k) ((k) + 1 < nwin ? per : count - (k) * per)
    dopt__shm_window_in(s, DOPT__SHM_WIN(0), DOPT__SHM_WIN_N(0), es, e0);
    st = dopt__shm_barrier(c, s, d);
    if (st == DOPT_OK) st = dopt__shm_check_match(c, s, d);
    for (k = 0; st == DOPT_OK && k < nwin; k++) {
        if (k > 0) dopt__shm_window_out(s, DOPT__SHM_WIN(k - 1), DOPT__SHM_WIN_N(k - 1), es, e0 + k - 1);
        dopt__shm_window_reduce(s, d, DOPT__SHM_WIN(k), DOPT__SHM_WIN_N(k), es, e0 + k);
        if (k + 1 < nwin) dopt__shm_window_in(s, DOPT__SHM_WIN(k + 1), DOPT__SHM_WIN_N(k + 1), es, e0 + k + 1);
        st = dopt__shm_step(c, s, d);
    }
    if (st == DOPT_OK) dopt__shm_window_out(s, DOPT__SHM_WIN(nwin - 1), DOPT__SHM_WIN_N(nwin - 1), es, e0 + nwin - 1);
#undef DOPT__SHM_WIN
#undef DOPT__SHM_WIN_N
    return st;
}

static dopt_status dopt__shm_allreduce(dopt_comm *c, const dopt_coll_desc *d, void *buf) {
    dopt__shm *s = (dopt__shm *)c->impl;
    size_t es = dopt_dtype_size(d->dtype), bytes = (size_t)d->count * es;
    dopt_status st;
    if (c->size == 1) return DOPT_OK;
    st = dopt__shm_begin(c, s, d);
    if (st != DOPT_OK) return st;
    if (bytes <= s->oneshot_bytes) return dopt__shm_allreduce_oneshot(c, s, d, (unsigned char *)buf, bytes);
    return dopt__shm_allreduce_sliced(c, s, d, (unsigned char *)buf, es);
}

/* ===================================================================== ALLGATHERV AND BROADCAST

   Chunk k of every block goes through its sender's area (e0 + k) % 3: written in phase e0 + k,
   copied out in phase e0 + k + 1 while the sender writes chunk k + 1. */

static dopt_status dopt__shm_allgatherv(dopt_comm *c, const dopt_coll_desc *d, const void *send, void *recv,
                                        const size_t *bytes) {
    dopt__shm *s = (dopt__shm *)c->impl;
    const unsigned char *src = (const unsigned char *)send;
    unsigned char *dst = (unsigned char *)recv;
    size_t most = 0, nch, k, off, mine = bytes[c->rank], my_off = 0;
    uint64_t e0;
    dopt_status st;
    int q;
    for (q = 0; q < c->size; q++) {
        if (bytes[q] > most) most = bytes[q];
        if (q < c->rank) my_off += bytes[q];
    }
    if (c->size > 1) {
        st = dopt__shm_begin(c, s, d);
        if (st != DOPT_OK) return st;
        nch = (most + s->chunk - 1) / s->chunk;
        e0 = s->epoch;
        if (mine > 0) memcpy(dopt__shm_area(s, c->rank, e0), src, mine < s->chunk ? mine : s->chunk);
        st = dopt__shm_barrier(c, s, d);
        if (st == DOPT_OK) st = dopt__shm_check_match(c, s, d);
        for (k = 0; st == DOPT_OK && k < nch; k++) {
            size_t at = k * s->chunk;
            for (q = 0, off = 0; q < c->size; off += bytes[q], q++)
                if (q != c->rank && bytes[q] > at)
                    memcpy(dst + off + at, dopt__shm_area(s, q, e0 + k),
                           bytes[q] - at < s->chunk ? bytes[q] - at : s->chunk);
            if (k + 1 == nch) break;
            if (mine > at + s->chunk)
                memcpy(dopt__shm_area(s, c->rank, e0 + k + 1), src + at + s->chunk,
                       mine - at - s->chunk < s->chunk ? mine - at - s->chunk : s->chunk);
            st = dopt__shm_step(c, s, d);
        }
        if (st != DOPT_OK) return st;
    }
    /* Last, so that send may be this rank's own block of recv (in place). */
    if (mine > 0 && dst + my_off != src) memmove(dst + my_off, src, mine);
    return DOPT_OK;
}

static dopt_status dopt__shm_broadcast(dopt_comm *c, const dopt_coll_desc *d, void *buf) {
    dopt__shm *s = (dopt__shm *)c->impl;
    unsigned char *p = (unsigned char *)buf;
    size_t bytes = (size_t)d->count, nch, k;
    uint64_t e0;
    int root = d->root;
    dopt_status st;
    if (c->size == 1) return DOPT_OK;
    st = dopt__shm_begin(c, s, d);
    if (st != DOPT_OK) return st;
    nch = (bytes + s->chunk - 1) / s->chunk;
    e0 = s->epoch;
    if (c->rank == root && bytes > 0) memcpy(dopt__shm_area(s, root, e0), p, bytes < s->chunk ? bytes : s->chunk);
    st = dopt__shm_barrier(c, s, d);
    if (st == DOPT_OK) st = dopt__shm_check_match(c, s, d);
    for (k = 0; st == DOPT_OK && k < nch; k++) {
        size_t at = k * s->chunk, next = at + s->chunk;
        if (c->rank != root) memcpy(p + at, dopt__shm_area(s, root, e0 + k), bytes - at < s->chunk ? bytes - at : s->chunk);
        if (k + 1 == nch) break;
        if (c->rank == root)
            memcpy(dopt__shm_area(s, root, e0 + k + 1), p + next, bytes - next < s->chunk ? bytes - next : s->chunk);
        st = dopt__shm_step(c, s, d);
    }
    return st;
}

static dopt_status dopt__shm_barrier_call(dopt_comm *c, const dopt_coll_desc *d) {
    dopt__shm *s = (dopt__shm *)c->impl;
    dopt_status st;
    if (c->size == 1) return DOPT_OK;
    st = dopt__shm_begin(c, s, d);
    if (st == DOPT_OK) st = dopt__shm_barrier(c, s, d);
    if (st == DOPT_OK) st = dopt__shm_check_match(c, s, d);
    return st;
}

/* ===================================================================== LINKS

   One ring per ordered pair of ranks (SEGMENT LAYOUT): the writer alone moves head, the reader
   alone moves tail, so neither takes a lock; head is published after the bytes (release) and
   read before them (acquire). A rank that waits on its links sleeps on its own bell, which a
   peer rings after moving head or tail or closing. A link ends in order when its writer closed
   it and the reader has read everything; it fails when its peer is found dead (its lock is free)
   or left without closing. The engine in distopt.h runs collectives over these. */

static dopt__shm_chan *dopt__shm_chan_of(const dopt__shm *s, int from, int to) {
    size_t i = (size_t)from * (size_t)(s->size - 1) + (size_t)(to < from ? to : to - 1);
    return (dopt__shm_chan *)(void *)(s->base + s->links_off + i * s->link_stride);
}

static unsigned char *dopt__shm_ring_of(dopt__shm_chan *ch) { return (unsigned char *)ch + DOPT__SHM_LINK_CTRL; }

/* n bytes into ch's ring from stream position at, or out of it: up to the ring's end, then
   from its start. */
static void dopt__shm_ring_put(const dopt__shm *s, dopt__shm_chan *ch, uint64_t at, const unsigned char *src, size_t n) {
    size_t off = (size_t)(at & (s->link_bytes - 1)), first = s->link_bytes - off < n ? s->link_bytes - off : n;
    if (n == 0) return; /* a zero-length part may have no buffer */
    memcpy(dopt__shm_ring_of(ch) + off, src, first);
    memcpy(dopt__shm_ring_of(ch), src + first, n - first);
}

static void dopt__shm_ring_get(const dopt__shm *s, dopt__shm_chan *ch, uint64_t at, unsigned char *dst, size_t n) {
    size_t off = (size_t)(at & (s->link_bytes - 1)), first = s->link_bytes - off < n ? s->link_bytes - off : n;
    if (n == 0) return; /* a zero-length part may have no buffer */
    memcpy(dst, dopt__shm_ring_of(ch) + off, first);
    memcpy(dst + first, dopt__shm_ring_of(ch), n - first);
}

static int dopt__shm_peer_gone(const dopt__shm *s, int q) {
    return s->gone[q] || __atomic_load_n(&dopt__shm_cold_of(s, q)->left, __ATOMIC_ACQUIRE);
}

/* A failure the direct collectives recorded in the segment reaches the engine as this rank's
   failure (the same status and reason, "reported by" its reporter) and a failed link. A rank
   records its failure before its links end, so a link that ends looks here first. */
static int dopt__shm_links_aborted(dopt_comm *c, dopt__shm *s, int *err) {
    if (!dopt__shm_aborted(s)) return 0;
    dopt__shm_check_abort(c, s, dopt__eng_current(c->eng));
    *err = ECONNABORTED;
    return 1;
}

/* A link that ended: reason (0 in order), unless a failure recorded in the segment says more. */
static long dopt__shm_link_end(dopt_comm *c, dopt__shm *s, int reason, int *err) {
    if (!dopt__shm_links_aborted(c, s, err)) *err = reason;
    return -1;
}

static long dopt__shm_link_send(dopt_comm *c, int peer, const dopt_iov *parts, int nparts, int *err) {
    dopt__shm *s = (dopt__shm *)c->impl;
    dopt__shm_chan *ch = dopt__shm_chan_of(s, s->rank, peer);
    uint64_t head = ch->head;
    size_t room = s->link_bytes - (size_t)(head - __atomic_load_n(&ch->tail, __ATOMIC_ACQUIRE)), sent = 0;
    int i;
    if (ch->closed || dopt__shm_peer_gone(s, peer)) return dopt__shm_link_end(c, s, EPIPE, err);
    for (i = 0; i < nparts && sent < room; i++) {
        size_t n = parts[i].len < room - sent ? parts[i].len : room - sent;
        dopt__shm_ring_put(s, ch, head + sent, (const unsigned char *)parts[i].base, n);
        sent += n;
    }
    if (sent == 0) return 0;
    __atomic_store_n(&ch->head, head + sent, __ATOMIC_RELEASE);
    dopt__shm_ring_bell(s, peer);
    return (long)sent;
}

static long dopt__shm_link_recv(dopt_comm *c, int peer, void *dst, size_t cap, int *err) {
    dopt__shm *s = (dopt__shm *)c->impl;
    dopt__shm_chan *ch = dopt__shm_chan_of(s, peer, s->rank);
    uint64_t tail = ch->tail, head = __atomic_load_n(&ch->head, __ATOMIC_ACQUIRE);
    size_t n;
    if (head == tail) {
        if (__atomic_load_n(&ch->closed, __ATOMIC_ACQUIRE)) { /* closed after its last head */
            head = __atomic_load_n(&ch->head, __ATOMIC_ACQUIRE);
            if (head == tail) return dopt__shm_link_end(c, s, 0, err);
        } else if (dopt__shm_peer_gone(s, peer)) {
            return dopt__shm_link_end(c, s, ECONNRESET, err);
        } else {
            return 0;
        }
    }
    n = (size_t)(head - tail) < cap ? (size_t)(head - tail) : cap;
    dopt__shm_ring_get(s, ch, tail, (unsigned char *)dst, n);
    __atomic_store_n(&ch->tail, tail + n, __ATOMIC_RELEASE);
    dopt__shm_ring_bell(s, peer);
    return (long)n;
}

static int dopt__shm_links_ready(const dopt__shm *s, dopt_link_poll *polls, int npolls) {
    int i, ready = 0;
    for (i = 0; i < npolls; i++) {
        int q = polls[i].peer;
        short re = 0;
        if (polls[i].events & DOPT_LINK_IN) {
            dopt__shm_chan *in = dopt__shm_chan_of(s, q, s->rank);
            if (__atomic_load_n(&in->head, __ATOMIC_ACQUIRE) != in->tail || __atomic_load_n(&in->closed, __ATOMIC_ACQUIRE) ||
                dopt__shm_peer_gone(s, q))
                re |= DOPT_LINK_IN;
        }
        if (polls[i].events & DOPT_LINK_OUT) {
            dopt__shm_chan *out = dopt__shm_chan_of(s, s->rank, q);
            if (out->head - __atomic_load_n(&out->tail, __ATOMIC_ACQUIRE) < s->link_bytes || dopt__shm_peer_gone(s, q))
                re |= DOPT_LINK_OUT;
        }
        polls[i].revents = re;
        ready += re != 0;
    }
    return ready;
}

/* A few times per second while waiting: the peers waited for that died end their links. */
static void dopt__shm_probe_links(dopt__shm *s, const dopt_link_poll *polls, int npolls, double now) {
    int i;
    if (now < s->next_probe) return;
    s->next_probe = now + DOPT__SHM_LIVENESS_MS;
    for (i = 0; i < npolls; i++)
        if (!s->gone[polls[i].peer] && dopt__shm_rank_dead(s, polls[i].peer)) s->gone[polls[i].peer] = 1;
}

static int dopt__shm_link_wait(dopt_comm *c, dopt_link_poll *polls, int npolls, int timeout_ms, int *err) {
    dopt__shm *s = (dopt__shm *)c->impl;
    dopt__shm_cold *me = dopt__shm_cold_of(s, s->rank);
    double now = dopt__now_ms(), deadline = now + (double)timeout_ms;
    int ready;
    /* What has arrived comes before a failure recorded in the segment: a peer a collective ahead
       fails only after it sent this rank everything of the collective this rank is still in, and
       the engine finishes that one (a later collective's frames, its abort included, are parked
       and not polled). A link that ended is ready too, and link_recv then reads the record. */
    if ((ready = dopt__shm_links_ready(s, polls, npolls)) > 0) return ready;
    if (dopt__shm_links_aborted(c, s, err)) return -1;
    dopt__shm_probe_links(s, polls, npolls, now);
    if (timeout_ms == 0) {
        if (!s->spin) sched_yield(); /* more ranks than processors: let the peer run */
        return dopt__shm_links_ready(s, polls, npolls);
    }
    for (;;) {
        uint32_t seen;
        double nap = DOPT__SHM_SLEEP_MS;
        if (s->next_probe - now < nap) nap = s->next_probe - now;
        if (deadline - now < nap) nap = deadline - now;
        __atomic_fetch_add(&me->asleep, 1u, __ATOMIC_SEQ_CST);
        seen = __atomic_load_n(&me->bell, __ATOMIC_SEQ_CST);
        ready = dopt__shm_links_ready(s, polls, npolls);
        if (ready == 0 && !dopt__shm_aborted(s)) dopt__shm_futex_wait(&me->bell, seen, nap);
        __atomic_fetch_sub(&me->asleep, 1u, __ATOMIC_SEQ_CST);
        if (ready > 0 || (ready = dopt__shm_links_ready(s, polls, npolls)) > 0) return ready; /* as above */
        if (dopt__shm_links_aborted(c, s, err)) return -1;
        now = dopt__now_ms();
        dopt__shm_probe_links(s, polls, npolls, now);
        if ((ready = dopt__shm_links_ready(s, polls, npolls)) > 0 || now >= deadline) return ready;
    }
}

/* Ends this rank's writing to peer. */
static void dopt__shm_close_link(dopt__shm *s, int peer) {
    __atomic_store_n(&dopt__shm_chan_of(s, s->rank, peer)->closed, 1u, __ATOMIC_RELEASE);
    dopt__shm_ring_bell(s, peer);
}

/* The engine closes its links after a failure: the failure is recorded in the segment too, for
   peers waiting in a direct collective. What is recorded is what the engine's ABORT frame says
   (its culprit, and the reason without this rank's "rank R: <collective>: " prefix), since peers
   check the segment before their links: recording this rank's whole detail made every survivor
   name the reporter's call first ("rank 1: allreduce #5 (...): rank 0: allreduce #5 (...):
   connection to rank 2 lost ...") where TCP's name the dead rank. */
static void dopt__shm_link_close(dopt_comm *c, int peer) {
    dopt__shm *s = (dopt__shm *)c->impl;
    const dopt__engine *e = c->eng;
    if (dopt__family_error(c) != DOPT_OK) {
        if (e != NULL && e->abort_len > DOPT_FRAME_BYTES) {
            char why[DOPT__SHM_REASON_MAX];
            size_t n = e->abort_len - DOPT_FRAME_BYTES < sizeof why ? e->abort_len - DOPT_FRAME_BYTES : sizeof why - 1;
            memcpy(why, e->abort_msg + DOPT_FRAME_BYTES, n);
            why[n] = '\0';
            dopt__shm_publish_abort(s, c->error, (int)dopt__get_le32(e->abort_msg + 32), why);
        } else {
            dopt__shm_publish_abort(s, c->error, s->rank, c->detail);
        }
    }
    dopt__shm_close_link(s, peer);
}

/* A rank that waits in a direct collective for rank q while q has sent it frames: q runs a
   collective of the engine (a group's) that this rank has not started, which is a mismatch,
   named from the frame's header when it is whole. DATA frames only: an ABORT reaches the segment
   as well, and a GOODBYE comes just before q leaves. */
static dopt_status dopt__shm_frames_from(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, int q) {
    dopt__peer *P = &c->eng->peers[q];
    dopt__shm_chan *ch = dopt__shm_chan_of(s, q, s->rank);
    uint64_t avail = __atomic_load_n(&ch->head, __ATOMIC_ACQUIRE) - ch->tail;
    unsigned char hdr[DOPT_FRAME_BYTES];
    char why[DOPT__SHM_REASON_MAX];
    char theirs[100], mine[100];
    dopt__frame f;
    int whole = 0;
    if (P->hi - P->lo >= DOPT_FRAME_BYTES) {
        memcpy(hdr, P->stage + P->lo, sizeof hdr);
        whole = 1;
    } else if (P->hi == P->lo) {
        if (avail == 0) return DOPT_OK;
        whole = avail >= sizeof hdr;
        if (whole) dopt__shm_ring_get(s, ch, ch->tail, hdr, sizeof hdr);
    }
    if (whole && dopt__frame_decode(hdr, &f) == NULL) {
        if (f.type != DOPT__FRAME_DATA) return DOPT_OK;
        dopt_comm_fail_mismatch(c, d, &f.desc, q);
        dopt_coll_describe(&f.desc, theirs, sizeof theirs);
        dopt_coll_describe(d, mine, sizeof mine);
        snprintf(why, sizeof why, "rank %d called %s and rank %d %s", q, theirs, s->rank, mine);
    } else {
        dopt_comm_fail(c, d, DOPT_ERR_MISMATCH, "rank %d sent data for a collective this rank has not started", q);
        snprintf(why, sizeof why, "rank %d sent rank %d data for a collective it has not started", q, s->rank);
    }
    dopt__shm_publish_abort(s, DOPT_ERR_MISMATCH, q, why);
    return c->error;
}

static dopt_status dopt__shm_check_frames(dopt_comm *c, dopt__shm *s, const dopt_coll_desc *d, int late,
                                          uint64_t target) {
    int q;
    if (s->link_bytes == 0 || c->eng == NULL) return DOPT_OK;
    for (q = late; q < s->size; q++)
        if (q != s->rank && __atomic_load_n(&dopt__shm_hot_of(s, q)->epoch, __ATOMIC_SEQ_CST) < target &&
            dopt__shm_frames_from(c, s, d, q) != DOPT_OK)
            return c->error;
    return DOPT_OK;
}

/* ===================================================================== LEAVING AND DESTROY */

/* Removes the job's name once, and only if it still names our segment. */
static void dopt__shm_unlink_if_ours(const dopt__shm *s) {
    struct stat st;
    int fd = shm_open(s->path, O_RDONLY, 0);
    if (fd < 0) return;
    if (fstat(fd, &st) == 0 && st.st_dev == s->dev && st.st_ino == s->ino) shm_unlink(s->path);
    close(fd);
}

static void dopt__shm_unlink_name(dopt__shm *s) {
    uint32_t expect = 0;
    if (s->base == NULL || !s->member) return;
    if (__atomic_compare_exchange_n(&dopt__shm_hdr(s)->unlinked, &expect, 1u, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        dopt__shm_unlink_if_ours(s);
}

/* Tells the peers this rank is gone (a failure first, if it has one they may not know). */
static void dopt__shm_leave(dopt_comm *c, dopt__shm *s) {
    if (s->left || !s->member || s->base == NULL) return;
    s->left = 1;
    if (c->error != DOPT_OK) {
        char why[DOPT__SHM_REASON_MAX];
        snprintf(why, sizeof why, "rank %d left the job after an error: %.180s", s->rank, c->detail);
        dopt__shm_publish_abort(s, DOPT_ERR_PEER_LOST, s->rank, why);
    }
    dopt__shm_unlink_name(s);
    __atomic_store_n(&dopt__shm_cold_of(s, s->rank)->left, 1u, __ATOMIC_SEQ_CST);
    dopt__shm_wake_all(s);
    dopt__shm_ring_all_bells(s);
}

static void dopt__shm_release(dopt__shm *s) {
    if (s->base != NULL) munmap(s->base, s->map_len);
    s->base = NULL;
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
}

/* Says goodbye on every link (a peer still finishing the last collective knows this rank left
   on purpose), closes them, and leaves. */
static void dopt__shm_destroy(dopt_comm *c) {
    dopt__shm *s = (dopt__shm *)c->impl;
    int q;
    if (s == NULL) return;
    if (s->link_bytes > 0 && s->member && !s->left && s->base != NULL) {
        dopt_links_goodbye(c, c->timeout_ms < 5000 ? c->timeout_ms : 5000);
        for (q = 0; q < s->size; q++)
            if (q != s->rank) dopt__shm_close_link(s, q);
    }
    dopt__shm_leave(c, s);
    dopt__shm_release(s);
    DOPT_FREE(s->children);
    DOPT_FREE(s->gone);
    DOPT_FREE(s);
    c->impl = NULL;
}

static int dopt__shm_finish(dopt_comm *comm, int status);
static dopt_status dopt__shm_shrink(dopt_comm *c, dopt_comm **next);
static dopt_status dopt__shm_grow(dopt_comm *c, dopt_comm **next);
static int dopt__shm_joiners_held(const dopt_comm *c);

/* Direct collectives (reducing straight from the peers' slots), links for groups and requests
   of the engine; every collective on the engine; or, in worlds too large for links, direct
   collectives alone. */
static const dopt_comm_vtable dopt__shm_vtable = {
    "shm", dopt__shm_allreduce, dopt__shm_allgatherv, dopt__shm_broadcast, dopt__shm_barrier_call, dopt__shm_destroy,
    sizeof(dopt_comm_vtable), DOPT_PROVIDES_ALL, dopt__shm_link_send, dopt__shm_link_recv, dopt__shm_link_wait,
    dopt__shm_link_close, NULL, dopt__shm_finish, dopt_engine_provider, dopt__shm_shrink, dopt__shm_grow,
    dopt__shm_joiners_held};
static const dopt_comm_vtable dopt__shm_engine_vtable = {
    "shm", NULL, NULL, NULL, NULL, dopt__shm_destroy, sizeof(dopt_comm_vtable), 0u,
    dopt__shm_link_send, dopt__shm_link_recv, dopt__shm_link_wait, dopt__shm_link_close, NULL, dopt__shm_finish,
    dopt_engine_provider, dopt__shm_shrink, dopt__shm_grow, dopt__shm_joiners_held};
static const dopt_comm_vtable dopt__shm_unlinked_vtable = {
    "shm", dopt__shm_allreduce, dopt__shm_allgatherv, dopt__shm_broadcast, dopt__shm_barrier_call, dopt__shm_destroy,
    sizeof(dopt_comm_vtable), DOPT_PROVIDES_ALL, NULL, NULL, NULL, NULL, NULL, dopt__shm_finish, NULL, NULL, NULL, NULL};

/* ===================================================================== CONFIGURATION */

typedef struct dopt__shm_settings {
    char name[DOPT__SHM_NAME_MAX + 1];
    int rank, size, timeout_ms, engine;
    size_t chunk;
} dopt__shm_settings;

static int dopt__shm_name_ok(const char *name) {
    size_t i, n = strlen(name);
    if (n == 0 || n > DOPT__SHM_NAME_MAX) return 0;
    for (i = 0; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
              ch == '_' || ch == '-'))
            return 0;
    }
    return 1;
}

/* The configuration with the environment and defaults filled in; why says what is wrong. */
static dopt_status dopt__shm_resolve(const dopt_shm_config *cfg, dopt__shm_settings *out, char *why, size_t cap) {
    const char *name = cfg->name ? cfg->name : cfg->env_name[0] ? cfg->env_name : NULL;
    memset(out, 0, sizeof *out);
    if (cfg->size == 0) {
        snprintf(why, cap, "size is 0: set rank and size, or fill the config with dopt_shm_config_from_env");
        return DOPT_ERR_INVALID;
    }
    out->size = cfg->size;
    out->rank = cfg->rank;
    if (out->size < 1 || out->size > DOPT__SHM_MAX_RANKS || out->rank < 0 || out->rank >= out->size) {
        snprintf(why, cap, "rank %d of world size %d: need 0 <= rank < size <= %d", out->rank, out->size,
                 DOPT__SHM_MAX_RANKS);
        return DOPT_ERR_INVALID;
    }
    if (out->size > 1 && name == NULL) {
        snprintf(why, cap, "no job name: set dopt_shm_config.name, or DOPT_SHM_NAME with dopt_shm_config_from_env");
        return DOPT_ERR_INVALID;
    }
    if (name != NULL) {
        if (!dopt__shm_name_ok(name)) {
            snprintf(why, cap, "job name \"%.40s\" must be 1..%d characters of A-Z a-z 0-9 . _ -", name, DOPT__SHM_NAME_MAX);
            return DOPT_ERR_INVALID;
        }
        snprintf(out->name, sizeof out->name, "%s", name);
    }
    out->timeout_ms = cfg->timeout_ms;
    if (out->timeout_ms < 0) {
        snprintf(why, cap, "timeout_ms %d is negative", cfg->timeout_ms);
        return DOPT_ERR_INVALID;
    }
    if (out->timeout_ms == 0) out->timeout_ms = DOPT_DEFAULT_TIMEOUT_MS;
    if (cfg->engine != 0 && cfg->engine != 1) {
        snprintf(why, cap, "engine %d is not 0 or 1", cfg->engine);
        return DOPT_ERR_INVALID;
    }
    out->engine = cfg->engine;
    if (cfg->on_peer_lost != DOPT_FAIL && cfg->on_peer_lost != DOPT_SHRINK) {
        snprintf(why, cap, "on_peer_lost is %d, not DOPT_FAIL (0) or DOPT_SHRINK (1)", cfg->on_peer_lost);
        return DOPT_ERR_INVALID;
    }
    if (cfg->on_peer_lost == DOPT_SHRINK && out->size > DOPT__SHM_SHRINK_MAX_RANKS) {
        snprintf(why, cap, "on_peer_lost = DOPT_SHRINK: shared memory's survivors agree in worlds of up to %d ranks, "
                 "this one has %d (TCP has no such limit)", DOPT__SHM_SHRINK_MAX_RANKS, out->size);
        return DOPT_ERR_INVALID;
    }
    if (cfg->min_ranks < 0 || cfg->min_ranks > out->size) {
        snprintf(why, cap, "min_ranks %d is outside 0..size (%d)", cfg->min_ranks, out->size);
        return DOPT_ERR_INVALID;
    }
    out->chunk = cfg->chunk_bytes ? cfg->chunk_bytes : DOPT__SHM_DEFAULT_CHUNK;
    if (out->chunk < DOPT__SHM_MIN_CHUNK || out->chunk > DOPT__SHM_MAX_CHUNK) {
        snprintf(why, cap, "chunk_bytes %zu outside %zu..%zu", out->chunk, DOPT__SHM_MIN_CHUNK, DOPT__SHM_MAX_CHUNK);
        return DOPT_ERR_INVALID;
    }
    return DOPT_OK;
}

static dopt_status dopt__shm_config_fail(const dopt_shm_config *cfg, dopt_status st, const char *why) {
    char msg[DOPT_DETAIL_MAX];
    if (cfg->log_fn == NULL) return st;
    snprintf(msg, sizeof msg, "shm create: %s", why);
    cfg->log_fn(cfg->log_user, DOPT_LOG_ERROR, msg);
    return st;
}

/* ===================================================================== JOINING A JOB

   The creator makes the file with O_EXCL, locks its byte, sizes it with fallocate (so a full
   /dev/shm fails here and not as SIGBUS later), writes the header and stores the magic last.
   Everyone else opens the name, waits for the magic, checks the header, and locks its own
   byte. A segment is dead when nobody holds a lock in it, when a rank that joined it has died,
   or when its job recorded a failure; a newcomer then removes the name (once: a flag in the
   header, and only if the name still points at that file) and starts again. */

static void dopt__shm_prefault(dopt__shm *s) {
    size_t off;
    for (off = 0; off < s->map_len; off += DOPT__SHM_PAGE) (void)*(volatile unsigned char *)(s->base + off);
}

static void dopt__shm_record_identity(dopt__shm *s) {
    struct stat st;
    if (fstat(s->fd, &st) == 0) {
        s->dev = st.st_dev;
        s->ino = st.st_ino;
    }
}

static void dopt__shm_close_attempt(dopt__shm *s) {
    dopt__shm_release(s);
    s->member = 0;
}

/* *exists is set when the name is taken (then nothing else happened). */
static dopt_status dopt__shm_try_create(dopt_comm *c, dopt__shm *s, int *exists) {
    dopt__shm_header *h;
    void *map;
    int err;
    *exists = 0;
    s->fd = shm_open(s->path, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (s->fd < 0) {
        if (errno == EEXIST) {
            *exists = 1;
            return DOPT_OK;
        }
        return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "cannot create shared memory %s: %s", s->path, strerror(errno));
    }
    if (dopt__shm_lock_byte(s->fd, s->rank) != 0) {
        err = errno;
        shm_unlink(s->path);
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "cannot lock %s: %s", s->path, strerror(err));
    }
    dopt__shm_record_identity(s);
    s->member = 1;
    err = posix_fallocate(s->fd, 0, (off_t)s->total);
    if (err != 0) {
        shm_unlink(s->path);
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "cannot size %s to %zu bytes: %s", s->path, s->total,
                              strerror(err));
    }
    map = mmap(NULL, s->total, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (map == MAP_FAILED) {
        err = errno;
        shm_unlink(s->path);
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "cannot map %s: %s", s->path, strerror(err));
    }
    s->base = (unsigned char *)map;
    s->map_len = s->total;
    h = dopt__shm_hdr(s);
    h->version = DOPT__SHM_VERSION;
    h->size = s->size;
    h->chunk_bytes = s->chunk;
    h->area_stride = s->stride;
    h->total_bytes = s->total;
    h->engine = (uint32_t)s->engine;
    h->creator_pid = (int32_t)getpid();
    __atomic_store_n(&h->magic, DOPT__SHM_MAGIC, __ATOMIC_RELEASE);
    return DOPT_OK;
}

/* 1 when the job in the mapped segment can never complete. */
static int dopt__shm_job_dead(const dopt__shm *s, int size) {
    int q;
    if (__atomic_load_n(dopt__shm_abort_word(s), __ATOMIC_ACQUIRE) != 0) return 1;
    if (!dopt__shm_lock_held(s->fd, 0, 0)) return 1;
    for (q = 0; q < size; q++)
        if (__atomic_load_n(&dopt__shm_cold_of(s, q)->pid, __ATOMIC_ACQUIRE) != 0 && !dopt__shm_lock_held(s->fd, q, 1))
            return 1;
    return 0;
}

/* A file that never got its header: dead if nobody holds it and it is not brand new. */
static void dopt__shm_reap_unready(dopt__shm *s, const struct stat *st) {
    if (!dopt__shm_lock_held(s->fd, 0, 0) && time(NULL) - st->st_ctime > DOPT__SHM_STALE_S) dopt__shm_unlink_if_ours(s);
}

/* *retry is set when the caller should wait a moment and start over (the segment is being
   made or being removed). */
static dopt_status dopt__shm_try_attach(dopt_comm *c, dopt__shm *s, int *retry) {
    const dopt__shm_header *h;
    struct stat st;
    void *map;
    uint32_t expect = 0;
    int err;
    *retry = 1;
    s->fd = shm_open(s->path, O_RDWR, 0);
    if (s->fd < 0) {
        if (errno == ENOENT) return DOPT_OK; /* removed meanwhile: create it */
        return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "cannot open shared memory %s: %s", s->path, strerror(errno));
    }
    dopt__shm_record_identity(s);
    if (fstat(s->fd, &st) != 0) {
        err = errno;
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "cannot stat %s: %s", s->path, strerror(err));
    }
    if ((size_t)st.st_size < DOPT__SHM_HEADER_BYTES) {
        dopt__shm_reap_unready(s, &st);
        dopt__shm_close_attempt(s);
        return DOPT_OK;
    }
    map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (map == MAP_FAILED) {
        err = errno;
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "cannot map %s: %s", s->path, strerror(err));
    }
    s->base = (unsigned char *)map;
    s->map_len = (size_t)st.st_size;
    h = dopt__shm_hdr(s);
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == 0) {
        dopt__shm_reap_unready(s, &st);
        dopt__shm_close_attempt(s);
        return DOPT_OK;
    }
    if (h->magic != DOPT__SHM_MAGIC || h->version != DOPT__SHM_VERSION) {
        if (!dopt__shm_lock_held(s->fd, 0, 0) && time(NULL) - st.st_ctime > DOPT__SHM_STALE_S) {
            dopt__shm_unlink_if_ours(s); /* left by a dead job of another release */
            dopt__shm_close_attempt(s);
            return DOPT_OK;
        }
        *retry = 0;
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_PROTOCOL, "%s is not a distopt segment of protocol version %u", s->path,
                              DOPT__SHM_VERSION);
    }
    *retry = 0;
    if (h->size < 1 || h->size > DOPT__SHM_MAX_RANKS || h->total_bytes != (uint64_t)st.st_size ||
        h->total_bytes < DOPT__SHM_HEADER_BYTES + (uint64_t)h->size * DOPT__SHM_RANK_BYTES) {
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_PROTOCOL, "%s has a damaged header", s->path);
    }
    if (__atomic_load_n(&h->reaped, __ATOMIC_ACQUIRE) || dopt__shm_job_dead(s, h->size)) {
        if (__atomic_compare_exchange_n(&dopt__shm_hdr(s)->reaped, &expect, 1u, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            dopt__shm_unlink_if_ours(s);
            dopt_comm_log(c, DOPT_LOG_WARN, "shm: removed %s, left by a job that died (creator pid %d)", s->path,
                          (int)h->creator_pid);
        }
        dopt__shm_close_attempt(s);
        *retry = 1;
        return DOPT_OK;
    }
    if (h->size != s->size || h->chunk_bytes != s->chunk) {
        int size = h->size;
        unsigned long long chunk = (unsigned long long)h->chunk_bytes;
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_INVALID,
                              "job '%s' was created for %d ranks with chunk_bytes %llu; this rank was given %d and %zu",
                              s->job, size, chunk, s->size, s->chunk);
    }
    if (h->engine != (uint32_t)s->engine) {
        int engine = (int)h->engine;
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_INVALID, "job '%s' was created with engine %d; this rank was given %d",
                              s->job, engine, s->engine);
    }
    if (h->total_bytes != s->total) {
        dopt__shm_close_attempt(s);
        return dopt_comm_fail(c, NULL, DOPT_ERR_PROTOCOL, "%s has a damaged header", s->path);
    }
    if (dopt__shm_lock_byte(s->fd, s->rank) != 0) {
        int holder = (int)dopt__shm_cold_of(s, s->rank)->pid;
        err = errno;
        dopt__shm_close_attempt(s);
        if (err == EAGAIN || err == EACCES)
            return dopt_comm_fail(c, NULL, DOPT_ERR_INVALID,
                                  "rank %d of job '%s' is already held by live process %d: is another job using this name?",
                                  s->rank, s->job, holder);
        return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "cannot lock %s: %s", s->path, strerror(err));
    }
    s->member = 1;
    return DOPT_OK;
}

/* Joined: let the mapping alone hold the locked open file, keep it out of fork children, and
   probe the peers' locks through an open file of our own that holds none. */
static dopt_status dopt__shm_keep_lock_in_mapping(dopt_comm *c, dopt__shm *s) {
    int probe = shm_open(s->path, O_RDWR, 0);
    if (probe < 0) return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "cannot reopen %s: %s", s->path, strerror(errno));
    close(s->fd);
    s->fd = probe;
    madvise(s->base, s->map_len, MADV_DONTFORK);
    return DOPT_OK;
}

static dopt_status dopt__shm_join(dopt_comm *c, dopt__shm *s) {
    double deadline = dopt__now_ms() + (double)c->timeout_ms;
    dopt_status st;
    for (;;) {
        int again = 0;
        st = dopt__shm_try_create(c, s, &again);
        if (st != DOPT_OK) return st;
        if (!again) break;
        st = dopt__shm_try_attach(c, s, &again);
        if (st != DOPT_OK) return st;
        if (!again) break;
        if (dopt__now_ms() >= deadline)
            return dopt_comm_fail(c, NULL, DOPT_ERR_TIMEOUT, "%s exists but did not become ready within %d ms", s->path,
                                  c->timeout_ms);
        dopt__shm_sleep_ms(1.0);
    }
    st = dopt__shm_keep_lock_in_mapping(c, s);
    if (st != DOPT_OK) return st;
    dopt__shm_prefault(s);
    __atomic_store_n(&dopt__shm_cold_of(s, s->rank)->pid, (int32_t)getpid(), __ATOMIC_RELEASE);
    if (__atomic_add_fetch(&dopt__shm_hdr(s)->attached, 1u, __ATOMIC_SEQ_CST) == (uint32_t)s->size)
        dopt__shm_unlink_name(s); /* complete: every rank has its mapping, the name is not needed */
    st = dopt__shm_barrier(c, s, NULL);
    if (st != DOPT_OK) dopt__shm_unlink_name(s);
    return st;
}

/* The job's rank, size, name, timeout and engine from the launch variables (distopt.h's
   dopt_launch_read) and DOPT_SHM_NAME, DOPT_TIMEOUT_MS, DOPT_SHM_ENGINE. */
DOPT_DEF dopt_status dopt_shm_config_from_env(dopt_shm_config *cfg) {
    dopt_launch_info info;
    char why[DOPT__SHM_REASON_MAX];
    const char *name = getenv("DOPT_SHM_NAME"), *engine = getenv("DOPT_SHM_ENGINE"), *lost = getenv("DOPT_ON_PEER_LOST");
    long ms = 0, min_ranks = -1, join = -1;
    if (cfg == NULL) return DOPT_ERR_INVALID;
    if (dopt__env_long("DOPT_JOIN", 0, 1, &join, why, sizeof why) < 0)
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    if (dopt_launch_read(&info, why, sizeof why) != DOPT_OK) return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    if (join == 1) { /* a restarted worker: the job it asks gives it its rank and size */
        if (info.world_size < 1) info.world_size = 1;
        if (info.rank < 0 || info.rank >= info.world_size) info.rank = 0;
    }
    if (info.world_size < 0)
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID,
                                     "DOPT_WORLD_SIZE is not set and no launcher's variables give a world size (every "
                                     "rank needs DOPT_WORLD_SIZE and DOPT_RANK, or start the job with a launcher, or "
                                     "with dopt_shm_fork)");
    if (info.rank < 0) {
        snprintf(why, sizeof why, "DOPT_RANK is not set (every rank needs its own, 0..%d)", info.world_size - 1);
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    }
    if (info.world_size > DOPT__SHM_MAX_RANKS) {
        snprintf(why, sizeof why, "a world of %d ranks (%s) is more than shared memory's %d", info.world_size,
                 info.rank_from, DOPT__SHM_MAX_RANKS);
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    }
    if (info.local_size > 0 && info.local_size < info.world_size) {
        snprintf(why, sizeof why, "shared memory joins the ranks of one host, but %s's variables put %d of the %d "
                 "ranks on this one: use the TCP or MPI transport", info.launcher, info.local_size, info.world_size);
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    }
    if (dopt__env_long("DOPT_TIMEOUT_MS", 1, INT_MAX, &ms, why, sizeof why) < 0 ||
        dopt__env_long("DOPT_MIN_RANKS", 0, INT_MAX, &min_ranks, why, sizeof why) < 0)
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    if (lost && *lost && strcmp(lost, "fail") && strcmp(lost, "shrink")) {
        snprintf(why, sizeof why, "DOPT_ON_PEER_LOST=\"%.40s\" is not fail or shrink", lost);
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    }
    if (name && *name && strlen(name) > DOPT_SHM_NAME_MAX) {
        snprintf(why, sizeof why, "DOPT_SHM_NAME is %lu characters long, more than %d", (unsigned long)strlen(name),
                 DOPT_SHM_NAME_MAX);
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    }
    if (engine && *engine && strcmp(engine, "0") && strcmp(engine, "1")) {
        snprintf(why, sizeof why, "DOPT_SHM_ENGINE=\"%.40s\" is not 0 or 1", engine);
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    }
    snprintf(cfg->env_name, sizeof cfg->env_name, "%s", name && *name ? name : info.job);
    cfg->name = NULL;
    cfg->rank = info.rank;
    cfg->size = info.world_size;
    if (ms > 0) cfg->timeout_ms = (int)ms;
    if (engine && *engine) cfg->engine = *engine == '1';
    if (lost && *lost) cfg->on_peer_lost = strcmp(lost, "shrink") == 0 ? DOPT_SHRINK : DOPT_FAIL;
    if (min_ranks >= 0) cfg->min_ranks = (int)min_ranks; /* set: dopt__env_long wrote it */
    if (join >= 0) cfg->join = (int)join;
    return DOPT_OK;
}

/* dopt_shm_create, and a shrink's or a grow's: watch says where a rank lost before it joins is
   seen (the join then fails at once), family the name the job started under (NULL: cfg's). */
static dopt_status dopt__shm_create(dopt_comm **out, const dopt_shm_config *cfg, const dopt__shm_watch *watch,
                                    const char *family) {
    dopt_shm_config from_env;
    dopt__shm_settings set;
    dopt__shm *s;
    dopt_comm *c = NULL;
    char why[DOPT__SHM_REASON_MAX];
    dopt_status st;
    if (cfg == NULL) { /* NULL asks for the environment's configuration */
        memset(&from_env, 0, sizeof from_env);
        st = dopt_shm_config_from_env(&from_env);
        if (st != DOPT_OK) return st;
        cfg = &from_env;
    }
    if (out == NULL) return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, "out is NULL");
    *out = NULL;
    st = dopt__shm_resolve(cfg, &set, why, sizeof why);
    if (st != DOPT_OK) return dopt__shm_config_fail(cfg, st, why);
    s = (dopt__shm *)DOPT_MALLOC(sizeof *s);
    if (s == NULL) return dopt__shm_config_fail(cfg, DOPT_ERR_NOMEM, "out of memory");
    memset(s, 0, sizeof *s);
    s->fd = -1;
    s->rank = set.rank;
    s->size = set.size;
    s->chunk = set.chunk;
    snprintf(s->path, sizeof s->path, "/dopt.%s", set.name);
    s->job = s->path + 6;
    s->spin = set.size <= dopt__shm_cpus();
    s->engine = set.engine;
    s->watch = watch;
    snprintf(s->family, sizeof s->family, "%s", family ? family : set.name);
    dopt__shm_geometry(s);
    s->gone = (unsigned char *)DOPT_MALLOC((size_t)set.size);
    if (s->gone != NULL) memset(s->gone, 0, (size_t)set.size);
    st = s->gone == NULL ? DOPT_ERR_NOMEM
                         : dopt_comm_new(&c, set.rank, set.size,
                                         s->link_bytes == 0 ? &dopt__shm_unlinked_vtable
                                         : s->engine        ? &dopt__shm_engine_vtable
                                                            : &dopt__shm_vtable,
                                         s);
    if (st != DOPT_OK) {
        DOPT_FREE(s->gone);
        DOPT_FREE(s);
        return dopt__shm_config_fail(cfg, st, "out of memory");
    }
    c->timeout_ms = set.timeout_ms;
    c->on_peer_lost = cfg->on_peer_lost;
    c->min_ranks = cfg->min_ranks;
    dopt_comm_set_log(c, cfg->log_fn, cfg->log_user);
    if (set.size > 1) {
        st = dopt__shm_join(c, s);
        s->watch = NULL; /* the caller's */
        if (st != DOPT_OK) {
            dopt_comm_destroy(c);
            return st;
        }
    }
    dopt_comm_set_job(c, s->job, strlen(s->job)); /* the flight recorder's file */
    dopt_comm_log(c, DOPT_LOG_INFO, "shm rank %d of %d: job '%s', %zu bytes mapped, chunk %zu, %s", set.rank, set.size,
                  s->job, s->map_len, s->chunk, s->spin ? "spin then sleep" : "sleep (more ranks than cpus)");
    if (set.rank == 0) dopt_comm_set_host(c, set.size, dopt__shm_cpus()); /* one warning per job is enough */
    else c->local_ranks = set.size;
    *out = c;
    return DOPT_OK;
}

static dopt_status dopt__shm_ask_to_join(dopt_comm **out, const dopt_shm_config *cfg);

DOPT_DEF dopt_status dopt_shm_create(dopt_comm **out, const dopt_shm_config *cfg) {
    dopt_shm_config from_env;
    if (cfg == NULL) { /* NULL asks for the environment's configuration */
        dopt_status st;
        memset(&from_env, 0, sizeof from_env);
        st = dopt_shm_config_from_env(&from_env);
        if (st != DOPT_OK) return st;
        cfg = &from_env;
    }
    if (cfg->join) return dopt__shm_ask_to_join(out, cfg);
    return dopt__shm_create(out, cfg, NULL, NULL);
}

/* ===================================================================== SHRINK: THE SURVIVORS AGREE

   Every survivor of a failed DOPT_SHRINK job says in the failed job's segment that it is in the
   agreement (its cold block's shrinking = 1 + attempt) and waits, sleeping on the job's futex,
   until every rank of the last decision (all ranks at the first attempt) is in it, dead (its
   lock free, its pid gone) or left; or until timeout_ms, after which the silent ones are taken
   for lost. The first to get there writes the set of ranks in the agreement into the attempt's
   decision word with a compare-and-swap; every survivor reads the one that won, so all end with
   the same members whoever decides, and a rank that dies during the wait is simply not in it.
   Then the members form a new job of their own, named from the job's first name, the new epoch
   and the attempt (<name>.s<epoch>, then .s<epoch>-<attempt>), ranked in their old order. A
   member lost after the decision, before it joins the new job, fails every member's join at
   once (the join watches the failed job's locks for members that have not joined): they agree
   again, without it, at the next attempt, in a job of the next name. */

static uint64_t *dopt__shm_decision(const dopt__shm *s, int attempt) {
    return (uint64_t *)(void *)(s->base + DOPT__SHM_OFF_SHRINK) + attempt;
}

static int dopt__shm_popcount(uint64_t x) {
    int n = 0;
    for (; x; x &= x - 1) n++;
    return n;
}

/* The members decided at this attempt (among those of the decision before, `before`). */
static uint64_t dopt__shm_agree(dopt_comm *c, dopt__shm *s, int attempt, uint64_t before) {
    uint64_t *word = dopt__shm_decision(s, attempt);
    dopt__shm_sync *sync = dopt__shm_sync_of(s);
    double deadline = dopt__now_ms() + (double)c->timeout_ms;
    __atomic_store_n(&dopt__shm_cold_of(s, s->rank)->shrinking, (uint32_t)attempt + 1u, __ATOMIC_SEQ_CST);
    dopt__shm_wake_all(s);
    for (;;) {
        uint64_t w = __atomic_load_n(word, __ATOMIC_ACQUIRE), in = (uint64_t)1 << s->rank, expect = 0;
        uint32_t seen = __atomic_load_n(&sync->wake, __ATOMIC_SEQ_CST);
        int q, pending = 0;
        if (w != 0) return w;
        for (q = 0; q < s->size; q++) {
            dopt__shm_cold *cold = dopt__shm_cold_of(s, q);
            if (q == s->rank || !((before >> q) & 1u)) continue;
            if (__atomic_load_n(&cold->shrinking, __ATOMIC_ACQUIRE) > (uint32_t)attempt)
                in |= (uint64_t)1 << q;
            else if (!__atomic_load_n(&cold->left, __ATOMIC_ACQUIRE) && !dopt__shm_rank_dead(s, q))
                pending++;
        }
        if (pending == 0 || dopt__now_ms() >= deadline) {
            if (__atomic_compare_exchange_n(word, &expect, in, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                dopt__shm_wake_all(s);
                return in;
            }
            return expect; /* another survivor decided first */
        }
        dopt__shm_futex_wait(&sync->wake, seen, DOPT__SHM_SLEEP_MS);
    }
}

static void dopt__shm_ranks_str(uint64_t set, int n, char *out, size_t cap) {
    size_t used = 0;
    int r;
    out[0] = '\0';
    for (r = 0; r < n && used + 16 < cap; r++)
        if ((set >> r) & 1u) used += (size_t)snprintf(out + used, cap - used, "%s%d", used ? ", " : "", r);
}

/* What the job's next communicator (a shrink's or a grow's) takes over from c: the epoch, a fork
   job's children (dopt_comm_finish ends the new one as it would have the old), the progress thread. */
static void dopt__shm_carry_over(dopt_comm *c, dopt_comm *c2) {
    dopt__shm *s = (dopt__shm *)c->impl, *s2 = (dopt__shm *)c2->impl;
    c2->epoch = c->epoch + 1;
    s2->fork_child = s->fork_child;
    s2->children = s->children, s2->nchildren = s->nchildren;
    s->children = NULL, s->nchildren = 0;
#ifdef DOPT__THREADS
    if (c->eng && c->eng->threaded && c2->eng) (void)dopt_comm_set_progress_thread(c2, c->eng->interval_us);
#endif
}

static dopt_status dopt__shm_shrink(dopt_comm *c, dopt_comm **next) {
    dopt__shm *s = (dopt__shm *)c->impl;
    uint64_t before = s->size >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << s->size) - 1;
    int attempt, me = s->rank;
    char ranks[256], gone[256];
    if (s->base == NULL || !s->member)
        return dopt__shrink_fail(c, DOPT_ERR_INVALID, "this rank never joined its job");
    for (attempt = 0; attempt < DOPT__SHM_SHRINK_TRIES; attempt++) {
        uint64_t members = dopt__shm_agree(c, s, attempt, before);
        int m = dopt__shm_popcount(members), q, k;
        int map[DOPT__SHM_SHRINK_MAX_RANKS];
        dopt_shm_config cfg;
        dopt_comm *c2 = NULL;
        dopt_status st;
        dopt__shm_ranks_str(members, s->size, ranks, sizeof ranks);
        dopt__shm_ranks_str(~members, s->size, gone, sizeof gone);
        dopt_comm_log(c, DOPT_LOG_DEBUG, "rank %d: dopt_comm_shrink: agreed on ranks %s (attempt %d)", me, ranks,
                      attempt + 1);
        if (!((members >> me) & 1u))
            return dopt__shrink_fail(c, DOPT_ERR_PEER_LOST,
                                         "the survivors left this rank out (they agreed on ranks %s: this rank was "
                                         "taken for lost, later than timeout_ms); end this process, or restart it",
                                         ranks);
        if (m < c->min_ranks)
            return dopt__shrink_fail(c, DOPT_ERR_PEER_LOST,
                                         "%d of %d ranks survive (ranks %s are gone), fewer than min_ranks %d: the job "
                                         "cannot go on", m, s->size, gone, c->min_ranks);
        for (q = 0, k = 0; q < s->size; q++)
            if ((members >> q) & 1u) map[k++] = q;
        memset(&cfg, 0, sizeof cfg);
        snprintf(cfg.env_name, sizeof cfg.env_name, attempt ? "%.180s.s%u-%d" : "%.180s.s%u", s->family,
                 (unsigned)c->epoch + 1u, attempt);
        for (k = 0; map[k] != me; k++) continue;
        cfg.rank = k;
        cfg.size = m;
        cfg.timeout_ms = c->timeout_ms;
        cfg.chunk_bytes = s->chunk;
        cfg.engine = s->engine;
        cfg.log_fn = c->log_fn;
        cfg.log_user = c->log_user;
        cfg.on_peer_lost = DOPT_SHRINK;
        cfg.min_ranks = c->min_ranks;
        {
            dopt__shm_watch w = {NULL, NULL, NULL, -1, NULL, 0};
            w.job = s, w.rank = map;
            st = dopt__shm_create(&c2, &cfg, &w, s->family);
        }
        if (st == DOPT_OK) {
            dopt__shm_carry_over(c, c2);
            dopt_comm_log(c2, DOPT_LOG_INFO, "shm rank %d of %d (rank %d of %d before): ranks %s left out, job '%s', "
                          "epoch %u", k, m, me, s->size, gone, cfg.env_name, (unsigned)c2->epoch);
            *next = c2;
            return DOPT_OK;
        }
        if (st != DOPT_ERR_PEER_LOST)
            return dopt__shrink_fail(c, st, "the survivors' job '%s' did not form (%s; its log line says why)",
                                         cfg.env_name, dopt_status_str(st));
        before = members; /* a member was lost before it joined: agree again without it */
    }
    return dopt__shrink_fail(c, DOPT_ERR_PEER_LOST,
                                 "members kept being lost while the survivors formed their job (%d attempts); the last "
                                 "agreed on ranks %s", DOPT__SHM_SHRINK_TRIES, ranks);
}

/* ===================================================================== GROW: TAKING A WORKER BACK

   A restarted worker (join = 1) asks through the job's join box, a small shared-memory file
   named from the job's first name (/dev/shm/dopt.<name>+join, mode 0600; '+' is not allowed in
   a job name, so it never meets a job's segment). The box has DOPT__SHM_BOX_SLOTS slots; a
   joiner takes one by locking its byte after the box (an OFD lock: free again when the joiner
   dies, which is how the members see it is gone), then publishes a ticket and "waiting" in
   the slot's one word. Every box is all zeros when made, so whoever comes first makes it and
   nobody initialises it. A member's dopt_comm_joiners_held reads the box (one shm_open, ENOENT
   while nobody asks). dopt_comm_grow: the members allreduce (min) every slot's ticket and its
   negation over the communicator, so a slot comes in only when every member saw the same
   waiting ticket; one member (a compare-and-swap from waiting to taking) writes each joiner's
   admission (the new job's name, its rank and size, the members' settings) and marks it
   admitted; everyone, joiners included, then forms the grown job <name>.g<epoch>-<ticket>
   with dopt_shm_create's own join, the joiners ranked after the members in slot order. The
   members watch the joiners' slot locks while they wait (a joiner lost then fails the join at
   once), the joiner holds its slot until it has joined, then frees it, and removes the box
   when no other slot is held (taking a lock over all slots first, so that a joiner arriving
   meanwhile finds the box gone and makes a new one). */

typedef struct dopt__shm_slot {
    uint64_t word;       /* ticket << 4 | state: 0 free, 1 waiting, 2 taking, 3 admitted */
    int32_t pid;         /* the joiner's */
    int32_t rank, size;  /* admission: its rank in the grown job and the job's size */
    int32_t grown_from, timeout_ms, min_ranks, engine;
    uint32_t epoch;
    uint64_t chunk;
    char name[DOPT__SHM_NAME_MAX + 1]; /* the grown job's name */
} dopt__shm_slot;

typedef struct dopt__shm_box {
    uint32_t wake;       /* futex word: bumped when a slot is admitted */
    uint32_t pad;
    uint64_t tickets;    /* the last ticket handed out */
    dopt__shm_slot slot[DOPT__SHM_BOX_SLOTS];
} dopt__shm_box;

enum {
    DOPT__SHM_SLOT_FREE = 0,
    DOPT__SHM_SLOT_WAITING = 1,
    DOPT__SHM_SLOT_TAKING = 2,
    DOPT__SHM_SLOT_ADMITTED = 3,
    DOPT__SHM_SLOT_REFUSED = 4 /* the members gave up the grown job: ask again */
};

#define DOPT__SHM_SLOT_STATE(w) ((int)((w) & 15u))
#define DOPT__SHM_SLOT_TICKET(w) ((w) >> 4)

/* 1 when the joiner admitted in slot is lost (its lock free, or the slot taken by another),
   or, on the joiner itself (own), when the members gave up (refused). */
static int dopt__shm_box_gone(const dopt__shm_watch *w, int slot) {
    const dopt__shm_box *b = (const dopt__shm_box *)w->box;
    uint64_t word = __atomic_load_n(&b->slot[slot].word, __ATOMIC_ACQUIRE);
    if (DOPT__SHM_SLOT_TICKET(word) != (uint64_t)w->ticket[slot] || DOPT__SHM_SLOT_STATE(word) == DOPT__SHM_SLOT_REFUSED)
        return 1;
    return !w->own && !dopt__shm_lock_held(w->box_fd, (off_t)DOPT__SHM_BOX_BYTES + slot, 1);
}

static void dopt__shm_box_path(const char *family, char *out, size_t cap) { snprintf(out, cap, "/dopt.%s+join", family); }

/* Opens (create: or makes) the job's join box and maps it; NULL when there is none (or it is
   not sized yet: a joiner is making it). */
static dopt__shm_box *dopt__shm_box_open(const char *family, int create, int *fd_out) {
    char path[DOPT__SHM_NAME_MAX + 16];
    struct stat st;
    void *map;
    int fd;
    dopt__shm_box_path(family, path, sizeof path);
    *fd_out = -1;
    fd = shm_open(path, create ? O_RDWR | O_CREAT : O_RDWR, 0600);
    if (fd < 0) return NULL;
    if (fstat(fd, &st) != 0 || ((size_t)st.st_size < DOPT__SHM_BOX_BYTES &&
                                (!create || ftruncate(fd, (off_t)DOPT__SHM_BOX_BYTES) != 0))) {
        close(fd);
        return NULL;
    }
    map = mmap(NULL, DOPT__SHM_BOX_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        close(fd);
        return NULL;
    }
    *fd_out = fd;
    return (dopt__shm_box *)map;
}

static void dopt__shm_box_close(dopt__shm_box *b, int fd) {
    if (b != NULL) munmap((void *)b, DOPT__SHM_BOX_BYTES);
    if (fd >= 0) close(fd);
}

/* The ticket of slot k when a live joiner waits in it, else 0. */
static uint64_t dopt__shm_box_waiting(const dopt__shm_box *b, int fd, int k) {
    uint64_t w = __atomic_load_n(&b->slot[k].word, __ATOMIC_ACQUIRE);
    if (DOPT__SHM_SLOT_STATE(w) != DOPT__SHM_SLOT_WAITING) return 0;
    return dopt__shm_lock_held(fd, (off_t)DOPT__SHM_BOX_BYTES + k, 1) ? DOPT__SHM_SLOT_TICKET(w) : 0;
}

static int dopt__shm_joiners_held(const dopt_comm *c) {
    const dopt__shm *s = (const dopt__shm *)c->impl;
    dopt__shm_box *b;
    int fd, k, n = 0;
    if (s == NULL || c->on_peer_lost != DOPT_SHRINK || c->error != DOPT_OK) return 0;
    b = dopt__shm_box_open(s->family, 0, &fd);
    if (b == NULL) return 0;
    for (k = 0; k < DOPT__SHM_BOX_SLOTS; k++) n += dopt__shm_box_waiting(b, fd, k) != 0;
    dopt__shm_box_close(b, fd);
    return n;
}

/* A member of a failed grow: a member lost meanwhile fails c (then shrink it); otherwise the
   joiners did not make it and c goes on as it was. */
static dopt_status dopt__shm_grow_failed(dopt_comm *c, dopt__shm *s, dopt_status st, const char *job) {
    int q;
    for (q = 0; q < s->size; q++) {
        if (q == s->rank) continue;
        if (__atomic_load_n(&dopt__shm_cold_of(s, q)->left, __ATOMIC_ACQUIRE) || dopt__shm_rank_dead(s, q))
            return dopt__shm_fail(c, s, NULL, DOPT_ERR_PEER_LOST, q,
                                  "rank %d (pid %d) was lost while the joiners came in (job '%s'): shrink", q,
                                  (int)dopt__shm_cold_of(s, q)->pid, job);
    }
    dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: dopt_comm_grow: the grown job '%s' did not form (%s): the job goes on "
                  "as it was, and a joiner still alive asks again", s->rank, job, dopt_status_str(st));
    return DOPT_OK;
}

static dopt_status dopt__shm_grow(dopt_comm *c, dopt_comm **next) {
    dopt__shm *s = (dopt__shm *)c->impl;
    int64_t t[2 * DOPT__SHM_BOX_SLOTS];
    int map[DOPT__SHM_SHRINK_MAX_RANKS];
    uint64_t first = 0;
    dopt__shm_box *b;
    dopt_shm_config cfg;
    dopt_comm *c2 = NULL;
    dopt_status st;
    int fd, k, m = s->size;
    b = dopt__shm_box_open(s->family, 0, &fd);
    for (k = 0; k < DOPT__SHM_BOX_SLOTS; k++) {
        t[k] = b ? (int64_t)dopt__shm_box_waiting(b, fd, k) : 0;
        t[DOPT__SHM_BOX_SLOTS + k] = -t[k];
    }
    st = dopt_allreduce(c, t, 2 * DOPT__SHM_BOX_SLOTS, DOPT_I64, DOPT_MIN);
    if (st != DOPT_OK) {
        dopt__shm_box_close(b, fd);
        return st; /* c failed: shrink it */
    }
    for (k = 0; k < s->size; k++) map[k] = k;
    memset(&cfg, 0, sizeof cfg);
    for (k = 0; k < DOPT__SHM_BOX_SLOTS && m < DOPT__SHM_SHRINK_MAX_RANKS; k++)
        if (t[k] != 0 && t[k] == -t[DOPT__SHM_BOX_SLOTS + k]) { /* every member saw this ticket waiting */
            if (first == 0) first = (uint64_t)t[k];
            map[m++] = -1 - k;
        }
    if (m == s->size || b == NULL) {
        dopt__shm_box_close(b, fd);
        return DOPT_OK; /* nobody held by every member */
    }
    snprintf(cfg.env_name, sizeof cfg.env_name, "%.160s.g%u-%llu", s->family, (unsigned)c->epoch + 1u,
             (unsigned long long)first);
    dopt_comm_log(c, DOPT_LOG_DEBUG, "rank %d: dopt_comm_grow: every member saw %d joiner(s): forming job '%s'",
                  s->rank, m - s->size, cfg.env_name);
    for (k = s->size; k < m; k++) { /* the first member there writes each joiner's admission */
        dopt__shm_slot *sl = &b->slot[-1 - map[k]];
        uint64_t ticket = (uint64_t)t[-1 - map[k]], expect = ticket << 4 | DOPT__SHM_SLOT_WAITING;
        if (!__atomic_compare_exchange_n(&sl->word, &expect, ticket << 4 | DOPT__SHM_SLOT_TAKING, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST))
            continue;
        sl->rank = k, sl->size = m, sl->grown_from = s->size, sl->timeout_ms = c->timeout_ms;
        sl->min_ranks = c->min_ranks, sl->engine = s->engine, sl->epoch = c->epoch + 1u, sl->chunk = s->chunk;
        snprintf(sl->name, sizeof sl->name, "%s", cfg.env_name);
        __atomic_store_n(&sl->word, ticket << 4 | DOPT__SHM_SLOT_ADMITTED, __ATOMIC_RELEASE);
        __atomic_add_fetch(&b->wake, 1u, __ATOMIC_SEQ_CST);
        dopt__shm_futex_wake_all(&b->wake);
    }
    cfg.rank = s->rank, cfg.size = m, cfg.timeout_ms = c->timeout_ms, cfg.chunk_bytes = s->chunk;
    cfg.engine = s->engine, cfg.log_fn = c->log_fn, cfg.log_user = c->log_user;
    cfg.on_peer_lost = DOPT_SHRINK, cfg.min_ranks = c->min_ranks;
    {
        dopt__shm_watch w = {NULL, NULL, NULL, -1, NULL, 0};
        w.job = s, w.rank = map, w.box = b, w.box_fd = fd, w.ticket = t;
        st = dopt__shm_create(&c2, &cfg, &w, s->family);
    }
    if (st != DOPT_OK) { /* the joiners admitted (or being admitted by a member now lost) ask again */
        for (k = s->size; k < m; k++) {
            uint64_t ticket = (uint64_t)t[-1 - map[k]], *word = &b->slot[-1 - map[k]].word;
            uint64_t expect = ticket << 4 | DOPT__SHM_SLOT_ADMITTED;
            if (!__atomic_compare_exchange_n(word, &expect, ticket << 4 | DOPT__SHM_SLOT_REFUSED, 0, __ATOMIC_SEQ_CST,
                                             __ATOMIC_SEQ_CST)) {
                expect = ticket << 4 | DOPT__SHM_SLOT_TAKING;
                (void)__atomic_compare_exchange_n(word, &expect, ticket << 4 | DOPT__SHM_SLOT_REFUSED, 0,
                                                  __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
            }
        }
        __atomic_add_fetch(&b->wake, 1u, __ATOMIC_SEQ_CST);
        dopt__shm_futex_wake_all(&b->wake);
    }
    dopt__shm_box_close(b, fd);
    if (st != DOPT_OK) return dopt__shm_grow_failed(c, s, st, cfg.env_name);
    dopt__shm_carry_over(c, c2);
    c2->grown_from = s->size;
    dopt_comm_log(c2, DOPT_LOG_INFO, "shm rank %d of %d (of %d before): %d joiner(s) taken in, job '%s', epoch %u",
                  s->rank, m, s->size, m - s->size, cfg.env_name, (unsigned)c2->epoch);
    *next = c2;
    return DOPT_OK;
}

/* The joiner's side: a slot, a ticket, the wait for an admission, the grown job's join; again
   (a new ticket) when the grown job did not form, until timeout_ms. */
static dopt_status dopt__shm_ask_to_join(dopt_comm **out, const dopt_shm_config *cfg) {
    const char *name = cfg->name ? cfg->name : cfg->env_name[0] ? cfg->env_name : NULL;
    int timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : DOPT_DEFAULT_TIMEOUT_MS, tries = 0;
    double deadline = dopt__now_ms() + (double)timeout_ms;
    char why[DOPT_DETAIL_MAX - 16];
    dopt_status last = DOPT_ERR_TIMEOUT;
    if (out == NULL) return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (name == NULL || !dopt__shm_name_ok(name)) {
        snprintf(why, sizeof why, "join: the job's name (dopt_shm_config.name or DOPT_SHM_NAME) is %s",
                 name ? "not 1..200 characters of A-Z a-z 0-9 . _ -" : "not set");
        return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, why);
    }
    if (cfg->timeout_ms < 0) return dopt__shm_config_fail(cfg, DOPT_ERR_INVALID, "join: timeout_ms is negative");
    while (dopt__now_ms() < deadline) {
        char path[DOPT__SHM_NAME_MAX + 16];
        struct stat st1, st2;
        dopt__shm_box *b;
        dopt__shm_slot *sl = NULL;
        dopt_shm_config grown;
        uint64_t ticket, w = 0;
        int fd, k, fd2;
        dopt_comm *c = NULL;
        dopt_status st;
        b = dopt__shm_box_open(name, 1, &fd);
        if (b == NULL) {
            snprintf(why, sizeof why, "join: cannot make the join box of job '%.100s' in /dev/shm: %s", name, strerror(errno));
            return dopt__shm_config_fail(cfg, DOPT_ERR_IO, why);
        }
        for (k = 0; k < DOPT__SHM_BOX_SLOTS; k++)
            if (dopt__shm_lock_range(fd, (off_t)DOPT__SHM_BOX_BYTES + k, 1, F_WRLCK) == 0) break;
        dopt__shm_box_path(name, path, sizeof path);
        fd2 = shm_open(path, O_RDONLY, 0); /* the box a slot was taken in must still be the job's */
        if (k == DOPT__SHM_BOX_SLOTS || fd2 < 0 || fstat(fd, &st1) != 0 || fstat(fd2, &st2) != 0 ||
            st1.st_ino != st2.st_ino || st1.st_dev != st2.st_dev) {
            if (fd2 >= 0) close(fd2);
            dopt__shm_box_close(b, fd); /* every slot taken, or the box was being removed: again */
            dopt__shm_sleep_ms(k == DOPT__SHM_BOX_SLOTS ? 20.0 : 1.0);
            continue;
        }
        close(fd2);
        sl = &b->slot[k];
        ticket = __atomic_add_fetch(&b->tickets, 1u, __ATOMIC_SEQ_CST);
        __atomic_store_n(&sl->pid, (int32_t)getpid(), __ATOMIC_RELAXED);
        __atomic_store_n(&sl->word, ticket << 4 | DOPT__SHM_SLOT_WAITING, __ATOMIC_RELEASE);
        if (cfg->log_fn && tries++ == 0) {
            snprintf(why, sizeof why, "shm: asking job '%.100s' to take this process in (slot %d, ticket %llu)", name, k,
                     (unsigned long long)ticket);
            cfg->log_fn(cfg->log_user, DOPT_LOG_INFO, why);
        }
        while (dopt__now_ms() < deadline) {
            uint32_t seen = __atomic_load_n(&b->wake, __ATOMIC_SEQ_CST);
            w = __atomic_load_n(&sl->word, __ATOMIC_ACQUIRE);
            if (w == (ticket << 4 | DOPT__SHM_SLOT_ADMITTED) || w == (ticket << 4 | DOPT__SHM_SLOT_REFUSED)) break;
            dopt__shm_futex_wait(&b->wake, seen, DOPT__SHM_SLEEP_MS);
        }
        if (w == (ticket << 4 | DOPT__SHM_SLOT_ADMITTED)) {
            memset(&grown, 0, sizeof grown);
            snprintf(grown.env_name, sizeof grown.env_name, "%s", sl->name);
            grown.rank = sl->rank, grown.size = sl->size, grown.timeout_ms = sl->timeout_ms;
            grown.chunk_bytes = (size_t)sl->chunk, grown.engine = sl->engine, grown.min_ranks = sl->min_ranks;
            grown.on_peer_lost = DOPT_SHRINK, grown.log_fn = cfg->log_fn, grown.log_user = cfg->log_user;
            int64_t tickets[DOPT__SHM_BOX_SLOTS] = {0};
            int watch_rank[DOPT__SHM_SHRINK_MAX_RANKS], q;
            dopt__shm_watch wa = {NULL, NULL, NULL, -1, NULL, 1};
            for (q = 0; q < DOPT__SHM_SHRINK_MAX_RANKS; q++) watch_rank[q] = -1 - k;
            tickets[k] = (int64_t)ticket;
            wa.rank = watch_rank, wa.box = b, wa.box_fd = fd, wa.ticket = tickets;
            st = dopt__shm_create(&c, &grown, &wa, name);
            if (st == DOPT_OK) c->epoch = sl->epoch, c->grown_from = sl->grown_from;
        } else {
            st = w == (ticket << 4 | DOPT__SHM_SLOT_REFUSED) ? DOPT_ERR_PEER_LOST : DOPT_ERR_TIMEOUT;
        }
        /* free the slot, then remove the box if no other joiner holds one */
        __atomic_store_n(&sl->word, (uint64_t)DOPT__SHM_SLOT_FREE, __ATOMIC_RELEASE);
        (void)dopt__shm_lock_range(fd, (off_t)DOPT__SHM_BOX_BYTES + k, 1, F_UNLCK);
        if (dopt__shm_lock_range(fd, (off_t)DOPT__SHM_BOX_BYTES, DOPT__SHM_BOX_SLOTS, F_WRLCK) == 0) {
            fd2 = shm_open(path, O_RDONLY, 0);
            if (fd2 >= 0 && fstat(fd2, &st2) == 0 && st1.st_ino == st2.st_ino && st1.st_dev == st2.st_dev)
                shm_unlink(path);
            if (fd2 >= 0) close(fd2);
        }
        dopt__shm_box_close(b, fd);
        if (st == DOPT_OK) {
            dopt_comm_log(c, DOPT_LOG_INFO, "shm: taken into job '%s' as rank %d of %d (epoch %u)", name, c->rank,
                          c->size, (unsigned)c->epoch);
            *out = c;
            return DOPT_OK;
        }
        last = st;
        if (st != DOPT_ERR_PEER_LOST && st != DOPT_ERR_TIMEOUT) return st; /* the create said why */
    }
    snprintf(why, sizeof why, "join: no member of job '%.100s' took this process in within %d ms (%s; %d asks): is the job "
             "running with on_peer_lost = DOPT_SHRINK (DOPT_ON_PEER_LOST=shrink), and does it call dopt_comm_grow "
             "(localsgd.h's elastic driver does, at every round's end)?", name, timeout_ms, dopt_status_str(last), tries);
    return dopt__shm_config_fail(cfg, DOPT_ERR_TIMEOUT, why);
}

/* ===================================================================== FORK HELPER */

static void dopt__shm_unique_name(char *out, size_t cap) {
    struct timespec rt, mono;
    clock_gettime(CLOCK_REALTIME, &rt);
    clock_gettime(CLOCK_MONOTONIC, &mono);
    snprintf(out, cap, "fork-%ld-%llx-%llx", (long)getpid(),
             (unsigned long long)rt.tv_sec * 1000000000ull + (unsigned long long)rt.tv_nsec,
             (unsigned long long)mono.tv_nsec);
}

static void dopt__shm_kill_children(pid_t *children, int n) {
    int i;
    for (i = 0; i < n; i++) kill(children[i], SIGKILL);
    for (i = 0; i < n; i++)
        while (waitpid(children[i], NULL, 0) < 0 && errno == EINTR) {
        }
}

/* After killing a failed job's children: remove its segment if nobody holds it any more (a
   child may have been its creator), never the segment of another, live job. */
static void dopt__shm_remove_if_dead(const char *job) {
    char path[DOPT__SHM_NAME_MAX + 8];
    int fd;
    snprintf(path, sizeof path, "/dopt.%s", job);
    fd = shm_open(path, O_RDWR, 0);
    if (fd < 0) return;
    if (!dopt__shm_lock_held(fd, 0, 0)) shm_unlink(path);
    close(fd);
}

/* In a freshly forked child: join as rank, or exit (the parent fails and reaps us). */
static dopt_status dopt__shm_fork_child(dopt_comm **out, dopt_shm_config *cfg, int rank) {
    cfg->rank = rank;
    if (dopt_shm_create(out, cfg) != DOPT_OK) {
        fflush(NULL);
        _exit(1);
    }
    ((dopt__shm *)(*out)->impl)->fork_child = 1;
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_shm_fork(dopt_comm **out, int nranks, const dopt_shm_config *cfg) {
    dopt_shm_config local;
    char name[64];
    pid_t *children = NULL;
    dopt_status st;
    int r;
    if (cfg != NULL)
        local = *cfg;
    else
        memset(&local, 0, sizeof local);
    local.join = 0; /* the fork starts a job; nobody joins one through it */
    if (out == NULL) return dopt__shm_config_fail(&local, DOPT_ERR_INVALID, "fork: out is NULL");
    *out = NULL;
    if (nranks < 1 || nranks > DOPT__SHM_MAX_RANKS)
        return dopt__shm_config_fail(&local, DOPT_ERR_INVALID, "fork: nranks outside 1..1024");
    local.size = nranks;
    if (local.name == NULL) {
        dopt__shm_unique_name(name, sizeof name);
        local.name = name;
    }
    if (nranks > 1) {
        children = (pid_t *)DOPT_MALLOC((size_t)(nranks - 1) * sizeof(pid_t));
        if (children == NULL) return dopt__shm_config_fail(&local, DOPT_ERR_NOMEM, "fork: out of memory");
    }
    fflush(NULL);
    for (r = 1; r < nranks; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            DOPT_FREE(children);
            return dopt__shm_fork_child(out, &local, r);
        }
        if (pid < 0) {
            char why[128];
            snprintf(why, sizeof why, "fork: starting rank %d: %s", r, strerror(errno));
            dopt__shm_kill_children(children, r - 1);
            DOPT_FREE(children);
            return dopt__shm_config_fail(&local, DOPT_ERR_IO, why);
        }
        children[r - 1] = pid;
    }
    local.rank = 0;
    st = dopt_shm_create(out, &local);
    if (st != DOPT_OK) {
        dopt__shm_kill_children(children, nranks - 1);
        DOPT_FREE(children);
        if (nranks > 1) dopt__shm_remove_if_dead(local.name);
        return st;
    }
    ((dopt__shm *)(*out)->impl)->children = children;
    ((dopt__shm *)(*out)->impl)->nchildren = nranks - 1;
    return DOPT_OK;
}

/* Waits for rank r's process until the deadline (then kills it); its status as the shell
   reports it, and a log line when it failed. */
static int dopt__shm_wait_child(dopt_comm *c, int r, pid_t pid, double deadline) {
    int ws = 0, code;
    double nap = 0.5;
    for (;;) {
        pid_t got = waitpid(pid, &ws, WNOHANG);
        if (got == pid) break;
        if (got < 0 && errno != EINTR) {
            dopt_comm_log(c, DOPT_LOG_WARN, "shm fork: cannot wait for rank %d (pid %d): %s", r, (int)pid, strerror(errno));
            return 0;
        }
        if (dopt__now_ms() >= deadline) {
            kill(pid, SIGKILL);
            while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {
            }
            dopt_comm_log(c, DOPT_LOG_ERROR, "rank %d (pid %d) did not finish within %d ms of rank 0: killed", r,
                          (int)pid, c->timeout_ms);
            return 128 + SIGKILL;
        }
        dopt__shm_sleep_ms(nap);
        if (nap < 20.0) nap *= 2.0;
    }
    if (WIFSIGNALED(ws)) {
        code = 128 + WTERMSIG(ws);
        dopt_comm_log(c, DOPT_LOG_ERROR, "rank %d (pid %d) was killed by signal %d", r, (int)pid, WTERMSIG(ws));
    } else {
        code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 1;
        if (code != 0) dopt_comm_log(c, DOPT_LOG_ERROR, "rank %d (pid %d) exited with status %d", r, (int)pid, code);
    }
    return code;
}

DOPT_DEF int dopt_shm_fork_finish(dopt_comm *comm, int status) { return dopt_comm_finish(comm, status); }

/* dopt_comm_finish on shm: a forked child exits; rank 0 of a forked job waits for its children. */
static int dopt__shm_finish(dopt_comm *comm, int status) {
    dopt__shm *s = (dopt__shm *)comm->impl;
    int result = status, r;
    if (s != NULL && s->fork_child) {
        dopt_comm_destroy(comm);
        fflush(NULL);
        _exit(status & 0xFF);
    }
    if (s != NULL && s->nchildren > 0) {
        double deadline = dopt__now_ms() + (double)comm->timeout_ms;
        dopt__shm_leave(comm, s); /* ranks still waiting for rank 0 give up at once */
        for (r = 1; r <= s->nchildren; r++) {
            int code = dopt__shm_wait_child(comm, r, s->children[r - 1], deadline);
            if (result == 0) result = code;
        }
    }
    dopt_comm_destroy(comm);
    return result;
}

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_IMPLEMENTATION && !DOPT__SHM_IMPLEMENTED */
