#!/usr/bin/env bash
# The exercises (exercises/catalogue.json, graded by tools/exercise.py):
#  - the workbook's own code (one unchanged copy, shared by every exercise) scores full points on
#    every exercise, and every exercise's starter (its stub, or its planted bug) scores 0: an
#    exercise whose checks cannot tell the two apart fails here;
#  - at least 20 exercises, two or more for each of stages 01-09 and common/, and 80% of all
#    points need no GPU;
#  - the grader's robustness: a copy that does not compile, one that hangs (its processes ended at
#    the time limit), one that crashes printing bytes that are not text, and one that writes outside
#    its copy are each graded failed with that reason, and the grader goes on to the next check.
# Copies go to work/.test-exercises/ (removed at the end); grades are read from grade.json.
source "$(dirname "$0")/lib.sh"
base=work/.test-exercises
rm -rf "$base"
trap 'end_test_processes; rm -rf "$tmp" "$base"' EXIT
ids=$(python3 -c "import json; print(' '.join(e['id'] for e in json.load(open('exercises/catalogue.json'))['exercises']))")

kind() { python3 -c "import json, sys; print(next(e['kind'] for e in json.load(open('exercises/catalogue.json'))['exercises'] if e['id'] == sys.argv[1]))" "$1"; }
# grade_sum <copy> <field>: earned, points or blocked of the copy's grade.json
grade_sum() { python3 -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1/grade.json" "$2"; }
failures() { python3 -c "
import json, sys
for c in json.load(open(sys.argv[1]))['checks']:
    if c['result'] != 'passed': print('   ', c['check'], '->', c['result'], '|', ' / '.join(c['why'][:3]))
" "$1/grade.json"; }

# the catalogue's shape: counts per stage, and the points a CPU can earn
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

# the workbook's own code: one copy, every exercise's checks on it; a calculation's copy of its
# own, whose answers.json the tool fills with the planner's numbers
start=$SECONDS
python3 tools/exercise.py start adamw-update --state solution --dir "$base/solution" >/dev/null
for id in $ids; do
    copy=$base/solution
    if [ "$(kind "$id")" = calculation ]; then
        copy=$base/solution-$id
        python3 tools/exercise.py start "$id" --state solution --dir "$copy" >/dev/null
    fi
    python3 tools/exercise.py grade --dir "$copy" --as "$id" >"$tmp/solution-$id.log" 2>&1
    earned=$(grade_sum "$copy" earned) points=$(grade_sum "$copy" points) blocked=$(grade_sum "$copy" blocked)
    check '[ "$earned" -eq $((points - blocked)) ] && [ "$earned" -gt 0 ]' \
        "$id: the workbook's own code scores $earned of $points points ($blocked blocked):
$(failures "$copy")"
done

echo "every exercise's checks on the workbook's own code: $((SECONDS - start)) s"

# every starter scores 0
start=$SECONDS
for id in $ids; do
    python3 tools/exercise.py start "$id" --dir "$base/$id" >/dev/null
    python3 tools/exercise.py grade --dir "$base/$id" >"$tmp/starter-$id.log" 2>&1
    earned=$(grade_sum "$base/$id" earned)
    check '[ "$earned" = 0 ]' "$id: its starter scores $earned points; its checks cannot tell it from the solution"
    rm -rf "${base:?}/$id"
done
echo "every starter graded: $((SECONDS - start)) s"

# robustness: four broken hand-ins, graded with a catalogue made for them
python3 - "$tmp/robust.json" <<'PY'
import json, sys
sampler = dict(stage="06", kind="code", file="06_inference/sampler.c", function="candidates",
               build=["build/tests/test_top_p"], title="robustness")
def exercise(id, stub, limit=60):
    return dict(sampler, id=id, stub=stub, checks=[{"name": "sampler", "points": 1, "command": "build/tests/test_top_p",
                                                    "time_limit_s": limit, "needs_gpu": False},
                                                   {"name": "after", "points": 1, "command": "true",
                                                    "time_limit_s": limit, "needs_gpu": False}])
used = "    (void)s, (void)mass, (void)by_probability_desc, (void)g_sort_prob;\n"
ex = [exercise("no-compile", "    this is not C;"),
      exercise("hangs", used + "    for (;;) {\n    }\n    return 0;", limit=5),
      exercise("garbage", used + '    fwrite("\\xff\\xfe\\x1b[2J\\x07", 1, 6, stdout);\n    fflush(stdout);\n    abort();'),
      exercise("outside", used + '    FILE *f = fopen("../../../exercise-outside-probe", "w");\n    if (f) fclose(f);\n    abort();')]
json.dump({"exercises": ex}, open(sys.argv[1], "w"))
PY
robust() { # robust <id>: starts and grades that broken copy; its grade.json's first check is printed
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
check '[[ "$out" == "failed passed wrote outside its copy: exercise-outside-probe"* ]]' "a copy that writes outside itself: $out"
rm -f exercise-outside-probe
finish test_exercises
