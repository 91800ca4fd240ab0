"""`load_model`: a DeepSeek V4 checkpoint directory -> a ready `DeepseekV4`.

Reads `config.json`, then the safetensors shards (official tensor names, FP8/FP4
dequantised by `checkpoint.read_checkpoint`), checks every tensor against the
model's own parameter shapes (missing, unexpected, mismatched: one clear error),
range-checks the hash-routing tables,
and places the model on the requested device and dtype. The model is built on the
meta device and the loaded tensors are assigned, so no second copy of the weights
is ever allocated: tensors are converted to the target device and dtype as they are
read. mHC parameters, sinks, `ape` and router biases stay float32, as in the
official checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..config import ModelConfig
from .checkpoint import CheckpointError, check_tensors, check_tid2eid, read_checkpoint
from .model import DeepseekV4

def resolve_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda[:N]' or 'npu[:N]' -> torch.device, with a clear error when unavailable."""
    d = str(device)
    if d.startswith("npu"):
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise CheckpointError("--device npu needs the torch_npu package (pip install 'dsv4[npu]')") from None
    elif d.startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointError("--device cuda: no CUDA device is available; use --device cpu")
    return torch.device(d)


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               progress: Callable[[int, int], None] | None = None, fuse: bool = True) -> DeepseekV4:
    """Load a checkpoint directory (config.json + *.safetensors, official names).

    `fuse` (default) fuses linears that read the same input for inference
    (`DeepseekV4.fuse_projections`): move or train the model afterwards only without it."""
    cfg = ModelConfig.from_dir(path)
    dev = resolve_device(device)
    tensors, _ = read_checkpoint(path, dtype=dtype, device=dev, keep_f32=True, progress=progress)
    with_mtp = cfg.num_nextn_predict_layers > 0 and any(k.startswith("mtp.0.") for k in tensors)
    with torch.device("meta"):
        model = DeepseekV4(cfg, with_mtp=with_mtp)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_tensors(tensors, expected)
    check_tid2eid(tensors, cfg.n_routed_experts)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.make_rope_tables(dev)
    if fuse:
        model.fuse_projections()
    return model.eval()
