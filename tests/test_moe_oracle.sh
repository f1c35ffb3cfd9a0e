#!/usr/bin/env bash
# test_moe_oracle.sh: our mixture-of-experts GPT-2 (common/moe.c in common/gpt.c's block) against a
# PyTorch one written in tests/oracle_moe.py (GPT-2 blocks and a Mixtral-style sparse block with our
# capacity, in float64, with autograd), on random tiny checkpoints with k = 1 and 2, with and
# without dropping: router probabilities, chosen experts, dropped pairs, logits, loss,
# load-balancing loss and every gradient. The Python runs in the oracle venv (tests/lib.sh).
set -u
cd "$(dirname "$0")/.."
source tests/lib.sh

BIN=build/tests/test_moe
oracle_venv
check '[ -x "$BIN" ]' "$BIN is not built (make test builds it)"

"$ORACLE_VENV/bin/python" tests/oracle_moe.py "$BIN" "$tmp" >"$tmp/oracle.txt" 2>"$tmp/oracle.err"
cat "$tmp/oracle.txt"
passed=$((passed + $(grep -c '^ok: ' "$tmp/oracle.txt")))
failed=$((failed + $(grep -c '^FAIL: ' "$tmp/oracle.txt")))
check "grep -q '^oracle_moe: every case ran' '$tmp/oracle.txt'" "tests/oracle_moe.py did not run to the end: $(tail -3 "$tmp/oracle.err")"

finish test_moe_oracle
