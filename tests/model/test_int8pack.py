"""W8A8 weights prepacked for oneDNN (`dsv4/model/int8pack.py`): the same bits as plain
int8 through `torch._int_mm` at every step the engine runs, no second copy of the weights,
no compiled steps over them, and off on kernels that are not exact."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import dsv4
from dsv4 import LLM, SamplingParams
from dsv4.model import int8pack, kernels
from dsv4.model.model import DeepseekV4, init_random
from dsv4.model.moe import gathered
from dsv4.model.state import Batch
from dsv4.model.w8a8 import QuantLinear, from_float, to_w8a8
from tests.model.tiny import tiny_config

needs_exact = pytest.mark.skipif(not int8pack.exact(), reason="this CPU's oneDNN int8 kernels are not exact "
                                 "(AVX-512 without VNNI saturates): packing is off here")


def _w8a8_model(pack: bool) -> DeepseekV4:
    torch.manual_seed(0)
    model = to_w8a8(init_random(DeepseekV4(tiny_config()), seed=0).eval()).fuse_projections()
    if pack:
        assert int8pack.pack_model(model, min_bytes=0) > 0
    return model


def _steps(model: DeepseekV4) -> list[torch.Tensor]:
    """Chunked prefill of two requests (one batched with the other's second chunk), a
    2-token verify step of both, the MTP over the prefill, a rollback and a 1-token step."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(2, 128, (30,), generator=g).tolist(), torch.randint(2, 128, (12,), generator=g).tolist()
    st = model.new_state(2, 128, max_chunk=64)
    out = []
    with torch.inference_mode():
        h0, lg = model.forward_batch(Batch.build([(0, 0, a[:7])]), st)
        out.append(lg)
        h1, lg = model.forward_batch(Batch.build([(0, 7, a[7:]), (1, 0, b)]), st)
        out.append(lg)
        out.append(model.forward_batch(Batch.build([(0, 30, [5, 6]), (1, 12, [7, 8])]), st)[1])
        z, lg = model.mtp_forward(Batch.build([(0, 0, a[1:7] + [a[7]])]), h0, st, None)
        out += [z, lg]
        st.rollback(0, 31)
        out.append(model.forward_batch(Batch.build([(0, 31, [9])]), st)[1])
    return out


@needs_exact
@pytest.mark.exact
def test_packed_int8_is_bit_for_bit_the_plain_model():
    plain, packed = _steps(_w8a8_model(False)), _steps(_w8a8_model(True))
    assert len(plain) == len(packed) == 6
    for i, (x, y) in enumerate(zip(plain, packed)):
        assert torch.equal(x, y), f"output {i} differs by {(x - y).abs().max().item()}"


@needs_exact
@pytest.mark.exact
def test_packed_matmul_is_the_exact_int_product_at_every_row_count():
    g = torch.Generator().manual_seed(0)
    wq, ws = from_float(torch.randn(72, 200, generator=g))
    p = int8pack.pack(wq)
    for m in (1, 2, 5, 17, 64):
        x = torch.randn(m, 200, generator=g)
        xq, xs = kernels.quantize_tokens(x)
        ref = (xq.long() @ wq.long().t()).float() * xs * ws  # exact in int64
        assert torch.equal(kernels.w8a8_linear(x, p, ws), ref)
        assert torch.equal(kernels.w8a8_linear(x[:1], p, ws), ref[:1])  # alone = batched


@needs_exact
def test_packing_keeps_one_copy_and_plain_reads_fail_loudly():
    model = _w8a8_model(True)
    int8 = sum(m.weight.numel() for m in model.modules() if isinstance(m, QuantLinear))
    assert int8pack.packed_bytes(model) == int8  # every int8 weight, once (the stacked experts' views too)
    sd = model.state_dict()
    assert all(t.is_meta for k, t in sd.items() if t.dtype == torch.int8)
    assert not any(t.is_meta for t in sd.values() if t.dtype != torch.int8)  # scales, norms, head stay
    moe = model.layers[0].ffn
    assert moe.packed and isinstance(moe.stacked["w13"], list)
    wq = model.layers[0].attn.wq_b
    with pytest.raises(RuntimeError, match="prepacked"):  # the plain weight is gone (torch._int_mm would read
        kernels.w8a8_linear(torch.randn(1, wq.weight.shape[1]), wq.weight, wq.scale)  # garbage from it)
    with pytest.raises(RuntimeError, match="prepacked"):
        x = torch.randn(2, model.cfg.hidden_size)
        gathered(torch.zeros(2, model.cfg.hidden_size), x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), moe)


def test_small_weights_stay_plain():
    model = _w8a8_model(False)
    assert int8pack.pack_model(model) == 0  # the tiny model's weights are all under MIN_BYTES
    assert not any(t.is_meta for t in model.state_dict().values())


@needs_exact
def test_engine_packs_w8a8_and_serves_the_same_tokens(monkeypatch):
    """The engine loads w8a8 packed (compile auto says why it stays off) and its tokens,
    drafts and logprobs are the plain model's."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    prompt = list(range(10, 50))

    def run() -> tuple[list, list, str, int, int]:
        with LLM(dsv4.DEFAULT_MODEL, quantization="w8a8", num_speculative_tokens=1, compile="auto") as llm:
            out = llm.generate([prompt], params)[0]
            lps = out.logprobs
            m = llm.engine.model
            assert ("packed" in m.draft_head) == (int8pack.MIN_BYTES == 0 and int8pack.fast())  # the MTP's int8 head too
            return (out.token_ids, lps, llm.engine.compile_note, int8pack.packed_bytes(m),
                    out.metrics["spec"]["drafted"])

    ids, lps, note, packed, drafted = run()
    assert packed == 0  # the embedded model's int8 weights are under MIN_BYTES
    monkeypatch.setattr(int8pack, "MIN_BYTES", 0)
    monkeypatch.setattr(int8pack, "fast", lambda: False)  # oneDNN's reference kernel only: never packed
    assert run()[3] == 0
    monkeypatch.setattr(int8pack, "fast", lambda: True)  # the speed probe's verdict aside: packing is exact
    ids2, lps2, note2, packed2, drafted2 = run()
    assert packed2 > 0 and "prepacked" in note2 and "prepacked" not in note
    assert ids2 == ids and lps2 == lps and drafted2 > 0 and drafted > 0  # the drafts through the packed head
    assert int8pack.describe(_w8a8_model(True)).startswith("w8a8: 0.00 GiB of int8 weights prepacked")


def _flags() -> str:
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


def _under_isa(isa: str, code: str) -> str:
    """`code`'s stdout in a fresh interpreter whose oneDNN is held to `isa`."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


CHECK = ("import torch; from dsv4.model import int8pack, kernels\n"
         "g = torch.Generator().manual_seed(3)\n"
         "w = torch.randint(-127, 128, (300, 4096), dtype=torch.int8, generator=g); w[0] = 127\n"
         "x = torch.randint(-127, 128, (33, 4096), dtype=torch.int8, generator=g); x[0] = 127\n"
         "ref = x.long() @ w.long().t()\n"
         "print(int8pack.cpu_saturates(), int8pack.exact(), torch.equal(kernels.int_mm(x, w).long(), ref),\n"
         "      torch.equal(torch._int_mm(x, w.t()).long(), ref))")


@pytest.mark.skipif(" avx2" not in _flags(), reason="needs an x86 CPU with AVX2")
def test_int8_products_stay_exact_where_onednn_saturates():
    """oneDNN without VNNI adds u8 x s8 pairs in int16 (the int8 activation shifted by 128):
    a row of 127s against a row of 127s comes out near 0.5 M instead of 66 M. Held to AVX2,
    `torch._int_mm` is that wrong, the process says so, `kernels.int_mm` splits the weight
    and stays exact, and packing (which saturates there too) stays off."""
    saturates, packed_exact, int_mm_exact, raw_exact = _under_isa("AVX2", CHECK).split()
    assert (saturates, packed_exact, int_mm_exact, raw_exact) == ("True", "False", "True", "False")


@pytest.mark.skipif(" avx512f" not in _flags(), reason="needs an AVX-512 CPU")
def test_packing_is_exact_on_avx512_without_vnni():
    """AVX-512 without VNNI: `torch._int_mm` saturates (split), oneDNN's packed kernel does
    not, so packing stays on, and both give the exact product."""
    assert _under_isa("AVX512_CORE", CHECK).split() == ["True", "True", "True", "False"]


def test_the_split_product_is_exact_on_saturating_rows():
    g = torch.Generator().manual_seed(4)
    w = torch.randint(-127, 128, (40, 512), dtype=torch.int8, generator=g)
    x = torch.randint(-127, 128, (5, 512), dtype=torch.int8, generator=g)
    w[0], w[1], x[0], x[1, ::2], x[1, 1::2] = 127, -127, 127, 127, -127
    assert torch.equal(int8pack.split_mm(x, w).long(), x.long() @ w.long().t())
    assert int8pack.exact_product(int8pack.split_mm)


def test_onednn_isa_is_the_cpus_best_under_the_cap(monkeypatch):
    """The banner's instruction set for the packed int8 matmul: the CPU's best level, held
    down by ONEDNN_MAX_CPU_ISA as oneDNN itself is (test.sh's avx2 and default passes)."""
    c = torch.cpu
    best = ("AMX" if c._is_amx_tile_supported() else
            ("AVX-512 VNNI" if c._is_vnni_supported() else "AVX-512") if c._is_avx512_supported() else
            "AVX2" if c._is_avx2_supported() else "SSE4.1")
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    assert int8pack.onednn_isa() == best
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert int8pack.onednn_isa() == best
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    assert int8pack.onednn_isa() == "SSE4.1"
    if best != "SSE4.1":
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        assert int8pack.onednn_isa() == "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")  # a cap above the CPU: its own best
    assert int8pack.onednn_isa() == best
    assert f"({int8pack.onednn_isa()})" in int8pack.describe(_w8a8_model(True))


def test_the_speed_probe_runs_on_one_thread_and_restores_the_count(monkeypatch):
    """`fast()` times on one thread (a team beside a busy core stalls and once judged the real
    kernel slow: a daemon then served unpacked, 1.4x slower) and gives the count back."""
    seen: list[int] = []
    real_mm = int8pack.mm
    monkeypatch.setattr(int8pack, "mm", lambda x, p: (seen.append(torch.get_num_threads()), real_mm(x, p))[1])
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        int8pack.fast.cache_clear()
        int8pack.fast()
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
        int8pack.fast.cache_clear()
