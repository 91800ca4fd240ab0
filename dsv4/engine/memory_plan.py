"""The memory a configuration needs, part by part, before anything loads.

    plan = memory_plan(config)        # an EngineConfig (a config.json alone will do: `dsv4 plan`)
    print(plan.render())              # weights by kind and format, the state pool, the rings, ...
    plan.check()                      # EngineConfigError naming the figures and the flags that fit

Weights are the loader's own meta model (`loader.meta_model`: the formats and dtypes
`--quantization` and `--dtype` give, rank 0's share under tensor parallelism), summed by
kind; the draft head's int8 copy (w8a8 modes) is added. The state is the block pool
`EngineConfig` sized, each slot's rings, and the prefix cache's saved rings at most. The
activations are an estimate of one step at the token budget (`activation_bytes`). Ranks on one
host add up, and so do engine replicas (--data-parallel-size). `serve` and `run --local` refuse a plan over the memory available, before a
weight is read, naming the quantisations and limits that would fit.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from dsv4.engine.checks import EngineConfigError, machine_memory
from dsv4.machine import available_memory

KINDS = [  # (label, pattern of the official names), first match wins
    ("routed experts", re.compile(r".*\.ffn\.experts\..*")),
    ("shared experts", re.compile(r".*\.ffn\.shared_experts\..*")),
    ("attention", re.compile(r".*\.attn\..*")),
    ("embedding and head", re.compile(r"(?:embed|head)\..*")),
]
FORMATS = {"uint8": "MXFP4", "int8": "int8", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
           "int64": "int64"}
ALTERNATIVES = ("w8a8-mxfp4", "mxfp4", "w8a8", "none")  # what a refusal suggests, smallest first
# With no --quantization: the stored weights as float ("none": exact) where they fit, else the
# checkpoint's own formats: FP4 experts as stored with int8 for the rest first (the smallest, and
# decode is bound by the bytes a token reads: int8 attention reads a quarter of float32's), then
# float for the rest, then w8a8
DEFAULT_ORDER = ("none", "w8a8-mxfp4", "mxfp4", "w8a8")


@dataclass
class Part:
    what: str
    bytes: int
    detail: str = ""


@dataclass
class MemoryPlan:
    """Parts per rank (`parts`), ranks on this host, and the memory they are held against."""

    parts: list[Part]
    ranks_here: int = 1
    here: str = "ranks"  # what ranks_here counts: tensor-parallel ranks, or engines (--data-parallel-size)
    available: int | None = None  # bytes this host may use (MemAvailable, or `dsv4 plan --memory`)
    total_memory: int | None = None
    quantization: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def per_rank(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def host_bytes(self) -> int:
        return self.per_rank * self.ranks_here

    def fits(self) -> bool:
        return self.available is None or self.host_bytes <= self.available

    def render(self) -> str:
        """A table of the parts and the verdict (plain text, one line per part)."""
        rows = [(p.what, _gib(p.bytes), p.detail) for p in self.parts]
        rows.append((f"total per {self.here[:-1]}", _gib(self.per_rank), ""))
        if self.ranks_here > 1:
            rows.append((f"this host ({self.ranks_here} {self.here})", _gib(self.host_bytes), ""))
        w = max(len(r[0]) for r in rows)
        lines = [f"{a:<{w}}  {b:>10}  {c}".rstrip() for a, b, c in rows]
        if self.available is not None:
            verdict = "fits" if self.fits() else "does NOT fit"
            lines.append(f"{verdict} in {_gib(self.available).strip()} available"
                         + (f" ({_gib(self.total_memory).strip()} in all)" if self.total_memory else ""))
        return "\n".join(lines + self.notes)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:8.2f} GiB"


def _stored_dtype(model_dir: Any, name: str) -> str | None:
    """The safetensors dtype `name` has in the checkpoint at `model_dir`; None without one (a
    config.json alone, as the published V4 configs in the tests: the official format then)."""
    from dsv4.model.checkpoint import Checkpoint, CheckpointError

    try:
        entry = Checkpoint(model_dir).entries.get(name)
    except (CheckpointError, OSError, TypeError):
        return None
    return entry.dtype if entry is not None else None


def weight_parts(config: Any, exact: bool = False) -> list[Part]:
    """The weights of rank 0 by kind, with their formats. The routed experts of a layer are
    alike, so unless `exact` the meta model is built with one per rank and their bytes scaled
    by the experts a rank holds (building all of V4 Pro's takes seconds, even on meta:
    docs/quantization.md, 'dsv4/engine/memory_plan.py')."""
    from dsv4.model.loader import head_as_stored, meta_model

    mc, T = config.model_config, config.tensor_parallel_size
    head = head_as_stored(config.quantization, config.torch_dtype, config.device.split(":")[0],
                          lambda: _stored_dtype(config.model, "head.weight"))
    scale = 1
    if not exact and mc.n_routed_experts > T:
        scale = mc.n_routed_experts // T
        # one expert per rank; the router's rows (and the hash table's ids) follow the real count
        mc = dataclasses.replace(mc, n_routed_experts=T, num_experts_per_tok=min(mc.num_experts_per_tok, T))
    model, _ = meta_model(mc, config.quantization, config.torch_dtype, config.has_mtp, 0, T, head_stored=head)
    sums: dict[str, dict[str, int]] = {}
    for name, t in model.state_dict().items():
        kind = next((label for label, rx in KINDS if rx.fullmatch(name)), "other (norms, router, mHC, MTP)")
        fmt = FORMATS.get(str(t.dtype).removeprefix("torch."), str(t.dtype))
        n = t.numel() * t.element_size()
        if scale > 1 and kind == "routed experts":
            n *= scale
        elif scale > 1 and (name.endswith(".gate.weight") or name.endswith(".gate.bias") or name.endswith("tid2eid")):
            full = config.model_config  # [E, D] router rows, [E] bias, [V, k] hash table
            n = n // t.shape[0] * full.n_routed_experts if not name.endswith("tid2eid") else \
                t.shape[0] * full.num_experts_per_tok * t.element_size()
        by = sums.setdefault(kind, {})
        by[fmt] = by.get(fmt, 0) + n
    if config.quantization.startswith("w8a8") and config.has_mtp:  # quantize_draft_head's int8 copy
        head = model.head.weight
        by = sums.setdefault("embedding and head", {})
        by["int8 draft head"] = head.shape[0] * (head.shape[1] + 4)
    del model
    order = [k for k, _ in KINDS] + ["other (norms, router, mHC, MTP)"]
    return [Part(f"weights: {k}", sum(sums[k].values()),
                 ", ".join(f"{f} {_gib(b).strip()}" for f, b in sorted(sums[k].items(), key=lambda kv: -kv[1])))
            for k in order if k in sums]


def state_parts(config: Any) -> list[Part]:
    """The block pool, the slots' rings, the prefix cache's saved rings at most."""
    from dsv4.model.state import ModelState

    K = config.num_speculative_tokens
    slots = config.max_num_seqs + (1 if config.compile is not False else 0)
    st = ModelState(config.model_config, slots, config.max_model_len + K + 1, max_chunk=max(config.effective_chunk_size, K) + 1,
                    max_spec=K + 1, with_mtp=config.has_mtp, device="meta", dtype=config.torch_dtype, num_blocks=1,
                    block_size=config.block_size)
    rings = st.ring_bytes_per_slot() * slots
    saved = max(16, min(1024, config.kv_cache_memory // 8 // max(1, st.saved_bytes()))) * st.saved_bytes()
    return [Part("state: block pool", config.kv_cache_memory,
                 f"{config.kv_cache_blocks} blocks of {config.block_size} positions (--kv-cache-memory)"),
            Part("state: rings", rings, f"{slots} slots: window, compressor carry"),
            Part("state: saved rings", saved if config.enable_prefix_caching else 0, "prefix cache, at most")]


def activation_bytes(config: Any) -> int:
    """An estimate of one step's working memory at the token budget: the hyper-connection
    streams and the attention, MoE and logits intermediates of its tokens (float32)."""
    mc, T = config.model_config, config.max_num_batched_tokens
    rows = config.max_num_seqs * (1 + config.num_speculative_tokens)  # rows sampled at most
    stream = 4 * mc.hc_mult * mc.hidden_size * 4  # a few live copies of [T, hc, D]
    attn = mc.num_attention_heads * (3 * mc.head_dim + mc.sliding_window + mc.index_topk) * 4
    moe = mc.num_experts_per_tok * 3 * mc.moe_intermediate_size * 4
    index = mc.index_n_heads * (mc.index_head_dim + mc.index_topk) * 4
    return T * (stream + attn + moe + index) // max(1, config.tensor_parallel_size) + 2 * rows * mc.vocab_size * 4


def memory_plan(config: Any, available: int | None = None) -> MemoryPlan:
    """The plan of a built `EngineConfig`; `available` (bytes) replaces this machine's."""
    parts = weight_parts(config) + state_parts(config)
    parts.append(Part("activations (estimate)", activation_bytes(config),
                      f"one step of {config.max_num_batched_tokens} tokens (--max-num-batched-tokens)"))
    replicas, T = config.replicas_here, config.tensor_parallel_size  # this host's replicas: each all its parts
    plan = MemoryPlan(parts, ranks_here=T // max(1, config.nnodes) * replicas, quantization=config.quantization,
                      here="engines" if replicas > 1 and T == 1 else "ranks")
    if available is not None:
        plan.available = available
    elif config.device == "cpu":
        plan.available, plan.total_memory = available_memory(), machine_memory("cpu")
    else:
        plan.available = machine_memory(config.device)
    weights = sum(p.bytes for p in parts if p.what.startswith("weights"))
    if config.compile is True:  # --compile: missing buckets are captured in this process, before serving
        plan.parts.append(Part(COMPILE_BUILD, int(COMPILE_BUILD_COPIES * weights),
                               "--compile builds missing buckets in this process: a second copy of the weights"))
    if config.compile == "auto" and replicas == 1:  # replicas build nothing (each loads what is cached)
        plan.notes.append(f"note: serve builds missing compiled steps in a second process that loads its own "
                          f"copy of the weights ({_gib(weights).strip()}), only when that much is free")
    return plan


COMPILE_BUILD = "compile build (peak)"
# A capture (export, then AOTInductor) holds one more copy of the weights (measured:
# docs/compile.md, 'Memory'). Counted as one copy, so a --compile that will not fit is refused
# before anything loads instead of meeting the OOM killer halfway through its build.
COMPILE_BUILD_COPIES = 1.0


def _others(config: Any, order: tuple[str, ...], available: int | None):
    """(config with --quantization q, its plan) for each q of `order` but config's own that this
    checkpoint takes (a format it cannot take is skipped)."""
    for q in order:
        if q == config.quantization:
            continue
        try:
            other = dataclasses.replace(config, quantization=q)
            yield other, memory_plan(other, available=available)
        except Exception:  # noqa: BLE001  (EngineConfigError, or a format the meta model cannot build)
            continue


def fit(config: Any, available: int | None = None) -> tuple[Any, str, MemoryPlan]:
    """`fit_default`, with the plan of the config it returns (for `check`, so it is not built again)."""
    plan = memory_plan(config, available)
    if not plan.fits():
        for other, other_plan in _others(config, DEFAULT_ORDER, plan.available):
            if other_plan.fits():
                return other, (f"--quantization {other.quantization} chosen: as {config.quantization} the model "
                               f"needs {_gib(plan.host_bytes).strip()}, over the {_gib(plan.available or 0).strip()} "
                               f"available (give --quantization to choose)"), other_plan
    return config, "", plan


def fit_default(config: Any, available: int | None = None) -> tuple[Any, str]:
    """For a config built without --quantization: itself when its plan fits, else the first of
    DEFAULT_ORDER this checkpoint takes whose plan fits, with a line saying why (else itself,
    which `check` then refuses with the figures). `available` replaces this machine's memory.
    Returns (config, note or "")."""
    return fit(config, available)[:2]


def settle(config: Any, quantization_given: bool) -> tuple[Any, str]:
    """The config every entry point loads (the CLI's `build_config`, `LLM`): without a given
    quantization the formats that fit (`fit`), then `check` (EngineConfigError, with the
    figures and the flags, when it does not fit), before any weight loads. Returns
    (config, the note saying what was chosen and why, or "")."""
    note, plan = "", None
    if not quantization_given:
        config, note, plan = fit(config)
    check(config, plan)
    return config, note


def check(config: Any, plan: MemoryPlan | None = None) -> MemoryPlan:
    """`memory_plan(config)` (or `plan`, already built for it), or EngineConfigError when it does
    not fit: the figures, and the --quantization values, --max-model-len or --max-num-seqs that would."""
    plan = plan or memory_plan(config)
    if plan.fits():
        return plan
    need, have = plan.host_bytes, plan.available or 0
    big = sorted(plan.parts, key=lambda p: -p.bytes)[:3]
    hints = [f"--quantization {other.quantization} ({_gib(p.host_bytes).strip()})"
             for other, p in _others(config, ALTERNATIVES, have) if p.fits()]
    if any(p.what == COMPILE_BUILD for p in plan.parts):
        auto = memory_plan(dataclasses.replace(config, compile="auto"), available=have)
        if auto.fits():
            hints.insert(0, f"--compile auto, the default: cached buckets only, the others built in the "
                            f"background when memory is free ({_gib(auto.host_bytes).strip()})")
    hints.append("a smaller --max-model-len, --max-num-seqs or --kv-cache-memory")
    raise EngineConfigError(
        f"--model {config.model} needs {_gib(need).strip()} as {config.quantization} ("
        + ", ".join(f"{p.what} {_gib(p.bytes).strip()}" for p in big)
        + f"), over the {_gib(have).strip()} available; it would fit with " + " or ".join(hints)
        + " ('dsv4 plan' shows every part)")
