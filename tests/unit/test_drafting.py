"""`drafting.propose`: greedy rows keep the argmax, sampled rows draw from the MTP's processed
distribution q (penalties over the drafts before them included), seeded rows draw with the
keyed noise of their position, and broken logits rows fall back to a one-hot proposal."""

from __future__ import annotations

import torch

from dsv4.engine.spec.drafting import propose
from dsv4.engine.request import Request
from dsv4.engine.sampling import SamplingParams, apply_penalties, keyed_sample, logits_to_probs

V = 8


def req(**kw) -> Request:
    return Request("r", [1, 2], SamplingParams(**kw))


def processed(logits: torch.Tensor, p: SamplingParams, out: list[int]) -> torch.Tensor:
    x = apply_penalties(logits[None], [[1, 2]], [out], [p.repetition_penalty], [p.presence_penalty],
                        [p.frequency_penalty])
    t = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    return logits_to_probs(x, t(p.temperature), t(p.top_k, torch.long), t(p.top_p), t(p.min_p))[0]


def test_greedy_argmax_and_unseeded_draws_from_processed_q() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    sampled = dict(temperature=0.8, top_k=5, repetition_penalty=1.5)
    reqs = [req(), req(**sampled), req(**sampled)]
    # row 1's output holds its likeliest token outside the prompt [1, 2] (a prompt token is
    # penalised with or without the output: the comparison below would be an equality)
    top = next(int(i) for i in logits[1].argsort(descending=True) if int(i) not in (1, 2))
    outs = [[3], [top], []]
    toks, qs = propose(logits, reqs, outs, [4, 4, 3], generator=torch.Generator().manual_seed(1))
    assert toks[0] == int(logits[0].argmax()) and qs[0] is None
    for i in (1, 2):  # the history given (prompt, output, earlier drafts) is penalised
        assert torch.allclose(qs[i], processed(logits[i], reqs[i].params, outs[i]), atol=1e-6)
        assert qs[i][toks[i]] > 0
    assert qs[1][top] < processed(logits[1], reqs[1].params, [])[top]
    n = 4000  # unseeded draws follow q
    many, _ = propose(logits[1:2].expand(n, V), [reqs[1]] * n, [outs[1]] * n, [4] * n,
                      generator=torch.Generator().manual_seed(2))
    f = torch.bincount(torch.tensor(many), minlength=V).float() / n
    assert 0.5 * float((f - qs[1]).abs().sum()) < 0.05


def test_seeded_draft_is_the_keyed_draw_of_its_position() -> None:
    """With the target's own logits as the MTP's, a seeded draft is the target's keyed draw
    at that position: drafts and targets share the noise."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    r = req(temperature=1.0, top_p=0.9, seed=77)
    p = processed(logits[0], r.params, [])
    drafts = [propose(logits, [r], [[]], [pos])[0][0] for pos in range(40)]
    assert drafts == keyed_sample(p[None].expand(40, V), 77, range(40))
    assert len(set(drafts)) > 2
    assert propose(logits, [r], [[]], [5])[1] == [None]  # seeded verification does not read q


def test_nan_and_inf_logits_fall_back_to_a_one_hot_proposal() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(4))
    logits[0, 3] = float("nan")
    logits[1, 6] = float("inf")
    logits[2] = float("nan")
    logits[3, 2] = float("-inf")  # a masked logit is not broken
    reqs = [req(temperature=1.0), req(temperature=1.0, repetition_penalty=1.2), req(temperature=0.5),
            req(temperature=1.0), req(temperature=1.0, seed=3)]
    logits[4, 1] = float("nan")
    toks, qs = propose(logits, reqs, [[]] * 5, [2] * 5)
    for i in (0, 1, 4):
        finite = logits[i].masked_fill(~torch.isfinite(logits[i]), float("-inf"))
        assert toks[i] == int(finite.argmax())
    assert toks[2] == 0
    for i in (0, 1, 2):
        assert torch.equal(qs[i], torch.nn.functional.one_hot(torch.tensor(toks[i]), V).float())
    assert torch.isfinite(qs[3]).all() and qs[3][2] == 0 and abs(float(qs[3].sum()) - 1) < 1e-6


def test_greedy_draft_with_a_penalty_is_the_penalised_argmax() -> None:
    """A greedy request with a repetition penalty (`run --temperature 0` over the embedded
    model's defaults): its draft is the argmax the target's processing takes, earlier drafts
    counted, not the raw argmax."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 3.0, 2.9, 0.0, 0.0, 0.0]])  # (the prompt is [1, 2])
    r = req(temperature=0.0, repetition_penalty=1.5)
    toks, qs = propose(logits, [r], [[5, 3]], [4])  # token 3 already in the output: penalised below 2.9
    assert toks == [4] and qs == [None]
    assert propose(logits, [r], [[5]], [4])[0] == [3]  # without it in the history: the raw argmax
