"""Per-request decode state of DeepSeek V4, owned by one object: `ModelState`.

* **What slides** (window rows, compressor input rings) lives in small per-slot rings
  indexed by absolute position modulo the ring size, so rollback of rejected speculative
  tokens is free (`Rw = max_chunk + window + max_spec`, `Rr = max_chunk + 2 * ratio + max_spec`).
* **What only grows** (compressed entries, CSA indexer keys) lives in blocks of `block_size`
  positions from a pool shared by every slot, named by per-slot block tables (sharable by
  requests with one prefix). Entry w is rewritten whenever position `w * ratio + ratio - 1`
  is, so a rejected token leaves nothing behind; the last block (`trash`) is no request's.
* Host-side: `lengths[slot]` and `mtp_lengths[slot]` (writes start exactly there; a gap
  raises; `rollback` moves them back) and `blocks[slot]` (`assign`).

A `Batch` describes one dispatch: rows `(slot, start, n)` packed into token tensors [T].
Details: docs/state-layout.md, 'dsv4/model/state.py'.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ..config import CSA, WINDOW, ModelConfig, block_entry_bytes, state_block_size


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


STATIC_CONTEXT = 2048  # positions a compiled decode step covers (see ModelState.static_len)


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """A slotted state tensor [slots, n, d] as rows [slots * n, d] (a view), for
    `index_select` / `index_copy_`: one flat index is much cheaper than a (slot, row) pair."""
    return t.view(-1, t.shape[-1])


def _ring_index(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The rows of a slotted ring [slots, R, d] that hold positions lo..hi-1 ([hi - lo])."""
    return torch.arange(lo, hi, device=t.device) % t.shape[1]


def gather_entries(pool: torch.Tensor, table: torch.Tensor, slots, n: int) -> torch.Tensor:
    """The first `n` entries of each slot in `slots` (an int, or a tensor [T]) from a block
    pool [blocks, per_block, d] through the block table [slots, blocks] -> [n, d] or [T, n, d]."""
    per = pool.shape[1]
    e = pool[table[slots, : -(-n // per)]]  # [(T,) nb, per, d]
    return e.flatten(-3, -2)[..., :n, :]


class LayerState:
    """State tensors of one attention layer (see the module docstring). `table` is the
    owning `ModelState`'s block table, shared by every layer."""

    def __init__(self, cfg: ModelConfig, kind: str, ratio: int, slots: int, max_chunk: int, max_spec: int,
                 num_blocks: int, block_size: int, table: torch.Tensor, device, dtype: torch.dtype):
        hd = cfg.head_dim
        self.kind, self.ratio, self.table = kind, ratio, table
        win_size = max_chunk + cfg.sliding_window + max_spec
        self.win = torch.zeros(slots, win_size, hd, device=device, dtype=dtype)
        if kind != WINDOW:
            coff = 2 if kind == CSA else 1
            raw_size = max_chunk + 2 * ratio + max_spec
            per = block_size // ratio
            f32 = torch.float32
            self.raw_kv = torch.zeros(slots, raw_size, coff * hd, device=device, dtype=f32)
            self.raw_score = torch.zeros(slots, raw_size, coff * hd, device=device, dtype=f32)
            self.entries = torch.zeros(num_blocks + 1, per, hd, device=device, dtype=dtype)  # +1: trash
            if kind == CSA:
                di = cfg.index_head_dim
                self.idx_raw_kv = torch.zeros(slots, raw_size, 2 * di, device=device, dtype=f32)
                self.idx_raw_score = torch.zeros(slots, raw_size, 2 * di, device=device, dtype=f32)
                self.idx_entries = torch.zeros(num_blocks + 1, per, di, device=device, dtype=dtype)

    NAMES = ("win", "raw_kv", "raw_score", "entries", "idx_raw_kv", "idx_raw_score", "idx_entries")
    RINGS = ("win", "raw_kv", "raw_score", "idx_raw_kv", "idx_raw_score")  # per slot; the rest is in blocks

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self.NAMES if hasattr(self, n)]

    def rebound(self, tensors: list[torch.Tensor], table: torch.Tensor | None = None) -> "LayerState":
        """A shallow copy whose state tensors are `tensors` (in `tensors()` order), e.g. the
        inputs of an exported step (and whose block table is `table`, if given)."""
        out = copy.copy(self)
        for name, t in zip([n for n in self.NAMES if hasattr(self, n)], tensors, strict=True):
            setattr(out, name, t)
        if table is not None:
            out.table = table
        return out

    def entries_of(self, slots, n: int, idx: bool = False) -> torch.Tensor:
        """The first n compressed entries (`idx`: indexer keys) of `slots` (see `gather_entries`)."""
        return gather_entries(self.idx_entries if idx else self.entries, self.table, slots, n)


class ModelState:
    """All per-request state of the main model and the MTP block: rings in slots, compressed
    entries in blocks (`num_blocks` of `block_size` positions; None: every slot's max_len
    up front, assigned once, for callers without a block manager)."""

    def __init__(self, cfg: ModelConfig, max_slots: int, max_len: int, *, max_chunk: int = 128,
                 max_spec: int = 4, with_mtp: bool = True, device="cpu", dtype: torch.dtype = torch.float32,
                 num_blocks: int | None = None, block_size: int | None = None):
        self.cfg = cfg
        self.max_slots, self.max_len, self.max_chunk = max_slots, max_len, max_chunk
        self.block_size = block_size or state_block_size(cfg)
        if any(r and self.block_size % r for r in cfg.compress_ratios):
            raise ValueError(f"block size {self.block_size} is not a multiple of every compression ratio")
        self.max_blocks = -(-max_len // self.block_size)  # a slot's table width
        # what a compiled (static) dispatch attends over: masks cover the whole span, so a longer
        # context runs eager, whose cost follows the context
        self.static_len = min(max_len, -(-STATIC_CONTEXT // self.block_size) * self.block_size)
        managed = num_blocks is not None
        self.num_blocks = num_blocks if managed else max_slots * self.max_blocks
        self.trash = self.num_blocks  # the pool's spare block
        self.table = torch.full((max_slots, self.max_blocks), self.trash, dtype=torch.long, device=device)
        self.blocks: list[list[int]] = [[] for _ in range(max_slots)]
        args = (max_slots, max_chunk, max_spec, self.num_blocks, self.block_size, self.table, device, dtype)
        self.layers = [LayerState(cfg, k, r, *args) for k, r in zip(cfg.layer_kinds, cfg.compress_ratios)]
        self.mtp = LayerState(cfg, WINDOW, 0, *args) if with_mtp else None
        self.lengths = [0] * max_slots
        self.mtp_lengths = [0] * max_slots
        if not managed:
            for s in range(max_slots):
                self.assign(s, list(range(s * self.max_blocks, (s + 1) * self.max_blocks)))

    def assign(self, slot: int, blocks: list[int]) -> None:
        """Set the block ids of `slot` (its first len(blocks) blocks of positions); the rest
        of its table row points at the trash block."""
        if len(blocks) > self.max_blocks or any(not 0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"slot {slot}: bad block list (at most {self.max_blocks} ids < {self.num_blocks})")
        self.blocks[slot] = list(blocks)
        row = torch.full((self.max_blocks,), self.trash, dtype=torch.long)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        self.table[slot].copy_(row)

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
            if not mtp and start + n > len(self.blocks[slot]) * self.block_size:
                raise ValueError(f"slot {slot}: position {start + n - 1} has no block "
                                 f"({len(self.blocks[slot])} blocks of {self.block_size} assigned)")
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

    def assume(self, slot: int, length: int) -> None:
        """Timing only (auto K's calibration): let `slot` hold `length` positions, in the main
        model and the MTP, whatever its rows contain, so that a dispatch after them costs what
        it costs at that context without computing one. Its outputs are garbage."""
        if length + 1 > len(self.blocks[slot]) * self.block_size:
            raise ValueError(f"slot {slot}: {length} positions need more than its {len(self.blocks[slot])} blocks")
        self.lengths[slot] = length
        self.mtp_lengths[slot] = length

    def free(self, slot: int) -> None:
        """Release a slot: its contents become garbage that the next owner overwrites."""
        self.lengths[slot] = 0
        self.mtp_lengths[slot] = 0

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor: the layers' in order, then the MTP block's, then the block table."""
        return [t for ls in self._layer_states() for t in ls.tensors()] + [self.table]

    def rebound(self, tensors: list[torch.Tensor]) -> "ModelState":
        """A shallow copy (bookkeeping shared) whose state tensors are `tensors` (in
        `tensors()` order): what an exported step binds its tensor inputs to."""
        out, it = copy.copy(self), iter(tensors[:-1])
        out.table = tensors[-1]
        take = lambda ls: ls.rebound([next(it) for _ in ls.tensors()], out.table)  # noqa: E731
        out.layers = [take(ls) for ls in self.layers]
        out.mtp = take(self.mtp) if self.mtp is not None else None
        if next(it, None) is not None:
            raise ValueError("more tensors than the state holds")
        return out

    def _layer_states(self) -> list[LayerState]:
        return self.layers + ([self.mtp] if self.mtp is not None else [])

    def ring_bytes_per_slot(self) -> int:
        """Bytes of one slot's rings (window, compressor carry), whatever its length."""
        return sum(getattr(ls, n)[0].numel() * getattr(ls, n).element_size()
                   for ls in self._layer_states() for n in LayerState.RINGS if hasattr(ls, n))

    def block_bytes(self) -> int:
        """Bytes of one block of compressed entries (every layer's)."""
        return block_entry_bytes(self.cfg, self.block_size, self.layers[0].win.element_size())

    def nbytes_per_slot(self) -> int:
        """One slot's rings plus the blocks of a max_len request."""
        return self.ring_bytes_per_slot() + self.max_blocks * self.block_bytes()

    # -------------------------------------------------------------- ring snapshots
    def _spans(self, slot: int):
        """(layer state, ring name, lo, hi) for every ring row range the next dispatch of `slot`
        can read: the window's last `window - 1` positions, and the compressor rows of the
        unfinished window plus the CSA overlap carry."""
        W = self.cfg.sliding_window
        for i, ls in enumerate(self._layer_states()):
            n = self.mtp_lengths[slot] if i == len(self.layers) else self.lengths[slot]
            yield ls, "win", max(n - W + 1, 0), n
            if ls.kind != WINDOW:
                m = ls.ratio
                lo = max((n // m) * m - (m if ls.kind == CSA else 0), 0)
                for name in LayerState.RINGS[1:]:
                    if hasattr(ls, name):
                        yield ls, name, lo, n

    def save_rings(self, slot: int) -> tuple[int, int, list[torch.Tensor]]:
        """Copies of what `slot`'s rings hold for its next dispatch, with its lengths: with the
        blocks of its entries, everything a request continuing from here reads (the prefix
        cache keeps one at a block boundary)."""
        rows = []
        for ls, name, lo, hi in self._spans(slot):
            t = getattr(ls, name)
            rows.append(t[slot, _ring_index(t, lo, hi)])  # advanced indexing: a copy already
        return self.lengths[slot], self.mtp_lengths[slot], rows

    def load_rings(self, slot: int, saved: tuple[int, int, list[torch.Tensor]]) -> None:
        """Put `save_rings`'s copies (of any slot) into `slot` and take its lengths; the slot's
        blocks must already hold the entries before them (`assign`)."""
        self.lengths[slot], self.mtp_lengths[slot], rows = saved
        for (ls, name, lo, hi), r in zip(self._spans(slot), rows, strict=True):
            t = getattr(ls, name)
            t[slot].index_copy_(0, _ring_index(t, lo, hi), r)

    def saved_bytes(self) -> int:
        """Bytes of one `save_rings` at a block boundary (its largest)."""
        W, n = self.cfg.sliding_window, 0
        for ls in self._layer_states():
            n += (W - 1) * ls.win[0, 0].numel() * ls.win.element_size()
            if ls.kind == CSA:
                n += ls.ratio * sum(getattr(ls, k)[0, 0].numel() * 4 for k in LayerState.RINGS[1:] if hasattr(ls, k))
        return n

    # -------------------------------------------------------------- inspection
    def snapshot(self, slot: int) -> dict[str, torch.Tensor]:
        """The logical state of a slot (what the next dispatch can read), for tests: the
        ring rows `save_rings` keeps, and every emitted entry."""
        out: dict[str, torch.Tensor] = {}
        names = {id(ls): ("mtp" if i == len(self.layers) else f"layers.{i}")
                 for i, ls in enumerate(self._layer_states())}
        for ls, name, lo, hi in self._spans(slot):
            t = getattr(ls, name)
            out[f"{names[id(ls)]}.{name}"] = t[slot, _ring_index(t, lo, hi)]
        for i, ls in enumerate(self.layers):
            n = self.lengths[slot] // ls.ratio if ls.ratio else 0
            if ls.kind != WINDOW:
                out[f"layers.{i}.entries"] = ls.entries_of(slot, n)
                if ls.kind == CSA:
                    out[f"layers.{i}.idx_entries"] = ls.entries_of(slot, n, idx=True)
        return out

