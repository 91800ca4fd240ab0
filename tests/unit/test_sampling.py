"""Sampling: masks, greedy rows, per-request seeded reproducibility, speculative verification.

The distribution tests draw N = 20000 samples on V = 6 tokens. For multinomial frequencies
f, E|f_i - p_i| <= sqrt(p_i (1 - p_i) / N), so E[TV] <= 0.5 * sum_i sqrt(p_i (1 - p_i) / N)
<= 0.5 * sqrt(V - 1) / sqrt(N) ~ 0.008 (Cauchy-Schwarz); its standard deviation is smaller
still, so 0.02 leaves several sigma of room, while the wrong answer (the draft
distribution) is at TV >= 0.3 from the target: the bound separates them clearly.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.engine.request import RequestError
from dsv4.engine.sampling import (
    SamplingParams,
    draw_key,
    keyed_sample,
    logits_to_probs,
    sample,
    verify_greedy,
    verify_sampled,
)

N_SAMPLES = 20000
TV_BOUND = 0.02


def probs_for(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    x = torch.tensor([logits], dtype=torch.float32)
    t = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    return logits_to_probs(x, t(temperature), t(top_k, torch.long), t(top_p), t(min_p))[0]


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


# ------------------------------------------------------------------ params
def test_params_validate() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3, stop=["\n"], stop_token_ids=[2]).validate()
    bad = [
        dict(max_tokens=0), dict(max_tokens=1.5), dict(max_tokens=True), dict(temperature=-0.1),
        dict(temperature=float("nan")), dict(temperature="1"), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
        dict(min_p=-0.1), dict(min_p=2), dict(seed=-1), dict(seed=2**64), dict(seed="1"), dict(stop="x"),
        dict(stop=[""]), dict(stop=[3]), dict(stop_token_ids=[-1]), dict(stop_token_ids=["a"]),
        dict(ignore_eos=1), dict(speculative="no"),
    ]
    for kw in bad:
        with pytest.raises(RequestError) as e:
            SamplingParams(**kw).validate()
        assert "\n" not in str(e.value) and next(iter(kw)).split("_")[0] in str(e.value), kw
    with pytest.raises(RequestError, match="vocabulary"):
        SamplingParams(stop_token_ids=[100]).validate(vocab_size=50)


def test_params_from_dict() -> None:
    p = SamplingParams.from_dict({"max_tokens": 5, "temperature": 0.5, "stop": ["a"]})
    assert p.max_tokens == 5 and p.stop == ["a"]
    with pytest.raises(RequestError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"max_tokenz": 5})
    with pytest.raises(RequestError):
        SamplingParams.from_dict([1, 2])


# ------------------------------------------------------------------ logits -> probs
def test_temperature_zero_is_one_hot() -> None:
    p = probs_for([0.1, 3.0, 2.9, -1.0], temperature=0.0, top_k=1, top_p=0.1)
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_plain_softmax_with_temperature() -> None:
    logits = [1.0, 2.0, 0.5, -1.0]
    p = probs_for(logits, temperature=0.5)
    assert torch.allclose(p, torch.softmax(torch.tensor(logits) / 0.5, -1), atol=1e-6)


def test_top_k_mask() -> None:
    p = probs_for([1.0, 4.0, 3.0, 2.0, 0.0], top_k=2)
    assert (p > 0).tolist() == [False, True, True, False, False]
    assert torch.allclose(p[[1, 2]], torch.softmax(torch.tensor([4.0, 3.0]), -1))
    assert (probs_for([1.0, 4.0, 3.0], top_k=10) > 0).all()  # k >= V: off


def test_top_p_mask() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert (probs_for(logits, top_p=0.45) > 0).tolist() == [True, False, False, False]  # 0.5 covers 0.45
    assert (probs_for(logits, top_p=0.6) > 0).tolist() == [True, True, False, False]
    assert (probs_for(logits, top_p=0.81) > 0).tolist() == [True, True, True, False]
    p = probs_for(logits, top_p=0.6)
    assert torch.allclose(p[:2], torch.tensor([0.625, 0.375]), atol=1e-6)
    assert (probs_for(logits, top_p=1e-6) > 0).sum() == 1  # the top token always stays


def test_min_p_mask() -> None:
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist()
    assert (probs_for(logits, min_p=0.5) > 0).tolist() == [True, True, True, False]  # 0.2 >= 0.5*0.4
    assert (probs_for(logits, min_p=0.8) > 0).tolist() == [True, False, False, False]


def test_batched_rows_are_independent() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.0, 1.0, 0.7])
    k = torch.tensor([0, 3, 0])
    tp = torch.tensor([1.0, 1.0, 0.8])
    mp = torch.tensor([0.0, 0.0, 0.05])
    p = logits_to_probs(logits, t, k, tp, mp)
    assert torch.allclose(p.sum(-1), torch.ones(3))
    for i in range(3):
        row = logits_to_probs(logits[i : i + 1], t[i : i + 1], k[i : i + 1], tp[i : i + 1], mp[i : i + 1])[0]
        assert torch.allclose(p[i], row)


# ------------------------------------------------------------------ sampling
def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_keyed_draws_depend_only_on_seed_and_position() -> None:
    """A seeded row's token is a function of its probabilities, seed and position: the same
    alone, among other rows, in another order of positions; other seeds or positions differ."""
    v = 50
    probs = torch.softmax(torch.randn(1, v, generator=make_generator(1)), -1)
    alone = [keyed_sample(probs, 1234, [n])[0] for n in range(40)]
    assert len(set(alone)) > 3  # it really samples
    assert keyed_sample(probs.expand(40, v), 1234, range(40)) == alone
    order = list(range(39, -1, -1))
    assert keyed_sample(probs.expand(40, v), 1234, order) == alone[::-1]
    assert keyed_sample(probs.expand(40, v), 1235, range(40)) != alone
    keys = {draw_key(s, n) for s in range(50) for n in range(200)}
    assert len(keys) == 50 * 200 and all(0 <= k < 2**63 for k in keys)


def test_keyed_draws_follow_the_distribution_and_respect_zeros() -> None:
    p = P0.expand(N_SAMPLES, -1)
    f = torch.bincount(torch.tensor(keyed_sample(p, 7, range(N_SAMPLES))), minlength=P0.numel()).float()
    assert tv(f / f.sum(), P0) < TV_BOUND
    masked = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]]).expand(2000, -1)
    assert set(keyed_sample(masked, 3, range(2000))) == {1, 3}
    one_hot = torch.zeros(3, 6)
    one_hot[0, 4] = one_hot[1, 0] = one_hot[2, 5] = 1.0
    assert keyed_sample(one_hot, 9, [5, 6, 7]) == [4, 0, 5]


def test_greedy_rows_sample_argmax() -> None:
    p = torch.zeros(2, 5)
    p[0, 3] = 1.0
    p[1, 1] = 1.0
    assert sample(p).tolist() == [3, 1]


# ------------------------------------------------------------------ verification
@pytest.mark.parametrize("target,drafts,expected", [
    ([5], [], (0, [5])),  # K = 0: just the target token
    ([1, 2, 3, 4], [1, 2, 3], (3, [1, 2, 3, 4])),  # all accepted + bonus
    ([1, 9, 3, 4], [1, 2, 3], (1, [1, 9])),  # mismatch at 2: correction, rest ignored
    ([7, 2, 3], [1, 2], (0, [7])),  # first draft wrong
    ([1, 2, 8], [1, 2], (2, [1, 2, 8])),
])
def test_verify_greedy(target, drafts, expected) -> None:
    assert verify_greedy(target, drafts) == expected


def test_verify_greedy_shape_check() -> None:
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def test_verify_sampled_with_one_hot_target_is_greedy() -> None:
    g = make_generator(0)
    p = torch.zeros(3, 6)
    p[0, 2], p[1, 4], p[2, 0] = 1, 1, 1
    assert verify_sampled(p, [2, 4], None, g) == (2, [2, 4, 0])
    assert verify_sampled(p, [2, 5], None, g) == (1, [2, 4])
    assert verify_sampled(p, [3, 4], torch.full((2, 6), 1 / 6), g) == (0, [2])


P0 = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])
Q0 = torch.tensor([0.05, 0.10, 0.10, 0.15, 0.25, 0.35])  # deliberately different


def _first_token_freqs(q: torch.Tensor | None, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Frequencies of the 1st emitted token, of the 2nd (when emitted), and the acceptance rate."""
    v = P0.numel()
    p = torch.stack([P0.roll(i) for i in range(k + 1)])  # a different target row per position
    qs = None if q is None else torch.stack([q.roll(i) for i in range(k)])
    draft_rng = torch.Generator().manual_seed(seed + 1)
    g = make_generator(seed)
    first, second = torch.zeros(v), torch.zeros(v)
    accepted = 0
    for _ in range(N_SAMPLES):
        if qs is None:  # greedy drafter: its argmax, a poor guess for the target
            drafts = [int(Q0.roll(i).argmax()) for i in range(k)]
        else:
            drafts = torch.multinomial(qs, 1, generator=draft_rng).squeeze(-1).tolist()
        a, toks = verify_sampled(p, drafts, qs, g)
        assert len(toks) == a + 1 and toks[:a] == drafts[:a]
        accepted += a
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
    return first / first.sum(), second / max(second.sum(), 1), accepted / (N_SAMPLES * k)


def test_rejection_sampling_keeps_target_distribution_sampled_drafter() -> None:
    assert tv(P0, Q0) >= 0.3  # a verifier that returned the drafts would fail the bound
    f1, f2, acc = _first_token_freqs(Q0, k=2, seed=0)
    assert tv(f1, P0) < TV_BOUND
    assert tv(f2, P0.roll(1)) < 2 * TV_BOUND  # fewer samples reach the second position
    # expected acceptance of the first draft: sum_x min(p(x), q(x)) = 1 - TV(p, q)
    assert 0.3 < acc < 0.8


def test_rejection_sampling_keeps_target_distribution_greedy_drafter() -> None:
    # greedy drafter always proposes token 5 (p = 0.05): accepted 5% of the time
    f1, _, acc = _first_token_freqs(None, k=1, seed=1)
    assert tv(f1, P0) < TV_BOUND
    assert math.isclose(acc, float(P0[int(Q0.argmax())]), abs_tol=0.01)


def test_verify_sampled_reproducible() -> None:
    p = torch.softmax(torch.randn(3, 6, generator=torch.Generator().manual_seed(0)), -1)
    runs = [[verify_sampled(p, [1, 2], None, g) for _ in range(20)] for g in (make_generator(5), make_generator(5))]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------ acceptance bookkeeping (metrics)
def test_request_metrics_definitions() -> None:
    from dsv4.engine.metrics import EngineMetrics, RequestMetrics

    m = RequestMetrics(arrival=10.0, prompt_tokens=7)
    m.on_tokens(1, now=10.5)  # first token from prefill
    for drafted, accepted, now in ((2, 2, 10.7), (2, 0, 10.9), (1, 1, 11.1), (0, 0, 11.2)):
        m.on_verify(drafted, accepted)
        m.on_tokens(accepted + 1, now=now)
    m.on_finish(now=11.2)
    d = m.to_dict()
    assert d["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "cached_tokens": 0}
    assert d["timings"]["ttft_s"] == pytest.approx(0.5) and d["timings"]["e2e_s"] == pytest.approx(1.2)
    assert d["timings"]["tpot_s"] == pytest.approx(0.7 / 7)
    s = d["spec"]
    assert (s["drafted"], s["accepted"]) == (5, 3) and s["acceptance_rate"] == pytest.approx(0.6)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 3 / 3)  # 3 verify steps carried drafts
    assert s["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 2])
    e = EngineMetrics(start_time=10.0)
    e.add(m)
    e.add(m)
    ed = e.to_dict()
    assert ed["usage"]["completion_tokens"] == 16 and ed["spec"]["acceptance_rate"] == pytest.approx(0.6)
    assert ed["timings"]["ttft_s"]["p50"] == pytest.approx(0.5)
    assert ed["throughput"]["output_tokens_per_s"] == pytest.approx(16 / 1.2)
    assert RequestMetrics().to_dict()["spec"]["acceptance_rate"] is None


def test_tiny_temperature_rejected_and_overflow_falls_back_to_argmax() -> None:
    with pytest.raises(RequestError, match="temperature must be 0"):
        SamplingParams(temperature=1e-40).validate()
    logits = torch.tensor([[0.0, float("inf"), 1.0], [0.0, 2.0, 1.0]])
    one = torch.ones(2)
    probs = logits_to_probs(logits, one, torch.zeros(2, dtype=torch.long), one, torch.zeros(2))
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0]))
    assert torch.isfinite(probs).all()


# ------------------------------------------------------------------ penalties
def test_penalties_by_hand():
    from dsv4.engine.sampling import apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    # prompt has token 0; output has token 1 twice and token 3 once
    out = apply_penalties(logits, [[0]], [[1, 3, 1]], [2.0], [0.5], [0.25])
    want = torch.tensor([[2.0 / 2,  # seen in the prompt: positive / 2; no output counts
                          -1.0 * 2 - 0.25 * 2 - 0.5,  # negative * 2, twice in the output, present
                          0.5,  # never seen
                          3.0 / 2 - 0.25 - 0.5,
                          -2.0]])
    assert torch.allclose(out, want)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]]))  # input untouched


def test_penalties_off_change_nothing_and_rows_are_independent():
    from dsv4.engine.sampling import apply_penalties

    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    same = apply_penalties(logits, [[1, 2], [], [6]], [[3], [4, 4], []], [1.0] * 3, [0.0] * 3, [0.0] * 3)
    assert torch.equal(same, logits)
    out = apply_penalties(logits, [[], [], []], [[], [5], []], [1.0, 1.3, 1.0], [0.0] * 3, [0.0] * 3)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1, 5] < logits[1, 5] and torch.equal(out[1, :5], logits[1, :5])


@pytest.mark.parametrize("name,value", [("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                                        ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                        ("presence_penalty", "a")])
def test_penalty_ranges(name, value):
    with pytest.raises(RequestError, match=name):
        SamplingParams(**{name: value}).validate()


def _reference_probs(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The processing written plainly on one row [V]: sort the whole row, then top-k, top-p, min-p."""
    x = x.float() / temperature
    v = x.shape[-1]
    s, order = x.sort(descending=True)
    k = v if top_k <= 0 or top_k > v else top_k
    s[k:] = float("-inf")
    p = s.softmax(-1)
    before = p.cumsum(-1) - p
    if top_p < 1:
        drop = before > top_p
        drop[0] = False
        s[drop] = float("-inf")
    if min_p > 0:
        s[s < s[0] + math.log(min_p)] = float("-inf")
    return torch.zeros(v).scatter_(-1, order, s.softmax(-1))


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat rows (nucleus beyond the candidates) to peaked ones
def test_candidate_path_equals_sorting_the_whole_row(scale: float) -> None:
    """`logits_to_probs` looks at each row's top CANDIDATES tokens first and sorts the whole
    row only when its kept set may reach beyond them: the same distribution either way."""
    from dsv4.engine.sampling import CANDIDATES

    V = 3 * CANDIDATES + 17
    g = torch.Generator().manual_seed(int(scale * 10))
    grid = [(t, k, p, m) for t in (0.5, 1.0) for k in (0, 7, CANDIDATES, CANDIDATES + 1, V)
            for p in (1.0, 0.5, 0.95) for m in (0.0, 0.05)]
    logits = torch.randn(len(grid), V, generator=g) * scale
    col = lambda i, dt=torch.float32: torch.tensor([row[i] for row in grid], dtype=dt)  # noqa: E731
    probs = logits_to_probs(logits, col(0), col(1, torch.long), col(2), col(3))
    for i, (t, k, p, m) in enumerate(grid):
        ref = _reference_probs(logits[i], t, k, p, m)
        assert torch.equal(probs[i] > 0, ref > 0), (t, k, p, m)
        torch.testing.assert_close(probs[i], ref, rtol=1e-5, atol=1e-7)


def test_a_rows_probabilities_do_not_depend_on_its_neighbours() -> None:
    """Rows that take the candidate path and rows that sort the whole vocabulary, batched
    together or alone: bit-identical (seeded draws read these probabilities)."""
    from dsv4.engine.sampling import CANDIDATES

    V = 2 * CANDIDATES + 5
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(9)) * torch.tensor([[8.0], [0.2], [8.0], [0.2]])
    t, k = torch.tensor([0.8, 1.0, 1.0, 0.7]), torch.tensor([0, 0, 40, 0])
    tp, mp = torch.tensor([0.9, 0.99, 1.0, 1.0]), torch.zeros(4)
    batched = logits_to_probs(logits, t, k, tp, mp)
    for i in range(4):
        alone = logits_to_probs(logits[i:i + 1], t[i:i + 1], k[i:i + 1], tp[i:i + 1], mp[i:i + 1])[0]
        assert torch.equal(batched[i], alone), i


def test_a_vocabulary_smaller_than_the_candidates() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    t, k, tp, mp = torch.ones(3), torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.9]), torch.zeros(3)
    probs = logits_to_probs(logits, t, k, tp, mp)
    for i in range(3):
        ref = _reference_probs(logits[i], 1.0, int(k[i]), float(tp[i]), 0.0)
        torch.testing.assert_close(probs[i], ref, rtol=1e-5, atol=1e-7)
    assert bool((probs[0] > 0).all())  # nothing removed


def test_rows_without_top_k_or_top_p_need_no_order() -> None:
    """Temperature and min-p only (the OpenAI API's defaults): nothing sorted, the same
    distribution as the plain processing."""
    logits = torch.randn(2, 700, generator=torch.Generator().manual_seed(5)) * 4
    t, mp = torch.tensor([0.7, 1.3]), torch.tensor([0.0, 0.02])
    probs = logits_to_probs(logits, t, torch.zeros(2, dtype=torch.long), torch.ones(2), mp)
    for i in range(2):
        ref = _reference_probs(logits[i], float(t[i]), 0, 1.0, float(mp[i]))
        assert torch.equal(probs[i] > 0, ref > 0)
        torch.testing.assert_close(probs[i], ref, rtol=1e-5, atol=1e-7)
    assert bool((probs[0] > 0).all()) and not bool((probs[1] > 0).all())


def test_greedy_and_broken_rows_beside_sampled_ones() -> None:
    """Greedy rows are one-hot at their argmax and a row with NaN falls back to its finite
    argmax, whichever way the sampled rows beside them go."""
    from dsv4.engine.sampling import CANDIDATES

    V = 2 * CANDIDATES + 3
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(11)) * torch.tensor([[5.0], [0.2], [5.0], [1.0]])
    logits[3, 7] = float("nan")
    t, k = torch.tensor([0.0, 1.0, 0.9, 1.0]), torch.tensor([0, 0, 20, 0])
    tp, mp = torch.tensor([0.9, 0.95, 1.0, 0.9]), torch.zeros(4)
    probs = logits_to_probs(logits, t, k, tp, mp)
    assert probs[0].argmax() == logits[0].argmax() and probs[0].max() == 1.0
    assert probs[3].max() == 1.0 and int(probs[3].argmax()) == int(torch.nan_to_num(logits[3], nan=-1e9).argmax())
    for i in (1, 2):
        torch.testing.assert_close(probs[i], _reference_probs(logits[i], float(t[i]), int(k[i]), float(tp[i]), 0.0),
                                   rtol=1e-5, atol=1e-7)


def test_rows_whose_kept_tokens_are_among_the_candidates_are_not_sorted(monkeypatch) -> None:
    """A top-k within the candidates, or a peaked top-p, never sorts the vocabulary; a broad
    top-p does (the sort is what the candidates save: 7.8 ms a row of V4's vocabulary)."""
    from dsv4.engine.sampling import CANDIDATES

    sorts = []
    real = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **kw: sorts.append(self.shape) or real(self, *a, **kw))
    V = 8 * CANDIDATES
    g = torch.Generator().manual_seed(12)
    one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    logits_to_probs(torch.randn(1, V, generator=g), one(1.0), one(50, torch.long), one(1.0), one(0.0))
    logits_to_probs(torch.randn(1, V, generator=g) * 8, one(1.0), one(0, torch.long), one(0.9), one(0.0))
    logits_to_probs(torch.randn(1, V, generator=g), one(0.7), one(0, torch.long), one(1.0), one(0.1))
    assert sorts == []
    logits_to_probs(torch.randn(1, V, generator=g) * 0.1, one(1.0), one(0, torch.long), one(0.9), one(0.0))
    assert sorts == [(1, V)]
