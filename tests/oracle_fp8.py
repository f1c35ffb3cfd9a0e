#!/usr/bin/python3
"""The ml_dtypes side of tests/test_fp8.sh: common/base/numbers.h's FP8 casts and scales (through
build/tests/fp8_codes) against ml_dtypes' float8_e4m3fn and float8_e5m2, which share no code with
them, bit for bit.

usage: python tests/oracle_fp8.py BUILD/tests/fp8_codes TMPDIR

Per format, 2 x 10^6 values: 10^6 random float32 bit patterns (every exponent: NaNs with any
payload and sign, infinities, float32 subnormals, values far beyond the format) and 10^6 around the
format's own range: random values from below its smallest subnormal to past its largest finite,
every value of the format and every midpoint between neighbours (the ties, which round to the even
one), and the edges (+-0, +-max, the first value that overflows, +-inf, NaN). Plain casts match
ml_dtypes' astype; saturating ones match astype of the values clipped to +-max (NaN kept). Every
byte decodes to ml_dtypes' value (NaN to a NaN). The scales: fp8_scale = max / amax in float32;
the MX scale's E8M0 byte = floor(log2 amax) - emax + 127, from Python's exact log2 of the value.
"""
import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np

from oracle_train import check
import oracle_train

FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8), "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 15)}


def run(binary, args, data):
    return subprocess.run([binary] + args, input=data.tobytes(), capture_output=True, check=True).stdout


def values_around(dtype, fmax, rng, n):
    """random values spanning the format's range and beyond, its every value and every midpoint"""
    grid = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)  # exact in float32
    tiny = float(grid[grid > 0].min())
    edges = np.array([0.0, -0.0, fmax, -fmax, np.inf, -np.inf, np.nan, tiny / 2, -tiny / 2, tiny, fmax * 1.0625,
                      fmax * (1 + 2.0 ** -8), np.float32(3.4028235e38)], dtype=np.float32)
    k = n - len(grid) - len(mids) - len(edges)
    exponents = rng.uniform(math.log2(tiny) - 3, math.log2(fmax) + 3, k)
    rand = (np.sign(rng.standard_normal(k)) * 2.0 ** exponents).astype(np.float32)
    return np.concatenate([grid, mids, edges, rand]).astype(np.float32)


def same_codes(ours, ref, what, inputs):
    bad = np.nonzero(ours != ref)[0]
    example = f"; first at {inputs[bad[0]]!r}: ours {ours[bad[0]]:#04x}, ml_dtypes {ref[bad[0]]:#04x}" if len(bad) else ""
    check(len(bad) == 0, f"{what}: {len(ours)} values, {len(bad)} differ{example}")


def main():
    binary, tmp = sys.argv[1], sys.argv[2]
    os.makedirs(tmp, exist_ok=True)
    rng = np.random.default_rng(54)
    for name, (dtype, fmax, emax) in FORMATS.items():
        bits = rng.integers(0, 2 ** 32, 10 ** 6, dtype=np.uint64).astype(np.uint32).view(np.float32)
        x = np.concatenate([bits, values_around(dtype, fmax, rng, 10 ** 6)])
        with np.errstate(over="ignore", invalid="ignore"):
            plain = x.astype(dtype).view(np.uint8)
            saturated = np.clip(x, -fmax, fmax).astype(dtype).view(np.uint8)
        ours = np.frombuffer(run(binary, ["encode", name], x), dtype=np.uint8)
        same_codes(ours, plain, f"{name} cast", x)
        ours = np.frombuffer(run(binary, ["encode", name, "saturate"], x), dtype=np.uint8)
        same_codes(ours, saturated, f"{name} saturating cast", x)
        kinds = {"NaN": np.isnan(x), "inf": np.isinf(x), "beyond max": np.abs(x) > fmax,
                 "below the smallest normal": (np.abs(x) > 0) & (np.abs(x) < 2.0 ** (1 - (7 if name == "e4m3" else 15)))}
        print(f"   {name}: " + ", ".join(f"{int(v.sum())} {k}" for k, v in kinds.items()) + " among the inputs")

        codes = np.arange(256, dtype=np.uint8)
        ours = np.frombuffer(run(binary, ["decode", name], codes), dtype=np.float32)
        ref = codes.view(dtype).astype(np.float32)
        agree = (ours.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(ours) & np.isnan(ref))
        check(bool(agree.all()), f"{name} decode: {int((~agree).sum())} of 256 bytes differ")

        amax = np.abs(values_around(dtype, fmax, rng, 10 ** 5))
        amax = np.concatenate([amax, np.abs(bits[:10 ** 5])])
        ours = np.frombuffer(run(binary, ["scale", name], amax), dtype=np.float32)
        finite = np.isfinite(amax) & (amax > 0)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            ref = np.where(finite, np.float32(fmax) / amax, np.float32(1)).astype(np.float32)
        check(bool((ours.view(np.uint32) == ref.view(np.uint32)).all()),
              f"{name} tensorwise scale max / amax: {len(amax)} amaxes, {int((ours != ref).sum())} differ")
        ours = np.frombuffer(run(binary, ["mx_scale", name], amax), dtype=np.uint8)
        ref = np.array([0xFF if not math.isfinite(a) else 0 if a == 0 else
                        min(127, max(-127, math.floor(math.log2(a)) - emax)) + 127 for a in amax.tolist()], dtype=np.uint8)
        same_codes(ours, ref, f"{name} MX E8M0 scale", amax)
    sys.exit(1 if oracle_train.failures else 0)


if __name__ == "__main__":
    main()
