"""grammar.py without a model: spec checks, the install hint without llguidance, choice grammars,
masks applied to logits (any row subset), the matcher walk over drafts."""

from __future__ import annotations

import sys

import pytest
import torch

from dsv4.engine.errors import RequestError
from dsv4.engine.grammar.masks import Grammars, apply_masks, check_spec, new_bitmask, unpack
from dsv4.engine.params import SamplingParams


@pytest.mark.parametrize("spec", [{"json_schema": {"type": "object"}}, {"json_object": True}, {"regex": "a+"},
                                  {"choice": ["a", "b"]}, {"ebnf": 'root ::= "x"'}])
def test_good_specs(spec):
    SamplingParams(structured=spec).validate()


@pytest.mark.parametrize("spec", [{}, {"regex": ""}, {"json_object": False}, {"choice": ["a", 3]}, "regex",
                                  {"xml": "x"}, {"json_schema": 3}, {"ebnf": "x" * (70 << 10)}])
def test_bad_specs(spec):
    with pytest.raises(RequestError) as e:
        check_spec(spec)
    assert "\n" not in str(e.value)


def test_without_llguidance_the_error_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    with pytest.raises(RequestError, match=r"llguidance, which is not installed: scripts/venv.sh http, or pip "
                                           r"install 'dsv4\[http\]'"):
        Grammars(None, 8, 1).compile({"regex": "a"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_apply_masks_limits_only_the_given_rows(dtype):
    pytest.importorskip("llguidance")
    logits = torch.zeros(3, 40, dtype=dtype)
    bm = new_bitmask(3, 40)
    bm[1, 0] = 0b101  # tokens 0 and 2 of the first word
    bm[1, 1] = 1 << 3  # token 35
    bm[2] = 0  # not in rows: untouched
    out = apply_masks(logits, [1], bm)
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 2, 35]
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all() and torch.isfinite(logits).all()
    assert apply_masks(logits, [], bm) is logits


def test_numpy_and_torch_unpacking_agree():
    g = torch.Generator().manual_seed(0)
    bm = torch.randint(-2**31, 2**31 - 1, (4, 5), dtype=torch.int32, generator=g)
    a, b = unpack(bm, 150, numpy=True), unpack(bm, 150, numpy=False)
    assert a.shape == (4, 150) and torch.equal(a, b)
    assert torch.equal(a[0, :32], torch.tensor([(int(bm[0, 0]) >> i) & 1 for i in range(32)]).bool())
