"""`dsv4 status` for people: the daemon's status map as a few labelled lines in human units.

Durations in ms or s, memory in MiB, acceptance as a percentage, throughput over the time
the engine was busy (not over uptime, which counts idle hours). Keys this view does not
know are listed after it, flattened, so nothing the daemon reports is hidden.
"""

from __future__ import annotations

from typing import Any

KNOWN = {"model", "device", "dtype", "num_speculative_tokens", "vocab_size", "uptime_s", "running", "waiting",
         "state_bytes", "totals", "pid", "version", "protocol", "endpoint", "clients", "in_flight",
         "memory_rss_bytes", "compiled", "compiled_buckets", "compile_building", "max_model_len", "preemptions",
         "blocks", "block_size", "free_blocks", "cached_blocks", "prefix_cache_queries", "prefix_cache_hits",
         "prefix_cache_hit_rate", "model_id", "revision", "data_parallel_size", "replicas", "routing", "kernels"}


def _bytes(n: Any) -> str:
    from dsv4.daemon.process import human_bytes

    return "-" if not isinstance(n, (int, float)) else human_bytes(n)


def _dur(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return "-"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _pct(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.1%}"


def _uptime(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return "-"
    s = int(s)
    d, rest = divmod(s, 86400)
    h, rest = divmod(rest, 3600)
    m, sec = divmod(rest, 60)
    return (f"{d} d " if d else "") + f"{h:02d}:{m:02d}:{sec:02d}"


def _compiled(st: dict[str, Any]) -> str:
    """What runs compiled: "decode buckets 1, 2, 4 (main), 1, 2 (mtp)", or "no (eager)"."""
    b = st.get("compiled_buckets")
    if not isinstance(b, dict):
        return "-"  # a daemon older than the key
    parts = [f"{', '.join(str(n) for n in b.get(kind) or [])} ({kind})" for kind in ("main", "mtp") if b.get(kind)]
    line = "decode buckets " + ", ".join(parts) if parts else "no (eager)"
    return line + ("; building the others in the background" if st.get("compile_building") else "")


def _pool(st: dict[str, Any]) -> str:
    """The state pool and the prefix cache: "64 blocks of 256 (16384 tokens; longest request
    8192), 60 free, 12 cached; prefix cache hit 73.0% of 4096 prompt tokens; 0 preemptions"."""
    n, size = st.get("blocks"), st.get("block_size")
    if not isinstance(n, int) or not isinstance(size, int):
        return "-"  # a daemon older than the keys
    return (f"{n} blocks of {size} ({n * size} tokens; longest request {st.get('max_model_len')}), "
            f"{st.get('free_blocks')} free, {st.get('cached_blocks')} cached; prefix cache hit "
            f"{_pct(st.get('prefix_cache_hit_rate'))} of {st.get('prefix_cache_queries', 0)} prompt tokens; "
            f"{st.get('preemptions', 0)} preemptions")


def _replicas(st: dict[str, Any]) -> list[tuple[str, str]]:
    """One line per engine replica (--data-parallel-size), and the routing decisions."""
    reps = st.get("replicas") or []
    if not reps:
        return []
    routing = st.get("routing") or {}
    lines = [("routing", f"{routing.get('prefix', 0)} by cached prefix, {routing.get('load', 0)} to the least "
                         f"loaded, {routing.get('balance', 0)} away from a busy holder of their prefix")]
    for r in reps:
        routed = r.get("routed") or {}
        lines.append((f"replica {r.get('index')}",
                      f"{r.get('state')}, " + (f"on {r['host']}, " if r.get("host") else "")
                      + f"pid {r.get('pid')}, cores {','.join(map(str, r.get('cores') or []))}; "
                      f"{r.get('running', 0)} running, {r.get('waiting', 0)} waiting, {r.get('in_flight', 0)} in "
                      f"flight; {sum(routed.values())} routed ({routed.get('prefix', 0)} by prefix); prefix cache "
                      f"hit {_pct(r.get('prefix_cache_hit_rate'))}; {r.get('output_tokens', 0)} tokens generated"
                      + (f"; restarted {r['restarts']} time(s), last: {r.get('error')}" if r.get("restarts") else "")
                      + (f"; last: {r.get('error')}" if r.get("error") and not r.get("restarts") else "")))
    return lines


def _model(st: dict[str, Any]) -> str:
    """The model's directory, or "ORG/NAME@COMMIT (directory)" for a hub model."""
    if st.get("model_id"):
        return f"{st['model_id']}@{str(st.get('revision') or '?')[:12]} ({st.get('model')})"
    return str(st.get("model"))


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k in sorted(d):
        v = d[k]
        out += _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


def status_lines(st: dict[str, Any]) -> list[str]:
    t = st.get("totals") or {}
    usage, thr, spec = t.get("usage") or {}, t.get("throughput") or {}, t.get("spec") or {}
    tim = t.get("timings") or {}
    up, busy = st.get("uptime_s"), thr.get("busy_s")
    busy_share = f", {busy / up:.0%} of uptime" if isinstance(busy, (int, float)) and up else ""
    rate = thr.get("output_tokens_per_busy_s")
    tpot = (tim.get("tpot_s") or {}).get("p50")

    def dist(name: str) -> str:
        d = tim.get(name) or {}
        return (f"p50 {_dur(d.get('p50'))} (mean {_dur(d.get('mean'))}, p90 {_dur(d.get('p90'))}, "
                f"p99 {_dur(d.get('p99'))})") if d.get("p50") is not None else "-"

    per_pos = ", ".join(_pct(x) for x in spec.get("per_position_acceptance") or []) or "-"
    lines = [
        ("daemon", f"pid {st.get('pid')}, dsv4 {st.get('version')} (protocol {st.get('protocol')}), "
                   f"up {_uptime(up)}, {st.get('endpoint')}"),
        ("model", _model(st) + f" (vocabulary {st.get('vocab_size')}), {st.get('device')} {st.get('dtype')}, "
                  f"MTP K = {st.get('num_speculative_tokens')}"),
        ("compiled", _compiled(st)),
        ("kernels", st.get("kernels") or "torch's own ops"),
        ("requests", f"{st.get('running')} running, {st.get('waiting')} waiting, {st.get('in_flight')} in flight "
                     f"from {st.get('clients')} client(s); {t.get('requests', 0)} finished"),
        ("tokens", f"{usage.get('prompt_tokens', 0)} prompt, {usage.get('completion_tokens', 0)} generated"),
        ("throughput", (f"{rate:.1f} tok/s while busy" if isinstance(rate, (int, float)) else "-")
         + f" (busy {_dur(busy)}{busy_share})"),
        ("TTFT", dist("ttft_s")),
        ("TPOT", dist("tpot_s") + (f"; {1 / tpot:.1f} tok/s per request" if tpot else "")),
        ("E2E", dist("e2e_s")),
        ("MTP", f"acceptance {_pct(spec.get('acceptance_rate'))} ({spec.get('accepted', 0)} of "
                f"{spec.get('drafted', 0)} drafts), mean acceptance length "
                + (f"{spec['mean_acceptance_length']:.2f}" if spec.get("mean_acceptance_length") else "-")
                + f", per position {per_pos}"),
        ("memory", f"{_bytes(st.get('memory_rss_bytes'))} resident, {_bytes(st.get('state_bytes'))} request state"),
        ("state", _pool(st)),
    ]
    lines += _replicas(st)
    out = [f"{k:<11} {v}" for k, v in lines]
    extra = {k: v for k, v in st.items() if k not in KNOWN}
    out += [f"{k:<11} {v}" for k, v in _flatten(extra)]
    return out
