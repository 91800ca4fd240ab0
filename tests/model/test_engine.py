"""The engine end to end in-process (tiny random checkpoint, fp32 CPU): MTP never changes
greedy output, chunked prefill keeps the drafter exact, acceptance bookkeeping, sampling."""

from __future__ import annotations

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine.config import DEFAULT_CHUNK
from dsv4.engine.request import RequestError
from tests.checkpoints import write_tiny_checkpoint
from tests.model.conftest import W8A8_DENSE, assert_chains_agree

LENGTHS = [1, 2, 127, 128, 129, 255, 256, 257, 300]  # 300: past the window, many windows closed
GEN = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model = write_tiny_checkpoint(d)
    return d, model


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in lengths]


def _run(ckpt_dir, prompts, K, seqs, **kw):
    llm = LLM(ckpt_dir, num_speculative_tokens=K, max_num_seqs=seqs, max_model_len=512, **kw)
    return llm.generate(prompts, SamplingParams(max_tokens=GEN, ignore_eos=True))


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    """The w8a8 tests' checkpoint: routes densely (see tests/model/conftest.py `bound`)."""
    d = tmp_path_factory.mktemp("tiny-dense")
    return d, write_tiny_checkpoint(d, **W8A8_DENSE)


@pytest.fixture(scope="module")
def fp4_ckpts(tmp_path_factory):
    """Checkpoints stored as the official one is (FP8 attention, FP4 routed experts) for the
    mxfp4 modes: {quantization: (dir, the float32 model of its stored weights)}; the
    int8-activation one routes densely (see tests/model/conftest.py `bound`)."""
    out = {}
    for q, over in (("mxfp4", {}), ("w8a8-mxfp4", W8A8_DENSE)):
        d = tmp_path_factory.mktemp(f"tiny-{q}")
        write_tiny_checkpoint(d, quantize=True, **over)
        out[q] = d, LLM(d, quantization="none", max_model_len=512).engine.runner.model
    return out


@pytest.mark.exact
@pytest.mark.parametrize("quantization, limit", [("none", 16), ("none", 128), ("w8a8", 16), ("w8a8", 128),
                                                 ("mxfp4", 16), ("w8a8-mxfp4", 16)])
def test_greedy_with_mtp_equals_without(ckpt, dense_ckpt, fp4_ckpts, limit, quantization):
    """float32 (none, mxfp4): equal token for token. int8 activations: equal but at near-ties
    (`assert_chains_agree`)."""
    d, float_model = {"none": ckpt, "w8a8": dense_ckpt}.get(quantization) or fp4_ckpts[quantization]
    prompts = _prompts(LENGTHS)
    q = dict(prefill_limit=limit, quantization=quantization)
    llm = LLM(d, num_speculative_tokens=0, max_num_seqs=8, max_model_len=512, **q)
    ref = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=GEN, ignore_eos=True))]
    assert all(len(r) == GEN for r in ref)
    for K, seqs in ((1, 1), (1, 8), (2, 8), (3, 8)):
        out = [c.token_ids for c in _run(d, prompts, K, seqs, **q)]
        quantized = (llm.engine.runner.model, float_model) if "w8a8" in quantization else ()
        assert_chains_agree(out, ref, prompts, *quantized)


def test_penalties_with_mtp_equal_without(tmp_path):
    """The penalty of verify row j counts drafts 1..j, so greedy output with penalties is the
    same with K = 0, 1, 3 (a vocabulary of 8, where tokens repeat and penalties decide);
    the drafts are an oracle's, so verification accepts many and they must count."""
    write_tiny_checkpoint(tmp_path, vocab_size=8, with_tokenizer=False, seed=7)
    prompts = [[3, 5, 2, 7], [1, 1, 4], [6, 2, 2, 2, 5, 0, 1]]
    pen = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                         frequency_penalty=0.3)
    mk = lambda K: LLM(tmp_path, num_speculative_tokens=K, max_num_seqs=4, max_model_len=64)  # noqa: E731
    ref = [c.token_ids for c in mk(0).generate(prompts, pen)]
    assert ref != [c.token_ids for c in mk(0).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    by_prompt = {tuple(p): r for p, r in zip(prompts, ref)}

    def oracle(req, out_so_far, proposed):
        i = len(out_so_far)
        return (by_prompt[tuple(req.prompt_ids)][i:] + [0] * len(proposed))[:len(proposed)]

    for K, drafter in ((1, None), (1, oracle), (3, oracle)):
        llm = mk(K)
        llm.engine.runner.draft_override = drafter
        out = llm.generate(prompts, pen)
        assert [c.token_ids for c in out] == ref, K
        if drafter is not None:
            assert sum(c.metrics["spec"]["accepted"] for c in out) > 3 * K


def test_greedy_unchunked(ckpt):
    prompts = _prompts([1, 2, 60, 100])
    kw = dict(enable_chunked_prefill=False, max_model_len=128)
    llm0 = LLM(ckpt[0], num_speculative_tokens=0, max_num_seqs=4, **kw)
    ref = [c.token_ids for c in llm0.generate(prompts, SamplingParams(max_tokens=GEN, ignore_eos=True))]
    for K in (1, 3):
        llm = LLM(ckpt[0], num_speculative_tokens=K, max_num_seqs=4, **kw)
        assert [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=GEN, ignore_eos=True))] == ref


@pytest.mark.exact
def test_engine_greedy_equals_full_forward_chain(ckpt):
    d, model = ckpt
    prompt = _prompts([140], seed=3)[0]
    ids = list(prompt)
    for _ in range(GEN):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    for K in (0, 1):
        (c,) = _run(d, [prompt], K, 1, prefill_limit=16)
        assert c.token_ids == ids[len(prompt):]


def _prefilled(d, prompt, limit):
    llm = LLM(d, num_speculative_tokens=1, max_num_seqs=1, max_model_len=512, prefill_limit=limit)
    eng = llm.engine
    eng.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    while not any(o.token_ids for o in eng.step()):
        pass
    return eng.runner


def test_the_engine_keeps_the_daemon_contract(ckpt):
    """`Engine` has every member the daemon reads (`dsv4.daemon.contract.ServedEngine`)."""
    from dsv4.daemon.contract import ServedEngine

    llm = LLM(ckpt[0], max_model_len=64, num_speculative_tokens=0)
    assert isinstance(llm.engine, ServedEngine) and llm.engine.max_model_len == 64


@pytest.mark.exact
def test_greedy_output_is_the_same_for_every_prefill_budget(ckpt):
    """Chunked = whole through the engine, MTP on: chunks of 16, 128 (the NPU kernel's tile)
    and the CPU default (one chunk for every prompt here) give the same tokens."""
    prompts = _prompts([300, 129, 37], seed=6)
    params = SamplingParams(max_tokens=GEN, ignore_eos=True)
    out = {}
    for limit in (16, 128, None):
        llm = LLM(ckpt[0], num_speculative_tokens=2, max_num_seqs=3, max_model_len=512,
                  **({} if limit is None else {"prefill_limit": limit}))
        assert llm.engine.config.effective_chunk_size == (limit or DEFAULT_CHUNK)
        out[limit] = [c.token_ids for c in llm.generate(prompts, params)]
    assert out[16] == out[128] == out[None]


def test_mtp_state_after_chunked_prefill_equals_whole(ckpt):
    prompt = _prompts([100], seed=4)[0]
    whole, chunked = _prefilled(ckpt[0], prompt, 128), _prefilled(ckpt[0], prompt, 16)
    assert chunked.state.mtp_lengths[0] == whole.state.mtp_lengths[0] == 100
    a, b = whole.state.snapshot(0), chunked.state.snapshot(0)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), k
    assert chunked.drafts[0] == whole.drafts[0]


@pytest.mark.parametrize("K", [1, 3])
def test_oracle_and_wrong_drafters(ckpt, K):
    d = ckpt[0]
    prompts = _prompts([37, 129], seed=5)
    n = 1 + (K + 1) * 4  # every verify step can take all K drafts
    ref_llm = LLM(d, num_speculative_tokens=0, max_num_seqs=2, max_model_len=512)
    ref = [c.token_ids for c in ref_llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]
    by_prompt = {tuple(p): r for p, r in zip(prompts, ref)}
    for oracle in (True, False):
        llm = LLM(d, num_speculative_tokens=K, max_num_seqs=2, max_model_len=512)

        def drafter(req, out_so_far, proposed, oracle=oracle):
            cont = by_prompt[tuple(req.prompt_ids)]
            i = len(out_so_far)
            truth = cont[i:i + K] + [0] * K
            return truth[:K] if oracle else [(t + 1) % 4096 for t in truth[:K]]

        llm.engine.runner.draft_override = drafter
        out = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        assert [c.token_ids for c in out] == ref
        for c in out:
            spec = c.metrics["spec"]
            if oracle:
                assert spec["drafted"] == 4 * K
                assert spec["acceptance_rate"] == 1.0 and spec["mean_acceptance_length"] == K + 1
                assert c.sources.count("draft") == 4 * K
            else:
                assert spec["drafted"] >= 4 * K
                assert spec["acceptance_rate"] == 0.0 and spec["mean_acceptance_length"] == 1.0
                assert "draft" not in c.sources


@pytest.mark.exact
def test_sampled_output_with_mtp_equals_without(tmp_path, monkeypatch):
    """Vocabulary of 8, temperature 1: with a seed every request's tokens are the same with MTP
    as without, token for token (keyed draws; this replaced a statistical test of the same
    promise), though their drafts are now keyed draws from the MTP's distribution. Unseeded
    requests go through rejection sampling against the q their drafts were drawn from (its
    distribution is tested in tests/unit/test_sampled_drafts.py); here they draft, verify and finish."""
    import dsv4.engine.spec.verify as runner_mod  # sample_verify calls verify_sampled
    write_tiny_checkpoint(tmp_path, vocab_size=8, with_tokenizer=False, seed=7)
    n = 64
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
    outs = []
    for K in (0, 1, 2):
        llm = LLM(tmp_path, num_speculative_tokens=K, max_num_seqs=8, max_model_len=64)
        out = llm.generate([[3, 5, 2, 7]] * n, params)
        if K:
            spec = [c.metrics["spec"] for c in out]
            assert sum(m["drafted"] for m in spec) > n and 0 < sum(m["accepted"] for m in spec) < sum(m["drafted"] for m in spec)
        outs.append([c.token_ids for c in out])
    assert outs[1] == outs[0] and outs[2] == outs[0]
    assert len({tuple(t) for t in outs[0]}) > n // 2  # the seeds really sample
    seen, verify = [], runner_mod.verify_sampled

    def spy(p, drafts, q, g):  # each draft was drawn from its row of q
        seen.append(q is not None and len(q) == len(drafts) and all(float(q[i, d]) > 0 for i, d in enumerate(drafts)))
        return verify(p, drafts, q, g)

    monkeypatch.setattr(runner_mod, "verify_sampled", spy)
    free = llm.generate([[3, 5, 2, 7]] * 16, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    assert all(len(c.token_ids) == 6 and all(0 <= t < 8 for t in c.token_ids) for c in free)
    assert sum(c.metrics["spec"]["drafted"] for c in free) > 0
    assert seen and all(seen)


def test_seed_reproducible_and_stop_strings(ckpt):
    d = ckpt[0]
    llm = LLM(d, num_speculative_tokens=1, max_num_seqs=4, max_model_len=512)
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=42, ignore_eos=True)
    (a,) = llm.generate(["ROMEO:"], sp)
    b = llm.generate(["ROMEO:", "JULIET:", "Hamlet"], [sp, SamplingParams(max_tokens=5, temperature=1.0, seed=1),
                                                      SamplingParams(max_tokens=7, temperature=1.0)])[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    (g,) = llm.generate(["ROMEO:"], SamplingParams(max_tokens=12, ignore_eos=True))
    text = g.text
    tok = llm.engine.tokenizer
    pieces = [tok.decode(g.token_ids[:i]) for i in range(len(g.token_ids) + 1)]
    cut = next(i for i in range(2, len(pieces)) if len(pieces[i]) > len(pieces[1]) + 2)
    boundary = len(pieces[cut - 1])  # a stop string spanning the boundary before token `cut`
    stop = text[boundary - 2:boundary + 2]
    assert len(stop) == 4
    (s,) = llm.generate(["ROMEO:"], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))
    assert s.finish_reason == "stop"
    assert s.text == text[:text.index(stop)]


def test_bad_request_fails_alone(ckpt):
    llm = LLM(ckpt[0], num_speculative_tokens=1, max_num_seqs=2, max_model_len=64)
    eng = llm.engine
    good = eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    for bad in ([], [5] * 64, [99999]):
        with pytest.raises(RequestError):
            eng.add_request(bad, SamplingParams(max_tokens=4))
    with pytest.raises(RequestError):
        eng.add_request([5], SamplingParams(max_tokens=0))
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == [good] and done[0].finish_reason == "length"


def test_profile_dir_gets_labelled_step_traces(ckpt, tmp_path):
    llm = LLM(ckpt[0], num_speculative_tokens=1, max_model_len=512, profile_dir=str(tmp_path))
    llm.generate(["ROMEO:"], SamplingParams(max_tokens=24, ignore_eos=True))
    llm.engine.close()
    traces = list(tmp_path.glob("*.json"))
    assert traces
    text = traces[0].read_text()
    assert all(f'"dsv4.{s}"' in text for s in ("dispatch", "sample_verify", "mtp"))


SEEDED = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=123,
                        ignore_eos=True)  # the embedded model's default sampling, seeded


@pytest.mark.exact
@pytest.mark.parametrize("K", [0, 1, 2, "auto"])
def test_seeded_output_is_a_function_of_prompt_params_and_seed(ckpt, K):
    """Not of K, neighbours, chunking or a tight step budget: each token is the keyed draw of
    its position (`keyed_sample`), and drafts are accepted when they equal it."""
    prompts = _prompts([6, 9, 40, 11], seed=6)
    other = SamplingParams(max_tokens=30, temperature=0.7, ignore_eos=True)
    (ref,) = LLM(ckpt[0], num_speculative_tokens=0, max_num_seqs=1, max_model_len=128).generate([prompts[0]], SEEDED)
    assert len(set(ref.token_ids)) > 5  # it really samples
    kw = dict(num_speculative_tokens=K, max_num_seqs=4, max_model_len=128)
    (alone,) = LLM(ckpt[0], **kw).generate([prompts[0]], SEEDED)
    assert alone.token_ids == ref.token_ids
    tight = LLM(ckpt[0], max_num_batched_tokens=7, prefill_limit=4, **kw)
    crowded = tight.generate(prompts, [SEEDED, other, SamplingParams(**{**SEEDED.__dict__, "seed": 5}), other])
    assert crowded[0].token_ids == ref.token_ids
    if K in (1, 2):  # drafts that are the reference's tokens are all accepted
        llm = LLM(ckpt[0], **kw)
        llm.engine.runner.draft_override = lambda req, out, d: (ref.token_ids[len(out):] + [0] * K)[:len(d)]
        (oracle,) = llm.generate([prompts[0]], SEEDED)
        assert oracle.token_ids == ref.token_ids
        spec = oracle.metrics["spec"]
        assert spec["accepted"] == spec["drafted"] > 10


def test_stop_string_cuts_tokens_and_usage(ckpt):
    d = ckpt[0]
    (g,) = LLM(d, num_speculative_tokens=0, max_model_len=512).generate(
        ["ROMEO:"], SamplingParams(max_tokens=30, ignore_eos=True))
    stop = g.text[len(g.text) // 2: len(g.text) // 2 + 3]
    outs = []
    for K in (0, 3):
        llm = LLM(d, num_speculative_tokens=K, max_model_len=512)
        llm.engine.runner.draft_override = lambda req, so_far, d: (g.token_ids[len(so_far):] + [5] * 3)[:3]
        (c,) = llm.generate(["ROMEO:"], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))
        assert c.finish_reason == "stop" and c.text == g.text[: g.text.index(stop)]
        assert c.metrics["usage"]["completion_tokens"] == len(c.token_ids)
        outs.append(c.token_ids)
    assert outs[0] == outs[1]  # the tokens after the one that completed the stop string are dropped


def test_generation_config_supplies_defaults(tmp_path):
    import json

    write_tiny_checkpoint(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.9, "top_k": 7, "repetition_penalty": 1.2, "max_new_tokens": 5}))
    llm = LLM(tmp_path, num_speculative_tokens=0, max_model_len=64)
    p = llm.engine.make_params({"max_tokens": 3})
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0.9, 7, 1.2, 3)
    g = llm.engine.make_params({"temperature": 0})  # an explicit field wins; 0 stays greedy
    assert g.greedy and g.repetition_penalty == 1.2
    assert llm.engine.default_params.temperature == 0.9
    assert SamplingParams().greedy  # an explicit SamplingParams keeps its own (greedy) defaults
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(RequestError, match="generation_config.json: temperature"):
        LLM(tmp_path, num_speculative_tokens=0, max_model_len=64)


def test_llm_chat_sends_the_rendered_conversation(ckpt):
    from dsv4.agents.prompts import chat_prompt

    llm = LLM(ckpt[0], num_speculative_tokens=0, max_model_len=512)
    msgs = [{"role": "user", "content": "ROMEO:"}, {"role": "assistant", "content": "Peace"},
            {"role": "user", "content": "JULIET:"}]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    (a,) = llm.chat(msgs, sp)
    (b,) = llm.generate([chat_prompt(llm.engine.tokenizer, msgs)], sp, prompt_mode="raw")
    assert a.token_ids == b.token_ids and len(a.token_ids) == 5
    assert len(llm.chat([msgs, msgs[:1]], sp)) == 2
