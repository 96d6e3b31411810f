#!/bin/sh
# Jobs across simulated hosts: scripts/cluster.sh makes 4 network namespaces joined through a
# bridge with 1 Gbit/s links; least_squares runs 2 ranks on each (8 ranks) over TCP, started by
# the one call of launch.h from DOPT_* variables and from torchrun's (RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Each run must converge to the same
# point as the reference: the same 8 ranks forked over shared memory on one host (the same
# arithmetic in the same order gives the same printed result). Then the cluster is removed and
# nothing of it is left. Needs root (skipped otherwise, exit 77). Usage: tests/check_cluster.sh BUILD
set -u
BUILD=${1:-build}
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then echo "skipped: needs root"; exit 77; fi
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    echo "skipped: needs iproute2's ip and tc"
    exit 77
fi
HOSTS=4
PER_HOST=2
N=$((HOSTS * PER_HOST))
DOPT_CLUSTER=ck$$
export DOPT_CLUSTER
LOGS=$BUILD/logs.check_cluster
trap 'scripts/cluster.sh down' EXIT
make --no-print-directory -s BUILD="$BUILD" "$BUILD/least_squares" >/dev/null || { echo "FAIL: cannot build least_squares"; exit 1; }
rm -rf "$LOGS" && mkdir -p "$LOGS"
scripts/cluster.sh up $HOSTS --rate 1gbit >"$LOGS/up.log" 2>&1 || { echo "FAIL: cluster.sh up"; cat "$LOGS/up.log"; exit 1; }
master=$(scripts/cluster.sh addr 0)
ARGS="--steps 3000 --seed 7"
# the result line without the transport's name
result() { sed -n 's/^least_squares: [a-z]*, //p' "$1"; }

"$BUILD/least_squares" --workers $N $ARGS >"$LOGS/reference.log" 2>&1 || { echo "FAIL: the reference run"; cat "$LOGS/reference.log"; exit 1; }
want=$(result "$LOGS/reference.log")

# $1: name, $2: port, then a function that prints rank $r's variables
job() {
    name=$1 port=$2 vars=$3
    pids=""
    r=$N
    while [ $r -gt 0 ]; do # rank 0 last: the others wait for it
        r=$((r - 1))
        h=$((r / PER_HOST))
        # shellcheck disable=SC2046
        scripts/cluster.sh exec $h env $($vars $r $h $port) DOPT_TOKEN="$name-$$" DOPT_TIMEOUT_MS=60000 \
            DOPT_RENDEZVOUS_TIMEOUT_MS=60000 "$BUILD/least_squares" $ARGS >"$LOGS/$name.r$r.log" 2>&1 &
        pids="$pids $!"
    done
    status=0
    for p in $pids; do wait "$p" || status=1; done
    got=$(result "$LOGS/$name.r0.log")
    if [ $status -ne 0 ] || [ -z "$got" ] || [ "$got" != "$want" ] || ! grep -q "^least_squares: tcp, $N rank" "$LOGS/$name.r0.log"; then
        echo "FAIL: $name: 8 ranks on 4 hosts (exit status $status)"
        echo "  want: $want"
        echo "  got:  $got"
        tail -n 3 "$LOGS/$name".r*.log
        exit 1
    fi
    echo "ok   $name: $N ranks on $HOSTS hosts ($master ... $(scripts/cluster.sh addr $((HOSTS - 1)))) over TCP match $N forked ranks: $got"
}
dopt_vars() { echo DOPT_RANK=$1 DOPT_WORLD_SIZE=$N DOPT_MASTER_ADDR=$master DOPT_MASTER_PORT=$3; }
torchrun_vars() {
    echo RANK=$1 WORLD_SIZE=$N LOCAL_RANK=$(($1 % PER_HOST)) LOCAL_WORLD_SIZE=$PER_HOST MASTER_ADDR=$master MASTER_PORT=$3
}
port=$((20000 + $$ % 10000))
job dopt-variables $port dopt_vars
job torchrun-variables $((port + 1)) torchrun_vars

scripts/cluster.sh down
trap - EXIT
if ip netns list | grep -q "^$DOPT_CLUSTER-"; then echo "FAIL: cluster.sh down left namespaces"; exit 1; fi
if ip link show "$DOPT_CLUSTER-br" >/dev/null 2>&1; then echo "FAIL: cluster.sh down left the bridge"; exit 1; fi
exit 0
