"""config.json values are range-checked as tensors are checked finite (issue 21): NaN,
infinities, out-of-range and mistyped numbers are one-line errors naming the key, never a
model that loads and prints garbage; a config.json that is not UTF-8 (or nests without
end) is a one-line error naming the file, not "internal error"."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from dsv4.config import ConfigError, ModelConfig
from dsv4.engine.config import EngineConfig
from tests.model.tiny import tiny_dict
from tests.unit.test_engine_config import err, make_ckpt

YARN = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_theta": math.nan}, "'rope_theta' must be a finite number, got nan"),
    ({"rope_theta": math.inf}, "'rope_theta' must be a finite number, got inf"),
    ({"rope_theta": 1}, "'rope_theta' must be > 1, got 1"),
    ({"compress_rope_theta": -160000.0}, "'compress_rope_theta' must be > 1, got -160000.0"),
    ({"rope_theta": "10000"}, "'rope_theta' must be a number, got '10000'"),
    ({"rope_theta": 10 ** 400}, "'rope_theta' must be a finite number, got 1000000"),
    ({"rms_norm_eps": 0.0}, "'rms_norm_eps' must be > 0, got 0.0"),
    ({"hc_eps": math.nan}, "'hc_eps' must be a finite number, got nan"),
    ({"routed_scaling_factor": -1.5}, "'routed_scaling_factor' must be > 0, got -1.5"),
    ({"swiglu_limit": -math.inf}, "'swiglu_limit' must be a finite number, got -inf"),
    ({"rope_scaling": {**YARN, "factor": math.nan}}, "'rope_scaling factor' must be a finite number, got nan"),
    ({"rope_scaling": {**YARN, "beta_slow": -1}}, "'rope_scaling beta_slow' must be > 0, got -1"),
    ({"rope_scaling": {**YARN, "original_max_position_embeddings": 6.5}},
     "'rope_scaling original_max_position_embeddings' must be an integer, got 6.5"),
    ({"rope_scaling": "yarn"}, "'rope_scaling' must be an object, got 'yarn'"),
    ({"compress_ratios": [0, 4, math.nan, 4, 0]}, "'compress_ratios[2]' must be an integer, got nan"),
    ({"qk_rope_head_dim": "8"}, "'qk_rope_head_dim' must be an integer, got '8'"),
    ({"eos_token_id": [None]}, "'eos_token_id' must be an integer, got None"),
    ({"bos_token_id": -1}, "'bos_token_id' must be >= 0, got -1"),
])
def test_out_of_range_values_name_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(tiny_dict(**change))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_valid_values_still_load() -> None:
    cfg = ModelConfig.from_dict(tiny_dict(rope_theta=10000, eos_token_id=[1, 2], compress_ratios=[0, 4.0, 8, 4, 0]))
    assert cfg.rope_theta == 10000.0 and cfg.eos_token_id == 1 and cfg.compress_ratios[:3] == (0, 4, 8)


def test_nan_in_config_json_is_refused_before_loading(tmp_path: Path) -> None:
    d = make_ckpt(tmp_path / "nan")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "rope_theta": math.nan}))  # the literal NaN
    assert "NaN" in (d / "config.json").read_text()
    assert err(EngineConfig.create, model=str(d)) == f"--model {d}: 'rope_theta' must be a finite number, got nan"


def test_config_json_not_utf8_names_the_file(tmp_path: Path) -> None:
    d = make_ckpt(tmp_path / "latin1")
    raw = (d / "config.json").read_bytes()
    (d / "config.json").write_bytes(raw[:1] + b'"n\xe9": 1, ' + raw[1:])
    assert err(EngineConfig.create, model=str(d)) == (f"--model {d}: {d / 'config.json'}: not UTF-8 text "
                                                       f"(byte 0xe9 at offset 3)")
    (d / "config.json").write_text("[" * 100_000)
    assert err(EngineConfig.create, model=str(d)).endswith("config.json: not valid JSON (nested too deeply)")
