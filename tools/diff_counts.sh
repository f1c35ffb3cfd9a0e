#!/usr/bin/env bash
# The changed lines a learner reads between a stage's train.c and the one it builds on, by
# issue 33's measure: diff -u A B | grep -c '^[-+][^-+]' (added and removed lines, not the
# +++/--- headers, not blank ones). One line per pair: "<from>→<to> <changed> <budget>", the
# budget being the most the pair may change (tests/test_diff_counts.sh holds each to it;
# docs/ARCHITECTURE.md quotes the counts).
# Usage: bash tools/diff_counts.sh
set -u
cd "$(dirname "$0")/.." || exit 1
# from to budget
# budgets are ceilings with room (~15% over the count when set), so that removing a stage's dead
# lines never needs a budget raised to land
pairs="01_single_gpu 02_mixed_precision 70
02_mixed_precision 03_ddp 125
03_ddp 04_fsdp 130
03_ddp 05_tensor_parallel 170
03_ddp 07_pipeline_parallel 170
03_ddp 08_mixture_of_experts 130
03_ddp 09_context_parallel 100
03_ddp 10_composed 240"
while read -r from to budget; do
    for f in "$from/train.c" "$to/train.c"; do
        [ -f "$f" ] || { echo "error: tools/diff_counts.sh: no $f" >&2; exit 1; }
    done
    changed=$(diff -u "$from/train.c" "$to/train.c" | grep -c '^[-+][^-+]')
    echo "${from%%_*}→${to%%_*} $changed $budget"
done <<<"$pairs"
