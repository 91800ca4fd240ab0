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

    def choose(batch: int, sampled: int = 0) -> int:
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


def test_calibration_times_every_part_and_leaves_no_trace(tiny_checkpoint):
    """The calibration fills the dispatch tables at every K of one request and at the batch
    ends, and the host tables (choosing tokens, proposing drafts) with sampling parameters;
    it leaves every slot empty, its blocks as they were, and the global RNG where it was (an
    unseeded request's draws do not depend on whether auto K calibrated)."""
    from dsv4.engine.spec.calibration import calibrate

    llm = LLM(tiny_checkpoint, num_speculative_tokens="auto", max_num_seqs=4, max_model_len=256)
    runner, pol = llm.engine.runner, llm.engine.policy
    K, S = runner.num_spec, runner.max_num_seqs
    blocks = [list(b) for b in runner.state.blocks]
    rng = torch.get_rng_state()
    calibrate(runner, SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1))
    assert torch.equal(torch.get_rng_state(), rng)
    counts = set(range(1, K + 2)) | {S, S * (K + 1)}
    assert set(pol.verify.shape) == set(pol.draft.shape) == set(pol.verify_host.shape) == counts
    assert set(pol.draft_host.shape) == {1, S}
    assert all(v > 0 for t in (pol.verify, pol.draft, pol.verify_host, pol.draft_host) for v in t.shape.values())
    assert runner.state.lengths == [0] * len(runner.state.lengths)
    assert runner.state.mtp_lengths == [0] * len(runner.state.mtp_lengths)
    assert [list(b) for b in runner.state.blocks] == blocks
    prompts = _prompts([7, 33])
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in llm.generate(prompts, sp)] == [
        c.token_ids for c in LLM(tiny_checkpoint, num_speculative_tokens=0, max_model_len=256).generate(prompts, sp)]


def test_assume_refuses_positions_without_blocks(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, num_speculative_tokens="auto", max_num_seqs=2, max_model_len=256)
    state = llm.engine.runner.state
    state.assign(0, [0])
    state.assume(0, state.block_size - 1)
    assert state.lengths[0] == state.mtp_lengths[0] == state.block_size - 1
    with pytest.raises(ValueError, match="blocks"):
        state.assume(0, state.block_size)
    state.free(0)
    state.assign(0, [])


@pytest.mark.parametrize("max_model_len", [2, 3])
def test_calibration_fits_the_shortest_context(tiny_checkpoint, max_model_len):
    """A state of a few positions: the calibration's contexts shrink to fit (no position beyond it)."""
    llm = LLM(tiny_checkpoint, num_speculative_tokens="auto", max_num_seqs=2, max_model_len=max_model_len)
    assert llm.engine.policy.verify.shape
    (out,) = llm.generate([[5]], SamplingParams(max_tokens=1, ignore_eos=True))
    assert len(out.token_ids) == 1


def test_a_second_start_loads_the_calibration_and_serves_the_same(tiny_checkpoint, tmp_path, monkeypatch):
    """The calibration cache (spec/cost_cache.py): the first start times the costs and keeps
    them; a second with the same settings loads the same tables (no timing) and generates
    the same tokens; other settings, DSV4_CALIBRATION=fresh, a corrupt entry and a directory
    other users may write are timed again."""
    monkeypatch.setenv("DSV4_CALIBRATION_DIR", str(tmp_path / "cal"))
    kw = dict(num_speculative_tokens="auto", max_num_seqs=2, max_model_len=256)
    first = LLM(tiny_checkpoint, **kw).engine
    assert first.calibration_note.startswith("auto K: decode step costs timed in")
    entries = list((tmp_path / "cal").glob("*.json"))
    assert len(entries) == 1 and (tmp_path / "cal").stat().st_mode & 0o777 == 0o700
    tables = ("verify", "verify_host", "draft", "draft_host")
    second = LLM(tiny_checkpoint, **kw).engine
    assert "from the calibration cache" in second.calibration_note, second.calibration_note
    for t in tables:
        assert getattr(second.policy, t).shape == getattr(first.policy, t).shape
    prompts, sp = _prompts([3, 20]), SamplingParams(max_tokens=8, ignore_eos=True)
    ref = [c.token_ids for c in LLM(tiny_checkpoint, num_speculative_tokens=0, max_model_len=256).generate(prompts, sp)]
    assert [c.token_ids for c in LLM(tiny_checkpoint, **kw).generate(prompts, sp)] == ref
    assert LLM(tiny_checkpoint, **{**kw, "max_num_seqs": 3}).engine.calibration_note.startswith("auto K: decode step costs timed")
    monkeypatch.setenv("DSV4_CALIBRATION", "fresh")
    assert LLM(tiny_checkpoint, **kw).engine.calibration_note.startswith("auto K: decode step costs timed")
    monkeypatch.delenv("DSV4_CALIBRATION")
    entries[0].write_text('{"tables": {"verify": {"1": "x"')
    assert LLM(tiny_checkpoint, **kw).engine.calibration_note.startswith("auto K: decode step costs timed")
    assert "from the calibration cache" in LLM(tiny_checkpoint, **kw).engine.calibration_note  # rewritten
    (tmp_path / "cal").chmod(0o777)
    assert LLM(tiny_checkpoint, **kw).engine.calibration_note.startswith("auto K: decode step costs timed")
