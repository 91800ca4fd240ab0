"""The MTP block against a composition by hand (docs/architecture.md, "The model in one paragraph"), with
transformers' decoder layer and hyper-connection head as the independent block."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.hf_compat import hf_config_dict, official_to_hf
from dsv4.model.mxfp4 import FP4Linear
from dsv4.model.state import Batch
from dsv4.model.w8a8 import QuantLinear
from tests.model.tiny import tiny_config

pytestmark = pytest.mark.exact  # also run under other CPU kernels (test.sh)

hf_mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_mtp_equals_composition_by_hand(tiny_model):
    model, cfg = tiny_model, tiny_model.cfg
    if any(isinstance(m, (QuantLinear, FP4Linear)) for m in model.modules()):
        pytest.skip("parity with transformers' float layer; w8a8 MTP is checked against itself "
                    "(test_mtp_stateful_chunks_equal_whole, tests/model/test_engine.py), MXFP4 "
                    "experts against their float twin (tests/model/test_mxfp4.py)")
    S = 60  # longer than the window of 12
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(11))
    hidden, _ = model.forward_batch(Batch.whole(ids), None)  # [S, hc, D]
    z, logits = model.mtp_forward(Batch.whole(ids[:, 1:].contiguous()), hidden[:-1], None)

    # by hand: e = enorm(embed(x_{t+1})), h = hnorm(h_t), z = e_proj(e) + h_proj(h)
    sd = {k[len("mtp.0."):]: v for k, v in model.state_dict().items() if k.startswith("mtp.0.")}
    e = _rms(model.embed.weight[ids[0, 1:]], sd["enorm.weight"])
    h = _rms(hidden[:-1], sd["hnorm.weight"])
    z0 = (e @ sd["e_proj.weight"].T)[:, None, :] + h @ sd["h_proj.weight"].T  # [S-1, hc, D]

    # the block: one transformers decoder layer (sliding window, score-routed MoE)
    one = tiny_config(num_hidden_layers=1, compress_ratios=[0, 0], num_hash_layers=0)
    hcfg = hf_mod.DeepseekV4Config(**hf_config_dict(one))
    layer = hf_mod.DeepseekV4DecoderLayer(hcfg, 0).eval()
    block = {f"layers.0.{k}": v for k, v in sd.items()
             if not k.split(".")[0] in ("enorm", "hnorm", "norm", "e_proj", "h_proj")
             and not k.startswith("hc_head")}
    conv = official_to_hf(block, one)
    layer.load_state_dict({k[len("model.layers.0."):]: v for k, v in conv.items()}, strict=True)
    pos = torch.arange(S - 1)[None]
    rot = hf_mod.DeepseekV4RotaryEmbedding(hcfg)
    pe = {t: rot(z0, pos, layer_type=t) for t in ("main", "compress")}
    i = torch.arange(S - 1)
    mask = torch.zeros(S - 1, S - 1).masked_fill((i[None] > i[:, None]) | (i[None] <= i[:, None] - cfg.sliding_window),
                                                 float("-inf"))[None, None]
    with torch.no_grad():
        zb = layer(z0[None], position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=None)[0]
        head = hf_mod.DeepseekV4HyperHead(hcfg)
        head.load_state_dict({"hc_fn": sd["hc_head_fn"], "hc_base": sd["hc_head_base"],
                              "hc_scale": sd["hc_head_scale"]})
        ref_logits = _rms(head(zb[None])[0], sd["norm.weight"]) @ model.head.weight.T
    assert (z - zb).abs().max().item() <= 1e-4
    assert (logits - ref_logits).abs().max().item() <= 1e-4


def test_mtp_stateful_chunks_equal_whole(tiny_model):
    model = tiny_model
    S = 80
    ids = torch.randint(0, model.cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(12))
    hidden, _ = model.forward_batch(Batch.whole(ids), None)
    _, whole = model.mtp_forward(Batch.whole(ids[:, 1:].contiguous()), hidden[:-1], None)
    state = model.new_state(1, 128, max_chunk=32)
    outs, t = [], 0
    for n in (5, 1, 13, 30, 30):  # pairs (h_t, x_{t+1}) for t in 0..78, in chunks
        b = Batch.build([(0, t, ids[0, t + 1:t + 1 + n].tolist())])
        outs.append(model.mtp_forward(b, hidden[t:t + n], state)[1])
        t += n
    assert t == S - 1
    assert (torch.cat(outs) - whole).abs().max().item() <= _mtp_bound(model, ids, whole)


def _mtp_bound(model, ids: torch.Tensor, whole: torch.Tensor) -> float:
    """float32: 1e-5. w8a8: the MTP's own quantisation error on these ids (max |w8a8 - float32
    MTP logits| of one whole pass), the w8a8 promise of conftest.bound: chunking moves the
    logits by less than quantisation does (per-token rounding turns the float kernels' last-bit
    differences between batch shapes into one-step int8 flips; ATEN_CPU_CAPABILITY=default
    shows it). A chunking bug moves them by their own scale."""
    twin = getattr(model, "float_twin", None)
    if twin is None:
        return 1e-5
    with torch.inference_mode():
        hidden, _ = twin.forward_batch(Batch.whole(ids), None)
        _, ref = twin.mtp_forward(Batch.whole(ids[:, 1:].contiguous()), hidden[:-1], None)
    return (whole - ref).abs().max().item()
