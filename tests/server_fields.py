"""tests/server_fields.py: every request field of stage 06's server honoured or refused, for
tests/test_server_fields.sh. Prints one JSON object: each check's name -> {"ok", "detail"}.

  python3 tests/server_fields.py <url> <model>

The server runs a model whose weights are all 0, with the byte tokenizer (a token is a byte;
end-of-text is 256): every logit is 0 but those a logit_bias moves, so the greedy answers under the
penalties are computed here from their definitions (OpenAI's, vLLM's; ties to the lowest id) and
must match exactly, and min_p's kept tokens are known.
"""
import json
import math
import sys

sys.path.insert(0, "tests")
import server_client as sc  # noqa: E402

X, Y, EOT = ord("x"), ord("y"), 256
Z, J = ord("z"), ord("j")  # in neither prompt below, nor in the Alpaca template chat puts around it

# (endpoint, field, a value that asks for something refused, the value that asks for nothing)
REFUSED = [
    ("completions", "best_of", 2, 1),
    ("completions", "suffix", "end", None),
    ("chat", "response_format", {"type": "json_object"}, {"type": "text"}),
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}], []),
    ("chat", "tool_choice", "auto", "none"),
    ("chat", "functions", [{"name": "f"}], []),
    ("chat", "function_call", "auto", "none"),
    ("chat", "store", True, False),
    ("chat", "metadata", {"a": "b"}, {}),
    ("completions", "service_tier", "flex", None),
    ("chat", "modalities", ["text", "audio"], None),
    ("chat", "audio", {"voice": "alloy"}, None),
    ("chat", "prediction", {"type": "content", "content": "x"}, None),
    ("chat", "reasoning_effort", "low", None),
    ("chat", "web_search_options", {}, None),
    ("completions", "no_such_field", 1, None),
    ("chat", "messages_typo", [], None),
    ("completions", "messages", [], None),   # a chat field at completions
    ("chat", "prompt", "hi", None),          # and a completions field at chat
]


def body(endpoint, model, **fields):
    b = {"model": model, "max_tokens": 6, "temperature": 0}
    b.update({"prompt": "Count."} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Count."}]})
    b.update(fields)
    return b


def ask(url, endpoint, b):
    return sc.post(url, "/v1/completions" if endpoint == "completions" else "/v1/chat/completions", b)


def stream_events(url, endpoint, b):
    """a streamed answer's events, parsed"""
    c = sc.connect(url)
    c.request("POST", "/v1/completions" if endpoint == "completions" else "/v1/chat/completions", json.dumps(b),
              {"Content-Type": "application/json"})
    lines = c.getresponse().read().decode().split("\n")
    c.close()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def text_of(reply):
    c = reply["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


def greedy_with(biases, steps, presence=0.0, frequency=0.0, repetition=1.0, prompt=b"Count."):
    """the greedy answer when every logit is 0 but the biased ones, under the penalties"""
    out = []
    for _ in range(steps):
        logits = {}
        for t, b in biases.items():
            v = float(b)
            if repetition != 1.0 and (t in prompt or t in out):
                v = v / repetition if v > 0 else v * repetition
            v -= frequency * out.count(t) + (presence if t in out else 0.0)
            logits[t] = v
        best = max(logits, key=lambda t: (logits[t], -t))
        out.append(best if logits[best] > 0 else None)  # 0: every other token; never so here
    return bytes(out).decode()


# logprobs: the logits are the biases below and 0 elsewhere (257 tokens), the same at every step
LP_BIAS = {X: 3.0, Y: 2.5, Z: 1.0, J: -1.0}


def reference_logprobs(temperature, top_k=0, top_p=1.0, min_p=0.0):
    """the log-probabilities (257) of the distribution the sampler draws from; greedy: softmax's"""
    logits = [LP_BIAS.get(t, 0.0) for t in range(257)]
    t = temperature if temperature > 0 else 1.0
    m = max(logits)
    p = [math.exp((v - m) / t) for v in logits]
    total = sum(p)
    p = [v / total for v in p]
    if temperature > 0:
        order = sorted(range(257), key=lambda i: (-p[i], i))
        kept = order[:top_k] if top_k else order
        mass, n = 0.0, 0
        for i in kept:
            mass, n = mass + p[i], n + 1
            if mass >= top_p:
                break
        kept = kept[:n]
        kept = [i for i in kept if p[i] >= min_p * p[kept[0]]]
        mass = sum(p[i] for i in kept)
        p = [p[i] / mass if i in kept else 0.0 for i in range(257)]
    return [math.log(v) if v > 0 else -math.inf for v in p]


def token_name(i):
    b = bytes([i])
    return b.decode() if i < 128 and i != 0 else "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def logprobs_match(choice, chat, ref, n, tokens):
    """the choice's logprobs against the reference: each token's, and its n likeliest alternatives
    (the likeliest first, ties to the lower id)"""
    lp = choice["logprobs"]
    want_top = sorted((i for i in range(257) if ref[i] > -math.inf), key=lambda i: (-ref[i], i))[:n]
    close = lambda a, b: abs(a - b) < 1e-4
    if chat:
        items = lp["content"]
        ids = [item["bytes"][0] for item in items]
        ok = all(close(item["logprob"], ref[i]) and item["token"] == token_name(i) and
                 [a["bytes"][0] for a in item["top_logprobs"]] == want_top and
                 all(close(a["logprob"], ref[a["bytes"][0]]) for a in item["top_logprobs"]) for item, i in zip(items, ids))
    else:
        names = {token_name(i): i for i in range(256)}
        ids = [names[t] for t in lp["tokens"]]
        ok = all(close(v, ref[i]) for v, i in zip(lp["token_logprobs"], ids)) and \
            all([names[k] for k in top] == want_top and all(close(v, ref[names[k]]) for k, v in top.items())
                for top in lp["top_logprobs"]) and lp["text_offset"] == list(range(len(ids)))  # the byte tokenizer: a byte a character, or a U+FFFD
    return ok and len(ids) == tokens


def logprobs_checks(url, model, checks):
    bias = {str(t): v for t, v in LP_BIAS.items()}
    cases = [("greedy", dict(temperature=0), {}), ("temperature 0.7", dict(temperature=0.7, seed=3), {}),
             ("top_k 3", dict(temperature=1, top_k=3, seed=4), dict(top_k=3)),
             ("top_p 0.17", dict(temperature=0.8, top_p=0.17, seed=5), dict(top_p=0.17)),
             ("min_p 0.3", dict(temperature=1.2, min_p=0.3, seed=6), dict(min_p=0.3))]
    for name, fields, ref_args in cases:
        ref = reference_logprobs(fields["temperature"], **ref_args)
        for endpoint, n in (("completions", 5), ("chat", 5), ("chat", 0)):
            asked = dict(logprobs=n) if endpoint == "completions" else dict(logprobs=True, top_logprobs=n)
            b = body(endpoint, model, max_tokens=8, logit_bias=bias, **fields, **asked)
            status, reply = ask(url, endpoint, b)
            ok = status == 200 and logprobs_match(reply["choices"][0], endpoint == "chat", ref, n, 8)
            # streamed: each event carries its token's, the same
            events = [e for e in stream_events(url, endpoint, dict(b, stream=True))
                      if e["choices"] and e["choices"][0].get("logprobs")]
            streamed = [x for e in events for x in (e["choices"][0]["logprobs"]["content"] if endpoint == "chat"
                                                     else e["choices"][0]["logprobs"]["token_logprobs"])]
            whole = reply["choices"][0]["logprobs"]["content" if endpoint == "chat" else "token_logprobs"] if ok else None
            checks[f"{endpoint}: logprobs {n}, {name}"] = (ok and streamed == whole, {"reply": reply, "streamed": streamed})
    # "é" is two bytes, two tokens here: alternating under a frequency penalty, they make "éééé"
    # (UTF-8 C3 A9): each character's tokens are at its offset; neither byte is a character alone
    status, reply = ask(url, "completions", body("completions", model, max_tokens=8, logprobs=0, frequency_penalty=2,
                                                 logit_bias={str(0xC3): 100, str(0xA9): 99}))
    lp = reply["choices"][0]["logprobs"] if status == 200 else {}
    checks["logprobs of characters of two tokens"] = (
        status == 200 and reply["choices"][0]["text"] == "éééé" and lp["text_offset"] == [0, 0, 1, 1, 2, 2, 3, 3]
        and lp["tokens"] == ["bytes:\\xc3", "bytes:\\xa9"] * 4, reply)
    status, reply = ask(url, "completions", body("completions", model))
    checks["no logprobs asked: null"] = (status == 200 and reply["choices"][0]["logprobs"] is None, reply)
    for endpoint, fields in (("completions", dict(logprobs=21)), ("chat", dict(logprobs=True, top_logprobs=21)),
                             ("chat", dict(top_logprobs=2)), ("chat", dict(logprobs=1))):
        status, reply = ask(url, endpoint, body(endpoint, model, **fields))
        err = reply.get("error", {}) if isinstance(reply, dict) else {}
        checks[f"{endpoint}: {json.dumps(fields)} refused"] = (status == 400 and err.get("param") in fields, reply)


def prompt_checks(url, model, checks):
    """prompts as text, token ids, lists of one; echo; bad prompts, alone or in a list"""
    ids = list(b"Count.")
    bias = {str(X): 100}
    for name, prompt in (("text", "Count."), ("token ids", ids), ("a list of one text", ["Count."]),
                         ("a list of one list of token ids", [ids])):
        for stream in (False, True):
            b = body("completions", model, prompt=prompt, echo=True, logit_bias=bias, stream=stream)
            if stream:
                events = stream_events(url, "completions", b)
                got = ("".join(e["choices"][0]["text"] for e in events if e["choices"]), len(events))
                want = ("Count.xxxxxx", 1 + 6 + 1)  # the prompt, a token each, the finish
            else:
                status, reply = ask(url, "completions", b)
                got = (reply["choices"][0]["text"], reply["usage"]["prompt_tokens"]) if status == 200 else reply
                want = ("Count.xxxxxx", 6)
            checks[f"prompt as {name}, echo{', streamed' if stream else ''}"] = (got == want, {"got": got, "want": want})
    status, reply = ask(url, "completions", body("completions", model, prompt=ids, logit_bias=bias))
    checks["prompt as token ids, no echo"] = (status == 200 and reply["choices"][0]["text"] == "xxxxxx", reply)
    for name, prompt in (("a token id past the vocabulary", [67, 257]), ("no token", []), ("a fraction", [67.5]),
                         ("a list with an empty prompt", ["a", ""]), ("a list with a token list of none", [[1], []]),
                         ("a list with a token id past the vocabulary", [[1], [2, 257]])):
        status, reply = ask(url, "completions", body("completions", model, prompt=prompt))
        err = reply.get("error", {}) if isinstance(reply, dict) else {}
        checks[f"prompt as {name}: 400"] = (status == 400 and err.get("param") == "prompt", reply)
    status, reply = ask(url, "completions", body("completions", model, echo=True, logprobs=1))
    err = reply.get("error", {}) if isinstance(reply, dict) else {}
    checks["echo with logprobs: 400"] = (status == 400 and err.get("param") == "echo", reply)


def prompt_list_checks(url, model, checks):
    """a list of prompts (texts, token-id lists): each prompt's n choices, answer p * n + c the
    choice c of prompt p (OpenAI's order), streamed too; the usage counts each prompt once"""
    bias = {str(X): 100}
    texts = ["Count.", "Sort the digits 3141.", "Go"]
    for name, prompts in (("texts", texts), ("token-id lists", [list(t.encode()) for t in texts])):
        for stream in (False, True):
            b = body("completions", model, prompt=prompts, n=2, echo=True, logit_bias=bias, max_tokens=3, stream=stream)
            want = [(i, texts[i // 2] + "xxx") for i in range(6)]
            if stream:
                events = stream_events(url, "completions", b)
                got = {}
                for e in events:
                    for c in e["choices"]:
                        got[c["index"]] = got.get(c["index"], "") + c["text"]
                got, usage = sorted(got.items()), None
            else:
                status, reply = ask(url, "completions", b)
                got = [(c["index"], c["text"]) for c in reply["choices"]] if status == 200 else reply
                usage = reply.get("usage", {}).get("prompt_tokens") if status == 200 else None
            ok = got == want and (stream or usage == sum(len(t) for t in texts))
            checks[f"prompt as a list of {len(texts)} {name}, n 2{', streamed' if stream else ''}"] = (
                ok, {"got": got, "want": want, "usage.prompt_tokens": usage})
    status, reply = ask(url, "completions", body("completions", model, prompt=["a"] * 9, n=8))
    err = reply.get("error", {}) if isinstance(reply, dict) else {}
    checks["9 prompts of 8 choices, over max_queue: 400"] = (status == 400 and err.get("param") == "prompt", reply)


def choices_checks(url, model, checks):
    """n: distinct seeded choices, choice 0 the answer of n 1, the prompt computed once"""
    for endpoint in ("completions", "chat"):
        b = body(endpoint, model, max_tokens=10, temperature=1, seed=11,
                 **(dict(logprobs=0) if endpoint == "completions" else dict(logprobs=True)))  # to count the tokens
        _, one = ask(url, endpoint, b)
        status, three = ask(url, endpoint, dict(b, n=3))
        _, again = ask(url, endpoint, dict(b, n=3))
        texts = [text_of({"choices": [c]}) for c in three["choices"]] if status == 200 else []
        ok = status == 200 and [c["index"] for c in three["choices"]] == [0, 1, 2] and texts[0] == text_of(one) \
            and len(set(texts)) == 3 and three["choices"] == again["choices"] \
            and three["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content" if endpoint == "chat" else "tokens"])
                                                           for c in three["choices"]) \
            and three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
        checks[f"{endpoint}: n 3"] = (ok, {"one": one, "three": three})
        events = stream_events(url, endpoint, dict(b, n=3, stream=True, stream_options={"include_usage": True}))
        streamed = ["".join((e["choices"][0].get("delta", {}).get("content") or "") if endpoint == "chat"
                            else e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["index"] == i)
                    for i in range(3)]
        usage = [e["usage"] for e in events if not e["choices"]]
        checks[f"{endpoint}: n 3, streamed"] = (streamed == texts and len(usage) == 1 and
                                                usage[0]["completion_tokens"] == three["usage"]["completion_tokens"],
                                                {"streamed": streamed, "whole": texts, "usage": usage})
    # the later choices find the first one's prompt cached: 6 full blocks of 16 of a prompt of 100
    prompt = ("Count the digits of " + "2718281828459045235360287471352662497757247093699959574966967627724076630353547594")[:99] + "."
    saved = sc.metric(url, "workbook_prefix_cache_tokens_saved_total")
    status, reply = ask(url, "completions", body("completions", model, prompt=prompt, n=3, max_tokens=2))
    saved = sc.metric(url, "workbook_prefix_cache_tokens_saved_total") - saved
    checks["n 3 computes the prompt once"] = (status == 200 and len(prompt) == 100 and saved == 2 * 96, {"saved": saved})
    for n in (0, 10 ** 6):
        status, reply = ask(url, "completions", body("completions", model, n=n))
        err = reply.get("error", {}) if isinstance(reply, dict) else {}
        checks[f"n {n}: 400"] = (status == 400 and err.get("param") == "n", reply)


def main():
    url, model = sys.argv[1], sys.argv[2]
    checks = {}
    for endpoint, field, asks, nothing in REFUSED:
        status, reply = ask(url, endpoint, body(endpoint, model, **{field: asks}))
        err = reply.get("error", {}) if isinstance(reply, dict) else {}
        checks[f"{endpoint}: {field}={json.dumps(asks)} refused naming it"] = (
            status == 400 and err.get("param") == field and err.get("code") == "unsupported_parameter"
            and err.get("type") == "invalid_request_error" and f"'{field}'" in err.get("message", ""), [status, reply])
        if nothing is not None or field in ("logprobs", "suffix", "service_tier"):
            status, reply = ask(url, endpoint, body(endpoint, model, **{field: nothing}))
            checks[f"{endpoint}: {field}={json.dumps(nothing)} asks nothing: answered"] = (status == 200, [status, reply])

    logprobs_checks(url, model, checks)
    prompt_checks(url, model, checks)
    prompt_list_checks(url, model, checks)
    choices_checks(url, model, checks)

    # logit_bias: +100 makes a token the greedy choice; -100 keeps the greedy choice away
    for endpoint in ("completions", "chat"):
        status, reply = ask(url, endpoint, body(endpoint, model, logit_bias={str(X): 100}))
        checks[f"{endpoint}: logit_bias +100"] = (status == 200 and text_of(reply) == "xxxxxx", reply)
    # every logit 0: the greedy choice is token 0 (ties to the lowest id); -100 on it leaves token 1
    _, banned = ask(url, "completions", body("completions", model, max_tokens=3, logit_bias={"0": -100}))
    checks["logit_bias -100 keeps the greedy choice away"] = (banned["choices"][0]["text"] == "\x01" * 3, banned)
    # the penalties, against their definitions
    cases = [
        ("frequency_penalty 2", {Z: 100, J: 95}, dict(frequency_penalty=2), dict(frequency=2)),
        ("presence_penalty 2", {Z: 100, J: 99}, dict(presence_penalty=2), dict(presence=2)),
        ("presence -1 and frequency 0.5", {Z: 99, J: 100}, dict(presence_penalty=-1, frequency_penalty=0.5),
         dict(presence=-1, frequency=0.5)),
        ("repetition_penalty 2", {Z: 100, J: 60}, dict(repetition_penalty=2), dict(repetition=2)),
        ("repetition_penalty 2 on a letter of the prompt", {Z: 50, ord("C"): 90}, dict(repetition_penalty=2),
         dict(repetition=2)),
        ("repetition_penalty 1.5 on a negative bias", {Z: -10, J: -14, X: -20}, dict(repetition_penalty=1.5),
         dict(repetition=1.5)),
    ]
    for name, biases, fields, ref in cases:
        want = greedy_with(biases, 12, **ref) if min(biases.values()) > 0 else None
        for endpoint in ("completions", "chat"):
            b = body(endpoint, model, max_tokens=12, logit_bias={str(t): v for t, v in biases.items()}, **fields)
            status, reply = ask(url, endpoint, b)
            got = text_of(reply) if status == 200 else reply
            if want is None:  # negative biases: every other token is likelier; the answer avoids the three
                ok = status == 200 and not set(got) & {"x", "z", "j"}
            else:
                ok = got == want and len(set(want)) > 1
            checks[f"{endpoint}: {name}"] = (ok, {"got": got, "want": want})
    # stop_token_ids: the answer ends after the token; ignore_eos: end-of-text is a token like any other
    status, reply = ask(url, "completions", body("completions", model, logit_bias={str(X): 100}, stop_token_ids=[X]))
    checks["stop_token_ids"] = (status == 200 and reply["choices"][0]["text"] == "x" and
                                reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 1, reply)
    status, reply = ask(url, "chat", body("chat", model, logit_bias={str(Y): 100}, stop_token_ids=[EOT, Y]))
    checks["chat: stop_token_ids"] = (status == 200 and text_of(reply) == "y" and
                                      reply["choices"][0]["finish_reason"] == "stop", reply)
    _, ends = ask(url, "completions", body("completions", model, logit_bias={str(EOT): 100}))
    _, goes_on = ask(url, "completions", body("completions", model, logit_bias={str(EOT): 100}, ignore_eos=True))
    checks["ignore_eos"] = (ends["usage"]["completion_tokens"] == 0 and ends["choices"][0]["finish_reason"] == "stop" and
                            goes_on["usage"]["completion_tokens"] == 6 and goes_on["choices"][0]["finish_reason"] == "length",
                            [ends, goes_on])
    # min_p: biases 5, 5 and 4 on x, y, z (z e^-1 as likely as x and y, every other token e^-5):
    # min_p 0.5 keeps x and y, 0.3 z too, 0 every token; 4 seeds of 16 tokens each
    def letters(min_p):
        return set("".join(text_of(ask(url, "completions", body(
            "completions", model, max_tokens=16, temperature=1, seed=s, min_p=min_p,
            logit_bias={str(X): 5, str(Y): 5, str(ord("z")): 4}))[1]) for s in range(4)))
    kept = {p: letters(p) for p in (0.5, 0.3, 0)}
    checks["min_p"] = (kept[0.5] == {"x", "y"} and kept[0.3] == {"x", "y", "z"} and len(kept[0]) > 3,
                       {p: sorted(v) for p, v in kept.items()})
    # bad values of the honoured fields: 400 naming the field
    for field, value in [("logit_bias", {"x": 1}), ("logit_bias", {"257": 1}), ("logit_bias", {"5": 101}),
                         ("logit_bias", [1]), ("stop_token_ids", [257]), ("stop_token_ids", ["x"]),
                         ("stop_token_ids", 5), ("ignore_eos", 1), ("min_p", 1.5), ("presence_penalty", 3),
                         ("frequency_penalty", -2.5), ("repetition_penalty", 0)]:
        status, reply = ask(url, "completions", body("completions", model, **{field: value}))
        err = reply.get("error", {}) if isinstance(reply, dict) else {}
        checks[f"{field}={json.dumps(value)}: 400"] = (status == 400 and err.get("param") == field, [status, reply])
    print(json.dumps({name: {"ok": bool(ok), "detail": detail} for name, (ok, detail) in checks.items()}, default=str))


if __name__ == "__main__":
    main()
