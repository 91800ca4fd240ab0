"""OpenAI request bodies -> daemon requests (prompts, sampling parameters, prompt mode).

`parse_completion(body)` and `parse_chat(body, tokenizer)` check the shapes the OpenAI API
defines and raise `ApiError` (status, one-line message, offending field) for anything this
server cannot honour; value ranges are `SamplingParams`' to check, except OpenAI's own bounds
on fields renamed on the way, checked here so the error names the field the client sent.
Nothing is silently ignored: a field that would change the answer and that dsv4 does not
implement gets a 400 naming it (`REFUSED`); fields that never change it are ignored.
Chat prompts are rendered to token ids by DeepSeek V4's encoding (`dsv4.agents.encoding`)
when the tokenizer has its chat tokens (tools, `tool_choice`, reasoning, thinking mode);
a model without them continues the messages' text. `parse_tokenize` gives POST /tokenize
exactly the ids a chat (or completion) request would use. Which fields are honoured, and
how: docs/http-api.md, 'dsv4/http/openai_requests.py'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dsv4.agents.encoding import EncodingError, check_tool_choice, check_tools, thinking_mode
from dsv4.agents.prompts import chat_prompt
from dsv4.engine.tokenizer import TokenizerError
from dsv4.engine.params import MAX_BIAS as _MAX_BIAS
from dsv4.engine.params import MAX_LOGPROBS
from dsv4.http import logprobs as L
from dsv4.http.errors import ApiError  # noqa: F401  (importers take it from here too)
from dsv4.http.errors import bad as _bad
from dsv4.http.errors import short as _short
from dsv4.http.structured import structured_of
from dsv4.http.toolgrammar import forced_call

# OpenAI field -> SamplingParams field (max_completion_tokens is the newer name of max_tokens)
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
                "repetition_penalty", "presence_penalty", "frequency_penalty",
                "include_stop_str_in_output", "cache_salt",  # vLLM's
                "speculative")  # dsv4's own: false = no MTP drafts for this request


_NEVER: Callable[[Any], bool] = lambda v: False  # noqa: E731

# field -> (is its value a no-op?, the reason it is refused otherwise)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "top_logprobs": (lambda v: v == 0, "top_logprobs is for /v1/chat/completions; completions take an integer "
                                       "logprobs"),
    "best_of": (lambda v: v == 1 and not isinstance(v, bool), "best_of is not supported by this server"),
    "echo": (lambda v: v is False, "echo is for /v1/completions, not chat"),
    "suffix": (lambda v: v == "", "suffix is not supported by this server"),
    "tools": (lambda v: v == [], "tools are for /v1/chat/completions, not completions"),
    "tool_choice": (lambda v: v == "none", "tool_choice is for /v1/chat/completions, not completions"),
    "functions": (lambda v: v == [], "functions are not supported by this server"),
    "function_call": (lambda v: v == "none", "function_call is not supported by this server"),
    "audio": (_NEVER, "audio output is not supported by this server"),
    "modalities": (lambda v: v == ["text"], 'modalities: only ["text"] is supported'),
    "prediction": (_NEVER, "prediction (predicted outputs) is not supported by this server"),
    "web_search_options": (_NEVER, "web search is not supported by this server"),
    "verbosity": (_NEVER, "verbosity is not supported by this server"),
    "reasoning_effort": (_NEVER, "reasoning_effort is for /v1/chat/completions, not completions"),
    "store": (lambda v: v is False, "store is not supported by this server (nothing is stored)"),
    "service_tier": (lambda v: v in ("auto", "default"), "service_tier: only auto or default"),
    # vLLM's extensions that change the answer
    "min_tokens": (lambda v: v == 0 and not isinstance(v, bool), "min_tokens is not supported by this server"),
    "use_beam_search": (lambda v: v is False, "beam search is not supported by this server"),
    "allowed_token_ids": (_NEVER, "allowed_token_ids is not supported by this server"),
    "bad_words": (lambda v: v == [], "bad_words is not supported by this server"),
    "logits_processors": (lambda v: v == [], "logits_processors are not supported by this server"),
}


@dataclass
class Parsed:
    """What one HTTP request asks the daemon for."""

    prompts: list[str | list[int]]
    params: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    mode: str = "auto"
    thinking: bool = False
    n: int = 1  # samples per prompt (choices prompt-major: index = prompt * n + sample)
    tools: list[dict[str, Any]] | None = None  # rendered in the prompt: the answer's DSML is parsed into tool_calls
    logprobs: int | None = None  # the reply carries logprobs with this many top tokens (None: no logprobs)
    echo: bool = False  # completions: the prompt (and its logprobs) before the answer
    prompt_logprobs: int | None = None  # vLLM's: the choices carry the prompt's logprobs, n top tokens each


MAX_N = 128  # OpenAI's bound


def n_of(body: dict[str, Any]) -> int:
    """`n`: samples per prompt, 1..MAX_N (each its own request: a seed s gives s, s + 1, ...)."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise _bad(f"n must be an integer in 1..{MAX_N}", "n")
    return n


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# fields of REFUSED that a chat request honours (the prompt encoding renders them, logprobs)
CHAT_FIELDS = ("tools", "tool_choice", "reasoning_effort", "top_logprobs")
COMPLETION_FIELDS = ("echo",)
MAX_CHAT_LOGPROBS, MAX_BIAS = MAX_LOGPROBS, int(_MAX_BIAS)  # OpenAI's ranges, as the engine checks them
MAX_COMPLETION_LOGPROBS = 5


def refuse_unsupported(body: dict[str, Any], honoured: tuple[str, ...] = ()) -> None:
    """400 naming the first field of `REFUSED` (but `honoured`) whose value is neither null nor a no-op."""
    for name, (noop, reason) in REFUSED.items():
        if name in honoured:
            continue
        value = body.get(name)
        if value is not None and not noop(value):
            raise _bad(f"{reason}; got {name} = {_short(value)}", name)


def _common(body: dict[str, Any], honoured: tuple[str, ...] = ()) -> tuple[dict[str, Any], bool, bool]:
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
    refuse_unsupported(body, honoured)
    try:
        if (plp := L.prompt_logprobs_of(body, MAX_LOGPROBS)) is not None:
            params["prompt_logprobs"] = plp
    except ValueError as e:
        raise _bad(str(e), "prompt_logprobs") from None
    if (spec := structured_of(body)) is not None:  # response_format, structured_outputs, guided_*
        params["structured"] = spec
    bias = logit_bias_of(body)
    if bias:
        params["logit_bias"] = bias
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


def logit_bias_of(body: dict[str, Any]) -> dict[str, float]:
    """`logit_bias`: token ids (strings of digits, as JSON keys are) -> a bias in [-100, 100]
    (the vocabulary's bound is the daemon's check)."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise _bad("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12):  # int() of 4301+ digits raises
            raise _bad(f"logit_bias keys must be token ids (strings of digits), got {_short(k)}", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_BIAS <= v <= MAX_BIAS:
            raise _bad(f"logit_bias values must be numbers in [-{MAX_BIAS}, {MAX_BIAS}], got {_short(v)} for "
                       f"token {k}", "logit_bias")
    return {str(int(k)): float(v) for k, v in bias.items()}


def chat_logprobs(body: dict[str, Any], params: dict[str, Any]) -> int | None:
    """`logprobs` (true/false), `top_logprobs` (0..20, needs logprobs) -> top tokens per position, or None."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise _bad(f"logprobs must be true or false, got {_short(lp)}", "logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_CHAT_LOGPROBS):
        raise _bad(f"top_logprobs must be an integer in [0, {MAX_CHAT_LOGPROBS}], got {_short(top)}",
                   "top_logprobs")
    if top and not lp:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    if lp:
        params["logprobs"] = top or 0
    return params.get("logprobs")


def completion_logprobs(body: dict[str, Any], params: dict[str, Any]) -> tuple[int | None, bool]:
    """Integer `logprobs` (0..5) and `echo` -> (logprobs or None, echo)."""
    lp, echo = body.get("logprobs"), body.get("echo")
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_COMPLETION_LOGPROBS):
        raise _bad(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], got {_short(lp)}", "logprobs")
    if echo is not None and not isinstance(echo, bool):
        raise _bad(f"echo must be true or false, got {_short(echo)}", "echo")
    if lp is not None:
        params["logprobs"] = lp
    if params.get("max_tokens") == 0 and not echo:
        raise _bad("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
    return lp, bool(echo)


def parse_completion(body: dict[str, Any]) -> Parsed:
    """POST /v1/completions: `prompt` is a string, a list of strings, token ids or lists of token ids."""
    params, stream, include_usage = _common(body, COMPLETION_FIELDS)
    lp, echo = completion_logprobs(body, params)
    plp = params.get("prompt_logprobs")  # vLLM's field (_common)
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
    if echo and (lp is not None or params.get("max_tokens") == 0 or any(isinstance(p, list) for p in prompts)):
        params["prompt_logprobs"] = max(lp or 0, plp or 0)  # the prompt's tokens (and the text of token-id prompts)
    return Parsed(prompts, params, stream, include_usage, mode="raw", logprobs=lp, echo=echo, n=n_of(body),
                  prompt_logprobs=plp)


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


def thinking_switch(body: dict[str, Any]) -> bool | None:
    """DeepSeek's `thinking: {type: enabled | disabled}` (or a bool), else vLLM/SGLang's
    `chat_template_kwargs.thinking` / `enable_thinking`; None when the body says nothing."""
    t = body.get("thinking")
    if isinstance(t, dict):
        if t.get("type") not in ("enabled", "disabled"):
            raise _bad(f'thinking.type must be "enabled" or "disabled"; got {_short(t.get("type"))}', "thinking")
        return t["type"] == "enabled"
    if isinstance(t, bool):
        return t
    if t is not None:
        raise _bad('thinking must be {"type": "enabled"} or {"type": "disabled"}', "thinking")
    kw = body.get("chat_template_kwargs")
    if isinstance(kw, dict):
        for key in ("thinking", "enable_thinking"):
            if isinstance(kw.get(key), bool):
                return kw[key]
    return None


def thinking_of(body: dict[str, Any]) -> bool:
    """Thinking mode of a chat body: the switch, else on for any `reasoning_effort` but "none", else off."""
    try:
        return thinking_mode(thinking_switch(body), body.get("reasoning_effort"))
    except EncodingError as e:
        raise _bad(str(e), e.param) from None


_KEPT = ("tool_calls", "tool_call_id", "reasoning_content", "reasoning")  # what the encoding reads beside content


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """[{role, content, ...}] with text content; roles system, developer (as system), user,
    assistant, tool; an assistant's tool_calls and reasoning, a tool's tool_call_id kept."""
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
        msg = {"role": "system" if role == "developer" else role, "content": _content(m, i)}
        msg.update((k, m[k]) for k in _KEPT if m.get(k) is not None)
        out.append(msg)
    return out


@dataclass
class Chat:
    """A chat body's prompt: ids (or, without chat tokens, text) and the mode the answer is read in."""

    prompt: str | list[int]
    thinking: bool
    tool_choice: str  # "auto", "none", "required" or the name of the function it forces
    functions: list[dict[str, Any]]  # the request's tools, checked (`encoding.check_tools`)


def chat_prompt_of(body: dict[str, Any], tokenizer: Any) -> Chat:
    """The prompt of a chat body, exactly as POST /v1/chat/completions sends it (400s for bad input)."""
    msgs = chat_messages(body)
    thinking = thinking_of(body)
    try:
        functions = check_tools(body.get("tools"))
        choice = check_tool_choice(body.get("tool_choice"), functions)
        options: dict[str, Any] = {"tools": (functions and body["tools"]) or None, "tool_choice": body.get("tool_choice"),
                                   "reasoning_effort": body.get("reasoning_effort")}
        rf = body.get("response_format")  # rendered as DeepSeek's encoder does (with a template); a grammar enforces it
        if isinstance(rf, dict) and rf.get("type") != "text":
            options["response_format"] = rf
        # without a template, what would change the prompt is refused (`prompts.chat_prompt`)
        return Chat(chat_prompt(tokenizer, msgs, thinking=thinking, **options), thinking, choice, functions)
    except EncodingError as e:
        raise _bad(str(e), e.param) from None


def parse_chat(body: dict[str, Any], tokenizer: Any) -> Parsed:
    """POST /v1/chat/completions: the conversation rendered to one prompt."""
    params, stream, include_usage = _common(body, CHAT_FIELDS)
    chat = chat_prompt_of(body, tokenizer)
    if chat.tool_choice not in ("auto", "none"):  # a call forced by a grammar (after </think> when thinking)
        if "structured" in params:
            raise _bad("tool_choice required or named cannot be combined with a structured output field",
                       "tool_choice")
        params["structured"] = forced_call(chat.functions, chat.tool_choice)
    tools = body["tools"] if chat.tool_choice != "none" and chat.functions else None
    lp = chat_logprobs(body, params)
    return Parsed([chat.prompt], params, stream, include_usage, mode="raw", thinking=chat.thinking, tools=tools,
                  logprobs=lp, n=n_of(body), prompt_logprobs=params.get("prompt_logprobs"))


def parse_tokenize(body: dict[str, Any], tokenizer: Any) -> list[int]:
    """POST /tokenize (vLLM's shapes): `messages` plus the chat fields -> the ids the chat
    request would use; `prompt` (a string) -> the ids of a completion request for it
    (`add_special_tokens` false: without the tokenizer's BOS)."""
    if tokenizer is None:
        raise _bad("this model has no tokenizer.json, so nothing to tokenize with")
    has_messages, has_prompt = body.get("messages") is not None, body.get("prompt") is not None
    if has_messages == has_prompt:
        raise _bad("send either messages (a chat) or prompt (a string)", "messages")
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise _bad("add_special_tokens must be true or false", "add_special_tokens")
    try:
        if has_prompt:
            if not isinstance(body["prompt"], str):
                raise _bad("prompt must be a string", "prompt")
            return tokenizer.encode_prompt(body["prompt"], mode="raw", add_bos=None if special in (None, True)
                                           else False)
        for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
            if body.get(name) not in (None, default):
                raise _bad(f"{name}: only {str(default).lower()} (a chat prompt always opens the assistant's "
                           "turn)", name)
        if body.get("chat_template") is not None:
            raise _bad("chat_template is not supported: DeepSeek V4's own encoding renders the messages",
                       "chat_template")
        prompt = chat_prompt_of(body, tokenizer).prompt
        return prompt if isinstance(prompt, list) else tokenizer.encode_prompt(prompt, mode="raw")
    except TokenizerError as e:
        raise _bad(str(e), "prompt" if has_prompt else "messages") from None


def parse_detokenize(body: dict[str, Any], tokenizer: Any) -> str:
    """POST /detokenize: `tokens` (ids) -> their text, special tokens written out."""
    if tokenizer is None:
        raise _bad("this model has no tokenizer.json, so nothing to detokenize with")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < tokenizer.vocab_size for t in ids):
        raise _bad(f"tokens must be a list of token ids in 0..{tokenizer.vocab_size - 1}", "tokens")
    return tokenizer.decode(ids)
