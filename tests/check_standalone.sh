#!/bin/sh
# Every header, implementation included, compiles on its own as the first include of a file under
# strict ISO C11 and C++11 with -Wall -Wextra -Wpedantic -Werror and no feature macro on the
# command line (the headers that need POSIX ask for it themselves), and the C11 program links
# without any BLAS (a host that links none needs nothing). transport_mpi.h goes through mpicc.
# Usage: tests/check_standalone.sh BUILD_DIR
set -eu
BUILD=${1:-build}
cd "$(dirname "$0")/.."
mkdir -p "$BUILD"
status=0
for h in distopt.h transport_*.h clip.h compress.h localsgd.h launch.h; do
    [ -f "$h" ] || continue
    src="$BUILD/standalone_$(basename "$h" .h).c"
    printf '#define DISTOPT_IMPLEMENTATION\n#include "../%s"\nint main(void) { return 0; }\n' "$h" > "$src"
    cc=cc; cxx=c++
    [ "$h" = transport_mpi.h ] && cc=mpicc && cxx=mpicxx
    # shellcheck disable=SC2086
    if ! $cc -std=c11 -Wall -Wextra -Wpedantic -Werror "$src" -o "$src.exe" -lm -lpthread -lrt 2>"$src.err"; then
        echo "$h does not compile and link alone as C11 (no BLAS):"; head -5 "$src.err"; status=1
    fi
    # shellcheck disable=SC2086
    if ! $cxx -std=c++11 -x c++ -Wall -Wextra -Wpedantic -Werror -c "$src" -o "$src.o" 2>"$src.err"; then
        echo "$h does not compile alone as C++11:"; head -5 "$src.err"; status=1
    fi
done
exit $status
