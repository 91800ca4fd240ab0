"""DeepSeek V4 feed-forward: mixture of experts with a hash or score router.

Router: sqrt(softplus(x @ W_gate^T)) scores; the first `num_hash_layers` layers pick
experts by token id (`tid2eid`), the others by top-k of score + bias (the bias
only selects). Weights are the chosen scores, renormalised and scaled by
`routed_scaling_factor`. Experts are SwiGLU with clamping (gate <= limit,
-limit <= up <= limit); a shared expert is added to every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import parallel
from .layers import FusedLinear, Linear, cast, constant, f32, linear, project


class Expert(nn.Module):
    """SwiGLU expert with DeepSeek's clamp: w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter), Linear(inter, dim), Linear(dim, inter)
        self.limit = limit
        self.fused: FusedLinear | None = None

    def fuse(self) -> None:
        """Inference: w1 and w3 as one matmul (see `FusedLinear`)."""
        self.fused = FusedLinear([self.w1, self.w3])

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        g, u = (f32(t) for t in project(x, self.fused, [self.w1, self.w3]))
        if self.limit > 0:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        h = F.silu(g) * u
        if weight is not None:
            h = h * weight.unsqueeze(-1)
        return self.w2(cast(h, x.dtype))


class Gate(nn.Module):
    """Router; holds `weight` and either `bias` (score routing) or `tid2eid` (hash routing)."""

    def __init__(self, cfg: ModelConfig, hash_routed: bool):
        super().__init__()
        self.k, self.scale, self.hash = cfg.num_experts_per_tok, cfg.routed_scaling_factor, hash_routed
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], ids [T] -> (weights [T, k] float32, expert indices [T, k])."""
        scores = F.softplus(linear(f32(x), f32(self.weight))).sqrt()  # [T, E]
        if self.hash:
            idx = self.tid2eid.index_select(0, ids)
        else:
            idx = torch.topk(scores + f32(self.bias), self.k, dim=-1).indices
        w = scores.gather(1, idx)
        dev = x.device
        w = w / (w.sum(dim=-1, keepdim=True) + constant(1e-20, dev))
        return w * constant(self.scale, dev), idx


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hash_routed: bool):
        super().__init__()
        self.gate = Gate(cfg, hash_routed)
        inter = cfg.moe_intermediate_size
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, inter, cfg.swiglu_limit)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = (Expert(cfg.hidden_size, inter * cfg.n_shared_experts, cfg.swiglu_limit)
                               if cfg.n_shared_experts else None)
        self.local = range(cfg.n_routed_experts)  # the experts this rank holds (sharding.shard_model)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, D], ids [T] -> [T, D]: the shared expert, plus each routed expert's
        share added in increasing expert order (the same order for one token or many).
        Under expert parallelism each rank adds its own experts' shares (rank 0 also the
        shared expert's) and the ranks' sums are added."""
        weights, idx = self.gate(x, ids)
        local = self.local
        if self.shared_experts is not None:
            out = f32(self.shared_experts(x))  # [T, D] float32, fresh: the accumulator
        else:
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if x.shape[0] == 1:  # decode of one token: no grouping needed
            for j, e in sorted(enumerate(idx[0].tolist()), key=lambda je: je[1]):
                if e in local:
                    out = out + f32(self.experts[e](x, weights[:, j]))
            return cast(parallel.all_reduce(out), x.dtype)
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tok = order // idx.shape[1]
        wsorted = weights.flatten()[order]
        start = 0
        for e, c in enumerate(counts):
            if c and e in local:
                t = tok[start:start + c]
                out.index_add_(0, t, f32(self.experts[e](x[t], wsorted[start:start + c])))
            start += c
        return cast(parallel.all_reduce(out), x.dtype)
