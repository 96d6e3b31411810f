/* bench_recorder — what the flight recorder costs a collective, beside what a collective costs.

   On a world of one whose recorder is mapped from a file (DOPT_RECORDER_DIR, else /tmp): a record
   is the begin and end of one collective's entry (two clock reads, two seqlocked writes, the
   traffic's busy time); an arrival is one peer's data timed (a clock read, a search of the
   entry's peers, a seqlocked write, the traffic's waited time). Beside them, in the same run: one
   clock read (CLOCK_MONOTONIC), and a whole dopt_allreduce of one double on the world of one with
   the recorder on and off (DOPT_RECORDER=0), the cheapest collective there is. Each figure is the
   median of 9 runs of 10^6 calls; the spread is (max - min) / median of the record's runs.

   Last line: "bench recorder ns_per_record=<x> ns_per_arrival=<y> ..." (goal: both < 1000).
   Run: build/bench_recorder   (make bench does this) */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define REPS 9
#define CALLS 1000000

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef enum what { RECORD, ARRIVAL, CLOCK, ALLREDUCE } what;

/* Nanoseconds per call of one run. */
static double run(dopt_comm *c, what w) {
    dopt_coll_desc d;
    volatile uint64_t sink = 0;
    double t0, x = 1.0;
    uint64_t slot;
    int i;
    memset(&d, 0, sizeof d);
    d.kind = DOPT_COLL_ALLREDUCE;
    d.count = 1000;
    slot = dopt__rec_begin(c, &d);
    for (i = 0; i < DOPT_REC_PEERS; i++) dopt__rec_expect(c, slot, i);
    t0 = now_ns();
    for (i = 0; i < CALLS; i++) {
        switch (w) {
        case RECORD:
            d.seq = (uint64_t)i + 1;
            slot = dopt__rec_begin(c, &d);
            dopt__rec_end(c, c, slot, DOPT_OK);
            break;
        case ARRIVAL: dopt__rec_arrived(c, c, slot, i & (DOPT_REC_PEERS - 1)); break;
        case CLOCK: sink += dopt__rec_now_ns(); break;
        case ALLREDUCE: dopt_allreduce(c, &x, 1, DOPT_F64, DOPT_SUM); break;
        }
    }
    (void)sink;
    return (now_ns() - t0) / CALLS;
}

/* The median of REPS runs; *spread, when not NULL, (max - min) / median. */
static double median(dopt_comm *c, what w, double *spread) {
    double v[REPS];
    int r;
    for (r = 0; r < REPS; r++) v[r] = run(c, w);
    qsort(v, REPS, sizeof v[0], by_value);
    if (spread) *spread = (v[REPS - 1] - v[0]) / v[REPS / 2];
    return v[REPS / 2];
}

static dopt_comm *make_self(int recorder) {
    dopt_comm *c;
    const char *dir = getenv("DOPT_RECORDER_DIR");
    if (!dir || !*dir) setenv("DOPT_RECORDER_DIR", "/tmp", 1);
    if (recorder) unsetenv("DOPT_RECORDER");
    else setenv("DOPT_RECORDER", "0", 1);
    if (dopt_comm_create_self(&c) != DOPT_OK) return NULL;
    dopt_comm_set_job(c, "bench_recorder", 14);
    return c;
}

int main(void) {
    dopt_comm *c = make_self(1), *off;
    double record, arrival, clock, with, without, spread;
    if (c == NULL || c->rec == NULL || c->rec->ring == NULL) {
        fprintf(stderr, "bench_recorder: no recorder\n");
        return 1;
    }
    printf("recorder in %s (%s)\n", c->rec->mapped ? c->rec->path : "memory", c->rec->mapped ? "a mapped file" : "not mapped");
    record = median(c, RECORD, &spread);
    arrival = median(c, ARRIVAL, NULL);
    clock = median(c, CLOCK, NULL);
    with = median(c, ALLREDUCE, NULL);
    dopt_comm_destroy(c);
    if ((off = make_self(0)) == NULL) return 1;
    without = median(off, ALLREDUCE, NULL);
    dopt_comm_destroy(off);
    printf("%-34s %8.1f ns\n", "record (begin + end of an entry)", record);
    printf("%-34s %8.1f ns\n", "arrival (one peer's data timed)", arrival);
    printf("%-34s %8.1f ns\n", "clock_gettime(CLOCK_MONOTONIC)", clock);
    printf("%-34s %8.1f ns (recorder off: %.1f ns)\n", "allreduce of 1 f64, world of one", with, without);
    printf("bench recorder ns_per_record=%.1f ns_per_arrival=%.1f clock_ns=%.1f allreduce_self_ns=%.1f "
           "allreduce_self_off_ns=%.1f spread=%.2f\n",
           record, arrival, clock, with, without, spread);
    return 0;
}
