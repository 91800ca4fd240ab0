"""One generation request and its lifecycle; pure Python (no torch).

    WAITING --admit (slot assigned)--> PREFILL --last chunk done--> DECODE --> FINISHED

A request holds only what the scheduler needs: its prompt, its sampling parameters, how
many of its tokens are in the model state (`num_computed_tokens`), its output so far and
its slot, the index 0..max_num_seqs-1 of its row in the model's preallocated state.

Position invariant: while prefilling, `num_computed_tokens` is the start of the next
chunk. While decoding, `num_computed_tokens == num_tokens - 1`: the last output token
is not in the state yet, and it is the first row (at position `num_computed_tokens`) of
the next decode step. `RequestOutput` is what a step gives back of one request.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsv4.engine.errors import RequestError  # noqa: F401  (re-exported: the error of one request)

if TYPE_CHECKING:
    from dsv4.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    PREFILL = "prefill"  # has a slot, prompt not fully in the state
    DECODE = "decode"  # prompt done, generating
    FINISHED = "finished"


# Finish reasons (strings, as they go over the wire).
FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or max_model_len reached
FINISH_ABORT = "abort"  # cancelled by the client
FINISH_ERROR = "error"  # failed inside the engine


@dataclass(eq=False)
class Request:
    """A generation request. The scheduler owns every field below `params`."""

    request_id: Any  # any hashable id, unique among live requests (a str over the wire)
    prompt_ids: list[int]
    params: "SamplingParams"
    arrival_time: float = field(default_factory=time.monotonic)
    client: Any = None  # who asked (any hashable): admission shares the slots fairly between clients
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    num_spec: int = 0  # K for this request: 0 when params.speculative is False
    finish_reason: str | None = None
    grammar: Any = None  # a `grammar.GrammarState` when the output is constrained (rank 0)
    # Scheduler bookkeeping.
    num_scheduled_tokens: int = 0  # tokens given to this request by the latest schedule()
    last_scheduled_step: int = -1
    num_cached_tokens: int = 0  # prefill tokens a prefix-cache hit gave this admission
    prompt_cached_tokens: int = 0  # ... its first admission (usage: cached_tokens)
    cache_counted: bool = False  # its first admission went into the prefix cache's hit rate
    recomputed: int = 0  # outputs its prefill recomputes after a preemption (they stay output)
    block_hashes: list = field(default_factory=list, repr=False)  # chained hashes of its full prefill blocks
    after: "Request | None" = field(default=None, repr=False)  # a sibling sample with the same prompt

    def waits_for_sibling(self) -> bool:
        """Whether it must stay queued until `after` (the first sample of its prompt) has
        prefilled, so that the prefix cache gives it that prefill's blocks (then forgotten)."""
        if self.after is not None and self.after.status not in (RequestStatus.WAITING, RequestStatus.PREFILL):
            self.after = None
        return self.after is not None

    @property
    def prefill_ids(self) -> list[int]:
        """What its prefill computes: the prompt, and after a preemption the outputs it had made."""
        return self.prompt_ids + self.output_ids[: self.recomputed] if self.recomputed else self.prompt_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill reports the prompt's logprobs (asked for, and not a recompute's again)."""
        return self.params.prompt_logprobs is not None and not self.recomputed

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.prompt_ids) + self.recomputed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"computed={self.num_computed_tokens}, out={len(self.output_ids)}, slot={self.slot})")


@dataclass
class RequestOutput:
    """New output of one request since the previous one."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # per token: "draft" or "target"
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict[str, Any] | None = None
    # per token, when the request asks (`SamplingParams.logprobs`): {id, token, bytes, logprob, top: [...]}
    logprobs: list[dict[str, Any]] | None = None
    # the prompt's, in the request's first output (`prompt_logprobs`; the first token's logprob is None)
    prompt_logprobs: list[dict[str, Any]] | None = None
    # refused where it was queued (an engine replica: a grammar that did not compile, a full
    # queue): the daemon answers it as its admission refuses (`RequestBusy`: busy, else bad_request)
    refusal: Exception | None = None
