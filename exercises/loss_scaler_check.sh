#!/usr/bin/env bash
# exercises/loss_scaler_check.sh: the check of exercise loss-scaler, as tests/test_fp16.sh checks the
# scaler, on a tiny model for 10 steps of stage 02 in 16-mixed: an overflow injected at step 3
# (WORKBOOK_INJECT_INF_STEP) skips exactly that step and halves the scale, which doubles again
# after 4 good steps (loss_scale_window 4), and the losses track stage 01's fp32 ones within 1%.
# Reads metrics.jsonl only. Ends with its summary line; exits 0 when all holds.
source "$(dirname "$0")/../tests/lib.sh"
field() { python3 -c "import json, sys; [print(json.loads(l)[sys.argv[2]]) for l in open(sys.argv[1])]" "$1" "$2"; }
args=(--config configs/tiny.json --stop_iteration=10 --eval_batches=1 --eval_interval=1000 --log_interval=100
      --n_layer=2 --n_embd=32 --n_head=4 --global_batch_size=4)
run_single 1 fp32
WORKBOOK_INJECT_INF_STEP=3 run_single 2 fp16 --precision=16-mixed --loss_scale_window=4
m="$tmp/fp16/metrics.jsonl"
check '[ "$(field "$m" skipped | tr "\n" " ")" = "False False True False False False False False False False " ]' \
    "not exactly step 3 skipped: $(field "$m" skipped | tr "\n" " ")"
check '[ "$(field "$m" loss_scale | tr "\n" " ")" = "65536 65536 32768 32768 32768 32768 65536 65536 65536 65536 " ]' \
    "the scale did not halve at the overflow and double after 4 good steps: $(field "$m" loss_scale | tr "\n" " ")"
# the skipped step's loss is still the forward's; the weights after it are those before it, so the
# runs part from step 4 on: compare the first 3 steps
check 'python3 -c "
import json, sys
a = [json.loads(l)[\"loss\"] for l in open(sys.argv[1])][:3]
b = [json.loads(l)[\"loss\"] for l in open(sys.argv[2])][:3]
sys.exit(0 if len(a) == len(b) == 3 and all(abs(x - y) <= 0.01 * abs(x) for x, y in zip(a, b)) else 1)
" "$tmp/fp32/metrics.jsonl" "$m"' "16-mixed's first steps stray more than 1% from fp32"
finish loss_scaler_check
