#!/usr/bin/env bash
# Stage 06's server under abuse (issue 39), over loopback only; tests/server_abuse.py drives it
# with raw sockets, the standard library's HTTP and the official `openai` package:
#  - one client holding 520 idle connections (more than the server takes in all) and another
#    trickling headers on 40 cannot keep a third from an answer within a second; both are closed
#    by the client deadline;
#  - every malformed or hostile request gets its 4xx with an OpenAI error object: a NUL (escaped
#    or raw), invalid UTF-8, bytes after the JSON, stop "", an unknown model (404 model_not_found),
#    n, max_tokens, a prompt over the context, a body over 1 MiB, headers over 16 KiB, a
#    Content-Length over 1 MiB; a full queue's 429 says Retry-After;
#  - so does every malformed request head, each on a new connection, with /health answered
#    right after it: request lines and versions (505), header lines, Host, Content-Length, a body
#    in chunks (411), another transfer coding (501), a request line (414) or headers (431) over
#    16 KiB, each counted by its status in /metrics (workbook_requests_total);
#  - keep-alive: a connection carries request after request (raw sockets, and the openai
#    package's pool: /metrics's workbook_connections_accepted_total grows less than the
#    requests); pipelined requests are answered in order; a second request, right or malformed,
#    is checked as a first (its error object, and the connection ends); Connection: close and
#    HTTP/1.0 end the connection after the answer; an idle kept-alive connection is closed by the
#    deadline; Expect: 100-continue gets its 100 before the body;
#  - stream_options.include_usage sends the usage chunk; GET /v1/models/{id}; chat content as a
#    list of text parts; clients that hang up free their slot and their place in the queue
#    (/metrics); the server answers as before at the end;
#  - 128 connections from one address that send part of a head and close free their places at
#    once: the address's next request is answered within the second;
#  - a whole answer's head comes with the answer (a Content-Length), a stream's at once (chunks);
#  - `make` copies build/stage-6 while a server runs from it (no "Text file busy");
#  - all of it again on a build under AddressSanitizer (build/asan, -O1 -g: make builds it when
#    the sources changed), which must end without a report; and servers with a draft model, on
#    one rank and on [2,1,1], stopped by SIGTERM with no request, also without a report.
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
source tests/server_lib.sh
export OMP_NUM_THREADS=1
DEADLINE=10  # http.c's CLIENT_DEADLINE_S
VENV=build/openai-venv  # tests/test_server.sh installs the openai package there
python=python3
"$VENV/bin/python" -c 'import openai' 2>/dev/null && python=$VENV/bin/python

# serve <name> <binary> [env...]: a server on a free port of 127.0.0.1 with one slot and a queue
# of one; sets $url, $pid and $rank0, the log in $tmp/<name>.log
serve() {
    local name=$1 bin=$2; shift 2
    env "$@" timeout --kill-after=5 300 "$bin" --config configs/inference.json --model_id=custom --n_layer=4 --n_head=4 \
        --n_embd=256 --max_seq_len=2048 --random_init=true --init_from= --max_batch_size=1 --max_queue=1 \
        --serve=true --host=127.0.0.1 --port=0 >"$tmp/$name.log" 2>&1 &
    pid=$!
    servers+=("$pid")
    wait_server "$name" 600
}

# abuse <name> <an answer's time limit, s>: every check of server_abuse.py counted here
abuse() {
    local name=$1 out=$tmp/$1.json line
    bounded 240 "$python" tests/server_abuse.py "$url" random "$DEADLINE" "$2" >"$out" 2>"$tmp/$name.err"
    check '[ -s "$out" ]' "$name: tests/server_abuse.py failed: $(tail -3 "$tmp/$name.err")"
    while IFS= read -r line; do
        check '[ "${line%%	*}" = ok ]' "$name: ${line#*	}"
    done < <(python3 -c 'import json,sys; [print(("ok" if v["ok"] else "FAIL") + "\t" + k + ": " + json.dumps(v["detail"])[:600]) for k, v in json.load(open(sys.argv[1])).items()]' "$out" 2>/dev/null)
    grep -q '"the openai package"' "$out" || echo "test_server_abuse: $name: the openai package: SKIPPED (not importable by $python)"
}

# ---- the build as it is: the lockout limits at one second; make while it serves
serve plain build/stage-6
abuse plain 1
backend=$(for b in cpu cuda; do cmp -s build/stage-6 "build/$b/stage-6" && echo "$b"; done | head -1)
if [ -n "$backend" ] && make -q --no-print-directory BACKEND="$backend" "build/$backend/stage-6" 2>/dev/null; then
    touch "build/$backend/stage-6"  # newer than the copy: make copies it again, onto the running binary
    make --no-print-directory BACKEND="$backend" build/stage-6 >"$tmp/make.log" 2>&1; rc=$?
    check '[ $rc -eq 0 ] && cmp -s build/stage-6 "build/$backend/stage-6"' "make while a server runs from build/stage-6: $(tail -2 "$tmp/make.log")"
else
    echo "test_server_abuse: make while serving: SKIPPED (build/stage-6 is not an up-to-date build/<backend>/stage-6)"
fi
kill -TERM "$rank0"; wait "$pid"; rc=$?
check '[ $rc -eq 0 ]' "the server did not stop cleanly after the abuse: exit $rc, $(tail -3 "$tmp/plain.log")"

# ---- under AddressSanitizer: the same, an answer allowed 30 s; Open MPI's own allocations, kept
# to the process's end, are not the workbook's leaks (tests/lsan_mpi.supp)
CFLAGS="-O1 -g -fsanitize=address -fno-omit-frame-pointer" MPICC="mpicc -fsanitize=address" \
    make --no-print-directory -j2 BACKEND=cpu B=build/asan build/asan/stage-6 >"$tmp/asan_build.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "the AddressSanitizer build of stage 6 failed: $(grep -m3 error "$tmp/asan_build.log")"
if [ $rc -eq 0 ]; then
    serve asan build/asan/stage-6 ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0 \
        LSAN_OPTIONS=suppressions=$PWD/tests/lsan_mpi.supp
    abuse asan 30
    kill -TERM "$rank0"; wait "$pid"; rc=$?
    check '[ $rc -eq 0 ] && ! grep -q "ERROR: [A-Za-z]*Sanitizer\|SUMMARY: [A-Za-z]*Sanitizer" "$tmp/asan.log"' \
        "under AddressSanitizer: exit $rc, $(grep -A12 -m1 "ERROR: [A-Za-z]*Sanitizer" "$tmp/asan.log")"
    # with a draft model (speculative decoding; rank 0 holds it), on one rank and on [2,1,1]:
    # SIGTERM with no request stops it cleanly, freeing the draft's state after nothing it reads
    $STAGE_BIN/stage-1 --config configs/tiny.json --stop_iteration=1 --out_dir="$tmp/tiny" >"$tmp/tiny.log" 2>&1
    for np in 1 2; do
        dims=$([ "$np" = 2 ] && echo 2,1,1 || echo 1,1,1)
        ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0 LSAN_OPTIONS=suppressions=$PWD/tests/lsan_mpi.supp \
            STAGE_BIN=build/asan start_server "draft$np" "$np" --config configs/inference.json --init_from="$tmp/tiny" \
            --draft_model="$tmp/tiny" --num_speculative_tokens=2 --tp_dimensions="$dims"
        stop_server; rc=$?
        check '[ $rc -eq 0 ] && grep -q "^server: stopped" "$tmp/draft$np.log" && ! grep -q "ERROR: [A-Za-z]*Sanitizer\|SUMMARY: [A-Za-z]*Sanitizer" "$tmp/draft$np.log"' \
            "under AddressSanitizer, a draft model, [$dims], SIGTERM with no request: exit $rc, $(grep -A12 -m1 "ERROR: [A-Za-z]*Sanitizer" "$tmp/draft$np.log" || tail -3 "$tmp/draft$np.log")"
    done
fi

finish test_server_abuse
