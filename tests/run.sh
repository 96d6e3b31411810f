#!/bin/sh
# Runs every test program built into the build directory ($1, default build) and prints the total
# as the last line: "N passed, N failed, N skipped" (skipped: what this machine cannot run, e.g.
# without root; never counted as passed). Exits 1 when anything failed.
# Programs named test_* use dtest and print a "dtest-summary" line; check_* programs are compile
# and link checks that pass by exiting 0, as do the scripts tests/check_*.sh (given the build
# directory); test_mpi* run under mpirun at the world sizes they need.
BUILD=${1:-build}
passed=0
failed=0
skipped=0

count_summary() { # $1: file holding a program's output, $2: its exit status, $3: its name
    line=$(grep '^dtest-summary ' "$1" | tail -1)
    if [ -z "$line" ]; then
        echo "FAIL $3: exited with status $2 and no summary"
        failed=$((failed + 1))
        return
    fi
    p=$(echo "$line" | sed 's/.*passed=\([0-9]*\).*/\1/')
    f=$(echo "$line" | sed 's/.*failed=\([0-9]*\).*/\1/')
    k=$(echo "$line" | sed -n 's/.*skipped=\([0-9]*\).*/\1/p')
    if [ "$2" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    passed=$((passed + p))
    failed=$((failed + f))
    skipped=$((skipped + ${k:-0}))
}

out=$(mktemp)
# The flight recorder's files (distopt.h: FLIGHT RECORDER) go to a directory of this run's own,
# removed at the end (the ranks of failing jobs, which many tests make on purpose, keep theirs),
# so make test leaves nothing in /dev/shm: checked below.
DOPT_RECORDER_DIR=$(mktemp -d /tmp/distopt-rec-XXXXXX)
export DOPT_RECORDER_DIR
stamp="$DOPT_RECORDER_DIR/.started"
: >"$stamp"
trap 'rm -f "$out"; rm -rf "$DOPT_RECORDER_DIR"' EXIT

for t in "$BUILD"/check_*; do
    [ -f "$t" ] && [ -x "$t" ] || continue
    name=$(basename "$t")
    if "$t" >"$out" 2>&1; then
        echo "ok   $name"
        passed=$((passed + 1))
    else
        echo "FAIL $name"; cat "$out"
        failed=$((failed + 1))
    fi
done

for t in tests/check_*.sh; do # exit 77: skipped, the last line saying why
    name=$(basename "$t" .sh)
    status=0
    "$t" "$BUILD" >"$out" 2>&1 || status=$?
    if [ "$status" -eq 0 ]; then
        echo "ok   $name"
        passed=$((passed + 1))
    elif [ "$status" -eq 77 ]; then
        echo "skip $name: $(tail -n 1 "$out")"
        skipped=$((skipped + 1))
    else
        echo "FAIL $name"; cat "$out"
        failed=$((failed + 1))
    fi
done

for t in "$BUILD"/test_*; do
    [ -f "$t" ] && [ -x "$t" ] || continue
    name=$(basename "$t")
    case "$name" in test_mpi*) continue ;; esac
    echo "== $name"
    "$t" 2>&1 | tee "$out"
    status=$(tail -1 "$out" | grep -q '^dtest-summary .* failed=0\( \|$\)' && echo 0 || echo 1)
    count_summary "$out" "$status" "$name"
done

MPIRUN="mpirun --allow-run-as-root --oversubscribe --mca btl_vader_single_copy_mechanism none"
for t in "$BUILD"/test_mpi*; do
    [ -f "$t" ] && [ -x "$t" ] || continue
    for np in 2 3; do
        name="$(basename "$t") (mpirun -np $np)"
        echo "== $name"
        status=0
        timeout 300 $MPIRUN -np $np "$t" >"$out" 2>&1 || status=$?
        awk '!/^dtest-summary / || !seen[$0]++' "$out" # every rank prints the same summary: once
        # every rank prints a summary; count rank 0's
        grep '^dtest-summary ' "$out" | head -1 >"$out.sum" || true
        [ -s "$out.sum" ] || echo "dtest-summary x passed=0 failed=1" >"$out.sum"
        count_summary "$out.sum" "$status" "$name"
        rm -f "$out.sum"
    done
done

left=$(find /dev/shm -maxdepth 1 -name 'dopt-rec.*' -newer "$stamp" 2>/dev/null || true)
if [ -n "$left" ]; then
    echo "FAIL recorder files left in /dev/shm (DOPT_RECORDER_DIR was not used):"; echo "$left"
    failed=$((failed + 1))
else
    echo "ok   no recorder file left in /dev/shm"
    passed=$((passed + 1))
fi

echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
