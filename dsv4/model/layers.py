"""Small building blocks of DeepSeek V4: RMS norms, interleaved RoPE tables, mHC.

Everything here is stateless math on packed token rows: a leading token axis T
(all rows of a dispatch concatenated), so the same code serves one whole prompt,
a prefill chunk and a batch of decodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, YarnParams, yarn_inv_freq


class RMSNorm(nn.Module):
    """Weighted RMS norm over the last dim, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = f32(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return cast(f32(self.weight) * xf, x.dtype)


def f32(t: torch.Tensor) -> torch.Tensor:
    """`t.float()` without a dispatch when it already is float32 (decode is op-overhead bound)."""
    return t if t.dtype == torch.float32 else t.float()


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last dim (the per-head query norm, mHC input norm)."""
    return x * cast(torch.rsqrt(f32(x).square().mean(-1, keepdim=True) + eps), x.dtype)


class RopeTable(nn.Module):
    """Rotations e^{i pos f} of interleaved RoPE for one base (and optional YaRN), grown on demand.

    `rotation(pos)` takes absolute positions [T] and returns complex64 [T, rope_dim // 2].
    """

    def __init__(self, rope_dim: int, base: float, yarn: YarnParams | None):
        super().__init__()
        self.register_buffer("inv_freq", yarn_inv_freq(rope_dim, base, yarn), persistent=False)
        self.register_buffer("cis", torch.empty(0, rope_dim // 2, dtype=torch.complex64), persistent=False)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cis.shape[0], 256)
        with torch.inference_mode(False):  # ordinary tensors, usable by training too
            freqs = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)[:, None] * self.inv_freq.clone()
            self.cis = torch.complex(freqs.cos(), freqs.sin())

    def rotation(self, pos: torch.Tensor, max_pos: int | None = None) -> torch.Tensor:
        need = (int(pos.max()) if max_pos is None else max_pos) + 1 if pos.numel() else 0
        if need > self.cis.shape[0]:
            self._grow(need)
        return self.cis[pos]


def apply_rope(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cis.shape[-1] dims of x as interleaved pairs (x[2i], x[2i+1])
    read as complex numbers: out = x * e^{i pos f} (the conjugate when `inverse`, used on
    the attention output).

    x: [T, ..., d]; cis: complex [T, r/2] (broadcast over the middle dims).
    """
    half = cis.shape[-1]
    if cis.dim() < x.dim():
        cis = cis.view(cis.shape[0], *([1] * (x.dim() - cis.dim())), half)
    if inverse:
        cis = cis.conj()
    rope = torch.view_as_complex(f32(x[..., -2 * half:]).reshape(*x.shape[:-1], half, 2))
    out = torch.view_as_real(rope * cis).flatten(-2)
    return torch.cat([x[..., : -2 * half], cast(out, x.dtype)], dim=-1)


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project [T, hc, hc] logits towards a doubly stochastic matrix (row softmax, then
    alternate column/row normalisations; the last one is a column normalisation).

    Decode runs this on a few 4x4 matrices: on the CPU without autograd, numpy's small-op
    overhead is half of torch's, and the arithmetic is the same IEEE float32, bit for bit.
    """
    c = torch.softmax(c, dim=-1)
    if c.device.type == "cpu" and c.dtype == torch.float32 and not c.requires_grad:
        a = c.numpy()
        a += eps
        a /= a.sum(-2, keepdims=True) + eps
        for _ in range(iters - 1):
            a /= a.sum(-1, keepdims=True) + eps
            a /= a.sum(-2, keepdims=True) + eps
        return c
    c = c + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


class HyperConnection(nn.Module):
    """mHC parameters of one sub-layer (`hc_{attn,ffn}_{fn,base,scale}` live on the block).

    `pre(x, fn, base, scale)` -> (y [T, D], post [T, hc], comb [T, hc, hc]);
    `post(f_y, x, post, comb)` -> [T, hc, D].
    """

    @staticmethod
    def pre(
        x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc = cfg.hc_mult
        xf = rms_unweighted(f32(x.flatten(-2)), cfg.rms_norm_eps)  # [T, hc*D]
        mixes = F.linear(xf, f32(fn))  # [T, (2+hc)*hc]
        base, scale = f32(base), f32(scale)
        pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
        post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        comb = mixes[:, 2 * hc :].view(-1, hc, hc) * scale[2] + base[2 * hc :].view(hc, hc)
        comb = sinkhorn(comb, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        y = cast((pre.unsqueeze(-1) * x).sum(dim=1), x.dtype)  # [T, D]
        return y, post, comb

    @staticmethod
    def post(fy: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        # out[j] = post[j] * f(y) + sum_i comb[i, j] * x[i]
        return cast(post, dt).unsqueeze(-1) * fy.unsqueeze(-2) + torch.matmul(cast(comb, dt).transpose(-1, -2), x)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Collapse the hc streams for the head: [T, hc, D] -> [T, D] (no Sinkhorn)."""
    xf = rms_unweighted(f32(x.flatten(-2)), cfg.rms_norm_eps)
    mixes = F.linear(xf, f32(fn))
    pre = torch.sigmoid(mixes * f32(scale) + f32(base)) + cfg.hc_eps
    return cast((pre.unsqueeze(-1) * x).sum(dim=1), x.dtype)
