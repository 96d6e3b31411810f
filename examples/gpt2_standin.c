/* gpt2_standin.c — a tiny GPT-2 trained data-parallel: a stand-in, owned by this repository, for
   llm.c's train_gpt2.c (Andrej Karpathy, MIT licence), to show distopt dropped into a loop of
   that shape. It keeps llm.c's structure and names: a GPT2 struct whose ParameterTensors (the 16
   tensors wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw,
   fcprojb, lnfw, lnfb) point into one flat params_memory of num_parameters floats, the same for
   grads_memory, AdamW moments allocated at the first gpt2_update, the layernorm, matmul,
   attention, GELU, residual, softmax and cross-entropy kernels with their backward passes
   (OpenMP-parallel where llm.c's are), and llm.c's main loop: every 10 steps the validation loss
   over val_num_batches batches of its own loader, every 20 steps a sample of generated tokens
   (sample_mult over the last position's probabilities), then dataloader_next_batch,
   gpt2_forward, gpt2_zero_grad, gpt2_backward, gpt2_update, a printf of the loss.

   What it leaves out: the checkpoint (the parameters start random from a fixed seed), the
   tokenizer (samples are printed as token numbers), the per-step timing (one line of medians at
   the end instead), and the size: by default one layer of 32 channels and 4 heads over a
   vocabulary of 64 and 32 positions, 4 sequences per step, 15840 parameters; 300 steps take
   about a second on one core. The tokens come from a seeded Markov
   chain in which every token has 4 possible successors, of probabilities 0.5, 0.25, 0.15 and
   0.1: no file is needed, the loss starts at ln 64 = 4.16 and cannot fall below the chain's
   entropy, 1.21.

       cc -std=c11 -O2 -fopenmp -I. -o gpt2_standin examples/gpt2_standin.c -lm -lpthread -lrt
       ./gpt2_standin                                        one process
       DOPT_WORLD_SIZE=2 OMP_NUM_THREADS=1 ./gpt2_standin    two ranks forked over shared memory
       mpirun -n 2 -x OMP_NUM_THREADS=1 ./gpt2_standin       (srun, torchrun, ...: see launch.h)
       ./gpt2_standin --gradcheck                            gpt2_backward against finite differences
   Flags: --steps N (default 300); --gradcheck; --desync: rank 1 changes one parameter before the
   end, so that the replica check fails (for tests); --nan-at K: the last rank's gradient holds a
   NaN at step K, so that the driver stops and the job ends with status 1 (for tests); --overlap
   on|off (default off): gpt2_backward marks each layer's gradients final as it finishes them, so
   that the driver averages them while backward goes on (the same numbers); --layers L (1),
   --channels C (32, a multiple of the 4 heads), --batch B (4), --seq T (32): the model's and the
   step's size (bench/overlap.sh runs larger ones); --period I (1): local SGD, the models averaged
   every I steps (the gradients are then not averaged: a long period times the compute alone).
   At the end rank 0 prints the timing line the overlap benchmark parses. Give each
   rank one OpenMP thread per core it may use: threads beyond the free cores spin at every
   parallel loop's barrier.

   The lines marked distopt are all that distopt adds or changes: synchronous data parallelism,
   ten core lines (scripts/count-lines.sh counts them; tests/check_gpt2_standin.sh runs all
   this). The start (declarations, the communicator from the launcher's variables, the driver,
   which broadcasts rank 0's parameters), each loader's shard (rank r takes batches r, r + size,
   ...: the training and the validation loader), the gradient average after every gpt2_backward
   (the replicas then stay bitwise identical: each rank applies the same AdamW update to the same
   gradient), the printed losses as means over the ranks (the training loss and the validation
   loss), the closing call, and the changed return. No print is guarded by a rank: every rank
   prints the same lines (the losses are the same means, the samples come from identical models
   and generators), and DOPT_STDOUT_RANKS=0 keeps rank 0's stdout alone (launch.h). No status is
   checked inside the loop: a communicator that failed makes every later call return at once,
   and dopt_dp_close returns its status, which dopt_comm_finish prints and turns into the exit
   status; a NaN in one rank's gradient is such a failure (the driver stops at that step on every
   rank). The unmarked lines --nan-at, --desync and the "result:" line are test harness; without
   them the end would be return dopt_comm_finish(comm, dopt_dp_close(&dp, model.params_memory))
   before the frees, which llm.c's order (frees, then return 0) makes two lines. */
#define DISTOPT_IMPLEMENTATION /* distopt */
#include "transport_shm.h"     /* distopt: DOPT_WORLD_SIZE=N forks N ranks over shared memory */
#include "transport_tcp.h"     /* distopt: launchers across hosts */
#include "launch.h"            /* distopt */
#include "localsgd.h"          /* distopt: the data-parallel driver, dopt_dp */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ----------------------------------------------------------------------------------------------
   The layers, forward and backward. Activations are (B, T, C) row-major; a backward pass adds
   its gradients into the arrays it is given (gpt2_zero_grad clears them), as llm.c's do. */

/* out[b,t,:] = wte[inp[b,t],:] + wpe[t,:] */
static void encoder_forward(float *out, const int *inp, const float *wte, const float *wpe, int B, int T, int C) {
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            float *out_bt = out + ((size_t)b * T + t) * C;
            const float *wte_ix = wte + (size_t)inp[b * T + t] * C;
            const float *wpe_t = wpe + (size_t)t * C;
            for (int i = 0; i < C; i++) out_bt[i] = wte_ix[i] + wpe_t[i];
        }
    }
}

static void encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp, int B, int T, int C) {
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            const float *dout_bt = dout + ((size_t)b * T + t) * C;
            float *dwte_ix = dwte + (size_t)inp[b * T + t] * C;
            float *dwpe_t = dwpe + (size_t)t * C;
            for (int i = 0; i < C; i++) {
                dwte_ix[i] += dout_bt[i];
                dwpe_t[i] += dout_bt[i];
            }
        }
    }
}

/* Normalises each position's C channels to mean 0 and variance 1, then scales and shifts them;
   keeps the mean and the reciprocal standard deviation for the backward pass. */
static void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                              const float *bias, int B, int T, int C) {
    const float eps = 1e-5f;
    for (int bt = 0; bt < B * T; bt++) {
        const float *x = inp + (size_t)bt * C;
        float *y = out + (size_t)bt * C;
        float m = 0.0f, v = 0.0f;
        for (int i = 0; i < C; i++) m += x[i];
        m /= (float)C;
        for (int i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
        v /= (float)C;
        float s = 1.0f / sqrtf(v + eps);
        for (int i = 0; i < C; i++) y[i] = s * (x[i] - m) * weight[i] + bias[i];
        mean[bt] = m;
        rstd[bt] = s;
    }
}

static void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                               const float *weight, const float *mean, const float *rstd, int B, int T, int C) {
    for (int bt = 0; bt < B * T; bt++) {
        const float *dy = dout + (size_t)bt * C;
        const float *x = inp + (size_t)bt * C;
        float *dx = dinp + (size_t)bt * C;
        float m = mean[bt], s = rstd[bt];
        /* the two reductions of the normalisation's gradient */
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (int i = 0; i < C; i++) {
            float norm = (x[i] - m) * s;
            float dnorm = weight[i] * dy[i];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= (float)C;
        dnorm_norm_mean /= (float)C;
        for (int i = 0; i < C; i++) {
            float norm = (x[i] - m) * s;
            float dnorm = weight[i] * dy[i];
            dbias[i] += dy[i];
            dweight[i] += norm * dy[i];
            dx[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    }
}

/* out (B,T,OC) = inp (B,T,C) · weightᵀ (weight is OC × C) + bias (OC; NULL: none) */
static void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int B, int T, int C,
                           int OC) {
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            const float *x = inp + ((size_t)b * T + t) * C;
            float *y = out + ((size_t)b * T + t) * OC;
            for (int o = 0; o < OC; o++) {
                const float *w = weight + (size_t)o * C;
                float acc = bias ? bias[o] : 0.0f;
                for (int i = 0; i < C; i++) acc += x[i] * w[i];
                y[o] = acc;
            }
        }
    }
}

/* Two loops so that each thread owns what it writes: positions for dinp, output rows for dweight
   and dbias (the results do not depend on the number of threads). */
static void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                            const float *weight, int B, int T, int C, int OC) {
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            const float *dy = dout + ((size_t)b * T + t) * OC;
            float *dx = dinp + ((size_t)b * T + t) * C;
            for (int o = 0; o < OC; o++) {
                const float *w = weight + (size_t)o * C;
                for (int i = 0; i < C; i++) dx[i] += w[i] * dy[o];
            }
        }
    }
#pragma omp parallel for
    for (int o = 0; o < OC; o++) {
        float *dw = dweight + (size_t)o * C;
        for (int bt = 0; bt < B * T; bt++) {
            const float *x = inp + (size_t)bt * C;
            float d = dout[(size_t)bt * OC + o];
            if (dbias) dbias[o] += d;
            for (int i = 0; i < C; i++) dw[i] += x[i] * d;
        }
    }
}

/* Causal self-attention over inp (B,T,3C) holding the queries, keys and values of NH heads;
   preatt and att (B,NH,T,T) keep the scores before and after the softmax; out is (B,T,C). */
static void attention_forward(float *out, float *preatt, float *att, const float *inp, int B, int T, int C, int NH) {
    int C3 = 3 * C, hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < NH; h++) {
                const float *q = inp + ((size_t)b * T + t) * C3 + h * hs;
                float *preatt_bth = preatt + (((size_t)b * NH + h) * T + t) * T;
                float *att_bth = att + (((size_t)b * NH + h) * T + t) * T;
                float maxval = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = inp + ((size_t)b * T + t2) * C3 + h * hs + C;
                    float v = 0.0f;
                    for (int i = 0; i < hs; i++) v += q[i] * k[i];
                    v *= scale;
                    preatt_bth[t2] = v;
                    if (v > maxval) maxval = v;
                }
                float expsum = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    float e = expf(preatt_bth[t2] - maxval);
                    att_bth[t2] = e;
                    expsum += e;
                }
                for (int t2 = 0; t2 < T; t2++) att_bth[t2] = t2 <= t ? att_bth[t2] / expsum : 0.0f;
                float *out_bth = out + ((size_t)b * T + t) * C + h * hs;
                for (int i = 0; i < hs; i++) out_bth[i] = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *v = inp + ((size_t)b * T + t2) * C3 + h * hs + 2 * C;
                    for (int i = 0; i < hs; i++) out_bth[i] += att_bth[t2] * v[i];
                }
            }
        }
    }
}

/* Serial, as llm.c's: the gradients of keys and values gather from every later position. */
static void attention_backward(float *dinp, float *dpreatt, float *datt, const float *dout, const float *inp,
                               const float *att, int B, int T, int C, int NH) {
    int C3 = 3 * C, hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < NH; h++) {
                const float *att_bth = att + (((size_t)b * NH + h) * T + t) * T;
                float *datt_bth = datt + (((size_t)b * NH + h) * T + t) * T;
                float *dpreatt_bth = dpreatt + (((size_t)b * NH + h) * T + t) * T;
                const float *q = inp + ((size_t)b * T + t) * C3 + h * hs;
                float *dq = dinp + ((size_t)b * T + t) * C3 + h * hs;
                const float *dout_bth = dout + ((size_t)b * T + t) * C + h * hs;
                for (int t2 = 0; t2 <= t; t2++) { /* out = att · v */
                    const float *v = inp + ((size_t)b * T + t2) * C3 + h * hs + 2 * C;
                    float *dv = dinp + ((size_t)b * T + t2) * C3 + h * hs + 2 * C;
                    for (int i = 0; i < hs; i++) {
                        datt_bth[t2] += v[i] * dout_bth[i];
                        dv[i] += att_bth[t2] * dout_bth[i];
                    }
                }
                for (int t2 = 0; t2 <= t; t2++) /* the softmax's Jacobian: att2 (δ23 − att3) */
                    for (int t3 = 0; t3 <= t; t3++)
                        dpreatt_bth[t3] += att_bth[t2] * ((t2 == t3) - att_bth[t3]) * datt_bth[t2];
                for (int t2 = 0; t2 <= t; t2++) { /* preatt = q · k · scale */
                    const float *k = inp + ((size_t)b * T + t2) * C3 + h * hs + C;
                    float *dk = dinp + ((size_t)b * T + t2) * C3 + h * hs + C;
                    for (int i = 0; i < hs; i++) {
                        dq[i] += k[i] * dpreatt_bth[t2] * scale;
                        dk[i] += q[i] * dpreatt_bth[t2] * scale;
                    }
                }
            }
        }
    }
}

/* GELU, tanh approximation (GPT-2's): 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))) */
#define GELU_SCALING_FACTOR 0.7978845608f

static void gelu_forward(float *out, const float *inp, size_t N) {
    for (size_t i = 0; i < N; i++) {
        float x = inp[i];
        out[i] = 0.5f * x * (1.0f + tanhf(GELU_SCALING_FACTOR * (x + 0.044715f * x * x * x)));
    }
}

static void gelu_backward(float *dinp, const float *inp, const float *dout, size_t N) {
    for (size_t i = 0; i < N; i++) {
        float x = inp[i];
        float th = tanhf(GELU_SCALING_FACTOR * (x + 0.044715f * x * x * x));
        float sech2 = 1.0f - th * th;
        float local = 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_SCALING_FACTOR * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] += local * dout[i];
    }
}

static void residual_forward(float *out, const float *inp1, const float *inp2, size_t N) {
    for (size_t i = 0; i < N; i++) out[i] = inp1[i] + inp2[i];
}

static void residual_backward(float *dinp1, float *dinp2, const float *dout, size_t N) {
    for (size_t i = 0; i < N; i++) {
        dinp1[i] += dout[i];
        dinp2[i] += dout[i];
    }
}

static void softmax_forward(float *probs, const float *logits, int B, int T, int V) {
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            const float *z = logits + ((size_t)b * T + t) * V;
            float *p = probs + ((size_t)b * T + t) * V;
            float maxval = -INFINITY, sum = 0.0f;
            for (int i = 0; i < V; i++)
                if (z[i] > maxval) maxval = z[i];
            for (int i = 0; i < V; i++) {
                p[i] = expf(z[i] - maxval);
                sum += p[i];
            }
            for (int i = 0; i < V; i++) p[i] /= sum;
        }
    }
}

static void crossentropy_forward(float *losses, const float *probs, const int *targets, int B, int T, int V) {
    for (int bt = 0; bt < B * T; bt++) losses[bt] = -logf(probs[(size_t)bt * V + targets[bt]]);
}

/* The softmax and the cross-entropy together: d loss / d logit_i = (p_i − [i = target]) · dloss. */
static void crossentropy_softmax_backward(float *dlogits, const float *dlosses, const float *probs, const int *targets,
                                          int B, int T, int V) {
    for (int bt = 0; bt < B * T; bt++) {
        const float *p = probs + (size_t)bt * V;
        float *dz = dlogits + (size_t)bt * V;
        for (int i = 0; i < V; i++) dz[i] += (p[i] - (i == targets[bt])) * dlosses[bt];
    }
}

/* ----------------------------------------------------------------------------------------------
   The model: llm.c's GPT2, its flat parameter and activation arrays, forward, backward, update. */

typedef struct {
    int max_seq_len; /* positions, maxT */
    int vocab_size;  /* V */
    int num_layers;  /* L */
    int num_heads;   /* NH */
    int channels;    /* C */
} GPT2Config;

#define NUM_PARAMETER_TENSORS 16
typedef struct {
    float *wte;      /* (V, C), also the output projection (tied) */
    float *wpe;      /* (maxT, C) */
    float *ln1w;     /* (L, C) */
    float *ln1b;     /* (L, C) */
    float *qkvw;     /* (L, 3C, C) */
    float *qkvb;     /* (L, 3C) */
    float *attprojw; /* (L, C, C) */
    float *attprojb; /* (L, C) */
    float *ln2w;     /* (L, C) */
    float *ln2b;     /* (L, C) */
    float *fcw;      /* (L, 4C, C) */
    float *fcb;      /* (L, 4C) */
    float *fcprojw;  /* (L, C, 4C) */
    float *fcprojb;  /* (L, C) */
    float *lnfw;     /* (C) */
    float *lnfb;     /* (C) */
} ParameterTensors;

static const char *const parameter_names[NUM_PARAMETER_TENSORS] = {
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
    "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"};

static void fill_in_parameter_sizes(size_t *param_sizes, GPT2Config config) {
    size_t V = (size_t)config.vocab_size, C = (size_t)config.channels;
    size_t maxT = (size_t)config.max_seq_len, L = (size_t)config.num_layers;
    param_sizes[0] = V * C;
    param_sizes[1] = maxT * C;
    param_sizes[2] = L * C;
    param_sizes[3] = L * C;
    param_sizes[4] = L * (3 * C) * C;
    param_sizes[5] = L * (3 * C);
    param_sizes[6] = L * C * C;
    param_sizes[7] = L * C;
    param_sizes[8] = L * C;
    param_sizes[9] = L * C;
    param_sizes[10] = L * (4 * C) * C;
    param_sizes[11] = L * (4 * C);
    param_sizes[12] = L * C * (4 * C);
    param_sizes[13] = L * C;
    param_sizes[14] = C;
    param_sizes[15] = C;
}

static void *calloc_or_die(size_t count, size_t size) {
    void *p = calloc(count, size);
    if (p == NULL) {
        fprintf(stderr, "gpt2_standin: out of memory (%zu × %zu bytes)\n", count, size);
        exit(1);
    }
    return p;
}

/* One array for all the tensors; the struct's pointers point into it, in the table's order. */
static float *malloc_and_point_parameters(ParameterTensors *params, const size_t *param_sizes) {
    size_t num_parameters = 0;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) num_parameters += param_sizes[i];
    float *params_memory = calloc_or_die(num_parameters, sizeof(float));
    float **ptrs[NUM_PARAMETER_TENSORS] = {
        &params->wte,  &params->wpe,  &params->ln1w, &params->ln1b,    &params->qkvw,    &params->qkvb,
        &params->attprojw, &params->attprojb, &params->ln2w, &params->ln2b, &params->fcw, &params->fcb,
        &params->fcprojw, &params->fcprojb, &params->lnfw, &params->lnfb};
    float *iter = params_memory;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        *ptrs[i] = iter;
        iter += param_sizes[i];
    }
    return params_memory;
}

#define NUM_ACTIVATION_TENSORS 23
typedef struct {
    float *encoded;   /* (B, T, C) */
    float *ln1;       /* (L, B, T, C) */
    float *ln1_mean;  /* (L, B, T) */
    float *ln1_rstd;  /* (L, B, T) */
    float *qkv;       /* (L, B, T, 3C) */
    float *atty;      /* (L, B, T, C) */
    float *preatt;    /* (L, B, NH, T, T) */
    float *att;       /* (L, B, NH, T, T) */
    float *attproj;   /* (L, B, T, C) */
    float *residual2; /* (L, B, T, C) */
    float *ln2;       /* (L, B, T, C) */
    float *ln2_mean;  /* (L, B, T) */
    float *ln2_rstd;  /* (L, B, T) */
    float *fch;       /* (L, B, T, 4C) */
    float *fch_gelu;  /* (L, B, T, 4C) */
    float *fcproj;    /* (L, B, T, C) */
    float *residual3; /* (L, B, T, C) */
    float *lnf;       /* (B, T, C) */
    float *lnf_mean;  /* (B, T) */
    float *lnf_rstd;  /* (B, T) */
    float *logits;    /* (B, T, V) */
    float *probs;     /* (B, T, V) */
    float *losses;    /* (B, T) */
} ActivationTensors;

static void fill_in_activation_sizes(size_t *act_sizes, GPT2Config config, int B, int T) {
    size_t C = (size_t)config.channels, NH = (size_t)config.num_heads, L = (size_t)config.num_layers;
    size_t V = (size_t)config.vocab_size, BT = (size_t)B * (size_t)T;
    act_sizes[0] = BT * C;
    act_sizes[1] = L * BT * C;
    act_sizes[2] = L * BT;
    act_sizes[3] = L * BT;
    act_sizes[4] = L * BT * 3 * C;
    act_sizes[5] = L * BT * C;
    act_sizes[6] = L * B * NH * T * T;
    act_sizes[7] = L * B * NH * T * T;
    act_sizes[8] = L * BT * C;
    act_sizes[9] = L * BT * C;
    act_sizes[10] = L * BT * C;
    act_sizes[11] = L * BT;
    act_sizes[12] = L * BT;
    act_sizes[13] = L * BT * 4 * C;
    act_sizes[14] = L * BT * 4 * C;
    act_sizes[15] = L * BT * C;
    act_sizes[16] = L * BT * C;
    act_sizes[17] = BT * C;
    act_sizes[18] = BT;
    act_sizes[19] = BT;
    act_sizes[20] = BT * V;
    act_sizes[21] = BT * V;
    act_sizes[22] = BT;
}

static float *malloc_and_point_activations(ActivationTensors *acts, const size_t *act_sizes) {
    size_t num_activations = 0;
    for (int i = 0; i < NUM_ACTIVATION_TENSORS; i++) num_activations += act_sizes[i];
    float *acts_memory = calloc_or_die(num_activations, sizeof(float));
    float **ptrs[NUM_ACTIVATION_TENSORS] = {
        &acts->encoded,  &acts->ln1,     &acts->ln1_mean,  &acts->ln1_rstd, &acts->qkv,      &acts->atty,
        &acts->preatt,   &acts->att,     &acts->attproj,   &acts->residual2, &acts->ln2,     &acts->ln2_mean,
        &acts->ln2_rstd, &acts->fch,     &acts->fch_gelu,  &acts->fcproj,   &acts->residual3, &acts->lnf,
        &acts->lnf_mean, &acts->lnf_rstd, &acts->logits,   &acts->probs,    &acts->losses};
    float *iter = acts_memory;
    for (int i = 0; i < NUM_ACTIVATION_TENSORS; i++) {
        *ptrs[i] = iter;
        iter += act_sizes[i];
    }
    return acts_memory;
}

typedef struct {
    GPT2Config config;
    ParameterTensors params;
    size_t param_sizes[NUM_PARAMETER_TENSORS];
    float *params_memory;
    size_t num_parameters;
    ParameterTensors grads;
    float *grads_memory;
    float *m_memory; /* AdamW's moments, allocated by the first gpt2_update */
    float *v_memory;
    ActivationTensors acts;
    size_t act_sizes[NUM_ACTIVATION_TENSORS];
    float *acts_memory;
    size_t num_activations;
    ActivationTensors grads_acts;
    float *grads_acts_memory;
    int batch_size; /* the B and T of the activations, set by the first gpt2_forward */
    int seq_len;
    int *inputs;  /* the last forward's tokens, for the backward pass */
    int *targets; /* NULL after a forward without targets */
    float mean_loss; /* the last forward's mean loss; -1 without targets */
} GPT2;

/* A xorshift64* generator: the same numbers on every platform, for the parameters and the data. */
static uint32_t random_u32(uint64_t *state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1DULL) >> 32);
}

static float random_f32(uint64_t *state) { return (float)(random_u32(state) >> 8) / 16777216.0f; } /* [0, 1) */

static float random_normal(uint64_t *state) { /* Box-Muller */
    float u1 = 1.0f - random_f32(state), u2 = random_f32(state);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

/* llm.c reads GPT-2's checkpoint; this model starts as GPT-2 did: weights N(0, 0.02²), the
   projections into the residual stream N(0, (0.02/√(2L))²), biases 0, layernorm gains 1. */
static void gpt2_build_from_random(GPT2 *model, GPT2Config config, uint64_t seed) {
    memset(model, 0, sizeof *model);
    model->config = config;
    fill_in_parameter_sizes(model->param_sizes, config);
    model->num_parameters = 0;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) model->num_parameters += model->param_sizes[i];
    model->params_memory = malloc_and_point_parameters(&model->params, model->param_sizes);
    uint64_t state = seed * 2654435761ULL + 1;
    float residual_std = 0.02f / sqrtf(2.0f * (float)config.num_layers);
    float *p = model->params_memory;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        const char *name = parameter_names[i];
        int is_gain = !strcmp(name, "ln1w") || !strcmp(name, "ln2w") || !strcmp(name, "lnfw");
        int is_bias = name[strlen(name) - 1] == 'b';
        float std = !strcmp(name, "attprojw") || !strcmp(name, "fcprojw") ? residual_std : 0.02f;
        for (size_t j = 0; j < model->param_sizes[i]; j++)
            p[j] = is_gain ? 1.0f : is_bias ? 0.0f : std * random_normal(&state);
        p += model->param_sizes[i];
    }
    model->mean_loss = -1.0f;
}

/* Sets model->mean_loss when targets is not NULL. The activations are sized by the first call. */
static void gpt2_forward(GPT2 *model, const int *inputs, const int *targets, int B, int T) {
    int V = model->config.vocab_size, L = model->config.num_layers;
    int NH = model->config.num_heads, C = model->config.channels;
    for (int i = 0; i < B * T; i++) {
        if (inputs[i] < 0 || inputs[i] >= V || (targets && (targets[i] < 0 || targets[i] >= V))) {
            fprintf(stderr, "gpt2_forward: token %d out of the vocabulary\n", targets ? targets[i] : inputs[i]);
            exit(1);
        }
    }
    if (model->acts_memory == NULL) {
        model->batch_size = B;
        model->seq_len = T;
        fill_in_activation_sizes(model->act_sizes, model->config, B, T);
        model->num_activations = 0;
        for (int i = 0; i < NUM_ACTIVATION_TENSORS; i++) model->num_activations += model->act_sizes[i];
        model->acts_memory = malloc_and_point_activations(&model->acts, model->act_sizes);
        model->inputs = calloc_or_die((size_t)B * T, sizeof(int));
        model->targets = calloc_or_die((size_t)B * T, sizeof(int));
    } else if (B != model->batch_size || T != model->seq_len || T > model->config.max_seq_len) {
        fprintf(stderr, "gpt2_forward: B %d, T %d after B %d, T %d\n", B, T, model->batch_size, model->seq_len);
        exit(1);
    }
    memcpy(model->inputs, inputs, (size_t)B * T * sizeof(int));
    if (targets) memcpy(model->targets, targets, (size_t)B * T * sizeof(int));

    ParameterTensors params = model->params;
    ActivationTensors acts = model->acts;
    size_t BTC = (size_t)B * T * C;
    encoder_forward(acts.encoded, inputs, params.wte, params.wpe, B, T, C);
    for (int l = 0; l < L; l++) {
        float *residual = l == 0 ? acts.encoded : acts.residual3 + (size_t)(l - 1) * BTC;
        float *l_ln1 = acts.ln1 + l * BTC;
        float *l_ln1_mean = acts.ln1_mean + (size_t)l * B * T;
        float *l_ln1_rstd = acts.ln1_rstd + (size_t)l * B * T;
        float *l_qkv = acts.qkv + l * BTC * 3;
        float *l_atty = acts.atty + l * BTC;
        float *l_preatt = acts.preatt + (size_t)l * B * NH * T * T;
        float *l_att = acts.att + (size_t)l * B * NH * T * T;
        float *l_attproj = acts.attproj + l * BTC;
        float *l_residual2 = acts.residual2 + l * BTC;
        float *l_ln2 = acts.ln2 + l * BTC;
        float *l_ln2_mean = acts.ln2_mean + (size_t)l * B * T;
        float *l_ln2_rstd = acts.ln2_rstd + (size_t)l * B * T;
        float *l_fch = acts.fch + l * BTC * 4;
        float *l_fch_gelu = acts.fch_gelu + l * BTC * 4;
        float *l_fcproj = acts.fcproj + l * BTC;
        float *l_residual3 = acts.residual3 + l * BTC;
        layernorm_forward(l_ln1, l_ln1_mean, l_ln1_rstd, residual, params.ln1w + l * C, params.ln1b + l * C, B, T, C);
        matmul_forward(l_qkv, l_ln1, params.qkvw + (size_t)l * 3 * C * C, params.qkvb + l * 3 * C, B, T, C, 3 * C);
        attention_forward(l_atty, l_preatt, l_att, l_qkv, B, T, C, NH);
        matmul_forward(l_attproj, l_atty, params.attprojw + (size_t)l * C * C, params.attprojb + l * C, B, T, C, C);
        residual_forward(l_residual2, residual, l_attproj, BTC);
        layernorm_forward(l_ln2, l_ln2_mean, l_ln2_rstd, l_residual2, params.ln2w + l * C, params.ln2b + l * C, B, T,
                          C);
        matmul_forward(l_fch, l_ln2, params.fcw + (size_t)l * 4 * C * C, params.fcb + l * 4 * C, B, T, C, 4 * C);
        gelu_forward(l_fch_gelu, l_fch, BTC * 4);
        matmul_forward(l_fcproj, l_fch_gelu, params.fcprojw + (size_t)l * C * 4 * C, params.fcprojb + l * C, B, T,
                       4 * C, C);
        residual_forward(l_residual3, l_residual2, l_fcproj, BTC);
    }
    float *residual = acts.residual3 + (size_t)(L - 1) * BTC;
    layernorm_forward(acts.lnf, acts.lnf_mean, acts.lnf_rstd, residual, params.lnfw, params.lnfb, B, T, C);
    matmul_forward(acts.logits, acts.lnf, params.wte, NULL, B, T, C, V);
    softmax_forward(acts.probs, acts.logits, B, T, V);
    if (targets) {
        crossentropy_forward(acts.losses, acts.probs, targets, B, T, V);
        double sum = 0.0;
        for (int i = 0; i < B * T; i++) sum += acts.losses[i];
        model->mean_loss = (float)(sum / (B * T));
    } else {
        model->mean_loss = -1.0f;
    }
}

static void gpt2_zero_grad(GPT2 *model) {
    if (model->grads_memory) memset(model->grads_memory, 0, model->num_parameters * sizeof(float));
    if (model->grads_acts_memory) memset(model->grads_acts_memory, 0, model->num_activations * sizeof(float));
}

/* --overlap on: gpt2_backward hands each layer's gradients to the driver as they become final, as
   llm.c's gpt2_backward_and_reduce starts each layer's reduction, so that their average runs while
   backward goes on. The buckets' table cuts grads_memory by tensor and, for the 12 per-layer
   tensors, by layer: wte, wpe, ln1w of layer 0, of layer 1, ..., ln1b of layer 0, ..., lnfw, lnfb. */
typedef struct {
    dopt_dp *dp;
    dopt_segment *segs; /* 4 + 12 L */
    size_t num_segs;
    dopt_buf grads;     /* grads_memory cut by segs, once gpt2_backward has allocated it */
} GradReady;

static void grad_ready_init(GradReady *ready, dopt_dp *dp, const GPT2 *model) {
    size_t L = (size_t)model->config.num_layers, offset = 0;
    ready->dp = dp;
    ready->num_segs = 0;
    ready->segs = calloc_or_die(4 + 12 * L, sizeof(dopt_segment));
    for (int k = 0; k < NUM_PARAMETER_TENSORS; k++) {
        size_t parts = k >= 2 && k < 14 ? L : 1, count = model->param_sizes[k] / parts;
        for (size_t l = 0; l < parts; l++) {
            ready->segs[ready->num_segs++] = (dopt_segment){offset, count, parameter_names[k], 0};
            offset += count;
        }
    }
}

/* Tensors k and k + 1 (a weight and its bias) of layer l are final: their segments are marked. */
static void grads_ready(GradReady *ready, int L, int k, int l) {
    if (ready == NULL) return;
    for (int j = k; j <= k + 1; j++) {
        size_t seg = j < 2 ? (size_t)j : j < 14 ? 2 + (size_t)(j - 2) * L + l : 2 + 12 * (size_t)L + (j - 14);
        dopt_dp_grad_ready(ready->dp, seg); /* distopt option: its bucket may start */
    }
}

/* The gradient of the last forward's mean loss into grads_memory (allocated by the first call);
   ready (NULL: none) gets each layer's gradients as they become final. */
static void gpt2_backward(GPT2 *model, GradReady *ready) {
    if (model->mean_loss == -1.0f) {
        fprintf(stderr, "gpt2_backward: the forward pass had no targets\n");
        exit(1);
    }
    if (model->grads_memory == NULL) {
        model->grads_memory = malloc_and_point_parameters(&model->grads, model->param_sizes);
        model->grads_acts_memory = malloc_and_point_activations(&model->grads_acts, model->act_sizes);
        if (ready) { /* distopt option: the gradients exist: the buckets' descriptor */
            ready->grads = dopt_buf_flat(model->grads_memory, model->num_parameters, ready->segs, ready->num_segs); /* distopt option */
            dopt_dp_set_grads(ready->dp, &ready->grads); /* distopt option */
        } /* distopt option */
    }
    int B = model->batch_size, T = model->seq_len, V = model->config.vocab_size;
    int L = model->config.num_layers, NH = model->config.num_heads, C = model->config.channels;
    ParameterTensors params = model->params, grads = model->grads;
    ActivationTensors acts = model->acts, grads_acts = model->grads_acts;
    size_t BTC = (size_t)B * T * C;

    float dloss_mean = 1.0f / (float)(B * T); /* the loss is the mean over B × T positions */
    for (int i = 0; i < B * T; i++) grads_acts.losses[i] = dloss_mean;
    crossentropy_softmax_backward(grads_acts.logits, grads_acts.losses, acts.probs, model->targets, B, T, V);
    matmul_backward(grads_acts.lnf, grads.wte, NULL, grads_acts.logits, acts.lnf, params.wte, B, T, C, V);
    float *residual = acts.residual3 + (size_t)(L - 1) * BTC;
    float *dresidual = grads_acts.residual3 + (size_t)(L - 1) * BTC;
    layernorm_backward(dresidual, grads.lnfw, grads.lnfb, grads_acts.lnf, residual, params.lnfw, acts.lnf_mean,
                       acts.lnf_rstd, B, T, C);
    grads_ready(ready, L, 14, 0); /* distopt option: lnfw, lnfb */
    for (int l = L - 1; l >= 0; l--) {
        residual = l == 0 ? acts.encoded : acts.residual3 + (size_t)(l - 1) * BTC;
        dresidual = l == 0 ? grads_acts.encoded : grads_acts.residual3 + (size_t)(l - 1) * BTC;
        size_t lBT = (size_t)l * B * T, lBNHTT = (size_t)l * B * NH * T * T;
        /* the layer's weights and their gradients */
        float *l_ln1w = params.ln1w + l * C, *dl_ln1w = grads.ln1w + l * C, *dl_ln1b = grads.ln1b + l * C;
        float *l_qkvw = params.qkvw + (size_t)l * 3 * C * C, *dl_qkvw = grads.qkvw + (size_t)l * 3 * C * C;
        float *dl_qkvb = grads.qkvb + l * 3 * C;
        float *l_attprojw = params.attprojw + (size_t)l * C * C, *dl_attprojw = grads.attprojw + (size_t)l * C * C;
        float *dl_attprojb = grads.attprojb + l * C;
        float *l_ln2w = params.ln2w + l * C, *dl_ln2w = grads.ln2w + l * C, *dl_ln2b = grads.ln2b + l * C;
        float *l_fcw = params.fcw + (size_t)l * 4 * C * C, *dl_fcw = grads.fcw + (size_t)l * 4 * C * C;
        float *dl_fcb = grads.fcb + l * 4 * C;
        float *l_fcprojw = params.fcprojw + (size_t)l * C * 4 * C, *dl_fcprojw = grads.fcprojw + (size_t)l * C * 4 * C;
        float *dl_fcprojb = grads.fcprojb + l * C;
        /* the layer's activations and their gradients */
        float *l_ln1 = acts.ln1 + l * BTC, *dl_ln1 = grads_acts.ln1 + l * BTC;
        float *l_qkv = acts.qkv + l * BTC * 3, *dl_qkv = grads_acts.qkv + l * BTC * 3;
        float *l_atty = acts.atty + l * BTC, *dl_atty = grads_acts.atty + l * BTC;
        float *l_att = acts.att + lBNHTT, *dl_att = grads_acts.att + lBNHTT, *dl_preatt = grads_acts.preatt + lBNHTT;
        float *dl_attproj = grads_acts.attproj + l * BTC;
        float *l_residual2 = acts.residual2 + l * BTC, *dl_residual2 = grads_acts.residual2 + l * BTC;
        float *l_ln2 = acts.ln2 + l * BTC, *dl_ln2 = grads_acts.ln2 + l * BTC;
        float *l_fch = acts.fch + l * BTC * 4, *dl_fch = grads_acts.fch + l * BTC * 4;
        float *l_fch_gelu = acts.fch_gelu + l * BTC * 4, *dl_fch_gelu = grads_acts.fch_gelu + l * BTC * 4;
        float *dl_fcproj = grads_acts.fcproj + l * BTC, *dl_residual3 = grads_acts.residual3 + l * BTC;

        residual_backward(dl_residual2, dl_fcproj, dl_residual3, BTC);
        matmul_backward(dl_fch_gelu, dl_fcprojw, dl_fcprojb, dl_fcproj, l_fch_gelu, l_fcprojw, B, T, 4 * C, C);
        grads_ready(ready, L, 12, l); /* distopt option: fcprojw, fcprojb */
        gelu_backward(dl_fch, l_fch, dl_fch_gelu, BTC * 4);
        matmul_backward(dl_ln2, dl_fcw, dl_fcb, dl_fch, l_ln2, l_fcw, B, T, C, 4 * C);
        grads_ready(ready, L, 10, l); /* distopt option: fcw, fcb */
        layernorm_backward(dl_residual2, dl_ln2w, dl_ln2b, dl_ln2, l_residual2, l_ln2w, acts.ln2_mean + lBT,
                           acts.ln2_rstd + lBT, B, T, C);
        grads_ready(ready, L, 8, l); /* distopt option: ln2w, ln2b */
        residual_backward(dresidual, dl_attproj, dl_residual2, BTC);
        matmul_backward(dl_atty, dl_attprojw, dl_attprojb, dl_attproj, l_atty, l_attprojw, B, T, C, C);
        grads_ready(ready, L, 6, l); /* distopt option: attprojw, attprojb */
        attention_backward(dl_qkv, dl_preatt, dl_att, dl_atty, l_qkv, l_att, B, T, C, NH);
        matmul_backward(dl_ln1, dl_qkvw, dl_qkvb, dl_qkv, l_ln1, l_qkvw, B, T, C, 3 * C);
        grads_ready(ready, L, 4, l); /* distopt option: qkvw, qkvb */
        layernorm_backward(dresidual, dl_ln1w, dl_ln1b, dl_ln1, residual, l_ln1w, acts.ln1_mean + lBT,
                           acts.ln1_rstd + lBT, B, T, C);
        grads_ready(ready, L, 2, l); /* distopt option: ln1w, ln1b */
    }
    encoder_backward(grads.wte, grads.wpe, grads_acts.encoded, model->inputs, B, T, C);
    grads_ready(ready, L, 0, 0); /* distopt option: wte (tied: the logits' matmul added to it first), wpe */
}

/* AdamW (Loshchilov and Hutter), step t counted from 1 for the bias corrections. */
static void gpt2_update(GPT2 *model, float learning_rate, float beta1, float beta2, float eps, float weight_decay,
                        int t) {
    if (model->m_memory == NULL) {
        model->m_memory = calloc_or_die(model->num_parameters, sizeof(float));
        model->v_memory = calloc_or_die(model->num_parameters, sizeof(float));
    }
    float bias1 = 1.0f - powf(beta1, (float)t), bias2 = 1.0f - powf(beta2, (float)t);
    for (size_t i = 0; i < model->num_parameters; i++) {
        float param = model->params_memory[i], grad = model->grads_memory[i];
        float m = beta1 * model->m_memory[i] + (1.0f - beta1) * grad;
        float v = beta2 * model->v_memory[i] + (1.0f - beta2) * grad * grad;
        model->m_memory[i] = m;
        model->v_memory[i] = v;
        model->params_memory[i] -= learning_rate * ((m / bias1) / (sqrtf(v / bias2) + eps) + weight_decay * param);
    }
}

static void gpt2_free(GPT2 *model) {
    free(model->params_memory);
    free(model->grads_memory);
    free(model->m_memory);
    free(model->v_memory);
    free(model->acts_memory);
    free(model->grads_acts_memory);
    free(model->inputs);
    free(model->targets);
}

/* ----------------------------------------------------------------------------------------------
   The data: a token stream from a seeded Markov chain, cut into batches of B × T tokens. */

/* Every token has 4 successors, drawn once from the seed, taken with probabilities 0.5, 0.25,
   0.15 and 0.1 (entropy 1.21 nats per token). The same stream on every rank. */
static int *generate_tokens(size_t num_tokens, int V, uint64_t seed) {
    static const float cumulative[4] = {0.5f, 0.75f, 0.9f, 1.0f};
    int *successors = calloc_or_die((size_t)V * 4, sizeof(int));
    int *tokens = calloc_or_die(num_tokens, sizeof(int));
    uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
    for (int i = 0; i < V * 4; i++) successors[i] = (int)(random_u32(&state) % (uint32_t)V);
    for (size_t i = 1; i < num_tokens; i++) {
        float u = random_f32(&state);
        int k = 0;
        while (k < 3 && u >= cumulative[k]) k++;
        tokens[i] = successors[tokens[i - 1] * 4 + k];
    }
    free(successors);
    return tokens;
}

/* llm.c's DataLoader over a stream in memory: batch k is tokens k·B·T .. k·B·T + B·T (one more
   for the targets, the inputs shifted by one). Process r of n reads batches r, r + n, r + 2n, ...
   and starts again at r at the end of the stream. */
typedef struct {
    int B, T;
    int process_rank, num_processes;
    const int *tokens;
    size_t num_batches;
    size_t current_batch;
    int *batch;   /* B·T + 1 tokens */
    int *inputs;  /* batch */
    int *targets; /* batch + 1 */
} DataLoader;

static void dataloader_init(DataLoader *loader, const int *tokens, size_t num_tokens, int B, int T, int process_rank,
                            int num_processes) {
    loader->B = B;
    loader->T = T;
    loader->process_rank = process_rank;
    loader->num_processes = num_processes;
    loader->tokens = tokens;
    loader->num_batches = (num_tokens - 1) / ((size_t)B * T);
    if (loader->num_batches < (size_t)num_processes) {
        fprintf(stderr, "dataloader_init: %zu batches for %d processes\n", loader->num_batches, num_processes);
        exit(1);
    }
    loader->current_batch = (size_t)process_rank;
    loader->batch = calloc_or_die((size_t)B * T + 1, sizeof(int));
    loader->inputs = loader->batch;
    loader->targets = loader->batch + 1;
}

static void dataloader_next_batch(DataLoader *loader) {
    size_t BT = (size_t)loader->B * loader->T;
    memcpy(loader->batch, loader->tokens + loader->current_batch * BT, (BT + 1) * sizeof(int));
    loader->current_batch += (size_t)loader->num_processes;
    if (loader->current_batch >= loader->num_batches) loader->current_batch = (size_t)loader->process_rank;
}

static void dataloader_reset(DataLoader *loader) { loader->current_batch = (size_t)loader->process_rank; }

static void dataloader_free(DataLoader *loader) { free(loader->batch); }

/* llm.c's sampler: the index at which the cumulative probability passes coin (in [0, 1)). */
static int sample_mult(const float *probabilities, int n, float coin) {
    float cdf = 0.0f;
    for (int i = 0; i < n; i++) {
        cdf += probabilities[i];
        if (coin < cdf) return i;
    }
    return n - 1;
}

/* ----------------------------------------------------------------------------------------------
   The gradient check and main. */

enum { B_BATCH = 4, T_SEQ = 32, NUM_TOKENS = 1 << 16, NUM_VAL_TOKENS = 1 << 13, GEN_T = 16 };
static const GPT2Config model_config = {.max_seq_len = T_SEQ, .vocab_size = 64, .num_layers = 1, .num_heads = 4,
                                        .channels = 32};

/* The mean loss of the model's last forward, summed in double: the finite differences below
   subtract two losses that agree in their first 4 or 5 digits. */
static double last_loss(const GPT2 *model) {
    double sum = 0.0;
    int n = model->batch_size * model->seq_len;
    for (int i = 0; i < n; i++) sum += model->acts.losses[i];
    return sum / n;
}

/* The loss after moving parameter i by delta (and back). */
static double loss_moved(GPT2 *model, const DataLoader *loader, size_t i, float delta) {
    float saved = model->params_memory[i];
    model->params_memory[i] = saved + delta;
    gpt2_forward(model, loader->inputs, loader->targets, loader->B, loader->T);
    model->params_memory[i] = saved;
    return last_loss(model);
}

/* For every tensor, its element of the largest gradient and one more drawn at random, against
   a numerical derivative: central differences at h and h/2 combined (Richardson) so that their
   h² errors cancel. The forward passes are in float: the agreement is about 1e-4 relative for the
   large gradients and 1e-5 absolute for the small ones; a wrong backward is off by far more. */
static int gpt2_gradcheck(void) {
    const float h = 1e-2f;
    const double rtol = 1e-3, atol = 3e-5;
    GPT2 model;
    gpt2_build_from_random(&model, model_config, 7);
    /* larger weights than at the start of training, so that every path carries gradient */
    for (size_t i = 0; i < model.num_parameters; i++) model.params_memory[i] *= 3.0f;
    int *tokens = generate_tokens(NUM_TOKENS, model_config.vocab_size, 3);
    DataLoader loader;
    dataloader_init(&loader, tokens, NUM_TOKENS, B_BATCH, T_SEQ, 0, 1);
    dataloader_next_batch(&loader);
    gpt2_forward(&model, loader.inputs, loader.targets, B_BATCH, T_SEQ);
    gpt2_zero_grad(&model);
    gpt2_backward(&model, NULL);

    uint64_t state = 11;
    int checked = 0, failed = 0;
    size_t offset = 0;
    for (int k = 0; k < NUM_PARAMETER_TENSORS; k++) {
        size_t n = model.param_sizes[k], largest = 0;
        for (size_t j = 1; j < n; j++)
            if (fabsf(model.grads_memory[offset + j]) > fabsf(model.grads_memory[offset + largest])) largest = j;
        size_t picks[2] = {largest, random_u32(&state) % n};
        for (int p = 0; p < 2; p++) {
            size_t i = offset + picks[p];
            double d1 = (loss_moved(&model, &loader, i, h) - loss_moved(&model, &loader, i, -h)) / (2.0 * h);
            double d2 = (loss_moved(&model, &loader, i, h / 2) - loss_moved(&model, &loader, i, -h / 2)) / h;
            double numeric = (4.0 * d2 - d1) / 3.0, analytic = model.grads_memory[i];
            double err = fabs(numeric - analytic);
            int ok = err <= atol + rtol * fmax(fabs(numeric), fabs(analytic));
            printf("gradcheck %-8s [%5zu] analytic %+.6e numeric %+.6e error %.2e %s\n", parameter_names[k], picks[p],
                   analytic, numeric, err, ok ? "ok" : "FAIL");
            checked++;
            failed += !ok;
        }
        offset += n;
    }
    printf("gradcheck: %d of %d gradients agree with finite differences\n", checked - failed, checked);
    dataloader_free(&loader);
    gpt2_free(&model);
    free(tokens);
    return failed ? 1 : 0;
}

static int usage(const char *message) {
    if (message) fprintf(stderr, "gpt2_standin: %s\n", message);
    fprintf(message ? stderr : stdout,
            "usage: gpt2_standin [--steps N] [--gradcheck] [--desync] [--nan-at K] [--overlap on|off]\n"
            "                    [--layers L] [--channels C] [--batch B] [--seq T] [--period I]\n");
    return message ? 2 : 0;
}

/* Flag argv[*i]'s value (the next argument) as a whole number in [lo, hi], or -1. */
static int int_flag(int argc, char **argv, int *i, long lo, long hi) {
    char *end;
    if (*i + 1 >= argc) return -1;
    long v = strtol(argv[++*i], &end, 10);
    return *end || end == argv[*i] || v < lo || v > hi ? -1 : (int)v;
}

/* The timing line the overlap benchmark parses (as examples/common.h's STEP TIMING prints it),
   with llm.c's clock: medians over the steps after the first 3 of a step (forward to update), of
   the time inside dopt_dp_after_backward, and of gpt2_backward. */
enum { TIMING_WARMUP = 3 };

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median_ms(double *x, int n) {
    if (n <= 0) return NAN;
    qsort(x, (size_t)n, sizeof *x, compare_doubles);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

int main(int argc, char **argv) {
    int steps = 300, desync = 0, nan_at = -1, overlap = 0, B = B_BATCH, period = 1;
    GPT2Config config = model_config;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--gradcheck")) return gpt2_gradcheck();
        if (!strcmp(argv[i], "--desync")) {
            desync = 1;
        } else if (!strcmp(argv[i], "--overlap") && i + 1 < argc) {
            overlap = !strcmp(argv[++i], "on");
            if (!overlap && strcmp(argv[i], "off")) return usage("--overlap expects on or off");
        } else if (!strcmp(argv[i], "--steps")) {
            if ((steps = int_flag(argc, argv, &i, 1, 1000000)) < 0) return usage("--steps expects a number from 1 to 1000000");
        } else if (!strcmp(argv[i], "--nan-at")) {
            if ((nan_at = int_flag(argc, argv, &i, 0, 1000000)) < 0) return usage("--nan-at expects a step from 0 to 1000000");
        } else if (!strcmp(argv[i], "--layers")) {
            if ((config.num_layers = int_flag(argc, argv, &i, 1, 64)) < 0) return usage("--layers expects 1 to 64");
        } else if (!strcmp(argv[i], "--channels")) {
            config.channels = int_flag(argc, argv, &i, 1, 4096);
            if (config.channels < 0 || config.channels % config.num_heads)
                return usage("--channels expects a multiple of 4 (the heads) up to 4096");
        } else if (!strcmp(argv[i], "--batch")) {
            if ((B = int_flag(argc, argv, &i, 1, 1024)) < 0) return usage("--batch expects 1 to 1024");
        } else if (!strcmp(argv[i], "--seq")) {
            if ((config.max_seq_len = int_flag(argc, argv, &i, 2, 1024)) < 0) return usage("--seq expects 2 to 1024");
        } else if (!strcmp(argv[i], "--period")) {
            if ((period = int_flag(argc, argv, &i, 1, 1 << 30)) < 0) return usage("--period expects 1 to 2^30");
        } else if (!strcmp(argv[i], "--help")) {
            return usage(NULL);
        } else {
            return usage("unknown flag or missing value");
        }
    }
    dopt_comm *comm; dopt_dp dp;                                             /* distopt */
    if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1;               /* distopt: the reason is on stderr */

    GPT2 model;
    gpt2_build_from_random(&model, config, 1337 + (uint64_t)comm->rank); /* a test harness: other weights on
                                                                         every rank, which the broadcast
                                                                         must make equal */
    dopt_dp_init(&dp, comm, model.num_parameters, &(dopt_dp_config){.params = model.params_memory, /* distopt */
                 .period = (size_t)period});                                 /* distopt option: --period */
    GradReady ready;                                                         /* distopt option: --overlap on */
    if (overlap) grad_ready_init(&ready, &dp, &model);                       /* distopt option */

    int T = config.max_seq_len, gen_t = GEN_T < T ? GEN_T : T;
    int *tokens = generate_tokens(NUM_TOKENS, model.config.vocab_size, 42);
    int *val_tokens = generate_tokens(NUM_VAL_TOKENS, model.config.vocab_size, 42); /* the same chain, a shorter run */
    DataLoader train_loader, val_loader;
    dataloader_init(&train_loader, tokens, NUM_TOKENS, B, T, comm->rank, comm->size); /* distopt: the shard */
    dataloader_init(&val_loader, val_tokens, NUM_VAL_TOKENS, B, T, comm->rank, comm->size); /* distopt: the shard */
    int val_num_batches = 4;
    printf("[GPT-2] vocab_size %d, max_seq_len %d, num_layers %d, num_heads %d, channels %d\n", model.config.vocab_size,
           model.config.max_seq_len, model.config.num_layers, model.config.num_heads, model.config.channels);
    printf("num_parameters: %zu\n", model.num_parameters);
    printf("train dataset num_batches: %zu, processes: %d, B %d, T %d\n", train_loader.num_batches,
           train_loader.num_processes, B, T);

    uint64_t rng_state = 1337;
    int *gen_tokens = calloc_or_die((size_t)B * T, sizeof(int));
    double *times_ms = calloc_or_die(3 * (size_t)steps, sizeof(double)); /* step, wait, backward */
    int timed = 0;
    for (int step = 0; step < steps; step++) {
        if (step % 10 == 0) { /* once in a while, the validation loss */
            float val_loss = 0.0f;
            dataloader_reset(&val_loader);
            for (int i = 0; i < val_num_batches; i++) {
                dataloader_next_batch(&val_loader);
                gpt2_forward(&model, val_loader.inputs, val_loader.targets, B, T);
                val_loss += model.mean_loss;
            }
            val_loss /= val_num_batches;
            val_loss = (float)dopt_mean(comm, val_loss);                     /* distopt: the mean over the ranks */
            printf("val loss %f\n", val_loss);
        }
        if (step > 0 && step % 20 == 0) { /* once in a while, text from the model */
            for (int i = 0; i < B * T; i++) gen_tokens[i] = 0;
            printf("generating:\n---\n");
            for (int t = 1; t < gen_t; t++) {
                gpt2_forward(&model, gen_tokens, NULL, B, T);
                float *probs = model.acts.probs + (size_t)(t - 1) * model.config.vocab_size;
                gen_tokens[t] = sample_mult(probs, model.config.vocab_size, random_f32(&rng_state));
                printf("%d ", gen_tokens[t]);
            }
            printf("\n---\n");
        }
        dataloader_next_batch(&train_loader);
        double t_start = seconds_now();
        gpt2_forward(&model, train_loader.inputs, train_loader.targets, B, T);
        gpt2_zero_grad(&model);
        double t_backward = seconds_now();
        gpt2_backward(&model, overlap ? &ready : NULL);                      /* distopt option: marks with --overlap on */
        if (step == nan_at && comm->rank == comm->size - 1) model.grads_memory[12345] = NAN;
        double t_wait = seconds_now();
        if (overlap) dopt_dp_after_backward_buf(&dp, &ready.grads);          /* distopt option: the table marked */
        else dopt_dp_after_backward(&dp, model.grads_memory);                /* distopt: the ranks' mean gradient */
        double t_update = seconds_now();
        gpt2_update(&model, 3e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, step + 1);
        if (period > 1) dopt_dp_after_step(&dp, model.params_memory);       /* distopt option: --period's model average */
        if (step >= TIMING_WARMUP) {
            times_ms[timed] = 1e3 * (seconds_now() - t_start);
            times_ms[steps + timed] = 1e3 * (t_update - t_wait);
            times_ms[2 * steps + timed] = 1e3 * (t_wait - t_backward);
            timed++;
        }
        model.mean_loss = (float)dopt_mean(comm, model.mean_loss);           /* distopt: the mean over the ranks */
        printf("step %d: train loss %f\n", step, model.mean_loss);
    }

    if (desync && train_loader.process_rank == 1) model.params_memory[0] += 1e-3f;
    int status = dopt_comm_finish(comm, dopt_dp_close(&dp, model.params_memory)); /* distopt: ranks > 0 exit here */
    if (status == 0) printf("result: loss %f replicas identical\n", model.mean_loss);
    if (status == 0)
        printf("timing steps=%d step_ms=%.3f wait_ms=%.3f backward_ms=%.3f overlap=%s\n", timed,
               median_ms(times_ms, timed), median_ms(times_ms + steps, timed), median_ms(times_ms + 2 * steps, timed),
               overlap ? "on" : "off");
    dataloader_free(&train_loader);
    dataloader_free(&val_loader);
    gpt2_free(&model);
    free(tokens);
    free(val_tokens);
    free(gen_tokens);
    free(times_ms);
    if (overlap) free(ready.segs);
    return status;                                                           /* distopt: the job's status */
}
