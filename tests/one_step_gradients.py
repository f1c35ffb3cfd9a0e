#!/usr/bin/env python3
"""Per-tensor gradients after one step, read from checkpoints: one_step_gradients.py START REF RUN.

START is a run of one step at lr 1e-30 (the initial weights), REF and RUN one step at a large lr
with AdamW's eps 1, no decay, no clipping and no warm-up: step 1 then moves each weight by
lr g / (|g| + 1), about lr times the gradient, so START - REF is stage 01's gradient and
START - RUN the run's, each tensor compared relative to its largest step. Prints the largest
difference and every tensor over 1e-5; exits 1 if there is one."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from diverge import read_header, read_tensor  # noqa: E402

TOLERANCE = 1e-5


def main(start_dir, ref_dir, run_dir):
    paths = [d + "/model.safetensors" for d in (start_dir, ref_dir, run_dir)]
    headers = [read_header(p) for p in paths]
    worst, bad = (0.0, ""), []
    for name in headers[0][0]:
        w0, wr, ws = (read_tensor(p, h[name], h_start) for p, (h, _, h_start) in zip(paths, headers))
        step_ref = [a - b for a, b in zip(w0, wr)]
        scale = max(map(abs, step_ref))
        if scale < 1e-2:
            continue  # a gradient that is zero but for rounding (the attention key's bias)
        gap = max(abs((a - c) - r) for a, c, r in zip(w0, ws, step_ref)) / scale
        worst = max(worst, (gap, name))
        if gap > TOLERANCE:
            bad.append(f"{name} {gap:.1e}")
    print(f"largest per-tensor gradient difference {worst[0]:.1e} ({worst[1]})", *bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
