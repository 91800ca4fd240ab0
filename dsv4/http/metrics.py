"""Prometheus metrics of the HTTP front end, under vLLM's names (dashboards, `vllm bench serve`).

Counters and histograms are observed here, per HTTP request, from the daemon's replies:
generated tokens as they stream (the token ids of each delta: tokens, not engine steps),
prompt tokens (the `usage` of each final message), TTFT, the gap
between streamed deltas, end-to-end latency, finish reasons and the MTP counters
(`vllm:spec_decode_*`: acceptance rate = accepted / draft tokens; mean acceptance length
= 1 + accepted / drafts). The running / waiting gauges are read from the daemon's status
at scrape time. prometheus_client's `_created` series are switched off because recent
`vllm bench serve` sums every line that starts with `vllm:spec_decode`.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

prometheus_client.disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class Metrics:
    """One registry per HTTP app; `model_name` is every series' label."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, ["model_name"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests in the engine's running set", lab, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot", lab, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lab, registry=r)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     lab, registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", lab,
                                  registry=r)
        self.success = Counter("vllm:request_success", "Requests finished", lab + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lab,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between streamed outputs", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps that carried drafts", lab, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", lab, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", lab, registry=r)
        self.accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted per "
                                    "draft position", lab + ["position"], registry=r)
        eng = lab + ["engine"]  # per replica (--data-parallel-size), from the daemon's status at scrape time
        self.engine_running = Gauge("dsv4:engine_requests_running", "Requests running on one engine replica", eng,
                                    registry=r)
        self.engine_waiting = Gauge("dsv4:engine_requests_waiting", "Requests waiting on one engine replica", eng,
                                    registry=r)
        self.engine_hits = Gauge("dsv4:engine_prefix_cache_hits", "Prompt tokens one replica found in its prefix "
                                 "cache (since it started)", eng, registry=r)
        self.engine_queries = Gauge("dsv4:engine_prefix_cache_queries", "Prompt tokens one replica looked up in its "
                                    "prefix cache (since it started)", eng, registry=r)
        self.engine_routed = Gauge("dsv4:engine_routed_requests", "Requests routed to one replica, by why: prefix "
                                   "(it holds the prompt's prefix), load (the least loaded), balance (away from a "
                                   "busy holder)", eng + ["why"], registry=r)
        self.engine_restarts = Gauge("dsv4:engine_restarts", "Times one replica was started again", eng, registry=r)
        for c in (self.prompt_tokens, self.generation_tokens, self.drafts, self.draft_tokens, self.accepted):
            c.labels(model_name)  # exported as 0 before the first request
        for g in (self.running, self.waiting):
            g.labels(model_name).set(0)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_gap(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def observe_tokens(self, n: int) -> None:
        """`n` tokens streamed (a delta)."""
        self.generation_tokens.labels(self.model_name).inc(n)

    def observe_final(self, msg: dict[str, Any], e2e_s: float) -> None:
        """A final message from the daemon: prompt tokens, finish reason, latency, MTP counters."""
        m = self.model_name
        usage, spec = msg.get("usage") or {}, msg.get("spec") or {}
        self.prompt_tokens.labels(m).inc(int(usage.get("prompt_tokens") or 0))
        self.cache_queries.labels(m).inc(int(usage.get("prompt_tokens") or 0))
        self.cache_hits.labels(m).inc(int(usage.get("cached_tokens") or 0))
        reason = msg.get("finish_reason")
        if reason in ("stop", "length"):
            self.success.labels(m, reason).inc()
            self.e2e.labels(m).observe(e2e_s)
        self.drafts.labels(m).inc(int(spec.get("verify_steps") or 0))
        self.draft_tokens.labels(m).inc(int(spec.get("drafted") or 0))
        self.accepted.labels(m).inc(int(spec.get("accepted") or 0))
        for pos, n in enumerate(spec.get("accepted_per_position") or []):
            self.accepted_pos.labels(m, str(pos)).inc(int(n))

    def set_queue(self, status: dict[str, Any]) -> None:
        self.running.labels(self.model_name).set(float(status.get("running") or 0))
        self.waiting.labels(self.model_name).set(float(status.get("waiting") or 0))
        for rep in status.get("replicas") or []:
            m, e = self.model_name, str(rep.get("index"))
            self.engine_running.labels(m, e).set(float(rep.get("running") or 0))
            self.engine_waiting.labels(m, e).set(float(rep.get("waiting") or 0))
            self.engine_hits.labels(m, e).set(float(rep.get("prefix_cache_hits") or 0))
            self.engine_queries.labels(m, e).set(float(rep.get("prefix_cache_queries") or 0))
            self.engine_restarts.labels(m, e).set(float(rep.get("restarts") or 0))
            for why, n in (rep.get("routed") or {}).items():
                self.engine_routed.labels(m, e, why).set(float(n))

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
