"""Reading a DeepSeek V4 answer as it streams: reasoning, content and tool calls, per choice.

`Reply` is one choice's parse: in thinking mode the text before `</think>` is reasoning
(`ReasoningSplitter`, the tag dropped), then, when the request listed tools, the content
goes through the DSML parser (`dsml.DSMLStreamParser`), which turns `<｜DSML｜...>` markup
into OpenAI tool calls. `feed(text)` and `finish(cut)` return a `Piece` (the reasoning,
content and `delta.tool_calls` entries that text made); the whole answer accumulates in
`reasoning`, `content` and `calls`. HTTP (`http/replies.py`), `dsv4 chat` and
`run --tools` (`cli/tools.py`) all read answers through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv4.agents.calls import ContentDelta, Event, ToolCallArgs, ToolCallStart
from dsv4.agents.dsml import DSMLStreamParser
from dsv4.agents.encoding import THINK_END


class ReasoningSplitter:
    """`feed(text) -> (reasoning, content)`; without thinking everything is content. A tail
    that could be the start of `</think>` is held back until the next text (or `flush`)."""

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        buf = self._held + text
        cut = buf.find(THINK_END)
        if cut >= 0:
            self.in_reasoning, self._held = False, ""
            return buf[:cut], buf[cut + len(THINK_END):]
        keep = 0  # the longest tail of buf that is a proper prefix of THINK_END
        for n in range(min(len(THINK_END) - 1, len(buf)), 0, -1):
            if THINK_END.startswith(buf[-n:]):
                keep = n
                break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], ""

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


@dataclass
class Piece:
    """What one piece of streamed text made: reasoning, content, `delta.tool_calls` entries,
    and `ended_reasoning` when it held the `</think>` tag."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    ended_reasoning: bool = False


def tool_deltas(events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
    """Parser events -> (content text, OpenAI `delta.tool_calls` entries)."""
    content, calls = "", []
    for e in events:
        if isinstance(e, ContentDelta):
            content += e.text
        elif isinstance(e, ToolCallStart):
            calls.append({"index": e.index, "id": e.id, "type": "function",
                          "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, ToolCallArgs):
            calls.append({"index": e.index, "function": {"arguments": e.text}})
    return content, calls


class Reply:
    """One choice's answer as it streams (module docstring). `tools`: the request's OpenAI
    tools (None or [] = no DSML parsing); `thinking`: the answer starts inside `<think>`."""

    def __init__(self, thinking: bool, tools: list[dict[str, Any]] | None = None) -> None:
        self._split = ReasoningSplitter(thinking)
        self._parser = DSMLStreamParser(tools) if tools else None
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str) -> Piece:
        was = self._split.in_reasoning
        return self._piece(*self._split.feed(text), was=was, final=False, cut=False)

    def finish(self, cut: bool = False) -> Piece:
        """The rest, once the answer ended; `cut`: it ended at max_tokens (a call cut short
        is not a call)."""
        was = self._split.in_reasoning
        return self._piece(*self._split.flush(), was=was, final=True, cut=cut)

    def _piece(self, reasoning: str, content: str, *, was: bool, final: bool, cut: bool) -> Piece:
        calls: list[dict[str, Any]] = []
        if self._parser is not None:
            events = self._parser.feed(content) + (self._parser.finish(cut) if final else [])
            content, calls = tool_deltas(events)
        self.reasoning += reasoning
        self.content += content
        return Piece(reasoning, content, calls, ended_reasoning=was and not self._split.in_reasoning)

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The whole answer's tool calls, in OpenAI's `message.tool_calls` shape."""
        return self._parser.openai_calls() if self._parser is not None else []

    @property
    def finish_reason(self) -> str | None:
        """"tool_calls" when the answer called tools, "length" when cut inside a call, else None."""
        return self._parser.finish_reason if self._parser is not None else None
