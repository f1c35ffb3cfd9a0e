#!/usr/bin/env bash
# make demo: every stage that exists, on the embedded default (configs/tiny.json: a small GPT
# trained on the built-in synthetic instruction set, CPU backend), a few minutes in all.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}

# every demo starts from scratch: a second make demo would otherwise resume each finished run
# from its out_dir (resume=auto, docs/CLUSTER.md "Resume") and train no step
rm -rf out/demo-stage-*

say() { printf '\n\033[1m== %s\033[0m\n%s\n\n' "$1" "$2"; }

say "What the model learns from" \
"Each training record is an instruction in the Alpaca template. Only the response (after
'### Response:') carries loss; the prompt is context. Here is one record, token by token:"
build/tokenize --record 0 --max-seq-len 256 | sed -n 1,30p  # sed reads it all: no SIGPIPE under pipefail

say "Stage 01: one process trains a GPT from scratch" \
"Watch the loss (over the answers only) fall from ln(257) = 5.55, a uniform guess over 257 byte
tokens: first the answers' form and counting, then, over a few hundred steps, the attention that
finds the digits in the prompt. 'val' is the loss on held-out records. About 2.5 minutes."
build/stage-1 --config configs/tiny.json --out_dir=out/demo-stage-1

echo
echo "The checkpoint is in out/demo-stage-1/ (model.safetensors + config.json, Hugging Face format)."

say "Stage 02: the same run with bf16 matmuls" \
"Watch the memory report (the bf16 copy of the weights, the smaller activations) and the
loss: it follows stage 01's closely but not exactly, because bf16 rounding is real. 50 steps."
build/stage-2 --config configs/tiny.json --precision=bf16-mixed --stop_iteration=50 --log_interval=10 --out_dir=out/demo-stage-2

say "Stage 03: four ranks, one model (data parallelism)" \
"Four processes each take a quarter of every global batch and add up their gradients with one
all-reduce. Watch the loss: it is stage 01's, step for step, to about 8 digits (compare step 50
with stage 01's), and the table at the end: one all-reduce of all gradients per step."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/stage-3 --config configs/tiny.json \
    --stop_iteration=50 --log_interval=10 --trace=true --out_dir=out/demo-stage-3

say "Stage 04: four ranks, each holding a quarter of the model (FSDP)" \
"Before step 1, compare the per-rank memory with DDP's: parameters, gradients and AdamW state
are split four ways, and each block is gathered just before it is used. The loss is again
stage 01's (compare steps 10 and 20 with stage 03's). 20 steps."
mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/stage-4 --config configs/tiny.json \
    --stop_iteration=20 --log_interval=10 --trace=true --out_dir=out/demo-stage-4

say "Stage 05: one model cut over a 2 x 2 grid of ranks (AxoNN tensor parallelism)" \
"Every linear layer is split: out-features over x, in-features over y. Watch the table at the
end: all-reduces over the x and y groups in every layer, and still stage 01's loss. 20 steps."
mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/stage-5 --config configs/tiny.json \
    --tp_dimensions=2,2,1 --stop_iteration=20 --log_interval=10 --trace=true --out_dir=out/demo-stage-5

say "Stage 07: the blocks split into 2 pipeline stages, times 2 data-parallel replicas" \
"Stage 0 holds the embedding and block 0, stage 1 block 1 and the head; 4 micro-batches flow
through them in the 1F1B order. Watch each rank's op sequence after step 1 (F/B: forward and
backward of a micro-batch, r/s: received and sent), the measured bubble beside (p-1)/(m+p-1),
and again stage 01's loss. 20 steps."
mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/stage-7 --config configs/tiny.json \
    --pp_size=2 --num_microbatches=4 --stop_iteration=20 --log_interval=10 --trace=true --out_dir=out/demo-stage-7

say "Stage 08: a mixture of experts, 4 experts spread over 2 ranks, times 2 replicas" \
"Each block's MLP is 4 MLPs and a router that sends every token to its 2 most probable experts.
A token's row travels to the rank holding its expert and back (two all-to-alls per block, and
two more in backward). Watch the rows each expert ran and the dropped pairs (over the capacity)
in each line, the load-balancing loss (aux; 2 is perfectly balanced for top-2), and the
all-to-all rows of the table at the end. 20 steps."
mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/stage-8 --config configs/moe.json \
    --ep_size=2 --stop_iteration=20 --log_interval=10 --trace=true --out_dir=out/demo-stage-8

say "Stage 09: context parallelism, each sequence split over 2 ranks, times 2 replicas" \
"Each sequence is cut into 4 chunks; a rank holds one early and one late chunk, so that under the
causal mask both ranks have the same attention work. Every op but attention runs on the chunks
alone; attention passes keys and values around the ring of the 2 ranks, while the rank computes
with the block it holds. Watch stage 01's loss again, and the send-recv rows of the table at the
end: the ring's bytes. 20 steps."
mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/stage-9 --config configs/tiny.json \
    --cp_size=2 --overlap_communication=true --stop_iteration=20 --log_interval=10 --trace=true --out_dir=out/demo-stage-9

say "Stage 10: the techniques composed, tensor pairs inside 2 pipeline stages" \
"The 4 ranks form a mesh: ranks 0 and 1 split every linear of pipeline stage 0 (tensor
parallelism, innermost: on a cluster, the same host), ranks 2 and 3 those of stage 1. Watch the
mesh the run prints first (its order, and why tensor parallelism is innermost), then the table at
the end: the x group's all-reduces in every layer, the pipeline's send-recv at the stage edge, the
tied embedding's all-reduce between the first and last stage. The loss is stage 01's. 20 steps."
mpirun -np 4 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 build/stage-10 --config configs/tiny.json \
    --tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2 --stop_iteration=20 --log_interval=10 --out_dir=out/demo-stage-10

say "Stage 06: the model from stage 01 answers questions it never saw" \
"Generation with a KV cache: each batch of prompts is read in one pass (prefill), then every
step adds one token per prompt, reading the earlier tokens' keys and values from the cache
(decode). The prompts are the held-out records of the instruction set; an answer counts only
if it is exactly right. Watch the accuracy, and prefill vs decode tokens/s."
build/stage-6 --config configs/inference.json --init_from=out/demo-stage-1 --eval_accuracy=true --max_batch_size=16

say "Ask it yourself" \
"One question per line; a tab separates the instruction from its input (the Alpaca record's two
fields). Try other digits, or a task it never saw."
questions='Sort the digits.\t8302\nFind the smallest digit.\t97531\n'
echo "\$ printf '$questions' | build/stage-6 --config configs/inference.json --prompts_path=-"
# shellcheck disable=SC2059  # the format is the questions: printf turns \t and \n into the real bytes
printf "$questions" | build/stage-6 --config configs/inference.json --init_from=out/demo-stage-1 --prompts_path=- |
    sed -n '/User:/,/tokens,/p'  # the answers, without the timing table

say "The report: every run above on one page" \
"Open it in a browser (it is a file; no server): first every run side by side in one table; then
the loss of every layout over the steps they all trained, one curve, and each run's relative
difference from stage 01 (near fp32's rounding for the parallel layouts, bf16's for stage 02;
stage 08 is another model); memory by category; and per run its communication with bus
bandwidth and how much of it overlapped compute, measured from its trace (open trace.json in
ui.perfetto.dev)."
python3 tools/report.py -o out/demo-report out/demo-stage-1 out/demo-stage-2 out/demo-stage-3 out/demo-stage-4 \
    out/demo-stage-5 out/demo-stage-7 out/demo-stage-8 out/demo-stage-9
echo "open file://$PWD/out/demo-report/index.html"
