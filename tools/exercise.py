#!/usr/bin/env python3
"""The workbook's exercises: make a learner's copy, grade hand-ins on pristine tests, pack a class.

The stages are the solutions. An exercise (exercises/catalogue.json) names a function in a stage
or in common/ (found by its definition), or a region between `// exercise <id>: begin` and
`// exercise <id>: end`; a starter copy has that body replaced by a stub, a bug hunt's copy has
one planted bug, a calculation's copy a blank answers.json.

Grading never builds or runs the learner's copy. It takes only the exercise's own part from it
(the body of its function or region, a bug hunt's function, a calculation's answers.json) into a
fresh tree made from the workbook (its files and its build; in a class's pack, the exercise's
starter tree), writes that file newer than every object so that what includes it is rebuilt (in
the workbook, a part the same as the workbook's own keeps the objects built from it), and runs
the catalogue's checks there, each in a session of its own under a time limit. A check
passes on exit status 0 together with its test's own summary line ("NAME: N passed, 0 failed",
N > 0); a check marked `partial` earns its points in proportion to the cases that pass.

  tools/exercise.py list
  tools/exercise.py start EX [--state starter|solution|bug] [--dir DIR] [--again]
  tools/exercise.py grade [EX ...] [--dir DIR ...] [--as EX] [--jobs N] [--json FILE]
  tools/exercise.py class HANDINS [--csv FILE] [--json FILE] [--jobs N]
  tools/exercise.py pack [--out FILE]

Standard library only.
"""
import argparse
import concurrent.futures
import csv
import functools
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOGUE = os.path.join(ROOT, "exercises", "catalogue.json")
WORK = os.path.join(ROOT, "work")
GRADING = os.path.join(WORK, ".grading")  # the fresh trees, one per hand-in being graded
TREES = os.path.join(ROOT, "exercises", "trees")  # only in a class's pack: <id>.tar.gz, each starter tree
BUILD_CACHE = os.path.join(WORK, ".build")  # in a pack: each exercise's last grading build, reused
PACK_FILES = os.path.join(ROOT, "exercises", "pack")  # the pack's README.md and Makefile
AGENTS = os.path.join(ROOT, "exercises", "AGENTS.md")  # for a learner's AI assistant, in every copy
MARK = ".exercise.json"  # in a copy: which exercise, in which state, made by which grader
BUILD_LIMIT_S = 900
WHY_LINES = 6
SUMMARY = re.compile(r"^(.*\S): (\d+) passed, (\d+) failed\s*$")
# lines of mpirun's and make's own that say nothing about the learner's code
NOISE = re.compile(r"^\s*$|^-{5,}|^={5,}|mpirun|prterun|PRTE|Primary job|MPI_ABORT|NOTE: invoking|"
                   r"You may or may not|errorcode|Open MPI|process rank|make(\[\d+\])?: |Clock skew|"
                   r"modification time .* in the future")
CASE = re.compile(r"^case (.+): (passed|failed)\s*$")  # a test's line per case (test_ops NAME)
FAILED_AT = re.compile(r"^FAIL (\S+:\d+):")  # check.h's failure line: which check failed
# the lines that name what is wrong, ahead of the rest
CAUSE = re.compile(r"^FAIL|\bgot\b.*\bwant|\bnan\b|\binf\b|error|wrong|not answered|does not|did not|not exactly",
                   re.I)


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


def in_pack():
    return os.path.isdir(TREES)


class NoPart(Exception):
    """The exercise's part is missing from a file (its function or region cannot be found)."""


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
        raise NoPart(f"{ex['file']}: {what} not found")
    return span


def stub_text(ex):
    stub = ex["stub"]
    return stub if ex.get("region") else "\n" + stub.rstrip("\n") + "\n"


def replace_part(path, ex, part):
    """Puts part in place of the exercise's body in the file at path, written newer than every
    object built before, so that make rebuilds whatever includes it."""
    text = open(path).read()
    start, end = locate(text, ex)
    write_newer(path, text[:start] + part + text[end:])


def apply_bug(copy, ex):
    path = os.path.join(copy, ex["file"])
    text = open(path).read()
    bug = ex["bug"]
    if text.count(bug["find"]) != 1:
        die(f"{ex['file']}: the bug's text to replace occurs {text.count(bug['find'])} times, not once")
    write_newer(path, text.replace(bug["find"], bug["replace"]))


def write_newer(path, text):
    with open(path, "w") as f:
        f.write(text)
    now = time.time()
    os.utime(path, (now + 1, now + 1))


def learner_part(copy, ex):
    """The one part of a learner's copy that grading takes: the exercise's body (a bug hunt's
    whole function) or a calculation's answers.json."""
    path = os.path.join(copy, ex["file"])
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError as e:
        raise NoPart(f"{ex['file']}: {e.strerror}")
    return part_of_text(text, ex)


def part_of_text(text, ex):
    if ex["kind"] == "calculation":
        return text
    start, end = locate(text, ex)
    return text[start:end]


def put_part(tree, ex, part):
    """The hand-in's part into the grading tree's file, which is then newer than every object. In
    the workbook, a part the same as the workbook's own leaves the file as it is: the build copied
    with it was made from that very text (in a pack, the build may be a previous hand-in's)."""
    path = os.path.join(tree, ex["file"])
    if ex["kind"] == "calculation":
        write_newer(path, part)
    elif in_pack() or learner_part(tree, ex) != part:
        replace_part(path, ex, part)


# ---- the workbook's trees ----------------------------------------------------------------------

def source_files(root):
    """The workbook's files, relative to root: git's tracked and unignored ones when root is a git
    checkout, else every file but the build, the copies and version control's own."""
    git = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], capture_output=True, text=True) \
        if shutil.which("git") else None
    if git and git.returncode == 0 and os.path.samefile(git.stdout.strip(), root):
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                             cwd=root, capture_output=True, check=True).stdout.decode()
        files = [p for p in out.split("\0") if p]
    else:
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            if dirpath == root:
                dirnames[:] = [d for d in dirnames if d not in ("build", "work", "out", ".git")]
            files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames]
    return [p for p in files if not p.startswith("work/") and os.path.isfile(os.path.join(root, p))]


def workbook_tree(dest, with_build, with_cuda=True):
    """dest becomes a copy of the workbook's files and, times kept, its build (no oracle venvs, no
    test harnesses' clusters and logs; without build/cuda unless with_cuda)."""
    for rel in source_files(ROOT):
        dst = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), dst, follow_symlinks=False)
    if with_build and os.path.isdir(os.path.join(ROOT, "build")):
        build = os.path.join(ROOT, "build")
        not_copied = shutil.ignore_patterns("*-venv", "*-test")
        cuda = set() if with_cuda else {"cuda"}
        shutil.copytree(build, os.path.join(dest, "build"), symlinks=True,
                        ignore=lambda d, names: not_copied(d, names) | (cuda if d == build else set()))


def packed_tree(ex_id, dest):
    """dest becomes a pack's starter tree of exercise ex_id, file times kept."""
    with tarfile.open(os.path.join(TREES, f"{ex_id}.tar.gz")) as tar:
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))


def starter_tree(ex, state, dest, with_build=True):
    """dest becomes the exercise's copy in state starter, bug or solution (workbook only)."""
    if in_pack():
        packed_tree(ex["id"], dest)
        return
    workbook_tree(dest, with_build)
    if state == "starter" and ex["kind"] != "calculation":
        replace_part(os.path.join(dest, ex["file"]), ex, stub_text(ex))
    elif state == "bug":
        apply_bug(dest, ex)
    if ex["kind"] == "calculation":
        write_answers(ex, dest, state == "solution")
    if os.path.isfile(AGENTS):
        shutil.copy2(AGENTS, os.path.join(dest, "AGENTS.md"))


# the key of a calculation, for the workbook's own test of its grader: no learner's copy has a mode
# that writes it
ANSWER_KEY = ("import json, sys, tempfile; sys.path.insert(0, 'exercises'); import calc_check\n"
              "with tempfile.TemporaryDirectory() as t:\n"
              "    json.dump(calc_check.truth(sys.argv[1], t), open('answers.json', 'w'), indent=2)")


def write_answers(ex, copy, solved):
    """answers.json, the file a calculation's learner fills: blank, or (solved) the right numbers"""
    if solved:
        rc, out = run_command(f"python3 -c {shlex.quote(ANSWER_KEY)} {ex['id']}", copy, BUILD_LIMIT_S)
        if rc != 0:
            die(f"{ex['id']}: solving failed: {' / '.join(readable(out))}")
        return
    with open(os.path.join(copy, "answers.json"), "w") as f:
        json.dump({q["key"]: None for q in ex["questions"]}, f, indent=2)
        f.write("\n")


# ---- making a copy -----------------------------------------------------------------------------

def start(cat, ex_id, state, copy, with_build=True, again=False):
    ex = find(cat, ex_id)
    if os.path.exists(copy) and not again:
        die(f"{os.path.relpath(copy, ROOT)} exists (your work on it): start over with make exercise EX={ex_id} AGAIN=1")
    if state == "bug" and "bug" not in ex:
        die(f"{ex_id} is not a bug hunt")
    if state == "starter" and ex["kind"] == "bug-hunt":
        state = "bug"
    if in_pack() and state == "solution":
        die("a class's pack holds no solutions")
    # the new copy is made beside the old one and only then takes its place: a failure leaves both
    fresh = copy.rstrip("/") + ".new"
    shutil.rmtree(fresh, ignore_errors=True)
    try:
        starter_tree(ex, state, fresh, with_build)
        with open(os.path.join(fresh, MARK), "w") as f:
            json.dump({"exercise": ex_id, "state": state, "home": ROOT}, f)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    shutil.rmtree(copy, ignore_errors=True)
    os.rename(fresh, copy)
    what = {"code": f"write the body of {ex.get('function') or 'the marked region'} in {ex['file']}",
            "bug-hunt": f"find and fix the bug in {ex.get('function')} ({ex['file']}) that the checks catch",
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


def snapshot():
    """(path -> (size, mtime)) of the workbook's tree outside work/: what a check must not touch."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d != ".git" and os.path.join(dirpath, d) != WORK]
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


def run_command(command, cwd, limit):
    """(rc or None on timeout, output bytes) of bash -c command in cwd, in a session of its own;
    its temporary files and its log lie under work/.grading/, never in the tree it runs in."""
    os.makedirs(GRADING, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".run-", dir=GRADING)
    log = os.path.join(scratch, "log")
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=dict(os.environ, TMPDIR=scratch),
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = None
            end_session(proc.pid)  # a hung rank or a stray child, ended with its session
            if rc is None:
                proc.wait()
        with open(log, "rb") as f:
            return rc, f.read()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def why_lines(output):
    """What says why a check failed: the lines that name a cause, in their order, ahead of the
    rest, one per failing check of the test (its first: a test that fails one check many times
    would hide its others); mpirun's and make's boilerplate left out."""
    lines = [l for l in readable(output, keep=10 ** 6) if not NOISE.search(l)]
    causes, seen = [], set()
    for line in lines:
        where = FAILED_AT.match(line)
        if CAUSE.search(line) and not (where and where.group(1) in seen):
            causes.append(line)
            if where:
                seen.add(where.group(1))
    return causes[:WHY_LINES - 1] or lines[-(WHY_LINES - 1):]


def summary_counts(output):
    """(passed, failed) added over the test's summary lines ("NAME: N passed, N failed"), or None
    when it printed none (it did not run to its end)."""
    counts = [SUMMARY.match(l) for l in readable(output, keep=10 ** 6)]
    counts = [(int(m.group(2)), int(m.group(3))) for m in counts if m]
    return (sum(p for p, _ in counts), sum(f for _, f in counts)) if counts else None


def case_groups(chk, output):
    """(names of the check's case groups that pass, names of those that fail). A group passes when
    each of its `cases` (text in a case's name) names a case the test ran, and every case it names
    passed."""
    results = {}
    for line in readable(output, keep=10 ** 6):
        m = CASE.match(line)
        if m:
            results[m.group(1)] = results.get(m.group(1), True) and m.group(2) == "passed"
    passed, failed = [], []
    for g in chk.get("groups", []):
        named = [[ok for case, ok in results.items() if part in case] for part in g["cases"]]
        (passed if all(named) and all(all(n) for n in named) else failed).append(g["name"])
    return passed, failed


def verdict(chk, rc, output, touched):
    """(points earned, result, why) of one check's run."""
    if touched:
        return 0, "failed", [f"wrote outside its tree: {', '.join(sorted(os.path.relpath(p, ROOT) for p in touched)[:5])}"]
    if rc is None:
        return 0, "failed", [f"timed out after {chk['time_limit_s']} s (its processes were ended)"] + why_lines(output)
    if rc < 0:
        return 0, "failed", [f"crashed: {signal.Signals(-rc).name}"] + why_lines(output)
    counts = summary_counts(output)
    if rc == 0 and counts and counts[0] > 0 and counts[1] == 0:
        unnamed = case_groups(chk, output)[1]  # the catalogue's groups must name cases the test runs
        if unnamed:
            return 0, "failed", [f"the catalogue's case groups {', '.join(unnamed)} name no passing case "
                                 "of this test"]
        return chk["points"], "passed", []
    if rc == 0:
        return 0, "failed", ["exited 0 without its test's summary line (N passed, 0 failed, N > 0): "
                             "the test did not run to its end"] + why_lines(output)
    passed, failed = case_groups(chk, output)
    if failed and rc > 0:  # the groups of cases that pass earn their points; full marks take the whole test
        earned = sum(g["points"] for g in chk["groups"] if g["name"] in passed)
        return earned, "partial" if earned else "failed", \
            [f"case groups passed: {', '.join(passed) or 'none'}; failed: {', '.join(failed)}"] + why_lines(output)
    if chk.get("partial") and counts and counts[0] > 0:
        passed, cases = counts[0], counts[0] + counts[1]
        return chk["points"] * passed // cases, "partial", [f"{passed} of {cases} cases pass"] + why_lines(output)
    return 0, "failed", [f"exit status {rc}"] + why_lines(output)


def written_between(before, after):
    """The files of the workbook's tree (outside work/) that differ between two snapshots."""
    return [p for p in set(before) | set(after) if before.get(p) != after.get(p)]


def make_targets(targets, tree):
    """None when make builds the targets in tree, else why not."""
    if not targets:
        return None
    rc, out = run_command("make -j2 --no-print-directory BACKEND=cpu " + " ".join(targets), tree, BUILD_LIMIT_S)
    if rc == 0:
        return None
    return ["build failed" if rc is not None else f"build timed out after {BUILD_LIMIT_S} s"] + why_lines(out)


def grading_tree(ex, gpu):
    """A fresh tree for one grading: the workbook's, its CUDA build only where a GPU can run it (or
    the pack's starter tree, with the build of its last grading)."""
    os.makedirs(GRADING, exist_ok=True)
    tree = tempfile.mkdtemp(prefix=ex["id"] + "-", dir=GRADING)
    if in_pack():
        packed_tree(ex["id"], tree)
        cache = os.path.join(BUILD_CACHE, ex["id"])
        if os.path.isdir(cache):
            shutil.copytree(cache, os.path.join(tree, "build"), symlinks=True)
    else:
        workbook_tree(tree, with_build=True, with_cuda=gpu)
    return tree


def keep_build(ex, tree):
    """In a pack, the grading's build is the next one's start (only what changed recompiles)."""
    if in_pack() and os.path.isdir(os.path.join(tree, "build")):
        cache = os.path.join(BUILD_CACHE, ex["id"])
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(BUILD_CACHE, exist_ok=True)
        shutil.move(os.path.join(tree, "build"), cache)


def tree_key(ex, part):
    """What a grading tree holds that the others may not: hand-ins with the same key make the same
    tree and are graded in one. In the workbook, the hand-in's file as grading writes it (None
    when that is the workbook's own: every exercise's solution makes the workbook's tree); in a
    pack, the exercise's own starter tree with the part."""
    if in_pack():
        return ex["id"], part
    if ex["kind"] == "calculation":
        return ex["file"], part
    text = open(os.path.join(ROOT, ex["file"])).read()
    start, end = locate(text, ex)
    spliced = text[:start] + part + text[end:]
    return None if spliced == text else (ex["file"], spliced)


class SharedTree:
    """One fresh grading tree for the hand-ins of one tree_key: built once, each check's command
    run in it once and its result shared by every hand-in whose check runs that command."""

    def __init__(self, ex, part, gpu):
        self.ex = ex
        self.path = grading_tree(ex, gpu)
        self.ran = {}  # (command, time limit) -> (rc, output, files written outside the tree)
        self.seen = None  # the workbook's snapshot after the last check (only make ran since, in the tree)
        try:
            put_part(self.path, ex, part)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def run_check(self, chk):
        key = (chk["command"], chk["time_limit_s"])
        if key not in self.ran:
            before = self.seen or snapshot()
            rc, out = run_command(chk["command"], self.path, chk["time_limit_s"])
            self.seen = snapshot()
            self.ran[key] = rc, out, written_between(before, self.seen)
        return self.ran[key]

    def grade(self, ex, gpu):
        """The rows of one hand-in of this tree's key."""
        rows = new_rows(ex)
        why_build = make_targets(ex.get("build", []), self.path)
        for chk, row in zip(ex["checks"], rows):
            if chk.get("needs_gpu") and not gpu:
                row.update(earned=0, result="blocked", why=["needs a GPU; none is visible here"])
            elif why_build:
                row.update(earned=0, result="failed", why=why_build)
            else:
                earned, result, why = verdict(chk, *self.run_check(chk))
                row.update(earned=earned, result=result, why=why)
        return rows

    def close(self):
        keep_build(self.ex, self.path)
        shutil.rmtree(self.path, ignore_errors=True)


def new_rows(ex):
    return [{"exercise": ex["id"], "check": c["name"], "points": c["points"]} for c in ex["checks"]]


def grade_in_one_tree(handins, gpu):
    """The rows of each (exercise, part) of one tree_key, graded one after the other in one tree."""
    tree = None
    try:
        tree = SharedTree(*handins[0], gpu)
        return [tree.grade(ex, gpu) for ex, _ in handins]
    finally:
        if tree:
            tree.close()


def grade_side_by_side(cat, handins, jobs):
    """Grades [(exercise id, copy)], up to `jobs` trees at once; the rows of each, in order. Each
    hand-in's part is taken first: those that make the same tree share one (tree_key)."""
    gpu = has_gpu()
    graded = [None] * len(handins)
    by_tree = {}
    for i, (ex_id, copy) in enumerate(handins):
        ex = cat[ex_id]
        try:
            part = learner_part(copy, ex)
        except NoPart as e:
            graded[i] = [dict(row, earned=0, result="failed", why=[f"nothing to grade: {e}"]) for row in new_rows(ex)]
            continue
        by_tree.setdefault(tree_key(ex, part), []).append((i, ex, part))
    # the workbook's build is not made here: its phony targets would be rewritten under the checks
    # of other gradings; a grading tree's own make rebuilds whatever of it is stale. The trees with
    # the most hand-ins start first, so that none of them is left to run alone at the end.
    groups = sorted(by_tree.values(), key=len, reverse=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = pool.map(lambda g: grade_in_one_tree([(ex, part) for _, ex, part in g], gpu), groups)
        for group, rows in zip(groups, done):
            for (i, _, _), mine in zip(group, rows):
                graded[i] = mine
    return graded


def print_table(rows):
    w = max([len(r.get("learner", "") + r["exercise"]) + 1 for r in rows] + [8])
    c = max([len(r["check"]) for r in rows] + [5])
    print(f"{'exercise':<{w}}  {'check':<{c}}  points  result")
    for r in rows:
        who = (r["learner"] + "/" if "learner" in r else "") + r["exercise"]
        print(f"{who:<{w}}  {r['check']:<{c}}  {r['earned']:>2}/{r['points']:<3}  {r['result']}")
        for line in r["why"][:4]:
            print(f"{'':<{w}}    {line}")
    s = rubric(rows)
    print(f"total: {s['earned']} / {s['earnable']} points earnable here" +
          (f"; {s['blocked']} more blocked (they need a GPU): {', '.join(s['blocked_checks'])}" if s["blocked"] else ""))


def rubric(rows):
    blocked = [r for r in rows if r["result"] == "blocked"]
    return {"earned": sum(r["earned"] for r in rows),
            "earnable": sum(r["points"] for r in rows) - sum(r["points"] for r in blocked),
            "blocked": sum(r["points"] for r in blocked),
            "blocked_checks": [f"{r['exercise']}: {r['check']}" for r in blocked],
            "checks": rows}


def copies_under_work():
    return sorted(os.path.join(WORK, d) for d in (os.listdir(WORK) if os.path.isdir(WORK) else [])
                  if os.path.isfile(os.path.join(WORK, d, MARK)))


def exercise_of(copy):
    try:
        with open(os.path.join(copy, MARK)) as f:
            return json.load(f)["exercise"]
    except (OSError, ValueError, KeyError, TypeError):
        die(f"{copy}: not an exercise copy (make exercise EX=<id> makes one)")


def grade(cat, ids, dirs, as_ex, jobs, json_out=None):
    if dirs:
        copies = [os.path.abspath(d) for d in dirs]
    elif ids:
        copies = [os.path.join(WORK, i) for i in ids]
    else:
        copies = copies_under_work()
        if not copies:
            die("no exercise started: make exercise EX=<id> first")
    handins = [(find(cat, as_ex or exercise_of(c))["id"], c) for c in copies]
    every = []
    for (ex_id, copy), rows in zip(handins, grade_side_by_side(cat, handins, jobs)):
        if os.path.abspath(copy) != ROOT:
            with open(os.path.join(copy, "grade.json"), "w") as f:
                json.dump(dict(rubric(rows), exercise=ex_id), f, indent=2)
                f.write("\n")
        every += rows
    print_table(every)
    if json_out or (len(copies) > 1 and not dirs):
        with open(json_out or os.path.join(WORK, "grade.json"), "w") as f:
            json.dump(rubric(every), f, indent=2)
            f.write("\n")
    return every


# ---- a class's hand-ins ------------------------------------------------------------------------

def learner_copies(folder):
    """A learner's folder is a copy, or holds copies (a work/ of them, or work/ itself)."""
    if os.path.isfile(os.path.join(folder, MARK)):
        return [folder]
    found = []
    for sub in ("", "work"):
        d = os.path.join(folder, sub)
        if os.path.isdir(d):
            found += [os.path.join(d, c) for c in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, c, MARK))]
    return found


@functools.lru_cache(maxsize=4)
def starter_files(made_for, files):
    """{path: text} of the files (a tuple of paths) in a pack's starter tree of exercise made_for,
    read in one pass over its archive."""
    texts = {}
    with tarfile.open(os.path.join(TREES, f"{made_for}.tar.gz")) as tar:
        for member in tar:
            rel = os.path.normpath(member.name)
            if rel in files and member.isfile():
                texts[rel] = tar.extractfile(member).read().decode("utf-8", "replace")
    return texts


def pristine_part(cat, ex, made_for):
    """Exercise ex's part as the workbook holds it, read from a tree made for exercise made_for
    (another one): the workbook's own files, or in a pack that exercise's starter tree."""
    if not in_pack():
        return learner_part(ROOT, ex)
    texts = starter_files(made_for, tuple(sorted({e["file"] for e in cat.values()})))
    if ex["file"] not in texts:
        raise NoPart(f"{ex['file']}: not in {made_for}'s starter tree")
    return part_of_text(texts[ex["file"]], ex)


def relabelled(cat, ex, copy):
    """None when the copy can have been made for exercise ex, else why not. Its mark is the
    learner's to edit, so the copy's contents decide: a copy is made with one exercise's part
    changed (its stub or its bug) and every other part the workbook's own. So every other code
    part must be the workbook's; and a copy with no part changed at all (a fixed bug hunt's, say)
    cannot tell which exercise it was made for, so it is no hand-in of a code exercise, whose
    starter a learner replaces."""
    try:
        mine = learner_part(copy, ex)
    except NoPart:
        return None  # graded as nothing to grade
    if ex["kind"] == "calculation":
        try:
            keys = set(json.loads(mine))
        except (ValueError, TypeError):
            return None  # graded: calc_check says what is wrong with the file
        want = {q["key"] for q in ex["questions"]}
        return None if keys == want else [f"answers.json holds the keys {', '.join(sorted(keys))}, not {ex['id']}'s "
                                          f"({', '.join(sorted(want))}): a copy made for another exercise"]
    for other in cat.values():
        if other["id"] == ex["id"] or other["kind"] == "calculation":
            continue
        try:
            changed = learner_part(copy, other) != pristine_part(cat, other, ex["id"])
        except NoPart:
            changed = True
        if changed:
            return [f"made for {other['id']}, not {ex['id']}: its part of {other['id']} ({other['file']}) is not the "
                    f"workbook's, as only the part of the exercise a copy is made for can be"]
    if ex["kind"] == "code" and mine == pristine_part(cat, ex, next(i for i in cat if i != ex["id"])):
        return [f"no part of this copy differs from the workbook's own code, {ex['id']}'s neither: "
                "it cannot be told from a copy made for another exercise (a fixed bug hunt's)"]
    return None


def grade_class(cat, folder, csv_out, json_out, jobs):
    """Grades every learner's folder in `folder` (one per learner) into one CSV and one JSON."""
    learners = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    handins, owners, rows = [], [], []
    for who in learners:
        copies = learner_copies(os.path.join(folder, who))
        if not copies:
            rows.append({"learner": who, "exercise": "-", "check": "-", "points": 0, "earned": 0,
                         "result": "failed", "why": ["no exercise copy in this folder"]})
        for copy in copies:
            ex_id = exercise_of(copy)
            why = [f"no exercise '{ex_id}'"] if ex_id not in cat else relabelled(cat, cat[ex_id], copy)
            if why:  # a relabelled copy earns none of its exercise's points
                points = sum(c["points"] for c in cat[ex_id]["checks"]) if ex_id in cat else 0
                rows.append({"learner": who, "exercise": ex_id, "check": "-", "points": points, "earned": 0,
                             "result": "refused" if ex_id in cat else "failed", "why": why})
                continue
            handins.append((ex_id, copy))
            owners.append(who)
    for who, graded in zip(owners, grade_side_by_side(cat, handins, jobs)):
        rows += [dict(r, learner=who) for r in graded]
    rows.sort(key=lambda r: r["learner"])
    print_table(rows)
    with open(csv_out, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["learner", "exercise", "check", "points", "earned", "result", "why"])
        for r in rows:
            out.writerow([r["learner"], r["exercise"], r["check"], r["points"], r["earned"], r["result"],
                          " / ".join(r["why"][:2])])
    with open(json_out, "w") as f:
        json.dump({who: rubric(list(mine)) for who, mine in itertools.groupby(rows, key=lambda r: r["learner"])},
                  f, indent=2)
        f.write("\n")
    print(f"{csv_out}, {json_out}: {len(learners)} learners, {len(handins)} hand-ins")


# ---- an archive for a class --------------------------------------------------------------------

def pack(cat, out):
    """An archive that works unpacked in an empty directory, without git: README.md, Makefile,
    AGENTS.md, the pages and catalogue, the grader, and each exercise's starter tree (its own
    stub; no build, no version history)."""
    if in_pack():
        die("this is a class's pack already")
    staging = os.path.join(WORK, ".pack")
    shutil.rmtree(staging, ignore_errors=True)
    trees = os.path.join(staging, "exercises", "trees")
    os.makedirs(trees)
    for ex_id in sorted(cat):
        tree = os.path.join(staging, "tree")
        starter_tree(cat[ex_id], "bug" if cat[ex_id]["kind"] == "bug-hunt" else "starter", tree, with_build=False)
        with tarfile.open(os.path.join(trees, f"{ex_id}.tar.gz"), "w:gz") as tar:
            tar.add(tree, arcname=".")
        shutil.rmtree(tree)
    for name in os.listdir(os.path.join(ROOT, "exercises")):
        if name.endswith(".md") or name == "catalogue.json":
            shutil.copy2(os.path.join(ROOT, "exercises", name), os.path.join(staging, "exercises", name))
    os.makedirs(os.path.join(staging, "tools"))
    shutil.copy2(os.path.abspath(__file__), os.path.join(staging, "tools", "exercise.py"))
    for src, dst in ((os.path.join(PACK_FILES, "README.md"), "README.md"),
                     (os.path.join(PACK_FILES, "Makefile"), "Makefile"), (AGENTS, "AGENTS.md")):
        shutil.copy2(src, os.path.join(staging, dst))
    with tarfile.open(out, "w:gz") as tar:
        tar.add(staging, arcname=".")
    shutil.rmtree(staging)
    print(f"{out}: {len(cat)} starter trees, the task pages and the grader; unpack it in an empty directory")


def home_of_copy():
    """Inside a learner's copy, the grader of the workbook or pack that made it (its tests are the
    pristine ones); None elsewhere."""
    if not os.path.isfile(os.path.join(ROOT, MARK)):
        return None
    with open(os.path.join(ROOT, MARK)) as f:
        home = json.load(f).get("home", "")
    for root in (home, os.path.dirname(os.path.dirname(ROOT))):
        script = os.path.join(root, "tools", "exercise.py")
        if root and os.path.isfile(script) and not os.path.isfile(os.path.join(root, MARK)):
            return script
    die("this copy's workbook or pack is gone: grade it from there with tools/exercise.py grade --dir DIR")


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
    g.add_argument("--dir", action="append", help="grade this copy (default: work/<id>); repeatable")
    g.add_argument("--as", dest="as_ex", help="with this exercise's checks (the workbook's own code: --dir .)")
    g.add_argument("--jobs", type=int, default=1, help="copies graded side by side")
    g.add_argument("--json", help="also write the grade of every copy graded here to this file")
    c = sub.add_parser("class")
    c.add_argument("handins", help="a folder with one folder per learner")
    c.add_argument("--csv", default="grades.csv")
    c.add_argument("--json", default="grades.json")
    c.add_argument("--jobs", type=int, default=1)
    p = sub.add_parser("pack")
    p.add_argument("--out", default=os.path.join(ROOT, "exercises-pack.tar.gz"))
    args = ap.parse_args()
    home = home_of_copy() if args.cmd in ("start", "grade") else None
    if home:  # a copy's own grader and tests are the learner's to edit: never the ones that grade
        argv = sys.argv[1:] if args.cmd == "start" else ["grade", "--dir", ROOT]
        os.execv(sys.executable, [sys.executable, home] + argv)
    cat = load_catalogue(args.catalogue)
    if args.cmd == "list":
        for ex in cat.values():
            print(f"{ex['id']:<28} {ex['stage']:<7} {ex['kind']:<12} {ex['title']}")
    elif args.cmd == "start":
        start(cat, args.id, args.state, os.path.abspath(args.dir) if args.dir else os.path.join(WORK, args.id),
              again=args.again)
    elif args.cmd == "grade":
        grade(cat, args.ids, args.dir, args.as_ex, args.jobs, args.json)
    elif args.cmd == "class":
        grade_class(cat, args.handins, args.csv, args.json, args.jobs)
    elif args.cmd == "pack":
        pack(cat, args.out)


if __name__ == "__main__":
    main()
