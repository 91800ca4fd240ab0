"""What an engine answers before a request reaches its scheduler: the model's default
sampling, text size limits and tokenizing. `Engine` and the data-parallel `EnginePool` (whose
daemon-side tokenizer feeds every replica) both are a `RequestFront`; no torch here.
"""

from __future__ import annotations

from typing import Any

from dsv4.engine.config import EngineConfig
from dsv4.engine.request import RequestError
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tokenizer import Tokenizer, TokenizerError, TokenizerMissing


class RequestFront:
    """The prompt side of an engine (`_init_front` first in `__init__`)."""

    config: EngineConfig
    tokenizer: Tokenizer | None
    max_text_bytes: int
    default_params: SamplingParams

    def _init_front(self, config: EngineConfig) -> None:
        """The model's default sampling (refused before any weight loads), the tokenizer, the text limit."""
        self.config = config
        try:  # the model's defaults must be valid before any weight loads
            self.default_params = SamplingParams.from_dict(dict(config.sampling_defaults))
        except RequestError as e:
            raise RequestError(f"--model {config.model}: generation_config.json: {e}") from None
        try:
            self.tokenizer = Tokenizer.from_dir(config.model)
        except TokenizerMissing:
            self.tokenizer = None  # token-id prompts only (a corrupt tokenizer.json is an error)
        # A text longer than this many UTF-8 bytes cannot fit in max_model_len tokens:
        # refused before tokenizing (every token covers at most the longest vocabulary entry).
        self.max_text_bytes = (config.max_model_len * self.tokenizer.max_token_bytes
                               if self.tokenizer is not None else 0)

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + output), in tokens."""
        return self.config.max_model_len

    def make_params(self, fields: dict[str, Any]) -> SamplingParams:
        """SamplingParams from a request's fields over the model's generation_config.json
        defaults (fields given win; `temperature: 0` stays greedy); raises `RequestError`."""
        if not isinstance(fields, dict):
            raise RequestError(f"sampling parameters must be a map, got {type(fields).__name__}")
        return SamplingParams.from_dict({**self.config.sampling_defaults, **fields})

    def check_text_size(self, prompt: str, system: str | None = None) -> None:
        """Refuse an empty prompt, or text too long for --max-model-len, before tokenizing (RequestError)."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer.json; send token ids instead of text")
        if not prompt:
            raise RequestError("the prompt is empty; send at least one character")
        n = len(prompt.encode("utf-8", "surrogatepass")) + len((system or "").encode("utf-8", "surrogatepass"))
        if n > self.max_text_bytes:
            what = "prompt and system prompt" if system else "prompt"
            raise RequestError(f"{what} of {n} bytes {'exceed' if system else 'exceeds'} the limit of "
                               f"{self.max_text_bytes} bytes for --max-model-len {self.config.max_model_len} "
                               f"({self.tokenizer.max_token_bytes} bytes per token at most); send a shorter prompt")

    def encode_request(self, prompt: str, *, prompt_mode: str = "auto", system: str | None = None,
                       thinking: bool = False, tools: list[Any] | None = None) -> list[int]:
        """Prompt ids of a text request, size-checked first; touches only the tokenizer, so it
        may run on another thread than `step()` (the daemon tokenizes big prompts there)."""
        self.check_text_size(prompt, system)
        assert self.tokenizer is not None
        try:
            return self.tokenizer.encode_prompt(prompt, mode=prompt_mode, system=system,  # type: ignore[arg-type]
                                                thinking=thinking, tools=tools)
        except TokenizerError as e:
            raise RequestError(str(e)) from None

    def prompt_ids(self, prompt: str | list[int], params: SamplingParams, *, prompt_mode: str = "auto", system: str | None = None,
                   thinking: bool = False, tools: list[Any] | None = None) -> list[int]:
        """`add_request`'s prompt as ids (a text prompt tokenized here); refuses stop strings
        without a tokenizer and tools with an id prompt (RequestError)."""
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model has no tokenizer.json "
                               "(use stop_token_ids)")
        if isinstance(prompt, str):
            return self.encode_request(prompt, prompt_mode=prompt_mode, system=system, thinking=thinking,
                                       tools=tools)
        if tools:
            raise RequestError("tools are rendered into a text prompt; pass the prompt as text")
        return prompt
