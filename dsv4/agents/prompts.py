"""Rendering prompts: one user turn or a whole conversation, and the refusals without a template.

A model whose vocabulary has DeepSeek's chat tokens (`<｜User｜>`, `<｜Assistant｜>`) gets
DeepSeek V4's encoding (`encoding.encode_messages`: system text, turns, tools block, thinking
mode); one without them (the embedded Shakespeare model) gets its text as is: a raw prompt, or
a conversation continued as a transcript, one message a line. What only a template can
render (a system prompt, thinking mode, tools, reasoning_effort, ...) is refused there in one
line (`no_template`), never dropped. The engine's tokenizer (`Tokenizer.encode_prompt`,
`encode_chat`), HTTP (`http/openai_requests.py`) and `dsv4 chat` all render through here.
Errors are `EncodingError` (a one-line message and the request field it concerns).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, Sequence

from dsv4.agents.encoding import ChatOptions, EncodingError, TokenizerLike, encode_messages

USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"

PromptMode = Literal["auto", "chat", "raw"]


class PromptTokenizer(TokenizerLike, Protocol):
    """What rendering needs of a tokenizer: the encoder's (`encoding.TokenizerLike`) plus these
    (`dsv4.engine.tokenizer.Tokenizer` has them)."""

    add_bos: bool  # a raw prompt starts with BOS (the tokenizer's files say so)

    @property
    def has_chat_tokens(self) -> bool: ...
    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...


def no_template(what: str, param: str = "messages") -> EncodingError:
    """The one refusal of what needs a chat template, on a model without one."""
    return EncodingError(f"this model has no chat template, so no {what}", param)


def has_template(tokenizer: PromptTokenizer | None) -> bool:
    return tokenizer is not None and tokenizer.has_chat_tokens


def render_turn(tokenizer: PromptTokenizer, text: str, *, mode: PromptMode = "auto", system: str | None = None,
                thinking: bool = False, add_bos: bool | None = None,
                tools: Sequence[dict] | None = None) -> list[int]:
    """Prompt ids for one user turn (`tools`: OpenAI function tools, V4's "## Tools" block).

    chat: BOS + system + <｜User｜> + text + <｜Assistant｜> + (<think> if thinking else </think>).
    raw:  (BOS +) text as is. auto: chat with the chat tokens, else raw, where a `system`
    prompt, `thinking` or `tools` is refused. `add_bos` None: BOS for chat, the tokenizer's
    `add_bos` for raw.
    """
    if mode not in ("auto", "chat", "raw"):
        raise EncodingError(f"unknown prompt mode {mode!r} (expected auto, chat or raw)")
    if mode == "auto":
        mode = "chat" if tokenizer.has_chat_tokens else "raw"
        if mode == "raw" and (thinking or system or tools):  # refused, not ignored
            raise no_template("thinking mode" if thinking else "system prompt" if system else "tools")
    if mode == "raw" and tools:
        raise EncodingError("tools need the chat template (not a raw prompt)", "tools")
    if mode == "raw":
        return tokenizer.encode(text, add_bos=tokenizer.add_bos if add_bos is None else add_bos)
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return render_chat(tokenizer, msgs, thinking=thinking, add_bos=add_bos is None or add_bos, tools=tools or None)


def render_chat(tokenizer: PromptTokenizer, messages: Sequence[dict], *, thinking: bool = False,
                add_bos: bool = True, tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                reasoning_effort: str | None = None, response_format: dict | None = None) -> list[int]:
    """Prompt ids for an OpenAI-style conversation in DeepSeek V4's encoding, special tokens
    by id (content cannot inject them), ending `<｜Assistant｜>` + (`<think>` if thinking
    else `</think>`)."""
    for token in (USER_TOKEN, ASSISTANT_TOKEN):
        if tokenizer.token_to_id(token) is None:
            raise EncodingError(f"the tokenizer has no {token} token (hint: use raw prompt mode)")
    options = ChatOptions(thinking=thinking, reasoning_effort=reasoning_effort, tools=tools,
                          tool_choice=tool_choice, response_format=response_format, add_bos=add_bos)
    return encode_messages(tokenizer, messages, options)


def chat_prompt(tokenizer: PromptTokenizer | None, messages: Sequence[dict], *, thinking: bool = False,
                **options: Any) -> str | list[int]:
    """The prompt for a conversation, sent raw: token ids through `render_chat` (which takes
    `options`: tools, tool_choice, reasoning_effort, response_format) with a template, else
    plain continuation text, each message's content on its own line, ending with a newline.
    Without a template an option that would change the prompt is refused (`tools` with
    tool_choice "none", reasoning_effort "none" and response_format, which only a grammar
    enforces there, change nothing)."""
    if has_template(tokenizer):
        assert tokenizer is not None
        return render_chat(tokenizer, messages, thinking=thinking, **options)
    unused = ("tool_choice", "response_format") + (("tools",) if options.get("tool_choice") == "none" else ())
    for name, value in options.items():
        if value is not None and name not in unused and not (name == "reasoning_effort" and value == "none"):
            raise no_template(name, name)
    if thinking:
        raise no_template("thinking mode")
    text = "".join(str(m.get("content") or "") + "\n" for m in messages if m.get("content"))
    if not text:
        raise EncodingError("the messages are empty")
    return text
