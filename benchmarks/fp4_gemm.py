#!/usr/bin/env python3
"""The fused FP4 GEMMs (dsv4/model/fp4_kernel.py) against w8a8's int8 paths and bf16, on
DeepSeek V4 Flash's routed-expert shapes.

    python benchmarks/fp4_gemm.py [--threads 1,2] [--rows 1,4,16,128] [--iters 20] [--experts 8]

Shapes: the fused w1|w3 of two experts' halves, [N 4096, K 4096] (packed [4096, 2048]), and
w2, [4096, 2048]. Arms, each with the per-token quantisation it needs included:
  fp4 A8     quantize_tokens + linear_a8 (int8 activations; the --quantization w8a8 style)
  fp4 A8 vnni  the same on the AVX-512 VNNI path, where the default is AMX (the same bits)
  fp4 F      linear_f with float32 activations (W4A32)
  w8a8 pack  quantize_tokens + int8pack.mm (oneDNN prepacked, what the engine loads) + rescale
  _int_mm    quantize_tokens + torch._int_mm on the int8 [N, K] weight + rescale
  bf16       F.linear, bf16 activations and weight
Every arm cycles through --experts distinct weights (more bytes than the L3 holds), so that
decode reads from memory as it does serving. Times are wall-clock medians; the copy and
read bandwidths are measured in the same run at each thread count, and the floor used for
"% floor" is the larger of the two (read: a float32 sum; copy: bytes read + written).
The machine may be shared: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from dsv4.model import fp4_kernel, int8pack
from dsv4.model.kernels import quantize_tokens

SHAPES = [("w1|w3 [4096, 4096]", 4096, 4096), ("w2 [4096, 2048]", 4096, 2048)]
REF_SLOW_S = 0.05  # a prepacked call slower than this at one row is oneDNN's reference kernel: not repeated


def _median(fn, iters: int, warm: int = 3) -> float:
    for i in range(warm):
        fn(i)
    ts = []
    for i in range(iters):
        t = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bandwidth(mib: int = 512) -> tuple[float, float]:
    """(read GB/s: a float32 sum, copy GB/s: read + written bytes) of `mib` MiB buffers."""
    src = torch.ones(mib << 18)  # float32
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    read = nbytes / _median(lambda i: src.sum(), 5, 1) / 1e9
    copy = 2 * nbytes / _median(lambda i: dst.copy_(src), 5, 1) / 1e9
    return read, copy


def weights(n: int, k: int, e: int, g: torch.Generator) -> dict:
    """`e` distinct weights of each format (random: the kernels' speed does not depend on values)."""
    packed = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g).view(torch.int8) for _ in range(e)]
    scale = [torch.randint(118, 128, (n, k // 32), dtype=torch.uint8, generator=g) for _ in range(e)]
    w8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g) for _ in range(e)]
    return {"packed": packed, "scale": scale, "w8": w8, "ws": torch.rand(n) / 100,
            "packed_v": [p.clone() for p in packed], "scale_v": [s.clone() for s in scale],  # own copies: no
            # arm reads weights another left in the cache
            "pack": [int8pack.pack(w) for w in w8] if int8pack.available() else None,
            "bf16": [torch.randn(n, k, generator=g, dtype=torch.bfloat16) for _ in range(e)]}


def arms(w: dict, x: torch.Tensor) -> dict:
    e = len(w["packed"])
    xb = x.bfloat16()

    def a8(i):
        xq, xs = quantize_tokens(x)
        return fp4_kernel.linear_a8(xq, xs, w["packed"][i % e], w["scale"][i % e])

    def pack(i):
        xq, xs = quantize_tokens(x)
        return int8pack.mm(xq, w["pack"][i % e]) * xs * w["ws"]

    def int_mm(i):
        xq, xs = quantize_tokens(x)
        return torch._int_mm(xq, w["w8"][i % e].t()).float() * xs * w["ws"]

    def a8_vnni(i):  # the AVX-512 VNNI path beside the AMX one, where AMX is the default
        xq, xs = quantize_tokens(x)
        return fp4_kernel.linear_a8(xq, xs, w["packed_v"][i % e], w["scale_v"][i % e], isa="avx512-vnni")

    out = {"fp4 A8": a8, "fp4 A8 vnni": a8_vnni if "amx" in fp4_kernel.backend() else None,
           "fp4 F": lambda i: fp4_kernel.linear_f(x, w["packed"][i % e], w["scale"][i % e]),
           "w8a8 pack": pack if w["pack"] is not None else None, "_int_mm": int_mm,
           "bf16": lambda i: F.linear(xb, w["bf16"][i % e])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,4,16,128")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--experts", type=int, default=8, help="distinct weights per format and shape")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    rows = [int(m) for m in a.rows.split(",")]
    print(f"torch {torch.__version__}, {fp4_kernel.backend()}, load average before: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    g = torch.Generator().manual_seed(0)
    table = []
    with torch.inference_mode():
        for name, n, k in SHAPES:
            w = weights(n, k, a.experts, g)
            nbytes = {"fp4 A8": n * k // 2 + n * k // 32, "fp4 F": n * k // 2 + n * k // 32,
                      "w8a8 pack": n * k, "_int_mm": n * k, "bf16": 2 * n * k}
            for th in threads:
                torch.set_num_threads(th)
                read, copy = bandwidth()
                floor = max(read, copy)
                ref_slow = None
                for m in rows:
                    x = torch.randn(m, k, generator=g)
                    t = {}
                    for arm, fn in arms(w, x).items():
                        if fn is None:
                            continue
                        if arm == "w8a8 pack":
                            if ref_slow is not None:
                                t[arm] = None
                                continue
                            one = _median(fn, 1, 1)
                            if one > REF_SLOW_S:  # oneDNN's ref_int8 kernel (seen on AMD Zen 4): time it once
                                ref_slow, t[arm] = one, one
                                continue
                        t[arm] = _median(fn, a.iters if m <= 16 else max(3, a.iters // 4))
                    best8 = min(v for arm, v in t.items() if arm in ("w8a8 pack", "_int_mm") and v)
                    table.append((name, m, th, t, best8, nbytes, floor, read, copy))
                print(f"{name}, {th} thread(s): read {read:.1f} GB/s, copy {copy:.1f} GB/s", flush=True)
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    cols = ["fp4 A8", "fp4 A8 vnni", "fp4 F", "w8a8 pack", "_int_mm", "bf16"]
    print("| shape | M | threads | " + " | ".join(f"{c} ms" for c in cols) +
          " | A8 / best w8a8 | A8 GB/s (% floor) | F GB/s (% floor) | A8 M / A8 M=1 |")
    print("|---|---|---|" + "---|" * (len(cols) + 4))
    m1 = {}
    for name, m, th, t, best8, nbytes, floor, read, copy in table:
        if m == rows[0]:
            m1[(name, th)] = t["fp4 A8"]
        cells = [("-" if t.get(c) is None else f"{1e3 * t[c]:.3f}" + (" (ref)" if c == "w8a8 pack" and t[c] > REF_SLOW_S else ""))
                 for c in cols]
        gbs = {c: nbytes[c] / t[c] / 1e9 for c in ("fp4 A8", "fp4 F")}
        speed = best8 / t["fp4 A8"]
        print(f"| {name} | {m} | {th} | " + " | ".join(cells) +
              f" | {speed:.2f}x faster | {gbs['fp4 A8']:.1f} ({100 * gbs['fp4 A8'] / floor:.0f} %)"
              f" | {gbs['fp4 F']:.1f} ({100 * gbs['fp4 F'] / floor:.0f} %) | {t['fp4 A8'] / m1[(name, th)]:.2f} |")


if __name__ == "__main__":
    main()
