#!/bin/sh
# The CELGC experiment (Liu et al., NeurIPS 2022: local gradient clipping with periodic model
# averaging): a character-level LSTM (examples/char_lstm.c) on the fortunes text, at a step size
# where plain SGD blows up, with N = 2 and N = 4 workers as processes talking TCP on 127.0.0.1,
# seeds LSTM_SEED, LSTM_SEED + 1 and LSTM_SEED + 2. For each N and seed:
#   - synchronous clipped SGD, the paper's baseline: the workers' gradients averaged, then one step
#     min(eta, gamma/|g|) on the average (--celgc at --period 1 --average grads);
#   - CELGC: each worker steps min(eta, gamma/|g|) on its own gradient, the models averaged every
#     I steps, I in 1 2 4 8 (--average models);
#   - plain SGD at the same step eta, synchronous, unclipped (expected: diverges); left out with
#     LSTM_UNCLIPPED=0, since it does not depend on gamma.
# Both N train on the same characters, each worker on 1/N of them with the same batch per worker:
# an epoch is the same data, and at N = 4 the global batch is twice that of N = 2 and an epoch
# half as many steps.
# Writes OUT/NAME_w<N>_<method>_s<seed>.csv (NAME: LSTM_NAME, default celgc_lstm; one row per
# epoch; rank 0's output goes to BUILD/experiments/NAME_w<N>_<method>_s<seed>.log, its command
# line first, the other ranks' to .rank<R>.out beside it), OUT/NAME.png (validation loss against
# epochs and against averaging rounds, for each N) and OUT/NAME.md (the table made from the CSVs,
# then the verdicts computed from it). 36 runs, about 6 minutes on 2 cores.
# Usage: experiments/celgc_lstm.sh BUILD_DIR OUT_DIR   (from the repository's top directory)
# Environment: LSTM_EPOCHS, LSTM_TRAIN_CHARS, LSTM_HIDDEN, LSTM_SEED, LSTM_GAMMA, LSTM_PERIODS
# override the settings below; LSTM_NAME names the files (a second gamma beside the first);
# LSTM_UNCLIPPED=0 leaves out the unclipped SGD runs;
# LSTM_REPORT_ONLY=1: no runs, the table, text and figure again from OUT's CSVs and the logs.
set -eu

BUILD=${1:?usage: experiments/celgc_lstm.sh BUILD_DIR OUT_DIR}
OUT=${2:?usage: experiments/celgc_lstm.sh BUILD_DIR OUT_DIR}
EPOCHS=${LSTM_EPOCHS:-5}
TRAIN_CHARS=${LSTM_TRAIN_CHARS:-160000}
HIDDEN=${LSTM_HIDDEN:-128}
SEED=${LSTM_SEED:-1}
SEEDS="$SEED $((SEED + 1)) $((SEED + 2))"
WORKERS="2 4"
BPTT=32
BATCH=32
ETA=30
GAMMA=${LSTM_GAMMA:-3}
PERIODS=${LSTM_PERIODS:-1 2 4 8}
CLIPPED="sync$(for i in $PERIODS; do printf ' celgc_I%s' "$i"; done)" # celgc_I<I>: --period I, the models averaged
METHODS=$CLIPPED
[ "${LSTM_UNCLIPPED:-1}" = 0 ] || METHODS="$METHODS sgd"
P=${LSTM_NAME:-celgc_lstm}

LOGS=$BUILD/experiments
INFO=$OUT/${P}_run_info # "seconds date commit" of the last full run, for the report
mkdir -p "$BUILD" "$OUT" "$LOGS"
export OPENBLAS_NUM_THREADS=1 # one BLAS thread per worker process

# One job: ranks 1..N-1 in the background, rank 0 in the foreground writing the CSV; every exit
# status kept (1 is an answer here: "did not converge"). A port already taken makes rank 0 fail
# to start: then the other ranks are stopped and the next port is tried.
# The transport's words for a rank 0 that could not listen, in its older and its current form.
NOSTART="cannot start the tcp transport|rank 0: setup: cannot listen on"
port_base=$((20000 + $$ % 20000))
job=0
rank() { # $1: rank, then the method's flags
    rk=$1
    shift
    DOPT_RANK=$rk "$BUILD/char_lstm" --transport tcp --epochs "$EPOCHS" --train-limit "$TRAIN_CHARS" \
        --hidden "$HIDDEN" --bptt $BPTT --batch $BATCH "$@"
}
run() { # $1: run name, $2: workers, then char_lstm's method flags
    name=$1 workers=$2
    shift 2
    log="$LOGS/${P}_$name"
    csv="$OUT/${P}_$name.csv"
    tries=0
    while :; do
        job=$((job + 1))
        export DOPT_WORLD_SIZE="$workers" DOPT_MASTER_ADDR=127.0.0.1 DOPT_MASTER_PORT=$((port_base + job * 7)) \
            DOPT_TOKEN="celgc-lstm-$$-$job" DOPT_TIMEOUT_MS=120000
        rm -f "$csv" "$log".rank*.out # a failed attempt must not leave an earlier run's figures
        pids=""
        other=1
        while [ $other -lt "$workers" ]; do
            rank $other "$@" >"$log.rank$other.out" 2>&1 &
            pids="$pids $!"
            other=$((other + 1))
        done
        others="ranks 1-$((workers - 1))"
        [ "$workers" -eq 2 ] && others="rank 1"
        echo "DOPT_WORLD_SIZE=$workers DOPT_RANK=0 $BUILD/char_lstm --transport tcp --epochs $EPOCHS" \
            "--train-limit $TRAIN_CHARS --hidden $HIDDEN --bptt $BPTT --batch $BATCH $* --csv $csv" \
            "  ($others: the same without --csv)" >"$log.log"
        s0=0
        rank 0 "$@" --csv "$csv" >>"$log.log" 2>&1 || s0=$?
        # rank 0 never listened: the others would keep trying to connect until their timeout
        if grep -qE "$NOSTART" "$log.log"; then
            for pid in $pids; do kill "$pid" 2>/dev/null || true; done
        fi
        sr=0 # the worst exit status of ranks 1..N-1
        for pid in $pids; do
            st=0
            wait "$pid" || st=$?
            [ $st -gt $sr ] && sr=$st
        done
        if grep -qE "$NOSTART" "$log.log" "$log".rank*.out && [ $tries -lt 4 ]; then
            tries=$((tries + 1))
            echo "  (port $DOPT_MASTER_PORT: the transport did not start, trying another)"
            continue
        fi
        break
    done
    printf '%-22s exit %d/%d  %s\n' "$name" "$s0" "$sr" "$(tail -n 1 "$log.log")"
    # exit 1 is an answer (diverged, not converged) unless the run itself broke: the transport did
    # not start, or a collective failed ("rank R: step S: ...", "rank R: setup failed")
    if [ "$s0" -gt 1 ] || [ "$sr" -gt 1 ] || [ ! -s "$csv" ] ||
        grep -qE "$NOSTART|^(distopt: )?rank [0-9]+: (step|setup)" "$log.log" "$log".rank*.out; then
        echo "celgc_lstm: $name failed to run:" >&2
        tail -n 5 "$log.log" "$log".rank*.out >&2
        exit 1
    fi
}
method_flags() { # $1: method
    case $1 in
        sync) echo "--celgc $ETA,$GAMMA --period 1 --average grads" ;;
        celgc_I*) echo "--celgc $ETA,$GAMMA --period ${1#celgc_I} --average models" ;;
        sgd) echo "--lr $ETA" ;;
    esac
}

if [ -z "${LSTM_REPORT_ONLY:-}" ]; then
    make --no-print-directory -s BUILD="$BUILD" "$BUILD/char_lstm" >/dev/null
    # no table may mix this run with an earlier one's files
    rm -f "$OUT/${P}"_w*.csv "$LOGS/${P}"_w*.log "$LOGS/${P}"_w*.out "$INFO"
    echo "celgc_lstm: char-LSTM (hidden $HIDDEN, BPTT $BPTT), $TRAIN_CHARS training characters, $WORKERS workers over"
    echo "TCP, batch $BATCH windows per worker, $EPOCHS epochs, eta $ETA, gamma $GAMMA, seeds $SEEDS"
    started=$(date +%s)
    for n in $WORKERS; do
        for s in $SEEDS; do
            for m in $METHODS; do
                # shellcheck disable=SC2046 # the method's flags, several words
                run "w${n}_${m}_s$s" "$n" $(method_flags "$m") --seed "$s"
            done
        done
    done
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    git diff --quiet HEAD -- '*.c' '*.h' Makefile experiments 2>/dev/null || commit="$commit with uncommitted changes"
    echo "$(($(date +%s) - started)) $(date -u '+%Y-%m-%d') $commit" >"$INFO"
fi
read -r elapsed run_date commit <"$INFO"
echo "celgc_lstm: the runs took $elapsed s"

# ---------------------------------------------------------------- table, from the CSVs
# CSV columns: epoch,train_loss,val_loss,val_bpc,rounds,bytes_sent,time_s,batch
label() {
    case $1 in
        sync) echo "synchronous clipped SGD (gradients averaged, then clipped)" ;;
        celgc_I*) echo "CELGC, I = ${1#celgc_I} (models averaged)" ;;
        sgd) echo "SGD, unclipped, synchronous" ;;
    esac
}
paragraph() { # stdin as one paragraph, wrapped at 100 columns
    awk '{ for (i = 1; i <= NF; i++) w[++n] = $i }
        END { for (i = 1; i <= n; i++) {
                  if (line != "" && length(line) + 1 + length(w[i]) > 100) { print line; line = "" }
                  line = line (line == "" ? "" : " ") w[i] }
              print line }'
}
uniform=$(awk 'BEGIN { printf "%.4f", log(96) }')
summary="$OUT/${P}_summary.txt" # n method seed epochs train val bpc rounds bytes time clipped diverged
: >"$summary"
for n in $WORKERS; do
    for m in $METHODS; do
        for s in $SEEDS; do
            r="w${n}_${m}_s$s"
            awk -F, -v n="$n" -v m="$m" -v s="$s" -v uniform="$uniform" '
                NR > 1 { k++; train = $2; val = $3; bpc = $4; rounds = $5; bytes = $6; secs = $7
                         if ($2 !~ /^-?[0-9.]+(e[-+]?[0-9]+)?$/ || $3 !~ /^-?[0-9.]+(e[-+]?[0-9]+)?$/) bad = 1 }
                END { div = bad ? "yes:_non-finite_loss" : (val > uniform ? "yes:_worse_than_a_uniform_guess" : "no")
                      printf "%s %s %s %d %s %s %s %s %s %s %s %s\n", n, m, s, k, train, val, bpc, rounds, bytes, secs,
                             (clipped == "" ? "-" : clipped), div }' \
                clipped="$(sed -n 's/.*clipped [0-9]* of [0-9]* steps (\(.*\)%).*/\1%/p' "$LOGS/${P}_$r.log")" \
                "$OUT/${P}_$r.csv" >>"$summary"
        done
    done
done
# Validation loss per run and epoch, for the comparison of N at the same number of steps:
# n method seed epoch rounds val
curves="$OUT/${P}_curves.txt"
: >"$curves"
for n in $WORKERS; do
    for m in $METHODS; do
        for s in $SEEDS; do
            awk -F, -v pre="$n $m $s" 'NR > 1 { print pre, $1, $5, $3 }' "$OUT/${P}_w${n}_${m}_s$s.csv" >>"$curves"
        done
    done
done

md="$OUT/$P.md"
{
    echo "### CELGC on a character-level LSTM (2 and 4 workers, TCP), gamma = $GAMMA"
    echo
    {
        echo "\`experiments/celgc_lstm.sh\` ($run_date, the code of commit $commit): examples/char_lstm.c, one LSTM layer"
        echo "of $HIDDEN units, one-hot input over 96 symbols, BPTT $BPTT, the first $TRAIN_CHARS characters of the fortunes"
        echo "training text, $EPOCHS epochs, N = 2 and N = 4 worker processes over TCP on 127.0.0.1, seeds $(echo "$SEEDS" | sed 's/ \([^ ]*\)$/ and \1/; s/ \([^ ]*\) and/, \1 and/')."
        echo "Each worker trains on 1/N of the characters with a batch of $BATCH windows: an epoch is the same data for"
        echo "both N, and at N = 4 the global batch is twice as large ($((4 * BATCH)) windows against $((2 * BATCH))) and an epoch has"
        echo "half as many steps. Step size eta = $ETA everywhere. The baseline is the paper's: synchronous clipped SGD"
        echo "averages the workers' gradients, then steps min(eta, gamma/|g|) on the average (gamma = $GAMMA). CELGC takes that"
        echo "step on each worker's own gradient and averages the models every I steps (at I = 1, after every step)."
        echo "Losses in nats per character; rounds: averages (of gradients or of models); MB: payload each worker"
        echo "handed to the transport during training (not bytes on the wire: a ring allreduce puts 2(N-1)/N of its"
        echo "payload on the wire per worker, 1x at N = 2 and 1.5x at N = 4); time: training wall time (evaluation excluded) on a shared"
        echo "2-core machine, where N = 4 puts two worker processes on each core (the $(wc -l <"$summary") runs took $elapsed s"
        echo "in all); steps clipped: rank 0's steps on which the rule chose gamma/|g| over eta."
    } | paragraph
    echo
    echo "| N | method | seed | rounds | MB sent / worker | final train loss | final val loss | time (s) | steps clipped | diverged? |"
    echo "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"
    while read -r n m s _ train val _ rounds bytes secs clipped div; do
        printf '| %s | %s | %s | %s | %.1f | %.4f | %.4f | %.1f | %s | %s |\n' "$n" "$(label "$m")" "$s" "$rounds" \
            "$(awk -v b="$bytes" 'BEGIN { print b / 1e6 }')" "$train" "$val" "$secs" "$clipped" \
            "$(echo "$div" | tr _ ' ')"
    done <"$summary"
    echo
    {
        echo "Validation loss against epochs and against rounds: \`$P.png\`. Unigram baseline (symbol frequencies"
        echo "of the training text): $(sed -n 's/.*unigram baseline \([0-9.]*\) nats.*/\1/p' "$LOGS/${P}_w2_sync_s$SEED.log" | head -n 1) nats/char; uniform guess: $uniform nats/char."
    } | paragraph
    echo
    echo "#### What the figures say"
    echo
    # The verdicts are computed from the table; the thresholds are stated with them.
    awk -v workers="$WORKERS" -v periods="$PERIODS" -v seeds="$SEEDS" -v eta="$ETA" -v gamma="$GAMMA" -v clipped="$CLIPPED" \
        -v hassgd="$(case " $METHODS " in *" sgd "*) echo 1 ;; *) echo 0 ;; esac)" \
        -v clipmax="$(awk '$2 != "sgd" && $11 + 0 > m { m = $11 + 0 } END { print m + 0 }' "$summary")" \
        -v epochs="$EPOCHS" -v uniform="$uniform" \
        -v clipmin="$(awk '$2 != "sgd" && (m == "" || $11 + 0 < m) { m = $11 + 0 } END { print m }' "$summary")" '
        FILENAME == ARGV[1] { k = $1 " " $2 " " $3; val[k] = $6; rounds[k] = $8; bytes[k] = $9; secs[k] = $10; div[k] = $12; next }
        { cv[$1 " " $2 " " $3 " " $4] = $6; if ($2 == "sync") steps[$1 " " $4] = $5 }
        function abs(x) { return x < 0 ? -x : x }
        function wrap(text,   n, i, word, line, out) { # at 100 columns
            n = split(text, word, " "); line = ""; out = ""
            for (i = 1; i <= n; i++)
                if (line != "" && length(line) + 1 + length(word[i]) > 100) { out = out line "\n"; line = word[i] }
                else line = line (line == "" ? "" : " ") word[i]
            return out line "\n"
        }
        function mean(n, m,   j, t) { t = 0; for (j = 1; j <= ns; j++) t += val[n " " m " " S[j]]; return t / ns }
        function seedspread(n, m,   j, v, lo, hi) { # the largest minus the smallest final loss over the seeds
            for (j = 1; j <= ns; j++) { v = val[n " " m " " S[j]]; if (j == 1 || v < lo) lo = v; if (j == 1 || v > hi) hi = v }
            return hi - lo
        }
        function lbl(m) { return m == "sync" ? "synchronous clipped SGD" : "CELGC at I = " substr(m, 8) }
        # "d1, d2" of method m against reference ref at N = n, one per seed; sets dmax, dmin
        function diffs(n, m, ref,   j, d, out) {
            out = ""; dmax = -1e9; dmin = 1e9
            for (j = 1; j <= ns; j++) {
                d = val[n " " m " " S[j]] - val[n " " ref " " S[j]]
                out = out (j > 1 ? ", " : "") sprintf("%+.4f", d)
                if (d > dmax) dmax = d; if (d < dmin) dmin = d
            }
            return out
        }
        function verdict(spread) {
            if (dmax > spread) return "**higher** by more than the spread"
            if (dmax < -spread) return "lower by more than the spread on every seed"
            return "the same within the spread"
        }
        END {
            nw = split(workers, W, " "); np = split(periods, P, " "); ns = split(seeds, S, " ")
            nm = split(clipped, M, " ")
            printf "**Thresholds.** The yardstick at each N is the seed-to-seed spread S(N): the largest difference\n"
            printf "between the final validation losses of the %d seeds of one clipped method at that N. A method has \"the\n", ns
            printf "same loss\" as a reference when, on every seed, its final validation loss is no more than S(N) above the\n"
            printf "reference'"'"'s (paired by seed: same initialisation and data order); \"higher\" when it is more than S(N)\n"
            printf "above on some seed. With %d seeds this can show a difference larger than the noise; it cannot show that\n", ns
            printf "a smaller one is zero.\n\n"
            for (w = 1; w <= nw; w++) {
                n = W[w]; spread[n] = 0
                for (i = 1; i <= nm; i++) {
                    d = seedspread(n, M[i])
                    if (d > spread[n]) { spread[n] = d; widest[n] = M[i] }
                }
            }
            printf "| N | method | rounds | mean final val loss | seed spread | vs synchronous clipped SGD, per seed | verdict | vs CELGC at I = 1, per seed | verdict |\n"
            printf "|---:|---|---:|---:|---:|---:|---|---:|---|\n"
            for (w = 1; w <= nw; w++) {
                n = W[w]
                for (i = 1; i <= nm; i++) {
                    m = M[i]; k = n " " m " " S[1]
                    printf "| %s | %s | %d | %.4f | %.4f | ", n, lbl(m), rounds[k], mean(n, m), seedspread(n, m)
                    if (m == "sync") printf "- | - | "
                    else { d = diffs(n, m, "sync"); printf "%s | %s | ", d, verdict(spread[n]); v_sync[n " " m] = (dmax > spread[n]) }
                    if (m == "sync" || m == "celgc_I1") printf "- | - |\n"
                    else { d = diffs(n, m, "celgc_I1"); printf "%s | %s |\n", d, verdict(spread[n]); v_one[n " " m] = (dmax > spread[n]) }
                }
            }
            printf "\nThe claim under test: CELGC at period I reaches the loss per epoch of synchronous clipped SGD\n"
            printf "with I times fewer rounds.\n\n"
            for (w = 1; w <= nw; w++) {
                n = W[w]
                printf "- **N = %s** (S = %.4f nats/char, the spread of %s).\n  Rounds:", n, spread[n], lbl(widest[n])
                r1 = rounds[n " celgc_I1 " S[1]]
                printf " %d at I = 1 (the synchronous baseline: %d)", r1, rounds[n " sync " S[1]]
                for (p = 2; p <= np; p++) { k = n " celgc_I" P[p] " " S[1]; printf ", %d at I = %d (%.1fx fewer)", rounds[k], P[p], r1 / rounds[k] }
                printf ";\n  MB sent per worker"
                for (p = 1; p <= np; p++) printf "%s %.1f", (p > 1 ? "," : ""), bytes[n " celgc_I" P[p] " " S[1]] / 1e6
                held = ""; failed = ""
                for (p = 1; p <= np; p++) { m = "celgc_I" P[p]; if (v_sync[n " " m]) failed = failed " " P[p]; else held = held " " P[p] }
                printf ".\n  Against synchronous clipped SGD the claim held for I =%s%s;", (held == "" ? " none" : held), (failed == "" ? "" : ", not for I =" failed)
                held = ""; failed = ""
                for (p = 2; p <= np; p++) { m = "celgc_I" P[p]; if (v_one[n " " m]) failed = failed " " P[p]; else held = held " " P[p] }
                printf " against CELGC at I = 1, for\n  I =%s%s.\n", (held == "" ? " none" : held), (failed == "" ? "" : ", not for I =" failed)
            }
            # N against N: the same data (the last epoch), and the same number of steps per worker
            n2 = W[1]; n4 = W[nw]; e2 = 0; e4 = 0
            for (a = 1; a <= epochs; a++) for (b = 1; b <= epochs; b++)
                if (steps[n2 " " a] != "" && steps[n2 " " a] == steps[n4 " " b] && a > e2) { e2 = a; e4 = b }
            sp = spread[n2] > spread[n4] ? spread[n2] : spread[n4]
            printf "- **N = %s against N = %s**, the final validation loss of N = %s minus that of N = %s, mean over seeds\n", n4, n2, n4, n2
            printf "  (yardstick: the larger spread, %.4f). After the same data (%d epochs: %d steps per worker at\n", sp, epochs, steps[n2 " " epochs]
            printf "  N = %s, %d at N = %s):\n ", n2, steps[n4 " " epochs], n4
            same = 0; worse = 0; better = 0
            for (i = 1; i <= nm; i++) {
                m = M[i]; d = mean(n4, m) - mean(n2, m)
                printf "%s %+.4f %s", (i > 1 ? "," : ""), d, (i == 1 ? "(synchronous)" : "(I = " substr(m, 8) ")")
                if (d > sp) worse++; else if (d < -sp) better++; else same++
            }
            printf ";\n  higher by more than the yardstick for %d of the %d clipped methods, within it for %d, lower for %d.\n", worse, nm, same, better
            if (e2 > 0) {
                printf "  After the same number of steps per worker (%d: N = %s at epoch %d, N = %s at epoch %d, having seen\n", steps[n2 " " e2], n2, e2, n4, e4
                printf "  %s times the data):\n ", (e4 / e2 == int(e4 / e2) ? e4 / e2 : sprintf("%.1f", e4 / e2))
                below = 0
                for (i = 1; i <= nm; i++) {
                    m = M[i]; a4 = 0; a2 = 0
                    for (j = 1; j <= ns; j++) { a4 += cv[n4 " " m " " S[j] " " e4]; a2 += cv[n2 " " m " " S[j] " " e2] }
                    d = (a4 - a2) / ns
                    printf "%s %+.4f %s", (i > 1 ? "," : ""), d, (i == 1 ? "(synchronous)" : "(I = " substr(m, 8) ")")
                    if (d < -sp) below++
                }
                printf ";\n  lower by more than the yardstick for %d of the %d clipped methods.\n", below, nm
            }
            t2 = 0; t4 = 0; c2 = 0; c4 = 0
            for (k in secs) { split(k, K, " "); if (K[1] == n2) { t2 += secs[k]; c2++ } else if (K[1] == n4) { t4 += secs[k]; c4++ } }
            printf "  Training time per run, mean over all runs: %.1f s at N = %s, %.1f s at N = %s.\n", t2 / c2, n2, t4 / c4, n4
            printf "- The rule chose gamma/|g| on %s%% to %s%% of the steps of rank 0 in the clipped runs (column \"steps\n", clipmin, clipmax
            printf "  clipped\" of the table).\n"
            # unclipped SGD
            if (hassgd) {
            printf "- Plain SGD at the same step eta = %s, unclipped: final validation loss (nats/char, seeds in order)\n ", eta
            ndiv = 0
            for (w = 1; w <= nw; w++) {
                printf "%s", (w > 1 ? "," : "")
                for (j = 1; j <= ns; j++) { k = W[w] " sgd " S[j]; printf "%s %.1f", (j > 1 ? " and" : ""), val[k]; if (div[k] != "no") ndiv++ }
                printf " at N = %s", W[w]
            }
            printf ";\n  it diverged (non-finite, or worse than a uniform guess: %s) in %d of %d runs.\n", uniform, ndiv, nw * ns
            }
            printf "\n#### What it means\n\n"
            fails = ""
            for (w = 1; w <= nw; w++) for (p = 1; p <= np; p++) {
                m = "celgc_I" P[p]
                if (v_sync[W[w] " " m]) fails = fails sprintf("%s N = %s, I = %d against synchronous clipped SGD", (fails == "" ? "" : ";"), W[w], P[p])
                if (p > 1 && v_one[W[w] " " m]) fails = fails sprintf("%s N = %s, I = %d against CELGC at I = 1", (fails == "" ? "" : ";"), W[w], P[p])
            }
            if (fails == "")
                t = sprintf("At both N and every period up to I = %d, CELGC ended no further above synchronous clipped SGD, and no further above its own I = 1, than the seeds of one method end apart, with I times fewer rounds: the communication claim of the paper holds here, for these %d epochs, within that noise.", P[np], epochs)
            else
                t = sprintf("The claim failed (a final loss higher than the reference'"'"'s by more than the spread) at:%s. Everywhere else it held within the spread, with I times fewer rounds.", fails)
            # the sign of the paired differences against the synchronous baseline, and where they exceed the spread
            npair = 0; nbelow = 0; dlow = 0; beyond = ""
            for (w = 1; w <= nw; w++) for (p = 1; p <= np; p++) {
                m = "celgc_I" P[p]; all = 1
                for (j = 1; j <= ns; j++) {
                    d = val[W[w] " " m " " S[j]] - val[W[w] " sync " S[j]]; npair++
                    if (d < 0) nbelow++
                    if (d < dlow) dlow = d
                    if (d >= -spread[W[w]]) all = 0
                }
                if (all) beyond = beyond sprintf("%s N = %s, I = %d", (beyond == "" ? "" : ";"), W[w], P[p])
            }
            if (nbelow > npair / 2) {
                t = t sprintf(" CELGC ended below synchronous clipped SGD in %d of the %d seed-paired comparisons (by up to %.2f nats/char), by more than the spread on every seed at%s.", nbelow, npair, -dlow, (beyond == "" ? " none" : beyond))
                if (clipmin >= 90)
                    t = t " A possible reason, not tested here: with the rule choosing gamma/|g| on nearly every step, the synchronous step has length gamma, while the average of the workers'"'"' own clipped steps is shorter wherever their gradients point different ways; at this large step size CELGC'"'"'s averaged model moves less far."
            }
            printf "%s", wrap(t)
            t = sprintf("The paper also claims a speedup linear in N: N workers need about 1/N of the steps, so after the same data the loss would not depend on N, and after the same number of steps N = %s would be ahead of N = %s. Here, after the same data, ", n4, n2)
            if (worse == 0 && better == 0)
                t = t sprintf("N = %s matched N = %s within the yardstick for every clipped method, with half the steps: consistent with a linear speedup from %s to %s workers.", n4, n2, n2, n4)
            else if (worse > 0) {
                t = t sprintf("N = %s ended higher for %d of the %d clipped methods: half the steps with twice the global batch did not reach the loss of N = %s", n4, worse, nm, n2)
                if (clipmin >= 90)
                    t = t sprintf(" (a possible reason: the rule chose gamma/|g| on at least %.1f%% of the steps of every clipped run, and such a step has length gamma whatever the batch; a larger batch aims a step better but does not lengthen it)", clipmin)
                if (e2 > 0 && below > 0)
                    t = t sprintf(". After the same number of steps, N = %s was lower for %d of the %d: from %s to %s workers the gain per step was real but less than linear.", n4, below, nm, n2, n4)
                else if (e2 > 0)
                    t = t sprintf(". After the same number of steps, N = %s, having seen twice the data, was not lower than N = %s by more than the yardstick for any of them: from %s to %s workers no gain per step could be seen, let alone a linear one.", n4, n2, n2, n4)
                else
                    t = t sprintf(": from %s to %s workers the speedup in steps was less than linear.", n2, n4)
            } else
                t = t sprintf("N = %s ended lower for %d of the %d clipped methods and within the yardstick for the others.", n4, better, nm)
            t = t sprintf(" Wall time cannot show a speedup in N on this machine: it has 2 cores, so at N = %s two worker processes share each core, and a run trained for %.1f s on average against %.1f s at N = %s. What can be compared is the loss per epoch and per step, and the rounds, as above.", n4, t4 / c4, t2 / c2, n2)
            printf "\n%s", wrap(t)
        }' "$summary" "$curves"
} >"$md"

# ---------------------------------------------------------------- plot
# Unclipped SGD lives at tens of nats/char: drawn at the top edge (CAP, a little above the clipped
# methods' worst), its real values in the key. One colour per method; the seeds solid, dashed,
# dotted.
colour() {
    case $1 in
        sync) echo black ;;
        celgc_I1) echo "#0072b2" ;;
        celgc_I2) echo "#009e73" ;;
        celgc_I4) echo "#e69f00" ;;
        *) echo "#d55e00" ;;
    esac
}
if command -v gnuplot >/dev/null 2>&1; then
    clipped_csvs=""
    for f in "$OUT/${P}"_w*_s*.csv; do
        case $f in *_sgd_s*) ;; *) clipped_csvs="$clipped_csvs $f" ;; esac
    done
    # shellcheck disable=SC2086  # a list of file names without spaces
    CAP=$(awk -F, 'FNR > 1 && $3 + 0 == $3 && $3 > m { m = $3 } END { printf "%.2f", m + 0.1 }' $clipped_csvs)
    # shellcheck disable=SC2086
    FLOOR=$(awk -F, 'FNR > 1 && $3 + 0 == $3 && (m == "" || $3 < m) { m = $3 } END { printf "%.2f", m - 0.05 }' $clipped_csvs)
    panels=""
    for n in $WORKERS; do
        for x in epoch rounds; do
            plots=""
            c=0
            for m in $METHODS; do
                c=$((c + 1))
                [ "$m" = sgd ] && continue
                colour=$(colour "$m")
                d=0
                for s in $SEEDS; do
                    d=$((d + 1))
                    title="notitle"
                    [ $d -eq 1 ] && [ "$n" = 2 ] && [ $x = epoch ] && title="title \"$(label "$m" | sed 's/ (.*//')\""
                    if [ $x = epoch ]; then col=1; else col=5; fi
                    plots="$plots \"$OUT/${P}_w${n}_${m}_s$s.csv\" using $col:3 with linespoints lw 1.5 lc rgb \"$colour\" dt $d pt $c $title,"
                done
            done
            plots=${plots%,}
            if [ -e "$OUT/${P}_w${n}_sgd_s$SEED.csv" ]; then
                unclipped=$(awk -v n="$n" -v s="$SEED" '$1 == n && $2 == "sgd" && $3 == s { printf "%.1f", $6 }' "$summary")
                if [ $x = epoch ]; then col=1; else col=5; fi
                title="notitle"
                [ $x = epoch ] && title="title \"SGD unclipped, seed $SEED (top edge; ends at $unclipped)\""
                plots="$plots, \"$OUT/${P}_w${n}_sgd_s$SEED.csv\" using $col:(\$3 < $CAP ? \$3 : $CAP) with linespoints lw 1.5 lc rgb \"gray50\" dt 4 pt $c $title"
            fi
            if [ $x = epoch ]; then
                panels="$panels
set title \"N = $n workers: against epochs (an epoch is the same data for both N)\"
set xlabel \"epoch\"
unset logscale x
set xtics 1
set key top right opaque box width -6
plot $plots"
            else
                panels="$panels
set title \"N = $n workers: against averaging rounds (log scale)\"
set xlabel \"rounds (gradient or model averages)\"
set logscale x
set xtics auto
unset key
plot $plots"
            fi
        done
    done
    gnuplot <<EOF
set terminal pngcairo size 1400,1000 noenhanced font ",11"
set output "$OUT/$P.png"
set datafile separator ","
set multiplot layout 2,2 title "char-LSTM on fortunes ($TRAIN_CHARS characters, hidden $HIDDEN), TCP, eta = $ETA, gamma = $GAMMA; validation loss, seed $SEED solid, $((SEED + 1)) dashed, $((SEED + 2)) dotted"
set grid
set ylabel "validation loss (nats/char)"
set yrange [$FLOOR:$CAP + 0.05]
$panels
unset multiplot
EOF
else
    echo "celgc_lstm: gnuplot not found: no plot" >&2
fi
rm -f "$summary" "$curves"
echo "celgc_lstm: $md, $OUT/$P.png, $OUT/${P}_*.csv"
cat "$md"
