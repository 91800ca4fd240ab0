"""Logprobs: of each output token (`SamplingParams.logprobs`) and of each prompt token
(`SamplingParams.prompt_logprobs`, for `echo`), with the n most likely tokens at each position.

* output tokens: the log of the distribution the token was drawn from, after the request's
  processing (`sampling.processed_logprobs`; removed tokens -inf; greedy: the log-softmax
  after `logit_bias` and penalties). Under MTP an accepted draft gets its verify row's
  logprob: the same numbers as a run without drafts.
* prompt tokens: the raw log-softmax at the position before each token (lm-eval's
  loglikelihood); the first has none. Only requests that ask pay for the head over every row.

Requests that ask for neither cost nothing. `gather` turns rows of logprobs into
`TokenLogprob`s (one host copy per tensor); `TokenTexts` names tokens for the wire
(`entries`): text and UTF-8 bytes per id, cached. Details: docs/serving.md,
'dsv4/engine/logprobs.py'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from dsv4.engine.tokenizer import Tokenizer


@dataclass
class TokenLogprob:
    """One position: the token there, its logprob and the n most likely (most likely first)."""

    token_id: int
    logprob: float | None  # None: the first prompt token (nothing before it)
    top: list[tuple[int, float]]  # [(token id, logprob)] * n, descending
    rank: int | None = None  # 1 + the tokens more likely than it (vLLM's rank)


def gather(lp: torch.Tensor, tokens: Sequence[int], ns: Sequence[int]) -> list[TokenLogprob]:
    """Row r of `lp` [R, V] (log-probabilities) at tokens[r], with its ns[r] most likely tokens."""
    r = lp.shape[0]
    if r != len(tokens) or r != len(ns):
        raise ValueError(f"{r} rows for {len(tokens)} tokens and {len(ns)} counts")
    if r == 0:
        return []
    dev = lp.device
    picked = lp[torch.arange(r, device=dev), torch.tensor(list(tokens), dtype=torch.long, device=dev)]
    ranks = ((lp > picked[:, None]).sum(dim=-1) + 1).tolist()
    chosen = picked.tolist()
    k = min(max(ns), lp.shape[1])
    if k:
        vals, ids = lp.topk(k, dim=-1)  # [R, k], sorted descending
        vals, ids = vals.tolist(), ids.tolist()
    out = []
    for i in range(r):
        top = list(zip(ids[i][:ns[i]], vals[i][:ns[i]])) if k else []
        out.append(TokenLogprob(int(tokens[i]), chosen[i], top, ranks[i]))
    return out


def token_text(raw: bytes) -> str:
    """A token's text: its UTF-8 decoding, or OpenAI's `bytes:\\xNN...` for bytes that are
    not whole characters (a piece of a multi-byte character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), cached; without a tokenizer the text is empty."""

    def __init__(self, tokenizer: "Tokenizer | None") -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else b""
            hit = self._cache[token_id] = (token_text(raw), list(raw))
            if len(self._cache) > 1 << 18:
                self._cache.clear()
        return hit

    def entry(self, t: TokenLogprob) -> dict[str, Any]:
        """One position for the wire: {id, token, bytes, logprob, rank, top: [{id, token, bytes, logprob}]}."""
        text, raw = self.get(t.token_id)
        top = []
        for i, v in t.top:
            tt, tb = self.get(i)
            top.append({"id": i, "token": tt, "bytes": tb, "logprob": v})
        return {"id": t.token_id, "token": text, "bytes": raw, "logprob": t.logprob, "rank": t.rank, "top": top}

    def entries(self, ts: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        return [self.entry(t) for t in ts]
