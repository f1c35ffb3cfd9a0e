#!/usr/bin/env bash
# Llama in stage 06 (a tiny one: 2 layers, 4 query heads and 2 key/value heads of 16, random
# weights), whose KV cache holds the key/value heads only:
#  - the cache's size: at the same kv_cache_bytes the pool has twice the blocks of the same model
#    with 4 key/value heads (/metrics' workbook_kv_cache_blocks, against the figure by hand);
#  - greedy and seeded sampling with the cache give exactly the tokens of the loop without it
#    (prompts of different lengths, batches of 3); so do tensor-parallel grids [2,1,1] and [2,2,1]
#    (each x rank caches its one key/value head); x = 4 does not divide 2 key/value heads: refused;
#  - the server (paged cache in a small pool with preemptions, prefix caching, chunked prefill, on
#    one rank and on [2,1,1]): its greedy answers are the loop's without a cache, and every answer
#    (sampled too) is the plain server's.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
source tests/server_lib.sh
export OMP_NUM_THREADS=1

# Random weights: a trained tiny model this small answers greedily with one token over and over,
# where a random one walks through varied bytes, so that a wrong key or value shows in the greedy
# tokens (a sampled token changes only where the logits differ by about a millionth)
llama=(--random_init=true --seed=3 --model_id=custom --arch=llama --n_layer=2 --n_head=4 --n_kv_head=2 --n_embd=64
       --intermediate_size=172)

# 1. the cache's size: 2 layers x keys and values x 16 positions x 32 columns (2 heads of 16) x
# 4 bytes = 8192 bytes a block, 60 in 491520 bytes; with 4 key/value heads 16384 bytes, 30
blocks() { # blocks <name> <args...>: the pool's blocks of a server started with <args>
    local name=$1; shift
    start_server "$name" 1 --config configs/inference.json "${llama[@]}" --max_seq_len=256 --kv_block_size=16 \
        --kv_cache_bytes=491520 "$@"
    curl -s -m 10 "$url/metrics" | sed -n 's/^workbook_kv_cache_blocks //p'
    stop_server
}
gqa=$(blocks gqa)
mha=$(blocks mha --n_kv_head=4)
check '[ "$gqa" = 60 ] && [ "$mha" = 30 ]' \
    "kv_cache_bytes 491520: want 60 blocks with 2 key/value heads, 30 with 4; found '$gqa' and '$mha'"

# 2. the prompts mode: cache and no cache, one rank and grids
printf 'Sort the digits.\nHow do I bake a cake?\n\nFind the largest digit.\nCount the letters in this rather long sentence, please.\n' >"$tmp/prompts.txt"
args=(--config configs/inference.json "${llama[@]}" --prompts_path="$tmp/prompts.txt"
      --tokens_to_generate=16 --show_token_ids=true --max_batch_size=3)
sample=(--temperature=1 --seed=7)
run6() { # run6 <name> <ranks> <args...>
    local name=$1 np=$2; shift 2
    if [ "$np" -eq 1 ]; then bounded 120 $STAGE_BIN/stage-6 "$@" >"$tmp/$name.log" 2>&1
    else bounded 120 mpirun -np "$np" --bind-to none $STAGE_BIN/stage-6 "$@" >"$tmp/$name.log" 2>&1; fi
}
run6 cache 1 "${args[@]}"
run6 nocache 1 "${args[@]}" --kv_cache=false
check '[ "$(answer_ids cache | wc -l)" -eq 4 ] && [ "$(answer_ids cache)" = "$(answer_ids nocache)" ]' \
    "greedy: KV cache and no cache differ: $(diff <(answer_ids cache) <(answer_ids nocache) | head -4; tail -2 "$tmp/cache.log")"
run6 s 1 "${args[@]}" "${sample[@]}"
run6 snocache 1 "${args[@]}" "${sample[@]}" --kv_cache=false
check '[ "$(answer_ids s | sort -u | wc -l)" -eq 4 ] && [ "$(answer_ids s)" = "$(answer_ids snocache)" ]' \
    "sampled: KV cache and no cache differ: $(diff <(answer_ids s) <(answer_ids snocache) | head -4)"
for grid in 2,1,1:2 2,2,1:4; do
    dims=${grid%:*} np=${grid#*:}
    run6 "tp$dims" "$np" "${args[@]}" --tp_dimensions="$dims"
    run6 "tps$dims" "$np" "${args[@]}" "${sample[@]}" --tp_dimensions="$dims"
    check '[ "$(answer_ids "tp$dims")" = "$(answer_ids cache)" ] && [ "$(answer_ids "tps$dims")" = "$(answer_ids s)" ]' \
        "[$dims] differs from one rank: $(diff <(answer_ids s) <(answer_ids "tps$dims") | head -4; tail -2 "$tmp/tps$dims.log")"
done
expect_one_error "[4,1,1] with 2 key/value heads" 'n_kv_head.*x' \
    bounded 60 mpirun -np 4 --bind-to none $STAGE_BIN/stage-6 "${args[@]}" --tp_dimensions=4,1,1

# 3. the server: 16 chat requests sharing prefixes (a task, and digits), half greedy
python3 - "$tmp" <<'PY'
import json, random, sys
tasks = ["Sort the digits.", "Reverse the digits.", "Count the digits.", "Add the digits."]
rng = random.Random(5)
digits = lambda n: "".join(rng.choice("0123456789") for _ in range(n))
prompts = [(tasks[i % 4], digits(8) if i < 8 else digits(2 + i % 5)) for i in range(16)]
open(f"{sys.argv[1]}/requests.txt", "w").write("".join(f"{a}\t{b}\n" for a, b in prompts))
reqs = []
for i, (instruction, text) in enumerate(prompts):
    r = {"model": "random", "messages": [{"role": "system", "content": text}, {"role": "user", "content": instruction}]}
    r.update({"temperature": 0} if i % 2 == 0 else {"temperature": 1, "seed": 200 + i, "max_tokens": 5 + i % 9})
    reqs.append(r)
json.dump(reqs, open(f"{sys.argv[1]}/requests.json", "w"))
PY
model=(--config configs/inference.json "${llama[@]}" --tokens_to_generate=16)
bounded 120 $STAGE_BIN/stage-6 "${model[@]}" --prompts_path="$tmp/requests.txt" --kv_cache=false --show_token_ids=true \
    >"$tmp/reqnocache.log" 2>&1
# the greedy answers' text as the server writes it: the byte tokenizer's tokens are bytes, and a
# byte that does not begin a valid character becomes U+FFFD (openai.c's append_utf8)
python3 - "$tmp" <<'PY' >"$tmp/nocache.txt"
import json, sys
def text(b):
    out, i = [], 0
    while i < len(b):
        c = b[i]
        n = 1 if c < 0x80 else 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 0
        try:
            out.append(b[i:i + n].decode("utf-8") if n and i + n <= len(b) else None)
        except UnicodeDecodeError:
            out.append(None)
        if out[-1] is None:
            out[-1], n = "\ufffd", 1
        i += n
    return "".join(out)
ids = [l.split(":", 1)[1].split() for l in open(f"{sys.argv[1]}/reqnocache.log", errors="replace") if "answer ids:" in l]
for answer in ids[0::2]:  # the greedy ones
    print(json.dumps(text(bytes(int(t) for t in answer if int(t) < 256))))
PY
check '[ "$(wc -l <"$tmp/nocache.txt")" -eq 8 ]' "the no-cache reference did not answer 8 greedy prompts: $(tail -3 "$tmp/reqnocache.log")"
greedy() { python3 -c 'import json,sys; [print(json.dumps(x.get("text"))) for x in json.load(open(sys.argv[1]))[0::2]]' "$1"; }
served() { # served <name> <ranks> <args...>: the 16 requests at once
    local name=$1 np=$2; shift 2
    start_server "$name" "$np" "${model[@]}" --max_batch_size=16 "$@"
    bounded 300 python3 tests/server_client.py answers "$url" "$tmp/requests.json" 16 >"$tmp/$name.json"
    curl -s -m 10 "$url/metrics" >"$tmp/$name.metrics"
    stop_server
    check 'cmp -s <(greedy "$tmp/$name.json") "$tmp/nocache.txt"' \
        "$name: greedy answers differ from no cache: $(diff <(greedy "$tmp/$name.json") "$tmp/nocache.txt" | head -4)"
}
metric() { sed -n "s/^$2 //p" "$tmp/$1.metrics"; }
served plain 1
# a pool of 120 blocks of 4 positions (2048 bytes each; 1024 on each of [2,1,1]'s ranks): the
# template's ~50 blocks, which prefix caching shares, and room for a few of the ~230-position
# prompts' own blocks and answers
engine=(--max_prefill_tokens=32 --kv_block_size=4)
served engine 1 "${engine[@]}" --kv_cache_bytes=245760
served tp 2 "${engine[@]}" --kv_cache_bytes=122880 --tp_dimensions=2,1,1
for name in engine tp; do
    check 'cmp -s "$tmp/$name.json" "$tmp/plain.json" && [ "$(metric $name workbook_kv_cache_blocks)" = 120 ] && [ "$(metric $name workbook_preemptions_total)" -gt 0 ] && [ "$(metric $name workbook_prefix_cache_hits_total)" -gt 0 ]' \
        "$name: want the plain server's answers from 120 blocks, with preemptions and prefix hits: $(diff <(tr "}" "\n" <"$tmp/$name.json") <(tr "}" "\n" <"$tmp/plain.json") | head -4; grep -a "^workbook_.*\(cache\|preempt\)" "$tmp/$name.metrics")"
done

finish test_llama_inference
