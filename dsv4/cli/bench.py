"""`dsv4 bench`: serving benchmark against the daemon (or an in-process engine with --local).

Method (docs/serving.md sections 4 and 5): fixed-length prompts (random token ids with
EOS ignored, so every request makes exactly --gen-len tokens, or windows of real text
from --dataset FILE), streaming requests, the same prompts and the same daemon for both
MTP arms, a warmup before each measured run. For each concurrency and arm: TTFT
(sent -> first token received), TPOT ((e2e - TTFT) / (tokens - 1)), ITL (gap between
streamed chunks; grows under speculation), output tok/s and req/s over the run's wall
time, acceptance rate (accepted / drafted) and mean acceptance length (1 + accepted /
verify steps). Then MTP on versus off side by side with on/off ratios.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

import dsv4
from dsv4.cli import options as O
from dsv4.cli.options import CliError
from dsv4.engine.metrics import percentiles


class _Record:
    """Client-side timeline of one request."""

    def __init__(self) -> None:
        self.sent = time.monotonic()
        self.chunks: list[tuple[float, int]] = []  # (time received, tokens in it)
        self.final: dict[str, Any] = {}
        self.done: float | None = None

    def metrics(self) -> dict[str, Any]:
        usage = self.final.get("usage") or {}
        n = int(usage.get("completion_tokens") or sum(k for _, k in self.chunks))  # tokens, not chunks
        ttft = self.chunks[0][0] - self.sent if self.chunks else None
        e2e = (self.done or time.monotonic()) - self.sent
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None
        itl = [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]
        spec = self.final.get("spec") or {}
        drafted, accepted = int(spec.get("drafted") or 0), int(spec.get("accepted") or 0)
        steps = int(spec.get("verify_steps") or 0)
        return {"tokens": n, "prompt": int(usage.get("prompt_tokens") or 0),
                "cached": int(usage.get("cached_tokens") or 0), "ttft": ttft, "tpot": tpot, "e2e": e2e, "itl": itl,
                "drafted": drafted,
                "accepted": accepted, "steps": steps, "k": spec.get("num_speculative_tokens"), "done": self.done}


class _DaemonBackend:
    def __init__(self, endpoint: str, api_key: str | None = None) -> None:
        from dsv4.daemon.client import Client

        self.client = Client(endpoint, api_key=api_key)
        self.client.connect()
        self.info = self.client.status()

    def submit(self, prompt: list[int], params: dict[str, Any]) -> str:
        return self.client.generate(prompt, params, mode="raw")

    def poll(self) -> list[dict[str, Any]]:
        msg = self.client.recv(0.5)
        self.client.heartbeat()
        out = [msg] if msg is not None else []
        while (msg := self.client.recv(0)) is not None:
            out.append(msg)
        return [m for m in out if m["type"] in ("delta", "final", "error")]

    def close(self) -> None:
        self.client.close()


class _LocalBackend:
    """An engine in this process, driven through `LLM` (the in-process loop)."""

    def __init__(self, kw: dict[str, Any]) -> None:
        from dsv4.daemon.process import load_engine
        from dsv4.engine.llm import LLM

        self.llm = LLM.from_engine(load_engine(O.build_config(kw)))
        self.info = dict(self.llm.engine.status())

    def submit(self, prompt: list[int], params: dict[str, Any]) -> str:
        from dsv4.engine.sampling import SamplingParams

        return self.llm.submit(prompt, SamplingParams.from_dict(params), prompt_mode="raw")

    def poll(self) -> list[dict[str, Any]]:
        from dsv4.daemon import protocol as P

        return [msg for out in self.llm.step() for msg in P.output_messages(out.request_id, out)]

    def close(self) -> None:
        self.llm.close()  # stops the other tensor-parallel ranks, if any


def _run_arm(backend: Any, prompts: list[list[int]], params: dict[str, Any], concurrency: int,
             advance: Any) -> tuple[list[_Record], float]:
    """Send `prompts` keeping `concurrency` in flight; returns the records and the wall time."""
    queue, live, done = list(prompts), {}, []
    t0 = time.monotonic()
    while queue or live:
        while queue and len(live) < concurrency:
            rec = _Record()
            live[backend.submit(queue.pop(0), params)] = rec
        for msg in backend.poll():
            rec = live.get(msg.get("id"))
            if rec is None:
                continue
            now = time.monotonic()
            if msg["type"] == "error":
                raise CliError(f"daemon rejected a benchmark request: {msg.get('message')}")
            n = len(msg.get("token_ids") or []) or msg.get("n", 0)  # HTTP deltas carry text, counted 1
            if msg["type"] == "delta" and n:
                rec.chunks.append((now, n))
            elif msg["type"] == "final":
                if msg.get("finish_reason") in ("error", "abort"):
                    raise CliError(f"a benchmark request failed: {msg.get('error') or msg.get('finish_reason')}")
                rec.final, rec.done = msg, now
                done.append(live.pop(msg["id"]))
                advance()
    return done, time.monotonic() - t0


def _summarise(records: list[_Record], wall: float, concurrency: int, mtp: str,
               spec: dict[str, float] | None = None) -> dict[str, Any]:
    ms = [r.metrics() for r in records]
    tokens = sum(m["tokens"] for m in ms)
    drafted, accepted, steps = (int(spec[k]) if spec is not None else sum(m[k] for m in ms)
                                for k in ("drafted", "accepted", "steps"))
    pick = lambda k: [m[k] for m in ms if m[k] is not None]  # noqa: E731
    return {
        "concurrency": concurrency, "mtp": mtp, "requests": len(ms), "wall_s": wall, "output_tokens": tokens,
        "ttft_s": percentiles(pick("ttft")), "tpot_s": percentiles(pick("tpot")), "e2e_s": percentiles(pick("e2e")),
        "itl_s": percentiles([x for m in ms for x in m["itl"]]),
        "output_throughput_tok_s": tokens / wall if wall > 0 else None,
        "request_throughput_req_s": len(ms) / wall if wall > 0 else None,
        "drafted": drafted, "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / steps if steps else None,
        "prefix_cache_hit_rate": (sum(m["cached"] for m in ms) / sum(m["prompt"] for m in ms)
                                  if sum(m["prompt"] for m in ms) else None),
        # the K in use when the arm's last request finished (auto K: the policy's latest choice)
        "num_speculative_tokens": max(ms, key=lambda m: m["done"] or 0.0)["k"] if ms else None,
    }


def _prompts(dataset: str, n: int, prompt_len: int, vocab: int, model_dir: str | None,
             rng: random.Random) -> tuple[list[list[int]], str]:
    if dataset == "random":
        return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n)], "random token ids"
    path = Path(dataset)
    if not path.is_file():
        raise CliError(f"--dataset {dataset}: no such file (use 'random' or a text file)", O.EXIT_USAGE)
    from dsv4.engine.tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer.from_dir(model_dir or dsv4.DEFAULT_MODEL)
    except TokenizerError as e:
        raise CliError(f"--dataset needs the model's tokenizer: {e}") from None
    ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"))
    if len(ids) < prompt_len:
        raise CliError(f"--dataset {dataset} has {len(ids)} tokens, fewer than --prompt-len {prompt_len}",
                       O.EXIT_USAGE)
    starts = [rng.randrange(len(ids) - prompt_len + 1) for _ in range(n)]
    return [ids[s:s + prompt_len] for s in starts], f"text windows from {path}"


def _int_list(flag: str, value: str) -> list[int]:
    try:
        xs = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or any(x < 1 for x in xs):
        raise CliError(f"{flag} must be a comma-separated list of positive integers, got {value!r}", O.EXIT_USAGE)
    return xs


def bench(
    prompt_len: Annotated[int, typer.Option("--prompt-len", metavar="N", callback=O.int_range(1), help="Prompt tokens per request.")]
    = 256,
    gen_len: Annotated[int, typer.Option("--gen-len", metavar="N", callback=O.int_range(1), help="Tokens generated per request.")]
    = 16,
    concurrency: Annotated[str, typer.Option("--concurrency", metavar="LIST",
                                             help="Comma-separated concurrency levels.")] = "1,8",
    num_prompts: Annotated[int, typer.Option("--num-prompts", metavar="N", callback=O.int_range(1),
                                             help="Measured requests per concurrency level and arm.")] = 16,
    mtp: Annotated[str, typer.Option("--mtp", metavar="LIST", help="Arms to run: on, off or on,off.")] = "on,off",
    dataset: Annotated[str, typer.Option("--dataset", metavar="random|FILE",
                                         help="Random token ids, or windows of a text FILE.")] = "random",
    warmup: Annotated[int, typer.Option("--warmup", metavar="N", callback=O.int_range(0),
                                        help="Warmup requests before each measured run.")] = 2,
    json_file: Annotated[Optional[str], typer.Option("--json", metavar="FILE",
                                                     help="Write all results as JSON to FILE ('-' = stdout).")]
    = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Seed for choosing the prompts.")] = 0,
    plot: Annotated[Optional[str], typer.Option(
        "--plot", metavar="FILE", help="Also draw output tok/s, TTFT and TPOT against concurrency, MTP on and "
                                       "off, into FILE (.png or .svg; needs matplotlib, the plot extra).")] = None,
    socket: O.Socket = None,
    http: Annotated[Optional[str], typer.Option(
        "--http", metavar="URL", help="Benchmark an OpenAI-compatible server (dsv4 serve --http) at URL, "
                                      "e.g. http://127.0.0.1:8000, instead of the daemon's socket")] = None,
    api_key: O.ApiKey = None,
    local: Annotated[bool, typer.Option("--local", help="Benchmark an engine in this process instead of the "
                                        "daemon (takes the engine options of 'dsv4 serve' but --seed).")] = False,
    model: O.Model = None, device: O.Device = None, dtype: O.Dtype = None, max_num_seqs: O.MaxNumSeqs = None,
    max_model_len: O.MaxModelLen = None, max_num_batched_tokens: O.MaxBatched = None,
    long_prefill_token_threshold: O.LongPrefill = None, enable_chunked_prefill: O.Chunked = None,
    num_speculative_tokens: O.NumSpec = None, threads: O.Threads = None, quantization: O.Quantization = None,
    compile: O.Compile = None, kv_cache_memory: O.KvCacheMemory = None,
    enable_prefix_caching: O.PrefixCaching = None, tensor_parallel_size: O.TensorParallel = None,
    draft_vocab: O.DraftVocab = None, revision: O.Revision = None,
) -> None:
    levels = _int_list("--concurrency", concurrency)
    if plot is not None:
        from dsv4.cli.bench_plot import PlotError, check

        try:
            check(plot)
        except PlotError as e:
            raise CliError(str(e), O.EXIT_USAGE) from None
    arms = [a.strip() for a in mtp.split(",") if a.strip()]
    if not arms or any(a not in ("on", "off") for a in arms) or len(set(arms)) != len(arms):
        raise CliError(f"--mtp must be on, off or on,off; got {mtp!r}", O.EXIT_USAGE)
    local = local or O.under_torchrun()  # under torchrun every process is a rank of one engine
    engine = O.local_engine_kwargs(
        local, model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill, num_speculative_tokens=num_speculative_tokens,
        threads=threads, quantization=quantization, compile=compile,
        kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
        tensor_parallel_size=tensor_parallel_size, draft_vocab=draft_vocab, revision=revision)
    from dsv4.daemon.paths import resolve_endpoint

    if http is not None and local:
        raise CliError("--http and --local are two different targets; give one", O.EXIT_USAGE)
    if local:
        from dsv4.cli.hub import fetch_model

        fetch_model(engine)  # --model ORG/NAME: pulled when missing, then found in the cache
        O.torchrun_follower(engine)  # under torchrun, RANK > 0 follows rank 0's steps here and exits
    if http is not None:
        from dsv4.cli.bench_http import HttpBackend

        backend: Any = HttpBackend(http, api_key)
    else:
        backend = _LocalBackend(engine) if local else _DaemonBackend(resolve_endpoint(socket), api_key)
    try:
        info = backend.info
        vocab = int(info.get("vocab_size") or 0)
        if dataset == "random" and vocab < 2:
            raise CliError("the daemon did not report its vocabulary size; use --dataset FILE")
        rng = random.Random(seed)
        prompts, source = _prompts(dataset, num_prompts + warmup, prompt_len, vocab, info.get("model"), rng)
        # greedy and no penalties, whatever the model's generation_config.json says: exact and comparable
        params = {"max_tokens": gen_len, "ignore_eos": True, "temperature": 0.0, "repetition_penalty": 1.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0}
        total = len(levels) * len(arms) * (num_prompts + warmup)
        results = _measure(backend, prompts, params, levels, arms, warmup, total)
    finally:
        backend.close()
    report = {"config": {"prompt_len": prompt_len, "gen_len": gen_len, "concurrency": levels,
                         "num_prompts": num_prompts, "mtp": arms, "warmup": warmup, "dataset": dataset,
                         "prompt_source": source, "ignore_eos": True, "temperature": 0.0, "streaming": True,
                         "prefix_caching": False,
                         "target": "local" if local else (f"http {http}" if http else "daemon"),
                         "model": info.get("model"), "device": info.get("device"), "dtype": info.get("dtype"),
                         "num_speculative_tokens": info.get("max_speculative_tokens",
                                                            info.get("num_speculative_tokens")),
                         "speculative_auto": bool(info.get("speculative_auto"))},
              "results": results, "comparison": _compare(results)}
    if "on" in arms and all(r["drafted"] == 0 for r in results if r["mtp"] == "on"):
        O.err("dsv4 bench: warning: the MTP-on arm drafted nothing ("
              + ("auto K chose 0 drafts throughout: speculation does not pay here)" if info.get("speculative_auto")
                 else "is the daemon running with --num-speculative-tokens 0?)"))
    if json_file == "-":
        print(json.dumps(report, indent=2))
    else:
        if json_file:
            Path(json_file).write_text(json.dumps(report, indent=2) + "\n")
        from dsv4.cli.bench_report import print_report

        print_report(report)
    if plot is not None:
        from dsv4.cli.bench_plot import plot as draw

        O.err(f"dsv4 bench: plot written to {draw(report, plot)}")


def _measure(backend: Any, prompts: list[list[int]], params: dict[str, Any], levels: list[int], arms: list[str],
             warmup: int, total: int) -> list[dict[str, Any]]:
    from dsv4.daemon.process import ProgressBar

    bar, done = ProgressBar("bench"), 0

    def advance() -> None:
        nonlocal done
        done += 1
        bar(done, total)

    results = []
    try:
        for c in levels:
            for arm in arms:
                p = {**params, "speculative": arm == "on"}
                if warmup:
                    _run_arm(backend, prompts[:warmup], p, c, advance)
                # the prompts again, but no prefix-cache hits on an earlier level's or arm's runs
                p["cache_salt"] = f"dsv4 bench {os.getpid()} {time.time()} {c} {arm}"
                before = backend.spec_totals() if hasattr(backend, "spec_totals") else None
                records, wall = _run_arm(backend, prompts[warmup:], p, c, advance)
                spec = None
                if before is not None:  # HTTP: the arm's MTP counters from the server's metrics
                    after = backend.spec_totals()
                    spec = {k: after[k] - before[k] for k in after}
                results.append(_summarise(records, wall, c, arm, spec))
    finally:
        bar.close()
    return results


def _compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """MTP on versus off per concurrency: the values and on/off ratios."""
    out = []
    keys = [("output_throughput_tok_s", None), ("request_throughput_req_s", None), ("ttft_s", "p50"),
            ("ttft_s", "mean"), ("tpot_s", "p50"), ("tpot_s", "mean"), ("itl_s", "p50")]
    for c in sorted({r["concurrency"] for r in results}):
        on = next((r for r in results if r["concurrency"] == c and r["mtp"] == "on"), None)
        off = next((r for r in results if r["concurrency"] == c and r["mtp"] == "off"), None)
        if on is None or off is None:
            continue
        row: dict[str, Any] = {"concurrency": c}
        for key, sub in keys:
            name = key if sub is None else f"{key}_{sub}"
            a = on[key] if sub is None else on[key][sub]
            b = off[key] if sub is None else off[key][sub]
            row[name] = {"on": a, "off": b, "ratio": a / b if a is not None and b else None}
        out.append(row)
    return out

