#!/usr/bin/env bash
# Graceful sharing: stage 01's step on an idle machine and with another process keeping one core
# busy (a shell loop pinned to the last core), interleaved over rounds, so that both see the same
# machine. On 2 cores, losing one should cost about 2x, no more: OpenMP threads that spin at
# barriers made it 6-9x. Each run twice: as the stages run (their threads wait passively:
# common/ops_cpu.c, restart_with_passive_waiting) and with libgomp's default, spinning ~3 ms
# first (GOMP_SPINCOUNT=300000), for the cost of passive waiting on an idle machine and its gain on
# a shared one. The figures go to $BENCH_JSON under "sharing". Runs alone too: `make bench-sharing`.
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
echo "| round | waiting  |  idle ms | shared ms | shared / idle |"
echo "|-------|----------|----------|-----------|---------------|"
spin=GOMP_SPINCOUNT=300000
for r in $(seq "$rounds"); do
    idle=$(step_ms "idle$r") idle_spin=$(step_ms "idle_spin$r" $spin)
    taskset -c "$last_core" sh -c 'while :; do :; done' &
    busy=$!
    shared=$(step_ms "shared$r") shared_spin=$(step_ms "shared_spin$r" $spin)
    kill "$busy"; wait "$busy" 2>/dev/null || true; busy=
    echo "$r $idle $shared $idle_spin $shared_spin" >>"$out/rounds"
    python3 -c 'import sys
r, i, s, i2, s2 = sys.argv[1:]
for what, a, b in (("passive", i, s), ("spinning", i2, s2)):
    print(f"| {r:>5} | {what:<8} | {float(a):>8.1f} | {float(b):>9.1f} | {float(b) / float(a):>13.2f} |")' "$r" "$idle" "$shared" "$idle_spin" "$shared_spin"
done
python3 - "$out/rounds" "$BENCH_JSON" "${run_args[*]}" "$(uptime)" <<'PY'
import json, os, statistics, sys
rows = [[float(x) for x in line.split()] for line in open(sys.argv[1])]
idle, shared, idle_spin, shared_spin = (statistics.median(r[k] for r in rows) for k in (1, 2, 3, 4))
print(f"median: idle {idle:.1f} ms, shared {shared:.1f} ms: {shared / idle:.2f}x (on 2 cores, about 2x is the cost of the core);")
print(f"spinning: idle {idle_spin:.1f} ms, shared {shared_spin:.1f} ms: {shared_spin / idle_spin:.2f}x; "
      f"passive waiting costs {100 * (idle / idle_spin - 1):+.1f}% idle")
path = sys.argv[2]
data = json.load(open(path)) if os.path.exists(path) else {}
data["sharing"] = {"run": sys.argv[3], "threads": int(os.environ["OMP_NUM_THREADS"]), "uptime": sys.argv[4].strip(),
                   "rounds": [{"idle_ms": r[1], "shared_ms": r[2], "spinning_idle_ms": r[3], "spinning_shared_ms": r[4]}
                              for r in rows],
                   "idle_ms": idle, "shared_ms": shared, "ratio": shared / idle,
                   "spinning": {"env": "GOMP_SPINCOUNT=300000", "idle_ms": idle_spin, "shared_ms": shared_spin,
                                "ratio": shared_spin / idle_spin}}
json.dump(data, open(path + ".tmp", "w"), indent=1)
os.replace(path + ".tmp", path)
PY
