"""The HTTP surface against hostile peers and careless clients (issue 21: items 1, 5 and 6), on one
real keyless `dsv4 serve --http` under `ulimit -n 256`: connection floods and slowloris beside
a ZeroMQ flood, DNS rebinding and cross-site requests, bodies no later stage could take."""

from __future__ import annotations

import http.client
import json
import os
import resource
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import zmq

from tests.e2e.util import CMD, dsv4, env_for, free_port, short_dir, wait_until

NOFILE = 256
ALLOWED_ORIGIN = "http://app.example:3000"


class Served:
    def __init__(self, proc: subprocess.Popen, endpoint: str, port: int, log: Path) -> None:
        self.proc, self.endpoint, self.port, self.log = proc, endpoint, port, log

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))



def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[Served]:
    d = short_dir()
    ep, port, log = f"ipc://{d}/d.sock", free_port(), d / "serve.log"
    env = env_for(DSV4_TEST_HTTP_HEADER_TIMEOUT_S="1")
    env.pop("DSV4_API_KEY", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([*CMD, "serve", "--model", str(tiny_model), "--socket", ep, "--http",
                                 f"127.0.0.1:{port}", "--allowed-hosts", "api.example",
                                 "--allowed-origins", ALLOWED_ORIGIN], env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, preexec_fn=_low_nofile)
    s = Served(proc, ep, port, log)
    try:
        assert wait_until(lambda: _request(port, "GET", "/health")[0] == 200, timeout=90), log.read_text()
        yield s
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(d, ignore_errors=True)


def _request(port: int, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None) -> tuple[int, dict, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    except OSError:
        return 0, {}, ""
    finally:
        c.close()


def _post(port: int, body: bytes, path: str = "/v1/completions", **headers: str) -> tuple[int, dict, str]:
    return _request(port, "POST", path, body, {"Content-Type": "application/json", **headers})


def _error(text: str) -> dict:
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


COMPLETION = json.dumps({"prompt": "To be", "max_tokens": 2}).encode()


# ---------------------------------------------------------------------- 5: rebinding, cross-site requests
def test_keyless_http_warns_in_one_line(served: Served) -> None:
    lines = [ln for ln in served.log.read_text().splitlines() if "without --api-key" in ln]
    assert len(lines) == 1 and "HTTP" in lines[0] and "warning" in lines[0], lines


def test_host_must_name_this_server(served: Served) -> None:
    status, _, text = _request(served.port, "GET", "/v1/models", headers={"Host": "evil.example:8000"})
    assert status == 400 and "--allowed-hosts" in _error(text)["message"]
    assert _post(served.port, COMPLETION, Host="evil.example")[0] == 400
    for host in (f"localhost:{served.port}", f"127.0.0.1:{served.port}", "[::1]", "api.example"):
        assert _request(served.port, "GET", "/v1/models", headers={"Host": host})[0] == 200, host


def test_cross_origin_requests_are_refused_unless_allowed(served: Served) -> None:
    # the attack of the issue: a text/plain "simple" POST from a page at evil.example
    status, _, text = _request(served.port, "POST", "/v1/completions", COMPLETION,
                               {"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert status == 403 and _error(text)["type"] == "permission_error"
    status, _, _ = _post(served.port, COMPLETION, Origin="http://evil.example")
    assert status == 403
    pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    status, headers, _ = _request(served.port, "OPTIONS", "/v1/completions", headers=pre)
    assert status == 403 and "access-control-allow-origin" not in headers
    # an allowed origin: preflight answered, CORS headers on the answer
    asked = {**pre, "Origin": ALLOWED_ORIGIN, "Access-Control-Request-Headers": "content-type, X-Stainless-OS"}
    status, headers, _ = _request(served.port, "OPTIONS", "/v1/completions", headers=asked)
    assert status == 204 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert {"content-type", "x-stainless-os", "authorization"} <= set(headers["access-control-allow-headers"].split(", "))
    # a refused body from an allowed origin: the page can read why
    status, headers, _ = _request(served.port, "POST", "/v1/completions", COMPLETION,
                                  {"Content-Type": "text/plain", "Origin": ALLOWED_ORIGIN})
    assert status == 415 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    status, headers, text = _post(served.port, COMPLETION, Origin=ALLOWED_ORIGIN)
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN, text
    # the server's own origin is not cross-origin
    assert _post(served.port, COMPLETION, Origin=f"http://127.0.0.1:{served.port}")[0] == 200


def test_post_bodies_must_be_json(served: Served) -> None:
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": ctype} if ctype else {}
        status, _, text = _request(served.port, "POST", "/v1/completions", COMPLETION, headers)
        assert status == 415 and "application/json" in _error(text)["message"], (ctype, status)
    assert _post(served.port, COMPLETION, **{"Content-Type": "application/json; charset=utf-8"})[0] == 200


# ---------------------------------------------------------------------- 6: bodies no later stage could take
@pytest.mark.parametrize("body, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "deeper than"),
    (b'{"prompt": "x", "user": ' + b"[" * 200 + b"]" * 200 + b"}", "deeper than"),
    (b'{"prompt": [18446744073709551616]}', "out of range"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "out of range"),
    (b'{"prompt": "x", "seed": -9223372036854775809}', "out of range"),
    (b'{"prompt": "x\\ud800y"}', "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "lone surrogate"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "top_p": Infinity}', "Infinity"),
    (b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": "no"}}', "true or false"),
])
def test_bodies_no_stage_could_take_are_400_in_one_log_line(served: Served, body: bytes, needle: str) -> None:
    before = served.log.read_text()
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, _, text = _post(served.port, body, path)
    assert status == 400 and needle in _error(text)["message"], (status, text)
    new = served.log.read_text()[len(before):]
    assert "Traceback" not in new and len(new.splitlines()) <= 1, new


def test_a_trailing_slash_is_404_not_a_redirect_to_the_host_sent(served: Served) -> None:
    status, headers, text = _request(served.port, "GET", "/v1/models/", headers={"Host": "localhost"})
    assert status == 404 and "location" not in headers and _error(text)["type"] == "not_found_error"


# ---------------------------------------------------------------------- 1: descriptors
def test_connection_floods_and_slowloris_cannot_take_the_descriptors(served: Served) -> None:
    """More idle connections than the descriptor limit, slowloris ones, and a ZeroMQ flood at
    once: extra HTTP connections get 503 and are closed, slow heads are closed, and the daemon
    answers `dsv4 status` and generates throughout."""
    held: list[socket.socket] = []
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4096)
    dealers: list[zmq.Socket] = []
    try:
        for _ in range(64):  # slowloris: a head that never ends
            s = socket.create_connection(("127.0.0.1", served.port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-a: ")
            held.append(s)
        peak = served.fds()
        for _ in range(NOFILE + 64):  # idle: connect and send nothing
            held.append(socket.create_connection(("127.0.0.1", served.port), timeout=10))
        peak = max(peak, served.fds())
        for _ in range(600):
            z = ctx.socket(zmq.DEALER)
            z.setsockopt(zmq.LINGER, 0)
            z.connect(served.endpoint)
            dealers.append(z)
        peak = max(peak, served.fds())
        assert wait_until(lambda: "refusing connections" in served.log.read_text(), timeout=30), \
            f"exit status {served.proc.poll()}\n{served.log.read_text()}"
        for z in dealers:
            z.close(0)
        assert served.proc.poll() is None, served.log.read_text()
        assert peak < NOFILE
        # every held connection ends: refused at once (503) or closed once its head is late
        refused = closed = 0
        for s in held:
            try:
                data = s.recv(4096)
            except OSError:  # reset: closed with our unread head in its buffer
                data = b""
            refused += data.startswith(b"HTTP/1.1 503")
            closed += data == b""
        assert refused + closed == len(held) and refused > 0 and closed > 0
        r = dsv4("status", "--json", endpoint=served.endpoint, timeout=60)
        assert r.returncode == 0, r.stderr + served.log.read_text()
        print(f"\nflood at ulimit -n {NOFILE}: {len(held)} HTTP connections ({refused} refused with 503, "
              f"{closed} closed by timeouts), {len(dealers)} ZeroMQ connections; the daemon held "
              f"{peak} descriptors at most when looked at; status answered")
    finally:
        for s in held:
            s.close()
        for z in dealers:
            z.close(0)
        ctx.term()
    assert wait_until(lambda: _post(served.port, COMPLETION)[0] == 200, timeout=30), served.log.read_text()
    assert served.proc.poll() is None and "Too many open files" not in served.log.read_text()
