#!/usr/bin/env python3
"""preflight.py: proves a machine or a cluster allocation ready for a session, before the audience
arrives (`make preflight` on a laptop, `sbatch slurm/preflight.sh` on a cluster).

Each check ends pass, fail or skipped (with the reason), with what it measured and what it
expected; a failed one says what to do next. The checks:
  toolchain and libraries  the compilers, and a small program linked against each library the
                           build uses (cJSON, oneDNN, MPI; cudart, cuBLAS and NCCL
                           on the CUDA backend), run to print its version; on every node
  GPUs                     visible per node against the ranks per node, and their memory against
                           the planner's need (build/plan --json) for each config; CUDA only
  mesh                     each stage-10 config's mesh (tp x pp x cp) against the ranks it must
                           divide, and its tp against the ranks of a node (tp talks in every layer)
  MPI / NCCL init          build/preflight_comm started on every rank of the session's layout
  bandwidth                its all-reduce and all-gather bus bandwidth (nccl-tests' definition)
                           against the expected figure (--expect_busbw, or the cluster
                           description's expected_busbw_GBps); short of it, the slowest pair of
                           hosts it measured is named
  disk                     free space and write speed of the output directory against the need
  model files              each config's init_from and tokenizer_path: present, complete
                           (safetensors sizes) and matching the SHA256SUMS manifest beside them
  stages                   one short step of every built stage on the session's layout (tiny config)
Writes <report>/preflight.json (the checks as data) and <report>/preflight.txt (the table); exit
status 1 when any check failed. `--node_only` runs the checks of one node and prints them as JSON
(the Slurm form runs it once per node).
"""
import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the groups of checks --only can pick; the stages' runs need the comm group's MPI start
GROUPS = ("toolchain", "gpus", "disk", "models", "comm", "stages")


class Checks:
    def __init__(self, prefix=""):
        self.rows, self.prefix = [], prefix

    def add(self, name, status, measured, expected, next_step="", seconds=None):
        row = {"check": self.prefix + name, "status": status, "measured": measured, "expected": expected}
        if status == "fail":
            row["next"] = next_step
        if seconds is not None:
            row["seconds"] = round(seconds, 2)
        self.rows.append(row)
        mark = {"pass": "ok  ", "fail": "FAIL", "skipped": "skip"}[status]
        print(f"  {mark} {row['check']}: {measured}", file=sys.stderr, flush=True)
        return status == "pass"


def run(cmd, timeout, env=None, cwd=ROOT):
    """(exit status, stdout + stderr); 124 on a timeout, 127 when the program is missing."""
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace")
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n(timed out after {timeout} s)"
    except OSError as e:
        return 127, str(e)


def last_lines(text, n=3):
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    return " | ".join(lines[-n:])


def first_error(text):
    for line in text.splitlines():
        if re.search(r"error|undefined reference|not found|cannot find|No such", line, re.I):
            return line.strip()
    return last_lines(text, 1)


# ---- toolchain and libraries ---------------------------------------------------------------------
def check_tool(checks, name, program, what_next):
    path = shutil.which(program)
    if not path:
        return checks.add(f"toolchain: {name}", "fail", f"'{program}' not found on PATH", "on PATH",
                          what_next)
    rc, out = run([program, "--version"], 20)
    # the first line that holds a version number (nvcc's is its fourth)
    version = next((l for l in out.splitlines() if re.search(r"\d+\.\d+", l)), "?").strip()
    if rc != 0:
        return checks.add(f"toolchain: {name}", "fail", f"{path} --version exit {rc}: {last_lines(out)}",
                          "runs", what_next)
    return checks.add(f"toolchain: {name}", "pass", f"{path}: {version}", "on PATH, runs")


# (name, compiler variable, source, link flags); the probe prints the library's version
LIBRARY_PROBES = {
    "cJSON": ("CC", "#include <stdio.h>\n#include <cjson/cJSON.h>\n"
              "int main(void) { puts(cJSON_Version()); return 0; }\n", ["-lcjson"]),
    "oneDNN": ("CC", "#include <stdio.h>\n#include <dnnl.h>\n"
               "int main(void) { const dnnl_version_t *v = dnnl_version();\n"
               "  printf(\"%d.%d.%d\\n\", v->major, v->minor, v->patch); return 0; }\n", ["-ldnnl"]),
    "MPI": ("MPICC", "#include <stdio.h>\n#include <string.h>\n#include <mpi.h>\n"
            "int main(void) { char v[MPI_MAX_LIBRARY_VERSION_STRING]; int n;\n"
            "  MPI_Get_library_version(v, &n); *strchrnul(v, '\\n') = 0; puts(v); return 0; }\n", []),
    "CUDA runtime": ("CC", "#include <stdio.h>\n#include <cuda_runtime_api.h>\n"
                     "int main(void) { int v = 0; cudaRuntimeGetVersion(&v); printf(\"%d\\n\", v); return 0; }\n",
                     ["-lcudart"]),
    "cuBLAS": ("CC", "#include <stdio.h>\n#include <cublas_api.h>\n"
               "int main(void) { int a = 0, b = 0; cublasGetProperty(MAJOR_VERSION, &a);\n"
               "  cublasGetProperty(MINOR_VERSION, &b); printf(\"%d.%d\\n\", a, b); return 0; }\n", ["-lcublas"]),
    "NCCL": ("CC", "#include <stdio.h>\n#include <nccl.h>\n"
             "int main(void) { int v = 0; ncclGetVersion(&v); printf(\"%d\\n\", v); return 0; }\n", ["-lnccl"]),
}
CUDA_LIBRARIES = ("CUDA runtime", "cuBLAS", "NCCL")


def check_library(checks, name, backend, workdir):
    if name in CUDA_LIBRARIES and backend != "cuda":
        return checks.add(f"library: {name}", "skipped", "CPU backend: not used", "links and runs")
    compiler_var, source, flags = LIBRARY_PROBES[name]
    compiler = os.environ.get(compiler_var, "gcc" if compiler_var == "CC" else "mpicc")
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if name in CUDA_LIBRARIES:
        flags = [f"-I{cuda_home}/include", f"-L{cuda_home}/lib64", f"-L{cuda_home}/lib"] + flags
    src = os.path.join(workdir, re.sub(r"\W", "_", name) + ".c")
    exe = src[:-2]
    with open(src, "w") as f:
        f.write(source)
    t0 = time.time()
    rc, out = run(shlex.split(compiler) + ["-D_GNU_SOURCE", src, "-o", exe] + flags, 60)
    what_next = (f"install {name} (scripts/setup.sh installs the workbook's packages) or load its module; "
                 "if it is installed, point LIBRARY_PATH and LD_LIBRARY_PATH (CUDA_HOME for the CUDA ones) at it")
    if rc != 0:
        return checks.add(f"library: {name}", "fail", f"{compiler} cannot build against it: {first_error(out)}",
                          "links and runs", what_next, time.time() - t0)
    rc, out = run([exe], 20)
    if rc != 0:
        return checks.add(f"library: {name}", "fail", f"the linked program does not run (exit {rc}): {first_error(out)}",
                          "links and runs", what_next, time.time() - t0)
    return checks.add(f"library: {name}", "pass", f"version {out.strip()}", "links and runs", seconds=time.time() - t0)


# ---- GPUs ------------------------------------------------------------------------------------------
def visible_gpus():
    """[(name, MiB)] of the GPUs this process sees, or None without nvidia-smi."""
    rc, out = run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"], 30)
    if rc != 0:
        return None
    gpus = []
    for line in out.strip().splitlines():
        name, mib = line.rsplit(",", 1)
        gpus.append((name.strip(), float(mib)))
    return gpus


def check_gpus(checks, args):
    if args.backend != "cuda":
        checks.add("gpus: count", "skipped", "CPU backend: the ranks run on the CPU cores", f"{args.ranks_per_node} per node")
        return
    gpus = visible_gpus()
    if gpus is None:
        checks.add("gpus: count", "fail", "nvidia-smi does not run: no driver or no GPU", f">= {args.ranks_per_node}",
                   "this node has no usable GPU: exclude it (sbatch --exclude=HOST), or fall back to the CPU "
                   "backend (make BACKEND=cpu all; docs/INSTRUCTOR.md)")
        return
    ok = checks.add("gpus: count", "pass" if len(gpus) >= args.ranks_per_node else "fail",
                    f"{len(gpus)} ({', '.join(sorted({g[0] for g in gpus}))})", f">= {args.ranks_per_node} (ranks per node)",
                    "ask for a GPU per rank (sbatch --gpus-per-node=N) or run fewer ranks per node; "
                    "CUDA_VISIBLE_DEVICES may hide some")
    if ok:
        args.gpu_mib = min(g[1] for g in gpus)


def mesh_of(cfg):
    """A stage-10 config's mesh (tp, pp, cp), or None for another strategy's."""
    if cfg.get("strategy") != "composed":
        return None
    return int(cfg.get("tp_dimensions", [1, 1, 1])[0]), int(cfg.get("pp_size", 1)), int(cfg.get("cp_size", 1))


def asks_for(cfg, layout):
    """Whether the planner's layout is the one this config asks for."""
    mesh = mesh_of(cfg)
    if mesh:
        tp, pp, cp = mesh
        return layout["stage"] == 10 and all(a in layout["args"] for a in
                                             (f"--tp_dimensions={tp},1,1", f"--pp_size={pp}", f"--cp_size={cp}"))
    if int(cfg.get("pp_size", 1)) > 1:
        return f"--pp_size={cfg['pp_size']}" in layout["args"]
    strategy = cfg.get("strategy", "ddp")
    if strategy == "axonn":
        dims = ",".join(str(d) for d in cfg.get("tp_dimensions", [1, 1, 1]))
        return layout["name"].startswith("TP") and f"--tp_dimensions={dims}" in layout["args"]
    return layout["name"] == ("FSDP" if strategy == "fsdp" else "DDP")


def rank_need(layout):
    """The bytes a layout's fullest rank holds: rank 0's, or on stage 10 its heaviest stage's."""
    return max(layout["memory_total"], layout.get("heaviest_memory_total", 0))


def check_gpu_memory(checks, args):
    for path in args.configs:
        name = f"gpus: memory for {path}"
        if args.backend != "cuda":
            checks.add(name, "skipped", "CPU backend: no GPU memory to size", "planner's need")
            continue
        if args.gpu_mib is None:
            checks.add(name, "skipped", "no GPU count passed (see gpus: count)", "planner's need")
            continue
        if not args.cluster:
            checks.add(name, "skipped", "no --cluster description to plan with", "planner's need")
            continue
        cfg = load_config(path)
        plan_json = os.path.join(args.report, "plan-" + os.path.basename(path))
        rc, out = run([os.path.join(args.bin, "plan"), f"--cluster={args.cluster}", "--config", path,
                       f"--ranks={args.ranks}", f"--json={plan_json}"], 120)
        if rc != 0:
            checks.add(name, "fail", f"build/plan failed: {first_error(out)}", "a plan", "run build/plan by hand and read its error")
            continue
        layouts = json.load(open(plan_json))["layouts"]
        # the config's own layout (the fastest of its kind); where P ranks cannot run it, the smallest
        need = next((l for l in layouts if asks_for(cfg, l)), min(layouts, key=lambda l: l["memory_total"]))
        need_mib = rank_need(need) / 2**20
        fitting = [l["name"] for l in layouts if rank_need(l) / 2**20 <= args.gpu_mib]
        checks.add(name, "pass" if need_mib <= args.gpu_mib else "fail",
                   f"{need['name']} needs {need_mib:.0f} MiB a rank", f"<= {args.gpu_mib:.0f} MiB (smallest GPU)",
                   "the planner's next layout that fits: " + (", ".join(fitting[:3]) if fitting else
                   "none at this rank count; more ranks (nodes), bf16 or activation_checkpointing"))


def check_mesh(checks, args):
    """Stage 10's mesh against the session's ranks: tp x pp x cp must divide them (dp takes what is
    left), and tp's ranks, consecutive, must share a node: its all-reduces run in every layer."""
    for path in args.configs:
        if not os.path.exists(path) or not mesh_of(load_config(path)):
            continue
        tp, pp, cp = mesh_of(load_config(path))
        name, size = f"mesh: {path}", tp * pp * cp
        if args.ranks % size:
            checks.add(name, "fail", f"tp {tp} x pp {pp} x cp {cp} = {size} does not divide {args.ranks} ranks",
                       "tp x pp x cp divides the ranks (dp takes the rest)",
                       f"run a multiple of {size} ranks, or change tp_dimensions, pp_size or cp_size "
                       "(build/plan --cluster=FILE lists the meshes that fit)")
        elif tp > args.ranks_per_node:
            checks.add(name, "fail", f"tp {tp} spans nodes of {args.ranks_per_node} ranks",
                       f"tp <= {args.ranks_per_node} (ranks per node)",
                       "lower tp_dimensions' x to the GPUs of a node and raise pp_size: a pipeline's messages "
                       "may cross nodes, tp's all-reduces of every layer should not")
        else:
            checks.add(name, "pass", f"tp {tp} x pp {pp} x cp {cp} x dp {args.ranks // size} = {args.ranks} ranks, "
                       f"tp within a node of {args.ranks_per_node}", "tp x pp x cp divides the ranks, tp within a node")


# ---- disk ------------------------------------------------------------------------------------------
def check_disk(checks, args):
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        for name in ("disk: free space", "disk: write speed"):
            checks.add(name, "fail", f"cannot create {args.out_dir}: {e.strerror}", "a writable directory",
                       "point --out_dir (and the session's out_dir) at a directory you can write")
        return
    free_gib = shutil.disk_usage(args.out_dir).free / 2**30
    checks.add("disk: free space", "pass" if free_gib >= args.disk_need_gib else "fail",
               f"{free_gib:.2f} GiB free in {args.out_dir}", f">= {args.disk_need_gib:g} GiB",
               "free space there (old out/ runs, checkpoints) or point out_dir elsewhere (--out_dir=...)")
    size = min(args.disk_write_mib * 2**20, int(free_gib * 2**30 / 2))
    path = os.path.join(args.out_dir, f".preflight-write-{socket.gethostname()}-{os.getpid()}")
    block = os.urandom(4 << 20)
    t0 = time.time()
    try:
        with open(path, "wb") as f:
            written = 0
            while written < size:
                written += f.write(block[:min(len(block), size - written)])
            f.flush()
            os.fsync(f.fileno())
        mbps = written / 1e6 / max(time.time() - t0, 1e-9)
        checks.add("disk: write speed", "pass" if mbps >= args.disk_min_mbps else "fail",
                   f"{mbps:.0f} MB/s ({written / 2**20:.0f} MiB, fsync'd)", f">= {args.disk_min_mbps:g} MB/s",
                   "a slow or shared file system: write checkpoints to node-local or faster storage (out_dir)")
    except OSError as e:
        checks.add("disk: write speed", "fail", f"writing {size / 2**20:.0f} MiB: {e.strerror}",
                   f">= {args.disk_min_mbps:g} MB/s", "the output directory cannot take a checkpoint: free space or move out_dir")
    finally:
        if os.path.exists(path):
            os.remove(path)


def node_checks(args, prefix=""):
    checks = Checks(prefix)
    if "toolchain" in args.only:
        check_toolchain(checks, args)
    if "gpus" in args.only:
        check_gpus(checks, args)
    if "disk" in args.only:
        check_disk(checks, args)
    return checks


def check_toolchain(checks, args):
    with tempfile.TemporaryDirectory() as workdir:
        check_tool(checks, "C compiler", os.environ.get("CC", "gcc"), "install gcc (scripts/setup.sh)")
        check_tool(checks, "MPI compiler", os.environ.get("MPICC", "mpicc"), "install Open MPI (scripts/setup.sh) or load its module")
        check_tool(checks, "MPI launcher", shlex.split(args.launcher)[0], "install Open MPI or Slurm's srun, or fix --launcher")
        if args.backend == "cuda":
            check_tool(checks, "CUDA compiler", os.environ.get("NVCC", "nvcc"), "install the CUDA toolkit or load its module (CUDA_HOME)")
        else:
            checks.add("toolchain: CUDA compiler", "skipped", "CPU backend: not used", "on PATH, runs")
        for name in LIBRARY_PROBES:
            check_library(checks, name, args.backend, workdir)


# ---- model files -------------------------------------------------------------------------------------
def load_config(path):
    with open(path) as f:
        return json.load(f)


def safetensors_complete(path):
    """'' when the file holds every byte its header promises, else what is wrong."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes: no header"
        n = struct.unpack("<Q", head)[0]
        if 8 + n > size:
            return f"header of {n} bytes, file of {size}"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "its header is not JSON"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return "" if 8 + n + end == size else f"{size} bytes, its header describes {8 + n + end}"


def model_files(path, key):
    """The files a checkpoint or tokenizer directory must hold (present ones listed first)."""
    if os.path.isfile(path):
        return [path]
    have = lambda f: os.path.exists(os.path.join(path, f))
    if key == "tokenizer_path":
        names = ["vocab.json", "merges.txt"] if have("vocab.json") or not have("encoder.json") else ["encoder.json", "vocab.bpe"]
    elif have("model.safetensors.index.json"):
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
        names = ["config.json", "model.safetensors.index.json"] + sorted(set(index["weight_map"].values()))
    else:
        names = ["config.json", "model.safetensors"]
    return [os.path.join(path, n) for n in names]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_of(files):
    """{file: sha256} from the SHA256SUMS beside the files, or None where there is none."""
    sums = os.path.join(os.path.dirname(files[0]), "SHA256SUMS")
    if not os.path.exists(sums):
        return None, sums
    table = {}
    for line in open(sums):
        digest, _, name = line.strip().partition("  ")
        table[os.path.join(os.path.dirname(sums), name.lstrip("*"))] = digest
    return table, sums


def check_model_files(checks, cfg_path, cfg):
    name = f"model files: {cfg_path}"
    paths = [(k, cfg[k]) for k in ("init_from", "tokenizer_path") if cfg.get(k)]
    if not paths:
        return checks.add(name, "skipped", "names no init_from or tokenizer_path (random weights, byte tokenizer)",
                          "present, complete, checksums match")
    fetch = (f"scripts/download.sh {cfg.get('model_id')}" if "/" in str(cfg.get("model_id", ""))
             else "run the stage that writes it before the session (docs/INSTRUCTOR.md, pre-run)")
    problems, counted = [], 0
    for key, path in paths:
        if not os.path.exists(path):
            problems.append(f"{key} {path}: missing")
            continue
        files = model_files(path, key)
        missing = [f for f in files if not os.path.exists(f)]
        problems += [f"{key}: {f} missing" for f in missing]
        for f in files:
            if f.endswith(".safetensors") and f not in missing and (why := safetensors_complete(f)):
                problems.append(f"{f} incomplete: {why}")
        table, sums = manifest_of(files)
        if table is None:
            problems.append(f"{key}: no checksum manifest {sums}")
            continue
        for f in files:
            if f in missing:
                continue
            if f not in table:
                problems.append(f"{f} not in {sums}")
            elif sha256(f) != table[f]:
                problems.append(f"{f}: sha256 differs from {sums}")
            else:
                counted += 1
    if problems:
        return checks.add(name, "fail", "; ".join(problems), "present, complete, checksums match",
                          f"fetch them again: {fetch} (it writes SHA256SUMS); a file that is right but unlisted: "
                          "(cd DIR && sha256sum FILES >> SHA256SUMS)")
    return checks.add(name, "pass", f"{counted} files match their SHA256SUMS", "present, complete, checksums match")


# ---- communication -----------------------------------------------------------------------------------
def launch(args, program_args, ranks=None):
    """The launcher's command for program_args on the session's ranks."""
    cmd = [a.replace("{ranks}", str(ranks or args.ranks)) for a in shlex.split(args.launcher)]
    return cmd + program_args


def expected_busbw(args, hosts):
    if args.expect_busbw is not None:
        return args.expect_busbw, "--expect_busbw"
    if args.cluster:
        desc = load_config(args.cluster).get("expected_busbw_GBps")
        if desc:
            link = "inter_node" if len(set(hosts)) > 1 else "intra_node"
            return float(desc[link]), f"{args.cluster} expected_busbw_GBps.{link}"
    return None, ""


def check_comm(checks, args):
    out_json = os.path.join(args.report, "comm.json")
    if os.path.exists(out_json):
        os.remove(out_json)
    env = dict(os.environ, COMM_TIMEOUT=str(args.comm_timeout))
    t0 = time.time()
    cmd = launch(args, [os.path.join(args.bin, "preflight_comm"), f"--json={out_json}",
                        f"--sizes={args.sizes}", f"--iters={args.iters}",
                        f"--pair_bytes={args.pair_bytes}"])
    rc, out = run(cmd, args.comm_timeout * 4 + 60, env)
    with open(os.path.join(args.report, "comm.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + out)
    if rc != 0 or not os.path.exists(out_json):
        checks.add("mpi: init", "fail", f"{args.ranks} ranks did not all start (exit {rc}): {last_lines(out)}",
                   f"{args.ranks} ranks join", "a rank that cannot start: its host (ssh / srun to it, "
                   "its Open MPI and libraries: this preflight's node checks), the launcher (--launcher), "
                   f"OMPI_MCA_btl_tcp_if_include; the full output is in {args.report}/comm.log", time.time() - t0)
        return None
    comm = json.load(open(out_json))
    hosts = comm["hosts"]
    checks.add("mpi: init", "pass" if comm["ranks"] == args.ranks else "fail",
               f"{comm['ranks']} ranks on {len(set(hosts))} host(s): {', '.join(sorted(set(hosts)))}",
               f"{args.ranks} ranks join", "the launcher started another rank count: check --ranks and the allocation",
               time.time() - t0)
    line = next((l for l in out.splitlines() if l.startswith("communication:")), "")
    if args.backend != "cuda":
        checks.add("nccl: init", "skipped", "CPU backend: MPI moves the bytes", "NCCL communicators on every rank")
    else:
        checks.add("nccl: init", "pass" if "NCCL" in line else "fail", line or "no backend line",
                   "communication: NCCL, a GPU per rank", "NCCL needs a GPU per rank: see gpus: count; "
                   "NCCL_DEBUG=INFO shows why its init failed (slurm/common.sh)")
    return comm


def check_bandwidth(checks, args, comm):
    if comm is None:
        for kind in ("all-reduce", "all-gather"):
            checks.add(f"bandwidth: {kind}", "skipped", "MPI did not start (see mpi: init)", "bus bandwidth")
        return
    expect, source = expected_busbw(args, comm["hosts"])
    pairs = sorted(comm["pairs"], key=lambda p: p["GBps"])
    for kind, rows in (("all-reduce", comm["all_reduce"]), ("all-gather", comm["all_gather"])):
        figures = ", ".join(f"{r['busbw_GBps']:.2f} GB/s at {r['bytes'] / 2**20:g} MiB" for r in rows)
        if args.ranks < 2:
            checks.add(f"bandwidth: {kind}", "skipped", "one rank: nothing to move", "bus bandwidth")
        elif expect is None:
            checks.add(f"bandwidth: {kind}", "skipped", f"busbw {figures}; no expected figure: pass --expect_busbw "
                       "or a --cluster with expected_busbw_GBps", "bus bandwidth")
        else:
            largest = rows[-1]["busbw_GBps"]
            slowest = (f"; slowest pair {pairs[0]['a']} <-> {pairs[0]['b']} {pairs[0]['GBps']:.2f} GB/s"
                       f" (fastest {pairs[-1]['GBps']:.2f})") if pairs else ""
            checks.add(f"bandwidth: {kind}", "pass" if largest >= expect else "fail", f"busbw {figures}" +
                       ("" if largest >= expect else slowest), f">= {expect:g} GB/s at the largest size ({source})",
                       (f"the link {pairs[0]['a']} <-> {pairs[0]['b']} is the slowest: check its NIC and cabling, "
                        "NCCL_SOCKET_IFNAME / NCCL_IB_HCA / OMPI_MCA_btl_tcp_if_include (slurm/common.sh), or leave "
                        "that host out (sbatch --exclude=HOST)") if pairs else "check the fabric")


# ---- one step of every stage ---------------------------------------------------------------------------
def stage_runs(args):
    """(stage, ranks, config, extra keys) for every stage: the session's rank count where the stage
    is parallel, a layout that divides it."""
    p, even = args.ranks, args.ranks % 2 == 0
    split = 2 if even and p > 1 else 1
    return [
        (1, 1, args.tiny, []), (2, 1, args.tiny, []),
        (3, p, args.tiny, []), (4, p, args.tiny, []),
        (5, p, args.tiny, [f"--tp_dimensions={split},1,1"]),
        (6, 1, args.tiny, ["--tokens_to_generate=4"]),
        (7, p, args.tiny, [f"--pp_size={split}", f"--num_microbatches={split}"]),
        (8, p, "configs/moe.json", [f"--ep_size={split}"]),
        (10, p, args.tiny, [f"--tp_dimensions={split},1,1"] +
         ([f"--pp_size={split}", f"--num_microbatches={split}"] if p % (split * split) == 0 else [])),
    ]


def check_stages(checks, args, mpi_ok):
    base = os.path.join(args.report, "stages")
    for n, ranks, cfg, extra in stage_runs(args):
        name = f"stage {n}: one step"
        binary = os.path.join(args.bin, f"stage-{n}")
        if not os.access(binary, os.X_OK):
            checks.add(name, "skipped", f"{binary} is not built", "a step")
            continue
        if ranks > 1 and not mpi_ok:
            checks.add(name, "skipped", "MPI did not start (see mpi: init)", f"a step on {ranks} ranks")
            continue
        out = os.path.join(base, f"stage-{n}")
        shutil.rmtree(out, ignore_errors=True)
        keys = ["--config", cfg, "--stop_iteration=1", "--log_interval=1", "--eval_batches=1", "--resume=false", f"--out_dir={out}"] + extra
        if n == 6:
            keys = ["--config", cfg, f"--out_dir={out}"] + extra
            if os.path.exists(os.path.join(base, "stage-1", "model.safetensors")):
                keys.append(f"--init_from={os.path.join(base, 'stage-1')}")
        cmd = [binary] + keys if ranks == 1 else launch(args, [binary] + keys, ranks)
        env = dict(os.environ, COMM_TIMEOUT=str(args.comm_timeout), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        t0 = time.time()
        rc, text = run(cmd, args.stage_timeout, env)
        with open(out + ".log", "w") as f:
            f.write(" ".join(cmd) + "\n" + text)
        took = time.time() - t0
        where = f"{ranks} rank{'s' if ranks > 1 else ''}" + (f" {' '.join(extra)}" if extra else "")
        if rc != 0:
            checks.add(name, "fail", f"exit {rc} after {took:.1f} s on {where}: {first_error(text)}", f"a step on {where}",
                       f"read {out}.log; rebuild (make all), or fall back to the CPU backend on the login node "
                       "(docs/INSTRUCTOR.md)", took)
            continue
        loss = None
        if n != 6:
            try:
                loss = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())["loss"]
            except (OSError, ValueError, KeyError):
                pass
            if loss is None or not math.isfinite(loss) or loss <= 0:
                checks.add(name, "fail", f"no positive finite loss in {out}/metrics.jsonl (found {loss})", f"a step on {where}",
                           f"read {out}.log", took)
                continue
        measured = f"{took:.1f} s on {where}" + (f", loss {loss:.4f}" if loss is not None else ", generated")
        checks.add(name, "pass", measured, f"a step on {where}", seconds=took)


# ---- the whole preflight ---------------------------------------------------------------------------------
def per_node(args):
    """The node checks on every node: here, or once per node through --per_node."""
    if not args.per_node:
        return node_checks(args).rows
    forward, skip = [], False
    for a in sys.argv[1:]:
        if not skip and not a.startswith("--per_node"):
            forward.append(a)
        skip = a == "--per_node"
    cmd = shlex.split(args.per_node) + [sys.executable, os.path.abspath(__file__), "--node_only"] + forward
    rc, out = run(cmd, 300)
    rows = []
    for line in out.splitlines():
        if line.startswith("PREFLIGHT_NODE "):
            try:
                rows.append(json.loads(line[len("PREFLIGHT_NODE "):]))
            except ValueError:
                rows.append({"check": "nodes: node checks", "status": "fail", "measured": f"a garbled line: {line[:200]}",
                             "expected": "one check a line", "next": "rerun; report it if it repeats"})
    if rc != 0 and not rows:
        rows.append({"check": "nodes: node checks", "status": "fail", "measured": f"exit {rc}: {last_lines(out)}",
                     "expected": "every node reports", "next": "a node that cannot run python3 or reach the repository"})
    return rows


def table(rows):
    width = max(len(r["check"]) for r in rows)
    lines = [f"{'check':<{width}}  status   measured  [expected]"]
    for r in rows:
        lines.append(f"{r['check']:<{width}}  {r['status']:<7}  {r['measured']}  [{r['expected']}]")
        if r["status"] == "fail":
            lines.append(f"{'':<{width}}  {'':<7}  -> next: {r['next']}")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=os.environ.get("BACKEND", "auto"), choices=["auto", "cpu", "cuda"])
    ap.add_argument("--configs", default="configs/tiny.json", help="the session's configs, separated by spaces or commas")
    ap.add_argument("--tiny", default="configs/tiny.json", help="the config of the one-step stage runs")
    ap.add_argument("--ranks", type=int, default=int(os.environ.get("SLURM_NTASKS", 4)))
    ap.add_argument("--ranks_per_node", type=int, default=None)
    ap.add_argument("--launcher", default=None, help="the command that starts {ranks} ranks of a program "
                    "(default: 'mpirun --oversubscribe --bind-to none -np {ranks}'; in a Slurm job, srun)")
    ap.add_argument("--per_node", default="", help="a command that runs a program once per node (the Slurm form: "
                    "srun --ntasks-per-node=1); the node checks then run on every node")
    ap.add_argument("--cluster", default="", help="a cluster description (configs/clusters/*.json)")
    ap.add_argument("--expect_busbw", type=float, default=None, help="GB/s the largest all-reduce and all-gather must reach")
    ap.add_argument("--sizes", default="262144,4194304,33554432", help="collective sizes in bytes")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--pair_bytes", type=int, default=16777216, help="bytes each host of a pair sends the other")
    ap.add_argument("--out_dir", default="out", help="the output directory the session writes to")
    ap.add_argument("--disk_need_gib", type=float, default=1.0)
    ap.add_argument("--disk_min_mbps", type=float, default=50.0)
    ap.add_argument("--disk_write_mib", type=int, default=128)
    ap.add_argument("--bin", default="build", help="where the stage binaries, build/plan and build/preflight_comm are")
    ap.add_argument("--report", default="build/preflight", help="where preflight.json and preflight.txt go")
    ap.add_argument("--comm_timeout", type=int, default=30, help="COMM_TIMEOUT for the runs: a stuck rank ends them")
    ap.add_argument("--stage_timeout", type=int, default=120)
    ap.add_argument("--only", default=",".join(GROUPS), help="the groups of checks to run, of " + ", ".join(GROUPS))
    ap.add_argument("--node_only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.only = set(g for g in args.only.split(",") if g)
    if args.only - set(GROUPS):
        ap.error(f"--only: expected groups of {', '.join(GROUPS)}, found {', '.join(sorted(args.only - set(GROUPS)))}")
    if args.backend == "auto":
        args.backend = "cuda" if run(["nvidia-smi", "-L"], 20)[0] == 0 else "cpu"
    if args.launcher is None:
        args.launcher = ("srun --mpi=pmix --kill-on-bad-exit=1 -n {ranks}" if os.environ.get("SLURM_JOB_ID")
                         else "mpirun --oversubscribe --bind-to none -np {ranks}")
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", 1))
    if args.ranks_per_node is None:
        args.ranks_per_node = -(-args.ranks // nodes)
    args.configs = [c for c in re.split(r"[\s,]+", args.configs) if c]
    args.gpu_mib = None
    return args


def main():
    args = parse_args(sys.argv[1:])
    os.chdir(ROOT)
    if args.node_only:
        # a check a line: srun forwards the nodes' output in pieces of about 1 KiB, and two nodes'
        # pieces of one longer line interleave
        for row in node_checks(args, socket.gethostname() + ": ").rows:
            print("PREFLIGHT_NODE " + json.dumps(row), flush=True)
        return 0
    os.makedirs(args.report, exist_ok=True)
    t0 = time.time()
    print(f"preflight: {args.backend} backend, {args.ranks} ranks, configs {' '.join(args.configs)}", file=sys.stderr)
    rows = per_node(args) if {"toolchain", "gpus", "disk"} & args.only else []
    checks = Checks()
    if "gpus" in args.only:
        check_gpu_memory(checks, args)
        check_mesh(checks, args)
    for path in args.configs if "models" in args.only else []:
        if not os.path.exists(path):
            checks.add(f"model files: {path}", "fail", "config file missing", "a config", "check --configs")
            continue
        check_model_files(checks, path, load_config(path))
    comm = check_comm(checks, args) if {"comm", "stages"} & args.only else None
    if "comm" in args.only:
        check_bandwidth(checks, args, comm)
    if "stages" in args.only:
        check_stages(checks, args, comm is not None)
    rows += checks.rows
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skipped")}
    report = {"host": socket.gethostname(), "backend": args.backend, "ranks": args.ranks, "configs": args.configs,
              "seconds": round(time.time() - t0, 1), "checks": rows, **counts}
    with open(os.path.join(args.report, "preflight.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = table(rows) + (f"\npreflight: {counts['pass']} passed, {counts['fail']} failed, {counts['skipped']} skipped "
                          f"in {report['seconds']} s ({args.report}/preflight.json)")
    with open(os.path.join(args.report, "preflight.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
