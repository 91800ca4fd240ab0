"""Logprobs, echo and logit_bias through a real `dsv4 serve --http` (MTP K = 2) and the `openai`
package: OpenAI's shapes, streamed = whole, and the numbers equal a full forward of the same
checkpoint in this process (greedy chat logprobs; the prompt logprobs lm-eval's
`local-completions` loglikelihood reads: prompt token ids, echo, logprobs, max_tokens 1)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Iterator

import openai
import pytest
import torch

from tests.e2e.util import openai_server

KEY = "sk-test-logprobs"
TOL = 1e-3


@pytest.fixture(scope="module")
def client(tiny_model: Path) -> Iterator[openai.OpenAI]:
    with openai_server(tiny_model, "--num-speculative-tokens", "2", "--long-prefill-token-threshold", "16",
                       key=KEY) as (c, _):
        yield c


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    from dsv4.model.loader import load_model

    return load_model(tiny_model, dtype=torch.float32).eval()


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)  # [S, V]


def _name(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def _tokenize(client: openai.OpenAI, body: dict) -> list[int]:
    """POST /tokenize (vLLM's route, beside /v1)."""
    req = urllib.request.Request(str(client.base_url).replace("/v1/", "/tokenize"), data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["tokens"]


def test_chat_logprobs_streamed_equal_whole_and_a_full_forward(client, model):
    msgs = [{"role": "user", "content": "To be, or not"}]
    kw = dict(model=_name(client), messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    text = ""
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the most likely
        vals = [t.logprob for t in e.top_logprobs]
        assert vals == sorted(vals, reverse=True) and e.top_logprobs[0].logprob == e.logprob
        assert e.bytes is not None
        text += bytes(e.bytes).decode("utf-8", "replace") if not e.token.startswith("bytes:") else ""
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # the numbers: log-softmax of a full forward over the prompt the server used and the answer
    prompt = _tokenize(client, {"messages": msgs})
    answer = _tokenize(client, {"prompt": r.choices[0].message.content, "add_special_tokens": False})
    if len(answer) == 12:  # the text re-tokenizes to the same ids (a byte-level BPE usually does)
        lp = _logprobs(model, prompt + answer)
        want = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(answer)]
        assert max(abs(e.logprob - w) for e, w in zip(content, want)) <= TOL


def test_lm_eval_loglikelihood_request(client, model):
    """What lm-eval's local-completions sends for loglikelihood: token ids, echo, logprobs 1, max_tokens 1."""
    ids = torch.randint(3, 4096, (40,), generator=torch.Generator().manual_seed(3)).tolist()  # 3 chunks of 16
    r = client.completions.create(model=_name(client), prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                  echo=True, seed=1234)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 41
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    full = _logprobs(model, ids)
    want = [full[j - 1, ids[j]].item() for j in range(1, 40)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:40], want)) <= TOL
    for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == v and 1 <= len(top) <= 2  # the most likely, and the chosen one
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # lm-eval's sum and is_greedy over a continuation
    ctx = 30
    assert abs(sum(lp.token_logprobs[ctx:-1]) - sum(want[ctx - 1:])) <= 40 * TOL
    r0 = client.completions.create(model=_name(client), prompt=ids, max_tokens=0, logprobs=0, echo=True)
    assert r0.usage.completion_tokens == 0 and len(r0.choices[0].logprobs.tokens) == 40
    assert r0.choices[0].logprobs.token_logprobs[1:] == lp.token_logprobs[1:40]


def test_vllm_prompt_logprobs(client, model):
    """vLLM's prompt_logprobs field (completions and chat, streamed and whole): null for the
    first position, then the prompt token's logprob and rank and the n most likely, equal to a
    full forward; echo's logprobs keep their own count of top tokens beside it."""
    ids = torch.randint(3, 4096, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    full = _logprobs(model, ids)
    r = client.completions.create(model=_name(client), prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    plp = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(plp) == 30 and plp[0] is None
    for j in range(1, 30):
        row = full[j - 1]
        mine = plp[j][str(ids[j])]
        assert abs(mine["logprob"] - row[ids[j]].item()) <= TOL
        assert mine["rank"] == int((row > row[ids[j]]).sum()) + 1
        ranked = {e["rank"]: int(t) for t, e in plp[j].items() if e["rank"] <= 3}
        assert [ranked[k] for k in (1, 2, 3)] == row.topk(3).indices.tolist() and len(plp[j]) in (3, 4)
    streamed = [c.model_dump()["choices"][0].get("prompt_logprobs") for c in client.completions.create(
        model=_name(client), prompt=ids, max_tokens=2, temperature=0, stream=True, extra_body={"prompt_logprobs": 3})
        if c.choices]
    assert streamed[0] == plp and all(p is None for p in streamed[1:])
    echo = client.completions.create(model=_name(client), prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                     echo=True, extra_body={"prompt_logprobs": 5}).choices[0]
    assert all(len(t) <= 2 for t in echo.logprobs.top_logprobs[1:])  # echo: logprobs 1's own count
    assert all(len(d) in (5, 6) for d in echo.model_dump()["prompt_logprobs"][1:])  # and prompt_logprobs 5's
    chat = client.chat.completions.create(model=_name(client), messages=[{"role": "user", "content": "x"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    cp = chat.model_dump()["choices"][0]["prompt_logprobs"]
    assert cp[0] is None and all(len(d) == 1 for d in cp[1:])  # the prompt's token only
    for bad in (-1, 21, "3", True):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            client.completions.create(model=_name(client), prompt="x", max_tokens=1,
                                      extra_body={"prompt_logprobs": bad})


def test_completion_stream_with_echo_equals_whole(client):
    kw = dict(model=_name(client), prompt="The king", max_tokens=6, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    assert whole.text.startswith("The king")
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.text
            for k in merged:
                merged[k] += getattr(c.logprobs, k) if c.logprobs is not None else []
    assert text == whole.text and merged == whole.logprobs.model_dump()


def test_logit_bias_forces_and_bans(client):
    kw = dict(model=_name(client), prompt="The king", max_tokens=5, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].logprobs.tokens
    forced = client.completions.create(**kw, logit_bias={"77": 100}).choices[0].logprobs.tokens
    assert len(set(forced)) == 1 and forced != plain
    first = _tokenize(client, {"prompt": plain[0], "add_special_tokens": False})
    banned = client.completions.create(**kw, logit_bias={str(first[0]): -100}).choices[0].logprobs.tokens
    assert banned[0] != plain[0]
    chat = client.chat.completions.create(model=_name(client), messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, temperature=0, logit_bias={"77": 100}, logprobs=True)
    assert len({e.token for e in chat.choices[0].logprobs.content}) == 1


@pytest.mark.parametrize("chat, extra", [
    (True, {"logprobs": True, "top_logprobs": 21}), (True, {"top_logprobs": 2}), (True, {"echo": True}),
    (False, {"logprobs": 6}), (False, {"logit_bias": {"5": 101}}), (False, {"logit_bias": {"999999": 1}}),
    (False, {"max_tokens": 0})])
def test_bad_values_are_400(client, chat, extra):
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model=_name(client), messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, extra_body=extra)
        else:
            client.completions.create(model=_name(client), prompt="x", **{"max_tokens": 2, **extra})
    assert e.value.status_code == 400 and e.value.body["message"] and "\n" not in e.value.body["message"]
    json.dumps(e.value.body)


def test_n_samples_are_choices_with_the_prompt_counted_once(client):
    """`n` = 3 with a seed: three choices (index 0..2), seeded samples s, s + 1, s + 2 (the
    same request answers the same), streamed as whole; prompt tokens counted once."""
    kw = dict(model=_name(client), prompt="To be, or not", max_tokens=6, temperature=1.0, seed=11, n=3)
    r = client.completions.create(**kw)
    again = client.completions.create(**kw)
    one = client.completions.create(**{**kw, "n": 1})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert r.choices[0].text == one.choices[0].text and len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == one.usage.prompt_tokens and r.usage.completion_tokens == 18
    texts = {i: "" for i in range(3)}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]
    echoed = client.completions.create(**{**kw, "n": 2, "echo": True, "prompt": ["To be", "Or not"]})
    assert [c.text.split(" ", 1)[0] for c in echoed.choices][::2] == ["To", "Or"]  # prompt-major choices
    assert [c.text[:5] for c in echoed.choices] == ["To be", "To be", "Or no", "Or no"]
