"""Structured outputs (dsv4/engine/grammar/masks.py) through the engine on a tiny random checkpoint:
JSON schema, regex and choice outputs follow their grammar, greedy and sampled; MTP K = 2
gives the same tokens as K = 0 whatever the drafts (the model's own, an oracle's, drafts the
grammar forbids: rejected), so the matcher's rollback is exact; thinking mode constrains only
after `</think>`; bad grammars are one-line errors for their request."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine.request import RequestError
from tests.checkpoints import write_tiny_checkpoint

pytest.importorskip("llguidance")
pytestmark = pytest.mark.exact

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
PROMPTS = ["To be, or not to be", "Now is the winter"]


def validate(doc, schema=SCHEMA) -> None:
    """The document against the schema, by jsonschema (a test dependency)."""
    import jsonschema

    jsonschema.validate(doc, schema)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-structured")
    write_tiny_checkpoint(d)
    return d


@pytest.fixture(scope="module")
def llms(ckpt):
    out = {K: LLM(ckpt, num_speculative_tokens=K, max_num_seqs=4, max_model_len=256, prefill_limit=16)
           for K in (0, 2)}
    yield out
    for llm in out.values():
        llm.close()


def _run(llm, params, drafter=None, prompts=PROMPTS):
    llm.engine.runner.draft_override = drafter
    try:
        return llm.generate(prompts, params)
    finally:
        llm.engine.runner.draft_override = None


def _by_prompt(llm, outs, prompts=PROMPTS):
    return {tuple(llm.engine.encode_request(p)): c.token_ids for p, c in zip(prompts, outs)}


def _oracle(ref):
    def draft(req, out_so_far, proposed):
        return (ref[tuple(req.prompt_ids)][len(out_so_far):] + [5] * len(proposed))[:len(proposed)]
    return draft


def _forbidden(llm):
    """Drafts the grammar never allows: the pad token, then EOS (only allowed at the end)."""
    tok = llm.engine.tokenizer
    return lambda req, out, proposed: [2, tok.eos_id][:len(proposed)]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_json_schema_output_is_valid_and_the_same_under_mtp(llms, sampling):
    params = SamplingParams(max_tokens=160, structured={"json_schema": SCHEMA}, **sampling)
    ref = _run(llms[0], params)
    for c in ref:
        assert c.finish_reason == "stop"
        validate(json.loads(c.text))
    by_prompt = _by_prompt(llms[0], ref)
    oracle = _run(llms[2], params, _oracle(by_prompt))
    assert [c.token_ids for c in oracle] == [c.token_ids for c in ref]
    assert sum(c.metrics["spec"]["accepted"] for c in oracle) >= 20  # drafts did run through the matcher
    for drafter in (None, _forbidden(llms[2])):
        out = _run(llms[2], params, drafter)
        assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    bad = _run(llms[2], params, _forbidden(llms[2]))
    assert sum(c.metrics["spec"]["accepted"] for c in bad) == 0  # forbidden drafts are rejected
    assert sum(c.metrics["spec"]["drafted"] for c in bad) > 0


def test_half_right_drafts_roll_the_matcher_back(llms):
    """Drafts right at the first position, wrong at the second: every step rolls back one token."""
    params = SamplingParams(max_tokens=160, structured={"json_schema": SCHEMA})
    ref = _by_prompt(llms[0], _run(llms[0], params))

    def half(req, out_so_far, proposed):
        nxt = ref[tuple(req.prompt_ids)][len(out_so_far):] + [5]
        return ([nxt[0], 2] + [5] * len(proposed))[:len(proposed)]
    out = _run(llms[2], params, half)
    assert [c.token_ids for c in out] == list(ref.values())
    assert sum(c.metrics["spec"]["accepted"] for c in out) > 0


def test_unseeded_sampled_json_object(llms):
    params = SamplingParams(max_tokens=120, temperature=1.0, structured={"json_object": True})
    for K in (0, 2):
        for c in _run(llms[K], params):
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict)
            else:  # a random model may write a long object: what it wrote is still a JSON prefix
                assert c.text.lstrip().startswith("{")


def test_regex_and_choice(llms):
    rx = r"[a-z]{3,6}-[0-9]{2}"
    for K in (0, 2):
        for c in _run(llms[K], SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured={"regex": rx})):
            assert re.fullmatch(rx, c.text) and c.finish_reason == "stop"
        choices = ["yes", "no", "maybe so", 'a "quoted"\nline']
        for seed in range(4):
            for c in _run(llms[K], SamplingParams(max_tokens=40, temperature=1.0, seed=seed,
                                                  structured={"choice": choices})):
                assert c.text in choices and c.finish_reason == "stop"


def test_constrained_and_free_requests_share_a_batch(llms):
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = _run(llms[2], free, prompts=PROMPTS[:1])[0]
    eng = llms[2].engine
    a = eng.add_request(PROMPTS[0], free)
    b = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=160, structured={"json_schema": SCHEMA}))
    got: dict[str, list[int]] = {a: [], b: []}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.token_ids
    assert got[a] == alone.token_ids  # the free request is not masked
    validate(json.loads(eng.tokenizer.decode(got[b][:-1])))


@pytest.mark.parametrize("spec, words", [
    ({"json_schema": {"type": "nonsense"}}, "json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"choice": []}, "choice"),
    ({"json_schema": {"enum": ["x" * 70000]}}, "limit"),
    ({"regex": "a", "choice": ["a"]}, "one of"),
])
def test_bad_grammars_are_one_line_errors(llms, spec, words):
    with pytest.raises(RequestError) as e:
        llms[0].engine.add_request("hi", SamplingParams(structured=spec))
    msg = str(e.value)
    assert "\n" not in msg and words in msg and len(msg) < 500
    assert not llms[0].engine.has_unfinished()


def test_ignore_eos_still_ends_at_the_grammar_end(llms):
    c = _run(llms[0], SamplingParams(max_tokens=60, ignore_eos=True, structured={"choice": ["yes", "no"]}))[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop"


def test_mask_cost_is_nothing_for_free_requests(llms, monkeypatch):
    import dsv4.engine.spec.verify as V

    called = []
    monkeypatch.setattr(V, "grammar_rows", lambda *a: called.append(1))
    _run(llms[2], SamplingParams(max_tokens=4))
    assert not called


def test_thinking_mode_constrains_after_think_end(tmp_path):
    """A prompt ending in <think> is free until </think>: a logit_bias making </think> the first
    token is obeyed there (a constrained row forbids it), then the JSON follows."""
    from dsv4.engine.grammar.masks import GrammarState

    class Matcher:  # records what the grammar sees (llguidance's LLMatcher calls, every token allowed in)
        def __init__(self):
            self.seen = []

        def unsafe_compute_mask_ptr(self, ptr, size):  # a mask that forbids everything: visible in bm
            import ctypes

            ctypes.memset(ptr, 0, size)

        def try_consume_tokens(self, ts):
            self.seen += ts
            return len(ts)

        def consume_token(self, t):
            self.seen.append(t)
            return True

        def rollback(self, n):
            del self.seen[len(self.seen) - n:]

    m = Matcher()
    g = GrammarState(m, 64, active=False, think_end=9)
    bm = torch.full((4, 2), -1, dtype=torch.int32)
    assert g.masks([5, 9, 7], bm) == [False, False, True, True] and m.seen == []
    assert bm[0].tolist() == [-1, -1] and bm[2].tolist() == [0, 0]
    g.commit([5, 9, 7])
    assert g.active and m.seen == [7]


@pytest.fixture(scope="module")
def v4_llm(tmp_path_factory):
    """A tiny model with DeepSeek V4's real tokenizer (its <think> and </think> tokens)."""
    from tests.checkpoints import write_v4_tokenizer_model

    d = write_v4_tokenizer_model(tmp_path_factory.mktemp("v4-structured"))
    llm = LLM(d, num_speculative_tokens=2, max_num_seqs=2, max_model_len=256)
    yield llm
    llm.close()


def test_thinking_mode_constrains_only_after_think_end(v4_llm):
    """</think> made the likeliest token everywhere (logit_bias): the thinking prompt writes it
    first (free), then a valid JSON answer in which the grammar forbids it; a chat-mode prompt
    is constrained from its first token."""
    tok = v4_llm.engine.tokenizer
    end = tok.token_to_id("</think>")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = SamplingParams(max_tokens=40, logit_bias={end: 100.0}, structured={"json_schema": schema})
    msgs = [{"role": "user", "content": "Answer in JSON."}]
    think = v4_llm.chat(msgs, params, thinking=True)[0]
    assert think.token_ids[0] == end and end not in think.token_ids[1:]
    assert json.loads(tok.decode(think.token_ids[1:-1])) in ({"ok": True}, {"ok": False})
    chat = v4_llm.chat(msgs, params)[0]
    assert end not in chat.token_ids and json.loads(chat.text) in ({"ok": True}, {"ok": False})
    free = v4_llm.chat(msgs, SamplingParams(max_tokens=3, logit_bias={end: 100.0}))[0]
    assert free.token_ids == [end] * 3  # what the bias does without a grammar


def test_the_daemon_compiles_grammars_off_its_loop(ckpt, tmp_path):
    """A real daemon loop (Server) over a real engine: a structured request's grammar compiles
    in the engine's compile pool (a worker process), so the loop never compiles (nor waits):
    `add_request` gets the compiled grammar; the answer follows it; a bad grammar is a one-line error."""
    import threading

    from dsv4.daemon.client import Client, DaemonError
    from dsv4.daemon.server import Server

    llm = LLM(ckpt, num_speculative_tokens=0, max_num_seqs=2, max_model_len=256)
    eng = llm.engine
    compiled_inline: list[str] = []
    given: list[bool] = []
    eng.grammars.compile = lambda spec: compiled_inline.append(threading.current_thread().name)  # type: ignore
    add = eng.add_request

    def recording(*a, **kw):
        given.append(kw.get("grammar") is not None)
        return add(*a, **kw)

    eng.add_request = recording  # type: ignore[method-assign]
    ep = f"ipc://{tmp_path}/s.sock"
    server = Server(eng, ep, model_name="tiny")
    server.bind()
    loop = threading.Thread(target=server.serve_forever, name="loop", daemon=True)
    loop.start()
    try:
        with Client(ep, api_key="") as c:
            rid = c.generate([5, 6, 7], {"max_tokens": 40, "structured": {"choice": ["yes", "no way"]}},
                             mode="raw")
            text = "".join(m.get("text") or "" for m in c.stream(rid, deadline=time.monotonic() + 60))
            assert text in ("yes", "no way")
            rid = c.generate([5], {"max_tokens": 4, "structured": {"regex": "(unclosed"}}, mode="raw")
            with pytest.raises(DaemonError, match="cannot compile"):
                list(c.stream(rid, deadline=time.monotonic() + 60))
        stats = eng.grammars.status()
    finally:
        server.request_stop("test over")
        loop.join(5)
        server.close()
        llm.close()
    assert compiled_inline == [] and given == [True], (compiled_inline, given)
    assert stats["compiled"] == 1 and stats["workers"] >= 1, stats  # in a worker process
