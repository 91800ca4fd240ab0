"""The engine at --tensor-parallel-size 2 (rank 0 here, rank 1 spawned, gloo on CPU):
greedy output with MTP K = 1 and 2 across prefill chunk boundaries equals the single
process token for token (none and w8a8), and so do the drafts through a draft vocabulary, with auto K (any K sequence) equals K = 0 (a
seeded sampled request too: its draws are keyed by position, not by rank or K), and at --tensor-parallel-size 4 (on the tiny
config's `TP4` variant) with K = 1; a killed rank fails the step and leaves no process
behind (nor anything in /dev/shm), and rank 0's rendezvous store no longer listens once
the group is up; a size that does not divide the model is refused
before loading."""

from __future__ import annotations

import glob
import itertools
import json
import os
import signal
import time

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine.config import EngineConfig, EngineConfigError
from dsv4.engine.parallel.ranks import RankError
from dsv4.engine.parallel import step_plan as plan
from tests.checkpoints import write_tiny_checkpoint
from tests.model.conftest import assert_chains_agree
from tests.model.test_rendezvous import listening

GEN = 8


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (5, 37, 70)]


def _run(tiny_checkpoint, T: int, K: int | str, quantization: str, gen: int = GEN, schedule: list[int] | None = None,
         spec: bool = False, **kw) -> list:
    """Each request's tokens (with `spec`: (tokens, its spec metrics))."""
    with LLM(tiny_checkpoint, tensor_parallel_size=T, num_speculative_tokens=K, max_num_seqs=3, max_model_len=128,
             prefill_limit=16, quantization=quantization, **kw) as llm:
        if schedule is not None:  # auto K: rank 0's policy follows `schedule` (cycled)
            ks = itertools.cycle(schedule)
            llm.engine.policy.choose = lambda batch, sampled=0: next(ks)
        greedy = SamplingParams(max_tokens=gen, ignore_eos=True)
        seeded = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7)
        outs = llm.generate(_prompts() + _prompts()[1:2], [greedy] * 3 + [seeded])
    return [(c.token_ids, c.metrics["spec"]) if spec else c.token_ids for c in outs]


@pytest.mark.parametrize(("quantization", "K"), [("none", 1), ("none", 2), ("w8a8", 2)])
def test_two_ranks_generate_what_one_does(tiny_checkpoint, dense_checkpoint, quantization, K):
    """w8a8: the same but at near-ties (`assert_chains_agree`): reordered float32 sums can flip
    a token's int8 rounding. The seeded request is compared in float32 only: its tokens are
    draws, which a w8a8 logit moved by rounding may tip at any margin."""
    threads = torch.get_num_threads()
    ckpt = dense_checkpoint[0] if quantization == "w8a8" else tiny_checkpoint
    try:
        ref = _run(ckpt, 1, K, quantization)
        assert all(len(r) == GEN for r in ref)
        out = _run(ckpt, 2, K, quantization)
        if quantization == "none":
            assert out == ref
        else:
            from dsv4.model.loader import load_model

            model = load_model(ckpt, quantization="w8a8")
            greedy = slice(0, 3)  # the greedy rows
            assert_chains_agree(out[greedy], ref[greedy], _prompts(), model, dense_checkpoint[1])
    finally:
        torch.set_num_threads(threads)


def test_a_draft_vocabulary_at_two_ranks_drafts_what_one_rank_does(tiny_checkpoint, tmp_path):
    """Each rank keeps the draft tokens of its vocabulary slice (the set spans both): the
    drafts and what they accept are the single process's, and the text is K = 0's."""
    ids = torch.randperm(4096, generator=torch.Generator().manual_seed(0))[:1500].tolist()
    path = tmp_path / "dv.json"
    path.write_text(json.dumps({"format": "dsv4-draft-vocab", "version": 1, "vocab_size": 4096, "token_ids": ids}))
    threads = torch.get_num_threads()
    try:
        ref = _run(tiny_checkpoint, 1, 0, "none")
        one = _run(tiny_checkpoint, 1, 2, "none", draft_vocab=str(path), spec=True)
        two = _run(tiny_checkpoint, 2, 2, "none", draft_vocab=str(path), spec=True)
        assert [t for t, _ in one] == [t for t, _ in two] == ref
        assert [s for _, s in one] == [s for _, s in two]
        assert sum(s["drafted"] for _, s in two) > 0
    finally:
        torch.set_num_threads(threads)


def test_auto_k_at_two_ranks_equals_k0(tiny_checkpoint):
    """Auto K at T = 2: every plan carries rank 0's K, so rank 1's MTP backlog follows; K
    flapping, and a pause longer than the MTP window (12), over prefill chunk boundaries."""
    threads = torch.get_num_threads()
    try:
        ref = _run(tiny_checkpoint, 1, 0, "none", gen=24)
        assert all(len(r) == 24 for r in ref)
        schedule = [3, 0, 1, 2, 0, 0, 3, 1] + [0] * 14 + [2, 3]
        assert _run(tiny_checkpoint, 2, "auto", "none", gen=24, schedule=schedule) == ref
    finally:
        torch.set_num_threads(threads)


def test_four_ranks_generate_what_one_does(tmp_path):
    from tests.model.tiny import TP4

    write_tiny_checkpoint(tmp_path, **TP4)
    threads = torch.get_num_threads()
    try:
        ref = _run(tmp_path, 1, 1, "none")
        assert all(len(r) == GEN for r in ref)
        assert _run(tmp_path, 4, 1, "none") == ref
    finally:
        torch.set_num_threads(threads)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes (it holds no memory)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_rank_fails_the_step_and_leaves_nothing(tiny_checkpoint):
    threads = torch.get_num_threads()
    llm = LLM(tiny_checkpoint, tensor_parallel_size=2, num_speculative_tokens=1, max_num_seqs=2, max_model_len=128)
    try:
        pids = llm.engine.ranks.pids
        assert type(plan.channel()).__name__ == "ShmChannel"  # one host: the plans go through shared memory
        # the group is up: rank 0's store (bound to 127.0.0.1 before rank 1 was told its port) is closed
        addr, port = llm.engine.ranks.store
        assert addr == "127.0.0.1" and all(a[1] != port for a in listening(os.getpid()).values())
        llm.engine.add_request(_prompts()[1], SamplingParams(max_tokens=50, ignore_eos=True))
        llm.engine.step()  # mid-request
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(RankError, match=r"^tensor-parallel rank 1 \(pid \d+\) exited with code -9$"):
            for _ in range(50):
                llm.engine.step()
    finally:
        llm.close()
        torch.set_num_threads(threads)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert not glob.glob(f"/dev/shm/dsv4-plan-{os.getpid()}-*")  # nothing left in /dev/shm


def test_size_that_does_not_divide_is_refused(tiny_checkpoint):
    with pytest.raises(EngineConfigError, match=r"^--tensor-parallel-size 3 does not divide the model's attention "
                                                r"heads \(4\)$"):
        EngineConfig.create(str(tiny_checkpoint), tensor_parallel_size=3)
    with pytest.raises(EngineConfigError, match="^--tensor-parallel-size must be a positive integer, got 0$"):
        EngineConfig.create(str(tiny_checkpoint), tensor_parallel_size=0)


def test_structured_output_at_two_ranks(tiny_checkpoint):
    """A JSON-schema request at T = 2, K = 2 (rank 0 masks the verified rows and the drafts,
    and sends each depth's drafts to rank 1): the tokens of T = 1, K = 0, and as many drafts
    accepted as at T = 1, K = 2."""
    pytest.importorskip("llguidance")
    from tests.model.test_structured import SCHEMA

    threads = torch.get_num_threads()
    params = SamplingParams(max_tokens=160, structured={"json_schema": SCHEMA})
    got = {}
    try:
        for T, K in ((1, 0), (1, 2), (2, 2)):
            with LLM(tiny_checkpoint, tensor_parallel_size=T, num_speculative_tokens=K, max_num_seqs=3,
                     max_model_len=256, prefill_limit=16) as llm:
                c = llm.generate(["To be, or not to be"], params)[0]
            got[T, K] = (c.token_ids, c.metrics["spec"]["accepted"], c.finish_reason)
    finally:
        torch.set_num_threads(threads)
    assert got[1, 0][0] == got[1, 2][0] == got[2, 2][0] and got[1, 0][2] == "stop"
    assert got[2, 2][1] == got[1, 2][1] > 0
