#!/bin/sh
# Open MPI across simulated hosts: scripts/cluster.sh makes 4 hosts with 1 Gbit/s links, and its
# mpirun (from host 0, daemons started through scripts/netns-rsh) runs build/test_mpi, the MPI
# backend's conformance suite, with 2 ranks per host (8 ranks); it must pass, and every host's
# link must have carried at least 16 MiB of it (tc's counter on the host's eth0): ranks of
# different hosts talked over TCP across the shaped links, as they cannot over shared memory.
# Then the cluster is removed. Needs root (skipped otherwise, exit 77).
#
# Then least_squares over distopt's TCP transport with its 8 ranks started by the same mpirun
# (rank and world size from Open MPI's variables through launch.h's one call, rank 0's address
# and port from DOPT_*): it must print what the same 8 ranks forked on one host print.
# More under the same mpirun: run_under_mpirun NAME REGEX MIN_BYTES [MPIRUN_ARGS] CMD ... below.
# Usage: tests/check_cluster_mpi.sh BUILD_DIR
set -u
BUILD=${1:-build}
cd "$(dirname "$0")/.." || exit 1
if [ "$(id -u)" -ne 0 ]; then echo "skipped: needs root"; exit 77; fi
for tool in ip tc mpirun unshare; do
    command -v "$tool" >/dev/null 2>&1 || { echo "skipped: needs $tool"; exit 77; }
done
DOPT_CLUSTER=cm$$
export DOPT_CLUSTER
HOSTS=4
PER_HOST=2
trap 'scripts/cluster.sh down' EXIT
trap 'exit 1' INT TERM
make --no-print-directory -s BUILD="$BUILD" "$BUILD/test_mpi" "$BUILD/least_squares" >/dev/null ||
    { echo "FAIL: cannot build test_mpi and least_squares"; exit 1; }
scripts/cluster.sh up $HOSTS --rate 1gbit || { echo "FAIL: cluster.sh up"; exit 1; }
BUILD_ABS=$(cd "$BUILD" && pwd)

sent() { # bytes host $1's eth0 has sent (tc's counter of its root qdisc)
    ip netns exec "$DOPT_CLUSTER-h$1" tc -s qdisc show dev eth0 | awk '$1 == "Sent" { print $2; exit }'
}

# run_under_mpirun NAME REGEX MIN_BYTES [MPIRUN_ARGS] CMD ...: CMD with PER_HOST ranks on every
# host; passes when mpirun exits 0, the ranks' output (all of it, through mpirun) matches REGEX
# and every host's link carried at least MIN_BYTES.
failed=0
run_under_mpirun() {
    name=$1 regex=$2 min_bytes=$3
    shift 3
    log="$BUILD/check_cluster_mpi.$name.log"
    before=""
    for h in $(seq 0 $((HOSTS - 1))); do before="$before $(sent "$h")"; done
    status=0
    timeout 900 scripts/cluster.sh mpirun $PER_HOST "$@" >"$log" 2>&1 || status=$?
    short=""
    h=0
    for b in $before; do
        moved=$(($(sent $h) - b))
        [ "$moved" -ge "$min_bytes" ] || short="$short host $h sent $moved bytes;"
        h=$((h + 1))
    done
    if [ "$status" -ne 0 ] || ! grep -Eq "$regex" "$log" || [ -n "$short" ]; then
        echo "FAIL $name under mpirun across $HOSTS hosts (exit $status)${short:+:$short}"
        tail -n 20 "$log"
        failed=1
        return
    fi
    echo "ok   $name: $((HOSTS * PER_HOST)) ranks on $HOSTS hosts: $(grep -E "$regex" "$log" | head -n 1)"
}

rm -rf "$BUILD"/check_cluster_mpi.*
run_under_mpirun test_mpi '^dtest-summary .* failed=0( |$)' $((16 << 20)) "$BUILD_ABS/test_mpi"
"$BUILD/least_squares" --workers $((HOSTS * PER_HOST)) --steps 3000 --seed 7 >"$BUILD/check_cluster_mpi.reference.log" 2>&1
want=$(sed -n 's/^least_squares: [a-z]*, //p' "$BUILD/check_cluster_mpi.reference.log")
run_under_mpirun least_squares_tcp "^least_squares: tcp, $((HOSTS * PER_HOST)) rank.*; converged$" $((64 << 10)) \
    -x DOPT_TRANSPORT=tcp -x DOPT_MASTER_ADDR="$(scripts/cluster.sh addr 0)" -x DOPT_MASTER_PORT=$((20000 + $$ % 20000)) \
    "$BUILD_ABS/least_squares" --steps 3000 --seed 7
got=$(sed -n 's/^least_squares: tcp, //p' "$BUILD/check_cluster_mpi.least_squares_tcp.log")
if [ -z "$want" ] || [ "$got" != "$want" ]; then
    echo "FAIL least_squares_tcp under mpirun does not match the same ranks forked on one host"
    echo "  want: $want"
    echo "  got:  $got"
    failed=1
fi
exit $failed
