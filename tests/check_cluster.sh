#!/bin/sh
# A job across simulated hosts: scripts/cluster.sh makes 2 network namespaces joined through a
# bridge with 1 Gbit/s links; least_squares runs one rank on each over TCP, started from DOPT_*
# variables, and must reach its optimum. Twice: over IPv4 (DOPT_MASTER_ADDR and DOPT_MASTER_PORT),
# then on a cluster with IPv6 only (DOPT_MASTER_ADDR=[addr]:port, each rank listening on its eth0
# through DOPT_SOCKET_IFNAME); then the cluster is removed and nothing of it is left.
# Needs root (skipped otherwise, exit 77). Usage: tests/check_cluster.sh BUILD_DIR
set -u
BUILD=${1:-build}
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then echo "skipped: needs root"; exit 77; fi
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    echo "skipped: needs iproute2's ip and tc"
    exit 77
fi
DOPT_CLUSTER=ck$$
export DOPT_CLUSTER
trap 'scripts/cluster.sh down' EXIT
make --no-print-directory -s BUILD="$BUILD" "$BUILD/least_squares" >/dev/null || { echo "FAIL: cannot build least_squares"; exit 1; }
port=$((20000 + $$ % 20000))
run() { # $1: host = rank, then the variables that say where rank 0 is
    host=$1
    shift
    scripts/cluster.sh exec "$host" env DOPT_RANK="$host" DOPT_WORLD_SIZE=2 "$@" \
        DOPT_TOKEN="check-cluster-$$" DOPT_TIMEOUT_MS=60000 \
        "$BUILD/least_squares" --transport tcp --steps 3000 --seed 7
}
job() { # $1: v4 or v6, then cluster.sh up's options
    family=$1
    shift
    scripts/cluster.sh up 2 --rate 1gbit "$@" || { echo "FAIL: cluster.sh up $*"; exit 1; }
    master=$(scripts/cluster.sh addr 0)
    if [ "$family" = v6 ]; then
        set -- DOPT_MASTER_ADDR="[$master]:$port" DOPT_SOCKET_IFNAME=eth0
    else
        set -- DOPT_MASTER_ADDR="$master" DOPT_MASTER_PORT=$port
    fi
    run 1 "$@" >"$BUILD/check_cluster.rank1.log" 2>&1 &
    peer=$!
    status=0
    run 0 "$@" >"$BUILD/check_cluster.rank0.log" 2>&1 || status=$?
    wait "$peer" || status=$?
    if [ "$status" -ne 0 ] || ! grep -q "converged" "$BUILD/check_cluster.rank0.log"; then
        echo "FAIL: least_squares across 2 hosts over $family (exit $status)"
        tail -n 3 "$BUILD/check_cluster.rank0.log" "$BUILD/check_cluster.rank1.log"
        exit 1
    fi
    echo "ok   least_squares over TCP ($family) between hosts $master and $(scripts/cluster.sh addr 1): $(tail -n 1 "$BUILD/check_cluster.rank0.log")"
}
job v4
job v6 --no-ipv4
scripts/cluster.sh down
trap - EXIT
if ip netns list | grep -q "^$DOPT_CLUSTER-"; then echo "FAIL: cluster.sh down left namespaces"; exit 1; fi
if ip link show "$DOPT_CLUSTER-br" >/dev/null 2>&1; then echo "FAIL: cluster.sh down left the bridge"; exit 1; fi
exit 0
