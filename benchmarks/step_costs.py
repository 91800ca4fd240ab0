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

`--compile` adds a column for the captured dispatch of `--compile` (dsv4/engine/compile/compiled.py:
`torch.compile(fullgraph=True, dynamic=False)` of the model's own `forward_batch` on a static
decode dispatch (`Batch.static_step`), padded to its
bucket of 1, 2, 4, 8 or 16 tokens; one compile per bucket, about two minutes each on a
2-core CPU when the inductor cache is cold), with the time each capture took.
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
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    model = load_model(dsv4.DEFAULT_MODEL, device=dev, dtype=torch.float32)
    state = model.new_state(9, 1024, max_chunk=129, max_spec=4)  # slot 8: the compiled buckets' scratch
    steps = None
    if a.compile:
        from dsv4.engine.compile.env import private_cache_dir
        from dsv4.engine.compile.compiled import CompiledSteps

        private_cache_dir()
        steps = CompiledSteps(model, state, 16, mode=a.compile_mode)
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
        idx = torch.arange(rows * n, device=dev)
        return setup, lambda fn, b: fn(b, state, idx) if fn is not None else steps.main(b, idx)

    def mtp_step(rows: int):
        with torch.inference_mode():  # as the runner's hidden rows (a compiled bucket guards on it)
            hid = torch.randn(rows, model.cfg.hc_mult, model.cfg.hidden_size, device=dev)

        def setup():
            for s in range(rows):
                state.rollback(s, state.lengths[s], mtp_length=PROMPT)
            return Batch.build([(s, PROMPT, [7]) for s in range(rows)], dev)
        idx = torch.arange(rows, device=dev)
        return setup, lambda fn, b: fn(b, hid, state, idx) if fn is not None else steps.mtp(b, hid, idx)

    shapes = {"1-token step": (main_step(1, 1), "main", 1), "2-token verify (K = 1)": (main_step(1, 2), "main", 2),
              "4-token verify (K = 3)": (main_step(1, 4), "main", 4), "batch-8 step": (main_step(8, 1), "main", 8),
              "batch-8 verify, 2 tokens each": (main_step(8, 2), "main", 16),
              "MTP dispatch, 1 request": (mtp_step(1), "mtp", 1), "MTP dispatch, 8 requests": (mtp_step(8), "mtp", 8)}
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
    for name, ((setup, call), kind, bucket) in shapes.items():
        eager_fn = model.forward_batch if kind == "main" else model.mtp_forward
        comp = None
        if steps is not None:
            secs = steps.capture({(kind, bucket)})
            print(f"{name}: captured the {kind} bucket of {bucket} in {secs:.1f} s", flush=True)
            assert steps.ready.get((kind, bucket)), steps.failed
            calls = steps.calls[kind]
            comp, eager = measure(None, setup, call), measure(eager_fn, setup, call)
            comp = min(comp, measure(None, setup, call))  # eager between two compiled runs: drift shows
            assert steps.calls[kind] > calls
        else:
            eager = measure(eager_fn, setup, call)
        rows.append((name, eager, comp))
        print(f"{name}: eager {eager:.3f} ms" + (f", compiled {comp:.3f} ms" if comp else ""), flush=True)
    base = rows[0][1]
    what = "wall ms (synchronised)" if cuda else "CPU ms"
    print(f"\n| dispatch ({a.device}, threads {torch.get_num_threads()}) | eager {what} | vs 1-token step |"
          + (" compiled | vs compiled 1-token step | compiled / eager |" if a.compile else ""))
    print("|---|---|---|" + ("---|---|---|" if a.compile else ""))
    cbase = rows[0][2]
    for name, eager, comp in rows:
        extra = f" {comp:.2f} | {comp / cbase:.2f}x | {comp / eager:.2f}x |" if comp else ""
        print(f"| {name} | {eager:.2f} | {eager / base:.2f}x |{extra}")


if __name__ == "__main__":
    main()
