"""The shared-memory plan channel (dsv4/engine/parallel/transport.py) between 2 gloo ranks: messages
arrive whole and in order, a message larger than the buffer goes through the group,
bytes that do not unpickle and a header out of sequence raise `TransportError` on the
receiving rank, and nothing is left in /dev/shm (the name is gone as soon as both ranks
mapped it); the engine at T = 2 uses it on one host and falls back to the object
broadcast across hosts."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch

from dsv4.engine.config import EngineConfig, EngineConfigError
from tests.model.test_parallel import spawn_ranks

MESSAGES = [None, {"a": [1, 2, 3]}, list(range(5000)), ("x" * 40, 7), list(range(3))]  # 5000 ints > 64 bytes


def _channel_work(rank: int, world: int) -> list:
    from dsv4.engine.parallel.transport import ShmChannel, TransportError

    ch = ShmChannel(capacity=64)
    leftovers = glob.glob(f"/dev/shm/dsv4-plan-{os.getppid() if rank else os.getpid()}-*")
    got: list = [leftovers]
    for m in MESSAGES:
        got.append(ch.broadcast(m if rank == 0 else None))
    errors = []
    if rank == 0:
        ch.send(b"not a pickle")
        torch.distributed.broadcast(torch.tensor([12, 0]), src=0)  # a header out of sequence
    else:
        for _ in range(2):
            try:
                ch.receive()
            except TransportError as e:
                errors.append(str(e))
    got.append(errors)
    return got


def test_shm_channel_delivers_and_refuses(tmp_path: Path) -> None:
    (r0, r1), pids = spawn_ranks(_channel_work, (), tmp_path, world=2)
    assert r0[0] == [] and r1[0] == []  # unlinked once both mapped it
    assert r1[1:-1] == MESSAGES == r0[1:-1]
    assert r1[-1][0].startswith("plan message 6 (12 bytes) on rank 1 does not decode: UnpicklingError")
    assert r1[-1][1] == "plan message 12 arrived on rank 1, 7 was expected"
    assert not glob.glob(f"/dev/shm/dsv4-plan-{pids[0]}-*")


def test_waiting_for_a_dead_rank_checks_its_liveness() -> None:
    """Rank 0 waits for the acks of the previous message; `check` (Ranks.check) runs meanwhile."""
    import mmap

    from dsv4.engine.parallel.ranks import RankError
    from dsv4.engine.parallel.transport import ShmChannel

    ch = object.__new__(ShmChannel)
    ch.world, ch.buf, calls = 2, mmap.mmap(-1, 16), []  # rank 1's ack slot stays 0

    def check() -> None:
        calls.append(1)
        raise RankError("tensor-parallel rank 1 (pid 1) exited with code -9")

    ch.check = check
    with pytest.raises(RankError, match="^tensor-parallel rank 1"):
        ch._wait_acks(1)
    assert calls == [1]


def test_engine_transport_choice(tmp_path: Path) -> None:
    from tests.checkpoints import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, with_tokenizer=False)
    assert EngineConfig.create(str(tmp_path), tensor_parallel_size=2).plan_transport == "shm"
    hosts = dict(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=1234)
    assert EngineConfig.create(str(tmp_path), **hosts).plan_transport == "object"
    with pytest.raises(EngineConfigError, match="^plan_transport shm needs every rank on one host; use object"):
        EngineConfig.create(str(tmp_path), plan_transport="shm", **hosts)
    with pytest.raises(EngineConfigError, match="^plan_transport must be one of auto, shm, object, got 'udp'$"):
        EngineConfig.create(str(tmp_path), plan_transport="udp")
