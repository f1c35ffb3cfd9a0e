#!/usr/bin/env bash
# The demo's promise (issue 11): after make demo's training budget -- stage 01 on
# configs/tiny.json, its whole schedule -- the model answers held-out synthetic questions, at
# least 90% of them exactly right and every task at least 80%. The answers are checked against
# the generator's, which test_alpaca checks against independent implementations of each task.
# About 3 minutes on 2 cores: the same commands as scripts/demo.sh.
source "$(dirname "$0")/lib.sh"

build/stage-1 --config configs/tiny.json --out_dir="$tmp/model" >"$tmp/train.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "training failed: $(tail -3 "$tmp/train.log")"
build/stage-6 --config configs/inference.json --init_from="$tmp/model" --eval_accuracy=true \
    --max_batch_size=16 >"$tmp/eval.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "evaluation failed: $(tail -3 "$tmp/eval.log")"

# "exact-answer accuracy on ...: 399 / 400 = 99.8% (...)" and "  <task>  93 / 93 = 100.0%"
overall=$(sed -nE 's/^exact-answer accuracy on .*: ([0-9]+) \/ ([0-9]+) = .*/\1 \2/p' "$tmp/eval.log")
check '[ -n "$overall" ] && awk -v r="${overall% *}" -v n="${overall#* }" "BEGIN { exit !(n >= 100 && r >= 0.9 * n) }"' \
    "accuracy below 90% (or no report): $(grep -a 'accuracy' "$tmp/eval.log")"
tasks=$(sed -nE 's/^  (.*[^ ]) +([0-9]+) \/ ([0-9]+) +=.*/\2 \3/p' "$tmp/eval.log")
check '[ "$(echo "$tasks" | wc -l)" -eq 4 ]' "expected 4 tasks in the report, found: $(sed -n '/per instruction/,$p' "$tmp/eval.log")"
check 'echo "$tasks" | awk "{ if (\$1 < 0.8 * \$2) bad = 1 } END { exit bad }"' \
    "a task below 80%: $(sed -n '/per instruction/,/accuracy/p' "$tmp/eval.log")"
# a question typed as the README shows, instruction<TAB>input: the with-input template, answered
printf 'Sort the digits.\t52913\nFind the largest digit.\t40172\n' | build/stage-6 --config configs/inference.json \
    --init_from="$tmp/model" --prompts_path=- >"$tmp/typed.log" 2>&1
rc=$?; check '[ $rc -eq 0 ] && [ "$(grep -a -A1 "User:" "$tmp/typed.log" | grep -a -o "Assistant:.*" | sed "s/^[^ ]* //" | tr "\n" " ")" = "12359 7 " ]' \
    "typed questions: $(grep -a -A1 "User:" "$tmp/typed.log")"
finish test_demo
