#!/usr/bin/env bash
# Stage 06's chat templates (06_inference/serving/chat_template.c, a subset of Jinja) against transformers'
# own rendering (tests/chat_templates.py, in the oracle venv: tests/lib.sh oracle_venv):
#  - ChatML (Qwen2's), Llama-3's, Phi-3's, Llama-3.1's structure and one that raises, over four
#    conversations (a system message, turns, whitespace to trim, a tab and non-ASCII text), with
#    and without add_generation_prompt: the same text, byte for byte (build/tests/test_chat_template);
#  - the server: a checkpoint with a tokenizer_config.json beside it takes chat requests through its
#    template (the byte tokenizer: the prompt's tokens are the rendering's bytes), a conversation
#    the template raises on is refused with its words, and a template outside the subset stops the
#    server at the start with the file and the key.
source "$(dirname "$0")/lib.sh"
source tests/server_lib.sh
export OMP_NUM_THREADS=1
oracle_venv
py=$ORACLE_VENV/bin/python

"$py" tests/chat_templates.py cases "$tmp/cases.json" 2>"$tmp/cases.err"
check '[ -s "$tmp/cases.json" ]' "transformers' renderings: $(tail -3 "$tmp/cases.err")"
build/tests/test_chat_template "$tmp/cases.json" >"$tmp/render.txt" 2>&1
check 'grep -q "^test_chat_template: [0-9]* passed, 0 failed" "$tmp/render.txt"' "renderings differ from transformers': $(head -c 1500 "$tmp/render.txt")"
n=$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))))' "$tmp/cases.json")
check '[ "$n" -ge 30 ]' "want at least 30 cases, found $n"

# the server: a checkpoint of stage 01 with Llama-3's template beside it
build/stage-1 --config configs/tiny.json --n_layer=1 --n_embd=32 --max_seq_len=512 --stop_iteration=1 \
    --out_dir="$tmp/model" >"$tmp/train.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 training for the test failed: $(tail -3 "$tmp/train.log")"
for name in llama3 no_system; do
    "$py" tests/chat_templates.py config "$name" "$tmp/model"
    start_server "$name" 1 --config configs/inference.json --init_from="$tmp/model" --max_seq_len=512
    check 'grep -q "^server: chat messages through $tmp/model/tokenizer_config.json" "$tmp/$name.log"' "$name: the template is not said to be used: $(head -3 "$tmp/$name.log")"
    for i in 0 1 2 3; do
        python3 -c 'import json,sys; sys.path.insert(0,"tests"); import chat_templates as c; json.dump(c.CONVERSATIONS[int(sys.argv[1])], open(sys.argv[2], "w"))' "$i" "$tmp/m$i.json"
        curl -s -m 30 "$url/v1/chat/completions" -d "{\"model\":\"model\",\"max_tokens\":1,\"messages\":$(cat "$tmp/m$i.json")}" >"$tmp/reply$i.json"
        if [ "$name" = no_system ] && [ "$i" -ge 1 ] && [ "$i" -le 2 ]; then
            check '[ "$(json_value "$tmp/reply$i.json" error param)" = messages ] && json_value "$tmp/reply$i.json" error message | grep -q "System role not supported"' \
                "$name, conversation $i: want a 400 with the template's words: $(cat "$tmp/reply$i.json")"
            continue
        fi
        want=$(python3 -c 'import json,sys; print(len(next(c["expected"] for c in json.load(open(sys.argv[1])) if c["name"] == sys.argv[2]).encode()))' \
            "$tmp/cases.json" "$name, conversation $i, add_generation_prompt True")
        check '[ "$(json_value "$tmp/reply$i.json" usage prompt_tokens)" = "$want" ]' \
            "$name, conversation $i: want $want prompt tokens (the rendering's bytes), found: $(cat "$tmp/reply$i.json")"
    done
    stop_server
done
# a template outside the subset: the server does not start, and says which file and key
python3 -c 'import json,sys; json.dump({"chat_template": "{{ messages | tojson }}"}, open(sys.argv[1] + "/tokenizer_config.json", "w"))' "$tmp/model"
timeout --kill-after=5 60 build/stage-6 --config configs/inference.json --init_from="$tmp/model" --serve=true --port=0 >"$tmp/bad.log" 2>&1 </dev/null
rc=$?
check '[ $rc -ne 0 ] && grep -q "$tmp/model/tokenizer_config.json: key .chat_template.: chat template, byte 0: the filter .tojson." "$tmp/bad.log"' \
    "a template outside the subset: want a refusal naming the file and key, exit $rc: $(tail -2 "$tmp/bad.log")"

finish test_chat_template_oracle
