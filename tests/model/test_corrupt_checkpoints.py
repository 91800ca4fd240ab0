"""Corrupt models are named as such (issue 11, defect 8): one stderr line, exit 1, never "internal error".

A real tiny checkpoint is written, then damaged the way a bad download or a hostile
file would be: data bytes overwritten with 0xFF under a valid header, one NaN or inf
weight, an out-of-range hash-routing table, a wrong shape, a missing tensor, no
safetensors at all, a garbled tokenizer.json. Each is loaded through the real CLI
(`dsv4 run --local`, in this process) and through `load_model`.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.cli.main import main
from dsv4.model.checkpoint import CheckpointError, check_tid2eid, validate_tensor
from dsv4.model.loader import load_model
from tests.checkpoints import write_tiny_checkpoint

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good")
    write_tiny_checkpoint(path)
    return path


def copy_of(good: Path, dst: Path) -> Path:
    dst.mkdir(exist_ok=True)
    for f in good.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def rewrite(path: Path, change) -> None:
    tensors = load_file(str(path / WEIGHTS))
    change(tensors)
    save_file(tensors, str(path / WEIGHTS))


def cli_run_local(model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code = main(["run", "--local", "--model", str(model), "--max-tokens", "2", "--raw", "hello"])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_clean_error(code: int, err: str, *needles: str) -> None:
    assert code == 1, err
    assert len(err.splitlines()) == 1 and "internal error" not in err, err
    for n in needles:
        assert n in err, err


def test_ff_bytes_under_a_valid_header(good: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    bad = copy_of(good, tmp_path / "ff")
    raw = bytearray((bad / WEIGHTS).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n:] = b"\xff" * (len(raw) - 8 - n)
    (bad / WEIGHTS).write_bytes(bytes(raw))
    code, err = cli_run_local(bad, monkeypatch, capsys)
    assert_clean_error(code, err, "checkpoint error:", "non-finite", WEIGHTS)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_named_with_its_file(good: Path, tmp_path: Path, value: float, monkeypatch,
                                                    capsys) -> None:
    bad = copy_of(good, tmp_path / "nan")
    name = "layers.1.attn.wo_b.weight"
    rewrite(bad, lambda t: t[name].view(-1).__setitem__(3, value))
    code, err = cli_run_local(bad, monkeypatch, capsys)
    assert_clean_error(code, err, f"tensor {name!r}", str(bad / WEIGHTS), "1 non-finite value")


@pytest.mark.parametrize("bad_id", [-1, 8, 1 << 40])
def test_hash_routing_ids_out_of_range(good: Path, tmp_path: Path, bad_id: int, monkeypatch, capsys) -> None:
    bad = copy_of(good, tmp_path / "tid")
    rewrite(bad, lambda t: t["layers.0.ffn.gate.tid2eid"].view(-1).__setitem__(5, bad_id))
    code, err = cli_run_local(bad, monkeypatch, capsys)
    assert_clean_error(code, err, "layers.0.ffn.gate.tid2eid", f"expert id {bad_id}", "[0, 8)")


def test_wrong_shape_and_missing_tensor(good: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    bad = copy_of(good, tmp_path / "shape")
    rewrite(bad, lambda t: t.__setitem__("layers.1.attn.wo_b.weight", t["layers.1.attn.wo_b.weight"][:-1]))
    code, err = cli_run_local(bad, monkeypatch, capsys)
    assert_clean_error(code, err, "checkpoint error:", "layers.1.attn.wo_b.weight", "shape")
    bad = copy_of(good, tmp_path / "missing")
    rewrite(bad, lambda t: t.pop("layers.1.attn.wo_b.weight"))
    code, err = cli_run_local(bad, monkeypatch, capsys)
    assert_clean_error(code, err, "checkpoint error:", "missing tensor 'layers.1.attn.wo_b.weight'")


def test_no_safetensors(good: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    bad = copy_of(good, tmp_path / "none")
    (bad / WEIGHTS).unlink()
    code, err = cli_run_local(bad, monkeypatch, capsys)
    assert_clean_error(code, err, "checkpoint error:", "no *.safetensors")


def test_corrupt_tokenizer_is_an_error_not_no_tokenizer(good: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    bad = copy_of(good, tmp_path / "tok")
    (bad / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": [1, 2')
    code, err = cli_run_local(bad, monkeypatch, capsys)
    assert_clean_error(code, err, "tokenizer error:", "tokenizer.json")
    assert "no tokenizer.json" not in err


def test_checks_are_cheap_helpers_that_pass_good_data(good: Path) -> None:
    model = load_model(good)  # a good checkpoint passes every check
    assert model is not None
    validate_tensor("x", Path("f"), torch.zeros(3, dtype=torch.bfloat16))
    validate_tensor("ids", Path("f"), torch.tensor([-1, 5]))  # integer tensors are range-checked elsewhere
    with pytest.raises(CheckpointError, match="'x' in f has 2 non-finite"):
        validate_tensor("x", Path("f"), torch.tensor([1.0, float("nan"), float("-inf")]))
    check_tid2eid({"layers.0.ffn.gate.tid2eid": torch.tensor([[0, 7]])}, 8)
    with pytest.raises(CheckpointError, match="expert id 8"):
        check_tid2eid({"layers.0.ffn.gate.tid2eid": torch.tensor([[0, 8]])}, 8)
    assert json.loads((good / "config.json").read_text())["n_routed_experts"] == 8


@pytest.mark.parametrize("change", [{"vocab_size": 10**12, "hidden_size": 10**7}, {"n_routed_experts": 10**9},
                                    {"moe_intermediate_size": 2**40}, {"max_position_embeddings": 2**62}])
def test_absurd_sizes_in_config_json_are_refused_before_any_tensor(good: Path, tmp_path: Path, change, monkeypatch,
                                                                   capsys) -> None:
    """Sizes that would overflow a tensor's storage (or exceed any machine) are one line naming
    the key, before a tensor is built: never 'internal error: ... Storage size calculation overflowed'."""
    bad = copy_of(good, tmp_path / "absurd")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    code, err = cli_run_local(bad, monkeypatch, capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "internal error" not in err, err
    assert next(iter(change)) in err and "over the largest this server takes" in err, err
