# tests/plan_lib.sh: the planner's prediction against a run of the layout, sourced by the
# planner's tests (test_plan.sh, test_plan_composed.sh) after tests/lib.sh and tests/mpi_env.sh.

# same <name> <ranks> <plan --layout> [stage args...]: plans the one layout (build/plan on
# $cluster with the config ${args[@]}; --microbatches=M is the planner's alone), runs it for $steps
# steps as the plan names it (its binary and keys: what --measure runs), and compares: rank 0's
# memory report row for row, every step's comm_bytes, and stats.json's bytes per group and
# collective over the steps, exactly (stage 08's routed all-to-alls aside)
same() {
    local name=$1 np=$2 layout=$3 stage
    shift 3
    local plan_args=() run_args=()
    for a in "$@"; do case $a in --microbatches=*) plan_args+=("$a") ;; *) plan_args+=("$a"); run_args+=("$a") ;; esac; done
    build/plan --cluster=$cluster --ranks="$np" --layout="$layout" --json="$tmp/$name.plan.json" "${args[@]}" \
        "${plan_args[@]}" >"$tmp/$name.plan.log" 2>&1
    local rc=$?
    check '[ $rc -eq 0 ]' "plan $name ($layout on $np ranks) failed: $(tail -3 "$tmp/$name.plan.log")"
    # the run: the binary and the layout's keys as the plan names them (what --measure runs)
    stage=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['layouts'][0]['stage'])" "$tmp/$name.plan.json")
    mapfile -t layout_args < <(python3 -c \
        "import json,sys; [print(a) for a in json.load(open(sys.argv[1]))['layouts'][0]['args']]" "$tmp/$name.plan.json")
    run_ranks "$stage" "$name" "$np" --stop_iteration=$steps "${run_args[@]}" "${layout_args[@]}"
    python3 - "$tmp/$name.plan.json" "$tmp/$name" $steps >"$tmp/$name.cmp" 2>&1 <<'PY'
import json, sys
plan_path, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
plan = json.load(open(plan_path))["layouts"]
assert len(plan) == 1, f"the plan holds {len(plan)} layouts, want 1"
plan = plan[0]
stats = json.load(open(out + "/stats.json"))
lines = [json.loads(l) for l in open(out + "/metrics.jsonl")]
bad = []
if plan["memory"] != stats["memory"]:
    bad.append(f"memory: planned {plan['memory']}, stats.json {stats['memory']}")
if sum(plan["memory_by_category"].values()) != sum(stats["memory"].values()):
    bad.append("the categories do not add up to the report")
per_step = {l["comm_bytes"] for l in lines}
routed_bytes = [c for c in plan["communication"] if (c["group"], c["kind"]) == ("experts", "all-to-all")]
if len(lines) != steps or (per_step != {plan["comm_bytes"]} and not routed_bytes):
    bad.append(f"comm_bytes per step: planned {plan['comm_bytes']:.0f}, metrics.jsonl {sorted(per_step)}")
planned = {(c["group"], c["kind"]): c["bytes"] for c in plan["communication"]}
# after the steps: the final save (FSDP's "ckpt", stage 05's and 10's "checkpoint" group, stage 10's
# ZeRO-1 moments over "zero-ckpt"; stages
# 07 and 10 assemble the model over "pipeline", stage 08 over "experts") and the pipelines' schedule
# printout (an all-gather over "world", stage 10's over "slice")
after = {7: {("pipeline", "all-reduce"), ("world", "all-gather")}, 8: {("experts", "all-reduce")},
         10: {("pipeline", "all-reduce"), ("slice", "all-gather")}}.get(stats["stage"], set())
measured = {(e["group"], e["kind"]): e["bytes"] / steps for e in stats["communication"]
            if e["group"] not in ("ckpt", "checkpoint", "zero-ckpt") and (e["group"], e["kind"]) not in after}
# stage 08's all-to-alls carry the rows the router sent: planned for balanced routing, not exact
routed = ("experts", "all-to-all")
if routed in planned and routed in measured:
    del planned[routed], measured[routed]
    print(f"{plan['name']}: all-to-all not compared (routing); ", end="")
if planned != measured:
    bad.append(f"per group and collective: planned {planned}, stats.json / steps {measured}")
print("\n".join(bad) if bad else f"{plan['name']}: memory {sum(plan['memory'].values())} B and "
      f"{plan['comm_bytes']:.0f} B per step, as planned")
sys.exit(1 if bad else 0)
PY
    rc=$?
    check '[ $rc -eq 0 ]' "$name: the plan differs from the run: $(cat "$tmp/$name.cmp")"
}
