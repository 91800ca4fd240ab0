#!/usr/bin/env python3
"""What one small HTTP request can make the daemon do: n samples of a long prompt with echo,
logprobs and prompt_logprobs (issue 34's attack), timed, its answer's bytes counted, and the
daemon's RSS before and after.

    python benchmarks/amplification.py                       # the attack: n 64, 806 tokens, 20 + 5 logprobs
    python benchmarks/amplification.py --n 8                 # one the budget allows
    PYTHONPATH=/path/to/other/checkout python benchmarks/amplification.py   # an older dsv4, same request

A tiny random model with DeepSeek V4's real tokenizer (129,280 ids) is written to a scratch
directory and served by a `dsv4 serve --http` subprocess (the dsv4 that `import dsv4` finds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # tests.checkpoints; dsv4 itself from PYTHONPATH first


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def post(port: int, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=806)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=18734)
    a = ap.parse_args()
    from tests.checkpoints import write_v4_tokenizer_model

    import dsv4

    work = Path(tempfile.mkdtemp(prefix="dsv4-amp-"))
    model = write_v4_tokenizer_model(work / "model")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(dsv4.__file__).parents[1]),
                                                                    os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli.main", "serve", "--model", str(model), "--socket",
                             f"ipc://{work}/s.sock", "--http", f"127.0.0.1:{a.port}", "--num-speculative-tokens",
                             "0", "--no-compile"], env=env, cwd=work, stderr=open(work / "serve.log", "wb"))
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        post(a.port, {"prompt": "warm", "max_tokens": 2})
        before = rss(proc.pid)
        prompt = [1000 + (i * 7919) % 100000 for i in range(a.prompt_len)]
        body = {"prompt": prompt, "n": a.n, "max_tokens": a.max_tokens, "echo": True, "logprobs": 5,
                "prompt_logprobs": 20, "temperature": 1.0}
        t = time.perf_counter()
        status, answer = post(a.port, body)
        took = time.perf_counter() - t
        time.sleep(1.0)
        after = rss(proc.pid)
        print(f"dsv4 from {Path(dsv4.__file__).parents[1]}: request of {len(json.dumps(body))} bytes, n {a.n}, "
              f"prompt {a.prompt_len} tokens -> HTTP {status}, {len(answer) / 1e6:.2f} MB in {took:.1f} s; "
              f"daemon RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB (+{(after - before) / 2**20:.0f})")
        if status != 200:
            print("   ", json.loads(answer)["error"]["message"])
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
