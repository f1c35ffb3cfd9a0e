#!/usr/bin/env bash
# test_checkpoint_oracle.sh: a checkpoint written by our C code opens in an independent PyTorch
# GPT-2 and gives the same loss there as here.
#   1. build/tests/test_checkpoint --oracle-save DIR saves a model with known random weights,
#      writes the token sequence to DIR/tokens.json and prints our loss and a few logits;
#   2. tests/oracle_checkpoint.py (Debian's /usr/bin/python3 with python3-torch) checks the files
#      are what Hugging Face expects, loads them into ../shared/fixtures/oracle's GPT-2 and
#      prints its loss and logits;
#   3. the two must agree (relative 1e-5 for the loss).
# Run from the repository root after `make test` has built build/tests/test_checkpoint.
set -u
cd "$(dirname "$0")/.."

PY=/usr/bin/python3
BIN=${TEST_CHECKPOINT_BIN:-build/tests/test_checkpoint}  # overridable for a hand-built copy
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL test_checkpoint_oracle: $*" >&2; }

tmp=$(mktemp -d /tmp/test_checkpoint_oracle_XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# No torch is a failure, not a skip: this is the only test that checks our files against an
# implementation that is not ours.
if "$PY" -c 'import torch' 2>"$tmp/torch_err"; then
    ok
else
    bad "$PY cannot import torch ($(tail -1 "$tmp/torch_err")); install it: apt-get install --no-install-recommends python3-torch"
fi

if [ -x "$BIN" ] && "$BIN" --oracle-save "$tmp/ckpt" >"$tmp/ours.txt"; then
    ok
else
    bad "$BIN --oracle-save failed (is it built? make test builds it)"
fi

if "$PY" tests/oracle_checkpoint.py "$tmp/ckpt" >"$tmp/torch.txt" 2>"$tmp/torch_stderr"; then
    ok
else
    bad "tests/oracle_checkpoint.py failed: $(grep FAIL "$tmp/torch.txt"; tail -3 "$tmp/torch_stderr")"
fi
# the Python side's own checks of the file format, one count each
pass=$((pass + $(grep -c '^ok: ' "$tmp/torch.txt")))
fail=$((fail + $(grep -c '^FAIL: ' "$tmp/torch.txt")))

# value <key> <file>: the fields after "key" on its line
value() { awk -v k="$1" '$1 == k { $1 = ""; print substr($0, 2) }' "$2"; }
# close <got> <want> <rtol> <atol>: |got - want| <= rtol * |want| + atol
close() { awk -v g="$1" -v w="$2" -v r="$3" -v a="$4" \
    'BEGIN { d = g - w; if (d < 0) d = -d; m = w < 0 ? -w : w; exit !(g != "" && w != "" && d <= r * m + a) }'; }

ours=$(value loss "$tmp/ours.txt")
theirs=$(value loss "$tmp/torch.txt")
if close "$ours" "$theirs" 1e-5 0; then
    ok
else
    bad "loss: ours '$ours', PyTorch '$theirs' (relative tolerance 1e-5)"
fi

read -r -a ours_l <<<"$(value logits_b1_tlast_first4 "$tmp/ours.txt")"
read -r -a theirs_l <<<"$(value logits_b1_tlast_first4 "$tmp/torch.txt")"
for i in 0 1 2 3; do
    if close "${ours_l[$i]:-}" "${theirs_l[$i]:-}" 1e-4 1e-5; then
        ok
    else
        bad "logit $i at the last position: ours '${ours_l[$i]:-}', PyTorch '${theirs_l[$i]:-}'"
    fi
done

echo "test_checkpoint_oracle: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
