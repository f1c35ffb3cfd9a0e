#!/usr/bin/python3
"""The PyTorch side of tests/test_train_oracle.sh: stage 01's whole training loop, written again
here from what the workbook says it does, in float64, sharing no code with the C.

usage: /usr/bin/python3 tests/oracle_train.py data OUT.json
       /usr/bin/python3 tests/oracle_train.py check CONFIG.json INIT_DIR RUN_DIR [RUN_DIR ...]

`data` writes a small alpaca file: records with and without an input (the two prompt templates),
answers of different lengths (batches of different padded lengths) and one answer that
max_seq_len cuts (no end-of-text). `check` trains from the weights stage 01 saved in INIT_DIR
(model.safetensors of a run with stop_iteration 0) on the records of CONFIG.json's data_path, with CONFIG.json's
hyper-parameters, and compares every step's loss, lr, grad_norm and val_loss with each RUN_DIR's
metrics.jsonl; it prints "RUN_DIR: ok: ..." or "RUN_DIR: FAIL: ..." per check.

What is computed here, not read from the C: the prompt template, byte tokens and the prompt mask;
the held-out split and each epoch's sample order (the splitmix64 shuffles alpaca.h describes);
the model (GPT-2 or phi, by the checkpoint's tensor names); the loss as the mean over the global
batch's targets (what gradient accumulation must add up to); the learning rate (linear warm-up,
then cosine to min_lr); the gradient norm and its clipping; AdamW with bias correction, weight
decay on the matrices only; with "optimizer": "muon", Muon on the blocks' matrices (momentum,
Nesterov, five Newton-Schulz iterations, the shape's scale) and AdamW on the rest; validation over
the held-out split's first batches.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from oracle_bf16 import read_safetensors  # the fixtures' reader: float32 tensors by name

MASK64 = (1 << 64) - 1
EOT, VOCAB = 256, 257  # the byte tokenizer: one token per byte, then <|endoftext|>
WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
              "context. Write a response that appropriately completes the request.\n\n"
              "### Instruction:\n{}\n\n### Input:\n{}\n\n### Response:\n")
NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
            "completes the request.\n\n### Instruction:\n{}\n\n### Response:\n")
failures = 0


def check(cond, what, run=""):
    global failures
    print(run + ("ok: " if cond else "FAIL: ") + what)
    failures += 0 if cond else 1


# ---- data ---------------------------------------------------------------------------------------

def write_data(path):
    records = []
    for k in range(64):
        digits = "".join(str((k * 7 + i * 3) % 10) for i in range(3 + k % 5))
        answer = "".join(sorted(digits)) * (1 + k % 3)
        if k == 5:
            answer = "the answer is long enough that max_seq_len cuts it off " * 2
        records.append({"instruction": ["Sort the digits.", "Repeat it."][k % 2],
                        "input": digits if k % 4 else "", "output": answer})
    json.dump(records, open(path, "w"), indent=1)


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def shuffled(n, state):
    """Fisher-Yates from the last position down, j = next % (i + 1)"""
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        state, r = splitmix64(state)
        j = r % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def tokenize(record, max_seq_len):
    """(ids, prompt_len): bytes of prompt + answer cut at max_seq_len, then end-of-text if room"""
    template = WITH_INPUT.format(record["instruction"], record["input"]) if record["input"] else \
        NO_INPUT.format(record["instruction"])
    prompt = list(template.encode())
    ids = (prompt + list(record["output"].encode()))[:max_seq_len]
    if len(ids) < max_seq_len:
        ids.append(EOT)
    return ids, min(len(prompt), len(ids))


def load_splits(cfg):
    records = json.load(open(cfg["data_path"]))
    n = len(records)
    n_val = int(cfg["val_fraction"] * n + 0.5)
    held_out = set(shuffled(n, 0x5EED5EED)[:n_val])
    toks = [tokenize(r, cfg["max_seq_len"]) for r in records]
    return ([toks[k] for k in range(n) if k not in held_out], [toks[k] for k in range(n) if k in held_out])


def global_batch(split_tokens, split, seed, epoch, b, G, max_seq_len):
    """inputs, targets (-100: no loss) of global batch b of the epoch, right-padded to a multiple of 8"""
    order = shuffled(len(split_tokens), ((seed * 0x9E3779B97F4A7C15) & MASK64) ^ (epoch << 1 | split))
    rows = [split_tokens[i] for i in order[b * G:(b + 1) * G]]
    T = min(max(8, -(-max(len(ids) - 1 for ids, _ in rows) // 8) * 8), max_seq_len)
    x = torch.zeros(G, T, dtype=torch.long)
    y = torch.full((G, T), -100, dtype=torch.long)
    for r, (ids, prompt_len) in enumerate(rows):
        n = len(ids) - 1
        x[r, :n] = torch.tensor(ids[:n])
        for pos in range(n):
            if pos + 1 >= prompt_len:  # the prompt's own tokens are not predicted
                y[r, pos] = ids[pos + 1]
    return x, y


# ---- the model ----------------------------------------------------------------------------------

def attention(q, k, v, H):
    B, T, C = q.shape
    q, k, v = (z.view(B, T, H, C // H).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    return (att @ v).transpose(1, 2).reshape(B, T, C)


def gpt2_logits(p, x, H, L):
    """GPT-2: learned positions, pre-LayerNorm blocks, Conv1D weights (in, out), tied head"""
    C = p["transformer.wte.weight"].shape[1]
    ln = lambda h, n: F.layer_norm(h, (C,), p[n + ".weight"], p[n + ".bias"], 1e-5)
    conv = lambda h, n: h @ p[n + ".weight"] + p[n + ".bias"]
    h = p["transformer.wte.weight"][x] + p["transformer.wpe.weight"][:x.shape[1]]
    for i in range(L):
        b = f"transformer.h.{i}."
        q, k, v = conv(ln(h, b + "ln_1"), b + "attn.c_attn").split(C, dim=2)
        h = h + conv(attention(q, k, v, H), b + "attn.c_proj")
        h = h + conv(F.gelu(conv(ln(h, b + "ln_2"), b + "mlp.c_fc"), approximate="tanh"), b + "mlp.c_proj")
    return ln(h, "transformer.ln_f") @ p["transformer.wte.weight"].t()


def rotate(z, H, rot):
    """phi's rotary embedding on the first `rot` dims of each head, in rotate_half's layout"""
    B, T, C = z.shape
    z = z.view(B, T, H, C // H)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = (torch.cat([f(angle)] * 2, -1)[None, :, None, :] for f in (torch.cos, torch.sin))
    zr, rest = z[..., :rot], z[..., rot:]
    half = torch.cat([-zr[..., rot // 2:], zr[..., :rot // 2]], -1)
    return torch.cat([zr * cos + half * sin, rest], -1).reshape(B, T, C)


def phi_logits(p, x, H, L):
    """phi-1_5: no position table, rotary on half of each head, one LayerNorm feeding attention and
    the MLP in parallel, an untied head with a bias"""
    C = p["model.embed_tokens.weight"].shape[1]
    ln = lambda h, n: F.layer_norm(h, (C,), p[n + ".weight"], p[n + ".bias"], 1e-5)
    lin = lambda h, n: h @ p[n + ".weight"].t() + p[n + ".bias"]
    rot = C // H // 2
    h = p["model.embed_tokens.weight"][x]
    for i in range(L):
        b = f"model.layers.{i}."
        a = ln(h, b + "input_layernorm")
        q, k = (rotate(lin(a, b + f"self_attn.{n}_proj"), H, rot) for n in "qk")
        att = lin(attention(q, k, lin(a, b + "self_attn.v_proj"), H), b + "self_attn.dense")
        mlp = lin(F.gelu(lin(a, b + "mlp.fc1"), approximate="tanh"), b + "mlp.fc2")
        h = h + att + mlp
    return lin(ln(h, "model.final_layernorm"), "lm_head")


def mean_loss(p, x, y, model):
    logits = model["forward"](p, x, model["H"], model["L"])[..., :VOCAB]  # the padding rows are no words
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum"), \
        int((y >= 0).sum())


# ---- the optimisation ---------------------------------------------------------------------------

def learning_rate(cfg, step, steps):
    """linear warm-up to lr over warmup_steps (the first step already at lr/warmup_steps), then a
    half cosine from lr at the first step after warm-up to min_lr at the last step"""
    lr, warm = cfg["lr"], cfg["warmup_steps"]
    if step < warm:
        return lr * (step + 1) / warm
    span = steps - warm - 1
    if span <= 0:
        return lr
    return cfg["min_lr"] + (lr - cfg["min_lr"]) * (1 + math.cos(math.pi * min(1.0, (step - warm) / span))) / 2


def adamw(p, grads, state, t, lr, cfg, names):
    """AdamW (Loshchilov and Hutter) on the tensors named: decay (matrices only) from the weight
    before the step"""
    b1, b2 = cfg["beta1"], cfg["beta2"]
    for name in names:
        w, g = p[name], grads[name]
        m, v = state.setdefault(name, (torch.zeros_like(w), torch.zeros_like(w)))
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        state[name] = (m, v)
        decay = cfg["weight_decay"] if w.dim() == 2 else 0.0
        step = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + cfg["eps"])
        p[name] = w - lr * (step + decay * w)


def muon_trains(name, w):
    """Muon's tensors: a block's matrices (GPT-2's transformer.h.*, phi's model.layers.*); the
    embeddings, the head, norms and biases stay with AdamW, as the published recipe has it"""
    return w.dim() == 2 and (".h." in name or ".layers." in name)


def newton_schulz(g, steps):
    """Muon's orthogonalization (Keller Jordan's zeropower_via_newtonschulz5, in float64 here): the
    quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, on the wide orientation, from X scaled
    to Frobenius norm 1"""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.t()
    for _ in range(steps):
        A = x @ x.t()
        x = a * x + (b * A + c * A @ A) @ x
    return x.t() if tall else x


def muon(p, grads, state, lr, cfg, conv1d):
    """Muon on the block matrices: momentum by lerp, Nesterov's look-ahead, the orthogonalized
    update scaled by sqrt(max(1, out/in)), decoupled weight decay; its lr is muon_lr on lr's
    schedule. GPT-2's Conv1D weights are stored (in, out): taken as (out, in) for the shape."""
    beta, nesterov = cfg.get("muon_momentum", 0.95), cfg.get("muon_nesterov", True)
    mlr = cfg.get("muon_lr", 0.02) * lr / cfg["lr"]
    for name in (n for n, w in p.items() if muon_trains(n, w)):
        g = grads[name].t() if conv1d else grads[name]
        buf = state.get(name, torch.zeros_like(g)).lerp(g, 1 - beta)
        state[name] = buf
        update = g.lerp(buf, beta) if nesterov else buf
        out, inp = update.shape
        o = newton_schulz(update, cfg.get("muon_ns_steps", 5)) * max(1.0, out / inp) ** 0.5
        p[name] = p[name] * (1 - mlr * cfg["weight_decay"]) - mlr * (o.t() if conv1d else o)


def validation_loss(p, val, cfg, model):
    total, count = 0.0, 0
    batches = min(len(val) // cfg["global_batch_size"], cfg["eval_batches"])
    with torch.no_grad():
        for b in range(batches):
            x, y = global_batch(val, 1, cfg["seed"], 0, b, cfg["global_batch_size"], cfg["max_seq_len"])
            s, n = mean_loss(p, x, y, model)
            total, count = total + s.item(), count + n
    return total / count


def train(cfg, p, model):
    """one record per step: loss, lr, grad_norm and (at evaluations and the last step) val_loss"""
    train_split, val = load_splits(cfg)
    G = cfg["global_batch_size"]
    per_epoch = len(train_split) // G
    steps = per_epoch * cfg["num_epochs"]
    state, log = {}, []
    for step in range(steps):
        x, y = global_batch(train_split, 0, cfg["seed"], step // per_epoch, step % per_epoch, G, cfg["max_seq_len"])
        leaves = {k: w.clone().requires_grad_(True) for k, w in p.items()}
        s, n = mean_loss(leaves, x, y, model)
        (s / n).backward()
        grads = {k: w.grad for k, w in leaves.items()}
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        if cfg["grad_clip"] > 0 and norm > cfg["grad_clip"]:
            grads = {k: g * (cfg["grad_clip"] / norm) for k, g in grads.items()}
        lr = learning_rate(cfg, step, steps)
        if cfg.get("optimizer", "adamw") == "muon":
            muon(p, grads, state, lr, cfg, conv1d=model["forward"] is gpt2_logits)
            adamw(p, grads, state, step + 1, lr, cfg, [n for n, w in p.items() if not muon_trains(n, w)])
        else:
            adamw(p, grads, state, step + 1, lr, cfg, list(p))
        rec = {"step": step + 1, "loss": s.item() / n, "lr": lr, "grad_norm": norm}
        if (step + 1) % cfg["eval_interval"] == 0 or step + 1 == steps:
            rec["val_loss"] = validation_loss(p, val, cfg, model)
        log.append(rec)
    return log


def compare(ours, ref, cfg, run, loss_tol=None):
    """every step's figures within their tolerances; loss_tol, when given, holds loss and val_loss"""
    check(len(ours) == len(ref), f"{len(ours)} steps logged, the reference ran {len(ref)}", run)
    # Muon's runs are held to 1e-6: its orthogonalization in fp32 against float64 is the figure
    tight = loss_tol or (1e-6 if cfg.get("optimizer") == "muon" else 1e-5)
    tol = {"loss": tight, "lr": 1e-5, "grad_norm": max(1e-4, 4 * tight), "val_loss": tight}
    for key, limit in tol.items():
        pairs = [(o.get(key), r[key], r["step"]) for o, r in zip(ours, ref) if key in r]
        missing = [step for o, _, step in pairs if o is None]
        gaps = [(abs(o - r) / abs(r), step) for o, r, step in pairs if o is not None]
        worst, at = max(gaps) if gaps else (float("inf"), 0)
        check(not missing and worst <= limit,
              f"{key} at {len(pairs)} steps within {limit:g} (largest relative gap {worst:.2e} at step {at}"
              f"{', missing at steps ' + str(missing) if missing else ''})", run)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "data":
        write_data(sys.argv[2])
        return
    if len(sys.argv) < 5 or sys.argv[1] != "check":
        sys.exit(__doc__)
    torch.set_num_threads(1)
    cfg = json.load(open(sys.argv[2]))
    init_dir, run_dirs = sys.argv[3], sys.argv[4:]
    p = {name: t.double() for name, t in read_safetensors(os.path.join(init_dir, "model.safetensors")).items()}
    phi = "lm_head.weight" in p
    model = {"forward": phi_logits if phi else gpt2_logits, "H": cfg["n_head"], "L": cfg["n_layer"]}
    ref = train(cfg, p, model)
    clipped = sum(r["grad_norm"] > cfg["grad_clip"] for r in ref)
    check(0 < clipped < len(ref), f"the run has clipped and unclipped steps ({clipped} of {len(ref)} clipped)")
    warm = cfg["warmup_steps"]
    check(0 < warm < len(ref) - 2, f"the run covers warm-up ({warm} steps) and decay")
    for run_dir in run_dirs:
        ours = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        compare(ours, ref, cfg, os.path.basename(run_dir) + ": ")
    print(f"{'phi' if phi else 'gpt2'}: loss {ref[0]['loss']:.6f} -> {ref[-1]['loss']:.6f}, "
          f"norms {min(r['grad_norm'] for r in ref):.3f}..{max(r['grad_norm'] for r in ref):.3f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
