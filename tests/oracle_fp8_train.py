#!/usr/bin/python3
"""The reference side of tests/test_fp8.sh's training checks: stage 02's FP8 recipes (precision
fp8-tensorwise with fp8_scaling current or delayed, fp8-rowwise, mxfp8) on GPT-2, written again
from fp8.h's description in PyTorch (float64) with ml_dtypes' FP8 casts, and run through
tests/oracle_train.py's training loop (data, loss, AdamW, clipping, validation).

usage: python tests/oracle_fp8_train.py CONFIG.json INIT_DIR RUN_DIR [LOSS_TOLERANCE]

Each block linear (c_attn, attn.c_proj, c_fc, mlp.c_proj), its weight W stored (in, out):
  tensorwise  y = q4(x) @ q4(W) + b, q4 a tensor cast to e4m3 under the power of two at or below
              448 / amax (saturating) and divided back; backward dx = q5(dy) q4(W)^T,
              dW = q4(x)^T q5(dy), q5 the same with e5m2 and 57344. Delayed: amax is the largest of
              the tensor's last fp8_amax_history casts (1 as the scale before any), and backward
              casts x and W under their forward's scales.
  rowwise     every operand in e4m3 with a power-of-two scale per group along the matmul's
              reduction dimension: y = q(x, rows) q(W, columns); dx = q(dy, rows) q(W, rows)^T;
              dW = q(x, by token)^T q(dy, by token).
  mxfp8       the same groups cut into blocks of 32 (the last one shorter), each with MX's scale
              2^(floor(log2 amax) - 8) as the element divisor.
db is the sum of dy itself. The head: logits = bf16(ln_f(x)) bf16(wte)^T, its backward from
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
from oracle_bf16 import Bf16Attention, read_safetensors

FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def pow2_scale(amax, fmt):
    """the power of two at or below fmax / amax, the division in float32 as the C code's"""
    fmax = FORMATS[fmt][1]
    return 2.0 ** math.floor(math.log2(np.float32(fmax) / np.float32(amax))) if amax > 0 else 1.0


def on_grid(x, fmt, scale, operand, values=None):
    """x (scale broadcast over it) cast to fmt, saturating, and divided back; the recipe counts what
    saturated and what underflowed, for operand (0 input, 1 weight, 2 output gradient)"""
    dtype, fmax = FORMATS[fmt]
    scaled = (x * scale).float().numpy()
    v = np.clip(scaled, -fmax, fmax).astype(dtype).astype(np.float64)
    RECIPE.count(operand, np.abs(scaled) > fmax, (x.numpy() != 0) & (v == 0), values or x.numel())
    return torch.from_numpy(v) / scale


def amax_of(x):
    return float(np.float32(x.abs().max().item()))


def grouped(x, dim, mx, operand):
    """x (2-D) on the e4m3 grid with a scale per group along dim: the whole line (rowwise) or
    blocks of 32 of it (MX)"""
    t = x.movedim(dim, -1)
    lines, n = t.shape
    group = 32 if mx else n
    pad = -n % group
    g = F.pad(t, (0, pad)).reshape(lines, -1, group)
    amax = g.abs().amax(-1, keepdim=True).float().double()
    if mx:
        exp = torch.floor(torch.log2(amax.clamp_min(2.0 ** -149))) - 8
        scale = torch.where(amax > 0, 2.0 ** -exp.clamp(-127, 127), torch.full_like(amax, 2.0 ** 127))
    else:
        scale = torch.tensor([[[pow2_scale(float(a), "e4m3")] for a in row] for row in amax.flatten(1).tolist()],
                             dtype=torch.float64)
    q = on_grid(g, "e4m3", scale, operand, values=t.numel()).reshape(lines, -1)[:, :n]  # the padding: no values
    return q.movedim(-1, dim)


class Recipe:
    """which recipe, and delayed scaling's histories: (linear, operand) -> its last amaxes"""
    def __init__(self, cfg):
        self.precision = cfg["precision"]
        self.delayed = cfg.get("fp8_scaling", "current") == "delayed"
        self.length = cfg.get("fp8_amax_history", 16)
        self.histories = {}
        self.clips = np.zeros((3, 3))  # per operand: saturated, underflowed, values cast
        self.steps = []                # per training step: the shares saturated and underflowed

    def count(self, operand, saturated, flushed, values):
        self.clips[operand] += [saturated.sum(), flushed.sum(), values]

    def record_step(self):
        """the step's shares since the last record, as fp8_step_stats takes them"""
        values = np.maximum(self.clips[:, 2], 1)
        self.steps.append((self.clips[:, 0] / values, self.clips[:, 1] / values))
        self.clips[:] = 0

    def tensor_scale(self, x, fmt, key):
        amax = amax_of(x)
        if not self.delayed:
            return pow2_scale(amax, fmt)
        h = self.histories.setdefault(key, [])
        scale = pow2_scale(max(h, default=0.0), fmt)
        self.histories[key] = (h + [amax])[-self.length:]
        return scale


RECIPE = None
def bf16(x):
    return x.float().to(torch.bfloat16).double()


class Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, name):  # Conv1D: x (.., in) @ w (in, out)
        x2 = x.reshape(-1, x.shape[-1])
        ctx.name, ctx.shape = name, x.shape
        ctx.save_for_backward(x2, w)
        if RECIPE.precision == "fp8-tensorwise":
            ctx.sx, ctx.sw = RECIPE.tensor_scale(x2, "e4m3", (name, "x")), RECIPE.tensor_scale(w, "e4m3", (name, "w"))
            y = on_grid(x2, "e4m3", ctx.sx, 0) @ on_grid(w, "e4m3", ctx.sw, 1)
        else:
            mx = RECIPE.precision == "mxfp8"
            y = grouped(x2, 1, mx, 0) @ grouped(w, 0, mx, 1)
        return (y + b).reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        if RECIPE.precision == "fp8-tensorwise":
            dyq = on_grid(dy2, "e5m2", RECIPE.tensor_scale(dy2, "e5m2", (ctx.name, "dy")), 2)
            xq, wq = on_grid(x2, "e4m3", ctx.sx, 0), on_grid(w, "e4m3", ctx.sw, 1)  # cast again, as fp8.c does
            dx, dw = dyq @ wq.t(), xq.t() @ dyq
        else:
            mx = RECIPE.precision == "mxfp8"
            dx = grouped(dy2, 1, mx, 2) @ grouped(w, 1, mx, 1).t()
            dw = grouped(x2, 0, mx, 0).t() @ grouped(dy2, 0, mx, 2)
        return dx.reshape(ctx.shape), dw, dy2.sum(0), None


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
    lin = lambda h, n: Fp8Linear.apply(h, p[n + ".weight"], p[n + ".bias"], n)
    h = p["transformer.wte.weight"][x] + p["transformer.wpe.weight"][:x.shape[1]]
    for i in range(L):
        b = f"transformer.h.{i}."
        q, k, v = lin(ln(h, b + "ln_1"), b + "attn.c_attn").split(C, dim=2)
        h = h + lin(Bf16Attention.apply(q, k, v, H, bf16), b + "attn.c_proj")  # attention in bf16, as in bf16-mixed
        h = h + lin(F.gelu(lin(ln(h, b + "ln_2"), b + "mlp.c_fc"), approximate="tanh"), b + "mlp.c_proj")
    return Bf16Head.apply(ln(h, "transformer.ln_f"), p["transformer.wte.weight"])


def compare_clips(ours, ref, run):
    """metrics.jsonl's fp8_saturated and fp8_underflow, each step and operand, against the
    reference's shares: within 1e-4 and 2% (a value on a rounding boundary in float64 lands on its
    other side in fp32 now and then)"""
    gaps = [abs(o - r) - (1e-4 + 0.02 * r)
            for rec, (sat, flushed) in zip(ours, ref)
            for key, shares in (("fp8_saturated", sat), ("fp8_underflow", flushed))
            for o, r in zip(rec.get(key, [float("inf")] * 3), shares)]
    worst = max(gaps, default=float("inf"))
    ot.check(len(ref) == len(ours) and worst <= 0,
             f"fp8_saturated and fp8_underflow at {len(ref)} steps within 1e-4 + 2% (worst excess {worst:.2e}; "
             f"last step ours {[ours[-1].get(k) for k in ('fp8_saturated', 'fp8_underflow')]}, reference "
             f"{[list(np.round(v, 6)) for v in ref[-1]]})", run)


def main():
    torch.set_num_threads(1)
    global RECIPE
    cfg = json.load(open(sys.argv[1]))
    RECIPE = Recipe(cfg)
    init_dir, run_dir = sys.argv[2], sys.argv[3]
    p = {name: t.double() for name, t in read_safetensors(os.path.join(init_dir, "model.safetensors")).items()}
    learning_rate = ot.learning_rate  # train() asks it once a step, after the backward: the step's record
    ot.learning_rate = lambda *args: (RECIPE.record_step(), learning_rate(*args))[1]
    ref = ot.train(cfg, p, {"forward": gpt2_fp8_logits, "H": cfg["n_head"], "L": cfg["n_layer"]})
    ours = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    # a value that lands on a tie of the FP8 or bf16 grid in one computation and beside it in the
    # other (fp32 against float64) rounds apart, and the gap grows with the steps: test_fp8 passes
    # 1e-4 over 6 steps (measured up to 4.7e-5 on val_loss and 2.5e-4 on the gradient norm since
    # attention's products round the probabilities and their gradients to bf16 too; 1.3e-5 before;
    # bf16-mixed on the same run strays to 1.3e-4 on the loss, 1.9e-3 on the gradient norm). A scale per row flips with its row's amax near a
    # power of two, a whole row rounding apart: the test passes a looser bound for the other
    # recipes (rowwise measured 6.6e-5 on the loss, 5.7e-4 on the gradient norm by step 3), and
    # the first step, before any update has carried a gap, is held to 1e-5 and 1e-4 (measured
    # 1.8e-6 and 1.6e-5)
    run = os.path.basename(run_dir) + ": "
    ot.compare(ours, ref, cfg, run, loss_tol=float(sys.argv[4]) if len(sys.argv) > 4 else 3e-5)
    first = [abs(ours[0][k] - ref[0][k]) / abs(ref[0][k]) for k in ("loss", "grad_norm")] if ours else [1, 1]
    ot.check(first[0] <= 1e-5 and first[1] <= 1e-4,
             f"step 1: loss within 1e-5 and gradient norm within 1e-4 (gaps {first[0]:.1e}, {first[1]:.1e})", run)
    compare_clips(ours, RECIPE.steps, os.path.basename(run_dir) + ": ")
    print(f"{cfg['precision']} ({cfg.get('fp8_scaling', 'current')}) reference: loss {ref[0]['loss']:.6f} -> {ref[-1]['loss']:.6f}")
    sys.exit(1 if ot.failures else 0)


if __name__ == "__main__":
    main()
