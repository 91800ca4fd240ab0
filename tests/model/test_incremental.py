"""The stateful path against itself: chunked == whole, prefill + decode == forward,
rollback leaves no trace, batched decode == single decode."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.state import Batch
from tests.model.conftest import bound, prefill

pytestmark = pytest.mark.exact  # also run under other CPU kernels (test.sh)

V = 128


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _snap_equal(model, a: dict, b: dict, ids: list[int], plan: list[int]) -> None:
    """Slot snapshots a and b equal: to 1e-5 in float32; under w8a8 each tensor within its
    quantisation error (the w8a8 against the float32 state after prefilling `ids` by `plan`)."""
    assert a.keys() == b.keys()
    twin = getattr(model, "float_twin", None)
    if twin is not None:
        st = twin.new_state(1, 256, max_chunk=max(plan))
        prefill(twin, st, 0, ids, plan)
        ref = st.snapshot(0)
    for k in a:
        assert a[k].shape == b[k].shape, k
        tol = bound(model, ids) if twin is None else _max_diff(b[k], ref[k])
        assert _max_diff(a[k], b[k]) <= tol, (k, _max_diff(a[k], b[k]), tol)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


W = 12  # tiny sliding window
PLANS = {
    "ones": [1] * 100,
    "irregular": [7, 1, 9, 2, 16, 3, 30, 32],
    "around_window": [W - 1, 1, W + 1, W - 1, 1, W + 1, 100 - 4 * W - 2],
    "whole": [100],
}


@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
def test_chunked_prefill_equals_whole(tiny_model, plan):
    ids = _ids(100)
    whole = tiny_model(torch.tensor([ids]))[0]
    state = tiny_model.new_state(2, 256, max_chunk=100)
    _, logits = prefill(tiny_model, state, 1, ids, plan)
    assert (logits - whole).abs().max().item() <= bound(tiny_model, ids)
    ref_state = tiny_model.new_state(2, 256, max_chunk=100)
    prefill(tiny_model, ref_state, 1, ids, [100])
    _snap_equal(tiny_model, state.snapshot(1), ref_state.snapshot(1), ids, [100])


@pytest.mark.parametrize("k,step", [(37, 1), (40, 3), (1, 1), (63, 5)])
def test_prefill_then_decode_equals_forward(tiny_model, k, step):
    ids = _ids(90, seed=3)
    whole = tiny_model(torch.tensor([ids]))[0]
    state = tiny_model.new_state(1, 128, max_chunk=64)
    _, first = prefill(tiny_model, state, 0, ids[:k], [k])
    outs = [first]
    pos = k
    while pos < len(ids):
        n = min(step, len(ids) - pos)
        _, lg = tiny_model.forward_batch(Batch.build([(0, pos, ids[pos:pos + n])]), state)
        outs.append(lg)
        pos += n
    assert (torch.cat(outs) - whole).abs().max().item() <= bound(tiny_model, ids)


@pytest.mark.parametrize("k", [29, 30, 31, 45])  # rolled-back tokens close CSA(4) / HCA(8) windows
@pytest.mark.parametrize("one_dispatch", [True, False])
def test_rollback_leaves_no_trace(tiny_model, k, one_dispatch):
    ids = _ids(k + 6, seed=5)
    wrong = [(t + 17) % (V - 2) + 2 for t in ids[k + 1:k + 3]]
    state = tiny_model.new_state(1, 128, max_chunk=64)
    prefill(tiny_model, state, 0, ids[:k], [k])
    # decode 3 tokens: the true next one plus two that will be rejected
    spec = [ids[k]] + wrong
    if one_dispatch:
        tiny_model.forward_batch(Batch.build([(0, k, spec)]), state)
    else:
        for i, t in enumerate(spec):
            tiny_model.forward_batch(Batch.build([(0, k + i, [t])]), state)
    state.rollback(0, k + 1)
    _, lg = tiny_model.forward_batch(Batch.build([(0, k + 1, ids[k + 1:k + 6])]), state)
    whole = tiny_model(torch.tensor([ids]))[0]
    assert (lg - whole[k + 1:k + 6]).abs().max().item() <= bound(tiny_model, ids)
    ref = tiny_model.new_state(1, 128, max_chunk=64)
    prefill(tiny_model, ref, 0, ids, [k + 6])
    _snap_equal(tiny_model, state.snapshot(0), ref.snapshot(0), ids, [k + 6])


@pytest.mark.parametrize("span", [2048, 16])  # 16: rows of contexts 5..64 attend in groups by context
def test_batched_decode_equals_single(tiny_model, span, monkeypatch):
    from dsv4.model import attention

    monkeypatch.setattr(attention, "SPAN_MIN", span)
    if span == 16:  # one dispatch of four groups and a long row (a prefill chunk) beside them
        b = Batch.build([(0, 3, [1]), (1, 40, [2, 3]), (2, 100, list(range(9))), (3, 17, [4])])
        long_rows, groups = attention.split_rows(b)
        assert long_rows == [(2, 100, 9, 3)]
        assert [(g.tolist(), top) for g, top in groups] == [([0], 3), ([1, 2], 41), ([12], 17)]
    lens = [5, 33, 64, 17]
    prompts = [_ids(n + 4, seed=10 + i) for i, n in enumerate(lens)]
    batched = tiny_model.new_state(4, 128, max_chunk=64)
    for s, (n, p) in enumerate(zip(lens, prompts)):
        prefill(tiny_model, batched, s, p[:n], [n])
    outs = []
    for step in range(4):  # 4 decode steps, 1 token per row, all rows in one dispatch
        rows = [(s, n + step, [p[n + step]]) for s, (n, p) in enumerate(zip(lens, prompts))]
        outs.append(tiny_model.forward_batch(Batch.build(rows), batched)[1])
    # multi-token rows of different sizes in one dispatch
    rows = [(s, n + 4, _ids(1 + s, seed=99 + s)) for s, n in enumerate(lens)]
    mixed = tiny_model.forward_batch(Batch.build(rows), batched)[1]
    for s, (n, p) in enumerate(zip(lens, prompts)):
        alone = tiny_model.new_state(1, 128, max_chunk=64)
        prefill(tiny_model, alone, 0, p[:n], [n])
        for step in range(4):
            lg = tiny_model.forward_batch(Batch.build([(0, n + step, [p[n + step]])]), alone)[1]
            assert (lg[0] - outs[step][s]).abs().max().item() <= bound(tiny_model, p[:n + step + 1])
        lg = tiny_model.forward_batch(Batch.build([(0, n + 4, rows[s][2])]), alone)[1]
        off = sum(1 + j for j in range(s))
        assert (lg - mixed[off:off + 1 + s]).abs().max().item() <= bound(tiny_model, p[:n + 4] + rows[s][2])


def test_state_rejects_gaps(tiny_model):
    state = tiny_model.new_state(1, 64, max_chunk=16)
    prefill(tiny_model, state, 0, _ids(8), [8])
    with pytest.raises(ValueError, match="holds 8 positions"):
        tiny_model.forward_batch(Batch.build([(0, 9, [5])]), state)
    with pytest.raises(ValueError, match="roll slot 0 forward"):
        state.rollback(0, 9)


def test_mixed_dispatch_of_chunks_and_decodes(tiny_model):
    """Prefill chunks (attending per row) and decode rows (gathering per token) in one dispatch."""
    a, b, c = _ids(70, seed=21), _ids(40, seed=22), _ids(30, seed=23)
    state = tiny_model.new_state(3, 128, max_chunk=64)
    prefill(tiny_model, state, 1, b[:37], [37])
    prefill(tiny_model, state, 2, c[:20], [20])
    rows = [(0, 0, a[:40]), (1, 37, b[37:40]), (2, 20, [c[20]])]
    _, lg = tiny_model.forward_batch(Batch.build(rows), state)
    _, lg2 = tiny_model.forward_batch(Batch.build([(0, 40, a[40:70]), (2, 21, c[21:30])]), state)
    for slot, ids, got in ((0, a, torch.cat([lg[:40], lg2[:30]])), (1, b[:40], lg[40:43]), (2, c, torch.cat([lg[43:44], lg2[30:]]))):
        whole = tiny_model(torch.tensor([ids]))[0]
        assert (got - whole[-got.shape[0]:]).abs().max().item() <= bound(tiny_model, ids), slot


def test_static_dispatch_equals_built(tiny_model):
    """The compiled step's dispatch (`Batch.static_step`: no host rows, masks over the whole
    entry table, every token pooling its window into the entry row it closes or a spare one),
    run uncompiled, equals the same rows built from the host, on every bucket shape the
    engine compiles (1 + K tokens a row, several rows, tokens closing CSA and HCA windows)."""
    lens = [29, 6, 47]
    prompts = [_ids(n + 12, seed=40 + i) for i, n in enumerate(lens)]
    built, static = (tiny_model.new_state(4, 128, max_chunk=64, max_spec=3) for _ in range(2))
    for st in (built, static):
        for s, (n, p) in enumerate(zip(lens, prompts)):
            prefill(tiny_model, st, s, p[:n], [n])
    done = [0, 0, 0]
    for k in (1, 3, 2, 4):  # tokens a row; the rows' positions cross window closes of 4 and 8
        rows = [(s, n + done[s], p[n + done[s]:n + done[s] + k]) for s, (n, p) in enumerate(zip(lens, prompts))]
        ref_h, ref = tiny_model.forward_batch(Batch.build(rows), built)
        b = Batch.build(rows)
        static.begin(b)
        h, got = tiny_model.forward_batch(Batch.static_step(b.input_ids, b.positions, b.slots, static.max_len), static)
        seen = [p[:n + done[s] + k] for s, (n, p) in enumerate(zip(lens, prompts))]
        tol = max(bound(tiny_model, ids) for ids in seen)
        assert (got - ref).abs().max().item() <= tol, k
        done = [d + k for d in done]
    for s, (n, p) in enumerate(zip(lens, prompts)):
        _snap_equal(tiny_model, static.snapshot(s), built.snapshot(s), p[:n + done[s]], [n + done[s]])
