"""step_bound.py: a training step against what this machine allows it, op by op.

Reads a run made with `trace: true` (its trace.json, whose op spans carry each op's bytes and
FLOPs: common/base/trace.h, trace_op_end; and its metrics.jsonl) and the ceilings build/ceilings
measured (its CEILING_* variables, from the environment). An op's bound is the longer of

  - its FLOPs at the matmul ceiling: a linear layer's at the ceiling measured for its shape and
    precision (CEILING_MATMUL_F32_768x2304 ...; the whole set's, CEILING_MATMUL_F32 or _BF16, for
    a shape not measured), attention's matmul-shaped products (QK^T and PV, f32 on the CPU) at
    the f32 one;
  - the bytes it must read and write at least (its inputs and outputs once) at the read
    bandwidth (CEILING_READ);

and the step's bound is the sum over its ops. Steps are told apart by their "embedding forward"
span; the first (warm-up) is left out, and each figure is the mean over the others (a step's
shape follows its batch).

  step_bound.py RUN_DIR --label=TEXT [--json=FILE]

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


def op_bound(name, args, ceil):
    """seconds: the longer of the op's FLOPs at its matmul ceiling and its bytes at the read rate"""
    flops, nbytes = args["flops"], args["bytes"]
    precision = "BF16" if name.endswith("_16") else "F32"
    rate = ceil[f"MATMUL_{precision}"]
    if "shape" in args:
        _, c, oc = args["shape"].split("x")
        rate = ceil.get(f"MATMUL_{precision}_{c}x{oc}", rate)
    return max(flops / rate if flops else 0.0, nbytes / ceil["READ"])


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


def analyse(run_dir, ceil):
    path = os.path.join(run_dir, "trace.json")
    if not os.path.exists(path):
        sys.exit(f"step_bound.py: {path} does not exist: run with trace: true (--trace=true --trace_steps=N)")
    events = json.load(open(path))["traceEvents"]
    steps = steps_of(events)[1:]
    if not any(steps):
        sys.exit(f"step_bound.py: {path} holds no op spans: the backend that ran records none "
                 "(the CPU backend does: common/ops/ops_cpu.c)")
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    traced = metrics[1:1 + len(steps)]
    # a step's shape follows its batch (its longest sequence): each figure is the mean per step
    per_step = 1.0 / len(steps)
    rows = {}
    for k, step in enumerate(steps):
        for e in step:
            r = rows.setdefault(row_key(e), {"op": row_key(e), "calls": 0, "ms": 0.0, "bytes": 0.0, "flops": 0.0,
                                             "bound_ms": 0.0})
            r["calls"] += per_step
            r["ms"] += per_step * e["dur"] / 1e3
            r["bytes"] += per_step * e["args"]["bytes"]
            r["flops"] += per_step * e["args"]["flops"]
            r["bound_ms"] += per_step * 1e3 * op_bound(e["name"], e["args"], ceil)
    for r in rows.values():
        r["share_of_bound"] = r["bound_ms"] / r["ms"] if r["ms"] > 0 else None
    ops = sorted(rows.values(), key=lambda r: -r["ms"])
    step_ms = statistics.mean(m["ms"] for m in traced)
    bound_ms = sum(r["bound_ms"] for r in ops)
    ops_ms = sum(r["ms"] for r in ops)
    flop_bound = sum(r["bound_ms"] for r in ops if r["flops"])
    return {"steps": len(steps), "step_ms": step_ms, "bound_ms": bound_ms, "ratio": step_ms / bound_ms,
            "flop_bound_ms": flop_bound, "byte_bound_ms": bound_ms - flop_bound,
            "ops_ms": ops_ms, "outside_ops_ms": step_ms - ops_ms,
            "ceilings": {k: v for k, v in ceil.items()}, "ops": ops}


def report(label, a):
    print(f"{label}: step {a['step_ms']:.1f} ms, bound {a['bound_ms']:.1f} ms "
          f"({a['flop_bound_ms']:.1f} ms of FLOPs at the matmul ceilings + {a['byte_bound_ms']:.1f} ms of bytes "
          f"at {a['ceilings']['READ'] / 1e9:.1f} GB/s): {a['ratio']:.2f}x its bound "
          f"(mean of {a['steps']} steps after the first)")
    print(f"| {'op (matmul: C x OC)':<32} | calls |      ms |      MB |  GFLOP | bound ms | bound/time |")
    print(f"|{'-' * 34}|-------|---------|---------|--------|----------|------------|")
    for r in a["ops"]:
        share = f"{100 * r['share_of_bound']:9.0f}%" if r["share_of_bound"] is not None else "         -"
        print(f"| {r['op']:<32} | {r['calls']:>5.0f} | {r['ms']:>7.1f} | {r['bytes'] / 1e6:>7.1f} "
              f"| {r['flops'] / 1e9:>6.2f} | {r['bound_ms']:>8.2f} | {share} |")
    print(f"| {'(outside any op: data, the loop)':<32} |       | {a['outside_ops_ms']:>7.1f} |         "
          f"|        |          |            |")


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    if len(args) != 1 or "label" not in opts:
        sys.exit("usage: step_bound.py RUN_DIR --label=TEXT [--json=FILE]")
    a = analyse(args[0], ceilings())
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
