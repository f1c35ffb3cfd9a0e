#!/usr/bin/python3
"""The reference side of tests/test_fp8.sh's training check: stage 02's fp8-tensorwise recipe on
GPT-2, written again from fp8.h's description in PyTorch (float64) with ml_dtypes' FP8 casts, and
run through tests/oracle_train.py's training loop (data, loss, AdamW, clipping, validation).

usage: python tests/oracle_fp8_train.py CONFIG.json INIT_DIR RUN_DIR

Each block linear (c_attn, attn.c_proj, c_fc, mlp.c_proj): y = q4(x) @ q4(W) + b, with q4 a tensor
cast to e4m3 under the power of two at or below 448 / amax (saturating) and divided back; its
backward reads q5(dy), the same with e5m2 and 57344: dx = q5(dy) q4(W)^T, dW = q4(x)^T q5(dy),
db = the sum of dy itself. The head: logits = bf16(ln_f(x)) bf16(wte)^T, its backward from
bf16(dlogits). Everything else as oracle_train.py's fp32 model.
"""
import json
import math
import os
import sys

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

import oracle_train as ot
from oracle_bf16 import read_safetensors

FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def fp8(x, fmt):
    """x on the FP8 grid of fmt under its tensorwise power-of-two scale, divided back"""
    dtype, fmax = FORMATS[fmt]
    amax = float(np.float32(x.abs().max().item()))
    scale = 2.0 ** math.floor(math.log2(np.float32(fmax) / np.float32(amax))) if amax > 0 else 1.0
    v = np.clip((x * scale).float().numpy(), -fmax, fmax).astype(dtype).astype(np.float64)
    return torch.from_numpy(v) / scale


def bf16(x):
    return x.float().to(torch.bfloat16).double()


class Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):  # Conv1D: x (.., in) @ w (in, out)
        xq, wq = fp8(x, "e4m3"), fp8(w, "e4m3")
        ctx.save_for_backward(xq, wq)
        return xq @ wq + b

    @staticmethod
    def backward(ctx, dy):
        xq, wq = ctx.saved_tensors
        dyq = fp8(dy, "e5m2")
        dx = dyq @ wq.t()
        dw = xq.reshape(-1, xq.shape[-1]).t() @ dyq.reshape(-1, dyq.shape[-1])
        return dx, dw, dy.reshape(-1, dy.shape[-1]).sum(0)


class Bf16Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wte):
        xb, wb = bf16(x), bf16(wte)
        ctx.save_for_backward(xb, wb)
        return xb @ wb.t()

    @staticmethod
    def backward(ctx, dy):
        xb, wb = ctx.saved_tensors
        dyb = bf16(dy)
        return dyb @ wb, dyb.reshape(-1, dyb.shape[-1]).t() @ xb.reshape(-1, xb.shape[-1])


def gpt2_fp8_logits(p, x, H, L):
    C = p["transformer.wte.weight"].shape[1]
    ln = lambda h, n: F.layer_norm(h, (C,), p[n + ".weight"], p[n + ".bias"], 1e-5)
    lin = lambda h, n: Fp8Linear.apply(h, p[n + ".weight"], p[n + ".bias"])
    h = p["transformer.wte.weight"][x] + p["transformer.wpe.weight"][:x.shape[1]]
    for i in range(L):
        b = f"transformer.h.{i}."
        q, k, v = lin(ln(h, b + "ln_1"), b + "attn.c_attn").split(C, dim=2)
        h = h + lin(ot.attention(q, k, v, H), b + "attn.c_proj")
        h = h + lin(F.gelu(lin(ln(h, b + "ln_2"), b + "mlp.c_fc"), approximate="tanh"), b + "mlp.c_proj")
    return Bf16Head.apply(ln(h, "transformer.ln_f"), p["transformer.wte.weight"])


def main():
    torch.set_num_threads(1)
    cfg = json.load(open(sys.argv[1]))
    init_dir, run_dir = sys.argv[2], sys.argv[3]
    p = {name: t.double() for name, t in read_safetensors(os.path.join(init_dir, "model.safetensors")).items()}
    ref = ot.train(cfg, p, {"forward": gpt2_fp8_logits, "H": cfg["n_head"], "L": cfg["n_layer"]})
    ours = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    # a value that lands on a tie of the FP8 or bf16 grid in one computation and beside it in the
    # other (fp32 against float64) rounds apart, and the gap grows with the steps: 3e-5 over 6
    # steps (measured up to 1.3e-5 on val_loss; bf16-mixed on the same run strays to 1.3e-4 on
    # the loss, 1.9e-3 on the gradient norm)
    ot.compare(ours, ref, cfg, os.path.basename(run_dir) + ": ", loss_tol=3e-5)
    print(f"fp8 reference: loss {ref[0]['loss']:.6f} -> {ref[-1]['loss']:.6f}")
    sys.exit(1 if ot.failures else 0)


if __name__ == "__main__":
    main()
