"""Bit-exact codecs for the quantised weights of the official DeepSeek V4 checkpoint.

Two block formats, both with power-of-two E8M0 scales (a byte B meaning 2^(B-127)):
FP8 (float8_e4m3fn, one scale per 128x128 block) and FP4 for the routed experts (e2m1
packed two per int8 byte, element 2k in the LOW nibble, one scale per 1x32 block).
Scales follow the official kernels, ``s = 2^ceil(log2(amax / qmax))`` with a floored block
amax, values clamped and rounded to nearest-even, with two refinements (an exact ceil, and
the halved scale when rounding pulls a block's max down to qmax/2) that make the codecs
bit-exact fixed points: ``quantize(dequantize(q)) == q``. All codecs are vectorised torch
code, device-agnostic, computing in float32. Formulas and refinements in full:
docs/quantization.md, 'dsv4/model/quant.py'.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# torch >= 2.7 has the E8M0 dtype; older versions get scales as raw uint8 exponent bytes.
E8M0: Optional[torch.dtype] = getattr(torch, "float8_e8m0fnu", None)

FP8_MAX = 448.0
FP8_BLOCK = 128
FP8_AMAX_FLOOR = 1e-4
FP4_MAX = 6.0
FP4_BLOCK = 32
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# A rounder maps scaled, clamped float32 values to (codes, float32 values or |values|).
_Rounder = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


# ----------------------------------------------------------------------------- E8M0 helpers
def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The raw exponent bytes (uint8) of an E8M0 scale tensor (float8_e8m0fnu or uint8)."""
    if E8M0 is not None and scale.dtype == E8M0:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    raise TypeError(f"E8M0 scales must be float8_e8m0fnu or uint8 exponent bytes, got {scale.dtype}")


def _to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """int32 exponents e -> E8M0 scales 2^e (float8_e8m0fnu, or uint8 bytes on old torch)."""
    b = (exponent + 127).to(torch.uint8)
    return b.view(E8M0) if E8M0 is not None else b


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales -> float32 2^(B-127), built from bits (byte 0 is 2^-127, 255 is NaN)."""
    b = e8m0_bytes(scale).to(torch.int32)
    f = (b << 23).view(torch.float32)
    f = torch.where(b == 0, torch.full_like(f, 2.0**-127), f)
    return torch.where(b == 255, torch.full_like(f, math.nan), f)


def _exp2(e: torch.Tensor) -> torch.Tensor:
    """int32 e in [-126, 127] -> float32 2^e, exactly."""
    return ((e + 127) << 23).view(torch.float32)


def _ceil_exp(amax: torch.Tensor, qmax_mant: float, qmax_exp: int) -> torch.Tensor:
    """Smallest int e with amax <= qmax * 2^e, where qmax = qmax_mant * 2^qmax_exp, mant in [.5, 1)."""
    m, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)
    return e - qmax_exp + (m > qmax_mant).to(torch.int32)


def _block_quantize(blocks: torch.Tensor, dims: tuple[int, ...], qmax: float, floor: float,
                    rounder: _Rounder) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise float32 ``blocks`` with one power-of-two scale per block (reduced over ``dims``).

    Returns (codes from ``rounder``, int32 exponents with ``dims`` kept as size-1 axes).
    """
    if not bool(torch.isfinite(blocks).all()):
        raise ValueError("cannot quantise a tensor with NaN or infinite values")
    mant, qexp = math.frexp(qmax)

    def exponent(amax: torch.Tensor) -> torch.Tensor:
        return _ceil_exp(amax.clamp_min(floor), mant, qexp)

    e = exponent(blocks.abs().amax(dim=dims, keepdim=True))
    codes, vals = rounder((blocks * _exp2(-e)).clamp_(-qmax, qmax))
    # Fixed point: if rounding pulled the block max down to qmax/2, quantising the dequantised
    # block would pick e-1. Use e-1 directly (the max saturates to qmax, the rest gains a bit).
    e2 = exponent(vals.abs().amax(dim=dims, keepdim=True) * _exp2(e))
    if not torch.equal(e, e2):
        codes, _ = rounder((blocks * _exp2(-e2)).clamp_(-qmax, qmax))
        e = e2
    return codes, e


def _pad2(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the bottom/right to [rows, cols] (no copy when already there)."""
    if x.shape[0] == rows and x.shape[1] == cols:
        return x
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _check_2d(w: torch.Tensor, what: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{what} expects a 2-D weight, got shape {tuple(w.shape)}")


# ----------------------------------------------------------------------------- FP8
def fp8_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the 128x128 block-scale grid of a [rows, cols] FP8 weight."""
    return (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def _round_fp8(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = y.to(torch.float8_e4m3fn)  # round to nearest even; |y| <= 448 so no saturation needed
    return q, q.float()


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float -> (float8_e4m3fn [R, C], E8M0 scales [ceil(R/128), ceil(C/128)])."""
    _check_2d(w, "quantize_fp8")
    rows, cols = w.shape
    br, bc = fp8_scale_shape(rows, cols)
    x = _pad2(w.detach().float(), br * FP8_BLOCK, bc * FP8_BLOCK)
    blocks = x.view(br, FP8_BLOCK, bc, FP8_BLOCK)  # [br, 128, bc, 128]
    q, e = _block_quantize(blocks, (1, 3), FP8_MAX, FP8_AMAX_FLOOR, _round_fp8)
    q = q.view(br * FP8_BLOCK, bc * FP8_BLOCK)[:rows, :cols].contiguous()
    return q, _to_e8m0(e.view(br, bc))


def dequantize_fp8(w8: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(float8_e4m3fn [R, C], E8M0 [ceil(R/128), ceil(C/128)]) -> [R, C] in ``dtype`` (exact)."""
    _check_2d(w8, "dequantize_fp8")
    rows, cols = w8.shape
    br, bc = fp8_scale_shape(rows, cols)
    if tuple(scale.shape) != (br, bc):
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not match weight "
                         f"{(rows, cols)}; expected {(br, bc)}")
    x = _pad2(w8.float(), br * FP8_BLOCK, bc * FP8_BLOCK).view(br, FP8_BLOCK, bc, FP8_BLOCK)
    s = e8m0_to_float(scale)[:, None, :, None]  # [br, 1, bc, 1]
    out = x.mul_(s).view(br * FP8_BLOCK, bc * FP8_BLOCK)[:rows, :cols]  # x: our float copy of w8
    return out.to(dtype).contiguous()


# ----------------------------------------------------------------------------- FP4
def fp4_scale_shape(rows: int, packed_cols: int) -> tuple[int, int]:
    """Shape of the 1x32 block-scale grid of a packed [rows, packed_cols] FP4 weight."""
    return (rows, -(-2 * packed_cols // FP4_BLOCK))


def _round_fp4(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y in [-6, 6] -> (uint8 nibble codes, float32 |values|), round to nearest even."""
    a = y.abs()
    _, ex = torch.frexp(a)  # a = m * 2^ex, m in [0.5, 1) (0 -> ex 0)
    step = torch.exp2((ex - 2).clamp_min(-1).to(torch.float32))  # e2m1 spacing: .5 below 2, then 1, 2
    mag = torch.round(a / step) * step  # torch.round is half-to-even; mag in the e2m1 grid
    m, e = torch.frexp(mag)  # 2, 3, 4, 6 = (.5|.75) * 2^(2|3) -> codes 4, 5, 6, 7
    code = torch.where(mag < 2, 2 * mag, 2 * e.to(torch.float32) + (m > 0.5).to(torch.float32))
    codes = (code + 8 * torch.signbit(y).to(torch.float32)).to(torch.uint8)
    return codes, mag


def _fp4_lut(device: torch.device) -> torch.Tensor:
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float (C even) -> (int8 packed [R, C/2], E8M0 scales [R, ceil(C/32)])."""
    _check_2d(w, "quantize_fp4")
    rows, cols = w.shape
    if cols % 2:
        raise ValueError(f"quantize_fp4 needs an even number of columns, got shape {(rows, cols)}")
    nb = -(-cols // FP4_BLOCK)
    x = _pad2(w.detach().float(), rows, nb * FP4_BLOCK).view(rows, nb, FP4_BLOCK)
    codes, e = _block_quantize(x, (2,), FP4_MAX, FP4_AMAX_FLOOR, _round_fp4)
    codes = codes.view(rows, nb * FP4_BLOCK)[:, :cols]  # [R, C] uint8 nibbles
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # element 2k low, 2k+1 high
    return packed.view(torch.int8).contiguous(), _to_e8m0(e.view(rows, nb))


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(int8 packed [R, C/2], E8M0 [R, ceil(C/32)]) -> [R, C] in ``dtype`` (exact)."""
    _check_2d(packed, "dequantize_fp4")
    rows, half = packed.shape
    cols = 2 * half
    if tuple(scale.shape) != fp4_scale_shape(rows, half):
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not match packed weight "
                         f"{(rows, half)}; expected {fp4_scale_shape(rows, half)}")
    nb = scale.shape[1]
    u = packed.view(torch.uint8)
    codes = torch.stack((u & 0xF, u >> 4), dim=-1).view(rows, cols)  # [R, C]
    vals = _pad2(_fp4_lut(packed.device)[codes.long()], rows, nb * FP4_BLOCK)
    out = vals.view(rows, nb, FP4_BLOCK) * e8m0_to_float(scale)[:, :, None]  # [R, nb, 32]
    return out.view(rows, nb * FP4_BLOCK)[:, :cols].to(dtype).contiguous()
