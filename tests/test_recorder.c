/* Tests of the flight recorder (distopt.h: FLIGHT RECORDER) and of distopt-inspect, which must
   name the rank everyone waits for.

   Each injected case starts a job of 4 real processes over a transport of worlds.h (shm direct,
   shm's engine, TCP on loopback), with the recorder's files in a directory of its own
   (DOPT_RECORDER_DIR). Every rank runs the same loop of 12 small allreduces whose sizes repeat
   with period 4 (1000 .. 1003 elements, then 2^18 .. 2^18 + 3 for the ring); one rank, the victim, departs from it at step
   6 (sequence number 7): it skips that allreduce, calls an extra barrier before it, calls it with
   another size, SIGKILLs itself, SIGSTOPs itself, or waits outside distopt (a rank behind); or
   nobody departs and the job runs on (distopt-inspect must then name nobody: rank=-1). Then build/distopt-inspect reads the
   directory, and its "culprit rank=R seq=S cause=C" line must name the victim, sequence number 7
   and the cause. For a stopped rank and one behind it runs while the job hangs (polled until every other rank
   has begun #7, at most INSPECT_BUDGET_S); for the other cases after the job ended, since a
   failed rank keeps its file. Prints "inspect cases=<n> named=<n>" per transport and requires
   named == cases (REC_SHOW=1 in the environment prints every case's output). A clean job leaves no file behind, and the per-peer waiting counters name a
   rank that sleeps before every collective. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "dtest.h"
#include "worlds.h"
#define DOPT_INSPECT_NO_MAIN
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function" /* the tool's, but its reader of entries */
#include "../tools/distopt-inspect.c"
#pragma GCC diagnostic pop

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>

#define REC_RANKS 4
#define REC_STEPS 12
#define REC_AT 6               /* the victim departs at this step: sequence number REC_AT + 1 */
#define REC_TIMEOUT_MS 20000   /* every rank's timeout: a stopped rank's job hangs this long at most */
#define INSPECT_BUDGET_S 20    /* how long a hung job is polled for the others to reach #7 */

typedef enum rec_case { REC_SKIP, REC_EXTRA, REC_SIZE, REC_DEAD, REC_STOP, REC_SLOW, REC_MOVING, REC_NCASES } rec_case;
static const char *const rec_case_names[REC_NCASES] = {"skipped", "extra", "size", "dead", "stopped", "behind",
                                                       "none"};

typedef struct rec_trial {
    world w;
    rec_case what;
    int victim;
    size_t base;        /* allreduces of base .. base + 3 elements: the direct path, or the ring */
    int ready_pipe[2];
} rec_trial;

static size_t rec_count(const rec_trial *t, int step) { return t->base + (size_t)(step % 4); }

/* A rank: the loop, with the victim's departure at REC_AT; exits with its status. */
static void rec_rank(rec_trial *t, int rank) {
    dopt_comm *c = world_join(&t->w, rank);
    float *buf = (float *)calloc(t->base + 16, sizeof(float));
    dopt_status s = DOPT_OK;
    int step;
    DT_CHECK(buf != NULL);
    dopt_comm_set_timeout(c, REC_TIMEOUT_MS);
    dtest_write_int(t->ready_pipe[1], rank);
    for (step = 0; (step < REC_STEPS || t->what == REC_MOVING) && s == DOPT_OK; step++) {
        size_t n = rec_count(t, step);
        if (rank == t->victim && step == REC_AT) {
            if (t->what == REC_SKIP) continue;
            if (t->what == REC_EXTRA) s = dopt_barrier(c);
            if (t->what == REC_SIZE) n += 7;
            if (t->what == REC_DEAD) raise(SIGKILL);
            if (t->what == REC_STOP) raise(SIGSTOP);
            while (t->what == REC_SLOW) pause(); /* busy elsewhere, until killed */
            if (s != DOPT_OK) break;
        }
        s = dopt_allreduce(c, buf, n, DOPT_F32, DOPT_SUM);
    }
    _exit(dopt_comm_finish(c, s));
}

/* build/distopt-inspect, beside this program. */
static void rec_inspector(char *out, size_t cap) {
    char self[400];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    char *slash;
    DT_CHECK(n > 0);
    self[n] = '\0';
    slash = strrchr(self, '/');
    DT_CHECK(slash != NULL);
    *slash = '\0';
    snprintf(out, cap, "%s/distopt-inspect", self);
    DT_CHECKF(access(out, X_OK) == 0, "%s is not built (make all builds it)", out);
}

/* Runs distopt-inspect on dir; its output in out, the culprit line's fields parsed (1 when found). */
static int rec_inspect(const char *dir, char *out, size_t cap, int *rank, unsigned long long *seq, char *cause) {
    char exe[512], cmd[1200];
    const char *line;
    FILE *p;
    size_t used = 0, got;
    rec_inspector(exe, sizeof exe);
    snprintf(cmd, sizeof cmd, "'%s' --dir '%s' --interval 100 2>&1", exe, dir);
    p = popen(cmd, "r");
    DT_CHECK(p != NULL);
    while (used + 1 < cap && (got = fread(out + used, 1, cap - 1 - used, p)) > 0) used += got;
    out[used] = '\0';
    pclose(p);
    line = strstr(out, "culprit rank=");
    return line && sscanf(line, "culprit rank=%d seq=%llu cause=%15s", rank, seq, cause) == 3;
}

static void rec_rmdir(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[512];
    if (d == NULL) return;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

static int rec_files(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    if (d == NULL) return -1;
    while ((e = readdir(d)) != NULL) n += strncmp(e->d_name, "dopt-rec.", 9) == 0;
    closedir(d);
    return n;
}

/* Forks the job with the recorder in dir; pids[] filled. */
static void rec_start(rec_trial *t, world_via via, const char *dir, pid_t *pids) {
    struct timespec ts;
    int r;
    memset(&t->w, 0, sizeof t->w);
    t->w.via = via;
    t->w.n = REC_RANKS;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    snprintf(t->w.shm_name, sizeof t->w.shm_name, "dtest-rec-%d-%lld", (int)getpid(), (long long)ts.tv_nsec);
    DT_CHECK(pipe(t->w.port_pipe) == 0 && pipe(t->ready_pipe) == 0);
    setenv("DOPT_RECORDER_DIR", dir, 1);
    fflush(stdout);
    fflush(stderr);
    for (r = 0; r < REC_RANKS; r++) {
        pids[r] = fork();
        DT_CHECK(pids[r] >= 0);
        if (pids[r] == 0) rec_rank(t, r);
    }
    for (r = 0; r < REC_RANKS; r++) dtest_read_int(t->ready_pipe[0], "a rank's ready signal");
}

static void rec_end(rec_trial *t, pid_t *pids) {
    int r;
    for (r = 0; r < REC_RANKS; r++) {
        kill(pids[r], SIGCONT);
        kill(pids[r], SIGKILL);
        waitpid(pids[r], NULL, 0);
    }
    close(t->w.port_pipe[0]);
    close(t->w.port_pipe[1]);
    close(t->ready_pipe[0]);
    close(t->ready_pipe[1]);
}

/* Waits for every rank but the victim to exit (at most REC_TIMEOUT_MS and a margin). */
static void rec_reap_survivors(const pid_t *pids, int victim) {
    double deadline = dtest_now_ms() + REC_TIMEOUT_MS + 10000;
    int r;
    for (r = 0; r < REC_RANKS; r++) {
        if (r == victim) continue;
        while (waitpid(pids[r], NULL, WNOHANG) == 0 && dtest_now_ms() < deadline) usleep(2000);
    }
}

/* One injected case: 1 when distopt-inspect named the victim, REC_AT + 1 and the cause. */
static int rec_case_run(world_via via, rec_case what, int victim, size_t base) {
    rec_trial t;
    pid_t pids[REC_RANKS];
    char dir[64] = "/tmp/dtest-rec-XXXXXX", out[8192], cause[16] = "";
    unsigned long long seq = 0;
    int rank = -1, found = 0, named;
    unsigned long long at = REC_AT + 1; /* the sequence number to be named */
    double deadline;
    DT_CHECK(mkdtemp(dir) != NULL);
    t.what = what;
    t.victim = victim;
    t.base = base;
    rec_start(&t, via, dir, pids);
    if (what == REC_STOP || what == REC_SLOW) { /* the job hangs: inspect it live, until the others are all in #7 */
        deadline = dtest_now_ms() + INSPECT_BUDGET_S * 1e3;
        do {
            found = rec_inspect(dir, out, sizeof out, &rank, &seq, cause);
            if (found && rank == victim && seq == REC_AT + 1 && strcmp(cause, rec_case_names[what]) == 0) break;
            usleep(20000);
        } while (dtest_now_ms() < deadline);
    } else if (what == REC_MOVING) { /* nobody departs: the job moves on while it is read */
        found = rec_inspect(dir, out, sizeof out, &rank, &seq, cause);
    } else {
        rec_reap_survivors(pids, victim);
        found = rec_inspect(dir, out, sizeof out, &rank, &seq, cause);
    }
    rec_end(&t, pids);
    rec_rmdir(dir);
    if (what == REC_MOVING) victim = -1, at = 0; /* nobody, at no collective */
    named = found && rank == victim && seq == at && strcmp(cause, rec_case_names[what]) == 0;
    if (!named || getenv("REC_SHOW"))
        printf("  %s, %zu-element allreduces, rank %d %s at #%d: distopt-inspect said rank=%d seq=%llu cause=%s:\n%s\n",
               world_via_name(via), base, victim, rec_case_names[what], (int)at, rank, seq, cause, out);
    return named;
}

/* Every case, with victims 1 and 3 (3: the ring's last, whose neighbour is rank 0), on small
   allreduces (every rank waits for every other) and on 1 MiB ones (a ring: each waits for its
   neighbour only); and a job that runs on unharmed, read while it moves: nobody is named. */
static void rec_cases(world_via via, int n) {
    static const size_t bases[2] = {1000, 1u << 18};
    int cases = 0, named = 0, what, victim, b;
    (void)n;
    for (b = 0; b < 2; b++)
        for (what = 0; what < REC_NCASES; what++)
            for (victim = 1; victim < REC_RANKS; victim += 2) {
                if (what == REC_MOVING && victim > 1) continue;
                cases++;
                named += rec_case_run(via, (rec_case)what, victim, bases[b]);
            }
    printf("inspect transport=%s cases=%d named=%d\n", world_via_name(via), cases, named);
    DT_EQ_INT(named, cases);
}

DTEST_WORLDS_RUN(inspect_names_the_rank_everyone_waits_for, rec_cases, REC_RANKS, REC_RANKS);

/* ------------------------------------------------------------------ a clean job leaves nothing */

static char clean_dir[64];

static void body_clean(dopt_comm *c, void *arg) {
    float x[64] = {0};
    int i;
    (void)arg;
    for (i = 0; i < 5; i++) DT_OK(dopt_allreduce(c, x, 64, DOPT_F32, DOPT_SUM));
    DT_EQ_INT(rec_files(clean_dir) >= 1, 1); /* this rank's file, at least, while the job runs */
}

static void rec_clean(world_via via, int n) {
    snprintf(clean_dir, sizeof clean_dir, "/tmp/dtest-rec-XXXXXX");
    DT_CHECK(mkdtemp(clean_dir) != NULL);
    setenv("DOPT_RECORDER_DIR", clean_dir, 1);
    world_run(via, n, body_clean, NULL);
    DT_EQ_INT(rec_files(clean_dir), 0);
    rec_rmdir(clean_dir);
}

DTEST_WORLDS_RUN(clean_job_leaves_no_file, rec_clean, 2, 3);

/* ------------------------------------------------------------------ the recorder's entries */

/* A communicator's own file, parsed through the public layout: the newest entry. */
static void body_entries(dopt_comm *c, void *arg) {
    const dopt_rec_header *h;
    const dopt_rec_entry *x;
    float v[300] = {0};
    (void)arg;
    DT_OK(dopt_allreduce(c, v, 300, DOPT_F32, DOPT_MAX));
    DT_OK(dopt_broadcast(c, v, 12, c->size - 1));
    DT_CHECK(c->rec != NULL && c->rec->mapped);
    h = c->rec->hdr;
    DT_CHECK(h->magic == DOPT_REC_MAGIC && h->rank == c->rank && h->size == c->size && h->pid == (int32_t)getpid());
    DT_CHECK(h->written == 2 && h->state == DOPT_REC_RUNNING);
    x = &c->rec->ring[0];
    DT_CHECK(x->kind == DOPT_COLL_ALLREDUCE && x->seq == 1 && x->count == 300 && x->op == DOPT_MAX && x->end_ns >= x->start_ns);
    x = &c->rec->ring[1];
    DT_CHECK(x->kind == DOPT_COLL_BROADCAST && x->seq == 2 && x->count == 12 && x->root == c->size - 1 && x->end_ns != 0);
    DT_CHECK((x->lock & 1u) == 0 && x->status == 0);
    DT_CHECK(c->traffic.busy_ns > 0);
}

DTEST_WORLDS(entries_record_each_collective, body_entries, NULL, 2, 3);

/* ------------------------------------------------------------------ straggler figures */

/* Rank 1 sleeps before every allreduce: the others' time waiting is charged to it. shm's direct
   collectives run in the backend, which times no arrivals: engine transports only. */
static void body_straggler(dopt_comm *c, void *arg) {
    float x[256] = {0};
    int i, r;
    (void)arg;
    memset(&c->traffic, 0, sizeof c->traffic);
    for (i = 0; i < 6; i++) {
        if (c->rank == 1) usleep(30000);
        DT_OK(dopt_allreduce(c, x, 256, DOPT_F32, DOPT_SUM));
    }
    if (c->rank == 1) return;
    for (r = 0; r < c->size; r++)
        if (r != 1) DT_CHECKF(c->traffic.waited_ns[1] > 4 * c->traffic.waited_ns[r], "rank %d: waited %llu ns for rank 1, %llu for rank %d", c->rank, (unsigned long long)c->traffic.waited_ns[1], (unsigned long long)c->traffic.waited_ns[r], r);
    DT_CHECK(dopt_comm_straggler(c, 1) > 0.5 && dopt_comm_straggler(c, 1) <= 1.0);
    DT_CHECK(dopt_comm_straggler(c, c->rank) == 0.0 && dopt_comm_straggler(c, -1) == 0.0 &&
             dopt_comm_straggler(c, DOPT_STRAGGLER_RANKS) == 0.0);
}

DTEST_WORLDS_ON(straggler_score_names_the_rank_that_sleeps, body_straggler, NULL, 3, 4,
                WORLD_MASK_SHM_ENGINE | WORLD_MASK_TCP);

/* ------------------------------------------------------------------ files written by hand */

/* A rank's file as the recorder writes it, with the given calls (allreduces of counts[i]
   elements, or a barrier for a count of 0) as #1, #2, ...; the last one failed when failed. */
static void rec_write_file(const char *dir, int rank, int size, const size_t *counts, int n, int failed) {
    static dopt_rec_entry ring[16];
    dopt_rec_header h;
    unsigned char pad[DOPT_REC_HEADER_BYTES];
    char path[256];
    FILE *f;
    int i;
    memset(&h, 0, sizeof h);
    memset(ring, 0, sizeof ring);
    memset(pad, 0, sizeof pad);
    h.magic = DOPT_REC_MAGIC;
    h.version = DOPT_REC_VERSION;
    h.header_bytes = DOPT_REC_HEADER_BYTES;
    h.entry_bytes = sizeof(dopt_rec_entry);
    h.capacity = 16;
    h.rank = rank;
    h.size = size;
    h.pid = 0; /* no process: gone */
    h.state = failed ? DOPT_REC_FAILED : DOPT_REC_RUNNING;
    h.job = 0x1234;
    h.written = (uint64_t)n;
    snprintf(h.transport, sizeof h.transport, "test");
    for (i = 0; i < n; i++) {
        ring[i].kind = counts[i] ? DOPT_COLL_ALLREDUCE : DOPT_COLL_BARRIER;
        ring[i].seq = (uint64_t)i + 1;
        ring[i].count = counts[i];
        ring[i].start_ns = 1000u * (uint64_t)(i + 1);
        ring[i].end_ns = ring[i].start_ns + 10;
    }
    if (failed) ring[n - 1].status = DOPT_ERR_MISMATCH;
    memcpy(pad, &h, sizeof h);
    snprintf(path, sizeof path, "%s/dopt-rec.%016llx.%d", dir, (unsigned long long)h.job, rank);
    f = fopen(path, "wb");
    DT_CHECK(f != NULL);
    DT_CHECK(fwrite(pad, 1, sizeof pad, f) == sizeof pad && fwrite(ring, sizeof ring, 1, f) == 1);
    fclose(f);
}

/* Ranks 0 and 3 failed in #6 (a neighbour's abort reached them before they began #7), rank 2
   called #7 as the loop goes on, rank 1 an extra barrier: the ranks that never got to #7 vote
   with what their history says comes next, so rank 1 is named, not rank 2. */
DTEST(inspect_predicts_the_next_call_of_a_rank_that_failed_early) {
    static const size_t upto6[6] = {1000, 1001, 1002, 1003, 1000, 1001};
    static const size_t seven[7] = {1000, 1001, 1002, 1003, 1000, 1001, 1002};
    static const size_t extra[7] = {1000, 1001, 1002, 1003, 1000, 1001, 0};
    char dir[64] = "/tmp/dtest-rec-XXXXXX", out[8192], cause[16] = "";
    unsigned long long seq = 0;
    int rank = -1;
    DT_CHECK(mkdtemp(dir) != NULL);
    rec_write_file(dir, 0, 4, upto6, 6, 1);
    rec_write_file(dir, 1, 4, extra, 7, 1);
    rec_write_file(dir, 2, 4, seven, 7, 1);
    rec_write_file(dir, 3, 4, upto6, 6, 1);
    DT_CHECK(rec_inspect(dir, out, sizeof out, &rank, &seq, cause));
    rec_rmdir(dir);
    DT_CHECKF(rank == 1 && seq == 7 && strcmp(cause, "extra") == 0, "distopt-inspect said:\n%s", out);
}

/* ------------------------------------------------------------------ a reader while it is written */

/* A writer process records collectives as fast as it can (allreduce #s of 7·s elements, root s
   mod 1000); 1000 times this process stops it wherever it is (often in the middle of an entry,
   as a SIGSTOP or a crash leaves one) and reads, the way distopt-inspect does, the entry being
   begun (which may still hold a collective 2048 older) and the newest: every copy the seqlock
   calls consistent must be one the writer wrote whole (the fields of one collective, its start
   no earlier than its predecessor's). */
DTEST(reader_never_keeps_a_torn_entry) {
    char dir[64] = "/tmp/dtest-rec-XXXXXX", path[256];
    struct stat st;
    pid_t writer;
    void *map = MAP_FAILED;
    long kept = 0, torn = 0, pass;
    int fd = -1, i;
    DT_CHECK(mkdtemp(dir) != NULL);
    setenv("DOPT_RECORDER_DIR", dir, 1);
    fflush(stdout);
    writer = fork();
    DT_CHECK(writer >= 0);
    if (writer == 0) {
        dopt_comm *c;
        dopt_coll_desc d;
        uint64_t s;
        if (dopt_comm_create_self(&c) != DOPT_OK) _exit(1);
        dopt_comm_set_job(c, "torn", 4);
        memset(&d, 0, sizeof d);
        d.kind = DOPT_COLL_ALLREDUCE;
        for (s = 1;; s++) {
            uint64_t slot;
            d.seq = s;
            d.count = 7 * s;
            d.root = (int)(s % 1000);
            slot = dopt__rec_begin(c, &d);
            dopt__rec_expect(c, slot, (int)(s % 5));
            dopt__rec_end(c, c, slot, DOPT_OK);
        }
    }
    snprintf(path, sizeof path, "%s/dopt-rec.%016llx.0", dir,
             (unsigned long long)dopt__mix64(dopt__fnv1a(DOPT__FNV_OFFSET, "torn", 4)));
    for (i = 0; i < 2000 && (fd = open(path, O_RDONLY)) < 0; i++) usleep(1000);
    DT_CHECKF(fd >= 0, "the writer's file %s never appeared", path);
    while (fstat(fd, &st) == 0 && (size_t)st.st_size < DOPT__REC_BYTES) usleep(1000);
    map = mmap(NULL, DOPT__REC_BYTES, PROT_READ, MAP_SHARED, fd, 0);
    DT_CHECK(map != MAP_FAILED);
    for (pass = 0; pass < 1000; pass++) { /* the writer stopped wherever it is, often mid-entry */
        const dopt_rec_header *h = (const dopt_rec_header *)map;
        const dopt_rec_entry *ring = (const dopt_rec_entry *)((const unsigned char *)map + DOPT_REC_HEADER_BYTES);
        uint64_t w;
        dopt_rec_entry e, p;
        int status;
        usleep(200);
        kill(writer, SIGSTOP);
        DT_CHECK(waitpid(writer, &status, WUNTRACED) == writer && WIFSTOPPED(status));
        w = __atomic_load_n(&h->written, __ATOMIC_ACQUIRE);
        for (i = 0; i < 2; i++) { /* the entry being begun (it holds a collective 2048 older), the newest */
            if (!inspect_copy_entry(&ring[(w + DOPT_REC_ENTRIES - (uint64_t)i) % DOPT_REC_ENTRIES], &e, 1) || e.seq == 0)
                continue;
            kept++;
            if (e.count != 7 * e.seq || e.root != (int32_t)(e.seq % 1000) ||
                (e.npeers == 1 && e.peers[0].peer != (int32_t)(e.seq % 5)))
                torn++;
            else if (inspect_copy_entry(&ring[(e.seq + DOPT_REC_ENTRIES - 2) % DOPT_REC_ENTRIES], &p, 1) &&
                     p.seq + 1 == e.seq && e.start_ns < p.start_ns)
                torn++; /* a new sequence number beside the start time of the collective it replaces */
        }
        kill(writer, SIGCONT);
    }
    kill(writer, SIGKILL);
    waitpid(writer, NULL, 0);
    munmap(map, DOPT__REC_BYTES);
    close(fd);
    rec_rmdir(dir);
    printf("  %ld entries kept by the reader, %ld torn\n", kept, torn);
    DT_CHECK(kept > 0);
    DT_EQ_INT(torn, 0);
}

/* DOPT_RECORDER=0: no file, nothing recorded, the collectives as before. */
DTEST(recorder_off_records_nothing) {
    dopt_comm *c;
    double x = 1.0;
    setenv("DOPT_RECORDER", "0", 1);
    DT_OK(dopt_comm_create_self(&c));
    DT_OK(dopt_allreduce(c, &x, 1, DOPT_F64, DOPT_SUM));
    DT_CHECK(c->rec == NULL || c->rec->ring == NULL);
    dopt_comm_destroy(c);
    unsetenv("DOPT_RECORDER");
}

DTEST_MAIN()
