#!/bin/sh
# Gradient buckets averaged during backward (issue #31), measured on the simulated cluster:
# scripts/cluster.sh makes H = 2 and 4 hosts of one rank each, links shaped (tbf) to 1 Gbit/s and
# then to the rate at which the gradient's ring allreduce takes as long as the step's compute,
#   R = 2(H-1)/H · bytes / compute_ms   (rounded to Mbit/s, the shaper's payload share added),
# and each model runs, in turns, REPS times each of:
#   compute   local SGD with a period longer than the run (--period 1000000): every rank computes
#             as in the others, nothing is averaged but the loss's scalar mean
#   blocking  synchronous steps, the gradient averaged after backward (--overlap off)
#   overlap   synchronous steps, buckets averaged while backward runs (--overlap on)
# Models: gpt2_standin at 3 layers of 128 channels, 4 sequences of 16 tokens (605312 parameters,
# 28 segments; 147 ms a step on 2 hosts, 292 on 4, with other jobs on the cores), and fmnist_mlp
# at 500 samples a step (235146 parameters, 6 segments).
# One rank per host, one thread each (OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1): four hosts share
# this machine's 2 cores. Each run prints on rank 0 the medians of its steps after the first 3:
#   timing steps=k step_ms=s wait_ms=w backward_ms=b
# and one line per hosts, model and rate:
#   bench overlap hosts=H model=M gbits=R blocking_ms=a overlap_ms=b compute_ms=c comm_ms=d
#         bound_ms=e ratio_to_bound=e/b model_ms=p model_ratio=p/b link_ms=l backward_ms=f reach_ms=g reps=n
#         blocking_range=x..y overlap_range=x..y compute_range=x..y
#   blocking_ms, overlap_ms, compute_ms  the median over the runs of each run's step_ms
#   comm_ms     communication alone: the median wait_ms of the blocking runs (time inside
#               dopt_dp_after_backward, every rank arriving at about the same time)
#   bound_ms    max(compute_ms, comm_ms); ratio_to_bound = bound_ms / overlap_ms (1: all hidden)
#   model_ms    perf_model --overlap's overlapped step from compute_ms, the compute runs' backward
#               time and the segments in backward's order; model_ratio = model_ms / overlap_ms
#   link_ms     the ring's bound on the link: 2(H-1)/H · bytes / R (R's payload share)
#   backward_ms the compute runs' median backward time
#   *_range     the fastest and the slowest run's step_ms (the spread)
#   reach_ms    compute_ms - backward_ms + max(backward_ms, comm_ms): the best a step can do when
#               buckets run during backward only (after_backward waits for them before the update,
#               so the next forward hides nothing)
# Goals: ratio_to_bound >= 0.9; overlap_ms <= 1.05 · compute_ms where comm_ms < compute_ms / 2;
# overlap_ms <= 0.6 · blocking_ms at comm ≈ compute; model_ratio within 0.8 .. 1.2.
# Root only: otherwise prints "skipped: needs root" and exits 0. About 5 minutes (5 min 20 s at a
# load average of 2.6 to 8). docs/measurements.md (overlap) has a run's lines and what limits them.
# Usage: bench/overlap.sh [build-dir]
#   OVERLAP_REPS (3), OVERLAP_HOSTS ("2 4"), OVERLAP_MODELS ("gpt2_standin fmnist_mlp") narrow it.
set -eu
BUILD=${1:-build}
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then echo "skipped: needs root"; exit 0; fi
REPS=${OVERLAP_REPS:-3}
DOPT_CLUSTER=co$$
export DOPT_CLUSTER
trap 'scripts/cluster.sh down' EXIT
trap 'exit 1' INT TERM
make --no-print-directory -s BUILD="$BUILD" "$BUILD/gpt2_standin" "$BUILD/fmnist_mlp" "$BUILD/perf_model" >/dev/null
BIN=$(cd "$BUILD" && pwd)
LOGS=$BUILD/bench_overlap
rm -rf "$LOGS"
mkdir -p "$LOGS"
PAYLOAD=0.956407 # 1448 / 1514: TCP payload in a shaped frame (perf_model's PROJ_PAYLOAD)
GPT2_L=3 GPT2_C=128 GPT2_B=4 GPT2_T=16 GPT2_V=64
GPT2_STEPS=20
FMNIST_BATCH=500
FMNIST_STEPS=40 # at 4 hosts the 60000 images allow 30
port=$((20000 + $$ % 20000))
echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"

# The model's command line (mode: compute, blocking or overlap; $2 the hosts).
command_for() {
    case $2 in
    compute) mode="--period 1000000 --overlap off" ;;
    blocking) mode="--overlap off" ;;
    *) mode="--overlap on" ;;
    esac
    case $1 in
    gpt2_standin)
        echo "$BIN/gpt2_standin --layers $GPT2_L --channels $GPT2_C --batch $GPT2_B --seq $GPT2_T --steps $GPT2_STEPS $mode" ;;
    fmnist_mlp)
        echo "$BIN/fmnist_mlp --batch $FMNIST_BATCH --epochs 1 --train-limit $((FMNIST_BATCH * FMNIST_STEPS * $3)) $mode" ;;
    esac
}

# The gradient's elements per segment in the order backward finishes them (the examples' marks):
# gpt2_standin's final layernorm, then each layer from the last (its tensors from fcproj back to
# ln1, one segment per tensor and layer), then the embeddings; fmnist_mlp's layers from the last.
segments_of() {
    case $1 in
    gpt2_standin)
        awk -v L=$GPT2_L -v C=$GPT2_C -v V=$GPT2_V -v T=$GPT2_T 'BEGIN {
            s = C "," C
            for (l = L - 1; l >= 0; l--)
                s = s "," 4*C*C "," C "," 4*C*C "," 4*C "," C "," C "," C*C "," C "," 3*C*C "," 3*C "," C "," C
            print s "," V*C "," T*C }' ;;
    fmnist_mlp) echo "1280,10,32768,128,200704,256" ;;
    esac
}

params_of() { segments_of "$1" | tr ',' '\n' | awk '{ n += $1 } END { print n }'; }

# One run on every host (rank r on host r), its rank 0's timing line appended to $LOGS/$name.timing.
run() {
    name=$1 hosts=$2
    shift 2
    port=$((port + 1))
    pids=""
    r=0
    while [ $r -lt "$hosts" ]; do
        # shellcheck disable=SC2048,SC2086 # $* is the command line command_for made: split on purpose
        timeout 300 scripts/cluster.sh exec $r env DOPT_RANK=$r DOPT_WORLD_SIZE="$hosts" DOPT_MASTER_ADDR="$master" \
            DOPT_MASTER_PORT=$port DOPT_TOKEN="bench-overlap-$$" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
            $* >"$LOGS/$name.rank$r.log" 2>&1 &
        pids="$pids $!"
        r=$((r + 1))
    done
    status=0
    for p in $pids; do wait "$p" || status=1; done
    if [ $status -ne 0 ] || ! grep -q '^timing ' "$LOGS/$name.rank0.log"; then
        echo "bench/overlap.sh: $name failed:" >&2
        tail -n 3 "$LOGS/$name".rank*.log >&2
        exit 1
    fi
    grep '^timing ' "$LOGS/$name.rank0.log" >>"$LOGS/$name.timing"
}

# The median of field $2 (step_ms, wait_ms, backward_ms) over the timing lines of file $1; with
# $3 = spread, the smallest and the largest instead ("a..b").
median() {
    sed -n "s/.* $2=\([0-9.]*\).*/\1/p" "$1" | sort -g | awk -v spread="${3:-}" '{ v[NR] = $1 } END {
        if (spread != "") printf "%.1f..%.1f\n", v[1], v[NR]
        else print NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# REPS turns of compute, blocking and overlap for model $1 on the $2 hosts at $3 Mbit/s; the line.
measure() {
    model=$1 hosts=$2 mbit=$3
    tag=$model.h$hosts.m$mbit
    i=0
    while [ $i -lt "$REPS" ]; do
        for mode in compute blocking overlap; do
            run "$tag.$mode" "$hosts" "$(command_for "$model" $mode "$hosts")"
        done
        i=$((i + 1))
    done
    compute=$(median "$LOGS/$tag.compute.timing" step_ms)
    backward=$(median "$LOGS/$tag.compute.timing" backward_ms)
    blocking=$(median "$LOGS/$tag.blocking.timing" step_ms)
    overlap=$(median "$LOGS/$tag.overlap.timing" step_ms)
    comm=$(median "$LOGS/$tag.blocking.timing" wait_ms)
    gbits=$(awk -v m="$mbit" 'BEGIN { printf "%g", m / 1000 }')
    "$BIN/perf_model" --overlap --hosts "$hosts" --gbits "$gbits" --link-us 50 --compute-ms "$compute" \
        --backward-ms "$backward" --comm-ms "$comm" --segments "$(segments_of "$model")" >"$LOGS/$tag.model" 2>&1 ||
        { cat "$LOGS/$tag.model" >&2; exit 1; }
    predicted=$(sed -n 's/^overlap model_ms=\([0-9.]*\).*/\1/p' "$LOGS/$tag.model")
    awk -v h="$hosts" -v m="$model" -v g="$gbits" -v a="$blocking" -v b="$overlap" -v c="$compute" -v d="$comm" \
        -v p="$predicted" -v f="$backward" -v ra="$(median "$LOGS/$tag.blocking.timing" step_ms spread)" \
        -v rb="$(median "$LOGS/$tag.overlap.timing" step_ms spread)" -v rc="$(median "$LOGS/$tag.compute.timing" step_ms spread)" -v bytes="$(($(params_of "$model") * 4))" -v reps="$REPS" -v pay=$PAYLOAD 'BEGIN {
        e = c > d ? c : d
        printf "bench overlap hosts=%d model=%s gbits=%s blocking_ms=%.1f overlap_ms=%.1f compute_ms=%.1f comm_ms=%.1f bound_ms=%.1f ratio_to_bound=%.2f model_ms=%.1f model_ratio=%.2f link_ms=%.1f backward_ms=%.1f reach_ms=%.1f reps=%d blocking_range=%s overlap_range=%s compute_range=%s\n",
            h, m, g, a, b, c, d, e, e / b, p, p / b, 2 * (h - 1) / h * bytes / (g * 1e9 / 8 * pay) * 1e3, f,
            c - f + (f > d ? f : d), reps, ra, rb, rc }'
}

# The rate (Mbit/s) at which the ring's time on the link equals compute_ms of the 1 Gbit/s runs.
equal_rate() {
    awk -v h="$2" -v bytes="$(($(params_of "$1") * 4))" -v c="$(median "$LOGS/$1.h$2.m1000.compute.timing" step_ms)" \
        -v pay=$PAYLOAD 'BEGIN { printf "%d", 2 * (h - 1) / h * bytes * 8 / (c / 1e3) / pay / 1e6 + 0.5 }'
}

for hosts in ${OVERLAP_HOSTS:-2 4}; do
    scripts/cluster.sh up "$hosts" --rate 1gbit >/dev/null
    master=$(scripts/cluster.sh addr 0)
    for model in ${OVERLAP_MODELS:-gpt2_standin fmnist_mlp}; do measure "$model" "$hosts" 1000; done
    for model in ${OVERLAP_MODELS:-gpt2_standin fmnist_mlp}; do
        mbit=$(equal_rate "$model" "$hosts")
        scripts/cluster.sh up "$hosts" --rate "${mbit}mbit" >/dev/null
        measure "$model" "$hosts" "$mbit"
    done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
