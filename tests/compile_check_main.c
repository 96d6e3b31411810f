/* The second translation unit of the link check: declarations only, no implementation macro. */
#include "../distopt.h"
#include "../engine.h"
#include "../transport_shm.h"
#include "../clip.h"
#include "../compress.h"
#include "../localsgd.h"
#include "../transport_tcp.h"
#include "../launch.h"

int main(void) {
    dopt_comm *c;
    float x[3] = {1, 2, 3};
    if (dopt_comm_create_self(&c) != DOPT_OK) return 1;
    if (dopt_allreduce(c, x, 3, DOPT_F32, DOPT_MEAN) != DOPT_OK) return 1;
    dopt_comm_destroy(c);
    return dopt_sumsq(x, 3) == 14.0 ? 0 : 1;
}
