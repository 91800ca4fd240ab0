"""A parsed DSML tool call and how its values are typed (the parser is `dsml.py`).

Events a streaming parse emits (`ContentDelta`, `ToolCallStart`, `ToolCallArgs`,
`ToolCallEnd`), a finished `ToolCall` and a whole `ParseResult`; `typed` turns a
parameter's written text into its JSON value by the tool's schema (the rules are in
`dsml.py`'s docstring).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union


_BAD = object()  # "not JSON"


def make_call_id() -> str:
    """An OpenAI-style call id: `call_` + 24 lowercase hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str  # a piece of the JSON arguments string


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    error: Optional[str] = None  # None: a good call; TRUNCATED: cut off; else why it is malformed


Event = Union[ContentDelta, ToolCallStart, ToolCallArgs, ToolCallEnd]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # always valid JSON (an object)
    error: Optional[str] = None  # set when a value was not valid JSON for its schema

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParseResult:
    content: str  # the text without any DSML
    calls: list[ToolCall]  # complete calls, in order (malformed ones have `error` set)
    finish_reason: Optional[str]  # "length", "tool_calls" or None (keep the engine's)
    truncated: bool  # the text ended inside markup
    errors: list[str] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [c.to_openai() for c in self.calls]


def _schemas(tools: Optional[Iterable[Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its schema's `properties` (OpenAI `tools` entries or bare functions)."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        if not isinstance(t, dict):
            continue
        fn = t.get("function", t)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _types(prop: Any) -> Optional[set[str]]:
    """The JSON types a property schema allows, or None when it does not say."""
    if not isinstance(prop, dict):
        return None
    t = prop.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {str(x) for x in t}
    alts = prop.get("anyOf") or prop.get("oneOf")
    if isinstance(alts, list) and alts:
        sets = [_types(a) for a in alts]
        return None if None in sets else set().union(*sets)  # type: ignore[arg-type]
    enum = prop.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(x, str) for x in enum):
        return {"string"}
    return None


def _reject(name: str) -> Any:
    raise ValueError(name)


def _loads(text: str) -> Any:
    try:
        return json.loads(text.strip(), parse_constant=_reject)  # no NaN/Infinity
    except (ValueError, RecursionError):
        return _BAD


def _typed(raw: str, written_string: bool, types: Optional[set[str]]) -> tuple[Any, Optional[str]]:
    """(value, error) for a parameter's text; the rules are in the module docstring."""
    if written_string:
        if types is None or "string" in types:
            return raw, None
        v = _loads(raw)
        return (raw, None) if v is _BAD or isinstance(v, str) else (v, None)
    v = _loads(raw)
    if types is not None and "string" in types:
        if v is _BAD or (types == {"string"} and not isinstance(v, str)):
            return raw.strip(), None
        return v, None
    if v is _BAD:
        return raw.strip(), "not valid JSON"
    return v, None
