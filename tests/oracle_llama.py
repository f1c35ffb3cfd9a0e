"""The transformers side of tests/test_llama_oracle.sh.

usage: PYTHON tests/oracle_llama.py OUR_BINARY WORKDIR   (PYTHON: a venv with transformers 4.49.0)

Builds transformers' LlamaForCausalLM offline from a tiny random LlamaConfig with grouped-query
attention (2 key/value heads for 4 query heads; eager attention, RMSNorm weights random too, so a
misplaced one shows), saves it with save_pretrained, runs `OUR_BINARY --oracle WORKDIR/ckpt`
(tests/test_llama.c, tests/oracle_step.h) on it and compares: our logits, one training step's
loss, per-tensor gradient norms, the weights after one AdamW step, and a checkpoint we saved loaded
back into transformers; our logits from fp16 and bf16 copies saved in shards
(model.safetensors.index.json); our logits for a tied-embedding model with Llama 3's
rope_scaling, and the config.json we save for it loading in transformers with no warning, each
float written as the shortest decimal of its float32; and that configs with what we do not
implement are refused by name. Prints "ok: ..." or "FAIL: ..." per check.
"""
import json
import logging
import os
import subprocess
import sys
import warnings

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import oracle_step
from oracle_step import check, check_stored_dtypes, close, compare_step, our_logits, run_ours


def tiny_llama(**overrides):
    torch.manual_seed(0)
    # vocab 300: not a multiple of 128, so our padding rows are exercised
    settings = dict(vocab_size=300, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rope_theta=10000.0, rms_norm_eps=1e-5, attention_dropout=0.0, tie_word_embeddings=False,
                    attn_implementation="eager")
    settings.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # the RMSNorms' weights
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def check_logits(binary, work, name, model, x, y):
    ckpt = os.path.join(work, name)
    model.save_pretrained(ckpt, safe_serialization=True)
    if run_ours(binary, ckpt, x, y):
        ours, theirs = our_logits(ckpt, x), model(input_ids=x.long()).logits.detach().numpy()
        check(close(ours, theirs, 1e-5, 1e-5),
              f"{name}: logits equal transformers' (max |diff| {float(np.abs(ours - theirs).max()):.3g})")


def check_saved_config(ckpt, model):
    """the config.json we saved loads in transformers with no warning, and each float in it is
    written as the shortest decimal that reads back as its float32 (json.loads keeps the text)"""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = LlamaConfig.from_pretrained(ckpt)
    logging.getLogger("transformers").removeHandler(handler)
    said = [r.getMessage() for r in records if r.levelno >= logging.WARNING] + [str(w.message) for w in caught]
    check(not said and loaded.rope_scaling == model.config.rope_scaling,
          f"the config.json we saved loads in transformers with no warning and its rope_scaling (said: {said[:3]})")
    text = json.load(open(os.path.join(ckpt, "config.json")), parse_float=lambda t: ("float", t))
    floats = {}

    def collect(obj, path):
        for k, v in obj.items():
            if isinstance(v, dict):
                collect(v, path + k + ".")
            elif isinstance(v, tuple):
                floats[path + k] = v[1]
    collect(text, "")
    wanted = ["rope_theta", "rms_norm_eps", "rope_scaling.factor", "rope_scaling.low_freq_factor",
              "rope_scaling.high_freq_factor"]
    long = {k: t for k, t in floats.items() if float(t) != float(str(np.float32(t)))}
    check(all(k in floats for k in wanted) and not long,
          f"config.json writes its floats ({sorted(floats)}) as floats, each the shortest decimal of its "
          f"float32 (not: {long}; ints: {[k for k in wanted if k not in floats]})")


def check_refused(binary, work, model, x, y):
    """a config.json asking for what we do not implement: refused, naming the key"""
    cases = [("rope_scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 64}}),
             ("sliding_window", {"sliding_window": 16}), ("attention_bias", {"attention_bias": True}),
             ("mlp_bias", {"mlp_bias": True}), ("hidden_act", {"hidden_act": "gelu"}),
             ("num_key_value_heads", {"num_key_value_heads": 3})]
    for key, change in cases:
        ckpt = os.path.join(work, "refused_" + key)
        model.save_pretrained(ckpt, safe_serialization=True)
        path = os.path.join(ckpt, "config.json")
        cfg = json.load(open(path))
        cfg.update(change)
        json.dump(cfg, open(path, "w"))
        B, T = x.shape
        np.concatenate([[B, T], x.flatten().numpy(), y.flatten().numpy()]).astype(np.int32).tofile(
            os.path.join(ckpt, "tokens.bin"))
        run = subprocess.run([binary, "--oracle", ckpt], capture_output=True, text=True)
        check(run.returncode != 0 and key in run.stderr and "config.json" in run.stderr,
              f"a config.json with {change} is refused by name ({run.stderr.strip()[-200:]})")


def main():
    binary, work = sys.argv[1], sys.argv[2]
    ckpt = os.path.join(work, "ckpt")
    model = tiny_llama()
    model.save_pretrained(ckpt, safe_serialization=True)
    B, T, V = 2, 24, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    y = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    check_stored_dtypes(binary, work, model, x, y, "20KB")
    # head_dim 8: frequencies 1, 0.1, 0.01, 0.001, whose wavelengths (6.3 to 6283) straddle both of
    # Llama 3's bounds at original_max_position_embeddings 64 (64 / 4 = 16 and 64 / 1 = 64)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    tied = tiny_llama(tie_word_embeddings=True, rope_scaling=llama3, rms_norm_eps=1e-6)
    check_logits(binary, work, "tied_llama3", tied, x, y)
    check_saved_config(os.path.join(work, "tied_llama3", "resaved"), tied)
    check_refused(binary, work, model, x, y)
    if not run_ours(binary, ckpt, x, y):
        return

    compare_step(model, LlamaForCausalLM, ckpt, x, y)


if __name__ == "__main__":
    main()
    sys.exit(1 if oracle_step.failures else 0)
