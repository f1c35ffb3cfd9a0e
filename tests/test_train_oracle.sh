#!/usr/bin/env bash
# Stage 01's training loop against an independent PyTorch one (tests/oracle_train.py, float64):
# every step's loss, lr, gradient norm and validation loss, on GPT-2 and on phi, over warm-up and
# decay, clipped and unclipped steps, gradient accumulation and two epochs; and a run stopped
# half-way and resumed from its checkpoint against the same uninterrupted reference; and the same
# runs with optimizer muon (Newton-Schulz on tall and wide matrices, GPT-2's fused qkv and phi's
# apart), held to 1e-6. The other stages are checked against stage 01, so this is what catches a
# bug they all share.
source "$(dirname "$0")/lib.sh"

if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
    echo "FAIL: /usr/bin/python3 has no torch: apt-get install python3-torch (make setup does)"
    echo "test_train_oracle: 0 passed, 1 failed"
    exit 1
fi
/usr/bin/python3 tests/oracle_train.py data "$tmp/data.json"
# the clip limit lies inside the run's gradient norms (1.1 to 3.1 on GPT-2): some steps are
# clipped, some are not, and the oracle checks that both happen
for arch in gpt2 phi; do
    cat >"$tmp/$arch.json" <<JSON
{"arch": "$arch", "n_layer": 2, "n_head": 2, "n_embd": 32, "max_seq_len": 256, "precision": "32",
 "data_path": "$tmp/data.json", "val_fraction": 0.25, "seed": 7,
 "global_batch_size": 8, "gradient_acc_steps": 2, "num_epochs": 3,
 "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 4, "weight_decay": 0.1,
 "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 2.0,
 "eval_interval": 5, "eval_batches": 4, "log_interval": 100}
JSON
    sed 's/"log_interval": 100}/"log_interval": 100, "optimizer": "muon", "muon_lr": 0.02}/' "$tmp/$arch.json" \
        >"$tmp/$arch-muon.json"
done

# oracle <config> <init dir> <run dir...>: the reference's ok/FAIL lines, counted as checks
oracle() {
    /usr/bin/python3 tests/oracle_train.py check "$@" >"$tmp/oracle.txt" 2>&1
    cat "$tmp/oracle.txt"
    passed=$((passed + $(grep -c 'ok: ' "$tmp/oracle.txt")))
    failed=$((failed + $(grep -c 'FAIL: ' "$tmp/oracle.txt")))
    check "grep -q '^gpt2: \|^phi: ' '$tmp/oracle.txt'" "tests/oracle_train.py did not run to the end: $(tail -3 "$tmp/oracle.txt")"
}

args=()
for arch in gpt2 phi; do
    # stop_iteration 0 saves the initial weights, which the reference starts from
    run_single 1 "$arch-init" --config "$tmp/$arch.json" --stop_iteration=0
    run_single 1 "$arch" --config "$tmp/$arch.json"
    run_single 1 "$arch-muon" --config "$tmp/$arch-muon.json" --init_from="$tmp/$arch-init"
done
# stopped after 9 of 18 steps, then the same command again: it resumes from the checkpoint, and
# the whole run must match the uninterrupted reference
run_single 1 resumed --config "$tmp/gpt2.json" --stop_iteration=9
check '[ "$(wc -l <"$tmp/resumed/metrics.jsonl")" -eq 9 ]' "the first half logged $(wc -l <"$tmp/resumed/metrics.jsonl") steps, not 9"
run_single 1 resumed --config "$tmp/gpt2.json"
check 'grep -q "resuming the run saved in" "$tmp/resumed.log"' "the second half did not resume: $(head -3 "$tmp/resumed.log")"

oracle "$tmp/gpt2.json" "$tmp/gpt2-init" "$tmp/gpt2" "$tmp/resumed"
oracle "$tmp/phi.json" "$tmp/phi-init" "$tmp/phi"
oracle "$tmp/gpt2-muon.json" "$tmp/gpt2-init" "$tmp/gpt2-muon"
oracle "$tmp/phi-muon.json" "$tmp/phi-init" "$tmp/phi-muon"

finish test_train_oracle
