/* clip.h — gradient clipping for data-parallel training: by the global norm (across ranks), per
   segment, by value, TernGrad's c·σ, CELGC's step rule, and adaptive clipping (AGC); NaN and
   infinity detected and, across ranks, agreed on.
   Part of distopt 0.1.0. MIT licence (see the end of distopt.h).

   DO THIS in exactly one C or C++ file of your program, before including the headers:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "clip.h"

   Other files include the two headers without the macro. DISTOPT_STATIC works as in distopt.h.

   QUICK START (after backward, before the host's own optimizer; grads hold n floats, +∇ of the
   mean loss, already averaged across workers — so no communicator is needed)

       dopt_buf g = {.data = grads, .n = n};
       dopt_clip_norm clip = {.max_norm = 1.0f};
       if (dopt_clip_global_norm(NULL, &g, &clip) == DOPT_ERR_NONFINITE) continue;
       sgd_update(params, grads);                   (skip the step on NaN/Inf, else clip to 1;
                                                     clip.norm is the norm before clipping)

   An optimizer that takes a factor (llm.c's CUDA trainer: gpt2_update's grad_scale) keeps the
   buffer as it is (llm.c's CPU trainer takes no factor: clip its buffer as above):

       dopt_clip_norm clip = {.max_norm = 1.0f, .measure_only = 1};
       dopt_clip_global_norm(NULL, &g, &clip);
       adamw_update(..., clip.factor);              (grads untouched)

   THE COMMUNICATOR (first argument of every clipping call; CELGC takes none)
     NULL means this process alone. With a communicator the call is a collective: every rank
     makes it, in the same order, with a buffer of the same number of segments. It costs one
     small allreduce (8 bytes, or 8 per segment for dopt_clip_segment_norms) and its verdict is
     agreed: either every rank returns DOPT_OK, or every rank returns the same error and no rank
     has touched its buffer — so either every rank skips the step or none does, and no rank is
     left waiting in the next collective. Norm-based calls (global, per segment) then measure the
     gradient across all ranks: the norm of the concatenation of every rank's buffer, the same
     bits on every rank. That is the right norm when each rank holds a different part of one
     gradient (a shard after a reduce-scatter, a model split across ranks). Gradients that are
     already averaged (identical on every rank) want NULL: each rank computes the same norm
     locally, with no communication. Elementwise rules (by value, c·σ, AGC) keep their local
     statistics — TernGrad's σ is each worker's own, AGC is meant for the averaged gradient — and
     use the communicator only to agree the verdict.

   BUFFERS, SIGN AND SCALE
     Gradients (and parameters) are dopt_buf descriptors (distopt.h): a flat array, optionally cut
     into segments, or a scatter list. A plain array of n floats is &(dopt_buf){.data = x, .n = n}
     (or dopt_buf_flat(x, n, NULL, 0)). Elements in gaps between segments belong to no segment:
     they are neither measured nor changed. A scale is the factor that turns the buffer into the
     convention of +∇ of the mean loss (llm.c, kann):
         scale·g = +∇ of the mean loss
     so scale = 1 for llm.c and kann, and scale = -1/batch for darknet and FANN (they hold -∇
     summed over the batch). Every threshold is in those units: the norms are of scale·g (a summed
     buffer with scale ±1/batch is clipped exactly as its mean would be), so are the values of
     dopt_clip_value and AGC's ratio. Norms ignore the sign; CELGC's step uses it. The buffer
     itself keeps its own convention: clipping multiplies it by a factor ≤ 1. The scale field of
     an argument struct (dopt_clip_norm, dopt_agc, dopt_celgc) may be left 0, which means 1;
     otherwise it must be finite. dopt_clip_value takes its scale as an argument, which must be
     finite and non-zero. With a communicator each rank may pass its own scale (unequal local
     batches): the norm is of the concatenation of every rank's scale·g.

   ARGUMENT STRUCTS
     The global and per-segment norms, AGC and CELGC take their settings in a small struct
     (dopt_clip_norm, dopt_agc, dopt_celgc), which a caller may write as a compound literal:
     &(dopt_celgc){.eta = 0.1f, .gamma = 1.0f}. A field left 0 means its default (the tables
     below); a field with no default (a threshold) must be set. The struct itself is required: a
     NULL one is DOPT_ERR_INVALID. A field a call does not use is ignored (one dopt_celgc, states
     and all, serves the driver's dopt_dp_celgc_step and dopt_celgc_step_size alike).

   THRESHOLDS AND ERRORS
     Thresholds (max_norm, max_value, c, lambda, gamma) must be positive; +∞ is allowed and means
     "never clip" (the norm is still measured). NaN, zero or negative is DOPT_ERR_INVALID, as are
     a NULL argument struct, a NULL buffer descriptor, one that dopt_buf_validate refuses, a
     non-finite scale, and anything else named in a function's paragraph. DOPT_ERR_NONFINITE: the
     gradient holds a NaN or an infinity (with a communicator: on some rank). On any error no
     buffer is changed, norms are set to NaN and factors and steps to 0 (where the call has
     somewhere to write them). With a communicator a transport error (DOPT_ERR_PEER_LOST,
     DOPT_ERR_TIMEOUT, ...) is returned as is. An invalid argument on one rank gives
     DOPT_ERR_INVALID on every rank; if that rank cannot even take part in the reduction (a NULL
     descriptor, or NULL norms for dopt_clip_segment_norms), the transport reports the mismatch
     (DOPT_ERR_MISMATCH) on every rank instead of leaving its peers waiting.

   ACCURACY
     Norms are accumulated in double: exact squares, no overflow for any finite float, a relative
     error about 1e-12 for 10^8 elements (test_clip asserts < 1e-11), and NaN/Inf show up in the
     sum itself, so detecting them costs no extra pass. Clip factors are computed in double and
     applied in float: a clipped buffer has norm max_norm to within float rounding (a few 1e-7
     relative). A factor below FLT_MIN (a norm above ~1e38·max_norm) would keep few bits as a
     float: the clipping calls then multiply in double instead; dopt_clip_norm's factor field
     holds that subnormal float.

   THREADING
     Without a communicator every call is pure: any thread may call it, on buffers no other thread
     is writing. A communicator is used by one thread at a time (distopt.h). No call allocates.

   FUNCTIONS

   dopt_status dopt_clip_global_norm(dopt_comm *comm, const dopt_buf *grads, dopt_clip_norm *opt)
     Global-norm clipping: ‖scale·g‖ over every segment (and every rank with a communicator), then
     g ← g · min(1, max_norm/‖scale·g‖). A zero gradient has norm 0 and is left alone. opt holds
     the arguments and receives the results:

     | field        | meaning                                                      | zero means  |
     |--------------|--------------------------------------------------------------|-------------|
     | max_norm     | the threshold                                                | (required)  |
     | scale        | grads holds scale·g                                          | 1           |
     | measure_only | 1: compute norm and factor, leave grads alone                | clip        |
     | max_norms    | dopt_clip_segment_norms only; ignored here                   |             |
     | norm (out)   | ‖scale·g‖ before clipping, over every rank; NaN on error     |             |
     | factor (out) | min(1, max_norm/norm): the factor applied (or, with          |             |
     |              | measure_only, the one to apply); 0 on error                  |             |

     With measure_only, multiplying the buffer by factor (dopt_scale) is exactly what the call
     does without it, bit for bit (but see ACCURACY for factors below FLT_MIN).

   dopt_status dopt_clip_segment_norms(dopt_comm *comm, const dopt_buf *grads,
                                       const dopt_clip_norm *opt, double *norms)
     Per-segment (per-layer) clipping: segment l is multiplied by min(1, τ_l/‖scale·g_l‖), with
     τ_l = opt->max_norms[l] (one threshold per segment), or opt->max_norm for every segment when
     max_norms is NULL (max_norm is then the one checked; with max_norms it is ignored).
     opt->scale as above (0: 1); opt->measure_only: compute the norms, leave grads alone. opt is
     only read: its norm and factor fields are not written. norms (required:
     dopt_buf_nsegs(grads) doubles) receives each segment's norm before clipping; with a
     communicator it is also the reduction buffer, so norm l is over every rank's segment l.

   dopt_status dopt_clip_value(dopt_comm *comm, const dopt_buf *grads, float scale,
                               float max_value)
     Clipping by value: each element of scale·g is clipped to [-max_value, max_value], i.e. each
     element of the buffer to ±max_value/|scale| (rounded to float). scale: finite, non-zero.

   dopt_status dopt_clip_sigma(dopt_comm *comm, const dopt_buf *grads, float c)
     TernGrad's clipping (Wen et al. 2017), per segment: σ = population standard deviation
     of the segment's elements, each element clipped to [-c·σ, c·σ]; the paper's c is
     DOPT_CLIP_SIGMA_DEFAULT (2.5). Scale-free (the rule is the same for scale·g), so no scale. A
     segment with σ = 0 (one element, or all equal) is left as it is: it has no spread to clip
     against, and the formula would zero it (a one-element bias would never learn).

   dopt_status dopt_clip_agc(dopt_comm *comm, const dopt_buf *grads, const dopt_buf *params,
                             const dopt_agc *opt)
     Adaptive gradient clipping (Brock et al. 2021, NFNets): each unit u of each segment is
     clipped so that ‖scale·g_u‖ / max(‖w_u‖, eps) ≤ lambda; a unit over the bound is rescaled to
     exactly lambda·max(‖w_u‖, eps). params has the same layout as grads (same segment count and
     sizes) and is only read; NaN/Inf in it are DOPT_ERR_NONFINITE too.

     | field  | meaning                                                   | zero means           |
     |--------|-----------------------------------------------------------|----------------------|
     | lambda | the bound on the ratio                                    | (required)           |
     | eps    | the smallest weight norm; > 0 and finite                  | DOPT_AGC_EPS_DEFAULT |
     |        |                                                           | (1e-3, the paper's)  |
     | scale  | grads holds scale·g                                       | 1                    |
     | cols   | one per segment: segment l is a matrix of rows of cols[l] | NULL: every segment  |
     |        | elements, each row one unit (cols[l] = 0: the segment is  | is one unit          |
     |        | one unit)                                                 |                      |

     A row is an output neuron's fan-in: llm.c's (OC, C) weights, darknet's filters, FANN's
     connections of one neuron are all contiguous rows. One unit for a whole segment is how the
     reference code treats biases and gains (a vector is one unit; per-element units would let a
     bias move by at most lambda·eps per step while it is near 0). DOPT_ERR_INVALID also when
     cols[l] does not divide segment l.

   dopt_status dopt_celgc_step_size(const dopt_buf *grads, const dopt_celgc *rule, float *step)
     CELGC's step size (Liu et al. 2022): *step = min(eta, gamma/(‖scale·g‖ + DOPT_CELGC_EPS)),
     from this worker's own gradient — the norm is local and nothing is communicated, which is the
     point of the method. Equivalent to clipping g to norm gamma/eta and stepping eta. step may be
     NULL (the call then only checks).

     | field        | meaning                                                      | zero means  |
     |--------------|--------------------------------------------------------------|-------------|
     | eta          | η, the largest step; finite                                  | (required)  |
     | gamma        | γ: the step is min(η, γ/‖g‖); +∞ is plain SGD at η           | (required)  |
     | weight_decay | added to the direction (dopt_celgc_step); finite             | none        |
     | scale        | grads holds scale·g                                          | 1           |
     | states       | localsgd.h's dopt_dp_celgc_step only; ignored here           |             |

     Every call checks the whole rule (weight_decay ≥ 0 included), so one rule serves them all.

   dopt_status dopt_celgc_step(const dopt_buf *params, const dopt_buf *grads,
                               const dopt_celgc *rule)
     Applies the step: x ← x − step·(scale·g + weight_decay·x), with step from the gradient's norm
     alone, as the reference code does (weight decay is added to the direction, not to the norm).
     params and grads have the same layout and must not overlap. On DOPT_ERR_NONFINITE the
     parameters are untouched: this worker skips the step (with local steps its peers need not
     agree; the next model average brings it along). With the local SGD driver, localsgd.h's
     dopt_dp_celgc_step takes the same rule.

   CONSTANTS
     DOPT_CLIP_SIGMA_DEFAULT  2.5f   TernGrad's c
     DOPT_AGC_EPS_DEFAULT     1e-3f  AGC's ε (what eps = 0 means)
     DOPT_CELGC_EPS           1e-10  added to the norm in CELGC's step (the reference code's)
*/
#ifndef DISTOPT_CLIP_H
#define DISTOPT_CLIP_H

#include "distopt.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_CLIP_SIGMA_DEFAULT 2.5f
#define DOPT_AGC_EPS_DEFAULT 1e-3f
#define DOPT_CELGC_EPS 1e-10

/* The arguments of dopt_clip_global_norm and dopt_clip_segment_norms; a zero field means its
   default. */
typedef struct dopt_clip_norm {
    float max_norm;         /* the threshold; segment_norms: every segment's unless max_norms */
    float scale;            /* grads holds scale·g (a sum over a batch, a negated gradient); 0 means 1 */
    const float *max_norms; /* segment_norms: one threshold per segment, or NULL */
    int measure_only;       /* compute the norm (and factor), leave the gradients alone */
    double norm;            /* out, global_norm: the global norm ‖scale·g‖ over every rank */
    float factor;           /* out, global_norm: min(1, max_norm/norm), applied unless measure_only */
} dopt_clip_norm;

/* The arguments of dopt_clip_agc. */
typedef struct dopt_agc {
    float lambda;       /* the bound on ‖scale·g_u‖ / max(‖w_u‖, eps) */
    float eps;          /* 0: DOPT_AGC_EPS_DEFAULT */
    float scale;        /* 0: 1 */
    const size_t *cols; /* one per segment: elements per unit (0: the whole segment); NULL: all 0 */
} dopt_agc;

/* CELGC's rule: dopt_celgc_step_size, dopt_celgc_step, and localsgd.h's dopt_dp_celgc_step. */
typedef struct dopt_celgc {
    float eta;              /* η, the largest step */
    float gamma;            /* γ: the step is min(η, γ/‖g‖) */
    float weight_decay;     /* 0: none */
    float scale;            /* grads holds scale·g; 0 means 1 */
    const dopt_buf *states; /* dopt_dp_celgc_step only: the driver's extra state buffers (as
                               dopt_dp_after_step_buf takes them), NULL when none */
} dopt_celgc;

DOPT_DEF dopt_status dopt_clip_global_norm(dopt_comm *comm, const dopt_buf *grads, dopt_clip_norm *opt);
DOPT_DEF dopt_status dopt_clip_segment_norms(dopt_comm *comm, const dopt_buf *grads, const dopt_clip_norm *opt,
                                             double *norms);
DOPT_DEF dopt_status dopt_clip_value(dopt_comm *comm, const dopt_buf *grads, float scale, float max_value);
DOPT_DEF dopt_status dopt_clip_sigma(dopt_comm *comm, const dopt_buf *grads, float c);
DOPT_DEF dopt_status dopt_clip_agc(dopt_comm *comm, const dopt_buf *grads, const dopt_buf *params,
                                   const dopt_agc *opt);

DOPT_DEF dopt_status dopt_celgc_step_size(const dopt_buf *grads, const dopt_celgc *rule, float *step);
DOPT_DEF dopt_status dopt_celgc_step(const dopt_buf *params, const dopt_buf *grads, const dopt_celgc *rule);

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_CLIP_H */

/* ==================== REFERENCE FOR CONTRIBUTORS ====================
   Not needed to use clip.h: how the rules are computed, where they come from, what was measured.

   One collective per call, carrying the verdict. Every rule that takes a communicator makes
   exactly one allreduce (SUM of doubles), whatever happens on this rank, so that a rank with bad
   arguments or a non-finite gradient fails together with its peers instead of leaving them
   waiting. Each rank's verdict travels inside the sums: a sum of squares of finite floats is at
   most n·FLT_MAX² ≈ 1.2e77·n, far from DBL_MAX even summed over every rank, so before the
   reduction a non-finite local sum is made +inf and invalid arguments make every sum NaN; after
   it, NaN anywhere (NaN absorbs +inf) is DOPT_ERR_INVALID on every rank, +inf anywhere is
   DOPT_ERR_NONFINITE on every rank, and otherwise the sums are the exact totals. The elementwise
   rules (value, c·σ, AGC) send one such flag with no numbers. Without a communicator the same
   decoding gives the local verdict. NaN and infinity are told by their bits
   (dopt__is_nan/dopt__is_finite, dopt_all_finite), so -ffast-math hosts keep the checks.

   Norms. ‖scale·g‖² = scale²·Σ x², the sum in double by distopt.h's dopt_sumsq (relative error
   about 1e-12 over 10^8 elements, no overflow for any finite float); scale² goes inside each
   rank's sum so that ranks whose buffers hold different scales add like terms. The norm pass is
   the non-finite check too (a separate check would halve its speed: docs/measurements.md,
   Clipping). A factor f = min(1, τ/‖g‖) below FLT_MIN would lose its bits as a float (elements
   near FLT_MAX clipped to a small norm), so such a factor is applied in double element by
   element; every other goes through dopt_scale.

   By value and TernGrad's c·σ (Wen et al. 2017): a clamp to ±bound, branch-free in blocks
   of 16 so that it compiles to vector min/max. σ is the segment's population standard deviation
   (dopt_mean_var, shifted sums in double); c = 2.5 is the paper's choice. A segment with σ = 0
   or a bound beyond FLT_MAX is left as it is.

   AGC (Brock, De, Smith, Simonyan 2021, "High-performance large-scale image recognition without
   normalization"): for each unit u (a row of a weight matrix, the fan-in of one output),
   g_u ← g_u · λ·max(‖w_u‖, ε)/‖g_u‖ when ‖g_u‖ > λ·max(‖w_u‖, ε); ε = 1e-3 as in the paper.
   Vectors (biases, gains) are one unit each, as the reference code treats them.

   CELGC (Liu, Zhuang, Lei, Liao 2022): step = min(η, γ/(‖g‖ + ε)) on the worker's
   own gradient, ε = 1e-10 as the reference code adds it; x ← x − step·(scale·g + wd·x), written
   as keep·x − a·g with keep = 1 − step·wd (exactly 1 without decay) and a = step·scale, the decay
   added to the direction and not to the norm, as the reference code does. */

/* =====================================================================================
   IMPLEMENTATION — stop reading here if you only want the API.
   ===================================================================================== */

#if defined(DISTOPT_IMPLEMENTATION) && !defined(DOPT__CLIP_IMPLEMENTED)
#define DOPT__CLIP_IMPLEMENTED

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ===================================================================== ARGUMENT CHECKS */

/* NaN and infinity are told by their bits (distopt.h's dopt__is_nan and dopt__is_finite), so that
   a host built with -ffast-math, where isnan() and isfinite() may be folded to constants, still
   sees them. A threshold: positive; +inf allowed (never clips). */
static int dopt__clip_limit_ok(float t) { return !dopt__is_nan(t) && t > 0.0f; }

static int dopt__clip_positive_finite(float t) { return dopt__is_finite(t) && t > 0.0f; }

static int dopt__clip_scale_ok(float s) { return dopt__is_finite(s) && s != 0.0f; }

/* A field left 0 (either sign), told by its bits: under -ffast-math a NaN may compare equal to 0,
   and would then take the default instead of being refused. */
static int dopt__clip_is_zero(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x7FFFFFFFu) == 0;
}

/* An argument struct's scale: 0 means 1. */
static float dopt__clip_scale_or_one(float s) { return dopt__clip_is_zero(s) ? 1.0f : s; }

static dopt_status dopt__clip_check_buf(const dopt_buf *b) {
    return b != NULL && dopt_buf_validate(b) == DOPT_OK ? DOPT_OK : DOPT_ERR_INVALID;
}

/* params and grads describe the same tensors: the same number of segments of the same sizes. */
static dopt_status dopt__clip_check_pair(const dopt_buf *params, const dopt_buf *grads) {
    size_t i, k;
    if (dopt__clip_check_buf(params) != DOPT_OK || dopt__clip_check_buf(grads) != DOPT_OK) return DOPT_ERR_INVALID;
    k = dopt_buf_nsegs(grads);
    if (dopt_buf_nsegs(params) != k) return DOPT_ERR_INVALID;
    for (i = 0; i < k; i++)
        if (dopt_buf_segment(params, i).count != dopt_buf_segment(grads, i).count) return DOPT_ERR_INVALID;
    return DOPT_OK;
}

static int dopt__clip_buf_finite(const dopt_buf *b) {
    size_t i, k = dopt_buf_nsegs(b);
    for (i = 0; i < k; i++) {
        dopt_span s = dopt_buf_segment(b, i);
        if (!dopt_all_finite(s.ptr, s.count)) return 0;
    }
    return 1;
}

/* ===================================================================== SUM OF SQUARES */

/* Σ over the segments of Σ x², in segment order. */
static double dopt__clip_buf_sumsq(const dopt_buf *b) {
    size_t i, k = dopt_buf_nsegs(b);
    double total = 0.0;
    for (i = 0; i < k; i++) {
        dopt_span s = dopt_buf_segment(b, i);
        total += dopt_sumsq(s.ptr, s.count);
    }
    return total;
}

/* ===================================================================== AGREEMENT ACROSS RANKS */

/* Each rank's verdict travels inside the sums all ranks add up, so that the verdict and the
   norms come from one allreduce and cannot disagree. A sum of squares of finite floats is
   finite (at most n·FLT_MAX² ≈ 1.2e77·n, far from DBL_MAX even over all ranks), and holds NaN
   or +inf as soon as one element is NaN or ±inf. Before the reduction a non-finite local sum
   becomes +inf, and a rank whose arguments are invalid fills every sum with NaN; after it:
   NaN anywhere (NaN absorbs everything) → DOPT_ERR_INVALID on every rank; else +inf anywhere →
   DOPT_ERR_NONFINITE on every rank; else the sums are the exact totals. Without a communicator
   the same decoding gives the local verdict. local is DOPT_OK or DOPT_ERR_INVALID. api is the
   public call, named in the communicator's detail should the allreduce fail. */
static dopt_status dopt__clip_agree(dopt_comm *comm, const char *api, double *sums, size_t k, dopt_status local) {
    size_t i;
    int nan_seen = 0, inf_seen = 0;
    for (i = 0; i < k; i++) {
        if (local != DOPT_OK)
            sums[i] = NAN;
        else if (!dopt__is_finite(sums[i]))
            sums[i] = INFINITY;
    }
    if (comm != NULL) {
        const char *prev = dopt_comm_set_api(comm, api);
        dopt_status s = dopt_allreduce(comm, sums, k, DOPT_F64, DOPT_SUM);
        dopt_comm_set_api(comm, prev);
        if (s != DOPT_OK) return s;
    }
    for (i = 0; i < k; i++) {
        nan_seen |= dopt__is_nan(sums[i]);
        inf_seen |= !dopt__is_finite(sums[i]);
    }
    if (nan_seen) return DOPT_ERR_INVALID;
    return inf_seen ? DOPT_ERR_NONFINITE : DOPT_OK;
}

/* A verdict with no numbers attached: the elementwise rules' only collective. */
static dopt_status dopt__clip_agree_verdict(dopt_comm *comm, const char *api, dopt_status local) {
    double flag = local == DOPT_ERR_NONFINITE ? INFINITY : 0.0;
    return dopt__clip_agree(comm, api, &flag, 1, local == DOPT_ERR_NONFINITE ? DOPT_OK : local);
}

/* min(1, limit/norm); 1 for a zero norm or an infinite limit. */
static double dopt__clip_factor(double norm, float limit) { return norm > (double)limit ? (double)limit / norm : 1.0; }

/* x ← x·f for f in [0, 1]. As a float, a factor below FLT_MIN is subnormal and keeps few
   significant bits (elements near FLT_MAX clipped to a small norm), so such a factor is applied
   in double, one element at a time; every other factor goes through dopt_scale as (float)f. */
static void dopt__clip_apply(float *x, size_t n, double f) {
    size_t i;
    if (f == 1.0) return;
    if (f >= FLT_MIN) {
        dopt_scale(x, (float)f, n);
        return;
    }
    for (i = 0; i < n; i++) x[i] = (float)((double)x[i] * f);
}

static void dopt__clip_apply_buf(const dopt_buf *b, double f) {
    size_t i, k = dopt_buf_nsegs(b);
    for (i = 0; i < k; i++) {
        dopt_span s = dopt_buf_segment(b, i);
        dopt__clip_apply(s.ptr, s.count, f);
    }
}

/* ===================================================================== GLOBAL NORM */

DOPT_DEF dopt_status dopt_clip_global_norm(dopt_comm *comm, const dopt_buf *grads, dopt_clip_norm *opt) {
    dopt_status s = dopt__clip_check_buf(grads);
    float scale = opt ? dopt__clip_scale_or_one(opt->scale) : 1.0f;
    double total = 0.0, norm, f;
    if (opt == NULL || !dopt__is_finite(scale) || !dopt__clip_limit_ok(opt->max_norm)) s = DOPT_ERR_INVALID;
    /* scale² inside the sum, so that ranks with different scales still add like terms */
    if (s == DOPT_OK) total = (double)scale * (double)scale * dopt__clip_buf_sumsq(grads);
    /* a rank with no opt still takes part, so that its peers fail with it instead of waiting */
    s = dopt__clip_agree(comm, "dopt_clip_global_norm", &total, 1, s);
    if (opt == NULL) return s;
    if (s != DOPT_OK) {
        opt->norm = NAN;
        opt->factor = 0.0f;
        return s;
    }
    norm = sqrt(total);
    f = dopt__clip_factor(norm, opt->max_norm);
    opt->norm = norm;
    opt->factor = (float)f;
    if (!opt->measure_only) dopt__clip_apply_buf(grads, f);
    return DOPT_OK;
}

/* ===================================================================== PER SEGMENT */

static dopt_status dopt__clip_check_limits(const float *limits, size_t k, float one_limit) {
    size_t i;
    if (limits == NULL) return dopt__clip_limit_ok(one_limit) ? DOPT_OK : DOPT_ERR_INVALID;
    for (i = 0; i < k; i++)
        if (!dopt__clip_limit_ok(limits[i])) return DOPT_ERR_INVALID;
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_clip_segment_norms(dopt_comm *comm, const dopt_buf *grads, const dopt_clip_norm *opt,
                                             double *norms) {
    dopt_status s = DOPT_OK;
    float scale = opt ? dopt__clip_scale_or_one(opt->scale) : 1.0f;
    size_t i, k;
    if (grads == NULL || (norms == NULL && dopt_buf_nsegs(grads) > 0)) {
        /* Nowhere to reduce nsegs sums: take part with one NaN, so that peers fail too (with
           DOPT_ERR_INVALID, or DOPT_ERR_MISMATCH from the transport when their count differs). */
        double invalid = 0.0;
        dopt__clip_agree(comm, "dopt_clip_segment_norms", &invalid, 1, DOPT_ERR_INVALID);
        return DOPT_ERR_INVALID;
    }
    k = dopt_buf_nsegs(grads); /* read from the descriptor alone, so the count matches peers' */
    if (opt == NULL || dopt__clip_check_buf(grads) != DOPT_OK || !dopt__is_finite(scale) ||
        dopt__clip_check_limits(opt->max_norms, k, opt->max_norm) != DOPT_OK)
        s = DOPT_ERR_INVALID;
    for (i = 0; i < k && s == DOPT_OK; i++) {
        dopt_span seg = dopt_buf_segment(grads, i);
        norms[i] = (double)scale * (double)scale * dopt_sumsq(seg.ptr, seg.count);
    }
    s = dopt__clip_agree(comm, "dopt_clip_segment_norms", norms, k, s);
    for (i = 0; i < k; i++) {
        dopt_span seg;
        float limit;
        if (s != DOPT_OK) {
            norms[i] = NAN;
            continue;
        }
        norms[i] = sqrt(norms[i]);
        if (opt->measure_only) continue;
        seg = dopt_buf_segment(grads, i);
        limit = opt->max_norms ? opt->max_norms[i] : opt->max_norm;
        dopt__clip_apply(seg.ptr, seg.count, dopt__clip_factor(norms[i], limit));
    }
    return s;
}

/* ===================================================================== BY VALUE */

/* x ← min(max(x, -bound), bound); branch-free so that it compiles to vector min/max. Blocks of
   16 with a constant inner trip count vectorize at -O2 (see distopt.h's kernels). */
static void dopt__clip_clamp(float *x, size_t n, float bound) {
    size_t i, n_main = n - n % 16;
    int j;
    for (i = 0; i < n_main; i += 16)
        for (j = 0; j < 16; j++) {
            float v = x[i + j];
            v = v > bound ? bound : v;
            x[i + j] = v < -bound ? -bound : v;
        }
    for (i = n_main; i < n; i++) {
        float v = x[i];
        v = v > bound ? bound : v;
        x[i] = v < -bound ? -bound : v;
    }
}

DOPT_DEF dopt_status dopt_clip_value(dopt_comm *comm, const dopt_buf *grads, float scale, float max_value) {
    dopt_status s = dopt__clip_check_buf(grads);
    size_t i, k;
    double bound;
    if (!dopt__clip_scale_ok(scale) || !dopt__clip_limit_ok(max_value)) s = DOPT_ERR_INVALID;
    if (s == DOPT_OK && !dopt__clip_buf_finite(grads)) s = DOPT_ERR_NONFINITE;
    s = dopt__clip_agree_verdict(comm, "dopt_clip_value", s);
    if (s != DOPT_OK) return s;
    bound = (double)max_value / fabs((double)scale);
    if (bound >= FLT_MAX) return DOPT_OK; /* no float exceeds it */
    k = dopt_buf_nsegs(grads);
    for (i = 0; i < k; i++) {
        dopt_span seg = dopt_buf_segment(grads, i);
        dopt__clip_clamp(seg.ptr, seg.count, (float)bound);
    }
    return DOPT_OK;
}

/* ===================================================================== TERNGRAD c·σ */

DOPT_DEF dopt_status dopt_clip_sigma(dopt_comm *comm, const dopt_buf *grads, float c) {
    dopt_status s = dopt__clip_check_buf(grads);
    size_t i, k;
    if (!dopt__clip_limit_ok(c)) s = DOPT_ERR_INVALID;
    if (s == DOPT_OK && !dopt__clip_buf_finite(grads)) s = DOPT_ERR_NONFINITE;
    s = dopt__clip_agree_verdict(comm, "dopt_clip_sigma", s);
    if (s != DOPT_OK) return s;
    k = dopt_buf_nsegs(grads);
    for (i = 0; i < k; i++) {
        dopt_span seg = dopt_buf_segment(grads, i);
        double mean, var, bound;
        dopt_mean_var(seg.ptr, seg.count, &mean, &var);
        bound = (double)c * sqrt(var);
        if (var > 0.0 && bound < FLT_MAX) dopt__clip_clamp(seg.ptr, seg.count, (float)bound);
    }
    return DOPT_OK;
}

/* ===================================================================== ADAPTIVE CLIPPING (AGC) */

static dopt_status dopt__clip_check_cols(const dopt_buf *grads, const size_t *cols) {
    size_t i, k = dopt_buf_nsegs(grads);
    if (cols == NULL) return DOPT_OK;
    for (i = 0; i < k; i++)
        if (cols[i] != 0 && dopt_buf_segment(grads, i).count % cols[i] != 0) return DOPT_ERR_INVALID;
    return DOPT_OK;
}

/* One segment, unit by unit: ‖scale·g_u‖ > lambda·max(‖w_u‖, eps) → g_u scaled down onto the
   bound. */
static void dopt__clip_agc_segment(float *g, const float *w, size_t count, size_t unit, double abs_scale,
                                   double lambda, double eps) {
    size_t u;
    for (u = 0; u + unit <= count; u += unit) {
        double gnorm = abs_scale * sqrt(dopt_sumsq(g + u, unit));
        double wnorm = sqrt(dopt_sumsq(w + u, unit));
        double bound = lambda * (wnorm > eps ? wnorm : eps);
        if (gnorm > bound) dopt__clip_apply(g + u, unit, bound / gnorm);
    }
}

DOPT_DEF dopt_status dopt_clip_agc(dopt_comm *comm, const dopt_buf *grads, const dopt_buf *params,
                                   const dopt_agc *opt) {
    dopt_status s = dopt__clip_check_pair(params, grads);
    float scale = opt ? dopt__clip_scale_or_one(opt->scale) : 1.0f;
    float eps = opt == NULL || dopt__clip_is_zero(opt->eps) ? DOPT_AGC_EPS_DEFAULT : opt->eps;
    const size_t *cols = opt ? opt->cols : NULL;
    size_t i, k;
    if (opt == NULL || !dopt__is_finite(scale) || !dopt__clip_limit_ok(opt->lambda) || !dopt__clip_positive_finite(eps))
        s = DOPT_ERR_INVALID;
    if (s == DOPT_OK) s = dopt__clip_check_cols(grads, cols);
    if (s == DOPT_OK && (!dopt__clip_buf_finite(grads) || !dopt__clip_buf_finite(params))) s = DOPT_ERR_NONFINITE;
    s = dopt__clip_agree_verdict(comm, "dopt_clip_agc", s);
    if (s != DOPT_OK) return s;
    k = dopt_buf_nsegs(grads);
    for (i = 0; i < k; i++) {
        dopt_span g = dopt_buf_segment(grads, i), w = dopt_buf_segment(params, i);
        size_t unit = cols != NULL && cols[i] != 0 ? cols[i] : g.count;
        if (g.count == 0) continue;
        dopt__clip_agc_segment(g.ptr, w.ptr, g.count, unit, fabs((double)scale), (double)opt->lambda, (double)eps);
    }
    return DOPT_OK;
}

/* ===================================================================== CELGC STEP RULE */

/* The whole rule, whichever call reads it; *scale receives its scale with the default applied. */
static dopt_status dopt__celgc_check(const dopt_celgc *rule, float *scale) {
    if (rule == NULL) return DOPT_ERR_INVALID;
    *scale = dopt__clip_scale_or_one(rule->scale);
    if (!dopt__is_finite(*scale) || !dopt__clip_positive_finite(rule->eta) || !dopt__clip_limit_ok(rule->gamma) ||
        !(dopt__is_finite(rule->weight_decay) && rule->weight_decay >= 0.0f))
        return DOPT_ERR_INVALID;
    return DOPT_OK;
}

/* min(eta, gamma/(‖scale·g‖ + ε)) in double, from an already validated buffer. */
static dopt_status dopt__celgc_compute_step(const dopt_buf *grads, float scale, float eta, float gamma, double *step) {
    double ss = dopt__clip_buf_sumsq(grads), limited;
    if (!dopt__is_finite(ss)) return DOPT_ERR_NONFINITE;
    limited = (double)gamma / (fabs((double)scale) * sqrt(ss) + DOPT_CELGC_EPS);
    *step = limited < (double)eta ? limited : (double)eta;
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_celgc_step_size(const dopt_buf *grads, const dopt_celgc *rule, float *step) {
    double st = 0.0;
    float scale = 1.0f;
    dopt_status s = dopt__clip_check_buf(grads);
    if (s == DOPT_OK) s = dopt__celgc_check(rule, &scale);
    if (s == DOPT_OK) s = dopt__celgc_compute_step(grads, scale, rule->eta, rule->gamma, &st);
    if (step) *step = s == DOPT_OK ? (float)st : 0.0f;
    return s;
}

/* x ← keep·x − a·g with keep = 1 − step·weight_decay and a = step·scale (keep = 1 exactly
   without weight decay, so then x − a·g). */
static void dopt__celgc_update(float *DOPT_RESTRICT x, const float *DOPT_RESTRICT g, size_t n, float keep, float a) {
    size_t i, n_main = n - n % 16;
    int j;
    for (i = 0; i < n_main; i += 16)
        for (j = 0; j < 16; j++) x[i + j] = keep * x[i + j] - a * g[i + j];
    for (i = n_main; i < n; i++) x[i] = keep * x[i] - a * g[i];
}

DOPT_DEF dopt_status dopt_celgc_step(const dopt_buf *params, const dopt_buf *grads, const dopt_celgc *rule) {
    double step = 0.0;
    size_t i, k;
    float scale = 1.0f, keep, a;
    dopt_status s = dopt__clip_check_pair(params, grads);
    if (s == DOPT_OK) s = dopt__celgc_check(rule, &scale);
    if (s == DOPT_OK) s = dopt__celgc_compute_step(grads, scale, rule->eta, rule->gamma, &step);
    if (s != DOPT_OK) return s;
    /* in float arithmetic, where an overflow is an infinity rather than an out-of-range
       conversion; step ≤ eta is a float already */
    keep = 1.0f - (float)step * rule->weight_decay;
    a = (float)step * scale;
    k = dopt_buf_nsegs(grads);
    for (i = 0; i < k; i++) {
        dopt_span x = dopt_buf_segment(params, i), g = dopt_buf_segment(grads, i);
        dopt__celgc_update(x.ptr, g.ptr, g.count, keep, a);
    }
    return DOPT_OK;
}

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_IMPLEMENTATION */
