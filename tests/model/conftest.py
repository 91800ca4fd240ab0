"""Shared fixtures for the model tests: tiny random models, fp32 on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4.model.model import DeepseekV4, init_random
from dsv4.model.w8a8 import to_w8a8
from tests.checkpoints import write_tiny_checkpoint
from tests.model.tiny import tiny_config


@pytest.fixture(scope="session", params=["plain", "fused", "w8a8-fused"])
def tiny_model(request) -> DeepseekV4:
    """The same random model as built (what training uses), with its projections fused
    (what `load_model` and the engine use), and fused with int8 weights (`--quantization
    w8a8`; fused = unfused for it is checked in test_w8a8.py): every test of it runs on
    all three, so the invariants (chunked = whole, rollback, MTP) hold for each format."""
    torch.manual_seed(0)
    model = init_random(DeepseekV4(tiny_config()), seed=0).eval()
    if request.param.startswith("w8a8"):
        to_w8a8(model)
    return model.fuse_projections() if request.param.endswith("fused") else model


def prefill(model: DeepseekV4, state, slot: int, ids: list[int], plan: list[int]):
    """Prefill `ids` into `slot` chunk by chunk -> (hidden [S, hc, D], logits [S, V])."""
    from dsv4.model.state import Batch

    hs, ls, start = [], [], 0
    for n in plan:
        b = Batch.build([(slot, start, ids[start:start + n])])
        h, lg = model.forward_batch(b, state)
        hs.append(h)
        ls.append(lg)
        start += n
    assert start == len(ids)
    return torch.cat(hs), torch.cat(ls)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny checkpoint (`write_tiny_checkpoint`), written once for the engine tests."""
    d = tmp_path_factory.mktemp("tiny-checkpoint")
    write_tiny_checkpoint(d)
    return d
