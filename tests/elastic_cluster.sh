#!/bin/sh
# make elastic-test on the simulated cluster: 4 hosts (network namespaces, 1 Gbit/s links), one
# rank of build/elastic_sgd on each, 20 trials of tests/elastic_trials.c killing a random rank;
# then the same with build/fmnist_mlp --elastic on (its test accuracy against an undisturbed run).
# Root only (prints "skipped: needs root" and exits 0 otherwise, as make elastic-test's second
# half). Usage: tests/elastic_cluster.sh BUILD_DIR [TRIALS]
set -u
BUILD=${1:-build}
TRIALS=${2:-20}
cd "$(dirname "$0")/.." || exit 1
if [ "$(id -u)" -ne 0 ]; then echo "elastic cluster: skipped: needs root (network namespaces)"; exit 0; fi
DOPT_CLUSTER=el$$
export DOPT_CLUSTER
trap 'scripts/cluster.sh down' EXIT
log=$(mktemp)
scripts/cluster.sh up 4 --rate 1gbit >"$log" 2>&1 || { echo "FAIL: cluster.sh up"; cat "$log"; rm -f "$log"; exit 1; }
rm -f "$log"
status=0
"$BUILD/elastic_trials" "$BUILD" "$TRIALS" "$(scripts/cluster.sh addr 0),$(scripts/cluster.sh addr 1),$(scripts/cluster.sh addr 2),$(scripts/cluster.sh addr 3)" || status=1
OPENBLAS_NUM_THREADS=1 "$BUILD/elastic_trials" "$BUILD" "$TRIALS" "$(scripts/cluster.sh addr 0),$(scripts/cluster.sh addr 1),$(scripts/cluster.sh addr 2),$(scripts/cluster.sh addr 3)" mlp || status=1
exit $status
