#!/usr/bin/env bash
# Stage 01 end to end: it learns (the loss falls steadily on a real alpaca file with GPT-2's
# tokenizer and on the built-in synthetic set), writes what DESIGN.md promises, and refuses bad
# input with one clear message and a non-zero exit.
source "$(dirname "$0")/lib.sh"
field() { python3 -c "import json,sys; print(' '.join(str(json.loads(l)[sys.argv[2]]) for l in open(sys.argv[1])))" "$1" "$2"; }
# mean of the first and of the last k values: the second must be below the first by a margin
falls() { python3 -c "
import sys; v=[float(x) for x in sys.argv[1].split()]; k=int(sys.argv[2]); a=sum(v[:k])/k; b=sum(v[-k:])/k
sys.exit(0 if b < a * float(sys.argv[3]) else 1)" "$1" "$2" "$3"; }

# 1. learns on the rasbt alpaca fixture with GPT-2's BPE (tiny model, 30 steps)
build/stage-1 --config configs/tiny.json --data_path=../shared/fixtures/alpaca/rasbt-LLMs-from-scratch_instruction-data.json \
    --tokenizer_path=../shared/fixtures/gpt2-tokenizer --max_seq_len=128 --n_embd=64 --n_layer=2 --stop_iteration=30 \
    --global_batch_size=8 --log_interval=10 --out_dir="$tmp/rasbt" >"$tmp/rasbt.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "rasbt run failed: $(tail -3 "$tmp/rasbt.log")"
losses=$(field "$tmp/rasbt/metrics.jsonl" loss)
check 'falls "$losses" 5 0.75' "the loss did not fall by 25% on the rasbt data: $losses"
check '[ "$(grep -c "^step" "$tmp/rasbt.log")" -eq 3 ]' "expected 3 progress lines (log_interval 10)"
check 'grep -q "tok/s" "$tmp/rasbt.log" && grep -q "eta" "$tmp/rasbt.log"' "the progress line lacks tok/s or eta"
check '[ -f "$tmp/rasbt/model.safetensors" ] && [ -f "$tmp/rasbt/config.json" ]' "no checkpoint written"
for key in step loss lr grad_norm tokens_per_sec; do
    check '[ -n "$(field "$tmp/rasbt/metrics.jsonl" $key)" ]' "metrics.jsonl lacks $key"
done

# 2. learns on the synthetic set with the byte tokenizer (the demo's data)
build/stage-1 --config configs/tiny.json --n_embd=64 --n_layer=2 --stop_iteration=40 --global_batch_size=8 \
    --out_dir="$tmp/synth" >"$tmp/synth.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "synthetic run failed: $(tail -3 "$tmp/synth.log")"
losses=$(field "$tmp/synth/metrics.jsonl" loss)
check 'falls "$losses" 5 0.7' "the loss did not fall by 30% on the synthetic set: $losses"

# 2b. starts from a Hugging Face checkpoint: the shape comes from its config.json
hf=../shared/fixtures/lm-buddy-fake_gpt2
build/stage-1 --config configs/tiny.json --init_from=$hf --tokenizer_path=$hf --max_seq_len=128 \
    --data_path=../shared/fixtures/alpaca/rasbt-LLMs-from-scratch_instruction-examples.json \
    --stop_iteration=3 --global_batch_size=2 --out_dir="$tmp/hf" >"$tmp/hf.log" 2>&1
rc=$?; check '[ $rc -eq 0 ] && grep -q "L=1 H=1 C=2 V=50257" "$tmp/hf.log"' "init_from the HF checkpoint: $(tail -3 "$tmp/hf.log")"

# 3. bad input: one message naming what is wrong, exit 1
expect_error() { expect_one_error "$1" "$2" build/stage-1 "${@:3}"; } # <description> <pattern> <args...>
echo '{"global_bach_size": 8}' >"$tmp/typo.json"
expect_error "unknown key" "unknown key 'global_bach_size' (did you mean 'global_batch_size'" --config "$tmp/typo.json"
echo '{"n_layer": "four"}' >"$tmp/type.json"
expect_error "wrong type" "key 'n_layer': expected an integer, found a string" --config "$tmp/type.json"
echo '{"lr": 1e-3,}' >"$tmp/broken.json"
expect_error "not JSON" "not valid JSON" --config "$tmp/broken.json"
expect_error "missing config" "cannot open $tmp/none.json" --config "$tmp/none.json"
expect_error "bf16 on stage 01" "command line: key 'precision' is 'bf16-mixed' but stage 01 trains in fp32 (32 or 32-true); bf16 and fp16 are stage 02" --config configs/tiny.json --precision=bf16-mixed
expect_error "bad shape" "n_embd must be divisible by n_head, found 130 and 4" --config configs/tiny.json --n_embd=130
expect_error "bad override" "expected a number, found 'fast'" --config configs/tiny.json --lr=fast
expect_error "unknown override" "unknown key 'lrate'" --config configs/tiny.json --lrate=1
expect_error "missing data" "cannot open $tmp/no.json" --config configs/tiny.json --data_path="$tmp/no.json"
expect_error "bad precision" "expected 32, 32-true, bf16-mixed, bf16, 16-mixed, fp8-tensorwise, fp8-rowwise or mxfp8, found 'fp8'" --config configs/tiny.json --precision=fp8
expect_error "diverging run" "step [0-9]*: the loss is" --config configs/tiny.json --n_layer=1 --n_embd=32 \
    --lr=1e30 --grad_clip=0 --warmup_steps=0 --stop_iteration=5 --out_dir="$tmp/nan"
expect_error "vocab mismatch" "has 50257 tokens but the tokenizer ('byte tokenizer') has 257" --config configs/tiny.json \
    --init_from=../shared/fixtures/lm-buddy-fake_gpt2 --max_seq_len=128
build/stage-1 --help >"$tmp/help" 2>&1
check '[ $? -eq 0 ] && grep -q -- "--global_batch_size" "$tmp/help" && grep -q -- "--tokenizer_path" "$tmp/help"' "--help does not list the keys"
finish test_stage1
