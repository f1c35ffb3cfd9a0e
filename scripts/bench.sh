#!/usr/bin/env bash
# make bench: tokens/s, ms/step and MFU of the training stages, as a table; stage 06's decode
# speed and its server's throughput and time to first token under load. Each run's first
# step (warm-up: page faults, primitive creation) is left out; the median of the rest is shown.
# Then each step against its bound and stage 01 sharing the machine (build/bench/bench.json keeps
# their figures); the flight recorder's cost (scripts/bench_flight.sh). Last, the planner's predicted step
# times against measured ones (scripts/bench_plan.sh, which also runs alone).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# the figures as data (scripts/bench_bound.sh and bench_sharing.sh write theirs into it)
export BENCH_JSON=build/bench/bench.json
mkdir -p build/bench
rm -f "$BENCH_JSON"

run() { # run <label> <stage> <f32|bf16> <args...>
    local label=$1 stage=$2 precision=$3; shift 3
    build/stage-$stage "$@" --out_dir="$out/$label" --eval_batches=0 --checkpoint_interval=0 >"$out/$label.log" 2>&1 ||
        { echo "bench: $label failed:"; tail "$out/$label.log"; exit 1; }
    python3 - "$label" "$out/$label/metrics.jsonl" "$out/$label/stats.json" "$precision" <<'PY'
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[2])][1:]
if any(r["loss"] == 0 for r in rows):  # a batch with no target measures less than a real step
    sys.exit(f"bench: {sys.argv[1]}: a step without response tokens to predict (loss 0): use a longer max_seq_len")
med = lambda k: statistics.median(r[k] for r in rows)
# the memory report's items (stats.json), added up by their first word: "parameters (...)"
mib = {}
for what, nbytes in json.load(open(sys.argv[3]))["memory"].items():
    first = what.split()[0]
    mib[first] = mib.get(first, 0) + nbytes / 1048576
# whole-step FLOP/s: MFU x the peak it was taken against (the same FLOP count per token)
bf16 = sys.argv[4] == "bf16"
flops = med('mfu') * float(os.environ["OPS_PEAK_FLOPS_BF16" if bf16 else "OPS_PEAK_FLOPS_F32"])
ceiling = float(os.environ["CEILING_MATMUL_BF16" if bf16 else "CEILING_MATMUL_F32"])
print(f"| {sys.argv[1]:<28} | {med('tokens_per_sec'):>9.0f} | {med('ms'):>9.1f} | {100*med('mfu'):>6.1f}% "
      f"| {flops/1e9:>8.0f} | {100*flops/ceiling:>7.1f}% "
      f"| {mib.get('parameters', 0):>10.1f} | {mib.get('activations', 0):>11.1f} |")
PY
}

# MFU's peak, found once here as the stages find it (build/peak_flops: measured on a CPU, derived
# from the device on a GPU) and handed to every run through OPS_PEAK_FLOPS_F32/_BF16, so all rows
# divide by the same figure rather than each run measuring its own
peaks=$(build/peak_flops)
eval "$peaks"
echo "$OMP_NUM_THREADS threads; MFU against this peak (build/peak_flops, once for every run):"
sed 's/^[^#]*# /  /' <<<"$peaks"
# the ceilings at GPT-2 124M's shapes (256 rows a step), measured now, in this run: each figure
# below is also given as a share of its ceiling, so that it means something on any machine
ceilings=$(build/ceilings 256 768 50304)
eval "$ceilings"
python3 - <<'PY'
import os
e = {k: float(v) / 1e9 for k, v in os.environ.items() if k.startswith("CEILING_")}
print(f"ceilings at the GPT-2 124M bench shape: {e['CEILING_MATMUL_F32']:.0f} GFLOP/s f32 matmul, "
      f"{e['CEILING_MATMUL_BF16']:.0f} GFLOP/s bf16 matmul, {e['CEILING_READ']:.1f} GB/s read "
      "(build/ceilings 256 768 50304):")
PY
sed 's/^[^#]*# /    /' <<<"$ceilings"
echo "step GFLOP/s = FLOP per token x tokens/s, FLOP per token = 6 (12 L C^2 + V C) + 12 L C T"
echo "(common/run/run_setup.c: flops_per_token, as MFU counts it); % ceil = step GFLOP/s / matmul ceiling"
# GPT-2 124M at 1 x 256 tokens: the matmuls see 256 rows, as at 4 x 64, but a 256-token window
# holds a whole record of the built-in data (the byte-level template alone is longer than 64), so
# every step has response tokens to predict: a real loss, the softmax of every row computed.
echo "| run                          |  tokens/s |   ms/step |    MFU |  GFLOP/s |  % ceil | params MiB | activ. MiB  |"
echo "|------------------------------|-----------|-----------|--------|----------|---------|------------|-------------|"
run "stage-1 gpt2-124M B=1 T=256" 1 f32 --config configs/bench_gpt2.json
run "stage-2 gpt2-124M bf16-mixed" 2 bf16 --config configs/bench_gpt2.json --precision=bf16-mixed
run "stage-1 tiny.json" 1 f32 --config configs/tiny.json --stop_iteration=12
run "stage-2 tiny.json bf16-mixed" 2 bf16 --config configs/tiny.json --stop_iteration=12 --precision=bf16-mixed

# Stage 06: decode speed at batch 1 and 8, random weights (the speed does not depend on them). At
# batch 1 a decode step reads every weight once and the cached keys and values of every position
# before it to produce one token, so tokens/s is bounded by those bytes over the memory's read
# rate: stage 06 prints that bound itself at batch 1 (06_inference/infer.c, print_decode_bound),
# the rate measured in its own process over the weights it decodes with. bf16 weights
# (--precision=bf16-mixed) are half the weights' bytes.
head -4 data/inference/prompts.txt >"$out/prompts8.txt"
head -4 data/inference/prompts.txt >>"$out/prompts8.txt"
decode() { # decode <label> <batch> <args...>
    local label=$1 batch=$2; shift 2
    build/stage-6 "$@" --random_init=true --tokens_to_generate=48 --max_seq_len=256 \
        --prompts_path="$out/prompts8.txt" --max_batch_size="$batch" >"$out/$label.log" 2>&1 ||
        { echo "bench: $label failed:"; tail "$out/$label.log"; exit 1; }
    python3 - "$label" "$out/$label.log" "$batch" <<'PY'
import re, sys
log = open(sys.argv[2], errors="replace").read()
m = re.search(r"prefill: (\d+) tokens in ([0-9.]+) ms = (\d+) tokens/s \| decode: (\d+) tokens in ([0-9.]+) ms = (\d+) tokens/s", log)
batch = int(sys.argv[3])
decode_tps, prefill_tps = float(m[6]), float(m[3])
b = re.search(r"at ([0-9.]+) GB/s \(this process.* = ([0-9.]+) tokens/s; decode ran at (\d+)% of it", log)
share = f"{int(b[3]):4d}% of {float(b[2]):6.0f} at {float(b[1]):5.1f} GB/s" if b else "          -                "
print(f"| {sys.argv[1]:<28} | {decode_tps:>12.0f} | {1e3 * batch / decode_tps:>9.2f} | {prefill_tps:>9.0f} | {share} |")
open(f"{sys.argv[2]}.tps", "w").write(f"{decode_tps}\n")
PY
}
echo
echo "stage 06 decode (greedy, 8 prompts; $OMP_NUM_THREADS threads)"
echo "| run                          | decode tok/s | ms/step   | prefill/s | batch-1 bound tok/s, read rate |"
echo "|------------------------------|--------------|-----------|-----------|--------------------------------|"
decode "stage-6 tiny.json B=1" 1 --config configs/tiny.json
decode "stage-6 tiny.json B=8" 8 --config configs/tiny.json
decode "stage-6 gpt2-124M B=1" 1 --config configs/bench_gpt2.json
decode "stage-6 gpt2-124M B=8" 8 --config configs/bench_gpt2.json
decode "stage-6 gpt2-124M B=1 bf16" 1 --config configs/bench_gpt2.json --precision=bf16-mixed
python3 -c "import sys; print(f'bf16 weights decode {float(sys.argv[2]) / float(sys.argv[1]):.2f}x as fast as fp32 at batch 1')" \
    "$(cat "$out/stage-6 gpt2-124M B=1.log.tps")" "$(cat "$out/stage-6 gpt2-124M B=1 bf16.log.tps")"

# Stage 06 as a server (--serve=true): tests/server_client.py's load generator streams completions
# from 1, 4 and 16 clients at once, each sending its next request when its answer is done. The
# server batches whatever is running (continuous batching, 16 slots): more clients give more
# tokens/s until the step is no longer bound by reading the weights, and a longer wait for the
# first token (a new request's prefill shares the loop with everyone's decode steps). The server
# runs one thread: the load generator needs a core too, and OpenMP threads waiting for a busy
# core cost more than a tiny model's matmuls gain from them.
server_log=$out/server.log
OMP_NUM_THREADS=1 build/stage-6 --config configs/tiny.json --random_init=true --max_seq_len=256 --max_batch_size=16 \
    --serve=true --host=127.0.0.1 --port=0 >"$server_log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; rm -rf "$out"' EXIT
for _ in $(seq 300); do grep -q "^server: model" "$server_log" && break; sleep 0.1; done
grep -q "^server: model" "$server_log" || { echo "bench: the server did not start:"; tail "$server_log"; exit 1; }
url=http://127.0.0.1:$(grep -ao 'http://127.0.0.1:[0-9]*' "$server_log" | sed 's/.*://')
echo '{"model":"random","prompt":"Once upon a time there was","max_tokens":64,"temperature":0}' >"$out/request.json"
echo
echo "stage 06 server: tiny.json, random weights, 1 thread, 16 slots, 64 tokens per request, streamed (load: tests/server_client.py)"
echo "| clients | requests | tokens/s | TTFT p50 ms | TTFT p99 ms |"
echo "|---------|----------|----------|-------------|-------------|"
for clients in 1 4 16; do
    python3 tests/server_client.py bench "$url" "$clients" $((clients * 8)) "$out/request.json" >"$out/load$clients.json" ||
        { echo "bench: the load generator failed at $clients clients"; tail "$server_log"; exit 1; }
    python3 - "$out/load$clients.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| {r['clients']:>7} | {r['requests']:>8} | {r['tokens_per_second']:>8.0f} | {r['ttft_p50_ms']:>11.1f} | {r['ttft_p99_ms']:>11.1f} |")
PY
done
kill -TERM $server
wait $server || { echo "bench: the server did not exit 0 on SIGTERM:"; tail "$server_log"; exit 1; }
# ---- a step against its bound (scripts/bench_bound.sh); stage 01 sharing the machine (scripts/bench_sharing.sh) ----
echo
bash scripts/bench_bound.sh
echo
bash scripts/bench_sharing.sh
# ---- stage 06's engine: paged KV cache, prefix caching, chunked prefill, speculative decoding ----
bash scripts/bench_engine.sh
# ---- the flight recorder's cost: step time with it on and off (scripts/bench_flight.sh) ----
echo
bash scripts/bench_flight.sh
# ---- the planner (build/plan, docs/PLANNER.md): predicted step time against measured, 4 ranks ----
echo
bash scripts/bench_plan.sh
