"""The peft side of tests/test_lora_oracle.sh.

usage: PYTHON tests/oracle_lora.py OUR_TEST_BINARY OUR_MERGE_TOOL WORKDIR   (PYTHON: the oracle venv, with peft)

Builds tests/oracle_llama.py's tiny random Llama (grouped-query attention), wraps it with peft's
get_peft_model (LoRA r 3, lora_alpha 7 on three of its seven linears), gives lora_B random values too (peft starts
it at zero, which would hide A's gradient and the adapters' effect), saves base and adapter with
save_pretrained, runs `OUR_TEST_BINARY --oracle WORKDIR/llama` (tests/test_lora.c) and compares:
the adapted model's logits, the adapters' gradients after one step, the adapter we saved after
one AdamW step loading in peft with our logits, the base weights bit-identical after the step,
and the model our merge tool writes loading in transformers with the adapted logits. Then the
adapters' gradients with lora_dropout 0.1 (r 4, lora_alpha 6 on all seven): peft's lora_dropout
modules replaced by ones applying the masks `OUR_TEST_BINARY --oracle-dropout` drew, so that both
sides drop the same elements. Then the same logits and gradients for GPT-2's module names (r 2,
lora_alpha 5 on two of its three) and phi's (r 5, lora_alpha 3 on all six). The scales alpha / r,
7/3, 1.5, 2.5 and 0.6, are none of them integers. Prints "ok: ..." or "FAIL: ..." per check.
"""
import copy
import os
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, PhiConfig, PhiForCausalLM

import oracle_step
from oracle_llama import tiny_llama
from oracle_step import check, close

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted(base, targets, r, alpha, fan_in_fan_out=False, dropout=0.0):
    """base (left as it is) wrapped by peft with adapters of rank r scaled by alpha / r, every adapter
    matrix random"""
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        fan_in_fan_out=fan_in_fan_out)
    model = get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    return model.eval()


def prepare(work, name, base, model, x, y):
    """base in WORK/NAME/ckpt, the adapter in WORK/NAME/adapter, tokens.bin: our --oracle's input"""
    d = os.path.join(work, name)
    base.save_pretrained(os.path.join(d, "ckpt"), safe_serialization=True)
    model.save_pretrained(os.path.join(d, "adapter"))
    B, T = x.shape
    np.concatenate([[B, T], x.flatten().numpy(), y.flatten().numpy()]).astype(np.int32).tofile(
        os.path.join(d, "tokens.bin"))
    return d


def run_ours(binary, d):
    run = subprocess.run([binary, "--oracle", d], capture_output=True, text=True)
    check(run.returncode == 0, f"our --oracle run on {os.path.basename(d)} exits 0 ({run.stderr.strip()[-300:]})")
    return run.returncode == 0


def rows(path, x, V):
    B, T = x.shape
    return np.fromfile(path, dtype=np.float32).reshape(B, T, V)


def compare_logits_and_grads(name, d, model, x, y):
    V = model.config.vocab_size
    ours = rows(os.path.join(d, "logits.bin"), x, V)
    theirs = model(input_ids=x.long()).logits.detach().numpy()
    check(close(ours, theirs, 1e-5, 1e-5),
          f"{name}: the adapted model's logits equal peft's (max |diff| {float(np.abs(ours - theirs).max()):.3g})")
    model.train()
    compare_grads(name, d, model, x, y)
    model.eval()


def adamw_step(model):
    """tests/oracle_step.py's AdamW on the adapters (all matrices: weight decay on all)"""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=oracle_step.LR, betas=oracle_step.BETAS, eps=oracle_step.EPS,
                            weight_decay=oracle_step.WD)
    opt.step()


def check_llama(binary, merge_tool, work):
    base = tiny_llama()
    B, T, V = 2, 24, base.config.vocab_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    y = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    model = adapted(base, ["q_proj", "v_proj", "down_proj"], 3, 7)
    d = prepare(work, "llama", base, model, x, y)
    if not run_ours(binary, d):
        return
    compare_logits_and_grads("llama", d, model, x, y)

    stepped = rows(os.path.join(d, "stepped_logits.bin"), x, V)
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), os.path.join(d, "stepped")).eval()
    again = loaded(input_ids=x.long()).logits.detach().numpy()
    check(close(stepped, again, 1e-5, 1e-5),
          f"the adapter we saved after one step loads in peft with our logits (max |diff| "
          f"{float(np.abs(stepped - again).max()):.3g})")
    adamw_step(model)
    theirs_stepped = model(input_ids=x.long()).logits.detach().numpy()
    check(close(stepped, theirs_stepped, 1e-4, 1e-5),
          f"after one AdamW step on the adapters our logits equal peft's (max |diff| "
          f"{float(np.abs(stepped - theirs_stepped).max()):.3g})")

    after = load_file(os.path.join(d, "base_after", "model.safetensors"))
    before = base.state_dict()
    moved = [n for n, t in after.items() if not torch.equal(t, before[n])]
    check(not moved and len(after) == len(before),
          f"the base's {len(after)} tensors are bit-identical after the step (moved: {moved[:3]})")

    merged_dir = os.path.join(d, "merged")
    run = subprocess.run([merge_tool, os.path.join(d, "ckpt"), os.path.join(d, "stepped"), merged_dir],
                         capture_output=True, text=True)
    check(run.returncode == 0, f"lora_merge exits 0 ({run.stderr.strip()[-300:]})")
    if run.returncode == 0:
        merged = LlamaForCausalLM.from_pretrained(merged_dir, attn_implementation="eager").eval()
        m = merged(input_ids=x.long()).logits.detach().numpy()
        check(close(stepped, m, 1e-5, 1e-5),
              f"the merged checkpoint loads in transformers with the adapted model's logits (max |diff| "
              f"{float(np.abs(stepped - m).max()):.3g})")


class FixedMask(torch.nn.Module):
    """peft's lora_dropout with our mask: x times the factors (0 or 1 / (1 - p)) we drew"""

    def __init__(self, factors):
        super().__init__()
        self.factors = factors

    def forward(self, x):
        return x * self.factors


def compare_grads(name, d, model, x, y):
    """one backward of the mean loss in peft (model in training mode) against our DIR/grads/"""
    V = model.config.vocab_size
    model.zero_grad()
    loss = F.cross_entropy(model(input_ids=x.long()).logits.reshape(-1, V), y.flatten().long())
    loss.backward()
    grads = load_file(os.path.join(d, "grads", "adapter_model.safetensors"))
    theirs = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.requires_grad}
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    bad = [n for n, g in theirs.items()
           if n not in grads or not close(grads[n].numpy(), g.numpy(), 1e-4, 1e-4 * float(g.abs().max()))]
    check(not bad and len(grads) == len(theirs) and not frozen_grads,
          f"{name}: the {len(theirs)} adapter gradients equal peft's within 1e-4, under peft's names "
          f"(differ or missing: {bad[:3]}; ours {len(grads)})")


def check_llama_dropout(binary, work):
    """one step's adapter gradients with lora_dropout 0.1, both sides dropping our masks' elements"""
    p = 0.1
    base = tiny_llama()
    B, T, V = 2, 24, base.config.vocab_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    y = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    model = adapted(base, LLAMA_TARGETS, 4, 6, dropout=p)
    d = prepare(work, "llama_dropout", base, model, x, y)
    run = subprocess.run([binary, "--oracle-dropout", d, str(p)], capture_output=True, text=True)
    check(run.returncode == 0, f"our --oracle-dropout run exits 0 ({run.stderr.strip()[-300:]})")
    if run.returncode != 0:
        return
    rates, replaced, kept = [], 0, set()
    for name, module in model.named_modules():
        if not hasattr(module, "lora_dropout") or "default" not in module.lora_dropout:
            continue
        ours = name[len("base_model.model."):]
        width = module.in_features
        factors = np.fromfile(os.path.join(d, f"mask.{ours}.bin"), dtype=np.float32).reshape(B, T, width)
        rates.append(float((factors == 0).mean()))
        kept |= {float(v) for v in np.unique(factors)}
        module.lora_dropout["default"] = FixedMask(torch.from_numpy(factors))
        replaced += 1
    check(replaced == 14 and all(0.05 < r < 0.15 for r in rates) and kept == {0.0, float(np.float32(1 / (1 - p)))},
          f"llama dropout: our 14 masks drop about 10% (rates {[round(r, 3) for r in rates[:4]]}...; "
          f"{replaced} replaced; factors {sorted(kept)})")
    model.train()
    compare_grads("llama with lora_dropout 0.1", d, model, x, y)


def check_other(binary, work, name, base, targets, r, alpha, fan_in_fan_out):
    """GPT-2's and phi's module names: logits and gradients"""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    V = base.config.vocab_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (2, 16), generator=g, dtype=torch.int32)
    y = torch.randint(0, V, (2, 16), generator=g, dtype=torch.int32)
    model = adapted(base, targets, r, alpha, fan_in_fan_out)
    d = prepare(work, name, base, model, x, y)
    if run_ours(binary, d):
        compare_logits_and_grads(name, d, model, x, y)


def main():
    binary, merge_tool, work = sys.argv[1], sys.argv[2], sys.argv[3]
    check_llama(binary, merge_tool, work)
    check_llama_dropout(binary, work)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).float().eval()
    check_other(binary, work, "gpt2", gpt2, ["c_attn", "c_fc"], 2, 5, True)
    phi = PhiForCausalLM(PhiConfig(vocab_size=300, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64, partial_rotary_factor=0.5,
                                   resid_pdrop=0, embd_pdrop=0, attention_dropout=0,
                                   attn_implementation="eager")).float().eval()
    check_other(binary, work, "phi", phi, ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"], 5, 3, False)
    print("lora oracle: done")


if __name__ == "__main__":
    main()
    sys.exit(1 if oracle_step.failures else 0)
