"""DeepSeek V4 attention: sliding window, CSA (compressor + lightning indexer), HCA.

All functions work on packed token rows (`Batch`): x [T, D] with per-token
absolute positions and state slots. Each dispatch first writes its rows into the
layer's state (window ring, compressor input rings, closed compressed entries),
then every query gathers what it may see:

* the window: positions `pos-W+1 .. pos` of its own slot (W = sliding_window);
* HCA: every compressed entry `w < (pos+1) // ratio`;
* CSA: the indexer's top-k among those entries.

Attention has one shared K=V head, a per-head sink in the softmax denominator,
inverse RoPE on the output and a grouped low-rank output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CSA, WINDOW, ModelConfig
from .layers import RMSNorm, RopeTable, apply_rope, cast, f32, rms_unweighted
from .state import Batch, LayerState


def rope_at(rope: RopeTable, pos: torch.Tensor, batch: Batch | None) -> torch.Tensor:
    """Rotations [T, r/2] at the batch's positions, computed once per dispatch and table."""
    if batch is None:
        return rope.rotation(pos)
    return batch.cached(("rope", id(rope)), lambda: rope.rotation(pos))


def window_index(pos: torch.Tensor, W: int, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring slots of positions pos-W+1..pos [T, W] and their bias (-inf before position 0)."""
    kpos = pos[:, None] - torch.arange(W - 1, -1, -1, device=pos.device)
    bias = torch.zeros(kpos.shape, device=pos.device).masked_fill(kpos < 0, float("-inf"))
    return kpos % ring, bias


ROW_MIN = 8  # rows with at least this many tokens attend against keys shared by the row


def split_rows(batch: Batch) -> tuple[list[tuple[int, int, int, int]], torch.Tensor | None]:
    """Long rows (slot, start, n, packed offset) and the packed indices of the other tokens
    (None when there are none)."""
    long_rows, short, off = [], [], 0
    for slot, start, n in batch.rows:
        if n >= ROW_MIN:
            long_rows.append((slot, start, n, off))
        else:
            short.extend(range(off, off + n))
        off += n
    idx = torch.tensor(short, dtype=torch.long, device=batch.positions.device) if short else None
    return long_rows, idx


def entry_limit(pos: torch.Tensor, ratio: int) -> tuple[torch.Tensor, int]:
    """Entries visible to each query [T] (w < (pos+1) // ratio), and their maximum."""
    limit = (pos + 1) // ratio
    return limit, int(limit.max())


class Linear(nn.Module):
    """Bias-free linear whose parameter is named `weight`, as in the checkpoint."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


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

    def forward(self, x: torch.Tensor, batch: Batch, raw_kv: torch.Tensor, raw_score: torch.Tensor,
                entries: torch.Tensor, rope: RopeTable) -> None:
        """Write this dispatch's rows, then (re)compute every entry a row closes."""
        m, d = self.ratio, self.dim
        pos, slots = batch.positions, batch.slots
        kv = f32(self.wkv(x))  # [T, coff*d]
        score = f32(self.wgate(x)) + f32(self.ape)[pos % m]
        R = raw_kv.shape[1]
        raw_kv[slots, pos % R] = kv
        raw_score[slots, pos % R] = score
        close = batch.cached(("close", m), lambda: ((pos + 1) % m == 0).nonzero().squeeze(-1))
        if close.numel() == 0:
            return
        cs, w = slots[close], pos[close] // m  # [C]
        first = w * m
        if self.overlap:
            # slots: the previous window's Ca half, then this window's Cb half
            p = torch.cat([first[:, None] - m + torch.arange(m, device=x.device),
                           first[:, None] + torch.arange(m, device=x.device)], dim=1)  # [C, 2m]
            g_kv = raw_kv[cs[:, None], p % R]  # [C, 2m, 2d]
            g_sc = raw_score[cs[:, None], p % R]
            sel_kv = torch.cat([g_kv[:, :m, :d], g_kv[:, m:, d:]], dim=1)  # [C, 2m, d]
            sel_sc = torch.cat([g_sc[:, :m, :d], g_sc[:, m:, d:]], dim=1)
            missing = (p < 0).unsqueeze(-1)  # window -1 does not exist
            sel_kv = sel_kv.masked_fill(missing, 0.0)
            sel_sc = sel_sc.masked_fill(missing, float("-inf"))
        else:
            p = first[:, None] + torch.arange(m, device=x.device)  # [C, m]
            sel_kv = raw_kv[cs[:, None], p % R]
            sel_sc = raw_score[cs[:, None], p % R]
        pooled = (sel_kv * sel_sc.softmax(dim=1)).sum(dim=1)  # [C, d]
        pooled = self.norm(pooled)
        entries[cs, w] = cast(apply_rope(pooled, rope.rotation(first)), entries.dtype)


    def pool_dense(self, x: torch.Tensor, B: int, S: int, rope: RopeTable) -> torch.Tensor:
        """Stateless: every complete window of B sequences of S tokens -> entries [B, S//m, d]."""
        m, d = self.ratio, self.dim
        n = S // m
        pos = torch.arange(S, device=x.device)
        kv = self.wkv(x).float().view(B, S, -1)
        score = self.wgate(x).float().view(B, S, -1) + self.ape.float()[pos % m]
        kv, score = kv[:, : n * m].view(B, n, m, -1), score[:, : n * m].view(B, n, m, -1)
        if self.overlap:
            prev_kv = torch.cat([torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]], dim=1)
            prev_sc = torch.cat([torch.full_like(score[:, :1, :, :d], float("-inf")), score[:, :-1, :, :d]], dim=1)
            kv = torch.cat([prev_kv, kv[..., d:]], dim=2)  # [B, n, 2m, d]
            score = torch.cat([prev_sc, score[..., d:]], dim=2)
        pooled = self.norm((kv * score.softmax(dim=2)).sum(dim=2))  # [B, n, d]
        cis = rope.rotation(torch.arange(n, device=x.device) * m, max_pos=S)  # [n, r/2]
        return cast(apply_rope(pooled, cis.expand(B, -1, -1)), x.dtype)


class Indexer(nn.Module):
    """Lightning indexer of CSA layers: scores compressed entries, keeps the top-k."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg, ratio, self.head_dim, overlap=True)

    def select(self, x: torch.Tensor, qr: torch.Tensor, cis: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """Score keys [T, E, di] (or [E, di] shared by all rows) -> bias [T, E]: 0 on the
        top-k visible entries, -inf elsewhere. `cis`: the queries' rotations [T, r/2]."""
        T, n_ent = x.shape[0], visible.shape[-1]
        q = apply_rope(self.wq_b(qr).view(T, self.n_heads, self.head_dim), cis)
        if keys.dim() == 3:  # [T, H, di] x [T, E, di] -> [T, H, E]
            scores = torch.bmm(f32(q), f32(keys).transpose(1, 2))
        else:
            scores = torch.einsum("thd,ed->the", f32(q), f32(keys))
        scores = scores.relu() * self.head_dim ** -0.5
        w = f32(self.weights_proj(x)) * self.n_heads ** -0.5  # [T, H]
        scores = (scores * w.unsqueeze(-1)).sum(dim=1)  # [T, E]
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(self.topk, n_ent)
        top = scores.topk(k, dim=-1).indices  # [T, k]
        chosen = visible.gather(1, top)
        bias = torch.full((T, n_ent + 1), float("-inf"), device=x.device)
        bias.scatter_(1, torch.where(chosen, top, n_ent), 0.0)
        return bias[:, :n_ent]


class Attention(nn.Module):
    """Attention of one layer (kind window / csa / hca), reading and writing `LayerState`."""

    def __init__(self, cfg: ModelConfig, kind: str, ratio: int):
        super().__init__()
        self.cfg, self.kind, self.ratio = cfg, kind, ratio
        H, hd = cfg.num_attention_heads, cfg.head_dim
        self.n_heads, self.head_dim = H, hd
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * hd)
        self.wkv = Linear(cfg.hidden_size, hd)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = Linear(H * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        if kind != WINDOW:
            self.compressor = Compressor(cfg, ratio, hd, overlap=kind == CSA)
        if kind == CSA:
            self.indexer = Indexer(cfg, ratio)

    def forward(self, x: torch.Tensor, batch: Batch, ls: LayerState | None, rope: RopeTable) -> torch.Tensor:
        """x: [T, D] normed sub-layer input -> [T, D]. Without state (`ls` None) the
        batch must be dense: B whole sequences from position 0."""
        cfg = self.cfg
        T, H, hd = x.shape[0], self.n_heads, self.head_dim
        pos, slots = batch.positions, batch.slots
        cis = rope_at(rope, pos, batch)

        qr = self.q_norm(self.wq_a(x))  # [T, q_lora]
        q = rms_unweighted(self.wq_b(qr).view(T, H, hd), cfg.rms_norm_eps)
        q = apply_rope(q, cis)  # [T, H, hd]
        kv = apply_rope(self.kv_norm(self.wkv(x)), cis)  # [T, hd]
        if ls is None:
            return self._out(self._dense(x, qr, q, kv, batch, rope), cis)

        # writes first: window ring, compressor rows and closed entries (and the indexer's)
        ls.win[slots, pos % ls.win.shape[1]] = cast(kv, ls.win.dtype)
        if self.kind != WINDOW:
            self.compressor(x, batch, ls.raw_kv, ls.raw_score, ls.entries, rope)
        if self.kind == CSA:
            self.indexer.compressor(x, batch, ls.idx_raw_kv, ls.idx_raw_score, ls.idx_entries, rope)
        # then reads: long rows (prefill chunks) against keys shared by the row, short rows
        # (decode, verify) each gathering its own keys
        long_rows, short = batch.cached("split", lambda: split_rows(batch))
        if not long_rows:
            return self._out(self._attend_packed(x, qr, q, cis, pos, slots, ls, batch, ""), cis)
        o = torch.empty_like(q)
        for slot, start, n, off in long_rows:
            sl = slice(off, off + n)
            o[sl] = self._attend_row(x[sl], qr[sl], q[sl], cis[sl], slot, start, n, ls)
        if short is not None:
            o[short] = self._attend_packed(x[short], qr[short], q[short], cis[short], pos[short], slots[short],
                                           ls, batch, "short")
        return self._out(o, cis)

    def _attend_row(self, x, qr, q, cis, slot: int, start: int, n: int, ls: LayerState) -> torch.Tensor:
        """One row's n queries (positions start..start+n-1) -> o [n, H, hd], one matmul per step."""
        W, dev = self.cfg.sliding_window, x.device
        p0 = max(0, start - W + 1)
        kpos = torch.arange(p0, start + n, device=dev)  # [L]
        keys = ls.win[slot, kpos % ls.win.shape[1]]  # [L, hd]
        qpos = torch.arange(start, start + n, device=dev)
        far = (kpos[None, :] > qpos[:, None]) | (kpos[None, :] <= qpos[:, None] - W)
        bias = torch.zeros(n, kpos.shape[0], device=dev).masked_fill(far, float("-inf"))  # [n, L]
        if self.kind != WINDOW and (start + n) // self.ratio > 0:
            n_ent = (start + n) // self.ratio
            visible = torch.arange(n_ent, device=dev)[None, :] < ((qpos + 1) // self.ratio)[:, None]
            if self.kind == CSA:
                cbias = self.indexer.select(x, qr, cis, ls.idx_entries[slot, :n_ent], visible)
            else:
                cbias = torch.zeros(n, n_ent, device=dev).masked_fill(~visible, float("-inf"))
            keys = torch.cat([keys, ls.entries[slot, :n_ent]])  # [L+E, hd]
            bias = torch.cat([bias, cbias], dim=1)
        H, hd = self.n_heads, self.head_dim
        scores = f32(q.reshape(n * H, hd) @ cast(keys, q.dtype).t()).view(n, H, -1) * hd ** -0.5
        probs = self._softmax_with_sink(scores + bias.unsqueeze(1))
        return cast((cast(probs, keys.dtype).view(n * H, -1) @ keys).view(n, H, hd), x.dtype)

    def _attend_packed(self, x, qr, q, cis, pos, slots, ls: LayerState, batch: Batch, tag: str) -> torch.Tensor:
        """Queries [T] of different rows, each gathering its own window and entries -> o [T, H, hd]."""
        T, hd, W = x.shape[0], self.head_dim, self.cfg.sliding_window
        Rw = ls.win.shape[1]
        ring_idx, bias = batch.cached((tag, "window", Rw, W), lambda: window_index(pos, W, Rw))
        keys = ls.win[slots[:, None], ring_idx]  # [T, W, hd]
        if self.kind != WINDOW:
            limit, n_ent = batch.cached((tag, "limit", self.ratio), lambda: entry_limit(pos, self.ratio))
            if n_ent > 0:
                visible = torch.arange(n_ent, device=x.device)[None, :] < limit[:, None]  # [T, E]
                if self.kind == CSA:
                    cbias = self.indexer.select(x, qr, cis, ls.idx_entries[slots, :n_ent], visible)
                else:
                    cbias = torch.zeros(T, n_ent, device=x.device).masked_fill(~visible, float("-inf"))
                keys = torch.cat([keys, ls.entries[slots, :n_ent]], dim=1)  # [T, W+E, hd]
                bias = torch.cat([bias, cbias], dim=1)
        scores = f32(torch.bmm(q, cast(keys, q.dtype).transpose(1, 2))) * hd ** -0.5  # [T, H, K]
        probs = self._softmax_with_sink(scores + bias.unsqueeze(1))
        return cast(torch.bmm(cast(probs, keys.dtype), keys), x.dtype)  # [T, H, hd]

    def _softmax_with_sink(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [T, H, k] or [B, H, S, k] -> probabilities over k (the sink takes its share)."""
        shape = [1] * scores.dim()
        shape[1] = self.n_heads
        sink = f32(self.attn_sink).view(shape).expand(*scores.shape[:-1], 1)
        return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]

    def _dense(self, x, qr, q, kv, batch: Batch, rope: RopeTable) -> torch.Tensor:
        """Stateless attention over B whole sequences of S tokens -> o [T, H, hd]."""
        B, S = batch.dense
        T, H, hd, W = x.shape[0], self.n_heads, self.head_dim, self.cfg.sliding_window
        i = torch.arange(S, device=x.device)
        keys = kv.view(B, S, hd)
        bias = torch.zeros(S, S, device=x.device)
        bias = bias.masked_fill((i[None, :] > i[:, None]) | (i[None, :] <= i[:, None] - W), float("-inf"))
        bias = bias.expand(B, S, S)
        if self.kind != WINDOW and S >= self.ratio:
            entries = self.compressor.pool_dense(x, B, S, rope)  # [B, n, hd]
            n = entries.shape[1]
            visible = torch.arange(n, device=x.device)[None, :] < ((i + 1) // self.ratio)[:, None]  # [S, n]
            if self.kind == CSA:
                ikeys = self.indexer.compressor.pool_dense(x, B, S, rope)  # [B, n, di]
                icis = rope.rotation(i)
                cb = torch.cat([self.indexer.select(x.view(B, S, -1)[b], qr.view(B, S, -1)[b], icis, ikeys[b],
                                                    visible) for b in range(B)])
                cbias = cb.view(B, S, n)
            else:
                cbias = torch.zeros(S, n, device=x.device).masked_fill(~visible, float("-inf")).expand(B, S, n)
            keys = torch.cat([keys, entries], dim=1)  # [B, S+n, hd]
            bias = torch.cat([bias, cbias], dim=2)
        qb = q.view(B, S, H, hd)
        scores = torch.einsum("bshd,bkd->bhsk", qb, keys.to(q.dtype)).float() * hd ** -0.5
        probs = self._softmax_with_sink(scores + bias.unsqueeze(1))  # [B, H, S, S+n]
        o = torch.einsum("bhsk,bkd->bshd", probs.to(keys.dtype), keys)
        return o.reshape(T, H, hd).to(x.dtype)

    def _out(self, o: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE and the grouped low-rank output projection: [T, H, hd] -> [T, D]."""
        cfg = self.cfg
        T = o.shape[0]
        o = apply_rope(o, cis, inverse=True)
        G = cfg.o_groups
        wo_a = self.wo_a.weight.view(G, cfg.o_lora_rank, -1)  # [G, O, H*hd/G]
        o = torch.bmm(o.reshape(T, G, -1).transpose(0, 1), wo_a.transpose(1, 2)).transpose(0, 1)  # [T, G, O]
        return self.wo_b(o.flatten(1))
