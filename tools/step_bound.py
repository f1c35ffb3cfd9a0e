"""step_bound.py: a training step against what this machine allows it, op by op.

Reads a run made with `trace: true` (its trace.json, whose op spans carry each op's bytes and
FLOPs: common/base/trace.h, trace_op_end; and its metrics.jsonl) and the ceilings build/ceilings
measured (its CEILING_* variables, from the environment). An op's bound is the longer of

  - its FLOPs at the matmul ceiling: a linear layer's at the ceiling measured for its shape,
    precision and direction (CEILING_MATMUL_F32_FWD_768x2304, ..._BWD_...: a backward reads an
    operand transposed; the whole set's, CEILING_MATMUL_F32 or _BF16, for a shape not measured),
    attention's matmul-shaped products (QK^T and PV) at the f32 one, or the bf16 one for the
    16-bit precisions' attention_forward_16 and attention_backward_16 (as every op named *_16);
  - the bytes it must read and write at least (its inputs and outputs once) at the bandwidth
    measured the way it uses memory (CEILING_BW_READ_<bytes> for an op that only reads,
    CEILING_BW_WRITE_ for one that only writes, the faster of CEILING_BW_READ_ and
    CEILING_BW_UPDATE_ for one that does both) at the measured sizes around its working set (a
    set that fits a cache runs at that cache's rate, one that does not streams; CEILING_READ, the
    streaming read, where no size was measured). A call's working set is what it moves, but an
    optimizer's sweep over the model's state (AdamW's, Muon's: a call per tensor, each moving
    state no other op touched since the last step's sweep) streams as a whole: its calls are
    bounded at the rate of the whole sweep's bytes;

and the step's bound is the sum over its ops. A bound is what the op cannot beat: an op that
runs faster than its bound shows a ceiling measured too low (a busy machine, a size or layout
not measured), and is printed as a measurement error naming that ceiling ("over_bound"). Steps
are told apart by their "embedding forward" span; each run's first (warm-up) is left out, and the
figures are the fastest of the others' (of every run given: the same step run at several moments)
and its ops' (each ceiling is the best of its timings too: other work on the machine slows a
step, not a bound), the steps' mean printed beside it.

  step_bound.py RUN_DIR [RUN_DIR ...] --label=TEXT [--json=FILE]

prints the step against its bound and a table per op (and per shape for a matmul): its time,
bytes, FLOPs, bound and the share of its bound it reaches (bound / time); --json adds the same
figures under "step_bound" -> TEXT in FILE (created, or updated in place).
"""
import json
import os
import statistics
import sys


def ceilings():
    c = {k[len("CEILING_"):]: float(v) for k, v in os.environ.items() if k.startswith("CEILING_")}
    for need in ("MATMUL_F32", "MATMUL_BF16", "READ"):
        if need not in c:
            sys.exit(f"step_bound.py: CEILING_{need} is not in the environment: "
                     "evaluate build/ceilings' output first (eval \"$(build/ceilings N C V)\")")
    return c


READ_ONLY = ("sum_squares", "sum_values")  # the ops that write nothing but a few sums
WRITE_ONLY = ("dev_zero",)
# the ops that sweep the model's state once a step, a call per tensor
SWEEPS = ("adamw_update", "adamw_update_16", "muon_momentum")


def matmul_ceiling(name, args, ceil):
    """(FLOP/s, its ceiling's name) for an op's FLOPs: its shape's and direction's, else the set's"""
    precision = "BF16" if name.endswith("_16") else "F32"
    key = f"MATMUL_{precision}"
    if "shape" in args:
        _, c, oc = args["shape"].split("x")
        direction = "BWD" if "backward" in name else "FWD"
        if f"MATMUL_{precision}_{direction}_{c}x{oc}" in ceil:
            key = f"MATMUL_{precision}_{direction}_{c}x{oc}"
    return ceil[key], key


def bandwidth_ceiling(name, size, ceil):
    """(bytes/s, its ceiling's name) for an op whose working set is `size` bytes: the fastest
    measured of the kinds of memory use it may have, at the two measured sizes around `size` (the
    largest not above it, the smallest not below it). Bandwidth falls as a working set outgrows
    each cache, so a smaller size's rate is the bound's, and not one far smaller (a 500 MB sweep
    does not run at a 4 MiB set's cache rate); the larger neighbour covers the small sizes, where
    a call's fixed cost makes the rate rise with size. CEILING_READ where none was measured"""
    kinds = ("READ",) if name in READ_ONLY else ("WRITE",) if name in WRITE_ONLY else ("READ", "UPDATE")
    measured = []
    for kind in kinds:
        sizes = sorted(int(k.rsplit("_", 1)[1]) for k in ceil if k.startswith(f"BW_{kind}_"))
        below = [s for s in sizes if s <= size][-1:]
        above = [s for s in sizes if s >= size][:1]
        measured += [(ceil[f"BW_{kind}_{s}"], f"BW_{kind}_{s}") for s in set(below + above)]
    return max(measured) if measured else (ceil["READ"], "READ")


def op_bound(name, args, ceil, size):
    """(seconds, the ceiling that sets it): the longer of the op's FLOPs at its matmul ceiling and
    its bytes at the bandwidth ceiling of a working set of `size` bytes"""
    flops, nbytes = args["flops"], args["bytes"]
    by_flops, by_bytes = (0.0, None), (0.0, None)
    if flops:
        rate, key = matmul_ceiling(name, args, ceil)
        by_flops = (flops / rate, key)
    if nbytes:
        rate, key = bandwidth_ceiling(name, size, ceil)
        by_bytes = (nbytes / rate, key)
    seconds, key = max(by_flops, by_bytes, key=lambda b: b[0])
    return seconds, f"CEILING_{key}" if key else None


def sweep_bytes(step):
    """each sweep's bytes in a step, all its calls together"""
    totals = {}
    for e in step:
        if e["name"] in SWEEPS:
            totals[e["name"]] = totals.get(e["name"], 0.0) + e["args"]["bytes"]
    return totals


def steps_of(events):
    """the op events of each traced step, in order"""
    starts = sorted(e["ts"] for e in events if e["name"] == "embedding forward")
    if len(starts) < 2:
        sys.exit("step_bound.py: the trace holds fewer than 2 steps (\"embedding forward\" spans): "
                 "run with trace_steps >= 2")
    steps = [[] for _ in starts]
    for e in events:
        if not e.get("args", {}).get("op"):
            continue
        k = sum(1 for s in starts if s <= e["ts"]) - 1
        if k >= 0:
            steps[k].append(e)
    return steps


def row_key(e):
    shape = e["args"].get("shape")
    return f"{e['name']} {shape.split('x', 1)[1]}" if shape else e["name"]


def traced_steps(run_dir):
    """a run's traced steps after the first: [(its op events, its metrics line)]"""
    path = os.path.join(run_dir, "trace.json")
    if not os.path.exists(path):
        sys.exit(f"step_bound.py: {path} does not exist: run with trace: true (--trace=true --trace_steps=N)")
    events = json.load(open(path))["traceEvents"]
    steps = steps_of(events)[1:]
    if not any(steps):
        sys.exit(f"step_bound.py: {path} holds no op spans: the backend that ran records none "
                 "(the CPU backend does: common/ops/ops_cpu.c)")
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return list(zip(steps, metrics[1:1 + len(steps)]))


def step_tokens(metrics):
    """the tokens a step trained on, from its metrics line (its time and tokens a second)"""
    return round(metrics["tokens_per_sec"] * metrics["ms"] / 1e3)


def analyse(run_dirs, ceil):
    runs = [step for run_dir in run_dirs for step in traced_steps(run_dir)]
    traced = [m for _, m in runs]
    # the fastest step of all the runs and its ops, as the ceilings are each the best of their
    # timings: other work on the machine slows some steps, and a bound has no such share in it
    # (the mean is kept beside it). Fastest a token: a batch's length moves its step's time
    fastest = min(range(len(runs)), key=lambda k: traced[k]["ms"] / step_tokens(traced[k]))
    step = runs[fastest][0]
    # a call's working set: what it moves, or a sweep's whole
    sweeps = sweep_bytes(step)
    rows = {}
    for e in step:
        r = rows.setdefault(row_key(e), {"op": row_key(e), "calls": 0, "ms": 0.0, "bytes": 0.0, "flops": 0.0,
                                         "bound_ms": 0.0, "ceilings": {}})
        seconds, key = op_bound(e["name"], e["args"], ceil, sweeps.get(e["name"], e["args"]["bytes"]))
        r["calls"] += 1
        r["ms"] += e["dur"] / 1e3
        r["bytes"] += e["args"]["bytes"]
        r["flops"] += e["args"]["flops"]
        r["bound_ms"] += 1e3 * seconds
        if key:
            r["ceilings"][key] = r["ceilings"].get(key, 0.0) + 1e3 * seconds
    for r in rows.values():
        r["share_of_bound"] = r["bound_ms"] / r["ms"] if r["ms"] > 0 else None
        # the ceiling that sets most of the row's bound: the one a time under the bound shows too low
        r["ceiling"] = max(r["ceilings"], key=r["ceilings"].get) if r["ceilings"] else None
    ops = sorted(rows.values(), key=lambda r: -r["ms"])
    over = [{"op": r["op"], "ms": r["ms"], "bound_ms": r["bound_ms"], "ceiling": r["ceiling"],
             "value": ceil.get(r["ceiling"][len("CEILING_"):]) if r["ceiling"] else None}
            for r in ops if r["ms"] < r["bound_ms"]]
    step_ms = traced[fastest]["ms"]
    bound_ms = sum(r["bound_ms"] for r in ops)
    ops_ms = sum(r["ms"] for r in ops)
    flop_bound = sum(r["bound_ms"] for r in ops if r["flops"])
    return {"steps": len(runs), "step_ms": step_ms, "step_tokens": step_tokens(traced[fastest]),
            "mean_step_ms": statistics.mean(m["ms"] for m in traced),
            "bound_ms": bound_ms, "ratio": step_ms / bound_ms,
            "flop_bound_ms": flop_bound, "byte_bound_ms": bound_ms - flop_bound,
            "ops_ms": ops_ms, "outside_ops_ms": step_ms - ops_ms,
            "ceilings": {k: v for k, v in ceil.items()}, "ops": ops, "over_bound": over}


def report(label, a):
    print(f"{label}: step {a['step_ms']:.1f} ms ({a['step_tokens']} tokens), bound {a['bound_ms']:.1f} ms "
          f"({a['flop_bound_ms']:.1f} ms of FLOPs at the matmul ceilings + {a['byte_bound_ms']:.1f} ms of bytes "
          f"at {a['ceilings']['READ'] / 1e9:.1f} GB/s): {a['ratio']:.2f}x its bound "
          f"(the fastest a token of {a['steps']} traced steps after each run's first, and its ops; their mean "
          f"{a['mean_step_ms']:.1f} ms)")
    print(f"| {'op (matmul: C x OC)':<32} | calls |      ms |      MB |  GFLOP | bound ms | bound/time |")
    print(f"|{'-' * 34}|-------|---------|---------|--------|----------|------------|")
    for r in a["ops"]:
        share = f"{100 * r['share_of_bound']:9.0f}%" if r["share_of_bound"] is not None else "         -"
        print(f"| {r['op']:<32} | {r['calls']:>5.0f} | {r['ms']:>7.1f} | {r['bytes'] / 1e6:>7.1f} "
              f"| {r['flops'] / 1e9:>6.2f} | {r['bound_ms']:>8.2f} | {share} |")
    print(f"| {'(outside any op: data, the loop)':<32} |       | {a['outside_ops_ms']:>7.1f} |         "
          f"|        |          |            |")
    for o in a["over_bound"]:
        unit = "FLOP/s" if "MATMUL" in o["ceiling"] else "bytes/s"
        print(f"measurement error: {o['op']} took {o['ms']:.2f} ms, under its bound of {o['bound_ms']:.2f} ms: "
              f"{o['ceiling']} ({o['value']:.4g} {unit}) was measured too low")


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    if not args or "label" not in opts:
        sys.exit("usage: step_bound.py RUN_DIR [RUN_DIR ...] --label=TEXT [--json=FILE]")
    a = analyse(args, ceilings())
    report(opts["label"], a)
    if "json" in opts:
        path = opts["json"]
        data = json.load(open(path)) if os.path.exists(path) else {}
        data.setdefault("step_bound", {})[opts["label"]] = a
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)


if __name__ == "__main__":
    main(sys.argv[1:])
