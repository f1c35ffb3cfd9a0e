#!/usr/bin/env bash
# Stage 10 with a mixture of experts (10_composed/composed_ep.c: ep folded into each stage's data
# replicas, the experts whole on every x rank) under mpirun, on configs/moe.json (GPT-2, the one
# family with experts) with capacity factor 1, so that pairs drop at every step:
#  - tp 2 x pp 2 x ep 2 (8 ranks) reproduces one rank's (stage 08, every expert on it) per-step
#    loss and gradient norm within 1e-5 relative over 20 steps; dp 2 x tp 2 x pp 2 x ep 2 (16
#    ranks) over 3 steps, its replicas holding the same experts identical at the end; zb-h1 on tp 2 x
#    pp 2 x ep 2 over 3 steps;
#  - rank 0's "experts" traffic equals the README's formula: the all-to-alls 8 x C x (rows it sent
#    + rows its experts ran) bytes, the counts' all-gather m x (MoE blocks of its stage) x ep x E x 4
#    bytes a step, its experts' gradients over the replicas holding them 4 x E / ep x (8 C^2 + 5 C);
#  - the ep run's checkpoint holds the whole model: stage 08 starts from it as from one rank's,
#    and a run saved on tp 2 x pp 2 x ep 2 resumes on tp 4 x pp 2 (ep 1) with one rank's figures;
#  - an ep_size that does not divide a stage's replicas, cp_size > 1 or the interleaved schedule with
#    experts, and 16-bit experts: one error, every rank stops.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
C=64 E=4
args=(--config configs/moe.json --stop_iteration=20 --eval_batches=0 --log_interval=100 --n_embd=$C --capacity_factor=1)
mesh=(--tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2)

run_single 8 single
run_single 8 single3 --stop_iteration=3
run_ranks 10 t2p2e2 8 "${mesh[@]}" --ep_size=2
run_ranks 10 d2t2p2e2 16 "${mesh[@]}" --ep_size=2 --stop_iteration=3
check 'compare_losses "$tmp/single" "$tmp/t2p2e2" 20 1e-5' "tp 2 x pp 2 x ep 2 does not reproduce one rank's figures"
check 'compare_losses "$tmp/single3" "$tmp/d2t2p2e2" 3 1e-5' "dp 2 x tp 2 x pp 2 x ep 2 does not reproduce one rank's figures"
check 'grep -q "replicas identical on all 2 ranks" "$tmp/d2t2p2e2.log"' "no check that replicas with the same experts agree"
# ZB-H1's split backward around 08's MoE MLP (the experts' weight gradients in its W pass)
run_ranks 10 t2p2e2_zb 8 "${mesh[@]}" --ep_size=2 --pp_schedule=zb-h1 --stop_iteration=3
check 'compare_losses "$tmp/single3" "$tmp/t2p2e2_zb" 3 1e-5' "zb-h1 on tp 2 x pp 2 x ep 2 does not reproduce one rank's figures"

# rank 0 (stage 0: one MoE block; m = 2 micro-batches a step, 20 steps, no evaluation)
a2a=$(comm_value "$tmp/t2p2e2/stats.json" experts all-to-all bytes)
counts=$(comm_value "$tmp/t2p2e2/stats.json" experts all-gather bytes)
to=$(json_value "$tmp/t2p2e2/stats.json" rows_to_experts)
at=$(json_value "$tmp/t2p2e2/stats.json" rows_at_experts)
check '[ -n "$to" ] && [ "$a2a" = "$((8 * C * (to + at)))" ]' "rank 0's all-to-all bytes $a2a, want 8 x $C x ($to + $at)"
check '[ "$counts" = "$((20 * 2 * 1 * 2 * E * 4))" ]' "rank 0's all-gather bytes $counts, want 20 x 2 x 1 x 2 x $E x 4"
# its experts' gradients (E / ep = 2 of them, 8 C^2 + 5 C floats each) over the 2 replicas holding them, 3 steps
held=$(comm_value "$tmp/d2t2p2e2/stats.json" expert-replicas all-reduce bytes)
check '[ "$held" = "$((3 * 4 * 1 * 2 * (8 * C * C + 5 * C)))" ]' "rank 0's expert-replicas bytes $held, want 3 x 4 x 2 x (8 C^2 + 5 C)"

# the checkpoint: stage 08 from it starts as from one rank's; a saved run resumes on another mesh
run_single 8 from_single --init_from="$tmp/single" --stop_iteration=1
run_single 8 from_ep --init_from="$tmp/t2p2e2" --stop_iteration=1
check 'compare_losses "$tmp/from_single" "$tmp/from_ep" 1 1e-5' "stage 08 starts from the ep run's checkpoint otherwise than from one rank's"
run_ranks 10 resumed 8 "${mesh[@]}" --ep_size=2 --stop_iteration=2
run_ranks 10 resumed 8 --tp_dimensions=4,1,1 --pp_size=2 --num_microbatches=2 --stop_iteration=3 --resume=true
check 'compare_losses "$tmp/single3" "$tmp/resumed" 3 1e-5' "2 steps on ep 2 + 1 resumed on tp 4 x pp 2 differ from one rank's 3"

bad=(bounded 120 mpirun -np 8 --bind-to none build/stage-10 "${args[@]}" "${mesh[@]}" --out_dir="$tmp/bad")
expect_one_error "ep_size not dividing the replicas" "key 'ep_size' is 4 but .* there are 2 (dp = 8 ranks / (tp 2 x pp 2)): expected a divisor of 2" \
    "${bad[@]}" --ep_size=4
expect_one_error "experts with cp" "key 'cp_size' is 2 but num_experts is 4" "${bad[@]}" --cp_size=2 --max_seq_len=64
expect_one_error "experts with interleaved" "key 'pp_schedule' is 'interleaved' but num_experts is 4" \
    "${bad[@]}" --n_layer=4 --pp_schedule=interleaved --virtual_stages=2
expect_one_error "16-bit experts" "stage 10's experts train in fp32" \
    bounded 60 build/stage-10 "${args[@]}" --out_dir="$tmp/bad" --precision=bf16-mixed
finish test_stage10_ep
