#!/usr/bin/env python3
"""Time to first token against prompt length, for several prefill chunk sizes, in one process.

    python benchmarks/prefill_chunk.py --model DIR --quantization w8a8 --chunks 128,256,512,1024,2048 \
        --lengths 128,144,192,256,512,1024,2048

The model loads once (its state sized for the largest chunk); each chunk size is then set on
the scheduler (what `--max-num-batched-tokens` sets at startup) and each prompt (random ids,
prefix caching off, one request at a time) is timed from `add_request` to its first token,
`--reps` times (the median is printed). Prints a markdown table with the load average. It
is how DEFAULT_CHUNK (dsv4/engine/config.py) was chosen; see BENCHMARKS.md "Prefill chunk".
`--row-spans 64,100000` times each chunk with attention in spans of 64 queries and in one
matmul over the chunk (what attention did before spans).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.model import attention  # noqa: E402


def ttft(llm: LLM, prompt: list[int]) -> float:
    eng = llm.engine
    t0 = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), prompt_mode="raw")
    while True:
        for out in eng.step():
            if out.request_id == rid and out.token_ids:
                dt = time.perf_counter() - t0
                while eng.has_unfinished():
                    eng.step()
                return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--chunks", default="128,256,512,1024,2048")
    ap.add_argument("--lengths", default="128,144,192,256,512,1024,2048")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--row-spans", default=None,
                    help="also time each chunk size under these attention spans (model/attention.py ROW_SPAN; "
                         "a span >= the chunk: one matmul over the whole chunk, as before spans)")
    a = ap.parse_args()
    chunks = [int(x) for x in a.chunks.split(",")]
    lengths = [int(x) for x in a.lengths.split(",")]
    llm = LLM(a.model, quantization=a.quantization, max_num_seqs=1, max_model_len=max(lengths) + 8,
              max_num_batched_tokens=max(chunks), num_speculative_tokens=0, enable_prefix_caching=False,
              threads=a.threads)
    sched = llm.engine.scheduler
    vocab = llm.engine.config.model_config.vocab_size
    rng = random.Random(0)
    ttft(llm, [rng.randrange(2, vocab) for _ in range(16)])  # warm-up
    rows = {}
    spans = [int(x) for x in a.row_spans.split(",")] if a.row_spans else [attention.ROW_SPAN]
    keys = [(c, sp) for c in chunks for sp in spans]
    for c, sp in keys:
        sched.chunk_size, sched.budget = c, c
        attention.ROW_SPAN = sp
        for n in lengths:
            rows[(c, sp), n] = statistics.median(ttft(llm, [rng.randrange(2, vocab) for _ in range(n)])
                                                 for _ in range(a.reps))
            print(f"chunk {c} span {sp} length {n}: {rows[(c, sp), n]:.3f} s", file=sys.stderr, flush=True)
    print(f"\nTTFT (s, median of {a.reps}) against prompt length; {a.model}, quantization "
          f"{llm.engine.config.quantization}, {llm.engine.config.threads} threads; load average "
          f"{os.getloadavg()[0]:.2f} at the end\n")
    print("| chunk | attention span | " + " | ".join(str(n) for n in lengths) + " | 144 / 128 |")
    print("| --- " * (len(lengths) + 3) + "|")
    for k in keys:
        ratio = f"{rows[k, 144] / rows[k, 128]:.2f}x" if (k, 144) in rows and (k, 128) in rows else "-"
        print(f"| {k[0]} | {k[1]} | " + " | ".join(f"{rows[k, n]:.2f}" for n in lengths) + f" | {ratio} |")


if __name__ == "__main__":
    main()
