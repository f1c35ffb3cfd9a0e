#!/usr/bin/env bash
# make bench's part on stage 06's engine (runs alone too): what the paged KV cache, prefix caching
# and chunked prefill buy, each against the server without it, on a small random-weight model
# (4 layers of 256, context 2048, one thread). Each line starts a server, measures with
# scripts/bench_engine.py and stops it. The server's port is $SERVER_PORT (0: any free one; the
# speculation lines run a second server beside it, on the next port).
#   capacity   64 short requests at once, a cache of 4 whole contexts: the most running at once,
#              the slot design (one block of a whole context per request) against blocks of 16
#   TTFT       8 requests that share a 512-token prefix: time to first token without and with
#              prefix caching
#   stall      16 streams decoding when a 2000-token prompt arrives: their per-token latency p99
#              while it is prefilled, against the second before, whole and in 16-token chunks
#   speculation  batch-1 greedy decoding tokens/s without and with a small draft model, both
#              trained here to count (4 layers of 512 and 1 of 64)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
server=
alone=  # the speculation lines' second server
trap '[ -n "$server" ] && kill -TERM $server 2>/dev/null; [ -n "$alone" ] && kill -TERM $alone 2>/dev/null; rm -rf "$out"' EXIT
model=(--config configs/tiny.json --model_id=custom --n_layer=4 --n_head=4 --n_embd=256 --max_seq_len=2048
       --random_init=true --init_from= --tokens_to_generate=32)
context_bytes=$((2 * 4 * 2048 * 256 * 4))  # keys and values, 4 layers, 2048 positions, 256 columns, fp32

serve() { # serve <args...>: a server with the model and <args>; sets $url and $server (its output: $out/$log.log)
    OMP_NUM_THREADS=1 "${STAGE_BIN:-build}/stage-6" "${model[@]}" "$@" --serve=true --host=127.0.0.1 --port="${SERVER_PORT:-0}" \
        >"$out/${log:-server}.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do grep -qs "^server: model" "$out/${log:-server}.log" && break; sleep 0.1; done
    grep -q "^server: model" "$out/${log:-server}.log" || { echo "bench: the server did not start:"; tail "$out/${log:-server}.log"; exit 1; }
    url=http://127.0.0.1:$(grep -ao 'http://127.0.0.1:[0-9]*' "$out/${log:-server}.log" | sed 's/.*://')
}
unserve() { kill -TERM $server; wait $server; server=; }
measure() { python3 scripts/bench_engine.py "$@"; }
value() { python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }

python3 - "$out" <<'PY'
import json, random, sys
rng = random.Random(1)
words = "the a of to and in is was for on that with as it by at from his her they be this had".split()
text = lambda n: " ".join(rng.choice(words) for _ in range(n))[:n]  # the byte tokenizer: n tokens
open(f"{sys.argv[1]}/prefix.txt", "w").write(text(512))
open(f"{sys.argv[1]}/long.txt", "w").write(text(2000))
records = [{"instruction": f"Count to {n}.", "input": "", "output": " ".join(map(str, range(1, n + 1)))}
           for n in (rng.randrange(10, 40) for _ in range(400))]  # the byte tokenizer: "Count to 39." fits 256
json.dump(records, open(f"{sys.argv[1]}/count.json", "w"))
PY

echo
echo "stage 06 engine: 4 layers x 256, random weights, context 2048, 1 thread (scripts/bench_engine.sh)"
serve --max_batch_size=64 --kv_cache_bytes=$((4 * context_bytes)) --kv_block_size=2048 --prefix_caching=false
slots=$(value "$(measure capacity "$url")" most_running); unserve
serve --max_batch_size=64 --kv_cache_bytes=$((4 * context_bytes)) --kv_block_size=16 --prefix_caching=false
paged=$(value "$(measure capacity "$url")" most_running); unserve
echo "capacity, a cache of 4 contexts, 64 short requests: at most $slots running with whole-context slots, $paged with blocks of 16 positions ($(python3 -c "print(f'{$paged / $slots:.1f}')")x)"

serve --max_batch_size=8 --kv_cache_bytes=$((8 * context_bytes)) --prefix_caching=false
off=$(measure ttft "$url" "$out/prefix.txt"); unserve
serve --max_batch_size=8 --kv_cache_bytes=$((8 * context_bytes)) --prefix_caching=true
on=$(measure ttft "$url" "$out/prefix.txt"); unserve
echo "time to first token, a shared 512-token prefix: $(value "$off" median_ms | xargs printf %.1f) ms without prefix caching, $(value "$on" median_ms | xargs printf %.1f) ms with ($(python3 -c "print(f'{$(value "$off" median_ms) / $(value "$on" median_ms):.1f}')")x lower)"

for chunk in 0 16; do
    serve --max_batch_size=32 --kv_cache_bytes=$((8 * context_bytes)) --max_prefill_tokens=$chunk
    r=$(measure stall "$url" "$out/long.txt"); unserve
    what=$([ $chunk = 0 ] && echo "whole prompt" || echo "chunks of $chunk")
    echo "16 decoding streams, a 2000-token prompt arrives ($what): per-token p99 $(value "$r" before_p99_ms | xargs printf %.1f) ms before, $(value "$r" during_p99_ms | xargs printf %.1f) ms while it is prefilled ($(python3 -c "print(f'{$(value "$r" during_p99_ms) / $(value "$r" before_p99_ms):.1f}')")x; its TTFT $(value "$r" long_ttft_ms | xargs printf %.0f) ms)"
done

# Speculative decoding at batch 1. It pays where a decode step costs what reading the weights
# costs, so that checking k + 1 rows costs little more than one: the model is 4 layers of 512
# (52 MB of f32 weights, more than this CPU's 32 MB L3 cache), the draft 1 layer of 64 (0.4 MB).
# Both learn here, from the same records, a task whose answers are predictable, counting ("Count
# to 27." -> "1 2 3 ... 27"): the case speculative decoding is built for (boilerplate, code, text
# that quotes the prompt), where a small draft agrees with the model on most tokens. The model
# is trained just enough to count; its slips, which the draft does not share, are the refusals.
# Both servers run at once; one request at a time goes to each in turn.
"${STAGE_BIN:-build}/stage-1" --config configs/tiny.json --n_layer=4 --n_embd=512 --stop_iteration=60 --global_batch_size=2 \
    --warmup_steps=5 --log_interval=100 --eval_batches=0 --checkpoint_interval=0 --out_dir="$out/counter" \
    --data_path="$out/count.json" >"$out/counter.log" 2>&1
"${STAGE_BIN:-build}/stage-1" --config configs/tiny.json --n_layer=1 --n_embd=64 --stop_iteration=40 --global_batch_size=8 \
    --log_interval=100 --eval_batches=0 --checkpoint_interval=0 --out_dir="$out/counter_draft" \
    --data_path="$out/count.json" >"$out/counter_draft.log" 2>&1
model=(--config configs/inference.json --init_from="$out/counter")
echo '{"model":"counter","messages":[{"role":"user","content":"Count to 35."}],"max_tokens":100,"temperature":0}' >"$out/count_request.json"
serve --max_batch_size=1
alone=$server alone_url=$url
SERVER_PORT=$((${SERVER_PORT:-0} ? ${SERVER_PORT:-0} + 1 : 0)) log=drafted serve --max_batch_size=1 --draft_model="$out/counter_draft" --num_speculative_tokens=4
r=$(measure speculation "$alone_url" "$url" "$out/count_request.json"); unserve
server=$alone; unserve; alone=
ratio() { python3 -c "print(f'{$(value "$r" "$1") / $(value "$r" "$2"):.2f}')"; }
echo "batch 1, greedy, counting to 35 (4 layers x 512, trained here): $(value "$r" alone_tokens_per_second | xargs printf %.0f) tokens/s decoding alone, $(value "$r" draft_tokens_per_second | xargs printf %.0f) with a 1-layer draft of 64 proposing 4 (acceptance $(value "$r" acceptance_rate | xargs printf %.2f); $(ratio draft_tokens_per_second alone_tokens_per_second)x; the best of 8 answers each, $(ratio draft_median alone_median)x at their medians)"
