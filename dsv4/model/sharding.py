"""Which slice of the model each rank holds under tensor and expert parallelism: `Shard`
(one tensor's slice), `Layout` (a rank's whole share, which the loader reads the
checkpoint by), `check_sizes` and `shard_model`, which cuts a built model down to one
rank's share in place. The collectives the model then runs are in `parallel.py`.

DeepSeek's reference layout (docs/distributed-layout.md), one flat group of T ranks:
query heads (`wq_b`, `attn_sink`), output groups (`wo_a`, and `wo_b` by columns), index
heads (indexer `wq_b`, `weights_proj`), vocabulary (embedding, head) and routed experts
(contiguous blocks) are split T ways; everything else is replicated. The shared expert
is held by rank 0 only (its output enters the MoE's all_reduce once). At world size 1
`shard_model` is never called, so the single-process model is untouched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..config import ModelConfig
from .attention import Attention
from .compressor import Indexer
from .layers import Embedding
from .moe import MoE


class ParallelError(ValueError):
    """A parallel setting that cannot work; the message names the flag and the numbers."""


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
