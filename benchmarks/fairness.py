#!/usr/bin/env python3
"""Latency of a 1-token request while one client floods the daemon, against none flooding (issue 21).

    python benchmarks/fairness.py [--streams 64] [--flood-tokens 64] [--probes 5]

Starts `dsv4 serve` (the embedded model, default --max-num-seqs 8, one thread) on a
temporary socket, then measures `--probes` probe requests (a short prompt, max_tokens 1,
each on its own connection, one after the other) in two scenarios:

* none:   nothing else runs;
* flood:  one other client (one connection, a separate process) keeps `--streams`
          requests of `--flood-tokens` greedy tokens in flight, submitting a new one
          as each finishes.

The daemon's engine has far fewer slots than the flood has requests, so the probe has to
be admitted past the flood's waiting requests: first come first served, it waits for all
of them; with fair admission across clients it takes the next free slot. Prints the
median and worst latency per scenario and the flood/none ratio of the medians. A
benchmark, not a test: nothing is asserted.
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

from dsv4.daemon.client import Client  # noqa: E402
from serve_daemon import serving  # noqa: E402

PROMPT = "To be, or not to be"


def probe(ep: str) -> float:
    """Seconds from sending one 1-token request to its final message."""
    with Client(ep) as c:
        c.connect()
        t0 = time.monotonic()
        for _ in c.stream(c.generate(PROMPT, {"max_tokens": 1, "temperature": 0})):
            pass
        return time.monotonic() - t0


def flooder(ep: str, streams: int, tokens: int, stop: "multiprocessing.synchronize.Event",
            started: "multiprocessing.synchronize.Event") -> None:
    """A separate process: keep `streams` requests in flight on one connection until `stop`."""
    params = {"max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    with Client(ep) as c:
        c.connect()
        live = {c.generate(PROMPT, params) for _ in range(streams)}
        firsts = 0
        for msg in c.events():
            if msg["type"] == "delta" and not started.is_set():
                firsts += 1
                if firsts >= 2:
                    started.set()  # the flood is running; the rest of it is waiting for slots
            if msg["type"] in ("final", "error"):
                live.discard(msg.get("id"))
                if stop.is_set():
                    if not live:
                        return
                else:
                    live.add(c.generate(PROMPT, params))


def scenario(ep: str, flood: bool, args: argparse.Namespace) -> list[float]:
    mp = multiprocessing.get_context("spawn")
    stop, started = mp.Event(), mp.Event()
    proc = None
    if flood:
        proc = mp.Process(target=flooder, args=(ep, args.streams, args.flood_tokens, stop, started), daemon=True)
        proc.start()
        if not started.wait(120):
            raise RuntimeError("the flood did not start within 120 s")
    try:
        return [probe(ep) for _ in range(args.probes)]
    finally:
        stop.set()
        if proc is not None:
            proc.join(600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64, help="requests the flooding client keeps in flight")
    ap.add_argument("--flood-tokens", type=int, default=64, help="tokens of each flood request")
    ap.add_argument("--probes", type=int, default=5, help="1-token requests measured per scenario")
    args = ap.parse_args()
    with serving("--threads", "1") as ep:
        probe(ep)  # warm-up
        results = {"none": scenario(ep, False, args), "flood": scenario(ep, True, args)}
    base = statistics.median(results["none"])
    print(f"{args.probes} probes of 1 token; flood: one client with {args.streams} streams of "
          f"{args.flood_tokens} tokens")
    print(f"{'scenario':<8} {'median':>10} {'worst':>10} {'x none (median)':>16}")
    for name, r in results.items():
        med = statistics.median(r)
        print(f"{name:<8} {med * 1000:>8.0f}ms {max(r) * 1000:>8.0f}ms {med / base:>15.1f}x")


if __name__ == "__main__":
    main()
