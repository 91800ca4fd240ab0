"""A daemon stuck in a step because a tensor-parallel rank is frozen (issue 21): `status`
says so (the step's age from a pong answered mid-step, and the rank process that is
stopped) instead of "is it still loading the model?". The rank is a real process stopped
with SIGSTOP; the engine is the step-gated fake of test_step_watch (no torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Iterator

import pytest

from dsv4.daemon.client import Client, DaemonTimeout, spawned_ranks, stopped_ranks
from tests.unit.test_protocol import Harness
from tests.unit.test_step_watch import GatedEngine


class FrozenRanks:
    """What `Engine.ranks` gives the daemon: the pids of the other ranks."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids


@pytest.fixture
def frozen_rank() -> Iterator[subprocess.Popen]:
    p = subprocess.Popen(["sleep", "120"])
    os.kill(p.pid, signal.SIGSTOP)
    for _ in range(1000):  # the signal is delivered when the process next runs: wait for it (bounded)
        if stopped_ranks([p.pid]):
            break
        time.sleep(0.01)
    yield p
    p.kill()
    p.wait()


def test_status_names_the_rank_that_does_not_answer(frozen_rank: subprocess.Popen) -> None:
    engine = GatedEngine()
    engine.ranks = FrozenRanks([frozen_rank.pid])
    h = Harness(engine)
    try:
        with Client(h.endpoint) as c:
            c.connect()
            c.generate("hi", {"max_tokens": 2})
            assert engine.in_step.wait(10)  # the step waits, as rank 0's does on a frozen rank's collective
            with pytest.raises(DaemonTimeout) as e:
                c.status(timeout_s=1)
        msg = str(e.value)
        assert msg.startswith(f"the dsv4 daemon (pid {os.getpid()}) did not answer 'status' within 1 s: its engine "
                              f"step has run for ")
        assert msg.endswith(f"; a tensor-parallel rank is not answering (rank process {frozen_rank.pid} is stopped)")
        assert "loading" not in msg and "\n" not in msg
    finally:
        engine.gate.set()
        h.close()


def test_stopped_spawn_children_are_found(frozen_rank: subprocess.Popen) -> None:
    assert stopped_ranks([frozen_rank.pid, os.getpid()]) == f"rank process {frozen_rank.pid} is stopped"
    assert spawned_ranks(os.getpid()) == []  # `sleep` is no multiprocessing spawn child
