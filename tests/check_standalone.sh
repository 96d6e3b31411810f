#!/bin/sh
# Every header, implementation included, compiles on its own as the first include of a file under
# strict ISO C11 and C++11 with -Wall -Wextra -Wpedantic -Werror and no feature macro on the
# command line (the headers that need POSIX ask for it themselves), and the C11 program links
# without any BLAS (a host that links none needs nothing). transport_mpi.h goes through mpicc.
# Then the combinations a program without links includes, in one translation unit: engine.h
# after distopt.h, and the training modules without any transport (so without engine.h).
# Usage: tests/check_standalone.sh BUILD_DIR
set -eu
BUILD=${1:-build}
cd "$(dirname "$0")/.."
mkdir -p "$BUILD"
status=0
for h in distopt.h engine.h transport_*.h clip.h compress.h localsgd.h launch.h; do
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
# "a b c": the headers in that order; the training modules need POSIX (-D_GNU_SOURCE, as their
# manuals say) when distopt.h comes first.
for combo in "distopt.h engine.h" "distopt.h clip.h compress.h localsgd.h"; do
    name=$(echo "$combo" | tr ' ' '+')
    src="$BUILD/standalone_$(echo "$combo" | tr ' .' '__').c"
    { echo '#define DISTOPT_IMPLEMENTATION'; for h in $combo; do echo "#include \"../$h\""; done
      echo 'int main(void) { dopt_comm *c; if (dopt_comm_create_self(&c) != DOPT_OK) return 1; dopt_comm_destroy(c); return 0; }'; } > "$src"
    if ! cc -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wpedantic -Werror "$src" -o "$src.exe" -lm -lpthread -lrt 2>"$src.err" ||
        ! "$src.exe"; then
        echo "$name does not compile, link and run as C11:"; head -5 "$src.err"; status=1
    fi
    if ! c++ -std=c++11 -x c++ -D_GNU_SOURCE -Wall -Wextra -Wpedantic -Werror -c "$src" -o "$src.o" 2>"$src.err"; then
        echo "$name does not compile as C++11:"; head -5 "$src.err"; status=1
    fi
done
exit $status
