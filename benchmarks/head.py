#!/usr/bin/env python3
"""The head's product as the int8 modes hold it (BF16 as stored, `fp4_kernel.linear_bf16`)
against the float32 head it replaced, on DeepSeek V4's head shape [129280, 4096].

    python benchmarks/head.py [--threads 1,2] [--rows 1,4,8,16] [--iters 5]

Arms: `f32 mm` torch.mm against the head widened to float32 (what the int8 modes held
before), `bf16 <path>` linear_bf16 on each C++ path this CPU runs (the same bits on every
one), and `bf16 mm` torch.mm with the activations rounded to BF16 (oneDNN's BF16 kernels:
not the same logits, for scale only). Best of --iters after a warm-up; the machine may be
shared: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from dsv4.model import fp4_kernel

V, D = 129280, 4096


def best(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--scalar", action="store_true", help="the scalar path too (slow)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, D, generator=g).bfloat16()
    w32 = w.float()
    # amx runs the avx512 kernel; scalar (fmaf calls: ~1 s a row of this head) only with --scalar
    paths = [p for p in fp4_kernel.available_isas() if p != "amx" and (args.scalar or p != "scalar")]
    print(f"load average {os.getloadavg()[0]:.2f}; {fp4_kernel.backend()}; head [{V}, {D}]")
    print("| threads | rows | f32 mm ms | " + " | ".join(f"bf16 {p} ms" for p in paths)
          + " | bf16 mm ms | f32 mm / best bf16 |")
    print("| --- " * (4 + len(paths)) + "| --- |")
    for th in map(int, args.threads.split(",")):
        torch.set_num_threads(th)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, D, generator=g)
            xb = x.bfloat16()
            f32 = best(lambda: torch.mm(x, w32.t()), args.iters)
            ours = [best(lambda p=p: fp4_kernel.linear_bf16(x, w, isa=p), args.iters) for p in paths]
            bmm = best(lambda: torch.mm(xb, w.t()), args.iters)
            print(f"| {th} | {m} | {f32:.1f} | " + " | ".join(f"{t:.1f}" for t in ours)
                  + f" | {bmm:.1f} | {f32 / min(ours):.2f}x |")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
