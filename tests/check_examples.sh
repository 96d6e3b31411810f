#!/bin/sh
# Keeps the examples honest: least_squares must reach its known optimum over the self backend,
# over shared memory in fp32, with TernGrad, with local SGD and compressed deltas, with CELGC at
# period 4, with DiLoCo's outer optimizer at period 8, and over MPI — and must report failure when the step size makes SGD diverge;
# fmnist_mlp must run one short epoch, with fixed and with adaptive batches; char_lstm --elastic on
# must survive a killed worker and take it back when it is started again; fmnist_mlp and char_lstm must end with the same parameters, bit for bit, with --overlap on (gradients handed to the driver
# during backward) as with --overlap off, and print the timing line; perf_model must
# measure its ingredients and predict, size overlapped steps' buckets with the driver's own rule,
# and project to 1024 ranks. Usage: tests/check_examples.sh BUILD_DIR (tests/run.sh passes it); builds the
# examples there through the Makefile when they are missing or stale. A few seconds.
set -u

BUILD=${1:-build}
mkdir -p "$BUILD"
export OPENBLAS_NUM_THREADS=1
failed=0

build() { # $1: example name
    make --no-print-directory -s BUILD="$BUILD" "$BUILD/$1" >/dev/null || { echo "FAIL: cannot build $1"; exit 1; }
}

expect() { # $1: expected outcome (converges | fails), then the command
    want=$1
    shift
    if "$@" >/dev/null 2>&1; then got=converges; else got=fails; fi
    if [ "$got" = "$want" ]; then
        echo "ok   $want: $*"
    else
        echo "FAIL expected '$want', got '$got': $*"
        "$@" 2>&1 | tail -3
        failed=1
    fi
}

# What a user sees on a mistake: exit status $1, the line $2 on stderr exactly once.
expect_message() {
    want_status=$1 want_line=$2
    shift 2
    out=$("$@" 2>&1 >/dev/null)
    got_status=$?
    count=$(printf '%s\n' "$out" | grep -cF -- "$want_line")
    if [ "$got_status" -eq "$want_status" ] && [ "$count" -eq 1 ]; then
        echo "ok   says \"$want_line\": $*"
    else
        echo "FAIL expected exit $want_status and \"$want_line\" once, got exit $got_status, $count times: $*"
        printf '%s\n' "$out" | head -5
        failed=1
    fi
}

# The same final parameters with --overlap on as off: the "params fnv1a" lines of the two runs
# of the command (its flags then --overlap on|off) are equal, both end well, and the run with
# --overlap on prints the timing line the overlap benchmark parses.
same_with_overlap() {
    on=$("$@" --overlap on 2>&1)
    s_on=$?
    off=$("$@" --overlap off 2>&1)
    s_off=$?
    h_on=$(printf '%s\n' "$on" | sed -n 's/^params fnv1a \([0-9a-f]*\)$/\1/p')
    h_off=$(printf '%s\n' "$off" | sed -n 's/^params fnv1a \([0-9a-f]*\)$/\1/p')
    timing=$(printf '%s\n' "$on" | grep -cE '^timing steps=[0-9]+ step_ms=[0-9.]+ wait_ms=[0-9.]+ backward_ms=[0-9.]+ overlap=on$')
    if [ $s_on -eq $s_off ] && [ -n "$h_on" ] && [ "$h_on" = "$h_off" ] && [ "$timing" -eq 1 ]; then
        echo "ok   --overlap on = off (params fnv1a $h_on, exit $s_on): $*"
    else
        echo "FAIL --overlap on (exit $s_on, hash ${h_on:-none}, $timing timing lines) against off (exit $s_off, hash ${h_off:-none}): $*"
        printf '%s\n' "$on" | tail -3
        failed=1
    fi
}

build least_squares
expect_message 2 "error: --workers must be >= 1 (got 0)" "$BUILD/least_squares" --workers 0
expect_message 2 "error: --period must be >= 1 (got 0)" "$BUILD/least_squares" --period 0
expect_message 2 'error: --compress must be one of none, ternary, qsgd, topk, sign, fp16, bf16, majority, powersgd (got "nonsense")' \
    "$BUILD/least_squares" --compress nonsense
expect_message 2 "error: --lr expects a number (got \"fast\")" "$BUILD/least_squares" --lr fast
expect_message 2 "error: unknown flag --wokers" "$BUILD/least_squares" --wokers 2
expect_message 2 "error: --steps needs a value" "$BUILD/least_squares" --steps
expect_message 1 "not started by an MPI launcher" env -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE -u PMIX_RANK \
    -u MPI_LOCALNRANKS "$BUILD/least_squares" --transport mpi
expect_message 0 "usage: " sh -c '"$0" --help 1>&2' "$BUILD/least_squares"
# shellcheck disable=SC2317  # called through expect
least_squares() { "$BUILD/least_squares" --steps 3000 --seed 7 "$@"; }
expect converges least_squares --transport self
expect converges least_squares --transport shm --workers 2
expect converges least_squares --transport shm --workers 2 --compress ternary
expect converges least_squares --transport shm --workers 3 --compress topk --period 4
expect converges least_squares --transport shm --workers 2 --celgc 0.05,1.0 --period 4
expect converges least_squares --transport shm --workers 2 --period 8 --outer-lr 0.7 --outer-momentum 0.9
expect fails least_squares --transport shm --workers 2 --lr 5
expect fails least_squares --transport self --steps 10
expect converges mpirun --allow-run-as-root --mca btl_vader_single_copy_mechanism none -n 2 -x OPENBLAS_NUM_THREADS "$BUILD/least_squares" --steps 3000 --seed 7 \
    --transport mpi --compress ternary

if [ -r /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz ]; then
    build fmnist_mlp
    expect converges "$BUILD/fmnist_mlp" --transport shm --workers 2 --epochs 1 --train-limit 2048 \
        --compress ternary --period 4 --clip 2
    expect converges "$BUILD/fmnist_mlp" --transport shm --workers 2 --epochs 1 --train-limit 2048 \
        --adaptive-batch aip --batch-eta 0.5 --max-batch-units 4
    expect converges "$BUILD/fmnist_mlp" --transport shm --workers 2 --epochs 1 --train-limit 2048 \
        --compress ternary --tern-clip off --evals-per-epoch 2 --target-acc 10
    expect converges "$BUILD/fmnist_mlp" --transport shm --workers 2 --epochs 1 --train-limit 2048 \
        --compress powersgd --powersgd-rank 4
    same_with_overlap "$BUILD/fmnist_mlp" --transport shm --workers 2 --epochs 1 --train-limit 2048
    same_with_overlap "$BUILD/fmnist_mlp" --transport shm --workers 2 --epochs 1 --train-limit 2048 \
        --adaptive-batch aip --batch-eta 0.5 --max-batch-units 4
    same_with_overlap "$BUILD/fmnist_mlp" --transport shm --workers 2 --epochs 1 --train-limit 2048 --celgc 0.1,1
    same_with_overlap "$BUILD/fmnist_mlp" --transport shm --workers 2 --epochs 1 --train-limit 2048 \
        --compress ternary --period 4
else
    echo "FAIL: Fashion-MNIST is missing (scripts/install-deps.sh installs dataset-fashion-mnist)"
    failed=1
fi

# char_lstm --elastic on: three workers over TCP on loopback (CELGC, local SGD at period 4), rank 0
# killed (SIGKILL) once its first epoch's row is out, in the second epoch's training, and started
# again at once with DOPT_JOIN=1 (ranks 1 and 2 listen on known ports, DOPT_JOIN_PEERS names them:
# nobody listens at rank 0's address any more). Both survivors and the joiner must exit 0 (the
# closing dopt_dp_close found the replicas identical), the survivors must say they went on and
# took a worker back (in two rounds, or in the round that lost rank 0 when the joiner asked in
# time: one line then), the joiner that it was taken back, and the later epochs must converge.
# Tried again on other ports when one of them was taken.
char_lstm_survives_a_lost_worker() {
    dir=$(mktemp -d)
    port=$((30000 + $$ % 20000))
    for attempt in 1 2 3; do
        port=$((port + 4))
        for r in 0 1 2; do
            listen=0
            [ $r -gt 0 ] && listen=$((port + r))
            DOPT_TRANSPORT=tcp DOPT_RANK=$r DOPT_WORLD_SIZE=3 DOPT_MASTER_ADDR=127.0.0.1 DOPT_MASTER_PORT=$port \
                DOPT_LISTEN_PORT=$listen DOPT_TOKEN="lstm-elastic-$$" DOPT_ON_PEER_LOST=shrink "$BUILD/char_lstm" \
                --train-limit 60000 --val-limit 4000 --batch 16 --epochs 4 --seed 7 --celgc 30,3 --period 4 \
                --elastic on >"$dir/$r.out" 2>"$dir/$r.err" &
            eval "pid$r=\$!"
        done
        i=0
        while [ $i -lt 1200 ] && ! grep -q '^    1 ' "$dir/0.out" && kill -0 "$pid0" 2>/dev/null; do
            sleep 0.1
            i=$((i + 1))
        done
        kill -9 "$pid0" 2>/dev/null
        DOPT_TRANSPORT=tcp DOPT_JOIN=1 DOPT_MASTER_ADDR=127.0.0.1 DOPT_MASTER_PORT=$port \
            DOPT_JOIN_PEERS="127.0.0.1:$((port + 1)),127.0.0.1:$((port + 2))" DOPT_LISTEN_PORT=$((port + 3)) \
            DOPT_TOKEN="lstm-elastic-$$" DOPT_ON_PEER_LOST=shrink "$BUILD/char_lstm" --train-limit 60000 \
            --val-limit 4000 --batch 16 --epochs 4 --seed 7 --celgc 30,3 --period 4 --elastic on \
            >"$dir/j.out" 2>"$dir/j.err" &
        pidj=$!
        wait "$pid1"; s1=$?
        wait "$pid2"; s2=$?
        wait "$pidj"; sj=$?
        wait "$pid0" 2>/dev/null
        grep -q "in use" "$dir"/*.err || break
    done
    survivors=$(cat "$dir/1.out" "$dir/2.out")
    if grep -q '^    1 ' "$dir/0.out" && [ "$s1" -eq 0 ] && [ "$s2" -eq 0 ] && [ "$sj" -eq 0 ] &&
        { { printf '%s\n' "$survivors" | grep -q '^lost a worker: 2 go on' &&
            printf '%s\n' "$survivors" | grep -q '^a worker came back: 3 go on'; } ||
            printf '%s\n' "$survivors" | grep -q '^lost a worker, and one came back: 3 go on'; } &&
        grep -q '^char_lstm: taken back as rank 2 of 3' "$dir/j.out" &&
        printf '%s\n' "$survivors" | grep -q '^    4 ' &&
        printf '%s\n' "$survivors" | grep -q ': converged$'; then
        echo "ok   char_lstm --elastic on: rank 0 of 3 killed in epoch 2, started again and taken back, converged"
    else
        echo "FAIL char_lstm --elastic on: rank 0 of 3 killed in epoch 2 and started again (survivors exited $s1 and" \
            "$s2, the joiner $sj)"
        tail -n 4 "$dir"/*.out "$dir"/*.err
        failed=1
    fi
    rm -rf "$dir"
}

# char_lstm: the backward pass against finite differences; CELGC at a step size where plain SGD
# blows up must beat the unigram baseline on 16000 characters, at period 2 and at period 1 with
# the models averaged (each worker clips its own gradient), and plain SGD at that step must fail
# by reporting DIVERGED (not by crashing).
if [ -r /usr/share/games/fortunes/fortunes ]; then
    build char_lstm
    # shellcheck disable=SC2317  # called through expect
    char_lstm() { "$BUILD/char_lstm" --transport shm --workers 2 --train-limit 16000 --val-limit 4000 --batch 16 \
        --epochs 6 --seed 7 "$@"; }
    # shellcheck disable=SC2317
    char_lstm_reports_divergence() { out=$(char_lstm "$@" 2>&1); s=$?; echo "$out" | grep -q DIVERGED || return 0; return "$s"; }
    expect converges "$BUILD/char_lstm" --gradcheck
    expect converges char_lstm --celgc 30,3 --period 2
    expect converges char_lstm --celgc 30,3 --period 1 --average models
    expect fails char_lstm_reports_divergence --lr 30
    same_with_overlap "$BUILD/char_lstm" --transport shm --workers 2 --train-limit 16000 --val-limit 2000 --batch 16 \
        --epochs 2 --seed 7 --clip 0.1 --lr 30
    char_lstm_survives_a_lost_worker
else
    echo "FAIL: the fortunes text is missing (scripts/install-deps.sh installs fortunes)"
    failed=1
fi

# The performance model: measures its ingredients over shm (a short time each) and predicts.
build perf_model
expect converges "$BUILD/perf_model" --transport shm --workers 2 --seconds 0.02 none:64:1 ternary:64:1 none:512:4:adaptive
expect fails "$BUILD/perf_model" --transport self bogus:64:1
expect fails "$BUILD/perf_model" --transport self powersgd:64:1
# --overlap predicts with the driver's own bucket-size rule (localsgd.h's dopt__dp_bucket_rule),
# not a copy that could drift from it: the source calls it and computes no size of its own, and a
# prediction chooses a size within the rule's bounds (64 KiB .. the gradients' 8 MB here).
src=$(dirname "$0")/../examples/perf_model.c
line=$("$BUILD/perf_model" --overlap --hosts 2 --gbits 1 --link-us 50 --compute-ms 100 --backward-ms 60 \
    --segments 1000000,500000,500000 2>/dev/null | grep '^overlap ')
if grep -q 'dopt__dp_bucket_rule(' "$src" && ! grep -q 'sqrt(' "$src" &&
    echo "$line" | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^bucket_bytes=/) b = substr($i, 14) + 0 }
                        END { exit !(b >= 65536 && b <= 8000000) }'; then
    echo "ok   perf_model --overlap sizes buckets with the driver's rule: $line"
else
    echo "FAIL perf_model --overlap: its own bucket-size rule in $src, or no size in: $line"
    failed=1
fi
# The projection: a row per rate, method and world size 2..1024; TernGrad's allgather stops
# growing across hosts while its integer ring keeps scaling (1 Gbit/s, 1024 ranks: several times).
proj=$(mktemp -d)
if "$BUILD/perf_model" --project --seconds 0.02 --out "$proj" >/dev/null 2>&1 &&
    awk -F, 'NR > 1 { rows++ } $1 == 1 && $2 == 1024 { sps[$5] = $9 }
             END { exit !(rows == 100 && sps["tern-ring"] > 3 * sps["tern-allgather"] && sps["fp32"] > sps["tern-allgather"]) }' \
        "$proj/projection.csv"; then
    echo "ok   projection: 100 rows in $proj/projection.csv; at 1024 ranks the integer ring outruns the allgather"
else
    echo "FAIL projection: $BUILD/perf_model --project --out $proj"
    failed=1
fi
rm -rf "$proj"
exit $failed
