"""--quantization w8a8: the int8 kernel, FP4/FP8 -> int8 conversion, loading, `dsv4 convert`,
and the one-line errors for bad input. (The engine invariants under w8a8 run in
test_incremental.py, test_mtp.py and test_engine.py through their parametrisation, within
the model's quantisation error: see tests/model/conftest.py `bound`. What is exact is the
kernel: a row's output is bit for bit the same whatever it is batched with.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4 import LLM, SamplingParams
from dsv4.engine.config import EngineConfig, EngineConfigError
from dsv4.model import kernels
from dsv4.model.checkpoint import CheckpointError
from dsv4.model.convert import convert_checkpoint
from dsv4.model.layers import Linear
from dsv4.model.loader import load_model
from dsv4.model.quant import dequantize_fp4, quantize_fp4
from dsv4.model.w8a8 import QuantLinear, RowCounts, from_float, from_fp4, is_quantized
from tests.checkpoints import write_tiny_checkpoint


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.exact
def test_w8a8_linear_is_the_exact_int_product_rescaled():
    x = torch.randn(5, 48, generator=_g(0))
    wq, ws = from_float(torch.randn(24, 48, generator=_g(1)))
    xq, xs = kernels.quantize_tokens(x)
    acc = xq.long() @ wq.long().t()  # exact in int64
    ref = acc.float() * xs * ws
    assert torch.equal(kernels.w8a8_linear(x, wq, ws), ref)
    # rows are independent of the rows batched with them (chunked = whole relies on it)
    for i in range(5):
        assert torch.equal(kernels.w8a8_linear(x[i:i + 1], wq, ws), ref[i:i + 1])
    assert kernels.w8a8_linear(x.view(5, 1, 48), wq, ws).shape == (5, 1, 24)


@pytest.mark.exact
@pytest.mark.parametrize("k,n", [(64, 96), (256, 24), (1000, 130)])
def test_w8a8_rows_are_bitwise_independent_of_the_batch(k, n):
    """The part of w8a8 that is batch-invariant on every CPU (the suite runs it under each
    ATEN_CPU_CAPABILITY): the same float row gives the same output bits alone or among
    1..64 rows, since quantisation is per token and the int8 product is exact."""
    x = torch.randn(64, k, generator=_g(3)) * torch.logspace(-2, 2, 64)[:, None]
    wq, ws = from_float(torch.randn(n, k, generator=_g(4)))
    alone = torch.cat([kernels.w8a8_linear(x[i:i + 1], wq, ws) for i in range(64)])
    for m in (2, 3, 5, 8, 16, 17, 33, 64):
        for lo in range(0, 64, m):
            assert torch.equal(kernels.w8a8_linear(x[lo:lo + m], wq, ws), alone[lo:lo + m]), (m, lo)


def test_quantize_tokens_rounds_within_half_a_step():
    x = torch.randn(7, 33, generator=_g(2)) * torch.logspace(-3, 3, 7)[:, None]
    q, s = kernels.quantize_tokens(x)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert ((q.float() * s - x).abs() <= s / 2 * (1 + 1e-6)).all()
    zq, zs = kernels.quantize_tokens(torch.zeros(2, 8))
    assert (zq == 0).all() and torch.isfinite(zs).all()


def test_npu_layout_and_scales_reproduce_the_cpu_kernel():
    """The Ascend adapter is untested on hardware; its conversions are checked here."""
    x = torch.randn(3, 64, generator=_g(3))
    wq, ws = from_float(torch.randn(16, 64, generator=_g(4)))
    w_kn, scale = kernels.npu_weight_layout(wq, ws, torch.bfloat16)
    assert w_kn.shape == (64, 16) and scale.shape == (16,) and scale.dtype == torch.float32
    xq, xs = kernels.quantize_tokens(x)  # what npu_dynamic_quant returns: int8 and a [M] scale
    acc = torch._int_mm(xq, w_kn)
    assert torch.equal(kernels.npu_rescale_reference(acc, xs.reshape(-1), scale), kernels.w8a8_linear(x, wq, ws))


def test_kernel_check_names_the_flag():
    kernels.check_kernel("cpu")
    with pytest.raises(kernels.W8A8Error, match=r"--quantization w8a8 .*--device meta"):
        kernels.check_kernel("meta")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(kernels.W8A8Error, match=r"--quantization w8a8 on --device npu needs torch_npu"):
            kernels.check_kernel("npu")


def test_fp4_rows_convert_exactly_when_exponents_span_at_most_3():
    w = torch.randn(6, 128, generator=_g(5))
    w[3, 96:] *= 2.0 ** 6  # row 3: block exponents span > 3 -> rounded
    w[4] = 0.0  # an all-zero row is exact
    w[5, :32] = 0.0  # a zero block does not constrain the row
    packed, scale = quantize_fp4(w)
    counts = RowCounts()
    q, s = from_fp4(packed, scale, counts)
    deq = dequantize_fp4(packed, scale)
    assert (counts.exact, counts.rounded) == (5, 1)
    exact = [0, 1, 2, 4, 5]
    assert torch.equal(q[exact].float() * s[exact, None], deq[exact])
    assert q[exact].abs().max() <= 96
    assert torch.equal(q[3], from_float(deq[3:4])[0][0])  # rounded like any float row


def test_fp4_conversion_of_every_byte_and_exponent_span():
    """Random bytes (every pair of codes, -0 included, whole blocks of -0) under block
    exponents spanning 0..6: an exact row is the dequantised row, q * s, bit for bit, with
    |q| <= 96; any other row is `from_float` of it; the counts add up."""
    g = _g(11)
    for span in range(7):
        packed = torch.randint(0, 256, (48, 256), generator=g, dtype=torch.uint8)
        packed[:, 16:32] = 0x88  # a block of -0: it constrains nothing
        packed[7] = 0
        e = torch.randint(127 - span, 128, (48, 16), generator=g, dtype=torch.uint8)
        e[:, 3] = 127 - 6  # a zero-only block may not...
        packed[:, 48:64] = 0  # ...whatever its exponent
        scale = e.view(torch.float8_e8m0fnu)
        counts = RowCounts()
        q, s = from_fp4(packed.view(torch.int8), scale, counts)
        deq = dequantize_fp4(packed.view(torch.int8), scale)
        exact = (q.float() * s[:, None] == deq).all(-1)
        assert counts.exact + counts.rounded == 48 and int(exact.sum()) >= counts.exact >= 1
        assert q[exact].abs().max() <= 96
        for r in (~exact).nonzero().flatten().tolist():
            assert torch.equal(q[r], from_float(deq[r:r + 1])[0][0]), (span, r)
        if span <= 3:
            assert counts.rounded == 0 and bool(exact.all())


def test_rule_covers_the_large_linears_only():
    assert is_quantized("layers.3.attn.wq_a") and is_quantized("layers.3.attn.indexer.compressor.wkv")
    assert is_quantized("layers.0.ffn.experts.7.w2") and is_quantized("mtp.0.e_proj")
    assert is_quantized("layers.1.ffn.shared_experts.w1")
    assert not is_quantized("head") and not is_quantized("layers.1.ffn.gate")


def _logits(model, n=70):
    ids = torch.randint(0, 4096, (1, n), generator=_g(0))
    return model(ids)


def test_load_w8a8_converts_each_tensor_and_fuses(tmp_path):
    model = write_tiny_checkpoint(tmp_path, quantize=True, num_shards=2, with_tokenizer=False)
    counts = RowCounts()
    m = load_model(tmp_path, quantization="w8a8", counts=counts)
    assert counts.exact + counts.rounded == sum(p.shape[0] for n, p in model.named_parameters()
                                                if ".experts." in n)
    sd = m.state_dict()
    assert sd["layers.1.attn.wq_a.weight"].dtype == torch.int8
    assert sd["layers.1.attn.wq_a.scale"].dtype == torch.float32
    assert sd["head.weight"].dtype == torch.float32 and sd["layers.1.ffn.gate.weight"].dtype == torch.float32
    unfused = load_model(tmp_path, quantization="w8a8", fuse=False)
    assert torch.equal(_logits(m), _logits(unfused))  # fused int8 rows + scales = one by one
    assert isinstance(m.layers[1].attn.wq_a, QuantLinear) and not isinstance(m.head, QuantLinear)
    none = load_model(tmp_path)
    a, b = _logits(m)[0], _logits(none)[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9  # close to the float model


def test_convert_then_load_is_bit_identical_to_converting_at_load(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    write_tiny_checkpoint(src, quantize=True)
    counts = convert_checkpoint(src, dst, shard_bytes=200_000)
    assert counts.exact + counts.rounded > 0
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["dsv4_quantization"] == "w8a8" and "quantization_config" not in cfg
    assert len(list(dst.glob("model-*-of-*.safetensors"))) > 1 and (dst / "tokenizer.json").is_file()
    at_load = load_model(src, quantization="w8a8")
    converted = load_model(dst)  # no flag: the config says w8a8
    for k, v in at_load.state_dict().items():
        assert torch.equal(converted.state_dict()[k], v), k
    assert torch.equal(_logits(converted), _logits(at_load))
    llm = LLM(str(dst), max_model_len=64)
    assert llm.engine.config.quantization == "w8a8"
    assert llm.engine.status()["weight_bytes"] < LLM(str(src), max_model_len=64).engine.status()["weight_bytes"]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    with pytest.raises(EngineConfigError, match=r"--quantization none: .* is a w8a8 conversion"):
        EngineConfig.create(model=str(dst), quantization="none")
    with pytest.raises(CheckpointError, match="already a w8a8 conversion"):
        convert_checkpoint(dst, tmp_path / "again")
    with pytest.raises(CheckpointError, match="not empty"):
        convert_checkpoint(src, dst)


def _in_file_mappings(t: torch.Tensor) -> bool:
    spans = [tuple(int(x, 16) for x in ln.split()[0].split("-"))
             for ln in open("/proc/self/maps").read().splitlines() if ".safetensors" in ln]
    return any(a <= t.data_ptr() < b for a, b in spans)


def test_a_converted_checkpoint_loads_as_the_files_pages(tmp_path):
    """`dsv4 convert` lays every fused group (attention's projections of x, each MoE's stacked
    w1|w3 and w2, the row scales) back to back in one shard, so the loader maps every tensor
    (fused ones included) instead of copying it: each lies in a mapping of a shard, equals
    the file's tensor as safetensors reads it, and the model computes what converting at load
    does. The files stay valid safetensors (every tensor read back by the library)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    write_tiny_checkpoint(src, quantize=True)
    convert_checkpoint(src, dst, shard_bytes=200_000)
    stored = {}
    for f in sorted(dst.glob("*.safetensors")):
        stored.update(load_file(f))
    m = load_model(dst)
    sd = m.state_dict()
    assert set(sd) == set(stored)
    for k, v in sd.items():
        assert _in_file_mappings(v), k
        assert torch.equal(v, stored[k]), k
    moe = m.layers[0].ffn
    assert _in_file_mappings(moe.stacked["w13"]) and moe.stacked["w13"].data_ptr() == moe.experts[0].w1.weight.data_ptr()
    assert m.layers[0].attn.fused.current(m.layers[0].attn._x_linears())
    assert torch.equal(_logits(m), _logits(load_model(src, quantization="w8a8")))


def _tamper(dst, fn):
    f = next(p for p in sorted(dst.glob("*.safetensors")) if "layers.1.attn.wq_b.weight" in load_file(p))
    sd = load_file(f)
    fn(sd)
    save_file(sd, f)


@pytest.mark.parametrize("what,msg", [
    ("missing_scale", r"'layers\.1\.attn\.wq_b\.weight' \(I8\) has no scale tensor 'layers\.1\.attn\.wq_b\.scale'"),
    ("scale_shape", r"int8 weight 'layers\.1\.attn\.wq_b\.weight' .* float32 scale 'layers\.1\.attn\.wq_b\.scale'"),
    ("weight_shape", r"tensor 'layers\.1\.attn\.wq_b\.(weight|scale)' has shape"),
])
def test_broken_conversion_names_the_tensor(tmp_path, what, msg):
    src, dst = tmp_path / "src", tmp_path / "dst"
    write_tiny_checkpoint(src, with_tokenizer=False)
    convert_checkpoint(src, dst)
    name = "layers.1.attn.wq_b"
    if what == "missing_scale":
        _tamper(dst, lambda sd: sd.pop(f"{name}.scale"))
        idx = json.loads((dst / "model.safetensors.index.json").read_text())
        del idx["weight_map"][f"{name}.scale"]
        (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    elif what == "scale_shape":
        _tamper(dst, lambda sd: sd.__setitem__(f"{name}.scale", sd[f"{name}.scale"][:-1].clone()))
    else:
        _tamper(dst, lambda sd: (sd.__setitem__(f"{name}.weight", sd[f"{name}.weight"][:-1].clone()),
                                 sd.__setitem__(f"{name}.scale", sd[f"{name}.scale"][:-1].clone())))
    with pytest.raises(CheckpointError, match=msg) as e:
        load_model(dst)
    assert "\n" not in str(e.value)


def test_unknown_quantization_names_the_flag(tmp_path):
    write_tiny_checkpoint(tmp_path, with_tokenizer=False)
    with pytest.raises(EngineConfigError, match=r"--quantization 'int4' is not supported; use none, w8a8, mxfp4 or w8a8-mxfp4"):
        EngineConfig.create(model=str(tmp_path), quantization="int4")
    with pytest.raises(CheckpointError, match=r"--quantization 'int4'"):
        load_model(tmp_path, quantization="int4")
    with pytest.raises(CheckpointError, match="convert writes w8a8 checkpoints only"):
        convert_checkpoint(tmp_path, tmp_path / "out", quantization="none")


def test_w8a8_drafts_through_an_int8_head_and_verifies_through_the_exact_one(tmp_path):
    """Under w8a8 the MTP's logits come from an int8 copy of the head (a draft reads half
    the head's bytes); the main model's logits still come from the float head, bit for bit,
    and the draft head is each row of the head quantised (`kernels.quantize_rows`)."""
    from dsv4.model.state import Batch

    write_tiny_checkpoint(tmp_path, quantize=True, with_tokenizer=False)
    m = load_model(tmp_path, quantization="w8a8")
    assert m.draft_head is not None and m.draft_head["weight"].dtype == torch.int8
    q, s = kernels.quantize_rows(m.head.weight)
    assert torch.equal(m.draft_head["weight"], q) and torch.equal(m.draft_head["scale"], s)
    assert load_model(tmp_path).draft_head is None  # unquantised: the drafts read the head itself
    ids = torch.randint(2, m.cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        h, main = m.forward_batch(Batch.whole(ids[None]), None)
        _, draft = m.mtp_forward(Batch.whole(ids[None]), h, None)
        head, m.draft_head = m.draft_head, None
        h2, main_exact = m.forward_batch(Batch.whole(ids[None]), None)
        _, draft_exact = m.mtp_forward(Batch.whole(ids[None]), h2, None)
        m.draft_head = head
    assert torch.equal(main, main_exact)  # verification: the float head
    assert not torch.equal(draft, draft_exact)  # drafting: the int8 one ...
    assert (draft.argmax(-1) == draft_exact.argmax(-1)).float().mean() >= 0.8  # ... close to it
    rel = (draft - draft_exact).abs().max() / draft_exact.abs().max()
    assert rel < 0.05, rel


@pytest.mark.parametrize("rows,width", [(1, 64), (4, 64), (5, 64), (1, 24), (1, 17)])
def test_draft_head_kernel_is_the_int8_head(rows, width):
    """`kernels.draft_linear`: bf16 drafts of few rows through int8 weight-only mm, others
    W8A8 (and widths that are not a multiple of 16, where torch's kernel gives NaN or
    crashes); both are the int8 head (to the rounding of bf16 activations / int8 ones)."""
    w = torch.randn(300, width, generator=torch.Generator().manual_seed(0))
    q, s = kernels.quantize_rows(w)
    head = {"weight": q, "scale": s, "scale_bf16": s.to(torch.bfloat16)}
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    exact = x.float() @ (q.float() * s[:, None]).t()  # the int8 head on the bf16 activations
    got = kernels.draft_linear(x, head)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 300)
    assert (got.float() - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.exact
def test_int8_modes_keep_an_official_bf16_head_as_stored(tmp_path):
    """An official checkpoint's BF16 head stays BF16 under the int8 modes on the CPU (half
    the bytes a decode step reads through it) and is multiplied widened as read: the logits
    are those of the same head in float32 to float32 rounding, and the int8 draft head is
    the same quantisation of the same values. A float32-stored head, and `--quantization
    none`, stay float32."""
    write_tiny_checkpoint(tmp_path / "bf16", quantize=True, with_tokenizer=False, head_bf16=True)
    write_tiny_checkpoint(tmp_path / "f32", quantize=True, with_tokenizer=False)
    for q in ("w8a8", "w8a8-mxfp4"):
        m = load_model(tmp_path / "bf16", quantization=q)
        assert m.head.weight.dtype == torch.bfloat16, q
        assert load_model(tmp_path / "f32", quantization=q).head.weight.dtype == torch.float32, q
        wide = load_model(tmp_path / "bf16", quantization=q)
        wide.head.weight.data = wide.head.weight.data.float()  # the same values, as a plain float32 head
        wide.head.__class__ = Linear
        wq, ws = kernels.quantize_rows(wide.head.weight)
        assert torch.equal(m.draft_head["weight"], wq) and torch.equal(m.draft_head["scale"], ws)
        a, b = _logits(m), _logits(wide)
        assert a.dtype == torch.float32 and (a - b).abs().max() <= 1e-5 * b.abs().max(), q
    assert load_model(tmp_path / "bf16").head.weight.dtype == torch.float32
