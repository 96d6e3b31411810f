/* distopt-inspect — which rank is everyone waiting for? Reads the flight recorder files every rank
   of a distopt job keeps (distopt.h: FLIGHT RECORDER), while the job runs, hangs, or after it
   failed, and says who lags and where the ranks diverge.

   Build: make build/distopt-inspect (cc -std=c11 -D_GNU_SOURCE -I. tools/distopt-inspect.c).
   Usage: see usage() below, or run it with --help.

   The file parser (inspect_parse) takes bytes, not a file, so fuzz/fuzz_recorder.c feeds it
   arbitrary ones: a torn, truncated or hostile file is refused or its bad entries skipped, never
   read out of bounds. */
#include "../distopt.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define INSPECT_MAX_RANKS 4096
#define INSPECT_MAX_CAPACITY (1u << 20)

/* One rank's file, parsed. */
typedef struct inspect_rank {
    dopt_rec_header hdr;
    dopt_rec_entry *entries; /* oldest first */
    size_t n;                /* entries kept */
    size_t skipped;          /* entries torn or malformed */
    uint64_t written;        /* entries its writer had begun when read */
    int gone;                /* its process no longer exists */
    int stopped;             /* its process is stopped (SIGSTOP, ^Z, a debugger) */
    char path[512];
} inspect_rank;

/* ------------------------------------------------------------------------ parsing */

static uint32_t inspect_lock_of(const dopt_rec_entry *x) { return __atomic_load_n(&x->lock, __ATOMIC_ACQUIRE); }

/* Copies entry x as its writer left it: retries (up to tries times) while its seqlock is odd or
   moved during the copy. 1 when the copy is consistent. */
static int inspect_copy_entry(const dopt_rec_entry *x, dopt_rec_entry *out, int tries) {
    int t;
    for (t = 0; t < tries; t++) {
        uint32_t before = inspect_lock_of(x);
        if (before & 1u) continue;
        memcpy(out, (const void *)x, sizeof *out);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&x->lock, __ATOMIC_RELAXED) == before) return 1;
    }
    return 0;
}

/* An entry whose fields a writer could have written. */
static int inspect_entry_ok(const dopt_rec_entry *x, int size) {
    int i;
    if (x->kind < DOPT_COLL_ALLREDUCE || x->kind > DOPT_COLL_EXCHANGE || x->dtype > DOPT_I64 || x->op > DOPT_MEAN ||
        x->npeers > DOPT_REC_PEERS || x->seq == 0)
        return 0;
    for (i = 0; i < x->npeers; i++)
        if (x->peers[i].peer < 0 || x->peers[i].peer >= size) return 0;
    return 1;
}

/* Parses a recorder file's bytes (a live mapping or a copy): 0 with out filled (entries
   allocated, oldest first), else -1 with why. tries: how often a torn entry is read again. */
static int inspect_parse(const unsigned char *buf, size_t len, int tries, inspect_rank *out, char *why, size_t cap) {
    const dopt_rec_header *h = (const dopt_rec_header *)buf;
    uint64_t written, first, k;
    memset(out, 0, sizeof *out);
    if (len < sizeof(dopt_rec_header) || len < DOPT_REC_HEADER_BYTES) {
        snprintf(why, cap, "%zu bytes: shorter than a header", len);
        return -1;
    }
    memcpy(&out->hdr, h, sizeof out->hdr);
    out->hdr.transport[sizeof out->hdr.transport - 1] = '\0';
    out->hdr.detail[sizeof out->hdr.detail - 1] = '\0';
    if (out->hdr.magic != DOPT_REC_MAGIC) return snprintf(why, cap, "not a distopt recorder file"), -1;
    if (out->hdr.version != DOPT_REC_VERSION)
        return snprintf(why, cap, "version %u, this tool reads %d", out->hdr.version, DOPT_REC_VERSION), -1;
    if (out->hdr.header_bytes != DOPT_REC_HEADER_BYTES || out->hdr.entry_bytes != sizeof(dopt_rec_entry) ||
        out->hdr.capacity == 0 || out->hdr.capacity > INSPECT_MAX_CAPACITY)
        return snprintf(why, cap, "a header of %u bytes, entries of %u, %u of them: not this layout",
                        out->hdr.header_bytes, out->hdr.entry_bytes, out->hdr.capacity), -1;
    if ((len - DOPT_REC_HEADER_BYTES) / sizeof(dopt_rec_entry) < out->hdr.capacity)
        return snprintf(why, cap, "%zu bytes: too short for %u entries", len, out->hdr.capacity), -1;
    if (out->hdr.size < 1 || out->hdr.size > INSPECT_MAX_RANKS || out->hdr.rank < 0 || out->hdr.rank >= out->hdr.size)
        return snprintf(why, cap, "rank %d of %d: out of range", out->hdr.rank, out->hdr.size), -1;
    if (out->hdr.state != DOPT_REC_RUNNING && out->hdr.state != DOPT_REC_FAILED)
        return snprintf(why, cap, "state %u: unknown", out->hdr.state), -1;
    written = __atomic_load_n(&h->written, __ATOMIC_ACQUIRE);
    out->written = written;
    first = written > out->hdr.capacity ? written - out->hdr.capacity : 0;
    out->entries = (dopt_rec_entry *)malloc(sizeof(dopt_rec_entry) * (size_t)(written - first + 1));
    if (out->entries == NULL) return snprintf(why, cap, "out of memory"), -1;
    for (k = first; k < written; k++) {
        const dopt_rec_entry *x =
            (const dopt_rec_entry *)(buf + DOPT_REC_HEADER_BYTES + (size_t)(k % out->hdr.capacity) * sizeof(dopt_rec_entry));
        dopt_rec_entry *e = &out->entries[out->n];
        if (inspect_copy_entry(x, e, tries) && inspect_entry_ok(e, out->hdr.size)) out->n++;
        else out->skipped++;
    }
    return 0;
}

static void inspect_rank_free(inspect_rank *r) {
    free(r->entries);
    r->entries = NULL;
}

/* ------------------------------------------------------------------------ processes */

static void inspect_process(inspect_rank *r) {
    char path[64], stat[512], *p;
    FILE *f;
    r->gone = r->hdr.pid <= 0 || (kill((pid_t)r->hdr.pid, 0) != 0 && errno == ESRCH);
    if (r->gone) return;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)r->hdr.pid);
    if ((f = fopen(path, "r")) == NULL) return;
    if (fgets(stat, sizeof stat, f) && (p = strrchr(stat, ')')) != NULL && p[1] == ' ') {
        r->stopped = p[2] == 'T' || p[2] == 't';
        r->gone = p[2] == 'Z' || p[2] == 'X'; /* dead, its parent has not collected it yet */
    }
    fclose(f);
}

/* ------------------------------------------------------------------------ describing */

static const char *inspect_kind(int k) {
    static const char *names[] = {"?", "allreduce", "allgather", "allgatherv", "broadcast", "barrier", "exchange"};
    return k >= 1 && k <= 6 ? names[k] : "?";
}

static void inspect_what(const dopt_rec_entry *x, char *out, size_t cap) {
    static const char *dt[] = {"f32", "f64", "i32", "i64"}, *op[] = {"sum", "max", "min", "mean"};
    char in[32] = "";
    if (x->group) snprintf(in, sizeof in, " in group %u", x->group);
    switch (x->kind) {
    case DOPT_COLL_ALLREDUCE:
        snprintf(out, cap, "allreduce #%llu%s (%s %s, %llu elems)", (unsigned long long)x->seq, in, dt[x->dtype & 3],
                 op[x->op & 3], (unsigned long long)x->count);
        break;
    case DOPT_COLL_BROADCAST:
        snprintf(out, cap, "broadcast #%llu%s (%llu bytes from rank %d)", (unsigned long long)x->seq, in,
                 (unsigned long long)x->count, x->root);
        break;
    case DOPT_COLL_BARRIER: snprintf(out, cap, "barrier #%llu%s", (unsigned long long)x->seq, in); break;
    case DOPT_COLL_EXCHANGE:
        snprintf(out, cap, "exchange #%llu%s (tag %llu)", (unsigned long long)x->seq, in, (unsigned long long)x->count);
        break;
    default:
        snprintf(out, cap, "%s #%llu%s (%llu bytes)", inspect_kind(x->kind), (unsigned long long)x->seq, in,
                 (unsigned long long)x->count);
    }
}

static double inspect_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The same call on two ranks: what the engine fingerprints. */
static int inspect_same(const dopt_rec_entry *a, const dopt_rec_entry *b) {
    return a->kind == b->kind && a->dtype == b->dtype && a->op == b->op && a->count == b->count && a->root == b->root &&
           a->group == b->group;
}

/* ------------------------------------------------------------------------ a job */

typedef struct inspect_job {
    uint64_t hash;
    inspect_rank *ranks; /* by rank; hdr.magic 0: no file for it */
    int size, found;
} inspect_job;

/* The newest entry of group 0 on r, or NULL. */
static const dopt_rec_entry *inspect_last(const inspect_rank *r) {
    size_t i;
    for (i = r->n; i > 0; i--)
        if (r->entries[i - 1].group == 0) return &r->entries[i - 1];
    return NULL;
}

/* r's entry of (group, seq), or NULL. */
static const dopt_rec_entry *inspect_find(const inspect_rank *r, uint32_t group, uint64_t seq) {
    size_t i;
    for (i = r->n; i > 0; i--)
        if (r->entries[i - 1].group == group && r->entries[i - 1].seq == seq) return &r->entries[i - 1];
    return NULL;
}

static int inspect_have(const inspect_job *j, int r) { return j->ranks[r].hdr.magic == DOPT_REC_MAGIC; }

/* The collective the others stopped in: the lowest sequence number of group 0 that some rank
   other than `not` began and did not complete; 0 when none. */
static uint64_t inspect_stuck_seq(const inspect_job *j, int not) {
    uint64_t best = 0;
    int r;
    for (r = 0; r < j->size; r++) {
        const dopt_rec_entry *x;
        if (r == not || !inspect_have(j, r) || (x = inspect_last(&j->ranks[r])) == NULL) continue;
        if ((x->end_ns == 0 || x->status != 0) && (best == 0 || x->seq < best)) best = x->seq;
    }
    return best;
}

static const char *inspect_status(int s) {
    static const char *names[] = {"ok",       "invalid",  "nomem",    "io",          "timeout",    "peer lost",
                                  "mismatch", "nonfinite", "protocol", "auth", "unsupported", "closed"};
    return s <= 0 && s >= -11 ? names[-s] : "?";
}

/* "waiting for ranks 1, 3" from x's peers whose data has not all arrived ("" for none). */
static void inspect_waiting(const dopt_rec_entry *x, char *out, size_t cap) {
    size_t used;
    int i, n = 0, k = 0;
    out[0] = '\0';
    for (i = 0; i < x->npeers; i++) n += x->peers[i].pending != 0;
    if (n == 0) return;
    used = (size_t)snprintf(out, cap, "waiting for rank%s ", n > 1 ? "s" : "");
    for (i = 0; i < x->npeers && used + 16 < cap; i++)
        if (x->peers[i].pending) used += (size_t)snprintf(out + used, cap - used, "%s%d", k++ ? ", " : "", x->peers[i].peer);
}

static void inspect_table(const inspect_job *j) {
    double now = inspect_now_s();
    int r;
    printf("rank  pid      process   last collective                                 state\n");
    for (r = 0; r < j->size; r++) {
        const inspect_rank *k = &j->ranks[r];
        const dopt_rec_entry *x;
        char what[128] = "none yet", state[160] = "", wait[128];
        if (!inspect_have(j, r)) {
            printf("%-5d -        -         (no file: this rank ended cleanly, never began, or runs elsewhere)\n", r);
            continue;
        }
        if ((x = inspect_last(k)) != NULL) {
            inspect_what(x, what, sizeof what);
            inspect_waiting(x, wait, sizeof wait);
            if (x->status != 0)
                snprintf(state, sizeof state, "failed: %s", inspect_status(x->status));
            else if (x->end_ns != 0)
                snprintf(state, sizeof state, "done %.1f s ago", now - (double)x->end_ns / 1e9);
            else
                snprintf(state, sizeof state, "in it for %.1f s%s%s", now - (double)x->start_ns / 1e9, wait[0] ? ", " : "",
                         wait);
        }
        printf("%-5d %-8d %-9s %-47s %s\n", r, (int)k->hdr.pid, k->gone ? "gone" : k->stopped ? "STOPPED" : "running",
               what, state);
    }
    for (r = 0; r < j->size; r++)
        if (inspect_have(j, r) && j->ranks[r].hdr.detail[0]) printf("  %s\n", j->ranks[r].hdr.detail);
}

/* The verdict: who everyone waits for, why, and from which collective on. */
typedef struct inspect_verdict {
    int rank;
    uint64_t seq;
    const char *cause; /* skipped, extra, size, different, dead, stopped, behind, waited-for */
    char why[512];
} inspect_verdict;

/* The call that followed one like x in r's history before (what r calls after x), or NULL. */
static const dopt_rec_entry *inspect_followed(const inspect_rank *r, const dopt_rec_entry *x) {
    size_t i;
    for (i = r->n; i > 1; i--) {
        const dopt_rec_entry *a = &r->entries[i - 2], *b = &r->entries[i - 1];
        if (a->seq < x->seq && a->group == x->group && b->group == x->group && b->seq == a->seq + 1 && inspect_same(a, x))
            return b;
    }
    return NULL;
}

/* 1 when r ever called what x is (before x's sequence number). */
static int inspect_called(const inspect_rank *r, const dopt_rec_entry *x) {
    size_t i;
    for (i = 0; i < r->n; i++)
        if (r->entries[i].seq < x->seq && inspect_same(&r->entries[i], x)) return 1;
    return 0;
}

#define INSPECT_VOTERS 64  /* ranks whose calls are compared (the first 64) */
#define INSPECT_RECENT 256 /* entries of each rank searched for a divergence: the newest */

/* What rank r called at (group, seq), into *out: 2 when it did (recorded), 1 when its history
   says what it would call next (its newest entry in the group is seq - 1 and such an entry was
   followed before), 0 when neither. */
static int inspect_call(const inspect_rank *r, uint32_t group, uint64_t seq, dopt_rec_entry *out) {
    const dopt_rec_entry *x = inspect_find(r, group, seq), *prev, *next;
    size_t i;
    if (x) return *out = *x, 2;
    if (seq < 2 || (prev = inspect_find(r, group, seq - 1)) == NULL) return 0;
    for (i = r->n; i > 0; i--) /* prev must be its newest in the group */
        if (r->entries[i - 1].group == group) break;
    if (i == 0 || &r->entries[i - 1] != prev || (next = inspect_followed(r, prev)) == NULL) return 0;
    *out = *next;
    out->seq = seq;
    return 1;
}

/* Names the rank that departs at (group, seq) from what the others called (recorded, or as their
   history predicts for a rank that failed before it got there). 1 with v filled. */
static int inspect_diverge_at(const inspect_job *j, uint32_t group, uint64_t seq, inspect_verdict *v) {
    dopt_rec_entry call[INSPECT_VOTERS], next;
    int how[INSPECT_VOTERS], votes[INSPECT_VOTERS], n = j->size < INSPECT_VOTERS ? j->size : INSPECT_VOTERS;
    int r, q, best = -1, odd = -1, have_next;
    const dopt_rec_entry *its_next;
    char a[128], b[128];
    for (r = 0; r < n; r++) how[r] = inspect_have(j, r) ? inspect_call(&j->ranks[r], group, seq, &call[r]) : 0;
    for (r = 0; r < n; r++)
        for (votes[r] = 0, q = 0; q < n && how[r]; q++) votes[r] += how[q] && inspect_same(&call[r], &call[q]);
    for (r = 0; r < n; r++)
        if (how[r] && (best < 0 || votes[r] > votes[best] || (votes[r] == votes[best] && how[r] > how[best]))) best = r;
    for (r = 0; r < n && best >= 0; r++)
        if (how[r] == 2 && !inspect_same(&call[r], &call[best]) && (odd < 0 || votes[r] < votes[odd])) odd = r;
    if (odd < 0) return 0;
    /* what the majority calls after seq, and what the odd rank called after its own */
    have_next = inspect_call(&j->ranks[best], group, seq + 1, &next) != 0;
    if (!have_next) {
        const dopt_rec_entry *f = inspect_followed(&j->ranks[best], &call[best]);
        if ((have_next = f != NULL)) next = *f;
    }
    its_next = inspect_find(&j->ranks[odd], group, seq + 1);
    inspect_what(&call[best], a, sizeof a);
    inspect_what(&call[odd], b, sizeof b);
    v->rank = odd;
    v->seq = seq;
    if (have_next && inspect_same(&next, &call[odd])) {
        v->cause = "skipped";
        snprintf(v->why, sizeof v->why, "rank %d skipped %s: it called the next one, %s, in its place", odd, a, b);
    } else if (its_next && inspect_same(its_next, &call[best])) {
        v->cause = "extra";
        snprintf(v->why, sizeof v->why, "rank %d called an extra %s before %s", odd, b, a);
    } else if (call[odd].kind == call[best].kind && call[odd].dtype == call[best].dtype && call[odd].op == call[best].op &&
               call[odd].root == call[best].root && call[odd].count != call[best].count) {
        v->cause = "size";
        snprintf(v->why, sizeof v->why, "rank %d called %s where the others called %s: a size mismatch", odd, b, a);
    } else if (call[odd].kind != call[best].kind || !inspect_called(&j->ranks[best], &call[odd])) {
        v->cause = "extra";
        snprintf(v->why, sizeof v->why, "rank %d called an extra %s where the others called %s", odd, b, a);
    } else {
        v->cause = "different";
        snprintf(v->why, sizeof v->why, "rank %d called %s where the others called %s", odd, b, a);
    }
    return 1;
}

/* The first (group, seq), among every rank's newest entries, where a rank called something
   else than the others. 1 when found. */
static int inspect_diverge(const inspect_job *j, inspect_verdict *v) {
    inspect_verdict found;
    int r, any = 0;
    size_t i;
    for (r = 0; r < j->size && r < INSPECT_VOTERS; r++) {
        const inspect_rank *k = &j->ranks[r];
        if (!inspect_have(j, r)) continue;
        for (i = k->n > INSPECT_RECENT ? k->n - INSPECT_RECENT : 0; i < k->n; i++) {
            const dopt_rec_entry *x = &k->entries[i];
            if (any && x->group == 0 && v->seq <= x->seq) break;
            if (inspect_diverge_at(j, x->group, x->seq, &found)) {
                if (!any || found.seq < v->seq) *v = found;
                any = 1;
                break;
            }
        }
    }
    return any;
}

/* A rank whose process is gone while the others have not all ended: the first that died
   without its communicator failing, else the first that exited. */
static int inspect_gone(const inspect_job *j, inspect_verdict *v) {
    int r, pick = -1, live = 0;
    for (r = 0; r < j->size; r++) {
        if (!inspect_have(j, r)) continue;
        if (!j->ranks[r].gone || j->ranks[r].hdr.state == DOPT_REC_FAILED) live++;
        if (j->ranks[r].gone && j->ranks[r].hdr.state == DOPT_REC_RUNNING && pick < 0) pick = r;
    }
    if (pick < 0 || live == 0) return 0;
    {
        const dopt_rec_entry *x = inspect_last(&j->ranks[pick]);
        char what[128] = "none";
        uint64_t stuck = inspect_stuck_seq(j, pick);
        if (x) inspect_what(x, what, sizeof what);
        v->rank = pick;
        v->seq = stuck ? stuck : x ? x->seq : 0;
        v->cause = "dead";
        snprintf(v->why, sizeof v->why, "rank %d died (pid %d is gone without ending its communicator); its last "
                 "collective: %s%s; the others stopped in #%llu", pick, (int)j->ranks[pick].hdr.pid, what,
                 x && x->end_ns == 0 ? " (in flight)" : "", (unsigned long long)v->seq);
    }
    return 1;
}

static int inspect_stopped(const inspect_job *j, inspect_verdict *v) {
    int r;
    for (r = 0; r < j->size; r++) {
        const dopt_rec_entry *x;
        char what[128] = "none";
        if (!inspect_have(j, r) || !j->ranks[r].stopped) continue;
        x = inspect_last(&j->ranks[r]);
        if (x) inspect_what(x, what, sizeof what);
        v->rank = r;
        v->seq = inspect_stuck_seq(j, r);
        if (v->seq == 0 && x) v->seq = x->seq;
        v->cause = "stopped";
        snprintf(v->why, sizeof v->why, "rank %d (pid %d) is stopped (SIGSTOP, ^Z or a debugger: kill -CONT %d); "
                 "its last collective: %s%s", r, (int)j->ranks[r].hdr.pid, (int)j->ranks[r].hdr.pid, what,
                 x && x->end_ns == 0 ? " (in flight)" : "");
        return 1;
    }
    return 0;
}

/* Some ranks are in a collective the laggard has not begun. */
static int inspect_behind(const inspect_job *j, inspect_verdict *v) {
    uint64_t stuck = inspect_stuck_seq(j, -1), low = 0;
    int r, lag = -1;
    if (stuck == 0) return 0;
    for (r = 0; r < j->size; r++) {
        const dopt_rec_entry *x;
        if (!inspect_have(j, r)) continue;
        x = inspect_last(&j->ranks[r]);
        if ((x == NULL || x->seq < stuck) && (lag < 0 || (x ? x->seq : 0) < low)) lag = r, low = x ? x->seq : 0;
    }
    if (lag < 0) return 0;
    v->rank = lag;
    v->seq = stuck;
    v->cause = "behind";
    snprintf(v->why, sizeof v->why, "rank %d has not begun #%llu, which the others are in: its last collective is "
             "#%llu (it is computing, blocked outside distopt, or its host is slow)", lag, (unsigned long long)stuck,
             (unsigned long long)low);
    return 1;
}

/* Everyone is in the same collective: the rank the most others wait for. */
static int inspect_waited_for(const inspect_job *j, inspect_verdict *v) {
    int count[64] = {0}, r, i, best = -1;
    uint64_t seq = 0;
    for (r = 0; r < j->size; r++) {
        const dopt_rec_entry *x;
        if (!inspect_have(j, r) || (x = inspect_last(&j->ranks[r])) == NULL || x->end_ns != 0) continue;
        for (i = 0; i < x->npeers; i++)
            if (x->peers[i].pending && x->peers[i].peer < 64) count[x->peers[i].peer]++, seq = x->seq;
    }
    for (r = 0; r < 64 && r < j->size; r++)
        if (count[r] && (best < 0 || count[r] > count[best])) best = r;
    if (best < 0) return 0;
    v->rank = best;
    v->seq = seq;
    v->cause = "waited-for";
    snprintf(v->why, sizeof v->why, "%d rank%s wait%s for rank %d's data in #%llu", count[best], count[best] > 1 ? "s" : "",
             count[best] > 1 ? "" : "s", best, (unsigned long long)seq);
    return 1;
}

static int inspect_verdict_of(const inspect_job *j, inspect_verdict *v) {
    memset(v, 0, sizeof *v);
    v->rank = -1;
    return inspect_diverge(j, v) || inspect_gone(j, v) || inspect_stopped(j, v) || inspect_behind(j, v) ||
           inspect_waited_for(j, v);
}

/* 1 when every live rank of j began a collective since `before` was read: nobody is stuck. */
static int inspect_moving(const inspect_job *before, const inspect_job *j) {
    int r, live = 0;
    for (r = 0; r < j->size; r++) {
        if (!inspect_have(j, r) || j->ranks[r].gone) continue;
        if (before->size != j->size || !inspect_have(before, r) || j->ranks[r].written <= before->ranks[r].written) return 0;
        live++;
    }
    return live > 0;
}

static void inspect_report(const inspect_job *j, const char *dir, int moving, int interval_ms) {
    inspect_verdict v;
    int r, failed = 0, t = -1;
    for (r = 0; r < j->size && t < 0; r++)
        if (inspect_have(j, r)) t = r;
    printf("job %016llx: %d of %d ranks recorded in %s (%s)\n", (unsigned long long)j->hash, j->found, j->size, dir,
           j->ranks[t].hdr.transport);
    inspect_table(j);
    for (r = 0; r < j->size; r++) failed += inspect_have(j, r) && j->ranks[r].hdr.state == DOPT_REC_FAILED;
    if (moving) {
        printf("no rank is stuck: every live rank began collectives in the last %d ms\n", interval_ms);
        printf("culprit rank=-1 seq=0 cause=none\n");
    } else if (inspect_verdict_of(j, &v)) {
        printf("everyone waits for rank %d: %s\n", v.rank, v.why);
        printf("culprit rank=%d seq=%llu cause=%s\n", v.rank, (unsigned long long)v.seq, v.cause);
    } else {
        printf("no rank waits for another: every rank's newest collective has ended%s\n",
               failed ? " (the job failed: the details above say how)" : "");
        printf("culprit rank=-1 seq=0 cause=none\n");
    }
}

/* ------------------------------------------------------------------------ files */

/* "dopt-rec.<16 hex>.<rank>": 1 with the hash and rank. */
static int inspect_name(const char *name, uint64_t *hash, int *rank) {
    char *end;
    unsigned long long h;
    long r;
    if (strncmp(name, "dopt-rec.", 9) != 0 || strlen(name) < 9 + 16 + 2 || name[9 + 16] != '.') return 0;
    h = strtoull(name + 9, &end, 16);
    if (end != name + 9 + 16) return 0;
    r = strtol(name + 9 + 17, &end, 10);
    if (*end != '\0' || r < 0 || r >= INSPECT_MAX_RANKS || !isdigit((unsigned char)name[9 + 17])) return 0;
    *hash = (uint64_t)h;
    *rank = (int)r;
    return 1;
}

/* Maps and parses one file; 0 when it was read. */
static int inspect_load(const char *path, inspect_rank *out) {
    struct stat st;
    char why[256];
    void *map;
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC), rc;
    if (fd < 0) return fprintf(stderr, "distopt-inspect: %s: %s\n", path, strerror(errno)), -1;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) {
        close(fd);
        return fprintf(stderr, "distopt-inspect: %s: empty or unreadable\n", path), -1;
    }
    map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return fprintf(stderr, "distopt-inspect: %s: %s\n", path, strerror(errno)), -1;
    rc = inspect_parse((const unsigned char *)map, (size_t)st.st_size, 1000, out, why, sizeof why);
    munmap(map, (size_t)st.st_size);
    if (rc != 0) return fprintf(stderr, "distopt-inspect: %s: %s\n", path, why), -1;
    snprintf(out->path, sizeof out->path, "%s", path);
    inspect_process(out);
    return 0;
}

typedef struct inspect_opts {
    const char *dir;
    uint64_t job;
    int have_job, prune;
    int interval_ms; /* between the two reads that tell a job moving on from a stuck one */
} inspect_opts;

/* The jobs whose files are in dir, each once: *hashes (malloc'd), returns how many. */
static int inspect_jobs(const char *dir, uint64_t **hashes) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0, cap = 0, i, rank;
    uint64_t h;
    *hashes = NULL;
    if (d == NULL) return -1;
    while ((e = readdir(d)) != NULL) {
        if (!inspect_name(e->d_name, &h, &rank)) continue;
        for (i = 0; i < n && (*hashes)[i] != h; i++) continue;
        if (i < n) continue;
        if (n == cap) {
            uint64_t *grown = (uint64_t *)realloc(*hashes, sizeof(uint64_t) * (size_t)(cap = cap ? 2 * cap : 8));
            if (grown == NULL) break;
            *hashes = grown;
        }
        (*hashes)[n++] = h;
    }
    closedir(d);
    return n;
}

/* Loads every rank file of job hash in dir; 0 when at least one was read. */
static int inspect_job_load(const char *dir, uint64_t hash, inspect_job *j) {
    DIR *d = opendir(dir);
    struct dirent *e;
    inspect_rank one;
    char path[512];
    uint64_t h;
    int rank;
    memset(j, 0, sizeof *j);
    j->hash = hash;
    if (d == NULL) return -1;
    while ((e = readdir(d)) != NULL) {
        if (!inspect_name(e->d_name, &h, &rank) || h != hash) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (inspect_load(path, &one) != 0) continue;
        if (one.hdr.rank != rank || (j->size && one.hdr.size != j->size)) {
            fprintf(stderr, "distopt-inspect: %s: rank %d of %d does not fit its name or the job (%d ranks)\n", path,
                    one.hdr.rank, one.hdr.size, j->size);
            inspect_rank_free(&one);
            continue;
        }
        if (j->ranks == NULL) {
            j->size = one.hdr.size;
            j->ranks = (inspect_rank *)calloc((size_t)j->size, sizeof(inspect_rank));
            if (j->ranks == NULL) break;
        }
        inspect_rank_free(&j->ranks[rank]);
        j->ranks[rank] = one;
        j->found++;
    }
    closedir(d);
    return j->found > 0 ? 0 : -1;
}

static void inspect_job_free(inspect_job *j) {
    int r;
    for (r = 0; r < j->size; r++) inspect_rank_free(&j->ranks[r]);
    free(j->ranks);
    j->ranks = NULL;
}

/* Removes the files of job j when none of its processes is alive; 1 when it did. */
static int inspect_prune(const inspect_job *j) {
    int r;
    for (r = 0; r < j->size; r++)
        if (inspect_have(j, r) && !j->ranks[r].gone) return 0;
    for (r = 0; r < j->size; r++)
        if (inspect_have(j, r)) {
            if (unlink(j->ranks[r].path) == 0) printf("removed %s\n", j->ranks[r].path);
            else fprintf(stderr, "distopt-inspect: cannot remove %s: %s\n", j->ranks[r].path, strerror(errno));
        }
    return 1;
}

static void usage(FILE *to) {
    fprintf(to,
            "usage: distopt-inspect [--dir DIR] [--job HASH] [--interval MS] [--prune]\n"
            "Reads the flight recorder of every rank of a distopt job on this machine and says which rank\n"
            "everyone waits for: the lagging rank, its last collective, and the sequence number where the\n"
            "ranks diverge (a skipped or extra collective, a size mismatch, a dead or stopped process).\n"
            "Run it while the job hangs, or after it failed (a failed rank keeps its file).\n"
            "  --dir DIR    where the files are: dopt-rec.<job>.<rank> (default: $DOPT_RECORDER_DIR, else\n"
            "               /dev/shm)\n"
            "  --job HASH   only that job (the 16 hex digits of its files' names); default: every job\n"
            "  --interval MS  read the files twice, MS apart (default 300; 0: once): a job whose live\n"
            "               ranks all began collectives in between is moving, not stuck\n"
            "  --prune      remove the files of jobs none of whose processes is alive, and report nothing\n"
            "Output: a table of the ranks, then \"everyone waits for rank R: why\" and a line for scripts,\n"
            "\"culprit rank=R seq=S cause=C\" (C: skipped, extra, size, different, dead, stopped, behind,\n"
            "waited-for; none with rank=-1 when no rank waits). Exit status: 0 when a job was read, 1 when\n"
            "none was found, 2 for a bad argument.\n");
}

static int inspect_args(int argc, char **argv, inspect_opts *o) {
    int i;
    const char *env = getenv("DOPT_RECORDER_DIR");
    memset(o, 0, sizeof *o);
    o->dir = env && *env ? env : "/dev/shm";
    o->interval_ms = 300;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dir") && i + 1 < argc) {
            o->dir = argv[++i];
        } else if (!strcmp(argv[i], "--job") && i + 1 < argc) {
            char *end;
            o->job = strtoull(argv[++i], &end, 16);
            o->have_job = 1;
            if (*end != '\0') return fprintf(stderr, "distopt-inspect: --job %s: not hex digits\n", argv[i]), -1;
        } else if (!strcmp(argv[i], "--interval") && i + 1 < argc) {
            char *end;
            long ms = strtol(argv[++i], &end, 10);
            if (*end != '\0' || ms < 0 || ms > 600000)
                return fprintf(stderr, "distopt-inspect: --interval %s: not milliseconds in 0..600000\n", argv[i]), -1;
            o->interval_ms = (int)ms;
        } else if (!strcmp(argv[i], "--prune")) {
            o->prune = 1;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            exit(0);
        } else {
            fprintf(stderr, "distopt-inspect: unknown argument %s\n", argv[i]);
            return -1;
        }
    }
    return 0;
}

#ifndef DOPT_INSPECT_NO_MAIN
int main(int argc, char **argv) {
    inspect_opts o;
    uint64_t *hashes;
    int n, i, read = 0;
    if (inspect_args(argc, argv, &o) != 0) {
        usage(stderr);
        return 2;
    }
    if ((n = inspect_jobs(o.dir, &hashes)) < 0) {
        fprintf(stderr, "distopt-inspect: cannot read %s: %s\n", o.dir, strerror(errno));
        return 1;
    }
    for (i = 0; i < n; i++) {
        inspect_job j, again;
        int moving = 0;
        if (o.have_job && hashes[i] != o.job) continue;
        if (inspect_job_load(o.dir, hashes[i], &j) != 0) continue;
        read++;
        if (!o.prune && o.interval_ms > 0) {
            usleep((useconds_t)o.interval_ms * 1000u);
            if (inspect_job_load(o.dir, hashes[i], &again) == 0) {
                moving = inspect_moving(&j, &again);
                inspect_job_free(&j);
                j = again;
            }
        }
        if (o.prune) inspect_prune(&j);
        else {
            if (read > 1) printf("\n");
            inspect_report(&j, o.dir, moving, o.interval_ms);
        }
        inspect_job_free(&j);
    }
    free(hashes);
    if (read == 0 && !o.prune) printf("no distopt recorder files%s in %s\n", o.have_job ? " of that job" : "", o.dir);
    return read > 0 || o.prune ? 0 : 1;
}
#endif
