#!/usr/bin/env bash
# Graceful sharing: stage 01's step on an idle machine and with another process keeping one core
# busy (a shell loop pinned to the last core), interleaved over rounds, so that both see the same
# machine. On 2 cores, losing one should cost about 2x, no more: OpenMP threads that spin at
# barriers made it 6-9x. Each run three ways: as the stages run (their threads spin ~15 us, then
# sleep: common/ops/ops_cpu_fast.c, restart_with_short_spin), waiting passively (OMP_WAIT_POLICY=passive:
# the best when shared, slow when idle where waking a thread is slow) and with libgomp's default
# (GOMP_SPINCOUNT=300000, several ms: the worst when shared). The figures go to $BENCH_JSON under
# "sharing". Runs alone too: `make bench-sharing`.
# BENCH_SHARING_ARGS: the run (default tiny.json, 8 steps); BENCH_SHARING_ROUNDS: rounds (3).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
BENCH_JSON=${BENCH_JSON:-build/bench/bench.json}
mkdir -p "$(dirname "$BENCH_JSON")"
rounds=${BENCH_SHARING_ROUNDS:-3}
read -r -a run_args <<<"${BENCH_SHARING_ARGS:---config configs/tiny.json --stop_iteration=8}"
out=$(mktemp -d)
busy=
trap '[ -n "$busy" ] && kill "$busy" 2>/dev/null; rm -rf "$out"' EXIT

step_ms() { # step_ms <name> [VAR=value]: the median step after the first, ms
    env ${2:-} build/stage-1 "${run_args[@]}" --log_interval=1 --eval_batches=0 --checkpoint_interval=0 \
        --out_dir="$out/$1" >"$out/$1.log" 2>&1 || { echo "bench: stage-1 ($1) failed:"; tail "$out/$1.log"; exit 1; }
    python3 -c 'import json, statistics, sys
print(statistics.median(json.loads(l)["ms"] for l in list(open(sys.argv[1]))[1:]))' "$out/$1/metrics.jsonl"
}

last_core=$(($(nproc) - 1))
echo "stage 01 sharing the machine: ${run_args[*]}, $OMP_NUM_THREADS threads, idle and with a busy loop on core $last_core,"
echo "interleaved, $rounds rounds ($(uptime | sed 's/.*load/load/')):"
echo "| round | waiting         |  idle ms | shared ms | shared / idle |"
echo "|-------|-----------------|----------|-----------|---------------|"
modes=("as run:" "passive:OMP_WAIT_POLICY=passive" "libgomp default:GOMP_SPINCOUNT=300000")
for r in $(seq "$rounds"); do
    idle=() shared=()
    for k in "${!modes[@]}"; do idle+=("$(step_ms "idle$r$k" "${modes[$k]#*:}")"); done
    taskset -c "$last_core" sh -c 'while :; do :; done' &
    busy=$!
    for k in "${!modes[@]}"; do shared+=("$(step_ms "shared$r$k" "${modes[$k]#*:}")"); done
    kill "$busy"; wait "$busy" 2>/dev/null || true; busy=
    for k in "${!modes[@]}"; do
        echo "$r $k ${idle[$k]} ${shared[$k]}" >>"$out/rounds"
        printf '| %5s | %-15s | %8.1f | %9.1f | %13.2f |\n' "$r" "${modes[$k]%%:*}" "${idle[$k]}" "${shared[$k]}" \
            "$(python3 -c "print(${shared[$k]} / ${idle[$k]})")"
    done
done
python3 - "$out/rounds" "$BENCH_JSON" "${run_args[*]}" "$(uptime)" "${modes[@]}" <<'PY'
import json, os, statistics, sys
rounds, path, run, uptime, *modes = sys.argv[1:]
rows = [line.split() for line in open(rounds)]
def medians(k):
    idle = statistics.median(float(r[2]) for r in rows if int(r[1]) == k)
    shared = statistics.median(float(r[3]) for r in rows if int(r[1]) == k)
    return {"env": modes[k].split(":", 1)[1], "idle_ms": idle, "shared_ms": shared, "ratio": shared / idle}
as_run, passive, spinning = (medians(k) for k in range(3))
print(f"median as run: idle {as_run['idle_ms']:.1f} ms, shared {as_run['shared_ms']:.1f} ms: {as_run['ratio']:.2f}x "
      "(on 2 cores, about 2x is the cost of the core);")
for name, m in (("passive", passive), ("libgomp default", spinning)):
    print(f"{name}: idle {m['idle_ms']:.1f} ms, shared {m['shared_ms']:.1f} ms: {m['ratio']:.2f}x")
data = json.load(open(path)) if os.path.exists(path) else {}
data["sharing"] = {"run": run, "threads": int(os.environ["OMP_NUM_THREADS"]), "uptime": uptime.strip(),
                   "rounds": [{"mode": modes[int(r[1])].split(":")[0], "idle_ms": float(r[2]), "shared_ms": float(r[3])}
                              for r in rows],
                   "idle_ms": as_run["idle_ms"], "shared_ms": as_run["shared_ms"], "ratio": as_run["ratio"],
                   "passive": passive, "spinning": spinning}
json.dump(data, open(path + ".tmp", "w"), indent=1)
os.replace(path + ".tmp", path)
PY
