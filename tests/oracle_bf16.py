#!/usr/bin/python3
"""The PyTorch side of tests/test_bf16_oracle.sh: our bf16 mixed-precision recipe, written
independently in PyTorch with explicit casts, on the fixture model tiny_gpt2_C8_L2_H2.

usage: /usr/bin/python3 tests/oracle_bf16.py OUT.json

The recipe (stage 02): every matmul (the four linear layers of each block and the tied lm_head)
rounds its input and its weight to bf16 (round to nearest even) and accumulates in f32; its
backward rounds the output gradient to bf16 too, and the weight gradient comes out in f32. The
bias gradient is summed from the f32 gradient. Attention's six products round their operands (q,
k, v, the probabilities, the output gradient and the scores' gradient) to bf16 and accumulate in
f32. LayerNorm, the softmax, GELU, the residual stream and the loss stay in f32. Writes the loss, the global and per-tensor gradient norms, and
the loss after one AdamW step on f32 master weights (the fixture's hyper-parameters).
"""
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.environ.get("FIXTURES", os.path.join(HERE, "..", "..", "shared", "fixtures"))
REF = os.path.join(FIXTURES, "reference")


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


class Bf16Linear(torch.autograd.Function):
    """y = bf16(x) @ bf16(w)^T + b, and a backward that rounds the output gradient to bf16."""

    @staticmethod
    def forward(ctx, x, w, b):
        xr, wr = bf16(x), bf16(w)
        ctx.save_for_backward(xr, wr)
        ctx.has_bias = b is not None
        y = xr @ wr.t()
        return y + b if b is not None else y

    @staticmethod
    def backward(ctx, g):
        xr, wr = ctx.saved_tensors
        gr = bf16(g)
        dx = gr @ wr
        dw = gr.reshape(-1, gr.shape[-1]).t() @ xr.reshape(-1, xr.shape[-1])
        db = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db


class Bf16Attention(torch.autograd.Function):
    """Causal attention with its six products on 16-bit operands (rnd rounds, e.g. bf16 above) and f32
    (or, given wider tensors, wider) sums, the softmax and its backward on the unrounded
    probabilities: q, k, v, the probabilities P, the output gradient and the scores' gradient dS are
    rounded before each product reads them. q, k, v: (B, T, C), H heads."""

    @staticmethod
    def forward(ctx, q, k, v, H, rnd):
        B, T, C = q.shape
        hs = C // H
        qr, kr, vr = (rnd(z).view(B, T, H, hs).transpose(1, 2) for z in (q, k, v))
        s = (qr @ kr.transpose(-2, -1)) / math.sqrt(hs)
        p = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        ctx.save_for_backward(qr, kr, vr, p)
        ctx.rnd = rnd
        return (rnd(p) @ vr).transpose(1, 2).reshape(B, T, C)

    @staticmethod
    def backward(ctx, dout):
        qr, kr, vr, p = ctx.saved_tensors
        rnd = ctx.rnd
        B, H, T, hs = qr.shape
        g = rnd(dout).reshape(B, T, H, hs).transpose(1, 2)
        dp = g @ vr.transpose(-2, -1)
        ds = rnd(p * (dp - (dp * p).sum(-1, keepdim=True)))
        scale = 1 / math.sqrt(hs)
        dq, dk, dv = (ds @ kr) * scale, (ds.transpose(-2, -1) @ qr) * scale, rnd(p).transpose(-2, -1) @ g
        return (*(z.transpose(1, 2).reshape(B, T, H * hs) for z in (dq, dk, dv)), None, None)


def read_safetensors(path):
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        data = bytearray(blob[8 + n + b:8 + n + end])
        out[name] = torch.frombuffer(data, dtype=torch.float32).reshape(e["shape"]).clone()
    return out


def model_params(sd, L):
    """our names (the fixture's) -> tensors in nn.Linear (out, in) layout, requiring grad"""
    t = lambda k: sd.get("transformer." + k, sd.get(k))
    p = {"wte.weight": t("wte.weight"), "wpe.weight": t("wpe.weight"),
         "ln_f.weight": t("ln_f.weight"), "ln_f.bias": t("ln_f.bias")}
    for i in range(L):
        h = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            p[h + ln + ".weight"] = t(h + ln + ".weight")
            p[h + ln + ".bias"] = t(h + ln + ".bias")
        for mine, hf in (("c_attn", "attn.c_attn"), ("attn_proj", "attn.c_proj"),
                         ("c_fc", "mlp.c_fc"), ("mlp_proj", "mlp.c_proj")):
            p[h + mine + ".weight"] = t(h + hf + ".weight").t().contiguous()  # Conv1D -> (out, in)
            p[h + mine + ".bias"] = t(h + hf + ".bias")
    return {k: v.clone().requires_grad_(True) for k, v in p.items()}


def forward(p, x, y, L, H):
    B, T = x.shape
    C = p["wte.weight"].shape[1]
    lin = Bf16Linear.apply
    h = p["wte.weight"][x] + p["wpe.weight"][torch.arange(T)]
    for i in range(L):
        k = lambda n: p[f"h.{i}.{n}"]
        a = F.layer_norm(h, (C,), k("ln_1.weight"), k("ln_1.bias"), 1e-5)
        q, kk, v = lin(a, k("c_attn.weight"), k("c_attn.bias")).split(C, dim=2)
        yy = Bf16Attention.apply(q, kk, v, H, bf16)
        h = h + lin(yy, k("attn_proj.weight"), k("attn_proj.bias"))
        m = F.layer_norm(h, (C,), k("ln_2.weight"), k("ln_2.bias"), 1e-5)
        m = F.gelu(lin(m, k("c_fc.weight"), k("c_fc.bias")), approximate="tanh")
        h = h + lin(m, k("mlp_proj.weight"), k("mlp_proj.bias"))
    h = F.layer_norm(h, (C,), p["ln_f.weight"], p["ln_f.bias"], 1e-5)
    logits = lin(h, p["wte.weight"], None)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    torch.set_num_threads(2)
    ref = json.load(open(os.path.join(REF, "tiny_gpt2_train_step.json")))
    cfg, opt = ref["config"], ref["adamw"]
    L, H = cfg["n_layer"], cfg["n_head"]
    p = model_params(read_safetensors(os.path.join(REF, "tiny_gpt2_C8_L2_H2.safetensors")), L)
    x, y = torch.tensor(ref["x"]), torch.tensor(ref["y"])
    loss = forward(p, x, y, L, H)
    loss.backward()
    norms = {k: v.grad.double().norm().item() for k, v in p.items()}
    total = math.sqrt(sum(n * n for n in norms.values()))
    adamw = torch.optim.AdamW(p.values(), lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]),
                              eps=opt["eps"], weight_decay=opt["weight_decay"])
    adamw.step()
    with torch.no_grad():
        after = forward(p, x, y, L, H)
    json.dump({"recipe": __doc__.split("\n\n")[1], "loss_before": loss.item(),
               "grad_global_norm": total, "grad_norms": norms, "loss_after_1_step": after.item()},
              open(sys.argv[1], "w"), indent=1)
    print(f"bf16 recipe: loss {loss.item():.9g} -> {after.item():.9g}, |g| = {total:.9g}")


if __name__ == "__main__":
    main()
