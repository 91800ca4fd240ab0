"""Keep a compiled decode bucket only where it wins: timed against eager at startup.

A compiled program is not faster everywhere: on the DeepSeek V4 Flash-shaped slice a w8a8
bucket ran far slower than eager, while the embedded model's buckets run several times faster
(figures: docs/compile.md, 'dsv4/engine/compile/bucket_check.py'). So each bucket, once captured or loaded, runs the same scratch dispatch
compiled and eager (the model's own code, uncompiled, on the same static dispatch: the
same work), best of a few runs each, and stays compiled only when it is not slower than
eager by more than `MARGIN`; otherwise it runs eager, with one log line giving both times.

Only on a CPU with one rank: under tensor parallelism the ranks would have to agree on
timings that differ between them (a rank running a bucket eagerly while another runs it
compiled is fine for the results, but the decision would need a collective), and a GPU
needs synchronised timing (`scripts/gpu_check.sh` measures it instead).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

MARGIN = 1.05  # compiled may cost up to this much of eager (timing noise) and still be kept
REPS = 3


def best_time(fn: Callable[[], object], reps: int = REPS) -> float:
    """Seconds of the fastest of `reps` calls of `fn`, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def compare(eager: Callable[[], object], compiled: Callable[[], object]) -> tuple[bool, float, float]:
    """(keep compiled, compiled seconds, eager seconds) for one dispatch."""
    tc, te = best_time(compiled), best_time(eager)
    return tc <= MARGIN * te, tc, te
