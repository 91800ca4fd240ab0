"""`dsv4 status --watch`: a live view of the daemon, refreshed every `--interval` seconds.

Rates are over the last interval (deltas of the daemon's totals between two polls), not over
the daemon's life: output tok/s, requests finished, MTP acceptance, prefix cache hits. Levels
are as polled: requests running and waiting, the state pool's use, compiled buckets (and
whether more are building). On a terminal it redraws in place (rich `Live`); otherwise
(a pipe, a file) one plain line per interval, and `--json` one JSON object per line
(JSON Lines) with the rates added under "watch". Ends at Ctrl-C, after `--count` polls, or
when the daemon goes away (one line, exit 1).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from .status_view import _compiled, _pct, status_lines


@dataclass
class Sample:
    """The counters one poll read (monotonic time, the daemon's cumulative totals)."""

    t: float
    out_tokens: int
    prompt_tokens: int
    requests: int
    drafted: int
    accepted: int
    cache_queries: int
    cache_hits: int

    @classmethod
    def of(cls, st: dict[str, Any], t: float) -> "Sample":
        tot = st.get("totals") or {}
        usage, spec = tot.get("usage") or {}, tot.get("spec") or {}
        return cls(t, int(usage.get("completion_tokens") or 0), int(usage.get("prompt_tokens") or 0),
                   int(tot.get("requests") or 0), int(spec.get("drafted") or 0), int(spec.get("accepted") or 0),
                   int(st.get("prefix_cache_queries") or 0), int(st.get("prefix_cache_hits") or 0))


def rates(prev: Sample, cur: Sample, st: dict[str, Any]) -> dict[str, Any]:
    """What changed between two polls, per second or as a share, and the levels now."""
    dt = max(cur.t - prev.t, 1e-9)
    drafted, queries = cur.drafted - prev.drafted, cur.cache_queries - prev.cache_queries
    blocks, free = st.get("blocks"), st.get("free_blocks")
    return {
        "interval_s": round(dt, 3),
        "output_tokens_per_s": (cur.out_tokens - prev.out_tokens) / dt,
        "prompt_tokens_per_s": (cur.prompt_tokens - prev.prompt_tokens) / dt,
        "requests_finished": cur.requests - prev.requests,
        "acceptance": (cur.accepted - prev.accepted) / drafted if drafted > 0 else None,
        "prefix_cache_hit_rate": (cur.cache_hits - prev.cache_hits) / queries if queries > 0 else None,
        "state_pool_used": (1 - free / blocks) if isinstance(blocks, int) and blocks > 0
        and isinstance(free, int) else None,
    }


def _bar(share: float | None, width: int = 20) -> str:
    if share is None:
        return "-"
    n = round(max(0.0, min(1.0, share)) * width)
    return "#" * n + "." * (width - n) + f" {share:.0%}"


def now_lines(r: dict[str, Any], st: dict[str, Any]) -> list[str]:
    """The live view's head: the last interval's rates and the levels now."""
    return [
        f"{'now':<11} {r['output_tokens_per_s']:.1f} output tok/s, {r['prompt_tokens_per_s']:.1f} prompt tok/s, "
        f"{r['requests_finished']} finished in the last {r['interval_s']:.1f} s; "
        f"{st.get('running')} running, {st.get('waiting')} waiting",
        f"{'acceptance':<11} {_pct(r['acceptance'])} (last interval); "
        f"prefix cache hits {_pct(r['prefix_cache_hit_rate'])} (last interval)",
        f"{'state pool':<11} {_bar(r['state_pool_used'])}",
        f"{'compile':<11} {_compiled(st)}",
    ]


def watch(poll: Callable[[], dict[str, Any]], interval: float, count: int | None, as_json: bool,
          out=sys.stdout) -> int:
    """Poll `poll()` every `interval` s and show it (module docstring); the exit status."""
    live_ok = out.isatty() and not as_json
    prev = None
    n = 0
    live = None
    if live_ok:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        live = Live(Text("connecting..."), console=Console(file=out), auto_refresh=False, transient=False)
        live.start()
    try:
        while count is None or n < count:
            st = poll()
            cur = Sample.of(st, time.monotonic())
            r = rates(prev or cur, cur, st)
            prev = cur
            n += 1
            if as_json:
                print(json.dumps({**st, "watch": r}, sort_keys=True), file=out, flush=True)
            elif live is not None:  # `Text` imported with `Live` above
                live.update(Text("\n".join(now_lines(r, st) + [""] + status_lines(st))), refresh=True)
            else:
                print(" | ".join(ln.split(None, 1)[1] if " " in ln else ln for ln in now_lines(r, st)[:3]),
                      file=out, flush=True)
            if count is None or n < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    return 0
