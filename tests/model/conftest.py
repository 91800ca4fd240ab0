"""Shared fixtures for the model tests: tiny random models, fp32 on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4.model.layers import StoredLinear
from dsv4.model.model import DeepseekV4, init_random
from dsv4.model.mxfp4 import ROUTED_RULE, to_mxfp4
from dsv4.model.quant import dequantize_fp4, quantize_fp4
from dsv4.model.w8a8 import to_w8a8
from tests.checkpoints import write_tiny_checkpoint
from tests.model.tiny import tiny_config


# The w8a8 variant routes densely (every token to all 8 experts, the indexer keeps every
# entry): see `bound`.
W8A8_DENSE = {"num_experts_per_tok": 8, "index_topk": 64}
TOL = 1e-5  # float32: chunked = whole, decode = forward, batched = alone hold to this


@pytest.fixture(scope="session", params=["plain", "fused", "w8a8-fused", "mxfp4-fused", "w8a8-mxfp4-fused"])
def tiny_model(request) -> DeepseekV4:
    """The same random model as built (what training uses), with its projections fused
    (what `load_model` and the engine use), fused with int8 weights (`--quantization
    w8a8`; fused = unfused for it is checked in test_w8a8.py), and fused with the routed
    experts kept MXFP4 (`--quantization mxfp4`: float activations, and `w8a8-mxfp4`: int8
    activations, the rest w8a8): every test of it runs on all five, so the invariants
    (chunked = whole, rollback, MTP, prefix hits) hold for each format. The int8-activation
    models hold their head in bfloat16, as the loader keeps an official checkpoint's (read by
    `fp4_kernel.linear_bf16`), and carry `float_twin`, the same weights in float32 (see `bound`)."""
    quantized = "w8a8" in request.param
    over = W8A8_DENSE if quantized else {}

    def build(twin: bool) -> DeepseekV4:
        torch.manual_seed(0)
        m = init_random(DeepseekV4(tiny_config(**over)), seed=0).eval()
        if "mxfp4" in request.param:  # the experts as FP4 stores them: the twin holds them dequantised
            fp4_experts(m) if twin else to_mxfp4(m, act_int8=quantized)
        if quantized:  # the head as an official checkpoint stores it, kept so (loader.head_as_stored)
            if twin:
                m.head.weight.data = m.head.weight.data.to(torch.bfloat16).float()
            else:
                StoredLinear.keep(m.head)
        if quantized and not twin:
            to_w8a8(m)
        return m.fuse_projections() if twin or request.param.endswith("fused") else m

    model = build(twin=False)
    if quantized:
        model.float_twin = build(twin=True)
    return model


def fp4_experts(model: DeepseekV4) -> DeepseekV4:
    """Round every routed expert's weights to MXFP4 and back, in place (exact in float32):
    the float model whose experts are those an mxfp4 mode holds."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if ROUTED_RULE.fullmatch(name):
                mod.weight.copy_(dequantize_fp4(*quantize_fp4(mod.weight.float())))
    return model


def bound(model: DeepseekV4, ids: list[int]) -> float:
    """How far two evaluations of `model` on `ids` may differ when only the batch shape
    (chunking, batching, speculation) differs.

    float32: `TOL`. w8a8: the model's own quantisation error on these ids, max |w8a8 logits -
    float32 logits| of one whole forward. Per-token int8 rounding turns the last-bit
    differences of float kernels chosen by shape and by CPU (MKL, ATen's capability) into
    one-step flips of a token's int8 activations, so the w8a8 promise is "batch shape moves
    the logits by less than quantisation itself does" (measured: at most 0.57 of it, over
    10 prompts x 6 chunk plans under ATEN_CPU_CAPABILITY default, avx2 and avx512), not
    equality. A discrete choice (router or indexer top-k) near a tie can flip too and move
    a logit by as much as quantisation does, which is why the w8a8 twin routes densely:
    every expert and every entry, so only the rounding itself is left to bound. A chunking
    or state bug moves logits by their own scale (~1 here, 8x this bound)."""
    twin = getattr(model, "float_twin", None)
    if twin is None:
        return TOL
    with torch.inference_mode():
        x = torch.tensor([ids])
        return (model(x)[0] - twin(x)[0]).abs().max().item()


def assert_chains_agree(out: list[list[int]], ref: list[list[int]], prompts: list[list[int]],
                        model: DeepseekV4 | None = None, float_model: DeepseekV4 | None = None) -> None:
    """Greedy chains `out` equal `ref` token for token; with a w8a8 `model` (and `float_model`,
    its weights in float32), equal up to the first token whose reference margin (top-1 minus
    top-2 logit of `model`) is within twice the quantisation error on that sequence: batch shape
    moves w8a8 logits by less than that (`bound`), so only such near-ties may go either way."""
    if model is None:
        assert out == ref
        return
    for p, o, r in zip(prompts, out, ref, strict=True):
        assert len(o) == len(r)
        i = next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), None)
        if i is None:
            continue
        with torch.inference_mode():
            x = torch.tensor([p + r[:i]])
            logits = model(x)[0]
            err = (logits - float_model(x)[0]).abs().max().item()
        top2 = logits[-1].topk(2).values
        margin = (top2[0] - top2[1]).item()
        assert margin <= 2 * err, (len(p), i, margin, err)


def prefill(model: DeepseekV4, state, slot: int, ids: list[int], plan: list[int]):
    """Prefill `ids` into `slot` chunk by chunk -> (hidden [S, hc, D], logits [S, V])."""
    from dsv4.model.state import Batch

    hs, ls, start = [], [], 0
    for n in plan:
        b = Batch.build([(slot, start, ids[start:start + n])])
        h, lg = model.forward_batch(b, state)
        hs.append(h)
        ls.append(lg)
        start += n
    assert start == len(ids)
    return torch.cat(hs), torch.cat(ls)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny checkpoint (`write_tiny_checkpoint`), written once for the engine tests."""
    d = tmp_path_factory.mktemp("tiny-checkpoint")
    write_tiny_checkpoint(d)
    return d


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DeepseekV4]:
    """The w8a8 tests' checkpoint: routes densely (`bound`); (path, its float32 model)."""
    d = tmp_path_factory.mktemp("tiny-dense")
    return d, write_tiny_checkpoint(d, **W8A8_DENSE)
