#!/bin/sh
# Runs build/bench_allreduce twice with 2 ranks (NP to change), printing its lines:
#   1. Open MPI with its default transports (shared memory between ranks of one machine):
#      mpi-raw against dopt-mpi, dopt-mpi-check, mpi-iallreduce and dopt-shm, with the memory
#      limit (limit-memcpy: every rank copies the buffer at once; dopt-shm's limit_ratio), and
#      dopt-shm-nb (8 allreduces in flight; blocking_ratio: the same 8 as blocking calls ÷ them);
#   2. Open MPI forced onto TCP (--mca btl tcp,self): mpi-raw-tcp against dopt-tcp, so that the
#      TCP backend is compared with MPI over the same kind of link, with the raw socket stream
#      (limit-tcp-stream; dopt-tcp's limit_ratio), and dopt-tcp-nb (8 in flight, as for shm).
# Usage: bench/run_allreduce.sh [build-dir]     (build it first: make build/bench_allreduce)
set -eu
BUILD=${1:-build}
NP=${NP:-2}
MPIRUN="mpirun --allow-run-as-root --oversubscribe --mca btl_vader_single_copy_mechanism none -np $NP"
echo "== Open MPI default transports: $MPIRUN $BUILD/bench_allreduce mpi-raw mpi,mpi-check,iallreduce,shm,shm-nb,memcpy"
$MPIRUN "$BUILD/bench_allreduce" mpi-raw mpi,mpi-check,iallreduce,shm,shm-nb,memcpy
echo "== Open MPI over TCP: $MPIRUN --mca btl tcp,self $BUILD/bench_allreduce mpi-raw-tcp tcp,tcp-nb,stream"
$MPIRUN --mca btl tcp,self "$BUILD/bench_allreduce" mpi-raw-tcp tcp,tcp-nb,stream
