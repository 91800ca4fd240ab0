#!/usr/bin/env python3
"""Where one request's generation spends its time: cProfile around `LLM.generate`.

    python benchmarks/profile_engine.py [--compile] [--k 1] [--tokens 96] [--threads 2] [--top 25]

The embedded model, one held-out-style prompt, greedy, after one warm-up generation (and,
with --compile, after the capture: cold the first time, then from the inductor cache).
Prints tokens/s, the share of the wall time inside the model dispatches (compiled
programs or eager forwards) against the engine's Python around them, the per-call cost
of each dispatch kind, then pstats' top functions by internal time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import dsv4
from dsv4 import LLM, SamplingParams

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
# runner functions whose cumulative time is "inside a model dispatch"
DISPATCHES = {"_forward": "main-model dispatch", "_mtp_forward": "MTP dispatch"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--k", type=int, default=1, help="--num-speculative-tokens")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t = time.monotonic()
    llm = LLM(dsv4.DEFAULT_MODEL, max_model_len=1024, compile=a.compile, num_speculative_tokens=a.k,
              max_num_seqs=1)
    print(f"ready in {time.monotonic() - t:.1f} s; {llm.engine.compile_note or 'eager'}")
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    llm.generate([PROMPT], sp)  # warm-up
    prof = cProfile.Profile()
    t = time.monotonic()
    prof.enable()
    llm.generate([PROMPT], sp)
    prof.disable()
    wall = time.monotonic() - t
    st = pstats.Stats(prof)
    steps = next((v[0] for k, v in st.stats.items() if k[2] == "step" and k[0].endswith("engine.py")), 0)
    print(f"{a.tokens} tokens in {wall:.3f} s: {a.tokens / wall:.1f} tok/s, {steps} engine steps "
          f"({a.tokens / max(steps, 1):.2f} tokens a step)")
    inside = 0.0
    for (file, _, fn), (_, ncalls, _, cum, _) in st.stats.items():
        if fn in DISPATCHES and file.endswith("runner.py"):
            inside += cum
            print(f"  {DISPATCHES[fn]}: {ncalls} calls, {1e3 * cum / max(ncalls, 1):.2f} ms a call, "
                  f"{100 * cum / wall:.0f} % of the wall time")
    print(f"  outside the dispatches (scheduling, sampling, verification, bookkeeping): "
          f"{100 * (wall - inside) / wall:.0f} %")
    st.sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
