"""Draft vocabularies (dsv4/draft_vocab.py): building one ranks by frequency with the special
tokens first; a file that cannot be used is refused in one line naming what is wrong; the
engine config resolves --draft-vocab (auto: the checkpoint's draft_vocab.json) before any
weight is read and refuses a bad file naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4 import draft_vocab as dv
from dsv4.engine.config import EngineConfig, EngineConfigError
from tests.unit.test_engine_config import make_ckpt


def _write(path: Path, **over) -> Path:
    data = {"format": dv.FORMAT, "version": 1, "vocab_size": 64, "token_ids": [5, 3, 9], **over}
    path.write_text(json.dumps(data))
    return path


def test_build_ranks_by_count_then_id_with_the_special_tokens_first() -> None:
    texts = [[7] * 9 + [3] * 8 + [9], [7, 5]]  # 7: 10, 3: 8, 9: 1, 5: 1
    data = dv.build(texts, vocab_size=16, size=4, always=[1])
    assert data["token_ids"] == [1, 7, 3, 5]  # 5 before 9: a tie goes to the lower id
    assert data["coverage"] == pytest.approx(19 / 20)
    assert data["counted_tokens"] == 20
    assert data["size_for_coverage"] == {"0.9": 2, "0.95": 3, "0.99": 4}  # 18, 19, 20 of 20 tokens
    more = dv.build(texts, vocab_size=16, size=8)  # fewer distinct tokens than asked: unseen ones by id
    assert more["token_ids"] == [7, 3, 5, 9, 0, 1, 2, 4]
    assert dv.coverage([7, 3], [[7, 3, 1, 1]]) == 0.5 and dv.coverage([7], []) is None
    with pytest.raises(dv.DraftVocabError, match="1..16"):
        dv.build(texts, vocab_size=16, size=17)


def test_read_round_trips_what_build_writes(tmp_path: Path) -> None:
    data = dv.build([[1, 2, 2, 40]], vocab_size=64, size=3)
    p = tmp_path / "v.json"
    p.write_text(json.dumps(data))
    assert dv.read(p, 64) == data["token_ids"] == [2, 1, 40]


@pytest.mark.parametrize("content, words", [
    ("{not json", "not JSON"),
    ('[1, 2]', "not a dsv4-draft-vocab file"),
    ('{"format": "other", "token_ids": [1]}', "not a dsv4-draft-vocab file"),
    (dict(token_ids=[]), "non-empty list"),
    (dict(token_ids="1,2"), "non-empty list"),
    (dict(token_ids=[1, 64]), "token id 64 is not in 0..63"),
    (dict(token_ids=[1, -1]), "token id -1 is not in 0..63"),
    (dict(token_ids=[1, None]), "token id None is not in 0..63"),
    (dict(token_ids=[1, True]), "token id True is not in 0..63"),
    (dict(token_ids=[1, 2.0]), "token id 2.0 is not in 0..63"),
    (dict(token_ids=[4, 4]), "repeat"),
    (dict(vocab_size=129280), "made for a vocabulary of 129280 tokens, the model has 64"),
    (dict(version=2), "version 2 of its format; this dsv4 reads version 1"),
    ("[" * 100000, "not JSON"),  # nested past the parser's recursion limit
])
def test_bad_files_are_one_line_errors(tmp_path: Path, content, words) -> None:
    p = tmp_path / "v.json"
    if isinstance(content, dict):
        _write(p, **content)
    else:
        p.write_text(content)
    with pytest.raises(dv.DraftVocabError, match=words) as e:
        dv.read(p, 64)
    assert "\n" not in str(e.value)


def test_unreadable_and_oversized_files(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(dv.DraftVocabError, match="No such file"):
        dv.read(tmp_path / "missing.json", 64)
    p = _write(tmp_path / "v.json")
    p.write_bytes(b"\xff\xfe" + p.read_bytes())
    with pytest.raises(dv.DraftVocabError, match="not JSON"):
        dv.read(p, 64)
    monkeypatch.setattr(dv, "MAX_BYTES", 8)
    with pytest.raises(dv.DraftVocabError, match="over 0 MiB"):
        dv.read(_write(tmp_path / "w.json"), 64)


def test_resolve_auto_off_and_paths(tmp_path: Path) -> None:
    assert dv.resolve(None, tmp_path) is None and dv.resolve("auto", tmp_path) is None
    own = _write(tmp_path / dv.FILE)
    assert dv.resolve("auto", tmp_path) == own and dv.resolve(None, tmp_path) == own
    assert dv.resolve("off", tmp_path) is None
    other = _write(tmp_path / "other.json")
    assert dv.resolve(str(other), tmp_path) == other.absolute()
    with pytest.raises(dv.DraftVocabError, match="--draft-vocab nope.json: no such file"):
        dv.resolve("nope.json", tmp_path)


def test_engine_config_reads_the_draft_vocabulary_before_the_weights(tmp_path: Path) -> None:
    d = make_ckpt(tmp_path / "m")
    assert EngineConfig.create(model=str(d)).draft_vocab == "off"
    assert EngineConfig.create(model=str(d)).draft_vocab_ids is None
    _write(d / dv.FILE)  # auto: the checkpoint's own
    c = EngineConfig.create(model=str(d))
    assert c.draft_vocab == str(d / dv.FILE) and c.draft_vocab_ids == [5, 3, 9]
    assert "drafts from 3 of 64 tokens" in " ".join(c.banner_lines())
    assert EngineConfig.create(model=str(d), draft_vocab="off").draft_vocab_ids is None
    # no speculation: nothing to restrict (and nothing read)
    assert EngineConfig.create(model=str(d), num_speculative_tokens=0).draft_vocab_ids is None
    other = _write(tmp_path / "bad.json", token_ids=[1, 99])
    with pytest.raises(EngineConfigError, match=r"token id 99 is not in 0..63.*--draft-vocab off"):
        EngineConfig.create(model=str(d), draft_vocab=str(other))
    with pytest.raises(EngineConfigError, match="--draft-vocab .*missing.json: no such file"):
        EngineConfig.create(model=str(d), draft_vocab=str(tmp_path / "missing.json"))
    (d / dv.FILE).write_text("{")  # a broken file of the checkpoint's own fails too, and says how to skip it
    with pytest.raises(EngineConfigError, match="not JSON.*--draft-vocab off"):
        EngineConfig.create(model=str(d))


def test_a_detached_daemon_gets_the_file_as_an_absolute_path(tmp_path: Path, monkeypatch) -> None:
    """`serve --detach` restarts itself in `/`: a relative --draft-vocab is made absolute
    first; auto and off stay words; a running daemon is compared on the flag."""
    from dsv4.cli.options import engine_argv, engine_kwargs
    from dsv4.daemon.process import SETTING_FLAGS

    monkeypatch.chdir(tmp_path)
    argv = engine_argv(engine_kwargs(draft_vocab="sets/dv.json"))
    assert argv[argv.index("--draft-vocab") + 1] == str(tmp_path / "sets" / "dv.json")
    for word in ("auto", "off"):
        argv = engine_argv(engine_kwargs(draft_vocab=word))
        assert argv[argv.index("--draft-vocab") + 1] == word
    argv = engine_argv(engine_kwargs(draft_vocab=" off "))
    assert argv[argv.index("--draft-vocab") + 1] == "off"
    assert "draft_vocab" in SETTING_FLAGS  # a running daemon is compared on it when the flag is given
