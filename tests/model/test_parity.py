"""dsv4's model against transformers' independent DeepseekV4ForCausalLM, same weights."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.hf_compat import hf_config_dict, hf_to_official, official_to_hf
from dsv4.model.model import DeepseekV4, init_random
from tests.model.tiny import tiny_config

pytestmark = pytest.mark.exact  # also run under other CPU kernels (test.sh)

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("over", [
    {},  # hc_mult 4: window, CSA(4), HCA(8), CSA(4)
    {"hc_mult": 2, "compress_ratios": [4, 8, 0, 4, 0], "num_hash_layers": 2, "sliding_window": 8},
])
def test_logits_match_transformers(over):
    cfg = tiny_config(**over)
    torch.manual_seed(1)
    model = init_random(DeepseekV4(cfg, with_mtp=False), seed=1).eval()
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**hf_config_dict(cfg))).eval()
    missing, unexpected = hf.load_state_dict(official_to_hf(model.state_dict(), cfg), strict=False)
    assert not missing and not unexpected
    # the conversion is a bijection on names
    assert set(hf_to_official(hf.state_dict())) == set(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(2))
    # 150 tokens: many windows of 8/12, 37 CSA entries against index_topk 5
    assert 150 // 4 > cfg.index_topk and 150 > cfg.sliding_window
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits
    out = model(ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-4
