# tests/lib.sh: what the shell tests share. Source it first: it moves to the repository root,
# makes $tmp (removed on exit), ends on exit every process the test started (end_test_processes)
# and gives check, bounded, compare_losses, json_value, comm_value, run_ranks, run_single,
# first_loss, stage1_starts_alike and finish. The figures a check compares come from a run's
# metrics.jsonl and stats.json, not from the text the run prints for people.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# where the stage binaries are: build/ holds the copies of the backend built last (the CPU one under
# `make test`); tests/test_cuda_stages.sh points it at build/cuda
STAGE_BIN=${STAGE_BIN:-build}
tmp=$(mktemp -d)
# Every process the test starts inherits TEST_PROCESS_TAG in its environment (mpirun passes it on
# to its ranks), nested under the tag of what started the test (tests/run.sh gives each test one):
# a tag, not a process group, because timeout, mpirun's ranks and setsid each leave the group they
# were started in. A test that replaces this EXIT trap calls end_test_processes in its own. A stop
# (SIGTERM from run.sh's TEST_TIMEOUT, a Ctrl-C) exits at once when the test waits in bounded or
# wait, and so runs the trap; run.sh ends what a test stopped with SIGKILL leaves.
export TEST_PROCESS_TAG=${TEST_PROCESS_TAG:+$TEST_PROCESS_TAG/}${tmp##*/}
trap 'end_test_processes; rm -rf "$tmp"' EXIT
trap 'stop_test 129' HUP
trap 'stop_test 130' INT
trap 'stop_test 143' TERM
passed=0 failed=0

# stop_test <status>: exits, ignoring any later stop (a second Ctrl-C), which would cut the EXIT
# trap short
stop_test() {
    trap '' HUP INT TERM
    exit "$1"
}

# tagged_processes <tag>: the ids of the processes whose environment holds TEST_PROCESS_TAG=<tag>
# or a tag nested under it, this shell left out (grep, run through env without the tag, finds
# only the others)
tagged_processes() {
    local files f
    files=$(env -u TEST_PROCESS_TAG grep -lzxE "TEST_PROCESS_TAG=${1//./\\.}(/.*)?" /proc/[0-9]*/environ 2>/dev/null)
    for f in $files; do
        f=${f#/proc/} f=${f%/environ}
        [ "$f" = $$ ] || echo "$f"
    done
}

# end_test_processes [tag]: ends every process carrying the tag (default: this test's): SIGTERM,
# then SIGKILL to whatever is left 2 s later (a rank that spins, a server that ignores SIGTERM);
# returns when none is left, or after 10 s (a process stuck in the kernel cannot be killed)
end_test_processes() {
    local tag=${1:-$TEST_PROCESS_TAG} round pids
    for ((round = 1; round <= 50; round++)); do
        pids=$(tagged_processes "$tag")
        [ -n "$pids" ] || return 0
        if [ $round -eq 1 ]; then
            kill -TERM $pids 2>/dev/null
        elif [ $round -gt 10 ]; then
            kill -KILL $pids 2>/dev/null
        fi
        sleep 0.2
    done
}

# bounded <seconds> <command...>: the command, stopped after <seconds> with everything in its
# process group (SIGTERM, then SIGKILL 5 s later: time for a test stopped so to run its EXIT
# trap); its exit status, 124 when stopped. The test waits for it with `wait`, which a stop
# interrupts, where a command in the foreground would hold the stop back until it ended. A
# command the test starts alongside (`&`) runs under `timeout --kill-after=5 <seconds>` directly,
# so that $! is timeout's.
bounded() {
    timeout --kill-after=5 "$@" <&0 &
    wait $!
}

# check '<condition>' "<what is wrong when it fails>": counts one check. The condition is
# evaluated here; capture a command's status first (rc=$?) if the message runs commands.
check() {
    if eval "$1"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: $2"; fi
}

# compare_losses <reference out_dir> <out_dir> <steps> <tolerance> [norm tolerance]: both runs
# logged <steps> steps, and every figure that says what the training did agrees within the
# relative tolerance: each step's loss, lr, grad_norm, val_loss (wherever the reference logged
# it; a run stopped to be resumed evaluates at its stop too) and whatever else both runs log per
# step (fp16's loss scale and skips, the experts' load), and the figures both stats.json files
# hold (parallel_weight_elements, ...); not timings, memory, a rank's share, the precision asked
# for, or what this process did (communication, tokens_trained: a resumed run counts from its
# resume), which differ by design. grad_norm is held to [norm tolerance] when given: a run in
# another precision computes another gradient, whose norm strays further than its loss.
# Prints the largest gap of each figure.
compare_losses() {
    python3 - "$1" "$2" "$3" "$4" "${5:-$4}" <<'PY'
import json, math, os, sys
ref_dir, run_dir, steps, tol, norm_tol = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
NOT_TRAINING = {"step", "ms", "tokens_per_sec", "mfu", "mem_bytes", "comm_bytes", "comm_ms", "state_bytes",
                "grad_underflow", "stage", "world_size", "layout", "precision", "memory", "communication",
                "tokens_trained"}
def layout_figure(key):
    return key in NOT_TRAINING or any(part in key for part in ("bytes", "per_rank", "slots", "rows_"))
def records(path):
    try:
        return [json.loads(line) for line in open(path)]
    except OSError:
        return []
def gap(x, y):
    if isinstance(x, bool) or isinstance(y, bool) or not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
        return 0.0 if x == y else math.inf
    return 0.0 if x == y else abs(x - y) / max(abs(x), 1e-30)
a, b = (records(os.path.join(d, "metrics.jsonl")) for d in (ref_dir, run_dir))
worst, problems = {}, []
if not len(a) == len(b) == steps:
    problems.append(f"{len(a)} and {len(b)} steps logged, not {steps}")
keys = {k for r in a for k in r} & {k for r in b for k in r}
for x, y in zip(a, b):
    for k in sorted(k for k in keys if not layout_figure(k)):
        if k in x and k not in y:
            problems.append(f"step {x.get('step')}: {k} not logged")
        elif k in x:
            worst[k] = max(worst.get(k, 0.0), gap(x[k], y[k]))
try:
    sa, sb = (json.load(open(os.path.join(d, "stats.json"))) for d in (ref_dir, run_dir))
except (OSError, ValueError):
    sa, sb = {}, {}
for k in sorted(set(sa) & set(sb)):
    if not layout_figure(k):
        worst["stats." + k] = gap(sa[k], sb[k])
problems += [f"{k} differs by {v:.2e}" for k, v in sorted(worst.items()) if not v <= (norm_tol if k == "grad_norm" else tol)]
figures = ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items()))
print(f"{run_dir}: {len(b)} steps, largest relative differences: {figures or 'none'}")
for p in problems[:5]:
    print(f"  {p}")
sys.exit(1 if problems or "loss" not in worst else 0)
PY
}

# SCALE_ARGS: clipping off and AdamW's eps near the size of a gradient element, so that AdamW's step
# depends on the gradient's scale. With clipping on and eps 1e-8 it does not: a gradient twice too
# large (or never unscaled from fp16) leaves the loss where it was. With these, on configs/tiny.json
# (n_layer 2, n_embd 64, 20 steps), a gradient twice too large moves stage 01's loss by 3.5%.
SCALE_ARGS=(--grad_clip=0 --eps=1e-3)

# json_value <file> <key> [key ...]: the value at that path of a JSON file (a run's stats.json),
# a number or string as is, a list or object as JSON; prints nothing and fails when it is absent.
json_value() {
    python3 - "$@" <<'PY'
import json, sys
value = json.load(open(sys.argv[1]))
for key in sys.argv[2:]:
    if not isinstance(value, dict) or key not in value:
        sys.exit(1)
    value = value[key]
print(value if isinstance(value, (str, int, float)) else json.dumps(value))
PY
}

# first_loss <out_dir>: the loss of the first step the run's metrics.jsonl logged
first_loss() {
    python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readline())['loss'])" "$1/metrics.jsonl"
}

# stage1_starts_alike <stage> <checkpoint out_dir> <run from it> <random start out_dir> [args...]:
# three checks that a stage's checkpoint holds the whole model: build/stage-1 started from it
# (the test's "${args[@]}" plus [args...], one step, into $tmp/from_s1) runs, logs the first loss
# <run from it> logged, and that loss is a trained model's (at least 1 below the random start's)
stage1_starts_alike() {
    local stage=$1 ckpt=$2 run=$3 random=$4
    shift 4
    OMP_NUM_THREADS=2 build/stage-1 "${args[@]}" "$@" --init_from="$ckpt" --stop_iteration=1 --out_dir="$tmp/from_s1" \
        >"$tmp/from_s1.log" 2>&1
    local rc=$? first start
    check '[ $rc -eq 0 ]' "stage 1 from the stage-$stage checkpoint failed: $(tail -3 "$tmp/from_s1.log")"
    check 'compare_losses "$tmp/from_s1" "$run" 1 1e-5' "stage 01 from the stage-$stage checkpoint gives another first loss"
    first=$(first_loss "$tmp/from_s1") start=$(first_loss "$random")
    check 'awk -v a="$first" -v b="$start" "BEGIN { exit !(a < b - 1) }"' \
        "the checkpoint's first loss $first is not a trained model's (random start $start)"
}

# one_step_gradients_match <stage> <name> <np> [layout args...]: per-tensor gradients after one step
# of <stage> on <np> ranks (the test's "${args[@]}", and [layout args...] for it alone) within 1e-5
# of stage 01's (the test's "${args[@]}"), each
# tensor relative to its largest (tests/one_step_gradients.py: with AdamW's eps 1, no decay, no
# clipping and no warm-up, step 1 moves each weight by about lr times its gradient; lr 100 makes that
# large beside the weight's fp32 resolution, and a run at lr 1e-30 gives the start)
one_step_gradients_match() {
    local stage=$1 name=$2 np=$3
    shift 3
    local one=(--stop_iteration=1 --eval_batches=0 --warmup_steps=0 --weight_decay=0 --grad_clip=0 --eps=1)
    run_single 1 "${name}_start" "${one[@]}" --lr=1e-30 --min_lr=1e-30
    run_single 1 "${name}_s1" "${one[@]}" --lr=100 --min_lr=100
    run_ranks "$stage" "$name" "$np" "${one[@]}" --lr=100 --min_lr=100 "$@"
    python3 tests/one_step_gradients.py "$tmp/${name}_start" "$tmp/${name}_s1" "$tmp/$name" >"$tmp/$name.grads"
    local rc=$?
    check '[ $rc -eq 0 ]' "$name: one step's per-tensor gradients differ from stage 01's: $(cat "$tmp/$name.grads")"
    echo "$name: $(cat "$tmp/$name.grads")"
}

# comm_value <stats.json> <group> <kind> <field>: one field (calls, bytes, seconds, algbw_GBps,
# busbw_GBps) of the run's communication on that group of that kind (all-reduce, all-gather,
# ...); prints nothing and fails when the run made no such call.
comm_value() {
    python3 - "$@" <<'PY'
import json, sys
path, group, kind, field = sys.argv[1:]
for entry in json.load(open(path))["communication"]:
    if entry["group"] == group and entry["kind"] == kind:
        print(entry[field])
        sys.exit(0)
sys.exit(1)
PY
}

# run_ranks <stage> <name> <ranks> [args...]: $STAGE_BIN/stage-<stage> on <ranks> MPI ranks with
# the test's "${args[@]}" plus [args...], writing $tmp/<name>/ and $tmp/<name>.log; one check that
# it exits 0 (tests/mpi_env.sh must be sourced). COMM_BACKEND=<value> adds --comm_backend=<value>:
# COMM_BACKEND=mpi-staged bash tests/test_stage3.sh runs the stage's layouts through the MPI path
# of ranks that share a GPU.
run_ranks() {
    local stage=$1 name=$2 np=$3
    shift 3
    bounded 300 mpirun -np "$np" --bind-to none "$STAGE_BIN/stage-$stage" "${args[@]}" --out_dir="$tmp/$name" \
        ${COMM_BACKEND:+--comm_backend="$COMM_BACKEND"} "$@" >"$tmp/$name.log" 2>&1
    local rc=$?
    check '[ $rc -eq 0 ]' "stage $stage $name failed (exit $rc): $(tail -5 "$tmp/$name.log")"
}

# run_single <stage> <name> [args...]: the same as one process without mpirun (two OpenMP threads
# on the CPU, whatever tests/mpi_env.sh set for the ranks)
run_single() {
    local stage=$1 name=$2
    shift 2
    OMP_NUM_THREADS=2 bounded 300 "$STAGE_BIN/stage-$stage" "${args[@]}" --out_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1
    local rc=$?
    check '[ $rc -eq 0 ]' "stage $stage $name failed: $(tail -3 "$tmp/$name.log")"
}

# answer_ids <name>: the token ids stage 06 generated in the run logged to $tmp/<name>.log
# (--show_token_ids=true), one line per prompt: what its equivalence checks compare
answer_ids() { grep -a "answer ids:" "$tmp/$1.log"; }

# same_routing <out_dir> <out_dir>: two stage-08 runs dropped the same pairs and gave each expert
# the same rows at every step
same_routing() {
    python3 - "$1/metrics.jsonl" "$2/metrics.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
keys = ("dropped", "expert_load")
sys.exit(0 if len(a) == len(b) and all(x[k] == y[k] for x, y in zip(a, b) for k in keys) else 1)
PY
}

# tp_grids <command...>: runs <command...> <name> <ranks> <x,y,z> [switches] for each tensor-parallel
# grid test_stage5.sh checks against stage 01, the switches riding on the grids where they matter
# (prefetch and async, the gathered loss); test_plan.sh and test_cuda_stages.sh check the same grids
tp_grids() {
    "$@" g111 1 1,1,1
    "$@" g211 2 2,1,1
    "$@" g121 2 1,2,1
    "$@" g112 2 1,1,2
    "$@" g411 4 4,1,1
    "$@" g141 4 1,4,1
    "$@" g221 4 2,2,1 --overlap_communication=true
    "$@" g212 4 2,1,2 --overlap_communication=true --gradient_acc_steps=2
    "$@" g122 4 1,2,2
    "$@" g211d2 4 2,1,1 --vocab_parallel_loss=false
}

# visible_gpus: how many GPUs a CUDA program started here sees: those nvidia-smi lists (0 without
# one or without the driver), no more than CUDA_VISIBLE_DEVICES names when it is set
visible_gpus() {
    local n listed
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
        listed=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c '[^[:space:]]')
        [ "$listed" -lt "$n" ] && n=$listed
    fi
    echo "$n"
}

# same_adapter <out_dir> <out_dir>: two LoRA runs saved the same adapter: adapter_model.safetensors
# with the same tensors, names and shapes, values within 1e-5 relative, and the same
# adapter_config.json; prints the largest difference
same_adapter() {
    python3 - "$1" "$2" <<'PY'
import json, struct, sys
def read(d):
    raw = open(d + "/adapter_model.safetensors", "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    values = {k: struct.unpack("<%df" % (len(data[v["data_offsets"][0]:v["data_offsets"][1]]) // 4),
                               data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}
    config = json.load(open(d + "/adapter_config.json"))
    return header, values, config
(ha, va, ca), (hb, vb, cb) = read(sys.argv[1]), read(sys.argv[2])
gap = max(abs(x - y) / max(abs(x), 1.0) for k in va for x, y in zip(va[k], vb[k])) if ha == hb else float("inf")
print("%s: adapter's largest difference %.2e" % (sys.argv[2], gap))
sys.exit(0 if ha == hb and ca == cb and gap <= 1e-5 else 1)
PY
}

# expect_one_error <what> <pattern> <command...>: one check that the command exits 1 and that its
# stderr holds exactly one line starting with "error", which matches <pattern> (grep). Under
# mpirun that means every rank stopped and only one of them spoke for the job.
expect_one_error() {
    local what=$1 pattern=$2
    shift 2
    "$@" >"$tmp/err.out" 2>"$tmp/err.log"
    local rc=$?
    check '[ $rc -eq 1 ] && grep -q -- "$pattern" "$tmp/err.log" && [ "$(grep -c "^error" "$tmp/err.log")" -eq 1 ]' \
        "$what: exit $rc, stderr: $(cat "$tmp/err.log")"
}

# oracle_venv [peft]: makes, once, the venv the oracle tests (test_phi_oracle, test_moe_oracle,
# test_lora_oracle, ...) run their Python in: Debian's python3 and its torch, plus transformers
# 4.49.0, peft 0.14.0, accelerate 1.2.1 (peft needs it; later ones need torch 2) and the small
# packages they import, every one pinned and installed with --no-deps. pip's resolver would read
# peft's torch>=1.13.0 as excluding Debian's 1.13.0a0 and pull a torch 2 with its CUDA libraries,
# gigabytes on every fresh machine. A venv holding a torch of its own is made anew, one holding
# other packages than these gets these. Setting it up prints the venv's size and what it holds;
# one check that it imports, peft too when asked. The venv is $ORACLE_VENV.
ORACLE_VENV=build/phi-oracle-venv
ORACLE_PACKAGES=(transformers==4.49.0 peft==0.14.0 accelerate==1.2.1
                 huggingface-hub==0.28.1 tokenizers==0.21.0 safetensors==0.5.2 regex==2024.11.6
                 tqdm==4.67.1 packaging==24.2 filelock==3.17.0 fsspec==2024.12.0 jinja2==3.1.5 markupsafe==3.0.2)
oracle_venv() {
    if ! "$ORACLE_VENV/bin/python" -c 'import torch; assert torch.__file__.startswith("/usr/")' 2>/dev/null; then
        rm -rf "$ORACLE_VENV"
        /usr/bin/python3 -m venv --system-site-packages "$ORACLE_VENV"
    fi
    local held wanted
    held=$("$ORACLE_VENV/bin/pip" freeze --local 2>/dev/null | tr 'A-Z_' 'a-z-' | sort)
    wanted=$(printf '%s\n' "${ORACLE_PACKAGES[@]}" | sort)
    if [ "$held" != "$wanted" ]; then
        "$ORACLE_VENV/bin/pip" install -q --no-deps "${ORACLE_PACKAGES[@]}" >"$tmp/pip.log" 2>&1
        echo "oracle venv $ORACLE_VENV: $(du -sh "$ORACLE_VENV" | cut -f1) over Debian's torch, holding:" \
            $("$ORACLE_VENV/bin/pip" freeze --local 2>/dev/null)
    fi
    check '"$ORACLE_VENV/bin/python" -c "import transformers, torch; assert transformers.__version__ == \"4.49.0\""' \
        "transformers 4.49.0 does not import in $ORACLE_VENV (pip: $(tail -2 "$tmp/pip.log" 2>/dev/null))"
    [ "${1:-}" = peft ] || return 0
    check '"$ORACLE_VENV/bin/python" -c "import peft; assert peft.__version__ == \"0.14.0\""' \
        "peft 0.14.0 does not import in $ORACLE_VENV (pip: $(tail -2 "$tmp/pip.log" 2>/dev/null))"
}

# finish <name>: the summary line tests/run.sh reads, and the exit status
finish() {
    echo "$1: $passed passed, $failed failed"
    [ "$failed" -eq 0 ]
}

# killed_rank_ends_job <stage> <ranks> <args incl. --out_dir=DIR>: kills one rank with SIGKILL once
# training has started; the job must end (non-zero, before the 120 s guard) with the launcher
# naming the rank, not hang in a collective or a receive waiting for the dead rank
killed_rank_ends_job() {
    local n=$1 np=$2 out log start launcher victim rc; shift 2
    out=$(printf '%s\n' "$@" | sed -n 's/^--out_dir=//p' | tail -1)
    log=$out.log
    start=$SECONDS
    timeout --kill-after=5 120 mpirun -np "$np" --bind-to none "$STAGE_BIN/stage-$n" "$@" --stop_iteration=100000 >"$log" 2>&1 &
    launcher=$!
    for _ in $(seq 100); do [ -f "$out/metrics.jsonl" ] && break; sleep 0.2; done
    victim=$(pgrep -f "$STAGE_BIN/stage-$n .*--out_dir=$out" | tail -1)
    [ -n "$victim" ] && kill -9 "$victim"
    wait $launcher
    rc=$?
    check '[ -n "$victim" ] && [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qi "rank" "$log"' \
        "stage $n, a killed rank: exit $rc after $((SECONDS - start)) s (want non-zero before the 120 s guard, the rank named): $(tail -2 "$log")"
}
