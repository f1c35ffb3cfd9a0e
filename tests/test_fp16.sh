#!/usr/bin/env bash
# precision 16-mixed: fp16 matmul inputs with dynamic loss scaling (stages 02, 03, 04):
#  - stage 02 tracks stage 01's fp32 losses on configs/tiny.json over 60 steps, each of the first 59
#    within 0.5% and the last within 5% (bf16-mixed strays 17% over the same steps), and not bit for
#    bit. The last step's batch amplifies any difference: fp16's rounding turns an ulp anywhere into
#    a drift of 1e-4 to 6e-4 over the run, which that batch makes 0.5-2%. Measured: the first 59
#    within 0.13-0.2%; the last 0.51%, then 1.38% once attention's CPU products summed in oneDNN's
#    order, 0.81% and then 2.05% on one machine once the cross-entropy's exponentials moved by an
#    ulp (the fp32 losses by 2e-5 at most);
#  - stages 03 (2 ranks) and 04 (2 ranks) in 16-mixed match stage 02 in 16-mixed within 1e-3;
#  - an overflow injected at step 3 (the test hook WORKBOOK_INJECT_INF_STEP) skips exactly that
#    step on both ranks of stage 03 (they end with identical weights: stage 03 checks that), halves
#    the scale, and the run goes on; with loss_scale_window 4 the scale doubles 4 good steps later;
#  - a run stopped at step 6 and resumed gets the saved scale back (from the optimizer file's
#    metadata, or from the loss_scale.json of an older checkpoint): steps 7-10 equal those of the
#    uninterrupted run to 17 digits;
#  - at a fixed scale of 1 more of the gradients cast to fp16 round to zero than at 2^16 (the
#    share is in metrics.jsonl as grad_underflow);
#  - bad values: 16-mixed in stage 01, loss_scale 0, loss_scale_window -1 give one clear error.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
args=(--config configs/tiny.json --eval_batches=1 --log_interval=100)

# a metrics.jsonl field of every step, one per line
field() { python3 -c "import json, sys; [print(json.loads(l)[sys.argv[2]]) for l in open(sys.argv[1])]" "$1" "$2"; }

build/stage-1 "${args[@]}" --stop_iteration=60 --out_dir="$tmp/s1" >"$tmp/s1.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 failed: $(tail -3 "$tmp/s1.log")"
build/stage-2 "${args[@]}" --stop_iteration=60 --precision=16-mixed --out_dir="$tmp/s2" >"$tmp/s2.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 2 16-mixed failed: $(tail -3 "$tmp/s2.log")"
check 'compare_losses "$tmp/s1" "$tmp/s2" 60 0.05 0.25' "16-mixed strays more than 5% from fp32"
# the largest relative gap between the two runs' losses over their first n steps
loss_gap() { # <dir> <dir> <n>
    python3 - "$@" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(d + "/metrics.jsonl")][:int(sys.argv[3])] for d in sys.argv[1:3])
print(max(abs(x - y) / abs(x) for x, y in zip(a, b)))
PY
}
gap=$(loss_gap "$tmp/s1" "$tmp/s2" 59)
check 'python3 -c "import sys; sys.exit(float(sys.argv[1]) > 0.005)" "$gap"' \
    "16-mixed strays more than 0.5% from fp32 before the last step: $gap"
# where the loss sees the gradient's scale (tests/lib.sh's SCALE_ARGS): gradients left scaled by
# 2^16 would move it far beyond 1%
build/stage-1 "${args[@]}" "${SCALE_ARGS[@]}" --stop_iteration=20 --out_dir="$tmp/s1scale" >"$tmp/s1scale.log" 2>&1
build/stage-2 "${args[@]}" "${SCALE_ARGS[@]}" --stop_iteration=20 --precision=16-mixed --out_dir="$tmp/s2scale" >"$tmp/s2scale.log" 2>&1
check 'compare_losses "$tmp/s1scale" "$tmp/s2scale" 20 0.01 0.25' "16-mixed without clipping, eps 1e-3, strays more than 1% from fp32"
check '! cmp -s <(field "$tmp/s1/metrics.jsonl" loss) <(field "$tmp/s2/metrics.jsonl" loss)' \
    "16-mixed gives exactly the fp32 losses: the fp16 rounding is not happening"
check '[ "$(field "$tmp/s2/metrics.jsonl" loss_scale | sort -u)" = 65536 ] &&
       [ "$(field "$tmp/s2/metrics.jsonl" skipped_steps | tail -1)" = 0 ]' \
    "a clean 16-mixed run changed its scale or skipped a step"

# stages 03 and 04 against stage 02, 20 steps each
short=(--stop_iteration=20 --precision=16-mixed)
build/stage-2 "${args[@]}" "${short[@]}" --out_dir="$tmp/ref" >"$tmp/ref.log" 2>&1
args+=("${short[@]}")
run_ranks 3 ddp 2
run_ranks 4 fsdp 2
# each rank rounds its own gradient to fp16: the norm strays more than the loss (measured 2.9e-3)
check 'compare_losses "$tmp/ref" "$tmp/ddp" 20 1e-3 1e-2' "stage 03 in 16-mixed does not match stage 02"
check 'compare_losses "$tmp/ref" "$tmp/fsdp" 20 1e-3 1e-2' "stage 04 in 16-mixed does not match stage 02"

# an overflow at step 3, a window of 4 good steps
window=(--loss_scale_window=4 --stop_iteration=10 --log_interval=1)
WORKBOOK_INJECT_INF_STEP=3 run_ranks 3 inject 2 "${window[@]}"
m="$tmp/inject/metrics.jsonl"
check '[ "$(field "$m" skipped | tr "\n" " ")" = "False False True False False False False False False False " ]' \
    "not exactly step 3 skipped: $(field "$m" skipped | tr "\n" " ")"
check '[ "$(field "$m" loss_scale | tr "\n" " ")" = "65536 65536 32768 32768 32768 32768 65536 65536 65536 65536 " ]' \
    "the scale did not halve at the overflow and double after 4 good steps: $(field "$m" loss_scale | tr "\n" " ")"
check '[ "$(field "$m" grad_norm | sed -n 3p)" = None ] && grep -q "scale 32768 (skipped: inf), 1 skipped" "$tmp/inject.log"' \
    "the skipped step is not reported as skipped"

# stopped after step 6 (the scale halved, 3 good steps since) and resumed. The scale is saved
# in optimizer.safetensors' metadata, beside the step, in the checkpoint's one atomic group.
# optimizer_meta <out_dir>: the optimizer file's __metadata__ as JSON
optimizer_meta() {
    python3 - "$1/optimizer.safetensors" <<'PY'
import json, struct, sys
f = open(sys.argv[1], "rb")
print(json.dumps(json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))["__metadata__"]))
PY
}
WORKBOOK_INJECT_INF_STEP=3 run_ranks 3 resumed 2 "${window[@]}" --stop_iteration=6
cp -r "$tmp/resumed" "$tmp/old_format"
optimizer_meta "$tmp/resumed" >"$tmp/meta.json"
check '[ "$(json_value "$tmp/meta.json" loss_scale) $(json_value "$tmp/meta.json" loss_scale_good_steps) $(json_value "$tmp/meta.json" loss_scale_skipped_steps)" = "32768 3 1" ] && [ ! -e "$tmp/resumed/loss_scale.json" ]' \
    "the checkpoint did not save the scale in the optimizer file: $(cat "$tmp/meta.json")"
WORKBOOK_INJECT_INF_STEP=3 run_ranks 3 resumed 2 "${window[@]}" --resume=true
check '[ "$(field "$m" loss) $(field "$m" loss_scale)" = "$(field "$tmp/resumed/metrics.jsonl" loss) $(field "$tmp/resumed/metrics.jsonl" loss_scale)" ]' \
    "the resumed run's losses and scales differ from the uninterrupted run's"
# a checkpoint saved before the scale moved there kept it in loss_scale.json: still resumed
python3 - "$tmp/old_format" <<'PY'
import json, struct, sys
path = sys.argv[1] + "/optimizer.safetensors"
data = open(path, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
meta = header["__metadata__"]
old = {"loss_scale": float(meta.pop("loss_scale")), "good_steps": int(meta.pop("loss_scale_good_steps")),
       "skipped_steps": int(meta.pop("loss_scale_skipped_steps"))}
text = json.dumps(header).encode()
text += b" " * ((8 - len(text) % 8) % 8)
open(path, "wb").write(struct.pack("<Q", len(text)) + text + data[8 + n:])
json.dump(old, open(sys.argv[1] + "/loss_scale.json", "w"))
PY
WORKBOOK_INJECT_INF_STEP=3 run_ranks 3 old_format 2 "${window[@]}"
check '[ "$(field "$m" loss) $(field "$m" loss_scale)" = "$(field "$tmp/old_format/metrics.jsonl" loss) $(field "$tmp/old_format/metrics.jsonl" loss_scale)" ]' \
    "a checkpoint with the old loss_scale.json did not resume to the uninterrupted run's losses and scales"

# underflow: what scaling is for
for scale in 1 65536; do
    build/stage-2 --config configs/tiny.json --precision=16-mixed --stop_iteration=3 --eval_batches=1 \
        --loss_scale=$scale --loss_scale_window=0 --out_dir="$tmp/u$scale" >"$tmp/u$scale.log" 2>&1
done
u1=$(field "$tmp/u1/metrics.jsonl" grad_underflow | tail -1)
u2=$(field "$tmp/u65536/metrics.jsonl" grad_underflow | tail -1)
check 'python3 -c "import sys; sys.exit(not (float(\"$u1\") > 100 * float(\"$u2\") and float(\"$u1\") > 0.001))"' \
    "at scale 1, $u1 of the fp16 gradients round to zero; at 2^16, $u2: scaling should save most of them"
echo "gradient values cast to fp16 that rounded to zero, step 3: $u1 at scale 1, $u2 at scale 65536"

expect_one_error "16-mixed in stage 01" "key 'precision' is '16-mixed' but stage 01 trains in fp32" \
    build/stage-1 --config configs/tiny.json --precision=16-mixed --out_dir="$tmp/bad"
expect_one_error "loss_scale 0" "key 'loss_scale': expected a positive value, found 0" \
    build/stage-2 --config configs/tiny.json --precision=16-mixed --loss_scale=0 --out_dir="$tmp/bad"
expect_one_error "loss_scale_window -1" "key 'loss_scale_window': expected 0 or more, found -1" \
    build/stage-2 --config configs/tiny.json --precision=16-mixed --loss_scale_window=-1 --out_dir="$tmp/bad"
finish test_fp16
