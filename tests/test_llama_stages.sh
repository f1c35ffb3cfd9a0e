#!/usr/bin/env bash
# Llama (configs/tiny_llama.json: RMSNorm, SwiGLU, rotary over the whole head, grouped-query
# attention with 2 key/value heads for 4 query heads, untied lm_head) in stages 01-05 and 07:
#  - DDP on 2 and 4 ranks, FSDP on 2 and 3 ranks, tensor parallelism on [2,1,1], [2,2,1]
#    (RMSNorm's sums all-reduced over y), [1,1,2] and [2,1,1] x data 2, and a pipeline of 2 stages
#    reproduce stage 01's per-step losses within 1e-5 relative over 20 steps (a global batch of
#    12, which 2, 3 and 4 ranks divide);
#  - stage 02 (bf16-mixed) stays within 1e-2 of stage 01 (bf16 rounds every matmul input);
#  - stage 01 saves a checkpoint that it starts from again (LlamaForCausalLM's config.json);
#  - key/value heads that do not split over the tensor-parallel x dimension are refused by name.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
args=(--config configs/tiny_llama.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_embd=64
      --intermediate_size=172 --global_batch_size=12)

run_single 1 single
run_ranks 3 ddp2 2
run_ranks 3 ddp4 4
run_ranks 4 fsdp2 2
run_ranks 4 fsdp3 3
run_ranks 5 tp211 2 --tp_dimensions=2,1,1
run_ranks 5 tp221 4 --tp_dimensions=2,2,1
run_ranks 5 tp112 2 --tp_dimensions=1,1,2
run_ranks 5 tp211d2 4 --tp_dimensions=2,1,1
run_ranks 7 pp2 2 --pp_size=2 --num_microbatches=4
for name in ddp2 ddp4 fsdp2 fsdp3 tp211 tp221 tp112 tp211d2 pp2; do
    check 'compare_losses "$tmp/single" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01's Llama losses"
done
run_single 2 bf16 --precision=bf16-mixed
check 'compare_losses "$tmp/single" "$tmp/bf16" 20 1e-2 0.25' "stage 02 bf16-mixed strays from stage 01's Llama losses"

# stage 01 starts from its own checkpoint (an lr of 1e-30 keeps the weights): the validation loss it
# saved with is the one it measures
run_single 1 reload --init_from="$tmp/single" --stop_iteration=1 --lr=1e-30 --min_lr=0
check 'python3 -c "
import json, sys
a = json.loads(open(sys.argv[1]).readlines()[-1])[\"val_loss\"]
b = json.loads(open(sys.argv[2]).readlines()[-1])[\"val_loss\"]
sys.exit(0 if abs(a - b) <= 1e-5 * abs(a) else 1)" "$tmp/single/metrics.jsonl" "$tmp/reload/metrics.jsonl"' \
    "Llama: stage 01 from its own checkpoint has another validation loss: $(tail -1 "$tmp/reload/metrics.jsonl")"

expect_one_error "key/value heads that do not split over x" 'n_kv_head.*x' \
    mpirun -np 4 --bind-to none $STAGE_BIN/stage-5 "${args[@]}" --tp_dimensions=4,1,1 --out_dir="$tmp/tp411"

finish test_llama_stages
