"""DeepSeek V4 feed-forward: mixture of experts with a hash or score router.

Router: sqrt(softplus(x @ W_gate^T)) scores; the first `num_hash_layers` layers pick
experts by token id (`tid2eid`), the others by top-k of score + bias (the bias
only selects). Weights are the chosen scores, renormalised and scaled by
`routed_scaling_factor`. Experts are SwiGLU with clamping (gate <= limit,
-limit <= up <= limit); a shared expert is added to every token.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import int8pack, kernels, mxfp4, parallel
from .fusion import FusedLinear, Source, project, sourced, sourced_rows, stack_views
from .layers import Linear, cast, constant, f32, linear


class Expert(nn.Module):
    """SwiGLU expert with DeepSeek's clamp: w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter), Linear(inter, dim), Linear(dim, inter)
        self.limit = limit
        self.fused: FusedLinear | None = None

    def fuse(self, into: dict[str, torch.Tensor] | None = None, copy: bool = True, source: Source | None = None,
             prefix: str = "") -> None:
        """Inference: w1 and w3 as one matmul (see `FusedLinear`), in `into` when given, else
        where `source` has it (this module being named `prefix`)."""
        mods = [self.w1, self.w3]
        self.fused = FusedLinear(mods, sourced_rows(source, self, prefix, mods) if into is None else into, copy)

    def pack_int8(self, min_bytes: int) -> int:
        """`int8pack.pack_model`: the fused w1/w3 packed (a routed expert's was packed by its
        MoE, which owns the storage; w2 packs itself)."""
        return int8pack.pack_fused(self.fused, [self.w1, self.w3], min_bytes) if self.fused is not None else 0

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
        self.stacked: dict[str, torch.Tensor] | None = None  # fuse(): the local experts' weights, stacked
        self.mxfp4: bool | None = None  # routed experts kept MXFP4 (`mxfp4.to_mxfp4`): their own path
        self.packed = False  # pack_int8(): stacked["w13"] / ["w2"] are lists of prepacked weights per expert

    def fuse(self, copy: bool = True, source: Source | None = None, prefix: str = "") -> None:
        """Inference: each expert's w1/w3 as one matmul, and the local experts' weights stacked
        (w13 [E, 2I, D], w2 [E, D, I], and their row scales when int8) with every expert's
        tensors views of them, for the traced decode MoE (`gathered`): no memory grows.
        `copy` False: the weights hold nothing yet (the loader's), so no values are copied."""
        if self.shared_experts is not None:
            self.shared_experts.fuse(copy=copy, source=source, prefix=f"{prefix}shared_experts.")
        local = [self.experts[e] for e in self.local]
        if not local or mxfp4.is_mxfp4(local[0]):  # MXFP4 experts are used as stored (mapped): no stacking
            return
        w1 = local[0].w1
        (I, D), quant = w1.weight.shape, w1.scale is not None
        dev, E = w1.weight.device, len(local)
        # storage order: w1 then w3 of each expert (w13), then each expert's w2; scales alike
        w13 = [m for ex in local for m in (ex.w1, ex.w3)]
        w2s = [ex.w2 for ex in local]
        got = lambda mods, a, shape: sourced(source, self, prefix, mods, a, shape)  # noqa: E731
        st = {"w13": got(w13, "weight", (E, 2 * I, D))}
        if st["w13"] is None:
            st["w13"] = torch.empty(E, 2 * I, D, dtype=w1.weight.dtype, device=dev)
        if quant:
            st["s13"] = got(w13, "scale", (E, 2 * I))
            if st["s13"] is None:
                st["s13"] = torch.empty(E, 2 * I, dtype=w1.scale.dtype, device=dev)
        for i, ex in enumerate(local):
            ex.fuse({"weight": st["w13"][i], **({"scale": st["s13"][i]} if quant else {})}, copy)
        w2 = w2s[0].weight
        st["w2"] = stack_views(w2s, "weight", copy, got(w2s, "weight", (E, *w2.shape)))
        if quant:
            st["s2"] = stack_views(w2s, "scale", copy, got(w2s, "scale", (E, *w2s[0].scale.shape)))
        self.stacked = st

    def pack_int8(self, min_bytes: int) -> int:
        """`int8pack.pack_model`: the stacked int8 experts (CPU, one expert's w1/w3 of at
        least `min_bytes`) become lists of prepacked weights, one per local expert, which the
        experts' fused w1/w3 and w2 share; their plain weights become meta. Returns the bytes."""
        st = self.stacked
        if self.packed or st is None or "s13" not in st or not int8pack.worth_packing(st["w13"][0], min_bytes):
            return 0
        local = [self.experts[e] for e in self.local]
        if not self._stacked_current() or any(ex.fused is None for ex in local):
            return 0
        total = st["w13"].numel() + st["w2"].numel()
        # w13 first, and its plain storage gone (no view of it left) before w2 packs: loading
        # peaks at one layer's packed w1/w3 more than the plain model, not all its experts
        st["w13"] = [int8pack.pack(w) for w in st["w13"]]  # [2I, D] each
        for ex, p13 in zip(local, st["w13"]):
            int8pack.pack_fused(ex.fused, [ex.w1, ex.w3], min_bytes, packed=p13)
        st["w2"] = [int8pack.pack(w) for w in st["w2"]]  # [D, I] each
        for ex, p2 in zip(local, st["w2"]):
            ex.w2.adopt([p2])
        self.packed = True
        return total

    def packed_weights(self) -> list[torch.Tensor]:
        return [*self.stacked["w13"], *self.stacked["w2"]] if self.packed else []

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, D], ids [T] -> [T, D]: the shared expert, plus each routed expert's
        share added in increasing expert order (the same order for one token or many).
        Under expert parallelism each rank adds its own experts' shares (rank 0 also the
        shared expert's) and the ranks' sums are added."""
        weights, idx = self.gate(x, ids)
        local = self.local
        if mxfp4.is_mxfp4(self.experts[local.start]) and not torch.is_grad_enabled():
            return cast(parallel.all_reduce(self._routed_mxfp4(x, weights, idx)), x.dtype)
        if self.shared_experts is not None:
            out = f32(self.shared_experts(x))  # [T, D] float32, fresh: the accumulator
        else:
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if torch.compiler.is_compiling():  # no host reads: the experts' weights gathered per token
            return cast(parallel.all_reduce(gathered(out, x, weights, idx, self)), x.dtype)
        if self._stacked_current() and not torch.is_grad_enabled():
            out = routed(out, x, weights, idx, self.stacked, self.local.start, len(self.experts),
                         self.experts[self.local.start].limit)
            return cast(parallel.all_reduce(out), x.dtype)
        # unfused (or training): expert by expert through the modules, grouped as `routed` groups
        for e, t, w in _groups(idx, weights, local.start, len(local), len(self.experts)):
            y = f32(self.experts[local.start + e](x if t is None else x[t], w))
            out = out + y if t is None else out.index_add(0, t, y)
        return cast(parallel.all_reduce(out), x.dtype)

    def _routed_mxfp4(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The shared expert plus the MXFP4 routed shares (`mxfp4.routed`; one opaque op when compiled)."""
        out = f32(self.shared_experts(x)) if self.shared_experts is not None else \
            torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        lo, n, first = self.local.start, len(self.local), self.experts[self.local.start]
        lim, a8 = first.limit, first.w1.act_int8
        if torch.compiler.is_compiling():
            flat = [t for e in self.local for t in mxfp4.expert_tensors(self.experts[e])]
            return torch.ops.dsv4.moe_mxfp4(out, x, weights, idx, flat, lim, lo, len(self.experts), a8)
        return mxfp4.routed(out, x, _groups(idx, weights, lo, n, len(self.experts)),
                            lambda e: mxfp4.expert_tensors(self.experts[lo + e]), lim, a8)

    def _stacked_current(self) -> bool:
        """Whether `fuse()` stacked the local experts and their weights still live there."""
        st = self.stacked
        if st is None:
            return False
        if self.packed:  # the experts' plain weights are meta: the stacked lists are the only copy
            return True
        first, last = self.experts[self.local.start], self.experts[self.local.stop - 1]
        return (first.w1.weight.data_ptr() == st["w13"].data_ptr()
                and last.w2.weight.data_ptr() == st["w2"][-1].data_ptr())


# The traced MoE gathers the chosen experts' weights while tokens x top-k <= GATHER_MAX x
# experts, else runs every local expert densely (zero weights for the unchosen). Measured
# on the embedded model (8 experts, top-2, 1 thread, docs/benchmark-log.md section 4):
# gathering made the compiled 8-token step 0.42x of eager instead of 0.86x (dense).
GATHER_MAX = 4
# Experts this large (bytes of one expert's w1/w3) run in the compiled step as one opaque op,
# `dsv4::moe_routed`: the eager grouped path (one GEMM per chosen expert, the library's
# kernels), which the compiler calls rather than traces. A traced gather-reduction over
# V4 Flash's experts (4096 x 4096 in bf16) ran the Flash-shaped slice's compiled decode at
# 0.84x (batch 1) and 0.51x (batch 4) of eager (BENCHMARKS.md); the embedded model's
# 0.4 MB experts are op-overhead bound, where the traced gather wins.
OPAQUE_MIN_BYTES = 4 << 20


def gathered(out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, moe: MoE) -> torch.Tensor:
    """`MoE.forward`'s routed shares without host reads (the compiled decode step): out
    [T, D] float32 plus, for each token, its chosen local experts' shares added in
    increasing expert order (as the eager path adds them), from the stacked weights.
    x [T, D]; weights, idx [T, k]. Same arithmetic per (token, expert) as `Expert.forward`:
    the int8 experts quantise x once per token and h once per (token, expert)."""
    st = moe.stacked
    if st is None:
        raise RuntimeError("the traced MoE needs fused experts (DeepseekV4.fuse_projections)")
    if moe.packed:
        raise RuntimeError("the traced MoE needs plain int8 experts; this model's are prepacked (int8pack)")
    lo, E = moe.local.start, len(moe.local)
    lim = moe.experts[lo].limit
    if st["w13"][0].numel() * st["w13"].element_size() >= OPAQUE_MIN_BYTES:  # grouped by `routed`, global ids
        return torch.ops.dsv4.moe_routed(out, x, weights, idx, st["w13"], st["w2"], st.get("s13"), st.get("s2"),
                                         lim, lo, len(moe.experts))
    idx, perm = idx.sort(dim=-1)
    weights = weights.gather(1, perm)
    if E != len(moe.experts):  # expert parallelism: other ranks' experts weigh nothing here
        mine = (idx >= lo) & (idx < lo + E)
        weights, idx = weights.masked_fill(~mine, 0.0), (idx - lo).clamp(0, E - 1)
    T, k = idx.shape
    if T * k > GATHER_MAX * E:  # every expert, densely: zero weight for the unchosen
        weights = torch.zeros(T, E, dtype=weights.dtype, device=x.device).scatter(1, idx, weights)
        idx = None
    gu = _expert_in(x, st, idx)  # [T, n, 2I]: n = the k chosen experts, or all E (idx None)
    h = _swiglu(gu, lim) * weights.unsqueeze(-1)  # [T, n, I]
    y = _expert_out(cast(h, x.dtype), st, idx)  # [T, n, D]
    for j in range(y.shape[1]):  # in increasing expert order
        out = out + f32(y[:, j])
    return out


def _swiglu(gu: torch.Tensor, lim: float) -> torch.Tensor:
    """[..., 2I] (w1 x, w3 x) -> silu(min(g, L)) * clamp(u, -L, L) [..., I] float32."""
    g, u = f32(gu).chunk(2, dim=-1)
    if lim > 0:
        g, u = g.clamp(max=lim), u.clamp(-lim, lim)
    return F.silu(g) * u


def _expert_in(x: torch.Tensor, st: dict[str, torch.Tensor], idx: torch.Tensor | None) -> torch.Tensor:
    """x [T, D] through w1/w3 of experts idx [T, k] -> [T, k, 2I] (idx None: all E -> [T, E, 2I])."""
    w = st["w13"]
    E, N, D = w.shape
    if "s13" not in st:
        if idx is None:
            return linear(x, w.view(E * N, D)).view(-1, E, N)
        return (x[:, None, None, :] * w[idx]).sum(-1)  # the weights are read once, inside the reduction
    xq, xs = kernels.quantize_tokens(x)  # once per token, as the fused w1/w3 of one expert does
    if idx is None:
        acc = kernels.int_mm(xq, w.view(E * N, D)).view(-1, E, N)
        return (acc.float() * xs.unsqueeze(-1) * st["s13"]).to(x.dtype)
    acc = (xq[:, None, None, :].to(torch.int32) * w[idx].to(torch.int32)).sum(-1)  # exact, as int_mm
    return (acc.float() * xs.unsqueeze(-1) * st["s13"][idx]).to(x.dtype)


def _expert_out(h: torch.Tensor, st: dict[str, torch.Tensor], idx: torch.Tensor | None) -> torch.Tensor:
    """h [T, k, I] through w2 of experts idx [T, k] -> [T, k, D] (idx None: h [T, E, I], all E)."""
    w = st["w2"]
    if "s2" not in st:
        if idx is None:
            return torch.bmm(h.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)
        return (h[:, :, None, :] * w[idx]).sum(-1)
    T, n, I = h.shape  # n: k chosen, or all E
    hq, hs = kernels.quantize_tokens(h.reshape(T * n, I))  # per (token, expert) row, as w2 alone does
    hq, hs = hq.view(T, n, I), hs.view(T, n, 1)
    if idx is None:
        acc = torch.stack([kernels.int_mm(hq[:, e], w[e]) for e in range(n)], dim=1)
        return (acc.float() * hs * st["s2"]).to(h.dtype)
    acc = (hq[:, :, None, :].to(torch.int32) * w[idx].to(torch.int32)).sum(-1)
    return (acc.float() * hs * st["s2"][idx]).to(h.dtype)


def routed(out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
           st: dict[str, torch.Tensor], lo: int, n_experts: int, limit: float) -> torch.Tensor:
    """The grouped MoE: out [T, D] float32 (updated in place and returned) plus the routed
    shares of x [T, D] through the experts idx [T, k] (global ids; this rank's are
    lo .. lo + len(st["w13"]) - 1) weighted by weights [T, k]. The token-expert pairs are
    sorted by expert, and each chosen expert runs one GEMM pair over all its tokens from the
    stacked weights (`MoE.fuse`), adding its shares in increasing expert order per token.
    Under w8a8 each token's activation is quantised once for all its experts (per-token
    scales: the same bits as quantising it per expert) and each (token, expert) row of the
    SwiGLU output once, as the expert's w2 does."""
    quant = "s13" in st
    if quant and x.device.type in ("cpu", "cuda"):
        xq, xs = kernels.quantize_tokens(x)  # [T, D] int8, [T, 1]
    for e, t, w in _groups(idx, weights, lo, len(st["w13"]), n_experts):
        xe = x if t is None else x[t]  # [c, D]
        if quant and x.device.type not in ("cpu", "cuda"):  # npu: its own fused quantise + matmul
            gu = kernels.w8a8_linear(xe, st["w13"][e], st["s13"][e])
        elif quant:  # w8a8_linear's arithmetic on the rows quantised above
            xe_q, xe_s = (xq, xs) if t is None else (xq[t], xs[t])
            gu = (kernels.int_mm(xe_q, st["w13"][e]).float() * xe_s * st["s13"][e]).to(x.dtype)
        else:
            gu = linear(xe, st["w13"][e])
        h = cast(_swiglu(gu, limit) * w.unsqueeze(-1), x.dtype)  # [c, I]
        y = linear(h, st["w2"][e]) if not quant else kernels.w8a8_linear(h, st["w2"][e], st["s2"][e])
        if t is None:
            out = out + f32(y)
        else:
            out.index_add_(0, t, f32(y))
    return out


def _groups(idx: torch.Tensor, weights: torch.Tensor, lo: int, E: int, n_experts: int):
    """(local expert, its tokens' rows [c] (None: the one token), their weights [c]) for each
    chosen local expert lo .. lo + E - 1, in increasing expert order."""
    T, k = idx.shape
    if T == 1:  # decode of one token: no sorting needed
        for e, j in sorted(zip(idx[0].tolist(), range(k))):
            if lo <= e < lo + E:
                yield e - lo, None, weights[:, j]
        return
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    tok, wsorted = order // k, weights.flatten()[order]
    start = sum(counts[:lo])
    for e in range(E):
        c = counts[lo + e]
        if c:
            yield e, tok[start:start + c], wsorted[start:start + c]
        start += c


@torch.library.custom_op("dsv4::moe_routed", mutates_args=())
def moe_routed(acc: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, s13: Optional[torch.Tensor], s2: Optional[torch.Tensor], limit: float,
               lo: int, n_experts: int) -> torch.Tensor:
    """`routed` (the eager grouped MoE) on global expert ids idx [T, k] (this rank's: lo ..
    lo + len(w13) - 1, of n_experts), as one op a compiled step calls without tracing it."""
    st = {"w13": w13, "w2": w2, **({"s13": s13, "s2": s2} if s13 is not None else {})}
    return routed(acc.clone(), x, weights, idx, st, lo, n_experts, limit)


@moe_routed.register_fake
def _moe_routed_fake(acc, x, weights, idx, w13, w2, s13, s2, limit, lo, n_experts) -> torch.Tensor:
    return torch.empty_like(acc)


@torch.library.custom_op("dsv4::moe_mxfp4", mutates_args=())
def moe_mxfp4(acc: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
              tensors: list[torch.Tensor], limit: float, lo: int, n_experts: int, act_int8: bool) -> torch.Tensor:
    """`mxfp4.routed` as one op a compiled step calls without tracing it (`tensors`: every local
    expert's `mxfp4.expert_tensors`, concatenated)."""
    groups = _groups(idx, weights, lo, len(tensors) // 6, n_experts)
    return mxfp4.routed(acc.clone(), x, groups, lambda e: tensors[6 * e: 6 * e + 6], limit, act_int8)


@moe_mxfp4.register_fake
def _moe_mxfp4_fake(acc, x, weights, idx, tensors, limit, lo, n_experts, act_int8) -> torch.Tensor:
    return torch.empty_like(acc)
