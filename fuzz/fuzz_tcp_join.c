/* fuzz_tcp_join.c — libFuzzer target for the joiner's handshake of transport_tcp.h (RE-ADMIT:
   THE JOINER'S HANDSHAKE), both sides, from memory: no socket, no communicator, so that it runs
   at hundreds of thousands of inputs a second.

   Build and run (clang 14 or later; make fuzz does both):

       clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I. fuzz/fuzz_tcp_join.c -lm \
           -o build/fuzz_tcp_join
       mkdir -p build/corpus_tcp_join
       build/fuzz_tcp_join -max_len=4096 -max_total_time=60 build/corpus_tcp_join fuzz/corpus/tcp_join

   Input: byte 0 flags, byte 1 the size of the pieces the bytes arrive in (1..64), the rest what
   the other side sends. Each input is used three ways:
   1. The record decoder on every 64 bytes of the rest.
   2. A member serving a joiner: the rest is what the joiner sends. With flag 1, the record that
      follows a CHALLENGE is made a valid ANSWER first (its header and the proof of the job's
      token), so that what happens after the joiner is held is reached too.
   3. A joiner asking a member: the rest is the member's side. With flag 2, its first record is
      made a valid CHALLENGE (header, a proof over the epoch, size and rank it states).
   Each side must end held, refused or waiting for more, never read or write outside its
   buffers; a side that replied must have replied with a well-formed record; a member may hold
   only a joiner whose answer carried the right proof. fuzz/corpus/tcp_join/ holds the seeds. */
#define DOPT_NO_BLAS
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_tcp.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static unsigned char fuzz_token[DOPT_TCP_TOKEN_MAX] = "fuzz token";
static const unsigned char fuzz_nonce_m[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const unsigned char fuzz_nonce_j[16] = {16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1};
static const unsigned char fuzz_addr[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7};

/* A reply must decode; a hold must follow a right proof (the member's word for it is checked
   against the proof computed here). */
static void fuzz_check_reply(const unsigned char *out) {
    dopt__join_rec r;
    if (dopt__join_decode(out, &r) != NULL) abort();
}

static void fuzz_member(unsigned flags, size_t piece, unsigned char *in, size_t n) {
    dopt__join_side m;
    unsigned char out[DOPT__TCP_JOIN_BYTES];
    size_t off = 0;
    int reply, patched = 0;
    dopt__join_serve_init(&m, fuzz_token, fuzz_nonce_m, 3, 4, 1);
    while (off < n) {
        size_t k = n - off < piece ? n - off : piece, used;
        int before = m.stage;
        if ((flags & 1) && !patched && m.stage == DOPT__JOIN_WAIT_REPLY && m.got == 0 &&
            n - off >= DOPT__TCP_JOIN_BYTES) { /* the next record: a valid ANSWER */
            unsigned char stated[18];
            memcpy(in + off, "DJON", 4);
            in[off + 4] = DOPT__TCP_JOIN_VERSION, in[off + 5] = DOPT__JOIN_ANSWER, in[off + 6] = in[off + 7] = 0;
            dopt__join_joiner_stated(m.addr, m.port, stated);
            dopt__join_proof(m.key, 'J', m.nonce_j, m.nonce_m, stated, 18, in + off + 8);
            patched = 1;
        }
        used = dopt__join_feed(&m, 1, in + off, k, out, &reply);
        if (reply) fuzz_check_reply(out);
        if (m.stage == DOPT__JOIN_HELD && before != DOPT__JOIN_HELD && !patched) abort(); /* held without the proof */
        if (used == 0) break;
        off += used;
    }
}

static void fuzz_joiner(unsigned flags, size_t piece, unsigned char *in, size_t n) {
    dopt__join_side j;
    unsigned char out[DOPT__TCP_JOIN_BYTES], ask[DOPT__TCP_JOIN_BYTES];
    size_t off = 0;
    int reply;
    dopt__join_ask_init(&j, fuzz_token, fuzz_nonce_j, fuzz_addr, 4000, ask);
    fuzz_check_reply(ask);
    if ((flags & 2) && n >= DOPT__TCP_JOIN_BYTES) { /* the first record: a valid CHALLENGE */
        dopt__join_rec r;
        unsigned char stated[12];
        memcpy(in, "DJON", 4);
        in[4] = DOPT__TCP_JOIN_VERSION, in[5] = DOPT__JOIN_CHALLENGE, in[6] = in[7] = 0;
        r.epoch = dopt__get_le32(in + 40), r.size = dopt__get_le32(in + 44), r.rank = dopt__get_le32(in + 48);
        dopt__join_member_stated(&r, stated);
        dopt__join_proof(j.key, 'M', fuzz_nonce_j, in + 8, stated, 12, in + 24);
    }
    while (off < n) {
        size_t k = n - off < piece ? n - off : piece, used = dopt__join_feed(&j, 0, in + off, k, out, &reply);
        if (reply) fuzz_check_reply(out);
        if (used == 0) break;
        off += used;
    }
    if (j.stage == DOPT__JOIN_REFUSED && j.why == NULL) abort(); /* every refusal says why */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static unsigned char copy[4096];
    dopt__join_rec r;
    size_t i, n, piece;
    unsigned flags;
    if (size < 2 || size - 2 > sizeof copy) return 0;
    flags = data[0];
    piece = 1 + data[1] % DOPT__TCP_JOIN_BYTES;
    n = size - 2;
    for (i = 0; i + DOPT__TCP_JOIN_BYTES <= n; i += DOPT__TCP_JOIN_BYTES) (void)dopt__join_decode(data + 2 + i, &r);
    memcpy(copy, data + 2, n);
    fuzz_member(flags, piece, copy, n);
    memcpy(copy, data + 2, n);
    fuzz_joiner(flags, piece, copy, n);
    return 0;
}
