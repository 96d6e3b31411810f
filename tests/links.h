/* links.h — the link contract of dopt_comm_vtable (distopt.h, WRITING A BACKEND) checked on any
   backend that has links, below the engine. Include after distopt.h and dtest.h.

   links_conformance(c)   every rank streams to every peer at once, through link_send alone:
                          one byte, parts with a zero-length one among them, a kilobyte, a
                          message of several MiB (far beyond any ring, slot or socket buffer,
                          so it goes in many partial sends that link_wait(OUT) paces), then a
                          few small parts, then link_close. Every rank reads every peer's stream
                          with link_recv into buffers of 7 bytes to 1 MiB and checks each byte
                          (its value encodes the pair and the offset, so loss, duplication and
                          reordering all show), then the end of the stream (-1, err 0) after the
                          last byte, and nothing after it.

   It uses the links directly, so the communicator is not usable for collectives afterwards:
   run it last, then destroy. A failed check _exit(1)s the rank (dtest's DT_*). */
#ifndef DOPT_TEST_LINKS_H
#define DOPT_TEST_LINKS_H

#include <stdlib.h>
#include <string.h>

#define LINKS_MAX_RANKS 16
#define LINKS_LARGE (((size_t)3 << 20) + 13)
#define LINKS_STEPS 5
#define LINKS_PARTS 3

/* The parts of each step of a stream (links_nparts of them); the large one is LINKS_LARGE. */
static const size_t links_plan[LINKS_STEPS][LINKS_PARTS] = {
    {1, 0, 0}, {5, 0, 9}, {1000, 0, 0}, {LINKS_LARGE, 0, 0}, {3, 4, 5}};
static const int links_nparts[LINKS_STEPS] = {1, 3, 1, 1, 3};

static unsigned char links_byte(int from, int to, size_t at) {
    return (unsigned char)((size_t)from * 131u + (size_t)to * 29u + at * 7u + (at >> 8));
}

static size_t links_step_bytes(int step) {
    size_t n = 0;
    int k;
    for (k = 0; k < links_nparts[step]; k++) n += links_plan[step][k];
    return n;
}

typedef struct links_peer {
    int step;         /* the step being sent */
    size_t step_sent; /* bytes of it sent */
    size_t sent;      /* bytes of the whole stream sent */
    int tx_done, tx_blocked;
    size_t got;       /* bytes received */
    int rx_ended;
} links_peer;

/* One send to q from where its stream stands: the parts of the step not yet sent, as they are
   (a zero-length one included). */
static void links_send_some(dopt_comm *c, int q, links_peer *P, unsigned char *src) {
    dopt_iov iov[LINKS_PARTS];
    size_t skip = P->step_sent, total = 0, i;
    int n = 0, k, err = 0;
    long wrote;
    for (k = 0; k < links_nparts[P->step]; k++) {
        size_t len = links_plan[P->step][k];
        if (skip > 0 && skip >= len) { /* sent already */
            skip -= len;
            continue;
        }
        iov[n].base = src + total;
        iov[n].len = len - skip;
        total += len - skip;
        skip = 0;
        n++;
    }
    for (i = 0; i < total; i++) src[i] = links_byte(c->rank, q, P->sent + i);
    wrote = c->vt->link_send(c, q, iov, n, &err);
    DT_CHECKF(wrote >= 0, "rank %d: link_send to %d failed: %s", c->rank, q, strerror(err));
    DT_CHECKF((size_t)wrote <= total, "rank %d: link_send to %d wrote %ld of %zu bytes", c->rank, q, wrote, total);
    P->tx_blocked = wrote == 0;
    P->sent += (size_t)wrote;
    P->step_sent += (size_t)wrote;
    if (P->step_sent == links_step_bytes(P->step)) {
        P->step_sent = 0;
        if (++P->step == LINKS_STEPS) {
            c->vt->link_close(c, q);
            P->tx_done = 1;
        }
    }
}

static void links_recv_some(dopt_comm *c, int q, links_peer *P, unsigned char *dst, size_t total, unsigned round) {
    static const size_t caps[4] = {7, 4096, 65536 + 3, (size_t)1 << 20};
    size_t cap = caps[round % 4], i;
    int err = 0;
    long n = c->vt->link_recv(c, q, dst, cap, &err);
    if (n < 0) {
        DT_CHECKF(err == 0, "rank %d: the link from %d failed: %s", c->rank, q, strerror(err));
        DT_CHECKF(P->got == total, "rank %d: the stream from %d ended after %zu of %zu bytes", c->rank, q, P->got,
                  total);
        P->rx_ended = 1;
        return;
    }
    DT_CHECKF((size_t)n <= cap, "rank %d: link_recv from %d gave %ld bytes into %zu", c->rank, q, n, cap);
    DT_CHECKF(P->got + (size_t)n <= total, "rank %d: %zu bytes from %d, more than the %zu sent", c->rank,
              P->got + (size_t)n, q, total);
    for (i = 0; i < (size_t)n; i++)
        if (dst[i] != links_byte(q, c->rank, P->got + i))
            DT_CHECKF(0, "rank %d: byte %zu from %d is %u, not %u", c->rank, P->got + i, q, dst[i],
                      links_byte(q, c->rank, P->got + i));
    P->got += (size_t)n;
}

__attribute__((unused)) static void links_conformance(dopt_comm *c) {
    links_peer peers[LINKS_MAX_RANKS];
    dopt_link_poll polls[LINKS_MAX_RANKS];
    unsigned char *src = (unsigned char *)malloc(LINKS_LARGE + 64), *dst = (unsigned char *)malloc((size_t)1 << 20);
    size_t total = 0;
    unsigned round = 0;
    int q, s, left = 0, idle = 0;
    DT_CHECK(c->size <= LINKS_MAX_RANKS && src != NULL && dst != NULL);
    DT_CHECK(c->vt->link_send != NULL);
    for (s = 0; s < LINKS_STEPS; s++) total += links_step_bytes(s);
    memset(peers, 0, sizeof peers);
    for (q = 0; q < c->size; q++) left += q != c->rank ? 2 : 0; /* a stream each way */
    while (left > 0) {
        int np = 0, i, err = 0, moved = 0;
        for (q = 0; q < c->size; q++) {
            links_peer *P = &peers[q];
            size_t before_tx = P->sent, before_rx = P->got;
            int was_ended = P->rx_ended, was_done = P->tx_done;
            if (q == c->rank) continue;
            if (!P->tx_done && !P->tx_blocked) links_send_some(c, q, P, src);
            if (!P->rx_ended) links_recv_some(c, q, P, dst, total, round++);
            left -= (P->tx_done && !was_done) + (P->rx_ended && !was_ended);
            moved |= P->sent != before_tx || P->got != before_rx || P->tx_done != was_done || P->rx_ended != was_ended;
        }
        if (moved) {
            idle = 0;
            continue;
        }
        for (q = 0; q < c->size; q++) {
            links_peer *P = &peers[q];
            short ev = 0;
            if (q == c->rank) continue;
            if (!P->rx_ended) ev |= DOPT_LINK_IN;
            if (!P->tx_done && P->tx_blocked) ev |= DOPT_LINK_OUT;
            if (!ev) continue;
            polls[np].peer = q;
            polls[np].events = ev;
            polls[np++].revents = 0;
        }
        if (np == 0) continue;
        i = c->vt->link_wait(c, polls, np, 1000, &err);
        DT_CHECKF(i >= 0, "rank %d: link_wait failed: %s", c->rank, strerror(err));
        DT_CHECKF(++idle < 30, "rank %d: no link moved for 30 s", c->rank);
        for (i = 0; i < np; i++)
            if (polls[i].revents & DOPT_LINK_OUT) peers[polls[i].peer].tx_blocked = 0;
    }
    free(src);
    free(dst);
}

#endif
