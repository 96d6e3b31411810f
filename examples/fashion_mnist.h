/* fashion_mnist.h — Fashion-MNIST from the Debian package dataset-fashion-mnist (gzip IDX files,
   read with zlib; link -lz): what the examples on it share. Not part of distopt. */
#ifndef DOPT_EXAMPLES_FASHION_MNIST_H
#define DOPT_EXAMPLES_FASHION_MNIST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <zlib.h>

#define FASHION_MNIST_DIR "/usr/share/datasets/fashion-mnist/"

static inline uint32_t idx_be32(gzFile f) {
    unsigned char b[4] = {0};
    if (gzread(f, b, 4) != 4) return 0;
    return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
}

/* An IDX file's items as bytes: images (magic 2051, 28×28 each) or labels (magic 2049); name is
   relative to FASHION_MNIST_DIR ("train-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", ...).
   Exits with a message naming the package when the file is missing, not IDX, or truncated. */
static inline unsigned char *load_idx(const char *name, uint32_t magic, size_t item_bytes, size_t *count) {
    char path[256];
    gzFile f;
    unsigned char *bytes;
    snprintf(path, sizeof path, FASHION_MNIST_DIR "%s", name);
    if ((f = gzopen(path, "rb")) == NULL || idx_be32(f) != magic) {
        fprintf(stderr, "cannot read %s as IDX (apt-get install dataset-fashion-mnist)\n", path);
        exit(1);
    }
    *count = idx_be32(f);
    if (magic == 2051) idx_be32(f), idx_be32(f); /* rows, columns */
    bytes = (unsigned char *)malloc(*count * item_bytes + 1);
    if (bytes == NULL || gzread(f, bytes, (unsigned)(*count * item_bytes)) != (int)(*count * item_bytes)) {
        fprintf(stderr, "%s: truncated\n", path);
        exit(1);
    }
    gzclose(f);
    return bytes;
}

#endif
