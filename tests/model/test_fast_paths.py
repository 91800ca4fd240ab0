"""The decode fast paths against the plain ones: fused projections, the two float64
Sinkhorn implementations, in-place RoPE and the single-token MoE path."""

from __future__ import annotations

import pytest
import torch

from dsv4.model import layers
from dsv4.model.layers import apply_rope, sinkhorn
from dsv4.model.model import DeepseekV4, init_random
from dsv4.model.moe import GATHER_MAX, gathered
from dsv4.model.state import Batch
from dsv4.model.w8a8 import to_w8a8
from tests.model.tiny import tiny_config

pytestmark = pytest.mark.exact  # also run under other CPU kernels (test.sh)


def _pair() -> tuple[DeepseekV4, DeepseekV4]:
    plain = init_random(DeepseekV4(tiny_config()), seed=0).eval()
    fused = init_random(DeepseekV4(tiny_config()), seed=0).eval().fuse_projections()
    return plain, fused


def test_fusion_keeps_weights_and_memory():
    plain, fused = _pair()
    a, b = plain.state_dict(), fused.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    attn = fused.layers[1].attn  # a CSA layer: seven projections of x in one weight
    w = attn.fused.weight
    mods = attn._x_linears()
    assert len(mods) == 7 and w.shape[0] == sum(m.weight.shape[0] for m in mods)
    for m in mods:  # views into the fused weight, not copies
        assert m.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in fused.parameters()}
    n_plain = sum(p.numel() * p.element_size() for p in plain.parameters())
    assert sum(storages.values()) == n_plain  # memory did not grow
    expert = fused.layers[0].ffn.experts[3]
    assert expert.w1.weight.untyped_storage().data_ptr() == expert.w3.weight.untyped_storage().data_ptr()


def test_fused_model_matches_plain():
    plain, fused = _pair()
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(plain(ids), fused(ids), atol=1e-5, rtol=0)
    outs = []
    for m in (plain, fused):
        st = m.new_state(1, 64, max_chunk=40)
        with torch.inference_mode():
            m.forward_batch(Batch.build([(0, 0, ids[0, :39].tolist())]), st)
            _, lg = m.forward_batch(Batch.build([(0, 39, [int(ids[0, 39])])]), st)
        outs.append(lg)
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=0)


def test_fusion_never_goes_stale():
    """Replaced parameters (deepcopy, .to, assign) and training fall back to the plain path."""
    import copy

    plain, fused = _pair()
    ids = torch.randint(2, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    twin = copy.deepcopy(fused)  # parameters cloned: no longer views of the fused weights
    other = init_random(DeepseekV4(tiny_config()), seed=5).eval()
    twin.load_state_dict(other.state_dict())
    assert torch.allclose(twin(ids), other(ids), atol=1e-5, rtol=0)
    grads = []
    for m in (plain, fused):  # training through a fused model: the same gradients as plain
        with torch.enable_grad():
            m.forward_batch(Batch.whole(ids), None)[1].square().mean().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert sum(g is not None for g in grads[0].values()) > 100
    for n, g in grads[0].items():
        assert (g is None) == (grads[1][n] is None), n
        assert g is None or torch.allclose(g, grads[1][n], atol=1e-6, rtol=1e-4), n


@pytest.mark.parametrize("T", [1, 2])
def test_sinkhorn_python_and_numpy_agree_bitwise(T, monkeypatch):
    g = torch.Generator().manual_seed(T)
    for scale in (0.1, 1.0, 5.0):
        c = torch.randn(T, 4, 4, generator=g) * scale
        fast = sinkhorn(c, 20, 1e-6)
        monkeypatch.setattr(layers, "SINKHORN_PY_MAX", 0)
        slow = sinkhorn(c, 20, 1e-6)
        monkeypatch.undo()
        assert torch.equal(fast, slow)
        # and the float32 torch path (training) computes the same projection
        ref = sinkhorn(c.clone().requires_grad_(), 20, 1e-6).detach()
        assert torch.allclose(fast, ref, atol=1e-6, rtol=0)
        assert torch.allclose(fast.sum(-2), torch.ones(T, 4), atol=1e-5)  # columns normalised last


@pytest.mark.parametrize("T", [6, 70])  # numpy's sum, then the sliced sums of prefill chunks
def test_sinkhorn_row_does_not_depend_on_batch(T):
    c = torch.randn(T, 4, 4, generator=torch.Generator().manual_seed(0)) * 3
    many = sinkhorn(c, 20, 1e-6)
    for i in range(T):
        assert torch.equal(sinkhorn(c[i:i + 1], 20, 1e-6)[0], many[i])  # Python path


def _rotation(T: int, r: int, seed: int = 0) -> tuple[layers.Rotation, torch.Tensor]:
    """Rotations of T random positions for r rotary dims, and the same as complex64 [T, r/2]."""
    table = layers.RopeTable(r, 10000.0, None)
    pos = torch.randint(0, 5000, (T,), generator=torch.Generator().manual_seed(seed))
    rot = table.rotation(pos)
    angles = pos[:, None].float() * table.inv_freq
    return rot, torch.polar(torch.ones_like(angles), angles)


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_is_the_complex_product(inverse):
    """The real-table RoPE is x * e^{i pos f} on interleaved pairs (its conjugate when inverse)."""
    rot, cis = _rotation(5, 8)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(1))
    pairs = torch.view_as_complex(x[..., 8:].reshape(5, 3, 4, 2).contiguous())
    ref = torch.view_as_real(pairs * (cis.conj() if inverse else cis).unsqueeze(1)).flatten(-2)
    got = apply_rope(x, rot, inverse)
    assert torch.equal(got[..., :8], x[..., :8])
    assert torch.allclose(got[..., 8:], ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_inplace_rope_equals_out_of_place(dtype, inverse):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g).to(dtype)
    rot, _ = _rotation(5, 8)
    ref = apply_rope(x, rot, inverse)
    with torch.inference_mode():
        got = apply_rope(x.clone(), rot, inverse, inplace=True)
    assert torch.equal(got, ref)
    assert torch.equal(got[..., :8], x[..., :8])  # the non-rotary dims are untouched


def test_inplace_rope_keeps_autograd():
    x = torch.randn(2, 8, requires_grad=True)
    rot, _ = _rotation(2, 4)
    y = apply_rope(x * 1.0, rot, inplace=True)  # tracked: falls back to out-of-place
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("T", [1, 2, 7])
def test_traced_sinkhorn_is_the_eager_one_bitwise(T):
    """The compiled step's Sinkhorn (tensor ops, unrolled float64 sums) computes the same bits
    as the eager Python and numpy paths."""
    g = torch.Generator().manual_seed(T)
    for scale in (0.1, 1.0, 5.0):
        c = torch.randn(T, 4, 4, generator=g) * scale
        unrolled = layers._sinkhorn_unrolled(torch.softmax(c, dim=-1), 20, 1e-6)
        assert torch.equal(unrolled, sinkhorn(c, 20, 1e-6))


def test_single_token_moe_equals_grouped():
    _, fused = _pair()
    moe = fused.layers[1].ffn  # a score-routed layer
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([5, 9, 77])
    with torch.inference_mode():
        grouped = moe(x, ids)
        single = torch.cat([moe(x[i:i + 1], ids[i:i + 1]) for i in range(3)])
    assert torch.allclose(grouped, single, atol=1e-6, rtol=1e-6)  # a few float32 ulps: matmuls of 1 and 3 rows


@pytest.mark.parametrize("opaque", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("T", [1, 3, 40])  # 40 x top-2 > GATHER_MAX x 8 experts: the dense form
def test_traced_moe_equals_eager(quantized, T, opaque, monkeypatch):
    """The compiled step's MoE (`gathered`: the chosen experts' stacked weights, no host reads)
    adds the same shares as the eager grouped MoE, float32 and int8; for large experts it is
    the opaque op `dsv4::moe_routed`, the eager arithmetic itself: equal bit for bit."""
    if opaque:
        monkeypatch.setattr("dsv4.model.moe.OPAQUE_MIN_BYTES", 0)
    model = init_random(DeepseekV4(tiny_config()), seed=0).eval()
    if quantized:
        to_w8a8(model)
    model.fuse_projections()
    moe = model.layers[1].ffn  # a score-routed layer
    assert (T * moe.gate.k > GATHER_MAX * len(moe.experts)) == (T == 40)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, 100, (T,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = moe(x, ids)
        weights, idx = moe.gate(x, ids)
        got = gathered(layers.f32(moe.shared_experts(x)), x, weights, idx, moe)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    if opaque:
        assert torch.equal(got, ref)


def test_opaque_moe_on_one_ranks_experts_equals_eager(monkeypatch):
    """Under expert parallelism the opaque op takes the global expert ids and runs this rank's
    experts only (no zero-weight GEMMs for the others'): equal to the eager grouped MoE."""
    monkeypatch.setattr("dsv4.model.moe.OPAQUE_MIN_BYTES", 0)
    model = init_random(DeepseekV4(tiny_config()), seed=0).eval()
    moe = model.layers[1].ffn
    moe.local = range(2, 6)  # this rank's experts
    moe.fuse()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, 100, (5,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = moe(x, ids)
        weights, idx = moe.gate(x, ids)
        got = gathered(layers.f32(moe.shared_experts(x)), x, weights, idx, moe)
    assert torch.equal(got, ref)
