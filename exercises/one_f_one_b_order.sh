#!/usr/bin/env bash
# exercises/one_f_one_b_order.sh: the order check of exercise one-f-one-b, as tests/test_stage7.sh
# checks it, on 2, 3 and 4 pipeline stages (an answer right on 2 stages only fails): the first
# step's schedule that stage 07 prints for each stage (F forward, B backward, r received before
# it, s sent after it) must be 1F1B's: stage s of pp runs min(pp - s - 1, m) forwards, then one
# forward and one backward in turn, then the backwards left. Ends with its summary line; exits 0
# when all holds.
source "$(dirname "$0")/../tests/lib.sh"
source tests/mpi_env.sh
args=(--config configs/tiny.json --stop_iteration=2 --eval_batches=1 --eval_interval=1000 --log_interval=100
      --n_embd=32 --n_head=4)
# expected <pp> <m> <stage>: the sequence stage 07 prints for 1F1B
expected() {
    python3 - "$@" <<'PY'
import sys
pp, m, s = map(int, sys.argv[1:])
warm = min(pp - s - 1, m)
order = [("F", i) for i in range(warm)]
for k in range(m - warm):
    order += [("F", warm + k), ("B", k)]
order += [("B", k) for k in range(m - warm, m)]
def op(kind, i):  # a forward receives from the stage before, a backward from the one after
    recv = s > 0 if kind == "F" else s < pp - 1
    send = s < pp - 1 if kind == "F" else s > 0
    return ("r" if recv else "") + f"{kind}{i}" + ("s" if send else "")
print(" ".join(op(k, i) for k, i in order))
PY
}
for shape in "2 4 4" "3 4 4" "4 8 8"; do  # pp, micro-batches, global batch
    read -r pp m gbs <<<"$shape"
    run_ranks 7 "pp$pp" "$pp" --n_layer="$pp" --global_batch_size="$gbs" --pp_size="$pp" --num_microbatches="$m" --pp_schedule=1f1b
    for ((s = 0; s < pp; s++)); do
        want=$(expected "$pp" "$m" "$s")
        got=$(grep -a "(stage $s, replica 0):" "$tmp/pp$pp.log" | head -1 | sed 's/.*| *//; s/ *$//')
        check '[ "$got" = "$want" ]' "1F1B on $pp stages, $m micro-batches, stage $s: got '$got', want '$want'"
    done
done
finish one_f_one_b_order
