/* fuzz_compress_decode.c — libFuzzer target for every decoder in compress.h: the message
   validator and decode-and-accumulate of each codec, and the state loader.

   Build and run (clang 14 or later; make fuzz does this for every fuzz/fuzz_*.c):

       clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I. fuzz/fuzz_compress_decode.c -lm \
           -o build/fuzz_compress_decode
       mkdir -p build/corpus/fuzz_compress_decode
       build/fuzz_compress_decode -max_len=4096 -max_total_time=60 build/corpus/fuzz_compress_decode \
           fuzz/corpus/compress_decode

   Input: byte 0 picks the codec (mod 9) and byte 1 the layout and options (below); the rest is
   the message. With bit 7 of byte 1 set, the harness first writes a well-formed message header
   and sizes the input to the exact message length (cut or zero-filled), so the mutations reach
   the segment records and bodies instead of dying at the size check. The same bytes then go to
   dopt_compress_state_load. Decoding must return DOPT_OK, DOPT_ERR_NONFINITE (a well-formed
   message that says its sender's gradient was not finite) or DOPT_ERR_PROTOCOL, and a message
   that is not decoded must leave the accumulator untouched; ASan and UBSan catch any
   out-of-bounds access. PowerSGD (codec 8) has no message: its decode must return
   DOPT_ERR_UNSUPPORTED, and the bytes are for its state loader (bit 7 of byte 1 then sizes them
   to its state and writes a valid state header). fuzz/corpus/compress_decode/ holds valid
   messages of every codec (seeds, wire version 2, one flagged message per codec among them), a
   valid PowerSGD state, and any input that ever crashed the target. */
#define DOPT_NO_BLAS
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../compress.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Layouts small enough for -max_len=4096: odd sizes, a block boundary, an empty segment, and a
   segment below fp32_below; the matrices (10 × 13, 8 × 8) are PowerSGD's, the other codecs
   ignore their rows. */
static const dopt_segment layout_a[3] = {{0, 67, NULL}, {67, 0, NULL}, {70, 130, NULL, 10}};
static const dopt_segment layout_b[2] = {{0, 3, NULL}, {3, 64, NULL, 8}};
static const dopt_segment layout_c[1] = {{0, 1, NULL}};

static void fuzz_layout(unsigned sel, const dopt_segment **segs, size_t *nsegs, size_t *flat) {
    switch (sel % 3) {
    case 0: *segs = layout_a; *nsegs = 3; *flat = 200; break;
    case 1: *segs = layout_b; *nsegs = 2; *flat = 67; break;
    default: *segs = layout_c; *nsegs = 1; *flat = 1; break;
    }
}

static void fuzz_config(unsigned codec, unsigned sel, dopt_compressor_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->codec = (dopt_codec)(codec % 9);
    cfg->fp32_below = (sel & 4) ? 4 : 0;
    cfg->qsgd_levels = (sel & 8) ? 100 : 7; /* 8-bit and 4-bit codes */
    cfg->qsgd_bucket = (sel & 16) ? 50 : 512;
    cfg->topk_ratio = (sel & 32) ? 0.3 : 0.01;
    cfg->error_feedback = (sel & 64) ? DOPT_EF_ON : DOPT_EF_AUTO;
    cfg->powersgd_min = 1;                   /* every matrix compressed */
    cfg->powersgd_rank = (sel & 8) ? 1 : 2;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dopt_compressor cz;
    dopt_compressor_config cfg;
    const dopt_segment *segs;
    size_t nsegs, flat, bytes, i;
    unsigned char *msg;
    float out[200];
    dopt_buf acc;
    dopt_status s;
    int psgd;
    if (size < 2) return 0;
    fuzz_layout(data[1], &segs, &nsegs, &flat);
    fuzz_config(data[0], data[1], &cfg);
    if (dopt_compressor_init(&cz, &cfg, segs, nsegs) != DOPT_OK) return 0;
    psgd = cfg.codec == DOPT_CODEC_POWERSGD;
    bytes = size - 2;
    if (data[1] & 0x80) bytes = psgd ? dopt_compress_state_bytes(&cz) : dopt_compress_bound(&cz);
    msg = (unsigned char *)malloc(bytes ? bytes : 1);
    if (msg == NULL) {
        dopt_compressor_free(&cz);
        return 0;
    }
    memset(msg, 0, bytes);
    memcpy(msg, data + 2, size - 2 < bytes ? size - 2 : bytes);
    if ((data[1] & 0x80) && psgd) { /* a valid state header (PowerSGD has no message), the input after it */
        unsigned char *state = (unsigned char *)malloc(bytes);
        if (state != NULL && dopt_compress_state_save(&cz, state, bytes) == DOPT_OK) memcpy(msg, state, 32);
        free(state);
    } else if ((data[1] & 0x80) && bytes >= DOPT_COMPRESS_HEADER_BYTES) {
        dopt__write_header(&cz, &cz.view, 0, msg);
    }
    memset(out, 0, sizeof out);
    acc = dopt_buf_flat(out, flat, segs, nsegs);
    s = dopt_compress_decode(&cz, msg, bytes, 0.5f, &acc);
    if (psgd ? s != DOPT_ERR_UNSUPPORTED
                                         : s != DOPT_OK && s != DOPT_ERR_NONFINITE && s != DOPT_ERR_PROTOCOL)
        abort();
    if (s != DOPT_OK)
        for (i = 0; i < flat; i++)
            if (out[i] != 0.0f) abort(); /* a message not decoded touched the accumulator */
    (void)dopt_compress_state_load(&cz, msg, bytes);
    free(msg);
    dopt_compressor_free(&cz);
    return 0;
}
