"""Structured outputs through a real `dsv4 serve --http` (MTP K = 2) and the `openai` package:
response_format json_schema (whole and streamed) and json_object, vLLM's structured_outputs
and guided_* extras; grammars that cannot compile and bad shapes are 400 one-liners."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import openai
import pytest

from tests.e2e.util import openai_server
from tests.model.test_structured import SCHEMA, validate

pytest.importorskip("llguidance")
KEY = "sk-test-structured"
MSGS = [{"role": "user", "content": "Who goes there?"}]


@pytest.fixture(scope="module")
def client(tiny_model: Path) -> Iterator[openai.OpenAI]:
    with openai_server(tiny_model, "--num-speculative-tokens", "2", key=KEY) as (c, _):
        yield c


def _name(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def test_response_format_json_schema_whole_and_streamed(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for temperature in (0, 1.0):
        r = client.chat.completions.create(model=_name(client), messages=MSGS, max_tokens=160,
                                           temperature=temperature, seed=5, response_format=rf)
        assert r.choices[0].finish_reason == "stop"
        validate(json.loads(r.choices[0].message.content))
        chunks = client.chat.completions.create(model=_name(client), messages=MSGS, max_tokens=160,
                                                temperature=temperature, seed=5, response_format=rf, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == r.choices[0].message.content


def test_json_object_and_vllm_extras(client):
    r = client.chat.completions.create(model=_name(client), messages=MSGS, max_tokens=150, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")
    c = client.completions.create(model=_name(client), prompt="Who", max_tokens=20, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["Romeo", "Juliet"]}})
    assert c.choices[0].text in ("Romeo", "Juliet") and c.choices[0].finish_reason == "stop"
    c = client.completions.create(model=_name(client), prompt="Who", max_tokens=20, temperature=1.0,
                                  extra_body={"guided_regex": "[A-Z][a-z]{2,5}!"})
    assert re.fullmatch("[A-Z][a-z]{2,5}!", c.choices[0].text)
    c = client.completions.create(model=_name(client), prompt="Who", max_tokens=160, temperature=0,
                                  extra_body={"guided_json": json.dumps(SCHEMA)})
    validate(json.loads(c.choices[0].text))
    c = client.completions.create(model=_name(client), prompt="Who", max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": 'root ::= "ay" | "nay"'})
    assert c.choices[0].text in ("ay", "nay")


@pytest.mark.parametrize("extra, words", [
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "ebnf"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "enum": ["x" * 70000]}}}}, "limit"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "one structured-output field"),
])
def test_bad_grammars_are_400_one_liners(client, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=_name(client), messages=MSGS, max_tokens=4, extra_body=extra)
    msg = e.value.body["message"]
    assert e.value.status_code == 400 and words in msg and "\n" not in msg
    r = client.chat.completions.create(model=_name(client), messages=MSGS, max_tokens=2)  # the server goes on
    assert r.usage.completion_tokens == 2


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["C", "F"]}, "days": {"type": "integer"}},
    "required": ["unit", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}


@pytest.fixture(scope="module")
def v4_client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    """A tiny random model with DeepSeek V4's tokenizer (its DSML markup), served with K = 2."""
    from tests.checkpoints import write_v4_tokenizer_model

    path = write_v4_tokenizer_model(tmp_path_factory.mktemp("v4-tools"))
    with openai_server(path, "--num-speculative-tokens", "2", key=KEY) as (c, _):
        yield c


@pytest.mark.parametrize("choice, name", [("required", None),
                                          ({"type": "function", "function": {"name": "get_time"}}, "get_time")])
def test_forced_tool_choice_makes_a_valid_call(v4_client, choice, name):
    """A random model forced by the DSML grammar: its answer parses into tool_calls of the listed
    functions with arguments of the schema's types, streamed as whole; no DSML in content."""
    kw = dict(model=_name(v4_client), messages=[{"role": "user", "content": "Weather or time?"}],
              tools=[WEATHER, TIME], tool_choice=choice, max_tokens=300, temperature=1.0)
    finished = 0
    for seed in range(3):
        r = v4_client.chat.completions.create(**kw, seed=seed)
        ch = r.choices[0]
        assert not ch.message.content or "DSML" not in ch.message.content
        if ch.finish_reason == "length":  # a random model may go on calling
            continue
        finished += 1
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
        for call in ch.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert call.function.name in ((name,) if name else ("get_weather", "get_time"))
            if call.function.name == "get_weather":
                assert args["unit"] in ("C", "F") and isinstance(args["days"], int)
            else:
                assert isinstance(args["utc"], bool)
        streamed: dict[int, list[str]] = {}
        for chunk in v4_client.chat.completions.create(**kw, seed=seed, stream=True):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                slot = streamed.setdefault(tc.index, ["", ""])
                slot[0] += tc.function.name or ""
                slot[1] += tc.function.arguments or ""
        assert [tuple(v) for _, v in sorted(streamed.items())] == [
            (c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    assert finished


def test_without_llguidance_a_structured_request_is_400_naming_what_to_install(tiny_model, tmp_path):
    """A daemon that cannot import llguidance (a stand-in package that raises ImportError) answers
    a structured-output request with a 400 that says how to install it; others run as before."""
    import os

    fake = tmp_path / "no-llguidance" / "llguidance"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("llguidance is hidden for this test")\n')
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH", "")) if p)
    with openai_server(tiny_model, key=KEY, PYTHONPATH=path) as (c, _):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=_name(c), messages=MSGS, max_tokens=4,
                                      response_format={"type": "json_object"})
        msg = e.value.body["message"]
        assert e.value.status_code == 400 and "llguidance" in msg and "scripts/venv.sh http" in msg
        assert c.chat.completions.create(model=_name(c), messages=MSGS, max_tokens=2).usage.completion_tokens == 2
