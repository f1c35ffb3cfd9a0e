#!/usr/bin/env bash
# Stage 10 with LoRA (10_composed/composed_lora.h: 05's adapter slices of each pipeline stage's
# blocks) under mpirun:
#  - GPT-2 on dp 2 x tp 2 x pp 2 (8 ranks) with adapters on every block linear (column- and
#    row-parallel) and lora_dropout 0.1 reproduces stage 01's LoRA run (loss, grad_norm, val_loss)
#    within 1e-5 relative over 20 steps and saves its adapter (PEFT's files: the same tensors,
#    names, shapes and config, values within 1e-5), put together from both stages and both x ranks;
#    its memory report holds gradients and AdamW moments of the adapters' slices only;
#  - Llama (fused q, k, v and gate, up; grouped-query attention) on tp 2 x pp 2, 3 blocks split 2, 1,
#    the same against stage 01, adapter included;
#  - bf16-mixed GPT-2 on dp 2 x tp 2 x pp 2 against stage 02's LoRA run within stage 03's bound;
#  - LoRA with cp_size > 1: one error naming the key, every rank stops.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
common=(--stop_iteration=20 --eval_batches=1 --log_interval=100 --n_embd=64 --lora_rank=4 --lora_alpha=8)
mesh=(--tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2)

args=(--config configs/tiny.json "${common[@]}" --n_layer=2 --lora_targets=c_attn,c_proj,c_fc --lora_dropout=0.1)
run_single 1 single_gpt2
run_ranks 10 d2t2p2_gpt2 8 "${mesh[@]}"
check 'compare_losses "$tmp/single_gpt2" "$tmp/d2t2p2_gpt2" 20 1e-5' "GPT-2 LoRA on dp 2 x tp 2 x pp 2 strays from stage 01's"
check 'same_adapter "$tmp/single_gpt2" "$tmp/d2t2p2_gpt2"' "GPT-2 LoRA on dp 2 x tp 2 x pp 2 saved another adapter than stage 01's"
check '[ ! -e "$tmp/d2t2p2_gpt2/model.safetensors" ] && grep -q "replicas identical on all 2 ranks" "$tmp/d2t2p2_gpt2.log"' \
    "the LoRA run saved the base, or its replicas' adapters differ"
check 'python3 - "$tmp/d2t2p2_gpt2/stats.json" <<'"'PY'"'
import json, sys
mem = json.load(open(sys.argv[1]))["memory"]
adapters = mem["gradients (fp32)"]  # rank 0's slices of its stage's adapters: the base has no gradients
sys.exit(0 if mem["AdamW m and v (fp32)"] == 2 * adapters and 0 < adapters * 5 < mem["parameters (fp32)"] - adapters else 1)
PY' "stage 10 LoRA's memory report counts the base's gradients or moments: $(head -c 600 "$tmp/d2t2p2_gpt2/stats.json")"

args=(--config configs/tiny_llama.json "${common[@]}" --n_layer=3 --intermediate_size=172
      --lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)
run_single 1 single_llama
run_ranks 10 t2p2_llama 4 "${mesh[@]}"
check 'compare_losses "$tmp/single_llama" "$tmp/t2p2_llama" 20 1e-5' "Llama LoRA on tp 2 x pp 2 strays from stage 01's"
check 'same_adapter "$tmp/single_llama" "$tmp/t2p2_llama"' "Llama LoRA on tp 2 x pp 2 saved another adapter than stage 01's"

args=(--config configs/tiny.json "${common[@]}" --n_layer=2 --lora_targets=c_attn,c_proj,c_fc --precision=bf16-mixed)
run_single 2 single_bf16
run_ranks 10 d2t2p2_bf16 8 "${mesh[@]}"
check 'compare_losses "$tmp/single_bf16" "$tmp/d2t2p2_bf16" 20 1e-3' "bf16-mixed LoRA on dp 2 x tp 2 x pp 2 strays from stage 02's"

expect_one_error "LoRA beside cp" "key 'cp_size' is 2 but lora_rank is 4" \
    timeout --kill-after=5 120 mpirun -np 4 --bind-to none "$STAGE_BIN/stage-10" "${args[@]}" --precision=32 "${mesh[@]}" \
    --tp_dimensions=1,1,1 --cp_size=2 --out_dir="$tmp/bad"

finish test_stage10_lora
