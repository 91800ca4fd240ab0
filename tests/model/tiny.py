"""Tiny DeepSeek V4 configs for the model tests: every attention kind, a hash layer, MTP."""

from __future__ import annotations

from dsv4.config import ModelConfig


def tiny_dict(**over) -> dict:
    d = {
        "model_type": "deepseek_v4",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 32,
        "o_lora_rank": 16,
        "o_groups": 2,
        "sliding_window": 12,
        "compress_ratios": [0, 4, 8, 4, 0],
        "compress_rope_theta": 160000.0,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1024,
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": 5,
        "num_hash_layers": 1,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 5,
        "hc_eps": 1e-6,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    d.update(over)
    return d


def tiny_config(**over) -> ModelConfig:
    return ModelConfig.from_dict(tiny_dict(**over))


# The variant whose every split dimension divides by 4 (tensor parallelism at T = 4):
# 4 attention heads, 8 index heads, 4 output groups (the base config has 2), 8 routed
# experts; vocabularies of the test checkpoints (128, 256, 4096) all divide by 4.
TP4 = {"o_groups": 4}
