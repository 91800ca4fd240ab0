"""`dsv4 convert` keeps what is not weights: generation_config.json (the sampling
defaults), the model card and the tokenizer files are copied byte for byte, and every
file of the output has the mode of its counterpart in the source. It is atomic (issue
21): a corrupt source (a NaN weight) fails the conversion, not the later load, and leaves
nothing behind; a leftover from a killed run blocks no rerun; a full disk (a small tmpfs
in a mount namespace of the test's own) is one line naming the destination, nothing kept."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.engine.config import generation_defaults
from dsv4.model.checkpoint import CheckpointError
from dsv4.model.convert import convert_checkpoint
from tests.e2e.util import CMD, dsv4, env_for

GENERATION = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.8, "top_p": 0.95,
              "top_k": 50, "repetition_penalty": 1.1}


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_convert_copies_the_other_files_with_their_modes(tiny_model: Path, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "w8a8"
    shutil.copytree(tiny_model, src)
    (src / "generation_config.json").write_text(json.dumps(GENERATION))
    (src / "README.md").write_text("# a model card\n")
    (src / "LICENSE").write_text("MIT\n")
    modes = {"config.json": 0o644, "model.safetensors": 0o644, "tokenizer.json": 0o640,
             "tokenizer_config.json": 0o644, "generation_config.json": 0o664, "README.md": 0o444, "LICENSE": 0o600}
    for name, mode in modes.items():
        (src / name).chmod(mode)

    r = dsv4("convert", str(src), str(dst), "--shard-size", "0.0005")
    assert r.returncode == 0, r.stderr

    for name in ("generation_config.json", "README.md", "LICENSE", "tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
        assert _mode(dst / name) == modes[name], name
    shards = sorted(dst.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    assert {_mode(p) for p in [*shards, dst / "model.safetensors.index.json"]} == {modes["model.safetensors"]}
    assert _mode(dst / "config.json") == modes["config.json"]
    # the converted model samples as the source does, not greedily
    assert generation_defaults(dst) == generation_defaults(src) and generation_defaults(dst)["temperature"] == 0.8


def test_corrupt_source_fails_the_conversion_and_leaves_nothing(tiny_model: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out" / "w8a8"
    shutil.copytree(tiny_model, src)
    good = load_file(src / "model.safetensors")
    bad = dict(good)
    bad["layers.1.ffn_norm.weight"] = bad["layers.1.ffn_norm.weight"].clone()
    bad["layers.1.ffn_norm.weight"][3] = torch.nan
    save_file(bad, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"^tensor 'layers\.1\.ffn_norm\.weight' in .*model\.safetensors has 1 "
                                              r"non-finite value\(s\) \(NaN or inf\)"):
        convert_checkpoint(src, out)
    assert list(out.parent.iterdir()) == []  # no DST, no temporary directory
    save_file(good, str(src / "model.safetensors"))
    (out.parent / ".w8a8.dsv4-convert-0badc0de").mkdir()  # what a killed run leaves: no obstacle
    convert_checkpoint(src, out)
    assert (out / "config.json").is_file() and sorted(p.name for p in out.parent.iterdir()) == [
        ".w8a8.dsv4-convert-0badc0de", "w8a8"]


def test_full_disk_is_one_line_naming_the_destination(tiny_model: Path, tmp_path: Path) -> None:
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace for this user (unshare -rm)")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = ('mount -t tmpfs -o size=1m tmpfs "$1" && shift && "$@"; rc=$?; ls -A "$DISK"; exit $rc')
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(disk), *CMD, "convert", str(tiny_model),
                        str(disk / "w8a8"), "--shard-size", "0.0005"],
                       capture_output=True, text=True, timeout=120, env=env_for(DISK=str(disk)))
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"dsv4: {disk / 'w8a8'}: no space left on the device while writing "
                                                 f"the converted checkpoint (nothing was kept; free space there or "
                                                 f"choose another directory)")
    assert r.stdout == ""  # the small disk was left empty
