"""Tensor and expert parallelism: the process group, which slice each rank holds, and
every collective the model runs (one grep for `parallel.` finds them all).

DeepSeek's reference layout (docs: distributed.md), one flat group of T ranks:
query heads (`wq_b`, `attn_sink`), output groups (`wo_a`, and `wo_b` by columns), index
heads (indexer `wq_b`, `weights_proj`), vocabulary (embedding, head) and routed experts
(contiguous blocks) are split T ways; everything else is replicated. The collectives:

* `all_reduce` (fp32 sum): after `wo_b`, after the MoE, of the indexer's scores, of the
  embedding (ids outside a rank's vocabulary slice give zeros);
* `all_gather`: the head's logits, along the vocabulary.

At world size 1 (no group initialised) every collective returns its input unchanged,
and `shard_model` is never called, so the single-process model is untouched.

The shared expert is computed by rank 0 only (its output enters the MoE's all_reduce
once); the other ranks do not hold it. Per-request state is replicated on every rank.
"""

from __future__ import annotations

import datetime
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig

_GROUP: dist.ProcessGroup | None = None
_CHANNEL: Any = None  # replaces broadcast_object_list when set (engine.transport.ShmChannel, one host)
STATS: dict[str, list] = {}  # collective -> [calls, seconds] on this rank (benchmarks/parallel.py)


def _count(name: str, t0: float) -> None:
    c = STATS.setdefault(name, [0, 0.0])
    c[0] += 1
    c[1] += time.perf_counter() - t0


class ParallelError(ValueError):
    """A parallel setting that cannot work; the message names the flag and the numbers."""


# ------------------------------------------------------------------ the group
def init(rank: int, world: int, master_addr: str, master_port: int, *, backend: str = "gloo",
         timeout_s: float = 60.0, rendezvous_s: float | None = None, serve_store: bool | None = None) -> None:
    """Join the group of `world` ranks rendezvousing at master_addr:master_port (TCP store,
    served by rank 0, or by torchrun's agent: `serve_store` False on every rank).
    `rendezvous_s` (default `timeout_s`) bounds the wait for the others; `timeout_s`
    bounds every collective (a dead peer cannot hang a rank)."""
    global _GROUP
    timeout = datetime.timedelta(seconds=timeout_s)
    wait = rendezvous_s if rendezvous_s is not None else timeout_s
    meet = datetime.timedelta(seconds=wait)
    is_master = rank == 0 if serve_store is None else serve_store
    if not is_master:
        _wait_for_master(master_addr, master_port, wait)
    store = dist.TCPStore(master_addr, master_port, world, is_master=is_master, timeout=meet,
                          wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    _GROUP = dist.group.WORLD


def _wait_for_master(addr: str, port: int, timeout_s: float) -> None:
    """Until rank 0's store accepts a connection; `TimeoutError` after `timeout_s` (checked
    here, so an absent master is one clean error rather than c10d's retry log)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens at {addr}:{port}") from None
            time.sleep(0.2)


def set_channel(channel: Any) -> None:
    """Send `broadcast_object`'s messages through `channel` (its `broadcast(obj)`; None: the group)."""
    global _CHANNEL
    _CHANNEL = channel


def channel() -> Any:
    """The channel set by `set_channel` (None: messages go through the group)."""
    return _CHANNEL


def close() -> None:
    """Leave the group (a no-op when none was joined)."""
    global _GROUP, _CHANNEL
    if _CHANNEL is not None:
        _CHANNEL.close()
        _CHANNEL = None
    if _GROUP is not None:
        dist.destroy_process_group()
        _GROUP = None


def world_size() -> int:
    return dist.get_world_size() if _GROUP is not None else 1


def rank() -> int:
    return dist.get_rank() if _GROUP is not None else 0


# ------------------------------------------------------------------ the collectives
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, reduced in float32 (gloo has no bf16 sum), in x's dtype."""
    if _GROUP is None:
        return x
    t0 = time.perf_counter()
    y = x.float() if x.dtype != torch.float32 else x.contiguous()
    dist.all_reduce(y)
    _count("all_reduce", t0)
    return y.to(x.dtype)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of x over the ranks (float32): the token amax of a row-parallel
    int8 linear's input, and a row-parallel weight's row amax when quantised at load."""
    if _GROUP is None:
        return x
    t0 = time.perf_counter()
    y = x.float().contiguous()
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    _count("all_reduce_max", t0)
    return y


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """The ranks' x [..., n] concatenated along the last dim, in rank order: [..., T * n]."""
    if _GROUP is None:
        return x
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    _count("all_gather", t0)
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: object = None) -> object:
    """Rank 0's `obj` on every rank (the engine's per-step plan and results), through the
    channel when one is set, else `broadcast_object_list`."""
    if _GROUP is None:
        return obj
    t0 = time.perf_counter()
    if _CHANNEL is not None:
        out = _CHANNEL.broadcast(obj)
    else:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
    _count("broadcast_object", t0)
    return out


# ------------------------------------------------------------------ who holds what
@dataclass(frozen=True)
class Shard:
    """Part `rank` of `parts` equal contiguous pieces of a tensor along `dim`."""

    dim: int
    rank: int
    parts: int

    def bounds(self, n: int) -> tuple[int, int]:
        size = n // self.parts
        return self.rank * size, (self.rank + 1) * size


_EXPERT_RE = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.")
_SHARED_RE = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.shared_experts\.")


@dataclass
class Layout:
    """What one rank holds of a checkpoint: `shards` (tensor name -> its slice) and the
    routed experts [expert_lo, expert_hi) (the shared expert on rank 0 only)."""

    rank: int
    parts: int
    expert_lo: int
    expert_hi: int
    shards: dict[str, Shard]

    def holds(self, name: str) -> bool:
        m = _EXPERT_RE.match(name)
        if m is not None:
            return self.expert_lo <= int(m.group(1)) < self.expert_hi
        return self.rank == 0 or _SHARED_RE.match(name) is None

    def shard(self, name: str) -> Shard | None:
        return self.shards.get(name)


def check_sizes(cfg: ModelConfig, world: int, flag: str = "--tensor-parallel-size") -> None:
    """Raise `ParallelError` unless `world` divides every split dimension of the model."""
    if world < 1:
        raise ParallelError(f"{flag} must be >= 1, got {world}")
    for what, n in (("attention heads", cfg.num_attention_heads), ("index heads", cfg.index_n_heads),
                    ("output groups", cfg.o_groups), ("routed experts", cfg.n_routed_experts),
                    ("vocabulary size", cfg.vocab_size)):
        if n % world:
            raise ParallelError(f"{flag} {world} does not divide the model's {what} ({n})")


def shard_model(model: nn.Module, rank: int, parts: int) -> Layout:
    """Cut a built model (meta or real, plain or w8a8) down to rank `rank`'s part of the
    reference layout, in place; returns the `Layout` the loader reads slices by."""
    from .attention import Attention
    from .compressor import Indexer
    from .layers import Embedding
    from .moe import MoE

    check_sizes(model.cfg, parts)
    shards: dict[str, Shard] = {}
    cfg = model.cfg
    E = cfg.n_routed_experts
    lo, hi = Shard(0, rank, parts).bounds(E)

    def cut(prefix: str, mod: nn.Module, dim: int, attrs: tuple[str, ...] = ("weight", "scale")) -> None:
        """Keep mod's slice of `attrs` along dim (an int8 linear's row scales only when cut by rows)."""
        for attr in attrs if dim == 0 else attrs[:1]:
            t = getattr(mod, attr, None)
            if t is None:
                continue
            a, b = Shard(dim, rank, parts).bounds(t.shape[dim])
            part = t.detach().narrow(dim, a, b - a).clone()
            setattr(mod, attr, nn.Parameter(part, t.requires_grad) if isinstance(t, nn.Parameter) else part)
            shards[f"{prefix}.{attr}" if prefix else attr] = Shard(dim, rank, parts)

    for name, mod in list(model.named_modules()):
        if isinstance(mod, Attention):
            cut(f"{name}.wq_b", mod.wq_b, 0)
            cut(name, mod, 0, ("attn_sink",))
            cut(f"{name}.wo_a", mod.wo_a, 0)
            cut(f"{name}.wo_b", mod.wo_b, 1)
            mod.wo_b.row_parallel = True  # an int8 wo_b quantises its input by whole rows
            mod.n_heads //= parts
            mod.n_groups //= parts
        elif isinstance(mod, Indexer):
            cut(f"{name}.wq_b", mod.wq_b, 0)
            cut(f"{name}.weights_proj", mod.weights_proj, 0)
            mod.n_heads //= parts
        elif isinstance(mod, MoE):
            for e in range(E):
                if not lo <= e < hi:
                    mod.experts[e] = nn.Module()  # holds nothing: another rank's expert
            mod.local = range(lo, hi)
            if rank != 0:
                mod.shared_experts = None
        elif isinstance(mod, Embedding):
            cut(name, mod, 0)
            mod.vocab_start = Shard(0, rank, parts).bounds(cfg.vocab_size)[0]
    cut("head", model.head, 0)
    return Layout(rank, parts, lo, hi, shards)
