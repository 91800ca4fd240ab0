"""The daemon's logprobs (`delta.logprobs`, `delta.prompt_logprobs`: `dsv4.engine.logprobs`) in
OpenAI's reply shapes.

* chat: `choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs}], ...}`,
  one entry per generated token (reasoning tokens included);
* completions: `choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`
  (`top_logprobs`: the n most likely and always the chosen one; with `echo` the prompt's
  tokens first; `text_offset` counts characters across stream chunks);
* vLLM's `prompt_logprobs` (`prompt_logprobs_of`, `vllm_prompt`): per prompt position null
  (the first) or {token id: {logprob, rank, decoded_token}}, the raw log-softmax.

A logprob of -inf (nil on the wire) is reported as -9999.0, as vLLM does: JSON has no
infinity. Details: docs/http-api.md, 'dsv4/http/logprobs.py'.
"""

from __future__ import annotations

import codecs
from typing import Any

FLOOR = -9999.0


def _lp(v: float | None) -> float:
    return FLOOR if v is None or v < FLOOR else float(v)


def chat_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Wire entries -> chat `logprobs.content` entries."""
    return [{"token": e["token"], "logprob": _lp(e["logprob"]), "bytes": list(e["bytes"]),
             "top_logprobs": [{"token": t["token"], "logprob": _lp(t["logprob"]), "bytes": list(t["bytes"])}
                              for t in e["top"]]} for e in entries]


def empty_completion() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def extend(into: dict[str, list[Any]], part: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """`into` with `part`'s lists appended (in place)."""
    for k, v in part.items():
        into[k].extend(v)
    return into


def prompt_text(entries: list[dict[str, Any]]) -> str:
    """The text of prompt tokens (for echo of a token-id prompt): their bytes, decoded."""
    return b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace")


class CompletionLogprobs:
    """One completions choice's logprobs, built chunk by chunk (text offsets continue)."""

    def __init__(self) -> None:
        self.offset = 0  # characters of the choice's text before the next token
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def part(self, entries: list[dict[str, Any]]) -> dict[str, list[Any]]:
        out = empty_completion()
        for e in entries:
            out["text_offset"].append(self.offset)
            self.offset += len(self._utf8.decode(bytes(e["bytes"])))
            out["tokens"].append(e["token"])
            if e["logprob"] is None and not e["top"]:  # the first prompt token: nothing before it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp = _lp(e["logprob"])
            top = {t["token"]: _lp(t["logprob"]) for t in e["top"]}
            top.setdefault(e["token"], lp)  # the chosen token is always there
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
        return out


def prompt_logprobs_of(body: dict[str, Any], most: int) -> int | None:
    """vLLM's `prompt_logprobs` field: None, or the top tokens per prompt position (0..most);
    ValueError naming it otherwise."""
    v = body.get("prompt_logprobs")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= most:
        raise ValueError(f"prompt_logprobs must be an integer in [0, {most}], got {v!r:.40}")
    return v


def vllm_prompt(entries: list[dict[str, Any]], n: int) -> list[dict[str, dict[str, Any]] | None]:
    """Prompt wire entries -> vLLM's prompt_logprobs: null for the first, then {id: {logprob,
    rank, decoded_token}} of the prompt's token and the n most likely (ranks 1..n)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e["logprob"] is None:
            out.append(None)
            continue
        d = {str(t["id"]): {"logprob": _lp(t["logprob"]), "rank": r, "decoded_token": t["token"]}
             for r, t in enumerate(e["top"][:n], start=1)}
        d[str(e["id"])] = {"logprob": _lp(e["logprob"]), "rank": e.get("rank"), "decoded_token": e["token"]}
        out.append(d)
    return out
