#!/usr/bin/env bash
# test_phi_oracle.sh: our phi (the tutorial's model) against transformers' PhiForCausalLM, an
# implementation that shares no code with ours: logits, one training step (loss, per-tensor
# gradient norms, weights after AdamW), and a checkpoint we save loading back into transformers.
# The oracle is transformers 4.49.0 from PyPI over Debian's python3-torch, in a venv made once
# under build/ (CI on a clean clone makes it here). tests/oracle_phi.py does the comparing.
set -u
cd "$(dirname "$0")/.."
source tests/lib.sh

BIN=build/tests/test_phi
tmp=$(mktemp -d /tmp/test_phi_oracle_XXXXXX)
trap 'end_test_processes; rm -rf "$tmp"' EXIT

oracle_venv
check '[ -x "$BIN" ] && [ -x build/stage-6 ]' "$BIN or build/stage-6 is not built (make test builds them)"

"$ORACLE_VENV/bin/python" tests/oracle_phi.py "$BIN" build/stage-6 "$tmp" >"$tmp/oracle.txt" 2>"$tmp/oracle.err"
cat "$tmp/oracle.txt"
passed=$((passed + $(grep -c '^ok: ' "$tmp/oracle.txt")))
failed=$((failed + $(grep -c '^FAIL: ' "$tmp/oracle.txt")))
check "grep -q 'checkpoint we saved' '$tmp/oracle.txt'" "tests/oracle_phi.py did not run to the end: $(tail -3 "$tmp/oracle.err")"

finish test_phi_oracle
