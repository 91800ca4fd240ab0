"""`--quantization mxfp4` / `w8a8-mxfp4`: the routed experts kept as the official checkpoint
stores them (FP4 e2m1 + E8M0 per 32), mapped from the files and multiplied from the packed
bytes. Exactness under these modes is checked with the other formats (tests/model/conftest.py
`tiny_model`, test_engine.py `test_greedy_with_mtp_equals_without`); here: loading equals
dequantising, the bytes are the files' own pages, and what cannot work is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.model.checkpoint import CheckpointError
from dsv4.model.loader import load_model
from dsv4.model.mxfp4 import FP4Linear
from dsv4.model.state import Batch
from dsv4.model.w8a8 import QuantLinear
from tests.checkpoints import write_tiny_checkpoint
from tests.model.conftest import TOL, W8A8_DENSE

IDS = torch.randint(3, 4096, (1, 40), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def fp4_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp4")
    write_tiny_checkpoint(d, quantize=True, **W8A8_DENSE)
    return d


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward_batch(Batch.whole(IDS), None)[1]


def test_mxfp4_equals_the_dequantised_experts(fp4_dir):
    """float activations: the dequantised model's logits within float rounding; int8
    activations: as close to them as w8a8 (which holds the same experts as exact int8 rows)."""
    ref = _logits(load_model(fp4_dir, quantization="none"))
    m = load_model(fp4_dir, quantization="mxfp4")
    experts = [mod for name, mod in m.named_modules() if ".experts." in name and name.endswith((".w1", ".w2", ".w3"))]
    assert experts and all(isinstance(e, FP4Linear) for e in experts)
    assert not any(isinstance(mod, QuantLinear) for mod in m.modules())  # the rest stays float
    assert (_logits(m) - ref).abs().max().item() <= TOL
    w8 = (_logits(load_model(fp4_dir, quantization="w8a8")) - ref).abs().max().item()
    wm = load_model(fp4_dir, quantization="w8a8-mxfp4")
    assert any(isinstance(mod, QuantLinear) for mod in wm.modules())
    err = (_logits(wm) - ref).abs().max().item()
    assert 0 < err <= 1.25 * w8, (err, w8)  # the same activation rounding; only the sum order differs


def test_fp4_experts_are_the_files_pages(fp4_dir):
    """The packed bytes are not copied: each buffer lies inside a mapping of a safetensors file,
    and equals the file's tensor."""
    m = load_model(fp4_dir, quantization="mxfp4")
    stored = {}
    for f in sorted(fp4_dir.glob("*.safetensors")):
        stored.update(load_file(f))
    maps = open("/proc/self/maps").read().splitlines()
    spans = [tuple(int(x, 16) for x in ln.split()[0].split("-")) for ln in maps if ".safetensors" in ln]
    n = 0
    for name, mod in m.named_modules():
        if isinstance(mod, FP4Linear):
            ptr = mod.weight.data_ptr()
            assert any(a <= ptr < b for a, b in spans), name
            assert torch.equal(mod.weight, stored[f"{name}.weight"].view(torch.uint8))
            assert torch.equal(mod.scale, stored[f"{name}.scale"].view(torch.uint8))
            n += 1
    assert n > 0


def test_mxfp4_needs_fp4_experts(tmp_path):
    write_tiny_checkpoint(tmp_path)  # float32 experts
    with pytest.raises(CheckpointError, match=r"--quantization mxfp4 .*layers\.0\.ffn\.experts\.0\.w1\.weight"):
        load_model(tmp_path, quantization="mxfp4")


def test_nan_scale_is_refused_naming_the_tensor(tmp_path):
    """E8M0 255 is NaN: an expert with one is refused at load, not computed into NaN logits."""
    write_tiny_checkpoint(tmp_path, quantize=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text()) \
        if (tmp_path / "model.safetensors.index.json").exists() else None
    name = "layers.1.ffn.experts.3.w2.scale"
    f = tmp_path / (index["weight_map"][name] if index else "model.safetensors")
    sd = load_file(f)
    bad = sd[name].view(torch.uint8).clone()
    bad[0, 0] = 255
    sd[name] = bad.view(sd[name].dtype)
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(Exception, match=name.replace(".", r"\.")):
        load_model(tmp_path, quantization="mxfp4")
