/* Compile check for transport_mpi.h, which needs the MPI compiler wrappers: built as C11 with
   mpicc and as C++11 with mpicxx, and with DOPT_CHECK_STATIC after "#define inline". Running it
   does not start MPI. */
#ifdef DOPT_CHECK_STATIC
#define inline
#define DISTOPT_STATIC
#endif
#define DISTOPT_IMPLEMENTATION
#include "../distopt.h"
#include "../transport_mpi.h"
#include "../launch.h"

int main(void) {
    dopt_mpi_config cfg;
    memset(&cfg, 0, sizeof cfg);
    return cfg.check; /* 0 */
}
