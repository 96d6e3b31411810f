/* fuzz_tcp_frame.c — libFuzzer target for everything transport_tcp.h parses from a peer.

   Build and run (clang 14 or later):

       clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I. fuzz/fuzz_tcp_frame.c -lm \
           -o build/fuzz_tcp_frame
       mkdir -p build/corpus_tcp_frame          (new inputs go there, the seeds stay as they are)
       build/fuzz_tcp_frame -max_len=4096 -max_total_time=60 build/corpus_tcp_frame fuzz/corpus/tcp_frame

   Each input is used three ways:
   1. The decoders alone: the 96-byte handshake record, a peer-table entry and the 48-byte frame
      header (then checked against an expected collective), at the start of the input.
   2. The handshake: as what a stranger sends to a listening rank (which must refuse it or admit
      it, never crash or wait), and as rank 0's answer to a HELLO.
   3. The receive engine: a world of 2 over a socketpair where this process is one rank and the
      input is everything the other rank ever sends. Its first two bytes choose the collectives
      and the algorithm; the rest goes onto the wire, the connection is closed, and two
      collectives run. They must end (any status) without touching memory they should not.
   fuzz/corpus/tcp_frame/ holds the seed inputs (well-formed conversations) and any input that
   once crashed. */
#define DOPT_NO_BLAS
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_tcp.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void fuzz_decoders(const uint8_t *data, size_t size) {
    dopt__tcp_hs h;
    dopt__frame f;
    unsigned char addr[16];
    uint32_t port;
    if (size >= DOPT__TCP_HS_BYTES) (void)dopt__tcp_hs_decode(data, &h);
    if (size >= DOPT__TCP_ENTRY_BYTES) (void)dopt__tcp_entry_decode(data, addr, &port);
    if (size >= DOPT_FRAME_BYTES && dopt__frame_decode(data, &f) == NULL && f.type == DOPT__FRAME_DATA) {
        dopt_comm *c;
        dopt_coll_desc want;
        memset(&want, 0, sizeof want);
        want.kind = DOPT_COLL_ALLREDUCE;
        want.seq = 1;
        want.count = 4;
        if (dopt_comm_create_self(&c) != DOPT_OK) return;
        (void)dopt__frame_check(c, &want, 1, &f, 16);
        dopt_comm_destroy(c);
    }
}

/* Writes all of data into fd (a socketpair end with room for it) and closes it for writing. */
static void fuzz_feed(int fd, const uint8_t *data, size_t size) {
    size_t off = 0;
    while (off < size) {
        ssize_t n = send(fd, data + off, size - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n <= 0) break;
        off += (size_t)n;
    }
    shutdown(fd, SHUT_WR);
}

/* Rank 0 of a world of 3 reading a HELLO from an unauthenticated connection, and rank 1 reading
   rank 0's answer to its own HELLO: the input is what the other side sent. */
static void fuzz_handshake(const uint8_t *data, size_t size) {
    static const unsigned char addr[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1};
    dopt_tcp_config cfg;
    dopt_comm *c;
    dopt__tcp *t;
    dopt__tcp_pending q;
    int sv[2], r;
    memset(&cfg, 0, sizeof cfg);
    cfg.world_size = 3;
    cfg.token = "fuzz";
    cfg.timeout_ms = 1000;
    if (dopt__tcp_new(&c, &cfg) != DOPT_OK) return;
    t = (dopt__tcp *)c->impl;
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0) {
        memset(&q, 0, sizeof q);
        q.fd = sv[0];
        fuzz_feed(sv[1], data, size);
        while ((r = dopt__tcp_pending_read(c, t, &q, 1, 3)) == 0) continue;
        close(sv[1]); /* on success sv[0] now belongs to t, which closes it */
    }
    dopt_comm_destroy(c);
    cfg.rank = 1;
    if (dopt__tcp_new(&c, &cfg) != DOPT_OK) return;
    t = (dopt__tcp *)c->impl;
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0) {
        fuzz_feed(sv[1], data, size);
        (void)dopt__tcp_hello(c, t, sv[0], 0, addr, 4000, dopt__now_ms() + 1000, -1, "rank 0");
        close(sv[0]);
        close(sv[1]);
    }
    dopt_comm_destroy(c);
}

/* One collective chosen by sel, on buffers big enough for count elements of any type. */
static void fuzz_collective(dopt_comm *c, unsigned sel, size_t count) {
    static double buf[2 * 64], recv[2 * 64];
    size_t sizes[2];
    switch (sel % 5) {
    case 0: (void)dopt_allreduce(c, buf, count, (dopt_dtype)((sel / 5) % 4), (dopt_op)((sel / 20) % 4)); break;
    case 1: (void)dopt_allgather(c, buf, recv, count); break;
    case 2: (void)dopt_allgatherv(c, buf, count * (size_t)(c->rank + 1) % 97, recv, sizeof recv, sizes); break;
    case 3: (void)dopt_broadcast(c, buf, count * 8, (int)(sel / 5) % 2); break;
    default: (void)dopt_barrier(c); break;
    }
}

static void fuzz_engine(const uint8_t *data, size_t size) {
    int sv[2], fds[2];
    dopt_tcp_config cfg;
    dopt_comm *c = NULL;
    size_t count;
    unsigned sel;
    if (size < 2) return;
    sel = data[0];
    count = data[1] % 64u;
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return;
    memset(&cfg, 0, sizeof cfg);
    cfg.rank = (sel >> 7) & 1;
    cfg.world_size = 2;
    cfg.timeout_ms = 1000;
    cfg.spin_us = -1;
    cfg.small_bytes = (data[1] & 0x40) ? 1 : 0; /* 1: ring and chain for everything but 0 bytes */
    fds[cfg.rank] = -1;
    fds[1 - cfg.rank] = sv[0];
    if (dopt_tcp_create_from_sockets(&c, fds, &cfg) != DOPT_OK) {
        close(sv[1]);
        return;
    }
    fuzz_feed(sv[1], data + 2, size - 2);
    fuzz_collective(c, sel & 0x7F, count);
    fuzz_collective(c, (sel * 7 + 3) & 0x7F, count);
    dopt_comm_destroy(c);
    close(sv[1]);
}

/* The flight recorder is off: its 0.5 MiB ring for each of the communicators an input makes
   halved the runs per second; fuzz_recorder.c fuzzes what reads it. */
int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    setenv("DOPT_RECORDER", "0", 1);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_decoders(data, size);
    fuzz_handshake(data, size);
    fuzz_engine(data, size);
    return 0;
}
