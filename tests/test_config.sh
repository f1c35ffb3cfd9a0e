#!/usr/bin/env bash
# The config's errors and the keys that choose code paths (common/config/config.c):
#  - an error names where the bad value came from: the file, the command line, or each of two;
#  - a second --config and an empty config file are errors, not silently something else;
#  - strategy: empty means the stage's own; another stage's strategy is refused with the stage
#    that runs it, on every rank of a parallel stage; a tensor-parallel grid needs axonn;
#  - tf32: refused by the CPU backend and by every stage but 01;
#  - dataset_id: the alpaca file in data_path, or the built-in synthetic set, or refused;
#  - every shipped config agrees with the stage that reads it.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
FIX=${FIXTURES:-../shared/fixtures}
ALPACA=$FIX/alpaca/rasbt-LLMs-from-scratch_instruction-examples.json
# run_config <out_dir> <key>: the key as the run resolved it (the checkpoint's run_config)
run_config() {
    python3 - "$1/model.safetensors" "$2" <<'PY'
import json, struct, sys
f = open(sys.argv[1], "rb")
header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
print(json.loads(header["__metadata__"]["run_config"])[sys.argv[2]])
PY
}
# train_one_step <name> <stage args...>: one optimizer step of stage 01, checked to exit 0
train_one_step() {
    build/stage-1 --config configs/tiny.json --stop_iteration=1 --eval_batches=1 --out_dir="$tmp/$1" "${@:2}" \
        >"$tmp/$1.log" 2>&1
    local rc=$?
    check '[ $rc -eq 0 ]' "stage 1 $1 failed (exit $rc): $(tail -3 "$tmp/$1.log")"
}

# ---- 1. errors name where the value came from -------------------------------------------------
expect_one_error "a bad override is the command line's" "^error: command line: key 'global_batch_size': expected a positive value, found -1" \
    build/stage-1 --config configs/tiny.json --global_batch_size=-1
echo '{"global_batch_size": -1}' >"$tmp/negative.json"
expect_one_error "bad file value" "^error: $tmp/negative.json: key 'global_batch_size'" build/stage-1 --config "$tmp/negative.json"
expect_one_error "two keys from two places" "^error: command line (n_embd), configs/tiny.json (n_head): keys 'n_embd' and 'n_head'" \
    build/stage-1 --config configs/tiny.json --n_embd=130
expect_one_error "second --config" "^error: command line: --config given twice ('configs/tiny.json' and 'configs/ddp.json')" \
    build/stage-1 --config configs/tiny.json --config=configs/ddp.json
expect_one_error "second --config (CONFIG_FILE does not count)" "given twice" \
    env CONFIG_FILE=configs/tiny.json build/stage-1 --config=configs/tiny.json --config configs/tiny.json
: >"$tmp/empty.json"
expect_one_error "empty config file" "^error: $tmp/empty.json: the file is empty" build/stage-1 --config "$tmp/empty.json"
printf ' \n\t\n' >"$tmp/blank.json"
expect_one_error "whitespace-only config file" "^error: $tmp/blank.json: the file is empty" build/stage-1 --config "$tmp/blank.json"
expect_one_error "--config without a file" "^error: command line: --config needs a file name" build/stage-1 --config

# ---- 2. strategy ------------------------------------------------------------------------------
expect_one_error "stage 01 given ddp" \
    "^error: command line: key 'strategy' is \"ddp\" but stage 01 runs \"single_device\"; run build/stage-3 for ddp" \
    build/stage-1 --config configs/tiny.json --strategy=ddp
expect_one_error "stage 01 given the ddp config" "^error: configs/ddp.json: key 'strategy' is \"ddp\" but stage 01" \
    build/stage-1 --config configs/ddp.json
expect_one_error "stage 02 given axonn" "stage 02 runs \"single_device\"; run build/stage-5 for axonn" \
    build/stage-2 --config configs/tiny.json --strategy=axonn
expect_one_error "stage 05 given single_device" "stage 05 runs \"axonn\"; run build/stage-1 for single_device" \
    build/stage-5 --config configs/tiny.json --strategy=single_device
expect_one_error "unknown strategy" "key 'strategy': expected single_device, ddp, fsdp, axonn, pipeline, expert_parallel, context_parallel or composed, found 'zero3'" \
    build/stage-1 --config configs/tiny.json --strategy=zero3
expect_one_error "cp_size on stage 01" "key 'cp_size' is 2 but strategy \"single_device\" does not split sequences" \
    build/stage-1 --config configs/tiny.json --cp_size=2
expect_one_error "an unknown cp_impl" "key 'cp_impl': expected ring or ulysses, found 'star'" \
    build/stage-1 --config configs/tiny.json --cp_impl=star
expect_one_error "stage 06 given fsdp" "stage 06 runs \"axonn\" or \"single_device\"; run build/stage-4 for fsdp" \
    build/stage-6 --config configs/inference.json --strategy=fsdp
expect_one_error "a grid without axonn" "key 'tp_dimensions' is \[2, 1, 1\] but strategy \"single_device\" does not split layers" \
    build/stage-6 --config configs/inference.json --strategy=single_device --tp_dimensions=2,1,1
expect_one_error "a grid on stage 01" "key 'tp_dimensions' is \[1, 2, 1\] but strategy \"single_device\"" \
    build/stage-1 --config configs/tiny.json --tp_dimensions=1,2,1
# tf32 is stage 01's lesson on a GPU: the CPU backend has no TF32 (it would multiply in f32 and say
# nothing), the other stages keep their f32; refused before anything is written, on every rank
expect_one_error "tf32 on the CPU backend" "^error: tf32: the CPU backend has no TF32 matmuls" \
    build/stage-1 --config configs/tiny.json --tf32=true --out_dir="$tmp/tf32cpu"
check '[ ! -e "$tmp/tf32cpu" ]' "stage 01 refused tf32 but left $tmp/tf32cpu behind"
expect_one_error "tf32 on stage 03, 3 ranks" "^error: command line: key 'tf32' is true but stage 03 keeps its f32 matmuls in f32" \
    timeout --kill-after=5 60 mpirun -np 3 --bind-to none build/stage-3 --config configs/tiny.json --tf32=true --out_dir="$tmp/tf32s3"
check '[ ! -e "$tmp/tf32s3" ]' "stage 03 refused tf32 but left $tmp/tf32s3 behind"
# every rank checks (rank 0 speaks for the job, the others stop too: mpirun exits 1, no output)
expect_one_error "stage 03 on 2 ranks given fsdp" \
    "^error: command line: key 'strategy' is \"fsdp\" but stage 03 runs \"ddp\"; run build/stage-4 for fsdp" \
    bounded 60 mpirun -np 2 --bind-to none build/stage-3 --config configs/tiny.json --strategy=fsdp --out_dir="$tmp/s3fsdp"
check '[ ! -e "$tmp/s3fsdp" ]' "stage 03 refused fsdp but left $tmp/s3fsdp behind"
# a rank refuses on its own, not only because rank 0 did: here only rank 1 is given fsdp
expect_one_error "stage 03, fsdp on rank 1 only" "^error (rank 1): command line: key 'strategy' is \"fsdp\"" \
    bounded 60 mpirun --bind-to none -np 1 build/stage-3 --config configs/tiny.json --out_dir="$tmp/s3r1" \
    : -np 1 build/stage-3 --config configs/tiny.json --strategy=fsdp --out_dir="$tmp/s3r1"
# empty means the stage's own, and the run records what it ran
train_one_step own
check '[ "$(run_config "$tmp/own" strategy)" = single_device ]' "stage 01 did not record strategy single_device"
bounded 120 mpirun -np 2 --bind-to none build/stage-3 --config configs/tiny.json --stop_iteration=1 --eval_batches=1 \
    --out_dir="$tmp/ddp" >"$tmp/ddp.log" 2>&1
rc=$?; check '[ $rc -eq 0 ] && [ "$(run_config "$tmp/ddp" strategy)" = ddp ]' \
    "stage 03 on configs/tiny.json did not run as ddp (exit $rc): $(tail -3 "$tmp/ddp.log")"

# ---- 3. dataset_id ----------------------------------------------------------------------------
expect_one_error "alpaca without a file" "^error: command line: key 'dataset_id' is \"tatsu-lab/alpaca\", an alpaca JSON file, but data_path is empty" \
    build/stage-1 --config configs/tiny.json --dataset_id=tatsu-lab/alpaca
expect_one_error "synthetic with a file" "key 'dataset_id' is \"synthetic\" (the built-in set) but data_path is '$ALPACA'" \
    build/stage-1 --config configs/tiny.json --dataset_id=synthetic --data_path="$ALPACA"
expect_one_error "unknown dataset" "key 'dataset_id': expected tatsu-lab/alpaca or alpaca .*, found 'squad'" \
    build/stage-1 --config configs/tiny.json --dataset_id=squad
check '[ "$(run_config "$tmp/own" dataset_id)" = synthetic ]' "no data_path did not record dataset_id synthetic"
train_one_step tatsu --dataset_id=tatsu-lab/alpaca --data_path="$ALPACA" --max_seq_len=128
check '[ "$(run_config "$tmp/tatsu" dataset_id)" = tatsu-lab/alpaca ] && grep -q "data: 190 train / 10 validation" "$tmp/tatsu.log"' \
    "tatsu-lab/alpaca did not train on $ALPACA: $(grep data: "$tmp/tatsu.log")"
train_one_step file --data_path="$ALPACA" --max_seq_len=128
check '[ "$(run_config "$tmp/file" dataset_id)" = alpaca ]' "a data_path alone did not record dataset_id alpaca"

# ---- 4. the shipped configs agree with their stages: validation gets past strategy and data to
# a key set wrong on purpose (so nothing starts)
for pair in 1:single_gpu 2:mixed_precision 3:ddp 4:fsdp 5:axonn 6:inference 6:inference_axonn 7:pipeline \
            10:composed 1:tiny 2:tiny 3:tiny 4:tiny 5:tiny 6:tiny 7:tiny 10:tiny 1:bench_gpt2 6:bench_gpt2; do
    IFS=: read -r n config <<<"$pair"
    expect_one_error "stage $n with configs/$config.json" "^error: command line: key 'num_epochs'" \
        bounded 60 "build/stage-$n" --config "configs/$config.json" --num_epochs=0
done
check '! grep -q "\"strategy\"" configs/tiny.json configs/bench_gpt2.json' "a config every stage reads names a strategy"
finish test_config
