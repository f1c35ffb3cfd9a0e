#!/usr/bin/env bash
# test_lora_oracle.sh: LoRA (common/run/lora.h) against peft 0.14.0 (tests/oracle_lora.py, our side
# tests/test_lora.c --oracle): the adapted model's logits within 1e-5, the adapters' gradients
# after one step within 1e-4, the adapter we save loading in peft with our logits, the base
# bit-identical after the step, and the model build/lora_merge writes loading in transformers with
# the adapted logits; the adapters' gradients with lora_dropout 0.1 within 1e-4, peft dropping the
# elements our masks drop (test_lora --oracle-dropout writes them); GPT-2's and phi's module names
# too. The oracle is tests/lib.sh's venv.
source "$(dirname "$0")/lib.sh"
oracle_venv peft
check '[ -x build/tests/test_lora ] && [ -x build/lora_merge ]' "build/tests/test_lora or build/lora_merge is not built"
mkdir -p "$tmp/oracle"
PYTHONPATH=tests "$ORACLE_VENV/bin/python" tests/oracle_lora.py build/tests/test_lora build/lora_merge "$tmp/oracle" \
    >"$tmp/oracle.txt" 2>"$tmp/oracle.err"
cat "$tmp/oracle.txt"
passed=$((passed + $(grep -c '^ok: ' "$tmp/oracle.txt")))
failed=$((failed + $(grep -c '^FAIL: ' "$tmp/oracle.txt")))
check "grep -q 'lora oracle: done' '$tmp/oracle.txt'" "tests/oracle_lora.py did not run to the end: $(tail -3 "$tmp/oracle.err")"

finish test_lora_oracle
