"""Blocks of compressed state and the prefix cache: `BlockManager`, the one owner of block ids.

The model keeps what only grows (compressed entries, indexer keys) in blocks of `block_size`
positions from a pool (`model.state`); what slides stays in per-slot rings. This module
decides which block ids each request holds, on the host, and tells the runner through a
`KVPlan` per step: blocks are taken on demand (`grow`: the free list first, then the least
recently used cached block); every full block of a prefill is named by a hash chained over
the token ids before it (from a root naming model, dtype, quantization, speculation); a
request reuses the longest chain of cached blocks that ends where rings were saved
(`KVPlan.saves`) and prefills only the rest; shared blocks are refcounted and never written
again; evicting a block drops its hash and the rings saved at its end (`KVPlan.drops`).
Details: docs/state-layout.md, 'dsv4/engine/kvcache.py'.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsv4.engine.request import Request


SAVE_EVERY = 8  # blocks between the saved rings of one long prefill (besides its last boundary)


@dataclass
class KVPlan:
    """What the runner applies in one step, before (tables, loads, drops) and after (saves)
    its dispatch."""

    tables: dict[int, list[int]] = field(default_factory=dict)  # slot -> its block ids (changed this step)
    loads: dict[int, bytes] = field(default_factory=dict)  # slot -> saved rings to start from (a hit)
    saves: dict[int, bytes] = field(default_factory=dict)  # slot -> key to save its rings under
    drops: list[bytes] = field(default_factory=list)  # saved rings to forget

    def __bool__(self) -> bool:
        return bool(self.tables or self.loads or self.saves or self.drops)


def chain_hashes(root: bytes, tokens: list[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """The chained hashes of every full block of `tokens`, extending `known` (the ones already
    computed for a prefix of the same tokens)."""
    out = list(known)
    prev = out[-1] if out else root
    for i in range(len(out), len(tokens) // block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes())
        prev = h.digest()
        out.append(prev)
    return out


class BlockManager:
    """Block ids of `num_blocks` blocks of `block_size` positions, by slot, with a prefix cache
    (`caching`) keeping saved rings at up to `max_saved` boundaries."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True, max_saved: int = 64,
                 root: str = ""):
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.max_saved = max_saved
        self.root = hashlib.blake2b(root.encode(), digest_size=16).digest()
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # holding nothing cached
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, held by no request: LRU first
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.saved: OrderedDict[bytes, None] = OrderedDict()  # keys whose rings the runner holds: LRU first
        self.saving: dict[int, bytes] = {}  # slot -> key its planned step saves under (committed by `register`)
        self.held: dict[int, list[int]] = {}  # slot -> block ids
        self.plan = KVPlan()  # this step's, handed to the runner by `take_plan`
        self.queries = self.hits = 0  # prompt tokens looked up / found (vllm:prefix_cache_*)

    @classmethod
    def for_config(cls, config, state) -> "BlockManager":
        """The pool an `EngineConfig` sized (kv_cache_blocks of block_size) for the runner's
        `ModelState` `state`, its cache keyed by what else changes the state: model, dtype,
        quantization, tensor-parallel size; ring snapshots up to an eighth of the pool's bytes
        (16 to 1024)."""
        root = f"{config.model}|{config.dtype}|{config.quantization}|tp{config.tensor_parallel_size}"
        max_saved = max(16, min(1024, config.kv_cache_memory // 8 // max(1, state.saved_bytes())))
        return cls(config.kv_cache_blocks, config.block_size, caching=config.enable_prefix_caching,
                   max_saved=max_saved, root=root)

    # ------------------------------------------------------------------ accounting
    @property
    def available(self) -> int:
        """Blocks a request could get now: free ones and cached ones no request holds."""
        return len(self.free) + len(self.idle)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def take_plan(self) -> KVPlan:
        plan, self.plan = self.plan, KVPlan()
        return plan

    # ------------------------------------------------------------------ prefix cache
    def root_for(self, salt: str) -> bytes:
        """The chain root of requests whose state also depends on `salt` (e.g. speculation)."""
        return hashlib.blake2b(self.root + salt.encode(), digest_size=16).digest()

    def lookup(self, hashes: list[bytes], n_tokens: int) -> tuple[int, list[int]]:
        """The longest cached prefix of a prefill of `n_tokens` tokens whose full blocks hash to
        `hashes` that ends at saved rings and leaves at least its last token to compute ->
        (cached tokens, their block ids); `count` records the outcome."""
        if not self.caching:
            return 0, []
        best, blocks = 0, []
        for i, h in enumerate(hashes[: (n_tokens - 1) // self.block_size]):
            b = self.block_of.get(h)
            if b is None:
                break
            blocks.append(b)
            if h in self.saved:
                best = i + 1
        return best * self.block_size, blocks[:best]

    def count(self, n_tokens: int, cached: int) -> None:
        """A request was admitted for the first time with `cached` of its `n_tokens` prompt
        tokens from the cache."""
        self.queries += n_tokens
        self.hits += cached

    def register(self, slot: int, hashes: list[bytes], n_tokens: int) -> None:
        """`slot`'s step succeeded and its first `n_tokens` positions are committed: name its full
        blocks among them by `hashes` (a hash already naming another block keeps that one), and
        commit the rings the step saved (`save`) if their chain is still cached (else the runner
        forgets them)."""
        if not self.caching:
            return
        for b, h in zip(self.held.get(slot, [])[: n_tokens // self.block_size], hashes):
            if b not in self.hash_of and h not in self.block_of:
                self.hash_of[b], self.block_of[h] = h, b
        key = self.saving.pop(slot, None)
        if key is None:
            return
        if key not in self.block_of:  # its block was evicted in the very step that saved it
            self._unsave(key)
            return
        self.saved[key] = None
        self.saved.move_to_end(key)
        while len(self.saved) > self.max_saved:
            self.plan.drops.append(self.saved.popitem(last=False)[0])

    def save(self, slot: int, key: bytes) -> None:
        """Ask the runner to save `slot`'s rings under `key` after this step; they count once the
        step has succeeded (`register`), so a failed step leaves no key without rings."""
        if not self.caching:
            return
        if key in self.saved:  # the same prefix's rings are there already
            self.saved.move_to_end(key)
            return
        self.plan.saves[slot] = key
        self.saving[slot] = key

    def _unsave(self, key: bytes) -> None:
        """Rings the runner may hold under `key` without the cache naming them: forget them
        (unless committed by another request)."""
        if key not in self.saved:
            self.plan.drops.append(key)

    def touch(self, key: bytes) -> None:
        """A hit used the rings saved under `key`: most recently used."""
        self.saved.move_to_end(key)

    # ------------------------------------------------------------------ requests
    def hashes(self, req: "Request") -> list[bytes]:
        """The chained hashes of `req`'s full prefill blocks (kept on the request, extended)."""
        ids = req.prefill_ids
        if len(req.block_hashes) < len(ids) // self.block_size:
            # what else the state or the tenant depends on: the drafter's rings, the request's salt
            root = self.root_for(("mtp" if req.num_spec else "") + "|" + (req.params.cache_salt or ""))
            req.block_hashes = chain_hashes(root, ids, self.block_size, req.block_hashes)
        return req.block_hashes

    def admit(self, req: "Request", slot: int) -> bool:
        """Give `req` (about to take `slot`) its cached prefix and check that the blocks of its
        whole prefill and a first output are available; False (nothing taken) otherwise.
        Requests asking for prompt logprobs compute their whole prompt."""
        n = req.num_prefill_tokens
        cached, blocks = 0, []
        if self.caching and req.params.prompt_logprobs is None:
            cached, blocks = self.lookup(self.hashes(req), n)
        shared_idle = sum(1 for b in blocks if self.refs[b] == 0)
        if self.blocks_for(n + 1) - len(blocks) > self.available - shared_idle:
            return False
        if not req.cache_counted:  # the first admission (not a recompute's, nor one preempted at once)
            req.cache_counted, req.prompt_cached_tokens = True, cached
            self.count(n, cached)
        self.share(slot, blocks)
        if cached:
            key = req.block_hashes[cached // self.block_size - 1]
            self.touch(key)
            self.plan.loads[slot] = key
        req.num_computed_tokens = req.num_cached_tokens = cached
        return True

    def save_point(self, req: "Request", start: int = 0) -> int:
        """The next boundary after `start` where `req`'s prefill saves its rings (0: none): the
        last block boundary before its final token (where the next turn of a conversation, or
        the same prompt again, resumes), and every SAVE_EVERY blocks before it (where prompts
        that share a long document but not its question can resume)."""
        if not self.caching:
            return 0
        last = (req.num_prefill_tokens - 1) // self.block_size * self.block_size
        every = SAVE_EVERY * self.block_size
        p = (max(start, req.num_cached_tokens) // every + 1) * every
        p = min(p, last)
        return p if p > max(start, req.num_cached_tokens) else 0

    def prefilled(self, req: "Request", start: int, n: int) -> None:
        """`req`'s chunk [start, start + n) is planned: save the rings if it ends at a save point."""
        p = self.save_point(req, start)
        if p and start + n == p:
            self.save(req.slot, self.hashes(req)[p // self.block_size - 1])

    # ------------------------------------------------------------------ holding blocks
    def share(self, slot: int, blocks: list[int]) -> None:
        """`slot` starts from cached `blocks` (a hit): one more holder each."""
        for b in blocks:
            if self.refs[b] == 0:
                self.idle.pop(b, None)
            self.refs[b] += 1
        self.held[slot] = list(blocks)
        self.plan.tables[slot] = list(blocks)

    def grow(self, slot: int, n_blocks: int) -> bool:
        """Make `slot` hold at least `n_blocks` blocks; False (nothing taken) when too few are
        available."""
        have = self.held.setdefault(slot, [])
        need = n_blocks - len(have)
        if need <= 0:
            return True
        if need > self.available:
            return False
        for _ in range(need):
            if self.free:
                b = self.free.popitem(last=False)[0]
            else:
                b = self.idle.popitem(last=False)[0]
                self._forget(b)
            self.refs[b] = 1
            have.append(b)
        self.plan.tables[slot] = list(have)
        return True

    def release(self, slot: int) -> None:
        """`slot`'s request is done (finished or preempted): its cached blocks stay for later
        hits (most recently used last, a chain's tail before its head: eviction takes the tail
        first, and the rings saved at its end with it, so what stays cached is still a chain
        that can hit), the others are free again."""
        key = self.saving.pop(slot, None)  # a save its step made (or, failed, did not) that never counted
        if key is not None:
            self._unsave(key)
        for b in reversed(self.held.pop(slot, [])):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.hash_of:
                    self.idle[b] = None
                else:
                    self.free[b] = None
        self.plan.tables[slot] = []

    def _forget(self, b: int) -> None:
        """Block b leaves the cache: its hash, and rings saved at its end, with it."""
        h = self.hash_of.pop(b, None)
        if h is None:
            return
        del self.block_of[h]
        if h in self.saved:
            del self.saved[h]
            self.plan.drops.append(h)

    def stats(self) -> dict[str, float | int]:
        return {"blocks": self.num_blocks, "block_size": self.block_size, "free_blocks": self.available,
                "cached_blocks": len(self.hash_of), "prefix_cache_queries": self.queries,
                "prefix_cache_hits": self.hits,
                "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0}



class SavedRings:
    """The runner's side of the prefix cache (one per rank): the rings saved by key, with the
    pending hidden row and the MTP backlog of the prefill that saved them, so that a hit
    resumes the drafter too. It applies a step's `KVPlan` to a `Runner`'s state."""

    def __init__(self) -> None:
        self.by_key: dict[bytes, tuple[Any, Any, Any]] = {}

    def apply(self, runner: Any, kv: KVPlan) -> None:
        """Before a step's dispatch: block tables, then hits' rings (before drops: a key can
        be loaded and dropped in one step)."""
        for slot, blocks in kv.tables.items():
            runner.state.assign(slot, blocks)
        for slot, key in kv.loads.items():
            rings, pending, backlog = self.by_key[key]
            runner.reset_slot(slot)
            runner.state.load_rings(slot, rings)
            if pending is not None:
                runner.pending[slot] = pending
            if backlog is not None:
                runner.backlog[slot] = (backlog[0], list(backlog[1]), list(backlog[2]))
        for key in kv.drops:
            self.by_key.pop(key, None)

    def save(self, runner: Any, kv: KVPlan) -> None:
        """After a step: the rings of the slots whose prefill reached a save point."""
        for slot, key in kv.saves.items():
            bl = runner.backlog.get(slot)  # copies: its rows are views of a whole step's hidden states
            self.by_key[key] = (runner.state.save_rings(slot), runner.pending.get(slot),
                                None if bl is None else (bl[0], [h.clone() for h in bl[1]], list(bl[2])))
