#!/usr/bin/env python3
"""What a matmul of few rows costs in eager PyTorch (MKL on x86), by row count.

    python benchmarks/small_gemm.py [--threads 1] [--iters 300]

The weight shapes of the embedded model's decode step (the vocabulary head, the fused
attention input projection, an expert's fused gate/up, the output projection), each
multiplied by M = 1, 2, 4, 8 and 16 rows: median CPU time per call and its ratio to
M = 1. A weight-bound matmul should cost about the same for 1 and 2 rows (the weight is
read once either way); where 2 rows cost about twice 1, a decode step of 1 + K tokens
pays for every token in full, which is what `--compile`'s C++ micro-GEMM avoids
(dsv4/engine/compile/env.py `CPU_OPTIONS`, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# (name, out_features, in_features) of the embedded model (dsv4/assets/tiny-shakespeare)
SHAPES = [("head", 4096, 256), ("CSA layer's fused input projections", 580, 256),
          ("shared expert w1|w3", 384, 256), ("wo_b", 256, 256), ("wq_b", 256, 128), ("shared expert w2", 256, 192)]
ROWS = [1, 2, 4, 8, 16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), MKL: {torch.backends.mkl.is_available()}\n")
    print("| weight | " + " | ".join(f"M = {m} us" for m in ROWS) + " | M = 2 / M = 1 |")
    print("|---|" + "---|" * (len(ROWS) + 1))
    with torch.inference_mode():
        for name, n, k in SHAPES:
            w = torch.randn(n, k)
            us = []
            for m in ROWS:
                x = torch.randn(m, k)
                for _ in range(20):
                    torch.mm(x, w.t())
                ts = []
                for _ in range(a.iters):
                    t = time.process_time()
                    torch.mm(x, w.t())
                    ts.append(time.process_time() - t)
                us.append(1e6 * statistics.median(ts))
            print(f"| {name} [{n} x {k}] | " + " | ".join(f"{u:.1f}" for u in us) + f" | {us[1] / us[0]:.2f}x |")


if __name__ == "__main__":
    main()
