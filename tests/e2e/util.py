"""Helpers for the end-to-end tests: real `dsv4` processes on short temporary ipc sockets.

Socket paths live in /tmp/dsv4t-XXXXXX/ (well under the 107-byte Unix socket limit,
whatever pytest's own tmp_path looks like). Every process gets OMP_NUM_THREADS=1: on a
small, busy CPU several torch threads per process make the tiny model a hundred
times slower.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

BIN = Path(sys.executable).parent / "dsv4"
CMD = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "dsv4.cli.main"]


def free_port() -> int:
    """A loopback TCP port free at this moment (bound, read and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="dsv4t-", dir="/tmp"))


def env_for(endpoint: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DSV4_DEBUG", "DSV4_SOCKET")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="200")
    # eager unless a test says otherwise: a developer's compile cache must not change what a
    # test computes, and a daemon's background build would take a core for minutes
    env["DSV4_COMPILE"] = "off"
    if endpoint is not None:
        env["DSV4_SOCKET"] = endpoint
    env.update(extra)
    return env


def dsv4(*args: str, endpoint: str | None = None, input: str | None = None, timeout: float = 60,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `dsv4 ARGS` to completion (stdin from `input`, else /dev/null)."""
    return subprocess.run([*CMD, *args], input=input, stdin=None if input is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, env=env or env_for(endpoint))


def as_from_a_terminal() -> None:
    """In a child: SIGINT back to its default, as a shell at a terminal starts a command. A
    suite run in the background (test.sh's runs, `pytest &`) has SIGINT ignored, which
    children inherit, and Python keeps an ignored SIGINT ignored: Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args: str, endpoint: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([*CMD, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or env_for(endpoint),
                            preexec_fn=as_from_a_terminal)


def run_json(*args: str, endpoint: str) -> dict[str, Any]:
    r = dsv4("run", "--json", *args, endpoint=endpoint)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def status(endpoint: str) -> dict[str, Any]:
    r = dsv4("status", "--json", endpoint=endpoint)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def status_now(endpoint: str, api_key: str | None = None) -> dict[str, Any]:
    """What `status(endpoint)` gives, asked from this process (the CLI's own client calls),
    for polling: a `dsv4 status` process costs about 0.4 CPU-s, so a test that polled one
    every 0.1 s kept a core busy while it waited. The key: `api_key`, else DSV4_API_KEY."""
    from dsv4.daemon.client import Client

    with Client(endpoint, api_key=api_key or os.environ.get("DSV4_API_KEY")) as c:
        c.connect()
        return json.loads(json.dumps(c.status()))


def answers(endpoint: str, api_key: str | None = None) -> bool:
    """Whether a daemon answers `status` on `endpoint` now (`status_now`)."""
    from dsv4.daemon.client import DaemonError, DaemonTimeout, DaemonUnreachable

    try:
        status_now(endpoint, api_key)
        return True
    except (DaemonUnreachable, DaemonTimeout, DaemonError):
        return False


def reap(proc: subprocess.Popen) -> None:
    """Kill `proc` if it still runs, and wait for it (a test's cleanup)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def wait_until(cond: Any, timeout: float = 10.0, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return bool(cond())


class Daemon:
    """`dsv4 serve` in the foreground as a subprocess, with its log captured to a file."""

    def __init__(self, model: Path, *args: str, directory: Path | None = None,
                 env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> None:
        self.dir = directory or short_dir()
        self.socket = self.dir / "d.sock"
        self.endpoint = f"ipc://{self.socket}"
        self.pid_file = Path(f"{self.socket}.pid")
        self.log = self.dir / "serve.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([*prefix, *CMD, "serve", "--model", str(model), "--socket", self.endpoint, *args],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env or env_for())

    def wait_ready(self, timeout: float = 90) -> "Daemon":
        from dsv4.daemon.client import Client, DaemonUnreachable

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsv4 serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self.socket.exists():
                with Client(self.endpoint) as c:
                    try:
                        c.connect(timeout_s=1.0)
                        return self
                    except DaemonUnreachable:
                        pass
            time.sleep(0.1)
        raise TimeoutError(f"dsv4 serve not ready after {timeout} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def openai_server(model: Path, *args: str, key: str, **env: str) -> Iterator[tuple[Any, Daemon]]:
    """`dsv4 serve --http` of `model` with `args`, API key `key` and `env` added to its
    environment, and an `openai` client of it once its model list answers (DSV4_API_KEY is
    `key` meanwhile, for the CLI's clients)."""
    import openai

    port = free_port()
    old = os.environ.get("DSV4_API_KEY")
    os.environ["DSV4_API_KEY"] = key
    d = Daemon(model, "--http", f"127.0.0.1:{port}", "--api-key", key, *args, env=env_for(**env))
    try:
        d.wait_ready()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)

        def alive() -> bool:
            try:
                return bool(c.models.list().data)
            except openai.APIError:
                return False

        assert wait_until(alive, timeout=30), d.log.read_text()
        yield c, d
    finally:
        d.cleanup()
        if old is None:
            os.environ.pop("DSV4_API_KEY", None)
        else:
            os.environ["DSV4_API_KEY"] = old
