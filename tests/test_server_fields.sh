#!/usr/bin/env bash
# Every field of a request to stage 06's server is honoured or refused, never ignored
# (06_inference/serving/api_fields.c; README "The API, field by field"); tests/server_fields.py drives it:
#  - each field the server does not implement (n > 1, best_of, logprobs, echo, suffix, tools,
#    response_format, ...) and a field it does not know: 400 in OpenAI's error shape naming the
#    field; the same field with the value that asks for nothing (null, false, 1, []) is answered;
#  - logit_bias, presence_penalty, frequency_penalty, repetition_penalty: greedy answers equal
#    those computed from the definitions; stop_token_ids, ignore_eos, min_p; bad values refused;
#  - a list of prompts (texts or token-id lists) with n 2: each answer in OpenAI's order (index
#    prompt * n + choice), streamed or whole, the usage counting each prompt once;
#  - usage.prompt_tokens_details.cached_tokens: the prefix cache's hit for each request, as
#    /metrics counts it.
source "$(dirname "$0")/lib.sh"
source tests/server_lib.sh
export OMP_NUM_THREADS=1

# A model whose weights are all 0: every logit is 0, so a logit_bias alone decides each token and
# the answers under the penalties follow from their definitions exactly (a checkpoint of stage 01,
# its tensors' bytes zeroed)
build/stage-1 --config configs/tiny.json --n_layer=1 --n_embd=32 --stop_iteration=1 --out_dir="$tmp/zero" >"$tmp/train.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 training for the test failed: $(tail -3 "$tmp/train.log")"
python3 - "$tmp/zero/model.safetensors" <<'PY'
import json, struct, sys
data = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", data[:8])[0]
data[8 + n:] = bytes(len(data) - 8 - n)
open(sys.argv[1], "wb").write(data)
PY
start_server fields 1 --config configs/inference.json --init_from="$tmp/zero" --max_batch_size=4 --kv_block_size=16
timeout --kill-after=5 300 python3 tests/server_fields.py "$url" zero >"$tmp/fields.json" 2>"$tmp/fields.err"
check '[ -s "$tmp/fields.json" ]' "tests/server_fields.py failed: $(tail -3 "$tmp/fields.err")"
while IFS= read -r line; do
    check '[ "${line%%	*}" = ok ]' "${line#*	}"
done < <(python3 -c 'import json,sys; [print(("ok" if v["ok"] else "FAIL") + "\t" + k + ": " + json.dumps(v["detail"])[:600]) for k, v in json.load(open(sys.argv[1])).items()]' "$tmp/fields.json" 2>/dev/null)

# cached_tokens: a prompt of 100 bytes asked three times in blocks of 16; the first computes it,
# the later ones find its 6 full blocks (96 positions), as /metrics's tokens saved counts them
saved() { curl -s -m 10 "$url/metrics" | sed -n 's/^workbook_prefix_cache_tokens_saved_total //p'; }
prompt=$(python3 -c 'print(("Sum the digits of " + "31415926535897932384626433832795028841971693993751058209749445923078164062862089986280")[:99] + ".")')
cached=()
for i in 1 2 3; do
    before=$(saved)
    curl -s -m 30 "$url/v1/completions" -d "{\"model\":\"zero\",\"prompt\":\"$prompt\",\"max_tokens\":2}" >"$tmp/cached$i.json"
    cached+=("$(json_value "$tmp/cached$i.json" usage prompt_tokens_details cached_tokens)/$(( $(saved) - before ))")
done
check '[ "${cached[*]}" = "0/0 96/96 96/96" ]' "cached_tokens/the metric's tokens saved of three same prompts: want 0/0 96/96 96/96, found ${cached[*]}"
stop_server

finish test_server_fields
