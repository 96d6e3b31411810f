#!/bin/sh
# Installs the Debian packages distopt's tests, examples and benchmarks need, and only those that
# are missing. Idempotent: when everything is present it does nothing and exits 0.
# With the argument "hosts", also what examples/hosts needs: FANN and darknet (darknet pulls in
# OpenCV, about 260 MB).
# As root it runs apt-get; otherwise it uses sudo when it can, else prints the exact command and
# exits 1.
set -eu

PACKAGES="build-essential pkg-config libopenblas-dev zlib1g-dev openmpi-bin libopenmpi-dev \
clang libclang-rt-dev dataset-fashion-mnist fortunes gnuplot-nox iproute2 iptables slurm-wlm munge"
if [ "${1:-}" = hosts ]; then
    PACKAGES="$PACKAGES libfann-dev darknet"
fi

missing=""
for p in $PACKAGES; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done
[ -z "$missing" ] && exit 0

cmd="apt-get install -y --no-install-recommends$missing"
if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo"
else
    echo "distopt needs these Debian packages:$missing" >&2
    echo "run as root:  apt-get update && $cmd" >&2
    exit 1
fi
echo "installing:$missing" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
