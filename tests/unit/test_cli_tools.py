"""`dsv4 run --tools` output (dsv4/cli/tools.py, run.Output): the DSML the model writes
streams as nothing, the content as usual, then each call as one JSON line; `--json` adds
`content` and `tool_calls` with finish_reason "tool_calls" ("length" when a call is cut)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4.cli.run import Output
from dsv4.cli.tools import read_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
BLOCK = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
         '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
         '</｜DSML｜tool_calls>')


def _drive(text: str, *, as_json: bool, thinking: bool = False, reason: str = "stop") -> Output:
    out = Output(as_json=as_json, show_drafts=False, tools=TOOLS, thinking=thinking)
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # tags split across deltas
    events = [{"type": "delta", "token_ids": [1], "text": p} for p in pieces]
    events.append({"type": "final", "finish_reason": reason, "usage": {"prompt_tokens": 5, "completion_tokens": 9}})
    assert out.drive(iter(events), on_interrupt=None) == 0
    return out


def test_calls_print_as_json_lines_after_the_content(capsys) -> None:
    _drive("Let me check." + BLOCK, as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Let me check." and len(lines) == 2 and "DSML" not in lines[0]
    call = json.loads(lines[1])
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_json_has_content_and_tool_calls(capsys) -> None:
    _drive("I think.</think>Sure." + BLOCK, as_json=True, thinking=True)
    r = json.loads(capsys.readouterr().out)
    assert r["finish_reason"] == "tool_calls" and r["content"] == "Sure."
    assert r["text"].startswith("I think.</think>Sure.") and "DSML" in r["text"]  # the raw text, as generated
    assert [c["function"]["name"] for c in r["tool_calls"]] == ["get_weather"]


def test_thinking_prints_its_reasoning_and_the_tag(capsys) -> None:
    _drive("Hm, <maybe>.</think>Done." + BLOCK, as_json=False, thinking=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Hm, <maybe>.</think>Done." and json.loads(lines[1])["function"]["name"] == "get_weather"


def test_a_cut_call_finishes_with_length(capsys) -> None:
    _drive("Ok." + BLOCK[:BLOCK.index("Paris") + 2], as_json=True, reason="length")
    r = json.loads(capsys.readouterr().out)
    assert r["finish_reason"] == "length" and r["content"] == "Ok." and r["tool_calls"] == []  # not a call


def test_without_a_call_the_answer_is_plain(capsys) -> None:
    _drive("No tools needed: 1 < 2", as_json=True)
    r = json.loads(capsys.readouterr().out)
    assert r["finish_reason"] == "stop" and r["tool_calls"] == [] and r["content"] == "No tools needed: 1 < 2"


@pytest.mark.parametrize("body, needle", [
    ("[]", "non-empty JSON list"), ('{"tools": 5}', "non-empty JSON list"), ("{", "not JSON"),
    ('[{"type": "function", "function": {"parameters": {}}}]', "name"),
])
def test_bad_tool_files_are_one_line(tmp_path: Path, body: str, needle: str) -> None:
    f = tmp_path / "t.json"
    f.write_text(body)
    with pytest.raises(ValueError, match=needle) as e:
        read_tools(str(f))
    assert "\n" not in str(e.value) and str(f) in str(e.value)
    assert read_tools(str(_good(tmp_path))) == TOOLS


def _good(tmp_path: Path) -> Path:
    f = tmp_path / "good.json"
    f.write_text(json.dumps({"tools": TOOLS}))
    return f
