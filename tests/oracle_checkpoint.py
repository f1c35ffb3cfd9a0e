#!/usr/bin/python3
"""The PyTorch side of tests/test_checkpoint_oracle.sh.

usage: /usr/bin/python3 tests/oracle_checkpoint.py DIR

DIR holds a checkpoint our C code wrote (model.safetensors + config.json) and tokens.json (B, T,
inputs, targets). This script, which shares no code with ours:
  1. reads model.safetensors by hand (struct + json + torch.frombuffer: transformers is not
     installed, and would hide what is checked) and checks that the file and config.json are
     what Hugging Face's GPT2LMHeadModel expects: names, Conv1D (in, out) shapes, F32, no
     lm_head, contiguous data offsets, metadata format "pt", the config keys;
  2. loads the weights into the independent PyTorch GPT-2 of
     ../shared/fixtures/oracle/gpt2_torch_timing.py (pre-LN, GELU-tanh, tied head);
  3. prints the mean cross-entropy on tokens.json and a few logits, for the shell test to
     compare with what our C forward pass printed.
Each check prints "ok: ..." or "FAIL: ..."; the exit status is 1 if any failed.
"""
import json
import os
import struct
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.environ.get("FIXTURES", os.path.join(HERE, "..", "..", "shared", "fixtures"))
sys.path.insert(0, os.path.join(FIXTURES, "oracle"))
from gpt2_torch_timing import GPT  # noqa: E402  (the fixtures' own PyTorch GPT-2)

failures = 0


def check(cond, what):
    global failures
    print(("ok: " if cond else "FAIL: ") + what)
    if not cond:
        failures += 1


def read_safetensors(path):
    """(header dict, {name: float32 tensor}) read with nothing but the format's definition."""
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    base = 8 + n
    check(base % 8 == 0, f"data section starts 8-byte aligned (header {n} bytes)")
    tensors, spans = {}, []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        spans.append((begin, end))
        if e["dtype"] == "F32":
            data = bytearray(blob[base + begin:base + end])
            tensors[name] = torch.frombuffer(data, dtype=torch.float32).reshape(e["shape"]).clone()
    # the reference reader (huggingface/safetensors) wants the tensors back to back, covering
    # the whole data section, with no gap
    spans.sort()
    contiguous = all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    check(spans[0][0] == 0 and contiguous and spans[-1][1] == len(blob) - base,
          "data offsets are contiguous and cover the data section exactly")
    return header, tensors


def expected_shapes(cfg):
    V, P, C, L = cfg["vocab_size"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"]
    shapes = {"wte.weight": [V, C], "wpe.weight": [P, C], "ln_f.weight": [C], "ln_f.bias": [C]}
    for i in range(L):
        h = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            shapes[h + ln + ".weight"] = [C]
            shapes[h + ln + ".bias"] = [C]
        # Conv1D: weight (in, out)
        for name, fan_in, fan_out in (("attn.c_attn", C, 3 * C), ("attn.c_proj", C, C),
                                      ("mlp.c_fc", C, 4 * C), ("mlp.c_proj", 4 * C, C)):
            shapes[h + name + ".weight"] = [fan_in, fan_out]
            shapes[h + name + ".bias"] = [fan_out]
    return {"transformer." + k: v for k, v in shapes.items()}


def check_config(cfg):
    V = cfg.get("vocab_size")
    check(cfg.get("model_type") == "gpt2", "config model_type gpt2")
    check(cfg.get("architectures") == ["GPT2LMHeadModel"], "config architectures [GPT2LMHeadModel]")
    check(cfg.get("n_ctx") == cfg.get("n_positions"), "config n_ctx = n_positions")
    check(cfg.get("activation_function") == "gelu_new", "config activation_function gelu_new")
    check(abs(cfg.get("layer_norm_epsilon", 0) - 1e-5) < 1e-12, "config layer_norm_epsilon 1e-5")
    check(cfg.get("tie_word_embeddings") is True, "config tie_word_embeddings true")
    check(cfg.get("bos_token_id") == V - 1 and cfg.get("eos_token_id") == V - 1, "config bos/eos = vocab_size - 1")
    check(all(cfg.get(k) == 0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")), "config dropout 0")
    check(cfg["n_embd"] % cfg["n_head"] == 0, "config n_embd divisible by n_head")


def load_into(model, sd, L):
    """HF names and Conv1D (in, out) weights -> the nn.Linear (out, in) modules of GPT."""
    t = lambda k: sd["transformer." + k]
    with torch.no_grad():
        model.wte.weight.copy_(t("wte.weight"))
        model.wpe.weight.copy_(t("wpe.weight"))
        model.ln_f.weight.copy_(t("ln_f.weight"))
        model.ln_f.bias.copy_(t("ln_f.bias"))
        for i, blk in enumerate(model.h):
            p = f"h.{i}."
            for ln in ("ln_1", "ln_2"):
                getattr(blk, ln).weight.copy_(t(p + ln + ".weight"))
                getattr(blk, ln).bias.copy_(t(p + ln + ".bias"))
            for mine, hf in (("c_attn", "attn.c_attn"), ("attn_proj", "attn.c_proj"),
                             ("c_fc", "mlp.c_fc"), ("mlp_proj", "mlp.c_proj")):
                getattr(blk, mine).weight.copy_(t(p + hf + ".weight").t())
                getattr(blk, mine).bias.copy_(t(p + hf + ".bias"))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = sys.argv[1]
    torch.set_num_threads(2)
    cfg = json.load(open(os.path.join(d, "config.json")))
    check_config(cfg)
    header, sd = read_safetensors(os.path.join(d, "model.safetensors"))
    meta = header.get("__metadata__", {})
    check(meta.get("format") == "pt", "metadata format 'pt' (transformers refuses a file without it)")
    names = {k for k in header if k != "__metadata__"}
    want = expected_shapes(cfg)
    check(names == set(want), f"tensor names are GPT2LMHeadModel's ({len(names)} tensors, no lm_head)")
    check(all(header[k]["dtype"] == "F32" for k in names), "every tensor F32")
    bad = [k for k in names & set(want) if header[k]["shape"] != want[k]]
    check(not bad, "shapes: Conv1D weights (in, out), wte (vocab_size, n_embd)" + (f"; wrong: {bad}" if bad else ""))
    if failures:
        sys.exit(1)

    model = GPT(cfg["vocab_size"], cfg["n_positions"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"])
    load_into(model, sd, cfg["n_layer"])
    model.eval()
    tok = json.load(open(os.path.join(d, "tokens.json")))
    B, T = tok["B"], tok["T"]
    x = torch.tensor(tok["inputs"]).view(B, T)
    y = torch.tensor(tok["targets"]).view(B, T)
    with torch.no_grad():
        logits, loss = model(x, y)
    print(f"loss {loss.item():.9g}")
    print("logits_b1_tlast_first4 " + " ".join(f"{v:.9g}" for v in logits[B - 1, T - 1, :4].tolist()))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
