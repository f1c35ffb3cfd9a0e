# tests/server_lib.sh: starting and stopping stage 06's server in a test (source it after lib.sh).
# start_server <name> <ranks> <args...>: $STAGE_BIN/stage-6 serving on 127.0.0.1, port $SERVER_PORT (0, the
# default: any free one); sets $url, $pid (of the launcher: timeout, then mpirun with several
# ranks) and $rank0 (the process that serves, which a graceful stop signals), the log in
# $tmp/<name>.log. Every server is stopped when the test ends, as all it started (tests/lib.sh's
# end_test_processes); stop_servers stops those started so far before then.
servers=()
stop_servers() {
    local p
    for p in "${servers[@]}"; do
        kill -TERM "$p" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null
    done
}

start_server() {
    local name=$1 np=$2; shift 2
    if [ "$np" -eq 1 ]; then
        timeout --kill-after=5 600 "$STAGE_BIN/stage-6" "$@" --serve=true --host=127.0.0.1 --port="${SERVER_PORT:-0}" >"$tmp/$name.log" 2>&1 &
    else
        timeout --kill-after=5 600 mpirun -np "$np" --bind-to none "$STAGE_BIN/stage-6" "$@" --serve=true --host=127.0.0.1 \
            --port="${SERVER_PORT:-0}" >"$tmp/$name.log" 2>&1 &
    fi
    pid=$!
    servers+=("$pid")
    wait_server "$name" 300
}

# wait_server <name> <tenths of a second>: waits for the server logging to $tmp/<name>.log to
# listen; sets $url and $rank0
wait_server() {
    local name=$1
    for _ in $(seq "$2"); do grep -q "^server: model" "$tmp/$name.log" && break; sleep 0.1; done
    url=http://127.0.0.1:$(grep -ao 'http://127.0.0.1:[0-9]*' "$tmp/$name.log" | sed 's/.*://')
    rank0=$(grep -ao 'kill -TERM [0-9]*' "$tmp/$name.log" | sed 's/.* //')
    check 'grep -q "^server: model" "$tmp/$name.log"' "server $name did not start: $(tail -3 "$tmp/$name.log")"
}

# stop_server: SIGTERM to the last server started, and waits for it
stop_server() {
    kill -TERM "$rank0" 2>/dev/null
    wait "$pid"
}
