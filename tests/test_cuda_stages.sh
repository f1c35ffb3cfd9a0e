#!/usr/bin/env bash
# Every stage's equivalence tests on the CUDA backend (build/cuda/): the runs of test_stage2.sh ..
# test_stage9.sh and test_phi_stages.sh that must reproduce a single process's loss curve (or its
# generated tokens), here on GPUs, with those tests' tolerances (fp32: 1e-5 relative at every step;
# bf16: their documented looser bounds). GPU against GPU: a GPU adds floats in another order than
# the CPU, so the references are single-process runs on the GPU (tests/test_ops_cuda.sh holds stage
# 01 on the GPU against the CPU).
#   - every stage runs on 1 GPU, and every layout of 2-4 ranks runs too: over NCCL, one rank a GPU,
#     where that many GPUs are visible, else with the ranks sharing the GPUs, which moves the bytes
#     over MPI through pinned host memory (comm.h comm_select_backend; each run's banner must say
#     which); section share: more ranks than GPUs choose MPI by themselves and say why, and
#     comm_backend=nccl is refused there;
#   - stage 06's server sizes its KV cache pool as a share of the GPU's free memory
#     (kv_cache_memory_fraction, section 6): the blocks that share of what it measured holds, and
#     nvidia-smi sees the GPU that much fuller;
#   - traces (section trace): valid with CUDA-event spans, and stage 03's bucket all-reduces overlap
#     the backward on the GPU's clock with overlap_communication, not without;
#   - sections paged, llama, lora: the CPU suite's tests of the serving engine, Llama and LoRA,
#     run on the CUDA binaries;
#   - without a GPU: one SKIPPED line, nothing counted (test_ops_cuda.sh checks the build and the
#     no-device error there).
# Usage: tests/test_cuda_stages.sh [section ...]   sections 1 2 3 4 5 6 7 8 9 phi trace share paged llama lora;
#   default: all
# A dry run of this script's logic where there is no GPU: the CPU binaries, as if G GPUs were
# visible (it checks the script, not the CUDA backend); the layouts that would share a GPU run
# through the same MPI path with comm_backend=mpi-staged (memcpy for the staging copies):
#   STAGE_BIN=build/cpu TEST_GPUS=G bash tests/test_cuda_stages.sh
STAGE_BIN=${STAGE_BIN:-build/cuda}
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
name=test_cuda_stages
STAGES="1 2 3 4 5 6 7 8 9"
SECTIONS="$STAGES phi trace share paged llama lora"
[ $# -gt 0 ] || set -- $SECTIONS
for section in "$@"; do
    case " $SECTIONS " in
        *" $section "*) ;;
        *) echo "unknown section '$section': the sections are $SECTIONS" >&2; exit 2 ;;
    esac
done
gpus=${TEST_GPUS:-$(visible_gpus)}

if [ "$gpus" -eq 0 ]; then
    echo "$name: SKIPPED: no GPU visible (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them): no stage ran on the CUDA backend"
    finish "$name"
    exit
fi

# the CUDA binaries, up to date (make has nothing to do after `make test-cuda`); a dry run names
# binaries already built
if [ "$STAGE_BIN" = build/cuda ] && command -v "${NVCC:-nvcc}" >/dev/null 2>&1; then
    make --no-print-directory BACKEND=cuda $(printf 'build/cuda/stage-%s ' $STAGES) >"$tmp/build.log" 2>&1
    rc=$?
    check '[ $rc -eq 0 ]' "the CUDA build failed: $(grep -E "error|undefined" "$tmp/build.log" | head -6)"
fi
missing=$(for n in $STAGES; do [ -x "$STAGE_BIN/stage-$n" ] || printf ' %s' "$STAGE_BIN/stage-$n"; done)
if [ -n "$missing" ]; then
    echo "$name: SKIPPED: no binaries to run:$missing (nvcc not found, or the build failed; make test-cuda builds them)"
    finish "$name"
    exit
fi
echo "$gpus GPU(s)${TEST_GPUS:+ (pretended: TEST_GPUS)}: layouts of up to $gpus rank(s) run over NCCL, larger ones (up to 4 ranks) share the GPUs over MPI; binaries in $STAGE_BIN/"

# on_ranks <stage> <run> <ranks> [args...]: run_ranks, and a check that the run's banner names
# the backend this many ranks must use: NCCL where each has a GPU of its own, MPI where they share.
# A dry run (the CPU binaries, which always use MPI) sends the shared layouts through MPI's staged
# path, the one ranks sharing a GPU take, with memcpy for the staging copies.
on_ranks() {
    local stage=$1 run=$2 np=$3 want=NCCL
    shift 3
    [ "$np" -gt "$gpus" ] && want=MPI
    if [ -z "${TEST_GPUS:-}" ]; then
        run_ranks "$stage" "$run" "$np" "$@"
    elif [ "$want" = MPI ]; then
        COMM_BACKEND=mpi-staged run_ranks "$stage" "$run" "$np" "$@"
        want="MPI, staged"
    else
        run_ranks "$stage" "$run" "$np" "$@"
        want=MPI
    fi
    check 'grep -q "^communication: $want" "$tmp/$run.log"' \
        "stage $stage $run on $np rank(s), $gpus GPU(s): the banner does not say '$want': $(grep -a -m1 '^communication' "$tmp/$run.log")"
}

# layout <stage> <run> <ranks> <reference> <steps> <tolerance> [args...]: stage <stage> on <ranks>
# ranks gives the reference run's loss at each of <steps> steps, within the relative tolerance
layout() {
    local stage=$1 run=$2 np=$3 ref=$4 steps=$5 tol=$6
    shift 6
    on_ranks "$stage" "$run" "$np" "$@"
    check 'compare_losses "$tmp/$ref" "$tmp/$run" $steps $tol' \
        "stage $stage $run on $np rank(s), $gpus GPU(s) does not reproduce $ref within $tol"
}

# generates_like <run> <ranks> <reference> [args...]: stage 06 on <ranks> ranks generates exactly the
# reference run's tokens (a sampled token changes only if the logits differ by about a millionth)
generates_like() {
    local run=$1 np=$2 ref=$3
    shift 3
    on_ranks 6 "$run" "$np" "$@"
    check '[ -n "$(answer_ids "$ref")" ] && [ "$(answer_ids "$run")" = "$(answer_ids "$ref")" ]' \
        "stage 06 $run on $np rank(s) generates other tokens than $ref: $(diff <(answer_ids "$ref") <(answer_ids "$run") | head -4)"
}

loss_lines() { grep -o '"loss": [^,]*' "$tmp/$1/metrics.jsonl" 2>/dev/null; }
# same_losses <run> <run>: both runs logged losses, and the same ones to the last bit (two runs
# that logged nothing are no evidence)
same_losses() { [ -n "$(loss_lines "$1")" ] && cmp -s <(loss_lines "$1") <(loss_lines "$2"); }

# the shape test_stage3/4/5/7.sh train (tiny.json's 2 layers, narrower)
small=(--config configs/tiny.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_embd=64)

# stage 01 is every other stage's reference: its reductions have a fixed order (no atomics), so
# two runs on the GPU give the same losses to the last bit
section_1() {
    args=("${small[@]}")
    run_single 1 s1_a
    run_single 1 s1_b
    check 'same_losses s1_a s1_b' "stage 01 twice on the GPU: other losses"
}

# stage 02 (test_stage2.sh): precision 32 is stage 01 bit for bit; bf16-mixed within 2% and not
# identical (the rounding is real); pure bf16 within 5%
section_2() {
    args=(--config configs/tiny.json --stop_iteration=40 --eval_batches=1 --log_interval=100)
    run_single 1 s2_ref
    local p
    for p in 32 bf16-mixed bf16; do run_single 2 "s2_$p" --precision=$p; done
    check 'same_losses s2_ref s2_32' "stage 02 precision 32 is not bit-identical to stage 01"
    check 'compare_losses "$tmp/s2_ref" "$tmp/s2_bf16-mixed" 40 0.02 0.25' "stage 02 bf16-mixed strays more than 2% from fp32"
    check '[ -n "$(loss_lines s2_bf16-mixed)" ] && ! same_losses s2_ref s2_bf16-mixed' "bf16-mixed gives exactly the fp32 losses: no rounding"
    check 'compare_losses "$tmp/s2_ref" "$tmp/s2_bf16" 40 0.05 0.25' "stage 02 pure bf16 strays more than 5% from fp32"
}

# stage 03 (test_stage3.sh): DDP flat, accumulated and bucketed; bf16 against stage 02 within 1e-3
section_3() {
    args=("${small[@]}")
    run_single 1 s3_ref
    run_single 2 s3_bf16ref --precision=bf16-mixed
    layout 3 s3_np1 1 s3_ref 20 1e-5
    layout 3 s3_np2 2 s3_ref 20 1e-5
    layout 3 s3_np4 4 s3_ref 20 1e-5
    layout 3 s3_np2acc2 2 s3_ref 20 1e-5 --gradient_acc_steps=2
    layout 3 s3_np4overlap 4 s3_ref 20 1e-5 --overlap_communication=true --bucket_size_mb=0.05
    layout 3 s3_np2bf16 2 s3_bf16ref 20 1e-3 --precision=bf16-mixed
}

# stage 04 (test_stage4.sh): FSDP, with prefetch, on 3 ranks (padded shards, batch 12); bf16 1e-3
section_4() {
    args=("${small[@]}")
    run_single 1 s4_ref
    run_single 1 s4_ref12 --stop_iteration=5 --global_batch_size=12
    run_single 2 s4_bf16ref --stop_iteration=10 --precision=bf16-mixed
    layout 4 s4_np1 1 s4_ref 20 1e-5
    layout 4 s4_np2 2 s4_ref 20 1e-5
    layout 4 s4_np4 4 s4_ref 20 1e-5
    layout 4 s4_np2acc2prefetch 2 s4_ref 20 1e-5 --gradient_acc_steps=2 --overlap_communication=true
    layout 4 s4_np3 3 s4_ref12 5 1e-5 --stop_iteration=5 --global_batch_size=12
    layout 4 s4_np2bf16 2 s4_bf16ref 10 1e-3 --stop_iteration=10 --precision=bf16-mixed
}

# stage 05 (test_stage5.sh): every grid (lib.sh's tp_grids, with overlap, accumulation and the
# gathered loss riding on some); bf16 within 1e-3 of stage 02 on [2,1,2] and, for machines with 2 GPUs, on [1,1,2]
section_5() {
    args=("${small[@]}" --n_head=4 --global_batch_size=8)
    run_single 1 s5_ref
    run_single 2 s5_bf16ref --precision=bf16-mixed
    grid() { layout 5 "s5_$1" "$2" s5_ref 20 1e-5 --tp_dimensions="$3" "${@:4}"; } # grid <name> <ranks> <x,y,z> [switches]
    tp_grids grid
    layout 5 s5_bf16_112 2 s5_bf16ref 20 1e-3 --tp_dimensions=1,1,2 --precision=bf16-mixed
    layout 5 s5_bf16_212 4 s5_bf16ref 20 1e-3 --tp_dimensions=2,1,2 --precision=bf16-mixed --overlap_communication=true
}

# stage 06 (test_stage6.sh): with a model stage 01 trained on real alpaca answers, the KV cache,
# batch 1, bf16 weights among themselves, a CUDA graph (compile) and tensor-parallel grids generate
# the tokens of the cached batched run, greedy and sampled
section_6() {
    args=(--config configs/tiny.json --n_layer=2 --n_embd=64 --stop_iteration=25 --global_batch_size=8
          --log_interval=100 --eval_batches=1
          --data_path="${FIXTURES:-../shared/fixtures}/alpaca/rasbt-LLMs-from-scratch_instruction-data.json")
    run_single 1 s6_model
    printf 'Sort the digits.\nHow do I bake a cake?\n\nFind the largest digit.\nCount the letters in this rather long sentence, please.\n' \
        >"$tmp/s6_prompts.txt"
    args=(--config configs/inference.json --init_from="$tmp/s6_model" --prompts_path="$tmp/s6_prompts.txt"
          --tokens_to_generate=24 --show_token_ids=true --max_batch_size=3)
    local sample=(--temperature=1 --seed=7) grid dims np
    run_single 6 s6_greedy
    run_single 6 s6_sampled "${sample[@]}"
    run_single 6 s6_bf16 "${sample[@]}" --precision=bf16-mixed
    check '[ "$(answer_ids s6_greedy | wc -l)" -eq 4 ] && [ "$(answer_ids s6_sampled | sort -u | wc -l)" -eq 4 ] &&
           [ "$(answer_ids s6_bf16 | sort -u | wc -l)" -eq 4 ]' \
        "stage 06 did not answer the 4 prompts (sampled: 4 different answers): $(tail -2 "$tmp/s6_sampled.log")"
    generates_like s6_greedy_nocache 1 s6_greedy --kv_cache=false
    generates_like s6_sampled_nocache 1 s6_sampled "${sample[@]}" --kv_cache=false
    generates_like s6_sampled_batch1 1 s6_sampled "${sample[@]}" --max_batch_size=1
    generates_like s6_sampled_graph 1 s6_sampled "${sample[@]}" --compile=true
    generates_like s6_bf16_nocache 1 s6_bf16 "${sample[@]}" --precision=bf16-mixed --kv_cache=false
    generates_like s6_bf16_batch1 1 s6_bf16 "${sample[@]}" --precision=bf16-mixed --max_batch_size=1
    for grid in 2,1,1:2 4,1,1:4 2,2,1:4; do
        dims=${grid%:*} np=${grid#*:}
        generates_like "s6_greedy_tp$dims" "$np" s6_greedy --tp_dimensions="$dims"
        generates_like "s6_sampled_tp$dims" "$np" s6_sampled "${sample[@]}" --tp_dimensions="$dims"
    done
    pool_of_free_memory
}

# pool_figures <metrics> <fraction> <nvidia-smi's free MiB, or empty>: "ok", or what is wrong
pool_figures() {
    python3 - "$@" <<'PY'
import sys
m = {l.split()[0]: int(float(l.split()[1])) for l in open(sys.argv[1]) if l.startswith("workbook_kv_cache")}
fraction, smi = float(sys.argv[2]), sys.argv[3]
free, blocks = m.get("workbook_kv_cache_free_memory_bytes", 0), m.get("workbook_kv_cache_blocks", 0)
want = int(fraction * free) // 16384
left = (free - blocks * 16384) / 2**20  # MiB
ok = blocks > 0 and blocks == want and m.get("workbook_kv_cache_bytes") == blocks * 16384
ok = ok and (not smi or abs(int(smi) - left) < 1024)
print("ok" if ok else f"want {want} blocks of 16384 bytes from {free} bytes free and nvidia-smi's free "
      f"{smi or '(not asked)'} MiB near {left:.0f} MiB; found {m}")
PY
}
# The server's KV cache pool as a share of the GPU's free memory (kv_cache_memory_fraction, 0.25):
# the blocks that share of the free memory it measured holds (16384 bytes each: keys and values,
# 2 layers, 16 positions, 64 columns, fp32), and the GPU that much fuller once it is allocated, by
# nvidia-smi within 1 GiB (cuBLAS's workspace and the like come later). A dry run takes 0.0001 of
# the host's memory and leaves nvidia-smi out.
pool_of_free_memory() {
    local fraction=0.25 gpu=${CUDA_VISIBLE_DEVICES:-0} smi="" pid url
    [ -n "${TEST_GPUS:-}" ] && fraction=0.0001
    timeout --kill-after=5 120 "$STAGE_BIN/stage-6" --config configs/inference.json --init_from="$tmp/s6_model" --serve=true \
        --host=127.0.0.1 --port=0 --kv_cache_memory_fraction=$fraction >"$tmp/s6_pool.log" 2>&1 </dev/null &
    pid=$!
    for _ in $(seq 600); do grep -q "^server: model" "$tmp/s6_pool.log" && break; sleep 0.1; done
    url=http://127.0.0.1:$(grep -ao 'http://127.0.0.1:[0-9]*' "$tmp/s6_pool.log" | sed 's/.*://')
    curl -s -m 10 "$url/metrics" >"$tmp/s6_pool.metrics"
    [ -z "${TEST_GPUS:-}" ] && smi=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i "${gpu%%,*}")
    kill -TERM "$pid" 2>/dev/null
    wait "$pid"
    check '[ "$(pool_figures "$tmp/s6_pool.metrics" "$fraction" "$smi")" = ok ]' \
        "stage 06 server, kv_cache_memory_fraction $fraction: $(pool_figures "$tmp/s6_pool.metrics" "$fraction" "$smi") $(tail -2 "$tmp/s6_pool.log")"
}

# stage 07 (test_stage7.sh): pipelines of 1-4 stages (an uneven 3), GPipe and 1F1B, 1 and 4
# micro-batches, x data 2; recomputation gives the same losses to the last bit; bf16 within 1e-3
section_7() {
    args=("${small[@]}")
    run_single 1 s7_ref2 --n_layer=2
    run_single 1 s7_ref4 --n_layer=4
    run_single 2 s7_bf16ref --n_layer=2 --precision=bf16-mixed
    layout 7 s7_pp1 1 s7_ref2 20 1e-5 --n_layer=2
    layout 7 s7_pp2_1f1b_m4 2 s7_ref2 20 1e-5 --n_layer=2 --pp_size=2 --num_microbatches=4 --pp_schedule=1f1b
    layout 7 s7_pp2_gpipe_m4 2 s7_ref2 20 1e-5 --n_layer=2 --pp_size=2 --num_microbatches=4 --pp_schedule=gpipe
    layout 7 s7_pp2_m1 2 s7_ref2 20 1e-5 --n_layer=2 --pp_size=2 --num_microbatches=1
    layout 7 s7_pp2_dp2 4 s7_ref2 20 1e-5 --n_layer=2 --pp_size=2 --num_microbatches=2
    layout 7 s7_pp2_L4 2 s7_ref4 20 1e-5 --n_layer=4 --pp_size=2 --num_microbatches=4
    layout 7 s7_pp2_recompute 2 s7_ref4 20 1e-5 --n_layer=4 --pp_size=2 --num_microbatches=4 --activation_checkpointing=true &&
        check 'same_losses s7_pp2_L4 s7_pp2_recompute' "stage 07: recomputation changed the losses"
    layout 7 s7_pp3_uneven 3 s7_ref4 20 1e-5 --n_layer=4 --pp_size=3 --num_microbatches=4
    layout 7 s7_pp4_gpipe 4 s7_ref4 20 1e-5 --n_layer=4 --pp_size=4 --num_microbatches=4 --pp_schedule=gpipe
    layout 7 s7_pp2bf16 2 s7_bf16ref 20 1e-3 --n_layer=2 --pp_size=2 --num_microbatches=4 --precision=bf16-mixed
}

# stage 08 (test_stage8.sh): without experts it is stage 01 data-parallel; with experts (capacity 1:
# pairs drop at every step) ep 2, ep 4 and ep 2 x dp 2 give one rank's losses, dropped pairs and
# rows per expert
section_8() {
    args=(--config configs/tiny.json --stop_iteration=20 --eval_batches=0 --log_interval=100 --n_embd=64)
    run_single 1 s8_dense_ref
    layout 8 s8_dense1 1 s8_dense_ref 20 1e-5
    layout 8 s8_dense2 2 s8_dense_ref 20 1e-5
    args=(--config configs/moe.json --stop_iteration=20 --eval_batches=0 --log_interval=100 --n_embd=64 --capacity_factor=1)
    on_ranks 8 s8_ep1 1
    local dropped spec run np ep
    dropped=$(python3 -c "import json,sys; print(sum(json.loads(l)['dropped'] for l in open(sys.argv[1])))" "$tmp/s8_ep1/metrics.jsonl")
    check '[ "$dropped" -gt 0 ]' "capacity 1 dropped no pair in 20 steps: the comparison proves nothing about dropping"
    for spec in ep2:2:2 ep4:4:4 ep2_dp2:4:2; do
        IFS=: read -r run np ep <<<"$spec"
        layout 8 "s8_$run" "$np" s8_ep1 20 1e-5 --ep_size="$ep" &&
            check 'same_routing "$tmp/s8_ep1" "$tmp/s8_$run"' "stage 08 $run drops other pairs or loads the experts otherwise than one rank"
    done
}

# stage 09 (test_stage9.sh): the ring's CUDA blocks (09_context_parallel/backend/ring_blocks_cuda.cu)
# and Ulysses' all-to-alls, on sequences of 238 tokens (padded chunks, the last one past the
# positions): ring cp 2 with overlap and cp 4, Ulysses cp 2 x dp 2, for GPT-2, phi and Llama
# (grouped-query) against stage 01 within 1e-5; bf16-mixed ring cp 2 x dp 2 against stage 02 within 1e-3
section_9() {
    local common=(--stop_iteration=20 --eval_batches=1 --log_interval=100 --n_layer=2 --n_embd=64
                  --max_seq_len=238 --global_batch_size=4) model
    for model in tiny tiny_phi tiny_llama; do
        args=(--config "configs/$model.json" "${common[@]}")
        run_single 1 "s9_${model}_ref"
        layout 9 "s9_${model}_ring2" 2 "s9_${model}_ref" 20 1e-5 --cp_size=2 --overlap_communication=true
        layout 9 "s9_${model}_ulysses2dp2" 4 "s9_${model}_ref" 20 1e-5 --cp_size=2 --cp_impl=ulysses
    done
    args=(--config configs/tiny.json "${common[@]}")
    layout 9 s9_ring4 4 s9_tiny_ref 20 1e-5 --cp_size=4
    args=(--config configs/tiny.json "${common[@]}" --precision=bf16-mixed)
    run_single 2 s9_bf16_ref
    layout 9 s9_bf16_ring2dp2 4 s9_bf16_ref 20 1e-3 --cp_size=2 --overlap_communication=true
}

# phi (test_phi_stages.sh): DDP, FSDP (3 ranks: padded shards), tensor-parallel grids and pipelines
# against stage 01's phi losses; stage 02 bf16-mixed within 1e-2; stage 06 from stage 01's phi model
section_phi() {
    args=(--config configs/tiny_phi.json --stop_iteration=20 --eval_batches=1 --log_interval=100 --n_embd=64)
    run_single 1 phi_ref
    run_single 1 phi_ref12 --stop_iteration=5 --global_batch_size=12
    run_single 2 phi_bf16 --precision=bf16-mixed
    check 'compare_losses "$tmp/phi_ref" "$tmp/phi_bf16" 20 1e-2 0.25' "phi: stage 02 bf16-mixed strays from stage 01"
    layout 3 phi_ddp2 2 phi_ref 20 1e-5
    layout 3 phi_ddp4 4 phi_ref 20 1e-5
    layout 4 phi_fsdp2 2 phi_ref 20 1e-5
    layout 4 phi_fsdp3 3 phi_ref12 5 1e-5 --stop_iteration=5 --global_batch_size=12
    layout 5 phi_tp111 1 phi_ref 20 1e-5 --tp_dimensions=1,1,1
    layout 5 phi_tp211 2 phi_ref 20 1e-5 --tp_dimensions=2,1,1
    layout 5 phi_tp112 2 phi_ref 20 1e-5 --tp_dimensions=1,1,2
    layout 5 phi_tp221 4 phi_ref 20 1e-5 --tp_dimensions=2,2,1
    layout 5 phi_tp211data2 4 phi_ref 20 1e-5 --tp_dimensions=2,1,1
    layout 7 phi_pp2 2 phi_ref 20 1e-5 --pp_size=2 --num_microbatches=4
    layout 7 phi_pp2data2 4 phi_ref 20 1e-5 --pp_size=2 --num_microbatches=2 --pp_schedule=gpipe
    printf 'Sort the digits.\nCount the letters in this rather long sentence, please.\nHi\n' >"$tmp/phi_prompts.txt"
    args=(--config configs/inference.json --init_from="$tmp/phi_ref" --prompts_path="$tmp/phi_prompts.txt"
          --tokens_to_generate=16 --show_token_ids=true --max_batch_size=3 --temperature=1 --seed=7)
    run_single 6 phi_gen
    check '[ "$(answer_ids phi_gen | wc -l)" -eq 3 ]' "phi: stage 06 did not answer the 3 prompts: $(tail -3 "$tmp/phi_gen.log")"
    generates_like phi_gen_nocache 1 phi_gen --kv_cache=false
    generates_like phi_gen_tp211 2 phi_gen --tp_dimensions=2,1,1
    generates_like phi_gen_tp221 4 phi_gen --tp_dimensions=2,2,1
}

# traces on the GPU (test_trace.sh's checks): the spans are CUDA events on the streams, so this is
# where their nesting, the merged clock and the overlap measured from them are checked
section_trace() {
    args=("${small[@]}" --stop_iteration=3 --trace=true --trace_steps=2)
    run_single 1 t1
    local out
    out=$(python3 tools/trace_check.py valid "$tmp/t1/trace.json" 2>&1)
    check '[ $? -eq 0 ]' "stage 01 on the GPU: trace.json is not a valid timeline: $out"
    out=$(python3 tools/trace_check.py count "$tmp/t1/trace.json" "block 1 backward")
    check '[ "$out" = "0:2" ]' "stage 01 on the GPU: 'block 1 backward' per rank is '$out', want 0:2"
    on_ranks 3 t_on 2 --overlap_communication=true --bucket_size_mb=0.05
    on_ranks 3 t_off 2 --overlap_communication=false
    for run in t_on t_off; do
        out=$(python3 tools/trace_check.py valid "$tmp/$run/trace.json" 2>&1)
        check '[ $? -eq 0 ]' "stage 03 $run on 2 GPUs: trace.json is not a valid timeline: $out"
    done
    local on off
    on=$(python3 tools/trace_check.py overlap "$tmp/t_on/trace.json")
    off=$(python3 tools/trace_check.py overlap "$tmp/t_off/trace.json")
    # ranks sharing a GPU over MPI stage each bucket on the host as it starts: nothing to overlap
    [ "$gpus" -ge 2 ] && check 'awk -v x="$on" "BEGIN { exit !(x > 0) }"' "GPU, overlap on: bucket all-reduces overlap backward compute for $on us, want > 0"
    check '[ "$off" = "0.000" ]' "GPU, overlap off: the all-reduce overlaps backward compute for $off us, want 0"
}

# More ranks on a host than GPUs: the CUDA backend chooses MPI by itself and its banner names both
# counts; asking for NCCL there is refused with the reason. (Pretended GPUs cannot check this.)
section_share() {
    if [ -n "${TEST_GPUS:-}" ]; then
        echo "$name: SKIPPED: section share: the choice of MPI for ranks that share a GPU (TEST_GPUS=$TEST_GPUS is a pretended count)"
        return
    fi
    local np=$((gpus + 1)) rc
    args=("${small[@]}" --stop_iteration=1 --global_batch_size=$((8 * np)))
    run_ranks 3 share "$np"
    check 'grep -q "^communication: MPI ($np ranks share .* $gpus GPU" "$tmp/share.log"' \
        "stage 03 on $np ranks with $gpus GPU(s): the banner does not say they share over MPI: $(grep -a -m1 '^communication' "$tmp/share.log")"
    bounded 120 mpirun -np "$np" --bind-to none "$STAGE_BIN/stage-3" "${args[@]}" --comm_backend=nccl \
        --out_dir="$tmp/share_nccl" >"$tmp/share_nccl.log" 2>&1
    rc=$?
    check '[ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "NCCL needs a GPU per rank" "$tmp/share_nccl.log"' \
        "stage 03 on $np ranks, $gpus GPU(s), comm_backend=nccl: exit $rc, want a refusal with the reason: $(grep -m2 error "$tmp/share_nccl.log")"
}

# The serving engine (paged KV cache, prefix caching, chunked prefill, speculative decoding), Llama
# and LoRA on the GPU: the CPU suite's own tests of them, run on the binaries in $STAGE_BIN, each
# against its own references (no-cache greedy answers, the single-process run, peft)
suite() { # suite <test name>: tests/<name>.sh on $STAGE_BIN, one check
    local rc
    STAGE_BIN=$STAGE_BIN bash "tests/$1.sh" </dev/null 2>&1 | tee "$tmp/$1.log"  # (the section's log keeps it)
    rc=${PIPESTATUS[0]}
    check '[ $rc -eq 0 ]' "tests/$1.sh on $STAGE_BIN/ (exit $rc): $(grep -E '^FAIL' "$tmp/$1.log" | head -5) $(tail -1 "$tmp/$1.log")"
}
section_paged() { suite test_paged; }
section_llama() { suite test_llama_stages; suite test_llama_inference; }
section_lora() { suite test_lora; }

for section in "$@"; do
    start=$SECONDS
    "section_$section"
    echo "section $section: $((SECONDS - start)) s"
done
finish "$name"
