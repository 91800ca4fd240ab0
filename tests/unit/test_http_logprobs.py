"""Logprobs, echo and logit_bias in the HTTP layer (dsv4/http/openai_requests.py, replies.py,
logprobs.py): bodies -> daemon parameters (400s with one-line messages for bad values), and
the daemon's logprob entries -> OpenAI's shapes, validated by the `openai` package's types,
streamed = whole."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("starlette")
openai_types = pytest.importorskip("openai.types")

from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from dsv4.http.replies import Replies  # noqa: E402
from dsv4.http.openai_requests import ApiError, parse_chat, parse_completion  # noqa: E402

MSGS = [{"role": "user", "content": "x"}]


class _Choice:
    """Attribute access to a completions choice (its logprobs too) in a plain dict."""

    def __init__(self, d: dict) -> None:
        self.text, self.finish_reason = d["text"], d["finish_reason"]
        self.logprobs = type("L", (), dict(d["logprobs"])) if d["logprobs"] else None


class _Metrics:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def _entry(tid: int, text: str, lp: float | None, top: list[tuple[int, str, float | None]] = ()) -> dict:
    raw = list(text.encode()) if not text.startswith("bytes:") else [0xE2]
    return {"id": tid, "token": text, "bytes": raw, "logprob": lp,
            "top": [{"id": i, "token": t, "bytes": list(t.encode()), "logprob": v} for i, t, v in top]}


def test_bodies_to_params():
    p = parse_chat({"messages": MSGS, "logprobs": True, "top_logprobs": 3, "logit_bias": {"7": -100, "9": 5.5}}, None)
    assert p.params["logprobs"] == 3 and p.logprobs == 3 and p.params["logit_bias"] == {"7": -100.0, "9": 5.5}
    assert parse_chat({"messages": MSGS, "logprobs": True}, None).params["logprobs"] == 0
    assert "logprobs" not in parse_chat({"messages": MSGS, "logprobs": False, "top_logprobs": 0}, None).params
    c = parse_completion({"prompt": [1, 2], "logprobs": 2, "echo": True, "max_tokens": 0})
    assert c.params == {"logprobs": 2, "prompt_logprobs": 2, "max_tokens": 0} and c.echo and c.logprobs == 2
    assert "prompt_logprobs" not in parse_completion({"prompt": "ab", "echo": True}).params  # the text is known
    assert parse_completion({"prompt": [1], "echo": True}).params == {"prompt_logprobs": 0}  # for its text
    assert parse_completion({"prompt": "x", "logit_bias": {}}).params == {}


@pytest.mark.parametrize("chat, extra, param", [
    (True, {"logprobs": "yes"}, "logprobs"), (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (True, {"top_logprobs": 2}, "top_logprobs"), (True, {"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    (True, {"echo": True}, "echo"), (False, {"logprobs": 6}, "logprobs"), (False, {"logprobs": True}, "logprobs"),
    (False, {"top_logprobs": 2}, "top_logprobs"), (False, {"echo": 1}, "echo"), (False, {"max_tokens": 0}, "max_tokens"),
    (False, {"logit_bias": {"x": 1}}, "logit_bias"), (False, {"logit_bias": {"5": 101}}, "logit_bias"),
    (True, {"logit_bias": [5]}, "logit_bias"), (True, {"logit_bias": {"5": True}}, "logit_bias"),
    (False, {"logit_bias": {"1" * 5000: 1}}, "logit_bias")])  # int() of 4301+ digits raises: a 400, not a 500
def test_bad_values_are_400_naming_the_field(chat, extra, param):
    with pytest.raises(ApiError) as e:
        if chat:
            parse_chat({"messages": MSGS, **extra}, None)
        else:
            parse_completion({"prompt": "x", **extra})
    assert e.value.status == 400 and e.value.param == param and "\n" not in e.value.message


TOKENS = [_entry(5, " the", -0.5, [(5, " the", -0.5), (6, " a", -1.5), (7, "x", None)]),
          _entry(8, "bytes:\\xe2", -0.1, [(8, "bytes:\\xe2", -0.1), (5, " the", -3.0), (6, " a", -4.0)]),
          _entry(9, " king", -2.0, [(6, " a", -1.0), (7, "x", -1.9), (5, " the", -1.95)])]
PROMPT = [_entry(1, "Hi", None), _entry(2, " there", -3.25, [(3, ",", -1.0)])]


def _run(parsed, chat: bool, deltas: list[dict]) -> tuple[Replies, list[dict]]:
    r = Replies(parsed, chat, {"r": 0}, 0.0, model_name="m", metrics=_Metrics())
    chunks = []
    for d in deltas:
        chunks += r.take({"type": "delta", "id": "r", **d})
    chunks += r.take({"type": "final", "id": "r", "finish_reason": "length",
                      "usage": {"prompt_tokens": 2, "completion_tokens": len(TOKENS)}})
    return r, chunks


def _deltas(prompt=None) -> list[dict]:
    """One delta per token; the second's text is held back (half a character) until the third."""
    first = {"text": " the", "token_ids": [5], "logprobs": TOKENS[:1]}
    if prompt is not None:
        first["prompt_logprobs"] = prompt
    return [first, {"text": "", "token_ids": [8], "logprobs": TOKENS[1:2]},
            {"text": "\u2603 king", "token_ids": [9], "logprobs": TOKENS[2:]}]


def test_chat_shapes_streamed_equal_whole():
    parsed = parse_chat({"messages": MSGS, "logprobs": True, "top_logprobs": 3, "stream": True}, None)
    r, chunks = _run(parsed, True, _deltas())
    streamed = []
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
        lp = c["choices"][0]["logprobs"]
        streamed += lp["content"] if lp else []
    whole = ChatCompletion.model_validate(r.whole())
    content = whole.choices[0].logprobs.content
    assert [e.model_dump() for e in content] == streamed
    assert [e.token for e in content] == [" the", "bytes:\\xe2", " king"]
    assert content[0].top_logprobs[2].logprob == -9999.0  # -inf (nil on the wire)
    assert content[1].bytes == [0xE2] and content[2].top_logprobs[0].token == " a"
    none = Replies(parse_chat({"messages": MSGS}, None), True, {"r": 0}, 0.0, model_name="m", metrics=_Metrics())
    none.take({"type": "delta", "id": "r", "text": "a", "token_ids": [1]})
    assert none.whole()["choices"][0]["logprobs"] is None


def _completion(obj: dict) -> Completion:
    """Validated by openai's types, which type the echoed first token's null logprob as a float
    (OpenAI and vLLM send null there; the client does not validate): checked without it."""
    choice = dict(obj["choices"][0])
    choice["finish_reason"] = choice["finish_reason"] or "length"  # a stream chunk's null, typed as required
    lp = choice["logprobs"]
    if lp and lp["token_logprobs"][:1] == [None]:
        assert lp["top_logprobs"][0] is None
        choice["logprobs"] = {k: v[1:] for k, v in lp.items()}
    return Completion.model_validate({**obj, "choices": [choice]})


@pytest.mark.parametrize("prompt", ["Hi there", [1, 2]])
def test_completion_echo_shapes_streamed_equal_whole(prompt):
    parsed = parse_completion({"prompt": prompt, "logprobs": 1, "echo": True, "stream": True})
    r, chunks = _run(parsed, False, _deltas(PROMPT))
    obj = r.whole()
    _completion(obj)
    whole = _Choice(obj["choices"][0])
    assert whole.text == "Hi there the\u2603 king"
    lp = whole.logprobs
    assert lp.tokens == ["Hi", " there", " the", "bytes:\\xe2", " king"]
    assert lp.token_logprobs == [None, -3.25, -0.5, -0.1, -2.0]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[1] == {",": -1.0, " there": -3.25}  # the chosen one too
    assert lp.top_logprobs[4] == {" a": -1.0, "x": -1.9, " the": -1.95, " king": -2.0}  # as many as the daemon sent
    assert lp.text_offset == [0, 2, 8, 12, 12]  # a piece of a character counts once the character is whole
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for c in chunks:
        _completion(c)
        text += c["choices"][0]["text"]
        for k, v in (c["choices"][0]["logprobs"] or {}).items():
            merged[k] += v
    assert text == whole.text and merged == obj["choices"][0]["logprobs"]


def test_echo_without_new_tokens():
    parsed = parse_completion({"prompt": [1, 2], "echo": True, "max_tokens": 0})
    r = Replies(parsed, False, {"r": 0}, 0.0, model_name="m", metrics=_Metrics())
    r.take({"type": "delta", "id": "r", "text": "", "token_ids": [], "prompt_logprobs": PROMPT})
    r.take({"type": "final", "id": "r", "finish_reason": "length", "usage": {"prompt_tokens": 2,
                                                                          "completion_tokens": 0}})
    choice = _completion(r.whole()).choices[0]
    assert choice.text == "Hi there" and choice.logprobs is None and choice.finish_reason == "length"
