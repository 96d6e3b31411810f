/* Compile check: every non-MPI header, implementation included, in one translation unit.
   Built three ways by the Makefile: as C11 beside a second unit that only includes the headers
   (compile_check_main.c), as C++, and with DOPT_CHECK_STATIC, where a host has done
   "#define inline" (kann does under -std=c11) and wants everything static. */
#ifdef DOPT_CHECK_STATIC
#define inline
#define DISTOPT_STATIC
#endif
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../engine.h"
#include "../transport_shm.h"
#include "../clip.h"
#include "../compress.h"
#include "../localsgd.h"
#include "../transport_tcp.h"
#include "../launch.h"

#ifdef DOPT_CHECK_STATIC
int main(void) {
    dopt_comm *c;
    float x[3] = {1, 2, 3};
    if (dopt_comm_create_self(&c) != DOPT_OK) return 1;
    if (dopt_allreduce(c, x, 3, DOPT_F32, DOPT_MEAN) != DOPT_OK) return 1;
    dopt_comm_destroy(c);
    return dopt_sumsq(x, 3) == 14.0 ? 0 : 1;
}
#endif
