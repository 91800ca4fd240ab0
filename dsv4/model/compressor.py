"""The KV compressor of CSA/HCA layers and the lightning indexer of CSA layers.

The compressor pools every `ratio` tokens into one entry: a softmax over the window
of the gate projection (plus a learned per-offset bias `ape`) weights the kv
projection, then an RMS norm and RoPE at the window's first position. CSA windows
overlap: an entry pools the `Ca` half of the previous window and the `Cb` half of
its own. The indexer scores compressed entries per query and keeps the top-k.

Projections of the layer input (`wkv`, `wgate`, the indexer's `weights_proj`) are
computed by the attention layer, fused with its own, and passed in.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from . import parallel
from .layers import Linear, RMSNorm, RopeTable, Rotation, apply_rope, cast, constant, f32
from .state import Batch, flat_rows


class Compressor(nn.Module):
    """Pools every `ratio` tokens into one entry (overlapping windows for CSA)."""

    def __init__(self, cfg: ModelConfig, ratio: int, dim: int, overlap: bool):
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        coff = 2 if overlap else 1
        self.wkv = Linear(cfg.hidden_size, coff * dim)
        self.wgate = Linear(cfg.hidden_size, coff * dim)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * dim))
        self.norm = RMSNorm(dim, cfg.rms_norm_eps)

    def forward(self, kv: torch.Tensor, gate: torch.Tensor, batch: Batch, raw_kv: torch.Tensor,
                raw_score: torch.Tensor, entries: torch.Tensor, table: torch.Tensor, rope: RopeTable) -> None:
        """Write this dispatch's rows (kv, gate: the projections [T, coff*d]), then
        (re)compute every entry a row closes into the block pool `entries` [blocks, per, d]
        through the block table [slots, blocks]."""
        m, d, pos = self.ratio, self.dim, batch.positions
        R = raw_kv.shape[1]
        rows = batch.ring_rows(R)
        flat_rows(raw_kv).index_copy_(0, rows, f32(kv))
        ape = f32(self.ape).index_select(0, batch.cached(("mod", m), lambda: pos % m))
        flat_rows(raw_score).index_copy_(0, rows, f32(gate) + ape)
        key = ("close", m, R, entries.shape[:2], self.overlap, rope.key)  # shared by the layers of this ratio
        closes = batch.cached(key, lambda: closed_windows(batch, m, R, entries.shape[1], entries.shape[0] - 1,
                                                          table, self.overlap, rope))
        if closes is None:
            return
        src, missing, entry_rows, cis = closes
        C = entry_rows.shape[0]
        sel_kv = flat_rows(raw_kv).index_select(0, src).view(C, -1, raw_kv.shape[-1])  # [C, k, coff*d]
        sel_sc = flat_rows(raw_score).index_select(0, src).view(C, -1, raw_score.shape[-1])
        if self.overlap:  # the previous window's Ca half, then this window's Cb half
            sel_kv = torch.cat([sel_kv[:, :m, :d], sel_kv[:, m:, d:]], dim=1).masked_fill(missing, 0.0)  # [C, 2m, d]
            sel_sc = torch.cat([sel_sc[:, :m, :d], sel_sc[:, m:, d:]], dim=1).masked_fill(missing, float("-inf"))
        pooled = self.norm((sel_kv * sel_sc.softmax(dim=1)).sum(dim=1))  # [C, d]
        flat_rows(entries).index_copy_(0, entry_rows, cast(apply_rope(pooled, cis, inplace=True), entries.dtype))

    def pool_dense(self, kv: torch.Tensor, gate: torch.Tensor, B: int, S: int, rope: RopeTable) -> torch.Tensor:
        """Stateless: every complete window of B sequences of S tokens -> entries [B, S//m, d].
        kv, gate: the projections [B*S, coff*d]."""
        m, d, dt = self.ratio, self.dim, kv.dtype
        n = S // m
        pos = torch.arange(S, device=kv.device)
        kv = kv.float().view(B, S, -1)
        score = gate.float().view(B, S, -1) + self.ape.float()[pos % m]
        kv, score = kv[:, : n * m].reshape(B, n, m, -1), score[:, : n * m].reshape(B, n, m, -1)
        if self.overlap:
            prev_kv = torch.cat([torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]], dim=1)
            prev_sc = torch.cat([torch.full_like(score[:, :1, :, :d], float("-inf")), score[:, :-1, :, :d]], dim=1)
            kv = torch.cat([prev_kv, kv[..., d:]], dim=2)  # [B, n, 2m, d]
            score = torch.cat([prev_sc, score[..., d:]], dim=2)
        pooled = self.norm((kv * score.softmax(dim=2)).sum(dim=2))  # [B, n, d]
        C, Sn = rope.rotation(torch.arange(n, device=kv.device) * m, max_pos=S)  # [n, r]
        return cast(apply_rope(pooled, (C.expand(B, -1, -1), Sn.expand(B, -1, -1))), dt)


def closed_windows(batch: Batch, m: int, R: int, per: int, trash: int, table: torch.Tensor, overlap: bool,
                   rope: RopeTable) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Rotation] | None:
    """The windows of `m` tokens this dispatch closes (None if none): the flattened ring
    rows [C * k] each one pools (k = 2m with the overlap, whose rows before position 0
    are `missing` [C, k, 1]), the flattened pool rows [C] it is written to (entry w of a
    slot: row `per * table[slot, w // per] + w % per`, `per` entries a block), and the
    rotations [C, r] at each window's first position.

    The closing tokens come from the host rows. A static dispatch has none to read, so
    every token pools its window (C = T) and a token that closes none writes the pool's
    `trash` block, which no query reads."""
    pos, slots = batch.positions, batch.slots
    if batch.static:
        cs, w = slots, pos // m
        dest = torch.where((pos + 1) % m == 0, table[cs, w // per] * per + w % per, trash * per)
    else:
        close = batch.closers(m)
        if not close:
            return None
        close = torch.tensor(close, dtype=torch.long, device=pos.device)
        cs, w = slots[close], pos[close] // m  # [C]
        dest = table[cs, w // per] * per + w % per
    first = w * m
    k = torch.arange(m, device=pos.device)
    p = torch.cat([first[:, None] - m + k, first[:, None] + k], dim=1) if overlap else first[:, None] + k  # [C, k]
    missing = (p < 0).unsqueeze(-1) if overlap else None
    return (cs[:, None] * R + p % R).flatten(), missing, dest, rope.rotation(first, batch.top())


class Indexer(nn.Module):
    """Lightning indexer of CSA layers: scores compressed entries, keeps the top-k."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.head_scale = cfg.index_n_heads ** -0.5  # of all heads: n_heads is divided by T under TP
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg, ratio, self.head_dim, overlap=True)

    def select(self, head_w: torch.Tensor, qr: torch.Tensor, cis: Rotation, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """Score keys [T, E, di] (or [E, di] shared by all rows) -> bias [T, E]: 0 on the
        top-k visible entries, -inf elsewhere. `head_w`: weights_proj of the layer input
        [T, H]; `qr`: the normed query latent; `cis`: the queries' rotations (C, S) [T, r]."""
        T, n_ent = qr.shape[0], visible.shape[-1]
        q = apply_rope(self.wq_b(qr).view(T, self.n_heads, self.head_dim), cis, inplace=True)
        if keys.dim() == 3:  # [T, H, di] x [T, E, di] -> [T, H, E]
            scores = torch.bmm(f32(q), f32(keys).transpose(1, 2))
        else:
            scores = torch.einsum("thd,ed->the", f32(q), f32(keys))
        dev = qr.device
        scores = scores.relu() * constant(self.head_dim ** -0.5, dev)
        w = f32(head_w) * constant(self.head_scale, dev)  # [T, H]
        scores = parallel.all_reduce((scores * w.unsqueeze(-1)).sum(dim=1))  # [T, E], summed over all heads
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(self.topk, n_ent)
        top = scores.topk(k, dim=-1).indices  # [T, k]
        chosen = visible.gather(1, top)
        bias = torch.full((T, n_ent + 1), float("-inf"), device=qr.device)
        bias.scatter_(1, torch.where(chosen, top, n_ent), 0.0)
        return bias[:, :n_ent]
