#!/usr/bin/env python3
"""What one decode-shaped dispatch of the embedded model costs, by shape.

    python benchmarks/step_costs.py [--device cpu] [--threads N] [--iters 50] [--compile]

Shapes (every row at position 256 after a 256-token prompt, as in a real decode step):
a 1-token step, a 2-token verify (K = 1), a 4-token verify (K = 3), a batch-8 step
(8 rows of 1 token), a batch-8 verify of 2 tokens each, and the MTP dispatch for one and
for eight requests. Each is run `--iters` times after a warm-up, the state rolled back
in between, and reported as the median of CPU time per dispatch (process time on the
CPU: other tenants of a shared machine do not count) or wall time on a GPU (synchronised),
with its ratio to the 1-token step. These are the costs `--num-speculative-tokens auto`
weighs (the engine times the same dispatches while it serves).

`--compile` adds a column for `torch.compile(dynamic=False)` of the same dispatch
(inductor; one compile per shape, which takes minutes on a small CPU). The dispatch
has host-side steps inside every layer (Sinkhorn in Python floats, RoPE and entry
counts read back with `int(t.max())`, the MoE's expert list with `tolist()`), so dynamo
splits it into many graphs; see BENCHMARKS.md for what that measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dsv4
from dsv4.model.loader import load_model
from dsv4.model.state import Batch

PROMPT = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    model = load_model(dsv4.DEFAULT_MODEL, device=dev, dtype=torch.float32)
    state = model.new_state(8, 1024, max_chunk=129, max_spec=4)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for s in range(8):  # 256-token prompts in every slot, MTP cache included
            ids = torch.randint(2, 4096, (PROMPT + 1,), generator=g).tolist()
            for lo in range(0, PROMPT, 128):
                h, _ = model.forward_batch(Batch.build([(s, lo, ids[lo:lo + 128])], dev), state)
                model.mtp_forward(Batch.build([(s, lo, ids[lo + 1:lo + 129])], dev), h, state)

    def main_step(rows: int, n: int):
        def setup():
            for s in range(rows):
                state.rollback(s, PROMPT)
            return Batch.build([(s, PROMPT, [7] * n) for s in range(rows)], dev)
        return setup, lambda fn, b: fn(b, state, torch.arange(rows * n, device=dev))

    def mtp_step(rows: int):
        hid = torch.randn(rows, model.cfg.hc_mult, model.cfg.hidden_size, device=dev)

        def setup():
            for s in range(rows):
                state.rollback(s, state.lengths[s], mtp_length=PROMPT)
            return Batch.build([(s, PROMPT, [7]) for s in range(rows)], dev)
        return setup, lambda fn, b: fn(b, hid, state, torch.arange(rows, device=dev))

    shapes = {"1-token step": (main_step(1, 1), "main"), "2-token verify (K = 1)": (main_step(1, 2), "main"),
              "4-token verify (K = 3)": (main_step(1, 4), "main"), "batch-8 step": (main_step(8, 1), "main"),
              "batch-8 verify, 2 tokens each": (main_step(8, 2), "main"), "MTP dispatch, 1 request": (mtp_step(1), "mtp"),
              "MTP dispatch, 8 requests": (mtp_step(8), "mtp")}
    clock = time.perf_counter if cuda else time.process_time

    def measure(fn, setup, call) -> float:
        times = []
        with torch.inference_mode():
            for i in range(a.iters + 3):
                b = setup()
                if cuda:
                    torch.cuda.synchronize()
                t = clock()
                call(fn, b)
                if cuda:
                    torch.cuda.synchronize()
                if i >= 3:
                    times.append(clock() - t)
        return statistics.median(times) * 1e3

    rows = []
    for name, ((setup, call), kind) in shapes.items():
        eager_fn = model.forward_batch if kind == "main" else model.mtp_forward
        eager = measure(eager_fn, setup, call)
        comp = None
        if a.compile:
            fn = torch.compile(eager_fn, dynamic=False)
            comp = measure(fn, setup, call)
        rows.append((name, eager, comp))
        print(f"{name}: eager {eager:.3f} ms" + (f", compiled {comp:.3f} ms" if comp else ""), flush=True)
    base = rows[0][1]
    what = "wall ms (synchronised)" if cuda else "CPU ms"
    print(f"\n| dispatch ({a.device}, threads {torch.get_num_threads()}) | eager {what} | vs 1-token step |"
          + (" compiled | compiled / eager |" if a.compile else ""))
    print("|---|---|---|" + ("---|---|" if a.compile else ""))
    for name, eager, comp in rows:
        extra = f" {comp:.2f} | {comp / eager:.2f}x |" if comp else ""
        print(f"| {name} | {eager:.2f} | {eager / base:.2f}x |{extra}")


if __name__ == "__main__":
    main()
