/* The host-aware allreduce on a real network: every rank of a TCP job started from DOPT_*
   variables (tests/check_cluster.sh starts 8 on 4 simulated hosts) runs
   - the conformance suite (every collective, dtype and op against a serial reference, the same
     bits on every rank and on a repeat) with the transport's choice of schedule, which is the
     two-level one for large allreduces when ranks share hosts;
   - TernGrad's and majority vote's integer ring by host against their allgather (the same bits);
   - a 16 MiB integer-valued allreduce with the two-level schedule and again with the flat ring
     (the host table dropped): the same bits, equal to the serial sum;
   then, for groups, the conformance suite on dopt_comm_split_host's group (the two ranks of the
   host) and on a group of one rank per host; and the even ranks (the first of each host: the
   script puts two on each) say how many bytes
   their host's eth0 sent during each of the two, which the script compares: the two-level
   schedule must send less over the host's link.
   Prints "cluster_allreduce: rank R ok" (and, on the even ranks,
   "cluster_allreduce: host tx two_level=B flat=B bytes=S"). Exit status 1 on a failed check. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_tcp.h"
#include "../compress.h"
#include "dtest.h"
#include "conformance.h"

static long long eth0_tx(void) {
    FILE *f = fopen("/sys/class/net/eth0/statistics/tx_bytes", "r");
    long long v = -1;
    if (f == NULL) return -1;
    if (fscanf(f, "%lld", &v) != 1) v = -1;
    fclose(f);
    return v;
}

/* Sends of this host during one allreduce of x (the host's ranks meet in barriers around it). */
static long long host_tx_during(dopt_comm *c, float *x, size_t n) {
    long long before;
    DT_OK(dopt_barrier(c));
    before = eth0_tx();
    DT_OK(dopt_allreduce(c, x, n, DOPT_F32, DOPT_SUM));
    DT_OK(dopt_barrier(c));
    return eth0_tx() - before;
}

static float int_value(int rank, size_t i) { return (float)((int)((i * 7 + (size_t)rank * 13) % 201) - 100); }

/* TernGrad's integer ring across the hosts, by host (TCP knows them), against the allgather of
   the messages: the same bits; then majority vote the same way. */
static void compressed_by_host(dopt_comm *c) {
    size_t m = (size_t)1 << 20, i;
    dopt_segment segs[2] = {{0, ((size_t)1 << 20) - 1000, "w", 0}, {((size_t)1 << 20) - 1000, 1000, "b", 0}};
    float *g = (float *)malloc(m * sizeof(float)), *h = (float *)malloc(m * sizeof(float));
    int k;
    DT_CHECK(g != NULL && h != NULL);
    for (k = 0; k < 2; k++) {
        dopt_compressor ring, ag;
        dopt_compressor_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.codec = k ? DOPT_CODEC_MAJORITY : DOPT_CODEC_TERNARY;
        cfg.seed = 11;
        cfg.aggregate = DOPT_AGG_RING;
        DT_OK(dopt_compressor_init(&ring, &cfg, segs, 2));
        cfg.aggregate = DOPT_AGG_ALLGATHER;
        DT_OK(dopt_compressor_init(&ag, &cfg, segs, 2));
        for (i = 0; i < m; i++) g[i] = h[i] = int_value(c->rank, i) * 1e-3f;
        DT_OK(dopt_compress_allreduce(&ring, c, g, m));
        DT_OK(dopt_compress_allreduce(&ag, c, h, m));
        DT_CHECKF(ring.path == DOPT_PATH_RING_TWO_LEVEL && ag.path == DOPT_PATH_ALLGATHER, "rank %d: paths %d, %d",
                  c->rank, (int)ring.path, (int)ag.path);
        DT_CHECKF(memcmp(g, h, m * sizeof(float)) == 0, "rank %d: %s: the ring by host and the allgather differ",
                  c->rank, dopt_codec_name(cfg.codec));
        dopt_compressor_free(&ring);
        dopt_compressor_free(&ag);
    }
    free(g);
    free(h);
}

int main(void) {
    dopt_comm *c;
    size_t n = (size_t)4 << 20, i;
    float *two, *flat;
    long long tx_two, tx_flat;
    dopt_status s = dopt_tcp_create_from_env(&c, NULL);
    dtest_current = "cluster_allreduce";
    if (s != DOPT_OK) {
        fprintf(stderr, "cluster_allreduce: cannot create the communicator: %s\n", dopt_status_str(s));
        return 1;
    }
    dopt_comm_set_timeout(c, 60000);
    conformance_run(c);
    compressed_by_host(c);
    two = (float *)malloc(n * sizeof(float));
    flat = (float *)malloc(n * sizeof(float));
    DT_CHECK(two != NULL && flat != NULL);
    for (i = 0; i < n; i++) two[i] = flat[i] = int_value(c->rank, i);
    tx_two = host_tx_during(c, two, n);
    DT_OK(dopt_comm_set_hosts(c, NULL, DOPT_TWO_LEVEL_AUTO)); /* no host table: the flat ring */
    tx_flat = host_tx_during(c, flat, n);
    DT_CHECKF(memcmp(two, flat, n * sizeof(float)) == 0, "rank %d: the two-level and flat results differ", c->rank);
    for (i = 0; i < n; i++) {
        double want = 0;
        int r;
        for (r = 0; r < c->size; r++) want += int_value(r, i);
        DT_CHECKF((double)two[i] == want, "rank %d: element %zu is %g, the serial sum %g", c->rank, i, (double)two[i], want);
    }
    { /* groups over the cluster: this host's ranks (the TCP host table), and one rank of each host */
        dopt_comm *host, *across;
        DT_OK(dopt_comm_split_host(c, &host));
        DT_CHECKF(host != NULL && host->size == 2 && host->rank == c->rank % 2, "rank %d: host group %d of %d", c->rank,
                  host ? host->rank : -1, host ? host->size : -1);
        DT_OK(dopt_comm_split(c, c->rank % 2, c->rank, &across));
        conformance_run(host);
        conformance_run(across);
        dopt_comm_destroy(across);
        dopt_comm_destroy(host);
    }
    if (c->rank % 2 == 0)
        printf("cluster_allreduce: host tx two_level=%lld flat=%lld bytes=%zu\n", tx_two, tx_flat, n * sizeof(float));
    printf("cluster_allreduce: rank %d ok\n", c->rank);
    free(two);
    free(flat);
    dopt_comm_destroy(c);
    return 0;
}
