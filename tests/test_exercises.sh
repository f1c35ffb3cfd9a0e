#!/usr/bin/env bash
# The exercises (exercises/catalogue.json, graded by tools/exercise.py on pristine tests):
#  - the workbook's own code scores full points on every exercise, and every exercise's starter (its
#    stub, or its planted bug) scores 0 even when its copy grades itself: each starter copy has its
#    tests' summaries and checks made to pass, its check scripts made to exit 0, its catalogue's
#    tolerances widened, the answer-key-free calc_check.py made to exit 0, and its exercise's file
#    dated before the build (stale objects); grading takes only the exercise's part, so none of it
#    counts. All 60 hand-ins go to one grader, three trees at a time; the solutions share one tree
#    (the workbook's), where a check run by several exercises runs once;
#  - an answer that calls exit(0) scores 0 with a reason that names the missing summary line;
#  - a calculation with one key of three wrong earns its points for the other two;
#  - a GPU check is reported blocked, apart from the points earnable here;
#  - at least 20 exercises, two or more for each of stages 01-09 and common/, and 80% of all
#    points need no GPU; no calculation has an answer-key mode;
#  - the pack unpacked in an empty directory, without git: make exercise, make grade (inside the
#    copy too), make exercise AGAIN=1; the instructor's class command grades a folder of hand-ins
#    into CSV and JSON;
#  - the grader's robustness: a hand-in that does not compile, one that hangs (its processes ended
#    at the time limit), one that crashes printing bytes that are not text, one that writes
#    outside its tree, and a check whose program is missing (exit 127) are each graded failed with
#    that reason, and the grader goes on.
# Copies go to work/.test-exercises/ (removed at the end); grades are read from the JSON files.
source "$(dirname "$0")/lib.sh"
export PYTHONDONTWRITEBYTECODE=1  # tools/ is imported below: no byte-code beside the sources
base=$PWD/work/.test-exercises
rm -rf "$base"
mkdir -p "$base"
trap 'end_test_processes; rm -rf "$tmp" "$base"' EXIT
ids=$(python3 -c "import json; print(' '.join(e['id'] for e in json.load(open('exercises/catalogue.json'))['exercises']))")
# the workbook's build of every check's targets, once: each grading tree starts from it
make -j2 --no-print-directory BACKEND=cpu $(python3 -c "import json; print(' '.join(sorted({t for e in json.load(open('exercises/catalogue.json'))['exercises'] for t in e.get('build', [])})))") >/dev/null

# field <grade.json> <key>: earned, earnable, blocked ... of a grade
field() { python3 -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
file_of() { python3 -c "import json, sys; print(next(e['file'] for e in json.load(open('exercises/catalogue.json'))['exercises'] if e['id'] == sys.argv[1]))" "$1"; }
# first_why <grade.json>: the result and the first reason of its first check
first_why() { python3 -c "
import json, sys
c = json.load(open(sys.argv[1]))['checks'][0]
print(c['result'], c['earned'], ' '.join(c['why']))" "$1"; }

check 'python3 - <<PY
import json, collections, sys
ex = json.load(open("exercises/catalogue.json"))["exercises"]
per = collections.Counter(e["stage"] for e in ex)
need = ["01", "02", "03", "04", "05", "06", "07", "08", "09", "common"]
points = sum(c["points"] for e in ex for c in e["checks"])
cpu = sum(c["points"] for e in ex for c in e["checks"] if not c["needs_gpu"])
ok = len(ex) >= 20 and all(per[s] >= 2 for s in need) and cpu >= 0.8 * points
print(f"{len(ex)} exercises, per stage {dict(per)}, {cpu} of {points} points without a GPU")
sys.exit(0 if ok else 1)
PY' "the catalogue needs >= 20 exercises, >= 2 per stage and common/, and 80% of the points without a GPU"
check '! grep -q -- "--solve\|\"solve\"" exercises/calc_check.py exercises/catalogue.json' \
    "a calculation still has an answer-key mode"

# A copy that grades itself: what a learner could edit in it to pass, all of it ignored by grading
tamper() { # tamper <copy> <exercise's file>
    local c=$1
    sed -i 's/return check_failed_ ? 1 : 0;/return 0;/' "$c/tests/check.h"
    sed -i 's/if eval "\$1"; then/if true; then/; s/\[ "\$failed" -eq 0 \]$/true/' "$c/tests/lib.sh"
    sed -i '1a exit 0' "$c"/exercises/*.sh
    sed -i 's/"tolerance": [0-9.e-]*/"tolerance": 1e9/' "$c/exercises/catalogue.json"
    sed -i 's/sys.exit(1 if wrong else 0)/sys.exit(0)/' "$c/exercises/calc_check.py"
    touch -d 2001-01-01 "$c/$2"
}
export -f tamper

# start_without_build <id> <state> <copy>: a hand-in needs only its sources (grading takes its part
# into a tree of its own), and forty copies of the build would fill a small disk (a calculation's
# solution is solved with the build: it keeps it)
start_without_build() {
    python3 -c "
import sys; sys.path.insert(0, 'tools'); import exercise
exercise.start(exercise.load_catalogue(), sys.argv[1], sys.argv[2], sys.argv[3], with_build=False)" "$@" >/dev/null
}
export -f start_without_build

# one exercise's hand-ins: its starter, tampered, and for a calculation a copy with the right numbers
# (the workbook's own code is handed in as the workbook itself)
start_copies() { # start_copies <id>
    local id=$1 kind file
    read -r kind file < <(python3 -c "import json, sys; e = next(e for e in json.load(open('exercises/catalogue.json'))['exercises'] if e['id'] == sys.argv[1]); print(e['kind'], e['file'])" "$id")
    if [ "$kind" = calculation ]; then
        python3 tools/exercise.py start "$id" --state solution --dir "$base/solution-$id" >/dev/null
    fi
    start_without_build "$id" starter "$base/$id"
    tamper "$base/$id" "$file"
}
export -f start_copies
export base

start=$SECONDS
printf '%s\n' $ids | xargs -P 2 -I{} bash -c 'start_copies {}'
# every hand-in graded by one grader, three trees at a time: the solutions make one tree (the
# workbook's), where a check shared by exercises runs once; each grade's JSON in $tmp, and one
# line per exercise in $tmp/grades.tsv: its solution's earned and earnable points, its starter's, and
# whether the starter builds
bounded 800 python3 - "$base" "$tmp" $ids <<'PY'
import json, os, sys
sys.path.insert(0, "tools")
import exercise
base, tmp, ids = sys.argv[1], sys.argv[2], sys.argv[3:]
cat = exercise.load_catalogue()
solutions = [(i, os.path.join(base, "solution-" + i) if cat[i]["kind"] == "calculation" else exercise.ROOT) for i in ids]
starters = [(i, os.path.join(base, i)) for i in ids]
graded = exercise.grade_side_by_side(cat, solutions + starters, jobs=3)
with open(os.path.join(tmp, "grades.tsv"), "w") as tsv:
    for n, i in enumerate(ids):
        mine = {"solution": exercise.rubric(graded[n]), "starter": exercise.rubric(graded[len(ids) + n])}
        for state, grade in mine.items():
            json.dump(grade, open(os.path.join(tmp, f"{state}-{i}.json"), "w"), indent=2)
        failing = " / ".join(f"{c['check']} -> {c['result']}: {' '.join(c['why'][:3])}"
                             for c in mine["solution"]["checks"] if c["result"] != "passed")
        builds = "no" if any(c["why"][:1] and c["why"][0].startswith("build failed") for c in mine["starter"]["checks"]) \
            else "yes"
        print(i, mine["solution"]["earned"], mine["solution"]["earnable"], mine["starter"]["earned"], builds, failing,
              sep="\t", file=tsv)
PY
while IFS=$'\t' read -r id earned earnable starter builds failing; do
    check '[ "$earned" -eq "$earnable" ] && [ "$earned" -gt 0 ]' \
        "$id: the workbook's own code scores $earned of $earnable points earnable here: $failing"
    check '[ "$starter" = 0 ]' \
        "$id: its starter, in a copy that grades itself, scores $starter points; grading ran the copy's own tests or build"
    # a starter fails on its checks, not on the compiler: a learner's copy builds before any answer
    check '[ "$builds" = yes ]' "$id: its starter does not build: $(first_why "$tmp/starter-$id.json")"
done <"$tmp/grades.tsv"
check '[ "$(wc -l <"$tmp/grades.tsv")" -eq "$(wc -w <<<"$ids")" ]' "$(wc -l <"$tmp/grades.tsv") of the exercises graded"
echo "every exercise's solution and tampered starter, three trees at a time: $((SECONDS - start)) s"

# blocked points stand apart: adamw-update's GPU check
s=$tmp/solution-adamw-update.json
check '[ "$(field "$s" blocked)" = 5 ] && [ "$(field "$s" earnable)" = 10 ] || [ "$(field "$s" blocked)" = 0 ]' \
    "adamw-update's GPU check is counted in what a CPU can earn: $(field "$s" earnable) earnable, $(field "$s" blocked) blocked"

# exit(0) in an answer ends the test before its summary line: no points, and the reason says so
python3 tools/exercise.py start adamw-update --dir "$base/exit0" >/dev/null
sed -i 's|^    // TODO: one AdamW step|    exit(0);\n&|' "$base/exit0/$(file_of adamw-update)"
python3 tools/exercise.py grade --dir "$base/exit0" --json "$tmp/exit0.json" >/dev/null 2>&1
out=$(first_why "$tmp/exit0.json")
check '[[ "$out" == "failed 0 exited 0 without its test"*"summary line"* ]]' "an answer that calls exit(0): $out"

# a calculation with 2 of its 3 keys right earns 2/3 of its points
python3 - "$base/solution-calc-ddp-comm/answers.json" <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))
a["parameters"] += 1000
json.dump(a, open(sys.argv[1], "w"))
PY
python3 tools/exercise.py grade --dir "$base/solution-calc-ddp-comm" --json "$tmp/partial.json" >/dev/null 2>&1
out=$(first_why "$tmp/partial.json")
check '[[ "$out" == "partial 6 2 of 3 cases pass"*"parameters: wrong"* ]]' "calc-ddp-comm with one key of three wrong: $out"

# the pack: unpacked in an empty directory, no git anywhere above it
python3 tools/exercise.py pack --out "$tmp/pack.tar.gz" >/dev/null
check '! tar tzf "$tmp/pack.tar.gz" | grep -q "\.git/"' "the pack holds version history"
pack=$(mktemp -d /tmp/exercise-pack.XXXXXX)
clip_file=$(file_of grad-clip)
tar xzf "$tmp/pack.tar.gz" -C "$pack"
solution_body=$(python3 -c "
import sys; sys.path.insert(0, 'tools'); import exercise
ex = exercise.load_catalogue()['grad-clip']
print(exercise.learner_part('.', ex), end='')")
(
    cd "$pack" && export GIT_CEILING_DIRECTORIES=/tmp
    passed=0 failed=0  # this part's own counts, added to the rest's below
    check '[ -f README.md ] && [ -f Makefile ] && [ -f AGENTS.md ] && ! git rev-parse 2>/dev/null' "the pack's root: $(ls)"
    make exercise EX=grad-clip >/dev/null 2>&1
    check '[ -f work/grad-clip/AGENTS.md ] && grep -q "TODO" "work/grad-clip/$clip_file"' "make exercise in the pack made no starter copy"
    SOLUTION="$solution_body" python3 -c "
import os, sys; sys.path.insert(0, 'tools'); import exercise
ex = exercise.load_catalogue()['grad-clip']
exercise.put_part('work/grad-clip', ex, os.environ['SOLUTION'])"
    (cd work/grad-clip && make grade >/dev/null 2>&1)
    check '[ "$(field work/grad-clip/grade.json earned)" = 10 ]' "make grade inside the pack's copy, with the right answer: $(cat work/grad-clip/grade.json 2>&1 | head -5)"
    make exercise EX=grad-clip AGAIN=1 >/dev/null 2>&1
    make grade EX=grad-clip >/dev/null 2>&1
    check '[ "$(field work/grad-clip/grade.json earned)" = 0 ] && grep -q TODO "work/grad-clip/$clip_file"' \
        "make exercise AGAIN=1 in the pack: not a starter again, graded $(field work/grad-clip/grade.json earned 2>&1)"
    finish pack >"$tmp/pack.result"
)
read -r _ p _ f _ <"$tmp/pack.result"
passed=$((passed + p)) failed=$((failed + f))
rm -rf "$pack"

# the instructor's side: a folder with one folder per learner, into one CSV and one JSON
mkdir -p "$base/class/ana/work" "$base/class/ben" "$base/class/cai"
mv "$base/solution-calc-bubble" "$base/class/ana/work/calc-bubble"
mv "$base/exit0" "$base/class/ben/adamw-update"
python3 tools/exercise.py class "$base/class" --csv "$tmp/class.csv" --json "$tmp/class.json" --jobs 2 >/dev/null 2>&1
check 'python3 - "$tmp/class.csv" "$tmp/class.json" <<PY
import csv, json, sys
rows = {(r["learner"], r["check"][:30]): r for r in csv.DictReader(open(sys.argv[1]))}
by = json.load(open(sys.argv[2]))
ok = (by["ana"]["earned"] == 10 and by["ben"]["earned"] == 0 and by["ben"]["blocked"] in (0, 5)
      and by["cai"]["earned"] == 0 and "no exercise copy" in by["cai"]["checks"][0]["why"][0]
      and any(k[0] == "ben" for k in rows))
sys.exit(0 if ok else 1)
PY' "the class's grades: $(cat "$tmp/class.csv" 2>&1 | head -6)"

# robustness: five broken hand-ins, graded with a catalogue made for them
python3 - "$tmp/robust.json" <<'PY'
import json, sys
sampler = dict(stage="06", kind="code", file="06_inference/sampler.c", function="candidates",
               build=["build/tests/test_top_p"], title="robustness")
def exercise(id, stub, limit=60, command="build/tests/test_top_p"):
    return dict(sampler, id=id, stub=stub, checks=[{"name": "sampler", "points": 1, "command": command,
                                                    "time_limit_s": limit, "needs_gpu": False},
                                                   {"name": "after", "points": 1, "command": "echo 'after: 1 passed, 0 failed'",
                                                    "time_limit_s": limit, "needs_gpu": False}])
used = "    (void)s, (void)mass, (void)by_probability_desc, (void)g_sort_prob;\n"
ex = [exercise("no-compile", "    this is not C;"),
      exercise("hangs", used + "    for (;;) {\n    }\n    return 0;", limit=5),
      exercise("garbage", used + '    fwrite("\\xff\\xfe\\x1b[2J\\x07", 1, 6, stdout);\n    fflush(stdout);\n    abort();'),
      exercise("outside", used + '    FILE *f = fopen("../../../exercise-outside-probe", "w");\n    if (f) fclose(f);\n    abort();'),
      exercise("missing", used + "    return 0;", command="build/tests/test_top_p_not_built")]
json.dump({"exercises": ex}, open(sys.argv[1], "w"))
PY
robust() { # robust <id>: starts and grades that broken copy; its first check's result and why are printed
    python3 tools/exercise.py --catalogue "$tmp/robust.json" start "$1" --dir "$base/$1" >/dev/null
    bounded 300 python3 tools/exercise.py --catalogue "$tmp/robust.json" grade --dir "$base/$1" >"$tmp/robust-$1.log" 2>&1
    python3 -c "
import json, sys
c = json.load(open(sys.argv[1]))['checks']
print(c[0]['result'], c[1]['result'], ' '.join(c[0]['why']))" "$base/$1/grade.json"
}
out=$(robust no-compile)
check '[[ "$out" == "failed failed build failed"* ]]' "a copy that does not compile: $out"
start=$SECONDS
out=$(robust hangs)
check '[[ "$out" == "failed passed timed out after 5 s"* ]] && [ $((SECONDS - start)) -lt 120 ]' \
    "a copy that hangs: $out ($((SECONDS - start)) s)"
check '! pgrep -f "$base/hangs" >/dev/null && ! pgrep -x test_top_p >/dev/null' "the hung check's processes were not ended"
out=$(robust garbage)
check '[[ "$out" == "failed passed crashed: SIGABRT"* ]]' "a copy that crashes printing bytes: $out"
check 'python3 -c "import json, sys; json.load(open(sys.argv[1]))" "$base/garbage/grade.json"' "grade.json of the garbage-printing copy is not JSON"
out=$(robust outside)
check '[[ "$out" == "failed passed wrote outside its tree: exercise-outside-probe"* ]]' "a copy that writes outside itself: $out"
rm -f exercise-outside-probe
# a check whose program is not there (bash: command not found, exit 127) is failed, not passed
out=$(robust missing)
check '[[ "$out" == "failed passed exit status 127"* ]]' "a check whose program is missing: $out"

# credit per group of cases: a check whose test prints "case NAME: passed|failed" lines (test_ops
# NAME does) earns the points of each group whose cases all pass, says which, and full marks still
# need the whole test to pass; groups the test never ran earn nothing
python3 - "$tmp/groups.json" <<'PY'
import json, sys
cases = "printf 'case shapes(3, 7): passed\\ncase shapes(1, 1): passed\\ncase edges(): failed\\ncase backward(): passed\\nt: 3 passed, 1 failed\\n'"
ex = dict(id="groups", stage="06", kind="code", file="06_inference/sampler.c", function="candidates", build=[],
          title="groups", stub="    (void)s, (void)mass, (void)by_probability_desc, (void)g_sort_prob;\n    return 0;",
          checks=[{"name": "cases", "points": 10, "command": cases + "; exit 1", "time_limit_s": 30, "needs_gpu": False,
                   "groups": [{"name": "shapes", "cases": ["shapes("], "points": 4},
                              {"name": "edges", "cases": ["edges("], "points": 3},
                              {"name": "backward", "cases": ["backward(", "never_run("], "points": 3}]}])
json.dump({"exercises": [ex]}, open(sys.argv[1], "w"))
PY
python3 -c "
import sys; sys.path.insert(0, 'tools'); import exercise
exercise.start(exercise.load_catalogue(sys.argv[1]), 'groups', 'starter', sys.argv[2], with_build=False)" \
    "$tmp/groups.json" "$base/groups" >/dev/null
python3 tools/exercise.py --catalogue "$tmp/groups.json" grade --dir "$base/groups" --json "$tmp/groups-grade.json" >/dev/null 2>&1
out=$(first_why "$tmp/groups-grade.json")
check '[[ "$out" == "partial 4 case groups passed: shapes; failed: edges, backward"* ]]' \
    "a test with the cases of one group of three passing (another's cases never run): $out"

# the speed exercises: the starters (right but slow) fail on speed, not on their answers; a fast
# answer that is wrong (the bias dropped from the workbook's own kernel) scores 0
for id in decode-matvec-speed gelu-speed; do
    out=$(first_why "$tmp/starter-$id.json")
    check '[[ "$out" == "failed 0 exit status 1"*"too slow"* ]]' "$id's starter: $out"
done
python3 -c "
import sys; sys.path.insert(0, 'tools'); import exercise
cat = exercise.load_catalogue()
ex = cat['decode-matvec-speed']
exercise.start(cat, ex['id'], 'starter', sys.argv[1], with_build=False)
fast = exercise.learner_part('.', ex)
exercise.put_part(sys.argv[1], ex, fast.replace('bias ? bias[o] : 0.0f', '0.0f'))" "$base/fast-wrong" >/dev/null
python3 tools/exercise.py grade --dir "$base/fast-wrong" --json "$tmp/fast-wrong.json" >/dev/null 2>&1
out=$(first_why "$tmp/fast-wrong.json")
check '[[ "$out" == "failed 0 exit status 1"*"outputs wrong"* ]]' "a fast decode matvec that drops the bias: $out"

# a copy relabelled as another exercise (its mark is the learner's to edit) is refused in a class's
# grading, with the exercise its contents say it was made for: a code copy (its own part is not the
# workbook's), a fixed bug hunt's copy (no part differs at all) as a code exercise, a calculation's
# answers.json as another calculation's
relabel() { # relabel <learner> <exercise> <state> <as exercise>
    start_without_build "$2" "$3" "$base/relabel/$1/$2"
    python3 -c "
import json, os, sys; sys.path.insert(0, 'tools'); import exercise
json.dump(dict(json.load(open(os.path.join(sys.argv[1], exercise.MARK))), exercise=sys.argv[2]),
          open(os.path.join(sys.argv[1], exercise.MARK), 'w'))" "$base/relabel/$1/$2" "$4"
}
relabel dan gelu-backward starter grad-clip
relabel eve bug-causal-mask solution top-p
relabel fay calc-ddp-comm starter calc-bubble
python3 tools/exercise.py class "$base/relabel" --csv "$tmp/relabel.csv" --json "$tmp/relabel.json" >/dev/null 2>&1
refused() { python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))[sys.argv[2]]
c = r['checks'][0]
print(c['result'], r['earned'], r['earnable'], ' '.join(c['why']))" "$tmp/relabel.json" "$1"; }
out=$(refused dan)
check '[[ "$out" == "refused 0 10 made for gelu-backward, not grad-clip"* ]]' "a gelu-backward copy marked grad-clip: $out"
out=$(refused eve)
check '[[ "$out" == "refused 0 10 no part of this copy differs"* ]]' "a fixed bug hunt's copy marked top-p: $out"
out=$(refused fay)
check '[[ "$out" == "refused 0 10 answers.json holds the keys allreduce_bytes_per_step"* ]]' "a calc-ddp-comm copy marked calc-bubble: $out"
# ... and no exercise's stub or bug changes another exercise's part: a copy is never refused as its own
cat >"$tmp/own.py" <<'PY'
import sys; sys.path.insert(0, "tools"); import exercise as e
cat = e.load_catalogue()
for ex in (x for x in cat.values() if x["kind"] != "calculation"):
    text = open(ex["file"]).read()
    if ex["kind"] == "bug-hunt":
        made = text.replace(ex["bug"]["find"], ex["bug"]["replace"])
    else:
        start, end = e.locate(text, ex)
        made = text[:start] + e.stub_text(ex) + text[end:]
    for other in cat.values():
        if other is not ex and other["kind"] != "calculation" and other["file"] == ex["file"] \
                and e.part_of_text(made, other) != e.part_of_text(text, other):
            sys.exit(f"{ex['id']}: its starter changes the part of {other['id']}")
PY
out=$(python3 "$tmp/own.py" 2>&1)
check '[ -z "$out" ]' "an exercise's copy would be refused as its own: $out"

finish test_exercises
