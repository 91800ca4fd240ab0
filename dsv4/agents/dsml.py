"""DSML tool calls: parse what DeepSeek V4 generates into OpenAI `tool_calls`.

V4 writes its calls after the content, as a `<｜DSML｜tool_calls>` block of `invoke`
elements with `parameter`s (`string="true"|"false"`); V3.2's and V4.1's variants are
accepted too. `DSMLStreamParser` (events and call types in `calls.py`) is fed text as it is
detokenised and emits `ContentDelta` as it comes and each call whole once its invoke closes
(`ToolCallStart`, `ToolCallArgs`, `ToolCallEnd`); `parse_dsml` feeds it the whole text.
Whatever could still become a tag is held back until decided, so no DSML fragment reaches
content. Values are typed by the tool's schema; `arguments` is `json.dumps` of the object,
and the streamed pieces concatenate to exactly that string. Calls to functions not in
`tools` are dropped (listed in `errors`) unless `allow_unknown`; a call still open at the
end is not a call. `finish_reason`: "length" then, else "tool_calls" with calls, else None.
The format, accepted variants and typing rules: docs/agents.md, 'dsv4/agents/dsml.py'.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Optional

from .calls import (ContentDelta, Event, ParseResult, ToolCall, ToolCallArgs, ToolCallEnd,  # noqa: F401
                    ToolCallStart, _loads, _schemas, _typed, _types, make_call_id)
from .encoding import DSML, dumps  # noqa: F401  (one spelling of the markup token; importers take it from here too)

TRUNCATED = "truncated"
_OPENERS = ("<" + DSML, "</" + DSML)
_TAG_CAP = 512  # a tag longer than this (no '>' yet) is not a tag
_TAG_RE = re.compile(
    r'<(/?)｜DSML｜[ \t]*([A-Za-z_]+)((?:[ \t]+[A-Za-z_]+[ \t]*=[ \t]*"[^"<>\n]*")*)[ \t]*(/?)>')
_ATTR_RE = re.compile(r'([A-Za-z_]+)[ \t]*=[ \t]*"([^"<>\n]*)"')
_TERM_RE = re.compile(r"[<>\n]")
BLOCK_NAMES = frozenset({"tool_calls", "function_calls", "calls"})
WRAPPER_NAMES = frozenset({"arguments", "parameters", "params", "args", "input"})
_WS = " \t\r\n"


def _classify(buf: str, i: int) -> tuple[str, int, Optional[re.Match[str]]]:
    """What starts at buf[i] == '<': ("tag", end, match), ("partial", 0, None) when more text
    must come to decide, ("bad", n, None) for n chars from `<｜DSML｜` that are no tag, or
    ("text", 1, None). Depends only on the text, never on where it was split."""
    for lit in _OPENERS:
        rest = buf[i:i + len(lit)]
        if len(rest) < len(lit) and lit.startswith(rest):
            return "partial", 0, None
        if rest == lit:
            start = i + len(lit)
            term = _TERM_RE.search(buf, start, start + _TAG_CAP)
            if term is None:
                return ("partial", 0, None) if len(buf) - start < _TAG_CAP else ("bad", len(lit), None)
            if term.group() == ">":
                m = _TAG_RE.fullmatch(buf, i, term.end())
                return ("tag", m.end(), m) if m else ("bad", term.end() - i, None)
            return "bad", term.start() - i, None
    return "text", 1, None


@dataclass
class _Call:
    index: int
    id: str
    name: str
    props: Optional[dict[str, Any]]  # None: no schema (unknown function allowed)
    skip: bool = False  # unknown function: parsed, not emitted
    first: bool = True  # no argument key written yet
    nparams: int = 0
    pieces: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    error: Optional[str] = None


@dataclass
class _Param:
    name: str
    written_string: bool
    types: Optional[set[str]]
    wrapper: bool
    stream: bool
    raw: list[str] = field(default_factory=list)


class DSMLStreamParser:
    """Feed generated text (after `</think>`) piece by piece; `feed` and `finish` return events.

    After `finish()`: `calls` (complete calls), `errors`, `truncated`, `finish_reason`."""

    def __init__(self, tools: Optional[Iterable[Any]] = None, *, allow_unknown: bool = False,
                 id_factory: Callable[[], str] = make_call_id) -> None:
        self._schemas = _schemas(tools)
        self._allow_unknown = allow_unknown
        self._id_factory = id_factory
        self._buf = ""
        self._mode = "content"  # content | block | invoke | param
        self._implicit = False  # the block was opened by a bare invoke
        self._block_calls = 0
        self._pending_ws = ""
        self._lstrip = False
        self._call: Optional[_Call] = None
        self._param: Optional[_Param] = None
        self._next_index = 0
        self._out: list[Event] = []
        self.calls: list[ToolCall] = []
        self._held: list[Event] = []  # the events of the call being parsed, emitted when it closes
        self.errors: list[str] = []
        self.truncated = False

    def openai_calls(self) -> list[dict[str, Any]]:
        """The complete calls in OpenAI's shape, as they were streamed."""
        return [c.to_openai() for c in self.calls]

    @property
    def finish_reason(self) -> Optional[str]:
        return "length" if self.truncated else ("tool_calls" if self.calls else None)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._run()
        return self._take()

    def finish(self, cut: bool = False) -> list[Event]:
        """The end of the text: `cut` when the generation was stopped by its length (then a
        held-back `<` may be the start of a block, and is dropped with the whitespace before
        it), else it ended on purpose and a `<` or `</` that never became a tag is text."""
        self._run()
        rest, self._buf = self._buf, ""
        if self._mode == "content":
            if rest and "｜" not in rest and not cut:  # `<`, `</`: it never became a tag, so it is text
                self._out.append(ContentDelta(self._pending_ws + rest))
                self._pending_ws = ""
            elif rest:  # the start of DSML markup, cut by the end: never content
                self.truncated, self._pending_ws = "｜" in rest, ""
            if self._pending_ws:
                self._out.append(ContentDelta(self._pending_ws))
                self._pending_ws = ""
        else:
            if self._mode in ("invoke", "param") or self._block_calls == 0:
                self.truncated = True
            if self._param is not None:
                if self._param.stream:
                    self._args('"')
                self._param = None
            if self._call is not None:
                self._end_invoke(TRUNCATED)
            self._mode = "content"
        if self.truncated:
            self.errors.append("the text ended inside a tool call")
        return self._take()

    def _take(self) -> list[Event]:
        """The events so far, a call's only once it closed complete (a cut one never), adjacent
        content or argument pieces merged."""
        ready: list[Event] = []
        for e in self._out:
            if not (isinstance(e, ToolCallStart) or self._held):
                ready.append(e)
                continue
            self._held.append(e)
            if isinstance(e, ToolCallEnd):
                if e.error != TRUNCATED:
                    ready += self._held
                self._held = []
        out: list[Event] = []
        for e in ready:
            if out and type(out[-1]) is type(e) and isinstance(e, (ContentDelta, ToolCallArgs)):
                out[-1] = replace(e, text=out[-1].text + e.text)  # type: ignore[union-attr]
            else:
                out.append(e)
        self._out = []
        return out

    def _run(self) -> None:
        buf, pos = self._buf, 0
        while pos < len(buf):
            lt = buf.find("<", pos)
            end = len(buf) if lt < 0 else lt
            if end > pos:
                self._text(buf[pos:end])
                pos = end
            if lt < 0:
                break
            kind, n, m = _classify(buf, lt)
            if kind == "partial":
                break
            if kind == "tag":
                self._tag(m)  # type: ignore[arg-type]
                pos = n
            elif kind == "bad" and self._mode == "content":
                pos += n  # `<｜DSML｜` that is no tag: markup all the same, never content
            else:
                self._text(buf[pos:pos + n])
                pos += n
        self._buf = buf[pos:]

    def _text(self, s: str) -> None:
        mode = self._mode
        if mode == "content":
            if self._lstrip:
                s = s.lstrip(_WS)
                if not s:
                    return
                self._lstrip = False
            body = s.rstrip(_WS)
            if body:
                self._out.append(ContentDelta(self._pending_ws + body))
                self._pending_ws = ""
            self._pending_ws += s[len(body):]
        elif mode == "param":
            assert self._param is not None
            if self._param.stream:
                self._args(dumps(s)[1:-1])  # JSON escapes are per character
            else:
                self._param.raw.append(s)
        elif mode == "invoke" and self._call is not None and self._call.nparams == 0:
            self._call.body.append(s)
        # block mode: text between invokes is ignored

    def _tag(self, m: re.Match[str]) -> None:
        close, name, selfclose = m.group(1) == "/", m.group(2).lower(), bool(m.group(4))
        attrs = dict(_ATTR_RE.findall(m.group(3)))
        if self._mode == "param":
            self._end_param()
            if close and name == "parameter":
                return
        if name in BLOCK_NAMES:
            if close and self._mode != "content":
                if self._call is not None:
                    self._end_invoke(None)
                self._to_content()
            elif not close and self._mode == "content" and not selfclose:
                self._open_block(implicit=False)
        elif name == "invoke":
            if close:
                if self._mode == "invoke":
                    self._end_invoke(None)
                    self._after_invoke()
                return
            if self._mode == "content":
                self._open_block(implicit=True)
            elif self._mode == "invoke":
                self._end_invoke(None)
            self._start_invoke(attrs.get("name", ""))
            if selfclose:
                self._end_invoke(None)
                self._after_invoke()
        elif name == "parameter" and not close and self._mode == "invoke":
            self._start_param(attrs)
            if selfclose:
                self._end_param()
        # anything else (stray closes, unknown tag names) is dropped

    def _open_block(self, implicit: bool) -> None:
        self._mode, self._implicit, self._block_calls, self._pending_ws = "block", implicit, 0, ""

    def _to_content(self) -> None:
        self._mode, self._lstrip = "content", True

    def _after_invoke(self) -> None:
        if self._implicit:
            self._to_content()
        else:
            self._mode = "block"

    def _args(self, text: str) -> None:
        call = self._call
        if call is not None and not call.skip:
            call.pieces.append(text)
            self._out.append(ToolCallArgs(call.index, text))

    def _key(self, key: str) -> None:
        assert self._call is not None
        self._args(("{" if self._call.first else ", ") + dumps(key) + ": ")
        self._call.first = False

    def _start_invoke(self, name: str) -> None:
        name = name.strip()
        self._mode = "invoke"
        self._block_calls += 1
        if name not in self._schemas and not self._allow_unknown:
            self.errors.append(f"call to unknown function {name!r} dropped")
            self._call = _Call(-1, "", name, None, skip=True)
            return
        self._call = _Call(self._next_index, self._id_factory(), name, self._schemas.get(name))
        self._next_index += 1
        self._out.append(ToolCallStart(self._call.index, self._call.id, name))

    def _start_param(self, attrs: dict[str, str]) -> None:
        call = self._call
        assert call is not None
        call.nparams += 1
        name = attrs.get("name", "")
        written_string = attrs.get("string", "true").strip().lower() != "false"
        types = _types(call.props.get(name)) if call.props is not None else None
        wrapper = call.props is not None and name in WRAPPER_NAMES and name not in call.props
        stream = written_string and (types is None or "string" in types) and not wrapper
        self._param = _Param(name, written_string, types, wrapper, stream)
        self._mode = "param"
        if stream:
            self._key(name)
            self._args('"')

    def _end_param(self) -> None:
        p, call = self._param, self._call
        assert p is not None and call is not None
        self._param, self._mode = None, "invoke"
        if p.stream:
            self._args('"')
            return
        raw = "".join(p.raw)
        if p.wrapper:
            v = _loads(raw)
            if isinstance(v, dict):
                for k, x in v.items():
                    self._key(str(k))
                    self._args(dumps(x))
                return
        value, err = _typed(raw, p.written_string, p.types)
        if err and call.error is None:
            call.error = f"parameter {p.name!r}: {err}"
        self._key(p.name)
        self._args(dumps(value))

    def _end_invoke(self, error: Optional[str]) -> None:
        call = self._call
        assert call is not None
        if call.skip:
            self._call = None
            return
        if call.first:  # no parameters: empty, or a V4.1 JSON-object body
            body = "".join(call.body).strip()
            obj = _loads(body) if body else {}
            if isinstance(obj, dict) and len(obj) == 1 and call.props is not None:
                (k, v), = obj.items()
                if k in WRAPPER_NAMES and k not in call.props and isinstance(v, dict):
                    obj = v
            if not isinstance(obj, dict):
                obj, error = {}, error or "the invoke body is not a JSON object"
            self._args(dumps(obj))
        else:
            self._args("}")
        error, self._call = error or call.error, None
        self._out.append(ToolCallEnd(call.index, error))
        if error == TRUNCATED:  # not a call (`_take` drops its events)
            return
        self.calls.append(ToolCall(call.id, call.name, "".join(call.pieces), error))
        if error:
            self.errors.append(f"call {call.index} ({call.name}): {error}")


def parse_dsml(text: str, tools: Optional[Iterable[Any]] = None, *,
               allow_unknown: bool = False, cut: bool = False) -> ParseResult:
    """Parse a whole generated text (after `</think>`): content without DSML, complete calls."""
    parser = DSMLStreamParser(tools, allow_unknown=allow_unknown)
    events = parser.feed(text) + parser.finish(cut)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return ParseResult(content, parser.calls, parser.finish_reason, parser.truncated, parser.errors)
