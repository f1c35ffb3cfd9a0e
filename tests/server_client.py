"""tests/server_client.py: a client of stage 06's server (--serve=true) for tests/test_server.sh
and `make bench`, over the standard library's HTTP only (the official `openai` package is
tested separately). Every call has a timeout; every result is printed as JSON for the shell.

  answers <url> <requests.json> <threads>   each request's status, text and finish reason, in order
  midjoin <url> <a.json> <b.json>           a streamed; b sent after a's 5th token; both answers,
                                            and whether b was done before a
  disconnect <url> <body.json>              a client hangs up mid-stream, another while it waits
  queue <url> <body.json>                   one slot, one place in the queue: the third gets 429
  sigterm <url> <pid> <body.json>           SIGTERM while a request runs: it still finishes
  metric <url> <name>                       one value of /metrics
  bench <url> <clients> <requests> <body.json>  throughput and time to first token
"""
import http.client
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse

TIMEOUT = 120


def connect(url):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT)


def post(url, path, body):
    """status, parsed JSON (or the raw text)"""
    c = connect(url)
    c.request("POST", path, body=body if isinstance(body, (str, bytes)) else json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    text = r.read().decode("utf-8")
    c.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def path_of(body):
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def summary(status, reply):
    if status != 200:
        return {"status": status, "error": reply.get("error") if isinstance(reply, dict) else reply}
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return {"status": status, "text": text, "finish_reason": choice["finish_reason"],
            "completion_tokens": reply["usage"]["completion_tokens"]}


def stream(url, body):
    """yields each event's text (delta content or text), finish reason and socket; returns at [DONE]"""
    c = connect(url)
    c.request("POST", path_of(body), body=json.dumps(dict(body, stream=True)),
              headers={"Content-Type": "application/json"})
    sock = c.sock  # the response takes it from the connection (Connection: close)
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"stream: status {r.status}: {r.read()[:200]}")
    for raw in r:
        line = raw.decode("utf-8").strip()
        if not line:
            continue
        if line == "data: [DONE]":
            c.close()
            return
        event = json.loads(line[len("data: "):])
        choice = event["choices"][0]
        yield choice.get("delta", {}).get("content") if "delta" in choice else choice["text"], \
            choice["finish_reason"], sock
    raise RuntimeError("stream: no [DONE]")


def metric(url, name):
    c = connect(url)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"no metric {name}")


def wait_metric(url, name, want, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if metric(url, name) == want:
            return True
        time.sleep(0.02)
    return False


def answers(url, requests, threads):
    out = [None] * len(requests)

    def one(i):
        out[i] = summary(*post(url, path_of(requests[i]), requests[i]))

    if threads == 1:
        for i in range(len(requests)):
            one(i)
    else:
        workers = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(TIMEOUT)
    return out


def midjoin(url, a, b):
    text, joined, t, finish = [], {}, None, None
    for i, (piece, finish, _) in enumerate(stream(url, a)):
        text.append(piece or "")
        if i == 5:  # a is running: b joins the batch now
            t = threading.Thread(target=lambda: joined.update(summary(*post(url, path_of(b), b))))
            t.start()
    b_within_a = bool(joined)  # b came and went while a ran: they shared decode steps
    if t:
        t.join(TIMEOUT)
    return {"a": "".join(text), "b": joined.get("text"), "a_finish": finish, "b_within_a": b_within_a}


def hang_up(sock):
    # close alone would leave the socket open while a response's file object holds it
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def gone(url, before):
    return {"running_back_to_zero": wait_metric(url, "workbook_running_batch_size", 0),
            "generated_tokens": metric(url, "workbook_generated_tokens_total") - before}


def disconnect(url, body):
    """a streamed answer whose client goes away after 3 tokens; then a whole (not streamed) one
    whose client goes away while it waits"""
    before = metric(url, "workbook_generated_tokens_total")
    for i, (_, _, sock) in enumerate(stream(url, body)):
        if i == 3:
            hang_up(sock)
            break
    streamed = gone(url, before)
    before = metric(url, "workbook_generated_tokens_total")
    conn = connect(url)
    conn.request("POST", path_of(body), body=json.dumps(body), headers={"Content-Type": "application/json"})
    running = wait_metric(url, "workbook_running_batch_size", 1)
    hang_up(conn.sock)
    return {"streamed": streamed, "whole": dict(gone(url, before), started=running)}


def queue(url, body):
    results = {}
    events = stream(url, body)
    next(events)  # a holds the only slot
    waiting = threading.Thread(target=lambda: results.update(b=post(url, path_of(body), body)[0]))
    waiting.start()
    results["queued"] = wait_metric(url, "workbook_queue_length", 1)
    status, reply = post(url, path_of(body), body)
    results["c"], results["c_error"] = status, reply.get("error", {}).get("type") if isinstance(reply, dict) else None
    for _ in events:  # a to its end
        pass
    waiting.join(TIMEOUT)
    return results


def sigterm(url, pid, body):
    results = {}
    running = threading.Thread(target=lambda: results.update(a=summary(*post(url, path_of(body), body))))
    running.start()
    results["started"] = wait_metric(url, "workbook_running_batch_size", 1)
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    try:
        results["after"] = post(url, path_of(body), body)[0]
    except OSError:
        results["after"] = "refused"
    running.join(TIMEOUT)
    return results


def bench(url, clients, requests, body):
    """clients threads send requests streamed requests in all; tokens/s and TTFT percentiles"""
    ttft, tokens, lock = [], [0], threading.Lock()
    todo = list(range(requests))

    def client():
        while True:
            with lock:
                if not todo:
                    return
                todo.pop()
            t0 = time.time()
            n = 0
            for piece, finish, _ in stream(url, body):
                if n == 0:
                    with lock:
                        ttft.append(time.time() - t0)
                n += 1 if finish is None else 0
            with lock:
                tokens[0] += n

    t0 = time.time()
    workers = [threading.Thread(target=client) for _ in range(clients)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(600)
    seconds = time.time() - t0
    ttft.sort()
    pick = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]
    return {"clients": clients, "requests": requests, "tokens": tokens[0], "seconds": seconds,
            "tokens_per_second": tokens[0] / seconds, "ttft_p50_ms": 1e3 * pick(0.5),
            "ttft_p99_ms": 1e3 * pick(0.99)}


def main():
    cmd, url, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    load = lambda path: json.load(open(path))
    if cmd == "answers":
        result = answers(url, load(args[0]), int(args[1]))
    elif cmd == "midjoin":
        result = midjoin(url, load(args[0]), load(args[1]))
    elif cmd == "disconnect":
        result = disconnect(url, load(args[0]))
    elif cmd == "queue":
        result = queue(url, load(args[0]))
    elif cmd == "sigterm":
        result = sigterm(url, int(args[0]), load(args[1]))
    elif cmd == "metric":
        result = metric(url, args[0])
    elif cmd == "bench":
        result = bench(url, int(args[0]), int(args[1]), load(args[2]))
    else:
        sys.exit(f"unknown command {cmd}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
