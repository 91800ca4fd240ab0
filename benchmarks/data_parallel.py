#!/usr/bin/env python3
"""Engine replicas (`serve --data-parallel-size`) against one engine with the same cores, in one run.

    python benchmarks/data_parallel.py [--rounds 2] [--sections throughput,rotation,hosts]

* throughput: 32 requests of 256-token held-out prompts, 64 greedy tokens each (ignore_eos),
  8 in flight, through a real daemon on the embedded model: output tokens per second of wall
  time with `--data-parallel-size 2 --threads 1` (two engines, each pinned to one core)
  against `--threads 2` (one engine, both cores). The arms alternate round after round, and
  the ratio compares arms of the same round (the machine's other tenants drift).
* rotation: the agentic workload of benchmarks/prefix_cache.py through the daemon: 4 system
  prompts of 2048 tokens in rotation, 100 requests (a 64-token user message, 8 new tokens),
  4 in flight, two replicas: the prefix cache's hit rate (over every replica's prompt tokens)
  with routing by cached prefix, by load alone and at random ($DSV4_ROUTING), and one engine's.

* hosts: the throughput workload with replica 1 joined over TCP (`--data-parallel-rank 1`,
  loopback) against both replicas on one host, one core per replica in both arms.

Markdown tables on stdout; the load average beside each run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import heldout_prompts  # noqa: E402
from serve_daemon import serving  # noqa: E402

import dsv4  # noqa: E402
from dsv4.daemon.client import Client  # noqa: E402
from dsv4.engine.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def drive(ep: str, prompts: list[list[int]], params: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """Keep `concurrency` requests in flight on the daemon at `ep` until all are answered."""
    todo, live, tokens, ttfts = list(prompts), {}, 0, []
    with Client(ep) as c:
        c.connect(timeout_s=30)
        t0 = time.monotonic()
        while todo or live:
            while todo and len(live) < concurrency:
                live[c.generate(todo.pop(0), params)] = [time.monotonic(), None]
            msg = c.recv(0.5)
            c.heartbeat()
            if msg is None or msg.get("id") not in live:
                continue
            if msg["type"] == "error":
                raise SystemExit(f"request failed: {msg.get('message')}")
            if msg["type"] == "delta":
                tokens += len(msg.get("token_ids") or [])
                if live[msg["id"]][1] is None:
                    live[msg["id"]][1] = time.monotonic() - live[msg["id"]][0]
                    ttfts.append(live[msg["id"]][1])
            elif msg["type"] == "final":
                if msg.get("finish_reason") == "error":
                    raise SystemExit(f"request failed: {msg.get('error')}")
                del live[msg["id"]]
        wall = time.monotonic() - t0
        st = c.status()
    return {"tok_s": tokens / wall, "wall_s": wall, "ttft_ms": 1000 * statistics.mean(ttfts), "status": st}


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def throughput(text: list[int], rounds: int) -> None:
    prompts = [text[i * 256:(i + 1) * 256] for i in range(32)]
    params = {"max_tokens": 64, "ignore_eos": True, "temperature": 0}
    arms = {"1 engine x 2 threads": ["--threads", "2"],
            "2 engines x 1 thread": ["--data-parallel-size", "2", "--threads", "1"]}
    rates: dict[str, list[float]] = {a: [] for a in arms}
    print("\n| round | arm | output tok/s | mean TTFT | wall | machine |\n|---|---|---|---|---|---|")
    for r in range(rounds):
        for arm, flags in arms.items():
            with serving(*flags) as ep:
                drive(ep, prompts[:4], params, 4)  # warm-up: first dispatches, calibration
                res = drive(ep, prompts, params, 8)
            rates[arm].append(res["tok_s"])
            print(f"| {r + 1} | {arm} | {res['tok_s']:.1f} | {res['ttft_ms']:.0f} ms | {res['wall_s']:.1f} s | {load()} |",
                  flush=True)
    one, two = (statistics.median(v) for v in rates.values())
    ratios = [b / a for a, b in zip(*rates.values())]
    print(f"\n2 engines x 1 thread / 1 engine x 2 threads, output tok/s at concurrency 8: "
          f"**{two / one:.2f}x** (median of rounds; per round {', '.join(f'{x:.2f}' for x in ratios)})")


def hosts(text: list[int], rounds: int) -> None:
    """Replica 1 joined over TCP (--data-parallel-rank 1 on loopback) against both replicas
    on one host: what the link costs. One core per replica in both arms (taskset)."""
    prompts = [text[i * 256:(i + 1) * 256] for i in range(32)]
    params = {"max_tokens": 64, "ignore_eos": True, "temperature": 0}
    key, port = "bench-replica-key", 29000 + os.getpid() % 1000
    dp = ["--data-parallel-size", "2", "--threads", "1"]
    joined = [*dp, "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)]
    rates: dict[str, list[float]] = {"one host": [], "replica 1 over TCP": []}
    print("\n| round | arm | output tok/s | mean TTFT | wall | machine |\n|---|---|---|---|---|---|")
    for r in range(rounds):
        for arm in rates:
            remote = arm != "one host"
            os.environ.pop("DSV4_API_KEY", None)
            if remote:
                os.environ["DSV4_API_KEY"] = key
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                member = subprocess.Popen(["taskset", "-c", "1", str(Path(sys.executable).parent / "dsv4"), "serve",
                                           *joined, "--data-parallel-rank", "1"], env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                with serving(*(joined + ["--data-parallel-size-local", "1"] if remote else dp),
                             prefix=("taskset", "-c", "0") if remote else (), key=key if remote else None) as ep:
                    drive(ep, prompts[:4], params, 4)
                    res = drive(ep, prompts, params, 8)
            finally:
                if remote:
                    member.wait(30)
            rates[arm].append(res["tok_s"])
            print(f"| {r + 1} | {arm} | {res['tok_s']:.1f} | {res['ttft_ms']:.0f} ms | {res['wall_s']:.1f} s | {load()} |",
                  flush=True)
    os.environ.pop("DSV4_API_KEY", None)
    one, tcp = (statistics.median(v) for v in rates.values())
    print(f"\nreplica 1 over TCP / both on one host, output tok/s at concurrency 8: **{tcp / one:.2f}x** (median)")


def rotation(text: list[int], requests: int) -> None:
    systems = [text[i * 2048:(i + 1) * 2048] for i in range(4)]
    msgs = [text[8192 + 64 * j:8192 + 64 * (j + 1)] for j in range(requests)]
    prompts = [systems[j % 4] + msgs[j] for j in range(requests)]
    params = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}
    print(f"\n| routing | engines | prefix cache hit | per replica (hit, requests) | mean TTFT | wall | machine |"
          f"\n|---|---|---|---|---|---|---|")
    for routing, flags in (("prefix", ["--data-parallel-size", "2", "--threads", "1"]),
                           ("load", ["--data-parallel-size", "2", "--threads", "1"]),
                           ("random", ["--data-parallel-size", "2", "--threads", "1"]),
                           ("(one engine)", ["--threads", "1"])):
        os.environ["DSV4_ROUTING"] = routing if not routing.startswith("(") else "prefix"
        with serving(*flags, "--max-model-len", "8192") as ep:
            res = drive(ep, prompts, params, 4)
        st = res["status"]
        q, h = st.get("prefix_cache_queries") or 0, st.get("prefix_cache_hits") or 0
        per = ", ".join(f"{r['prefix_cache_hit_rate']:.0%} of {sum(r['routed'].values())}"
                        for r in st.get("replicas") or [])
        print(f"| {routing} | {st.get('data_parallel_size', 1)} | **{h / q:.1%}** of {q} tokens | {per or '-'} | "
              f"{res['ttft_ms']:.0f} ms | {res['wall_s']:.1f} s | {load()} |", flush=True)
    os.environ.pop("DSV4_ROUTING", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sections", default="throughput,rotation")
    ap.add_argument("--requests", type=int, default=100)
    a = ap.parse_args()
    tok = Tokenizer.from_dir(dsv4.DEFAULT_MODEL)
    text = heldout_prompts(tok, ROOT / "data" / "shakespeare", 1, 8192 + 64 * a.requests)[0]
    print(f"# engine replicas on {os.cpu_count()} CPUs ({load()})")
    for name in a.sections.split(","):
        {"throughput": lambda: throughput(text, a.rounds), "rotation": lambda: rotation(text, a.requests),
         "hosts": lambda: hosts(text, a.rounds)}[name]()


if __name__ == "__main__":
    main()
