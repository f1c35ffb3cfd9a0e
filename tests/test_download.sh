#!/usr/bin/env bash
# scripts/download.sh on local files (the hub cannot be reached from here): a fake hub served as
# file:// (HF_ENDPOINT) holding a tiny phi checkpoint in two shards with an index, GPT-2's
# tokenizer files and phi's added tokens.
#  - every file arrives whole; a shard left half-downloaded (.part) is resumed, not restarted;
#    files the repository lacks (tokenizer.json, ...) are skipped; a second run fetches nothing;
#  - SHA256SUMS (the preflight's manifest) lists each file that arrived with its sha256, once;
#  - what arrived is usable: stage 01 starts from it, the tokenizer matches added tokens;
#  - an unreachable hub and an unknown model are each one clear error, exit 1.
source "$(dirname "$0")/lib.sh"
FIX=${FIXTURES:-../shared/fixtures}

build/stage-1 --config configs/tiny_phi.json --n_embd=64 --stop_iteration=1 --eval_batches=1 \
    --out_dir="$tmp/ckpt" >"$tmp/train.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 (the checkpoint to serve) failed: $(tail -3 "$tmp/train.log")"

repo=$tmp/hub/org/tiny-phi/resolve/main
mkdir -p "$repo"
cp "$tmp/ckpt/config.json" "$repo/"
cp "$FIX/gpt2-tokenizer/encoder.json" "$repo/vocab.json"
cp "$FIX/gpt2-tokenizer/vocab.bpe" "$repo/merges.txt"
printf '{"  ": 50257}' >"$repo/added_tokens.json"
# two shards: the first half of the tensors, the rest; and the index naming them
python3 - "$tmp/ckpt/model.safetensors" "$repo" <<'PY'
import json, struct, sys
blob = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", blob[:8])
header = json.loads(blob[8:8 + n])
header.pop("__metadata__", None)
names = sorted(header, key=lambda k: header[k]["data_offsets"][0])
shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
          "model-00002-of-00002.safetensors": names[len(names) // 2:]}
weight_map = {}
for shard, keys in shards.items():
    h, data, off = {"__metadata__": {"format": "pt"}}, b"", 0
    for k in keys:
        b, e = header[k]["data_offsets"]
        h[k] = {"dtype": header[k]["dtype"], "shape": header[k]["shape"], "data_offsets": [off, off + e - b]}
        data += blob[8 + n + b:8 + n + e]
        off += e - b
        weight_map[k] = shard
    j = json.dumps(h).encode()
    j += b" " * (-len(j) % 8)
    open(f"{sys.argv[2]}/{shard}", "wb").write(struct.pack("<Q", len(j)) + j + data)
json.dump({"metadata": {}, "weight_map": weight_map}, open(f"{sys.argv[2]}/model.safetensors.index.json", "w"))
PY

dest=$tmp/models/org/tiny-phi
mkdir -p "$dest"
head -c 1000 "$repo/model-00001-of-00002.safetensors" >"$dest/model-00001-of-00002.safetensors.part"
HF_ENDPOINT="file://$tmp/hub" scripts/download.sh org/tiny-phi "$dest" >"$tmp/dl.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "download failed (exit $rc): $(tail -3 "$tmp/dl.log")"
for f in config.json model.safetensors.index.json model-00001-of-00002.safetensors model-00002-of-00002.safetensors \
         vocab.json merges.txt added_tokens.json; do
    check 'cmp -s "$repo/$f" "$dest/$f"' "$f did not arrive whole"
done
check '[ -z "$(ls "$dest" | grep "\.part$")" ] && [ ! -e "$dest/tokenizer.json" ]' "leftover .part files, or a file the hub lacks: $(ls "$dest")"
check 'grep -q "^resume model-00001-of-00002.safetensors from byte 1000" "$tmp/dl.log"' "the half-downloaded shard was not resumed"
check 'grep -q "skip  tokenizer.json" "$tmp/dl.log"' "a tokenizer file the repository lacks is not reported as skipped"
# the manifest the preflight checks: every file that arrived, listed once, with the hub's bytes' sha256
(cd "$repo" && sha256sum config.json model.safetensors.index.json model-0000[12]-of-00002.safetensors vocab.json \
    merges.txt added_tokens.json | sort -k2) >"$tmp/want.sums"
check 'sort -k2 "$dest/SHA256SUMS" | cmp -s - "$tmp/want.sums"' "SHA256SUMS does not list the 7 files with the hub's checksums: $(cat "$dest/SHA256SUMS" 2>&1)"
HF_ENDPOINT="file://$tmp/hub" scripts/download.sh org/tiny-phi "$dest" >"$tmp/dl2.log" 2>&1
rc=$?
check '[ $rc -eq 0 ] && [ "$(grep -c "^have" "$tmp/dl2.log")" -eq 7 ] && ! grep -q "^fetch.*safetensors" "$tmp/dl2.log"' \
    "a second run fetched again: $(grep '^fetch' "$tmp/dl2.log" | head -2)"
check 'sort -k2 "$dest/SHA256SUMS" | cmp -s - "$tmp/want.sums"' "a second run changed SHA256SUMS: $(cat "$dest/SHA256SUMS")"

build/stage-1 --config configs/tiny_phi.json --n_embd=64 --stop_iteration=1 --eval_batches=1 \
    --init_from="$dest" --out_dir="$tmp/from_download" >"$tmp/from.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 01 cannot start from the downloaded shards: $(tail -3 "$tmp/from.log")"
printf 'a  b' >"$tmp/text.txt"
check '[ "$(build/tests/test_phi --encode "$dest" "$tmp/text.txt")" = "[64, 50257, 65]" ]' \
    "the downloaded tokenizer does not match its added token first"

HF_ENDPOINT=http://127.0.0.1:9 scripts/download.sh org/tiny-phi "$tmp/unreachable" >/dev/null 2>"$tmp/unreach.err"
rc=$?
check '[ $rc -eq 1 ] && [ "$(grep -c "^error: cannot reach http://127.0.0.1:9" "$tmp/unreach.err")" -eq 1 ]' \
    "an unreachable hub: exit $rc, $(grep error "$tmp/unreach.err")"
HF_ENDPOINT="file://$tmp/hub" scripts/download.sh org/nope "$tmp/nope" >/dev/null 2>"$tmp/nope.err"
rc=$?
check '[ $rc -eq 1 ] && grep -q "^error: .*org/nope/resolve/main/config.json: not found" "$tmp/nope.err"' \
    "an unknown model: exit $rc, $(grep error "$tmp/nope.err")"

finish test_download
