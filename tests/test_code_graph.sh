#!/usr/bin/env bash
# Dependencies point one way (docs/ARCHITECTURE.md): stages -> common, and no stage builds on
# another stage's files except where the design says so. tests/code_graph.py reads the graph
# from the sources' #include "..." lines and from make itself (make -pn: what each program links;
# make -n -B: the -I flags each object is compiled with), and this checks:
#  - common/'s modules (a file stem: gpt.c + gpt.h) include each other round no loop, a folder of
#    common/ includes only the folders common/README.md's table allows it, and common/ includes
#    nothing outside it;
#  - no stage or tool links, includes or puts on its include path another stage's file, except
#    stage 06 -> 05 (tensor-parallel inference), stage 06 -> 08's moe* files (generation from MoE
#    checkpoints), stage 10 -> 05, 07, 08 and 09 (the techniques composed: 05's layers inside 07's
#    stages, 09's ring attention and 08's MoE MLP inside 05's layers)
#    and the planner (tools/plan*: it sizes layouts with the stages' arithmetic);
#  - no stage's modules include each other round a loop (a technique and its glue);
#  - the techniques see a trained set beside a frozen base (common/run/trainable.h), never LoRA: no
#    stage file names it but a main (train.c) and a stage's LoRA glue (a file named *lora*).
source "$(dirname "$0")/lib.sh"
make -pn BACKEND=cpu >"$tmp/db" 2>/dev/null
objects=$(sed -n 's/^build\/cpu\/\(stage-[0-9][0-9]*\|plan\|tokenize\|peak_flops\|ceilings\): //p' "$tmp/db" |
    tr ' ' '\n' | grep -v '^build/cpu/common/' | grep '\.o$' | sort -u)
# shellcheck disable=SC2086 # one word per object
make -n -B BACKEND=cpu $objects >"$tmp/compiles" 2>/dev/null
python3 tests/code_graph.py "$tmp/db" "$tmp/compiles" >"$tmp/graph"
rc=$?
check '[ $rc -eq 0 ]' "tests/code_graph.py failed (exit $rc)"
# the graph was read: the edges the design allows are there
check 'grep -q "^ok	stage-6	links 05_tensor_parallel/tp_linear.o" "$tmp/graph"' "stage 06's link to 05's tp_linear.o was not found: the make database was not read"
check 'grep -q "^ok	stage-10	links 07_pipeline_parallel/pipeline.o" "$tmp/graph"' "stage 10's link to 07's pipeline.o was not found"
check 'grep -q "^ok	plan	links 04_fsdp/fsdp.o" "$tmp/graph"' "the planner's link to 04's fsdp.o was not found: the make database was not read"
check 'grep -q "^ok	plan	tools/plan.c is compiled with -I04_fsdp" "$tmp/graph"' "the planner's -I04_fsdp was not found: the compile commands were not read"
for kind in cycle folder outside links flag includes; do
    found=$(grep "^$kind	" "$tmp/graph" | cut -f2- | tr '\t' ' ')
    check '[ -z "$found" ]' "$kind: $(sed 's/$/;/' <<<"$found" | tr '\n' ' ')"
done
naming=$(find 0[0-9]_* 10_* -name '*.[ch]' -o -name '*.cu' | grep -v '/train\.c$' | grep -vi 'lora[^/]*$' |
         sort | xargs grep -li lora)
check '[ -z "$naming" ]' "technique files name LoRA, which only the mains and the LoRA glue may: $(echo $naming)"
[ "${1:-}" = -v ] && cat "$tmp/graph"
finish test_code_graph
