#!/bin/sh
# Checks examples/gpt2_standin.c, llm.c's training loop in miniature with distopt's synchronous
# drop-in:
#   - its backward pass agrees with finite differences on two elements of each of the 16 tensors;
#   - 1 rank and 2 ranks (forked over shared memory, DOPT_WORLD_SIZE=2) exit 0, print one loss
#     line per step, the last loss well below the first (at most 60% of it), nothing on stderr,
#     and rank 0's "result: ... replicas identical" line, which it prints only when
#     dopt_dp_close found the replicas bitwise identical;
#   - with --desync (rank 1 changes one parameter before the end) the job fails: a non-zero exit
#     status, the library's "distopt: ... replicas differ ..." line on stderr, no result line;
#   - with --overlap on (gpt2_backward hands each layer's gradients to the driver) 2 ranks print
#     the same loss lines, digit for digit, as with --overlap off, and the timing line; with
#     local steps (--period 4, 2 layers) the marks do nothing and the replicas end identical;
#   - the lines the source marks /* distopt */ as core number at most 10 (scripts/count-lines.sh).
# Usage: tests/check_gpt2_standin.sh BUILD_DIR (tests/run.sh passes it); builds BUILD_DIR/gpt2_standin
# through the Makefile when it is missing or stale. A few seconds.
set -u

BUILD=${1:-build}
STEPS=200
MAX_CORE=10
cd "$(dirname "$0")/.." || exit 1
if ! make --no-print-directory -s BUILD="$BUILD" "$BUILD/gpt2_standin" >/dev/null; then
    echo "FAIL: cannot build $BUILD/gpt2_standin"
    exit 1
fi
bin=$BUILD/gpt2_standin
# One OpenMP thread per rank: on a shared machine, threads that outnumber the free cores spin
# at every parallel loop's barrier.
export OMP_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0

fail() {
    echo "FAIL $*"
    failed=1
}

# $1: log name; then the command. stdout to $tmp/NAME.out, stderr to $tmp/NAME.err; returns the
# exit status (timeout only guards against a hang).
run() {
    name=$1
    shift
    timeout 300 "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"
}

show() { # $1: log name
    echo "--- stdout (last lines)"; tail -5 "$tmp/$1.out"
    echo "--- stderr"; head -20 "$tmp/$1.err"
}

# The gradient check: 32 lines that end in "ok" and the summary, exit 0.
run gradcheck "$bin" --gradcheck
status=$?
ok=$(grep -c '^gradcheck [a-z0-9]* *\[ *[0-9]*\] analytic .* ok$' "$tmp/gradcheck.out")
if [ $status -eq 0 ] && [ "$ok" -eq 32 ] &&
    [ "$(tail -1 "$tmp/gradcheck.out")" = "gradcheck: 32 of 32 gradients agree with finite differences" ]; then
    echo "ok   gradient check: 32 of 32 gradients agree with finite differences"
else
    fail "gradient check: exit $status, $ok of 32 ok"
    cat "$tmp/gradcheck.out"
fi

# A training run of $2 ranks, rank 0's stdout alone (DOPT_STDOUT_RANKS=0): every step's loss line,
# in order, falling; a validation loss every 10 steps and a sample every 20, once each; the result
# line.
train() { # $1: log name, $2: ranks
    run "$1" env DOPT_WORLD_SIZE="$2" DOPT_STDOUT_RANKS=0 "$bin" --steps $STEPS
    status=$?
    out=$tmp/$1.out
    lines=$(grep -c '^step [0-9]*: train loss [0-9]*\.[0-9]*$' "$out")
    in_order=$(awk -v n=$STEPS 'BEGIN { i = 0 } /^step / { if ($2 != i ":") bad = 1; i++ }
        END { print (i == n && !bad) ? "yes" : "no" }' "$out")
    first=$(sed -n 's/^step 0: train loss \([0-9.]*\)$/\1/p' "$out")
    last=$(sed -n "s/^step $((STEPS - 1)): train loss \\([0-9.]*\\)\$/\\1/p" "$out")
    result=$(grep -c "^result: loss $last replicas identical\$" "$out")
    procs=$(grep -c "^train dataset num_batches: [0-9]*, processes: $2, B 4, T 32\$" "$out")
    falls=$(awk -v a="${first:-0}" -v b="${last:-9}" 'BEGIN { print (a > 3 && b <= 0.6 * a) ? "yes" : "no" }')
    vals=$(grep -c '^val loss [0-9]*\.[0-9]*$' "$out")
    samples=$(grep -c '^generating:$' "$out")
    if [ $status -ne 0 ]; then
        fail "$2 rank(s): exit status $status"
    elif [ "$lines" -ne $STEPS ] || [ "$in_order" != yes ] || [ "$procs" -ne 1 ]; then
        fail "$2 rank(s): $lines of $STEPS loss lines (in order: $in_order), $procs process-count lines"
    elif [ "$vals" -ne $((STEPS / 10)) ] || [ "$samples" -ne $(((STEPS - 1) / 20)) ]; then
        fail "$2 rank(s): $vals validation lines (expected $((STEPS / 10))), $samples samples (expected $(((STEPS - 1) / 20)))"
    elif [ "$falls" != yes ]; then
        fail "$2 rank(s): the loss went from ${first:-?} to ${last:-?} (expected at most 60% of the first)"
    elif [ "$result" -ne 1 ]; then
        fail "$2 rank(s): no line \"result: loss $last replicas identical\""
    elif [ -s "$tmp/$1.err" ]; then
        fail "$2 rank(s): something on stderr"
    else
        echo "ok   $2 rank(s): exit 0, loss $first -> $last over $STEPS steps, replicas identical"
        return
    fi
    show "$1"
}
train one 1
train two 2
grep -v '^timing ' "$tmp/two.out" >"$tmp/two.nt"

# --overlap on: the same lines as the 2-rank run above (bitwise equal means at 2 ranks), and the
# timing line the overlap benchmark parses.
run overlap env DOPT_WORLD_SIZE=2 DOPT_STDOUT_RANKS=0 "$bin" --steps $STEPS --overlap on
status=$?
timing='^timing steps=[0-9]* step_ms=[0-9.]* wait_ms=[0-9.]* backward_ms=[0-9.]* overlap=on bucket_ms=[0-9.]* bucket_cpu_ms=[0-9.]*$'
if [ $status -eq 0 ] && grep -v '^timing ' "$tmp/overlap.out" | cmp -s - "$tmp/two.nt" && grep -q "$timing" "$tmp/overlap.out" &&
    [ ! -s "$tmp/overlap.err" ]; then
    echo "ok   2 ranks, --overlap on: the same $STEPS loss lines and result as --overlap off, and the timing line"
else
    fail "2 ranks, --overlap on: exit $status; differs from --overlap off, or no timing line"
    grep -v '^timing ' "$tmp/overlap.out" | diff - "$tmp/two.nt" | head -5
    show overlap
fi

# Local steps (--period 4): the marks do nothing, the models are averaged every 4 steps and at the
# end; a model of 2 layers, so that the marks run per layer.
run local_steps env DOPT_WORLD_SIZE=2 DOPT_STDOUT_RANKS=0 "$bin" --steps 20 --period 4 --layers 2 --overlap on
status=$?
if [ $status -eq 0 ] && grep -q '^result: loss [0-9.]* replicas identical$' "$tmp/local_steps.out" && [ ! -s "$tmp/local_steps.err" ]; then
    echo "ok   2 ranks, 2 layers, --period 4 --overlap on: exit 0, replicas identical"
else
    fail "2 ranks, 2 layers, --period 4 --overlap on: exit $status"
    show local_steps
fi

# Without DOPT_STDOUT_RANKS every rank prints, and prints the same lines: each loss line twice.
run both env DOPT_WORLD_SIZE=2 "$bin" --steps 20
status=$?
twice=$(grep '^step \|^val loss ' "$tmp/both.out" | sort | uniq -c | awk '$1 != 2 { bad++ } END { print bad + 0 }')
count=$(grep -c '^step ' "$tmp/both.out")
if [ $status -eq 0 ] && [ "$count" -eq 40 ] && [ "$twice" -eq 0 ]; then
    echo "ok   both ranks' stdout: every loss line printed once by each rank, the same"
else
    fail "both ranks' stdout: exit $status, $count step lines (expected 40), $twice lines not printed exactly twice"
    show both
fi

# The check can fail: rank 1's replica differs at the end.
run desync env DOPT_WORLD_SIZE=2 "$bin" --steps 20 --desync
status=$?
differ='^distopt: rank [01]: dopt_dp_close: the replicas differ after step 20: 1 rank (1) holds other parameters'
says=$(grep -c "$differ" "$tmp/desync.err")
if [ $status -ne 0 ] && [ "$says" -ge 1 ] && ! grep -q '^result:' "$tmp/desync.out"; then
    echo "ok   desynchronised replicas: exit $status, $(grep -m1 'replicas differ' "$tmp/desync.err")"
else
    fail "desynchronised replicas: exit $status, $says \"replicas differ\" lines on stderr (expected a failure)"
    show desync
fi

# A NaN in the last rank's gradient at step 7, in a loop that checks no status: every rank stops
# there, the job exits non-zero with the library's line naming the step and the rank, and the
# loss lines stop being averaged (no result line).
run nan env DOPT_WORLD_SIZE=2 "$bin" --steps 20 --nan-at 7
status=$?
named='^distopt: rank [01]: dopt_dp_after_backward: the gradient average of step 7 is not finite (first at element 12345): the input of rank 1 held NaN or infinity'
says=$(grep -c "$named" "$tmp/nan.err")
if [ $status -eq 1 ] && [ "$says" -ge 1 ] && ! grep -q '^result:' "$tmp/nan.out"; then
    echo "ok   a NaN at step 7: exit 1, $(grep -m1 'not finite' "$tmp/nan.err" | cut -c1-120)..."
else
    fail "a NaN at step 7: exit $status, $says lines naming it on stderr (expected exit 1 and the line)"
    show nan
fi

# The drop-in's size.
counts=$(scripts/count-lines.sh examples/gpt2_standin.c | tr '\n' ' ')
core=$(scripts/count-lines.sh examples/gpt2_standin.c core)
if [ -n "$core" ] && [ "$core" -ge 1 ] && [ "$core" -le $MAX_CORE ]; then
    echo "ok   lines marked distopt: ${counts}(core at most $MAX_CORE)"
else
    fail "lines marked distopt: ${counts}(core at most $MAX_CORE)"
fi

exit $failed
