"""load_model on checkpoints in DeepSeek's official layout: FP8/FP4 round trip over 3
shards, and the errors a user sees for broken checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.config import ConfigError
from dsv4.model.checkpoint import CheckpointError, official_storage
from dsv4.model.loader import load_model
from dsv4.model.model import DeepseekV4
from dsv4.model.quant import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from tests.checkpoints import write_tiny_checkpoint


def _dequantised(name: str, t: torch.Tensor) -> torch.Tensor:
    fmt = official_storage(name)
    if fmt == "fp8":
        return dequantize_fp8(*quantize_fp8(t))
    if fmt == "fp4":
        return dequantize_fp4(*quantize_fp4(t))
    return t  # the tiny checkpoint keeps the other floats in fp32


@pytest.mark.exact
def test_fp8_fp4_sharded_round_trip(tmp_path):
    model = write_tiny_checkpoint(tmp_path, quantize=True, num_shards=3, with_tokenizer=False)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    stored = {}
    for f in files:
        stored.update(load_file(tmp_path / f))
    assert stored["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.1.ffn.experts.3.w1.weight"].dtype == torch.int8
    assert "mtp.0.e_proj.scale" in stored
    loaded = load_model(tmp_path)
    ref = {k: _dequantised(k, v) for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k].to(got[k].dtype)), k  # bit-exact dequantisation
    plain = DeepseekV4(model.cfg)
    plain.load_state_dict(ref)
    ids = torch.randint(0, 4096, (1, 70), generator=torch.Generator().manual_seed(0))
    # bit for bit against the same weights in the same form (load_model fuses the projections;
    # a fused and an unfused matmul round differently on some CPUs' kernels, e.g. AVX2's)
    assert torch.equal(loaded(ids), plain.eval().fuse_projections()(ids))


def _ckpt(tmp_path):
    write_tiny_checkpoint(tmp_path, with_tokenizer=False)
    return tmp_path / "model.safetensors", load_file(tmp_path / "model.safetensors")


def test_missing_tensor_named(tmp_path):
    f, sd = _ckpt(tmp_path)
    del sd["layers.2.attn.wkv.weight"], sd["norm.weight"]
    save_file(sd, f)
    with pytest.raises(CheckpointError, match=r"missing .*(layers\.2\.attn\.wkv\.weight|norm\.weight).*1 more"):
        load_model(tmp_path)


def test_shape_mismatch_named(tmp_path):
    f, sd = _ckpt(tmp_path)
    sd["layers.0.attn.wq_a.weight"] = torch.zeros(3, 64)
    save_file(sd, f)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight.*\[3, 64\], expected \[32, 64\]"):
        load_model(tmp_path)


def test_other_naming_scheme(tmp_path):
    f, sd = _ckpt(tmp_path)
    save_file({"model." + k: v for k, v in sd.items()}, f)
    with pytest.raises(CheckpointError, match="another naming scheme.*layers.0.attn.wq_a.weight"):
        load_model(tmp_path)


def test_corrupt_and_missing_files(tmp_path):
    f, _ = _ckpt(tmp_path)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)
    f.unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises((CheckpointError, ConfigError), match="config.json"):
        load_model(tmp_path)


def test_unsupported_dtype(tmp_path):
    f, sd = _ckpt(tmp_path)
    sd["norm.weight"] = torch.zeros(64, dtype=torch.uint16)
    save_file(sd, f)
    with pytest.raises(CheckpointError, match="U16 for tensor 'norm.weight'"):
        load_model(tmp_path)


def test_config_errors_name_the_key(tmp_path):
    write_tiny_checkpoint(tmp_path, with_tokenizer=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for change, key in (({"model_type": "llama"}, "model_type"),
                        ({"compress_ratios": [0, 4]}, "compress_ratios"),
                        ({"hidden_size": None}, "hidden_size")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConfigError, match=key):
            load_model(tmp_path)
