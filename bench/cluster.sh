#!/bin/sh
# Allreduce across simulated hosts: scripts/cluster.sh makes H = 4 hosts whose links are shaped
# to 1 Gbit/s (and delayed 0.5 ms where the kernel has netem), 2 ranks on each (N = 8 ranks), and
# times an f32 sum allreduce in place of 64 KiB, 1 MiB, 16 MiB and 64 MiB (build/bench_allreduce:
# a warm-up, then the median of 9 repetitions of at least 20 ms each, the slowest rank's time):
#   dopt-tcp     distopt's TCP transport, its 8 processes started one by one on their hosts with
#                `cluster.sh exec HOST env DOPT_RANK=... bench_allreduce --from-env`; ranks of
#                one host talk over loopback, of different hosts over the links; large
#                allreduces take the host-aware (two-level) schedule
#   dopt-tcp-flat the same with DOPT_TWO_LEVEL=off: one ring through all 8 ranks
#   mpi-raw-tcp  MPI_Allreduce of Open MPI started by `cluster.sh mpirun 2` (daemons reached
#                through scripts/netns-rsh); ranks of one host use shared memory, of different
#                hosts TCP over the links
# One line per backend and size:
#   bench cluster hosts=4 ranks=8 backend=B bytes=n us=t busbw_GBps=x link_ratio=r us_min=.. us_max=..
# us: microseconds per call (median); us_min, us_max: the fastest and slowest repetition;
#   busbw      = 2·(N−1)/N · bytes / time                  (GB/s; N ranks)
#   link_ratio = bound / time, bound = 2·(H−1)/H · bytes / R
# with R the shaped rate of a host's link in bytes/s (1 Gbit/s = 125e6 B/s): the time a
# bandwidth-optimal allreduce needs to move the data each host must send over its one link
# (the ring bound), so link_ratio 1 is the link's limit (latency left out).
# Root only: otherwise prints "skipped: needs root" and exits 0. About 2 minutes.
# Then (part "model") the performance model's communication times against measurement at 2, 4 and
# 8 ranks (2 hosts × 1, 2 × 2, 4 × 2): examples/perf_model.c --project --same-box predicts each
# method's seconds per call for the same gradient (16 matrices of 1024 × 1024), the same links
# and this machine's cores, cluster_compress measures them:
#   bench model-check hosts=H ranks=N method=M measured_ms=t model_ms=p ratio=p/t
#   bench model-check worst_ratio=r within_20pct=yes|no
# Usage: bench/cluster.sh [build-dir] [all|allreduce|compress|model]   (the parts to run; all by default)
#   CLUSTER_COMPRESS_METHODS="fp32 ternary ..." runs only those methods of the compress part.
set -eu
BUILD=${1:-build}
PARTS=${2:-all}
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then echo "skipped: needs root"; exit 0; fi
HOSTS=4
PER_HOST=2
RANKS=$((HOSTS * PER_HOST))
RATE_BYTES=125000000 # --rate 1gbit
DOPT_CLUSTER=cb$$
export DOPT_CLUSTER
trap 'scripts/cluster.sh down' EXIT
trap 'exit 1' INT TERM
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench_allreduce" "$BUILD/cluster_compress" "$BUILD/perf_model" >/dev/null
BENCH=$(cd "$BUILD" && pwd)/bench_allreduce
COMPRESS=$(cd "$BUILD" && pwd)/cluster_compress
LOGS=$BUILD/bench_cluster
rm -rf "$LOGS"
mkdir -p "$LOGS"
scripts/cluster.sh up $HOSTS --rate 1gbit --delay 0.5ms

# bench allreduce lines on stdin -> bench cluster lines (64 KiB and up)
report() {
    awk -v hosts=$HOSTS -v ranks=$RANKS -v rate=$RATE_BYTES '
        $1 == "bench" && $2 == "allreduce" && $3 ~ /^backend=/ {
            for (i = 3; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
            if (f["bytes"] < 65536) next
            t = f["us"] * 1e-6
            printf "bench cluster hosts=%d ranks=%d backend=%s bytes=%d us=%s busbw_GBps=%.3f link_ratio=%.3f us_min=%s us_max=%s\n",
                hosts, ranks, f["backend"], f["bytes"], f["us"], 2 * (ranks - 1) / ranks * f["bytes"] / t / 1e9,
                2 * (hosts - 1) / hosts * f["bytes"] / rate / t, f["us_min"], f["us_max"]
        }'
}

# One process per rank, rank r on host r / PER_HOST, over TCP from DOPT_* variables; $1 names the
# run (its logs), $2 the DOPT_TWO_LEVEL setting, the rest is the command.
launch() {
    name=$1
    mode=$2
    shift 2
    port=$((port + 1))
    pids=""
    r=0
    while [ $r -lt $RANKS ]; do
        timeout 600 scripts/cluster.sh exec $((r / PER_HOST)) env DOPT_RANK=$r DOPT_WORLD_SIZE=$RANKS \
            DOPT_MASTER_ADDR="$master" DOPT_MASTER_PORT=$port DOPT_TOKEN="bench-cluster-$$" DOPT_TWO_LEVEL=$mode \
            DOPT_BENCH_HOSTS=$((RANKS / PER_HOST)) OPENBLAS_NUM_THREADS=1 "$@" >"$LOGS/$name.rank$r.log" 2>&1 &
        pids="$pids $!"
        r=$((r + 1))
    done
    status=0
    for p in $pids; do wait "$p" || status=1; done
    if [ $status -ne 0 ]; then
        echo "bench/cluster.sh: $name failed:" >&2
        tail -n 3 "$LOGS"/$name.rank*.log >&2
        exit 1
    fi
}

# dopt-tcp: one process per rank, rank r on host r / PER_HOST; DOPT_TWO_LEVEL=auto (the
# host-aware allreduce, the default) or off (dopt-tcp-flat: one ring through all 8 ranks)
master=$(scripts/cluster.sh addr 0)
port=$((20000 + $$ % 20000))
[ "$PARTS" = compress ] || [ "$PARTS" = model ] || for mode in auto off; do
    name=dopt-tcp
    [ $mode = off ] && name=dopt-tcp-flat
    launch $name $mode "$BENCH" --from-env
    report <"$LOGS/$name.rank0.log"
done

# mpi-raw-tcp: bench_allreduce's raw MPI_Allreduce alone
if [ "$PARTS" != compress ] && [ "$PARTS" != model ] && ! timeout 600 scripts/cluster.sh mpirun $PER_HOST "$BENCH" mpi-raw-tcp none >"$LOGS/mpi-raw-tcp.log" 2>&1; then
    echo "bench/cluster.sh: mpi-raw-tcp failed:" >&2
    tail -n 10 "$LOGS/mpi-raw-tcp.log" >&2
    exit 1
fi
[ "$PARTS" = compress ] || [ "$PARTS" = model ] || report <"$LOGS/mpi-raw-tcp.log"

# The compressed allreduce of a 64 MiB gradient, every codec against the fp32 allreduce
# (bench/cluster_compress.c): its "bench cluster-compress" lines as they are
[ "$PARTS" = allreduce ] && exit 0
if [ "$PARTS" != model ]; then
    # shellcheck disable=SC2086 # CLUSTER_COMPRESS_METHODS: a list of method names
    launch cluster-compress auto "$COMPRESS" ${CLUSTER_COMPRESS_METHODS:-}
    grep '^bench cluster-compress' "$LOGS/cluster-compress.rank0.log"
fi
[ "$PARTS" = compress ] && exit 0

# The model against the cluster: each layout measured, then predicted
layers=1024
i=0
while [ $i -lt 16 ]; do layers="$layers,1024"; i=$((i + 1)); done
OPENBLAS_NUM_THREADS=1 "$(cd "$BUILD" && pwd)/perf_model" --project --layers "$layers" --layouts 2x1,2x2,4x2 --gbits 1 --link-us 30 \
    --intra-gbs 2 --same-box --seconds 1.5 --out "$LOGS" >"$LOGS/model.log" 2>&1 || { cat "$LOGS/model.log" >&2; exit 1; }
for layout in 2x1 2x2 4x2; do
    H=${layout%x*} PER_HOST=${layout#*x}
    RANKS=$((H * PER_HOST))
    launch "model-$layout" auto "$COMPRESS" fp32 ternary-allgather ternary-ring powersgd
done
for layout in 2x1 2x2 4x2; do
    H=${layout%x*} L=${layout#*x}
    awk -v H="$H" -v L="$L" -F'[ =,]' '
        FNR == NR && $2 == H * L && $3 == H { model[$5] = $7; next }  # projection.csv: gbits,ranks,hosts,local,method,...
        $1 == "bench" && $2 == "cluster-compress" { for (i = 3; i < NF; i += 2) f[$i] = $(i + 1); meas[f["codec"]] = f["us"] / 1000 }
        END {
            split("fp32:fp32 ternary-allgather:tern-allgather ternary-ring:tern-ring powersgd:powersgd", pairs, " ")
            for (k in pairs) {
                split(pairs[k], mm, ":")
                if (meas[mm[1]] > 0 && model[mm[2]] > 0)
                    printf "bench model-check hosts=%d ranks=%d method=%s measured_ms=%.1f model_ms=%.1f ratio=%.2f\n",
                        H, H * L, mm[2], meas[mm[1]], model[mm[2]], model[mm[2]] / meas[mm[1]]
            }
        }' "$LOGS/projection.csv" "$LOGS/model-$layout.rank0.log"
done | tee "$LOGS/model-check.txt"
awk '{ split($8, r, "="); d = r[2] > 1 ? r[2] - 1 : 1 - r[2]; if (d > worst) { worst = d; w = r[2] } }
     END { printf "bench model-check worst_ratio=%.2f within_20pct=%s\n", w, worst <= 0.2 ? "yes" : "no" }' "$LOGS/model-check.txt"
