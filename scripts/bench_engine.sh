#!/usr/bin/env bash
# make bench's part on stage 06's engine (runs alone too): what the paged KV cache, prefix caching
# and chunked prefill buy, each against the server without it, on a small random-weight model
# (4 layers of 256, context 2048, one thread). Each line starts a server, measures with
# scripts/bench_engine.py and stops it. The server's port is $SERVER_PORT (0: any free one).
#   capacity   64 short requests at once, a cache of 4 whole contexts: the most running at once,
#              the slot design (one block of a whole context per request) against blocks of 16
#   TTFT       8 requests that share a 512-token prefix: time to first token without and with
#              prefix caching
#   stall      16 streams decoding when a 2000-token prompt arrives: their per-token latency p99
#              while it is prefilled, against the second before, whole and in 16-token chunks
#   speculation  batch-1 greedy tokens/s without and with a small draft model (trained here)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
server=
trap '[ -n "$server" ] && kill -TERM $server 2>/dev/null; rm -rf "$out"' EXIT
model=(--config configs/tiny.json --model_id=custom --n_layer=4 --n_head=4 --n_embd=256 --max_seq_len=2048
       --random_init=true --init_from= --tokens_to_generate=32)
context_bytes=$((2 * 4 * 2048 * 256 * 4))  # keys and values, 4 layers, 2048 positions, 256 columns, fp32

serve() { # serve <args...>: a server with the model and <args>; sets $url and $server
    OMP_NUM_THREADS=1 "${STAGE_BIN:-build}/stage-6" "${model[@]}" "$@" --serve=true --host=127.0.0.1 --port="${SERVER_PORT:-0}" \
        >"$out/server.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do grep -q "^server: model" "$out/server.log" && break; sleep 0.1; done
    grep -q "^server: model" "$out/server.log" || { echo "bench: the server did not start:"; tail "$out/server.log"; exit 1; }
    url=http://127.0.0.1:$(grep -ao 'http://127.0.0.1:[0-9]*' "$out/server.log" | sed 's/.*://')
}
unserve() { kill -TERM $server; wait $server; server=; }
measure() { python3 scripts/bench_engine.py "$@"; }
value() { python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }

python3 - "$out" <<'PY'
import random, sys
rng = random.Random(1)
words = "the a of to and in is was for on that with as it by at from his her they be this had".split()
text = lambda n: " ".join(rng.choice(words) for _ in range(n))[:n]  # the byte tokenizer: n tokens
open(f"{sys.argv[1]}/prefix.txt", "w").write(text(512))
open(f"{sys.argv[1]}/long.txt", "w").write(text(2000))
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

# speculative decoding at batch 1: a model trained a little on alpaca answers (4 layers of 256)
# and a draft trained alike (1 layer of 64): they agree on most greedy tokens
data="${FIXTURES:-../shared/fixtures}/alpaca/rasbt-LLMs-from-scratch_instruction-data.json"
"${STAGE_BIN:-build}/stage-1" --config configs/tiny.json --n_layer=4 --n_embd=256 --stop_iteration=30 --global_batch_size=8 \
    --log_interval=100 --eval_batches=0 --checkpoint_interval=0 --out_dir="$out/target" --data_path="$data" >"$out/target.log" 2>&1
"${STAGE_BIN:-build}/stage-1" --config configs/tiny.json --n_layer=1 --n_embd=64 --stop_iteration=30 --global_batch_size=8 \
    --log_interval=100 --eval_batches=0 --checkpoint_interval=0 --out_dir="$out/draft" --data_path="$data" >"$out/draft.log" 2>&1
model=(--config configs/inference.json --init_from="$out/target")
echo '{"model":"target","prompt":"Once upon a time","max_tokens":200,"temperature":0}' >"$out/spec.json"
for draft in "" "$out/draft"; do
    serve --max_batch_size=1 ${draft:+--draft_model=$draft --num_speculative_tokens=4}
    python3 tests/server_client.py bench "$url" 1 4 "$out/spec.json" >"$out/spec$([ -n "$draft" ] && echo 1 || echo 0).json"
    rate=$(python3 tests/server_client.py metric "$url" workbook_spec_acceptance_rate); unserve
done
echo "batch 1, 200 greedy tokens: $(value "$(cat "$out/spec0.json")" tokens_per_second | xargs printf %.0f) tokens/s alone, $(value "$(cat "$out/spec1.json")" tokens_per_second | xargs printf %.0f) with a 1-layer draft proposing 4 (acceptance $(printf %.2f "$rate"); $(python3 -c "print(f'{$(value "$(cat "$out/spec1.json")" tokens_per_second) / $(value "$(cat "$out/spec0.json")" tokens_per_second):.2f}')")x)"
