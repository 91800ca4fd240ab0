"""`SpecPolicy` (auto K) as a pure-Python unit: synthetic step costs and acceptance in,
the K that maximises tokens per second out."""

from __future__ import annotations

import pytest

from dsv4.engine.spec_policy import CostTable, SpecPolicy

MS = 1e-3


def _policy(verify, draft, acceptance, max_k=3, **kw) -> SpecPolicy:
    """A policy whose cost tables hold `verify(T)` for T = 1..64 and `draft(rows)` for
    rows = 1..64, and whose acceptance estimate is `acceptance` per depth (strong prior)."""
    p = SpecPolicy(max_k, prior=acceptance, prior_weight=1e6, **kw)
    for n in range(1, 65):
        p.verify.observe(n, verify(n))
        p.draft.observe(n, draft(n))
    return p


def _best(p: SpecPolicy, batch: int) -> int:
    rates = [p.throughput(batch, k) for k in range(p.max_k + 1)]
    return max(range(len(rates)), key=rates.__getitem__)


def test_cost_table_interpolates_and_extrapolates():
    t = CostTable()
    assert t(3) == 0.0  # nothing measured yet
    t.observe(1, 1.0)
    assert t(2) == 2.0  # one point: proportional
    t.observe(4, 4.0)
    assert t(1) == 1.0 and t(2.5) == pytest.approx(2.5) and t(8) == pytest.approx(8.0) and t(0) == 0.0
    t.observe(4, 6.0)  # a moving average, not a replacement
    assert t.points[4] == pytest.approx(4.2)


def test_cpu_like_costs_choose_no_drafts():
    # a CPU: every extra verified token costs half a step, the MTP dispatch 1.3 ms
    p = _policy(lambda n: 6 * MS * (1 + 0.5 * (n - 1)), lambda n: 1.3 * MS, (0.64, 0.5, 0.45))
    assert p.choose(1) == 0 and p.k == 0
    assert p.throughput(1, 0) > p.throughput(1, 1)


def test_launch_bound_costs_choose_deep_drafts():
    # a GPU at small batch: verify costs the same for up to 32 tokens, cheap drafts
    p = _policy(lambda n: 6 * MS if n <= 32 else 6 * MS * n / 32, lambda n: 0.3 * MS, (0.8, 0.7, 0.6))
    assert p.choose(1) == 3
    assert p.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.8 * 0.7 + 0.8 * 0.7 * 0.6)


def test_k_follows_the_batch_size():
    # free up to 8 tokens, then every token costs: speculate alone, not in a full batch
    p = _policy(lambda n: 6 * MS * max(1.0, n / 8), lambda n: 0.2 * MS, (0.7, 0.6, 0.5))
    assert p.choose(1) == 3
    assert p.choose(8) == 0
    assert p.choose(2) == 3  # back when the load falls


def test_acceptance_is_learned_from_verified_drafts():
    p = _policy(lambda n: 6 * MS if n <= 32 else 6 * MS * n / 32, lambda n: 0.3 * MS, (0.8, 0.7, 0.6),
                hysteresis=0.0)
    p._tried, p._accepted = [2.0] * 3, [2 * 0.8, 2 * 0.7, 2 * 0.6]  # a weak prior
    assert p.choose(1) == 3
    for _ in range(500):  # the drafter is always wrong
        p.observe_verify(3, 0)
    assert p.acceptance[0] < 0.05
    assert p.acceptance[1:] == pytest.approx([0.7, 0.6])  # depth 2 and 3 were never reached
    assert p.choose(1) == 0
    for _ in range(500):  # now it is always right
        p.observe_verify(3, 3)
    assert min(p.acceptance) > 0.9 and p.choose(1) == 3


def test_hysteresis_keeps_the_current_k_on_near_ties():
    # K = 1 about 1% better than K = 0: not enough to move off 0
    base = lambda n: 6 * MS * (1 + 0.6 * (n - 1))  # noqa: E731
    p = _policy(base, lambda n: 0.05 * MS, (0.62,), max_k=1, hysteresis=0.03)
    r0, r1 = p.throughput(1, 0), p.throughput(1, 1)
    assert 1.0 < r1 / r0 < 1.03
    p.k = 0
    assert p.choose(1) == 0
    p.k = 1
    assert p.choose(1) == 1


def test_probes_k1_after_a_long_run_at_zero():
    p = _policy(lambda n: 6 * MS * n, lambda n: 1 * MS, (0.5,), max_k=1, probe_interval=10, probe_steps=3)
    ks = [p.choose(1) for _ in range(30)]
    assert ks[:9] == [0] * 9 and ks[9:12] == [1, 1, 1] and ks[12:19] == [0] * 7 and ks[19:22] == [1, 1, 1]
    assert p.k == 0  # probing does not change the K the policy believes in


def test_no_mtp_or_no_costs():
    assert SpecPolicy(0).choose(4) == 0
    p = SpecPolicy(3)
    assert p.choose(4) == p.k == 1  # nothing timed yet: the prior K
    with pytest.raises(ValueError):
        SpecPolicy(-1)
