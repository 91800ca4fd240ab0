"""Small building blocks of DeepSeek V4: linears (fused ones: fusion.py), RMS norms,
interleaved RoPE tables, mHC with its Sinkhorn projection.

Everything here is stateless math on packed token rows: a leading token axis T
(all rows of a dispatch concatenated), so the same code serves one whole prompt,
a prefill chunk and a batch of decodes. A decode step of a small model is bound by
per-op overhead, not arithmetic, so the hot helpers trade generality for fewer
dispatches (fused linears, cached constants, in-place RoPE, Sinkhorn in Python
floats for a single token), each shown equal to the plain formulation by
tests/model/test_fast_paths.py.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, YarnParams, yarn_inv_freq
from . import fp4_kernel, parallel


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` without bias; for packed rows [T, in] straight to `mm` (the same
    kernel F.linear reaches, minus two dispatch layers: decode runs ~80 of these a step)."""
    return torch.mm(x, w.t()) if x.dim() == 2 else F.linear(x, w)


class Linear(nn.Module):
    """Bias-free linear whose parameter is named `weight`, as in the checkpoint.

    The one place that says how a weight is stored and multiplied (with `FusedLinear`):
    here a plain float weight; `w8a8.QuantLinear` is the int8 one, swapped in at load.
    Model code calls the module (`self.wq_b(x)`, `self.wo_a.grouped(o)`), never its weight."""

    scale = None  # no row scales: the weight is used as stored

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal use of the rows in G groups: x [T, G, in] -> [T, G, out / G], group g
        multiplying rows g*out/G .. (g+1)*out/G (attention's grouped output projection)."""
        G = x.shape[1]
        w = self.weight.view(G, self.weight.shape[0] // G, -1)  # [G, O, in]
        return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)  # [T, G, O]


class StoredLinear(Linear):
    """A `Linear` whose weight stays bfloat16 as the checkpoint stores it while the model
    computes in float32 (the head under the int8 modes: `loader.head_as_stored`): float32 x
    [T, in] times each weight widened as it is read (`fp4_kernel.linear_bf16`), the float32
    weight's values at half the bytes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp4_kernel.linear_bf16(x, self.weight)

    @classmethod
    def keep(cls, lin: Linear) -> None:
        """Turn `lin` (a float Linear, meta or not) into one holding its weight in bfloat16."""
        lin.weight.data = lin.weight.data.to(torch.bfloat16)
        lin.__class__ = cls


class Embedding(nn.Module):
    """Token embedding whose parameter is named `weight`. Under tensor parallelism it
    holds the vocabulary rows [vocab_start, vocab_start + rows) (`sharding.shard_model`):
    other ids give zeros and the ranks' rows are summed."""

    vocab_start = 0

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, D]."""
        if parallel.world_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        e = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return parallel.all_reduce(e)


class RMSNorm(nn.Module):
    """Weighted RMS norm over the last dim, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = f32(x)
        return cast(f32(self.weight) * (xf * rms_scale(xf, self.eps)), x.dtype)


def f32(t: torch.Tensor) -> torch.Tensor:
    """`t.float()` without a dispatch when it already is float32 (decode is op-overhead bound)."""
    return t if t.dtype == torch.float32 else t.float()


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last dim (the per-head query norm)."""
    return x * cast(rms_scale(f32(x), eps), x.dtype)


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) over the last dim: [..., n] -> [..., 1] (x float32).

    Written as eps + sum(x^2) * (1/n) in one fused op with cached constants: a Python
    scalar operand costs a tensor wrap per call, and decode runs ~45 of these a step."""
    dev = x.device
    return torch.rsqrt(torch.addcmul(constant(eps, dev), (x * x).sum(-1, keepdim=True),
                                     constant(1.0 / x.shape[-1], dev)))


_CONSTANTS: dict[tuple[float, torch.device], torch.Tensor] = {}


def constant(value: float, device: torch.device) -> torch.Tensor:
    """A cached float32 0-dim tensor (an ordinary tensor, usable by autograd too). As an
    operand it gives the same float32 arithmetic as the Python float, without the per-call
    wrap of a Python scalar into a tensor, a large share of a small CPU op (measured:
    docs/architecture.md, 'dsv4/model/layers.py')."""
    key = (value, device)
    t = _CONSTANTS.get(key)
    if t is None:
        if torch.compiler.is_compiling():  # a constant of the graph (cached by the first eager call)
            return torch.tensor(value, dtype=torch.float32, device=device)
        with torch.inference_mode(False):
            t = _CONSTANTS[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return t


Rotation = tuple[torch.Tensor, torch.Tensor]  # (C, S) [T, r]: see `RopeTable.rotation`


class RopeTable(nn.Module):
    """Rotations of interleaved RoPE for one base (and optional YaRN), as real tables.

    `rotation(pos)` takes absolute positions [T] and returns (C, S), each [T, rope_dim]:
    C = (cos f0, cos f0, cos f1, cos f1, ...), S = (-sin f0, sin f0, -sin f1, sin f1, ...),
    so that `apply_rope` is x * C + swap_pairs(x) * S: the complex product
    (a + ib) e^{i pos f} in real arithmetic (no complex dtype: a compiler takes it whole).
    The tables grow on demand; a compiled caller grows them first (`ensure`) and passes
    the highest position, so that nothing is read back from the device.
    """

    def __init__(self, rope_dim: int, base: float, yarn: YarnParams | None):
        super().__init__()
        self.key = ("rope", base, yarn is not None)  # names this table in a dispatch's memo
        self.register_buffer("inv_freq", yarn_inv_freq(rope_dim, base, yarn), persistent=False)
        empty = torch.empty(0, rope_dim)
        self.register_buffer("cos2", empty, persistent=False)
        self.register_buffer("sin2", empty.clone(), persistent=False)

    def ensure(self, n: int) -> None:
        """Hold the rotations of positions 0..n-1 at least."""
        if n > self.cos2.shape[0]:
            n = max(n, 2 * self.cos2.shape[0], 256)
            with torch.inference_mode(False):  # ordinary tensors, usable by training too
                freqs = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)[:, None] * self.inv_freq.clone()
                sign = torch.tensor([-1.0, 1.0], device=freqs.device)
                self.cos2 = freqs.cos().repeat_interleave(2, dim=-1)  # [n, r]
                self.sin2 = (freqs.sin()[:, :, None] * sign).flatten(1)  # [n, r]

    def rotation(self, pos: torch.Tensor, max_pos: int | None = None) -> Rotation:
        """(C, S) [T, r] at positions pos [T]; `max_pos` (the highest, if the caller knows it)
        spares a read of pos back to the host."""
        if pos.numel():
            self.ensure((int(pos.max()) if max_pos is None else max_pos) + 1)
        return self.cos2.index_select(0, pos), self.sin2.index_select(0, pos)


def rot_rows(rot: Rotation, idx) -> Rotation:
    """The rotations of some tokens (an index or slice of the token axis)."""
    return rot[0][idx], rot[1][idx]


def inverse_rotation(rot: Rotation) -> Rotation:
    """The conjugate rotations (applied to the attention output)."""
    return rot[0], -rot[1]


def apply_rope(x: torch.Tensor, rot: Rotation, inverse: bool = False, inplace: bool = False) -> torch.Tensor:
    """Rotate the trailing r = C.shape[-1] dims of x as interleaved pairs (x[2i], x[2i+1])
    read as complex numbers: out = x * e^{i pos f} (the conjugate when `inverse`, used on
    the attention output), computed in float32 as x * C + swap_pairs(x) * S.

    x: [T, ..., d]; rot: (C, S) [T, r] (broadcast over the middle dims). With `inplace`
    (for callers that own a fresh x) the rotation is written into x unless autograd tracks
    it; the arithmetic is the same either way.
    """
    C, S = inverse_rotation(rot) if inverse else rot
    r = C.shape[-1]
    if C.dim() < x.dim():
        shape = (C.shape[0], *([1] * (x.dim() - C.dim())), r)
        C, S = C.view(shape), S.view(shape)
    tail = f32(x[..., -r:])
    swapped = tail.unflatten(-1, (r // 2, 2)).flip(-1).flatten(-2)  # (b0, a0, b1, a1, ...)
    out = tail * C + swapped * S
    if inplace and not (x.requires_grad and torch.is_grad_enabled()):
        x[..., -r:].copy_(out)
        return x
    return torch.cat([x[..., :-r], cast(out, x.dtype)], dim=-1)


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project [T, hc, hc] logits towards a doubly stochastic matrix (row softmax, then
    alternate column/row normalisations; the last one is a column normalisation).

    Decode runs this on one or two 4x4 matrices per sub-layer, where op overhead is all
    the cost. On the CPU without autograd the iterations run in float64: plain Python
    for a few hc=4 matrices, numpy otherwise. Both perform the same IEEE double
    operations in the same order (sums left to right), so they agree bit for bit and a
    row's result does not depend on the batch it rides in.
    """
    c = torch.softmax(c, dim=-1)
    if torch.compiler.is_compiling():  # tensor ops only; on the CPU the same float64 arithmetic
        return _sinkhorn_unrolled(c, iters, eps) if c.device.type == "cpu" else _sinkhorn_tensor(c, iters, eps)
    if c.device.type == "cpu" and not c.requires_grad:
        if c.shape[-1] == 4 and c.shape[0] <= SINKHORN_PY_MAX:
            flat = c.flatten().tolist()
            out = [x for i in range(0, len(flat), 16) for x in _sinkhorn4(flat[i:i + 16], iters, eps)]
            return torch.tensor(out, dtype=c.dtype).view(c.shape)
        a = c.double().numpy()
        a += eps
        if c.shape[0] >= SINKHORN_SLICED_MIN and c.shape[-1] < 8:
            _sinkhorn_sliced(a, iters, eps)
        else:
            a /= a.sum(-2, keepdims=True) + eps
            for _ in range(iters - 1):
                a /= a.sum(-1, keepdims=True) + eps
                a /= a.sum(-2, keepdims=True) + eps
        return torch.from_numpy(a).to(c.dtype)
    return _sinkhorn_tensor(c, iters, eps)


def _sinkhorn_tensor(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn`'s iterations with torch's reductions (autograd, GPUs)."""
    c = c + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def _sinkhorn_unrolled(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn`'s iterations as float64 tensor ops, each sum unrolled left to right: the
    IEEE operations of the Python and numpy paths in the same order (so the same bits),
    in a form a compiler takes whole (the compiled decode step). [T, hc, hc] -> c's dtype."""
    a = c.double() + eps
    hc = a.shape[-1]
    for it in range(max(iters, 1)):  # like the other paths, the columns are normalised at least once
        if it:  # rows
            s = a[:, :, 0:1]
            for j in range(1, hc):
                s = s + a[:, :, j:j + 1]
            a = a / (s + eps)
        s = a[:, 0:1, :]  # columns
        for i in range(1, hc):
            s = s + a[:, i:i + 1, :]
        a = a / (s + eps)
    return a.to(c.dtype)


SINKHORN_PY_MAX = 2  # up to this many matrices, unrolled Python beats numpy's per-call overhead
SINKHORN_SLICED_MIN = 64  # from this many (prefill chunks), sums over slices beat numpy's small-axis reduce


def _sinkhorn_sliced(a: np.ndarray, iters: int, eps: float) -> None:
    """`sinkhorn`'s iterations in place on a float64 numpy array [T, hc, hc], summing
    slice by slice, left to right: for hc < 8 numpy's `sum` over such a short axis adds in
    the same order, so this is the same arithmetic, faster on many matrices (measured:
    docs/architecture.md, 'dsv4/model/layers.py')."""
    hc = a.shape[-1]
    at = a.transpose(0, 2, 1)  # at[t, j, i] = a[t, i, j]

    def normalise(m, out_shape) -> None:  # divide by the sums over m's axis 1
        s = m[:, 0] + m[:, 1] if hc > 1 else m[:, 0].copy()
        for i in range(2, hc):
            s += m[:, i]
        s += eps
        np.divide(a, s.reshape(out_shape), out=a)

    T = a.shape[0]
    normalise(a, (T, 1, hc))  # columns
    for _ in range(iters - 1):
        normalise(at, (T, hc, 1))  # rows
        normalise(a, (T, 1, hc))


def _sinkhorn4(m: list[float], iters: int, eps: float) -> tuple[float, ...]:
    """`sinkhorn`'s iterations on one 4x4 matrix (after the softmax, row-major) in Python floats."""
    a, b, c, d, e, f, g, h, i, j, k, l, m_, n, o, p = (x + eps for x in m)  # noqa: E741
    for it in range(max(iters, 1)):  # like the other paths, the columns are normalised at least once
        if it:  # rows
            s = a + b + c + d + eps
            a, b, c, d = a / s, b / s, c / s, d / s
            s = e + f + g + h + eps
            e, f, g, h = e / s, f / s, g / s, h / s
            s = i + j + k + l + eps
            i, j, k, l = i / s, j / s, k / s, l / s  # noqa: E741
            s = m_ + n + o + p + eps
            m_, n, o, p = m_ / s, n / s, o / s, p / s
        s = a + e + i + m_ + eps  # columns
        a, e, i, m_ = a / s, e / s, i / s, m_ / s
        s = b + f + j + n + eps
        b, f, j, n = b / s, f / s, j / s, n / s
        s = c + g + k + o + eps
        c, g, k, o = c / s, g / s, k / s, o / s
        s = d + h + l + p + eps
        d, h, l, p = d / s, h / s, l / s, p / s
    return a, b, c, d, e, f, g, h, i, j, k, l, m_, n, o, p


class HyperConnection(nn.Module):
    """mHC parameters of one sub-layer (`hc_{attn,ffn}_{fn,base,scale}` live on the block).

    `pre(x, fn, base, scale)` -> (y [T, D], post [T, hc], comb [T, hc, hc]);
    `post(f_y, x, post, comb)` -> [T, hc, D].
    """

    @staticmethod
    def pre(
        x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc, T, dev = cfg.hc_mult, x.shape[0], x.device
        # z = base + scale * (fn @ rms_norm(x)), the three scales spread over their segments
        z = torch.addcmul(f32(base), _mix(x, fn, cfg.rms_norm_eps), f32(scale).index_select(0, _scale_index(hc, dev)))
        gates = torch.sigmoid(z[:, : 2 * hc])  # [T, 2hc]
        pre, post = gates[:, :hc] + constant(cfg.hc_eps, dev), gates[:, hc:] * constant(2.0, dev)
        comb = sinkhorn(z[:, 2 * hc:].view(T, hc, hc), cfg.hc_sinkhorn_iters, cfg.hc_eps)
        return _collapse(pre, x), post, comb

    @staticmethod
    def post(fy: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        # out[j] = post[j] * f(y) + sum_i comb[i, j] * x[i]
        return torch.baddbmm(cast(post, dt).unsqueeze(-1) * fy.unsqueeze(1), cast(comb, dt).transpose(1, 2), x)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Collapse the hc streams for the head: [T, hc, D] -> [T, D] (no Sinkhorn)."""
    pre = torch.sigmoid(torch.addcmul(f32(base), _mix(x, fn, cfg.rms_norm_eps), f32(scale))) + constant(cfg.hc_eps, x.device)
    return _collapse(pre, x)


def _mix(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """fn @ rms_norm(flattened streams): [T, hc, D] -> [T, n] float32 (the norm is applied
    to the n outputs rather than the hc*D inputs: the same value, fewer operations)."""
    xf = f32(x).flatten(1)  # [T, hc*D]
    return linear(xf, f32(fn)) * rms_scale(xf, eps)


def _collapse(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_i weights[:, i] * x[:, i]: [T, hc] and [T, hc, D] -> [T, D] in x's dtype."""
    return cast(torch.bmm(weights.unsqueeze(1), f32(x)).squeeze(1), x.dtype)


_SCALE_INDEX: dict[tuple[int, torch.device], torch.Tensor] = {}


def _scale_index(hc: int, device: torch.device) -> torch.Tensor:
    """Which of the three mHC scales each of the (2 + hc) * hc mixes takes: [0]*hc + [1]*hc + [2]*hc*hc."""
    key = (hc, device)
    if key not in _SCALE_INDEX:
        if torch.compiler.is_compiling():
            return torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=device)
        with torch.inference_mode(False):  # an ordinary tensor, usable by training too
            _SCALE_INDEX[key] = torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=device)
    return _SCALE_INDEX[key]
