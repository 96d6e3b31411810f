#!/bin/sh
# make demo: two workers over shared memory train an MLP on Fashion-MNIST, fp32 synchronous SGD
# against TernGrad-compressed local SGD (period 4) with gradient clipping, with and without
# adaptive batches; prints a comparison table and, with gnuplot, draws test accuracy per epoch to
# BUILD/demo.png. Usage: examples/demo.sh [BUILD_DIR]   (from the repository's top directory)
set -eu

BUILD=${1:-build}
EPOCHS=${DEMO_EPOCHS:-10}
SEED=${DEMO_SEED:-1}
mkdir -p "$BUILD"

scripts/install-deps.sh
make --no-print-directory -s BUILD="$BUILD" "$BUILD/fmnist_mlp"

# Two processes on two cores: one BLAS thread each.
export OPENBLAS_NUM_THREADS=1

run() { # $1: name, then the method's flags
    name=$1
    shift
    echo
    "$BUILD/fmnist_mlp" --transport shm --workers 2 --epochs "$EPOCHS" --batch 64 --lr 0.1 --seed "$SEED" \
        --csv "$BUILD/demo_$name.csv" "$@"
}

echo "Fashion-MNIST, MLP 784-256-128-10, 2 workers over shared memory, full training set (60000), $EPOCHS epochs,"
echo "batch 64 per worker, lr 0.1, seed $SEED."
run fp32 --compress none --period 1
run terngrad --compress ternary --period 4 --clip 2
# adaptive: micro-batches of 32, two per step to start (the variance is their spread), up to 16; the
# library's variant of the norm test (bias-corrected |grad F|^2 pooled over ~10 rounds: localsgd.h)
run terngrad_adaptive --compress ternary --period 4 --clip 2 --adaptive-batch norm --batch-eta 1.5 --batch-history 0.9 \
    --batch-grad-norm bias-corrected --batch 32 --max-batch-units 16

echo
echo "Comparison after $EPOCHS epochs (bytes: gradient/model messages each worker sent):"
printf '%-48s %9s %7s %12s %7s\n' method test_acc rounds bytes_MB time_s
row() { # $1: name, $2: label
    tail -n 1 "$BUILD/demo_$1.csv" |
        awk -F, -v label="$2" '{ printf "%-48s %8.2f%% %7d %12.1f %7.1f\n", label, $3, $4, $5 / 1e6, $6 }'
}
row fp32 "fp32 synchronous SGD"
row terngrad "TernGrad deltas, local SGD I=4, clip 2"
row terngrad_adaptive "  + adaptive batch (norm test eta 1.5, 64 to 512)"

if command -v gnuplot >/dev/null 2>&1; then
    gnuplot <<EOF
set terminal png size 1500,480 noenhanced
set output "$BUILD/demo.png"
set datafile separator ","
set multiplot layout 1,3 title "Fashion-MNIST MLP, 2 workers over shared memory, $EPOCHS epochs"
set ylabel "test accuracy (%)"
set key bottom right
set grid
set title "per epoch"
set xlabel "epoch"
set xtics 1
plot "$BUILD/demo_fp32.csv" using 1:3 with linespoints title "fp32 synchronous", \
     "$BUILD/demo_terngrad.csv" using 1:3 with linespoints title "TernGrad + local SGD (I=4) + clip", \
     "$BUILD/demo_terngrad_adaptive.csv" using 1:3 with linespoints title "... + adaptive batch"
set xtics auto
set logscale x
set title "against the bytes each worker sent"
set xlabel "MB sent per worker (log scale)"
plot "$BUILD/demo_fp32.csv" using (\$5/1e6):3 with linespoints title "fp32 synchronous", \
     "$BUILD/demo_terngrad.csv" using (\$5/1e6):3 with linespoints title "TernGrad + local SGD (I=4) + clip", \
     "$BUILD/demo_terngrad_adaptive.csv" using (\$5/1e6):3 with linespoints title "... + adaptive batch"
set title "against the averaging rounds"
set xlabel "averaging rounds (log scale)"
plot "$BUILD/demo_fp32.csv" using 4:3 with linespoints title "fp32 synchronous", \
     "$BUILD/demo_terngrad.csv" using 4:3 with linespoints title "TernGrad + local SGD (I=4) + clip", \
     "$BUILD/demo_terngrad_adaptive.csv" using 4:3 with linespoints title "... + adaptive batch"
unset multiplot
EOF
    echo
    echo "accuracy per epoch, per MB sent and per averaging round: $BUILD/demo.png"
else
    echo "gnuplot not found: no plot (the CSV files are $BUILD/demo_*.csv)"
fi
