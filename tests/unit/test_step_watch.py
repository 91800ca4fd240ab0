"""The daemon's step watch (dsv4/daemon/watch.py): during an engine step that does not end
until the test lets it, pings are answered at once, pings without the right key are not,
and requests sent meanwhile are handled after the step, in order."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest

from dsv4.daemon import protocol as P
from dsv4.daemon.client import Client, DaemonError, new_id
from tests.unit.test_protocol import FakeEngine, Harness, collect

KEY = "sk-watch"


class GatedEngine(FakeEngine):
    """FakeEngine whose steps wait while `gate` is closed; `in_step` is set while one waits."""

    def __init__(self) -> None:
        super().__init__(step_delay=0.0)
        self.gate = threading.Event()
        self.in_step = threading.Event()

    def step(self) -> list[Any]:
        if not self.gate.is_set():
            self.in_step.set()
            self.gate.wait(30)
        return super().step()


@pytest.fixture
def gated() -> Iterator[tuple[Harness, GatedEngine]]:
    engine = GatedEngine()
    h = Harness(engine, api_key=KEY)
    yield h, engine
    engine.gate.set()
    h.close()


def test_pings_are_answered_while_a_step_runs(gated: tuple[Harness, GatedEngine]) -> None:
    h, engine = gated
    with Client(h.endpoint, api_key=KEY) as c:
        c.connect()
        first = c.generate("hi", {"max_tokens": 2})
        assert engine.in_step.wait(10)
        pong = c.call(P.Ping(new_id()), timeout_s=10)
        assert pong["type"] == "pong" and pong["state"] == "ready"
        assert not engine.gate.is_set()  # answered while the step was still running
        second = c.generate("there", {"max_tokens": 1})  # held by the watch until the step ends
        engine.gate.set()
        assert collect(c, first)[0] == "xx"
        text, final = collect(c, second)
        assert text == "x" and final["finish_reason"] == "length"


def test_a_ping_without_the_key_is_left_to_the_loop(gated: tuple[Harness, GatedEngine]) -> None:
    h, engine = gated
    with Client(h.endpoint, api_key=KEY) as c:
        c.connect()
        c.generate("hi", {"max_tokens": 1})
        assert engine.in_step.wait(10)
        with Client(h.endpoint, api_key="wrong") as intruder:
            intruder.send(P.Ping(new_id()).to_wire())
            time.sleep(0.5)  # the watch has had time to answer, were it to answer
            assert intruder.recv(0) is None and not engine.gate.is_set()
            engine.gate.set()
            with pytest.raises(DaemonError, match="API key"):  # the loop's answer, after the step
                intruder.call(P.Ping(new_id()), timeout_s=10)
