"""The scheduler: which requests run in the next step, and how many tokens each; pure Python.

One engine step: `out = scheduler.schedule()` (admit, then plan); the runner runs
`out.prefills` and `out.decodes` in one dispatch; then `on_prefill_done(req, n, first_token
or None)` per prefill entry and `on_decode_done(req, emitted)` per decode entry (both return
the tokens actually appended, cut at EOS / stop ids / max_tokens / max_model_len; the
request may then be FINISHED, its slot free). `finish(req, reason)` and `abort(request_id)`
end a request early.

A prefill entry `(req, start, n)` is the prompt chunk [start, start+n) (`start == 0`: the
slot was just (re)assigned, its state must be reset); a decode entry `(req, num_tokens)`
feeds `[x_last, d_1 .. d_{num_tokens-1}]` from `req.num_computed_tokens`. Rows are
classified by request state, never by length. The policy (fair admission between clients,
chunks, decodes, blocks and preemption, no starvation): docs/serving.md, 'dsv4/engine/scheduler.py'.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from dsv4.engine.kvcache import BlockManager, KVPlan
from dsv4.engine.request import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Request,
    RequestError,
    RequestStatus,
)


@dataclass
class SchedulerOutput:
    """The plan for one step."""

    prefills: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, start, n)
    decodes: list[tuple[Request, int]] = field(default_factory=list)  # (request, 1 + drafts)
    kv: KVPlan | None = None  # block tables, ring loads / saves / drops (with a BlockManager)
    # K of this step: the MTP drafts per request the runner makes for the next step to verify
    # (auto K: the policy's choice; else the fixed K). The one name K travels under.
    num_drafts: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.prefills) + sum(n for _, n in self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Fair admission into fixed slots (FCFS per client); per-step token budget shared by
    decodes and prefill chunks."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        chunk_size: int,
        single_dispatch: bool = False,
        num_speculative_tokens: int = 0,
        eos_token_id: int | None = None,
        vocab_size: int | None = None,
        kv: BlockManager | None = None,
        policy: Any = None,
    ):
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("chunk_size", chunk_size)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if not 0 <= num_speculative_tokens < max_num_batched_tokens:
            raise ValueError(f"budget {max_num_batched_tokens} cannot hold 1 + K = {1 + num_speculative_tokens}")
        if single_dispatch and max_model_len - 1 > min(chunk_size, max_num_batched_tokens):
            raise ValueError("single-dispatch mode needs max_model_len - 1 <= min(chunk_size, budget)")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.budget = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.single_dispatch = single_dispatch
        self.num_spec = num_speculative_tokens
        self.policy = policy  # auto K (`SpecPolicy`): chooses each plan's num_drafts; None = the fixed K
        self._drafted = num_speculative_tokens  # the last plan's num_drafts: this step verifies at most these
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.kv = kv  # None: every slot's state is preallocated (no blocks to manage)
        self.num_preemptions = 0

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._by_id: dict[Any, Request] = {}
        self._free_slots = list(range(max_num_seqs))  # a heap: lowest slot first
        self._step = 0
        self._prefill_first = False  # set when prefills were starved in the last step

    @classmethod
    def from_config(cls, cfg: Any, eos_token_id: int | None = None, kv: BlockManager | None = None,
                    policy: Any = None) -> "Scheduler":
        """Build from an `EngineConfig` (or anything with the same attributes)."""
        mc = getattr(cfg, "model_config", None)
        return cls(
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            chunk_size=cfg.effective_chunk_size,
            single_dispatch=cfg.single_dispatch,
            num_speculative_tokens=cfg.num_speculative_tokens,
            eos_token_id=eos_token_id if eos_token_id is not None else getattr(mc, "eos_token_id", None),
            vocab_size=getattr(mc, "vocab_size", None),
            kv=kv,
            policy=policy,
        )

    # ------------------------------------------------------------------ requests in and out
    def add(self, request: Request) -> None:
        """Queue a request; raises `RequestError` (for this request only) if it cannot run."""
        if request.request_id in self._by_id:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        check_prompt(request.prompt_ids, request.params, self.vocab_size, self.max_model_len,
                     self.kv.num_blocks * self.kv.block_size if self.kv is not None else None)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_cached_tokens = request.recomputed = 0
        request.cache_counted, request.block_hashes = False, []
        request.output_ids = []
        request.slot = None
        request.finish_reason = None
        request.num_spec = self.num_spec if request.params.speculative else 0
        self.waiting.append(request)
        self._by_id[request.request_id] = request

    def finish(self, request: Request, reason: str) -> None:
        """Finish a request now and free its slot; a no-op if it already finished."""
        if request.is_finished:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            request.slot = None
        else:
            self._release_slot(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._by_id.pop(request.request_id, None)

    def stop_at(self, request: Request, n: int) -> None:
        """A stop string ended the output inside the tokens just appended: keep the first
        `n` outputs and finish as stopped, also when those tokens had already finished it
        for another reason (length)."""
        del request.output_ids[n:]
        self.finish(request, FINISH_STOP)
        request.finish_reason = FINISH_STOP

    def is_stop_token(self, request: Request, t: int) -> bool:
        """Whether output token `t` ends the request (EOS unless ignored, or a stop token id).
        A structured output ends at EOS whatever ignore_eos says: it is its grammar's end."""
        p = request.params
        return (t == self.eos_token_id and (not p.ignore_eos or p.structured is not None)) or t in p.stop_token_ids

    def abort(self, request_id: Any) -> Request | None:
        """Cancel a live request; returns it, or None if no live request has that id."""
        req = self._by_id.get(request_id)
        if req is not None:
            self.finish(req, FINISH_ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        """Admit waiting requests into free slots and spend this step's budget."""
        self._step += 1
        self._admit()
        for req in self.running:
            req.num_scheduled_tokens = 0
        prefilling = [r for r in self.running if r.status is RequestStatus.PREFILL]
        decoding = [r for r in self.running if r.status is RequestStatus.DECODE]

        out = SchedulerOutput()
        budget = self.budget
        if self._prefill_first:
            budget = self._plan_prefills(prefilling, budget, out)
            budget = self._plan_decodes(decoding, budget, out)
        else:
            budget = self._plan_decodes(decoding, budget, out)
            budget = self._plan_prefills(prefilling, budget, out)
        self._prefill_first = bool(prefilling) and not out.prefills
        if self.kv is not None:
            out.kv = self.kv.take_plan()
        if not out.is_empty:
            out.num_drafts = self.num_spec
            if self.policy is not None:  # the drafts this step makes, for the requests that will decode
                spec = [r for r in self.running if r.num_spec]
                out.num_drafts = self.policy.choose(len(spec), sum(1 for r in spec if not r.params.greedy))
            self._drafted = out.num_drafts
        return out

    def _admit(self) -> None:
        """Fill free slots from `waiting`: the oldest request of the client holding the fewest
        slots first, ties to the oldest request (module docstring, Admission)."""
        if not self.waiting or not self._free_slots:
            return
        held: dict[Any, int] = {}
        for r in self.running:
            held[r.client] = held.get(r.client, 0) + 1
        queues: dict[Any, deque[tuple[int, Request]]] = {}
        for pos, r in enumerate(self.waiting):
            if not r.waits_for_sibling():
                queues.setdefault(r.client, deque()).append((pos, r))
        heap = [(held.get(c, 0), q[0][0], c) for c, q in queues.items()]
        heapq.heapify(heap)  # (slots held, position of its oldest waiting request, client); positions are unique
        admitted: set[int] = set()
        while heap and self._free_slots:
            n, _, client = heapq.heappop(heap)
            q = queues[client]
            pos, req = q[0]
            if self.kv is not None and not self.kv.admit(req, self._free_slots[0]):
                break  # its blocks are not free yet: it stays first in line
            q.popleft()
            admitted.add(pos)
            req.slot = heapq.heappop(self._free_slots)
            req.status = RequestStatus.PREFILL
            self.running.append(req)
            if q:
                heapq.heappush(heap, (n + 1, q[0][0], client))
        if len(admitted) == len(self.waiting):
            self.waiting.clear()
        else:
            self.waiting = deque(r for pos, r in enumerate(self.waiting) if pos not in admitted)

    def _plan_prefills(self, reqs: list[Request], budget: int, out: SchedulerOutput) -> int:
        for req in reqs:
            if budget <= 0:
                break
            if req.slot is None:
                continue  # preempted by a request planned before it in this step
            start = req.num_computed_tokens
            left = req.num_prefill_tokens - start
            if self.single_dispatch:
                if left > budget:
                    break  # waits whole for a later step; never split, never overtaken
                n = left
            else:
                n = min(left, self.chunk_size, budget)
                if self.kv is not None and (p := self.kv.save_point(req, start)):
                    n = min(n, p - start)  # the rings are saved at a block boundary
            if not self._room(req, start + n):
                continue
            if self.kv is not None:
                self.kv.prefilled(req, start, n)
            out.prefills.append((req, req.num_computed_tokens, n))
            req.num_scheduled_tokens = n
            req.last_scheduled_step = self._step
            budget -= n
        return budget

    def _plan_decodes(self, reqs: list[Request], budget: int, out: SchedulerOutput) -> int:
        """Least recently served first, each with all the drafts its room allows or not at
        all this step: the draft count never depends on other requests, so a seeded
        sampled request makes the same tokens whatever runs beside it. One that does not
        fit goes first next step (the budget is at least 1 + K)."""
        for req in sorted(reqs, key=lambda r: r.last_scheduled_step):  # stable: admission order on ties
            if req.slot is None:
                continue  # preempted by a request planned before it in this step
            n = 1 + self.draft_room(req)
            if n > budget or not self._room(req, req.num_computed_tokens + n):
                continue
            budget -= n
            req.num_scheduled_tokens = n
            req.last_scheduled_step = self._step
            out.decodes.append((req, n))
        return budget

    def _room(self, req: Request, end: int) -> bool:
        """Whether `req` holds the blocks of its positions before `end`, growing them on demand
        and preempting newer requests not yet planned in this step when none are left."""
        if self.kv is None:
            return True
        need = self.kv.blocks_for(end)
        victims: list[Request] | None = None
        while not self.kv.grow(req.slot, need):
            if victims is None:  # newer requests not planned in this step, the newest last
                victims = [r for r in self.running[self.running.index(req) + 1:] if r.num_scheduled_tokens == 0]
            if not victims:
                return False
            self._preempt(victims.pop())
        return True

    def _release_slot(self, req: Request) -> None:
        """Take a running request out of the running set, with its slot and blocks."""
        self.running.remove(req)
        heapq.heappush(self._free_slots, req.slot)
        if self.kv is not None:
            self.kv.release(req.slot)
        req.slot = None

    def _preempt(self, req: Request) -> None:
        """Release `req`'s slot and blocks; it waits first in line to be recomputed."""
        self._release_slot(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = req.num_cached_tokens = 0
        req.recomputed = len(req.output_ids)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def draft_room(self, req: Request) -> int:
        """Most drafts `req` may take now: K (at most the last plan's `num_drafts`, the drafts
        auto K had the runner make), and never past max_model_len or max_tokens.

        A step with d drafts emits up to d + 1 tokens, so d <= room - 1 for both limits.
        """
        room_len = self.max_model_len - req.num_tokens - 1
        room_out = req.params.max_tokens - len(req.output_ids) - 1
        return max(0, min(req.num_spec, self._drafted, room_len, room_out))

    # ------------------------------------------------------------------ results
    def on_prefill_done(self, request: Request, n: int, token_id: int | None = None) -> list[int]:
        """A chunk of `n` prompt tokens is in the state; `token_id` is the first output
        token, given exactly when this was the last chunk. Returns the tokens appended."""
        if request.is_finished:
            return []  # aborted while its step ran
        if request.status is not RequestStatus.PREFILL or not 0 < n <= request.num_scheduled_tokens:
            raise ValueError(f"{request!r}: {n} prefill tokens were not scheduled")
        request.num_computed_tokens += n
        request.num_scheduled_tokens = 0
        if self.kv is not None and self.kv.caching:  # (without caching nothing is named: no hashing)
            self.kv.register(request.slot, self.kv.hashes(request), request.num_computed_tokens)
        last = request.num_computed_tokens == request.num_prefill_tokens
        if last != (token_id is not None):
            raise ValueError(f"{request!r}: the first output token comes with the last chunk, and only then")
        if not last:
            return []
        request.status = RequestStatus.DECODE
        return self._append(request, [token_id])

    def on_decode_done(self, request: Request, token_ids: Iterable[int]) -> list[int]:
        """A decode step emitted `token_ids` (accepted drafts, then the correction or bonus
        token). Returns the tokens appended, cut at the first finishing token."""
        if request.is_finished:
            return []
        tokens = [int(t) for t in token_ids]
        if request.status is not RequestStatus.DECODE or not 0 < len(tokens) <= request.num_scheduled_tokens:
            raise ValueError(f"{request!r}: {len(tokens)} tokens emitted, {request.num_scheduled_tokens} scheduled")
        request.num_computed_tokens += len(tokens)  # x_last plus the accepted drafts are now committed
        request.num_scheduled_tokens = 0
        return self._append(request, tokens)

    def _append(self, req: Request, tokens: list[int]) -> list[int]:
        p = req.params
        if p.max_tokens == 0:  # prompt logprobs only (echo): the first token is not output
            self.finish(req, FINISH_LENGTH)
            return []
        for i, t in enumerate(tokens):
            req.output_ids.append(t)
            if self.is_stop_token(req, t):
                self.finish(req, FINISH_STOP)
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                self.finish(req, FINISH_LENGTH)
            if req.is_finished:
                return tokens[: i + 1]
        return tokens


def check_prompt(ids: Any, params: Any, vocab_size: int | None, max_model_len: int, positions: int | None) -> None:
    """Refuse (RequestError) a prompt or parameters no engine of this config can run: ids that
    are not the vocabulary's, a prompt longer than max_model_len or than the state pool's
    `positions`, parameters naming tokens outside the vocabulary."""
    if vocab_size is not None:  # the params are valid since built; the model's vocabulary is ours
        params.check_vocab(vocab_size)
    if not isinstance(ids, list):
        raise RequestError(f"prompt token ids must be a list of integers, got {type(ids).__name__}")
    if not ids:
        raise RequestError("the prompt is empty; send at least one token")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise RequestError("prompt token ids must be non-negative integers")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise RequestError(f"prompt token id {max(ids)} is outside the vocabulary (size {vocab_size})")
    if len(ids) > max_model_len - 1:
        raise RequestError(f"the prompt has {len(ids)} tokens, but max_model_len {max_model_len} allows "
                           f"at most {max_model_len - 1} (one position is kept for output); "
                           f"shorten the prompt or raise --max-model-len")
    if positions is not None and len(ids) + 1 > positions:
        raise RequestError(f"the prompt has {len(ids)} tokens, more than the state pool holds "
                           f"({positions} positions); shorten the prompt or raise --kv-cache-memory")
