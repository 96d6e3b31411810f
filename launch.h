/* launch.h — start a job the way clusters start jobs: one call reads who this process is from
   the launcher's variables (mpirun, srun, torchrun, or DOPT_*), picks the transport and returns
   the communicator. Part of distopt 0.1.0. MIT licence (see the end of distopt.h).

   DO THIS in exactly one C or C++ file of your program: include the transports the program may
   run on, then this header, all after the implementation macro:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "transport_shm.h"     (any of the three; transport_mpi.h needs mpicc)
       #include "transport_tcp.h"
       #include "launch.h"

   The call can start exactly the transports included before this header in that file.

   QUICK START

       dopt_comm *comm;
       if (dopt_comm_create_from_env(&comm) != DOPT_OK) return 1;   (the reason is on stderr)
       ... train, with comm->rank of comm->size (localsgd.h's driver: dopt_dp_init(&dp, comm, ...)) ...
       return dopt_comm_finish(comm, dopt_dp_close(&dp, params));
                         (forked ranks exit here; rank 0 gets the job's status; a failure was
                          printed to stderr when it happened)

   and start it any of these ways:

       ./train                                              a world of one (self)
       DOPT_WORLD_SIZE=4 ./train                            4 ranks forked on this host (shm)
       mpirun -n 8 ./train                                  MPI if the program has it, else see below
       DOPT_TRANSPORT=tcp mpirun -n 8 -x DOPT_TRANSPORT -x DOPT_MASTER_ADDR=node1 ./train
       srun -n 8 ./train                                    TCP; rank 0 on the step's first node
       torchrun --nnodes 2 --nproc-per-node 4 ... ./train   TCP at MASTER_ADDR:MASTER_PORT + 1
       torchrun --standalone --nproc-per-node 4 ./train     shm (every rank on this host)
       DOPT_LOG_LEVEL=info DOPT_WORLD_SIZE=4 ./train        says what it chose and how each rank
                                                            started (ENVIRONMENT below)
       DOPT_RANK=0 DOPT_WORLD_SIZE=2 DOPT_MASTER_ADDR=10.0.0.1 DOPT_MASTER_PORT=29500 ./train

   WHO THIS PROCESS IS
     distopt.h's dopt_launch_read (see LAUNCH VARIABLES there) reads rank, world size, local rank
     and size, and the meeting point, from DOPT_*, then Open MPI's or PMI's variables, then
     Slurm's, then torchrun's. Conflicting or incomplete settings are DOPT_ERR_INVALID with a line
     naming the variables, before anything waits.

   WHICH TRANSPORT
     cfg->transport, else DOPT_TRANSPORT (shm, tcp, mpi, self), else:
     1. started by mpirun or another PMI launcher, and transport_mpi.h is included: mpi;
     2. no launcher and no rank: a world of cfg->world_size, else DOPT_WORLD_SIZE, else 1 —
        self for one rank, else that many ranks forked on this host by transport_shm.h;
     3. a world of one: self;
     4. every rank on this host (the launcher's local size is the world size), shm included,
        and a job name known (DOPT_SHM_NAME, else the launcher's: Slurm's job and step, Open
        MPI's job id, PMI's KVS name, torchrun's MASTER_ADDR and MASTER_PORT): shm — so
        torchrun's workers on one host (LOCAL_WORLD_SIZE = WORLD_SIZE) meet in shared memory;
     5. tcp when included, else shm when every rank is on this host, else DOPT_ERR_INVALID
        naming what the program would need.
     DOPT_TRANSPORT=shm without a rank forks too; with a rank it joins by name. A transport this
     program was not built with is DOPT_ERR_INVALID naming the header to include.

   CONFIGURATION (dopt_launch_config; NULL or all zero means the defaults)

   | field       | meaning                                                          | zero means        |
   |-------------|------------------------------------------------------------------|-------------------|
   | transport   | "shm", "tcp", "mpi", "self"; wins over DOPT_TRANSPORT            | DOPT_TRANSPORT,   |
   |             |                                                                  | else chosen above |
   | world_size  | the ranks to fork when no launcher started this process; a       | DOPT_WORLD_SIZE,  |
   |             | launcher that started another number is DOPT_ERR_INVALID         | else 1            |
   | log_fn,     | told why a start failed and, installed on the communicator,      | the default       |
   | log_user    | everything after (as each transport's log_fn), every level       | logger: stderr,   |
   |             |                                                                  | DOPT_LOG_LEVEL's  |
   |             |                                                                  | lines (below)     |

   ENVIRONMENT (read during dopt_launch_create, by it or the ..._config_from_env it calls; never
   by a config. Rank, world size and rank 0's address: distopt.h's LAUNCH VARIABLES)

   | variable                | meaning                                             | unset or empty    |
   |-------------------------|-----------------------------------------------------|-------------------|
   | DOPT_TRANSPORT          | shm, tcp, mpi or self (WHICH TRANSPORT)             | the rules choose  |
   | DOPT_WORLD_SIZE         | without a launcher: the ranks to fork               | 1                 |
   | DOPT_LOG_LEVEL          | error, warn, info or debug: the default logger      | warn: warnings    |
   |                         | prints the lines of that level and the more severe. | and errors        |
   |                         | info adds the transport chosen and from which       |                   |
   |                         | variables, and each rank's start: its rank, where   |                   |
   |                         | it met the others, the host layout. A log_fn of the |                   |
   |                         | program's own gets every line whatever it says      |                   |
   | DOPT_SHM_ENGINE         | 0 or 1: shm's engine option (transport_shm.h's      | 0                 |
   |                         | CONFIGURATION), for forked ranks and joining ones   |                   |
   | DOPT_PROGRESS_THREAD_US | TCP's progress_thread_us (transport_tcp.h): a       | 0: no thread      |
   |                         | thread moves requests every this many µs            |                   |
   | DOPT_STDOUT_RANKS       | all, or the ranks whose stdout is kept (0, or 0,2): | all: every rank's |
   |                         | every other rank writes its stdout to /dev/null     | stdout            |
   |                         | from a successful start on (stderr is untouched),   |                   |
   |                         | as torchrun's --local-ranks-filter does. A loop     |                   |
   |                         | that prints means over the ranks then needs no      |                   |
   |                         | rank test. Anything else is refused before a start  |                   |

   A value outside these is refused before anything starts, with one line naming the variable
   and what it accepts ("cannot start the job: DOPT_LOG_LEVEL="loud" is not one of error,
   warn, info, debug"). With DOPT_LOG_LEVEL=info a start says (TCP, rank 1 of 4 on 2 hosts):
       distopt: transport tcp; rank and size from RANK, WORLD_SIZE; meeting point from
         MASTER_ADDR, MASTER_PORT + 1
       distopt: tcp rank 1 of 4: rendezvous at 10.0.0.1:29501, 2 hosts (ranks per host 2,2)
   (shm: "shm rank 1 of 4: job 'slurm-4242.0', ..."; MPI: "mpi rank 1 of 4: joined MPI, ...").
   Each transport's other settings come from its own ..._config_from_env (DOPT_TIMEOUT_MS,
   DOPT_TOKEN, DOPT_SOCKET_IFNAME, DOPT_SHM_NAME, DOPT_MPI_CHECK, ...; see each header's
   ENVIRONMENT).

   FUNCTIONS

   dopt_status dopt_comm_create_from_env(dopt_comm **out)
     dopt_launch_create(out, NULL).

   dopt_status dopt_launch_create(dopt_comm **out, const dopt_launch_config *cfg)
     Reads the environment, chooses the transport and creates the communicator (a forked shm
     job returns in every rank). One DOPT_LOG_INFO line says what was chosen and from which
     variables (shown by the default logger at DOPT_LOG_LEVEL=info). On failure *out is NULL,
     one DOPT_LOG_ERROR line says why, and the status is the transport's (DOPT_ERR_INVALID for
     the environment's mistakes, DOPT_ERR_TIMEOUT when the ranks did not all arrive, ...). The
     default logger (to stderr, "distopt: <line>", the levels DOPT_LOG_LEVEL lets through:
     warnings and errors unless set; installed on the communicator too, so a later failure is
     printed once, when it happens) is, with dopt_comm_finish's line for a failed rank that has
     no log callback, the only place distopt prints: without a log_fn a failed start would be
     silent.

   const char *dopt_launch_choose(const dopt_launch_info *info, const dopt_launch_config *cfg,
                                  char *why, size_t cap)
     The transport the rules above choose for info ("shm", "tcp", "mpi", "self"; a forked shm
     job is "shm"), or NULL with why filled. No side effects (it reads DOPT_SHM_NAME besides
     info): for printing and tests.

   ERRORS
     dopt_comm_create_from_env and dopt_launch_create return DOPT_OK, or:
     DOPT_ERR_INVALID  the environment does not describe a job this program can start: launch
                       variables that conflict or are incomplete (distopt.h's LAUNCH
                       VARIABLES), an unknown transport, a transport the program was built
                       without (the line names the header to include), a world_size the
                       launcher contradicts, a bad DOPT_LOG_LEVEL or DOPT_SHM_ENGINE, or the
                       transport's own configuration refused (DOPT_TIMEOUT_MS,
                       DOPT_PROGRESS_THREAD_US, DOPT_MPI_CHECK, ...). Fix the command line or
                       the build.
     any other         the transport's create failed (DOPT_ERR_TIMEOUT: not every rank arrived;
                       DOPT_ERR_AUTH, DOPT_ERR_PROTOCOL, DOPT_ERR_IO, ...): see that header's
                       ERRORS. The line on stderr (or through log_fn) says why.
     Either way *out is NULL and no forked rank is left running: return from main.
*/
#ifndef DISTOPT_LAUNCH_H
#define DISTOPT_LAUNCH_H

#include "distopt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dopt_launch_config {
    const char *transport; /* "shm", "tcp", "mpi", "self"; NULL: DOPT_TRANSPORT, else chosen */
    int world_size;        /* ranks to fork without a launcher; 0: DOPT_WORLD_SIZE, else 1 */
    dopt_log_fn log_fn;    /* NULL: to stderr, the levels DOPT_LOG_LEVEL lets through */
    void *log_user;
} dopt_launch_config;

DOPT_DEF dopt_status dopt_comm_create_from_env(dopt_comm **out);
DOPT_DEF dopt_status dopt_launch_create(dopt_comm **out, const dopt_launch_config *cfg);
DOPT_DEF const char *dopt_launch_choose(const dopt_launch_info *info, const dopt_launch_config *cfg, char *why,
                                        size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_LAUNCH_H */

/* ==================== REFERENCE FOR CONTRIBUTORS ====================
   Not needed to use launch.h: how it knows the transports and what it calls.

   The transports this file can start are those whose headers were included before it in the
   implementation file: it tests their include guards (DISTOPT_TRANSPORT_SHM_H, _TCP_H, _MPI_H)
   when DISTOPT_IMPLEMENTATION is defined, so it links against nothing it was not given.
   dopt_launch_create reads DOPT_LOG_LEVEL (the default logger is one function per level, so
   the level travels in the function pointer and log_user stays NULL: no state), then
   dopt_launch_read's info, asks dopt_launch_choose, logs the choice at DOPT_LOG_INFO, and calls
   the transport with log_fn and log_user set: self, dopt_comm_create_self (then
   dopt_comm_set_log); shm without a rank, dopt_shm_fork with engine from DOPT_SHM_ENGINE (read
   here: dopt_shm_config_from_env, which reads it for a joining rank, needs a rank); shm with
   one, dopt_shm_config_from_env then dopt_shm_create; tcp, dopt_tcp_create_from_env; mpi,
   dopt_mpi_config_from_env then dopt_mpi_create. Its own refusals are one DOPT_LOG_ERROR line,
   "cannot start the job: <why>"; a transport's are that transport's. Each transport logs one
   DOPT_LOG_INFO line once its rank has joined (rank, size, where it met the others, the host
   layout): the lines DOPT_LOG_LEVEL=info shows.
*/

/* =====================================================================================
   IMPLEMENTATION — stop reading here if you only want the API.
   ===================================================================================== */

#if defined(DISTOPT_IMPLEMENTATION) && !defined(DOPT__LAUNCH_IMPLEMENTED)
#define DOPT__LAUNCH_IMPLEMENTED

#include <stdio.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifdef DISTOPT_TRANSPORT_SHM_H
#  define DOPT__LAUNCH_SHM 1
#else
#  define DOPT__LAUNCH_SHM 0
#endif
#ifdef DISTOPT_TRANSPORT_TCP_H
#  define DOPT__LAUNCH_TCP 1
#else
#  define DOPT__LAUNCH_TCP 0
#endif
#ifdef DISTOPT_TRANSPORT_MPI_H
#  define DOPT__LAUNCH_MPI 1
#else
#  define DOPT__LAUNCH_MPI 0
#endif

/* The default logger: the lines up to a level to stderr, one function per level (the level
   travels in the function pointer; log_user stays NULL). */
static void dopt__launch_print(dopt_log_level upto, dopt_log_level level, const char *message) {
    if (level <= upto) fprintf(stderr, "distopt: %s\n", message);
}
static void dopt__launch_stderr_error(void *user, dopt_log_level level, const char *message) {
    (void)user;
    dopt__launch_print(DOPT_LOG_ERROR, level, message);
}
static void dopt__launch_stderr_warn(void *user, dopt_log_level level, const char *message) {
    (void)user;
    dopt__launch_print(DOPT_LOG_WARN, level, message);
}
static void dopt__launch_stderr_info(void *user, dopt_log_level level, const char *message) {
    (void)user;
    dopt__launch_print(DOPT_LOG_INFO, level, message);
}
static void dopt__launch_stderr_debug(void *user, dopt_log_level level, const char *message) {
    (void)user;
    dopt__launch_print(DOPT_LOG_DEBUG, level, message);
}
static const dopt_log_fn dopt__launch_stderr[4] = {dopt__launch_stderr_error, dopt__launch_stderr_warn,
                                                   dopt__launch_stderr_info, dopt__launch_stderr_debug};

/* DOPT_LOG_LEVEL into *level (warn when unset or empty); 0, or -1 with why. */
static int dopt__launch_log_level(dopt_log_level *level, char *why, size_t cap) {
    static const char *const names[4] = {"error", "warn", "info", "debug"};
    const char *v = getenv("DOPT_LOG_LEVEL");
    int i;
    *level = DOPT_LOG_WARN;
    if (v == NULL || *v == '\0') return 0;
    for (i = 0; i < 4; i++)
        if (!strcmp(v, names[i])) {
            *level = (dopt_log_level)i;
            return 0;
        }
    snprintf(why, cap, "DOPT_LOG_LEVEL=\"%.40s\" is not one of error, warn, info, debug", v);
    return -1;
}

#if DOPT__LAUNCH_SHM
/* DOPT_SHM_ENGINE for a forked world, with dopt_shm_config_from_env's rule (that function needs
   a rank, which forked ranks get from the fork): 0 or 1 into *engine (unset or empty: left as
   it is); 0, or -1 with why. */
static int dopt__launch_shm_engine(int *engine, char *why, size_t cap) {
    const char *v = getenv("DOPT_SHM_ENGINE");
    if (v == NULL || *v == '\0') return 0;
    if (strcmp(v, "0") && strcmp(v, "1")) {
        snprintf(why, cap, "DOPT_SHM_ENGINE=\"%.40s\" is not 0 or 1", v);
        return -1;
    }
    *engine = *v == '1';
    return 0;
}
#endif

/* The world a launcher-less start asks for: cfg's, else DOPT_WORLD_SIZE's, else 1. */
static int dopt__launch_fork_size(const dopt_launch_info *info, const dopt_launch_config *cfg) {
    if (cfg && cfg->world_size > 0) return cfg->world_size;
    return info->world_size > 0 ? info->world_size : 1;
}

static int dopt__launch_built(const char *t) {
    if (!strcmp(t, "shm")) return DOPT__LAUNCH_SHM;
    if (!strcmp(t, "tcp")) return DOPT__LAUNCH_TCP;
    if (!strcmp(t, "mpi")) return DOPT__LAUNCH_MPI;
    return !strcmp(t, "self");
}

DOPT_DEF const char *dopt_launch_choose(const dopt_launch_info *info, const dopt_launch_config *cfg, char *why,
                                        size_t cap) {
    const char *t = cfg && cfg->transport ? cfg->transport : info->transport[0] ? info->transport : NULL;
    const char *shm_name = getenv("DOPT_SHM_NAME");
    int launched = info->rank >= 0, all_here = info->local_size > 0 && info->local_size == info->world_size;
    if (cfg && cfg->world_size > 0 && launched && cfg->world_size != info->world_size) {
        snprintf(why, cap, "the program asks for %d ranks but %s say the job has %d", cfg->world_size,
                 info->rank_from, info->world_size);
        return NULL;
    }
    if (t) {
        if (strcmp(t, "shm") && strcmp(t, "tcp") && strcmp(t, "mpi") && strcmp(t, "self")) {
            snprintf(why, cap, "transport \"%.40s\" is not one of shm, tcp, mpi, self", t);
            return NULL;
        }
        if (!dopt__launch_built(t)) {
            snprintf(why, cap, "transport %s: this program was built without transport_%s.h (include it before "
                               "launch.h%s)", t, t, !strcmp(t, "mpi") ? " and build with mpicc" : "");
            return NULL;
        }
        if (!strcmp(t, "self") && (launched ? info->world_size : dopt__launch_fork_size(info, cfg)) > 1) {
            snprintf(why, cap, "transport self is a world of one, but %s ask for %d ranks",
                     launched ? info->rank_from : "DOPT_WORLD_SIZE", launched ? info->world_size
                                                                             : dopt__launch_fork_size(info, cfg));
            return NULL;
        }
        if (!strcmp(t, "tcp") && !launched && dopt__launch_fork_size(info, cfg) > 1) {
            snprintf(why, cap, "transport tcp: DOPT_RANK is not set and no launcher's variables give a rank (start "
                               "every rank with DOPT_RANK and DOPT_WORLD_SIZE, or with mpirun, srun or torchrun)");
            return NULL;
        }
        return t;
    }
    if (launched && (!strcmp(info->launcher, "Open MPI") || !strcmp(info->launcher, "PMI")) && DOPT__LAUNCH_MPI)
        return "mpi";
    if (!launched) {
        if (dopt__launch_fork_size(info, cfg) == 1) return "self";
        if (DOPT__LAUNCH_SHM) return "shm";
        snprintf(why, cap, "a world of %d ranks with no launcher needs transport_shm.h to fork them, or a launcher "
                           "(mpirun, srun, torchrun, DOPT_RANK) to start each", dopt__launch_fork_size(info, cfg));
        return NULL;
    }
    if (info->world_size == 1) return "self";
    if (all_here && DOPT__LAUNCH_SHM && (info->job[0] || (shm_name && *shm_name))) return "shm";
    if (DOPT__LAUNCH_TCP) return "tcp";
    if (all_here && DOPT__LAUNCH_SHM) return "shm";
    snprintf(why, cap, "%s started %d ranks %s; this program has no transport for that (include transport_tcp.h, or "
                       "transport_mpi.h and build with mpicc)", info->launcher, info->world_size,
             all_here ? "without a job name for shared memory (set DOPT_SHM_NAME)" : "that may span hosts");
    return NULL;
}

static dopt_status dopt__launch_fail(dopt_log_fn log_fn, void *user, dopt_status st, const char *why) {
    char msg[DOPT_DETAIL_MAX];
    snprintf(msg, sizeof msg, "cannot start the job: %.480s", why);
    log_fn(user, DOPT_LOG_ERROR, msg);
    return st;
}

DOPT_DEF dopt_status dopt_comm_create_from_env(dopt_comm **out) { return dopt_launch_create(out, NULL); }

/* The chosen transport's communicator, its logging set; why is scratch for a refusal. */
static dopt_status dopt__launch_transport(dopt_comm **out, const char *t, const dopt_launch_info *li,
                                          const dopt_launch_config *cfg, dopt_log_fn log_fn, void *user, char *why,
                                          size_t cap) {
    dopt_status st;
    (void)li, (void)cfg, (void)why, (void)cap; /* a program with the MPI transport alone reads none */
    if (!strcmp(t, "self")) {
        st = dopt_comm_create_self(out);
        if (st == DOPT_OK) dopt_comm_set_log(*out, log_fn, user);
        return st;
    }
#if DOPT__LAUNCH_SHM
    if (!strcmp(t, "shm")) {
        dopt_shm_config sc;
        memset(&sc, 0, sizeof sc);
        sc.log_fn = log_fn;
        sc.log_user = user;
        if (li->rank < 0) {
            if (dopt__launch_shm_engine(&sc.engine, why, cap) < 0)
                return dopt__launch_fail(log_fn, user, DOPT_ERR_INVALID, why);
            return dopt_shm_fork(out, dopt__launch_fork_size(li, cfg), &sc);
        }
        st = dopt_shm_config_from_env(&sc);
        return st == DOPT_OK ? dopt_shm_create(out, &sc) : st;
    }
#endif
#if DOPT__LAUNCH_TCP
    if (!strcmp(t, "tcp")) {
        dopt_tcp_config tc;
        memset(&tc, 0, sizeof tc);
        tc.log_fn = log_fn;
        tc.log_user = user;
        return dopt_tcp_create_from_env(out, &tc);
    }
#endif
#if DOPT__LAUNCH_MPI
    if (!strcmp(t, "mpi")) {
        dopt_mpi_config mc;
        memset(&mc, 0, sizeof mc);
        mc.log_fn = log_fn;
        mc.log_user = user;
        st = dopt_mpi_config_from_env(&mc);
        return st == DOPT_OK ? dopt_mpi_create(out, &mc) : st;
    }
#endif
    return dopt__launch_fail(log_fn, user, DOPT_ERR_INVALID, "no transport"); /* not reached: choose checked */
}

/* DOPT_STDOUT_RANKS: "all", or the ranks whose stdout is kept, as "0" or "0,2,5". 1 with *keep
   set for this rank, 0 when unset or empty (every rank keeps it), -1 with why filled. */
static int dopt__launch_stdout_ranks(int rank, int *keep, char *why, size_t cap) {
    const char *v = getenv("DOPT_STDOUT_RANKS"), *p;
    *keep = 1;
    if (v == NULL || *v == 0 || !strcmp(v, "all")) return 0;
    *keep = 0;
    for (p = v;;) {
        char *end;
        long r;
        if (*p < '0' || *p > '9') break;
        r = strtol(p, &end, 10);
        if (r == rank) *keep = 1;
        if (*end == 0) return 1;
        if (*end != ',') break;
        p = end + 1;
    }
    snprintf(why, cap, "DOPT_STDOUT_RANKS=\"%.40s\" is neither all nor a list of ranks such as 0 or 0,2", v);
    return -1;
}

/* Every rank but those DOPT_STDOUT_RANKS names writes its stdout to /dev/null from here on. */
static void dopt__launch_quiet_stdout(dopt_comm *c) {
    char why[128];
    int keep;
    if (dopt__launch_stdout_ranks(c->rank, &keep, why, sizeof why) <= 0 || keep) return;
    fflush(stdout);
    if (freopen("/dev/null", "w", stdout) == NULL)
        dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: DOPT_STDOUT_RANKS: cannot send stdout to /dev/null", c->rank);
    else
        dopt_comm_log(c, DOPT_LOG_INFO, "rank %d: stdout to /dev/null (DOPT_STDOUT_RANKS)", c->rank);
}

DOPT_DEF dopt_status dopt_launch_create(dopt_comm **out, const dopt_launch_config *cfg) {
    dopt_launch_info info;
    dopt_log_level level;
    dopt_log_fn log_fn = cfg && cfg->log_fn ? cfg->log_fn : dopt__launch_stderr[DOPT_LOG_WARN];
    void *user = cfg && cfg->log_fn ? cfg->log_user : NULL;
    char why[DOPT_DETAIL_MAX];
    const char *t;
    dopt_status st = DOPT_ERR_INVALID;
    int keep;
    if (out == NULL) return DOPT_ERR_INVALID;
    *out = NULL;
    if (dopt__launch_log_level(&level, why, sizeof why) < 0) return dopt__launch_fail(log_fn, user, st, why);
    if (!(cfg && cfg->log_fn)) log_fn = dopt__launch_stderr[level];
    if (dopt_launch_read(&info, why, sizeof why) != DOPT_OK) return dopt__launch_fail(log_fn, user, st, why);
    t = dopt_launch_choose(&info, cfg, why, sizeof why);
    if (t == NULL) return dopt__launch_fail(log_fn, user, st, why);
    if (dopt__launch_stdout_ranks(0, &keep, why, sizeof why) < 0) return dopt__launch_fail(log_fn, user, st, why);
    snprintf(why, sizeof why, "transport %s; %s%.96s%s%.128s%s", t, info.rank_from[0] ? "rank and size from " : "no launcher",
             info.rank_from, info.master_from[0] ? "; meeting point from " : "", info.master_from,
             cfg && cfg->transport ? " (the program chose the transport)" : "");
    log_fn(user, DOPT_LOG_INFO, why);
    st = dopt__launch_transport(out, t, &info, cfg, log_fn, user, why, sizeof why);
    if (st == DOPT_OK) dopt__launch_quiet_stdout(*out);
    return st;
}

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_IMPLEMENTATION && !DOPT__LAUNCH_IMPLEMENTED */
