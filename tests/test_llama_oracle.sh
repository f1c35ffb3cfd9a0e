#!/usr/bin/env bash
# test_llama_oracle.sh: our Llama against transformers' LlamaForCausalLM, an implementation that
# shares no code with ours, on a tiny random model with grouped-query attention: logits (fp32, and
# fp16/bf16 shards with an index), one training step (loss, per-tensor gradient norms, weights
# after AdamW), a checkpoint we save loading back into transformers, a tied-embedding model with
# Llama 3's rope_scaling, and configs we do not implement refused by name. The oracle is
# transformers 4.49.0 in tests/lib.sh's oracle venv; tests/oracle_llama.py does the comparing.
set -u
cd "$(dirname "$0")/.."
source tests/lib.sh

BIN=build/tests/test_llama
tmp=$(mktemp -d /tmp/test_llama_oracle_XXXXXX)
trap 'end_test_processes; rm -rf "$tmp"' EXIT

oracle_venv
check '[ -x "$BIN" ]' "$BIN is not built (make test builds it)"

"$ORACLE_VENV/bin/python" tests/oracle_llama.py "$BIN" "$tmp" >"$tmp/oracle.txt" 2>"$tmp/oracle.err"
cat "$tmp/oracle.txt"
passed=$((passed + $(grep -c '^ok: ' "$tmp/oracle.txt")))
failed=$((failed + $(grep -c '^FAIL: ' "$tmp/oracle.txt")))
check "grep -q 'checkpoint we saved' '$tmp/oracle.txt'" "tests/oracle_llama.py did not run to the end: $(tail -3 "$tmp/oracle.err")"

finish test_llama_oracle
