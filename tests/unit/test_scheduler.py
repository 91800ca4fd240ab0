"""Scheduler policy: chunk plans, single dispatch, slots, budget, starvation, draft caps, bad requests."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from dsv4.engine.request import Request, RequestError, RequestStatus
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.scheduler import Scheduler, SchedulerOutput

TOK = 5  # a token that is never EOS here


def make(max_num_seqs=4, max_model_len=2048, budget=4096, chunk=128, single=False, k=0, eos=None, vocab=None):
    return Scheduler(max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=budget,
                     chunk_size=chunk, single_dispatch=single, num_speculative_tokens=k, eos_token_id=eos,
                     vocab_size=vocab)


def req(rid, n, **params) -> Request:
    return Request(rid, [1] * n, SamplingParams(**params))


def complete(s: Scheduler, out: SchedulerOutput, accept: int | None = None) -> None:
    """Pretend the model ran: last chunks yield TOK, decodes accept `accept` drafts (all by default)."""
    for r, start, n in out.prefills:
        s.on_prefill_done(r, n, TOK if start + n == r.num_prompt_tokens else None)
    for r, n in out.decodes:
        a = n - 1 if accept is None else min(accept, n - 1)
        s.on_decode_done(r, [TOK] * (a + 1))


def chunk_plan(s: Scheduler, r: Request) -> list[tuple[int, int]]:
    s.add(r)
    plan = []
    while r.status is not RequestStatus.DECODE:
        out = s.schedule()
        assert not out.decodes
        plan += [(start, n) for rr, start, n in out.prefills if rr is r]
        complete(s, out)
    return plan


@pytest.mark.parametrize("length,expected", [
    (127, [(0, 127)]),
    (128, [(0, 128)]),
    (129, [(0, 128), (128, 1)]),
    (255, [(0, 128), (128, 127)]),
    (256, [(0, 128), (128, 128)]),
    (257, [(0, 128), (128, 128), (256, 1)]),
])
def test_chunk_plan_table(length, expected) -> None:
    assert chunk_plan(make(), req("a", length)) == expected


def test_threshold_64() -> None:
    assert chunk_plan(make(chunk=64), req("a", 129)) == [(0, 64), (64, 64), (128, 1)]


def test_budget_limits_chunk() -> None:
    assert chunk_plan(make(budget=100), req("a", 257)) == [(0, 100), (100, 100), (200, 57)]


def test_one_token_tail_is_prefill() -> None:
    s = make()
    r = req("a", 129)
    s.add(r)
    complete(s, s.schedule())
    out = s.schedule()
    assert [(x, st, n) for x, st, n in out.prefills] == [(r, 128, 1)] and out.decodes == []
    assert r.status is RequestStatus.PREFILL
    complete(s, out)
    assert r.status is RequestStatus.DECODE and r.output_ids == [TOK] and r.num_computed_tokens == 129
    out = s.schedule()
    assert out.decodes == [(r, 1)] and not out.prefills


def test_single_dispatch_defers_whole_prompt() -> None:
    s = make(budget=130, chunk=128, max_model_len=128, single=True)
    a, b, c = req("a", 100), req("b", 100), req("c", 10)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    # b does not fit in the 30 tokens left: it waits whole, and c does not overtake it
    assert [(r.request_id, st, n) for r, st, n in out.prefills] == [("a", 0, 100)]
    complete(s, out)
    seen = []
    for _ in range(10):
        out = s.schedule()
        seen += [(r.request_id, st, n) for r, st, n in out.prefills]
        complete(s, out)
    assert ("b", 0, 100) in seen and ("c", 0, 10) in seen
    assert all(n == {"b": 100, "c": 10}[rid] and st == 0 for rid, st, n in seen)


def test_slots_assigned_and_freed() -> None:
    s = make(max_num_seqs=2)
    rs = [req(i, 4, max_tokens=2) for i in range(3)]
    for r in rs:
        s.add(r)
    complete(s, s.schedule())
    assert [r.slot for r in rs] == [0, 1, None] and rs[2].status is RequestStatus.WAITING
    s.abort(0)
    assert rs[0].status is RequestStatus.FINISHED and rs[0].finish_reason == "abort" and rs[0].slot is None
    out = s.schedule()
    assert rs[2].slot == 0 and (rs[2], 0, 4) in out.prefills
    complete(s, out)  # rs[1] emits its 2nd token: max_tokens reached
    assert rs[1].is_finished and rs[1].finish_reason == "length" and s.num_free_slots == 1
    assert s.abort("nope") is None


def test_finish_on_eos_and_stop_ids() -> None:
    s = make(k=2, eos=9)
    a, b, c = req("a", 3), req("b", 3, stop_token_ids=[7]), req("c", 3, ignore_eos=True)
    for r in (a, b, c):
        s.add(r)
    complete(s, s.schedule())
    out = s.schedule()
    assert all(n == 3 for _, n in out.decodes)
    assert s.on_decode_done(a, [4, 9, 4]) == [4, 9] and a.finish_reason == "stop"
    assert s.on_decode_done(b, [7, 4]) == [7] and b.finish_reason == "stop"
    assert s.on_decode_done(c, [9, 9, 9]) == [9, 9, 9] and not c.is_finished
    assert a.slot is None and b.slot is None and s.num_free_slots == 3


def test_abort_mid_step_is_harmless() -> None:
    s = make()
    r = req("a", 3)
    s.add(r)
    out = s.schedule()
    s.abort("a")
    complete(s, out)  # results for an aborted request are dropped
    assert r.output_ids == [] and not s.has_work


def test_budget_exhaustion_waits() -> None:
    s = make(max_num_seqs=6, budget=4, k=1, max_model_len=64)
    rs = [req(i, 5 + 3 * i, max_tokens=6) for i in range(8)]
    for r in rs:
        s.add(r)
    for _ in range(200):
        out = s.schedule()
        assert out.num_tokens <= 4
        complete(s, out, accept=0)
        if not s.has_work:
            break
    assert all(r.is_finished and len(r.output_ids) == 6 for r in rs)


def test_decodes_cannot_starve_prefill() -> None:
    """Decodes fill the whole budget; the waiting prefill still runs at least every other step."""
    s = make(max_num_seqs=3, budget=4, k=1)
    d1, d2 = req("d1", 2, max_tokens=1000), req("d2", 2, max_tokens=1000)
    s.add(d1), s.add(d2)
    complete(s, s.schedule())
    p = req("p", 40)
    s.add(p)
    prefill_steps, decode_steps = [], []
    for step in range(30):
        out = s.schedule()
        if out.prefills:
            prefill_steps.append(step)
        if out.decodes:
            decode_steps.append(step)
        complete(s, out)
    assert p.status is RequestStatus.DECODE
    assert prefill_steps and all(b - a <= 2 for a, b in zip(prefill_steps, prefill_steps[1:]))
    assert all(b - a <= 2 for a, b in zip(decode_steps, decode_steps[1:]))


def test_prefill_cannot_starve_decodes() -> None:
    """Whole single-dispatch prompts that need nearly all the budget, one after another:
    every decode still runs at least every other step, and every prompt gets in."""
    s = make(max_num_seqs=8, budget=128, chunk=128, max_model_len=128, single=True, k=1)
    ds = [req(f"d{i}", 2, max_tokens=100) for i in range(3)]
    for d in ds:
        s.add(d)
    complete(s, s.schedule())
    ps = [req(f"p{i}", 127, max_tokens=1) for i in range(5)]
    for p in ps:
        s.add(p)
    served = {d.request_id: [] for d in ds}
    skipped_some = False
    for step in range(20):
        out = s.schedule()
        assert out.num_tokens <= 128
        for r, _ in out.decodes:
            served[r.request_id].append(step)
        skipped_some |= len(out.decodes) < 3
        complete(s, out)
    assert all(p.is_finished for p in ps)
    assert skipped_some  # prefill-first steps did take the budget from decodes
    for steps in served.values():
        assert steps[0] <= 1 and steps[-1] >= 18
        assert all(b - a <= 2 for a, b in zip(steps, steps[1:]))


def test_random_load_all_finish() -> None:
    rng = random.Random(0)
    for single in (False, True):
        s = make(max_num_seqs=4, budget=40, chunk=32, max_model_len=32 if single else 200, single=single, k=2)
        rs = []
        for step in range(2000):
            if step < 300 and rng.random() < 0.3:
                r = req(len(rs), rng.randint(1, 31), max_tokens=rng.randint(1, 20))
                s.add(r)
                rs.append(r)
            out = s.schedule()
            assert out.num_tokens <= 40
            assert len({r.slot for r, *_ in out.prefills + out.decodes}) == len(out.prefills) + len(out.decodes)
            complete(s, out, accept=rng.randint(0, 2))
            if step > 300 and not s.has_work:
                break
        assert all(r.is_finished for r in rs) and s.num_free_slots == 4


@pytest.mark.parametrize("prompt,max_model_len,max_tokens,expected", [
    # every draft rejected, so each step emits one token and the room shrinks by one
    (15, 20, 100, [4, 3, 2, 1]),  # 16 tokens after prefill: 20 - 16 - 1 = 3 drafts, ...
    (17, 20, 100, [2, 1]),  # 18 tokens: 1 draft, then only the last position
    (5, 100, 4, [3, 2, 1]),  # max_tokens 4: first token from prefill, then 2 drafts, ...
    (5, 100, 1, []),  # max_tokens 1: done after prefill
])
def test_drafts_capped_by_room(prompt, max_model_len, max_tokens, expected) -> None:
    s = make(k=3, max_model_len=max_model_len)
    r = req("a", prompt, max_tokens=max_tokens)
    s.add(r)
    complete(s, s.schedule())
    sizes = []
    while s.has_work:
        out = s.schedule()
        sizes += [n for _, n in out.decodes]
        complete(s, out, accept=0)
    assert sizes == expected
    assert r.num_tokens <= max_model_len and len(r.output_ids) <= max_tokens


def test_drafts_never_pass_limits_when_all_accepted() -> None:
    s = make(k=3, max_model_len=20)
    r = req("a", 15)
    s.add(r)
    complete(s, s.schedule())
    out = s.schedule()
    assert out.decodes == [(r, 4)]
    complete(s, out)  # all 3 drafts and the bonus: exactly max_model_len
    assert r.num_tokens == 20 and r.finish_reason == "length"


def test_non_speculative_request() -> None:
    s = make(k=3)
    a, b = req("a", 4), req("b", 4, speculative=False)
    s.add(a), s.add(b)
    complete(s, s.schedule())
    assert dict((r.request_id, n) for r, n in s.schedule().decodes) == {"a": 4, "b": 1}


@pytest.mark.parametrize("bad,needle", [
    (Request("x", [], SamplingParams()), "empty"),
    (Request("x", [1] * 100, SamplingParams()), "--max-model-len"),
    (Request("x", [1, 500], SamplingParams()), "vocabulary"),
    (Request("x", [1, 2], SamplingParams(stop_token_ids=[300])), "stop_token_ids entry 300 is outside the vocabulary"),
    (Request("x", [1, 2], SamplingParams(logit_bias={256: 1.0})), "logit_bias token 256 is outside the vocabulary"),
    (Request("x", [1, "2"], SamplingParams()), "token ids"),
    (Request("a", [1], SamplingParams()), "already in use"),
])
def test_bad_request_rejected_alone(bad, needle) -> None:
    s = make(max_model_len=100, vocab=256)
    good = req("a", 4)
    s.add(good)
    with pytest.raises(RequestError, match=needle):
        s.add(bad)
    out = s.schedule()
    assert out.prefills == [(good, 0, 4)] and len(s.waiting) == 0 and len(s.running) == 1


@pytest.mark.parametrize("bad,needle", [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature")])
def test_bad_params_never_exist(bad, needle) -> None:
    """SamplingParams are checked when built, so a bad value never reaches the scheduler."""
    with pytest.raises(RequestError, match=needle):
        SamplingParams(**bad)


def test_prompt_of_max_model_len_minus_one_fits() -> None:
    s = make(max_model_len=100)
    r = req("a", 99, max_tokens=50)
    s.add(r)
    while s.has_work:
        complete(s, s.schedule())
    assert r.finish_reason == "length" and r.num_tokens == 100 and len(r.output_ids) == 1


def test_from_config_duck_typed() -> None:
    class Cfg:
        max_num_seqs, max_model_len, max_num_batched_tokens = 2, 64, 32
        effective_chunk_size, single_dispatch, num_speculative_tokens = 16, False, 1

    s = Scheduler.from_config(Cfg())
    assert (s.chunk_size, s.budget, s.num_spec, s.eos_token_id) == (16, 32, 1, None)


def test_scheduler_imports_no_torch() -> None:
    code = "import sys, dsv4.engine.scheduler, dsv4.engine.request; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fair_admission_between_clients() -> None:
    """A client's flood waits behind another client's single request; FCFS within a client."""
    s = make(max_num_seqs=2)
    flood = [Request(f"f{i}", [1] * 4, SamplingParams(max_tokens=50), client="flood") for i in range(6)]
    for r in flood:
        s.add(r)
    complete(s, s.schedule())
    assert [r.slot for r in flood[:2]] == [0, 1] and all(r.slot is None for r in flood[2:])
    probe = Request("p", [1] * 4, SamplingParams(max_tokens=1), client="probe")
    s.add(probe)
    complete(s, s.schedule())  # no slot free: the probe waits with the flood
    assert probe.status is RequestStatus.WAITING
    s.abort("f0")
    out = s.schedule()  # one slot: the probe's client holds none, the flood's one
    assert [r.request_id for r, _, _ in out.prefills] == ["p"] and flood[2].status is RequestStatus.WAITING
    complete(s, out)
    assert probe.is_finished
    s.abort("f1")
    out = s.schedule()  # two slots, one client: its oldest requests, in order
    assert [r.request_id for r, _, _ in out.prefills] == ["f2", "f3"]
    assert list(s.waiting) == flood[4:]


def test_fair_admission_ties_go_to_the_oldest() -> None:
    s = make(max_num_seqs=3)
    order = [("a", "x"), ("b", "x"), ("c", "y"), ("d", "y"), ("e", "z")]
    rs = [Request(rid, [1] * 2, SamplingParams(max_tokens=5), client=c) for rid, c in order]
    for r in rs:
        s.add(r)
    out = s.schedule()  # each client's oldest, oldest first: a (x), c (y), e (z)
    assert [r.request_id for r, _, _ in out.prefills] == ["a", "c", "e"]
    assert [r.request_id for r in s.waiting] == ["b", "d"]


def test_fair_admission_random_load_all_finish() -> None:
    rng = random.Random(1)
    s = make(max_num_seqs=3, budget=40, chunk=16, k=1)
    rs, held_max = [], 0
    for step in range(3000):
        if step < 300 and rng.random() < 0.4:
            client = "flood" if rng.random() < 0.7 else rng.choice("abc")
            r = Request(len(rs), [1] * rng.randint(1, 30), SamplingParams(max_tokens=rng.randint(1, 12)),
                        client=client)
            s.add(r)
            rs.append(r)
        before = set(s.running)
        out = s.schedule()
        held = {c: sum(r.client == c for r in s.running) for c in {r.client for r in rs}}
        for a in (r for r in s.running if r not in before):  # admitted now: its client held the fewest slots
            assert all(held[a.client] - 1 <= held[w.client] for w in s.waiting)
        held_max = max(held_max, len(s.running))
        complete(s, out, accept=rng.randint(0, 1))
        if step > 300 and not s.has_work:
            break
    assert all(r.is_finished for r in rs) and s.num_free_slots == 3 and held_max == 3
