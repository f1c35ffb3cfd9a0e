"""tests/oracle_step.py: what the transformers oracles (oracle_phi.py, oracle_llama.py) share: the
checks and their count, our --oracle run (tests/oracle_step.h), and the comparison of its one
training step -- logits, loss, per-tensor gradient norms, the weights after one AdamW step, and
the checkpoint we saved loaded back into transformers -- against the same step in PyTorch."""
import copy
import json
import os
import subprocess

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

# the AdamW step of tests/oracle_step.h (ORACLE_*)
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
failures = 0


def check(cond, what):
    global failures
    print(("ok: " if cond else "FAIL: ") + what)
    failures += 0 if cond else 1


def close(ours, theirs, rtol, atol):
    return np.allclose(ours, theirs, rtol=rtol, atol=atol)


def run_ours(binary, ckpt, x, y):
    """tokens.bin into ckpt, then our --oracle run there; True when it succeeded"""
    B, T = x.shape
    np.concatenate([[B, T], x.flatten().numpy(), y.flatten().numpy()]).astype(np.int32).tofile(
        os.path.join(ckpt, "tokens.bin"))
    run = subprocess.run([binary, "--oracle", ckpt], capture_output=True, text=True)
    check(run.returncode == 0, f"our --oracle run on {os.path.basename(ckpt)} exits 0 ({run.stderr.strip()[-300:]})")
    return run.returncode == 0


def our_logits(ckpt, x):
    B, T = x.shape
    return np.fromfile(os.path.join(ckpt, "logits.bin"), dtype=np.float32).reshape(B, T, -1)


def check_stored_dtypes(binary, work, model, x, y, shard_size):
    """fp16 and bf16 files, in shards of shard_size with model.safetensors.index.json: our logits
    equal those of transformers' model with the weights rounded the same way"""
    for dtype in (torch.float16, torch.bfloat16):
        ckpt = os.path.join(work, str(dtype).split(".")[1])
        rounded = copy.deepcopy(model)
        with torch.no_grad():
            for p in rounded.parameters():
                p.copy_(p.to(dtype).float())
        copy.deepcopy(model).to(dtype).save_pretrained(ckpt, safe_serialization=True, max_shard_size=shard_size)
        shards = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
        check(len(shards) > 1 and os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")),
              f"transformers saved {dtype} in {len(shards)} shards with an index")
        if not run_ours(binary, ckpt, x, y):
            continue
        ours, theirs = our_logits(ckpt, x), rounded(input_ids=x.long()).logits.detach().numpy()
        check(close(ours, theirs, 1e-5, 1e-5),
              f"{dtype} shards: logits equal transformers' (max |diff| {float(np.abs(ours - theirs).max()):.3g})")


def compare_step(model, model_class, ckpt, x, y):
    """our run in ckpt (run_ours) against model's: logits, the step, the resaved checkpoint"""
    V = model.config.vocab_size
    ours = our_logits(ckpt, x)
    logits = model(input_ids=x.long()).logits
    theirs = logits.detach().numpy()
    diff = float(np.abs(ours - theirs).max())
    check(close(ours, theirs, 1e-5, 1e-5), f"logits equal transformers' (max |diff| {diff:.3g})")

    grads = json.load(open(os.path.join(ckpt, "grads.json")))
    loss = F.cross_entropy(logits.reshape(-1, V), y.flatten().long())
    check(abs(grads["loss"] - loss.item()) <= 1e-5 * abs(loss.item()),
          f"loss {grads['loss']:.9g} = transformers' {loss.item():.9g}")
    model.train()
    model.zero_grad()
    loss = F.cross_entropy(model(input_ids=x.long()).logits.reshape(-1, V), y.flatten().long())
    loss.backward()
    bad = [n for n, p in model.named_parameters()
           if abs(grads[n] - p.grad.norm().item()) > 1e-5 * p.grad.norm().item() + 1e-7]
    check(not bad and len(grads) == 1 + len(list(model.parameters())),
          f"per-tensor gradient norms equal transformers' ({len(grads) - 1} tensors; differ: {bad[:3]})")

    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    # Adam's first step moves each weight by about lr * sign(grad). A gradient that is zero in
    # exact arithmetic is rounding noise in both implementations, and its sign is a coin toss (in
    # phi, the key bias's dims past rotary_dim add the same score to every key, which softmax
    # cancels). Those elements are left out of the comparison (and counted).
    noise = {n: (p.grad.abs() < 1e-7).numpy() for n, p in model.named_parameters()}
    opt.step()
    stepped = load_file(os.path.join(ckpt, "stepped", "model.safetensors"))
    bad = [n for n, p in model.named_parameters()
           if not close(stepped[n].numpy()[~noise[n]], p.detach().numpy()[~noise[n]], 1e-4, 1e-6)]
    skipped = {n: int(m.sum()) for n, m in noise.items() if m.any()}
    check(not bad,
          f"weights after one AdamW step equal transformers' (differ: {bad[:3]}; zero-gradient elements "
          f"left out: {skipped})")

    resaved = model_class.from_pretrained(os.path.join(ckpt, "resaved"), attn_implementation="eager").eval()
    again = resaved(input_ids=x.long()).logits.detach().numpy()
    check(close(ours, again, 1e-5, 1e-5), "a checkpoint we saved loads in transformers with our logits")
