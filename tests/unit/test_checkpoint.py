"""Tests for dsv4.model.quant (FP8/FP4 codecs) and dsv4.model.checkpoint (reader/writer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsv4.model import quant
from dsv4.model.checkpoint import CheckpointError, check_tensors, official_storage, read_checkpoint
from dsv4.model.save import save_checkpoint
from dsv4.model.quant import dequantize_fp4, dequantize_fp8, e8m0_bytes, quantize_fp4, quantize_fp8

ROOT = Path(__file__).resolve().parents[2]
FP4_GRID = torch.tensor(quant.FP4_VALUES)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _sample(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Random values spanning ~12 decades along the columns, with zeros and a -0."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[1])
    w.view(-1)[:: 7] = 0.0
    w.view(-1)[1] = -0.0
    return w


SHAPES = [(1, 2), (3, 34), (64, 96), (128, 256), (129, 130)]


# ============================================================================ FP8
def _fp8_reference(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Independent FP8 dequantisation: ldexp with the exponent grid repeated per element."""
    exp = e8m0_bytes(s).long() - 127
    exp = exp.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
    return torch.ldexp(q.double(), exp.double()).float()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mag", [1.0, 1e-30, 1e30])
def test_fp8_exact_and_round_trip(shape, mag):
    w = _sample(shape) * mag
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float8_e8m0fnu and tuple(s.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    d = dequantize_fp8(q, s)
    assert torch.equal(d, _fp8_reference(q, s))
    assert torch.equal(dequantize_fp8(q, s, torch.bfloat16).float(), d)  # exactly representable
    assert torch.equal(torch.signbit(d), torch.signbit(w))  # sign kept, also on underflow to 0
    # error: half an e4m3 step (relative 2^-4) or half the smallest subnormal of the block
    sc = _fp8_reference(torch.ones_like(q, dtype=torch.float8_e4m3fn), s)
    assert bool(((d - w).abs() <= torch.maximum(w.abs() * 2**-4, sc * 2**-10)).all())
    q2, s2 = quantize_fp8(d)
    assert torch.equal(_bytes(q2), _bytes(q)) and torch.equal(_bytes(s2), _bytes(s))
    assert torch.equal(_bytes(quantize_fp8(d.to(torch.bfloat16))[0]), _bytes(q))


def test_fp8_scale_rule_zeros_and_negative_zero():
    w = torch.zeros(130, 5)
    w[0, 0] = -0.0
    w[129, 4] = 448.0  # block (1, 0): amax 448 -> scale 2^0
    q, s = quantize_fp8(w)
    assert e8m0_bytes(s).tolist() == [[127 - 22], [127]]  # all-zero block: amax floor 1e-4 -> 2^-22
    assert _bytes(q)[0, 0].item() == 0x80 and _bytes(q)[0, 1].item() == 0
    assert torch.signbit(dequantize_fp8(q, s)[0, 0]) and q[129, 4].float().item() == 448.0
    # 480 needs scale 2; 449 (-> 224.5 -> 224) and 230 (-> 224 = qmax/2) are
    # quantised with the halved scale instead, saturating to 448, as re-quantising would pick.
    cases = [(480.0, 128, 240.0), (449.0, 127, 448.0), (230.0, 126, 448.0), (1e-4, 105, 419.0)]
    for amax, scale_byte, qmax in cases:
        q, s = quantize_fp8(torch.tensor([[amax, amax / 4]]))
        assert e8m0_bytes(s).item() == scale_byte, amax
        assert q.float().abs().max().item() == pytest.approx(qmax, rel=0.02)
        q2, s2 = quantize_fp8(dequantize_fp8(q, s))
        assert torch.equal(_bytes(q2), _bytes(q)) and torch.equal(_bytes(s2), _bytes(s))


def test_quantize_rejects_non_finite_and_bad_shapes():
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_fp8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_fp4(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="even"):
        quantize_fp4(torch.ones(2, 3))
    with pytest.raises(ValueError, match="expected"):
        dequantize_fp8(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8))


# ============================================================================ FP4
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mag", [1.0, 1e-30, 1e30])
def test_fp4_nearest_exact_and_round_trip(shape, mag):
    w = _sample(shape, seed=1) * mag
    p, s = quantize_fp4(w)
    assert p.dtype == torch.int8 and tuple(p.shape) == (shape[0], shape[1] // 2)
    assert tuple(s.shape) == (shape[0], -(-shape[1] // 32)) and s.dtype == torch.float8_e8m0fnu
    d = dequantize_fp4(p, s)
    # every value is grid * 2^(S-127), and the nearest such value to w (brute force over the grid)
    sc = torch.ldexp(torch.ones(s.shape, dtype=torch.float64), e8m0_bytes(s).double() - 127)
    sc = sc.repeat_interleave(32, 1)[:, : shape[1]]
    cand = FP4_GRID.double()[None, None, :] * sc[..., None]  # [R, C, 16]
    best = (cand - w.double()[..., None]).abs().min(-1).values
    assert torch.equal((d.double() - w.double()).abs(), best)
    assert bool(((d.double()[..., None] == cand).any(-1)).all())
    assert torch.equal(dequantize_fp4(p, s, torch.bfloat16).float(), d)
    p2, s2 = quantize_fp4(d)
    assert torch.equal(p2, p) and torch.equal(_bytes(s2), _bytes(s))


def test_fp4_packing_order_and_ties():
    # 0.5 -> code 1 (low nibble, element 0); -6 -> code 15 (high nibble, element 1): byte 0xF1
    p, s = quantize_fp4(torch.tensor([[0.5, -6.0]]))
    assert _bytes(p).tolist() == [[0xF1]] and e8m0_bytes(s).tolist() == [[127]]
    assert dequantize_fp4(p, s).tolist() == [[0.5, -6.0]]
    # hand-written byte 0x2B: low nibble 0xB = -1.5 (element 0), high nibble 0x2 = 1.0 (element 1)
    d = dequantize_fp4(torch.tensor([[0x2B]], dtype=torch.uint8).view(torch.int8),
                       torch.tensor([[128]], dtype=torch.uint8))  # scale 2
    assert d.tolist() == [[-3.0, 2.0]]
    # midpoints round to the even code; -0.1 rounds to -0 (code 8)
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 0.0]])
    p, s = quantize_fp4(x)
    u = _bytes(p)[0]
    codes = torch.stack((u & 0xF, u >> 4), -1).flatten().tolist()
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 0]
    # all-zero block: amax floor 6*2^-126 -> scale 2^-126
    assert e8m0_bytes(quantize_fp4(torch.zeros(1, 32))[1]).tolist() == [[1]]
    # 3.2 rounds to 3 = qmax/2: re-expressed with the halved scale (as 6 * 2^-1)
    p, s = quantize_fp4(torch.tensor([[3.2, 1.0]]))
    assert e8m0_bytes(s).tolist() == [[126]] and (_bytes(p)[0, 0] & 0xF).item() == 7


# ============================================================================ checkpoint files
def _official_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    t = {"embed.weight": r(64, 48), "head.weight": r(64, 48), "norm.weight": r(48),
         "hc_head_fn": r(2, 96), "hc_head_base": r(2), "hc_head_scale": r(1)}
    for p in ("layers.0.", "layers.1.", "mtp.0."):
        t |= {p + "attn_norm.weight": r(48), p + "ffn_norm.weight": r(48),
              p + "attn.wq_a.weight": r(200, 48), p + "attn.q_norm.weight": r(200),
              p + "attn.wq_b.weight": r(130, 200), p + "attn.wkv.weight": r(40, 48),
              p + "attn.wo_a.weight": r(64, 40), p + "attn.wo_b.weight": r(48, 64),
              p + "attn.attn_sink": r(4), p + "hc_attn_fn": r(12, 96), p + "hc_attn_base": r(12),
              p + "hc_attn_scale": r(3), p + "ffn.gate.weight": r(4, 48),
              p + "ffn.shared_experts.w1.weight": r(64, 48), p + "ffn.shared_experts.w2.weight": r(48, 64),
              p + "ffn.experts.0.w1.weight": r(64, 48), p + "ffn.experts.1.w2.weight": r(48, 40)}
    t |= {"layers.0.attn.compressor.wkv.weight": r(16, 48), "layers.0.attn.compressor.ape": r(4, 16),
          "layers.0.attn.indexer.wq_b.weight": r(32, 200), "layers.0.attn.indexer.compressor.ape": r(4, 8),
          "layers.0.ffn.gate.tid2eid": torch.randint(0, 4, (64, 2), generator=g),
          "layers.1.ffn.gate.bias": r(4), "mtp.0.e_proj.weight": r(48, 48), "mtp.0.h_proj.weight": r(48, 48),
          "mtp.0.enorm.weight": r(48)}
    return t


def _expected_after_read(t: dict[str, torch.Tensor], quantized: bool) -> dict[str, torch.Tensor]:
    out = {}
    for n, x in t.items():
        fmt = official_storage(n)
        if quantized and fmt == "fp8":
            out[n] = dequantize_fp8(*quantize_fp8(x))
        elif quantized and fmt == "fp4":
            out[n] = dequantize_fp4(*quantize_fp4(x))
        elif fmt in ("f32", "i64"):
            out[n] = x
        else:
            out[n] = x.to(torch.bfloat16).float()
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n


def test_official_storage():
    cases = {"layers.3.attn.wq_a.weight": "fp8", "mtp.0.attn.wo_b.weight": "fp8",
             "layers.2.attn.indexer.wq_b.weight": "fp8", "layers.9.ffn.shared_experts.w3.weight": "fp8",
             "mtp.0.e_proj.weight": "fp8", "mtp.0.h_proj.weight": "fp8",
             "layers.3.ffn.experts.255.w2.weight": "fp4", "mtp.0.ffn.experts.7.w1.weight": "fp4",
             "hc_head_fn": "f32", "layers.1.hc_ffn_scale": "f32", "mtp.0.hc_head_base": "f32",
             "layers.0.attn.attn_sink": "f32", "layers.2.attn.compressor.ape": "f32",
             "layers.2.attn.indexer.compressor.ape": "f32", "layers.5.ffn.gate.bias": "f32",
             "layers.0.ffn.gate.tid2eid": "i64", "layers.2.attn.compressor.wkv.weight": "float",
             "layers.2.attn.indexer.weights_proj.weight": "float", "embed.weight": "float",
             "layers.0.ffn.gate.weight": "float", "mtp.0.enorm.weight": "float"}
    assert {n: official_storage(n) for n in cases} == cases


def test_quantized_sharded_round_trip(tmp_path):
    t = _official_tensors()
    config = {"model_type": "deepseek_v4", "hidden_size": 48}
    save_checkpoint(tmp_path, t, config, quantize=True, num_shards=3)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    assert set(wm.values()) == set(files)
    assert wm["layers.0.attn.wq_a.scale"] == wm["layers.0.attn.wq_a.weight"]
    assert wm["mtp.0.ffn.experts.0.w1.scale"] == wm["mtp.0.ffn.experts.0.w1.weight"]
    assert index["metadata"]["total_size"] == sum((tmp_path / f).stat().st_size for f in files) - sum(
        8 + int.from_bytes((tmp_path / f).read_bytes()[:8], "little") for f in files)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and cfg["expert_dtype"] == "fp4"
    assert cfg["hidden_size"] == 48

    from safetensors import safe_open
    with safe_open(str(tmp_path / wm["layers.0.attn.wq_a.weight"]), "pt") as f:
        assert f.get_slice("layers.0.attn.wq_a.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("layers.0.attn.wq_a.scale").get_dtype() == "F8_E8M0"
        assert f.get_slice("layers.0.attn.wq_a.scale").get_shape() == [2, 1]
    with safe_open(str(tmp_path / wm["layers.0.ffn.experts.0.w1.weight"]), "pt") as f:
        assert f.get_slice("layers.0.ffn.experts.0.w1.weight").get_dtype() == "I8"
        assert f.get_slice("layers.0.ffn.experts.0.w1.scale").get_shape() == [64, 2]

    got, got_cfg = read_checkpoint(tmp_path)
    assert got_cfg == cfg
    _assert_same(got, _expected_after_read(t, quantized=True))
    assert got["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    bf, _ = read_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert bf["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert torch.equal(bf["layers.0.attn.wq_a.weight"].float(), got["layers.0.attn.wq_a.weight"])


def test_unquantized_single_file_and_resave(tmp_path):
    t = _official_tensors()
    save_checkpoint(tmp_path / "a", t, {"quantization_config": {}, "expert_dtype": "fp4"})
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["config.json", "model.safetensors"]
    got, cfg = read_checkpoint(tmp_path / "a")
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    _assert_same(got, _expected_after_read(t, quantized=False))
    save_checkpoint(tmp_path / "f32", t, {}, dtype=torch.float32, num_shards=2)
    _assert_same(read_checkpoint(tmp_path / "f32")[0], t)
    # re-saving into the same directory with one shard removes the stale shards and index
    save_checkpoint(tmp_path / "f32", t, {}, dtype=torch.float32)
    assert sorted(p.name for p in (tmp_path / "f32").iterdir()) == ["config.json", "model.safetensors"]


def test_make_checkpoint_tool(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import make_checkpoint

    t = _official_tensors()
    save_checkpoint(tmp_path / "src", t, {"hidden_size": 48})
    assert make_checkpoint.main(["--from", str(tmp_path / "src"), "--out", str(tmp_path / "q"),
                                 "--quantize", "--shards", "2"]) == 0
    got, cfg = read_checkpoint(tmp_path / "q")
    assert cfg["expert_dtype"] == "fp4" and len(list((tmp_path / "q").glob("*.safetensors"))) == 2
    _assert_same(got, _expected_after_read(_expected_after_read(t, False), quantized=True))
    assert make_checkpoint.main(["--from", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 1


def test_torch_without_e8m0(tmp_path, monkeypatch):
    """Old torch (no float8_e8m0fnu): scales are uint8 exponent bytes, read and written."""
    t = {"layers.0.attn.wq_a.weight": _sample((130, 40)),
         "layers.0.ffn.experts.0.w1.weight": _sample((8, 64))}
    save_checkpoint(tmp_path / "new", t, {}, quantize=True)
    want, _ = read_checkpoint(tmp_path / "new")
    monkeypatch.setattr(quant, "E8M0", None)
    _assert_same(read_checkpoint(tmp_path / "new")[0], want)  # F8_E8M0 read from raw bytes
    assert quantize_fp8(t["layers.0.attn.wq_a.weight"])[1].dtype == torch.uint8
    save_checkpoint(tmp_path / "old", t, {}, quantize=True)  # U8 scales
    monkeypatch.undo()
    _assert_same(read_checkpoint(tmp_path / "old")[0], want)


# ============================================================================ errors
def _write(d: Path, tensors: dict[str, torch.Tensor]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    save_file(tensors, str(d / "model.safetensors"))
    return d


def _err(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_error_missing_config_and_no_files(tmp_path):
    msg = _err(tmp_path)
    assert "config.json" in msg and str(tmp_path) in msg
    assert "does not exist" in _err(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    assert "no *.safetensors" in _err(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert "cannot parse" in _err(tmp_path)


def test_error_missing_shard_and_index_mismatch(tmp_path):
    save_checkpoint(tmp_path, _official_tensors(), {}, quantize=True, num_shards=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _err(tmp_path)
    assert "'ghost.weight'" in msg and "model-00001-of-00003.safetensors" in msg
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    msg = _err(tmp_path)
    assert "missing shard file model-00002-of-00003.safetensors" in msg


def test_error_corrupt_files(tmp_path):
    save_checkpoint(tmp_path, _official_tensors(), {}, num_shards=2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])  # truncated
    msg = _err(tmp_path)
    assert "corrupt" in msg and shard.name in msg
    shard.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])  # header size beyond the file
    assert shard.name in _err(tmp_path)
    shard.write_bytes(data[:5])
    assert shard.name in _err(tmp_path)


@pytest.mark.parametrize("bad", [torch.uint16, torch.complex64, torch.bool, torch.float8_e5m2])
def test_error_unsupported_dtype(tmp_path, bad):
    # Deliberately unsupported: nothing in the official checkpoint uses these dtypes.
    x = torch.zeros(4, 4, dtype=bad)
    msg = _err(_write(tmp_path, {"norm.weight": torch.ones(4), "layers.0.odd": x}))
    assert "unsupported dtype" in msg and "'layers.0.odd'" in msg
    names = {torch.uint16: "U16", torch.complex64: "C64", torch.bool: "BOOL", torch.float8_e5m2: "F8_E5M2"}
    assert names[bad] in msg


def test_error_scales(tmp_path):
    q, s = quantize_fp8(torch.randn(130, 40))
    p, s4 = quantize_fp4(torch.randn(8, 64))
    msg = _err(_write(tmp_path / "a", {"layers.0.attn.wq_a.weight": q}))
    assert "'layers.0.attn.wq_a.weight'" in msg and "no scale tensor 'layers.0.attn.wq_a.scale'" in msg
    msg = _err(_write(tmp_path / "b", {"layers.0.ffn.experts.0.w1.weight": p}))
    assert "no scale tensor 'layers.0.ffn.experts.0.w1.scale'" in msg
    msg = _err(_write(tmp_path / "c", {"x.weight": q, "x.scale": s.view(torch.uint8)[:1].contiguous()}))
    assert "'x.scale'" in msg and "expected [2, 1], found [1, 1]" in msg
    msg = _err(_write(tmp_path / "d", {"e.weight": p, "e.scale": s4[:, :1].contiguous()}))
    assert "'e.scale'" in msg and "expected [8, 2], found [8, 1]" in msg
    msg = _err(_write(tmp_path / "e", {"x.weight": q, "x.scale": s.float()}))
    assert "unsupported dtype F32 for scale tensor 'x.scale'" in msg
    msg = _err(_write(tmp_path / "f", {"x.weight": torch.ones(2), "x.scale": s}))
    assert "scale tensor 'x.scale' has no quantised weight" in msg


def test_check_tensors():
    expected = {"embed.weight": (64, 48), "layers.0.attn.wq_a.weight": (200, 48), "norm.weight": (48,),
                "head.weight": (64, 48)}
    ok = {n: torch.zeros(s) for n, s in expected.items()}
    check_tensors(ok, expected)
    with pytest.raises(CheckpointError, match=r"missing tensor 'norm.weight' and 1 more are missing"):
        check_tensors({n: ok[n] for n in ("embed.weight", "layers.0.attn.wq_a.weight")}, expected)
    with pytest.raises(CheckpointError, match=r"missing tensor 'head.weight'$"):
        check_tensors({n: ok[n] for n in list(ok)[:3]}, expected)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'extra' and 1 more"):
        check_tensors(ok | {"extra": torch.zeros(1), "extra2": torch.zeros(1)}, expected)
    hf = {"model.embed_tokens.weight": 0, "model.layers.0.self_attn.q_a_proj.weight": 0, "norm.weight": 0}
    with pytest.raises(CheckpointError, match=r"another naming scheme.*'layers.0.attn.wq_a.weight'"):
        check_tensors(hf, expected)
    bad = ok | {"layers.0.attn.wq_a.weight": torch.zeros(48, 200)}
    with pytest.raises(CheckpointError, match=r"'layers.0.attn.wq_a.weight' has shape \[48, 200\], "
                                              r"expected \[200, 48\]"):
        check_tensors(bad, expected)
    check_tensors({n: tuple(s) for n, s in expected.items()}, expected)  # shapes work too


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
