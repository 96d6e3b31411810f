/* Starting a job from the environment: distopt.h's dopt_launch_read for every launcher's
   variables (and their mistakes), launch.h's choice of transport, and the one call starting real
   worlds — forked over shared memory, over TCP from torchrun's variables and from Slurm's with a
   derived port. Every test sets its own variables: each runs in its own process. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "../transport_tcp.h"
#include "../launch.h"
#include "dtest.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

typedef struct captured_log {
    char text[8192];
} captured_log;

static void capture_log(void *user, dopt_log_level level, const char *message) {
    captured_log *log = (captured_log *)user;
    size_t used = strlen(log->text);
    snprintf(log->text + used, sizeof log->text - used, "%c %s\n", "EWID"[level], message);
}

/* Every variable any launcher sets, so a test starts from none of them (the suite itself may
   run under a launcher). */
static void clear_launch_env(void) {
    static const char *const names[] = {
        "DOPT_TRANSPORT", "DOPT_RANK", "DOPT_WORLD_SIZE", "DOPT_LOCAL_RANK", "DOPT_LOCAL_SIZE",
        "DOPT_MASTER_ADDR", "DOPT_MASTER_PORT", "DOPT_SHM_NAME", "DOPT_TIMEOUT_MS", "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
        "OMPI_MCA_ess_base_jobid", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_KVSNAME",
        "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_LAUNCH_NODE_IPADDR",
        "SLURM_JOB_ID", "SLURM_STEP_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "DOPT_LOG_LEVEL", "DOPT_SHM_ENGINE", "DOPT_PROGRESS_THREAD_US",
        "DOPT_BIND_ADDR", "DOPT_STDOUT_RANKS"};
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++) unsetenv(names[i]);
}

static dopt_launch_info read_ok(void) {
    dopt_launch_info info;
    char why[512];
    dopt_status st = dopt_launch_read(&info, why, sizeof why);
    DT_CHECKF(st == DOPT_OK, "dopt_launch_read: %s", why);
    return info;
}

/* The environment as it stands is refused with exactly this reason. */
static void expect_refused(const char *reason) {
    dopt_launch_info info;
    char why[512];
    DT_EQ_INT(dopt_launch_read(&info, why, sizeof why), DOPT_ERR_INVALID);
    DT_CHECKF(strcmp(why, reason) == 0, "expected \"%s\", got \"%s\"", reason, why);
}

/* ------------------------------------------------------------------ reading the variables */

DTEST(nothing_set_is_no_launcher) {
    dopt_launch_info info;
    clear_launch_env();
    info = read_ok();
    DT_CHECK(info.rank == -1 && info.world_size == -1 && info.local_rank == -1 && info.local_size == -1);
    DT_CHECK(info.master_addr[0] == 0 && info.master_port == 0 && info.job[0] == 0 && info.transport[0] == 0);
    DT_CHECK(!strcmp(info.launcher, ""));
    setenv("DOPT_WORLD_SIZE", "3", 1); /* a size alone: a world to fork */
    info = read_ok();
    DT_CHECK(info.rank == -1 && info.world_size == 3);
}

DTEST(dopt_variables) {
    dopt_launch_info info;
    clear_launch_env();
    setenv("DOPT_RANK", "2", 1);
    setenv("DOPT_WORLD_SIZE", "4", 1);
    setenv("DOPT_LOCAL_RANK", "0", 1);
    setenv("DOPT_LOCAL_SIZE", "2", 1);
    setenv("DOPT_MASTER_ADDR", "node7", 1);
    setenv("DOPT_MASTER_PORT", "29999", 1);
    setenv("DOPT_TRANSPORT", "tcp", 1);
    info = read_ok();
    DT_CHECK(info.rank == 2 && info.world_size == 4 && info.local_rank == 0 && info.local_size == 2);
    DT_CHECK(!strcmp(info.master_addr, "node7") && info.master_port == 29999 && !strcmp(info.transport, "tcp"));
    DT_CHECKF(!strcmp(info.launcher, "DOPT") && !strcmp(info.rank_from, "DOPT_RANK, DOPT_WORLD_SIZE"), "%s / %s",
              info.launcher, info.rank_from);
    DT_CHECKF(!strcmp(info.master_from, "DOPT_MASTER_ADDR, DOPT_MASTER_PORT"), "%s", info.master_from);
}

DTEST(open_mpi_variables_and_a_derived_port) {
    dopt_launch_info info;
    int port;
    clear_launch_env();
    setenv("OMPI_COMM_WORLD_RANK", "5", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    setenv("OMPI_MCA_ess_base_jobid", "327548929", 1);
    info = read_ok();
    DT_CHECK(info.rank == 5 && info.world_size == 8 && info.local_rank == 1 && info.local_size == 2);
    DT_CHECKF(!strcmp(info.launcher, "Open MPI") && !strcmp(info.job, "ompi-327548929"), "%s %s", info.launcher,
              info.job);
    DT_CHECKF(info.master_addr[0] == 0, "Open MPI names no host for rank 0, got %s", info.master_addr);
    /* the port is a function of the job's name alone: the same on every rank, in the range */
    port = info.master_port;
    DT_CHECKF(port >= 20000 && port < 32000, "port %d", port);
    DT_EQ_INT(port, 20000 + (int)(dopt__fnv1a(DOPT__FNV_OFFSET, "ompi-327548929", 14) % 12000u));
    setenv("OMPI_COMM_WORLD_RANK", "0", 1);
    DT_EQ_INT(read_ok().master_port, port);
    setenv("OMPI_MCA_ess_base_jobid", "327548930", 1);
    DT_CHECK(read_ok().master_port != port);
    /* every rank on this host: rank 0 is here */
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8", 1);
    info = read_ok();
    DT_CHECK(!strcmp(info.master_addr, "127.0.0.1"));
}

DTEST(pmi_variables) {
    dopt_launch_info info;
    clear_launch_env();
    setenv("PMI_RANK", "1", 1);
    setenv("PMI_SIZE", "3", 1);
    setenv("MPI_LOCALRANKID", "1", 1);
    setenv("MPI_LOCALNRANKS", "3", 1);
    info = read_ok();
    DT_CHECK(info.rank == 1 && info.world_size == 3 && info.local_rank == 1 && info.local_size == 3);
    DT_CHECK(!strcmp(info.launcher, "PMI") && !strcmp(info.rank_from, "PMI_RANK, PMI_SIZE"));
}

DTEST(slurm_variables_and_its_node_lists) {
    dopt_launch_info info;
    clear_launch_env();
    setenv("SLURM_PROCID", "5", 1);
    setenv("SLURM_NTASKS", "7", 1);
    setenv("SLURM_LOCALID", "0", 1);
    setenv("SLURM_NODEID", "2", 1);
    setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2),3", 1);
    setenv("SLURM_STEP_NODELIST", "gpu[03-05,09],cpu1", 1);
    setenv("SLURM_JOB_NODELIST", "other1", 1);
    setenv("SLURM_LAUNCH_NODE_IPADDR", "10.9.9.9", 1);
    setenv("SLURM_JOB_ID", "4242", 1);
    setenv("SLURM_STEP_ID", "3", 1);
    info = read_ok();
    DT_CHECK(info.rank == 5 && info.world_size == 7 && info.local_rank == 0);
    DT_CHECKF(info.local_size == 3, "node 2 of \"2(x2),3\" has 3 tasks, got %d", info.local_size);
    DT_CHECKF(!strcmp(info.master_addr, "gpu03"), "first node %s", info.master_addr);
    DT_CHECKF(!strcmp(info.job, "slurm-4242.3"), "%s", info.job);
    DT_CHECK(info.master_port >= 20000 && info.master_port < 32000);
    setenv("SLURM_NODEID", "0", 1);
    DT_EQ_INT(read_ok().local_size, 2);
    setenv("SLURM_STEP_TASKS_PER_NODE", "4,1,2", 1);
    setenv("SLURM_NODEID", "1", 1);
    DT_EQ_INT(read_ok().local_size, 1);
    setenv("SLURM_STEP_NODELIST", "a1,b2", 1);
    DT_CHECK(!strcmp(read_ok().master_addr, "a1"));
    unsetenv("SLURM_STEP_NODELIST"); /* the job's list, then where srun ran */
    DT_CHECK(!strcmp(read_ok().master_addr, "other1"));
    unsetenv("SLURM_JOB_NODELIST");
    DT_CHECK(!strcmp(read_ok().master_addr, "10.9.9.9"));
    /* MASTER_ADDR and DOPT_MASTER_ADDR come first; one node: this host */
    setenv("MASTER_ADDR", "m1", 1);
    DT_CHECK(!strcmp(read_ok().master_addr, "m1"));
    setenv("DOPT_MASTER_ADDR", "d1", 1);
    DT_CHECK(!strcmp(read_ok().master_addr, "d1"));
    unsetenv("MASTER_ADDR");
    unsetenv("DOPT_MASTER_ADDR");
    setenv("SLURM_STEP_TASKS_PER_NODE", "7", 1);
    setenv("SLURM_NODEID", "0", 1);
    DT_CHECK(!strcmp(read_ok().master_addr, "127.0.0.1"));
}

DTEST(torchrun_variables) {
    dopt_launch_info info;
    clear_launch_env();
    setenv("RANK", "3", 1);
    setenv("WORLD_SIZE", "4", 1);
    setenv("LOCAL_RANK", "1", 1);
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    setenv("MASTER_ADDR", "fd00:dc::1", 1);
    setenv("MASTER_PORT", "29500", 1);
    info = read_ok();
    DT_CHECK(info.rank == 3 && info.world_size == 4 && info.local_rank == 1 && info.local_size == 2);
    DT_CHECK(!strcmp(info.launcher, "torchrun") && !strcmp(info.master_addr, "fd00:dc::1"));
    DT_EQ_INT(info.master_port, 29500);
    /* under torchrun itself, its store holds MASTER_PORT */
    setenv("TORCHELASTIC_RUN_ID", "none", 1);
    info = read_ok();
    DT_EQ_INT(info.master_port, 29501);
    DT_CHECKF(strstr(info.master_from, "MASTER_PORT + 1") != NULL, "%s", info.master_from);
    setenv("DOPT_MASTER_PORT", "31000", 1);
    DT_EQ_INT(read_ok().master_port, 31000);
}

/* An inner launcher wins over the outer one's inherited variables. */
DTEST(nested_launchers_read_the_inner_one) {
    dopt_launch_info info;
    clear_launch_env();
    setenv("SLURM_PROCID", "0", 1); /* the batch step's */
    setenv("SLURM_NTASKS", "16", 1);
    setenv("OMPI_COMM_WORLD_RANK", "6", 1); /* mpirun inside the allocation */
    setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
    info = read_ok();
    DT_CHECK(info.rank == 6 && info.world_size == 8 && !strcmp(info.launcher, "Open MPI"));
    clear_launch_env();
    setenv("SLURM_PROCID", "1", 1); /* srun started one torchrun per node */
    setenv("SLURM_NTASKS", "2", 1);
    setenv("RANK", "5", 1);
    setenv("WORLD_SIZE", "8", 1);
    DT_CHECK(read_ok().rank == 1); /* without torchrun's own mark, the order decides */
    setenv("TORCHELASTIC_RUN_ID", "job9", 1);
    info = read_ok();
    DT_CHECK(info.rank == 5 && info.world_size == 8 && !strcmp(info.launcher, "torchrun"));
}

DTEST(mistakes_are_refused_naming_the_variables) {
    clear_launch_env();
    setenv("DOPT_TRANSPORT", "udp", 1);
    expect_refused("DOPT_TRANSPORT=\"udp\" is not one of shm, tcp, mpi, self");
    clear_launch_env();
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    expect_refused("OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not (Open MPI's launcher sets both; "
                   "unset the stray one)");
    clear_launch_env();
    setenv("WORLD_SIZE", "4", 1);
    expect_refused("WORLD_SIZE is set but RANK is not (torchrun's launcher sets both; unset the stray one)");
    clear_launch_env();
    setenv("SLURM_PROCID", "x", 1);
    setenv("SLURM_NTASKS", "4", 1);
    expect_refused("SLURM_PROCID=\"x\" is not a number");
    clear_launch_env();
    setenv("PMI_RANK", "4", 1);
    setenv("PMI_SIZE", "4", 1);
    expect_refused("PMI_RANK=4 is not below PMI_SIZE=4");
    clear_launch_env();
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
    setenv("DOPT_WORLD_SIZE", "4", 1);
    expect_refused("DOPT_WORLD_SIZE=4 but OMPI_COMM_WORLD_SIZE=8: they name two different jobs; unset DOPT_WORLD_SIZE");
    setenv("DOPT_WORLD_SIZE", "8", 1); /* restating it is fine */
    DT_EQ_INT(read_ok().world_size, 8);
    setenv("DOPT_RANK", "2", 1);
    expect_refused("DOPT_RANK=2 but OMPI_COMM_WORLD_RANK=1: they name two different jobs; unset DOPT_RANK");
    clear_launch_env();
    setenv("DOPT_RANK", "0", 1);
    expect_refused("DOPT_RANK is set but DOPT_WORLD_SIZE is not (every rank needs both)");
    setenv("DOPT_WORLD_SIZE", "2", 1);
    setenv("DOPT_LOCAL_SIZE", "3", 1);
    expect_refused("DOPT_LOCAL_SIZE=3 is above the world size 2");
    setenv("DOPT_LOCAL_SIZE", "1", 1);
    setenv("DOPT_LOCAL_RANK", "1", 1);
    expect_refused("the local rank 1 is not below the local size 1 (DOPT_LOCAL_RANK, DOPT_LOCAL_SIZE)");
    clear_launch_env();
    setenv("DOPT_RANK", "0", 1);
    setenv("DOPT_WORLD_SIZE", "2", 1);
    setenv("DOPT_MASTER_PORT", "65536", 1);
    expect_refused("DOPT_MASTER_PORT=65536 is above 65535");
}

/* ------------------------------------------------------------------ choosing the transport */

static const char *choose(const dopt_launch_config *cfg, char *why, size_t cap) {
    dopt_launch_info info = read_ok();
    why[0] = 0;
    return dopt_launch_choose(&info, cfg, why, cap);
}

DTEST(the_transport_follows_the_documented_rules) {
    char why[512];
    const char *t;
    dopt_launch_config cfg;
    memset(&cfg, 0, sizeof cfg);
    clear_launch_env();
    DT_CHECK(!strcmp(choose(NULL, why, sizeof why), "self")); /* rule 2: nothing set */
    setenv("DOPT_WORLD_SIZE", "3", 1);
    DT_CHECK(!strcmp(choose(NULL, why, sizeof why), "shm")); /* rule 2: fork 3 */
    cfg.world_size = 1;
    DT_CHECK(!strcmp(choose(&cfg, why, sizeof why), "self")); /* the program's number wins */
    unsetenv("DOPT_WORLD_SIZE");
    cfg.world_size = 4;
    DT_CHECK(!strcmp(choose(&cfg, why, sizeof why), "shm"));
    /* a launcher: mpi is not built in here, so Open MPI's ranks on 2 hosts go over TCP */
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    setenv("OMPI_MCA_ess_base_jobid", "99", 1);
    t = choose(&cfg, why, sizeof why);
    DT_CHECKF(t != NULL && !strcmp(t, "tcp"), "%s / %s", t ? t : "NULL", why);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1); /* rule 4: all here, a job name */
    DT_CHECK(!strcmp(choose(&cfg, why, sizeof why), "shm"));
    unsetenv("OMPI_MCA_ess_base_jobid"); /* no name for the segment: TCP */
    DT_CHECK(!strcmp(choose(&cfg, why, sizeof why), "tcp"));
    setenv("DOPT_SHM_NAME", "mine", 1);
    DT_CHECK(!strcmp(choose(&cfg, why, sizeof why), "shm"));
    cfg.world_size = 8; /* the program asks for another world than the launcher started */
    DT_CHECK(choose(&cfg, why, sizeof why) == NULL);
    DT_CHECKF(!strcmp(why, "the program asks for 8 ranks but OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE say the job "
                           "has 4"),
              "%s", why);
    cfg.world_size = 0;
    /* named transports */
    setenv("DOPT_TRANSPORT", "mpi", 1);
    DT_CHECK(choose(&cfg, why, sizeof why) == NULL);
    DT_CHECKF(!strcmp(why, "transport mpi: this program was built without transport_mpi.h (include it before "
                           "launch.h and build with mpicc)"),
              "%s", why);
    setenv("DOPT_TRANSPORT", "self", 1);
    DT_CHECK(choose(&cfg, why, sizeof why) == NULL);
    DT_CHECKF(strstr(why, "transport self is a world of one, but OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE ask for 4 "
                          "ranks") != NULL,
              "%s", why);
    cfg.transport = "tcp"; /* the program's choice wins over DOPT_TRANSPORT */
    DT_CHECK(!strcmp(choose(&cfg, why, sizeof why), "tcp"));
    cfg.transport = NULL;
    clear_launch_env(); /* rule 4 for torchrun: its workers all on this host, named by its address */
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "4", 1);
    setenv("LOCAL_RANK", "1", 1);
    setenv("LOCAL_WORLD_SIZE", "4", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "29500", 1);
    DT_CHECK(!strcmp(choose(&cfg, why, sizeof why), "shm"));
    setenv("LOCAL_WORLD_SIZE", "2", 1); /* on 2 hosts: TCP */
    DT_CHECK(!strcmp(choose(&cfg, why, sizeof why), "tcp"));
    cfg.transport = "tcp";
    clear_launch_env();
    setenv("DOPT_WORLD_SIZE", "2", 1); /* TCP cannot fork */
    DT_CHECK(choose(&cfg, why, sizeof why) == NULL);
    DT_CHECKF(strstr(why, "DOPT_RANK is not set") != NULL, "%s", why);
    setenv("DOPT_RANK", "1", 1);
    setenv("DOPT_WORLD_SIZE", "1", 1);
    DT_EQ_INT(dopt_launch_read(&(dopt_launch_info){0}, why, sizeof why), DOPT_ERR_INVALID); /* rank 1 of 1 */
}

/* ------------------------------------------------------------------ starting real worlds */

static void check_world(dopt_comm *c, int size, const char *backend) {
    int64_t v[2] = {c->rank, 1};
    DT_CHECK(c != NULL && c->size == size);
    DT_CHECKF(!strcmp(c->vt->name, backend), "backend %s, expected %s", c->vt->name, backend);
    DT_OK(dopt_allreduce(c, v, 2, DOPT_I64, DOPT_SUM));
    DT_CHECK(v[0] == (int64_t)size * (size - 1) / 2 && v[1] == size);
}

/* DOPT_WORLD_SIZE alone: the one call forks that many ranks, each returns with its own. */
DTEST(one_call_forks_a_shared_memory_world) {
    dopt_comm *c = NULL;
    captured_log log;
    dopt_launch_config cfg;
    clear_launch_env();
    setenv("DOPT_WORLD_SIZE", "3", 1);
    memset(&log, 0, sizeof log);
    memset(&cfg, 0, sizeof cfg);
    cfg.log_fn = capture_log;
    cfg.log_user = &log;
    DT_OK(dopt_launch_create(&c, &cfg));
    check_world(c, 3, "shm");
    if (c->rank == 0) DT_CHECKF(strstr(log.text, "I transport shm; no launcher") != NULL, "%s", log.text);
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

/* 1 when this process's stdout is /dev/null. */
static int stdout_is_dev_null(void) {
    struct stat out, null;
    return fstat(1, &out) == 0 && stat("/dev/null", &null) == 0 && out.st_rdev == null.st_rdev &&
           S_ISCHR(out.st_mode);
}

/* DOPT_STDOUT_RANKS keeps the stdout of the ranks it names and sends the others' to /dev/null;
   a value that is neither all nor a list of ranks is refused before the start, naming it. */
DTEST(stdout_of_the_ranks_not_named_goes_to_dev_null) {
    static const char *const bad[] = {"x", "0,", ",1", "-1", "0;1", "1 2", "rank0"};
    dopt_comm *c = NULL;
    captured_log log;
    dopt_launch_config cfg;
    size_t i;
    clear_launch_env();
    memset(&cfg, 0, sizeof cfg);
    cfg.log_fn = capture_log;
    cfg.log_user = &log;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&log, 0, sizeof log);
        setenv("DOPT_STDOUT_RANKS", bad[i], 1);
        DT_EQ_INT(dopt_launch_create(&c, &cfg), DOPT_ERR_INVALID);
        DT_CHECKF(c == NULL && strstr(log.text, "DOPT_STDOUT_RANKS=") != NULL, "%s: %s", bad[i], log.text);
    }
    setenv("DOPT_STDOUT_RANKS", "0,2", 1);
    setenv("DOPT_WORLD_SIZE", "3", 1);
    DT_OK(dopt_launch_create(&c, &cfg));
    DT_CHECKF(stdout_is_dev_null() == (c->rank == 1), "rank %d: stdout %s /dev/null", c->rank,
              stdout_is_dev_null() ? "is" : "is not");
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

static int free_port(void) {
    struct sockaddr_in sa;
    socklen_t len = sizeof sa;
    int fd = socket(AF_INET, SOCK_STREAM, 0), port;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    DT_CHECK(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
             getsockname(fd, (struct sockaddr *)&sa, &len) == 0);
    port = ntohs(sa.sin_port);
    close(fd);
    return port;
}

typedef struct started {
    const char *launcher; /* "torchrun" or "slurm" */
    const char *transport; /* DOPT_TRANSPORT, NULL: unset */
    const char *expect;    /* the backend the one call must pick */
    int size, port;
    char job[32];
} started;

static void rank_from_launcher(int rank, void *arg) {
    started *s = (started *)arg;
    char r[16], n[16], p[16];
    dopt_comm *c = NULL;
    snprintf(r, sizeof r, "%d", rank);
    snprintf(n, sizeof n, "%d", s->size);
    snprintf(p, sizeof p, "%d", s->port);
    clear_launch_env();
    if (s->transport) setenv("DOPT_TRANSPORT", s->transport, 1);
    setenv("DOPT_TIMEOUT_MS", "30000", 1);
    if (!strcmp(s->launcher, "torchrun")) {
        setenv("RANK", r, 1);
        setenv("WORLD_SIZE", n, 1);
        setenv("LOCAL_RANK", r, 1);
        setenv("LOCAL_WORLD_SIZE", n, 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", p, 1);
    } else {
        setenv("SLURM_PROCID", r, 1);
        setenv("SLURM_NTASKS", n, 1);
        setenv("SLURM_LOCALID", r, 1);
        setenv("SLURM_NODEID", "0", 1);
        setenv("SLURM_STEP_TASKS_PER_NODE", n, 1);
        setenv("SLURM_STEP_NODELIST", "localhost", 1);
        setenv("SLURM_JOB_ID", s->job, 1);
        setenv("SLURM_STEP_ID", "0", 1);
    }
    DT_OK(dopt_comm_create_from_env(&c));
    check_world(c, s->size, s->expect);
    dopt_comm_destroy(c);
}

DTEST(one_call_starts_tcp_from_torchrun_variables) {
    started s = {"torchrun", "tcp", "tcp", 3, 0, ""};
    s.port = free_port();
    DT_EQ_INT(dtest_spawn(3, rank_from_launcher, &s, 60), 0);
}

/* Slurm names no port: every rank derives the same one from the job's id. All ranks on one node
   and a job name: shared memory when nothing says otherwise, TCP when asked. */
DTEST(one_call_starts_from_slurm_variables) {
    started s = {"slurm", NULL, "shm", 3, 0, ""};
    snprintf(s.job, sizeof s.job, "%d", (int)getpid());
    DT_EQ_INT(dtest_spawn(3, rank_from_launcher, &s, 60), 0);
    s.transport = "tcp";
    s.expect = "tcp";
    s.size = 2;
    snprintf(s.job, sizeof s.job, "%d1", (int)getpid());
    DT_EQ_INT(dtest_spawn(2, rank_from_launcher, &s, 60), 0);
}

/* ------------------------------------------------------------------ what the start says, and its settings */

/* stderr sent to a file while a part of a test runs, then read back. */
typedef struct stderr_capture {
    char path[64];
    int saved;
} stderr_capture;

static void stderr_begin(stderr_capture *cap) {
    int fd;
    snprintf(cap->path, sizeof cap->path, "/tmp/dopt-test-launch-XXXXXX");
    fd = mkstemp(cap->path);
    DT_CHECK(fd >= 0);
    fflush(stderr);
    cap->saved = dup(2);
    DT_CHECK(cap->saved >= 0 && dup2(fd, 2) == 2);
    close(fd);
}

static void stderr_end(stderr_capture *cap, char *text, size_t size) {
    FILE *f;
    size_t n;
    fflush(stderr);
    dup2(cap->saved, 2);
    close(cap->saved);
    f = fopen(cap->path, "r");
    DT_CHECK(f != NULL);
    n = fread(text, 1, size - 1, f);
    text[n] = 0;
    fclose(f);
    unlink(cap->path);
}

/* DOPT_LOG_LEVEL chooses which lines the default logger prints: unset is warn; each level shows
   itself and the more severe; info shows launch.h's choice. */
DTEST(log_level_from_the_environment) {
    static const char *const names[4] = {"error", "warn", "info", "debug"};
    int level, l;
    for (level = -1; level < 4; level++) { /* -1: unset */
        int upto = level < 0 ? DOPT_LOG_WARN : level;
        char text[4096], line[64];
        stderr_capture cap;
        dopt_comm *c = NULL;
        dopt_status st;
        clear_launch_env();
        if (level >= 0) setenv("DOPT_LOG_LEVEL", names[level], 1);
        stderr_begin(&cap);
        st = dopt_comm_create_from_env(&c);
        for (l = 0; c && l < 4; l++) dopt_comm_log(c, (dopt_log_level)l, "a line at %s", names[l]);
        stderr_end(&cap, text, sizeof text);
        DT_OK(st);
        DT_CHECKF(c->log_fn == dopt__launch_stderr[upto], "DOPT_LOG_LEVEL=%s: not the logger of its level",
                  level < 0 ? "(unset)" : names[level]);
        for (l = 0; l < 4; l++) {
            snprintf(line, sizeof line, "distopt: a line at %s\n", names[l]);
            DT_CHECKF((strstr(text, line) != NULL) == (l <= upto), "DOPT_LOG_LEVEL=%s, a line at %s: stderr has\n%s",
                      level < 0 ? "(unset)" : names[level], names[l], text);
        }
        DT_CHECKF((strstr(text, "distopt: transport self; no launcher\n") != NULL) == (upto >= DOPT_LOG_INFO),
                  "DOPT_LOG_LEVEL=%s: stderr has\n%s", level < 0 ? "(unset)" : names[level], text);
        dopt_comm_destroy(c);
    }
}

DTEST(a_bad_log_level_is_refused_naming_the_variable) {
    dopt_comm *c = NULL;
    captured_log log;
    dopt_launch_config cfg;
    stderr_capture cap;
    char text[4096];
    dopt_status st;
    clear_launch_env();
    memset(&log, 0, sizeof log);
    memset(&cfg, 0, sizeof cfg);
    cfg.log_fn = capture_log;
    cfg.log_user = &log;
    setenv("DOPT_LOG_LEVEL", "INFO", 1); /* the names are lower case, as every DOPT_* value */
    DT_EQ_INT(dopt_launch_create(&c, &cfg), DOPT_ERR_INVALID);
    DT_CHECK(c == NULL);
    DT_CHECKF(!strcmp(log.text, "E cannot start the job: DOPT_LOG_LEVEL=\"INFO\" is not one of error, warn, info, "
                                "debug\n"),
              "%s", log.text);
    setenv("DOPT_LOG_LEVEL", "loud", 1); /* without a log_fn: on stderr */
    stderr_begin(&cap);
    st = dopt_comm_create_from_env(&c);
    stderr_end(&cap, text, sizeof text);
    DT_EQ_INT(st, DOPT_ERR_INVALID);
    DT_CHECKF(!strcmp(text, "distopt: cannot start the job: DOPT_LOG_LEVEL=\"loud\" is not one of error, warn, info, "
                            "debug\n"),
              "%s", text);
}

/* DOPT_SHM_ENGINE sets shm's engine option, for forked ranks (launch.h) and joining ones
   (dopt_shm_config_from_env); the engine's vtable runs no collective itself. */
static void forked_world_on_the_engine(int engine) {
    dopt_comm *c = NULL;
    clear_launch_env();
    setenv("DOPT_WORLD_SIZE", "2", 1);
    setenv("DOPT_SHM_ENGINE", engine ? "1" : "0", 1);
    DT_OK(dopt_comm_create_from_env(&c));
    check_world(c, 2, "shm");
    DT_CHECKF(c->vt->provides == (engine ? 0u : DOPT_PROVIDES_ALL), "DOPT_SHM_ENGINE=%d: provides %u", engine,
              c->vt->provides);
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
}

DTEST(shm_engine_from_the_environment) {
    dopt_shm_config sc;
    captured_log log;
    dopt_launch_config cfg;
    dopt_comm *c = NULL;
    forked_world_on_the_engine(1);
    forked_world_on_the_engine(0);
    clear_launch_env();
    memset(&log, 0, sizeof log);
    memset(&cfg, 0, sizeof cfg);
    cfg.log_fn = capture_log;
    cfg.log_user = &log;
    setenv("DOPT_WORLD_SIZE", "2", 1);
    setenv("DOPT_SHM_ENGINE", "yes", 1);
    DT_EQ_INT(dopt_launch_create(&c, &cfg), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "\nE cannot start the job: DOPT_SHM_ENGINE=\"yes\" is not 0 or 1\n") != NULL, "%s",
              log.text); /* after the line saying shm was chosen */
    setenv("DOPT_RANK", "1", 1); /* a joining rank: dopt_shm_config_from_env */
    setenv("DOPT_SHM_NAME", "engine-from-env", 1);
    memset(&sc, 0, sizeof sc);
    memset(&log, 0, sizeof log);
    sc.log_fn = capture_log;
    sc.log_user = &log;
    DT_EQ_INT(dopt_shm_config_from_env(&sc), DOPT_ERR_INVALID);
    DT_CHECKF(strstr(log.text, "DOPT_SHM_ENGINE=\"yes\" is not 0 or 1") != NULL, "%s", log.text);
    setenv("DOPT_SHM_ENGINE", "1", 1);
    DT_OK(dopt_shm_config_from_env(&sc));
    DT_EQ_INT(sc.engine, 1);
    unsetenv("DOPT_SHM_ENGINE"); /* unset: the config's own */
    DT_OK(dopt_shm_config_from_env(&sc));
    DT_EQ_INT(sc.engine, 1);
    setenv("DOPT_SHM_ENGINE", "0", 1);
    DT_OK(dopt_shm_config_from_env(&sc));
    DT_EQ_INT(sc.engine, 0);
}

DTEST(progress_thread_from_the_environment) {
    dopt_tcp_config tc;
    captured_log log;
    clear_launch_env();
    setenv("DOPT_RANK", "0", 1);
    setenv("DOPT_WORLD_SIZE", "1", 1);
    memset(&tc, 0, sizeof tc);
    memset(&log, 0, sizeof log);
    tc.log_fn = capture_log;
    tc.log_user = &log;
    tc.progress_thread_us = 7;
    DT_OK(dopt_tcp_config_from_env(&tc)); /* unset: the config's own */
    DT_EQ_INT(tc.progress_thread_us, 7);
    setenv("DOPT_PROGRESS_THREAD_US", "250", 1);
    DT_OK(dopt_tcp_config_from_env(&tc));
    DT_EQ_INT(tc.progress_thread_us, 250);
    setenv("DOPT_PROGRESS_THREAD_US", "-5", 1);
    DT_EQ_INT(dopt_tcp_config_from_env(&tc), DOPT_ERR_INVALID);
    DT_CHECKF(!strcmp(log.text, "E DOPT_PROGRESS_THREAD_US=-5 is below 0\n"), "%s", log.text);
    DT_EQ_INT(tc.progress_thread_us, 250); /* a refused environment leaves cfg as it was */
}

/* With DOPT_LOG_LEVEL=info a TCP start says which transport from which variables, then each rank
   where it met rank 0 and the hosts (here rank 0 listens on 127.0.0.1, ranks 1 and 2 on
   127.0.0.2: two hosts as the addresses tell). DOPT_PROGRESS_THREAD_US gives the communicator
   its thread (a second one is refused). */
static void rank_says_how_it_started(int rank, void *arg) {
    started *s = (started *)arg;
    char r[16], p[16], want[160];
    captured_log log;
    dopt_launch_config cfg;
    dopt_comm *c = NULL;
    snprintf(r, sizeof r, "%d", rank);
    snprintf(p, sizeof p, "%d", s->port);
    clear_launch_env();
    memset(&log, 0, sizeof log);
    memset(&cfg, 0, sizeof cfg);
    cfg.log_fn = capture_log;
    cfg.log_user = &log;
    setenv("DOPT_TRANSPORT", "tcp", 1);
    setenv("DOPT_TIMEOUT_MS", "30000", 1);
    setenv("DOPT_PROGRESS_THREAD_US", "200", 1);
    setenv("DOPT_BIND_ADDR", rank == 0 ? "127.0.0.1" : "127.0.0.2", 1);
    setenv("RANK", r, 1);
    setenv("WORLD_SIZE", "3", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", p, 1);
    DT_OK(dopt_launch_create(&c, &cfg));
    check_world(c, 3, "tcp");
    DT_CHECKF(strstr(log.text, "I transport tcp; rank and size from RANK, WORLD_SIZE; meeting point from MASTER_ADDR, "
                               "MASTER_PORT\n") != NULL,
              "%s", log.text);
    snprintf(want, sizeof want, "I tcp rank %d of 3: rendezvous at 127.0.0.1:%d, 2 hosts (ranks per host 1,2)\n", rank,
             s->port);
    DT_CHECKF(strstr(log.text, want) != NULL, "expected \"%s\" in\n%s", want, log.text);
    DT_EQ_INT(dopt_comm_set_progress_thread(c, 0), DOPT_ERR_INVALID);
    dopt_comm_destroy(c);
}

DTEST(info_lines_say_the_transport_the_rendezvous_and_the_hosts) {
    started s = {"torchrun", "tcp", "tcp", 3, 0, ""};
    s.port = free_port();
    DT_EQ_INT(dtest_spawn(3, rank_says_how_it_started, &s, 60), 0);
}

/* A start that cannot work fails at once with one line naming the cause. */
DTEST(failed_start_says_why_in_one_line) {
    dopt_comm sentinel, *c = &sentinel;
    captured_log log;
    dopt_launch_config cfg;
    clear_launch_env();
    memset(&log, 0, sizeof log);
    memset(&cfg, 0, sizeof cfg);
    cfg.log_fn = capture_log;
    cfg.log_user = &log;
    setenv("DOPT_TRANSPORT", "mpi", 1);
    DT_EQ_INT(dopt_launch_create(&c, &cfg), DOPT_ERR_INVALID);
    DT_CHECK(c == NULL);
    DT_CHECKF(!strcmp(log.text, "E cannot start the job: transport mpi: this program was built without transport_mpi.h "
                                "(include it before launch.h and build with mpicc)\n"),
              "%s", log.text);
    clear_launch_env();
    memset(&log, 0, sizeof log);
    setenv("OMPI_COMM_WORLD_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    DT_EQ_INT(dopt_launch_create(&c, &cfg), DOPT_ERR_INVALID); /* TCP across hosts, rank 0's host unknown */
    DT_CHECKF(strstr(log.text, "E rank 0's address is unknown: Open MPI's variables put 2 of the 4 ranks on this host")
                  != NULL,
              "%s", log.text);
    DT_EQ_INT(dopt_comm_create_from_env(NULL), DOPT_ERR_INVALID);
}

DTEST_MAIN()
