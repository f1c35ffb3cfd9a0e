#!/usr/bin/env bash
# A stage's diff against the one it builds on shows its technique and little else: each pair's
# changed lines (tools/diff_counts.sh, issue 33's measure) stay within the pair's budget, and
# docs/ARCHITECTURE.md's sentence quoting them ("changed lines ...: 01→02 N, ...") gives the
# counts the tool prints today, every pair, so the figures cannot go stale.
source "$(dirname "$0")/lib.sh"
bash tools/diff_counts.sh >"$tmp/counts"
rc=$?
check '[ $rc -eq 0 ] && [ "$(wc -l <"$tmp/counts")" -eq 7 ]' "tools/diff_counts.sh failed (exit $rc) or printed not 7 pairs"
quoted=$(tr -s '\n ' ' ' <docs/ARCHITECTURE.md | grep -o 'changed lines of train.c[^)]*')
check '[ -n "$quoted" ]' "docs/ARCHITECTURE.md has no sentence 'changed lines of train.c ...' quoting tools/diff_counts.sh"
while read -r pair changed budget; do
    check '[ "$changed" -le "$budget" ]' "$pair: $changed changed lines in train.c, over its budget of $budget"
    check '[[ "$quoted" == *"$pair $changed"[,.\;]* || "$quoted" == *"$pair $changed" ]]' \
        "docs/ARCHITECTURE.md quotes $(grep -o "$pair [0-9]*" <<<"$quoted" || echo "no count") for $pair; tools/diff_counts.sh counts $changed"
done <"$tmp/counts"
finish test_diff_counts
