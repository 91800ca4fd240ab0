"""Rank 0's per-step messages to the other ranks under tensor parallelism: what they say
and which way they travel.

Every step `Runner.execute` on rank 0 sends the plan (`plan_message`: rows, prompts
when a request starts, decode tokens with their drafts, the step's K), then, after the
dispatch, its sampled results; each other rank rebuilds the plan on shadow requests
(`follow`) and runs the same dispatches on its shard. Both go through `broadcast`: the
channel `use_channel` installed (on one host `transport.ShmChannel`, shared memory with
only a header through the group), else the group's own object broadcast
(`parallel.broadcast_object`). This module owns the channel; `ranks` installs it when the
group is joined and closes it (`close_channel`) before leaving the group.
"""

from __future__ import annotations

import time
from typing import Any

from dsv4.model import parallel
from dsv4.engine.request import Request
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.scheduler import SchedulerOutput

_CHANNEL: Any = None  # a transport.ShmChannel on one host; None: through the group
KEEPALIVE = "keepalive"  # rank 0's message while it has no step to send: the others go on waiting
_LAST_SENT = [time.monotonic()]  # when rank 0 last broadcast (monotonic seconds)


def use_channel(channel: Any) -> None:
    """Send `broadcast`'s messages through `channel` (its `broadcast(obj)`; None: the group)."""
    global _CHANNEL
    _CHANNEL = channel


def channel() -> Any:
    """The channel `use_channel` installed (None: messages go through the group)."""
    return _CHANNEL


def close_channel() -> None:
    """Close and drop the channel (a no-op when there is none)."""
    global _CHANNEL
    if _CHANNEL is not None:
        _CHANNEL.close()
        _CHANNEL = None


def broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (a step's plan, then its results): through the channel
    when one is installed, else `parallel.broadcast_object`. Counted in `parallel.STATS`
    as "broadcast_object" either way."""
    _LAST_SENT[0] = time.monotonic()
    if _CHANNEL is None or parallel.world_size() == 1:
        return parallel.broadcast_object(obj)
    t0 = time.perf_counter()
    out = _CHANNEL.broadcast(obj)
    parallel.count("broadcast_object", t0)
    return out


def idle_s() -> float:
    """Seconds since this process last broadcast (rank 0: since the other ranks last heard from it)."""
    return time.monotonic() - _LAST_SENT[0]


def plan_message(plan: SchedulerOutput, drafts: dict[int, list[int]],
                 sync_drafts: bool = False) -> tuple[list, list, int, bool, Any]:
    """What the other ranks need of one step: (slot, start, n, prefill ids at the request's
    first chunk (start 0, or its prefix-cache hit) else None,
    K, whether the chunk's rows all get logits: prompt logprobs) per prefill chunk, (slot, n, computed, last token, K, drafts) per decode row, the
    drafts this step makes (`SchedulerOutput.num_drafts`: auto K's choice, else the fixed K) and whether
    rank 0 sends each MTP depth's drafts (`Runner.sync_drafts`: sampled drafts are rank 0's
    draws, and the deeper dispatches of every rank must take the same tokens), and the
    step's `KVPlan` (block tables, ring loads / saves / drops: every rank keeps its own
    rings and applies the same plan, so they agree on every hit)."""
    return ([(r.slot, s, n, r.prefill_ids if s == r.num_cached_tokens else None, r.num_spec,
              r.wants_prompt_logprobs)
             for r, s, n in plan.prefills],
            [(r.slot, n, r.num_computed_tokens, r.last_token_id, r.num_spec, drafts.get(r.slot, [])[: n - 1])
             for r, n in plan.decodes], plan.num_drafts, sync_drafts, plan.kv)


def follow(runner: Any) -> None:
    """A worker's loop: run every step rank 0 broadcasts on `runner` (a `Runner`), until
    the stop message (None)."""
    shadows: dict[int, Request] = {}
    while True:
        msg = broadcast(None)
        if msg is None:
            return
        if msg == KEEPALIVE:
            continue
        # auto K: the MTP depth of this step, as rank 0 chose it; sampled drafts: rank 0 sends each depth's
        pre, dec, num_drafts, runner.sync_drafts, kv = msg
        plan = SchedulerOutput(kv=kv, num_drafts=num_drafts)
        prefills, decodes = plan.prefills, plan.decodes
        for slot, start, n, prompt, k, prompt_lp in pre:
            if prompt is not None:
                shadows[slot] = Request(f"slot-{slot}", list(prompt), SamplingParams(), slot=slot,
                                        num_cached_tokens=start)
            shadows[slot].num_spec = k
            shadows[slot].params.prompt_logprobs = 0 if prompt_lp else None  # the same head rows as rank 0
            prefills.append((shadows[slot], start, n))
        for slot, n, computed, last, k, drafts in dec:
            req = shadows[slot]
            req.num_computed_tokens, req.output_ids, req.num_spec = computed, [last], k
            runner.drafts[slot] = list(drafts)
            decodes.append((req, n))
        runner.execute(plan)
