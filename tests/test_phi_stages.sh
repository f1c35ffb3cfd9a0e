#!/usr/bin/env bash
# phi (configs/tiny_phi.json: parallel block, rotary, untied lm_head with bias) in stages 01-07:
#  - DDP on 2 and 4 ranks, FSDP on 2 and 3 ranks, tensor parallelism on [2,1,1], [2,2,1],
#    [1,1,2] and [2,1,1] x data 2, and pipelines of 2 stages (1F1B, and GPipe x data 2)
#    reproduce stage 01's per-step losses within 1e-5 relative over 20 steps (FSDP on 3 ranks:
#    batch 12, whose shards end in padding); the pipeline's checkpoint loads in stage 01;
#  - stage 02 (bf16-mixed) stays within 1e-2 of stage 01 (bf16 rounds every matmul input);
#  - stage 06 generates from stage 01's phi checkpoint (seeded sampling, which walks through varied
#    text): the KV cache gives the tokens of no cache, and [2,1,1] and [2,2,1] those of one rank;
#  - a phi checkpoint with a missing tensor, a wrong shape or an option we do not implement
#    (qk_layernorm, another activation, grouped-query attention) is one clear error naming it, as
#    is an added token (CodeGen's tokenizer) whose id does not follow the vocabulary.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
args=(--config configs/tiny_phi.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_embd=64)

run_single 1 single
run_single 1 single12 --stop_iteration=5 --global_batch_size=12
run_ranks 3 ddp2 2
run_ranks 3 ddp4 4
run_ranks 4 fsdp2 2
run_ranks 4 fsdp3 3 --stop_iteration=5 --global_batch_size=12
run_ranks 5 tp211 2 --tp_dimensions=2,1,1
run_ranks 5 tp221 4 --tp_dimensions=2,2,1
run_ranks 5 tp112 2 --tp_dimensions=1,1,2
run_ranks 5 tp211data2 4 --tp_dimensions=2,1,1
# pipelines: the last stage holds phi's own lm_head (no tied wte to share with the first)
run_ranks 7 pp2 2 --pp_size=2 --num_microbatches=4
run_ranks 7 pp2data2 4 --pp_size=2 --num_microbatches=2 --pp_schedule=gpipe
for name in ddp2 ddp4 fsdp2 tp211 tp221 tp112 tp211data2 pp2 pp2data2; do
    check 'compare_losses "$tmp/single" "$tmp/$name" 20 1e-5' "$name does not reproduce stage 01's phi losses"
done
check 'compare_losses "$tmp/single12" "$tmp/fsdp3" 5 1e-5' "fsdp3 does not reproduce stage 01's phi losses"
# the pipeline's checkpoint (each stage's tensors, lm_head from the last) is the whole model: stage
# 01 loads it (an lr of 1e-30 keeps the weights) and its validation loss is the pipeline's last
run_single 1 load_pp2 --init_from="$tmp/pp2" --stop_iteration=1 --lr=1e-30 --min_lr=0
check 'python3 -c "
import json, sys
a = json.loads(open(sys.argv[1]).readlines()[-1])[\"val_loss\"]
b = json.loads(open(sys.argv[2]).readlines()[-1])[\"val_loss\"]
sys.exit(0 if abs(a - b) <= 1e-5 * abs(a) else 1)" "$tmp/pp2/metrics.jsonl" "$tmp/load_pp2/metrics.jsonl"' \
    "phi: stage 01 from the pipeline's checkpoint has another validation loss: $(tail -1 "$tmp/load_pp2/metrics.jsonl")"
run_single 2 bf16 --precision=bf16-mixed
check 'compare_losses "$tmp/single" "$tmp/bf16" 20 1e-2 0.25' "stage 02 bf16-mixed strays from stage 01's phi losses"

# ---- stage 06: a phi checkpoint generates; KV cache = no cache; tensor-parallel = one rank -------
printf 'Sort the digits.\nCount the letters in this rather long sentence, please.\nHi\n' >"$tmp/prompts.txt"
gen=(--config configs/inference.json --init_from="$tmp/single" --prompts_path="$tmp/prompts.txt"
     --tokens_to_generate=16 --show_token_ids=true --max_batch_size=3 --temperature=1 --seed=7)
bounded 120 build/stage-6 "${gen[@]}" >"$tmp/gen.log" 2>&1
rc=$?; check '[ $rc -eq 0 ] && [ "$(answer_ids gen | wc -l)" -eq 3 ]' "stage 06 on phi failed: $(tail -3 "$tmp/gen.log")"
bounded 120 build/stage-6 "${gen[@]}" --kv_cache=false >"$tmp/nocache.log" 2>&1
check '[ "$(answer_ids gen)" = "$(answer_ids nocache)" ]' "phi: KV cache and no cache differ: $(diff <(answer_ids gen) <(answer_ids nocache) | head -4)"
for grid in 2,1,1:2 2,2,1:4; do
    dims=${grid%:*} np=${grid#*:}
    bounded 120 mpirun -np "$np" --bind-to none build/stage-6 "${gen[@]}" --tp_dimensions="$dims" >"$tmp/gen$dims.log" 2>&1
    check '[ -n "$(answer_ids gen)" ] && [ "$(answer_ids "gen$dims")" = "$(answer_ids gen)" ]' \
        "phi: stage 06 [$dims] differs from one rank: $(diff <(answer_ids gen) <(answer_ids "gen$dims") | head -4; tail -2 "$tmp/gen$dims.log")"
done

# ---- bad checkpoints: stage 01's saved phi model, edited -----------------------------------------
ckpt=$tmp/single
edit_config() { # edit_config <name> <python statement on c>: a copy of the checkpoint, config edited
    mkdir -p "$tmp/$1" && cp "$ckpt/model.safetensors" "$tmp/$1/"
    python3 -c "import json,sys; c = json.load(open(sys.argv[1])); $2; json.dump(c, open(sys.argv[2], 'w'))" \
        "$ckpt/config.json" "$tmp/$1/config.json"
}
edit_tensors() { # edit_tensors <name> <python statement on h (the safetensors header)>
    mkdir -p "$tmp/$1" && cp "$ckpt/config.json" "$tmp/$1/"
    python3 - "$ckpt/model.safetensors" "$tmp/$1/model.safetensors" "$2" <<'PY'
import json, struct, sys
blob = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", blob[:8])
h = json.loads(blob[8:8 + n])
exec(sys.argv[3])
head = json.dumps(h).encode()
head += b" " * (-len(head) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(head)) + head + blob[8 + n:])
PY
}
load() { build/stage-1 "${args[@]}" --stop_iteration=1 --init_from="$tmp/$1" --out_dir="$tmp/$1.out"; }

mkdir -p "$tmp/good" && cp "$ckpt/model.safetensors" "$ckpt/config.json" "$tmp/good/"
load good >"$tmp/good.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 01 does not start from its own phi checkpoint: $(tail -3 "$tmp/good.log")"
edit_config qk 'c["qk_layernorm"] = True'
expect_one_error "qk_layernorm" 'qk_layernorm.*not implemented' load qk
edit_config act 'c["hidden_act"] = "gelu"'
expect_one_error "another activation" 'hidden_act.*gelu_new.*found gelu' load act
edit_config gqa 'c["num_key_value_heads"] = 1'
expect_one_error "grouped-query attention" 'num_key_value_heads' load gqa
edit_tensors missing 'h["renamed.fc1.weight"] = h.pop("model.layers.1.mlp.fc1.weight")'
expect_one_error "a missing tensor" 'model.layers.1.mlp.fc1.weight.*is missing' load missing
edit_tensors shape 'h["lm_head.bias"]["shape"] = [1, h["lm_head.bias"]["shape"][0]]'
expect_one_error "a wrong shape" 'lm_head.bias has shape' load shape

# ---- bad added tokens: the CodeGen tokenizer's added_tokens.json must follow the vocabulary ------
mkdir -p "$tmp/tok"
ln -s "$(realpath "${FIXTURES:-../shared/fixtures}/gpt2-tokenizer/encoder.json")" "$tmp/tok/vocab.json"
ln -s "$(realpath "${FIXTURES:-../shared/fixtures}/gpt2-tokenizer/vocab.bpe")" "$tmp/tok/merges.txt"
printf 'a  b' >"$tmp/text.txt"
printf '{"  ": 50260}' >"$tmp/tok/added_tokens.json"
expect_one_error "an added token's id leaves a gap" 'added_tokens.json: added token "  " has id 50260; expected 50257' \
    build/tests/test_phi --encode "$tmp/tok" "$tmp/text.txt"
printf '{"  ": 50257}' >"$tmp/tok/added_tokens.json"
check '[ "$(build/tests/test_phi --encode "$tmp/tok" "$tmp/text.txt")" = "[64, 50257, 65]" ]' \
    "an added token is not matched before BPE: $(build/tests/test_phi --encode "$tmp/tok" "$tmp/text.txt" 2>&1)"

finish test_phi_stages
