#!/bin/sh
# A cluster of simulated hosts on this machine: network namespaces joined through a bridge, each
# host's link shaped by tc. Root only. Only the namespaces' own addresses and loopback are used.
#
#   scripts/cluster.sh up H [--rate 1gbit] [--delay 0.5ms] [--loss 0.01] [--ipv6] [--no-ipv4]
#                           [--second-net]
#   scripts/cluster.sh exec HOST CMD ...      run CMD on host HOST (0 .. H-1)
#   scripts/cluster.sh addr HOST [IFACE]      the host's address on eth0 or IFACE (IPv4, else IPv6)
#   scripts/cluster.sh hostfile SLOTS         an Open MPI hostfile: every host with SLOTS slots
#   scripts/cluster.sh mpirun PER_HOST ARGS   Open MPI's mpirun across the hosts (OPEN MPI below)
#   scripts/cluster.sh down                   remove everything (also what a killed run left)
#
# Names carry the cluster's name, DOPT_CLUSTER (default "dc"), so that two runs with different
# names cannot collide: namespaces NAME-h0 .., bridge NAME-br, veths NAME-v0 ... Host i has
# 10.231.0.(i+1)/24 (and fd00:dc::(i+1)/64 with --ipv6) on its eth0. --rate shapes each host's
# link both ways with tbf (egress of the host's eth0 and of its bridge port); --delay needs
# netem, which some kernels lack: up then says the delay is absent and goes on; --loss P drops
# each packet arriving at a host with probability P (iptables' statistic match); --second-net
# gives every host a second network on eth1 (bridge NAME-br1, 10.232.0.(i+1)/24 and
# fd00:dd::(i+1)/64 with --ipv6, not shaped), to choose between by name. `up` first
# removes a cluster of the same name left by a killed run; a trap removes a half-made one.
#
# OPEN MPI. `mpirun PER_HOST ARGS` runs mpirun ARGS on host 0 (so that it and its daemons meet
# on the hosts' own addresses; the root namespace gets none) with PER_HOST slots on every host,
# hence PER_HOST x H ranks unless ARGS has -np. Hosts are named NAME-hI in the hostfile; mpirun
# starts host 0's ranks itself and the other hosts' daemons through scripts/netns-rsh, its rsh
# agent, which reaches NAME-hI with `ip netns exec`. mpirun and every daemon run in a UTS
# namespace whose hostname is NAME-hI: with the one hostname they would all share, the ranks of
# different hosts take the same names for their shared-memory segments and session directories
# (vader crashes). Ranks of one host find each other local and use shared memory (vader); ranks
# of different hosts use TCP over the shaped links. Options:
#   --mca plm_rsh_agent .../netns-rsh      start each host's daemon in its namespace
#   --mca oob_tcp_if_include eth0          daemons and mpirun talk over the hosts' links ...
#   --mca btl_tcp_if_include eth0          ... and so do ranks (every host's link is its eth0)
#   --mca mpi_yield_when_idle 1            H x PER_HOST ranks share this machine's cores, but
#                                          each daemon sees all of them and so no oversubscription:
#                                          ranks that spin instead of yielding starve each other
#   --mca btl_vader_single_copy_mechanism none   as tests/run.sh: CMA needs ptrace rights that
#                                          containers often deny
set -eu

NAME=${DOPT_CLUSTER:-dc}
STATE=/run/distopt-cluster/$NAME

die() { echo "cluster.sh: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" -eq 0 ] || { echo "skipped: needs root" >&2; exit 77; }; }
hosts() { cat "$STATE/hosts" 2>/dev/null || echo 0; }

hostfile() {
    case $1 in '' | *[!0-9]* | 0) die "hostfile needs a number of slots per host (got \"$1\")" ;; esac
    h_n=$(hosts)
    [ "$h_n" -gt 0 ] || die "no cluster $NAME"
    h_i=0
    while [ "$h_i" -lt "$h_n" ]; do
        echo "$NAME-h$h_i slots=$1"
        h_i=$((h_i + 1))
    done
}

run_mpirun() {
    per_host=${1:-}
    [ $# -gt 0 ] && shift
    [ "$(hosts)" -gt 0 ] || die "no cluster $NAME"
    command -v mpirun >/dev/null 2>&1 || die "mpirun needs Open MPI (apt-get install openmpi-bin)"
    hostfile "$per_host" >"$STATE/hostfile"
    # shellcheck disable=SC2016 # $1 is the inner shell's
    exec ip netns exec "$NAME-h0" unshare --uts -- sh -c 'hostname "$1" && shift && exec "$@"' sh "$NAME-h0" \
        mpirun --allow-run-as-root --hostfile "$STATE/hostfile" \
        --mca plm_rsh_agent "$(cd "$(dirname "$0")" && pwd)/netns-rsh" \
        --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0 \
        --mca mpi_yield_when_idle 1 --mca btl_vader_single_copy_mechanism none "$@"
}

down() { # (sh has no local variables: this one's are d_*)
    d_n=$(hosts)
    d_i=0
    # namespaces of a half-made cluster too: any NAME-hK that exists; what still runs on a host
    # (the daemons and ranks of a killed mpirun) is ended first
    for ns in $(ip netns list 2>/dev/null | awk '{ print $1 }' | grep -E "^$NAME-h[0-9]+$" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "${TMPDIR:-/tmp}/ompi.$NAME-h"[0-9]* # Open MPI's session directories, left by a killed mpirun
    while [ "$d_i" -lt "$d_n" ]; do
        ip link del "$NAME-v$d_i" 2>/dev/null || true
        ip link del "$NAME-w$d_i" 2>/dev/null || true
        d_i=$((d_i + 1))
    done
    ip link del "$NAME-br" 2>/dev/null || true
    ip link del "$NAME-br1" 2>/dev/null || true
    rm -rf "$STATE"
}

up() {
    n=$1
    shift
    rate="" delay="" loss="" v6=0 v4=1 second=0
    while [ $# -gt 0 ]; do
        case $1 in
        --rate) rate=$2; shift 2 ;;
        --delay) delay=$2; shift 2 ;;
        --loss) loss=$2; shift 2 ;;
        --ipv6) v6=1; shift ;;
        --no-ipv4) v4=0; v6=1; shift ;;
        --second-net) second=1; shift ;;
        *) die "unknown option $1" ;;
        esac
    done
    case $n in '' | *[!0-9]*) die "up needs a number of hosts (got \"$n\")" ;; esac
    [ "$n" -ge 1 ] && [ "$n" -le 64 ] || die "1 to 64 hosts (got $n)"
    down
    mkdir -p "$STATE"
    trap 'down; exit 1' INT TERM
    trap 'status=$?; [ $status -eq 0 ] || down' EXIT
    ip link add "$NAME-br" type bridge
    ip link set "$NAME-br" up
    if [ "$second" -eq 1 ]; then
        ip link add "$NAME-br1" type bridge
        ip link set "$NAME-br1" up
    fi
    netem=1
    if [ -n "$delay" ] && ! tc qdisc add dev "$NAME-br" root netem delay "$delay" 2>/dev/null; then
        netem=0
        echo "cluster.sh: this kernel has no netem: links get no delay (--delay $delay ignored)"
    fi
    [ -n "$delay" ] && [ "$netem" -eq 1 ] && tc qdisc del dev "$NAME-br" root
    i=0
    while [ "$i" -lt "$n" ]; do
        ns=$NAME-h$i
        ip netns add "$ns"
        ip link add "$NAME-v$i" type veth peer name "$NAME-e$i"
        ip link set "$NAME-e$i" netns "$ns"
        ip -n "$ns" link set "$NAME-e$i" name eth0
        ip link set "$NAME-v$i" master "$NAME-br"
        ip link set "$NAME-v$i" up
        ip -n "$ns" link set lo up
        [ "$v4" -eq 1 ] && ip -n "$ns" addr add "10.231.0.$((i + 1))/24" dev eth0
        [ "$v6" -eq 1 ] && ip -n "$ns" addr add "fd00:dc::$((i + 1))/64" dev eth0 nodad
        ip -n "$ns" link set eth0 up
        if [ "$second" -eq 1 ]; then # eth1: a second network, not shaped
            ip link add "$NAME-w$i" type veth peer name "$NAME-f$i"
            ip link set "$NAME-f$i" netns "$ns"
            ip -n "$ns" link set "$NAME-f$i" name eth1
            ip link set "$NAME-w$i" master "$NAME-br1"
            ip link set "$NAME-w$i" up
            [ "$v4" -eq 1 ] && ip -n "$ns" addr add "10.232.0.$((i + 1))/24" dev eth1
            [ "$v6" -eq 1 ] && ip -n "$ns" addr add "fd00:dd::$((i + 1))/64" dev eth1 nodad
            ip -n "$ns" link set eth1 up
        fi
        if [ -n "$rate" ] || { [ -n "$delay" ] && [ "$netem" -eq 1 ]; }; then
            for side in "-n $ns eth0" "$NAME-v$i"; do
                dev=${side##* }
                nsopt=${side% *}
                [ "$nsopt" = "$side" ] && nsopt=""
                # shellcheck disable=SC2086 # nsopt is "-n NS" or nothing
                if [ -n "$delay" ] && [ "$netem" -eq 1 ]; then
                    tc $nsopt qdisc add dev "$dev" root handle 1: netem delay "$delay"
                    [ -n "$rate" ] && tc $nsopt qdisc add dev "$dev" parent 1: handle 2: tbf rate "$rate" burst 256kb latency 50ms
                else
                    tc $nsopt qdisc add dev "$dev" root tbf rate "$rate" burst 256kb latency 50ms
                fi
            done
        fi
        if [ -n "$loss" ]; then
            command -v iptables >/dev/null 2>&1 || die "--loss needs iptables (apt-get install iptables)"
            ip netns exec "$ns" iptables -A INPUT -i eth0 -m statistic --mode random --probability "$loss" -j DROP
        fi
        i=$((i + 1))
        echo "$i" >"$STATE/hosts"
    done
    trap - INT TERM EXIT
    echo "cluster $NAME: $n hosts${rate:+, links at $rate}$( [ -n "$delay" ] && [ "$netem" -eq 1 ] && echo ", delay $delay")${loss:+, loss $loss}: $(i=0; while [ $i -lt "$n" ]; do printf '%s ' "$(addr "$i")"; i=$((i + 1)); done)"
}

addr() { # $1 host, $2 interface (eth0)
    ns=$NAME-h$1
    dev=${2:-eth0}
    a=$(ip -n "$ns" -4 -o addr show dev "$dev" 2>/dev/null | awk '{ split($4, a, "/"); print a[1] }')
    [ -n "$a" ] || a=$(ip -n "$ns" -6 -o addr show dev "$dev" scope global 2>/dev/null | awk '{ split($4, a, "/"); print a[1] }')
    [ -n "$a" ] || die "no host $1 in cluster $NAME"
    echo "$a"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
up) need_root; up "$@" ;;
down) need_root; down ;;
exec)
    need_root
    [ $# -ge 2 ] || die "exec HOST CMD ..."
    h=$1
    shift
    ip netns list | awk '{ print $1 }' | grep -qx "$NAME-h$h" || die "no host $h in cluster $NAME"
    exec ip netns exec "$NAME-h$h" "$@" ;;
addr) need_root; addr "${1:?addr HOST [IFACE]}" "${2:-}" ;;
hostfile) need_root; hostfile "${1:?hostfile SLOTS}" ;;
mpirun) need_root; run_mpirun "$@" ;;
*) die "usage: cluster.sh up H [--rate R] [--delay D] [--loss P] [--ipv6] [--no-ipv4] [--second-net] | exec HOST CMD ... | addr HOST [IFACE] | hostfile SLOTS | mpirun PER_HOST ARGS ... | down" ;;
esac
