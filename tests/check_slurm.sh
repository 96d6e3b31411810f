#!/bin/sh
# A real Slurm on this machine (scripts/slurm.sh: its own munged, a slurmctld, two nodes with a
# slurmd each): the variables srun gives its tasks must be the ones launcher-aware code reads;
# least_squares under `srun -n 4` over TCP must reach its optimum, with the same result as 4
# workers over shared memory (same shards, same seeds; the two transports sum in the same order
# today, so the printed figures agree) and on the same problem as 1 process; after down no
# process of the run is left and its directory is gone. Needs root, slurm-wlm and munge (skipped
# otherwise, exit 77). A few seconds; its cluster is named ck<pid>, so runs side by side do not
# collide, nor touch a cluster the caller brought up.
#
# least_squares runs twice under srun: with a wrapper that maps SLURM_PROCID and SLURM_NTASKS to
# DOPT_RANK and DOPT_WORLD_SIZE (meeting point from DOPT_MASTER_ADDR/PORT), and, unless
# SLURM_CHECK_ENV_ONLY=0 (for a tree without dopt_comm_create_from_env), as
# `DOPT_TRANSPORT=tcp srun -n 4 least_squares` with nothing else: rank, size and meeting point
# from Slurm's variables alone, the port from the job and step ids.
# Usage: [SLURM_CHECK_ENV_ONLY=0] tests/check_slurm.sh BUILD_DIR
#
# What srun gave each task here (Slurm 22.05.8 from Debian 12, nodes HOST-0 and HOST-1):
#   srun -n 4 (fits one node): SLURM_PROCID 0..3, SLURM_LOCALID 0..3, SLURM_NODEID 0,
#     SLURM_NTASKS=4 SLURM_STEP_NUM_TASKS=4 SLURM_NNODES=1 SLURM_TASKS_PER_NODE=4
#     SLURM_STEP_TASKS_PER_NODE=4 SLURM_JOB_NODELIST=SLURM_STEP_NODELIST=SLURMD_NODENAME=HOST-0,
#     SLURM_JOB_ID=441001 (decimal; slurm.sh's FirstJobId starts each run's ids elsewhere),
#     SLURM_STEP_ID=0 (a bare srun is a job of its own, always step 0; the steps of one salloc or
#     sbatch allocation count 0, 1, ...), SLURM_LAUNCH_NODE_IPADDR=127.0.0.1 (where srun runs,
#     as its host name resolves: /etc/hosts maps it to loopback here; SLURM_SRUN_COMM_HOST the
#     same), SLURM_GTIDS=0,1,2,3 (the ranks on this node), SLURM_CPUS_ON_NODE=4 and
#     SLURM_JOB_CPUS_PER_NODE=4 (allocated, not the node's 8), and the old names SLURM_JOBID,
#     SLURM_STEPID, SLURM_NPROCS, SLURM_NODELIST. SLURM_CPUS_PER_TASK only with -c.
#   srun -N 2 --ntasks-per-node=2: SLURM_LOCALID 0,1,0,1, SLURM_NODEID 0,0,1,1, SLURM_NNODES=2,
#     SLURM_TASKS_PER_NODE=SLURM_STEP_TASKS_PER_NODE=2(x2), SLURM_JOB_NODELIST=HOST-[0-1] (a
#     compressed host list, whose names need not resolve), SLURM_GTIDS 0,1 and 2,3.
#   Counts per node are comma-separated in node-list order, a run of N equal counts C as C(xN):
#   -N 2 -n 5 gives 4,1. Inside an allocation, srun -n 2 sets SLURM_NTASKS=2 and its step's
#   count per node, not the allocation's.
set -u
BUILD=${1:-build}
cd "$(dirname "$0")/.." || exit 1
if [ "$(id -u)" -ne 0 ]; then echo "skipped: needs root"; exit 77; fi
for prog in munged slurmctld slurmd srun sinfo; do
    command -v "$prog" >/dev/null 2>&1 || { echo "skipped: needs slurm-wlm and munge"; exit 77; }
done
env_only=${SLURM_CHECK_ENV_ONLY:-1}
DOPT_SLURM=ck$$
export DOPT_SLURM
RUN=/run/distopt-slurm/$DOPT_SLURM
OUT=$BUILD/check_slurm.$DOPT_SLURM
# a failed run ends in well under a minute
export OPENBLAS_NUM_THREADS=1 DOPT_TIMEOUT_MS=15000 DOPT_RENDEZVOUS_TIMEOUT_MS=15000
# what a caller's environment holds (a Slurm job of its own, say) must not steer the runs
unset DOPT_RANK DOPT_WORLD_SIZE DOPT_MASTER_ADDR DOPT_MASTER_PORT DOPT_TOKEN DOPT_TRANSPORT
for v in $(env | sed -n 's/^\(SLURM_[A-Za-z0-9_]*\)=.*/\1/p'); do unset "$v"; done
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

trap 'scripts/slurm.sh down >/dev/null 2>&1' EXIT
trap 'exit 1' INT TERM HUP
make --no-print-directory -s BUILD="$BUILD" "$BUILD/least_squares" >/dev/null || { echo "FAIL: cannot build least_squares"; exit 1; }
rm -f "$OUT".*
started=$(date +%s)
env=$(scripts/slurm.sh up 2 2>"$OUT.up.log") || { echo "FAIL: slurm.sh up"; cat "$OUT.up.log"; exit 1; }
eval "$env"
host=$(uname -n)
host=${host%%.*}

# --- a) what srun gives each task ----------------------------------------------------------
var() { sed -n "s/^$3=//p" "$OUT.$1.$2" 2>/dev/null; } # $1: run, $2: task, $3: variable
expect_eq() { # $1: run, $2: task, $3: variable, $4: the value
    got=$(var "$1" "$2" "$3")
    [ "$got" = "$4" ] || fail "srun $1, task $2: $3=\"$got\", expected \"$4\""
}
expect_like() { # $1: run, $2: task, $3: variable, $4: a case pattern
    got=$(var "$1" "$2" "$3")
    # shellcheck disable=SC2254 # $4 is a pattern
    case $got in $4) ;; *) fail "srun $1, task $2: $3=\"$got\", expected $4" ;; esac
}
srun_env() { # $1: run name, then srun's options
    name=$1
    shift
    timeout 60 srun "$@" --output="$OUT.$name.%t" env 2>"$OUT.$name.err" || { fail "srun $* env"; cat "$OUT.$name.err"; }
}

before=$failures
# 4 tasks fit one node's 8 CPUs: one node, local ids equal to global ones.
srun_env n4 -n 4
node=$(var n4 0 SLURMD_NODENAME)
case $node in "$host"-[01]) ;; *) fail "srun -n 4 ran on node \"$node\", not one of $host-0, $host-1" ;; esac
job=$(var n4 0 SLURM_JOB_ID)
step=$(var n4 0 SLURM_STEP_ID)
addr=$(var n4 0 SLURM_LAUNCH_NODE_IPADDR)
expect_like n4 0 SLURM_JOB_ID '[1-9]*[0-9]'
expect_like n4 0 SLURM_STEP_ID '[0-9]*'
expect_like n4 0 SLURM_LAUNCH_NODE_IPADDR '[0-9a-f]*[.:]*[0-9a-f]'
for t in 0 1 2 3; do
    expect_eq n4 $t SLURM_PROCID $t
    expect_eq n4 $t SLURM_LOCALID $t
    expect_eq n4 $t SLURM_NODEID 0
    expect_eq n4 $t SLURM_NTASKS 4
    expect_eq n4 $t SLURM_STEP_NUM_TASKS 4
    expect_eq n4 $t SLURM_NNODES 1
    expect_eq n4 $t SLURM_TASKS_PER_NODE 4
    expect_eq n4 $t SLURM_STEP_TASKS_PER_NODE 4
    expect_eq n4 $t SLURM_JOB_NODELIST "$node"
    expect_eq n4 $t SLURM_STEP_NODELIST "$node"
    expect_eq n4 $t SLURMD_NODENAME "$node"
    expect_eq n4 $t SLURM_JOB_ID "$job"
    expect_eq n4 $t SLURM_STEP_ID "$step"
    expect_eq n4 $t SLURM_LAUNCH_NODE_IPADDR "$addr"
done
# 2 tasks on each of 2 nodes: the node list compressed, counts per node as "2(x2)".
srun_env n2x2 -N 2 --ntasks-per-node=2
for t in 0 1 2 3; do
    expect_eq n2x2 $t SLURM_PROCID $t
    expect_eq n2x2 $t SLURM_LOCALID $((t % 2))
    expect_eq n2x2 $t SLURM_NODEID $((t / 2))
    expect_eq n2x2 $t SLURMD_NODENAME "$host-$((t / 2))"
    expect_eq n2x2 $t SLURM_NTASKS 4
    expect_eq n2x2 $t SLURM_NNODES 2
    expect_eq n2x2 $t SLURM_TASKS_PER_NODE "2(x2)"
    expect_eq n2x2 $t SLURM_STEP_TASKS_PER_NODE "2(x2)"
    expect_eq n2x2 $t SLURM_JOB_NODELIST "$host-[0-1]"
    expect_eq n2x2 $t SLURM_STEP_NODELIST "$host-[0-1]"
done
[ "$failures" -eq "$before" ] && echo "ok   srun -n 4 and -N 2 --ntasks-per-node=2: every task's SLURM_* as expected (node $node, job $job, step $step, launch node $addr)"

# --- b) least_squares under srun --------------------------------------------------------------
least_squares() { "$BUILD/least_squares" --steps 3000 --seed 7 "$@"; }
ref_shm=$(least_squares --transport shm --workers 4) || fail "least_squares --transport shm --workers 4: $ref_shm"
ref_self=$(least_squares --transport self) || fail "least_squares --transport self: $ref_self"
xstar() { printf '%s\n' "$1" | sed -n 's/.*(|x\*| = \([^)]*\)).*/\1/p'; }

# $1: run name, $2: how to call it; then the command srun starts (srun -n 4, a file per task)
srun_least_squares() {
    name=$1 what=$2
    shift 2
    status=0
    timeout 40 srun -n 4 --kill-on-bad-exit=1 --output="$OUT.$name.%t" "$@" || status=$?
    line=$(tail -n 1 "$OUT.$name.0" 2>/dev/null)
    others=$(cat "$OUT.$name.1" "$OUT.$name.2" "$OUT.$name.3" 2>/dev/null | grep '^least_squares:')
    if [ "$status" -ne 0 ]; then
        fail "srun -n 4 $what: exit $status; rank 0: $line"
        tail -n 3 "$OUT.$name".[0-3] 2>&1
    elif [ -n "$others" ]; then
        fail "srun -n 4 $what: ranks 1-3 printed a result too (4 separate runs?); rank 0: $line"
        tail -n 3 "$OUT.$name".[0-3] 2>&1
    elif [ "${line#least_squares: *, }" != "${ref_shm#least_squares: shm, }" ]; then
        # the same ranks, shards and seeds as the shm run: the same figures
        fail "srun -n 4 $what: rank 0 says \"$line\"; 4 workers over shm say \"$ref_shm\""
    elif [ "$(xstar "$line")" != "$(xstar "$ref_self")" ]; then
        fail "srun -n 4 $what: |x*| differs from the serial run's (\"$line\" against \"$ref_self\")"
    else
        echo "ok   srun -n 4 $what: $line"
    fi
}

port=$((24000 + $$ % 8000)) # above slurm.sh's ports, below the ephemeral ones
# shellcheck disable=SC2016 # the wrapper expands the variables in each task
srun_least_squares explicit "least_squares --transport tcp, DOPT_RANK=\$SLURM_PROCID etc. by a wrapper" \
    env DOPT_MASTER_ADDR=127.0.0.1 DOPT_MASTER_PORT=$port DOPT_TOKEN=check-slurm-$$ \
    sh -c 'DOPT_RANK=$SLURM_PROCID DOPT_WORLD_SIZE=$SLURM_NTASKS exec "$0" --transport tcp --steps 3000 --seed 7' \
    "$BUILD/least_squares"
if [ "$env_only" != 0 ]; then
    srun_least_squares envonly "least_squares, DOPT_TRANSPORT=tcp and nothing else" \
        env DOPT_TRANSPORT=tcp "$BUILD/least_squares" --steps 3000 --seed 7
fi

# --- c) down leaves nothing -------------------------------------------------------------------
before=$failures
daemons=$(cat "$RUN"/*.pid 2>/dev/null)
scripts/slurm.sh down || fail "slurm.sh down"
trap - EXIT
unset SLURM_CONF
[ -e "$RUN" ] && fail "slurm.sh down left $RUN"
alive() { s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1; s=${s##*) }; [ "${s%% *}" != Z ]; }
for p in $daemons; do alive "$p" && fail "daemon pid $p is still running: $(tr '\0' ' ' <"/proc/$p/cmdline")"; done
# any process that names the run directory, has a file in it open, or is a client of its cluster
named=$(grep -laF "$RUN/" /proc/[0-9]*/cmdline /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | sort -u)
for p in $named; do alive "$p" && fail "pid $p still names $RUN: $(tr '\0' ' ' <"/proc/$p/cmdline")"; done
# shellcheck disable=SC2010 # the names are /proc's; ls -l shows where the links point
held=$(ls -l /proc/[0-9]*/cwd /proc/[0-9]*/fd 2>/dev/null | grep -E -- "-> $RUN(/| \(deleted\)|$)")
[ -n "$held" ] && fail "files of $RUN still open: $held"
# shellcheck disable=SC2086 # one pid per word
[ "$failures" -eq "$before" ] && echo "ok   down: daemons$(printf ' %s' $daemons) gone, no process of the run left, $RUN removed ($(($(date +%s) - started)) s in all)"
[ "$failures" -eq 0 ] || exit 1
rm -f "$OUT".*
