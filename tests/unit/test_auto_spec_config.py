"""`--num-speculative-tokens auto` in the engine config: the default with MTP weights, 0
without, parsed from CLI strings, bounded by the step budget; bad values name the flag."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dsv4.engine.config import EngineConfig, EngineConfigError
from tests.unit.test_engine_config import err, make_ckpt


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_ckpt(tmp_path / "ckpt")


@pytest.mark.parametrize("value", [None, "auto"])
def test_auto_is_the_default_with_mtp(ckpt: Path, value) -> None:
    c = EngineConfig.create(model=str(ckpt), num_speculative_tokens=value)
    assert c.speculative_auto and c.num_speculative_tokens == 3  # state and budget sized for K = 3
    assert c.max_num_batched_tokens == 512 + 8 * 4  # DEFAULT_CHUNK beside a full batch of 1 + K rows
    assert any("K = auto (0..3" in line for line in c.banner_lines())
    assert dataclasses.replace(c, seed=1).speculative_auto  # re-validation keeps it


def test_auto_without_mtp_means_zero(tmp_path: Path) -> None:
    for c in (EngineConfig.create(model=str(make_ckpt(tmp_path / "a", mtp_layers=0)), num_speculative_tokens="auto"),
              EngineConfig.create(model=str(make_ckpt(tmp_path / "b", mtp_tensors=False)))):
        assert not c.speculative_auto and c.num_speculative_tokens == 0
        assert any("K = 0" in line for line in c.banner_lines())


def test_fixed_k_from_a_cli_string(ckpt: Path) -> None:
    c = EngineConfig.create(model=str(ckpt), num_speculative_tokens="2")
    assert c.num_speculative_tokens == 2 and not c.speculative_auto
    assert EngineConfig.create(model=str(ckpt), num_speculative_tokens=0).speculative_auto is False


@pytest.mark.parametrize("value", ["fast", "-1", "1.5", 2.0])
def test_bad_values_name_the_flag(ckpt: Path, value) -> None:
    msg = err(EngineConfig.create, model=str(ckpt), num_speculative_tokens=value)
    assert "--num-speculative-tokens must be an integer >= 0 (or auto)" in msg


def test_auto_fits_a_small_budget(ckpt: Path) -> None:
    c = EngineConfig.create(model=str(ckpt), max_num_batched_tokens=3)
    assert c.speculative_auto and c.num_speculative_tokens == 2
    c = EngineConfig.create(model=str(ckpt), max_num_batched_tokens=1)
    assert not c.speculative_auto and c.num_speculative_tokens == 0
    with pytest.raises(EngineConfigError, match="--max-num-batched-tokens 1"):
        EngineConfig.create(model=str(ckpt), max_num_batched_tokens=1, num_speculative_tokens=1)
