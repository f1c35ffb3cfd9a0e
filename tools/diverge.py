"""diverge.py [--tol R] [--tensor-tol R] [--json FILE] [REFERENCE] RUN: where two training runs part.

With RUN alone the reference is made first: the run's config (its checkpoint's run_config) run
as one process for as many steps as RUN logged, without its layout's keys, by stage 01 (stage 02
for a 16-bit precision, stage 08 for a mixture of experts), into RUN-reference/ (started over;
the config it ran is reference_config.json there).

Reads what the runs already wrote to their out_dirs (metrics.jsonl, stats.json, the checkpoint's
model.safetensors or LoRA's adapter_model.safetensors, with the run's config in its metadata and
the step in optimizer.safetensors') and names:
  - the first step where a figure that says what the training did (loss, lr, grad_norm,
    val_loss, a mixture of experts' load, fp16's loss scale ...) differs by more than --tol
    relative (default 1e-5, the fp32 bound every stage keeps against stage 01);
  - when both checkpoints are of the same step, the tensors whose largest element difference
    exceeds --tensor-tol (default 1e-2) of their largest magnitude, the worst first; and
  - the ranks of the run that hold the worst tensor, from its layout: a pipeline stage's blocks
    (stage 07's rank = replica x pp + stage; stage 10's mesh, pipeline outermost: rank =
    ((stage x dp + replica) x cp + c) x tp + t, every rank of the stage holding a part), an
    expert rank's experts (stage 08's rank = replica x ep + expert rank), every rank where the
    tensor is replicated or sharded (data, tensor and context parallelism).
The tensor tolerance is looser than the loss's: AdamW divides each gradient element by its own
size, so an element whose gradient is zero but for rounding (GPT-2's attention key bias) takes
steps of the learning rate's size either way, and the weights of two equal runs drift apart by
1e-3 of their size in a few steps (stage 03 on 3 ranks against stage 01: 9e-4 after 6 steps).
The loss and the norm keep the tight bound; the tensors say where to look. A checkpoint is of
the run's last step: to see the tensors where the runs first part, run both again with
--stop_iteration=<that step>.
Prints a few lines for people; --json writes the same as data (reference, run, tolerance,
tensor_tolerance, steps_compared, steps_apart (logged by one run only), first_step {step, figures [{name, reference, run,
relative}]} or null, checkpoint_step, checkpoint_note, tensors [{name, relative (null: in one file
only, or shapes apart), ranks, held_by}], agree).
Exit status: 0 when the runs agree, 1 when they differ, 2 when a run cannot be read."""
import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
from array import array

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the keys that lay a run out over ranks (and where it writes): the reference runs without them
LAYOUT_KEYS = ("strategy", "tp_dimensions", "pp_size", "num_microbatches", "pp_schedule", "virtual_stages", "ep_size",
               "cp_size", "cp_impl", "zero_stage", "hsdp_replicas", "overlap_communication", "bucket_size_mb",
               "vocab_parallel_loss", "sequence_parallel", "comm_backend", "out_dir", "resume", "stop_iteration", "trace",
               "trace_steps")

# metrics.jsonl figures that say how a run is laid out or how fast it ran, not what it trained
NOT_TRAINING = {"step", "ms", "tokens_per_sec", "mfu", "mem_bytes", "comm_bytes", "comm_ms", "state_bytes",
                "grad_underflow"}


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def read_metrics(run):
    """{step: record} from run/metrics.jsonl; a resumed run's lines for a step replace the earlier ones"""
    path = os.path.join(run, "metrics.jsonl")
    steps = {}
    try:
        for number, line in enumerate(open(path), 1):
            try:
                record = json.loads(line)
                steps[int(record["step"])] = record
            except (ValueError, KeyError, TypeError):
                fail(f"{path}:{number}: expected one JSON object with a 'step', found {line.strip()[:80]!r}")
    except OSError as e:
        fail(f"{path}: {e.strerror}")
    if not steps:
        fail(f"{path}: no steps logged")
    return steps


def gap(x, y):
    """relative difference of two logged values: numbers, lists of numbers, or anything compared whole"""
    if isinstance(x, list) and isinstance(y, list):
        return max((gap(a, b) for a, b in zip(x, y)), default=0.0) if len(x) == len(y) else math.inf
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
    if not numbers or x == y:
        return 0.0 if x == y else math.inf
    return abs(x - y) / max(abs(x), 1e-30)


def first_step(ref, run, tol):
    """the first step both logged where a training figure differs beyond tol, with those figures"""
    for step in sorted(set(ref) & set(run)):
        a, b = ref[step], run[step]
        figures = [{"name": k, "reference": a[k], "run": b[k], "relative": gap(a[k], b[k])}
                   for k in sorted(set(a) & set(b) - NOT_TRAINING)]
        differing = [f for f in figures if not f["relative"] <= tol]
        if differing:
            return {"step": step, "figures": differing}
    return None


# ---- checkpoints ------------------------------------------------------------------------------

def read_header(path):
    """(header without __metadata__, metadata, offset of the data) of a safetensors file"""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        fail(f"{path}: not a readable safetensors file ({e})")
    return header, header.pop("__metadata__", {}) or {}, 8 + n


def read_tensor(path, entry, data_start):
    if entry["dtype"] != "F32":
        fail(f"{path}: a tensor is {entry['dtype']}: the finder reads the F32 checkpoints the stages write")
    begin, end = entry["data_offsets"]
    values = array("f")
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        values.frombytes(f.read(end - begin))
    if sys.byteorder != "little":
        values.byteswap()
    return values


def checkpoint_step(run):
    """the step of the run's checkpoint: its optimizer state's, or the last logged (a LoRA run
    keeps no optimizer state and saves its adapters at its end)"""
    path = os.path.join(run, "optimizer.safetensors")
    if not os.path.exists(path):
        return max(read_metrics(run))
    return int(read_header(path)[1].get("step", -1))


def weights_file(run):
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if os.path.exists(os.path.join(run, name)):
            return os.path.join(run, name)
    return None


def relative_difference(a, b):
    """largest element difference over the tensor's largest magnitude"""
    scale = max(map(abs, a), default=0.0)
    worst = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    return worst / scale if scale else (0.0 if worst == 0 else math.inf)


def differing_tensors(ref_file, run_file, tensor_tol):
    """[(relative, name)] beyond tensor_tol, the worst first; a tensor one file lacks or shapes
    apart counts as infinitely far"""
    (ha, _, sa), (hb, _, sb) = read_header(ref_file), read_header(run_file)
    found = []
    for name in sorted(set(ha) | set(hb)):
        if name not in ha or name not in hb or ha[name]["shape"] != hb[name]["shape"]:
            found.append((math.inf, name))
            continue
        r = relative_difference(read_tensor(ref_file, ha[name], sa), read_tensor(run_file, hb[name], sb))
        if not r <= tensor_tol:
            found.append((r, name))
    return sorted(found, key=lambda t: -t[0])


# ---- which ranks hold a tensor ----------------------------------------------------------------

def stage_blocks(n_layer, stages, stage):
    """blocks [first, first + n) of a pipeline stage: stage 07's split (pipeline.c stage_blocks)"""
    base, extra = divmod(n_layer, stages)
    return stage * base + min(stage, extra), base + (stage < extra)


def holders(run, name):
    """(ranks, words) of the run's ranks that hold tensor `name`"""
    try:
        stats = json.load(open(os.path.join(run, "stats.json")))
    except (OSError, ValueError):
        return None, "unknown (no stats.json)"
    world, layout = int(stats.get("world_size", 1)), stats.get("layout", {})
    header, metadata, _ = read_header(weights_file(run))
    config = json.loads(metadata.get("run_config", "{}"))
    block = re.search(r"\.(?:h|layers)\.(\d+)\.", name)
    pp = int(layout.get("pp", 1))
    if pp > 1:
        chunks = int(config.get("virtual_stages", 1)) if config.get("pp_schedule") == "interleaved" else 1
        if block:
            layer = int(block.group(1))
            virtual = next(v for v in range(pp * chunks)
                           if 0 <= layer - stage_blocks(int(config["n_layer"]), pp * chunks, v)[0]
                           < stage_blocks(int(config["n_layer"]), pp * chunks, v)[1])
            stages = [virtual % pp]
        elif re.search(r"wte|embed_tokens", name):  # tied: the last stage's head holds it too
            stages = [0] if "lm_head.weight" in header else [0, pp - 1]
        elif "wpe" in name:
            stages = [0]
        else:
            stages = [pp - 1]
        words = f"pipeline stage {' and '.join(map(str, stages))} of {pp}"
        if stats.get("stage") == 10:  # the mesh: rank = ((stage x dp + replica) x cp + c) x tp + t
            per_stage = world // pp
            ranks = [s * per_stage + r for s in sorted(stages) for r in range(per_stage)]
            return ranks, f"{words}, a part on each of its {per_stage} ranks (stage 10's mesh)"
        ranks = sorted(replica * pp + s for replica in range(world // pp) for s in stages)
        return ranks, words
    expert = re.search(r"\.experts\.(\d+)\.", name)
    ep = int(layout.get("ep", 1))
    if ep > 1 and expert:
        per_rank = int(config["num_experts"]) // ep
        r = int(expert.group(1)) // per_rank
        return [replica * ep + r for replica in range(world // ep)], f"expert rank {r} of {ep}"
    how = "a block of it on each rank of the tensor-parallel grid" if layout.get("tp_dimensions", [1, 1, 1]) != [1, 1, 1] \
        else "sharded over the ranks" if layout.get("sharded") else "replicated on every rank"
    return list(range(world)), how


# ---- the reference of one run --------------------------------------------------------------------

def make_reference(run):
    """runs the reference of `run` (module docstring) and returns its out_dir"""
    weights = weights_file(run)
    if not weights:
        fail(f"{run}: no model.safetensors to read the run's config from (a run writes it at its end)")
    config = json.loads(read_header(weights)[1].get("run_config") or "null")
    if not isinstance(config, dict):
        fail(f"{weights}: no run_config in its metadata (a LoRA run's adapters keep none), so the reference "
             f"cannot be made: give the reference run's directory before this one")
    stage = 8 if config.get("num_experts") else 1 if config.get("precision") in ("32", "32-true") else 2
    reference = run.rstrip("/") + "-reference"
    os.makedirs(reference, exist_ok=True)
    path = os.path.join(reference, "reference_config.json")
    with open(path, "w") as f:
        json.dump({k: v for k, v in config.items() if k not in LAYOUT_KEYS}, f)
    steps = max(read_metrics(run))
    program = os.path.join(os.environ.get("STAGE_BIN", os.path.join(ROOT, "build")), f"stage-{stage}")
    command = [program, "--config", path, f"--out_dir={reference}", f"--stop_iteration={steps}", "--resume=false"]
    print(f"the reference: {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        fail(f"{program}: {e.strerror} (make stage-{stage})")
    if done.returncode != 0:
        fail(f"the reference run ({' '.join(command)}) failed: {done.stderr.strip()[-400:]}")
    return reference


# ---- the report -------------------------------------------------------------------------------

def compare(ref, run, tol, tensor_tol):
    ref_steps, run_steps = read_metrics(ref), read_metrics(run)
    result = {"reference": ref, "run": run, "tolerance": tol, "tensor_tolerance": tensor_tol,
              "steps_compared": len(set(ref_steps) & set(run_steps)), "steps_apart": len(set(ref_steps) ^ set(run_steps)),
              "first_step": first_step(ref_steps, run_steps, tol), "checkpoint_step": None, "tensors": []}
    ref_file, run_file = weights_file(ref), weights_file(run)
    steps = checkpoint_step(ref), checkpoint_step(run)
    if ref_file and run_file and os.path.basename(ref_file) == os.path.basename(run_file) and steps[0] == steps[1]:
        result["checkpoint_step"] = steps[0]
        # the ranks of the run that is laid out over several, the reference's when the run is one
        layout_run = run if read_world(run) > 1 or read_world(ref) == 1 else ref
        for relative, name in differing_tensors(ref_file, run_file, tensor_tol):
            ranks, words = holders(layout_run, name)
            result["tensors"].append({"name": name, "relative": relative, "ranks": ranks, "held_by": words})
    result["agree"] = result["first_step"] is None and not result["tensors"] and result["steps_compared"] > 0
    result["checkpoint_note"] = None if result["checkpoint_step"] is not None else \
        f"checkpoints not compared: {ref_file or 'none'} at step {steps[0]}, {run_file or 'none'} at step {steps[1]}"
    return result


def read_world(run):
    try:
        return int(json.load(open(os.path.join(run, "stats.json"))).get("world_size", 1))
    except (OSError, ValueError):
        return 1


def print_report(r):
    print(f"{r['run']} against {r['reference']}: {r['steps_compared']} steps compared"
          + (f", {r['steps_apart']} logged by one run only" if r["steps_apart"] else ""))
    first = r["first_step"]
    if first:
        figures = ", ".join(f"{f['name']} {f['run']} vs {f['reference']} (relative {f['relative']:.2e})"
                            for f in first["figures"])
        print(f"first step beyond {r['tolerance']:g}: step {first['step']}: {figures}")
    else:
        print(f"every step within {r['tolerance']:g}")
    if r["checkpoint_step"] is None:
        print(r["checkpoint_note"])
    elif r["tensors"]:
        worst = r["tensors"][0]
        ranks = "unknown" if worst["ranks"] is None else ", ".join(map(str, worst["ranks"]))
        print(f"tensors at step {r['checkpoint_step']} beyond {r['tensor_tolerance']:g}: {len(r['tensors'])}; the most: "
              f"{worst['name']} (relative {worst['relative']:.2e}), held by rank {ranks} ({worst['held_by']})")
        for t in r["tensors"][1:5]:
            print(f"  then {t['name']} (relative {t['relative']:.2e})")
        if first and first["step"] < r["checkpoint_step"]:
            print(f"to see the tensors where the runs part, run both with --stop_iteration={first['step']} and compare again")
    else:
        print(f"every tensor at step {r['checkpoint_step']} within {r['tensor_tolerance']:g}")
    print("the runs agree" if r["agree"] else "the runs differ")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="[REFERENCE] RUN")
    parser.add_argument("--tol", type=float, default=1e-5)
    parser.add_argument("--tensor-tol", type=float, default=1e-2)
    parser.add_argument("--json")
    args = parser.parse_args()
    if len(args.runs) > 2:
        parser.error(f"expected one or two run directories, found {len(args.runs)}")
    reference, run = args.runs if len(args.runs) == 2 else (make_reference(args.runs[0]), args.runs[0])
    result = compare(reference, run, args.tol, args.tensor_tol)
    print_report(result)
    if args.json:  # strict JSON: a tensor one file lacks, or of another shape, is null apart
        for t in result["tensors"]:
            t["relative"] = None if math.isinf(t["relative"]) else t["relative"]
        with open(args.json + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    sys.exit(0 if result["agree"] else 1)


if __name__ == "__main__":
    main()
