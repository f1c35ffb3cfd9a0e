#!/usr/bin/env bash
# The preflight (tools/preflight.py, `make preflight`): on this machine every check passes; then
# each condition it checks is broken on purpose, and the check that covers it must fail, by name,
# with what it measured and what to do next, while the checks beside it still pass:
#   - a library shadowed by an empty stub (LIBRARY_PATH, LD_LIBRARY_PATH) and a compiler setting
#     (MPICC) pointing at nothing;
#   - a model file with one byte flipped, and one cut short (a copy of a fixture in $tmp);
#   - an output directory on a 16 MiB tmpfs;
#   - an MPI rank that cannot start (a launcher wrapper that fails rank 3);
#   - an expected bus bandwidth far above what the ranks reach (the slowest pair is named);
#   - GPUs: a stand-in nvidia-smi that fails, one that lists too few GPUs, and GPUs too small for
#     the planner's need;
#   - a stage-10 mesh that does not divide the ranks, and one whose tp spans nodes.
# The bandwidths in comm.json are nccl-tests' algbw and busbw for the rank count. Every figure is
# read from the run's preflight.json (and comm.json), never from its table.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
FIX=${FIXTURES:-../shared/fixtures}
[ -x build/preflight_comm ] || make --no-print-directory -j2 BACKEND=cpu build/preflight_comm >"$tmp/make.log" 2>&1

# status <report dir> <check>: pass, fail, skipped, or "absent"
status() {
    python3 -c 'import json, sys
rows = [r for r in json.load(open(sys.argv[1] + "/preflight.json"))["checks"] if r["check"] == sys.argv[2]]
print(rows[0]["status"] if rows else "absent")' "$1" "$2" 2>/dev/null || echo "no preflight.json"
}
# field <report dir> <check> <key>: that check's measured / expected / next
field() {
    python3 -c 'import json, sys
rows = [r for r in json.load(open(sys.argv[1] + "/preflight.json"))["checks"] if r["check"] == sys.argv[2]]
print(rows[0].get(sys.argv[3], "") if rows else "")' "$1" "$2" "$3" 2>/dev/null
}
# expect <report dir> <status> <check> [text the measured value must hold]
expect() {
    local dir=$1 want=$2 name=$3 text=${4:-} got measured
    got=$(status "$dir" "$name") measured=$(field "$dir" "$name" measured)
    check '[ "$got" = "$want" ]' "'$name' is $got, expected $want (measured: $measured)"
    if [ "$want" = fail ]; then
        check '[ -n "$(field "$dir" "$name" next)" ]' "'$name' failed without saying what to do next"
    fi
    if [ -n "$text" ]; then
        check 'grep -qF -- "$text" <<<"$measured"' "'$name' measured '$measured', expected it to say '$text'"
    fi
}
preflight() { python3 tools/preflight.py --backend=cpu "$@" >"$tmp/last.log" 2>&1; }

# a session config naming a real checkpoint and tokenizer: a copy of a fixture, with its manifest
model=$tmp/model
mkdir -p "$model"
cp "$FIX"/lm-buddy-tiny_gpt2/{config.json,model.safetensors,vocab.json,merges.txt} "$model/"
(cd "$model" && sha256sum config.json model.safetensors vocab.json merges.txt >SHA256SUMS)
printf '{"model_id": "custom", "init_from": "%s", "tokenizer_path": "%s"}\n' "$model" "$model" >"$tmp/session.json"

# ---- 1. this machine is ready: make preflight passes ------------------------------------------------
ok=$tmp/ok
make --no-print-directory preflight BACKEND=cpu \
    PREFLIGHT_ARGS="--report=$ok --out_dir=$tmp/out --disk_write_mib=32 --configs=configs/tiny.json,$tmp/session.json --expect_busbw=0.01" \
    >"$tmp/make-preflight.log" 2>&1
rc=$?
check '[ $rc -eq 0 ]' "make preflight failed (exit $rc): $(tail -n 5 "$tmp/make-preflight.log")"
check '[ "$(python3 -c "import json; print(json.load(open(\"$ok/preflight.json\"))[\"fail\"])")" = 0 ]' \
    "make preflight reported failures: $(grep -E '^[^ ].* fail ' "$tmp/make-preflight.log")"
for c in "library: cJSON" "library: oneDNN" "library: MPI" "mpi: init" \
         "bandwidth: all-reduce" "bandwidth: all-gather" "disk: free space" "disk: write speed" \
         "model files: $tmp/session.json"; do
    expect "$ok" pass "$c"
done
for n in 1 2 3 4 5 6 7 8 10; do expect "$ok" pass "stage $n: one step"; done
# the bandwidths as nccl-tests defines them (its PERFORMANCE.md): algbw = size / time, busbw = algbw x
# 2(n-1)/n for all-reduce (a reduce-scatter and an all-gather) and x (n-1)/n for all-gather
check 'python3 - "$ok/comm.json" <<'"'PY'"'
import json, sys
d = json.load(open(sys.argv[1]))
n, wrong = d["ranks"], []
for kind, factor in (("all_reduce", 2 * (d["ranks"] - 1) / d["ranks"]), ("all_gather", (d["ranks"] - 1) / d["ranks"])):
    for row in d[kind]:
        alg = row["bytes"] / row["seconds"] / 1e9
        if abs(row["algbw_GBps"] - alg) > 1e-9 * alg or abs(row["busbw_GBps"] - alg * factor) > 1e-9 * alg:
            wrong.append((kind, row))
sys.exit(1 if wrong or not d["all_reduce"] or not d["all_gather"] else 0)
PY' "comm.json's algbw or busbw is not nccl-tests' (size / time; x 2(n-1)/n all-reduce, x (n-1)/n all-gather): $(head -c 400 "$ok/comm.json")"
expect "$ok" skipped "gpus: count" "CPU backend"
secs=$(python3 -c "import json; print(json.load(open('$ok/preflight.json'))['seconds'])")
check 'awk -v s="$secs" "BEGIN { exit !(s < 300) }"' "make preflight took $secs s, over 5 minutes"
echo "make preflight: $secs s"

# ---- 2. a missing library, a compiler that is not there ---------------------------------------------
mkdir -p "$tmp/stub"
gcc -shared -o "$tmp/stub/libcjson.so" -x c /dev/null && ln -sf libcjson.so "$tmp/stub/libcjson.so.1"
r=$tmp/lib
LIBRARY_PATH=$tmp/stub LD_LIBRARY_PATH=$tmp/stub MPICC=/nonexistent/mpicc preflight --only=toolchain --report="$r"
rc=$?
check '[ $rc -eq 1 ]' "the preflight with a broken library exited $rc, expected 1"
expect "$r" fail "library: cJSON" "cJSON_Version"
expect "$r" fail "toolchain: MPI compiler" "/nonexistent/mpicc"
expect "$r" fail "library: MPI"
expect "$r" pass "library: oneDNN"
expect "$r" pass "toolchain: C compiler"

# ---- 3. a model file corrupted, then cut short -----------------------------------------------------
r=$tmp/model-flip
python3 -c 'import sys; f = open(sys.argv[1], "r+b"); f.seek(5000); b = f.read(1); f.seek(5000); f.write(bytes([b[0] ^ 1]))' \
    "$model/model.safetensors"
preflight --only=models --configs="$tmp/session.json" --report="$r"
expect "$r" fail "model files: $tmp/session.json" "model.safetensors: sha256 differs"
r=$tmp/model-short
head -c 9000 "$FIX/lm-buddy-tiny_gpt2/model.safetensors" >"$model/model.safetensors"
preflight --only=models --configs="$tmp/session.json" --report="$r"
expect "$r" fail "model files: $tmp/session.json" "incomplete"
rm "$model/SHA256SUMS"
cp "$FIX/lm-buddy-tiny_gpt2/model.safetensors" "$model/"
r=$tmp/model-nosums
preflight --only=models --configs="$tmp/session.json" --report="$r"
expect "$r" fail "model files: $tmp/session.json" "no checksum manifest"

# ---- 4. a disk too small for the session ---------------------------------------------------------------
small=$tmp/small
mkdir -p "$small"
trap 'end_test_processes; umount "$small" 2>/dev/null; rm -rf "$tmp"' EXIT   # (lib.sh's trap, with the tmpfs let go first)
if mount -t tmpfs -o size=16m tmpfs "$small" 2>"$tmp/mount.err"; then
    r=$tmp/disk
    preflight --only=disk --out_dir="$small" --disk_need_gib=1 --report="$r"
    expect "$r" fail "disk: free space" "GiB free in $small"
    umount "$small"
else
    check false "cannot mount a tmpfs for the small-disk case (needs root): $(cat "$tmp/mount.err")"
fi

# ---- 5. a rank that cannot start ------------------------------------------------------------------------
cat >"$tmp/fail-rank3.sh" <<'EOF'
#!/bin/sh
# a launcher wrapper: rank 3's host is broken
[ "$OMPI_COMM_WORLD_RANK" = 3 ] && { echo "rank 3: cannot start" >&2; exit 1; }
exec "$@"
EOF
chmod +x "$tmp/fail-rank3.sh"
r=$tmp/rank
preflight --only=comm --comm_timeout=10 --launcher="mpirun --bind-to none -np {ranks} $tmp/fail-rank3.sh" --report="$r"
expect "$r" fail "mpi: init" "did not all start"
expect "$r" skipped "bandwidth: all-reduce"

# ---- 6. an expected bandwidth far above what the ranks reach ---------------------------------------------
r=$tmp/bw
preflight --only=comm --expect_busbw=1000 --report="$r"
expect "$r" pass "mpi: init"
expect "$r" fail "bandwidth: all-reduce" "slowest pair $(hostname):rank"
expect "$r" fail "bandwidth: all-gather" "slowest pair"

# ---- 7. GPUs: none that work, too few, too small ----------------------------------------------------------
mkdir -p "$tmp/bin"
fake_gpus() { # fake_gpus <count> <MiB>, or "broken": a stand-in nvidia-smi
    if [ "$1" = broken ]; then printf '#!/bin/sh\necho "NVIDIA-SMI has failed" >&2; exit 9\n'
    else printf '#!/bin/sh\nfor i in $(seq %s); do echo "Test GPU, %s"; done\n' "$1" "$2"; fi >"$tmp/bin/nvidia-smi"
    chmod +x "$tmp/bin/nvidia-smi"
}
gpus() { PATH=$tmp/bin:$PATH preflight --backend=cuda --only=gpus --ranks=4 --configs=configs/tiny.json \
             --cluster=configs/clusters/h100-sxm.json --report="$1"; }
fake_gpus broken; gpus "$tmp/gpu-broken"
expect "$tmp/gpu-broken" fail "gpus: count" "nvidia-smi does not run"
fake_gpus 2 81559; gpus "$tmp/gpu-few"
expect "$tmp/gpu-few" fail "gpus: count" "2 (Test GPU)"
fake_gpus 4 20; gpus "$tmp/gpu-small"
expect "$tmp/gpu-small" pass "gpus: count"
expect "$tmp/gpu-small" fail "gpus: memory for configs/tiny.json" "MiB a rank"
fake_gpus 4 81559; gpus "$tmp/gpu-ok"
expect "$tmp/gpu-ok" pass "gpus: memory for configs/tiny.json"

# ---- 8. stage 10's mesh: one that does not divide the ranks, a tp wider than a node ----------------
# (and the planner's memory for it: the stage-10 mesh the config names)
printf '{"strategy": "composed", "tp_dimensions": [2, 1, 1], "pp_size": 2, "num_microbatches": 2}\n' >"$tmp/mesh.json"
fake_gpus 8 81559
mesh() { PATH=$tmp/bin:$PATH preflight --backend=cuda --only=gpus --configs="$tmp/mesh.json" \
             --cluster=configs/clusters/h100-sxm.json "$@"; }
mesh --ranks=6 --report="$tmp/mesh-6"
expect "$tmp/mesh-6" fail "mesh: $tmp/mesh.json" "tp 2 x pp 2 x cp 1 = 4 does not divide 6 ranks"
mesh --ranks=4 --ranks_per_node=1 --report="$tmp/mesh-node"
expect "$tmp/mesh-node" fail "mesh: $tmp/mesh.json" "tp 2 spans nodes of 1 ranks"
mesh --ranks=8 --report="$tmp/mesh-ok"
expect "$tmp/mesh-ok" pass "mesh: $tmp/mesh.json" "dp 2 = 8 ranks"
expect "$tmp/mesh-ok" pass "gpus: memory for $tmp/mesh.json" "tp2-pp2 x 2"

finish test_preflight
