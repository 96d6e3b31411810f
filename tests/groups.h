/* groups.h — dopt_comm_split and dopt_comm_split_host as every backend with links must keep
   them, as bodies that run on every rank of a world (of the size each names). Include after
   distopt.h, dtest.h and conformance.h.

   groups_of_parity(c)             parity groups ranked backwards pass the conformance suite
                                   beside their parent (any size >= 2);
   groups_in_flight(c)             parent and group requests in flight together, groups of
                                   groups and of one, a group number agreed after only some
                                   ranks split (4 ranks);
   split_colors(c)                 DOPT_UNDEFINED, and a bad color named (3 ranks);
   mismatch_across_groups(c)       a parent/group mix-up is named on both, poisoning both (2);
   group_failure_poisons_parent(c) a local failure in a group poisons the parent (2);
   groups_of_hosts(c)              split_host from the identity and from a host table (4). */
#ifndef DOPT_TEST_GROUPS_H
#define DOPT_TEST_GROUPS_H

#include <stdlib.h>
#include <string.h>

#define GROUPS_MAX_RANKS 8

/* Odd and even ranks, each ranked backwards (key -rank): both groups pass the conformance suite at
   once over the parent's links, and the parent still does after. */
__attribute__((unused)) static void groups_of_parity(dopt_comm *c) {
    dopt_comm *g;
    int x[1];
    DT_OK(dopt_comm_split(c, c->rank % 2, -c->rank, &g));
    DT_CHECK(g != NULL && g->size == (c->size + 1 - c->rank % 2) / 2);
    DT_EQ_INT(g->rank, g->size - 1 - c->rank / 2);
    x[0] = c->rank;
    DT_OK(dopt_allreduce(g, x, 1, DOPT_I32, DOPT_SUM));
    DT_EQ_INT(x[0], c->size == 4 ? (c->rank % 2 ? 4 : 2) : x[0]);
    conformance_run(g);
    conformance_run(c);
    dopt_comm_destroy(g);
    DT_OK(dopt_barrier(c));
}


/* Collectives of the parent and of a group in flight at once, waited for out of order; a group
   of a group; a group of one; a group made by some ranks only, then one by all. */
__attribute__((unused)) static void groups_in_flight(dopt_comm *c) {
    dopt_comm *pair, *one;
    dopt_request r[4];
    size_t n = (size_t)1 << 18, i;
    float *big = (float *)malloc(n * sizeof(float)), small[3];
    int ranks[GROUPS_MAX_RANKS], seven = 7;
    DT_CHECK(big != NULL);
    DT_OK(dopt_comm_split(c, c->rank / 2, 0, &pair)); /* {0, 1}, {2, 3} */
    for (i = 0; i < n; i++) big[i] = (float)(c->rank + 1);
    for (i = 0; i < 3; i++) small[i] = (float)c->rank;
    DT_OK(dopt_allreduce_start(c, big, n, DOPT_F32, DOPT_SUM, &r[0]));
    DT_OK(dopt_allreduce_start(pair, small, 3, DOPT_F32, DOPT_MAX, &r[1]));
    DT_OK(dopt_allgather_start(c, &c->rank, ranks, sizeof(int), &r[2]));
    DT_OK(dopt_broadcast_start(pair, &seven, sizeof seven, 1, &r[3]));
    for (i = 4; i-- > 0;) DT_OK(dopt_wait(&r[i]));
    for (i = 0; i < n; i++) DT_CHECKF(big[i] == 10.0f, "rank %d: element %zu is %g", c->rank, i, (double)big[i]);
    for (i = 0; i < 3; i++) DT_CHECK(small[i] == (float)(c->rank | 1));
    for (i = 0; i < (size_t)c->size; i++) DT_EQ_INT(ranks[i], (int)i);
    DT_OK(dopt_comm_split(pair, pair->rank, 0, &one));
    DT_CHECK(one != NULL && one->size == 1 && one->rank == 0);
    DT_OK(dopt_allreduce(one, small, 3, DOPT_F32, DOPT_SUM));
    DT_OK(dopt_barrier(one));
    DT_OK(dopt_allreduce(pair, big, n, DOPT_F32, DOPT_MEAN));
    DT_CHECK(big[0] == 10.0f && big[n - 1] == 10.0f);
    DT_CHECK(pair->traffic.calls[DOPT_COLL_ALLREDUCE] == 2 && c->traffic.calls[DOPT_COLL_BROADCAST] == 0);
    { /* only the first pair makes another group: the next group of all must still agree its number */
        dopt_comm *extra = NULL, *everyone;
        int x = 1;
        if (c->rank < 2) DT_OK(dopt_comm_split(pair, 0, 0, &extra));
        DT_OK(dopt_comm_split(c, 0, 0, &everyone));
        DT_OK(dopt_allreduce(everyone, &x, 1, DOPT_I32, DOPT_SUM));
        DT_EQ_INT(x, c->size);
        dopt_comm_destroy(everyone);
        dopt_comm_destroy(extra);
    }
    dopt_comm_destroy(one);
    dopt_comm_destroy(pair);
    free(big);
}


/* DOPT_UNDEFINED joins nothing; a color below it fails every rank, naming the rank. */
__attribute__((unused)) static void split_colors(dopt_comm *c) {
    dopt_comm *g = (dopt_comm *)1;
    DT_OK(dopt_comm_split(c, c->rank == 0 ? DOPT_UNDEFINED : 1, 0, &g));
    DT_CHECK(c->rank == 0 ? g == NULL : (g != NULL && g->size == c->size - 1 && g->rank == c->rank - 1));
    if (g) {
        DT_OK(dopt_barrier(g));
        dopt_comm_destroy(g);
    }
    DT_EQ_INT(dopt_comm_split(c, c->rank == 2 ? -5 : 0, 0, &g), DOPT_ERR_INVALID);
    DT_CHECK(g == NULL);
    DT_CHECKF(strstr(dopt_comm_detail(c), "rank 2 passed color -5") != NULL, "detail: %s", dopt_comm_detail(c));
}


/* Rank 0 allreduces on the parent while rank 1 allreduces on their common group: both are told
   of the mismatch, naming the group, and the parent and the group are both poisoned. */
__attribute__((unused)) static void mismatch_across_groups(dopt_comm *c) {
    dopt_comm *g, *mine, *other;
    float x[4] = {0};
    dopt_status s;
    DT_OK(dopt_comm_split(c, 0, 0, &g));
    mine = c->rank == 0 ? c : g;
    other = c->rank == 0 ? g : c;
    s = dopt_allreduce(mine, x, 4, DOPT_F32, DOPT_SUM);
    DT_CHECKF(s == DOPT_ERR_MISMATCH || s == DOPT_ERR_PEER_LOST, "rank %d: %d: %s", c->rank, (int)s,
              dopt_comm_detail(mine));
    DT_CHECKF(strstr(dopt_comm_detail(mine), "in group 1") != NULL, "detail: %s", dopt_comm_detail(mine));
    /* the other one is poisoned too, with the same status and detail, at once */
    DT_EQ_INT(dopt_barrier(other), s);
    DT_CHECKF(strcmp(dopt_comm_detail(other), dopt_comm_detail(mine)) == 0, "rank %d: \"%s\" after \"%s\"", c->rank,
              dopt_comm_detail(other), dopt_comm_detail(mine));
    dopt_comm_destroy(g);
}

/* A failure that needs no peer to notice (a NULL buffer on every rank) poisons the group's parent
   just the same. */
__attribute__((unused)) static void group_failure_poisons_parent(dopt_comm *c) {
    dopt_comm *g;
    DT_OK(dopt_comm_split(c, 0, 0, &g));
    DT_EQ_INT(dopt_allreduce(g, NULL, 4, DOPT_F32, DOPT_SUM), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_barrier(c), DOPT_ERR_INVALID);
    DT_CHECKF(strcmp(dopt_comm_detail(c), dopt_comm_detail(g)) == 0, "rank %d: \"%s\" after \"%s\"", c->rank,
              dopt_comm_detail(c), dopt_comm_detail(g));
    dopt_comm_destroy(g);
}


/* Hosts from the backend's table, and (without one) from the host's identity: one machine here. */
__attribute__((unused)) static void groups_of_hosts(dopt_comm *c) {
    static const int hosts[4] = {5, 5, 9, 9};
    dopt_comm *h;
    int x = c->rank;
    DT_OK(dopt_comm_split_host(c, &h));
    DT_CHECK(h != NULL && h->size == c->size && h->rank == c->rank);
    dopt_comm_destroy(h);
    DT_OK(dopt_comm_set_hosts(c, hosts, DOPT_TWO_LEVEL_AUTO));
    DT_OK(dopt_comm_split_host(c, &h));
    DT_CHECK(h != NULL && h->size == 2 && h->rank == c->rank % 2);
    DT_OK(dopt_allreduce(h, &x, 1, DOPT_I32, DOPT_SUM));
    DT_EQ_INT(x, c->rank < 2 ? 1 : 5);
    dopt_comm_destroy(h);
}

#endif
