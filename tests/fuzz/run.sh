#!/usr/bin/env bash
# Fuzz the data paths with libFuzzer + AddressSanitizer + UBSan (not part of `make test`).
#   bash tests/fuzz/run.sh [SECONDS_PER_HARNESS]     (from the repo root; default 120)
# Builds build/fuzz/<harness>, seeds a corpus in build/fuzz/corpus_<harness>, and runs each
# harness for the given time. A crash leaves crash-* files in build/fuzz/ and stops the script.
set -euo pipefail
secs=${1:-120}
out=build/fuzz
export FUZZ_TOKENIZER=$(cd ../shared/fixtures/gpt2-tokenizer && pwd)  # the harnesses run in $out
mkdir -p "$out"
CFLAGS="-g -O1 -std=c11 -Wall -Wextra -Icommon -Itests/fuzz -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all"
build() {  # build NAME SOURCES...
    local name=$1; shift
    clang $CFLAGS "tests/fuzz/$name.c" tests/fuzz/fuzz_log.c "$@" -o "$out/$name" -lcjson -lm
}
build fuzz_bpe common/data/tokenizer.c
build fuzz_alpaca common/data/alpaca.c common/data/tokenizer.c common/data/synthetic.c
build fuzz_tokenizer_files common/data/tokenizer.c

# seeds: a few real records, small texts, a tiny tokenizer
mkdir -p "$out/corpus_fuzz_bpe" "$out/corpus_fuzz_alpaca" "$out/corpus_fuzz_tokenizer_files"
printf "It's 2024: na\xc3\xafve caf\xc3\xa9 \xe2\x80\x94 \xe6\x9d\xb1\xe4\xba\xac \xf0\x9f\x9a\x80" > "$out/corpus_fuzz_bpe/seed1"
printf " hello  world\n\n<|endoftext|>don't 123 \xc2\xa0x" > "$out/corpus_fuzz_bpe/seed2"
head -c 3000 ../shared/fixtures/alpaca/stanford-alpaca-first200_from_Niveditha-12-FineTuning.json \
    > "$out/corpus_fuzz_bpe/seed3"
printf '[{"instruction": "Add.", "input": "1+2", "output": "3"}, {"instruction": "x", "output": "\\u00e9\\ud83d\\ude80"}]' \
    > "$out/corpus_fuzz_alpaca/seed1"
python3 -c "import json; d=json.load(open('../shared/fixtures/alpaca/LLaMA-Factory_alpaca_en_demo.json')); print(json.dumps(d[:3]))" \
    > "$out/corpus_fuzz_alpaca/seed2"
printf '{"a": 0, "b": 1, "ab": 2, "\\u0120": 3, "\\u0120a": 4, "<|endoftext|>": 5}\n@@\n#version: 0.2\na b\n\xc4\xa0 a\n' \
    > "$out/corpus_fuzz_tokenizer_files/seed1"
cat > "$out/json.dict" <<'DICT'
"instruction"
"input"
"output"
"{"
"}"
"["
"]"
":"
","
"\\u"
"\\ud800"
"null"
"true"
"0.5"
"1e400"
"\x00"
"\xc0\xaf"
"\xed\xa0\x80"
"#version: 0.2"
"\\u0120"
"<|endoftext|>"
DICT

for h in fuzz_bpe fuzz_alpaca fuzz_tokenizer_files; do
    leaks=0; [ "$h" = fuzz_bpe ] && leaks=1
    echo "== $h for ${secs}s"
    (cd "$out" && ASAN_OPTIONS=detect_leaks=$leaks ./"$h" -max_total_time="$secs" -max_len=4096 \
        -timeout=10 -rss_limit_mb=4096 -dict=json.dict -print_final_stats=1 "corpus_$h" 2>&1 | tail -12)
done
