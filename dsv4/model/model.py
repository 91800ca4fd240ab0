"""DeepSeek V4 (Flash) in PyTorch, with its MTP block.

Parameter names are the official checkpoint names: `model.state_dict()` keys are exactly the
tensors of a DeepSeek V4 checkpoint, dequantised.

* `model(input_ids)` [B, S] -> logits [B, S, vocab]: a full causal forward from position 0.
* `state = model.new_state(max_slots, max_len, ...)`; `model.forward_batch(batch, state,
  logits_index)`: one dispatch of any mix of prefill chunks and decode rows (a `Batch`);
  returns the final hidden streams [T, hc, D] (before `hc_head`) and the logits asked for.
* `model.mtp_forward(batch, hidden, state, logits_index)`: the MTP block over pairs
  (h_t, x_{t+1}) (`batch.input_ids` x_{t+1}, `batch.positions` t, `hidden` h_t); returns its
  own streams (fed back for deeper drafts) and logits for x_{t+2}.
Details: docs/architecture.md, 'dsv4/model/model.py'.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import WINDOW, ModelConfig
from .attention import Attention
from . import int8pack, kernels, parallel, w8a8
from .fusion import Source
from .layers import Embedding, HyperConnection, Linear, RMSNorm, RopeTable, f32, hc_head
from .moe import MoE
from .state import Batch, LayerState, ModelState


DRAFT_ROWS_MULTIPLE = 16  # a draft vocabulary's head rows are padded to this (restrict_draft_vocab)


class Block(nn.Module):
    """One transformer block: mHC around attention, then mHC around the MoE."""

    def __init__(self, cfg: ModelConfig, kind: str, ratio: int, hash_routed: bool):
        super().__init__()
        self.cfg, self.kind = cfg, kind
        mix = (2 + cfg.hc_mult) * cfg.hc_mult
        D = cfg.hidden_size
        self.attn_norm, self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps), RMSNorm(D, cfg.rms_norm_eps)
        self.attn = Attention(cfg, kind, ratio)
        self.ffn = MoE(cfg, hash_routed)
        for p in ("attn", "ffn"):
            self.register_parameter(f"hc_{p}_fn", nn.Parameter(torch.zeros(mix, cfg.hc_mult * D)))
            self.register_parameter(f"hc_{p}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{p}_scale", nn.Parameter(torch.ones(3)))

    def forward(self, x: torch.Tensor, batch: Batch, ls: LayerState | None, rope: RopeTable) -> torch.Tensor:
        """x: [T, hc, D] -> [T, hc, D]."""
        cfg = self.cfg
        y, post, comb = HyperConnection.pre(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, cfg)
        x = HyperConnection.post(self.attn(self.attn_norm(y), batch, ls, rope), x, post, comb)
        y, post, comb = HyperConnection.pre(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, cfg)
        return HyperConnection.post(self.ffn(self.ffn_norm(y), batch.input_ids), x, post, comb)


class MTPBlock(Block):
    """The MTP layer: a window-only block with its own input projections and head mix."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, WINDOW, 0, hash_routed=False)
        D = cfg.hidden_size
        self.enorm, self.hnorm, self.norm = (RMSNorm(D, cfg.rms_norm_eps) for _ in range(3))
        self.e_proj, self.h_proj = Linear(D, D), Linear(D, D)
        self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * D))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))


class DeepseekV4(nn.Module):
    """The main model plus (when the config has one) the MTP block."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool | None = None):
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.embed = Embedding(cfg.vocab_size, D)  # by vocabulary under TP, like the head
        self.layers = nn.ModuleList(
            Block(cfg, k, r, cfg.is_hash_layer(i))
            for i, (k, r) in enumerate(zip(cfg.layer_kinds, cfg.compress_ratios))
        )
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = Linear(D, cfg.vocab_size)
        self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * D))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        if with_mtp is None:
            with_mtp = cfg.num_nextn_predict_layers > 0
        self.mtp = nn.ModuleList([MTPBlock(cfg)]) if with_mtp else None
        # the MTP's own head, when it has one: the head's int8 rows "weight" [V, D] and float32
        # "scale" [V] (quantize_draft_head), and/or only the rows of a draft vocabulary, with
        # their local token ids "ids" [V'] (restrict_draft_vocab); a dict: compiled-step
        # packages find its tensors by name
        self.draft_head: dict[str, torch.Tensor] | None = None
        self.make_rope_tables()

    def make_rope_tables(self, device: torch.device | str | None = None) -> None:
        """The RoPE tables: plain for window layers, YaRN for compressed ones (derived from
        the config, not stored in checkpoints; `load_model` builds them on the real device
        after a meta-device construction)."""
        rd, cfg = self.cfg.qk_rope_head_dim, self.cfg
        self.rope_main = RopeTable(rd, cfg.rope_theta, None).to(device)
        self.rope_compress = RopeTable(rd, cfg.compress_rope_theta, cfg.yarn).to(device)

    def fuse_projections(self, copy: bool = True, source: Source | None = None) -> "DeepseekV4":
        """For inference: every group of linears that reads one input runs as one matmul
        (attention's projections of x, each expert's w1/w3). Parameters become views of
        the fused weights, so memory does not grow and `state_dict()` is unchanged.
        Call it once the model is on its device (`load_model` does, with `copy` False:
        storage fresh from `to_empty` holds no values worth copying, and a `source`: the
        checkpoint's mapped pages where a group lies in them back to back, `fusion.Source`)."""
        for name, mod in self.named_modules():
            if isinstance(mod, (Attention, MoE)):  # MoE: its experts, stacked
                mod.fuse(copy=copy, source=source, prefix=f"{name}." if name else "")
        return self

    def quantize_draft_head(self) -> int:
        """W8A8 inference: the MTP drafts through an int8 copy of the head (per-row scales;
        `kernels.draft_linear`), or of its draft-vocabulary rows (`restrict_draft_vocab`, called
        first): a draft reads half the head's bytes, most of what it reads (the sizes:
        docs/architecture.md, 'dsv4/model/model.py'). Drafts are proposals: verification
        keeps the exact head, so the text still follows the main model alone (greedy: the
        same tokens; sampled: the target's distribution, with q the drafts' own). Quantised
        by `w8a8.rows_into` (no float32 copy of the whole head). Returns the bytes of the draft
        head."""
        kept = dict(self.draft_head or {})
        w = kept.pop("weight", self.head.weight).detach()  # [V, D] (this rank's vocabulary slice under TP)
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        sc = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        w8a8.rows_into("plain", w, None, q, sc)  # as the loader converts a float weight
        self.draft_head = {**kept, "weight": q, "scale": sc, "scale_bf16": sc.to(torch.bfloat16)}
        return sum(t.numel() * t.element_size() for t in self.draft_head.values())

    def restrict_draft_vocab(self, token_ids: list[int] | torch.Tensor, rank: int = 0, world: int = 1) -> int:
        """Drafts propose only `token_ids` (a draft vocabulary, `dsv4/draft_vocab.py`): the draft
        head is a copy of those rows of the head, with their ids "ids" [V'], and the MTP's
        logits elsewhere are -inf. Rank `rank` of `world` tensor-parallel ranks keeps the ids
        of its vocabulary slice. The rows are padded with zero rows to a multiple of
        `DRAFT_ROWS_MULTIPLE` (CUDA's int8 matmul pads them on every call otherwise; the padding's
        logits are dropped). Call it before `quantize_draft_head` (which then quantises only
        these rows). Returns this rank's draft rows."""
        if self.draft_head is not None:
            raise RuntimeError("restrict the draft vocabulary before quantising or packing the draft head")
        w = self.head.weight
        n = w.shape[0]  # this rank's vocabulary slice [lo, lo + n) (an even split, sharding.Shard)
        lo = rank * n if world > 1 else 0
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique()  # sorted: the head's rows in order
        local = (ids[(ids >= lo) & (ids < lo + n)] - lo).to(w.device)
        pad = -local.numel() % DRAFT_ROWS_MULTIPLE
        with torch.no_grad():
            rows = w.detach().index_select(0, local)
            self.draft_head = {"weight": torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]), "ids": local}
        return local.numel()

    def pack_int8(self, min_bytes: int) -> int:
        """`int8pack.pack_model`: the MTP's int8 copy of the head prepacked for oneDNN (in
        place of the plain one and its bf16 scales), when it lives on the CPU and has at least
        `min_bytes`. Returns the bytes packed."""
        head = self.draft_head
        if (head is None or "weight" not in head or head["weight"].dtype != torch.int8
                or not int8pack.worth_packing(head["weight"], min_bytes)):
            return 0
        kept = {k: v for k, v in head.items() if k in ("scale", "ids")}
        self.draft_head = {"packed": int8pack.pack(head["weight"]), **kept}
        return head["weight"].numel()

    def packed_weights(self) -> list[torch.Tensor]:
        return [self.draft_head["packed"]] if self.draft_head is not None and "packed" in self.draft_head else []

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    def new_state(self, max_slots: int, max_len: int, *, max_chunk: int = 128, max_spec: int = 4,
                  num_blocks: int | None = None, block_size: int | None = None) -> ModelState:
        """Slots for `max_slots` requests of up to `max_len` positions; entries in `num_blocks`
        blocks of `block_size` positions (None: every slot's max_len up front; see `ModelState`)."""
        p = self.embed.weight
        return ModelState(self.cfg, max_slots, max_len, max_chunk=max_chunk, max_spec=max_spec,
                          with_mtp=self.has_mtp, device=p.device, dtype=p.dtype, num_blocks=num_blocks,
                          block_size=block_size)

    def _rope(self, kind: str) -> RopeTable:
        return self.rope_main if kind == WINDOW else self.rope_compress

    def _logits(self, h: torch.Tensor, fn, base, scale, norm: RMSNorm, draft: bool = False) -> torch.Tensor:
        """[N, hc, D] streams -> [N, vocab] float32 logits (`draft`: through `draft_head` if made)."""
        y = norm(hc_head(h, fn, base, scale, self.cfg))
        if draft and self.draft_head is not None:
            ids = self.draft_head.get("ids")
            if ids is None:
                out = f32(kernels.draft_linear(y, self.draft_head))
            else:  # a draft vocabulary: its rows' logits [N, V' + padding] in place, -inf elsewhere
                out = torch.full((y.shape[0], self.head.weight.shape[0]), float("-inf"), device=y.device)
                if ids.numel():
                    out.index_copy_(1, ids, f32(kernels.draft_linear(y, self.draft_head))[:, :ids.numel()])
            return parallel.all_gather(out)  # [N, vocab]
        return parallel.all_gather(f32(self.head(y)))  # each rank's vocabulary slice

    # ---------------------------------------------------------------- stateful
    def forward_batch(self, batch: Batch, state: ModelState | None,
                      logits_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One dispatch of the main model -> (hidden [T, hc, D], logits [N, vocab]).

        `logits_index` picks token rows for the head (default: every row). With
        `state` None the batch must be `Batch.whole(...)` (stateless, dense attention).
        """
        if state is not None:
            if not batch.static:  # a static dispatch's caller did the bookkeeping (host work)
                state.begin(batch)
        elif batch.dense is None:
            raise ValueError("a stateless dispatch needs Batch.whole(input_ids)")
        h = self.embed(batch.input_ids)  # [T, D]
        h = h.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, hc, D]
        for i, layer in enumerate(self.layers):
            h = layer(h, batch, state.layers[i] if state is not None else None, self._rope(layer.kind))
        sel = h if logits_index is None else h[logits_index]
        return h, self._logits(sel, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm)

    def mtp_forward(self, batch: Batch, hidden: torch.Tensor, state: ModelState | None,
                    logits_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP over pairs (h_t [T, hc, D], x_{t+1} = batch.input_ids) at positions t.

        Returns (MTP streams [T, hc, D], logits for x_{t+2} [N, vocab]).
        """
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP weights")
        mtp: MTPBlock = self.mtp[0]
        if state is not None and not batch.static:
            state.begin(batch, mtp=True)
        e = mtp.enorm(self.embed(batch.input_ids))  # [T, D]
        z = mtp.e_proj(e).unsqueeze(1) + mtp.h_proj(mtp.hnorm(hidden))  # [T, hc, D]
        z = mtp(z, batch, state.mtp if state is not None else None, self.rope_main)
        sel = z if logits_index is None else z[logits_index]
        return z, self.mtp_logits(sel)

    def mtp_logits(self, z: torch.Tensor, draft: bool = True) -> torch.Tensor:
        """The MTP's streams [N, hc, D] -> its logits [N, vocab]: through its draft head
        (`draft`, the default), or through the main model's head over the whole vocabulary."""
        mtp: MTPBlock = self.mtp[0]
        return self._logits(z, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, mtp.norm, draft=draft)

    @property
    def draft_vocab_size(self) -> int | None:
        """Tokens the drafts may propose on this rank (`restrict_draft_vocab`); None: every one."""
        ids = (self.draft_head or {}).get("ids")
        return None if ids is None else ids.numel()

    # ---------------------------------------------------------------- stateless
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward from position 0: [B, S] -> logits [B, S, vocab]."""
        B, S = input_ids.shape
        _, logits = self.forward_batch(Batch.whole(input_ids), None)
        return logits.view(B, S, -1)


@torch.no_grad()
def init_random(model: DeepseekV4, seed: int = 0, std: float = 0.02) -> DeepseekV4:
    """Random weights in the spirit of the real ones (for tests and toy models).

    Norm weights near 1, mHC scales near 1 with small fn, small ape/sink/bias, a
    random but fixed `tid2eid` table.
    """
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif leaf.endswith("_scale"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif leaf.endswith("_base") or leaf in ("ape", "attn_sink", "bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif leaf.endswith("_fn"):
            p.copy_(std * torch.randn(p.shape, generator=g))
        elif name == "embed.weight":
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            b.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(cfg.vocab_size)]))
    return model
