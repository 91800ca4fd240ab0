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
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS norm over the last dim (the per-head query norm, mHC input norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


class RopeTable(nn.Module):
    """Cos/sin of interleaved RoPE for one base (and optional YaRN), grown on demand.

    `cos_sin(pos)` takes absolute positions [T] and returns cos, sin [T, rope_dim // 2].
    """

    def __init__(self, rope_dim: int, base: float, yarn: YarnParams | None):
        super().__init__()
        self.register_buffer("inv_freq", yarn_inv_freq(rope_dim, base, yarn), persistent=False)
        self.register_buffer("cos", torch.empty(0, rope_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(0, rope_dim // 2), persistent=False)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 256)
        with torch.inference_mode(False):  # ordinary tensors, usable by training too
            freqs = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)[:, None] * self.inv_freq.clone()
            self.cos, self.sin = freqs.cos(), freqs.sin()

    def cos_sin(self, pos: torch.Tensor, max_pos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        need = (int(pos.max()) if max_pos is None else max_pos) + 1 if pos.numel() else 0
        if need > self.cos.shape[0]:
            self._grow(need)
        return self.cos[pos], self.sin[pos]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] dims of x as interleaved pairs.

    x: [T, ..., d]; cos/sin: [T, r/2] (broadcast over the middle dims).
    `inverse` applies the conjugate rotation (used on the attention output).
    """
    r = cos.shape[-1] * 2
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-r], x[..., -r:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


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
        xf = rms_unweighted(x.flatten(-2).float(), cfg.rms_norm_eps)  # [T, hc*D]
        mixes = F.linear(xf, fn.float())  # [T, (2+hc)*hc]
        base, scale = base.float(), scale.float()
        pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
        post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        comb = mixes[:, 2 * hc :].view(-1, hc, hc) * scale[2] + base[2 * hc :].view(hc, hc)
        comb = sinkhorn(comb, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        y = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)  # [T, D]
        return y, post, comb

    @staticmethod
    def post(fy: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        # out[j] = post[j] * f(y) + sum_i comb[i, j] * x[i]
        return post.to(dt).unsqueeze(-1) * fy.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Collapse the hc streams for the head: [T, hc, D] -> [T, D] (no Sinkhorn)."""
    xf = rms_unweighted(x.flatten(-2).float(), cfg.rms_norm_eps)
    mixes = F.linear(xf, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
