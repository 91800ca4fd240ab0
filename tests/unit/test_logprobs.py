"""The engine's logprob pieces (dsv4/engine/logprobs.py, sampling.processed_logprobs and
adjust_logits, Tokenizer.token_bytes) on small tensors."""

from __future__ import annotations

import torch

from dsv4.engine.logprobs import TokenTexts, gather, token_text
from dsv4.engine.sampling import SamplingParams, adjust_logits, logits_to_probs, processed_logprobs
from dsv4.engine.tokenizer import Tokenizer
from tests.checkpoints import TOKENIZER_DIR


def test_processed_logprobs_are_the_log_of_the_sampling_distribution():
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    t = torch.tensor([0.7, 1.0, 0.0, 1.3])
    k, p, m = torch.tensor([10, 0, 5, 0]), torch.tensor([1.0, 0.8, 1.0, 0.9]), torch.tensor([0.0, 0.0, 0.0, 0.05])
    lp = processed_logprobs(x, t, k, p, m)
    probs = logits_to_probs(x, t, k, p, m)
    sampled = [0, 1, 3]
    assert torch.allclose(lp[sampled].exp(), probs[sampled], atol=1e-6)
    assert torch.equal(torch.isinf(lp[sampled]), probs[sampled] == 0)
    assert torch.allclose(lp[2], x[2].log_softmax(-1))  # greedy: unmasked, temperature 1
    assert torch.allclose(processed_logprobs(x[2:3], t[2:3], k[2:3], p[2:3], m[2:3]), lp[2:3])


def test_gather_takes_the_token_and_the_top_sorted():
    lp = torch.tensor([[-1.0, -0.5, -3.0, float("-inf")], [-2.0, -0.1, -9.0, -4.0]])
    a, b = gather(lp, [2, 3], [2, 0])
    assert (a.token_id, a.logprob, a.top) == (2, -3.0, [(1, -0.5), (0, -1.0)])
    assert (b.token_id, b.logprob, b.top) == (3, -4.0, [])
    assert gather(lp[:0], [], []) == []


def test_logit_bias_comes_before_penalties():
    x = torch.tensor([[2.0, -1.0, 0.5]])
    params = [SamplingParams(logit_bias={"0": 2.0, 2: -1.0}, repetition_penalty=2.0)]
    assert params[0].logit_bias == {0: 2.0, 2: -1.0}  # string keys (JSON, msgpack) become ids
    got = adjust_logits(x, params, [[0, 2]], [[]])
    assert torch.allclose(got, torch.tensor([[2.0, -1.0, -1.0]]))  # (2 + 2) / 2, -1, (0.5 - 1) * 2
    assert adjust_logits(x, [SamplingParams()], [[0]], [[]]) is x  # nothing to do: no copy


def test_token_texts_and_bytes():
    tok = Tokenizer.from_dir(TOKENIZER_DIR)
    text = "Hello wörld ☃ end"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text == tok.decode(ids)
    names = TokenTexts(tok)
    pieces = [names.get(i)[0] for i in ids]
    assert any(p.startswith("bytes:\\x") for p in pieces)  # the snowman's bytes come in pieces
    assert token_text(b"\xe2\x98") == "bytes:\\xe2\\x98" and token_text("☃".encode()) == "☃"
    assert TokenTexts(None).get(5) == ("", [])
