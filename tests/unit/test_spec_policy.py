"""`SpecPolicy` (auto K) as a pure-Python unit: synthetic step costs and acceptance in,
the K that maximises tokens per second out."""

from __future__ import annotations

import pytest

from dsv4.engine.spec.policy import CostTable, SpecPolicy

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
    t.observe(4, 6.0)  # right after count 1, a contrast: the shape at 4 averages with it, the level stays
    assert t.shape[4] == pytest.approx(5.0) and t.level == 1.0 and t.points[4] == pytest.approx(5.0)
    for _ in range(40):
        t.observe(1, 1.0)
        t.observe(4, 6.0)
    assert t.shape[4] / t.shape[1] == pytest.approx(6.0, rel=0.02)  # then moving averages


def test_one_count_moves_every_estimate():
    # calibrated at 1, 2 and 4; serving runs 25% slower and only ever at count 2
    t = CostTable()
    for n, s in ((1, 6.0), (2, 8.0), (4, 12.0)):
        t.calibrate(n, s * MS)
    for _ in range(50):
        t.observe(2, 10.0 * MS)
    assert t.level == pytest.approx(1.25)
    assert t(1) == pytest.approx(7.5 * MS) and t(4) == pytest.approx(15.0 * MS)  # not left at calibration
    assert t.shape == {1: 6.0 * MS, 2: 8.0 * MS, 4: 12.0 * MS}  # no contrast: the shape is kept


def test_contrasts_correct_the_shape_and_not_drift():
    # calibration says a 2-token verify costs 1.2x a 1-token one; serving shows 1.5x
    t = CostTable()
    t.calibrate(1, 6.0 * MS)
    t.calibrate(2, 7.2 * MS)
    for rep in range(30):  # alternating runs of 8 observations at 1 (6 ms) and at 2 (9 ms)
        for n, s in ((1, 6.0), (2, 9.0)):
            for _ in range(8):
                t.observe(n, s * MS)
    assert t(2) / t(1) == pytest.approx(1.5, rel=0.03)
    # the machine then gets 30% slower while only count 2 runs: the level follows, the shape stays
    shape = dict(t.shape)
    for _ in range(100):
        t.observe(2, 9.0 * 1.3 * MS)
    assert t(2) == pytest.approx(9.0 * 1.3 * MS, rel=0.01)
    assert t(2) / t(1) == pytest.approx(1.5, rel=0.03)
    assert t.shape[2] == pytest.approx(shape[2], rel=0.02)


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


def test_stale_costs_do_not_make_auto_flap():
    # CPU-like: K = 1 pays 5% over K = 0. Calibrated at level 1, serving runs at level 1.4 and
    # times only the K in use: the K not in use must not look cheaper for being stale.
    verify, draft = (lambda n: 6 * MS * (1 + 0.35 * (n - 1))), (lambda n: 1.0 * MS)
    p = SpecPolicy(3, prior=(0.7, 0.5, 0.45), prior_weight=1e6, probe_interval=10**9, first_probe=10**9)
    for n in (1, 2, 4, 8):
        p.verify.calibrate(n, verify(n))
        p.draft.calibrate(n, draft(n))
    ks = []
    for _ in range(200):
        k = p.choose(1)
        ks.append(k)
        p.verify.observe(1 + k, 1.4 * verify(1 + k))
        if k:
            p.draft.observe(1, 1.4 * draft(1))
    assert p.throughput(1, 1) > 1.03 * p.throughput(1, 0)
    assert set(ks) == {1}


def test_a_calibration_that_undercounts_tokens_is_corrected_by_probes():
    # the calibration sees half the cost of each extra verified token (identical tokens route
    # to the same experts), serving runs at 1.4x its level: per-count averages flapped to
    # K = 2, 3 and 0 here; now K stays at the best, 1, but for the probes, which teach the shape
    cal, draft = (lambda n: 6 * MS * (1 + 0.175 * (n - 1))), (lambda n: 1.0 * MS)
    serve = lambda n: 1.4 * 6 * MS * (1 + 0.35 * (n - 1))  # noqa: E731
    p = SpecPolicy(3, prior=(0.7, 0.5, 0.45), prior_weight=1e6, first_probe=16, probe_interval=64, probe_steps=4)
    for n in (1, 2, 4, 8):
        p.verify.calibrate(n, cal(n))
        p.draft.calibrate(n, draft(n))
    ks, prev = [], p.k
    for _ in range(300):
        k = p.choose(1)
        ks.append(k)
        p.verify.observe(1 + prev, serve(1 + prev))  # a step verifies the drafts of the step before
        if k:
            p.draft.observe(1, 1.4 * draft(1))
        prev = k
    probes = [i for i, k in enumerate(ks) if k != 1]
    assert len(probes) == 4 * 5 and probes[:4] == [15, 16, 17, 18] and set(ks) == {0, 1, 2}
    assert p.verify(2) / p.verify(1) == pytest.approx(1.35, rel=0.02)  # learned from the probes' contrasts
    assert p.verify(3) / p.verify(2) == pytest.approx(1.7 / 1.35, rel=0.05)


def test_catch_up_is_amortised_when_drafting_restarts():
    # K = 1 is 4% better per step, but restarting it first catches the MTP up over 128 pairs
    p = _policy(lambda n: 6 * MS * (1 + 0.45 * (n - 1)), lambda n: 0.5 * MS * (1 + n / 16), (0.6,), max_k=1,
                probe_interval=10**9, first_probe=10**9)
    p.k = 0
    assert p.throughput(1, 1) > 1.03 * p.throughput(1, 0)
    p.backlog_rows = 128  # 4.5 ms of MTP catch-up, over 32 steps: gone
    assert p.choose(1) == 0
    p.backlog_rows = 4
    assert p.choose(1) == 1


def test_probes_the_neighbours_after_a_long_run():
    # the first probe comes early (a fresh engine learns its costs), then every probe_interval steps
    p = _policy(lambda n: 6 * MS * (1 + 0.3 * (n - 1)), lambda n: 0.5 * MS, (0.7, 0.5, 0.45),
                probe_interval=10, probe_steps=2, first_probe=4)
    ks = [p.choose(1) for _ in range(19)]
    best = ks[0]
    assert 0 < best < 3 and ks == [best] * 3 + [best - 1] * 2 + [best] * 8 + [best + 1] * 2 + [best] * 4
    assert p.k == best


def test_probes_k1_after_a_long_run_at_zero():
    p = _policy(lambda n: 6 * MS * n, lambda n: 1 * MS, (0.5,), max_k=1, probe_interval=10, probe_steps=3,
                first_probe=10)
    ks = [p.choose(1) for _ in range(30)]
    assert ks[:9] == [0] * 9 and ks[9:12] == [1, 1, 1] and ks[12:19] == [0] * 7 and ks[19:22] == [1, 1, 1]
    assert p.k == 0  # probing does not change the K the policy believes in


def test_no_mtp_or_no_costs():
    assert SpecPolicy(0).choose(4) == 0
    p = SpecPolicy(3)
    assert p.choose(4) == p.k == 1  # nothing timed yet: the prior K
    with pytest.raises(ValueError):
        SpecPolicy(-1)


def test_host_work_per_row_counts_against_drafting():
    # dispatches alone: K = 1 pays 8% (6 ms a token, +35% for a second; acceptance 0.6);
    # choosing each row's token costs 0.5 ms and proposing a draft 0.8 ms (sampled requests)
    verify, draft = (lambda n: 6 * MS * (1 + 0.35 * (n - 1))), (lambda n: 1.0 * MS)
    p = _policy(verify, draft, (0.6,), max_k=1)
    assert p.throughput(1, 1) > 1.05 * p.throughput(1, 0) and p.choose(1) == 1
    for n in range(1, 65):
        p.verify_host.observe(n, 0.5 * MS * n)
    p.draft_host.observe(1, 0.8 * MS)
    assert p.step_cost(1, 1) == pytest.approx(verify(2) + 1.0 * MS + 1.0 * MS + 0.8 * MS)
    assert p.throughput(1, 0) > 1.03 * p.throughput(1, 1) and p.choose(1) == 0


def test_greedy_and_sampled_drafts_keep_their_own_acceptance():
    # sampled drafts are accepted far more often here; greedy requests must not drag the
    # estimate for sampled ones down (nor the other way round), and a mix averages the two
    p = _policy(lambda n: 6 * MS * (1 + 0.35 * (n - 1)), lambda n: 1.0 * MS, (0.6,), max_k=1, hysteresis=0.0)
    p._tried, p._accepted = [4.0], [4 * 0.6]
    p._tried_s, p._accepted_s = [4.0], [4 * 0.6]
    for _ in range(400):
        p.observe_verify(1, 0)  # greedy: always rejected
        p.observe_verify(1, 1, sampled=True)  # sampled: always accepted
    assert p.acceptance_of(False)[0] < 0.05 and p.acceptance_of(True)[0] > 0.95
    assert p.choose(1) == 0 and p.choose(1, sampled=1) == 1
    assert p.choose(4, sampled=2) is not None and p.acceptance[0] == pytest.approx(0.5, abs=0.05)
    assert p.expected_tokens(1) == pytest.approx(1.5, abs=0.05)


def test_a_few_early_rejections_do_not_end_drafting_but_a_request_s_worth_does():
    # K = 1 pays 11% at the sampled prior's 0.69. A fresh engine's first eight sampled drafts
    # accept two (a request's acceptance swings 0.55-0.88 over 64 tokens): with the prior
    # weighed as 16 drafts it keeps drafting; at 4 it fell to 0.40 and stopped for good
    # (at K = 0 nothing measures acceptance until a probe). Forty drafts at 0.3 outweigh it.
    p = SpecPolicy(1, probe_interval=10**9, first_probe=10**9)
    for n in (1, 2, 4):
        p.verify.calibrate(n, 6 * MS * (1 + 0.35 * (n - 1)))
        p.draft.calibrate(n, 1.0 * MS)
    assert p.acceptance_of(True)[0] == pytest.approx(0.69) and p.acceptance_of(False)[0] == pytest.approx(0.64)
    assert p.choose(1, sampled=1) == 1
    for a in (0, 1, 0, 0, 1, 0, 0, 0):
        p.observe_verify(1, a, sampled=True)
        assert p.choose(1, sampled=1) == 1
    for i in range(40):
        p.observe_verify(1, int(i % 10 < 3), sampled=True)
    assert p.acceptance_of(True)[0] < 0.45 and p.choose(1, sampled=1) == 0
    assert p.acceptance_of(False)[0] == pytest.approx(0.64)  # greedy drafts' figure is untouched


def test_probes_back_off_while_they_find_the_probed_k_far_below() -> None:
    # K = 1 at 0.69x of K = 0: the first probe's finding may be noise, the second doubles the
    # wait, and so on up to 2 ** max_backoff; a probe that finds it close brings the wait back
    p = _policy(lambda n: 6 * MS * n, lambda n: 1 * MS, (0.5,), max_k=1, probe_interval=10, probe_steps=3,
                first_probe=10, max_backoff=2)
    ks = [p.choose(1) for _ in range(300)]
    starts = [i for i, k in enumerate(ks) if k == 1 and (i == 0 or ks[i - 1] == 0)]
    assert [b - a for a, b in zip(starts, starts[1:])][:6] == [10, 20, 40, 40, 40, 40]
    p.verify.calibrate(2, 9 * MS)  # K = 1 now at 0.9x of K = 0 (an undercounting calibration, say)
    assert p.throughput(1, 1) / p.throughput(1, 0) == pytest.approx(0.9)
    ks = [p.choose(1) for _ in range(200)]
    starts = [i for i, k in enumerate(ks) if k == 1 and (i == 0 or ks[i - 1] == 0)]
    assert [b - a for a, b in zip(starts, starts[1:])][1:8] == [10] * 7  # every probe_interval steps again
    assert p.k == 0
    for _ in range(3 * 40):  # far below again: back to waiting 40 steps
        p.verify.calibrate(2, 20 * MS)
        p.choose(1)
    p.verify.calibrate(2, 6.2 * MS)  # now K = 1 is the best: its neighbour K = 0 is probed 10 steps on
    ks = [p.choose(1) for _ in range(12)]
    assert ks[0] == 1 and p.k == 1 and 0 in ks[9:12]


def test_choices_reuse_their_rates_until_something_they_depend_on_moves() -> None:
    p = _policy(lambda n: 6 * MS * n, lambda n: 1 * MS, (0.5,), max_k=1, refresh=16,
                probe_interval=10**9, first_probe=10**9)
    for _ in range(4):  # past the helper's other counts: these are level steps, not contrasts
        p.verify.observe(1, 6 * MS)
    assert p.choose(1) == 0
    calls = 0
    throughput = p.throughput

    def counted(*a, **kw):
        nonlocal calls
        calls += 1
        return throughput(*a, **kw)
    p.throughput = counted
    for _ in range(32):
        p.verify.observe(1, 6 * MS)  # the level moves: not a reason to compute again
        assert p.choose(1) == 0
    assert calls == 2 * 2  # twice (every 16 choices), for K = 0 and 1
    for change in (lambda: p.choose(2), lambda: p.observe_verify(1, 1), lambda: p.verify.observe(100, 600 * MS),
                   lambda: setattr(p, "backlog_rows", 128)):
        before = calls
        change()
        p.choose(1)
        assert calls > before
