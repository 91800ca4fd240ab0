"""Weights quantised to int8 rows at load by the C++ extension (`dsv4/model/int8_rows.py`,
`csrc/int8_rows.cpp`): every path gives the torch code's bits (dequantize_fp8, then
kernels.quantize_rows) for FP8, bfloat16 and float32 sources, NaN rows keep a NaN scale,
what it cannot take is left to the torch code untouched, and a model loads the same bits
with the extension as without it.

Marked `exact`: test.sh reruns them under ATEN_CPU_CAPABILITY=avx2 and =default."""

from __future__ import annotations

import pytest
import torch

from dsv4.model import fp4_kernel as fk
from dsv4.model import int8_rows, kernels, quant
from dsv4.model.loader import load_model
from tests.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.exact

ISAS = fk.available_isas()
needs_ext = pytest.mark.skipif(not ISAS, reason=f"the C++ extension is not loaded: {fk.backend()}")


def _reference(src: torch.Tensor, fp8_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch code the loader ran before (and runs without the extension)."""
    w = quant.dequantize_fp8(src, fp8_scale) if fp8_scale is not None else src.float().clone()
    return kernels.quantize_rows(w, scratch=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.view(torch.int32)[~na], b.view(torch.int32)[~nb])


def _sources(rows: int, cols: int, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.1
    w[min(1, rows - 1)] = 0  # an all-zero row: the amax floor
    w[rows // 2, : max(1, cols // 3)] *= 1e4  # a row dominated by a few large values
    w8, scale = quant.quantize_fp8(w)
    sb = scale.view(torch.uint8)
    sb[0, 0] = 0  # 2^-127: denormal products
    if sb.shape[1] > 1:
        sb[0, -1] = 254  # 2^127: products that overflow to inf (row 0's scale is inf)
    if sb.shape[0] > 1:
        sb[1, 0] = 250  # large but finite: rows 128.. keep finite scales
    return [("fp8", w8, scale), ("bf16", w.bfloat16(), None), ("f32", w, None)]


@needs_ext
@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 5), (128, 128), (129, 300), (300, 1000), (257, 4097)])
def test_every_path_gives_the_torch_codes_bits(rows, cols):
    for kind, src, scale in _sources(rows, cols, rows * cols):
        rq, rs = _reference(src, scale)
        for isa in ISAS:
            q = torch.full((rows, cols), 99, dtype=torch.int8)
            s = torch.empty(rows)
            assert int8_rows.into(src, q, s, fp8_scale=scale, isa=isa)
            ok = torch.isfinite(rs)  # a row with a NaN or inf has a non-finite scale (refused at load): its q is moot
            assert torch.equal(q[ok], rq[ok]), f"{kind} {isa} {rows}x{cols}"
            assert _same(s, rs), f"{kind} {isa} {rows}x{cols}"


@needs_ext
def test_rows_are_read_and_written_through_strides_and_threads_do_not_matter():
    _, w8, scale = _sources(256, 640, 3)[0]
    wide = torch.zeros(256, 1000, dtype=torch.float8_e4m3fn)
    wide[:, 100:740] = w8
    src = wide[:, 100:740]  # rows 1000 apart
    rq, rs = _reference(w8, scale)
    fused = torch.zeros(300, 640, dtype=torch.int8)  # a fused projection's rows 20..276
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            fused.zero_()
            s = torch.empty(256)
            assert int8_rows.into(src, fused[20:276], s, fp8_scale=scale)
            ok = torch.isfinite(rs)  # block (0, -1) overflows in rows 0..127 (their q is moot)
            assert torch.equal(fused[20:276][ok], rq[ok]) and _same(s, rs) and ok.sum() >= 128
            assert not fused[:20].any() and not fused[276:].any()
    finally:
        torch.set_num_threads(threads)


@needs_ext
def test_a_nan_makes_its_rows_scale_nan_and_leaves_the_others():
    g = torch.Generator().manual_seed(5)
    w8, scale = quant.quantize_fp8(torch.randn(300, 256, generator=g))
    w8.view(torch.uint8)[3, 17] = 0x7F  # e4m3's NaN
    scale.view(torch.uint8)[1, 1] = 255  # E8M0's NaN: rows 128..255, columns 128..255
    rq, rs = _reference(w8, scale)
    nan = torch.zeros(300, dtype=torch.bool)
    nan[3], nan[128:256] = True, True
    assert torch.equal(torch.isnan(rs), nan)
    for isa in ISAS:
        q, s = torch.empty(300, 256, dtype=torch.int8), torch.empty(300)
        assert int8_rows.into(w8, q, s, fp8_scale=scale, isa=isa)
        assert _same(s, rs) and torch.equal(q[~nan], rq[~nan]), isa
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g)
    w[2, 5] = float("nan")
    q, s = torch.empty(6, 64, dtype=torch.int8), torch.empty(6)
    assert int8_rows.into(w.bfloat16(), q, s)
    rq, rs = _reference(w.bfloat16(), None)
    assert torch.isnan(s[2]) and _same(s, rs) and torch.equal(q[[0, 1, 3, 4, 5]], rq[[0, 1, 3, 4, 5]])


def test_what_it_cannot_take_is_left_to_the_torch_code():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 256, generator=g)
    w8, scale = quant.quantize_fp8(w)
    q, s = torch.full((256, 256), 7, dtype=torch.int8), torch.full((256,), 7.0)
    cases = [
        (w.half(), q, s, None),                      # no float16 path
        (w.t(), q, s, None),                         # columns not contiguous
        (w8, q, s, scale[:1]),                       # the block scales' shape
        (w8, q, s, None),                            # FP8 without its scales
        (w8, q, s, scale.view(torch.uint8).float()),  # scales of another dtype
        (w, q[:, :128], s, None),                    # q's shape
        (w, q, s[:10], None),                        # s's shape
        (w, q.float(), s, None),                     # q's dtype
        (w, torch.empty(256, 512, dtype=torch.int8)[:, ::2], s, None),  # q's columns not contiguous
    ]
    for src, qq, ss, sc in cases:
        assert int8_rows.into(src, qq, ss, fp8_scale=sc) is False
    assert (q == 7).all() and (s == 7).all()  # nothing written
    assert int8_rows.into(w, q, s, isa="torch") is False


@pytest.mark.parametrize("quantization", ["w8a8", "w8a8-mxfp4"])
def test_a_model_loads_the_same_bits_without_the_extension(tmp_path, monkeypatch, quantization):
    """The loader's FP8 conversion and the draft head's quantisation: the extension's bits
    are the torch code's (DSV4_FP4_ISA=torch forces it everywhere)."""
    write_tiny_checkpoint(tmp_path, quantize=True, with_tokenizer=False, head_bf16=True)
    fast = load_model(tmp_path, quantization=quantization, pack=False)
    monkeypatch.setenv("DSV4_FP4_ISA", "torch")
    slow = load_model(tmp_path, quantization=quantization, pack=False)
    a, b = fast.state_dict(), slow.state_dict()
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k
    assert fast.draft_head is not None and fast.draft_head.keys() == slow.draft_head.keys()
    for k, v in fast.draft_head.items():
        assert torch.equal(v, slow.draft_head[k]), k
