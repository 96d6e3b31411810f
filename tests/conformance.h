/* conformance.h — the semantics every distopt transport must keep (DESIGN.md §4), as checks that
   run on every rank of a world. Include after distopt.h and dtest.h.

   conformance_run(c)             every collective × dtype × op at lengths 0, 1, 3, 1000, 2^20+7:
                                  results against a serial reference, bitwise equal on every rank,
                                  and the same bits when repeated.
   conformance_mismatch_count(c)  the last rank asks for one element more;
   conformance_mismatch_op(c)     the last rank reduces with MAX while the others SUM;
   conformance_mismatch_kind(c)   the last rank broadcasts while the others allreduce.
                                  Each mismatch check expects every rank to fail (MISMATCH, or
                                  PEER_LOST on a rank whose peer gave up first) and the communicator
                                  to stay poisoned; they need a world of at least 2.

   Every buffer handed to a collective sits between guard bytes that are checked after the call
   (and, under AddressSanitizer, poisoned, so that reading or writing one byte past the buffer is
   reported where it happens), and every element of a result is compared with the reference.

   A failed check prints "conformance: ..." with the rank and _exit(1)s that rank. */
#ifndef DOPT_CONFORMANCE_H
#define DOPT_CONFORMANCE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#define CONFORMANCE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CONFORMANCE_ASAN 1
#endif
#endif
#ifdef CONFORMANCE_ASAN
#include <sanitizer/asan_interface.h>
#define CONFORMANCE_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define CONFORMANCE_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define CONFORMANCE_POISON(p, n) ((void)(p), (void)(n))
#define CONFORMANCE_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* ------------------------------------------------------------------ guarded buffers */

#define CONFORMANCE_GUARD 64 /* bytes before and after every buffer */

static unsigned char conformance_guard_byte(size_t i) { return (unsigned char)(0xA5 ^ (i * 37)); }

/* bytes of memory (any alignment a double needs) between two guards; free with
   conformance_release. */
static void *conformance_alloc(size_t bytes) {
    unsigned char *base = (unsigned char *)malloc(bytes + 2 * CONFORMANCE_GUARD), *p;
    size_t i;
    DT_CHECK(base != NULL);
    p = base + CONFORMANCE_GUARD;
    for (i = 0; i < CONFORMANCE_GUARD; i++) base[i] = p[bytes + i] = conformance_guard_byte(i);
    CONFORMANCE_POISON(base, CONFORMANCE_GUARD);
    CONFORMANCE_POISON(p + bytes, CONFORMANCE_GUARD);
    return p;
}

/* The guards around a buffer of bytes still hold their values: nothing wrote outside it. */
static void conformance_check_guards(const void *buf, size_t bytes, int rank, const char *what) {
    unsigned char *p = (unsigned char *)buf, *base = p - CONFORMANCE_GUARD;
    size_t i;
    CONFORMANCE_UNPOISON(base, CONFORMANCE_GUARD);
    CONFORMANCE_UNPOISON(p + bytes, CONFORMANCE_GUARD);
    for (i = 0; i < CONFORMANCE_GUARD; i++) {
        DT_CHECKF(base[i] == conformance_guard_byte(i), "conformance: rank %d: %s wrote %zu bytes before its buffer", rank,
                  what, CONFORMANCE_GUARD - i);
        DT_CHECKF(p[bytes + i] == conformance_guard_byte(i), "conformance: rank %d: %s wrote byte %zu past its buffer of %zu",
                  rank, what, i, bytes);
    }
    CONFORMANCE_POISON(base, CONFORMANCE_GUARD);
    CONFORMANCE_POISON(p + bytes, CONFORMANCE_GUARD);
}

static void conformance_release(void *buf, size_t bytes) {
    unsigned char *base = (unsigned char *)buf - CONFORMANCE_GUARD;
    CONFORMANCE_UNPOISON(base, bytes + 2 * CONFORMANCE_GUARD);
    free(base);
}

static const size_t conformance_lengths[] = {0, 1, 3, 1000, (1u << 20) + 7};
#define CONFORMANCE_NLENGTHS (sizeof conformance_lengths / sizeof conformance_lengths[0])

static uint64_t conformance_hash(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 1469598103934665603ull;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Integer-valued inputs: sums are exact in every dtype whatever the reduction order, so the result
   must equal the serial reference exactly. Values depend on rank and index, include negatives. */
static int64_t conformance_int_value(int rank, size_t i) {
    return (int64_t)((i * 7 + (size_t)rank * 13) % 201) - 100 + (int64_t)rank;
}

/* Non-integer inputs: sums round differently in different orders, so these check that every rank
   ends with the same bits (the backend fixed one order) and that the value is close to the sum. */
static double conformance_real_value(int rank, size_t i) {
    return ((double)((i * 2654435761u + (size_t)rank * 40503u) % 100003u) / 100003.0 - 0.5) * (1.0 + (double)(i % 7)) /
           3.0;
}

/* Element i of rank r's input, as the dtype stores it. */
static double conformance_input(dopt_dtype dt, int rank, size_t i, int real) {
    double v = real ? conformance_real_value(rank, i) : (double)conformance_int_value(rank, i);
    switch (dt) {
    case DOPT_F32: return (double)(float)v;
    case DOPT_F64: return v;
    case DOPT_I32: return (double)conformance_int_value(rank, i);
    case DOPT_I64: return (double)(conformance_int_value(rank, i) * ((int64_t)1 << 33));
    }
    return 0;
}

static void conformance_fill(void *buf, size_t n, dopt_dtype dt, int rank, int real) {
    size_t i;
    for (i = 0; i < n; i++) {
        double v = conformance_input(dt, rank, i, real);
        switch (dt) {
        case DOPT_F32: ((float *)buf)[i] = (float)v; break;
        case DOPT_F64: ((double *)buf)[i] = v; break;
        case DOPT_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
        case DOPT_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
        }
    }
}

static double conformance_get(const void *buf, size_t i, dopt_dtype dt) {
    switch (dt) {
    case DOPT_F32: return ((const float *)buf)[i];
    case DOPT_F64: return ((const double *)buf)[i];
    case DOPT_I32: return (double)((const int32_t *)buf)[i];
    case DOPT_I64: return (double)((const int64_t *)buf)[i];
    }
    return 0;
}

/* The serial reference for element i: the inputs of ranks 0..size-1 combined in rank order in
   double (exact for integer-valued inputs), then MEAN's division as the core does it (an f32 sum
   times the f32 reciprocal of size: exact only when size divides it, which a world of 5 shows). */
static double conformance_expected(int size, size_t i, dopt_dtype dt, dopt_op op, int real) {
    double acc = conformance_input(dt, 0, i, real);
    int r;
    for (r = 1; r < size; r++) {
        double v = conformance_input(dt, r, i, real);
        if (op == DOPT_MAX)
            acc = v > acc ? v : acc;
        else if (op == DOPT_MIN)
            acc = v < acc ? v : acc;
        else
            acc += v;
    }
    if (op == DOPT_MEAN) {
        if (dt == DOPT_I32 || dt == DOPT_I64)
            acc = (double)((int64_t)acc / size); /* C division truncates toward zero */
        else if (dt == DOPT_F32)
            acc = (double)((float)acc * (1.0f / (float)size)); /* f32: times the f32 reciprocal */
        else
            acc /= size;
    }
    return acc;
}

/* Every rank must hold the same bytes: gather one hash per rank and compare. */
static void conformance_same_everywhere(dopt_comm *c, const void *buf, size_t bytes, const char *what) {
    uint64_t mine = conformance_hash(buf, bytes);
    uint64_t *all = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)c->size);
    int r;
    DT_OK(dopt_allgather(c, &mine, all, sizeof mine));
    for (r = 0; r < c->size; r++)
        DT_CHECKF(all[r] == mine, "conformance: rank %d: %s differs from rank %d's result", c->rank, what, r);
    free(all);
}

static void conformance_allreduce_case(dopt_comm *c, size_t n, dopt_dtype dt, dopt_op op, int real) {
    size_t es = dopt_dtype_size(dt), i;
    void *buf = conformance_alloc(n * es), *again = conformance_alloc(n * es);
    char what[96];
    snprintf(what, sizeof what, "allreduce %s %s n=%zu %s", dopt_dtype_name(dt), dopt_op_name(op), n,
             real ? "real" : "integer");
    conformance_fill(buf, n, dt, c->rank, real);
    DT_CHECKF(dopt_allreduce(c, n ? buf : NULL, n, dt, op) == DOPT_OK, "conformance: rank %d: %s: %s", c->rank, what,
              dopt_comm_detail(c));
    conformance_check_guards(buf, n * es, c->rank, what);
    for (i = 0; i < n; i++) {
        double got = conformance_get(buf, i, dt), want = conformance_expected(c->size, i, dt, op, real);
        /* exact for integer inputs; for real f32 inputs a few ulps of the magnitude summed */
        double tol = !real ? 0.0 : dt == DOPT_F32 ? 4e-6 * c->size * (1.0 + fabs(want)) : 1e-13 * c->size * (1.0 + fabs(want));
        DT_CHECKF(fabs(got - want) <= tol, "conformance: rank %d: %s: element %zu is %.17g, expected %.17g", c->rank,
                  what, i, got, want);
    }
    conformance_same_everywhere(c, buf, n * es, what);
    /* the same inputs give the same bits again */
    conformance_fill(again, n, dt, c->rank, real);
    DT_OK(dopt_allreduce(c, n ? again : NULL, n, dt, op));
    conformance_check_guards(again, n * es, c->rank, what);
    DT_CHECKF(n == 0 || memcmp(buf, again, n * es) == 0, "conformance: rank %d: %s not deterministic", c->rank, what);
    conformance_release(buf, n * es);
    conformance_release(again, n * es);
}

static void conformance_allreduce_all(dopt_comm *c) {
    static const dopt_dtype dts[4] = {DOPT_F32, DOPT_F64, DOPT_I32, DOPT_I64};
    static const dopt_op ops[4] = {DOPT_SUM, DOPT_MAX, DOPT_MIN, DOPT_MEAN};
    size_t k;
    int d, o;
    for (k = 0; k < CONFORMANCE_NLENGTHS; k++)
        for (d = 0; d < 4; d++)
            for (o = 0; o < 4; o++) {
                conformance_allreduce_case(c, conformance_lengths[k], dts[d], ops[o], 0);
                if ((dts[d] == DOPT_F32 || dts[d] == DOPT_F64) && ops[o] == DOPT_SUM)
                    conformance_allreduce_case(c, conformance_lengths[k], dts[d], ops[o], 1);
            }
}

static unsigned char conformance_byte(int rank, size_t i) { return (unsigned char)((i * 31 + (size_t)rank * 101 + 7) & 0xFF); }

static void conformance_allgather_all(dopt_comm *c) {
    size_t k;
    for (k = 0; k < CONFORMANCE_NLENGTHS; k++) {
        size_t n = conformance_lengths[k], i;
        unsigned char *send = (unsigned char *)conformance_alloc(n);
        unsigned char *recv = (unsigned char *)conformance_alloc(n * (size_t)c->size);
        int r;
        for (i = 0; i < n; i++) send[i] = conformance_byte(c->rank, i);
        DT_CHECKF(dopt_allgather(c, send, recv, n) == DOPT_OK, "conformance: rank %d: allgather %zu bytes: %s", c->rank,
                  n, dopt_comm_detail(c));
        conformance_check_guards(send, n, c->rank, "allgather's send buffer");
        conformance_check_guards(recv, n * (size_t)c->size, c->rank, "allgather");
        for (i = 0; i < n; i++)
            DT_CHECKF(send[i] == conformance_byte(c->rank, i), "conformance: rank %d: allgather wrote its send buffer", c->rank);
        for (r = 0; r < c->size; r++)
            for (i = 0; i < n; i++)
                DT_CHECKF(recv[(size_t)r * n + i] == conformance_byte(r, i),
                          "conformance: rank %d: allgather %zu bytes: block of rank %d wrong at %zu", c->rank, n, r, i);
        conformance_release(send, n);
        conformance_release(recv, n * (size_t)c->size);
    }
}

static void conformance_allgatherv_all(dopt_comm *c) {
    size_t k;
    for (k = 0; k < CONFORMANCE_NLENGTHS; k++) {
        /* unequal blocks: rank r sends base·(r+1)/size bytes, and rank 1 sends nothing */
        size_t base = conformance_lengths[k], mine, cap = 0, off = 0, i;
        size_t *sizes = (size_t *)malloc(sizeof(size_t) * (size_t)c->size);
        unsigned char *send, *recv;
        int r;
        for (r = 0; r < c->size; r++) cap += r == 1 ? 0 : base * (size_t)(r + 1) / (size_t)c->size + (size_t)r;
        mine = c->rank == 1 ? 0 : base * (size_t)(c->rank + 1) / (size_t)c->size + (size_t)c->rank;
        send = (unsigned char *)conformance_alloc(mine);
        recv = (unsigned char *)conformance_alloc(cap);
        for (i = 0; i < mine; i++) send[i] = conformance_byte(c->rank, i);
        DT_CHECKF(dopt_allgatherv(c, send, mine, recv, cap, sizes) == DOPT_OK, "conformance: rank %d: allgatherv: %s",
                  c->rank, dopt_comm_detail(c));
        conformance_check_guards(send, mine, c->rank, "allgatherv's send buffer");
        conformance_check_guards(recv, cap, c->rank, "allgatherv");
        for (r = 0; r < c->size; r++) {
            size_t want = r == 1 ? 0 : base * (size_t)(r + 1) / (size_t)c->size + (size_t)r;
            DT_CHECKF(sizes[r] == want, "conformance: rank %d: allgatherv: rank %d's size %zu, expected %zu", c->rank, r,
                      sizes[r], want);
            for (i = 0; i < want; i++)
                DT_CHECKF(recv[off + i] == conformance_byte(r, i), "conformance: rank %d: allgatherv: rank %d's block wrong at %zu",
                          c->rank, r, i);
            off += want;
        }
        free(sizes);
        conformance_release(send, mine);
        conformance_release(recv, cap);
    }
}

static void conformance_broadcast_all(dopt_comm *c) {
    size_t k;
    int root;
    for (k = 0; k < CONFORMANCE_NLENGTHS; k++)
        for (root = 0; root < c->size; root++) {
            size_t n = conformance_lengths[k], i;
            unsigned char *buf = (unsigned char *)conformance_alloc(n);
            for (i = 0; i < n; i++) buf[i] = c->rank == root ? conformance_byte(root, i) : 0xEE;
            DT_CHECKF(dopt_broadcast(c, buf, n, root) == DOPT_OK, "conformance: rank %d: broadcast %zu from %d: %s", c->rank,
                      n, root, dopt_comm_detail(c));
            conformance_check_guards(buf, n, c->rank, "broadcast");
            for (i = 0; i < n; i++)
                DT_CHECKF(buf[i] == conformance_byte(root, i), "conformance: rank %d: broadcast %zu bytes from %d wrong at %zu",
                          c->rank, n, root, i);
            conformance_release(buf, n);
        }
}

/* Many small collectives back to back: sequencing, wake-ups and slot reuse. */
static void conformance_many_small(dopt_comm *c) {
    int it;
    for (it = 0; it < 2000; it++) {
        int64_t v[2] = {c->rank + it, -(int64_t)it};
        int64_t want = (int64_t)c->size * it + (int64_t)c->size * (c->size - 1) / 2;
        DT_OK(dopt_allreduce(c, v, 2, DOPT_I64, DOPT_SUM));
        DT_CHECKF(v[0] == want && v[1] == -(int64_t)it * c->size, "conformance: rank %d: iteration %d: got %lld", c->rank,
                  it, (long long)v[0]);
        if (it % 100 == 0) DT_OK(dopt_barrier(c));
    }
}

/* c->traffic counts each completed collective and its payload as this rank handed it over. */
static void conformance_traffic(dopt_comm *c) {
    double d[3] = {0};
    unsigned char block[64] = {0}, *all = (unsigned char *)malloc(64 * (size_t)c->size); /* rank r sends r bytes */
    size_t got[64];
    dopt_traffic t;
    memset(&c->traffic, 0, sizeof c->traffic);
    DT_OK(dopt_allreduce(c, d, 3, DOPT_F64, DOPT_SUM));
    DT_OK(dopt_allgather(c, block, all, 5));
    DT_CHECK(c->size <= 64);
    DT_OK(dopt_allgatherv(c, block, (size_t)c->rank, all, 64 * (size_t)c->size, got));
    DT_OK(dopt_broadcast(c, block, 4, 0));
    DT_OK(dopt_barrier(c));
    t = c->traffic;
    DT_CHECK(t.calls[DOPT_COLL_ALLREDUCE] == 1 && t.bytes[DOPT_COLL_ALLREDUCE] == 24);
    /* allgatherv exchanges 16 bytes of sizes through allgather first */
    DT_CHECK(t.calls[DOPT_COLL_ALLGATHER] == 2 && t.bytes[DOPT_COLL_ALLGATHER] == 5 + 16);
    DT_CHECK(t.calls[DOPT_COLL_ALLGATHERV] == 1 && t.bytes[DOPT_COLL_ALLGATHERV] == (uint64_t)c->rank);
    DT_CHECK(t.calls[DOPT_COLL_BROADCAST] == 1 && t.bytes[DOPT_COLL_BROADCAST] == 4);
    DT_CHECK(t.calls[DOPT_COLL_BARRIER] == 1 && t.bytes[DOPT_COLL_BARRIER] == 0);
    DT_CHECK(dopt_comm_traffic_total(c) == 24 + 21 + (uint64_t)c->rank + 4);
    DT_CHECK(dopt_comm_traffic_total(NULL) == 0);
    free(all);
}

/* ------------------------------------------------------------------ exchange */

static size_t conformance_xfer_bytes(int from, int to, int round) {
    return (size_t)((from * 7 + to * 3 + round * 11) % 23) * 97; /* 0 .. 2134, some zero */
}

static unsigned char conformance_xfer_byte(int from, int to, int round, size_t i) {
    return (unsigned char)(from * 13 + to * 29 + round * 5 + (int)(i * 7));
}

/* Point-to-point exchanges: a shift round (right neighbour only), all-to-all rounds of unequal
   sizes, some zero, three in flight at once, an empty one; every byte and guard checked, and
   the traffic counters' sent and received equal what was listed. */
static void conformance_exchange(dopt_comm *c) {
    enum { ROUNDS = 3 };
    int n = c->size, r = c->rank, round, p;
    dopt_xfer *tx = (dopt_xfer *)calloc((size_t)(ROUNDS + 1) * (size_t)n, sizeof *tx);
    dopt_xfer *rx = (dopt_xfer *)calloc((size_t)(ROUNDS + 1) * (size_t)n, sizeof *rx);
    dopt_request req[ROUNDS + 1];
    int ntx[ROUNDS + 1] = {0}, nrx[ROUNDS + 1] = {0};
    uint64_t sent = 0, received = 0;
    dopt_status s;
    DT_CHECK(tx != NULL && rx != NULL);
    memset(&c->traffic, 0, sizeof c->traffic);
    s = dopt_exchange(c, 5, NULL, 0, NULL, 0);
    if (s == DOPT_ERR_UNSUPPORTED) { /* no links: nothing poisoned */
        DT_CHECK(c->eng == NULL && c->error == DOPT_OK);
        free(tx);
        free(rx);
        return;
    }
    DT_OK(s);
    for (round = 0; round <= ROUNDS; round++) { /* round ROUNDS: the shift */
        dopt_xfer *t = tx + (size_t)round * (size_t)n, *x = rx + (size_t)round * (size_t)n;
        for (p = 0; p < n; p++) {
            int to = round == ROUNDS ? (r + 1) % n : p, from = round == ROUNDS ? (r + n - 1) % n : p;
            size_t i;
            if (round == ROUNDS && p > 0) break;
            if (to != r) {
                size_t b = conformance_xfer_bytes(r, to, round);
                unsigned char *buf = (unsigned char *)conformance_alloc(b);
                for (i = 0; i < b; i++) buf[i] = conformance_xfer_byte(r, to, round, i);
                t[ntx[round]].peer = to, t[ntx[round]].buf = buf, t[ntx[round]++].bytes = b;
                sent += b;
            }
            if (from != r) {
                size_t b = conformance_xfer_bytes(from, r, round);
                x[nrx[round]].peer = from, x[nrx[round]].buf = conformance_alloc(b), x[nrx[round]++].bytes = b;
                received += b;
            }
        }
        DT_OK(dopt_exchange_start(c, 1000 + (uint64_t)round, t, ntx[round], x, nrx[round], &req[round]));
    }
    DT_OK(dopt_wait(&req[ROUNDS])); /* completes the earlier ones too */
    for (round = 0; round <= ROUNDS; round++) {
        DT_OK(dopt_wait(&req[round]));
        for (p = 0; p < nrx[round]; p++) {
            const dopt_xfer *x = &rx[(size_t)round * (size_t)n + (size_t)p];
            const unsigned char *got = (const unsigned char *)x->buf;
            size_t i;
            for (i = 0; i < x->bytes; i++)
                DT_CHECKF(got[i] == conformance_xfer_byte(x->peer, r, round, i),
                          "conformance: rank %d: exchange round %d: byte %zu from rank %d is %d", r, round, i, x->peer,
                          got[i]);
            conformance_check_guards(x->buf, x->bytes, r, "exchange receive");
            conformance_release(x->buf, x->bytes);
        }
        for (p = 0; p < ntx[round]; p++) {
            dopt_xfer *t = &tx[(size_t)round * (size_t)n + (size_t)p];
            conformance_check_guards(t->buf, t->bytes, r, "exchange send");
            conformance_release(t->buf, t->bytes);
        }
    }
    DT_CHECK(c->traffic.calls[DOPT_COLL_EXCHANGE] == ROUNDS + 2);
    DT_CHECK(c->traffic.bytes[DOPT_COLL_EXCHANGE] == sent);
    DT_CHECKF(c->traffic.sent[DOPT_COLL_EXCHANGE] == sent && c->traffic.received[DOPT_COLL_EXCHANGE] == received,
              "conformance: rank %d: exchange traffic sent %llu received %llu, listed %llu and %llu", r,
              (unsigned long long)c->traffic.sent[DOPT_COLL_EXCHANGE],
              (unsigned long long)c->traffic.received[DOPT_COLL_EXCHANGE], (unsigned long long)sent,
              (unsigned long long)received);
    free(tx);
    free(rx);
}

/* ------------------------------------------------------------------ requests */

#define CONFORMANCE_INFLIGHT 10

/* Ten collectives in flight at once — allreduces on both sides of the latency/ring threshold and
   of every dtype, an allgather, a broadcast — waited for in reverse order of their start, the
   odd ones polled with dopt_test first: every result equals, bit for bit, the same call made
   blocking. Then a request waited twice, and one started on nothing. */
static void conformance_requests(dopt_comm *c) {
    static const size_t lens[8] = {1, 3, 1000, 16384, 70000, (1u << 20) + 7, 0, 5};
    static const dopt_dtype dts[8] = {DOPT_F32, DOPT_F64, DOPT_F32, DOPT_I32, DOPT_F32, DOPT_F32, DOPT_F64, DOPT_I64};
    static const dopt_op ops[8] = {DOPT_SUM, DOPT_MEAN, DOPT_MAX, DOPT_SUM, DOPT_MEAN, DOPT_SUM, DOPT_SUM, DOPT_MIN};
    dopt_request req[CONFORMANCE_INFLIGHT];
    void *got[8], *want[8];
    size_t gbytes = 3000, bbytes = 100000;
    unsigned char *gsend = (unsigned char *)conformance_alloc(gbytes);
    unsigned char *gall = (unsigned char *)conformance_alloc(gbytes * (size_t)c->size);
    unsigned char *gwant = (unsigned char *)malloc(gbytes * (size_t)c->size);
    unsigned char *bbuf = (unsigned char *)conformance_alloc(bbytes), *bwant = (unsigned char *)malloc(bbytes);
    int i, k, root = c->size - 1;
    size_t j;
    for (i = 0; i < 8; i++) {
        size_t bytes = lens[i] * dopt_dtype_size(dts[i]);
        got[i] = conformance_alloc(bytes);
        want[i] = malloc(bytes + 1);
        conformance_fill(want[i], lens[i], dts[i], c->rank, 1);
        if (bytes) memcpy(got[i], want[i], bytes);
        DT_OK(dopt_allreduce(c, want[i], lens[i], dts[i], ops[i]));
    }
    for (j = 0; j < gbytes; j++) gsend[j] = conformance_byte(c->rank, j);
    DT_OK(dopt_allgather(c, gsend, gwant, gbytes));
    for (j = 0; j < bbytes; j++) bwant[j] = c->rank == root ? conformance_byte(root, j) : 0;
    DT_OK(dopt_broadcast(c, bwant, bbytes, root));
    for (j = 0; j < bbytes; j++) bbuf[j] = c->rank == root ? conformance_byte(root, j) : 0;

    for (i = 0; i < 4; i++) DT_OK(dopt_allreduce_start(c, got[i], lens[i], dts[i], ops[i], &req[i]));
    DT_OK(dopt_allgather_start(c, gsend, gall, gbytes, &req[8]));
    for (i = 4; i < 8; i++) DT_OK(dopt_allreduce_start(c, got[i], lens[i], dts[i], ops[i], &req[i]));
    DT_OK(dopt_broadcast_start(c, bbuf, bbytes, root, &req[9]));
    for (k = CONFORMANCE_INFLIGHT - 1; k >= 0; k--) {
        int done = 0, polls = 0;
        if (k % 2)
            while (!done) {
                DT_OK(dopt_test(&req[k], &done));
                polls++;
                DT_CHECKF(polls < 100000000, "conformance: rank %d: request %d never completes under dopt_test", c->rank, k);
            }
        DT_OK(dopt_wait(&req[k]));
    }
    for (i = 0; i < 8; i++) {
        size_t bytes = lens[i] * dopt_dtype_size(dts[i]);
        conformance_check_guards(got[i], bytes, c->rank, "a request's allreduce");
        DT_CHECKF(bytes == 0 || memcmp(got[i], want[i], bytes) == 0,
                  "conformance: rank %d: request %d (%zu elems) differs from the blocking call", c->rank, i, lens[i]);
        conformance_release(got[i], bytes);
        free(want[i]);
    }
    conformance_check_guards(gall, gbytes * (size_t)c->size, c->rank, "a request's allgather");
    DT_CHECKF(memcmp(gall, gwant, gbytes * (size_t)c->size) == 0, "conformance: rank %d: allgather request differs", c->rank);
    conformance_check_guards(bbuf, bbytes, c->rank, "a request's broadcast");
    DT_CHECKF(memcmp(bbuf, bwant, bbytes) == 0, "conformance: rank %d: broadcast request differs", c->rank);
    DT_OK(dopt_wait(&req[0])); /* waiting again is harmless */
    DT_EQ_INT(dopt_wait(NULL), DOPT_ERR_INVALID);
    conformance_release(gsend, gbytes);
    conformance_release(gall, gbytes * (size_t)c->size);
    conformance_release(bbuf, bbytes);
    free(gwant);
    free(bwant);
}

__attribute__((unused)) static void conformance_run(dopt_comm *c) {
    DT_CHECK(c != NULL && c->size >= 1 && c->rank >= 0 && c->rank < c->size);
    DT_OK(dopt_barrier(c));
    conformance_traffic(c);
    conformance_allreduce_all(c);
    conformance_allgather_all(c);
    conformance_allgatherv_all(c);
    conformance_broadcast_all(c);
    conformance_many_small(c);
    conformance_requests(c);
    conformance_exchange(c);
    DT_OK(dopt_allreduce_weighted_mean(c, NULL, 0, DOPT_F32, 1.0 + c->rank));
    {
        double x[2] = {(double)c->rank, 1.0}, w = 1.0 + c->rank, sw = 0, swx = 0;
        int r;
        for (r = 0; r < c->size; r++) sw += 1.0 + r, swx += (1.0 + r) * r;
        DT_OK(dopt_allreduce_weighted_mean(c, x, 2, DOPT_F64, w));
        DT_NEAR(x[0], swx / sw, 1e-12);
        DT_NEAR(x[1], 1.0, 1e-12);
    }
    DT_OK(dopt_barrier(c));
    DT_CHECKF(c->error == DOPT_OK, "conformance: rank %d: communicator poisoned: %s", c->rank, dopt_comm_detail(c));
}

/* ------------------------------------------------------------------ mismatches */

static void conformance_expect_failure(dopt_comm *c, dopt_status s, const char *what) {
    dopt_status again;
    DT_CHECKF(s == DOPT_ERR_MISMATCH || s == DOPT_ERR_PEER_LOST, "conformance: rank %d: %s gave %d (%s), detail: %s",
              c->rank, what, (int)s, dopt_status_str(s), dopt_comm_detail(c));
    if (s == DOPT_ERR_MISMATCH)
        DT_CHECKF(strstr(dopt_comm_detail(c), "called") != NULL, "conformance: rank %d: %s: detail does not name the other side: %s",
                  c->rank, what, dopt_comm_detail(c));
    again = dopt_barrier(c);
    DT_CHECKF(again == s, "conformance: rank %d: after %s the communicator is not poisoned (barrier gave %d)", c->rank,
              what, (int)again);
}

__attribute__((unused)) static void conformance_mismatch_count(dopt_comm *c) {
    float buf[17] = {0};
    int last = c->rank == c->size - 1;
    DT_CHECK(c->size >= 2);
    DT_OK(dopt_allreduce(c, buf, 16, DOPT_F32, DOPT_SUM)); /* in step first */
    conformance_expect_failure(c, dopt_allreduce(c, buf, last ? 17 : 16, DOPT_F32, DOPT_SUM), "count mismatch");
}

/* The last rank exchanges under another tag: every rank fails (MISMATCH, or PEER_LOST), at the
   exchange or, when its own messages were not the mismatched ones, at the next call. */
__attribute__((unused)) static void conformance_mismatch_exchange(dopt_comm *c) {
    unsigned char out[9] = {0}, in[9];
    int last = c->rank == c->size - 1;
    dopt_xfer t = {(c->rank + 1) % c->size, out, 8}, x = {(c->rank + c->size - 1) % c->size, in, 8};
    dopt_status s;
    DT_CHECK(c->size >= 2);
    DT_OK(dopt_exchange(c, 7, &t, 1, &x, 1));
    s = dopt_exchange(c, last ? 8 : 7, &t, 1, &x, 1);
    if (s == DOPT_OK) s = dopt_barrier(c); /* a rank that got its message whole hears of it next */
    conformance_expect_failure(c, s, "exchange tag mismatch");
}

/* The last rank sends rank 0 one byte more than rank 0 expects: rank 0 fails with PROTOCOL,
   naming both sizes. */
__attribute__((unused)) static void conformance_exchange_size(dopt_comm *c) {
    unsigned char out[9] = {0}, in[9];
    int last = c->rank == c->size - 1;
    dopt_xfer t = {(c->rank + 1) % c->size, out, last ? 9u : 8u}, x = {(c->rank + c->size - 1) % c->size, in, 8};
    dopt_status s = dopt_exchange(c, 7, &t, 1, &x, 1);
    DT_CHECK(c->size >= 2);
    if (c->rank == 0) /* the others got what they expected, or hear of rank 0's failure */
        DT_CHECKF(s == DOPT_ERR_PROTOCOL && strstr(dopt_comm_detail(c), "9 payload bytes, 8 expected"),
                  "conformance: rank 0: size mismatch gave %d (%s): %s", (int)s, dopt_status_str(s),
                  dopt_comm_detail(c));
}

__attribute__((unused)) static void conformance_mismatch_op(dopt_comm *c) {
    float buf[16] = {0};
    int last = c->rank == c->size - 1;
    DT_CHECK(c->size >= 2);
    DT_OK(dopt_barrier(c));
    conformance_expect_failure(c, dopt_allreduce(c, buf, 16, DOPT_F32, last ? DOPT_MAX : DOPT_SUM), "op mismatch");
}

/* The last rank's second request asks for one element more, with three requests in flight: every
   request from the mismatched one on fails on every rank with the same status; the first one
   either completed before the failure was seen (and holds the sum) or fails the same way. */
__attribute__((unused)) static void conformance_mismatch_in_flight(dopt_comm *c) {
    float a[8] = {0}, b[9] = {0}, d[8] = {0};
    dopt_request r[3];
    int last = c->rank == c->size - 1;
    dopt_status s;
    DT_CHECK(c->size >= 2);
    DT_OK(dopt_barrier(c));
    DT_OK(dopt_allreduce_start(c, a, 8, DOPT_F32, DOPT_SUM, &r[0]));
    /* a backend that runs its collectives at start (shm, MPI) fails here already */
    (void)dopt_allreduce_start(c, b, last ? 9 : 8, DOPT_F32, DOPT_SUM, &r[1]);
    (void)dopt_allreduce_start(c, d, 8, DOPT_F32, DOPT_SUM, &r[2]);
    s = dopt_wait(&r[2]);
    conformance_expect_failure(c, s, "mismatch in flight");
    DT_EQ_INT(dopt_wait(&r[1]), s);
    if (dopt_wait(&r[0]) == DOPT_OK) {
        DT_CHECK(a[0] == 0.0f && a[7] == 0.0f);
    } else {
        DT_EQ_INT(dopt_wait(&r[0]), s);
    }
}

__attribute__((unused)) static void conformance_mismatch_kind(dopt_comm *c) {
    float buf[16] = {0};
    dopt_status s;
    DT_CHECK(c->size >= 2);
    DT_OK(dopt_barrier(c));
    if (c->rank == c->size - 1)
        s = dopt_broadcast(c, buf, sizeof buf, 0);
    else
        s = dopt_allreduce(c, buf, 16, DOPT_F32, DOPT_SUM);
    conformance_expect_failure(c, s, "collective mismatch");
}

#endif
