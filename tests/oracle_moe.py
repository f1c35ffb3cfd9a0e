"""The PyTorch side of tests/test_moe_oracle.sh.

usage: PYTHON tests/oracle_moe.py OUR_BINARY WORKDIR   (PYTHON: the oracle venv, torch + safetensors)

For each case (k = 1 and 2, a capacity that drops pairs and none, every block or every second
block a MoE) writes a random tiny MoE GPT-2 checkpoint with our tensor names (model.safetensors,
config.json with num_local_experts, num_experts_per_tok, moe_every, and the run's capacity_factor
and router_aux_loss_coef) and a batch (tokens.bin), runs `OUR_BINARY --oracle DIR`
(tests/test_moe.c) and recomputes everything in float64 with a GPT-2 and a Mixtral-style sparse
MoE block written here (the capacity and dropping too) and autograd: each MoE block's router
probabilities, chosen experts and dropped pairs, the logits, the loss, the load-balancing loss,
the gradient of every tensor of CE + coef x mean aux, and the experts' keys of the config.json we
save. Without a capacity, the reference's sparse block and aux loss are checked against
transformers' MixtralSparseMoeBlock and load_balancing_loss_func. Prints "ok: ..." or "FAIL: ..."
per check.
"""
import json
import math
import os
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import save_file
from safetensors.torch import load_file

VALUE_RTOL, GRAD_RTOL = 1e-5, 1e-4
failures = 0


def check(cond, what):
    global failures
    print(("ok: " if cond else "FAIL: ") + what)
    failures += 0 if cond else 1


def worst_error(ours, ref, rtol):
    """the largest |ours - ref| in units of the tolerance rtol x (|ref| + a floor of 10% of the
    tensor's largest |ref|): <= 1 passes. The floor holds elements near zero to the tensor's scale,
    where float32's rounding is (a logit of 0.007 among logits of 4 is off by 2e-6)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    floor = 0.1 * max(np.abs(ref).max(), 1e-30)
    return float((np.abs(ours - ref) / (rtol * (np.abs(ref) + floor))).max())


def check_close(ours, ref, rtol, what):
    if np.shape(ours) != np.shape(ref):
        check(False, f"{what}: shape {np.shape(ours)}, expected {np.shape(ref)}")
        return
    err = worst_error(ours, ref, rtol)
    check(err <= 1, f"{what} within {rtol:g} (worst {err * rtol:.1e})")


# ---- the model: parameters in Hugging Face's layout (Conv1D weights (in, out)) ---------------------

def is_moe(case, l):
    return (l + 1) % case["moe_every"] == 0


def random_params(case, gen):
    C, V, L, E, maxT = case["C"], case["V"], case["L"], case["E"], case["maxT"]

    def randn(*shape, scale=0.2, mean=0.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + mean).float().numpy()

    # biases and LayerNorms random too, so that a misplaced one shows; the router larger, so that
    # float32 and float64 agree on every top-k
    p = {"transformer.wte.weight": randn(V, C), "transformer.wpe.weight": randn(maxT, C, scale=0.1),
         "transformer.ln_f.weight": randn(C, scale=0.1, mean=1.0), "transformer.ln_f.bias": randn(C, scale=0.1)}
    for l in range(L):
        h = f"transformer.h.{l}."
        p.update({h + "ln_1.weight": randn(C, scale=0.1, mean=1.0), h + "ln_1.bias": randn(C, scale=0.1),
                  h + "attn.c_attn.weight": randn(C, 3 * C), h + "attn.c_attn.bias": randn(3 * C, scale=0.1),
                  h + "attn.c_proj.weight": randn(C, C), h + "attn.c_proj.bias": randn(C, scale=0.1),
                  h + "ln_2.weight": randn(C, scale=0.1, mean=1.0), h + "ln_2.bias": randn(C, scale=0.1)})
        mlps = [h + f"mlp.experts.{e}." for e in range(E)] if is_moe(case, l) else [h + "mlp."]
        if is_moe(case, l):
            p[h + "mlp.gate.weight"] = randn(E, C, scale=1.0)  # nn.Linear: (out, in)
        for m in mlps:
            p.update({m + "c_fc.weight": randn(C, 4 * C), m + "c_fc.bias": randn(4 * C, scale=0.1),
                      m + "c_proj.weight": randn(4 * C, C, scale=0.1), m + "c_proj.bias": randn(C, scale=0.1)})
    return p


def mlp(p, prefix, x):
    h = F.gelu(x @ p[prefix + "c_fc.weight"] + p[prefix + "c_fc.bias"], approximate="tanh")
    return h @ p[prefix + "c_proj.weight"] + p[prefix + "c_proj.bias"]


def kept_pairs(choice, capacity, E):
    """(B, T, k) bool: which token-expert pairs fit, per sequence, token by token in position
    order, at most `capacity` per expert (0: no limit)"""
    B, T, k = choice.shape
    kept = torch.zeros(B, T, k, dtype=torch.bool)
    for b in range(B):
        used = [0] * E
        for t in range(T):
            for j in range(k):
                e = int(choice[b, t, j])
                if not capacity or used[e] < capacity:
                    kept[b, t, j] = True
                    used[e] += 1
    return kept


def sparse_moe(p, prefix, x, case):
    """Mixtral's sparse block with a capacity: x (B, T, C) -> (out, probs, choice, kept, aux summed
    over the sequences)"""
    B, T, C = x.shape
    E, k = case["E"], case["k"]
    probs = F.softmax(x @ p[prefix + "gate.weight"].T, dim=-1)
    top, choice = torch.topk(probs, k, dim=-1)
    weight = top / top.sum(dim=-1, keepdim=True)
    capacity = math.ceil(case["capacity_factor"] * T * k / E) if case["capacity_factor"] > 0 else 0
    kept = kept_pairs(choice, capacity, E)
    out = torch.zeros_like(x).reshape(B * T, C)
    flat_x, flat_choice, flat_kept, flat_w = x.reshape(B * T, C), choice.reshape(B * T, k), kept.reshape(B * T, k), weight.reshape(B * T, k)
    for e in range(E):
        token, j = torch.nonzero((flat_choice == e) & flat_kept, as_tuple=True)
        if len(token):
            y = mlp(p, prefix + f"experts.{e}.", flat_x[token])
            out = out.index_add(0, token, flat_w[token, j, None] * y)
    # aux = E sum_e f_e P_e per sequence; f (every choice, kept or not) carries no gradient
    f = F.one_hot(choice, E).sum(dim=2).double().mean(dim=1)  # (B, E)
    aux = (E * (f * probs.mean(dim=1)).sum(dim=-1)).sum()
    return out.reshape(B, T, C), probs, choice, kept, aux


def attention(p, prefix, x, n_head):
    B, T, C = x.shape
    q, k, v = (x @ p[prefix + "c_attn.weight"] + p[prefix + "c_attn.bias"]).split(C, dim=-1)
    q, k, v = (z.reshape(B, T, n_head, C // n_head).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-1, -2)) / math.sqrt(C // n_head)
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    return y @ p[prefix + "c_proj.weight"] + p[prefix + "c_proj.bias"]


def forward(p, case, x, y):
    """the logits, mean CE, mean aux and, per MoE block, (probs, choice, kept)"""
    T = x.shape[1]
    h = p["transformer.wte.weight"][x] + p["transformer.wpe.weight"][:T]
    ln = lambda z, name: F.layer_norm(z, z.shape[-1:], p[name + ".weight"], p[name + ".bias"], 1e-5)
    routing, aux = {}, 0
    for l in range(case["L"]):
        pre = f"transformer.h.{l}."
        h = h + attention(p, pre + "attn.", ln(h, pre + "ln_1"), case["n_head"])
        if is_moe(case, l):
            out, probs, choice, kept, block_aux = sparse_moe(p, pre + "mlp.", ln(h, pre + "ln_2"), case)
            routing[l] = (probs, choice, kept)
            aux = aux + block_aux
        else:
            out = mlp(p, pre + "mlp.", ln(h, pre + "ln_2"))
        h = h + out
    logits = ln(h, "transformer.ln_f") @ p["transformer.wte.weight"].T
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-1)
    return logits, ce, aux / (x.shape[0] * len(routing)), routing


# ---- the reference against transformers' Mixtral --------------------------------------------------

class GPT2Expert(torch.nn.Module):
    """one of our experts, as a module MixtralSparseMoeBlock can call"""

    def __init__(self, p, prefix):
        super().__init__()
        self.p, self.prefix = p, prefix

    def forward(self, x):
        return mlp(self.p, self.prefix, x)


def check_reference_against_mixtral(case):
    """Without a capacity, sparse_moe above is transformers' MixtralSparseMoeBlock with our experts
    plugged in, and its aux loss is load_balancing_loss_func's, summed over the sequences (Mixtral's
    routes in float32: VALUE_RTOL)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func
    gen = torch.Generator().manual_seed(case["seed"])
    p = {k: torch.tensor(v, dtype=torch.float64) for k, v in random_params(case, gen).items()}
    B, T, C, E, k = case["B"], case["T"], case["C"], case["E"], case["k"]
    prefix = f"transformer.h.{case['moe_every'] - 1}.mlp."  # the first MoE block
    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=C, intermediate_size=4 * C, num_local_experts=E,
                                                num_experts_per_tok=k)).double().eval()
    with torch.no_grad():
        block.gate.weight.copy_(p[prefix + "gate.weight"])
    block.experts = torch.nn.ModuleList(GPT2Expert(p, prefix + f"experts.{e}.") for e in range(E))
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        theirs, router_logits = block(x)
        ours, _, _, _, aux = sparse_moe(p, prefix, x, case)
        their_aux = sum(load_balancing_loss_func((router_logits.reshape(B, T, E)[b],), E, k) for b in range(B))
    check_close(ours.numpy(), theirs.numpy(), VALUE_RTOL, f"k={k}: the reference's sparse block is Mixtral's")
    check_close(aux.item(), float(their_aux), VALUE_RTOL, f"k={k}: the reference's aux loss is Mixtral's, per sequence")


# ---- one case ----------------------------------------------------------------------------------

def write_case(case, ckpt, params, x, y):
    os.makedirs(ckpt, exist_ok=True)
    save_file(params, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "gpt2", "activation_function": "gelu_new", "n_embd": case["C"], "n_layer": case["L"],
              "n_head": case["n_head"], "vocab_size": case["V"], "n_positions": case["maxT"],
              "num_local_experts": case["E"], "num_experts_per_tok": case["k"], "moe_every": case["moe_every"],
              "capacity_factor": case["capacity_factor"], "router_aux_loss_coef": case["coef"]}
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(config, f)
    B, T = x.shape
    np.concatenate([[B, T], x.flatten().numpy(), y.flatten().numpy()]).astype(np.int32).tofile(
        os.path.join(ckpt, "tokens.bin"))


def read_rows(ckpt, name, dtype, width):
    return np.fromfile(os.path.join(ckpt, name), dtype=dtype).reshape(-1, width)


def run_case(binary, work, case):
    name = case["name"]
    gen = torch.Generator().manual_seed(case["seed"])
    params = random_params(case, gen)
    B, T, V = case["B"], case["T"], case["V"]
    x = torch.randint(0, V, (B, T), generator=gen)
    y = torch.randint(0, V, (B, T), generator=gen)
    y[:, ::5] = -1  # some ignored targets
    ckpt = os.path.join(work, name.replace(" ", "_").replace(",", ""))
    write_case(case, ckpt, params, x, y)
    run = subprocess.run([binary, "--oracle", ckpt], capture_output=True, text=True)
    check(run.returncode == 0, f"{name}: our --oracle run exits 0 ({run.stderr.strip()[-300:]})")
    if run.returncode:
        return

    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    logits, ce, aux, routing = forward(p, case, x, y)
    (ce + case["coef"] * aux).backward()
    ours = json.load(open(os.path.join(ckpt, "result.json")))
    E, k = case["E"], case["k"]
    dropped = 0
    for l, (probs, choice, kept) in routing.items():
        check_close(read_rows(ckpt, f"probs_{l}.bin", np.float32, E), probs.detach().reshape(-1, E).numpy(),
                    VALUE_RTOL, f"{name}: block {l}'s router probabilities")
        our_choice = read_rows(ckpt, f"choice_{l}.bin", np.int32, k)
        check(np.array_equal(our_choice, choice.reshape(-1, k).numpy()), f"{name}: block {l}'s chosen experts, best first")
        our_kept = read_rows(ckpt, f"slot_{l}.bin", np.int32, k) >= 0
        check(np.array_equal(our_kept, kept.reshape(-1, k).numpy()),
              f"{name}: block {l} keeps the same {int(kept.sum())} of {kept.numel()} pairs")
        dropped += int((~kept).sum())
    check(ours["dropped"] == dropped and (dropped > 0) == (case["capacity_factor"] > 0),
          f"{name}: {ours['dropped']} pairs dropped, expected {dropped}")
    check_close(read_rows(ckpt, "logits.bin", np.float32, V), logits.detach().reshape(-1, V).numpy(), VALUE_RTOL,
                f"{name}: logits")
    check_close(ours["loss"], ce.item(), VALUE_RTOL, f"{name}: cross-entropy loss {ce.item():.6f}")
    check_close(ours["aux"], aux.item(), VALUE_RTOL, f"{name}: load-balancing loss {aux.item():.6f}")
    saved = json.load(open(os.path.join(ckpt, "grads", "config.json")))
    keys = {"num_local_experts": "E", "num_experts_per_tok": "k", "moe_every": "moe_every"}
    check(all(saved.get(key) == case[ours] for key, ours in keys.items()),
          f"{name}: the config.json we save names the experts as Mixtral's does "
          f"({ {key: saved.get(key) for key in keys} })")
    grads = load_file(os.path.join(ckpt, "grads", "model.safetensors"))
    check(set(grads) == set(p), f"{name}: our gradients name the {len(p)} tensors ({sorted(set(grads) ^ set(p))[:4]})")
    worst, worst_name = 0.0, ""
    for tensor, param in p.items():
        if tensor not in grads:
            continue
        err = worst_error(grads[tensor].numpy(), param.grad.numpy(), GRAD_RTOL)
        check(err <= 1, f"{name}: gradient of {tensor} within {GRAD_RTOL:g} (worst {err * GRAD_RTOL:.1e})")
        if err > worst:
            worst, worst_name = err, tensor
    print(f"{name}: the worst gradient is {worst_name}'s, at {worst:.2f} of the tolerance")


def main():
    binary, work = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    base = {"C": 32, "n_head": 4, "V": 50, "maxT": 32, "E": 4, "B": 3, "T": 16, "coef": 0.1}
    cases = [
        {"name": "k=2 with dropping", "L": 2, "moe_every": 1, "k": 2, "capacity_factor": 1.0, "seed": 1},
        {"name": "k=1 with dropping", "L": 2, "moe_every": 1, "k": 1, "capacity_factor": 1.0, "seed": 2},
        {"name": "k=2 without capacity, every second block", "L": 3, "moe_every": 2, "k": 2, "capacity_factor": 0.0,
         "seed": 3},
        {"name": "k=1 without capacity", "L": 2, "moe_every": 1, "k": 1, "capacity_factor": 0.0, "seed": 4},
    ]
    for case in cases:
        run_case(binary, work, {**base, **case})
        if case["capacity_factor"] == 0:
            check_reference_against_mixtral({**base, **case})
    print(f"oracle_moe: every case ran ({failures} failed)")


if __name__ == "__main__":
    main()
