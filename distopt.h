/* distopt.h — communication-efficient data-parallel training for C training loops.
   Version 0.1.0. MIT licence (see the end of this file).

   The core every other distopt header builds on: status codes, descriptors of the host's
   parameter and gradient buffers, a counter-based random number generator, vector kernels, and the
   communicator (dopt_comm) with its collectives, including a world of one ("self"). The transports
   (transport_shm.h, transport_tcp.h, transport_mpi.h) give worlds of many; launch.h starts a job in
   one call; clip.h, compress.h and localsgd.h are the training methods.

   DO THIS in exactly one C or C++ file of your program, before including the header:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"

   Every other file includes "distopt.h" alone. With DISTOPT_STATIC defined as well, every function
   becomes static (and unused-safe), for programs that are a single translation unit.

   QUICK START (every rank runs the same program; launch.h reads the job from the environment)

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "transport_shm.h"      (the transports the program may run on)
       #include "transport_tcp.h"
       #include "launch.h"
       #include <stdio.h>

       int main(void) {
           float grads[1000] = {0};                 (the host's own gradient buffer)
           double loss = 0.5, mean_loss;
           dopt_status st;
           dopt_comm *comm;
           if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1;   (the reason is on stderr)
           grads[0] = (float)comm->rank;
           st = dopt_allreduce(comm, grads, 1000, DOPT_F32, DOPT_MEAN); (the mean, on every rank)
           mean_loss = dopt_mean(comm, loss);       (a collective too: every rank calls it)
           if (comm->rank == 0) printf("loss %.4f\n", mean_loss);
           return dopt_comm_finish(comm, st);       (every rank's last call; a failure's detail
       }                                              went to stderr through launch.h's logger)

   ./train is a world of one, DOPT_WORLD_SIZE=4 ./train forks 4 ranks on this host, and mpirun,
   srun and torchrun start it too (launch.h). With distopt.h alone, dopt_comm_create_self(&comm)
   gives a world of one. A training loop calls localsgd.h's driver (dopt_dp_*) rather than the
   collectives, and ends with return dopt_comm_finish(comm, dopt_dp_close(&dp, params));

   BUILD OPTIONS (define before including, in the implementation file unless said otherwise)

   | macro                        | meaning                                               | where          |
   |------------------------------|-------------------------------------------------------|----------------|
   | DISTOPT_IMPLEMENTATION       | emit the definitions                                  | one file       |
   | DISTOPT_STATIC               | make every function static                            | every file     |
   | DOPT_MALLOC(sz), DOPT_FREE(p)| replace malloc/free; define both or neither           | impl file      |
   | DOPT_ASSERT(x)               | replace assert() for internal invariants              | impl file      |
   | DOPT_USE_BLAS                | dopt_axpy and dopt_scale through <cblas.h> (link a    | impl file      |
   |                              | CBLAS, e.g. -lopenblas): faster at large sizes (see   |                |
   |                              | REFERENCE FOR CONTRIBUTORS below: measured); without  |                |
   |                              | it every kernel is plain C and nothing beyond libm is |                |
   |                              | needed                                                |                |
   | DOPT_NO_BLAS                 | never include <cblas.h>, even with DOPT_USE_BLAS      | impl file      |
   | DOPT_NO_VECTOR_EXT           | plain loops only: no vector types and no intrinsics   | impl file      |
   |                              | (distopt.h, compress.h), whatever the target supports |                |
   | DOPT_NO_THREADS              | no <pthread.h>: dopt_comm_set_progress_thread returns | impl file      |
   |                              | DOPT_ERR_UNSUPPORTED                                  |                |

   BUFFER DESCRIPTORS
     A host holds its parameters and gradients either flat (one float array, optionally cut into
     segments, one per tensor or layer) or as a scatter list of {ptr, count} arrays. dopt_buf
     describes either; segment i of a gradient buffer corresponds to segment i of its parameters.
     - dopt_segment {offset, count, name, rows}: a segment of a flat buffer. rows, the last field,
       gives it a shape: 0 (the default: initialisers of the first three fields leave it 0) is a
       vector; otherwise the segment is a matrix of rows × (count / rows) elements stored row
       by row, and count must be a multiple of rows. Only compressors that work on matrices read
       it (compress.h's PowerSGD, whose init refuses a count that is not a multiple of rows);
       every other call ignores it, so a table filled field by field, without rows, works as it
       did. Initialisers of three fields still compile and mean a vector; GCC's and clang's
       -Wextra warn about them (-Wmissing-field-initializers): add the fourth value, 0, or name
       the fields ({.offset = 0, .count = n}) to silence it.
     - dopt_segments_from_sizes(segs, sizes, nsegs, &total): fills segs[0..nsegs) with
       consecutive segments, segment i of sizes[i] elements (sizes: const size_t *), starting at
       offset 0 with no gaps; names NULL, rows 0 (vectors). total, when not NULL, gets the sum
       of the sizes, the flat buffer's length; pass NULL to skip it. DOPT_ERR_INVALID when segs
       or sizes is NULL with nsegs > 0, or the sum overflows size_t (segs then partly filled,
       *total untouched); nsegs 0 is DOPT_OK with a total of 0.
     - dopt_buf_flat(data, n, segs, nsegs) / dopt_buf_scatter(spans, nspans): build descriptors
       (no copy, no allocation; the caller keeps the arrays alive while the descriptor is used).
     - dopt_buf_validate(&b): DOPT_ERR_INVALID for a NULL pointer with a non-zero count, or a
       segment table that is not in increasing offset order, overlaps, or exceeds the buffer.
       Gaps between segments are allowed (they belong to no segment).
     - dopt_buf_count(&b) elements in all; dopt_buf_nsegs(&b) segments; dopt_buf_segment(&b, i)
       the i-th segment as a {ptr, count} span.
     - dopt_buf_pack(&b, dst) copies the segments, in order, into a contiguous dst of
       dopt_buf_count(&b) floats; dopt_buf_unpack(&b, src) copies back.

   RANDOM NUMBERS
     Philox-4x32-10 (Salmon et al., SC'11): a pure function of a 128-bit counter and a 64-bit key,
     so any element's random number can be computed independently of threading and order.
     - dopt_philox4x32(ctr, key, out): one raw block (matches the Random123 known answers).
     - dopt_rng_init(&rng, seed, rank, stream): the key mixes (seed, rank); the stream fills the
       upper half of the counter. Element i of a stream is word i % 4 of block i / 4.
     - dopt_rng_u32(&rng, first, out, n): words first .. first+n-1 of the stream.
     - dopt_rng_uniform(&rng, first, out, n): the same words as floats in [0, 1) (24-bit).
     - dopt_seed_for_rank(seed, rank): a well-mixed per-rank seed for the host's own generators.

   VECTOR KERNELS (float data, double accumulation where it sums)
     dopt_sumsq(x, n)         Σ x_i², accumulated in double: relative error ~1e-12 for 10^8
                              elements and no overflow for any finite float.
     dopt_dot(x, y, n)        Σ x_i y_i in double.
     dopt_axpy(y, a, x, n)    y += a·x.
     dopt_scale(x, a, n)      x *= a.
     dopt_maxabs(x, n)        max |x_i| (0 for n = 0; NaN elements are skipped — use
                              dopt_all_finite to detect them).
     dopt_mean_var(x, n, &mean, &var)  mean and population variance in one pass (shifted sums in
                              double; accurate when |mean| ≫ std too).
     dopt_all_finite(x, n)    1 when no element is NaN or ±Inf.
     dopt_copy_finite(dst, src, n)  dst = src (n floats, no overlap), and 1 when no element is
                              NaN or ±Inf: the check rides on a copy that runs anyway (the
                              driver's verdict on an average costs no pass of its own).
     Both test bits, so they hold in hosts built with -ffast-math or -Ofast.
     dopt_reduce(dst, src, count, dtype, op)  dst ∘= src elementwise (MEAN reduces as SUM). The
                              primitive every transport reduces with.

   COMMUNICATORS (dopt_comm)
     A communicator is a rank in a world of size ranks with a backend behind a vtable. Backends:
     dopt_comm_create_self (here), and the shm, TCP and MPI transports in their own headers.
     c->vt->name names the backend, for messages and tests: "self" (dopt_comm_create_self),
     "shm" (transport_shm.h, with or without its engine), "tcp" (transport_tcp.h), "mpi"
     (transport_mpi.h, with or without its engine), and "group" for a group dopt_comm_split
     made (GROUPS below) over links, whatever the transport; a group MPI splits itself is "mpi". These
     collectives block (REQUESTS has their nonblocking forms), work in place where it makes sense,
     and must be called by every rank in the same order with matching arguments:
     - dopt_allreduce(c, buf, count, dtype, op): dtypes F32, F64, I32, I64; ops SUM, MAX, MIN, MEAN
       (sum then divide by size; integer MEAN truncates toward zero). It checks no value: a NaN
       or an infinity in one rank's buffer passes through (SUM and MEAN make that element NaN or
       infinite on every rank; MAX and MIN may keep or drop a NaN), in any build. To skip a step
       with a non-finite gradient on every rank together, have the ranks agree first
       (dopt_all_finite, then one allreduce of the verdict; clip.h's dopt_clip_global_norm
       carries it in the norm's own allreduce), or average through compress.h's
       dopt_compress_allreduce, which refuses non-finite gradients for every codec.
     - dopt_allreduce_weighted_mean(c, buf, count, dtype, weight): Σ w_r·buf_r / Σ w_r for F32/F64;
       DOPT_ERR_INVALID on every rank when Σ w_r is not positive.
     - dopt_allgather(c, send, recv, bytes): rank r's block lands at recv + r·bytes.
     - dopt_allgatherv(c, send, send_bytes, recv, recv_capacity, recv_bytes): blocks of unequal
       size; their sizes are exchanged first and written to recv_bytes[size]; blocks are packed in
       rank order. When the total exceeds any rank's capacity, every rank gets DOPT_ERR_INVALID.
     - dopt_broadcast(c, buf, bytes, root), dopt_barrier(c).
     - dopt_exchange(c, tag, sends, nsends, recvs, nrecvs): point-to-point messages as one
       collective, for schedules of one's own (compress.h's integer ring is one). Every rank
       calls it with the same tag (a number of the caller's choosing; another tag is a
       MISMATCH) and lists the messages it sends and receives (dopt_xfer: peer, buffer, bytes;
       either list may be empty). A rank's sends to a peer must match that peer's receives from
       it one for one, in order and in size (else DOPT_ERR_PROTOCOL names the sizes). Sends
       never wait for receives. It runs over links (TCP, shm in worlds of up to 64 ranks, MPI);
       a communicator without them (MPI's groups, larger shm worlds) returns
       DOPT_ERR_UNSUPPORTED without poisoning anything. Peer out of range or this rank itself,
       or a NULL buffer with bytes: DOPT_ERR_INVALID.
     Results are bitwise identical on every rank. Zero-length calls are legal. On any error the
     communicator is poisoned: every later call returns the same status at once, without
     communicating, and dopt_comm_detail(c) names the rank, the collective and its sequence
     number, and the peer. The modules keep that rule (clip.h's norms, compress.h's allreduce,
     every call of localsgd.h's driver), so a loop may check the status once per step or epoch
     instead of after every call.
     dopt_comm_destroy(c) releases everything (NULL is accepted).
     dopt_comm_finish(c, status) is the one call every rank makes last, whatever the transport:
     it ends this rank's part of the job with its own status (0: success) and returns the status
     to exit with. In a job a transport started itself (transport_shm.h's fork helper, which
     launch.h's dopt_comm_create_from_env uses without a launcher) the forked ranks exit inside
     it, and rank 0 waits for them and gets the job's status: its own if not 0, else that of the
     lowest rank that failed. Otherwise (a launcher started every rank) it destroys c and returns
     status. c may be NULL (returns status); on a group it destroys the group. A negative
     status (a dopt_status) becomes 1. When status is not 0, the communicator holds a detail
     (its first failure, or dopt_dp_close's verdict) and has no log callback (which was told
     already), finish prints it to stderr as "distopt: <detail>": the one line distopt.h
     prints, so a failed job says why without a line of the host's.
     dopt_mean(c, x) returns the mean of x over the ranks (a collective; NaN once c is
     poisoned): reporting a loss is one line, printf("loss %.4f\n", dopt_mean(c, loss)). For
     several numbers at once, dopt_allreduce(c, v, k, DOPT_F64, DOPT_MEAN).
     c->traffic counts, per collective kind (index dopt_coll), what this rank's completed
     collectives carried, in four arrays:
     - calls[]: the collectives completed;
     - bytes[]: their payload as the caller hands it to the transport, whatever the algorithm
       then sends: allreduce count × dtype size, allgather(v) this rank's own block, broadcast
       the buffer (on every rank), barrier 0, exchange the bytes it sent. Not bytes on the
       wire;
     - sent[] and received[]: the bytes on the links, what the engine actually wrote to and
       read from peers for them: frame payloads, the 48-byte frame headers (DOPT_FRAME_BYTES)
       and TCP/IP's own left out (a ring allreduce of B bytes over N ranks sends and receives
       2·(N-1)/N·B). 0 for collectives a backend runs itself, without the engine (shm's direct
       collectives, MPI's).
     Collectives the library issues itself (the size exchange of allgatherv, the total of a
     weighted mean, clip.h's norm) count in all four. Two more say where the time went (FLIGHT
     RECORDER below): busy_ns, the time from start to end of the completed collectives, summed,
     and waited_ns[r], the part of it spent waiting for rank r's data. dopt_comm_traffic_total
     sums bytes[]; zero the struct to start a new count.
     dopt_comm_set_log(c, fn, user) installs the log callback. dopt_comm_set_timeout(c, ms) sets
     c->timeout_ms, the bound on every wait (0 or less: the default, 300 s; each transport's
     config sets it at create; MPI without its engine enforces none: see transport_mpi.h).

     The collectives distopt's own calls make (the replica check, the batch-size decision, the
     clip verdict, TernGrad's scale sharing, the model average) name that call in the detail:
     "rank 0: dopt_dp_check_replicas: allreduce #68 (i64 max, 2 elems): rank 1 called
     allreduce #68 (f32 mean, 235146 elems)".
     In a program built with OpenMP (-fopenmp where DISTOPT_IMPLEMENTATION is defined), when
     several ranks share a host and OMP_NUM_THREADS is unset, the shm, TCP and MPI backends warn
     once through the log callback — each rank would start a thread per core — with the numbers
     and the setting to use.

   REQUESTS (nonblocking collectives)
     dopt_allreduce_start, dopt_allgather_start, dopt_broadcast_start and dopt_exchange_start take the arguments of
     their blocking twins plus a dopt_request the caller keeps (a plain value, nothing to free),
     and return at once. dopt_test(&req, &done) makes progress without sleeping and sets done;
     dopt_wait(&req) makes progress until the request completed. Buffers belong to the
     collective until then: do not touch them. Several may be in flight; they complete in the
     order they were started (waiting on a later one completes the earlier ones too), and their
     results equal the blocking call's bit for bit. Waiting again on a completed request returns
     DOPT_OK. The blocking calls are start + wait, and every collective, blocking or not, takes
     the next sequence number when it starts, so ranks must start them in the same order.
     On a failure the communicator is poisoned as for a blocking call: the failing request and
     every one after it return the error; one that completed before the failure returns
     DOPT_OK. Progress is made inside dopt_test and dopt_wait (and the blocking calls) and, on a
     communicator given one, by a progress thread: engine.h's dopt_comm_set_progress_thread(c,
     interval_us) (TCP: the config's progress_thread_us) starts a thread that passes over the links every
     interval_us while requests are in flight and sleeps otherwise; it stops at destroy, and every
     call on c (and its groups) then takes a lock the thread shares. A failure the thread finds
     poisons c as any other would, and is logged from the thread (the log callback must then
     tolerate being called from it). Without one, a request left alone does not move. With the TCP
     transport (and any backend with links: engine.h, which the transports include)
     the requests really overlap with the caller's work; the shm and MPI backends still run each
     collective whole when it starts, so there a request is complete when start returns.

   GROUPS (sub-communicators)
     dopt_comm_split(c, color, key, &g): every rank of c calls it; the ranks that pass the same
     color (>= 0) form a group g, ranked by key then by their rank in c; DOPT_UNDEFINED joins
     none (g = NULL). dopt_comm_split_host(c, &g): the ranks of c on this rank's host (from the
     host table TCP builds from its ranks' addresses; else from the host name and network
     namespace, exchanged). A group is a communicator like any other (every collective, request,
     the traffic counters of its own) and may be split again; destroy it with dopt_comm_destroy,
     before or after c. Over TCP and shm (any backend with links) a group shares c's links, so a
     rank that calls the parent while its peer calls a group they share is named (MISMATCH,
     "... in group 1").
     Rule: collectives on c and on groups split from it in which two ranks both take part must
     be started in the same order on both (a program that does otherwise would deadlock on most
     libraries; here it fails with a mismatch). A failure in c or any of its groups poisons them
     all (they share links). Details name ranks of the communicator the transport made. MPI
     splits with MPI_Comm_split; the self backend into itself; shm over its per-pair links (in
     worlds of up to 64 ranks; larger ones have no links and return DOPT_ERR_UNSUPPORTED,
     nothing poisoned).

   SURVIVING A LOST PEER (shrink)
     By default a lost peer ends the job: every survivor's communicator is poisoned and names it.
     A communicator whose transport was configured with on_peer_lost = DOPT_SHRINK (TCP: its
     config's on_peer_lost and min_ranks, or DOPT_ON_PEER_LOST=shrink and DOPT_MIN_RANKS; shm's
     the same, in worlds of up to 64 ranks; MPI cannot, and says DOPT_ERR_UNSUPPORTED) can go on
     without it: after a collective failed with DOPT_ERR_PEER_LOST or DOPT_ERR_TIMEOUT,
     on c or on a group split from it (a group's failure is c's: they share links), every
     survivor calls dopt_comm_shrink(c, &next). The survivors agree on who is alive,
     without a coordinator (rank 0 may be the one lost), and each gets next: a communicator of
     the survivors, ranked in their old order, with the same job identity (token, addresses) and
     settings, next->epoch = c->epoch + 1. c stays poisoned (every request in flight on it has
     failed); destroy it, after or before next. The agreement tolerates further deaths during it
     (a rank lost while the survivors agree is left out, or, when it dies after the decision, is
     named by next's first collective, which a second shrink then leaves out), and every
     survivor ends with the same members and numbering. What the survivors do with the lost
     rank's work is the program's (localsgd.h's driver does it with dopt_dp_config.elastic: see
     its ELASTIC).
     dopt_comm_shrink returns:
     - DOPT_OK with next;
     - DOPT_ERR_PEER_LOST when fewer than min_ranks survive (on every survivor, the detail
       giving the count and min_ranks), or when the others agreed to leave this rank out (it was
       too slow to answer: it was taken for lost);
     - DOPT_ERR_INVALID when c is healthy, failed otherwise (a MISMATCH is a program's bug, not a
       lost peer), is a group (shrink the communicator the transport made, then split again), or
       was not configured with DOPT_SHRINK; c is left as it was;
     - DOPT_ERR_UNSUPPORTED for a backend that cannot (MPI: Open MPI 4.1 has no ULFM, and
       mpirun ends the job when a rank dies);
     - DOPT_ERR_TIMEOUT when nobody answered within c's timeout.
     c->lost_rank is the rank the failure named (-1 before one). Ranks taken for lost are those
     whose connection ended, or who said nothing for the timeout: a survivor that was only slow
     may be left out, and learns it from dopt_comm_shrink's status. The rest of the contract is
     each transport's (transport_tcp.h and transport_shm.h: SURVIVING A LOST RANK).

   TAKING A WORKER BACK (grow)
     A restarted process of a DOPT_SHRINK job asks a member to join (TCP: dopt_tcp_config.join,
     or DOPT_JOIN=1, transport_tcp.h: RE-ADMIT; shm: dopt_shm_config.join, or DOPT_JOIN=1,
     transport_shm.h: TAKING A WORKER BACK), and the member holds it. The joiners come
     in only when every member calls dopt_comm_grow(c, &next), at a moment the program chooses
     (localsgd.h's driver: a round boundary), never inside a collective:
     - DOPT_OK, next NULL: nobody is held anywhere; c goes on.
     - DOPT_OK with next: the members agreed on every joiner held at that moment; next has them
       as ranks c->size, c->size + 1, ... (in the order of the members that held them), the
       members keep their ranks, next->epoch = c->epoch + 1, next->grown_from = c->size on
       every rank of next (a rank tells it came in by that grow: rank >= grown_from; 0 on
       communicators no grow made). c's links now belong to next:
       destroy c and go on with next (nothing in flight on c may be left). The joiner's create
       returns its side of next.
     - DOPT_ERR_PEER_LOST with next: a joiner (or a member) was lost while the links were made;
       the barrier that ends dopt_comm_grow named it. Shrink next (dopt_comm_shrink) to go on
       without it: the job is as it was, the joiner may ask again.
     - DOPT_ERR_PEER_LOST (or TIMEOUT) without next: a member was lost before the joiners were
       agreed; shrink c.
     - DOPT_ERR_INVALID: c is a group, has failed, or was not configured with DOPT_SHRINK.
     A backend that takes no joiners (MPI) returns DOPT_OK with next NULL. It costs one small
     collective when nobody joins (TCP: an allgather; shm: an allreduce, transport_shm.h: TAKING
     A WORKER BACK). dopt_comm_joiners_held(c): how many joiners this rank
     holds now (0 on a group, or where nobody can join); a program that carries it in a
     collective it makes anyway, and calls dopt_comm_grow (every member alike) only when some
     member holds one, saves that allgather (localsgd.h's driver does it in its model average).

   RANKS THAT SHARE A HOST
     Where the transport knows which ranks share a host (TCP, from the addresses its ranks listen
     on), a large allreduce across several hosts with the same number of ranks each runs in two
     levels, within each host and then across hosts, so that a host's link carries 2·(H−1)/H of
     the buffer for H hosts instead of the flat ring's 2·(N−1)/N for N ranks. Every rank still
     ends with the same bits, run after run. TCP's two_level (DOPT_TWO_LEVEL: auto, on, off)
     chooses when; see engine.h's REFERENCE FOR CONTRIBUTORS: HOSTS.
     dopt_comm_host_layout(c, &layout) tells a schedule of one's own what the engine knows: H
     hosts of `local` ranks each (hosts = 0 when unknown, uneven, or c is a group), this rank's
     host and place on it, and the two_level setting; dopt_comm_host_rank(c, host, place) is
     the rank at a place (-1 out of range). Hosts are numbered in the order of their lowest
     rank, places in rank order.

   FLIGHT RECORDER (always on; which rank is everyone waiting for?)
     Every communicator a transport makes keeps its last DOPT_REC_ENTRIES (2048) collectives and
     exchanges, its groups' included: sequence number, kind, count, dtype, op, group, root, start
     and end times, status, and for each of the first DOPT_REC_PEERS (16) peers it receives from,
     whether and when that peer's data arrived. They live in a file per rank that another process
     reads while the job runs or hangs: $DOPT_RECORDER_DIR/dopt-rec.<job>.<rank> (default
     directory /dev/shm; mode 0600; <job>: 16 hex digits hashed from the job's identity, the same
     on every rank: TCP's token and rank 0's address, shm's segment name, an id MPI's rank 0
     broadcasts). tools/distopt-inspect (make builds build/distopt-inspect) reads every rank's
     file of a job on this machine and names the rank everyone waits for, its last collective,
     and the sequence number where the ranks diverge (docs/reliability.md shows its output).
     - The file goes when the communicator is destroyed after a clean run. It stays when the
       communicator failed, or dopt_comm_finish was given a non-zero status, so that
       distopt-inspect reads it after the job ended; a rank that was killed leaves it too.
       distopt-inspect --prune removes the files of jobs none of whose processes is alive.
       dopt_comm_shrink's communicator is a job of its own (TCP: its epoch is part of the
       identity), so its files never take the names of those the failed one kept.
     - DOPT_RECORDER=0 in the environment turns the recorder off (read when a communicator
       first records). When the file cannot be made (no /dev/shm, a full or read-only
       directory), the recorder keeps its entries in memory, where no other process reads them,
       and says why in one DOPT_LOG_INFO line. A world of one (dopt_comm_create_self) and
       dopt_tcp_create_from_sockets, which have no job identity, record in memory only.
     - Cost: about 55 ns per collective and 26 ns per arrival of a peer's data (bench_recorder;
       REFERENCE FOR CONTRIBUTORS: MEASURED), and 513 KiB per communicator (a header of 1024
       bytes and 2048 entries of 256), mapped or allocated at its first collective: nothing is
       allocated per collective.
     - Arrival times come from the engine (engine.h): TCP, shm with its engine, MPI with its
       engine, and groups over links. The collectives shm and MPI run themselves record their
       start, end and status only, and waited_ns stays 0 there.
     Straggler figures, in c->traffic: each arrival of a peer's data ends a wait that began at
     the collective's start or at the previous arrival in it, whichever is later; that span is
     added to waited_ns[peer] (peers below DOPT_STRAGGLER_RANKS, 64, in the numbering of the
     communicator the transport made). Their sum over peers is the time from a collective's
     start to its last arrival. dopt_comm_straggler(c, r) = waited_ns[r] / busy_ns, in [0, 1]:
     the share of this rank's time in collectives spent waiting for rank r's data (0 when
     nothing completed yet, for r out of range, and for r = c->rank). A rank whose score is high
     on every other rank is the straggler; on a ring (large allreduces) each rank receives from
     its neighbour only, so there the rank downstream of a straggler charges it all, and the
     small ones (every rank receives from every other) tell more. A host may log it every few
     hundred steps, e.g. printf("straggler %.2f\n", dopt_comm_straggler(c, 3)).
     For backends: dopt_comm_set_job(c, identity, bytes) once the job has formed (the
     transports do it at create) names the file; before it, the recorder is in memory.

   LAUNCH VARIABLES
     dopt_launch_read(&info, why, cap) reads where this process stands in its job from the
     environment, for the transports' ..._config_from_env and launch.h's one-call start:
     | what             | read from, first found wins                                             |
     |------------------|-------------------------------------------------------------------------|
     | rank, world size | the first launcher that sets both: Open MPI (OMPI_COMM_WORLD_RANK,      |
     |                  | _SIZE), PMI/MPICH (PMI_RANK, PMI_SIZE), Slurm (SLURM_PROCID,            |
     |                  | SLURM_NTASKS), torchrun (RANK, WORLD_SIZE); else DOPT_RANK and          |
     |                  | DOPT_WORLD_SIZE. DOPT_* set beside a launcher must say the same.        |
     | local rank, size | the same launcher's (OMPI_COMM_WORLD_LOCAL_RANK/_SIZE, MPI_LOCALRANKID/ |
     |                  | MPI_LOCALNRANKS, SLURM_LOCALID and this node's entry of                 |
     |                  | SLURM_STEP_TASKS_PER_NODE, LOCAL_RANK/LOCAL_WORLD_SIZE), or             |
     |                  | DOPT_LOCAL_RANK/DOPT_LOCAL_SIZE; -1 when unknown                        |
     | rank 0's host    | DOPT_MASTER_ADDR; MASTER_ADDR; 127.0.0.1 when the local size is the     |
     |                  | world size; under Slurm the first node of SLURM_STEP_NODELIST (rank 0   |
     |                  | runs there with Slurm's default block distribution; "n[03-05]" gives    |
     |                  | n03), else SLURM_LAUNCH_NODE_IPADDR (where srun ran, which need not run |
     |                  | rank 0); else none ("")                                                 |
     | its port         | DOPT_MASTER_PORT; MASTER_PORT (plus one under torchrun itself, where    |
     |                  | TORCHELASTIC_RUN_ID is set: torchrun's own store holds MASTER_PORT);    |
     |                  | else one derived from the job's name, 20000 + FNV-1a(name) mod 12000,   |
     |                  | the same on every rank; else 0                                          |
     | job name         | slurm-JOB.STEP, ompi-JOBID (OMPI_MCA_ess_base_jobid), pmi-KVSNAME,      |
     |                  | torchrun-ADDR.PORT; "" without a launcher                               |
     | transport        | DOPT_TRANSPORT: shm, tcp, mpi or self; "" when unset                    |
     A launcher that sets only one of its rank and size variables, a malformed number, a rank
     not below the size, DOPT_* disagreeing with the launcher ("DOPT_WORLD_SIZE=4 but
     OMPI_COMM_WORLD_SIZE=8: they name two different jobs; unset DOPT_WORLD_SIZE") or an unknown
     DOPT_TRANSPORT is DOPT_ERR_INVALID with why naming the variables. A launcher nested in
     another must win over the outer one's inherited variables: mpirun inside a Slurm allocation
     is read as Open MPI by the order above; torchrun's workers (TORCHELASTIC_RUN_ID is set, by
     torchrun only) are read as torchrun's first, so torchrun started by srun works too.
     info->rank_from and info->master_from say which variables were used.

   ERRORS
     Every fallible call returns dopt_status: DOPT_OK (0) or a negative code; dopt_status_str(s)
     returns a static string for every code and "unknown status" otherwise. Collectives also
     leave a one-line detail in the communicator (dopt_comm_detail), and after any error the
     communicator is poisoned (COMMUNICATORS): end the rank with dopt_comm_finish(c, status)
     (which prints that detail when no log callback was told it), rather than calling on. What each code means here:
     DOPT_ERR_INVALID      a bad argument or layout (a NULL pointer with a count, a segment table
                           out of order, an unknown dtype or op); on every rank when the ranks
                           disagree on what they must share (allgatherv's capacity, the weighted
                           mean's total). Fix the call.
     DOPT_ERR_NOMEM        an allocation failed.
     DOPT_ERR_IO           a system call failed (file, socket, shared memory).
     DOPT_ERR_TIMEOUT      a peer did not answer within the communicator's timeout; the detail
                           names it.
     DOPT_ERR_PEER_LOST    a peer closed its connection or its process died; the detail names it.
     DOPT_ERR_MISMATCH     ranks called different collectives, counts, types, ops or roots; the
                           detail names both calls. Every rank must make the same calls in the
                           same order.
     DOPT_ERR_NONFINITE    NaN or infinity where finite numbers are needed (clip.h, compress.h
                           and localsgd.h say what to do; dopt_allreduce checks nothing).
     DOPT_ERR_PROTOCOL     bytes from a peer or a file that do not follow the format (another
                           release of distopt, a stranger, a damaged state file).
     DOPT_ERR_AUTH         a peer presented the wrong job token (TCP).
     DOPT_ERR_UNSUPPORTED  the operation is not available with this backend or build (groups on
                           shm beyond 64 ranks; a progress thread without links or threads).
     DOPT_ERR_CLOSED       the communicator was already shut down (MPI finalized under it).
     Each transport's manual lists what its create can return and what its details say.

   NOTES
   - Sizes are size_t. Buffers are passed at each call; nothing is captured at init.
   - No global mutable state, no printing (but dopt_comm_finish's one line when there is no log
     callback, and launch.h's default logger), no exit(). Logging goes to a callback installed on a communicator
     (dopt_comm_set_log); without one the library is silent.
   - Thread safety: functions without a context are pure and may be called from any thread. A
     communicator must be used by one thread at a time.
*/
/* The transports and localsgd.h call POSIX, which the C library hides under strict ISO C
   (-std=c11) unless a feature macro comes before the first system header. They define
   DOPT__WANT_POSIX before including this file, so a program whose first include is one of them
   builds without -D_GNU_SOURCE. In GNU modes, or when the program chose its own feature macros,
   nothing is defined here. */
#if defined(DOPT__WANT_POSIX) && defined(__STRICT_ANSI__) && !defined(_GNU_SOURCE) && \
    !defined(_POSIX_C_SOURCE) && !defined(_XOPEN_SOURCE) && !defined(_DEFAULT_SOURCE)
#  define _GNU_SOURCE 1
#endif

#ifndef DISTOPT_H
#define DISTOPT_H

#include <stddef.h>
#include <stdint.h>

#define DOPT_VERSION_MAJOR 0
#define DOPT_VERSION_MINOR 1
#define DOPT_VERSION_PATCH 0
#define DOPT_VERSION_STRING "0.1.0"

#ifdef DISTOPT_STATIC
#  if defined(__GNUC__) || defined(__clang__)
#    define DOPT_DEF static __attribute__((unused))
#  else
#    define DOPT_DEF static
#  endif
#else
#  define DOPT_DEF extern
#endif

#if defined(__cplusplus) || defined(_MSC_VER)
#  define DOPT_RESTRICT __restrict
#else
#  define DOPT_RESTRICT restrict
#endif

#if defined(__GNUC__) || defined(__clang__)
#  define DOPT__MAYBE_UNUSED __attribute__((unused))
#else
#  define DOPT__MAYBE_UNUSED
#endif

#if defined(__GNUC__) || defined(__clang__)
#  define DOPT_PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#  define DOPT_PRINTF(fmt_index, first_arg)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ===================================================================== STATUS */

typedef enum dopt_status {
    DOPT_OK = 0,
    DOPT_ERR_INVALID = -1,     /* a bad argument or layout */
    DOPT_ERR_NOMEM = -2,       /* an allocation failed */
    DOPT_ERR_IO = -3,          /* a system call failed (file, socket, shared memory) */
    DOPT_ERR_TIMEOUT = -4,     /* a peer did not answer within the communicator's timeout */
    DOPT_ERR_PEER_LOST = -5,   /* a peer closed its connection or its process died */
    DOPT_ERR_MISMATCH = -6,    /* ranks called different collectives, counts, types or ops */
    DOPT_ERR_NONFINITE = -7,   /* NaN or infinity found where finite numbers are needed */
    DOPT_ERR_PROTOCOL = -8,    /* bytes from a peer or a file that do not follow the format */
    DOPT_ERR_AUTH = -9,        /* a peer presented the wrong job token */
    DOPT_ERR_UNSUPPORTED = -10,/* the operation is not available with this backend or build */
    DOPT_ERR_CLOSED = -11      /* the communicator was already shut down */
} dopt_status;

DOPT_DEF const char *dopt_status_str(dopt_status s);
DOPT_DEF const char *dopt_version(void);

/* ===================================================================== LOGGING */

typedef enum dopt_log_level {
    DOPT_LOG_ERROR = 0,
    DOPT_LOG_WARN = 1,
    DOPT_LOG_INFO = 2,
    DOPT_LOG_DEBUG = 3
} dopt_log_level;

typedef void (*dopt_log_fn)(void *user, dopt_log_level level, const char *message);

/* ===================================================================== BUFFER DESCRIPTORS */

typedef struct dopt_segment {
    size_t offset;    /* first element of the segment in the flat buffer */
    size_t count;     /* elements */
    const char *name; /* optional, for messages; not copied */
    size_t rows;      /* 0: a vector; else a rows × (count / rows) matrix, row-major */
} dopt_segment;

typedef struct dopt_span {
    float *ptr;
    size_t count;
} dopt_span;

typedef struct dopt_buf {
    float *data;                /* flat buffer, or NULL for a scatter list */
    size_t n;                   /* flat: elements in data */
    const dopt_segment *segs;   /* flat: optional segment table (NULL: one segment) */
    size_t nsegs;
    const dopt_span *spans;     /* scatter list (data must be NULL) */
    size_t nspans;
} dopt_buf;

DOPT_DEF dopt_status dopt_segments_from_sizes(dopt_segment *segs, const size_t *sizes, size_t nsegs,
                                              size_t *total);
DOPT_DEF dopt_buf dopt_buf_flat(float *data, size_t n, const dopt_segment *segs, size_t nsegs);
DOPT_DEF dopt_buf dopt_buf_scatter(const dopt_span *spans, size_t nspans);
DOPT_DEF dopt_status dopt_buf_validate(const dopt_buf *b);
DOPT_DEF size_t dopt_buf_count(const dopt_buf *b);
DOPT_DEF size_t dopt_buf_nsegs(const dopt_buf *b);
DOPT_DEF dopt_span dopt_buf_segment(const dopt_buf *b, size_t i);
DOPT_DEF void dopt_buf_pack(const dopt_buf *b, float *dst);
DOPT_DEF void dopt_buf_unpack(const dopt_buf *b, const float *src);

/* ===================================================================== RANDOM NUMBERS */

typedef struct dopt_rng {
    uint32_t key[2];
    uint64_t stream;
} dopt_rng;

DOPT_DEF void dopt_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);
DOPT_DEF uint64_t dopt_seed_for_rank(uint64_t seed, int rank);
DOPT_DEF void dopt_rng_init(dopt_rng *rng, uint64_t seed, int rank, uint64_t stream);
DOPT_DEF void dopt_rng_u32(const dopt_rng *rng, uint64_t first, uint32_t *out, size_t n);
DOPT_DEF void dopt_rng_uniform(const dopt_rng *rng, uint64_t first, float *out, size_t n);

/* ===================================================================== VECTOR KERNELS */

typedef enum dopt_dtype { DOPT_F32 = 0, DOPT_F64 = 1, DOPT_I32 = 2, DOPT_I64 = 3 } dopt_dtype;
typedef enum dopt_op { DOPT_SUM = 0, DOPT_MAX = 1, DOPT_MIN = 2, DOPT_MEAN = 3 } dopt_op;

DOPT_DEF size_t dopt_dtype_size(dopt_dtype dt); /* 0 for an unknown type */
DOPT_DEF const char *dopt_dtype_name(dopt_dtype dt);
DOPT_DEF const char *dopt_op_name(dopt_op op);

DOPT_DEF double dopt_sumsq(const float *x, size_t n);
DOPT_DEF double dopt_dot(const float *x, const float *y, size_t n);
DOPT_DEF void dopt_axpy(float *y, float a, const float *x, size_t n);
DOPT_DEF void dopt_scale(float *x, float a, size_t n);
DOPT_DEF float dopt_maxabs(const float *x, size_t n);
DOPT_DEF void dopt_mean_var(const float *x, size_t n, double *mean, double *var);
DOPT_DEF int dopt_all_finite(const float *x, size_t n);
DOPT_DEF int dopt_copy_finite(float *DOPT_RESTRICT dst, const float *DOPT_RESTRICT src, size_t n);
DOPT_DEF void dopt_reduce(void *dst, const void *src, size_t count, dopt_dtype dt, dopt_op op);

/* ===================================================================== COMMUNICATORS */

typedef enum dopt_coll {
    DOPT_COLL_ALLREDUCE = 1,
    DOPT_COLL_ALLGATHER = 2,
    DOPT_COLL_ALLGATHERV = 3,
    DOPT_COLL_BROADCAST = 4,
    DOPT_COLL_BARRIER = 5,
    DOPT_COLL_EXCHANGE = 6
} dopt_coll;

/* What a collective is, as every rank must agree on it. Backends put it (or its fingerprint) on
   the wire to detect mismatched calls. */
typedef struct dopt_coll_desc {
    dopt_coll kind;
    dopt_dtype dtype; /* allreduce; DOPT_F32 otherwise */
    dopt_op op;       /* allreduce; DOPT_SUM otherwise */
    int root;         /* broadcast; 0 otherwise */
    uint64_t seq;     /* 1, 2, 3, ... per communicator */
    uint64_t count;   /* allreduce: elements; allgather: bytes per rank; allgatherv: total bytes;
                         broadcast: bytes; barrier: 0; exchange: the caller's tag */
    uint32_t group;   /* 0: the communicator a backend made; else the number of the group
                         (dopt_comm_split) it runs in, below 2^24 */
} dopt_coll_desc;

typedef struct dopt_comm dopt_comm;

#define DOPT_STRAGGLER_RANKS 64 /* ranks whose data the traffic counters time (dopt_traffic.waited_ns) */

/* Completed collectives and their bytes, indexed by dopt_coll (index 0 unused). */
typedef struct dopt_traffic {
    uint64_t calls[7];
    uint64_t bytes[7];    /* payload handed to the transport (see COMMUNICATORS) */
    uint64_t sent[7];     /* payload bytes the engine wrote to peers (0 where the backend runs it) */
    uint64_t received[7]; /* payload bytes the engine read from peers (0 where the backend runs it) */
    uint64_t busy_ns;     /* time from start to end of the completed collectives, summed */
    uint64_t waited_ns[DOPT_STRAGGLER_RANKS]; /* time waited for rank r's data (see FLIGHT RECORDER) */
} dopt_traffic;

/* One message of an exchange (dopt_exchange_start): to or from rank `peer`. */
typedef struct dopt_xfer {
    int peer;
    void *buf;    /* a send's bytes, or where a receive's land */
    size_t bytes;
} dopt_xfer;

/* Where the ranks of a communicator live (dopt_comm_host_layout). */
typedef struct dopt_host_layout {
    int hosts;      /* H hosts of `local` ranks each; 0: not known, or hosts of unequal sizes */
    int local;
    int host;       /* this rank's host, 0 .. H-1 (hosts in the order of their lowest rank) */
    int local_rank; /* its place among its host's ranks, in rank order */
    int two_level;  /* DOPT_TWO_LEVEL_* in force for host-aware schedules */
} dopt_host_layout;

/* A piece of a frame for a link's send (a header, a payload). */
typedef struct dopt_iov {
    const void *base;
    size_t len;
} dopt_iov;

/* One peer's link in a link_wait call: what the engine waits for, and what happened. */
typedef struct dopt_link_poll {
    int peer;
    short events;  /* DOPT_LINK_IN | DOPT_LINK_OUT, either or neither (see link_wait) */
    short revents; /* set by link_wait: the same bits, or DOPT_LINK_IN when the link ended or failed */
} dopt_link_poll;

#define DOPT_LINK_IN 1
#define DOPT_LINK_OUT 2

/* The collectives a backend runs itself (dopt_comm_vtable.provides). */
#define DOPT_PROVIDES_ALLREDUCE 1u
#define DOPT_PROVIDES_ALLGATHERV 2u
#define DOPT_PROVIDES_BROADCAST 4u
#define DOPT_PROVIDES_BARRIER 8u
#define DOPT_PROVIDES_ALL 15u

/* What a collective works on (dopt_coll_provider.start): the fields its kind uses. */
typedef struct dopt_coll_args {
    void *buf;                       /* allreduce (desc->count elements), broadcast (desc->count bytes): in place */
    const void *send;                /* allgather, allgatherv: this rank's block */
    void *recv;                      /* ... where rank r's block lands: recv + Σ_{q<r} bytes[q] */
    const size_t *bytes;             /* ... every rank's block size, the same on every rank */
    const dopt_xfer *sends, *recvs;  /* exchange: this rank's messages */
    int nsends, nrecvs;
} dopt_coll_args;

/* A provider of collectives (see "for backends" in the manual): where a communicator's
   collectives run. Each is handed a collective already numbered and checked (desc, args); it
   poisons c through dopt_comm_fail when one fails. dopt_own_provider() runs the backend's own
   functions (the vtable's allreduce ... barrier); engine.h's dopt_engine_provider() runs them over
   the backend's links. Fields a provider does not need are NULL. */
typedef struct dopt_coll_provider {
    const char *name;
    /* 1: runs exchanges between ranks; 0: only a world of one's (larger worlds are refused with
       DOPT_ERR_UNSUPPORTED before the call takes a sequence number). */
    int exchanges;
    /* At dopt_comm_new, after the fields are set: what the provider needs for c. An error ends
       the creation (dopt_comm_new destroys c and returns it). */
    dopt_status (*attach)(dopt_comm *c);
    /* Runs or starts d: DOPT_OK with *ticket 0 when it completed (counted in c->traffic, a MEAN
       divided), with *ticket > 0 while in flight (progress completes it, in start order). */
    dopt_status (*start)(dopt_comm *c, const dopt_coll_desc *d, const dopt_coll_args *a, uint64_t *ticket);
    /* Moves c's collectives on: until ticket completed when block is set, else one pass. DOPT_OK
       once it completed; c's error with *done = 1 when it never will; *done = 0 while in flight. */
    dopt_status (*progress)(dopt_comm *c, uint64_t ticket, int block, int *done);
    /* The group of this rank, from every rank's {color, key, proposal} (all[3r..3r+2]; colors
       checked, color >= 0) under the agreed number. NULL: the backend's vt->split makes groups. */
    dopt_status (*split)(dopt_comm *c, const int64_t *all, uint32_t number, dopt_comm **out);
    /* The host the backend said this rank runs on (>= 0; dopt_comm_split_host's color), -1: not said. */
    int (*host_of)(const dopt_comm *c);
    /* dopt_comm_host_layout and dopt_comm_host_rank; NULL: flat (no hosts known, two-level off). */
    void (*host_layout)(const dopt_comm *c, dopt_host_layout *out);
    int (*host_rank)(const dopt_comm *c, int host, int local_rank);
    /* c is being destroyed: it leaves the provider. Returns the communicator whose backend and
       memory go now: c, the root of c's family when c was its last member, or NULL. */
    dopt_comm *(*leave)(dopt_comm *c);
    /* After the backend's destroy of a communicator leave returned: frees what attach made. */
    void (*release)(dopt_comm *c);
} dopt_coll_provider;

typedef struct dopt_comm_vtable {
    const char *name;
    /* The collectives a backend runs itself (see provides). In place on buf (desc->count elements of desc->dtype). */
    dopt_status (*allreduce)(dopt_comm *c, const dopt_coll_desc *desc, void *buf);
    /* Rank r's bytes[r] bytes land at recv + Σ_{q<r} bytes[q]; bytes[] is the same on all ranks. */
    dopt_status (*allgatherv)(dopt_comm *c, const dopt_coll_desc *desc, const void *send, void *recv,
                              const size_t *bytes);
    dopt_status (*broadcast)(dopt_comm *c, const dopt_coll_desc *desc, void *buf);
    dopt_status (*barrier)(dopt_comm *c, const dopt_coll_desc *desc);
    /* Releases the backend's state (not the dopt_comm itself). */
    void (*destroy)(dopt_comm *c);
    /* From here on the vtable may grow; struct_size says how much of it the backend filled. */
    size_t struct_size;
    /* Collectives the backend runs itself (DOPT_PROVIDES_*); the engine runs the others over the
       links. A vtable without links (struct_size too small or link_send NULL) provides them all. */
    unsigned provides;
    /* LINKS: one ordered, reliable byte stream to each peer; none of these may block.
       link_send writes a prefix of parts[0..nparts) and returns its length (0: no room now),
       or -1 with *err = the errno-style reason when the link is broken.
       link_recv reads up to cap bytes; > 0 bytes read, 0 nothing now, -1 the link ended
       (*err = 0: the peer closed it in order; else the reason).
       link_wait sleeps until one of polls[0..npolls) may move or timeout_ms passes (0: look
       without sleeping; it may yield the processor), sets revents and returns how many are
       ready, 0 on timeout, -1 with *err on a failure. An entry without DOPT_LINK_IN (events 0
       included) is a link the engine does not read now; a backend that can tell reports
       DOPT_LINK_IN on it when the peer ended its stream or the link failed, even with bytes
       unread before the end (TCP: a FIN or a reset), and one that cannot reports nothing.
       link_close ends this rank's writing to peer: the peer reads what was written, then the end
       of the stream (TCP: shutdown(SHUT_WR)); reading goes on. Called after an abort. */
    long (*link_send)(dopt_comm *c, int peer, const dopt_iov *parts, int nparts, int *err);
    long (*link_recv)(dopt_comm *c, int peer, void *dst, size_t cap, int *err);
    int (*link_wait)(dopt_comm *c, dopt_link_poll *polls, int npolls, int timeout_ms, int *err);
    void (*link_close)(dopt_comm *c, int peer);
    /* A backend without links that can make groups itself (MPI: MPI_Comm_split): dopt_comm_split
       with every rank's color already checked (>= 0, or DOPT_UNDEFINED: *out stays NULL, but the
       call is collective all the same); *out gets the group. NULL: no groups. */
    dopt_status (*split)(dopt_comm *c, int color, int key, dopt_comm **out);
    /* A backend that started the job's processes itself (shm's fork helper): dopt_comm_finish
       calls it instead of destroying c; it destroys c and returns the job's status (or, in a
       process it forked, exits). NULL: dopt_comm_finish destroys c and returns status. */
    int (*finish)(dopt_comm *c, int status);
    /* Where the collectives run: a backend with links names engine.h's dopt_engine_provider (it
       runs what `provides` leaves out, and exchanges and groups); NULL: dopt_own_provider (the
       functions above; a collective without one fails with DOPT_ERR_UNSUPPORTED). */
    const dopt_coll_provider *(*provider)(void);
    /* A backend whose survivors can agree and go on (dopt_comm_shrink): called on a communicator
       configured with DOPT_SHRINK that failed with PEER_LOST or TIMEOUT; *next gets the
       survivors' communicator. NULL: DOPT_ERR_UNSUPPORTED. */
    dopt_status (*shrink)(dopt_comm *c, dopt_comm **next);
    /* A backend that takes joiners (dopt_comm_grow): called on a healthy communicator configured
       with DOPT_SHRINK; *next gets the grown communicator, or stays NULL when nobody joins.
       NULL: nobody ever joins. */
    dopt_status (*grow)(dopt_comm *c, dopt_comm **next);
    /* Joiners this rank holds now for the next grow. NULL: none ever. */
    int (*joiners_held)(const dopt_comm *c);
} dopt_comm_vtable;

/* The vtable has field f: the backend's struct_size covers it. */
#define DOPT__VT_HAS(vt, f) ((vt)->struct_size >= offsetof(dopt_comm_vtable, f) + sizeof((vt)->f) && (vt)->f != NULL)

/* When the host-aware (two-level) allreduce runs: on the ring path when ranks share hosts (AUTO),
   for every non-empty allreduce (ON), or never (OFF). */
/* What a communicator does when a peer is lost (the transports' config on_peer_lost): end the job
   (DOPT_FAIL, the default) or let the survivors go on (DOPT_SHRINK: dopt_comm_shrink). */
#define DOPT_FAIL 0
#define DOPT_SHRINK 1

#define DOPT_TWO_LEVEL_AUTO 0
#define DOPT_TWO_LEVEL_ON 1
#define DOPT_TWO_LEVEL_OFF (-1)

#define DOPT_DEFAULT_TIMEOUT_MS 300000
#define DOPT_DETAIL_MAX 512
#define DOPT_FRAME_BYTES 48  /* the header before every payload on a link (transport_tcp.h, WIRE FORMAT) */
#define DOPT_FRAME_VERSION 3 /* its version byte */

struct dopt__engine; /* the collective engine's state (private) */
struct dopt__rec;    /* the flight recorder's state (private) */

struct dopt_comm {
    int rank;
    int size;
    const dopt_comm_vtable *vt;
    void *impl;           /* the backend's state */
    int timeout_ms;       /* bound on every blocking wait */
    uint64_t seq;         /* collectives issued so far */
    dopt_status error;    /* DOPT_OK, or the first error (the communicator is poisoned) */
    dopt_log_fn log_fn;
    void *log_user;
    uint64_t *gatherv_sizes; /* allgatherv: every rank's block size and capacity (2·size words) */
    size_t *block_bytes;  /* size entries of scratch for equal-block allgather */
    dopt_traffic traffic; /* what this rank's collectives carried; see COMMUNICATORS */
    const char *api;      /* the distopt call whose collectives run now, named in details; NULL: the caller's */
    int local_ranks;      /* ranks of this communicator on this host, 0 when the backend does not know */
    int one_thread;       /* 1: only the thread that made it may call it (MPI below MPI_THREAD_SERIALIZED);
                             0: any thread, one at a time */
    const dopt_coll_provider *provider; /* where its collectives run (dopt_comm_vtable.provider) */
    struct dopt__engine *eng; /* engine.h's state when the engine runs its collectives; NULL otherwise */
    dopt_comm *root;      /* a group (dopt_comm_split): the communicator whose links it shares; else NULL */
    int *members;         /* a group: the root's rank of each of its ranks; else NULL */
    uint32_t group;       /* 0, or the number dopt_comm_split gave this group (in every frame's header) */
    uint64_t started_seq; /* the sequence number of its newest collective the engine has queued */
    int destroyed;        /* a root dopt_comm_destroy ended while its groups live on: freed with the last of them */
    /* A root and its groups share one fate: the family's first error, kept by the root (a member
       takes it at its next call), and the lowest group number the family has not used. */
    dopt_status family_status;
    char family_detail[DOPT_DETAIL_MAX];
    uint32_t next_group;
    /* Surviving a lost peer (SURVIVING A LOST PEER): what the transport's config said, how many
       shrinks made this communicator, and the rank the failure named (-1: none yet). */
    int on_peer_lost;     /* DOPT_FAIL or DOPT_SHRINK */
    int min_ranks;        /* dopt_comm_shrink fails below this many survivors (0, 1: never) */
    uint32_t epoch;       /* 0 for a communicator a transport made; c->epoch + 1 for dopt_comm_shrink's */
    int grown_from;       /* dopt_comm_grow's next: the members before the grow (ranks at or above it came
                             in by that grow), on every rank of it; 0 for every other communicator */
    int lost_rank;
    char detail[DOPT_DETAIL_MAX];
    struct dopt__rec *rec; /* the flight recorder (a root's; its groups write into it); NULL until used */
};

/* FOR MODULES (the implementation's THE ORDERED WORKER): a thread that runs jobs in order. */
typedef dopt_status (*dopt__job_fn)(void *arg);
typedef struct dopt__worker dopt__worker;

/* A collective in flight (see REQUESTS). A plain value the caller keeps; nothing to free. */
typedef struct dopt_request {
    dopt_comm *comm;
    uint64_t ticket;    /* the engine's request number + 1; 0: completed when it started */
    dopt_status status; /* ticket 0: how it completed */
} dopt_request;

DOPT_DEF dopt_status dopt_comm_create_self(dopt_comm **out);
/* Destroys c. Groups split from it may be destroyed in any order, before or after it (its links
   stay open until the last of them is destroyed). */
DOPT_DEF void dopt_comm_destroy(dopt_comm *c);
/* The last call of every rank (see the manual): destroys c, or for a job the transport forked
   itself exits in the forked ranks and waits for them in rank 0; returns the status to exit with. */
DOPT_DEF int dopt_comm_finish(dopt_comm *c, int status);

/* GROUPS (see the manual). Every rank of c calls these, in the same order as its other
   collectives on c. */
#define DOPT_UNDEFINED (-1) /* a color that joins no group: *out is NULL */
/* The ranks that pass the same color >= 0 form a group, ranked by key then by their rank in c;
   *out is this rank's group (a communicator of its own, sharing c's links), NULL for
   DOPT_UNDEFINED. DOPT_ERR_INVALID on every rank when one passes a color below -1;
   DOPT_ERR_UNSUPPORTED (nothing poisoned) on a transport that cannot (shm beyond 64 ranks). */
DOPT_DEF dopt_status dopt_comm_split(dopt_comm *c, int color, int key, dopt_comm **out);
/* The ranks of c on this rank's host, in the order of c (host: the same host name and network
   namespace, exchanged among the ranks). */
DOPT_DEF dopt_status dopt_comm_split_host(dopt_comm *c, dopt_comm **out);
/* After a lost peer, on a communicator configured with DOPT_SHRINK: the survivors agree on who is
   alive and each gets *next, their communicator (SURVIVING A LOST PEER). Every survivor calls it. */
DOPT_DEF dopt_status dopt_comm_shrink(dopt_comm *c, dopt_comm **next);
DOPT_DEF dopt_status dopt_comm_grow(dopt_comm *c, dopt_comm **next);
DOPT_DEF int dopt_comm_joiners_held(const dopt_comm *c);
DOPT_DEF const char *dopt_comm_detail(const dopt_comm *c);
DOPT_DEF void dopt_comm_set_log(dopt_comm *c, dopt_log_fn fn, void *user);
DOPT_DEF void dopt_comm_set_timeout(dopt_comm *c, int timeout_ms);
/* Payload bytes of every completed collective (c->traffic summed over kinds); 0 for NULL. */
DOPT_DEF uint64_t dopt_comm_traffic_total(const dopt_comm *c);

DOPT_DEF dopt_status dopt_allreduce(dopt_comm *c, void *buf, size_t count, dopt_dtype dt, dopt_op op);
DOPT_DEF dopt_status dopt_allreduce_weighted_mean(dopt_comm *c, void *buf, size_t count, dopt_dtype dt,
                                                  double weight);
DOPT_DEF dopt_status dopt_allgather(dopt_comm *c, const void *send, void *recv, size_t bytes);
DOPT_DEF dopt_status dopt_allgatherv(dopt_comm *c, const void *send, size_t send_bytes, void *recv,
                                     size_t recv_capacity, size_t *recv_bytes);
DOPT_DEF dopt_status dopt_broadcast(dopt_comm *c, void *buf, size_t bytes, int root);
DOPT_DEF dopt_status dopt_barrier(dopt_comm *c);
DOPT_DEF double dopt_mean(dopt_comm *c, double x);

DOPT_DEF dopt_status dopt_allreduce_start(dopt_comm *c, void *buf, size_t count, dopt_dtype dt, dopt_op op,
                                          dopt_request *req);
DOPT_DEF dopt_status dopt_allgather_start(dopt_comm *c, const void *send, void *recv, size_t bytes, dopt_request *req);
DOPT_DEF dopt_status dopt_broadcast_start(dopt_comm *c, void *buf, size_t bytes, int root, dopt_request *req);
DOPT_DEF dopt_status dopt_exchange_start(dopt_comm *c, uint64_t tag, const dopt_xfer *sends, int nsends,
                                         const dopt_xfer *recvs, int nrecvs, dopt_request *req);
DOPT_DEF dopt_status dopt_exchange(dopt_comm *c, uint64_t tag, const dopt_xfer *sends, int nsends,
                                   const dopt_xfer *recvs, int nrecvs);
DOPT_DEF dopt_status dopt_comm_host_layout(const dopt_comm *c, dopt_host_layout *out);
DOPT_DEF int dopt_comm_host_rank(const dopt_comm *c, int host, int local_rank);
DOPT_DEF dopt_status dopt_test(dopt_request *req, int *done);
DOPT_DEF dopt_status dopt_wait(dopt_request *req);

/* For backends. */
DOPT_DEF dopt_status dopt_comm_new(dopt_comm **out, int rank, int size, const dopt_comm_vtable *vt,
                                   void *impl);
DOPT_DEF dopt_status dopt_comm_fail(dopt_comm *c, const dopt_coll_desc *desc, dopt_status s,
                                    const char *fmt, ...) DOPT_PRINTF(4, 5);
DOPT_DEF dopt_status dopt_comm_fail_mismatch(dopt_comm *c, const dopt_coll_desc *mine,
                                             const dopt_coll_desc *theirs, int peer);
DOPT_DEF uint64_t dopt_coll_fingerprint(const dopt_coll_desc *d);
DOPT_DEF int dopt_coll_describe(const dopt_coll_desc *d, char *out, size_t cap);
DOPT_DEF void dopt_comm_log(dopt_comm *c, dopt_log_level level, const char *fmt, ...) DOPT_PRINTF(3, 4);
/* For modules: the call to name in details from now on (the string must outlive it); returns the
   previous label, to put back. */
DOPT_DEF const char *dopt_comm_set_api(dopt_comm *c, const char *api);
/* For backends, once the log callback is installed: how many ranks share this host and its
   cores. In a build with OpenMP (_OPENMP where DISTOPT_IMPLEMENTATION is), with more than one
   rank per host and OMP_NUM_THREADS unset, warns once: each rank would start a thread per core. */
DOPT_DEF void dopt_comm_set_host(dopt_comm *c, int local_ranks, int cores);
/* For backends: the provider that runs a backend's own collectives (vt->allreduce ... barrier);
   every request completes at its start. */
DOPT_DEF const dopt_coll_provider *dopt_own_provider(void);

/* ===================================================================== FLIGHT RECORDER */

/* A 0-1 score of how much this rank's collectives waited for rank's data (see FLIGHT RECORDER). */
DOPT_DEF double dopt_comm_straggler(const dopt_comm *c, int rank);
/* For backends, once the job has formed: bytes every rank of the job holds alike (TCP: the token
   and rank 0's address; shm: the segment's name). The recorder's file is named by their hash. */
DOPT_DEF void dopt_comm_set_job(dopt_comm *c, const void *identity, size_t bytes);

/* The recorder's file, as distopt-inspect reads it (REFERENCE FOR CONTRIBUTORS: FLIGHT RECORDER):
   a header, then DOPT_REC_ENTRIES entries; all fields in the host's byte order. */
#define DOPT_REC_MAGIC 0x31434552544f5044ull /* "DOPTREC1" */
#define DOPT_REC_VERSION 1
#define DOPT_REC_ENTRIES 2048      /* the collectives each rank keeps: the newest, in a ring */
#define DOPT_REC_PEERS 16          /* peers whose data an entry times */
#define DOPT_REC_HEADER_BYTES 1024
#define DOPT_REC_RUNNING 1         /* dopt_rec_header.state: the communicator lives */
#define DOPT_REC_FAILED 2          /* ... it failed (or finished with a failure); the file stays */

/* One peer an entry's collective receives from. */
typedef struct dopt_rec_peer {
    int32_t peer;        /* its rank in the communicator the transport made */
    uint32_t pending;    /* its receives not yet complete (0: all its data arrived) */
    uint32_t arrived_us; /* when the last of them completed, µs after the start (saturates) */
} dopt_rec_peer;

/* One collective or exchange: 256 bytes. A writer makes lock odd, writes, makes it even again. */
typedef struct dopt_rec_entry {
    uint32_t lock;
    uint8_t kind, dtype, op, npeers; /* dopt_coll, dopt_dtype, dopt_op; peers[0..npeers) in use */
    uint64_t seq, count;             /* as dopt_coll_desc */
    uint32_t group;
    int32_t root;
    int32_t status;                  /* a dopt_status once it ended; 0 while in flight */
    uint32_t more_peers;             /* peers it receives from beyond peers[] (not timed) */
    uint64_t start_ns, end_ns;       /* CLOCK_MONOTONIC; end_ns 0: in flight */
    uint64_t last_ns;                /* the newest arrival of a peer's data */
    dopt_rec_peer peers[DOPT_REC_PEERS];
} dopt_rec_entry;

typedef struct dopt_rec_header {
    uint64_t magic;
    uint32_t version, header_bytes, entry_bytes, capacity; /* capacity: DOPT_REC_ENTRIES */
    int32_t rank, size, pid;
    uint32_t state;                  /* DOPT_REC_RUNNING or DOPT_REC_FAILED */
    uint64_t job;                    /* the hash of the job's identity (dopt_comm_set_job) */
    uint64_t written;                /* entries begun; entry k is at k % capacity */
    uint64_t created_ns;
    char transport[16];              /* c->vt->name */
    char detail[DOPT_DETAIL_MAX];    /* the first failure's detail */
} dopt_rec_header;

/* ===================================================================== LAUNCH VARIABLES */

#define DOPT_LAUNCH_ADDR_MAX 255

/* Where this process stands in its job, as its launcher's variables say (see LAUNCH VARIABLES). */
typedef struct dopt_launch_info {
    int rank, world_size;       /* -1: no variable sets them (world_size alone: DOPT_WORLD_SIZE) */
    int local_rank, local_size; /* this host's share of the job; -1: unknown */
    char master_addr[DOPT_LAUNCH_ADDR_MAX + 1]; /* rank 0's host; "": none named */
    int master_port;            /* the rendezvous port; 0: none named or derived */
    char transport[8];          /* DOPT_TRANSPORT: "shm", "tcp", "mpi", "self"; "": unset */
    char job[96];               /* a name every rank of the job shares, from the launcher; "": none */
    const char *launcher;       /* "Open MPI", "PMI", "Slurm", "torchrun", "DOPT" or "" */
    char rank_from[96];         /* the variables rank and world size came from */
    char master_from[128];      /* where master_addr and master_port came from */
} dopt_launch_info;

DOPT_DEF dopt_status dopt_launch_read(dopt_launch_info *info, char *why, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_H */

/* ==================== REFERENCE FOR CONTRIBUTORS ====================
   Not needed to use distopt.h: how a backend plugs in, how modules label their collectives, and
   measured figures.

   WRITING A BACKEND
     A backend with links (an ordered, reliable byte stream to every peer) writes against
     engine.h, whose manual is the contract: the link_* fields of dopt_comm_vtable, with
     struct_size = sizeof(dopt_comm_vtable) and provider = dopt_engine_provider; the engine runs
     every collective over them. A backend with collectives of its own sets their DOPT_PROVIDES_*
     bits and fills allreduce, allgatherv, broadcast, barrier (a vtable without a provider runs
     them all, through dopt_own_provider): those see only SUM, MAX and MIN (MEAN arrives with
     op = DOPT_MEAN in the descriptor for fingerprinting but must be reduced as a SUM; the core
     divides afterwards) and allgatherv with every block size already known, and report errors
     with dopt_comm_fail / dopt_comm_fail_mismatch. Either way the communicator is made with
     dopt_comm_new, and its public calls reach the collectives through c->provider alone.

   MODULES
     A module labels its collectives with dopt_comm_set_api(c, "its call") and puts the previous
     label back after (labels nest), so that details name the call the user made.

   FLIGHT RECORDER
     The file is a dopt_rec_header (the first DOPT_REC_HEADER_BYTES bytes; the rest of them 0),
     then capacity entries of sizeof(dopt_rec_entry) = 256 bytes, in the host's byte order (the
     readers run on the same machine). Entry k of the communicator's collectives is at
     k % capacity; header.written counts the entries begun (stored after the entry is written).
     Each entry has a seqlock: its writer makes lock odd, writes, makes it even again; a reader
     copies an entry and keeps the copy only when lock was even and the same before and after.
     Writers are the threads of the rank's own process, one per entry at a time: the caller
     begins an entry (in dopt__start, before the provider runs), the engine's lock holder times
     its arrivals and ends it (engine.h, lines marked FLIGHT RECORDER). header.state is
     DOPT_REC_FAILED once the communicator failed (header.detail: the first failure's detail);
     a file whose state is DOPT_REC_RUNNING and whose pid is gone belonged to a rank that died.
     Times are CLOCK_MONOTONIC nanoseconds, comparable between the processes of one machine.

   MEASURED
     DOPT_USE_BLAS: dopt_axpy and dopt_scale through OpenBLAS were 10-30% faster at large sizes
     here (bench/bench_kernels.c, make bench).
     Flight recorder (build/bench_recorder, medians of 9 runs of 10^6): a record (begin and end
     of an entry) 54.9 ns, an arrival 26.3 ns, beside a clock_gettime of 27.2 ns; a 1-element
     allreduce on a world of one takes 60.5 ns with the recorder and 15.6 ns without it (the
     cheapest call there is: over links a small allreduce takes tens of microseconds).
*/

/* =====================================================================================
   IMPLEMENTATION — stop reading here if you only want the API.
   ===================================================================================== */

#if defined(DISTOPT_IMPLEMENTATION) && !defined(DOPT__DISTOPT_IMPLEMENTED)
#define DOPT__DISTOPT_IMPLEMENTED

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if !defined(DOPT_NO_THREADS) && (defined(__unix__) || defined(__APPLE__))
#define DOPT__THREADS 1 /* a progress thread is available (dopt_comm_set_progress_thread) */
#include <pthread.h>
#endif
#if defined(_POSIX_C_SOURCE) || defined(_DEFAULT_SOURCE) || defined(_GNU_SOURCE)
#include <sys/stat.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/mman.h>
#define DOPT__REC_FILES 1 /* the flight recorder can map a file another process reads */
#endif

/* x86 with AVX: the double sums use intrinsics (see VECTOR KERNELS) */
#if (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)) && !defined(DOPT_NO_VECTOR_EXT) && defined(__AVX__)
#  include <immintrin.h>
#  define DOPT__AVX_SUMS 1
#endif
/* x86 with AVX-512 or AVX2: Philox runs 16 or 8 blocks per vector register (see PHILOX) */
#if (defined(__clang__) || defined(__GNUC__)) && !defined(DOPT_NO_VECTOR_EXT) && defined(__AVX512F__)
#  include <immintrin.h>
#  define DOPT__AVX512_PHILOX 1
#elif (defined(__clang__) || defined(__GNUC__)) && !defined(DOPT_NO_VECTOR_EXT) && defined(__AVX2__)
#  include <immintrin.h>
#  define DOPT__AVX2_PHILOX 1
#endif
/* GCC 12 in C++ mode warns about the self-initialised placeholder inside its own AVX-512
   intrinsics (_mm512_undefined_epi32) wherever they are inlined: silenced for this file only. */
#if defined(DOPT__AVX512_PHILOX) && defined(__cplusplus) && defined(__GNUC__) && !defined(__clang__)
#  define DOPT__GCC_AVX512_PRAGMAS 1
#  pragma GCC diagnostic push
#  pragma GCC diagnostic ignored "-Wuninitialized"
#  pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#if defined(DOPT_MALLOC) && defined(DOPT_FREE)
#elif !defined(DOPT_MALLOC) && !defined(DOPT_FREE)
#  include <stdlib.h>
#  define DOPT_MALLOC(sz) malloc(sz)
#  define DOPT_FREE(p) free(p)
#else
#  error "distopt: define both DOPT_MALLOC and DOPT_FREE, or neither"
#endif

#ifndef DOPT_ASSERT
#  include <assert.h>
#  define DOPT_ASSERT(x) assert(x)
#endif

#if defined(DOPT_USE_BLAS) && !defined(DOPT_NO_BLAS)
#  define DOPT__BLAS 1
#  include <cblas.h>
/* OpenBLAS takes int counts; longer vectors go through in pieces of this many elements. */
#  define DOPT__BLAS_CHUNK ((size_t)1 << 30)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ===================================================================== STATUS AND VERSION */

DOPT_DEF const char *dopt_status_str(dopt_status s) {
    switch (s) {
    case DOPT_OK: return "ok";
    case DOPT_ERR_INVALID: return "invalid argument";
    case DOPT_ERR_NOMEM: return "out of memory";
    case DOPT_ERR_IO: return "input/output error";
    case DOPT_ERR_TIMEOUT: return "timed out";
    case DOPT_ERR_PEER_LOST: return "peer lost";
    case DOPT_ERR_MISMATCH: return "collective mismatch between ranks";
    case DOPT_ERR_NONFINITE: return "non-finite value";
    case DOPT_ERR_PROTOCOL: return "protocol error";
    case DOPT_ERR_AUTH: return "authentication failed";
    case DOPT_ERR_UNSUPPORTED: return "unsupported";
    case DOPT_ERR_CLOSED: return "closed";
    }
    return "unknown status";
}

DOPT_DEF const char *dopt_version(void) { return DOPT_VERSION_STRING; }

/* ===================================================================== BUFFER DESCRIPTORS */

DOPT_DEF dopt_status dopt_segments_from_sizes(dopt_segment *segs, const size_t *sizes, size_t nsegs,
                                              size_t *total) {
    size_t off = 0, i;
    if (nsegs > 0 && (segs == NULL || sizes == NULL)) return DOPT_ERR_INVALID;
    for (i = 0; i < nsegs; i++) {
        if (sizes[i] > SIZE_MAX - off) return DOPT_ERR_INVALID;
        segs[i].offset = off;
        segs[i].count = sizes[i];
        segs[i].name = NULL;
        segs[i].rows = 0;
        off += sizes[i];
    }
    if (total) *total = off;
    return DOPT_OK;
}

DOPT_DEF dopt_buf dopt_buf_flat(float *data, size_t n, const dopt_segment *segs, size_t nsegs) {
    dopt_buf b;
    memset(&b, 0, sizeof b);
    b.data = data;
    b.n = n;
    b.segs = segs;
    b.nsegs = segs ? nsegs : 0;
    return b;
}

DOPT_DEF dopt_buf dopt_buf_scatter(const dopt_span *spans, size_t nspans) {
    dopt_buf b;
    memset(&b, 0, sizeof b);
    b.spans = spans;
    b.nspans = nspans;
    return b;
}

DOPT_DEF dopt_status dopt_buf_validate(const dopt_buf *b) {
    size_t i, end = 0;
    if (b == NULL) return DOPT_ERR_INVALID;
    if (b->spans != NULL || b->nspans > 0) {
        if (b->data != NULL || b->spans == NULL) return DOPT_ERR_INVALID;
        for (i = 0; i < b->nspans; i++)
            if (b->spans[i].ptr == NULL && b->spans[i].count > 0) return DOPT_ERR_INVALID;
        return DOPT_OK;
    }
    if (b->data == NULL && b->n > 0) return DOPT_ERR_INVALID;
    if (b->nsegs > 0 && b->segs == NULL) return DOPT_ERR_INVALID;
    for (i = 0; i < b->nsegs; i++) {
        const dopt_segment *s = &b->segs[i];
        if (s->offset < end) return DOPT_ERR_INVALID;              /* out of order or overlapping */
        if (s->offset > b->n || s->count > b->n - s->offset) return DOPT_ERR_INVALID;
        end = s->offset + s->count;
    }
    return DOPT_OK;
}

DOPT_DEF size_t dopt_buf_nsegs(const dopt_buf *b) {
    if (b->spans) return b->nspans;
    return b->segs ? b->nsegs : 1;
}

DOPT_DEF dopt_span dopt_buf_segment(const dopt_buf *b, size_t i) {
    dopt_span s;
    DOPT_ASSERT(i < dopt_buf_nsegs(b));
    if (b->spans) return b->spans[i];
    if (b->segs) {
        s.ptr = b->data ? b->data + b->segs[i].offset : NULL;
        s.count = b->segs[i].count;
    } else {
        s.ptr = b->data;
        s.count = b->n;
    }
    return s;
}

DOPT_DEF size_t dopt_buf_count(const dopt_buf *b) {
    size_t i, total = 0, k = dopt_buf_nsegs(b);
    for (i = 0; i < k; i++) total += dopt_buf_segment(b, i).count;
    return total;
}

DOPT_DEF void dopt_buf_pack(const dopt_buf *b, float *dst) {
    size_t i, k = dopt_buf_nsegs(b);
    for (i = 0; i < k; i++) {
        dopt_span s = dopt_buf_segment(b, i);
        if (s.count) memcpy(dst, s.ptr, s.count * sizeof(float));
        dst += s.count;
    }
}

DOPT_DEF void dopt_buf_unpack(const dopt_buf *b, const float *src) {
    size_t i, k = dopt_buf_nsegs(b);
    for (i = 0; i < k; i++) {
        dopt_span s = dopt_buf_segment(b, i);
        if (s.count) memcpy(s.ptr, src, s.count * sizeof(float));
        src += s.count;
    }
}

/* ===================================================================== LITTLE-ENDIAN FIELDS */

/* For the byte layouts other headers put on the wire or in files (TCP frames, compressed
   messages): explicit little-endian, whatever the host. */
DOPT__MAYBE_UNUSED static void dopt__put_le16(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}

DOPT__MAYBE_UNUSED static void dopt__put_le32(unsigned char *p, uint32_t v) {
    dopt__put_le16(p, v & 0xFFFFu);
    dopt__put_le16(p + 2, v >> 16);
}

DOPT__MAYBE_UNUSED static void dopt__put_le64(unsigned char *p, uint64_t v) {
    dopt__put_le32(p, (uint32_t)v);
    dopt__put_le32(p + 4, (uint32_t)(v >> 32));
}

DOPT__MAYBE_UNUSED static uint32_t dopt__get_le16(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8;
}

DOPT__MAYBE_UNUSED static uint32_t dopt__get_le32(const unsigned char *p) {
    return dopt__get_le16(p) | dopt__get_le16(p + 2) << 16;
}

DOPT__MAYBE_UNUSED static uint64_t dopt__get_le64(const unsigned char *p) {
    return (uint64_t)dopt__get_le32(p) | (uint64_t)dopt__get_le32(p + 4) << 32;
}

/* ===================================================================== NAN AND INFINITY BY THEIR BITS */

/* For the modules' checks that must hold in hosts built with -ffast-math or -Ofast, under which
   the compiler may assume that no float is NaN or infinite and fold isnan(), isfinite(), x != x
   and comparisons with infinity to constants: integer tests on the bits survive. */
DOPT__MAYBE_UNUSED static int dopt__is_nan(double v) {
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x7FF0000000000000ull) == 0x7FF0000000000000ull && (u & 0x000FFFFFFFFFFFFFull) != 0;
}

DOPT__MAYBE_UNUSED static int dopt__is_finite(double v) {
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x7FF0000000000000ull) != 0x7FF0000000000000ull;
}

/* ===================================================================== PHILOX-4x32-10 RNG */

#define DOPT__PHILOX_M0 0xD2511F53u
#define DOPT__PHILOX_M1 0xCD9E8D57u
#define DOPT__PHILOX_W0 0x9E3779B9u
#define DOPT__PHILOX_W1 0xBB67AE85u
#define DOPT__RNG_BATCH 32 /* blocks generated together (128 numbers) */

DOPT_DEF void dopt_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3], k0 = key[0], k1 = key[1];
    int r;
    for (r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)DOPT__PHILOX_M0 * c0, p1 = (uint64_t)DOPT__PHILOX_M1 * c2;
        c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c1 = (uint32_t)p1;
        c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c3 = (uint32_t)p0;
        k0 += DOPT__PHILOX_W0;
        k1 += DOPT__PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* splitmix64's finaliser: a bijection on 64 bits with full avalanche. */
static uint64_t dopt__mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

DOPT_DEF uint64_t dopt_seed_for_rank(uint64_t seed, int rank) {
    return dopt__mix64(seed ^ dopt__mix64((uint64_t)(uint32_t)rank + 0x9E3779B97F4A7C15ull));
}

DOPT_DEF void dopt_rng_init(dopt_rng *rng, uint64_t seed, int rank, uint64_t stream) {
    uint64_t k = dopt_seed_for_rank(seed, rank);
    rng->key[0] = (uint32_t)k;
    rng->key[1] = (uint32_t)(k >> 32);
    rng->stream = stream;
}

/* Blocks first_block .. first_block + DOPT__RNG_BATCH - 1, written as 4·BATCH words. The lanes are
   kept in separate arrays so each round is one loop the compiler turns into vector multiplies. */
DOPT__MAYBE_UNUSED static void dopt__philox_batch_portable(const dopt_rng *rng, uint64_t first_block,
                                                             uint32_t *DOPT_RESTRICT out) {
    uint32_t c0[DOPT__RNG_BATCH], c1[DOPT__RNG_BATCH], c2[DOPT__RNG_BATCH], c3[DOPT__RNG_BATCH];
    uint32_t k0 = rng->key[0], k1 = rng->key[1];
    int j, r;
    for (j = 0; j < DOPT__RNG_BATCH; j++) {
        uint64_t b = first_block + (uint64_t)j;
        c0[j] = (uint32_t)b;
        c1[j] = (uint32_t)(b >> 32);
        c2[j] = (uint32_t)rng->stream;
        c3[j] = (uint32_t)(rng->stream >> 32);
    }
    for (r = 0; r < 10; r++) {
        for (j = 0; j < DOPT__RNG_BATCH; j++) {
            uint64_t p0 = (uint64_t)DOPT__PHILOX_M0 * c0[j], p1 = (uint64_t)DOPT__PHILOX_M1 * c2[j];
            uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[j] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3[j] ^ k1;
            c1[j] = (uint32_t)p1;
            c3[j] = (uint32_t)p0;
            c0[j] = n0;
            c2[j] = n2;
        }
        k0 += DOPT__PHILOX_W0;
        k1 += DOPT__PHILOX_W1;
    }
    for (j = 0; j < DOPT__RNG_BATCH; j++) {
        out[4 * j + 0] = c0[j];
        out[4 * j + 1] = c1[j];
        out[4 * j + 2] = c2[j];
        out[4 * j + 3] = c3[j];
    }
}

#if defined(DOPT__AVX512_PHILOX)
/* AVX-512: sixteen blocks per register, one register per counter word. _mm512_mul_epu32
   multiplies the even 32-bit lanes into 64-bit products, so the odd lanes go through a shifted
   copy and masked blends put the halves back in lane order; one ternary-logic op does both xors.
   A round's dependency chain is about ten cycles long, so a full batch runs its two groups of
   sixteen side by side. */
static void dopt__philox16_rounds(__m512i c[][4], int groups, uint32_t key0, uint32_t key1) {
    const __m512i m0 = _mm512_set1_epi64(DOPT__PHILOX_M0), m1 = _mm512_set1_epi64(DOPT__PHILOX_M1);
    const __mmask16 odd = 0xAAAA;
    int r, g;
    for (r = 0; r < 10; r++) {
        __m512i k0 = _mm512_set1_epi32((int)key0), k1 = _mm512_set1_epi32((int)key1);
        for (g = 0; g < groups; g++) {
            __m512i e0 = _mm512_mul_epu32(c[g][0], m0), o0 = _mm512_mul_epu32(_mm512_srli_epi64(c[g][0], 32), m0);
            __m512i e1 = _mm512_mul_epu32(c[g][2], m1), o1 = _mm512_mul_epu32(_mm512_srli_epi64(c[g][2], 32), m1);
            __m512i hi0 = _mm512_mask_blend_epi32(odd, _mm512_srli_epi64(e0, 32), o0);
            __m512i hi1 = _mm512_mask_blend_epi32(odd, _mm512_srli_epi64(e1, 32), o1);
            __m512i n0 = _mm512_ternarylogic_epi32(hi1, c[g][1], k0, 0x96);
            __m512i n2 = _mm512_ternarylogic_epi32(hi0, c[g][3], k1, 0x96);
            c[g][1] = _mm512_mask_blend_epi32(odd, e1, _mm512_slli_epi64(o1, 32));
            c[g][3] = _mm512_mask_blend_epi32(odd, e0, _mm512_slli_epi64(o0, 32));
            c[g][0] = n0;
            c[g][2] = n2;
        }
        key0 += DOPT__PHILOX_W0;
        key1 += DOPT__PHILOX_W1;
    }
}

/* Counter words of blocks b .. b+15, the high word carried where the low one wraps. */
static void dopt__philox16_counters(const dopt_rng *rng, uint64_t b, __m512i c[4]) {
    if ((uint32_t)b <= 0xFFFFFFFFu - 15u) {
        c[0] = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)b),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        c[1] = _mm512_set1_epi32((int)(uint32_t)(b >> 32));
    } else {
        uint32_t lo[16], hi[16];
        int j;
        for (j = 0; j < 16; j++) {
            lo[j] = (uint32_t)(b + (uint64_t)j);
            hi[j] = (uint32_t)((b + (uint64_t)j) >> 32);
        }
        c[0] = _mm512_loadu_si512((const void *)lo);
        c[1] = _mm512_loadu_si512((const void *)hi);
    }
    c[2] = _mm512_set1_epi32((int)(uint32_t)rng->stream);
    c[3] = _mm512_set1_epi32((int)(uint32_t)(rng->stream >> 32));
}

/* Lanes hold word w of blocks 0..15 in c[w]; the stream wants block by block: a 4x16 transpose. */
static void dopt__philox16_store(const __m512i c[4], uint32_t *out) {
    __m512i u0 = _mm512_unpacklo_epi32(c[0], c[1]), u1 = _mm512_unpackhi_epi32(c[0], c[1]);
    __m512i u2 = _mm512_unpacklo_epi32(c[2], c[3]), u3 = _mm512_unpackhi_epi32(c[2], c[3]);
    __m512i v0 = _mm512_unpacklo_epi64(u0, u2), v1 = _mm512_unpackhi_epi64(u0, u2); /* blocks 4L, 4L+1 */
    __m512i v2 = _mm512_unpacklo_epi64(u1, u3), v3 = _mm512_unpackhi_epi64(u1, u3); /* blocks 4L+2, 4L+3 */
    __m512i w0 = _mm512_shuffle_i32x4(v0, v1, 0x44), w1 = _mm512_shuffle_i32x4(v2, v3, 0x44);
    __m512i w2 = _mm512_shuffle_i32x4(v0, v1, 0xEE), w3 = _mm512_shuffle_i32x4(v2, v3, 0xEE);
    _mm512_storeu_si512((void *)out, _mm512_shuffle_i32x4(w0, w1, 0x88));
    _mm512_storeu_si512((void *)(out + 16), _mm512_shuffle_i32x4(w0, w1, 0xDD));
    _mm512_storeu_si512((void *)(out + 32), _mm512_shuffle_i32x4(w2, w3, 0x88));
    _mm512_storeu_si512((void *)(out + 48), _mm512_shuffle_i32x4(w2, w3, 0xDD));
}

/* groups · 16 blocks from first_block: groups · 64 words. */
static void dopt__philox_groups(const dopt_rng *rng, uint64_t first_block, int groups, uint32_t *out) {
    __m512i c[2][4];
    int g;
    for (g = 0; g < groups; g++) dopt__philox16_counters(rng, first_block + (uint64_t)(16 * g), c[g]);
    dopt__philox16_rounds(c, groups, rng->key[0], rng->key[1]);
    for (g = 0; g < groups; g++) dopt__philox16_store(c[g], out + 64 * g);
}

static void dopt__philox_batch(const dopt_rng *rng, uint64_t first_block, uint32_t *DOPT_RESTRICT out) {
    dopt__philox_groups(rng, first_block, DOPT__RNG_BATCH / 16, out);
}
#define DOPT__PHILOX_HALF_BATCH 1 /* 16 blocks (64 words) also go through the vector path */
#elif defined(DOPT__AVX2_PHILOX)
/* The same blocks with AVX2, eight per register: _mm256_mul_epu32 multiplies the even 32-bit lanes
   into 64-bit products, so the odd lanes go through a shifted copy, and blends put the low and
   high halves back in lane order. GCC does not find this form from the portable loop (it
   vectorizes only the set-up). */
static __m256i dopt__mul_lo32(__m256i even, __m256i odd) {
    return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

static __m256i dopt__mul_hi32(__m256i even, __m256i odd) {
    return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/* One round's dependency chain (shift, multiply, blend, xor) is about ten cycles long, so the
   groups of eight blocks go through the rounds side by side: their chains overlap. */
#define DOPT__PHILOX_GROUPS (DOPT__RNG_BATCH / 8)

static void dopt__philox8_avx2(__m256i c[DOPT__PHILOX_GROUPS][4], uint32_t key0, uint32_t key1) {
    const __m256i m0 = _mm256_set1_epi64x(DOPT__PHILOX_M0), m1 = _mm256_set1_epi64x(DOPT__PHILOX_M1);
    int r, g;
    for (r = 0; r < 10; r++) {
        __m256i k0 = _mm256_set1_epi32((int)key0), k1 = _mm256_set1_epi32((int)key1);
        for (g = 0; g < DOPT__PHILOX_GROUPS; g++) {
            __m256i e0 = _mm256_mul_epu32(c[g][0], m0), o0 = _mm256_mul_epu32(_mm256_srli_epi64(c[g][0], 32), m0);
            __m256i e1 = _mm256_mul_epu32(c[g][2], m1), o1 = _mm256_mul_epu32(_mm256_srli_epi64(c[g][2], 32), m1);
            __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(dopt__mul_hi32(e1, o1), c[g][1]), k0);
            __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(dopt__mul_hi32(e0, o0), c[g][3]), k1);
            c[g][1] = dopt__mul_lo32(e1, o1);
            c[g][3] = dopt__mul_lo32(e0, o0);
            c[g][0] = n0;
            c[g][2] = n2;
        }
        key0 += DOPT__PHILOX_W0;
        key1 += DOPT__PHILOX_W1;
    }
}

/* Counters of blocks b .. b+7: the low words in lanes, the high word carried where it wraps. */
static void dopt__philox8_counters(uint64_t b, __m256i *lo, __m256i *hi) {
    const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    if ((uint32_t)b <= 0xFFFFFFFFu - 7u) {
        *lo = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)b), step);
        *hi = _mm256_set1_epi32((int)(uint32_t)(b >> 32));
    } else {
        uint32_t l[8], h[8];
        int j;
        for (j = 0; j < 8; j++) {
            l[j] = (uint32_t)(b + (uint64_t)j);
            h[j] = (uint32_t)((b + (uint64_t)j) >> 32);
        }
        *lo = _mm256_loadu_si256((const __m256i *)(const void *)l);
        *hi = _mm256_loadu_si256((const __m256i *)(const void *)h);
    }
}

/* Lanes hold word w of blocks 0..7 in c[w]; the stream wants block by block: a 4x8 transpose. */
static void dopt__philox8_store(const __m256i c[4], uint32_t *out) {
    __m256i t0 = _mm256_unpacklo_epi32(c[0], c[1]), t1 = _mm256_unpacklo_epi32(c[2], c[3]);
    __m256i t2 = _mm256_unpackhi_epi32(c[0], c[1]), t3 = _mm256_unpackhi_epi32(c[2], c[3]);
    __m256i r0 = _mm256_unpacklo_epi64(t0, t1), r1 = _mm256_unpackhi_epi64(t0, t1); /* blocks 0|4, 1|5 */
    __m256i r2 = _mm256_unpacklo_epi64(t2, t3), r3 = _mm256_unpackhi_epi64(t2, t3); /* blocks 2|6, 3|7 */
    _mm256_storeu_si256((__m256i *)(void *)(out + 0), _mm256_permute2x128_si256(r0, r1, 0x20));
    _mm256_storeu_si256((__m256i *)(void *)(out + 8), _mm256_permute2x128_si256(r2, r3, 0x20));
    _mm256_storeu_si256((__m256i *)(void *)(out + 16), _mm256_permute2x128_si256(r0, r1, 0x31));
    _mm256_storeu_si256((__m256i *)(void *)(out + 24), _mm256_permute2x128_si256(r2, r3, 0x31));
}

static void dopt__philox_batch(const dopt_rng *rng, uint64_t first_block, uint32_t *DOPT_RESTRICT out) {
    __m256i c[DOPT__PHILOX_GROUPS][4];
    int g;
    for (g = 0; g < DOPT__PHILOX_GROUPS; g++) {
        dopt__philox8_counters(first_block + (uint64_t)(8 * g), &c[g][0], &c[g][1]);
        c[g][2] = _mm256_set1_epi32((int)(uint32_t)rng->stream);
        c[g][3] = _mm256_set1_epi32((int)(uint32_t)(rng->stream >> 32));
    }
    dopt__philox8_avx2(c, rng->key[0], rng->key[1]);
    for (g = 0; g < DOPT__PHILOX_GROUPS; g++) dopt__philox8_store(c[g], out + 32 * g);
}
#else
#define dopt__philox_batch dopt__philox_batch_portable
#endif

DOPT_DEF void dopt_rng_u32(const dopt_rng *rng, uint64_t first, uint32_t *out, size_t n) {
    uint32_t words[4 * DOPT__RNG_BATCH];
    while (n > 0) {
        uint64_t block = first / 4;
        size_t skip = (size_t)(first % 4), take;
        if (skip == 0 && n >= 4 * DOPT__RNG_BATCH) {
            dopt__philox_batch(rng, block, out);
            take = 4 * DOPT__RNG_BATCH;
#ifdef DOPT__PHILOX_HALF_BATCH
        } else if (skip == 0 && n >= 64) {
            dopt__philox_groups(rng, block, 1, out);
            take = 64;
#endif
        } else {
            uint32_t ctr[4];
            ctr[0] = (uint32_t)block;
            ctr[1] = (uint32_t)(block >> 32);
            ctr[2] = (uint32_t)rng->stream;
            ctr[3] = (uint32_t)(rng->stream >> 32);
            dopt_philox4x32(ctr, rng->key, words);
            take = 4 - skip < n ? 4 - skip : n;
            memcpy(out, words + skip, take * sizeof(uint32_t));
        }
        out += take;
        first += take;
        n -= take;
    }
}

DOPT_DEF void dopt_rng_uniform(const dopt_rng *rng, uint64_t first, float *out, size_t n) {
    uint32_t words[4 * DOPT__RNG_BATCH];
    while (n > 0) {
        size_t take = n < 4 * DOPT__RNG_BATCH ? n : 4 * DOPT__RNG_BATCH, j;
        dopt_rng_u32(rng, first, words, take);
        if (take == 4 * DOPT__RNG_BATCH) /* a constant trip count: vectorized at -O2 */
            for (j = 0; j < 4 * DOPT__RNG_BATCH; j++) out[j] = (float)(words[j] >> 8) * (1.0f / 16777216.0f);
        else
            for (j = 0; j < take; j++) out[j] = (float)(words[j] >> 8) * (1.0f / 16777216.0f);
        out += take;
        first += take;
        n -= take;
    }
}

/* ===================================================================== VECTOR KERNELS */

/* Reductions keep DOPT__LANES independent accumulators: without -ffast-math the compiler may not
   reorder one accumulator's additions, but it does vectorize across the lanes. The order is fixed
   by the code, so results do not depend on the compiler or the vector width. */
#define DOPT__LANES 16

DOPT_DEF size_t dopt_dtype_size(dopt_dtype dt) {
    switch (dt) {
    case DOPT_F32: return 4;
    case DOPT_F64: return 8;
    case DOPT_I32: return 4;
    case DOPT_I64: return 8;
    }
    return 0;
}

DOPT_DEF const char *dopt_dtype_name(dopt_dtype dt) {
    switch (dt) {
    case DOPT_F32: return "f32";
    case DOPT_F64: return "f64";
    case DOPT_I32: return "i32";
    case DOPT_I64: return "i64";
    }
    return "?";
}

DOPT_DEF const char *dopt_op_name(dopt_op op) {
    switch (op) {
    case DOPT_SUM: return "sum";
    case DOPT_MAX: return "max";
    case DOPT_MIN: return "min";
    case DOPT_MEAN: return "mean";
    }
    return "?";
}

static double dopt__sum_lanes(const double *acc) {
    double s = 0.0;
    int j;
    for (j = 0; j < DOPT__LANES; j++) s += acc[j];
    return s;
}

/* The main loops run over whole blocks of DOPT__LANES with a constant inner trip count: that shape
   is vectorized even at -O2 (GCC's "very cheap" cost model refuses loops that need a scalar
   epilogue). Tails go to separate scalars so the lane accumulators can live in registers. These
   portable forms are what other compilers get, and what the tests hold the vector forms to. */
DOPT__MAYBE_UNUSED static double dopt__sumsq_portable(const float *x, size_t n) {
    double acc[DOPT__LANES] = {0}, tail = 0.0;
    size_t i, n_main = n - n % DOPT__LANES;
    int j;
    for (i = 0; i < n_main; i += DOPT__LANES)
        for (j = 0; j < DOPT__LANES; j++) acc[j] += (double)x[i + j] * (double)x[i + j];
    for (i = n_main; i < n; i++) tail += (double)x[i] * (double)x[i];
    return dopt__sum_lanes(acc) + tail;
}

DOPT__MAYBE_UNUSED static double dopt__dot_portable(const float *x, const float *y, size_t n) {
    double acc[DOPT__LANES] = {0}, tail = 0.0;
    size_t i, n_main = n - n % DOPT__LANES;
    int j;
    for (i = 0; i < n_main; i += DOPT__LANES)
        for (j = 0; j < DOPT__LANES; j++) acc[j] += (double)x[i + j] * (double)y[i + j];
    for (i = n_main; i < n; i++) tail += (double)x[i] * (double)y[i];
    return dopt__sum_lanes(acc) + tail;
}

/* Sums of (x - shift) and their squares; shift = x[0] keeps them small when the mean is large
   against the spread, which is what makes the one-pass formula lose digits. */
DOPT__MAYBE_UNUSED static void dopt__shifted_sums_portable(const float *x, size_t n, double shift, double *s1_out, double *s2_out) {
    double s1[DOPT__LANES] = {0}, s2[DOPT__LANES] = {0}, t1 = 0.0, t2 = 0.0;
    size_t i, n_main = n - n % DOPT__LANES;
    int j;
    for (i = 0; i < n_main; i += DOPT__LANES)
        for (j = 0; j < DOPT__LANES; j++) {
            double d = (double)x[i + j] - shift;
            s1[j] += d;
            s2[j] += d * d;
        }
    for (i = n_main; i < n; i++) {
        double d = (double)x[i] - shift;
        t1 += d;
        t2 += d * d;
    }
    *s1_out = dopt__sum_lanes(s1) + t1;
    *s2_out = dopt__sum_lanes(s2) + t2;
}

#if (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)) && !defined(DOPT_NO_VECTOR_EXT)
/* ---- the same sums with GCC/Clang vector types ----
   Widening float to double is the bottleneck of these loops; without explicit vectors GCC -O2
   keeps the lane array in memory and runs at about half the read bandwidth (bench_kernels).
   Four independent 4-wide double accumulators keep the adds' latency hidden, and 32-byte vectors
   lower well on every x86-64 level (64-byte ones are slow without AVX-512). */
#define DOPT__VECTOR_SUMS 1
typedef float dopt__v4f __attribute__((vector_size(16)));
typedef double dopt__v4d __attribute__((vector_size(32)));

/* Macros, not functions: a function taking or returning a 32-byte vector changes the ABI when AVX
   is off, which GCC warns about. */
#define DOPT__WIDEN4(p) __builtin_convertvector(dopt__load4f(p), dopt__v4d)
#define DOPT__HSUM4(a) (((a)[0] + (a)[1]) + ((a)[2] + (a)[3]))

DOPT__MAYBE_UNUSED static dopt__v4f dopt__load4f(const float *p) {
    dopt__v4f f;
    memcpy(&f, p, sizeof f); /* unaligned load */
    return f;
}

#ifdef DOPT__AVX_SUMS
/* On x86 with AVX the same sums through intrinsics: GCC 12 lowers __builtin_convertvector of 4
   floats to two half-width conversions and an insert, which caps these loops near 4.5 Gelem/s
   even in cache. The product of two floats is exact in double, so a fused multiply-add rounds
   exactly as a + x·y does: same accumulators, same order, same bits as the portable-vector form.
   The prefetch 8 KiB ahead keeps enough misses in flight to stream at read bandwidth where the
   hardware prefetcher alone does not (bench_clip: 1.9 -> 7.1 Gelem/s at 1e7). The address is
   computed as an integer: it may lie past the end of the array. */
#define DOPT__PREFETCH_AHEAD(p) _mm_prefetch((const char *)((uintptr_t)(p) + 8192u), _MM_HINT_T0)
#ifdef __FMA__
#  define DOPT__MUL_ADD(acc, a, b) _mm256_fmadd_pd(a, b, acc)
#else
#  define DOPT__MUL_ADD(acc, a, b) _mm256_add_pd(acc, _mm256_mul_pd(a, b))
#endif
#define DOPT__CVT4(p) _mm256_cvtps_pd(_mm_loadu_ps(p))

static double dopt__hsum_avx(__m256d a0, __m256d a1, __m256d a2, __m256d a3) {
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

DOPT__MAYBE_UNUSED static double dopt__sumsq_vector(const float *x, size_t n) {
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    size_t i, n_main = n - n % 16;
    for (i = 0; i < n_main; i += 16) {
        __m256d d0 = DOPT__CVT4(x + i), d1 = DOPT__CVT4(x + i + 4), d2 = DOPT__CVT4(x + i + 8), d3 = DOPT__CVT4(x + i + 12);
        DOPT__PREFETCH_AHEAD(x + i);
        a0 = DOPT__MUL_ADD(a0, d0, d0);
        a1 = DOPT__MUL_ADD(a1, d1, d1);
        a2 = DOPT__MUL_ADD(a2, d2, d2);
        a3 = DOPT__MUL_ADD(a3, d3, d3);
    }
    return dopt__hsum_avx(a0, a1, a2, a3) + dopt__sumsq_portable(x + n_main, n - n_main);
}

DOPT__MAYBE_UNUSED static double dopt__dot_vector(const float *x, const float *y, size_t n) {
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    size_t i, n_main = n - n % 16;
    for (i = 0; i < n_main; i += 16) {
        DOPT__PREFETCH_AHEAD(x + i);
        DOPT__PREFETCH_AHEAD(y + i);
        a0 = DOPT__MUL_ADD(a0, DOPT__CVT4(x + i), DOPT__CVT4(y + i));
        a1 = DOPT__MUL_ADD(a1, DOPT__CVT4(x + i + 4), DOPT__CVT4(y + i + 4));
        a2 = DOPT__MUL_ADD(a2, DOPT__CVT4(x + i + 8), DOPT__CVT4(y + i + 8));
        a3 = DOPT__MUL_ADD(a3, DOPT__CVT4(x + i + 12), DOPT__CVT4(y + i + 12));
    }
    return dopt__hsum_avx(a0, a1, a2, a3) + dopt__dot_portable(x + n_main, y + n_main, n - n_main);
}

DOPT__MAYBE_UNUSED static void dopt__shifted_sums_vector(const float *x, size_t n, double shift, double *s1_out,
                                                         double *s2_out) {
    __m256d p0 = _mm256_setzero_pd(), p1 = p0, q0 = p0, q1 = p0, sh = _mm256_set1_pd(shift), z = p0;
    size_t i, n_main = n - n % 8;
    double t1, t2;
    for (i = 0; i < n_main; i += 8) {
        __m256d d0 = _mm256_sub_pd(DOPT__CVT4(x + i), sh), d1 = _mm256_sub_pd(DOPT__CVT4(x + i + 4), sh);
        DOPT__PREFETCH_AHEAD(x + i);
        p0 = _mm256_add_pd(p0, d0);
        p1 = _mm256_add_pd(p1, d1);
        q0 = DOPT__MUL_ADD(q0, d0, d0);
        q1 = DOPT__MUL_ADD(q1, d1, d1);
    }
    dopt__shifted_sums_portable(x + n_main, n - n_main, shift, &t1, &t2);
    *s1_out = dopt__hsum_avx(p0, p1, z, z) + t1;
    *s2_out = dopt__hsum_avx(q0, q1, z, z) + t2;
}
#else
DOPT__MAYBE_UNUSED static double dopt__sumsq_vector(const float *x, size_t n) {
    dopt__v4d a0 = {0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0;
    size_t i, n_main = n - n % 16;
    for (i = 0; i < n_main; i += 16) {
        dopt__v4d d0 = DOPT__WIDEN4(x + i), d1 = DOPT__WIDEN4(x + i + 4);
        dopt__v4d d2 = DOPT__WIDEN4(x + i + 8), d3 = DOPT__WIDEN4(x + i + 12);
        a0 += d0 * d0;
        a1 += d1 * d1;
        a2 += d2 * d2;
        a3 += d3 * d3;
    }
    return DOPT__HSUM4((a0 + a1) + (a2 + a3)) + dopt__sumsq_portable(x + n_main, n - n_main);
}

DOPT__MAYBE_UNUSED static double dopt__dot_vector(const float *x, const float *y, size_t n) {
    dopt__v4d a0 = {0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0;
    size_t i, n_main = n - n % 16;
    for (i = 0; i < n_main; i += 16) {
        a0 += DOPT__WIDEN4(x + i) * DOPT__WIDEN4(y + i);
        a1 += DOPT__WIDEN4(x + i + 4) * DOPT__WIDEN4(y + i + 4);
        a2 += DOPT__WIDEN4(x + i + 8) * DOPT__WIDEN4(y + i + 8);
        a3 += DOPT__WIDEN4(x + i + 12) * DOPT__WIDEN4(y + i + 12);
    }
    return DOPT__HSUM4((a0 + a1) + (a2 + a3)) + dopt__dot_portable(x + n_main, y + n_main, n - n_main);
}
DOPT__MAYBE_UNUSED static void dopt__shifted_sums_vector(const float *x, size_t n, double shift, double *s1_out, double *s2_out) {
    dopt__v4d p0 = {0, 0, 0, 0}, p1 = p0, q0 = p0, q1 = p0, sh = {shift, shift, shift, shift};
    size_t i, n_main = n - n % 8;
    double t1, t2;
    for (i = 0; i < n_main; i += 8) {
        dopt__v4d d0 = DOPT__WIDEN4(x + i) - sh, d1 = DOPT__WIDEN4(x + i + 4) - sh;
        p0 += d0;
        p1 += d1;
        q0 += d0 * d0;
        q1 += d1 * d1;
    }
    dopt__shifted_sums_portable(x + n_main, n - n_main, shift, &t1, &t2);
    *s1_out = DOPT__HSUM4(p0 + p1) + t1;
    *s2_out = DOPT__HSUM4(q0 + q1) + t2;
}
#endif

#define DOPT__SUMSQ dopt__sumsq_vector
#define DOPT__DOT dopt__dot_vector
#define DOPT__SHIFTED_SUMS dopt__shifted_sums_vector
#else
#define DOPT__SUMSQ dopt__sumsq_portable
#define DOPT__DOT dopt__dot_portable
#define DOPT__SHIFTED_SUMS dopt__shifted_sums_portable
#endif

DOPT_DEF double dopt_sumsq(const float *x, size_t n) { return DOPT__SUMSQ(x, n); }

DOPT_DEF double dopt_dot(const float *x, const float *y, size_t n) { return DOPT__DOT(x, y, n); }

/* axpy and scale go to OpenBLAS with DOPT_USE_BLAS: bench_kernels measures its kernels 10-30%
   ahead of these loops at every size. Not so the rest: snrm2 is slower than dopt_sumsq, isamax
   no faster than dopt_maxabs, and dsdot (twice as fast) loses about 1e-7 relative accuracy on
   1e6 elements in this OpenBLAS build, which test_core catches, so dot stays here too. */
DOPT__MAYBE_UNUSED static void dopt__axpy_portable(float *DOPT_RESTRICT y, float a, const float *DOPT_RESTRICT x, size_t n) {
    size_t i, n_main = n - n % DOPT__LANES;
    int j;
    for (i = 0; i < n_main; i += DOPT__LANES)
        for (j = 0; j < DOPT__LANES; j++) y[i + j] += a * x[i + j];
    for (i = n_main; i < n; i++) y[i] += a * x[i];
}

DOPT__MAYBE_UNUSED static void dopt__scale_portable(float *x, float a, size_t n) {
    size_t i, n_main = n - n % DOPT__LANES;
    int j;
    for (i = 0; i < n_main; i += DOPT__LANES)
        for (j = 0; j < DOPT__LANES; j++) x[i + j] *= a;
    for (i = n_main; i < n; i++) x[i] *= a;
}

DOPT_DEF void dopt_axpy(float *DOPT_RESTRICT y, float a, const float *DOPT_RESTRICT x, size_t n) {
#ifdef DOPT__BLAS
    while (n > 0) {
        size_t k = n < DOPT__BLAS_CHUNK ? n : DOPT__BLAS_CHUNK;
        cblas_saxpy((int)k, a, x, 1, y, 1);
        x += k;
        y += k;
        n -= k;
    }
#else
    dopt__axpy_portable(y, a, x, n);
#endif
}

DOPT_DEF void dopt_scale(float *x, float a, size_t n) {
#ifdef DOPT__BLAS
    while (n > 0) {
        size_t k = n < DOPT__BLAS_CHUNK ? n : DOPT__BLAS_CHUNK;
        cblas_sscal((int)k, a, x, 1);
        x += k;
        n -= k;
    }
#else
    dopt__scale_portable(x, a, n);
#endif
}

DOPT_DEF float dopt_maxabs(const float *x, size_t n) {
    float acc[DOPT__LANES] = {0}, m = 0.0f;
    size_t i, n_main = n - n % DOPT__LANES;
    int j;
    /* "a > m ? a : m" skips NaN and compiles to a vector max. */
    for (i = 0; i < n_main; i += DOPT__LANES)
        for (j = 0; j < DOPT__LANES; j++) {
            float a = fabsf(x[i + j]);
            acc[j] = a > acc[j] ? a : acc[j];
        }
    for (j = 0; j < DOPT__LANES; j++) m = acc[j] > m ? acc[j] : m;
    for (i = n_main; i < n; i++) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    return m;
}

DOPT_DEF void dopt_mean_var(const float *x, size_t n, double *mean, double *var) {
    double shift, d1, d2;
    if (n == 0) {
        *mean = 0.0;
        *var = 0.0;
        return;
    }
    shift = (double)x[0];
    DOPT__SHIFTED_SUMS(x, n, shift, &d1, &d2);
    d1 /= (double)n;
    d2 /= (double)n;
    *mean = shift + d1;
    *var = d2 - d1 * d1 > 0.0 ? d2 - d1 * d1 : 0.0;
}

/* An exponent of all ones is NaN or Inf; integer tests vectorize and never trap. Each lane keeps
   the largest exponent field it saw: one and and one max per vector, over four blocks at once so
   that the check keeps up with a copy at cache speed (measured: as fast as memcpy from 256 KiB to
   16 MiB). With COPY, the same loop copies. */
#define DOPT__FINITE_BLOCK(COPY, dst, x, i, acc)                                                    \
    do {                                                                                            \
        uint32_t v_[DOPT__LANES];                                                                   \
        int j_;                                                                                     \
        memcpy(v_, &(x)[i], sizeof v_);                                                             \
        if (COPY) memcpy(&(dst)[i], v_, sizeof v_);                                                 \
        for (j_ = 0; j_ < DOPT__LANES; j_++) {                                                      \
            uint32_t e_ = v_[j_] & 0x7F800000u;                                                     \
            (acc)[j_] = (acc)[j_] > e_ ? (acc)[j_] : e_;                                            \
        }                                                                                           \
    } while (0)

#define DOPT__FINITE_SCAN(COPY, dst, x, n, any)                                                     \
    do {                                                                                            \
        uint32_t m0_[DOPT__LANES] = {0}, m1_[DOPT__LANES] = {0}, m2_[DOPT__LANES] = {0};           \
        uint32_t m3_[DOPT__LANES] = {0};                                                            \
        size_t i_, n_main_ = (n) - (n) % (4 * DOPT__LANES);                                         \
        int j_;                                                                                     \
        for (i_ = 0; i_ < n_main_; i_ += 4 * DOPT__LANES) {                                         \
            DOPT__FINITE_BLOCK(COPY, dst, x, i_, m0_);                                              \
            DOPT__FINITE_BLOCK(COPY, dst, x, i_ + DOPT__LANES, m1_);                                \
            DOPT__FINITE_BLOCK(COPY, dst, x, i_ + 2 * DOPT__LANES, m2_);                            \
            DOPT__FINITE_BLOCK(COPY, dst, x, i_ + 3 * DOPT__LANES, m3_);                            \
        }                                                                                           \
        for (i_ = n_main_; i_ < (n); i_++) {                                                        \
            uint32_t u_;                                                                            \
            memcpy(&u_, &(x)[i_], sizeof u_);                                                       \
            (any) |= (uint32_t)((u_ & 0x7F800000u) == 0x7F800000u);                                 \
            if (COPY) memcpy(&(dst)[i_], &u_, sizeof u_);                                           \
        }                                                                                           \
        for (j_ = 0; j_ < DOPT__LANES; j_++)                                                        \
            (any) |= (uint32_t)(m0_[j_] == 0x7F800000u) | (uint32_t)(m1_[j_] == 0x7F800000u) |       \
                     (uint32_t)(m2_[j_] == 0x7F800000u) | (uint32_t)(m3_[j_] == 0x7F800000u);       \
    } while (0)

DOPT_DEF int dopt_all_finite(const float *x, size_t n) {
    uint32_t any = 0;
    float *none = NULL;
    DOPT__FINITE_SCAN(0, none, x, n, any);
    return any == 0;
}

DOPT_DEF int dopt_copy_finite(float *DOPT_RESTRICT dst, const float *DOPT_RESTRICT src, size_t n) {
    uint32_t any = 0;
    DOPT__FINITE_SCAN(1, dst, src, n, any);
    return any == 0;
}

/* dst ∘= src over whole blocks of DOPT__LANES, then the tail (see dopt_sumsq for why). */
#define DOPT__REDUCE_BLOCKS(T, d, s, count, EXPR)                                                   \
    do {                                                                                            \
        size_t i_, n_main_ = (count) - (count) % DOPT__LANES;                                       \
        int j_;                                                                                     \
        for (i_ = 0; i_ < n_main_; i_ += DOPT__LANES)                                               \
            for (j_ = 0; j_ < DOPT__LANES; j_++) {                                                  \
                T a_ = d[i_ + j_], b_ = s[i_ + j_];                                                 \
                d[i_ + j_] = EXPR;                                                                  \
            }                                                                                       \
        for (i_ = n_main_; i_ < (count); i_++) {                                                    \
            T a_ = d[i_], b_ = s[i_];                                                               \
            d[i_] = EXPR;                                                                           \
        }                                                                                           \
    } while (0)

/* One function per type with restrict parameters: GCC honours restrict on parameters, and
   without it the -O2 vectorizer would need a run-time overlap check, which it refuses to add. */
#define DOPT__DEFINE_REDUCE(NAME, T)                                                                \
    static void NAME(T *DOPT_RESTRICT d, const T *DOPT_RESTRICT s, size_t count, dopt_op op) {     \
        if (op == DOPT_MAX)                                                                         \
            DOPT__REDUCE_BLOCKS(T, d, s, count, b_ > a_ ? b_ : a_);                                 \
        else if (op == DOPT_MIN)                                                                    \
            DOPT__REDUCE_BLOCKS(T, d, s, count, b_ < a_ ? b_ : a_);                                 \
        else                                                                                        \
            DOPT__REDUCE_BLOCKS(T, d, s, count, a_ + b_);                                           \
    }

DOPT__DEFINE_REDUCE(dopt__reduce_f32, float)
DOPT__DEFINE_REDUCE(dopt__reduce_f64, double)
DOPT__DEFINE_REDUCE(dopt__reduce_i32, int32_t)
DOPT__DEFINE_REDUCE(dopt__reduce_i64, int64_t)

DOPT_DEF void dopt_reduce(void *dst, const void *src, size_t count, dopt_dtype dt, dopt_op op) {
    switch (dt) {
    case DOPT_F32: dopt__reduce_f32((float *)dst, (const float *)src, count, op); break;
    case DOPT_F64: dopt__reduce_f64((double *)dst, (const double *)src, count, op); break;
    case DOPT_I32: dopt__reduce_i32((int32_t *)dst, (const int32_t *)src, count, op); break;
    case DOPT_I64: dopt__reduce_i64((int64_t *)dst, (const int64_t *)src, count, op); break;
    }
}

/* ===================================================================== LAUNCH VARIABLES */

/* For transports reading their launch variables: 1 and *out when var holds a whole number in
   [min, max]; 0 when it is unset or empty; -1 when it holds anything else, and why names the
   variable, its value and the rule ("DOPT_WORLD_SIZE=\"abc\" is not a number", "DOPT_RANK=-1 is
   below 0"). */
DOPT__MAYBE_UNUSED static int dopt__env_long(const char *var, long min, long max, long *out, char *why, size_t cap) {
    const char *v = getenv(var), *p;
    long x = 0;
    int neg, digits = 0, huge = 0;
    if (v == NULL || *v == '\0') return 0;
    neg = *v == '-';
    for (p = v + neg; *p >= '0' && *p <= '9'; p++, digits++) {
        if (x > (LONG_MAX - (*p - '0')) / 10) huge = 1; /* stop before it overflows */
        else x = 10 * x + (*p - '0');
    }
    if (digits == 0 || *p != '\0') {
        snprintf(why, cap, "%s=\"%.40s\" is not a number", var, v);
        return -1;
    }
    if (neg) x = -x;
    if (neg ? huge || x < min : x < min) {
        snprintf(why, cap, "%s=%.40s is below %ld", var, v, min);
        return -1;
    }
    if (huge || x > max) {
        snprintf(why, cap, "%s=%.40s is above %ld", var, v, max);
        return -1;
    }
    *out = x;
    return 1;
}

/* One launcher's names for rank, world size, local rank and local size (NULL: it has none). */
typedef struct dopt__launcher {
    const char *name, *rank, *size, *local_rank, *local_size;
} dopt__launcher;

static const dopt__launcher dopt__launchers[] = {
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", NULL},
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
};

static int dopt__env_set(const char *var) {
    const char *v = var ? getenv(var) : NULL;
    return v != NULL && *v != '\0';
}

/* dopt__env_long into an int in [lo, INT_MAX]; -1 with why on a malformed value. */
static int dopt__launch_int(const char *var, long lo, int *out, char *why, size_t cap) {
    long v = 0;
    int found = var ? dopt__env_long(var, lo, INT_MAX, &v, why, cap) : 0;
    if (found == 1) *out = (int)v;
    return found;
}

/* Slurm's tasks on node `node` from a list such as "2(x3),1" (3 nodes with 2 tasks, then 1);
   -1 when the list is malformed or shorter. */
static int dopt__slurm_tasks_on(const char *list, long node) {
    const char *p = list;
    while (*p) {
        long tasks = 0, times = 1;
        if (*p < '0' || *p > '9') return -1;
        while (*p >= '0' && *p <= '9' && tasks < INT_MAX) tasks = 10 * tasks + (*p++ - '0');
        if (p[0] == '(' && p[1] == 'x') {
            times = 0;
            for (p += 2; *p >= '0' && *p <= '9' && times < INT_MAX; p++) times = 10 * times + (*p - '0');
            if (*p++ != ')') return -1;
        }
        if (node < times) return tasks <= INT_MAX ? (int)tasks : -1;
        node -= times;
        if (*p == ',') p++;
        else if (*p) return -1;
    }
    return -1;
}

/* The first host of a Slurm node list: "n[01-04,07],m3" gives "n01". 0 on a malformed list. */
static int dopt__slurm_first_host(const char *list, char *out, size_t cap) {
    size_t n = 0;
    const char *p;
    for (p = list; *p && *p != ',' && *p != '['; p++)
        if (n + 1 < cap) out[n++] = *p;
    if (*p == '[')
        for (p++; *p >= '0' && *p <= '9'; p++)
            if (n + 1 < cap) out[n++] = *p;
    out[n] = '\0';
    return n > 0 && n + 1 < cap;
}

/* FNV-1a, 64 bits, continued from h (start with DOPT__FNV_OFFSET): the derived port here,
   localsgd.h's replica and state checksums. */
#define DOPT__FNV_OFFSET 0xCBF29CE484222325ull
#define DOPT__FNV_PRIME 0x100000001B3ull

DOPT__MAYBE_UNUSED static uint64_t dopt__fnv1a(uint64_t h, const void *data, size_t bytes) {
    const unsigned char *p = (const unsigned char *)data;
    size_t i;
    for (i = 0; i < bytes; i++) h = (h ^ p[i]) * DOPT__FNV_PRIME;
    return h;
}

/* The job's shared name from its launcher: only [A-Za-z0-9._-], so it can name a segment. */
static void dopt__launch_job(dopt_launch_info *info, const char *l) {
    const char *a = NULL, *b = NULL, *prefix = "";
    char *p;
    if (!strcmp(l, "Slurm")) prefix = "slurm-", a = getenv("SLURM_JOB_ID"), b = getenv("SLURM_STEP_ID");
    else if (!strcmp(l, "Open MPI")) prefix = "ompi-", a = getenv("OMPI_MCA_ess_base_jobid");
    else if (!strcmp(l, "PMI")) prefix = "pmi-", a = getenv("PMI_KVSNAME");
    else if (!strcmp(l, "torchrun")) prefix = "torchrun-", a = getenv("MASTER_ADDR"), b = getenv("MASTER_PORT");
    if (a == NULL || *a == '\0') return;
    snprintf(info->job, sizeof info->job, "%s%s%s%s", prefix, a, b ? "." : "", b ? b : "");
    for (p = info->job; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '.' ||
              *p == '-'))
            *p = '_';
}

/* DOPT_<what> against the launcher's value: the launcher's when DOPT's is unset, an error
   naming both when they differ. */
static dopt_status dopt__launch_agree(const char *dopt_var, const char *other_var, int *value, long lo, char *why,
                                      size_t cap) {
    int mine = -1, found = dopt__launch_int(dopt_var, lo, &mine, why, cap);
    if (found < 0) return DOPT_ERR_INVALID;
    if (found == 0) return DOPT_OK;
    if (*value >= 0 && mine != *value) {
        snprintf(why, cap, "%s=%d but %s=%d: they name two different jobs; unset %s", dopt_var, mine, other_var,
                 *value, dopt_var);
        return DOPT_ERR_INVALID;
    }
    *value = mine;
    return DOPT_OK;
}

/* Where dopt_launch_read found rank and size: the launcher (NULL: DOPT_* alone) and the variables
   that hold rank, size and local size, for the messages that name them. */
typedef struct dopt__launch_from {
    const dopt__launcher *launcher;
    const char *rank, *size, *local_size; /* local_size "": no variable gives it */
} dopt__launch_from;

/* DOPT_TRANSPORT, when set, names a transport distopt has. */
static dopt_status dopt__launch_read_transport(dopt_launch_info *info, char *why, size_t cap) {
    const char *t = getenv("DOPT_TRANSPORT");
    if (t == NULL || *t == '\0') return DOPT_OK;
    if (strcmp(t, "shm") && strcmp(t, "tcp") && strcmp(t, "mpi") && strcmp(t, "self")) {
        snprintf(why, cap, "DOPT_TRANSPORT=\"%.40s\" is not one of shm, tcp, mpi, self", t);
        return DOPT_ERR_INVALID;
    }
    snprintf(info->transport, sizeof info->transport, "%s", t);
    return DOPT_OK;
}

/* The first launcher that sets both rank and size; one that sets only one of them before it is
   an error (a later one is another program's leftover and is ignored). */
static dopt_status dopt__launch_find(dopt_launch_info *info, dopt__launch_from *from, char *why, size_t cap) {
    /* torchrun's workers read torchrun's first: it always runs inside whatever started it */
    static const int plain[4] = {0, 1, 2, 3}, torchrun_first[4] = {3, 0, 1, 2};
    const int *order = dopt__env_set("TORCHELASTIC_RUN_ID") ? torchrun_first : plain;
    int i;
    for (i = 0; i < 4; i++) {
        const dopt__launcher *c = &dopt__launchers[order[i]];
        int has_rank = dopt__env_set(c->rank), has_size = dopt__env_set(c->size);
        if (has_rank != has_size) {
            snprintf(why, cap, "%s is set but %s is not (%s's launcher sets both; unset the stray one)",
                     has_rank ? c->rank : c->size, has_rank ? c->size : c->rank, c->name);
            return DOPT_ERR_INVALID;
        }
        if (!has_rank) continue;
        if (dopt__launch_int(c->size, 1, &info->world_size, why, cap) < 0 ||
            dopt__launch_int(c->rank, 0, &info->rank, why, cap) < 0 ||
            dopt__launch_int(c->local_rank, 0, &info->local_rank, why, cap) < 0 ||
            dopt__launch_int(c->local_size, 1, &info->local_size, why, cap) < 0)
            return DOPT_ERR_INVALID;
        from->launcher = c;
        from->rank = c->rank;
        from->size = c->size;
        if (c->local_size) from->local_size = c->local_size;
        return DOPT_OK;
    }
    return DOPT_OK;
}

/* Slurm's tasks on this node, from the step's layout (Slurm has no local-size variable). */
static void dopt__launch_slurm_local(dopt_launch_info *info, dopt__launch_from *from, char *why, size_t cap) {
    const char *list = getenv("SLURM_STEP_TASKS_PER_NODE");
    long node = 0;
    if (list == NULL || *list == '\0') list = getenv("SLURM_TASKS_PER_NODE");
    if (list && *list && dopt__env_long("SLURM_NODEID", 0, INT_MAX, &node, why, cap) >= 0) {
        info->local_size = dopt__slurm_tasks_on(list, node);
        from->local_size = "SLURM_STEP_TASKS_PER_NODE";
    }
    why[0] = '\0';
}

/* DOPT_* may restate what the launcher says, or say what it does not; then rank, size, local rank
   and local size must make one job. */
static dopt_status dopt__launch_check(dopt_launch_info *info, const dopt__launch_from *from, char *why,
                                      size_t cap) {
    const dopt__launcher *L = from->launcher;
    const char *local_size_var = from->local_size[0] ? from->local_size : "DOPT_LOCAL_SIZE";
    if (dopt__launch_agree("DOPT_WORLD_SIZE", from->size, &info->world_size, 1, why, cap) != DOPT_OK ||
        dopt__launch_agree("DOPT_RANK", from->rank, &info->rank, 0, why, cap) != DOPT_OK ||
        dopt__launch_agree("DOPT_LOCAL_RANK", L && L->local_rank ? L->local_rank : "the launcher's local rank",
                           &info->local_rank, 0, why, cap) != DOPT_OK ||
        dopt__launch_agree("DOPT_LOCAL_SIZE", from->local_size[0] ? from->local_size : "the launcher's local size",
                           &info->local_size, 1, why, cap) != DOPT_OK)
        return DOPT_ERR_INVALID;
    if (info->rank >= 0 && info->world_size < 0) {
        snprintf(why, cap, "DOPT_RANK is set but DOPT_WORLD_SIZE is not (every rank needs both)");
        return DOPT_ERR_INVALID;
    }
    if (info->rank >= info->world_size && info->rank >= 0) {
        snprintf(why, cap, "%s=%d is not below %s=%d", L && !dopt__env_set("DOPT_RANK") ? from->rank : "DOPT_RANK",
                 info->rank, L && !dopt__env_set("DOPT_WORLD_SIZE") ? from->size : "DOPT_WORLD_SIZE",
                 info->world_size);
        return DOPT_ERR_INVALID;
    }
    if (info->local_size > info->world_size && info->world_size > 0) {
        snprintf(why, cap, "%s=%d is above the world size %d", local_size_var, info->local_size, info->world_size);
        return DOPT_ERR_INVALID;
    }
    if (info->local_rank >= 0 && info->local_size > 0 && info->local_rank >= info->local_size) {
        snprintf(why, cap, "the local rank %d is not below the local size %d (%s)", info->local_rank,
                 info->local_size, L ? L->name : "DOPT_LOCAL_RANK, DOPT_LOCAL_SIZE");
        return DOPT_ERR_INVALID;
    }
    return DOPT_OK;
}

/* The meeting point's address: DOPT_MASTER_ADDR, else MASTER_ADDR (torchrun's, or a job
   script's), else this host when every rank is on it, else Slurm's first node of the step. */
static dopt_status dopt__launch_meeting_addr(dopt_launch_info *info, const dopt__launch_from *from, char *why,
                                             size_t cap) {
    const char *addr;
    if ((addr = getenv("DOPT_MASTER_ADDR")) && *addr) {
        snprintf(info->master_from, sizeof info->master_from, "DOPT_MASTER_ADDR");
    } else if ((addr = getenv("MASTER_ADDR")) && *addr) {
        snprintf(info->master_from, sizeof info->master_from, "MASTER_ADDR");
    } else if (info->local_size > 0 && info->local_size == info->world_size) {
        addr = "127.0.0.1";
        snprintf(info->master_from, sizeof info->master_from, "every rank on this host (%s)", from->local_size);
    } else if (from->launcher && !strcmp(from->launcher->name, "Slurm")) {
        const char *list = getenv("SLURM_STEP_NODELIST");
        const char *which = "SLURM_STEP_NODELIST";
        if (list == NULL || *list == '\0') list = getenv("SLURM_JOB_NODELIST"), which = "SLURM_JOB_NODELIST";
        if (list && *list && dopt__slurm_first_host(list, info->master_addr, sizeof info->master_addr)) {
            snprintf(info->master_from, sizeof info->master_from, "the first node of %s", which);
        } else if ((addr = getenv("SLURM_LAUNCH_NODE_IPADDR")) && *addr) {
            snprintf(info->master_from, sizeof info->master_from, "SLURM_LAUNCH_NODE_IPADDR");
        }
    } else {
        addr = NULL;
    }
    if (addr && *addr) {
        if (strlen(addr) > DOPT_LAUNCH_ADDR_MAX) {
            snprintf(why, cap, "%s is %lu characters long, more than %d", info->master_from,
                     (unsigned long)strlen(addr), DOPT_LAUNCH_ADDR_MAX);
            return DOPT_ERR_INVALID;
        }
        snprintf(info->master_addr, sizeof info->master_addr, "%s", addr);
    }
    return DOPT_OK;
}

/* The meeting point's port: DOPT_MASTER_PORT, else MASTER_PORT (one above it under torchrun,
   whose store holds MASTER_PORT), else one derived from the job's name. */
static dopt_status dopt__launch_meeting_port(dopt_launch_info *info, char *why, size_t cap) {
    const char *port_var = NULL;
    size_t used = strlen(info->master_from), room = sizeof info->master_from - used;
    if (dopt__env_set("DOPT_MASTER_PORT")) port_var = "DOPT_MASTER_PORT";
    else if (dopt__env_set("MASTER_PORT")) port_var = "MASTER_PORT";
    if (port_var) {
        int torchrun_store = !strcmp(port_var, "MASTER_PORT") && dopt__env_set("TORCHELASTIC_RUN_ID");
        if (dopt__launch_int(port_var, 1, &info->master_port, why, cap) < 0) return DOPT_ERR_INVALID;
        if (info->master_port > 65535) {
            snprintf(why, cap, "%s=%d is above 65535", port_var, info->master_port);
            return DOPT_ERR_INVALID;
        }
        if (torchrun_store) {
            if (info->master_port == 65535) {
                snprintf(why, cap, "MASTER_PORT=65535 leaves no port above it for distopt (torchrun's store holds "
                                   "MASTER_PORT); set DOPT_MASTER_PORT");
                return DOPT_ERR_INVALID;
            }
            info->master_port++;
        }
        snprintf(info->master_from + used, room, "%s%s%s", used ? ", " : "", port_var, torchrun_store ? " + 1" : "");
    } else if (info->job[0]) { /* the same on every rank; outside the kernel's ephemeral range */
        info->master_port = 20000 + (int)(dopt__fnv1a(DOPT__FNV_OFFSET, info->job, strlen(info->job)) % 12000u);
        snprintf(info->master_from + used, room, "%sport derived from the job name %.60s", used ? ", " : "",
                 info->job);
    }
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_launch_read(dopt_launch_info *info, char *why, size_t cap) {
    dopt__launch_from from = {NULL, "DOPT_RANK", "DOPT_WORLD_SIZE", ""};
    dopt_status s;
    if (info == NULL || why == NULL || cap == 0) return DOPT_ERR_INVALID;
    why[0] = '\0';
    memset(info, 0, sizeof *info);
    info->rank = info->world_size = info->local_rank = info->local_size = -1;
    info->launcher = "";
    if ((s = dopt__launch_read_transport(info, why, cap)) != DOPT_OK ||
        (s = dopt__launch_find(info, &from, why, cap)) != DOPT_OK)
        return s;
    if (from.launcher && !strcmp(from.launcher->name, "Slurm")) dopt__launch_slurm_local(info, &from, why, cap);
    if ((s = dopt__launch_check(info, &from, why, cap)) != DOPT_OK) return s;
    if (from.launcher) {
        info->launcher = from.launcher->name;
        snprintf(info->rank_from, sizeof info->rank_from, "%s, %s", from.rank, from.size);
        dopt__launch_job(info, from.launcher->name);
    } else if (info->rank >= 0) {
        info->launcher = "DOPT";
        snprintf(info->rank_from, sizeof info->rank_from, "DOPT_RANK, DOPT_WORLD_SIZE");
    }
    if ((s = dopt__launch_meeting_addr(info, &from, why, cap)) != DOPT_OK) return s;
    return dopt__launch_meeting_port(info, why, cap);
}

/* ===================================================================== COMMUNICATOR: LOGGING AND FAILURE */

static void dopt__vlog(dopt_comm *c, dopt_log_level level, const char *fmt, va_list ap) {
    char msg[DOPT_DETAIL_MAX];
    if (c == NULL || c->log_fn == NULL) return;
    vsnprintf(msg, sizeof msg, fmt, ap);
    c->log_fn(c->log_user, level, msg);
}

DOPT_DEF void dopt_comm_log(dopt_comm *c, dopt_log_level level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    dopt__vlog(c, level, fmt, ap);
    va_end(ap);
}

static const char *dopt__coll_name(dopt_coll k) {
    switch (k) {
    case DOPT_COLL_ALLREDUCE: return "allreduce";
    case DOPT_COLL_ALLGATHER: return "allgather";
    case DOPT_COLL_ALLGATHERV: return "allgatherv";
    case DOPT_COLL_BROADCAST: return "broadcast";
    case DOPT_COLL_BARRIER: return "barrier";
    case DOPT_COLL_EXCHANGE: return "exchange";
    }
    return "collective?";
}

DOPT_DEF int dopt_coll_describe(const dopt_coll_desc *d, char *out, size_t cap) {
    const char *name = dopt__coll_name(d->kind);
    unsigned long long seq = (unsigned long long)d->seq, n = (unsigned long long)d->count;
    char in[32] = "";
    if (d->group) snprintf(in, sizeof in, " in group %u", (unsigned)d->group);
    switch (d->kind) {
    case DOPT_COLL_ALLREDUCE:
        return snprintf(out, cap, "%s #%llu%s (%s %s, %llu elems)", name, seq, in, dopt_dtype_name(d->dtype),
                        dopt_op_name(d->op), n);
    case DOPT_COLL_BROADCAST:
        return snprintf(out, cap, "%s #%llu%s (%llu bytes from rank %d)", name, seq, in, n, d->root);
    case DOPT_COLL_BARRIER: return snprintf(out, cap, "%s #%llu%s", name, seq, in);
    case DOPT_COLL_EXCHANGE: return snprintf(out, cap, "%s #%llu%s (tag %llu)", name, seq, in, n);
    case DOPT_COLL_ALLGATHER:
    case DOPT_COLL_ALLGATHERV: break;
    }
    return snprintf(out, cap, "%s #%llu%s (%llu bytes)", name, seq, in, n);
}

DOPT_DEF uint64_t dopt_coll_fingerprint(const dopt_coll_desc *d) {
    uint64_t h = dopt__mix64((uint64_t)d->kind << 48 ^ (uint64_t)d->dtype << 40 ^ (uint64_t)d->op << 32 ^
                             (uint64_t)(uint32_t)d->root);
    if (d->group) h = dopt__mix64(h ^ (uint64_t)d->group << 40);
    return dopt__mix64(h ^ d->count);
}

/* The rank a detail names: in a group, the rank in the communicator whose links it shares (the
   ranks the engine's messages name). */
static int dopt__rank_named(const dopt_comm *c) { return c->members ? c->members[c->rank] : c->rank; }

/* The communicator that keeps c's family's fate: its root (c itself when c is not a group). */
static dopt_comm *dopt__family_root(const dopt_comm *c) { return c->root ? c->root : (dopt_comm *)(uintptr_t)c; }

/* The root and its groups share links, so they share failures: the first one poisons them all
   (a member learns of it at its next call). */
static dopt_status dopt__family_error(dopt_comm *c) {
    const dopt_comm *f = dopt__family_root(c);
    if (c->error == DOPT_OK && f->family_status != DOPT_OK) {
        c->error = f->family_status;
        memcpy(c->detail, f->family_detail, sizeof c->detail);
    }
    return c->error;
}

static void dopt__family_note(dopt_comm *c) {
    dopt_comm *f = dopt__family_root(c);
    if (f->family_status != DOPT_OK) return;
    f->family_status = c->error;
    memcpy(f->family_detail, c->detail, sizeof f->family_detail);
}

/* For a backend whose setup starts over (transport_tcp.h's rendezvous, when a rank left before
   the job formed): the failure recorded on the way is moot, on the communicator and on its
   family, where dopt_comm_fail noted it. */
DOPT__MAYBE_UNUSED static void dopt__comm_forget_failure(dopt_comm *c) {
    dopt_comm *f = dopt__family_root(c);
    c->error = DOPT_OK;
    c->detail[0] = '\0';
    f->family_status = DOPT_OK;
    f->family_detail[0] = '\0';
}

static void dopt__rec_fail(dopt_comm *c, const dopt_coll_desc *d, dopt_status s);

DOPT_DEF dopt_status dopt_comm_fail(dopt_comm *c, const dopt_coll_desc *desc, dopt_status s,
                                    const char *fmt, ...) {
    char what[160] = "setup";
    int used;
    va_list ap;
    if (c->error != DOPT_OK) return c->error; /* the first error is the one users need */
    if (desc) dopt_coll_describe(desc, what, sizeof what);
    used = snprintf(c->detail, sizeof c->detail, "rank %d: %s%s%s: ", dopt__rank_named(c), c->api ? c->api : "",
                    c->api ? ": " : "", what);
    if (used < 0 || (size_t)used >= sizeof c->detail) used = 0;
    va_start(ap, fmt);
    vsnprintf(c->detail + used, sizeof c->detail - (size_t)used, fmt, ap);
    va_end(ap);
    c->error = s;
    dopt__family_note(c);
    dopt__rec_fail(c, desc, s); /* FLIGHT RECORDER */
    dopt_comm_log(c, DOPT_LOG_ERROR, "%s", c->detail);
    return s;
}

DOPT_DEF dopt_status dopt_comm_fail_mismatch(dopt_comm *c, const dopt_coll_desc *mine,
                                             const dopt_coll_desc *theirs, int peer) {
    char other[160];
    dopt_coll_describe(theirs, other, sizeof other);
    return dopt_comm_fail(c, mine, DOPT_ERR_MISMATCH, "rank %d called %s", peer, other);
}

/* ===================================================================== CLOCK */

/* Milliseconds on a clock that does not jump where the platform has one (POSIX's monotonic
   clock); C11's calendar clock otherwise. */
DOPT__MAYBE_UNUSED static double dopt__now_ms(void) {
    struct timespec ts;
#if defined(CLOCK_MONOTONIC)
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    timespec_get(&ts, TIME_UTC);
#endif
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

DOPT__MAYBE_UNUSED static int dopt__ms_left(double deadline) {
    double left = deadline - dopt__now_ms();
    if (left <= 0) return 0;
    if (left > (double)INT_MAX) return INT_MAX;
    return (int)left + 1;
}

/* ===================================================================== FLIGHT RECORDER

   Every collective a root and its groups start gets an entry in a ring of DOPT_REC_ENTRIES (the
   root's dopt__rec), in a file another process maps (dopt_comm_set_job) or, until a backend
   names the job or when the file cannot be made, in memory. The hooks are marked FLIGHT RECORDER
   where they are called: begin (dopt__start), expect and arrived (the engine's receives), end
   (completion: dopt__start for a backend's own collectives, the engine's retire) and fail
   (dopt_comm_fail). They never allocate but the first time a family records. Writers are this
   process's threads, one per entry at a time (the caller begins; the engine's lock holder
   times); each write of an entry holds its seqlock, so a reader in another process copies an
   entry again until its lock was even and unchanged around the copy. */

struct dopt__rec {
    dopt_rec_header *hdr;
    dopt_rec_entry *ring;  /* hdr's DOPT_REC_ENTRIES entries; NULL: recording is off */
    size_t bytes;          /* of the mapping or the allocation */
    int mapped;            /* 1: a file's mapping (path), 0: memory */
    int keep;              /* the file stays at close (the job failed: inspect it) */
    uint64_t current;      /* the entry the collective starting now got, + 1 (0: none) */
#ifdef DOPT__REC_FILES
    dev_t dev;             /* the file's identity: close removes the path only while it names it */
    ino_t ino;
#endif
    char path[256];
};

#define DOPT__REC_BYTES ((size_t)DOPT_REC_HEADER_BYTES + sizeof(dopt_rec_entry) * DOPT_REC_ENTRIES)

static uint64_t dopt__rec_now_ns(void) {
    struct timespec ts;
#if defined(CLOCK_MONOTONIC)
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    timespec_get(&ts, TIME_UTC);
#endif
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* An entry's seqlock: odd while written. The fences keep the writes between the two stores. */
static void dopt__rec_lock(dopt_rec_entry *x) {
#if defined(__GNUC__) || defined(__clang__)
    __atomic_store_n(&x->lock, x->lock + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
#else
    x->lock++;
#endif
}

static void dopt__rec_unlock(dopt_rec_entry *x) {
#if defined(__GNUC__) || defined(__clang__)
    __atomic_store_n(&x->lock, x->lock + 1, __ATOMIC_RELEASE);
#else
    x->lock++;
#endif
}

static void dopt__rec_header_init(dopt_rec_header *h, const dopt_comm *c, uint64_t job) {
    memset(h, 0, sizeof *h);
    h->magic = DOPT_REC_MAGIC;
    h->version = DOPT_REC_VERSION;
    h->header_bytes = DOPT_REC_HEADER_BYTES;
    h->entry_bytes = (uint32_t)sizeof(dopt_rec_entry);
    h->capacity = DOPT_REC_ENTRIES;
    h->rank = c->rank;
    h->size = c->size;
#ifdef DOPT__REC_FILES
    h->pid = (int32_t)getpid();
#endif
    h->state = DOPT_REC_RUNNING;
    h->job = job;
    h->created_ns = dopt__rec_now_ns();
    snprintf(h->transport, sizeof h->transport, "%s", c->vt && c->vt->name ? c->vt->name : "?");
}

/* DOPT_RECORDER=0 turns the recorder off. */
static int dopt__rec_wanted(void) {
    const char *v = getenv("DOPT_RECORDER");
    return !(v && v[0] == '0' && v[1] == '\0');
}

/* The family's recorder, made in memory at its first use; NULL when it is off or out of memory. */
static struct dopt__rec *dopt__rec_get(dopt_comm *c) {
    dopt_comm *f = dopt__family_root(c);
    struct dopt__rec *r = f->rec;
    if (r != NULL) return r->ring ? r : NULL;
    if ((r = (struct dopt__rec *)DOPT_MALLOC(sizeof *r)) == NULL) return NULL;
    memset(r, 0, sizeof *r);
    f->rec = r;
    if (!dopt__rec_wanted() || (r->hdr = (dopt_rec_header *)DOPT_MALLOC(DOPT__REC_BYTES)) == NULL) return NULL;
    memset(r->hdr, 0, DOPT__REC_BYTES);
    r->bytes = DOPT__REC_BYTES;
    r->ring = (dopt_rec_entry *)((unsigned char *)r->hdr + DOPT_REC_HEADER_BYTES);
    dopt__rec_header_init(r->hdr, f, 0);
    return r;
}

/* The entry of recorder slot k + 1 (0: none). */
static dopt_rec_entry *dopt__rec_at(const struct dopt__rec *r, uint64_t slot) {
    return r && slot ? &r->ring[(slot - 1) % DOPT_REC_ENTRIES] : NULL;
}

/* The slot of the collective starting now (dopt__start begins it before the provider runs). */
DOPT__MAYBE_UNUSED static uint64_t dopt__rec_current(const dopt_comm *c) { return c->rec ? c->rec->current : 0; }

/* A collective starts: a new entry. Returns its slot (0: not recorded). */
static uint64_t dopt__rec_begin(dopt_comm *c, const dopt_coll_desc *d) {
    struct dopt__rec *r = dopt__rec_get(c);
    dopt_rec_entry *x;
    uint64_t k;
    if (r == NULL) return 0;
    k = r->hdr->written;
    x = &r->ring[k % DOPT_REC_ENTRIES];
    dopt__rec_lock(x);
    x->kind = (uint8_t)d->kind;
    x->dtype = (uint8_t)d->dtype;
    x->op = (uint8_t)d->op;
    x->npeers = 0;
    x->seq = d->seq;
    x->count = d->count;
    x->group = d->group;
    x->root = d->root;
    x->status = 0;
    x->more_peers = 0;
    x->start_ns = dopt__rec_now_ns();
    x->end_ns = x->last_ns = 0;
    dopt__rec_unlock(x);
#if defined(__GNUC__) || defined(__clang__)
    __atomic_store_n(&r->hdr->written, k + 1, __ATOMIC_RELEASE);
#else
    r->hdr->written = k + 1;
#endif
    return r->current = k + 1;
}

/* The collective in slot receives from peer (once more). */
DOPT__MAYBE_UNUSED static void dopt__rec_expect(dopt_comm *c, uint64_t slot, int peer) {
    dopt_rec_entry *x = dopt__rec_at(c->rec, slot);
    int i;
    if (x == NULL) return;
    dopt__rec_lock(x);
    for (i = 0; i < x->npeers && x->peers[i].peer != peer; i++) continue;
    if (i < x->npeers) {
        x->peers[i].pending++;
    } else if (i < DOPT_REC_PEERS) {
        x->peers[i].peer = peer;
        x->peers[i].pending = 1;
        x->peers[i].arrived_us = 0;
        x->npeers++;
    } else {
        x->more_peers++;
    }
    dopt__rec_unlock(x);
}

/* One of peer's receives of the collective in slot completed: the wait since the start or the
   previous arrival, whichever is later, is charged to peer in owner's traffic (owner: the
   communicator it runs on, NULL when it was destroyed). */
DOPT__MAYBE_UNUSED static void dopt__rec_arrived(dopt_comm *c, dopt_comm *owner, uint64_t slot, int peer) {
    dopt_rec_entry *x = dopt__rec_at(c->rec, slot);
    uint64_t now, since, us;
    int i;
    if (x == NULL) return;
    now = dopt__rec_now_ns();
    since = x->last_ns > x->start_ns ? x->last_ns : x->start_ns;
    if (owner && peer >= 0 && peer < DOPT_STRAGGLER_RANKS && now > since) owner->traffic.waited_ns[peer] += now - since;
    dopt__rec_lock(x);
    x->last_ns = now;
    for (i = 0; i < x->npeers && x->peers[i].peer != peer; i++) continue;
    if (i < x->npeers && x->peers[i].pending > 0 && --x->peers[i].pending == 0) {
        us = (now - x->start_ns) / 1000u;
        x->peers[i].arrived_us = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
    }
    dopt__rec_unlock(x);
}

/* The collective in slot completed (s: DOPT_OK) or failed; owner's busy time grows by its span. */
static void dopt__rec_end(dopt_comm *c, dopt_comm *owner, uint64_t slot, dopt_status s) {
    dopt_rec_entry *x = dopt__rec_at(c->rec, slot);
    uint64_t now;
    if (x == NULL || x->end_ns != 0) return;
    now = dopt__rec_now_ns();
    if (owner && now > x->start_ns) owner->traffic.busy_ns += now - x->start_ns;
    dopt__rec_lock(x);
    x->end_ns = now;
    x->status = (int32_t)s;
    dopt__rec_unlock(x);
}

/* c failed (in d, when not NULL): its entry says so, the header keeps the detail, the file stays. */
static void dopt__rec_fail(dopt_comm *c, const dopt_coll_desc *d, dopt_status s) {
    struct dopt__rec *r = dopt__family_root(c)->rec;
    uint64_t k;
    if (r == NULL || r->ring == NULL) return;
    if (r->hdr->state != DOPT_REC_FAILED) {
        memcpy(r->hdr->detail, c->detail, sizeof r->hdr->detail);
        r->hdr->state = DOPT_REC_FAILED;
    }
    r->keep = 1;
    for (k = r->hdr->written; d && k > 0 && k + DOPT_REC_ENTRIES > r->hdr->written; k--) {
        dopt_rec_entry *x = &r->ring[(k - 1) % DOPT_REC_ENTRIES];
        if (x->seq == d->seq && x->group == d->group) {
            dopt__rec_end(dopt__family_root(c), NULL, k, s);
            break;
        }
    }
}

#ifdef DOPT__REC_FILES
/* Maps dir/dopt-rec.<job>.<rank>, copying what memory holds; 0 on success, else an errno. */
static int dopt__rec_map(struct dopt__rec *r, const dopt_comm *c, const char *dir, uint64_t job) {
    struct stat st;
    void *map;
    int fd, err;
    snprintf(r->path, sizeof r->path, "%s/dopt-rec.%016llx.%d", dir, (unsigned long long)job, c->rank);
    fd = open(r->path, O_RDWR | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return errno;
    if (ftruncate(fd, (off_t)DOPT__REC_BYTES) != 0 || fstat(fd, &st) != 0) {
        err = errno;
        close(fd);
        unlink(r->path);
        return err;
    }
    map = mmap(NULL, DOPT__REC_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    err = errno;
    close(fd);
    if (map == MAP_FAILED) {
        unlink(r->path);
        return err;
    }
    memcpy(map, r->hdr, DOPT__REC_BYTES);
    DOPT_FREE(r->hdr);
    r->hdr = (dopt_rec_header *)map;
    r->ring = (dopt_rec_entry *)((unsigned char *)map + DOPT_REC_HEADER_BYTES);
    r->mapped = 1;
    r->dev = st.st_dev;
    r->ino = st.st_ino;
    r->hdr->job = job;
    return 0;
}
#endif

DOPT_DEF void dopt_comm_set_job(dopt_comm *c, const void *identity, size_t bytes) {
    struct dopt__rec *r;
    uint64_t job;
    if (c == NULL || (r = dopt__rec_get(c)) == NULL || r->mapped) return;
    job = dopt__mix64(dopt__fnv1a(DOPT__FNV_OFFSET, identity, identity ? bytes : 0));
    r->hdr->job = job;
#ifdef DOPT__REC_FILES
    {
        const char *dir = getenv("DOPT_RECORDER_DIR");
        int err = dopt__rec_map(r, c, dir && *dir ? dir : "/dev/shm", job);
        if (err != 0)
            dopt_comm_log(c, DOPT_LOG_INFO,
                          "rank %d: flight recorder: cannot make %s (%s); it records in memory only, where "
                          "distopt-inspect cannot read it (set DOPT_RECORDER_DIR to a writable directory)",
                          c->rank, r->path, strerror(err));
    }
#endif
}

/* At the root's end: the file goes unless the job failed (distopt-inspect reads it then). */
static void dopt__rec_close(dopt_comm *c) {
    struct dopt__rec *r = c->rec;
    if (r == NULL) return;
    c->rec = NULL;
#ifdef DOPT__REC_FILES
    if (r->mapped) {
        struct stat st;
        if (c->error != DOPT_OK || c->family_status != DOPT_OK) r->keep = 1;
        if (r->keep) r->hdr->state = DOPT_REC_FAILED;
        if (!r->keep && stat(r->path, &st) == 0 && st.st_dev == r->dev && st.st_ino == r->ino) unlink(r->path);
        munmap((void *)r->hdr, r->bytes);
        DOPT_FREE(r);
        return;
    }
#endif
    DOPT_FREE(r->hdr);
    DOPT_FREE(r);
}

DOPT_DEF double dopt_comm_straggler(const dopt_comm *c, int rank) {
    double w;
    if (c == NULL || rank < 0 || rank >= DOPT_STRAGGLER_RANKS || c->traffic.busy_ns == 0) return 0.0;
    w = (double)c->traffic.waited_ns[rank] / (double)c->traffic.busy_ns;
    return w < 1.0 ? w : 1.0;
}

/* ===================================================================== RING ARITHMETIC

   A ring's positions and its cut of a buffer, shared by the engine's rings (engine.h) and the
   modules' own (compress.h), so that every ring agrees on them. */

/* a mod n in [0, n) for any sign of a. */
DOPT__MAYBE_UNUSED static int dopt__mod(long long a, int n) { return (int)(((a % n) + n) % n); }

/* Element range of ring segment i: count split into n near-equal parts (never i·count, which may
   overflow). */
DOPT__MAYBE_UNUSED static void dopt__ring_segment(uint64_t count, int n, int i, uint64_t *first, uint64_t *len) {
    uint64_t q = count / (uint64_t)n, rem = count % (uint64_t)n, ui = (uint64_t)i;
    *first = ui * q + (ui < rem ? ui : rem);
    *len = q + (ui < rem ? 1 : 0);
}

/* ===================================================================== COMMUNICATOR: LIFECYCLE AND SETTINGS */

DOPT_DEF dopt_status dopt_comm_new(dopt_comm **out, int rank, int size, const dopt_comm_vtable *vt,
                                   void *impl) {
    dopt_comm *c;
    dopt_status s = DOPT_OK;
    if (out == NULL || vt == NULL || size < 1 || rank < 0 || rank >= size) return DOPT_ERR_INVALID;
    *out = NULL;
    c = (dopt_comm *)DOPT_MALLOC(sizeof *c);
    if (c == NULL) return DOPT_ERR_NOMEM;
    memset(c, 0, sizeof *c);
    c->gatherv_sizes = (uint64_t *)DOPT_MALLOC(2 * (size_t)size * sizeof(uint64_t));
    c->block_bytes = (size_t *)DOPT_MALLOC((size_t)size * sizeof(size_t));
    if (c->gatherv_sizes == NULL || c->block_bytes == NULL) {
        DOPT_FREE(c->gatherv_sizes);
        DOPT_FREE(c->block_bytes);
        DOPT_FREE(c);
        return DOPT_ERR_NOMEM;
    }
    c->rank = rank;
    c->size = size;
    c->vt = vt;
    c->impl = impl;
    c->timeout_ms = DOPT_DEFAULT_TIMEOUT_MS;
    c->next_group = 1;
    c->lost_rank = -1;
    c->provider = DOPT__VT_HAS(vt, provider) ? vt->provider() : dopt_own_provider();
    if (c->provider->attach) s = c->provider->attach(c);
    if (s != DOPT_OK) {
        dopt_comm_destroy(c);
        return s;
    }
    *out = c;
    return DOPT_OK;
}

static void dopt__comm_free(dopt_comm *c) {
    dopt__rec_close(c);
    DOPT_FREE(c->members);
    DOPT_FREE(c->gatherv_sizes);
    DOPT_FREE(c->block_bytes);
    DOPT_FREE(c);
}

/* A group's memory goes at once; the root's, and the backend's state, when the provider says
   (over links: once the last of the family is destroyed). */
DOPT_DEF void dopt_comm_destroy(dopt_comm *c) {
    dopt_comm *last;
    if (c == NULL) return;
    last = c->provider && c->provider->leave ? c->provider->leave(c) : c;
    if (c->root != NULL) dopt__comm_free(c);
    if (last == NULL) return;
    if (last->vt && last->vt->destroy) last->vt->destroy(last);
    if (last->provider && last->provider->release) last->provider->release(last);
    dopt__comm_free(last);
}

DOPT_DEF int dopt_comm_finish(dopt_comm *c, int status) {
    if (status < 0) status = 1; /* a dopt_status: an exit status of 1 */
    if (c == NULL) return status;
    if (status != 0 && dopt__family_root(c)->rec) dopt__family_root(c)->rec->keep = 1; /* FLIGHT RECORDER */
    if (status != 0 && c->detail[0] && c->log_fn == NULL) fprintf(stderr, "distopt: %s\n", c->detail);
    if (c->root == NULL && DOPT__VT_HAS(c->vt, finish)) return c->vt->finish(c, status);
    dopt_comm_destroy(c);
    return status;
}

DOPT_DEF const char *dopt_comm_detail(const dopt_comm *c) { return c ? c->detail : "no communicator"; }

/* A backend's shrink that cannot go on (declared in FOR MODULES). */
DOPT__MAYBE_UNUSED static dopt_status dopt__shrink_fail(dopt_comm *c, dopt_status st, const char *fmt, ...)
    DOPT_PRINTF(3, 4);
DOPT__MAYBE_UNUSED static dopt_status dopt__shrink_fail(dopt_comm *c, dopt_status st, const char *fmt, ...) {
    va_list ap;
    int used = snprintf(c->detail, sizeof c->detail, "rank %d: dopt_comm_shrink: ", c->rank);
    if (used < 0 || (size_t)used >= sizeof c->detail) used = 0;
    va_start(ap, fmt);
    vsnprintf(c->detail + used, sizeof c->detail - (size_t)used, fmt, ap);
    va_end(ap);
    dopt_comm_log(c, DOPT_LOG_ERROR, "%s", c->detail);
    return st;
}

/* The checks every backend's shrink shares; the agreement itself is the backend's. A refusal
   leaves c as it was (its detail names the first failure, which the program still needs), so
   it is said through the log, and the status alone says which rule. */
DOPT_DEF dopt_status dopt_comm_shrink(dopt_comm *c, dopt_comm **next) {
    const char *why = NULL;
    dopt_status s = DOPT_ERR_INVALID;
    if (next) *next = NULL;
    if (c == NULL || next == NULL) return DOPT_ERR_INVALID;
    if (!DOPT__VT_HAS(c->vt, shrink) && c->root == NULL) {
        why = "has a backend that cannot shrink";
        s = DOPT_ERR_UNSUPPORTED;
    } else if (c->root != NULL)
        why = "is a group: shrink the communicator the transport made, then split the survivors again";
    else if (dopt__family_error(c) == DOPT_OK) /* a group's failure is its communicator's too */
        why = "has not failed: shrink after a collective failed with DOPT_ERR_PEER_LOST or DOPT_ERR_TIMEOUT";
    else if (c->error != DOPT_ERR_PEER_LOST && c->error != DOPT_ERR_TIMEOUT)
        why = "failed with something other than a lost peer (PEER_LOST or TIMEOUT): no rank to leave out";
    else if (c->on_peer_lost != DOPT_SHRINK)
        why = "was not configured to survive a lost peer: set the transport config's on_peer_lost = DOPT_SHRINK "
              "(or DOPT_ON_PEER_LOST=shrink)";
    if (why) {
        dopt_comm_log(c, DOPT_LOG_ERROR, "rank %d: dopt_comm_shrink: the communicator (%s) %s%s", c->rank,
                      c->vt->name, why,
                      s == DOPT_ERR_UNSUPPORTED && strcmp(c->vt->name, "mpi") == 0
                          ? " (MPI: Open MPI 4.1 has no ULFM, and mpirun ends the job when a rank dies)"
                          : "");
        return s;
    }
    return c->vt->shrink(c, next);
}

/* The checks every backend's grow shares; taking the joiners is the backend's. */
DOPT_DEF dopt_status dopt_comm_grow(dopt_comm *c, dopt_comm **next) {
    const char *why = NULL;
    if (next) *next = NULL;
    if (c == NULL || next == NULL) return DOPT_ERR_INVALID;
    if (c->root != NULL)
        why = "is a group: grow the communicator the transport made, then split again";
    else if (c->error != DOPT_OK)
        why = "has failed: shrink it first (dopt_comm_shrink), then grow the survivors' communicator";
    else if (c->on_peer_lost != DOPT_SHRINK)
        why = "was not configured to take joiners: set the transport config's on_peer_lost = DOPT_SHRINK (or "
              "DOPT_ON_PEER_LOST=shrink)";
    if (why) {
        dopt_comm_log(c, DOPT_LOG_ERROR, "rank %d: dopt_comm_grow: the communicator (%s) %s", c->rank, c->vt->name, why);
        return DOPT_ERR_INVALID;
    }
    if (!DOPT__VT_HAS(c->vt, grow)) return DOPT_OK; /* nobody can join: nobody did */
    return c->vt->grow(c, next);
}

DOPT_DEF int dopt_comm_joiners_held(const dopt_comm *c) {
    if (c == NULL || c->root != NULL || !DOPT__VT_HAS(c->vt, joiners_held)) return 0;
    return c->vt->joiners_held(c);
}

DOPT_DEF double dopt_mean(dopt_comm *c, double x) {
    const char *prev = dopt_comm_set_api(c, "dopt_mean");
    dopt_status s = dopt_allreduce(c, &x, 1, DOPT_F64, DOPT_MEAN);
    dopt_comm_set_api(c, prev);
    return s == DOPT_OK ? x : NAN;
}

DOPT_DEF void dopt_comm_set_host(dopt_comm *c, int local_ranks, int cores) {
    if (c == NULL) return;
    c->local_ranks = local_ranks;
#ifdef _OPENMP /* the file that holds the implementation is built with OpenMP */
    if (local_ranks > 1 && cores > 0 && getenv("OMP_NUM_THREADS") == NULL) {
        int each = cores / local_ranks > 1 ? cores / local_ranks : 1;
        dopt_comm_log(c, DOPT_LOG_WARN,
                      "%d ranks share this host's %d cores and OMP_NUM_THREADS is unset: OpenMP starts %d threads "
                      "in every rank (%d in all), which can make each step many times slower; set "
                      "OMP_NUM_THREADS=%d (and OPENBLAS_NUM_THREADS=%d) in every rank's environment",
                      local_ranks, cores, cores, cores * local_ranks, each, each);
    }
#else
    (void)cores;
#endif
}

DOPT_DEF const char *dopt_comm_set_api(dopt_comm *c, const char *api) {
    const char *prev;
    if (c == NULL) return NULL;
    prev = c->api;
    c->api = api;
    return prev;
}

DOPT_DEF void dopt_comm_set_log(dopt_comm *c, dopt_log_fn fn, void *user) {
    c->log_fn = fn;
    c->log_user = user;
}

DOPT_DEF void dopt_comm_set_timeout(dopt_comm *c, int timeout_ms) {
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : DOPT_DEFAULT_TIMEOUT_MS;
}

/* ===================================================================== COMMUNICATOR: A COLLECTIVE'S BOOKKEEPING */

/* Every collective starts here: a poisoned communicator fails fast, otherwise the call gets the
   next sequence number. */
static dopt_status dopt__begin(dopt_comm *c, dopt_coll_desc *d, dopt_coll kind, uint64_t count) {
    if (c == NULL) return DOPT_ERR_INVALID;
    memset(d, 0, sizeof *d);
    d->kind = kind;
    d->dtype = DOPT_F32;
    d->op = DOPT_SUM;
    d->count = count;
    d->seq = ++c->seq;
    d->group = c->group;
    return dopt__family_error(c);
}

static dopt_status dopt__finish_bytes(dopt_comm *c, const dopt_coll_desc *d, dopt_status s, uint64_t bytes) {
    if (s != DOPT_OK) {
        if (c->error == DOPT_OK) dopt_comm_fail(c, d, s, "%s backend failed without detail", c->vt->name);
        return s;
    }
    c->traffic.calls[d->kind]++;
    c->traffic.bytes[d->kind] += bytes;
    return s;
}

static dopt_status dopt__finish(dopt_comm *c, const dopt_coll_desc *d, dopt_status s) {
    return dopt__finish_bytes(c, d, s, d->kind == DOPT_COLL_BARRIER ? 0 : d->count);
}

DOPT_DEF uint64_t dopt_comm_traffic_total(const dopt_comm *c) {
    uint64_t total = 0;
    size_t k;
    if (c == NULL) return 0;
    for (k = 0; k < sizeof c->traffic.bytes / sizeof c->traffic.bytes[0]; k++) total += c->traffic.bytes[k];
    return total;
}

static void dopt__divide(void *buf, size_t count, dopt_dtype dt, int size) {
    size_t i;
    switch (dt) {
    case DOPT_F32: dopt_scale((float *)buf, 1.0f / (float)size, count); break;
    case DOPT_F64:
        for (i = 0; i < count; i++) ((double *)buf)[i] /= (double)size;
        break;
    case DOPT_I32:
        for (i = 0; i < count; i++) ((int32_t *)buf)[i] /= size;
        break;
    case DOPT_I64:
        for (i = 0; i < count; i++) ((int64_t *)buf)[i] /= size;
        break;
    }
}

/* ===================================================================== REQUESTS */

static void dopt__req_done(dopt_comm *c, dopt_request *req, dopt_status s) {
    if (req == NULL) return;
    req->comm = c;
    req->ticket = 0;
    req->status = s;
}

/* Hands the checked collective d to c's provider; req names it, in flight or done. */
static dopt_status dopt__start(dopt_comm *c, const dopt_coll_desc *d, const dopt_coll_args *a, dopt_request *req) {
    uint64_t ticket = 0, slot = dopt__rec_begin(c, d); /* FLIGHT RECORDER */
    dopt_status s = c->provider->start(c, d, a, &ticket);
    if (ticket == 0) dopt__rec_end(dopt__family_root(c), c, slot, s); /* FLIGHT RECORDER: done at its start */
    if (req != NULL) {
        req->comm = c;
        req->status = s;
        req->ticket = s == DOPT_OK ? ticket : 0;
    }
    return s;
}

/* Moves req's collective on (until it is done when block is set): a request that completed,
   even in the pass that then failed, is DOPT_OK; one still in flight on a poisoned communicator
   has the communicator's error. */
static dopt_status dopt__req_progress(dopt_request *req, int block, int *done) {
    *done = 1;
    if (req->ticket == 0) return req->status;
    return req->comm->provider->progress(req->comm, req->ticket, block, done);
}

DOPT_DEF dopt_status dopt_test(dopt_request *req, int *done) {
    if (req == NULL || done == NULL) return DOPT_ERR_INVALID;
    return dopt__req_progress(req, 0, done);
}

DOPT_DEF dopt_status dopt_wait(dopt_request *req) {
    int done;
    if (req == NULL) return DOPT_ERR_INVALID;
    return dopt__req_progress(req, 1, &done);
}

/* ===================================================================== THE ORDERED WORKER

   One thread that runs posted jobs one at a time, in the order they were posted (compress.h's
   nonblocking compressed allreduce, localsgd.h's gradient buckets): a job may run blocking
   collectives because no other thread calls the communicator until the poster has waited for it.
   Job k's status is kept in slot k mod cap until job k + cap is posted; post waits while cap jobs
   are queued. Without threads post runs the job itself. */

typedef struct dopt__job {
    dopt__job_fn fn;
    void *arg;
    dopt_status status;
} dopt__job;

struct dopt__worker {
    int cap;
    uint64_t posted, finished; /* jobs posted and finished: [finished, posted) are queued or running */
    dopt__job *jobs;           /* job k in slot k % cap */
#ifdef DOPT__THREADS
    int stopping;
    pthread_mutex_t lock;
    pthread_cond_t wake; /* a job posted, or the thread is to stop */
    pthread_cond_t done; /* a job finished */
    pthread_t thread;
#endif
};

#ifdef DOPT__THREADS
DOPT__MAYBE_UNUSED static void *dopt__worker_main(void *arg) {
    dopt__worker *w = (dopt__worker *)arg;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        dopt__job *j;
        dopt_status s;
        while (w->finished == w->posted && !w->stopping) pthread_cond_wait(&w->wake, &w->lock);
        if (w->finished == w->posted) break; /* stopping, and nothing left */
        j = &w->jobs[w->finished % (uint64_t)w->cap];
        pthread_mutex_unlock(&w->lock);
        s = j->fn(j->arg);
        pthread_mutex_lock(&w->lock);
        j->status = s;
        w->finished++;
        pthread_cond_broadcast(&w->done);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}
#endif

DOPT__MAYBE_UNUSED static dopt_status dopt__worker_new(dopt__worker **out, int cap) {
    dopt__worker *w;
    *out = NULL;
    if (cap < 1) return DOPT_ERR_INVALID;
    if ((w = (dopt__worker *)DOPT_MALLOC(sizeof *w)) == NULL) return DOPT_ERR_NOMEM;
    memset(w, 0, sizeof *w);
    w->cap = cap;
    if ((w->jobs = (dopt__job *)DOPT_MALLOC(sizeof(dopt__job) * (size_t)cap)) == NULL) {
        DOPT_FREE(w);
        return DOPT_ERR_NOMEM;
    }
#ifdef DOPT__THREADS
    if (pthread_mutex_init(&w->lock, NULL) != 0) goto fail;
    if (pthread_cond_init(&w->wake, NULL) != 0) {
        pthread_mutex_destroy(&w->lock);
        goto fail;
    }
    if (pthread_cond_init(&w->done, NULL) != 0) {
        pthread_cond_destroy(&w->wake);
        pthread_mutex_destroy(&w->lock);
        goto fail;
    }
    if (pthread_create(&w->thread, NULL, dopt__worker_main, w) != 0) {
        pthread_cond_destroy(&w->done);
        pthread_cond_destroy(&w->wake);
        pthread_mutex_destroy(&w->lock);
        goto fail;
    }
#endif
    *out = w;
    return DOPT_OK;
#ifdef DOPT__THREADS
fail:
    DOPT_FREE(w->jobs);
    DOPT_FREE(w);
    return DOPT_ERR_NOMEM;
#endif
}

DOPT__MAYBE_UNUSED static dopt_status dopt__worker_post(dopt__worker *w, dopt__job_fn fn, void *arg, uint64_t *ticket) {
    dopt__job *j;
#ifdef DOPT__THREADS
    pthread_mutex_lock(&w->lock);
    while (w->posted - w->finished >= (uint64_t)w->cap) pthread_cond_wait(&w->done, &w->lock);
#endif
    j = &w->jobs[w->posted % (uint64_t)w->cap];
    j->fn = fn;
    j->arg = arg;
    j->status = DOPT_OK;
    *ticket = ++w->posted;
#ifdef DOPT__THREADS
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
#else
    j->status = fn(arg);
    w->finished++;
#endif
    return DOPT_OK;
}

/* Job ticket - 1's status once it finished; DOPT_ERR_INVALID for no job, or one whose slot a
   later job took (its status is gone: never read as a success). */
DOPT__MAYBE_UNUSED static dopt_status dopt__worker_status(const dopt__worker *w, uint64_t ticket) {
    if (ticket == 0 || ticket > w->posted || ticket + (uint64_t)w->cap <= w->posted) return DOPT_ERR_INVALID;
    return w->jobs[(ticket - 1) % (uint64_t)w->cap].status;
}

DOPT__MAYBE_UNUSED static dopt_status dopt__worker_test(dopt__worker *w, uint64_t ticket, int *done) {
    dopt_status s = DOPT_OK;
#ifdef DOPT__THREADS
    pthread_mutex_lock(&w->lock);
#endif
    *done = w->finished >= ticket;
    if (*done) s = dopt__worker_status(w, ticket);
#ifdef DOPT__THREADS
    pthread_mutex_unlock(&w->lock);
#endif
    return s;
}

/* Spins a few microseconds (a bucket often finishes just after backward) before sleeping. */
DOPT__MAYBE_UNUSED static dopt_status dopt__worker_wait(dopt__worker *w, uint64_t ticket) {
    dopt_status s;
#ifdef DOPT__THREADS
    double spin_until = dopt__now_ms() + 0.02;
    int done;
    do {
        s = dopt__worker_test(w, ticket, &done);
        if (done) return s;
    } while (dopt__now_ms() < spin_until);
    pthread_mutex_lock(&w->lock);
    while (w->finished < ticket) pthread_cond_wait(&w->done, &w->lock);
    s = dopt__worker_status(w, ticket);
    pthread_mutex_unlock(&w->lock);
#else
    s = dopt__worker_status(w, ticket);
#endif
    return s;
}

/* Runs what is queued, then stops the thread and frees w. */
DOPT__MAYBE_UNUSED static void dopt__worker_free(dopt__worker *w) {
    if (w == NULL) return;
#ifdef DOPT__THREADS
    pthread_mutex_lock(&w->lock);
    w->stopping = 1;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->done);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->lock);
#endif
    DOPT_FREE(w->jobs);
    DOPT_FREE(w);
}

/* ===================================================================== COLLECTIVES */

DOPT_DEF dopt_status dopt_allreduce_start(dopt_comm *c, void *buf, size_t count, dopt_dtype dt, dopt_op op,
                                          dopt_request *req) {
    dopt_coll_desc d;
    dopt_status s = dopt__begin(c, &d, DOPT_COLL_ALLREDUCE, count);
    dopt__req_done(c, req, s);
    if (s != DOPT_OK) return s;
    d.dtype = dt;
    d.op = op;
    if (dopt_dtype_size(dt) == 0 || (unsigned)op > (unsigned)DOPT_MEAN)
        s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "unknown dtype %d or op %d", (int)dt, (int)op);
    else if (buf == NULL && count > 0)
        s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "NULL buffer");
    else if (count > SIZE_MAX / dopt_dtype_size(dt))
        s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "count overflows size_t bytes");
    if (s == DOPT_OK) {
        dopt_coll_args a;
        memset(&a, 0, sizeof a);
        a.buf = buf;
        return dopt__start(c, &d, &a, req);
    }
    dopt__req_done(c, req, s);
    return s;
}

DOPT_DEF dopt_status dopt_allreduce(dopt_comm *c, void *buf, size_t count, dopt_dtype dt, dopt_op op) {
    dopt_request req;
    dopt_status s = dopt_allreduce_start(c, buf, count, dt, op, &req);
    return s != DOPT_OK ? s : dopt_wait(&req);
}

/* A failure every rank reaches on its own from the same inputs. It takes a sequence number like a
   collective, so that the detail reads the same way on every rank. */
static dopt_status dopt__fail_agreed(dopt_comm *c, size_t count, dopt_dtype dt, const char *why, double value) {
    dopt_coll_desc d;
    dopt_status s = dopt__begin(c, &d, DOPT_COLL_ALLREDUCE, count);
    d.dtype = dt;
    d.op = DOPT_MEAN;
    return s != DOPT_OK ? s : dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "weighted mean: %s (%g)", why, value);
}

DOPT_DEF dopt_status dopt_allreduce_weighted_mean(dopt_comm *c, void *buf, size_t count, dopt_dtype dt,
                                                  double weight) {
    double total = weight, share;
    size_t i;
    dopt_status s;
    if (c == NULL) return DOPT_ERR_INVALID;
    if (dt != DOPT_F32 && dt != DOPT_F64) return dopt__fail_agreed(c, count, dt, "dtype is not f32 or f64", 0.0);
    if (buf == NULL && count > 0) total = NAN; /* every rank then refuses */
    /* The total goes first, so that a bad total is known everywhere before any buffer is touched. */
    s = dopt_allreduce(c, &total, 1, DOPT_F64, DOPT_SUM);
    if (s != DOPT_OK) return s;
    if (!(total > 0.0) || !dopt__is_finite(total))
        return dopt__fail_agreed(c, count, dt, "weights sum to a non-positive or non-finite total, or a buffer is NULL",
                                 total);
    share = weight / total;
    if (dt == DOPT_F32) {
        dopt_scale((float *)buf, (float)share, count);
    } else {
        for (i = 0; i < count; i++) ((double *)buf)[i] *= share;
    }
    return dopt_allreduce(c, buf, count, dt, DOPT_SUM);
}

/* Blocks of bytes[r] bytes (c->block_bytes or the sizes allgatherv exchanged). */
static dopt_status dopt__gather_start(dopt_comm *c, const dopt_coll_desc *d, const void *send, void *recv,
                                      const size_t *bytes, dopt_request *req) {
    dopt_coll_args a;
    memset(&a, 0, sizeof a);
    a.send = send;
    a.recv = recv;
    a.bytes = bytes;
    return dopt__start(c, d, &a, req);
}

DOPT_DEF dopt_status dopt_allgather_start(dopt_comm *c, const void *send, void *recv, size_t bytes, dopt_request *req) {
    dopt_coll_desc d;
    int r;
    dopt_status s = dopt__begin(c, &d, DOPT_COLL_ALLGATHER, bytes);
    dopt__req_done(c, req, s);
    if (s != DOPT_OK) return s;
    if (bytes > 0 && (send == NULL || recv == NULL))
        s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "NULL buffer");
    else if (bytes > SIZE_MAX / (size_t)c->size)
        s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "size * bytes overflows size_t");
    if (s != DOPT_OK) {
        dopt__req_done(c, req, s);
        return s;
    }
    for (r = 0; r < c->size; r++) c->block_bytes[r] = bytes;
    return dopt__gather_start(c, &d, send, recv, c->block_bytes, req);
}

DOPT_DEF dopt_status dopt_allgather(dopt_comm *c, const void *send, void *recv, size_t bytes) {
    dopt_request req;
    dopt_status s = dopt_allgather_start(c, send, recv, bytes, &req);
    return s != DOPT_OK ? s : dopt_wait(&req);
}

DOPT_DEF dopt_status dopt_allgatherv(dopt_comm *c, const void *send, size_t send_bytes, void *recv,
                                     size_t recv_capacity, size_t *recv_bytes) {
    dopt_coll_desc d;
    dopt_request req;
    uint64_t mine[2], total = 0;
    int r, null_rank = -1, short_rank = -1;
    dopt_status s;
    if (c == NULL || recv_bytes == NULL) return DOPT_ERR_INVALID;
    /* Each rank gives its block size and its capacity (0 for a NULL buffer), so every rank can
       tell whether all can take the total and fail together instead of leaving a peer waiting. */
    mine[0] = (send == NULL && send_bytes > 0) ? UINT64_MAX : (uint64_t)send_bytes;
    mine[1] = recv == NULL ? 0 : (uint64_t)recv_capacity;
    s = dopt_allgather(c, mine, c->gatherv_sizes, sizeof mine);
    if (s != DOPT_OK) return s;
    for (r = 0; r < c->size; r++) {
        uint64_t b = c->gatherv_sizes[2 * r];
        if (b == UINT64_MAX && null_rank < 0) null_rank = r;
        total = (b > UINT64_MAX - total) ? UINT64_MAX : total + b;
    }
    for (r = 0; r < c->size; r++)
        if (c->gatherv_sizes[2 * r + 1] < total && short_rank < 0) short_rank = r;
    s = dopt__begin(c, &d, DOPT_COLL_ALLGATHERV, total);
    if (s != DOPT_OK) return s;
    if (null_rank >= 0)
        return dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "rank %d passed a NULL send buffer", null_rank);
    if (total > (uint64_t)SIZE_MAX)
        return dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "blocks total %llu bytes", (unsigned long long)total);
    if (short_rank >= 0)
        return dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "blocks total %llu bytes but rank %d can receive %llu",
                              (unsigned long long)total, short_rank,
                              (unsigned long long)c->gatherv_sizes[2 * short_rank + 1]);
    for (r = 0; r < c->size; r++) recv_bytes[r] = (size_t)c->gatherv_sizes[2 * r];
    s = dopt__gather_start(c, &d, send, recv, recv_bytes, &req);
    return s != DOPT_OK ? s : dopt_wait(&req);
}

DOPT_DEF dopt_status dopt_broadcast_start(dopt_comm *c, void *buf, size_t bytes, int root, dopt_request *req) {
    dopt_coll_desc d;
    dopt_status s = dopt__begin(c, &d, DOPT_COLL_BROADCAST, bytes);
    dopt__req_done(c, req, s);
    if (s != DOPT_OK) return s;
    d.root = root;
    if (root < 0 || root >= c->size)
        s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "root %d outside [0, %d)", root, c->size);
    else if (buf == NULL && bytes > 0)
        s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "NULL buffer");
    if (s == DOPT_OK) {
        dopt_coll_args a;
        memset(&a, 0, sizeof a);
        a.buf = buf;
        return dopt__start(c, &d, &a, req);
    }
    dopt__req_done(c, req, s);
    return s;
}

DOPT_DEF dopt_status dopt_broadcast(dopt_comm *c, void *buf, size_t bytes, int root) {
    dopt_request req;
    dopt_status s = dopt_broadcast_start(c, buf, bytes, root, &req);
    return s != DOPT_OK ? s : dopt_wait(&req);
}

DOPT_DEF dopt_status dopt_barrier(dopt_comm *c) {
    dopt_coll_desc d;
    dopt_coll_args a;
    dopt_request req;
    dopt_status s = dopt__begin(c, &d, DOPT_COLL_BARRIER, 0);
    if (s != DOPT_OK) return s;
    memset(&a, 0, sizeof a);
    s = dopt__start(c, &d, &a, &req);
    return s != DOPT_OK ? s : dopt_wait(&req);
}

DOPT_DEF dopt_status dopt_exchange_start(dopt_comm *c, uint64_t tag, const dopt_xfer *sends, int nsends,
                                         const dopt_xfer *recvs, int nrecvs, dopt_request *req) {
    dopt_coll_desc d;
    dopt_coll_args a;
    dopt_status s;
    int i;
    if (c == NULL) return DOPT_ERR_INVALID;
    if (!c->provider->exchanges && c->size > 1) { /* a rank-local verdict that every rank of the backend reaches */
        s = dopt__family_error(c);
        if (s == DOPT_OK) s = DOPT_ERR_UNSUPPORTED;
        dopt__req_done(c, req, s);
        return s;
    }
    s = dopt__begin(c, &d, DOPT_COLL_EXCHANGE, tag);
    dopt__req_done(c, req, s);
    if (s != DOPT_OK) return s;
    if (nsends < 0 || nrecvs < 0 || (nsends > 0 && sends == NULL) || (nrecvs > 0 && recvs == NULL))
        s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "bad message lists (%d sends, %d receives)", nsends, nrecvs);
    for (i = 0; s == DOPT_OK && i < nsends + nrecvs; i++) {
        const dopt_xfer *x = i < nsends ? &sends[i] : &recvs[i - nsends];
        const char *what = i < nsends ? "send" : "receive";
        if (x->peer < 0 || x->peer >= c->size || x->peer == c->rank)
            s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "a %s names rank %d (this rank is %d of %d)", what, x->peer,
                               c->rank, c->size);
        else if (x->buf == NULL && x->bytes > 0)
            s = dopt_comm_fail(c, &d, DOPT_ERR_INVALID, "a %s of %llu bytes from a NULL buffer", what,
                               (unsigned long long)x->bytes);
    }
    if (s != DOPT_OK) {
        dopt__req_done(c, req, s);
        return s;
    }
    memset(&a, 0, sizeof a);
    a.sends = sends;
    a.nsends = nsends;
    a.recvs = recvs;
    a.nrecvs = nrecvs;
    return dopt__start(c, &d, &a, req);
}

DOPT_DEF dopt_status dopt_exchange(dopt_comm *c, uint64_t tag, const dopt_xfer *sends, int nsends,
                                   const dopt_xfer *recvs, int nrecvs) {
    dopt_request req;
    dopt_status s = dopt_exchange_start(c, tag, sends, nsends, recvs, nrecvs, &req);
    return s != DOPT_OK ? s : dopt_wait(&req);
}

DOPT_DEF dopt_status dopt_comm_host_layout(const dopt_comm *c, dopt_host_layout *out) {
    if (c == NULL || out == NULL) return DOPT_ERR_INVALID;
    memset(out, 0, sizeof *out);
    out->two_level = DOPT_TWO_LEVEL_OFF;
    if (c->provider->host_layout) c->provider->host_layout(c, out);
    return DOPT_OK;
}

DOPT_DEF int dopt_comm_host_rank(const dopt_comm *c, int host, int local_rank) {
    if (c == NULL || c->provider->host_rank == NULL) return -1;
    return c->provider->host_rank(c, host, local_rank);
}

/* ===================================================================== GROUPS

   A group is a communicator of its own. Over links (engine.h) it shares its root's, with the
   group's number in every frame header; the number is agreed here: the largest "next free
   number" among the splitting ranks, so two groups that share a pair of ranks never share one.
   A backend without links makes its groups itself (vt->split). */


DOPT_DEF dopt_status dopt_comm_split(dopt_comm *c, int color, int key, dopt_comm **out) {
    int64_t mine[3], *all;
    uint32_t number = 0;
    int r, bad = -1;
    dopt_status s;
    if (c == NULL || out == NULL) return DOPT_ERR_INVALID;
    *out = NULL;
    if (dopt__family_error(c) != DOPT_OK) return c->error;
    if (c->provider->split == NULL && !DOPT__VT_HAS(c->vt, split)) {
        dopt_comm_log(c, DOPT_LOG_ERROR,
                      "rank %d: dopt_comm_split: this %s communicator cannot make groups (it has no links: "
                      "shm has them up to 64 ranks); TCP and MPI can", c->rank, c->vt->name);
        return DOPT_ERR_UNSUPPORTED;
    }
    all = (int64_t *)DOPT_MALLOC(sizeof(int64_t) * 3 * (size_t)c->size);
    if (all == NULL) return DOPT_ERR_NOMEM;
    mine[0] = color;
    mine[1] = key;
    mine[2] = c->provider->split ? (int64_t)dopt__family_root(c)->next_group : 0;
    s = dopt_allgather(c, mine, all, sizeof mine);
    for (r = 0; s == DOPT_OK && r < c->size; r++) {
        if (all[3 * r] < DOPT_UNDEFINED && bad < 0) bad = r;
        if ((uint64_t)all[3 * r + 2] > number) number = (uint32_t)all[3 * r + 2];
    }
    if (s == DOPT_OK && bad >= 0)
        s = dopt_comm_fail(c, NULL, DOPT_ERR_INVALID,
                           "dopt_comm_split: rank %d passed color %lld (a color is >= 0, or DOPT_UNDEFINED)", bad,
                           (long long)all[3 * bad]);
    else if (s == DOPT_OK && c->provider->split && number >= (1u << 24))
        s = dopt_comm_fail(c, NULL, DOPT_ERR_INVALID, "dopt_comm_split: 2^24 groups made already");
    if (s == DOPT_OK && c->provider->split) {
        dopt__family_root(c)->next_group = number + 1;
        if (color >= 0) s = c->provider->split(c, all, number, out);
        if (s != DOPT_OK) s = dopt_comm_fail(c, NULL, s, "dopt_comm_split: cannot allocate the group");
    } else if (s == DOPT_OK) {
        s = c->vt->split(c, color, key, out);
    }
    DOPT_FREE(all);
    return s;
}

/* This host, as a string the ranks compare: the host name and, where POSIX calls are declared,
   the network namespace (so that simulated hosts on one machine differ). */
static void dopt__host_identity(char *out, size_t cap) {
    char name[64] = "";
    unsigned long long ns = 0;
    FILE *f = fopen("/proc/sys/kernel/hostname", "r");
    if (f) {
        if (fgets(name, sizeof name, f) == NULL) name[0] = '\0';
        fclose(f);
        name[strcspn(name, "\n")] = '\0';
    }
#if defined(_POSIX_C_SOURCE) || defined(_DEFAULT_SOURCE) || defined(_GNU_SOURCE)
    {
        struct stat st;
        if (name[0] == '\0') gethostname(name, sizeof name - 1);
        if (stat("/proc/self/ns/net", &st) == 0) ns = (unsigned long long)st.st_ino;
    }
#endif
    snprintf(out, cap, "%s/%llu", name, ns);
}

DOPT_DEF dopt_status dopt_comm_split_host(dopt_comm *c, dopt_comm **out) {
    char id[96]; /* a 63-byte host name, '/', 20 digits */
    char *all;
    int color;
    dopt_status s;
    if (c == NULL || out == NULL) return DOPT_ERR_INVALID;
    *out = NULL;
    if (dopt__family_error(c) != DOPT_OK) return c->error;
    color = c->provider->host_of ? c->provider->host_of(c) : -1;
    if (color >= 0) return dopt_comm_split(c, color, c->rank, out); /* the backend said where each rank runs */
    memset(id, 0, sizeof id);
    dopt__host_identity(id, sizeof id);
    all = (char *)DOPT_MALLOC(sizeof id * (size_t)c->size);
    if (all == NULL) return DOPT_ERR_NOMEM;
    s = dopt_allgather(c, id, all, sizeof id);
    for (color = 0; s == DOPT_OK && color < c->size; color++) /* the lowest rank on this host */
        if (memcmp(all + (size_t)color * sizeof id, id, sizeof id) == 0) break;
    DOPT_FREE(all);
    if (s != DOPT_OK) return s;
    return dopt_comm_split(c, color, c->rank, out);
}

/* ===================================================================== PROVIDER: THE BACKEND'S OWN COLLECTIVES

   A backend without links runs every collective itself, through the vtable; each completes in
   the call that starts it. engine.h hands the kinds a backend with links runs itself (its
   DOPT_PROVIDES_* bits) to this provider too, once what it has in flight has finished. */

/* 1 when the vtable has the function that runs kind (an exchange needs none: a world of one). */
static int dopt__own_runs(const dopt_comm_vtable *vt, dopt_coll kind) {
    switch (kind) {
    case DOPT_COLL_ALLREDUCE: return vt->allreduce != NULL;
    case DOPT_COLL_ALLGATHER:
    case DOPT_COLL_ALLGATHERV: return vt->allgatherv != NULL;
    case DOPT_COLL_BROADCAST: return vt->broadcast != NULL;
    case DOPT_COLL_BARRIER: return vt->barrier != NULL;
    case DOPT_COLL_EXCHANGE: return 1;
    }
    return 0;
}

static dopt_status dopt__own_start(dopt_comm *c, const dopt_coll_desc *d, const dopt_coll_args *a, uint64_t *ticket) {
    const dopt_comm_vtable *vt = c->vt;
    size_t count = (size_t)d->count;
    dopt_status s = DOPT_OK;
    *ticket = 0;
    if (!dopt__own_runs(vt, d->kind)) /* a backend with links that names no provider */
        return dopt_comm_fail(c, d, DOPT_ERR_UNSUPPORTED, "the %s backend does not run it (links need engine.h's "
                              "dopt_engine_provider in the vtable)", vt->name);
    switch (d->kind) {
    case DOPT_COLL_ALLREDUCE:
        s = dopt__finish_bytes(c, d, vt->allreduce(c, d, a->buf), d->count * dopt_dtype_size(d->dtype));
        if (s == DOPT_OK && d->op == DOPT_MEAN && c->size > 1) dopt__divide(a->buf, count, d->dtype, c->size);
        return s;
    case DOPT_COLL_ALLGATHER:
    case DOPT_COLL_ALLGATHERV:
        return dopt__finish_bytes(c, d, vt->allgatherv(c, d, a->send, a->recv, a->bytes), a->bytes[c->rank]);
    case DOPT_COLL_BROADCAST: return dopt__finish(c, d, vt->broadcast(c, d, a->buf));
    case DOPT_COLL_BARRIER: return dopt__finish(c, d, vt->barrier(c, d));
    case DOPT_COLL_EXCHANGE: return dopt__finish_bytes(c, d, DOPT_OK, 0); /* a world of one: nothing to move */
    }
    return s;
}

DOPT_DEF const dopt_coll_provider *dopt_own_provider(void) {
    static const dopt_coll_provider own = {"own", 0, NULL, dopt__own_start, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    return &own;
}

/* ===================================================================== SELF BACKEND (WORLD OF ONE) */

static dopt_status dopt__self_allreduce(dopt_comm *c, const dopt_coll_desc *d, void *buf) {
    (void)c;
    (void)d;
    (void)buf;
    return DOPT_OK;
}

static dopt_status dopt__self_allgatherv(dopt_comm *c, const dopt_coll_desc *d, const void *send, void *recv,
                                         const size_t *bytes) {
    (void)c;
    (void)d;
    if (bytes[0] > 0 && send != recv) memmove(recv, send, bytes[0]);
    return DOPT_OK;
}

static dopt_status dopt__self_broadcast(dopt_comm *c, const dopt_coll_desc *d, void *buf) {
    (void)c;
    (void)d;
    (void)buf;
    return DOPT_OK;
}

static dopt_status dopt__self_barrier(dopt_comm *c, const dopt_coll_desc *d) {
    (void)c;
    (void)d;
    return DOPT_OK;
}

static void dopt__self_destroy(dopt_comm *c) { (void)c; }

static dopt_status dopt__self_split(dopt_comm *c, int color, int key, dopt_comm **out) {
    (void)c, (void)key;
    return color < 0 ? DOPT_OK : dopt_comm_create_self(out);
}

static const dopt_comm_vtable dopt__self_vtable = {
    "self", dopt__self_allreduce, dopt__self_allgatherv, dopt__self_broadcast, dopt__self_barrier,
    dopt__self_destroy, sizeof(dopt_comm_vtable), DOPT_PROVIDES_ALL, NULL, NULL, NULL, NULL, dopt__self_split, NULL, NULL, NULL, NULL,
    NULL};

DOPT_DEF dopt_status dopt_comm_create_self(dopt_comm **out) {
    return dopt_comm_new(out, 0, 1, &dopt__self_vtable, NULL);
}

/* ===================================================================== FOR MODULES

   The private names of this file that the other headers (engine.h, the transports, clip.h,
   compress.h, localsgd.h) may use, each declared once more here with what it guarantees: a reader lists every
   crossing from this block alone, and tests/check_hygiene.sh fails when a header uses a dopt__ or
   DOPT__ name of this file that is not here. Anything else private may change without notice.

   Macros: DOPT__MAYBE_UNUSED (marks a static function a build may leave unused);
   DOPT__VT_HAS(vt, f) (the backend's vtable has field f: its struct_size covers it, and it is set);
   DOPT__THREADS (1 where POSIX threads are built in, else undefined); DOPT__BLAS (1 where the
   kernels call OpenBLAS); DOPT__FNV_OFFSET (the 64-bit FNV-1a basis dopt__fnv1a starts from) and
   DOPT__FNV_PRIME (its prime: localsgd.h's lanes of a state's hash step with it). */

/* NaN and infinity by their bits: the answers hold under -ffast-math and -Ofast. */
DOPT__MAYBE_UNUSED static int dopt__is_nan(double v);
DOPT__MAYBE_UNUSED static int dopt__is_finite(double v);
/* Little-endian fields of wire and state formats, whatever the host's byte order. */
DOPT__MAYBE_UNUSED static void dopt__put_le16(unsigned char *p, uint32_t v);
DOPT__MAYBE_UNUSED static void dopt__put_le32(unsigned char *p, uint32_t v);
DOPT__MAYBE_UNUSED static void dopt__put_le64(unsigned char *p, uint64_t v);
DOPT__MAYBE_UNUSED static uint32_t dopt__get_le16(const unsigned char *p);
DOPT__MAYBE_UNUSED static uint32_t dopt__get_le32(const unsigned char *p);
DOPT__MAYBE_UNUSED static uint64_t dopt__get_le64(const unsigned char *p);
/* 64-bit FNV-1a of bytes, continued from h (start from DOPT__FNV_OFFSET): checksums of state. */
DOPT__MAYBE_UNUSED static uint64_t dopt__fnv1a(uint64_t h, const void *data, size_t bytes);
#if defined(DOPT__AVX512_PHILOX)
/* Philox-4x32-10's rounds on groups of sixteen counters, bit for bit dopt_philox4x32's. */
static void dopt__philox16_rounds(__m512i c[][4], int groups, uint32_t key0, uint32_t key1);
#endif
/* a mod n in [0, n) for any sign of a (ring positions). */
static int dopt__mod(long long a, int n);
/* The ring's cut of count elements into n segments: segment i is [*first, *first + *len), the
   engine's and every module's ring agree on it. */
static void dopt__ring_segment(uint64_t count, int n, int i, uint64_t *first, uint64_t *len);
/* Milliseconds on a clock that does not jump; whole milliseconds left until deadline (0 when
   past, rounded up). */
static double dopt__now_ms(void);
static int dopt__ms_left(double deadline);
/* A whole-number launch variable in [min, max]: 1 with *out, 0 unset or empty, -1 with why. */
DOPT__MAYBE_UNUSED static int dopt__env_long(const char *var, long min, long max, long *out, char *why, size_t cap);
/* 1 when var is set and not empty. */
static int dopt__env_set(const char *var);
/* The failure of c's family (the root and its groups share links): poisons c with it and returns
   it, DOPT_OK while none failed. */
static dopt_status dopt__family_error(dopt_comm *c);
/* Forgets a failure that starting over made moot, on the communicator and on its family. */
DOPT__MAYBE_UNUSED static void dopt__comm_forget_failure(dopt_comm *c);
/* A backend's shrink that cannot go on: writes c's detail ("rank R: dopt_comm_shrink: " and the
   reason; c failed already, so dopt_comm_fail would keep the first failure's), says it in one
   error line, and returns st. */
DOPT__MAYBE_UNUSED static dopt_status dopt__shrink_fail(dopt_comm *c, dopt_status st, const char *fmt, ...);
/* The rank a detail names c's rank by: in a group, its rank in the root (the links' numbering). */
static int dopt__rank_named(const dopt_comm *c);
/* The flight recorder's hooks for the engine (FLIGHT RECORDER; c: the family's root, slot: the
   entry dopt__rec_current gave the collective starting now): a receive from peer is expected, one
   of them completed (timed, charged to owner's traffic unless owner is NULL), the collective
   completed or failed. None allocates; each is a no-op for slot 0. */
static uint64_t dopt__rec_current(const dopt_comm *c);
DOPT__MAYBE_UNUSED static void dopt__rec_expect(dopt_comm *c, uint64_t slot, int peer);
DOPT__MAYBE_UNUSED static void dopt__rec_arrived(dopt_comm *c, dopt_comm *owner, uint64_t slot, int peer);
static void dopt__rec_end(dopt_comm *c, dopt_comm *owner, uint64_t slot, dopt_status s);
/* Divides count elements of buf by size (a MEAN's last step: the same expression on every rank). */
static void dopt__divide(void *buf, size_t count, dopt_dtype dt, int size);
/* The ordered worker (THE ORDERED WORKER): jobs run one at a time, in post order, on one thread
   (without threads, inside post); test and wait give job ticket - 1's status once it finished
   (DOPT_ERR_INVALID once cap later jobs were posted: keep a status that must last in the job);
   free runs what is queued first. A job may call a communicator the poster leaves alone until it
   has waited for the job. */
DOPT__MAYBE_UNUSED static dopt_status dopt__worker_new(dopt__worker **out, int cap);
DOPT__MAYBE_UNUSED static dopt_status dopt__worker_post(dopt__worker *w, dopt__job_fn fn, void *arg, uint64_t *ticket);
DOPT__MAYBE_UNUSED static dopt_status dopt__worker_test(dopt__worker *w, uint64_t ticket, int *done);
DOPT__MAYBE_UNUSED static dopt_status dopt__worker_wait(dopt__worker *w, uint64_t ticket);
DOPT__MAYBE_UNUSED static void dopt__worker_free(dopt__worker *w);

#ifdef __cplusplus
}
#endif

#ifdef DOPT__GCC_AVX512_PRAGMAS
#  pragma GCC diagnostic pop
#endif

#endif /* DISTOPT_IMPLEMENTATION */

/* MIT License. Copyright (c) 2026 the distopt authors.
   Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
   associated documentation files (the "Software"), to deal in the Software without restriction,
   including without limitation the rights to use, copy, modify, merge, publish, distribute,
   sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
   furnished to do so, subject to the following conditions: The above copyright notice and this
   permission notice shall be included in all copies or substantial portions of the Software.
   THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED. */
