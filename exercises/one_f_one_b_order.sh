#!/usr/bin/env bash
# exercises/one_f_one_b_order.sh: the order check of exercise one-f-one-b, as tests/test_stage7.sh
# checks it: 2 pipeline stages, 4 micro-batches, 1F1B; the first step's schedule that stage 07
# prints (F forward, B backward, r received before it, s sent after it) must be, on stage 0,
# F0s F1s rB0 F2s rB1 F3s rB2 rB3 (one forward ahead, then alternating) and on stage 1
# rF0 B0s rF1 B1s rF2 B2s rF3 B3s (alternating from the start).
source "$(dirname "$0")/../tests/lib.sh"
source tests/mpi_env.sh
args=(--config configs/tiny.json --stop_iteration=2 --eval_batches=1 --eval_interval=1000 --log_interval=100
      --n_layer=2 --n_embd=32 --n_head=4 --global_batch_size=4)
run_ranks 7 pp 2 --pp_size=2 --num_microbatches=4 --pp_schedule=1f1b
check 'grep -q "rank 0 (stage 0, replica 0): .*| F0s F1s rB0 F2s rB1 F3s rB2 rB3 *$" "$tmp/pp.log"' \
    "1F1B's sequence on stage 0: $(grep -a "rank 0 (stage 0" "$tmp/pp.log")"
check 'grep -q "rank 1 (stage 1, replica 0): .*| rF0 B0s rF1 B1s rF2 B2s rF3 B3s *$" "$tmp/pp.log"' \
    "1F1B's sequence on stage 1: $(grep -a "rank 1 (stage 1" "$tmp/pp.log")"
finish one_f_one_b_order
