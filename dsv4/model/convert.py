"""`dsv4 convert SRC DST --quantization w8a8`: write a checkpoint that loads with no conversion work.

Streams SRC tensor by tensor (as `load_model` does) and writes DST as sharded safetensors
plus `model.safetensors.index.json`: the int8 linears of `w8a8.py` as ``X.weight`` I8 [out,
in] + ``X.scale`` F32 [out], every other tensor as stored in SRC (FP8/FP4 ones dequantised
to bfloat16); config.json gets ``"dsv4_quantization": "w8a8"``, so loading DST needs no
flag. The shards are laid out before anything converts (`_layout`, `_header`): each group
the model fuses (`fused_groups`) lies back to back in one shard, so the loader maps it as
the fused tensor instead of copying (`loader._fused_source`); each tensor is written at its
offset as it converts. SRC's other top-level files are copied, with their modes. Loading DST gives
bit-identical weights (and logits) to converting SRC at load time. The conversion is atomic
(a hidden directory beside DST, renamed once complete), checks SRC as `load_model` does,
and reports any write error in one line naming DST. Details: docs/quantization.md,
'dsv4/model/convert.py'.
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ModelConfig
from .checkpoint import (CONFIG_NAME, INDEX_NAME, QUANTIZATION_KEY, Checkpoint, CheckpointError, check_tid2eid,
                         dequantize, scale_name, validate_tensor)
from .model import DeepseekV4
from .w8a8 import QuantLinear, RowCounts, rows_into, to_w8a8

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
        counts = _write(ck, src, work, model, quantized, cfg.n_routed_experts, shard_bytes, progress)
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


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.int64: "I64", torch.float32: "F32", torch.int32: "I32",
                      torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
_TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def fused_groups(model: DeepseekV4) -> list[list[str]]:
    """The groups of tensors the loader maps as one fused tensor when a file stores them back
    to back in this order (`DeepseekV4.fuse_projections`' source asks for exactly these)."""
    groups: list[list[str]] = []

    def record(names: list[str], dtype: torch.dtype, numel: int) -> None:
        groups.append(list(names))

    model.fuse_projections(copy=False, source=record)  # on the meta device: nothing is allocated
    return groups


def _outputs(ck: Checkpoint, model: DeepseekV4, quantized: set[str]) -> dict[str, tuple[torch.dtype, tuple]]:
    """What DST will hold, in SRC's order: name -> (dtype, shape)."""
    sd = model.state_dict()
    out: dict[str, tuple[torch.dtype, tuple]] = {}
    for name, kind in ck.plan.items():
        if name in quantized:
            out[name] = (torch.int8, tuple(sd[name].shape))
            out[scale_name(name)] = (torch.float32, tuple(sd[name].shape[:1]))
        elif kind in ("fp8", "fp4"):
            out[name] = (torch.bfloat16, tuple(sd[name].shape))
        else:
            out[name] = (_TORCH_DTYPES[ck.entries[name].dtype], tuple(ck.entries[name].shape))
    return out



def _layout(outputs: dict[str, tuple[torch.dtype, tuple]], groups: list[list[str]], shard_bytes: int
            ) -> list[list[list[str]]]:
    """Shards of groups: every fused group whole and in its order within one shard (a shard may
    outgrow `shard_bytes` to hold one), every other tensor a group of its own; in SRC's order."""
    nbytes = lambda n: outputs[n][0].itemsize * math.prod(outputs[n][1])  # noqa: E731
    owner = {n: tuple(g) for g in groups if all(m in outputs for m in g) for n in g}
    shards: list[list[list[str]]] = [[]]
    size, seen = 0, set()
    for name in outputs:
        g = list(owner.get(name, (name,)))
        if g[0] in seen:
            continue
        seen.add(g[0])
        b = sum(nbytes(n) for n in g)
        if size and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += b
    return [s for s in shards if s]


def _header(outputs: dict[str, tuple[torch.dtype, tuple]], shard: list[list[str]]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for `shard` and each tensor's byte offset in the data: the groups
    by element size, largest first (every tensor stays aligned), each group's members back to back."""
    order = sorted(shard, key=lambda g: -outputs[g[0]][0].itemsize)  # stable: SRC's order within a size
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, at = {}, 0
    for g in order:
        for n in g:
            dtype, shape = outputs[n]
            end = at + dtype.itemsize * math.prod(shape)
            header[n] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, end]}
            offsets[n], at = at, end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def _write(ck: Checkpoint, src: Path, dst: Path, model: DeepseekV4, quantized: set[str], n_experts: int,
           shard_bytes: int, progress: Callable[[int, int], None] | None) -> RowCounts:
    """Convert and write every file of the checkpoint into the (new, empty) directory `dst`:
    shards laid out first (`_layout`, `_header`), each tensor written at its place as it converts."""
    counts, total = RowCounts(), 0
    outputs = _outputs(ck, model, quantized)
    shards = _layout(outputs, fused_groups(model), shard_bytes)
    final = [f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors" for j in range(len(shards))]
    where: dict[str, tuple[int, int]] = {}  # name -> (shard, absolute file offset)
    fds = []
    try:
        for j, shard in enumerate(shards):
            head, offsets = _header(outputs, shard)
            fd = os.open(dst / final[j], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            fds.append(fd)
            os.write(fd, head)
            where.update({n: (j, len(head) + off) for n, off in offsets.items()})
        with torch.no_grad():
            for i, (name, kind, raw, scale) in enumerate(ck.tensors("cpu")):
                if name in quantized:
                    q = torch.empty(outputs[name][1], dtype=torch.int8)
                    s = torch.empty(outputs[scale_name(name)][1], dtype=torch.float32)
                    rows_into(kind, raw, scale, q, s, counts)
                    pieces = {name: q, scale_name(name): s}
                elif kind in ("fp8", "fp4"):
                    pieces = {name: dequantize(kind, raw, scale, torch.bfloat16)}
                else:
                    pieces = {name: raw.contiguous()}
                # what load_model would refuse: NaN/inf (an int8 linear's row scales carry its weight's), bad expert ids
                validate_tensor(name, ck.entries[name].file, pieces.get(scale_name(name), pieces[name]))
                check_tid2eid(pieces, n_experts)
                for k, t in pieces.items():
                    if (t.dtype, tuple(t.shape)) != outputs[k]:
                        raise CheckpointError(f"tensor {k!r} converted to {t.dtype} {tuple(t.shape)}, where "
                                              f"{outputs[k][0]} {outputs[k][1]} was laid out")
                    j, off = where[k]
                    _pwrite_all(fds[j], t.reshape(-1).view(torch.uint8).numpy(), off)
                    total += t.numel() * t.element_size()
                if progress is not None:
                    progress(i + 1, len(ck.plan))
    finally:
        for fd in fds:
            os.close(fd)
    weight_map = {n: final[where[n][0]] for n in outputs}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = dict(ck.config)
    config.pop("quantization_config", None)
    config.pop("expert_dtype", None)
    config[QUANTIZATION_KEY] = "w8a8"
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    _copy_mode(src / CONFIG_NAME, [dst / CONFIG_NAME])
    _copy_mode(next(src.glob("*.safetensors")), [dst / INDEX_NAME, *(dst / n for n in final)])
    copy_other_files(src, dst)
    return counts


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of `data` (a buffer) at `offset` of `fd`."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


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
