#!/bin/sh
# make hosts: distopt inside two real C training loops from Debian, FANN and darknet. For each
# host, the same loop in 1 process against 2 workers over shared memory and over TCP (two
# processes on 127.0.0.1), at equal epochs and equal samples per step (1 process takes the 2
# workers' minibatches together). Checks, for every 2-worker run:
#   - test accuracy within HOSTS_MAX_GAP points (default 1) of the 1-process run;
#   - parameters bitwise identical on both ranks: the library's replica check
#     (dopt_dp_close) and, independently, each rank's own FNV-1a hash of its
#     parameters, printed by the host and compared here;
#   - darknet's synchronous mode (--average grads) with --overlap on (each layer's buffers marked
#     final as backward finishes it) ends with the same bits as with --overlap off;
#   - the lines the host's source marks /* distopt ... */, by kind: core (the calls and the
#     control flow that carries their status), layout (describing the host's memory to
#     distopt), option (TernGrad, clipping), include (#define/#include). Core: at most
#     HOSTS_MAX_LINES (default 10).
# Prints a table; exits non-zero on any failure.
# Usage: examples/hosts/run.sh [BUILD_DIR]   (from the repository's top directory; the binaries
# BUILD_DIR/fann_dp and BUILD_DIR/darknet_dp must exist: `make hosts` builds them first)
set -u

BUILD=${1:-build}
MAX_GAP=${HOSTS_MAX_GAP:-1}
MAX_LINES=${HOSTS_MAX_LINES:-10}
SEED=${HOSTS_SEED:-1}
LOGS="$BUILD/hosts"
mkdir -p "$LOGS"
export OPENBLAS_NUM_THREADS=1 DOPT_TIMEOUT_MS=120000
failed=0

# The runs: data, epochs and steps are the same for 1 and 2 workers; --batch is per worker.
FANN_ARGS="--epochs 3 --train-limit 20000 --lr 4 --hidden 64 --seed $SEED"
DARKNET_ARGS="--epochs 3 --train-limit 20000 --lr 0.1 --period 4 --seed $SEED"

for b in fann_dp darknet_dp; do
    [ -x "$BUILD/$b" ] || { echo "run.sh: $BUILD/$b is missing (make hosts builds it)"; exit 1; }
done

# $1: log name, $2: workers, then the command; stdout and stderr to $LOGS/NAME.log.
run_shm() {
    name=$1 workers=$2
    shift 2
    DOPT_TRANSPORT=shm DOPT_WORLD_SIZE=$workers timeout 600 "$@" >"$LOGS/$name.log" 2>&1
}

# $1: log name, then the command; rank r logs to $LOGS/NAME.rR.log. A port
# someone else took in the meantime is retried with another.
run_tcp() {
    name=$1
    shift
    for attempt in 1 2 3; do
        port=$(( ($$ * 31 + $(date +%s) + attempt * 7919) % 30000 + 20000 ))
        if ss -ltn 2>/dev/null | grep -q ":$port "; then continue; fi
        token="hosts-$$-$attempt"
        DOPT_TRANSPORT=tcp DOPT_WORLD_SIZE=2 DOPT_MASTER_ADDR=127.0.0.1 DOPT_MASTER_PORT=$port DOPT_TOKEN=$token \
            DOPT_RANK=1 timeout 600 "$@" >"$LOGS/$name.r1.log" 2>&1 &
        pid1=$!
        DOPT_TRANSPORT=tcp DOPT_WORLD_SIZE=2 DOPT_MASTER_ADDR=127.0.0.1 DOPT_MASTER_PORT=$port DOPT_TOKEN=$token \
            DOPT_RANK=0 timeout 600 "$@" >"$LOGS/$name.r0.log" 2>&1
        rc0=$?
        if [ $rc0 -ne 0 ] && grep -q "Address already in use" "$LOGS/$name.r0.log"; then
            kill "$pid1" 2>/dev/null
            wait "$pid1" 2>/dev/null
            continue
        fi
        wait "$pid1"
        rc1=$?
        cat "$LOGS/$name.r0.log" "$LOGS/$name.r1.log" >"$LOGS/$name.log"
        [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ]
        return
    done
    echo "run.sh: no free TCP port after 3 tries" >"$LOGS/$name.log"
    return 1
}

acc_of() { sed -n 's/^result: test_acc \([0-9.]*\) .*/\1/p' "$LOGS/$1.log"; }
replicas_of() { sed -n 's/^result: test_acc [0-9.]* replicas \(.*\)/\1/p' "$LOGS/$1.log"; }
# "equal" when every rank printed a hash and all are the same.
hashes_of() {
    n=$(grep -c '^rank [0-9]* .* fnv1a ' "$LOGS/$1.log")
    u=$(sed -n 's/^rank [0-9]* .* fnv1a \([0-9a-f]*\)$/\1/p' "$LOGS/$1.log" | sort -u | wc -l)
    if [ "$n" -eq "$2" ] && [ "$u" -eq 1 ]; then echo equal; else echo "DIFFER($n ranks, $u hashes)"; fi
}

# Lines marked /* distopt ... */ in a source, of one kind: core, layout, option, include (the
# counter the GPT-2-style stand-in's check uses too).
count_lines() { scripts/count-lines.sh "$1" "$2"; }

echo "Lines marked /* distopt */ (core: calls and the control flow around them; goal <= $MAX_LINES):"
printf '%-8s %5s %7s %7s %8s %6s  %s\n' host core layout option include total verdict
for h in fann:hosts/fann_dp darknet:hosts/darknet_dp gpt2:gpt2_standin; do
    src="examples/${h#*:}.c"
    c=$(count_lines "$src" core); l=$(count_lines "$src" layout); o=$(count_lines "$src" option)
    i=$(count_lines "$src" include)
    verdict=ok
    if [ "$c" -gt "$MAX_LINES" ]; then verdict="FAIL (core > $MAX_LINES)"; failed=1; fi
    printf '%-8s %5s %7s %7s %8s %6s  %s\n' "${h%%:*}" "$c" "$l" "$o" "$i" $((c + l + o + i)) "$verdict"
done
echo

printf '%-8s %-30s %8s %7s  %-10s %-10s %s\n' host run test_acc gap replicas hashes verdict
row() { # $1: host, $2: run label, $3: log name, $4: ranks, $5: baseline accuracy, $6: run status
    acc=$(acc_of "$3")
    rep=$(replicas_of "$3")
    hs=$(hashes_of "$3" "$4")
    verdict=ok
    if [ "$6" -ne 0 ] || [ -z "$acc" ]; then
        verdict="FAIL (exit $6, see $LOGS/$3.log)"
        acc=${acc:--}
    fi
    gap=-
    if [ "$4" -gt 1 ] && [ -n "$5" ] && [ "$acc" != - ]; then
        gap=$(awk -v a="$acc" -v b="$5" 'BEGIN { printf "%+.2f", a - b }')
        if awk -v g="$gap" -v m="$MAX_GAP" 'BEGIN { exit !(g > m || g < -m) }'; then verdict="FAIL (gap > $MAX_GAP)"; fi
    fi
    [ "$rep" = identical ] || { [ "$verdict" = ok ] && verdict="FAIL (replicas differ)"; }
    [ "$hs" = equal ] || { [ "$verdict" = ok ] && verdict="FAIL (hashes differ)"; }
    [ "$verdict" = ok ] || failed=1
    printf '%-8s %-30s %8s %7s  %-10s %-10s %s\n' "$1" "$2" "$acc" "$gap" "${rep:--}" "$hs" "$verdict"
}

host() { # $1: host name, $2: binary, $3: its arguments, $4: 1 to add a TernGrad + clipping row, 2 a row of
         # synchronous steps with the buckets averaged during backward (darknet)
    # shellcheck disable=SC2086  # the arguments are words
    run_shm "$2.1" 1 "$BUILD/$2" --batch 64 $3
    rc=$?
    base=$(acc_of "$2.1")
    row "$1" "1 process" "$2.1" 1 "" $rc
    # shellcheck disable=SC2086
    run_shm "$2.shm" 2 "$BUILD/$2" --batch 32 $3
    row "$1" "2 workers, shm" "$2.shm" 2 "$base" $?
    # shellcheck disable=SC2086
    run_tcp "$2.tcp" "$BUILD/$2" --batch 32 $3
    row "$1" "2 workers, tcp" "$2.tcp" 2 "$base" $?
    if [ "$4" = 1 ]; then
        # shellcheck disable=SC2086
        run_shm "$2.tern" 2 "$BUILD/$2" --batch 32 --compress ternary --clip 1 $3
        row "$1" "2 workers, shm, TernGrad" "$2.tern" 2 "$base" $?
    fi
    if [ "$4" = 2 ]; then
        # shellcheck disable=SC2086
        run_shm "$2.sync" 2 "$BUILD/$2" --batch 32 $3 --period 1 --average grads
        row "$1" "2 workers, shm, sync" "$2.sync" 2 "$base" $?
        # shellcheck disable=SC2086
        run_shm "$2.overlap" 2 "$BUILD/$2" --batch 32 $3 --period 1 --average grads --overlap on
        row "$1" "2 workers, shm, sync, overlap" "$2.overlap" 2 "$base" $?
    fi
}

host fann fann_dp "$FANN_ARGS" 1
host darknet darknet_dp "$DARKNET_ARGS" 2

# Not a goal, a fact worth seeing: with 2 ranks both transports give the same bits.
for b in fann_dp darknet_dp; do
    h1=$(sed -n 's/^rank 0 .* fnv1a \([0-9a-f]*\)$/\1/p' "$LOGS/$b.shm.log")
    h2=$(sed -n 's/^rank 0 .* fnv1a \([0-9a-f]*\)$/\1/p' "$LOGS/$b.tcp.log")
    if [ -n "$h1" ] && [ "$h1" = "$h2" ]; then same="the same parameters, bit for bit"; else same="different parameters"; fi
    echo "$b: shm and tcp runs end with $same ($h1, $h2)"
done
# A goal: marking each layer's buffers during backward changes no bit of the synchronous steps.
h1=$(sed -n 's/^rank 0 .* fnv1a \([0-9a-f]*\)$/\1/p' "$LOGS/darknet_dp.sync.log")
h2=$(sed -n 's/^rank 0 .* fnv1a \([0-9a-f]*\)$/\1/p' "$LOGS/darknet_dp.overlap.log")
if [ -n "$h1" ] && [ "$h1" = "$h2" ]; then
    echo "darknet_dp: synchronous steps end with the same parameters with --overlap on as off ($h1)"
else
    echo "darknet_dp: FAIL: synchronous steps with --overlap on end with other parameters than off ($h1, $h2)"
    failed=1
fi

echo
echo "fann: 784-64-10, FANN's batch trainer, slopes averaged every step (TernGrad row: ternary slopes,"
echo "per layer, and global-norm clipping at 1); darknet: 3 convolutions with batch norm, SGD with"
echo "momentum, models averaged every 4 steps (local SGD; sync rows: the update buffers averaged every step,"
echo "overlap: layer by layer during backward). 20000 training images, 3 epochs, 64 images per"
echo "step in all, seed $SEED; test accuracy on the 10000 test images; gap: against 1 process (goal within"
echo "$MAX_GAP point); replicas: distopt's check; hashes: every rank's own FNV-1a. Logs: $LOGS/"
if [ $failed -ne 0 ]; then echo "hosts: FAILED"; else echo "hosts: all checks passed"; fi
exit $failed
