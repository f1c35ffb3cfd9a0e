#!/usr/bin/env python3
"""What the READMEs and docs name in backticks, and whether the tree has it (tests/test_docs.sh).

Usage: doc_names.py <keys file> <make targets file> <allow file> <markdown file>...
  keys file: the config keys, one a line (build/stage-1 --help lists them)
  make targets file: the Makefile's targets, one a line (make -pn)
  allow file: "token | reason" lines, the exceptions
Prints one line per name: "ok|bad|skip <TAB> file:line <TAB> token <TAB> what it was taken for".

A name is what a `code span` holds, every command line of a ```sh block, a link's target and a
path of a source file written in the text (common/model/gpt.c): these must exist. How a span is read:
  - a command (its first word, after VAR=value assignments, is make, a build/ program, a script
    of the tree or a program of the workbook's toolchain): the program exists; make's targets are
    the Makefile's; a stage's --key=value names a config key, another program's --flag is one
    the tree's sources spell; every path of the tree it names (configs/, slurm/, tests/, ...)
    exists;
  - --flag[=value]: a config key, or a flag some file of the tree spells (`--nodes` in slurm/);
  - a path (a slash, or a file extension): it exists (from the root, beside the document, or a
    file of that name anywhere); an output the programs write (metrics.jsonl, build/stage-N,
    out/..., /tmp/...) is a make target or a name the sources spell;
  - key=value and key: value: key is a config key (VAR=value in capitals: a variable the sources
    or the Makefile read, or one of NCCL_/OMPI_/UCX_/PMIX_/CUDA_/SLURM_'s);
  - an identifier (function, type, macro, field, JSON key, f() and a.b->c included): a word of
    the tree's C, CUDA, shell and Python sources, configs or Makefile, or a config key;
    a_forward/backward is a_forward and a_backward; NCCL_* a prefix of some word;
  - a hyphenated name (all-reduce, 16-mixed): spelled as is in the sources;
  - skipped: numbers and grids ([2,2,1]), formulas and prose (spaces, no command), JSON
    snippets, and the allow file's tokens.
"""
import os
import re
import shlex
import subprocess
import sys

SOURCE_EXT = (".c", ".h", ".cu", ".sh", ".py", ".json")
# programs that are not the workbook's but that its docs tell you to run
EXTERNAL = {
    "/usr/bin/time", "apt-get", "bash", "cat", "cd", "compute-sanitizer", "curl", "diff", "echo",
    "export", "for", "gdb", "kill", "ls", "mpirun", "nvcc", "nvidia-smi", "pip", "printf", "python3",
    "rm", "sbatch", "scancel", "scontrol", "sed", "sinfo", "source", "squeue", "srun", "sudo", "tail",
}
ENV_PREFIXES = ("NCCL_", "OMPI_", "UCX_", "PMIX_", "CUDA_", "SLURM_", "OMP_")
TREE_DIRS = ("common/", "configs/", "data/", "docs/", "scripts/", "slurm/", "tests/", "tools/")
PLACEHOLDER = re.compile(r"<[^>]*>|\{[a-z]\}|…|\.\.\.|\b(?:N|P|M|L|DIR|FILE|JOB|NAME|OUT_DIR)\b")
ENV = re.compile(r"[A-Z][A-Z0-9]*(_[A-Za-z0-9]+)*")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
SOURCE_FILE = r"\.(c|h|cu|sh|py|md|json)$"


def tree_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return [f for f in out if f and os.path.exists(f)]


class Tree:
    def __init__(self, keys, targets, docs):
        self.files = set(tree_files())
        self.dirs = {os.path.dirname(f) + "/" for f in self.files}
        for d in list(self.dirs):
            while "/" in d.rstrip("/"):
                d = d.rstrip("/").rsplit("/", 1)[0] + "/"
                self.dirs.add(d)
        self.basenames = {os.path.basename(f) for f in self.files}
        # the test's own lists would name every token: they are not sources
        mine = {"tests/test_docs.sh", "tests/doc_names.py"}
        sources = [f for f in self.files if (f.endswith(SOURCE_EXT) or os.path.basename(f) == "Makefile")
                   and f not in mine and not f.startswith("data/")]
        self.text = "\n".join(open(f, errors="replace").read() for f in sorted(sources))
        self.words = set(re.findall(IDENT, self.text))
        self.keys = keys
        self.targets = targets
        # the run directories the docs' own commands write (build/stage-1 ... --out_dir=out/x)
        self.out_dirs = set()
        for doc in docs:
            self.out_dirs |= set(re.findall(r"--out_dir[= ](out/[\w./-]+)", open(doc).read()))

    def spelled(self, s):
        return s in self.text

    def spelled_name(self, s):
        """s spelled as a whole name: not inside a longer one (all-reduce is not all-reducer)"""
        return re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", self.text) is not None

    def word(self, w):
        return w in self.words or w in self.keys


def placeholder_regex(path):
    parts = PLACEHOLDER.split(path)
    return re.compile("^" + "[^/]*".join(re.escape(p) for p in parts) + "/?$")


def output_spelled(tree, path):
    """An output path (not in the tree): its longest spelled leading part, then every further
    component spelled after a slash ("$DIR/node/" spells /tmp/x/node/* once DIR=/tmp/x is)."""
    parts = [max(PLACEHOLDER.split(c), key=len) for c in path.replace("*", "…").strip("/").split("/")]
    lead = "/" if path.startswith("/") else ""
    for i in range(len(parts), 0, -1):
        prefix = lead + "/".join(parts[:i])
        if len(prefix) > 2 and tree.spelled(prefix):
            return all(not c or tree.spelled("/" + c) for c in parts[i:])
    return False


def path_ok(tree, path, doc_dir):
    """A path names a file or directory of the tree, or an output the tree's code spells out."""
    plain = path.rstrip("/")
    if PLACEHOLDER.search(path) or "*" in path:
        rx = placeholder_regex(path.replace("*", "<any>"))
        names = tree.files | tree.dirs | tree.targets
        if any(rx.match(n) or rx.match(n + "/") for n in names):
            return True, "path (pattern)"
        return output_spelled(tree, path), "output (pattern) the sources spell"
    for cand in (plain, os.path.normpath(os.path.join(doc_dir, plain))):
        if cand in tree.files or cand + "/" in tree.dirs:
            return True, "path"
    if "/" not in plain and plain in tree.basenames:
        return True, "file name"
    under_target = plain.startswith("build/") and any(t.startswith(plain + "/") for t in tree.targets)
    if plain in tree.targets or under_target:
        return True, "make target"
    if (plain.startswith(TREE_DIRS) or re.match(r"\d\d_", plain)) and re.search(SOURCE_FILE, plain):
        return False, "path of the tree that does not exist"
    if plain.startswith("out/"):
        named = any(d == plain or d.startswith(plain + "/") for d in tree.out_dirs)
        return named or output_spelled(tree, plain), "an out_dir the docs' commands or the sources name"
    if plain.endswith(".o") and plain[:-2] + ".c" in tree.basenames:
        return True, "object of a source file"
    return output_spelled(tree, plain), "output the sources spell"


def flag_ok(tree, flag, stage):
    name = flag[2:].split("=", 1)[0]
    if stage:
        return name in tree.keys or name in ("config", "help"), "config key (--key)"
    return name in tree.keys or tree.spelled("--" + name), "flag the sources spell"


def env_ok(tree, var):
    return var.startswith(ENV_PREFIXES) or var in tree.words, "variable"


def command_check(tree, words, doc_dir):
    """Problems with one simple command (a list of words); [] when it names what exists."""
    bad = []
    while words and re.match(rf"^{ENV.pattern}=", words[0]):
        ok, _ = env_ok(tree, words[0].split("=")[0])
        if not ok:
            bad.append(f"variable {words[0].split('=')[0]} is read nowhere in the tree")
        words = words[1:]
    if not words:
        return bad
    prog, args = words[0], words[1:]
    if prog == "make":
        for a in args:
            if a.startswith("-"):
                continue
            if "=" in a:
                if a.split("=")[0] not in tree.words:
                    bad.append(f"make variable {a.split('=')[0]} is not the Makefile's")
            elif not any(placeholder_regex(a).match(t) for t in tree.targets):
                bad.append(f"make target {a} is not the Makefile's")
        return bad
    stage = re.match(r"^build/stage-(\d|N)$", prog)
    if prog.startswith("build/"):
        if not any(placeholder_regex(prog).match(t) for t in tree.targets):
            bad.append(f"program {prog} is no make target")
    elif prog.startswith("$"):
        pass  # a program under a directory the reader sets
    elif "/" in prog and prog not in EXTERNAL:
        if not path_ok(tree, prog, doc_dir)[0]:
            bad.append(f"program {prog} does not exist")
    elif prog not in EXTERNAL:
        bad.append(f"program {prog} is neither the tree's nor a known external one")
    if prog in ("mpirun", "srun", "sudo", "sbatch"):
        # the launcher's own options, then the command it starts (if the line names one)
        starts = ("build/", "tests/", "slurm/", "python3", "bash")
        rest = [i for i, a in enumerate(args) if a.startswith(starts)]
        if rest:
            return bad + command_check(tree, args[rest[0]:], doc_dir)
        return bad
    for a in args:
        a = a.lstrip("<(").rstrip(")")
        value = a.split("=", 1)[1] if a.startswith("--") and "=" in a else a
        if a.startswith("--") and prog.startswith(("build/", "tests/", "scripts/", "tools/")):
            ok, _ = flag_ok(tree, a, stage)
            if not ok:
                bad.append(f"{prog} has no option {a.split('=')[0]}")
        if value.startswith(TREE_DIRS + ("build/",)) or re.match(r"^\d\d_\w+/", value):
            if not path_ok(tree, value.strip("'\""), doc_dir)[0]:
                bad.append(f"path {value} does not exist")
    return bad


def words_of(text):
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote: the words as they stand
        return text.split()


def split_commands(text):
    return [words_of(c) for c in re.split(r"&&|\|\||[|;]", text) if c.strip()]


def is_command(tree, text):
    words = text.split()
    while words and re.match(rf"^{ENV.pattern}=", words[0]):
        words = words[1:]
        if not words:
            return True
    if not words:
        return False
    w = words[0].rstrip(";")
    return (w == "make" or (w.startswith("build/") and len(words) > 1)
            or (w in EXTERNAL and (len(words) > 1 or w != "source")) or (w.endswith((".sh", ".py")) and "/" in w))


def classify(tree, tok, doc_dir):
    """(ok, what it was taken for); ok None: skipped."""
    t = " ".join(tok.split())
    if not re.search(r"[A-Za-z]", t) or re.fullmatch(r"[\d.]+[a-z]?|\[[^\]]*\]", t):
        return None, "number or grid"
    if t.startswith("{") or t.startswith("[") and ":" in t:
        return None, "JSON snippet"
    if is_command(tree, t):
        bad = [b for c in split_commands(t) for b in command_check(tree, c, doc_dir)]
        return (not bad), "command" + (": " + "; ".join(bad) if bad else "")
    words = t.split()
    if words[0].startswith("--") or words[0].startswith("configs/") and len(words) > 1:
        # options, maybe with their values: the flags are names, the paths exist
        bad = [w for w in words if w.startswith("--") and not flag_ok(tree, w, False)[0]]
        bad += [w for w in words if "/" in w and not w.startswith("--") and not path_ok(tree, w, doc_dir)[0]]
        return (not bad), "options" + (": not a config key nor a flag the tree spells, or no such path: "
                                       + " ".join(bad) if bad else "")
    m = re.fullmatch(rf"({IDENT})(=|: )(.*)", t)
    if m and (m.group(1) in tree.keys or " " not in m.group(3)):
        key = m.group(1)
        if m.group(2) == "=" and ENV.fullmatch(key):
            return env_ok(tree, key)
        if key in tree.keys:
            return True, "key=value (a config key)"
        return key in tree.words, "name=value (not a config key: a word of the sources)"
    if re.fullmatch(rf"\$\{{?{IDENT}\}}?", t):
        return env_ok(tree, t.strip("${}"))
    if re.fullmatch(rf"#+{IDENT}|{IDENT}::{IDENT}", t):
        return tree.spelled(t.lstrip("#")), "spelled as is"
    if " " in t:
        return None, "phrase or formula"
    if re.fullmatch(rf"{IDENT}(\(.*\)|\[\w*\])", t):
        return tree.word(re.split(r"[(\[]", t)[0]), "call or element"
    if re.fullmatch(IDENT, t):
        return tree.word(t), "identifier or key"
    if re.fullmatch(rf"{IDENT}\*", t):
        return any(w.startswith(t[:-1]) for w in tree.words), "prefix"
    m = re.fullmatch(r"([\w.]*\.|\w*_)(\w+)/(\w+)", t)
    if m and not path_ok(tree, t, doc_dir)[0]:
        names = [m.group(1) + m.group(2), m.group(1) + m.group(3)]
        missing = [n for n in names if not classify(tree, n, doc_dir)[0]]
        return not missing, "a_x/y: a_x and a_y" + (": missing " + " ".join(missing) if missing else "")
    if "/" in t or re.search(r"\.(c|h|cu|sh|py|json|jsonl|md|txt|log|safetensors|o|tmp)$", t):
        return path_ok(tree, t, doc_dir)
    if re.fullmatch(rf"{IDENT}(\[[a-z]\])?((\.|->){IDENT}(\[[a-z]\])?)+", t):
        if tree.spelled(t):
            return True, "dotted name"
        missing = [w for w in re.findall(IDENT, t) if not tree.word(w)]
        return not missing, "dotted name" + (": missing " + " ".join(missing) if missing else "")
    if re.fullmatch(r"[\w.{}-]+", t):
        fixed = PLACEHOLDER.split(t)
        if len(fixed) == 1:
            return tree.spelled_name(t), "name spelled as is"
        return all(tree.spelled(p) for p in fixed if p), "name spelled as is (placeholders aside)"
    return None, "other text"


def code_spans(text):
    """(line, content) of every inline code span outside fenced blocks, and of every command line
    of the ```sh blocks (continuation lines joined)."""
    lines = text.split("\n")
    prose, spans, fence = [], [], None
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("```"):
            fence = None if fence is not None else s[3:].strip()
            prose.append("")
            continue
        if fence is None:
            prose.append(line)
        else:
            prose.append("")
            if fence in ("sh", "bash"):
                spans.append((i + 1, line))
    cmds, pending = [], None
    for n, line in spans:
        if pending:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (n, line.strip())
        if line.rstrip().endswith("\\"):
            pending = (pending[0], pending[1].rstrip("\\ "))
            continue
        cmd = re.sub(r"\s#\s.*$", "", pending[1]).strip()
        if cmd and not cmd.startswith("#"):
            cmds.append((pending[0], re.sub(r"^\$ ", "", cmd)))
        pending = None
    joined = "\n".join(prose)
    found = []
    span = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", flags=re.S)
    for m in span.finditer(joined):
        found.append((joined.count("\n", 0, m.start()) + 1, m.group(2).replace("\n", " ").strip(), "span"))
    # outside the code spans: the targets of links, and paths of the tree's source files
    rest = span.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), joined)
    rest = re.sub(r"\b(https?|ftp)://\S+", " ", rest)
    for m in re.finditer(r"\]\(([^)\s#]+)[^)]*\)", rest):
        found.append((rest.count("\n", 0, m.start()) + 1, m.group(1), "link"))
    rest = re.sub(r"\]\([^)]*\)", " ", rest)
    for m in re.finditer(r"(?<![\w/.-])(?:[\w.-]+/)+[\w.-]+\.(?:c|h|cu|sh|py|md|json)\b", rest):
        found.append((rest.count("\n", 0, m.start()) + 1, m.group(0), "prose"))
    return found + [(n, c, "block") for n, c in cmds]


def main():
    keys = set(open(sys.argv[1]).read().split())
    targets = set(open(sys.argv[2]).read().split())
    allow = {}
    for line in open(sys.argv[3]):
        if "|" in line and not line.startswith("#"):
            tok, why = line.rsplit("|", 1)
            allow[tok.strip()] = why.strip()
    tree = Tree(keys, targets, sys.argv[4:])
    used = set()
    for doc in sys.argv[4:]:
        for n, tok, kind in code_spans(open(doc).read()):
            where = f"{doc}:{n}"
            if tok in allow:
                used.add(tok)
                print(f"skip\t{where}\t{tok}\tallowed: {allow[tok]}")
                continue
            if kind in ("link", "prose"):
                ok, what = path_ok(tree, tok, os.path.dirname(doc))
                ok = ok and what in ("path", "file name") if kind == "link" else ok
                what = ("link target: a file or directory of the tree" if kind == "link"
                        else "path in the text: " + what)
            elif kind == "block":
                if not is_command(tree, tok):
                    print(f"skip\t{where}\t{tok}\tnot a command")
                    continue
                bad = [b for c in split_commands(tok) for b in command_check(tree, c, os.path.dirname(doc))]
                ok, what = not bad, "command" + (": " + "; ".join(bad) if bad else "")
            else:
                ok, what = classify(tree, tok, os.path.dirname(doc))
            state = "skip" if ok is None else "ok" if ok else "bad"
            print(f"{state}\t{where}\t{tok}\t{what}")
    for tok in allow:
        if tok not in used:
            print(f"bad\ttest_docs.sh's allow list\t{tok}\tallowed but named by no document: remove it")


if __name__ == "__main__":
    main()
