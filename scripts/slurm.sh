#!/bin/sh
# A real Slurm on this machine, for tests: its own munged, a slurmctld and one slurmd per node,
# all under a private run directory, reached through loopback only. Root only (exit 77 otherwise).
#
#   eval "$(scripts/slurm.sh up [NODES])"   start; prints the lines to eval (export SLURM_CONF=...)
#   srun -n 4 ...                            any client, with that SLURM_CONF
#   scripts/slurm.sh status                  the daemons and sinfo; exit 3 when not running
#   scripts/slurm.sh down                    stop everything this run started, remove its directory
#
# The run's name, DOPT_SLURM (default "ds"), names everything: the directory
# /run/distopt-slurm/NAME holds the munge key, socket and log, slurm.conf, the state, spool, pid
# and log files; the cluster is NAME too. Two runs with different names do not collide: each has
# its own munged (a system munge, if one runs, is left alone), its own ports, its own job ids.
# NODES simulated nodes (default 1; 1 to 8) each get a slurmd of their own on this machine: one
# node is named after the host (so the node list resolves), several are HOST-0, HOST-1, ... (they
# do not resolve; their address, 127.0.0.1, is in slurm.conf). Each node has DOPT_SLURM_CPUS CPUs
# (default 8, whatever the hardware has), so srun -n 8 runs on a 2-core machine.
# Ports: slurmctld on P, the slurmds on P+1 ..., where P (DOPT_SLURM_PORT, else 16000 + 10k from a
# checksum of the name, below 24000) is moved on by 10 until no socket uses these ports.
# `up` first removes a run of the same name left by a killed process, waits for every node to be
# idle (DOPT_SLURM_TIMEOUT seconds, default 30), and on failure prints the logs' tails and
# removes what it made. `down` cancels the cluster's jobs, stops the daemons by their pid files
# and any step daemon (slurmstepd) of this run with its tasks, then removes the directory.
set -eu

NAME=${DOPT_SLURM:-ds}
RUN=/run/distopt-slurm/$NAME
CONF=$RUN/slurm.conf

die() { echo "slurm.sh: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" -eq 0 ] || { echo "skipped: needs root" >&2; exit 77; }; }
need_slurm() {
    for prog in munged slurmctld slurmd sinfo squeue scancel; do
        command -v "$prog" >/dev/null 2>&1 || { echo "skipped: needs slurm-wlm and munge" >&2; exit 77; }
    done
}

check_name() {
    case $NAME in '' | *[!a-z0-9_-]*) die "DOPT_SLURM must be lower-case letters, digits, _ and - (got \"$NAME\")" ;; esac
    [ ${#NAME} -le 32 ] || die "DOPT_SLURM must be at most 32 characters (got ${#NAME})"
}

alive() { # $1: pid; a zombie counts as gone
    a_stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    a_stat=${a_stat##*) }
    [ "${a_stat%% *}" != Z ]
}

# The processes that name RUN in their command line or hold a file in it open (the step daemons
# keep the slurmd log open and sit in RUN), among the programs $@ (a shell sitting in RUN or a
# `tail -f` of its logs is not ours to stop).
run_pids() {
    {
        grep -laF "$RUN/" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3
        # shellcheck disable=SC2012 # the names are /proc's; ls -l shows where the links point
        ls -l /proc/[0-9]*/cwd /proc/[0-9]*/fd 2>/dev/null | RUN=$RUN awk '
            /^\/proc\/[0-9]+\/fd:$/ { split($0, part, "/"); pid = part[3]; next }
            / -> / {
                target = substr($0, index($0, " -> ") + 4)
                if ($0 ~ /\/proc\/[0-9]+\/cwd -> /) { pid = $0; sub(/ -> .*/, "", pid); sub(/.*\/proc\//, "", pid); sub(/\/cwd$/, "", pid) }
                if (target == ENVIRON["RUN"] || index(target, ENVIRON["RUN"] "/") == 1 || index(target, ENVIRON["RUN"] " ") == 1)
                    print pid
            }'
    } | sort -un | while read -r p; do
        r_comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
        for prog in "$@"; do if [ "$r_comm" = "$prog" ]; then echo "$p"; fi; done
    done
}

# The clients of this cluster (their SLURM_CONF is CONF): an srun whose step is gone waits forever.
client_pids() {
    grep -lzxF "SLURM_CONF=$CONF" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | while read -r p; do
        case $(cat "/proc/$p/comm" 2>/dev/null) in srun | salloc | sbatch | sattach) echo "$p" ;; esac
    done
}

with_descendants() { # pids on stdin; prints them and all their descendants
    w_roots=$(tr '\n' ' ')
    [ -n "${w_roots# }" ] || return 0
    ps -e -o pid= -o ppid= | awk -v roots="$w_roots" '
        BEGIN { n = split(roots, root, " "); for (i = 1; i <= n; i++) keep[root[i]] = 1 }
        { parent[$1] = $2 }
        END {
            do {
                grown = 0
                for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; grown = 1 }
            } while (grown)
            for (p in keep) print p
        }'
}

stop_pids() { # $1: signal, then pids; waits up to 5 s for them to go; prints those left
    s_sig=$1
    shift
    for p in "$@"; do kill "-$s_sig" "$p" 2>/dev/null || true; done
    s_tries=0
    while [ "$s_tries" -lt 50 ]; do
        s_left=""
        for p in "$@"; do if alive "$p"; then s_left="$s_left $p"; fi; done
        [ -z "$s_left" ] && return 0
        sleep 0.1
        s_tries=$((s_tries + 1))
    done
    echo "$s_left"
}

down() {
    [ -d "$RUN" ] || return 0
    if [ -f "$RUN/slurmctld.pid" ] && alive "$(cat "$RUN/slurmctld.pid")"; then
        jobs=$(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086 # one job id per word
            SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
            d_tries=0
            while [ -n "$(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null)" ] && [ "$d_tries" -lt 50 ]; do
                sleep 0.1
                d_tries=$((d_tries + 1))
            done
        fi
    fi
    # What a killed run left: steps (slurmstepd ignores SIGTERM) with their tasks, and the
    # clients that waited for them.
    steps=$({ run_pids slurmstepd; client_pids; } | with_descendants)
    left=""
    # shellcheck disable=SC2086 # one pid per word
    [ -z "$steps" ] || left=$(stop_pids KILL $steps)
    [ -z "$left" ] || die "down: step processes $left of run $NAME will not stop"
    pids=""
    for f in "$RUN"/*.pid; do # written by the daemons: munged.pid, slurmctld.pid, slurmd-NODE.pid
        [ -f "$f" ] || continue
        p=$(cat "$f" 2>/dev/null || true)
        case $p in '' | *[!0-9]*) continue ;; esac
        # a pid recorded by a run killed long ago may belong to someone else by now
        if grep -qF "$RUN/" "/proc/$p/cmdline" 2>/dev/null; then pids="$pids $p"; fi
    done
    # shellcheck disable=SC2086 # one pid per word
    pids=$({ printf '%s\n' $pids; run_pids munged slurmctld slurmd; } | with_descendants | sort -un)
    if [ -n "$pids" ]; then
        # shellcheck disable=SC2086 # one pid per word
        left=$(stop_pids TERM $pids)
        # shellcheck disable=SC2086
        [ -z "$left" ] || left=$(stop_pids KILL $left)
        [ -z "$left" ] || die "down: processes$left of run $NAME will not stop"
    fi
    rm -rf "$RUN"
}

port_in_use() { # $1: port; 1 when a TCP socket (v4 or v6, any state) has it as its local port
    hex=$(printf '%04X' "$1")
    cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk -v hex="$hex" '
        NR > 0 { n = split($2, part, ":"); if (part[n] == hex) found = 1 }
        END { exit !found }'
}

pick_port() { # $1: nodes; prints P such that P .. P+nodes are free
    if [ -n "${DOPT_SLURM_PORT:-}" ]; then
        case $DOPT_SLURM_PORT in *[!0-9]*) die "DOPT_SLURM_PORT must be a port number (got \"$DOPT_SLURM_PORT\")" ;; esac
        echo "$DOPT_SLURM_PORT"
        return
    fi
    slot=$(($(printf '%s' "$NAME" | cksum | cut -d' ' -f1) % 800))
    tries=0
    while [ "$tries" -lt 100 ]; do
        base=$((16000 + 10 * ((slot + tries) % 800)))
        k=0
        while [ "$k" -le "$1" ] && ! port_in_use $((base + k)); do k=$((k + 1)); done
        [ "$k" -gt "$1" ] && { echo "$base"; return; }
        tries=$((tries + 1))
    done
    die "no free ports for slurmctld and $1 slurmd(s) between 16000 and 24000"
}

write_conf() { # $1: nodes, $2: first port, $3: host name
    cpus=${DOPT_SLURM_CPUS:-8}
    cat <<EOF
# Written by scripts/slurm.sh for run $NAME; removed by scripts/slurm.sh down.
ClusterName=$NAME
SlurmctldHost=localhost
SlurmctldPort=$2
SlurmdPort=$(($2 + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$RUN/munge.socket
StateSaveLocation=$RUN/state
SlurmdSpoolDir=$RUN/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$RUN/slurmctld.log
SlurmdLogFile=$RUN/slurmd-%n.log
# Job ids of different runs differ (a launcher may derive a port from them).
FirstJobId=$((1 + 1000 * ($(printf '%s' "$NAME" | cksum | cut -d' ' -f1) % 10000)))
# No cgroups, no accounting, no task binding: nothing needs setting up in a container.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Nodes have more CPUs than the hardware: take slurm.conf's figures, not the detected ones.
SlurmdParameters=config_overrides
# A cancelled job's tasks get SIGKILL 2 s after SIGTERM (default 30 s): down is quick.
KillWait=2
EOF
    if [ "$1" -eq 1 ]; then
        echo "NodeName=$3 NodeAddr=127.0.0.1 Port=$(($2 + 1)) CPUs=$cpus"
    else
        i=0
        while [ "$i" -lt "$1" ]; do
            echo "NodeName=$3-$i NodeHostname=$3 NodeAddr=127.0.0.1 Port=$(($2 + 1 + i)) CPUs=$cpus"
            i=$((i + 1))
        done
    fi
    echo "PartitionName=$NAME Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

log_tails() {
    for f in "$RUN"/*.log; do
        [ -f "$f" ] || continue
        echo "--- $f (last 15 lines)"
        tail -n 15 "$f"
    done >&2
}

fail() { echo "slurm.sh: up: $*" >&2; log_tails; exit 1; }

down_unless_ok() { [ "$1" -eq 0 ] || down; }

node_names() { # $1: nodes, $2: host
    if [ "$1" -eq 1 ]; then echo "$2"; return; fi
    i=0
    while [ "$i" -lt "$1" ]; do echo "$2-$i"; i=$((i + 1)); done
}

up() {
    nodes=${1:-1}
    case $nodes in '' | *[!0-9]*) die "up takes a number of nodes (got \"$nodes\")" ;; esac
    if [ "$nodes" -lt 1 ] || [ "$nodes" -gt 8 ]; then die "1 to 8 nodes (got $nodes)"; fi
    timeout=${DOPT_SLURM_TIMEOUT:-30}
    host=$(uname -n)
    host=${host%%.*}
    started=$(date +%s)
    down
    trap 'down; exit 1' INT TERM
    trap 'down_unless_ok $?' EXIT
    # munged refuses a socket directory that others cannot enter or may write to
    mkdir -p /run/distopt-slurm
    chmod 755 /run/distopt-slurm
    mkdir -m 755 "$RUN"
    mkdir -p "$RUN/state" "$RUN/spool"

    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile="$RUN/munge.key" || fail "mungekey could not write $RUN/munge.key"
    else
        dd if=/dev/urandom of="$RUN/munge.key" bs=1024 count=1 2>/dev/null
    fi
    chmod 600 "$RUN/munge.key"
    munged --socket="$RUN/munge.socket" --key-file="$RUN/munge.key" --pid-file="$RUN/munged.pid" \
        --log-file="$RUN/munged.log" --seed-file="$RUN/munged.seed" || fail "munged did not start"

    port=$(pick_port "$nodes")
    write_conf "$nodes" "$port" "$host" >"$CONF"
    slurmctld -f "$CONF" || fail "slurmctld did not start"
    for node in $(node_names "$nodes" "$host"); do
        mkdir -p "$RUN/spool/$node"
        slurmd -f "$CONF" -N "$node" || fail "slurmd for node $node did not start"
    done

    export SLURM_CONF="$CONF"
    while :; do
        idle=$(sinfo -h -N -o '%t' 2>/dev/null | grep -c '^idle$' || true)
        [ "$idle" -eq "$nodes" ] && break
        for f in "$RUN"/slurmctld.pid "$RUN"/slurmd-*.pid; do
            if [ -f "$f" ] && ! alive "$(cat "$f")"; then fail "$(basename "$f" .pid) exited"; fi
        done
        [ $(($(date +%s) - started)) -lt "$timeout" ] ||
            fail "after ${timeout} s, $idle of $nodes node(s) idle; sinfo says: $(sinfo -h -N -o '%N %t %E' 2>&1 | tr '\n' ';')"
        sleep 0.2
    done
    trap - INT TERM EXIT
    echo "slurm.sh: cluster $NAME up in $(($(date +%s) - started)) s: $nodes node(s) ($(node_names "$nodes" "$host" | tr '\n' ' ' | sed 's/ $//'), ${DOPT_SLURM_CPUS:-8} CPUs each), slurmctld on port $port, slurmd on $((port + 1))$([ "$nodes" -gt 1 ] && echo "-$((port + nodes))"), run directory $RUN" >&2
    echo "export SLURM_CONF=$CONF"
    echo "export DOPT_SLURM=$NAME"
}

status() {
    if [ ! -d "$RUN" ]; then
        echo "cluster $NAME: not running"
        exit 3
    fi
    st=0
    for f in "$RUN"/*.pid; do
        [ -f "$f" ] || continue
        p=$(cat "$f")
        d=$(basename "$f" .pid)
        if alive "$p"; then echo "$d: pid $p"; else echo "$d: pid $p is gone"; st=1; fi
    done
    SLURM_CONF=$CONF sinfo -N -o '%N %t %c %E' || st=1
    echo "export SLURM_CONF=$CONF"
    exit $st
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
up) need_root; need_slurm; check_name; up "$@" ;;
down) need_root; check_name; down ;;
status) need_root; check_name; status ;;
*) die "usage: [DOPT_SLURM=NAME] slurm.sh up [NODES] | status | down" ;;
esac
