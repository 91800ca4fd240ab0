"""Weights quantised to int8 rows while they load, by the C++ extension (`csrc/int8_rows.cpp`).

    if int8_rows.into(src, q, s, fp8_scale=scale):   # the stored tensor -> the model's own q, s
        ...                                           # else: kernels.quantize_rows, the same bits

The int8 modes' conversion of an FP8 (or bfloat16, float32) weight to int8 rows
(`w8a8.rows_into`: loading and `dsv4 convert`; also the int8 draft head) in one pass over the
stored bytes on every thread, written straight into the given storage: the values of
`quant.dequantize_fp8` followed by `kernels.quantize_rows`, bit for bit (one IEEE float32
operation per step, as there). The extension's build, loading and choice of path are
`fp4_kernel`'s; without it (or off the CPU) `into` returns False and the torch code runs.
"""

from __future__ import annotations

import functools

import torch

from . import fp4_kernel
from .kernels import QMAX, _TINY
from .quant import e8m0_to_float, fp8_scale_shape


@functools.lru_cache(maxsize=1)
def _fp8_table() -> torch.Tensor:
    """float32 [256]: an e4m3 byte's value, by torch's own conversion."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


_NONE = torch.empty(0)


def into(src: torch.Tensor, q: torch.Tensor, s: torch.Tensor, *, fp8_scale: torch.Tensor | None = None,
         isa: str | None = None) -> bool:
    """Quantise `src` [R, C] (float8_e4m3fn with its E8M0 block scales `fp8_scale`
    [ceil(R/128), ceil(C/128)], bfloat16 or float32; rows contiguous) into int8 rows `q` [R, C]
    and float32 scales `s` [R] in place. False (nothing written) where the C++ extension
    cannot: not built, not the CPU, another layout; the caller then runs the torch code.
    `isa`: force a path, as for `fp4_kernel.linear_a8` (tests)."""
    fp8 = src.dtype == torch.float8_e4m3fn
    if not (fp8 or src.dtype in (torch.bfloat16, torch.float32)) or src.dim() != 2 or q.shape != src.shape \
            or q.dtype != torch.int8 or s.dtype != torch.float32 or s.shape != src.shape[:1]:
        return False
    if (src.shape[1] > 1 and (src.stride(1) != 1 or q.stride(1) != 1)) or (src.shape[0] > 1 and s.stride(0) != 1):
        return False
    code = fp4_kernel.isa_code(isa, src, q, s)
    if code is None:
        return False
    lut = bscale = _NONE
    if fp8:
        if fp8_scale is None or tuple(fp8_scale.shape) != fp8_scale_shape(*src.shape):
            return False  # the torch code raises its error, naming the shapes
        try:
            bscale = e8m0_to_float(fp8_scale).contiguous()
        except TypeError:  # a scale of another dtype: the torch code raises its error
            return False
        lut = _fp8_table()
        src = src.view(torch.uint8)
    torch.ops.dsv4_fp4.rows_int8_(src, lut, bscale, q, s, _TINY, QMAX, code)
    return True
