#!/bin/sh
# make mutate: does the test suite catch a one-line bug? For each mutation below, a scratch copy
# of the repository gets that one change, the tests named for it are built and run there, and the
# mutation counts as caught when they fail. Prints a line per mutation and, last,
# "mutation score: CAUGHT/TRIED", naming the survivors; exits 1 when any survived or could not be
# applied (the text to change is no longer in the file: update the list). Slow (a build per
# mutation): not part of make test.
# Usage: tests/mutate.sh [NAME_SUBSTRING]   (from the top directory; only matching mutations)
set -u
cd "$(dirname "$0")/.."
only=${1:-}
scratch=$(mktemp -d /tmp/distopt-mutate-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
git ls-files | tar cf - -T - | tar xf - -C "$scratch"
# The flight recorder's files of the mutants' jobs (a mutant may keep them) stay in the scratch copy.
DOPT_RECORDER_DIR="$scratch/recorder"
mkdir -p "$DOPT_RECORDER_DIR"
export DOPT_RECORDER_DIR
tried=0
caught=0
survivors=""
unapplied=""

# Replaces the one occurrence of OLD by NEW in FILE (both literal); 1 when OLD is not there once.
replace_once() { # $1 file, $2 old, $3 new
    OLD=$2 NEW=$3 perl -0 -i -ne '
        my ($o, $n) = ($ENV{OLD}, $ENV{NEW});
        my $count = () = /\Q$o\E/g;
        if ($count != 1) { print; exit 3 }
        s/\Q$o\E/$n/; print' "$1"
}

# Runs one built test binary with a filter; MPI tests under mpirun at 2 and 3 ranks. A mutant
# that hangs fails fast: every dtest test gets 60 s (DTEST_TIMEOUT_S; the slowest test of make test
# takes under 30 s), the binary 300 s in all, each MPI run 120 s.
run_test() { # $1 binary name, $2 filter
    exe=$scratch/build/$1
    case $1 in
    test_mpi*)
        for np in 2 3; do
            timeout 120 mpirun --allow-run-as-root --oversubscribe --mca btl_vader_single_copy_mechanism none \
                -np "$np" "$exe" "$2" >>"$scratch/out" 2>&1 || return 1
        done ;;
    *) DTEST_TIMEOUT_S=60 timeout 300 "$exe" "$2" >>"$scratch/out" 2>&1 || return 1 ;;
    esac
    return 0
}

mutate() { # $1 name, $2 file, $3 old, $4 new, then "binary:filter" ...
    name=$1 file=$2 old=$3 new=$4
    shift 4
    case $name in *"$only"*) ;; *) return ;; esac
    tried=$((tried + 1))
    cp "$file" "$scratch/$file"
    if ! replace_once "$scratch/$file" "$old" "$new"; then
        cp "$file" "$scratch/$file"
        echo "NOT APPLIED  $name: the text to change is not in $file exactly once"
        unapplied="$unapplied $name"
        return
    fi
    : >"$scratch/out"
    verdict=survived
    for t in "$@"; do
        bin=${t%%:*} filter=${t#*:}
        if ! make -s -C "$scratch" BUILD=build "build/$bin" >>"$scratch/out" 2>&1; then
            verdict="caught (does not build)"
            break
        fi
        if ! run_test "$bin" "$filter"; then
            verdict="caught by $bin $filter"
            break
        fi
    done
    cp "$file" "$scratch/$file"
    case $verdict in
    survived) survivors="$survivors $name"; echo "SURVIVED     $name ($file)" ;;
    *) caught=$((caught + 1)); echo "caught       $name: $verdict" ;;
    esac
}

# ---------------------------------------------------------------- the mutations
# name, file, old text, new text, tests that must catch it (binary:filter, "" runs all).

mutate ring-segment-length distopt.h \
    '*len = q + (ui < rem ? 1 : 0);' '*len = q + (ui <= rem ? 1 : 0);' test_tcp:conformance
mutate mean-divides-by-size distopt.h \
    'case DOPT_F32: dopt_scale((float *)buf, 1.0f / (float)size, count); break;' \
    'case DOPT_F32: dopt_scale((float *)buf, 1.0f / (float)(size + 1), count); break;' test_shm:conformance_world_2
mutate fingerprint-ignores-count distopt.h \
    'return dopt__mix64(h ^ d->count);' 'return dopt__mix64(h);' test_mpi:mismatches
mutate broadcast-root-ignored distopt.h \
    'd.root = root;' 'd.root = 0;' test_shm:conformance_world_2
mutate clip-factor-inverted clip.h \
    'return norm > (double)limit ? (double)limit / norm : 1.0;' 'return norm > (double)limit ? norm / (double)limit : 1.0;' \
    test_clip:
mutate celgc-rule-max clip.h \
    '*step = limited < (double)eta ? limited : (double)eta;' '*step = limited > (double)eta ? limited : (double)eta;' \
    test_clip:celgc
mutate clip-zero-scale-refused clip.h \
    'static float dopt__clip_scale_or_one(float s) { return dopt__clip_is_zero(s) ? 1.0f : s; }' \
    'static float dopt__clip_scale_or_one(float s) { return dopt__clip_is_zero(s) ? NAN : s; }' test_clip:zero_scale
mutate clip-zero-scale-kept-as-zero clip.h \
    'static float dopt__clip_scale_or_one(float s) { return dopt__clip_is_zero(s) ? 1.0f : s; }' \
    'static float dopt__clip_scale_or_one(float s) { return s; }' test_clip:zero_scale
mutate clip-zero-scale-by-comparison clip.h \
    'static float dopt__clip_scale_or_one(float s) { return dopt__clip_is_zero(s) ? 1.0f : s; }' \
    'static float dopt__clip_scale_or_one(float s) { return s == 0.0f ? 1.0f : s; }' test_clip_ofast:bad_arguments
mutate clip-measure-only-clips clip.h \
    '    if (!opt->measure_only) dopt__clip_apply_buf(grads, f);' '    dopt__clip_apply_buf(grads, f);' \
    test_clip:measure_only
mutate agc-zero-eps-not-the-default clip.h \
    'float eps = opt == NULL || dopt__clip_is_zero(opt->eps) ? DOPT_AGC_EPS_DEFAULT : opt->eps;' \
    'float eps = opt == NULL ? DOPT_AGC_EPS_DEFAULT : opt->eps;' test_clip:agc_zero_eps
mutate dp-celgc-states-dropped localsgd.h \
    '    s = dopt_dp_after_step_buf(dp, params, rule->states);
    return s != DOPT_OK ? s : step_status;' '    s = dopt_dp_after_step_buf(dp, params, NULL);
    return s != DOPT_OK ? s : step_status;' test_localsgd:celgc_rule
mutate augmented-nu-not-squared localsgd.h \
    'if (g2 > 0.0) return v / (tol * tol * g2);' 'if (g2 > 0.0) return v / (tol * g2);' test_localsgd:inner_product
mutate batch-rounds-down localsgd.h \
    'units_d = ceil(need / workers / (double)c.unit_samples);' 'units_d = floor(need / workers / (double)c.unit_samples);' \
    test_localsgd:norm_test
mutate variance-bias-kept localsgd.h \
    'st.grad_norm2 = v[7] > 0.0 ? (v[5] + bc->pooled.gnorm2 - (v[6] > 0.0 ? tau2 * v[6] : 0.0)) / v[7] : NAN;' \
    'st.grad_norm2 = v[7] > 0.0 ? (v[5] + bc->pooled.gnorm2) / v[7] : NAN;' test_localsgd:within
mutate sync-step-compares-the-worker-batch localsgd.h \
    'if (dopt_dp_is_synchronous(dp, dp->step)) dopt_batch_averaged(dp->batch, dp->comm->size);' '' \
    test_localsgd:batch_compares_the_global
mutate sync-batch-not-divided localsgd.h \
    'workers = st && dopt__is_finite(st->workers) && st->workers >= 1.0 ? st->workers : 1.0;' 'workers = 1.0;' \
    test_localsgd:within_worker
mutate exact-ignores-the-global-direction localsgd.h \
    'const float *g = bc->global_dir ? bc->micro + bc->cfg.max_units * n : NULL;' 'const float *g = NULL;' \
    test_localsgd:batch_compares_the_global
mutate sync-norm-from-the-ranks-means localsgd.h '    if (bc->step_gproj) { /* the global' \
    '    if (0) { /* the global' test_localsgd:batch_compares_the_global test_batch_ref:controller_agrees
mutate sync-norm-from-a-compressed-mean localsgd.h \
    'dp->batch->cfg.estimator == DOPT_BATCH_WITHIN && !dp->grad_compressor && !dp->weighted)' \
    'dp->batch->cfg.estimator == DOPT_BATCH_WITHIN && !dp->weighted)' test_localsgd:batch_compares_the_global
mutate celgc-steps-before-the-anchor-check localsgd.h \
    '    if ((s = dopt__dp_check_anchor(dp, "dopt_dp_celgc_step")) != DOPT_OK) return s; /* before the step moves x */' \
    '' test_localsgd:a_step_that_needs_the_anchor
mutate nonfinite-step-kept localsgd.h 'if (!dopt__is_finite(ss) || !dopt__is_finite(mean2)) {' 'if (0) {' \
    test_localsgd:a_step_with_a_non_finite
mutate growth-unbounded localsgd.h 'if (c.max_growth >= 1.0) {' 'if (0) {' test_localsgd:max_growth
mutate anchor-unguarded localsgd.h 'if (dp->anchor == NULL || dp->anchor_set) return NULL;' 'return NULL;' \
    test_localsgd:a_step_that_needs_the_anchor
mutate drift-counted-as-noise localsgd.h \
    '        dopt_batch_end_step(dp->batch);
    }
    t = dp->step;' '    }
    t = dp->step;' test_localsgd:within_variance
mutate outer-momentum-not-nesterov localsgd.h \
    'd += mu * (double)dp->outer_v[i];' '' test_localsgd:outer
mutate finite-scan-keeps-the-smallest distopt.h \
    '            (acc)[j_] = (acc)[j_] > e_ ? (acc)[j_] : e_;' '            (acc)[j_] = (acc)[j_] < e_ ? (acc)[j_] : e_;' \
    test_core:finite
mutate finite-scan-ors-the-blocks distopt.h \
    '(any) |= (uint32_t)(m0_[j_] == 0x7F800000u) | (uint32_t)(m1_[j_] == 0x7F800000u) |' \
    '(any) |= (uint32_t)((m0_[j_] | m1_[j_]) == 0x7F800000u) | (uint32_t)(m1_[j_] == 0x7F800000u) |' test_core:finite
mutate nonfinite-average-unchecked localsgd.h \
    '    *finite = s == DOPT_OK && dopt_all_finite(g, dp->n);' \
    '    *finite = s == DOPT_OK && (dopt_all_finite(g, dp->n) || 1);' test_nonfinite:gradient_average
mutate nonfinite-gradients-not-zeroed localsgd.h \
    '    dopt__dp_zero(grads);' '    if (0) dopt__dp_zero(grads);' test_nonfinite:gradient_average
mutate nonfinite-fail-not-sticky localsgd.h \
    '    if (dp->status != DOPT_OK) return dp->status; /* a non-finite average under DOPT_NONFINITE_FAIL */' '' \
    test_nonfinite:gradient_average
mutate nonfinite-model-flag-ignored localsgd.h \
    '    if (s == DOPT_OK && dp->work[slot] != 0.0f) s = DOPT_ERR_NONFINITE;' '    (void)slot;' \
    test_nonfinite:model_average
mutate nonfinite-model-overflow-unchecked localsgd.h \
    '    if (!dopt__dp_unpack(dp, params, states))' '    if (!dopt__dp_unpack(dp, params, states) && 0)' \
    test_nonfinite:overflow
mutate nonfinite-rank-not-named localsgd.h \
    '    mine[0] = mine_finite ? 0 : 1;' '    mine[0] = mine_finite ? 0 : 0;' test_nonfinite:gradient_average
mutate nonfinite-input-not-scanned-in-place localsgd.h \
    '    *mine = dp->grad_compressor != NULL || dopt_all_finite(g, dp->n);' '    *mine = 1;' \
    test_nonfinite:gradient_average
mutate nonfinite-refused-input-not-scanned localsgd.h \
    '    if (s == DOPT_ERR_NONFINITE && dp->grad_compressor) *mine = dopt_all_finite(g, dp->n);' '' \
    test_nonfinite:gradient_average
mutate nonfinite-packed-average-unchecked localsgd.h \
    '    *finite = s == DOPT_OK && dopt__dp_unpack_finite(grads, dp->work);' \
    '    *finite = s == DOPT_OK && (dopt__dp_unpack_finite(grads, dp->work) || 1);' test_nonfinite:scatter
mutate flat-gradients-copied localsgd.h \
    '{ return b->data != NULL && b->n == n; }' '{ return b->data != NULL && b->n == n && 0; }' test_localsgd:in_place
mutate gapped-gradients-averaged-in-place localsgd.h \
    '{ return b->data != NULL && b->n == n; }' '{ return b->data != NULL && b->n >= n; }' test_localsgd:in_place
mutate steps-not-counted-without-after-step localsgd.h \
    '    if (dp->grads_step != dp->step + 1) return;' '    return;' test_nonfinite:gradient_average
mutate replica-steps-not-compared localsgd.h \
    'if (all[2 * r + 1] != all[1]) {' 'if (0) {' test_localsgd:replica
mutate mpi-check-ignores-seq transport_mpi.h \
    'if (v[0] == fp && v[1] == ~fp && v[2] == d->seq && v[3] == ~d->seq) return DOPT_OK;' \
    'if (v[0] == fp && v[1] == ~fp) return DOPT_OK;' test_mpi:mismatches
mutate shm-dead-rank-misnamed transport_shm.h \
    '"rank %d (pid %d) died", q, (int)cold->pid);' '"rank %d (pid %d) died", (q + 1) % s->size, (int)cold->pid);' \
    test_shm:peer_killed
mutate shm-link-read-ignores-wrap transport_shm.h \
    'memcpy(dst + first, dopt__shm_ring_of(ch), n - first);' 'memcpy(dst + first, dopt__shm_ring_of(ch) + off, n - first);' \
    test_shm:conformance_on_the_engine
mutate shm-link-writes-after-close transport_shm.h \
    'if (ch->closed || dopt__shm_peer_gone(s, peer))' 'if (dopt__shm_peer_gone(s, peer))' test_shm:links_keep
mutate shm-link-dead-peer-not-probed transport_shm.h \
    'if (!s->gone[polls[i].peer] && dopt__shm_rank_dead(s, polls[i].peer))' 'if (0 && dopt__shm_rank_dead(s, polls[i].peer))' \
    test_shm:peer_dying_mid_message
mutate shm-direct-wait-ignores-frames transport_shm.h \
    'if (st == DOPT_OK && d != NULL) st = dopt__shm_check_frames' 'if (0 && d != NULL) st = dopt__shm_check_frames' \
    test_shm:a_failure_crosses
mutate shm-engine-failure-not-recorded transport_shm.h \
    'if (dopt__family_error(c) != DOPT_OK) {' 'if (0) {' \
    test_shm:a_failure_crosses
mutate shm-engine-abort-recorded-with-the-reporters-call transport_shm.h \
    'dopt__shm_publish_abort(s, c->error, (int)dopt__get_le32(e->abort_msg + 32), why);' \
    'dopt__shm_publish_abort(s, c->error, s->rank, c->detail);' test_faults:shm_engine
mutate shm-link-end-ignores-segment-failure transport_shm.h \
    'if (!dopt__shm_links_aborted(c, s, err)) *err = reason;' '(void)c, (void)s, *err = reason;' test_shm:a_failure_crosses
mutate mpi-links-leave-messages-behind transport_mpi.h \
    'while (q != m->rank && !L->ended && dopt__now_ms() < deadline) {' 'while (0) {' test_mpi:engine_over
mutate mpi-link-rx-reposted-out-of-turn transport_mpi.h \
    'L->rx_cur = (L->rx_cur + 1) % DOPT__MPI_RX_SLOTS;' 'L->rx_cur = (L->rx_cur + 0) % DOPT__MPI_RX_SLOTS;' \
    test_mpi:engine_over
mutate localsgd-local-step-ignores-poison localsgd.h \
    '    return dopt__family_error(dp->comm);' \
    '    return DOPT_OK;' test_localsgd:poisoned
mutate close-skips-the-short-round localsgd.h \
    'if (s == DOPT_OK && dp->round_steps > 0) s = dopt__dp_end_round(' \
    'if (s == DOPT_OK && dp->round_steps > 9) s = dopt__dp_end_round(' test_localsgd:close
mutate close-misses-differing-replicas localsgd.h \
    'if (s == DOPT_OK && !same) s = dopt__dp_close_mismatch(dp, params);' 'if (s == DOPT_OK && same < 0) s = dopt__dp_close_mismatch(dp, params);' test_localsgd:close
mutate period-one-averages-models-after-averaged-gradients localsgd.h \
    'return dopt__dp_end_round(dp, params, states, dp->grads_step != t + 1, t, "");' \
    'return dopt__dp_end_round(dp, params, states, 1, t, "");' test_localsgd:period_one
mutate bucket-starts-before-its-segments-are-marked localsgd.h \
    '            if (!ov->marks[ov->order[j]]) return;' '            if (!ov->marks[ov->order[j]] && j > b->first) return;' \
    test_overlap:bucketed_mean
mutate staged-bucket-mean-not-copied-out localsgd.h \
    'if (s == DOPT_OK && b->staged && !ov->check)' 'if (s == DOPT_OK && b->staged && !ov->check && b->k)' \
    test_overlap:bucketed_mean
mutate compressed-bucket-drops-a-segment localsgd.h \
    'ov->order + b->first,
                                             b->end - b->first);' 'ov->order + b->first,
                                             b->end - b->first - (b->end - b->first > 1));' \
    test_overlap:compressed_buckets
mutate bucket-orders-not-compared localsgd.h 'if (a == b) continue;' 'if (1) continue;' \
    test_overlap:another_order
mutate never-marked-segment-not-said localsgd.h \
    'dopt__dp_ov_mistake(ov, DOPT__DP_NEVER_MARKED, i);' '(void)0;' test_overlap:mistake_in_one
mutate write-after-mark-not-checked localsgd.h \
    'if (dopt__fnv1a(DOPT__FNV_OFFSET, h.ptr, h.count * sizeof(float)) != ov->sums[i])' \
    'if (dopt__fnv1a(DOPT__FNV_OFFSET, h.ptr, h.count * sizeof(float)) == 0)' \
    test_overlap:write_after
mutate marks-verdict-not-agreed localsgd.h \
    's = dopt_allreduce(dp->comm, verdict, 1, DOPT_I64, DOPT_MIN);' 's = DOPT_OK;' test_overlap:mistake_in_one
mutate marks-verdict-names-the-highest-rank localsgd.h \
    '(int64_t)dp->comm->rank << 40 |' '(int64_t)(dp->comm->size - 1 - dp->comm->rank) << 40 |' \
    test_overlap:mistake_in_one
mutate unknown-segment-mark-not-said localsgd.h \
    'if (sync) dopt__dp_ov_mistake(ov, DOPT__DP_MARKED_UNKNOWN, seg);' 'if (0) dopt__dp_ov_mistake(ov, 0, seg);' \
    test_overlap:mistake_in_one
mutate other-gradients-after-marks-not-said localsgd.h \
    '|| !dopt__dp_ov_same_buf(ov, grads))' '|| !dopt__dp_ov_same_buf(ov, &ov->grads))' test_overlap:mistake_in_one
mutate mistaken-step-gradients-not-zeroed localsgd.h '    dopt__dp_zero(&dp->ov.grads);' '' \
    test_overlap:mistake_in_one
mutate weighted-bucket-averaged-plainly localsgd.h \
    's = dopt_allreduce_weighted_mean(dp->comm, b->region, b->count, DOPT_F32, ov->weight);' \
    's = dopt_allreduce(dp->comm, b->region, b->count, DOPT_F32, DOPT_MEAN);' test_overlap:weighted_buckets
mutate batch-direction-skipped-after-buckets localsgd.h \
    'if (dp->batch && dp->batch->cfg.estimator == DOPT_BATCH_WITHIN && !dp->grad_compressor && !dp->weighted)' \
    'if (dp->batch && dp->batch->cfg.estimator == DOPT_BATCH_WITHIN && !dp->grad_compressor && !dp->weighted && grads != &dp->ov.grads)' \
    test_overlap:batch_statistics
mutate compressor-misfit-names-another-segment localsgd.h \
    '        if (dopt_buf_segment(g, i).count != cz->segs[i].count) return i;' \
    '        if (dopt_buf_segment(g, i).count != cz->segs[i].count) return 0;' test_overlap:another_table
mutate descriptor-misfit-names-another-segment compress.h \
    '        if (dopt_buf_segment(b, i).count != cz->segs[i].count) return i;' \
    '        if (dopt_buf_segment(b, i).count != cz->segs[i].count) return 0;' test_compress:buckets_in_any_order
mutate unused-segment-not-zeroed localsgd.h '    if (unused) {' '    if (0 && unused) {' test_overlap:unused
mutate mean-of-a-scalar-is-a-sum distopt.h \
    'dopt_status s = dopt_allreduce(c, &x, 1, DOPT_F64, DOPT_MEAN);' \
    'dopt_status s = dopt_allreduce(c, &x, 1, DOPT_F64, DOPT_SUM);' test_localsgd:close
mutate tcp-abort-culprit-ignored engine.h \
    'dopt_comm_fail(c, d, (dopt_status)f->status, "%s (reported by rank %d)", why, f->reporter);' \
    'dopt_comm_fail(c, d, (dopt_status)f->status, "rank %d closed the connection", f->reporter);' test_faults:tcp
mutate tcp-closed-connection-misnamed engine.h \
    '"rank %d closed the connection%s", culprit, also);' '"rank %d closed the connection%s", (culprit + 1) % e->size, also);' \
    test_faults:tcp
mutate engine-sleeps-past-the-blame-deadline engine.h \
    'if (e->blame_deadline > 0 && wait_ms > dopt__ms_left(e->blame_deadline))' \
    'if (0 && e->blame_deadline > 0 && wait_ms > dopt__ms_left(e->blame_deadline))' \
    test_tcp:survivor_whose_other_link_is_parked
mutate engine-abort-behind-a-parked-frame-ignored engine.h \
    '                dopt_status s = dopt__eng_take_abort(c, e, p, d, &f);' '                dopt_status s = DOPT_OK;' \
    test_tcp:abort_behind_a_parked_frame
mutate tcp-parked-link-end-unwatched transport_tcp.h \
    '#define DOPT__TCP_POLL_END POLLRDHUP' '#define DOPT__TCP_POLL_END 0' \
    test_tcp:abort_behind_a_parked_frame_is_read_when_the_peer_ends
mutate tcp-destroy-closes-before-the-peer-has-its-bytes transport_tcp.h \
    '    return dopt__tcp_unacked(P->fd) > 0;' '    return dopt__tcp_unacked(P->fd) < 0;' test_tcp:destroy_after_an_abort
mutate engine-timeout-restarts-every-poll engine.h \
    '    if (e->last_progress == 0) e->last_progress = entry;' '    e->last_progress = entry;' \
    test_engine:dopt_test_reaches
mutate engine-abort-keeps-links-open engine.h \
    '        if (p != e->rank) e->root->vt->link_close(e->root, p);' '' test_engine:dopt_test_reaches
mutate two-level-combines-before-the-host-sum engine.h \
    '    e->ops[rs + 1].dep = host_sum;' '' test_engine:two_level
mutate two-level-sends-from-the-chunk-start engine.h \
    '    e->ops[rs].dep_off = e->blk_off[hp] - chunk_off;' '' test_engine:two_level
mutate two-level-spreads-too-early engine.h \
    'int b = dopt__mod((long long)hp + 1 - t, H), done = t == 0 ? rs + 2 * (H - 2) + 1 : ag + 2 * (t - 1) + 1;' \
    'int b = dopt__mod((long long)hp + 1 - t, H), done = t == 0 ? rs + 2 * (H - 2) + 1 : ag + 2 * (t - 1) - 1;' \
    test_engine:two_level
mutate two-level-uneven-hosts-accepted engine.h \
    '        if (ranks != count) { /* uneven hosts: flat schedules only */' '        if (0) {' \
    test_engine:uneven
mutate group-ignores-key engine.h \
    'for (i = m; i > 0 && all[3 * members[i - 1] + 1] > all[3 * r + 1]; i--) members[i] = members[i - 1];' \
    'for (i = m; i > 0 && 0; i--) members[i] = members[i - 1];' test_engine:groups_pass
mutate group-number-not-agreed distopt.h \
    '        if ((uint64_t)all[3 * r + 2] > number) number = (uint32_t)all[3 * r + 2];' \
    '        if (r == c->rank) number = (uint32_t)all[3 * r + 2];' test_engine:group
mutate group-failure-poisons-only-itself distopt.h \
    'if (c->error == DOPT_OK && f->family_status != DOPT_OK) {' 'if (0) {' \
    test_engine:mismatch_between_parent
mutate engine-dry-queue-not-restarted engine.h \
    '    if (*cur < 0) *cur = i; /* the queue was empty, or ran dry before this request started */' \
    '    if (*cur < 0 && *tail == i) *cur = i;' test_engine:dry
mutate progress-thread-idle engine.h \
    '        if (e->retired < e->started && e->root->family_status == DOPT_OK) dopt__eng_run(e->root, e, e->started - 1, 0);' \
    '' test_engine:progress_thread
mutate tcp-loopback-table-unchecked transport_tcp.h \
    'if (s == DOPT_OK) s = dopt__tcp_loopback_check(c, t, how);' \
    'if (s == DOPT_OK && 0) s = dopt__tcp_loopback_check(c, t, how);' test_tcp:rank_0_
mutate tcp-loopback-joiner-unchecked transport_tcp.h \
    'if (!dopt__tcp_is_loopback(addr) || dopt__tcp_is_loopback(master)) return DOPT_OK;' \
    'if (!dopt__tcp_is_loopback(addr) || dopt__tcp_is_loopback(master) || 1) return DOPT_OK;' test_tcp:off_loopback
mutate tcp-ifname-family-ignored transport_tcp.h \
    'if (!found || (dopt__tcp_is_v4(addr) == want_v6 && dopt__tcp_is_v4(a) != want_v6)) memcpy(addr, a, 16);' \
    'if (!found || (dopt__tcp_is_v4(addr) == want_v6 && 0)) memcpy(addr, a, 16);' test_tcp:socket_ifname
mutate tcp-v2-answered-in-v3-layout transport_tcp.h \
    'if (reason == DOPT__TCP_WRONG_VERSION && q->rec[4] == 2 && q->rec[5] == 0)' \
    'if (reason == DOPT__TCP_WRONG_VERSION && q->rec[4] == 2 && q->rec[5] == 0 && 0)' test_tcp:version_2
mutate compress-average-weight compress.h \
    'weight = 1.0f / (float)comm->size;' 'weight = 1.0f / (float)(comm->size + 1);' test_compress:equals_serial
mutate per-rank-scale-average-drops-1/N compress.h \
    'dopt__tern_accum(sp.ptr, n, weight * b, data[r]);' 'dopt__tern_accum(sp.ptr, n, b, data[r]);' \
    test_compress:equals_serial
mutate shared-scale-is-min compress.h \
    'dopt_allreduce(share, cz->scales, v->nsegs + 1, DOPT_F32, DOPT_MAX);' \
    'dopt_allreduce(share, cz->scales, v->nsegs + 1, DOPT_F32, DOPT_MIN);' test_compress:equals_serial
mutate ef-residual-sign compress.h \
    'dopt__accumulate(cz, v, msg, -1.0f, &e);' 'dopt__accumulate(cz, v, msg, 1.0f, &e);' test_compress:ef_residual
mutate powersgd-warm-start-dropped compress.h \
    'memcpy(cz->psgd_qnext + dopt__psgd_qoff(cz, i), b, cols * r * sizeof(float));' '(void)0;' test_powersgd:warm_start
mutate powersgd-residual-sign compress.h \
    'for (k = 0; k < sp.count; k++) m[k] = m[k] - sp.ptr[k];' 'for (k = 0; k < sp.count; k++) m[k] = sp.ptr[k] - m[k];' \
    test_powersgd:residual
mutate powersgd-gram-schmidt-order compress.h \
    '    for (j = 0; j < r; j++)
        if (!dopt__psgd_gs_column(v, rows, j))' '    for (j = r; j-- > 0;)
        if (!dopt__psgd_gs_column(v, rows, j))' test_powersgd:warm_start
mutate powersgd-dependent-column-left-zero compress.h \
    'for (attempt = 0; attempt < 4; attempt++) {' 'for (attempt = 0; attempt > 4; attempt++) {' test_powersgd:zero_gradient
mutate powersgd-q-flag-ignored compress.h \
    'b[nq] = dopt__psgd_second(cz, v, a, b, nq) ? 0.0f : 1.0f;' 'b[nq] = 0.0f * (float)dopt__psgd_second(cz, v, a, b, nq);' \
    test_powersgd:nonfinite
mutate bucket-codes-keyed-by-place compress.h \
    'dopt__seg_rng(cz, rank, v->index[j], &so.rng);' 'dopt__seg_rng(cz, rank, j, &so.rng);' test_compress:buckets_in_any
mutate bucket-ring-codes-keyed-by-place compress.h \
    'dopt__seg_rng(cz, cz->rank, w.seg, &rng);' 'dopt__seg_rng(cz, cz->rank, w.pos, &rng);' test_compress:tcp_buckets_in_any
mutate bucket-step-advances-per-call compress.h \
    'if (cz->nfinished == cz->nsegs) dopt__step_close(cz);' 'dopt__step_close(cz);' test_compress:buckets_in_any
mutate bucket-failed-step-kept compress.h \
    'cz->step_failed |= s != DOPT_OK;' 'cz->step_failed |= 0 * s;' test_compress:buckets_in_any
mutate bucket-residual-never-kept compress.h \
    'if (cz->ef && cz->count) memcpy(cz->residual, cz->work, cz->count * sizeof(float));' '(void)0;' \
    test_compress:buckets_in_any
mutate bucket-given-twice-accepted compress.h \
    'if (i < cz->nsegs && !cz->given[i]) {' 'if (i < cz->nsegs) {' test_compress:buckets_in_any
mutate bucket-residual-at-the-calls-place compress.h \
    'float *w = cz->work + cz->offs[v->index[j]];' 'float *w = cz->work + cz->offs[j];' test_compress:buckets_in_any
mutate powersgd-step-keeps-old-q compress.h \
    'if (cz->psgd_nq) memcpy(cz->psgd_q, cz->psgd_qnext, cz->psgd_nq * sizeof(float));' '(void)0;' test_powersgd:warm_start
mutate powersgd-bucket-m-at-the-calls-place compress.h \
    '        m = cz->work + cz->offs[i];
        rows = dopt__psgd_rows(cz, i);
        if (rows == 0) {
            if (dopt__absbits_max' '        m = cz->work + cz->offs[j];
        rows = dopt__psgd_rows(cz, i);
        if (rows == 0) {
            if (dopt__absbits_max' test_compress:buckets_in_any
mutate started-on-one-thread-comm-uses-the-worker compress.h \
    'if (s == DOPT_OK && !comm->one_thread) s = dopt__compress_worker(cz);' 'if (s == DOPT_OK) s = dopt__compress_worker(cz);' \
    test_compress:started_buckets
mutate started-blocking-call-not-waited compress.h \
    'return s != DOPT_OK ? s : dopt_compress_wait(&req);' 'return s;' test_compress:started_buckets
mutate started-request-forgets-its-status compress.h \
    '    req->ticket = 0;
    return req->status = s;' '    req->ticket = 0;
    return s;' test_compress:started_buckets

mutate ring-width-a-bit-short compress.h \
    'while (((uint64_t)1 << w) < 2 * k + 1) w++;' 'while (((uint64_t)1 << w) < 2 * k) w++;' test_ring:integer_ring
mutate ring-step-count compress.h \
    'h->rx.K = (s + 1) * (int)p->k0;' 'h->rx.K = (s + 1) * (int)p->k0 + 1;' test_ring:integer_ring
mutate ring-two-level-wrong-chunk compress.h \
    '(pl->j + 1) % pl->L, &cf, &cl); /* the chunk carried across */' \
    'pl->j % pl->L, &cf, &cl); /* the chunk carried across */' test_ring:integer_ring
mutate ring-pieces-from-this-place-alone compress.h \
    'b->cap = (a->cap + (size_t)pl->H - 1) / (size_t)pl->H;' 'b->cap = (b->g1 - b->g0 + (size_t)pl->H - 1) / (size_t)pl->H;' \
    test_ring:cuts_as_many
mutate ring-pipeline-runs-ahead-of-the-encoder compress.h \
    'while (t < pl->nb && q->encoded <= t)' 'while (t < pl->nb && q->encoded < t)' test_ring:integer_ring
mutate ring-pipeline-decodes-a-bucket-not-summed compress.h \
    '&& q->summed <= d) pthread_cond_wait' '&& q->summed < d) pthread_cond_wait' test_ring:integer_ring
mutate ring-pipeline-host-sums-in-one-region compress.h \
    '(size_t)(k % 2) * pl->host_bytes' '(size_t)(k % 1) * pl->host_bytes' test_ring:integer_ring
mutate ring-pipeline-bucket-planes-misplaced compress.h \
    'cz->ring_buf + w.lo * 16);' 'cz->ring_buf + (w.lo - (size_t)f) * 16);' test_ring:integer_ring
mutate ring-pipeline-bucket-cut compress.h \
    'w->e0 = (lo - gb) * DOPT__BLOCK;' 'w->e0 = (lo - gb + (lo > gb)) * DOPT__BLOCK;' test_ring:integer_ring
mutate ring-fold-bias-portable compress.h \
    'va[t] = (uint16_t)(va[t] + vb[t] - a->K - b->K + o->K);' \
    'va[t] = (uint16_t)(va[t] + vb[t] - a->K - b->K + o->K + 1);' test_ring_portable:integer_ring
mutate ring-accepts-a-sum-too-large compress.h \
    'bad |= va[t] > 2 * a->K;' 'bad |= va[t] > 2 * a->K + 1;' test_ring_portable:kernels
mutate majority-tie-counts-as-positive compress.h \
    'y[i + t] = vote ? (v[t] > K ? scale : v[t] < K ? -scale : 0.0f)' 'y[i + t] = vote ? (v[t] >= K ? scale : v[t] < K ? -scale : 0.0f)' \
    test_ring_portable:majority
mutate half-ring-mean-weights compress.h \
    'x[t] = (x[t] + y[t]) / ko;' 'x[t] = (x[t] + y[t]) / (ko + 1.0f);' test_ring:majority_fp16_and_bf16
mutate half-ring-ignores-non-finite compress.h \
    'return s != DOPT_OK ? s : flag != 0.0f ? DOPT_ERR_NONFINITE : DOPT_OK;' \
    'return s != DOPT_OK ? s : flag != 0.0f ? DOPT_OK : DOPT_OK;' test_ring:non_finite
mutate ring-buffer-allocated-every-call compress.h \
    'if (bytes <= cz->ring_bytes) return DOPT_OK;' 'if (bytes < cz->ring_bytes) return DOPT_OK;' \
    test_allocs:compress_allreduce
mutate setup-failure-kept-by-the-family distopt.h \
    '    f->family_status = DOPT_OK;' '    (void)0;' test_tcp:forgotten
mutate exchange-received-bytes engine.h \
    'dopt__eng_req(e, e->started)->received += bytes;' 'dopt__eng_req(e, e->started)->received += bytes / 2;' \
    test_tcp:conformance_world_of_3

mutate launch-torchrun-port-not-moved distopt.h \
    '            info->master_port++;' '            (void)0;' test_launch:torchrun
mutate launch-dopt-conflict-ignored distopt.h \
    '    if (*value >= 0 && mine != *value) {' '    if (0 && mine != *value) {' test_launch:mistakes
mutate launch-slurm-node-list-range distopt.h \
    '        if (node < times) return tasks <= INT_MAX ? (int)tasks : -1;' \
    '        if (node <= times) return tasks <= INT_MAX ? (int)tasks : -1;' test_launch:slurm
mutate launch-shm-without-a-name launch.h \
    '    if (all_here && DOPT__LAUNCH_SHM && (info->job[0] || (shm_name && *shm_name))) return "shm";' \
    '    if (all_here && DOPT__LAUNCH_SHM && (!info->job[0] || (shm_name && *shm_name))) return "shm";' \
    test_launch:transport
mutate shrink-adopts-a-lower-decision engine.h \
    '    if (from > a->from) {' '    if (from < a->from) {' test_shrink:agreement
mutate shrink-decides-without-waiting engine.h \
    '    if (dopt__agree_waiting_for(a) >= 0) return 0;' '    (void)0;' test_shrink:agreement
mutate shrink-forgets-the-culprit transport_tcp.h \
    '        dopt__tcp_shrink_gone(c, &z, c->lost_rank, "the failure named it");' '        (void)0;' \
    test_shrink:stopped
mutate shrink-closes-a-later-hello transport_tcp.h \
    'dopt__get_le32(z->pbuf[i] + 8) > c->epoch &&' 'dopt__get_le32(z->pbuf[i] + 8) > c->epoch + 9 &&' \
    test_shrink:second_death
mutate shrink-ignores-min-ranks transport_tcp.h \
    '    else if (members < c->min_ranks)' '    else if (members < 0)' test_shrink:min_ranks
mutate keepalive-never-asked transport_tcp.h \
    '    for (p = 0; p < t->size; p++) dopt__tcp_keepalive(t->peers[p].fd, t->keepalive_s);' '    (void)p;' \
    test_tcp:keepalive
mutate keepalive-ends-a-link-at-one-lost-probe transport_tcp.h \
    'int one = 1, probes = DOPT__TCP_KEEPALIVE_PROBES;' 'int one = 1, probes = 1;' test_tcp:keepalive
mutate join-proof-without-the-members-nonce transport_tcp.h \
    '    memcpy(m + 2 + DOPT__TCP_NONCE_BYTES, nonce_m, DOPT__TCP_NONCE_BYTES);' \
    '    memset(m + 2 + DOPT__TCP_NONCE_BYTES, nonce_m[0] & 0, DOPT__TCP_NONCE_BYTES);' test_tcp:joiners_handshake
mutate join-member-takes-any-proof transport_tcp.h \
    '            return dopt__join_refuse(s, 1, DOPT__JOIN_WRONG_TOKEN, "its proof is not the job token'"'"'s", out);' \
    '            (void)0;' test_tcp:joiners_handshake
mutate join-siphash-one-round-short transport_tcp.h \
    '    for (i = 0; i < 4; i++) DOPT__SIPROUND(v0, v1, v2, v3);' '    for (i = 0; i < 3; i++) DOPT__SIPROUND(v0, v1, v2, v3);' \
    test_tcp:siphash
mutate grow-hello-takes-any-proof transport_tcp.h \
    '    return dopt__tcp_same_bytes(want, in, sizeof want);' '    return want[0] || 1;' test_tcp:members_hold
mutate members-but-0-never-listen-for-joiners transport_tcp.h \
    '    return t->ready ? t->shrink_lfd : -1;' '    return -1;' test_tcp:members_hold
mutate held-joiner-that-left-is-kept transport_tcp.h \
    '        t->pfd[np].events = POLLIN | DOPT__TCP_POLL_END;' \
    '        t->pfd[np].events = t->joiners[j].side.stage == DOPT__JOIN_HELD ? 0 : POLLIN;' test_tcp:members_hold
mutate elastic-never-goes-on localsgd.h \
    '        if (dopt__dp_lost_peer(dp, s)) s = dopt__dp_go_on(dp, s, params, states, given, 1, &adopted);' '        (void)0;' \
    test_shrink:elastic_driver_averages
mutate elastic-averages-again-where-a-survivor-was-ahead localsgd.h \
    '    if (at[0] == -at[1] && at[2] == -at[3] && at[5] == -1.0) {' '    if (at[5] == -1.0) {' \
    test_shrink:round_ahead
mutate elastic-joiner-never-seen localsgd.h \
    'dp->work[slot + 1] = dopt_comm_joiners_held(dp->comm) > 0 ? 1.0f : 0.0f;' 'dp->work[slot + 1] = 0.0f;' \
    test_shrink:restarted_worker_back
mutate elastic-ignores-a-failure-found-at-the-next-call localsgd.h \
    '    if (!dopt__dp_lost_peer(dp, s) || dp->status != DOPT_OK || dp->work == NULL ||' \
    '    if (1 || dp->status != DOPT_OK || dp->work == NULL ||' test_shrink:own_collective
mutate elastic-forgets-the-dead-in-the-retry localsgd.h \
    '        if (dp->comm == before) break; /* the shrink failed */' '        if (dp->comm != before) break;' \
    test_shrink:while_the_survivors_go_on
mutate elastic-never-takes-joiners-in localsgd.h \
    '    if (dp->elastic && average != 2 && (s = dopt__dp_admit(dp, given, params, states, t)) != DOPT_OK)' \
    '    if (0 && (s = dopt__dp_admit(dp, given, params, states, t)) != DOPT_OK)' \
    test_shrink:restarted_worker_back
mutate elastic-joiner-takes-a-corrupt-state localsgd.h \
    '    if (h != agreed || h_host != agreed_host) {' '    if (0) {' test_shrink:takes_the_state_whole
mutate elastic-joiner-takes-corrupt-host-bytes localsgd.h \
    '    if (h != agreed || h_host != agreed_host) {' '    if (h != agreed) {' test_shrink:takes_the_state_whole
mutate elastic-sender-keeps-its-host-bytes localsgd.h \
    '    if (dp->host_bytes) memcpy(buf + host, dp->host, dp->host_bytes); /* the sender'"'"'s go to the joiners */' \
    '    (void)0;' test_shrink:takes_the_state_whole
mutate host-bytes-not-saved localsgd.h \
    '    if (dp->host_bytes) dopt__dp_put(w, dp->host, dp->host_bytes);' '    if (dp->host_bytes) w->pos += dp->host_bytes;' \
    test_localsgd:host_bytes
mutate host-size-not-in-the-layout localsgd.h \
    '    dopt__dp_put_u64(w, dp->host_bytes);' '    dopt__dp_put_u64(w, 0);' test_localsgd:host_bytes
mutate shrink-ignores-a-groups-failure distopt.h \
    '    else if (dopt__family_error(c) == DOPT_OK) /* a group'"'"'s failure is its communicator'"'"'s too */' \
    '    else if (c->error == DOPT_OK)' test_shrink:in_a_group
mutate listen-port-ignored transport_tcp.h \
    '(uint32_t)cfg->listen_port, &t->lfd, &port);' '0, &t->lfd, &port);' test_tcp:listen_port
mutate shm-shrink-ignores-min-ranks transport_shm.h \
    '        if (m < c->min_ranks)' '        if (m < 0)' test_shrink:shm_fewer
mutate shm-join-does-not-watch-the-failed-job transport_shm.h \
    '            if (was >= 0 && w->job &&' '            if (was >= 0 && w->job == (void *)1 &&' \
    test_shrink:shm_a_member_lost_after
mutate shm-grow-does-not-watch-the-joiners transport_shm.h \
    'return !w->own && !dopt__shm_lock_held(w->box_fd, (off_t)DOPT__SHM_BOX_BYTES + slot, 1);' \
    'return 0;' \
    test_shrink:shm_grow
mutate shm-grow-counts-a-slot-nobody-holds transport_shm.h \
    'return dopt__shm_lock_held(fd, (off_t)DOPT__SHM_BOX_BYTES + k, 1) ? DOPT__SHM_SLOT_TICKET(w) : 0;' \
    'return fd >= -1 ? DOPT__SHM_SLOT_TICKET(w) : 0;' test_shrink:shm_grow
mutate shm-grow-failure-not-told-to-the-joiner transport_shm.h \
    '    if (st != DOPT_OK) { /* the joiners admitted (or being admitted by a member now lost) ask again */' \
    '    if (0) {' test_shrink:shm_grow_failed_is_told
mutate shm-join-box-left-behind transport_shm.h \
    '                shm_unlink(path);' '                (void)0;' test_shrink:shm_grow
mutate shm-grow-forgets-grown-from transport_shm.h \
    '        c2->grown_from = s->size;' '        (void)0;' test_shrink:shm_grow
mutate shm-agreement-waits-for-nobody transport_shm.h \
    '!dopt__shm_rank_dead(s, q))
                pending++;' '!dopt__shm_rank_dead(s, q))
                (void)pending;' test_shrink:shm_survivors
mutate heartbeat-never-sent transport_tcp.h \
    '(void)sendto(h->ufd, msg, sizeof msg, MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr *)&ss, len);' \
    '(void)ss, (void)len;' test_tcp:heartbeat
mutate heartbeat-not-handed-over-at-a-shrink transport_tcp.h \
    'if (from == NULL || from->hb == NULL || t2->size < 2) return' 'if (1) return' test_tcp:heartbeat
mutate heartbeat-end-reported-as-a-close transport_tcp.h \
    '*err = dopt__tcp_silent(t, peer) ? ETIMEDOUT : 0;' '*err = 0;' test_tcp:heartbeat
mutate elastic-joiner-without-the-average-states localsgd.h \
    '    if (avg) memcpy(buf + file, dp->work + dp->n, avg);' '    (void)0;' test_shrink:takes_the_state_whole
mutate elastic-joiner-layout-unnamed localsgd.h \
    '    s = dopt__dp_check_file_layout(dp, buf + 24, (size_t)layout_bytes, mine, "elastic: the job runs");' \
    '    s = DOPT_OK;' test_shrink:configured_otherwise
mutate elastic-joiner-keeps-its-step localsgd.h \
    '    dopt__dp_get_state(&r, dp); /* step, syncs, round counters, anchor, outer momentum */' '    (void)r;' \
    test_shrink:restarted_worker_back
mutate elastic-joiner-keeps-its-model localsgd.h \
    '    if (dp->n) memcpy(dp->work, dp->anchor, dp->n * sizeof(float)); /* the model of the last average */' \
    '    (void)0;' test_shrink:takes_the_state_whole
mutate shrink-takes-a-wrong-token transport_tcp.h \
    '        why = "the wrong job token";' '        why = NULL;' test_shrink:strangers
mutate shrink-takes-a-mismatch-for-a-lost-peer distopt.h \
    'c->error != DOPT_ERR_PEER_LOST && c->error != DOPT_ERR_TIMEOUT)' 'c->error == DOPT_OK)' test_shrink:refuses
mutate recorder-end-never-recorded engine.h \
    'dopt__rec_end(e->root, q->comm, q->rec, DOPT_OK); /* FLIGHT RECORDER */' '(void)0;' \
    test_recorder:tcp_entries_record
mutate recorder-engine-loses-its-entry engine.h \
    'q->rec = dopt__rec_current(e->root);' 'q->rec = 0;' test_recorder:shm_engine_entries_record
mutate recorder-arrival-not-timed engine.h \
    'dopt__rec_arrived(e->root, q->comm, q->rec, o->peer); /* FLIGHT RECORDER */' '(void)q;' \
    test_recorder:tcp_straggler
mutate recorder-wait-charged-to-the-wrong-peer distopt.h \
    'owner->traffic.waited_ns[peer] += now - since;' 'owner->traffic.waited_ns[(peer + 1) % DOPT_STRAGGLER_RANKS] += now - since;' \
    test_recorder:straggler
mutate recorder-newest-entry-unpublished distopt.h \
    '__atomic_store_n(&r->hdr->written, k + 1, __ATOMIC_RELEASE);' '__atomic_store_n(&r->hdr->written, k, __ATOMIC_RELEASE);' \
    test_recorder:entries_record
mutate recorder-file-left-after-a-clean-run distopt.h \
    'if (!r->keep && stat(r->path, &st) == 0' 'if (0 && stat(r->path, &st) == 0' test_recorder:clean_job
mutate recorder-failed-job-file-removed distopt.h \
    'if (!r->keep && stat(r->path, &st) == 0' 'if (stat(r->path, &st) == 0' test_recorder:tcp_inspect
mutate inspect-stopped-process-not-seen tools/distopt-inspect.c \
    "r->stopped = p[2] == 'T' || p[2] == 't';" 'r->stopped = 0;' test_recorder:shm_inspect
mutate inspect-zombie-counted-alive tools/distopt-inspect.c \
    "r->gone = p[2] == 'Z' || p[2] == 'X';" '(void)0;' test_recorder:tcp_inspect
mutate inspect-skip-read-as-size tools/distopt-inspect.c \
    'if (have_next && inspect_same(&next, &call[odd])) {' 'if (0) {' test_recorder:shm_engine_inspect
mutate inspect-failed-rank-not-predicted tools/distopt-inspect.c \
    '    if (x) return *out = *x, 2;
    if (seq < 2' '    if (x) return *out = *x, 2;
    if (1 || seq < 2' test_recorder:inspect
mutate inspect-moving-job-blamed tools/distopt-inspect.c \
    '    return live > 0;
}' '    return 0;
}' test_recorder:tcp_inspect
echo "mutation score: $caught/$tried${survivors:+ (survived:$survivors)}${unapplied:+ (not applied:$unapplied)}"
[ "$caught" -eq "$tried" ]
