"""Read and write DeepSeek V4 checkpoints (safetensors) in the official layout.

Everything works on flat dicts of tensors keyed by the official names (no prefix), e.g.
``embed.weight``, ``layers.3.attn.wq_a.weight`` (+ ``.scale``), ``layers.0.ffn.gate.tid2eid``.
On disk as DeepSeek publishes V4: FP8 tensors with one E8M0 scale per 128x128 block, FP4
routed experts (two e2m1 per byte) with one per 1x32, a few F32 / I64 tensors, everything
else BF16 (docs/quantization.md, "Formats on disk").

``read_checkpoint`` returns dequantised tensors (scales consumed); ``save.save_checkpoint``
writes the same layout, optionally quantised and sharded with an index. Every problem with
the files on disk is a one-line ``CheckpointError``, corrupt data too as far as one cheap
pass can tell (``validate_tensor``: non-finite floats; ``check_tid2eid``: hash-routing ids
out of range). Details: docs/quantization.md, 'dsv4/model/checkpoint.py'.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
import safetensors

from ..safetensors_header import read_header
from . import quant
from .quant import dequantize_fp4, dequantize_fp8, fp4_scale_shape, fp8_scale_shape

PathLike = Union[str, Path]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
QUANTIZATION_KEY = "dsv4_quantization"  # config.json key a `dsv4 convert` output records its format in
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
    "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
}

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_INT_DTYPES = {"I32", "I64"}
_SCALE_DTYPES = {"F8_E8M0", "U8"}  # U8: exponent bytes written by torch without float8_e8m0fnu
_QUANT_DTYPES = {"F8_E4M3": "fp8", "I8": "fp4"}  # with an E8M0 .scale; I8 + F32 [rows] .scale: int8 rows

_PREFIX = r"(?:layers|mtp)\.\d+\."
_FP8_RE = re.compile(_PREFIX + r"(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                     r"|ffn\.shared_experts\.w[123]|[eh]_proj)\.weight")
_FP4_RE = re.compile(_PREFIX + r"ffn\.experts\.\d+\.w[123]\.weight")
_ROUTED_WEIGHT = _FP4_RE  # the routed experts' weights (stored FP4 in the official layout)
_F32_RE = re.compile(r"(?:.*\.)?hc_\w+|.*\.attn\.attn_sink|.*\.compressor\.ape|.*\.ffn\.gate\.bias")
_I64_RE = re.compile(r".*\.ffn\.gate\.tid2eid")


class CheckpointError(Exception):
    """A checkpoint on disk (or its tensor set) is unusable; the message says why, in one line."""


def official_storage(name: str) -> str:
    """Storage format of a tensor in the official checkpoint: "fp8"|"fp4"|"f32"|"i64"|"float"."""
    if _FP8_RE.fullmatch(name):
        return "fp8"
    if _FP4_RE.fullmatch(name):
        return "fp4"
    if _F32_RE.fullmatch(name):
        return "f32"
    if _I64_RE.fullmatch(name):
        return "i64"
    return "float"


def scale_name(weight_name: str) -> str:
    """``a.b.weight`` -> ``a.b.scale`` (the official pairing of a quantised weight and its scales)."""
    return weight_name.removesuffix(".weight") + ".scale"


# ============================================================================ reading
@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]


class Checkpoint:
    """A checkpoint directory whose headers have been read and checked (no tensor data yet).

    `config` (config.json), `shapes` (name -> shape of each tensor `tensors()` yields: FP8
    and FP4 weights at their dequantised shape, E8M0 scales folded in), `quantization`
    ("none", or "w8a8" for a `dsv4 convert` output). Raises `CheckpointError`."""

    def __init__(self, path: PathLike):
        self.root = Path(path)
        self.config = _read_config(self.root)
        self.entries = _scan(_shard_files(self.root))
        self.plan = _plan(self.entries)  # name -> "plain"|"fp8"|"fp4"|"int8"
        self.shapes = {n: _out_shape(k, self.entries[n].shape) for n, k in self.plan.items()}
        self.quantization = str(self.config.get(QUANTIZATION_KEY, "none"))

    def tensors(self, device: Union[str, torch.device] = "cpu", layout: Any = None,
                skip: frozenset[str] = frozenset()
                ) -> Iterator[tuple[str, str, torch.Tensor, Optional[torch.Tensor]]]:
        """(name, kind, stored tensor, E8M0 scale for "fp8"/"fp4" else None), one at a time,
        shard by shard, memory mapped: nothing is kept after the caller lets go of it.

        With a `sharding.Layout`, only the tensors the rank holds, each read as its slice
        (`get_slice`): an FP8 weight with the rows/columns of its 128x128 block scales; a
        slice that cuts through blocks reads the covering blocks and comes back dequantised
        and trimmed, as kind "plain" float32."""
        for file in sorted({e.file for e in self.entries.values()}):
            names = [n for n, e in self.entries.items() if e.file == file and n in self.plan
                     and n not in skip and (layout is None or layout.holds(n))]
            if not names:  # every tensor of this shard mapped or not this rank's: its header is not read again
                continue
            with _open(file) as f:
                for name in names:
                    kind = self.plan[name]
                    shard = layout.shard(name) if layout is not None else None
                    entry = self.entries[name]
                    part = shard.bounds(entry.shape[shard.dim]) if shard is not None else None
                    dim = shard.dim if shard is not None else 0
                    if kind == "fp8" and part is not None:  # whole 128-blocks around the slice
                        a, b = part
                        blk = quant.FP8_BLOCK
                        part = (a // blk * blk, min(-(-b // blk) * blk, entry.shape[dim]))
                    raw = _get(f, file, name, entry.dtype, dim, part).to(device)
                    scale = None
                    if kind in ("fp8", "fp4"):
                        sname = scale_name(name)
                        se = self.entries[sname]
                        spart = (part[0] // quant.FP8_BLOCK, -(-part[1] // quant.FP8_BLOCK)) if part else None
                        if se.file == file:
                            scale = _get(f, file, sname, se.dtype, dim, spart)
                        else:
                            with _open(se.file) as g:
                                scale = _get(g, se.file, sname, se.dtype, dim, spart)
                        scale = scale.to(device)
                    if kind == "fp8" and shard is not None and part != shard.bounds(entry.shape[dim]):
                        a, b = shard.bounds(entry.shape[dim])
                        raw = dequantize(kind, raw, scale, torch.float32).narrow(dim, a - part[0], b - a)
                        kind, scale = "plain", None
                    yield name, kind, raw, scale
                    del raw, scale


def _out_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], 2 * shape[1]) if kind == "fp4" else shape


def dequantize(kind: str, raw: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A stored FP8 or FP4 weight and its E8M0 scale -> [R, C] in ``dtype`` (exact)."""
    return (dequantize_fp8 if kind == "fp8" else dequantize_fp4)(raw, scale, dtype)


def read_checkpoint(path: PathLike, *, dtype: torch.dtype = torch.float32,
                    device: Union[str, torch.device] = "cpu", keep_f32: bool = False,
                    progress: Optional[Callable[[int, int], None]] = None
                    ) -> tuple[dict[str, torch.Tensor], dict]:
    """Load a checkpoint directory: (dequantised tensors keyed by official name, config.json).

    Float tensors are cast to ``dtype`` (with ``keep_f32``, those the official layout keeps
    in float32 -- mHC, sinks, ``ape``, router bias -- stay float32); FP8/FP4 weights are
    dequantised to ``dtype`` (their ``.scale`` tensors are consumed), as are the int8 rows
    of a w8a8 conversion (weight * row scale); I32/I64 tensors come back as int64. Files
    are memory mapped and converted tensor by tensor, shard by shard. All headers are
    checked before any data is read. ``progress(done, total)`` is called per tensor.
    Raises ``CheckpointError``. (`load_model` streams into the model instead.)
    """
    if not dtype.is_floating_point:
        raise ValueError(f"read_checkpoint dtype must be a floating dtype, got {dtype}")
    ck = Checkpoint(path)
    out: dict[str, torch.Tensor] = {}
    for name, kind, raw, scale in ck.tensors(device):
        if progress is not None:
            progress(len(out) + 1, len(ck.plan))
        if kind == "plain":
            if not raw.is_floating_point():
                out[name] = raw.to(torch.int64)
            else:
                validate_tensor(name, ck.entries[name].file, raw)
                keep = keep_f32 and official_storage(name) == "f32"
                out[name] = raw.to(torch.float32 if keep else dtype)
        elif kind == "int8":
            out[name] = raw
        else:
            out[name] = dequantize(kind, raw, scale, dtype)
            validate_tensor(name, ck.entries[name].file, out[name])
    for name, kind in ck.plan.items():
        if kind == "int8":
            sname = scale_name(name)
            out[name] = (out[name].float() * out.pop(sname).float()[:, None]).to(dtype)
    return out, ck.config


def _read_config(root: Path) -> dict:
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist or is not a directory")
    cfg = root / CONFIG_NAME
    if not cfg.is_file():
        raise CheckpointError(f"no {CONFIG_NAME} in checkpoint directory {root}")
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot parse {cfg}: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg} must hold a JSON object")
    return config


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file name map (CheckpointError when unreadable)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"cannot parse {index} (need a 'weight_map' object): {e!r}") from None
    return weight_map


def _shard_files(root: Path) -> dict[Path, Optional[set[str]]]:
    """Shard files to read -> tensor names the index places there (None without an index)."""
    index = root / INDEX_NAME
    if index.is_file():
        weight_map = _weight_map(index)
        files: dict[Path, Optional[set[str]]] = {}
        for name, fname in weight_map.items():
            files.setdefault(root / fname, set()).add(name)  # type: ignore[union-attr]
        for file, names in sorted(files.items()):
            if not file.is_file():
                raise CheckpointError(f"{index.name} references missing shard file {file.name} "
                                      f"({len(names or ())} tensors, e.g. {min(names or ['?'])!r}) in {root}")
        return files
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no *.safetensors files (and no {INDEX_NAME}) in {root}")
    return {f: None for f in found}


def tensor_names(root: Path) -> set[str]:
    """Every tensor name of the checkpoint in `root`, from its index (the shards are not
    opened) or else from the safetensors headers (no tensor data is read; no files: none);
    CheckpointError when the index or a header is unreadable."""
    if (root / INDEX_NAME).is_file():
        return set(_weight_map(root / INDEX_NAME))
    names: set[str] = set()
    for file in sorted(root.glob("*.safetensors")):
        with _open(file) as f:
            names.update(f.keys())
    return names


def _open(file: Path) -> Any:
    """`safetensors.safe_open` (memory mapped; looked up at call time, so tests can watch it),
    with header/size corruption reported as CheckpointError."""
    try:
        return safetensors.safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError, ...: the file itself is unusable
        raise CheckpointError(f"corrupt or unreadable safetensors file {file}: {e}") from None


def _scan(files: Mapping[Path, Optional[set[str]]]) -> dict[str, _Entry]:
    """Read every shard header: name -> (file, dtype, shape); check it against the index."""
    entries: dict[str, _Entry] = {}
    for file, indexed in files.items():
        with _open(file) as f:
            keys = list(f.keys())
            for name in keys:
                if name in entries:
                    raise CheckpointError(f"tensor {name!r} appears in both {entries[name].file.name} "
                                          f"and {file.name}")
                sl = f.get_slice(name)
                entries[name] = _Entry(file, str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
        if indexed is not None and not indexed <= set(keys):
            missing = sorted(indexed - set(keys))
            raise CheckpointError(f"{INDEX_NAME} places {missing[0]!r} in {file.name}, but that file "
                                  f"does not contain it ({len(missing)} such tensors); re-download it")
    return entries


def _plan(entries: Mapping[str, _Entry]) -> dict[str, str]:
    """Validate dtypes and weight/scale pairs; name -> "plain"|"fp8"|"fp4"|"int8" (E8M0 scales
    omitted; the float32 row scales of "int8" weights are "plain" tensors of their own)."""
    plan: dict[str, str] = {}
    scales: set[str] = set()
    for name, e in entries.items():
        sname = scale_name(name)
        se = entries.get(sname)
        if e.dtype == "I8" and se is not None and se.dtype == "F32":  # a dsv4 w8a8 conversion
            if len(e.shape) != 2 or se.shape != e.shape[:1]:
                raise CheckpointError(f"int8 weight {name!r} {list(e.shape)} needs a float32 scale {sname!r} of "
                                      f"shape [{e.shape[0] if e.shape else '?'}] (one per row), found "
                                      f"{list(se.shape)}")
            plan[name], plan[sname] = "int8", "plain"
            continue
        if e.dtype in _QUANT_DTYPES:
            kind = _QUANT_DTYPES[e.dtype]
            if se is None:
                raise CheckpointError(f"quantised weight {name!r} ({e.dtype}) has no scale tensor "
                                      f"{sname!r}; the checkpoint is incomplete")
            if se.dtype not in _SCALE_DTYPES:
                raise CheckpointError(f"unsupported dtype {se.dtype} for scale tensor {sname!r} "
                                      f"(expected F8_E8M0)")
            if len(e.shape) != 2:
                raise CheckpointError(f"quantised weight {name!r} must be 2-D, found shape {list(e.shape)}")
            want = fp8_scale_shape(*e.shape) if kind == "fp8" else fp4_scale_shape(*e.shape)
            if se.shape != want:
                raise CheckpointError(f"scale {sname!r} has the wrong shape for {kind} weight {name!r} "
                                      f"{list(e.shape)}: expected {list(want)}, found {list(se.shape)}")
            plan[name] = kind
            scales.add(sname)
        elif (e.dtype in _FLOAT_DTYPES or e.dtype in _INT_DTYPES) and name not in plan:
            plan[name] = "plain"
    for name, e in entries.items():
        if name in plan or name in scales:
            continue
        if e.dtype == "F8_E8M0":
            raise CheckpointError(f"scale tensor {name!r} has no quantised weight "
                                  f"{name.removesuffix('.scale') + '.weight'!r} (F8_E4M3 or I8) to apply to")
        raise CheckpointError(f"unsupported dtype {e.dtype} for tensor {name!r} in {e.file.name} "
                              f"(supported: BF16/F16/F32/F64, I32/I64, F8_E4M3 or I8 with an F8_E8M0 .scale)")
    return plan


def _get(f: Any, file: Path, name: str, dtype: str, dim: int = 0,
         part: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """One tensor from an open shard, or only its rows (dim 0) / columns (dim 1) [a, b) of
    `part`; E8M0 scales are returned as float8_e8m0fnu or uint8 bytes."""
    try:
        if dtype == "F8_E8M0" and quant.E8M0 is None:
            t = _raw_bytes(file, name)
            return t if part is None else t.narrow(dim, part[0], part[1] - part[0]).clone()
        if part is None:
            return f.get_tensor(name)
        a, b = part
        return f.get_slice(name)[a:b] if dim == 0 else f.get_slice(name)[:, a:b]
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name!r} from {file}: {e}") from None


def _raw_bytes(file: Path, name: str) -> torch.Tensor:
    """Read a 1-byte-per-element tensor straight from the file (torch without float8_e8m0fnu)."""
    h = read_header(file)
    meta = h.tensors[name]
    start, end = meta["data_offsets"]
    with open(file, "rb") as fh:
        fh.seek(h.data_start + start)
        data = bytearray(fh.read(end - start))
    return torch.frombuffer(data, dtype=torch.uint8).view(meta["shape"])


# ============================================================================ checking
_FINITE_CHUNK = 1 << 24  # elements per aminmax() pass


def validate_tensor(name: str, file: Path, t: torch.Tensor) -> None:
    """Refuse NaN/inf in a floating tensor just read from `file` (one pass, in chunks); raise CheckpointError."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), _FINITE_CHUNK):
        # min and max are finite iff every value is (torch's reductions propagate NaN; an inf
        # is an extreme): one read of the chunk and no mask, ~30x faster than isfinite().all()
        lo, hi = torch.aminmax(flat[i:i + _FINITE_CHUNK])
        if not bool(torch.isfinite(lo)) or not bool(torch.isfinite(hi)):
            bad = int((~torch.isfinite(flat)).sum())
            raise CheckpointError(f"tensor {name!r} in {file} has {bad} non-finite value(s) (NaN or inf) of "
                                  f"{flat.numel()}; the checkpoint is corrupt, re-download or re-convert it")


def check_tid2eid(tensors: Mapping[str, torch.Tensor], num_experts: int) -> None:
    """Refuse hash-routing tables (``*.ffn.gate.tid2eid``) with expert ids outside [0, num_experts)."""
    for name, t in tensors.items():
        if not _I64_RE.fullmatch(name) or t.numel() == 0:
            continue
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise CheckpointError(f"hash-routing table {name!r} holds expert id {bad}, outside [0, {num_experts}) "
                                  f"(n_routed_experts); the checkpoint is corrupt")

def check_tensors(tensors: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Check a loaded tensor set against the model's parameter shapes; raise CheckpointError.

    ``tensors`` values are tensors (or shapes); ``expected`` maps official names to shapes.
    """
    unexpected = [n for n in tensors if n not in expected]
    if unexpected and len(unexpected) * 2 > len(tensors):
        example = "layers.0.attn.wq_a.weight"
        if example not in expected:
            example = next(iter(expected), example)
        raise CheckpointError(f"{len(unexpected)} of {len(tensors)} checkpoint tensors have unexpected names "
                              f"(e.g. {unexpected[0]!r}); the checkpoint seems to use another naming scheme, "
                              f"expected official DeepSeek V4 names like {example!r}")
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" and {len(missing) - 1} more are missing" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise CheckpointError(f"checkpoint has unexpected tensor {unexpected[0]!r}{more}")
    for name, shape in expected.items():
        t = tensors[name]
        found = tuple(t.shape) if hasattr(t, "shape") else tuple(t)
        if found != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {list(found)}, expected {list(shape)}")
