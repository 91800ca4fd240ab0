"""Shared end-to-end fixtures: one tiny random checkpoint and one daemon serving it for the session."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.e2e.util import Daemon


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.checkpoints import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny-model")
    write_tiny_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    """A daemon with the default engine settings but a fixed K = 1, so that every request
    drafts (the default, auto, may choose K = 0 on a CPU)."""
    d = Daemon(tiny_model, "--num-speculative-tokens", "1").wait_ready()
    yield d
    d.cleanup()
