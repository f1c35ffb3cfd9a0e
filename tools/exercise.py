#!/usr/bin/env python3
"""The workbook's exercises: make a learner's copy, grade it, pack a class's archive.

The stages are the solutions. An exercise (exercises/catalogue.json) names a function in a stage
or in common/ (found by its definition), or a region between `// exercise <id>: begin` and
`// exercise <id>: end`; a starter copy has that body replaced by a stub, a bug hunt's copy has
one planted bug. Grading builds the copy and runs the exercise's checks (the workbook's own
tests), each all-or-nothing, each in its own process group under a time limit.

  tools/exercise.py list
  tools/exercise.py start EX [--state starter|solution|bug] [--dir DIR] [--again]
  tools/exercise.py grade [EX ...] [--dir DIR] [--as EX]
  tools/exercise.py pack [--out FILE]

Standard library only.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOGUE = os.path.join(ROOT, "exercises", "catalogue.json")
WORK = os.path.join(ROOT, "work")
MARK = ".exercise.json"  # in a copy: which exercise, in which state
BUILD_LIMIT_S = 900
WHY_LINES = 6


def die(msg):
    print(f"exercise.py: {msg}", file=sys.stderr)
    sys.exit(2)


def load_catalogue(path=CATALOGUE):
    try:
        with open(path) as f:
            cat = json.load(f)
    except (OSError, ValueError) as e:
        die(f"{path}: {e}")
    return {ex["id"]: ex for ex in cat["exercises"]}


def find(cat, ex_id):
    if ex_id not in cat:
        die(f"no exercise '{ex_id}' (exercises: {', '.join(sorted(cat))})")
    return cat[ex_id]


# ---- locating a body ---------------------------------------------------------------------------

def skip_literal(text, i):
    """Index just past the comment or string literal that starts at text[i], or i if none does."""
    if text.startswith("//", i):
        j = text.find("\n", i)
        return len(text) if j < 0 else j
    if text.startswith("/*", i):
        j = text.find("*/", i + 2)
        return len(text) if j < 0 else j + 2
    if text[i] in "\"'":
        q, j = text[i], i + 1
        while j < len(text) and text[j] != q:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    return i


def body_span(text, open_brace):
    """(start, end) of what lies between the brace at open_brace and its matching brace."""
    depth, i = 0, open_brace
    while i < len(text):
        j = skip_literal(text, i)
        if j != i:
            i = j
            continue
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return open_brace + 1, i
        i += 1
    raise ValueError("unbalanced braces")


def function_body(text, name):
    """(start, end) of the body of the function defined as `name` (a definition starts a line)."""
    pattern = re.compile(r"^[A-Za-z_][^;{}()\n]*\b" + re.escape(name) + r"\s*\(", re.M)
    for m in pattern.finditer(text):
        depth, i = 0, m.end() - 1
        while i < len(text):  # past the parameter list
            if text[i] == "(":
                depth += 1
            elif text[i] == ")":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        rest = text[i + 1:]
        after = re.match(r"\s*\{", rest)
        if after:  # a definition, not a declaration
            return body_span(text, i + 1 + after.end() - 1)
    return None


def region_body(text, ex_id):
    begin = re.search(r"^[ \t]*// exercise " + re.escape(ex_id) + r": begin[^\n]*\n", text, re.M)
    end = re.search(r"^[ \t]*// exercise " + re.escape(ex_id) + r": end", text, re.M)
    if not begin or not end or end.start() < begin.end():
        return None
    return begin.end(), end.start()


def locate(text, ex):
    span = region_body(text, ex["id"]) if ex.get("region") else function_body(text, ex["function"])
    if span is None:
        what = f"region '// exercise {ex['id']}: begin/end'" if ex.get("region") else f"function {ex['function']}"
        die(f"{ex['file']}: {what} not found")
    return span


def stub_text(ex):
    stub = ex["stub"]
    return stub if ex.get("region") else "\n" + stub.rstrip("\n") + "\n"


def apply_stub(copy, ex):
    path = os.path.join(copy, ex["file"])
    text = open(path).read()
    start, end = locate(text, ex)
    write_changed(path, text[:start] + stub_text(ex) + text[end:])


def apply_bug(copy, ex):
    path = os.path.join(copy, ex["file"])
    text = open(path).read()
    bug = ex["bug"]
    if text.count(bug["find"]) != 1:
        die(f"{ex['file']}: the bug's text to replace occurs {text.count(bug['find'])} times, not once")
    write_changed(path, text.replace(bug["find"], bug["replace"]))


def write_changed(path, text):
    with open(path, "w") as f:
        f.write(text)
    # newer than every object seeded from the workbook's build, so make recompiles what uses it
    now = time.time()
    os.utime(path, (now + 1, now + 1))


# ---- making a copy -----------------------------------------------------------------------------

def tracked_files():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [p for p in out.split("\0") if p and not p.startswith("work/") and os.path.isfile(os.path.join(ROOT, p))]


def make_copy(copy, with_build=True):
    if os.path.exists(copy):
        shutil.rmtree(copy)
    for rel in tracked_files():
        dst = os.path.join(copy, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), dst, follow_symlinks=False)
    # the workbook's own build, times kept: only what the exercise changes recompiles
    if with_build and os.path.isdir(os.path.join(ROOT, "build")):
        shutil.copytree(os.path.join(ROOT, "build"), os.path.join(copy, "build"), symlinks=True)


def write_answers(ex, copy, solved):
    """answers.json, the file a calculation's learner fills: blank, or (solved) the planner's numbers"""
    if solved:
        rc, out = run_command(ex["solve"], copy, BUILD_LIMIT_S)
        if rc != 0:
            die(f"{ex['id']}: solving failed: {' / '.join(readable(out))}")
        return
    with open(os.path.join(copy, "answers.json"), "w") as f:
        json.dump({q["key"]: None for q in ex["questions"]}, f, indent=2)
        f.write("\n")


def start(cat, ex_id, state, copy, with_build=True, again=False):
    ex = find(cat, ex_id)
    if os.path.exists(copy) and not again:
        die(f"{os.path.relpath(copy, ROOT)} exists (your work on it): start over with make exercise EX={ex_id} AGAIN=1")
    if state == "bug" and "bug" not in ex:
        die(f"{ex_id} is not a bug hunt")
    if state == "starter":
        state = "bug" if ex["kind"] == "bug-hunt" else "starter"
    make_copy(copy, with_build)
    if state == "starter" and ex["kind"] != "calculation":
        apply_stub(copy, ex)
    elif state == "bug":
        apply_bug(copy, ex)
    if ex["kind"] == "calculation":
        write_answers(ex, copy, state == "solution")
    with open(os.path.join(copy, MARK), "w") as f:
        json.dump({"exercise": ex_id, "state": state}, f)
    what = {"code": f"write the body of {ex.get('function') or 'the marked region'} in {ex['file']}",
            "bug-hunt": "find and fix the bug the checks catch",
            "calculation": "fill in answers.json"}[ex["kind"]]
    print(f"{os.path.relpath(copy, ROOT)}: {ex_id} ({state}); {what} (exercises/{ex_id}.md), then: make grade EX={ex_id}")


# ---- running a check ---------------------------------------------------------------------------

def has_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def session_members(sid):
    """Processes in session sid: what a check started, even the ranks that left its group."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def end_session(sid):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = session_members(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(0.5)


def snapshot(copy):
    """(path -> (size, mtime)) of the workbook's tree outside the copies under work/ (work/'s own
    files included): what a check must not touch."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d != ".git" and dirpath != WORK]
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            try:
                st = os.lstat(p)
                seen[p] = (st.st_size, st.st_mtime_ns)
            except OSError:
                pass
    return seen


def readable(raw, keep=WHY_LINES):
    """The last `keep` lines of a check's output, as text a terminal and JSON can hold."""
    text = raw.decode("utf-8", "replace")
    text = "".join(c if c in "\n\t" or (c.isprintable() and c != "\ufffd") else "?" for c in text)
    lines = [l[:200] for l in text.strip().splitlines()]
    return lines[-keep:]


def run_command(command, copy, limit):
    """(rc or None on timeout, output bytes) of bash -c command in copy, in a session of its own."""
    tmp = os.path.join(copy, ".tmp")
    os.makedirs(tmp, exist_ok=True)
    env = dict(os.environ, TMPDIR=tmp, EXERCISE_COPY=copy)
    log = os.path.join(copy, ".check.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=copy, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
        end_session(proc.pid)  # a hung rank or a stray child, ended with its session
        if rc is None:
            proc.wait()
    with open(log, "rb") as f:
        return rc, f.read()


def why_lines(output):
    """What says why a check failed: its first failure or error lines, else its last lines."""
    lines = readable(output, keep=10 ** 6)
    failures = [l for l in lines if l.startswith("FAIL") or "error" in l.lower()]
    return failures[:WHY_LINES - 1] or lines[-(WHY_LINES - 1):]


def verdict(rc, output, limit, touched):
    if touched:
        return "failed", [f"wrote outside its copy: {', '.join(sorted(os.path.relpath(p, ROOT) for p in touched)[:5])}"]
    if rc is None:
        return "failed", [f"timed out after {limit} s (its processes were ended)"] + why_lines(output)
    if rc < 0:
        return "failed", [f"crashed: {signal.Signals(-rc).name}"] + why_lines(output)
    if rc != 0:
        return "failed", [f"exit status {rc}"] + why_lines(output)
    return "passed", []


def check_outside(before, copy):
    after = snapshot(copy)
    return [p for p in set(before) | set(after) if before.get(p) != after.get(p)]


def build(ex, copy):
    targets = ex.get("build", [])
    if not targets:
        return None
    cmd = "make -j2 --no-print-directory BACKEND=cpu " + " ".join(targets)
    rc, out = run_command(cmd, copy, BUILD_LIMIT_S)
    if rc == 0:
        return None
    return ["build failed" if rc is not None else f"build timed out after {BUILD_LIMIT_S} s"] + why_lines(out)


def grade_one(ex, copy, gpu):
    rows = []
    why_build = build(ex, copy)
    for chk in ex["checks"]:
        row = {"exercise": ex["id"], "check": chk["name"], "points": chk["points"]}
        if chk.get("needs_gpu") and not gpu:
            row.update(result="blocked", why=["needs a GPU; none is visible here"])
        elif why_build:
            row.update(result="failed", why=why_build)
        else:
            before = snapshot(copy)
            rc, out = run_command(chk["command"], copy, chk["time_limit_s"])
            result, why = verdict(rc, out, chk["time_limit_s"], check_outside(before, copy))
            row.update(result=result, why=why)
        rows.append(row)
    return rows


def print_table(rows):
    w = max([len(r["exercise"]) for r in rows] + [8])
    c = max([len(r["check"]) for r in rows] + [5])
    print(f"{'exercise':<{w}}  {'check':<{c}}  points  result")
    for r in rows:
        earned = r["points"] if r["result"] == "passed" else 0
        print(f"{r['exercise']:<{w}}  {r['check']:<{c}}  {earned:>2}/{r['points']:<3}  {r['result']}")
        for line in r["why"][:3]:
            print(f"{'':<{w}}    {line}")
    total = sum(r["points"] for r in rows)
    earned = sum(r["points"] for r in rows if r["result"] == "passed")
    blocked = sum(r["points"] for r in rows if r["result"] == "blocked")
    print(f"total: {earned}/{total} points" + (f" ({blocked} blocked: they need a GPU)" if blocked else ""))


def rubric(rows):
    return {"points": sum(r["points"] for r in rows),
            "earned": sum(r["points"] for r in rows if r["result"] == "passed"),
            "blocked": sum(r["points"] for r in rows if r["result"] == "blocked"),
            "checks": rows}


def grade(cat, ids, copy_dir, as_ex):
    if copy_dir:
        copies = [os.path.abspath(copy_dir)]
    elif ids:
        copies = [os.path.join(WORK, i) for i in ids]
    else:
        copies = sorted(os.path.join(WORK, d) for d in (os.listdir(WORK) if os.path.isdir(WORK) else [])
                        if os.path.isfile(os.path.join(WORK, d, MARK)))
        if not copies:
            die("no exercise started: make exercise EX=<id> first")
    gpu = has_gpu()
    every = []
    for copy in copies:
        try:
            mark = json.load(open(os.path.join(copy, MARK)))
        except (OSError, ValueError):
            die(f"{copy}: not an exercise copy (make exercise EX=<id> makes one)")
        ex = find(cat, as_ex or mark["exercise"])
        rows = grade_one(ex, copy, gpu)
        with open(os.path.join(copy, "grade.json"), "w") as f:
            json.dump(dict(rubric(rows), exercise=ex["id"]), f, indent=2)
            f.write("\n")
        every += rows
    print_table(every)
    if len(copies) > 1:
        os.makedirs(WORK, exist_ok=True)
        with open(os.path.join(WORK, "grade.json"), "w") as f:
            json.dump(rubric(every), f, indent=2)
            f.write("\n")
    return every


# ---- an archive for a class ----------------------------------------------------------------------

def pack(cat, out):
    staging = os.path.join(WORK, ".pack")
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    for ex_id in sorted(cat):
        copy = os.path.join(staging, "work", ex_id)
        start(cat, ex_id, "starter", copy, with_build=False, again=True)  # learners build their own
    with tarfile.open(out, "w:gz") as tar:
        tar.add(os.path.join(ROOT, "exercises"), arcname="exercises")
        tar.add(os.path.join(ROOT, "tools", "exercise.py"), arcname="tools/exercise.py")
        for ex_id in sorted(cat):
            tar.add(os.path.join(staging, "work", ex_id), arcname=f"work/{ex_id}")
    shutil.rmtree(staging)
    print(f"{out}: {len(cat)} starter copies, the task pages and the grader")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--catalogue", default=CATALOGUE)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    s = sub.add_parser("start")
    s.add_argument("id")
    s.add_argument("--state", choices=["starter", "solution", "bug"], default="starter")
    s.add_argument("--dir")
    s.add_argument("--again", action="store_true", help="replace an existing copy (and the work in it)")
    g = sub.add_parser("grade")
    g.add_argument("ids", nargs="*")
    g.add_argument("--dir", help="grade this copy (default: work/<id>)")
    g.add_argument("--as", dest="as_ex", help="with this exercise's checks (a shared solution copy)")
    p = sub.add_parser("pack")
    p.add_argument("--out", default=os.path.join(ROOT, "exercises-pack.tar.gz"))
    args = ap.parse_args()
    cat = load_catalogue(args.catalogue)
    if args.cmd == "list":
        for ex in cat.values():
            print(f"{ex['id']:<28} {ex['stage']:<7} {ex['kind']:<12} {ex['title']}")
    elif args.cmd == "start":
        start(cat, args.id, args.state, os.path.abspath(args.dir) if args.dir else os.path.join(WORK, args.id),
              again=args.again)
    elif args.cmd == "grade":
        grade(cat, args.ids, args.dir, args.as_ex)
    elif args.cmd == "pack":
        pack(cat, args.out)


if __name__ == "__main__":
    main()
