/* Built with -fopenmp (the Makefile's own rule): ranks that share a host warn once when
   OMP_NUM_THREADS is unset — an OpenMP host would start a thread per core in every rank — and
   say nothing when it is set. */
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_shm.h"
#include "dtest.h"

#ifndef _OPENMP
#error "test_openmp.c is built with -fopenmp"
#endif

static int warnings;
static char last[512];

static void count_thread_warnings(void *user, dopt_log_level level, const char *msg) {
    (void)user;
    if (level == DOPT_LOG_WARN && strstr(msg, "OMP_NUM_THREADS is unset")) {
        warnings++;
        snprintf(last, sizeof last, "%s", msg);
    }
}

/* Two forked ranks; rank 0 reports how many warnings it heard in its exit status. */
static int warnings_heard_by_rank_0(void) {
    dopt_comm *c;
    dopt_shm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.log_fn = count_thread_warnings;
    warnings = 0;
    DT_OK(dopt_shm_fork(&c, 2, &cfg));
    DT_EQ_INT(c->local_ranks, 2);
    if (c->rank != 0) {
        dopt_comm_finish(c, warnings); /* does not return */
    }
    DT_EQ_INT(dopt_comm_finish(c, 0), 0);
    return warnings;
}

DTEST(ranks_sharing_a_host_warn_once_when_omp_num_threads_is_unset) {
    unsetenv("OMP_NUM_THREADS");
    DT_EQ_INT(warnings_heard_by_rank_0(), 1);
    DT_CHECKF(strstr(last, "2 ranks share this host's") && strstr(last, "set OMP_NUM_THREADS="), "%s", last);
}

DTEST(nothing_is_said_when_omp_num_threads_is_set) {
    setenv("OMP_NUM_THREADS", "1", 1);
    DT_EQ_INT(warnings_heard_by_rank_0(), 0);
}

DTEST_MAIN()
