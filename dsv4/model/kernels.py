"""W8A8 device kernels behind one small interface.

    xq, xs = quantize_tokens(x)          # [M, K] float -> int8 [M, K], float32 [M, 1]
    y = w8a8_linear(x, wq, ws)           # x [..., K], int8 rows wq [N, K], float32 scales ws [N] -> [..., N]

The product is an exact int8 x int8 -> int32 matmul, rescaled in float32:
y[m, n] = (sum_k xq[m, k] * wq[n, k]) * xs[m] * ws[n]. Per-token quantisation makes every
row independent of the rows batched with it (the same bits alone or in any batch); under
w8a8 chunked = whole, batched = alone and MTP on = off hold within the model's quantisation
error, not exactly (docs/quantization.md). Backends, by the device of x: cpu `torch._int_mm`
(or `int8pack`'s prepacked weights; split in halves where int16 pair sums saturate), cuda
`torch._int_mm` padded to its rules, npu `torch_npu` (UNTESTED on a real NPU).
`check_kernel(device)` says at startup whether the device has one (`W8A8Error` if not).
Details: docs/quantization.md, 'dsv4/model/kernels.py'.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import int8pack
from .layers import linear

QMAX = 127.0
_TINY = 1e-30  # amax floor: an all-zero token quantises to zeros with a harmless scale


class W8A8Error(RuntimeError):
    """The device has no int8 kernel for --quantization w8a8 (one line, names the flag)."""


def quantize_tokens(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: x [M, K] -> (q int8 [M, K], scale float32 [M, 1]),
    q = round(x / scale), scale = amax(|x|) / 127 (round half to even). `amax` [M, 1]
    given: the amax of the whole row when x is a tensor-parallel slice of it."""
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    s = amax.clamp_min(_TINY) / QMAX  # [M, 1]
    q = torch.round(xf / s).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, s


def quantize_rows(w: torch.Tensor, amax: torch.Tensor | None = None, *, scratch: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8 of a float weight: [N, K] -> (int8 [N, K], float32 [N])
    (`amax` [N]: of the whole rows, when w holds a slice of their columns). `scratch`: w is a
    float32 temporary the caller drops (a weight being loaded): it is divided and rounded in
    place, the same values as `quantize_tokens` with no [N, K] float temporaries (the load's
    cost is these passes over float32)."""
    if not (scratch and w.dtype == torch.float32 and w.is_contiguous()):
        q, s = quantize_tokens(w, None if amax is None else amax.unsqueeze(-1))
        return q, s.squeeze(-1)
    if amax is None:
        lo, hi = torch.aminmax(w, dim=-1)  # max |x| = max(max x, -min x), one pass and no |x| copy
        amax = torch.maximum(hi, lo.neg())
    s = amax.unsqueeze(-1).clamp_min(_TINY) / QMAX  # [N, 1]
    q = w.div_(s).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, s.squeeze(-1)


def int_mm(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Exact int8 [M, K] x int8 rows [N, K] -> int32 [M, N] on cpu or cuda (float32 [M, N],
    the same values, when wq is prepacked for oneDNN: `int8pack`)."""
    if wq.is_mkldnn:
        return int8pack.mm(xq, wq)
    if wq.is_meta:  # torch._int_mm would read a meta tensor's missing data without a word
        raise RuntimeError(f"int8 weight {tuple(wq.shape)} has no data: it is prepacked (int8pack) and "
                           f"its owner multiplies by the packed copy")
    if xq.device.type != "cuda":
        if int8pack.cpu_saturates():
            return int8pack.split_mm(xq, wq)
        return torch._int_mm(xq, wq.t())
    M, K = xq.shape
    N = wq.shape[0]
    pm, pk, pn = max(17 - M, 0), (-K) % 8, (-N) % 8  # cuBLAS int8 rules: M > 16, K and N multiples of 8
    if pm or pk:
        xq = F.pad(xq, (0, pk, 0, pm))
    if pk or pn:
        wq = F.pad(wq, (0, pk, 0, pn))
    return torch._int_mm(xq, wq.t())[:M, :N]


def w8a8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] (compute dtype) with int8 rows wq [N, K] and float32 row scales ws [N]
    -> [..., N] in x's dtype. `reduce_amax` (row-parallel slices): the token amax [M, 1]
    of the slice -> of the whole row, so every rank quantises as the unsplit linear does."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.device.type == "npu" and reduce_amax is None:
        out = npu_w8a8_linear(x2, wq, ws)
    else:
        amax = None if reduce_amax is None else reduce_amax(x2.float().abs().amax(dim=-1, keepdim=True))
        xq, xs = quantize_tokens(x2, amax)
        out = int_mm(xq, wq).float() * xs * ws  # [M, N] float32
    return out.to(x.dtype).view(*lead, out.shape[-1])


DRAFT_PACKED_MAX_ROWS = 4  # int8 weight-only mm beats W8A8 up to here (2 threads: 1.9x at 1 row, 1.0x at 4)


def draft_linear(x: torch.Tensor, head: dict[str, torch.Tensor]) -> torch.Tensor:
    """The MTP's draft logits through its own head: x [M, K] -> [M, V] in x's dtype. That
    head is the int8 copy of the head (`DeepseekV4.quantize_draft_head`) and/or the rows of a
    draft vocabulary (`restrict_draft_vocab`, in the head's dtype when not int8). Drafts are
    only proposals (verification uses the exact head), so the fastest int8 kernel serves: on
    CPU with bfloat16 x and few rows, `torch._weight_int8pack_mm` (int8 weight, bf16
    activations: it reads the head faster than `_int_mm`); else W8A8. A head prepacked for
    oneDNN (`DeepseekV4.pack_int8`) goes through it at any row count (faster still). Measured:
    docs/quantization.md, 'dsv4/model/kernels.py'."""
    if "packed" in head:
        return w8a8_linear(x, head["packed"], head["scale"])
    if head["weight"].dtype != torch.int8:  # a draft vocabulary's rows of an unquantised head
        return linear(x, head["weight"])
    if (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= DRAFT_PACKED_MAX_ROWS
            and x.shape[1] % 16 == 0):  # torch 2.13's kernel: NaN or a crash for other widths (e.g. 24, 17)
        return torch.ops.aten._weight_int8pack_mm(x, head["weight"], head["scale_bf16"])
    return w8a8_linear(x, head["weight"], head["scale"])


def check_kernel(device: torch.device | str) -> None:
    """Raise `W8A8Error` when `device` has no int8 kernel (before any weight is read)."""
    kind = device.type if isinstance(device, torch.device) else str(device).partition(":")[0]
    if kind in ("cpu", "cuda"):
        if not hasattr(torch, "_int_mm"):
            raise W8A8Error(f"--quantization w8a8: torch {torch.__version__} has no torch._int_mm for "
                            f"--device {kind}; upgrade torch or use --quantization none")
        if kind == "cpu":
            int8pack.cpu_saturates()  # decided before any step (and before a compiled step traces int_mm)
        return
    if kind == "npu":
        try:
            import torch_npu
        except Exception as e:  # noqa: BLE001  (ImportError or a broken CANN install)
            raise W8A8Error(f"--quantization w8a8 on --device npu needs torch_npu ({type(e).__name__}: {e}); "
                            f"use --quantization none") from None
        if not (hasattr(torch_npu, "npu_dynamic_quant") and hasattr(torch_npu, "npu_quant_matmul")):
            raise W8A8Error("--quantization w8a8: this torch_npu has no npu_dynamic_quant/npu_quant_matmul; "
                            "upgrade torch_npu or use --quantization none")
        return
    raise W8A8Error(f"--quantization w8a8 has no int8 kernel for --device {kind}; use --quantization none")


# ------------------------------------------------------------------ Ascend (UNTESTED on a real NPU)
def npu_weight_layout(wq: torch.Tensor, ws: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int8 rows [N, K] and float32 scales [N] -> what `npu_quant_matmul` takes:
    the weight as [K, N] (a transposed view, as msModelSlim's W8A8_DYNAMIC layers pass it)
    and the per-channel scale [N] in float32 (bfloat16 output) or float32 (other outputs)."""
    return wq.t(), ws.to(torch.float32).reshape(-1)


def npu_rescale_reference(acc: torch.Tensor, token_scale: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
    """What `npu_quant_matmul(x, w, scale, pertoken_scale=...)` computes from the int32
    accumulator: acc [M, N] * pertoken_scale [M] (per row) * scale [N] (per column), float32.
    The CPU tests check that the layout above fed to this formula equals `w8a8_linear`."""
    return acc.float() * token_scale.reshape(-1, 1).float() * channel_scale.reshape(1, -1).float()


def npu_w8a8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:  # pragma: no cover
    """x [M, K] -> float32 [M, N] through torch_npu. UNTESTED: no NPU was available."""
    import torch_npu

    xq, xs = torch_npu.npu_dynamic_quant(x)  # int8 [M, K], per-token scale [M] (amax / 127)
    w, scale = npu_weight_layout(wq, ws, x.dtype)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    out = torch_npu.npu_quant_matmul(xq, w, scale, pertoken_scale=xs.reshape(-1).float(), output_dtype=out_dtype)
    return out.float()
