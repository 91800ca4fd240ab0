"""Linears that read one input, run as one matmul: `FusedLinear`, the experts' stacked
weights (`stack_views`), and where their storage comes from.

Fusing makes each linear's parameters views of one fused tensor (`state_dict()` unchanged);
`project` runs the fused matmul while the fusion is current. The storage is new (values
copied, or not when the loader fills it next) or a `Source`'s: the checkpoint's mapped pages
where a group lies back to back in one file (`loader._fused_source`, `dsv4 convert`'s layout).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from .layers import linear


class FusedLinear:
    """Linears that read the same input, run as one matmul (decode is op-overhead bound).

    Concatenates the weights (and, for int8 linears, their row scales) into one
    [sum of outputs, in] tensor and makes each module's tensor a view of its rows, so
    memory does not grow, `state_dict()` is unchanged and in-place updates of the
    parameters (`load_state_dict`, an optimizer step, the loader's copies) stay visible.
    `fused(x)` returns the outputs in module order: a tuple of [..., out_i] views.
    `project` uses it only while it is `current`: once a parameter is replaced rather
    than updated in place (`.to()`, `copy.deepcopy`, `load_state_dict(assign=True)`), or
    while autograd needs the parameters' gradients, the linears run one by one again,
    correct but unfused. All the linears must share one storage format.
    """

    def __init__(self, linears: list[nn.Module], into: dict[str, torch.Tensor] | None = None, copy: bool = True):
        """`into` ({"weight": ..., "scale": ...}): storage to fuse into (one expert's slice of
        the MoE's stacked weights) instead of a new tensor. `copy` False: the linears hold
        nothing yet (the loader fills the fused storage next), so their values are not copied."""
        if len({type(m) for m in linears}) != 1:
            raise ValueError(f"cannot fuse linears of different formats: {[type(m).__name__ for m in linears]}")
        into = into or {}
        self.first = linears[0]
        self.sizes = [m.weight.shape[0] for m in linears]
        self.weight = _fuse_rows(linears, "weight", into.get("weight"), copy)  # [sum(sizes), in]
        self.scale = (_fuse_rows(linears, "scale", into.get("scale"), copy)
                      if linears[0].scale is not None else None)  # [sum(sizes)]
        self._ends = (self.weight.data_ptr(), self.weight[sum(self.sizes) - self.sizes[-1]:].data_ptr())
        self.packed = False  # `weight` is prepacked for oneDNN (`int8pack.pack_fused`); the linears' are meta

    def current(self, linears: list[nn.Module]) -> bool:
        """Whether the first and last parameters still live in the fused weight."""
        return self.packed or (linears[0].weight.data_ptr(), linears[-1].weight.data_ptr()) == self._ends

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = linear(x, self.weight) if self.scale is None else self.first.matmul(x, self.weight, self.scale)
        return out.split_with_sizes(self.sizes, dim=-1)


def _fuse_rows(linears: list[nn.Module], attr: str, into: torch.Tensor | None = None,
               copy: bool = True) -> torch.Tensor:
    """Concatenate the modules' `attr` tensors along rows (into `into` when given; `copy`
    False: storage of that shape, values left out) and make each one a view of its rows."""
    with torch.no_grad():
        parts = [getattr(m, attr).detach() for m in linears]
        if not copy:
            first = parts[0]
            shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
            fused = into if into is not None else torch.empty(shape, dtype=first.dtype, device=first.device)
        else:
            fused = torch.cat(parts) if into is None else torch.cat(parts, out=into)
    off = 0
    for m in linears:
        n = getattr(m, attr).shape[0]
        _repoint(m, attr, fused[off:off + n])
        off += n
    return fused


def stack_views(mods: list[nn.Module], attr: str, copy: bool = True, into: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The modules' `attr` tensors stacked [len(mods), ...], each becoming a view of its
    slice (`copy` False: storage of that shape, `into` when given, values left out)."""
    with torch.no_grad():
        parts = [getattr(m, attr).detach() for m in mods]
        if copy:
            stacked = torch.stack(parts) if into is None else torch.stack(parts, out=into)
        else:
            stacked = into if into is not None else torch.empty(len(parts), *parts[0].shape, dtype=parts[0].dtype,
                                                                device=parts[0].device)
    for i, m in enumerate(mods):
        _repoint(m, attr, stacked[i])
    return stacked


# Where fused storage may come from instead of a new tensor: given the member tensors' full
# names (in storage order), their dtype and total element count, a flat tensor holding them
# back to back (the loader's mapped file pages), or None.
Source = Callable[[list[str], torch.dtype, int], "torch.Tensor | None"]


def sourced(source: Source | None, owner: nn.Module, prefix: str, mods: list[nn.Module], attr: str,
            shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """The storage `source` has for the `attr` tensors of `mods` (modules below `owner`, which
    is named `prefix`), viewed as `shape` (default: concatenated along rows); None without a
    source, or when it has none."""
    first = getattr(mods[0], attr, None)
    if source is None or first is None:
        return None
    if shape is None:
        parts = [getattr(m, attr) for m in mods]
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    names = {id(m): n for n, m in owner.named_modules()}
    flat = source([f"{prefix}{names[id(m)]}.{attr}" for m in mods], first.dtype, math.prod(shape))
    return None if flat is None else flat.view(shape)


def sourced_rows(source: Source | None, owner: nn.Module, prefix: str, mods: list[nn.Module]
                 ) -> dict[str, torch.Tensor]:
    """`FusedLinear`'s `into` for `mods`: the weight and scale storage `source` has for them."""
    return {a: t for a in ("weight", "scale") if (t := sourced(source, owner, prefix, mods, a)) is not None}


def _repoint(m: nn.Module, attr: str, view: torch.Tensor) -> None:
    """Make m's parameter or buffer `attr` the tensor `view` (same values, new storage)."""
    t = getattr(m, attr)
    if isinstance(t, nn.Parameter):
        t.data = view
    else:
        setattr(m, attr, view)  # a registered buffer


def project(x: torch.Tensor, fused: FusedLinear | None, linears: list[nn.Module]) -> tuple[torch.Tensor, ...]:
    """The outputs of `linears` on x: one matmul when they are fused (and the fusion is
    current, and no gradient is wanted), else one each."""
    if fused is not None and torch.compiler.is_compiling():  # inference; the check reads data pointers
        return fused(x)
    if (fused is not None and fused.current(linears)
            and not (torch.is_grad_enabled() and linears[0].weight.requires_grad)):
        return fused(x)
    return tuple(m(x) for m in linears)
