"""The connection sentinel (dsv4/daemon/sentinel.py) as a real process watching this one: once
free descriptors fall under the mark it puts a socket nobody listens on in place of the one it
guards (connects are refused, the path is still a socket of ours), tells the guard once, never
touches another file, guards a new file after `bound()`, and stops at end of file."""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import pytest

from dsv4.daemon.intake import open_descriptors
from dsv4.daemon.paths import check_socket_file
from dsv4.daemon.sentinel import Sentinel, listening_fd
from tests.e2e.util import wait_until

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


def _listener(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    return s


def _ino(path: Path) -> int:
    return os.lstat(path).st_ino


def _refused(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        try:
            c.connect(str(path))
        except ConnectionRefusedError:
            return True
    return False


def _until(cond, timeout: float = 10.0) -> bool:
    return wait_until(cond, timeout, every=0.005)


def _take(n: int) -> list[int]:
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]


def _holds(sentinel: Sentinel, sock: socket.socket) -> bool:
    """Whether the sentinel process holds a copy of `sock` (it has read the BOUND that carried it)."""
    want = f"socket:[{os.fstat(sock.fileno()).st_ino}]"
    fd_dir = f"/proc/{sentinel.proc.pid}/fd"
    return any(os.readlink(f"{fd_dir}/{fd}") == want for fd in os.listdir(fd_dir))


def test_the_door_shuts_when_descriptors_run_low_and_the_guard_hears_it_once(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    lst = _listener(path)
    sentinel = Sentinel(str(path), limit=open_descriptors() + 202, low_water=50)  # 2: its pipes
    sentinel.bound()
    held: list[int] = []
    try:
        assert _until(lambda: _holds(sentinel, lst))
        first = _ino(path)
        held += _take(100)  # 100 of 200 free: above the mark
        time.sleep(0.3)
        assert _ino(path) == first and not sentinel.said_low() and not _refused(path)
        held += _take(80)  # 20 free, under 50
        assert _until(lambda: _ino(path) != first), "the daemon's socket is still in place"
        assert _until(sentinel.said_low)
        assert _refused(path) and check_socket_file(path)  # clients find a socket, and retry
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert not [p for p in tmp_path.iterdir() if p != path]  # no spare name left behind
        time.sleep(0.1)
        assert not sentinel.said_low()  # said once, until the daemon binds again
        # bound again (libzmq replaces the file), still short of descriptors: shut again
        lst.close()
        path.unlink()
        lst = _listener(path)
        second = _ino(path)
        sentinel.bound()
        assert _until(lambda: _ino(path) != second) and _until(sentinel.said_low) and _refused(path)
    finally:
        for fd in held:
            os.close(fd)
        lst.close()
        sentinel.close()
    assert sentinel.proc.returncode == 0


def test_another_socket_at_the_path_is_left_alone(tmp_path: Path) -> None:
    """Another listening socket put at the path after BOUND (no bound() said so; its inode
    number may be the first one's, reused): the device, inode and change time tell them apart."""
    path = tmp_path / "d.sock"
    lst = _listener(path)
    sentinel = Sentinel(str(path), limit=open_descriptors() + 202, low_water=50)
    sentinel.bound()
    held: list[int] = []
    other = None
    try:
        assert _until(lambda: _holds(sentinel, lst))  # BOUND read: the first socket is its to guard
        lst.close()
        path.unlink()
        time.sleep(0.01)  # another change time, whatever the file system's clock granularity
        other = _listener(path)
        second = _ino(path)
        held += _take(180)
        assert _until(sentinel.said_low)  # the guard still hears that descriptors ran low
        assert _ino(path) == second and not _refused(path)
    finally:
        for fd in held:
            os.close(fd)
        if other is not None:
            other.close()
        sentinel.close()


def test_nothing_is_guarded_before_bound_and_it_stops_when_the_daemon_goes(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    lst = _listener(path)
    sentinel = Sentinel(str(path), limit=open_descriptors() + 10, low_water=20)  # low from the start
    try:
        first = _ino(path)
        time.sleep(0.2)
        assert _ino(path) == first and not _refused(path) and not sentinel.said_low()  # not bound yet
        sentinel.bound()
        assert _until(sentinel.said_low) and _refused(path)
        assert sentinel.proc.poll() is None
        sentinel._chan.close()  # what the daemon's exit does to its end
        assert sentinel.proc.wait(5) == 0
    finally:
        lst.close()
        sentinel.close()


def test_it_holds_the_listening_socket_only_while_bound(tmp_path: Path) -> None:
    """Its copy of the listener wakes it on a pending connect; after `unbound()` it lets the
    copy go, so the closed listener refuses connects (a copy would queue them)."""
    path = tmp_path / "d.sock"
    lst = _listener(path)
    found = listening_fd(str(path), set())
    assert found is not None and found[0] == lst.fileno()
    assert listening_fd(str(path), {found[1]}) is None  # handed over before: not found again
    sentinel = Sentinel(str(path), limit=open_descriptors() + 1000, low_water=20)
    try:
        sentinel.bound()
        lst.close()  # the daemon's listener goes; the sentinel's copy keeps the socket listening
        assert _until(lambda: not _refused(path), 2.0)
        sentinel.unbound()
        assert _until(lambda: _refused(path))
    finally:
        sentinel.close()


def test_a_guard_whose_sentinel_dies_goes_on_alone(tmp_path: Path) -> None:
    """A sentinel killed (SIGTERM to the process group, the OOM killer) leaves its pipe at end
    of file: the guard stops polling it (no busy loop on an always-readable pipe) and warns."""
    import zmq

    from dsv4.daemon.intake import ConnectionGuard

    ep = f"ipc://{tmp_path}/d.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(ep)
    sentinel = Sentinel(str(tmp_path / "d.sock"), limit=open_descriptors() + 1000, low_water=20)
    sentinel.bound()
    guard = ConnectionGuard(sock, ep, 100, lambda: None, sentinel=sentinel)
    try:
        guard.handle()
        assert guard._sentinel_alive
        sentinel.proc.kill()
        sentinel.proc.wait()
        assert _until(lambda: (guard.handle(), not guard._sentinel_alive)[1])
        guard.handle()  # and on: nothing raises, nothing to unbind
        assert not guard.refusing
    finally:
        guard.close()
        sock.close(0)
        ctx.term()
