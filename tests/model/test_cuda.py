"""The exactness checks again on a CUDA device (skipped without one).

Run on a lent GPU machine by `scripts/gpu_check.sh`. float32 with TF32 off, so that
chunked == whole and MTP on == off are as exact as on the CPU; bf16 (the GPU default)
gets a smoke test with a real acceptance rate.
"""

from __future__ import annotations

import pytest
import torch

import dsv4
from dsv4 import LLM, SamplingParams
from dsv4.model.loader import load_model
from dsv4.model.state import Batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _ids(n: int) -> torch.Tensor:
    return torch.randint(2, 4096, (1, n), generator=torch.Generator().manual_seed(n))


def test_forward_matches_cpu():
    ids = _ids(300)
    cpu = load_model(dsv4.DEFAULT_MODEL)(ids)
    gpu = load_model(dsv4.DEFAULT_MODEL, device="cuda")(ids.cuda()).cpu()
    assert (cpu - gpu).abs().max().item() < 1e-3


def test_chunked_prefill_equals_whole_on_cuda():
    model = load_model(dsv4.DEFAULT_MODEL, device="cuda")
    ids = _ids(300)[0].tolist()
    whole = model(torch.tensor([ids], device="cuda"))[0]
    state = model.new_state(1, 512, max_chunk=128)
    outs, start = [], 0
    with torch.inference_mode():
        for n in (50, 128, 100, 1, 21):
            outs.append(model.forward_batch(Batch.build([(0, start, ids[start:start + n])], "cuda"), state)[1])
            start += n
    assert (torch.cat(outs) - whole).abs().max().item() < 1e-4


def test_mtp_on_equals_off_on_cuda():
    llm = LLM(device="cuda", dtype="float32", max_num_seqs=4, max_model_len=1024)
    prompts = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak.", "KING."]
    on = llm.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))
    off = llm.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True, speculative=False))
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert sum(c.metrics["spec"]["accepted"] for c in on) > 0


def test_bf16_engine_on_cuda():
    llm = LLM(device="cuda", max_num_seqs=4, max_model_len=1024)  # dtype auto: bfloat16
    out = llm.generate(["ROMEO:", "KING."], SamplingParams(max_tokens=32, ignore_eos=True))
    assert all(len(c.token_ids) == 32 for c in out)
    drafted = sum(c.metrics["spec"]["drafted"] for c in out)
    assert drafted > 0 and sum(c.metrics["spec"]["accepted"] for c in out) / drafted > 0.3


@pytest.mark.parametrize("M,K,N", [(1, 64, 24), (5, 60, 30), (40, 4096, 4096)])
def test_w8a8_linear_on_cuda_equals_cpu(M, K, N):
    """`torch._int_mm` on CUDA needs M > 16 and K, N multiples of 8: the kernel pads; the
    integer product is exact, so the result equals the CPU's."""
    from dsv4.model import kernels
    from dsv4.model.w8a8 import from_float

    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g)
    wq, ws = from_float(torch.randn(N, K, generator=g))
    cpu = kernels.w8a8_linear(x, wq, ws)
    gpu = kernels.w8a8_linear(x.cuda(), wq.cuda(), ws.cuda()).cpu()
    assert torch.allclose(gpu, cpu, rtol=1e-6, atol=0)  # same integers; float rescale may differ in the last bit
