#!/usr/bin/env bash
# download.sh <model-name> [dir]: a Hugging Face model's config, weights and tokenizer, by name,
# as the tutorial's download.py does. Example:
#   scripts/download.sh microsoft/phi-1_5        # -> models/microsoft/phi-1_5/
# then: build/stage-2 --config configs/phi-1_5.json (its init_from and tokenizer_path point there).
#
# Each file goes to <file>.part first and is renamed when whole: a file already there is skipped,
# and an interrupted download resumes where it stopped (curl -C -). Weights are model.safetensors,
# or model.safetensors.index.json and every shard it lists. Tokenizer files the repository does
# not have are skipped; anything else that fails stops the script with the reason.
# Each whole file's sha256 goes into <dir>/SHA256SUMS (sha256sum's format), which the preflight
# (tools/preflight.py) checks before a session: a file damaged or cut short since is caught there.
# HF_ENDPOINT (default https://huggingface.co) names the hub, HF_TOKEN a token for gated models.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 <model-name> [dir]   e.g. $0 microsoft/phi-1_5 (into models/microsoft/phi-1_5)" >&2
    exit 2
fi
name=$1
dir=${2:-models/$name}
hub=${HF_ENDPOINT:-https://huggingface.co}
auth=()
[ -n "${HF_TOKEN:-}" ] && auth=(-H "Authorization: Bearer $HF_TOKEN")
mkdir -p "$dir"

# record_sum <file> [again]: its line in SHA256SUMS; a file already listed keeps its line unless
# it was fetched again
record_sum() {
    [ "${2:-}" = again ] && [ -f "$dir/SHA256SUMS" ] && sed -i "\|  $1\$|d" "$dir/SHA256SUMS"
    grep -q "  $1\$" "$dir/SHA256SUMS" 2>/dev/null || (cd "$dir" && sha256sum "$1") >>"$dir/SHA256SUMS"
}

# fetch <file> <required|optional>: returns 1 for an optional file the repository does not have
fetch() {
    local file=$1 need=$2 url="$hub/$name/resolve/main/$1" rc=0
    [ -f "$dir/$file" ] && { echo "have  $dir/$file"; record_sum "$file"; return 0; }
    echo "fetch $url"
    [ -s "$dir/$file.part" ] && echo "resume $file from byte $(stat -c %s "$dir/$file.part")"
    local quiet=(-#)  # a progress bar; an optional file is small, and its absence no error
    [ "$need" = optional ] && quiet=(-s)
    curl -fL "${quiet[@]}" --retry 3 --connect-timeout 20 -C - "${auth[@]}" -o "$dir/$file.part" "$url" || rc=$?
    if [ "$rc" -eq 0 ]; then
        mv "$dir/$file.part" "$dir/$file"
        record_sum "$file" again
        return 0
    fi
    # 22: the hub answered with an HTTP error (404: no such file); 37: a file:// hub has no such file
    if [ "$rc" -eq 22 ] || [ "$rc" -eq 37 ]; then
        rm -f "$dir/$file.part"
        [ "$need" = optional ] && { echo "skip  $file (not in $name)"; return 1; }
        echo "error: $url: not found (curl exit $rc); is '$name' a model on $hub, and is it public (else set HF_TOKEN)?" >&2
        exit 1
    fi
    echo "error: cannot reach $hub for $url (curl exit $rc); the partial file $dir/$file.part is kept: run again to resume" >&2
    exit 1
}

fetch config.json required
if [ ! -f "$dir/model.safetensors.index.json" ] && fetch model.safetensors optional; then
    :
elif fetch model.safetensors.index.json optional; then
    # the shards the index lists, each once
    for shard in $(python3 -c 'import json, sys; print(" ".join(sorted(set(json.load(open(sys.argv[1]))["weight_map"].values()))))' \
                   "$dir/model.safetensors.index.json"); do
        fetch "$shard" required
    done
else
    echo "error: $name has neither model.safetensors nor model.safetensors.index.json (only safetensors weights are read)" >&2
    exit 1
fi
for file in vocab.json merges.txt added_tokens.json tokenizer.json tokenizer_config.json special_tokens_map.json; do
    fetch "$file" optional || true
done
echo "done: $dir"
