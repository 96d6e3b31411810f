/* host_common.h — what the two host programs share around their loops, as such programs would
   each write it: flags and a hash of the parameters for the run script. Not part of distopt. */
#ifndef DOPT_HOST_COMMON_H
#define DOPT_HOST_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct host_options {
    const char *compress;
    int epochs, batch, hidden, period;
    float lr, clip;
    long train_limit;
    unsigned seed;
    int average_grads; /* --average grads|models (darknet_dp; default models) */
    int overlap;       /* --overlap on|off (darknet_dp with --average grads; default off) */
} host_options;

/* Flags as "--name value" pairs (the transport and the number of workers come from the
   environment: DOPT_WORLD_SIZE, DOPT_TRANSPORT, or a launcher's variables); `flags` is the usage text after the program name (it lists the
   flags this host reads: another host's flag is accepted and ignored). */
static inline void host_parse_options(host_options *o, int argc, char **argv, const char *flags) {
    int i;
    for (i = 1; i + 1 < argc; i += 2) {
        const char *f = argv[i], *v = argv[i + 1];
        if (!strcmp(f, "--epochs")) o->epochs = atoi(v);
        else if (!strcmp(f, "--batch")) o->batch = atoi(v);
        else if (!strcmp(f, "--lr")) o->lr = strtof(v, NULL);
        else if (!strcmp(f, "--hidden")) o->hidden = atoi(v);
        else if (!strcmp(f, "--period")) o->period = atoi(v);
        else if (!strcmp(f, "--train-limit")) o->train_limit = atol(v);
        else if (!strcmp(f, "--seed")) o->seed = (unsigned)strtoul(v, NULL, 10);
        else if (!strcmp(f, "--compress")) o->compress = v;
        else if (!strcmp(f, "--clip")) o->clip = strtof(v, NULL);
        else if (!strcmp(f, "--average") && (!strcmp(v, "grads") || !strcmp(v, "models"))) o->average_grads = !strcmp(v, "grads");
        else if (!strcmp(f, "--overlap") && (!strcmp(v, "on") || !strcmp(v, "off"))) o->overlap = !strcmp(v, "on");
        else break;
    }
    if (i != argc || o->epochs < 1 || o->batch < 1 || o->hidden < 1 || o->period < 1 ||
        (o->average_grads && o->period != 1) || (o->overlap && !o->average_grads) ||
        (strcmp(o->compress, "none") && strcmp(o->compress, "ternary"))) {
        fprintf(stderr, "usage: %s %s\n", argv[0], flags);
        exit(2);
    }
}

/* 64-bit FNV-1a of the parameters' bytes in descriptor order: each rank prints its own, the run
   script compares them (independently of distopt's own replica check). */
static inline unsigned long long host_params_hash(const dopt_buf *params) {
    unsigned long long h = 14695981039346656037ull;
    int scatter = params->data == NULL;
    size_t i, b, n = scatter ? params->nspans : 1;
    for (i = 0; i < n; i++) {
        const unsigned char *p = (const unsigned char *)(scatter ? params->spans[i].ptr : params->data);
        size_t bytes = (scatter ? params->spans[i].count : params->n) * sizeof(float);
        for (b = 0; b < bytes; b++) h = (h ^ p[b]) * 1099511628211ull;
    }
    return h;
}

#endif
