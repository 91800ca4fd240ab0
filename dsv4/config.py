"""Model configuration: `ModelConfig`, read from a checkpoint's `config.json`.

Accepts both key sets found in the wild: the official DeepSeek keys (`compress_ratios`,
`num_hash_layers`, `rope_scaling` with YaRN, ...) and the normalised keys transformers writes
(`layer_types`, `compress_rates`, `rope_parameters`, ...). Every layer gets an attention
kind and a compression ratio: "window" (ratio 0), "csa" (overlapping compressor plus
lightning indexer) or "hca" (non-overlapping compressor); officially ratio 4 means CSA and
any other ratio > 1 HCA, as the reference code decides.

Problems are `ConfigError`s naming the offending key (or the file, when it is not UTF-8
JSON); NaN, infinities and values outside a key's range are errors, not a model that loads
and prints garbage. Details: docs/architecture.md, 'dsv4/config.py'.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config_values import ConfigError, Getter, integer as _integer, real as _real, shown

WINDOW, CSA, HCA = "window", "csa", "hca"
HF_LAYER_TYPES = {
    "sliding_attention": WINDOW,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
HF_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
# The prefill tile of the reference NPU kernel: the most prompt tokens one dispatch may take.
DEEPSEEK_V4_PREFILL_LIMIT = 128


@dataclass(frozen=True)
class YarnParams:
    """YaRN scaling for the compressed layers' RoPE (no mscale: attention factor 1)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model math needs, with DeepSeek's names where it has them."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    layer_kinds: tuple[str, ...]  # per layer: "window" | "csa" | "hca"
    compress_ratios: tuple[int, ...]  # per layer: 0 for window layers
    num_hash_layers: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnParams | None
    max_position_embeddings: int
    num_nextn_predict_layers: int
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    scoring_func: str = "sqrtsoftplus"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ helpers
    @property
    def prefill_limit(self) -> int:
        """Most prompt tokens one dispatch may take (the reference kernel's tile)."""
        return DEEPSEEK_V4_PREFILL_LIMIT

    @property
    def speculation_spans_chunks(self) -> bool:
        """Can the MTP drafter's state be carried across prefill chunks? Yes for DeepSeek V4:
        every state (window rings, compressors, MTP window) is indexed by absolute position."""
        return True

    @property
    def mtp_depth(self) -> int:
        """Drafts per step the MTP layers support (one layer applied recurrently, up to 3)."""
        return 3 if self.num_nextn_predict_layers > 0 else 0

    def is_hash_layer(self, i: int) -> bool:
        return i < self.num_hash_layers

    def to_official_dict(self) -> dict[str, Any]:
        """The official DeepSeek key set for this config (what `save_checkpoint` writes)."""
        d: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_lora_rank": self.o_lora_rank,
            "o_groups": self.o_groups,
            "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios) + [0] * self.num_nextn_predict_layers,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "num_hash_layers": self.num_hash_layers,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "scoring_func": self.scoring_func,
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
        if self.yarn is not None:
            d["rope_scaling"] = {
                "type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
            }
        return d

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        if not f.is_file():
            raise ConfigError(f"no config.json in {p}: is this a DeepSeek V4 checkpoint directory?")
        try:
            raw = f.read_bytes()
        except OSError as e:
            raise ConfigError(f"{f}: cannot read ({e.strerror or e})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{f}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{f}: not valid JSON ({e})") from None
        except RecursionError:
            raise ConfigError(f"{f}: not valid JSON (nested too deeply)") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{f}: expected a JSON object")
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        mt = d.get("model_type")
        if mt != "deepseek_v4":
            raise ConfigError(f"model_type {mt!r} is not supported; dsv4 runs model_type 'deepseek_v4'")
        g = Getter(d)
        n_layers = g.int("num_hidden_layers")
        head_dim = g.int("head_dim")
        kinds, ratios = _layer_kinds(d, n_layers)
        rope_dim = _rope_dim(d, head_dim)
        n_hash = _num_hash_layers(d, n_layers)
        rope_theta, compress_theta, yarn = _rope(d)
        heads = g.int("num_attention_heads")
        o_groups = g.int("o_groups")
        if heads % o_groups:
            raise ConfigError(f"num_attention_heads {heads} is not divisible by o_groups {o_groups}")
        if rope_dim % 2 or not 0 < rope_dim <= head_dim:
            raise ConfigError(f"qk_rope_head_dim {rope_dim} must be even and at most head_dim {head_dim}")
        kv_heads = d.get("num_key_value_heads", 1)
        if kv_heads != 1:
            raise ConfigError(f"num_key_value_heads {kv_heads}: DeepSeek V4 has one shared K=V head")
        cfg = cls(
            vocab_size=g.int("vocab_size"),
            hidden_size=g.int("hidden_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=g.int("q_lora_rank"),
            o_lora_rank=g.int("o_lora_rank"),
            o_groups=o_groups,
            sliding_window=g.int("sliding_window"),
            layer_kinds=tuple(kinds),
            compress_ratios=tuple(ratios),
            num_hash_layers=n_hash,
            moe_intermediate_size=g.int("moe_intermediate_size"),
            n_routed_experts=g.int("n_routed_experts"),
            n_shared_experts=g.int("n_shared_experts", 1, minimum=0),
            num_experts_per_tok=g.int("num_experts_per_tok"),
            routed_scaling_factor=g.float("routed_scaling_factor", 1.0, above=0),
            swiglu_limit=g.float("swiglu_limit", 0.0, at_least=0),
            index_n_heads=g.int("index_n_heads", 64) if CSA in kinds else g.int("index_n_heads", 1),
            index_head_dim=g.int("index_head_dim", 128),
            index_topk=g.int("index_topk", 512),
            hc_mult=g.int("hc_mult", 4),
            hc_sinkhorn_iters=g.int("hc_sinkhorn_iters", 20),
            hc_eps=g.float("hc_eps", 1e-6, above=0),
            rms_norm_eps=g.float("rms_norm_eps", 1e-6, above=0),
            rope_theta=rope_theta,
            compress_rope_theta=compress_theta,
            yarn=yarn,
            max_position_embeddings=g.int("max_position_embeddings"),
            num_nextn_predict_layers=g.int("num_nextn_predict_layers", 0, minimum=0),
            bos_token_id=_integer("bos_token_id", d.get("bos_token_id", 0)),
            eos_token_id=_integer("eos_token_id", _first(d.get("eos_token_id", 1))),
            scoring_func=d.get("scoring_func", "sqrtsoftplus"),
            raw=dict(d),
        )
        _check_maxima(cfg)
        if cfg.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func {cfg.scoring_func!r}: DeepSeek V4 uses 'sqrtsoftplus'")
        if cfg.num_experts_per_tok > cfg.n_routed_experts:
            raise ConfigError("num_experts_per_tok exceeds n_routed_experts")
        if CSA in kinds and cfg.index_head_dim < rope_dim:
            raise ConfigError(f"index_head_dim {cfg.index_head_dim} is smaller than qk_rope_head_dim {rope_dim}")
        if cfg.num_nextn_predict_layers > 1:
            raise ConfigError("num_nextn_predict_layers > 1 is not supported (DeepSeek V4 ships one MTP layer)")
        return cfg


# The largest value each size may take: far above any DeepSeek V4 (Pro: hidden 7168, 384 experts
# of width 3072, vocabulary 129280, 1M positions), low enough that no tensor's element count
# overflows and the memory plan can add them up; beyond, one line naming the key.
MAXIMA = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "num_hidden_layers": 1 << 10, "num_attention_heads": 1 << 10,
    "head_dim": 1 << 12, "q_lora_rank": 1 << 16, "o_lora_rank": 1 << 16, "o_groups": 1 << 10,
    "sliding_window": 1 << 16, "moe_intermediate_size": 1 << 17, "n_routed_experts": 1 << 12,
    "n_shared_experts": 64, "num_experts_per_tok": 1 << 10, "index_n_heads": 1 << 10, "index_head_dim": 1 << 12,
    "index_topk": 1 << 20, "hc_mult": 64, "hc_sinkhorn_iters": 1 << 10, "max_position_embeddings": 1 << 24,
    "num_hash_layers": 1 << 10,
}


def _check_maxima(cfg: "ModelConfig") -> None:
    for key, most in MAXIMA.items():
        v = getattr(cfg, key)
        if v > most:
            raise ConfigError(f"{key!r} is {shown(v)}, over the largest this server takes ({most}); "
                              f"is this config.json corrupt?")


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, list) and v else v


def _layer_kinds(d: dict[str, Any], n: int) -> tuple[list[str], list[int]]:
    """Per layer: attention kind and compression ratio. A config may carry both key sets
    (the embedded model does, so that transformers, whose ratio map knows only 4 and 128,
    loads it from `layer_types` + `compress_rates`); then they must agree."""
    kinds, ratios = _layer_kinds_of(d, n)
    if d.get("layer_types") is not None and d.get("compress_ratios") is not None:
        official = _layer_kinds_of({"compress_ratios": d["compress_ratios"]}, n)
        if official != (kinds, ratios):
            raise ConfigError(f"'compress_ratios' {official[1]} and 'layer_types' with 'compress_rates' "
                              f"{ratios} disagree; keep one of them, or make them agree")
    return kinds, ratios


def _layer_kinds_of(d: dict[str, Any], n: int) -> tuple[list[str], list[int]]:
    if d.get("layer_types") is not None:
        lt = d["layer_types"]
        if not isinstance(lt, list) or len(lt) < n:
            raise ConfigError(f"'layer_types' has {len(lt) if isinstance(lt, list) else '?'} entries, "
                              f"but num_hidden_layers is {n}")
        rates = dict(HF_DEFAULT_RATES)
        rates.update(d.get("compress_rates") or {})
        kinds, ratios = [], []
        for t in lt[:n]:
            if t not in HF_LAYER_TYPES:
                raise ConfigError(f"'layer_types' entry {t!r} is not one of {sorted(HF_LAYER_TYPES)}")
            kinds.append(HF_LAYER_TYPES[t])
            ratios.append(0 if t == "sliding_attention" else _integer(f"compress_rates[{t!r}]", rates[t]))
    elif d.get("compress_ratios") is not None:
        cr = d["compress_ratios"]
        if not isinstance(cr, list) or len(cr) < n:
            raise ConfigError(f"'compress_ratios' has {len(cr) if isinstance(cr, list) else '?'} entries, "
                              f"but num_hidden_layers is {n} (one entry per layer, plus one per MTP layer)")
        ratios = [_integer(f"compress_ratios[{i}]", r) for i, r in enumerate(cr[:n])]
        kinds = [WINDOW if r == 0 else CSA if r == 4 else HCA for r in ratios]
    else:
        raise ConfigError("config.json is missing required key 'compress_ratios' (or 'layer_types')")
    for i, r in enumerate(ratios):
        if r < 0 or r == 1:
            raise ConfigError(f"compression ratio {r} of layer {i} is invalid: use 0 (window only) or a ratio > 1")
    return kinds, ratios


def _rope_dim(d: dict[str, Any], head_dim: int) -> int:
    if d.get("qk_rope_head_dim") is not None:
        return _integer("qk_rope_head_dim", d["qk_rope_head_dim"], 1)
    if d.get("partial_rotary_factor") is not None:
        factor = _real("partial_rotary_factor", d["partial_rotary_factor"], above=0)
        if factor > 1:
            raise ConfigError(f"'partial_rotary_factor' must be at most 1, got {factor:g}")
        return int(head_dim * factor)
    raise ConfigError("config.json is missing required key 'qk_rope_head_dim' (or 'partial_rotary_factor')")


def _num_hash_layers(d: dict[str, Any], n: int) -> int:
    if d.get("mlp_layer_types") is not None:
        mt = list(d["mlp_layer_types"])[:n]
        k = sum(1 for t in mt if t == "hash_moe")
        if mt[:k] != ["hash_moe"] * k or any(t not in ("hash_moe", "moe") for t in mt):
            raise ConfigError("'mlp_layer_types' must be some 'hash_moe' entries followed by 'moe' entries")
        return k
    k = d.get("num_hash_layers", 0)
    if not isinstance(k, int) or not 0 <= k <= n:
        raise ConfigError(f"'num_hash_layers' must be an integer in 0..{n}, got {k!r}")
    return k


def _yarn(p: dict[str, Any]) -> YarnParams | None:
    kind = p.get("rope_type", p.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ConfigError(f"rope scaling type {kind!r} is not supported (DeepSeek V4 uses 'yarn')")
    try:
        return YarnParams(
            factor=_real("rope_scaling factor", p["factor"], above=0),
            original_max_position_embeddings=_integer("rope_scaling original_max_position_embeddings",
                                                      p["original_max_position_embeddings"], 1),
            beta_fast=_real("rope_scaling beta_fast", p.get("beta_fast") or 32, above=0),
            beta_slow=_real("rope_scaling beta_slow", p.get("beta_slow") or 1, above=0),
        )
    except KeyError as e:
        raise ConfigError(f"rope scaling is missing key {e.args[0]!r}") from None


def _rope(d: dict[str, Any]) -> tuple[float, float, YarnParams | None]:
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
        return (_base("rope_parameters main rope_theta", main.get("rope_theta", 10000.0)),
                _base("rope_parameters compress rope_theta", comp.get("rope_theta", 160000.0)), _yarn(comp))
    scaling = d.get("rope_scaling") or (rp if isinstance(rp, dict) else None)
    if scaling and not isinstance(scaling, dict):
        raise ConfigError(f"'rope_scaling' must be an object, got {scaling!r:.60}")
    yarn = _yarn(scaling) if scaling else None
    return (_base("rope_theta", d.get("rope_theta", 10000.0)),
            _base("compress_rope_theta", d.get("compress_rope_theta", 160000.0)), yarn)


def _base(key: str, v: Any) -> float:
    """A RoPE base: finite and > 1 (its log divides YaRN's correction range)."""
    return _real(key, v, above=1)


def yarn_inv_freq(dim: int, base: float, yarn: YarnParams | None):
    """Inverse RoPE frequencies, one per interleaved pair: [dim // 2] float32, on the CPU
    whatever the default device (under `torch.device("meta")`, a meta arange would import
    torch's reference ops: 2 s of a model's start)."""
    import torch

    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    inv = 1.0 / pos_freqs
    if yarn is None:
        return inv

    def corr(rot: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(yarn.beta_fast)), 0)
    high = min(math.ceil(corr(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    return 1.0 / (yarn.factor * pos_freqs) * (1 - extrap) + inv * extrap


def state_block_size(cfg: ModelConfig) -> int:
    """Positions per block of compressed state: the smallest multiple of every compression
    ratio that is at least 256 (256 for V4's ratios 4 and 128, and the embedded model's 4 and 16)."""
    lcm = math.lcm(*[r for r in cfg.compress_ratios if r > 0] or [1])
    return -(-256 // lcm) * lcm


def block_entry_bytes(cfg: ModelConfig, block_size: int, elem_size: int) -> int:
    """Bytes one block holds over every layer: the compressed entries (head_dim each) and, in
    CSA layers, the indexer keys (index_head_dim each) of its block_size positions."""
    n = 0
    for kind, r in zip(cfg.layer_kinds, cfg.compress_ratios):
        if r:
            n += block_size // r * (cfg.head_dim + (cfg.index_head_dim if kind == CSA else 0))
    return n * elem_size
