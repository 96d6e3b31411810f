#!/bin/sh
# A host that goes silent (transport_tcp.h: KEEP-ALIVE). On 3 simulated hosts, one rank of
# tests/silent_host.c on each; once all are ready, host 2's link is cut and its rank killed, so
# that nothing (no FIN, no RST) ever tells the others. First, while the survivors wait in
# allreduce #2 for rank 2 (alive, in no collective), distopt-inspect run on host 0 must name rank
# 2 at #2 from the flight recorder files of all three hosts. Then three jobs:
#   idle       the survivors stay idle 6 s, then allreduce: with keep-alive (default, 1 s) the
#              kernel has ended the links to the silent host meanwhile, and the allreduce fails
#              with DOPT_ERR_PEER_LOST naming rank 2 (the timeout is 60 s: waiting for it would be
#              DOPT_ERR_TIMEOUT);
#   waiting    the survivors are inside a 1 MiB allreduce when the host goes silent: PEER_LOST
#              naming rank 2 on both, long before the 60 s timeout would say TIMEOUT;
#   off        as idle with DOPT_KEEPALIVE_S=-1 and a timeout of 4 s: DOPT_ERR_TIMEOUT, which
#              shows what the first two would have been without keep-alive;
#   hb-idle    as idle with DOPT_DEAD_AFTER_MS=1000 (HEARTBEAT) and 2 s of idleness: each survivor's
#              heartbeat thread gives up on rank 2 while idle (its line is checked and timed), and
#              the allreduce after it fails with PEER_LOST at once (keep-alive alone would need 4 s);
#   hb-waiting as waiting with DOPT_DEAD_AFTER_MS=1000: PEER_LOST on both, the heartbeat's line on
#              both.
# Statuses are checked, not times; the times are printed (docs: transport_tcp.h KEEP-ALIVE).
# Needs root (skipped otherwise, exit 77). Usage: tests/check_keepalive.sh BUILD_DIR
set -u
BUILD=${1:-build}
cd "$(dirname "$0")/.." || exit 1
if [ "$(id -u)" -ne 0 ]; then echo "skipped: needs root"; exit 77; fi
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    echo "skipped: needs iproute2's ip and tc"
    exit 77
fi
make --no-print-directory -s BUILD="$BUILD" "$BUILD/silent_host" >/dev/null || { echo "FAIL: cannot build silent_host"; exit 1; }
N=3
SILENT=2
DOPT_CLUSTER=ka$$
export DOPT_CLUSTER
LOGS=$BUILD/logs.check_keepalive
trap 'scripts/cluster.sh down' EXIT
rm -rf "$LOGS" && mkdir -p "$LOGS"
scripts/cluster.sh up $N --rate 1gbit >"$LOGS/up.log" 2>&1 || { echo "FAIL: cluster.sh up"; cat "$LOGS/up.log"; exit 1; }
MASTER=$(scripts/cluster.sh addr 0)
now_ms() { date +%s%3N; }

# job NAME TIMEOUT_MS KEEPALIVE MODE ARGS...: starts the ranks, silences host 2 once all are ready,
# waits for the survivors (killed after 120 s), and leaves their lines in $LOGS/NAME.rR.log
job() {
    name=$1 timeout=$2 keepalive=$3
    shift 3
    pids=""
    r=$N
    while [ $r -gt 0 ]; do # rank 0 last: the others wait for it
        r=$((r - 1))
        timeout -s KILL 120 scripts/cluster.sh exec $r env DOPT_RANK=$r DOPT_WORLD_SIZE=$N DOPT_MASTER_ADDR="$MASTER" \
            DOPT_MASTER_PORT=29610 DOPT_TOKEN="ka-$name-$$" DOPT_TIMEOUT_MS="$timeout" DOPT_KEEPALIVE_S="$keepalive" \
            DOPT_DEAD_AFTER_MS="${DEAD_AFTER:-0}" \
            DOPT_SILENT_RANK=$SILENT DOPT_RECORDER_DIR="$REC_DIR" "$BUILD/silent_host" "$@" >"$LOGS/$name.r$r.log" 2>&1 &
        [ $r -ne $SILENT ] && pids="$pids $!"
    done
    waited=0
    while [ "$(cat "$LOGS/$name".r*.log | grep -c ': ready$')" -lt $N ]; do
        sleep 0.1
        waited=$((waited + 1))
        if [ $waited -gt 600 ]; then
            echo "FAIL: $name: the ranks were not all ready within 60 s"
            tail -n 5 "$LOGS/$name".r*.log
            ip netns pids "$DOPT_CLUSTER-h0" "$DOPT_CLUSTER-h1" "$DOPT_CLUSTER-h2" 2>/dev/null | xargs -r kill -9
            exit 1
        fi
    done
    [ -n "$BEFORE_CUT" ] && $BEFORE_CUT
    ip -n "$DOPT_CLUSTER-h$SILENT" link set eth0 down # nothing leaves host 2 any more ...
    cut=$(now_ms)
    ip netns pids "$DOPT_CLUSTER-h$SILENT" | xargs -r kill -9 # ... not even its rank's death
    for p in $pids; do wait "$p"; done # each killed after 120 s at most (timeout above)
    ip -n "$DOPT_CLUSTER-h$SILENT" link set eth0 up
}

# expect NAME STATUS_NAME WORDS: every survivor's line has the status, names rank 2 and says WORDS;
# prints the times
expect() {
    name=$1 want=$2 words=$3
    r=0
    while [ $r -lt $N ]; do
        if [ $r -ne $SILENT ]; then
            line=$(grep '^silent_host: rank .*: status' "$LOGS/$name.r$r.log")
            detail=$(echo "$line" | sed 's/.* ms at [0-9]*: //')
            case "$line|$detail" in
            *"($want) after "*"|"*"rank $SILENT"*) ;;
            *) line="$line (the detail does not name rank $SILENT)" ;;
            esac
            case $line in
            *"($want) after "*"$words"*) ;;
            *)
                echo "FAIL: $name: rank $r: want status \"$want\" naming rank $SILENT, saying \"$words\"; got: ${line:-nothing}"
                tail -n 5 "$LOGS/$name.r$r.log"
                exit 1 ;;
            esac
            ms=$(echo "$line" | sed 's/.* after \([0-9]*\) ms.*/\1/')
            at=$(echo "$line" | sed 's/.* ms at \([0-9]*\):.*/\1/')
            echo "ok   $name: rank $r: $want after $ms ms in the allreduce, $((at - cut)) ms after the cut: $detail"
        fi
        r=$((r + 1))
    done
}

# heard NAME: every survivor printed the heartbeat's verdict on rank 2; prints when, after the cut
heard() {
    name=$1
    r=0
    while [ $r -lt $N ]; do
        if [ $r -ne $SILENT ]; then
            line=$(grep '^silent_host: rank .*: heard at ' "$LOGS/$name.r$r.log" | head -n 1)
            case $line in
            *"rank $SILENT not heard from"*) ;;
            *)
                echo "FAIL: $name: rank $r: no heartbeat verdict on rank $SILENT; got: ${line:-nothing}"
                tail -n 5 "$LOGS/$name.r$r.log"
                exit 1 ;;
            esac
            at=$(echo "$line" | sed 's/.* heard at \([0-9]*\):.*/\1/')
            echo "ok   $name: rank $r: heartbeat gave up on rank $SILENT $((at - cut)) ms after the cut"
        fi
        r=$((r + 1))
    done
}

# While the survivors wait in allreduce #2 for rank 2 (alive on its host, in no collective),
# distopt-inspect, run on host 0, must name it from the flight recorder files of all three hosts.
inspect_hang() {
    sleep 1
    scripts/cluster.sh exec 0 "$BUILD/distopt-inspect" --dir "$REC_DIR" >"$LOGS/hang.inspect" 2>&1
    culprit=$(grep '^culprit ' "$LOGS/hang.inspect")
    case $culprit in
    "culprit rank=$SILENT seq=2 "*) echo "ok   hang: distopt-inspect on host 0 names rank $SILENT on host $SILENT: $culprit" ;;
    *)
        echo "FAIL: hang: distopt-inspect did not name rank $SILENT at #2:"
        cat "$LOGS/hang.inspect"
        ip netns pids "$DOPT_CLUSTER-h0" "$DOPT_CLUSTER-h1" "$DOPT_CLUSTER-h2" 2>/dev/null | xargs -r kill -9
        exit 1 ;;
    esac
}
BEFORE_CUT=inspect_hang
REC_DIR=$LOGS/recorder # this job's files alone
mkdir -p "$REC_DIR"
job hang 60000 1 waiting
BEFORE_CUT=
REC_DIR=${DOPT_RECORDER_DIR:-/dev/shm}
job idle 60000 1 idle 6000
expect idle "peer lost" "Connection timed out"
job waiting 60000 1 waiting
expect waiting "peer lost" "Connection timed out"
job off 4000 -1 idle 6000
expect off "timed out" "no progress for 4000 ms"
DEAD_AFTER=1000
job hb-idle 60000 1 idle 2000
heard hb-idle
expect hb-idle "peer lost" "Connection timed out"
job hb-waiting 60000 1 waiting
heard hb-waiting
expect hb-waiting "peer lost" "Connection timed out"
exit 0
