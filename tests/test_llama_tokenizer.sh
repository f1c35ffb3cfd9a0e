#!/usr/bin/env bash
# test_llama_tokenizer.sh: our reader of Hugging Face's tokenizer.json (Llama-2's and Llama-3's
# forms, and GPT-2's) against the `tokenizers` library, which shares no code with it: ids, decode,
# end-of-text, on texts with runs of spaces, code, CRLF, non-ASCII and characters only byte
# fallback can encode. The library builds the tokenizer.json files (tests/oracle_tokenizer.py);
# it comes with transformers in the oracle venv (tests/lib.sh's oracle_venv). Then: tokenizer.json
# files naming parts we do not implement are refused by name.
set -u
cd "$(dirname "$0")/.."
source tests/lib.sh

BIN=build/tests/tokenizer_ids
oracle_venv
check '[ -x "$BIN" ] && [ -x "$STAGE_BIN/stage-1" ]' "$BIN or $STAGE_BIN/stage-1 is not built (make test builds them)"

"$ORACLE_VENV/bin/python" tests/oracle_tokenizer.py "$BIN" "$tmp" >"$tmp/oracle.txt" 2>"$tmp/oracle.err"
cat "$tmp/oracle.txt"
passed=$((passed + $(grep -c '^ok: ' "$tmp/oracle.txt")))
failed=$((failed + $(grep -c '^FAIL: ' "$tmp/oracle.txt")))
check "grep -q 'every tokenizer compared' '$tmp/oracle.txt'" "tests/oracle_tokenizer.py did not run to the end: $(tail -3 "$tmp/oracle.err")"

# the tokenizer_path key reads tokenizer.json: stage 01 trains on the Alpaca data with Llama-3's
# form and sizes its embedding by the library's vocabulary (with the added tokens)
if [ -f "$tmp/llama3/tokenizer.json" ]; then
    args=(--config configs/tiny.json --tokenizer_path="$tmp/llama3" --stop_iteration=2)
    run_single 1 llama3_run
    want=$("$ORACLE_VENV/bin/python" -c 'import sys; from tokenizers import Tokenizer; print(Tokenizer.from_file(sys.argv[1]).get_vocab_size())' "$tmp/llama3/tokenizer.json")
    got=$(json_value "$tmp/llama3_run/config.json" vocab_size)
    check '[ -n "$want" ] && [ "$got" = "$want" ]' "stage 01 with the llama3 tokenizer: vocab_size $got, the library's $want"
fi

# mutate <name> <python statement on spec>: a copy of the llama3 tokenizer with one part changed
mutate() {
    mkdir -p "$tmp/$1"
    python3 -c "import json, sys; spec = json.load(open(sys.argv[1])); $2; json.dump(spec, open(sys.argv[2], 'w'))" \
        "$tmp/llama3/tokenizer.json" "$tmp/$1/tokenizer.json"
}
echo '{"texts": [], "ids": []}' >"$tmp/none.json"
refused() {  # refused <name> <python statement> <pattern the error must match>
    mutate "$1" "$2"
    expect_one_error "$1" "$3" "$BIN" "$tmp/$1" "$tmp/none.json" "$tmp/$1.out"
}
if [ -f "$tmp/llama3/tokenizer.json" ]; then
    refused model "spec['model']['type'] = 'WordPiece'" 'model type "WordPiece" is not one'
    refused pre "spec['pre_tokenizer']['pretokenizers'][0] = {'type': 'Whitespace'}" 'pre_tokenizer type "Whitespace"'
    refused norm "spec['normalizer'] = {'type': 'NFKC'}" 'normalizer type "NFKC"'
    refused decoder "spec['decoder'] = {'type': 'WordPiece'}" 'decoder type "WordPiece"'
    refused pattern "spec['pre_tokenizer']['pretokenizers'][0]['pattern']['Regex'] = r'\\w+'" 'Split pattern'
    refused single_word "spec['added_tokens'][0]['single_word'] = True" 'single_word true'
    refused behavior "spec['pre_tokenizer']['pretokenizers'][0]['behavior'] = 'Removed'" 'behavior "Removed"'
fi
finish test_llama_tokenizer
