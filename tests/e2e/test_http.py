"""The OpenAI-compatible HTTP API of a real `dsv4 serve --http` subprocess, through real clients:
the `openai` package, and raw HTTP for SSE framing, body limits and disconnects."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from pathlib import Path
from typing import Iterator

import openai
import pytest

from tests.e2e.util import Daemon, dsv4, env_for, free_port, run_json, status, status_now, wait_until

KEY = "sk-test-dsv4"



@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[tuple[Daemon, int]]:
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV4_API_KEY", KEY)  # the key guards the ZeroMQ socket too: the CLI calls here carry it
        # a fixed K: the spec-decode metrics and the bench's MTP arms need drafts (auto may choose 0)
        d = Daemon(tiny_model, "--http", f"127.0.0.1:{port}", "--api-key", KEY,
                   "--num-speculative-tokens", "1").wait_ready()
        assert wait_until(lambda: _get(port, "/health")[0] == 200, timeout=30), d.log.read_text()
        yield d, port
        d.cleanup()


@pytest.fixture(scope="module")
def client(server: tuple[Daemon, int]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[1]}/v1", api_key=KEY, max_retries=0, timeout=60)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read().decode()
    except OSError:
        return 0, ""
    finally:
        c.close()


def _post(port: int, path: str, body: bytes, headers: dict | None = None) -> http.client.HTTPResponse:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", path, body=body, headers={"Authorization": f"Bearer {KEY}", "Content-Type":
                                                 "application/json", **(headers or {})})
    return c.getresponse()


def test_models_and_the_same_greedy_text_as_the_cli(server, client):
    d, _ = server
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == Path(models[0].root).name
    r = client.completions.create(model=models[0].id, prompt="To be", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    cli = run_json("--raw", "--temperature", "0", "--max-tokens", "12", "--ignore-eos", "To be", endpoint=d.endpoint)
    assert r.choices[0].text == cli["text"]
    assert r.usage.prompt_tokens == cli["usage"]["prompt_tokens"]


def test_token_id_prompts_and_several_prompts(client):
    model = _model(client)
    r = client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6


def test_chat_stream_with_usage_matches_the_whole_answer(client):
    model = _model(client)
    msgs = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in with_choices].count("length") == 1
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 10


def test_stop_string_cuts_the_text(client):
    model = _model(client)
    full = client.completions.create(model=model, prompt="The king", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = client.completions.create(model=model, prompt="The king", max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.usage.completion_tokens < 24
    kept = client.completions.create(model=model, prompt="The king", max_tokens=24, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].finish_reason == "stop" and kept.choices[0].text == full[:full.index(stop) + len(stop)]
    assert kept.usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.parametrize("extra", [{"temperature": -1}, {"n": 129}, {"top_p": 0}, {"max_tokens": 0},
                                   {"stream_options": {"include_usage": True}}, {"logprobs": 6},
                                   {"repetition_penalty": 0}])
def test_bad_parameters_are_400(client, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=_model(client), prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["message"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("field, value", [("response_format", {"type": "structural_tag"}),
                                          ("reasoning_effort", "high"), ("min_tokens", 3), ("tools", [{}]),
                                          ("guided_json", 3), ("top_logprobs", 2)])
def test_fields_dsv4_does_not_honour_are_400_naming_them(client, chat, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model=_model(client), messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, extra_body={field: value})
        else:
            client.completions.create(model=_model(client), prompt="x", max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]


def test_no_op_values_and_fields_that_do_not_change_the_answer_are_accepted(client):
    r = client.completions.create(model=_model(client), prompt="x", max_tokens=2, n=1, user="u1", logit_bias={},
                                  extra_body={"response_format": {"type": "text"}, "some_vendor_field": 1})
    assert r.usage.completion_tokens == 2


def test_max_tokens_beyond_the_context_is_400_and_without_it_the_context_ends_the_answer(server, client):
    max_len = json.loads(_get(server[1], "/v1/models", {"Authorization": f"Bearer {KEY}"})[1])["data"][0][
        "max_model_len"]
    prompt = [5] * (max_len - 4)  # room for 4 output tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=_model(client), prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    assert "max_tokens 5 is too large" in e.value.body["message"] and "room for 4" in e.value.body["message"]
    for max_tokens in (4, None):  # fits exactly; unset: the model's default, cut at the context's end
        extra = {"max_tokens": max_tokens} if max_tokens else {}
        r = client.completions.create(model=_model(client), prompt=prompt, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
        assert r.usage.total_tokens == max_len


def test_wrong_key_is_401_and_unknown_model_404(server, client):
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    assert _get(server[1], "/health")[0] == 200  # open without the key
    assert _get(server[1], "/v1/nowhere", {"Authorization": f"Bearer {KEY}"})[0] == 404


def test_bad_bodies_get_the_openai_error_shape(server):
    port = server[1]
    for body, code in ((b"{not json", 400), (b"[1, 2]", 400), (b'{"prompt": 5}', 400),
                       (b'{"prompt": "' + b"x" * (9 << 20) + b'"}', 413)):
        r = _post(port, "/v1/completions", body)
        err = json.loads(r.read())["error"]
        assert r.status == code and err["type"] and err["message"], (body[:20], r.status, err)


def test_concurrent_streams(client):
    model = _model(client)
    results: dict[int, tuple[str, int]] = {}

    def one(i: int) -> None:
        text, usage = "", None
        for c in client.completions.create(model=model, prompt=f"Line {i}:", max_tokens=8, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
            text += "".join(ch.text for ch in c.choices)
            usage = c.usage or usage
        results[i] = (text, usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1, 2, 3] and all(n == 8 and text for text, n in results.values())


def test_sse_framing(server):
    r = _post(server[1], "/v1/completions", json.dumps({"prompt": "Now", "max_tokens": 4, "stream": True,
                                                        "ignore_eos": True, "temperature": 0}).encode())
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    assert r.getheader("cache-control") == "no-cache" and r.getheader("content-encoding") is None
    raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert [p["choices"][0]["finish_reason"] for p in payloads][-1] == "length"
    assert all(p["choices"][0]["finish_reason"] is None for p in payloads[:-1])


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_the_generation(server, stream):
    d, port = server
    cancelled = d.log.read_text().count("cancelled")
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = json.dumps({"prompt": "Long", "max_tokens": 900, "stream": stream, "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
              + b"\r\n\r\n" + body)
    if stream:
        got = b""
        while b"data: " not in got:  # the stream has started
            more = s.recv(4096)
            assert more, got
            got += more
    assert wait_until(lambda: status_now(d.endpoint)["in_flight"] == 1, timeout=30)
    s.close()
    assert wait_until(lambda: status_now(d.endpoint)["in_flight"] == 0, timeout=5)
    log = d.log.read_text()
    assert log.count("cancelled") == cancelled + 1 and "Traceback" not in log


def test_metrics_use_vllm_names(server, client):
    client.completions.create(model=_model(client), prompt="Count", max_tokens=6, extra_body={"ignore_eos": True})
    code, text = _get(server[1], "/metrics", {"Authorization": f"Bearer {KEY}"})
    assert code == 200
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    value = {ln.rsplit(" ", 1)[0].split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}
    assert value["vllm:generation_tokens_total"] >= 6
    assert value["vllm:spec_decode_num_draft_tokens_total"] > 0  # the tiny model drafts with K = 1
    assert "vllm:time_to_first_token_seconds_bucket" in value and "vllm:num_requests_running" in value
    assert not any("_created" in ln for ln in lines)


def test_non_loopback_address_needs_a_key():
    env = {k: v for k, v in env_for().items() if k != "DSV4_API_KEY"}  # no key from the environment either
    r = dsv4("serve", "--http", "0.0.0.0:8123", env=env)
    assert r.returncode == 2 and "--api-key" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bench_over_http(server):
    d, port = server
    r = dsv4("bench", "--http", f"http://127.0.0.1:{port}", "--api-key", KEY, "--prompt-len", "8", "--gen-len", "4",
             "--num-prompts", "2", "--warmup", "0", "--concurrency", "2", "--json", "-", timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    arms = {x["mtp"]: x for x in rep["results"]}
    assert rep["config"]["target"].startswith("http") and set(arms) == {"on", "off"}
    assert all(x["output_tokens"] == 8 and x["requests"] == 2 and x["ttft_s"]["p50"] for x in arms.values())
    assert arms["on"]["drafted"] > 0 and arms["off"]["drafted"] == 0


def test_metrics_need_the_key_and_health_stays_minimal(server):
    _, port = server
    status, text = _get(port, "/metrics")
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    status, text = _get(port, "/metrics", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and "vllm:" in text
    status, text = _get(port, "/health")
    assert status == 200 and json.loads(text) == {"status": "ok"}


def test_prefix_cache_over_http(client: openai.OpenAI, server: tuple[Daemon, int]) -> None:
    """The same 600-token prompt twice: the second finds its first two blocks cached
    (usage.prompt_tokens_details.cached_tokens), writes the same text, and the metrics and
    `dsv4 status` count it; another cache_salt shares nothing."""
    d, port = server
    prompt = list(range(5, 605))
    ask = lambda **extra: client.completions.create(  # noqa: E731
        model=_model(client), prompt=prompt, max_tokens=8, temperature=0, extra_body=extra)
    first, again = ask(), ask()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 512
    assert again.choices[0].text == first.choices[0].text
    assert ask(cache_salt="tenant-b").usage.prompt_tokens_details.cached_tokens == 0
    metrics = _get(port, "/metrics", {"Authorization": f"Bearer {KEY}"})[1]
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 512, metrics[:2000]
    st = status(d.endpoint)
    assert st["prefix_cache_hits"] >= 512 and st["prefix_cache_queries"] >= 1800 and st["blocks"] >= 8
    assert "prefix cache hit" in dsv4("status", "--socket", d.endpoint).stdout
    bad = _post(port, "/v1/completions", json.dumps({"model": _model(client), "prompt": "x", "cache_salt": ""}).encode())
    assert bad.status == 400 and "cache_salt" in bad.read().decode()
