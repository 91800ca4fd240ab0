"""Logprobs, prompt logprobs (echo) and logit_bias through the engine, against a full forward
of the model (tiny random fp32 checkpoint): equal with MTP K = 0 and K = 2 (an oracle
drafter, so drafts are accepted and their logprobs come from verify rows), across chunked
prefill; requests that do not ask get none."""

from __future__ import annotations

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine.sampling import processed_logprobs
from tests.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.exact
TOL = 1e-4
GEN = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-logprobs")
    return d, write_tiny_checkpoint(d)


def _prompt(n, seed=1):
    return torch.randint(3, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(d, K, chunk=16):
    return LLM(d, num_speculative_tokens=K, max_num_seqs=4, max_model_len=256, prefill_limit=chunk)


def _oracle(ref):
    """A drafter that proposes the reference continuation: every draft is accepted."""
    def draft(req, out_so_far, proposed):
        i = len(out_so_far)
        return (ref[tuple(req.prompt_ids)][i:] + [0] * len(proposed))[:len(proposed)]
    return draft


def _full_logprobs(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)  # [S, V]


def _check_top(entry, n):
    top = entry["top"]
    assert len(top) == n
    vals = [t["logprob"] for t in top]
    assert vals == sorted(vals, reverse=True)
    ids = [t["id"] for t in top]
    rank = sum(v > entry["logprob"] for v in vals)  # the chosen token's place among the top
    if rank < n:
        assert entry["id"] in ids[:rank + 1] and top[ids.index(entry["id"])]["logprob"] == entry["logprob"]
    for t in top:
        assert t["bytes"] == list(t["token"].encode()) or t["token"].startswith("bytes:")


def test_greedy_logprobs_equal_full_forward_with_and_without_mtp(ckpt):
    d, model = ckpt
    prompts = [_prompt(40), _prompt(5, seed=2)]  # 40: three chunks of 16
    params = SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=3)
    ref = _llm(d, 0).generate(prompts, params)
    by_prompt = {tuple(p): c.token_ids for p, c in zip(prompts, ref)}
    for p, c in zip(prompts, ref):
        lp = _full_logprobs(model, p + c.token_ids)
        assert [e["id"] for e in c.logprobs] == c.token_ids
        for j, e in enumerate(c.logprobs):
            row = lp[len(p) - 1 + j]
            assert abs(e["logprob"] - row[e["id"]].item()) <= TOL
            assert e["top"][0]["id"] == e["id"]  # greedy: the chosen token is the most likely
            _check_top(e, 3)
            want = row.topk(3)
            assert [t["id"] for t in e["top"]] == want.indices.tolist()
            assert max(abs(t["logprob"] - v) for t, v in zip(e["top"], want.values.tolist())) <= TOL
    llm = _llm(d, 2)
    llm.engine.runner.draft_override = _oracle(by_prompt)
    out = llm.generate(prompts, params)
    assert sum(c.metrics["spec"]["accepted"] for c in out) >= GEN  # the drafts' logprobs come from verify rows
    for a, b in zip(out, ref):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x["id"] == y["id"] and abs(x["logprob"] - y["logprob"]) <= TOL
            assert [t["id"] for t in x["top"]] == [t["id"] for t in y["top"]]


def test_sampled_logprobs_are_processed_and_independent_of_k(ckpt):
    d, model = ckpt
    prompt = _prompt(30, seed=4)
    params = SamplingParams(max_tokens=GEN, ignore_eos=True, temperature=0.7, top_k=40, top_p=0.9, seed=5,
                            logprobs=5)
    (ref,) = _llm(d, 0).generate([prompt], params)
    raw = _full_logprobs(model, prompt + ref.token_ids)  # log-softmax = logits up to a constant per row
    one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    for j, e in enumerate(ref.logprobs):
        want = processed_logprobs(raw[len(prompt) - 1 + j][None], one(0.7), one(40, torch.long), one(0.9),
                                  one(0.0))[0]
        assert abs(e["logprob"] - want[e["id"]].item()) <= TOL
        _check_top(e, 5)
        finite = [t for t in e["top"] if t["logprob"] != float("-inf")]
        assert [t["id"] for t in finite] == want.topk(len(finite)).indices.tolist()
    llm = _llm(d, 2)
    llm.engine.runner.draft_override = _oracle({tuple(prompt): ref.token_ids})
    (c,) = llm.generate([prompt], params)
    assert c.token_ids == ref.token_ids and c.metrics["spec"]["accepted"] > 0
    assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(c.logprobs, ref.logprobs)) <= TOL


def test_requests_that_do_not_ask_get_none(ckpt):
    d, _ = ckpt
    out = _llm(d, 1).generate([_prompt(10), _prompt(12, seed=3)],
                              [SamplingParams(max_tokens=4, ignore_eos=True),
                               SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)])
    assert out[0].logprobs is None and out[0].prompt_logprobs is None
    assert len(out[1].logprobs) == 4 and all(e["top"] == [] for e in out[1].logprobs)


def test_logit_bias_moves_greedy_output_and_mtp_stays_exact(ckpt):
    d, _ = ckpt
    prompt = _prompt(20, seed=6)
    base = SamplingParams(max_tokens=GEN, ignore_eos=True)
    (plain,) = _llm(d, 0).generate([prompt], base)
    first = plain.token_ids[0]
    ban = SamplingParams(max_tokens=GEN, ignore_eos=True, logit_bias={first: -100.0}, logprobs=1)
    (banned,) = _llm(d, 0).generate([prompt], ban)
    assert banned.token_ids[0] != first and first not in banned.token_ids
    assert banned.logprobs[0]["logprob"] > -1e-3 or banned.logprobs[0]["top"][0]["id"] == banned.token_ids[0]
    force = SamplingParams(max_tokens=GEN, ignore_eos=True, logit_bias={"77": 100})  # a string key, as JSON sends
    (forced,) = _llm(d, 0).generate([prompt], force)
    assert forced.token_ids == [77] * GEN
    for params, ref in ((ban, banned), (force, forced)):
        llm = _llm(d, 2)
        llm.engine.runner.draft_override = _oracle({tuple(prompt): ref.token_ids})
        (c,) = llm.generate([prompt], params)
        assert c.token_ids == ref.token_ids and c.metrics["spec"]["accepted"] > 0
        (c,) = _llm(d, 2).generate([prompt], params)  # the MTP's own drafts, biased too
        assert c.token_ids == ref.token_ids


@pytest.mark.parametrize("K", [0, 2])
def test_prompt_logprobs_equal_full_forward_across_chunks(ckpt, K):
    d, model = ckpt
    prompt = _prompt(50, seed=7)  # chunks of 16: 16 + 16 + 16 + 2
    lp = _full_logprobs(model, prompt)
    llm = _llm(d, K)
    for max_tokens in (0, 2):
        (c,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=2))
        assert len(c.token_ids) == max_tokens and c.finish_reason == "length"
        assert len(c.prompt_logprobs) == len(prompt)
        assert c.prompt_logprobs[0]["logprob"] is None and c.prompt_logprobs[0]["id"] == prompt[0]
        for j, e in enumerate(c.prompt_logprobs[1:], start=1):
            assert e["id"] == prompt[j]
            assert abs(e["logprob"] - lp[j - 1, prompt[j]].item()) <= TOL
            _check_top(e, 2)
            assert [t["id"] for t in e["top"]] == lp[j - 1].topk(2).indices.tolist()
    (one,) = llm.generate([[5]], SamplingParams(max_tokens=1, prompt_logprobs=0, logprobs=0))
    assert [(e["id"], e["logprob"], e["top"]) for e in one.prompt_logprobs] == [(5, None, [])]
    assert len(one.logprobs) == 1


def test_bad_values_are_refused(ckpt):
    from dsv4.engine.request import RequestError
    d, _ = ckpt
    llm = _llm(d, 0)
    for bad in (dict(logprobs=21), dict(logprobs=-1), dict(logprobs=True), dict(prompt_logprobs="2"),
                dict(logit_bias={5: 101}), dict(logit_bias={"x": 1}), dict(logit_bias={99999: 1}),
                dict(logit_bias=[1]), dict(max_tokens=0)):
        with pytest.raises(RequestError):
            llm.engine.add_request([1, 2, 3], SamplingParams(**bad))


def test_greedy_and_prompt_logprobs_equal_transformers(ckpt):
    """The issue's promise, against transformers' independent DeepseekV4ForCausalLM (same weights)."""
    transformers = pytest.importorskip("transformers")
    from dsv4.model.hf_compat import hf_config_dict, official_to_hf

    d, model = ckpt
    cfg = model.cfg
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**hf_config_dict(cfg))).eval()
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    missing, unexpected = hf.load_state_dict(official_to_hf(sd, cfg), strict=False)
    assert not missing and not unexpected
    prompt = _prompt(37, seed=9)
    (c,) = _llm(d, 2).generate([prompt], SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=2,
                                                        prompt_logprobs=2))
    ids = prompt + c.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].float().log_softmax(-1)
    got = [e["logprob"] for e in c.prompt_logprobs[1:]] + [e["logprob"] for e in c.logprobs]
    want = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-3
    assert c.token_ids == [int(ref[len(prompt) - 1 + j].argmax()) for j in range(GEN)]


def test_two_ranks_report_what_one_does(tiny_checkpoint):
    """--tensor-parallel-size 2: the prompt-logprob chunks get the same head rows on every rank
    (the plan says which), and biased greedy drafts are rank 0's; same tokens and logprobs."""
    prompts = [_prompt(37, seed=10), _prompt(9, seed=11)]
    params = [SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=1, logit_bias={77: 5.0})]
    outs = []
    for T in (1, 2):
        with LLM(tiny_checkpoint, tensor_parallel_size=T, num_speculative_tokens=2, max_num_seqs=2,
                 max_model_len=128, prefill_limit=16) as llm:
            outs.append(llm.generate(prompts, params))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs)) <= TOL
    pa, pb = outs[0][0].prompt_logprobs, outs[1][0].prompt_logprobs
    assert len(pa) == len(pb) == 37
    assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(pa[1:], pb[1:])) <= TOL
