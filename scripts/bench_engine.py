"""scripts/bench_engine.py: measurements of stage 06's engine against a running server (started
by scripts/bench_engine.sh), over tests/server_client.py's HTTP calls. Prints one JSON object.

  capacity <url>                      the most requests running at once while 64 short ones wait
  ttft <url> <prefix_file>            time to first token of 8 requests sharing a long prefix
  stall <url> <long_prompt_file>      16 decoding streams' token gaps before and while a long
                                      prompt arrives
  speculation <url> <draft_url> <body_file>  one request at a time, to the server without a draft
                                      and to the one with, in turn (8 each): the best and the
                                      median decode tokens/s of each, and the draft's acceptance
                                      rate
"""
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import server_client as sc  # noqa: E402


def capacity(url):
    body = {"model": "random", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}
    most, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            most[0] = max(most[0], int(sc.metric(url, "workbook_running_batch_size")))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    sc.answers(url, [body] * 64, 64)
    done.set()
    watcher.join()
    return {"most_running": most[0]}


def first_token_seconds(url, body):
    t0 = time.time()
    for _ in sc.stream(url, body):
        return time.time() - t0


def ttft(url, prefix_file):
    prefix = open(prefix_file).read()
    times = []
    for i in range(9):  # the first computes the prefix (and, with prefix caching, caches it)
        body = {"model": "random", "prompt": prefix + f" question {i}:", "max_tokens": 1, "temperature": 0}
        times.append(first_token_seconds(url, body))
    later = sorted(times[1:])
    return {"first_ms": 1e3 * times[0], "median_ms": 1e3 * later[len(later) // 2]}


def stall(url, long_file):
    """16 streams decode; after 1 s a long prompt arrives. Each stream's gaps between tokens, by
    the time they end: p99 in the second before the arrival, and p99 from the arrival until the
    long prompt's first token (and 50 ms more)"""
    body = {"model": "random", "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0}
    gaps, lock, stop = [], threading.Lock(), threading.Event()

    def streamer():
        last = None
        for _, _, conn in sc.stream(url, body):
            now = time.time()
            if last is not None:
                with lock:
                    gaps.append((now, now - last))
            last = now
            if stop.is_set():
                sc.hang_up(conn)
                return

    workers = [threading.Thread(target=streamer) for _ in range(16)]
    for w in workers:
        w.start()
    time.sleep(2.0)
    arrival = time.time()
    long_body = {"model": "random", "prompt": open(long_file).read(), "max_tokens": 1, "temperature": 0}
    long_ttft = first_token_seconds(url, long_body)
    time.sleep(0.3)
    stop.set()
    for w in workers:
        w.join(sc.TIMEOUT)

    def p99(xs):
        xs = sorted(xs)
        return 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")

    before = [g for t, g in gaps if arrival - 1.0 <= t < arrival]
    during = [g for t, g in gaps if arrival <= t <= arrival + long_ttft + 0.05]
    return {"before_p99_ms": p99(before), "during_p99_ms": p99(during), "long_ttft_ms": 1e3 * long_ttft,
            "gaps_before": len(before), "gaps_during": len(during)}


def decode_tokens_per_second(url, body):
    """one streamed answer's tokens after the first over the time from the first to the last: the
    decode steps alone (speculative decoding does not change the prompt's prefill)"""
    times = [time.time() for piece, finish, _ in sc.stream(url, body) if finish is None]
    times = times[1:] if "messages" in body else times  # a chat answer's first event is its role
    if len(times) < 2:
        sys.exit(f"bench: an answer of {len(times)} tokens: too short to time its decoding")
    return (len(times) - 1) / (times[-1] - times[0])


def speculation(url, draft_url, body_file):
    """The two servers run side by side but only one answers at a time, so both see the machine
    alike: their requests alternate. The best answer of each is its speed when no other job got
    in its way; the medians are given too"""
    body = json.load(open(body_file))
    alone, drafted = [], []
    for _ in range(8):
        alone.append(decode_tokens_per_second(url, body))
        drafted.append(decode_tokens_per_second(draft_url, body))
    median = lambda xs: sorted(xs)[len(xs) // 2]
    return {"alone_tokens_per_second": max(alone), "draft_tokens_per_second": max(drafted),
            "alone_median": median(alone), "draft_median": median(drafted),
            "acceptance_rate": sc.metric(draft_url, "workbook_spec_acceptance_rate")}


def main():
    cmd, url, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    result = {"capacity": lambda: capacity(url), "ttft": lambda: ttft(url, args[0]),
              "stall": lambda: stall(url, args[0]),
              "speculation": lambda: speculation(url, args[0], args[1])}[cmd]()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
