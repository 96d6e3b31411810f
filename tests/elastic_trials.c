/* elastic_trials.c — make elastic-test: local SGD surviving a killed worker, measured.

   Each trial starts 4 processes of build/elastic_sgd over TCP on loopback (DOPT_* variables,
   DOPT_ON_PEER_LOST=shrink), SIGKILLs one of them (any rank, rank 0 included; drawn from a fixed
   seed) at a random moment of the training (150 ms to 1.15 s after the job formed), and waits at most 60 s for the others. A trial
   survives when every survivor exits 0 having converged, with the same model (its hash) as the
   other survivors, after one shrink or more. The time to recover is from the kill to the moment
   the last survivor trained again (its resumed_ms). Then one trial with DOPT_MIN_RANKS=4: every
   survivor must end with an error naming min_ranks, none may hang. Rank r > 0 listens on the
   port rank 0 listens on plus r (DOPT_LISTEN_PORT). In the least-squares trials the killed
   worker, rank 0 included, is started again 200 ms after the kill with DOPT_JOIN=1 and
   DOPT_JOIN_PEERS naming the other ranks' ports (rank 0's address is tried first: when rank 0
   was the one killed, nobody listens there): it is taken back when every member took it in
   (grows >= 1) and it ends with their model. Then 5 trials that kill the member sending the
   state: a worker other than rank 0 is killed and started again as above, and rank 0 is killed
   the moment it says it took the joiner in (its log's "takes in", before the state is sent):
   the trial survives when the two other members and the joiner end with the same model, the
   joiner having taken the state from another member. On the cluster, 5 more trials cut a random
   worker's host off (its link down, then its rank killed: no FIN, no RST reaches anyone) with
   DOPT_DEAD_AFTER_MS=1000 on every worker: the survivors' heartbeat gives up on it, they shrink
   and train on; the time to recover is from the cut (no restart in these). Prints per trial a
   line and, last:
       elastic transport=tcp trials=N survived=S rejoined=J hangs=H max_recover_ms=M
       state_MBps=X link_MBps=0 min_ranks_ok=1 links=... restarted=R state_bytes=B
       sender_trials=5 sender_killed=K sender_survived=V silent_trials=5|0 silent_survived=W
       silent_max_recover_ms=Z
   (on loopback, state_MBps and link_MBps are bench_rejoin's, run after the trials: a joiner
   taking a 32 MB model, and a raw TCP stream of the same bytes; B is then its state's bytes.
   On the cluster, or without build/bench_rejoin, state_MBps is the median over the trials of
   the joiner's transfer of a 16-float model, a latency more than a rate, and link_MBps 0).
   Exits 1 when a trial did not survive or hung, a worker started again was not taken back, or a
   sender trial did not kill rank 0 or did not survive it.
   Usage: elastic_trials [BUILD_DIR] [TRIALS] [ADDRS|-|shm] [mlp]: with shm, the workers run over
   shared memory (DOPT_TRANSPORT=shm, a job name of their own; a worker started again asks through
   the job's join box, DOPT_JOIN=1 with the same DOPT_SHM_NAME), state_MBps and link_MBps are
   bench_rejoin 32 shm's (the link: the shm transport's own broadcast), and the line says
   transport=shm links=shm. With
   ADDRS, rank r runs on the
   simulated cluster's host r (scripts/cluster.sh exec r; the cluster must be up with 4 hosts,
   ADDRS the hosts' addresses "a0,a1,a2,a3", or host 0's alone, when a killed rank 0 is not
   started again: tests/elastic_cluster.sh gives all four) and the line says links=cluster, else
   links=loopback ("-": loopback).
   With mlp, the program is build/fmnist_mlp --elastic on (Fashion-MNIST, local SGD period 4, 4
   epochs, about 4.5 s on loopback): first a run nobody disturbs, then the trials, the kill 50 ms
   to 50 ms + 0.7 x the undisturbed run's time after rank 0 said the job formed (within the
   training: the closing average, dopt_dp_close, is not elastic). A trial survives when every
   survivor exits 0 (dopt_dp_close checked that the replicas are identical) and the final test
   accuracy is within 3 points of the undisturbed run's (it trained on); the goal, within 0.5
   point, is counted, not required: where the kill falls moves the accuracy (the survivors start
   the epoch over on their new shards), once by 1.7 points. The line then says model=mlp and adds
   acc_undisturbed, acc_min, acc_max, max_drop (points) and within_half_point (trials). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WORKERS 4
#define TRIAL_LIMIT_MS 60000
#define SENDER_TRIALS 5 /* after the others: a worker killed and started again, then rank 0 killed as it
                           begins to send it the job's state */
#define SILENT_TRIALS 5 /* on the cluster, last: a host cut off, then its rank killed (no FIN, no RST) */
#define SILENT_DEAD_AFTER_MS "1000" /* the heartbeat those trials run with (DOPT_DEAD_AFTER_MS) */

static uint64_t next_random(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* 1 when nothing listens on port here (a bind to loopback succeeds). */
static int port_free(int port) {
    struct sockaddr_in sa;
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1, ok;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0) return 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    ok = bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    return ok;
}

/* The ports of a job: rank 0's, then rank r's at + r, a restarted rank 0's at + WORKERS. Below
   the kernel's ephemeral range (32768 and up here), so that no outgoing connection, nor one in
   TIME_WAIT, holds one on a cluster host where the harness cannot look; a fresh block per job. */
static int job_ports(void) {
    static int next;
    int tries;
    for (tries = 0; tries < 1500; tries++) {
        int base = 20000 + (next++ * 8) % 12000, k, ok = 1;
        for (k = 0; k <= WORKERS && ok; k++) ok = port_free(base + k);
        if (ok) return base;
    }
    return 0;
}

#define SLOTS (WORKERS + 1) /* the workers, and the killed one started again (slot WORKERS) */

typedef struct outcome {
    int exited[SLOTS], status[SLOTS];
    char line[SLOTS][512];
    char acc_line[SLOTS][512]; /* mlp: the last evaluation's line */
    int final[SLOTS];           /* mlp: printed the replicas' hash (rank 0 at the end) */
    double resumed[SLOTS];      /* mlp: when it went on after a lost worker (monotonic ms), 0: never */
    double run_ms;              /* from the job formed to the last rank's exit */
    char err[SLOTS][512];
    int hung;
    int restarted;              /* the killed worker was started again (slot WORKERS) */
    int sender_killed;          /* rank 0 was killed as it began to send the joiner the job's state */
} outcome;

static const char *cluster_master; /* NULL: every rank on loopback */
static char host_addr[WORKERS][64]; /* where rank r runs; "": not known (a killed rank 0 stays dead) */
static int mlp;                    /* 1: build/fmnist_mlp, else build/elastic_sgd */
static int silent_cut;             /* the trial cuts the victim's host off before the kill */
static int shm;                    /* 1: over shared memory (DOPT_TRANSPORT=shm) */

static double mono_ms(void) { /* fmnist_mlp's clock */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Every rank said that the job formed (the TCP transport's "tcp rank R of 4: rendezvous at ...",
   shm's "shm rank R of 4: job ..." on its stderr): a kill before that would be a rank lost during the rendezvous, which waits for
   it to come back (transport_tcp.h: STARTING UP), not what these trials measure. */
static int job_formed(const char *dir) {
    int r;
    if (mlp) { /* rank 0's first line comes after the rendezvous and the first broadcast */
        char path[600], line[512];
        int seen = 0;
        FILE *f;
        snprintf(path, sizeof path, "%s/rank0.log", dir);
        if ((f = fopen(path, "r")) == NULL) return 0;
        while (!seen && fgets(line, sizeof line, f)) seen = strstr(line, shm ? "fmnist_mlp: shm" : "fmnist_mlp: tcp") != NULL;
        fclose(f);
        return seen;
    }
    for (r = 0; r < WORKERS; r++) {
        char path[600], line[512];
        int seen = 0;
        FILE *f;
        snprintf(path, sizeof path, "%s/rank%d.err", dir, r);
        if ((f = fopen(path, "r")) == NULL) return 0;
        while (!seen && fgets(line, sizeof line, f)) seen = strstr(line, shm ? ": job '" : "rendezvous at") != NULL;
        fclose(f);
        if (!seen) return 0;
    }
    return 1;
}

/* Starts worker r (slot r; slot WORKERS: the killed worker again, with DOPT_JOIN=1) of the job at
   port, its stdout and stderr in dir's rank<slot>.log and .err. */
static pid_t spawn_worker(const char *exe, const char *dir, int slot, int r, int port, int min_ranks) {
    pid_t pid = fork();
    if (pid == 0) {
        char v[32], path[600], err[600];
        snprintf(path, sizeof path, "%s/rank%d.log", dir, slot);
        snprintf(err, sizeof err, "%s/rank%d.err", dir, slot);
        if (!freopen(path, "w", stdout) || !freopen(err, "w", stderr)) _exit(3);
        snprintf(v, sizeof v, "%d", r);
        setenv("DOPT_RANK", v, 1);
        setenv("DOPT_WORLD_SIZE", "4", 1);
        snprintf(v, sizeof v, "%d", port);
        setenv("DOPT_MASTER_PORT", v, 1);
        setenv("DOPT_MASTER_ADDR", cluster_master ? cluster_master : "127.0.0.1", 1);
        setenv("DOPT_TOKEN", "elastic-trials", 1);
        setenv("DOPT_ON_PEER_LOST", "shrink", 1);
        snprintf(v, sizeof v, "%d", min_ranks);
        setenv("DOPT_MIN_RANKS", v, 1);
        setenv("DOPT_TRANSPORT", shm ? "shm" : "tcp", 1);
        if (shm) { /* a job's name: this harness's pid and the job's ports, which no other job holds */
            snprintf(path, sizeof path, "elastic-trials-%d-%d", (int)getppid(), port);
            setenv("DOPT_SHM_NAME", path, 1);
        }
        setenv("OPENBLAS_NUM_THREADS", "1", 1);
        if (silent_cut) setenv("DOPT_DEAD_AFTER_MS", SILENT_DEAD_AFTER_MS, 1);
        if (slot > 0) { /* rank r > 0 at rank 0's port + r; a restarted rank 0 at + WORKERS */
            snprintf(v, sizeof v, "%d", port + (r > 0 ? r : WORKERS));
            setenv("DOPT_LISTEN_PORT", v, 1);
        }
        if (slot == WORKERS) { /* the members to ask after rank 0: every other rank > 0 */
            char peers[4 * 80] = "";
            int q;
            for (q = 1; q < WORKERS; q++)
                if (q != r)
                    snprintf(peers + strlen(peers), sizeof peers - strlen(peers), "%s%s:%d", peers[0] ? "," : "",
                             host_addr[q], port + q);
            setenv("DOPT_JOIN_PEERS", peers, 1);
            setenv("DOPT_JOIN", "1", 1);
            setenv("DOPT_RENDEZVOUS_TIMEOUT_MS", "20000", 1); /* the job may end before a round takes it */
        }
        {
            static char *const sgd_args[] = {"--step-us", "200", NULL};
            static char *const mlp_args[] = {"--epochs", "4", "--period", "4", "--elastic", "on", "--evals-per-epoch", "1", NULL};
            char *const *args = mlp ? mlp_args : sgd_args;
            char *argv_[16], host[16];
            int k = 0, j;
            snprintf(host, sizeof host, "%d", r);
            if (cluster_master) { /* cluster.sh exec becomes `ip netns exec`, which becomes exe: one pid */
                argv_[k++] = (char *)"scripts/cluster.sh";
                argv_[k++] = (char *)"exec";
                argv_[k++] = host;
            }
            argv_[k++] = (char *)exe;
            for (j = 0; args[j]; j++) argv_[k++] = args[j];
            argv_[k] = NULL;
            execv(argv_[0], argv_);
        }
        _exit(4);
    }
    return pid;
}

/* Rank r's stderr (or, says_log, its stdout) holds words. */
static int says_in(const char *dir, int r, const char *ext, const char *words) {
    char path[600], line[512];
    int seen = 0;
    FILE *f;
    snprintf(path, sizeof path, "%s/rank%d.%s", dir, r, ext);
    if ((f = fopen(path, "r")) == NULL) return 0;
    while (!seen && fgets(line, sizeof line, f)) seen = strstr(line, words) != NULL;
    fclose(f);
    return seen;
}
static int says(const char *dir, int r, const char *words) { return says_in(dir, r, "err", words); }
static int says_log(const char *dir, int r, const char *words) { return says_in(dir, r, "log", words); }

/* The cluster's host r's link up or down (scripts/cluster.sh's namespaces). */
static void host_link(int r, const char *updown) {
    char cmd[256];
    const char *cluster = getenv("DOPT_CLUSTER");
    snprintf(cmd, sizeof cmd, "ip -n %s-h%d link set eth0 %s", cluster ? cluster : "dopt", r, updown);
    if (system(cmd) != 0) fprintf(stderr, "elastic_trials: %s failed\n", cmd);
}

/* rejoin: the killed worker is started again REJOIN_AFTER_MS after the kill, as a joiner (rank 0
   only when the other hosts' addresses are known). */
#define REJOIN_AFTER_MS 200

static void run_job(const char *build, const char *dir, int victim, int delay_ms, int min_ranks, int rejoin,
                    int kill_sender, double *kill_ms, outcome *out) {
    pid_t pids[SLOTS] = {0};
    int r, port = job_ports(), left = WORKERS;
    double start = wall_ms(), formed = 0, killed_at = 0;
    char exe[512];
    memset(out, 0, sizeof *out);
    {
        char path[600];
        snprintf(path, sizeof path, "%s/rank%d.log", dir, WORKERS); /* no earlier trial's joiner */
        unlink(path);
        snprintf(path, sizeof path, "%s/rank%d.err", dir, WORKERS);
        unlink(path);
    }
    snprintf(exe, sizeof exe, "%s/%s", build, mlp ? "fmnist_mlp" : "elastic_sgd");
    fflush(stdout);
    for (r = 0; r < WORKERS; r++) pids[r] = spawn_worker(exe, dir, r, r, port, min_ranks);
    *kill_ms = 0;
    while (left > 0) {
        int status;
        pid_t p = waitpid(-1, &status, WNOHANG);
        double now = wall_ms();
        if (formed == 0 && job_formed(dir)) formed = now; /* the kill comes after the rendezvous */
        if (victim >= 0 && *kill_ms == 0 && formed > 0 && now - formed >= delay_ms && pids[victim] > 0) {
            if (silent_cut) host_link(victim, "down"); /* nothing leaves its host, not even its death */
            kill(pids[victim], SIGKILL);
            *kill_ms = mlp ? mono_ms() : wall_ms();
            killed_at = now;
        }
        if (rejoin && (victim > 0 || host_addr[1][0]) && killed_at > 0 && !out->restarted && now - killed_at >= REJOIN_AFTER_MS) {
            pids[WORKERS] = spawn_worker(exe, dir, WORKERS, victim, port, min_ranks);
            out->restarted = 1;
            left++;
        }
        if (kill_sender && out->restarted && !out->sender_killed && pids[0] > 0 && says(dir, 0, "takes in")) {
            kill(pids[0], SIGKILL); /* it took the joiner in and begins to send it the job's state */
            out->sender_killed = 1;
        }
        if (p > 0) {
            for (r = 0; r < SLOTS; r++)
                if (pids[r] == p) {
                    pids[r] = 0;
                    out->exited[r] = 1;
                    out->status[r] = status;
                    left--;
                }
            if (left == 0 && formed > 0) out->run_ms = now - formed;
            continue;
        }
        if (now - start > TRIAL_LIMIT_MS) {
            out->hung = 1;
            for (r = 0; r < SLOTS; r++)
                if (pids[r] > 0) {
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0);
                }
            break;
        }
        usleep(1000);
    }
    if (silent_cut && killed_at > 0) host_link(victim, "up");
    for (r = 0; r < SLOTS; r++) {
        char path[600];
        FILE *f;
        snprintf(path, sizeof path, "%s/rank%d.log", dir, r);
        out->line[r][0] = out->acc_line[r][0] = '\0';
        out->final[r] = 0;
        out->resumed[r] = 0;
        if ((f = fopen(path, "r")) != NULL) {
            char line[512];
            if (!mlp && !fgets(out->line[r], sizeof out->line[r], f)) out->line[r][0] = '\0';
            while (mlp && fgets(line, sizeof line, f)) { /* the last evaluation; who printed the replicas' hash */
                const char *c = strstr(line, "monotonic clock ");
                if (strchr(line, '%') && strstr(line, "target") == NULL) snprintf(out->acc_line[r], sizeof out->acc_line[r], "%s", line);
                if (strncmp(line, "params fnv1a", 12) == 0) out->final[r] = 1;
                if (c && strstr(line, "lost a worker")) out->resumed[r] = atof(c + 16); /* not "came back" */
                snprintf(out->line[r], sizeof out->line[r], "%s", line);
            }
            fclose(f);
        }
        out->line[r][strcspn(out->line[r], "\n")] = '\0';
        snprintf(path, sizeof path, "%s/rank%d.err", dir, r); /* the last thing it said on stderr */
        out->err[r][0] = '\0';
        if ((f = fopen(path, "r")) != NULL) {
            char line[512];
            while (fgets(line, sizeof line, f)) snprintf(out->err[r], sizeof out->err[r], "%s", line);
            fclose(f);
        }
        out->err[r][strcspn(out->err[r], "\n")] = '\0';
    }
}

/* The ranks' logs and the directory they are in. */
/* The workers' flight-recorder files (a killed worker leaves its own) go to a directory of the
   harness's own, removed at the end, unless the caller set DOPT_RECORDER_DIR. */
static char rec_dir[600];

static void remove_scratch(const char *dir) {
    int r;
    if (rec_dir[0]) {
        DIR *d = opendir(rec_dir);
        struct dirent *e;
        while (d && (e = readdir(d)) != NULL) {
            char path[900];
            if (e->d_name[0] == '.') continue;
            snprintf(path, sizeof path, "%s/%s", rec_dir, e->d_name);
            unlink(path);
        }
        if (d) closedir(d);
        rmdir(rec_dir);
    }
    for (r = 0; r < SLOTS; r++) {
        char path[600];
        snprintf(path, sizeof path, "%s/rank%d.log", dir, r);
        unlink(path);
        snprintf(path, sizeof path, "%s/rank%d.err", dir, r);
        unlink(path);
    }
    rmdir(dir);
}

/* mlp: the final test accuracy the job printed (its last rank 0's last evaluation), or -1. */
static double mlp_accuracy(const outcome *out, int victim) {
    int r;
    for (r = 0; r < WORKERS; r++) {
        double epoch, loss, acc;
        if (r == victim || !out->final[r]) continue;
        if (sscanf(out->acc_line[r], "%lf %lf %lf%%", &epoch, &loss, &acc) == 3) return acc;
    }
    return -1;
}

static int mlp_trials(const char *build, const char *dir, int trials) {
    uint64_t rng = 20261206;
    int t, r, survived = 0, hangs = 0, span, within = 0, restarted = 0, rejoined = 0;
    double base, lo = 100, hi = 0, max_recover = 0, kill_ms;
    outcome out;
    run_job(build, dir, -1, 0, 0, 0, 0, &kill_ms, &out);
    base = mlp_accuracy(&out, -1);
    span = (int)(0.7 * out.run_ms); /* kills within the training, not during the closing average */
    printf("undisturbed: test accuracy %.2f%%, %.0f ms from the job formed to its end\n", base, out.run_ms);
    if (out.hung || base < 0 || span < 100) {
        for (r = 0; r < WORKERS; r++) printf("  rank %d: %s | stderr: %s\n", r, out.line[r], out.err[r]);
        return 1;
    }
    for (t = 0; t < trials; t++) {
        int victim = (int)(next_random(&rng) % WORKERS), delay = 50 + (int)(next_random(&rng) % (uint64_t)span), ok;
        double acc, resumed = 0;
        int came_back;
        /* started again when killed in the first half: a worker loads the data before it asks */
        run_job(build, dir, victim, delay, 0, delay < span / 2, 0, &kill_ms, &out);
        hangs += out.hung;
        ok = !out.hung && kill_ms > 0;
        for (r = 0; r < WORKERS && ok; r++) {
            if (r == victim) continue;
            if (!out.exited[r] || !WIFEXITED(out.status[r]) || WEXITSTATUS(out.status[r]) != 0) ok = 0;
            if (out.resumed[r] > resumed) resumed = out.resumed[r];
        }
        acc = mlp_accuracy(&out, victim);
        ok = ok && acc >= 0 && resumed > 0 && acc >= base - 3.0; /* it trained on; the 0.5 goal is counted */
        came_back = out.restarted && out.exited[WORKERS] && WIFEXITED(out.status[WORKERS]) &&
                    WEXITSTATUS(out.status[WORKERS]) == 0 &&
                    says_log(dir, WORKERS, "taken back as rank"); /* and dopt_dp_close found 4 identical replicas */
        restarted += out.restarted;
        rejoined += came_back;
        if (ok) {
            survived++;
            within += acc >= base - 0.5;
            if (acc < lo) lo = acc;
            if (acc > hi) hi = acc;
            if (resumed - kill_ms > max_recover) max_recover = resumed - kill_ms;
        }
        printf("trial %d: killed rank %d %d ms after the job formed: %s, test accuracy %.2f%%, training again %.0f ms "
               "after the kill%s\n",
               t, victim, delay, out.hung ? "HUNG" : ok ? "survivors went on" : "FAILED", acc,
               resumed > 0 ? resumed - kill_ms : 0.0,
               !out.restarted ? "" : came_back ? "; started again, taken back, the 4 replicas identical at the close"
                                               : "; started again, NOT taken back");
        if (!ok || (out.restarted && !came_back))
            for (r = 0; r < SLOTS; r++)
                printf("  %s %d: %s | stderr: %s\n", r < WORKERS ? "rank" : "joiner", r < WORKERS ? r : victim,
                       out.line[r][0] ? out.line[r] : "(nothing)", out.err[r]);
    }
    printf("elastic transport=%s model=mlp trials=%d survived=%d rejoined=%d hangs=%d max_recover_ms=%.0f state_MBps=0 "
           "link_MBps=0 acc_undisturbed=%.2f acc_min=%.2f acc_max=%.2f max_drop=%.2f within_half_point=%d links=%s "
           "restarted=%d\n",
           shm ? "shm" : "tcp", trials, survived, rejoined, hangs, max_recover, base, lo, hi, base - lo, within,
           cluster_master ? "cluster" : shm ? "shm" : "loopback", restarted);
    return survived == trials && hangs == 0 && rejoined == restarted ? 0 : 1;
}

int main(int argc, char **argv) {
    const char *build = argc > 1 ? argv[1] : "build";
    int trials = argc > 2 ? atoi(argv[2]) : 20, t, r, survived = 0, hangs = 0, min_ranks_ok = 1;
    double max_recover = 0, rates[256], state_MBps = 0, link_MBps = 0;
    int nrates = 0, restarted = 0, rejoined = 0, sender_killed = 0, sender_survived = 0, silent_survived = 0;
    double silent_recover = 0;
    int sender_trials, silent_trials;
    size_t state_bytes = 0;
    uint64_t rng = 20261128;
    char dir[] = "/tmp/distopt-elastic-XXXXXX";
    outcome out;
    shm = argc > 3 && strcmp(argv[3], "shm") == 0;
    cluster_master = argc > 3 && strcmp(argv[3], "-") && !shm ? argv[3] : NULL;
    for (r = 0; r < WORKERS; r++) snprintf(host_addr[r], sizeof host_addr[r], "%s", cluster_master ? "" : "127.0.0.1");
    if (cluster_master) { /* "a0,a1,a2,a3", or a0 alone */
        static char first[64];
        const char *p = cluster_master;
        for (r = 0; r < WORKERS && *p; r++) {
            size_t k = strcspn(p, ",");
            snprintf(host_addr[r], sizeof host_addr[r], "%.*s", (int)(k < 63 ? k : 63), p);
            p += k + (p[k] == ',');
        }
        if (r < WORKERS)
            for (r = 1; r < WORKERS; r++) host_addr[r][0] = '\0';
        snprintf(first, sizeof first, "%s", host_addr[0]);
        cluster_master = first;
    }
    mlp = argc > 4 && strcmp(argv[4], "mlp") == 0;
    sender_trials = SENDER_TRIALS;
    silent_trials = cluster_master ? SILENT_TRIALS : 0;
    if (!mkdtemp(dir)) {
        perror("elastic_trials: mkdtemp");
        return 1;
    }
    if (!getenv("DOPT_RECORDER_DIR")) {
        snprintf(rec_dir, sizeof rec_dir, "%s/recorder", dir);
        if (mkdir(rec_dir, 0700) == 0) setenv("DOPT_RECORDER_DIR", rec_dir, 1);
        else rec_dir[0] = '\0';
    }
    if (mlp) {
        int status = mlp_trials(build, dir, trials);
        remove_scratch(dir);
        return status;
    }
    for (t = 0; t < trials + sender_trials + silent_trials; t++) {
        int sender = t >= trials && t < trials + sender_trials; /* then rank 0 is killed too, as it sends the joiner the state */
        int silent = t >= trials + sender_trials;
        int victim = sender ? 1 + (int)(next_random(&rng) % (WORKERS - 1)) : (int)(next_random(&rng) % WORKERS);
        int delay = 150 + (int)(next_random(&rng) % 1000), ok = 1;
        int came_back = 1;
        unsigned long long model = 0;
        double kill_ms, resumed = 0;
        silent_cut = silent;
        run_job(build, dir, victim, delay, 0, !silent, sender, &kill_ms, &out);
        silent_cut = 0;
        hangs += out.hung;
        ok = !out.hung;
        for (r = 0; r < WORKERS && ok; r++) {
            unsigned long long m;
            int shrinks, grows, joined;
            double res;
            const char *p = strstr(out.line[r], "model ");
            if (r == victim || (r == 0 && out.sender_killed)) continue;
            if (!out.exited[r] || !WIFEXITED(out.status[r]) || WEXITSTATUS(out.status[r]) != 0 || p == NULL ||
                sscanf(p, "model %llx, shrinks %d, resumed_ms %lf, grows %d, joined %d", &m, &shrinks, &res, &grows,
                       &joined) != 5 || shrinks < 1 || (model && m != model)) {
                ok = 0;
                break;
            }
            model = m;
            came_back = came_back && grows > 0; /* every member took it in */
            if (res > resumed) resumed = res;
        }
        if (out.restarted && ok) { /* the worker started again: taken back with the job's model */
            unsigned long long m;
            int shrinks, grows, joined;
            double res, ms;
            size_t bytes;
            const char *p = strstr(out.line[WORKERS], "model ");
            came_back = came_back && out.exited[WORKERS] && WIFEXITED(out.status[WORKERS]) &&
                        WEXITSTATUS(out.status[WORKERS]) == 0 && p &&
                        sscanf(p, "model %llx, shrinks %d, resumed_ms %lf, grows %d, joined %d, state_bytes %zu, state_ms %lf",
                               &m, &shrinks, &res, &grows, &joined, &bytes, &ms) == 7 &&
                        joined == 1 && m == model;
            if (came_back && ms > 0 && nrates < (int)(sizeof rates / sizeof rates[0])) {
                rates[nrates++] = bytes / ms / 1e3;
                state_bytes = bytes;
            }
        } else {
            came_back = 0;
        }
        if (silent) {
            silent_survived += ok;
            if (ok && resumed - kill_ms > silent_recover) silent_recover = resumed - kill_ms;
        } else if (sender) {
            sender_killed += out.sender_killed;
            sender_survived += out.sender_killed && ok && came_back;
        } else {
            restarted += out.restarted;
            rejoined += came_back;
            if (ok) survived++;
            if (ok && resumed - kill_ms > max_recover) max_recover = resumed - kill_ms;
        }
        printf("trial %d: %s rank %d %d ms after the job formed: %s, training again %.0f ms after the kill%s%s\n", t,
               silent ? "cut off the host of, then killed," : "killed", victim, delay, out.hung ? "HUNG" : ok ? "survivors identical and converged" : "FAILED",
               ok ? resumed - kill_ms : 0.0,
               !out.restarted ? "" : came_back ? "; started again, taken back, ended with the same model"
                                               : "; started again, NOT taken back",
               !sender ? "" : out.sender_killed ? "; rank 0 killed as it began to send the state"
                                                : "; rank 0 NOT killed (it never took the joiner in)");
        if (!ok || (out.restarted && !came_back) || (sender && !out.sender_killed))
            for (r = 0; r < SLOTS; r++)
                printf("  %s %d: %s | stderr: %s\n", r < WORKERS ? "rank" : "joiner", r < WORKERS ? r : victim,
                       out.line[r][0] ? out.line[r] : "(nothing)", out.err[r]);
    }
    { /* fewer survivors than min_ranks: every survivor ends with the reason, nobody hangs */
        double kill_ms;
        run_job(build, dir, 1, 400, 4, 0, 0, &kill_ms, &out);
        hangs += out.hung;
        for (r = 0; r < WORKERS; r++) {
            if (r == 1) continue;
            if (out.hung || !out.exited[r] || !WIFEXITED(out.status[r]) || WEXITSTATUS(out.status[r]) != 1 ||
                strstr(out.line[r], "min_ranks 4") == NULL)
                min_ranks_ok = 0;
        }
        printf("below min_ranks: %s\n", min_ranks_ok ? "every survivor ended with the reason" : "FAILED");
        if (!min_ranks_ok)
            for (r = 0; r < WORKERS; r++) printf("  rank %d: %s\n", r, out.line[r][0] ? out.line[r] : "(nothing)");
    }
    remove_scratch(dir);
    if (nrates) { /* the median */
        int a, b;
        for (a = 1; a < nrates; a++)
            for (b = a; b > 0 && rates[b - 1] > rates[b]; b--) {
                double x = rates[b];
                rates[b] = rates[b - 1];
                rates[b - 1] = x;
            }
        state_MBps = rates[nrates / 2];
    }
    if (!cluster_master) { /* the rate with a model worth timing, against the link: bench_rejoin */
        char cmd[600], line[512];
        FILE *p;
        double st = 0, lk = 0, mb = 0;
        snprintf(cmd, sizeof cmd, "%s/bench_rejoin 32%s", build, shm ? " shm" : "");
        if ((p = popen(cmd, "r")) != NULL) {
            while (fgets(line, sizeof line, p)) {
                const char *b = strstr(line, "bench rejoin ");
                if (b && sscanf(b, "bench rejoin state_MB=%lf state_MBps=%lf link_MBps=%lf", &mb, &st, &lk) == 3) {
                    state_MBps = st;
                    link_MBps = lk;
                    state_bytes = (size_t)(mb * 1e6);
                    printf("%s", line);
                }
            }
            pclose(p);
        }
    }
    printf("elastic transport=%s trials=%d survived=%d rejoined=%d hangs=%d max_recover_ms=%.0f state_MBps=%.1f "
           "link_MBps=%.0f min_ranks_ok=%d links=%s restarted=%d state_bytes=%zu sender_trials=%d sender_killed=%d "
           "sender_survived=%d silent_trials=%d silent_survived=%d silent_max_recover_ms=%.0f\n",
           shm ? "shm" : "tcp", trials, survived, rejoined, hangs, max_recover, state_MBps, link_MBps, min_ranks_ok,
           cluster_master ? "cluster" : shm ? "shm" : "loopback", restarted, state_bytes, sender_trials, sender_killed,
           sender_survived, silent_trials, silent_survived, silent_recover);
    return survived == trials && hangs == 0 && min_ranks_ok && rejoined == restarted &&
                   sender_killed == sender_trials && sender_survived == sender_killed &&
                   silent_survived == silent_trials
               ? 0
               : 1;
}
