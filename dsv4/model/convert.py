"""`dsv4 convert SRC DST --quantization w8a8`: write a checkpoint that loads with no conversion work.

Streams SRC tensor by tensor (as `load_model` does) and writes DST as sharded safetensors
plus `model.safetensors.index.json`: the int8 linears of `w8a8.py` as ``X.weight`` I8 [out,
in] + ``X.scale`` F32 [out], every other tensor as stored in SRC (FP8/FP4 ones dequantised
to bfloat16); config.json gets ``"dsv4_quantization": "w8a8"``, so loading DST needs no
flag. SRC's other top-level files are copied, with their modes. Loading DST gives
bit-identical weights (and logits) to converting SRC at load time. The conversion is atomic
(a hidden directory beside DST, renamed once complete), checks SRC as `load_model` does,
and reports any write error in one line naming DST. Details: docs/quantization.md,
'dsv4/model/convert.py'.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from .checkpoint import (CONFIG_NAME, INDEX_NAME, QUANTIZATION_KEY, Checkpoint, CheckpointError, check_tid2eid,
                         dequantize, scale_name, validate_tensor)
from .model import DeepseekV4
from .w8a8 import QuantLinear, RowCounts, from_float, from_fp4, to_w8a8

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")  # never copied: DST has its own weights


def convert_checkpoint(src: str | Path, dst: str | Path, *, quantization: str = "w8a8",
                       shard_bytes: int = 4 << 30, progress: Callable[[int, int], None] | None = None
                       ) -> RowCounts:
    """Convert SRC to DST (see the module docstring); returns how the FP4 rows converted.
    Raises `CheckpointError` (one line) for unusable input (before writing anything, or
    for a corrupt tensor when it is read) and for a write that fails; DST is then untouched."""
    if quantization != "w8a8":
        raise CheckpointError(f"--quantization {quantization!r}: convert writes w8a8 checkpoints only "
                              f"(use --quantization w8a8)")
    src, dst = Path(src), Path(dst)
    ck = Checkpoint(src)
    if ck.quantization != "none":
        raise CheckpointError(f"{src} is already a {ck.quantization} conversion; convert the original checkpoint")
    if dst.is_symlink() or dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"output directory {dst} exists and is not empty; choose a new directory")
    cfg = ModelConfig.from_dir(src)
    with torch.device("meta"):
        model = to_w8a8(DeepseekV4(cfg, with_mtp=any(k.startswith("mtp.0.") for k in ck.shapes)))
    quantized = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    from .checkpoint import check_tensors
    from .loader import _produced_shapes

    check_tensors(_produced_shapes(ck, model), {k: tuple(v.shape) for k, v in model.state_dict().items()})

    work = _work_dir(dst)
    try:
        counts = _write(ck, src, work, quantized, cfg.n_routed_experts, shard_bytes, progress)
        try:
            work.rename(dst)  # replaces an empty DST
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):  # DST appeared meanwhile
                raise CheckpointError(f"output directory {dst} exists and is not empty; choose a new directory") from None
            raise
    except OSError as e:
        shutil.rmtree(work, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointError(f"{dst}: no space left on the device while writing the converted checkpoint "
                                  f"(nothing was kept; free space there or choose another directory)") from None
        raise CheckpointError(f"{dst}: cannot write the converted checkpoint: {e.strerror or e}"
                              + (f" ({e.filename})" if e.filename else "")) from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return counts


def _work_dir(dst: Path) -> Path:
    """A new, empty hidden directory beside `dst` (its mode from the umask, as `mkdir`'s)."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            work = dst.parent / f".{dst.name}.dsv4-convert-{secrets.token_hex(4)}"
            try:
                work.mkdir(0o777)
                return work
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(dst.parent))
    except OSError as e:
        raise CheckpointError(f"{dst}: cannot create a directory beside it: {e.strerror or e}") from None


def _save(shard: dict[str, torch.Tensor], path: Path) -> None:
    """`save_file`, its I/O errors (a SafetensorError "... (os error N)") as `OSError`."""
    try:
        save_file(shard, str(path), metadata={"format": "pt"})
    except Exception as e:  # noqa: BLE001  (safetensors has its own exception type)
        m = re.search(r"os error (\d+)", str(e))
        if isinstance(e, OSError) or m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def _write(ck: Checkpoint, src: Path, dst: Path, quantized: set[str], n_experts: int, shard_bytes: int,
           progress: Callable[[int, int], None] | None) -> RowCounts:
    """Convert and write every file of the checkpoint into the (new, empty) directory `dst`."""
    counts, shard, size, names, weight_map, total = RowCounts(), {}, 0, [], {}, 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            fname = f"model-{len(names) + 1:05d}.safetensors"  # renamed to -of-N once N is known
            _save(shard, dst / fname)
            names.append(fname)
            weight_map.update({k: fname for k in shard})
            shard, size = {}, 0

    with torch.no_grad():
        for i, (name, kind, raw, scale) in enumerate(ck.tensors("cpu")):
            if name in quantized:
                if kind == "fp4":
                    out = from_fp4(raw, scale, counts)
                elif kind == "fp8":
                    out = from_float(dequantize(kind, raw, scale, torch.float32), scratch=True)
                else:
                    out = from_float(raw.float())
                pieces = {name: out[0].contiguous(), scale_name(name): out[1].contiguous()}
            elif kind in ("fp8", "fp4"):
                pieces = {name: dequantize(kind, raw, scale, torch.bfloat16)}
            else:
                pieces = {name: raw.contiguous()}
            # what load_model would refuse: NaN/inf (an int8 linear's row scales carry its weight's), bad expert ids
            validate_tensor(name, ck.entries[name].file, pieces.get(scale_name(name), pieces[name]))
            check_tid2eid(pieces, n_experts)
            for k, t in pieces.items():
                shard[k] = t
                size += t.numel() * t.element_size()
                total += t.numel() * t.element_size()
            if size >= shard_bytes:
                flush()
            if progress is not None:
                progress(i + 1, len(ck.plan))
        flush()
    final = {n: f"model-{j + 1:05d}-of-{len(names):05d}.safetensors" for j, n in enumerate(names)}
    for old, new in final.items():
        (dst / old).rename(dst / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = dict(ck.config)
    config.pop("quantization_config", None)
    config.pop("expert_dtype", None)
    config[QUANTIZATION_KEY] = "w8a8"
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    _copy_mode(src / CONFIG_NAME, [dst / CONFIG_NAME])
    _copy_mode(next(src.glob("*.safetensors")), [dst / INDEX_NAME, *(dst / n for n in final.values())])
    copy_other_files(src, dst)
    return counts


def copy_other_files(src: Path, dst: Path) -> list[str]:
    """Copy SRC's top-level files that are not weights, an index or config.json into DST,
    each with its mode (symbolic links are followed); returns their names."""
    names = []
    for f in sorted(src.iterdir()):
        if (f.name.startswith(".") or f.name in (CONFIG_NAME, INDEX_NAME) or f.name.endswith(WEIGHT_SUFFIXES)
                or not f.is_file()):
            continue
        shutil.copy(f, dst / f.name)  # contents and mode bits
        names.append(f.name)
    return names


def _copy_mode(like: Path, paths: list[Path]) -> None:
    mode = like.stat().st_mode & 0o777
    for p in paths:
        p.chmod(mode)
