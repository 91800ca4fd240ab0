"""Rank 0's rendezvous store (`parallel.init`) on one host: while the group forms it listens
on the master address only (127.0.0.1, not every interface) through the very socket that
chose the port (its descriptor handed over: no close-and-rebind window for an impostor);
once every rank has joined (gloo) it no longer listens at all. A master address that is not this host's is one line naming the flags.
The start's meeting points (`parallel.meet`) wait past the group's collective timeout, on every rank.
Traffic stays on loopback; 192.0.2.1 (TEST-NET-1) is only bound to, which fails locally."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from dsv4.model import parallel
from tests.model.test_parallel import _rank_entry, spawn_ranks


def _decode(hex_addr: str) -> tuple[str, int]:
    """/proc/net/tcp's "0100007F:1F90" (or tcp6's 32 hex digits) -> ("127.0.0.1", 8080)."""
    host, port = hex_addr.split(":")
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw), int(port, 16)


def listening(pid: int) -> dict[int, tuple[str, int]]:
    """The TCP sockets process `pid` listens on: socket inode -> (address, port)."""
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(int(link[8:-1]))
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[9]) in mine:  # 0A: LISTEN
                    found[int(cols[9])] = _decode(cols[1])
    return found


def _noop(rank: int, world: int) -> None:
    return None


def test_store_listens_on_the_master_address_only_and_closes_once_joined(tmp_path: Path) -> None:
    sock = parallel.listen("127.0.0.1")
    port, inode = sock.getsockname()[1], os.fstat(sock.fileno()).st_ino
    errors: list[BaseException] = []

    def rank0() -> None:
        try:
            parallel.init(0, 2, "127.0.0.1", port, listener=sock, rendezvous_s=120)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    for _ in range(2400):  # until the store takes the socket over (rank 1 is not started yet)
        if sock.fileno() == -1 or errors:
            break
        time.sleep(0.05)
    # while the group forms: the one listener on the port is our socket, on 127.0.0.1 only
    assert sock.fileno() == -1 and not errors  # handed over (detached), not closed and re-bound
    assert [a for a in listening(os.getpid()).values() if a[1] == port] == [("127.0.0.1", port)]
    assert listening(os.getpid()).get(inode) == ("127.0.0.1", port)
    p = mp.get_context("spawn").Process(target=_rank_entry, args=(1, 2, port, str(tmp_path / "out"), _noop, ()))
    p.start()
    try:
        t.join(240)
        assert not t.is_alive() and not errors, errors
        # the group is up: the store no longer listens
        assert all(a[1] != port for a in listening(os.getpid()).values())
        dist.barrier()  # rank 1's last collective: both leave
        parallel.close()
        p.join(120)
        assert p.exitcode == 0
    finally:
        parallel.close()
        if p.is_alive():
            p.kill()
            p.join()


def test_master_address_not_on_this_host_is_one_line(tiny_checkpoint: Path) -> None:
    from dsv4.engine.config import EngineConfig
    from dsv4.engine.parallel.ranks import RankError, Ranks

    config = EngineConfig.create(str(tiny_checkpoint), tensor_parallel_size=2, nnodes=2, node_rank=0,
                                 master_addr="192.0.2.1", master_port=29555)
    with pytest.raises(RankError, match=r"^--master-addr 192\.0\.2\.1 --master-port 29555: rank 0 cannot listen "
                                        r"for the other ranks at 192\.0\.2\.1:29555 \(.+\)$"):
        Ranks(config)


def _late_meet(rank: int, world: int, late_rank: int, late_s: float) -> list[float]:
    """Rank `late_rank` reaches the meeting point `late_s` after the others; this rank's wait there."""
    if rank == late_rank:
        time.sleep(late_s)
    t = time.monotonic()
    parallel.meet(60.0)
    return [time.monotonic() - t]


@pytest.mark.parametrize("late_rank", [0, 2])
def test_a_meeting_waits_past_the_collective_timeout_on_every_rank(tmp_path: Path, late_rank: int) -> None:
    """One of 3 ranks finishes loading 4 s after the others, in a group whose collectives time
    out after 1 s: every rank gets through (gloo's monitored_barrier failed the early non-zero
    ranks: their sends to a late rank 0 are bounded by the group's timeout)."""
    waits, _ = spawn_ranks(_late_meet, (late_rank, 4.0), tmp_path, world=3, timeout_s=1)  # every rank exits 0
    assert min(w[0] for r, w in enumerate(waits) if r != late_rank) > 2.0, waits  # they did wait for it


def _late_join(rank: int, port: int, out: str) -> None:
    """Rank 1 joins 3 s after rank 0, in a group whose collectives time out after 1 s; then
    rank 0 is 3 s late for an all_reduce. Writes (joined, all_reduce outcome, seconds)."""
    import json
    import torch

    if rank == 1:
        time.sleep(3)
    try:
        parallel.init(rank, 2, "127.0.0.1", port, timeout_s=1, rendezvous_s=120)
    except Exception as e:  # noqa: BLE001  (reported by the test)
        Path(f"{out}.{rank}").write_text(json.dumps([False, f"{type(e).__name__}: {e}"[:200], 0.0]))
        return
    if rank == 0:
        time.sleep(3)
    t = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(1))
        outcome = "ok"
    except Exception as e:  # noqa: BLE001
        outcome = type(e).__name__
    Path(f"{out}.{rank}").write_text(json.dumps([True, outcome, time.monotonic() - t]))
    os._exit(0)  # the group is broken by design: no orderly leave


def test_a_slow_join_waits_for_the_rendezvous_then_collectives_keep_their_timeout(tmp_path: Path) -> None:
    """Forming the group may take the rendezvous timeout (gloo connects its full mesh through
    the store: under load that took over 5 s, and a 5 s collective timeout failed the start);
    once formed, a collective still fails after the collective timeout."""
    import json
    from tests.e2e.util import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_late_join, args=(r, port, str(tmp_path / "out"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    got = [json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1)]
    assert got[0][0] and got[1][0], got  # both joined, 3 s apart under a 1 s collective timeout
    assert got[1][1] != "ok" and got[1][2] < 2.5, got  # rank 1 waited for rank 0's all_reduce 1 s, not 3
