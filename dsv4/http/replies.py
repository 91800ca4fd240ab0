"""The daemon's replies to one HTTP request folded into OpenAI objects, whole or as stream chunks.

Per choice, the text goes through a `dsv4.agents.replies.Reply`: thinking mode's reasoning
(before `</think>`) becomes `reasoning_content` and, when the request renders tools, the
DSML tool-call parser turns what the model writes as a
`<｜DSML｜tool_calls>` block becomes `tool_calls` (streamed as `delta.tool_calls`:
each call whole once its invoke closes) and never reaches `content`. A choice with
complete calls finishes with `tool_calls`; one whose text ended inside a call with `length`,
without that call.
Logprobs, when asked, ride with the text they belong to (`dsv4.http.logprobs`): a stream
chunk carries the entries of the tokens received since the last chunk; `echo` puts the
prompt (its text, and its tokens' logprobs) before a completion's answer.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from dsv4.agents.replies import Piece, Reply
from dsv4.daemon import protocol as P
from dsv4.http import logprobs as L
from dsv4.http.openai_requests import ApiError, Parsed

_DAEMON_STATUS = {P.ERR_SHUTTING_DOWN: 503, P.ERR_BUSY: 503, P.ERR_RATE_LIMITED: 429, P.ERR_INTERNAL: 500}


def daemon_error(msg: dict[str, Any]) -> ApiError:
    """An `error` reply, or a final that ended in error/abort, as an ApiError."""
    if msg["type"] == "error":
        return ApiError(_DAEMON_STATUS.get(str(msg.get("code")), 400), str(msg.get("message")))
    reason = msg.get("finish_reason")
    return ApiError(503 if reason == "abort" else 500, str(msg.get("error") or f"request ended: {reason}"))


class Replies:
    """The replies of one HTTP request (`index`: request id -> choice)."""

    def __init__(self, parsed: Parsed, chat: bool, index: dict[str, int], t0: float, *, model_name: str,
                 metrics: Any) -> None:
        self.parsed, self.chat, self.index, self.t0 = parsed, chat, index, t0
        self.model_name, self.metrics = model_name, metrics
        n = len(index)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.replies = [Reply(parsed.thinking, parsed.tools if chat else None) for _ in range(n)]  # text so far
        self.echo_sent = [""] * n  # the prompt text an echoing completion put before its answer
        self.reasons: list[str | None] = [None] * n
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = [0] * n, [0] * n, [0] * n
        self.started = [False] * n
        self.last_time: list[float | None] = [None] * n
        self.done: set[str] = set()
        self.finished = 0
        self.error: ApiError | None = None
        self.lp_all: list[Any] = [[] if chat else L.empty_completion() for _ in range(n)]  # every entry so far
        self.lp_new: list[Any] = [[] if chat else L.empty_completion() for _ in range(n)]  # not yet in a chunk
        self.lp_parts = [L.CompletionLogprobs() for _ in range(n)] if not chat else []
        self.prompt_lp: list[list | None] = [None] * n  # vLLM's prompt_logprobs of each choice
        self.prompt_lp_unsent = [False] * n
        # completions with echo: the prompt's text until it is sent (a token-id prompt's comes with its logprobs)
        self.echo_text: list[str | None] = [p if parsed.echo and isinstance(p, str) else None
                                            for p in (self.prompt_of(i) for i in range(n))]
        # The n samples of a prompt: only the first (its "leader") asks the engine for the prompt's
        # logprobs (`submit.sample_params`); its siblings take them from it, and a sibling's replies
        # that come before them wait here (its chunks keep their order).
        shares = "prompt_logprobs" in parsed.params and parsed.n > 1
        self.wants_prompt = [shares and i % parsed.n > 0 for i in range(n)]
        self.prompt_raw: list[list | None] = [None] * n  # a leader's prompt entries, as the daemon sent them
        self.deferred: list[list[dict[str, Any]]] = [[] for _ in range(n)]

    def prompt_of(self, i: int) -> str | list[int]:
        """The prompt of choice i (choices are prompt-major: n samples of each)."""
        return self.parsed.prompts[i // self.parsed.n]

    def take(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        """Fold in one reply; returns the stream chunks it makes."""
        rid = msg.get("id")
        i = self.index.get(rid) if isinstance(rid, str) else None
        if i is None or rid in self.done:
            if msg["type"] == "error" and rid is None:
                self.error = daemon_error(msg)
            return []
        if self.wants_prompt[i] and msg["type"] != "error":
            leader = i - i % self.parsed.n
            if self.prompt_raw[leader] is None:  # its leader's prompt logprobs are not here yet
                self.deferred[i].append(msg)
                return []
            self.wants_prompt[i] = False
            msg = {**msg, "prompt_logprobs": self.prompt_raw[leader]}
        chunks = self._take(i, rid, msg)
        if i % self.parsed.n == 0 and self.prompt_raw[i] is not None:  # a leader's: its siblings may go on
            for j in range(i + 1, i + self.parsed.n):
                waiting, self.deferred[j] = self.deferred[j], []
                for held in waiting:
                    chunks += self.take(held)
        return chunks

    def _take(self, i: int, rid: str, msg: dict[str, Any]) -> list[dict[str, Any]]:
        now = time.monotonic()
        m = self.metrics
        if msg["type"] == "error" or (msg["type"] == "final" and msg.get("finish_reason") in ("error", "abort")):
            self.error = daemon_error(msg)
            self.done.add(rid)
            self.finished += 1
            return []
        if msg["type"] == "delta":
            if self.last_time[i] is None:
                m.observe_first_token(now - self.t0)
            else:
                m.observe_gap(now - self.last_time[i])
            self.last_time[i] = now
            m.observe_tokens(len(msg.get("token_ids") or ()))
            self._logprobs(i, msg)
            return self._delta(i, self.replies[i].feed(msg.get("text") or ""), None, final=False)
        usage = msg.get("usage") or {}
        self.prompt_tokens[i] = int(usage.get("prompt_tokens") or 0)
        self.cached_tokens[i] = int(usage.get("cached_tokens") or 0)
        self.completion_tokens[i] = int(usage.get("completion_tokens") or 0)
        self.reasons[i] = msg.get("finish_reason")
        m.observe_final(msg, now - self.t0)
        self.done.add(rid)
        self.finished += 1
        return self._delta(i, self.replies[i].finish(cut=self.reasons[i] == "length"), self.reasons[i], final=True)

    def _logprobs(self, i: int, msg: dict[str, Any]) -> None:
        """Take a delta's logprobs (and, with echo, the prompt's) into choice i."""
        prompt = msg.get("prompt_logprobs")
        if prompt is not None:
            self.prompt_raw[i] = prompt
        if prompt is not None and self.parsed.prompt_logprobs is not None:
            self.prompt_lp[i], self.prompt_lp_unsent[i] = L.vllm_prompt(prompt, self.parsed.prompt_logprobs), True
        if self.parsed.echo and prompt is not None and not isinstance(self.prompt_of(i), str):
            self.echo_text[i] = L.prompt_text(prompt)
        if self.parsed.logprobs is None:
            return
        echoed = [{**e, "top": e["top"][:self.parsed.logprobs]} for e in prompt or []] if self.parsed.echo else []
        entries = echoed + (msg.get("logprobs") or [])
        if self.chat:
            new = L.chat_entries(entries)
            self.lp_all[i].extend(new)
            self.lp_new[i].extend(new)
        elif entries:
            part = self.lp_parts[i].part(entries)
            L.extend(self.lp_all[i], part)
            L.extend(self.lp_new[i], part)

    def _chunk_logprobs(self, i: int) -> Any:
        """The logprobs a stream chunk of choice i carries (those not sent yet), or None."""
        new = self.lp_new[i]
        if self.parsed.logprobs is None or not (new if self.chat else new["tokens"]):
            return None
        self.lp_new[i] = [] if self.chat else L.empty_completion()
        return {"content": new, "refusal": None} if self.chat else new

    def _delta(self, i: int, piece: Piece, reason: str | None, final: bool) -> list[dict[str, Any]]:
        reasoning, content, calls = piece.reasoning, piece.content, piece.calls
        if self.echo_text[i] is not None:  # the first text of an echoing completion starts with the prompt
            content, self.echo_sent[i], self.echo_text[i] = self.echo_text[i] + content, self.echo_text[i], None
        if final and self.replies[i].finish_reason is not None:  # "length" inside a call, else "tool_calls"
            reason = self.reasons[i] = self.replies[i].finish_reason
        if not (reasoning or content or calls or final):
            return []
        if self.chat:
            delta: dict[str, Any] = {}
            if not self.started[i]:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or not (reasoning or calls):
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": i, "delta": delta, "logprobs": self._chunk_logprobs(i), "finish_reason": reason}
        else:
            choice = {"index": i, "text": content, "logprobs": self._chunk_logprobs(i), "finish_reason": reason}
        if self.prompt_lp_unsent[i]:  # vLLM's: in the choice's first chunk
            choice["prompt_logprobs"], self.prompt_lp_unsent[i] = self.prompt_lp[i], False
        self.started[i] = True
        return [self.chunk([choice])]

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model_name, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return obj

    def usage(self) -> dict[str, int]:
        p = sum(self.prompt_tokens[::self.parsed.n])  # a prompt's tokens once, whatever its n samples
        c = sum(self.completion_tokens)
        cached = sum(self.cached_tokens[::self.parsed.n])
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def release(self) -> None:
        """Drop the text and logprobs gathered (after `whole()` was rendered)."""
        n = len(self.index)
        self.replies, self.echo_sent = [Reply(False) for _ in range(n)], [""] * n
        self.lp_all = self.lp_new = [None] * n
        self.prompt_lp = self.prompt_raw = [None] * n

    def whole(self) -> dict[str, Any]:
        choices = []
        for i in range(len(self.index)):
            logprobs = None
            if self.parsed.logprobs is not None:
                logprobs = {"content": self.lp_all[i], "refusal": None} if self.chat else self.lp_all[i]
            extra = {"prompt_logprobs": self.prompt_lp[i]} if self.parsed.prompt_logprobs is not None else {}
            reply = self.replies[i]
            if not self.chat:
                choices.append({"index": i, "text": self.echo_sent[i] + reply.content, "logprobs": logprobs,
                                "finish_reason": self.reasons[i], **extra})
                continue
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.calls:
                message["content"] = reply.content or None
                message["tool_calls"] = reply.calls
            if self.parsed.thinking:
                message["reasoning_content"] = reply.reasoning
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": self.reasons[i],
                            **extra})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices, "usage": self.usage()}
