"""The compiler-ready decode dispatch (`dsv4.model.static_step`, run here uncompiled: no
compile time) against the eager model on the same state: hidden streams, logits and the
state it writes agree to 1e-4 (fp32; only the summation order differs, e.g. masked
entries in the softmax, the experts' matmuls), and the argmax of every row is the same.
Shapes: decode rows of 1..4 tokens of 1..4 requests at positions that close compressed
windows of both ratios, and the MTP's draft dispatch."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.model import DeepseekV4, init_random
from dsv4.model.state import Batch
from dsv4.model.static_step import StaticStep, _sinkhorn
from dsv4.model.layers import sinkhorn
from tests.model.conftest import prefill
from tests.model.tiny import tiny_config

TOL = 1e-4
PROMPTS = [37, 40, 45, 50]  # the last tokens close windows of ratio 4 and 8 as decoding goes on


@pytest.fixture(scope="module", params=["plain", "fused"])
def setup(request):
    torch.manual_seed(0)
    model = init_random(DeepseekV4(tiny_config()), seed=0).eval()
    if request.param == "fused":
        model.fuse_projections()
    state = model.new_state(5, 128, max_chunk=16, max_spec=4)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for s, n in enumerate(PROMPTS):
            ids = torch.randint(3, 128, (n + 1,), generator=g).tolist()
            h, _ = prefill(model, state, s, ids[:n], [16] * (n // 16) + [n % 16])
            for lo in range(0, n, 16):
                model.mtp_forward(Batch.build([(s, lo, ids[lo + 1:min(lo + 16, n) + 1])]), h[lo:lo + 16], state)
    return model, state, StaticStep(model, state)


def _rows(state, rows, n, mtp=False):
    """Roll every row back to its prompt and build a dispatch of n tokens each."""
    out = []
    for s in range(rows):
        start = PROMPTS[s]
        state.rollback(s, start, mtp_length=min(state.mtp_lengths[s], start))
        out.append((s, start, [(7 * s + 3 * j) % 120 + 3 for j in range(n)]))
    return out


@pytest.mark.parametrize("rows,n", [(1, 1), (1, 2), (1, 4), (4, 1), (2, 3), (4, 2), (4, 5)])  # (4, 5): dense MoE
def test_main_dispatch_equals_eager(setup, rows, n):
    model, state, st = setup
    with torch.inference_mode():
        spec = _rows(state, rows, n)
        he, le = model.forward_batch(Batch.build(spec), state)
        want = [{k: v.clone() for k, v in state.snapshot(s).items()} for s in range(rows)]
        b = Batch.build(_rows(state, rows, n))
        state.begin(b)
        hs, ls = st.main(b.input_ids, b.positions, b.slots)
        got = [state.snapshot(s) for s in range(rows)]
    torch.testing.assert_close(hs, he, atol=TOL, rtol=0)
    torch.testing.assert_close(ls, le, atol=TOL, rtol=0)
    assert torch.equal(ls.argmax(-1), le.argmax(-1))
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for k in w:
            torch.testing.assert_close(g[k], w[k], atol=TOL, rtol=0, msg=k)


@pytest.mark.parametrize("rows,n", [(1, 1), (1, 2), (3, 2)])
def test_mtp_dispatch_equals_eager(setup, rows, n):
    model, state, st = setup
    hid = torch.randn(rows * n, model.cfg.hc_mult, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ze, le = model.mtp_forward(Batch.build(_rows(state, rows, n)), hid, state)
        want = [state.snapshot(s)["mtp.win"].clone() for s in range(rows)]
        b = Batch.build(_rows(state, rows, n))
        state.begin(b, mtp=True)
        zs, ls = st.mtp(b.input_ids, b.positions, b.slots, hid)
    torch.testing.assert_close(zs, ze, atol=TOL, rtol=0)
    torch.testing.assert_close(ls, le, atol=TOL, rtol=0)
    for s, w in enumerate(want):
        torch.testing.assert_close(state.snapshot(s)["mtp.win"], w, atol=TOL, rtol=0)


def test_sinkhorn_bit_identical():
    """The tensor Sinkhorn does the eager float64 arithmetic in the same order: equal bits."""
    z = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(3))
    for T in (1, 2, 6):
        assert torch.equal(_sinkhorn(z[:T], 20, 1e-6), sinkhorn(z[:T], 20, 1e-6))
