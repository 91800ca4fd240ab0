#!/usr/bin/env python3
"""Decode speed and load time by thread setting, on a quiet machine and beside a busy loop.

    python benchmarks/busy_threads.py [--rounds 3] [--tokens 96] [--arms old,new,one,passive] [--busy-cpus N,...]
    python benchmarks/busy_threads.py --model SLICE --quantization w8a8-mxfp4 --rounds 1 --tokens 16 --arms old,new,passive

Each measurement is a fresh process (OpenMP reads its settings once, when torch loads it)
that loads the embedded model (or `--model`) through the real engine (`dsv4.LLM`, K = 0, one request),
generates a warm-up, then `--tokens` greedy tokens after a fixed 64-token prompt, then
one token after a 384-token prompt; it reports the load time (`LLM(...)`), the decode
rate and the prefill rate (wall clock, which is what a user waits for). The arms:

- `old`: the default before: one thread per usable CPU (at most 16);
- `new`: today's default (`dsv4.engine.config.default_threads`: one fewer, at least 1);
- `one`: `--threads 1`;
- `passive`, `spin10k`, `spin1k`, `spin100`: one thread per usable CPU with the OpenMP
  runtime told to sleep at once (OMP_WAIT_POLICY=PASSIVE) or to spin less than libgomp's
  300,000 turns before it sleeps (GOMP_SPINCOUNT).

OpenMP variables of the calling shell (OMP_*, GOMP_*, KMP_*, MKL_NUM_THREADS) are removed
from every arm's environment.

"loaded" runs the same process while a busy loop (a Python `while True`, pinned to one CPU
with sched_setaffinity, started and stopped by this script and ending by itself after
`--busy-max-s` whatever happens) holds one core (or each of `--busy-cpus`), as another
tenant's work would. The
arms run interleaved, round after round, so drift in the machine's other load spreads
over all of them; each cell is the median over rounds, and the ratios compare arms of the
same run. The machine's other tenants still count: read the ratios, not the rates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_DEFAULT_THREADS = 16  # dsv4.engine.config's (not imported here: the parent never loads dsv4)
PREFILL = 384  # tokens of the prompt whose time to first token is measured
OMP_PREFIXES = ("OMP_", "GOMP_", "KMP_")


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def arms() -> dict[str, tuple[int | None, dict[str, str]]]:
    """name -> (--threads, or None for dsv4's default; OpenMP environment to set)."""
    n = min(usable_cpus(), MAX_DEFAULT_THREADS)
    return {
        "old": (n, {}),
        "new": (None, {}),
        "one": (1, {}),
        "passive": (n, {"OMP_WAIT_POLICY": "PASSIVE"}),
        "spin10k": (n, {"GOMP_SPINCOUNT": "10000"}),
        "spin1k": (n, {"GOMP_SPINCOUNT": "1000"}),
        "spin100": (n, {"GOMP_SPINCOUNT": "100"}),
    }


def child(threads: int | None, tokens: int, model: str | None, quantization: str | None) -> None:
    t0 = time.monotonic()
    import torch

    import dsv4
    from dsv4 import LLM, SamplingParams

    opts = {} if threads is None else {"threads": threads}
    t1 = time.monotonic()
    llm = LLM(model or dsv4.DEFAULT_MODEL, num_speculative_tokens=0, max_num_seqs=1, max_model_len=512,
              quantization=quantization, **opts)
    load = time.monotonic() - t1
    prompt = torch.randint(2, 4096, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, temperature=0))
    t, c = time.monotonic(), time.process_time()
    llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
    wall = time.monotonic() - t
    cpu = time.process_time() - c
    long = torch.randint(2, 4096, (PREFILL,), generator=torch.Generator().manual_seed(1)).tolist()
    t = time.monotonic()
    llm.generate([long], SamplingParams(max_tokens=1, temperature=0))
    prefill = time.monotonic() - t
    print(json.dumps({"load_s": load, "import_s": t1 - t0, "tok_s": tokens / wall, "prefill_tok_s": PREFILL / prefill,
                      "cpu_per_wall": cpu / wall, "threads": torch.get_num_threads(),
                      "env": {k: v for k, v in os.environ.items() if k.startswith(OMP_PREFIXES)}}))


def start_busy(cpus: list[int], max_s: float) -> list[subprocess.Popen]:
    """One busy loop pinned on each of `cpus`, each ending by itself after `max_s`."""
    procs = []
    for cpu in cpus:
        code = (f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nend = time.monotonic() + {max_s}\n"
                "while time.monotonic() < end:\n    pass\n")
        procs.append(subprocess.Popen([sys.executable, "-c", code]))
    time.sleep(0.3)  # running and pinned before the measurement starts
    return procs


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure(arm: tuple[int | None, dict[str, str]], tokens: int, timeout_s: float, model: list[str]) -> dict:
    threads, extra = arm
    env = {k: v for k, v in os.environ.items() if not k.startswith(OMP_PREFIXES) and k != "MKL_NUM_THREADS"}
    env.update(extra, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--tokens", str(tokens), *model]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise SystemExit(f"benchmarks/busy_threads.py: child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


FIELDS = (("tok_s", "decode tok/s", "{:.0f}"), ("prefill_tok_s", f"prefill tok/s ({PREFILL} tokens)", "{:.0f}"),
          ("load_s", "load s", "{:.2f}"))


def report(names: list[str], runs: dict[tuple[str, str], list[dict]], rounds: int, tokens: int) -> str:
    """Medians per arm and condition, and the ratio to the first arm in the same condition
    (> 1 = faster; for the load time, its inverse)."""
    med = {k: {f: statistics.median(m[f] for m in v) for f in (*(f for f, _, _ in FIELDS), "cpu_per_wall")}
           for k, v in runs.items()}
    ref = names[0]
    head = ["arm", "threads"]
    for _, label, _ in FIELDS:
        head += [f"{label} quiet / loaded", f"vs {ref}"]
    head.append("CPU s per wall s, quiet decode")
    lines = [f"\nmedians of {rounds} interleaved rounds (decode: {tokens} greedy tokens, batch 1, K = 0)\n",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        q, l = med[(name, "quiet")], med[(name, "loaded")]
        rq, rl = med[(ref, "quiet")], med[(ref, "loaded")]
        row = [name, str(runs[(name, "quiet")][0]["threads"])]
        for f, _, fmt in FIELDS:
            ratio = (lambda x, y: y / x) if f == "load_s" else (lambda x, y: x / y)
            row += [f"{fmt.format(q[f])} / {fmt.format(l[f])}", f"{ratio(q[f], rq[f]):.2f}x / {ratio(l[f], rl[f]):.2f}x"]
        row.append(f"{q['cpu_per_wall']:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--arms", default="old,new,one,passive", help=f"comma-separated, of {','.join(arms())}")
    ap.add_argument("--busy-cpus", default=None,
                    help="comma-separated CPUs that each get a busy loop when loaded (default: the last usable)")
    ap.add_argument("--busy-max-s", type=float, default=300.0, help="the busy loop ends by itself after this long")
    ap.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded model)")
    ap.add_argument("--quantization", default=None, help="as `dsv4 serve --quantization` (default: as the plan picks)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.threads, a.tokens, a.model, a.quantization)
    table = arms()
    names = [s for s in a.arms.split(",") if s]
    unknown = [s for s in names if s not in table]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; choose from {list(table)}")
    cpus = [int(c) for c in a.busy_cpus.split(",")] if a.busy_cpus else [max(os.sched_getaffinity(0))]
    model = (["--model", a.model] if a.model else []) + (["--quantization", a.quantization] if a.quantization else [])
    import torch

    print(f"{usable_cpus()} usable CPUs; torch {torch.__version__}; "
          f"{torch.__config__.parallel_info().splitlines()[-1].strip()}; busy loop(s) on CPU {cpus}", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(a.rounds):
        for load in ("quiet", "loaded"):
            for name in names:
                busy = start_busy(cpus, a.busy_max_s) if load == "loaded" else None
                try:
                    m = measure(table[name], a.tokens, a.busy_max_s, model)
                finally:
                    if busy is not None:
                        stop_busy(busy)
                runs.setdefault((name, load), []).append(m)
                print(f"round {r + 1} {load:6} {name:8} threads {m['threads']}  load {m['load_s']:6.2f} s  "
                      f"decode {m['tok_s']:6.1f} tok/s  prefill {m['prefill_tok_s']:6.0f} tok/s  "
                      f"cpu/wall {m['cpu_per_wall']:.2f}  {m['env']}", flush=True)
    print(report(names, runs, a.rounds, a.tokens))
    if a.json:
        a.json.write_text(json.dumps({f"{k[0]}/{k[1]}": v for k, v in runs.items()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
