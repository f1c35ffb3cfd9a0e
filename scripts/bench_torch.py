#!/usr/bin/env python3
"""PyTorch's side of the speed comparison: GPT-2 124M at the bench shape (1 x 256 tokens), one
training step (forward, backward, AdamW) timed the ways PyTorch users run it on a CPU: eager and
torch.compile, fp32 and bf16 autocast, AdamW fused where this torch has it; each variant's best
step after one warm-up. scripts/bench_bound.sh runs it after the stages, on the same threads, with
the first Python that imports torch (TORCH_PYTHON, python3, /usr/bin/python3: Debian's
python3-torch is 1.13), and prints it beside them. A variant this torch lacks (torch.compile
before 2.0) is reported as such; before 2.0 attention is written out (no
scaled_dot_product_attention) and AdamW runs foreach (no fused CPU AdamW).

The model is written here from GPT-2's description (pre-LayerNorm blocks, causal attention through
scaled_dot_product_attention, tanh GELU, tied embedding and head, vocabulary padded to 50304 as
the workbook pads it); it shares no code with the C.

Prints one line per variant and, last, one JSON object with every figure; --json=FILE also adds
it to FILE under "torch" and prints the workbook's steps FILE holds (bench_bound.sh's
"step_bound") beside PyTorch's best of the same precision.
Usage: bench_torch.py [--steps 6] [--threads N] [--variants eager-fp32,compile-fp32,...] [--json FILE]
                     [--layers 12 --width 768 --heads 12 --vocab 50304]
"""
import argparse
import json
import os
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

CONTEXT, TOKENS = 1024, 50257  # GPT-2's positions and tokens (the vocabulary padded: --vocab)


def written_out_attention(q, k, v):
    """softmax(q k^T / sqrt(hs)) v over each key up to the query's position, for a torch before 2.0"""
    t = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def causal_attention(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return written_out_attention(q, k, v)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_out = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = causal_attention(q, k, v)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, layers, width, heads, vocab):
        super().__init__()
        self.vocab = vocab
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(CONTEXT, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.view(-1))


def adamw(model):
    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True), "fused"
    except (RuntimeError, TypeError):  # a torch without the fused CPU AdamW
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True), "foreach"


def time_variant(name, args):
    compiled, precision = name.split("-")
    if compiled == "compile" and not hasattr(torch, "compile"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.compile (2.0 on)")
    torch.manual_seed(0)
    model = GPT2(args.layers, args.width, args.heads, args.vocab)
    optimizer, kind = adamw(model)
    step_fn = torch.compile(model) if compiled == "compile" else model
    steps, tokens, words = args.steps, args.tokens, min(TOKENS, args.vocab)
    idx = torch.randint(0, words, (1, tokens))
    targets = torch.randint(0, words, (1, tokens))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = step_fn(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    start = time.perf_counter()
    step()  # warm-up: compilation, allocation
    warmup = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    ms = 1000 * min(times)
    result = {"variant": name, "ms": ms, "median_ms": 1000 * statistics.median(times),
              "tokens_per_sec": tokens / (ms / 1000), "adamw": kind, "warmup_s": warmup, "loss": loss, "steps": steps}
    print(f"{name:<14} {ms:9.1f} ms/step {result['tokens_per_sec']:8.1f} tokens/s  (best of {steps}, median "
          f"{result['median_ms']:.1f} ms; AdamW {kind}, warm-up {warmup:.1f} s)", flush=True)
    return result


def fp32_matmul_library():
    """The BLAS this process's torch runs fp32 matmuls on, read from the libraries it has loaded after
    one (Debian's python3-torch is built against the generic libblas.so.3, which is netlib's
    reference BLAS unless an optimized one, such as OpenBLAS, is installed as the alternative)."""
    torch.ones(64, 64) @ torch.ones(64, 64)
    loaded = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "blas" in os.path.basename(path) or "mkl" in os.path.basename(path):
                loaded.add(os.path.realpath(path))
    return ", ".join(sorted(loaded)) or "none loaded (built in)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--variants", default="eager-fp32,compile-fp32,eager-bf16,compile-bf16")
    parser.add_argument("--json", help="add the figures to this file under \"torch\"")
    # GPT-2 124M unless told (tests/test_bench_torch.sh runs a small one)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"PyTorch {torch.__version__}, {args.threads} threads, GPT-2 L={args.layers} C={args.width} "
          f"H={args.heads} V={args.vocab}, 1 x {args.tokens} tokens, best of {args.steps} steps after one warm-up")
    blas = fp32_matmul_library()
    print(f"fp32 matmuls on: {blas}" + ("  (netlib's reference BLAS: not PyTorch's best; an optimized BLAS, e.g. "
                                        "apt-get install libopenblas0-pthread, replaces it)"
                                        if "/blas/libblas" in blas else ""))
    results = []
    for name in args.variants.split(","):
        try:
            results.append(time_variant(name, args))
        except Exception as e:  # torch.compile needs a C++ compiler; say why a variant is missing
            print(f"{name:<14} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    best = {}
    for r in results:
        precision = r["variant"].split("-")[1]
        if precision not in best or r["tokens_per_sec"] > best[precision]["tokens_per_sec"]:
            best[precision] = r
    figures = {"torch": torch.__version__, "fp32_blas": blas, "threads": args.threads, "tokens": args.tokens,
               "model": {"layers": args.layers, "width": args.width, "heads": args.heads, "vocab": args.vocab},
               "results": results,
               "best_tokens_per_sec": {k: v["tokens_per_sec"] for k, v in best.items()},
               "best_ms": {k: v["ms"] for k, v in best.items()}}
    print(json.dumps(figures))
    if args.json:
        add_to_bench_json(args.json, figures)


def add_to_bench_json(path, figures):
    """figures under "torch" in path (created, or updated in place), and the workbook's steps there
    (step_bound's labels name fp32 or bf16) beside PyTorch's best of the same precision, in tokens a
    second"""
    data = json.load(open(path)) if os.path.exists(path) else {}
    data["torch"] = figures
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    for label, run in data.get("step_bound", {}).items():
        precision = "bf16" if "bf16" in label else "fp32"
        if precision in figures["best_ms"]:
            # tokens a second: the workbook's step trains on its batch's tokens, PyTorch's on --tokens
            ours = 1e3 * run["step_tokens"] / run["step_ms"]
            theirs = figures["best_tokens_per_sec"][precision]
            print(f"{label}: {run['step_ms']:.1f} ms a step of {run['step_tokens']} tokens, {ours:.1f} tokens/s; "
                  f"PyTorch {figures['torch']}'s best {precision}: {figures['best_ms'][precision]:.1f} ms a step of "
                  f"{figures['tokens']}, {theirs:.1f} tokens/s (the workbook {ours / theirs:.2f}x as fast)")


if __name__ == "__main__":
    main()
