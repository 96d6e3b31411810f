/* Tests of surviving a lost rank (distopt.h: SURVIVING A LOST PEER; transport_tcp.h: SURVIVING A
   LOST RANK; engine.h: SHRINK: THE SURVIVORS' AGREEMENT).

   The agreement's rules run first over random schedules of a simulated world (deaths at any
   point, a rank dying half-way through telling its decision, messages delivered in any order
   a FIFO link allows, a link's end seen only after what was written before it): every rank that
   decides decides the same set, the set holds the failure's culprit and no rank still alive,
   and every live rank decides.

   Then real worlds over TCP on loopback: forked ranks run allreduces, one SIGKILLs itself at a
   chosen step (rank 0 included, and before the first collective completed), the survivors
   shrink and go on; each survivor reports its new rank, size, epoch, the old ranks of the new
   communicator (an allgather on it) and the sums of its allreduces after the shrink, and the
   parent checks that they are the same everywhere and right. Also: a second death while the
   survivors agree, fewer survivors than min_ranks (a clear error on every survivor, nothing
   hangs), strangers and a wrong token at the listening socket, the refusals, the environment.
   No test asserts a time; the time a shrink took is printed. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_tcp.h"
#include "../transport_shm.h"
#include "../localsgd.h"
#include "dtest.h"

#include <signal.h>
#include <sys/time.h>
#include <sys/wait.h>

/* ===================================================================== THE RULES, SIMULATED */

#define SIM_MAX 9
#define SIM_QMAX 64

typedef struct sim_msg {
    int eof;             /* the sender died: nothing after this */
    uint64_t value;      /* a decision (n <= 64: one word) */
} sim_msg;

typedef struct sim_link {
    sim_msg q[SIM_QMAX];
    int head, tail;
} sim_link;

typedef struct sim {
    int n;
    dopt__agree a[SIM_MAX];
    int dead[SIM_MAX];       /* 1 once it died */
    int dies_after[SIM_MAX]; /* dies after sending this many decision messages (-1: never) */
    int told[SIM_MAX];       /* decision messages sent */
    int sent_all[SIM_MAX];
    sim_link link[SIM_MAX][SIM_MAX];
    uint64_t rng;
} sim;

static uint64_t sim_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void sim_push(sim *S, int from, int to, int eof, uint64_t value) {
    sim_link *L = &S->link[from][to];
    DT_CHECK(L->tail < SIM_QMAX);
    L->q[L->tail].eof = eof;
    L->q[L->tail++].value = value;
}

static void sim_die(sim *S, int p) {
    int q;
    S->dead[p] = 1;
    for (q = 0; q < S->n; q++)
        if (q != p) sim_push(S, p, q, 1, 0); /* the end, behind whatever it wrote */
}

/* One random world: returns 1 when it ran to the end (every check passed). */
static int sim_world(uint64_t seed) {
    sim S;
    int p, q, culprit, steps = 0;
    memset(&S, 0, sizeof S);
    S.rng = seed;
    S.n = 2 + (int)(sim_next(&S.rng) % (SIM_MAX - 1));
    culprit = (int)(sim_next(&S.rng) % (uint64_t)S.n);
    for (p = 0; p < S.n; p++) {
        DT_OK(dopt__agree_init(&S.a[p], S.n, p));
        S.dies_after[p] = -1;
        if (p != culprit && sim_next(&S.rng) % 4 == 0) S.dies_after[p] = (int)(sim_next(&S.rng) % (uint64_t)S.n);
    }
    sim_die(&S, culprit);
    for (p = 0; p < S.n; p++) dopt__agree_lost(&S.a[p], culprit); /* every survivor's failure named it */
    for (;;) {
        int choices[SIM_MAX * SIM_MAX + SIM_MAX], nc = 0, k;
        for (p = 0; p < S.n; p++) {
            if (S.dead[p]) continue;
            if (!S.sent_all[p]) choices[nc++] = -1 - p; /* p takes a step */
            for (q = 0; q < S.n; q++)
                if (S.link[q][p].head < S.link[q][p].tail) choices[nc++] = q * SIM_MAX + p;
        }
        if (nc == 0) break;
        k = choices[sim_next(&S.rng) % (uint64_t)nc];
        DT_CHECK(++steps < 100000);
        if (k < 0) {
            p = -1 - k;
            if (!dopt__agree_step(&S.a[p])) {
                if (dopt__agree_waiting_for(&S.a[p]) < 0) DT_CHECK(!"waits for nobody and did not decide");
                continue;
            }
            for (q = p + 1; q < S.n && !S.dead[p]; q++) {
                if (S.dies_after[p] == S.told[p]) {
                    sim_die(&S, p);
                    break;
                }
                sim_push(&S, p, q, 0, S.a[p].value[0]);
                S.told[p]++;
            }
            S.sent_all[p] = 1;
            if (!S.dead[p] && S.dies_after[p] >= 0 && sim_next(&S.rng) % 2) sim_die(&S, p); /* dies after deciding */
        } else {
            sim_link *L;
            sim_msg m;
            q = k / SIM_MAX; /* from */
            p = k % SIM_MAX; /* to */
            L = &S.link[q][p];
            m = L->q[L->head++];
            if (m.eof)
                dopt__agree_lost(&S.a[p], q);
            else if (q < p)
                dopt__agree_heard(&S.a[p], q, &m.value);
        }
    }
    {
        int first = -1;
        uint64_t dead = 0;
        for (p = 0; p < S.n; p++) dead |= (uint64_t)S.dead[p] << p;
        for (p = 0; p < S.n; p++) {
            if (S.dead[p] && !S.a[p].decided) continue;
            if (!S.dead[p]) DT_CHECKF(S.a[p].decided, "seed %llu: live rank %d never decided", (unsigned long long)seed, p);
            if (S.dead[p]) continue; /* a rank that died after deciding is not held to it */
            DT_CHECKF((S.a[p].value[0] >> culprit) & 1, "seed %llu: rank %d's decision keeps the culprit %d",
                      (unsigned long long)seed, p, culprit);
            DT_CHECKF((S.a[p].value[0] & ~dead) == 0, "seed %llu: rank %d's decision leaves out a live rank",
                      (unsigned long long)seed, p);
            if (first < 0) first = p;
            DT_CHECKF(S.a[p].value[0] == S.a[first].value[0], "seed %llu: ranks %d and %d decided %#llx and %#llx",
                      (unsigned long long)seed, first, p, (unsigned long long)S.a[first].value[0],
                      (unsigned long long)S.a[p].value[0]);
        }
    }
    for (p = 0; p < S.n; p++) dopt__agree_free(&S.a[p]);
    return 1;
}

DTEST(agreement_holds_over_random_schedules_of_deaths_and_deliveries) {
    uint64_t seed;
    int worlds = 0;
    for (seed = 1; seed <= 20000; seed++) worlds += sim_world(seed);
    printf("  %d simulated worlds: every survivor decided, all alike\n", worlds);
}

DTEST(agreement_alone_at_the_bottom_decides_what_it_knows) {
    dopt__agree a;
    uint64_t told = 0x6; /* ranks 1 and 2 gone */
    DT_OK(dopt__agree_init(&a, 5, 0));
    dopt__agree_lost(&a, 3);
    dopt__agree_lost(&a, 0); /* never itself */
    DT_EQ_INT(dopt__agree_step(&a), 1);
    DT_CHECK(a.value[0] == 0x8);
    dopt__agree_free(&a);
    DT_OK(dopt__agree_init(&a, 5, 3));
    DT_EQ_INT(dopt__agree_waiting_for(&a), 0);
    DT_EQ_INT(dopt__agree_step(&a), 0);
    dopt__agree_heard(&a, 0, &told);
    dopt__agree_lost(&a, 1);
    dopt__agree_lost(&a, 2);
    DT_EQ_INT(dopt__agree_step(&a), 1);
    DT_CHECK(a.value[0] == told); /* rank 0's decision, not what rank 3 knows */
    dopt__agree_free(&a);
}

/* ===================================================================== REAL WORLDS OVER TCP */

#define SH_MAXN 8
#define SH_ELEMS 4096
#define SH_AFTER 3 /* allreduces after the shrink */

typedef struct sh_plan {
    int n;
    int victim, victim_step;  /* SIGKILLs itself instead of collective victim_step */
    int second;               /* -1, or a rank that dies as soon as its collective failed */
    int min_ranks;
    int stranger;             /* 1: garbage and a wrong-token hello reach every listener first */
    int steps;                /* collectives before the kill and after, on the first communicator */
    int stop;                 /* 1: the victim SIGSTOPs itself (alive, silent) instead */
    int timeout_ms;           /* every rank's; 0: 20000 */
    int thread_us;            /* > 0: a progress thread (it carries over to the survivors' communicator) */
    int driver;               /* 1: local SGD through localsgd.h's driver with elastic (el_body) */
    int timer_us;             /* driver: > 0, the victim dies this long after its first average instead */
    int outer;                /* driver: 1: DiLoCo's outer step (lr 0.7, momentum 0.9) */
    int dim;                  /* driver: the model's size; 0: EL_DIM */
    int partial;              /* driver: the victim sends its average's data to rank 0 alone, then stops */
    int host_coll;            /* driver: the host allreduces a number of its own after every step */
    int timeout0_ms;          /* rank 0's own timeout; 0: timeout_ms */
    int rejoin;               /* driver: 1: a joiner is started once the victim is gone (victim != 0), and the
                                 members step on until a grow took it in; 2: the joiner's model has another size;
                                 3: the joiner dies once taken in, before it has the job's state */
    int lead_dies;            /* driver, rejoin: rank 0 dies the moment its driver took the joiner in */
    int group;                /* 1: the collectives before the kill run on a group of every rank (split), and
                                 the survivors shrink the communicator the transport made */
    int shm;                  /* 1: over shared memory (transport_shm.h) instead of TCP */
    int second_late;          /* 1: `second` dies once the survivors agreed, before it joins their job (shm:
                                 on its log's "agreed on ranks") */
} sh_plan;

typedef struct sh_report {
    int status;               /* dopt_comm_shrink's last status */
    int old_rank, rank, size;
    unsigned epoch;
    int shrinks, grows;
    int lost_rank;
    int members[SH_MAXN];     /* the new communicator's ranks' old ranks */
    double sums[SH_AFTER];    /* element 0 of each allreduce after the shrink */
    double shrink_ms;
    char detail[DOPT_DETAIL_MAX];
} sh_report;

typedef struct sh_world {
    sh_plan plan;
    int port_pipe[2], report_pipe[2];
    char shm_name[64];        /* plan.shm: the job's name */
} sh_world;

static void sh_on_listen(void *user, int port) {
    sh_world *w = (sh_world *)user;
    int i;
    for (i = 1; i < w->plan.n + (w->plan.rejoin != 0); i++) dtest_write_int(w->port_pipe[1], port); /* and the joiner's */
}

/* A stranger at rank r's listening socket: garbage, then a hello with the wrong token. */
static void sh_stranger(const dopt__tcp *t, int r) {
    struct sockaddr_in sa;
    unsigned char hello[DOPT__TCP_SHRINK_HELLO];
    dopt__tcp fake;
    int fd;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)t->peers[r].port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) (void)!write(fd, "GET / HTTP/1.0\r\n\r\n", 18);
    /* the fd stays open: an idle stranger, too */
    fd = socket(AF_INET, SOCK_STREAM, 0);
    memcpy(&fake, t, sizeof fake);
    memset(fake.token, 0, sizeof fake.token);
    memcpy(fake.token, "not-the-token", 13);
    dopt__tcp_shrink_hello(hello, &fake, 0, 0, r);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) (void)!write(fd, hello, sizeof hello);
}

static int sh_die_when_agreed; /* this rank dies the moment the survivors agreed (plan.second_late) */

static void sh_log(void *user, dopt_log_level level, const char *msg) {
    (void)user;
    (void)level;
    if (getenv("SHRINK_TEST_LOG")) fprintf(stderr, "    [%d] %s\n", (int)getpid(), msg);
    if (sh_die_when_agreed && strstr(msg, "agreed on ranks")) raise(SIGKILL);
}

/* ===================================================================== THE DRIVER GOES ON (localsgd.h: ELASTIC) */

#define EL_DIM 300
#define EL_PERIOD 4

static void el_die(int sig) {
    (void)sig;
    raise(SIGKILL);
}

/* The victim's last average, sent to rank 0 alone: the driver's allreduce (the packed model,
   the non-finite slot and elastic's joiner slot, f32 mean) started, its frame to rank 0 written, and then the victim stops
   (SIGSTOP: alive and silent, so that no end of its connections reaches rank 0 before rank 0
   has read the frame). Rank 0's average completes at once; the others' time out (the plan's
   short timeout) while rank 0 goes on a round and fails at its next average: rank 0 is a round
   ahead when they shrink, and the stopped victim is left out after the timeout. */
static void el_stop_after_rank_0(dopt_comm *c, const float *x, int dim) {
    dopt__engine *e = c->eng;
    float *buf = (float *)calloc((size_t)dim + 2, sizeof(float)); /* and the two flags' slots, 0 */
    dopt_request req;
    int progress = 0;
    DT_CHECK(buf != NULL && e != NULL);
    memcpy(buf, x, sizeof(float) * (size_t)dim);
    DT_OK(dopt_allreduce_start(c, buf, (size_t)dim + 2, DOPT_F32, DOPT_MEAN, &req));
    DT_OK(dopt__eng_pump_tx(c, e, 0, &progress));
    for (;;) raise(SIGSTOP); /* until the harness kills it */
}

/* What a rank of el_body learns from its log: it took another's state; or, as P->second, it dies
   the moment the driver's shrink made it a survivor (a death while the survivors go on). */
typedef struct el_watch {
    int ahead;
    int die_going_on;
    int die_taking_in;
} el_watch;

static void el_log(void *user, dopt_log_level level, const char *msg) {
    el_watch *w = (el_watch *)user;
    if (strstr(msg, "this rank takes its model") || strstr(msg, "go on from their last average (rank ")) w->ahead = 1;
    if (w->die_going_on && strstr(msg, "elastic: rank ") && strstr(msg, "the survivors go on")) raise(SIGKILL);
    if (w->die_taking_in && strstr(msg, "joiner(s) after step")) raise(SIGKILL);
    sh_log(NULL, level, msg);
}

/* Local SGD on EL_DIM coordinates pulled toward this rank's own target, averaged every
   EL_PERIOD steps by the driver with elastic, for P->steps steps (the driver's count: a
   survivor that was behind follows dp.step), then one last sync. The victim dies at its step
   victim_step, or P->timer_us after its first average. Reports the final model's hash and
   sums[0] = the hash's low 48 bits, sums[1] = dp.step, sums[2] = x[1]; members: the old ranks;
   epoch: the communicator's; shrinks: dp.shrinks; status 0 when all went well, with
   lost_rank = 1 when this rank took another survivor's state (it was a round ahead). */
static void el_body(dopt_comm *c, int rank, const sh_plan *P, sh_report *rep) {
    int joiner = rank == P->n; /* a restarted worker (P->rejoin) */
    int dim = (P->dim ? P->dim : EL_DIM) + (joiner && P->rejoin == 2);
    double until = dtest_now_ms() + 60000;
    float *x = (float *)malloc(sizeof(float) * (size_t)dim);
    dopt_dp dp;
    dopt_dp_config cfg;
    dopt_buf b = dopt_buf_flat(x, (size_t)dim, NULL, 0);
    dopt_status s = DOPT_OK;
    int i, old = rank;
    el_watch watch = {0, rank == P->second, rank == 0 && P->lead_dies};
    uint64_t h = 1469598103934665603ull;
    memset(&cfg, 0, sizeof cfg);
    cfg.period = EL_PERIOD;
    cfg.elastic = 1;
    if (P->outer) {
        cfg.outer_lr = 0.7;
        cfg.outer_momentum = 0.9;
    }
    c->log_fn = el_log;
    c->log_user = &watch;
    DT_CHECK(x != NULL);
    for (i = 0; i < dim; i++) x[i] = (float)rank; /* different: the broadcast makes them one */
    DT_OK(dopt_dp_init(&dp, c, (size_t)dim, &cfg));
    DT_CHECK(dp.joining == joiner);
    if (joiner && P->rejoin == 3) raise(SIGKILL);
    s = dopt_dp_broadcast(&dp, x); /* a joiner takes the job's state */
    if (!joiner) DT_OK(s);
    /* members: with a joiner, until it came in (and, one that leaves, until it is left out again) */
    while (s == DOPT_OK && (dp.step < (uint64_t)P->steps ||
                            (P->rejoin && !joiner && (dp.grows == 0 || (P->rejoin > 1 && dp.comm->size == P->n))))) {
        DT_CHECKF(dtest_now_ms() < until, "rank %d: no joiner came in within 60 s", rank);
        if (rank == P->victim && !P->timer_us && !P->partial && dp.step == (uint64_t)P->victim_step) raise(SIGKILL);
        for (i = 0; i < dim; i++) x[i] -= 0.05f * (x[i] - (float)(rank + 1) * (float)(1 + i % 7));
        if (rank == P->victim && P->partial && dp.step >= (uint64_t)P->victim_step && dopt_dp_should_sync(&dp, dp.step))
            el_stop_after_rank_0(c, x, dim);
        s = dopt_dp_after_step(&dp, x);
        if (rank == P->victim && P->timer_us > 0 && dp.syncs == 1 && dp.round_steps == 0) {
            struct itimerval t = {{0, 0}, {0, P->timer_us}};
            signal(SIGALRM, el_die);
            setitimer(ITIMER_REAL, &t, NULL);
        }
        if (dp.comm != c) { /* a worker was lost; the survivors went on (ELASTIC) */
            dopt_comm_destroy(c);
            c = dp.comm;
            c->log_fn = el_log;
            c->log_user = &watch;
        }
        if (P->host_coll && s == DOPT_OK) { /* a failure here is the next after_step's to take up */
            double loss = 1.0;
            (void)dopt_allreduce(c, &loss, 1, DOPT_F64, DOPT_SUM);
        }
    }
    if (rank == P->victim) raise(SIGKILL); /* the timer had not fired: die at the last sync */
    if (s == DOPT_OK) s = dopt_dp_sync(&dp, &b, NULL);
    if (dp.comm != c) {
        dopt_comm_destroy(c);
        c = dp.comm;
    }
    rep->status = (int)s;
    rep->lost_rank = watch.ahead;
    if (s != DOPT_OK) snprintf(rep->detail, sizeof rep->detail, "%s", dopt_dp_detail(&dp));
    for (i = 0; i < dim; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], 4);
        h = (h ^ bits) * 1099511628211ull;
    }
    rep->sums[0] = (double)(h & 0xFFFFFFFFFFFFull);
    rep->sums[1] = (double)dp.step;
    rep->sums[2] = x[1];
    rep->shrinks = (int)dp.shrinks;
    rep->grows = (int)dp.grows;
    if (s == DOPT_OK) {
        rep->rank = c->rank;
        rep->size = c->size;
        rep->epoch = c->epoch;
        DT_OK(dopt_allgather(c, &old, rep->members, sizeof(int)));
    }
    dopt_dp_free(&dp);
    dopt_comm_destroy(c);
    free(x);
}

static void sh_rank(int rank, void *arg) {
    sh_world *w = (sh_world *)arg;
    const sh_plan *P = &w->plan;
    dopt_tcp_config cfg;
    dopt_comm *c = NULL, *g = NULL;
    sh_report rep;
    float *x = (float *)malloc(sizeof(float) * SH_ELEMS);
    int step, i, old;
    dopt_status s = DOPT_OK;
    memset(&rep, 0, sizeof rep);
    memset(&cfg, 0, sizeof cfg);
    cfg.rank = rank;
    cfg.world_size = P->n;
    cfg.timeout_ms = P->timeout_ms ? P->timeout_ms : 20000;
    if (rank == 0 && P->timeout0_ms) cfg.timeout_ms = P->timeout0_ms;
    cfg.token = "distopt-shrink-test";
    cfg.on_peer_lost = DOPT_SHRINK;
    cfg.min_ranks = P->min_ranks;
    cfg.log_fn = sh_log;
    cfg.progress_thread_us = P->thread_us;
    if (rank == 0) {
        cfg.on_listen = sh_on_listen;
        cfg.on_listen_user = w;
    } else if (!P->shm) {
        cfg.master_port = dtest_read_int(w->port_pipe[0], "rank 0's port");
    }
    if (P->shm) {
        dopt_shm_config scfg;
        memset(&scfg, 0, sizeof scfg);
        scfg.name = w->shm_name;
        scfg.rank = rank;
        scfg.size = P->n;
        scfg.timeout_ms = cfg.timeout_ms;
        scfg.engine = P->thread_us > 0; /* a progress thread needs the engine */
        scfg.on_peer_lost = DOPT_SHRINK;
        scfg.min_ranks = P->min_ranks;
        scfg.log_fn = sh_log;
        DT_OK(dopt_shm_create(&c, &scfg));
        if (P->thread_us > 0) DT_OK(dopt_comm_set_progress_thread(c, P->thread_us));
    } else {
        DT_OK(dopt_tcp_create(&c, &cfg));
    }
    DT_CHECK(c->on_peer_lost == DOPT_SHRINK && c->epoch == 0 && c->lost_rank == -1);
    rep.old_rank = rank;
    if (P->stranger) {
        int r;
        for (r = 1; r < P->n; r++)
            if (r != rank && rank == 0) sh_stranger((const dopt__tcp *)c->impl, r);
        DT_OK(dopt_barrier(c));
    }
    if (P->driver) {
        el_body(c, rank, P, &rep);
        DT_CHECK(write(w->report_pipe[1], &rep, sizeof rep) == (ssize_t)sizeof rep);
        free(x);
        _exit(0);
    }
    if (P->group) DT_OK(dopt_comm_split(c, 0, rank, &g));
    for (step = 0; step < P->steps && s == DOPT_OK; step++) {
        if (rank == P->victim && step == P->victim_step) raise(P->stop ? SIGSTOP : SIGKILL);
        for (i = 0; i < SH_ELEMS; i++) x[i] = (float)(rank + 1);
        s = dopt_allreduce(g ? g : c, x, SH_ELEMS, DOPT_F32, DOPT_SUM);
    }
    DT_CHECKF(s == (P->stop ? DOPT_ERR_TIMEOUT : DOPT_ERR_PEER_LOST), "rank %d: %s", rank,
              dopt_comm_detail(g ? g : c));
    if (g) dopt_comm_destroy(g); /* its failure is c's: c shrinks */
    if (rank == P->second && !P->second_late) raise(SIGKILL);
    sh_die_when_agreed = rank == P->second && P->second_late;
    /* shrink until a communicator runs its collectives (a death during the agreement may take
       a second one) */
    for (;;) {
        dopt_comm *next = NULL;
        double t0 = dtest_now_ms();
        int oldrank = rank;
        s = dopt_comm_shrink(c, &next);
        rep.shrink_ms = dtest_now_ms() - t0;
        rep.status = (int)s;
        rep.lost_rank = c->lost_rank;
        if (s != DOPT_OK) {
            snprintf(rep.detail, sizeof rep.detail, "%s", dopt_comm_detail(c));
            break;
        }
        rep.shrinks++;
        DT_CHECK(next != NULL && next->epoch == c->epoch + 1);
        if (P->thread_us > 0) DT_CHECK(next->eng != NULL && next->eng->threaded); /* the setting carried over */
        (void)oldrank;
        dopt_comm_destroy(c);
        c = next;
        old = rank;
        s = dopt_allgather(c, &old, rep.members, sizeof(int));
        for (step = 0; step < SH_AFTER && s == DOPT_OK; step++) {
            for (i = 0; i < SH_ELEMS; i++) x[i] = (float)(c->rank + 1) * (float)(step + 1);
            if (P->thread_us > 0) { /* the survivors' progress thread moves a request */
                dopt_request req;
                s = dopt_allreduce_start(c, x, SH_ELEMS, DOPT_F32, DOPT_SUM, &req);
                if (s == DOPT_OK) s = dopt_wait(&req);
            } else {
                s = dopt_allreduce(c, x, SH_ELEMS, DOPT_F32, DOPT_SUM);
            }
            rep.sums[step] = x[SH_ELEMS - 1];
        }
        if (s == DOPT_OK) break;
        DT_CHECK(rep.shrinks < 4);
    }
    if (s == DOPT_OK) {
        rep.rank = c->rank;
        rep.size = c->size;
        rep.epoch = c->epoch;
    }
    DT_CHECK(write(w->report_pipe[1], &rep, sizeof rep) == (ssize_t)sizeof rep);
    dopt_comm_destroy(c);
    free(x);
    _exit(0);
}

/* A restarted worker of an elastic driver's job (P->rejoin): asks rank 0 to take it in, then runs
   el_body as "rank" P->n. */
static void sh_joiner(sh_world *w) {
    const sh_plan *P = &w->plan;
    dopt_tcp_config cfg;
    dopt_comm *c = NULL;
    sh_report rep;
    memset(&rep, 0, sizeof rep);
    memset(&cfg, 0, sizeof cfg);
    cfg.join = 1;
    if (!P->shm) cfg.master_port = dtest_read_int(w->port_pipe[0], "rank 0's port");
    cfg.token = "distopt-shrink-test";
    cfg.timeout_ms = P->timeout_ms ? P->timeout_ms : 20000;
    cfg.rendezvous_timeout_ms = 60000;
    cfg.on_peer_lost = DOPT_SHRINK;
    cfg.log_fn = sh_log;
    if (P->shm) { /* shared memory: the job's name, no token, no address */
        dopt_shm_config scfg;
        memset(&scfg, 0, sizeof scfg);
        scfg.name = w->shm_name;
        scfg.join = 1;
        scfg.timeout_ms = 60000; /* the wait to be taken in; the job's own timeout comes with the admission */
        scfg.log_fn = sh_log;
        DT_OK(dopt_shm_create(&c, &scfg));
        DT_EQ_INT(c->timeout_ms, P->timeout_ms ? P->timeout_ms : 20000);
    } else {
        DT_OK(dopt_tcp_create(&c, &cfg));
    }
    DT_CHECK(c->grown_from > 0 && c->rank >= c->grown_from && c->epoch >= 1 && c->on_peer_lost == DOPT_SHRINK);
    rep.old_rank = P->n;
    el_body(c, P->n, P, &rep);
    DT_CHECK(write(w->report_pipe[1], &rep, sizeof rep) == (ssize_t)sizeof rep);
    _exit(0);
}

/* Runs a plan; the survivors' reports (in rank order of their old ranks) land in rep[]; returns
   how many survived. Every rank must end: the victims by their SIGKILL, the others with 0. */
static int sh_run(const sh_plan *plan, sh_report *rep) {
    sh_world w;
    pid_t pids[SH_MAXN + 1];
    int r, got = 0, left;
    double deadline = dtest_now_ms() + 90000;
    static int jobs;
    memset(&w, 0, sizeof w);
    w.plan = *plan;
    snprintf(w.shm_name, sizeof w.shm_name, "shrink-test-%d-%d", (int)getpid(), jobs++);
    DT_CHECK(pipe(w.port_pipe) == 0 && pipe(w.report_pipe) == 0);
    fflush(stdout);
    for (r = 0; r < plan->n; r++) {
        pids[r] = fork();
        DT_CHECK(pids[r] >= 0);
        if (pids[r] == 0) sh_rank(r, &w);
    }
    pids[plan->n] = 0;
    for (left = plan->n; left > 0;) {
        int status;
        pid_t p = waitpid(-1, &status, WNOHANG);
        if (p <= 0) {
            if (plan->stop && left == 1 && pids[plan->victim] > 0) kill(pids[plan->victim], SIGKILL); /* the rest ended */
            if (dtest_now_ms() > deadline) {
                for (r = 0; r <= plan->n; r++)
                    if (pids[r] > 0) kill(pids[r], SIGKILL);
                DT_CHECK(!"a rank hung: killed after 90 s");
            }
            usleep(2000);
            continue;
        }
        for (r = 0; r <= plan->n; r++)
            if (pids[r] == p) {
                int victim = r == plan->victim || r == plan->second || (r == plan->n && plan->rejoin == 3) ||
                             (r == 0 && plan->lead_dies);
                pids[r] = 0;
                left--;
                if (r == plan->victim && plan->rejoin) { /* a restarted worker asks to come back */
                    pids[plan->n] = fork();
                    DT_CHECK(pids[plan->n] >= 0);
                    if (pids[plan->n] == 0) sh_joiner(&w);
                    left++;
                }
                if (victim)
                    DT_CHECKF(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "rank %d was to die", r);
                else
                    DT_CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %d failed", r);
            }
    }
    close(w.report_pipe[1]);
    while (got < SH_MAXN && read(w.report_pipe[0], &rep[got], sizeof rep[got]) == (ssize_t)sizeof rep[got]) got++;
    close(w.report_pipe[0]);
    close(w.port_pipe[0]);
    close(w.port_pipe[1]);
    return got;
}

/* Every survivor went on with the same members in the same order, the sums over them right. */
static void sh_check_went_on(const sh_plan *plan, const sh_report *rep, int got, int dead) {
    int i, j, k;
    double slowest = 0;
    DT_EQ_INT(got, plan->n - dead);
    for (i = 0; i < got; i++) {
        DT_CHECKF(rep[i].status == DOPT_OK, "old rank %d: %s", rep[i].old_rank, rep[i].detail);
        DT_EQ_INT(rep[i].size, got);
        DT_CHECK(rep[i].members[rep[i].rank] == rep[i].old_rank);
        for (k = 0; k < got; k++) {
            DT_EQ_INT(rep[i].members[k], rep[0].members[k]);
            if (k) DT_CHECK(rep[i].members[k] > rep[i].members[k - 1]); /* old order kept */
            DT_CHECK(rep[i].members[k] != plan->victim && rep[i].members[k] != plan->second);
        }
        for (j = 0; j < SH_AFTER; j++) {
            double want = 0;
            for (k = 0; k < got; k++) want += (double)(k + 1) * (j + 1);
            DT_NEAR(rep[i].sums[j], want, 0);
        }
        DT_EQ_INT((int)rep[i].epoch, rep[0].shrinks);
        if (rep[i].shrink_ms > slowest) slowest = rep[i].shrink_ms;
    }
    printf("  %d -> %d ranks (epoch %u), the last shrink took at most %.2f ms\n", plan->n, got, rep[0].epoch,
           slowest);
}

DTEST(tcp_survivors_of_a_killed_rank_go_on_renumbered) {
    sh_plan p = {4, 2, 3, -1, 0, 0, 8};
    sh_report rep[SH_MAXN];
    int got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
    DT_EQ_INT(rep[0].lost_rank, 2);
}

DTEST(tcp_survivors_of_a_rank_lost_in_a_group_shrink_the_communicator_it_came_from) {
    sh_plan p = {4, 1, 3, -1, 0, 0, 8};
    sh_report rep[SH_MAXN];
    int got;
    p.group = 1;
    got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
    DT_EQ_INT(rep[0].lost_rank, 1);
}

DTEST(tcp_survivors_go_on_when_rank_0_is_the_one_lost) {
    sh_plan p = {4, 0, 2, -1, 0, 0, 8};
    sh_report rep[SH_MAXN];
    int got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
    DT_EQ_INT(rep[0].members[0], 1);
}

DTEST(tcp_survivors_go_on_with_a_progress_thread_and_requests) {
    sh_plan p = {4, 1, 3, -1, 0, 0, 8, 0, 0, 100};
    sh_report rep[SH_MAXN];
    int got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
}

DTEST(tcp_survivors_go_on_when_the_first_collective_never_completed) {
    sh_plan p = {4, 3, 0, -1, 0, 0, 8};
    sh_report rep[SH_MAXN];
    int got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
}

DTEST(tcp_a_second_death_while_the_survivors_agree_leaves_two) {
    int lost;
    for (lost = 0; lost < 3; lost++) { /* the second to die: below, between and above the first */
        sh_plan p = {5, 2, 2, -1, 0, 0, 8};
        sh_report rep[SH_MAXN];
        int got;
        p.second = lost == 0 ? 0 : lost == 1 ? 1 : 4;
        got = sh_run(&p, rep);
        sh_check_went_on(&p, rep, got, 2);
    }
}

DTEST(tcp_a_stopped_rank_is_left_out_after_the_timeout) {
    int victim;
    for (victim = 3; victim >= 0; victim -= 3) { /* above everyone, and rank 0 */
        sh_plan p = {4, 3, 2, -1, 0, 0, 8, 1, 1500};
        sh_report rep[SH_MAXN];
        int got;
        p.victim = victim;
        got = sh_run(&p, rep);
        sh_check_went_on(&p, rep, got, 1);
        DT_EQ_INT(rep[0].lost_rank, victim);
    }
}

DTEST(shm_survivors_of_a_killed_rank_go_on_renumbered) {
    sh_plan p = {4, 2, 3, -1, 0, 0, 8};
    sh_report rep[SH_MAXN];
    int got;
    p.shm = 1;
    got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
    DT_EQ_INT(rep[0].lost_rank, 2);
}

DTEST(shm_survivors_go_on_when_rank_0_is_the_one_lost_and_on_the_engine_with_a_progress_thread) {
    sh_plan p = {4, 0, 2, -1, 0, 0, 8};
    sh_report rep[SH_MAXN];
    int got;
    p.shm = 1;
    got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
    DT_EQ_INT(rep[0].members[0], 1);
    p.victim = 1, p.victim_step = 3, p.thread_us = 100;
    got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
}

DTEST(shm_a_second_death_while_the_survivors_agree_leaves_two) {
    int lost;
    for (lost = 0; lost < 3; lost++) { /* the second to die: below, between and above the first */
        sh_plan p = {5, 2, 2, -1, 0, 0, 8};
        sh_report rep[SH_MAXN];
        int got;
        p.shm = 1;
        p.second = lost == 0 ? 0 : lost == 1 ? 1 : 4;
        got = sh_run(&p, rep);
        sh_check_went_on(&p, rep, got, 2);
    }
}

DTEST(shm_a_member_lost_after_the_decision_is_left_out_at_the_next_attempt) {
    int lost;
    for (lost = 0; lost < 2; lost++) { /* below and above the first to die */
        sh_plan p = {5, 2, 2, -1, 0, 0, 8};
        sh_report rep[SH_MAXN];
        int got;
        p.shm = 1;
        p.second = lost == 0 ? 0 : 4;
        p.second_late = 1;
        got = sh_run(&p, rep);
        sh_check_went_on(&p, rep, got, 2);
    }
}

DTEST(shm_a_stopped_rank_is_left_out_after_the_timeout) {
    sh_plan p = {4, 3, 2, -1, 0, 0, 8, 1, 1500};
    sh_report rep[SH_MAXN];
    int got;
    p.shm = 1;
    got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
    DT_EQ_INT(rep[0].lost_rank, 3);
}

DTEST(shm_fewer_survivors_than_min_ranks_fail_everywhere_with_the_reason) {
    sh_plan p = {4, 1, 2, -1, 4, 0, 8};
    sh_report rep[SH_MAXN];
    int got, i;
    p.shm = 1;
    got = sh_run(&p, rep);
    DT_EQ_INT(got, 3);
    for (i = 0; i < got; i++) {
        DT_EQ_INT(rep[i].status, DOPT_ERR_PEER_LOST);
        DT_CHECKF(strstr(rep[i].detail, "3 of 4 ranks survive") && strstr(rep[i].detail, "min_ranks 4"), "%s",
                  rep[i].detail);
    }
}

DTEST(tcp_strangers_at_the_listening_sockets_do_not_disturb_the_shrink) {
    sh_plan p = {4, 1, 2, -1, 0, 1, 8};
    sh_report rep[SH_MAXN];
    int got = sh_run(&p, rep);
    sh_check_went_on(&p, rep, got, 1);
}

DTEST(tcp_fewer_survivors_than_min_ranks_fail_everywhere_with_the_reason) {
    sh_plan p = {4, 1, 2, -1, 4, 0, 8};
    sh_report rep[SH_MAXN];
    int got = sh_run(&p, rep), i;
    DT_EQ_INT(got, 3);
    for (i = 0; i < got; i++) {
        DT_EQ_INT(rep[i].status, DOPT_ERR_PEER_LOST);
        DT_CHECKF(strstr(rep[i].detail, "3 of 4 ranks survive") && strstr(rep[i].detail, "min_ranks 4"), "%s",
                  rep[i].detail);
    }
}

/* ===================================================================== REFUSALS AND SETTINGS */

static void sh_port(void *user, int port) { dtest_write_int(((int *)user)[1], port); }

/* A 2-rank world configured with on_peer_lost; body runs on both. */
static void refuse_rank(int rank, void *arg) {
    int *pp = (int *)arg;
    dopt_tcp_config cfg;
    dopt_comm *c = NULL, *next = (dopt_comm *)1, *g = NULL;
    float x[4] = {1, 2, 3, 4};
    memset(&cfg, 0, sizeof cfg);
    cfg.rank = rank;
    cfg.world_size = 2;
    cfg.timeout_ms = 20000;
    cfg.on_peer_lost = pp[2];
    if (rank == 0) {
        cfg.on_listen = sh_port;
        cfg.on_listen_user = pp;
    } else {
        cfg.master_port = dtest_read_int(pp[0], "port");
    }
    DT_OK(dopt_tcp_create(&c, &cfg));
    DT_EQ_INT(dopt_comm_shrink(c, &next), DOPT_ERR_INVALID); /* healthy */
    DT_CHECK(next == NULL && c->error == DOPT_OK);
    DT_OK(dopt_comm_split(c, 0, 0, &g));
    DT_EQ_INT(dopt_comm_shrink(g, &next), DOPT_ERR_INVALID); /* a group */
    dopt_comm_destroy(g);
    /* a mismatch is a program's bug, not a lost peer */
    DT_EQ_INT(dopt_allreduce(c, x, rank ? 3 : 4, DOPT_F32, DOPT_SUM), DOPT_ERR_MISMATCH);
    DT_EQ_INT(dopt_comm_shrink(c, &next), DOPT_ERR_INVALID);
    DT_CHECK(next == NULL && c->error == DOPT_ERR_MISMATCH);
    dopt_comm_destroy(c);
    _exit(0);
}

static void refusals(int on_peer_lost) {
    int pp[3];
    DT_CHECK(pipe(pp) == 0);
    pp[2] = on_peer_lost;
    DT_EQ_INT(dtest_spawn(2, refuse_rank, pp, 60), 0);
    close(pp[0]);
    close(pp[1]);
}

/* The survivors' reports of an elastic driver's run: all went on to the same model. Returns how
   many took a survivor's state because it was a round ahead. */
static int el_check(const sh_plan *plan, const sh_report *rep, int got) {
    int i, k, ahead = 0, dead = 1 + (plan->second >= 0);
    DT_EQ_INT(got, plan->n - dead);
    for (i = 0; i < got; i++) {
        DT_CHECKF(rep[i].status == DOPT_OK, "old rank %d: %s: %s", rep[i].old_rank, dopt_status_str(rep[i].status),
                  rep[i].detail);
        DT_EQ_INT(rep[i].size, got);
        DT_EQ_INT(rep[i].shrinks, dead);
        DT_EQ_INT((int)rep[i].epoch, dead);
        DT_CHECKF(rep[i].sums[0] == rep[0].sums[0], "old ranks %d and %d end with different models (x[1] %g and %g)",
                  rep[0].old_rank, rep[i].old_rank, rep[i].sums[2], rep[0].sums[2]);
        DT_NEAR(rep[i].sums[1], (double)plan->steps, 0);
        for (k = 0; k < got; k++) {
            DT_EQ_INT(rep[i].members[k], rep[0].members[k]);
            DT_CHECK(rep[i].members[k] != plan->victim && rep[i].members[k] != plan->second);
        }
        ahead |= rep[i].lost_rank;
    }
    return ahead;
}

/* Rank 2, then rank 0, dies before an average: the survivors average that round over themselves
   and go on; with DiLoCo's outer step too. */
DTEST(tcp_elastic_driver_averages_over_the_survivors_and_goes_on) {
    static const int victims[][3] = {{2, 11, 0}, {0, 23, 0}, {3, 12, 1}}; /* victim, its step, outer */
    size_t v;
    for (v = 0; v < sizeof victims / sizeof victims[0]; v++) {
        sh_plan p;
        sh_report rep[SH_MAXN];
        memset(&p, 0, sizeof p);
        p.n = 4;
        p.victim = victims[v][0];
        p.victim_step = victims[v][1];
        p.outer = victims[v][2];
        p.second = -1;
        p.steps = 80;
        p.driver = 1;
        el_check(&p, rep, sh_run(&p, rep));
    }
}

DTEST(shm_elastic_driver_averages_over_the_survivors_and_goes_on) {
    static const int victims[][3] = {{2, 11, 0}, {0, 23, 1}}; /* victim, its step, outer */
    size_t v;
    for (v = 0; v < sizeof victims / sizeof victims[0]; v++) {
        sh_plan p;
        sh_report rep[SH_MAXN];
        memset(&p, 0, sizeof p);
        p.n = 4;
        p.victim = victims[v][0];
        p.victim_step = victims[v][1];
        p.outer = victims[v][2];
        p.second = -1;
        p.steps = 80;
        p.driver = 1;
        p.shm = 1;
        el_check(&p, rep, sh_run(&p, rep));
    }
}

/* The victim dies at a random moment, inside an average or between: whichever survivors' averages
   completed, every replica ends identical. Says how many trials took a survivor's state. Over TCP,
   then (fewer trials) over shared memory. */
static void el_random_deaths(int shm, int trials) {
    uint64_t rng = 77;
    int t, ahead = 0;
    for (t = 0; t < trials; t++) {
        sh_plan p;
        sh_report rep[SH_MAXN];
        memset(&p, 0, sizeof p);
        p.shm = shm;
        p.n = 3 + t % 2;
        p.victim = (int)(sim_next(&rng) % (uint64_t)p.n);
        p.second = -1;
        p.steps = (t % 3 == 2 ? 400 : 4000) * (shm ? 10 : 1); /* shm steps faster: the timer must fall inside */
        p.dim = t % 3 == 2 ? 1 << 17 : 0; /* a ring's allreduce: some survivors may finish it */
        p.driver = 1;
        p.timer_us = 1 + (int)(sim_next(&rng) % 20000);
        ahead += el_check(&p, rep, sh_run(&p, rep));
    }
    printf("  %d trials (%s): identical replicas in every one; in %d a survivor was a round ahead and the others took "
           "its state\n", trials, shm ? "shm" : "tcp", ahead);
}

DTEST(tcp_elastic_driver_ends_with_identical_replicas_whenever_the_rank_dies) { el_random_deaths(0, 12); }

DTEST(shm_elastic_driver_ends_with_identical_replicas_whenever_the_rank_dies) { el_random_deaths(1, 6); }

/* The victim's last average reaches rank 0 alone: rank 0 completes it and goes on a round, the
   others fail it; when rank 0's next average fails they shrink, find rank 0 ahead, and all take
   its model and step. With 3 and 4 ranks, with and without DiLoCo's outer step. Rank 0 waits
   longer than the others, whose timeout in the round it completed must name the stopped victim
   first: its own would name the first rank it waits for, rank 1, which is alive and waiting
   for the victim, and the survivors would split (transport_tcp.h: SURVIVING A LOST RANK,
   limits). */
DTEST(tcp_elastic_driver_takes_the_state_of_a_survivor_a_round_ahead) {
    int n, outer;
    for (n = 3; n <= 4; n++)
        for (outer = 0; outer <= 1; outer++) {
            sh_plan p;
            sh_report rep[SH_MAXN];
            memset(&p, 0, sizeof p);
            p.n = n;
            p.victim = n - 1;
            p.victim_step = 10;
            p.partial = 1;
            p.stop = 1;
            p.timeout_ms = 1500;
            p.timeout0_ms = 4500;
            p.outer = outer;
            p.second = -1;
            p.steps = 40;
            p.driver = 1;
            int got = sh_run(&p, rep), i;
            DT_EQ_INT(el_check(&p, rep, got), 1);
            for (i = 0; i < got; i++) /* rank 0 kept its own state, the others took it */
                DT_EQ_INT(rep[i].lost_rank, rep[i].old_rank != 0);
        }
}

/* The host allreduces a number of its own after every step, and that is where the survivors
   learn of the death (between averages): their next after_step finds the communicator failed,
   and they go on from the last average, all alike. */
DTEST(tcp_elastic_driver_takes_up_a_failure_of_the_hosts_own_collective) {
    sh_plan p;
    sh_report rep[SH_MAXN];
    int got, i;
    memset(&p, 0, sizeof p);
    p.n = 4;
    p.victim = 1;
    p.victim_step = 9; /* between the averages after steps 7 and 11 */
    p.second = -1;
    p.steps = 40;
    p.driver = 1;
    p.host_coll = 1;
    got = sh_run(&p, rep);
    el_check(&p, rep, got);
    for (i = 0; i < got; i++) DT_EQ_INT(rep[i].lost_rank, rep[i].old_rank != 0); /* rank 0's last average */
}

/* Rank 1 dies the moment the driver's first shrink made it a survivor: the others' agreement on
   where they stand fails, and they shrink again and go on, two of four. */
DTEST(tcp_elastic_driver_survives_a_death_while_the_survivors_go_on) {
    sh_plan p;
    sh_report rep[SH_MAXN];
    memset(&p, 0, sizeof p);
    p.n = 4;
    p.victim = 3;
    p.victim_step = 13;
    p.second = 1;
    p.steps = 60;
    p.driver = 1;
    el_check(&p, rep, sh_run(&p, rep));
}

/* A plan of the driver's with a worker started again (rejoin: sh_plan's): n ranks, the victim
   killed before its step victim_step, 60 steps. */
static sh_plan rejoin_plan(int n, int victim, int victim_step, int rejoin) {
    sh_plan p;
    memset(&p, 0, sizeof p);
    p.n = n;
    p.victim = victim;
    p.victim_step = victim_step;
    p.second = -1;
    p.steps = 60;
    p.driver = 1;
    p.rejoin = rejoin;
    return p;
}

/* A rank that went on: no error, the world's size, its shrinks and grows, ref's model and step. */
static void rejoin_check(const sh_report *r, const sh_report *ref, int size, int shrinks, int grows) {
    DT_CHECKF(r->status == DOPT_OK, "old rank %d: %s: %s", r->old_rank, dopt_status_str(r->status), r->detail);
    DT_EQ_INT(r->size, size);
    DT_EQ_INT(r->shrinks, shrinks);
    DT_EQ_INT(r->grows, grows);
    DT_CHECKF(r->sums[0] == ref->sums[0], "old ranks %d and %d end with different models (x[1] %g and %g)",
              ref->old_rank, r->old_rank, ref->sums[2], r->sums[2]);
    DT_NEAR(r->sums[1], ref->sums[1], 0); /* the same step */
}

/* A worker dies and a restarted one asks rank 0 to come back: at the end of a round the members
   grow, rank 0 sends it the job's state (its model, step, counters, the outer momentum), and all
   go on to the same model, the full world again. With and without DiLoCo's outer step; the third
   time with a model of 2^17 elements (the state in several pieces). */
DTEST(tcp_elastic_driver_takes_a_restarted_worker_back_with_the_jobs_state) {
    int outer;
    for (outer = 0; outer <= 2; outer++) {
        sh_plan p = rejoin_plan(3 + (outer & 1), 1 + (outer & 1), 9, 1);
        sh_report rep[SH_MAXN];
        int got, i, k;
        p.outer = outer & 1;
        p.dim = outer == 2 ? 1 << 17 : 0;
        got = sh_run(&p, rep);
        DT_EQ_INT(got, p.n); /* the survivors and the joiner */
        for (i = 0; i < got; i++) {
            int joiner = rep[i].old_rank == p.n;
            rejoin_check(&rep[i], &rep[0], p.n, !joiner, !joiner);
            DT_EQ_INT((int)rep[i].epoch, 2);
            DT_CHECK(rep[i].sums[1] >= (double)p.steps);
            for (k = 0; k < got; k++) DT_EQ_INT(rep[i].members[k], rep[0].members[k]);
            DT_EQ_INT(rep[i].members[p.n - 1], p.n); /* the joiner came in last */
        }
    }
}

/* The same over shared memory: the restarted worker asks through the job's join box, the members
   grow at a round's end into a job of the full size, and rank 0 sends the state. */
DTEST(shm_elastic_driver_takes_a_restarted_worker_back_with_the_jobs_state) {
    int outer;
    for (outer = 0; outer <= 1; outer++) {
        sh_plan p = rejoin_plan(3 + outer, 1 + outer, 9, 1);
        sh_report rep[SH_MAXN];
        int got, i, k;
        p.outer = outer;
        p.shm = 1;
        got = sh_run(&p, rep);
        DT_EQ_INT(got, p.n);
        for (i = 0; i < got; i++) {
            int joiner = rep[i].old_rank == p.n;
            rejoin_check(&rep[i], &rep[0], p.n, !joiner, !joiner);
            DT_EQ_INT((int)rep[i].epoch, 2);
            for (k = 0; k < got; k++) DT_EQ_INT(rep[i].members[k], rep[0].members[k]);
            DT_EQ_INT(rep[i].members[p.n - 1], p.n);
        }
    }
}

/* Over shared memory, rank 0 dies the moment it took the joiner in: the others and the joiner
   shrink, and the joiner takes the state from the lowest survivor. */
DTEST(shm_elastic_driver_joiner_takes_the_state_from_another_member_when_rank_0_dies) {
    sh_plan p = rejoin_plan(4, 2, 9, 1);
    sh_report rep[SH_MAXN];
    int got, i;
    p.lead_dies = 1;
    p.shm = 1;
    got = sh_run(&p, rep);
    DT_EQ_INT(got, p.n - 1);
    for (i = 0; i < got; i++) {
        int joiner = rep[i].old_rank == p.n;
        rejoin_check(&rep[i], &rep[0], p.n - 1, joiner ? 1 : 2, !joiner);
    }
    DT_EQ_INT(rep[0].members[0], 1);
    DT_EQ_INT(rep[0].members[1], 3);
    DT_EQ_INT(rep[0].members[2], p.n);
}

/* Over shared memory, the restarted worker dies once taken in, before it has the state: the
   members shrink again and go on as before. */
DTEST(shm_elastic_driver_joiner_lost_while_it_takes_the_state_leaves_the_job_as_it_was) {
    sh_plan p = rejoin_plan(4, 3, 6, 3);
    sh_report rep[SH_MAXN];
    int got, i;
    p.shm = 1;
    got = sh_run(&p, rep);
    DT_EQ_INT(got, p.n - 1);
    for (i = 0; i < got; i++) {
        rejoin_check(&rep[i], &rep[0], p.n - 1, 2, 1);
        DT_EQ_INT((int)rep[i].epoch, 3);
    }
}

static char shm_refusal[DOPT_DETAIL_MAX];
static void shm_refusal_log(void *user, dopt_log_level level, const char *msg) {
    (void)user;
    if (level == DOPT_LOG_ERROR) snprintf(shm_refusal, sizeof shm_refusal, "%s", msg);
}

/* dopt_comm_grow over shared memory, without the driver. First a joiner that dies the moment the
   members admitted it (a process of the test's own that asks through the join box by hand, with
   a stale "waiting" slot beside it that nobody holds): every member's grow says the grown job
   did not form and returns DOPT_OK with no next, the stale slot is never counted, and the job goes
   on as it was. Then a real joiner (dopt_shm_create with join = 1) comes in as rank 3 of 4,
   epoch 1, grown_from 3, and an allreduce over the four is right; the join box is gone after. */
static int gr_failed_seen;
static void gr_log(void *user, dopt_log_level level, const char *msg) {
    (void)user;
    if (strstr(msg, "did not form")) gr_failed_seen = 1;
    sh_log(NULL, level, msg);
}

static void gr_member(const char *name, int rank, int phase_fd) {
    dopt_shm_config cfg;
    dopt_comm *c = NULL, *next = NULL;
    double until = dtest_now_ms() + 30000, sum;
    int all = 0, rounds = 0;
    memset(&cfg, 0, sizeof cfg);
    cfg.name = name, cfg.rank = rank, cfg.size = 3;
    cfg.timeout_ms = 60000; /* longer than the loop's 30 s: a joiner's death is seen by its slot, never waited out */
    cfg.on_peer_lost = DOPT_SHRINK, cfg.log_fn = gr_log;
    DT_OK(dopt_shm_create(&c, &cfg));
    while (!all) { /* phase 1: the joiner that dies once admitted */
        int mine = gr_failed_seen;
        DT_CHECKF(dtest_now_ms() < until, "rank %d: the dying joiner's grow never failed", rank);
        DT_CHECK(dopt_comm_joiners_held(c) <= 1); /* the stale slot is nobody's */
        DT_OK(dopt_comm_grow(c, &next));
        DT_CHECK(next == NULL);
        DT_OK(dopt_allreduce(c, &mine, 1, DOPT_I32, DOPT_MIN));
        all = mine;
        usleep(1000);
        rounds++;
    }
    sum = rank + 1;
    DT_OK(dopt_allreduce(c, &sum, 1, DOPT_F64, DOPT_SUM));
    DT_NEAR(sum, 6.0, 0);
    if (rank == 0) DT_CHECK(write(phase_fd, "1", 1) == 1); /* the parent starts the real joiner now */
    while (next == NULL) { /* phase 2: the real joiner */
        DT_CHECKF(dtest_now_ms() < until + 30000, "rank %d: the joiner never came in", rank);
        DT_OK(dopt_comm_grow(c, &next));
        if (next == NULL) usleep(1000);
    }
    dopt_comm_destroy(c);
    DT_EQ_INT(next->size, 4);
    DT_EQ_INT(next->rank, rank);
    DT_EQ_INT(next->grown_from, 3);
    DT_EQ_INT((int)next->epoch, 1);
    DT_CHECK(next->on_peer_lost == DOPT_SHRINK);
    sum = rank + 1;
    DT_OK(dopt_allreduce(next, &sum, 1, DOPT_F64, DOPT_SUM));
    DT_NEAR(sum, 10.0, 0);
    dopt_comm_destroy(next);
    _exit(0);
}

/* Asks by hand in slot 2 (and leaves slot 5 saying "waiting" with nobody holding it), then dies
   once a member admitted it. */
static void gr_dying_joiner(const char *name) {
    int fd;
    dopt__shm_box *b = dopt__shm_box_open(name, 1, &fd);
    DT_CHECK(b != NULL);
    DT_CHECK(dopt__shm_lock_range(fd, (off_t)DOPT__SHM_BOX_BYTES + 2, 1, F_WRLCK) == 0);
    b->slot[5].word = (uint64_t)77 << 4 | DOPT__SHM_SLOT_WAITING;
    b->slot[2].pid = (int32_t)getpid();
    __atomic_store_n(&b->slot[2].word, (uint64_t)78 << 4 | DOPT__SHM_SLOT_WAITING, __ATOMIC_RELEASE);
    while (__atomic_load_n(&b->slot[2].word, __ATOMIC_ACQUIRE) != ((uint64_t)78 << 4 | DOPT__SHM_SLOT_ADMITTED))
        usleep(200);
    raise(SIGKILL);
}

/* A joiner (dopt_shm_create with join = 1) that must come in as rank `rank` of `size`, then
   allreduces rank + 1 with the others. */
static void gr_joiner(const char *name, int rank, int size, int epoch) {
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    double sum = rank + 1;
    memset(&cfg, 0, sizeof cfg);
    cfg.name = name, cfg.join = 1, cfg.timeout_ms = 30000, cfg.log_fn = sh_log;
    DT_OK(dopt_shm_create(&c, &cfg));
    DT_EQ_INT(c->size, size);
    DT_EQ_INT(c->rank, rank);
    DT_EQ_INT(c->grown_from, rank);
    DT_EQ_INT((int)c->epoch, epoch);
    DT_EQ_INT(c->timeout_ms, 60000); /* the members' */
    DT_OK(dopt_allreduce(c, &sum, 1, DOPT_F64, DOPT_SUM));
    DT_NEAR(sum, size * (size + 1) / 2.0, 0);
    dopt_comm_destroy(c);
    _exit(0);
}

DTEST(shm_grow_takes_a_joiner_in_and_one_lost_once_admitted_leaves_the_job_as_it_was) {
    char name[64], box[128];
    pid_t pid[5];
    int r, status, phase[2];
    snprintf(name, sizeof name, "grow-test-%d", (int)getpid());
    snprintf(box, sizeof box, "/dev/shm/dopt.%s+join", name);
    DT_CHECK(pipe(phase) == 0);
    fflush(stdout);
    for (r = 0; r < 3; r++)
        if ((pid[r] = fork()) == 0) gr_member(name, r, phase[1]);
    if ((pid[3] = fork()) == 0) gr_dying_joiner(name);
    DT_CHECK(waitpid(pid[3], &status, 0) == pid[3]);
    DT_CHECKF(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "the dying joiner was never admitted (status %d)",
              status);
    DT_CHECK(read(phase[0], &r, 1) == 1); /* the members are through phase 1 */
    if ((pid[4] = fork()) == 0) gr_joiner(name, 3, 4, 1);
    for (r = 0; r < 5; r++) {
        if (r == 3) continue;
        DT_CHECK(waitpid(pid[r], &status, 0) == pid[r]);
        DT_CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "process %d failed (status %d)", r, status);
    }
    DT_CHECKF(access(box, F_OK) != 0, "%s is left behind", box);
    close(phase[0]);
    close(phase[1]);
}

/* A member dies the moment every member agreed on a joiner, before the grown job formed: the
   other members' grow fails naming it (they shrink, then take the joiner in at a later grow),
   and the joiner, told the members gave up, asks again and comes in as rank 2 of 3. */
static void gr_die_log(void *user, dopt_log_level level, const char *msg) {
    (void)user;
    if (strstr(msg, "every member saw")) raise(SIGKILL);
    sh_log(NULL, level, msg);
}

/* Waits for the n processes: `dies` (-1: none) must end by SIGKILL, the others exit 0. */
static void gr_reap(const pid_t *pid, int n, int dies) {
    int r, status;
    for (r = 0; r < n; r++) {
        DT_CHECK(waitpid(pid[r], &status, 0) == pid[r]);
        if (r == dies)
            DT_CHECKF(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "process %d was to die (status %d)", r, status);
        else
            DT_CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "process %d failed (status %d)", r, status);
    }
}

static void gr_member_lost(const char *name, int rank) {
    dopt_shm_config cfg;
    dopt_comm *c = NULL, *next = NULL;
    double until = dtest_now_ms() + 30000, sum;
    int lost = 0;
    memset(&cfg, 0, sizeof cfg);
    cfg.name = name, cfg.rank = rank, cfg.size = 3, cfg.timeout_ms = 60000;
    cfg.on_peer_lost = DOPT_SHRINK, cfg.log_fn = rank == 2 ? gr_die_log : sh_log;
    DT_OK(dopt_shm_create(&c, &cfg));
    for (;;) {
        dopt_status s;
        DT_CHECKF(dtest_now_ms() < until, "rank %d: the joiner never came in", rank);
        s = dopt_comm_grow(c, &next);
        if (s == DOPT_OK && next) break;
        if (s == DOPT_OK) {
            usleep(1000);
            continue;
        }
        DT_CHECKF(s == DOPT_ERR_PEER_LOST && c->lost_rank == 2 && !lost, "rank %d: %s: %s", rank, dopt_status_str(s),
                  dopt_comm_detail(c));
        lost = 1;
        DT_OK(dopt_comm_shrink(c, &next));
        dopt_comm_destroy(c);
        c = next;
        next = NULL;
    }
    DT_CHECK(lost);
    dopt_comm_destroy(c);
    DT_EQ_INT(next->size, 3);
    DT_EQ_INT(next->grown_from, 2);
    DT_EQ_INT((int)next->epoch, 2);
    sum = next->rank + 1;
    DT_OK(dopt_allreduce(next, &sum, 1, DOPT_F64, DOPT_SUM));
    DT_NEAR(sum, 6.0, 0);
    dopt_comm_destroy(next);
    _exit(0);
}


DTEST(shm_grow_a_member_lost_while_the_joiner_comes_in_fails_the_grow_and_the_joiner_asks_again) {
    char name[64];
    pid_t pid[4];
    int r;
    snprintf(name, sizeof name, "grow-lost-%d", (int)getpid());
    fflush(stdout);
    for (r = 0; r < 3; r++)
        if ((pid[r] = fork()) == 0) gr_member_lost(name, r);
    if ((pid[3] = fork()) == 0) gr_joiner(name, 2, 3, 2);
    gr_reap(pid, 4, 2);
}

/* The same death, with a joiner that was admitted but has not come to join yet (one of the
   test's own, asking by hand): the members that gave up the grown job mark its slot refused, so
   that it asks again at once instead of forming the grown job alone until the timeout. */
static void gr_member_refuses(const char *name, int rank) {
    dopt_shm_config cfg;
    dopt_comm *c = NULL, *next = NULL;
    double until = dtest_now_ms() + 30000, sum;
    dopt_status s = DOPT_OK;
    memset(&cfg, 0, sizeof cfg);
    cfg.name = name, cfg.rank = rank, cfg.size = 3, cfg.timeout_ms = 60000;
    cfg.on_peer_lost = DOPT_SHRINK, cfg.log_fn = rank == 2 ? gr_die_log : sh_log;
    DT_OK(dopt_shm_create(&c, &cfg));
    while (s == DOPT_OK) {
        DT_CHECKF(dtest_now_ms() < until, "rank %d: the grow never failed", rank);
        s = dopt_comm_grow(c, &next);
        DT_CHECK(next == NULL);
        usleep(1000);
    }
    DT_CHECKF(s == DOPT_ERR_PEER_LOST && c->lost_rank == 2, "rank %d: %s", rank, dopt_comm_detail(c));
    DT_OK(dopt_comm_shrink(c, &next));
    dopt_comm_destroy(c);
    sum = next->rank + 1;
    DT_OK(dopt_allreduce(next, &sum, 1, DOPT_F64, DOPT_SUM));
    DT_NEAR(sum, 3.0, 0);
    dopt_comm_destroy(next);
    _exit(0);
}

static void gr_admitted_waits_for_refusal(const char *name) {
    int fd;
    double until = dtest_now_ms() + 20000;
    dopt__shm_box *b = dopt__shm_box_open(name, 1, &fd);
    uint64_t w;
    DT_CHECK(b != NULL);
    DT_CHECK(dopt__shm_lock_range(fd, (off_t)DOPT__SHM_BOX_BYTES, 1, F_WRLCK) == 0);
    __atomic_store_n(&b->slot[0].word, (uint64_t)5 << 4 | DOPT__SHM_SLOT_WAITING, __ATOMIC_RELEASE);
    while ((w = __atomic_load_n(&b->slot[0].word, __ATOMIC_ACQUIRE)) != ((uint64_t)5 << 4 | DOPT__SHM_SLOT_REFUSED)) {
        DT_CHECKF(dtest_now_ms() < until, "the admitted joiner's slot never said refused (word %llx)",
                  (unsigned long long)w);
        usleep(500);
    }
    _exit(0);
}

DTEST(shm_grow_failed_is_told_to_an_admitted_joiner_that_has_not_joined_yet) {
    char name[64], box[128];
    pid_t pid[4];
    int r;
    snprintf(name, sizeof name, "grow-refused-%d", (int)getpid());
    snprintf(box, sizeof box, "/dopt.%s+join", name);
    fflush(stdout);
    if ((pid[3] = fork()) == 0) gr_admitted_waits_for_refusal(name);
    for (r = 0; r < 3; r++)
        if ((pid[r] = fork()) == 0) gr_member_refuses(name, r);
    gr_reap(pid, 4, 2);
    shm_unlink(box);
}

/* A joiner that nobody takes in (no job of that name runs) says so at its timeout, and leaves
   no join box behind. */
DTEST(shm_joiner_that_nobody_takes_in_fails_with_the_reason_and_leaves_nothing) {
    dopt_shm_config cfg;
    dopt_comm *c = (dopt_comm *)1;
    char name[64], box[128];
    snprintf(name, sizeof name, "grow-nobody-%d", (int)getpid());
    snprintf(box, sizeof box, "/dev/shm/dopt.%s+join", name);
    memset(&cfg, 0, sizeof cfg);
    cfg.name = name, cfg.join = 1, cfg.timeout_ms = 300, cfg.log_fn = shm_refusal_log;
    shm_refusal[0] = '\0';
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_TIMEOUT);
    DT_CHECK(c == NULL);
    DT_CHECKF(strstr(shm_refusal, "took this process in within 300 ms") && strstr(shm_refusal, "dopt_comm_grow"), "%s",
              shm_refusal);
    DT_CHECKF(access(box, F_OK) != 0, "%s is left behind", box);
    cfg.name = "bad/name";
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID);
}

/* Rank 0 dies the moment it took the joiner in, before it sent the job's state: the joiner's
   take fails, the others' next collective; all shrink, and the joiner takes the state from the
   lowest survivor that holds it. */
DTEST(tcp_elastic_driver_joiner_takes_the_state_from_another_member_when_rank_0_dies) {
    sh_plan p = rejoin_plan(4, 2, 9, 1);
    sh_report rep[SH_MAXN];
    int got, i, k;
    p.lead_dies = 1;
    got = sh_run(&p, rep);
    DT_EQ_INT(got, p.n - 1); /* old ranks 1 and 3, and the joiner */
    for (i = 0; i < got; i++) {
        int joiner = rep[i].old_rank == p.n;
        rejoin_check(&rep[i], &rep[0], p.n - 1, joiner ? 1 : 2, !joiner);
        for (k = 0; k < got; k++) DT_EQ_INT(rep[i].members[k], rep[0].members[k]);
    }
    DT_EQ_INT(rep[0].members[0], 1);
    DT_EQ_INT(rep[0].members[1], 3);
    DT_EQ_INT(rep[0].members[2], p.n);
}

/* The restarted worker dies once the members took it in, before it has the job's state: rank 0's
   broadcast to it fails, the others' next average; they shrink again and go on as before. */
DTEST(tcp_elastic_driver_joiner_lost_while_it_takes_the_state_leaves_the_job_as_it_was) {
    sh_plan p = rejoin_plan(4, 3, 6, 3);
    sh_report rep[SH_MAXN];
    int got, i;
    got = sh_run(&p, rep);
    DT_EQ_INT(got, p.n - 1);
    for (i = 0; i < got; i++) {
        rejoin_check(&rep[i], &rep[0], p.n - 1, 2, 1);
        DT_EQ_INT((int)rep[i].epoch, 3);
    }
}

/* The restarted worker's model has another size: it takes part in the broadcasts, refuses the
   state naming the difference, and leaves; the members lose it at their next average and go on
   without it. */
DTEST(tcp_elastic_driver_joiner_configured_otherwise_refuses_and_the_job_goes_on) {
    sh_plan p = rejoin_plan(3, 2, 9, 2);
    sh_report rep[SH_MAXN];
    int got, i, joiners = 0, first = -1;
    got = sh_run(&p, rep);
    DT_EQ_INT(got, p.n);
    for (i = 0; i < got; i++) {
        if (rep[i].old_rank == p.n) {
            joiners++;
            DT_EQ_INT(rep[i].status, DOPT_ERR_INVALID);
            DT_CHECKF(strstr(rep[i].detail, "elastic: the job runs with element count 300, this driver has 301"),
                      "%s", rep[i].detail);
            continue;
        }
        if (first < 0) first = i;
        rejoin_check(&rep[i], &rep[first], p.n - 1, 2, 1);
    }
    DT_EQ_INT(joiners, 1);
}

/* The state a joiner takes, in one process: what a member would send (the state file's form and
   the AVERAGE states) is taken whole by a driver of the same configuration (model, step,
   counters, anchor, outer momentum, AVERAGE states; KEEP stays, RESET is zeroed; the sender's
   host bytes, which are not in the agreed state hash since every rank has its own), and refused,
   naming why, when a byte of the state or of the host bytes changed in transit, when its version
   or size is not this build's, or when the taker has another model size or host state size. */
DTEST(elastic_joiner_takes_the_state_whole_and_refuses_it_corrupt_or_configured_otherwise) {
    enum { N = 96, M = 40 };
    dopt_tcp_config tc;
    dopt_comm *c = NULL;
    dopt_dp a, b, other;
    dopt_dp_config cfg;
    dopt_state_desc sd[3] = {{M, DOPT_STATE_AVERAGE, "momentum"}, {5, DOPT_STATE_KEEP, "count"},
                             {7, DOPT_STATE_RESET, "scratch"}};
    float xa[N], xb[N + 1], ma[M], mb[M], ka[5], kb[5], ra[7], rb[7];
    dopt_buf pa = dopt_buf_flat(xa, N, NULL, 0), pb = dopt_buf_flat(xb, N, NULL, 0);
    dopt_buf sa[3], sb[3];
    unsigned char *pay, *copy;
    uint64_t hash = 0, h2 = 0, ha[3] = {7, 11, 13}, hb[3] = {0, 0, 99}, ho[2] = {0, 0};
    size_t bytes, i, host;
    int step;
    memset(&tc, 0, sizeof tc);
    tc.world_size = 1;
    tc.on_peer_lost = DOPT_SHRINK;
    DT_OK(dopt_tcp_create(&c, &tc));
    memset(&cfg, 0, sizeof cfg);
    cfg.period = 3;
    cfg.elastic = 1;
    cfg.outer_lr = 0.7;
    cfg.outer_momentum = 0.9;
    cfg.states = sd;
    cfg.nstates = 3;
    sa[0] = dopt_buf_flat(ma, M, NULL, 0), sa[1] = dopt_buf_flat(ka, 5, NULL, 0), sa[2] = dopt_buf_flat(ra, 7, NULL, 0);
    sb[0] = dopt_buf_flat(mb, M, NULL, 0), sb[1] = dopt_buf_flat(kb, 5, NULL, 0), sb[2] = dopt_buf_flat(rb, 7, NULL, 0);
    for (i = 0; i < N; i++) xa[i] = (float)i * 0.25f;
    for (i = 0; i < M; i++) ma[i] = (float)i;
    for (i = 0; i < 5; i++) ka[i] = kb[i] = 100.0f + (float)i;
    for (i = 0; i < 7; i++) ra[i] = rb[i] = 3.0f;
    DT_OK(dopt_dp_init(&a, c, N, &cfg));
    DT_OK(dopt_dp_broadcast_buf(&a, &pa, sa));
    for (step = 0; step < 9; step++) { /* three rounds: outer momentum, anchor and counters move */
        for (i = 0; i < N; i++) xa[i] -= 0.1f * (xa[i] - 1.0f);
        for (i = 0; i < M; i++) ma[i] = 0.5f * ma[i] + 1.0f;
        DT_OK(dopt_dp_after_step_buf(&a, &pa, sa));
    }
    DT_OK(dopt_dp_init(&b, c, N, &cfg));
    DT_OK(dopt_dp_host_state(&a, ha, sizeof ha));
    DT_OK(dopt_dp_host_state(&b, hb, sizeof hb));
    bytes = dopt__dp_state_payload(&a, &pa, sa, NULL, NULL);
    host = dopt__dp_host_offset(&a, dopt__dp_encode(&a, NULL));
    pay = (unsigned char *)malloc(bytes);
    copy = (unsigned char *)malloc(bytes);
    DT_CHECK(pay != NULL && copy != NULL);
    DT_EQ_INT((int)dopt__dp_state_payload(&a, &pa, sa, pay, &hash), (int)bytes);
    DT_EQ_INT((int)dopt__dp_state_payload(&a, &pa, sa, copy, &h2), (int)bytes); /* the same on every member */
    DT_CHECK(hash == h2 && memcmp(pay, copy, bytes) == 0);
    DT_CHECK(memcmp(pay + host, ha, sizeof ha) == 0); /* the sender's host bytes travel ... */
    ha[0]++;
    DT_EQ_INT((int)dopt__dp_state_payload(&a, &pa, sa, copy, &h2), (int)bytes);
    DT_CHECK(h2 == hash); /* ... outside the agreed hash: each rank's are its own */
    ha[0]--;
    memcpy(copy, pay, bytes); /* a host byte changed in transit: refused */
    copy[host + 3] ^= 0x20;
    DT_EQ_INT(dopt__dp_take(&b, &pb, sb, copy, bytes, hash, dopt__dp_host_hash(&a)), DOPT_ERR_PROTOCOL);
    DT_CHECKF(strstr(dopt_dp_detail(&b), "arrived corrupt (host bytes' hash") != NULL, "%s", dopt_dp_detail(&b));
    DT_CHECK(b.step == 0 && hb[2] == 99);
    /* a byte changed in transit: refused, nothing taken */
    memcpy(copy, pay, bytes);
    copy[bytes - 3] ^= 0x10;
    DT_EQ_INT(dopt__dp_take(&b, &pb, sb, copy, bytes, hash, dopt__dp_host_hash(&a)), DOPT_ERR_PROTOCOL);
    DT_CHECKF(strstr(dopt_dp_detail(&b), "arrived corrupt") != NULL, "%s", dopt_dp_detail(&b));
    DT_CHECK(b.step == 0 && kb[0] == 100.0f && rb[0] == 3.0f);
    memcpy(copy, pay, bytes);
    copy[8] ^= 1; /* the version */
    DT_EQ_INT(dopt__dp_take(&b, &pb, sb, copy, bytes, hash, dopt__dp_host_hash(&a)), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&b), "format version") != NULL, "%s", dopt_dp_detail(&b));
    memcpy(copy, pay, bytes);
    DT_EQ_INT(dopt__dp_take(&b, &pb, sb, copy, bytes - 4, hash, dopt__dp_host_hash(&a)), DOPT_ERR_PROTOCOL); /* short */
    DT_CHECKF(strstr(dopt_dp_detail(&b), "holds") != NULL, "%s", dopt_dp_detail(&b));
    /* another model size: named */
    DT_OK(dopt_dp_init(&other, c, N + 1, &cfg));
    {
        dopt_buf po = dopt_buf_flat(xb, N + 1, NULL, 0);
        memcpy(copy, pay, bytes);
        DT_EQ_INT(dopt__dp_take(&other, &po, sb, copy, bytes, hash, dopt__dp_host_hash(&a)), DOPT_ERR_INVALID);
        DT_CHECKF(strstr(dopt_dp_detail(&other), "elastic: the job runs with element count 96, this driver has 97"),
                  "%s", dopt_dp_detail(&other));
    }
    dopt_dp_free(&other);
    /* another host state size: named */
    DT_OK(dopt_dp_init(&other, c, N, &cfg));
    DT_OK(dopt_dp_host_state(&other, ho, sizeof ho));
    memcpy(copy, pay, bytes);
    DT_EQ_INT(dopt__dp_take(&other, &pb, sb, copy, bytes, hash, dopt__dp_host_hash(&a)), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&other), "host state bytes (dopt_dp_host_state) 24, this driver has 16"), "%s",
              dopt_dp_detail(&other));
    dopt_dp_free(&other);
    /* whole: taken */
    memcpy(copy, pay, bytes);
    DT_OK(dopt__dp_take(&b, &pb, sb, copy, bytes, hash, dopt__dp_host_hash(&a)));
    DT_CHECK(memcmp(xb, xa, sizeof(float) * N) == 0 && memcmp(mb, ma, sizeof mb) == 0);
    DT_CHECK(b.step == a.step && b.syncs == a.syncs && b.sync_step == a.step && !b.joining && b.anchor_set);
    DT_CHECK(memcmp(b.anchor, a.anchor, sizeof(float) * N) == 0 && memcmp(b.outer_v, a.outer_v, sizeof(float) * N) == 0);
    DT_CHECK(kb[0] == 100.0f && rb[0] == 0.0f); /* KEEP as it was, RESET zeroed */
    DT_CHECK(memcmp(hb, ha, sizeof ha) == 0);     /* the sender's host bytes */
    DT_EQ_INT((int)dopt__dp_state_payload(&b, &pb, sb, copy, &h2), (int)bytes); /* b would send what a sent */
    DT_CHECK(h2 == hash);
    free(pay);
    free(copy);
    dopt_dp_free(&a);
    dopt_dp_free(&b);
    dopt_comm_destroy(c);
}

DTEST(elastic_driver_is_refused_without_shrink_and_with_what_it_cannot_carry) {
    dopt_comm *c = NULL;
    dopt_dp dp;
    dopt_dp_config cfg;
    dopt_tcp_config tc;
    memset(&cfg, 0, sizeof cfg);
    cfg.elastic = 1;
    DT_OK(dopt_comm_create_self(&c));
    DT_EQ_INT(dopt_dp_init(&dp, c, 8, &cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&dp), "DOPT_SHRINK") != NULL, "%s", dopt_dp_detail(&dp));
    dopt_dp_free(&dp);
    dopt_comm_destroy(c);
    memset(&tc, 0, sizeof tc);
    tc.world_size = 1;
    tc.on_peer_lost = DOPT_SHRINK;
    DT_OK(dopt_tcp_create(&c, &tc));
    cfg.sync_grads = 1;
    DT_EQ_INT(dopt_dp_init(&dp, c, 8, &cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(dopt_dp_detail(&dp), "sync_grads") != NULL, "%s", dopt_dp_detail(&dp));
    dopt_dp_free(&dp);
    cfg.sync_grads = 0;
    DT_OK(dopt_dp_init(&dp, c, 8, &cfg));
    dopt_dp_free(&dp);
    dopt_comm_destroy(c);
}

DTEST(shrink_refuses_a_healthy_a_group_and_a_mismatch) {
    refusals(DOPT_SHRINK);
    refusals(DOPT_FAIL);
}

DTEST(shrink_without_the_setting_or_on_a_backend_that_cannot_is_refused) {
    dopt_comm *c = NULL, *next = NULL;
    DT_OK(dopt_comm_create_self(&c));
    DT_EQ_INT(dopt_comm_shrink(c, &next), DOPT_ERR_UNSUPPORTED);
    DT_EQ_INT(dopt_comm_shrink(NULL, &next), DOPT_ERR_INVALID);
    DT_EQ_INT(dopt_comm_shrink(c, NULL), DOPT_ERR_INVALID);
    dopt_comm_destroy(c);
}

DTEST(the_tcp_config_and_environment_set_on_peer_lost_and_min_ranks) {
    dopt_tcp_config cfg;
    dopt_comm *c = NULL;
    memset(&cfg, 0, sizeof cfg);
    setenv("DOPT_RANK", "0", 1);
    setenv("DOPT_WORLD_SIZE", "1", 1);
    setenv("DOPT_ON_PEER_LOST", "shrink", 1);
    setenv("DOPT_MIN_RANKS", "1", 1);
    DT_OK(dopt_tcp_config_from_env(&cfg));
    DT_EQ_INT(cfg.on_peer_lost, DOPT_SHRINK);
    DT_EQ_INT(cfg.min_ranks, 1);
    DT_OK(dopt_tcp_create(&c, &cfg));
    DT_EQ_INT(c->on_peer_lost, DOPT_SHRINK);
    DT_EQ_INT(c->min_ranks, 1);
    dopt_comm_destroy(c);
    setenv("DOPT_ON_PEER_LOST", "survive", 1);
    DT_EQ_INT(dopt_tcp_config_from_env(&cfg), DOPT_ERR_INVALID);
    setenv("DOPT_ON_PEER_LOST", "fail", 1);
    setenv("DOPT_MIN_RANKS", "-2", 1);
    DT_EQ_INT(dopt_tcp_config_from_env(&cfg), DOPT_ERR_INVALID);
    unsetenv("DOPT_MIN_RANKS");
    unsetenv("DOPT_ON_PEER_LOST");
    memset(&cfg, 0, sizeof cfg);
    cfg.world_size = 1;
    cfg.on_peer_lost = 7;
    DT_EQ_INT(dopt_tcp_create(&c, &cfg), DOPT_ERR_INVALID);
    cfg.on_peer_lost = DOPT_SHRINK;
    cfg.min_ranks = 2;
    DT_EQ_INT(dopt_tcp_create(&c, &cfg), DOPT_ERR_INVALID);
}

/* Captures the last error line of a refused create. */

DTEST(the_shm_config_and_environment_set_on_peer_lost_and_min_ranks) {
    dopt_shm_config cfg;
    dopt_comm *c = NULL;
    memset(&cfg, 0, sizeof cfg);
    setenv("DOPT_RANK", "0", 1);
    setenv("DOPT_WORLD_SIZE", "1", 1);
    setenv("DOPT_ON_PEER_LOST", "shrink", 1);
    setenv("DOPT_MIN_RANKS", "1", 1);
    DT_OK(dopt_shm_config_from_env(&cfg));
    DT_EQ_INT(cfg.on_peer_lost, DOPT_SHRINK);
    DT_EQ_INT(cfg.min_ranks, 1);
    DT_OK(dopt_shm_create(&c, &cfg));
    DT_EQ_INT(c->on_peer_lost, DOPT_SHRINK);
    DT_EQ_INT(c->min_ranks, 1);
    dopt_comm_destroy(c);
    cfg.log_fn = shm_refusal_log;
    setenv("DOPT_ON_PEER_LOST", "survive", 1);
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(shm_refusal, "DOPT_ON_PEER_LOST") != NULL, "%s", shm_refusal);
    setenv("DOPT_ON_PEER_LOST", "fail", 1);
    setenv("DOPT_MIN_RANKS", "-2", 1);
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(shm_refusal, "DOPT_MIN_RANKS") != NULL, "%s", shm_refusal);
    unsetenv("DOPT_MIN_RANKS");
    unsetenv("DOPT_ON_PEER_LOST");
    unsetenv("DOPT_RANK");
    unsetenv("DOPT_WORLD_SIZE");
    setenv("DOPT_JOIN", "1", 1); /* a joiner needs neither rank nor size */
    memset(&cfg, 0, sizeof cfg);
    DT_OK(dopt_shm_config_from_env(&cfg));
    DT_EQ_INT(cfg.join, 1);
    setenv("DOPT_JOIN", "yes", 1);
    cfg.log_fn = shm_refusal_log;
    DT_EQ_INT(dopt_shm_config_from_env(&cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(shm_refusal, "DOPT_JOIN") != NULL, "%s", shm_refusal);
    unsetenv("DOPT_JOIN");
    memset(&cfg, 0, sizeof cfg);
    cfg.size = 1;
    cfg.log_fn = shm_refusal_log;
    cfg.on_peer_lost = 7;
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(shm_refusal, "on_peer_lost is 7") != NULL, "%s", shm_refusal);
    cfg.on_peer_lost = DOPT_SHRINK;
    cfg.min_ranks = 2;
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(shm_refusal, "min_ranks 2") != NULL, "%s", shm_refusal);
    cfg.min_ranks = 0;
    cfg.size = 65;
    cfg.name = "shrink-test-too-many";
    DT_EQ_INT(dopt_shm_create(&c, &cfg), DOPT_ERR_INVALID); /* one 64-bit word holds a decision */
    DT_CHECKF(strstr(shm_refusal, "up to 64 ranks") != NULL, "%s", shm_refusal);
}

DTEST_MAIN()
