"""The HTTP front end's pure parts: request parsing (OpenAI shapes -> daemon requests), the
thinking-mode splitter, address checks, and the chat session's commands."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from dsv4.cli.chat import Session  # noqa: E402
from dsv4.http.openai_requests import ApiError, parse_chat, parse_completion, thinking_of  # noqa: E402
from dsv4.http.server import HttpError, parse_address  # noqa: E402
from dsv4.agents.replies import ReasoningSplitter  # noqa: E402


def test_completion_fields_map_to_sampling_params():
    p = parse_completion({"prompt": "x", "max_completion_tokens": 7, "temperature": 0.5, "top_k": 3, "seed": 1,
                          "stop": "\n", "ignore_eos": True, "repetition_penalty": 1.1, "unknown_field": 1})
    assert p.params == {"max_tokens": 7, "temperature": 0.5, "top_k": 3, "seed": 1, "stop": ["\n"],
                        "ignore_eos": True, "repetition_penalty": 1.1}
    assert parse_completion({"prompt": "x", "max_tokens": 9}).params == {"max_tokens": 9}
    assert parse_completion({"prompt": [1, 2]}).prompts == [[1, 2]]
    assert parse_completion({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    assert parse_completion({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    s = parse_completion({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert s.stream and s.include_usage


@pytest.mark.parametrize("body", [{"prompt": ""}, {"prompt": []}, {"prompt": [1, "a"]}, {"prompt": None},
                                  {"prompt": "x", "n": 0}, {"prompt": "x", "n": 129}, {"prompt": "x", "n": True},
                                  {"prompt": "x", "n": 2.0}, {"prompt": "x", "echo": "yes"},
                                  {"prompt": "x", "stream_options": {"include_usage": True}},
                                  {"prompt": "x", "stream": "yes"}, {"prompt": "x", "stop": [1]},
                                  {"prompt": "x", "max_tokens": 3, "max_completion_tokens": 4}])
def test_bad_completion_bodies(body):
    with pytest.raises(ApiError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_parts_and_thinking_switches():
    p = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "RO"},
                                                              {"type": "text", "text": "MEO:"}]}]}, None)
    assert p.prompts == ["ROMEO:\n"] and p.mode == "raw"
    assert thinking_of({"thinking": {"type": "enabled"}}) and not thinking_of({"thinking": {"type": "disabled"}})
    assert thinking_of({"chat_template_kwargs": {"thinking": True}}) and not thinking_of({})
    for bad in ({"messages": []}, {"messages": [{"content": "x"}]}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}):
        with pytest.raises(ApiError):
            parse_chat(bad, None)


def test_reasoning_split_across_deltas():
    s = ReasoningSplitter(thinking=True)
    pieces = ["Let me", " think.</", "thi", "nk>The answer", " is 4."]
    got = [s.feed(p) for p in pieces] + [s.flush()]
    assert "".join(r for r, _ in got) == "Let me think."
    assert "".join(c for _, c in got) == "The answer is 4."
    plain = ReasoningSplitter(thinking=False)
    assert plain.feed("a</think>b") == ("", "a</think>b")
    unfinished = ReasoningSplitter(thinking=True)
    assert unfinished.feed("still </th") == ("still ", "") and unfinished.flush() == ("</th", "")


def test_addresses():
    assert parse_address("127.0.0.1:8000", None).port == 8000
    assert parse_address("8001", None).host == "127.0.0.1"
    assert parse_address("[::1]:8002", None).loopback
    assert parse_address("0.0.0.0:8003", "key").host == "0.0.0.0"
    for text, key in (("0.0.0.0:8000", None), ("localhost:0", None), ("host:port", None), ("10.0.0.1:80", "")):
        with pytest.raises(HttpError, match="--"):
            parse_address(text, key)


def test_chat_session_commands():
    s = Session(None)
    assert s.command("/set temperature 0.7") == "temperature = 0.7" and s.params["temperature"] == 0.7
    assert "max_tokens" in s.command("/set")
    with pytest.raises(ValueError):
        s.command("/set temperature hot")
    with pytest.raises(ValueError):
        s.command("/frobnicate")
    s.answered("ROMEO:", " O, she doth teach")
    assert s.prompt("JULIET:") == ("ROMEO:\n O, she doth teach\nJULIET:\n", "raw")
    assert s.command("/clear") and s.messages == []
    assert s.command("/bye") is None


def test_n_samples_per_prompt():
    """`n`: choices prompt-major, each sample its own request with seed s + j; the prompt cap
    counts the samples."""
    from dsv4.http.submit import check_prompt_count, sample_params

    p = parse_completion({"prompt": ["a", "b"], "n": 3, "seed": 7})
    assert p.n == 3 and parse_completion({"prompt": "x"}).n == 1
    assert [sample_params(p.params, j)["seed"] for j in range(3)] == [7, 8, 9]
    assert "seed" not in sample_params({"temperature": 1.0}, 2)
    assert sample_params({"seed": 2**64 - 1}, 1)["seed"] == 0
    check_prompt_count(p, 6)
    with pytest.raises(ApiError) as e:
        check_prompt_count(p, 5)
    assert e.value.status == 400 and "n = 3" in str(e.value)
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 2}, None).n == 2
