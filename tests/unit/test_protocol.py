"""Protocol validation, daemon paths, and the server loop against a fake engine (no model, no torch).

The server runs in a thread on a short ipc socket; clients are the real `Client` or a
raw DEALER for frames a real client would never send.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import msgpack
import pytest
import zmq

from dsv4.daemon import paths
from dsv4.daemon import protocol as P
from dsv4.daemon.client import Client, DaemonError, DaemonUnreachable
from dsv4.daemon.contract import ServedEngine
from dsv4.daemon.server import Server


# ---------------------------------------------------------------------- protocol
def frame(**msg: Any) -> bytes:
    return msgpack.packb({"v": P.PROTOCOL_VERSION, **msg}, use_bin_type=True)


def code_of(data: bytes) -> str:
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(data)
    return e.value.code


def test_round_trip_every_request_type() -> None:
    for req in (P.Ping("a"), P.Status("b"), P.Shutdown("c"), P.Cancel("d", target="x"),
                P.Generate("e", prompt=[1, 2, 3], mode="raw", params={"max_tokens": 4}, pieces=True),
                P.Generate("f", prompt="hello", system="be brief", thinking=True)):
        assert P.decode_request(P.encode(req.to_wire())) == req


@pytest.mark.parametrize("data,code", [
    (b"\xc1\xff garbage", P.ERR_BAD_MESSAGE),
    (msgpack.packb([1, 2, 3]), P.ERR_BAD_MESSAGE),
    (msgpack.packb({"v": 99, "type": "ping", "id": "a"}), P.ERR_BAD_VERSION),
    (msgpack.packb({"type": "ping", "id": "a"}), P.ERR_BAD_VERSION),
    (frame(type="launch", id="a"), P.ERR_UNKNOWN_TYPE),
    (frame(type="ping"), P.ERR_BAD_FIELD),
    (frame(type="ping", id=""), P.ERR_BAD_FIELD),
    (frame(type="ping", id="x" * 200), P.ERR_BAD_FIELD),
    (frame(type="ping", id="a", extra=1), P.ERR_BAD_FIELD),
    (frame(type="generate", id="a"), P.ERR_BAD_FIELD),
    (frame(type="generate", id="a", prompt=7), P.ERR_BAD_FIELD),
    (frame(type="generate", id="a", prompt=[1, -2]), P.ERR_BAD_FIELD),
    (frame(type="generate", id="a", prompt=[1, True]), P.ERR_BAD_FIELD),
    (frame(type="generate", id="a", prompt="x", mode="poem"), P.ERR_BAD_FIELD),
    (frame(type="generate", id="a", prompt="x", params=[1]), P.ERR_BAD_FIELD),
    (frame(type="generate", id="a", prompt="x", thinking=1), P.ERR_BAD_FIELD),
    (frame(type="generate", id="a", prompt="x" * (P.MAX_PROMPT_CHARS + 1)), P.ERR_TOO_LARGE),
    (frame(type="cancel", id="a"), P.ERR_BAD_FIELD),
    (b"\x00" * (P.MAX_MESSAGE_BYTES + 1), P.ERR_TOO_LARGE),
])
def test_bad_messages_are_protocol_errors(data: bytes, code: str) -> None:
    assert code_of(data) == code


def test_error_keeps_the_request_id_when_it_can() -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(msgpack.packb({"v": 0, "type": "ping", "id": "mine"}))
    assert e.value.request_id == "mine"


def test_request_id_of_reads_the_id_without_decoding_the_rest() -> None:
    big = P.encode(P.Generate("mine", prompt="x" * (20 << 20)).to_wire())
    assert P.request_id_of(big) == "mine" and P.request_id_of(big[:200]) == "mine"
    assert P.request_id_of(msgpack.packb({"a" * 1000: [1, 2], "id": "late"})) == "late"
    for bad in (b"", b"\x93garbage", msgpack.packb([1, 2]), msgpack.packb({"id": 5}), msgpack.packb({"id": ""}),
                msgpack.packb({"x": "y" * (100 << 10), "id": "past the window"})):
        assert P.request_id_of(bad) is None


def test_generate_client_field() -> None:
    assert P.decode_request(frame(type="generate", id="a", prompt="x", client="user-1")).client == "user-1"
    assert code_of(frame(type="generate", id="a", prompt="x", client=5)) == P.ERR_BAD_FIELD
    assert code_of(frame(type="generate", id="a", prompt="x", client="u" * (P.MAX_CLIENT_LEN + 1))) == P.ERR_BAD_FIELD


def test_to_wire_makes_anything_packable() -> None:
    out = P.to_wire({"a": (1, 2), "b": float("nan"), "c": Path("/x"), 3: {"d": object()}})
    assert out["a"] == [1, 2] and out["b"] is None and out["c"] == "/x" and isinstance(out["3"]["d"], str)
    assert P.decode_reply(P.encode(P.final("r", "stop", None, {"usage": {"prompt_tokens": 1}, "timings": {
        "ttft_s": math.inf}})))["timings"]["ttft_s"] is None


def test_final_says_what_ran_compiled() -> None:
    buckets = {"main": [1, 2, 4], "mtp": [1, 2]}
    msg = P.decode_reply(P.encode(P.final("r", "stop", None, {"compiled": True, "compiled_buckets": buckets})))
    assert msg["compiled"] is True and msg["compiled_buckets"] == buckets
    aborted = P.decode_reply(P.encode(P.final("r", "abort", "cancelled")))  # no metrics: nil, as usage
    assert aborted["compiled"] is None and aborted["compiled_buckets"] is None and aborted["usage"] is None


# ---------------------------------------------------------------------- paths
def test_endpoint_defaults_and_overrides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DSV4_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert paths.default_endpoint() == f"ipc://{tmp_path}/dsv4/dsv4.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert paths.default_endpoint() == f"ipc:///tmp/dsv4-{os.getuid()}/dsv4.sock"
    monkeypatch.setenv("DSV4_SOCKET", "tcp://127.0.0.1:5555")
    assert paths.resolve_endpoint(None) == "tcp://127.0.0.1:5555"
    assert paths.resolve_endpoint("/tmp/x.sock") == "ipc:///tmp/x.sock"
    assert paths.pid_file("ipc:///tmp/x.sock") == Path("/tmp/x.sock.pid")


def test_long_socket_path_is_refused_with_its_length() -> None:
    long = "/tmp/" + "d" * 120 + "/s.sock"
    with pytest.raises(paths.PathError, match=r"socket path is \d+ bytes.*at most 107"):
        paths.resolve_endpoint(long)
    with pytest.raises(paths.PathError, match="unsupported endpoint"):
        paths.resolve_endpoint("udp://x")


def test_private_dir_and_pid_lock(tmp_path: Path) -> None:
    d = tmp_path / "run"
    paths.ensure_private_dir(d)
    assert d.is_dir()
    ep = f"ipc://{d}/s.sock"
    assert paths.daemon_pid(ep) is None
    a, b = paths.PidLock(paths.pid_file(ep)), paths.PidLock(paths.pid_file(ep))
    assert a.acquire()
    assert not b.acquire()
    assert paths.daemon_pid(ep) == os.getpid()
    a.release()
    assert not paths.pid_file(ep).exists() and paths.daemon_pid(ep) is None
    (d / "s.sock").write_text("not a socket")
    with pytest.raises(paths.PathError, match="not a socket"):
        paths.remove_stale(ep)


# ---------------------------------------------------------------------- server
class FakeEngine:
    """One token ('x', id 7) per request per step; prompt 'boom' makes step() raise. Implements
    the daemon's engine contract (`ServedEngine`); text prompts pass through untokenized."""

    max_model_len = 51
    max_text_bytes = None  # no frame limit
    ranks = None
    weight_bytes, rank_weight_bytes = 0, [0]
    quant_note = compile_note = ""
    policy, calibration_note = None, ""

    def __init__(self, step_delay: float = 0.005) -> None:
        self.live: dict[str, list[int]] = {}  # rid -> [emitted, max_tokens]
        self.aborted: list[str] = []
        self.step_delay = step_delay
        self.tokenizer = None
        self.explode = False

    def make_params(self, fields: dict[str, Any]) -> Any:
        return fake_params(fields)

    def check_text_size(self, prompt: str, system: Any = None) -> None:
        pass

    def encode_request(self, prompt: str, **_: Any) -> str:
        return prompt

    def submit_grammar(self, spec: dict[str, Any]) -> Future:
        raise ValueError("this fake engine has no grammars")

    def build_in_background(self) -> str:
        return ""

    def poll_compiled(self) -> None:
        pass

    def close(self) -> None:
        pass

    def add_request(self, prompt: Any, params: Any, *, request_id: str, **_: Any) -> str:
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) > 50:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_model_len - 1 = 50")
        self.explode = self.explode or prompt == "boom"
        self.live[request_id] = [0, params.max_tokens]
        return request_id

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return self.live.pop(rid, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list[Any]:
        time.sleep(self.step_delay)
        if self.explode:
            self.explode = False
            raise RuntimeError("kaboom")
        outs = []
        for rid, st in list(self.live.items()):
            st[0] += 1
            done = st[0] >= st[1]
            outs.append(SimpleNamespace(request_id=rid, text="x", token_ids=[7], sources=["target"], finished=done,
                                        finish_reason="length" if done else None, error=None, refusal=None,
                                        metrics={"usage": {"completion_tokens": st[0]}} if done else None))
            if done:
                del self.live[rid]
        return outs

    def status(self) -> dict[str, Any]:
        return {"running": len(self.live), "waiting": 0}


def test_the_fake_keeps_the_engine_contract() -> None:
    """The daemon reads its engine only through `ServedEngine`; a fake missing a member fails here."""
    assert isinstance(FakeEngine(), ServedEngine)

    class Partial:  # an engine without the contract's members
        def step(self) -> list[Any]:
            return []

    assert not isinstance(Partial(), ServedEngine)


def fake_params(d: dict) -> Any:
    if set(d) - {"max_tokens", "temperature"}:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(set(d) - {'max_tokens', 'temperature'}))}")
    n = d.get("max_tokens", 4)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"max_tokens must be >= 1, got {n}")
    return SimpleNamespace(max_tokens=n, structured=None)


class Harness:
    """A `Server` over a fake engine in a thread, on a short ipc socket; `kw` go to `Server`
    (heartbeat_timeout, api_key, the flood guards)."""

    def __init__(self, engine: Any = None, **kw: Any) -> None:
        self.dir = tempfile.mkdtemp(prefix="dsv4t-", dir="/tmp")
        self.endpoint = f"ipc://{self.dir}/s.sock"
        self.lock = paths.PidLock(paths.pid_file(self.endpoint))
        assert self.lock.acquire()
        self.engine = engine or FakeEngine()
        self.server = Server(self.engine, self.endpoint, model_name="fake", **kw)
        self.server.bind()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def client(self) -> Client:
        c = Client(self.endpoint)
        c.connect()
        return c

    def close(self) -> None:
        self.server.request_stop("test over")
        self.thread.join(5)
        self.server.close()
        self.lock.release()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(FakeEngine(), heartbeat_timeout=0.6)
    yield h
    h.close()


def collect(c: Client, rid: str) -> tuple[str, dict[str, Any]]:
    text, final = "", {}
    for msg in c.stream(rid, deadline=time.monotonic() + 10):
        if msg["type"] == "delta":
            text += msg["text"]
        else:
            final = msg
    return text, final


def test_generate_streams_deltas_then_final(harness: Harness) -> None:
    with harness.client() as c:
        assert c.daemon["model"] == "fake" and c.daemon["state"] == "ready"
        assert c.daemon["max_message_bytes"] == P.MAX_MESSAGE_BYTES  # what the HTTP front end checks against
        text, final = collect(c, c.generate("hi", {"max_tokens": 5}))
        assert text == "xxxxx" and final["finish_reason"] == "length" and final["usage"] == {"completion_tokens": 5}
        st = c.status()
        assert st["in_flight"] == 0 and st["running"] == 0 and st["pid"] == os.getpid()


def test_bad_frames_get_error_replies_and_the_daemon_keeps_serving(harness: Harness) -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(harness.endpoint)
    try:
        sends = [[b"\x93garbage"], [msgpack.packb({"v": 42, "type": "ping", "id": "v"})],
                 [frame(type="dance", id="u")], [b"", frame(type="ping", id="p")],
                 [frame(type="generate", id="big", prompt="y" * 51)],
                 [frame(type="generate", id="prm", prompt="ok", params={"max_tokens": 0})],
                 [frame(type="generate", id="unk", prompt="ok", params={"nope": 1})],
                 [frame(type="generate", id="huge", prompt="z" * (P.MAX_MESSAGE_BYTES + 1))]]
        codes, ids = [], []
        for parts in sends:
            raw.send_multipart(parts)
            assert raw.poll(5000), f"no reply to {parts!r:.60}"
            reply = msgpack.unpackb(raw.recv())
            assert reply["type"] == "error" and reply["v"] == P.PROTOCOL_VERSION
            codes.append(reply["code"])
            ids.append(reply["id"])
        assert codes == [P.ERR_BAD_MESSAGE, P.ERR_BAD_VERSION, P.ERR_UNKNOWN_TYPE, P.ERR_BAD_MESSAGE,
                         P.ERR_BAD_REQUEST, P.ERR_INVALID_PARAMS, P.ERR_INVALID_PARAMS, P.ERR_TOO_LARGE]
        assert ids == [None, "v", "u", None, "big", "prm", "unk", "huge"]  # every error that can name its request
    finally:
        raw.close()
    with harness.client() as c:
        assert collect(c, c.generate("still fine", {"max_tokens": 3}))[0] == "xxx"


def test_duplicate_id_and_cancel(harness: Harness) -> None:
    with harness.client() as c:
        rid = c.generate("long", {"max_tokens": 100000})
        c.generate("again", {"max_tokens": 3}, request_id=rid)
        with pytest.raises(DaemonError) as e:
            for _ in c.stream(rid, deadline=time.monotonic() + 5):  # deltas of the first, then the error
                pass
        assert e.value.code == P.ERR_DUPLICATE_ID
        c.cancel(rid)
        finals = [m for m in c.stream(rid, deadline=time.monotonic() + 5) if m["type"] == "final"]
        assert finals[0]["finish_reason"] == "abort"
        assert c.status()["in_flight"] == 0 and not harness.engine.live


def wait_until(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_a_client_that_goes_away_has_its_request_cancelled(harness: Harness) -> None:
    c = harness.client()
    rid = c.generate("forever", {"max_tokens": 100000})
    assert c.recv(5)["type"] == "delta"  # generating
    c.close(linger_ms=0)
    assert wait_until(lambda: not harness.engine.live), "request of a closed client still running"
    with harness.client() as c2:
        assert c2.status()["in_flight"] == 0
    assert rid  # the aborted engine id is the server's own, not the client's


def test_a_silent_client_is_reaped() -> None:
    h = Harness(FakeEngine(step_delay=0.05), heartbeat_timeout=0.3)
    try:
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(h.endpoint)
        raw.send(frame(type="generate", id="g", prompt="p", params={"max_tokens": 100000}))
        assert wait_until(lambda: bool(h.engine.live))
        assert wait_until(lambda: not h.engine.live, timeout=5), "silent client was not reaped"  # never pings
        raw.close()
    finally:
        h.close()


def test_engine_failure_fails_requests_but_not_the_daemon(harness: Harness) -> None:
    with harness.client() as c:
        _, final = collect(c, c.generate("boom", {"max_tokens": 5}))
        assert final["finish_reason"] == "error" and "kaboom" in final["error"]
        assert collect(c, c.generate("fine", {"max_tokens": 2}))[0] == "xx"


def test_shutdown_cancels_in_flight_and_tells_clients(harness: Harness) -> None:
    with harness.client() as a, harness.client() as b:
        rid = a.generate("long", {"max_tokens": 100000})
        assert a.recv(5)["type"] == "delta"
        assert b.shutdown()["type"] == "ok"
        _, final = collect(a, rid)
        assert final["finish_reason"] == "abort" and "shutting down" in final["error"]
    harness.thread.join(5)
    assert not harness.thread.is_alive()


def test_no_daemon_is_reported_quickly(tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/none.sock"
    t = time.monotonic()
    with Client(ep) as c, pytest.raises(DaemonUnreachable, match="not running; start it with 'dsv4 serve --detach'"):
        c.connect()
    (tmp_path / "none.sock").touch()  # a stale socket file, nobody holding the lock
    with Client(ep) as c, pytest.raises(DaemonUnreachable, match="stale"):
        c.connect()
    assert time.monotonic() - t < 1.0


# ---------------------------------------------------------------------- --show-drafts rendering
def test_show_drafts_colours_draft_characters() -> None:
    from dsv4.cli.run import DRAFT_COLOUR, RESET, Output

    out = Output(as_json=False, show_drafts=False)
    # one step emitted two accepted drafts and a target token; the text of "é" completes one token late
    first = out._coloured("ab", ["a", "b"], ["target", "draft"])
    second = out._coloured("cdé", ["cd", "", "é"], ["draft", "draft", "target"])
    assert first == f"a{DRAFT_COLOUR}b{RESET}"
    assert second == f"{DRAFT_COLOUR}cd{RESET}é"
    assert out._coloured("zz", [], []) == "zz"  # text beyond the pieces: plain


def test_run_json_says_what_ran_compiled() -> None:
    from dsv4.cli.run import Output

    out = Output(as_json=True, show_drafts=False)
    buckets = {"main": [1, 2, 4], "mtp": [1, 2]}
    out.final = P.final("r", "length", None, {"compiled": True, "compiled_buckets": buckets})
    r = out.result()
    assert r["compiled"] is True and r["compiled_buckets"] == buckets  # at the top level of --json
    out.final = {k: v for k, v in out.final.items() if not k.startswith("compiled")}  # an older daemon's final
    r = out.result()
    assert r["compiled"] is None and r["compiled_buckets"] is None


def test_client_refuses_a_frame_the_daemon_would_drop(tmp_path):
    from dsv4.daemon.client import Client, DaemonError

    with Client(f"ipc://{tmp_path}/none.sock") as c:
        with pytest.raises(DaemonError, match="exceeds the limit"):
            c.send({"v": P.PROTOCOL_VERSION, "type": "generate", "id": "x", "prompt": "é" * (P.MAX_MESSAGE_BYTES // 2 + 1)})
