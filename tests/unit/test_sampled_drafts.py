"""Rejection sampling of drafts drawn from the drafter's own distribution q (`verify_sampled`
with q): the emitted tokens keep the target's distribution on a small vocabulary for K = 1..3,
including q and p with zeros, q zero outside a draft vocabulary, one-hot q, top-k 1 and near-zero temperature targets; a q that
cannot have produced its draft (no mass there, NaN, inf, negative) is read as one-hot.

Each distribution case runs 2000 speculative generations of two tokens (about 0.3 s)."""

from __future__ import annotations

import bisect
import math
import random

import pytest
import torch

from dsv4.engine.sampling import logits_to_probs, verify_sampled
from tests.unit.test_sampling import make_generator, tv


def _toy_tables(v: int, k: int, seed: int, p_kw: dict, q_kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy target P and drafter Q: the next-token distribution at output position `pos` after
    token `last` is P[pos, last] (Q[pos, last]), each from random logits through
    `logits_to_probs` with the given parameters (top-k 1, near-zero temperature, top-p ... make
    rows with zeros and one-hot rows). The drafter's logits are the target's plus noise, as an
    MTP's approximate its model's."""
    g = torch.Generator().manual_seed(seed)
    x = 1.5 * torch.randn((k + 2) * v, v, generator=g)

    def table(x: torch.Tensor, kw: dict) -> torch.Tensor:
        if "vocab" in kw:  # a draft vocabulary: the drafter's logits are -inf outside it
            x = torch.full_like(x, float("-inf")).index_copy(1, torch.tensor(kw["vocab"]), x[:, kw["vocab"]])
        n = x.shape[0]
        t = lambda name, dflt, dt=torch.float32: torch.full((n,), kw.get(name, dflt), dtype=dt)  # noqa: E731
        return logits_to_probs(x, t("temperature", 1.0), t("top_k", 0, torch.long), t("top_p", 1.0),
                               t("min_p", 0.0)).view(k + 2, v, v)

    return table(x, p_kw), table(x + torch.randn(x.shape, generator=g), q_kw)


def _speculate_two(P: torch.Tensor, Q: torch.Tensor, k: int, n: int, seed: int, q_seen: torch.Tensor | None = None):
    """n runs of speculative decoding until two tokens are out: drafts d_j ~ Q[pos + j, previous],
    verified against the target rows P[pos, last], P[pos + 1, d_1], ... (the target's row after
    each draft). Returns counts of the first token [V], of the pair [V, V] and first-draft acceptances.
    `q_seen`: the table verification is told (default Q; another one is a wrong q)."""

    v = P.shape[-1]
    q_seen = Q if q_seen is None else q_seen
    cdf = [[(torch.cumsum(Q[i, j].double(), 0) / Q[i, j].double().sum()).tolist() for j in range(v)]
           for i in range(Q.shape[0])]
    last_nz = [[int(torch.nonzero(Q[i, j])[-1]) for j in range(v)] for i in range(Q.shape[0])]
    rng, g = random.Random(seed), make_generator(seed)
    first, pair, acc1 = torch.zeros(v), torch.zeros(v, v), 0
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            pos, last = len(out), (out[-1] if out else 0)  # token 0 stands for the prompt
            drafts, prev = [], last
            for j in range(k):
                d = bisect.bisect_right(cdf[pos + j][prev], rng.random())
                prev = min(d, last_nz[pos + j][prev])
                drafts.append(prev)
            pos_idx = torch.arange(pos, pos + k + 1)
            p = P[pos_idx, torch.tensor([last] + drafts)]
            q = q_seen[pos_idx[:k], torch.tensor([last] + drafts[:-1])]
            a, toks = verify_sampled(p, drafts, q, g)
            assert len(toks) == a + 1 and toks[:a] == drafts[:a]
            if not out:
                acc1 += a > 0
            out += toks
        first[out[0]] += 1
        pair[out[0], out[1]] += 1
    return first, pair, acc1


def _tv_bound(p: torch.Tensor, n: int, delta: float = 1e-4) -> float:
    """A bound the empirical TV of n draws from p stays under with probability >= 1 - delta:
    E[TV] <= 0.5 * sum_i sqrt(p_i (1 - p_i) / n), and TV moves by at most 1/n per draw, so
    P(TV > E[TV] + t) <= exp(-2 n t^2) (McDiarmid)."""
    p = p.flatten().double()
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / delta) / (2 * n))


SAMPLED_DRAFT_CASES = {  # name: (K, target parameters, drafter parameters)
    "q-zero-where-p-has-mass": (1, dict(temperature=1.0), dict(temperature=1.3, top_p=0.8)),
    "p-zero-where-q-has-mass": (2, dict(top_k=3), dict(temperature=0.8)),
    "top-k-1-target": (3, dict(top_k=1), dict(min_p=0.1)),
    "near-zero-temperature-target": (2, dict(temperature=1e-5), dict(temperature=1.0)),
    "one-hot-q": (1, dict(temperature=0.7), dict(top_k=1)),
    # q zero outside a draft vocabulary (--draft-vocab), where p has mass: K = 1..3
    "draft-vocabulary-k1": (1, dict(temperature=0.8, top_p=0.95), dict(temperature=0.8, top_p=0.95, vocab=[0, 2, 3, 5])),
    "draft-vocabulary-k3": (3, dict(temperature=1.0), dict(temperature=1.0, vocab=[1, 4, 6])),
}


@pytest.mark.parametrize("case", list(SAMPLED_DRAFT_CASES))
def test_rejection_sampling_with_sampled_drafts_keeps_the_target_distribution(case) -> None:
    """Drafts drawn from the drafter's own processed distribution q and verified with it: the
    first emitted token and the first two (over one or two steps) are distributed as the target
    samples them without speculation (TV under `_tv_bound`), and the first draft is accepted
    with probability sum_x min(p(x), q(x)) (a verifier that ignored q would get sum_x p(x) q(x))."""
    k, p_kw, q_kw = SAMPLED_DRAFT_CASES[case]
    v, n = 7, 2000
    P, Q = _toy_tables(v, k, seed=len(case), p_kw=p_kw, q_kw=q_kw)
    first, pair, acc1 = _speculate_two(P, Q, k, n, seed=3)
    p0 = P[0, 0]
    joint = p0[:, None] * P[1]  # P(t0, t1) = p0(t0) P[1, t0](t1)
    assert tv(first / n, p0) < _tv_bound(p0, n)
    assert tv(pair / n, joint) < _tv_bound(joint, n)
    a = 1 - tv(p0, Q[0, 0])
    assert abs(acc1 / n - a) < 4 * math.sqrt(max(a * (1 - a), 1e-4) / n) + 1e-3


def test_the_distribution_test_sees_a_wrong_q() -> None:
    """The same check fails when verification is told another q than the drafts came from."""
    k, v, n = 1, 7, 2000
    P, Q = _toy_tables(v, k, seed=11, p_kw={}, q_kw=dict(top_k=2))
    uniform = torch.full_like(Q, 1.0 / v)
    first, _, _ = _speculate_two(P, Q, k, n, seed=4, q_seen=uniform)
    assert tv(first / n, P[0, 0]) > 2 * _tv_bound(P[0, 0], n)


def test_verify_sampled_reads_an_impossible_q_row_as_one_hot() -> None:
    """A q row with no mass at its draft, NaN, inf or negative entries never divides by zero
    or crashes: it is verified as a deterministic proposal (one-hot q), draw for draw."""
    p = torch.softmax(torch.randn(3, 6, generator=make_generator(2)), -1)
    q = torch.softmax(torch.randn(2, 6, generator=make_generator(3)), -1)
    drafts = [2, 4]
    one_hot = torch.zeros(2, 6)
    one_hot[0, 2] = one_hot[1, 4] = 1.0
    for row, col, value in ((0, 2, 0.0), (1, 0, float("nan")), (0, 5, float("inf")), (1, 1, -0.5)):
        bad = q.clone()
        bad[row, col] = value
        fixed = q.clone()
        fixed[row] = one_hot[row]
        for s in range(30):
            want = verify_sampled(p, drafts, fixed, make_generator(s))
            assert verify_sampled(p, drafts, bad, make_generator(s)) == want
    zero = torch.zeros(2, 6)  # every row impossible: the greedy drafter's verification
    for s in range(30):
        assert verify_sampled(p, drafts, zero, make_generator(s)) == verify_sampled(p, drafts, None, make_generator(s))


def test_verify_sampled_degenerate_p_and_q() -> None:
    """p one-hot at a token q never proposes, the draft where p has no mass: always rejected,
    and the residual max(p - q, 0) is p's token."""
    p = torch.zeros(2, 6)
    p[0, 3] = p[1, 0] = 1.0
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    for s in range(20):
        assert verify_sampled(p, [1], q, make_generator(s)) == (0, [3])
    q = torch.zeros(1, 6)
    q[0, 3] = 1.0  # p == q, both one-hot: always accepted, then the bonus
    assert verify_sampled(p, [3], q, make_generator(0)) == (1, [3, 0])
