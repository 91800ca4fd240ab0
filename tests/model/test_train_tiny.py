"""tools/train_tiny.py runs, evaluates, resumes and exports on a sliver of data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dsv4.model.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
TEXT = ("ROMEO.\nBut soft, what light through yonder window breaks?\n"
        "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\n") * 40


def _train(data: Path, out: Path, *extra: str) -> str:
    cmd = [sys.executable, str(ROOT / "tools/train_tiny.py"), str(data), str(out), "--seq", "64", "--batch", "2",
           "--eval-every", "1", "--save-every", "1", "--threads", "1", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_train_tiny_runs_resumes_and_exports(tmp_path):
    data = tmp_path / "data"
    for split in ("train", "heldout"):
        (data / split).mkdir(parents=True)
        (data / split / "a.txt").write_text(TEXT)
    out = tmp_path / "run"
    log = _train(data, out, "--max-steps", "1")
    assert "held-out main" in log and "final step 1" in log
    log = _train(data, out, "--max-steps", "2", "--resume")
    assert "resumed at step 1" in log and "final step 2" in log
    asset = out / "asset"
    cfg = json.loads((asset / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4" and cfg["num_nextn_predict_layers"] == 1
    model = load_model(asset)
    assert model.has_mtp and (asset / "tokenizer.json").exists()
