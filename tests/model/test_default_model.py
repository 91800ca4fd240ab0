"""The embedded default model: it loads, validates, decodes exactly, and its MTP head drafts well."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dsv4
from dsv4 import LLM, SamplingParams
from dsv4.engine.config import EngineConfig
from dsv4.engine.tokenizer import Tokenizer
from dsv4.model.loader import load_model

HELDOUT = Path(__file__).resolve().parents[2] / "data/shakespeare/heldout"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=4, max_model_len=1024, num_speculative_tokens=1)  # K = 1: these tests measure drafts


def test_asset_loads_and_validates():
    cfg = EngineConfig.create(model=str(dsv4.DEFAULT_MODEL))
    assert cfg.has_mtp and cfg.speculative_auto and cfg.num_speculative_tokens == 3
    mc = cfg.model_config
    assert set(mc.layer_kinds) == {"window", "csa", "hca"} and mc.num_hash_layers == 1
    assert mc.sliding_window == 128 and mc.hc_mult == 4 and mc.vocab_size == 4096
    tok = Tokenizer.from_dir(dsv4.DEFAULT_MODEL)
    assert (tok.bos_id, tok.eos_id, tok.has_chat_tokens) == (0, 1, False)
    size = (dsv4.DEFAULT_MODEL / "model.safetensors").stat().st_size
    assert size < 32 * 2**20


@pytest.mark.exact
def test_engine_greedy_equals_full_forward_chain(llm):
    model = load_model(dsv4.DEFAULT_MODEL)
    prompt = Tokenizer.from_dir(dsv4.DEFAULT_MODEL).encode_prompt("ROMEO:\n")
    ids = list(prompt)
    for _ in range(24):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    (c,) = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
    assert c.token_ids == ids[len(prompt):]


@pytest.mark.exact
def test_mtp_on_and_off_same_greedy_text(llm):
    prompts = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak.", "KING."]
    on = llm.generate(prompts, SamplingParams(max_tokens=40))
    off = llm.generate(prompts, SamplingParams(max_tokens=40, speculative=False))
    assert [c.text for c in on] == [c.text for c in off]
    assert sum(c.metrics["spec"]["drafted"] for c in on) > 0
    assert all(c.metrics["spec"]["drafted"] == 0 for c in off)


@pytest.mark.skipif(not HELDOUT.is_dir(), reason=f"held-out texts not found at {HELDOUT}")
def test_heldout_acceptance_above_half(llm):
    tok = Tokenizer.from_dir(dsv4.DEFAULT_MODEL)
    ids = tok.encode((HELDOUT / "hamlet_gut.txt").read_text(encoding="utf-8"))
    prompts = [ids[i: i + 200] for i in range(1000, 1000 + 4 * 3000, 3000)]
    out = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    drafted = sum(c.metrics["spec"]["drafted"] for c in out)
    accepted = sum(c.metrics["spec"]["accepted"] for c in out)
    assert drafted > 0 and accepted / drafted > 0.5, accepted / drafted


def test_bfloat16_serving_smoke():
    """The dtype GPUs use: loads, prefills across chunks, drafts and verifies (values not compared)."""
    llm = LLM(dtype="bfloat16", max_num_seqs=2, max_model_len=512, prefill_limit=64)
    out = llm.generate(["ROMEO:", "JULIET: " * 30], SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(c.token_ids) == 8 and c.text for c in out)
    assert llm.engine.model.embed.weight.dtype == torch.bfloat16
