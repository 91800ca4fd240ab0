"""Engine replicas on other hosts (`serve --data-parallel-address ADDR --data-parallel-rpc-port PORT`).

    node 0:  dsv4 serve --data-parallel-size 3 --data-parallel-size-local 1 --data-parallel-address A --data-parallel-rpc-port P
    host 1:  dsv4 serve --data-parallel-size 3 --data-parallel-rank 1 --data-parallel-address A --data-parallel-rpc-port P
    host 2:  dsv4 serve --data-parallel-size 3 --data-parallel-rank 2 --data-parallel-address A --data-parallel-rpc-port P

Node 0's pool (`JoinDesk`) listens on A:P only (bound there, as the tensor-parallel store is:
`parallel.listen`). A joining host proves the shared key (DSV4_API_KEY or --api-key, the
daemon's own) by an HMAC challenge both ways (`multiprocessing.connection`: the key never
travels), then says which replica it is and what it serves (`identity`: the model's
config.json and tensor list, dtype, quantization, lengths). Nothing is unpickled before the
key is proven; a connection that does not prove it within HANDSHAKE_S is dropped, and at most
MAX_PENDING handshakes run at once (a flood of connections costs node 0 a socket each, briefly).
A replica with another model, dtype or key is refused before it loads a byte (exit 2). Once
welcomed, the joining process runs `worker.replica_main` over that connection, exactly as a
local replica does over its pipe. It is not torch.distributed's TCPStore: the store has no
authentication, and this link lives as long as the replica and carries pickles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any, Iterator

from dsv4.machine import installed_version
from dsv4.safetensors_header import tensor_listing

log = logging.getLogger("dsv4.replicas")

HANDSHAKE_S = 10.0  # a joining connection proves the key and says who it is within this
MAX_PENDING = 8  # handshakes at once; more connections are closed at once
MAX_PENDING_PER_PEER = 2  # of them from one address
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
IDENTITY_FLAGS = {"dtype": "--dtype", "quantization": "--quantization", "tensor_parallel_size": "--tensor-parallel-size",
                  "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
                  "num_speculative_tokens": "--num-speculative-tokens", "enable_prefix_caching": "--enable-prefix-caching",
                  "draft_vocab_ids": "--draft-vocab"}


class JoinError(Exception):
    """This host could not join node 0 (one line); `code` is the exit status (2: refused)."""

    def __init__(self, line: str, code: int = 1) -> None:
        super().__init__(line)
        self.code = code


def link_key(key: str) -> bytes:
    """The HMAC key of the link, from the shared secret."""
    return hashlib.sha256(b"dsv4-replica-link\0" + key.encode()).digest()


def identity(config: Any) -> dict[str, Any]:
    """What a joining replica must share with node 0: the model (its config.json and every
    tensor's name, dtype and shape: paths differ between hosts), and the settings that change
    what it computes or how requests are routed to it."""
    model = Path(config.model)
    digest = hashlib.sha256((model / "config.json").read_bytes())
    digest.update(json.dumps(sorted(tensor_listing(model).values()), default=str).encode())
    for name in TOKENIZER_FILES:  # the daemon tokenizes; a replica detokenizes what it streams
        if (model / name).is_file():
            digest.update(name.encode() + hashlib.sha256((model / name).read_bytes()).digest())
    return {"dsv4": installed_version(), "model": digest.hexdigest(),
            **{k: _short(repr(getattr(config, k, None))) for k in IDENTITY_FLAGS}}


def _short(text: str) -> str:
    """A setting's repr, or its digest when long (a draft vocabulary's ids)."""
    return text if len(text) <= 64 else "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def differs(ours: dict[str, Any], theirs: Any) -> str:
    """'' when a joiner's identity is ours, else what differs (one phrase)."""
    if not isinstance(theirs, dict):
        return "it sent no identity"
    if theirs.get("dsv4") != ours["dsv4"]:  # the messages between them are this version's
        return f"it runs dsv4 {theirs.get('dsv4')}, this daemon {ours['dsv4']}"
    if theirs.get("model") != ours["model"]:
        return "its model differs (config.json, the tensors or the tokenizer)"
    for k, flag in IDENTITY_FLAGS.items():
        if theirs.get(k) != ours[k]:
            return f"its {flag} {theirs.get(k)} differs from this daemon's {ours[k]}"
    return ""


@contextlib.contextmanager
def _deadline(sock: socket.socket, seconds: float) -> Iterator[None]:
    """Shut `sock` down unless the block ends within `seconds`: one bound over a whole
    handshake (a per-read timeout would let a peer trickle a byte at a time)."""
    lock, done = threading.Lock(), []

    def cut() -> None:
        with lock:
            if not done:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            done.append(True)
        timer.cancel()


def _link(sock: socket.socket) -> Connection:
    """A `Connection` on a duplicate of `sock`'s descriptor (`sock` stays ours to shut down
    until the handshake ends, so its number cannot be reused meanwhile), with TCP keepalive:
    a host that loses power or its network is noticed within about half a minute, also while
    its replica loads (it does not beat then)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 30000)):
        if hasattr(socket, name):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return Connection(os.dup(sock.fileno()))


class JoinDesk:
    """Node 0's door: a listening socket and a thread accepting on it; `joined` holds
    (connection, join message, peer address) for each joiner that proved the key."""

    def __init__(self, address: str, port: int, key: str) -> None:
        from dsv4.model.parallel import listen

        try:
            self.sock = listen(address, port)
        except (OSError, UnicodeError) as e:
            raise OSError(f"--data-parallel-address {address} --data-parallel-rpc-port {port}: cannot listen there "
                          f"({getattr(e, 'strerror', None) or e}); use an address of this host and a free port") from None
        self.key = link_key(key)
        self.where = f"{address}:{self.sock.getsockname()[1]}"
        self.joined: "queue.Queue[tuple[Connection, tuple, str]]" = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # handshakes under way, per peer address
        self._closed = False
        threading.Thread(target=self._accept, name="dsv4-replica-desk", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self.sock.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("the replica desk could not accept a connection (%s); going on", e)
                time.sleep(0.1)  # out of descriptors, or a peer's error passed on: the door stays open
                continue
            with self._lock:
                n = self._pending.get(peer[0], 0)
                full = n >= MAX_PENDING_PER_PEER or sum(self._pending.values()) >= MAX_PENDING
                if not full:
                    self._pending[peer[0]] = n + 1
            if full:
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock, peer[0]), daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        conn = _link(sock)
        try:
            with _deadline(sock, HANDSHAKE_S):
                deliver_challenge(conn, self.key)
                answer_challenge(conn, self.key)
                msg = conn.recv()  # authenticated: a pickle from a holder of the key
            if not (isinstance(msg, tuple) and len(msg) == 4 and msg[0] == "join"):
                raise ValueError("not a join message")
            with self._lock:
                if not self._closed:
                    self.joined.put((conn, msg, peer))
                    conn = None
        except AuthenticationError:
            log.warning("a replica connecting from %s did not prove the key (DSV4_API_KEY): dropped", peer)
        except (OSError, EOFError, ValueError, TypeError) as e:
            log.warning("a connection from %s to the replica desk failed its handshake (%s): dropped", peer,
                        type(e).__name__)
        except Exception as e:  # noqa: BLE001  (an unpickling error from a key holder: theirs, not ours)
            log.warning("a replica from %s sent what could not be read (%s): dropped", peer, e)
        finally:
            sock.close()
            if conn is not None:
                conn.close()
            with self._lock:
                self._pending[peer] -= 1
                if not self._pending[peer]:
                    del self._pending[peer]

    def close(self) -> None:
        """Stop accepting; a joiner welcomed by nobody yet is told node 0 is stopping."""
        with self._lock:
            self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        while True:
            try:
                conn = self.joined.get_nowait()[0]
            except queue.Empty:
                return
            try:
                conn.send(("stopping", "node 0 is stopping"))
            except (OSError, ValueError):
                pass
            conn.close()


def connect(address: str, port: int, key: str, wait_s: float) -> Connection:
    """This host's link to node 0's desk, the key proven both ways; retried until `wait_s`
    (node 0 may still be starting, or its desk busy with other handshakes). `JoinError`
    when it cannot be had, at once (code 2) when node 0 refuses the key."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _handshake(address, port, key)
        except (OSError, UnicodeError) as e:  # not there yet, or the handshake was cut (a full desk)
            if time.monotonic() >= deadline:
                raise JoinError(f"could not join {address}:{port} (--data-parallel-address/--data-parallel-rpc-port) "
                                f"within {wait_s:g} s: {getattr(e, 'strerror', None) or e}") from None
            time.sleep(0.5)


def _handshake(address: str, port: int, key: str) -> Connection:
    try:
        sock = socket.create_connection((address, port), timeout=HANDSHAKE_S)
    except OSError as e:
        raise OSError(f"nothing answers at {address}:{port} ({e.strerror or e})") from None
    sock.settimeout(None)
    conn = _link(sock)
    try:
        with _deadline(sock, HANDSHAKE_S):
            answer_challenge(conn, link_key(key))
            deliver_challenge(conn, link_key(key))
        return conn
    except AuthenticationError:
        conn.close()
        raise JoinError(f"node 0 at {address}:{port} refused this host's key: DSV4_API_KEY (or --api-key) must be "
                        f"the same on every host", code=2) from None
    except (OSError, EOFError) as e:
        conn.close()
        raise OSError(f"{address}:{port} cut the handshake ({type(e).__name__}): a full desk, or not a dsv4 "
                      f"daemon's --data-parallel-rpc-port") from None
    finally:
        sock.close()


def join(config: Any, key: str) -> int:
    """`dsv4 serve --data-parallel-rank R` (R > 0): be replica R of node 0's daemon until it
    stops us (exit 0). Refused (another model, dtype, rank taken): one line, exit 2."""
    from dsv4.engine.replicas.worker import replica_config, replica_main

    rank, where = config.data_parallel_rank, f"{config.data_parallel_address}:{config.data_parallel_rpc_port}"
    ours, cores = identity(config), sorted(os.sched_getaffinity(0))  # before connecting: the desk waits briefly
    try:
        conn = connect(config.data_parallel_address, config.data_parallel_rpc_port, key, config.rendezvous_timeout)
        conn.send(("join", rank, ours, {"pid": os.getpid(), "cores": cores}))
        if not conn.poll(config.rendezvous_timeout):
            raise JoinError(f"node 0 at {where} did not answer the join within --rendezvous-timeout")
        reply = conn.recv()
    except (JoinError, EOFError, OSError) as e:
        print(f"dsv4: engine replica {rank}: {str(e) or type(e).__name__}", file=sys.stderr)
        return e.code if isinstance(e, JoinError) else 1
    if reply[0] != "welcome":
        what = "refused it" if reply[0] == "refused" else "did not take it"
        print(f"dsv4: engine replica {rank}: node 0 at {where} {what}: {reply[1]}", file=sys.stderr)
        return 2 if reply[0] == "refused" else 1
    log.info("engine replica %d joined the daemon at %s; loading", rank, where)
    old = signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop: close the engine, exit 0
    try:
        return replica_main(rank, replica_config(config, rank), cores, conn,
                            gone=f"dsv4: engine replica {rank}: the daemon at {where}")
    except KeyboardInterrupt:
        print(f"dsv4: engine replica {rank}: stopped here; node 0 sends its requests elsewhere", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGTERM, old)


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)
