"""`dsv4 draft-vocab` and `--draft-vocab` as a user runs them (real subprocesses, the embedded
model): the file it writes serves with `run --local`, giving the text of the full vocabulary;
a bad file is one line naming the flag; an existing --out is kept without --force."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4 import draft_vocab as dv
from tests.e2e.util import dsv4

ROOT = Path(__file__).resolve().parents[2]
HAMLET = ROOT / "data" / "shakespeare" / "heldout" / "hamlet_gut.txt"
TEMPEST = ROOT / "data" / "shakespeare" / "heldout" / "tempest_gut.txt"
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


def test_draft_vocab_writes_a_file_run_serves_with(tmp_path: Path) -> None:
    out = tmp_path / "dv.json"
    r = dsv4("draft-vocab", str(HAMLET), "--size", "1024", "--heldout", str(TEMPEST), "--out", str(out))
    assert r.returncode == 0, r.stderr
    line = r.stderr.strip()
    assert line.startswith(f"dsv4: wrote {out}: 1024 of 4096 tokens, covering ") and "of --heldout" in line
    assert "\n" not in line and r.stdout == ""
    ids = dv.read(out, 4096)
    assert len(ids) == 1024 and ids[:2] == [1, 0]  # end and start of sequence first
    data = json.loads(out.read_text())
    assert 0.5 < data["heldout_coverage"] < data["coverage"] < 1
    again = dsv4("draft-vocab", str(HAMLET), "--out", str(out))
    assert again.returncode == 2 and "exists; give --force" in again.stderr
    assert dsv4("draft-vocab", str(HAMLET), "--size", "4097", "--out", str(out), "--force").returncode == 2

    base = ["run", "--local", "--json", "--temperature", "0", "--max-tokens", "24", "--ignore-eos",
            "--num-speculative-tokens", "1"]
    full = dsv4(*base, "--draft-vocab", "off", PROMPT, timeout=120)
    part = dsv4(*base, "--draft-vocab", str(out), PROMPT, timeout=120)
    assert full.returncode == part.returncode == 0, (full.stderr, part.stderr)
    assert json.loads(part.stdout)["token_ids"] == json.loads(full.stdout)["token_ids"]
    assert json.loads(part.stdout)["spec"]["drafted"] > 0


def test_bad_draft_vocab_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": dv.FORMAT, "token_ids": [1, 5000]}))
    r = dsv4("run", "--local", "--draft-vocab", str(bad), PROMPT, timeout=120)
    assert r.returncode == 2, r.stderr  # a setting that cannot work: a usage error, before any weight loads
    assert r.stderr.count("\n") == 1 and "token id 5000 is not in 0..4095" in r.stderr and "--draft-vocab off" in r.stderr
    r = dsv4("run", "--local", "--draft-vocab", str(tmp_path / "none.json"), PROMPT, timeout=120)
    assert r.returncode == 2 and "no such file" in r.stderr
    r = dsv4("run", "--draft-vocab", str(bad), PROMPT)  # an engine flag without --local
    assert r.returncode == 2 and "--draft-vocab applies only with --local" in r.stderr
    r = dsv4("draft-vocab", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o.json"))
    assert r.returncode == 2 and "missing.txt" in r.stderr and r.stderr.count("\n") == 1
