#!/usr/bin/env python3
"""The cost of turning logits into a sampling distribution, against sorting every row whole.

    python benchmarks/sampling.py [--threads 2] [--reps 30]

`sampling.logits_to_probs` (temperature, top-k, top-p, min-p) looks at each row's top
`CANDIDATES` tokens first and sorts the whole vocabulary only for rows whose kept tokens
may lie beyond them. The peer, timed in the same run: the same processing with every row
sorted whole (what dsv4 did before). Vocabularies of the embedded model (4096) and V4
(129280); 1, 4 and 8 rows; logits peaked (N(0, 6^2): a top-p nucleus of a few tokens) and
broad (N(0, 1): the nucleus reaches past the candidates, so both sort); without top-k and
top-p nothing needs an order. Median of `--reps`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.engine.sampling import logits_to_probs  # noqa: E402


def sort_whole(x: torch.Tensor, t: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The peer: temperature, top-k and top-p over every row sorted whole."""
    v = x.shape[-1]
    s, order = (x / t[:, None]).sort(dim=-1, descending=True)
    kk = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
    s = s.masked_fill(torch.arange(v)[None, :] >= kk[:, None], float("-inf"))
    q = s.softmax(-1)
    drop = ((q.cumsum(-1) - q) > p[:, None]) & (p < 1)[:, None]
    drop[:, 0] = False
    return torch.zeros_like(x).scatter_(-1, order, s.masked_fill(drop, float("-inf")).softmax(-1))


def median_us(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e6 * sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print("| vocabulary | rows | parameters | logits | dsv4 us | sort every row us | ratio |")
    print("|---|---|---|---|---|---|---|")
    for v in (4096, 129280):
        for n in (1, 4, 8):
            for name, (t, k, p) in {"top-k 50, top-p 0.95, T 0.8": (0.8, 50, 0.95),
                                    "top-p 0.95, T 1": (1.0, 0, 0.95),
                                    "T 0.7 only (the OpenAI API's defaults)": (0.7, 0, 1.0)}.items():
                for kind, scale in (("peaked", 6.0), ("broad", 1.0)):
                    if (k or p == 1) and kind == "broad":
                        continue  # top-k (or no truncation) takes one way whatever the logits
                    x = torch.randn(n, v, generator=g) * scale
                    tt, kk, pp = torch.full((n,), t), torch.full((n,), k, dtype=torch.long), torch.full((n,), p)
                    ours = median_us(lambda: logits_to_probs(x, tt, kk, pp, torch.zeros(n)), a.reps)
                    peer = median_us(lambda: sort_whole(x, tt, kk, pp), a.reps)
                    print(f"| {v} | {n} | {name} | {kind} | {ours:.0f} | {peer:.0f} | {peer / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
