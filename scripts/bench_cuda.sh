#!/usr/bin/env bash
# make bench-cuda: the GPU's figures at GPT-2 124M, in about a minute (the build for the GPU present
# aside): stage 01 (fp32) and stage 02 (bf16-mixed) training at llm.c's shape, B=4 sequences of
# T=1024 tokens (B=1 on a GPU with less than 20 GiB), tokens/s and MFU against the GPU's peak
# (build/peak_flops: derived from the device); stage 06 decoding at batch 1 and 8, tokens/s against
# what the GPU's memory bandwidth allows (every weight read once per decode step; the bandwidth is
# build/ceilings' sum over 1 GiB, measured now). Each training run's first step (warm-up) is left
# out and the median of the other steps shown; stage 02 runs again with the attention forward on
# the tensor cores (OPS_CUDA_KERNELS=flash_bf16), and with every switched kernel (all). Decode runs twice: with the default kernels and with
# those behind OPS_CUDA_KERNELS=all (docs/CUDA.md, "Kernels behind a switch"), so one run shows
# whether a switched kernel should become the default. Beside the training figures, the anchors'
# published figures for the same model on the same GPU class (not measured here).
#   BENCH_B   sequences a training step (default 4, 1 below 20 GiB); printed
# Without a GPU or nvcc it says SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ -z "$gpu" ]; then
    echo "bench-cuda: SKIPPED: no GPU visible (nvidia-smi lists none): nothing measured"
    exit 0
fi
if ! command -v "${NVCC:-nvcc}" >/dev/null 2>&1; then
    echo "bench-cuda: SKIPPED: nvcc not found, so the CUDA binaries cannot be built: nothing measured"
    exit 0
fi
name=${gpu%%,*} mem_mib=${gpu##*, }
make -j"$(nproc)" --no-print-directory BACKEND=cuda build/cuda/stage-1 build/cuda/stage-2 build/cuda/stage-6 \
    build/cuda/peak_flops build/cuda/ceilings >/dev/null || { echo "bench-cuda: the CUDA build failed"; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
B=4 T=1024
[ "$mem_mib" -lt 20480 ] && B=1
B=${BENCH_B:-$B}

# records longer than T (the byte tokenizer: one token a character), so that every batch is B x T
# tokens: a batch is as long as its longest record, and the built-in ones are a few hundred
python3 - "$out/long.json" <<'PY'
import json, sys
records = [{"instruction": f"Write out the sequence number {i}.", "input": "",
            "output": " ".join(str(i * 7919 + j) for j in range(300))} for i in range(64)]
json.dump(records, open(sys.argv[1], "w"))
PY

eval "$(build/cuda/peak_flops)"
eval "$(build/cuda/ceilings $((B * T)) 768 50304)"
echo "bench-cuda on $name ($mem_mib MiB): GPT-2 124M (vocabulary padded to 50304), B=$B T=$T"
echo "MFU peaks (build/peak_flops): $(python3 -c "import os; print(f\"{float(os.environ['OPS_PEAK_FLOPS_F32'])/1e12:.1f} TFLOP/s f32, {float(os.environ['OPS_PEAK_FLOPS_BF16'])/1e12:.1f} TFLOP/s bf16\")"); memory read $(python3 -c "import os; print(f\"{float(os.environ['CEILING_READ'])/1e9:.0f}\")") GB/s (build/ceilings)"

train() { # train <label> <stage> <args...>
    local label=$1 stage=$2; shift 2
    build/cuda/stage-$stage --config configs/bench_gpt2.json --dataset_id=alpaca --data_path="$out/long.json" \
        --global_batch_size=$B --max_seq_len=$T --stop_iteration=6 --eval_batches=0 --val_fraction=0.1 \
        --out_dir="$out/$label" "$@" >"$out/$label.log" 2>&1 ||
        { echo "bench-cuda: $label failed:"; tail -5 "$out/$label.log"; return 1; }
    python3 - "$label" "$name" "$out/$label/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[3])][1:]
med = lambda k: statistics.median(r[k] for r in rows)
print(f"| {sys.argv[2]:<22} | {sys.argv[1]:<26} | {med('tokens_per_sec'):>10.0f} | {med('ms'):>8.1f} | {100 * med('mfu'):>5.1f}% |")
PY
}
echo "| GPU                    | run                        |   tokens/s |  ms/step |   MFU |"
echo "|------------------------|----------------------------|------------|----------|-------|"
train "stage 01 fp32" 1
# the tf32 lesson (01_single_gpu/README.md), where the GPU has TF32 (compute capability 8.0 on);
# its MFU is against the f32 peak, as stage 01's
[ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | cut -d. -f1)" -ge 8 ] &&
    train "stage 01 tf32 (lesson)" 1 --tf32=true
train "stage 02 bf16-mixed" 2 --precision=bf16-mixed
# the kernels behind a switch (docs/CUDA.md): the attention forward on the tensor cores alone, then
# with the bias gradients in cuBLASLt's epilogue too
OPS_CUDA_KERNELS=flash_bf16 train "stage 02, flash_bf16" 2 --precision=bf16-mixed
OPS_CUDA_KERNELS=all train "stage 02, all switched" 2 --precision=bf16-mixed
# published figures for GPT-2 124M training at T=1024 on this GPU class, for scale
case "$name" in
    *H100* | *H200*) echo "anchors: llm.c about 460,000 tokens/s per H100 (GPT-2 124M, 10B tokens in about 45 min on 8 H100s; bf16)" ;;
    *A100*) echo "anchors: llm.c about 230,000 tokens/s per A100; nanoGPT with torch.compile about 140,000 (GPT-2 124M, bf16)" ;;
    *) echo "anchors: none published for this GPU class (llm.c: about 460,000 tokens/s per H100, 230,000 per A100)" ;;
esac

decode() { # decode <label> <batch> <bytes per weight> <args...>; OPS_CUDA_KERNELS from the caller
    local label=$1 batch=$2 weight_bytes=$3; shift 3
    [ -n "${OPS_CUDA_KERNELS:-}" ] && label="$label, $OPS_CUDA_KERNELS"
    build/cuda/stage-6 --config configs/bench_gpt2.json --random_init=true --tokens_to_generate=64 --max_seq_len=256 \
        --prompts_path="$out/prompts8.txt" --max_batch_size="$batch" "$@" >"$out/$label.log" 2>&1 ||
        { echo "bench-cuda: $label failed:"; tail -5 "$out/$label.log"; return 1; }
    python3 - "$label" "$name" "$out/$label.log" "$batch" "$CEILING_READ" "$weight_bytes" <<'PY'
import re, sys
label, name, path = sys.argv[1:4]
batch, bw, weight_bytes = int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
log = open(path, errors="replace").read()
params = float(re.search(r"\| ([0-9.]+)M parameters", log)[1]) * 1e6
tps = float(re.search(r"decode: \d+ tokens in [0-9.]+ ms = (\d+) tokens/s", log)[1])
bound = batch * bw / (weight_bytes * params)  # a step reads every weight once and makes `batch` tokens
print(f"| {name:<22} | {label:<35} | {tps:>12.0f} | {bound:>15.0f} | {100 * tps / bound:>5.1f}% |")
PY
}
cat data/inference/prompts.txt data/inference/prompts.txt | head -8 >"$out/prompts8.txt"  # a batch of 8
echo
echo "| GPU                    | stage 06 decode                     | tokens/s     | bandwidth bound | share |"
echo "|------------------------|-------------------------------------|--------------|-----------------|-------|"
for kernels in "" all; do
    export OPS_CUDA_KERNELS=$kernels
    decode "batch 1, fp32 weights" 1 4
    decode "batch 8, fp32 weights" 8 4
    decode "batch 1, bf16 weights" 1 2 --precision=bf16-mixed
    decode "batch 8, bf16 weights" 8 2 --precision=bf16-mixed
    decode "batch 1, fp32, CUDA graph" 1 4 --compile=true
done
unset OPS_CUDA_KERNELS
echo "bench-cuda: $SECONDS s"
