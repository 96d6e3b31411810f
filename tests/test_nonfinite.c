/* Tests of the data-parallel driver's non-finite rule (localsgd.h, NON-FINITE AVERAGES), on every
   transport of worlds.h at 2 and 3 ranks: a NaN or an infinity in one rank's gradient at step 3
   of a loop that checks no status, through fp32 and every codec, under DOPT_NONFINITE_FAIL and
   _SKIP; a model gone non-finite before a local-SGD average (plain, weighted, compressed deltas,
   DiLoCo's outer step); finite gradients whose sum overflows; gradients flat (averaged in place)
   and as a scatter list (packed). The bodies are tests/nonfinite.h's, shared with test_mpi.c.
   The Makefile builds this file again with -Ofast and with clang's -ffast-math: the verdict
   tests bits. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "../clip.h"
#include "../compress.h"
#include "../localsgd.h"
#include "dtest.h"
#include "worlds.h"

#define NF_CHECK(cond, ...) DT_CHECKF(cond, __VA_ARGS__)
#include "nonfinite.h"

static void body_case(dopt_comm *c, void *arg) { nf_run(c, (const nf_case *)arg); }

#define FAIL_ DOPT_NONFINITE_FAIL
#define SKIP_ DOPT_NONFINITE_SKIP

/* Synchronous gradient averages: fp32 and every codec, NaN and +inf, both policies. */
static const nf_case grads_cases[] = {
    {NF_GRADS, -1, DOPT_AGG_AUTO, FAIL_, 0, 0, 0},
    {NF_GRADS, -1, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
    {NF_GRADS, -1, DOPT_AGG_AUTO, FAIL_, 1, 0, 0},
    {NF_GRADS, -1, DOPT_AGG_AUTO, SKIP_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_TERNARY, DOPT_AGG_ALLGATHER, FAIL_, 0, 0, 0},
    {NF_GRADS, DOPT_CODEC_TERNARY, DOPT_AGG_ALLGATHER, SKIP_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_TERNARY, DOPT_AGG_RING, FAIL_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_TERNARY, DOPT_AGG_RING, SKIP_, 0, 0, 0},
    {NF_GRADS, DOPT_CODEC_MAJORITY, DOPT_AGG_RING, FAIL_, 0, 0, 0},
    {NF_GRADS, DOPT_CODEC_MAJORITY, DOPT_AGG_ALLGATHER, SKIP_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_FP16, DOPT_AGG_AUTO, FAIL_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_FP16, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
    {NF_GRADS, DOPT_CODEC_BF16, DOPT_AGG_AUTO, FAIL_, 0, 0, 0},
    {NF_GRADS, DOPT_CODEC_BF16, DOPT_AGG_AUTO, SKIP_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_QSGD, DOPT_AGG_AUTO, FAIL_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_QSGD, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
    {NF_GRADS, DOPT_CODEC_TOPK, DOPT_AGG_AUTO, FAIL_, 0, 0, 0},
    {NF_GRADS, DOPT_CODEC_TOPK, DOPT_AGG_AUTO, SKIP_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_SIGN, DOPT_AGG_AUTO, FAIL_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_SIGN, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
    {NF_GRADS, DOPT_CODEC_POWERSGD, DOPT_AGG_AUTO, FAIL_, 0, 0, 0},
    {NF_GRADS, DOPT_CODEC_POWERSGD, DOPT_AGG_AUTO, SKIP_, 1, 0, 0},
    {NF_GRADS, DOPT_CODEC_FP32, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
};
DTEST_WORLDS_EACH(a_non_finite_gradient_average_stops_or_skips_on_every_rank_for_every_codec, body_case, grads_cases,
                  2, 3);

/* The same rule where the host calls after_step too, and in CELGC's synchronous clipped SGD. */
static const nf_case step_cases[] = {
    {NF_GRADS_AND_STEP, -1, DOPT_AGG_AUTO, FAIL_, 0, 0, 0},
    {NF_GRADS_AND_STEP, -1, DOPT_AGG_AUTO, SKIP_, 1, 0, 0},
    {NF_GRADS_AND_STEP, DOPT_CODEC_TERNARY, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
    {NF_CELGC, -1, DOPT_AGG_AUTO, FAIL_, 1, 0, 0},
    {NF_CELGC, -1, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
    {NF_CELGC, DOPT_CODEC_TERNARY, DOPT_AGG_AUTO, SKIP_, 1, 0, 0},
};
DTEST_WORLDS_EACH(after_step_and_celgc_follow_the_same_non_finite_rule, body_case, step_cases, 2, 3);

/* Gradients as a scatter list: packed into the driver's workspace, where the cases above average
   a flat buffer in place; the verdicts ride on the copies instead of scans, the rule is the same. */
static const nf_case scatter_cases[] = {
    {NF_GRADS, -1, DOPT_AGG_AUTO, FAIL_, 0, 0, 0, 1},
    {NF_GRADS, -1, DOPT_AGG_AUTO, SKIP_, 1, 0, 0, 1},
    {NF_GRADS, -1, DOPT_AGG_AUTO, FAIL_, 1, 0, 0, 1},
    {NF_GRADS, -1, DOPT_AGG_AUTO, SKIP_, 0, 0, 0, 1},
    {NF_GRADS, DOPT_CODEC_TERNARY, DOPT_AGG_ALLGATHER, FAIL_, 1, 0, 0, 1},
    {NF_GRADS, DOPT_CODEC_TERNARY, DOPT_AGG_RING, SKIP_, 0, 0, 0, 1},
    {NF_GRADS, DOPT_CODEC_FP16, DOPT_AGG_AUTO, SKIP_, 1, 0, 0, 1},
    {NF_GRADS, DOPT_CODEC_POWERSGD, DOPT_AGG_AUTO, FAIL_, 0, 0, 0, 1},
    {NF_GRADS_AND_STEP, -1, DOPT_AGG_AUTO, SKIP_, 0, 0, 0, 1},
    {NF_CELGC, -1, DOPT_AGG_AUTO, FAIL_, 0, 0, 0, 1},
    {NF_OVERFLOW, -1, DOPT_AGG_AUTO, FAIL_, 0, 0, 0, 1},
    {NF_OVERFLOW, -1, DOPT_AGG_AUTO, SKIP_, 0, 0, 0, 1},
};
DTEST_WORLDS_EACH(a_scatter_list_of_gradients_follows_the_same_non_finite_rule, body_case, scatter_cases, 2, 3);

/* Local SGD: plain, weighted, compressed deltas with error feedback, DiLoCo's outer step. */
static const nf_case model_cases[] = {
    {NF_MODELS, -1, DOPT_AGG_AUTO, FAIL_, 0, 0, 0},
    {NF_MODELS, -1, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
    {NF_MODELS, -1, DOPT_AGG_AUTO, SKIP_, 1, 1, 0},
    {NF_MODELS, -1, DOPT_AGG_AUTO, FAIL_, 1, 0, 1},
    {NF_MODELS, -1, DOPT_AGG_AUTO, SKIP_, 0, 0, 1},
    {NF_MODELS, DOPT_CODEC_TOPK, DOPT_AGG_AUTO, FAIL_, 1, 0, 0},
    {NF_MODELS, DOPT_CODEC_TOPK, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
};
DTEST_WORLDS_EACH(a_non_finite_model_average_stops_or_continues_from_the_finite_ranks_mean, body_case, model_cases, 2,
                  3);

/* Every input finite, their sum not: an overflow, no rank blamed. */
static const nf_case overflow_cases[] = {
    {NF_OVERFLOW, -1, DOPT_AGG_AUTO, FAIL_, 0, 0, 0},
    {NF_OVERFLOW, -1, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
    {NF_MODELS_OVERFLOW, -1, DOPT_AGG_AUTO, FAIL_, 0, 0, 0},
    {NF_MODELS_OVERFLOW, -1, DOPT_AGG_AUTO, SKIP_, 0, 0, 0},
    {NF_MODELS_OVERFLOW, -1, DOPT_AGG_AUTO, SKIP_, 0, 1, 1},
};
DTEST_WORLDS_EACH(an_average_that_overflows_is_named_as_an_overflow, body_case, overflow_cases, 2, 3);

DTEST(a_policy_that_is_not_one_is_refused_at_init) {
    dopt_comm *c = NULL;
    dopt_dp dp;
    dopt_dp_config cfg;
    DT_OK(dopt_comm_create_self(&c));
    memset(&cfg, 0, sizeof cfg);
    cfg.nonfinite = (dopt_nonfinite_policy)2;
    DT_EQ_INT(dopt_dp_init(&dp, c, 4, &cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&dp), "nonfinite") != NULL, "%s", dopt_dp_detail(&dp));
    dopt_dp_free(&dp);
    dopt_comm_destroy(c);
}

DTEST_MAIN()
