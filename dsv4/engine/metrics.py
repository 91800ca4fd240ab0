"""Per-request and engine-wide metrics, with the definitions of docs/serving.md section 4, and
the torch profiler traces of engine steps (`--profile`, `step_profiler`).

* TTFT: arrival to first output token.
* TPOT: (end-to-end latency - TTFT) / (output tokens - 1).
* Acceptance rate: accepted drafts / drafted tokens.
* Mean acceptance length: 1 + accepted / verify steps (counts the bonus token; <= K + 1).
  A verify step is a decode step that carried at least one draft.
* Per-position acceptance: for draft position i, accepted at i / drafted at i.

Times are `time.monotonic()` seconds unless the caller passes its own clock readings.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _per_position(accepted: Sequence[int], drafted: Sequence[int]) -> list[float]:
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation between closest ranks); None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values)

    def q(frac: float) -> float:
        pos = frac * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


class _Acceptance:
    """Acceptance figures of anything counting `drafted`, `accepted` and `verify_steps`."""

    drafted: int
    accepted: int
    verify_steps: int

    @property
    def acceptance_rate(self) -> float | None:
        return _ratio(self.accepted, self.drafted)

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / verify steps: tokens per verify step, the bonus token included."""
        r = _ratio(self.accepted, self.verify_steps)
        return None if r is None else 1.0 + r


@dataclass
class RequestMetrics(_Acceptance):
    """Timings and speculation counters of one request."""

    arrival: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, from the prefix cache (its first admission's)
    first_token_time: float | None = None
    completion_tokens: int = 0
    last_token_time: float | None = None
    finish_time: float | None = None
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    # ------------------------------------------------------------------ recording
    def on_tokens(self, n: int, now: float | None = None) -> None:
        """`n` output tokens were produced at `now` (a speculative step emits several at once)."""
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.completion_tokens += n
        self.last_token_time = now

    def on_verify(self, num_drafted: int, num_accepted: int) -> None:
        """One decode step verified `num_drafted` drafts and accepted the first `num_accepted`."""
        if num_drafted <= 0:
            return
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafts")
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.verify_steps += 1
        for counts, n in ((self.drafted_per_position, num_drafted), (self.accepted_per_position, num_accepted)):
            if len(counts) < num_drafted:
                counts.extend([0] * (num_drafted - len(counts)))
            for i in range(n):
                counts[i] += 1

    def on_finish(self, now: float | None = None) -> None:
        self.finish_time = time.monotonic() if now is None else now

    # ------------------------------------------------------------------ derived
    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def end_time(self) -> float | None:
        """When the request finished, else when its last token came (None before any)."""
        return self.finish_time if self.finish_time is not None else self.last_token_time

    @property
    def e2e(self) -> float | None:
        end = self.end_time
        return None if end is None else end - self.arrival

    @property
    def tpot(self) -> float | None:
        ttft, e2e, n = self.ttft, self.e2e, self.completion_tokens
        return None if ttft is None or e2e is None or n < 2 else (e2e - ttft) / (n - 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "cached_tokens": self.cached_tokens},
            "timings": {"ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e},
            "spec": {
                "drafted": self.drafted,
                "accepted": self.accepted,
                "verify_steps": self.verify_steps,
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance": _per_position(self.accepted_per_position, self.drafted_per_position),
                "accepted_per_position": list(self.accepted_per_position),
                "drafted_per_position": list(self.drafted_per_position),
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], end: float) -> "RequestMetrics":
        """A finished request's metrics again from its `to_dict` (a replica's final output),
        finished at `end` (time.monotonic: one clock for every process of the host)."""
        usage, tim, spec = d.get("usage") or {}, d.get("timings") or {}, d.get("spec") or {}
        e2e, ttft = tim.get("e2e_s"), tim.get("ttft_s")
        m = cls(arrival=end - (e2e or 0.0), prompt_tokens=int(usage.get("prompt_tokens") or 0),
                cached_tokens=int(usage.get("cached_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0), finish_time=end,
                drafted=int(spec.get("drafted") or 0), accepted=int(spec.get("accepted") or 0),
                verify_steps=int(spec.get("verify_steps") or 0),
                drafted_per_position=list(spec.get("drafted_per_position") or []),
                accepted_per_position=list(spec.get("accepted_per_position") or []))
        m.first_token_time = m.arrival + ttft if ttft is not None else None
        return m


@dataclass
class EngineMetrics(_Acceptance):
    """Engine-wide totals: tokens as they are produced (`on_output`: requests still running
    count, so throughput is right during a long generation), and over finished requests the
    request count, acceptance and the distributions of their timings."""

    start_time: float = field(default_factory=time.monotonic)
    num_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    last_time: float | None = None
    busy_s: float = 0.0  # time spent in engine steps

    def on_step(self, num_prefill_tokens: int, num_decode_tokens: int, seconds: float = 0.0) -> None:
        self.busy_s += seconds
        self.num_steps += 1
        self.num_prefill_tokens += num_prefill_tokens
        self.num_decode_tokens += num_decode_tokens

    def on_output(self, num_prompt_tokens: int, num_output_tokens: int, now: float | None = None) -> None:
        """A step prefilled `num_prompt_tokens` and produced `num_output_tokens` (counted now,
        not when their requests finish)."""
        self.prompt_tokens += num_prompt_tokens
        self.completion_tokens += num_output_tokens
        if num_output_tokens:
            now = time.monotonic() if now is None else now
            self.last_time = now if self.last_time is None else max(self.last_time, now)

    def add(self, m: RequestMetrics, *, streamed: bool = False) -> None:
        """Fold in a finished request; its tokens too, unless `streamed` (counted by `on_output`)."""
        self.num_requests += 1
        if not streamed:
            self.prompt_tokens += m.prompt_tokens
            self.completion_tokens += m.completion_tokens
        self.drafted += m.drafted
        self.accepted += m.accepted
        self.verify_steps += m.verify_steps
        _add_counts(self.drafted_per_position, m.drafted_per_position)
        _add_counts(self.accepted_per_position, m.accepted_per_position)
        for xs, v in ((self.ttfts, m.ttft), (self.tpots, m.tpot), (self.e2es, m.e2e)):
            if v is not None:
                xs.append(v)
        end = m.end_time
        if end is not None:
            self.last_time = end if self.last_time is None else max(self.last_time, end)

    def output_throughput(self, now: float | None = None) -> float | None:
        """Output tokens per second of wall time since `start_time`."""
        end = now if now is not None else (self.last_time if self.last_time is not None else time.monotonic())
        wall = end - self.start_time
        return self.completion_tokens / wall if wall > 0 else None

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        return {
            "requests": self.num_requests,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
            "throughput": {"output_tokens_per_s": self.output_throughput(now),
                           "busy_s": self.busy_s,
                           "output_tokens_per_busy_s": self.completion_tokens / self.busy_s if self.busy_s else None},
            "timings": {"ttft_s": percentiles(self.ttfts), "tpot_s": percentiles(self.tpots),
                        "e2e_s": percentiles(self.e2es)},
            "spec": {
                "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance": _per_position(self.accepted_per_position, self.drafted_per_position),
            },
            "steps": {"count": self.num_steps, "prefill_tokens": self.num_prefill_tokens,
                      "decode_tokens": self.num_decode_tokens},
        }


def _add_counts(mine: list[int], theirs: list[int]) -> None:
    """Add per-position counts `theirs` into `mine` (extended as needed)."""
    mine.extend([0] * (len(theirs) - len(mine)))
    for i, c in enumerate(theirs):
        mine[i] += c


def step_profiler(config: Any) -> Any:
    """With --profile DIR (or DSV4_PROFILE_DIR): torch profiler traces of engine steps.

    Cycles of 10 recorded steps (after 5 skipped and 1 warm-up), at most 10 trace files,
    so a long-running daemon does not grow without bound. Runner stages are labelled
    `dsv4.dispatch` (prefill chunks and verify rows), `dsv4.sample_verify`, `dsv4.mtp`.
    """
    if not config.profile_dir:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    import warnings

    warnings.filterwarnings("ignore", message=".*Profiler clears events")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if config.device.startswith("cuda") else [])
    prof = profile(activities=acts, schedule=schedule(wait=5, warmup=1, active=10, repeat=10),
                   on_trace_ready=tensorboard_trace_handler(config.profile_dir, worker_name="dsv4"))
    prof.start()
    return prof
