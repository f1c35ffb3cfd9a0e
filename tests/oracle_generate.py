#!/usr/bin/python3
"""The PyTorch side of stage 06's oracle test (tests/test_stage6.sh).

usage: /usr/bin/python3 tests/oracle_generate.py CHECKPOINT_DIR N PROMPT_ID [PROMPT_ID ...]

Greedy generation the plainest way, sharing no code with ours: the safetensors file read by hand
and the weights loaded into the fixtures' own PyTorch GPT-2 (both through
tests/oracle_checkpoint.py), then N times: run the WHOLE sequence so far (no cache), take the
argmax of the last row's logits, append it; stop early at end-of-text (vocab_size - 1, GPT-2's
<|endoftext|>), which is not printed. Prints "oracle answer ids: ..." for the shell test to compare
with stage 06's "answer ids:" line.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_checkpoint import GPT, load_into, read_safetensors  # noqa: E402


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    d, n = sys.argv[1], int(sys.argv[2])
    ids = [int(x) for x in sys.argv[3:]]
    torch.set_num_threads(2)
    cfg = json.load(open(os.path.join(d, "config.json")))
    _, sd = read_safetensors(os.path.join(d, "model.safetensors"))
    V, L = cfg["vocab_size"], cfg["n_layer"]
    model = GPT(V, cfg["n_positions"], L, cfg["n_head"], cfg["n_embd"])
    load_into(model, sd, L)
    model.eval()
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids + out]))
            token = int(torch.argmax(logits[0, -1]))
            if token == V - 1:
                break
            out.append(token)
    print("oracle answer ids: " + " ".join(str(t) for t in out))


if __name__ == "__main__":
    main()
