"""Routed experts kept in the checkpoint's MXFP4 (`--quantization mxfp4` and `w8a8-mxfp4`).

`to_mxfp4(model, act_int8)` swaps every routed expert's `w1`/`w2`/`w3` for an `FP4Linear`
holding the checkpoint's MXFP4 bytes as stored (two e2m1 values a byte, one E8M0 scale per
32; the loader maps them from the safetensors files); the rest of the model stays as
`--quantization` says (`mxfp4`: the compute dtype, `w8a8-mxfp4`: int8). `FP4Linear`
multiplies through `fp4_kernel`: float activations give x @ dequantised(W)^T within float
rounding; int8 activations (quantised per token as w8a8 does) give the exact product of the
quantised x and the checkpoint's own weights. `routed` is the MoE's routed share over such
experts (`moe.moe_mxfp4` is it as one opaque op for compiled steps).
Details: docs/quantization.md, 'dsv4/model/mxfp4.py'.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import fp4_kernel, kernels
from .layers import Linear, cast, f32

MODES = ("mxfp4", "w8a8-mxfp4")
ROUTED_RULE = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]")
BLOCK = 32


class FP4Linear(nn.Module):
    """Packed e2m1 `weight` uint8 [out, in / 2] and E8M0 `scale` uint8 [out, in / 32] (buffers,
    saved as ``X.weight`` / ``X.scale``, as the checkpoint stores them). `act_int8`: x is
    quantised per token and multiplied exactly in int32 per block, else in float."""

    def __init__(self, n_in: int, n_out: int, act_int8: bool, device: torch.device | str | None = None):
        super().__init__()
        if n_in % BLOCK:
            raise ValueError(f"an MXFP4 linear needs an input width that is a multiple of {BLOCK}, got {n_in}")
        self.act_int8 = act_int8
        self.register_buffer("weight", torch.empty(n_out, n_in // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.empty(n_out, n_in // BLOCK, dtype=torch.uint8, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.act_int8:
            xq, xs = kernels.quantize_tokens(x2)
            y = fp4_kernel.linear_a8(xq, xs, self.weight, self.scale)
        else:
            y = fp4_kernel.linear_f(x2, self.weight, self.scale)
        return y.to(x.dtype).reshape(*lead, -1)


def to_mxfp4(model: nn.Module, act_int8: bool) -> nn.Module:
    """Swap every routed expert's `Linear` for an `FP4Linear`, in place (on the meta device for
    the loader; float weights are quantised to MXFP4, as `quant.quantize_fp4` writes them)."""
    from .quant import e8m0_bytes, quantize_fp4

    for name, mod in list(model.named_modules()):
        if type(mod) is not Linear or ROUTED_RULE.fullmatch(name) is None:
            continue
        n_out, n_in = mod.weight.shape
        q = FP4Linear(n_in, n_out, act_int8, device=mod.weight.device)
        if mod.weight.device.type != "meta":
            with torch.no_grad():
                packed, scale = quantize_fp4(mod.weight.float())
                q.weight.copy_(packed.view(torch.uint8))
                q.scale.copy_(e8m0_bytes(scale))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, q)
    return model


def is_mxfp4(expert: nn.Module) -> bool:
    return isinstance(getattr(expert, "w1", None), FP4Linear)


def _swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    g, u = f32(g), f32(u)
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.silu(g) * u


def routed(out: torch.Tensor, x: torch.Tensor, groups: Iterable[tuple[int, Any, torch.Tensor]], tensors: Any,
           limit: float, act_int8: bool) -> torch.Tensor:
    """out [T, D] float32 plus the routed shares of x [T, D]: `groups` yields (local expert e,
    its tokens' rows [c] or None for the one token, their routing weights [c]) in increasing
    expert order (`moe._groups`); `tensors(e)`: expert e's w1, s1, w3, s3, w2, s2. Under int8
    activations x is quantised once per token (the same bits as per expert) and each (token,
    expert) row of the SwiGLU output once, as the expert's w2 alone does."""
    if act_int8:
        xq, xs = kernels.quantize_tokens(x)  # [T, D] int8, [T, 1]
    for e, t, w in groups:
        w1, s1, w3, s3, w2, s2 = tensors(e)
        if act_int8:
            q, s = (xq, xs) if t is None else (xq[t], xs[t])
            g, u = fp4_kernel.linear_a8(q, s, w1, s1), fp4_kernel.linear_a8(q, s, w3, s3)
        else:
            xe = x if t is None else x[t]
            g, u = fp4_kernel.linear_f(xe, w1, s1), fp4_kernel.linear_f(xe, w3, s3)
        h = cast(_swiglu(cast(g, x.dtype), cast(u, x.dtype), limit) * w.unsqueeze(-1), x.dtype)  # [c, I]
        if act_int8:
            hq, hs = kernels.quantize_tokens(h)
            y = fp4_kernel.linear_a8(hq, hs, w2, s2)
        else:
            y = fp4_kernel.linear_f(h, w2, s2)
        y = f32(cast(y, x.dtype))
        if t is None:
            out = out + y
        else:
            out.index_add_(0, t, y)
    return out


def expert_tensors(expert: nn.Module) -> tuple[torch.Tensor, ...]:
    """One expert's packed weights and scales in `routed`'s order: w1, s1, w3, s3, w2, s2."""
    return tuple(t for lin in (expert.w1, expert.w3, expert.w2) for t in (lin.weight, lin.scale))


def check_shapes(name: str, packed_shape: tuple[int, ...], scale_shape: Optional[tuple[int, ...]],
                 out_features: int, in_features: int) -> Optional[str]:
    """Why a stored FP4 tensor cannot be `name`'s packed weight (one line), or None."""
    want_p, want_s = (out_features, in_features // 2), (out_features, in_features // BLOCK)
    if tuple(packed_shape) != want_p:
        return f"tensor {name!r} is {list(packed_shape)}, expected packed FP4 {list(want_p)}"
    if scale_shape is None or tuple(scale_shape) != want_s:
        return f"tensor {name[:-len('weight')]}scale is {scale_shape and list(scale_shape)}, expected {list(want_s)}"
    return None
