"""OpenAI request bodies -> daemon requests (prompts, sampling parameters, prompt mode).

`parse_completion(body)` and `parse_chat(body, tokenizer)` check the shapes the OpenAI API
defines and raise `ApiError` (status, one-line message, offending field) for anything
this server cannot honour; value ranges are checked once, by `SamplingParams.validate`
in the daemon, whose error becomes a 400 too.

Nothing is silently ignored: an OpenAI field (or a well-known vLLM extension) that would
change the answer and that dsv4 does not implement gets a 400 naming it (`REFUSED`),
unless its value changes nothing (`response_format: {"type": "text"}`, `n: 1`, `logit_bias:
{}`, ...). Fields that never change the answer (`user`, `metadata`, `safety_identifier`,
`prompt_cache_key`, `parallel_tool_calls` without tools) and unknown vendor fields are
ignored, as OpenAI ignores what it does not know.

Chat prompts: with a tokenizer that has DeepSeek's chat tokens the whole conversation is
rendered to token ids by `Tokenizer.encode_chat` (thinking mode from `thinking` or
`chat_template_kwargs.thinking`); a model without them (the embedded Shakespeare model)
continues the messages' text, one per line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from dsv4.engine.tokenizer import TokenizerError, chat_prompt

# OpenAI field -> SamplingParams field (max_completion_tokens is the newer name of max_tokens)
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
                "repetition_penalty", "presence_penalty", "frequency_penalty",
                "speculative")  # dsv4's own: false = no MTP drafts for this request


_NEVER: Callable[[Any], bool] = lambda v: False  # noqa: E731

# field -> (is its value a no-op?, the reason it is refused otherwise)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (lambda v: v == {}, "logit_bias is not supported by this server"),
    "response_format": (lambda v: v == {"type": "text"},
                        'response_format is not supported by this server (only {"type": "text"}, plain text)'),
    "logprobs": (lambda v: v == 0, "logprobs are not supported by this server"),  # false or 0
    "top_logprobs": (lambda v: v == 0, "logprobs are not supported by this server"),
    "n": (lambda v: v == 1 and not isinstance(v, bool), "only n = 1 is supported"),
    "best_of": (lambda v: v == 1 and not isinstance(v, bool), "best_of is not supported by this server"),
    "echo": (lambda v: v is False, "echo is not supported by this server"),
    "suffix": (lambda v: v == "", "suffix is not supported by this server"),
    "tools": (lambda v: v == [], "tools are not supported by this server"),
    "tool_choice": (lambda v: v == "none", "tool_choice is not supported by this server (tools are not)"),
    "functions": (lambda v: v == [], "functions are not supported by this server"),
    "function_call": (lambda v: v == "none", "function_call is not supported by this server"),
    "audio": (_NEVER, "audio output is not supported by this server"),
    "modalities": (lambda v: v == ["text"], 'modalities: only ["text"] is supported'),
    "prediction": (_NEVER, "prediction (predicted outputs) is not supported by this server"),
    "web_search_options": (_NEVER, "web search is not supported by this server"),
    "verbosity": (_NEVER, "verbosity is not supported by this server"),
    "reasoning_effort": (_NEVER, "reasoning_effort is not supported by this server; turn thinking mode on with "
                                 '"thinking": {"type": "enabled"} or "chat_template_kwargs": {"thinking": true}'),
    "store": (lambda v: v is False, "store is not supported by this server (nothing is stored)"),
    "service_tier": (lambda v: v in ("auto", "default"), "service_tier: only auto or default"),
    # vLLM's extensions that change the answer
    "min_tokens": (lambda v: v == 0 and not isinstance(v, bool), "min_tokens is not supported by this server"),
    "use_beam_search": (lambda v: v is False, "beam search is not supported by this server"),
    "include_stop_str_in_output": (lambda v: v is False, "include_stop_str_in_output is not supported by this "
                                                         "server"),
    "prompt_logprobs": (lambda v: v == 0, "prompt_logprobs are not supported by this server"),
    "allowed_token_ids": (_NEVER, "allowed_token_ids is not supported by this server"),
    "bad_words": (lambda v: v == [], "bad_words is not supported by this server"),
    "logits_processors": (lambda v: v == [], "logits_processors are not supported by this server"),
    **{name: (_NEVER, f"{name} (structured output) is not supported by this server")
       for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")},
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, etype: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.etype = etype or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                               413: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.etype, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    """What one HTTP request asks the daemon for."""

    prompts: list[str | list[int]]
    params: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    mode: str = "auto"
    thinking: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _bad(msg: str, param: str | None = None) -> ApiError:
    return ApiError(400, msg, param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def refuse_unsupported(body: dict[str, Any]) -> None:
    """400 naming the first field of `REFUSED` whose value is neither null nor a no-op."""
    for name, (noop, reason) in REFUSED.items():
        value = body.get(name)
        if value is not None and not noop(value):
            raise _bad(f"{reason}; got {name} = {_short(value)}", name)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _common(body: dict[str, Any]) -> tuple[dict[str, Any], bool, bool]:
    """Sampling parameters, stream, include_usage: the fields completions and chat share."""
    params: dict[str, Any] = {}
    for name in _PASSTHROUGH:
        if body.get(name) is not None:
            params[name] = body[name]
    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise _bad("max_tokens and max_completion_tokens disagree; send one", "max_tokens")
    if (mt if mt is not None else mct) is not None:
        params["max_tokens"] = mt if mt is not None else mct
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop must be a string or a list of strings", "stop")
        if stop:
            params["stop"] = stop
    refuse_unsupported(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise _bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(opts, dict):
            raise _bad("stream_options must be an object", "stream_options")
        include_usage = opts.get("include_usage", False)
        if include_usage is None:
            include_usage = False
        if not isinstance(include_usage, bool):
            raise _bad(f"stream_options.include_usage must be true or false, got {_short(include_usage)}",
                       "stream_options")
    return params, stream, include_usage


def parse_completion(body: dict[str, Any]) -> Parsed:
    """POST /v1/completions: `prompt` is a string, a list of strings, token ids or lists of token ids."""
    params, stream, include_usage = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)):
        prompts = [list(p) for p in prompt]
    else:
        raise _bad("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                   "token ids (not empty)", "prompt")
    if any(isinstance(p, str) and not p for p in prompts) or any(isinstance(p, list) and not p for p in prompts):
        raise _bad("the prompt is empty", "prompt")
    return Parsed(prompts, params, stream, include_usage, mode="raw")


def _content(msg: dict[str, Any], i: int) -> str:
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def thinking_of(body: dict[str, Any]) -> bool:
    """DeepSeek's `thinking: {type: enabled}`, vLLM/SGLang's `chat_template_kwargs.thinking`."""
    t = body.get("thinking")
    if isinstance(t, dict):
        return t.get("type") == "enabled"
    if isinstance(t, bool):
        return t
    kw = body.get("chat_template_kwargs")
    if isinstance(kw, dict):
        for key in ("thinking", "enable_thinking"):
            if isinstance(kw.get(key), bool):
                return kw[key]
    return False


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """[{role, content}] with text content; roles system, developer, user, assistant, tool."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a role", "messages")
        role = m["role"]
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}].role {role!r:.30} is not one of system, developer, user, assistant, tool",
                       "messages")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    return out


def parse_chat(body: dict[str, Any], tokenizer: Any) -> Parsed:
    """POST /v1/chat/completions: the conversation rendered to one prompt."""
    params, stream, include_usage = _common(body)
    msgs = chat_messages(body)
    thinking = thinking_of(body)
    try:
        prompt = chat_prompt(tokenizer, msgs, thinking=thinking)
    except TokenizerError as e:
        raise _bad(str(e), "messages") from None
    return Parsed([prompt], params, stream, include_usage, mode="raw", thinking=thinking)
