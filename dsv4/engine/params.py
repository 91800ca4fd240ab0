"""Sampling parameters: what a request asks for, checked when built; no torch.

A `SamplingParams` is valid from the moment it exists: construction (`__post_init__`,
also under `dataclasses.replace`) checks values and types (they arrive as msgpack over a
socket or JSON over HTTP) and raises `RequestError` with a one-line reason. Clients (the
CLI's flags, HTTP bodies) only translate their fields into it (`from_dict`). What depends
on the model (token ids inside its vocabulary) is checked once more when the scheduler
queues the request (`check_vocab`). `dsv4.engine.sampling` re-exports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from dsv4.engine.errors import RequestError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
_U64 = 2**64
MIN_TEMPERATURE = 1e-5  # below this logits / T overflows float32; use 0 for greedy
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BIAS = 100.0  # |bias| (OpenAI's range)
MAX_CACHE_SALT = 256  # characters of cache_salt


@dataclass
class SamplingParams:
    """Per-request sampling options. Defaults: greedy, 64 tokens."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; keep tokens with p >= min_p * p_max
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the text stays in it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    speculative: bool = True  # False: never draft for this request
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens of the prompt and output
    presence_penalty: float = 0.0  # 0 = off; subtracted from tokens already in the output
    frequency_penalty: float = 0.0  # 0 = off; subtracted once per earlier occurrence in the output
    # None = off; n: each output token's logprob and the n most likely (0..MAX_LOGPROBS), of the
    # processed distribution (`logprobs.py`)
    logprobs: int | None = None
    # None = off; n: each prompt token's logprob under the model (raw log-softmax) and the n most likely
    prompt_logprobs: int | None = None
    # token id -> added to its logit before penalties (-100..100); keys may arrive as decimal strings
    logit_bias: dict[int, float] | None = None
    # None = free text; {kind: value}, kind one of json_schema (a schema), json_object (true), regex,
    # choice (strings), ebnf: the output follows that grammar (`grammar/masks.py`; after </think> in thinking mode)
    structured: dict[str, Any] | None = None
    # vLLM's: requests share cached prefixes only with requests of the same salt (another tenant,
    # or a benchmark's arm, cannot hit, or time, what this one cached)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):  # JSON and msgpack maps from clients have string keys
            self.logit_bias = {(int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12 else k): v
                               for k, v in self.logit_bias.items()}
        self.validate()

    @classmethod
    def from_dict(cls, d: Any) -> "SamplingParams":
        """Build from a decoded message; unknown keys and bad values raise `RequestError`."""
        if not isinstance(d, dict):
            raise RequestError(f"sampling parameters must be a map, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)  # validated as it is built

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusted(self) -> bool:
        """Whether the raw logits change before temperature (logit_bias or penalties)."""
        return bool(self.logit_bias) or self.penalized

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `RequestError` naming the first bad parameter (run when built; with
        `vocab_size`, also `check_vocab`)."""
        _int("max_tokens", self.max_tokens, 0)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise RequestError("max_tokens must be >= 1 (0 only with prompt logprobs: echo)")
        _num("temperature", self.temperature, 0.0, None)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise RequestError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}")
        _int("top_k", self.top_k, 0)
        _num("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _num("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int("seed", self.seed, 0)
            if self.seed >= _U64:
                raise RequestError(f"seed must be below 2**64, got {self.seed}")
        if not isinstance(self.stop, (list, tuple)):
            raise RequestError(f"stop must be a list of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise RequestError(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_LEN} "
                                   f"characters, got {s!r:.60}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise RequestError("include_stop_str_in_output must be true or false")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise RequestError(f"stop_token_ids must be a list of integers, got {type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids:
            _int("stop_token_ids entry", t, 0)
        _num("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, open_low=True)
        _num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _int(name, v, 0)
                if v > MAX_LOGPROBS:
                    raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
        _check_bias(self.logit_bias)
        if self.structured is not None:
            from dsv4.engine.grammar.masks import check_spec

            check_spec(self.structured)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT):
            raise RequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters")
        for name in ("ignore_eos", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if vocab_size is not None:
            self.check_vocab(vocab_size)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise `RequestError` when a token id it names is outside a vocabulary of `vocab_size`."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise RequestError(f"stop_token_ids entry {t} is outside the vocabulary (size {vocab_size})")
        for k in self.logit_bias or {}:
            if k >= vocab_size:
                raise RequestError(f"logit_bias token {k} is outside the vocabulary (size {vocab_size})")


def _int(name: str, v: Any, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{name} must be an integer, got {v!r:.60}")
    if v < minimum:
        raise RequestError(f"{name} must be >= {minimum}, got {v}")


def _num(name: str, v: Any, lo: float, hi: float | None, open_low: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, got {v!r:.60}")
    if v < lo or (open_low and v == lo) or (hi is not None and v > hi):
        rng = f"{'(' if open_low else '['}{lo}, {hi if hi is not None else 'inf'}{']' if hi is not None else ')'}"
        raise RequestError(f"{name} must be in {rng}, got {v}")


def _check_bias(bias: Any) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be a map of token ids to numbers, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(bias)} entries, over the limit of {MAX_LOGIT_BIAS}")
    for k, v in bias.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise RequestError(f"logit_bias keys must be token ids (non-negative integers), got {k!r:.40}")
        _num(f"logit_bias[{k}]", v, -MAX_BIAS, MAX_BIAS)
