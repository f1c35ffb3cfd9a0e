#!/usr/bin/env python3
"""Who uses whose files (tests/test_code_graph.sh): the include graph of common/ and what each
stage and tool compiles against and links.

Usage: code_graph.py <make database> <compile commands>
  make database: `make -pn BACKEND=cpu` (the link prerequisites of build/cpu/stage-N and of the
  tools, and the STAGE_DIR_N and TOOLS variables)
  compile commands: `make -n -B BACKEND=cpu <every stage's and tool's objects>` (their -I flags)
Prints one line per finding: "<kind> <TAB> <who> <TAB> <what>", kinds:
  cycle     common/ modules, or one stage's (but 06's), that include each other, round a loop (module =
            file stem: gpt.c and gpt.h are gpt; x_internal.h is x's); "a -> b -> a" and every
            include inside it (a technique and its glue included by each other: fsdp <-> fsdp_x)
  folder    a common/ file including a file of a folder its own may not include (common/README.md's
            table), or a folder with no row there
  outside   a common/ file including a file outside common/
  links     a program linking another stage's object (who: stage-N or a tool)
  flag      a stage's or tool's object compiled with -I<another stage's directory>
  includes  a stage's or tool's file including another stage's file
and "ok" lines for the edges the rules allow, so the caller sees the graph was read.
"""
import os
import re
import sys


def make_vars(db):
    return {m.group(1): m.group(2).split() for m in re.finditer(r"^(\w+) :?= (.*)$", db, flags=re.M)}


def includes(path):
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', open(path, errors="replace").read(), flags=re.M)


def resolve(name, src, search):
    for d in [os.path.dirname(src)] + search:
        p = os.path.normpath(os.path.join(d, name))
        if os.path.exists(p):
            return p
    return None


def shortest_loop(edges, scc):
    """The shortest way from the component's first module back to itself (breadth first)."""
    start, parent, queue = scc[0], {scc[0]: None}, [scc[0]]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, ())):
            if w == start:
                loop = [v]
                while parent[loop[-1]] is not None:
                    loop.append(parent[loop[-1]])
                return [start] + loop[::-1][1:] + [start] if len(loop) > 1 else [start, v, start]
            if w in scc and w not in parent:
                parent[w] = v
                queue.append(w)
    return scc


def folder_rules():
    """common/README.md's table: each folder and the folders it may include."""
    rules = {}
    for m in re.finditer(r"^\| `(\w+)/` \| ([^|]*) \|", open("common/README.md").read(), flags=re.M):
        rules[m.group(1)] = set(re.findall(r"`(\w+)/`", m.group(2)))
    return rules


def common_cycles():
    """Strongly connected components of more than one module, found by Tarjan's algorithm; and
    every include from one folder of common/ into another that common/README.md does not allow."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk("common") for f in fs if f.endswith((".c", ".h", ".cu")))
    # a module is a file stem; x_internal.h, the private header of x's files, is part of x
    stem = lambda p: re.sub(r"_internal$", "", os.path.splitext(p)[0])
    folder = lambda p: p.split("/")[1] if p.count("/") > 1 else ""
    rules = folder_rules()
    edges, findings = {}, []
    for a in rules:  # the table itself has an order: no folder may reach itself
        seen, todo = set(), list(rules[a])
        while todo:
            b = todo.pop()
            if b == a:
                findings.append(("folder", f"common/{a}/", "reaches itself through common/README.md's table"))
                break
            if b not in seen:
                seen.add(b)
                todo += rules.get(b, ())
    for d in sorted({folder(f) for f in files}):
        if d not in rules:
            findings.append(("folder", f"common/{d}/", "has no row in common/README.md's table"))
    for f in files:
        for name in includes(f):
            p = resolve(name, f, ["common"])
            if p is None or not p.startswith("common/"):
                findings.append(("outside", f, f"#include \"{name}\" ({p or 'not found'})"))
                continue
            a, b = folder(f), folder(p)
            if a != b and b not in rules.get(a, set()):
                findings.append(("folder", f, f"#include \"{name}\": common/{a}/ may not include common/{b}/ (common/README.md)"))
            if stem(p) != stem(f):
                edges.setdefault(stem(f), set()).add(stem(p))
    for loop, inside in loops(edges):
        findings.append(("cycle", "common/", f"{loop} (the loop's includes: {inside})"))
    return findings


def loops(edges):
    """Strongly connected components of more than one module, found by Tarjan's algorithm: each
    as its shortest loop and the includes inside it."""
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    for scc in sccs:
        inside = ", ".join(f"{a} -> {b}" for a in scc for b in sorted(edges.get(a, ())) if b in scc)
        yield " -> ".join(shortest_loop(edges, scc)), inside


def stage_cycles(own):
    """The loops among one stage's modules (its sub-folders' too), its own includes resolved in
    its directory."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(own) for f in fs if f.endswith((".c", ".h", ".cu")))
    stem = lambda p: re.sub(r"_internal$", "", os.path.splitext(p)[0])
    edges = {}
    for f in files:
        for name in includes(f):
            p = resolve(name, f, [own])
            if p and p.startswith(own + "/") and stem(p) != stem(f):
                edges.setdefault(stem(f), set()).add(stem(p))
    return [("cycle", own, f"{loop} (the loop's includes: {inside})") for loop, inside in loops(edges)]


def allowed(who, path):
    """The uses of another stage's files the design allows: stage 06 runs 05's tensor-parallel
    layers and generates from 08's MoE checkpoints with 08's moe files; stage 10 composes the
    techniques, calling 05's tensor-parallel layers inside 07's pipeline stages, 09's chunks
    and ring attention and 08's MoE MLP inside 05's layers (the pieces, not copies); the planner sizes every
    layout with the stages' own arithmetic."""
    if who == "plan":
        return True
    if who == "stage-10":
        return path.startswith(("05_tensor_parallel/", "07_pipeline_parallel/", "08_mixture_of_experts/",
                                "09_context_parallel/"))
    if who == "stage-6":
        return path.startswith("05_tensor_parallel/") or (path.startswith("08_mixture_of_experts/")
                                                          and os.path.basename(path).startswith("moe"))
    return False


def allowed_directory(who, directory):
    return any(allowed(who, f"{directory}/{f}") for f in os.listdir(directory))


def main():
    db = open(sys.argv[1]).read()
    compiles = open(sys.argv[2]).read().split("\n")
    v = make_vars(db)
    stage_dirs = {n: v[f"STAGE_DIR_{n}"][0] for n in map(str, range(1, 11)) if f"STAGE_DIR_{n}" in v}
    dir_of = {d: n for n, d in stage_dirs.items()}
    findings = common_cycles()
    # (06_inference's own loops, kv_grid <-> kv_model and serving's request_logits <-> scheduler,
    # are older than this check and not yet untangled: its modules are left out until they are)
    for d in sorted(set(stage_dirs.values()) - {"06_inference"}):
        findings += stage_cycles(d)
    programs = {f"stage-{n}": d for n, d in stage_dirs.items()}
    programs.update({t: "tools" for t in v.get("TOOLS", [])})
    flags = {}
    for line in compiles:
        m = re.search(r"-c (\S+\.c[u]?) -o (\S+)", line)
        if m:
            flags[m.group(1)] = [f[2:] for f in line.split() if f.startswith("-I") and f != "-I"]
    for who, own in sorted(programs.items()):
        m = re.search(rf"^build/cpu/{re.escape(who)}: (.*)$", db, flags=re.M)
        if not m:
            findings.append(("links", who, "no link rule build/cpu/" + who + " in make -pn"))
            continue
        objs = [o[len("build/cpu/"):] for o in m.group(1).split() if o.endswith(".o")]
        for o in objs:
            top = o.split("/")[0]
            if top in dir_of and top != own:
                kind = "ok" if allowed(who, o) else "links"
                findings.append((kind, who, f"links {o}"))
        # the program's own files (a tool's: tools/<name>*), headers too, each with the -I
        # directories its directory's objects are compiled with
        # (a stage's sub-folders too: 06's serving/, 09's backend/)
        mine = sorted(os.path.join(d, f) for d, _, fs in os.walk(own) for f in fs
                      if f.endswith((".c", ".h", ".cu")) and (own != "tools" or f.startswith(who)))
        search = ["common"]
        for src in mine:
            for d in flags.get(src, []):
                d = os.path.normpath(d)
                if d not in search:
                    search.append(d)
                if d in dir_of and d != own:
                    # a directory on the include path is allowed when some of its files are: the
                    # includes below are then checked file by file
                    kind = "ok" if allowed_directory(who, d) else "flag"
                    findings.append((kind, who, f"{src} is compiled with -I{d}"))
        for src in mine:
            for name in includes(src):
                p = resolve(name, src, search)
                if p and p.split("/")[0] in dir_of and p.split("/")[0] != own:
                    kind = "ok" if allowed(who, p) else "includes"
                    findings.append((kind, who, f"{src} includes {p}"))
    for kind, who, what in findings:
        print(f"{kind}\t{who}\t{what}")


if __name__ == "__main__":
    main()
