"""A draft vocabulary (`DeepseekV4.restrict_draft_vocab`, `--draft-vocab`): the MTP's logits
are its full logits on the chosen tokens (bit for bit under w8a8, where both are integer
products) and -inf elsewhere; greedy output with it equals K = 0's; a request whose grammar
allows no token of it drafts through the whole head; on the embedded model a vocabulary of
a quarter of the tokens keeps most of the acceptance; at two ranks each keeps its slice
and the drafts are the single process's."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4 import draft_vocab as dv
from dsv4.model.model import DRAFT_ROWS_MULTIPLE, DeepseekV4, init_random
from dsv4.model.state import Batch
from dsv4.model.w8a8 import to_w8a8
from tests.model.conftest import assert_chains_agree
from tests.model.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[2]
GEN = 12


def _vocab_file(path: Path, ids: list[int], vocab: int = 4096) -> Path:
    path.write_text(json.dumps({"format": dv.FORMAT, "version": 1, "vocab_size": vocab, "token_ids": ids}))
    return path


def _half(vocab: int, seed: int = 0) -> list[int]:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:vocab // 2].tolist()


@pytest.mark.exact
@pytest.mark.parametrize("fmt", ["float32", "w8a8"])
def test_draft_logits_are_the_chosen_rows_of_the_full_ones(fmt):
    torch.manual_seed(0)
    full = init_random(DeepseekV4(tiny_config()), seed=0).eval()
    if fmt == "w8a8":
        to_w8a8(full)
    full.fuse_projections()
    part = copy.deepcopy(full)
    ids = [0, 5, 17, 63, 64, 127]
    assert part.restrict_draft_vocab(ids + [5]) == len(ids)  # repeats count once
    assert part.draft_head["weight"].shape[0] == DRAFT_ROWS_MULTIPLE  # padded with zero rows
    if fmt == "w8a8":
        full.quantize_draft_head()
        part.quantize_draft_head()
        assert torch.equal(part.draft_head["weight"][:len(ids)], full.draft_head["weight"][ids])
    assert not part.draft_head["weight"][len(ids):].any()
    assert part.draft_vocab_size == len(ids) and full.draft_vocab_size is None
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (1, 20), generator=g)
    with torch.inference_mode():
        hidden, _ = full.forward_batch(Batch.whole(x), None)
        _, ref = full.mtp_forward(Batch.whole(x), hidden, None)  # [20, 128]
        _, got = part.mtp_forward(Batch.whole(x), hidden, None)
        whole = part.mtp_logits(part.mtp_forward(Batch.whole(x), hidden, None)[0], draft=False)
    out = torch.ones(128, dtype=torch.bool)
    out[ids] = False
    assert torch.isinf(got[:, out]).all() and (got[:, out] < 0).all()
    if fmt == "w8a8":  # integer products with the same rows: the same bits
        assert torch.equal(got[:, ids], ref[:, ids])
    else:
        torch.testing.assert_close(got[:, ids], ref[:, ids], rtol=0, atol=1e-5)
    assert torch.isfinite(whole).all()  # the whole head, for rows no token of the set can serve
    with pytest.raises(RuntimeError, match="before quantising or packing"):
        part.restrict_draft_vocab(ids)


def test_each_rank_keeps_the_ids_of_its_vocabulary_slice():
    model = init_random(DeepseekV4(tiny_config()), seed=0).eval()
    rows = model.head.weight.detach().clone()
    model.head.weight = torch.nn.Parameter(rows[64:].clone())  # rank 1 of 2: tokens 64..127
    assert model.restrict_draft_vocab([3, 127, 70], rank=1, world=2) == 2
    assert model.draft_head["ids"].tolist() == [6, 63]
    assert torch.equal(model.draft_head["weight"][:2], rows[[70, 127]])
    none = init_random(DeepseekV4(tiny_config()), seed=0).eval()
    none.head.weight = torch.nn.Parameter(rows[:64].clone())  # rank 0 of 2 holds none of the set
    assert none.restrict_draft_vocab([70, 127], rank=0, world=2) == 0
    with torch.inference_mode():  # its slice of the draft logits: all -inf
        x = torch.tensor([[5, 9, 11]])
        hidden, _ = none.forward_batch(Batch.whole(x), None)
        logits = none.mtp_forward(Batch.whole(x), hidden, None)[1]
    assert logits.shape == (3, 64) and torch.isneginf(logits).all()


@pytest.mark.exact
@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_greedy_with_a_draft_vocabulary_equals_k0(tiny_checkpoint, dense_checkpoint, tmp_path, quantization):
    d = dense_checkpoint[0] if quantization == "w8a8" else tiny_checkpoint
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (3, 40, 130)]
    params = SamplingParams(max_tokens=GEN, ignore_eos=True)
    q = dict(max_num_seqs=3, max_model_len=256, prefill_limit=16, quantization=quantization)
    ref = [c.token_ids for c in LLM(d, num_speculative_tokens=0, **q).generate(prompts, params)]
    for ids, K in ((_half(4096), 1), (_half(4096, 1), 3), ([7], 2)):
        with LLM(d, num_speculative_tokens=K, draft_vocab=str(_vocab_file(tmp_path / f"v{K}.json", ids)), **q) as llm:
            assert llm.engine.runner.model.draft_vocab_size == len(ids)
            outs = llm.generate(prompts, params)
        got = [c.token_ids for c in outs]
        if quantization == "none":
            assert got == ref
        else:
            from dsv4.model.loader import load_model

            assert_chains_agree(got, ref, prompts, load_model(d, quantization="w8a8"), dense_checkpoint[1])
        drafted = [t for c in outs for t, s in zip(c.token_ids, c.sources) if s == "draft"]
        assert set(drafted) <= set(ids)  # an accepted draft was proposed, and proposals are in the set
        assert sum(c.metrics["spec"]["drafted"] for c in outs) > 0


def test_the_embedded_model_keeps_most_of_its_acceptance(tmp_path):
    """A quarter of the vocabulary, ranked on one held-out play, decoding others: acceptance
    stays near the full head's (0.61 against 0.64 on 48 prompts, benchmarks/draft_vocab.py);
    ids mapped to the wrong rows would accept next to nothing."""
    from dsv4.engine.tokenizer import Tokenizer
    import dsv4

    tok = Tokenizer.from_dir(dsv4.DEFAULT_MODEL)
    held = ROOT / "data" / "shakespeare" / "heldout"
    data = dv.build([tok.encode((held / "hamlet_gut.txt").read_text(encoding="utf-8"))], 4096, 1024,
                    always=tok.special_token_ids())
    path = tmp_path / "dv.json"
    path.write_text(json.dumps(data))
    text = tok.encode((held / "tempest_gut.txt").read_text(encoding="utf-8"))
    prompts = [text[i:i + 128] for i in range(2000, 2000 + 6 * 1500, 1500)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    acc = {}
    for name in ("off", str(path)):
        with LLM(num_speculative_tokens=1, draft_vocab=name, max_model_len=512) as llm:
            outs = llm.generate(prompts, params)
        spec = [c.metrics["spec"] for c in outs]
        acc[name] = sum(s["accepted"] for s in spec) / sum(s["drafted"] for s in spec)
    assert acc["off"] > 0.5
    assert acc[str(path)] > 0.8 * acc["off"], acc


def test_a_grammar_with_no_token_of_the_set_drafts_through_the_whole_head(tiny_checkpoint, tmp_path, monkeypatch):
    """A draft vocabulary of the pad token only, which the JSON grammar never allows: every
    constrained row falls back to the whole head, so the drafts, and what they accept, are
    those of no draft vocabulary; without the fallback every draft is refused."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
              "required": ["n", "s"], "additionalProperties": False}
    params = SamplingParams(max_tokens=48, structured={"json_schema": schema})
    prompts = ["To be, or not to be", "Now is the winter"]
    kw = dict(num_speculative_tokens=2, max_num_seqs=2, max_model_len=256)
    with LLM(tiny_checkpoint, draft_vocab="off", **kw) as llm:
        ref = llm.generate(prompts, params)
    pad = _vocab_file(tmp_path / "pad.json", [2])
    with LLM(tiny_checkpoint, draft_vocab=str(pad), **kw) as llm:
        got = llm.generate(prompts, params)
        monkeypatch.setattr(type(llm.engine.runner), "_outside_vocab", lambda self, logits, *a: logits)
        bare = llm.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref] == [c.token_ids for c in bare]
    assert [c.metrics["spec"] for c in got] == [c.metrics["spec"] for c in ref]
    assert sum(c.metrics["spec"]["accepted"] for c in ref) > 0
    assert sum(c.metrics["spec"]["accepted"] for c in bare) == 0


def test_a_packed_draft_head_keeps_its_vocabulary(tiny_checkpoint, monkeypatch):
    """w8a8 with every int8 weight packed (MIN_BYTES 0): the draft head is the set's rows,
    packed, and the MTP's logits are the plain restricted head's bit for bit."""
    from dsv4.model import int8pack
    from dsv4.model.loader import load_model

    if not int8pack.exact():
        pytest.skip("oneDNN's packed int8 product is not exact on this CPU: nothing is packed")
    ids = _half(4096, 3)
    plain = load_model(tiny_checkpoint, quantization="w8a8", draft_vocab=ids)
    monkeypatch.setattr(int8pack, "MIN_BYTES", 0)
    monkeypatch.setattr(int8pack, "fast", lambda: True)  # packed even where oneDNN's kernel is its slow reference one
    packed = load_model(tiny_checkpoint, quantization="w8a8", pack=True, draft_vocab=ids)
    assert "packed" in packed.draft_head and "weight" not in packed.draft_head
    assert torch.equal(packed.draft_head["ids"], plain.draft_head["ids"]) and packed.draft_vocab_size == len(ids)
    x = torch.randint(0, 4096, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        outs = []
        for m in (plain, packed):
            hidden, _ = m.forward_batch(Batch.whole(x), None)
            outs.append(m.mtp_forward(Batch.whole(x), hidden, None)[1])
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0][:, ids]).all()
