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
from torch import nn

from ..config import CSA, WINDOW, ModelConfig
from . import int8pack, parallel
from .compressor import Compressor, Indexer
from .fusion import FusedLinear, Source, project, sourced_rows
from .layers import (Linear, RMSNorm, RopeTable, apply_rope, cast, constant, f32, inverse_rotation, rms_unweighted,
                     rot_rows)
from .state import Batch, LayerState, flat_rows


def window_index(pos: torch.Tensor, slots: torch.Tensor, W: int, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each query's window keys live: rows [T * W] of the flattened ring (`flat_rows`)
    holding positions pos-W+1..pos, and their bias [T, W] (-inf before position 0)."""
    kpos = pos[:, None] - torch.arange(W - 1, -1, -1, device=pos.device)
    bias = torch.zeros(kpos.shape, device=pos.device).masked_fill(kpos < 0, float("-inf"))
    return (slots[:, None] * ring + kpos % ring).flatten(), bias


def entry_bias(pos: torch.Tensor, ratio: int, window_bias: torch.Tensor, max_pos: int
               ) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """Compressed entries visible to each query (w < (pos+1) // ratio): their count E (for
    the highest position `max_pos`: the dispatch's, or the state's last in a static one),
    the mask [T, E], and the window bias followed by 0 / -inf over them [T, W+E] (all of a
    query's bias in HCA layers, and in CSA layers while E <= top-k)."""
    limit = (pos + 1) // ratio
    n = (max_pos + 1) // ratio
    if n == 0:
        return 0, None, None
    visible = torch.arange(n, device=pos.device)[None, :] < limit[:, None]  # [T, E]
    ebias = torch.zeros(visible.shape, device=pos.device).masked_fill(~visible, float("-inf"))
    return n, visible, torch.cat([window_bias, ebias], dim=1)


ROW_MIN = 8  # rows with at least this many tokens attend against keys shared by the row
ROW_SPAN = 64  # a long row's queries attend in spans of this many (each against its own keys)
SPAN_MIN = 2048  # short rows attend in groups by context: ends up to this, then each power of two above


def split_rows(batch: Batch) -> tuple[list[tuple[int, int, int, int]], list[tuple[torch.Tensor | None, int]]]:
    """Long rows (slot, start, n, packed offset), and the other tokens in groups (packed
    indices, the group's highest position): rows whose context ends within the same power of
    two (at least SPAN_MIN), so that a short row beside a long context does not pay for its
    entries. None as indices: the group is every token (always, in a static dispatch)."""
    if batch.static:
        return [], [(None, batch.top())]
    long_rows, groups, off = [], {}, 0
    for slot, start, n in batch.rows:
        if n >= ROW_MIN:
            long_rows.append((slot, start, n, off))
        else:
            g = groups.setdefault(max(SPAN_MIN, 1 << (start + n - 1).bit_length()), [[], -1])  # [indices, top]
            g[0].extend(range(off, off + n))
            g[1] = max(g[1], start + n - 1)
        off += n
    if not long_rows and len(groups) == 1:
        return [], [(None, batch.top())]
    dev = batch.positions.device
    return long_rows, [(torch.tensor(idx, dtype=torch.long, device=dev), top) for idx, top in groups.values()]


class Attention(nn.Module):
    """Attention of one layer (kind window / csa / hca), reading and writing `LayerState`."""

    def __init__(self, cfg: ModelConfig, kind: str, ratio: int):
        super().__init__()
        self.cfg, self.kind, self.ratio = cfg, kind, ratio
        H, hd = cfg.num_attention_heads, cfg.head_dim
        self.n_heads, self.head_dim = H, hd
        self.n_groups = cfg.o_groups  # both divided by T under tensor parallelism
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
        self.fused: FusedLinear | None = None

    def fuse(self, copy: bool = True, source: Source | None = None, prefix: str = "") -> None:
        """Inference: one matmul for every projection of the layer input (see `FusedLinear`;
        `copy` False: the linears hold nothing yet, their values are not copied; `source`:
        where the fused storage may come from, this module being named `prefix`)."""
        mods = self._x_linears()
        self.fused = FusedLinear(mods, sourced_rows(source, self, prefix, mods), copy=copy)

    def pack_int8(self, min_bytes: int) -> int:
        """`int8pack.pack_model`: the fused projections of x, and `wo_a` with one packed weight
        per output group (visited before its children, which then find themselves packed)."""
        n = self.wo_a.pack_int8(min_bytes, groups=self.n_groups) if hasattr(self.wo_a, "pack_int8") else 0
        return n + (int8pack.pack_fused(self.fused, self._x_linears(), min_bytes) if self.fused is not None else 0)

    def _x_linears(self) -> list[Linear]:
        """The linears that read the layer input x, in the order `forward` unpacks them."""
        mods = [self.wq_a, self.wkv]
        if self.kind != WINDOW:
            mods += [self.compressor.wkv, self.compressor.wgate]
        if self.kind == CSA:
            c = self.indexer.compressor
            mods += [self.indexer.weights_proj, c.wkv, c.wgate]
        return mods

    def forward(self, x: torch.Tensor, batch: Batch, ls: LayerState | None, rope: RopeTable) -> torch.Tensor:
        """x: [T, D] normed sub-layer input -> [T, D]. Without state (`ls` None) the
        batch must be dense: B whole sequences from position 0."""
        cfg = self.cfg
        T, H, hd = x.shape[0], self.n_heads, self.head_dim
        pos, slots = batch.positions, batch.slots
        cis = batch.cached(rope.key, lambda: rope.rotation(pos, batch.top()))  # (C, S) [T, r], once per dispatch
        qa, kv, *xp = project(x, self.fused, self._x_linears())  # xp: compressor, then indexer inputs

        qr = self.q_norm(qa)  # [T, q_lora]
        q = rms_unweighted(self.wq_b(qr).view(T, H, hd), cfg.rms_norm_eps)
        q = apply_rope(q, cis, inplace=True)  # [T, H, hd]
        kv = apply_rope(self.kv_norm(kv), cis, inplace=True)  # [T, hd]
        head_w = xp[2] if self.kind == CSA else None  # the indexer's per-head weights [T, Hi]
        if ls is None:
            return self._out(self._dense(x, qr, q, kv, xp, cis, batch, rope), cis, batch, rope)

        # writes first: window ring, compressor rows and closed entries (and the indexer's)
        flat_rows(ls.win).index_copy_(0, batch.ring_rows(ls.win.shape[1]), cast(kv, ls.win.dtype))
        if self.kind != WINDOW:
            self.compressor(xp[0], xp[1], batch, ls.raw_kv, ls.raw_score, ls.entries, ls.table, rope)
        if self.kind == CSA:
            self.indexer.compressor(xp[3], xp[4], batch, ls.idx_raw_kv, ls.idx_raw_score, ls.idx_entries, ls.table,
                                    rope)
        # then reads: long rows (prefill chunks) against keys shared by the row, short rows
        # (decode, verify) each gathering its own keys
        long_rows, groups = batch.cached("split", lambda: split_rows(batch))
        if not long_rows and groups[0][0] is None:  # every token in one packed group
            o = self._attend_packed(head_w, qr, q, cis, pos, slots, ls, batch, "", groups[0][1])
            return self._out(o, cis, batch, rope)
        o = torch.empty_like(q)
        for slot, start, n, off in long_rows:
            sl = slice(off, off + n)
            hw = head_w[sl] if head_w is not None else None
            o[sl] = self._attend_row(hw, qr[sl], q[sl], rot_rows(cis, sl), slot, start, n, ls)
        for g, (idx, top) in enumerate(groups):
            hw = head_w[idx] if head_w is not None else None
            o[idx] = self._attend_packed(hw, qr[idx], q[idx], rot_rows(cis, idx), pos[idx], slots[idx], ls, batch,
                                         f"short{g}", top)
        return self._out(o, cis, batch, rope)

    def _attend_row(self, head_w, qr, q, cis, slot: int, start: int, n: int, ls: LayerState) -> torch.Tensor:
        """One row's n queries (positions start..start+n-1) -> o [n, H, hd], in spans of
        ROW_SPAN queries: a span reads only the keys its queries may see (its window and the
        entries closed by its end), where one matmul over the whole row would score every
        query against all n + W - 1 window keys."""
        gathered: dict[bool, torch.Tensor] = {}
        n_row = (start + n) // self.ratio if self.kind != WINDOW else 0

        def entries(m: int, idx: bool = False) -> torch.Tensor:
            """The row's first m entries (`idx`: indexer keys), gathered once for all its spans."""
            if idx not in gathered:
                gathered[idx] = ls.entries_of(slot, n_row, idx=idx)
            return gathered[idx][:m]

        if n <= ROW_SPAN:
            return self._attend_span(head_w, qr, q, cis, slot, start, n, ls, entries)
        o = torch.empty_like(q)
        for a in range(0, n, ROW_SPAN):
            sl = slice(a, min(n, a + ROW_SPAN))
            hw = head_w[sl] if head_w is not None else None
            o[sl] = self._attend_span(hw, qr[sl], q[sl], rot_rows(cis, sl), slot, start + a, sl.stop - a, ls, entries)
        return o

    def _attend_span(self, head_w, qr, q, cis, slot: int, start: int, n: int, ls: LayerState,
                     entries) -> torch.Tensor:
        """n queries of one row (positions start..start+n-1) -> o [n, H, hd], one matmul per step;
        `entries(m, idx)`: the row's first m compressed entries (or indexer keys)."""
        W, dev = self.cfg.sliding_window, q.device
        p0 = max(0, start - W + 1)
        kpos = torch.arange(p0, start + n, device=dev)  # [L]
        keys = ls.win[slot, kpos % ls.win.shape[1]]  # [L, hd]
        qpos = torch.arange(start, start + n, device=dev)
        far = (kpos[None, :] > qpos[:, None]) | (kpos[None, :] <= qpos[:, None] - W)
        bias = torch.zeros(n, kpos.shape[0], device=dev).masked_fill(far, float("-inf"))  # [n, L]
        if self.kind != WINDOW and (start + n) // self.ratio > 0:
            n_ent = (start + n) // self.ratio
            visible = torch.arange(n_ent, device=dev)[None, :] < ((qpos + 1) // self.ratio)[:, None]
            if self.kind == CSA and n_ent > self.indexer.topk:
                cbias = self.indexer.select(head_w, qr, cis, entries(n_ent, idx=True), visible)
            else:  # HCA, or CSA while the top-k keeps every visible entry
                cbias = torch.zeros(n, n_ent, device=dev).masked_fill(~visible, float("-inf"))
            keys = torch.cat([keys, entries(n_ent)])  # [L+E, hd]
            bias = torch.cat([bias, cbias], dim=1)
        H, hd = self.n_heads, self.head_dim
        scores = f32(q.reshape(n * H, hd) @ cast(keys, q.dtype).t()).view(n, H, -1) * hd ** -0.5
        probs = self._softmax_with_sink(scores + bias.unsqueeze(1))
        return cast((cast(probs, keys.dtype).view(n * H, -1) @ keys).view(n, H, hd), q.dtype)

    def _attend_packed(self, head_w, qr, q, cis, pos, slots, ls: LayerState, batch: Batch, tag: str,
                       top: int) -> torch.Tensor:
        """Queries [T] of different rows (the highest at position `top`), each gathering its own
        window and entries -> o [T, H, hd]."""
        T, hd, W, Rw = q.shape[0], self.head_dim, self.cfg.sliding_window, ls.win.shape[1]
        rows, bias = batch.cached((tag, "window", Rw, W), lambda: window_index(pos, slots, W, Rw))
        keys = flat_rows(ls.win).index_select(0, rows).view(T, W, hd)  # [T, W, hd]
        if self.kind != WINDOW:  # masks shared by every layer of this ratio in the dispatch
            n_ent, visible, full_bias = batch.cached((tag, "entries", self.ratio),
                                                     lambda: entry_bias(pos, self.ratio, bias, top))
            if n_ent > 0:
                if self.kind == CSA and n_ent > self.indexer.topk:
                    ikeys = ls.entries_of(slots, n_ent, idx=True)  # [T, E, di]
                    cbias = self.indexer.select(head_w, qr, cis, ikeys, visible)
                    bias = torch.cat([bias, cbias], dim=1)
                else:  # HCA, or CSA while the top-k keeps every visible entry
                    bias = full_bias
                keys = torch.cat([keys, ls.entries_of(slots, n_ent)], dim=1)  # [T, W+E, hd]
        scores = f32(torch.bmm(q, cast(keys, q.dtype).transpose(1, 2))) * constant(hd ** -0.5, q.device)  # [T, H, K]
        probs = self._softmax_with_sink(scores + bias.unsqueeze(1))
        return cast(torch.bmm(cast(probs, keys.dtype), keys), q.dtype)  # [T, H, hd]

    def _softmax_with_sink(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [T, H, k] or [B, H, S, k] -> probabilities over k (the sink takes its share)."""
        shape = [1] * scores.dim()
        shape[1] = self.n_heads
        sink = f32(self.attn_sink).view(shape).expand(*scores.shape[:-1], 1)
        return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]

    def _dense(self, x, qr, q, kv, xp, cis, batch: Batch, rope: RopeTable) -> torch.Tensor:
        """Stateless attention over B whole sequences of S tokens -> o [T, H, hd]."""
        B, S = batch.dense
        T, H, hd, W = x.shape[0], self.n_heads, self.head_dim, self.cfg.sliding_window
        i = torch.arange(S, device=x.device)
        keys = kv.view(B, S, hd)
        bias = torch.zeros(S, S, device=x.device)
        bias = bias.masked_fill((i[None, :] > i[:, None]) | (i[None, :] <= i[:, None] - W), float("-inf"))
        bias = bias.expand(B, S, S)
        if self.kind != WINDOW and S >= self.ratio:
            entries = self.compressor.pool_dense(xp[0], xp[1], B, S, rope)  # [B, n, hd]
            n = entries.shape[1]
            visible = torch.arange(n, device=x.device)[None, :] < ((i + 1) // self.ratio)[:, None]  # [S, n]
            if self.kind == CSA:
                ikeys = self.indexer.compressor.pool_dense(xp[3], xp[4], B, S, rope)  # [B, n, di]
                cb = torch.cat([self.indexer.select(xp[2].view(B, S, -1)[b], qr.view(B, S, -1)[b], rot_rows(cis, slice(0, S)), ikeys[b],
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

    def _out(self, o: torch.Tensor, cis: torch.Tensor, batch: Batch, rope: RopeTable) -> torch.Tensor:
        """Inverse RoPE and the grouped low-rank output projection: [T, H, hd] -> [T, D]."""
        T = o.shape[0]
        inv = batch.cached(("inverse", rope.key), lambda: inverse_rotation(cis))  # once per dispatch and table
        o = apply_rope(o, inv, inplace=True)
        o = self.wo_a.grouped(o.reshape(T, self.n_groups, -1))  # [T, G, O]
        return parallel.all_reduce(self.wo_b(o.flatten(1)))  # row-parallel: each rank holds G/T groups
