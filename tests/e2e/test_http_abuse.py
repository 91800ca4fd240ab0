"""Nobody's request stalls anyone else's, through a real `dsv4 serve --http` with DeepSeek V4's
real tokenizer (its 129k vocabulary is what makes grammars costly) and the `openai` client:

* large grammars (the costliest schemas within 64 KiB), sent at once, neither stop a running
  stream nor hold up a small structured request (it is not answered last), and a grammar over
  llguidance's limits is a 400 saying so in one line;
* n samples of one prompt share its prefill (the prefix cache's hits count their blocks) and
  its prompt logprobs (computed once, the same in every choice); a request that may answer
  more logprob entries than the limit is a 400 naming it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import openai
import pytest

from tests.e2e.test_http import _get
from tests.e2e.util import openai_server

pytest.importorskip("llguidance")
KEY = "sk-test-abuse"


def large_schema(salt: str) -> dict:
    """800 properties with a pattern each (45 KB; xgrammar took 9.5 s, llguidance ~0.2 s)."""
    return {"type": "object", "title": salt, "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+{i}$"} for i in range(800)}}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[openai.OpenAI, int]]:
    from tests.checkpoints import write_v4_tokenizer_model

    path = write_v4_tokenizer_model(tmp_path_factory.mktemp("v4-abuse"))
    with openai_server(path, "--num-speculative-tokens", "0", key=KEY) as (c, d):
        yield c, c.base_url.port


def _model(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def test_large_grammars_stall_neither_a_stream_nor_a_small_grammar(served):
    c, _ = served
    model = _model(c)
    c.completions.create(model=model, prompt="warm", max_tokens=1,
                         extra_body={"structured_outputs": {"choice": ["a", "b"]}})  # the vocabulary's tables
    arrivals: list[float] = []
    done: dict[str, float] = {}
    t0 = time.monotonic()

    def stream() -> None:
        for _chunk in c.completions.create(model=model, prompt="Once upon a time", max_tokens=1000 - 8, stream=True,
                                           temperature=1.0, extra_body={"ignore_eos": True}):
            arrivals.append(time.monotonic() - t0)
        done["stream"] = time.monotonic() - t0

    def slow(salt: str) -> None:
        try:
            c.completions.create(model=model, prompt="x", max_tokens=2,
                                 extra_body={"structured_outputs": {"json": large_schema(salt)}})
        finally:
            done[f"slow {salt}"] = time.monotonic() - t0

    runner = threading.Thread(target=stream)
    runner.start()
    while len(arrivals) < 5:
        time.sleep(0.02)
    salts = ("a", "b", "c", "d")
    slows = [threading.Thread(target=slow, args=(s,)) for s in salts]
    sent = time.monotonic() - t0
    for t in slows:
        t.start()
    time.sleep(0.05)
    r = c.completions.create(model=model, prompt="y", max_tokens=4,
                             extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    done["small"] = time.monotonic() - t0
    assert r.choices[0].text in ("yes", "no")
    for t in slows:
        t.join(120)
    last_slow = max(done[f"slow {s}"] for s in salts)
    during = [a for a in arrivals if sent <= a <= last_slow]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if sent <= b <= last_slow]
    answered = ", ".join(f"{done['slow ' + s] - sent:.2f}" for s in salts)
    print(f"\nlarge grammars answered {answered} s after they "
          f"were sent; the small one {done['small'] - sent:.2f} s; the stream's largest gap meanwhile "
          f"{max(gaps, default=0) * 1000:.0f} ms over {len(during)} chunks")
    assert done["small"] < last_slow  # not behind all of them
    assert "stream" not in done or done["stream"] > last_slow  # the stream outlived the compiles ...
    assert len(during) >= 3  # ... and kept flowing through them (the loop never waited on a compile)
    runner.join(120)


def test_a_grammar_over_llguidances_limits_is_a_400_saying_so(served):
    c, _ = served
    lark = "start: " + " | ".join(f'/[^{chr(65 + i % 26)}]{{{i % 40 + 10},{i % 40 + 400}}}/ "{i}"' for i in range(300))
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=_model(c), prompt="x", max_tokens=2,
                             extra_body={"structured_outputs": {"grammar": lark}})
    msg = e.value.body["message"]
    assert "cannot compile" in msg and "too many" in msg and "\n" not in msg


def _metric(port: int, name: str) -> float:
    status, text = _get(port, "/metrics", {"Authorization": f"Bearer {KEY}"})
    assert status == 200
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")
               or line.startswith(name + " "))


def test_samples_share_the_prompts_prefill_and_logprobs(served):
    c, port = served
    prompt = list(range(1000, 1000 + 600))  # two whole blocks of 256, and a tail
    n = 6
    before = _metric(port, "vllm:prefix_cache_hits_total")
    r = c.completions.create(model=_model(c), prompt=prompt, max_tokens=3, n=n, echo=True, logprobs=2,
                             temperature=1.0, extra_body={"prompt_logprobs": 3})
    hits = _metric(port, "vllm:prefix_cache_hits_total") - before
    assert len(r.choices) == n
    first = r.choices[0].model_extra["prompt_logprobs"]
    assert first and all(ch.model_extra["prompt_logprobs"] == first for ch in r.choices)
    assert all(ch.logprobs.tokens[:len(prompt)] == r.choices[0].logprobs.tokens[:len(prompt)] for ch in r.choices)
    assert hits >= (n - 1) * 512, hits  # every sibling started from the first one's two blocks


def test_a_request_over_the_logprob_budget_is_a_400_naming_it(served):
    c, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=_model(c), prompt="hello " * 200, max_tokens=1000, n=64, echo=True, logprobs=5,
                             extra_body={"prompt_logprobs": 20})
    msg = e.value.body["message"]
    assert "logprob entries" in msg and "over the limit of 262144 per request" in msg, msg
    ok = c.completions.create(model=_model(c), prompt="hello", max_tokens=2, n=2, logprobs=1)
    assert len(ok.choices) == 2


def test_json_of_every_choice_is_one_body(served):
    """A whole answer is one JSON document (rendered once, not through several copies)."""
    c, port = served
    r = c.with_raw_response.completions.create(model=_model(c), prompt="hi", max_tokens=3, n=3)
    body = json.loads(r.http_response.text)
    assert len(body["choices"]) == 3 and r.http_response.headers["content-type"].startswith("application/json")
