"""`dsv4 serve --detach --http`: a port in use is reported in one line (the daemon's own
error, not "exited with status 1"), and a started daemon prints its OpenAI API URL."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

from dsv4.daemon.paths import daemon_pid
from tests.e2e.util import dsv4, env_for, free_port, short_dir

pytest.importorskip("uvicorn")



def test_detach_with_the_port_in_use_says_so_in_one_line(tiny_model: Path) -> None:
    d = short_dir()
    busy = socket.socket()
    try:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = dsv4("serve", "--detach", "--http", f"127.0.0.1:{port}", "--model", str(tiny_model),
                 "--socket", f"ipc://{d}/d.sock", timeout=120, env=env_for(XDG_STATE_HOME=str(d / "state")))
        assert r.returncode == 1, r.stderr
        warnings = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("dsv4: warning:")]
        assert len(warnings) == 1 and "HTTP" in warnings[0] and "without --api-key" in warnings[0], r.stderr
        lines = [ln for ln in r.stderr.strip().splitlines() if ln not in warnings]
        assert len(lines) == 1, r.stderr
        assert re.fullmatch(rf"dsv4: the daemon did not start: --http 127\.0\.0\.1:{port}: cannot listen there: "
                            rf"Address already in use \(log: \S+dsv4\.log\)", lines[0]), lines[0]
        assert r.stdout == "" and daemon_pid(f"ipc://{d}/d.sock") is None
    finally:
        busy.close()
        shutil.rmtree(d, ignore_errors=True)


def test_detach_prints_the_http_url(tiny_model: Path) -> None:
    d = short_dir()
    ep = f"ipc://{d}/d.sock"
    port = free_port()
    try:
        r = dsv4("serve", "--detach", "--http", f"127.0.0.1:{port}", "--model", str(tiny_model), "--socket", ep,
                 timeout=120, env=env_for(XDG_STATE_HOME=str(d / "state")))
        assert r.returncode == 0, r.stderr
        m = re.search(r"OpenAI API at (http://\S+/v1),", r.stdout)
        assert m and m.group(1) == f"http://127.0.0.1:{port}/v1", r.stdout
        with urllib.request.urlopen(f"{m.group(1)}/models", timeout=30) as resp:
            assert json.load(resp)["data"][0]["id"] == tiny_model.name
        assert dsv4("stop", endpoint=ep).returncode == 0
    finally:
        pid = daemon_pid(ep)
        if pid and pid > 0:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)
