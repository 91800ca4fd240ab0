"""The fused FP4 GEMMs (`dsv4/model/fp4_kernel.py`, `csrc/fp4_gemm.cpp`): linear_a8's exact
contract on every C++ path and the torch fallback bit for bit, rows independent of the
batch, linear_f within float rounding, the choice of path, and one-line errors.

Marked `exact`: test.sh reruns them under ATEN_CPU_CAPABILITY=avx2 and =default, where
`backend()` must pick the capped path. The C++ paths are all run whatever the cap (each one
this CPU supports); without a built extension only the fallback is tested here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsv4.model import fp4_kernel as fk
from dsv4.model.kernels import quantize_tokens
from dsv4.model.quant import E8M0, dequantize_fp4, e8m0_bytes

pytestmark = pytest.mark.exact

ISAS = fk.available_isas()
PATHS = ISAS + ["torch"]
needs_ext = pytest.mark.skipif(not ISAS, reason=f"the C++ extension is not loaded: {fk.backend()}")


def _weight(n: int, k: int, g: torch.Generator, lo: int = 110, hi: int = 135, int8: bool = True):
    """A random packed FP4 weight [n, k/2] (int8 as stored, or uint8) and E8M0 scales [n, k/32]."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, generator=g)
    return (packed.view(torch.int8) if int8 else packed), (scale.view(E8M0) if E8M0 is not None else scale)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs (whatever their payload) in the same places."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.view(torch.int32)[~na], b.view(torch.int32)[~nb])


def _check_paths(xq, xs, packed, scale, ms=(1, 2, 3, 4, 5, 8, 17, 64, 130)) -> None:
    """Every path at every row count: the fallback's bits, and each row as computed alone."""
    alone = {p: fk.linear_a8(xq[:1], xs[:1], packed, scale, isa=p) for p in PATHS}
    for m in ms:
        if m > xq.shape[0]:
            continue
        ref = fk.linear_a8(xq[:m], xs[:m], packed, scale, isa="torch")
        for p in PATHS:
            y = fk.linear_a8(xq[:m], xs[:m], packed, scale, isa=p)
            assert y.dtype == torch.float32 and y.shape == (m, packed.shape[0])
            assert _same_bits(y, ref), f"path {p}, M {m}, weight {tuple(packed.shape)}"
            assert _same_bits(y[:1], alone[p]), f"path {p}: row 0 in a batch of {m} differs from alone"


@pytest.mark.parametrize("k", [32, 64, 96, 2080])
def test_a8_paths_are_the_fallback_bit_for_bit(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(130, k, generator=g) * torch.rand(130, 1, generator=g) * 4
    xq, xs = quantize_tokens(x)
    for i, n in enumerate((1, 7, 33, 100)):
        packed, scale = _weight(n, k, g, int8=i % 2 == 0)
        _check_paths(xq, xs, packed, scale)


def test_a8_adversarial_scales_and_codes():
    """Extreme exponents (denormal 2^-128, overflow to inf, E8M0 255 = NaN), all-zero and
    all -0 blocks, activations at +-127 and -128: the same bits on every path."""
    g = torch.Generator().manual_seed(7)
    n, k = 37, 640
    packed, _ = _weight(n, k, g, int8=False)
    choices = torch.tensor([0, 1, 2, 3, 64, 100, 127, 128, 200, 238, 239, 240, 254, 255], dtype=torch.uint8)
    scale = choices[torch.randint(0, len(choices), (n, k // 32), generator=g)]
    scale[:5] = torch.tensor([0, 1, 254, 255, 127], dtype=torch.uint8)[:, None]  # whole rows too
    packed[5:9, :16] = 0  # zero blocks
    packed[9:13, 16:32] = 0x88  # -0 in both nibbles
    packed[13, :] = 0x77  # +6 everywhere
    packed[14, :] = 0xFF  # -6 everywhere
    xq = torch.randint(-127, 128, (19, k), dtype=torch.int8, generator=g)
    xq[0], xq[1], xq[2, ::2], xq[2, 1::2], xq[3] = 127, -127, 127, -127, -128
    xs = torch.tensor([1e-30, 1e30, 1.0, 2.0**-130] + [0.01] * 15, dtype=torch.float32)[:, None]
    _check_paths(xq, xs, packed, scale, ms=(1, 2, 3, 4, 5, 17, 19))
    y = fk.linear_a8(xq, xs, packed, scale, isa="torch")
    assert torch.isnan(y[:, 3]).all() and not torch.isfinite(y[4:, 2]).all()  # S = 255: NaN; 254: overflows
    assert torch.isfinite(y[:, 0]).all() and (y[4:, 0].abs() < 1e-30).all()  # S = 0: 2^-128, a denormal


def test_a8_is_the_float64_product_within_float32_rounding():
    g = torch.Generator().manual_seed(3)
    n, k = 100, 2048
    packed, scale = _weight(n, k, g, lo=100, hi=140)
    xq, xs = quantize_tokens(torch.randn(9, k, generator=g))
    w = dequantize_fp4(packed, scale).double()
    xf = xq.double() * xs.double()
    ref, mag = xf @ w.t(), xf.abs() @ w.abs().t()
    bound = (k // 32 + 2) * 2.0**-24 * mag  # one rounding a block, and the token scale
    for p in PATHS:
        y = fk.linear_a8(xq, xs, packed, scale, isa=p).double()
        assert ((y - ref).abs() <= bound).all(), p


def test_a8_reads_row_strided_views_in_place():
    """A slice of wider rows (as a memory-mapped, stacked or sharded tensor gives it)."""
    g = torch.Generator().manual_seed(5)
    n, k = 40, 256
    wide_p = torch.randint(0, 256, (n, k // 2 + 48), dtype=torch.uint8, generator=g)
    wide_s = torch.randint(110, 135, (n, k // 32 + 3), dtype=torch.uint8, generator=g)
    packed, scale = wide_p[:, 16:16 + k // 2], wide_s[:, 1:1 + k // 32]
    xq, xs = quantize_tokens(torch.randn(6, k, generator=g))
    ref = fk.linear_a8(xq, xs, packed.contiguous(), scale.contiguous(), isa="torch")
    for p in PATHS:
        assert _same_bits(fk.linear_a8(xq, xs, packed, scale, isa=p), ref), p
        assert torch.allclose(fk.linear_f(xq.float(), packed, scale, isa=p),
                              fk.linear_f(xq.float(), packed.contiguous(), scale.contiguous(), isa=p), rtol=1e-6)


@pytest.mark.parametrize("k", [64, 2080])
def test_f_is_the_float64_product_within_1e5_and_rows_are_independent(k):
    g = torch.Generator().manual_seed(11)
    n = 100
    packed, scale = _weight(n, k, g)
    w = dequantize_fp4(packed, scale).double()
    x = torch.randn(70, k, generator=g)
    x[3] *= 1e-3
    ref = x.double() @ w.t()
    for p in PATHS:
        y = fk.linear_f(x, packed, scale, isa=p)
        assert y.dtype == torch.float32
        err = (y.double() - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)
        assert (err <= 1e-5).all(), f"{p}: {err.max().item():.2e}"
        for m in (1, 2, 3, 5, 17):
            assert torch.equal(fk.linear_f(x[:m], packed, scale, isa=p), y[:m]), f"{p}: M {m}"
        assert torch.equal(fk.linear_f(x[40:41], packed, scale, isa=p), y[40:41]), p


def test_f_takes_bfloat16_and_rounds_once_to_it():
    g = torch.Generator().manual_seed(12)
    packed, scale = _weight(33, 512, g)
    x = torch.randn(5, 512, generator=g).bfloat16()
    ref = x.double() @ dequantize_fp4(packed, scale).double().t()
    for p in PATHS:
        y = fk.linear_f(x, packed, scale, isa=p)
        assert y.dtype == torch.bfloat16
        assert ((y.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-5 * ref.abs().amax(dim=1, keepdim=True)).all(), p


@needs_ext
def test_backend_names_the_path_and_honours_the_caps(monkeypatch):
    best = ISAS[-1]
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    expected = {"default": "scalar", "avx2": "avx2" if "avx2" in ISAS else "scalar"}.get(cap, best)
    if not os.environ.get("DSV4_FP4_ISA"):
        assert fk.backend() == f"fp4 GEMM: C++ {expected}"
    assert fk._choose("", "default") == (0, "C++ scalar")
    assert fk._choose("", "AVX2")[1] == ("C++ avx2" if "avx2" in ISAS else "C++ scalar")
    assert fk._choose("", "avx512")[1] == f"C++ {best}"
    g = torch.Generator().manual_seed(1)
    packed, scale = _weight(20, 128, g)
    xq, xs = quantize_tokens(torch.randn(3, 128, generator=g))
    ref = fk.linear_a8(xq, xs, packed, scale, isa="torch")
    for p in PATHS:
        monkeypatch.setenv("DSV4_FP4_ISA", p)
        assert p in fk.backend() and "forced by DSV4_FP4_ISA" in fk.backend()
        assert _same_bits(fk.linear_a8(xq, xs, packed, scale), ref)
    monkeypatch.setenv("DSV4_FP4_ISA", "avx1024")
    assert "DSV4_FP4_ISA=avx1024 ignored" in fk.backend()
    with pytest.raises(ValueError, match="not available"):
        fk.linear_a8(xq, xs, packed, scale, isa="avx1024")


def test_missing_corrupt_or_unsafe_extension_falls_back_with_one_line(tmp_path, monkeypatch):
    d = tmp_path / "cache" / "dsv4" / "ext" / "fp4_gemm-x"
    ops, why = fk._load_from(d)
    assert ops is None and why == f"extension not built: run `{fk.BUILD_HINT}`"
    d.mkdir(parents=True, mode=0o700)
    for p in (d.parent, d.parent.parent):
        p.chmod(0o700)
    (d / f"{fk.NAME}.so").write_bytes(b"not an ELF file")
    ops, why = fk._load_from(d)
    assert ops is None and why.startswith("extension failed to load (OSError") and "\n" not in why
    d.parent.chmod(0o777)
    ops, why = fk._load_from(d)
    assert ops is None and why.startswith("extension not loaded:") and "mode 0777" in why and "\n" not in why
    # a process without the extension: the banner says why, and the products still run
    monkeypatch.setattr(fk, "_library", lambda: (None, "extension not built: run `x`"))
    monkeypatch.delenv("DSV4_FP4_ISA", raising=False)
    fk._choose.cache_clear()
    try:
        assert fk.backend() == "fp4 GEMM: torch fallback (extension not built: run `x`)"
        g = torch.Generator().manual_seed(2)
        packed, scale = _weight(9, 64, g)
        xq, xs = quantize_tokens(torch.randn(2, 64, generator=g))
        assert _same_bits(fk.linear_a8(xq, xs, packed, scale), fk._a8_torch(xq, xs, packed.view(torch.uint8),
                                                                             e8m0_bytes(scale)))
    finally:
        fk._choose.cache_clear()


def test_build_dir_is_per_user_and_keyed(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    d = fk.build_dir()
    assert d.parent == tmp_path / "dsv4" / "ext" and d.name.endswith(f"-torch{torch.__version__}")
    assert all(f.is_file() and f.parent == Path(fk.__file__).parent / "csrc" for f in fk.SOURCES + fk.HEADERS)


def test_the_build_the_venv_recorded_is_found_under_another_cache_home(monkeypatch, tmp_path):
    """A process started with another XDG_CACHE_HOME (a benchmark's isolated cache) still
    finds the extension scripts/venv.sh built and recorded, and nothing of another source."""
    built = fk.build_dir()
    monkeypatch.setattr(fk.sys, "prefix", str(tmp_path / "venv"))
    (tmp_path / "venv").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert fk._candidates() == [fk.build_dir()]  # nothing recorded
    (tmp_path / "venv" / ".dsv4-fp4-ext").write_text(str(built / f"{fk.NAME}.so"))
    assert fk._candidates() == [fk.build_dir(), built]
    (tmp_path / "venv" / ".dsv4-fp4-ext").write_text(str(tmp_path / "fp4_gemm-other" / f"{fk.NAME}.so"))
    assert fk._candidates() == [fk.build_dir()]  # another source's build: never loaded


@pytest.mark.parametrize("case", ["scale_k16", "packed_full_k", "packed_float", "scale_float", "xq_float",
                                  "xs_shape", "k_not_32", "columns_strided", "x_int"])
def test_bad_inputs_are_one_line_value_errors(case):
    n, k = 8, 64
    packed = torch.zeros(n, k // 2, dtype=torch.int8)
    scale = torch.full((n, k // 32), 127, dtype=torch.uint8)
    xq, xs = torch.zeros(3, k, dtype=torch.int8), torch.ones(3, 1)
    call = lambda: fk.linear_a8(xq, xs, packed, scale)  # noqa: E731
    if case == "scale_k16":
        scale = torch.full((n, k // 16), 127, dtype=torch.uint8)
    elif case == "packed_full_k":
        packed = torch.zeros(n, k, dtype=torch.int8)
    elif case == "packed_float":
        packed = torch.zeros(n, k // 2)
    elif case == "scale_float":
        scale = torch.ones(n, k // 32)
    elif case == "xq_float":
        xq = torch.zeros(3, k)
    elif case == "xs_shape":
        xs = torch.ones(4, 1)
    elif case == "k_not_32":
        packed, scale, xq = torch.zeros(n, 24, dtype=torch.int8), scale[:, :2], torch.zeros(3, 48, dtype=torch.int8)
    elif case == "columns_strided":
        packed = torch.zeros(k // 2, n, dtype=torch.int8).t()
    elif case == "x_int":
        call = lambda: fk.linear_f(xq, packed, scale)  # noqa: E731
    for p in PATHS:
        with pytest.raises(ValueError) as e:
            if case == "x_int":
                fk.linear_f(xq, packed, scale, isa=p)
            else:
                fk.linear_a8(xq, xs, packed, scale, isa=p)
        msg = str(e.value)
        assert msg.startswith("fp4 GEMM:") and "\n" not in msg and "(" in msg, msg
    with pytest.raises(ValueError):
        call()


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(4)
    packed, scale = _weight(300, 512, g)
    x = torch.randn(20, 512, generator=g)
    xq, xs = quantize_tokens(x)
    old = torch.get_num_threads()
    try:
        one = {p: (fk.linear_a8(xq, xs, packed, scale, isa=p), fk.linear_f(x, packed, scale, isa=p)) for p in ISAS}
        torch.set_num_threads(3)
        for p in ISAS:
            assert _same_bits(fk.linear_a8(xq, xs, packed, scale, isa=p), one[p][0]), p
            assert torch.equal(fk.linear_f(x, packed, scale, isa=p), one[p][1]), p
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------- linear_bf16
@pytest.mark.exact
@pytest.mark.parametrize("m,n,k", [(1, 37, 16), (3, 9, 40), (5, 130, 256), (17, 67, 33), (70, 21, 100), (2, 5, 1)])
def test_bf16_head_product_is_one_order_on_every_path(m, n, k):
    """`linear_bf16`: every C++ path gives the same bits (its one order of sums), a row the same
    bits alone as in any batch and on any thread count, and x @ w.float().T to float32
    rounding; the torch fallback within that rounding too."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    ref = x.double() @ w.double().t()
    tol = 1e-6 * (x.double().abs() @ w.double().abs().t()).max().item()
    outs = {isa: fk.linear_bf16(x, w, isa=isa) for isa in fk.available_isas() + ["torch"]}
    for isa, y in outs.items():
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert (y.double() - ref).abs().max().item() <= tol, isa
    paths = fk.available_isas()
    for isa in paths:
        assert torch.equal(outs[isa], outs[paths[0]]), isa
        alone = torch.cat([fk.linear_bf16(x[i:i + 1], w, isa=isa) for i in range(m)])
        assert torch.equal(alone, outs[isa]), isa
    if paths:
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(fk.linear_bf16(x, w, isa=paths[-1]), outs[paths[-1]])
        finally:
            torch.set_num_threads(threads)
        strided = torch.randn(m, 2 * k, generator=g)[:, ::2]  # a view: rows not contiguous
        assert torch.equal(fk.linear_bf16(strided, w, isa=paths[-1]), fk.linear_bf16(strided.contiguous(), w, isa=paths[-1]))


def test_bf16_head_product_refuses_what_it_cannot_take():
    x, w = torch.randn(2, 8), torch.randn(3, 8).bfloat16()
    for bad_x, bad_w, what in [(x.double(), w, "x must be"), (x, w.float(), "w must be bfloat16"),
                               (x, torch.randn(3, 9).bfloat16(), "w must be bfloat16"),
                               (x, torch.randn(8, 6).bfloat16().t(), "contiguous rows")]:
        with pytest.raises(ValueError, match=what):
            fk.linear_bf16(bad_x, bad_w)
