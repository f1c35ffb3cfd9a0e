#!/usr/bin/env bash
# The config's errors (common/config.c):
#  - an error names where the bad value came from: the file, the command line, or each of two;
#  - a second --config and an empty config file are errors, not silently something else.
source "$(dirname "$0")/lib.sh"

# ---- 1. errors name where the value came from -------------------------------------------------
expect_one_error "a bad override is the command line's" "^error: command line: key 'global_batch_size': expected a positive value, found -1" \
    build/stage-1 --config configs/tiny.json --global_batch_size=-1
echo '{"global_batch_size": -1}' >"$tmp/negative.json"
expect_one_error "bad file value" "^error: $tmp/negative.json: key 'global_batch_size'" build/stage-1 --config "$tmp/negative.json"
expect_one_error "two keys from two places" "^error: command line (n_embd), configs/tiny.json (n_head): keys 'n_embd' and 'n_head'" \
    build/stage-1 --config configs/tiny.json --n_embd=130
expect_one_error "second --config" "^error: command line: --config given twice ('configs/tiny.json' and 'configs/ddp.json')" \
    build/stage-1 --config configs/tiny.json --config=configs/ddp.json
expect_one_error "second --config (CONFIG_FILE does not count)" "given twice" \
    env CONFIG_FILE=configs/tiny.json build/stage-1 --config=configs/tiny.json --config configs/tiny.json
: >"$tmp/empty.json"
expect_one_error "empty config file" "^error: $tmp/empty.json: the file is empty" build/stage-1 --config "$tmp/empty.json"
printf ' \n\t\n' >"$tmp/blank.json"
expect_one_error "whitespace-only config file" "^error: $tmp/blank.json: the file is empty" build/stage-1 --config "$tmp/blank.json"
expect_one_error "--config without a file" "^error: command line: --config needs a file name" build/stage-1 --config

finish test_config
