"""Which engine replica a request goes to: the one holding the longest prefix of its prompt,
else the least loaded (pure Python: no torch, no processes).

    router = Router(replicas=2, capacity=[pieces, pieces], root=b"...")
    i, why, matched = router.route(prompt_ids, salt, loads=[3, 1])   # why: "prefix" / "load" / "balance"

The router cannot see inside the replicas' prefix caches, so it keeps an estimate, as SGLang's
cache-aware router does with its approximate radix tree per worker: per replica, the chained
hashes (`kvcache.chain_hashes`, the function the prefix cache names its blocks with) of the
prompts it sent there, in pieces of `PIECE_TOKENS`, least recently used first, bounded by what
the replica's block pool holds. A prompt's pieces chain from a root that includes its
`cache_salt`, so tenants with different salts never attract each other. Pieces are finer than
the caches' blocks (256 positions): a conversation's second turn follows its first even when
that was shorter than a block, and lands where the blocks it grows will be cached.

Balance: a replica holding the prefix gets the request unless it has more than `slack`
requests in flight beyond the least loaded one (then "balance": the least loaded takes it);
without any prefix held anywhere, the least loaded takes it ("load"; ties go round the
replicas). A replica that is not serving (starting, dead) has load None and gets nothing.
`mode` "load" ignores prefixes (a plain least-loaded balancer) and "random" picks any serving
replica: the baselines `benchmarks/data_parallel.py` compares with ($DSV4_ROUTING).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Sequence

from dsv4.engine.kvcache import chain_hashes

PIECE_TOKENS = 32  # tokens per routing hash
MODES = ("prefix", "load", "random")


class Router:
    """Routing decisions over `replicas` replicas; `capacity[i]`: the pieces replica i's pool holds."""

    def __init__(self, replicas: int, capacity: Sequence[int], root: bytes, slack: int, mode: str = "prefix") -> None:
        if mode not in MODES:
            raise ValueError(f"routing mode {mode!r}: use one of {', '.join(MODES)}")
        self.mode = mode
        self._random = random.Random(0)
        self.held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]
        self.capacity = list(capacity)
        self.root = root
        self.slack = slack
        self.decisions = {"prefix": 0, "load": 0, "balance": 0}
        self.per_replica = [{"prefix": 0, "load": 0, "balance": 0} for _ in range(replicas)]
        self._turn = 0  # where a tie between equally loaded replicas starts

    def hashes(self, ids: list[int], salt: str | None) -> list[bytes]:
        """The prompt's piece hashes, chained from a root of the salt."""
        root = hashlib.blake2b(self.root + (salt or "").encode(), digest_size=16).digest()
        return chain_hashes(root, ids, PIECE_TOKENS, [])

    def matched(self, replica: int, hashes: list[bytes]) -> int:
        """How many leading pieces of `hashes` replica `replica` is thought to hold."""
        held, n = self.held[replica], 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def route(self, ids: list[int], salt: str | None, loads: Sequence[int | None]) -> tuple[int, str, int]:
        """(replica, why, pieces matched there) for a prompt; `loads[i]`: replica i's requests in
        flight, None when it cannot take any. Records the prompt's pieces as held there."""
        live = [i for i, n in enumerate(loads) if n is not None]
        if not live:
            raise LookupError("no engine replica is serving")
        hashes = self.hashes(ids, salt)
        least = min(loads[i] for i in live)  # type: ignore[type-var]
        match = {i: self.matched(i, hashes) if self.mode == "prefix" else 0 for i in live}
        best = max(live, key=lambda i: (match[i], -loads[i]))  # type: ignore[operator]
        if self.mode == "random":
            choice, why = self._random.choice(live), "load"
        elif match[best] > 0 and loads[best] - least <= self.slack:  # type: ignore[operator]
            choice, why = best, "prefix"
        else:
            idle = [i for i in live if loads[i] == least]
            choice = min(idle, key=lambda i: (i - self._turn) % len(self.held))
            self._turn = (choice + 1) % len(self.held)
            why = "balance" if match[best] > 0 else "load"
        self._hold(choice, hashes)
        self.decisions[why] += 1
        self.per_replica[choice][why] += 1
        return choice, why, match[choice]

    def forget(self, replica: int) -> None:
        """A replica restarted: its cache is empty."""
        self.held[replica].clear()

    def _hold(self, replica: int, hashes: list[bytes]) -> None:
        held = self.held[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity[replica]:
            held.popitem(last=False)
