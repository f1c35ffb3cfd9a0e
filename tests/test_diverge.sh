#!/usr/bin/env bash
# tools/diverge.py, the divergence finder, on runs of the tiny config (6 steps, 12 sequences a
# step): stage 03 on 3 ranks agrees with stage 01 (exit 0), given stage 01's run or making it
# itself from the run's config; a run whose lr differs parts at step 1 by lr alone; a pipeline
# run (stage 07, pp 2 x dp 2) resumed at step 3 from a checkpoint with one tensor scaled by 1.1
# parts at step 4, and that tensor is named, held by the ranks of pipeline stage 1 (1 and 3: rank
# = replica x pp + stage); the tied embedding is held by both ends; on stage 10's mesh (tp 2 x pp 2)
# a stage's tensors by its ranks, ((stage x dp + replica) x cp + c) x tp + t. Checks read the
# finder's --json.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
args=(--config configs/tiny.json --global_batch_size=12 --stop_iteration=6 --checkpoint_interval=0)

# diverge <name> <reference> <run> [flags]: the finder's exit status in $rc, its JSON in $tmp/<name>.json
diverge() {
    local name=$1
    shift
    python3 tools/diverge.py "$@" --json "$tmp/$name.json" >"$tmp/$name.out" 2>&1
    rc=$?
}
# field <name> <python expression over r, the finder's JSON>
field() { python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print($2)" "$tmp/$1.json"; }

run_single 1 ref
run_ranks 3 ddp 3
diverge agree "$tmp/ref" "$tmp/ddp"
check '[ $rc -eq 0 ] && [ "$(field agree "r[\"agree\"], r[\"first_step\"], r[\"checkpoint_step\"], r[\"steps_compared\"]")" = "True None 6 6" ]' \
    "stage 03 on 3 ranks against stage 01: exit $rc, want 0 and agreement at every step and tensor: $(cat "$tmp/agree.out")"
# the same with the run alone: the finder runs stage 01 on the run's config, its layout keys left
# out, and gets the losses of the stage 01 run above to the bit
diverge alone "$tmp/ddp"
losses() { python3 -c 'import json, sys; print([json.loads(l)["loss"] for l in open(sys.argv[1])])' "$1/metrics.jsonl"; }
check '[ $rc -eq 0 ] && [ "$(field alone "r[\"agree\"], r[\"reference\"], r[\"steps_compared\"]")" = "True $tmp/ddp-reference 6" ] &&
       [ "$(losses "$tmp/ddp-reference")" = "$(losses "$tmp/ref")" ]' \
    "stage 03 alone: exit $rc, want 0, stage 01 run into $tmp/ddp-reference with the losses of stage 01's run: $(cat "$tmp/alone.out")"

run_single 1 lr --lr=2.2e-3
diverge lr "$tmp/ref" "$tmp/lr"
check '[ $rc -eq 1 ] && [ "$(field lr "r[\"first_step\"][\"step\"], \" \".join(f[\"name\"] for f in r[\"first_step\"][\"figures\"])")" = "1 lr" ]' \
    "a run with lr 10% larger: exit $rc, want 1 and step 1's lr alone named: $(cat "$tmp/lr.out")"

# the pipeline run: 3 steps, one tensor scaled in its checkpoint, then resumed to 6
pipe=(--strategy=pipeline --pp_size=2 --num_microbatches=2)
run_ranks 7 pipe 4 "${pipe[@]}" --stop_iteration=3
python3 - "$tmp/pipe/model.safetensors" transformer.h.1.mlp.c_fc.weight <<'PY'
import json, struct, sys
from array import array
path, name = sys.argv[1:]
with open(path, "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    begin, end = json.loads(f.read(n))[name]["data_offsets"]
    f.seek(8 + n + begin)
    values = array("f", f.read(end - begin))
    f.seek(8 + n + begin)
    f.write(array("f", (x * 1.1 for x in values)).tobytes())
PY
run_ranks 7 pipe 4 "${pipe[@]}"
diverge pipe "$tmp/ref" "$tmp/pipe"
check '[ $rc -eq 1 ] && [ "$(field pipe "r[\"first_step\"][\"step\"], \"loss\" in [f[\"name\"] for f in r[\"first_step\"][\"figures\"]], r[\"checkpoint_step\"]")" = "4 True 6" ]' \
    "the pipeline run with a tensor scaled after step 3: exit $rc, want 1 and step 4's loss named: $(cat "$tmp/pipe.out")"
check '[ "$(field pipe "r[\"tensors\"][0][\"name\"], r[\"tensors\"][0][\"ranks\"], r[\"tensors\"][0][\"held_by\"]")" = "transformer.h.1.mlp.c_fc.weight [1, 3] pipeline stage 1 of 2" ]' \
    "the pipeline run: want transformer.h.1.mlp.c_fc.weight on ranks 1 and 3 named first: $(cat "$tmp/pipe.out")"
# the root tensors of the same run: the tied wte on both ends, wpe on the first stage, ln_f on the last
holders=$(python3 -c 'import sys; sys.path.insert(0, "tools"); import diverge
print([diverge.holders(sys.argv[1], "transformer." + t)[0] for t in ("wte.weight", "wpe.weight", "ln_f.weight")])' "$tmp/pipe")
check '[ "$holders" = "[[0, 1, 2, 3], [0, 2], [1, 3]]" ]' "the pipeline's wte, wpe and ln_f held by $holders, want [[0, 1, 2, 3], [0, 2], [1, 3]]"
# stage 10's mesh (pipeline outermost, tp 2 innermost): stage 1's block on ranks 2 and 3, not 07's 1 and 3
run_ranks 10 mesh 4 --tp_dimensions=2,1,1 --pp_size=2 --num_microbatches=2 --stop_iteration=1 --n_layer=2
holders=$(python3 -c 'import sys; sys.path.insert(0, "tools"); import diverge
print([diverge.holders(sys.argv[1], "transformer." + t)[0] for t in ("h.1.mlp.c_fc.weight", "wpe.weight", "wte.weight")])' "$tmp/mesh")
check '[ "$holders" = "[[2, 3], [0, 1], [0, 1, 2, 3]]" ]' "stage 10's h.1, wpe and wte held by $holders, want [[2, 3], [0, 1], [0, 1, 2, 3]]"

# a run directory without metrics: one error, exit 2
diverge missing "$tmp/ref" "$tmp/nothing"
check '[ $rc -eq 2 ] && [ "$(grep -c "^error" "$tmp/missing.out")" -eq 1 ] && grep -q "^error: $tmp/nothing/metrics.jsonl: No such file or directory" "$tmp/missing.out"' \
    "a run without metrics.jsonl: exit $rc, want 2 and one error naming the file: $(cat "$tmp/missing.out")"
finish test_diverge
