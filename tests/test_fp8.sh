#!/usr/bin/env bash
# The FP8 formats of common/base/numbers.h (e4m3, e5m2: the casts, plain and saturating, the decode, the
# tensorwise scale and MX's E8M0 block scale) against ml_dtypes, bit for bit on 2 x 10^6 values a
# format (tests/oracle_fp8.py says which); stage 02's precision fp8-tensorwise against its float64
# reference over 6 steps, and beside bf16-mixed over 200; FP8 on stages without FP8 linears
# refused. ml_dtypes comes from PyPI into a venv of its own over Debian's python3, numpy and torch,
# made once: build/fp8-venv.
source "$(dirname "$0")/lib.sh"
BIN=build/tests/fp8_codes
VENV=build/fp8-venv
if ! "$VENV/bin/python" -c 'import ml_dtypes' 2>/dev/null; then
    rm -rf "$VENV"
    /usr/bin/python3 -m venv --system-site-packages "$VENV" &&
        "$VENV/bin/pip" install -q ml_dtypes==0.5.4 >"$tmp/pip.log" 2>&1
fi
check '"$VENV/bin/python" -c "import ml_dtypes; assert ml_dtypes.__version__ == \"0.5.4\""' \
    "ml_dtypes 0.5.4 does not import in $VENV (pip: $(tail -2 "$tmp/pip.log" 2>/dev/null))"
# built here too (a no-op after make test): a tree with a planted bug in numbers.h must test its own
make --no-print-directory -s BACKEND=cpu "$BIN" >"$tmp/make.log" 2>&1
check '[ -x "$BIN" ]' "$BIN does not build: $(tail -3 "$tmp/make.log")"

"$VENV/bin/python" tests/oracle_fp8.py "$BIN" "$tmp" >"$tmp/oracle.txt" 2>"$tmp/oracle.err"
cat "$tmp/oracle.txt"
passed=$((passed + $(grep -c '^ok: ' "$tmp/oracle.txt")))
failed=$((failed + $(grep -c '^FAIL: ' "$tmp/oracle.txt")))
check "[ \$(grep -c '^ok: \|^FAIL: ' '$tmp/oracle.txt') -eq 10 ]" "tests/oracle_fp8.py did not run to the end: $(tail -3 "$tmp/oracle.err")"

# ---- precision fp8-tensorwise (stage 02) ----------------------------------------------------------
# against its reference (tests/oracle_fp8_train.py: the recipe in float64 with ml_dtypes' casts,
# through tests/oracle_train.py's loop) over 6 steps of GPT-2 with warm-up, clipping, accumulation
/usr/bin/python3 tests/oracle_train.py data "$tmp/data.json"
cat >"$tmp/fp8.json" <<JSON
{"arch": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "max_seq_len": 256, "precision": "fp8-tensorwise",
 "data_path": "$tmp/data.json", "val_fraction": 0.25, "seed": 7,
 "global_batch_size": 8, "gradient_acc_steps": 2, "num_epochs": 1,
 "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.1,
 "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 2.0,
 "eval_interval": 3, "eval_batches": 4, "log_interval": 100}
JSON
args=(--config "$tmp/fp8.json")
run_single 2 init --stop_iteration=0
run_single 2 fp8
(cd tests && "../$VENV/bin/python" oracle_fp8_train.py "$tmp/fp8.json" "$tmp/init" "$tmp/fp8") >"$tmp/oracle.txt" 2>&1
cat "$tmp/oracle.txt"
passed=$((passed + $(grep -c 'ok: ' "$tmp/oracle.txt")))
failed=$((failed + $(grep -c 'FAIL: ' "$tmp/oracle.txt")))
check "grep -q '^fp8 reference: ' '$tmp/oracle.txt'" "tests/oracle_fp8_train.py did not run to the end: $(tail -3 "$tmp/oracle.txt")"

# 200 steps of the tiny config beside bf16-mixed: the mean loss of the last 20 steps within 10%
args=(--config configs/tiny.json --n_embd=64 --global_batch_size=8 --stop_iteration=200 --log_interval=100
      --eval_batches=2)
run_single 2 tiny_bf16 --precision=bf16-mixed
run_single 2 tiny_fp8 --precision=fp8-tensorwise
ratio=$(python3 - "$tmp/tiny_bf16/metrics.jsonl" "$tmp/tiny_fp8/metrics.jsonl" <<'PY'
import json, sys
bf16, fp8 = ([json.loads(l)["loss"] for l in open(p)][-20:] for p in sys.argv[1:])
print(f"{sum(fp8) / sum(bf16):.4f}")
PY
)
echo "fp8-tensorwise / bf16-mixed, mean loss of steps 181-200: $ratio"
check 'python3 -c "import sys; sys.exit(not $ratio <= 1.10)"' "fp8-tensorwise's loss is $ratio x bf16-mixed's after 200 steps, more than 1.10"

# ---- bad input: FP8 where no FP8 linears run ------------------------------------------------------
args=(--config configs/tiny.json --precision=fp8-tensorwise --out_dir="$tmp/bad")
source tests/mpi_env.sh
expect_one_error "fp8 on stage 03" "key 'precision' is fp8-tensorwise but stage 03 has no FP8 linears" \
    timeout --kill-after=5 120 mpirun -np 2 --bind-to none build/stage-3 "${args[@]}"
expect_one_error "fp8 on stage 01" "key 'precision' is fp8-tensorwise but stage 01 has no FP8 linears" build/stage-1 "${args[@]}"
expect_one_error "fp8 with LoRA" "lora_rank is 4: LoRA's adapters train in bf16-mixed" build/stage-2 "${args[@]}" --lora_rank=4
expect_one_error "fp8-rowwise" "key 'precision': expected 32, 32-true, bf16-mixed, bf16, 16-mixed or fp8-tensorwise, found 'fp8-rowwise'" \
    build/stage-2 "${args[@]}" --precision=fp8-rowwise
finish test_fp8
