#!/usr/bin/env bash
# Stage 06's OpenAI-compatible server (--serve=true), with real clients over loopback only:
#  - curl: a completion, a streamed chat (server-sent events, one per token, [DONE] last), /health,
#    /metrics in Prometheus text format with its histograms;
#  - continuous batching: 32 concurrent requests (greedy and seeded sampling, 8 slots) get exactly
#    the answers they get one at a time, and the greedy ones those of stage 06 itself on the same
#    prompts (no server: an independent reference); a request that joins a running batch changes
#    nothing in the answer it joins;
#  - tensor parallelism: [2,1,1] and [2,2,1] serve the same answers as one rank;
#  - stop strings of two and three tokens cut the answer before them, whole and streamed;
#  - bad requests get 400 with an OpenAI error object and the server goes on serving (an unknown
#    model: 404, with the other hostile requests in tests/test_server_abuse.sh); a client
#    that goes away mid-stream frees its slot; a full queue answers 429; SIGTERM finishes the
#    request in flight, refuses new ones and exits 0;
#  - the official `openai` Python package (PyPI, in a venv under build/): a completion and a
#    streamed chat.
# Every wait is bounded; every server started here is stopped on exit.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
export OMP_NUM_THREADS=1
VENV=build/openai-venv
client() { bounded 300 python3 tests/server_client.py "$@"; }

source tests/server_lib.sh

# A small model trained on the built-in synthetic tasks: its answers are short, varied and end
# with end-of-text, so greedy and sampled answers differ from prompt to prompt.
build/stage-1 --config configs/tiny.json --n_layer=2 --n_embd=64 --stop_iteration=100 \
    --global_batch_size=16 --log_interval=100 --eval_batches=1 --out_dir="$tmp/model" >"$tmp/train.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 training for the test failed: $(tail -3 "$tmp/train.log")"
model=(--config configs/inference.json --init_from="$tmp/model" --max_batch_size=8 --tokens_to_generate=16)

# the prompts: instruction <TAB> input, as stage 06's prompts file has them
python3 - "$tmp" <<'PY'
import json, random, sys
tasks = ["Sort the digits.", "Find the largest digit.", "Reverse the digits.", "Count the digits.",
         "Add the digits."]
rng = random.Random(1)
prompts = [(tasks[i % len(tasks)], "".join(rng.choice("0123456789") for _ in range(3 + i % 7)))
           for i in range(32)]
open(f"{sys.argv[1]}/prompts.txt", "w").write("".join(f"{a}\t{b}\n" for a, b in prompts))
# in chat form the input is the system message (README: how messages map to the Alpaca template);
# the even ones greedy, the odd ones sampled with their own seed and limit
reqs = []
for i, (instruction, digits) in enumerate(prompts):
    r = {"model": "model", "messages": [{"role": "system", "content": digits},
                                        {"role": "user", "content": instruction}]}
    r.update({"temperature": 0} if i % 2 == 0 else {"temperature": 1, "seed": 100 + i, "max_tokens": 3 + i % 5})
    reqs.append(r)
json.dump(reqs, open(f"{sys.argv[1]}/requests.json", "w"))
greedy = [dict(r, temperature=0) for r in reqs]
for r in greedy:
    r.pop("seed", None), r.pop("max_tokens", None)
json.dump(greedy, open(f"{sys.argv[1]}/greedy.json", "w"))
json.dump(reqs[:8], open(f"{sys.argv[1]}/eight.json", "w"))
PY

# ---- 1. curl: a completion, a streamed chat, /health, /metrics
start_server one 1 "${model[@]}"
curl -s -m 30 "$url/v1/completions" -d '{"model":"model","prompt":"Sort the digits.","max_tokens":4,"temperature":0}' >"$tmp/c.json"
check '[ "$(json_value "$tmp/c.json" object)" = text_completion ] && [ "$(json_value "$tmp/c.json" usage prompt_tokens)" = 16 ]' \
    "curl completion: $(cat "$tmp/c.json")"
sse_body='{"model":"model","messages":[{"role":"system","content":"52913"},{"role":"user","content":"Sort the digits."}],"max_tokens":6,"temperature":0'
curl -s -N -m 30 "$url/v1/chat/completions" -d "$sse_body,\"stream\":true}" >"$tmp/sse.txt"
curl -s -m 30 "$url/v1/chat/completions" -d "$sse_body}" >"$tmp/chat.json"
# the events: the role first, then one per token (as many as the answer's completion tokens),
# then the finish reason, then [DONE]; their text is the answer's
check 'python3 - "$tmp/sse.txt" "$tmp/chat.json" <<'"'"'PY'"'"'
import json, sys
lines = [l for l in open(sys.argv[1]).read().split("\n") if l]
whole = json.load(open(sys.argv[2]))
events = [json.loads(l[6:]) for l in lines[:-1]]
tokens = events[1:-1]
sys.exit(not (lines[-1] == "data: [DONE]" and all(l.startswith("data: ") for l in lines)
              and events[0]["choices"][0]["delta"]["role"] == "assistant"
              and all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
              and events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
              and len(tokens) == whole["usage"]["completion_tokens"] >= 1
              and "".join(e["choices"][0]["delta"]["content"] for e in tokens) == whole["choices"][0]["message"]["content"]))
PY' "SSE: want a role event, one per token, a finish event, then [DONE]: $(head -c 600 "$tmp/sse.txt") / $(cat "$tmp/chat.json")"
check '[ "$(curl -s -m 10 "$url/health")" = "{\"status\":\"ok\"}" ]' "/health: $(curl -s -m 10 "$url/health")"
curl -s -m 10 "$url/metrics" >"$tmp/metrics.txt"
check 'grep -q "^# TYPE workbook_time_to_first_token_seconds histogram" "$tmp/metrics.txt" && grep -q "^workbook_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3$" "$tmp/metrics.txt" && grep -q "^workbook_time_to_first_token_seconds_count 3$" "$tmp/metrics.txt" && grep -q "^# TYPE workbook_time_per_output_token_seconds histogram" "$tmp/metrics.txt" && grep -q "^workbook_requests_total{code=\"200\"} 3$" "$tmp/metrics.txt" && grep -q "^workbook_queue_length 0$" "$tmp/metrics.txt" && grep -q "^workbook_running_batch_size 0$" "$tmp/metrics.txt"' \
    "/metrics: $(head -30 "$tmp/metrics.txt")"

# ---- 2. continuous batching: 32 concurrent = one at a time (all greedy; then half of them
# sampled, with their own seeds and limits) = stage 06 without a server (the greedy ones)
same_answers() { # same_answers <what> <a.json> <b.json>
    local a=$2 b=$3
    check '[ -s "$a" ] && cmp -s "$a" "$b"' "$1: $(diff <(tr "}" "\n" <"$a") <(tr "}" "\n" <"$b") | head -4)"
}
client answers "$url" "$tmp/greedy.json" 1 >"$tmp/greedy_serial.json"
client answers "$url" "$tmp/greedy.json" 32 >"$tmp/greedy_concurrent.json"
same_answers "32 concurrent greedy requests differ from one at a time" "$tmp/greedy_serial.json" "$tmp/greedy_concurrent.json"
client answers "$url" "$tmp/requests.json" 1 >"$tmp/serial.json"
client answers "$url" "$tmp/requests.json" 32 >"$tmp/concurrent.json"
same_answers "32 concurrent requests (half sampled) differ from one at a time" "$tmp/serial.json" "$tmp/concurrent.json"
check 'python3 -c "import json,sys; a=json.load(open(sys.argv[1])); sys.exit(not (all(x[\"status\"]==200 for x in a) and len(set(x[\"text\"] for x in a)) >= 8))" "$tmp/serial.json"' \
    "the answers are not 32 successes with varied text: $(head -c 400 "$tmp/serial.json")"
bounded 120 build/stage-6 "${model[@]}" --prompts_path="$tmp/prompts.txt" --show_token_ids=true >"$tmp/stage6.log" 2>&1
python3 - "$tmp" <<'PY' >"$tmp/reference.txt"
import json, sys
ids = [l.split(":", 1)[1].split() for l in open(f"{sys.argv[1]}/stage6.log", errors="replace") if "answer ids:" in l]
for answer in ids:  # the byte tokenizer: a token is a byte
    print(json.dumps(bytes(int(t) for t in answer).decode("utf-8", "replace")))
PY
python3 -c 'import json,sys; [print(json.dumps(x["text"])) for x in json.load(open(sys.argv[1]))]' "$tmp/greedy_concurrent.json" >"$tmp/served.txt"
check '[ "$(wc -l <"$tmp/reference.txt")" -eq 32 ] && cmp -s "$tmp/reference.txt" "$tmp/served.txt"' \
    "served greedy answers differ from stage 06's own: $(diff "$tmp/reference.txt" "$tmp/served.txt" | head -4)"
python3 -c 'import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); sys.exit(not all(a[i]==b[i] for i in range(0, 32, 2)))' \
    "$tmp/greedy_serial.json" "$tmp/serial.json"
rc=$?; check '[ $rc -eq 0 ]' "a greedy answer changed when the requests beside it were sampled"

# a stop string: the answer ends before it, finish reason "stop"
python3 - "$tmp" <<'PY'
import json, sys
req, got = json.load(open(f"{sys.argv[1]}/requests.json"))[0], json.load(open(f"{sys.argv[1]}/serial.json"))[0]
json.dump([dict(req, stop=[got["text"][2:4], "never"])], open(f"{sys.argv[1]}/stop.json", "w"))
PY
client answers "$url" "$tmp/stop.json" 1 >"$tmp/stopped.json"
check '[ "$(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))[0]; print(json.dumps(r[\"text\"]), r[\"finish_reason\"])" "$tmp/stopped.json")" = "$(python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))[0][\"text\"][:2]))" "$tmp/serial.json") stop" ]' \
    "a stop string did not cut the answer: $(cat "$tmp/stopped.json") (without it: $(head -c 200 "$tmp/serial.json"))"
# stop strings of two and three tokens (the byte tokenizer: one byte each), whole and streamed:
# the answer is the text before the stop string's first occurrence, the finish reason "stop"
python3 - "$tmp" <<'PY'
import json, sys
reqs, got = json.load(open(f"{sys.argv[1]}/requests.json")), json.load(open(f"{sys.argv[1]}/serial.json"))
i = max(range(0, len(reqs), 2), key=lambda i: len(got[i]["text"]))  # the longest greedy answer
text = got[i]["text"]
cases = [dict(reqs[i], stop=[text[2:2 + n]]) for n in (2, 3)]
json.dump(cases, open(f"{sys.argv[1]}/stops.json", "w"))
json.dump([[text[:text.find(c["stop"][0])], "stop"] for c in cases], open(f"{sys.argv[1]}/stops_want.json", "w"))
for n, c in zip((2, 3), cases):
    json.dump(dict(c, stream=True), open(f"{sys.argv[1]}/stop{n}_stream.json", "w"))
PY
client answers "$url" "$tmp/stops.json" 1 >"$tmp/stops.json.out"
check 'python3 -c "import json,sys; a,w=(json.load(open(p)) for p in sys.argv[1:]); sys.exit([[x[\"text\"], x[\"finish_reason\"]] for x in a] != w)" "$tmp/stops.json.out" "$tmp/stops_want.json"' \
    "stop strings of 2 and 3 tokens, whole answers: $(cat "$tmp/stops.json.out"), want $(cat "$tmp/stops_want.json")"
for n in 2 3; do
    curl -s -N -m 30 "$url/v1/chat/completions" -d @"$tmp/stop${n}_stream.json" >"$tmp/stop${n}_sse.txt"
    check 'python3 - "$tmp/stop${n}_sse.txt" "$tmp/stops_want.json" $((n - 2)) <<'"'"'PY'"'"'
import json, sys
events = [json.loads(l[6:]) for l in open(sys.argv[1]).read().split("\n") if l.startswith("data: {")]
text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
want = json.load(open(sys.argv[2]))[int(sys.argv[3])]
sys.exit([text, events[-1]["choices"][0]["finish_reason"]] != want)
PY' "a stop string of $n tokens, streamed: $(head -c 600 "$tmp/stop${n}_sse.txt"), want $(cat "$tmp/stops_want.json")"
done

# ---- 3. bad requests: 400 and an OpenAI error object each; the server keeps serving
long=$(python3 -c 'print("x" * 300)')
bad=('{"model":"model","prompt":' '{"model":"model"}' '{"prompt":"hi"}' '{"model":7,"prompt":"hi"}'
     '{"model":"model","prompt":3}' "{\"model\":\"model\",\"prompt\":\"$long\"}"
     '{"model":"model","prompt":"hi","max_tokens":0}' '{"model":"model","prompt":"hi","max_tokens":100000}'
     '{"model":"model","prompt":"hi","max_tokens":"ten"}' '{"model":"model","prompt":"hi","temperature":"hot"}'
     '{"model":"model","prompt":"hi","stream":"yes"}' '[1,2]')
for body in "${bad[@]}"; do
    code=$(curl -s -m 10 -o "$tmp/bad.json" -w '%{http_code}' "$url/v1/completions" -d "$body")
    check '[ "$code" = 400 ] && [ "$(json_value "$tmp/bad.json" error type)" = invalid_request_error ] && json_value "$tmp/bad.json" error message >/dev/null && python3 -c "import json,sys; e=json.load(open(sys.argv[1]))[\"error\"]; sys.exit(not (\"param\" in e and \"code\" in e))" "$tmp/bad.json"' \
        "bad request ${body:0:60}: status $code, $(head -c 300 "$tmp/bad.json")"
done
for body in '{"model":"model"}' '{"model":"model","messages":[]}' '{"model":"model","messages":[{"role":"robot","content":"hi"}]}' \
            '{"model":"model","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}'; do
    code=$(curl -s -m 10 -o "$tmp/bad.json" -w '%{http_code}' "$url/v1/chat/completions" -d "$body")
    check '[ "$code" = 400 ] && [ "$(json_value "$tmp/bad.json" error param)" = messages ]' "bad chat ${body:0:60}: status $code, $(head -c 300 "$tmp/bad.json")"
done
check '[ "$(json_value "$tmp/c.json" choices)" = "$(curl -s -m 30 "$url/v1/completions" -d "{\"model\":\"model\",\"prompt\":\"Sort the digits.\",\"max_tokens\":4,\"temperature\":0}" | python3 -c "import json,sys; print(json.dumps(json.load(sys.stdin)[\"choices\"]))")" ]' \
    "after the bad requests the server no longer answers as before"

# ---- 4. the official openai package: a completion, a streamed chat
if ! "$VENV/bin/python" -c 'import openai' 2>/dev/null; then
    rm -rf "$VENV"
    /usr/bin/python3 -m venv --system-site-packages "$VENV" && "$VENV/bin/pip" install -q openai >"$tmp/pip.log" 2>&1
fi
check '"$VENV/bin/python" -c "import openai"' "the openai package does not import in $VENV (pip: $(tail -2 "$tmp/pip.log" 2>/dev/null))"
bounded 120 "$VENV/bin/python" - "$url" "$tmp/requests.json" "$tmp/serial.json" "$tmp/c.json" >"$tmp/openai.txt" 2>&1 <<'PY'
import json, sys
from openai import OpenAI
url, reqs, want, curl = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3])), json.load(open(sys.argv[4]))
client = OpenAI(base_url=url + "/v1", api_key="none")
c = client.completions.create(model="model", prompt="Sort the digits.", max_tokens=4, temperature=0)
print("completion as curl's", c.choices[0].text == curl["choices"][0]["text"] and c.usage.prompt_tokens == 16)
ok = 0
for i in (0, 1, 2, 3):  # greedy and sampled chats, streamed: the same text as the plain client's
    r = reqs[i]
    extra = {k: r[k] for k in ("temperature", "seed", "max_tokens") if k in r}
    pieces = [chunk.choices[0].delta.content or "" for chunk in
              client.chat.completions.create(model="model", messages=r["messages"], stream=True, **extra)]
    ok += "".join(pieces) == want[i]["text"]
print("streamed chats equal", ok)
try:
    client.completions.create(model="nope", prompt="hi")
except Exception as e:
    print("unknown model", getattr(e, "status_code", None))
PY
check 'grep -q "^completion as curl.s True$" "$tmp/openai.txt" && grep -q "^streamed chats equal 4$" "$tmp/openai.txt" && grep -q "^unknown model 404$" "$tmp/openai.txt"' \
    "openai package: $(tail -5 "$tmp/openai.txt")"

# ---- 5. tensor parallelism: the same answers from [2,1,1] and [2,2,1]; SIGTERM to rank 0 stops
# every rank, exit 0
python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))[:8]))' "$tmp/serial.json" >"$tmp/serial8.json"
for grid in 2,1,1:2 2,2,1:4; do
    dims=${grid%:*} np=${grid#*:}
    start_server "tp$dims" "$np" "${model[@]}" --tp_dimensions="$dims"
    client answers "$url" "$tmp/eight.json" 8 >"$tmp/tp$dims.json"
    check 'cmp -s "$tmp/serial8.json" "$tmp/tp$dims.json"' \
        "[$dims] serves other answers than one rank: $(diff <(tr "}" "\n" <"$tmp/serial8.json") <(tr "}" "\n" <"$tmp/tp$dims.json") | head -4; tail -2 "$tmp/tp$dims.log")"
    kill -TERM "$rank0"; wait "$pid"; rc=$?
    check '[ $rc -eq 0 ] && grep -q "^server: stopped" "$tmp/tp$dims.log"' "[$dims]: SIGTERM to rank 0: exit $rc, $(tail -3 "$tmp/tp$dims.log")"
done

# ---- 6. with a slower model (random weights, 4 wide layers, ~1 ms a token): a request joining a
# running one, a client going away, a full queue, SIGTERM
slow=(--config configs/inference.json --model_id=custom --n_layer=4 --n_head=4 --n_embd=256
      --max_seq_len=2048 --random_init=true --init_from= --max_batch_size=4)
# a: 400 tokens with no end-of-text for this seed; b joins at a's 5th token and is done long before
echo '{"model":"random","prompt":"Once upon a time","max_tokens":400,"temperature":1,"seed":8}' >"$tmp/a.json"
echo '{"model":"random","prompt":"Sort the digits.","max_tokens":40,"temperature":1,"seed":5}' >"$tmp/b.json"
echo '{"model":"random","prompt":"Hello","max_tokens":1500,"temperature":0}' >"$tmp/long.json"
start_server slow 1 "${slow[@]}"
client answers "$url" <(echo "[$(cat "$tmp/a.json"),$(cat "$tmp/b.json")]") 1 >"$tmp/alone.json"
client midjoin "$url" "$tmp/a.json" "$tmp/b.json" >"$tmp/midjoin.json"
check 'python3 -c "import json,sys; a,b=json.load(open(sys.argv[1])); m=json.load(open(sys.argv[2])); sys.exit(not (m[\"a\"]==a[\"text\"] and m[\"b\"]==b[\"text\"] and a[\"finish_reason\"]==\"length\" and m[\"b_within_a\"]))" "$tmp/alone.json" "$tmp/midjoin.json"' \
    "a request joining mid-batch changed an answer: alone $(head -c 300 "$tmp/alone.json"), joined $(head -c 300 "$tmp/midjoin.json")"
client disconnect "$url" "$tmp/long.json" >"$tmp/disconnect.json"
for how in streamed whole; do  # of the 1500 tokens asked for, few were made: the slot was freed
    check '[ "$(json_value "$tmp/disconnect.json" $how running_back_to_zero)" = True ] && python3 -c "import json,sys; sys.exit(not json.load(open(sys.argv[1]))[sys.argv[2]][\"generated_tokens\"] < 500)" "$tmp/disconnect.json" $how' \
        "a client gone ($how) did not free its slot, or its answer ran on: $(cat "$tmp/disconnect.json")"
done
kill -TERM "$rank0"; wait "$pid"
start_server queue 1 "${slow[@]}" --max_batch_size=1 --max_queue=1
client queue "$url" "$tmp/long.json" >"$tmp/queue.json"
check '[ "$(json_value "$tmp/queue.json" queued)" = True ] && [ "$(json_value "$tmp/queue.json" c)" = 429 ] && [ "$(json_value "$tmp/queue.json" c_error)" = rate_limit_error ] && [ "$(json_value "$tmp/queue.json" b)" = 200 ]' \
    "a full queue: $(cat "$tmp/queue.json")"
echo '{"model":"random","prompt":"Hello","max_tokens":300,"temperature":0}' >"$tmp/term.json"
client sigterm "$url" "$rank0" "$tmp/term.json" >"$tmp/sigterm.json"
wait "$pid"; rc=$?
check '[ $rc -eq 0 ] && [ "$(json_value "$tmp/sigterm.json" started)" = True ] && [ "$(json_value "$tmp/sigterm.json" a completion_tokens)" = 300 ] && [ "$(json_value "$tmp/sigterm.json" after)" != 200 ]' \
    "SIGTERM: exit $rc (want 0), $(cat "$tmp/sigterm.json"); $(tail -3 "$tmp/queue.log")"

# ---- 7. bad configs: one clear error
expect_one_error "serve without the KV cache" "needs the KV cache" build/stage-6 "${model[@]}" --serve=true --kv_cache=false
expect_one_error "serve and evaluate" "either serves or evaluates" build/stage-6 "${model[@]}" --serve=true --eval_accuracy=true
expect_one_error "a bad host" "key 'host': expected an IPv4 address" build/stage-6 "${model[@]}" --serve=true --host=localhost --port=0

finish test_server
