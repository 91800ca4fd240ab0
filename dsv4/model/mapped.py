"""Checkpoint tensors used as stored, memory-mapped from their safetensors files, not copied.

    files = MappedFiles()
    packed = files.tensor(path, "layers.3.ffn.experts.7.w1.weight")   # a uint8 view of the file's pages

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, data
offsets) and the data. Each file is mapped once (MAP_PRIVATE, readable and copy-on-write:
pages come from the page cache and are shared by every process that maps the file, so a
restart on a warm page cache reads nothing again and ranks on one host hold one copy; the
mapping holds a descriptor, and, being private, counts whole against RLIMIT_DATA: the
loader maps only files that hold what it uses as stored); tensors, and runs of tensors
stored back to back (`span`), are `torch.frombuffer` views of it, which keep it alive.

At open every tensor's offsets are checked against the header and the file's size: a
truncated file is a `CheckpointError` naming it, never a page fault at decode. A file changed
under a running server can still fault; replace checkpoints by renaming, not in place.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from ..safetensors_header import SafetensorsError, read_header
from .checkpoint import CheckpointError

_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F8_E8M0": torch.uint8, "BF16": torch.bfloat16,
           "F16": torch.float16, "F32": torch.float32, "I32": torch.int32, "I64": torch.int64}


class MappedFiles:
    """The mapped safetensors files of one load (each mapped once, headers checked at open)."""

    def __init__(self) -> None:
        self._files: dict[Path, tuple[int, dict]] = {}  # file -> (data start, header), checked
        self._maps: dict[Path, mmap.mmap] = {}  # file -> its mapping (its tensors keep it alive)

    def _open(self, file: Path) -> tuple[int, dict]:
        """`file`'s data start and header, every tensor's offsets checked against its size."""
        got = self._files.get(file)
        if got is not None:
            return got
        try:
            h = read_header(file)
            data, header, size = h.data_start, h.tensors, h.file_size
            for name, meta in header.items():
                start, end = meta["data_offsets"]
                if not 0 <= start <= end or data + end > size:
                    raise CheckpointError(f"truncated or corrupt safetensors file {file}: tensor {name!r} ends at "
                                          f"byte {data + end}, the file has {size}")
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot map safetensors file {file}: {e}") from None
        self._files[file] = got = (data, header)
        return got

    def _bytes(self, file: Path, start: int, end: int) -> torch.Tensor:
        """Bytes [start, end) of `file` as a uint8 view of the file's mapping (made once per
        file: a mapping holds a descriptor, and a checkpoint has thousands of tensors)."""
        mm = self._maps.get(file)
        if mm is None:
            try:
                with open(file, "rb") as fh:
                    mm = self._maps[file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"cannot map safetensors file {file}: {e}") from None
        return torch.frombuffer(mm, dtype=torch.uint8, count=end - start, offset=start)

    def is_mapped(self, file: Path) -> bool:
        """Whether `file` is mapped already (tensors of it cost no further mapping)."""
        return Path(file) in self._maps

    def tensor(self, file: Path, name: str) -> torch.Tensor:
        """`name` from `file` as a view of the mapped pages, in its stored dtype (E8M0 scales and
        packed FP4 as uint8)."""
        file = Path(file)
        data, header = self._open(file)
        meta = header.get(name)
        if meta is None:
            raise CheckpointError(f"{file} holds no tensor {name!r}")
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} in {file}: dtype {meta['dtype']} cannot be mapped")
        start, end = meta["data_offsets"]
        shape = [int(d) for d in meta["shape"]]
        count = end - start
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        raw = self._bytes(file, data + start, data + end)
        if dtype is not torch.uint8:
            raw = raw.view(dtype)
        if raw.numel() != (n := int(torch.tensor(shape).prod().item()) if shape else 1):
            raise CheckpointError(f"tensor {name!r} in {file}: {count} bytes do not hold shape {shape} "
                                  f"({n} elements of {meta['dtype']})")
        return raw.view(shape)

    def span(self, file: Path, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        """The tensors `names` of `file` as one flat `dtype` view of the mapped pages, when the
        file stores them back to back in this order, each as `dtype` (None otherwise)."""
        file = Path(file)
        data, header = self._open(file)
        metas = [header.get(n) for n in names]
        if any(m is None or _DTYPES.get(m["dtype"]) is not dtype or m["dtype"] == "F8_E8M0" for m in metas):
            return None
        if any(a["data_offsets"][1] != b["data_offsets"][0] for a, b in zip(metas, metas[1:])):
            return None
        start, end = metas[0]["data_offsets"][0], metas[-1]["data_offsets"][1]
        if end == start:
            return None
        try:
            return self._bytes(file, data + start, data + end).view(dtype)
        except RuntimeError:  # not aligned for dtype's elements
            return None

    def close(self) -> None:
        """Forget the headers and mappings (tensors made from them keep theirs alive)."""
        self._files.clear()
        self._maps.clear()
