"""Offline API: `LLM(model=..., **engine_options).generate(prompts, SamplingParams(...))`.

Runs the same engine loop as the daemon, in-process. `model` defaults to the
embedded tiny Shakespeare model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from dsv4.assets import DEFAULT_MODEL
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine, RequestOutput
from dsv4.engine.memory_plan import settle
from dsv4.engine.request import RequestError
from dsv4.engine.sampling import SamplingParams
from dsv4.agents.encoding import EncodingError
from dsv4.agents.prompts import chat_prompt


@dataclass
class Completion:
    """The whole result of one request."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: dict[str, Any] | None = None
    logprobs: list[dict[str, Any]] | None = None  # per token when asked (`RequestOutput.logprobs`)
    prompt_logprobs: list[dict[str, Any]] | None = None  # when asked; the first has logprob None


class LLM:
    """The in-process engine loop (`submit`, `step`, `stream`, `generate`, `chat`): the daemon's
    loop without the socket, used by `run --local`, `bench --local` and Python callers."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        """Build and load the engine. As the CLI does, before any weight loads: without
        `quantization` the formats that fit this machine (float32 where it fits, else the
        checkpoint's own; logged), and EngineConfigError, naming the figures, for a
        configuration whose memory plan does not fit."""
        config = EngineConfig.create(model=str(model or DEFAULT_MODEL), **engine_options)
        if config.node_rank == 0:
            config, note = settle(config, engine_options.get("quantization") is not None)
            if note:
                logging.getLogger("dsv4").warning("%s", note)
        self.engine = Engine(config)

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """Wrap an engine already built (the CLI's, loaded under its progress bar)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, **prompt_options: Any) -> str:
        """Queue one request; returns its id. Raises `RequestError` with a one-line reason."""
        return self.engine.add_request(prompt, params, **prompt_options)

    def step(self) -> list[RequestOutput]:
        """One engine step: the deltas it produced ([] when nothing is queued)."""
        return self.engine.step() if self.engine.has_unfinished() else []

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (if any) and flush the profiler."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, **prompt_options: Any
                 ) -> list[Completion]:
        """Run every prompt to completion (all batched together); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        done: dict[str, Completion] = {}
        order = [self.submit(p, sp, **prompt_options) for p, sp in zip(prompts, plist)]
        for rid in order:
            done[rid] = Completion(rid)
        while self.engine.has_unfinished():
            for out in self.step():
                _merge(done[out.request_id], out)
        return [done[r] for r in order]

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *, thinking: bool = False
             ) -> list[Completion]:
        """Answer one conversation ([{role, content}, ...]) or several; one Completion each.

        With DeepSeek's chat tokens the conversation goes through its chat template
        (`thinking` ends the prompt with `<think>`); a model without them (the embedded
        one) continues the messages' text, one per line."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        try:
            prompts = [chat_prompt(self.engine.tokenizer, c, thinking=thinking) for c in convs]  # type: ignore[arg-type]
        except EncodingError as e:
            raise RequestError(str(e)) from None
        return self.generate(prompts, params, prompt_mode="raw")  # type: ignore[arg-type]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               **prompt_options: Any) -> Iterator[RequestOutput]:
        """Yield the deltas of one request as they are produced."""
        rid = self.submit(prompt, params, **prompt_options)
        try:
            while self.engine.has_unfinished():
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)


def _merge(c: Completion, out: RequestOutput) -> None:
    c.text += out.text
    c.token_ids += out.token_ids
    c.sources += out.sources
    if out.logprobs is not None:
        c.logprobs = (c.logprobs or []) + out.logprobs
    if out.prompt_logprobs is not None:
        c.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        c.finish_reason, c.metrics = out.finish_reason, out.metrics
