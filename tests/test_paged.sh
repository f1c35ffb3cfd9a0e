#!/usr/bin/env bash
# Stage 06's engine (scheduler.c over the paged KV cache, kv_cache.h; block_pool.h): the server's
# answers are the tokens of the plain loop without a cache, whatever the engine does to get them.
#  - 64 concurrent chat requests whose prompts share prefixes of several lengths (the template,
#    the instruction, part of the input), half greedy and half sampled with their own seeds, the
#    last 8 asked before;
#  - greedy answers equal stage 06's own without a KV cache (--kv_cache=false: the training
#    model's forward over the whole text each step, an independent reference); every answer
#    equals the slot design's (one block of a whole context per request, one request at a time);
#  - a block pool that holds about two of them at once, in blocks of 4 positions, so that running
#    requests run out of blocks mid-answer and the newest are preempted (freed, and recomputed
#    later); then with prefix caching (hits counted in /metrics), chunked prefill (32 positions a
#    step, the prompts ~225), everything at once, and everything on a [2,1,1] grid;
#  - a pool sized as a share of the free memory (kv_cache_memory_fraction), on one rank and on
#    [2,1,1]: its blocks are what the share of the measured free memory holds; bad shares refused;
#  - prompts asked again in blocks of one position: the whole prompt is cached and its last block
#    copied before it is written (copy-on-write, counted in /metrics);
#  - speculative decoding (a 1-layer draft proposes 3 tokens a step): greedy answers equal no
#    cache's, alone, with everything else on, and on a [2,2,1] grid; sampled, a chi-square test
#    shows the model's distribution of a token the draft proposed, not the draft's; with prefix
#    caching, 16 seeded requests get the same answers alone, asked again and all at once, in
#    blocks of 1, 4 and 16.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
source tests/server_lib.sh
export OMP_NUM_THREADS=1
client() { bounded 300 python3 tests/server_client.py "$@"; }

# A small model trained for a few steps on real alpaca answers: it has not learned to stop, so
# every answer runs to its limit and the running requests keep taking blocks. Its greedy choice is
# degenerate (spaces); the sampled answers walk through varied text, and a sampled token changes
# if the logits differ by about a millionth.
$STAGE_BIN/stage-1 --config configs/tiny.json --n_layer=2 --n_embd=64 --stop_iteration=25 \
    --global_batch_size=8 --log_interval=100 --eval_batches=1 --out_dir="$tmp/model" \
    --data_path="${FIXTURES:-../shared/fixtures}/alpaca/rasbt-LLMs-from-scratch_instruction-data.json" >"$tmp/train.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 training for the test failed: $(tail -3 "$tmp/train.log")"
# speculative decoding's draft: the same data and tokenizer, 1 layer of 32, 8 steps: it agrees
# with the model often, and its own distribution is plainly another
$STAGE_BIN/stage-1 --config configs/tiny.json --n_layer=1 --n_embd=32 --stop_iteration=8 \
    --global_batch_size=8 --log_interval=100 --eval_batches=1 --out_dir="$tmp/draft" \
    --data_path="${FIXTURES:-../shared/fixtures}/alpaca/rasbt-LLMs-from-scratch_instruction-data.json" >"$tmp/draft.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 training of the draft failed: $(tail -3 "$tmp/draft.log")"
model=(--config configs/inference.json --init_from="$tmp/model" --tokens_to_generate=16)

# 64 prompts: 4 tasks x 16 inputs; the inputs of a task share a prefix of 0, 4, 8 or 12 digits
python3 - "$tmp" <<'PY'
import json, random, sys
tasks = ["Sort the digits.", "Reverse the digits.", "Count the digits.", "Add the digits."]
rng = random.Random(3)
digits = lambda n: "".join(rng.choice("0123456789") for _ in range(n))
shared = [digits(4 * k) for k in range(4)]
prompts = [(tasks[i % 4], shared[i % 4] + digits(2 + i % 7)) for i in range(56)]
prompts += prompts[:8]  # asked again: with prefix caching, their whole prompt is cached
open(f"{sys.argv[1]}/prompts.txt", "w").write("".join(f"{a}\t{b}\n" for a, b in prompts))
reqs = []
for i, (instruction, text) in enumerate(prompts):
    r = {"model": "model", "messages": [{"role": "system", "content": text}, {"role": "user", "content": instruction}]}
    r.update({"temperature": 0} if i % 2 == 0 else {"temperature": 1, "seed": 100 + i, "max_tokens": 6 + i % 11})
    reqs.append(r)
json.dump(reqs, open(f"{sys.argv[1]}/requests.json", "w"))
json.dump(reqs[:8] + reqs[56:], open(f"{sys.argv[1]}/again.json", "w"))
PY

# the references: no cache (greedy), and the slot design one request at a time (all)
bounded 300 $STAGE_BIN/stage-6 "${model[@]}" --prompts_path="$tmp/prompts.txt" --kv_cache=false --show_token_ids=true \
    >"$tmp/nocache.log" 2>&1
python3 - "$tmp" <<'PY' >"$tmp/nocache.txt"
import json, sys
ids = [l.split(":", 1)[1].split() for l in open(f"{sys.argv[1]}/nocache.log", errors="replace") if "answer ids:" in l]
for answer in ids[0::2]:  # the greedy ones; the byte tokenizer: a token is a byte
    print(json.dumps(bytes(int(t) for t in answer).decode("utf-8", "replace")))
PY
check '[ "$(wc -l <"$tmp/nocache.txt")" -eq 32 ]' "the no-cache reference did not answer 32 greedy prompts: $(tail -3 "$tmp/nocache.log")"
start_server slots 1 "${model[@]}" --max_batch_size=1 --kv_block_size=256 --prefix_caching=false
client answers "$url" "$tmp/requests.json" 1 >"$tmp/slots.json"
stop_server

greedy() { python3 -c 'import json,sys; [print(json.dumps(x.get("text"))) for x in json.load(open(sys.argv[1]))[0::2]]' "$1"; }
check 'cmp -s <(greedy "$tmp/slots.json") "$tmp/nocache.txt"' \
    "the slot design's greedy answers differ from no cache: $(diff <(greedy "$tmp/slots.json") "$tmp/nocache.txt" | head -4)"

# served <name> <what> <args...>: the 64 requests at once on a server with <args> (on
# $served_ranks ranks, 1 unless set); its greedy answers against no cache, all against the slot
# design's
served() {
    local name=$1 what=$2; shift 2
    start_server "$name" "${served_ranks:-1}" "${model[@]}" --max_batch_size=64 "$@"
    client answers "$url" "$tmp/requests.json" 64 >"$tmp/$name.json"
    curl -s -m 10 "$url/metrics" >"$tmp/$name.metrics"
    stop_server
    check 'cmp -s <(greedy "$tmp/$name.json") "$tmp/nocache.txt"' \
        "$what: greedy answers differ from no cache: $(diff <(greedy "$tmp/$name.json") "$tmp/nocache.txt" | head -4)"
    [ -n "${greedy_only:-}" ] && return  # speculative decoding samples from other random numbers
    check 'cmp -s "$tmp/$name.json" "$tmp/slots.json"' \
        "$what: answers differ from the slot design's: $(diff <(tr "}" "\n" <"$tmp/$name.json") <(tr "}" "\n" <"$tmp/slots.json") | head -4)"
}
metric() { sed -n "s/^$2 //p" "$tmp/$1.metrics"; }

# a pool of 120 blocks of 4 positions (4096 bytes each: 2 layers, keys and values, 64 columns):
# two prompts of about 225 tokens, and little room to answer (the answers stay below the
# context, where stage 06 without a server allows one token more than the server)
served paged "paged cache, small pool" --kv_block_size=4 --kv_cache_bytes=491520 --prefix_caching=false
check '[ "$(metric paged workbook_kv_cache_blocks)" = 120 ] && [ "$(metric paged workbook_preemptions_total)" -gt 0 ] && [ "$(metric paged workbook_kv_cache_blocks_used)" = 0 ] && [ "$(metric paged workbook_prefix_cache_hits_total)" = 0 ]' \
    "paged cache: want 120 blocks, some preemptions, none held at the end, no prefix hits: $(grep -a "^workbook_.*\(cache\|preempt\)" "$tmp/paged.metrics")"
# the same with prefix caching: the template's blocks (and a task's, and a shared input's) are
# computed once and found by the later requests; preempted requests find their own blocks again
served prefix "prefix caching, small pool" --kv_block_size=4 --kv_cache_bytes=491520
check '[ "$(metric prefix workbook_preemptions_total)" -gt 0 ] && [ "$(metric prefix workbook_prefix_cache_hits_total)" -ge 56 ] && [ "$(metric prefix workbook_prefix_cache_tokens_saved_total)" -ge $((56 * 150)) ] && [ "$(metric prefix workbook_kv_cache_blocks_used)" -le 120 ]' \
    "prefix caching: want preemptions, at least 56 hits saving 150 positions each: $(grep -a "^workbook_.*\(cache\|preempt\)" "$tmp/prefix.metrics")"
# chunked prefill: 32 prompt positions a step (a prompt takes 7 or 8 steps), mixed with the other
# requests' decoding rows; alone, then with everything else on, then on a tensor-parallel grid
served chunked "chunked prefill" --max_prefill_tokens=32 --prefix_caching=false
served all "chunked prefill, prefix caching, small pool" --max_prefill_tokens=32 --kv_block_size=4 --kv_cache_bytes=491520
check '[ "$(metric all workbook_preemptions_total)" -gt 0 ] && [ "$(metric all workbook_prefix_cache_hits_total)" -gt 0 ]' \
    "everything on: want preemptions and prefix hits: $(grep -a "^workbook_.*\(cache\|preempt\)" "$tmp/all.metrics")"
served_ranks=2 served tp "[2,1,1], everything on" --tp_dimensions=2,1,1 --max_prefill_tokens=32 --kv_block_size=4 \
    --kv_cache_bytes=245760
check '[ "$(metric tp workbook_preemptions_total)" -gt 0 ] && [ "$(metric tp workbook_prefix_cache_hits_total)" -gt 0 ]' \
    "[2,1,1], everything on: want preemptions and prefix hits: $(grep -a "^workbook_.*\(cache\|preempt\)" "$tmp/tp.metrics")"

# the pool as a share of the free memory (kv_cache_memory_fraction): the share that makes about 200
# blocks of this host's MemAvailable now. The server reports the free memory it measured once the
# model was loaded (the least of the ranks'); its blocks must be what that share of it holds, at
# 4096 bytes a block (2048 a rank on [2,1,1], which holds half the heads), and its measure this
# host's MemAvailable give or take half. The answers stay the slot design's.
available=$(sed -n 's/^MemAvailable: *\([0-9]*\) kB$/\1/p' /proc/meminfo)
fraction=$(python3 -c "import sys; print(repr(200 * 4096 / (int(sys.argv[1]) * 1024)))" "$available")
pool_of_free() {  # <name> <bytes per block>: the pool's figures against the arithmetic
    python3 - "$tmp/$1.metrics" "$fraction" "$2" "$available" <<'PY'
import sys
m = {l.split()[0]: int(float(l.split()[1])) for l in open(sys.argv[1]) if l.startswith("workbook_kv_cache")}
fraction, per_block, available = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) * 1024
free, blocks = m["workbook_kv_cache_free_memory_bytes"], m["workbook_kv_cache_blocks"]
ok = blocks == int(fraction * free) // per_block and m["workbook_kv_cache_bytes"] == blocks * per_block \
    and available / 2 < free < available * 2
print("ok" if ok else f"want {int(fraction * free) // per_block} blocks of {per_block} bytes from {free} bytes free "
      f"(MemAvailable {available}), found {m}")
PY
}
served fraction "a pool of kv_cache_memory_fraction $fraction" --kv_block_size=4 --kv_cache_memory_fraction="$fraction" \
    --prefix_caching=false
check '[ "$(pool_of_free fraction 4096)" = ok ]' "kv_cache_memory_fraction: $(pool_of_free fraction 4096)"
check 'grep -q "^KV cache pool: $(metric fraction workbook_kv_cache_blocks) blocks of 4 positions, $(metric fraction workbook_kv_cache_bytes) bytes per rank, from kv_cache_memory_fraction" "$tmp/fraction.log"' \
    "kv_cache_memory_fraction: the pool it chose is not printed: $(grep -a "KV cache" "$tmp/fraction.log")"
served_ranks=2 served tpfraction "[2,1,1], a pool of kv_cache_memory_fraction $fraction" --tp_dimensions=2,1,1 \
    --kv_block_size=4 --kv_cache_memory_fraction="$fraction" --max_prefill_tokens=32
check '[ "$(pool_of_free tpfraction 2048)" = ok ]' "[2,1,1], kv_cache_memory_fraction: $(pool_of_free tpfraction 2048)"
# refused: a share outside (0, 1], one with kv_cache_bytes, one too small for a whole context
refused() {  # <what> <the error's words> <args...>
    local what=$1 want=$2; shift 2
    bounded 60 $STAGE_BIN/stage-6 "${model[@]}" --serve=true --port=0 "$@" >"$tmp/refused.log" 2>&1 </dev/null; rc=$?
    check '[ $rc -ne 0 ] && grep -q "$want" "$tmp/refused.log"' "$what: want a refusal saying '$want', exit $rc: $(tail -2 "$tmp/refused.log")"
}
refused "kv_cache_memory_fraction 0" "command line: key 'kv_cache_memory_fraction': expected a share of the free memory in (0, 1], found 0" \
    --kv_cache_memory_fraction=0
refused "kv_cache_memory_fraction 1.5" "key 'kv_cache_memory_fraction': expected a share of the free memory in (0, 1], found 1.5" \
    --kv_cache_memory_fraction=1.5
refused "both pool keys" "keys 'kv_cache_bytes' and 'kv_cache_memory_fraction' both size the KV cache's pool" \
    --kv_cache_memory_fraction=0.5 --kv_cache_bytes=491520
refused "a share too small" "key 'kv_cache_memory_fraction': expected a share of the free memory (.*) that holds one whole context" \
    --kv_cache_memory_fraction=1e-12

# speculative decoding: the draft proposes 3 tokens a step, the model checks them in one pass;
# alone, then with everything else on, then on a [2,2,1] grid (the draft runs on rank 0)
spec=(--draft_model="$tmp/draft" --num_speculative_tokens=3)
greedy_only=1 served spec "speculative decoding" "${spec[@]}"
check 'python3 -c "import sys; p, a = float(sys.argv[1]), float(sys.argv[2]); sys.exit(not (p > 100 and 0 < a < p))" "$(metric spec workbook_spec_proposed_tokens_total)" "$(metric spec workbook_spec_accepted_tokens_total)"' \
    "speculative decoding: want over 100 proposals, some accepted, not all: $(grep -a "^workbook_spec" "$tmp/spec.metrics")"
greedy_only=1 served specall "speculative decoding, chunked prefill, prefix caching, small pool" "${spec[@]}" \
    --max_prefill_tokens=32 --kv_block_size=4 --kv_cache_bytes=491520
check '[ "$(metric specall workbook_preemptions_total)" -gt 0 ] && [ "$(metric specall workbook_prefix_cache_hits_total)" -gt 0 ] && [ "$(metric specall workbook_spec_accepted_tokens_total)" -gt 0 ]' \
    "speculative decoding with everything on: want preemptions, prefix hits and accepted proposals: $(grep -a "^workbook_.*\(cache\|preempt\|spec\)" "$tmp/specall.metrics")"
greedy_only=1 served_ranks=4 served spectp "[2,2,1], speculative decoding and everything on" "${spec[@]}" --tp_dimensions=2,2,1 \
    --max_prefill_tokens=32 --kv_block_size=4 --kv_cache_bytes=245760

# Seeded sampling with the draft and prefix caching: 16 sampled requests get the same answers
# one at a time, asked again one at a time (their prompts cached: a prompt whose every position
# but its last is cached computes that one alone, and its first token is still the sampler's),
# and all 16 at once, in blocks of 1, 4 and 16 positions (prompts of every length modulo them)
python3 - "$tmp" <<'PY'
import json, sys
reqs = [{"model": "model", "messages": [{"role": "user", "content": "Count to %d." % (7 + 3 * i) + " Go." * (i % 5)}],
         "max_tokens": 12, "temperature": 1, "seed": i} for i in range(16)]
json.dump(reqs, open(f"{sys.argv[1]}/seeded.json", "w"))
PY
for bs in 1 4 16; do
    start_server seeded$bs 1 "${model[@]}" --max_batch_size=16 "${spec[@]}" --kv_block_size=$bs
    client answers "$url" "$tmp/seeded.json" 1 >"$tmp/seeded$bs.alone"
    client answers "$url" "$tmp/seeded.json" 1 >"$tmp/seeded$bs.again"
    client answers "$url" "$tmp/seeded.json" 16 >"$tmp/seeded$bs.batch"
    curl -s -m 10 "$url/metrics" >"$tmp/seeded$bs.metrics"
    stop_server
    agree=$(python3 -c 'import json,sys; a,b,c=(json.load(open(f)) for f in sys.argv[1:]); print(sum(x==y==z and x["status"]==200 for x,y,z in zip(a,b,c)))' \
        "$tmp/seeded$bs.alone" "$tmp/seeded$bs.again" "$tmp/seeded$bs.batch")
    check '[ "$agree" = 16 ] && [ "$(metric seeded$bs workbook_prefix_cache_hits_total)" -ge 32 ] && [ "$(metric seeded$bs workbook_spec_accepted_tokens_total)" -gt 0 ]' \
        "blocks of $bs, a draft and prefix caching: want 16 of 16 seeded answers alike alone, again and at once, found $agree; want 32 hits and accepted proposals: $(grep -a "^workbook_\(prefix\|spec\)" "$tmp/seeded$bs.metrics" | tr "\n" " ")"
done

# Sampling with speculative decoding draws the model's distribution, not the draft's: 2000
# samples (seeds 0..1999) of a prompt's second token (its first is the prefill's; the second is
# the first the draft proposes) from the model with the draft, the model alone and the draft
# alone. A chi-square test of homogeneity (categories below 5 expected merged): with the draft
# against the model alone p > 0.001 (when both draw the same distribution, a false failure for
# one draw of seeds in a thousand), against the draft alone p < 1e-6.
port() { [ "${SERVER_PORT:-0}" = 0 ] && echo 0 || echo $((SERVER_PORT + $1)); }  # three servers at once
SERVER_PORT=$(port 0) start_server sref 1 "${model[@]}" --max_batch_size=16; url_ref=$url
SERVER_PORT=$(port 1) start_server sspec 1 "${model[@]}" --max_batch_size=16 "${spec[@]}"; url_spec=$url
SERVER_PORT=$(port 2) start_server sdraft 1 "${model[@]}" --max_batch_size=16 --init_from="$tmp/draft"; url_draft=$url
bounded 600 python3 - "$url_ref" "$url_spec" "$url_draft" >"$tmp/chi2.txt" 2>&1 <<'PY'
import concurrent.futures, math, sys
sys.path.insert(0, "tests")
import server_client as sc

def second_tokens(url, model):
    def one(seed):
        status, reply = sc.post(url, "/v1/completions", {"model": model, "prompt": "Name a color:",
                                                         "max_tokens": 3, "temperature": 1, "seed": seed})
        text = reply["choices"][0]["text"].encode("utf-8", "surrogatepass") if status == 200 else b""
        return text[1:2].hex() if len(text) >= 2 else "short"  # the byte tokenizer: a byte a token
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(2000)))

def q_gamma(a, x):  # the regularized upper incomplete gamma function (Numerical Recipes 6.2)
    if x < a + 1:
        term = total = 1.0 / a
        for n in range(1, 500):
            term *= x / (a + n)
            total += term
        return 1.0 - total * math.exp(-x + a * math.log(x) - math.lgamma(a))
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        c = b + an / c
        d = 1 / d
        h *= d * c
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h

def homogeneity_p(xs, ys):
    cats = sorted(set(xs) | set(ys))
    count = lambda zs: {c: zs.count(c) for c in cats}
    a, b = count(xs), count(ys)
    rows, other = [], [0, 0]
    for c in cats:  # categories expected below 5 in either sample are merged
        if (a[c] + b[c]) / 2 < 5:
            other[0] += a[c]; other[1] += b[c]
        else:
            rows.append((a[c], b[c]))
    if sum(other):
        rows.append(tuple(other))
    na, nb = len(xs), len(ys)
    stat = sum((x - (x + y) * na / (na + nb)) ** 2 / ((x + y) * na / (na + nb)) +
               (y - (x + y) * nb / (na + nb)) ** 2 / ((x + y) * nb / (na + nb)) for x, y in rows)
    return q_gamma((len(rows) - 1) / 2, stat / 2), len(rows)

ref, spec, draft = (second_tokens(u, m) for u, m in zip(sys.argv[1:4], ("model", "model", "draft")))
p_model, k1 = homogeneity_p(spec, ref)
p_draft, k2 = homogeneity_p(spec, draft)
print(f"against the model alone: p {p_model:.3g} over {k1} categories")
print(f"against the draft alone: p {p_draft:.3g} over {k2} categories")
print("ok" if p_model > 1e-3 and p_draft < 1e-6 else "wrong")
PY
check 'tail -1 "$tmp/chi2.txt" | grep -qx ok' "speculative sampling: the model's distribution, not the draft's? $(cat "$tmp/chi2.txt" | tail -4)"
for u in "$url_ref" "$url_spec" "$url_draft"; do curl -s -m 5 "$u/metrics" | grep -a "^workbook_spec_acceptance_rate" >>"$tmp/chi2.txt"; done
stop_servers; servers=()

# blocks of one position, one request at a time: a prompt asked again is cached whole, and its
# last position is computed again into a copy of its last block (copy-on-write)
start_server again 1 "${model[@]}" --kv_block_size=1
client answers "$url" "$tmp/again.json" 1 >"$tmp/again.json.out"
curl -s -m 10 "$url/metrics" >"$tmp/again.metrics"
stop_server
check 'cmp -s "$tmp/again.json.out" <(python3 -c "import json,sys; a=json.load(open(sys.argv[1])); print(json.dumps(a[:8] + a[56:]))" "$tmp/slots.json")' \
    "prompts asked again, copy-on-write: answers differ from the slot design's: $(head -c 300 "$tmp/again.json.out")"
check '[ "$(metric again workbook_kv_cache_block_copies_total)" -ge 8 ] && [ "$(metric again workbook_prefix_cache_hits_total)" -ge 15 ]' \
    "prompts asked again: want 8 block copies at least and 15 hits: $(grep -a "^workbook_.*cache" "$tmp/again.metrics")"

finish test_paged
