#!/bin/sh
# Jobs across simulated hosts: scripts/cluster.sh makes 4 network namespaces joined through a
# bridge with 1 Gbit/s links; least_squares runs 2 ranks on each (8 ranks) over TCP, started by
# the one call of launch.h:
#   - from DOPT_* variables, and from torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
#     MASTER_ADDR, MASTER_PORT);
#   - with DOPT_SOCKET_IFNAME=eth1 choosing each host's second network (--second-net) for the
#     ranks' own connections: it must carry their traffic, which the runs above leave on eth0;
#   - on hosts with IPv6 only, rank 0 named as DOPT_MASTER_ADDR=[addr]:port.
# Each run must print what the same 8 ranks forked over shared memory on one host print (the same
# arithmetic in the same order). Then tests/cluster_allreduce.c checks the host-aware allreduce
# there: conformance, the flat ring's bits and the serial sum, less sent over every host's link. Then the cluster is removed and nothing of it is left. Needs
# root (skipped otherwise, exit 77). Usage: tests/check_cluster.sh BUILD_DIR
set -u
BUILD=${1:-build}
cd "$(dirname "$0")/.." || exit 1
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
ARGS="--steps 3000 --seed 7"
result() { sed -n 's/^least_squares: [a-z]*, //p' "$1"; } # the result line without the transport's name
"$BUILD/least_squares" --workers $N $ARGS >"$LOGS/reference.log" 2>&1 || { echo "FAIL: the reference run"; cat "$LOGS/reference.log"; exit 1; }
want=$(result "$LOGS/reference.log")

tx() { ip -n "$DOPT_CLUSTER-h$1" -s link show dev "$2" | awk 'f { print $1; exit } /TX:/ { f = 1 }'; } # bytes sent

# job NAME VARS_FUNCTION: the 8 ranks, rank r on host r / PER_HOST with VARS_FUNCTION r's variables
job() {
    name=$1 vars=$2
    pids=""
    r=$N
    while [ $r -gt 0 ]; do # rank 0 last: the others wait for it
        r=$((r - 1))
        # shellcheck disable=SC2046
        scripts/cluster.sh exec $((r / PER_HOST)) env $($vars $r) DOPT_TOKEN="$name-$$" DOPT_TIMEOUT_MS=60000 \
            DOPT_RENDEZVOUS_TIMEOUT_MS=60000 "$BUILD/least_squares" $ARGS >"$LOGS/$name.r$r.log" 2>&1 &
        pids="$pids $!"
    done
    status=0
    for p in $pids; do wait "$p" || status=1; done
    got=$(result "$LOGS/$name.r0.log")
    if [ $status -ne 0 ] || [ -z "$got" ] || [ "$got" != "$want" ] || ! grep -q "^least_squares: tcp, $N rank" "$LOGS/$name.r0.log"; then
        echo "FAIL: $name: $N ranks on $HOSTS hosts (exit status $status)"
        echo "  want: $want"
        echo "  got:  $got"
        tail -n 3 "$LOGS/$name".r*.log
        exit 1
    fi
    echo "ok   $name: $N ranks on $HOSTS hosts over TCP print what $N forked ranks print: $got"
}

scripts/cluster.sh up $HOSTS --rate 1gbit --second-net >"$LOGS/up.log" 2>&1 || { echo "FAIL: cluster.sh up"; cat "$LOGS/up.log"; exit 1; }
master=$(scripts/cluster.sh addr 0)
port=$((20000 + $$ % 10000))
dopt_vars() { echo DOPT_RANK=$1 DOPT_WORLD_SIZE=$N DOPT_MASTER_ADDR=$master DOPT_MASTER_PORT=$port; }
torchrun_vars() {
    echo RANK=$1 WORLD_SIZE=$N LOCAL_RANK=$(($1 % PER_HOST)) LOCAL_WORLD_SIZE=$PER_HOST MASTER_ADDR=$master MASTER_PORT=$port
}
ifname_vars() { echo "$(dopt_vars "$1")" DOPT_SOCKET_IFNAME=eth1; }
before=$(tx 2 eth1)
job dopt-variables dopt_vars
port=$((port + 1))
job torchrun-variables torchrun_vars
idle=$(($(tx 2 eth1) - before))

# the host-aware allreduce: conformance over the cluster, the same bits as the flat ring and the
# serial sum, and less sent over each host's link (4 hosts x 2: 1.5 x the buffer per host, the
# flat ring 1.75 x)
make --no-print-directory -s BUILD="$BUILD" "$BUILD/cluster_allreduce" >/dev/null || { echo "FAIL: cannot build cluster_allreduce"; exit 1; }
port=$((port + 1))
pids=""
r=$N
while [ $r -gt 0 ]; do
    r=$((r - 1))
    # shellcheck disable=SC2046
    scripts/cluster.sh exec $((r / PER_HOST)) env $(dopt_vars $r) DOPT_TOKEN="two-level-$$" DOPT_TIMEOUT_MS=60000 \
        DOPT_RENDEZVOUS_TIMEOUT_MS=60000 "$BUILD/cluster_allreduce" >"$LOGS/two-level.r$r.log" 2>&1 &
    pids="$pids $!"
done
status=0
for p in $pids; do wait "$p" || status=1; done
if [ $status -ne 0 ] || [ "$(cat "$LOGS"/two-level.r*.log | grep -c '^cluster_allreduce: rank [0-9]* ok$')" -ne $N ]; then
    echo "FAIL: two-level allreduce on $HOSTS hosts x $PER_HOST (exit status $status)"
    tail -n 5 "$LOGS"/two-level.r*.log
    exit 1
fi
if ! awk '
    /^cluster_allreduce: host tx / {
        for (i = 4; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
        hosts++
        if (!(f["two_level"] < 0.95 * f["flat"] && f["two_level"] > 1.3 * f["bytes"])) bad++
        printf "     %s: the host sent two_level=%d flat=%d bytes for %d (ratio %.3f)\n", FILENAME, f["two_level"], f["flat"], f["bytes"], f["two_level"] / f["flat"]
    }
    END { exit !(hosts == '"$HOSTS"' && bad == 0) }' "$LOGS"/two-level.r*.log >"$LOGS/two-level.tx"; then
    echo "FAIL: two-level allreduce: a host link did not carry less than under the flat ring"
    cat "$LOGS/two-level.tx"
    exit 1
fi
echo "ok   two-level allreduce: $N ranks on $HOSTS hosts pass conformance (and so do the host groups and a group across hosts), equal the flat ring and the serial sum bit for bit, sum TernGrad's codes and majority's signs by host into the allgather's bits, and send less per host link:"
cat "$LOGS/two-level.tx"
port=$((port + 1))
before=$(tx 2 eth1)
job socket-ifname-eth1 ifname_vars
moved=$(($(tx 2 eth1) - before))
# host 2's ranks (4 and 5) talk to rank 0 over eth0 (its address is DOPT_MASTER_ADDR) and to
# every other rank over the network DOPT_SOCKET_IFNAME chose
if [ "$moved" -lt 65536 ] || [ "$idle" -ge 65536 ]; then
    echo "FAIL: socket-ifname-eth1: host 2 sent $moved bytes on eth1 with DOPT_SOCKET_IFNAME=eth1, $idle without"
    exit 1
fi
echo "ok   socket-ifname-eth1: host 2 sent $moved bytes on eth1 with DOPT_SOCKET_IFNAME=eth1, $idle in the two runs without"
scripts/cluster.sh down >/dev/null

scripts/cluster.sh up $HOSTS --rate 1gbit --no-ipv4 >"$LOGS/up6.log" 2>&1 || { echo "FAIL: cluster.sh up --no-ipv4"; cat "$LOGS/up6.log"; exit 1; }
master=$(scripts/cluster.sh addr 0)
port=$((port + 1))
ipv6_vars() { echo DOPT_RANK=$1 DOPT_WORLD_SIZE=$N DOPT_MASTER_ADDR="[$master]:$port"; }
job ipv6-only ipv6_vars

scripts/cluster.sh down
trap - EXIT
if ip netns list | grep -q "^$DOPT_CLUSTER-"; then echo "FAIL: cluster.sh down left namespaces"; exit 1; fi
if ip link show "$DOPT_CLUSTER-br" >/dev/null 2>&1; then echo "FAIL: cluster.sh down left the bridge"; exit 1; fi
exit 0
