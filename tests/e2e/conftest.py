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
    """A daemon with the default engine settings (K = 1: the tiny model has MTP weights)."""
    d = Daemon(tiny_model).wait_ready()
    yield d
    d.cleanup()
