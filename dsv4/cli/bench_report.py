"""Render a `dsv4 bench` report as rich tables on stdout: one per concurrency level, arms side by side."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

ROWS: list[tuple[str, str, str | None, str]] = [  # label, key, sub-key, unit
    ("requests", "requests", None, ""),
    ("TTFT mean", "ttft_s", "mean", "ms"), ("TTFT p50", "ttft_s", "p50", "ms"),
    ("TTFT p90", "ttft_s", "p90", "ms"), ("TTFT p99", "ttft_s", "p99", "ms"),
    ("TPOT mean", "tpot_s", "mean", "ms"), ("TPOT p50", "tpot_s", "p50", "ms"), ("TPOT p99", "tpot_s", "p99", "ms"),
    ("ITL p50", "itl_s", "p50", "ms"),
    ("output tok/s", "output_throughput_tok_s", None, ""), ("req/s", "request_throughput_req_s", None, ""),
    ("acceptance rate", "acceptance_rate", None, "%"), ("mean acceptance length", "mean_acceptance_length", None, ""),
    ("K in use at the end", "num_speculative_tokens", None, "k"),
    ("prefix cache hit", "prefix_cache_hit_rate", None, "%"),
]
LOWER_IS_BETTER = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
MIN_REQUESTS = {"p90": 10, "p99": 100}  # fewer and the percentile is just one of the largest values


def better(key: str) -> str:
    """Which way a ratio is good: 'lower' for latencies, 'higher' for rates."""
    return "lower" if key in LOWER_IS_BETTER else "higher"


def verdict(report: dict[str, Any]) -> str | None:
    """One line: MTP on versus off, by output throughput at each concurrency."""
    parts = []
    for row in report.get("comparison") or []:
        r = (row.get("output_throughput_tok_s") or {}).get("ratio")
        if r is None:
            continue
        word = "faster" if r > 1.02 else "slower" if r < 0.98 else "about even"
        parts.append(f"{r:.2f}x output tok/s at concurrency {row['concurrency']} ({word})")
    return "verdict: MTP on vs off: " + "; ".join(parts) if parts else None


def _k(cfg: dict[str, Any]) -> str:
    k = cfg.get("num_speculative_tokens")
    return f"auto, 0..{k}" if cfg.get("speculative_auto") else str(k)


def _value(r: dict[str, Any], key: str, sub: str | None) -> Any:
    v = r.get(key)
    return v.get(sub) if sub is not None and isinstance(v, dict) else v


def _fmt(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "ms":
        return f"{v * 1000:.1f}"
    if unit == "%":
        return f"{v:.1%}"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    """Tables per concurrency: one column per MTP arm, plus on/off ratio when both ran."""
    console = console or Console(highlight=False)
    cfg = report["config"]
    console.print(f"dsv4 bench: {cfg['target']} {cfg.get('model')} ({cfg.get('device')}, {cfg.get('dtype')}, "
                  f"K = {_k(cfg)}); prompts: {cfg['prompt_source']}, "
                  f"{cfg['prompt_len']} tokens in, {cfg['gen_len']} out, EOS ignored, streaming; "
                  f"{cfg['num_prompts']} requests per run after {cfg['warmup']} warmup")
    results = report["results"]
    thin = [p for p, n in MIN_REQUESTS.items() if cfg["num_prompts"] < n]
    if thin:
        console.print(f"warning: {cfg['num_prompts']} requests per run are too few for {' and '.join(thin)} "
                      f"(they need at least {' and '.join(str(MIN_REQUESTS[p]) for p in thin)}); those rows are "
                      f"close to the largest value seen (raise --num-prompts)")
    for c in sorted({r["concurrency"] for r in results}):
        arms = {r["mtp"]: r for r in results if r["concurrency"] == c}
        table = Table(title=f"concurrency {c}", title_justify="left")
        table.add_column("metric")
        for arm in arms:
            table.add_column(f"MTP {arm}", justify="right")
        both = "on" in arms and "off" in arms
        if both:
            table.add_column("on/off", justify="right")
            table.add_column("better", justify="left")
        for label, key, sub, unit in ROWS:
            vals = [_value(arms[a], key, sub) for a in arms]
            row = [label + (f" ({unit})" if unit == "ms" else "")] + [_fmt(v, unit) for v in vals]
            if both:
                on, off = _value(arms["on"], key, sub), _value(arms["off"], key, sub)
                ok = isinstance(on, (int, float)) and isinstance(off, (int, float)) and off and unit != "%"
                row.append(f"{on / off:.2f}x" if ok and key not in ("requests", "num_speculative_tokens") else "")
                row.append(better(key) if key not in ("requests", "num_speculative_tokens") else "")
            table.add_row(*row)
        console.print(table)
    line = verdict(report)
    if line:
        console.print(line)
