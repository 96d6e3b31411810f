/* localsgd.h — the data-parallel driver, dopt_dp: synchronous data parallelism (the gradients
   averaged after backward: period 1, the default), local SGD with periodic model averaging
   (period, post-local warm-up, extra state buffers with a policy each, DiLoCo's outer optimizer,
   compressed deltas), CELGC as a ready composition, adaptive batch sizes (norm, inner-product and
   augmented inner-product tests), the closing call, the helpers every data-parallel host needs
   (broadcast, replica check, data shard), and per-rank state saved and loaded for exact resume.
   Part of distopt 0.1.0. MIT licence (see the end of distopt.h).

   DO THIS in exactly one C or C++ file of your program, before including the headers:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "transport_shm.h"          (the transports launch.h may start)
       #include "transport_tcp.h"
       #include "launch.h"
       #include "localsgd.h"

   Other files include the headers without the macro (localsgd.h includes clip.h and compress.h
   itself). DISTOPT_STATIC works as in distopt.h. The state files use POSIX calls (open, fsync,
   rename): under strict -std=c11 include localsgd.h first, before distopt.h and any system
   header (it then asks for POSIX itself), or build with -D_GNU_SOURCE, as the Makefile does.

   QUICK START: synchronous data parallelism in a loop with flat buffers

       dopt_comm *comm; dopt_dp dp;
       if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1;   (launch.h; says why)
       dopt_shard(nsamples, comm->rank, comm->size, &begin, &end);   (this rank's data)
       dopt_dp_init(&dp, comm, n, &(dopt_dp_config){.params = params});
                                                          (period 1: synchronous; rank 0's
                                                           parameters to every rank)
       for (step = 0; step < steps; step++) {
           loss = forward_backward(params, grads);
           dopt_dp_after_backward(&dp, grads);            (the ranks' mean gradient)
           optimizer_update(params, grads);               (any optimizer: every rank does the same)
           loss = dopt_mean(comm, loss);                  (a collective: every rank calls it)
           if (comm->rank == 0) printf("loss %f\n", loss);
       }
       return dopt_comm_finish(comm, dopt_dp_close(&dp, params));

   No status is checked inside the loop (CHECK ONCE below): a refused init or a failed
   collective makes every later call return the same status at once, dopt_dp_close returns it
   (or checks that the replicas are bitwise identical), and dopt_comm_finish ends the job and
   says why it failed. The same program runs under mpirun, srun, torchrun or with
   DOPT_WORLD_SIZE=N (launch.h).

   MORE LOOP SHAPES

   1. Synchronous SGD with compressed gradients (TernGrad): give the driver a gradient
      compressor and after_backward averages through it (the models stay identical: no other
      communication); its state is saved with the driver's:

       dopt_compressor tern;                            (init sets every field, failing or not)
       dopt_compressor_init(&tern, &(dopt_compressor_config){.seed = 42}, segs, nsegs);
                                                        (ternary, c = 2.5, scale sharing)
       dopt_dp_init(&dp, comm, n, &(dopt_dp_config){.grad_compressor = &tern});
       ... the loop above ...
       st = dopt_dp_close(&dp, params);
       dopt_compressor_free(&tern);

   2. Local SGD (post-local SGD: 100 synchronous steps, then average every 8):

       dopt_dp_config cfg;
       memset(&cfg, 0, sizeof cfg);                     (zero: the defaults)
       cfg.period = 8;
       cfg.warmup_steps = 100;
       dopt_dp_init(&dp, comm, n, &cfg);
       dopt_dp_broadcast(&dp, params);
       for (step = 0; step < steps; step++) {
           forward_backward(params, grads);
           sgd_update(params, grads);                   (the host's own optimizer)
           dopt_dp_after_step(&dp, params);       (averages after steps 0..99, then
       }                                                 after 107, 115, ...)

      Setting cfg.compressor = &topk (a compressor with error feedback) sends each average's
      model delta compressed instead of in fp32 (COMPRESSED MODEL DELTAS below); setting
      cfg.outer_lr = 0.7 and cfg.outer_momentum = 0.9 makes each average a step of DiLoCo's outer
      Nesterov optimizer (DILOCO'S OUTER OPTIMIZER below).

   3. CELGC with adaptive batches: each worker steps min(η, γ/‖g‖) on its own gradient, models
      are averaged every I steps, and at each average the workers agree on the number of
      micro-batches for the next round:

       dopt_batch bc;
       dopt_batch_config bcfg;
       memset(&bcfg, 0, sizeof bcfg);
       bcfg.test = DOPT_BATCH_NORM;                     (Var/b ≤ η²‖∇F‖², η = bcfg.eta)
       bcfg.unit_samples = 32;                          (samples per micro-batch)
       bcfg.initial_units = 2;                          (the variance needs 2 per step)
       bcfg.max_units = 16;
       dopt_batch_init(&bc, n, &bcfg);
       cfg.period = 8; cfg.batch = &bc;
       dopt_dp_init(&dp, comm, n, &cfg);
       dopt_dp_broadcast(&dp, params);
       for (step = 0; step < steps; step++) {
           memset(grads, 0, n * sizeof(float));
           for (u = 0; u < dopt_batch_units(&bc); u++) {
               forward_backward_micro(params, micro);   (mean gradient of one micro-batch)
               dopt_batch_observe(&bc, &(dopt_buf){.data = micro, .n = n}, 1.0f);
               dopt_axpy(grads, 1.0f / dopt_batch_units(&bc), micro, n);
           }
           dopt_dp_celgc_step(&dp, &(dopt_buf){.data = params, .n = n}, &(dopt_buf){.data = grads, .n = n},
                              &(dopt_celgc){.eta = eta, .gamma = gamma});
       }                                    (the step's end for the batch controller too)

   WHEN THE AVERAGE HAPPENS
     Steps are numbered 0, 1, 2, ... by the driver (one dopt_dp_after_step each). With W
     warm-up steps and period I, the models are averaged at the end of step t when t < W, or when
     (t + 1 − W) is a multiple of I. The CELGC reference code averages at the *start* of steps 0, I,
     2I, ...: the average at the start of step kI (k ≥ 1) is the average at the end of step kI − 1,
     since nothing happens in between, and the one at the start of step 0 is replaced by
     dopt_dp_broadcast (replicas start identical, so their mean is that same model up to
     the rounding of a mean of N equal floats). Averaging at the end of a step means the models
     are identical whenever dopt_dp_after_step returns from a sync — the moment a host
     evaluates or checkpoints. dopt_dp_should_sync(dp, t) tells what happens when.

   CONFIGURATION (dopt_dp_config; all zero means the defaults; NULL means all zero)

   | field        | meaning                                                    | zero means        |
   |--------------|------------------------------------------------------------|-------------------|
   | period       | I: average every I steps after the warm-up                 | 1                 |
   | warmup_steps | W: steps averaged every step before going local            | 0                 |
   | sync_grads   | 1: on synchronous steps (the warm-up, or all when I = 1)   | 0: the models are |
   |              | dopt_dp_celgc_step averages the gradients instead of the   | averaged (CELGC's |
   |              | models: CELGC with I = 1 is then synchronous clipped SGD.  | own rule)         |
   |              | Other hosts need not set it: dopt_dp_after_backward        |                   |
   |              | averages the gradients of every synchronous step.          |                   |
   | weighted     | 1: averages weighted by the samples each rank processed    | 0: plain mean     |
   |              | since the last average (unequal local batches)             |                   |
   | states       | extra buffers (momentum, Adam moments, batch-norm running  | none              |
   | nstates      | statistics): {count, policy, name} each; copied at init    |                   |
   | batch        | an initialised dopt_batch deciding the batch at each sync  | fixed batch       |
   | keep_anchor  | 1: keep the model of the last average (n floats); implied  | 0                 |
   |              | by an across-worker batch estimator and by a compressor    |                   |
   | compressor   | a compress.h compressor for the model deltas (below)       | fp32 averages     |
   | grad_        | a compress.h compressor for the gradient averages of       | fp32 gradient     |
   |  compressor  | synchronous steps (CELGC's only with sync_grads)           | averages          |
   | outer_lr     | DiLoCo's outer step size on each model average (below)     | 1 (plain average) |
   | outer_       | its Nesterov momentum μ, in [0, 1)                         | 0                 |
   |  momentum    |                                                            |                   |
   | nonfinite    | what an average that is not finite does (NON-FINITE        | DOPT_NONFINITE_   |
   |              | AVERAGES below): DOPT_NONFINITE_FAIL or _SKIP              |  FAIL             |
   | params       | the host's flat parameters (n floats): init broadcasts     | no broadcast at   |
   |              | rank 0's to every rank, as dopt_dp_broadcast does          | init              |
   | grads        | the gradients' descriptor for buckets during backward      | no buckets until  |
   |              | (OVERLAP below), copied: flat with a segment table, or a   | dopt_dp_set_grads |
   |              | scatter list                                               |                   |
   | bucket_bytes | a bucket's size (OVERLAP)                                  | the rule's        |
   | first_bucket_| the first bucket's                                         | min(1 MiB,        |
   |  bytes       |                                                            |  bucket size)     |
   | overlap_check| 1: a write to a segment after its mark is caught (debug)   | 0                 |
   | elastic      | 1: a model average that fails because a rank was lost goes | 0: the failure is |
   |              | on over the survivors, and restarted workers are taken     | returned          |
   |              | back (ELASTIC below); the communicator must have           |                   |
   |              | on_peer_lost = DOPT_SHRINK                                 |                   |

   Policies of extra state buffers at every model average: DOPT_STATE_AVERAGE (averaged with the
   parameters, in the same allreduce), DOPT_STATE_KEEP (left local), DOPT_STATE_RESET (set to 0).

   ADAPTIVE BATCH SIZE (dopt_batch_config; zero means the default)

   | field         | meaning                                                    | zero means        |
   |---------------|------------------------------------------------------------|-------------------|
   | test          | DOPT_BATCH_NORM, DOPT_BATCH_INNER_PRODUCT, _AUGMENTED       | NORM              |
   | estimator     | DOPT_BATCH_WITHIN (micro-batch gradients the host reports) | WITHIN            |
   |               | or DOPT_BATCH_ACROSS (spread of the workers' model deltas) |                   |
   | eta           | norm test: Var/b ≤ η²‖∇F‖²                                 | 0.1               |
   | theta         | inner-product test: Var(⟨∇f_i,ĝ⟩)/b ≤ θ²‖∇F‖²              | 0.1               |
   | nu            | orthogonality test: Var(∇f_i − ⟨∇f_i,ĝ⟩ĝ)/b ≤ ν²‖∇F‖²      | 0.1               |
   | unit_samples  | samples per unit (micro-batch); b = units · unit_samples   | 1                 |
   | initial_units | units per step at the start                                | 1                 |
   | max_units     | cap                                                        | 64·initial_units  |
   | multiple      | units are rounded up to a multiple of this                 | 1                 |
   | projection    | WITHIN, inner-product tests: the direction ĝ. AUTO: EXACT  | PROJECT_AUTO      |
   |               | (the step's gradient, (max_units + 1)·n floats) when that  |                   |
   |               | fits DOPT_BATCH_EXACT_BYTES (256 MiB), else PREVIOUS (the  |                   |
   |               | previous step's mean, n floats; a WARN says so)            |                   |
   | history       | WITHIN: weight h in [0, 1) of earlier rounds' statistics   | 0: the round's    |
   |               | (a round k rounds back counts h^k): the library's variant  | own alone         |
   | bias_corrected| 1: ‖∇F‖² without the batch mean's upward bias (the         | 0: the plain      |
   |               | library's variant); 0: the plain estimate, as the paper's  | estimate          |
   | max_growth    | G ≥ 1: one decision multiplies the units by G at most      | 0: unbounded      |

   The defaults are the paper's test (Lau, Li, Xu, Liu, Kolar 2024, as its first author's
   reference code computes it): the plain estimate of ‖∇F‖² from the batch that moved the
   parameters, the batch compared being the one the update averaged — N·b on a synchronous step
   (gradients averaged over N workers: the warm-up, period 1), the worker's own b on a local step
   — and the current direction for the inner-product tests. bias_corrected, history and
   DOPT_BATCH_PROJECT_PREVIOUS are this library's variants, each a departure documented in
   REFERENCE FOR CONTRIBUTORS below with what it changes.

   What a user needs of the tests: every rank reaches the same decision (its inputs are results
   of scalar allreduces), the size is monotone, rounded up to `multiple`, capped at max_units and,
   with max_growth, at ×G per decision; a round that cannot decide keeps the size, counts in
   bc->undecided and says why in the communicator's log. An estimate of ‖∇F‖² at or below 0
   (possible bias-corrected, or plain on a synchronous step: the round's noise accounts for all of
   the observed gradient) passes no batch: the size goes to the cap (or ×G), bc->nonpositive
   counts it and a WARN names the decision and the estimate. WITHIN needs two micro-batches per
   step at least (initial_units ≥ 2). Choose η from the batch you can afford: run once, read
   dopt_batch_stats (bc->last) and take η ≈ √(Var/(b_max·‖∇F‖²)) for the b_max (samples of the
   update's gradient) you want reached when the gradient is that small; a strict η asks for a
   batch far beyond any cap at the first decision (the test's honest answer). history smooths
   the noisy estimate of ‖∇F‖² of a round with few micro-batches, at the price of a lag of about
   1/(1 − h) rounds. ACROSS reads model deltas as gradient sums: plain SGD only (not momentum,
   adaptive optimizers or CELGC, which refuses it). The tests' formulas, the estimators'
   derivations and measured behaviour are in REFERENCE FOR CONTRIBUTORS below.

   FUNCTIONS (driver)

   dopt_status dopt_dp_init(dopt_dp *dp, dopt_comm *comm, size_t n,
                                  const dopt_dp_config *cfg)
     Sizes a driver for parameters of n elements (flat or a scatter list of n in all). Allocates
     the averaging workspace (n + the AVERAGE states' elements) and the anchor when kept; copies
     the state table. comm is borrowed (it must outlive the driver); cfg->batch is borrowed too.
     cfg->compressor and cfg->grad_compressor are borrowed as well (they must be two different
     objects). Errors: DOPT_ERR_INVALID (NULL dp or comm, a bad policy, a batch controller whose
     estimator needs n elements and has another count, a compressor whose segments do not cover
     exactly n packed elements, a compressor with `weighted`, a grad_compressor that is the
     same object as compressor, outer_lr negative or not finite, outer_momentum
     outside [0, 1), nonfinite not a policy), DOPT_ERR_NOMEM. The object must not move after
     init. On failure nothing needs freeing, and the driver keeps the status and its reason: every
     later call returns that status at once, and dopt_dp_close returns it with the reason in
     dopt_dp_detail (check once: a host need not test init's result). Not a collective, unless
     cfg->params is given: then, once the driver is made, init broadcasts rank 0's parameters
     (dopt_dp_broadcast) and returns its status; a failed broadcast poisons the communicator as
     any collective does, and the driver, made, is closed or freed as usual. A scatter list is
     broadcast with dopt_dp_broadcast_buf after init.

   void dopt_dp_free(dopt_dp *dp)
     Releases what init allocated (not comm, not the batch controller). NULL or zeroed: accepted.

   int dopt_dp_should_sync(const dopt_dp *dp, uint64_t step)
   int dopt_dp_is_synchronous(const dopt_dp *dp, uint64_t step)
     should_sync: 1 when dopt_dp_after_step at the end of `step` averages (see WHEN THE
     AVERAGE HAPPENS). is_synchronous: 1 during the warm-up, and always when the period is 1.
     Pure.

   dopt_status dopt_dp_broadcast(dopt_dp *dp, float *params)
   dopt_status dopt_dp_broadcast_buf(dopt_dp *dp, const dopt_buf *params,
                                           const dopt_buf *states)
     Collective: rank 0's parameters (and every extra state buffer) to every rank; records the
     anchor. Call once before the first step (and after loading the host's checkpoint if ranks
     loaded different files). states is an array of nstates descriptors (NULL when nstates = 0);
     the flat form needs nstates = 0. Where something averages from the anchor — a delta
     compressor, the outer optimizer, an ACROSS batch controller — a step before the anchor was
     set (by this call, cfg.params or dopt_dp_load) is refused: after_backward, after_step,
     celgc_step and sync return DOPT_ERR_INVALID, count nothing, and the detail names the reader
     and this call. (Taking the anchor from the parameters at the first driver call would take it
     after the first step moved them; an average against the zeros it holds until then would be
     wrong: DiLoCo's first outer step at lr 0.7, μ 0.9 would set x to 1.33× the mean.)

   dopt_status dopt_dp_after_backward(dopt_dp *dp, float *grads)
   dopt_status dopt_dp_after_backward_buf(dopt_dp *dp, const dopt_buf *grads)
     On a synchronous step (every step at period 1, the warm-up otherwise): averages the
     gradients in place (through grad_compressor when set; weighted by the step's samples when
     `weighted`), and the after_step of that step then averages nothing: the models stay
     identical because every rank applies the same update. A flat buffer (with or without a
     segment table, no gaps) is averaged where it lies, without a copy; a scatter list, or a
     table with gaps, is packed into the driver's workspace and back (the same bits either way).
     On a local step: DOPT_OK at once, without communication. Call it between backward and the
     optimizer's update. After a transport's error a flat buffer may hold part of an average
     (the communicator is poisoned: the step is lost either way). A host that
     never calls it has its models averaged by after_step instead (exact for SGD, not for
     optimizers with state: call it). An average that is not finite (a NaN or an infinity in any
     rank's gradient, or a sum beyond the float range) returns DOPT_ERR_NONFINITE on every rank
     and leaves zeros in grads on every rank; what follows is the policy's (NON-FINITE AVERAGES).
     A host that never calls after_step has its steps counted here: a second after_backward with
     no after_step between ends the step before it (STEPS below).

   dopt_status dopt_dp_after_step(dopt_dp *dp, float *params)
   dopt_status dopt_dp_after_step_buf(dopt_dp *dp, const dopt_buf *params,
                                            const dopt_buf *states)
     Counts the step and, when it is a sync, averages parameters and AVERAGE states in one
     allreduce, zeroes the RESET states, runs the batch decision, and moves the anchor. A
     collective on sync steps only. Steady state: no allocation. Errors: DOPT_ERR_INVALID
     (layout differs from init: not n elements, wrong number of states or sizes — found before any
     communication, and the step is not counted), and the transport's errors (the communicator's
     detail names them; the parameters are then unchanged).

   dopt_status dopt_dp_sync(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states)
     Averages now, whatever the schedule: before the host evaluates or saves mid-round (darknet syncs its nets
     before it saves weights). Ends the round as a scheduled average does (AVERAGE and RESET
     states, the anchor, the batch decision) but is not a step: the schedule does not move. A
     round of no local step (right after an average, or only synchronous steps) returns DOPT_OK
     without communication: every rank counts steps alike, so every rank skips alike. Collective
     otherwise; errors as dopt_dp_after_step.

   dopt_status dopt_dp_celgc_step(dopt_dp *dp, const dopt_buf *params, const dopt_buf *grads,
                                  const dopt_celgc *rule)
     CELGC (Liu et al. 2022), one step: after_backward (gradient average on synchronous steps
     with sync_grads), x ← x − min(η, γ/‖g‖)·(scale·g + wd·x) with clip.h's dopt_celgc_step on
     this worker's own gradient, then after_step with rule->states (the extra state buffers, as
     dopt_dp_after_step_buf takes them; NULL when none). rule is clip.h's dopt_celgc (eta, gamma,
     weight_decay, scale: 0 means 1), e.g. &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}. Arguments
     are checked before any communication (DOPT_ERR_INVALID, also for a NULL rule and for an
     ACROSS batch controller, which reads deltas as gradient sums: clipped steps are not). With
     period 1 and sync_grads this is synchronous clipped SGD (gradients averaged, then clipped);
     with period 1 and without sync_grads, CELGC at I = 1 as its paper runs it (each worker clips
     its own gradient, the models are averaged after every step). A NaN or infinity in the
     gradient: without sync_grads this worker skips its update, the average still happens when
     due, and the call returns DOPT_ERR_NONFINITE on this rank; with sync_grads the gradient
     average has NON-FINITE AVERAGES' rule (under SKIP every rank skips its update and the step
     is counted). grads is averaged in place on synchronous steps with sync_grads.

   dopt_status dopt_dp_check_replicas(dopt_dp *dp, const dopt_buf *params, int *identical,
                                      double *max_diff)
     Collective: *identical = 1 when every rank's parameters are bitwise identical (one
     allgather of a 64-bit FNV-1a checksum and the step); otherwise one elementwise MAX allreduce in the
     workspace and one scalar one give *max_diff, the largest |x_r,i − x_q,i| over elements and
     ranks (0 when identical). Either output may be NULL. Same answer on every rank.

   dopt_status dopt_dp_close(dopt_dp *dp, float *params)
   dopt_status dopt_dp_close_buf(dopt_dp *dp, const dopt_buf *params,
                                 const dopt_buf *states)
     The closing call, once at the end of training, on every rank: averages a last round
     shorter than the period (as dopt_dp_sync), checks that the replicas are bitwise identical
     and at the same step, and releases the driver (dopt_dp_free after it is harmless; every
     other call then returns DOPT_ERR_CLOSED). Returns DOPT_OK, the communicator's status when
     it was poisoned, or DOPT_ERR_MISMATCH when the replicas differ; dopt_dp_detail(dp) then
     says which ranks hold other parameters than rank 0 and the largest difference, or that
     the ranks are at different steps, and the same words go to the communicator's detail
     (without poisoning it), which dopt_comm_finish prints. The host's end of a job is then

         return dopt_comm_finish(comm, dopt_dp_close(&dp, params));

   dopt_status dopt_dp_save(dopt_dp *dp, const char *path)
   dopt_status dopt_dp_load(dopt_dp *dp, const char *path)
     This rank's library state — step, syncs, the round's sample count, the anchor, the layout
     and policies, and the batch controller (size, accumulators, direction) — to a file: header
     "DOPTLSGD", format version (4; files of versions 1 to 3 are refused), world size, rank, layout,
     then the state — with the outer momentum, the batch round's sums and the host's bytes
     (dopt_dp_host_state) — then a 64-bit FNV-1a
     checksum of everything before it. Written atomically: a temporary file in the same
     directory, fsync, rename, fsync of the directory. Parameters, gradients and the host's
     optimizer state are the host's to save. Load refuses, leaving the driver unchanged:
     DOPT_ERR_IO (cannot open or read), DOPT_ERR_PROTOCOL (not such a file, another format
     version, a bad checksum, truncated), DOPT_ERR_INVALID (another world size, rank, element
     count, period, warm-up, host state size, state table, batch or outer-optimizer
     configuration).
     dopt_dp_detail(dp) then says which, in words. Save refuses (DOPT_ERR_INVALID) in the
     middle of a step with an EXACT-projection controller: the step's micro-batch gradients are
     not saved; save between steps. Save and load allocate a buffer the size of the file (they are
     not steady-state calls). Not collectives: each rank saves and loads its own file.

   dopt_status dopt_dp_host_state(dopt_dp *dp, void *bytes, size_t size)
     Registers size bytes of the host's own state that belong with the driver's: the data
     loader's position, an epoch counter, RNG counters (plain values, no pointers). dopt_dp_save
     writes them into the state file, dopt_dp_load copies them back into bytes, and a worker
     taken back (ELASTIC) receives the sending member's bytes in its dopt_dp_broadcast. The
     memory stays the host's and must live as long as the driver; registering again replaces
     it, size 0 removes it. Its size is part of the layout: a file or a job whose host state
     has another size is refused naming both. Every rank registers the same size (the bytes
     may differ: each rank saves its own). Returns DOPT_ERR_INVALID for size > 0 at NULL or
     inside a step whose marks are in flight.

   dopt_status dopt_dp_set_step_samples(dopt_dp *dp, double samples)
     The samples this rank processes per step from now on (unequal local batches: the last shard
     smaller, heterogeneous workers); 0 returns to the default, the batch controller's
     units · unit_samples, or 1 without one. They weigh this rank in `weighted` averages and in
     the ACROSS estimator. Saved with the state. DOPT_ERR_INVALID: negative or not finite.

   const char *dopt_dp_detail(const dopt_dp *dp)
     The driver's last error in words, which names the communicator's detail too; when the
     driver has none, the communicator's own detail (an error in a collective the host called
     itself); "" when neither failed. Owned by the driver or the communicator.

   CHECK ONCE
     Once its communicator is poisoned (any error in a collective of it or of a group split
     from it), every call of the driver — after_backward, after_step, sync, broadcast,
     celgc_step, check_replicas, a local step that would not communicate included — returns the
     communicator's status at once, sends nothing and counts no step; so a training loop may
     ignore the statuses inside a step and check the last one, once per step or per epoch. A
     non-finite average under DOPT_NONFINITE_FAIL stops the driver the same way (the
     communicator itself stays usable: dopt_mean and the host's own collectives go on). A
     mistake in a step's marks (OVERLAP) does not stop it: that step's after_backward returns
     DOPT_ERR_INVALID on every rank, once, and later calls go on; a loop that checks only its
     last status learns it from the ERROR line the communicator's log callback gets.

   NON-FINITE AVERAGES
     Every average the driver makes — fp32, fp16/bf16 and every codec, the gradients of
     synchronous steps (after_backward, celgc_step with sync_grads) and the models of local SGD
     (after_step, sync, close) — has one verdict: finite or not, taken from bits every rank holds
     identically (the averaged result, or the compressor's flags), so every rank reaches the same
     verdict in the same call, and it tests bits, so it holds under -Ofast and -ffast-math. A
     flat gradient buffer, averaged in place, is scanned (dopt_all_finite): the average after,
     and in fp32 this rank's input before the average overwrites it (a compressor refuses a
     non-finite input on every rank itself). Elsewhere the verdict rides on the copies the
     driver makes anyway (dopt_copy_finite), and a model average carries every rank's flag in
     one float more of its allreduce, so the verdict is known before anything is written; the
     cost of both beside the fp32 allreduce is measured in the distopt repository's
     docs/reliability.md. One allgather, only then,
     names the first non-finite element (segment by name, from the descriptor's table or the
     compressor's) and the ranks whose input held NaN or infinity, or says that every input was
     finite and the sum overflowed. dopt_dp_detail then reads, for example:
         dopt_dp_after_backward: the gradient average of step 51 is not finite (first at segment
         3 (layer1), element 17): the input of rank 1 held NaN or infinity; ...
     A gradient average that is not finite leaves zeros in grads on every rank, under either
     policy (replicas stay identical even when the host applies them). Then:
     - DOPT_NONFINITE_FAIL (the default): the driver stops. The call returns DOPT_ERR_NONFINITE,
       one DOPT_LOG_ERROR line says the detail, and every later call returns DOPT_ERR_NONFINITE
       at once; dopt_dp_close returns it and puts the detail in the communicator's, which
       dopt_comm_finish prints before the rank exits 1. A loop that checks nothing ends loudly.
       A model average that is not finite leaves every rank's parameters as they were — but for
       an average of finite models that overflows the float range, which is found as it is
       written: the parameters then hold it (the same on every rank), and the driver stops
       under either policy.
     - DOPT_NONFINITE_SKIP: the step is skipped on every rank and the driver goes on. The call
       returns DOPT_ERR_NONFINITE; grads holds zeros; dp.skipped counts such averages; a
       DOPT_LOG_WARN line says the detail (each of the first 8, then the 16th, 32nd, 64th, ...).
       The host skips its update as mixed-precision loss scaling does:

           if (dopt_dp_after_backward(&dp, grads) == DOPT_ERR_NONFINITE) continue;

       (a host that applies the zeros anyway moves only by its optimizer's momentum or decay,
       alike on every rank). A model average that is not finite is replaced by the plain mean,
       in fp32, of the ranks whose parameters and AVERAGE states are finite (without the outer
       step or the across-worker statistics; the compressor's residual is left as it was), and
       every rank continues from it; the round ends as usual. When no rank is finite the driver
       stops as under FAIL.
     celgc_step without sync_grads clips each worker's own gradient: a non-finite one there is
     this rank's alone — it skips its own update and returns DOPT_ERR_NONFINITE on this rank only
     (nothing is averaged, so nothing is stopped); the model average that follows has the rule
     above.

   ELASTIC (dopt_dp_config.elastic; the communicator made with on_peer_lost = DOPT_SHRINK)
     Local SGD goes on when a worker dies. When a model average (after_step, sync) fails with
     DOPT_ERR_PEER_LOST or DOPT_ERR_TIMEOUT, the driver shrinks the communicator
     (dopt_comm_shrink: the survivors agree, rank 0 may be the one lost) and averages the round
     again over the survivors: their own models of this round, which a failed average leaves as
     they were, so no survivor's work is lost and the lost worker's round is dropped (its model
     died with it). A survivor whose own average had completed before the death (the dead
     rank's last bytes reached it) goes on and fails at its next call (or in the dopt_comm_grow
     after the average, when a joiner waits: below): then the survivors all take the state
     of the last average any of them completed — that rank's model of the average (the anchor,
     which elastic keeps: n more floats), its AVERAGE states as they are, its outer momentum and
     counters — and drop their local steps since, at most a round; every replica is identical
     again either way. The same when the survivors
     learn of the death in a collective of the host's own on the communicator (a loss logged
     with dopt_allreduce): the next after_step or sync finds the failure, goes on from the last
     average, and does not count its step. A rank lost during this is handled the same way,
     until fewer than the communicator's min_ranks survive: then the call returns DOPT_ERR_PEER_LOST on every
     survivor, with the reason. The weighted mean and the division by the world size follow the
     survivors. What the host does, after each after_step or sync:

         st = dopt_dp_after_step(&dp, params);
         if (dp.comm != comm) {            // a worker was lost (or one came back): a new communicator
             dopt_comm_destroy(comm);      // the old one is the host's to destroy
             comm = dp.comm;               // rank and size changed: take the new shard
             take_shard(comm->rank, comm->size, dp.step);
         }

     The host goes on from dp.step, which moves back to the last average's step where local
     steps were dropped; dp.shrinks counts the shrinks. Each survivor's log callback gets WARN
     lines saying what happened ("elastic: rank 1 of 4 lost rank 3; the survivors go on, this
     one as rank 1 of 3"). The lost worker's data is the host's to redistribute (examples/elastic_sgd.c
     gives every survivor a larger shard) or to drop. Not covered (refused at init, naming it):
     sync_grads, gradient buckets, compressors (their residuals are per rank) and batch
     controllers; a gradient average (after_backward on a synchronous step: the warm-up or
     period 1) that loses a rank returns the failure as without elastic.

     Taking a worker back. A process started to join (dopt_tcp_config.join, dopt_shm_config.join
     or DOPT_JOIN=1; transport_tcp.h: RE-ADMIT, transport_shm.h: TAKING A WORKER BACK) asks a
     member to take it in, and the member holds it. Every model
     average says whether a member holds one (a float more in its allreduce: nothing more is
     sent while nobody waits), and when one does, every member calls dopt_comm_grow right after
     it: the job goes on as the larger communicator (dp.comm changes, as after a shrink: the host
     code above takes the new shard; dp.grows counts) and the members' rank 0 sends the joiners
     the job's state, in a group of them alone: the state file's bytes (dopt_dp_save's form: the
     layout, the step and counters, the anchor, which is the model of that average, the outer
     momentum, the sending member's host bytes, dopt_dp_host_state) and then the AVERAGE
     states, about 2n floats with the outer step. Every member makes the same bytes (the host
     bytes aside: each rank's are its own, and a hash of the sender's is agreed separately) and
     they agree on their size and a hash of them first (one allreduce);
     members that disagree have replicas that differ, and nobody is given a state
     (DOPT_ERR_MISMATCH everywhere). The joiner checks the version, the layout, the size and
     the hash before it takes anything. The joiner's host does what a fresh start does, with the
     members' configuration:

         dopt_tcp_create(&comm, &tcfg);       // tcfg.join = 1: returns once the members took it in
         dopt_dp_init(&dp, comm, n, &cfg);    // dp.joining is 1 (comm->rank >= comm->grown_from)
         dopt_dp_host_state(&dp, &pos, sizeof pos);  // if the members register one
         dopt_dp_broadcast(&dp, params);      // takes the job's state instead of rank 0's model
         take_shard(comm->rank, comm->size, dp.step);   // then trains as a member

     Its KEEP states stay as its host set them, its RESET states are zeroed, its per-step
     samples (dopt_dp_set_step_samples) stay its own; its host bytes are the sender's (keep
     there what is the job's, an epoch or a position in a shared order, or what a joiner can
     derive its own from). A joiner configured otherwise (another n, period, warm-up, states,
     host state size, outer step) takes part in the transfer and refuses it:
     DOPT_ERR_INVALID, naming the first difference ("elastic: the job runs with element count
     300, this driver has 301"); one whose bytes arrived corrupt refuses with
     DOPT_ERR_PROTOCOL. Its host leaves, and the members lose it at their next average and go on
     without it; the worker may be started again. A rank lost while the joiners come in or take the state
     is left out as in a shrink: a joiner then takes the state from the lowest member that holds
     it ("elastic: this joiner takes rank 0's model and goes on from step 12"), or, when no member
     is left, fails with DOPT_ERR_PEER_LOST. The log says each step ("elastic: rank 0 of 2 takes
     in 1 joiner(s) after step 19; the job goes on as 3 ranks", "elastic: sent the job's state
     (0.0012 MB) to 1 joiner(s) in 0.025 ms (48 MB/s)"); dp.state_bytes and dp.state_ms keep the
     last transfer's size and time, on rank 0 and on the joiners.

   STEPS
     Steps are counted by dopt_dp_after_step. A host that calls only after_backward (README's
     drop-in) has its synchronous steps counted there: when an after_backward finds the step
     before it averaged and no after_step since, that step is over. dopt_dp_close and
     dopt_dp_save count the last one the same way. The details and the closing call's same-step
     check then name the host's own step numbers (0 for the first call).

   FUNCTIONS (adaptive batch)

   dopt_status dopt_batch_init(dopt_batch *bc, size_t n, const dopt_batch_config *cfg)
   void dopt_batch_free(dopt_batch *bc)
     n: elements of the gradients dopt_batch_observe will see (WITHIN; 0 is fine for ACROSS).
     Allocates n doubles and n floats (WITHIN), or n doubles and (max_units + 1)·n floats (WITHIN with
     DOPT_BATCH_PROJECT_EXACT, which AUTO chooses for the inner-product tests when it fits
     DOPT_BATCH_EXACT_BYTES; bc->cfg.projection says which). DOPT_ERR_INVALID for a bad test,
     estimator or projection, a negative/NaN threshold, history outside [0, 1), max_growth
     neither 0 nor ≥ 1, max_units < initial_units; DOPT_ERR_NOMEM.

   size_t dopt_batch_units(const dopt_batch *bc)
     The units (micro-batches) per step the host should run now.

   dopt_status dopt_batch_observe(dopt_batch *bc, const dopt_buf *grad, float scale)
     WITHIN: one micro-batch's mean gradient (scale·grad = +∇ of its mean loss), taken at the
     current step's parameters; all of a step's before dopt_dp_after_backward (on a synchronous
     step the driver reads their sum there). O(n) (EXACT: O(n) more, a copy), no allocation, no
     communication. A step with a micro-batch that is not finite is left out of the statistics
     at its end (bc->steps_dropped counts it). DOPT_ERR_INVALID: another element count; EXACT, more than max_units
     micro-batches in one step.

   void dopt_batch_averaged(dopt_batch *bc, int workers)
     The current step's update uses the gradient averaged over `workers` ranks (a synchronous
     step): the test then compares the global batch, workers·b, and the plain ‖∇F‖² is that of
     the global mean (SYNCHRONOUS STEPS in the reference below). Call it between the step's
     observations and dopt_batch_end_step; the driver calls it on every step whose gradients it
     averaged. A step without it is a local step (workers = 1). O(1).

   void dopt_batch_end_step(dopt_batch *bc)
     WITHIN: the current step's micro-batches are all observed (the parameters move next). Its
     spread around its own mean joins the round's statistics. dopt_dp_after_step calls it;
     without the driver, call it after each step's micro-batches. A step without observations
     (or a second call) does nothing. O(n) (EXACT: O(k·n)), no communication.

   dopt_status dopt_batch_decide(dopt_batch *bc, dopt_comm *comm)
     Collective (one scalar allreduce): closes an open step, pools the WITHIN statistics of the
     round, updates the size, starts a new round. The driver calls it at each sync; call it
     yourself without the driver (synchronous training, e.g. every k steps). comm may be NULL
     (this process alone; nothing is logged then). For ACROSS the driver computes the
     statistics; this call returns DOPT_ERR_INVALID.

   size_t dopt_batch_next_units(const dopt_batch_config *cfg, size_t current_units,
                                const dopt_batch_stats *st, double *needed_samples)
     The decision rule alone, pure: the units for the next round given statistics (defaults
     applied to zero fields of cfg). *needed_samples (may be NULL) receives b_needed, the samples
     the update's gradient needs (st->workers·b of them on a synchronous round; +∞ when the
     estimate of ‖∇F‖² is ≤ 0 under noise), or NaN when the statistics cannot decide; each
     worker's share is b_needed/st->workers. bc->last holds the statistics of the last decision.

   FUNCTIONS (helpers)

   dopt_status dopt_broadcast_buf(dopt_comm *comm, const dopt_buf *buf, int root)
     Collective: each segment of buf from root (one broadcast per segment; gaps untouched). Every
     rank must describe its buffer with the same segment sizes; the driver's
     dopt_dp_broadcast has no such condition (it goes through the workspace in pieces).

   dopt_status dopt_shard(size_t total, int rank, int size, size_t *begin, size_t *end)
     This rank's [begin, end) of total samples: contiguous, in rank order, sizes differing by at
     most one (the first total % size ranks get one more). DOPT_ERR_INVALID for size < 1 or a
     rank outside [0, size).

   Per-rank seeds for the host's own generators (shuffling, dropout): dopt_seed_for_rank(seed,
   rank) in distopt.h.

   THREADING
     A driver and a batch controller are used by one thread at a time; the communicator's rules
     apply to every collective above.

   COMPRESSED MODEL DELTAS
     With cfg.compressor (an initialised compress.h compressor, borrowed, whose segment table
     covers the n packed parameter elements without gaps), each model average sends the delta
     x_m − x_anchor through dopt_compress_allreduce instead of the fp32 parameters: the new model
     is x_anchor + (1/N) Σ_m C(x_m − x_anchor), the same bytes on every rank. With a biased codec
     (top-k, sign) the compressor's error feedback keeps what C dropped and adds it to the next
     round's delta; its residual and step are saved in the state file with the rest. AVERAGE
     state buffers still go in fp32. Not with `weighted` (DOPT_ERR_INVALID at init: the compressed
     allreduce takes a plain mean). Synchronous gradient averages go through
     cfg.grad_compressor when one is given (below), else in fp32.

   DILOCO'S OUTER OPTIMIZER (Douillard et al. 2023)
     With outer_lr ≠ 1 or outer_momentum > 0, every model average (scheduled, on demand, in the
     warm-up when the gradients were not averaged) is a step of an outer optimizer: with the pseudo-gradient
     Δ = x_anchor − mean_m(x_m), v ← μ·v + Δ and x_anchor ← x_anchor − lr·(Δ + μ·v) (Nesterov), and
     every worker continues from the new anchor. DiLoCo uses lr 0.7, μ 0.9 with an inner AdamW
     and 500 local steps. lr = 1 with μ = 0 is the plain average and takes the plain path, bit for
     bit. The anchor is kept (n floats) and v is n floats more; both are saved with the state.
     With cfg.compressor the pseudo-gradient is the mean of the compressed deltas (with the
     compressor's error feedback). Gradient averages are not model averages and do
     not go through it; AVERAGE state buffers are averaged plainly.

   COMPRESSED GRADIENTS
     With cfg.grad_compressor (same requirements as cfg.compressor, a different object),
     dopt_dp_after_backward — and dopt_dp_celgc_step with sync_grads — averages the
     gradients of synchronous steps through dopt_compress_allreduce: (1/N) Σ_m C(g_m), the same
     bytes on every rank, in the gradient buffer itself when it is flat, else packed into the
     workspace first (any descriptor works). Its state (error-feedback residual, step) is saved
     with the driver's. Both compressors may be set: compressed gradients during the warm-up,
     compressed deltas after it.

   OVERLAP: GRADIENTS AVERAGED WHILE BACKWARD RUNS
     A synchronous step otherwise costs backward plus the average. A host whose backward runs
     layer by layer says when each segment of its gradients is final, and buckets of segments
     are averaged while backward computes the next ones:

       dopt_dp_init(&dp, comm, n, &(dopt_dp_config){.grads = &gbuf});
                                       (gbuf: a flat buffer with a segment table, or a scatter list)
       for (step = 0; step < steps; step++) {
           forward(params);
           for (l = layers - 1; l >= 0; l--) {              (the host's backward, last layer first)
               layer_backward(l, grads);
               dopt_dp_grad_ready(&dp, l);                  (segment l of gbuf is final)
           }
           dopt_dp_after_backward_buf(&dp, &gbuf);          (waits for the buckets; as before after)
           update(params, grads);
       }

     dopt_dp_set_grads(dp, grads) registers the descriptor when the buffer exists only later
     (llm.c allocates its gradients in the first backward), or again when it moves, before a
     step's first mark. The descriptor is copied (its table or spans; segment names are
     borrowed), and after_backward must be given the same buffer. A step whose segments are
     never marked is averaged whole, as without buckets.

     Rules.
     - A marked segment belongs to the average until after_backward returns: do not write it
       (its mean is written there meanwhile) or read it. With overlap_check = 1 (for debugging:
       it costs a copy in, a copy out and a checksum of every segment) the buckets average a
       copy, the gradients stay untouched until after_backward, and a segment written after its
       mark is a mistake in the marks (below).
     - Each segment is marked once in a synchronous step that marks any: the second mark of a
       segment, or a mark of a segment the table does not have, returns DOPT_ERR_INVALID at once.
       Mistakes in the marks (a segment marked twice, unknown, never marked, written after its
       mark under overlap_check, or after_backward given other gradients than those marked) are
       said by after_backward on EVERY rank alike: every bucket of the step still runs (unmarked
       segments go as they are), then the ranks agree a verdict (one allreduce of 8 bytes per
       step that marks), and every rank returns DOPT_ERR_INVALID with the same detail, naming the
       lowest rank that erred, its first mistake and the segment ("dopt_dp_after_backward: step
       7: rank 2: segment 3 ('h0.b') was marked twice ..."). Every rank's gradients are then
       zeros, the step counts, and the driver and the communicator go on: the next step may
       proceed. A segment without a
       gradient in a step is declared with dopt_dp_grad_unused(dp, seg): it is zeroed and
       averaged as zeros on that rank, so its mean is the sum over the ranks that had one, over N
       (as PyTorch DDP's find_unused_parameters); skipping it on every rank alike would need an
       agreement every step.
     - Marks on a step that is not synchronous (local SGD) do nothing and return DOPT_OK: call
       dopt_dp_grad_ready unconditionally.
     - From a step's first mark until its after_backward returns, make no collective call on the
       communicator or its groups: the buckets' collectives are running. `weighted` reads the
       step's samples (dopt_dp_set_step_samples) at the first mark.

     Buckets. A bucket's average starts once its last segment is marked and the buckets before
     it have started, so every rank starts the same buckets in the same order whatever order its
     marks come in. The first step that marks cuts buckets from the segment table in reverse
     (backward's order: the last segment first), the first up to first_bucket_bytes so that
     communication starts early, the others up to bucket_bytes (4 MiB while the link is not
     measured yet), and records the order this rank marked in. That step's after_backward
     compares every rank's order (one allgather of nseg + 1 words). The same: the buckets are cut
     again in that order, once for the driver's life. Different: DOPT_ERR_MISMATCH on every rank,
     the detail naming the first position that differs, the segments there and the ranks, and
     the driver stops. A segment is never split: one larger than a bucket is a bucket alone.

     The bucket size. bucket_bytes > 0 is used as given. At 0, the first step's after_backward
     also measures the link: three allreduces of 8 bytes run as buckets run (on the worker, so
     alpha, the fastest, counts the hand-over to it) and one of up to 4 MiB (time t), the rate R = bytes/(t − alpha), and backward's time Tb
     from the step's first mark to its last, each the largest over the ranks. With S the bytes a
     step averages (4 per element; with a gradient compressor, its message's bytes), a step
     communicates c(B) = S/R + (S/B)·alpha with buckets of B bytes, and the buckets add to
     backward max(0, c(B) − Tb) plus the last bucket, B/R + alpha, which cannot start before
     backward ends. So B = min(S·alpha/(Tb − S/R), sqrt(S·alpha·R)) when Tb > S/R (the smallest
     bucket that keeps the communication behind backward, unless that costs more than the
     balanced size), else sqrt(S·alpha·R); within [64 KiB, S]. The first bucket is
     min(1 MiB, B) (PyTorch DDP's cap). dp->ov keeps what it chose and measured (cut_bytes,
     alpha_ms, rate).

     Where they run. On a worker thread the driver starts at the first mark (one per driver,
     asleep while no bucket is queued): the host's thread goes on computing. The communicator's
     log callback may then be called from it. Without threads (DOPT_NO_THREADS), or on an MPI
     communicator only its own thread may call (MPI initialised below MPI_THREAD_SERIALIZED:
     comm->one_thread), the buckets run in after_backward, one INFO line says why, and the
     results are the same bits. dopt_mpi_create initialises MPI with MPI_THREAD_FUNNELED, so
     under mpirun buckets overlap only when the program initialises MPI itself with
     MPI_THREAD_SERIALIZED or more, and then makes no MPI call of its own while buckets run.
     Other driver calls (after_step, sync, broadcast, check_replicas, save, load, close, and
     celgc_step without sync_grads) refuse a step whose marks no after_backward completed
     (DOPT_ERR_INVALID, saying so). After each step dp->ov says how it went: wait_ms (after_backward
     waiting for the buckets), busy_ms (the buckets' time from start to end on the worker) and
     cpu_ms (the processor time the worker took for them: copies, sums, the kernel's sockets;
     the rest of busy_ms it slept waiting for peers). That processor time comes from a core the
     host may want: measured, 2.1-2.6 ms per step for 2.4 MB over TCP, taken from backward when
     every core computes. An OpenMP host whose threads spin at their barriers on every core (GCC's
     default) loses far more, a preempted thread holding up its team: run it with
     OMP_WAIT_POLICY=passive, or leave a core free (docs/measurements.md, overlap).

     The bits. fp32: a bucket's mean is a MEAN allreduce of its floats. At two ranks that is the
     whole-buffer mean bit for bit (a + b = b + a). Beyond, a ring allreduce adds the ranks'
     values of an element in an order that follows where the element falls in the message's cut,
     so a bucket's mean may differ from the whole buffer's in the last bit of some elements: the
     same bits on every rank and from run to run for the same buckets (tests/test_overlap.c
     checks the bits at two ranks, and the same bits on every rank beyond). With a gradient
     compressor each bucket is dopt_compress_allreduce_segments over its segments, so the
     compressor's table must be the gradients' (the same count at every index; dopt_dp_init or
     dopt_dp_set_grads refuse another, saying so): each segment keeps its random stream, scale
     and error-feedback residual, and the means and the compressor's state are the whole call's
     bit for bit wherever compress.h's NONBLOCKING AND BUCKETS says so (every codec at two
     ranks; beyond, all but fp16 and bf16 on the ring, and PowerSGD). No allocation per step
     after the first step that marks.

     The verdicts come after the wait, as for the whole buffer: the non-finite verdict (FAIL or
     SKIP, every rank alike, the ranks named), and a clip the host takes of the averaged
     gradient (clip.h's global norm of it is the same bits on every rank).
*/
#ifndef DISTOPT_LOCALSGD_H
#define DISTOPT_LOCALSGD_H

#define DOPT__WANT_POSIX 1 /* see the top of distopt.h */
#include "distopt.h"
#include "clip.h"
#include "compress.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_DP_FILE_VERSION 4u
#define DOPT_DP_DETAIL_MAX 256

/* ===================================================================== ADAPTIVE BATCH */

typedef enum dopt_batch_test {
    DOPT_BATCH_NORM = 0,          /* Byrd et al. 2012 */
    DOPT_BATCH_INNER_PRODUCT = 1, /* Bollapragada et al. 2018 */
    DOPT_BATCH_AUGMENTED = 2      /* inner product + orthogonality */
} dopt_batch_test;

typedef enum dopt_batch_estimator {
    DOPT_BATCH_WITHIN = 0, /* micro-batch gradients reported by the host */
    DOPT_BATCH_ACROSS = 1  /* spread of the workers' model deltas at each average */
} dopt_batch_estimator;

typedef enum dopt_batch_projection {
    DOPT_BATCH_PROJECT_AUTO = 0,    /* EXACT for the inner-product tests when it fits DOPT_BATCH_EXACT_BYTES */
    DOPT_BATCH_PROJECT_EXACT = 1,   /* onto the step's gradient (the papers'): keeps (max_units + 1)·n floats */
    DOPT_BATCH_PROJECT_PREVIOUS = 2 /* onto the previous local step's mean: n floats, an approximation */
} dopt_batch_projection;

/* AUTO's memory limit for EXACT's kept micro-batch gradients ((max_units + 1)·n floats). */
#ifndef DOPT_BATCH_EXACT_BYTES
#define DOPT_BATCH_EXACT_BYTES ((size_t)256 << 20)
#endif

typedef struct dopt_batch_config {
    dopt_batch_test test;
    dopt_batch_estimator estimator;
    double eta, theta, nu;
    size_t unit_samples;
    size_t initial_units;
    size_t max_units;
    size_t multiple;
    dopt_batch_projection projection;
    double history;
    int bias_corrected; /* 1: ‖∇F‖² without the batch mean's upward bias (the library's variant) */
    double max_growth;  /* G ≥ 1: a decision multiplies the units by G at most; 0: unbounded */
} dopt_batch_config;

/* What a decision was made from; NaN where unknown. */
typedef struct dopt_batch_stats {
    double samples;    /* b: samples per step and worker when the statistics were taken */
    double grad_norm2; /* ‖∇F‖²: plain (the paper's), or bias-corrected (≤ 0: noise hides the gradient) */
    double var;        /* per-sample variance, summed over coordinates */
    double ip_var;     /* per-sample variance of ⟨∇f_i, ĝ⟩ */
    double orth_var;   /* per-sample variance of ∇f_i − ⟨∇f_i, ĝ⟩ĝ, summed over coordinates */
    double workers;    /* the workers each step's update averaged: N on synchronous steps, 1 on local */
} dopt_batch_stats;

/* The WITHIN sums of one round on one rank, pooled over ranks at the decision. A step t of k_t
   micro-batch gradients v_j, all taken at the same parameters, with mean v̄_t, adds: */
typedef struct dopt_batch_round { /* doubles in this order: the first eleven summed over ranks as an array */
    double dof;        /* k_t − 1 */
    double ss;         /* Σ_j ‖v_j − v̄_t‖² */
    double proj_dof;   /* k_t − 1, when the step had a projection direction */
    double proj_ss;    /* Σ_j (p_j − p̄_t)², p_j = ⟨v_j, ĝ⟩, on those steps */
    double proj_total; /* Σ_j ‖v_j − v̄_t‖² on those steps */
    double mean_norm2; /* ‖v̄_t‖², on steps without a global projection */
    double noise_k;    /* c_t/k_t: the part of τ² taken off ‖v̄_t‖² (c_t = 1 − 1/W_t, or 1 bias-corrected) */
    double steps;      /* 1 */
    double workers;    /* W_t: the workers the step's update averaged */
    double gproj;      /* ⟨v̄_t, ĝ⟩ on steps whose averaged gradient ĝ (unit) the driver gave */
    double gproj_steps; /* 1 on those steps */
    double gnorm2;     /* pooled only: Σ over rounds of (mean gproj)²·gproj_steps, after the allreduce */
} dopt_batch_round;

typedef struct dopt_batch {
    dopt_batch_config cfg; /* with defaults filled in */
    size_t n;
    size_t units;          /* current size */
    uint64_t observed;     /* micro-batches of the current step */
    int step_workers;      /* the workers the current step's update averages (dopt_batch_averaged), or 1 */
    int projection_fallback; /* 1: AUTO chose PREVIOUS for lack of memory (said at the first decision) */
    double *sum;           /* WITHIN: Σ v_j of the current step, n doubles */
    float *dir;            /* PREVIOUS: the previous step's mean v̄ (direction ĝ), n floats */
    float *micro;          /* EXACT: the current step's v_j, max_units·n floats, then n for the global mean */
    int global_dir;        /* EXACT: the driver put the step's averaged gradient after the v_j */
    double global_dir_norm; /* its norm (> 0 when global_dir) */
    int step_gproj;        /* 1: the driver gave the step's averaged gradient; its projection below */
    double step_gproj_value; /* ⟨v̄, ĝ⟩: this rank's step mean on the averaged gradient's direction */
    double dir_norm;       /* ‖dir‖, 0 while there is none */
    double sumsq;          /* Σ ‖v_j‖² of the current step */
    double proj_sum;       /* PREVIOUS: Σ ⟨v_j, ĝ⟩ of the current step */
    double proj_sumsq;     /* PREVIOUS: Σ ⟨v_j, ĝ⟩² of the current step */
    dopt_batch_round round;
    dopt_batch_round pooled; /* the rounds so far, each weighted history^age (after the allreduce) */
    uint64_t decisions;    /* rounds decided or not */
    uint64_t undecided;    /* rounds whose statistics could not decide (the size stayed) */
    uint64_t nonpositive;  /* rounds whose estimate of ‖∇F‖² was ≤ 0 under noise: no batch passed */
    uint64_t steps_dropped; /* steps whose micro-batch gradients were not finite: left out of the statistics */
    dopt_batch_stats last;
} dopt_batch;

DOPT_DEF dopt_status dopt_batch_init(dopt_batch *bc, size_t n, const dopt_batch_config *cfg);
DOPT_DEF void dopt_batch_free(dopt_batch *bc);
DOPT_DEF size_t dopt_batch_units(const dopt_batch *bc);
DOPT_DEF dopt_status dopt_batch_observe(dopt_batch *bc, const dopt_buf *grad, float scale);
DOPT_DEF void dopt_batch_averaged(dopt_batch *bc, int workers);
DOPT_DEF void dopt_batch_end_step(dopt_batch *bc);
DOPT_DEF dopt_status dopt_batch_decide(dopt_batch *bc, dopt_comm *comm);
DOPT_DEF size_t dopt_batch_next_units(const dopt_batch_config *cfg, size_t current_units, const dopt_batch_stats *st,
                                      double *needed_samples);

/* ===================================================================== LOCAL SGD DRIVER */

typedef enum dopt_state_policy {
    DOPT_STATE_AVERAGE = 0, /* averaged with the parameters */
    DOPT_STATE_KEEP = 1,    /* left local */
    DOPT_STATE_RESET = 2    /* zeroed at every average */
} dopt_state_policy;

typedef struct dopt_state_desc {
    size_t count;
    dopt_state_policy policy;
    const char *name; /* optional, for messages; not copied */
} dopt_state_desc;

typedef enum dopt_nonfinite_policy {
    DOPT_NONFINITE_FAIL = 0, /* the driver stops: every later call returns DOPT_ERR_NONFINITE */
    DOPT_NONFINITE_SKIP = 1  /* the step is skipped on every rank (zero gradients); the driver goes on */
} dopt_nonfinite_policy;

typedef struct dopt_dp_config {
    size_t period;
    size_t warmup_steps;
    int sync_grads;
    int weighted;
    const dopt_state_desc *states;
    size_t nstates;
    dopt_batch *batch;
    int keep_anchor;
    dopt_compressor *compressor;
    dopt_compressor *grad_compressor;
    double outer_lr;
    double outer_momentum;
    dopt_nonfinite_policy nonfinite;
    float *params;
    const dopt_buf *grads;     /* buckets: the gradients' descriptor (copied), or dopt_dp_set_grads */
    size_t bucket_bytes;       /* buckets: their size, 0: chosen (OVERLAP) */
    size_t first_bucket_bytes; /* buckets: the first one's, 0: min(1 MiB, bucket_bytes) */
    int overlap_check;         /* 1: a write to a segment after its mark is caught (a checksum) */
    int elastic;               /* 1: a model average that loses a rank goes on over the survivors (ELASTIC) */
} dopt_dp_config;

/* The buckets of the synchronous steps' gradient averages (OVERLAP); internal to the driver. */
typedef struct dopt__dp_bucket dopt__dp_bucket;
typedef struct dopt_dp_overlap {
    dopt_buf grads;           /* the gradients' descriptor, over the copied tables below */
    dopt_segment *segs;       /* a flat descriptor's table (one segment when it had none) */
    dopt_span *spans;         /* a scatter list's spans */
    size_t nseg;              /* 0: no descriptor registered */
    int direct;               /* 1: a flat buffer whose segments tile it: buckets average in place */
    size_t *order;            /* nseg: the bucket order (backward's, then the one observed and agreed) */
    size_t *seen;             /* nseg: the order marked in the first step */
    size_t *stage_off;        /* nseg: a segment's place in the stage (the workspace, in bucket order) */
    unsigned char *marks;     /* nseg: times marked this step */
    uint64_t *sums;           /* nseg: checksums at the marks (overlap_check), else NULL */
    dopt_span *stage_spans;   /* nseg: the stage as a scatter list (the compressor's view of it) */
    dopt__dp_bucket *buckets; /* nseg slots; nbuckets used */
    size_t nbuckets, started, waited, nseen, marked; /* buckets cut, started, known ended; marks */
    size_t bucket_bytes, first_bytes; /* as configured (0: chosen) */
    size_t cut_bytes;         /* the size the buckets were cut with */
    int rebuilt;              /* 1: cut in the agreed order (after the first step that marked) */
    int check;                /* overlap_check */
    uint64_t step;            /* step + 1 whose marks are held, 0: none */
    int mistake;              /* the step's first mark mistake on this rank (DOPT__DP_MARKED_TWICE ...), 0: none */
    size_t mistake_seg;       /* ... the segment it concerns, as the host gave it */
    double t_first, t_last;   /* the first step's first and last mark (ms) */
    double weight;            /* the step's samples (weighted means) */
    double alpha_ms, rate;    /* what the rebuild measured: a collective's fixed cost, bytes/s */
    double wait_ms;           /* the last step: after_backward's wait for the buckets */
    double busy_ms, cpu_ms;   /* ... the buckets' time running, and the processor time they took */
    dopt__worker *worker;     /* runs the buckets; NULL: after_backward runs them */
    int inline_said;          /* the INFO line on why buckets wait for after_backward was logged */
    char label[96];           /* the bucket running now, as details name it (the worker's) */
} dopt_dp_overlap;

typedef struct dopt_dp {
    dopt_comm *comm;
    size_t n;
    size_t period, warmup;
    int sync_grads, weighted;
    dopt_state_desc *states; /* copied table */
    size_t nstates;
    size_t work_count;       /* n + Σ AVERAGE states */
    float *work;             /* averaging workspace: work_count floats and two flags' slots */
    float *anchor;           /* the model at the last average, or NULL */
    int anchor_set;          /* 1 once a broadcast, a load or an average wrote the anchor */
    dopt_batch *batch;       /* borrowed, or NULL */
    dopt_compressor *compressor; /* borrowed, or NULL: model deltas go through it */
    dopt_compressor *grad_compressor; /* borrowed, or NULL: synchronous gradient means go through it */
    int outer;               /* 1: model averages go through the outer optimizer */
    double outer_lr, outer_momentum;
    float *outer_v;          /* the outer momentum, n floats (outer_momentum > 0), or NULL */
    uint64_t step;           /* steps completed */
    uint64_t syncs;          /* averages done (model or gradient) */
    uint64_t round_steps;    /* steps since the last average */
    uint64_t grads_step;     /* step + 1 of the last step whose gradients were averaged, or 0 */
    dopt_status status;      /* init's refusal or a non-finite average under FAIL: every later call returns it */
    dopt_nonfinite_policy nonfinite;
    uint64_t skipped;        /* averages found non-finite and skipped (DOPT_NONFINITE_SKIP) */
    int logged;              /* 1: the failure in detail was logged when it happened */
    double round_samples;    /* samples since the last average (the weight) */
    double step_samples;     /* set by dopt_dp_set_step_samples, 0: automatic */
    uint64_t *replica_words; /* the replica check's exchange: checksum and step of every rank */
    char api[96];            /* the call whose collectives run now, as details name it */
    char detail[DOPT_DP_DETAIL_MAX];
    dopt_dp_overlap ov;      /* buckets during backward (OVERLAP) */
    int elastic;             /* ELASTIC */
    uint64_t shrinks;        /* ELASTIC: communicators shrunk (comm is the last one made) */
    uint64_t sync_step;      /* ELASTIC: step when the anchor was last written (an average, a broadcast) */
    int joining;             /* ELASTIC: 1 on a rank a grow took in (comm->grown_from), until it has the state */
    int joiners_waiting;     /* ELASTIC: the last average said a member holds a joiner (then the grow) */
    uint64_t grows;          /* ELASTIC: communicators grown (joiners taken in) */
    size_t state_bytes;      /* ELASTIC: the last state transfer this rank sent or took: its bytes, */
    double state_ms;         /* and its milliseconds on the wire (0: none yet) */
    void *host;              /* dopt_dp_host_state: the host's bytes, saved, loaded and sent with the driver's */
    size_t host_bytes;
} dopt_dp;

DOPT_DEF dopt_status dopt_dp_init(dopt_dp *dp, dopt_comm *comm, size_t n, const dopt_dp_config *cfg);
DOPT_DEF void dopt_dp_free(dopt_dp *dp);
DOPT_DEF int dopt_dp_should_sync(const dopt_dp *dp, uint64_t step);
DOPT_DEF int dopt_dp_is_synchronous(const dopt_dp *dp, uint64_t step);
DOPT_DEF dopt_status dopt_dp_broadcast(dopt_dp *dp, float *params);
DOPT_DEF dopt_status dopt_dp_broadcast_buf(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states);
DOPT_DEF dopt_status dopt_dp_after_backward(dopt_dp *dp, float *grads);
DOPT_DEF dopt_status dopt_dp_after_backward_buf(dopt_dp *dp, const dopt_buf *grads);
DOPT_DEF dopt_status dopt_dp_set_grads(dopt_dp *dp, const dopt_buf *grads);
DOPT_DEF dopt_status dopt_dp_grad_ready(dopt_dp *dp, size_t seg);
DOPT_DEF dopt_status dopt_dp_grad_unused(dopt_dp *dp, size_t seg);
DOPT_DEF dopt_status dopt_dp_after_step(dopt_dp *dp, float *params);
DOPT_DEF dopt_status dopt_dp_after_step_buf(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states);
DOPT_DEF dopt_status dopt_dp_sync(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states);
DOPT_DEF dopt_status dopt_dp_celgc_step(dopt_dp *dp, const dopt_buf *params, const dopt_buf *grads,
                                        const dopt_celgc *rule);
DOPT_DEF dopt_status dopt_dp_check_replicas(dopt_dp *dp, const dopt_buf *params, int *identical,
                                            double *max_diff);
DOPT_DEF dopt_status dopt_dp_close(dopt_dp *dp, float *params);
DOPT_DEF dopt_status dopt_dp_close_buf(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states);
DOPT_DEF dopt_status dopt_dp_set_step_samples(dopt_dp *dp, double samples);
DOPT_DEF dopt_status dopt_dp_host_state(dopt_dp *dp, void *bytes, size_t size);
DOPT_DEF dopt_status dopt_dp_save(dopt_dp *dp, const char *path);
DOPT_DEF dopt_status dopt_dp_load(dopt_dp *dp, const char *path);
DOPT_DEF const char *dopt_dp_detail(const dopt_dp *dp);

/* ===================================================================== HELPERS */

DOPT_DEF dopt_status dopt_broadcast_buf(dopt_comm *comm, const dopt_buf *buf, int root);
DOPT_DEF dopt_status dopt_shard(size_t total, int rank, int size, size_t *begin, size_t *end);

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_LOCALSGD_H */

/* ==================== REFERENCE FOR CONTRIBUTORS ====================
   Not needed to use the header: the adaptive batch-size tests' formulas, the estimators'
   derivations, where the defaults come from and what was measured with them.

   The tests, with b the samples of the batch gradient g_B that moves the parameters (SYNCHRONOUS
   AND LOCAL STEPS below), ĝ = g_B/‖g_B‖ its direction, and Var a per-sample variance summed over
   coordinates:
     norm (Byrd et al. 2012):           b_needed = Var / (η²‖∇F‖²)
     inner product (Bollapragada et al. 2018):
                                        b_needed = Var(⟨∇f_i, ĝ⟩) / (θ²‖∇F‖²)
                                                 (= Var(⟨∇f_i, g_B⟩)/(θ²‖g_B‖⁴) with ‖∇F‖ for ‖g_B‖)
     augmented:                         the larger of the inner-product answer and
                                        Var(∇f_i − ⟨∇f_i,ĝ⟩ĝ) / (ν²‖∇F‖²)
   The three statistics (dopt_batch_stats), with ∇f_i a sample's gradient and ∇F their mean:
     var      = Var              = E‖∇f_i − ∇F‖²
     ip_var   = Var(⟨∇f_i, ĝ⟩)   = E⟨∇f_i − ∇F, ĝ⟩²                 the spread along ĝ
     orth_var = Var(∇f_i − ⟨∇f_i,ĝ⟩ĝ) = E‖(∇f_i − ∇F) − ⟨∇f_i − ∇F, ĝ⟩ĝ‖² = var − ip_var
                                                                     the spread across ĝ
   (the orthogonality statistic; the last equality is Pythagoras', ĝ being a unit vector:
   ‖u‖² = ⟨u,ĝ⟩² + ‖u − ⟨u,ĝ⟩ĝ‖²). The estimators below compute it so: the spread less the
   spread along ĝ, the latter first held within [0, the spread], so orth_var ≥ 0.
   When b_needed > W·b (W the workers the update averaged) the next size is
   ⌈b_needed / (W·unit_samples)⌉ units, rounded up to a multiple of `multiple`, never below the
   current size (monotone), never above max_units, nor above ⌈G·units⌉ with max_growth G (one
   unit more at least). When the estimate of ‖∇F‖² is zero or below while there is noise (the
   noise accounts for all of the observed gradient), no batch passes: the size goes to the cap
   (or ×G) with a WARN naming the decision and the estimate. When the statistics are
   missing (no step of the round with 2 micro-batches, no direction yet, one worker for ACROSS,
   a zero gradient without noise, NaN) the size stays, bc->undecided counts the round, and the
   communicator's log says why (a warning the first time, information after). Every input of the
   decision is the result of a scalar allreduce, so every rank computes the same bits and reaches
   the same size.

   SYNCHRONOUS AND LOCAL STEPS. The test asks that the noise of the gradient that moves the
   parameters be small against ‖∇F‖. On a synchronous step (the warm-up, period 1: gradients
   averaged over N workers) that gradient is the mean of N·b samples, and the reference code's
   distributed tests compare the global batch N·b with the statistics of the global batch
   (per-sample variance over all N·b samples, ‖g_B‖² of the global mean); so does this library
   after dopt_batch_averaged (the driver calls it), and each worker's share of b_needed is
   b_needed/N. On a local step each worker moves its own model with its own b samples: the
   paper's test for local methods takes the per-worker batch, the per-sample variance pooled over
   the workers and ‖g_B‖² of each worker's batch gradient; so does this library, and b_needed is
   each worker's. (Comparing the per-worker b on a synchronous step, as this library did before,
   asks for N times the paper's batch.)

   Defaults and what to expect. η = θ = ν = 0.1 are the defaults of the reference code of
   AdAdaGrad (Lau, Liu, Kolar 2024), by the first author of the paper on adaptive batches for
   local methods (Lau, Li, Xu, Liu, Kolar 2024); that code's example runs use η ∈ {0.1, 0.25,
   0.5}, and θ = 0.5 with ν = 1; Bollapragada et al. suggest θ ≈ 0.9 with ν ≈ 5.84. The norm test
   asks that the batch mean's noise, √(Var/b), be at most η·‖∇F‖: b ≥ Var/(η²‖∇F‖²). On a small
   model the per-sample noise is many times the gradient, and a strict η asks for a batch far
   beyond any cap at the first decision — the test's honest answer, not a fault. Choose η from
   the batch you can afford: run once, read dopt_batch_stats (bc->last) and take
   η ≈ √(Var/(b_max·‖∇F‖²)) for the b_max you want reached when the gradient is that small. The
   Fashion-MNIST MLP in the distopt repository's examples/ (2 workers, period 4, 2 micro-batches
   of 32 per step, the library's variant: bias-corrected, history 0.9) asked at η = 0.1 for 3400
   samples at its first decision, far beyond its range of 64–512; at η = 1.5 it grew from 64 to
   256 over 10 epochs. docs/RESULTS.md has the paper's configuration on the same model.

   The WITHIN estimator. The host reports each micro-batch's mean gradient v_j
   (dopt_batch_observe), and marks the end of each local step (dopt_batch_end_step; the driver's
   dopt_dp_after_step does it). The variance is the spread of the micro-batch gradients of
   ONE step, all taken at the same parameters: τ² = Σ_t Σ_j ‖v_j − v̄_t‖² / Σ_t (k_t − 1), pooled
   over the round's steps and over ranks, and Var = unit_samples·τ². Steps differ in parameters;
   their difference is drift, not noise, and does not enter. A step of one micro-batch adds no
   degree of freedom: at initial_units = 1 nothing is ever decided, so start at 2 units or more.
   The reference code takes the per-sample variance of the b samples, b − 1 degrees of freedom
   per step; micro-batch means give k − 1 (8 per round for the Fashion-MNIST MLP at period 4 and
   2 micro-batches per step on 2 workers, against ~126 per-sample ones at b = 64): the same
   expectation, a noisier estimate (relative spread √(2/dof) for Gaussian noise), bought because a
   C loop has micro-batch gradients and per-sample ones are costly. tests/test_batch_ref.c
   measures what that does to the decisions against per-sample statistics.
   ‖∇F‖², with W_t the workers step t's update averaged (E‖v̄_t‖² = ‖∇F(x_t)‖² + τ²/k_t):
     plain (the default, the paper's): on a local step (W = 1), ‖v̄_t‖², the reference's ‖g_B‖² at
       the worker's batch, averaged over the round's steps and ranks. On a synchronous step under
       the driver, ‖ḡ_t‖² of the global mean, the reference's ‖g_B‖² at the global batch: the
       driver hands the averaged gradient ḡ over, each rank adds ⟨v̄_t, ḡ/‖ḡ‖⟩ to the decision's
       allreduce, and the square of their mean over ranks is ‖ḡ‖² when the host's gradient is a
       positive multiple of its micro-batch mean (what it applies: with weight decay folded into
       the gradient it is the squared projection of the global mean on it). A synchronous step
       without a plain fp32 gradient mean — marked by dopt_batch_averaged alone (no driver), or
       averaged through a gradient compressor (not the global mean's direction) or `weighted`
       (not the plain mean), or whose models rather than gradients were averaged — takes the
       mean of ‖v̄_t‖² − (1 − 1/W)·τ²/k_t instead: the same expectation where the ranks' shards
       are alike, higher by the spread of the ranks' mean gradients where they differ.
     bias_corrected (the library's variant): ‖∇F‖² unbiased, the noise of the batch mean taken
       off: ‖v̄_t‖² − τ²/k_t on a local step, ‖ḡ_t‖² − τ²/(W·k_t) on a synchronous one. What it
       changes: the plain estimate is larger by about Var/(W·b), so it asks for a smaller batch,
       most where the noise dominates (b_needed = Var/(η²‖∇F‖²) against
       Var/(η²(‖∇F‖² + Var/(W·b)))); and it can be ≤ 0, which no plain estimate on a local step
       can be: one noisy round then sends the size to the cap.
   Memory: n doubles for the step's sum, plus, for the inner-product tests:
     DOPT_BATCH_PROJECT_EXACT (the papers' direction; AUTO's choice when it fits
       DOPT_BATCH_EXACT_BYTES): (max_units + 1)·n floats that keep the step's micro-batch
       gradients until its end, then project them on the step's gradient: one more pass over
       k·n floats per step and a copy at each observation. A step of more than max_units
       micro-batches is refused (DOPT_ERR_INVALID). On a synchronous step the driver hands the
       averaged gradient over (the last n floats) and the projections are on its direction, as
       the reference's distributed tests project on the global mean; on a local step, or
       without the driver, on this rank's own step mean (measured by tests/test_batch_ref.c
       before the driver handed the direction over: ip_var about 20% above the paper's on a
       synchronous step of 3 ranks, orth_var about 5% below).
     DOPT_BATCH_PROJECT_PREVIOUS (the library's variant; AUTO's choice when EXACT does not fit,
       said once by a WARN): n floats. ĝ is the previous step's mean (the round's first step
       uses the previous round's last; the first step of all has none and adds nothing to the
       projected statistics). An approximation: it lags one local step, and it is exact when the
       direction does not move; where the direction turns within a step's distance it misplaces
       spread between ip_var and orth_var (a 90-degree turn swaps them). For GPT-2 small (124M
       parameters) at max_units 16 EXACT would keep 7.9 GB of micro-batch gradients; PREVIOUS
       keeps 0.5 GB (both beside the 1 GB of the step's sum in doubles).
   The projected statistics, with p_j = ⟨v_j, ĝ⟩ and p̄_t its mean over step t, summed over the
   steps that have a direction (S) and over ranks:
     ip_var   = unit_samples · Σ_{t∈S} Σ_j (p_j − p̄_t)² / Σ_{t∈S} (k_t − 1)
     orth_var = unit_samples · Σ_{t∈S} Σ_j (‖v_j − v̄_t‖² − (p_j − p̄_t)²) / Σ_{t∈S} (k_t − 1)
   a step's Σ_j (p_j − p̄_t)² held within [0, Σ_j ‖v_j − v̄_t‖²], so orth_var ≥ 0.

   history (this library's addition, not the papers'). One round's estimate of ‖∇F‖² is noisy
   when a round holds few micro-batches: the Fashion-MNIST MLP (2 workers, period 4, 2 micro-
   batches of 32 per step, bias-corrected) saw it between 0.17 and 6.9 in its first 30 rounds,
   and because the size never shrinks, one low estimate sends it to the cap for good (η = 4:
   the cap of 512 samples within the first two epochs, while most rounds asked for 2 to 9
   samples). With history = 0.9 (the statistics of about the last 10 rounds) the same run
   stayed at 64 samples at η = 4 and grew from 64 to 256 over 10 epochs at η = 1.5. The price is
   lag: a change of the gradient's scale shows within about 1/(1 − h) rounds. What it changes
   against the paper: a decision reads ~1/(1 − h) rounds of statistics (more degrees of freedom,
   older parameters) instead of its own round's. max_growth is the other guard against one
   noisy round; it bounds a decision without averaging old rounds in.

   The ACROSS estimator. At each model average, with d_m = x_m − x_anchor rank m's model delta over
   the round and B_m the samples it processed (B = Σ_m B_m), d̄ the (weighted) average:
   Var = Σ_m B_m‖d_m − d̄‖² / (N − 1) = (Σ B_m‖d_m‖² − B‖d̄‖²)/(N − 1), ‖∇F‖² ≈ ‖d̄‖² − Var·c with
   c = 1/B (weighted mean) or Σ_m(1/B_m)/N² (plain mean), and the projections on d̂ = d̄/‖d̄‖ from
   ⟨d_m, d̄⟩: ip_var = (Σ_m B_m⟨d_m, d̂⟩² − B‖d̄‖²)/(N − 1), held within [0, Var], and
   orth_var = Var − ip_var; two scalar allreduces beyond the average itself. It reads a delta
   as a gradient sum over the round's B_m samples times the step size (every test is a ratio,
   so the scale cancels). That holds for plain SGD at one learning rate on every rank within a
   round. Under momentum or adaptive optimizers the delta is the sum of the updates, not of the
   gradients, and the estimate is of the spread of the updates; use WITHIN there. Under
   clipping (CELGC) a step is min(η, γ/‖g‖)·g, not a fixed multiple of g: dopt_dp_celgc_step
   refuses an ACROSS controller. Unbiased for a weighted mean, and for a plain mean when the B_m
   are equal.
*/

/* =====================================================================================
   IMPLEMENTATION — stop reading here if you only want the API.
   ===================================================================================== */

#if defined(DISTOPT_IMPLEMENTATION) && !defined(DOPT__LOCALSGD_IMPLEMENTED)
#define DOPT__LOCALSGD_IMPLEMENTED

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef O_DIRECTORY /* a system header came before this one without a POSIX feature macro */
#error "localsgd.h needs POSIX.1-2008: compile with -D_GNU_SOURCE, or include it before any other header"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ===================================================================== SMALL HELPERS */

static void dopt__dp_ov_free(dopt_dp_overlap *ov);

static void dopt__dp_fail_detail(dopt_dp *dp, const char *fmt, ...) DOPT_PRINTF(2, 3);
static void dopt__dp_fail_detail(dopt_dp *dp, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dp->detail, sizeof dp->detail, fmt, ap);
    va_end(ap);
}

/* Names the driver's call in the communicator's details; returns the previous label, which the
   caller puts back with dopt_comm_set_api. */
static const char *dopt__dp_label(dopt_dp *dp, const char *fmt, ...) DOPT_PRINTF(2, 3);
static const char *dopt__dp_label(dopt_dp *dp, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dp->api, sizeof dp->api, fmt, ap);
    va_end(ap);
    return dopt_comm_set_api(dp->comm, dp->api);
}

static dopt_status dopt__dp_check_buf(const dopt_buf *b, size_t n) {
    if (b == NULL || dopt_buf_validate(b) != DOPT_OK || dopt_buf_count(b) != n) return DOPT_ERR_INVALID;
    return DOPT_OK;
}

/* Σ (x_i − a_i)(m_i − a_i): x a descriptor, m and a packed vectors (a rank's delta against the
   average delta). */
static double dopt__dp_delta_dot_buf(const dopt_buf *b, const float *mean, const float *anchor) {
    size_t i, j, k = dopt_buf_nsegs(b);
    double s = 0.0;
    for (i = 0; i < k; i++) {
        dopt_span sp = dopt_buf_segment(b, i);
        for (j = 0; j < sp.count; j++)
            s += ((double)sp.ptr[j] - (double)anchor[j]) * ((double)mean[j] - (double)anchor[j]);
        mean += sp.count;
        anchor += sp.count;
    }
    return s;
}

static double dopt__dp_sqdist(const float *x, const float *y, size_t n) {
    size_t i;
    double s = 0.0;
    for (i = 0; i < n; i++) {
        double d = (double)x[i] - (double)y[i];
        s += d * d;
    }
    return s;
}

/* ===================================================================== HELPERS: BROADCAST, SHARD */

DOPT_DEF dopt_status dopt_broadcast_buf(dopt_comm *comm, const dopt_buf *buf, int root) {
    size_t i, k;
    dopt_status s;
    if (comm == NULL || buf == NULL || dopt_buf_validate(buf) != DOPT_OK) return DOPT_ERR_INVALID;
    k = dopt_buf_nsegs(buf);
    for (i = 0; i < k; i++) {
        dopt_span sp = dopt_buf_segment(buf, i);
        s = dopt_broadcast(comm, sp.ptr, sp.count * sizeof(float), root);
        if (s != DOPT_OK) return s;
    }
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_shard(size_t total, int rank, int size, size_t *begin, size_t *end) {
    size_t base, extra, r, b;
    if (size < 1 || rank < 0 || rank >= size || begin == NULL || end == NULL) return DOPT_ERR_INVALID;
    base = total / (size_t)size;
    extra = total % (size_t)size;
    r = (size_t)rank;
    b = r * base + (r < extra ? r : extra);
    *begin = b;
    *end = b + base + (r < extra ? 1 : 0);
    return DOPT_OK;
}

/* ===================================================================== ADAPTIVE BATCH: DECISION RULE */

/* η = θ = ν = 0.1: the defaults of AdAdaGrad's reference code (Lau, Liu, Kolar 2024). */
static void dopt__batch_defaults(dopt_batch_config *c) {
    if (c->eta == 0.0) c->eta = 0.1;
    if (c->theta == 0.0) c->theta = 0.1;
    if (c->nu == 0.0) c->nu = 0.1;
    if (c->unit_samples == 0) c->unit_samples = 1;
    if (c->initial_units == 0) c->initial_units = 1;
    if (c->max_units == 0) c->max_units = c->initial_units > SIZE_MAX / 64 ? SIZE_MAX : 64 * c->initial_units;
    if (c->multiple == 0) c->multiple = 1;
}

/* The samples one test asks for: v/(tol²·g2). A gradient estimate of zero or below (the noise
   accounts for all of ‖ḡ‖²) asks for more than any batch when there is noise. NaN: no answer. */
static double dopt__batch_ratio(double v, double tol, double g2) {
    if (!dopt__is_finite(v) || v < 0.0 || dopt__is_nan(g2)) return NAN;
    if (g2 > 0.0) return v / (tol * tol * g2);
    return v > 0.0 ? INFINITY : NAN;
}

/* b_needed from the statistics, NaN when they cannot decide. */
static double dopt__batch_needed(const dopt_batch_config *c, const dopt_batch_stats *st) {
    double need, orth;
    if (c->test == DOPT_BATCH_NORM) return dopt__batch_ratio(st->var, c->eta, st->grad_norm2);
    need = dopt__batch_ratio(st->ip_var, c->theta, st->grad_norm2);
    if (c->test == DOPT_BATCH_AUGMENTED) {
        orth = dopt__batch_ratio(st->orth_var, c->nu, st->grad_norm2);
        need = dopt__is_nan(need) || dopt__is_nan(orth) ? NAN : (orth > need ? orth : need);
    }
    return need;
}

DOPT_DEF size_t dopt_batch_next_units(const dopt_batch_config *cfg, size_t current_units, const dopt_batch_stats *st,
                                      double *needed_samples) {
    dopt_batch_config c;
    double need, units_d, workers;
    size_t units, cap;
    if (cfg) c = *cfg; else memset(&c, 0, sizeof c);
    dopt__batch_defaults(&c);
    need = st ? dopt__batch_needed(&c, st) : NAN;
    if (needed_samples) *needed_samples = need;
    /* the update's gradient averaged `workers` workers' batches: each worker needs its share */
    workers = st && dopt__is_finite(st->workers) && st->workers >= 1.0 ? st->workers : 1.0;
    if (dopt__is_nan(need) || !(need / workers > (double)current_units * (double)c.unit_samples)) return current_units;
    units_d = ceil(need / workers / (double)c.unit_samples);
    cap = c.max_units;
    if (c.max_growth >= 1.0) { /* at most ×G per decision (one unit more at least), up to a multiple */
        double g = ceil((double)current_units * c.max_growth), m = (double)c.multiple;
        if (g < (double)current_units + 1.0) g = (double)current_units + 1.0;
        g = ceil(g / m) * m;
        if (g < (double)cap) cap = (size_t)g;
    }
    if (!(units_d < (double)cap)) return cap > current_units ? cap : current_units;
    units = (size_t)units_d;
    if (units % c.multiple) units += c.multiple - units % c.multiple;
    if (units > cap) units = cap;
    return units > current_units ? units : current_units;
}

/* ===================================================================== ADAPTIVE BATCH: CONTROLLER */

DOPT_DEF dopt_status dopt_batch_init(dopt_batch *bc, size_t n, const dopt_batch_config *cfg) {
    dopt_batch_config c;
    if (bc == NULL) return DOPT_ERR_INVALID;
    memset(bc, 0, sizeof *bc);
    if (cfg) c = *cfg; else memset(&c, 0, sizeof c);
    if ((unsigned)c.test > (unsigned)DOPT_BATCH_AUGMENTED || (unsigned)c.estimator > (unsigned)DOPT_BATCH_ACROSS ||
        (unsigned)c.projection > (unsigned)DOPT_BATCH_PROJECT_PREVIOUS)
        return DOPT_ERR_INVALID;
    if (!(c.eta >= 0.0) || !(c.theta >= 0.0) || !(c.nu >= 0.0) || !dopt__is_finite(c.eta) ||
        !dopt__is_finite(c.theta) || !dopt__is_finite(c.nu) || !dopt__is_finite(c.history) ||
        !(c.history >= 0.0 && c.history < 1.0) || !dopt__is_finite(c.max_growth) ||
        !(c.max_growth == 0.0 || c.max_growth >= 1.0))
        return DOPT_ERR_INVALID;
    dopt__batch_defaults(&c);
    if (c.max_units < c.initial_units) return DOPT_ERR_INVALID;
    if (c.projection == DOPT_BATCH_PROJECT_AUTO) { /* EXACT where the inner-product tests need it and it fits */
        int fits = n > 0 && c.max_units < DOPT_BATCH_EXACT_BYTES / sizeof(float) / n;
        c.projection = c.test != DOPT_BATCH_NORM && fits ? DOPT_BATCH_PROJECT_EXACT : DOPT_BATCH_PROJECT_PREVIOUS;
        bc->projection_fallback = c.test != DOPT_BATCH_NORM && !fits && c.estimator == DOPT_BATCH_WITHIN && n > 0;
    }
    bc->cfg = c;
    bc->n = n;
    bc->units = c.initial_units;
    bc->step_workers = 1;
    bc->last.samples = bc->last.grad_norm2 = bc->last.var = bc->last.ip_var = bc->last.orth_var = NAN;
    bc->last.workers = NAN;
    if (c.estimator != DOPT_BATCH_WITHIN || n == 0) return DOPT_OK;
    if (n > SIZE_MAX / sizeof(double)) return DOPT_ERR_INVALID;
    bc->sum = (double *)DOPT_MALLOC(n * sizeof(double));
    if (c.projection == DOPT_BATCH_PROJECT_EXACT) {
        if (c.max_units >= SIZE_MAX / sizeof(float) / n) {
            dopt_batch_free(bc);
            return DOPT_ERR_INVALID;
        }
        bc->micro = (float *)DOPT_MALLOC((c.max_units + 1) * n * sizeof(float));
    } else {
        bc->dir = (float *)DOPT_MALLOC(n * sizeof(float));
    }
    if (bc->sum == NULL || (bc->micro == NULL && bc->dir == NULL)) {
        dopt_batch_free(bc);
        return DOPT_ERR_NOMEM;
    }
    memset(bc->sum, 0, n * sizeof(double));
    if (bc->dir) memset(bc->dir, 0, n * sizeof(float));
    return DOPT_OK;
}

DOPT_DEF void dopt_batch_free(dopt_batch *bc) {
    if (bc == NULL) return;
    if (bc->sum) DOPT_FREE(bc->sum);
    if (bc->dir) DOPT_FREE(bc->dir);
    if (bc->micro) DOPT_FREE(bc->micro);
    bc->sum = NULL;
    bc->dir = NULL;
    bc->micro = NULL;
}

DOPT_DEF size_t dopt_batch_units(const dopt_batch *bc) { return bc ? bc->units : 0; }

DOPT_DEF dopt_status dopt_batch_observe(dopt_batch *bc, const dopt_buf *grad, float scale) {
    size_t i, j, k, off = 0;
    double sq = 0.0, proj = 0.0, sc = (double)scale;
    float *keep;
    if (bc == NULL || bc->cfg.estimator != DOPT_BATCH_WITHIN || dopt__dp_check_buf(grad, bc->n) != DOPT_OK ||
        !dopt__is_finite(sc) || sc == 0.0)
        return DOPT_ERR_INVALID;
    if (bc->micro && bc->observed >= bc->cfg.max_units) return DOPT_ERR_INVALID; /* no room to keep it */
    keep = bc->micro ? bc->micro + (size_t)bc->observed * bc->n : NULL;
    k = dopt_buf_nsegs(grad);
    for (i = 0; i < k; i++) { /* one pass over each segment: kept (EXACT) or projected (PREVIOUS) */
        dopt_span sp = dopt_buf_segment(grad, i);
        double *sum = bc->sum + off;
        if (keep)
            for (j = 0; j < sp.count; j++) {
                double v = sc * (double)sp.ptr[j];
                sum[j] += v;
                sq += v * v;
                keep[off + j] = (float)v;
            }
        else
            for (j = 0; j < sp.count; j++) {
                double v = sc * (double)sp.ptr[j];
                sum[j] += v;
                sq += v * v;
                proj += v * (double)bc->dir[off + j];
            }
        off += sp.count;
    }
    bc->sumsq += sq;
    if (bc->dir_norm > 0.0) {
        proj /= bc->dir_norm;
        bc->proj_sum += proj;
        bc->proj_sumsq += proj * proj;
    }
    bc->observed++;
    return DOPT_OK;
}

/* EXACT: Σ_j (p_j − p̄)² with p_j = ⟨v_j, ĝ⟩, over the kept micro-batch gradients; ĝ the
   direction of the step's gradient averaged over the workers when the driver gave it (a
   synchronous step, as the reference code's distributed tests), else of this rank's mean v̄. */
static double dopt__batch_exact_proj_ss(const dopt_batch *bc, double k, double mean_norm) {
    double p_sum = 0.0, p_sumsq = 0.0;
    size_t j, i, n = bc->n;
    const float *g = bc->global_dir ? bc->micro + bc->cfg.max_units * n : NULL;
    for (j = 0; j < (size_t)bc->observed; j++) {
        const float *v = bc->micro + j * n;
        double p = 0.0;
        if (g) {
            for (i = 0; i < n; i++) p += (double)v[i] * (double)g[i];
            p /= bc->global_dir_norm;
        } else {
            for (i = 0; i < n; i++) p += (double)v[i] * bc->sum[i];
            p /= k * mean_norm;
        }
        p_sum += p;
        p_sumsq += p * p;
    }
    return p_sumsq - p_sum * p_sum / k;
}

/* The driver, after a synchronous step's plain fp32 gradient mean: ⟨v̄, ĝ⟩ for this rank's step
   mean v̄ (the mean over ranks of these is ‖global mean‖ when the averaged gradient is a positive
   multiple of it), and for EXACT the direction of its projections (whose scale and sign do not
   matter to a projected variance). */
static void dopt__batch_global_direction(dopt_batch *bc, const dopt_buf *avg) {
    double dot = 0.0, gn = 0.0;
    size_t i, j, off = 0, k = dopt_buf_nsegs(avg);
    float *keep = bc->micro ? bc->micro + bc->cfg.max_units * bc->n : NULL; /* EXACT: one pass, kept too */
    if (bc->n == 0 || bc->observed == 0) return;
    for (i = 0; i < k; i++) {
        dopt_span sp = dopt_buf_segment(avg, i);
        for (j = 0; j < sp.count; j++) {
            double g = (double)sp.ptr[j];
            dot += bc->sum[off + j] * g;
            gn += g * g;
            if (keep) keep[off + j] = sp.ptr[j];
        }
        off += sp.count;
    }
    if (!(gn > 0.0 && dopt__is_finite(gn) && dopt__is_finite(dot))) return; /* zeros: a skipped step */
    bc->step_gproj = 1;
    bc->step_gproj_value = dot / ((double)bc->observed * sqrt(gn));
    bc->global_dir = keep != NULL;
    bc->global_dir_norm = sqrt(gn);
}

DOPT_DEF void dopt_batch_averaged(dopt_batch *bc, int workers) {
    if (bc && workers >= 1) bc->step_workers = workers;
}

/* Closes the current step: its spread around its own mean goes into the round (all its
   micro-batches were taken at the same parameters); its mean becomes the next direction. The
   plain estimate of ‖∇F‖² keeps the bias of the batch that moved the parameters: τ²/(W·k) of
   E‖v̄_t‖²'s τ²/k stays, so c_t = 1 − 1/W_t of it is taken off (bias-corrected: all of it). */
DOPT_DEF void dopt_batch_end_step(dopt_batch *bc) {
    double k, mean2 = 0.0, ss, pss = NAN, w;
    dopt_batch_round *r;
    size_t i;
    if (bc == NULL) return;
    w = (double)bc->step_workers;
    bc->step_workers = 1;
    if (bc->cfg.estimator != DOPT_BATCH_WITHIN || bc->observed == 0) {
        bc->global_dir = bc->step_gproj = 0;
        return;
    }
    r = &bc->round;
    k = (double)bc->observed;
    for (i = 0; i < bc->n; i++) mean2 += bc->sum[i] * bc->sum[i];
    mean2 /= k * k;
    ss = bc->sumsq - k * mean2;
    if (ss < 0.0) ss = 0.0;
    if (!dopt__is_finite(ss) || !dopt__is_finite(mean2)) { /* a NaN or an overflow: the step adds nothing */
        bc->steps_dropped++;
        goto reset;
    }
    if (bc->micro && mean2 > 0.0)
        pss = dopt__batch_exact_proj_ss(bc, k, sqrt(mean2));
    else if (!bc->micro && bc->dir_norm > 0.0)
        pss = bc->proj_sumsq - bc->proj_sum * bc->proj_sum / k;
    if (!dopt__is_nan(pss)) {
        r->proj_dof += k - 1.0;
        r->proj_ss += pss < 0.0 ? 0.0 : (pss > ss ? ss : pss);
        r->proj_total += ss;
    }
    r->dof += k - 1.0;
    r->ss += ss;
    if (bc->step_gproj) { /* the global mean's norm comes from the projections, after the allreduce */
        r->gproj += bc->step_gproj_value;
        r->gproj_steps += 1.0;
        r->noise_k += (bc->cfg.bias_corrected ? 1.0 / w : 0.0) / k;
    } else {
        r->mean_norm2 += mean2;
        r->noise_k += (bc->cfg.bias_corrected ? 1.0 : 1.0 - 1.0 / w) / k;
    }
    r->steps += 1.0;
    r->workers += w;
    if (bc->dir) {
        double nrm2 = 0.0;
        for (i = 0; i < bc->n; i++) {
            bc->dir[i] = (float)(bc->sum[i] / k);
            nrm2 += (double)bc->dir[i] * (double)bc->dir[i];
        }
        bc->dir_norm = sqrt(nrm2);
    }
reset:
    if (bc->n) memset(bc->sum, 0, bc->n * sizeof(double));
    bc->sumsq = bc->proj_sum = bc->proj_sumsq = 0.0;
    bc->observed = 0;
    bc->global_dir = bc->step_gproj = 0;
}

/* Why the statistics cannot decide, or NULL when they can. */
static const char *dopt__batch_undecided_why(const dopt_batch_config *c, const dopt_batch_stats *st) {
    if (!dopt__is_nan(dopt__batch_needed(c, st))) return NULL;
    if (dopt__is_nan(st->var)) return "no variance: no step of the round had 2 micro-batches (or one worker, ACROSS)";
    if (c->test != DOPT_BATCH_NORM && dopt__is_nan(st->ip_var))
        return "no projection direction yet (the first step, DOPT_BATCH_PROJECT_PREVIOUS)";
    return "a zero gradient with zero variance, or a non-finite statistic";
}

/* Applies the rule to pooled statistics and records them; says when they could not decide. */
static void dopt__batch_apply(dopt_batch *bc, const dopt_batch_stats *st, dopt_comm *comm) {
    const char *why = dopt__batch_undecided_why(&bc->cfg, st);
    size_t before = bc->units;
    double need;
    bc->last = *st;
    bc->units = dopt_batch_next_units(&bc->cfg, bc->units, st, &need);
    bc->decisions++;
    if (need == INFINITY) { /* not a finding of the test: the estimate could not see the gradient */
        bc->nonpositive++;
        if (comm)
            dopt_comm_log(comm, bc->units != before ? DOPT_LOG_WARN : DOPT_LOG_INFO,
                          "adaptive batch: decision %llu: the estimate of |grad F|^2 is %.3g (<= 0: the round's noise "
                          "accounts for all of the observed gradient), so no batch passes the test; the size goes "
                          "from %zu to %zu units (%s)",
                          (unsigned long long)bc->decisions, st->grad_norm2, before, bc->units,
                          bc->units == bc->cfg.max_units ? "the cap, max_units: set max_growth to bound one decision"
                                                          : "bounded by max_growth");
    }
    if (why == NULL) return;
    if (comm)
        dopt_comm_log(comm, bc->undecided == 0 ? DOPT_LOG_WARN : DOPT_LOG_INFO,
                      "adaptive batch: decision %llu could not decide, the size stays at %zu units: %s",
                      (unsigned long long)bc->decisions, bc->units, why);
    bc->undecided++;
}

/* Pools the round's sums over ranks (one allreduce, so every rank decides from the same
   numbers), applies the rule, starts a new round. τ² = Σss/Σdof is the variance of one
   micro-batch gradient; E‖v̄_t‖² = ‖∇F(x_t)‖² + τ²/k_t, so the mean of ‖v̄_t‖² − τ²/k_t over
   the round's steps estimates ‖∇F‖² without that bias. */
static dopt_status dopt__batch_decide(dopt_batch *bc, dopt_comm *comm) {
    double v[11], tau2, s_unit, gnorm2, *pool = &bc->pooled.dof;
    dopt_batch_stats st;
    dopt_status s;
    int i;
    if (bc == NULL || bc->cfg.estimator != DOPT_BATCH_WITHIN) return DOPT_ERR_INVALID;
    dopt_batch_end_step(bc);
    if (bc->projection_fallback == 1 && comm) {
        dopt_comm_log(comm, DOPT_LOG_WARN,
                      "adaptive batch: the inner-product test projects on the previous step's mean "
                      "(DOPT_BATCH_PROJECT_PREVIOUS, an approximation): the step's gradient needs (max_units + 1) x n "
                      "floats = %zu MiB, beyond DOPT_BATCH_EXACT_BYTES (%zu MiB); ask for DOPT_BATCH_PROJECT_EXACT "
                      "to have it anyway",
                      (size_t)((double)(bc->cfg.max_units + 1) * (double)bc->n * sizeof(float) / 1048576.0),
                      (size_t)(DOPT_BATCH_EXACT_BYTES >> 20));
        bc->projection_fallback = 2;
    }
    memcpy(v, &bc->round, sizeof v);
    if (comm != NULL) {
        s = dopt_allreduce(comm, v, 11, DOPT_F64, DOPT_SUM);
        if (s != DOPT_OK) return s;
    }
    /* the global mean of a synchronous step: the mean over ranks of ⟨v̄_m, ĝ⟩, squared (a
       round under the driver holds one synchronous step; more are pooled as their mean) */
    gnorm2 = v[10] > 0.0 ? v[9] * v[9] / v[10] : 0.0; /* (mean projection)² × the rank-steps it covers */
    st.workers = v[7] > 0.0 ? v[8] / v[7] : NAN; /* the round's own: history pools statistics, not the rule */
    bc->pooled.gnorm2 = bc->cfg.history * bc->pooled.gnorm2 + gnorm2;
    for (i = 0; i < 11; i++) v[i] = pool[i] = bc->cfg.history * pool[i] + v[i];
    s_unit = (double)bc->cfg.unit_samples;
    tau2 = v[0] > 0.0 ? v[1] / v[0] : NAN;
    st.samples = (double)bc->units * s_unit;
    st.var = s_unit * tau2;
    /* plain on local steps takes nothing off (noise_k = 0): known even without a variance */
    st.grad_norm2 = v[7] > 0.0 ? (v[5] + bc->pooled.gnorm2 - (v[6] > 0.0 ? tau2 * v[6] : 0.0)) / v[7] : NAN;
    st.ip_var = v[2] > 0.0 ? s_unit * v[3] / v[2] : NAN;
    st.orth_var = v[2] > 0.0 ? s_unit * (v[4] - v[3]) / v[2] : NAN;
    dopt__batch_apply(bc, &st, comm);
    memset(&bc->round, 0, sizeof bc->round);
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_batch_decide(dopt_batch *bc, dopt_comm *comm) {
    const char *prev = dopt_comm_set_api(comm, "dopt_batch_decide");
    dopt_status s = dopt__batch_decide(bc, comm);
    dopt_comm_set_api(comm, prev);
    return s;
}

/* ===================================================================== LOCAL SGD: INIT AND SCHEDULE */

/* A refused init: the driver keeps the status and the reason, every later call returns the status
   (check once), and dopt_dp_close reports the reason. */
static dopt_status dopt__dp_init_fail(dopt_dp *dp, const char *why) {
    dp->status = DOPT_ERR_INVALID;
    snprintf(dp->detail, sizeof dp->detail, "dopt_dp_init: %s", why);
    return DOPT_ERR_INVALID;
}

DOPT_DEF dopt_status dopt_dp_init(dopt_dp *dp, dopt_comm *comm, size_t n, const dopt_dp_config *cfg) {
    dopt_dp_config c;
    size_t i, work = n;
    int anchor;
    if (dp == NULL) return DOPT_ERR_INVALID;
    memset(dp, 0, sizeof *dp);
    dp->comm = comm;
    if (comm == NULL) return dopt__dp_init_fail(dp, "no communicator");
    if (cfg) c = *cfg; else memset(&c, 0, sizeof c);
    if (c.nstates > 0 && c.states == NULL) return dopt__dp_init_fail(dp, "nstates > 0 and no state table");
    for (i = 0; i < c.nstates; i++) {
        if ((unsigned)c.states[i].policy > (unsigned)DOPT_STATE_RESET)
            return dopt__dp_init_fail(dp, "a state's policy is unknown");
        if (c.states[i].policy == DOPT_STATE_AVERAGE) {
            if (c.states[i].count > SIZE_MAX / sizeof(float) - work)
                return dopt__dp_init_fail(dp, "the states are too large");
            work += c.states[i].count;
        }
    }
    if (c.batch && c.batch->cfg.estimator == DOPT_BATCH_WITHIN && c.batch->n != 0 && c.batch->n != n)
        return dopt__dp_init_fail(dp, "the batch controller was sized for another element count");
    /* the compressor's layout is over the packed parameters, without gaps; its mean is plain */
    if (c.compressor && (c.compressor->segs == NULL || c.compressor->count != n || c.compressor->flat_end != n ||
                         c.weighted))
        return dopt__dp_init_fail(dp, "compressor: not initialised, not covering the n packed elements, or with "
                                      "`weighted`");
    if (c.grad_compressor &&
        (c.grad_compressor->segs == NULL || c.grad_compressor->count != n || c.grad_compressor->flat_end != n ||
         c.weighted || c.grad_compressor == c.compressor))
        return dopt__dp_init_fail(dp, "grad_compressor: not initialised, not covering the n packed elements, with "
                                      "`weighted`, or the same object as compressor");
    if ((unsigned)c.nonfinite > (unsigned)DOPT_NONFINITE_SKIP)
        return dopt__dp_init_fail(dp, "nonfinite is neither DOPT_NONFINITE_FAIL nor DOPT_NONFINITE_SKIP");
    if (c.elastic && comm->on_peer_lost != DOPT_SHRINK)
        return dopt__dp_init_fail(dp, "elastic: the communicator was made with on_peer_lost = DOPT_FAIL, so it cannot "
                                      "shrink; make it with DOPT_SHRINK (DOPT_ON_PEER_LOST=shrink, TCP only)");
    if (c.elastic && (c.sync_grads || c.compressor || c.grad_compressor || c.batch || c.grads))
        return dopt__dp_init_fail(dp, c.sync_grads        ? "elastic: not with sync_grads (ELASTIC: model averages only)"
                                      : c.compressor      ? "elastic: not with a compressor yet (its residuals are per rank)"
                                      : c.grad_compressor ? "elastic: not with grad_compressor (ELASTIC: model averages only)"
                                      : c.batch           ? "elastic: not with a batch controller yet"
                                                          : "elastic: not with gradient buckets (ELASTIC: model averages only)");
    /* NaN first, by its bits: under GCC's -ffast-math NaN == 0.0 holds and would take the default */
    if (!dopt__is_finite(c.outer_lr) || !dopt__is_finite(c.outer_momentum))
        return dopt__dp_init_fail(dp, "outer_lr or outer_momentum is not finite");
    if (c.outer_lr == 0.0) c.outer_lr = 1.0;
    if (c.outer_lr < 0.0 || !(c.outer_momentum >= 0.0 && c.outer_momentum < 1.0))
        return dopt__dp_init_fail(dp, "outer_lr is negative or outer_momentum is outside [0, 1)");
    dp->outer = c.outer_lr != 1.0 || c.outer_momentum != 0.0;
    anchor = c.keep_anchor || c.compressor || dp->outer || (c.batch && c.batch->cfg.estimator == DOPT_BATCH_ACROSS) ||
             c.elastic;
    dp->comm = comm;
    dp->n = n;
    dp->period = c.period ? c.period : 1;
    dp->warmup = c.warmup_steps;
    dp->sync_grads = c.sync_grads != 0;
    dp->weighted = c.weighted != 0;
    dp->batch = c.batch;
    dp->compressor = c.compressor;
    dp->grad_compressor = c.grad_compressor;
    dp->outer_lr = c.outer_lr;
    dp->outer_momentum = c.outer_momentum;
    dp->nonfinite = c.nonfinite;
    dp->elastic = c.elastic != 0;
    dp->joining = dp->elastic && comm->grown_from > 0 && comm->rank >= comm->grown_from;
    dp->nstates = c.nstates;
    dp->work_count = work;
    if (c.nstates) {
        dp->states = (dopt_state_desc *)DOPT_MALLOC(c.nstates * sizeof(dopt_state_desc));
        if (dp->states == NULL) goto nomem;
        memcpy(dp->states, c.states, c.nstates * sizeof(dopt_state_desc));
    }
    dp->work = (float *)DOPT_MALLOC((work + 2) * sizeof(float)); /* + the non-finite flag's slot, elastic's */
    dp->replica_words = (uint64_t *)DOPT_MALLOC(2 * (size_t)comm->size * sizeof(uint64_t));
    if (dp->work == NULL || dp->replica_words == NULL) goto nomem;
    if (anchor) {
        dp->anchor = (float *)DOPT_MALLOC((n ? n : 1) * sizeof(float));
        if (dp->anchor == NULL) goto nomem;
        memset(dp->anchor, 0, (n ? n : 1) * sizeof(float));
    }
    if (c.outer_momentum > 0.0) {
        dp->outer_v = (float *)DOPT_MALLOC((n ? n : 1) * sizeof(float));
        if (dp->outer_v == NULL) goto nomem;
        memset(dp->outer_v, 0, (n ? n : 1) * sizeof(float));
    }
    dp->ov.bucket_bytes = c.bucket_bytes;
    dp->ov.first_bytes = c.first_bucket_bytes;
    dp->ov.check = c.overlap_check != 0;
    if (c.grads) {
        dopt_status s = dopt_dp_set_grads(dp, c.grads);
        if (s != DOPT_OK) {
            dopt_dp_free(dp); /* the detail says why */
            dp->status = s;
            return s;
        }
    }
    return c.params ? dopt_dp_broadcast(dp, c.params) : DOPT_OK;
nomem:
    dopt_dp_free(dp);
    dp->status = DOPT_ERR_NOMEM;
    snprintf(dp->detail, sizeof dp->detail, "dopt_dp_init: out of memory");
    return DOPT_ERR_NOMEM;
}

DOPT_DEF void dopt_dp_free(dopt_dp *dp) {
    if (dp == NULL) return;
    dopt__dp_ov_free(&dp->ov);
    if (dp->states) DOPT_FREE(dp->states);
    if (dp->work) DOPT_FREE(dp->work);
    if (dp->anchor) DOPT_FREE(dp->anchor);
    if (dp->outer_v) DOPT_FREE(dp->outer_v);
    if (dp->replica_words) DOPT_FREE(dp->replica_words);
    dp->replica_words = NULL;
    dp->states = NULL;
    dp->work = NULL;
    dp->anchor = NULL;
    dp->outer_v = NULL;
}

DOPT_DEF int dopt_dp_is_synchronous(const dopt_dp *dp, uint64_t step) {
    return step < (uint64_t)dp->warmup || dp->period == 1;
}

DOPT_DEF int dopt_dp_should_sync(const dopt_dp *dp, uint64_t step) {
    if (dopt_dp_is_synchronous(dp, step)) return 1;
    return (step + 1 - (uint64_t)dp->warmup) % (uint64_t)dp->period == 0;
}

DOPT_DEF dopt_status dopt_dp_set_step_samples(dopt_dp *dp, double samples) {
    if (dp == NULL || !dopt__is_finite(samples) || samples < 0.0) return DOPT_ERR_INVALID;
    dp->step_samples = samples;
    return DOPT_OK;
}

DOPT_DEF const char *dopt_dp_detail(const dopt_dp *dp) {
    if (dp == NULL) return "no driver";
    return dp->detail[0] || dp->comm == NULL ? dp->detail : dopt_comm_detail(dp->comm);
}

/* ===================================================================== LOCAL SGD: LAYOUT CHECKS AND PACKING */

static dopt_status dopt__dp_check_layout(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    size_t i;
    if (dopt__dp_check_buf(params, dp->n) != DOPT_OK) {
        dopt__dp_fail_detail(dp, "parameters: not a valid descriptor of %zu elements", dp->n);
        return DOPT_ERR_INVALID;
    }
    if (dp->nstates > 0 && states == NULL) {
        dopt__dp_fail_detail(dp, "%zu state buffers registered, none passed", dp->nstates);
        return DOPT_ERR_INVALID;
    }
    for (i = 0; i < dp->nstates; i++)
        if (dopt__dp_check_buf(&states[i], dp->states[i].count) != DOPT_OK) {
            dopt__dp_fail_detail(dp, "state %zu (%s): not a valid descriptor of %zu elements", i,
                                 dp->states[i].name ? dp->states[i].name : "unnamed", dp->states[i].count);
            return DOPT_ERR_INVALID;
        }
    return DOPT_OK;
}

/* A descriptor's segments into a contiguous dst, and back; 1 when every element copied is finite
   (the check rides on the copy: dopt_copy_finite). */
static int dopt__dp_pack_finite(const dopt_buf *b, float *dst) {
    size_t i, k = dopt_buf_nsegs(b);
    int finite = 1;
    for (i = 0; i < k; i++) {
        dopt_span sp = dopt_buf_segment(b, i);
        finite &= dopt_copy_finite(dst, sp.ptr, sp.count);
        dst += sp.count;
    }
    return finite;
}

static int dopt__dp_unpack_finite(const dopt_buf *b, const float *src) {
    size_t i, k = dopt_buf_nsegs(b);
    int finite = 1;
    for (i = 0; i < k; i++) {
        dopt_span sp = dopt_buf_segment(b, i);
        finite &= dopt_copy_finite(sp.ptr, src, sp.count);
        src += sp.count;
    }
    return finite;
}

/* params, then the AVERAGE states, into the workspace (1 when all of it is finite); and back (1
   when all of the average is finite). */
static int dopt__dp_pack(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    size_t i, off = dp->n;
    int finite = dopt__dp_pack_finite(params, dp->work);
    for (i = 0; i < dp->nstates; i++)
        if (dp->states[i].policy == DOPT_STATE_AVERAGE) {
            finite &= dopt__dp_pack_finite(&states[i], dp->work + off);
            off += dp->states[i].count;
        }
    return finite;
}

static int dopt__dp_unpack(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    size_t i, j, k, off = dp->n;
    int finite = dopt__dp_unpack_finite(params, dp->work);
    for (i = 0; i < dp->nstates; i++) {
        if (dp->states[i].policy == DOPT_STATE_AVERAGE) {
            finite &= dopt__dp_unpack_finite(&states[i], dp->work + off);
            off += dp->states[i].count;
        } else if (dp->states[i].policy == DOPT_STATE_RESET) {
            k = dopt_buf_nsegs(&states[i]);
            for (j = 0; j < k; j++) {
                dopt_span sp = dopt_buf_segment(&states[i], j);
                if (sp.count) memset(sp.ptr, 0, sp.count * sizeof(float));
            }
        }
    }
    return finite;
}

/* Samples this rank processes in one step: the batch controller's size, or 1. */
static double dopt__dp_step_samples(const dopt_dp *dp) {
    if (dp->step_samples > 0.0) return dp->step_samples;
    return dp->batch ? (double)dp->batch->units * (double)dp->batch->cfg.unit_samples : 1.0;
}

/* ===================================================================== NON-FINITE AVERAGES */

/* The first element of x[0..n) that is NaN or ±Inf, by its bits; n when there is none (the rare
   path only: the steady state's verdict is a scan or rides on the copies). */
static size_t dopt__dp_first_nonfinite(const float *x, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        if (!dopt_all_finite(x + i, 1)) return i;
    return n;
}

/* The same over a descriptor, as a packed index; dopt_buf_count(b) when there is none. */
static size_t dopt__dp_first_nonfinite_buf(const dopt_buf *b) {
    size_t i, k = dopt_buf_nsegs(b), off = 0;
    for (i = 0; i < k; i++) {
        dopt_span sp = dopt_buf_segment(b, i);
        size_t j = dopt__dp_first_nonfinite(sp.ptr, sp.count);
        if (j < sp.count) return off + j;
        off += sp.count;
    }
    return off;
}

/* Packed element i in words: its segment, by name where a table names it (the descriptor's, else
   the compressor's), and its place there; past n, an AVERAGE state's. */
static void dopt__dp_where(const dopt_dp *dp, const dopt_buf *b, const dopt_compressor *cz, size_t i, char *out,
                           size_t cap) {
    size_t k, off = 0, nseg = dopt_buf_nsegs(b);
    if (i >= dp->n) {
        for (i -= dp->n, k = 0; k < dp->nstates; k++) {
            if (dp->states[k].policy != DOPT_STATE_AVERAGE) continue;
            if (i < dp->states[k].count) break;
            i -= dp->states[k].count;
        }
        snprintf(out, cap, "state %zu (%s), element %zu", k, k < dp->nstates && dp->states[k].name ?
                 dp->states[k].name : "unnamed", i);
        return;
    }
    if (cz && b->data && b->segs == NULL) /* a flat buffer without a table: the compressor's names it */
        for (k = 0; k < cz->nsegs; k++)
            if (i >= cz->segs[k].offset && i - cz->segs[k].offset < cz->segs[k].count) {
                snprintf(out, cap, "segment %zu (%s), element %zu", k, cz->segs[k].name ? cz->segs[k].name : "unnamed",
                         i - cz->segs[k].offset);
                return;
            }
    for (k = 0; k + 1 < nseg && i - off >= dopt_buf_segment(b, k).count; k++) off += dopt_buf_segment(b, k).count;
    if (nseg <= 1)
        snprintf(out, cap, "element %zu", i);
    else
        snprintf(out, cap, "%s %zu (%s), element %zu", b->data ? "segment" : "span", k,
                 b->data && b->segs[k].name ? b->segs[k].name : "unnamed", i - off);
}

/* Which ranks' inputs were not finite, as "rank 1" or "ranks 1, 3"; the count in *bad. */
static void dopt__dp_bad_ranks(const dopt_dp *dp, char *out, size_t cap, int *bad) {
    size_t used = 0;
    int r;
    *bad = 0;
    out[0] = 0;
    for (r = 0; r < dp->comm->size; r++) {
        int k;
        if (dp->replica_words[2 * r] == 0) continue;
        if (++*bad > 8) continue;
        k = snprintf(out + used, cap - used, "%s%d", *bad > 1 ? ", " : "", r);
        if (k > 0 && (size_t)k < cap - used) used += (size_t)k;
    }
    if (*bad > 8 && used + 6 < cap) snprintf(out + used, cap - used, ", ...");
}

/* An average found not finite, on every rank alike (the verdict came from bits every rank holds:
   the averaged result, or the compressor's flags). One allgather says whose input held NaN or
   infinity and where the first one is; the detail names the step, the segment and the ranks;
   the policy decides: FAIL stops the driver, SKIP counts and warns (the first 8, then the 16th,
   32nd, ...). The first non-finite element is looked for in `layout` (in_layout 1: this rank's
   input, or gradients that hold the average), whose segments (or cz's) name it, else in the
   average in the workspace; the average is the one dp->api names.
   *finite_ranks: ranks whose input was finite. Returns DOPT_ERR_NONFINITE, or the allgather's
   failure. */
static dopt_status dopt__dp_nonfinite(dopt_dp *dp, const dopt_buf *layout, const dopt_compressor *cz, int in_layout,
                                      int mine_finite, int *finite_ranks) {
    uint64_t mine[2], first = UINT64_MAX;
    char where[128] = "an element no rank found again", ranks[64], whose[160];
    const char *prev = dopt_comm_set_api(dp->comm, dp->api);
    size_t total = in_layout ? dopt_buf_count(layout) : dp->work_count;
    size_t at = in_layout ? dopt__dp_first_nonfinite_buf(layout) : dopt__dp_first_nonfinite(dp->work, total);
    int r, bad;
    dopt_status s;
    mine[0] = mine_finite ? 0 : 1;
    mine[1] = at < total ? (uint64_t)at : UINT64_MAX;
    s = dopt_allgather(dp->comm, mine, dp->replica_words, sizeof mine);
    dopt_comm_set_api(dp->comm, prev);
    if (s != DOPT_OK) return s;
    for (r = 0; r < dp->comm->size; r++)
        if (dp->replica_words[2 * r + 1] < first) first = dp->replica_words[2 * r + 1];
    dopt__dp_bad_ranks(dp, ranks, sizeof ranks, &bad);
    *finite_ranks = dp->comm->size - bad;
    if (first != UINT64_MAX) dopt__dp_where(dp, layout, cz, (size_t)first, where, sizeof where);
    if (bad)
        snprintf(whose, sizeof whose, "the input of rank%s %s held NaN or infinity", bad > 1 ? "s" : "", ranks);
    else
        snprintf(whose, sizeof whose, "every rank's input was finite: the sum overflowed the float range");
    if (dp->nonfinite == DOPT_NONFINITE_FAIL) {
        dopt__dp_fail_detail(dp, "%s is not finite (first at %s): %s; the driver stopped (DOPT_NONFINITE_FAIL: every "
                                 "later call returns this; .nonfinite = DOPT_NONFINITE_SKIP skips such steps instead)",
                             dp->api, where, whose);
        dp->status = DOPT_ERR_NONFINITE;
        dp->logged = 1;
        dopt_comm_log(dp->comm, DOPT_LOG_ERROR, "rank %d: %s", dp->comm->rank, dp->detail);
        return DOPT_ERR_NONFINITE;
    }
    dp->skipped++;
    dopt__dp_fail_detail(dp, "%s is not finite (first at %s): %s; skipped on every rank (%llu so far)", dp->api, where,
                         whose, (unsigned long long)dp->skipped);
    if (dp->skipped <= 8 || (dp->skipped & (dp->skipped - 1)) == 0)
        dopt_comm_log(dp->comm, DOPT_LOG_WARN, "rank %d: %s", dp->comm->rank, dp->detail);
    return DOPT_ERR_NONFINITE;
}

/* Zeros in every element of a descriptor. */
static void dopt__dp_zero(const dopt_buf *b) {
    size_t i, k = dopt_buf_nsegs(b);
    for (i = 0; i < k; i++) {
        dopt_span sp = dopt_buf_segment(b, i);
        if (sp.count) memset(sp.ptr, 0, sp.count * sizeof(float));
    }
}

/* ===================================================================== LOCAL SGD: AVERAGING */

/* The across-worker statistics of the round, from this rank's delta d_m (params − anchor,
   params still unpacked) and the average d̄ (in the workspace). Two scalar allreduces. A delta
   is read as a gradient sum over the B_m samples of the round, scaled by the step size (every
   test is a ratio, so the scale cancels): E Σ_m B_m‖d_m − d̄‖² = (N − 1)σ² for the weighted
   mean (and for equal B_m), and E‖d̄‖² = ‖∇F‖² + σ²·c with c = 1/W (weighted) or
   Σ_m(1/B_m)/N² (plain), the bias taken off grad_norm2. */
static dopt_status dopt__dp_across_stats(dopt_dp *dp, const dopt_buf *params, double local_d2,
                                         dopt_batch_stats *st) {
    double sums[3], mean2, dot, proj2, w = dp->round_samples, N = (double)dp->comm->size, W, bias;
    dopt_status s;
    sums[0] = w * local_d2;
    sums[1] = w;
    sums[2] = w > 0.0 ? 1.0 / w : 0.0;
    s = dopt_allreduce(dp->comm, sums, 3, DOPT_F64, DOPT_SUM);
    if (s != DOPT_OK) return s;
    W = sums[1];
    mean2 = dopt__dp_sqdist(dp->work, dp->anchor, dp->n);
    dot = dopt__dp_delta_dot_buf(params, dp->work, dp->anchor);
    proj2 = mean2 > 0.0 ? w * dot * dot / mean2 : 0.0;
    s = dopt_allreduce(dp->comm, &proj2, 1, DOPT_F64, DOPT_SUM);
    if (s != DOPT_OK) return s;
    /* the mean samples per step over ranks: the same number everywhere */
    st->samples = W / (N * (double)(dp->round_steps ? dp->round_steps : 1));
    st->workers = 1.0; /* a round of local steps: each worker's own batch moved its model */
    if (dp->comm->size < 2) {
        st->grad_norm2 = mean2;
        st->var = st->ip_var = st->orth_var = NAN;
        return DOPT_OK;
    }
    st->var = (sums[0] - W * mean2) / (N - 1.0);
    st->ip_var = (proj2 - W * mean2) / (N - 1.0);
    if (st->var < 0.0) st->var = 0.0;
    if (st->ip_var < 0.0) st->ip_var = 0.0;
    if (st->ip_var > st->var) st->ip_var = st->var;
    st->orth_var = st->var - st->ip_var;
    bias = dp->weighted ? 1.0 / W : sums[2] / (N * N);
    st->grad_norm2 = mean2 - st->var * bias;
    /* A delta averages B_m samples, so the per-sample variance above is compared with the b of
       one step, as the tests define it. */
    return DOPT_OK;
}

/* The model delta since the last average through the compressor (error feedback is the
   compressor's), added back to the anchor: the new model is the same bytes on every rank because
   the anchor and the decoded mean are. AVERAGE states go in fp32 after. */
static dopt_status dopt__dp_average_compressed(dopt_dp *dp) {
    size_t i;
    dopt_status s;
    for (i = 0; i < dp->n; i++) dp->work[i] -= dp->anchor[i];
    s = dopt_compress_allreduce(dp->compressor, dp->comm, dp->work, dp->n);
    if (s != DOPT_OK) return s;
    for (i = 0; i < dp->n; i++) dp->work[i] += dp->anchor[i];
    if (dp->work_count == dp->n) return DOPT_OK; /* no AVERAGE states: the compressor's verdict is all */
    /* the states and the non-finite flag's slot in fp32 */
    return dopt_allreduce(dp->comm, dp->work + dp->n, dp->work_count - dp->n + 1, DOPT_F32, DOPT_MEAN);
}

/* DiLoCo's outer step (Douillard et al. 2023) on the average in the workspace: the
   pseudo-gradient Δ = anchor − mean, v ← μ·v + Δ, new model = anchor − lr·(Δ + μ·v) (Nesterov).
   The same bits on every rank: its inputs (anchor, mean, v) are. */
static void dopt__dp_outer_step(dopt_dp *dp) {
    double lr = dp->outer_lr, mu = dp->outer_momentum;
    size_t i;
    for (i = 0; i < dp->n; i++) {
        double d = (double)dp->anchor[i] - (double)dp->work[i];
        if (dp->outer_v) {
            dp->outer_v[i] = (float)(mu * (double)dp->outer_v[i] + d);
            d += mu * (double)dp->outer_v[i];
        }
        dp->work[i] = (float)((double)dp->anchor[i] - lr * d);
    }
}

/* DOPT_NONFINITE_SKIP's round whose average is not finite: the plain mean, in fp32, of the ranks
   whose parameters and AVERAGE states are finite (the others send zeros with weight 0), without
   the outer step or the across-worker statistics. Every rank then continues from the same finite
   model. No finite rank, or a mean that is still not finite: the driver stops, as under FAIL. */
static dopt_status dopt__dp_rescue_average(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states, int mine_finite,
                                           int finite_ranks, int written) {
    dopt_status s;
    const char *prev;
    if (finite_ranks > 0) {
        if (mine_finite)
            dopt__dp_pack(dp, params, states);
        else
            memset(dp->work, 0, dp->work_count * sizeof(float));
        prev = dopt_comm_set_api(dp->comm, dp->api);
        s = dopt_allreduce_weighted_mean(dp->comm, dp->work, dp->work_count, DOPT_F32, mine_finite ? 1.0 : 0.0);
        dopt_comm_set_api(dp->comm, prev);
        if (s != DOPT_OK) return s;
        if (dopt_all_finite(dp->work, dp->work_count)) return DOPT_ERR_NONFINITE; /* skipped, and mended */
    }
    dp->status = DOPT_ERR_NONFINITE;
    snprintf(dp->detail + strlen(dp->detail), sizeof dp->detail - strlen(dp->detail),
             "; %s: the driver stopped", written        ? "the parameters hold it already"
                                         : finite_ranks ? "the mean of the finite ranks is not finite either"
                                                        : "no rank holds finite parameters");
    dopt_comm_log(dp->comm, DOPT_LOG_ERROR, "rank %d: %s", dp->comm->rank, dp->detail);
    dp->logged = 1;
    return DOPT_ERR_NONFINITE;
}

/* A round whose average is not finite: named, then FAIL stops the driver with the parameters as
   they were, and SKIP puts the mean of the finite ranks in their place. `written`: the average
   was finite in every input and overflowed, found as it went into params (the same bits on every
   rank): nothing finite is left to continue from, so the driver stops whatever the policy. */
static dopt_status dopt__dp_models_not_finite(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states,
                                              int mine_finite, int from_input, int written) {
    int finite_ranks = 0;
    dopt_status s = dopt__dp_nonfinite(dp, params, dp->compressor, from_input, mine_finite, &finite_ranks);
    if (s == DOPT_ERR_NONFINITE && dp->nonfinite == DOPT_NONFINITE_SKIP)
        s = dopt__dp_rescue_average(dp, params, states, mine_finite, written ? 0 : finite_ranks, written);
    if (s == DOPT_ERR_NONFINITE && dp->status == DOPT_OK) {
        (void)dopt__dp_unpack(dp, params, states); /* the rescue checked it */
        if (dp->anchor && dp->n) memcpy(dp->anchor, dp->work, dp->n * sizeof(float));
    }
    return s;
}

/* The round's average into params and states. The verdict costs no pass of its own: a slot after
   the workspace carries this rank's flag (from the copy in) through the same allreduce, so every
   rank knows before anything is written whether some input held NaN or infinity (SKIP's mean of
   the finite ranks needs every rank's parameters as they were); an average of finite inputs that
   overflows is found on the copy out. */
static dopt_status dopt__dp_average_models(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    int across = dp->batch && dp->batch->cfg.estimator == DOPT_BATCH_ACROSS, mine_finite, averaged;
    size_t slot = dp->work_count;
    double local_d2 = 0.0;
    dopt_batch_stats st;
    dopt_status s;
    mine_finite = dopt__dp_pack(dp, params, states);
    dp->work[slot] = mine_finite ? 0.0f : 1.0f;
    /* ELASTIC (no compressor): whether a member holds a joiner rides in the average's next slot */
    if (dp->elastic) dp->work[slot + 1] = dopt_comm_joiners_held(dp->comm) > 0 ? 1.0f : 0.0f;
    if (across) local_d2 = dopt__dp_sqdist(dp->work, dp->anchor, dp->n);
    if (dp->compressor)
        s = dopt__dp_average_compressed(dp);
    else if (dp->weighted)
        s = dopt_allreduce_weighted_mean(dp->comm, dp->work, slot + 1 + dp->elastic, DOPT_F32, dp->round_samples);
    else
        s = dopt_allreduce(dp->comm, dp->work, slot + 1 + dp->elastic, DOPT_F32, DOPT_MEAN);
    dp->joiners_waiting = dp->elastic && s == DOPT_OK && dp->work[slot + 1] != 0.0f;
    averaged = s == DOPT_OK; /* else the compressor refused before writing: the input names the place */
    if (s == DOPT_OK && dp->work[slot] != 0.0f) s = DOPT_ERR_NONFINITE;
    if (s == DOPT_ERR_NONFINITE) return dopt__dp_models_not_finite(dp, params, states, mine_finite, !averaged, 0);
    if (s != DOPT_OK) return s;
    if (across) {
        s = dopt__dp_across_stats(dp, params, local_d2, &st);
        if (s != DOPT_OK) return s;
        dopt__batch_apply(dp->batch, &st, dp->comm);
    }
    if (dp->outer) dopt__dp_outer_step(dp);
    if (!dopt__dp_unpack(dp, params, states))
        return dopt__dp_models_not_finite(dp, params, states, mine_finite, 0, 1);
    if (dp->anchor && dp->n) memcpy(dp->anchor, dp->work, dp->n * sizeof(float));
    return DOPT_OK;
}

/* Check once: on a poisoned communicator every call of the driver fails at once with its status,
   a step that would not communicate included. */
static void dopt__dp_ov_quiesce(dopt_dp *dp);

static dopt_status dopt__dp_poisoned(dopt_dp *dp) {
    if (dp->work == NULL) return dp->status != DOPT_OK ? dp->status : DOPT_ERR_CLOSED; /* refused, or closed */
    dopt__dp_ov_quiesce(dp); /* no bucket runs on the communicator while this thread reads it */
    if (dp->status != DOPT_OK) return dp->status; /* a non-finite average under DOPT_NONFINITE_FAIL */
    return dopt__family_error(dp->comm);
}

/* What reads the anchor before anything wrote it: an average from it would be taken against zeros
   (DiLoCo's first outer step at lr 0.7, μ 0.9 would set the model to 1.33× the mean). Refused on
   every rank alike (the configuration and the collective calls that set it are the same
   everywhere); NULL when nothing needs it or it is set. */
static const char *dopt__dp_anchor_missing(const dopt_dp *dp) {
    if (dp->anchor == NULL || dp->anchor_set) return NULL;
    if (dp->compressor) return "the compressed model deltas (x - anchor)";
    if (dp->outer) return "the outer optimizer's step (anchor - mean)";
    if (dp->batch && dp->batch->cfg.estimator == DOPT_BATCH_ACROSS) return "the across-worker batch estimator";
    return NULL; /* keep_anchor alone: the host reads it, nothing averages from it */
}

static dopt_status dopt__dp_check_anchor(dopt_dp *dp, const char *api) {
    const char *who = dopt__dp_anchor_missing(dp);
    if (who == NULL) return DOPT_OK;
    dopt__dp_fail_detail(dp, "%s: the anchor (the model every rank starts a round from) was never set, and %s reads "
                             "it; call dopt_dp_broadcast (or give dopt_dp_config.params, or dopt_dp_load) before the "
                             "first step", api, who);
    return DOPT_ERR_INVALID;
}

/* A host that never calls after_step: the gradients of step `step` were averaged and no after_step
   followed, so its next after_backward (or the close, or a save) finds that step over. */
static uint64_t dopt__dp_steps_done(const dopt_dp *dp) { return dp->step + (dp->grads_step == dp->step + 1); }

/* A call that needs the step's buckets settled: refused while a synchronous step has marked
   segments that no after_backward completed (its buckets average into the gradients and the
   workspace; a save would catch the compressor mid-step). After a failure the failure speaks. */
static dopt_status dopt__dp_no_open_step(dopt_dp *dp, const char *api) {
    if (dp->work == NULL) return DOPT_OK;
    dopt__dp_ov_quiesce(dp);
    if (dp->status != DOPT_OK || !dp->ov.marked || dp->ov.step != dopt__dp_steps_done(dp) + 1) return DOPT_OK;
    if (dopt__family_error(dp->comm) != DOPT_OK) return DOPT_OK;
    dopt__dp_fail_detail(dp, "%s: %zu of the %zu gradient segments of step %llu are marked (dopt_dp_grad_ready) and "
                             "no dopt_dp_after_backward completed the step: call it first",
                         api, dp->ov.marked, dp->ov.nseg, (unsigned long long)dopt__dp_steps_done(dp));
    return DOPT_ERR_INVALID;
}

static void dopt__dp_count_pending_step(dopt_dp *dp) {
    if (dp->grads_step != dp->step + 1) return;
    dp->step++;
    dp->syncs++;
}

/* A flat descriptor of n elements whose segments, if it has a table, tile it without gaps: its
   buffer is the packed layout itself, so the gradient mean is made there, without the copies. */
static int dopt__dp_in_place(const dopt_buf *b, size_t n) { return b->data != NULL && b->n == n; }

/* The gradient mean of n packed floats at x: through the gradient compressor (its own segments),
   weighted by the step's samples, or plain. */
static dopt_status dopt__dp_grad_mean(dopt_dp *dp, float *x) {
    if (dp->grad_compressor) return dopt_compress_allreduce(dp->grad_compressor, dp->comm, x, dp->n);
    if (dp->weighted) return dopt_allreduce_weighted_mean(dp->comm, x, dp->n, DOPT_F32, dopt__dp_step_samples(dp));
    return dopt_allreduce(dp->comm, x, dp->n, DOPT_F32, DOPT_MEAN);
}

/* The mean in the gradients' own buffer. The average overwrites this rank's input, so the verdict
   on the input (*mine) is a read-only scan taken before; a compressor needs none: it accepts only
   inputs that are finite on every rank, and when it refuses it leaves grads as they were. The
   verdict on the average (*finite) is a scan of it, the same bits on every rank. */
static dopt_status dopt__dp_grads_in_place(dopt_dp *dp, float *g, int *mine, int *finite) {
    dopt_status s;
    *mine = dp->grad_compressor != NULL || dopt_all_finite(g, dp->n);
    s = dopt__dp_grad_mean(dp, g);
    if (s == DOPT_ERR_NONFINITE && dp->grad_compressor) *mine = dopt_all_finite(g, dp->n);
    *finite = s == DOPT_OK && dopt_all_finite(g, dp->n);
    return s;
}

/* The mean of any other descriptor (a scatter list, a table with gaps): packed into the workspace
   and back, the verdicts riding on the copies (this rank's input on the way in, the average on
   the way out). */
static dopt_status dopt__dp_grads_packed(dopt_dp *dp, const dopt_buf *grads, int *mine, int *finite) {
    dopt_status s;
    *mine = dopt__dp_pack_finite(grads, dp->work);
    s = dopt__dp_grad_mean(dp, dp->work);
    *finite = s == DOPT_OK && dopt__dp_unpack_finite(grads, dp->work);
    return s;
}

/* ===================================================================== SYNCHRONOUS STEPS: BUCKETS DURING BACKWARD

   The host marks each segment of its gradients final as backward produces it
   (dopt_dp_grad_ready); segments are grouped into buckets in the order they become final, and a
   bucket's average starts on the driver's worker thread the moment its last segment is marked,
   after the buckets before it (every rank starts the same buckets in the same order: the
   collectives' sequence numbers match). after_backward waits for them and gives the verdict
   the whole-buffer average would. The first step that marks cuts buckets from the segment table
   in reverse (backward's order) and records the order it saw; its after_backward agrees the
   order among the ranks (one allgather), measures the link when no size was given, and cuts the
   buckets again, once. */

struct dopt__dp_bucket {
    dopt_dp *dp;
    size_t k, first, end; /* bucket k holds ov.order[first .. end) */
    int staged;           /* its segments pass through the stage (a copy in and out) */
    float *region;        /* fp32: the contiguous floats averaged, in place or in the stage */
    size_t count;         /* ... and how many */
    int mine, finite;     /* this rank's input was finite; the average is */
    dopt_status status;   /* how its average ended (written by the job itself) */
    uint64_t ticket;      /* the worker's ticket */
};

/* A host's mistake in a step's marks, found on the rank that made it and agreed by every rank at
   after_backward (the verdict): the lowest kind is not an order of gravity, only a code. */
enum {
    DOPT__DP_MARK_FINE = 0,
    DOPT__DP_MARKED_TWICE = 1,      /* a segment marked a second time */
    DOPT__DP_MARKED_UNKNOWN = 2,    /* a segment index beyond the table */
    DOPT__DP_NEVER_MARKED = 3,      /* a segment not marked by a step that marked others */
    DOPT__DP_WRITTEN_AFTER = 4,     /* a segment written after its mark (overlap_check) */
    DOPT__DP_OTHER_GRADS = 5        /* after_backward given other gradients than those marked */
};

/* Keeps the step's first mistake on this rank; later ones are consequences or repeats. */
static void dopt__dp_ov_mistake(dopt_dp_overlap *ov, int kind, size_t seg) {
    if (ov->mistake) return;
    ov->mistake = kind;
    ov->mistake_seg = seg;
}

#define DOPT__DP_BUCKET_FIRST_STEP ((size_t)4 << 20) /* bytes per bucket before the link is measured */
#define DOPT__DP_FIRST_BUCKET ((size_t)1 << 20)      /* the first bucket's cap (PyTorch DDP's) */
#define DOPT__DP_BUCKET_MIN ((size_t)64 << 10)       /* the smallest bucket the rule chooses */
#define DOPT__DP_PROBE_BYTES ((size_t)4 << 20)       /* the rebuild's timed allreduce, at most */

static void dopt__dp_ov_free(dopt_dp_overlap *ov) {
    dopt__worker_free(ov->worker); /* first: it may run a bucket still */
    DOPT_FREE(ov->segs);
    DOPT_FREE(ov->spans);
    DOPT_FREE(ov->order);
    DOPT_FREE(ov->seen);
    DOPT_FREE(ov->stage_off);
    DOPT_FREE(ov->marks);
    DOPT_FREE(ov->sums);
    DOPT_FREE(ov->stage_spans);
    DOPT_FREE(ov->buckets);
    ov->worker = NULL;
    ov->segs = NULL;
    ov->spans = NULL;
    ov->order = ov->seen = ov->stage_off = NULL;
    ov->marks = NULL;
    ov->sums = NULL;
    ov->stage_spans = NULL;
    ov->buckets = NULL;
    ov->nseg = ov->nbuckets = 0;
}

/* "segment 3 ('h1.w')", as details name a segment. */
static const char *dopt__dp_seg_name(const dopt_dp_overlap *ov, size_t i, char *out, size_t cap) {
    const char *name = ov->segs && i < ov->nseg ? ov->segs[i].name : NULL;
    if (name)
        snprintf(out, cap, "segment %zu ('%s')", i, name);
    else
        snprintf(out, cap, "segment %zu", i);
    return out;
}

static dopt_span dopt__dp_host_span(const dopt_dp_overlap *ov, size_t i) { return dopt_buf_segment(&ov->grads, i); }

/* Where bucket k's segments are read and written: the stage, or the gradients themselves. */
static dopt_span dopt__dp_bucket_span(const dopt_dp *dp, const dopt__dp_bucket *b, size_t i) {
    return b->staged ? dp->ov.stage_spans[i] : dopt__dp_host_span(&dp->ov, i);
}

/* A staged bucket's means from the stage into the gradients. */
static void dopt__dp_bucket_copy_out(const dopt_dp *dp, const dopt__dp_bucket *b) {
    size_t j;
    for (j = b->first; j < b->end; j++) {
        size_t i = dp->ov.order[j];
        dopt_span h = dopt__dp_host_span(&dp->ov, i);
        if (h.count) memcpy(h.ptr, dp->ov.stage_spans[i].ptr, h.count * sizeof(float));
    }
}

/* Places the buckets as cut (bucket_end in each bucket): the stage in bucket order; a bucket
   averages in place when the gradients are one flat buffer tiled by its segments and (fp32) its
   segments are consecutive there, and through the stage otherwise (or when overlap_check holds
   the gradients untouched until after_backward). */
static void dopt__dp_ov_place(dopt_dp *dp) {
    dopt_dp_overlap *ov = &dp->ov;
    size_t k, j, off = 0;
    for (j = 0; j < ov->nseg; j++) {
        size_t i = ov->order[j];
        ov->stage_off[i] = off;
        ov->stage_spans[i].ptr = dp->work + off;
        ov->stage_spans[i].count = dopt__dp_host_span(ov, i).count;
        off += ov->stage_spans[i].count;
    }
    for (k = 0; k < ov->nbuckets; k++) {
        dopt__dp_bucket *b = &ov->buckets[k];
        size_t lo = SIZE_MAX, hi = 0, count = 0;
        for (j = b->first; j < b->end; j++) {
            size_t i = ov->order[j];
            lo = i < lo ? i : lo;
            hi = i > hi ? i : hi;
            count += dopt__dp_host_span(ov, i).count;
        }
        b->dp = dp;
        b->k = k;
        b->count = count;
        b->staged = !ov->direct || ov->check || (!dp->grad_compressor && hi - lo + 1 != b->end - b->first);
        b->region = b->staged ? dp->work + ov->stage_off[ov->order[b->first]] : dopt__dp_host_span(ov, lo).ptr;
    }
}

/* Cuts ov.order into buckets: the first up to `first` bytes, the others up to `size` (a segment
   larger than a bucket is a bucket of its own; segments are never split). */
static void dopt__dp_ov_cut(dopt_dp *dp, size_t size, size_t first) {
    dopt_dp_overlap *ov = &dp->ov;
    size_t j = 0, k = 0;
    while (j < ov->nseg) {
        size_t cap = k == 0 ? first : size, bytes = 0;
        ov->buckets[k].first = j;
        do {
            bytes += dopt__dp_host_span(ov, ov->order[j]).count * sizeof(float);
            j++;
        } while (j < ov->nseg && bytes + dopt__dp_host_span(ov, ov->order[j]).count * sizeof(float) <= cap);
        ov->buckets[k++].end = j;
    }
    ov->nbuckets = k;
    ov->cut_bytes = size;
    dopt__dp_ov_place(dp);
}

/* The first segment whose count differs between the gradient compressor's table and g (when one
   table is the other's beginning, the first segment one of them lacks), SIZE_MAX when they fit:
   a bucket hands the compressor whole segments by their index. */
static size_t dopt__dp_misfit(const dopt_compressor *cz, const dopt_buf *g) {
    size_t i, nseg = dopt_buf_nsegs(g);
    for (i = 0; i < nseg && i < cz->nsegs; i++)
        if (dopt_buf_segment(g, i).count != cz->segs[i].count) return i;
    return nseg == cz->nsegs ? SIZE_MAX : i;
}

/* Why the compressor's table does not fit g: the first segment that differs, both counts. */
static void dopt__dp_misfit_said(dopt_dp *dp, const dopt_compressor *cz, const dopt_buf *g) {
    size_t i = dopt__dp_misfit(cz, g), nseg = dopt_buf_nsegs(g);
    const char *name = i < nseg && g->segs && !g->spans ? g->segs[i].name : NULL;
    char mine[32] = "none", theirs[32] = "none";
    if (i < cz->nsegs) snprintf(mine, sizeof mine, "%zu elements", cz->segs[i].count);
    if (i < nseg) snprintf(theirs, sizeof theirs, "%zu elements", dopt_buf_segment(g, i).count);
    dopt__dp_fail_detail(dp, "dopt_dp_set_grads: the gradient compressor's table (%zu segments) does not fit the "
                             "gradients' (%zu): segment %zu%s%s%s has %s in the compressor's, %s in the gradients' "
                             "(buckets hand it whole segments: give it the gradients' table)",
                         cz->nsegs, nseg, i, name ? " ('" : "", name ? name : "", name ? "')" : "", mine, theirs);
}

/* The gradients' descriptor, copied: its tables, the bucket workspaces (once per layout), the
   first step's buckets. A descriptor of the same layout keeps the buckets already agreed. */
static dopt_status dopt__dp_ov_setup(dopt_dp *dp, const dopt_buf *g) {
    dopt_dp_overlap *ov = &dp->ov;
    size_t nseg = dopt_buf_nsegs(g), i;
    int same = ov->nseg == nseg;
    for (i = 0; same && i < nseg; i++) same = dopt_buf_segment(g, i).count == dopt__dp_host_span(ov, i).count;
    if (dp->grad_compressor && dopt__dp_misfit(dp->grad_compressor, g) != SIZE_MAX) {
        dopt__dp_misfit_said(dp, dp->grad_compressor, g);
        return DOPT_ERR_INVALID;
    }
    if (!same) {
        dopt__dp_ov_free(ov); /* the worker too: its room is one job per segment */
        ov->order = (size_t *)DOPT_MALLOC(nseg * sizeof(size_t));
        ov->seen = (size_t *)DOPT_MALLOC(nseg * sizeof(size_t));
        ov->stage_off = (size_t *)DOPT_MALLOC(nseg * sizeof(size_t));
        ov->marks = (unsigned char *)DOPT_MALLOC(nseg);
        ov->stage_spans = (dopt_span *)DOPT_MALLOC(nseg * sizeof(dopt_span));
        ov->buckets = (dopt__dp_bucket *)DOPT_MALLOC(nseg * sizeof(dopt__dp_bucket));
        ov->segs = (dopt_segment *)DOPT_MALLOC(nseg * sizeof(dopt_segment));
        ov->spans = (dopt_span *)DOPT_MALLOC(nseg * sizeof(dopt_span));
        ov->sums = ov->check ? (uint64_t *)DOPT_MALLOC(nseg * sizeof(uint64_t)) : NULL;
        if (!ov->order || !ov->seen || !ov->stage_off || !ov->marks || !ov->stage_spans || !ov->buckets || !ov->segs ||
            !ov->spans || (ov->check && !ov->sums)) {
            dopt__dp_ov_free(ov);
            dopt__dp_fail_detail(dp, "dopt_dp_set_grads: out of memory for the buckets of %zu segments", nseg);
            return DOPT_ERR_NOMEM;
        }
        ov->nseg = nseg;
        memset(ov->marks, 0, nseg);
        for (i = 0; i < nseg; i++) ov->order[i] = nseg - 1 - i; /* backward visits the last layer first */
        ov->rebuilt = 0;
        ov->step = 0;
    }
    if (g->spans) {
        memcpy(ov->spans, g->spans, nseg * sizeof(dopt_span));
        ov->grads = dopt_buf_scatter(ov->spans, nseg);
        memset(ov->segs, 0, nseg * sizeof(dopt_segment));
    } else {
        if (g->segs) {
            memcpy(ov->segs, g->segs, nseg * sizeof(dopt_segment));
        } else {
            memset(ov->segs, 0, sizeof(dopt_segment));
            ov->segs[0].count = g->n;
        }
        ov->grads = dopt_buf_flat(g->data, g->n, ov->segs, nseg);
    }
    ov->direct = dopt__dp_in_place(g, dp->n);
    if (!same || !ov->rebuilt) {
        size_t size = ov->bucket_bytes ? ov->bucket_bytes : DOPT__DP_BUCKET_FIRST_STEP;
        dopt__dp_ov_cut(dp, size, ov->first_bytes ? ov->first_bytes : (size < DOPT__DP_FIRST_BUCKET ? size : DOPT__DP_FIRST_BUCKET));
    } else {
        dopt__dp_ov_place(dp);
    }
    return DOPT_OK;
}

/* One bucket's average, on the worker (or in after_backward): in through the stage when it is
   staged, the verdict on this rank's input, the mean (fp32, weighted, or the gradient
   compressor over the bucket's segments), the verdict on the mean, and out again. Under
   overlap_check the mean stays in the stage until after_backward has checked the gradients. */
/* Processor time of the calling thread (ms), 0 where the platform cannot tell. */
static double dopt__dp_thread_cpu_ms(void) {
#if defined(CLOCK_THREAD_CPUTIME_ID)
    struct timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
#endif
    return 0.0;
}

static dopt_status dopt__dp_bucket_run(void *arg) {
    dopt__dp_bucket *b = (dopt__dp_bucket *)arg;
    dopt_dp *dp = b->dp;
    dopt_dp_overlap *ov = &dp->ov;
    double t0 = dopt__now_ms(), cpu0 = dopt__dp_thread_cpu_ms();
    const char *prev;
    size_t j;
    dopt_status s;
    snprintf(ov->label, sizeof ov->label, "dopt_dp_grad_ready: bucket %zu of %zu of step %llu's gradient average", b->k,
             ov->nbuckets, (unsigned long long)(ov->step - 1));
    prev = dopt_comm_set_api(dp->comm, ov->label);
    b->mine = 1;
    for (j = b->first; j < b->end; j++) {
        size_t i = ov->order[j];
        dopt_span h = dopt__dp_host_span(ov, i);
        if (b->staged && h.count) memcpy(ov->stage_spans[i].ptr, h.ptr, h.count * sizeof(float));
        b->mine = b->mine && dopt_all_finite(h.ptr, h.count);
    }
    if (dp->grad_compressor) {
        dopt_buf view = b->staged ? dopt_buf_scatter(ov->stage_spans, ov->nseg) : ov->grads;
        s = dopt_compress_allreduce_segments(dp->grad_compressor, dp->comm, &view, ov->order + b->first,
                                             b->end - b->first);
    } else if (dp->weighted) {
        s = dopt_allreduce_weighted_mean(dp->comm, b->region, b->count, DOPT_F32, ov->weight);
    } else {
        s = dopt_allreduce(dp->comm, b->region, b->count, DOPT_F32, DOPT_MEAN);
    }
    b->finite = s == DOPT_OK;
    for (j = b->first; j < b->end && b->finite; j++) {
        dopt_span sp = dopt__dp_bucket_span(dp, b, ov->order[j]);
        b->finite = dopt_all_finite(sp.ptr, sp.count);
    }
    if (s == DOPT_OK && b->staged && !ov->check) dopt__dp_bucket_copy_out(dp, b);
    dopt_comm_set_api(dp->comm, prev);
    b->status = s;
    ov->busy_ms += dopt__now_ms() - t0;
    ov->cpu_ms += dopt__dp_thread_cpu_ms() - cpu0;
    return s;
}

/* Waits for the buckets started so far (the step's wait time counts it). */
static void dopt__dp_ov_quiesce(dopt_dp *dp) {
    dopt_dp_overlap *ov = &dp->ov;
    double t0;
    if (ov->worker == NULL || ov->waited == ov->started) return;
    t0 = dopt__now_ms();
    (void)dopt__worker_wait(ov->worker, ov->buckets[ov->started - 1].ticket); /* each bucket keeps its status */
    ov->waited = ov->started;
    ov->wait_ms += dopt__now_ms() - t0;
}

/* Starts the buckets whose segments are all marked, in bucket order: a complete bucket waits
   for the ones before it. Without a worker they wait for after_backward. */
static void dopt__dp_ov_start_ready(dopt_dp *dp, int run_inline) {
    dopt_dp_overlap *ov = &dp->ov;
    while (ov->started < ov->nbuckets) {
        dopt__dp_bucket *b = &ov->buckets[ov->started];
        size_t j;
        for (j = b->first; j < b->end; j++)
            if (!ov->marks[ov->order[j]]) return;
        if (ov->worker)
            (void)dopt__worker_post(ov->worker, dopt__dp_bucket_run, b, &b->ticket); /* cannot fail */
        else if (run_inline)
            (void)dopt__dp_bucket_run(b); /* it keeps its status */
        else
            return;
        ov->started++;
    }
}

/* The first mark of a synchronous step: the step's bookkeeping, and the worker at the first. */
static void dopt__dp_ov_begin(dopt_dp *dp, uint64_t step) {
    dopt_dp_overlap *ov = &dp->ov;
    const char *why;
    memset(ov->marks, 0, ov->nseg);
    ov->step = step + 1;
    ov->started = ov->waited = ov->nseen = ov->marked = 0;
    ov->mistake = 0;
    ov->weight = dopt__dp_step_samples(dp);
    ov->t_first = dopt__now_ms();
    ov->busy_ms = ov->cpu_ms = ov->wait_ms = 0.0;
    if (ov->worker != NULL || ov->inline_said) return;
#ifdef DOPT__THREADS
    if (!dp->comm->one_thread && dopt__worker_new(&ov->worker, (int)(ov->nseg < INT_MAX ? ov->nseg : INT_MAX)) == DOPT_OK)
        return; /* room for every bucket: a mark never waits */
    why = dp->comm->one_thread ? "the communicator may be called only from the thread that made it (MPI initialised "
                                 "below MPI_THREAD_SERIALIZED: to overlap, initialise MPI with MPI_THREAD_SERIALIZED "
                                 "or more before creating the communicator, and make no MPI call while buckets run)"
                               : "no thread could be started";
#else
    why = "this build has no threads (DOPT_NO_THREADS)";
#endif
    ov->worker = NULL;
    dopt_comm_log(dp->comm, DOPT_LOG_INFO, "rank %d: dopt_dp: gradient buckets run in after_backward: %s",
                  dp->comm->rank, why);
    ov->inline_said = 1;
}

static dopt_status dopt__dp_mark(dopt_dp *dp, size_t seg, int unused, const char *api) {
    dopt_dp_overlap *ov = &dp->ov;
    uint64_t step;
    int sync;
    dopt_status s;
    char name[96];
    if (dp == NULL) return DOPT_ERR_INVALID;
    /* The communicator's own state is read only while no bucket is in flight: the worker may be
       running one on it, and after_backward says how they ended. */
    if (dp->work == NULL || dp->status != DOPT_OK || ov->worker == NULL || ov->waited == ov->started)
        if ((s = dopt__dp_poisoned(dp)) != DOPT_OK) return s;
    if (ov->nseg == 0) {
        dopt__dp_fail_detail(dp, "%s: no gradient descriptor: give dopt_dp_config.grads or call dopt_dp_set_grads first",
                             api);
        return DOPT_ERR_INVALID;
    }
    step = dopt__dp_steps_done(dp);
    sync = dopt_dp_is_synchronous(dp, step);
    if (sync && ov->step != step + 1) dopt__dp_ov_begin(dp, step);
    if (seg >= ov->nseg) { /* in a synchronous step, after_backward says it on every rank */
        if (sync) dopt__dp_ov_mistake(ov, DOPT__DP_MARKED_UNKNOWN, seg);
        dopt__dp_fail_detail(dp, "%s: segment %zu: the gradients have %zu segments", api, seg, ov->nseg);
        return DOPT_ERR_INVALID;
    }
    if (!sync) return DOPT_OK; /* a local step: nothing is averaged */
    if (ov->marks[seg]) {
        dopt__dp_ov_mistake(ov, DOPT__DP_MARKED_TWICE, seg);
        dopt__dp_fail_detail(dp, "%s: %s was marked already in step %llu", api, dopt__dp_seg_name(ov, seg, name, sizeof name),
                             (unsigned long long)step);
        return DOPT_ERR_INVALID;
    }
    if (unused) {
        dopt_span sp = dopt__dp_host_span(ov, seg);
        if (sp.count) memset(sp.ptr, 0, sp.count * sizeof(float));
    }
    if (ov->sums) {
        dopt_span sp = dopt__dp_host_span(ov, seg);
        ov->sums[seg] = dopt__fnv1a(DOPT__FNV_OFFSET, sp.ptr, sp.count * sizeof(float));
    }
    ov->marks[seg] = 1;
    ov->marked++;
    if (!ov->rebuilt) ov->seen[ov->nseen++] = seg;
    ov->t_last = dopt__now_ms();
    dopt__dp_ov_start_ready(dp, 0);
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_dp_grad_ready(dopt_dp *dp, size_t seg) { return dopt__dp_mark(dp, seg, 0, "dopt_dp_grad_ready"); }

DOPT_DEF dopt_status dopt_dp_grad_unused(dopt_dp *dp, size_t seg) { return dopt__dp_mark(dp, seg, 1, "dopt_dp_grad_unused"); }

DOPT_DEF dopt_status dopt_dp_set_grads(dopt_dp *dp, const dopt_buf *grads) {
    dopt_status s;
    if (dp == NULL) return DOPT_ERR_INVALID;
    if ((s = dopt__dp_poisoned(dp)) != DOPT_OK) return s;
    if (dp->ov.step == dopt__dp_steps_done(dp) + 1 && dp->ov.marked) {
        dopt__dp_fail_detail(dp, "dopt_dp_set_grads: segments of step %llu are marked already; call it before the first "
                                 "dopt_dp_grad_ready of a step",
                             (unsigned long long)dopt__dp_steps_done(dp));
        return DOPT_ERR_INVALID;
    }
    if (dopt__dp_check_buf(grads, dp->n) != DOPT_OK) {
        dopt__dp_fail_detail(dp, "dopt_dp_set_grads: not a valid descriptor of %zu elements", dp->n);
        return DOPT_ERR_INVALID;
    }
    return dopt__dp_ov_setup(dp, grads);
}

/* 1 when g is the descriptor the buckets average (the same buffer, or spans at the same places). */
static int dopt__dp_ov_same_buf(const dopt_dp_overlap *ov, const dopt_buf *g) {
    size_t i;
    if (g->spans == NULL && g->segs == NULL && ov->grads.spans == NULL && g->data == ov->grads.data)
        return 1; /* dopt_dp_after_backward(dp, grads): the same flat buffer, without its table */
    if (dopt_buf_nsegs(g) != ov->nseg || (g->spans == NULL) != (ov->grads.spans == NULL)) return 0;
    for (i = 0; i < ov->nseg; i++) {
        dopt_span a = dopt_buf_segment(g, i), b = dopt__dp_host_span(ov, i);
        if (a.ptr != b.ptr || a.count != b.count) return 0;
    }
    return 1;
}

/* The bucket size from what the rebuild measured (REFERENCE: THE BUCKET SIZE): S bytes on the
   wire per step, a collective's fixed cost alpha (s), the rate R (bytes/s), backward's time Tb
   (s). With c(B) = S/R + (S/B)·alpha the step's communication, the time it adds to the step is
   max(0, c(B) − Tb) plus the last bucket's B/R + alpha, which cannot start before backward ends.
   When the communication fits behind backward with room (Tb > S/R) the smallest B that keeps it
   there, S·alpha/(Tb − S/R), wins unless it exceeds sqrt(S·alpha·R), the size that minimizes
   the time otherwise. examples/perf_model.c predicts overlapped steps with this very function and
   DOPT__DP_FIRST_BUCKET (tests/check_examples.sh checks it has no copy): keep their names. */
static size_t dopt__dp_bucket_rule(double S, double alpha, double R, double Tb) {
    double B = sqrt(S * alpha * R);
    if (Tb > S / R) {
        double fit = S * alpha / (Tb - S / R);
        if (fit < B) B = fit;
    }
    if (!(B >= (double)DOPT__DP_BUCKET_MIN)) B = (double)DOPT__DP_BUCKET_MIN; /* NaN too */
    if (B > S) B = S;
    return B < (double)DOPT__DP_BUCKET_MIN ? DOPT__DP_BUCKET_MIN : (size_t)B;
}

/* One small allreduce, as a bucket runs it: on the worker when there is one, so that its fixed
   cost counts the hand-over to the thread and back. */
typedef struct dopt__dp_probe {
    dopt_dp *dp;
    float x[2];
} dopt__dp_probe;

static dopt_status dopt__dp_probe_run(void *arg) {
    dopt__dp_probe *p = (dopt__dp_probe *)arg;
    return dopt_allreduce(p->dp->comm, p->x, 2, DOPT_F32, DOPT_SUM);
}

static dopt_status dopt__dp_probe_small(dopt_dp *dp, double *ms) {
    dopt__dp_probe p;
    uint64_t ticket;
    double t0 = dopt__now_ms();
    dopt_status s;
    p.dp = dp;
    p.x[0] = p.x[1] = 0.0f;
    if (dp->ov.worker) {
        (void)dopt__worker_post(dp->ov.worker, dopt__dp_probe_run, &p, &ticket);
        s = dopt__worker_wait(dp->ov.worker, ticket);
    } else {
        s = dopt__dp_probe_run(&p);
    }
    *ms = dopt__now_ms() - t0;
    return s;
}

/* The first step's end: every rank's order compared (one allgather), then, with no size given,
   the link measured (three small allreduces through the worker, as buckets run, and one of up to
   4 MiB, their times maxed over the ranks), and the buckets cut again in the agreed order. Every rank gets the same numbers, so
   the same buckets. */
static dopt_status dopt__dp_ov_rebuild(dopt_dp *dp) {
    dopt_dp_overlap *ov = &dp->ov;
    int N = dp->comm->size, r;
    size_t words = ov->nseg + 1, j, first;
    uint64_t *all = (uint64_t *)DOPT_MALLOC((size_t)(N + 1) * words * sizeof(uint64_t));
    double tb = (ov->t_last - ov->t_first) / 1e3, t[2];
    const char *prev;
    dopt_status s;
    if (all == NULL) {
        dopt__dp_fail_detail(dp, "dopt_dp_after_backward: out of memory agreeing the bucket order");
        return DOPT_ERR_NOMEM;
    }
    memcpy(all, &tb, sizeof tb);
    for (j = 0; j < ov->nseg; j++) all[1 + j] = j < ov->nseen ? (uint64_t)ov->seen[j] : UINT64_MAX;
    prev = dopt__dp_label(dp, "dopt_dp_after_backward: the bucket order");
    s = dopt_allgather(dp->comm, all, all + words, words * sizeof(uint64_t));
    for (r = 1; s == DOPT_OK && r < N; r++)
        for (j = 0; j < ov->nseg; j++) {
            uint64_t a = all[words + 1 + j], b = all[(size_t)(r + 1) * words + 1 + j];
            char na[96], nb[96];
            if (a == b) continue;
            dopt__dp_fail_detail(dp, "dopt_dp_after_backward: the gradients became final in another order on rank %d than "
                                     "on rank 0: at position %zu rank 0 marked %s, rank %d %s; the buckets need one order "
                                     "(mark the segments in the same order on every rank)",
                                 r, j, a == UINT64_MAX ? "none (a segment never marked)" : dopt__dp_seg_name(ov, (size_t)a, na, sizeof na), r,
                                 b == UINT64_MAX ? "none (a segment never marked)" : dopt__dp_seg_name(ov, (size_t)b, nb, sizeof nb));
            s = DOPT_ERR_MISMATCH;
            break;
        }
    for (r = 0; s == DOPT_OK && r < N; r++) {
        double t_r;
        memcpy(&t_r, &all[(size_t)(r + 1) * words], sizeof t_r);
        if (t_r > tb) tb = t_r;
    }
    if (s == DOPT_OK && ov->bucket_bytes == 0) {
        size_t probe = dp->n * sizeof(float) < DOPT__DP_PROBE_BYTES ? dp->n * sizeof(float) : DOPT__DP_PROBE_BYTES;
        double t0;
        int i;
        memset(dp->work, 0, probe);
        t[0] = 1e30;
        for (i = 0; i < 3 && s == DOPT_OK; i++) {
            double ms;
            s = dopt__dp_probe_small(dp, &ms);
            if (ms < t[0]) t[0] = ms;
        }
        t0 = dopt__now_ms();
        if (s == DOPT_OK) s = dopt_allreduce(dp->comm, dp->work, probe / sizeof(float), DOPT_F32, DOPT_SUM);
        t[1] = dopt__now_ms() - t0;
        if (s == DOPT_OK) s = dopt_allreduce(dp->comm, t, 2, DOPT_F64, DOPT_MAX);
        if (s == DOPT_OK) {
            double S = (double)dp->n * sizeof(float), wire = 1.0;
            if (dp->grad_compressor && dp->grad_compressor->count)
                wire = (double)dopt_compress_bound(dp->grad_compressor) / (4.0 * (double)dp->grad_compressor->count);
            ov->alpha_ms = t[0];
            ov->rate = t[1] > t[0] ? (double)probe / ((t[1] - t[0]) / 1e3) : 1e12;
            ov->cut_bytes = dopt__dp_bucket_rule(S * wire, t[0] / 1e3, ov->rate, tb) / (wire > 0 ? wire : 1.0);
        }
    }
    dopt_comm_set_api(dp->comm, prev);
    DOPT_FREE(all);
    if (s == DOPT_ERR_MISMATCH) { /* the driver's verdict (same on every rank): it stops */
        dp->status = s;
        dp->logged = 1;
        dopt_comm_log(dp->comm, DOPT_LOG_ERROR, "rank %d: %s; the driver stopped", dp->comm->rank, dp->detail);
    }
    if (s != DOPT_OK) return s;
    memcpy(ov->order, ov->seen, ov->nseg * sizeof(size_t));
    first = ov->first_bytes ? ov->first_bytes : DOPT__DP_FIRST_BUCKET;
    if (ov->bucket_bytes) ov->cut_bytes = ov->bucket_bytes;
    dopt__dp_ov_cut(dp, ov->cut_bytes, first < ov->cut_bytes ? first : ov->cut_bytes);
    ov->rebuilt = 1;
    return DOPT_OK;
}

/* overlap_check: every segment's checksum against its mark's, a change this rank's mistake; when
   none changed, the means copied out of the stage (a compressor that refused left the input). */
static void dopt__dp_ov_check_writes(dopt_dp *dp) {
    dopt_dp_overlap *ov = &dp->ov;
    size_t i, k;
    for (i = 0; i < ov->nseg && !ov->mistake; i++) { /* after a mistake the step is zeros anyway */
        dopt_span h = dopt__dp_host_span(ov, i);
        if (dopt__fnv1a(DOPT__FNV_OFFSET, h.ptr, h.count * sizeof(float)) != ov->sums[i])
            dopt__dp_ov_mistake(ov, DOPT__DP_WRITTEN_AFTER, i);
    }
    for (k = 0; k < ov->nbuckets && !ov->mistake; k++)
        if (ov->buckets[k].status == DOPT_OK) dopt__dp_bucket_copy_out(dp, &ov->buckets[k]);
}

/* after_backward of a step that marked segments: the unmarked ones marked (so every bucket runs
   and no peer waits; not marking them is this rank's mistake), every bucket waited for, the
   gradients checked under overlap_check; the verdicts as the whole-buffer average gives them. */
static dopt_status dopt__dp_ov_finish(dopt_dp *dp, int *mine_finite, int *finite) {
    dopt_dp_overlap *ov = &dp->ov;
    dopt_status s = DOPT_OK;
    size_t k, i;
    for (i = 0; i < ov->nseg; i++)
        if (!ov->marks[i]) {
            dopt__dp_ov_mistake(ov, DOPT__DP_NEVER_MARKED, i);
            ov->marks[i] = 1;
        }
    dopt__dp_ov_start_ready(dp, 1);
    dopt__dp_ov_quiesce(dp);
    *mine_finite = *finite = 1;
    for (k = 0; k < ov->nbuckets; k++) {
        const dopt__dp_bucket *b = &ov->buckets[k];
        *mine_finite = *mine_finite && b->mine;
        *finite = *finite && b->finite;
        if (b->status != DOPT_OK && (s == DOPT_OK || s == DOPT_ERR_NONFINITE)) s = b->status;
    }
    if (s != DOPT_OK && s != DOPT_ERR_NONFINITE) {
        if (dopt__family_error(dp->comm) == DOPT_OK) { /* not the communicator's failure: the driver stops */
            dopt__dp_fail_detail(dp, "dopt_dp_after_backward: a bucket of step %llu failed: %s%s%s",
                                 (unsigned long long)(ov->step - 1), dopt_status_str(s),
                                 dp->grad_compressor ? " in the gradient compressor: " : "",
                                 dp->grad_compressor ? dopt_compress_detail(dp->grad_compressor) : "");
            dp->status = s;
        }
        return s; /* else the communicator says where */
    }
    if (ov->check) dopt__dp_ov_check_writes(dp);
    return s;
}

#define DOPT__DP_NO_MISTAKE INT64_MAX

/* The step's mark mistakes, agreed: each rank gives one word, (rank << 40) | (kind << 32) |
   segment (clipped to 32 bits), or DOPT__DP_NO_MISTAKE, to an allreduce MIN, so that every rank
   learns the lowest rank that erred and its first mistake. No other collective of the step
   carries a verdict (the non-finite one is read from the average's bits), so this is one 8-byte
   allreduce per step that marks (docs/measurements.md, the marks' verdict: its cost). */
static dopt_status dopt__dp_ov_agree_marks(dopt_dp *dp, int64_t *verdict) {
    dopt_dp_overlap *ov = &dp->ov;
    int64_t seg = ov->mistake_seg < 0xffffffffu ? (int64_t)ov->mistake_seg : (int64_t)0xffffffffu;
    const char *prev = dopt__dp_label(dp, "dopt_dp_after_backward: the verdict on step %llu's marks",
                                      (unsigned long long)dp->step);
    dopt_status s;
    *verdict = ov->mistake ? (int64_t)dp->comm->rank << 40 | (int64_t)ov->mistake << 32 | seg : DOPT__DP_NO_MISTAKE;
    s = dopt_allreduce(dp->comm, verdict, 1, DOPT_I64, DOPT_MIN);
    dopt_comm_set_api(dp->comm, prev);
    return s;
}

/* What a rank did wrong, from the agreed verdict: the same words on every rank. */
static void dopt__dp_mistake_words(const dopt_dp *dp, int kind, size_t seg, char *out, size_t cap) {
    const dopt_dp_overlap *ov = &dp->ov;
    char name[96];
    if (kind == DOPT__DP_MARKED_UNKNOWN) {
        snprintf(out, cap, "dopt_dp_grad_ready was given segment %zu%s, and the gradients have %zu segments", seg,
                 seg == 0xffffffffu ? " or above" : "", ov->nseg);
        return;
    }
    if (kind == DOPT__DP_OTHER_GRADS) {
        snprintf(out, cap, "after_backward was given other gradients than those marked (dopt_dp_config.grads or "
                           "dopt_dp_set_grads)");
        return;
    }
    dopt__dp_seg_name(ov, seg, name, sizeof name);
    if (kind == DOPT__DP_MARKED_TWICE)
        snprintf(out, cap, "%s was marked twice (once per step)", name);
    else if (kind == DOPT__DP_NEVER_MARKED)
        snprintf(out, cap, "%s was never marked while others were (dopt_dp_grad_unused: no gradient)", name);
    else
        snprintf(out, cap, "%s was written after dopt_dp_grad_ready marked it (overlap_check's checksum); it is the "
                           "average's until after_backward returns", name);
}

/* A mistake in the marks, said alike on every rank: the step's gradients are zeros everywhere
   (a host that applies them anyway keeps identical replicas), the step counts, and the driver
   and the communicator go on. */
static dopt_status dopt__dp_ov_mistake_said(dopt_dp *dp, int64_t verdict) {
    char what[320];
    dopt__dp_mistake_words(dp, (int)(verdict >> 32 & 0xff), (size_t)(verdict & 0xffffffff), what, sizeof what);
    dopt__dp_fail_detail(dp, "dopt_dp_after_backward: step %llu: rank %d: %s; the step's gradients are zeros on every "
                             "rank; the driver goes on",
                         (unsigned long long)dp->step, (int)(verdict >> 40), what);
    dopt__dp_zero(&dp->ov.grads);
    dp->grads_step = dp->step + 1;
    dopt_comm_log(dp->comm, DOPT_LOG_ERROR, "rank %d: %s", dp->comm->rank, dp->detail);
    return DOPT_ERR_INVALID;
}

/* What the average's verdicts make of the step, buckets or whole: grads hold the average, or
   zeros when it is not finite (on every rank, whatever the policy: replicas stay identical even
   where the host applies them). */
static dopt_status dopt__dp_grads_verdict(dopt_dp *dp, const dopt_buf *grads, dopt_status s, int mine_finite,
                                          int finite) {
    int finite_ranks;
    if (s != DOPT_OK && s != DOPT_ERR_NONFINITE) return s;
    if (finite) {
        dp->grads_step = dp->step + 1;
        /* a compressed mean is not the global mean's direction, a weighted one not the plain mean */
        if (dp->batch && dp->batch->cfg.estimator == DOPT_BATCH_WITHIN && !dp->grad_compressor && !dp->weighted)
            dopt__batch_global_direction(dp->batch, grads);
        return DOPT_OK;
    }
    s = dopt__dp_nonfinite(dp, grads, dp->grad_compressor, 1, mine_finite, &finite_ranks);
    if (s != DOPT_ERR_NONFINITE) return s;
    dopt__dp_zero(grads);
    if (dp->status == DOPT_OK) dp->grads_step = dp->step + 1; /* SKIP: zeros are the step's average */
    return s;
}

/* A step whose segments were marked (or a mark refused): the buckets completed, the marks'
   verdict agreed, the first step's rebuild, then the average's verdicts. The gradients are the
   registered descriptor (a flat pointer given without its table has gaps); another one given
   here is a mistake like the marks'. */
static dopt_status dopt__dp_average_buckets(dopt_dp *dp, const dopt_buf *grads, const char *api) {
    dopt_dp_overlap *ov = &dp->ov;
    int mine_finite, finite;
    int64_t verdict;
    const char *prev;
    dopt_status s, agreed;
    if (dopt__dp_check_buf(grads, dp->n) != DOPT_OK || !dopt__dp_ov_same_buf(ov, grads))
        dopt__dp_ov_mistake(ov, DOPT__DP_OTHER_GRADS, ov->nseg);
    dopt__dp_count_pending_step(dp);
    s = dopt__dp_ov_finish(dp, &mine_finite, &finite);
    ov->step = 0;
    if (s != DOPT_OK && s != DOPT_ERR_NONFINITE) return s;
    if ((agreed = dopt__dp_ov_agree_marks(dp, &verdict)) != DOPT_OK) return agreed;
    if (verdict != DOPT__DP_NO_MISTAKE) return dopt__dp_ov_mistake_said(dp, verdict);
    if (!ov->rebuilt && (agreed = dopt__dp_ov_rebuild(dp)) != DOPT_OK) return agreed;
    prev = dopt__dp_label(dp, "%s: the gradient average of step %llu", api, (unsigned long long)dp->step);
    dopt_comm_set_api(dp->comm, prev); /* dp->api names the average in a non-finite verdict */
    return dopt__dp_grads_verdict(dp, &ov->grads, s, mine_finite, finite);
}

/* 1 while a synchronous step has marks (or a refused mark) that no after_backward completed. */
static int dopt__dp_ov_open(const dopt_dp *dp) {
    return dp->ov.nseg && dp->ov.step == dopt__dp_steps_done(dp) + 1 && (dp->ov.marked || dp->ov.mistake);
}

/* The gradient mean of a synchronous step; the step's model average is then skipped. A flat
   buffer is averaged in place, any other descriptor through the workspace; either way grads then
   holds the average, or this rank's input where the compressor refused it, and the verdict comes
   from the average's bits, alike on every rank. */
static dopt_status dopt__dp_average_grads(dopt_dp *dp, const dopt_buf *grads, const char *api) {
    const char *prev;
    int mine_finite, finite;
    dopt_status s;
    if ((s = dopt__dp_poisoned(dp)) != DOPT_OK) return s;
    if ((s = dopt__dp_check_anchor(dp, api)) != DOPT_OK) return s;
    if (dopt__dp_ov_open(dp)) return dopt__dp_average_buckets(dp, grads, api);
    if (dopt__dp_check_buf(grads, dp->n) != DOPT_OK) {
        dopt__dp_fail_detail(dp, "gradients: not a valid descriptor of %zu elements", dp->n);
        return DOPT_ERR_INVALID;
    }
    dopt__dp_count_pending_step(dp);
    if (!dopt_dp_is_synchronous(dp, dp->step)) return DOPT_OK;
    prev = dopt__dp_label(dp, "%s: the gradient average of step %llu", api, (unsigned long long)dp->step);
    s = dopt__dp_in_place(grads, dp->n) ? dopt__dp_grads_in_place(dp, grads->data, &mine_finite, &finite)
                                        : dopt__dp_grads_packed(dp, grads, &mine_finite, &finite);
    dopt_comm_set_api(dp->comm, prev);
    return dopt__dp_grads_verdict(dp, grads, s, mine_finite, finite);
}

DOPT_DEF dopt_status dopt_dp_after_backward_buf(dopt_dp *dp, const dopt_buf *grads) {
    if (dp == NULL) return DOPT_ERR_INVALID;
    return dopt__dp_average_grads(dp, grads, "dopt_dp_after_backward");
}

DOPT_DEF dopt_status dopt_dp_after_backward(dopt_dp *dp, float *grads) {
    dopt_buf b = dopt_buf_flat(grads, dp ? dp->n : 0, NULL, 0);
    return dopt_dp_after_backward_buf(dp, &b);
}

/* Ends a round: the model average (or, when the gradients were averaged, only the anchor), the
   batch decision, the counters. On failure the detail names the step (`how` after it). */
/* ELASTIC. A collective failed because a rank was lost: shrink the communicator and agree where
   the survivors stand. When every survivor lost the same average (each at the end of the same
   round: at_end, the same step and count of averages), *again is set: the caller averages the
   round again over the survivors, whose models a failed average leaves as they were. Otherwise
   some survivor had completed an average the others lost (or failed elsewhere in a round): all
   take the state of the last average any survivor completed, from the lowest such rank (its
   anchor as the model, its AVERAGE states, outer momentum and counters); local steps since are
   dropped. Where no survivor's first broadcast completed (the rank lost during it), rank 0's
   model as it is, as the broadcast would have given it. A communicator this driver made in the same call (a rank lost during this) is
   destroyed here: the host never saw it. */
static dopt_status dopt__dp_survive(dopt_dp *dp, dopt_comm *given, const dopt_buf *params, const dopt_buf *states,
                                    int at_end, int *again) {
    dopt_comm *old = dp->comm, *next = NULL;
    double at[6], state[5];
    int32_t lead;
    int anchored, joined, behind;
    int old_rank = old->rank, old_size = old->size, lost = old->lost_rank;
    dopt_status s = dopt_comm_shrink(old, &next);
    *again = 0;
    if (s != DOPT_OK) return s; /* the old communicator's detail says why */
    dp->comm = next;
    dp->shrinks++;
    if (old != given) dopt_comm_destroy(old);
    dopt_comm_set_api(next, dp->api);
    dopt_comm_log(next, DOPT_LOG_WARN, "elastic: rank %d of %d lost rank %d; the survivors go on, this one as rank %d of %d",
                  old_rank, old_size, lost, next->rank, next->size);
    at[0] = (double)dp->syncs;
    at[1] = -(double)dp->syncs;
    at[2] = (double)dp->step;
    at[3] = -(double)dp->step;
    at[4] = at_end;
    at[5] = -at_end;
    if ((s = dopt_allreduce(next, at, 6, DOPT_F64, DOPT_MAX)) != DOPT_OK) return s;
    if (at[0] == -at[1] && at[2] == -at[3] && at[5] == -1.0) { /* the same average lost everywhere */
        *again = 1;
        return DOPT_OK;
    }
    lead = dp->syncs == (uint64_t)at[0] && dp->anchor_set && !dp->joining ? next->rank : next->size;
    if ((s = dopt_allreduce(next, &lead, 1, DOPT_I32, DOPT_MIN)) != DOPT_OK) return s;
    anchored = lead < next->size;
    if (!anchored && dp->joining) { /* only joiners are left: nobody holds the job's state */
        dp->status = DOPT_ERR_PEER_LOST;
        dopt__dp_fail_detail(dp, "elastic: every member that held the job's state was lost before this joiner had "
                                 "it; start the job again (from its last saved state, dopt_dp_load)");
        return DOPT_ERR_PEER_LOST;
    }
    if (!anchored) { /* nobody's first broadcast completed: rank 0's model as it is, as the broadcast would */
        lead = 0;
        dp->sync_step = dp->step;
    }
    if (next->rank == lead) {
        dopt__dp_pack(dp, params, states); /* the AVERAGE states as they are ... */
        if (anchored && dp->n) memcpy(dp->work, dp->anchor, dp->n * sizeof(float)); /* ... and the last average's model */
    }
    state[0] = (double)dp->sync_step;
    state[1] = (double)dp->syncs;
    state[2] = (double)dp->skipped;
    state[3] = (double)dp->grads_step;
    state[4] = 0.0;
    if ((s = dopt_broadcast(next, state, sizeof state, lead)) != DOPT_OK ||
        (s = dopt_broadcast(next, dp->work, dp->work_count * sizeof(float), lead)) != DOPT_OK ||
        (dp->outer_v && (s = dopt_broadcast(next, dp->outer_v, dp->n * sizeof(float), lead)) != DOPT_OK))
        return s;
    if (dp->host_bytes) { /* a joiner takes the lead's host bytes (dopt_dp_host_state); the others keep theirs */
        int keep = !dp->joining && next->rank != lead;
        unsigned char *scratch = keep ? (unsigned char *)DOPT_MALLOC(dp->host_bytes) : NULL;
        s = keep && scratch == NULL ? DOPT_ERR_NOMEM
                                    : dopt_broadcast(next, keep ? scratch : dp->host, dp->host_bytes, lead);
        if (scratch) DOPT_FREE(scratch);
        if (s != DOPT_OK) return s;
    }
    joined = dp->joining; /* a joiner has the job's state now */
    behind = dp->syncs < (uint64_t)at[0];
    dp->joining = 0;
    dp->step = dp->sync_step = (uint64_t)state[0];
    dp->syncs = (uint64_t)state[1];
    dp->skipped = (uint64_t)state[2];
    dp->grads_step = (uint64_t)state[3];
    dp->round_steps = 0;
    dp->round_samples = 0.0;
    dp->anchor_set = 1;
    if (dp->n) memcpy(dp->anchor, dp->work, dp->n * sizeof(float));
    dopt__dp_unpack(dp, params, states);
    if (joined)
        dopt_comm_log(next, DOPT_LOG_WARN, "elastic: this joiner takes rank %d's model and goes on from step %llu (its "
                      "KEEP states stay as they were)", (int)lead, (unsigned long long)dp->step);
    else if (next->rank == lead)
        dopt_comm_log(next, DOPT_LOG_WARN, "elastic: the survivors go on from this rank's last average (after step %llu)",
                      (unsigned long long)dp->step);
    else if (behind)
        dopt_comm_log(next, DOPT_LOG_WARN, "elastic: rank %d completed an average this rank lost: this rank takes its "
                      "model and goes on from step %llu", (int)lead, (unsigned long long)dp->step);
    else
        dopt_comm_log(next, DOPT_LOG_WARN, "elastic: the survivors go on from their last average (rank %d's, after "
                      "step %llu)", (int)lead, (unsigned long long)dp->step);
    return DOPT_OK;
}

static int dopt__dp_lost_peer(const dopt_dp *dp, dopt_status s) {
    return dp->elastic && dp->status == DOPT_OK && (s == DOPT_ERR_PEER_LOST || s == DOPT_ERR_TIMEOUT);
}

static dopt_status dopt__dp_admit(dopt_dp *dp, dopt_comm *given, const dopt_buf *params, const dopt_buf *states,
                                  uint64_t t);
static dopt_status dopt__dp_join(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states);

/* ELASTIC: after s, a failure that lost a rank, the survivors go on (dopt__dp_survive), averaging
   again when they all lost the same one (at_end: this rank failed its round's average, else
   another collective). *adopted: the state of a completed average was taken instead. A rank
   lost during this is handled the same way; a shrink that fails (fewer than min_ranks) ends it
   with its status. given: the communicator the host holds (the others this call made are
   destroyed when they are shrunk). */
static dopt_status dopt__dp_go_on(dopt_dp *dp, dopt_status s, const dopt_buf *params, const dopt_buf *states,
                                  dopt_comm *given, int at_end, int *adopted) {
    *adopted = 0;
    while (dopt__dp_lost_peer(dp, s)) {
        dopt_comm *before = dp->comm;
        int again = 0;
        s = dopt__dp_survive(dp, given, params, states, at_end, &again);
        if (dp->comm == before) break; /* the shrink failed */
        if (s != DOPT_OK) continue;
        if (!again) {
            *adopted = 1;
            break;
        }
        s = dopt__dp_average_models(dp, params, states); /* over the survivors */
    }
    return s;
}

/* A round ends: average 1, the model average (after_step, sync), 2, the closing one (close: no
   joiners taken in after it), 0, none (the anchor is the model as it is). */
static dopt_status dopt__dp_end_round(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states, int average,
                                      uint64_t t, const char *how) {
    dopt_status s = DOPT_OK;
    int skipped;
    dopt_comm *given = dp->comm;
    const char *prev = dopt__dp_label(dp, "%s: the average after step %llu",
                                      *how ? "dopt_dp_sync" : "dopt_dp_after_step", (unsigned long long)t);
    if (average) {
        int adopted = 0;
        s = dopt__dp_average_models(dp, params, states);
        if (dopt__dp_lost_peer(dp, s)) s = dopt__dp_go_on(dp, s, params, states, given, 1, &adopted);
        if (adopted && s == DOPT_OK) { /* a survivor's completed average stands for the round */
            dopt_comm_set_api(dp->comm, prev);
            return DOPT_OK;
        }
    } else if (dp->anchor && dp->n)
        dopt_buf_pack(params, dp->anchor);
    /* SKIP: a non-finite average was replaced by the finite ranks' mean; the round ends as usual */
    skipped = s == DOPT_ERR_NONFINITE && dp->status == DOPT_OK;
    if (skipped) s = DOPT_OK;
    if (s == DOPT_OK && dp->batch && dp->batch->cfg.estimator == DOPT_BATCH_WITHIN)
        s = dopt__batch_decide(dp->batch, dp->comm);
    dopt_comm_set_api(dp->comm, prev);
    if (s == DOPT_ERR_NONFINITE) return s; /* FAIL: the detail is said */
    if (s != DOPT_OK) {
        dopt__dp_fail_detail(dp, "average after step %llu%s: %s (%s)", (unsigned long long)t, how, dopt_status_str(s),
                             dopt_comm_detail(dp->comm));
        return s;
    }
    dp->syncs++;
    dp->sync_step = dp->step;
    dp->round_steps = 0;
    dp->round_samples = 0.0;
    dp->anchor_set = 1;
    if (dp->elastic && average != 2 && (s = dopt__dp_admit(dp, given, params, states, t)) != DOPT_OK)
        return s; /* joiners come in here */
    return skipped ? DOPT_ERR_NONFINITE : DOPT_OK;
}

/* ELASTIC: a call that finds its communicator failed by a lost rank (the failure came in the
   pass that completed this rank's last average, or in a collective of the host's) goes on with
   the survivors from the last average any of them completed; this call's step is not counted
   (the host follows dp->step). Other failures, or without elastic: the status. */
static dopt_status dopt__dp_resume(dopt_dp *dp, dopt_status s, const dopt_buf *params, const dopt_buf *states,
                                   const char *api) {
    const char *prev;
    int adopted;
    if (!dopt__dp_lost_peer(dp, s) || dp->status != DOPT_OK || dp->work == NULL ||
        dopt__dp_check_layout(dp, params, states) != DOPT_OK)
        return s;
    prev = dopt__dp_label(dp, "%s: going on without the lost rank", api);
    s = dopt__dp_go_on(dp, s, params, states, dp->comm, 0, &adopted);
    dopt_comm_set_api(dp->comm, prev);
    if (s != DOPT_OK)
        dopt__dp_fail_detail(dp, "%s: going on without the lost rank: %s (%s)", api, dopt_status_str(s),
                             dopt_comm_detail(dp->comm));
    return s;
}

DOPT_DEF dopt_status dopt_dp_after_step_buf(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    uint64_t t;
    dopt_status s = DOPT_OK;
    if (dp == NULL) return DOPT_ERR_INVALID;
    if ((s = dopt__dp_no_open_step(dp, "dopt_dp_after_step")) != DOPT_OK) return s;
    if ((s = dopt__dp_poisoned(dp)) != DOPT_OK) return dopt__dp_resume(dp, s, params, states, "dopt_dp_after_step");
    s = dopt__dp_check_layout(dp, params, states);
    if (s != DOPT_OK) return s;
    if ((s = dopt__dp_check_anchor(dp, "dopt_dp_after_step")) != DOPT_OK) return s;
    if (dp->batch && dp->batch->cfg.estimator == DOPT_BATCH_WITHIN) {
        /* a synchronous step (gradients averaged, or models after one step each) moved every
           replica with the global batch */
        if (dopt_dp_is_synchronous(dp, dp->step)) dopt_batch_averaged(dp->batch, dp->comm->size);
        dopt_batch_end_step(dp->batch);
    }
    t = dp->step;
    dp->round_samples += dopt__dp_step_samples(dp);
    dp->round_steps++;
    dp->step++;
    if (!dopt_dp_should_sync(dp, t)) return DOPT_OK;
    /* after averaged gradients the models are identical already */
    return dopt__dp_end_round(dp, params, states, dp->grads_step != t + 1, t, "");
}

DOPT_DEF dopt_status dopt_dp_after_step(dopt_dp *dp, float *params) {
    dopt_buf b = dopt_buf_flat(params, dp ? dp->n : 0, NULL, 0);
    return dopt_dp_after_step_buf(dp, &b, NULL);
}

DOPT_DEF dopt_status dopt_dp_sync(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    dopt_status s;
    if (dp == NULL) return DOPT_ERR_INVALID;
    if ((s = dopt__dp_no_open_step(dp, "dopt_dp_sync")) != DOPT_OK) return s;
    if ((s = dopt__dp_poisoned(dp)) != DOPT_OK) return dopt__dp_resume(dp, s, params, states, "dopt_dp_sync");
    s = dopt__dp_check_layout(dp, params, states);
    if (s != DOPT_OK) return s;
    if (dp->round_steps == 0) return DOPT_OK; /* the replicas are identical already */
    if ((s = dopt__dp_check_anchor(dp, "dopt_dp_sync")) != DOPT_OK) return s;
    return dopt__dp_end_round(dp, params, states, 1, dp->step, " (sync)");
}

/* Broadcasts a buffer from rank 0 in the packed order, through the workspace, in pieces of the
   workspace's size: ranks that describe the same elements differently (flat here, a scatter list
   there) make the same sequence of broadcasts. */
static dopt_status dopt__dp_broadcast_packed(dopt_dp *dp, const dopt_buf *b) {
    size_t cap = dp->work_count ? dp->work_count : 1, total = dopt_buf_count(b), done = 0;
    size_t seg = 0, in_seg = 0; /* the read position: segment and element in it */
    while (done < total) {
        size_t chunk = total - done < cap ? total - done : cap, filled, s2 = seg, i2 = in_seg;
        dopt_status s;
        for (filled = 0; filled < chunk;) { /* gather */
            dopt_span sp = dopt_buf_segment(b, s2);
            size_t take = sp.count - i2 < chunk - filled ? sp.count - i2 : chunk - filled;
            if (take) memcpy(dp->work + filled, sp.ptr + i2, take * sizeof(float));
            filled += take;
            i2 += take;
            if (i2 == sp.count) {
                s2++;
                i2 = 0;
            }
        }
        s = dopt_broadcast(dp->comm, dp->work, chunk * sizeof(float), 0);
        if (s != DOPT_OK) return s;
        for (filled = 0; filled < chunk;) { /* and back, from the same position */
            dopt_span sp = dopt_buf_segment(b, seg);
            size_t take = sp.count - in_seg < chunk - filled ? sp.count - in_seg : chunk - filled;
            if (take) memcpy(sp.ptr + in_seg, dp->work + filled, take * sizeof(float));
            filled += take;
            in_seg += take;
            if (in_seg == sp.count) {
                seg++;
                in_seg = 0;
            }
        }
        done += chunk;
    }
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_dp_broadcast_buf(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    size_t i;
    dopt_status s;
    const char *prev;
    if (dp == NULL) return DOPT_ERR_INVALID;
    if ((s = dopt__dp_no_open_step(dp, "dopt_dp_broadcast")) != DOPT_OK) return s;
    if ((s = dopt__dp_poisoned(dp)) != DOPT_OK) return s;
    s = dopt__dp_check_layout(dp, params, states);
    if (s != DOPT_OK) return s;
    if (dp->joining) return dopt__dp_join(dp, params, states); /* ELASTIC: a joiner takes the job's state */
    prev = dopt__dp_label(dp, "dopt_dp_broadcast");
    s = dopt__dp_broadcast_packed(dp, params);
    for (i = 0; s == DOPT_OK && i < dp->nstates; i++) s = dopt__dp_broadcast_packed(dp, &states[i]);
    dopt_comm_set_api(dp->comm, prev);
    if (s != DOPT_OK) {
        dopt__dp_fail_detail(dp, "broadcast: %s (%s)", dopt_status_str(s), dopt_comm_detail(dp->comm));
        return s;
    }
    if (dp->anchor && dp->n) dopt_buf_pack(params, dp->anchor);
    dp->anchor_set = 1;
    dp->sync_step = dp->step;
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_dp_broadcast(dopt_dp *dp, float *params) {
    dopt_buf b = dopt_buf_flat(params, dp ? dp->n : 0, NULL, 0);
    return dopt_dp_broadcast_buf(dp, &b, NULL);
}

/* ===================================================================== CELGC COMPOSITION */

static int dopt__dp_celgc_args_ok(const dopt_celgc *r) { /* a zero scale means 1: finite */
    return dopt__is_finite(r->scale) && dopt__is_finite(r->eta) && r->eta > 0.0f && !dopt__is_nan(r->gamma) &&
           r->gamma > 0.0f && dopt__is_finite(r->weight_decay) && r->weight_decay >= 0.0f;
}

DOPT_DEF dopt_status dopt_dp_celgc_step(dopt_dp *dp, const dopt_buf *params, const dopt_buf *grads,
                                        const dopt_celgc *rule) {
    dopt_status s, step_status;
    if (dp == NULL) return DOPT_ERR_INVALID;
    if (!dp->sync_grads && (s = dopt__dp_no_open_step(dp, "dopt_dp_celgc_step")) != DOPT_OK) return s;
    if ((s = dopt__dp_poisoned(dp)) != DOPT_OK) return s;
    if (rule == NULL) {
        dopt__dp_fail_detail(dp, "celgc step: no rule (NULL)");
        return DOPT_ERR_INVALID;
    }
    s = dopt__dp_check_layout(dp, params, rule->states);
    if (s != DOPT_OK) return s;
    if (dopt__dp_check_buf(grads, dp->n) != DOPT_OK || dopt_buf_nsegs(grads) != dopt_buf_nsegs(params) ||
        !dopt__dp_celgc_args_ok(rule)) {
        dopt__dp_fail_detail(dp, "celgc step: gradients of another layout, or a bad scale, eta, gamma or decay");
        return DOPT_ERR_INVALID;
    }
    if (dp->batch && dp->batch->cfg.estimator == DOPT_BATCH_ACROSS) {
        dopt__dp_fail_detail(dp, "celgc step: the across-worker batch estimator reads model deltas as gradient sums, "
                                 "and clipped steps are not; use DOPT_BATCH_WITHIN");
        return DOPT_ERR_INVALID;
    }
    if ((s = dopt__dp_check_anchor(dp, "dopt_dp_celgc_step")) != DOPT_OK) return s; /* before the step moves x */
    if (dp->sync_grads) { /* else CELGC's own: each worker clips its gradient, the models are averaged */
        s = dopt__dp_average_grads(dp, grads, "dopt_dp_celgc_step");
        if (s == DOPT_ERR_NONFINITE && dp->status == DOPT_OK) { /* SKIP: no update, the step still counts */
            s = dopt_dp_after_step_buf(dp, params, rule->states);
            return s != DOPT_OK ? s : DOPT_ERR_NONFINITE;
        }
        if (s != DOPT_OK) return s;
    }
    step_status = dopt_celgc_step(params, grads, rule);
    if (step_status != DOPT_OK && step_status != DOPT_ERR_NONFINITE) {
        dopt__dp_fail_detail(dp, "celgc step: %s (segment sizes of parameters and gradients differ?)",
                             dopt_status_str(step_status));
        return step_status;
    }
    s = dopt_dp_after_step_buf(dp, params, rule->states);
    return s != DOPT_OK ? s : step_status;
}

/* ===================================================================== REPLICA CHECK */

/* max_i (max_r x_ri − min_r x_ri) = max_r max_i (M_i − x_ri), M the elementwise maximum: one
   elementwise MAX allreduce in the workspace and one scalar. */
static dopt_status dopt__dp_replica_spread(dopt_dp *dp, const dopt_buf *params, double *spread) {
    size_t i, j, k = dopt_buf_nsegs(params);
    const float *m = dp->work;
    dopt_status s;
    *spread = 0.0;
    dopt_buf_pack(params, dp->work);
    s = dopt_allreduce(dp->comm, dp->work, dp->n, DOPT_F32, DOPT_MAX);
    if (s != DOPT_OK) return s;
    for (i = 0; i < k; i++) {
        dopt_span sp = dopt_buf_segment(params, i);
        for (j = 0; j < sp.count; j++) {
            double d = (double)m[j] - (double)sp.ptr[j];
            if (d > *spread || dopt__is_nan(d)) *spread = dopt__is_nan(d) ? INFINITY : d;
        }
        m += sp.count;
    }
    return dopt_allreduce(dp->comm, spread, 1, DOPT_F64, DOPT_MAX);
}

/* Every rank's checksum and step in one allgather: ranks at different steps are no replicas. */
static dopt_status dopt__dp_check_replicas(dopt_dp *dp, const dopt_buf *params, int *identical,
                                           double *max_diff) {
    uint64_t mine[2], *all = dp->replica_words;
    size_t i, k = dopt_buf_nsegs(params);
    int r, same = 1;
    dopt_status s;
    mine[0] = DOPT__FNV_OFFSET;
    mine[1] = dopt__dp_steps_done(dp);
    for (i = 0; i < k; i++) {
        dopt_span sp = dopt_buf_segment(params, i);
        mine[0] = dopt__fnv1a(mine[0], sp.ptr, sp.count * sizeof(float));
    }
    s = dopt_allgather(dp->comm, mine, all, sizeof mine);
    if (s != DOPT_OK) return s;
    for (r = 1; r < dp->comm->size; r++)
        if (all[2 * r + 1] != all[1]) {
            dopt__dp_fail_detail(dp, "dopt_dp_check_replicas: ranks are at different steps: rank 0 at %llu, "
                                     "rank %d at %llu",
                                 (unsigned long long)all[1], r, (unsigned long long)all[2 * r + 1]);
            return DOPT_ERR_MISMATCH;
        }
    for (r = 1; r < dp->comm->size; r++) same &= all[2 * r] == all[0];
    if (same) {
        if (identical) *identical = 1;
        if (max_diff) *max_diff = 0.0;
        return DOPT_OK;
    }
    return max_diff ? dopt__dp_replica_spread(dp, params, max_diff) : DOPT_OK;
}

DOPT_DEF dopt_status dopt_dp_check_replicas(dopt_dp *dp, const dopt_buf *params, int *identical,
                                          double *max_diff) {
    const char *prev;
    dopt_status s;
    if (identical) *identical = 0;
    if (max_diff) *max_diff = NAN;
    if (dp == NULL) return DOPT_ERR_INVALID;
    if ((s = dopt__dp_no_open_step(dp, "dopt_dp_check_replicas")) != DOPT_OK) return s;
    if ((s = dopt__dp_poisoned(dp)) != DOPT_OK) return s;
    if (dopt__dp_check_buf(params, dp->n) != DOPT_OK) {
        dopt__dp_fail_detail(dp, "replica check: parameters are not a valid descriptor of %zu elements", dp->n);
        return DOPT_ERR_INVALID;
    }
    prev = dopt_comm_set_api(dp->comm, "dopt_dp_check_replicas");
    s = dopt__dp_check_replicas(dp, params, identical, max_diff);
    dopt_comm_set_api(dp->comm, prev);
    return s;
}

/* ===================================================================== CLOSING CALL */

/* The closing call's verdict in the communicator's detail (and its log), where
   dopt_comm_finish finds it, unless the communicator holds its own failure (the first is the one
   users need, and it was logged when it happened); the communicator is not poisoned. */
static void dopt__dp_note(dopt_dp *dp) {
    if (dp->comm == NULL || dp->comm->error != DOPT_OK) return;
    snprintf(dp->comm->detail, sizeof dp->comm->detail, "rank %d: %s", dp->comm->rank, dp->detail);
    if (!dp->logged) dopt_comm_log(dp->comm, DOPT_LOG_ERROR, "%s", dp->comm->detail);
}

/* The closing call's verdict when the replicas differ, in the driver's detail: which ranks hold
   other parameters than rank 0, and by how much at most (dopt_dp_close_buf passes it on to the
   communicator through dopt__dp_note). */
static dopt_status dopt__dp_close_mismatch(dopt_dp *dp, const dopt_buf *params) {
    char ranks[96] = "", when[48] = "";
    size_t used = 0;
    double spread = NAN;
    int r, listed = 0, differ = 0;
    const uint64_t *all = dp->replica_words;
    for (r = 1; r < dp->comm->size; r++) {
        if (all[2 * r] == all[0]) continue;
        differ++;
        if (listed < 8 && used < sizeof ranks) {
            int k = snprintf(ranks + used, sizeof ranks - used, "%s%d", listed ? ", " : "", r);
            used += k > 0 ? (size_t)k : 0;
            listed++;
        }
    }
    if (dopt__dp_replica_spread(dp, params, &spread) != DOPT_OK) return dopt__dp_poisoned(dp);
    /* a host of after_backward alone has its steps counted there (and its last one by the close) */
    if (dp->step > 0) snprintf(when, sizeof when, " after step %llu", (unsigned long long)dp->step);
    dopt__dp_fail_detail(dp, "dopt_dp_close: the replicas differ%s: %d rank%s (%s%s) hold%s other "
                             "parameters than rank 0, by at most %.9g",
                         when, differ, differ == 1 ? "" : "s", ranks,
                         differ > listed ? ", ..." : "", differ == 1 ? "s" : "", spread);
    return DOPT_ERR_MISMATCH;
}

DOPT_DEF dopt_status dopt_dp_close_buf(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    int same = 0;
    const char *prev;
    dopt_status s;
    if (dp == NULL) return DOPT_ERR_INVALID;
    if ((s = dopt__dp_no_open_step(dp, "dopt_dp_close")) != DOPT_OK) return s;
    if (dp->status != DOPT_OK) { /* init refused, or a non-finite average stopped it: its reason stands */
        dopt__dp_note(dp);
        dopt_dp_free(dp);
        return dp->status;
    }
    dp->detail[0] = 0; /* what follows is the verdict of this call */
    if (dp->work == NULL) { /* closed already */
        dopt__dp_fail_detail(dp, "dopt_dp_close: the driver is not open");
        return DOPT_ERR_INVALID;
    }
    s = dopt__dp_poisoned(dp);
    if (s == DOPT_OK) s = dopt__dp_check_layout(dp, params, states);
    dopt__dp_count_pending_step(dp);
    if (s == DOPT_OK && dp->round_steps > 0) /* 2: the closing average takes no joiners in */
        s = dopt__dp_end_round(dp, params, states, 2, dp->step, " (close)");
    if (s == DOPT_OK) {
        prev = dopt_comm_set_api(dp->comm, "dopt_dp_close");
        s = dopt__dp_check_replicas(dp, params, &same, NULL);
        if (s == DOPT_OK && !same) s = dopt__dp_close_mismatch(dp, params);
        dopt_comm_set_api(dp->comm, prev);
    }
    if (s != DOPT_OK && dp->detail[0] == 0) /* the communicator's own failure */
        dopt__dp_fail_detail(dp, "%s", dopt_comm_detail(dp->comm));
    if (s != DOPT_OK) dopt__dp_note(dp);
    dopt_dp_free(dp);
    return s;
}

DOPT_DEF dopt_status dopt_dp_close(dopt_dp *dp, float *params) {
    dopt_buf b = dopt_buf_flat(params, dp ? dp->n : 0, NULL, 0);
    return dopt_dp_close_buf(dp, &b, NULL);
}

/* ===================================================================== STATE FILE: ENCODING */

/* A byte writer over a buffer (or, with buf NULL, a counter for the size). */
typedef struct dopt__dp_writer {
    unsigned char *buf;
    size_t pos;
} dopt__dp_writer;

static void dopt__dp_put(dopt__dp_writer *w, const void *p, size_t bytes) {
    if (w->buf && bytes) memcpy(w->buf + w->pos, p, bytes);
    w->pos += bytes;
}
static void dopt__dp_put_u64(dopt__dp_writer *w, uint64_t v) { dopt__dp_put(w, &v, 8); }
static void dopt__dp_put_f64(dopt__dp_writer *w, double v) { dopt__dp_put(w, &v, 8); }

typedef struct dopt__dp_reader {
    const unsigned char *buf;
    size_t pos, len;
    int short_read;
} dopt__dp_reader;

static void dopt__dp_get(dopt__dp_reader *r, void *p, size_t bytes) {
    if (r->short_read || bytes > r->len - r->pos) {
        r->short_read = 1;
        memset(p, 0, bytes);
        return;
    }
    memcpy(p, r->buf + r->pos, bytes);
    r->pos += bytes;
}
static uint64_t dopt__dp_get_u64(dopt__dp_reader *r) {
    uint64_t v;
    dopt__dp_get(r, &v, 8);
    return v;
}
static double dopt__dp_get_f64(dopt__dp_reader *r) {
    double v;
    dopt__dp_get(r, &v, 8);
    return v;
}

/* The layout: everything a loaded file must agree with. */
static void dopt__dp_put_layout(dopt__dp_writer *w, const dopt_dp *dp) {
    size_t i;
    dopt__dp_put_u64(w, (uint64_t)dp->comm->size);
    dopt__dp_put_u64(w, (uint64_t)dp->comm->rank);
    dopt__dp_put_u64(w, dp->n);
    dopt__dp_put_u64(w, dp->period);
    dopt__dp_put_u64(w, dp->warmup);
    dopt__dp_put_u64(w, (uint64_t)dp->sync_grads | (uint64_t)dp->weighted << 1 | (uint64_t)(dp->anchor != NULL) << 2 |
                            (uint64_t)(dp->batch != NULL) << 3 | (uint64_t)(dp->compressor != NULL) << 4 |
                            (uint64_t)(dp->grad_compressor != NULL) << 5 | (uint64_t)dp->outer << 6);
    dopt__dp_put_u64(w, dp->host_bytes);
    dopt__dp_put_u64(w, dp->nstates);
    for (i = 0; i < dp->nstates; i++) {
        dopt__dp_put_u64(w, dp->states[i].count);
        dopt__dp_put_u64(w, (uint64_t)dp->states[i].policy);
    }
    if (dp->batch) {
        const dopt_batch_config *c = &dp->batch->cfg;
        dopt__dp_put_u64(w, (uint64_t)c->test);
        dopt__dp_put_u64(w, (uint64_t)c->estimator);
        dopt__dp_put_f64(w, c->eta);
        dopt__dp_put_f64(w, c->theta);
        dopt__dp_put_f64(w, c->nu);
        dopt__dp_put_u64(w, c->unit_samples);
        dopt__dp_put_u64(w, c->initial_units);
        dopt__dp_put_u64(w, c->max_units);
        dopt__dp_put_u64(w, c->multiple);
        dopt__dp_put_u64(w, (uint64_t)c->projection);
        dopt__dp_put_f64(w, c->history);
        dopt__dp_put_u64(w, dp->batch->n);
    }
    if (dp->outer) {
        dopt__dp_put_f64(w, dp->outer_lr);
        dopt__dp_put_f64(w, dp->outer_momentum);
    }
    if (dp->compressor) {
        dopt__dp_put_u64(w, (uint64_t)dp->compressor->cfg.codec);
        dopt__dp_put_u64(w, dopt_compress_state_bytes(dp->compressor));
    }
    if (dp->grad_compressor) {
        dopt__dp_put_u64(w, (uint64_t)dp->grad_compressor->cfg.codec);
        dopt__dp_put_u64(w, dopt_compress_state_bytes(dp->grad_compressor));
    }
}

static void dopt__dp_put_state(dopt__dp_writer *w, const dopt_dp *dp) {
    dopt__dp_put_u64(w, dopt__dp_steps_done(dp));
    dopt__dp_put_u64(w, dp->syncs);
    dopt__dp_put_u64(w, dp->round_steps);
    dopt__dp_put_f64(w, dp->round_samples);
    dopt__dp_put_f64(w, dp->step_samples);
    if (dp->anchor) {
        dopt__dp_put_u64(w, (uint64_t)dp->anchor_set);
        dopt__dp_put(w, dp->anchor, dp->n * sizeof(float));
    }
    if (dp->outer_v) dopt__dp_put(w, dp->outer_v, dp->n * sizeof(float));
    if (dp->batch) {
        const dopt_batch *b = dp->batch;
        dopt__dp_put_u64(w, b->units);
        dopt__dp_put_u64(w, b->observed);
        dopt__dp_put_u64(w, b->decisions);
        dopt__dp_put_u64(w, b->undecided);
        dopt__dp_put_u64(w, b->nonpositive);
        dopt__dp_put_u64(w, b->steps_dropped);
        dopt__dp_put_f64(w, b->dir_norm);
        dopt__dp_put_f64(w, b->sumsq);
        dopt__dp_put_f64(w, b->proj_sum);
        dopt__dp_put_f64(w, b->proj_sumsq);
        dopt__dp_put(w, &b->round, sizeof b->round);
        dopt__dp_put(w, &b->pooled, sizeof b->pooled);
        dopt__dp_put(w, &b->last, sizeof b->last);
        if (b->sum) dopt__dp_put(w, b->sum, b->n * sizeof(double));
        if (b->dir) dopt__dp_put(w, b->dir, b->n * sizeof(float));
    }
    if (dp->host_bytes) dopt__dp_put(w, dp->host, dp->host_bytes);
    /* last, the compressors' states (gradient compressor, then delta compressor): load hands
       these bytes to the compressors before anything else */
    if (dp->grad_compressor) {
        size_t bytes = dopt_compress_state_bytes(dp->grad_compressor);
        if (w->buf) dopt_compress_state_save(dp->grad_compressor, w->buf + w->pos, bytes);
        w->pos += bytes;
    }
    if (dp->compressor) {
        size_t bytes = dopt_compress_state_bytes(dp->compressor);
        if (w->buf) dopt_compress_state_save(dp->compressor, w->buf + w->pos, bytes);
        w->pos += bytes;
    }
}

#define DOPT__LS_MAGIC "DOPTLSGD"

/* Header, layout, state, checksum; returns the size (buf NULL: only counts). */
static size_t dopt__dp_encode(const dopt_dp *dp, unsigned char *buf) {
    dopt__dp_writer w;
    uint64_t layout_bytes, h;
    dopt__dp_writer count = {NULL, 0};
    w.buf = buf;
    w.pos = 0;
    dopt__dp_put_layout(&count, dp);
    layout_bytes = count.pos;
    dopt__dp_put(&w, DOPT__LS_MAGIC, 8);
    dopt__dp_put_u64(&w, DOPT_DP_FILE_VERSION);
    dopt__dp_put_u64(&w, layout_bytes);
    dopt__dp_put_layout(&w, dp);
    dopt__dp_put_state(&w, dp);
    h = buf ? dopt__fnv1a(DOPT__FNV_OFFSET, buf, w.pos) : 0;
    dopt__dp_put_u64(&w, h);
    return w.pos;
}

/* ===================================================================== STATE FILE: ATOMIC WRITE */

static dopt_status dopt__dp_write_all(int fd, const unsigned char *p, size_t len) {
    while (len > 0) {
        ssize_t k = write(fd, p, len);
        if (k < 0) {
            if (errno == EINTR) continue;
            return DOPT_ERR_IO;
        }
        p += k;
        len -= (size_t)k;
    }
    return DOPT_OK;
}

/* fsync of the directory holding path, so that the rename itself is durable. */
static dopt_status dopt__dp_sync_dir(const char *path, char *scratch, size_t cap) {
    const char *slash = strrchr(path, '/');
    int fd;
    if (slash == NULL) {
        scratch[0] = '.';
        scratch[1] = 0;
    } else if (slash == path) {
        scratch[0] = '/';
        scratch[1] = 0;
    } else {
        size_t len = (size_t)(slash - path);
        if (len >= cap) return DOPT_ERR_IO;
        memcpy(scratch, path, len);
        scratch[len] = 0;
    }
    fd = open(scratch, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return DOPT_ERR_IO;
    if (fsync(fd) != 0 && errno != EINVAL) {
        close(fd);
        return DOPT_ERR_IO;
    }
    close(fd);
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_dp_host_state(dopt_dp *dp, void *bytes, size_t size) {
    dopt_status s;
    if (dp == NULL) return DOPT_ERR_INVALID;
    if ((s = dopt__dp_no_open_step(dp, "dopt_dp_host_state")) != DOPT_OK) return s;
    if (size > 0 && bytes == NULL) {
        dopt__dp_fail_detail(dp, "dopt_dp_host_state: %zu bytes at NULL", size);
        return DOPT_ERR_INVALID;
    }
    dp->host = size ? bytes : NULL;
    dp->host_bytes = size;
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_dp_save(dopt_dp *dp, const char *path) {
    size_t size, plen;
    unsigned char *buf;
    char *tmp;
    int fd;
    dopt_status s;
    if (dp == NULL || path == NULL) return DOPT_ERR_INVALID;
    if ((s = dopt__dp_no_open_step(dp, "dopt_dp_save")) != DOPT_OK) return s;
    if (dp->batch && dp->batch->micro && dp->batch->observed > 0) {
        dopt__dp_fail_detail(dp, "save: mid-step (%llu micro-batches observed): the exact projection keeps them in "
                                 "memory only; save between steps",
                             (unsigned long long)dp->batch->observed);
        return DOPT_ERR_INVALID;
    }
    size = dopt__dp_encode(dp, NULL);
    plen = strlen(path);
    buf = (unsigned char *)DOPT_MALLOC(size);
    tmp = (char *)DOPT_MALLOC(plen + 32);
    if (buf == NULL || tmp == NULL) {
        if (buf) DOPT_FREE(buf);
        if (tmp) DOPT_FREE(tmp);
        dopt__dp_fail_detail(dp, "save: out of memory for %zu bytes", size);
        return DOPT_ERR_NOMEM;
    }
    dopt__dp_encode(dp, buf);
    snprintf(tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        dopt__dp_fail_detail(dp, "save: cannot create %s: %s", tmp, strerror(errno));
        s = DOPT_ERR_IO;
    } else {
        s = dopt__dp_write_all(fd, buf, size);
        if (s == DOPT_OK && fsync(fd) != 0) s = DOPT_ERR_IO;
        if (close(fd) != 0) s = DOPT_ERR_IO;
        if (s == DOPT_OK && rename(tmp, path) != 0) s = DOPT_ERR_IO;
        if (s != DOPT_OK) {
            dopt__dp_fail_detail(dp, "save: writing %s failed: %s", path, strerror(errno));
            unlink(tmp);
        } else {
            s = dopt__dp_sync_dir(path, tmp, plen + 32);
            if (s != DOPT_OK) dopt__dp_fail_detail(dp, "save: cannot fsync the directory of %s", path);
        }
    }
    DOPT_FREE(buf);
    DOPT_FREE(tmp);
    return s;
}

/* ===================================================================== STATE FILE: LOAD */

static dopt_status dopt__dp_read_file(dopt_dp *dp, const char *path, unsigned char **out, size_t *len) {
    struct stat sb;
    int fd = open(path, O_RDONLY);
    size_t got = 0;
    unsigned char *buf;
    if (fd < 0) {
        dopt__dp_fail_detail(dp, "load: cannot open %s: %s", path, strerror(errno));
        return DOPT_ERR_IO;
    }
    if (fstat(fd, &sb) != 0 || sb.st_size < 0) {
        close(fd);
        dopt__dp_fail_detail(dp, "load: cannot stat %s", path);
        return DOPT_ERR_IO;
    }
    buf = (unsigned char *)DOPT_MALLOC((size_t)sb.st_size + 1);
    if (buf == NULL) {
        close(fd);
        return DOPT_ERR_NOMEM;
    }
    while (got < (size_t)sb.st_size) {
        ssize_t k = read(fd, buf + got, (size_t)sb.st_size - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        got += (size_t)k;
    }
    close(fd);
    *out = buf;
    *len = got;
    return DOPT_OK;
}

/* Compares the file's layout with this driver's, naming the first difference. */
static dopt_status dopt__dp_check_file_layout(dopt_dp *dp, const unsigned char *file_layout, size_t bytes,
                                              unsigned char *mine, const char *what) {
    static const char *const names[] = {"world size", "rank", "element count", "period", "warm-up steps",
                                        "flags (sync_grads, weighted, anchor, batch controller, compressor, gradient compressor, outer optimizer)",
                                        "host state bytes (dopt_dp_host_state)", "number of states"};
    dopt__dp_writer w;
    size_t i;
    w.buf = mine;
    w.pos = 0;
    dopt__dp_put_layout(&w, dp);
    if (w.pos == bytes && memcmp(mine, file_layout, bytes) == 0) return DOPT_OK;
    for (i = 0; i < 8 && (i + 1) * 8 <= bytes && (i + 1) * 8 <= w.pos; i++) {
        uint64_t a, b;
        memcpy(&a, file_layout + i * 8, 8);
        memcpy(&b, mine + i * 8, 8);
        if (a != b) {
            dopt__dp_fail_detail(dp, "%s with %s %llu, this driver has %llu", what, names[i],
                                 (unsigned long long)a, (unsigned long long)b);
            return DOPT_ERR_INVALID;
        }
    }
    dopt__dp_fail_detail(dp, "%s with other state buffers (sizes, policies) or another batch configuration", what);
    return DOPT_ERR_INVALID;
}

/* The state file's header in buf[0, len): magic, format version, layout size. DOPT_OK with
   *layout_bytes, or why not in dp->detail, naming what (a file, the job's state in transit):
   DOPT_ERR_PROTOCOL, or other_version when only the version differs. */
static dopt_status dopt__dp_check_header(dopt_dp *dp, const unsigned char *buf, size_t len, const char *what,
                                         dopt_status other_version, uint64_t *layout_bytes) {
    uint64_t version;
    if (len < 32 || memcmp(buf, DOPT__LS_MAGIC, 8) != 0) {
        dopt__dp_fail_detail(dp, "%s is not a distopt local-SGD state (%zu bytes, no DOPTLSGD header)", what, len);
        return DOPT_ERR_PROTOCOL;
    }
    memcpy(&version, buf + 8, 8);
    memcpy(layout_bytes, buf + 16, 8);
    if (version != DOPT_DP_FILE_VERSION) {
        dopt__dp_fail_detail(dp, "%s has format version %llu, this build reads version %u", what,
                             (unsigned long long)version, DOPT_DP_FILE_VERSION);
        return other_version;
    }
    if (*layout_bytes > len - 32 || *layout_bytes < 16) {
        dopt__dp_fail_detail(dp, "%s is truncated (%zu bytes)", what, len);
        return DOPT_ERR_PROTOCOL;
    }
    return DOPT_OK;
}

static void dopt__dp_get_state(dopt__dp_reader *r, dopt_dp *dp) {
    dp->step = dopt__dp_get_u64(r);
    dp->syncs = dopt__dp_get_u64(r);
    dp->round_steps = dopt__dp_get_u64(r);
    dp->round_samples = dopt__dp_get_f64(r);
    dp->step_samples = dopt__dp_get_f64(r);
    if (dp->anchor) {
        dp->anchor_set = dopt__dp_get_u64(r) != 0;
        dp->sync_step = dp->step;
        dopt__dp_get(r, dp->anchor, dp->n * sizeof(float));
    }
    if (dp->outer_v) dopt__dp_get(r, dp->outer_v, dp->n * sizeof(float));
    if (dp->batch) {
        dopt_batch *b = dp->batch;
        b->units = (size_t)dopt__dp_get_u64(r);
        b->observed = dopt__dp_get_u64(r);
        b->decisions = dopt__dp_get_u64(r);
        b->undecided = dopt__dp_get_u64(r);
        b->nonpositive = dopt__dp_get_u64(r);
        b->steps_dropped = dopt__dp_get_u64(r);
        b->dir_norm = dopt__dp_get_f64(r);
        b->sumsq = dopt__dp_get_f64(r);
        b->proj_sum = dopt__dp_get_f64(r);
        b->proj_sumsq = dopt__dp_get_f64(r);
        dopt__dp_get(r, &b->round, sizeof b->round);
        dopt__dp_get(r, &b->pooled, sizeof b->pooled);
        dopt__dp_get(r, &b->last, sizeof b->last);
        if (b->sum) dopt__dp_get(r, b->sum, b->n * sizeof(double));
        if (b->dir) dopt__dp_get(r, b->dir, b->n * sizeof(float));
    }
    if (dp->host_bytes) dopt__dp_get(r, dp->host, dp->host_bytes);
}

DOPT_DEF dopt_status dopt_dp_load(dopt_dp *dp, const char *path) {
    unsigned char *buf = NULL, *mine = NULL;
    size_t len = 0, expect;
    uint64_t layout_bytes, h_file, h;
    dopt__dp_reader r;
    dopt_status s;
    if (dp == NULL || path == NULL) return DOPT_ERR_INVALID;
    if ((s = dopt__dp_no_open_step(dp, "dopt_dp_load")) != DOPT_OK) return s;
    dp->detail[0] = 0;
    s = dopt__dp_read_file(dp, path, &buf, &len);
    if (s != DOPT_OK) return s;
    {
        char what[320];
        snprintf(what, sizeof what, "load: %s", path);
        s = dopt__dp_check_header(dp, buf, len, what, DOPT_ERR_PROTOCOL, &layout_bytes);
        if (s != DOPT_OK) goto done;
    }
    s = DOPT_ERR_PROTOCOL;
    memcpy(&h_file, buf + len - 8, 8);
    h = dopt__fnv1a(DOPT__FNV_OFFSET, buf, len - 8);
    if (h != h_file) {
        dopt__dp_fail_detail(dp, "load: %s is corrupt (checksum %016llx, expected %016llx)", path,
                             (unsigned long long)h, (unsigned long long)h_file);
        goto done;
    }
    mine = (unsigned char *)DOPT_MALLOC(dopt__dp_encode(dp, NULL));
    if (mine == NULL) {
        s = DOPT_ERR_NOMEM;
        goto done;
    }
    s = dopt__dp_check_file_layout(dp, buf + 24, (size_t)layout_bytes, mine, "load: the file was saved");
    if (s != DOPT_OK) goto done;
    expect = dopt__dp_encode(dp, NULL);
    if (expect != len) {
        dopt__dp_fail_detail(dp, "load: %s holds %zu bytes, its layout needs %zu", path, len, expect);
        s = DOPT_ERR_PROTOCOL;
        goto done;
    }
    {
        /* Validated by the compressors, which change nothing on failure; when the delta
           compressor refuses after the gradient compressor took its bytes, the gradient
           compressor gets its previous state back, so a refused file changes nothing. */
        size_t cbytes = dp->compressor ? dopt_compress_state_bytes(dp->compressor) : 0;
        size_t gbytes = dp->grad_compressor ? dopt_compress_state_bytes(dp->grad_compressor) : 0;
        const unsigned char *cstate = buf + len - 8 - cbytes, *gstate = cstate - gbytes;
        if (dp->grad_compressor) {
            dopt_compress_state_save(dp->grad_compressor, mine, gbytes); /* mine holds ≥ gbytes */
            if (dopt_compress_state_load(dp->grad_compressor, gstate, gbytes) != DOPT_OK) {
                dopt__dp_fail_detail(dp, "load: %s: the gradient compressor refuses its saved state", path);
                s = DOPT_ERR_PROTOCOL;
                goto done;
            }
        }
        if (dp->compressor && dopt_compress_state_load(dp->compressor, cstate, cbytes) != DOPT_OK) {
            if (dp->grad_compressor) dopt_compress_state_load(dp->grad_compressor, mine, gbytes);
            dopt__dp_fail_detail(dp, "load: %s: the compressor refuses its saved state", path);
            s = DOPT_ERR_PROTOCOL;
            goto done;
        }
    }
    r.buf = buf;
    r.pos = 24 + (size_t)layout_bytes;
    r.len = len - 8;
    r.short_read = 0;
    dopt__dp_get_state(&r, dp);
    s = DOPT_OK;
done:
    if (buf) DOPT_FREE(buf);
    if (mine) DOPT_FREE(mine);
    return s;
}

/* ===================================================================== ELASTIC: TAKING A WORKER BACK */

/* The hash of a state in transit: four lanes of 64-bit words (FNV-1a's step, then a rotation),
   the tail bytewise, fast enough to count little next to the transfer. */
static uint64_t dopt__dp_lanes_hash(uint64_t h, const unsigned char *p, size_t bytes) {
    uint64_t l[4];
    size_t i, k, body = bytes / 32 * 32;
    l[0] = h;
    l[1] = h ^ 0x9E3779B97F4A7C15ull;
    l[2] = h ^ 0xBF58476D1CE4E5B9ull;
    l[3] = h ^ 0x94D049BB133111EBull;
    for (i = 0; i < body; i += 32)
        for (k = 0; k < 4; k++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * k, 8);
            l[k] = (l[k] ^ w) * DOPT__FNV_PRIME;
            l[k] = l[k] << 31 | l[k] >> 33;
        }
    for (k = 0; k < 4; k++) h = dopt__fnv1a(h, &l[k], 8);
    return dopt__fnv1a(h, p + body, bytes - body);
}

/* Where the host's bytes (dopt_dp_host_state) sit in the state file's form of file bytes: before
   the compressors' states and the checksum. */
static size_t dopt__dp_host_offset(const dopt_dp *dp, size_t file) {
    size_t c = dp->compressor ? dopt_compress_state_bytes(dp->compressor) : 0;
    size_t g = dp->grad_compressor ? dopt_compress_state_bytes(dp->grad_compressor) : 0;
    return file - 8 - c - g - dp->host_bytes;
}

/* The hash of the host's bytes the sender sends: the members agree on it with the state's. */
static uint64_t dopt__dp_host_hash(const dopt_dp *dp) {
    return dopt__fnv1a(DOPT__FNV_OFFSET, dp->host_bytes ? dp->host : "", dp->host_bytes);
}

/* The state a joiner takes, in the state file's form (dopt_dp_save's bytes: magic, version,
   layout, state) with this rank's rank and per-step samples zeroed and, in place of the file's
   checksum, the hash of all of it and of the AVERAGE states that follow it: file bytes, then
   (work_count - n) floats. *hash: that hash, taken with the host's bytes zeroed (they are each
   rank's own); the bytes then hold this rank's, which the sender's payload carries (their hash:
   dopt__dp_host_hash). At a round's end the model is the anchor the file holds, so it is not
   sent twice. */
static size_t dopt__dp_state_payload(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states,
                                     unsigned char *buf, uint64_t *hash) {
    size_t file = dopt__dp_encode(dp, NULL), avg = (dp->work_count - dp->n) * sizeof(float);
    size_t host = dopt__dp_host_offset(dp, file);
    uint64_t layout_bytes;
    if (buf == NULL) return file + avg;
    dopt__dp_encode(dp, buf);
    memcpy(&layout_bytes, buf + 16, 8);
    memset(buf + 32, 0, 8);                              /* the layout's rank */
    memset(buf + 24 + (size_t)layout_bytes + 32, 0, 8); /* the state's step_samples */
    memset(buf + host, 0, dp->host_bytes);              /* the host's bytes: its own on each rank */
    dopt__dp_pack(dp, params, states);
    if (avg) memcpy(buf + file, dp->work + dp->n, avg);
    *hash = dopt__dp_lanes_hash(DOPT__FNV_OFFSET, buf, file - 8);
    *hash = dopt__dp_lanes_hash(*hash, buf + file, avg);
    memcpy(buf + file - 8, hash, 8);
    if (dp->host_bytes) memcpy(buf + host, dp->host, dp->host_bytes); /* the sender's go to the joiners */
    return file + avg;
}

/* A joiner takes the payload (bytes of it; agreed, agreed_host: the hashes the members agreed
   on, of the state and of the sender's host bytes): checked by magic, version, layout (world
   size and rank aside), size and hashes, then taken. DOPT_OK, or why not in dp->detail, nothing
   taken. */
static dopt_status dopt__dp_take(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states, unsigned char *buf,
                                 size_t bytes, uint64_t agreed, uint64_t agreed_host) {
    size_t expect = dopt__dp_state_payload(dp, params, states, NULL, NULL), file = dopt__dp_encode(dp, NULL);
    size_t avg = (dp->work_count - dp->n) * sizeof(float);
    size_t host;
    uint64_t layout_bytes, h, h_host, id[2];
    double own_samples = dp->step_samples;
    unsigned char *mine, *saved = NULL;
    dopt__dp_reader r;
    dopt_status s;
    s = dopt__dp_check_header(dp, buf, bytes, "elastic: the job's state", DOPT_ERR_INVALID, &layout_bytes);
    if (s != DOPT_OK) return s; /* another version: a joiner configured otherwise */
    if ((mine = (unsigned char *)DOPT_MALLOC(file)) == NULL) return DOPT_ERR_NOMEM;
    id[0] = (uint64_t)dp->comm->size;
    id[1] = (uint64_t)dp->comm->rank;
    memcpy(buf + 24, id, 16); /* the lead's world size is this one's too; its rank is not a difference */
    s = dopt__dp_check_file_layout(dp, buf + 24, (size_t)layout_bytes, mine, "elastic: the job runs");
    DOPT_FREE(mine);
    if (s != DOPT_OK) return s;
    if (bytes != expect) {
        dopt__dp_fail_detail(dp, "elastic: the job's state holds %zu bytes, this driver's layout needs %zu", bytes,
                             expect);
        return DOPT_ERR_PROTOCOL;
    }
    memset(buf + 32, 0, 8); /* hashed as the members hashed it */
    host = dopt__dp_host_offset(dp, file);
    h_host = dopt__fnv1a(DOPT__FNV_OFFSET, buf + host, dp->host_bytes);
    if (dp->host_bytes && (saved = (unsigned char *)DOPT_MALLOC(dp->host_bytes)) == NULL) return DOPT_ERR_NOMEM;
    if (saved) {
        memcpy(saved, buf + host, dp->host_bytes);
        memset(buf + host, 0, dp->host_bytes);
    }
    h = dopt__dp_lanes_hash(DOPT__FNV_OFFSET, buf, file - 8);
    h = dopt__dp_lanes_hash(h, buf + file, avg);
    if (saved) {
        memcpy(buf + host, saved, dp->host_bytes);
        DOPT_FREE(saved);
    }
    if (h != agreed || h_host != agreed_host) {
        dopt__dp_fail_detail(dp, "elastic: the job's state arrived corrupt (%s hash %016llx, the members agreed on %016llx)",
                             h != agreed ? "state" : "host bytes'", (unsigned long long)(h != agreed ? h : h_host),
                             (unsigned long long)(h != agreed ? agreed : agreed_host));
        return DOPT_ERR_PROTOCOL;
    }
    r.buf = buf;
    r.pos = 24 + (size_t)layout_bytes;
    r.len = file - 8;
    r.short_read = 0;
    dopt__dp_get_state(&r, dp); /* step, syncs, round counters, anchor, outer momentum */
    dp->step_samples = own_samples;
    dp->skipped = 0;
    if (dp->n) memcpy(dp->work, dp->anchor, dp->n * sizeof(float)); /* the model of the last average */
    if (avg) memcpy(dp->work + dp->n, buf + file, avg);
    dopt__dp_unpack(dp, params, states);
    dp->joining = 0;
    return DOPT_OK;
}

/* On every rank of a grown communicator (dp->comm): the members' rank 0 sends the job's state to
   the joiners, in a group of them alone. Every member first makes the payload
   (dopt__dp_state_payload) and they agree on its size and hash (one allreduce, the joiners in
   it too): members that disagree have replicas that differ, and nobody is given a state
   (DOPT_ERR_MISMATCH everywhere). A joiner configured otherwise refuses the state after it
   took part in the broadcast (DOPT_ERR_INVALID, naming the first difference), so that the
   others are not held; its host then leaves and the members' next collective loses it. The
   members other than the lead do not wait for the transfer. A lead or joiner lost during it
   fails the group, and with it dp->comm (a group's failure is its communicator's), which the
   group's survivors shrink at once and the other members at their next average. */
static dopt_status dopt__dp_share(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    dopt_comm *c = dp->comm, *g = NULL;
    unsigned char *buf = NULL;
    uint64_t hash = 0, agreed, host_hash = dopt__dp_host_hash(dp), agreed_host;
    int64_t v[8];
    size_t bytes = 0;
    double t0;
    int32_t ok = 1;
    int lead = c->rank == 0;
    dopt_status s = DOPT_OK, taken = DOPT_OK;
    if (!dp->joining) {
        bytes = dopt__dp_state_payload(dp, params, states, NULL, NULL);
        if ((buf = (unsigned char *)DOPT_MALLOC(bytes)) == NULL) s = DOPT_ERR_NOMEM;
        else dopt__dp_state_payload(dp, params, states, buf, &hash);
    }
    v[0] = dp->joining ? -1 : (int64_t)(hash >> 32);
    v[1] = dp->joining ? -1 : (int64_t)(hash & 0xFFFFFFFFu);
    v[2] = dp->joining ? -((int64_t)1 << 33) : -(int64_t)(hash >> 32);
    v[3] = dp->joining ? -((int64_t)1 << 33) : -(int64_t)(hash & 0xFFFFFFFFu);
    v[4] = dp->joining || s != DOPT_OK ? -1 : (int64_t)bytes;
    v[5] = dp->joining ? -((int64_t)1 << 62) : s != DOPT_OK ? 1 : -(int64_t)bytes; /* out of memory: disagrees */
    v[6] = lead ? (int64_t)(host_hash >> 32) : -1; /* the sender's host bytes */
    v[7] = lead ? (int64_t)(host_hash & 0xFFFFFFFFu) : -1;
    if ((s = dopt_allreduce(c, v, 8, DOPT_I64, DOPT_MAX)) != DOPT_OK) goto done;
    if (v[0] != -v[2] || v[1] != -v[3] || v[4] != -v[5] || v[4] < 0) {
        dopt__dp_fail_detail(dp, "elastic: the members' states differ (hashes %08llx%08llx to %08llx%08llx, %lld to "
                                 "%lld bytes, or a member is out of memory): their replicas are not identical; the "
                                 "joiners were not given a state",
                             (unsigned long long)-v[2], (unsigned long long)-v[3], (unsigned long long)v[0],
                             (unsigned long long)v[1], (long long)-v[5], (long long)v[4]);
        dopt_comm_log(c, DOPT_LOG_ERROR, "%s", dp->detail);
        s = dp->status = DOPT_ERR_MISMATCH;
        goto done;
    }
    agreed = (uint64_t)v[0] << 32 | (uint64_t)v[1];
    agreed_host = (uint64_t)v[6] << 32 | (uint64_t)v[7];
    bytes = (size_t)v[4];
    if ((s = dopt_comm_split(c, lead || dp->joining ? 0 : DOPT_UNDEFINED, c->rank, &g)) != DOPT_OK) goto done;
    if (g == NULL) goto done; /* a member other than the lead: nothing to send or take */
    if (dp->joining && (buf = (unsigned char *)DOPT_MALLOC(bytes ? bytes : 1)) == NULL) {
        s = DOPT_ERR_NOMEM; /* the others are held until this rank's end is seen */
        goto done;
    }
    /* A lead or joiner lost from here fails the group and so dp->comm, which every rank then
       shrinks: the others at their next average, as after any lost rank. */
    t0 = dopt__now_ms();
    if ((s = dopt_broadcast(g, buf, bytes, 0)) != DOPT_OK) goto done;
    dp->state_bytes = bytes;
    dp->state_ms = dopt__now_ms() - t0;
    if (dp->joining) {
        taken = dopt__dp_take(dp, params, states, buf, bytes, agreed, agreed_host);
        ok = taken == DOPT_OK;
    }
    if ((s = dopt_allreduce(g, &ok, 1, DOPT_I32, DOPT_MIN)) != DOPT_OK) goto done;
    if (lead) {
        dopt_comm_log(c, DOPT_LOG_INFO, "elastic: sent the job's state (%.3g MB) to %d joiner(s) in %.3g ms (%.0f MB/s)%s",
                      bytes / 1e6, g->size - 1, dp->state_ms, dp->state_ms > 0 ? bytes / 1e3 / dp->state_ms : 0.0,
                      ok ? "" : "; a joiner refused it (its log says why): it leaves");
    } else if (!dp->joining) { /* took it */
        dopt_comm_log(c, DOPT_LOG_INFO, "elastic: this joiner took the job's state (%.3g MB in %.3g ms) and goes on from "
                      "step %llu as rank %d of %d", bytes / 1e6, dp->state_ms, (unsigned long long)dp->step, c->rank,
                      c->size);
    } else {
        dopt_comm_log(c, DOPT_LOG_ERROR, "%s: this joiner leaves the job", dp->detail);
        s = dp->status = taken;
    }
done:
    if (g) dopt_comm_destroy(g);
    if (buf) DOPT_FREE(buf);
    return s;
}

/* After a new communicator replaced before: the one the driver made is its own to destroy (the
   host's is the host's), and the replica check's exchange follows the size. */
static dopt_status dopt__dp_take_comm(dopt_dp *dp, dopt_comm *before, dopt_comm *given, dopt_comm *next) {
    uint64_t *words = (uint64_t *)DOPT_MALLOC(2 * (size_t)next->size * sizeof(uint64_t));
    dp->comm = next;
    if (before != given) dopt_comm_destroy(before);
    dopt_comm_set_api(next, dp->api);
    if (words == NULL) return DOPT_ERR_NOMEM;
    DOPT_FREE(dp->replica_words);
    dp->replica_words = words;
    return DOPT_OK;
}

/* ELASTIC, at the end of a round (every member, right after the average, when it said a member
   holds a joiner): the joiners held anywhere come in (dopt_comm_grow) and take the job's state (dopt__dp_share); a rank lost
   meanwhile is left out the way survive does, the joiners taking the state from it then. */
static dopt_status dopt__dp_admit(dopt_dp *dp, dopt_comm *given, const dopt_buf *params, const dopt_buf *states,
                                  uint64_t t) {
    dopt_comm *before = dp->comm, *next = NULL;
    const char *prev = dopt__dp_label(dp, "dopt_dp_after_step: taking joiners in after step %llu", (unsigned long long)t);
    int adopted = 0, members = before->size;
    dopt_status s;
    if (!dp->joiners_waiting) { /* the average said nobody holds one: no grow */
        dopt_comm_set_api(before, prev);
        return DOPT_OK;
    }
    dp->joiners_waiting = 0;
    s = dopt_comm_grow(before, &next);
    if (s == DOPT_OK && next == NULL) {
        dopt_comm_set_api(before, prev);
        return DOPT_OK;
    }
    if (next) {
        dopt_status s2 = dopt__dp_take_comm(dp, before, given, next);
        dp->grows++;
        if (s == DOPT_OK) {
            dopt_comm_log(next, DOPT_LOG_WARN, "elastic: rank %d of %d takes in %d joiner(s) after step %llu; the job "
                          "goes on as %d ranks", next->rank, members, next->size - members, (unsigned long long)t,
                          next->size);
            s = s2 != DOPT_OK ? s2 : dopt__dp_share(dp, params, states);
        }
    }
    if (dopt__dp_lost_peer(dp, s)) s = dopt__dp_go_on(dp, s, params, states, given, 0, &adopted);
    dopt_comm_set_api(dp->comm, prev);
    if (s != DOPT_OK && !dp->detail[0])
        dopt__dp_fail_detail(dp, "taking joiners in after step %llu: %s (%s)", (unsigned long long)t,
                             dopt_status_str(s), dopt_comm_detail(dp->comm));
    return s;
}

/* ELASTIC, on a rank a grow took in, in place of dopt_dp_broadcast: the job's state from the
   members' rank 0; a rank lost meanwhile is left out the way survive does. */
static dopt_status dopt__dp_join(dopt_dp *dp, const dopt_buf *params, const dopt_buf *states) {
    dopt_comm *given = dp->comm;
    const char *prev = dopt__dp_label(dp, "dopt_dp_broadcast: taking the job's state");
    int adopted = 0;
    dopt_status s = dopt__dp_share(dp, params, states);
    if (dopt__dp_lost_peer(dp, s)) s = dopt__dp_go_on(dp, s, params, states, given, 0, &adopted);
    dopt_comm_set_api(dp->comm, prev);
    if (s != DOPT_OK && !dp->detail[0])
        dopt__dp_fail_detail(dp, "broadcast: taking the job's state: %s (%s)", dopt_status_str(s),
                             dopt_comm_detail(dp->comm));
    return s;
}

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_IMPLEMENTATION */
