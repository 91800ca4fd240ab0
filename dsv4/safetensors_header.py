"""The header of a safetensors file, read without torch: an 8-byte little-endian length, then
a JSON map of tensor name -> {dtype, shape, data_offsets} (offsets from the end of the header).

    h = read_header(path)            # SafetensorsError (one line) if it is not a safetensors file
    h.data_start, h.tensors["embed.weight"], h.file_size

Its readers: the loader's mapped tensors (`model/mapped.py`), the raw-byte reader of
`model/checkpoint.py`, `dsv4 models` (`hub/listing.py`), which sums bytes per dtype, and
`tensor_listing` (what a checkpoint holds, for the calibration cache's key and a joining
replica's identity).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_HEADER = 100 << 20  # bytes of JSON header: real checkpoints have a few hundred KB


class SafetensorsError(ValueError):
    """Not a readable safetensors header (one line naming the file)."""


@dataclass(frozen=True)
class Header:
    data_start: int  # byte offset of the data in the file (8 + the header's length)
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"} ("__metadata__" left out)
    file_size: int


def read_header(file: str | Path) -> Header:
    """`file`'s header; `SafetensorsError` when its length does not fit the file, or it is not JSON."""
    try:
        with open(file, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"corrupt safetensors file {file}: shorter than its header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER):
                raise SafetensorsError(f"corrupt safetensors file {file}: its header length does not fit the file")
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as e:
        if isinstance(e, SafetensorsError):
            raise
        raise SafetensorsError(f"cannot read safetensors file {file}: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"corrupt safetensors file {file}: its header is not a JSON object")
    return Header(8 + n, {k: v for k, v in header.items() if k != "__metadata__"}, size)


def tensor_listing(directory: str | Path) -> dict[str, list[tuple[str, Any, Any]]]:
    """Every shard of a checkpoint directory -> its tensors' (name, dtype, shape), sorted: what
    the checkpoint holds, wherever it lies."""
    return {f.name: [(n, t.get("dtype"), t.get("shape")) for n, t in sorted(read_header(f).tensors.items())]
            for f in sorted(Path(directory).glob("*.safetensors"))}
