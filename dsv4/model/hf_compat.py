"""Conversion between transformers' `DeepseekV4ForCausalLM` and dsv4's official names.

transformers (>= 5.23) ships an independent implementation of the main model; dsv4
uses it as a cross-check (tests) and as the peer in benchmarks. transformers has no
MTP block, so these conversions cover the main model only.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..config import CSA, HCA, HF_DEFAULT_RATES, HF_LAYER_TYPES, ModelConfig

_RENAMES = [  # (transformers pattern, official replacement), applied in order
    (r"^model\.embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^model\.norm\.", "norm."),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.", "layers."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.mlp\.", ".ffn."),
]


def hf_to_official(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers state dict -> official DeepSeek V4 tensor names (experts unfused)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m:
            i, kind = m.groups()
            for e in range(t.shape[0]):
                p = f"layers.{i}.ffn.experts.{e}."
                if kind == "gate_up_proj":
                    w1, w3 = t[e].chunk(2, dim=0)
                    out[p + "w1.weight"], out[p + "w3.weight"] = w1, w3
                else:
                    out[p + "w2.weight"] = t[e]
            continue
        for pat, rep in _RENAMES:
            name = re.sub(pat, rep, name)
        out[name] = t
    return out


def official_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_official` for the main model (MTP tensors are dropped)."""
    back = {next(iter(hf_to_official({hf: torch.empty(0)}))): hf for hf in _hf_names(cfg)}
    out = {back[n]: t for n, t in sd.items() if n in back}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}.ffn.experts."
        experts = range(cfg.n_routed_experts)
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{p}{e}.w1.weight"], sd[f"{p}{e}.w3.weight"]], dim=0) for e in experts])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([sd[f"{p}{e}.w2.weight"] for e in experts])
    return out


def _hf_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
             "model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"]
    for i, kind in enumerate(cfg.layer_kinds):
        p = f"model.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "attn_hc.fn", "attn_hc.base", "attn_hc.scale",
                                  "ffn_hc.fn", "ffn_hc.base", "ffn_hc.scale",
                                  "self_attn.q_a_proj.weight", "self_attn.q_a_norm.weight",
                                  "self_attn.q_b_proj.weight", "self_attn.kv_proj.weight",
                                  "self_attn.kv_norm.weight", "self_attn.o_a_proj.weight",
                                  "self_attn.o_b_proj.weight", "self_attn.sinks", "mlp.gate.weight",
                                  "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                                  "mlp.shared_experts.down_proj.weight")]
        names.append(p + ("mlp.gate.tid2eid" if cfg.is_hash_layer(i) else "mlp.gate.e_score_correction_bias"))
        if kind in (CSA, HCA):
            c = p + "self_attn.compressor."
            names += [c + n for n in ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")]
        if kind == CSA:
            c = p + "self_attn.compressor.indexer."
            names += [c + n for n in ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight",
                                      "q_b_proj.weight", "scorer.weights_proj.weight")]
    return names


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers `DeepseekV4Config` kwargs dict equivalent to `cfg`."""
    types = {kind: hf for hf, kind in HF_LAYER_TYPES.items()}
    rates = {}
    for k, r in zip(cfg.layer_kinds, cfg.compress_ratios):
        if k != "window":
            if rates.get(types[k], r) != r:
                raise ValueError("transformers needs one compression ratio per attention type")
            rates[types[k]] = r
    d = cfg.to_official_dict()
    for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "architectures",
              "model_type", "topk_method", "torch_dtype"):
        d.pop(k, None)
    d["layer_types"] = [types[k] for k in cfg.layer_kinds]
    d["compress_rates"] = {**HF_DEFAULT_RATES, **rates}
    d["mlp_layer_types"] = ["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.num_hidden_layers)]
    d["partial_rotary_factor"] = cfg.qk_rope_head_dim / cfg.head_dim
    compress = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta}
    if cfg.yarn is not None:
        y = cfg.yarn
        compress = {"rope_type": "yarn", "rope_theta": cfg.compress_rope_theta, "factor": y.factor,
                    "original_max_position_embeddings": y.original_max_position_embeddings,
                    "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "attention_factor": 1.0}
    compress["partial_rotary_factor"] = d["partial_rotary_factor"]
    d["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                     "partial_rotary_factor": d["partial_rotary_factor"]},
                            "compress": compress}
    return d
