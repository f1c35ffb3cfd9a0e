"""The transformers side of tests/test_phi_oracle.sh.

usage: PYTHON tests/oracle_phi.py OUR_BINARY STAGE_6 WORKDIR   (PYTHON: a venv with transformers 4.49.0)

Builds transformers' PhiForCausalLM offline from a tiny random PhiConfig (eager attention, no
dropout; biases and LayerNorms random too, so a misplaced one shows), saves it with
save_pretrained, runs `OUR_BINARY --oracle WORKDIR/ckpt` (tests/test_phi.c) on it and compares:
our logits, one training step's loss, per-tensor gradient norms, the weights after one AdamW
step, and a checkpoint we saved loaded back into transformers; and our logits from fp16 and bf16
copies saved in shards (model.safetensors.index.json); and stage 06's greedy continuation (KV
cache, two prompts of different lengths in one batch) against a greedy loop without a cache
written here; and our tokenizer with phi's added tokens against CodeGenTokenizerFast. Prints "ok: ..." or "FAIL: ..."
per check.
"""
import json
import os
import subprocess
import sys

import torch
from transformers import PhiConfig, PhiForCausalLM

import oracle_step
from oracle_step import check, check_stored_dtypes, compare_step, run_ours


def tiny_phi(scale=0.1):
    torch.manual_seed(0)
    # vocab 300: not a multiple of 128, so our padding rows are exercised
    cfg = PhiConfig(vocab_size=300, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=512, partial_rotary_factor=0.5,
                    rope_theta=10000.0, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                    attn_implementation="eager")
    model = PhiForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "layernorm" in name else 0.0))
            else:
                p.copy_(torch.randn_like(p) * scale)
    return model


def greedy_no_cache(model, prompt, n, vocab, eot):
    """the plainest greedy loop: the whole sequence so far, every step; argmax over the tokenizer's
    vocabulary (stage 06 draws only from it); stop at end-of-text, which is not returned"""
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([prompt + out])).logits
            token = int(torch.argmax(logits[0, -1, :vocab]))
            if token == eot:
                break
            out.append(token)
    return out


def check_greedy(stage6, work):
    # larger weights than the other checks': a model this small and this random otherwise repeats
    # one token whatever the positions, and a wrong rotation in decode would go unseen
    model = tiny_phi(scale=0.5)
    ckpt = os.path.join(work, "greedy")
    model.save_pretrained(ckpt, safe_serialization=True)
    prompts = os.path.join(work, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("Sort the digits.\nCount the letters in this rather longer sentence.\n")
    run = subprocess.run([stage6, "--config", "configs/inference.json", f"--init_from={ckpt}",
                          f"--prompts_path={prompts}", "--tokens_to_generate=12", "--show_token_ids=true",
                          "--max_batch_size=2", "--max_seq_len=512"], capture_output=True, text=True,
                         errors="replace")  # a random model writes any bytes
    check(run.returncode == 0, f"stage 06 generates from the transformers checkpoint ({run.stderr.strip()[-300:]})")
    ids = lambda key: [[int(t) for t in line.split(key)[1].split()] for line in run.stdout.splitlines() if key in line]
    prompt_ids, answers = ids("prompt ids:"), ids("answer ids:")
    check(len(prompt_ids) == 2 and len(answers) == 2, f"stage 06 printed 2 prompts and 2 answers")
    for p, a in zip(prompt_ids, answers):
        want = greedy_no_cache(model, p, 12, 257, 256)  # the byte tokenizer: 257 tokens, end-of-text 256
        check(a == want, f"KV-cache greedy continuation of a {len(p)}-token prompt: ours {a}, no-cache loop {want}")


# phi-1_5's added tokens (its added_tokens.json): runs of 31 down to 2 spaces, then 9 down to 2 tabs
PHI_ADDED = {**{" " * n: 50257 + 31 - n for n in range(31, 1, -1)}, **{"\t" * n: 50287 + 9 - n for n in range(9, 1, -1)}}
TEXTS = [
    "a  b", "a b", "x" + " " * 40 + "y", "\t\tif x:\n\t\t\treturn 1\n", "  \t  \t\t \n",
    "def f(x):\n    return x  # two spaces\n\n\n        deep = [1,  2,   3]\n",
    "line one\r\nline two\r\n\r\n  indented\r\n", "café naïve 日本語 emoji 🎉  and  spaces ",
    "trailing spaces     ", "     leading", "mixed \t \t\t   \t\tend",
]


def check_tokenizer(binary, work, fixtures):
    """our CodeGen tokenizer (GPT-2's files + phi's added tokens) against transformers'
    CodeGenTokenizerFast built from the same files"""
    from transformers import CodeGenTokenizerFast
    d = os.path.join(work, "tokenizer")
    os.makedirs(d)
    os.symlink(os.path.join(fixtures, "gpt2-tokenizer", "encoder.json"), os.path.join(d, "vocab.json"))
    os.symlink(os.path.join(fixtures, "gpt2-tokenizer", "vocab.bpe"), os.path.join(d, "merges.txt"))
    json.dump(PHI_ADDED, open(os.path.join(d, "added_tokens.json"), "w"))
    hf = CodeGenTokenizerFast.from_pretrained(d)
    check(len(hf) == 50295, f"transformers' CodeGen tokenizer has phi-1_5's 50295 tokens ({len(hf)})")
    for i, text in enumerate(TEXTS):
        path = os.path.join(work, f"text{i}.txt")
        open(path, "w", encoding="utf-8", newline="").write(text)
        run = subprocess.run([binary, "--encode", d, path], capture_output=True, text=True)
        ours = json.loads(run.stdout) if run.returncode == 0 else run.stderr.strip()
        theirs = hf(text)["input_ids"]
        check(ours == theirs, f"tokenizer on {text!r}: ours {ours}, transformers {theirs}")
    check(hf("a  b")["input_ids"] == [64, 50286, 65], "transformers gives [64, 50286, 65] for 'a  b'")
    # the same tokenizer as transformers saves it, its added tokens in tokenizer.json only
    saved = os.path.join(work, "tokenizer_saved")
    hf.save_pretrained(saved)
    if os.path.exists(os.path.join(saved, "added_tokens.json")):
        os.remove(os.path.join(saved, "added_tokens.json"))
    path = os.path.join(work, "text5.txt")
    run = subprocess.run([binary, "--encode", saved, path], capture_output=True, text=True)
    ours = json.loads(run.stdout) if run.returncode == 0 else run.stderr.strip()
    check(ours == hf(TEXTS[5])["input_ids"], f"added tokens read from tokenizer.json: ours {ours}")


def main():
    binary, stage6, work = sys.argv[1], sys.argv[2], sys.argv[3]
    check_tokenizer(binary, work, os.environ.get("FIXTURES", os.path.join(os.path.dirname(__file__), "..", "..",
                                                                          "shared", "fixtures")))
    ckpt = os.path.join(work, "ckpt")
    model = tiny_phi()
    model.save_pretrained(ckpt, safe_serialization=True)
    B, T, V = 2, 24, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    y = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    check_stored_dtypes(binary, work, model, x, y, "40KB")
    check_greedy(stage6, work)
    if not run_ours(binary, ckpt, x, y):
        return

    compare_step(model, PhiForCausalLM, ckpt, x, y)


if __name__ == "__main__":
    main()
    sys.exit(1 if oracle_step.failures else 0)
