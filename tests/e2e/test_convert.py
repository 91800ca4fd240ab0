"""`dsv4 convert` keeps what is not weights: generation_config.json (the sampling
defaults), the model card and the tokenizer files are copied byte for byte, and every
file of the output has the mode of its counterpart in the source."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

from dsv4.engine.config import generation_defaults
from tests.e2e.util import dsv4

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
