"""Attacks on the socket, reproduced and refused (issue 11), against a fake engine (no torch).

Another user is simulated by what they could leave behind: a socket directory with
group/world access, a symlink, a directory or socket owned by another uid (made with
chown, as root), a pid or log file planted as a symlink; a fake daemon listening there
must receive nothing. The server's own guards (API key, busy limits, prompts tokenized
off the loop) run on a `Server` in a thread with the real `Client`.
"""

from __future__ import annotations

import os
import shutil
import socket as pysocket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import zmq

from dsv4.cli.options import CliError, check_listen_key
from dsv4.daemon import paths
from dsv4.daemon import protocol as P
from dsv4.daemon.client import Client, DaemonError
from dsv4.daemon.server import Server
from tests.unit.test_protocol import FakeEngine, Harness, collect, fake_params

OTHER_UID = 12345
as_root = pytest.mark.skipif(os.getuid() != 0, reason="making a directory owned by another uid needs root")
CMD = [str(Path(sys.executable).parent / "dsv4")]


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsv4t-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def hostile_dir(base: Path, kind: str) -> tuple[Path, Path]:
    """`base/dsv4` set up the way another user could leave it; (the path, the real directory behind it)."""
    d = base / "dsv4"
    if kind == "world-writable":
        d.mkdir()
        os.chmod(d, 0o777)
        return d, d
    if kind == "symlink":
        real = base / "elsewhere"
        real.mkdir(mode=0o755)
        os.chmod(real, 0o755)
        d.symlink_to(real)
        return d, real
    assert kind == "other-owner"
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, OTHER_UID)
    return d, d


KINDS = ["world-writable", "symlink", pytest.param("other-owner", marks=as_root)]


class FakeDaemon:
    """What an attacker runs in their directory: a ROUTER that records whatever arrives."""

    def __init__(self, sock_path: Path) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{sock_path}")

    def received(self, wait_ms: int = 300) -> bool:
        return bool(self.sock.poll(wait_ms))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


# ---------------------------------------------------------------------- 1: the client trusts nothing
@pytest.mark.parametrize("kind", KINDS)
def test_client_refuses_a_socket_directory_another_user_controls(base: Path, kind: str) -> None:
    d, real = hostile_dir(base, kind)
    fake = FakeDaemon(real / "dsv4.sock")
    try:
        env = {**os.environ, "XDG_RUNTIME_DIR": str(base), "OMP_NUM_THREADS": "1"}
        env.pop("DSV4_SOCKET", None)
        r = subprocess.run([*CMD, "run", "--max-tokens", "2", "my password=hunter2"], env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stderr
        assert str(d) in r.stderr and "internal error" not in r.stderr and len(r.stderr.splitlines()) == 1
        assert "XDG_RUNTIME_DIR" in r.stderr  # says how to fix it
        assert not fake.received(), "the client talked to a daemon in an untrusted directory"
    finally:
        fake.close()


@as_root
def test_client_refuses_a_socket_owned_by_another_uid(base: Path) -> None:
    sock = base / "d.sock"
    ep = f"ipc://{sock}"
    lock = paths.PidLock(paths.pid_file(ep))
    assert lock.acquire()  # "a daemon is running"
    fake = FakeDaemon(sock)
    os.chown(sock, OTHER_UID, OTHER_UID)
    try:
        with Client(ep) as c, pytest.raises(paths.UnsafePathError, match=f"belongs to uid {OTHER_UID}"):
            c.connect()
        assert not fake.received()
    finally:
        fake.close()
        lock.release()


# ---------------------------------------------------------------------- 2, 3: serve trusts nothing
@pytest.mark.parametrize("kind", KINDS)
def test_serve_refuses_and_never_chmods_an_untrusted_directory(base: Path, kind: str) -> None:
    d, real = hostile_dir(base, kind)
    before = os.stat(real)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(base), "OMP_NUM_THREADS": "1"}
    env.pop("DSV4_SOCKET", None)
    r = subprocess.run([*CMD, "serve"], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    assert "socket directory" in r.stderr and str(d) in r.stderr
    after = os.stat(real)
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)  # not chmod-ed into shape
    assert list(real.iterdir()) == []  # nothing bound or written there
    # an explicit ipc:// path gets the same checks on its parent directory
    r = subprocess.run([*CMD, "serve", "--socket", f"ipc://{d}/x.sock"], env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "socket directory" in r.stderr, r.stderr


def test_pid_file_planted_as_a_symlink_is_not_followed(base: Path) -> None:
    victim = base / "victim.txt"
    victim.write_text("precious\n")
    ep = f"ipc://{base}/d.sock"
    paths.pid_file(ep).symlink_to(victim)
    with pytest.raises(paths.UnsafePathError, match="symlink"):
        paths.PidLock(paths.pid_file(ep)).acquire()
    assert paths.read_pid(paths.pid_file(ep)) is None and paths.daemon_pid(ep) is None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*CMD, "serve", "--socket", ep], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "symlink" in r.stderr and "internal error" not in r.stderr, r.stderr
    assert victim.read_text() == "precious\n"


def test_pid_file_is_created_private_and_a_fresh_directory_is_0700(base: Path) -> None:
    d = base / "new" / "run"
    paths.ensure_private_dir(d)
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    lock = paths.PidLock(d / "s.sock.pid")
    assert lock.acquire()
    assert stat.S_IMODE(os.lstat(d / "s.sock.pid").st_mode) == 0o600
    lock.release()


def test_log_file_planted_as_a_symlink_is_refused(base: Path) -> None:
    victim = base / "victim.txt"
    victim.write_text("precious\n")
    state = base / "state"
    (state / "dsv4").mkdir(parents=True)
    (state / "dsv4").chmod(0o700)  # a private log directory: the planted file is what is refused
    (state / "dsv4" / "dsv4.log").symlink_to(victim)
    env = {**os.environ, "XDG_STATE_HOME": str(state), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*CMD, "serve", "--detach", "--socket", f"ipc://{base}/d.sock"], env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "symlink" in r.stderr, r.stderr
    assert victim.read_text() == "precious\n"
    assert not (base / "d.sock").exists()


# ---------------------------------------------------------------------- 5: tcp needs a key
def test_non_loopback_tcp_needs_a_key() -> None:
    for ep in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://192.168.1.7:5555", "tcp://example.org:5555"):
        with pytest.raises(CliError, match="--api-key"):
            check_listen_key(ep, None)
        assert check_listen_key(ep, "s3cret") is False
    for ep in ("tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555"):
        assert check_listen_key(ep, None) is True  # allowed, with a warning
    assert check_listen_key("ipc:///run/x.sock", None) is False


def test_serve_on_a_public_address_without_a_key_is_a_usage_error() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DSV4_API_KEY"}
    r = subprocess.run([*CMD, "serve", "--socket", "tcp://0.0.0.0:5999"], env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--api-key" in r.stderr and "DSV4_API_KEY" in r.stderr, r.stderr


@pytest.fixture
def keyed() -> Iterator[Harness]:
    h = Harness(api_key="s3cret")
    yield h
    h.close()


def test_wrong_or_missing_key_gets_an_error_and_nothing_else(keyed: Harness) -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(keyed.endpoint)
    stop = msgpack.packb({"v": P.PROTOCOL_VERSION, "type": "shutdown", "id": "x"})
    try:
        for parts in ([stop], [P.KEY_PREFIX + b"guess", stop], [P.KEY_PREFIX + b"s3cre", stop],
                      [b"s3cret", stop], [b"garbage"]):
            raw.send_multipart(parts)
            assert raw.poll(5000)
            reply = msgpack.unpackb(raw.recv())
            assert reply["type"] == "error" and reply["code"] == P.ERR_UNAUTHORIZED and set(reply) == {
                "v", "type", "id", "code", "message"}
    finally:
        raw.close()
    assert keyed.server.stop_reason is None and keyed.server.requests.clients == {}  # nothing processed, no state
    with Client(keyed.endpoint, api_key="wrong") as c, pytest.raises(DaemonError, match="API key"):
        c.connect()
    with Client(keyed.endpoint, api_key="s3cret") as c:
        c.connect()
        assert collect(c, c.generate("hi", {"max_tokens": 3}))[0] == "xxx"


def test_a_key_is_ignored_by_a_daemon_without_one() -> None:
    h = Harness()
    try:
        with Client(h.endpoint, api_key="anything") as c:
            c.connect()
            assert collect(c, c.generate("hi", {"max_tokens": 2}))[0] == "xx"
    finally:
        h.close()


# ---------------------------------------------------------------------- 6: caps -> busy
def test_too_many_clients_or_requests_get_busy_and_others_keep_working() -> None:
    h = Harness(FakeEngine(step_delay=0.01), max_clients=2, max_requests=3)
    clients = [Client(h.endpoint) for _ in range(3)]
    try:
        rids = []
        for c in clients[:2]:  # two clients with requests in flight: the table is full
            c.connect()
            rids.append((c, c.generate("long", {"max_tokens": 100000})))
            assert c.status()["in_flight"] == len(rids)
        with pytest.raises(DaemonError, match="busy: 2 clients"):
            clients[2].connect()
        rids.append((clients[0], clients[0].generate("long", {"max_tokens": 100000})))
        assert clients[0].status()["in_flight"] == 3  # answered after its generate (one connection)
        extra = clients[1].generate("one more", {"max_tokens": 2})
        with pytest.raises(DaemonError, match="busy: 3 requests"):
            list(clients[1].stream(extra, deadline=time.monotonic() + 10))
        for c, rid in rids:
            c.cancel(rid)
        # nothing in flight now: idle clients are forgotten to make room for a new one
        clients[2].close(0)
        clients[2] = Client(h.endpoint)
        clients[2].connect()
        assert collect(clients[2], clients[2].generate("now", {"max_tokens": 2}))[0] == "xx"
        assert collect(clients[1], clients[1].generate("again", {"max_tokens": 1}))[0] == "x"
    finally:
        for c in clients:
            c.close(0)
        h.close()


# ---------------------------------------------------------------------- 7: big prompts off the loop
class SlowTokenizingEngine(FakeEngine):
    """Text over the inline limit waits on `release` while it is 'tokenized' (on the server's worker)."""

    def __init__(self) -> None:
        super().__init__(step_delay=0.005)
        self.release = threading.Event()
        self.max_text_bytes = 1 << 20

    def check_text_size(self, prompt: str, system: str | None = None) -> None:
        if len(prompt.encode()) > self.max_text_bytes:
            raise ValueError(f"prompt of {len(prompt.encode())} bytes exceeds the limit of {self.max_text_bytes}")

    def encode_request(self, prompt: str, **_: Any) -> list[int]:
        if len(prompt) > 1000:
            assert self.release.wait(30)
            return [1] * 10
        return [1] * len(prompt)


def test_a_big_prompt_being_tokenized_does_not_stall_other_streams() -> None:
    engine = SlowTokenizingEngine()
    h = Harness(engine)
    try:
        with Client(h.endpoint) as big, Client(h.endpoint) as small:
            big.connect()
            small.connect()
            rid_big = big.generate("y" * (64 << 10), {"max_tokens": 2})
            # the big prompt is stuck in the tokenizer; a small request still streams to the end
            assert collect(small, small.generate("hi", {"max_tokens": 5}))[0] == "xxxxx"
            assert h.server.status()["in_flight"] == 1
            with pytest.raises(DaemonError, match="exceeds the limit"):
                list(small.stream(small.generate("z" * (2 << 20), {"max_tokens": 2}),
                                  deadline=time.monotonic() + 10))
            engine.release.set()
            text = "".join(m.get("text", "") for m in big.stream(rid_big, deadline=time.monotonic() + 10))
            assert text == "xx"
    finally:
        engine.release.set()
        h.close()


def test_cancelling_a_request_while_its_prompt_is_tokenized() -> None:
    engine = SlowTokenizingEngine()
    h = Harness(engine)
    try:
        with Client(h.endpoint) as c:
            c.connect()
            rid = c.generate("y" * (64 << 10), {"max_tokens": 2})
            c.cancel(rid)
            final = [m for m in c.stream(rid, deadline=time.monotonic() + 10)][-1]
            assert final["finish_reason"] == "abort"
            engine.release.set()
            assert collect(c, c.generate("after", {"max_tokens": 1}))[0] == "x"
            assert engine.live == {}
    finally:
        engine.release.set()
        h.close()


# ---------------------------------------------------------------------- 6: the descriptor guard
def test_connection_guard_counts_churn_exactly() -> None:
    h = Harness()
    path = h.endpoint[len("ipc://"):]
    ctx = zmq.Context()
    kept = []
    try:
        for i in range(10):
            s = pysocket.socket(pysocket.AF_UNIX)  # closed at once, or after a garbage greeting
            s.connect(path)
            if i % 2:
                s.send(b"\x00not a zmtp greeting" * 4)
            s.close()
            d = ctx.socket(zmq.DEALER)
            d.connect(h.endpoint)
            d.send(b"x")
            if i % 3 == 0:
                kept.append(d)
            else:
                d.close(0)
        assert wait_for(lambda: h.server._guard.open == len(kept) == 4)  # only the DEALERs still open
    finally:
        ctx.destroy(0)
        h.close()


def test_connection_guard_refuses_at_its_limit_then_accepts_again() -> None:
    h = Harness(max_connections=5)
    path = h.endpoint[len("ipc://"):]
    held = []
    try:
        for _ in range(5):
            s = pysocket.socket(pysocket.AF_UNIX)
            s.connect(path)
            held.append(s)
        assert wait_for(lambda: h.server._guard.refusals == 1)
        for s in held:  # dropped: after the server's greeting, end of file (a timeout would raise)
            s.settimeout(10)
            while s.recv(4096):
                pass
        with Client(h.endpoint) as c:  # zmq retries until the endpoint is bound again
            c.connect(timeout_s=10)
            assert collect(c, c.generate("hi", {"max_tokens": 2}))[0] == "xx"
        assert h.server._guard.refusals == 1
    finally:
        for s in held:
            s.close()
        h.close()


def wait_for(cond: Any, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def test_generate_while_stopping_is_refused_with_its_reason() -> None:
    server = Server(FakeEngine(), "ipc:///nonexistent/s.sock")
    sent: list[dict[str, Any]] = []
    server.send = lambda client, msg, reap=True: sent.append(msg) or True  # type: ignore[method-assign]
    server.stop_reason = "stop requested by a client"
    server._handle(b"c", [msgpack.packb({"v": P.PROTOCOL_VERSION, "type": "generate", "id": "g", "prompt": "hi"})])
    assert [(m["type"], m["code"]) for m in sent] == [("error", P.ERR_SHUTTING_DOWN)]
    server.close()
