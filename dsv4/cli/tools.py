"""`dsv4 run --tools FILE`: the tools a prompt offers, and the tool calls in the answer.

The file holds OpenAI function tools: a JSON list, or an object with a "tools" list (the
body of a chat request will do). They are rendered into the prompt as DeepSeek V4's
"## Tools" block (`dsv4.agents.encoding`); the DSML block the model writes is parsed
into OpenAI `tool_calls` (`dsv4.agents.dsml`) as the answer streams, so no markup is
printed: the content streams as usual, then each call is one JSON line (`--json`: the
keys `content` and `tool_calls`, `finish_reason` "tool_calls").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsv4.agents.encoding import THINK_END, EncodingError, check_tools
from dsv4.agents.replies import Piece, Reply

MAX_TOOLS_BYTES = 1 << 20


def read_tools(path: str) -> list[dict[str, Any]]:
    """The tools in `path`, checked; ValueError with a one-line reason otherwise."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_TOOLS_BYTES:
            raise ValueError(f"--tools {path}: over {MAX_TOOLS_BYTES >> 20} MiB")
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--tools {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--tools {path}: not JSON ({e})") from None
    tools = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"--tools {path}: expected a non-empty JSON list of tools (or an object with one "
                         f"under \"tools\")")
    try:
        check_tools(tools)
    except EncodingError as e:
        raise ValueError(f"--tools {path}: {e}") from None
    return tools


class ToolText:
    """Splits an answer's text as it streams (`dsv4.agents.replies.Reply`): reasoning (thinking
    mode) passes through, the content after it goes through the DSML parser. `feed(text)` ->
    text to print (the `</think>` tag printed where reasoning ends); `finish(cut)` -> the
    rest; then `calls` (OpenAI shape), `content`, `reasoning` and `finish_reason`."""

    def __init__(self, tools: list[dict[str, Any]], thinking: bool) -> None:
        self._reply = Reply(thinking, tools)

    @staticmethod
    def _printed(piece: Piece) -> str:
        return piece.reasoning + (THINK_END if piece.ended_reasoning else "") + piece.content

    def feed(self, text: str) -> str:
        return self._printed(self._reply.feed(text))

    def finish(self, cut: bool) -> str:
        return self._printed(self._reply.finish(cut))

    @property
    def content(self) -> str:
        return self._reply.content

    @property
    def reasoning(self) -> str:
        return self._reply.reasoning

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self._reply.calls

    @property
    def finish_reason(self) -> str | None:
        return self._reply.finish_reason


def check_choice(choice: str, tools: list[dict[str, Any]] | None) -> str:
    """--tool-choice: auto, none, required or the name of one of `tools`; ValueError otherwise."""
    from dsv4.agents.encoding import check_tool_choice

    if tools is None:
        if choice != "auto":
            raise ValueError("--tool-choice needs --tools")
        return choice
    value: Any = choice if choice in ("auto", "none", "required") else {"type": "function",
                                                                        "function": {"name": choice}}
    try:
        return check_tool_choice(value, check_tools(tools))
    except EncodingError as e:
        raise ValueError(f"--tool-choice: {e}") from None


def tool_params(tools: list[dict[str, Any]] | None, choice: str) -> dict[str, Any]:
    """Sampling parameters a tool choice adds: a forced call (required, or a name) is the
    grammar of a DSML call (`structured`), as the HTTP API forces it."""
    from dsv4.http.toolgrammar import forced_call

    spec = forced_call(check_tools(tools), choice) if tools is not None else None
    return {"structured": spec} if spec is not None else {}


def call_line(call: dict[str, Any]) -> str:
    """One tool call as the chat prints it: [tool call ID] NAME ARGUMENTS."""
    fn = call["function"]
    return f"[tool call {call['id']}] {fn['name']} {fn['arguments']}"
