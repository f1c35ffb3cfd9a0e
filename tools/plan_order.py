"""plan_order.py: does the planner order layouts by step time as this machine does? Reads the JSON
of `build/plan --measure --passes=N --json=FILE` (N >= 2) and compares the two orders only where
each can tell two layouts apart (docs/PLANNER.md, "How far off"):

  - a layout's quiet passes are those during which other jobs kept fewer than QUIET_CORES of the
    cores busy (build/plan measures it: passes_others_cores); one with fewer than MIN_QUIET is
    disturbed, and its pairs are not measured;
  - the measurement orders two layouts when their quiet passes' ranges do not overlap (the slower
    layout's fastest pass is slower than the faster one's slowest pass); otherwise they are tied
    in the measurement: this machine cannot say which is faster;
  - the prediction orders them when its step times differ by more than the model's stated error
    (MODEL_ERROR: one predicted more than 1 + MODEL_ERROR times the other); otherwise they are
    tied in the prediction.

The order agrees when no pair ordered by both is ordered oppositely (and some pair is ordered by
both: a busy machine measures nothing, and the bench says so rather than "agrees").

  plan_order.py PLAN.json [--label=TEXT] [--model-error=E] [--json=OUT]

prints the comparison (the pairs that disagree by name) with Spearman's rank correlation of the
two full orders and the measured / predicted step time ratios; --json writes the counts as data.
"""
import json
import sys

# How far apart (relative) the model's step times of two layouts may be from the measured ones:
# docs/PLANNER.md, "How far off", states it from the runs there
MODEL_ERROR = 0.10
# Other jobs' use of the cores during a pass above which the pass measured them too: this machine's
# own daemons keep about 0.01 busy, and another job on one core for a fifth of a run slows 4
# ranks on 2 cores by about a tenth, the resolution sought here
QUIET_CORES = 0.15
# Quiet passes a layout needs to be compared: two equally fast layouts with a and b of them come
# out ordered (one's passes all below the other's) with chance 2 / C(a + b, a): 1 in 10 with 3
# and 3, 1 in 126 with 5 and 5; with 2 and 2 it would be 1 in 3
MIN_QUIET = 3


def quiet_passes(layout):
    """the step times of the passes during which other jobs left the cores alone (all of them
    where that was not measured)"""
    m = layout["measured"]
    others = m.get("passes_others_cores", [-1] * len(m["passes_step_s"]))
    return [t for t, o in zip(m["passes_step_s"], others) if o < QUIET_CORES]


def disturbed(layout):
    return len(quiet_passes(layout)) < MIN_QUIET


def measured_step(layout):
    """the fastest quiet pass; a disturbed layout's fastest pass"""
    return min(quiet_passes(layout) if not disturbed(layout) else layout["measured"]["passes_step_s"])


def measured_order(a, b):
    """-1 when a is measured faster than b beyond the spread, 1 when slower, 0 when tied"""
    qa, qb = quiet_passes(a), quiet_passes(b)
    return -1 if max(qa) < min(qb) else 1 if max(qb) < min(qa) else 0


def predicted_order(a, b, model_error):
    """-1 when a is predicted faster than b by more than the model's error, 1 when slower, 0 when tied"""
    fast, slow = sorted((a["step_s"], b["step_s"]))
    if slow <= fast * (1 + model_error):
        return 0
    return -1 if a["step_s"] < b["step_s"] else 1


def compare_pairs(layouts, model_error=MODEL_ERROR):
    """every pair of layouts, sorted into: not measured (a layout disturbed), ordered by both and
    agreeing, ordered by both and disagreeing, tied in the measurement, ordered by the measurement
    but tied in the prediction"""
    out = {"agree": [], "disagree": [], "measured_tie": [], "predicted_tie": [], "disturbed": []}
    for i, a in enumerate(layouts):
        for b in layouts[i + 1:]:
            fast, slow = (a, b) if a["step_s"] <= b["step_s"] else (b, a)  # as predicted
            pair = (fast["name"], slow["name"])
            if disturbed(a) or disturbed(b):
                out["disturbed"].append(pair)
                continue
            m, p = measured_order(a, b), predicted_order(a, b, model_error)
            kind = "measured_tie" if m == 0 else "predicted_tie" if p == 0 else "agree" if m == p else "disagree"
            out[kind].append(pair)
    return out


def spearman(layouts):
    n = len(layouts)
    rank = lambda key: {l["name"]: i for i, l in enumerate(sorted(layouts, key=key))}
    rp, rm = rank(lambda l: l["step_s"]), rank(measured_step)
    return 1 - 6 * sum((rp[k] - rm[k]) ** 2 for k in rp) / (n * (n * n - 1)) if n > 1 else 1.0


def verdict(pairs):
    """'no' when a pair is ordered oppositely, 'yes' when some are ordered by both and none so,
    and no verdict when nothing was ordered by both (a busy machine measures nothing)"""
    if pairs["disagree"]:
        return "no"
    return "yes" if pairs["agree"] else "nothing to compare (no pair ordered by both)"


def summary(layouts):
    """Spearman and the measured/predicted ratios, over the layouts measured on quiet passes:
    a disturbed layout's passes timed another job as well"""
    quiet = [l for l in layouts if not disturbed(l)]
    if len(quiet) < 2:
        return "Spearman and measured/predicted: fewer than 2 layouts measured quietly"
    ratios = [measured_step(l) / l["step_s"] for l in quiet]
    return (f"Spearman {spearman(quiet):.2f}, measured/predicted step time {min(ratios):.2f} to {max(ratios):.2f} "
            f"(the {len(quiet)} layouts measured quietly)")


def report(layouts, label, model_error):
    pairs = compare_pairs(layouts, model_error)
    exact = all(l["measured"]["comm_bytes"] == l["comm_bytes"] and l["measured"]["memory_agrees"] for l in layouts)
    by = lambda key: " < ".join(l["name"] + ("*" if disturbed(l) else "") for l in sorted(layouts, key=key))
    pad = " " * len(label)
    n_pairs = sum(len(v) for v in pairs.values())
    lines = [f"{label}: predicted order {by(lambda l: l['step_s'])}",
             f"{pad}  measured order  {by(measured_step)} (fastest quiet passes; *: disturbed, fastest pass)",
             f"{pad}  of {n_pairs} pairs: {len(pairs['agree']) + len(pairs['disagree'])} ordered by both, "
             f"{len(pairs['agree'])} agreeing; {len(pairs['measured_tie'])} tied in the measurement (passes overlap); "
             f"{len(pairs['predicted_tie'])} ordered by the measurement only (predicted within {100 * model_error:.0f}%); "
             f"{len(pairs['disturbed'])} not measured (a layout with fewer than {MIN_QUIET} quiet passes)",
             f"{pad}  order agrees: {verdict(pairs)}; {summary(layouts)}; bytes and memory as planned: "
             f"{'yes' if exact else 'NO'}"]
    lines += [f"{pad}  DISAGREE: predicted {fast} < {slow}, measured the other way" for fast, slow in pairs["disagree"]]
    for l in sorted(layouts, key=lambda l: l["step_s"]):
        quiet, passes = quiet_passes(l), l["measured"]["passes_step_s"]
        spread = f"{1e3 * min(quiet):8.1f} to {1e3 * max(quiet):8.1f} ms" if quiet else f"{'no pass':>23}"
        lines.append(f"    {l['name']:<20} predicted {1e3 * l['step_s']:8.1f} ms  measured {spread} over {len(quiet)} of "
                     f"{len(passes)} passes quiet  ratio {measured_step(l) / l['step_s']:.2f}"
                     + ("  (disturbed: not compared)" if disturbed(l) else ""))
    return "\n".join(lines), pairs


def main(argv):
    opts = dict(a[2:].split("=", 1) for a in argv[1:] if a.startswith("--") and "=" in a)
    paths = [a for a in argv[1:] if not a.startswith("--")]
    if len(paths) != 1:
        sys.exit(__doc__)
    layouts = json.load(open(paths[0]))["layouts"]
    few = [l["name"] for l in layouts if len(l.get("measured", {}).get("passes_step_s", [])) < 2]
    if few:
        sys.exit(f"{paths[0]}: {', '.join(few)}: expected at least 2 measured passes (build/plan --measure --passes=N), "
                 "found fewer: one pass has no spread to tell a tie from an order")
    text, pairs = report(layouts, opts.get("label", paths[0]), float(opts.get("model-error", MODEL_ERROR)))
    print(text)
    if "json" in opts:
        json.dump({k: [list(p) for p in v] for k, v in pairs.items()}, open(opts["json"], "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv)
