"""`dsv4 bench --plot FILE`: the report as a picture, PNG or SVG by FILE's suffix.

Three panels against concurrency, one line per MTP arm (on, off): output tokens per second
(the whole run's), TTFT and TPOT (p50, with the p90 as a lighter band). Drawn with
matplotlib's Agg backend (no display needed); matplotlib comes with the `plot` extra
(`scripts/venv.sh http,plot`, `pip install 'dsv4[plot]'`), checked before the benchmark
runs (`check`), so a missing library or a bad suffix costs no measurement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FORMATS = (".png", ".svg")
INSTALL_HINT = "scripts/venv.sh http,plot, or pip install 'dsv4[plot]'"
PANELS = (("output_throughput_tok_s", None, "output tok/s", 1.0), ("ttft_s", "p50", "TTFT (ms)", 1e3),
          ("tpot_s", "p50", "TPOT (ms)", 1e3))
STYLE = {"on": dict(color="#1f77b4", marker="o"), "off": dict(color="#ff7f0e", marker="s")}


class PlotError(ValueError):
    """--plot cannot be honoured (one line: the suffix, or matplotlib missing)."""


def check(path: str) -> Path:
    """Validate --plot FILE before anything runs: its suffix and matplotlib."""
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise PlotError(f"--plot {path}: the file must end in .png or .svg")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    return p


def _value(r: dict[str, Any], key: str, sub: str | None) -> float | None:
    v = r.get(key)
    if sub is not None:
        v = (v or {}).get(sub)
    return float(v) if isinstance(v, (int, float)) else None


def plot(report: dict[str, Any], path: str | Path) -> Path:
    """Draw `report` (as `dsv4 bench --json` writes it) into `path`; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = check(str(path))
    cfg, results = report.get("config") or {}, report.get("results") or []
    levels = sorted({int(r["concurrency"]) for r in results})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(13, 4), constrained_layout=True)
    for ax, (key, sub, label, scale) in zip(axes, PANELS):
        for arm in ("on", "off"):
            rows = sorted((r for r in results if r.get("mtp") == arm), key=lambda r: r["concurrency"])
            pts = [(r["concurrency"], _value(r, key, sub)) for r in rows]
            pts = [(c, v * scale) for c, v in pts if v is not None]
            if not pts:
                continue
            ax.plot([c for c, _ in pts], [v for _, v in pts], label=f"MTP {arm}", **STYLE[arm])
            if sub is not None:  # the p90 above the p50, a band
                hi = [(r["concurrency"], _value(r, key, "p90")) for r in rows]
                hi = [(c, v * scale) for c, v in hi if v is not None]
                if len(hi) == len(pts):
                    ax.fill_between([c for c, _ in pts], [v for _, v in pts], [v for _, v in hi],
                                    color=STYLE[arm]["color"], alpha=0.15, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_title(label + (" p50 (band: p90)" if sub else ""))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"dsv4 bench: {cfg.get('model')} on {cfg.get('device')} {cfg.get('dtype')}, "
                 f"prompt {cfg.get('prompt_len')} + {cfg.get('gen_len')} tokens, {cfg.get('num_prompts')} requests "
                 f"a point, K = {cfg.get('num_speculative_tokens')}", fontsize=10)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
