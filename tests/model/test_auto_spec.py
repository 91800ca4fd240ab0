"""Auto K end to end in-process (tiny random checkpoint, fp32 CPU): whatever K the policy
picks from step to step, greedy output equals K = 0; after steps without drafts the MTP
catches up over its backlog and drafts exactly what an MTP that never stopped drafts."""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv4 import LLM, SamplingParams
from tests.model.conftest import TOL

GEN = 24


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in lengths]


def _scripted(llm: LLM, schedule: list[int]) -> list[int]:
    """Make the engine's policy follow `schedule` (cycled); returns the list of K it chose."""
    chosen: list[int] = []
    ks = itertools.cycle(schedule)

    def choose(batch: int) -> int:
        chosen.append(next(ks))
        return chosen[-1]

    llm.engine.policy.choose = choose
    return chosen


SCHEDULES = {
    "real": None,  # the calibrated policy itself
    "flapping": [3, 0, 1, 2, 0, 0, 3, 1],
    "long_pause": [0] * 20 + [2, 3, 1, 1, 0, 3],  # backlogs longer than the window (12): trimmed
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_greedy_auto_equals_k0(tiny_checkpoint, name):
    prompts = _prompts([1, 5, 40, 129])
    sp = SamplingParams(max_tokens=GEN, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_model_len=256, prefill_limit=16)
    ref = [c.token_ids for c in LLM(tiny_checkpoint, num_speculative_tokens=0, **kw).generate(prompts, sp)]
    llm = LLM(tiny_checkpoint, num_speculative_tokens="auto", **kw)
    assert llm.engine.policy is not None and llm.engine.calibration_s > 0
    chosen = _scripted(llm, SCHEDULES[name]) if SCHEDULES[name] else []
    out = llm.generate(prompts, sp)
    assert [c.token_ids for c in out] == ref
    if chosen:
        assert set(chosen) == {0, 1, 2, 3}
        assert sum(c.metrics["spec"]["drafted"] for c in out) > 0
    st = llm.engine.status()
    assert st["speculative_auto"] and st["max_speculative_tokens"] == 3 and 0 <= st["num_speculative_tokens"] <= 3
    assert all(c.metrics["spec"]["speculative_auto"] for c in out)
    # one at a time as well (batch size 1: the policy's other cost curve)
    assert [c.token_ids for c in llm.generate(prompts[2:3], sp)] == ref[2:3]


@pytest.mark.exact
def test_drafts_after_catch_up_equal_an_mtp_that_never_stopped(tiny_checkpoint):
    """K = 0 for a while (the MTP skips, its pairs wait in a trimmed backlog), then K = 1:
    each draft equals the first draft of a K = 1 engine prefilled with the same tokens."""
    prompt = _prompts([30], seed=5)[0]
    llm = LLM(tiny_checkpoint, num_speculative_tokens="auto", max_num_seqs=1, max_model_len=256)
    _scripted(llm, [0] * 18 + [1] * 100)
    seen: dict[int, list[int]] = {}  # output length when drafted -> drafts
    caches: dict[int, tuple[int, torch.Tensor]] = {}  # ... -> (MTP length, its window rows)

    def record(req, tokens, drafts):
        seen[len(tokens)] = list(drafts)
        state = llm.engine.runner.state
        caches[len(tokens)] = (state.mtp_lengths[req.slot], state.snapshot(req.slot)["mtp.win"].clone())
        return drafts

    llm.engine.runner.draft_override = record
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))
    first = min(seen)
    assert first > 12  # the first drafts came after a backlog longer than the MTP window
    ref = LLM(tiny_checkpoint, num_speculative_tokens=1, max_num_seqs=1, max_model_len=256)
    got = {}
    ref.engine.runner.draft_override = lambda req, tokens, drafts: got.setdefault("d", list(drafts))
    for n in sorted(seen)[:4]:  # the catch-up itself and the steps after it
        got.clear()
        ref.generate([prompt + out.token_ids[:n - 1]], SamplingParams(max_tokens=1, ignore_eos=True))
        assert got["d"] == seen[n], n
        state = ref.engine.runner.state
        length, win = caches[n]
        assert state.mtp_lengths[0] == length
        # equal up to the summation order of matmuls over different row counts: the float32
        # promise (1e-5, tests/model/conftest.py TOL); 1e-6 held on AVX-512 kernels only
        # (AVX2: 1.4e-6 on one entry of 352)
        torch.testing.assert_close(state.snapshot(0)["mtp.win"], win, rtol=1e-5, atol=TOL)
