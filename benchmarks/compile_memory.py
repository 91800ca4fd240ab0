"""Resident memory of a `--compile` start against an eager one (docs/compile.md, 'Memory').

    XDG_CACHE_HOME=$(mktemp -d) python benchmarks/compile_memory.py DIR [--quantization w8a8] [--eager]

Starts an engine on DIR with one decode bucket (one sequence, K = 0, --max-model-len 256),
compiled (a cold cache builds it in this process) or with --eager not, while a thread samples
VmRSS every 50 ms; prints the start's seconds, the RSS after it, the peak, the compile banner
and the memory plan of the same configuration.
"""

from __future__ import annotations

import argparse
import threading
import time

from dsv4 import LLM
from dsv4.engine.memory_plan import memory_plan


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--quantization", default="w8a8")
    p.add_argument("--eager", action="store_true", help="no compile: the baseline")
    a = p.parse_args()
    peak = [0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], _rss())
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    t = time.perf_counter()
    llm = LLM(a.model, quantization=a.quantization, compile=not a.eager, max_num_seqs=1, num_speculative_tokens=0,
              max_model_len=256, enable_prefix_caching=False)
    secs, now = time.perf_counter() - t, _rss()
    print(f"start {secs:.1f} s; RSS {now / 2**30:.2f} GiB after it, peak {max(peak[0], now) / 2**30:.2f} GiB; "
          f"{llm.engine.compile_note}")
    print(memory_plan(llm.engine.config).render())


if __name__ == "__main__":
    main()
