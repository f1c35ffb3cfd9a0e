#!/usr/bin/env bash
# test_moe_oracle.sh: our mixture-of-experts GPT-2 (08_mixture_of_experts/moe.c in common/model/gpt.c's
# block) against a PyTorch one written in tests/oracle_moe.py (GPT-2 blocks and a Mixtral-style
# sparse block with our capacity, in float64, with autograd), on random tiny checkpoints with
# k = 1 and 2, with and without dropping: router probabilities, chosen experts, dropped pairs,
# logits, loss, load-balancing loss and every gradient. The Python runs in the oracle venv (tests/lib.sh). Then
# checkpoints whose experts do not add up, each refused with one clear error.
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

# a checkpoint whose experts do not add up: one clear error each (file, key, expected, found)
bad_checkpoint() { # bad_checkpoint <name> <python statement editing the config dict c>
    rm -rf "${tmp:?}/$1" && cp -r "$tmp/k=2_with_dropping" "$tmp/$1" && rm -rf "$tmp/$1/grads"
    python3 - "$tmp/$1/config.json" "$2" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
exec(sys.argv[2])
json.dump(c, open(sys.argv[1], "w"))
PY
}
bad_checkpoint k_above_e 'c["num_experts_per_tok"] = 5'
expect_one_error "num_experts_per_tok above num_local_experts" '"num_experts_per_tok" is 5 but there are 4 experts' \
    "$BIN" --oracle "$tmp/k_above_e"
bad_checkpoint no_moe_every 'del c["moe_every"]'
expect_one_error "no moe_every" 'config.json: missing key "moe_every"' "$BIN" --oracle "$tmp/no_moe_every"
bad_checkpoint moe_every_0 'c["moe_every"] = 0'
expect_one_error "moe_every 0" '"moe_every" must be a positive integer, found 0' "$BIN" --oracle "$tmp/moe_every_0"
bad_checkpoint too_many 'c["num_local_experts"] = 65'
expect_one_error "65 experts" '"num_local_experts" is 65; at most 64' "$BIN" --oracle "$tmp/too_many"
bad_checkpoint fewer_experts 'c["num_local_experts"] = 3'
expect_one_error "a file with more experts than configured" \
    'belongs to expert 3, but the configured model has 3 experts' "$BIN" --oracle "$tmp/fewer_experts"

finish test_moe_oracle
