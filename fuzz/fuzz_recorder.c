/* fuzz_recorder.c — libFuzzer target for distopt-inspect's reading of flight recorder files
   (tools/distopt-inspect.c): the parser, then the analysis of a job made of what it parsed, and
   the file-name parser. A file another process wrote, or a damaged one, must be refused or its
   bad entries skipped: never read out of bounds, never crash.

   Build and run (make fuzz does this for every fuzz/fuzz_*.c):

       clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -I. fuzz/fuzz_recorder.c -lm \
           -o build/fuzz_recorder
       mkdir -p build/corpus/fuzz_recorder
       build/fuzz_recorder -max_len=4096 -max_total_time=60 build/corpus/fuzz_recorder fuzz/corpus/recorder

   Input: byte 0's bit 0 set makes the harness write a valid header first (magic, version, sizes,
   a capacity that fits the input, a rank below the size, a state) over the input's first bytes,
   so that mutations reach the entries and the analysis; the rest of the header (written, pid,
   the detail) stays the input's. The bytes are copied to an aligned buffer, as a mapping is. */
#define DOPT_INSPECT_NO_MAIN
#include "../tools/distopt-inspect.c"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void fuzz_fix_header(unsigned char *buf, size_t len) {
    dopt_rec_header h;
    memcpy(&h, buf, sizeof h);
    h.magic = DOPT_REC_MAGIC;
    h.version = DOPT_REC_VERSION;
    h.header_bytes = DOPT_REC_HEADER_BYTES;
    h.entry_bytes = sizeof(dopt_rec_entry);
    h.capacity = (uint32_t)((len - DOPT_REC_HEADER_BYTES) / sizeof(dopt_rec_entry));
    if (h.capacity == 0) h.capacity = 1;
    h.size = 1 + (int32_t)((uint32_t)h.size % 8u);
    h.rank = (int32_t)((uint32_t)h.rank % (uint32_t)h.size);
    h.state = 1 + (h.state & 1u);
    h.pid = 0; /* never a live process: the harness must not signal one */
    memcpy(buf, &h, sizeof h);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    unsigned char *buf = (unsigned char *)aligned_alloc(64, (size / 64 + 1) * 64);
    inspect_rank r;
    inspect_job j;
    inspect_verdict v;
    char why[256], name[64];
    uint64_t hash;
    int rank;
    if (buf == NULL) return 0;
    memcpy(buf, data, size);
    if (size >= DOPT_REC_HEADER_BYTES && (data[0] & 1u)) fuzz_fix_header(buf, size);
    if (inspect_parse(buf, size, 1, &r, why, sizeof why) == 0) {
        inspect_process(&r);
        memset(&j, 0, sizeof j);
        j.size = r.hdr.size;
        j.ranks = (inspect_rank *)calloc((size_t)j.size, sizeof(inspect_rank));
        if (j.ranks != NULL) {
            j.ranks[r.hdr.rank] = r;
            j.found = 1;
            inspect_verdict_of(&j, &v);
            inspect_job_free(&j);
        } else {
            inspect_rank_free(&r);
        }
    }
    memcpy(name, data, size < sizeof name - 1 ? size : sizeof name - 1);
    name[size < sizeof name - 1 ? size : sizeof name - 1] = '\0';
    inspect_name(name, &hash, &rank);
    free(buf);
    return 0;
}
