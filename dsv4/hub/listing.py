"""What `dsv4 models` shows: each snapshot of a model in the hub cache, its weights' format
and stored size (config.json and the safetensors headers; no tensor is read), and whether
that fits this machine (`weights_fit`, a first estimate meant to be replaced by the
engine's memory plan).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..machine import available_memory
from ..safetensors_header import SafetensorsError, read_header
from .cache import INDEX_NAME, cache_dir, missing_files

QUANTIZATION_KEY = "dsv4_quantization"  # dsv4/model/checkpoint.py: a `dsv4 convert` output records its format here


@dataclass
class CachedModel:
    repo_id: str
    commit: str
    refs: list[str]  # branches and tags that point at this commit (main, ...)
    path: str
    size_on_disk: int  # the snapshot's files as stored in blobs/
    model_type: Optional[str]
    format: str  # "FP8/FP4 (official)", "w8a8 (dsv4 convert)", "bf16", ...
    weight_bytes: int  # sum of the tensors' stored bytes (safetensors headers)
    dtype_bytes: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # files dsv4 reads that are not there (an unfinished pull)
    fits: Optional[bool] = None
    available_bytes: Optional[int] = None
    fit_note: str = ""

    @property
    def servable(self) -> bool:
        return self.model_type == "deepseek_v4" and not self.missing

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "servable": self.servable}


def safetensors_dtype_bytes(files: list[Path]) -> Counter:
    """dtype -> bytes of the tensors stored in `files`, from their headers alone."""
    out: Counter = Counter()
    for file in files:
        try:
            header = read_header(file).tensors
        except SafetensorsError:
            continue  # an unreadable shard: the engine's checkpoint reader names it when loading
        for meta in header.values():
            if not isinstance(meta, dict):
                continue
            try:
                a, b = meta["data_offsets"]
                out[str(meta["dtype"])] += int(b) - int(a)
            except (KeyError, TypeError, ValueError):
                continue
    return out


def weight_format(config: dict, dtype_bytes: Counter) -> str:
    """The checkpoint's weight format, from config.json and the stored dtypes."""
    if config.get(QUANTIZATION_KEY) == "w8a8":
        return "w8a8 (dsv4 convert)"
    fp8, fp4 = "F8_E4M3" in dtype_bytes, "I8" in dtype_bytes and "F8_E8M0" in dtype_bytes
    if fp8 and fp4:
        return "FP8/FP4 (official)"
    if fp8:
        return "FP8 (official)"
    floats = {k: v for k, v in dtype_bytes.items() if k in ("BF16", "F16", "F32", "F64")}
    if not floats:
        return "-" if not dtype_bytes else "/".join(sorted(dtype_bytes)).lower()
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}[max(floats, key=floats.__getitem__)]


def weights_fit(weight_bytes: int) -> tuple[Optional[bool], Optional[int], str]:
    """(fits, available bytes, how it was judged): the weights' stored bytes against the
    memory available now (MemAvailable). A first estimate, kept in this one function so a
    full memory plan can replace it: the engine may hold more than the stored bytes (FP8/FP4
    weights dequantised to --dtype; the request state and the activations come on top) or
    less (tensor parallelism over several hosts), and on a GPU it is the device's memory that
    counts."""
    available = available_memory()
    if available is None:
        return None, None, "memory available unknown"
    return weight_bytes <= available, available, "stored weight bytes against MemAvailable"


def describe(repo_id: str, commit: str, refs: list[str], snap: Path, size_on_disk: int) -> CachedModel:
    """One snapshot's row: config.json and the safetensors headers read, nothing else."""
    try:
        config = json.loads((snap / "config.json").read_text(encoding="utf-8"))
        config = config if isinstance(config, dict) else {}
    except (OSError, ValueError):
        config = {}
    files = sorted(p for p in snap.glob("*.safetensors") if p.is_file())
    index = snap / INDEX_NAME
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            files = [p for p in files if p.name in shards]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    dtypes = safetensors_dtype_bytes(files)
    weight_bytes = sum(dtypes.values())
    missing = missing_files(snap.parent.parent, commit)
    mt = config.get("model_type")
    row = CachedModel(repo_id=repo_id, commit=commit, refs=sorted(refs), path=str(snap), size_on_disk=size_on_disk,
                      model_type=mt if isinstance(mt, str) else None, format=weight_format(config, dtypes),
                      weight_bytes=weight_bytes, dtype_bytes=dict(sorted(dtypes.items())), missing=missing)
    if row.model_type == "deepseek_v4" and weight_bytes:
        row.fits, row.available_bytes, row.fit_note = weights_fit(weight_bytes)
    return row


def cached_models(cache: Path | None = None) -> list[CachedModel]:
    """Every snapshot of a model repo in the hub cache, by repo id, newest first within a
    repo; [] when there is no cache. The cache is walked here rather than with
    huggingface_hub's `scan_cache_dir`, which leaves out a whole repo for one broken link or
    a ref whose snapshot is not there yet (a pull under way): such a snapshot is listed,
    with the files it misses."""
    cache = cache or cache_dir()
    rows = []
    try:
        repos = sorted((p for p in cache.iterdir() if p.name.startswith("models--") and p.is_dir()),
                       key=lambda p: p.name.lower())
    except OSError:
        return []
    for root in repos:
        repo_id = "/".join(root.name.split("--")[1:])
        refs: dict[str, list[str]] = {}
        for ref in sorted((root / "refs").glob("**/*")):
            if ref.is_file() and not ref.name.startswith("."):
                try:
                    refs.setdefault(ref.read_text(encoding="utf-8").strip(), []).append(
                        ref.relative_to(root / "refs").as_posix())
                except OSError:
                    continue
        try:
            snaps = [p for p in (root / "snapshots").iterdir() if p.is_dir()]
        except OSError:
            continue
        for snap in sorted(snaps, key=lambda p: -p.stat().st_mtime):
            rows.append(describe(repo_id, snap.name, refs.get(snap.name, []), snap, _size_on_disk(snap)))
    return rows


def _size_on_disk(snap: Path) -> int:
    """Bytes of the distinct blobs the snapshot's files are (links followed once)."""
    seen: dict[Path, int] = {}
    for f in snap.rglob("*"):
        try:
            if f.is_file():
                target = f.resolve()
                seen.setdefault(target, target.stat().st_size)
        except OSError:
            continue
    return sum(seen.values())
