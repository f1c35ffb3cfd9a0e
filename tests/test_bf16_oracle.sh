#!/usr/bin/env bash
# Stage 02's bf16 recipe against an independent PyTorch implementation of the same recipe
# (tests/oracle_bf16.py) on the tiny fixture model: loss, gradient norms, loss after AdamW.
set -u
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
    echo "FAIL: /usr/bin/python3 has no torch: apt-get install python3-torch (make setup does)"
    echo "test_bf16_oracle: 0 passed, 1 failed"
    exit 1
fi
/usr/bin/python3 tests/oracle_bf16.py "$tmp/bf16.json" || { echo "test_bf16_oracle: 0 passed, 1 failed"; exit 1; }
out=$(build/tests/test_gpt --bf16-reference "$tmp/bf16.json" 2>&1)
echo "$out"
echo "$out" | sed -n 's/^test_gpt_bf16: /test_bf16_oracle: /p'
echo "$out" | grep -q "^test_gpt_bf16: [0-9]* passed, 0 failed"
