"""The embedded model's directory works for Hugging Face based clients (lm-eval, `vllm bench
serve --tokenizer DIR`): transformers loads its config and tokenizer, and counts a prompt's
tokens as dsv4 does (BOS only where tokenizer_config.json says so).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import dsv4
from dsv4.config import ConfigError, ModelConfig
from dsv4.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TINY = Path(dsv4.DEFAULT_MODEL)
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun."


def test_autoconfig_loads_the_embedded_model() -> None:
    cfg = transformers.AutoConfig.from_pretrained(TINY)
    assert cfg.model_type == "deepseek_v4"
    assert cfg.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                               "compressed_sparse_attention", "heavily_compressed_attention",
                               "compressed_sparse_attention"]
    assert cfg.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    assert cfg.qk_rope_head_dim == 16 and cfg.num_hidden_layers == 6


def test_dsv4_reads_the_true_ratios() -> None:
    cfg = ModelConfig.from_dir(TINY)
    assert cfg.compress_ratios == (0, 4, 16, 4, 16, 4)
    assert cfg.layer_kinds == ("window", "csa", "hca", "csa", "hca", "csa")


def test_disagreeing_ratio_keys_are_refused() -> None:
    d = json.loads((TINY / "config.json").read_text())
    d["compress_ratios"] = [0, 4, 32, 4, 16, 4, 0]
    with pytest.raises(ConfigError, match="disagree"):
        ModelConfig.from_dict(d)


def test_autotokenizer_counts_prompt_tokens_as_dsv4_does() -> None:
    hf = transformers.AutoTokenizer.from_pretrained(TINY)
    ours = Tokenizer.from_dir(TINY)
    text = (PROMPT + "\n") * 12
    ids = hf(text).input_ids  # add_special_tokens=True, as vllm bench serve and lm-eval count
    assert ids == ours.encode_prompt(text)  # raw, no BOS: tokenizer_config.json says add_bos_token false
    assert ids[0] != ours.bos_id and hf.bos_token_id == ours.bos_id == 0 and hf.eos_token_id == ours.eos_id == 1
    assert hf.decode(ids) == text


def test_bos_where_the_tokenizer_config_asks_for_it(tmp_path: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, tmp_path / f)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.encode_prompt(PROMPT) == [ours.bos_id, *Tokenizer.from_dir(TINY).encode_prompt(PROMPT)]
