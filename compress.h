/* compress.h — gradient compressors behind one interface (TernGrad's ternary, QSGD, top-k, sign,
   fp16, bf16, PowerSGD's low-rank factors), error feedback, a validated wire format, and the
   compressed allreduce.
   Part of distopt 0.1.0. MIT licence (see the end of distopt.h).

   DO THIS in exactly one C or C++ file of your program, before including the headers:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "compress.h"

   Other files include the two headers without the macro. compress.h needs distopt.h only.

   CONTENTS
     This comment, the manual: QUICK START, COMPRESSORS, CONFIGURATION, FUNCTIONS, BYTES AS THE
     WORLD GROWS, NON-FINITE GRADIENTS, RANDOMNESS, ERROR FEEDBACK, POWERSGD, NONBLOCKING AND
     BUCKETS, ERRORS, THREADING.
     Then the declarations; REFERENCE FOR CONTRIBUTORS (how the allreduce exchanges and sums, the
     rings, the wire and state formats); and the implementation in three parts, each under its
     banner:
       PART 1 OF 3 — WHAT THE BITS ARE     the codecs and THE CODEC TABLE, the message layout,
                                           encode and decode, error feedback, PowerSGD's
                                           factors, the state, init and free
       PART 2 OF 3 — HOW THEY TRAVEL       the integer and 16-bit rings: kernels, schedule,
                                           pipeline, and the ring path of the allreduce
       PART 3 OF 3 — THE COMPRESSED        the allgather path, the choice between it, the ring
                     ALLREDUCE             and PowerSGD, and the public allreduce calls

   QUICK START (TernGrad over any communicator: every rank ends with the same averaged gradient)

       dopt_segment segs[2] = {{0, 4096, "w", 0}, {4096, 64, "b", 0}};   (the host's tensors)
       dopt_comm *comm;
       dopt_compressor tern;
       dopt_compressor_config cfg;
       dopt_status st = DOPT_OK;
       memset(&cfg, 0, sizeof cfg);               (zero: ternary, c = 2.5, scale sharing on)
       cfg.seed = 42;
       if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1;     (launch.h)
       if (dopt_compressor_init(&tern, &cfg, segs, 2) != DOPT_OK) return 1;
       for (step = 0; step < steps; step++) {
           forward_backward(params, grads);                        (the host's own code)
           st = dopt_compress_allreduce(&tern, comm, grads, 4160);
           if (st == DOPT_ERR_NONFINITE) continue;   (every rank skips this step together)
           if (st != DOPT_OK) break;
           sgd_update(params, grads);             (same averaged gradient on every rank)
       }
       dopt_compressor_free(&tern);
       return dopt_comm_finish(comm, st);

   With localsgd.h's driver, hand the compressor to it instead of calling the allreduce yourself:
   dopt_dp_config's grad_compressor averages the gradients of synchronous steps through it, its
   compressor the model deltas of local SGD's averages (localsgd.h's quick start).

   Parameter localization (TernGrad §3): every rank applies the same averaged gradient to its own
   copy of the parameters; the copies stay identical when they start identical (broadcast them
   from rank 0 once) because the averaged gradient is bitwise the same on every rank. That holds
   for ranks running one build: every rank decodes the same messages with the same code, and the
   vector and portable paths give the same bits, but two compilers may round y += w·v differently
   (clang fuses a multiply-add within an expression by default, GCC in ISO mode does not), so a
   job that mixes builds of different compilers or -ffp-contract settings can drift apart.

   COMPRESSORS

   | codec               | bits / element                  | unbiased | error feedback (EF_AUTO) |
   |---------------------|---------------------------------|----------|--------------------------|
   | DOPT_CODEC_TERNARY  | 2 (+ 32 per segment)            | yes (1)  | off                      |
   | DOPT_CODEC_QSGD     | 4 for s <= 7, 8 for s <= 127    | yes      | off                      |
   |                     | (+ 32 per bucket)               |          |                          |
   | DOPT_CODEC_TOPK     | 64 per kept element (index +    | no       | on                       |
   |                     | value): 0.64 at ratio 0.01      |          |                          |
   | DOPT_CODEC_SIGN     | 1 (+ 32 per segment)            | no       | on                       |
   | DOPT_CODEC_FP16     | 16                              | no (2)   | off                      |
   | DOPT_CODEC_BF16     | 16                              | no (2)   | off                      |
   | DOPT_CODEC_FP32     | 32 (no compression: a baseline) | exact    | off                      |
   | DOPT_CODEC_MAJORITY | 1 (+ 32 per segment)            | no (3)   | off                      |
   | DOPT_CODEC_POWERSGD | r·(rows + cols) floats per      | no       | always on (4)            |
   |                     | matrix per step, independent of |          |                          |
   |                     | N; 32 for the rest (fp32)       |          |                          |

   (1) Unbiased for the clipped gradient: E[s·t] = clip(g). Clipping itself (c·σ, on by default,
       as TernGrad does) trades a small bias for a lower variance.
   (2) Round to nearest even: the error is below half a unit in the last place, not zero-mean.
   (3) signSGD with majority vote (Bernstein et al. 2018): each rank sends the signs of its
       gradient (a zero counts as +), and the result is the sign of the vote, sign(Σ_r sign(g_r)),
       0 where the vote ties (an even N); times 1, or with majority_l1 = 1 the ranks' mean of
       ‖g‖₁/d per segment (the scale sign's messages carry). Every rank gets the same values.
   (4) PowerSGD: DOPT_EF_OFF is refused: PowerSGD without its error feedback does not converge well.
   Every segment also costs a 16-byte record header and padding to 8 bytes; the message a 32-byte
   header. dopt_compress_bound gives the exact total. PowerSGD sends no message: it averages its
   factors with two fp32 allreduces per step (POWERSGD below).

   CONFIGURATION (dopt_compressor_config; all zero means the defaults)

   | field           | meaning                                                  | zero means         |
   |-----------------|----------------------------------------------------------|--------------------|
   | codec           | which compressor                                         | DOPT_CODEC_TERNARY |
   | seed            | key of the random rounding (ternary, QSGD); give every   | 0                  |
   |                 | rank the same seed (the rank is mixed in)                |                    |
   | rank            | rank in the RNG key for dopt_compress_encode (the        | 0                  |
   |                 | allreduce uses comm->rank and keeps it in cz->rank,      |                    |
   |                 | which later encodes use; the config is never written)    |                    |
   | clip_c          | ternary: clip each segment to ±c·σ before scaling;       | 2.5                |
   |                 | DOPT_CLIP_OFF (any negative value) disables it           |                    |
   | no_scale_sharing| ternary allreduce: 1 = each rank keeps its own scale     | 0: shared (max)    |
   | fp32_below      | ternary: segments with fewer elements go as fp32         | 0: none            |
   | qsgd_levels     | QSGD: s, 1..127 (4-bit codes up to 7, 8-bit above)       | 7                  |
   | qsgd_bucket     | QSGD: elements per bucket (one norm each)                | 512                |
   | topk_ratio      | top-k: k = ceil(ratio·count) per segment (at least 1),   | 0.01               |
   |                 | 0 < ratio <= 1                                           |                    |
   | error_feedback  | DOPT_EF_AUTO, DOPT_EF_ON, DOPT_EF_OFF                    | AUTO (see table)   |
   | majority_l1     | majority: 1 = scale the vote by the mean ‖g‖₁/d          | 0: ±1              |
   | aggregate       | how the allreduce combines the ranks' messages:          | DOPT_AGG_AUTO      |
   |                 | DOPT_AGG_AUTO (the cheaper by prediction), _ALLGATHER,   |                    |
   |                 | _RING (ternary: where the ring can run; see BYTES AS THE |                    |
   |                 | WORLD GROWS)                                             |                    |
   | powersgd_rank   | PowerSGD: r, the rank of the factors, 1..64 (checked for | 2                  |
   |                 | every codec)                                             |                    |
   | powersgd_min    | PowerSGD: a matrix of fewer elements goes as fp32        | 4096               |
   | ring_buckets    | ternary on the ring: buckets the call pipelines (each    | 0: one per 1 Mi    |
   |                 | encoded while the ring sums the one before), 1..64       | elements, up to 16 |

   FUNCTIONS

   dopt_status dopt_compressor_init(dopt_compressor *cz, const dopt_compressor_config *cfg,
                                    const dopt_segment *segs, size_t nsegs)
     Sizes a compressor for a gradient layout: segs[0..nsegs) (offsets into a flat buffer, in
     increasing order, non-overlapping; gaps belong to no segment and are never touched). The
     table is copied; only PowerSGD reads the segments' rows. cfg may be NULL (all defaults).
     Allocates the message buffer, and with error feedback the residual (zero) and a work buffer
     of one float per element; PowerSGD also every compressed matrix's Q and a Gram–Schmidt
     workspace (rows × r doubles of the tallest). Errors: DOPT_ERR_INVALID (NULL cz, nsegs = 0
     or segs NULL, a bad table, a config value out of range, top-k with a segment of 2^32
     elements or more; PowerSGD with DOPT_EF_OFF, a segment whose count is not a multiple of its
     rows, or a compressed matrix with 2^31 rows or columns or more), DOPT_ERR_NOMEM. The object
     must not move after init. init sets every field of *cz, so it needs no initialiser (no
     "= {0}", which C++ refuses and -Wc++-compat warns about); on failure *cz is left zeroed
     (dopt_compressor_free accepts it) and nothing needs freeing.

   void dopt_compressor_free(dopt_compressor *cz)
     Releases everything init and the allreduce allocated. NULL and a zeroed object are accepted.

   size_t dopt_compress_bound(const dopt_compressor *cz)
     The size in bytes of every message this compressor writes: it depends only on the layout
     and the configuration, so it is exact, not just a bound, and the same on every rank (a
     segment call's message, of fewer segments, is shorter).
     PowerSGD, which writes none: the bytes of its two allreduces per step, 4 · (Σ r·(rows +
     cols) over the compressed matrices + the elements of the other segments + 2 flags).

   dopt_status dopt_compress_encode(dopt_compressor *cz, const dopt_buf *grads, void *out,
                                    size_t capacity, size_t *bytes)
     Compresses grads (flat or scatter list, with the same segment counts as the layout) into
     out, capacity >= dopt_compress_bound, and stores the size in *bytes. Ternary uses its own
     scales (no sharing: no communicator here). With error feedback it compresses p = g + e and
     sets e = p - C(p). Advances the step (the RNG key). grads is not modified. Errors:
     DOPT_ERR_INVALID (layout mismatch, capacity too small, NULL arguments), DOPT_ERR_NONFINITE
     (any codec: see NON-FINITE GRADIENTS; out then holds the flagged message, *bytes is set,
     and the step and the residual are unchanged), DOPT_ERR_UNSUPPORTED (PowerSGD: its factors
     need a round of communication between the two products, so there is no message; nothing
     changes). DOPT_ERR_INVALID too while a step is being averaged in parts (NONBLOCKING AND
     BUCKETS).

   dopt_status dopt_compress_decode(const dopt_compressor *cz, const void *msg, size_t bytes,
                                    float weight, const dopt_buf *accum)
     Decodes a message of this compressor's layout and adds weight · C(g) into accum (flat or
     scatter list, the layout's segment counts). The message is validated completely before
     accum is touched; anything that does not follow the wire format (REFERENCE FOR CONTRIBUTORS
     below) — a wrong magic, version,
     codec, layout, size, a 2-bit code 11, a level above s, an index out of range or out of
     order, non-zero padding or unused bits, a negative or non-finite scale or norm, a NaN or
     infinity among the values (fp32, fp16, bf16, top-k's, ternary's fp32 segments) — returns
     DOPT_ERR_PROTOCOL. A flagged message (its sender's gradient was not finite) returns
     DOPT_ERR_NONFINITE, accum untouched. PowerSGD: DOPT_ERR_UNSUPPORTED (no messages). Never
     reads outside msg[0, bytes) nor writes outside accum. Pure: may be called from several
     threads on different accum buffers.

   dopt_status dopt_compress_allreduce(dopt_compressor *cz, dopt_comm *comm, float *grads,
                                       size_t n)
   dopt_status dopt_compress_allreduce_buf(dopt_compressor *cz, dopt_comm *comm,
                                           const dopt_buf *grads)
     The compressed allreduce, in place: on return grads holds (1/N) Σ_r C_r(g_r), the same bytes
     on every rank. The flat form uses the layout's segment table on grads (n must reach the end
     of the last segment). How the messages are exchanged and summed: REFERENCE FOR CONTRIBUTORS
     below (THE COMPRESSED ALLREDUCE). The first
     call sizes the gather buffer for comm->size messages (one allocation, kept for later calls;
     a larger world later grows it once). The step and the residual change only when the call
     succeeds. Errors: those of the collectives, DOPT_ERR_INVALID, DOPT_ERR_NONFINITE (some
     rank's gradient holds a NaN or infinity: see NON-FINITE GRADIENTS), DOPT_ERR_PROTOCOL (a
     message that fails validation: every rank sees the same bytes, so every rank fails alike),
     DOPT_ERR_NOMEM (first call only). The communicator's detail names the failed collective as
     "dopt_compress_allreduce: allgather ..." (the message exchange) or
     "dopt_compress_allreduce: scale sharing: allreduce ..." (PowerSGD: "...: PowerSGD's P:
     allreduce ..." and "...: PowerSGD's Q: allreduce ...") — unless the caller has labelled the
     communicator itself (localsgd.h does, with the call the user made): that label stays. Every
     rank must call it with the same layout and configuration. One thread at a time per
     compressor. DOPT_ERR_INVALID too while a step is being averaged in parts: the whole call
     gives every segment, and some were given already (NONBLOCKING AND BUCKETS).

   dopt_status dopt_compress_allreduce_segments(dopt_compressor *cz, dopt_comm *comm,
                                                const dopt_buf *grads, const size_t *segs, size_t k)
     The compressed allreduce of some of the layout's segments, in place: segs[0..k) are indices
     into the segment table (k >= 1, each at most once, in any order). grads is the whole
     descriptor, as dopt_compress_allreduce_buf takes it (a flat buffer with the layout's table,
     or a scatter list of every segment); only the listed segments are read and written. Every
     rank lists the same segments in the same order: lists whose sizes differ fail as other
     layouts do (DOPT_ERR_MISMATCH or DOPT_ERR_PROTOCOL on every rank), but segments of equal
     sizes cannot be told apart. A segment's result, residual and random stream are those of
     the whole call (NONBLOCKING AND BUCKETS says where the bits can differ). Errors: those of dopt_compress_allreduce_buf; DOPT_ERR_INVALID also for segs NULL
     or k 0, an index beyond the table, or a segment given twice in one step, refused before
     anything starts (dopt_compress_detail says which).

   dopt_status dopt_compress_allreduce_start(dopt_compressor *cz, dopt_comm *comm,
                                             const dopt_buf *grads, const size_t *segs, size_t k,
                                             dopt_compress_request *req)
   dopt_status dopt_compress_test(dopt_compress_request *req, int *done)
   dopt_status dopt_compress_wait(dopt_compress_request *req)
     The segment call (segs NULL and k 0: every segment, the whole call) started: it returns at
     once and runs on the compressor's worker thread; test sets done without blocking, wait
     blocks until the call completed; both return its status once done (DOPT_OK from test while
     it runs). Refusals (DOPT_ERR_INVALID, DOPT_ERR_NOMEM for the worker) come from start
     itself, with nothing started, and req holds them. Semantics and rules: NONBLOCKING AND
     BUCKETS.

   const char *dopt_compress_detail(const dopt_compressor *cz)
     Why the last call of the segment or nonblocking family was refused with DOPT_ERR_INVALID
     before it started any collective (the communicator's detail says nothing then), e.g.
     "dopt_compress_allreduce_segments: segment 2 (w2) given twice in one step; 2 of its 4
     segments not given yet, the first 1 (b)"; "" after a call that was not refused.

   const void *dopt_compress_message(const dopt_compressor *cz, int rank, size_t *bytes)
     After an allreduce that gathered the messages (cz->path == DOPT_PATH_ALLGATHER): rank's
     message as gathered (for inspection and tests; after a segment call, the message of its
     segments); NULL otherwise (PowerSGD never gathers).

   cz->path says how the last allreduce combined the messages: DOPT_PATH_ALLGATHER,
     DOPT_PATH_RING (ternary sums along one ring), DOPT_PATH_RING_TWO_LEVEL (within hosts, then
     across them), DOPT_PATH_NONE (none yet, or it failed before exchanging); cz->buckets how
     many buckets a ring allreduce pipelined (0 off the ring). The
     communicator's traffic counters show it too: the ring's steps are exchanges
     (c->traffic.calls[DOPT_COLL_EXCHANGE]), and c->traffic.received[] holds the bytes a rank
     received on every path that runs on the engine.

   BYTES AS THE WORLD GROWS
     The allgather path hands every rank N - 1 messages: a rank receives (N - 1) times the bits
     per element of the table above — 2·(N - 1) for ternary, 14 at N = 8, 126 at N = 64, past
     fp32's ring allreduce (2·32·(N - 1)/N, about 64) at N = 32. Ternary with shared scales (the
     default) sums instead: the sum of N codes is an integer in [-N, N], reduced exactly along a
     ring of the engine in widening integers (a part that holds the sums of k ranks' codes
     travels in ceil(log2(2k + 1)) bits per element: 2 after one, 3 after two or three, 4 up to
     seven, ...), then the final sums go round once in ceil(log2(2N + 1)) bits. On a flat ring
     a rank receives, per element of the padded gradient and averaged over the ranks,
     (Σ_{k=1}^{N-1} ceil(log2(2k + 1)) + (N - 1)·ceil(log2(2N + 1)))/N bits: 2.5 at N = 2,
     3.667 at N = 3, 5 at N = 4, 7.375 at N = 8, 13.875 at N = 64. No part is wider than the
     final sums, so that stays below 2·ceil(log2(2N + 1)) bits: 8 at N = 4, 10 at N = 8, 16 at
     N = 64. When the communicator knows its ranks' hosts (TCP; dopt_comm_set_hosts) and each
     host has as many ranks, the sums are formed within each host first and the ring across
     hosts starts from the host's counts, so a host's link carries less (a rank receives 6.75 at
     4 hosts of 2). The result is the same bits either way, and the same as the allgather
     path's: integers add exactly, whatever the order. Majority vote sums its signs
     on the same ring (the same widths) and gets the allgather path's bits too. fp16 and bf16
     go round as 16-bit running means, each step adding its own value in fp32 and rounding the
     mean back to 16 bits: 2·16·(N - 1)/N bits per element received instead of 16·(N - 1); the
     result is the same on every rank and run after run, but not the allgather path's (which
     adds N exact values in rank order), and flat and by host round differently.
     DOPT_AGG_AUTO takes the ring when its predicted time is lower (REFERENCE FOR
     CONTRIBUTORS: THE INTEGER RING), which at 2 ranks it is not for ternary (2 bits against
     2.5); DOPT_AGG_RING insists, except where the ring cannot run: QSGD, top-k, sign, fp32,
     ternary without shared scales, a world of one, more than 16383 ranks (8191 for fp16 and
     bf16), a communicator without exchanges (MPI's groups, shm worlds beyond 64 ranks:
     distopt.h's dopt_exchange). QSGD, top-k, sign (with error feedback) and fp32 keep the
     allgather: their bytes grow as (N - 1) times their message.

   size_t dopt_compress_state_bytes(const dopt_compressor *cz)
   dopt_status dopt_compress_state_save(const dopt_compressor *cz, void *out, size_t capacity)
   dopt_status dopt_compress_state_load(dopt_compressor *cz, const void *in, size_t bytes)
     The per-rank state — the step (RNG counter) and the error-feedback residual; PowerSGD also
     r, which matrices it compresses and their rows, and every Q — as bytes (their layout:
     REFERENCE FOR CONTRIBUTORS below, STATE FORMAT).
     Load validates all of it against this compressor (DOPT_ERR_PROTOCOL otherwise, state
     unchanged). Save: DOPT_ERR_INVALID when capacity is too small.

   NON-FINITE GRADIENTS
     One rule for every codec. When a rank's gradient — with error feedback, p = g + e — holds
     a NaN or an infinity in a segment (elements in gaps between segments are never read), or a
     value its codec cannot carry (fp16: |x| >= 65520, which would round to infinity; bf16: |x|
     that rounds beyond 3.39e38; QSGD: a bucket whose norm exceeds FLT_MAX; PowerSGD: |x| >=
     2^64 ≈ 1.8e19 in a compressed matrix or in its products P = M·Q and Q = Mᵀ·P, below which
     none of its products can overflow), then dopt_compress_allreduce returns DOPT_ERR_NONFINITE
     on every rank together, writes nothing into any rank's grads, and leaves every rank's step
     and residual (PowerSGD: and Q) as they were: skip the step and go on with the next one. dopt_compress_encode returns it too, with the same state kept.
     Every rank learns it at no extra round trip (how: REFERENCE FOR CONTRIBUTORS below).
     The detection tests bits (an exponent of all ones) of the values each
     encoder reads in a pass it makes anyway (ternary's statistics, QSGD's norms, top-k's keys,
     sign's scale, the fp16/bf16/fp32 conversion; PowerSGD: a pass over M and over each product
     it makes), so it holds in hosts built with -Ofast or
     -ffast-math, where the compiler may assume that no float is NaN or infinite and fold
     isnan() or x != x away. The plain allreduce of distopt.h (dopt_allreduce) checks nothing:
     NaN and infinity pass through it like any value.

   RANDOMNESS
     Ternary and QSGD round with distopt's Philox generator, keyed by the seed and the rank, one
     stream per step and segment (the exact words each element uses: REFERENCE FOR CONTRIBUTORS
     below). A scale (ternary) or bucket norm (QSGD) below 1e-30, where 2^24/s would overflow
     a float, sends zero codes: a bias below 1e-30 per element. The result does not depend on
     threading, vector width or call order, and a run can be replayed. The step counts encodes
     (and PowerSGD's steps); it is saved with the state. PowerSGD draws from the seed alone (the
     same numbers on every rank): its first Q, and a column that Gram–Schmidt cannot keep
     (POWERSGD below).

   ERROR FEEDBACK
     A wrapper around any codec: p = g + e is compressed instead of g, and e = p - C(p) where
     C(p) is exactly what the message decodes to (the rank's own message is decoded with weight
     -1 into p). The residual is per-rank state: save it with dopt_compress_state_save.
     PowerSGD's C(p) is the averaged approximation every rank receives, M̂ = P·Qᵀ (its error
     feedback is part of the method: Vogels et al., Algorithm 2).

   POWERSGD (Vogels, Karimireddy, Jaggi 2019)
     Compresses the segments that have a shape (dopt_segment's rows: a rows × cols matrix, row
     by row) when r·(rows + cols) < rows·cols and the matrix holds at least powersgd_min
     elements. Per compressed matrix, on each rank, with its residual E:
         M = g + E;  P = M·Q;  P ← mean over the ranks;  P's columns made orthonormal;
         Q = Mᵀ·P;  Q ← mean over the ranks;  output M̂ = P·Qᵀ;  E ← M − M̂.
     Q is kept from one step to the next (the warm start: each step is one step of subspace
     iteration, so the factors follow the gradient's leading directions from step to step).
     Vectors (rows 0), small matrices and those that would not shrink go as fp32 and come back
     as the exact fp32 mean, their residual 0. One step is two fp32 allreduces (DOPT_MEAN): the
     first carries every P and the fp32 segments, the second every Q; a rank sends r·(rows +
     cols) floats per compressed matrix, whatever the number of ranks (dopt_compress_bound).
     The products go through OpenBLAS's sgemm when the implementation is built with
     DOPT_USE_BLAS, through plain C loops otherwise; the orthonormalisation is modified
     Gram–Schmidt in double, in plain C, columns in the order 0, 1, ..., r−1. A column that falls
     to 1e-10 of its norm (zero, or in the span of those before it: a zero gradient, a matrix of
     rank below r) is replaced by a random one drawn from the seed, the step and the segment,
     then orthonormalised: zeros would stay zero through the warm start for good. Every rank
     computes the output from the same averaged bytes with the same code, so the ranks of one
     build on one kind of CPU end with bitwise the same gradient. Ranks on different CPU types
     may not: OpenBLAS picks its sgemm kernel by CPU, and two kernels may round differently.
     The first Q is uniform in (−1, 1), the same on every rank. The state (saved with
     dopt_compress_state_save) holds the step, the residual and every Q; encode and decode are
     DOPT_ERR_UNSUPPORTED (there is no message), and error feedback cannot be turned off.

   NONBLOCKING AND BUCKETS
     A host whose backward makes the gradient final a segment at a time (the last layer's
     first) can average it in buckets of segments as they become final, with
     dopt_compress_allreduce_segments, or started with dopt_compress_allreduce_start so that
     the average runs while backward goes on. localsgd.h's driver does it for the host
     (dopt_dp_grad_ready).

     The step. The compressor's step (cz->step, the key of the random rounding) advances once
     every segment has been averaged once: by one whole call, or by segment calls in any
     bucketing and order. A segment given again before the others were given is refused
     (DOPT_ERR_INVALID, dopt_compress_detail names it and the first segment not yet given),
     nothing started: the mistake is this rank's alone, and its peers still expect its calls.
     The step's residuals (error feedback) and PowerSGD's Q's are kept when the call that ends
     its last segment ends; a segment's residual has the place the whole call gives it, so
     buckets cut differently from one step to the next keep their residuals, and the state file
     is unchanged (saved between two parts of a step, it holds the state before the step). When
     a call of a step fails — DOPT_ERR_NONFINITE (on every rank together, as for the whole
     call), or a collective's error — the step still closes once every segment was given, but
     without advancing and keeping nothing of it, as a whole call that fails keeps nothing: the
     segment calls and the whole call stay in step. So after a failed bucket, give the step's
     other segments still (the peers' calls need this rank's), then skip the step.

     The bits. A segment's result and residual are the whole call's bit for bit: its random
     stream is keyed by its index in the table, not its place in the call (RANDOMNESS: one
     stream per step and segment), its scale (shared by MAX, exact) and clip bound are its own,
     and the sums are exact integers (ternary with shared scales, majority vote, on either
     path) or taken per element in rank order (the allgather path of every codec, ternary's
     fp32 segments). Two exceptions at 3 ranks or more, where a sum of floats follows the cut
     of the message, which a bucket shortens: fp16 and bf16 on the ring (an element's running
     mean is folded starting from the rank whose chunk holds it, and the chunks are cut from
     the bucket's length), and PowerSGD (its factors and uncompressed segments are averaged by
     dopt_allreduce, whose fp32 sum may take its order from the message's length: the engine's
     ring above its latency path, MPI's own reduction); the results there stay the same on
     every rank, and PowerSGD's factors rounded otherwise change its output and residual beyond
     the last bit. At 2 ranks every codec gives the whole call's bits (two addends make one
     float in either order). The started call gives the blocking segment call's bits (the same
     call), for every codec.

     Nonblocking. dopt_compress_allreduce_start returns at once; the call runs on a thread the
     compressor starts at its first start, an ordered worker (distopt.h): calls run one at a
     time, in start order, each as the blocking call would. A request is a plain value, with
     distopt.h's REQUESTS semantics: several may be in flight (32; one more start waits for the
     oldest), they complete in start order (waiting on a later one completes the earlier ones),
     the results are the blocking call's bit for bit, and waiting again returns the same
     status until 32 later calls have started; after that test and wait return
     DOPT_ERR_INVALID (the status is gone, never read as a success): wait for each request
     before starting 32 more. The descriptor grads and segs are copied; the floats and the descriptor's arrays
     (its segment table or spans) belong to the call until it completes. Once the compressor
     has its worker, its blocking calls run on it too, behind the calls in flight;
     dopt_compress_encode, dopt_compress_state_save and _load, and dopt_compressor_free wait
     for the calls in flight first. Read cz's fields (step, path, residual) once its requests
     are complete.
     Rules: while a compressed request is in flight, start no other collective on comm or on its
     groups (the worker's collectives take their sequence numbers when it runs them, and one
     thread at a time may use a communicator); call the compressor's functions from one thread;
     comm's log callback may be called from the worker's thread. Without threads
     (DOPT_NO_THREADS), or on a communicator only its creating thread may call (comm->one_thread:
     MPI initialised below MPI_THREAD_SERIALIZED), start runs the call itself: the request is
     complete when start returns, and start returns its status.

   ERRORS (what to do)
     DOPT_ERR_NONFINITE   skip the step and go on: every rank of dopt_compress_allreduce got it
                          together, and nothing changed (NON-FINITE GRADIENTS).
     DOPT_ERR_INVALID     a layout, buffer or configuration that does not fit, or a segment given
                          twice in one step: fix the call (dopt_compress_detail says why for
                          the segment and nonblocking calls).
     DOPT_ERR_PROTOCOL    decode or state_load: bytes that are not this compressor's; from the
                          allreduce, or DOPT_ERR_MISMATCH: the ranks do not share one layout and
                          configuration (or one distopt release).
     DOPT_ERR_NOMEM       an allocation failed (init, the allreduce's first call).
     DOPT_ERR_UNSUPPORTED encode or decode of PowerSGD, which has no message: use the allreduce.
     Others come from the collectives (distopt.h's ERRORS): the communicator is poisoned; end the
     rank with dopt_comm_finish(comm, status).

   THREADING
     A compressor is used by one thread at a time; different compressors are independent. Its
     started calls run on its own worker thread (NONBLOCKING AND BUCKETS).
     Hosts are little-endian (x86-64, AArch64, RISC-V); a big-endian build stops with #error.
*/
#ifndef DISTOPT_COMPRESS_H
#define DISTOPT_COMPRESS_H

#include "distopt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dopt_codec {
    DOPT_CODEC_TERNARY = 0,
    DOPT_CODEC_QSGD = 1,
    DOPT_CODEC_TOPK = 2,
    DOPT_CODEC_SIGN = 3,
    DOPT_CODEC_FP16 = 4,
    DOPT_CODEC_BF16 = 5,
    DOPT_CODEC_FP32 = 6,
    DOPT_CODEC_MAJORITY = 7,
    DOPT_CODEC_POWERSGD = 8
} dopt_codec;

typedef enum dopt_ef_mode { DOPT_EF_AUTO = 0, DOPT_EF_ON = 1, DOPT_EF_OFF = 2 } dopt_ef_mode;

/* How dopt_compress_allreduce combines the ranks' messages (dopt_compressor_config.aggregate). */
typedef enum dopt_aggregate { DOPT_AGG_AUTO = 0, DOPT_AGG_ALLGATHER = 1, DOPT_AGG_RING = 2 } dopt_aggregate;

/* The way the last allreduce went (dopt_compressor.path). */
typedef enum dopt_agg_path {
    DOPT_PATH_NONE = 0,          /* no allreduce yet, or the last one failed before exchanging */
    DOPT_PATH_ALLGATHER = 1,     /* every rank's message to every rank */
    DOPT_PATH_RING = 2,          /* ternary sums along one ring */
    DOPT_PATH_RING_TWO_LEVEL = 3 /* ternary sums within hosts, then across them */
} dopt_agg_path;

#define DOPT_CLIP_OFF (-1.0f)
#define DOPT_COMPRESS_MAGIC 0x43504F44u /* "DOPC" */
#define DOPT_COMPRESS_VERSION 2
#define DOPT_COMPRESS_HEADER_BYTES 32
#define DOPT_COMPRESS_RECORD_BYTES 16

typedef struct dopt_compressor_config {
    dopt_codec codec;
    uint64_t seed;
    int rank;
    float clip_c;
    int no_scale_sharing;
    size_t fp32_below;
    unsigned qsgd_levels;
    size_t qsgd_bucket;
    double topk_ratio;
    dopt_ef_mode error_feedback;
    dopt_aggregate aggregate;
    int majority_l1;
    unsigned powersgd_rank;
    size_t powersgd_min;
    int ring_buckets;
} dopt_compressor_config;

/* The segments one allreduce works on (internal): the whole table, or a segment call's list. */
typedef struct dopt__compress_view {
    const size_t *index;        /* each one's index in the table, in the call's order */
    size_t nsegs;               /* how many */
    size_t count;               /* their elements */
    size_t msg_bytes;           /* a message of them */
} dopt__compress_view;

struct dopt__compress_job;

typedef struct dopt_compressor {
    dopt_compressor_config cfg; /* with the defaults filled in */
    dopt_segment *segs;         /* the layout, copied */
    size_t nsegs;
    size_t count;               /* elements in all segments */
    size_t flat_end;            /* a flat buffer must hold this many elements */
    size_t msg_bytes;           /* every message's size */
    int ef;                     /* error feedback on */
    uint64_t step;              /* encodes (PowerSGD: steps) so far: the RNG counter */
    float *residual;            /* EF: count floats */
    float *work;                /* EF: p = g + e, count floats */
    float *scales;              /* ternary: nsegs local/shared scales + a non-finite flag */
    float *bounds;              /* ternary: nsegs clip bounds */
    float *select;              /* top-k: |p| of the largest segment */
    unsigned char *msg;         /* this rank's message */
    unsigned char *gather;      /* the allreduce's N messages */
    size_t gather_ranks;        /* messages the gather buffer holds */
    int gathered;               /* messages in it from the last allreduce */
    int rank;                   /* the rank in the RNG key: cfg.rank, then each allreduce's comm->rank */
    dopt_agg_path path;         /* how the last allreduce combined the messages */
    int buckets;                /* ... on the ring: the buckets it pipelined (0: not the ring) */
    unsigned char *ring_buf;    /* the integer ring's planes: own, final, the host's, stage */
    unsigned char *ring_fin;    /* ... where the final sums are in it */
    int *ring_ranks;            /* ... the members of its rings */
    size_t ring_bytes, ring_nranks;
    float *psgd_q;              /* PowerSGD: every compressed matrix's Q (cols × r), in order */
    double *psgd_gs;            /* PowerSGD: Gram–Schmidt's columns, rows × r of the tallest */
    size_t psgd_np;             /* PowerSGD: floats of the first allreduce (P's, the rest, a flag) */
    size_t psgd_nq;             /* PowerSGD: floats of all Q's (the second allreduce adds a flag) */
    size_t psgd_nmat;           /* PowerSGD: matrices it compresses */
    float *psgd_qnext;          /* PowerSGD: the step's new Q's, kept until the step closes */
    /* A step in parts (NONBLOCKING AND BUCKETS): */
    dopt__compress_view view;   /* the segments the running allreduce works on */
    size_t *all;                /* 0 .. nsegs - 1: the whole table's view */
    size_t *part;               /* a segment call's indices, copied for its run */
    size_t *offs;               /* segment i's first element in residual and work; PowerSGD: then
                                   nsegs more, its Q's first float in psgd_q */
    unsigned char *given;       /* segments the calls started so far gave in this step */
    size_t ngiven;
    size_t nfinished;           /* segments whose calls have ended in this step */
    int step_failed;            /* one of them failed: the step closes without advancing */
    char detail[DOPT_DETAIL_MAX]; /* why the last call was refused (DOPT_ERR_INVALID), else "" */
    dopt__worker *worker;       /* the nonblocking calls' ordered worker, from the first start */
    struct dopt__compress_job *jobs; /* its jobs, one slot per job in flight */
    size_t *job_segs;           /* ... and their indices, nsegs per slot */
    int njobs;                  /* slots */
    uint64_t started;           /* jobs posted */
} dopt_compressor;

/* A nonblocking compressed allreduce (dopt_compress_allreduce_start): a plain value the caller
   keeps; nothing to free. */
typedef struct dopt_compress_request {
    dopt_compressor *cz;
    uint64_t ticket;            /* the worker's job number; 0: complete */
    dopt_status status;         /* ticket 0: how it completed */
} dopt_compress_request;

DOPT_DEF dopt_status dopt_compressor_init(dopt_compressor *cz, const dopt_compressor_config *cfg,
                                          const dopt_segment *segs, size_t nsegs);
DOPT_DEF void dopt_compressor_free(dopt_compressor *cz);
DOPT_DEF size_t dopt_compress_bound(const dopt_compressor *cz);
DOPT_DEF dopt_status dopt_compress_encode(dopt_compressor *cz, const dopt_buf *grads, void *out, size_t capacity,
                                          size_t *bytes);
DOPT_DEF dopt_status dopt_compress_decode(const dopt_compressor *cz, const void *msg, size_t bytes, float weight,
                                          const dopt_buf *accum);
DOPT_DEF dopt_status dopt_compress_allreduce(dopt_compressor *cz, dopt_comm *comm, float *grads, size_t n);
DOPT_DEF dopt_status dopt_compress_allreduce_buf(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads);
DOPT_DEF dopt_status dopt_compress_allreduce_segments(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads,
                                                      const size_t *segs, size_t k);
DOPT_DEF dopt_status dopt_compress_allreduce_start(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads,
                                                   const size_t *segs, size_t k, dopt_compress_request *req);
DOPT_DEF dopt_status dopt_compress_test(dopt_compress_request *req, int *done);
DOPT_DEF dopt_status dopt_compress_wait(dopt_compress_request *req);
DOPT_DEF const char *dopt_compress_detail(const dopt_compressor *cz);
DOPT_DEF const void *dopt_compress_message(const dopt_compressor *cz, int rank, size_t *bytes);
DOPT_DEF size_t dopt_compress_state_bytes(const dopt_compressor *cz);
DOPT_DEF dopt_status dopt_compress_state_save(const dopt_compressor *cz, void *out, size_t capacity);
DOPT_DEF dopt_status dopt_compress_state_load(dopt_compressor *cz, const void *in, size_t bytes);
DOPT_DEF const char *dopt_codec_name(dopt_codec codec);

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_COMPRESS_H */

/* ==================== REFERENCE FOR CONTRIBUTORS ====================
   Not needed to use compress.h: how the compressed allreduce exchanges and sums the messages, how
   a non-finite gradient reaches every rank, which random words round each element, and the
   layouts of the messages and of the saved state.

   THE COMPRESSED ALLREDUCE
     dopt_compress_allreduce's steps: (ternary, scale sharing) the per-segment scales and a
     non-finite flag go through one allreduce MAX of nsegs + 1 floats; every rank encodes its
     message (dopt_compress_bound bytes, equal on every rank). On the ring path (THE INTEGER
     RING below) the codes go round and the fp32 segments (below fp32_below) go through one
     allgather of their values. Otherwise one allgather of the messages, and every rank
     validates the N messages and decodes them with weight w = 1/N (a float). Ternary, N <= 127:
     a segment whose N scales are equal (scale sharing) is summed as integers — its result is
     (float)(Σ_r t_r) · (w·s), one rounding, in one write pass; other ternary segments (fp32,
     or scales not shared), other codecs and N > 127 accumulate the N messages in rank order
     into the zeroed segments, y += (w·s_r)·t_r.
     PowerSGD exchanges no messages: its first allreduce (DOPT_MEAN of f32, in the message
     buffer) carries, in segment order, each compressed matrix's P (rows × r, row-major) and
     each other segment's M = g + e, then a flag; the second each compressed matrix's Q (cols ×
     r) and a flag. Between them every rank orthonormalises the mean P it received and forms
     its own Q = Mᵀ·P; after the second it writes M̂ = P·Qᵀ (or the mean), the residual, and
     keeps Q. Its products are float sums in an order that one build on one CPU type fixes
     (sgemm's blocking; the plain loops' j = 0, 1, ...); the output is not fused with the
     residual (E = M − M̂ subtracts the stored output), so E is exact with multiply-adds fused
     too (-ffp-contract=fast; -ffast-math may rewrite any of it).

   SEGMENT CALLS AND STARTED CALLS
     A segment call runs the same code over a view of the table (dopt__compress_view: the
     listed segments' indices, in the call's order; the whole call's view is 0 .. nsegs - 1).
     Its message holds those segments' records in that order (the header's segment count,
     elements and size are the call's), its scale sharing reduces k + 1 floats, PowerSGD's two
     allreduces carry the listed matrices' P's and Q's and the listed other segments; random
     streams, residual places (cz->offs) and Q's stay those of the whole table. A call writes
     its segments' new residual into the work buffer (p there becomes p − C(p)) and PowerSGD's
     new Q's into psgd_qnext; the step's last call copies them into the state (THE STEP IN
     PARTS in the implementation), which costs the whole call no more than before (it copied
     the work buffer too). The buffers sized at init and at the first call for the whole table
     serve every view; the ring's grows to the largest call's plan once. A started call is a
     job of the ordered worker (distopt.h's THE ORDERED WORKER) with its arguments in one of 32
     slots (its indices copied into nsegs size_t's of the slot); the 33rd start waits for the
     job that held its slot. A request keeps its status until 32 later calls have started;
     then the worker says DOPT_ERR_INVALID for it.

   THE INTEGER RING
     Ternary segments (those not sent as fp32) are cut into groups of 64 elements, each
     segment padded with zeros to whole groups. A group of sums S biased by K (v = S + K in
     [0, 2K], K the number of codes summed) is kept and sent as w = ceil(log2(2K + 1))
     little-endian 64-bit words, word j holding bit j of the 64 values (bit t for element t):
     8·w bytes per group; this rank's own codes are such planes with K = 1, w = 2. A ring pass
     over a range of groups among n members cuts it into n chunks (near-equal runs of groups)
     and each chunk into pieces of at most 4096 groups (at least 2 per chunk); each step of each
     piece is one dopt_exchange (send right, receive left), two in flight. A reduce-scatter
     sends at step s the chunk pos - s with the sums of s + 1 members, and folds the chunk
     pos - s - 1 it receives into its own contribution ((v_a - K_a) + (v_b - K_b) + K_out, in
     registers, refusing a received value beyond 2·K_a as DOPT_ERR_PROTOCOL), so that after n - 1
     steps chunk pos + 1 holds every member's sum. An allgather sends the final planes on as
     received. Flat: one reduce-scatter and one allgather among all ranks (in rank order).
     Two levels (hosts of L ranks, H hosts): a reduce-scatter within the host leaves place j
     with the host's sums (K = L) of chunk j + 1; a reduce-scatter across hosts among the ranks
     at place j, starting from those (K grows by L a step), then an allgather across hosts and
     one within the host of the final sums (K = N). Majority vote: a rank's signs are planes
     with K = 1 too (v = 0 or 2), and the ranks' scales and non-finite flags go through one
     allgather before the ring. fp16/bf16:
     groups of 64 16-bit values (w = 16, K counting the means' contributions); a fold is
     (a·K_a + b·K_b)/(K_a + K_b) in fp32 — exact products, so a fused multiply-add changes
     nothing — rounded to nearest even, and a received value that is not finite is refused;
     a reduced flag tells every rank of a non-finite gradient first.
     Each rank then writes y = (float)(S) · (w·s) per element (w = 1/N as a float, s the
     shared scale): the allgather path's formula, so both paths give the same bits.
     Every ring of a level cuts its chunks into as many pieces, from the level's largest chunk:
     exchanges are numbered on the whole communicator, so places whose chunks straddle a piece
     boundary would otherwise drift apart.
     The pipeline: the groups are cut into B buckets (near-equal runs: ring_buckets, or one per
     16384 groups, up to 16), each going through the passes above on its own (tags carry the
     bucket's size and its number mod 16), in steps: at step t bucket t is summed within the
     host, t - 1 and t - 2 cross between hosts (reduce-scatter and allgather), t - 3 goes back
     within the host (flat: t reduced, t - 1 gathered). A step's passes run at once, each with
     two exchanges in flight, started round-robin in an order fixed by their shapes (never by
     which completes first), so every rank starts the same exchanges in the same order; the
     links across hosts stay busy while the hosts' own rings ride along. Two regions hold the
     host's sums (bucket t's formed while t - 1's cross) and each level of reduce-scatter has
     its stage. Ternary's codes are encoded per bucket, once the scales are shared: the caller's
     thread encodes bucket t (codes into the message and the own planes) once step t - 1 has
     begun — one bucket ahead, no more: further ahead, the encoders starved the ring on a busy
     machine — and decodes into grads each bucket the schedule has finished, while a thread of
     the call runs the schedule (it alone uses the communicator until it is joined). Without
     threads (DOPT_NO_THREADS, or one that cannot start), or for the other codecs (one bucket,
     their messages encoded first), one thread runs the steps, encoding bucket t before step t
     and decoding at the end: the same exchanges, the same bytes. A call that fails on the ring
     may have written some buckets' results into grads; the step and the residual are then
     unchanged, as on every failure.
     Why the pipeline starts a thread of its own, apart from the engine's progress thread
     (dopt_comm_set_progress_thread): the ring is not only bytes in flight. Each step of a
     reduce-scatter folds what it received into the planes that the next exchange sends on
     (dopt__ring_job_fold, before dopt__ring_job_start), so the schedule is computation
     interleaved with exchanges, and only a thread that runs compress.h's code can do it. The
     progress thread moves the bytes of requests already started and runs no module's code; it
     is off unless the caller starts it. With it and no thread of our own, the caller's thread would still encode, fold and
     decode in turn. So the call starts one thread for the schedule (a pthread_create and a join
     per call, against a call of tens of milliseconds at the sizes that pipeline) and keeps the
     encoder and decoder on the caller's. The same pipeline on one thread (DOPT_NO_THREADS)
     against the threaded one: docs/measurements.md, "The ring's pipeline thread".
     The choice (DOPT_AGG_AUTO) compares predicted times: the allgather's N - 1 steps of one
     message each plus N codes summed per element, against the ring's exchanges, the bytes its
     widths give, and the folds, at 30 µs per exchange, 1.25 GB/s (10 Gbit/s) and per-element
     costs measured on one core of an AVX-512 machine (0.03 ns per code summed, 0.25 ns per
     element folded or written). The kernels run 64 elements as two vectors of 32 16-bit lanes
     (AVX-512 BW: a word per plane from a mask, a mask per plane to a word); the portable loops
     give the same bits (tests/test_ring.c compares them).

   NON-FINITE GRADIENTS: HOW EVERY RANK LEARNS IT
     How every rank learns it, at no extra round trip: with scale sharing (ternary's default)
     the flag rides in the allreduce MAX of the scales, and the call returns before the message
     exchange; otherwise the rank sends a flagged message (the header with the non-finite flag,
     zeros after it) in the allgather it makes anyway, and every rank finds the flag before it
     reads any body. PowerSGD: a rank that cannot go on zeroes its part of an allreduce and sets
     its flag to 1; the mean of the flags is then above 0 on every rank, which stops before
     writing anything (after the first allreduce: M or P; after the second: Q).

   RANDOMNESS
     Ternary and QSGD round with distopt's Philox generator, the stream (seed, rank,
     step · 2^32 + segment) (dopt_rng_init with stream = step << 32 | segment). QSGD: word e
     decides element e of the segment. Ternary: element e is kept with probability A/2^24,
     A = ceil(|clip(g_e)| · (2^24/s)) (the product in float), by comparing a 24-bit uniform
     u = h·2^16 + l with A. h, 8 bits, is byte e of the stream (byte e mod 4, bits 8·(e mod 4)
     and up, of word e div 4) — four elements per word; l, 16 bits, is the low half of word
     2^63 + e, drawn only when h = A div 2^16 (probability 2^-8), since otherwise h alone
     decides.
     PowerSGD keys Philox by (seed, rank 0) on every rank and maps a word w to the uniform
     (w >> 8)·2^-23 − 1 in [−1, 1). The first Q of segment s: stream 2^63 + s, word k for
     element k of Q (cols × r, row-major). A column j that Gram–Schmidt cannot keep, at step t:
     stream t·2^32 + s, words (a·r + j)·rows + i for its element i at attempt a = 0..3 (the next
     attempt when the draw too lies in the span of the columns before; zeros after four).

   WIRE FORMAT (little-endian; every message of a compressor has the same size)

     message header, 32 bytes
       0  u32  magic 0x43504F44 (the bytes "DOPC")
       4  u8   version, 2 (version 1 had no flags: byte 6 was reserved)
       5  u8   codec (dopt_codec)
       6  u8   flags: bit 0 = the sender's gradient was not finite (its message carries nothing:
               every byte after the header is 0); the other bits 0
       7  u8   reserved, 0
       8  u32  number of segments
      12  u32  rank of the sender (the allreduce checks that message r says r)
      16  u64  elements in all segments
      24  u64  bytes in the whole message, this header included
     then for each segment, in order: a 16-byte record header
       0  u64  elements in the segment
       8  u32  a (by codec, below)
      12  u32  b (by codec, below)
     and the body, padded with zero bytes to a multiple of 8.

     codec    a                    b                  body
     TERNARY  0: ternary, 1: fp32  scale s (f32 bits)  ternary: 2-bit codes 00 = 0, 01 = +1,
                                   0 for fp32           10 = -1 (11 is invalid), value s·t;
                                                        fp32: count f32 (segments below
                                                        fp32_below)
     QSGD     bucket size          s (levels)          one f32 norm per bucket, then codes:
                                                        s <= 7: 4 bits, sign bit 3, level in
                                                        bits 0-2; else one signed byte; value
                                                        norm · level / s
     TOPK     k                    0                   k u32 indices (strictly increasing),
                                                        then k f32 values
     SIGN     0                    scale (f32 bits)     1 bit per element, 1 = negative; value
                                                        ±scale
     FP16     0                    0                   count IEEE binary16
     BF16     0                    0                   count bfloat16 (upper half of a f32)
     FP32     0                    0                   count f32

     Every value a message carries is finite: scales and norms are finite and not negative, and
     no f32, fp16 or bf16 value has an exponent of all ones.

     Bit packing (1, 2 and 4 bits): a segment's codes go in blocks of 64 elements (the last may
     be shorter). A block of m elements of w bits takes q = ceil(m·w / 8) bytes; its element t
     is at byte t mod q, bits w·(t div q) and up. Bits no element uses are 0. (This
     interleaving lets a whole block be packed and unpacked with vertical vector operations.)

   STATE FORMAT
     dopt_compress_state_save writes the per-rank state as: magic "DOPS", version, codec, element
     count, step, residual (f32 each, when EF is on). The 32-byte header: u32 magic, u8 version
     1, u8 codec, u8 EF on, u8 0, u64 elements, u64 step, 8 zero bytes. PowerSGD appends, after
     the residual: u32 r, u32 compressed matrices, one 16-byte record per compressed matrix (u32
     segment index, u32 0, u64 rows), then every compressed matrix's Q (cols × r f32, row-major),
     in segment order. Load checks all of it against the compressor (and that every value is
     finite) before it changes anything.
*/

/* =====================================================================================
   IMPLEMENTATION — stop reading here if you only want the API.
   ===================================================================================== */

#if defined(DISTOPT_IMPLEMENTATION) && !defined(DOPT__COMPRESS_IMPLEMENTED)
#define DOPT__COMPRESS_IMPLEMENTED

#include <float.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#  error "compress.h: the wire format is little-endian and bodies are copied as is; big-endian hosts are not supported"
#endif

/* The AVX-512 kernels use F, BW, VL and DQ (every AVX-512 x86 since Skylake-SP has them). */
#if (defined(__clang__) || defined(__GNUC__)) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__) && !defined(DOPT_NO_VECTOR_EXT)
#  include <immintrin.h>
#  define DOPT__COMPRESS_AVX512 1
#endif
#if (defined(__clang__) || defined(__GNUC__)) && defined(__F16C__) && defined(__AVX__) && !defined(DOPT_NO_VECTOR_EXT)
#  include <immintrin.h>
#  define DOPT__F16C 1
#endif

/* GCC 12 in C++ mode flags the self-initialised placeholder inside _mm512_undefined_epi32 (and
   friends) wherever an AVX-512 intrinsic is inlined; the warning is about the compiler's own
   header, so it is silenced for this implementation only. */
#if defined(DOPT__COMPRESS_AVX512) && defined(__cplusplus) && defined(__GNUC__) && !defined(__clang__)
#  define DOPT__COMPRESS_PRAGMAS 1
#  pragma GCC diagnostic push
#  pragma GCC diagnostic ignored "-Wuninitialized"
#  pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT__BLOCK 64 /* elements per packing block and per RNG batch */

static uint32_t dopt__f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float dopt__bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static size_t dopt__pad8(size_t bytes) { return (bytes + 7) & ~(size_t)7; }

/* =====================================================================================
   PART 1 OF 3 — WHAT THE BITS ARE: the codecs (bit packing, non-finite checks by bits, half
   precision, the segment statistics, ternary, QSGD, top-k, sign and majority vote), the codec
   table, the message layout, encode and decode, error feedback, PowerSGD's factors, the state,
   init and free. Nothing here sends a byte but PowerSGD's step (two plain allreduces).
   ===================================================================================== */

/* ===================================================================== BIT PACKING (1, 2, 4 BITS) */

/* A block of m <= 64 codes of w bits takes q = ceil(m·w/8) bytes; code t sits at byte t % q, bit
   w·(t / q). For a full block that is 8/w codes per byte taken from rows q apart, so packing is
   a few vertical shifts and ors over q-byte rows, which vectorize with no shuffles. */
static size_t dopt__block_bytes(size_t m, unsigned w) { return (m * w + 7) / 8; }

static size_t dopt__packed_bytes(size_t count, unsigned w) {
    return count / DOPT__BLOCK * dopt__block_bytes(DOPT__BLOCK, w) + dopt__block_bytes(count % DOPT__BLOCK, w);
}

DOPT__MAYBE_UNUSED static void dopt__pack2_full(const uint8_t *DOPT_RESTRICT c, uint8_t *DOPT_RESTRICT out) {
    int j;
    for (j = 0; j < 16; j++) out[j] = (uint8_t)(c[j] | c[j + 16] << 2 | c[j + 32] << 4 | c[j + 48] << 6);
}

/* 1 bit: byte j of a full block holds elements j, j + 8, ..., j + 56 in bits 0..7. */
DOPT__MAYBE_UNUSED static void dopt__pack1_full(const uint8_t *DOPT_RESTRICT c, uint8_t *DOPT_RESTRICT out) {
    int j;
    for (j = 0; j < 8; j++)
        out[j] = (uint8_t)(c[j] | c[j + 8] << 1 | c[j + 16] << 2 | c[j + 24] << 3 | c[j + 32] << 4 | c[j + 40] << 5 |
                           c[j + 48] << 6 | c[j + 56] << 7);
}

/* 4 bits: byte j of a full block holds elements j and j + 32. */
DOPT__MAYBE_UNUSED static void dopt__pack4_full(const uint8_t *DOPT_RESTRICT c, uint8_t *DOPT_RESTRICT out) {
    int j;
    for (j = 0; j < 32; j++) out[j] = (uint8_t)(c[j] | c[j + 32] << 4);
}

/* The 8x8 bit matrix in a word (byte k, bit j) transposed (to byte j, bit k): a 64-bit mask
   with bit t for element t becomes a full 1-bit block, and back (Hacker's Delight 7-3). */
DOPT__MAYBE_UNUSED static uint64_t dopt__transpose8x8(uint64_t x) {
    uint64_t t;
    t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull;
    x = x ^ t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull;
    x = x ^ t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull;
    return x ^ t ^ (t << 28);
}

/* Any width and any m <= 64: the tails, and the widths without a fast path. */
static void dopt__pack_block(const uint8_t *c, size_t m, unsigned w, uint8_t *out) {
    size_t q = dopt__block_bytes(m, w), t;
    memset(out, 0, q);
    for (t = 0; t < m; t++) out[t % q] |= (uint8_t)(c[t] << (w * (t / q)));
}

/* Returns non-zero when a bit no code uses is set (a malformed block). */
static unsigned dopt__unpack_block(const uint8_t *in, size_t m, unsigned w, uint8_t *c) {
    size_t q = dopt__block_bytes(m, w), t;
    unsigned mask = (1u << w) - 1u;
    uint8_t used[DOPT__BLOCK / 2];
    unsigned bad = 0;
    memset(used, 0, q);
    for (t = 0; t < m; t++) {
        c[t] = (uint8_t)((in[t % q] >> (w * (t / q))) & mask);
        used[t % q] |= (uint8_t)(mask << (w * (t / q)));
    }
    for (t = 0; t < q; t++) bad |= (unsigned)(in[t] & (uint8_t)~used[t]);
    return bad;
}

/* ===================================================================== NAN AND INFINITY BY THEIR BITS

   Every check below is an integer test of bits loaded from memory. A host built with
   -ffast-math or -Ofast lets the compiler assume that no float is NaN or infinite: it may fold
   isnan(), x != x and comparisons with infinity to constants, and may as well assume so of any
   float it computed, but it knows nothing of bits it loads. Encoders take the maximum of |x| as
   bits in a pass they make anyway; decoders take it over the values a message carries. */

#define DOPT__F32_ABS 0x7FFFFFFFu
#define DOPT__F32_MAX_BITS 0x7F7FFFFFu /* FLT_MAX: every finite |x| is at most this */
#define DOPT__F32_INF 0x7F800000u      /* |x| from here up: ±inf, then NaN */
#define DOPT__HALF_ABS 0x7FFFu         /* fp16 and bf16: the sign is bit 15 */
#define DOPT__F16_INF 0x7C00u          /* the same in fp16 */
#define DOPT__BF16_INF 0x7F80u         /* and in bf16 */

/* The loops below take the maximum of |value| as bits (an and and an unsigned max per vector,
   cheaper than collecting compares), in lanes with a fixed trip count, then a tail: that form
   vectorizes at -O2 (a loop over n elements does not). */
#define DOPT__CHECK_LANES 32

/* max |x_i| as bits over count f32 values at p (an array of floats, or a message at any
   alignment): above DOPT__F32_MAX_BITS when some x_i is NaN or ±inf. */
static uint32_t dopt__absbits_max(const void *DOPT_RESTRICT p, size_t count) {
    const unsigned char *b = (const unsigned char *)p;
    uint32_t m[DOPT__CHECK_LANES] = {0}, r = 0, u;
    size_t i, full = count - count % DOPT__CHECK_LANES;
    int j;
    for (i = 0; i < full; i += DOPT__CHECK_LANES)
        for (j = 0; j < DOPT__CHECK_LANES; j++) {
            memcpy(&u, b + 4 * (i + j), 4);
            u &= DOPT__F32_ABS;
            m[j] = u > m[j] ? u : m[j];
        }
    for (; i < count; i++) {
        memcpy(&u, b + 4 * i, 4);
        u &= DOPT__F32_ABS;
        r = u > r ? u : r;
    }
    for (j = 0; j < DOPT__CHECK_LANES; j++) r = m[j] > r ? m[j] : r;
    return r;
}

/* 1 when none of the count f32 values at p (any alignment) is NaN or ±inf. */
static int dopt__f32_bytes_finite(const unsigned char *p, size_t count) {
    return dopt__absbits_max(p, count) <= DOPT__F32_MAX_BITS;
}

/* The same for count 16-bit values (fp16: inf = DOPT__F16_INF, bf16: DOPT__BF16_INF). */
static int dopt__u16_bytes_finite(const unsigned char *DOPT_RESTRICT p, size_t count, uint16_t inf) {
    uint16_t m[DOPT__CHECK_LANES] = {0}, r = 0, h;
    size_t i, full = count - count % DOPT__CHECK_LANES;
    int j;
    for (i = 0; i < full; i += DOPT__CHECK_LANES)
        for (j = 0; j < DOPT__CHECK_LANES; j++) {
            memcpy(&h, p + 2 * (i + j), 2);
            h &= DOPT__HALF_ABS;
            m[j] = h > m[j] ? h : m[j];
        }
    for (; i < count; i++) {
        memcpy(&h, p + 2 * i, 2);
        h &= DOPT__HALF_ABS;
        r = h > r ? h : r;
    }
    for (j = 0; j < DOPT__CHECK_LANES; j++) r = m[j] > r ? m[j] : r;
    return r < inf;
}

/* A scale or a norm on the wire: finite and not negative (-0 included), by its bits. */
static int dopt__scale_ok(uint32_t bits) { return bits <= DOPT__F32_MAX_BITS || bits == 0x80000000u; }

/* ===================================================================== HALF PRECISION (FP16, BF16) */

/* float -> IEEE binary16, round to nearest even; NaN becomes a quiet NaN. Branch-free selects so
   the array loops vectorize. */
static uint16_t dopt__f32_to_f16(float f) {
    uint32_t x = dopt__f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    /* Below 2^-14 the result is subnormal: adding 0.5 puts the half's unit 2^-24 at the float's
       last mantissa bit, so the float adder rounds to nearest even for us. */
    uint32_t sub = dopt__f32_bits(dopt__bits_f32(ax) + 0.5f) - 0x3F000000u;
    /* Normal: rebias the exponent and round on the 13 dropped bits (ties to the even result);
       a carry out of the mantissa correctly bumps the exponent, up to infinity at 65520. */
    uint32_t norm = (ax + 0xC8000FFFu + ((ax >> 13) & 1u)) >> 13;
    uint32_t r = ax < 0x38800000u ? sub : norm;
    r = ax >= 0x47800000u ? 0x7C00u : r;               /* 65536 and above (and infinity) */
    r = ax > 0x7F800000u ? 0x7E00u : r;                /* NaN */
    return (uint16_t)(sign | r);
}

static float dopt__f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t normal = ((e + 112u) << 23) | (m << 13);
    uint32_t special = 0x7F800000u | (m << 13);
    float sub = (float)m * (1.0f / 16777216.0f); /* m·2^-24, exact */
    uint32_t r = e == 0 ? dopt__f32_bits(sub) : (e == 31 ? special : normal);
    return dopt__bits_f32(sign | r);
}

static uint16_t dopt__f32_to_bf16(float f) {
    uint32_t x = dopt__f32_bits(f);
    uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x40u;
    return (uint16_t)((x & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

static float dopt__bf16_to_f32(uint16_t h) { return dopt__bits_f32((uint32_t)h << 16); }

/* Messages may sit at any alignment (a caller's buffer), so 16-bit words go through memcpy. The
   encoders return 1 when every value they wrote is finite: a NaN or ±inf in x, or a value that
   rounds beyond the format's largest (fp16: |x| >= 65520), is not. */
DOPT__MAYBE_UNUSED static int dopt__f16_encode_portable(const float *DOPT_RESTRICT x, unsigned char *DOPT_RESTRICT out, size_t n) {
    uint32_t m = 0;
    size_t i;
    for (i = 0; i < n; i++) {
        uint16_t h = dopt__f32_to_f16(x[i]);
        memcpy(out + 2 * i, &h, 2);
        m = (h & DOPT__HALF_ABS) > m ? (h & DOPT__HALF_ABS) : m;
    }
    return m < DOPT__F16_INF;
}

DOPT__MAYBE_UNUSED static void dopt__f16_accum_portable(float *DOPT_RESTRICT y, float w, const unsigned char *DOPT_RESTRICT in, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        uint16_t h;
        float v;
        memcpy(&h, in + 2 * i, 2);
        v = w * dopt__f16_to_f32(h); /* its own statement, as the F16C path: no fused multiply-add */
        y[i] += v;
    }
}

/* F16C converts 8 at a time with the same rounding (NaN payloads may differ: both are NaN). */
static int dopt__f16_encode(const float *DOPT_RESTRICT x, unsigned char *DOPT_RESTRICT out, size_t n) {
#ifdef DOPT__F16C
    const __m128i abs_mask = _mm_set1_epi16((short)DOPT__HALF_ABS);
    __m128i m = _mm_setzero_si128();
    uint16_t lanes[8];
    size_t i, n8 = n - n % 8;
    int j, finite = 1;
    for (i = 0; i < n8; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(void *)(out + 2 * i), h);
        m = _mm_max_epu16(m, _mm_and_si128(h, abs_mask));
    }
    _mm_storeu_si128((__m128i *)(void *)lanes, m);
    for (j = 0; j < 8; j++) finite &= lanes[j] < DOPT__F16_INF;
    return dopt__f16_encode_portable(x + n8, out + 2 * n8, n - n8) && finite;
#else
    return dopt__f16_encode_portable(x, out, n);
#endif
}

static void dopt__f16_accum(float *DOPT_RESTRICT y, float w, const unsigned char *DOPT_RESTRICT in, size_t n) {
#ifdef DOPT__F16C
    size_t i, n8 = n - n % 8;
    __m256 wv = _mm256_set1_ps(w);
    for (i = 0; i < n8; i += 8) {
        __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i)));
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_mul_ps(wv, v)));
    }
    dopt__f16_accum_portable(y + n8, w, in + 2 * n8, n - n8);
#else
    dopt__f16_accum_portable(y, w, in, n);
#endif
}

/* bf16 goes through a 64-element local array so that the conversion loop has a fixed trip
   count and aligned stores (it vectorizes) and the message, at any alignment, gets one memcpy.
   Returns 1 when every value is finite (|x| < 0x7F7F8000 as bits, below which nothing rounds
   up to infinity). */
static int dopt__bf16_encode(const float *DOPT_RESTRICT x, unsigned char *DOPT_RESTRICT out, size_t n) {
    uint16_t h[DOPT__BLOCK], m[DOPT__BLOCK] = {0}, r = 0;
    size_t i, j, full = n - n % DOPT__BLOCK;
    for (i = 0; i < full; i += DOPT__BLOCK) {
        for (j = 0; j < DOPT__BLOCK; j++) {
            uint16_t a;
            h[j] = dopt__f32_to_bf16(x[i + j]);
            a = h[j] & DOPT__HALF_ABS;
            m[j] = a > m[j] ? a : m[j];
        }
        memcpy(out + 2 * i, h, sizeof h);
    }
    for (j = 0; j < n - full; j++) {
        h[j] = dopt__f32_to_bf16(x[full + j]);
        r = (h[j] & DOPT__HALF_ABS) > r ? (h[j] & DOPT__HALF_ABS) : r;
    }
    if (n > full) memcpy(out + 2 * full, h, 2 * (n - full));
    for (j = 0; j < DOPT__BLOCK; j++) r = m[j] > r ? m[j] : r;
    return r < DOPT__BF16_INF;
}

/* fp32 on the wire: the values as they are; returns 1 when all are finite. */
static int dopt__f32_encode(const float *DOPT_RESTRICT x, unsigned char *DOPT_RESTRICT out, size_t n) {
    uint32_t m[DOPT__CHECK_LANES] = {0}, r = 0, u;
    size_t i, full = n - n % DOPT__CHECK_LANES;
    int j;
    for (i = 0; i < full; i += DOPT__CHECK_LANES)
        for (j = 0; j < DOPT__CHECK_LANES; j++) {
            u = dopt__f32_bits(x[i + j]);
            memcpy(out + 4 * (i + j), &u, 4);
            u &= DOPT__F32_ABS;
            m[j] = u > m[j] ? u : m[j];
        }
    for (; i < n; i++) {
        u = dopt__f32_bits(x[i]);
        memcpy(out + 4 * i, &u, 4);
        u &= DOPT__F32_ABS;
        r = u > r ? u : r;
    }
    for (j = 0; j < DOPT__CHECK_LANES; j++) r = m[j] > r ? m[j] : r;
    return r < DOPT__F32_INF;
}

/* y[0..m) += w·v[0..m): a full block has a constant trip count, which vectorizes at -O2. */
static void dopt__accum_block(float *DOPT_RESTRICT y, float w, const float *DOPT_RESTRICT v, size_t m) {
    size_t j;
    if (m == DOPT__BLOCK)
        for (j = 0; j < DOPT__BLOCK; j++) y[j] += w * v[j];
    else
        for (j = 0; j < m; j++) y[j] += w * v[j];
}

static void dopt__bf16_accum(float *DOPT_RESTRICT y, float w, const unsigned char *DOPT_RESTRICT in, size_t n) {
    uint16_t h[DOPT__BLOCK];
    float v[DOPT__BLOCK];
    size_t i, j;
    for (i = 0; i < n; i += DOPT__BLOCK) {
        size_t m = n - i < DOPT__BLOCK ? n - i : DOPT__BLOCK;
        memcpy(h, in + 2 * i, 2 * m);
        if (m < DOPT__BLOCK) memset(h + m, 0, 2 * (DOPT__BLOCK - m)); /* converted, then unused */
        for (j = 0; j < DOPT__BLOCK; j++) v[j] = dopt__bf16_to_f32(h[j]);
        dopt__accum_block(y + i, w, v, m);
    }
}

/* y += w·v over f32 values in a message (any alignment): blocks of 64 through a local array. */
static void dopt__f32_accum(float *DOPT_RESTRICT y, float w, const unsigned char *DOPT_RESTRICT in, size_t n) {
    float v[DOPT__BLOCK];
    size_t i;
    for (i = 0; i < n; i += DOPT__BLOCK) {
        size_t m = n - i < DOPT__BLOCK ? n - i : DOPT__BLOCK;
        memcpy(v, in + 4 * i, 4 * m);
        dopt__accum_block(y + i, w, v, m);
    }
}

/* ===================================================================== RANDOM WORDS */

/* The generator of (seed, rank, step, segment): stream = step << 32 | segment. */
static void dopt__seg_rng(const dopt_compressor *cz, int rank, size_t seg, dopt_rng *rng) {
    dopt_rng_init(rng, cz->cfg.seed, rank, cz->step << 32 | (uint64_t)(uint32_t)seg);
}

/* ===================================================================== SEGMENT STATISTICS */

/* One pass: max |x|, and the sums of (x - x0) and (x - x0)² for σ. Float lanes are flushed into
   double lanes every 1024 elements and the 64 double lanes are added up once at the end: the
   vectorizer keeps everything in registers, no flush waits on a serial chain of double adds,
   the rounding error of a flush stays ~1e-6 relative, and σ only sets a clipping threshold.

   max |x| is taken over the bits, |x| as the unsigned integer x & 0x7FFFFFFF: for non-negative
   floats the integer order is the float order, +inf is 0x7F800000 and every NaN lies above it,
   so the maximum says at once whether the segment holds a NaN or an infinity. Integer compares
   of the loaded bits cost what the float max did, and no compiler option that assumes finite
   floats (-ffast-math, -Ofast) can remove them. */
typedef struct dopt__stats {
    double s1, s2;
    uint32_t maxbits; /* the bits of max |x|; above DOPT__F32_MAX_BITS for NaN or ±inf */
} dopt__stats;

#define DOPT__STAT_LANES 64
#define DOPT__STAT_FLUSH 16 /* blocks of 64 per flush */

/* Software prefetch 8 KiB ahead (as distopt.h's sums do): the hardware prefetcher alone does
   not keep enough misses in flight to stream at read bandwidth here. The address is computed
   as an integer: it may lie past the end of the array. */
#if defined(__GNUC__) || defined(__clang__)
#  define DOPT__PREFETCH(p, ahead) __builtin_prefetch((const void *)((uintptr_t)(const void *)(p) + (ahead)), 0, 3)
#else
#  define DOPT__PREFETCH(p, ahead) ((void)0)
#endif
#define DOPT__AHEAD 8192u

/* chunk blocks of 64 lanes into the float accumulators a1, a2 (zero on entry) and the |x| bits
   maxima m. */
DOPT__MAYBE_UNUSED static void dopt__stats_chunk_portable(const float *DOPT_RESTRICT x, size_t chunk, float shift,
                                                          float *DOPT_RESTRICT a1, float *DOPT_RESTRICT a2,
                                                          uint32_t *DOPT_RESTRICT m) {
    size_t k, i = 0;
    int j;
    for (k = 0; k < chunk; k++, i += DOPT__STAT_LANES) {
        for (j = 0; j < 4; j++) DOPT__PREFETCH(x + i + 16 * j, DOPT__AHEAD);
        for (j = 0; j < DOPT__STAT_LANES; j++) {
            float v = x[i + j], d = v - shift, dd;
            uint32_t a = dopt__f32_bits(v) & DOPT__F32_ABS;
            dd = d * d; /* its own statement: a compiler that contracts (clang) makes no fma */
            a1[j] += d;
            a2[j] += dd;
            m[j] = a > m[j] ? a : m[j];
        }
    }
}

#ifdef DOPT__COMPRESS_AVX512
/* The same 64 lanes in four registers each: the same additions in the same order, so the same
   bits as the loop above (the tests compare them); four registers keep four add chains in
   flight. */
static void dopt__stats_chunk_avx512(const float *x, size_t chunk, float shift, float *a1, float *a2, uint32_t *m) {
    const __m512 sh = _mm512_set1_ps(shift);
    const __m512i abs_mask = _mm512_set1_epi32((int)DOPT__F32_ABS);
    __m512 v1[4], v2[4];
    __m512i vm[4];
    size_t k, i = 0;
    int q;
    for (q = 0; q < 4; q++) {
        v1[q] = _mm512_loadu_ps(a1 + 16 * q);
        v2[q] = _mm512_loadu_ps(a2 + 16 * q);
        vm[q] = _mm512_loadu_si512((const void *)(m + 16 * q));
    }
    for (k = 0; k < chunk; k++, i += DOPT__STAT_LANES)
        for (q = 0; q < 4; q++) {
            __m512 v = _mm512_loadu_ps(x + i + 16 * q), d = _mm512_sub_ps(v, sh);
            DOPT__PREFETCH(x + i + 16 * q, DOPT__AHEAD);
            v1[q] = _mm512_add_ps(v1[q], d);
            v2[q] = _mm512_add_ps(v2[q], _mm512_mul_ps(d, d));
            vm[q] = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), vm[q]);
        }
    for (q = 0; q < 4; q++) {
        _mm512_storeu_ps(a1 + 16 * q, v1[q]);
        _mm512_storeu_ps(a2 + 16 * q, v2[q]);
        _mm512_storeu_si512((void *)(m + 16 * q), vm[q]);
    }
}
#endif

static void dopt__stats_run(const float *DOPT_RESTRICT x, size_t n, float shift, dopt__stats *st) {
    float a1[DOPT__STAT_LANES], a2[DOPT__STAT_LANES];
    uint32_t m[DOPT__STAT_LANES], mx = 0;
    double d1[DOPT__STAT_LANES], d2[DOPT__STAT_LANES];
    size_t i = 0, blocks = n / DOPT__STAT_LANES, b;
    int j;
    double s1 = 0.0, s2 = 0.0;
    for (j = 0; j < DOPT__STAT_LANES; j++) {
        m[j] = 0;
        d1[j] = d2[j] = 0.0;
    }
    for (b = 0; b < blocks;) {
        size_t chunk = blocks - b < DOPT__STAT_FLUSH ? blocks - b : DOPT__STAT_FLUSH;
        for (j = 0; j < DOPT__STAT_LANES; j++) a1[j] = a2[j] = 0.0f;
#ifdef DOPT__COMPRESS_AVX512
        dopt__stats_chunk_avx512(x + i, chunk, shift, a1, a2, m);
#else
        dopt__stats_chunk_portable(x + i, chunk, shift, a1, a2, m);
#endif
        i += chunk * DOPT__STAT_LANES;
        for (j = 0; j < DOPT__STAT_LANES; j++) { /* lane by lane: vectorizes, same bits either way */
            d1[j] += (double)a1[j];
            d2[j] += (double)a2[j];
        }
        b += chunk;
    }
    for (j = 0; j < DOPT__STAT_LANES; j++) {
        s1 += d1[j];
        s2 += d2[j];
        mx = m[j] > mx ? m[j] : mx;
    }
    for (; i < n; i++) {
        double d = (double)x[i] - (double)shift;
        uint32_t a = dopt__f32_bits(x[i]) & DOPT__F32_ABS;
        s1 += d;
        s2 += d * d;
        mx = a > mx ? a : mx;
    }
    st->s1 = s1;
    st->s2 = s2;
    st->maxbits = mx;
}

/* TernGrad step 1 and 2 for one segment: the clip bound c·σ (FLT_MAX when clipping is off or σ
   is 0) and the local scale max |clip(g)| = min(max |g|, bound). Returns 0 for non-finite data.
   (Finite values near FLT_MAX may overflow the float lanes of the sums to ±inf: var is then not
   a positive finite number and the segment goes unclipped.) */
static int dopt__tern_segment_scale(const float *x, size_t n, float c, float *bound, float *scale) {
    dopt__stats st;
    double var, b;
    float maxabs;
    *bound = FLT_MAX;
    *scale = 0.0f;
    if (n == 0) return 1;
    dopt__stats_run(x, n, x[0], &st);
    if (st.maxbits > DOPT__F32_MAX_BITS) return 0;
    maxabs = dopt__bits_f32(st.maxbits);
    var = st.s2 / (double)n - (st.s1 / (double)n) * (st.s1 / (double)n);
    b = (double)c * sqrt(dopt__is_finite(var) && var > 0.0 ? var : 0.0);
    if (c > 0.0f && b > 0.0 && b < (double)FLT_MAX) *bound = (float)b;
    *scale = maxabs < *bound ? maxabs : *bound;
    return 1;
}

/* ===================================================================== TERNARY (TERNGRAD) */

/* Codes of one block: t = sign(g)·Bernoulli(|clip(g)|/s), as 0, 1 (+1) or 2 (-1).

   The rule: a = |clip(g)|·k in float with k = 2^24/s, A = ceil(a) (0 .. 2^24 + 2), and the
   element is kept when a uniform 24-bit integer u is below A — probability A/2^24, the same
   as u < a. u is drawn lazily, high bits first: h = one byte of a Philox word (four elements
   per word), and only when h equals A's high part A >> 16 (probability 2^-8) are the 16 low
   bits l needed; they come from a second word, drawn for that element alone. keep =
   h < A >> 16, or h == A >> 16 and l < A & 0xFFFF: exactly u = h·2^16 + l < A, with a quarter
   of a word per element (the generator is the encoder's bottleneck: the 32-bit form took a
   word, the 16-bit form half of one).

   Layout of the words: element e of the segment uses byte e of the stream, that is byte
   e mod 4 (bits 8·(e mod 4) and up) of word e div 4; a block of 64 elements takes 16 words
   (a shorter tail block too, the bytes of elements >= m unused). The tie word of element e
   is word 2^63 + e of the segment's stream (its low 16 bits).

   dopt__tern_codes writes the codes of the elements that need no tie word, 0 for the others,
   and returns the tie mask (bit t: element t needs its tie word). Branch-free: random data
   defeats the branch predictor, and this form vectorizes. (|g| clipped to the bound is
   |clip(g)|; the sign of g is that of clip(g) whenever the element can be kept.) */
static float dopt__tern_ceil(float a) { return ceilf(a); }

static uint64_t dopt__tern_codes(const float *DOPT_RESTRICT x, const uint32_t *DOPT_RESTRICT r, size_t m,
                                 float bound, float k, uint8_t *DOPT_RESTRICT c) {
    uint64_t ties = 0;
    size_t t;
    for (t = 0; t < m; t++) {
        float a = fabsf(x[t]);
        uint32_t A, h, hi;
        a = a > bound ? bound : a;
        A = (uint32_t)dopt__tern_ceil(a * k);
        h = (r[t / 4] >> (8 * (t % 4))) & 0xFFu;
        hi = A >> 16;
        c[t] = (uint8_t)((h < hi) << (x[t] < 0.0f));
        ties |= (uint64_t)(h == hi && (A & 0xFFFFu) != 0) << t;
    }
    return ties;
}

/* Word `index` of the stream, as dopt_rng_u32 gives it, from one Philox block. */
static uint32_t dopt__rng_word(const dopt_rng *rng, uint64_t index) {
    uint32_t ctr[4], out[4];
    ctr[0] = (uint32_t)(index / 4);
    ctr[1] = (uint32_t)(index / 4 >> 32);
    ctr[2] = (uint32_t)rng->stream;
    ctr[3] = (uint32_t)(rng->stream >> 32);
    dopt_philox4x32(ctr, rng->key, out);
    return out[index % 4];
}

/* The tie words of a batch of elements: out[i] = word 2^63 + e[i] of the stream. */
DOPT__MAYBE_UNUSED static void dopt__tie_words_portable(const dopt_rng *rng, const uint64_t *e, int cnt, uint32_t *out) {
    int i;
    for (i = 0; i < cnt; i++) out[i] = dopt__rng_word(rng, ((uint64_t)1 << 63) + e[i]);
}

#ifdef DOPT__COMPRESS_AVX512
/* The same sixteen words at once: one Philox block per lane, each with its own counter, through
   distopt.h's vector rounds (dopt__philox16_rounds: DOPT__COMPRESS_AVX512 implies its AVX-512
   build), then the word e % 4 of each lane's block. A tie is rare (2^-8 per element) but at 2^24
   elements there are 65536 of them: one vector block per sixteen costs a tenth of sixteen scalar
   ones. */
static void dopt__tie_words_avx512(const dopt_rng *rng, const uint64_t *e, int cnt, uint32_t *out) {
    uint32_t lo[16], hi[16], sel[16];
    __m512i c[1][4], w, s;
    int i;
    for (i = 0; i < 16; i++) {
        uint64_t block = (((uint64_t)1 << 63) + (i < cnt ? e[i] : 0)) / 4;
        lo[i] = (uint32_t)block;
        hi[i] = (uint32_t)(block >> 32);
        sel[i] = (uint32_t)((i < cnt ? e[i] : 0) % 4);
    }
    c[0][0] = _mm512_loadu_si512((const void *)lo);
    c[0][1] = _mm512_loadu_si512((const void *)hi);
    c[0][2] = _mm512_set1_epi32((int)(uint32_t)rng->stream);
    c[0][3] = _mm512_set1_epi32((int)(uint32_t)(rng->stream >> 32));
    dopt__philox16_rounds(c, 1, rng->key[0], rng->key[1]);
    s = _mm512_loadu_si512((const void *)sel);
    w = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(1)), c[0][0], c[0][1]);
    w = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(2)), w, c[0][2]);
    w = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(3)), w, c[0][3]);
    _mm512_storeu_si512((void *)lo, w);
    memcpy(out, lo, (size_t)cnt * sizeof(uint32_t));
}
#endif

static void dopt__tie_words(const dopt_rng *rng, const uint64_t *e, int cnt, uint32_t *out) {
#ifdef DOPT__COMPRESS_AVX512
    dopt__tie_words_avx512(rng, e, cnt, out);
#else
    dopt__tie_words_portable(rng, e, cnt, out);
#endif
}

/* The elements of a segment waiting for their tie words, resolved sixteen at a time. The
   order of resolution does not matter: every element's tie word is fixed by its index. */
#define DOPT__TIE_BATCH 16

typedef struct dopt__tern_seg {
    const float *x;    /* the segment */
    size_t n;
    float bound, k;
    const dopt_rng *rng;
    uint8_t *out;      /* its packed codes */
    uint64_t tie[DOPT__TIE_BATCH];
    int nties;
} dopt__tern_seg;

/* Keeps the tied elements whose low 16 bits fall below A & 0xFFFF: sets their codes in the
   packed blocks (block of m elements, q = ceil(m/4) bytes, element t at byte t % q, bits
   2·(t / q)). */
static void dopt__tern_resolve(dopt__tern_seg *sg) {
    uint32_t w[DOPT__TIE_BATCH];
    int i;
    dopt__tie_words(sg->rng, sg->tie, sg->nties, w);
    for (i = 0; i < sg->nties; i++) {
        size_t e = (size_t)sg->tie[i], b = e / DOPT__BLOCK, t = e % DOPT__BLOCK;
        size_t m = sg->n - b * DOPT__BLOCK < DOPT__BLOCK ? sg->n - b * DOPT__BLOCK : DOPT__BLOCK, q = (m + 3) / 4;
        float a = fabsf(sg->x[e]);
        uint32_t A;
        a = a > sg->bound ? sg->bound : a;
        A = (uint32_t)dopt__tern_ceil(a * sg->k);
        if ((w[i] & 0xFFFFu) < (A & 0xFFFFu))
            sg->out[b * 16 + t % q] |= (uint8_t)((sg->x[e] < 0.0f ? 2u : 1u) << (2 * (t / q)));
    }
    sg->nties = 0;
}

/* Queues the ties of the block whose first element is e0 (bit t of ties: element e0 + t). */
static void dopt__tern_queue(dopt__tern_seg *sg, uint64_t ties, size_t e0) {
    while (ties) {
        unsigned t = 0;
#if defined(__GNUC__) || defined(__clang__)
        t = (unsigned)__builtin_ctzll(ties);
#else
        while (!((ties >> t) & 1u)) t++;
#endif
        ties &= ties - 1;
        sg->tie[sg->nties++] = (uint64_t)(e0 + t);
        if (sg->nties == DOPT__TIE_BATCH) dopt__tern_resolve(sg);
    }
}

#ifdef DOPT__COMPRESS_AVX512
/* The codes and the 2-bit pack of a full block with AVX-512, without leaving registers; returns
   the tie mask. Identical results to dopt__tern_codes + dopt__pack2_full (the tests compare
   them). Per 16 elements: their 16 bytes of random words widened to lanes; min(|x|, bound)
   in one vrangeps (minimum of magnitudes, sign cleared); ceil and the conversion in one
   instruction (embedded rounding toward +inf; A is an integer below 2^25, so exact). Element
   16q + j goes to byte j, bits 2q: the kept lanes add 1 << 2q, the kept negative ones add it
   once more (code 2). */
static uint64_t dopt__tern_block_avx512(const float *x, const uint32_t *r, float bound, float k, uint8_t *out) {
    const __m512 bv = _mm512_set1_ps(bound), kv = _mm512_set1_ps(k), zero = _mm512_setzero_ps();
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    const uint8_t *bytes = (const uint8_t *)r;
    __m128i packed = _mm_setzero_si128();
    __mmask16 tie[4];
    int q;
    for (q = 0; q < 4; q++) {
        const __m128i inc = _mm_set1_epi8((char)(1 << (2 * q)));
        __m512 xv = _mm512_loadu_ps(x + 16 * q);
        __m512 a = _mm512_mul_ps(_mm512_range_ps(xv, bv, 0x0A), kv);
        __m512i A = _mm512_cvt_roundps_epi32(a, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
        __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(bytes + 16 * q)));
        __m512i Ah = _mm512_srli_epi32(A, 16);
        __mmask16 keep = _mm512_cmp_epu32_mask(h, Ah, _MM_CMPINT_LT);
        __mmask16 neg = _mm512_mask_cmp_ps_mask(keep, xv, zero, _CMP_LT_OQ);
        tie[q] = _mm512_mask_cmp_epu32_mask(_mm512_test_epi32_mask(A, low16), h, Ah, _MM_CMPINT_EQ);
        packed = _mm_mask_add_epi8(packed, keep, packed, inc);
        packed = _mm_mask_add_epi8(packed, neg, packed, inc);
    }
    _mm_storeu_si128((__m128i *)(void *)out, packed);
    return (uint64_t)_mm512_kunpackd(_mm512_kunpackw(tie[3], tie[2]), _mm512_kunpackw(tie[1], tie[0]));
}

/* y += v·t over a full block; returns non-zero when a code is 11. v·t comes from a table
   indexed by the code (vpermps reads the low 4 bits of each index lane: the code and the
   next one's, so the table repeats every 4 entries): {v·0, v, v·(-1)}, the products the
   portable loop forms, so the same bits. The caller prefetches y. */
static unsigned dopt__tern_accum_avx512(float *y, float v, const uint8_t *in) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)in));
    const __m512 table = _mm512_setr_ps(v * 0.0f, v, v * -1.0f, 0.0f, v * 0.0f, v, v * -1.0f, 0.0f, v * 0.0f, v,
                                        v * -1.0f, 0.0f, v * 0.0f, v, v * -1.0f, 0.0f);
    __m512i bad = _mm512_and_si512(_mm512_and_si512(b, _mm512_srli_epi32(b, 1)), _mm512_set1_epi32(0x55));
    int q;
    for (q = 0; q < 4; q++) {
        __m512 vt = _mm512_permutexvar_ps(_mm512_srli_epi32(b, (unsigned)(2 * q)), table);
        _mm512_storeu_ps(y + 16 * q, _mm512_add_ps(_mm512_loadu_ps(y + 16 * q), vt));
    }
    return (unsigned)_mm512_test_epi32_mask(bad, bad);
}
#endif

/* 2^24 / s, or 0 for s = 0 (every code is then 0). */
/* 2^24/s, or 0 below DOPT__TINY_SCALE, where it would overflow a float: such a segment sends
   zeros (a bias below 1e-30 per element), the same on every rank and every build. */
#define DOPT__TINY_SCALE 1e-30f
static float dopt__tern_k(float s) { return s > DOPT__TINY_SCALE ? (float)(16777216.0 / (double)s) : 0.0f; }

#define DOPT__TERN_RUN 1024 /* elements whose words are generated together (256 words) */

/* The codes of elements [e0, e1) of a segment of n (e0 a multiple of 64; e1 one too, or n) into
   its packed body `out`, the bytes of those blocks alone. The runs go front to back, each block
   prefetching the elements 8 KiB further on, so that the generator's work overlaps the misses.
   (Order does not change the result: every element's words are fixed by its index. Back to
   front, to start where the statistics pass left the cache, measured slower: docs/measurements.md,
   Compression.) */
static void dopt__tern_encode_range(const float *x, size_t n, size_t e0, size_t e1, float bound, float s,
                                    const dopt_rng *rng, uint8_t *out) {
    uint32_t r[DOPT__TERN_RUN / 4];
    uint8_t c[DOPT__BLOCK];
    size_t i, j, full = n - n % DOPT__BLOCK, end = e1 < full ? e1 : full;
    dopt__tern_seg sg;
    sg.x = x;
    sg.n = n;
    sg.bound = bound;
    sg.k = dopt__tern_k(s);
    sg.rng = rng;
    sg.out = out;
    sg.nties = 0;
    if (e1 > full) { /* the short last block */
        uint64_t ties;
        memset(c, 0, sizeof c);
        dopt_rng_u32(rng, full / 4, r, 16);
        ties = dopt__tern_codes(x + full, r, n - full, bound, sg.k, c);
        dopt__pack_block(c, n - full, 2, out + full / 4);
        dopt__tern_queue(&sg, ties, full);
    }
    for (i = e0; i < end; i += DOPT__TERN_RUN) {
        size_t run = end - i < DOPT__TERN_RUN ? end - i : DOPT__TERN_RUN;
        dopt_rng_u32(rng, i / 4, r, run / 4);
        for (j = 0; j < run; j += DOPT__BLOCK) {
            const float *xb = x + i + j;
            uint64_t ties;
            int p;
            for (p = 0; p < 4; p++) DOPT__PREFETCH(xb + 16 * p, DOPT__AHEAD);
#ifdef DOPT__COMPRESS_AVX512
            ties = dopt__tern_block_avx512(xb, r + j / 4, bound, sg.k, out + (i + j) / 4);
#else
            ties = dopt__tern_codes(xb, r + j / 4, DOPT__BLOCK, bound, sg.k, c);
            dopt__pack2_full(c, out + (i + j) / 4);
#endif
            if (ties) dopt__tern_queue(&sg, ties, i + j);
        }
    }
    if (sg.nties) dopt__tern_resolve(&sg);
}

static void dopt__tern_encode_segment(const float *x, size_t n, float bound, float s, const dopt_rng *rng,
                                      uint8_t *out) {
    dopt__tern_encode_range(x, n, 0, n, bound, s, rng, out);
}

/* y += v·t over a block of codes, v = weight·s: the product is exact for t in {-1, 0, 1}, so the
   only rounding is the add's. Returns non-zero when a code is 11. */
DOPT__MAYBE_UNUSED static unsigned dopt__tern_accum_full(float *DOPT_RESTRICT y, float v, const uint8_t *DOPT_RESTRICT in) {
    unsigned bad = 0;
    int j, r;
    for (j = 0; j < 16; j++) bad |= (unsigned)(in[j] & (in[j] >> 1) & 0x55u);
    for (r = 0; r < 4; r++)
        for (j = 0; j < 16; j++) {
            unsigned code = (in[j] >> (2 * r)) & 3u;
            y[16 * r + j] += v * (float)((int)(code & 1u) - (int)(code >> 1));
        }
    return bad;
}

static unsigned dopt__tern_check(const uint8_t *in, size_t n) {
    uint8_t c[DOPT__BLOCK];
    size_t i, full = n - n % DOPT__BLOCK, nb = full / 4, j;
    unsigned bad = 0;
    uint64_t acc = 0;
    /* 11 has both bits of a pair set: w & (w >> 1) on the even bits. Whole 64-byte lines as
       words (the fixed inner count vectorizes; a shift across a byte lands on an odd bit,
       which the mask drops), then the bytes left over. */
    for (j = 0; j + 64 <= nb; j += 64) {
        uint64_t w[8];
        int k;
        memcpy(w, in + j, sizeof w);
        for (k = 0; k < 8; k++) acc |= w[k] & (w[k] >> 1);
    }
    bad = (acc & 0x5555555555555555ull) != 0;
    for (; j < nb; j++) bad |= (unsigned)(in[j] & (in[j] >> 1) & 0x55u);
    if (n > full) {
        bad |= dopt__unpack_block(in + nb, n - full, 2, c);
        for (i = 0; i < n - full; i++) bad |= (unsigned)(c[i] == 3);
    }
    return bad;
}

static void dopt__tern_accum(float *y, size_t n, float v, const uint8_t *in) {
    uint8_t c[DOPT__BLOCK];
    size_t i, full = n - n % DOPT__BLOCK;
    for (i = 0; i < full; i += DOPT__BLOCK, in += 16) {
        int p;
        for (p = 0; p < 4; p++) DOPT__PREFETCH(y + i + 16 * p, DOPT__AHEAD);
#ifdef DOPT__COMPRESS_AVX512
        (void)dopt__tern_accum_avx512(y + i, v, in);
#else
        (void)dopt__tern_accum_full(y + i, v, in);
#endif
    }
    if (n > full) {
        (void)dopt__unpack_block(in, n - full, 2, c);
        for (i = 0; i < n - full; i++) y[full + i] += v * (float)((int)(c[i] & 1u) - (int)(c[i] >> 1));
    }
}

/* ----- the allreduce's sum of N ternary messages with one shared scale

   With scale sharing every message of a segment carries the same s, so the average
   (1/N) Σ_r s·t_r is v · Σ_r t_r with v = (1/N)·s: the codes are summed as small integers
   (int8 counts, |Σ t| <= N <= 127) and converted once, y = (float)count · v — one rounding per
   element and one write pass instead of N read-modify-write passes over y. msgs[r] points at
   segment i's packed codes in message r. */
#define DOPT__TERN_SUM_MAX 127 /* ranks the int8 counts hold */

static void dopt__tern_sum_block(int8_t *DOPT_RESTRICT cnt, const uint8_t *const *msgs, int nmsg, size_t off, size_t m) {
    size_t q = (m + 3) / 4, t;
    int r;
    for (t = 0; t < m; t++) cnt[t] = 0;
    for (r = 0; r < nmsg; r++) {
        const uint8_t *in = msgs[r] + off;
        for (t = 0; t < m; t++) {
            unsigned code = (in[t % q] >> (2 * (t / q))) & 3u;
            cnt[t] = (int8_t)(cnt[t] + (int)(code & 1u) - (int)(code >> 1));
        }
    }
}

DOPT__MAYBE_UNUSED static void dopt__tern_sum_portable(float *DOPT_RESTRICT y, size_t n, float v, const uint8_t *const *msgs,
                                                     int nmsg) {
    int8_t cnt[DOPT__BLOCK];
    size_t i, t, off = 0;
    for (i = 0; i < n; i += DOPT__BLOCK, off += 16) {
        size_t m = n - i < DOPT__BLOCK ? n - i : DOPT__BLOCK;
        dopt__tern_sum_block(cnt, msgs, nmsg, off, m);
        for (t = 0; t < m; t++) y[i + t] = (float)cnt[t] * v;
    }
}

#ifdef DOPT__COMPRESS_AVX512
/* 64 counts per register: the 16 bytes of a block broadcast to the four 128-bit lanes, lane q
   shifted by 2q bits, so byte j of lane q holds the code of element 16q + j. Large segments go
   out with streaming stores (y is not read, and is too large to stay in cache). */
static void dopt__tern_sum_avx512(float *DOPT_RESTRICT y, size_t n, float v, const uint8_t *const *msgs, int nmsg) {
    const __m512i shifts = _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6), ones = _mm512_set1_epi8(1);
    const __m512 vv = _mm512_set1_ps(v);
    size_t i, full = n - n % DOPT__BLOCK, off = 0;
    int stream = n >= ((size_t)1 << 18) && ((uintptr_t)(void *)y & 63u) == 0, r;
    for (i = 0; i < full; i += DOPT__BLOCK, off += 16) {
        __m512i cnt = _mm512_setzero_si512();
        for (r = 0; r < nmsg; r++) {
            __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)(msgs[r] + off)));
            __m512i c = _mm512_srlv_epi64(b, shifts);
            cnt = _mm512_add_epi8(cnt, _mm512_and_si512(c, ones));
            cnt = _mm512_sub_epi8(cnt, _mm512_and_si512(_mm512_srli_epi64(c, 1), ones));
        }
        {
            __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(cnt, 0))), vv);
            __m512 f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(cnt, 1))), vv);
            __m512 f2 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(cnt, 2))), vv);
            __m512 f3 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(cnt, 3))), vv);
            if (stream) {
                _mm512_stream_ps(y + i, f0);
                _mm512_stream_ps(y + i + 16, f1);
                _mm512_stream_ps(y + i + 32, f2);
                _mm512_stream_ps(y + i + 48, f3);
            } else {
                _mm512_storeu_ps(y + i, f0);
                _mm512_storeu_ps(y + i + 16, f1);
                _mm512_storeu_ps(y + i + 32, f2);
                _mm512_storeu_ps(y + i + 48, f3);
            }
        }
    }
    if (stream) _mm_sfence();
    if (n > full) {
        int8_t cnt[DOPT__BLOCK];
        size_t t;
        dopt__tern_sum_block(cnt, msgs, nmsg, off, n - full);
        for (t = 0; t < n - full; t++) y[full + t] = (float)cnt[t] * v;
    }
}
#endif

static void dopt__tern_sum(float *y, size_t n, float v, const uint8_t *const *msgs, int nmsg) {
#ifdef DOPT__COMPRESS_AVX512
    dopt__tern_sum_avx512(y, n, v, msgs, nmsg);
#else
    dopt__tern_sum_portable(y, n, v, msgs, nmsg);
#endif
}

/* ===================================================================== QSGD */

static unsigned dopt__qsgd_width(unsigned s) { return s <= 7 ? 4u : 8u; }

static size_t dopt__qsgd_nbuckets(size_t n, size_t bucket) { return (n + bucket - 1) / bucket; }

/* Per-element factors of a block of m elements starting at element i, one bucket lookup per
   bucket the block touches (not one division per element): f[t] = s/‖v‖ (0 for a zero norm)
   for the encoder, ‖v‖/s for the decoder, ‖v‖ the norm of element i + t's bucket. */
static void dopt__qsgd_factors(const unsigned char *norms, size_t i, size_t m, size_t bucket, unsigned s, int decode,
                               float *f) {
    size_t t = 0;
    while (t < m) {
        size_t b = (i + t) / bucket, end = (b + 1) * bucket - i;
        float norm = dopt__bits_f32(dopt__get_le32(norms + 4 * b));
        float v = decode ? norm / (float)s : (norm > DOPT__TINY_SCALE ? (float)s / norm : 0.0f); /* see dopt__tern_k */
        end = end < m ? end : m;
        for (; t < end; t++) f[t] = v;
    }
    for (; t < DOPT__BLOCK; t++) f[t] = 0.0f;
}

/* Levels of one block of 64: l = floor(s|v|/‖v‖) + Bernoulli(frac), sign-magnitude in 4 bits
   (sign bit 3) or a signed byte. inv[t] is s/‖v‖ of the element's bucket. Branch-free with a
   constant trip count, so that it vectorizes at -O2; a shorter tail block goes through
   zero-padded copies. */
static void dopt__qsgd_codes(const float *DOPT_RESTRICT x, const float *DOPT_RESTRICT inv,
                             const uint32_t *DOPT_RESTRICT r, unsigned s, unsigned w, uint8_t *DOPT_RESTRICT c) {
    int t, l[DOPT__BLOCK], si = (int)s;
    for (t = 0; t < DOPT__BLOCK; t++) {
        float a = fabsf(x[t]) * inv[t], top = a < (float)s ? a : (float)s; /* NaN: s */
        int lv = (int)top;
        float frac = a - (float)lv;
        lv += (float)(int)(r[t] >> 8) * (1.0f / 16777216.0f) < frac;
        l[t] = lv > si ? si : lv;
    }
    if (w == 4)
        for (t = 0; t < DOPT__BLOCK; t++) c[t] = (uint8_t)(((x[t] < 0.0f) & (l[t] > 0)) << 3 | l[t]);
    else
        for (t = 0; t < DOPT__BLOCK; t++) c[t] = (uint8_t)(x[t] < 0.0f ? -l[t] : l[t]);
}

#define DOPT__QSGD_RUN 256 /* elements whose words are generated together */

/* Returns 0, having written only some norms, when a bucket holds a NaN or ±inf or its norm is
   beyond what a float holds (the bits of a bucket are checked right after its sum of squares
   read them, while they are in L1). */
static int dopt__qsgd_encode_segment(const float *x, size_t n, size_t bucket, unsigned s, const dopt_rng *rng,
                                     unsigned char *body) {
    size_t nb = dopt__qsgd_nbuckets(n, bucket), b, i, j, t;
    unsigned w = dopt__qsgd_width(s);
    unsigned char *codes = body + 4 * nb;
    uint32_t r[DOPT__QSGD_RUN];
    float inv[DOPT__BLOCK], xs[DOPT__BLOCK];
    uint8_t c[DOPT__BLOCK];
    for (b = 0; b < nb; b++) {
        size_t lo = b * bucket, len = n - lo < bucket ? n - lo : bucket;
        double ss = dopt_sumsq(x + lo, len);
        if (dopt__absbits_max(x + lo, len) > DOPT__F32_MAX_BITS || ss > (double)FLT_MAX * (double)FLT_MAX) return 0;
        dopt__put_le32(body + 4 * b, dopt__f32_bits((float)sqrt(ss)));
    }
    for (j = 0; j < n; j += DOPT__QSGD_RUN) {
        size_t run = n - j < DOPT__QSGD_RUN ? n - j : DOPT__QSGD_RUN;
        dopt_rng_u32(rng, j, r, run);
        for (t = run; t < DOPT__QSGD_RUN; t++) r[t] = 0;
        for (i = j; i < j + run; i += DOPT__BLOCK) {
            size_t m = n - i < DOPT__BLOCK ? n - i : DOPT__BLOCK;
            const float *xb = x + i;
            dopt__qsgd_factors(body, i, m, bucket, s, 0, inv);
            if (m < DOPT__BLOCK) {
                memset(xs, 0, sizeof xs);
                memcpy(xs, xb, m * sizeof(float));
                xb = xs;
            }
            dopt__qsgd_codes(xb, inv, r + (i - j), s, w, c);
            if (w == 8)
                memcpy(codes + i, c, m);
            else if (m == DOPT__BLOCK)
                dopt__pack4_full(c, codes + i / 2);
            else
                dopt__pack_block(c, m, 4, codes + i / 2);
        }
    }
    return 1;
}

/* Validates a segment's norms and codes (no output). Full 4-bit blocks use every bit, so
   only their codes are checked (no level above s, no negative zero), a byte at a time. */
static int dopt__qsgd_check(const unsigned char *body, size_t n, size_t bucket, unsigned s) {
    size_t nb = dopt__qsgd_nbuckets(n, bucket), b, i, t, full = n - n % DOPT__BLOCK;
    unsigned w = dopt__qsgd_width(s), bad = 0;
    const unsigned char *codes = body + 4 * nb;
    uint8_t c[DOPT__BLOCK];
    for (b = 0; b < nb; b++)
        if (!dopt__scale_ok(dopt__get_le32(body + 4 * b))) return 0;
    if (w == 8) {
        for (i = 0; i < n; i++) {
            int v = (int)(int8_t)codes[i];
            bad |= (unsigned)(v > (int)s) | (unsigned)(v < -(int)s);
        }
        return bad == 0;
    }
    for (i = 0; i < full / 2; i++) {
        unsigned lo = codes[i] & 15u, hi = codes[i] >> 4;
        bad |= (unsigned)((lo & 7u) > s) | (unsigned)(lo == 8u) | (unsigned)((hi & 7u) > s) | (unsigned)(hi == 8u);
    }
    if (n > full) {
        bad |= dopt__unpack_block(codes + full / 2, n - full, 4, c);
        for (t = 0; t < n - full; t++) bad |= (unsigned)((c[t] & 7u) > s) | (unsigned)(c[t] == 8u);
    }
    return bad == 0;
}

static void dopt__qsgd_accum(float *y, size_t n, size_t bucket, unsigned s, float weight, const unsigned char *body) {
    size_t nb = dopt__qsgd_nbuckets(n, bucket), i, t;
    unsigned w = dopt__qsgd_width(s);
    const unsigned char *codes = body + 4 * nb;
    uint8_t c[DOPT__BLOCK];
    float q[DOPT__BLOCK], value[DOPT__BLOCK];
    for (i = 0; i < n; i += DOPT__BLOCK) {
        size_t m = n - i < DOPT__BLOCK ? n - i : DOPT__BLOCK;
        dopt__qsgd_factors(body, i, m, bucket, s, 1, q);
        memset(c, 0, sizeof c);
        if (w == 8)
            memcpy(c, codes + i, m);
        else if (m == DOPT__BLOCK)
            for (t = 0; t < 32; t++) {
                c[t] = (uint8_t)(codes[i / 2 + t] & 15u);
                c[t + 32] = (uint8_t)(codes[i / 2 + t] >> 4);
            }
        else
            (void)dopt__unpack_block(codes + i / 2, m, 4, c);
        /* The decoded value is rounded on its own before the weight: with weight ±1 (error
           feedback's own message) a compiler that fuses the multiply-add still gives
           y ± round(q·level), so the residual is exactly p − C(p). */
        for (t = 0; t < DOPT__BLOCK; t++) {
            int level = w == 8 ? (int)(int8_t)c[t] : (int)(c[t] & 7u) * (1 - (int)((c[t] >> 2) & 2u));
            value[t] = q[t] * (float)level; /* q = ‖v‖/s */
        }
        if (m == DOPT__BLOCK)
            for (t = 0; t < DOPT__BLOCK; t++) y[i + t] += weight * value[t];
        else
            for (t = 0; t < m; t++) y[i + t] += weight * value[t];
    }
}

/* ===================================================================== TOP-K */

static size_t dopt__topk_k(size_t n, double ratio) {
    double k = ceil(ratio * (double)n);
    size_t kk = k < 1.0 ? 1 : (k > (double)n ? n : (size_t)k);
    return n == 0 ? 0 : kk;
}

/* The keys |x_i| into work, as bits (x & 0x7FFFFFFF: exactly fabsf, whatever the compiler's
   options); returns 0 when some x_i is NaN or ±inf, so that the selection below only ever sees
   finite keys, which have a total order. */
static int dopt__topk_keys(const float *DOPT_RESTRICT x, size_t n, float *DOPT_RESTRICT work) {
    uint32_t m[DOPT__CHECK_LANES] = {0}, r = 0, a;
    size_t i, full = n - n % DOPT__CHECK_LANES;
    int j;
    for (i = 0; i < full; i += DOPT__CHECK_LANES)
        for (j = 0; j < DOPT__CHECK_LANES; j++) {
            a = dopt__f32_bits(x[i + j]) & DOPT__F32_ABS;
            m[j] = a > m[j] ? a : m[j];
            work[i + j] = dopt__bits_f32(a);
        }
    for (; i < n; i++) {
        a = dopt__f32_bits(x[i]) & DOPT__F32_ABS;
        r = a > r ? a : r;
        work[i] = dopt__bits_f32(a);
    }
    for (j = 0; j < DOPT__CHECK_LANES; j++) r = m[j] > r ? m[j] : r;
    return r <= DOPT__F32_MAX_BITS;
}

/* The k-th largest of a[0..n), 1 <= k <= n, by quickselect with a three-way partition (runs of
   equal values, such as zeros, do not degrade it). Reorders a. */
static float dopt__kth_largest(float *a, size_t n, size_t k) {
    size_t lo = 0, hi = n, want = k - 1; /* index in descending order */
    for (;;) {
        size_t lt = lo, gt = hi, i = lo, mid = lo + (hi - lo) / 2;
        float p0 = a[lo], p1 = a[mid], p2 = a[hi - 1], pivot;
        if (hi - lo == 1) return a[lo];
        pivot = p0 > p1 ? (p1 > p2 ? p1 : (p0 > p2 ? p2 : p0)) : (p0 > p2 ? p0 : (p1 > p2 ? p2 : p1));
        /* [lo, lt) > pivot, [lt, i) == pivot, [gt, hi) < pivot */
        while (i < gt) {
            float v = a[i];
            if (v > pivot) {
                a[i] = a[lt];
                a[lt++] = v;
                i++;
            } else if (v < pivot) {
                a[i] = a[--gt];
                a[gt] = v;
            } else {
                i++;
            }
        }
        if (want < lt)
            hi = lt;
        else if (want < gt)
            return pivot;
        else
            lo = gt;
    }
}

/* The k-th largest of the n keys in work, by radix passes first. Keys are non-negative finite
   floats, whose bit patterns order like the values: a histogram of their top 11 bits (exponent
   and 3 mantissa bits) finds the bucket that holds the k-th largest, and only that bucket's
   keys are kept (compacted at the front of work); a second histogram of the next 11 bits
   narrows them again, and the few left go through the quickselect. Branch-free streaming
   passes instead of a quickselect over all n, and the same value (the k-th largest is unique).
   Four interleaved histograms keep runs of equal buckets from serializing on one counter. */
#define DOPT__TOPK_BUCKETS 2048

/* The bucket (bits >> shift & 2047) holding the k-th largest of the counts, and how many
   keys lie in the buckets above it. */
static uint32_t dopt__topk_bucket(uint32_t (*hist)[DOPT__TOPK_BUCKETS], size_t k, size_t *above) {
    uint32_t bucket = DOPT__TOPK_BUCKETS;
    size_t sum = 0;
    while (bucket-- > 1) { /* from the largest keys down, until k are covered */
        size_t h = (size_t)hist[0][bucket] + hist[1][bucket] + hist[2][bucket] + hist[3][bucket];
        if (sum + h >= k) break;
        sum += h;
    }
    *above = sum;
    return bucket;
}

static float dopt__topk_threshold(float *work, size_t n, size_t k) {
    static const unsigned shifts[2] = {20, 9};
    uint32_t hist[4][DOPT__TOPK_BUCKETS];
    size_t i, m = n, above, j;
    int level;
    for (level = 0; level < 2 && m > 64; level++) {
        unsigned sh = shifts[level];
        size_t m4 = m - m % 4, kept = 0;
        uint32_t bucket;
        memset(hist, 0, sizeof hist);
        for (i = 0; i < m4; i += 4)
            for (j = 0; j < 4; j++) hist[j][dopt__f32_bits(work[i + j]) >> sh & 2047u]++;
        for (; i < m; i++) hist[0][dopt__f32_bits(work[i]) >> sh & 2047u]++;
        bucket = dopt__topk_bucket(hist, k, &above);
        for (i = 0; i < m; i++) { /* compaction without a branch: kept <= i */
            float key = work[i];
            work[kept] = key;
            kept += (size_t)((dopt__f32_bits(key) >> sh & 2047u) == bucket);
        }
        m = kept;
        k -= above;
    }
    return dopt__kth_largest(work, m, k);
}

/* Body: k indices (increasing), then k values: the k largest |x_i|, ties to the lower index.
   Returns 0, having written nothing, when some x_i is NaN or ±inf. */
static int dopt__topk_encode_segment(const float *x, size_t n, size_t k, float *work, unsigned char *body) {
    size_t i, greater = 0, taken = 0, ties;
    float thr;
    if (k == 0) return 1;
    if (!dopt__topk_keys(x, n, work)) return 0;
    thr = dopt__topk_threshold(work, n, k);
    for (i = 0; i < n; i++) greater += fabsf(x[i]) > thr;
    ties = k - greater;
    /* Blocks of 64 are first counted branch-free (vectorized); only blocks with a candidate
       are walked element by element. */
    for (i = 0; i < n && taken < k; i += DOPT__BLOCK) {
        size_t m = n - i < DOPT__BLOCK ? n - i : DOPT__BLOCK, t;
        unsigned any = 0;
        if (m == DOPT__BLOCK)
            for (t = 0; t < DOPT__BLOCK; t++) any += fabsf(x[i + t]) >= thr;
        else
            any = 1;
        for (t = 0; any && t < m && taken < k; t++) {
            float key = fabsf(x[i + t]);
            if (key > thr || (key == thr && ties > 0)) {
                if (!(key > thr)) ties--;
                dopt__put_le32(body + 4 * taken, (uint32_t)(i + t));
                memcpy(body + 4 * k + 4 * taken, &x[i + t], 4);
                taken++;
            }
        }
    }
    return 1;
}

static int dopt__topk_check(const unsigned char *body, size_t n, size_t k) {
    size_t j;
    uint64_t prev = 0;
    for (j = 0; j < k; j++) {
        uint64_t idx = dopt__get_le32(body + 4 * j);
        if (idx >= n || (j > 0 && idx <= prev)) return 0;
        prev = idx;
    }
    return dopt__f32_bytes_finite(body + 4 * k, k);
}

static void dopt__topk_accum(float *y, size_t k, float weight, const unsigned char *body) {
    size_t j;
    for (j = 0; j < k; j++) {
        float v;
        memcpy(&v, body + 4 * k + 4 * j, 4);
        y[dopt__get_le32(body + 4 * j)] += weight * v;
    }
}

/* ===================================================================== SIGN (EF-SIGNSGD) */

/* 1 bit per element, 1 for x < 0; the scale ‖x‖₁/n goes in the record. |x| is taken as bits,
   and their maximum beside the sum: returns 0 when some x_i is NaN or ±inf. */
static int dopt__sign_scale(const float *x, size_t n, float *scale) {
    double acc[16] = {0}, s = 0.0;
    uint32_t m[16] = {0}, mx = 0;
    size_t i, full = n - n % 16;
    int j;
    for (i = 0; i < full; i += 16)
        for (j = 0; j < 16; j++) {
            uint32_t a = dopt__f32_bits(x[i + j]) & DOPT__F32_ABS;
            m[j] = a > m[j] ? a : m[j];
            acc[j] += (double)dopt__bits_f32(a);
        }
    for (j = 0; j < 16; j++) {
        s += acc[j];
        mx = m[j] > mx ? m[j] : mx;
    }
    for (i = full; i < n; i++) {
        uint32_t a = dopt__f32_bits(x[i]) & DOPT__F32_ABS;
        mx = a > mx ? a : mx;
        s += (double)dopt__bits_f32(a);
    }
    *scale = n ? (float)(s / (double)n) : 0.0f;
    return mx <= DOPT__F32_MAX_BITS;
}

/* Full blocks: the 64 sign bits as a mask (bit t: element t, one compare per 16 with AVX-512),
   transposed into the block's byte layout; the portable form packs bytes. The same bits
   either way (the tests compare them). */
DOPT__MAYBE_UNUSED static void dopt__sign_block_portable(const float *DOPT_RESTRICT x, uint8_t *DOPT_RESTRICT out) {
    uint8_t c[DOPT__BLOCK];
    int t;
    for (t = 0; t < DOPT__BLOCK; t++) c[t] = (uint8_t)(x[t] < 0.0f);
    dopt__pack1_full(c, out);
}

static void dopt__sign_block(const float *x, uint8_t *out) {
#ifdef DOPT__COMPRESS_AVX512
    const __m512 zero = _mm512_setzero_ps();
    uint64_t mask = 0, packed;
    int q;
    for (q = 0; q < 4; q++) mask |= (uint64_t)_mm512_cmp_ps_mask(_mm512_loadu_ps(x + 16 * q), zero, _CMP_LT_OQ) << (16 * q);
    packed = dopt__transpose8x8(mask);
    memcpy(out, &packed, 8);
#else
    dopt__sign_block_portable(x, out);
#endif
}

static void dopt__sign_encode_segment(const float *x, size_t n, uint8_t *out) {
    uint8_t c[DOPT__BLOCK];
    size_t i, t, full = n - n % DOPT__BLOCK;
    for (i = 0; i < full; i += DOPT__BLOCK) dopt__sign_block(x + i, out + i / 8);
    if (n > full) {
        for (t = 0; t < n - full; t++) c[t] = (uint8_t)(x[full + t] < 0.0f);
        dopt__pack_block(c, n - full, 1, out + full / 8);
    }
}

/* y += v·(1 - 2·bit) = ±v (exact products, so only the add rounds). */
DOPT__MAYBE_UNUSED static void dopt__sign_accum_block_portable(float *DOPT_RESTRICT y, float v, const uint8_t *DOPT_RESTRICT in) {
    int k, j;
    for (k = 0; k < 8; k++)
        for (j = 0; j < 8; j++) y[8 * k + j] += v * (1.0f - 2.0f * (float)((in[j] >> k) & 1u));
}

static void dopt__sign_accum_block(float *y, float v, const uint8_t *in) {
#ifdef DOPT__COMPRESS_AVX512
    const __m512 plus = _mm512_set1_ps(v * 1.0f), minus = _mm512_set1_ps(v * -1.0f);
    uint64_t packed, mask;
    int q;
    memcpy(&packed, in, 8);
    mask = dopt__transpose8x8(packed);
    for (q = 0; q < 4; q++) {
        __m512 vt = _mm512_mask_blend_ps((__mmask16)(mask >> (16 * q)), plus, minus);
        _mm512_storeu_ps(y + 16 * q, _mm512_add_ps(_mm512_loadu_ps(y + 16 * q), vt));
    }
#else
    dopt__sign_accum_block_portable(y, v, in);
#endif
}

static void dopt__sign_accum(float *y, size_t n, float v, const uint8_t *in) {
    uint8_t c[DOPT__BLOCK];
    size_t i, t, full = n - n % DOPT__BLOCK;
    for (i = 0; i < full; i += DOPT__BLOCK) {
        int p;
        for (p = 0; p < 4; p++) DOPT__PREFETCH(y + i + 16 * p, DOPT__AHEAD);
        dopt__sign_accum_block(y + i, v, in + i / 8);
    }
    if (n > full) {
        (void)dopt__unpack_block(in + full / 8, n - full, 1, c);
        for (t = 0; t < n - full; t++) y[full + t] += v * (1.0f - 2.0f * (float)c[t]);
    }
}

/* ===================================================================== MAJORITY VOTE */

/* Majority vote: the magnitude of a segment's result, 1, or with majority_l1 the mean of the
   ranks' scales (‖g‖₁/d) summed in rank order, rank r's at scales + r·stride (f32 bits). */
static float dopt__vote_magnitude(const dopt_compressor *cz, const unsigned char *scales, size_t stride, int N,
                                  float weight) {
    float v = 0.0f;
    int r;
    if (!cz->cfg.majority_l1) return 1.0f;
    for (r = 0; r < N; r++) v += dopt__bits_f32(dopt__get_le32(scales + (size_t)r * stride));
    return v * weight;
}

/* Rank r's votes on a block of m elements as a word with bit t for element t (1 = negative):
   the 1-bit body at base + r·stride + at, whose full block's byte j holds elements j, j + 8, ...,
   j + 56 (the transpose makes it the word). */
static uint64_t dopt__vote_word(const unsigned char *base, size_t stride, int r, size_t at, size_t m) {
    const unsigned char *p = base + (size_t)r * stride + at;
    uint64_t word = 0;
    size_t t;
    if (m == DOPT__BLOCK) {
        memcpy(&word, p, 8);
        return dopt__transpose8x8(word);
    } else {
        uint8_t c[DOPT__BLOCK];
        dopt__unpack_block(p, m, 1, c);
        for (t = 0; t < m; t++) word |= (uint64_t)c[t] << t;
    }
    return word;
}

/* The vote of N ranks on a block of m elements into y: S = N - 2·(negative votes), y = ±v by
   its sign, 0 on a tie (v >= 0, so sign(S)·v gives those bits). With AVX-512 and N <= 127, 64
   byte counters at once (a mask's bytes are -1 where its bits are set) and the floats from
   masks. */
static void dopt__vote_block(const unsigned char *base, size_t stride, int N, size_t at, size_t m, float v,
                             float *DOPT_RESTRICT y) {
    int cnt[DOPT__BLOCK], r;
    size_t t;
#ifdef DOPT__COMPRESS_AVX512
    if (N <= DOPT__TERN_SUM_MAX) {
        const __m512 pos = _mm512_set1_ps(v), neg = _mm512_set1_ps(-v);
        __m512i c = _mm512_setzero_si512(), d;
        uint64_t gt, lt;
        int q;
        for (r = 0; r < N; r++) c = _mm512_sub_epi8(c, _mm512_movm_epi8(dopt__vote_word(base, stride, r, at, m)));
        d = _mm512_sub_epi8(_mm512_set1_epi8((char)N), _mm512_add_epi8(c, c));
        gt = _mm512_cmpgt_epi8_mask(d, _mm512_setzero_si512());
        lt = _mm512_cmplt_epi8_mask(d, _mm512_setzero_si512());
        for (q = 0; q < 4 && (size_t)(16 * q) < m; q++) {
            __m512 f = _mm512_mask_mov_ps(_mm512_maskz_mov_ps((__mmask16)(gt >> 16 * q), pos), (__mmask16)(lt >> 16 * q), neg);
            if ((size_t)(16 * q + 16) <= m)
                _mm512_storeu_ps(y + 16 * q, f);
            else
                _mm512_mask_storeu_ps(y + 16 * q, (__mmask16)((1u << (m - 16 * (size_t)q)) - 1u), f);
        }
        return;
    }
#endif
    for (t = 0; t < DOPT__BLOCK; t++) cnt[t] = 0;
    for (r = 0; r < N; r++) {
        uint64_t word = dopt__vote_word(base, stride, r, at, m);
        for (t = 0; t < DOPT__BLOCK; t++) cnt[t] += (int)((word >> t) & 1u);
    }
    for (t = 0; t < m; t++) {
        int d = N - 2 * cnt[t];
        y[t] = (float)((d > 0) - (d < 0)) * v;
    }
}

/* ===================================================================== THE CODEC TABLE

   Every codec's part of a message in one row: how a segment's body is written, checked and
   added into a sum, and the facts the rest of the file asks of a codec (the body's size is
   dopt__body_bytes, from the functions beside the table).
   Indexed by dopt_codec (dopt__config_resolve refuses any other value). The functions take a
   segment at a time (a function pointer per segment, never per element). */

/* What the ring carries for a codec: integer sums in planes (ternary, majority), running means
   in fp16 or bf16 (64 values of 16 bits per group, little-endian), or nothing (the allgather
   only). */
enum { DOPT__RING_NONE = -1, DOPT__RING_INT = 0, DOPT__RING_F16 = 1, DOPT__RING_BF16 = 2 };

/* Error feedback under DOPT_EF_AUTO, and whether DOPT_EF_OFF is allowed. */
enum { DOPT__EF_DEFAULT_OFF = 0, DOPT__EF_DEFAULT_ON = 1, DOPT__EF_REQUIRED = 2 };

/* Segment i of a call (its scale and bound in cz->scales[i], cz->bounds[i]) being encoded: the
   codec writes its body (zero padding is written around it) and sets a and b, its record's
   fields (WIRE FORMAT). */
typedef struct dopt__seg_out {
    size_t i, n;
    const float *x;      /* its n values (p with error feedback) */
    dopt_rng rng;        /* (seed, rank, step, segment) */
    unsigned char *body;
    uint32_t a, b;
    int codes;           /* ternary: 0 leaves its codes to the ring's pipeline (dopt__pipe_encode) */
} dopt__seg_out;

/* A segment of a message whose record header said n elements, a and b. */
typedef struct dopt__seg_in {
    size_t n;
    uint32_t a, b;
    const unsigned char *body;
} dopt__seg_in;

typedef struct dopt__codec_ops {
    const char *name; /* dopt_codec_name */
    /* the body and the record's fields; 0 when the values hold a NaN, ±inf or a value the codec
       cannot carry (the body is then partly written). NULL: the codec sends no messages */
    int (*encode)(const dopt_compressor *cz, dopt__seg_out *s);
    /* 1 when the record's fields and the body follow the format (every value finite) */
    int (*check)(const dopt_compressor_config *cfg, const dopt__seg_in *s);
    /* y[0..n) += weight · the values of a checked body */
    void (*accum)(const dopt_compressor_config *cfg, const dopt__seg_in *s, float weight, float *y);
    int ef;           /* DOPT__EF_*: error feedback by default, or always */
    int ring;         /* DOPT__RING_*: what the ring carries of its messages */
    /* TernGrad's scales: found (with the clip bounds) in a pass before any code is written and
       shared by one allreduce MAX unless no_scale_sharing, which carries the non-finite verdict
       too, so that the ring's pipeline may write the codes bucket by bucket; segments below
       fp32_below go as fp32 (and off the ring) */
    int shared_scale;
    int vote;         /* the result is the sign of the ranks' sum times a magnitude, not their mean */
    int u32_index;    /* indices on the wire are u32 (segments below 2^32 elements), chosen through
                         a selection buffer as large as the largest segment */
} dopt__codec_ops;

static size_t dopt__tern_body_bytes(const dopt_compressor_config *cfg, size_t n) {
    return n < cfg->fp32_below ? 4 * n : dopt__packed_bytes(n, 2);
}

/* Ternary: the scales and bounds are cz's (dopt__tern_scales found them finite). */
static int dopt__tern_encode_seg(const dopt_compressor *cz, dopt__seg_out *s) {
    if (s->n < cz->cfg.fp32_below) {
        s->a = 1;
        if (s->n) memcpy(s->body, s->x, 4 * s->n);
        return 1;
    }
    s->b = dopt__f32_bits(cz->scales[s->i]);
    if (s->codes) dopt__tern_encode_segment(s->x, s->n, cz->bounds[s->i], cz->scales[s->i], &s->rng, s->body);
    return 1;
}

static int dopt__tern_check_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s) {
    if (s->n < cfg->fp32_below) return s->a == 1 && s->b == 0 && dopt__f32_bytes_finite(s->body, s->n);
    return s->a == 0 && dopt__scale_ok(s->b) && dopt__tern_check(s->body, s->n) == 0;
}

static void dopt__tern_accum_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s, float weight, float *y) {
    float b = dopt__bits_f32(s->b);
    if (s->n < cfg->fp32_below)
        dopt__f32_accum(y, weight, s->body, s->n);
    else
        dopt__tern_accum(y, s->n, weight * b, s->body);
}

static size_t dopt__qsgd_body_bytes(const dopt_compressor_config *cfg, size_t n) {
    return 4 * dopt__qsgd_nbuckets(n, cfg->qsgd_bucket) +
           (dopt__qsgd_width(cfg->qsgd_levels) == 4 ? dopt__packed_bytes(n, 4) : n);
}

static int dopt__qsgd_encode_seg(const dopt_compressor *cz, dopt__seg_out *s) {
    s->a = (uint32_t)cz->cfg.qsgd_bucket;
    s->b = cz->cfg.qsgd_levels;
    return dopt__qsgd_encode_segment(s->x, s->n, cz->cfg.qsgd_bucket, cz->cfg.qsgd_levels, &s->rng, s->body);
}

static int dopt__qsgd_check_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s) {
    return s->a == (uint32_t)cfg->qsgd_bucket && s->b == cfg->qsgd_levels &&
           dopt__qsgd_check(s->body, s->n, cfg->qsgd_bucket, cfg->qsgd_levels);
}

static void dopt__qsgd_accum_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s, float weight, float *y) {
    dopt__qsgd_accum(y, s->n, cfg->qsgd_bucket, cfg->qsgd_levels, weight, s->body);
}

static size_t dopt__topk_body_bytes(const dopt_compressor_config *cfg, size_t n) {
    return 8 * dopt__topk_k(n, cfg->topk_ratio);
}

static int dopt__topk_encode_seg(const dopt_compressor *cz, dopt__seg_out *s) {
    s->a = (uint32_t)dopt__topk_k(s->n, cz->cfg.topk_ratio);
    return dopt__topk_encode_segment(s->x, s->n, s->a, cz->select, s->body);
}

static int dopt__topk_check_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s) {
    return s->a == (uint32_t)dopt__topk_k(s->n, cfg->topk_ratio) && s->b == 0 && dopt__topk_check(s->body, s->n, s->a);
}

static void dopt__topk_accum_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s, float weight, float *y) {
    dopt__topk_accum(y, dopt__topk_k(s->n, cfg->topk_ratio), weight, s->body);
}

/* Sign and majority vote: the same message. */
static size_t dopt__sign_body_bytes(const dopt_compressor_config *cfg, size_t n) {
    (void)cfg;
    return dopt__packed_bytes(n, 1);
}

static int dopt__sign_encode_seg(const dopt_compressor *cz, dopt__seg_out *s) {
    float scale;
    int finite = dopt__sign_scale(s->x, s->n, &scale);
    (void)cz;
    s->b = dopt__f32_bits(scale);
    if (finite) dopt__sign_encode_segment(s->x, s->n, s->body);
    return finite;
}

/* Full blocks use every bit: only the tail can be malformed. */
static int dopt__sign_check_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s) {
    uint8_t c[DOPT__BLOCK];
    size_t full = s->n - s->n % DOPT__BLOCK;
    (void)cfg;
    if (!(s->a == 0 && dopt__scale_ok(s->b))) return 0;
    return s->n == full || dopt__unpack_block(s->body + full / 8, s->n - full, 1, c) == 0;
}

static void dopt__sign_accum_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s, float weight, float *y) {
    float b = dopt__bits_f32(s->b);
    (void)cfg;
    dopt__sign_accum(y, s->n, weight * b, s->body);
}

/* fp16, bf16 and fp32: the values, a and b 0. */
static size_t dopt__half_body_bytes(const dopt_compressor_config *cfg, size_t n) {
    (void)cfg;
    return 2 * n;
}

static size_t dopt__f32_body_bytes(const dopt_compressor_config *cfg, size_t n) {
    (void)cfg;
    return 4 * n;
}

static int dopt__f16_encode_seg(const dopt_compressor *cz, dopt__seg_out *s) {
    (void)cz;
    return dopt__f16_encode(s->x, s->body, s->n);
}

static int dopt__bf16_encode_seg(const dopt_compressor *cz, dopt__seg_out *s) {
    (void)cz;
    return dopt__bf16_encode(s->x, s->body, s->n);
}

static int dopt__f32_encode_seg(const dopt_compressor *cz, dopt__seg_out *s) {
    (void)cz;
    return dopt__f32_encode(s->x, s->body, s->n);
}

static int dopt__f16_check_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s) {
    (void)cfg;
    return s->a == 0 && s->b == 0 && dopt__u16_bytes_finite(s->body, s->n, DOPT__F16_INF);
}

static int dopt__bf16_check_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s) {
    (void)cfg;
    return s->a == 0 && s->b == 0 && dopt__u16_bytes_finite(s->body, s->n, DOPT__BF16_INF);
}

static int dopt__f32_check_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s) {
    (void)cfg;
    return s->a == 0 && s->b == 0 && dopt__f32_bytes_finite(s->body, s->n);
}

static void dopt__f16_accum_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s, float weight, float *y) {
    (void)cfg;
    dopt__f16_accum(y, weight, s->body, s->n);
}

static void dopt__bf16_accum_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s, float weight, float *y) {
    (void)cfg;
    dopt__bf16_accum(y, weight, s->body, s->n);
}

static void dopt__f32_accum_seg(const dopt_compressor_config *cfg, const dopt__seg_in *s, float weight, float *y) {
    (void)cfg;
    dopt__f32_accum(y, weight, s->body, s->n);
}

static const dopt__codec_ops dopt__codecs[] = {
    /* name, encode, check, accumulate,
       error feedback, ring, shared_scale, vote, u32_index */
    {"ternary", dopt__tern_encode_seg, dopt__tern_check_seg, dopt__tern_accum_seg,
     DOPT__EF_DEFAULT_OFF, DOPT__RING_INT, 1, 0, 0},
    {"qsgd", dopt__qsgd_encode_seg, dopt__qsgd_check_seg, dopt__qsgd_accum_seg,
     DOPT__EF_DEFAULT_OFF, DOPT__RING_NONE, 0, 0, 0},
    {"topk", dopt__topk_encode_seg, dopt__topk_check_seg, dopt__topk_accum_seg,
     DOPT__EF_DEFAULT_ON, DOPT__RING_NONE, 0, 0, 1},
    {"sign", dopt__sign_encode_seg, dopt__sign_check_seg, dopt__sign_accum_seg,
     DOPT__EF_DEFAULT_ON, DOPT__RING_NONE, 0, 0, 0},
    {"fp16", dopt__f16_encode_seg, dopt__f16_check_seg, dopt__f16_accum_seg,
     DOPT__EF_DEFAULT_OFF, DOPT__RING_F16, 0, 0, 0},
    {"bf16", dopt__bf16_encode_seg, dopt__bf16_check_seg, dopt__bf16_accum_seg,
     DOPT__EF_DEFAULT_OFF, DOPT__RING_BF16, 0, 0, 0},
    {"fp32", dopt__f32_encode_seg, dopt__f32_check_seg, dopt__f32_accum_seg,
     DOPT__EF_DEFAULT_OFF, DOPT__RING_NONE, 0, 0, 0},
    {"majority", dopt__sign_encode_seg, dopt__sign_check_seg, dopt__sign_accum_seg,
     DOPT__EF_DEFAULT_OFF, DOPT__RING_INT, 0, 1, 0},
    /* PowerSGD sends no messages (POWERSGD below): no encoder, checker or accumulator */
    {"powersgd", NULL, NULL, NULL, DOPT__EF_REQUIRED, DOPT__RING_NONE, 0, 0, 0},
};

/* The row of a codec that dopt__config_resolve accepted. */
static const dopt__codec_ops *dopt__codec(const dopt_compressor_config *cfg) { return &dopt__codecs[cfg->codec]; }

/* ===================================================================== MESSAGE LAYOUT */

/* Bytes of a segment's body before padding. A switch rather than the table: the loops over
   segments that ask it (the ring's walk, the averages, every record) should see it inline, and
   a call through a pointer stays a call. */
static size_t dopt__body_bytes(const dopt_compressor_config *cfg, size_t n) {
    switch (cfg->codec) {
    case DOPT_CODEC_TERNARY: return dopt__tern_body_bytes(cfg, n);
    case DOPT_CODEC_QSGD: return dopt__qsgd_body_bytes(cfg, n);
    case DOPT_CODEC_TOPK: return dopt__topk_body_bytes(cfg, n);
    case DOPT_CODEC_SIGN:
    case DOPT_CODEC_MAJORITY: return dopt__sign_body_bytes(cfg, n);
    case DOPT_CODEC_FP16:
    case DOPT_CODEC_BF16: return dopt__half_body_bytes(cfg, n);
    case DOPT_CODEC_FP32: return dopt__f32_body_bytes(cfg, n);
    case DOPT_CODEC_POWERSGD: break; /* no messages: POWERSGD below */
    }
    return 0;
}

/* The whole table as a view (dopt__compress_view: the segments a call works on, in its order). */
static dopt__compress_view dopt__whole(const dopt_compressor *cz) {
    dopt__compress_view v;
    v.index = cz->all;
    v.nsegs = cz->nsegs;
    v.count = cz->count;
    v.msg_bytes = cz->msg_bytes;
    return v;
}

/* Segment j of a view: its count in the table. */
static size_t dopt__vcount(const dopt_compressor *cz, const dopt__compress_view *v, size_t j) {
    return cz->segs[v->index[j]].count;
}

/* A message of segments index[0..k): a header, then a record and a padded body per segment. */
static size_t dopt__message_bytes(const dopt_compressor *cz, const size_t *index, size_t k) {
    size_t j, total = DOPT_COMPRESS_HEADER_BYTES;
    for (j = 0; j < k; j++)
        total += DOPT_COMPRESS_RECORD_BYTES + dopt__pad8(dopt__body_bytes(&cz->cfg, cz->segs[index[j]].count));
    return total;
}

#define DOPT__MSG_NONFINITE 1u /* header byte 6 (flags): the sender's gradient holds a NaN or ±inf */

/* A message of the view's segments: its header counts them, their elements and its bytes. */
static void dopt__write_header(const dopt_compressor *cz, const dopt__compress_view *v, int rank, unsigned char *out) {
    dopt__put_le32(out, DOPT_COMPRESS_MAGIC);
    out[4] = DOPT_COMPRESS_VERSION;
    out[5] = (unsigned char)cz->cfg.codec;
    out[6] = out[7] = 0;
    dopt__put_le32(out + 8, (uint32_t)v->nsegs);
    dopt__put_le32(out + 12, (uint32_t)rank);
    dopt__put_le64(out + 16, (uint64_t)v->count);
    dopt__put_le64(out + 24, (uint64_t)v->msg_bytes);
}

/* The message of a rank whose gradient is not finite: the header with the flag, then zeros. */
static void dopt__write_nonfinite(const dopt_compressor *cz, const dopt__compress_view *v, int rank,
                                  unsigned char *out) {
    dopt__write_header(cz, v, rank, out);
    out[6] = DOPT__MSG_NONFINITE;
    memset(out + DOPT_COMPRESS_HEADER_BYTES, 0, v->msg_bytes - DOPT_COMPRESS_HEADER_BYTES);
}

/* The first segment whose count differs between b and the layout (when one table is the other's
   beginning, the first segment one of them lacks), SIZE_MAX when b fits. b is valid. */
static size_t dopt__segment_misfit(const dopt_compressor *cz, const dopt_buf *b) {
    size_t i, nb = dopt_buf_nsegs(b);
    for (i = 0; i < nb && i < cz->nsegs; i++)
        if (dopt_buf_segment(b, i).count != cz->segs[i].count) return i;
    return nb == cz->nsegs ? SIZE_MAX : i;
}

/* 1 when b is a valid descriptor with the layout's segments and counts. */
static int dopt__segment_matches(const dopt_compressor *cz, const dopt_buf *b) {
    return dopt_buf_validate(b) == DOPT_OK && dopt__segment_misfit(cz, b) == SIZE_MAX;
}

/* ===================================================================== ENCODE */

/* Ternary steps 1-2 over the view's segments: bounds and local scales (slot j for its segment j:
   a segment call shares k + 1 floats), and scales[k] = 1 when a segment holds a NaN or infinity
   (so that an allreduce MAX spreads the verdict). */
static void dopt__tern_scales(dopt_compressor *cz, const dopt__compress_view *v, const dopt_buf *g) {
    size_t j;
    float c = cz->cfg.clip_c > 0.0f ? cz->cfg.clip_c : 0.0f;
    cz->scales[v->nsegs] = 0.0f;
    for (j = 0; j < v->nsegs; j++) {
        dopt_span sp = dopt_buf_segment(g, v->index[j]);
        if (!dopt__tern_segment_scale(sp.ptr, sp.count, c, &cz->bounds[j], &cz->scales[j])) cz->scales[v->nsegs] = 1.0f;
    }
}

/* Writes the message of g (p with error feedback) into out, msg_bytes long, and returns 1; or
   returns 0 at the first segment that holds a NaN or ±inf, or a value its codec cannot carry
   (out then holds part of a message). Each codec finds them in a pass over the segment it makes
   anyway. Ternary takes its scales and bounds from cz->scales and cz->bounds, which
   dopt__tern_scales found finite; without tern_bodies its codes are left for the ring's pipeline
   to write (dopt__pipe_encode), the rest of the message written all the same. */
static int dopt__encode_message(dopt_compressor *cz, const dopt__compress_view *v, const dopt_buf *g, int rank,
                                unsigned char *out, int tern_bodies) {
    const dopt__codec_ops *ops = dopt__codec(&cz->cfg);
    size_t j;
    unsigned char *p = out + DOPT_COMPRESS_HEADER_BYTES;
    dopt__write_header(cz, v, rank, out);
    for (j = 0; j < v->nsegs; j++) {
        dopt_span sp = dopt_buf_segment(g, v->index[j]);
        size_t body = dopt__body_bytes(&cz->cfg, sp.count);
        dopt__seg_out so;
        so.i = j, so.n = sp.count, so.x = sp.ptr, so.a = so.b = 0, so.codes = tern_bodies;
        so.body = p + DOPT_COMPRESS_RECORD_BYTES;
        dopt__seg_rng(cz, rank, v->index[j], &so.rng); /* its stream: its index in the table */
        memset(so.body + body, 0, dopt__pad8(body) - body);
        if (!ops->encode(cz, &so)) return 0;
        dopt__put_le64(p, (uint64_t)so.n);
        dopt__put_le32(p + 8, so.a);
        dopt__put_le32(p + 12, so.b);
        p = so.body + dopt__pad8(body);
    }
    return 1;
}

/* ===================================================================== DECODE */

static int dopt__zero_bytes(const unsigned char *p, size_t n) {
    size_t i;
    unsigned char any = 0;
    for (i = 0; i < n; i++) any |= p[i];
    return any == 0;
}

/* Checks a message's header against the layout, and that a flagged message (a non-finite
   gradient) is zeros after it; returns the message's rank field or -1. */
static long dopt__check_header(const dopt__compress_view *v, dopt_codec codec, const unsigned char *m, size_t bytes) {
    const size_t h = DOPT_COMPRESS_HEADER_BYTES;
    if (bytes != v->msg_bytes || bytes < h) return -1;
    if (dopt__get_le32(m) != DOPT_COMPRESS_MAGIC || m[4] != DOPT_COMPRESS_VERSION ||
        m[5] != (unsigned char)codec || (m[6] & ~DOPT__MSG_NONFINITE) != 0 || m[7] != 0 ||
        dopt__get_le32(m + 8) != (uint64_t)v->nsegs || dopt__get_le64(m + 16) != (uint64_t)v->count ||
        dopt__get_le64(m + 24) != (uint64_t)bytes)
        return -1;
    if ((m[6] & DOPT__MSG_NONFINITE) && !dopt__zero_bytes(m + h, bytes - h)) return -1;
    return (long)dopt__get_le32(m + 12);
}

static int dopt__flagged_nonfinite(const unsigned char *m) { return (m[6] & DOPT__MSG_NONFINITE) != 0; }

/* Checks every segment of a message whose header passed and that carries values; 1 when all
   follow the format. Every value must be finite: a rank's own NaN or infinity never reaches the
   wire (its message is flagged instead), so a non-finite value is malformed. */
/* Segment j of a message of the view, at p: its record's fields and its body. */
static dopt__seg_in dopt__seg_at(const dopt_compressor *cz, const dopt__compress_view *v, size_t j,
                                 const unsigned char *p) {
    dopt__seg_in si;
    si.n = dopt__vcount(cz, v, j);
    si.a = dopt__get_le32(p + 8);
    si.b = dopt__get_le32(p + 12);
    si.body = p + DOPT_COMPRESS_RECORD_BYTES;
    return si;
}

static int dopt__check_body(const dopt_compressor *cz, const dopt__compress_view *v, const unsigned char *m) {
    const dopt_compressor_config *cfg = &cz->cfg;
    const dopt__codec_ops *ops = dopt__codec(cfg);
    const unsigned char *p = m + DOPT_COMPRESS_HEADER_BYTES;
    size_t j;
    /* The layout fixes every record's size, and the header checked the message's size, so every
       read below stays inside the message. */
    for (j = 0; j < v->nsegs; j++) {
        dopt__seg_in si = dopt__seg_at(cz, v, j, p);
        size_t body = dopt__body_bytes(cfg, si.n);
        if (!(dopt__get_le64(p) == (uint64_t)si.n && dopt__zero_bytes(si.body + body, dopt__pad8(body) - body) &&
              ops->check(cfg, &si)))
            return 0;
        p = si.body + dopt__pad8(body);
    }
    return 1;
}

/* Adds weight · C(g) of a validated message of the view into accum (a descriptor of the whole
   table: the view's segments alone are written). */
static void dopt__accumulate(const dopt_compressor *cz, const dopt__compress_view *v, const unsigned char *m,
                             float weight, const dopt_buf *accum) {
    const dopt__codec_ops *ops = dopt__codec(&cz->cfg);
    const unsigned char *p = m + DOPT_COMPRESS_HEADER_BYTES;
    size_t j;
    for (j = 0; j < v->nsegs; j++) {
        dopt__seg_in si = dopt__seg_at(cz, v, j, p);
        ops->accum(&cz->cfg, &si, weight, dopt_buf_segment(accum, v->index[j]).ptr);
        p = si.body + dopt__pad8(dopt__body_bytes(&cz->cfg, si.n));
    }
}

DOPT_DEF dopt_status dopt_compress_decode(const dopt_compressor *cz, const void *msg, size_t bytes, float weight,
                                          const dopt_buf *accum) {
    dopt__compress_view v;
    if (cz == NULL || cz->segs == NULL || accum == NULL || (msg == NULL && bytes > 0)) return DOPT_ERR_INVALID;
    if (dopt__codec(&cz->cfg)->encode == NULL) return DOPT_ERR_UNSUPPORTED; /* PowerSGD: two rounds, no message */
    if (!dopt__segment_matches(cz, accum)) return DOPT_ERR_INVALID;
    v = dopt__whole(cz);
    if (msg == NULL || dopt__check_header(&v, cz->cfg.codec, (const unsigned char *)msg, bytes) < 0)
        return DOPT_ERR_PROTOCOL;
    if (dopt__flagged_nonfinite((const unsigned char *)msg)) return DOPT_ERR_NONFINITE;
    if (!dopt__check_body(cz, &v, (const unsigned char *)msg)) return DOPT_ERR_PROTOCOL;
    dopt__accumulate(cz, &v, (const unsigned char *)msg, weight, accum);
    return DOPT_OK;
}

/* ===================================================================== ERROR FEEDBACK */

/* The span table made at init, after the segment table: it describes the work buffer or the
   residual as a scatter list of the whole table (segment i at cz->offs[i]), whichever segments a
   call works on: a segment's residual has one place, whatever the buckets. */
static dopt_span *dopt__spans(dopt_compressor *cz) { return (dopt_span *)(void *)(cz->segs + cz->nsegs); }

static dopt_buf dopt__spans_over(dopt_compressor *cz, float *base) {
    dopt_span *spans = dopt__spans(cz);
    size_t i;
    for (i = 0; i < cz->nsegs; i++) {
        spans[i].ptr = base + cz->offs[i];
        spans[i].count = cz->segs[i].count;
    }
    return dopt_buf_scatter(spans, cz->nsegs);
}

/* p = g + e of the view's segments, into the work buffer; returns the work buffer's descriptor. */
static dopt_buf dopt__ef_prepare(dopt_compressor *cz, const dopt__compress_view *v, const dopt_buf *g) {
    size_t j, e;
    for (j = 0; j < v->nsegs; j++) {
        dopt_span sp = dopt_buf_segment(g, v->index[j]);
        float *w = cz->work + cz->offs[v->index[j]];
        const float *r = cz->residual + cz->offs[v->index[j]];
        for (e = 0; e < sp.count; e++) w[e] = sp.ptr[e] + r[e];
    }
    return dopt__spans_over(cz, cz->work);
}

/* The view's new residual e = p - C(p) in the work buffer: p minus its own decoded message, one
   rounding per element. It becomes the residual when the step closes (dopt__step_close). */
static void dopt__ef_update(dopt_compressor *cz, const dopt__compress_view *v, const unsigned char *msg) {
    dopt_buf e = dopt__spans_over(cz, cz->work);
    dopt__accumulate(cz, v, msg, -1.0f, &e);
}

/* ===================================================================== THE STEP IN PARTS

   A step is every segment averaged once, by one whole call or by segment calls (buckets). The
   calls started so far mark their segments in cz->given (the caller's thread: a segment given
   twice is refused before anything starts); the calls that end count theirs in cz->nfinished
   (whoever runs them: the caller, or the worker, in start order). When the step's last segment
   is in, the step closes: if every call of it succeeded, the new residuals (the work buffer) and
   PowerSGD's new Q's become the state and the step (the RNG key) advances; if one failed (a
   NaN somewhere, a lost peer), nothing of the step is kept, as a whole call that fails keeps
   nothing. */

static void dopt__step_close(dopt_compressor *cz) {
    if (!cz->step_failed) {
        if (cz->ef && cz->count) memcpy(cz->residual, cz->work, cz->count * sizeof(float));
        if (cz->psgd_nq) memcpy(cz->psgd_q, cz->psgd_qnext, cz->psgd_nq * sizeof(float));
        cz->step++;
    }
    cz->nfinished = 0;
    cz->step_failed = 0;
}

/* A call over k segments ended with status s. */
static void dopt__step_count(dopt_compressor *cz, size_t k, dopt_status s) {
    cz->step_failed |= s != DOPT_OK;
    cz->nfinished += k;
    if (cz->nfinished == cz->nsegs) dopt__step_close(cz);
}

/* Waits for the started calls in flight (none without a worker): what reads or writes the state
   outside a call (encode, state save and load) sees the state they leave. */
static void dopt__settle(const dopt_compressor *cz) {
    if (cz->worker != NULL) (void)dopt__worker_wait(cz->worker, cz->started);
}

static const char *dopt__seg_name(const dopt_compressor *cz, size_t i) {
    return i < cz->nsegs && cz->segs[i].name ? cz->segs[i].name : "unnamed";
}

/* Marks segs[0..k) given in this step (NULL: every segment), or refuses them, nothing marked,
   with the reason in cz->detail: an index out of the table, or a segment already given in this
   step. A step whose every segment is given starts the next. */
static dopt_status dopt__step_give(dopt_compressor *cz, const size_t *segs, size_t k, const char *api) {
    size_t j, i, first = 0;
    for (j = 0; j < k; j++) {
        i = segs ? segs[j] : j;
        if (i < cz->nsegs && !cz->given[i]) {
            cz->given[i] = 1;
            continue;
        }
        while (j-- > 0) cz->given[segs ? segs[j] : j] = 0;
        if (i >= cz->nsegs) {
            snprintf(cz->detail, sizeof cz->detail, "%s: segment index %zu is beyond the table's %zu segments", api, i,
                     cz->nsegs);
            return DOPT_ERR_INVALID;
        }
        while (first < cz->nsegs && cz->given[first]) first++; /* there is one: i is given */
        snprintf(cz->detail, sizeof cz->detail,
                 "%s: segment %zu (%s) given twice in one step; %zu of its %zu segments not given yet, the first "
                 "%zu (%s)",
                 api, i, dopt__seg_name(cz, i), cz->nsegs - cz->ngiven, cz->nsegs, first, dopt__seg_name(cz, first));
        return DOPT_ERR_INVALID;
    }
    cz->ngiven += k;
    if (cz->ngiven == cz->nsegs) {
        memset(cz->given, 0, cz->nsegs);
        cz->ngiven = 0;
    }
    return DOPT_OK;
}

/* ===================================================================== PUBLIC ENCODE */

/* The label of the allreduce's collectives in the communicator's details, unless the caller
   (localsgd.h) has set its own: details name the call the user made. Returns the label to put
   back. */
static const char *dopt__compress_label(dopt_comm *comm, const char *api) {
    return dopt_comm_set_api(comm, comm->api ? comm->api : api);
}

static int dopt__shares_scales(const dopt_compressor *cz) {
    return dopt__codec(&cz->cfg)->shared_scale && !cz->cfg.no_scale_sharing;
}

/* This rank's message of the view's segments of grads into out: p = g + e with error feedback
   (in the work buffer), ternary's scales (shared over `share` when it is given and sharing is
   on), the message. When p holds a NaN or ±inf, out gets the flagged message and the result is
   DOPT_ERR_NONFINITE; with scale sharing every rank has then learnt it from the allreduce and
   returns it too. The step and the residual do not change here: a call that succeeds writes
   the new residual into the work buffer (dopt__ef_update), and the step keeps it when it closes. */
static dopt_status dopt__encode_local(dopt_compressor *cz, const dopt__compress_view *v, const dopt_buf *grads,
                                      int rank, unsigned char *out, dopt_comm *share, int tern_bodies) {
    dopt_buf p = *grads;
    if (cz->ef) p = dopt__ef_prepare(cz, v, grads);
    if (dopt__codec(&cz->cfg)->shared_scale) {
        dopt__tern_scales(cz, v, &p);
        /* Step 3, scale sharing: one allreduce MAX of the scales and the non-finite flag. */
        if (share != NULL && dopt__shares_scales(cz)) {
            const char *prev = dopt__compress_label(share, "dopt_compress_allreduce: scale sharing");
            dopt_status s = dopt_allreduce(share, cz->scales, v->nsegs + 1, DOPT_F32, DOPT_MAX);
            dopt_comm_set_api(share, prev);
            if (s != DOPT_OK) return s;
        }
        if (cz->scales[v->nsegs] != 0.0f) {
            dopt__write_nonfinite(cz, v, rank, out);
            return DOPT_ERR_NONFINITE;
        }
    }
    if (!dopt__encode_message(cz, v, &p, rank, out, tern_bodies)) {
        dopt__write_nonfinite(cz, v, rank, out);
        return DOPT_ERR_NONFINITE;
    }
    return DOPT_OK;
}

DOPT_DEF size_t dopt_compress_bound(const dopt_compressor *cz) { return cz ? cz->msg_bytes : 0; }

DOPT_DEF dopt_status dopt_compress_encode(dopt_compressor *cz, const dopt_buf *grads, void *out, size_t capacity,
                                          size_t *bytes) {
    dopt_status s;
    if (cz == NULL || cz->segs == NULL || grads == NULL || out == NULL || bytes == NULL) return DOPT_ERR_INVALID;
    if (dopt__codec(&cz->cfg)->encode == NULL) return DOPT_ERR_UNSUPPORTED; /* PowerSGD: two rounds, no message */
    if (capacity < cz->msg_bytes || !dopt__segment_matches(cz, grads)) return DOPT_ERR_INVALID;
    dopt__settle(cz);
    if (cz->ngiven > 0) { /* a step in parts is under way */
        snprintf(cz->detail, sizeof cz->detail, "dopt_compress_encode: %zu of %zu segments were given to this step's "
                 "segment calls: finish the step first", cz->ngiven, cz->nsegs);
        return DOPT_ERR_INVALID;
    }
    cz->view = dopt__whole(cz);
    s = dopt__encode_local(cz, &cz->view, grads, cz->rank, (unsigned char *)out, NULL, 1);
    *bytes = cz->msg_bytes; /* the flagged message too: a peer that decodes it learns the verdict */
    if (s != DOPT_OK) return s;
    if (cz->ef) dopt__ef_update(cz, &cz->view, (const unsigned char *)out);
    dopt__step_count(cz, cz->nsegs, DOPT_OK);
    return s;
}

/* ===================================================================== POWERSGD */

/* PowerSGD (Vogels, Karimireddy, Jaggi 2019; DESIGN §5.7), per compressed matrix M (rows × cols,
   row-major) of a rank, with its residual E: M ← g + E; P = M·Q; P ← mean of P over the ranks;
   P's columns made orthonormal; Q ← Mᵀ·P; Q ← mean of Q; output M̂ = P·Qᵀ; E ← M − M̂. Q stays
   from one step to the next (the warm start: one step of subspace iteration per step). Two
   allreduces (DOPT_MEAN of f32) per step, in cz->msg: the first carries [every P | the other
   segments' values | a flag], psgd_np floats; the second [every Q | a flag], psgd_nq + 1. A flag
   is 1 on a rank that cannot go on, so its mean is not 0 on every rank alike. Everything after
   an allreduce is computed from the bytes every rank holds, by the same code in the same order:
   every rank writes the same output. */

#define DOPT__PSGD_MAX_RANK 64u
/* |x| at or above 2^64 in M, P or Q — and NaN, ±inf — stops the step (NON-FINITE GRADIENTS):
   below it every product the step makes stays far from overflowing (|P̂| <= 1, so |M̂| <=
   r·2^64·(1 + ε) and |E| < 2^71). */
#define DOPT__PSGD_LIMIT_BITS 0x5F800000u
#define DOPT__PSGD_Q_STREAM ((uint64_t)1 << 63) /* Q's first draw: stream 2^63 + segment */

/* Rows of segment i when PowerSGD compresses it, else 0: a matrix with r·(rows + cols) < count
   (the factors are smaller than the matrix) and count >= powersgd_min. */
static size_t dopt__psgd_rows(const dopt_compressor *cz, size_t i) {
    size_t rows = cz->segs[i].rows, n = cz->segs[i].count;
    if (cz->cfg.codec != DOPT_CODEC_POWERSGD || rows == 0 || n == 0 || n < cz->cfg.powersgd_min) return 0;
    return rows + n / rows <= (n - 1) / cz->cfg.powersgd_rank ? rows : 0; /* r·(rows + cols) < n, no overflow */
}

/* n numbers uniform in [−1, 1) from words first.. of rng: 24 bits each, exact as floats. */
static void dopt__psgd_uniform(const dopt_rng *rng, uint64_t first, float *out, size_t n) {
    size_t i;
    dopt_rng_uniform(rng, first, out, n);
    for (i = 0; i < n; i++) out[i] = 2.0f * out[i] - 1.0f;
}

/* The products, row-major: P = M·Q (rows × r), Q = Mᵀ·P (cols × r), M̂ = P·Qᵀ (rows × cols).
   OpenBLAS's sgemm with DOPT_USE_BLAS, plain loops otherwise; either way in float, the sums in
   an order fixed by the sizes alone. */
static void dopt__psgd_mq(const float *m, size_t rows, size_t cols, const float *q, size_t r, float *p) {
#ifdef DOPT__BLAS
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)r, (int)cols, 1.0f, m, (int)cols, q,
                (int)r, 0.0f, p, (int)r);
#else
    size_t i, j, k;
    for (i = 0; i < rows; i++) {
        const float *mi = m + i * cols;
        float *pi = p + i * r;
        for (k = 0; k < r; k++) pi[k] = 0.0f;
        for (j = 0; j < cols; j++)
            for (k = 0; k < r; k++) pi[k] += mi[j] * q[j * r + k];
    }
#endif
}

static void dopt__psgd_mtp(const float *m, size_t rows, size_t cols, const float *p, size_t r, float *q) {
#ifdef DOPT__BLAS
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)cols, (int)r, (int)rows, 1.0f, m, (int)cols, p,
                (int)r, 0.0f, q, (int)r);
#else
    size_t i, j, k;
    for (j = 0; j < cols * r; j++) q[j] = 0.0f;
    for (i = 0; i < rows; i++) {
        const float *mi = m + i * cols, *pi = p + i * r;
        for (j = 0; j < cols; j++)
            for (k = 0; k < r; k++) q[j * r + k] += mi[j] * pi[k];
    }
#endif
}

static void dopt__psgd_pqt(const float *p, size_t rows, size_t cols, const float *q, size_t r, float *out) {
#ifdef DOPT__BLAS
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)cols, (int)r, 1.0f, p, (int)r, q, (int)r,
                0.0f, out, (int)cols);
#else
    size_t i, j, k;
    for (i = 0; i < rows; i++)
        for (j = 0; j < cols; j++) {
            float acc = 0.0f; /* not p·q alone for r = 1: E = M − M̂ must not fuse with it */
            for (k = 0; k < r; k++) acc += p[i * r + k] * q[j * r + k];
            out[i * cols + j] = acc;
        }
#endif
}

/* Modified Gram–Schmidt on column j of v (columns of `rows` doubles, one after another): made
   orthogonal to columns 0 .. j−1, which are orthonormal, one at a time in that order, then
   normalised. Returns 0, leaving it unnormalised, when its norm fell to 1e-10 of what it was (or
   it was zero): it lay in their span, and normalising the rounding left would be noise. */
static int dopt__psgd_gs_column(double *v, size_t rows, size_t j) {
    double *x = v + j * rows, n0 = 0.0, n = 0.0, d;
    size_t i, k;
    for (k = 0; k < rows; k++) n0 += x[k] * x[k];
    for (i = 0; i < j; i++) {
        const double *u = v + i * rows;
        for (d = 0.0, k = 0; k < rows; k++) d += u[k] * x[k];
        for (k = 0; k < rows; k++) x[k] -= d * u[k];
    }
    for (k = 0; k < rows; k++) n += x[k] * x[k];
    if (!(n > 1e-20 * n0)) return 0; /* norms squared: 1e-10 relative; n0 = 0 too */
    n = sqrt(n);
    for (k = 0; k < rows; k++) x[k] /= n;
    return 1;
}

/* A column that Gram–Schmidt could not keep (zero, or in the span of those before it) becomes a
   random one, orthonormalised the same way: the same on every rank (seed, step and segment
   decide it), and never zero, so that Q = Mᵀ·P stays able to grow back and the warm start does
   not stall on a zero column. Uniform (−1, 1) numbers keyed by (seed, rank 0), stream
   step·2^32 + segment, words (attempt·r + j)·rows ..; the fourth failure leaves zeros (four
   random vectors within the span of j < rows columns: never in practice). */
static void dopt__psgd_replace_column(const dopt_compressor *cz, size_t seg, double *v, size_t rows, size_t j) {
    float draw[DOPT__BLOCK];
    double *x = v + j * rows;
    dopt_rng rng;
    uint64_t attempt, first;
    size_t k, take, t;
    dopt_rng_init(&rng, cz->cfg.seed, 0, (cz->step << 32) | (uint64_t)seg);
    for (attempt = 0; attempt < 4; attempt++) {
        first = (attempt * cz->cfg.powersgd_rank + j) * rows;
        for (k = 0; k < rows; k += take) {
            take = rows - k < DOPT__BLOCK ? rows - k : DOPT__BLOCK;
            dopt__psgd_uniform(&rng, first + k, draw, take);
            for (t = 0; t < take; t++) x[k + t] = (double)draw[t];
        }
        if (dopt__psgd_gs_column(v, rows, j)) return;
    }
    memset(x, 0, rows * sizeof(double));
}

/* P (rows × r, row-major, the mean every rank holds) gets orthonormal columns, computed in
   double in plain C (no threaded library: the order of every sum is fixed), columns in the order
   0, 1, ..., r−1. */
static void dopt__psgd_orthonormalize(const dopt_compressor *cz, size_t seg, float *p, size_t rows) {
    size_t r = cz->cfg.powersgd_rank, i, j;
    double *v = cz->psgd_gs;
    for (i = 0; i < rows; i++)
        for (j = 0; j < r; j++) v[j * rows + i] = (double)p[i * r + j];
    for (j = 0; j < r; j++)
        if (!dopt__psgd_gs_column(v, rows, j)) dopt__psgd_replace_column(cz, seg, v, rows, j);
    for (i = 0; i < rows; i++)
        for (j = 0; j < r; j++) p[i * r + j] = (float)v[j * rows + i];
}

/* The floats of the view's two allreduces: np (every P, the other segments' M, a flag) and nq
   (every Q; the second allreduce adds a flag). */
static void dopt__psgd_sizes(const dopt_compressor *cz, const dopt__compress_view *v, size_t *np, size_t *nq) {
    size_t r = cz->cfg.powersgd_rank, j, rows;
    *np = 1, *nq = 0;
    for (j = 0; j < v->nsegs; j++) {
        rows = dopt__psgd_rows(cz, v->index[j]);
        if (rows == 0) {
            *np += dopt__vcount(cz, v, j);
        } else {
            *np += rows * r;
            *nq += dopt__vcount(cz, v, j) / rows * r;
        }
    }
}

/* Where segment i's Q starts in psgd_q (and its new one in psgd_qnext). */
static size_t dopt__psgd_qoff(const dopt_compressor *cz, size_t i) { return cz->offs[cz->nsegs + i]; }

/* The first allreduce's buffer (np floats): every compressed matrix's P = M·Q and the other
   segments' M, in the view's order, M = g + e in the work buffer. 0 when a rank cannot go on
   (NaN or ±inf anywhere, |x| >= 2^64 in a compressed matrix or its P): the buffer is then
   zeros. */
static int dopt__psgd_first(dopt_compressor *cz, const dopt__compress_view *v, float *a, size_t np) {
    size_t r = cz->cfg.powersgd_rank, j, i, n, rows, cols;
    float *out = a;
    for (j = 0; j < v->nsegs; j++) {
        const float *m;
        i = v->index[j];
        n = cz->segs[i].count;
        m = cz->work + cz->offs[i];
        rows = dopt__psgd_rows(cz, i);
        if (rows == 0) {
            if (dopt__absbits_max(m, n) > DOPT__F32_MAX_BITS) break;
            if (n) memcpy(out, m, n * sizeof(float));
            out += n;
            continue;
        }
        cols = n / rows;
        if (dopt__absbits_max(m, n) >= DOPT__PSGD_LIMIT_BITS) break;
        dopt__psgd_mq(m, rows, cols, cz->psgd_q + dopt__psgd_qoff(cz, i), r, out);
        if (dopt__absbits_max(out, rows * r) >= DOPT__PSGD_LIMIT_BITS) break;
        out += rows * r;
    }
    if (j == v->nsegs) return 1;
    memset(a, 0, np * sizeof(float));
    return 0;
}

/* After the first allreduce: each mean P (in a) orthonormalised in place, and the second
   allreduce's buffer b (nq floats): every compressed matrix's Q = Mᵀ·P. 0 when a Q holds
   |x| >= 2^64 (or NaN, ±inf): b is then zeros. */
static int dopt__psgd_second(dopt_compressor *cz, const dopt__compress_view *v, float *a, float *b, size_t nq) {
    size_t r = cz->cfg.powersgd_rank, j, i, n, rows, cols;
    float *q = b;
    for (j = 0; j < v->nsegs; j++) {
        i = v->index[j];
        n = cz->segs[i].count;
        rows = dopt__psgd_rows(cz, i);
        if (rows == 0) {
            a += n;
            continue;
        }
        cols = n / rows;
        dopt__psgd_orthonormalize(cz, i, a, rows);
        dopt__psgd_mtp(cz->work + cz->offs[i], rows, cols, a, r, q);
        if (dopt__absbits_max(q, cols * r) >= DOPT__PSGD_LIMIT_BITS) {
            memset(b, 0, nq * sizeof(float));
            return 0;
        }
        a += rows * r;
        q += cols * r;
    }
    return 1;
}

/* The view's segments are done on every rank: grads gets M̂ = P·Qᵀ (compressed matrices) or the
   mean (the others); the work buffer E = M − M̂ (0 for the others, sent exactly) and psgd_qnext
   the new Q, which become the state when the step closes. */
static void dopt__psgd_commit(dopt_compressor *cz, const dopt__compress_view *v, const float *a, const float *b,
                              const dopt_buf *grads) {
    size_t r = cz->cfg.powersgd_rank, j, i, k, rows, cols;
    for (j = 0; j < v->nsegs; j++) {
        dopt_span sp;
        float *m;
        i = v->index[j];
        sp = dopt_buf_segment(grads, i);
        m = cz->work + cz->offs[i];
        rows = dopt__psgd_rows(cz, i);
        if (rows == 0) {
            if (sp.count) memcpy(sp.ptr, a, sp.count * sizeof(float));
            if (sp.count) memset(m, 0, sp.count * sizeof(float));
            a += sp.count;
            continue;
        }
        cols = sp.count / rows;
        dopt__psgd_pqt(a, rows, cols, b, r, sp.ptr);
        for (k = 0; k < sp.count; k++) m[k] = m[k] - sp.ptr[k];
        memcpy(cz->psgd_qnext + dopt__psgd_qoff(cz, i), b, cols * r * sizeof(float));
        a += rows * r;
        b += cols * r;
    }
}

static dopt_status dopt__psgd_allreduce(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads) {
    const dopt__compress_view *v = &cz->view;
    float *a = (float *)(void *)cz->msg, *b;
    size_t np, nq;
    const char *prev;
    dopt_status s;
    cz->gathered = 0;
    cz->rank = comm->rank;
    dopt__psgd_sizes(cz, v, &np, &nq);
    b = a + np;
    dopt__ef_prepare(cz, v, grads); /* M = g + e, the view's segments, into the work buffer */
    a[np - 1] = dopt__psgd_first(cz, v, a, np) ? 0.0f : 1.0f;
    prev = dopt__compress_label(comm, "dopt_compress_allreduce: PowerSGD's P");
    s = dopt_allreduce(comm, a, np, DOPT_F32, DOPT_MEAN);
    dopt_comm_set_api(comm, prev);
    if (s != DOPT_OK) return s;
    if (a[np - 1] != 0.0f) return DOPT_ERR_NONFINITE;
    b[nq] = dopt__psgd_second(cz, v, a, b, nq) ? 0.0f : 1.0f;
    prev = dopt__compress_label(comm, "dopt_compress_allreduce: PowerSGD's Q");
    s = dopt_allreduce(comm, b, nq + 1, DOPT_F32, DOPT_MEAN);
    dopt_comm_set_api(comm, prev);
    if (s != DOPT_OK) return s;
    if (b[nq] != 0.0f) return DOPT_ERR_NONFINITE;
    dopt__psgd_commit(cz, v, a, b, grads);
    return DOPT_OK;
}

/* At init: the sizes of the two allreduces, the Gram–Schmidt workspace, and every compressed
   matrix's first Q, uniform in (−1, 1) from (seed, rank 0): the same on every rank. A
   compressed matrix must have rows and cols below 2^31 (sgemm takes int). */
static dopt_status dopt__psgd_init(dopt_compressor *cz) {
    size_t r = cz->cfg.powersgd_rank, i, rows, cols, tallest = 0, nq = 0;
    float *q;
    dopt_rng rng;
    cz->psgd_np = 1;
    for (i = 0; i < cz->nsegs; i++) {
        rows = dopt__psgd_rows(cz, i);
        if (rows == 0) {
            cz->psgd_np += cz->segs[i].count;
            continue;
        }
        cols = cz->segs[i].count / rows;
        if (rows > INT_MAX || cols > INT_MAX) return DOPT_ERR_INVALID;
        cz->psgd_np += rows * r;
        cz->offs[cz->nsegs + i] = nq;
        nq += cols * r;
        tallest = rows > tallest ? rows : tallest;
        cz->psgd_nmat++;
    }
    cz->psgd_nq = nq;
    cz->psgd_q = (float *)DOPT_MALLOC((nq ? nq : 1) * sizeof(float));
    cz->psgd_qnext = (float *)DOPT_MALLOC((nq ? nq : 1) * sizeof(float));
    cz->psgd_gs = (double *)DOPT_MALLOC((tallest ? tallest * r : 1) * sizeof(double));
    if (cz->psgd_q == NULL || cz->psgd_qnext == NULL || cz->psgd_gs == NULL) return DOPT_ERR_NOMEM;
    for (q = cz->psgd_q, i = 0; i < cz->nsegs; i++) {
        rows = dopt__psgd_rows(cz, i);
        if (rows == 0) continue;
        cols = cz->segs[i].count / rows;
        dopt_rng_init(&rng, cz->cfg.seed, 0, DOPT__PSGD_Q_STREAM | (uint64_t)i);
        dopt__psgd_uniform(&rng, 0, q, cols * r);
        q += cols * r;
    }
    return DOPT_OK;
}

/* PowerSGD's part of the state, after the residual: u32 r, u32 compressed matrices, a 16-byte
   record per matrix (u32 segment, u32 0, u64 rows), then every Q (cols × r f32). */
static size_t dopt__psgd_state_bytes(const dopt_compressor *cz) {
    return cz->cfg.codec == DOPT_CODEC_POWERSGD ? 8 + 16 * cz->psgd_nmat + 4 * cz->psgd_nq : 0;
}

static void dopt__psgd_state_save(const dopt_compressor *cz, unsigned char *o) {
    size_t i;
    dopt__put_le32(o, (uint32_t)cz->cfg.powersgd_rank);
    dopt__put_le32(o + 4, (uint32_t)cz->psgd_nmat);
    o += 8;
    for (i = 0; i < cz->nsegs; i++) {
        size_t rows = dopt__psgd_rows(cz, i);
        if (rows == 0) continue;
        dopt__put_le32(o, (uint32_t)i);
        dopt__put_le32(o + 4, 0);
        dopt__put_le64(o + 8, (uint64_t)rows);
        o += 16;
    }
    if (cz->psgd_nq) memcpy(o, cz->psgd_q, 4 * cz->psgd_nq);
}

/* 1 when p holds this compressor's PowerSGD part: its r, its compressed matrices, finite Q's. */
static int dopt__psgd_state_ok(const dopt_compressor *cz, const unsigned char *p) {
    size_t i;
    if (dopt__get_le32(p) != (uint32_t)cz->cfg.powersgd_rank || dopt__get_le32(p + 4) != (uint32_t)cz->psgd_nmat)
        return 0;
    p += 8;
    for (i = 0; i < cz->nsegs; i++) {
        size_t rows = dopt__psgd_rows(cz, i);
        if (rows == 0) continue;
        if (dopt__get_le32(p) != (uint32_t)i || dopt__get_le32(p + 4) != 0 || dopt__get_le64(p + 8) != (uint64_t)rows)
            return 0;
        p += 16;
    }
    return dopt__f32_bytes_finite(p, cz->psgd_nq);
}

static void dopt__psgd_state_load(dopt_compressor *cz, const unsigned char *p) {
    if (cz->psgd_nq) memcpy(cz->psgd_q, p + 8 + 16 * cz->psgd_nmat, 4 * cz->psgd_nq);
}

/* ===================================================================== STATE SAVE / LOAD */

#define DOPT__STATE_MAGIC 0x53504F44u /* "DOPS" */
#define DOPT__STATE_VERSION 1 /* its own number: the state's format did not change with the wire's */
#define DOPT__STATE_HEADER 32

DOPT_DEF size_t dopt_compress_state_bytes(const dopt_compressor *cz) {
    if (cz == NULL) return 0;
    return DOPT__STATE_HEADER + (cz->ef ? 4 * cz->count : 0) + dopt__psgd_state_bytes(cz);
}

DOPT_DEF dopt_status dopt_compress_state_save(const dopt_compressor *cz, void *out, size_t capacity) {
    unsigned char *o = (unsigned char *)out;
    if (cz == NULL || out == NULL || capacity < dopt_compress_state_bytes(cz)) return DOPT_ERR_INVALID;
    dopt__settle(cz);
    memset(o, 0, DOPT__STATE_HEADER);
    dopt__put_le32(o, DOPT__STATE_MAGIC);
    o[4] = DOPT__STATE_VERSION;
    o[5] = (unsigned char)cz->cfg.codec;
    o[6] = (unsigned char)cz->ef;
    dopt__put_le64(o + 8, (uint64_t)cz->count);
    dopt__put_le64(o + 16, cz->step);
    if (cz->ef && cz->count) memcpy(o + DOPT__STATE_HEADER, cz->residual, 4 * cz->count);
    if (cz->cfg.codec == DOPT_CODEC_POWERSGD) dopt__psgd_state_save(cz, o + DOPT__STATE_HEADER + 4 * cz->count);
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_compress_state_load(dopt_compressor *cz, const void *in, size_t bytes) {
    const unsigned char *p = (const unsigned char *)in;
    if (cz == NULL || (in == NULL && bytes > 0)) return DOPT_ERR_INVALID;
    dopt__settle(cz);
    if (cz->ngiven || cz->nfinished) { /* the step's close would write over what is loaded */
        snprintf(cz->detail, sizeof cz->detail,
                 "dopt_compress_state_load: %zu of the %zu segments of a step in parts were given: finish the step "
                 "first", cz->ngiven, cz->nsegs);
        return DOPT_ERR_INVALID;
    }
    if (bytes != dopt_compress_state_bytes(cz) || dopt__get_le32(p) != DOPT__STATE_MAGIC ||
        p[4] != DOPT__STATE_VERSION || p[5] != (unsigned char)cz->cfg.codec || p[6] != (unsigned char)cz->ef ||
        p[7] != 0 || dopt__get_le64(p + 8) != (uint64_t)cz->count || !dopt__zero_bytes(p + 24, 8))
        return DOPT_ERR_PROTOCOL;
    if (cz->cfg.codec == DOPT_CODEC_POWERSGD && !dopt__psgd_state_ok(cz, p + DOPT__STATE_HEADER + 4 * cz->count))
        return DOPT_ERR_PROTOCOL;
    if (cz->ef && cz->count) {
        if (!dopt__f32_bytes_finite(p + DOPT__STATE_HEADER, cz->count)) return DOPT_ERR_PROTOCOL;
        memcpy(cz->residual, p + DOPT__STATE_HEADER, 4 * cz->count);
    }
    if (cz->cfg.codec == DOPT_CODEC_POWERSGD) dopt__psgd_state_load(cz, p + DOPT__STATE_HEADER + 4 * cz->count);
    cz->step = dopt__get_le64(p + 16);
    return DOPT_OK;
}

/* ===================================================================== INIT AND FREE */

DOPT_DEF const char *dopt_codec_name(dopt_codec codec) {
    return (unsigned)codec < sizeof dopt__codecs / sizeof dopt__codecs[0] ? dopt__codecs[codec].name : "?";
}

#define DOPT__RING_MAX_BUCKETS 64 /* ring_buckets, at most (the ring's pipeline) */

static dopt_status dopt__config_resolve(dopt_compressor_config *c) {
    if ((unsigned)c->codec > (unsigned)DOPT_CODEC_POWERSGD || (unsigned)c->error_feedback > (unsigned)DOPT_EF_OFF ||
        (unsigned)c->aggregate > (unsigned)DOPT_AGG_RING || (unsigned)c->majority_l1 > 1u)
        return DOPT_ERR_INVALID;
    /* NaN first, by its bits: under -ffast-math GCC compiles x == 0 so that it holds for NaN, which
       would then take the default */
    if (dopt__is_nan(c->clip_c) || dopt__is_nan(c->topk_ratio)) return DOPT_ERR_INVALID;
    if (c->clip_c == 0.0f) c->clip_c = 2.5f;
    if (!dopt__is_finite(c->clip_c) && c->clip_c > 0.0f) return DOPT_ERR_INVALID;
    if (c->clip_c < 0.0f) c->clip_c = DOPT_CLIP_OFF;
    if (c->qsgd_levels == 0) c->qsgd_levels = 7;
    if (c->qsgd_levels > 127) return DOPT_ERR_INVALID;
    if (c->qsgd_bucket == 0) c->qsgd_bucket = 512;
    if (c->qsgd_bucket > UINT32_MAX) return DOPT_ERR_INVALID;
    if (c->topk_ratio == 0.0) c->topk_ratio = 0.01;
    if (!(c->topk_ratio > 0.0 && c->topk_ratio <= 1.0)) return DOPT_ERR_INVALID;
    if (c->rank < 0) return DOPT_ERR_INVALID;
    if (c->powersgd_rank == 0) c->powersgd_rank = 2;
    if (c->powersgd_rank > DOPT__PSGD_MAX_RANK) return DOPT_ERR_INVALID;
    if (c->powersgd_min == 0) c->powersgd_min = 4096;
    if (c->ring_buckets < 0 || c->ring_buckets > DOPT__RING_MAX_BUCKETS) return DOPT_ERR_INVALID;
    /* PowerSGD without its error feedback does not converge well (Vogels et al. 2019, §4.1) */
    if (dopt__codec(c)->ef == DOPT__EF_REQUIRED && c->error_feedback == DOPT_EF_OFF) return DOPT_ERR_INVALID;
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_compressor_init(dopt_compressor *cz, const dopt_compressor_config *cfg,
                                          const dopt_segment *segs, size_t nsegs) {
    dopt_compressor_config c;
    size_t i, max_seg = 0, count = 0, end = 0, table, off;
    if (cz == NULL) return DOPT_ERR_INVALID;
    memset(cz, 0, sizeof *cz);
    if (segs == NULL || nsegs == 0 || nsegs > UINT32_MAX) return DOPT_ERR_INVALID;
    if (cfg)
        c = *cfg;
    else
        memset(&c, 0, sizeof c);
    if (dopt__config_resolve(&c) != DOPT_OK) return DOPT_ERR_INVALID;
    for (i = 0; i < nsegs; i++) { /* increasing, non-overlapping, no overflow */
        if (segs[i].offset < end || segs[i].count > SIZE_MAX - segs[i].offset) return DOPT_ERR_INVALID;
        end = segs[i].offset + segs[i].count;
        count += segs[i].count;
        max_seg = segs[i].count > max_seg ? segs[i].count : max_seg;
        if (dopt__codec(&c)->u32_index && segs[i].count > UINT32_MAX) return DOPT_ERR_INVALID;
        if (c.codec == DOPT_CODEC_POWERSGD && segs[i].rows != 0 && segs[i].count % segs[i].rows != 0)
            return DOPT_ERR_INVALID; /* not rows × cols (other codecs never read rows) */
    }
    if (count > SIZE_MAX / 8) return DOPT_ERR_INVALID;
    cz->cfg = c;
    cz->rank = c.rank;
    cz->nsegs = nsegs;
    cz->count = count;
    cz->flat_end = end;
    cz->ef = c.error_feedback == DOPT_EF_ON || (c.error_feedback == DOPT_EF_AUTO && dopt__codec(&c)->ef != DOPT__EF_DEFAULT_OFF);
    /* the segment table and, after it, the spans of the EF work buffer, the whole table's view,
       a segment call's indices, the offsets (elements, then PowerSGD's Q's), the given flags */
    table = nsegs * (sizeof(dopt_segment) + sizeof(dopt_span) + 4 * sizeof(size_t) + 1);
    cz->segs = (dopt_segment *)DOPT_MALLOC(table);
    if (cz->segs == NULL) return DOPT_ERR_NOMEM;
    memset(cz->segs, 0, table);
    memcpy(cz->segs, segs, nsegs * sizeof(dopt_segment));
    cz->all = (size_t *)(void *)(dopt__spans(cz) + nsegs);
    cz->part = cz->all + nsegs;
    cz->offs = cz->part + nsegs;
    cz->given = (unsigned char *)(void *)(cz->offs + 2 * nsegs);
    for (i = 0, off = 0; i < nsegs; i++) {
        cz->all[i] = i;
        cz->offs[i] = off;
        off += segs[i].count;
    }
    if (c.codec == DOPT_CODEC_POWERSGD) {
        dopt_status s = dopt__psgd_init(cz);
        if (s != DOPT_OK) {
            dopt_compressor_free(cz);
            return s;
        }
    }
    cz->msg_bytes = c.codec == DOPT_CODEC_POWERSGD ? 4 * (cz->psgd_np + cz->psgd_nq + 1) /* its two allreduces */
                                                   : dopt__message_bytes(cz, cz->all, nsegs);
    cz->view = dopt__whole(cz);
    cz->msg = (unsigned char *)DOPT_MALLOC(cz->msg_bytes);
    cz->scales = (float *)DOPT_MALLOC((2 * nsegs + 1) * sizeof(float));
    if (cz->msg == NULL || cz->scales == NULL) goto nomem;
    cz->bounds = cz->scales + nsegs + 1;
    for (i = 0; i < nsegs; i++) cz->bounds[i] = FLT_MAX;
    if (dopt__codec(&c)->u32_index) {
        cz->select = (float *)DOPT_MALLOC((max_seg ? max_seg : 1) * sizeof(float));
        if (cz->select == NULL) goto nomem;
    }
    if (cz->ef) {
        cz->residual = (float *)DOPT_MALLOC((count ? count : 1) * sizeof(float));
        cz->work = (float *)DOPT_MALLOC((count ? count : 1) * sizeof(float));
        if (cz->residual == NULL || cz->work == NULL) goto nomem;
        if (count) memset(cz->residual, 0, count * sizeof(float));
    }
    return DOPT_OK;
nomem:
    dopt_compressor_free(cz);
    return DOPT_ERR_NOMEM;
}

DOPT_DEF void dopt_compressor_free(dopt_compressor *cz) {
    if (cz == NULL) return;
    dopt__worker_free(cz->worker); /* runs what is queued first */
    DOPT_FREE(cz->jobs);
    DOPT_FREE(cz->job_segs);
    DOPT_FREE(cz->psgd_qnext);
    DOPT_FREE(cz->segs);
    DOPT_FREE(cz->msg);
    DOPT_FREE(cz->scales);
    DOPT_FREE(cz->select);
    DOPT_FREE(cz->residual);
    DOPT_FREE(cz->work);
    DOPT_FREE(cz->gather);
    DOPT_FREE(cz->ring_buf);
    DOPT_FREE(cz->ring_ranks);
    DOPT_FREE(cz->psgd_q);
    DOPT_FREE(cz->psgd_gs);
    memset(cz, 0, sizeof *cz);
}

/* =====================================================================================
   PART 2 OF 3 — HOW THEY TRAVEL: the integer and 16-bit rings (their kernels, the schedule of
   exchanges, the pipeline that encodes ternary's codes while the ring sums the buckets before
   them) and the ring path of the allreduce from one rank's message to the result.
   ===================================================================================== */

/* ===================================================================== THE RINGS: INTEGER SUMS, 16-BIT MEANS

   With one shared scale per segment, the sum of the N ranks' ternary codes is an integer in
   [-N, N]. The ring reduces it exactly: a chunk that carries the sums of k codes goes in
   w(k) = ceil(log2(2k + 1)) bits per element, then the final sums go round once more in w(N)
   bits. Integers add exactly, so the result does not depend on the schedule: flat or by host,
   every rank gets the sums the allgather path computes, and the same floats from them.

   Elements are taken in groups of 64, each segment's padded with zeros to whole groups (a
   segment's codes sit in 64-element blocks in the message too). A group of sums biased by K
   (v = S + K in [0, 2K]) is stored, and travels, as w little-endian 64-bit words ("planes"), word
   j holding bit j of the 64 values (bit t for element t): 8·w bytes per group. Each step of a
   reduce-scatter folds what it receives into this rank's own contribution, plane array to plane
   array, in registers. */

#define DOPT__RING_PIECE_GROUPS 4096 /* groups per exchange (256 Ki elements), at most */
#define DOPT__RING_DEPTH 2           /* exchanges in flight */
#define DOPT__RING_MAX_RANKS 16383   /* 2N + 1 values in the 16-bit lanes of the kernels */
#define DOPT__RING_MAX_HALF_RANKS 8191 /* fp16 means: 11 significant bits times a count below 2^13, exact */

static unsigned dopt__ring_width(uint64_t k) {
    unsigned w = 0;
    while (((uint64_t)1 << w) < 2 * k + 1) w++;
    return w;
}

static size_t dopt__ring_groups(size_t n) { return (n + DOPT__BLOCK - 1) / DOPT__BLOCK; }

/* Segment i goes through the ring (all but ternary's segments sent as fp32). */
static int dopt__ring_carries(const dopt_compressor *cz, size_t i) {
    return !dopt__codec(&cz->cfg)->shared_scale || cz->segs[i].count >= cz->cfg.fp32_below;
}

/* Groups [g0, ...) at p: integer sums biased by K in w planes, or (fmt F16, BF16; w = 16) the
   means of K contributions. */
typedef struct dopt__planes {
    unsigned char *p;
    size_t g0;
    unsigned w;
    int K;
    int fmt;
} dopt__planes;

/* The width of K contributions in format fmt. */
static unsigned dopt__ring_bits(int fmt, int K) { return fmt == DOPT__RING_INT ? dopt__ring_width((uint64_t)K) : 16u; }

static unsigned char *dopt__planes_at(const dopt__planes *a, size_t g) { return a->p + (g - a->g0) * 8 * a->w; }

/* ----- kernels: portable, then AVX-512 (the tests compare them bit for bit) */

/* 64 values of a group out of its planes, and back. */
static void dopt__ring_unpack(const unsigned char *DOPT_RESTRICT in, unsigned w, uint16_t *DOPT_RESTRICT v) {
    unsigned j, t;
    for (t = 0; t < DOPT__BLOCK; t++) v[t] = 0;
    for (j = 0; j < w; j++) {
        uint64_t word;
        memcpy(&word, in + 8 * j, 8);
        for (t = 0; t < DOPT__BLOCK; t++) v[t] = (uint16_t)(v[t] | ((word >> t) & 1u) << j);
    }
}

static void dopt__ring_pack(const uint16_t *DOPT_RESTRICT v, unsigned w, unsigned char *DOPT_RESTRICT out) {
    unsigned j, t;
    for (j = 0; j < w; j++) {
        uint64_t word = 0;
        for (t = 0; t < DOPT__BLOCK; t++) word |= (uint64_t)((v[t] >> j) & 1u) << t;
        memcpy(out + 8 * j, &word, 8);
    }
}

/* This rank's codes of a segment (a message body of n ternary elements) as planes of sums of
   one: w = 2, K = 1 (v = t + 1). A full block's element 16i + j is at byte j, bits 2i. */
DOPT__MAYBE_UNUSED static void dopt__ring_own_portable(const uint8_t *DOPT_RESTRICT in, size_t n,
                                                      unsigned char *DOPT_RESTRICT out) {
    size_t i, t;
    for (i = 0; i < n; i += DOPT__BLOCK, in += 16, out += 16) {
        size_t m = n - i < DOPT__BLOCK ? n - i : DOPT__BLOCK, q = (m + 3) / 4;
        uint16_t v[DOPT__BLOCK];
        for (t = 0; t < DOPT__BLOCK; t++) {
            unsigned code = t < m ? (in[t % q] >> (2 * (t / q))) & 3u : 0u;
            v[t] = (uint16_t)(1 + (int)(code & 1u) - (int)(code >> 1));
        }
        dopt__ring_pack(v, 2, out);
    }
}

/* out = a + b re-biased, group by group: (va - Ka) + (vb - Kb) + Ko in wo planes. a is what a
   peer sent: returns non-zero when one of its values exceeds 2·Ka. */
DOPT__MAYBE_UNUSED static unsigned dopt__ring_fold_portable(const dopt__planes *a, const dopt__planes *b,
                                                           const dopt__planes *o, size_t g, size_t groups) {
    unsigned bad = 0, t;
    size_t k;
    for (k = 0; k < groups; k++) {
        uint16_t va[DOPT__BLOCK], vb[DOPT__BLOCK];
        dopt__ring_unpack(dopt__planes_at(a, g + k), a->w, va);
        dopt__ring_unpack(dopt__planes_at(b, g + k), b->w, vb);
        for (t = 0; t < DOPT__BLOCK; t++) {
            bad |= va[t] > 2 * a->K;
            va[t] = (uint16_t)(va[t] + vb[t] - a->K - b->K + o->K);
        }
        dopt__ring_pack(va, o->w, dopt__planes_at(o, g + k));
    }
    return bad;
}

/* The first n elements of the groups at in, S = v - K: y = (float)S · scale, or with vote
   (majority) y = ±scale by the sign of S, 0 where S = 0 (a tie). */
DOPT__MAYBE_UNUSED static void dopt__ring_decode_portable(float *DOPT_RESTRICT y, size_t n, int K, unsigned w, float scale,
                                                         int vote, const unsigned char *DOPT_RESTRICT in) {
    size_t i, t;
    for (i = 0; i < n; i += DOPT__BLOCK, in += 8 * w) {
        uint16_t v[DOPT__BLOCK];
        size_t m = n - i < DOPT__BLOCK ? n - i : DOPT__BLOCK;
        dopt__ring_unpack(in, w, v);
        for (t = 0; t < m; t++)
            y[i + t] = vote ? (v[t] > K ? scale : v[t] < K ? -scale : 0.0f) : (float)((int)v[t] - K) * scale;
    }
}

#ifdef DOPT__COMPRESS_AVX512
/* A group's values as two vectors of 32 16-bit lanes (elements 0-31, 32-63). */
static void dopt__ring_unpack_avx512(const unsigned char *in, unsigned w, __m512i *lo, __m512i *hi) {
    unsigned j;
    *lo = *hi = _mm512_setzero_si512();
    for (j = 0; j < w; j++) {
        __m512i bit = _mm512_set1_epi16((short)(1 << j));
        uint64_t word;
        memcpy(&word, in + 8 * j, 8);
        *lo = _mm512_or_si512(*lo, _mm512_maskz_mov_epi16((__mmask32)word, bit));
        *hi = _mm512_or_si512(*hi, _mm512_maskz_mov_epi16((__mmask32)(word >> 32), bit));
    }
}

static void dopt__ring_pack_avx512(__m512i lo, __m512i hi, unsigned w, unsigned char *out) {
    unsigned j;
    for (j = 0; j < w; j++) {
        __m512i bit = _mm512_set1_epi16((short)(1 << j));
        uint64_t word = (uint64_t)_mm512_test_epi16_mask(lo, bit) | (uint64_t)_mm512_test_epi16_mask(hi, bit) << 32;
        memcpy(out + 8 * j, &word, 8);
    }
}

/* The 16 bytes of a full block broadcast to the four 128-bit lanes, lane q shifted by 2q bits:
   byte j of lane q holds the code of element 16q + j, and a compare per plane gives its word. */
static void dopt__ring_own_avx512(const uint8_t *in, size_t n, unsigned char *out) {
    const __m512i shifts = _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6), three = _mm512_set1_epi8(3);
    const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi8(1);
    size_t full = n - n % DOPT__BLOCK, i;
    for (i = 0; i < full; i += DOPT__BLOCK, in += 16, out += 16) {
        __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)in));
        __m512i c = _mm512_and_si512(_mm512_srlv_epi64(b, shifts), three);
        uint64_t w0 = _mm512_cmpeq_epi8_mask(c, zero), w1 = _mm512_cmpeq_epi8_mask(c, one); /* v = 1, v = 2 */
        memcpy(out, &w0, 8);
        memcpy(out + 8, &w1, 8);
    }
    if (n > full) dopt__ring_own_portable(in, n - full, out);
}

static unsigned dopt__ring_fold_avx512(const dopt__planes *a, const dopt__planes *b, const dopt__planes *o, size_t g,
                                       size_t groups) {
    const __m512i top = _mm512_set1_epi16((short)(2 * a->K)), bias = _mm512_set1_epi16((short)(o->K - a->K - b->K));
    __mmask32 bad = 0;
    size_t k;
    for (k = 0; k < groups; k++) {
        __m512i alo, ahi, blo, bhi;
        dopt__ring_unpack_avx512(dopt__planes_at(a, g + k), a->w, &alo, &ahi);
        dopt__ring_unpack_avx512(dopt__planes_at(b, g + k), b->w, &blo, &bhi);
        bad |= _mm512_cmpgt_epi16_mask(alo, top) | _mm512_cmpgt_epi16_mask(ahi, top);
        dopt__ring_pack_avx512(_mm512_add_epi16(_mm512_add_epi16(alo, blo), bias),
                               _mm512_add_epi16(_mm512_add_epi16(ahi, bhi), bias), o->w, dopt__planes_at(o, g + k));
    }
    return bad != 0;
}

static void dopt__ring_decode_avx512(float *DOPT_RESTRICT y, size_t n, int K, unsigned w, float scale, int vote,
                                     const unsigned char *DOPT_RESTRICT in) {
    const __m512i bias = _mm512_set1_epi16((short)K);
    const __m512 vv = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
    size_t i;
    for (i = 0; i < n; i += DOPT__BLOCK, in += 8 * w) {
        __m512i v[2];
        int h, q;
        dopt__ring_unpack_avx512(in, w, &v[0], &v[1]);
        for (h = 0; h < 2; h++) {
            __m512i s = _mm512_sub_epi16(v[h], bias);
            uint32_t gt = _mm512_cmpgt_epi16_mask(v[h], bias), lt = _mm512_cmplt_epi16_mask(v[h], bias);
            for (q = 0; q < 2; q++) {
                size_t at = i + (size_t)(32 * h + 16 * q);
                __m256i half = q ? _mm512_extracti64x4_epi64(s, 1) : _mm512_castsi512_si256(s);
                __m512 f = vote ? _mm512_mask_mov_ps(_mm512_maskz_mov_ps((__mmask16)(gt >> 16 * q), vv),
                                                     (__mmask16)(lt >> 16 * q), neg)
                                : _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(half)), vv);
                if (at + 16 <= n)
                    _mm512_storeu_ps(y + at, f);
                else if (at < n)
                    _mm512_mask_storeu_ps(y + at, (__mmask16)((1u << (n - at)) - 1u), f);
            }
        }
    }
}
#endif

static void dopt__ring_own(const uint8_t *in, size_t n, unsigned char *out) {
#ifdef DOPT__COMPRESS_AVX512
    dopt__ring_own_avx512(in, n, out);
#else
    dopt__ring_own_portable(in, n, out);
#endif
}

/* The means of a (Ka contributions) and b (Kb) into o: (a·Ka + b·Kb) / (Ka + Kb) in fp32,
   rounded to 16 bits. The products are exact (11 or 8 significant bits times K < 2^13), so
   whether the compiler fuses the multiply-add does not change a bit. A group at a time through
   local arrays (fixed trip counts: the conversions vectorize). Returns non-zero when a holds a
   NaN or an infinity. */
static unsigned dopt__ring_fold_half(const dopt__planes *a, const dopt__planes *b, const dopt__planes *o, size_t g,
                                     size_t groups) {
    const float ka = (float)a->K, kb = (float)b->K, ko = (float)o->K;
    const int f16 = a->fmt == DOPT__RING_F16;
    const uint16_t inf = f16 ? DOPT__F16_INF : DOPT__BF16_INF;
    uint16_t top = 0;
    size_t k;
    int t;
    for (k = 0; k < groups; k++) {
        uint16_t ha[DOPT__BLOCK], hb[DOPT__BLOCK];
        float x[DOPT__BLOCK], y[DOPT__BLOCK];
        memcpy(ha, dopt__planes_at(a, g + k), sizeof ha);
        memcpy(hb, dopt__planes_at(b, g + k), sizeof hb);
        for (t = 0; t < DOPT__BLOCK; t++) top = (uint16_t)((ha[t] & DOPT__HALF_ABS) > top ? (ha[t] & DOPT__HALF_ABS) : top);
#ifdef DOPT__COMPRESS_AVX512
        if (f16) {
            for (t = 0; t < DOPT__BLOCK; t += 16) {
                __m512 va = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(ha + t)));
                __m512 vb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(hb + t)));
                __m512 v = _mm512_div_ps(_mm512_add_ps(_mm512_mul_ps(va, _mm512_set1_ps(ka)), _mm512_mul_ps(vb, _mm512_set1_ps(kb))),
                                         _mm512_set1_ps(ko));
                _mm256_storeu_si256((__m256i *)(void *)(ha + t), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
            memcpy(dopt__planes_at(o, g + k), ha, sizeof ha);
            continue;
        }
#endif
        for (t = 0; t < DOPT__BLOCK; t++) {
            x[t] = (f16 ? dopt__f16_to_f32(ha[t]) : dopt__bf16_to_f32(ha[t])) * ka;
            y[t] = (f16 ? dopt__f16_to_f32(hb[t]) : dopt__bf16_to_f32(hb[t])) * kb;
        }
        for (t = 0; t < DOPT__BLOCK; t++) x[t] = (x[t] + y[t]) / ko;
        for (t = 0; t < DOPT__BLOCK; t++) ha[t] = f16 ? dopt__f32_to_f16(x[t]) : dopt__f32_to_bf16(x[t]);
        memcpy(dopt__planes_at(o, g + k), ha, sizeof ha);
    }
    return top >= inf;
}

static unsigned dopt__ring_fold(const dopt__planes *a, const dopt__planes *b, const dopt__planes *o, size_t g,
                                size_t groups) {
    if (a->fmt != DOPT__RING_INT) return dopt__ring_fold_half(a, b, o, g, groups);
#ifdef DOPT__COMPRESS_AVX512
    return dopt__ring_fold_avx512(a, b, o, g, groups);
#else
    return dopt__ring_fold_portable(a, b, o, g, groups);
#endif
}

static void dopt__ring_decode(float *y, size_t n, int K, unsigned w, float scale, int vote, const unsigned char *in) {
#ifdef DOPT__COMPRESS_AVX512
    dopt__ring_decode_avx512(y, n, K, w, scale, vote, in);
#else
    dopt__ring_decode_portable(y, n, K, w, scale, vote, in);
#endif
}

/* The first n fp16 or bf16 means at in, as floats. */
static void dopt__ring_decode_half(float *DOPT_RESTRICT y, size_t n, int fmt, const unsigned char *DOPT_RESTRICT in) {
    size_t i = 0;
#ifdef DOPT__F16C
    if (fmt == DOPT__RING_F16)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i))));
#endif
    for (; i < n; i++) {
        uint16_t h;
        memcpy(&h, in + 2 * i, 2);
        y[i] = fmt == DOPT__RING_F16 ? dopt__f16_to_f32(h) : dopt__bf16_to_f32(h);
    }
}

/* ----- the schedule */

/* One pass of a ring of n members over groups [g0, g1): chunk i is the i-th of n near-equal runs
   of groups, each cut into `pieces` pieces, one exchange per piece and step.
   A reduce-scatter (gather = 0) starts from this rank's own contributions `own` (sums of k0
   codes); at step s it sends chunk pos - s, holding the sums of (s + 1)·k0 codes (own itself at
   step 0, else what it folded at step s - 1), and folds chunk pos - s - 1 from the left into its
   own; the last step's fold, chunk pos + 1 with the sums of n·k0 codes, goes to `out`.
   An allgather (gather = 1) sends chunk pos + 1 - s of `out` and receives chunk pos - s into it:
   the final sums go round as they were packed, once. */
typedef struct dopt__ring_pass {
    dopt_comm *comm;
    uint64_t tag;
    const int *ranks; /* the members, in ring order (ranks of comm) */
    int n, pos;
    size_t g0, g1;
    int gather;
    uint64_t k0;
    size_t cap;       /* groups of the largest chunk of this pass on any ring of its level: every
                         rank cuts as many pieces (exchanges are numbered on the whole communicator) */
    dopt__planes own, out;
    unsigned char *stage; /* a reduce-scatter's: its folds and receptions (dopt__ring_hop_of) */
} dopt__ring_pass;

static size_t dopt__ring_chunk_first(const dopt__ring_pass *p, long long chunk) {
    uint64_t cf, cl;
    dopt__ring_segment(p->g1 - p->g0, p->n, dopt__mod(chunk, p->n), &cf, &cl);
    return p->g0 + (size_t)cf;
}

static void dopt__ring_piece(const dopt__ring_pass *p, int pieces, long long chunk, int b, size_t *first,
                             size_t *groups) {
    uint64_t cf, cl, pf, pl;
    dopt__ring_segment(p->g1 - p->g0, p->n, dopt__mod(chunk, p->n), &cf, &cl);
    dopt__ring_segment(cl, pieces, b, &pf, &pl);
    *first = p->g0 + (size_t)(cf + pf);
    *groups = (size_t)pl;
}

/* Pieces per chunk: every rank computes the same from the level's largest chunk (p->cap); at
   least the depth, so that a piece's next step is never waited for by an exchange started before
   it. */
static int dopt__ring_pieces_of(size_t chunk_groups) {
    size_t k = (chunk_groups + DOPT__RING_PIECE_GROUPS - 1) / DOPT__RING_PIECE_GROUPS;
    return k < DOPT__RING_DEPTH ? DOPT__RING_DEPTH : (int)k;
}

static int dopt__ring_pieces(const dopt__ring_pass *p) { return dopt__ring_pieces_of(p->cap); }

/* Exchange e of a pass (step e / pieces, piece e % pieces): what it sends (tx: own at step 0,
   else the chunk step s - 1 folded into, in the stage), where it receives (rx: a slot per
   exchange in flight) and where the fold of what it received goes (the stage, or at the last
   step the pass's out). The pass's stage holds two chunks at most out's width, then the
   slots. */
typedef struct dopt__ring_hop {
    size_t out_first, out_groups, in_first, in_groups;
    dopt__planes tx, rx, fold; /* fold: where the reduce-scatter's fold of rx goes */
} dopt__ring_hop;

static void dopt__ring_hop_of(const dopt__ring_pass *p, int pieces, long long e, dopt__ring_hop *h) {
    int s = (int)(e / pieces), b = (int)(e % pieces);
    long long out = p->gather ? (long long)p->pos + 1 - s : (long long)p->pos - s;
    size_t chunk_cap = p->cap;
    unsigned char *stage[2];
    dopt__ring_piece(p, pieces, out, b, &h->out_first, &h->out_groups);
    dopt__ring_piece(p, pieces, out - 1, b, &h->in_first, &h->in_groups);
    if (p->gather) {
        h->tx = h->rx = p->out;
        return;
    }
    /* stage[s % 2] gets step s's folds, sent at step s + 1; receptions go to a slot per piece */
    stage[0] = p->stage, stage[1] = p->stage + chunk_cap * 8 * p->out.w;
    h->rx.p = stage[1] + chunk_cap * 8 * p->out.w + (size_t)(e % DOPT__RING_DEPTH) * DOPT__RING_PIECE_GROUPS * 8 * p->out.w;
    h->rx.g0 = h->in_first;
    h->rx.K = (s + 1) * (int)p->k0;
    h->rx.w = dopt__ring_bits(p->own.fmt, h->rx.K);
    h->rx.fmt = p->own.fmt;
    if (s == 0) {
        h->tx = p->own;
    } else {
        h->tx.p = stage[(s - 1) % 2];
        h->tx.g0 = dopt__ring_chunk_first(p, out);
        h->tx.K = h->rx.K;
        h->tx.w = h->rx.w;
        h->tx.fmt = h->rx.fmt;
    }
    if (s == p->n - 2) { /* the last step: the chunk's final sums */
        h->fold = p->out;
    } else {
        h->fold.p = stage[s % 2];
        h->fold.g0 = dopt__ring_chunk_first(p, out - 1);
        h->fold.K = (s + 2) * (int)p->k0;
        h->fold.w = dopt__ring_bits(p->own.fmt, h->fold.K);
        h->fold.fmt = p->own.fmt;
    }
}

/* Bytes of the stage a pass needs (dopt__ring_hop_of's layout). */
static size_t dopt__ring_stage_bytes(const dopt__ring_pass *p) {
    size_t chunk_cap = p->cap;
    return p->gather ? 0 : (2 * chunk_cap + DOPT__RING_DEPTH * DOPT__RING_PIECE_GROUPS) * 8 * p->out.w;
}

static dopt_status dopt__ring_start(const dopt__ring_pass *p, int pieces, long long e, dopt_request *req) {
    dopt__ring_hop h;
    dopt_xfer tx, rx;
    dopt__ring_hop_of(p, pieces, e, &h);
    tx.peer = p->ranks[(p->pos + 1) % p->n];
    rx.peer = p->ranks[(p->pos + p->n - 1) % p->n];
    tx.buf = dopt__planes_at(&h.tx, h.out_first);
    tx.bytes = h.out_groups * 8 * h.tx.w;
    rx.buf = dopt__planes_at(&h.rx, h.in_first);
    rx.bytes = h.in_groups * 8 * h.rx.w;
    return dopt_exchange_start(p->comm, p->tag, &tx, 1, &rx, 1, req);
}

/* A pass among others in flight (dopt__ring_run). */
typedef struct dopt__ring_job {
    const dopt__ring_pass *p;
    int pieces;
    long long steps, started, done;
    dopt_request req[DOPT__RING_DEPTH];
} dopt__ring_job;

static dopt_status dopt__ring_job_start(dopt__ring_job *j) {
    long long e = j->started++;
    return dopt__ring_start(j->p, j->pieces, e, &j->req[e % DOPT__RING_DEPTH]);
}

/* Waits for job j's oldest exchange; a reduce-scatter folds what it received. */
static dopt_status dopt__ring_job_fold(dopt__ring_job *j) {
    const dopt__ring_pass *p = j->p;
    long long e = j->done++;
    dopt__ring_hop h;
    dopt_coll_desc d;
    dopt_status s = dopt_wait(&j->req[e % DOPT__RING_DEPTH]);
    if (s != DOPT_OK) return s;
    dopt__ring_hop_of(p, j->pieces, e, &h);
    if (p->gather || !dopt__ring_fold(&h.rx, &p->own, &h.fold, h.in_first, h.in_groups)) return DOPT_OK;
    memset(&d, 0, sizeof d);
    d.kind = DOPT_COLL_EXCHANGE;
    d.seq = p->comm->seq;
    d.count = p->tag;
    d.group = p->comm->group;
    return dopt_comm_fail(p->comm, &d, DOPT_ERR_PROTOCOL, "rank %d sent %s", p->ranks[(p->pos + p->n - 1) % p->n],
                          h.rx.fmt == DOPT__RING_INT ? "a sum beyond its count" : "a mean that is not finite");
}

/* Runs passes ps[0 .. np) at once (np <= 4; they write different places), each with
   DOPT__RING_DEPTH exchanges in flight: round after round, each unfinished pass in turn waits
   for its oldest exchange, folds it (a reduce-scatter, before the exchange that sends the fold
   on starts: pieces >= depth) and starts its next. What a rank starts, and in which order,
   follows from the passes' shapes alone, never from which exchange completes first: every rank
   starts the same exchanges in the same order. A slow pass (across hosts) paces the rounds; a
   fast one (within the host) rides along. */
static dopt_status dopt__ring_run(const dopt__ring_pass *const *ps, int np) {
    dopt__ring_job jobs[4];
    dopt_status s = DOPT_OK;
    int i, d, busy = 1;
    for (i = 0; i < np; i++) {
        jobs[i].p = ps[i];
        jobs[i].pieces = dopt__ring_pieces(ps[i]);
        jobs[i].steps = (long long)(ps[i]->n - 1) * jobs[i].pieces;
        jobs[i].started = jobs[i].done = 0;
    }
    for (d = 0; d < DOPT__RING_DEPTH; d++)
        for (i = 0; i < np && s == DOPT_OK; i++)
            if (jobs[i].started < jobs[i].steps) s = dopt__ring_job_start(&jobs[i]);
    while (busy && s == DOPT_OK)
        for (i = 0, busy = 0; i < np && s == DOPT_OK; i++) {
            if (jobs[i].done == jobs[i].steps) continue;
            busy = 1;
            s = dopt__ring_job_fold(&jobs[i]);
            if (s == DOPT_OK && jobs[i].started < jobs[i].steps) s = dopt__ring_job_start(&jobs[i]);
        }
    return s;
}

/* The ring's format for this compressor's codec (the codec table's). */
static int dopt__ring_fmt(const dopt_compressor *cz) { return dopt__codec(&cz->cfg)->ring; }

/* This rank's signs (a majority message body of n elements, 1 bit each, 1 = negative) as planes
   of sums of one: v = t + 1 is 0 or 2, so plane 0 is empty and plane 1 holds the positive
   elements. A full block's byte j holds elements j, j + 8, ..., j + 56: transposed, a word. */
static void dopt__ring_own_signs(const uint8_t *DOPT_RESTRICT in, size_t n, unsigned char *DOPT_RESTRICT out) {
    size_t i, t;
    for (i = 0; i < n; i += DOPT__BLOCK, in += 8, out += 16) {
        size_t m = n - i < DOPT__BLOCK ? n - i : DOPT__BLOCK;
        uint64_t word = 0, zero = 0;
        if (m == DOPT__BLOCK) {
            memcpy(&word, in, 8);
            word = ~dopt__transpose8x8(word);
        } else {
            uint8_t c[DOPT__BLOCK];
            dopt__unpack_block(in, m, 1, c);
            for (t = 0; t < m; t++) word |= (uint64_t)(c[t] == 0) << t;
        }
        memcpy(out, &zero, 8);
        memcpy(out + 8, &word, 8);
    }
}

/* This rank's contribution to the ring, group after group, from its message: planes of its
   signs (majority), or its fp16 or bf16 values padded with zeros. (Ternary's planes come from
   the pipeline: dopt__pipe_encode.) */
static void dopt__ring_fill_own(const dopt_compressor *cz, unsigned char *own) {
    size_t off = DOPT_COMPRESS_HEADER_BYTES, j;
    int fmt = dopt__ring_fmt(cz);
    for (j = 0; j < cz->view.nsegs; j++) {
        size_t n = dopt__vcount(cz, &cz->view, j), per = fmt == DOPT__RING_INT ? 16 : 128;
        size_t groups = dopt__ring_groups(n);
        const unsigned char *body = cz->msg + off + DOPT_COMPRESS_RECORD_BYTES;
        if (dopt__codec(&cz->cfg)->vote) {
            dopt__ring_own_signs(body, n, own);
        } else if (n > 0) {
            memcpy(own, body, 2 * n);
            memset(own + 2 * n, 0, groups * per - 2 * n);
        }
        own += groups * per;
        off += DOPT_COMPRESS_RECORD_BYTES + dopt__pad8(dopt__body_bytes(&cz->cfg, n));
    }
}

/* Grows the ring's one buffer to `bytes` (kept for later calls). */
static dopt_status dopt__ring_room(dopt_compressor *cz, size_t bytes) {
    if (bytes <= cz->ring_bytes) return DOPT_OK;
    DOPT_FREE(cz->ring_buf);
    cz->ring_bytes = 0;
    if ((cz->ring_buf = (unsigned char *)DOPT_MALLOC(bytes)) == NULL) return DOPT_ERR_NOMEM;
    cz->ring_bytes = bytes;
    return DOPT_OK;
}

/* Where this rank stands in the ring's schedule. The ring's one buffer holds: the own planes
   (groups × w(1), from group 0) | the final planes (cz->ring_fin: groups × w(N), biased by N) |
   two regions for the host's sums of the chunk this rank carries across hosts (host_sums:
   bucket k uses region k % 2, as bucket k + 1's sums are formed while k's cross) | the stages
   of the reduce-scatters within the host (or the flat ring) and across hosts (stage_a, then
   stage_b). cz->ring_ranks: the host's ranks in order, then the ranks at this
   rank's place on each host (two levels), or 0 .. N - 1 (flat). */
typedef struct dopt__ring_plan {
    dopt_comm *comm;
    int fmt, two, L, H, j, host;
    unsigned wown, whost, wfin;
    size_t groups;
    int nb;                    /* buckets */
    unsigned char *host_sums;
    size_t host_bytes;         /* one region of host_sums */
    unsigned char *stage_a, *stage_b;
} dopt__ring_plan;

/* The reduce-scatters that sum groups [g0, g1) (bucket k): over a flat ring (a) or, when the
   ranks sit on several hosts of several ranks each (and two-level schedules are not off), within
   the host (a) into the host's sums of one chunk, then across hosts (b) among the ranks at the
   same place, starting from the host's sums. For sizing, the buffers may be NULL. */
static void dopt__ring_passes(const dopt_compressor *cz, const dopt__ring_plan *pl, size_t g0, size_t g1, int k,
                              dopt__ring_pass *a, dopt__ring_pass *b) {
    uint64_t cf = 0, cl = 0;
    memset(a, 0, sizeof *a);
    memset(b, 0, sizeof *b);
    a->comm = b->comm = pl->comm;
    a->g0 = g0, a->g1 = g1, a->k0 = 1, a->n = pl->two ? pl->L : pl->comm->size;
    a->cap = (g1 - g0 + (size_t)a->n - 1) / (size_t)a->n;
    a->ranks = cz->ring_ranks;
    a->stage = pl->stage_a;
    a->own.p = cz->ring_buf, a->own.w = pl->wown, a->own.K = 1, a->own.fmt = pl->fmt;
    b->out.p = cz->ring_fin, b->out.w = pl->wfin, b->out.K = pl->comm->size, b->out.fmt = pl->fmt;
    if (!pl->two) {
        a->out = b->out;
        a->pos = pl->comm->rank;
        return;
    }
    dopt__ring_segment(g1 - g0, pl->L, (pl->j + 1) % pl->L, &cf, &cl); /* the chunk carried across */
    a->out.p = pl->host_sums ? pl->host_sums + (size_t)(k % 2) * pl->host_bytes : NULL;
    a->out.g0 = g0 + (size_t)cf, a->out.w = pl->whost, a->out.K = pl->L, a->out.fmt = pl->fmt;
    a->pos = pl->j;
    b->own = a->out;
    b->g0 = g0 + (size_t)cf, b->g1 = g0 + (size_t)(cf + cl), b->k0 = (uint64_t)pl->L, b->n = pl->H;
    b->cap = (a->cap + (size_t)pl->H - 1) / (size_t)pl->H; /* a->cap: the largest host chunk */
    b->ranks = cz->ring_ranks + pl->L, b->pos = pl->host;
    b->stage = pl->stage_b;
}

/* The plan of an allreduce of `groups` groups in nb buckets, and the ring's buffer (grown once,
   kept for later calls). */
static dopt_status dopt__ring_plan_init(dopt_compressor *cz, dopt_comm *comm, size_t groups, int nb,
                                        dopt__ring_plan *pl) {
    dopt_host_layout lay;
    dopt__ring_pass a, b;
    uint64_t first, most;
    size_t fin_off, host_off, stage_off, sa, sb = 0;
    dopt_status s;
    int i;
    memset(pl, 0, sizeof *pl);
    pl->comm = comm;
    pl->groups = groups, pl->nb = nb;
    pl->fmt = dopt__ring_fmt(cz);
    pl->L = 1, pl->H = comm->size;
    dopt_comm_host_layout(comm, &lay);
    pl->two = lay.hosts > 1 && lay.local > 1 && lay.two_level != DOPT_TWO_LEVEL_OFF;
    if (pl->two) pl->L = lay.local, pl->H = lay.hosts, pl->j = lay.local_rank, pl->host = lay.host;
    pl->wown = dopt__ring_bits(pl->fmt, 1);
    pl->whost = dopt__ring_bits(pl->fmt, pl->L);
    pl->wfin = dopt__ring_bits(pl->fmt, comm->size);
    dopt__ring_segment(groups, nb, 0, &first, &most); /* the first bucket is the largest */
    dopt__ring_passes(cz, pl, 0, (size_t)most, 0, &a, &b);
    sa = dopt__ring_stage_bytes(&a);
    if (pl->two) sb = dopt__ring_stage_bytes(&b), pl->host_bytes = (b.g1 - b.g0) * 8 * pl->whost;
    fin_off = groups * 8 * pl->wown;
    host_off = fin_off + groups * 8 * pl->wfin;
    stage_off = host_off + 2 * pl->host_bytes;
    if ((s = dopt__ring_room(cz, stage_off + sa + sb)) != DOPT_OK) return s;
    cz->ring_fin = cz->ring_buf + fin_off;
    pl->host_sums = cz->ring_buf + host_off;
    pl->stage_a = cz->ring_buf + stage_off, pl->stage_b = pl->stage_a + sa;
    if (pl->two) {
        for (i = 0; i < pl->L; i++) cz->ring_ranks[i] = dopt_comm_host_rank(comm, lay.host, i);
        for (i = 0; i < pl->H; i++) cz->ring_ranks[pl->L + i] = dopt_comm_host_rank(comm, i, pl->j);
    } else {
        for (i = 0; i < comm->size; i++) cz->ring_ranks[i] = i;
    }
    return DOPT_OK;
}

/* The passes of bucket k, in order: the reduce-scatters of dopt__ring_passes, then the final
   sums back around the same rings (across hosts, then within the host). Returns how many (2
   flat, 4 by host). Tags carry the bucket's size, the codec, the pass and k mod 16: ranks with
   another layout fail with a mismatch. */
static int dopt__ring_bucket_passes(const dopt_compressor *cz, const dopt__ring_plan *pl, int k, dopt__ring_pass *ps) {
    uint64_t f, l, tag;
    dopt__ring_segment(pl->groups, pl->nb, k, &f, &l);
    tag = l << 16 | (uint64_t)cz->cfg.codec << 8 | (uint64_t)(k & 15);
    dopt__ring_passes(cz, pl, (size_t)f, (size_t)(f + l), k, &ps[0], &ps[1]);
    if (!pl->two) {
        ps[0].tag = tag | 5u << 4;
        ps[1] = ps[0];
        ps[1].gather = 1, ps[1].tag = tag | 4u << 4;
        return 2;
    }
    ps[0].tag = tag | 1u << 4;
    ps[1].tag = tag | 2u << 4;
    ps[2] = ps[1];
    ps[2].gather = 1, ps[2].tag = tag | 3u << 4;
    ps[3] = ps[0];
    ps[3].out = ps[1].out; /* the final sums go round within the host */
    ps[3].gather = 1, ps[3].tag = tag | 4u << 4;
    return 4;
}

/* Walks the segments of the call (cz->view) the ring carries that overlap groups [g0, g1), in
   the call's order: each step gives the next one (seg: its index in the table, pos: in the
   call), its elements [e0, e1) within the range, its first group there (lo) and its record in
   cz->msg (rec); 0 at the end. */
typedef struct dopt__ring_walk {
    size_t g0, g1, gb, off, next; /* the range; the next segment's first group and record; its place */
    size_t seg, pos, e0, e1, lo, rec;
} dopt__ring_walk;

static dopt__ring_walk dopt__ring_walk_over(size_t g0, size_t g1) {
    dopt__ring_walk w;
    memset(&w, 0, sizeof w);
    w.g0 = g0, w.g1 = g1, w.off = DOPT_COMPRESS_HEADER_BYTES;
    return w;
}

static int dopt__ring_walk_step(const dopt_compressor *cz, dopt__ring_walk *w) {
    while (w->next < cz->view.nsegs && w->gb < w->g1) {
        size_t j = w->next++, i = cz->view.index[j], n = cz->segs[i].count, gb = w->gb, off = w->off;
        size_t gn = dopt__ring_carries(cz, i) ? dopt__ring_groups(n) : 0;
        size_t lo = w->g0 > gb ? w->g0 : gb, hi = w->g1 < gb + gn ? w->g1 : gb + gn;
        w->gb += gn;
        w->off += DOPT_COMPRESS_RECORD_BYTES + dopt__pad8(dopt__body_bytes(&cz->cfg, n));
        if (lo < hi) {
            w->seg = i, w->pos = j, w->lo = lo, w->rec = off;
            w->e0 = (lo - gb) * DOPT__BLOCK;
            w->e1 = (hi - gb) * DOPT__BLOCK < n ? (hi - gb) * DOPT__BLOCK : n;
            return 1;
        }
    }
    return 0;
}

/* grads over groups [g0, g1) of the segments the ring carries, from its final sums: y = (float)S ·
   (weight · s) for ternary, as the allgather path computes it; ±v or 0 for majority; the means
   for fp16 and bf16. */
static void dopt__ring_decode_groups(dopt_compressor *cz, int N, float weight, const dopt_buf *grads, size_t g0,
                                     size_t g1) {
    int fmt = dopt__ring_fmt(cz);
    unsigned wfin = dopt__ring_bits(fmt, N);
    dopt__ring_walk w = dopt__ring_walk_over(g0, g1);
    while (dopt__ring_walk_step(cz, &w)) {
        float *y = dopt_buf_segment(grads, w.seg).ptr + w.e0;
        const unsigned char *fin = cz->ring_fin + w.lo * 8 * wfin;
        if (fmt != DOPT__RING_INT)
            dopt__ring_decode_half(y, w.e1 - w.e0, fmt, fin);
        else if (dopt__codec(&cz->cfg)->vote)
            dopt__ring_decode(y, w.e1 - w.e0, N, wfin,
                              dopt__vote_magnitude(cz, cz->gather + 4 * w.pos, 4 * (cz->view.nsegs + 1), N, weight), 1,
                              fin);
        else
            dopt__ring_decode(y, w.e1 - w.e0, N, wfin, weight * dopt__bits_f32(dopt__get_le32(cz->msg + w.rec + 12)), 0,
                              fin);
    }
}

/* ----- the pipeline: ternary's codes encoded while the ring sums the buckets before them */

#define DOPT__RING_BUCKET_GROUPS 16384 /* the least an automatic bucket holds: 1 Mi elements */
#define DOPT__RING_AUTO_BUCKETS 16     /* automatic buckets, at most */

/* Buckets of this call: near-equal runs of groups (dopt__ring_segment's cut). Ternary only (its
   codes come out of the encoder group by group, and its non-finite verdict is known before any
   code is); 1 for the other codecs. */
static int dopt__ring_nbuckets(const dopt_compressor *cz, size_t groups) {
    size_t nb = 1;
    if (!dopt__codec(&cz->cfg)->shared_scale || groups == 0) return 1;
    if (cz->cfg.ring_buckets > 0)
        nb = (size_t)cz->cfg.ring_buckets;
    else
        nb = groups / DOPT__RING_BUCKET_GROUPS;
    if (cz->cfg.ring_buckets == 0 && nb > DOPT__RING_AUTO_BUCKETS) nb = DOPT__RING_AUTO_BUCKETS;
    if (nb > groups) nb = groups;
    return nb < 1 ? 1 : (int)nb;
}

/* Ternary's codes of bucket k of p into the message (cz->msg, whose records are written) and, as
   planes of sums of one, into the ring's own planes. */
static void dopt__pipe_encode(dopt_compressor *cz, const dopt__ring_plan *pl, const dopt_buf *p, int k) {
    uint64_t f, l;
    dopt__ring_walk w;
    dopt__ring_segment(pl->groups, pl->nb, k, &f, &l);
    w = dopt__ring_walk_over((size_t)f, (size_t)(f + l));
    while (dopt__ring_walk_step(cz, &w)) {
        dopt_span sp = dopt_buf_segment(p, w.seg);
        unsigned char *body = cz->msg + w.rec + DOPT_COMPRESS_RECORD_BYTES;
        dopt_rng rng;
        dopt__seg_rng(cz, cz->rank, w.seg, &rng);
        dopt__tern_encode_range(sp.ptr, sp.count, w.e0, w.e1, cz->bounds[w.pos], cz->scales[w.pos], &rng, body);
        dopt__ring_own(body + w.e0 / 4, w.e1 - w.e0, cz->ring_buf + w.lo * 16);
    }
}

/* Who writes the own planes of bucket k before its first pass starts: nobody (encode NULL: filled
   before the schedule), the schedule's own thread, or (threaded) the caller's thread, which the
   schedule's waits for and which decodes each bucket once the schedule says it is summed. */
typedef struct dopt__pipe {
    dopt_compressor *cz;
    const dopt__ring_plan *plan;
    const dopt_buf *encode;    /* the gradient ternary's codes come from */
    int threaded, encoded;     /* buckets the caller's thread has encoded */
    int begun;                 /* steps the schedule has begun */
    int summed;                /* buckets whose final sums are in place (nb once the schedule ends) */
    dopt_status status;
#ifdef DOPT__THREADS
    pthread_mutex_t mu;
    pthread_cond_t cv;
#endif
} dopt__pipe;

/* The ring's schedule, in steps: at step t, bucket t's first pass, t - 1's second, ... run at once
   (dopt__ring_run), so that bucket t is summed within the host while t - 1 and t - 2 cross
   between hosts and t - 3 goes back within the host. Bucket t's own planes are ready before step
   t (waited for, or encoded here). The same steps, passes and order on every rank. */
static dopt_status dopt__ring_schedule(dopt__pipe *q) {
    const dopt__ring_plan *pl = q->plan;
    int levels = pl->two ? 4 : 2, t, i;
    dopt_status s = DOPT_OK;
    for (t = 0; t < pl->nb + levels - 1 && s == DOPT_OK; t++) {
        dopt__ring_pass all[4], now[4];
        const dopt__ring_pass *run[4];
        int np = 0;
        if (t < pl->nb && q->encode && !q->threaded) dopt__pipe_encode(q->cz, pl, q->encode, t);
#ifdef DOPT__THREADS
        if (q->threaded) {
            pthread_mutex_lock(&q->mu);
            while (t < pl->nb && q->encoded <= t) pthread_cond_wait(&q->cv, &q->mu);
            q->begun = t + 1;
            pthread_cond_broadcast(&q->cv);
            pthread_mutex_unlock(&q->mu);
        }
#endif
        for (i = 0; i < levels; i++)
            if (t - i >= 0 && t - i < pl->nb) {
                dopt__ring_bucket_passes(q->cz, pl, t - i, all);
                now[np] = all[i];
                run[np] = &now[np];
                np++;
            }
        s = dopt__ring_run(run, np);
#ifdef DOPT__THREADS
        if (q->threaded && s == DOPT_OK && t - levels + 2 > 0) { /* bucket t - levels + 1 went its last pass */
            pthread_mutex_lock(&q->mu);
            q->summed = t - levels + 2;
            pthread_cond_broadcast(&q->cv);
            pthread_mutex_unlock(&q->mu);
        }
#endif
    }
    return s;
}

#ifdef DOPT__THREADS
static void *dopt__pipe_ring(void *arg) {
    dopt__pipe *q = (dopt__pipe *)arg;
    dopt_status s = dopt__ring_schedule(q);
    pthread_mutex_lock(&q->mu);
    q->status = s;
    q->summed = q->plan->nb;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

/* The caller's side of a threaded pipeline: bucket k is encoded once step k - 1 has begun, one
   bucket ahead of the ring and no more (further ahead, the encoders of 8 ranks on 2 cores starved
   the ring's thread; the figures are in docs/measurements.md, compressed allreduce across
   simulated hosts), and between two the buckets the schedule has finished are decoded into grads.
   Returns the schedule's status. */
static dopt_status dopt__pipe_caller(dopt__pipe *q, const dopt_buf *grads, float weight) {
    const dopt__ring_plan *pl = q->plan;
    dopt_status s = DOPT_OK;
    int k = 0, d = 0, encode;
    while (d < pl->nb) {
        uint64_t f, l;
        pthread_mutex_lock(&q->mu);
        while (!(encode = k < pl->nb && q->begun >= k) && q->summed <= d) pthread_cond_wait(&q->cv, &q->mu);
        s = q->status; /* DOPT_OK until the schedule has ended */
        pthread_mutex_unlock(&q->mu);
        if (s != DOPT_OK) break;
        if (encode) {
#ifdef DOPT__PIPE_TEST_DELAY_US /* tests: a slow encoder, so that a ring that runs ahead reads stale planes */
            struct timespec ts = {0, DOPT__PIPE_TEST_DELAY_US * 1000L};
            nanosleep(&ts, NULL);
#endif
            dopt__pipe_encode(q->cz, pl, q->encode, k);
            pthread_mutex_lock(&q->mu);
            q->encoded = ++k;
            pthread_cond_broadcast(&q->cv);
            pthread_mutex_unlock(&q->mu);
        } else { /* bucket d is summed */
            dopt__ring_segment(pl->groups, pl->nb, d, &f, &l);
            dopt__ring_decode_groups(q->cz, pl->comm->size, weight, grads, (size_t)f, (size_t)(f + l));
            d++;
        }
    }
    return s;
}
#endif

/* The ring's sums into grads' carried segments, ternary's codes encoded bucket by bucket on the
   way: with nb > 1 and threads, this thread encodes bucket k + 1 while a second one runs the
   schedule (it alone uses the communicator until it is joined), then decodes each bucket as the
   schedule finishes it; else one thread does it all, bucket t encoded before step t and every
   bucket decoded at the end. The same exchanges in the same order either way, so the same bytes.
   p == NULL: the own planes are filled already. On a failure, grads may hold some buckets'
   results. */
static dopt_status dopt__ring_pipeline(dopt_compressor *cz, const dopt__ring_plan *pl, const dopt_buf *p,
                                       const dopt_buf *grads, float weight) {
    dopt_status s;
    dopt__pipe q;
    memset(&q, 0, sizeof q);
    q.cz = cz, q.plan = pl, q.encode = p;
#ifdef DOPT__THREADS
    if (p != NULL && pl->nb > 1 && pthread_mutex_init(&q.mu, NULL) == 0) {
        pthread_t t;
        q.threaded = pthread_cond_init(&q.cv, NULL) == 0;
        if (q.threaded && pthread_create(&t, NULL, dopt__pipe_ring, &q) == 0) {
            s = dopt__pipe_caller(&q, grads, weight);
            pthread_join(t, NULL);
            pthread_cond_destroy(&q.cv);
            pthread_mutex_destroy(&q.mu);
            return s;
        }
        if (q.threaded) pthread_cond_destroy(&q.cv);
        pthread_mutex_destroy(&q.mu);
        q.threaded = 0;
    }
#endif
    if ((s = dopt__ring_schedule(&q)) == DOPT_OK) dopt__ring_decode_groups(cz, pl->comm->size, weight, grads, 0, pl->groups);
    return s;
}

/* ----- the ring path of the allreduce: the non-finite verdict, the exchange, ternary's fp32 segments */

/* Before the ring: every rank learns whether any rank's gradient was not finite (ternary knows
   it from the scale sharing). Majority vote allgathers each rank's scales and flag (its rows,
   nsegs + 1 floats, stay in the gather buffer for the result's magnitude); fp16 and bf16 reduce
   one flag. `mine` is this rank's encode status. */
static dopt_status dopt__ring_agree(dopt_compressor *cz, dopt_comm *comm, dopt_status mine) {
    size_t off = DOPT_COMPRESS_HEADER_BYTES, j, k = cz->view.nsegs;
    float flag = mine == DOPT_ERR_NONFINITE ? 1.0f : 0.0f;
    dopt_status s;
    int r;
    if (dopt__codec(&cz->cfg)->shared_scale) return mine;
    if (!dopt__codec(&cz->cfg)->vote) {
        s = dopt_allreduce(comm, &flag, 1, DOPT_F32, DOPT_MAX);
        return s != DOPT_OK ? s : flag != 0.0f ? DOPT_ERR_NONFINITE : DOPT_OK;
    }
    for (j = 0; j < k; j++) {
        cz->scales[j] = mine == DOPT_OK ? dopt__bits_f32(dopt__get_le32(cz->msg + off + 12)) : 0.0f;
        off += DOPT_COMPRESS_RECORD_BYTES + dopt__pad8(dopt__body_bytes(&cz->cfg, dopt__vcount(cz, &cz->view, j)));
    }
    cz->scales[k] = flag;
    s = dopt_allgather(comm, cz->scales, cz->gather, (k + 1) * sizeof(float));
    for (r = 0; s == DOPT_OK && r < comm->size; r++)
        if (dopt__bits_f32(dopt__get_le32(cz->gather + ((size_t)r * (k + 1) + k) * 4)) != 0.0f)
            s = DOPT_ERR_NONFINITE;
    return s;
}

/* The ring path of the compressed allreduce, after this rank's message is in cz->msg (ternary:
   all but the codes, which the pipeline writes from p, the gradient encoded): the sums of the
   segments through the ring into grads (dopt__ring_pipeline), ternary's fp32 segments (those
   below fp32_below) through one allgather of their values, left in the gather buffer for
   dopt__ring_decode_small. Sets cz->path and cz->buckets. */
static dopt_status dopt__ring_exchange(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *p, const dopt_buf *grads,
                                       size_t groups) {
    const dopt__compress_view *v = &cz->view;
    size_t off = DOPT_COMPRESS_HEADER_BYTES, small = 0, j;
    int nb = dopt__ring_nbuckets(cz, groups);
    dopt__ring_plan plan;
    dopt_status s;
    for (j = 0; j < v->nsegs; j++) small += dopt__ring_carries(cz, v->index[j]) ? 0 : dopt__vcount(cz, v, j);
    if ((size_t)comm->size > cz->ring_nranks) {
        DOPT_FREE(cz->ring_ranks);
        cz->ring_nranks = 0;
        if ((cz->ring_ranks = (int *)DOPT_MALLOC(sizeof(int) * (size_t)comm->size)) == NULL) return DOPT_ERR_NOMEM;
        cz->ring_nranks = (size_t)comm->size;
    }
    if ((s = dopt__ring_plan_init(cz, comm, groups, nb, &plan)) != DOPT_OK) return s;
    if (!dopt__codec(&cz->cfg)->shared_scale) dopt__ring_fill_own(cz, cz->ring_buf);
    s = dopt__ring_pipeline(cz, &plan, dopt__codec(&cz->cfg)->shared_scale ? p : NULL, grads, 1.0f / (float)comm->size);
    if (s != DOPT_OK) return s;
    cz->path = plan.two ? DOPT_PATH_RING_TWO_LEVEL : DOPT_PATH_RING;
    cz->buckets = nb;
    if (small == 0) return DOPT_OK;
    /* the fp32 segments' values, packed, then every rank's after them in the gather buffer */
    small = 0;
    for (j = 0; j < v->nsegs; j++) {
        size_t n = dopt__vcount(cz, v, j), body = dopt__body_bytes(&cz->cfg, n);
        if (!dopt__ring_carries(cz, v->index[j]) && n > 0) {
            memcpy(cz->gather + small * 4, cz->msg + off + DOPT_COMPRESS_RECORD_BYTES, 4 * n);
            small += n;
        }
        off += DOPT_COMPRESS_RECORD_BYTES + dopt__pad8(body);
    }
    return dopt_allgather(comm, cz->gather, cz->gather + small * 4, small * 4);
}

/* ternary's fp32 segments after the ring: the ranks' values accumulated in rank order. */
static void dopt__ring_decode_small(dopt_compressor *cz, int N, float weight, const dopt_buf *grads) {
    const dopt__compress_view *v = &cz->view;
    size_t small = 0, total = 0, j;
    int r;
    for (j = 0; j < v->nsegs; j++) total += dopt__ring_carries(cz, v->index[j]) ? 0 : dopt__vcount(cz, v, j);
    for (j = 0; j < v->nsegs; j++) {
        dopt_span sp = dopt_buf_segment(grads, v->index[j]);
        if (dopt__ring_carries(cz, v->index[j]) || sp.count == 0) continue;
        memset(sp.ptr, 0, sp.count * sizeof(float));
        for (r = 0; r < N; r++)
            dopt__f32_accum(sp.ptr, weight, cz->gather + ((size_t)(r + 1) * total + small) * 4, sp.count);
        small += sp.count;
    }
}

/* =====================================================================================
   PART 3 OF 3 — THE COMPRESSED ALLREDUCE: the allgather path, the choice between it, the ring
   and PowerSGD's two allreduces, and the public calls.
   ===================================================================================== */

/* ===================================================================== THE ALLGATHER PATH */

static dopt_status dopt__gather_room(dopt_compressor *cz, int ranks) {
    unsigned char *g;
    if ((size_t)ranks <= cz->gather_ranks) return DOPT_OK;
    if (cz->msg_bytes > SIZE_MAX / (size_t)ranks) return DOPT_ERR_NOMEM;
    g = (unsigned char *)DOPT_MALLOC(cz->msg_bytes * (size_t)ranks);
    if (g == NULL) return DOPT_ERR_NOMEM;
    DOPT_FREE(cz->gather);
    cz->gather = g;
    cz->gather_ranks = (size_t)ranks;
    return DOPT_OK;
}

/* The average of the N validated ternary messages in the gather buffer into grads. A segment
   whose N scales are bitwise equal (scale sharing) is summed as integer counts: y = count · v,
   v = weight · s. Others (fp32 segments, scales not shared) are zeroed and accumulate the
   messages in rank order, y += (weight · s_r) · t_r. Either way every rank computes the same
   bytes. */
static void dopt__tern_average(dopt_compressor *cz, int nmsg, float weight, const dopt_buf *grads) {
    const dopt__compress_view *v = &cz->view;
    const uint8_t *data[DOPT__TERN_SUM_MAX];
    size_t off = DOPT_COMPRESS_HEADER_BYTES, j;
    int r;
    for (j = 0; j < v->nsegs; j++) {
        dopt_span sp = dopt_buf_segment(grads, v->index[j]);
        size_t n = sp.count, body = dopt__body_bytes(&cz->cfg, n);
        const unsigned char *rec0 = cz->gather + off;
        int shared = n >= cz->cfg.fp32_below;
        for (r = 0; r < nmsg; r++) {
            const unsigned char *rec = cz->gather + (size_t)r * v->msg_bytes + off;
            data[r] = rec + DOPT_COMPRESS_RECORD_BYTES;
            shared = shared && dopt__get_le32(rec + 12) == dopt__get_le32(rec0 + 12);
        }
        if (shared) {
            dopt__tern_sum(sp.ptr, n, weight * dopt__bits_f32(dopt__get_le32(rec0 + 12)), data, nmsg);
        } else if (n) {
            memset(sp.ptr, 0, n * sizeof(float));
            for (r = 0; r < nmsg; r++) {
                float b = dopt__bits_f32(dopt__get_le32(data[r] - 4));
                if (n < cz->cfg.fp32_below) {
                    dopt__f32_accum(sp.ptr, weight, data[r], n);
                } else {
                    dopt__tern_accum(sp.ptr, n, weight * b, data[r]);
                }
            }
        }
        off += DOPT_COMPRESS_RECORD_BYTES + dopt__pad8(body);
    }
}

/* The verdict on the N gathered messages, the same on every rank since every rank holds the same
   bytes: DOPT_ERR_PROTOCOL for a header that does not follow the format (or names another rank),
   then DOPT_ERR_NONFINITE when a message is flagged (no body is read), then DOPT_ERR_PROTOCOL for
   a body that does not follow it. */
static dopt_status dopt__gathered_verdict(const dopt_compressor *cz, int nmsg) {
    const dopt__compress_view *v = &cz->view;
    int r, nonfinite = 0;
    for (r = 0; r < nmsg; r++) {
        const unsigned char *m = cz->gather + (size_t)r * v->msg_bytes;
        if (dopt__check_header(v, cz->cfg.codec, m, v->msg_bytes) != (long)r) return DOPT_ERR_PROTOCOL;
        nonfinite |= dopt__flagged_nonfinite(m);
    }
    if (nonfinite) return DOPT_ERR_NONFINITE;
    for (r = 0; r < nmsg; r++)
        if (!dopt__check_body(cz, v, cz->gather + (size_t)r * v->msg_bytes)) return DOPT_ERR_PROTOCOL;
    return DOPT_OK;
}

/* The allgather path of majority vote: S = N - 2·(negative votes) per element from the N
   validated messages, y = ±v by its sign (0 on a tie), as the ring path computes it. */
static void dopt__vote_average(dopt_compressor *cz, int N, float weight, const dopt_buf *grads) {
    size_t off = DOPT_COMPRESS_HEADER_BYTES, j, b, stride = cz->view.msg_bytes;
    for (j = 0; j < cz->view.nsegs; j++) {
        dopt_span sp = dopt_buf_segment(grads, cz->view.index[j]);
        size_t n = sp.count;
        float v = dopt__vote_magnitude(cz, cz->gather + off + 12, stride, N, weight);
        const unsigned char *bodies = cz->gather + off + DOPT_COMPRESS_RECORD_BYTES;
        for (b = 0; b < n; b += DOPT__BLOCK)
            dopt__vote_block(bodies, stride, N, b / 8, n - b < DOPT__BLOCK ? n - b : DOPT__BLOCK, v, sp.ptr + b);
        off += DOPT_COMPRESS_RECORD_BYTES + dopt__pad8(dopt__body_bytes(&cz->cfg, n));
    }
}

/* ===================================================================== CHOOSING THE PATH */

/* Pieces of a chunk of `groups` groups (as dopt__ring_pieces cuts them). */
static double dopt__ring_predict_pieces(double groups) { return dopt__ring_pieces_of((size_t)ceil(groups)); }

/* Σ_{k = lo}^{hi} w(k·mult): the widths of the steps of a reduce-scatter. */
static double dopt__ring_width_sum(int fmt, int lo, int hi, int mult) {
    double total = 0;
    int k;
    for (k = lo; k <= hi; k++) total += dopt__ring_bits(fmt, k * mult);
    return total;
}

/* What each path costs a rank, predicted: DOPT__AGG_ALPHA seconds per exchange (a ring step,
   or a piece of one), the bytes it receives at DOPT__AGG_BETA bytes per second, and the
   elements it processes at costs measured on one core of an AVX-512 machine (REFERENCE FOR
   CONTRIBUTORS: THE INTEGER RING). groups: 64-element groups of ternary codes; L ranks on each
   of H hosts (L = 1: a flat ring of H = N); msg_bytes: a message, for the allgather. */
#define DOPT__AGG_ALPHA 30e-6
#define DOPT__AGG_BETA 1.25e9
#define DOPT__AGG_SUM_NS 0.03 /* the allgather path: one message's code added to a sum */
#define DOPT__AGG_HOP_NS 0.25 /* the ring: one element unpacked, added and packed at one step */
#define DOPT__AGG_OUT_NS 0.25 /* either: one element of the result written */

static double dopt__ring_predict(int fmt, size_t groups, int N, int L, int H, int ring, double msg_bytes) {
    double G = (double)groups, T = G * DOPT__BLOCK, wfin = dopt__ring_bits(fmt, N), bytes, hops, steps;
    if (!ring)
        return (N - 1) * (DOPT__AGG_ALPHA + msg_bytes / DOPT__AGG_BETA) + T * (N * DOPT__AGG_SUM_NS + DOPT__AGG_OUT_NS) * 1e-9;
    if (L > 1 && H > 1) {
        double chunk = G / L, sub = chunk / H;
        bytes = 8 * (chunk * dopt__ring_width_sum(fmt, 1, L - 1, 1) + sub * dopt__ring_width_sum(fmt, 1, H - 1, L) +
                     (H - 1) * sub * wfin + (L - 1) * chunk * wfin);
        hops = DOPT__BLOCK * ((L - 1) * chunk + (H - 1) * sub);
        steps = 2.0 * (L - 1) * dopt__ring_predict_pieces(chunk) + 2.0 * (H - 1) * dopt__ring_predict_pieces(sub);
    } else {
        double chunk = G / N;
        bytes = 8 * chunk * (dopt__ring_width_sum(fmt, 1, N - 1, 1) + (N - 1) * wfin);
        hops = DOPT__BLOCK * (N - 1) * chunk;
        steps = 2.0 * (N - 1) * dopt__ring_predict_pieces(chunk);
    }
    return steps * DOPT__AGG_ALPHA + bytes / DOPT__AGG_BETA + (hops * DOPT__AGG_HOP_NS + T * DOPT__AGG_OUT_NS) * 1e-9;
}

/* 1 when this allreduce goes along the ring: ternary with shared scales, majority, fp16 or
   bf16, on a communicator with exchanges, and (AUTO) at a lower predicted cost than the
   allgather's. */
static int dopt__ring_wanted(const dopt_compressor *cz, const dopt_comm *comm, size_t groups) {
    dopt_host_layout lay;
    const dopt__codec_ops *ops = dopt__codec(&cz->cfg);
    int N = comm->size, L = 1, H = N, fmt = dopt__ring_fmt(cz);
    int codec_ok = ops->ring != DOPT__RING_NONE && (!ops->shared_scale || dopt__shares_scales(cz));
    if (cz->cfg.aggregate == DOPT_AGG_ALLGATHER || !codec_ok || N < 2 || comm->eng == NULL || groups == 0 ||
        N > (fmt == DOPT__RING_INT ? DOPT__RING_MAX_RANKS : DOPT__RING_MAX_HALF_RANKS))
        return 0;
    if (cz->cfg.aggregate == DOPT_AGG_RING) return 1;
    dopt_comm_host_layout(comm, &lay);
    if (lay.hosts > 1 && lay.local > 1 && lay.two_level != DOPT_TWO_LEVEL_OFF) L = lay.local, H = lay.hosts;
    return dopt__ring_predict(fmt, groups, N, L, H, 1, 0) <
           dopt__ring_predict(fmt, groups, N, L, H, 0, (double)cz->view.msg_bytes);
}

/* ===================================================================== THE ALLREDUCE OF A VIEW */

/* The compressed allreduce of cz->view's segments of grads (a descriptor of the whole table, of
   which only those segments are read and written): PowerSGD's two allreduces, the ring, or the
   allgather. When it succeeds, the view's new residuals are in the work buffer. */
static dopt_status dopt__allreduce_view(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads) {
    const dopt__compress_view *v = &cz->view;
    const char *prev;
    dopt_status s;
    size_t j, groups = 0;
    int r, ring;
    float weight;
    if (cz->cfg.codec == DOPT_CODEC_POWERSGD) return dopt__psgd_allreduce(cz, comm, grads);
    cz->gathered = 0;
    cz->path = DOPT_PATH_NONE;
    for (j = 0; j < v->nsegs; j++)
        groups += dopt__ring_carries(cz, v->index[j]) ? dopt__ring_groups(dopt__vcount(cz, v, j)) : 0;
    ring = dopt__ring_wanted(cz, comm, groups);
    s = dopt__gather_room(cz, ring ? comm->size + 1 : comm->size);
    if (s != DOPT_OK) return s;
    cz->rank = comm->rank;
    cz->buckets = 0;
    /* on the ring, ternary's codes are written by its pipeline (dopt__ring_pipeline) */
    s = dopt__encode_local(cz, v, grads, comm->rank, cz->msg, comm, !(ring && dopt__codec(&cz->cfg)->shared_scale));
    /* A non-finite gradient goes out as a flagged message, unless scale sharing has already told
       every rank. */
    if (s != DOPT_OK && (s != DOPT_ERR_NONFINITE || dopt__shares_scales(cz))) return s;
    prev = dopt__compress_label(comm, "dopt_compress_allreduce");
    if (ring) {
        dopt_buf p = cz->ef ? dopt__spans_over(cz, cz->work) : *grads; /* what was encoded */
        s = dopt__ring_agree(cz, comm, s);
        if (s == DOPT_OK) s = dopt__ring_exchange(cz, comm, &p, grads, groups);
        dopt_comm_set_api(comm, prev);
        if (s != DOPT_OK) return s;
        if (cz->ef) dopt__ef_update(cz, v, cz->msg);
        dopt__ring_decode_small(cz, comm->size, 1.0f / (float)comm->size, grads);
        return DOPT_OK;
    }
    s = dopt_allgather(comm, cz->msg, cz->gather, v->msg_bytes);
    dopt_comm_set_api(comm, prev);
    if (s != DOPT_OK) return s;
    cz->gathered = comm->size;
    cz->path = DOPT_PATH_ALLGATHER;
    s = dopt__gathered_verdict(cz, comm->size);
    if (s != DOPT_OK) return s;
    if (cz->ef) dopt__ef_update(cz, v, cz->msg);
    weight = 1.0f / (float)comm->size;
    if (cz->cfg.codec == DOPT_CODEC_TERNARY && comm->size <= DOPT__TERN_SUM_MAX) {
        dopt__tern_average(cz, comm->size, weight, grads);
        return DOPT_OK;
    }
    if (dopt__codec(&cz->cfg)->vote) {
        dopt__vote_average(cz, comm->size, weight, grads);
        return DOPT_OK;
    }
    for (j = 0; j < v->nsegs; j++) {
        dopt_span sp = dopt_buf_segment(grads, v->index[j]);
        if (sp.count) memset(sp.ptr, 0, sp.count * sizeof(float));
    }
    for (r = 0; r < comm->size; r++) dopt__accumulate(cz, v, cz->gather + (size_t)r * v->msg_bytes, weight, grads);
    return DOPT_OK;
}

/* The allreduce of segs[0..k) (NULL: the whole table, k = nsegs), whose calls have been checked
   and given (dopt__call_check), counted into the step when it ends. */
static dopt_status dopt__allreduce_run(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads, const size_t *segs,
                                       size_t k) {
    dopt_status s;
    size_t j;
    if (segs == NULL) {
        cz->view = dopt__whole(cz);
    } else {
        memcpy(cz->part, segs, k * sizeof(size_t));
        cz->view.index = cz->part;
        cz->view.nsegs = k;
        for (cz->view.count = 0, j = 0; j < k; j++) cz->view.count += cz->segs[segs[j]].count;
        cz->view.msg_bytes = dopt__message_bytes(cz, segs, k);
    }
    s = dopt__allreduce_view(cz, comm, grads);
    dopt__step_count(cz, k, s);
    return s;
}

/* ===================================================================== NONBLOCKING CALLS

   A started call is a job of the compressor's ordered worker (distopt.h's THE ORDERED WORKER),
   created at the first start: jobs run one at a time in start order on its thread, each a
   whole blocking call. A job's arguments live in slot m mod DOPT__COMPRESS_JOBS of cz->jobs
   (its indices in as many rows of nsegs in cz->job_segs), reused once job m + that many starts:
   start first waits for the job that held the slot. */

#define DOPT__COMPRESS_JOBS 32 /* jobs in flight at most: one more start waits for the oldest */

#ifdef DOPT__THREADS
struct dopt__compress_job {
    dopt_compressor *cz;
    dopt_comm *comm;
    dopt_buf grads;     /* the descriptor, copied (its arrays are the caller's) */
    const size_t *segs; /* a row of cz->job_segs, or NULL: every segment */
    size_t k;
};

static dopt_status dopt__compress_job_run(void *arg) {
    struct dopt__compress_job *job = (struct dopt__compress_job *)arg;
    return dopt__allreduce_run(job->cz, job->comm, &job->grads, job->segs, job->k);
}

static dopt_status dopt__compress_worker(dopt_compressor *cz) {
    if (cz->worker != NULL) return DOPT_OK;
    cz->jobs = (struct dopt__compress_job *)DOPT_MALLOC(DOPT__COMPRESS_JOBS * sizeof(struct dopt__compress_job));
    cz->job_segs = (size_t *)DOPT_MALLOC(DOPT__COMPRESS_JOBS * cz->nsegs * sizeof(size_t));
    if (cz->jobs == NULL || cz->job_segs == NULL || dopt__worker_new(&cz->worker, DOPT__COMPRESS_JOBS) != DOPT_OK) {
        DOPT_FREE(cz->jobs);
        DOPT_FREE(cz->job_segs);
        cz->jobs = NULL;
        cz->job_segs = NULL;
        return DOPT_ERR_NOMEM;
    }
    cz->njobs = DOPT__COMPRESS_JOBS;
    return DOPT_OK;
}
#endif

/* Why grads does not fit the layout: the first segment that differs, both counts. */
static void dopt__misfit_said(dopt_compressor *cz, const dopt_buf *grads, const char *api) {
    size_t i = dopt__segment_misfit(cz, grads), nb = dopt_buf_nsegs(grads);
    const char *name = i < cz->nsegs ? cz->segs[i].name : NULL;
    char mine[32] = "none", theirs[32] = "none";
    if (i < cz->nsegs) snprintf(mine, sizeof mine, "%zu elements", cz->segs[i].count);
    if (i < nb) snprintf(theirs, sizeof theirs, "%zu elements", dopt_buf_segment(grads, i).count);
    snprintf(cz->detail, sizeof cz->detail,
             "%s: the gradient descriptor (%zu segments) does not fit the compressor's layout (%zu): segment %zu%s%s%s "
             "has %s in the descriptor, %s in the layout",
             api, nb, cz->nsegs, i, name ? " ('" : "", name ? name : "", name ? "')" : "", theirs, mine);
}

/* Checks a call's arguments before anything starts (segs NULL with k = 0: every segment, where
   `all` allows it); the reason of a refusal in cz->detail. */
static dopt_status dopt__call_check(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads, const size_t *segs,
                                    size_t k, int all, const char *api) {
    if (cz == NULL || cz->segs == NULL) return DOPT_ERR_INVALID;
    cz->detail[0] = '\0';
    if (comm == NULL || grads == NULL) {
        snprintf(cz->detail, sizeof cz->detail, "%s: no %s", api,
                 comm == NULL ? "communicator" : "gradient descriptor");
        return DOPT_ERR_INVALID;
    }
    if (dopt_buf_validate(grads) != DOPT_OK) {
        snprintf(cz->detail, sizeof cz->detail, "%s: the gradient descriptor is not valid (dopt_buf_validate)", api);
        return DOPT_ERR_INVALID;
    }
    if (dopt__segment_misfit(cz, grads) != SIZE_MAX) {
        dopt__misfit_said(cz, grads, api);
        return DOPT_ERR_INVALID;
    }
    if ((segs == NULL) != (k == 0) || (segs == NULL && !all)) {
        snprintf(cz->detail, sizeof cz->detail, "%s: %s", api,
                 segs == NULL && k == 0 ? "no segments (segs NULL, k 0)"
                                        : "segs and k disagree (NULL with k > 0, or k 0 with a list)");
        return DOPT_ERR_INVALID;
    }
    return DOPT_OK;
}

/* Starts a checked and given call: on the worker (threads, a communicator any thread may call), else run
   here, complete at return. */
static dopt_status dopt__call_start(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads, const size_t *segs,
                                    size_t k, dopt_compress_request *req) {
    req->cz = cz;
    req->ticket = 0;
    req->status = DOPT_OK;
#ifdef DOPT__THREADS
    if (!comm->one_thread && cz->worker != NULL) {
        struct dopt__compress_job *job;
        size_t slot = (size_t)(cz->started % (uint64_t)cz->njobs);
        if (cz->started >= (uint64_t)cz->njobs) /* the slot's last job has ended */
            (void)dopt__worker_wait(cz->worker, cz->started - (uint64_t)cz->njobs + 1);
        job = &cz->jobs[slot];
        job->cz = cz, job->comm = comm, job->grads = *grads, job->k = segs ? k : cz->nsegs, job->segs = NULL;
        if (segs != NULL) job->segs = (const size_t *)memcpy(cz->job_segs + slot * cz->nsegs, segs, k * sizeof(size_t));
        cz->started++;
        return dopt__worker_post(cz->worker, dopt__compress_job_run, job, &req->ticket);
    }
    if (cz->worker != NULL) (void)dopt__worker_wait(cz->worker, cz->started); /* nothing of cz runs beside this call */
#endif
    req->status = dopt__allreduce_run(cz, comm, grads, segs, segs ? k : cz->nsegs);
    return req->status;
}

/* ===================================================================== PUBLIC ALLREDUCE */

/* A blocking call: start and wait once a worker exists (so that it runs after the calls in
   flight), else run here. */
static dopt_status dopt__call(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads, const size_t *segs, size_t k,
                              int all, const char *api) {
    dopt_compress_request req;
    dopt_status s = dopt__call_check(cz, comm, grads, segs, k, all, api);
    if (s == DOPT_OK) s = dopt__step_give(cz, segs, segs ? k : cz->nsegs, api);
    if (s != DOPT_OK) return s;
    s = dopt__call_start(cz, comm, grads, segs, k, &req);
    return s != DOPT_OK ? s : dopt_compress_wait(&req);
}

DOPT_DEF dopt_status dopt_compress_allreduce_buf(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads) {
    return dopt__call(cz, comm, grads, NULL, 0, 1, "dopt_compress_allreduce");
}

DOPT_DEF dopt_status dopt_compress_allreduce(dopt_compressor *cz, dopt_comm *comm, float *grads, size_t n) {
    dopt_buf b;
    if (cz == NULL || cz->segs == NULL || n < cz->flat_end || (grads == NULL && n > 0)) return DOPT_ERR_INVALID;
    b = dopt_buf_flat(grads, n, cz->segs, cz->nsegs);
    return dopt_compress_allreduce_buf(cz, comm, &b);
}

DOPT_DEF dopt_status dopt_compress_allreduce_segments(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads,
                                                      const size_t *segs, size_t k) {
    return dopt__call(cz, comm, grads, segs, k, 0, "dopt_compress_allreduce_segments");
}

DOPT_DEF dopt_status dopt_compress_allreduce_start(dopt_compressor *cz, dopt_comm *comm, const dopt_buf *grads,
                                                   const size_t *segs, size_t k, dopt_compress_request *req) {
    dopt_status s;
    if (req == NULL) return DOPT_ERR_INVALID;
    req->cz = cz;
    req->ticket = 0;
    s = dopt__call_check(cz, comm, grads, segs, k, 1, "dopt_compress_allreduce_start");
#ifdef DOPT__THREADS
    if (s == DOPT_OK && !comm->one_thread) s = dopt__compress_worker(cz);
#endif
    if (s == DOPT_OK) s = dopt__step_give(cz, segs, segs ? k : cz->nsegs, "dopt_compress_allreduce_start");
    if (s != DOPT_OK) return req->status = s;
    return dopt__call_start(cz, comm, grads, segs, k, req);
}

DOPT_DEF dopt_status dopt_compress_test(dopt_compress_request *req, int *done) {
    dopt_status s;
    if (req == NULL || done == NULL) return DOPT_ERR_INVALID;
    *done = 1;
    if (req->ticket == 0) return req->status;
    s = dopt__worker_test(req->cz->worker, req->ticket, done);
    if (!*done) return DOPT_OK;
    req->ticket = 0;
    return req->status = s;
}

DOPT_DEF dopt_status dopt_compress_wait(dopt_compress_request *req) {
    if (req == NULL) return DOPT_ERR_INVALID;
    if (req->ticket == 0) return req->status;
    req->status = dopt__worker_wait(req->cz->worker, req->ticket);
    req->ticket = 0;
    return req->status;
}

DOPT_DEF const char *dopt_compress_detail(const dopt_compressor *cz) { return cz ? cz->detail : ""; }

DOPT_DEF const void *dopt_compress_message(const dopt_compressor *cz, int rank, size_t *bytes) {
    if (cz == NULL || rank < 0 || rank >= cz->gathered) return NULL;
    if (bytes) *bytes = cz->view.msg_bytes;
    return cz->gather + (size_t)rank * cz->view.msg_bytes;
}

#ifdef __cplusplus
}
#endif

#ifdef DOPT__COMPRESS_PRAGMAS
#  pragma GCC diagnostic pop
#endif

#endif /* DISTOPT_IMPLEMENTATION */
