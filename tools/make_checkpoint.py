"""Re-save a DeepSeek V4 checkpoint directory in the official layout.

    python tools/make_checkpoint.py --from DIR --out DIR [--quantize] [--shards N] [--dtype bf16|fp32]

Reads every tensor of ``--from`` (dequantised to float32, so meant for small test
checkpoints: the whole model is held in memory), then writes ``--out`` with
``dsv4.model.save.save_checkpoint``: FP8/FP4 weights when ``--quantize``,
``--shards`` files plus an index when N > 1. The config.json is carried over.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dsv4.model.checkpoint import CheckpointError, read_checkpoint
from dsv4.model.save import save_checkpoint

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="src", required=True, help="existing checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quantize", action="store_true",
                   help="store FP8 / FP4 weights like the official release")
    p.add_argument("--shards", type=int, default=1, help="number of safetensors files (default 1)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of unquantised float tensors")
    args = p.parse_args(argv)
    try:
        tensors, config = read_checkpoint(args.src, dtype=torch.float32)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    save_checkpoint(args.out, tensors, config, quantize=args.quantize, dtype=DTYPES[args.dtype],
                    num_shards=args.shards)
    print(f"wrote {len(tensors)} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
