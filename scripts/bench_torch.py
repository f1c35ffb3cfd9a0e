#!/usr/bin/env python3
"""PyTorch's side of the speed comparison: GPT-2 124M at the bench shape (1 x 256 tokens), one
training step (forward, backward, AdamW) timed the ways PyTorch users run it on a CPU: eager and
torch.compile, fp32 and bf16 autocast, AdamW fused where this torch has it. Not a test and not in
CI: it needs PyTorch 2.x, which the workbook does not install (`python3 -m venv venv &&
venv/bin/pip install torch`, then `venv/bin/python scripts/bench_torch.py`). Run it in the same
sitting as `make bench`, whose stage 01 rows are the workbook's side.

The model is written here from GPT-2's description (pre-LayerNorm blocks, causal attention through
scaled_dot_product_attention, tanh GELU, tied embedding and head, vocabulary padded to 50304 as
the workbook pads it); it shares no code with the C.

Prints one line per variant and, last, one JSON object with every figure.
Usage: bench_torch.py [--steps 6] [--threads N] [--variants eager-fp32,compile-fp32,...]
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, CONTEXT, LAYERS, WIDTH, HEADS = 50304, 1024, 12, 768, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.attn_out = nn.Linear(WIDTH, WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc_out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def adamw(model):
    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True), "fused"
    except (RuntimeError, TypeError):  # a torch without the fused CPU AdamW
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True), "foreach"


def time_variant(name, steps, tokens):
    compiled, precision = name.split("-")
    torch.manual_seed(0)
    model = GPT2()
    optimizer, kind = adamw(model)
    step_fn = torch.compile(model) if compiled == "compile" else model
    idx = torch.randint(0, 50257, (1, tokens))
    targets = torch.randint(0, 50257, (1, tokens))

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
    ms = 1000 * statistics.median(times)
    result = {"variant": name, "ms": ms, "tokens_per_sec": tokens / (ms / 1000), "adamw": kind,
              "warmup_s": warmup, "loss": loss, "steps": steps}
    print(f"{name:<14} {ms:9.1f} ms/step {result['tokens_per_sec']:8.1f} tokens/s  (AdamW {kind}, "
          f"warm-up {warmup:.1f} s)", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--variants", default="eager-fp32,compile-fp32,eager-bf16,compile-bf16")
    args = parser.parse_args()
    if int(torch.__version__.split(".")[0]) < 2:
        raise SystemExit(f"bench_torch: PyTorch {torch.__version__} found; the comparison is with 2.x "
                         "(torch.compile, fused AdamW): pip install torch in a venv")
    torch.set_num_threads(args.threads)
    print(f"PyTorch {torch.__version__}, {args.threads} threads, GPT-2 124M, 1 x {args.tokens} tokens, "
          f"median of {args.steps} steps after one warm-up")
    results = []
    for name in args.variants.split(","):
        try:
            results.append(time_variant(name, args.steps, args.tokens))
        except Exception as e:  # torch.compile needs a C++ compiler; say why a variant is missing
            print(f"{name:<14} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    best = {}
    for r in results:
        precision = r["variant"].split("-")[1]
        if precision not in best or r["tokens_per_sec"] > best[precision]["tokens_per_sec"]:
            best[precision] = r
    print(json.dumps({"torch": torch.__version__, "threads": args.threads, "tokens": args.tokens,
                      "results": results,
                      "best_tokens_per_sec": {k: v["tokens_per_sec"] for k, v in best.items()}}))


if __name__ == "__main__":
    main()
