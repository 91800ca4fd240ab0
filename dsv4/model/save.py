"""Write DeepSeek V4 checkpoints (safetensors) in the official layout (read by `checkpoint`).

``save_checkpoint`` takes dequantised tensors keyed by official name and writes
``config.json`` plus one or more safetensors shards (with an index when sharded),
optionally quantising the FP8/FP4 tensors of ``checkpoint.official_storage``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from . import quant
from .checkpoint import CONFIG_NAME, INDEX_NAME, QUANTIZATION_CONFIG, SINGLE_NAME, PathLike, official_storage, scale_name
from .quant import fp4_scale_shape, fp8_scale_shape

def _stored_nbytes(t: torch.Tensor, fmt: str, dtype: torch.dtype) -> int:
    """Bytes a tensor (plus its scale) takes on disk in storage format ``fmt``."""
    n = t.numel()
    if fmt == "fp8":
        rows, cols = fp8_scale_shape(*t.shape)
        return n + rows * cols
    if fmt == "fp4":
        return n // 2 + t.shape[0] * fp4_scale_shape(t.shape[0], t.shape[1] // 2)[1]
    if fmt == "f32":
        return 4 * n
    if fmt == "i64" or not t.is_floating_point():
        return 8 * n
    return n * dtype.itemsize


def _storage(name: str, t: torch.Tensor, quantize: bool) -> str:
    fmt = official_storage(name)
    if fmt in ("fp8", "fp4") and not (quantize and t.dim() == 2):
        return "float"
    return fmt


def _convert(name: str, t: torch.Tensor, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One input tensor -> the tensor(s) stored for it (weight and maybe its scale), on CPU."""
    t = t.detach().cpu()
    if fmt in ("fp8", "fp4"):
        q, s = (quant.quantize_fp8 if fmt == "fp8" else quant.quantize_fp4)(t)
        return {name: q, scale_name(name): s}
    if fmt == "i64" or not t.is_floating_point():
        out = t.to(torch.int64)
    else:
        out = t.to(torch.float32 if fmt == "f32" else dtype)
    if out.data_ptr() == t.data_ptr():
        out = out.clone()  # never let two saved tensors share storage
    return {name: out.contiguous()}


def save_checkpoint(out_dir: PathLike, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], *,
                    quantize: bool = False, dtype: torch.dtype = torch.bfloat16, num_shards: int = 1) -> None:
    """Write ``config.json`` and safetensors in the official layout.

    ``tensors`` are unquantised (float/int) tensors keyed by official name. With
    ``quantize`` the FP8/FP4 tensors of ``official_storage`` are quantised (2-D weights
    only) and the config gets ``quantization_config`` and ``expert_dtype``. Other float
    tensors are stored as ``dtype`` (F32 ones stay F32). ``num_shards > 1`` writes
    ``model-0000i-of-0000N.safetensors`` of roughly equal size plus the index; a weight
    always shares its shard with its scale. Stale model files in ``out_dir`` are removed.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    bad = [n for n in tensors if n.endswith(".scale")]
    if bad:
        raise ValueError(f"save_checkpoint expects dequantised tensors, got scale tensor {bad[0]!r}")
    fmts = {n: _storage(n, t, quantize) for n, t in tensors.items()}
    sizes = {n: _stored_nbytes(t, fmts[n], dtype) for n, t in tensors.items()}
    total = sum(sizes.values())

    # Contiguous split by cumulative size: a tensor goes to the shard holding its midpoint.
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    done = 0
    for n in tensors:
        shards[min(num_shards - 1, int((done + sizes[n] / 2) * num_shards / max(total, 1)))].append(n)
        done += sizes[n]
    shards = [s for s in shards if s] or [[]]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model-*-of-*.safetensors"), out / SINGLE_NAME, out / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    cfg = dict(config)
    if quantize:
        cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
        cfg["expert_dtype"] = "fp4"
    else:
        cfg.pop("quantization_config", None)
        cfg.pop("expert_dtype", None)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")

    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        fname = SINGLE_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data: dict[str, torch.Tensor] = {}
        for n in names:
            data.update(_convert(n, tensors[n], fmts[n], dtype))
        save_file(data, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod((out / CONFIG_NAME).stat().st_mode & 0o777)  # as config.json, not safetensors' 0600
        weight_map.update({k: fname for k in data})
        del data
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
