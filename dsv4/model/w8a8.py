"""W8A8 storage: int8 weights with one float32 scale per output row, applied to a built model.

Which linears (`QUANTIZED_RULE`, by role): every `Linear` of the blocks and the MTP block
(attention, compressor and indexer projections, shared and routed experts, MTP
`e_proj`/`h_proj`); not the `head`, nor the embedding, norms, router gate, mHC, sinks or
`ape`. The small projections of the layer input run fused with `wq_a`/`wkv` in one int8
matmul after one activation quantisation (why they are int8 too: docs/quantization.md).

`to_w8a8(model)` swaps those modules for `QuantLinear` (from their float weights, or empty
on the meta device, for the loader to fill). `from_fp4` / `from_float` convert one
checkpoint tensor at a time; FP4 rows whose block exponents span <= 3 convert exactly
(doubled e2m1 values are integers <= 12, and 12 * 2^3 = 96 <= 127).
Details: docs/quantization.md, 'dsv4/model/w8a8.py'.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import int8_rows, int8pack, kernels, parallel
from .layers import Linear
from .quant import FP4_VALUES, dequantize_fp8, e8m0_bytes

QUANTIZATIONS = ("none", "w8a8", "mxfp4", "w8a8-mxfp4")  # mxfp4: the routed experts as stored (mxfp4.py)
INT8_MODES = ("w8a8", "w8a8-mxfp4")  # the other linears int8
QUANTIZED_RULE = re.compile(r"(?:layers|mtp)\.\d+\.(?:attn\..*|ffn\.(?:shared_experts|experts\.\d+)\.w[123]|[eh]_proj)")


def is_quantized(module_name: str) -> bool:
    """Whether the Linear named `module_name` (official prefix, e.g. ``layers.3.attn.wq_a``) is int8."""
    return QUANTIZED_RULE.fullmatch(module_name) is not None


class QuantLinear(nn.Module):
    """int8 `weight` [out, in] and float32 `scale` [out] (buffers, saved as ``X.weight`` /
    ``X.scale``); forward quantises x per token and multiplies exactly (`kernels`).
    A row-parallel slice (`row_parallel`, set by `sharding.shard_model`) quantises each
    token with the amax of its whole row, so the ranks' int32 partial sums add up to the
    unsplit product's."""

    row_parallel = False

    def __init__(self, n_in: int, n_out: int, device: torch.device | str | None = None):
        super().__init__()
        self.register_buffer("weight", torch.empty(n_out, n_in, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(n_out, dtype=torch.float32, device=device))
        self.packed: list[torch.Tensor] | None = None  # `int8pack`: the weight prepacked, whole or per group

    @staticmethod
    def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] (also used by `FusedLinear` on the fused rows)."""
        return kernels.w8a8_linear(x, weight, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and len(self.packed) > 1:
            raise RuntimeError(f"this linear is packed per output group ({len(self.packed)}): call grouped()")
        w = self.weight if self.packed is None else self.packed[0]
        return kernels.w8a8_linear(x, w, self.scale, parallel.all_reduce_max if self.row_parallel else None)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, G, in] -> [T, G, out / G], group g with its own rows (see `Linear.grouped`).
        Each (token, group) slice is quantised on its own: still row-independent."""
        T, G, _ = x.shape
        O = self.weight.shape[0] // G
        ws = self.packed if self.packed is not None else [self.weight[g * O:(g + 1) * O] for g in range(G)]
        outs = [kernels.w8a8_linear(x[:, g], ws[g], self.scale[g * O:(g + 1) * O]) for g in range(G)]
        return torch.stack(outs, dim=1)

    def pack_int8(self, min_bytes: int, groups: int = 1) -> int:
        """Hold the weight prepacked for oneDNN (`int8pack.pack_model`), one per `groups` of
        rows (`grouped`'s G: its owner packs it first), when it is worth it
        (`int8pack.worth_packing`). Returns the bytes packed."""
        w = self.weight
        if self.packed is not None or not int8pack.worth_packing(w, min_bytes):
            return 0
        O = w.shape[0] // groups
        self.adopt([int8pack.pack(w[g * O:(g + 1) * O]) for g in range(groups)])
        return w.numel()

    def adopt(self, packed: list[torch.Tensor]) -> None:
        """Multiply by `packed` (this weight prepacked, whole or per group) from now on; the
        plain buffer becomes meta (`int8pack.meta_like`)."""
        self.packed, self.weight = packed, int8pack.meta_like(self.weight)

    def packed_weights(self) -> list[torch.Tensor]:
        return self.packed or []


def to_w8a8(model: nn.Module) -> nn.Module:
    """Swap every quantised `Linear` (see `is_quantized`) for a `QuantLinear`, in place.
    Float weights are quantised per row (`from_float`); meta ones stay empty (the loader
    fills them). Call before `fuse_projections`."""
    for name, mod in list(model.named_modules()):
        if type(mod) is not Linear or not is_quantized(name):
            continue
        n_out, n_in = mod.weight.shape
        q = QuantLinear(n_in, n_out, device=mod.weight.device)
        if mod.weight.device.type != "meta":
            with torch.no_grad():
                w, s = from_float(mod.weight)
                q.weight.copy_(w)
                q.scale.copy_(s)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, q)
    return model


# ------------------------------------------------------------------ conversion, one tensor at a time
@dataclass
class RowCounts:
    """How FP4 rows converted: `exact` (block exponents span <= 3) or `rounded`."""

    exact: int = 0
    rounded: int = 0

    def __str__(self) -> str:
        total = self.exact + self.rounded
        return f"{self.exact} of {total} FP4 rows exact, {self.rounded} rounded" if total else "no FP4 rows"


def from_float(w: torch.Tensor, amax: torch.Tensor | None = None, *, scratch: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], float32 [out]): per-row amax / 127, round to nearest even
    (`amax` [out]: of the whole rows, when w is a slice of their columns; `scratch`: w is a
    temporary that may be overwritten, `kernels.quantize_rows`)."""
    return kernels.quantize_rows(w.detach(), amax, scratch=scratch)


ROWS = 1024  # rows_into's torch fallback for a float weight: rows converted at a time


def rows_into(kind: str, raw: torch.Tensor, scale: torch.Tensor | None, q: torch.Tensor, s: torch.Tensor,
              counts: RowCounts | None = None,
              reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """A stored weight ("fp4" with its E8M0 scales, "fp8" with its block scales, or "plain"
    float) as int8 rows, written into `q` [N, K] and `s` [N] (the model's storage, or the
    caller's). `reduce_amax`: `raw` holds a slice of the rows' columns (row-parallel), and
    this turns the slice's row amax [N] into the whole rows' (an all-reduce). FP8 and float
    rows go through the C++ extension where it runs (`int8_rows`: one pass, every thread,
    no temporaries), else through `from_float`: the same bits (a float weight `ROWS` rows at
    a time, so that a large one, such as the head the draft head copies, never has a float32
    copy whole)."""
    if kind == "fp4":
        wq, ws = from_fp4(raw, scale, counts)
    elif reduce_amax is None and kind in ("fp8", "plain") and int8_rows.into(raw, q, s, fp8_scale=scale):
        return
    elif reduce_amax is None and kind == "plain":
        for lo in range(0, raw.shape[0], ROWS):  # a float32 copy of ROWS rows, quantised in place
            wq, ws = from_float(raw[lo:lo + ROWS].to(torch.float32, copy=True), scratch=True)
            q[lo:lo + ROWS].copy_(wq)
            s[lo:lo + ROWS].copy_(ws)
        return
    else:
        w = dequantize_fp8(raw, scale) if kind == "fp8" else raw.float()
        amax = reduce_amax(w.abs().amax(dim=-1)) if reduce_amax is not None else None
        wq, ws = from_float(w, amax, scratch=w.data_ptr() != raw.data_ptr())  # w: our own temporary
    q.copy_(wq)
    s.copy_(ws)


FP4_SPAN = 3  # 12 * 2^3 = 96 <= 127: doubled e2m1 codes times 2^span still fit in int8


@functools.lru_cache(maxsize=None)
def _pair_table(device: torch.device) -> torch.Tensor:
    """int8 [256, 2]: byte -> (2 * e2m1 of its low nibble, of its high nibble)."""
    doubled = [int(2 * v) for v in FP4_VALUES]
    return torch.tensor([[doubled[b & 15], doubled[b >> 4]] for b in range(256)], dtype=torch.int8, device=device)


def from_fp4(packed: torch.Tensor, scale: torch.Tensor, counts: RowCounts | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed FP4 weight (int8 [R, C/2], E8M0 [R, C/32]) -> (int8 [R, C], float32 [R]).

    A row whose nonzero blocks' exponents span <= 3 converts exactly: with row scale
    2^(e_min - 1), element j of block b is (2 * e2m1) * 2^(e_b - e_min), an integer of
    magnitude <= 96. Other rows are dequantised and rounded per row (`from_float`).
    """
    rows, half = packed.shape
    u = packed.contiguous().view(torch.uint8)  # [R, C/2], element 2k in the low nibble of byte k
    # every operand stays one byte an element: a byte -> its two doubled e2m1 values (one
    # gather from a 256-entry table), and a block is nonzero iff a nibble's magnitude bits are
    ints = torch.index_select(_pair_table(u.device), 0, u.reshape(-1).to(torch.int32)).view(rows, -1, 32)
    nonzero = (u & 0x77).ne(0).view(rows, -1, 16).any(-1)  # [R, nb]: 16 bytes a block
    e = e8m0_bytes(scale).to(torch.int32)  # [R, nb] biased exponents
    big = torch.iinfo(torch.int32).max
    emin = torch.where(nonzero, e, big).amin(-1)  # [R]; zero blocks do not constrain the row scale
    emax = torch.where(nonzero, e, -1).amax(-1)
    exact = (emax - emin <= FP4_SPAN) | ~nonzero.any(-1)
    emin = torch.where(nonzero.any(-1), emin, 127)
    shift = (e - emin[:, None]).clamp(0, FP4_SPAN)  # [R, nb]; exact rows never clamp a nonzero block
    q = (ints * (1 << shift).to(torch.int8)[..., None]).view(rows, -1)  # |12 * 2^3| = 96: int8 holds it
    s = torch.ldexp(torch.full((rows,), 0.5), (emin - 127).to(torch.float32))  # 2^(e_min - 127 - 1)
    if not bool(exact.all()):
        from .quant import dequantize_fp4

        bad = (~exact).nonzero().squeeze(-1)
        qr, sr = from_float(dequantize_fp4(packed[bad], scale[bad], torch.float32))
        q[bad], s[bad] = qr, sr
    if counts is not None:
        n_exact = int(exact.sum())
        counts.exact += n_exact
        counts.rounded += rows - n_exact
    return q, s
