#!/usr/bin/env python3
"""A/B of two revisions of dsv4 on this machine: decode cost per token, alternating runs.

    python benchmarks/ab.py REV_A [REV_B] [--rounds 3] [--threads 1] [--k 0] [--tokens 128]

REV_B defaults to the working tree. Each revision is checked out into a temporary git
worktree; the two then run one after the other, `--rounds` times, each run a fresh
process that generates `--tokens` greedy tokens after a fixed random 256-token prompt
with the embedded model (after one warm-up generation). It reports the best process
CPU time per token of each side and the ratio.

Why this shape: these machines are shared, and wall-clock times drift by 10-20% from
one minute to the next, more than most single optimisations gain. Alternating the two
sides spreads the drift over both, CPU time leaves out the time other tenants take,
and one thread (the default) leaves out OpenMP's spinning. Use it to decide whether a
change is worth keeping; report speed with `benchmarks/run.py`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(threads: int, k: int, tokens: int) -> None:
    import torch

    torch.set_num_threads(threads)
    import dsv4
    from dsv4 import LLM, SamplingParams

    prompt = torch.randint(2, 4096, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(dsv4.DEFAULT_MODEL, num_speculative_tokens=k, max_num_seqs=1, max_model_len=1024)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params)
    t = time.process_time()
    llm.generate([prompt], params)
    print(f"{(time.process_time() - t) / tokens * 1e3:.4f}")


def measure(tree: Path, a: argparse.Namespace) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--threads", str(a.threads),
           "--k", str(a.k), "--tokens", str(a.tokens)]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev_a", nargs="?")
    ap.add_argument("rev_b", nargs="?", help="default: the working tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=0, help="MTP drafts per step")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.threads, a.k, a.tokens)
    if not a.rev_a:
        ap.error("name the revision to compare against (REV_A)")
    with tempfile.TemporaryDirectory(prefix="dsv4-ab-") as tmp:
        trees, added = [], []
        for i, rev in enumerate([a.rev_a, a.rev_b]):
            if rev is None:
                trees.append(ROOT)
                continue
            path = Path(tmp) / f"side{i}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), rev], check=True)
            trees.append(path)
            added.append(path)
        try:
            best = [float("inf"), float("inf")]
            for r in range(a.rounds):
                for i, tree in enumerate(trees):
                    ms = measure(tree, a)
                    best[i] = min(best[i], ms)
                    print(f"round {r + 1} {'AB'[i]}: {ms:.3f} ms/token", flush=True)
        finally:
            for path in added:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
    names = [a.rev_a, a.rev_b or "working tree"]
    print(f"A {names[0]}: {best[0]:.3f} ms/token   B {names[1]}: {best[1]:.3f} ms/token   "
          f"B/A {best[1] / best[0]:.3f} (CPU time, {a.threads} thread(s), K={a.k}, best of {a.rounds})")


if __name__ == "__main__":
    main()
