#!/usr/bin/env python3
"""`make test-mutations`: plants each bug of tests/mutations.txt, one at a time, in a scratch copy
of the tree, rebuilds it and runs the tests named beside it. A mutation is caught when one of its
tests fails; each test is first run once on the tree as it is, and one that fails there makes
its mutations errors, not catches. Prints one row per mutation (caught by which test, missed, or
an error) and exits 0 only when every mutation was caught.

usage: python3 tests/mutations.py [name-filter]

A mutation names a snippet of code, not a file and a line, so that the list survives code being
moved between files: the snippet must occur exactly once in the tree's sources (*.c, *.h, *.cu,
*.py, and *.sh: the test harness's own bugs), else the mutation is reported as an error. tests/mutations.txt says how to write one.
"""
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = (".c", ".h", ".cu", ".py", ".sh")  # the tools in Python (the exercise grader) and the test harness too
TEST_TIMEOUT = 3600  # a hung test ends; a slow one (a loaded machine) does not
RUNS = itertools.count()  # each run's tag apart


def unescape(text):
    """the list's find/replace values: \\n is a newline, \\t a tab, \\\\ a backslash"""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def read_mutations(path):
    """blocks of `name:`, `find:`, `replace:`, `tests:` lines, separated by blank lines; # comments"""
    mutations, current = [], {}
    for number, line in enumerate(open(path), 1):
        line = line.rstrip("\n")
        if line.startswith("#"):
            continue
        if not line.strip():
            if current:
                mutations.append(current)
            current = {}
            continue
        key, sep, value = line.partition(": ")
        if not sep and line.endswith(":"):
            key, sep, value = line[:-1], ":", ""
        if key not in ("name", "find", "replace", "tests") or not sep or key in current:
            sys.exit(f"{path}:{number}: expected one 'name: ', 'find: ', 'replace: ' or 'tests: ' line, found {line!r}")
        current[key] = value
    if current:
        mutations.append(current)
    for m in mutations:
        missing = [k for k in ("name", "find", "replace", "tests") if k not in m]
        if missing:
            sys.exit(f"{path}: mutation {m.get('name', '?')!r} has no {', '.join(missing)}")
        m["find"], m["replace"], m["tests"] = unescape(m["find"]), unescape(m["replace"]), m["tests"].split()
    return mutations


def copy_tree(scratch):
    """the working tree (tracked and untracked, not ignored files) with its CPU build, mtimes kept
    so that make rebuilds only what a mutation touches; the fixtures and the oracle venv linked"""
    tree = os.path.join(scratch, "tree")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = os.path.join(ROOT, f)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(tree, f)), exist_ok=True)
            shutil.copy2(src, os.path.join(tree, f), follow_symlinks=False)
    build = os.path.join(ROOT, "build")
    for entry in os.listdir(build):
        src, dst = os.path.join(build, entry), os.path.join(tree, "build", entry)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if entry == "cuda":
            continue
        if entry.endswith("venv"):
            os.symlink(src, dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst)
    os.symlink(os.path.realpath(os.path.join(ROOT, "..", "shared")), os.path.join(scratch, "shared"))
    return tree


def sources(tree):
    for top, dirs, files in os.walk(tree):
        dirs[:] = [d for d in dirs if d not in ("build", ".git")]
        for f in files:
            if f.endswith(SOURCES):
                yield os.path.join(top, f)


def locate(tree, snippet):
    """the files holding the snippet, one entry per occurrence"""
    hits = []
    for path in sources(tree):
        hits += [path] * open(path, encoding="utf-8").read().count(snippet)
    return hits


def run(cmd, cwd, log, timeout):
    """cmd's exit status, 124 when it ran past timeout. It runs under a tag of its own (tests/lib.sh's
    TEST_PROCESS_TAG): however it ends, whatever still carries the tag is ended (end_test_processes:
    SIGTERM, so that a test's EXIT trap runs, then SIGKILL), not only the test's own shell."""
    tag = f"mutations-{os.getpid()}-{next(RUNS)}"
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, TEST_PROCESS_TAG=tag))
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124
        finally:
            end_tagged(tag)
            proc.wait()


def end_tagged(tag):
    """tests/lib.sh's end_test_processes for tag, run from a shell that does not carry it"""
    env = {k: v for k, v in os.environ.items() if k != "TEST_PROCESS_TAG"}
    subprocess.run(["bash", "-c", 'source tests/lib.sh && end_test_processes "$1"', "end_tagged", tag],
                   cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def test_program(tree, name):
    """the test program a name means: NAME.c, or NAME where no tests/NAME.sh takes it; else None"""
    stem = name[:-2] if name.endswith(".c") else name
    if os.path.isfile(os.path.join(tree, "tests", stem + ".c")) and (
            name.endswith(".c") or not os.path.isfile(os.path.join(tree, "tests", name + ".sh"))):
        return stem
    return None


def test_command(tree, name):
    """NAME or NAME.sh: tests/NAME.sh; NAME.c (or NAME without a script): build/tests/NAME"""
    script = name if name.endswith(".sh") else name + ".sh"
    if not name.endswith(".c") and os.path.isfile(os.path.join(tree, "tests", script)):
        return ["bash", os.path.join("tests", script)]
    program = test_program(tree, name)
    return [os.path.join("build", "tests", program)] if program else None


def build(tree, log):
    """every stage, tool and test program (the Makefile's test-programs): a script's tests run the
    programs it names (test_llama_oracle runs build/tests/test_llama), which must carry the bug"""
    return run(["make", "-j2", "--no-print-directory", "BACKEND=cpu", "test-programs"], tree, log, 1800)


def failing_without_mutations(tree, tests, logs):
    """the tests that fail on the tree as it is: they would 'catch' any mutation"""
    return {t for t in tests if test_command(tree, t)
            and run(test_command(tree, t), tree, os.path.join(logs, f"unmutated_{t}.log"), TEST_TIMEOUT) != 0}


def try_mutation(tree, m, log, failing):
    """(result, detail): caught (by which test), missed, or error (why)"""
    hits = locate(tree, m["find"])
    if len(hits) != 1:
        return "error", f"snippet found {len(hits)} times in the sources, not once"
    unknown = [t for t in m["tests"] if not test_command(tree, t)]
    if unknown:
        return "error", f"no test named {' '.join(unknown)} (tests/NAME.sh, or tests/NAME.c as NAME.c)"
    if failing & set(m["tests"]):
        return "error", f"{' '.join(sorted(failing & set(m['tests'])))} fails without the mutation"
    path = hits[0]
    original = open(path, encoding="utf-8").read()
    open(path, "w", encoding="utf-8").write(original.replace(m["find"], m["replace"]))
    try:
        if build(tree, log) != 0:
            return "error", f"the mutated tree does not build ({os.path.relpath(path, tree)}; see {log})"
        for t in m["tests"]:
            if run(test_command(tree, t), tree, log, TEST_TIMEOUT) != 0:
                return "caught", t
        return "missed", " ".join(m["tests"]) + " passed"
    finally:
        open(path, "w", encoding="utf-8").write(original)
        os.utime(path)  # newer than its objects: the next build compiles the original again


def main():
    listed = read_mutations(os.path.join(ROOT, "tests", "mutations.txt"))
    chosen = [m for m in listed if len(sys.argv) < 2 or sys.argv[1] in m["name"]]
    scratch = tempfile.mkdtemp(prefix="mutations-")
    logs = os.path.join(scratch, "logs")
    os.makedirs(logs)
    tree = copy_tree(scratch)
    every_test = sorted({t for m in chosen for t in m["tests"]})
    if build(tree, os.path.join(logs, "unmutated.log")) != 0:
        sys.exit(f"the unmutated copy does not build: see {logs}/unmutated.log")
    failing = failing_without_mutations(tree, every_test, logs)
    counts = {"caught": 0, "missed": 0, "error": 0}
    print(f"{'mutation':58} {'result':7} {'seconds':>7}  detail")
    for i, m in enumerate(chosen):
        start = time.time()
        result, detail = try_mutation(tree, m, os.path.join(logs, f"{i:02d}.log"), failing)
        counts[result] += 1
        print(f"{m['name'][:58]:58} {result:7} {time.time() - start:7.0f}  {detail}", flush=True)
    all_caught = counts["missed"] == counts["error"] == 0
    print(f"{counts['caught']} caught, {counts['missed']} missed, {counts['error']} errors (of {len(chosen)})"
          + ("" if all_caught else f"; the scratch tree and its logs are kept in {scratch}"))
    if all_caught:
        shutil.rmtree(scratch)
    sys.exit(0 if all_caught else 1)


if __name__ == "__main__":
    main()
