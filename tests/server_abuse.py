"""tests/server_abuse.py: stage 06's server (--serve=true) under abuse, for tests/test_server_abuse.sh,
over raw sockets and the standard library's HTTP (the official `openai` package: openai_checks).
Prints one JSON object: each check's name -> {"ok": true/false, "detail": what was seen}.

  python3 tests/server_abuse.py <url> <model> <the server's client deadline, s> <an answer's time limit, s>

The time limit is 1 s (issue 39: one client holding hundreds of idle connections cannot keep
another from an answer within a second); more for a build under AddressSanitizer, whose checks
are on memory, not speed.

The server runs with one slot and a queue of one (max_batch_size=1, max_queue=1). Loopback has
every 127.x.y.z address: the abuser connects from 127.0.0.1 (and 127.0.0.3), the well-behaved
clients from 127.0.0.2 and 127.0.0.4.
"""
import http.client
import json
import socket
import sys
import threading
import time
import urllib.parse

TIMEOUT = 30


def connect(url, source="127.0.0.2", timeout=TIMEOUT):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout, source_address=(source, 0))


def request(url, method, path, body=None, headers=None, source="127.0.0.2", timeout=TIMEOUT):
    """status, headers, body bytes"""
    c = connect(url, source, timeout)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def openai_error(data):
    """the OpenAI-shaped error object in a body, or None"""
    try:
        e = json.loads(data)["error"]
        return e if isinstance(e.get("message"), str) and e.get("type") and "param" in e and "code" in e else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def metric(url, name):
    _, _, text = request(url, "GET", "/metrics", source="127.0.0.2")
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"no metric {name}")


# the statuses only the head checks answer (http_head.c's check_head, read_head)
DOOR_CODES = (411, 414, 431, 501, 505)


def status_counts(url, codes):
    """/metrics's workbook_requests_total of each code (None: not counted at all)"""
    _, _, text = request(url, "GET", "/metrics", source="127.0.0.2")
    lines = text.decode().splitlines()
    def count(code):
        prefix = f'workbook_requests_total{{code="{code}"}} '
        return next((float(l[len(prefix):]) for l in lines if l.startswith(prefix)), None)
    return {code: count(code) for code in codes}


def wait_metric(url, name, want, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if metric(url, name) == want:
            return True
        time.sleep(0.05)
    return False


def raw_socket(url, source):
    u = urllib.parse.urlparse(url)
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(5)
    s.connect((u.hostname, u.port))
    return s


def closed_by_server(s):
    """True when the server has closed (or reset) the connection: a read gives EOF"""
    s.setblocking(False)
    try:
        return s.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def timed_answer(url, model, source, limit):
    """a small completion from `source`: (status, seconds) within `limit` seconds, or the error"""
    t0 = time.time()
    try:
        status, _, _ = request(url, "POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": "Sort the digits.", "max_tokens": 2, "temperature": 0}), source=source,
            timeout=limit)
    except OSError as e:
        return f"no answer within {limit} s ({type(e).__name__})", time.time() - t0
    return status, time.time() - t0


def hold_connections(url, n, source):
    """n connections from `source` that send nothing; those the server refused at once are closed"""
    held = []
    for _ in range(n):
        try:
            held.append(raw_socket(url, source))
        except OSError:
            pass
    time.sleep(0.3)
    return held


def slowloris(url, n, source, stop):
    """n connections from `source` sending a request's headers a byte a second, never finishing;
    returns the sockets (threads keep trickling until `stop` is set or the server closes them)"""
    socks = []
    for _ in range(n):
        try:
            s = raw_socket(url, source)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        except OSError:
            pass

    def trickle():
        while not stop.is_set():
            for s in socks:
                try:
                    s.sendall(b"X")
                except OSError:
                    pass
            stop.wait(1)

    threading.Thread(target=trickle, daemon=True).start()
    return socks


def hung_up_mid_request(url, model, limit):
    """128 connections from one address (as many as it may hold) that send part of a request
    line, or of the headers, and close: their places are free at once, and the address's next
    request is answered within `limit` (retried until then: the closes and the new connection
    may reach the server in either order)"""
    source, parts = "127.0.0.5", (b"POST /v1/compl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    for i in range(128):
        s = raw_socket(url, source)
        s.sendall(parts[i % 2])
        s.close()
    t0, tries = time.time(), []
    while time.time() - t0 < limit:
        tries.append(timed_answer(url, model, source, limit))
        if tries[-1][0] == 200:
            break
    return tries[-1][0] == 200 and time.time() - t0 < limit, {"tries": tries, "seconds": time.time() - t0}


def bad_requests(url, model):
    """every malformed or hostile request: (name, status wanted, code wanted or None, status, error)"""
    chat = lambda content: json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2})
    cases = [
        ("NUL escaped", 400, None, '{"model":"%s","prompt":"Sort\\u0000 the digits."}' % model),
        ("NUL raw", 400, None, b'{"model":"%s","prompt":"Sort\x00 the digits."}' % model.encode()),
        ("invalid UTF-8", 400, "invalid_encoding", b'{"model":"%s","prompt":"Sort \xff\xfe digits."}' % model.encode()),
        ("overlong UTF-8", 400, "invalid_encoding", b'{"model":"%s","prompt":"\xc0\xafetc"}' % model.encode()),
        ("trailing bytes", 400, None, '{"model":"%s","prompt":"hi"} {"more":1}' % model),
        ("stop empty string", 400, None, json.dumps({"model": model, "prompt": "hi", "stop": ""})),
        ("stop empty in list", 400, None, json.dumps({"model": model, "prompt": "hi", "stop": [""]})),
        ("unknown model", 404, "model_not_found", json.dumps({"model": "gpt-4", "prompt": "hi"})),
        ("n=2", 400, None, json.dumps({"model": model, "prompt": "hi", "n": 2})),
        ("max_tokens over the context", 400, None, json.dumps({"model": model, "prompt": "hi", "max_tokens": 10 ** 6})),
        ("prompt over the context", 400, "context_length_exceeded", json.dumps({"model": model, "prompt": "y" * 5000})),
        ("stream_options without stream", 400, None,
         json.dumps({"model": model, "prompt": "hi", "stream_options": {"include_usage": True}})),
        ("an image part", 400, None, chat([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])),
        ("not JSON", 400, None, "{'model': 1"),
        ("a JSON array", 400, None, "[1, 2]"),
    ]
    out = []
    for name, want, code, body in cases:
        path = "/v1/chat/completions" if "messages" in str(body[:40]) else "/v1/completions"
        try:
            status, _, data = request(url, "POST", path, body, {"Content-Type": "application/json"})
        except OSError as e:
            status, data = f"{type(e).__name__}: {e}", b""
        out.append((name, want, code, status, openai_error(data), data[:200].decode("utf-8", "replace")))
    # refused from the headers, before the body (whose sending may then fail); a chunked body is not
    # taken (411) whatever its size
    big = json.dumps({"model": model, "prompt": "x" * (1 << 20)}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 65536]), big[i:i + 65536]) for i in range(0, len(big), 65536))
    for name, want, headers, body in [
            ("headers over 16 KiB", 431, {"X-Big": "a" * 20000, "Content-Length": "2"}, b"{}"),
            ("Content-Length over 1 MiB", 413, {"Content-Length": str(5 << 20)}, b"{}"),
            ("a chunked body over 1 MiB", 411, {"Transfer-Encoding": "chunked"}, chunked + b"0\r\n\r\n")]:
        try:
            s = raw_socket(url, "127.0.0.2")
        except OSError as e:
            out.append((name, want, None, f"{type(e).__name__}: {e}", None, ""))
            continue
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        try:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
        except OSError:
            pass
        reply = b""
        try:
            while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < int(
                    [l for l in reply.split(b"\r\n") if l.lower().startswith(b"content-length:")][0].split(b":")[1]):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        except (OSError, IndexError, ValueError):
            pass
        s.close()
        status = int(reply.split(b" ")[1]) if reply.startswith(b"HTTP/1.1 ") else None
        body = reply.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in reply else b""
        out.append((name, want, None, status, openai_error(body), body[:200].decode("utf-8", "replace")))
    return out


# request heads that are not HTTP/1.x, and heads that HTTP forbids: each sent alone on a new
# connection -> (status, code) of the OpenAI error object wanted
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
HEAD_REFUSALS = [
    ("a request line without spaces", b"GARBAGE\r\n\r\n", 400, "invalid_request_line"),
    ("a request line without a method", b" /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_request_line"),
    ("a space in the target", b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_request_line"),
    ("a request line without a version", b"GET /health\r\nHost: x\r\n\r\n", 400, "invalid_request_line"),
    ("a version not HTTP", b"GET /health FOO/1.1\r\nHost: x\r\n\r\n", 400, "invalid_request_line"),
    ("HTTP/2.0", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
    ("HTTP/0.9", b"GET /health HTTP/0.9\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
    ("a TLS handshake", bytes.fromhex("16030100a5010000a10303") + bytes(100), 400, "invalid_request_line"),
    ("binary bytes", bytes(range(256)) + b"\r\n\r\n", 400, "invalid_request_line"),
    ("a header line without a colon", b"GET /health HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", 400, "invalid_header"),
    ("whitespace before a colon", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A : 1\r\n\r\n", 400, "invalid_header"),
    ("a NUL in a header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400, "invalid_header"),
    ("HTTP/1.1 without Host", b"GET /health HTTP/1.1\r\n\r\n", 400, "invalid_host"),
    ("two Hosts", b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, "invalid_host"),
    ("Content-Length not a number", POST + b"Content-Length: abc\r\n\r\n{}", 400, "invalid_content_length"),
    ("Content-Length negative", POST + b"Content-Length: -2\r\n\r\n{}", 400, "invalid_content_length"),
    ("Content-Length of 23 digits", POST + b"Content-Length: " + b"9" * 23 + b"\r\n\r\n{}", 413, "body_too_large"),
    ("two Content-Lengths that disagree", POST + b"Content-Length: 2\r\nContent-Length: 5\r\n\r\n{}", 400,
     "invalid_content_length"),
    ("a malformed chunk", POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 411, "length_required"),
    ("a chunk size over 64 bits", POST + b"Transfer-Encoding: chunked\r\n\r\n" + b"f" * 21 + b"\r\n{}\r\n0\r\n\r\n",
     411, "length_required"),
    ("Transfer-Encoding gzip", POST + b"Transfer-Encoding: gzip\r\n\r\n{}", 501, "unsupported_transfer_encoding"),
    ("a request line over 16 KiB", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
    ("a header over 64 KiB", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 70000 + b"\r\n\r\n", 431,
     "headers_too_large"),
    ("5000 headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X%d: y\r\n" % i for i in range(5000)) + b"\r\n",
     431, "headers_too_large"),
]


def exchange(url, data, source="127.0.0.2", timeout=5):
    """sends data on a new connection and reads until the server closes it (or `timeout` seconds
    pass with nothing read): the replies' bytes"""
    s = raw_socket(url, source)
    s.settimeout(timeout)
    try:
        s.sendall(data)
    except OSError:
        pass
    reply = b""
    try:
        while chunk := s.recv(65536):
            reply += chunk
    except OSError:
        pass
    s.close()
    return reply


def status_and_body(reply):
    head, _, body = reply.partition(b"\r\n\r\n")
    return (int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else None), body


def head_refusals(url):
    """each of HEAD_REFUSALS gets its status and error object, and /health answers right after"""
    out = []
    for name, data, want, code in HEAD_REFUSALS:
        status, body = status_and_body(exchange(url, data))
        error = openai_error(body) or {}
        health = guarded(lambda: request(url, "GET", "/health")[::2])
        out.append((name, status == want and error.get("code") == code and health == (200, b'{"status":"ok"}\n'),
                    {"status": status, "want": [want, code], "body": body[:200].decode("utf-8", "replace"),
                     "health after": str(health)}))
    return out


# a second request on the connection of a first (pipelined: sent before the first answer came),
# right or malformed, and the status it gets: every request passes the head checks, a later one
# as the first (a right one asks to close, so that the exchange ends)
SECOND_REQUESTS = [
    ("a right one", b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 200),
    ("no Host", b"GET /health HTTP/1.1\r\n\r\n", 400),
    ("a request line without spaces", b"GARBAGE\r\n\r\n", 400),
    ("a space in the target", b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("a header line without a colon", b"GET /health HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", 400),
    ("Content-Length not a number", POST + b"Content-Length: abc\r\n\r\n{}", 400),
    ("a header over 64 KiB", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 70000 + b"\r\n\r\n", 431),
]


def answers_in(reply):
    """the answers in a connection's bytes, in order: (status, body) each (a body by its
    Content-Length, or in chunks)"""
    out = []
    while reply.startswith(b"HTTP/1.1 "):
        head, _, rest = reply.partition(b"\r\n\r\n")
        fields = {l.split(b":")[0].strip().lower(): l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")[1:] if b":" in l}
        body = b""
        if fields.get(b"transfer-encoding") == b"chunked":
            while True:
                size, _, rest = rest.partition(b"\r\n")
                n = int(size, 16)
                body, rest = body + rest[:n], rest[n + 2:]
                if n == 0:
                    break
        else:
            n = int(fields.get(b"content-length", b"0"))
            body, rest = rest[:n], rest[n:]
        out.append((int(head.split(b" ")[1]), body))
        reply = rest
    return out, reply


def second_requests(url, model):
    """each of SECOND_REQUESTS pipelined after a right first request (GET /health; a streamed
    completion; a 404): both answered in order, the second with its status (a malformed one with
    OpenAI's error object, never an HTML page, and the connection closed after it); after an
    HTTP/1.0 first, even one asking for keep-alive, the connection ends with the first answer"""
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    firsts = [(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 200),
              (POST + b"Content-Length: %d\r\n\r\n" % len(body) + body, 200),
              (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
              (b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 200)]
    seen = {}
    for first, status in firsts:
        for name, second, second_status in SECOND_REQUESTS:
            reply = exchange(url, first + second)
            answers, rest = answers_in(reply)
            want = [status] if b"HTTP/1.0" in first else [status, second_status]
            ok = [a[0] for a in answers] == want and not rest and b"<html" not in reply.lower() and \
                (len(answers) < 2 or second_status == 200 or openai_error(answers[1][1]) is not None)
            if not ok:
                seen[f"{first[:24]!r} then {name}"] = reply[:300].decode("utf-8", "replace")
    return not seen, seen or f"{len(firsts) * len(SECOND_REQUESTS)} pairs, each answered as it should be"


def pipelined(url, model):
    """three requests sent at once on one connection (a whole completion, a streamed one, models;
    the last asks to close): three answers, in order"""
    whole = json.dumps({"model": model, "prompt": "Sort the digits.", "max_tokens": 5, "temperature": 0}).encode()
    streamed = json.dumps({"model": model, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    reply = exchange(url, POST + b"Content-Length: %d\r\n\r\n%s" % (len(whole), whole) +
                     POST + b"Content-Length: %d\r\n\r\n%s" % (len(streamed), streamed) +
                     b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=TIMEOUT)
    answers, rest = answers_in(reply)
    try:
        kinds = [json.loads(answers[0][1])["object"], answers[1][1].count(b"data: "), json.loads(answers[2][1])["object"]]
    except (ValueError, KeyError, IndexError):
        kinds = None
    return [a[0] for a in answers] == [200] * 3 and kinds == ["text_completion", 5, "list"] and not rest, \
        {"statuses": [a[0] for a in answers], "kinds": kinds, "reply": reply[:300].decode("utf-8", "replace")}


def read_answer(f):
    """one answer from a connection's file: (status, headers, body)"""
    status = int(f.readline().split(b" ")[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, f.read(int(headers.get("content-length", 0)))


def kept_alive(url, model):
    """one connection carries requests one after another: health, a completion, a chat, a 400
    (a bad body keeps the connection: its framing is sound), models; then a malformed request
    on it gets its error object and the connection ends. /metrics counts the connections taken."""
    before = metric(url, "workbook_connections_accepted_total")
    s = raw_socket(url, "127.0.0.5")
    s.settimeout(30)
    f = s.makefile("rb")
    completion = json.dumps({"model": model, "prompt": "Sort the digits.", "max_tokens": 3}).encode()
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    requests = [b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
                POST + b"Content-Length: %d\r\n\r\n%s" % (len(completion), completion),
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(chat), chat),
                POST + b"Content-Length: 6\r\n\r\n[1, 2]",
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"]
    got = []
    for r in requests:
        s.sendall(r)
        status, headers, _ = read_answer(f)
        got.append((status, headers.get("connection")))
    s.sendall(b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = read_answer(f)
    got.append((status, headers.get("connection"), (openai_error(body) or {}).get("code")))
    closed = f.read() == b""
    s.close()
    accepted = metric(url, "workbook_connections_accepted_total") - before  # this one and the metric's
    want = [(200, "keep-alive"), (200, "keep-alive"), (200, "keep-alive"), (400, "keep-alive"), (200, "keep-alive"),
            (400, "close", "invalid_request_line")]
    return got == want and closed and accepted == 2, {"answers": got, "closed after": closed, "accepted": accepted}


def connection_headers(url, model):
    """an HTTP/1.1 answer keeps its connection (Connection: keep-alive); one the request asks to
    close (Connection: close), or a refused head's, says close and ends it; HTTP/1.0's ends too"""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answers = {
        "health": request(url, "GET", "/health"),
        "metrics": request(url, "GET", "/metrics"),
        "models": request(url, "GET", "/v1/models"),
        "a completion": request(url, "POST", "/v1/chat/completions", json.dumps(chat)),
        "a streamed completion": request(url, "POST", "/v1/chat/completions", json.dumps(dict(chat, stream=True))),
        "a refused body": request(url, "POST", "/v1/completions", "[1, 2]"),
    }
    wrong = {name: [status, headers.get("Connection")] for name, (status, headers, _) in answers.items()
             if headers.get("Connection") != "keep-alive"}
    body = json.dumps(chat).encode()
    for name, data, status in (
            ("Connection: close", b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 200),
            ("Connection: close, a completion", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), 200),
            ("HTTP/1.0", b"GET /health HTTP/1.0\r\n\r\n", 200),
            ("a refused head", POST + b"Transfer-Encoding: gzip\r\n\r\n", 501)):
        t0 = time.time()
        reply = exchange(url, data)  # until the server closes (5 s: it did not)
        seconds = time.time() - t0
        if not (reply.startswith(b"HTTP/1.1 %d" % status) and b"\r\nConnection: close\r\n" in reply and seconds < 4):
            wrong[name] = [reply[:120].decode("utf-8", "replace"), f"{seconds:.1f} s"]
    return not wrong, wrong or list(answers)


def expect_continue(url, model):
    """a client that sends Expect: 100-continue gets the 100 after the head, then, the body sent,
    its answer"""
    body = json.dumps({"model": model, "prompt": "Sort the digits.", "max_tokens": 2}).encode()
    s = raw_socket(url, "127.0.0.5")
    s.sendall(POST + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
    f = s.makefile("rb")
    interim = f.readline() + f.readline()
    s.sendall(body)
    status, headers, data = read_answer(f)
    s.close()
    return interim == b"HTTP/1.1 100 Continue\r\n\r\n" and status == 200, {"interim": interim, "status": status}


def idle_kept_alive(url):
    """a connection kept alive after its answer, then idle: the deadline closes it as any idle one"""
    s = raw_socket(url, "127.0.0.6")
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, _ = read_answer(s.makefile("rb"))
    return s, (status, headers.get("connection"))


def whole_answer_head(url, model):
    """a whole answer's head is sent with the answer, once it exists (the status can say how it
    went): a Content-Length, not chunks begun before the answer; a stream's begins at once"""
    body = json.dumps({"model": model, "prompt": "Sort the digits.", "max_tokens": 32, "temperature": 0})
    reply = exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body.encode()), timeout=TIMEOUT)  # the answer's time to generate
    head, _, data = reply.partition(b"\r\n\r\n")
    fields = {l.split(b":")[0].strip().lower(): l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")[1:] if b":" in l}
    _, stream_head, _ = request(url, "POST", "/v1/completions", json.dumps(dict(json.loads(body), stream=True)))
    ok = head.startswith(b"HTTP/1.1 200") and fields.get(b"content-length") == str(len(data)).encode() \
        and b"transfer-encoding" not in fields and json.loads(data)["usage"]["completion_tokens"] > 0 \
        and stream_head.get("Transfer-Encoding") == "chunked"
    return ok, {"head": head.decode("latin-1"), "stream head": stream_head}


def stream_events(url, body, source="127.0.0.2"):
    c = connect(url, source)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    lines = r.read().decode().split("\n")
    c.close()
    return [json.loads(l[6:]) for l in lines if l.startswith("data: {")], [l for l in lines if l][-1]


def include_usage(url, model):
    body = {"model": model, "messages": [{"role": "user", "content": "Sort the digits."}], "max_tokens": 5,
            "temperature": 0}
    events, last = stream_events(url, dict(body, stream=True, stream_options={"include_usage": True}))
    _, _, whole = request(url, "POST", "/v1/chat/completions", json.dumps(body), source="127.0.0.2")
    usage = json.loads(whole)["usage"]
    final = events[-1] if events else {}
    plain, _ = stream_events(url, dict(body, stream=True))
    counts = lambda u: {k: v for k, v in (u or {}).items() if k != "prompt_tokens_details"}  # cached: the cache's state
    ok = (last == "data: [DONE]" and final.get("choices") == [] and counts(final.get("usage")) == counts(usage)
          and "cached_tokens" in final["usage"]["prompt_tokens_details"]
          and all("usage" not in e for e in events[:-1]) and all("usage" not in e for e in plain))
    return ok, {"final": final, "usage": usage, "events": len(events), "plain_events": len(plain)}


def models(url, model):
    s1, _, one = request(url, "GET", f"/v1/models/{model}")
    s2, _, other = request(url, "GET", "/v1/models/no-such-model")
    ok = (s1 == 200 and json.loads(one).get("id") == model and json.loads(one).get("object") == "model"
          and s2 == 404 and (openai_error(other) or {}).get("code") == "model_not_found")
    return ok, {"one": [s1, one.decode()[:200]], "other": [s2, other.decode()[:200]]}


def content_parts(url, model):
    as_string = {"model": model, "messages": [{"role": "user", "content": "Sort the digits.\n52913"}],
                 "max_tokens": 6, "temperature": 0}
    as_parts = dict(as_string, messages=[{"role": "user", "content": [{"type": "text", "text": "Sort the digits."},
                                                                      {"type": "text", "text": "52913"}]}])
    a = request(url, "POST", "/v1/chat/completions", json.dumps(as_string))
    b = request(url, "POST", "/v1/chat/completions", json.dumps(as_parts))
    ok = a[0] == b[0] == 200 and json.loads(a[2])["choices"] == json.loads(b[2])["choices"]
    return ok, {"string": a[2].decode()[:200], "parts": b[2].decode()[:200]}


def queue_full_and_hang_ups(url, model):
    """one slot, one place in the queue: a third request gets 429 with Retry-After; then both
    clients hang up, and /metrics shows the slot and the queue free again"""
    long = {"model": model, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0}
    before = metric(url, "workbook_generated_tokens_total")
    a = connect(url, "127.0.0.2")
    a.request("POST", "/v1/completions", json.dumps(dict(long, stream=True)), {"Content-Type": "application/json"})
    sockets = [a.sock]  # the connection lets its socket go to the response (Connection: close)
    ra = a.getresponse()
    ra.fp.readline()  # its first event: a holds the slot
    b = connect(url, "127.0.0.2")
    b.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"})
    sockets.append(b.sock)
    queued = wait_metric(url, "workbook_queue_length", 1)
    status, headers, data = request(url, "POST", "/v1/completions", json.dumps(long), source="127.0.0.2")
    for sock in sockets:  # close alone would leave the socket open while a response object holds it
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    freed = wait_metric(url, "workbook_running_batch_size", 0) and wait_metric(url, "workbook_queue_length", 0)
    generated = metric(url, "workbook_generated_tokens_total") - before
    ok_429 = queued and status == 429 and headers.get("Retry-After") == "1" and openai_error(data) is not None
    return (ok_429, {"queued": queued, "status": status, "headers": headers, "body": data.decode()[:200]}), \
        (freed and generated < 2 * 1500, {"freed": freed, "generated": generated})


def whole_answer_hang_up(url, model):
    """a client waiting in the queue for a whole answer closes its connection (FIN, as a client that
    gives up does): its place in the queue is free at once, and its job never runs"""
    long = {"model": model, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0}
    a = connect(url, "127.0.0.2")
    a.request("POST", "/v1/completions", json.dumps(dict(long, stream=True)), {"Content-Type": "application/json"})
    holder = a.sock
    first = a.getresponse()
    first.fp.readline()  # its first event: a holds the slot
    body = json.dumps(long).encode()
    s = raw_socket(url, "127.0.0.2")
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    queued = wait_metric(url, "workbook_queue_length", 1)
    s.close()
    left = wait_metric(url, "workbook_queue_length", 0)
    holder.shutdown(socket.SHUT_RDWR)
    holder.close()
    freed = wait_metric(url, "workbook_running_batch_size", 0)
    return queued and left and freed, {"queued": queued, "queue freed": left, "slot freed": freed}


def openai_checks(url, model):
    """the official client: NotFoundError for an unknown model, models.retrieve, the usage chunk;
    its connection pool reuses its connections (the server takes fewer than the requests)"""
    try:
        import openai
    except ImportError:
        return None
    accepted = metric(url, "workbook_connections_accepted_total")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = {}
    try:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        out["not_found"] = "no error"
    except openai.NotFoundError as e:
        out["not_found"] = (e.status_code, e.code)
    out["retrieve"] = client.models.retrieve(model).id
    out["texts"] = [client.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text for _ in range(3)]
    # the stream last: this client closes a stream's connection at [DONE] without reading the end
    # of its chunks (its async client reads it), so its next request would take a new connection
    chunks = list(client.chat.completions.create(model=model, max_tokens=4, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]))
    out["usage"] = chunks[-1].usage.completion_tokens if chunks and chunks[-1].usage else None
    out["content"] = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    # 6 requests on one connection; the connections taken meanwhile, this count's own among them
    out["connections"] = metric(url, "workbook_connections_accepted_total") - accepted
    ok = out["not_found"] == (404, "model_not_found") and out["retrieve"] == model and out["usage"] == 4 and \
        len(out["texts"]) == 3 and out["connections"] <= 2
    return ok, out


def same_answer(url, body, reference):
    after = request(url, "POST", "/v1/completions", body)
    return (reference[0] == after[0] == 200 and json.loads(reference[2])["choices"] == json.loads(after[2])["choices"],
            [reference[2].decode()[:200], after[2].decode()[:200]])


def guarded(check, *args):
    """a check's (ok, detail); an exception (a refused connection, an answer that is not JSON) fails it"""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 -- whatever went wrong is the check's detail
        return False, f"{type(e).__name__}: {e}"


def main():
    url, model, deadline, limit = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    checks = {}
    greedy = json.dumps({"model": model, "prompt": "Sort the digits.", "max_tokens": 8, "temperature": 0})
    reference = request(url, "POST", "/v1/completions", greedy)

    # one client holds more connections than the server takes in all; a slow one trickles headers;
    # one keeps its connection after an answer, idle
    t0 = time.time()
    kept, kept_answer = idle_kept_alive(url)
    idle = hold_connections(url, 520, "127.0.0.1")
    stop = threading.Event()
    slow = slowloris(url, 40, "127.0.0.3", stop)
    answers = [timed_answer(url, model, "127.0.0.2", limit) for _ in range(3)]
    checks["served while one client holds 520 idle connections"] = (
        all(s == 200 and t < limit for s, t in answers), {"answers": answers, "held": len(idle)})
    answers = [timed_answer(url, model, "127.0.0.4", limit) for _ in range(3)]
    checks["served while another trickles headers on 40"] = (all(s == 200 and t < limit for s, t in answers), answers)

    checks["a client that hung up mid-request is served again at once"] = guarded(hung_up_mid_request, url, model, limit)

    counted_before = status_counts(url, DOOR_CODES)
    refused, heads = bad_requests(url, model), head_refusals(url)
    counted_after = status_counts(url, DOOR_CODES)
    for name, want, code, status, error, text in refused:
        checks[f"refused: {name}"] = (status == want and error is not None and (code is None or error["code"] == code),
                                      {"status": status, "want": want, "body": text})
    for name, ok, detail in heads:
        checks[f"refused head: {name}"] = (ok, detail)
    # /metrics counts each of those answers by its status, as the clients saw them
    seen = [r[3] for r in refused] + [detail["status"] for _, _, detail in heads]
    counted = {code: None if None in (counted_before[code], counted_after[code])
               else counted_after[code] - counted_before[code] for code in DOOR_CODES}
    checks["/metrics counts the head checks' refusals by status"] = (
        all(seen.count(code) > 0 and counted[code] == seen.count(code) for code in DOOR_CODES),
        {"counted": counted, "answered": {code: seen.count(code) for code in DOOR_CODES}})
    checks["a second request on a connection: answered, or refused as a first would be"] = guarded(second_requests, url, model)
    checks["pipelined requests answered in order"] = guarded(pipelined, url, model)
    checks["one connection, several requests, then a malformed one"] = guarded(kept_alive, url, model)
    checks["Connection: keep-alive, or close when asked (HTTP/1.0 too)"] = guarded(connection_headers, url, model)
    checks["Expect: 100-continue"] = guarded(expect_continue, url, model)
    checks["a whole answer's head comes with it"] = guarded(whole_answer_head, url, model)
    checks["stream_options include_usage"] = guarded(include_usage, url, model)
    checks["GET /v1/models/{id}"] = guarded(models, url, model)
    checks["chat content as text parts"] = guarded(content_parts, url, model)
    queue_checks = guarded(queue_full_and_hang_ups, url, model)
    if queue_checks[0] is False:  # an exception: both fail with it
        queue_checks = (queue_checks, queue_checks)
    checks["429 with Retry-After"], checks["clients gone free the slot and the queue"] = queue_checks
    checks["a client that gives up on a whole answer frees its place"] = guarded(whole_answer_hang_up, url, model)

    # the idle and the slow connections are closed by the deadline (and the refused ones at once)
    wait = t0 + deadline + 3 - time.time()
    if wait > 0:
        time.sleep(wait)
    still_idle = sum(not closed_by_server(s) for s in idle)
    still_slow = sum(not closed_by_server(s) for s in slow)
    stop.set()
    checks[f"idle and slow connections closed within {deadline + 3:.0f} s"] = (
        still_idle == 0 and still_slow == 0, {"idle_open": still_idle, "slow_open": still_slow})
    checks[f"a kept-alive connection, idle, closed within {deadline + 3:.0f} s"] = (
        kept_answer == (200, "keep-alive") and closed_by_server(kept), {"its answer": kept_answer})
    result = guarded(openai_checks, url, model)  # from 127.0.0.1, free again now
    if result is not None:
        checks["the openai package"] = result
    checks["the same answer after all this"] = guarded(same_answer, url, greedy, reference)
    print(json.dumps({name: {"ok": bool(ok), "detail": detail} for name, (ok, detail) in checks.items()},
                     default=str))
    if result is None:
        print("openai package: SKIPPED (not importable)", file=sys.stderr)


if __name__ == "__main__":
    main()
