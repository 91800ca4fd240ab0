"""A decode-shaped dispatch written for a compiler: static shapes, no host reads.

`StaticStep(model, state)` holds the same weights and the same `ModelState` as the eager
model and offers `main(ids, pos, slots)` and `mtp(ids, pos, slots, hidden)`, the
equivalents of `forward_batch` / `mtp_forward` for dispatches whose rows are all short
(decode rows of 1 + K tokens and the MTP's draft rows: every token gathers its own keys).
Every value here is a tensor op on tensors of a fixed shape for a given token count T:

* RoPE as real cos/sin tables gathered by position (no complex numbers);
* the window and compressed-entry masks from positions, over the whole entry table
  (the eager path reads back the visible count with `int(t.max())`);
* the compressor pools a window for every token and writes the non-closing ones into the
  spare last entry row, which no query ever sees (the eager path picks closers on the host);
* Sinkhorn as 20 unrolled float64 tensor iterations, summing left to right as the eager
  Python-float path does;
* the MoE without an expert list (the eager path lists the chosen experts on the host):
  for few tokens (tokens x top-k <= 4 x experts) the chosen experts' weights are gathered
  inside the reduction, otherwise every expert runs, weighted by the router's (mostly
  zero) weights; either way the shares are added in increasing expert order, as eager.

so `torch.compile(fullgraph=True, dynamic=False)` takes it whole. The state bookkeeping
(`ModelState.begin`, lengths, rollback) stays with the caller. Results equal the eager
path up to summation order (tests/model/test_static_step.py states the tolerance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import CSA, WINDOW
from .model import Block, DeepseekV4
from .state import ModelState

NEG = float("-inf")
# The MoE gathers the chosen experts' weights while tokens x top-k <= GATHER_MAX x experts,
# else runs every expert densely. Measured on the embedded model (8 experts, top-2, 1 thread,
# docs/benchmark-log.md section 4): gathering made the compiled 8-token step 0.42x of eager instead of 0.86x
# (dense), the 16-token one 0.48-0.53x instead of 0.81x.
GATHER_MAX = 4


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS norm over the last dim in float32 (weighted unless w is None)."""
    y = x * torch.rsqrt((x * x).sum(-1, keepdim=True) * (1.0 / x.shape[-1]) + eps)
    return y if w is None else w * y


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2 * r dims of x [T, ..., d]; cos, sin [T, r]
    (pass -sin for the inverse rotation)."""
    r = cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    tail = x[..., -2 * r:].unflatten(-1, (r, 2))
    a, b = tail[..., 0], tail[..., 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-2 * r], rot], dim=-1)


def _sinkhorn(z: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[T, hc, hc] logits -> doubly stochastic, in float64 with sums left to right (the
    eager `_sinkhorn4` arithmetic), returned in float32."""
    c = torch.softmax(z, dim=-1).double() + eps
    hc = c.shape[-1]
    for it in range(max(iters, 1)):
        if it:
            s = c[:, :, 0:1]
            for j in range(1, hc):
                s = s + c[:, :, j:j + 1]
            c = c / (s + eps)
        s = c[:, 0:1, :]
        for i in range(1, hc):
            s = s + c[:, i:i + 1, :]
        c = c / (s + eps)
    return c.float()


class StaticStep:
    """Compilable decode dispatches of `model` over `state` (see the module docstring)."""

    def __init__(self, model: DeepseekV4, state: ModelState):
        self.model, self.state, self.cfg = model, state, model.cfg
        cfg, dev = model.cfg, model.embed.weight.device
        n = state.max_len + 1
        self.tables = {}
        for name, rope in (("main", model.rope_main), ("compress", model.rope_compress)):
            freqs = torch.arange(n, device=dev, dtype=torch.float32)[:, None] * rope.inv_freq.clone()
            self.tables[name] = (freqs.cos(), freqs.sin())  # [n, r/2], the values of RopeTable.cis
        self.experts = []  # per block: (w13 [E * 2I, D], w2 [E, D, I])
        blocks = list(model.layers) + (list(model.mtp) if model.mtp is not None else [])
        for b in blocks:
            ex = b.ffn.experts
            w13 = torch.cat([torch.cat([e.w1.weight, e.w3.weight]) for e in ex])
            w2 = torch.stack([e.w2.weight for e in ex])
            self.experts.append((w13, w2))
        hc = cfg.hc_mult
        self.scale_index = torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=dev)

    # ------------------------------------------------------------------ entry points
    def main(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, pos, slots [T] -> (hidden [T, hc, D], logits [T, vocab] float32)."""
        m, cfg = self.model, self.cfg
        h = F.embedding(ids, m.embed.weight).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [T, hc, D]
        for i, layer in enumerate(m.layers):
            h = self._block(layer, i, h, ids, pos, slots, self.state.layers[i])
        return h, self._logits(h, m.hc_head_fn, m.hc_head_base, m.hc_head_scale, m.norm.weight)

    def mtp(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP over pairs (hidden [T, hc, D], ids [T]) at positions pos -> (z [T, hc, D], logits [T, vocab])."""
        m, cfg = self.model, self.cfg
        b = m.mtp[0]
        eps = cfg.rms_norm_eps
        e = _rms(F.embedding(ids, m.embed.weight), b.enorm.weight, eps)
        z = (e @ b.e_proj.weight.t()).unsqueeze(1) + _rms(hidden, b.hnorm.weight, eps) @ b.h_proj.weight.t()
        z = self._block(b, len(m.layers), z, ids, pos, slots, self.state.mtp)
        return z, self._logits(z, b.hc_head_fn, b.hc_head_base, b.hc_head_scale, b.norm.weight)

    # ------------------------------------------------------------------ pieces
    def _logits(self, h, fn, base, scale, norm_w) -> torch.Tensor:
        cfg = self.cfg
        xf = h.flatten(1)
        mix = (xf @ fn.t()) * torch.rsqrt((xf * xf).sum(-1, keepdim=True) * (1.0 / xf.shape[-1]) + cfg.rms_norm_eps)
        pre = torch.sigmoid(base + mix * scale) + cfg.hc_eps  # [T, hc]
        y = torch.bmm(pre.unsqueeze(1), h).squeeze(1)  # [T, D]
        return _rms(y, norm_w, cfg.rms_norm_eps) @ self.model.head.weight.t()

    def _hc_pre(self, x, fn, base, scale):
        """mHC pre-mix: x [T, hc, D] -> (y [T, D], post [T, hc], comb [T, hc, hc])."""
        cfg = self.cfg
        hc, T = cfg.hc_mult, x.shape[0]
        xf = x.flatten(1)
        mix = (xf @ fn.t()) * torch.rsqrt((xf * xf).sum(-1, keepdim=True) * (1.0 / xf.shape[-1]) + cfg.rms_norm_eps)
        z = base + mix * scale.index_select(0, self.scale_index)
        gates = torch.sigmoid(z[:, :2 * hc])
        pre, post = gates[:, :hc] + cfg.hc_eps, gates[:, hc:] * 2.0
        comb = _sinkhorn(z[:, 2 * hc:].reshape(T, hc, hc), cfg.hc_sinkhorn_iters, cfg.hc_eps)
        return torch.bmm(pre.unsqueeze(1), x).squeeze(1), post, comb

    @staticmethod
    def _hc_post(fy, x, post, comb):
        return torch.baddbmm(post.unsqueeze(-1) * fy.unsqueeze(1), comb.transpose(1, 2), x)

    def _block(self, blk: Block, i: int, x, ids, pos, slots, ls):
        eps = self.cfg.rms_norm_eps
        y, post, comb = self._hc_pre(x, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale)
        x = self._hc_post(self._attention(blk.attn, _rms(y, blk.attn_norm.weight, eps), pos, slots, ls), x, post, comb)
        y, post, comb = self._hc_pre(x, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale)
        return self._hc_post(self._moe(blk.ffn, i, _rms(y, blk.ffn_norm.weight, eps), ids), x, post, comb)

    def _attention(self, at, x, pos, slots, ls):
        """x [T, D] -> [T, D], writing this dispatch's rows into `ls` first."""
        cfg = self.cfg
        T, H, hd, W, eps = x.shape[0], at.n_heads, at.head_dim, cfg.sliding_window, cfg.rms_norm_eps
        cos_t, sin_t = self.tables["main" if at.kind == WINDOW else "compress"]
        cos, sin = cos_t.index_select(0, pos), sin_t.index_select(0, pos)  # [T, r/2]
        lin = at._x_linears()
        w = at.fused.weight if at.fused is not None else torch.cat([m.weight for m in lin])
        qa, kv, *xp = (x @ w.t()).split_with_sizes([m.weight.shape[0] for m in lin], dim=-1)
        qr = _rms(qa, at.q_norm.weight, eps)
        q = _rope(_rms((qr @ at.wq_b.weight.t()).view(T, H, hd), None, eps), cos, sin)  # [T, H, hd]
        kv = _rope(_rms(kv, at.kv_norm.weight, eps), cos, sin)  # [T, hd]
        Rw = ls.win.shape[1]
        win = ls.win.view(-1, hd)
        win.index_copy_(0, slots * Rw + pos % Rw, kv)
        if at.kind != WINDOW:
            self._compress(at.compressor, xp[0], xp[1], pos, slots, ls.raw_kv, ls.raw_score, ls.entries)
        if at.kind == CSA:
            c = at.indexer.compressor
            self._compress(c, xp[3], xp[4], pos, slots, ls.idx_raw_kv, ls.idx_raw_score, ls.idx_entries)
        kpos = pos[:, None] - torch.arange(W - 1, -1, -1, device=pos.device)  # [T, W]
        keys = win.index_select(0, (slots[:, None] * Rw + kpos % Rw).flatten()).view(T, W, hd)
        bias = torch.zeros(T, W, device=x.device).masked_fill(kpos < 0, NEG)
        if at.kind != WINDOW:
            E = ls.entries.shape[1]
            visible = torch.arange(E, device=pos.device)[None, :] < ((pos + 1) // at.ratio)[:, None]  # [T, E]
            if at.kind == CSA and E > at.indexer.topk:
                cbias = self._select(at.indexer, xp[2], qr, cos, sin, ls.idx_entries.index_select(0, slots), visible)
            else:
                cbias = torch.zeros(T, E, device=x.device).masked_fill(~visible, NEG)
            keys = torch.cat([keys, ls.entries.index_select(0, slots)], dim=1)  # [T, W + E, hd]
            bias = torch.cat([bias, cbias], dim=1)
        scores = torch.bmm(q, keys.transpose(1, 2)) * hd ** -0.5 + bias.unsqueeze(1)  # [T, H, K]
        sink = at.attn_sink.view(1, H, 1).expand(T, H, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        o = _rope(torch.bmm(probs, keys), cos, -sin)  # [T, H, hd]
        o = at.wo_a.grouped(o.reshape(T, at.n_groups, -1))
        return o.flatten(1) @ at.wo_b.weight.t()

    def _select(self, ix, head_w, qr, cos, sin, keys, visible):
        """The indexer's top-k over keys [T, E, di] -> bias [T, E] (0 chosen, -inf not)."""
        T, E = qr.shape[0], visible.shape[-1]
        q = _rope((qr @ ix.wq_b.weight.t()).view(T, ix.n_heads, ix.head_dim), cos, sin)
        scores = torch.bmm(q, keys.transpose(1, 2)).relu() * ix.head_dim ** -0.5  # [T, H, E]
        scores = (scores * (head_w * ix.head_scale).unsqueeze(-1)).sum(dim=1).masked_fill(~visible, NEG)
        top = scores.topk(min(ix.topk, E), dim=-1).indices
        chosen = visible.gather(1, top)
        bias = torch.full((T, E + 1), NEG, device=qr.device)
        return bias.scatter(1, torch.where(chosen, top, E), 0.0)[:, :E]

    def _compress(self, c, kv, gate, pos, slots, raw_kv, raw_score, entries) -> None:
        """Write the rows, then pool each token's window; closing tokens write their entry,
        the others the spare last row of their slot (never visible)."""
        m, d = c.ratio, c.dim
        R, E = raw_kv.shape[1], entries.shape[1]
        rkv, rsc = raw_kv.view(-1, raw_kv.shape[-1]), raw_score.view(-1, raw_score.shape[-1])
        rows = slots * R + pos % R
        rkv.index_copy_(0, rows, kv)
        rsc.index_copy_(0, rows, gate + c.ape.index_select(0, pos % m))
        w = pos // m
        first = w * m
        k = torch.arange(m, device=pos.device)
        p = torch.cat([first[:, None] - m + k, first[:, None] + k], dim=1) if c.overlap else first[:, None] + k
        src = (slots[:, None] * R + p % R).flatten()
        T = pos.shape[0]
        sel_kv = rkv.index_select(0, src).view(T, -1, rkv.shape[-1])
        sel_sc = rsc.index_select(0, src).view(T, -1, rsc.shape[-1])
        if c.overlap:
            missing = (p < 0).unsqueeze(-1)
            sel_kv = torch.cat([sel_kv[:, :m, :d], sel_kv[:, m:, d:]], dim=1).masked_fill(missing, 0.0)
            sel_sc = torch.cat([sel_sc[:, :m, :d], sel_sc[:, m:, d:]], dim=1).masked_fill(missing, NEG)
        pooled = _rms((sel_kv * sel_sc.softmax(dim=1)).sum(dim=1), c.norm.weight, self.cfg.rms_norm_eps)  # [T, d]
        cos_t, sin_t = self.tables["compress"]
        pooled = _rope(pooled, cos_t.index_select(0, first), sin_t.index_select(0, first))
        close = (pos + 1) % m == 0
        entries.view(-1, d).index_copy_(0, slots * E + torch.where(close, w, E - 1), pooled)

    def _moe(self, ffn, i, x, ids):
        """x [T, D] -> [T, D]: the shared expert plus the chosen experts' shares, in expert order."""
        g = ffn.gate
        scores = F.softplus(x @ g.weight.t()).sqrt()  # [T, E]
        idx = g.tid2eid.index_select(0, ids) if g.hash else torch.topk(scores + g.bias, g.k, dim=-1).indices
        wk = scores.gather(1, idx)
        wk = wk / (wk.sum(dim=-1, keepdim=True) + 1e-20) * g.scale
        out = self._expert(ffn.shared_experts, x)
        w13, w2 = self.experts[i]
        E, I, D = w2.shape[0], w2.shape[2], x.shape[1]
        lim = ffn.experts[0].limit
        T, k = idx.shape
        if T * k <= GATHER_MAX * E:  # the chosen experts' weights, gathered inside the reduction
            idx, perm = idx.sort(dim=-1)  # the eager path adds experts in increasing order
            wk = wk.gather(1, perm)
            gu = (x[:, None, None, :] * w13.view(E, 2 * I, D)[idx]).sum(-1)  # [T, k, 2I]
            gg, uu = gu[..., :I], gu[..., I:]
            if lim > 0:
                gg, uu = gg.clamp(max=lim), uu.clamp(-lim, lim)
            h = F.silu(gg) * uu * wk.unsqueeze(-1)  # [T, k, I]
            y = (h[:, :, None, :] * w2[idx]).sum(-1)  # [T, k, D]
            for j in range(k):
                out = out + y[:, j]
            return out
        dense = torch.zeros_like(scores).scatter(1, idx, wk)  # [T, E]
        gu = (x @ w13.t()).view(-1, E, 2, I)  # [T, E, 2, I]
        gg, uu = gu[:, :, 0], gu[:, :, 1]
        if lim > 0:
            gg, uu = gg.clamp(max=lim), uu.clamp(-lim, lim)
        h = F.silu(gg) * uu * dense.unsqueeze(-1)  # [T, E, I]
        y = torch.bmm(h.transpose(0, 1), w2.transpose(1, 2))  # [E, T, D]
        for e in range(E):
            out = out + y[e]
        return out

    @staticmethod
    def _expert(ex, x):
        g, u = (x @ ex.fused.weight.t()).chunk(2, dim=-1) if ex.fused is not None else (ex.w1(x), ex.w3(x))
        if ex.limit > 0:
            g, u = g.clamp(max=ex.limit), u.clamp(-ex.limit, ex.limit)
        return ex.w2(F.silu(g) * u)
