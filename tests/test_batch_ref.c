/* An independent reference for the adaptive batch-size controller (localsgd.h, issue #30).

   The test computes every sample's gradient in double, evaluates the paper's norm, inner-product
   and augmented tests from those per-sample gradients, as the reference code of AdAdaGrad
   (Lau, Liu, Kolar 2024) computes them, and feeds the same samples to the controller as float
   micro-batch means. Over hundreds of rounds, each at fresh parameters and data, it compares:
   each statistic against the reference's (the bias, its standard deviation derived below from the
   degrees of freedom, asserted within 5 of them), and the decisions (the rate at which "grow or
   keep" agree, and the rate at which the next batch sizes agree within a factor 2, each beside
   the rate the same derivation predicts, asserted not far below it). Two models: least squares and
   logistic regression; two kinds of round: synchronous (every rank at the same parameters, the
   update averaged over the N ranks: the reference pools all N·b samples and compares the global
   batch N·b) and local (each worker at its own parameters: the reference takes the worker's own
   batch b, its variance pooled over workers and its ‖g_B‖² averaged over them), on a world of 3
   processes, on every transport. Then answers known in advance: no noise never grows, even when
   the gradient moves between a round's steps; pure noise asks for many times the batch; and,
   where least squares knows ‖∇F‖², the bias-corrected estimate is unbiased for it while the
   plain one is high by τ²/(W·k).

   DERIVATION OF THE BOUNDS
   Write one step's samples as ∇f_i = μ + e_i, with e_i independent, mean 0, covariance Σ (one
   Σ per worker in a local round). The per-sample gradients are those of n = N·b samples, b = k·u
   per worker in k micro-batches of u. Both the controller's and the reference's statistics are,
   up to μ-terms that cancel, quadratic forms Q_A = Σ_il A_il ⟨e_i, e_l⟩ with A symmetric. For
   independent e_i with finite fourth moments,
       Var(Q_A) = Σ_i A_ii² (Var‖e‖² − 2 tr Σ²) + 2 tr(Σ²) ‖A‖²_F,
   so when A has a zero diagonal the fourth moment (how heavy-tailed the gradients are) drops out
   and Var(Q_A) = 2 tr(Σ²) ‖A‖²_F exactly; the same for Cov(Q_A, Q_B) = 2 tr(Σ²) ⟨A, B⟩_F. With
   P_B the projection onto the spread of the micro-batch means around their worker's mean (rank
   d_c = N(k − 1)), P_W onto the spread of the samples around their worker's mean (rank
   N(b − 1)), P_T onto the spread around the global mean (rank n − 1), P_R onto the spread of the
   workers' means around the global mean (rank N − 1), P_M onto the workers' means (rank N):
     controller  var = u·τ̂² = Q_{P_B/d_c}                  (the spread of the micro-batch means)
     reference   var = Q_{P_T/d_r}, d_r = n − 1 (synchronous; P_W/(N(b − 1)) in a local round)
   Every one of these has the diagonal 1/n (a sample's share is the same in both), so their
   difference has none and, as P_B lies inside P_T (and P_W),
       Var(var_c − var_r) = 2 tr(Σ²) (1/d_c − 1/d_r),
   whatever the distribution of the gradients. The ratio to var² is at most 2(1/d_c − 1/d_r):
   the √(2/d) of a χ² with d degrees of freedom, less what the reference's own dof remove. The
   same holds for ip_var (the forms restricted to a direction ĝ: tr Σ² becomes (ĝᵀΣĝ)²) and for
   orth_var (tr((P⊥ΣP⊥)²), P⊥ = I − ĝĝᵀ), given the direction. The controller's direction (its
   exact projection) and the reference's are the same vector: in a local round the worker's own
   mean, in a synchronous one the mean of all n samples (the driver hands the averaged gradient
   over). Given that mean the difference still has mean zero: the samples are exchangeable, and
   the form has a zero diagonal and zero row sums.
     ‖g_B‖². In a synchronous round the driver hands the averaged gradient ḡ over and the
   controller's plain estimate is (mean over ranks of ⟨v̄_m, ḡ/‖ḡ‖⟩)² = ‖ḡ‖², the reference's
   own; in a local round it is the mean of the workers' ‖v̄_m‖², the reference's the mean of
   their ‖g_B,m‖². Both the same numbers but for the float rounding of the micro-batch means
   (2⁻²⁴ relative each): asserted equal within 1e-5, and the decisions' spread below has no
   ‖g_B‖² term. (Before it read the global mean, the controller formed the synchronous estimate
   from scalars, (1/N)Σ_m‖v̄_m‖² − τ̂²(1 − 1/N)/k: equal in expectation for identically
   distributed shards, with Var(g_c − g_r) = 2 tr(Σ²)(N − 1)(1 + (N − 1)/d_c)/n², and high by the
   spread of the ranks' means when shards differ.)
     Bias-corrected, least squares (x ~ N(0, I), y = xᵀw* + σε, a = w − w*): ∇F = a,
   Σ = (‖a‖² + σ²) I + aaᵀ, so tr Σ = D(‖a‖² + σ²) + ‖a‖², tr Σ² and aᵀΣa in closed form. The
   estimate on a synchronous round, ‖ḡ‖² − τ̂²/(N·k) − ‖a‖² = 2⟨a, ē⟩ + Q_A, ē the mean noise
   of all n samples and A = 11ᵀ/n² − P_B/(d_c·n): zero diagonal (1/n² in both: var_c's diagonal
   is 1/n), ⟨11ᵀ, P_B⟩_F = 0 (the spreads are orthogonal to the constant), so
   ‖A‖²_F = (1 + 1/d_c)/n², and the linear and quadratic parts uncorrelated (a zero diagonal
   leaves no third moment): mean 0, Var = 4aᵀΣa/n + 2 tr(Σ²)(1 + 1/d_c)/n². The plain estimate
   exceeds it by τ̂²/(N·k) = var_c/n exactly, with E var_c = tr Σ and
   Var(var_c) = (Var‖e‖² − 2 tr Σ²)/n + 2 tr(Σ²)/d_c, the fourth moment measured on the round's
   own samples (e_i = ∇f_i − a is known); its sd is bounded by the sum of the two parts'.
     Over R independent rounds. Each round's difference c − r is divided by the same statistic s
   evaluated on an independent batch of as many samples at the same parameters, so every round
   counts alike and the division adds no bias (s is independent of c − r); tr Σ² and its kin are
   taken from that batch's sample covariance too (plug-ins; exact moments in the least-squares
   truth checks). The mean of (c − r)/s then has mean 0 and sd √(Σ Var_ρ/s_ρ²)/R, and the test
   asserts it within 5 of those sd. A fixed seed makes each outcome fixed; 5σ makes a failure a
   bias, not bad luck (a normal tail of 6e-7).
     Decisions. To first order log(need_c/need_r) = Δstat/stat − Δg/g, normal with the variance
   s² given by the terms above. The round's decisions differ when the threshold lies between the
   two: with m = log(need_r/batch), p = Φ(−|m|/s). The next batch (the larger of the current one
   and b_needed; the controller's in whole units, at most ×1.25 above) differs by more than a
   factor 2 with a probability q at most as beyond_twice() gives. The test sums p and q over the
   rounds (the expected numbers of disagreements) and asserts the observed numbers below the
   expectation plus 5 standard deviations of a sum of Bernoulli(p), plus 2% of the rounds for the
   first-order approximation (a round whose ‖g‖² estimate is near zero is where it is worst). The
   reference must grow in between 20% and 80% of the rounds, so that agreement is not won by
   rounds far from the threshold.
     A synchronous step without the driver (a host calling dopt_batch_averaged itself) projects
   on its rank's own mean, b samples instead of N·b: a direction drawn from fewer of the samples
   whose spread along it is measured finds more spread along it, and ip_var came out about 20%
   above the paper's on both models here (orth_var about 5% below). This test takes the
   driver's path for synchronous rounds.
     Not covered: shards that differ between ranks. Every rank here draws from the same
   distribution. Where the ranks' mean gradients ∇F_m differ, the paper's pooled variance of a
   synchronous round holds the spread between ranks (the law of total variance over the global
   batch) and the controller's, within-rank, does not (least squares with each rank's optimum
   moved 0.9‖w − w*‖ in a direction of its own: var −2%); ‖g_B‖² is the global mean's in both. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "../localsgd.h"
#include "dtest.h"
#include "worlds.h"

#include <stdint.h>

#define RD 8        /* parameters */
#define RK 4        /* micro-batches per step on each rank */
#define RU 8        /* samples per micro-batch */
#define RB (RK * RU) /* samples per step on each rank */
#define RN_MAX 4    /* ranks the reference can hold */
#define ROUNDS 400
#define MAX_UNITS 4096
#define SAMPLE_WORDS 32 /* generator words one sample uses */
#define SEED 3030

/* ------------------------------------------------------------------ generator in double */

static dopt_rng stream(uint64_t id) {
    dopt_rng r;
    dopt_rng_init(&r, SEED, 0, id);
    return r;
}

/* A double in (0, 1] from two 32-bit words (53 bits). */
static double unit_double(const dopt_rng *r, uint64_t word) {
    uint32_t w[2];
    dopt_rng_u32(r, word, w, 2);
    return ((double)(w[0] >> 5) * 67108864.0 + (double)(w[1] >> 6) + 1.0) / 9007199254740992.0;
}

/* n standard normals from words first, first + 1, ... (Box-Muller, 4 words a pair). */
static void normals(const dopt_rng *r, uint64_t first, double *out, int n) {
    int i;
    for (i = 0; i < n; i += 2) {
        double rad = sqrt(-2.0 * log(unit_double(r, first + 2 * (uint64_t)i)));
        double ang = 6.283185307179586 * unit_double(r, first + 2 * (uint64_t)i + 2);
        out[i] = rad * cos(ang);
        if (i + 1 < n) out[i + 1] = rad * sin(ang);
    }
}

static double dot(const double *a, const double *b) {
    double s = 0.0;
    int i;
    for (i = 0; i < RD; i++) s += a[i] * b[i];
    return s;
}

/* ------------------------------------------------------------------ the models */

typedef enum model_kind { LEAST_SQUARES, LOGISTIC } model_kind;

/* One rank's parameters in a round: w, the optimum w*, the label noise σ (least squares). */
typedef struct point {
    double w[RD], wstar[RD], sigma;
} point;

/* A random direction times a length log-uniform in [lo, hi]. */
static void random_offset(const dopt_rng *r, uint64_t first, double lo, double hi, double *out) {
    double z[RD], len = lo * exp(log(hi / lo) * unit_double(r, first + 40)), nz;
    int i;
    normals(r, first, z, RD);
    nz = sqrt(dot(z, z));
    for (i = 0; i < RD; i++) out[i] = len * z[i] / nz;
}

/* The round's point on a rank: least squares has ‖w − w*‖ in [0.1, 10] and σ²/‖w − w*‖² in
   [0.1, 100], so the norm test's b_needed ≈ (D + 1 + D·σ²/‖a‖²)/η² spans the batch; logistic
   regression has ‖w − w*‖ in [0.05, 10] around ‖w*‖ = 2. In a local round each worker's w has
   moved from the round's by 30% of ‖w − w*‖ (its own local steps). */
static point round_point(model_kind m, int round, int rank, int local) {
    dopt_rng r = stream(1);
    uint64_t at = (uint64_t)round * 1024;
    point p;
    double a[RD], drift[RD], na;
    int i;
    normals(&r, at, p.wstar, RD);
    if (m == LOGISTIC) {
        double nw = sqrt(dot(p.wstar, p.wstar));
        for (i = 0; i < RD; i++) p.wstar[i] *= 2.0 / nw;
    }
    random_offset(&r, at + 64, m == LOGISTIC ? 0.05 : 0.1, 10.0, a);
    na = sqrt(dot(a, a));
    p.sigma = na * sqrt(0.01 * exp(log(1e4) * unit_double(&r, at + 128)));
    random_offset(&r, at + 256 + 64 * (uint64_t)rank, 0.3 * na, 0.3 * na, drift);
    for (i = 0; i < RD; i++) p.w[i] = p.wstar[i] + a[i] + (local ? drift[i] : 0.0);
    return p;
}

/* The generator streams of the samples: those the controller and the reference both see, and an
   independent batch at the same parameters that only scales the comparison. */
#define SEEN 2
#define SCALE 4

/* Sample i of rank `rank` in round `round`: x ~ N(0, I); least squares y = xᵀw* + σε and
   ∇f = (xᵀw − y)x; logistic y ~ Bernoulli(s(xᵀw*)) and ∇f = (s(xᵀw) − y)x. */
static void sample_grad(model_kind m, const point *p, int round, int rank, int i, uint64_t batch, double *g) {
    dopt_rng r = stream(batch);
    uint64_t at = (((uint64_t)round * RN_MAX + (uint64_t)rank) * RB + (uint64_t)i) * SAMPLE_WORDS;
    double x[RD + 2], res;
    int j;
    normals(&r, at, x, RD + 1);
    if (m == LEAST_SQUARES) {
        res = dot(x, p->w) - dot(x, p->wstar) - p->sigma * x[RD];
    } else {
        double y = unit_double(&r, at + 24) <= 1.0 / (1.0 + exp(-dot(x, p->wstar))) ? 1.0 : 0.0;
        res = 1.0 / (1.0 + exp(-dot(x, p->w))) - y;
    }
    for (j = 0; j < RD; j++) g[j] = res * x[j];
}

/* Every sample's gradient on rank `rank` in the round, from the stream `batch`. */
static void rank_grads(model_kind m, int round, int rank, int local, uint64_t batch, double g[RB][RD]) {
    point p = round_point(m, round, rank, local);
    int i;
    for (i = 0; i < RB; i++) sample_grad(m, &p, round, rank, i, batch, g[i]);
}

/* ------------------------------------------------------------------ the reference: the paper's statistics */

/* The paper's statistics of one batch of per-sample gradients, and the second moments of its
   noise the bounds need (from the sample covariance S: plug-ins for Σ). */
typedef struct paper {
    double var;     /* Σ_coord Var_i(∇f_i), correction 1 */
    double g2;      /* ‖g_B‖², g_B the plain batch mean */
    double ip;      /* Var_i(⟨∇f_i, g_B⟩)/‖g_B‖² */
    double orth;    /* Σ_coord Var_i(∇f_i − ⟨∇f_i, g_B⟩g_B/‖g_B‖²) */
    double t2;      /* tr S² */
    double t2_ip;   /* (ĝᵀSĝ)² */
    double t2_orth; /* tr((P⊥SP⊥)²) */
    double c_ip;    /* ĝᵀS²ĝ: the covariance of ip's form with g2's */
    double c_orth;  /* tr S² − ĝᵀS²ĝ: the same for orth */
} paper;

static double sample_variance(const double *v, int n) {
    double mean = 0.0, ss = 0.0;
    int i;
    for (i = 0; i < n; i++) mean += v[i] / n;
    for (i = 0; i < n; i++) ss += (v[i] - mean) * (v[i] - mean);
    return ss / (n - 1);
}

static double coordinate_variance_sum(double (*g)[RD], int n) {
    double col[RN_MAX * RB], s = 0.0;
    int i, j;
    for (j = 0; j < RD; j++) {
        for (i = 0; i < n; i++) col[i] = g[i][j];
        s += sample_variance(col, n);
    }
    return s;
}

/* The noise's second moments from the sample covariance of the n gradients, along the unit u. */
static void noise_moments(double (*g)[RD], int n, const double *mean, const double *u, paper *out) {
    double S[RD][RD] = {{0}}, Su[RD], uSu;
    int i, j, l;
    for (i = 0; i < n; i++)
        for (j = 0; j < RD; j++)
            for (l = 0; l < RD; l++) S[j][l] += (g[i][j] - mean[j]) * (g[i][l] - mean[l]) / (n - 1);
    out->t2 = 0.0;
    for (j = 0; j < RD; j++)
        for (l = 0; l < RD; l++) out->t2 += S[j][l] * S[j][l];
    for (j = 0; j < RD; j++) Su[j] = dot(S[j], u);
    uSu = dot(u, Su);
    out->t2_ip = uSu * uSu;
    out->c_ip = dot(Su, Su);
    out->c_orth = out->t2 - out->c_ip;
    out->t2_orth = out->t2 - 2.0 * out->c_ip + out->t2_ip;
}

/* The reference code's statistics of a batch of n per-sample gradients. */
static paper paper_stats(double (*g)[RD], int n) {
    double mean[RD] = {0}, u[RD], p[RN_MAX * RB], orth[RN_MAX * RB][RD], ng;
    paper out;
    int i, j;
    for (i = 0; i < n; i++)
        for (j = 0; j < RD; j++) mean[j] += g[i][j] / n;
    out.g2 = dot(mean, mean);
    ng = sqrt(out.g2);
    for (j = 0; j < RD; j++) u[j] = mean[j] / ng;
    out.var = coordinate_variance_sum(g, n);
    for (i = 0; i < n; i++) {
        p[i] = dot(g[i], mean);
        for (j = 0; j < RD; j++) orth[i][j] = g[i][j] - p[i] * mean[j] / out.g2;
    }
    out.ip = sample_variance(p, n) / out.g2;
    out.orth = coordinate_variance_sum(orth, n);
    noise_moments(g, n, mean, u, &out);
    return out;
}

/* out += w/N, field by field. */
static void paper_add(paper *out, const paper *w, double N) {
    out->var += w->var / N;
    out->g2 += w->g2 / N;
    out->ip += w->ip / N;
    out->orth += w->orth / N;
    out->t2 += w->t2 / N;
    out->t2_ip += w->t2_ip / N;
    out->t2_orth += w->t2_orth / N;
    out->c_ip += w->c_ip / N;
    out->c_orth += w->c_orth / N;
}

/* A synchronous round: all N·b samples pooled. A local round: each worker's own batch, the
   statistics averaged over workers (equal degrees of freedom: the pooled variance). */
static paper paper_round(model_kind m, int round, int nranks, int local, uint64_t batch) {
    static double g[RN_MAX * RB][RD];
    paper out, w;
    int r;
    for (r = 0; r < nranks; r++) rank_grads(m, round, r, local, batch, g + r * RB);
    if (!local) return paper_stats(g, nranks * RB);
    memset(&out, 0, sizeof out);
    for (r = 0; r < nranks; r++) {
        w = paper_stats(g + r * RB, RB);
        paper_add(&out, &w, nranks);
    }
    return out;
}

/* ------------------------------------------------------------------ the controller */

typedef enum ctrl_kind { C_NORM, C_IP, C_AUG, C_NORM_CORRECTED, C_COUNT } ctrl_kind;

/* The tests' tolerances: η, θ, ν. */
typedef struct tolerances {
    double eta, theta, nu;
} tolerances;

/* What one controller decided in a round (the same on every rank). */
typedef struct decided {
    dopt_batch_stats st;
    size_t units;
} decided;

static dopt_batch_config ctrl_config(ctrl_kind k, const tolerances *tol) {
    dopt_batch_config c;
    memset(&c, 0, sizeof c);
    c.test = k == C_IP ? DOPT_BATCH_INNER_PRODUCT : k == C_AUG ? DOPT_BATCH_AUGMENTED : DOPT_BATCH_NORM;
    c.eta = tol->eta;
    c.theta = tol->theta;
    c.nu = tol->nu;
    c.unit_samples = RU;
    c.initial_units = RK;
    c.max_units = MAX_UNITS;
    c.projection = DOPT_BATCH_PROJECT_EXACT;
    c.bias_corrected = k == C_NORM_CORRECTED;
    return c;
}

/* This rank's k micro-batch means, as floats. */
static void micro_means(double g[RB][RD], float micro[RK][RD]) {
    int j, i, l;
    for (j = 0; j < RK; j++)
        for (l = 0; l < RD; l++) {
            double s = 0.0;
            for (i = 0; i < RU; i++) s += g[j * RU + i][l];
            micro[j][l] = (float)(s / RU);
        }
}

/* One step of a fresh controller of kind k on this rank's micro-batches, then its decision. A
   synchronous step goes through the driver at period 1, as a host would: it averages the step's
   gradient over the ranks (the mean of the micro-batch means), tells the controller the step was
   averaged, hands it the averaged gradient's direction, and decides. A local step calls the
   controller alone, as a host without the driver does. */
static decided controller_round(dopt_comm *c, ctrl_kind k, const tolerances *tol, float micro[RK][RD], int local) {
    dopt_batch bc;
    dopt_batch_config cfg = ctrl_config(k, tol);
    decided out;
    float grad[RD] = {0}, params[RD] = {0};
    int j, l;
    DT_OK(dopt_batch_init(&bc, RD, &cfg));
    for (j = 0; j < RK; j++) {
        dopt_buf b = dopt_buf_flat(micro[j], RD, NULL, 0);
        DT_OK(dopt_batch_observe(&bc, &b, 1.0f));
        for (l = 0; l < RD; l++) grad[l] += micro[j][l] / RK;
    }
    if (local) {
        DT_OK(dopt_batch_decide(&bc, c));
    } else {
        dopt_dp dp;
        dopt_dp_config dcfg;
        memset(&dcfg, 0, sizeof dcfg);
        dcfg.period = 1;
        dcfg.batch = &bc;
        DT_OK(dopt_dp_init(&dp, c, RD, &dcfg));
        DT_OK(dopt_dp_after_backward(&dp, grad));
        DT_OK(dopt_dp_after_step(&dp, params));
        dopt_dp_free(&dp);
    }
    DT_EQ_INT(bc.decisions, 1);
    out.st = bc.last;
    out.units = dopt_batch_units(&bc);
    dopt_batch_free(&bc);
    return out;
}

/* ------------------------------------------------------------------ comparison */

static double normal_tail(double z) { return 0.5 * erfc(z / sqrt(2.0)); }

/* Σ(c − r)/s and Σ Var(c − r)/s² over the rounds, for one statistic, s the same statistic on the
   independent batch: each round counts alike, and the scale, independent of c − r, adds no bias. */
typedef struct bias_sum {
    double rel, var;
    int rounds;
} bias_sum;

static void bias_add(bias_sum *b, double ctrl, double ref, double scale, double var) {
    b->rel += (ctrl - ref) / scale;
    b->var += var / (scale * scale);
    b->rounds++;
}

/* Prints the mean relative bias with its derived sd; fails beyond 5 sd. */
static void bias_check(const char *what, const bias_sum *b) {
    double rel = b->rel / b->rounds, sd = sqrt(b->var) / b->rounds;
    printf("  %-26s bias %+.5f (relative), derived sd %.5f, bound ±%.5f\n", what, rel, sd, 5 * sd);
    DT_CHECKF(fabs(rel) <= 5.0 * sd, "%s: bias %g relative, beyond 5 sd (%g)", what, rel, 5 * sd);
}

/* Decision agreement for one test: observed disagreements and their expectation. */
typedef struct agreement {
    int rounds, differ, far, ref_grew;
    double p, p_var, q, q_var; /* Σp, Σp(1 − p): grow-or-keep; Σq, Σq(1 − q): next batch beyond ×2 */
} agreement;

/* The probability that the controller's next batch is beyond a factor 2 of the paper's, at most:
   the next batch of each is the larger of the current one and its b_needed, the controller's
   rounded up to whole units of workers·u samples (at most ×(1 + workers·u/batch) = ×1.25). Above:
   need_c > 2·next_r/1.25; below (only when need_r > 2·batch): need_c < need_r/2. */
static double beyond_twice(double need_r, double batch, double s) {
    double next_r = need_r > batch ? need_r : batch;
    double q = normal_tail((log(2.0 * next_r / need_r) - log(1.25)) / s);
    return need_r > 2.0 * batch ? q + normal_tail(log(2.0) / s) : q;
}

/* The controller's next units (units_c, for `workers` ranks) against the paper's b_needed (need_r,
   compared with `batch` samples); s the sd of log(need_c/need_r). */
static void agreement_add(agreement *a, size_t units_c, int workers, double need_r, double batch, double s) {
    double m = log(need_r / batch), p = normal_tail(fabs(m) / s), q = beyond_twice(need_r, batch, s);
    double next_c = (double)units_c * RU * workers, next_r = need_r > batch ? need_r : batch;
    int grew_c = units_c > RK, grew_r = need_r > batch;
    a->rounds++;
    a->differ += grew_c != grew_r;
    a->far += !(next_c <= 2.0 * next_r && next_c >= 0.5 * next_r);
    a->ref_grew += grew_r;
    a->p += p;
    a->p_var += p * (1.0 - p);
    a->q += q;
    a->q_var += q * (1.0 - q);
}

static void agreement_check(const char *what, const agreement *a) {
    double n = a->rounds, slack = 0.02 * n;
    double differ_max = a->p + 5.0 * sqrt(a->p_var) + slack, far_max = a->q + 5.0 * sqrt(a->q_var) + slack;
    printf("  %-26s grow-or-keep agree %.3f (predicted %.3f, bound ≥ %.3f); next batch within ×2 %.3f (predicted %.3f, "
           "bound ≥ %.3f); the paper grew in %.2f of %d rounds\n",
           what, 1.0 - a->differ / n, 1.0 - a->p / n, 1.0 - differ_max / n, 1.0 - a->far / n, 1.0 - a->q / n,
           1.0 - far_max / n, a->ref_grew / n, a->rounds);
    DT_CHECKF(a->ref_grew >= 0.2 * n && a->ref_grew <= 0.8 * n,
              "%s: the paper grew in %d of %d rounds: no test of agreement", what, a->ref_grew, a->rounds);
    DT_CHECKF(a->differ <= differ_max, "%s: %d decisions differ, at most %.1f expected", what, a->differ, differ_max);
    DT_CHECKF(a->far <= far_max, "%s: %d next batches beyond ×2, at most %.1f expected", what, a->far, far_max);
}

/* ------------------------------------------------------------------ the rounds */

/* A model and a kind of round, with tolerances that put the paper's threshold at the median
   round's b_needed for the norm test and the orthogonality test, and at the 70th percentile for
   the inner-product test: the reference grows in about half the rounds (30% for the inner
   product), and the augmented test's answer is mostly its orthogonality part's (a controller that
   dropped that part shows). */
typedef struct ref_case {
    model_kind model;
    int local;
    const char *name;
    tolerances tol;
} ref_case;

/* The variance coefficients of the derivation for this world and kind of round. */
typedef struct coefs {
    double stat;    /* Var(Δstat) = 2·(its tr Σ²)·stat */
    double g2;      /* Var(Δg) = 2 tr Σ² · g2 */
    double stat_g2; /* Cov(Δstat, Δg) = 2·(its cross moment)·stat_g2 */
    double batch;   /* the samples the reference compares with */
    int workers;    /* ranks the update averages over */
} coefs;

static coefs round_coefs(int nranks, int local) {
    double N = nranks, n = N * RB, dc = N * (RK - 1), dr = local ? N * (RB - 1) : n - 1;
    coefs c;
    c.stat = 1.0 / dc - 1.0 / dr;
    c.g2 = 0.0; /* ‖g_B‖² is the reference's own, synchronous or local (float rounding aside) */
    c.stat_g2 = 0.0;
    c.batch = local ? RB : n;
    c.workers = local ? 1 : nranks;
    return c;
}

/* s² of log(need_c/need_r) for a statistic x with noise moment t2x and cross moment cx. */
static double log_ratio_var(const coefs *k, const paper *r, double x, double t2x, double cx) {
    return 2.0 * (t2x * k->stat / (x * x) + r->t2 * k->g2 / (r->g2 * r->g2) - 2.0 * cx * k->stat_g2 / (x * r->g2));
}

typedef struct tally {
    bias_sum var, g2, ip, orth;
    agreement norm, ip_test, aug;
} tally;

/* One round's comparison: the controller's statistics and decisions against the paper's (r), each
   difference scaled by, and its variance taken from, the independent batch (s). */
static void tally_round(tally *t, const coefs *k, const tolerances *tol, const paper *r, const paper *s,
                        const decided d[C_COUNT]) {
    const dopt_batch_stats *st = &d[C_NORM].st;
    double ip_need = r->ip / (tol->theta * tol->theta), orth_need = r->orth / (tol->nu * tol->nu), s_norm, s_ip, s_orth;
    int w = k->workers;
    bias_add(&t->var, st->var, r->var, s->var, 2.0 * s->t2 * k->stat);
    bias_add(&t->g2, st->grad_norm2, r->g2, s->g2, 2.0 * s->t2 * k->g2);
    bias_add(&t->ip, st->ip_var, r->ip, s->ip, 2.0 * s->t2_ip * k->stat);
    bias_add(&t->orth, st->orth_var, r->orth, s->orth, 2.0 * s->t2_orth * k->stat);
    s_norm = sqrt(log_ratio_var(k, r, r->var, r->t2, r->t2));
    s_ip = sqrt(log_ratio_var(k, r, r->ip, r->t2_ip, r->c_ip));
    s_orth = sqrt(log_ratio_var(k, r, r->orth, r->t2_orth, r->c_orth));
    agreement_add(&t->norm, d[C_NORM].units, w, r->var / (tol->eta * tol->eta * r->g2), k->batch, s_norm);
    agreement_add(&t->ip_test, d[C_IP].units, w, ip_need / r->g2, k->batch, s_ip);
    agreement_add(&t->aug, d[C_AUG].units, w, (ip_need > orth_need ? ip_need : orth_need) / r->g2, k->batch,
                  ip_need > orth_need ? s_ip : s_orth);
}

static void tally_report(const tally *t, const ref_case *rc, int nranks) {
    printf("  %s, %d ranks, %d rounds of %d micro-batches of %d samples per rank:\n", rc->name, nranks, ROUNDS, RK, RU);
    bias_check("var", &t->var);
    { /* local: the workers' mean ‖g_B,m‖²; synchronous: ‖ḡ‖² of the global mean (the driver's) */
        double rel = t->g2.rel / t->g2.rounds;
        printf("  %-26s bias %+.2e (relative; float rounding of the micro-batch means), bound ±1e-05\n", "grad_norm2",
               rel);
        DT_CHECKF(fabs(rel) <= 1e-5, "grad_norm2: %g relative off the reference's ‖g_B‖² (%s)", rel,
                  rc->local ? "the workers' mean" : "the global mean");
    }
    bias_check("ip_var", &t->ip);
    bias_check("orth_var", &t->orth);
    agreement_check("norm test", &t->norm);
    agreement_check("inner-product test", &t->ip_test);
    agreement_check("augmented test", &t->aug);
}

/* ------------------------------------------------------------------ least squares: ‖∇F‖² known */

/* The bias-corrected and the plain estimate's deviations from their expectations, relative to
   ‖∇F‖², each round weighted by the inverse of the corrected estimate's variance (a function of
   the round's parameters alone, so the weights add no bias): Σw·dev, Σw²·Var(dev), Σw. */
typedef struct truth_sum {
    double corrected, corrected_var, plain, plain_var, weight;
} truth_sum;

/* Least squares at a = w − w*: tr Σ, tr Σ², aᵀΣa in closed form; Var‖e‖² from the samples. */
static void truth_add(truth_sum *t, int round, int nranks, const decided *plain, const decided *corrected) {
    static double g[RN_MAX * RB][RD];
    point p = round_point(LEAST_SQUARES, round, 0, 0);
    double a[RD], a2, s, tr, tr2, aSa, n = (double)nranks * RB, dc = nranks * (RK - 1.0), m4 = 0.0, sd_c, sd_v, w;
    int i, r;
    for (i = 0; i < RD; i++) a[i] = p.w[i] - p.wstar[i];
    a2 = dot(a, a);
    s = a2 + p.sigma * p.sigma;
    tr = RD * s + a2;
    tr2 = RD * s * s + 2.0 * s * a2 + a2 * a2;
    aSa = s * a2 + a2 * a2;
    for (r = 0; r < nranks; r++) rank_grads(LEAST_SQUARES, round, r, 0, SEEN, g + r * RB);
    for (i = 0; i < nranks * RB; i++) {
        double e[RD], dev;
        int j;
        for (j = 0; j < RD; j++) e[j] = g[i][j] - a[j];
        dev = dot(e, e) - tr;
        m4 += dev * dev / n;
    }
    sd_c = sqrt(4.0 * aSa / n + 2.0 * tr2 * (1.0 + 1.0 / dc) / (n * n)) / a2;
    sd_v = sqrt((m4 - 2.0 * tr2) / n + 2.0 * tr2 / dc) / n / a2;
    w = 1.0 / (sd_c * sd_c);
    t->corrected += w * (corrected->st.grad_norm2 - a2) / a2;
    t->corrected_var += w * w * sd_c * sd_c;
    t->plain += w * (plain->st.grad_norm2 - a2 - tr / n) / a2;
    t->plain_var += w * w * (sd_c + sd_v) * (sd_c + sd_v);
    t->weight += w;
}

static void truth_report(const truth_sum *t, int nranks) {
    double corrected = t->corrected / t->weight, sd_c = sqrt(t->corrected_var) / t->weight;
    double plain = t->plain / t->weight, sd_p = sqrt(t->plain_var) / t->weight;
    printf("  ‖∇F‖² known (relative to it, weighted): bias-corrected %+.5f, derived sd %.5f, bound ±%.5f; plain "
           "minus τ²/(W·k) %+.5f, sd %.5f, bound ±%.5f (W = %d)\n",
           corrected, sd_c, 5 * sd_c, plain, sd_p, 5 * sd_p, nranks);
    DT_CHECKF(fabs(corrected) <= 5.0 * sd_c, "bias-corrected ‖∇F‖²: %g relative, beyond 5 sd (%g)", corrected,
              5 * sd_c);
    DT_CHECKF(fabs(plain) <= 5.0 * sd_p, "plain ‖∇F‖² minus τ²/(W·k): %g relative, beyond 5 sd (%g)", plain, 5 * sd_p);
}

/* Every rank runs the controllers on its micro-batches; rank 0 also evaluates the reference on
   every rank's samples (regenerated from the same counters) and compares. */
static void body_reference(dopt_comm *c, void *arg) {
    const ref_case *rc = (const ref_case *)arg;
    static double g[RB][RD];
    float micro[RK][RD];
    coefs k = round_coefs(c->size, rc->local);
    tally t;
    truth_sum truth;
    int round, kind;
    DT_CHECK(c->size <= RN_MAX);
    memset(&t, 0, sizeof t);
    memset(&truth, 0, sizeof truth);
    for (round = 0; round < ROUNDS; round++) {
        decided d[C_COUNT];
        rank_grads(rc->model, round, c->rank, rc->local, SEEN, g);
        micro_means(g, micro);
        for (kind = 0; kind < C_COUNT; kind++)
            d[kind] = controller_round(c, (ctrl_kind)kind, &rc->tol, micro, rc->local);
        DT_NEAR(d[C_NORM].st.workers, rc->local ? 1 : c->size, 0);
        if (c->rank != 0) continue;
        {
            paper r = paper_round(rc->model, round, c->size, rc->local, SEEN);
            paper s = paper_round(rc->model, round, c->size, rc->local, SCALE);
            tally_round(&t, &k, &rc->tol, &r, &s, d);
        }
        if (rc->model == LEAST_SQUARES && !rc->local)
            truth_add(&truth, round, c->size, &d[C_NORM], &d[C_NORM_CORRECTED]);
    }
    if (c->rank != 0) return;
    tally_report(&t, rc, c->size);
    if (rc->model == LEAST_SQUARES && !rc->local) truth_report(&truth, c->size);
}

static const ref_case reference_cases[] = {
    {LEAST_SQUARES, 0, "least squares, synchronous", {0.42, 0.25, 0.38}},
    {LEAST_SQUARES, 1, "least squares, local", {0.62, 0.35, 0.54}},
    {LOGISTIC, 0, "logistic regression, synchronous", {0.74, 0.37, 0.68}},
    {LOGISTIC, 1, "logistic regression, local", {0.86, 0.42, 0.76}},
};

/* The round's sums pooled over 3 ranks by the real allreduce, on every transport. */
DTEST_WORLDS_EACH(controller_agrees_with_the_papers_tests_from_per_sample_gradients, body_reference, reference_cases, 3,
                  3);

/* ------------------------------------------------------------------ answers known in advance */

/* η = θ = ν = 0.1, the reference code's defaults. */
static const tolerances reference_defaults = {0.1, 0.1, 0.1};

/* No noise: within a step every sample's gradient is the same vector, so every micro-batch mean
   is too, while the vector moves far between the round's 3 steps (the parameters move). The
   paper's variance is 0 and no test asks for more samples: the controller keeps the size, in
   every test, with the plain and the bias-corrected ‖∇F‖², on synchronous and local rounds, and
   its ‖∇F‖² is the mean of the steps' ‖g‖² (nothing to subtract). */
DTEST(no_noise_never_grows) {
    dopt_rng r = stream(3);
    int round, kind, local, t, j, l;
    for (round = 0; round < 100; round++)
        for (local = 0; local < 2; local++)
            for (kind = 0; kind < C_COUNT; kind++) {
                dopt_batch bc;
                dopt_batch_config cfg = ctrl_config((ctrl_kind)kind, &reference_defaults);
                double norm2 = 0.0;
                DT_OK(dopt_batch_init(&bc, RD, &cfg));
                for (t = 0; t < 3; t++) {
                    double v[RD];
                    float micro[RD];
                    dopt_buf b = dopt_buf_flat(micro, RD, NULL, 0);
                    normals(&r, ((uint64_t)round * 3 + (uint64_t)t) * 64, v, RD);
                    for (l = 0; l < RD; l++) micro[l] = (float)(v[l] * exp(4.0 * t));
                    for (l = 0; l < RD; l++) norm2 += (double)micro[l] * (double)micro[l] / 3.0;
                    for (j = 0; j < RK; j++) DT_OK(dopt_batch_observe(&bc, &b, 1.0f));
                    if (!local) dopt_batch_averaged(&bc, 3);
                    dopt_batch_end_step(&bc);
                }
                DT_OK(dopt_batch_decide(&bc, NULL));
                DT_EQ_INT(dopt_batch_units(&bc), RK);
                DT_CHECKF(bc.last.var <= 1e-12 * bc.last.grad_norm2, "var %g with no noise", bc.last.var);
                DT_NEAR(bc.last.grad_norm2 / norm2, 1.0, 1e-9);
                dopt_batch_free(&bc);
            }
}

/* Pure noise: least squares at its optimum (∇F = 0) with label noise; a local round's ‖g_B‖² is
   then the noise of the batch mean alone, tr Σ/b up to a χ²_D/D factor, and the norm test asks
   for b·(D/χ²_D)/η² samples: at η = 0.1, 100 times the batch give or take that factor, never
   below 10 times (χ²_8 > 80 has probability 1e-13). Reference and controller both. */
DTEST(pure_noise_asks_for_many_times_the_batch) {
    static double g[RB][RD];
    float micro[RK][RD];
    int round;
    for (round = 0; round < 100; round++) {
        dopt_batch bc;
        dopt_batch_config cfg = ctrl_config(C_NORM, &reference_defaults);
        point p = round_point(LEAST_SQUARES, round, 0, 0);
        paper r;
        double need;
        int i, j;
        memcpy(p.w, p.wstar, sizeof p.w);
        p.sigma = 1.0;
        for (i = 0; i < RB; i++) sample_grad(LEAST_SQUARES, &p, round, 0, i, SEEN, g[i]);
        r = paper_stats(g, RB);
        micro_means(g, micro);
        DT_OK(dopt_batch_init(&bc, RD, &cfg));
        for (j = 0; j < RK; j++) {
            dopt_buf b = dopt_buf_flat(micro[j], RD, NULL, 0);
            DT_OK(dopt_batch_observe(&bc, &b, 1.0f));
        }
        DT_OK(dopt_batch_decide(&bc, NULL));
        dopt_batch_next_units(&bc.cfg, RK, &bc.last, &need);
        DT_CHECKF(r.var / (0.01 * r.g2) >= 10.0 * RB, "the paper asks for %g samples", r.var / (0.01 * r.g2));
        DT_CHECKF(need >= 10.0 * RB, "round %d: the controller asks for %g samples", round, need);
        DT_CHECK(dopt_batch_units(&bc) >= 10 * RK);
        dopt_batch_free(&bc);
    }
}

DTEST_MAIN()
