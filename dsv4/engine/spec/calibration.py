"""Auto K's startup calibration: the shapes of the `SpecPolicy`'s cost tables.

`calibrate(runner, params)` times, before any request, what a decode step of B requests
drafting K tokens each costs, by part (one request at every K, and max_num_seqs requests at
K = 0 and the largest K): `verify` (the main model's dispatch of B * (1 + K) tokens) and
`draft` (one MTP dispatch), over distinct tokens and a full window of assumed context
(`ModelState.assume`: nothing computed); `verify_host` and `draft_host`, the host work of
choosing tokens (`verify.sample_verify`) and proposing drafts (`drafting.propose`), timed
with `params` (the engine's default sampling) on random logits.

Serving moves each table's level to what the requests in flight cost (`CostTable`); the
calibration only fixes how the costs grow with the token and row counts. The slots are freed
again and the global RNG left as it was. Why it is timed this way, with the measurements:
docs/serving.md, 'dsv4/engine/spec/calibration.py'.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from dsv4.model import parallel
from dsv4.model.state import Batch
from dsv4.engine.spec.drafting import propose
from dsv4.engine.params import SamplingParams
from dsv4.engine.request import Request
from dsv4.engine.spec.verify import sample_verify

if TYPE_CHECKING:
    from dsv4.engine.runner import Runner


def _best(fn, repeats: int) -> float:
    """The best of `repeats` timings of fn() after one warm-up run."""
    best = float("inf")
    for rep in range(repeats + 1):
        t = time.perf_counter()
        fn()
        if rep:
            best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def calibrate(runner: "Runner", params: SamplingParams | None = None, repeats: int = 4) -> None:
    """Fill the shapes of `runner.policy`'s cost tables (module docstring): each dispatch
    the mean of `repeats` runs after a warm-up (fewer for a slow one, `_timed_runs`), the
    shapes taking turns, at contexts that cover the compression's phases; each host part
    the best of `repeats`. `params` None: the dispatches only (the
    ranks of tensor parallelism, which do not sample)."""
    state, S, K, cfg = runner.state, runner.max_num_seqs, runner.num_spec, runner.model.cfg
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    shapes = sorted({(1, n) for n in range(1, K + 2)} | {(S, 1), (S, K + 1)})  # every K at batch 1
    # at one count, the one-request shape (the same drafts per request) speaks for both
    counts: dict[int, tuple[int, int]] = {}
    for b, n in shapes:
        counts.setdefault(b * n, (b, n))
    held = [list(state.blocks[s]) for s in range(S)]  # managed: none; calibration borrows one each
    try:
        for s in range(S):
            state.assign(s, held[s] or [s % state.num_blocks])
        # contexts ctx - 3 .. ctx, one per timed run: every phase of the CSA layers' compression
        # (a 1-token step compresses at one position in 4), so the average is serving's; the
        # last position written stays inside the borrowed block and max_len
        ctx = max(0, min(state.block_size, state.max_len) - K - 2)
        _time_dispatches(runner, list(counts.values()), ctx, ids, repeats)
    finally:
        for s in range(S):
            state.free(s)
            state.assign(s, held[s])
    if params is not None:
        dev = runner.device
        with torch.random.fork_rng(devices=[dev] if dev.type != "cpu" else [], device_type=dev.type):
            _calibrate_host(runner, params, list(counts.values()), ids, ctx, repeats)


def _time_dispatches(runner: "Runner", shapes: list[tuple[int, int]], ctx: int, ids, repeats: int) -> None:
    """`verify` and `draft` at each (b requests, n tokens) of `shapes` (see `calibrate`). The
    shapes take turns, one timed run each per round (of those with runs left), so that a
    burst of other work on the machine slows every shape a little (the level, which serving
    re-learns) rather than one shape a lot (the shape, which it keeps): timed one shape after
    another, a burst once made 4 tokens look cheaper than 2 and 3 and auto ran K = 3 where
    K = 1 was best."""
    pol, state, dev = runner.policy, runner.state, runner.device
    has_mtp = runner.model.has_mtp
    # 1-token steps are also timed alone, as K = 0 runs them: no MTP dispatch between two steps
    # (its weights push the main model's out of the caches: 10% dearer on the embedded model)
    plan = [(b, n, mtp) for b, n in shapes for mtp in ((True, False) if n == 1 and has_mtp else (has_mtp,))]
    plan.sort(key=lambda p: p[2])  # the alone runs first in each round
    alone = lambda p: has_mtp and not p[2]  # noqa: E731
    times: dict[tuple[int, int, bool], list[tuple[float, float]]] = {p: [] for p in plan}  # (verify, draft) a run

    def run(b: int, n: int, mtp: bool, rep: int) -> tuple[float, float]:
        at = max(0, ctx - rep % 4)  # consecutive runs cover every phase of the compression
        rows = [(s, at, ids(n)) for s in range(b)]
        for s in range(b):
            state.assume(s, at)
        last = torch.arange(n - 1, b * n, n, device=dev)  # the row each request drafts from
        t = time.perf_counter()
        hidden, logits = runner._forward(Batch.build(rows, dev), None, decode=True)
        logits.argmax(dim=-1).tolist()
        t_draft = time.perf_counter()
        if mtp:
            _, lg = runner._mtp_forward(Batch.build(rows, dev), hidden, last)
            lg.argmax(dim=-1).tolist()
        return t_draft - t, time.perf_counter() - t_draft

    run(1, 1, has_mtp, 0)  # untimed: the process's first dispatch is cold (it set no run count)
    runs = {}
    for p in plan:  # a warm-up run of each; every rank makes as many runs (each runs collectives)
        t = time.perf_counter()
        run(*p, 0)
        warm = parallel.all_reduce_max(torch.tensor([time.perf_counter() - t], device=dev))
        runs[p] = _timed_runs(float(warm[0]), repeats)
    for rep in range(1, 1 + max(runs.values())):
        now = [p for p in plan if rep <= runs[p]]  # the entries with runs left (`_timed_runs`)
        # each timed run follows what it follows in serving: an alone run a dispatch without
        # the MTP (K = 0), any other a dispatch with it; untimed runs set that up (the plan runs
        # the alone entries first)
        if now and alone(now[0]):
            run(1, 1, False, rep)
        for i, p in enumerate(now):
            if has_mtp and p[2] and i and alone(now[i - 1]):
                run(1, 1, True, rep)
            times[p].append(run(*p, rep))
    for b, n in shapes:  # verify from the alone runs where there are some; the draft from the MTP's
        verify = times.get((b, n, False)) or times[(b, n, has_mtp)]
        pol.verify.calibrate(b * n, _typical([v for v, _ in verify]))
        if has_mtp:
            pol.draft.calibrate(b * n, _typical([d for _, d in times[(b, n, True)]]))


SHAPE_BUDGET = 0.5  # seconds of timed runs a shape may take before fewer than `repeats` are made


def _timed_runs(warmup: float, repeats: int) -> int:
    """How many runs to time after a warm-up that took `warmup` seconds: `repeats`, fewer when
    they would take over SHAPE_BUDGET (a large model's dispatch lasts long enough that one
    run's noise is small next to it, and its calibration would otherwise hold up the start
    for tens of seconds: docs/serving.md, 'dsv4/engine/spec/calibration.py'), never fewer than one."""
    return max(1, min(repeats, int(SHAPE_BUDGET / max(warmup, 1e-9))))


def _typical(xs: list[float]) -> float:
    """The mean of the runs within 1.5x their median: each phase counts, a run a neighbour's
    burst of work slowed down does not (an example: docs/serving.md,
    'dsv4/engine/spec/calibration.py')."""
    med = sorted(xs)[len(xs) // 2]
    kept = [x for x in xs if x <= 1.5 * med]
    return sum(kept) / len(kept)


def _calibrate_host(runner: "Runner", params: SamplingParams, shapes, ids, ctx: int, repeats: int) -> None:
    """`verify_host` and `draft_host` from `params` on random logits, peaked as a language
    model's are (a top-p nucleus of a few tokens; see the module docstring)."""
    pol, V, dev = runner.policy, runner.model.cfg.vocab_size, runner.device
    proposed: set[int] = set()
    for b, n in shapes:
        reqs = []
        for s in range(b):
            r = Request(("calibration", s), ids(ctx), params)
            r.output_ids, r.slot, r.num_computed_tokens = ids(16), s, ctx + 15
            reqs.append(r)
        samples = [(r, i * n, n, ids(n - 1)) for i, r in enumerate(reqs)]
        logits = 8 * torch.randn(b * n, V, generator=torch.Generator().manual_seed(1)).to(dev)
        pol.verify_host.calibrate(b * n, _best(lambda: sample_verify(samples, logits, {}), repeats))
        if b not in proposed:  # one draft per request: by requests only
            proposed.add(b)
            outs, pos = [r.output_ids for r in reqs], [ctx + 16] * b
            pol.draft_host.calibrate(b, _best(lambda: propose(logits[:b], reqs, outs, pos), repeats))
