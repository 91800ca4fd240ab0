"""Node 0's door for replicas of other hosts (`dsv4/engine/replicas/remote.py`), on loopback:
only a holder of the key gets a join through (HMAC both ways; nothing unpickled before), a
connection that says nothing is dropped after the handshake limit and holds up nobody
meanwhile, a flood is cut at MAX_PENDING handshakes, a refused key is one line at once, and
the identity a joiner must share names what differs."""

from __future__ import annotations

import pickle
import queue
import socket
import time
from multiprocessing.connection import Connection

import pytest

from dsv4 import DEFAULT_MODEL
from dsv4.engine.config import EngineConfig
from dsv4.engine.replicas import remote
from dsv4.engine.replicas.slot import Replica

KEY = "the-shared-secret"


@pytest.fixture
def desk(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(remote, "HANDSHAKE_S", 1.0)
    d = remote.JoinDesk("127.0.0.1", 0, KEY)
    yield d
    d.close()


def port_of(desk: remote.JoinDesk) -> int:
    return desk.sock.getsockname()[1]


def join_message(rank: int = 1) -> tuple:
    return ("join", rank, {"model": "m"}, {"pid": 1, "cores": [0]})


def dial(desk: remote.JoinDesk, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the desk from `source` (any of 127.0.0.0/8 is this host)."""
    return socket.create_connection(("127.0.0.1", port_of(desk)), source_address=(source, 0))


def test_a_key_holder_joins_past_silent_connections(desk: remote.JoinDesk) -> None:
    silent = [dial(desk, "127.0.0.2"), dial(desk, "127.0.0.2"), dial(desk, "127.0.0.3")]
    t0 = time.monotonic()
    conn = remote.connect("127.0.0.1", port_of(desk), KEY, wait_s=5)
    conn.send(join_message())
    got, msg, peer = desk.joined.get(timeout=5)
    assert msg == join_message() and peer == "127.0.0.1"
    assert time.monotonic() - t0 < 1.0  # the silent ones did not hold it up
    got.send(("welcome",))
    assert conn.recv() == ("welcome",)
    for s in silent:  # dropped after the handshake limit
        s.settimeout(5)
        assert s.recv(4096)  # the challenge...
        assert s.recv(4096) == b""  # ...then closed
        s.close()
    got.close()
    conn.close()


def test_a_wrong_key_is_refused_at_once_and_nothing_is_read(desk: remote.JoinDesk) -> None:
    with pytest.raises(remote.JoinError, match="refused this host's key") as e:
        remote.connect("127.0.0.1", port_of(desk), "another-key", wait_s=30)
    assert e.value.code == 2
    # a peer without the key that sends a pickle anyway: never unpickled, never joined
    s = socket.create_connection(("127.0.0.1", port_of(desk)))
    c = Connection(s.detach())
    c.recv_bytes()  # the challenge
    c.send_bytes(pickle.dumps(join_message()))  # instead of the digest
    assert c.recv_bytes() == b"#FAILURE#"
    with pytest.raises((EOFError, OSError)):  # then closed
        c.recv_bytes()
    c.close()
    with pytest.raises(queue.Empty):
        desk.joined.get(timeout=0.5)


def test_a_key_holder_sending_nonsense_is_dropped(desk: remote.JoinDesk) -> None:
    conn = remote.connect("127.0.0.1", port_of(desk), KEY, wait_s=5)
    conn.send(("hello", "not a join"))
    with pytest.raises(EOFError):
        conn.recv()
    with pytest.raises(queue.Empty):
        desk.joined.get(timeout=0.2)


def test_a_flood_from_one_address_is_cut_and_a_joiner_retries_through(desk: remote.JoinDesk, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "HANDSHAKE_S", 3.0)  # none times out before the flood is in
    flood = [dial(desk) for _ in range(remote.MAX_PENDING + 4)]
    challenged = 0
    for s in flood:
        s.settimeout(10)
        challenged += bool(s.recv(4096))  # the challenge; b"" for one closed at once (no thread, no handshake)
    assert challenged == remote.MAX_PENDING_PER_PEER
    conn = remote.connect("127.0.0.1", port_of(desk), KEY, wait_s=10)  # gets in once the silent ones time out
    conn.send(join_message(2))
    assert desk.joined.get(timeout=5)[1] == join_message(2)
    for s in flood:
        s.close()
    conn.close()


def test_a_flood_from_many_addresses_is_cut_at_the_pending_limit(desk: remote.JoinDesk, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "HANDSHAKE_S", 3.0)  # none times out before the flood is in
    flood = [dial(desk, f"127.0.0.{10 + i // 2}") for i in range(remote.MAX_PENDING + 4)]  # 2 per address
    challenged = 0
    for s in flood:  # all kept open meanwhile: a closed one would free its place
        s.settimeout(10)
        challenged += bool(s.recv(4096))
    for s in flood:
        s.close()
    assert challenged == remote.MAX_PENDING


def test_a_trickling_peer_is_cut_at_the_handshake_deadline(desk: remote.JoinDesk) -> None:
    """One deadline over the whole handshake: a peer sending a byte at a time still goes."""
    s = socket.create_connection(("127.0.0.1", port_of(desk)))
    s.settimeout(5)
    s.recv(4096)  # the challenge
    t0 = time.monotonic()
    with pytest.raises(OSError):
        for _ in range(40):  # a 4-byte length header claiming 256 bytes, then a byte each 0.1 s
            s.sendall(b"\x00" if _ else b"\x00\x00\x01\x00")
            time.sleep(0.1)
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    raise OSError("closed")
            except BlockingIOError:
                pass
            finally:
                s.setblocking(True)
                s.settimeout(5)
    assert time.monotonic() - t0 < 2.0 + remote.HANDSHAKE_S
    s.close()


def test_nothing_listening_is_one_line_after_the_wait() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(remote.JoinError, match=f"could not join 127.0.0.1:{port} .* nothing answers") as e:
        remote.connect("127.0.0.1", port, KEY, wait_s=0.5)
    assert e.value.code == 1


def test_the_identity_names_what_differs() -> None:
    a = EngineConfig.create(str(DEFAULT_MODEL), dtype="float32", compile=False)
    b = EngineConfig.create(str(DEFAULT_MODEL), dtype="bfloat16", compile=False)
    ours = remote.identity(a)
    assert remote.differs(ours, remote.identity(a)) == ""
    assert remote.differs(ours, remote.identity(b)) == "its --dtype 'bfloat16' differs from this daemon's 'float32'"
    assert remote.differs(ours, {**ours, "model": "x"}) == "its model differs (config.json, the tensors or the tokenizer)"
    assert remote.differs(ours, {**ours, "dsv4": "0.0.1"}).startswith("it runs dsv4 0.0.1, this daemon")
    assert remote.differs(ours, None) == "it sent no identity"


def test_an_address_not_of_this_host_is_one_line() -> None:
    with pytest.raises(OSError, match="--data-parallel-address 192.0.2.7 --data-parallel-rpc-port 1: cannot listen"):
        remote.JoinDesk("192.0.2.7", 1, KEY)


def test_a_remote_replica_that_sends_half_a_message_holds_up_only_its_own_reader() -> None:
    """The pool reads a remote replica through a thread of its own: half a message leaves
    `message()` answering None at once (the pool's loop goes on), the rest delivers it, and
    an oversized or unreadable message, or the link's end, is reported, not waited on."""
    import struct

    from dsv4.engine.replicas.slot import MAX_REMOTE_MESSAGE, Unreadable

    ours, theirs = socket.socketpair()
    r = Replica(index=1, cores=[], remote=True)
    r.attach(Connection(ours.detach()))
    whole = pickle.dumps(("beat", {"running": 1}))
    frame = struct.pack("!i", len(whole)) + whole
    theirs.sendall(frame[:7])  # half a message, then silence
    t = time.monotonic()
    assert r.message() is None and time.monotonic() - t < 0.5
    theirs.sendall(frame[7:])
    assert _next(r) == ("beat", {"running": 1})
    bad = b"not a pickle"
    theirs.sendall(struct.pack("!i", len(bad)) + bad)
    with pytest.raises(Unreadable):
        _next(r)
    theirs.sendall(struct.pack("!i", -1) + struct.pack("!Q", MAX_REMOTE_MESSAGE + 1))  # a length over the limit
    with pytest.raises(OSError):
        _next(r)
    r.cut()
    r.sender.join(5)
    assert not r.sender.is_alive()  # its reader ended, then the link was closed
    theirs.close()


def _next(r: Replica, wait_s: float = 2.0) -> tuple:
    """The replica's next message, as the pool's loop gets it: `waitable` must wake it (the
    reader rings for each message) within `wait_s`."""
    from multiprocessing.connection import wait

    assert wait([r.waitable], wait_s), "the reader did not ring"
    msg = r.message()
    assert msg is not None
    return msg


def test_a_joiner_told_to_stop_while_it_loads_exits_0_at_once() -> None:
    """Another host's replica that node 0 stops before it serves (it is still loading, here a
    sleep) exits 0 with one line, without finishing the load; once serving, a stop is the
    serving loop's to take (the process goes on)."""
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent('''
        import socket, sys, time
        from multiprocessing.connection import Connection
        from dsv4.engine.replicas.worker import _Link
        link = _Link(Connection(int(sys.argv[1])), gone="dsv4: engine replica 1: the daemon at 10.0.0.1:29600")
        if sys.argv[2] == "serving":
            link.serving.set()
        link.send(("up",))
        time.sleep(3)  # loading
        print("loaded", link.inbox.get_nowait()[0])
    ''')
    for state, code, out, err in (("loading", 0, "", "the daemon at 10.0.0.1:29600 stopped it while it loaded"),
                                  ("serving", 0, "loaded stop", "")):
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-c", child, str(theirs.fileno()), state], pass_fds=[theirs.fileno()],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        theirs.close()
        node0 = Connection(ours.detach())
        assert node0.poll(30) and node0.recv() == ("up",)
        t = time.monotonic()
        node0.send(("stop",))
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == code and stdout.strip() == out and err in stderr, (stdout, stderr)
        if state == "loading":
            assert time.monotonic() - t < 2.5 and stderr.count("\n") == 1  # before the load ends; one line


def test_a_remote_replica_told_to_stop_gets_the_stop_and_its_link_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    """As `close` stops a remote replica: the stop arrives whole; the link closes once the
    replica closes its end, or LINGER_S later when it says nothing; its reader ends either way."""
    from dsv4.engine.replicas import slot

    monkeypatch.setattr(slot, "LINGER_S", 1.0)
    for peer_closes in (True, False):
        ours, theirs = socket.socketpair()
        r = Replica(index=1, cores=[], remote=True)
        r.attach(Connection(ours.detach()))
        peer = Connection(theirs.detach())
        t = time.monotonic()
        r.outbox.put(pickle.dumps(("stop",)))
        r.outbox.put(None)
        r.close_wake()
        assert peer.poll(2) and peer.recv() == ("stop",)
        if peer_closes:
            peer.close()
        r.sender.join(5)
        took = time.monotonic() - t
        assert not r.sender.is_alive() and (took < 0.9 if peer_closes else 0.9 <= took < 3), took
        if not peer_closes:
            assert peer.poll(1) and pytest.raises(EOFError, peer.recv)  # our end closed
            peer.close()
