#!/usr/bin/env bash
# A stage's diff against the one it builds on shows its technique and little else: each pair's
# changed lines (tools/diff_counts.sh, issue 33's measure) stay within the pair's budget, and
# docs/ARCHITECTURE.md's sentence quoting them ("changed lines ...: 01→02 N, ...") gives the
# counts the tool prints today, every pair, so the figures cannot go stale.
source "$(dirname "$0")/lib.sh"
bash tools/diff_counts.sh >"$tmp/counts"
rc=$?
check '[ $rc -eq 0 ] && [ "$(wc -l <"$tmp/counts")" -eq 8 ]' "tools/diff_counts.sh failed (exit $rc) or printed not 8 pairs"
quoted=$(tr -s '\n ' ' ' <docs/ARCHITECTURE.md | grep -o 'changed lines of train.c[^)]*')
check '[ -n "$quoted" ]' "docs/ARCHITECTURE.md has no sentence 'changed lines of train.c ...' quoting tools/diff_counts.sh"
while read -r pair changed budget; do
    check '[ "$changed" -le "$budget" ]' "$pair: $changed changed lines in train.c, over its budget of $budget"
    check '[[ "$quoted" == *"$pair $changed"[,.\;]* || "$quoted" == *"$pair $changed" ]]' \
        "docs/ARCHITECTURE.md quotes $(grep -o "$pair [0-9]*" <<<"$quoted" || echo "no count") for $pair; tools/diff_counts.sh counts $changed"
done <"$tmp/counts"
# a stage's train.c keeps no line of a feature the stage refuses: LoRA named in the train.c of a
# stage that refuses lora_rank is dead code a learner reads (the binary says whether it refuses)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for n in $(sed -E 's/^([0-9]+)→([0-9]+) .*/\1 \2/' "$tmp/counts" | tr ' ' '\n' | sort -u); do
    n=$((10#$n))
    [ -x "$STAGE_BIN/stage-$n" ] || continue
    timeout --kill-after=5 60 "$STAGE_BIN/stage-$n" --config configs/tiny.json --lora_rank=2 --stop_iteration=0 \
        --out_dir="$tmp/lora-$n" >"$tmp/lora-$n.log" 2>&1
    grep -q "does not train LoRA adapters" "$tmp/lora-$n.log" || continue
    file=$(ls -d "$(printf '%02d' "$n")"_*)/train.c
    check '! grep -qi lora "$file"' "$file: stage $n refuses lora_rank, yet its train.c names LoRA: $(grep -ni lora "$file" | head -3 | tr '\n' ' ')"
    refusing=$((${refusing:-0} + 1))
done
check '[ "${refusing:-0}" -ge 1 ]' "no stage refused lora_rank: the refusal check read nothing (stage 08 refuses it)"
finish test_diff_counts
