"""`dsv4 run --tools FILE` end to end, on a tiny random model with DeepSeek V4's real
tokenizer: the tools are rendered into the prompt the same way in a `--local` engine and
through a real daemon (the protocol's `tools`), exactly as the V4 encoder renders them, and
`--json` carries `content` and `tool_calls`; bad tool files and `--raw` are usage errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from dsv4.agents.encoding import ChatOptions, encode_messages
from dsv4.engine.tokenizer import Tokenizer
from tests.checkpoints import write_v4_tokenizer_model
from tests.e2e.util import Daemon, dsv4

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_v4_tokenizer_model(tmp_path_factory.mktemp("v4-tools-model"))


@pytest.fixture(scope="module")
def daemon(v4_model: Path) -> Iterator[Daemon]:
    d = Daemon(v4_model, "--num-speculative-tokens", "0").wait_ready()
    try:
        yield d
    finally:
        d.cleanup()


@pytest.fixture()
def tools_file(tmp_path: Path) -> Path:
    f = tmp_path / "tools.json"
    f.write_text(json.dumps(TOOLS))
    return f


def _run(*args: str, endpoint: str | None = None) -> dict:
    r = dsv4("run", "--json", "--max-tokens", "3", "--temperature", "0", *args, endpoint=endpoint, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_tools_are_rendered_in_the_prompt_locally_and_through_the_daemon(v4_model, daemon, tools_file) -> None:
    prompt = "Weather in Paris?"
    want = len(encode_messages(Tokenizer.from_dir(v4_model), [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": prompt}],
                               ChatOptions(tools=TOOLS)))
    local = _run("--local", "--model", str(v4_model), "--system", "Be brief.", "--tools", str(tools_file), prompt)
    served = _run("--system", "Be brief.", "--tools", str(tools_file), prompt, endpoint=daemon.endpoint)
    plain = _run("--system", "Be brief.", prompt, endpoint=daemon.endpoint)
    assert local["usage"]["prompt_tokens"] == served["usage"]["prompt_tokens"] == want
    assert plain["usage"]["prompt_tokens"] < want  # the "## Tools" block
    for r in (local, served):
        assert isinstance(r["tool_calls"], list) and "DSML" not in r["content"]
        assert r["finish_reason"] in ("stop", "length", "tool_calls")
    assert "tool_calls" not in plain and local["token_ids"] == served["token_ids"]


def test_bad_tools_are_usage_errors(v4_model, daemon, tmp_path, tools_file) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[{"type": "function", "function": {"name": 5}}]')
    r = dsv4("run", "--tools", str(bad), "hi", endpoint=daemon.endpoint)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--tools" in r.stderr, r.stderr
    r = dsv4("run", "--raw", "--tools", str(tools_file), "hi", endpoint=daemon.endpoint)
    assert r.returncode == 2 and "drop --raw" in r.stderr, r.stderr


CITY = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                          "parameters": {"type": "object", "properties": {
                                              "city": {"type": "string", "enum": ["Paris", "Rome"]}},
                                              "required": ["city"]}}}]


def test_chat_calls_a_tool_takes_its_result_and_goes_on(daemon, tmp_path) -> None:
    """`dsv4 chat --tools F --tool-choice required` on a terminal: the forced call prints as a
    line (no DSML), the session asks for its result by the tool's name, then the model goes on."""
    from tests.e2e.test_chat import Pty

    f = tmp_path / "tools.json"
    f.write_text(json.dumps(CITY))
    t = Pty("chat", "--tools", str(f), "--tool-choice", "required", "--max-tokens", "200", "--temperature", "0",
            endpoint=daemon.endpoint)
    try:
        t.expect("1 tool(s)")
        t.expect(">>> ")
        t.send("Weather in Paris?\r")
        shown = t.expect("get_weather> ")
        assert "[tool call call_" in shown and 'get_weather {"city": "' in shown and "DSML" not in shown, shown
        t.send("sunny, 21 C\r")
        t.expect(">>> ", timeout=120)  # the answer to the result (tool_choice auto now), then your turn
        t.send("/bye\r")
        assert t.proc.wait(20) == 0
    finally:
        t.close()


def test_run_tool_choice(daemon, tools_file) -> None:
    """required forces a call (a grammar); none leaves the tools out of the prompt; a name
    that is not a tool, or a choice without tools, is a usage error."""
    forced = _run("--tools", str(tools_file), "--tool-choice", "required", "--max-tokens", "40", "Hi",
                  endpoint=daemon.endpoint)
    assert forced["text"].startswith("\n\n<｜DSML｜tool_calls>") and forced["content"] == ""
    none = _run("--tools", str(tools_file), "--tool-choice", "none", "Hi", endpoint=daemon.endpoint)
    plain = _run("Hi", endpoint=daemon.endpoint)
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] < forced["usage"]["prompt_tokens"]
    for args, says in ((("--tools", str(tools_file), "--tool-choice", "nope"), "--tool-choice"),
                       (("--tool-choice", "required"), "--tool-choice needs --tools")):
        r = dsv4("run", *args, "Hi", endpoint=daemon.endpoint)
        assert r.returncode == 2 and says in r.stderr, r.stderr
