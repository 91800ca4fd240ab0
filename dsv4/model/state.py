"""Per-request decode state of DeepSeek V4, owned by one object: `ModelState`.

Layout: every tensor is preallocated with a leading *slot* axis (`max_slots`), so
that many requests run in one batched dispatch. Everything is indexed by
**absolute position**, which makes rollback of rejected speculative tokens free:

* window ring (every layer and the MTP block): `win[slot, pos % Rw]`, the normed,
  roped K=V vector. `Rw = max_chunk + window + max_spec`, so a dispatch of up to
  `max_chunk` tokens can write all its rows before reading its keys, and rows
  overwritten by rejected drafts are never ones a later query needs;
* compressor input rings (compressed layers, and the CSA indexer's compressor):
  `raw_kv/raw_score[slot, pos % Rr]`, the projected kv and gate(+ape) of recent
  tokens: they hold the unfinished window and the CSA overlap carry (the `Ca`
  half of the previous window). `Rr = max_chunk + 2 * ratio + max_spec`;
* compressed entries: `entries[slot, w]` for window `w` (and `idx_entries` for
  the indexer keys). Entry w is (re)written whenever the token that closes it,
  position `w * ratio + ratio - 1`, is processed, so a rejected token that closed a
  window leaves nothing behind once the position is written again.

The only host-side bookkeeping is `lengths[slot]` (main model) and
`mtp_lengths[slot]`: how many positions hold committed state. Writes must start
exactly at that length (a skipped position is a bug and raises), and `rollback`
moves the length back.

A `Batch` describes one dispatch: rows `(slot, start, n)` packed one after another
into token tensors [T].
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ..config import CSA, WINDOW, ModelConfig


@dataclass
class Batch:
    """One dispatch: rows of consecutive positions, packed along a token axis T.

    Two kinds: built from host rows (`build`, `whole`), which carry what the model would
    otherwise read back from the device (the highest position, which tokens close a
    compressor window); or `static` (the compiled decode step): tensors only, every row
    short, the state's bookkeeping done by the caller, and shapes that depend on the
    token count alone (masks over the whole entry table, every token pooling its window).
    """

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, absolute
    slots: torch.Tensor  # [T] long
    rows: list[tuple[int, int, int]]  # (slot, start, n) per row, in packing order ([] when static)
    dense: tuple[int, int] | None = None  # (B, S) for stateless whole sequences from position 0
    max_pos: int | None = None  # the highest position (static: the state's last), None: read from positions
    static: bool = False
    memo: dict = field(default_factory=dict, repr=False)  # per-dispatch values shared by all layers

    def cached(self, key, fn):
        """`fn()` computed once per dispatch (RoPE tables, window indices, entry counts)."""
        if key not in self.memo:
            self.memo[key] = fn()
        return self.memo[key]

    def ring_rows(self, size: int) -> torch.Tensor:
        """Each token's row in a ring state flattened to [slots * size, ...]:
        slot * size + position % size [T] (once per dispatch and ring size)."""
        return self.cached(("ring_rows", size), lambda: self.slots * size + self.positions % size)

    def top(self) -> int:
        """The highest position of the dispatch (-1 when empty)."""
        if self.max_pos is None:
            self.max_pos = int(self.positions.max()) if self.positions.numel() else -1
        return self.max_pos

    def closers(self, m: int) -> list[int]:
        """Packed indices of the tokens that close a window of `m` positions ((p + 1) % m == 0),
        from the host rows."""
        out, off = [], 0
        for _, start, n in self.rows:
            first = -(-(start + 1) // m) * m - 1  # the first closing position >= start
            out.extend(range(off + first - start, off + n, m))
            off += n
        return out

    @classmethod
    def whole(cls, input_ids: torch.Tensor) -> "Batch":
        """B whole sequences [B, S] from position 0, for the stateless (dense) path."""
        B, S = input_ids.shape
        dev = input_ids.device
        pos = torch.arange(S, device=dev).repeat(B)
        slots = torch.arange(B, device=dev).repeat_interleave(S)
        return cls(input_ids.reshape(-1), pos, slots, [(b, 0, S) for b in range(B)], (B, S), max_pos=S - 1)

    @classmethod
    def build(cls, rows: list[tuple[int, int, list[int]]], device: torch.device | str = "cpu") -> "Batch":
        """rows: (slot, start position, token ids) -> packed batch."""
        ids, pos, slots = [], [], []
        meta = []
        for slot, start, toks in rows:
            n = len(toks)
            ids.extend(toks)
            pos.extend(range(start, start + n))
            slots.extend([slot] * n)
            meta.append((slot, start, n))
        t = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return cls(t(ids), t(pos), t(slots), meta, max_pos=max(pos, default=-1))

    @classmethod
    def static_step(cls, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    max_len: int) -> "Batch":
        """A compiled decode dispatch: tensors [T] of short rows in a state of `max_len`
        positions (whose bookkeeping, `ModelState.begin`, the caller has done)."""
        return cls(input_ids, positions, slots, [], max_pos=max_len - 1, static=True)


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """A slotted state tensor [slots, n, d] as rows [slots * n, d] (a view), for
    `index_select` / `index_copy_`: one flat index is much cheaper than a (slot, row) pair."""
    return t.view(-1, t.shape[-1])


class LayerState:
    """State tensors of one attention layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, kind: str, ratio: int, slots: int, max_len: int,
                 max_chunk: int, max_spec: int, device, dtype: torch.dtype):
        hd = cfg.head_dim
        self.kind, self.ratio = kind, ratio
        win_size = max_chunk + cfg.sliding_window + max_spec
        self.win = torch.zeros(slots, win_size, hd, device=device, dtype=dtype)
        if kind != WINDOW:
            coff = 2 if kind == CSA else 1
            raw_size = max_chunk + 2 * ratio + max_spec
            n_entries = max_len // ratio + 1
            f32 = torch.float32
            self.raw_kv = torch.zeros(slots, raw_size, coff * hd, device=device, dtype=f32)
            self.raw_score = torch.zeros(slots, raw_size, coff * hd, device=device, dtype=f32)
            self.entries = torch.zeros(slots, n_entries, hd, device=device, dtype=dtype)
            if kind == CSA:
                di = cfg.index_head_dim
                self.idx_raw_kv = torch.zeros(slots, raw_size, 2 * di, device=device, dtype=f32)
                self.idx_raw_score = torch.zeros(slots, raw_size, 2 * di, device=device, dtype=f32)
                self.idx_entries = torch.zeros(slots, n_entries, di, device=device, dtype=dtype)

    NAMES = ("win", "raw_kv", "raw_score", "entries", "idx_raw_kv", "idx_raw_score", "idx_entries")

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self.NAMES if hasattr(self, n)]

    def rebound(self, tensors: list[torch.Tensor]) -> "LayerState":
        """A shallow copy whose state tensors are `tensors` (in `tensors()` order), e.g. the
        inputs of an exported step."""
        out = copy.copy(self)
        for name, t in zip([n for n in self.NAMES if hasattr(self, n)], tensors, strict=True):
            setattr(out, name, t)
        return out


class ModelState:
    """All per-request state of the main model and the MTP block, in slots."""

    def __init__(self, cfg: ModelConfig, max_slots: int, max_len: int, *, max_chunk: int = 128,
                 max_spec: int = 4, with_mtp: bool = True, device="cpu", dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.max_slots, self.max_len, self.max_chunk = max_slots, max_len, max_chunk
        args = (max_slots, max_len, max_chunk, max_spec, device, dtype)
        self.layers = [LayerState(cfg, k, r, *args) for k, r in zip(cfg.layer_kinds, cfg.compress_ratios)]
        self.mtp = LayerState(cfg, WINDOW, 0, *args) if with_mtp else None
        self.lengths = [0] * max_slots
        self.mtp_lengths = [0] * max_slots

    # -------------------------------------------------------------- bookkeeping
    def begin(self, batch: Batch, mtp: bool = False) -> None:
        """Check that every row continues its slot exactly, then advance the lengths."""
        lengths = self.mtp_lengths if mtp else self.lengths
        seen = set()
        for slot, start, n in batch.rows:
            if slot in seen:
                raise ValueError(f"slot {slot} appears twice in one dispatch")
            seen.add(slot)
            if not 0 <= slot < self.max_slots:
                raise ValueError(f"slot {slot} out of range 0..{self.max_slots - 1}")
            if start != lengths[slot]:
                what = "MTP" if mtp else "model"
                raise ValueError(f"{what} state of slot {slot} holds {lengths[slot]} positions, "
                                 f"but the dispatch writes from position {start}")
            if start + n > self.max_len:
                raise ValueError(f"slot {slot}: position {start + n - 1} beyond max_len {self.max_len}")
            if n > self.max_chunk:
                raise ValueError(f"slot {slot}: {n} tokens in one dispatch exceed max_chunk {self.max_chunk}")
        for slot, start, n in batch.rows:
            lengths[slot] = start + n

    def rollback(self, slot: int, length: int, mtp_length: int | None = None) -> None:
        """Forget positions >= length (and >= mtp_length in the MTP cache)."""
        if length > self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} forward from {self.lengths[slot]} to {length}")
        self.lengths[slot] = length
        if mtp_length is not None:
            if mtp_length > self.mtp_lengths[slot]:
                raise ValueError(f"cannot roll MTP of slot {slot} forward to {mtp_length}")
            self.mtp_lengths[slot] = mtp_length

    def skip_mtp(self, slot: int, length: int) -> None:
        """Move the MTP cache of `slot` forward to `length` without writing the positions in
        between. Valid because the MTP block is window-only: a caller that then writes at
        least `sliding_window` positions before reading (the runner's catch-up) never reads
        a skipped one for a draft."""
        if self.mtp is None or self.mtp.kind != WINDOW:
            raise ValueError("skip_mtp needs a window-only MTP block")
        if length < self.mtp_lengths[slot]:
            raise ValueError(f"cannot skip the MTP of slot {slot} back to {length}; use rollback")
        self.mtp_lengths[slot] = length

    def free(self, slot: int) -> None:
        """Release a slot: its contents become garbage that the next owner overwrites."""
        self.lengths[slot] = 0
        self.mtp_lengths[slot] = 0

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor: the layers' in order, then the MTP block's."""
        return [t for ls in self.layers + ([self.mtp] if self.mtp is not None else []) for t in ls.tensors()]

    def rebound(self, tensors: list[torch.Tensor]) -> "ModelState":
        """A shallow copy (bookkeeping shared) whose state tensors are `tensors` (in
        `tensors()` order): what an exported step binds its tensor inputs to."""
        out, it = copy.copy(self), iter(tensors)
        take = lambda ls: ls.rebound([next(it) for _ in ls.tensors()])  # noqa: E731
        out.layers = [take(ls) for ls in self.layers]
        out.mtp = take(self.mtp) if self.mtp is not None else None
        if next(it, None) is not None:
            raise ValueError("more tensors than the state holds")
        return out

    def nbytes_per_slot(self) -> int:
        ts = [t for ls in self.layers for t in ls.tensors()]
        if self.mtp is not None:
            ts += self.mtp.tensors()
        return sum(t[0].numel() * t.element_size() for t in ts)

    # -------------------------------------------------------------- inspection
    def snapshot(self, slot: int) -> dict[str, torch.Tensor]:
        """The logical state of a slot (what the next dispatch can read), for tests.

        Window rows of the last `window - 1` positions, every emitted entry, and the
        compressor rows of the unfinished window plus the overlap carry.
        """
        out: dict[str, torch.Tensor] = {}
        cfg = self.cfg

        def ring(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            idx = torch.arange(max(lo, 0), hi) % t.shape[1]
            return t[slot, idx.to(t.device)]

        for i, ls in enumerate(self.layers + ([self.mtp] if self.mtp is not None else [])):
            mtp = i == len(self.layers)
            n = self.mtp_lengths[slot] if mtp else self.lengths[slot]
            p = "mtp" if mtp else f"layers.{i}"
            out[f"{p}.win"] = ring(ls.win, n - cfg.sliding_window + 1, n)
            if ls.kind != WINDOW:
                m = ls.ratio
                lo = (n // m) * m - (m if ls.kind == CSA else 0)
                out[f"{p}.entries"] = ls.entries[slot, : n // m]
                out[f"{p}.raw_kv"] = ring(ls.raw_kv, lo, n)
                out[f"{p}.raw_score"] = ring(ls.raw_score, lo, n)
                if ls.kind == CSA:
                    out[f"{p}.idx_entries"] = ls.idx_entries[slot, : n // m]
                    out[f"{p}.idx_raw_kv"] = ring(ls.idx_raw_kv, lo, n)
                    out[f"{p}.idx_raw_score"] = ring(ls.idx_raw_score, lo, n)
        return out
