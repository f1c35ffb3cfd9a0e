#!/usr/bin/env bash
# test_data_errors: bad data and bad tokenizer files give one clear message and exit code 1.
# Drives build/tokenize (override with TOKENIZE=...) with broken files made in a temp directory;
# each case checks the exit code, that stderr is exactly one "error: ..." line, and that the line
# names the file (and the record and field where that applies).
set -u
TOKENIZE=${TOKENIZE:-build/tokenize}
FIXTURES=../shared/fixtures
passed=0
failed=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# expect_error NAME EXPECTED_TEXT... -- ARGS...: run the tool, want exit 1 and one error line
# containing every EXPECTED_TEXT
expect_error() {
    local name=$1; shift
    local wants=()
    while [ "$1" != "--" ]; do wants+=("$1"); shift; done
    shift
    local out rc
    out=$("$TOKENIZE" "$@" 2>&1 >/dev/null)
    rc=$?
    local ok=1 why=""
    if [ "$rc" -ne 1 ]; then ok=0; why="exit code $rc, want 1"; fi
    if [ "$(printf '%s\n' "$out" | wc -l)" -ne 1 ] || [[ "$out" != "error: "* ]]; then
        ok=0; why="$why; want one line starting with 'error: '"
    fi
    for w in "${wants[@]}"; do
        if [[ "$out" != *"$w"* ]]; then ok=0; why="$why; missing '$w'"; fi
    done
    if [ $ok -eq 1 ]; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        echo "FAIL $name: $why"
        echo "  got: $out"
    fi
}

data() {  # data FILE CONTENT: write a data file (printf-style escapes allowed)
    printf "$2" > "$tmp/$1"
}

# ---- alpaca data files
data not_json.json '[{"instruction": "a", "output": "b"'
expect_error "not JSON" "$tmp/not_json.json" "not valid JSON" "line 1" -- --data "$tmp/not_json.json"
data garbage.json 'hello'
expect_error "garbage" "$tmp/garbage.json" "not valid JSON" -- --data "$tmp/garbage.json"
data object.json '{"instruction": "a", "output": "b"}'
expect_error "not an array" "$tmp/object.json" "expected a JSON array" "found an object" -- --data "$tmp/object.json"
data empty.json '[]'
expect_error "empty dataset" "$tmp/empty.json" "empty" -- --data "$tmp/empty.json"
data empty_file.json ''
expect_error "empty file" "$tmp/empty_file.json" "not valid JSON" -- --data "$tmp/empty_file.json"
data no_instruction.json '[{"instruction": "a", "output": "b"},\n {"input": "x", "output": "y"}]'
expect_error "missing instruction" "$tmp/no_instruction.json" "record 1" 'missing field "instruction"' -- --data "$tmp/no_instruction.json"
data no_output.json '[{"instruction": "a", "input": "", "output": "b"}, {"instruction": "c"}]'
expect_error "missing output" "$tmp/no_output.json" "record 1" 'missing field "output"' -- --data "$tmp/no_output.json"
data number_input.json '[{"instruction": "a", "input": 5, "output": "b"}]'
expect_error "non-string input" "$tmp/number_input.json" "record 0" '"input" must be a string' "a number" -- --data "$tmp/number_input.json"
data null_output.json '[{"instruction": "a", "output": null}]'
expect_error "null output" "$tmp/null_output.json" "record 0" '"output" must be a string' "null" -- --data "$tmp/null_output.json"
data array_instruction.json '[{"instruction": ["a"], "output": "b"}]'
expect_error "array instruction" "$tmp/array_instruction.json" '"instruction" must be a string' -- --data "$tmp/array_instruction.json"
data not_object.json '[{"instruction": "a", "output": "b"}, "just a string"]'
expect_error "record not an object" "$tmp/not_object.json" "record 1" "expected an object" -- --data "$tmp/not_object.json"
data bad_utf8.json '[{"instruction": "a", "output": "b"}, {"instruction": "caf\xc3", "output": "b"}]'
expect_error "invalid UTF-8" "$tmp/bad_utf8.json" "record 1" '"instruction"' "not valid UTF-8" -- --data "$tmp/bad_utf8.json"
data overlong.json '[{"instruction": "a", "output": "\xc0\xaf"}]'
expect_error "overlong UTF-8" "$tmp/overlong.json" "record 0" '"output"' "not valid UTF-8" -- --data "$tmp/overlong.json"
data surrogate.json '[{"instruction": "a", "output": "\\ud800"}]'
expect_error "lone surrogate escape" "$tmp/surrogate.json" "not valid JSON" -- --data "$tmp/surrogate.json"
expect_error "missing data file" "$tmp/nope.json" "cannot open" -- --data "$tmp/nope.json"

# ---- tokenizer directories
mkdir -p "$tmp/only_encoder" "$tmp/only_merges" "$tmp/empty_dir" "$tmp/bad_vocab" "$tmp/bad_merges"
ln -s "$(cd "$FIXTURES/gpt2-tokenizer" && pwd)/encoder.json" "$tmp/only_encoder/encoder.json"
ln -s "$(cd "$FIXTURES/lm-buddy-fake_gpt2" && pwd)/merges.txt" "$tmp/only_merges/merges.txt"
expect_error "no vocab.bpe" "$tmp/only_encoder" "vocab.bpe" -- --tokenizer "$tmp/only_encoder" --text hi
expect_error "no vocab.json" "$tmp/only_merges/vocab.json" -- --tokenizer "$tmp/only_merges" --text hi
expect_error "no tokenizer files" "$tmp/empty_dir" "neither" -- --tokenizer "$tmp/empty_dir" --text hi
expect_error "no tokenizer dir" "$tmp/missing_dir" "no such directory" -- --tokenizer "$tmp/missing_dir" --text hi
expect_error "tokenizer path is a file" "$tmp/empty.json" "not a directory" -- --tokenizer "$tmp/empty.json" --text hi
printf '{"a": 0, "b": ' > "$tmp/bad_vocab/vocab.json"; : > "$tmp/bad_vocab/merges.txt"
expect_error "vocab not JSON" "$tmp/bad_vocab/vocab.json" "not valid JSON" -- --tokenizer "$tmp/bad_vocab" --text hi
printf '{"a": 0, "b": "one"}' > "$tmp/bad_vocab/vocab.json"
expect_error "vocab id not a number" "$tmp/bad_vocab/vocab.json" '"b"' -- --tokenizer "$tmp/bad_vocab" --text hi
printf '{"a": 0, "b": 1, "ab": 2}' > "$tmp/bad_merges/vocab.json"
printf '#version: 0.2\na b\nab c\n' > "$tmp/bad_merges/merges.txt"
expect_error "merge of unknown token" "$tmp/bad_merges/merges.txt" "line 3" '"c"' -- --tokenizer "$tmp/bad_merges" --text hi
printf '#version: 0.2\na b\nb a\n' > "$tmp/bad_merges/merges.txt"
expect_error "merge result not in vocab" "$tmp/bad_merges/merges.txt" "line 3" "not in the vocabulary" -- --tokenizer "$tmp/bad_merges" --text hi
printf 'a b c\n' > "$tmp/bad_merges/merges.txt"
expect_error "malformed merge line" "$tmp/bad_merges/merges.txt" "line 1" -- --tokenizer "$tmp/bad_merges" --text hi
expect_error "byte without a token" "lm-buddy-tiny_gpt2" "0x78" -- --tokenizer "$FIXTURES/lm-buddy-tiny_gpt2" --text x

# ---- options and batches
expect_error "uneven slices" "global_batch_size 6" "4 ranks" -- --batch 0 --global-batch 6 --slices 4
expect_error "batch out of range" "batch 100000" -- --batch 100000 --global-batch 8
expect_error "record out of range" "--record 9000" -- --record 9000
expect_error "max_seq_len too small" "max_seq_len" -- --max-seq-len 1
expect_error "val_fraction 1" "val_fraction" -- --val-fraction 1
expect_error "unknown option" "--frobnicate" -- --frobnicate 1
expect_error "bad number" "--record" "abc" -- --record abc

echo "test_data_errors: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
