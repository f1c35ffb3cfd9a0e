#!/usr/bin/env python3
"""exercises/calc_check.py <exercise>: the check of a calculation exercise.

Reads the learner's numbers from answers.json (in the copy's root) and compares each with the
planner's (build/plan --json, the stages' own arithmetic) and, where the question is about a run,
with a measured run's stats.json or metrics.jsonl (which the planner must also match). Each answer
within its tolerance (relative, from exercises/catalogue.json) is a case that passes, any other
one that fails; the summary line "calc_check: N passed, N failed" lets the grader give points per
key. Only whether each answer is right is printed, never the right number.
"""
import json
import os
import subprocess
import sys
import tempfile

TINY = ["--config", "configs/tiny.json", "--max_seq_len=64", "--n_layer=2", "--n_embd=32", "--n_head=4",
        "--global_batch_size=8", "--eval_batches=0", "--log_interval=100"]
CLUSTER = "--cluster=configs/clusters/h100-sxm.json"
MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")


def plan(tmp, ranks, layout, extra=()):
    out = os.path.join(tmp, f"plan-{layout}-{ranks}.json")
    r = subprocess.run(["build/plan", CLUSTER, f"--ranks={ranks}", f"--layout={layout}", f"--json={out}", *TINY, *extra],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"build/plan --layout={layout} failed: {r.stderr.strip()[-400:]}")
    return json.load(open(out))["layouts"][0]


def run(tmp, p, ranks, steps=2, extra=()):
    """runs the planned layout for a few steps; returns (stats.json, metrics lines)"""
    out = os.path.join(tmp, "run")
    args = ["mpirun", "-np", str(ranks), "--bind-to", "none", f"build/stage-{p['stage']}", *TINY, *p["args"], *extra,
            f"--stop_iteration={steps}", f"--out_dir={out}"]
    r = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, **MPI_ENV))
    if r.returncode:
        sys.exit(f"the measured run failed: {(r.stdout + r.stderr).strip()[-400:]}")
    return json.load(open(os.path.join(out, "stats.json"))), [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]


def truth(ex_id, tmp):
    """the right answers, after checking that the planner's agree with a measured run"""
    if ex_id == "calc-ddp-comm":
        p = plan(tmp, 4, "ddp")
        stats, lines = run(tmp, p, 4)
        measured = {l["comm_bytes"] for l in lines}
        assert measured == {p["comm_bytes"]}, f"the run's comm_bytes {measured} differ from the plan's {p['comm_bytes']}"
        return {"parameters": p["memory"]["parameters (fp32)"] / 4, "allreduce_bytes_per_step": p["comm_bytes"],
                "bytes_sent_per_rank_per_step": p["comm_bytes"] * 2 * 3 / 4}
    if ex_id == "calc-fsdp-memory":
        p = plan(tmp, 2, "fsdp")
        stats, _ = run(tmp, p, 2)
        assert stats["memory"] == p["memory"], f"the run's memory {stats['memory']} differs from the plan's {p['memory']}"
        c = p["memory_by_category"]
        return {"parameter_bytes": c["parameters"], "gradient_bytes": c["gradients"], "optimizer_bytes": c["optimizer"],
                "gathered_bytes": c["gathered"]}
    if ex_id == "calc-bubble":
        def fraction(pp, m):
            q = plan(tmp, pp, f"pp{pp}", [f"--microbatches={m}", "--global_batch_size=16", "--n_layer=4"])
            return q["bubble_s"] / (q["compute_s"] + q["bubble_s"])
        return {"bubble_pp2_m4": fraction(2, 4), "bubble_pp4_m4": fraction(4, 4), "bubble_pp4_m16": fraction(4, 16)}
    if ex_id == "calc-muon-zero":
        adamw = plan(tmp, 4, "fsdp")["comm_bytes"]
        muon = ["--optimizer=muon"]
        owners = plan(tmp, 4, "fsdp", muon)
        redundant = plan(tmp, 4, "fsdp", muon + ["--muon_redundant=true", "--strategy=fsdp"])  # a key of stage 04's
        stats, lines = run(tmp, owners, 4, extra=muon)
        measured = {l["comm_bytes"] for l in lines}
        assert measured == {owners["comm_bytes"]}, f"the run's comm_bytes {measured} differ from the plan's {owners['comm_bytes']}"
        assert stats["memory"] == owners["memory"], f"the run's memory {stats['memory']} differs from the plan's {owners['memory']}"
        return {"muon_comm_bytes": owners["comm_bytes"] - adamw, "redundant_comm_bytes": redundant["comm_bytes"] - adamw,
                "muon_memory_bytes": owners["memory"]["Muon: gathered block + scratch"]}
    if ex_id == "calc-composed-memory":
        mesh = ["--microbatches=4"]
        p = plan(tmp, 8, "tp2-pp2", mesh)
        stats, _ = run(tmp, p, 8)
        assert stats["memory"] == p["memory"], f"the run's memory {stats['memory']} differs from the plan's {p['memory']}"
        c = p["memory_by_category"]
        gpipe = plan(tmp, 8, "tp2-pp2", mesh + ["--pp_schedule=gpipe"])
        return {"parameter_bytes": c["parameters"], "gradient_bytes": c["gradients"], "optimizer_bytes": c["optimizer"],
                "activation_bytes": c["activations"], "heaviest_total_bytes": gpipe["heaviest_memory_total"]}
    sys.exit(f"calc_check.py: no calculation exercise '{ex_id}'")


def tolerances(ex_id):
    cat = json.load(open("exercises/catalogue.json"))["exercises"]
    ex = next(e for e in cat if e["id"] == ex_id)
    return {q["key"]: q["tolerance"] for q in ex["questions"]}


def main():
    ex_id = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        want = truth(ex_id, tmp)
    try:
        got = json.load(open("answers.json"))
    except (OSError, ValueError) as e:
        sys.exit(f"answers.json: {e}")
    if not isinstance(got, dict):
        sys.exit("answers.json: expected an object of numbers by key, found " + type(got).__name__)
    wrong, keys = 0, tolerances(ex_id)
    for key, tol in keys.items():
        value = got.get(key)
        ok = isinstance(value, (int, float)) and abs(value - want[key]) <= tol * abs(want[key])
        print(f"{key}: {'right' if ok else 'wrong' if isinstance(value, (int, float)) else 'not answered'}"
              f" (your {value})")
        wrong += not ok
    print(f"calc_check: {len(keys) - wrong} passed, {wrong} failed")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
