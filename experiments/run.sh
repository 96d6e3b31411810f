#!/bin/sh
# make experiments: the measurements behind docs/RESULTS.md, on Fashion-MNIST with
# examples/fmnist_mlp.c (and CELGC on a character LSTM with experiments/celgc_lstm.sh when it is
# there), then the performance model of examples/perf_model.c against the measured step times.
# Writes the runs' CSV files and logs to BUILD/experiments/, the figures to OUT/img/, and the
# generated part of OUT/RESULTS.md (between its "generated" markers; the prose around them is
# written by hand). Usage: experiments/run.sh [BUILD_DIR] [OUT_DIR]   (from the top directory)
#
# Environment: EXP_EPOCHS (default 6), EXP_SEEDS (default "1 2 3", every comparison; the bytes
# table takes the first), EXP_TARGET (test accuracy in percent, default 84), EXP_BATCH_ETA (the
# norm test's calibrated eta in the paper's configuration, section 2), EXP_REPORT_ONLY=1 (no runs:
# the tables and figures again from BUILD/experiments).
# About 12 minutes on 2 busy cores, plus the LSTM script (about 10).
set -eu
failures=0

BUILD=${1:-build}
OUT=${2:-docs}
EPOCHS=${EXP_EPOCHS:-6}
SEEDS=${EXP_SEEDS:-1 2 3}
TARGET=${EXP_TARGET:-84}
DATA=$BUILD/experiments
IMG=$OUT/img
mkdir -p "$DATA" "$IMG"

scripts/install-deps.sh
make --no-print-directory -s BUILD="$BUILD" "$BUILD/fmnist_mlp" "$BUILD/perf_model"
export OPENBLAS_NUM_THREADS=1 # one BLAS thread per worker process: the cores are the workers'
start=$(date +%s)
REPORT_ONLY=${EXP_REPORT_ONLY:-}
# no table and no command list may mix this run with an earlier one's files
[ -n "$REPORT_ONLY" ] || rm -f "$DATA"/*.csv "$DATA"/*.log

# ---------------------------------------------------------------- running

COMMON="--batch 64 --lr 0.1"
run() { # $1: name, $2: workers, then the method's flags; the command goes to the log's first line
    name=$1 workers=$2
    shift 2
    if [ -n "$REPORT_ONLY" ]; then return; fi
    # shellcheck disable=SC2086 # COMMON is several flags
    set -- "$BUILD/fmnist_mlp" --transport shm --workers "$workers" --epochs "$EPOCHS" $COMMON "$@" \
        --csv "$DATA/$name.csv"
    echo "$*" >"$DATA/$name.log"
    echo "load average at start: $(cut -d' ' -f1 /proc/loadavg)" >>"$DATA/$name.log"
    printf '%-28s' "$name"
    if "$@" >>"$DATA/$name.log" 2>&1; then
        tail -n 1 "$DATA/$name.csv" | awk -F, '{ printf " %6.2f%%  %7.1f s\n", $3, $6 }'
    else
        echo " FAILED (see $DATA/$name.log)"
        rm -f "$DATA/$name.csv" # no table may use a partial or earlier run's figures
        failures=$((failures + 1))
    fi
}

echo "== 1. TernGrad against fp32, synchronous, 2 and 4 workers ($EPOCHS epochs, seeds $SEEDS)"
for n in 2 4; do
    for s in $SEEDS; do
        run "tern_w${n}_fp32_s$s" "$n" --seed "$s"
        run "tern_w${n}_tern_s$s" "$n" --seed "$s" --compress ternary
        run "tern_w${n}_noclip_s$s" "$n" --seed "$s" --compress ternary --tern-clip off
    done
done

# PowerSGD (Vogels et al. 2019): rank-r factors of W1 and W2 with error feedback, the rest fp32
PSGD_RANKS="2 4"
echo "== 1b. PowerSGD against fp32, synchronous, 2 workers (ranks $PSGD_RANKS, seeds $SEEDS)"
for r in $PSGD_RANKS; do
    for s in $SEEDS; do
        run "psgd_w2_r${r}_s$s" 2 --seed "$s" --compress powersgd --powersgd-rank "$r"
    done
done

# The norm test of adaptive batch sizes for local gradient methods (Lau et al. 2024), in two settings:
# the paper's (the library's defaults: the plain estimate of |grad F|^2, the round's own statistics,
# no bound on the growth) at a paper value of eta and at an eta calibrated here, and the library's
# variant (bias-corrected |grad F|^2, statistics pooled over about 10 rounds, the previous step's
# mean as the projection) at the eta of the earlier runs. Micro-batches of 32, from 2 (64 samples,
# the fixed-64 batch) up to 16 (512, the fixed-512 batch).
BATCH_ETA=${EXP_BATCH_ETA:-1} # the smallest of 0.1 0.25 0.5 1 1.5 not at the cap within an epoch (RESULTS.md, 2)
BATCH_RUN="--period 4 --evals-per-epoch 8 --target-acc $TARGET"
BATCH_ADAPTIVE="--adaptive-batch norm --batch 32 --max-batch-units 16"
BATCH_PAPER="--batch-grad-norm plain --batch-history 0 --batch-projection auto" # and no --batch-max-growth: unbounded
BATCH_VARIANT="--batch-grad-norm bias-corrected --batch-history 0.9 --batch-projection previous"
BATCH_METHODS="fixed64 fixed512 paper paper_cal variant"
batch_flags() { # $1: method; the flags beside BATCH_RUN
    case $1 in
    fixed64) echo "" ;;
    fixed512) echo "--batch 512" ;;
    paper) echo "$BATCH_ADAPTIVE --batch-eta 0.1 $BATCH_PAPER" ;;
    paper_cal) echo "$BATCH_ADAPTIVE --batch-eta $BATCH_ETA $BATCH_PAPER" ;;
    variant) echo "$BATCH_ADAPTIVE --batch-eta 1.5 $BATCH_VARIANT" ;;
    esac
}
batch_label() {
    case $1 in
    fixed64) echo "fixed 64" ;;
    fixed512) echo "fixed 512" ;;
    paper) echo "norm test, paper's configuration, η = 0.1 (a value of the paper's code)" ;;
    paper_cal) echo "norm test, paper's configuration, η = $BATCH_ETA (calibrated here)" ;;
    variant) echo "norm test, library's variant, η = 1.5" ;;
    esac
}
echo "== 2. Adaptive batch against fixed batches, 2 workers, local SGD period 4, target $TARGET%"
for m in $BATCH_METHODS; do
    for s in $SEEDS; do
        # shellcheck disable=SC2046,SC2086 # several flags
        run "batch_${m}_s$s" 2 --seed "$s" $BATCH_RUN $(batch_flags "$m")
    done
done

echo "== 3. One worker against two, fp32 synchronous, target $TARGET%"
for s in $SEEDS; do
    run "workers_w1_b64_s$s" 1 --seed "$s" --evals-per-epoch 4 --target-acc "$TARGET"
    run "workers_w2_b64_s$s" 2 --seed "$s" --evals-per-epoch 4 --target-acc "$TARGET"
    run "workers_w2_b32_s$s" 2 --seed "$s" --evals-per-epoch 4 --target-acc "$TARGET" --batch 32
done

echo "== 4. Bytes per method, 2 workers, seed 1"
for codec in fp16 bf16 qsgd sign topk; do
    run "bytes_$codec" 2 --seed 1 --compress "$codec"
done
run bytes_local4_fp32 2 --seed 1 --period 4
run bytes_local4_tern 2 --seed 1 --period 4 --compress ternary

# DiLoCo (Douillard et al. 2023): each model average an outer Nesterov step, lr 0.7, momentum 0.9
DILOCO_PERIODS="16 64" # 32 too in earlier runs: left out to keep the run near 25 minutes
DILOCO="--outer-lr 0.7 --outer-momentum 0.9"
echo "== 4b. DiLoCo's outer optimizer against plain averaging, 2 workers, periods $DILOCO_PERIODS"
for i in $DILOCO_PERIODS; do
    for s in $SEEDS; do
        run "diloco_I${i}_plain_s$s" 2 --seed "$s" --period "$i" --evals-per-epoch 4
        # shellcheck disable=SC2086 # DILOCO is several flags
        run "diloco_I${i}_outer_s$s" 2 --seed "$s" --period "$i" --evals-per-epoch 4 $DILOCO
        # shellcheck disable=SC2086
        run "diloco_I${i}_outer_tern_s$s" 2 --seed "$s" --period "$i" --evals-per-epoch 4 $DILOCO --compress ternary
    done
done

# ---------------------------------------------------------------- performance model

# The configuration of a run as perf_model reads it, from its log's command line and its CSV:
# LABEL=CODEC:B:I[:adaptive], B the mean samples per step (epochs · shard / steps).
model_config() { # $1: run name
    head -n 1 "$DATA/$1.log" | awk -v name="$1" -v last="$(tail -n 1 "$DATA/$1.csv")" '{
        codec = "none"; period = 1; batch = 64; workers = 1; adaptive = ""
        for (i = 1; i < NF; i++) {
            if ($i == "--compress") codec = $(i + 1)
            if ($i == "--period") period = $(i + 1)
            if ($i == "--batch") batch = $(i + 1)
            if ($i == "--workers") workers = $(i + 1)
            if ($i == "--adaptive-batch") adaptive = ":adaptive"
        }
        split(last, f, ",")
        if (adaptive != "") batch = f[1] * int(60000 / workers) / f[8]
        printf "%s=%s:%.1f:%d%s\n", name, codec, batch, period, adaptive
    }'
}
model_runs() { # $1: workers; the runs (seed 1) whose step times the model predicts
    case $1 in
    1) echo workers_w1_b64_s1 ;;
    2) echo tern_w2_fp32_s1 tern_w2_tern_s1 workers_w2_b32_s1 batch_fixed64_s1 batch_fixed512_s1 \
        batch_paper_cal_s1 batch_variant_s1 bytes_local4_tern bytes_fp16 bytes_topk ;;
    4) echo tern_w4_fp32_s1 tern_w4_tern_s1 ;;
    esac
}
echo "== 5. Performance model (each ingredient timed for 0.5 s)"
for n in 1 2 4; do
    if [ -n "$REPORT_ONLY" ]; then break; fi
    configs=""
    for r in $(model_runs "$n"); do [ -s "$DATA/$r.csv" ] && configs="$configs $(model_config "$r")"; done
    cut -d' ' -f1 /proc/loadavg >"$DATA/model_w$n.load"
    rm -f "$DATA/model_w$n.csv"
    # shellcheck disable=SC2086 # one word per configuration
    if ! "$BUILD/perf_model" --transport shm --workers "$n" --seconds 0.5 --csv "$DATA/model_w$n.csv" $configs \
        >"$DATA/model_w$n.txt" 2>&1; then
        echo "perf_model with $n rank(s) FAILED"
        rm -f "$DATA/model_w$n.csv"
        failures=$((failures + 1))
    fi
    cat "$DATA/model_w$n.txt"
done

# A prediction, not a measurement: the same ingredients with a 1 Gb/s link between 2 machines.
LINK="--alpha-us 50 --beta-gbs 0.125"
if [ -z "$REPORT_ONLY" ]; then
    # shellcheck disable=SC2086 # LINK is two flags
    "$BUILD/perf_model" --transport shm --workers 2 --seconds 0.5 $LINK --csv "$DATA/model_1gbe.csv" \
        fp32=none:64:1 terngrad=ternary:64:1 local4_fp32=none:64:4 local4_terngrad=ternary:64:4 \
        adaptive192=none:192:4:adaptive >"$DATA/model_1gbe.txt"
fi

# ---------------------------------------------------------------- the LSTM (another script)

# Twice: at gamma = 3, where the rule clips nearly every step, with the unclipped SGD runs; and at
# LSTM_GAMMA2, where it clips on some steps only (18-40% of them, measured at 5 epochs with seeds
# 1 to 3 before this gamma was written here), without the unclipped runs (they do not depend on
# gamma) and at periods 1, 4 and 8 (the run's length).
LSTM_GAMMA2=${LSTM_GAMMA2:-8}
LSTM_RUNS="celgc_lstm celgc_lstm_g$LSTM_GAMMA2"
lstm=""
if [ -n "$REPORT_ONLY" ]; then
    [ -s "$DATA/celgc_lstm.md" ] && lstm=ok
elif [ -x experiments/celgc_lstm.sh ]; then
    echo "== 6. CELGC on a character LSTM (experiments/celgc_lstm.sh), gamma 3 and $LSTM_GAMMA2"
    # its CSVs, tables and figures go with the other runs' data; the figures are copied to img/
    lstm=ok
    experiments/celgc_lstm.sh "$BUILD" "$DATA" || lstm=failed
    LSTM_GAMMA=$LSTM_GAMMA2 LSTM_NAME=celgc_lstm_g$LSTM_GAMMA2 LSTM_UNCLIPPED=0 LSTM_PERIODS="1 4 8" \
        experiments/celgc_lstm.sh "$BUILD" "$DATA" || lstm=failed
    for r in $LSTM_RUNS; do [ -e "$DATA/$r.png" ] && cp "$DATA/$r.png" "$IMG/"; done
fi
if [ -z "$REPORT_ONLY" ]; then
    echo "$(($(date +%s) - start)) $(date -u '+%Y-%m-%d %H:%M UTC') $(cut -d' ' -f1-3 /proc/loadavg)" >"$DATA/run_info"
fi
read -r elapsed end_date end_time end_zone load1 load5 load15 <"$DATA/run_info"

# ---------------------------------------------------------------- tables

last() { tail -n 1 "$DATA/$1.csv"; } # the run's final evaluation
field() { last "$1" | cut -d, -f"$2"; }
mb() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1e6 }'; }
target_field() { # $1: run, $2: epoch|step|rounds|bytes|time_s; "-" when the target was not reached
    awk -v k="$2" '/^target .* reached:/ { for (i = 1; i < NF; i++) if ($i == k) v = $(i + 1) }
        END { print v == "" ? "-" : v }' "$DATA/$1.log"
}

figure() { # $1: name in IMG, $2: alt text (gnuplot draws it below)
    if command -v gnuplot >/dev/null 2>&1; then printf '\n![%s](%s)\n' "$2" "${IMG#"$OUT"/}/$1.png"; fi
}

{
    echo "Generated by \`make experiments\` (finished $end_date $end_time $end_zone, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' with local changes'))"
    echo "in $elapsed s on $(nproc) vCPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')),"
    echo "load average at the end $load1 $load5 $load15 (other jobs share the cores). $EPOCHS epochs, target $TARGET%, every run"
    echo "\`OPENBLAS_NUM_THREADS=1 $BUILD/fmnist_mlp --transport shm --epochs $EPOCHS $COMMON\` plus the flags below."
    echo
} >"$DATA/gen_run.md"
{
    echo "**TernGrad against fp32** (synchronous, gradients averaged every step; final test accuracy, %):"
    echo
    printf '| workers | method |'
    for s in $SEEDS; do printf ' seed %s |' "$s"; done
    echo ' mean | vs fp32, paired by seed (pt) | MB sent per worker | time (s, seed 1) |'
    printf '|---|---|'
    for s in $SEEDS; do printf '%s' '---|'; done
    printf '%s\n' '---|---|---|---|'
    for n in 2 4; do
        for m in "fp32:fp32 (none)" "tern:TernGrad, clip 2.5σ (--compress ternary)" "noclip:TernGrad, no clipping (--tern-clip off)"; do
            key=${m%%:*} label=${m#*:}
            accs="" diffs=""
            for s in $SEEDS; do
                accs="$accs $(field "tern_w${n}_${key}_s$s" 3)"
                diffs="$diffs $(awk -v a="$(field "tern_w${n}_${key}_s$s" 3)" -v b="$(field "tern_w${n}_fp32_s$s" 3)" 'BEGIN { print a - b }')"
            done
            mean=$(echo "$accs" | awk '{ for (i = 1; i <= NF; i++) t += $i; printf "%.2f", t / NF }')
            printf '| %s | %s |' "$n" "$label"
            for a in $accs; do printf ' %.2f |' "$a"; done
            printf ' %s | %s | %s | %.1f |\n' "$mean" "$(echo "$diffs" | awk '{
                    for (i = 1; i <= NF; i++) t += $i
                    m = t / NF
                    for (i = 1; i <= NF; i++) v += ($i - m) ^ 2
                    if (NF > 1) printf "%+.2f ± %.2f", m, sqrt(v / (NF - 1)); else printf "%+.2f", m }')" \
                "$(mb "$(field "tern_w${n}_${key}_s1" 5)")" "$(field "tern_w${n}_${key}_s1" 6)"
        done
    done
    echo
    figure terngrad "test accuracy per epoch, TernGrad against fp32"
} >"$DATA/gen_terngrad.md"
{
    echo "**PowerSGD against fp32** (2 workers, synchronous, gradients averaged every step; final test accuracy, %;"
    echo "the fp32 row is section 1's runs):"
    echo
    printf '| method |'
    for s in $SEEDS; do printf ' seed %s |' "$s"; done
    echo ' mean | vs fp32, paired by seed (pt) | bytes per step | MB sent per worker | time (s, seed 1) |'
    printf '|---|'
    for s in $SEEDS; do printf '%s' '---|'; done
    printf '%s\n' '---|---|---|---|---|'
    for key in tern_w2_fp32 $(for r in $PSGD_RANKS; do echo "psgd_w2_r$r"; done); do
        case $key in
        tern_*) label="fp32 (none)" ;;
        *) label="PowerSGD, r = ${key#psgd_w2_r} (--compress powersgd --powersgd-rank ${key#psgd_w2_r})" ;;
        esac
        accs="" diffs=""
        for s in $SEEDS; do
            accs="$accs $(field "${key}_s$s" 3)"
            diffs="$diffs $(awk -v a="$(field "${key}_s$s" 3)" -v b="$(field "tern_w2_fp32_s$s" 3)" 'BEGIN { print a - b }')"
        done
        mean=$(echo "$accs" | awk '{ for (i = 1; i <= NF; i++) t += $i; printf "%.2f", t / NF }')
        printf '| %s |' "$label"
        for a in $accs; do printf ' %.2f |' "$a"; done
        printf ' %s | %s | %s | %s | %.1f |\n' "$mean" "$(echo "$diffs" | awk '{
                for (i = 1; i <= NF; i++) t += $i
                m = t / NF
                for (i = 1; i <= NF; i++) v += ($i - m) ^ 2
                if (NF > 1) printf "%+.2f ± %.2f", m, sqrt(v / (NF - 1)); else printf "%+.2f", m }')" \
            "$(last "${key}_s1" | awk -F, '{ printf "%.0f", $5 / $8 }')" "$(mb "$(field "${key}_s1" 5)")" "$(field "${key}_s1" 6)"
    done
    echo
} >"$DATA/gen_psgd.md"
{
    echo "**Adaptive against fixed batches** (2 workers, local SGD with fp32 model averages every 4 steps,"
    echo "\`$BATCH_RUN\`; the target is checked 8 times per epoch; adaptive runs"
    echo "\`$BATCH_ADAPTIVE\` plus the flags below; paper's configuration: \`$BATCH_PAPER\`"
    echo "(the defaults); library's variant: \`$BATCH_VARIANT\`):"
    echo
    echo "| method | seed | reached $TARGET% at epoch | rounds to target | time to target (s) | MB to target | final acc (%) | final batch | rounds | time (s) | samples asked at the first / last decision |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
    for m in $BATCH_METHODS; do
        for s in $SEEDS; do
            r=batch_${m}_s$s
            [ -s "$DATA/$r.csv" ] || continue
            tb=$(target_field "$r" bytes)
            [ "$tb" = - ] || tb=$(mb "$tb")
            asked=$(sed -n 's/.*asked for \([^ ]*\) samples at the first, \([^ ]*\) at the last.*/\1 \/ \2/p' "$DATA/$r.log")
            printf '| %s | %s | %s | %s | %s | %s | %.2f | %s | %s | %.1f | %s |\n' "$(batch_label "$m")" "$s" \
                "$(target_field "$r" epoch)" "$(target_field "$r" rounds)" "$(target_field "$r" time_s)" "$tb" \
                "$(field "$r" 3)" "$(field "$r" 7)" "$(field "$r" 4)" "$(field "$r" 6)" "${asked:--}"
        done
    done
    echo
    echo "Mean over seeds (a run that never reached $TARGET% counts as not reached; the rounds and times to the"
    echo "target are means over the seeds that reached it):"
    echo
    echo "| method | seeds that reached $TARGET% | rounds to target | time to target (s) | final acc (%) | rounds | time (s) |"
    echo "|---|---|---|---|---|---|---|"
    for m in $BATCH_METHODS; do
        rows=""
        for s in $SEEDS; do
            r=batch_${m}_s$s
            [ -s "$DATA/$r.csv" ] || continue
            rows="$rows$(target_field "$r" rounds) $(target_field "$r" time_s) $(field "$r" 3) $(field "$r" 4) $(field "$r" 6)
"
        done
        [ -n "$rows" ] || continue
        printf '%s' "$rows" | awk -v label="$(batch_label "$m")" '
            { n++; acc += $3; rounds += $4; secs += $5; if ($1 != "-") { k++; tr += $1; tt += $2 } }
            END { printf "| %s | %d of %d | %s | %s | %.2f | %.0f | %.1f |\n", label, k, n,
                      k ? sprintf("%.0f", tr / k) : "-", k ? sprintf("%.2f", tt / k) : "-", acc / n, rounds / n, secs / n }'
    done
    echo
    figure adaptive_batch "test accuracy against rounds and time, adaptive and fixed batches"
} >"$DATA/gen_batch.md"
{
    echo "**One worker against two** (fp32 synchronous, \`--evals-per-epoch 4 --target-acc $TARGET\`):"
    echo
    echo "| workers × batch | seed | reached $TARGET% at epoch | steps to target | time to target (s) | speedup to target | final acc (%) | time (s) | ms per step |"
    echo "|---|---|---|---|---|---|---|---|---|"
    for m in "w1_b64:1 × 64" "w2_b64:2 × 64" "w2_b32:2 × 32"; do
        key=${m%%:*} label=${m#*:}
        for s in $SEEDS; do
            r=workers_${key}_s$s
            t1=$(target_field "workers_w1_b64_s$s" time_s) t=$(target_field "$r" time_s)
            printf '| %s | %s | %s | %s | %s | %s | %.2f | %.1f | %.2f |\n' "$label" "$s" "$(target_field "$r" epoch)" \
                "$(target_field "$r" step)" "$t" \
                "$(awk -v a="$t1" -v b="$t" 'BEGIN { if (a == "-" || b == "-") print "-"; else printf "%.2f×", a / b }')" \
                "$(field "$r" 3)" "$(field "$r" 6)" "$(last "$r" | awk -F, '{ printf "%.3f", 1000 * $6 / $8 }')"
        done
    done
    echo
    figure workers "test accuracy against time, 1 and 2 workers"
} >"$DATA/gen_workers.md"
{
    echo "**Bytes per method** (2 workers, seed 1; payload bytes each worker handed to the transport during"
    echo "training, as the communicator counts them; on shared memory no byte crosses a wire):"
    echo
    echo "| method | flags | rounds | bytes per round | MB per worker | vs fp32 | final acc (%) | time (s) |"
    echo "|---|---|---|---|---|---|---|---|"
    fp32_bytes=$(field tern_w2_fp32_s1 5)
    for m in "tern_w2_fp32_s1:fp32 synchronous:" "tern_w2_tern_s1:TernGrad synchronous:--compress ternary" \
             "bytes_fp16:fp16:--compress fp16" "bytes_bf16:bf16:--compress bf16" "bytes_qsgd:QSGD (s = 7):--compress qsgd" \
             "bytes_sign:sign + error feedback:--compress sign" "bytes_topk:top-k 1% + error feedback:--compress topk" \
             "bytes_local4_fp32:local SGD, fp32 models:--period 4" \
             "bytes_local4_tern:local SGD, TernGrad deltas:--period 4 --compress ternary" \
             "psgd_w2_r2_s1:PowerSGD r = 2 + error feedback:--compress powersgd --powersgd-rank 2"; do
        r=${m%%:*} rest=${m#*:}
        label=${rest%%:*} flags=${rest#*:}
        last "$r" | awk -F, -v label="$label" -v flags="$flags" -v fp32="$fp32_bytes" '{
            printf "| %s | `%s` | %d | %.0f | %.1f | %.4f | %.2f | %.1f |\n", label, flags, $4, $5 / $4, $5 / 1e6, $5 / fp32, $3, $6 }'
    done
    echo
} >"$DATA/gen_bytes.md"
{
    echo "**Performance model against measurement** (\`$BUILD/perf_model --transport shm --workers N CONFIG...\`;"
    echo "measured = fmnist_mlp's training time / steps, the fastest of the run's seeds (other jobs share"
    echo "the cores: the fastest run is the least disturbed); load = the load average when that run started;"
    echo "B = mean samples per step and worker):"
    echo
    echo "| run | ranks | codec | B | I | predicted compute (ms) | predicted comm (ms) | predicted step (ms) | measured step (ms) | slowest seed (ms) | load | error |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    echo "label,measured_ms,predicted_ms" >"$DATA/model_vs_measured.csv"
    for n in 1 2 4; do
        [ -s "$DATA/model_w$n.csv" ] || continue
        tail -n +2 "$DATA/model_w$n.csv" | while IFS=, read -r label ranks codec batch period adaptive compute comm step; do
            fastest=$label measured="" slowest=-
            for f in "$DATA/${label%_s1}"_s*.csv; do
                if [ ! -e "$f" ] || [ "$adaptive" = 1 ]; then continue; fi # adaptive: B is seed 1's
                ms=$(tail -n 1 "$f" | awk -F, '{ printf "%.3f", 1000 * $6 / $8 }')
                if [ -z "$measured" ] || awk -v a="$ms" -v b="$measured" 'BEGIN { exit !(a < b) }'; then
                    measured=$ms fastest=$(basename "$f" .csv)
                fi
                if [ "$slowest" = - ] || awk -v a="$ms" -v b="$slowest" 'BEGIN { exit !(a > b) }'; then slowest=$ms; fi
            done
            [ -n "$measured" ] || measured=$(last "$label" | awk -F, '{ printf "%.3f", 1000 * $6 / $8 }')
            echo "$label,$measured,$step" >>"$DATA/model_vs_measured.csv"
            printf '| %s | %s | %s%s | %s | %s | %.3f | %.3f | %.3f | %s | %s | %s | %s |\n' "$fastest" "$ranks" "$codec" \
                "$([ "$adaptive" = 1 ] && echo ', adaptive')" "$batch" "$period" "$compute" "$comm" "$step" "$measured" "$slowest" \
                "$(sed -n 's/^load average at start: //p' "$DATA/$fastest.log")" \
                "$(awk -v p="$step" -v m="$measured" 'BEGIN { printf "%+.0f%%", 100 * (p - m) / m }')"
        done
    done
    echo
    if [ -s "$DATA/model_1gbe.csv" ]; then
        echo "Predicted, not measured: the same compute and codec ingredients with a 1 Gb/s link between two"
        echo "machines (\`perf_model --workers 2 $LINK\`: α = 50 µs, β = 0.125 GB/s for both collectives):"
        echo
        echo "| configuration | codec | B | I | compute (ms) | communication (ms) | step (ms) | samples/s vs fp32 synchronous |"
        echo "|---|---|---|---|---|---|---|---|"
        tail -n +2 "$DATA/model_1gbe.csv" | awk -F, 'NR == 1 { base = $9 / $4 }
            { printf "| %s | %s | %s | %s | %.3f | %.3f | %.3f | %.2f× |\n", $1, $3, $4, $5, $7, $8, $9, base / ($9 / $4) }'
        echo
    fi
    printf 'perf_model ran at load averages'
    for n in 1 2 4; do [ -s "$DATA/model_w$n.load" ] && printf ' %s (%s rank(s))' "$(cat "$DATA/model_w$n.load")" "$n"; done
    echo "."
    echo
    echo "The model's ingredients as perf_model measured them (2 ranks; the 1- and 4-rank printouts are in"
    echo "\`$DATA/model_w{1,4}.txt\`):"
    echo
    echo '```'
    sed -n '1,/^predicted step time/p' "$DATA/model_w2.txt" | sed '$d'
    echo '```'
    figure perf_model "predicted against measured step time"
} >"$DATA/gen_model.md"
{
    echo "**DiLoCo's outer optimizer against plain averaging** (2 workers, local SGD at lr 0.1 with periods"
    echo "$DILOCO_PERIODS, \`--evals-per-epoch 4\`; DiLoCo: \`$DILOCO\`, Nesterov momentum on the pseudo-gradient"
    echo "anchor − mean; its TernGrad row sends the model deltas ternary, as the pseudo-gradient's input). At one period"
    echo "every method makes the same averaging rounds, so the final figures compare them at equal rounds."
    echo
    echo "| period | method | seed | rounds | MB sent / worker | final train loss | final test acc (%) | vs plain, same seed (pt) |"
    echo "|---|---|---|---|---|---|---|---|"
    for i in $DILOCO_PERIODS; do
        for m in "plain:plain average" "outer:DiLoCo outer Nesterov" "outer_tern:DiLoCo, TernGrad deltas"; do
            key=${m%%:*} label=${m#*:}
            for s in $SEEDS; do
                r=diloco_I${i}_${key}_s$s p=diloco_I${i}_plain_s$s
                [ -s "$DATA/$r.csv" ] || continue
                gain=-
                [ -s "$DATA/$p.csv" ] && gain=$(awk -v a="$(field "$r" 3)" -v b="$(field "$p" 3)" 'BEGIN { printf "%+.2f", a - b }')
                printf '| %s | %s | %s | %s | %s | %.4f | %.2f | %s |\n' "$i" "$label" "$s" "$(field "$r" 4)" \
                    "$(mb "$(field "$r" 5)")" "$(field "$r" 2)" "$(field "$r" 3)" "$gain"
            done
        done
    done
    echo
    figure diloco "test accuracy against averaging rounds, DiLoCo against plain averaging"
} >"$DATA/gen_diloco.md"
{
    if [ -n "$lstm" ]; then
        echo
        if [ "$lstm" = failed ]; then echo "experiments/celgc_lstm.sh failed in this run; see its output."; echo; fi
        for r in $LSTM_RUNS; do
            [ -s "$DATA/$r.md" ] && cat "$DATA/$r.md"
            [ -e "$IMG/$r.png" ] && printf '\n![%s](%s)\n\n' "$r" "img/$r.png"
        done
    fi
    echo
} >"$DATA/gen_lstm.md"
{
    printf '<details><summary>every command of this run</summary>\n\n```\n'
    for f in "$DATA"/*.log; do head -n 1 "$f"; done
    printf '```\n</details>\n'
} >"$DATA/gen_commands.md"

# ---------------------------------------------------------------- figures

if command -v gnuplot >/dev/null 2>&1; then
    gnuplot <<EOF
set terminal png size 1000,420 noenhanced
set datafile separator ","
set key autotitle columnhead bottom right
set grid
set ylabel "test accuracy (%)"
set output "$IMG/terngrad.png"
set multiplot layout 1,2 title "TernGrad against fp32, Fashion-MNIST MLP, seed 1"
do for [n in "2 4"] {
  set title n." workers over shared memory"
  set xlabel "epoch"
  set yrange [78:90]
  plot "$DATA/tern_w".n."_fp32_s1.csv" using 1:3 with linespoints title "fp32", \
       "$DATA/tern_w".n."_tern_s1.csv" using 1:3 with linespoints title "TernGrad, clip 2.5 sigma", \
       "$DATA/tern_w".n."_noclip_s1.csv" using 1:3 with linespoints title "TernGrad, no clipping"
}
unset multiplot
set output "$IMG/adaptive_batch.png"
set multiplot layout 1,2 title "Adaptive against fixed batches, 2 workers, local SGD I=4, seed 1"
set yrange [70:90]
set title "against averaging rounds"
set xlabel "averaging rounds"
set logscale x
plot "$DATA/batch_fixed64_s1.csv" using 4:3 with linespoints title "fixed 64", \
     "$DATA/batch_fixed512_s1.csv" using 4:3 with linespoints title "fixed 512", \
     "$DATA/batch_paper_s1.csv" using 4:3 with linespoints title "paper, eta 0.1", \
     "$DATA/batch_paper_cal_s1.csv" using 4:3 with linespoints title "paper, eta $BATCH_ETA", \
     "$DATA/batch_variant_s1.csv" using 4:3 with linespoints title "variant, eta 1.5", \
     $TARGET with lines dt 2 lc "gray" title "target"
unset logscale x
set title "against training time"
set xlabel "training time (s)"
plot "$DATA/batch_fixed64_s1.csv" using 6:3 with linespoints title "fixed 64", \
     "$DATA/batch_fixed512_s1.csv" using 6:3 with linespoints title "fixed 512", \
     "$DATA/batch_paper_s1.csv" using 6:3 with linespoints title "paper, eta 0.1", \
     "$DATA/batch_paper_cal_s1.csv" using 6:3 with linespoints title "paper, eta $BATCH_ETA", \
     "$DATA/batch_variant_s1.csv" using 6:3 with linespoints title "variant, eta 1.5", \
     $TARGET with lines dt 2 lc "gray" title "target"
unset multiplot
set terminal png size 1200,420 noenhanced
set output "$IMG/diloco.png"
set multiplot layout 1,$(echo "$DILOCO_PERIODS" | wc -w) title "DiLoCo's outer Nesterov step (lr 0.7, momentum 0.9) against plain averaging, 2 workers, seed 1"
set yrange [70:90]
set xlabel "averaging rounds"
set key bottom right
do for [i in "$DILOCO_PERIODS"] {
  set title "period ".i
  plot "$DATA/diloco_I".i."_plain_s1.csv" using 4:3 with linespoints title "plain average", \
       "$DATA/diloco_I".i."_outer_s1.csv" using 4:3 with linespoints title "DiLoCo", \
       "$DATA/diloco_I".i."_outer_tern_s1.csv" using 4:3 with linespoints title "DiLoCo, TernGrad deltas"
}
unset multiplot
set terminal png size 700,450 noenhanced
set output "$IMG/workers.png"
set title "One worker against two, fp32 synchronous, seed 1"
set xlabel "training time (s)"
plot "$DATA/workers_w1_b64_s1.csv" using 6:3 with linespoints title "1 worker, batch 64", \
     "$DATA/workers_w2_b64_s1.csv" using 6:3 with linespoints title "2 workers, batch 64 each", \
     "$DATA/workers_w2_b32_s1.csv" using 6:3 with linespoints title "2 workers, batch 32 each", \
     $TARGET with lines dt 2 lc "gray" title "target"
set output "$IMG/perf_model.png"
set title "Step time: performance model against fmnist_mlp"
set xlabel "measured (ms per step)"
set ylabel "predicted (ms per step)"
set logscale xy
set xrange [0.5:50]
set yrange [0.5:50]
set key top left
plot "$DATA/model_vs_measured.csv" using 2:3 with points pt 7 ps 1.3 title "configurations (fastest seed)", \
     x with lines dt 2 lc "gray" title "predicted = measured", \
     x / 2 with lines dt 3 lc "gray" title "predicted = measured / 2"
EOF
fi

# ---------------------------------------------------------------- RESULTS.md

RESULTS=$OUT/RESULTS.md
[ -e "$RESULTS" ] || printf '# Results\n' >"$RESULTS"
for section in run terngrad psgd batch workers bytes model diloco lstm commands; do
    begin="<!-- generated by experiments/run.sh: $section -->"
    end="<!-- end of $section -->"
    grep -qF "$begin" "$RESULTS" || printf '\n%s\n%s\n' "$begin" "$end" >>"$RESULTS"
    awk -v begin="$begin" -v end="$end" -v gen="$DATA/gen_$section.md" '
        $0 == begin { print; while ((getline line < gen) > 0) print line; skip = 1; next }
        $0 == end { skip = 0 }
        !skip { print }' "$RESULTS" >"$RESULTS.tmp"
    mv "$RESULTS.tmp" "$RESULTS"
done
echo "tables: $RESULTS; figures: $IMG/; runs: $DATA/ ($elapsed s)"
if [ "$failures" -gt 0 ]; then
    echo "experiments: $failures run(s) FAILED: their rows are missing from the tables" >&2
    exit 1
fi
