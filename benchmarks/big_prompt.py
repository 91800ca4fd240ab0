#!/usr/bin/env python3
"""Latency of a small request while huge prompts arrive, against none arriving (issue 11).

    python benchmarks/big_prompt.py [--requests 8] [--tokens 32] [--senders 3]

Starts `dsv4 serve` (the embedded model, --max-model-len 8192, one thread) on a
temporary socket, then measures `--requests` small streamed requests (`--tokens`
greedy tokens each) one after the other in three scenarios:

* none:     nothing else arrives;
* 4 MiB:    `--senders` clients keep sending 4 MiB prompts (refused by the byte cap
            of --max-model-len before tokenizing);
* 400 KiB:  the same with 400 KiB prompts, under the byte cap, so they are tokenized
            (on the daemon's worker thread, about 0.5 s each) and then refused for length.

It prints the median and worst end-to-end latency and worst gap between two tokens of
the small requests per scenario, and each as a ratio to the `none` scenario of the same
run. A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv4.daemon.client import Client, DaemonError  # noqa: E402
from serve_daemon import serving  # noqa: E402


def small_request(ep: str, tokens: int) -> tuple[float, float]:
    """(end-to-end seconds, worst gap between two deltas) of one small streamed request."""
    with Client(ep) as c:
        c.connect()
        t0 = time.monotonic()
        rid = c.generate("To be, or not to be", {"max_tokens": tokens, "ignore_eos": True})
        times = [t0]
        for msg in c.stream(rid):
            times.append(time.monotonic())
        return times[-1] - t0, max(b - a for a, b in zip(times, times[1:]))


def sender(ep: str, size: int, stop: "multiprocessing.synchronize.Event", refused: "multiprocessing.Value") -> None:
    """A separate process: send `size`-byte prompts one after the other until `stop`."""
    text = ("All the world's a stage, and all the men and women merely players. " * (size // 68 + 1))[:size]
    with Client(ep) as c:
        c.connect()
        while not stop.is_set():
            try:
                list(c.stream(c.generate(text, {"max_tokens": 1})))
            except DaemonError:
                with refused.get_lock():
                    refused.value += 1  # refused, as it should be


def scenario(ep: str, size: int, args: argparse.Namespace) -> dict[str, float]:
    mp = multiprocessing.get_context("spawn")
    stop, refused = mp.Event(), mp.Value("i", 0)
    procs = [mp.Process(target=sender, args=(ep, size, stop, refused), daemon=True)
             for _ in range(args.senders if size else 0)]
    for p in procs:
        p.start()
    time.sleep(3.0 if size else 0)  # let the senders start and get going
    e2e, gaps = [], []
    for _ in range(args.requests):
        a, g = small_request(ep, args.tokens)
        e2e.append(a)
        gaps.append(g)
    stop.set()
    for p in procs:
        p.join(60)
    return {"median_e2e": statistics.median(e2e), "max_e2e": max(e2e), "max_gap": max(gaps),
            "refused": refused.value}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--senders", type=int, default=3)
    args = ap.parse_args()
    with serving("--max-model-len", "8192") as ep:
        small_request(ep, args.tokens)  # warm-up
        results = {name: scenario(ep, size, args) for name, size in
                   (("none", 0), ("4 MiB", 4 << 20), ("400 KiB", 400 << 10))}
    base = results["none"]
    print(f"{args.requests} small requests of {args.tokens} tokens each; {args.senders} senders of big prompts")
    print(f"{'scenario':<10} {'median e2e':>12} {'worst e2e':>12} {'worst gap':>12} {'x none (median)':>16} "
          f"{'big refused':>12}")
    for name, r in results.items():
        print(f"{name:<10} {r['median_e2e'] * 1000:>10.0f}ms {r['max_e2e'] * 1000:>10.0f}ms "
              f"{r['max_gap'] * 1000:>10.0f}ms {r['median_e2e'] / base['median_e2e']:>15.2f}x {r['refused']:>12}")


if __name__ == "__main__":
    main()
