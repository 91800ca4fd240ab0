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

from tests.e2e.util import Daemon, free_port, wait_until
from tests.model.test_structured import SCHEMA, validate

pytest.importorskip("xgrammar")
KEY = "sk-test-structured"
MSGS = [{"role": "user", "content": "Who goes there?"}]


@pytest.fixture(scope="module")
def client(tiny_model: Path) -> Iterator[openai.OpenAI]:
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV4_API_KEY", KEY)
        d = Daemon(tiny_model, "--http", f"127.0.0.1:{port}", "--api-key", KEY, "--num-speculative-tokens", "2"
                   ).wait_ready()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert wait_until(lambda: _alive(c), timeout=30), d.log.read_text()
        yield c
        d.cleanup()


def _alive(c: openai.OpenAI) -> bool:
    try:
        return bool(c.models.list().data)
    except openai.APIError:
        return False


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
