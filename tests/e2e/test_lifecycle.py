"""Daemon lifecycle with real processes: bad configs, no daemon, detach, stop, SIGKILL and restart, SIGTERM."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from dsv4.daemon.paths import daemon_pid
from tests.e2e.util import Daemon, dsv4, env_for, short_dir, spawn, status, wait_until

NOT_RUNNING = "dsv4 daemon is not running; start it with 'dsv4 serve --detach'"


@pytest.mark.parametrize("args,message", [
    (["--num-speculative-tokens", "5"], "--num-speculative-tokens 5 is out of range"),
    (["--no-enable-chunked-prefill", "--max-model-len", "1024"], "chunked prefill is disabled"),
    (["--max-num-batched-tokens", "1", "--num-speculative-tokens", "1"], "--max-num-batched-tokens 1"),
    (["--max-num-batched-tokens", "100000", "--max-model-len", "512"],
     "--max-num-batched-tokens 100000 is more than a step can use"),
    (["--device", "tpu"], "--device 'tpu' is not supported"),
    (["--quantization", "int4"], "--quantization 'int4' is not supported; use none, w8a8, mxfp4 or w8a8-mxfp4"),
])
def test_invalid_serve_config_exits_2_and_starts_nothing(tiny_model: Path, args: list[str], message: str) -> None:
    d = short_dir()
    try:
        t = time.monotonic()
        r = dsv4("serve", "--model", str(tiny_model), "--socket", f"ipc://{d}/d.sock", *args)
        assert r.returncode == 2, r.stderr
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stdout == "" and list(d.iterdir()) == []  # no socket, no pid file
        assert time.monotonic() - t < 20  # validated before loading anything
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_missing_model_dir_is_a_usage_error() -> None:
    r = dsv4("serve", "--model", "/nonexistent/model", "--socket", "ipc:///tmp/dsv4t-none/d.sock")
    assert r.returncode == 2 and "no such directory" in r.stderr


def test_socket_path_too_long_is_refused(tiny_model: Path) -> None:
    long = "ipc:///tmp/" + "x" * 120 + "/d.sock"
    for args in (["serve", "--model", str(tiny_model), "--socket", long], ["run", "--socket", long, "hi"]):
        r = dsv4(*args)
        assert r.returncode == 2 and "at most 107" in r.stderr and "bytes" in r.stderr, r.stderr


def test_run_without_daemon_exits_69_quickly() -> None:
    d = short_dir()
    try:
        t = time.monotonic()
        r = dsv4("run", "hello", endpoint=f"ipc://{d}/d.sock")
        assert r.returncode == 69 and r.stderr.strip() == NOT_RUNNING and r.stdout == ""
        for cmd in ("status", "stop"):
            assert dsv4(cmd, endpoint=f"ipc://{d}/d.sock").returncode == 69
        assert time.monotonic() - t < 10  # three process starts, no waiting on a dead socket
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_second_serve_reports_the_running_daemon(daemon: Daemon, tiny_model: Path) -> None:
    r = dsv4("serve", "--model", str(tiny_model), "--socket", daemon.endpoint)
    assert r.returncode == 0, r.stderr
    assert "already running" in r.stderr and str(daemon.proc.pid) in r.stderr
    assert daemon.proc.poll() is None and status(daemon.endpoint)["pid"] == daemon.proc.pid


def test_detach_stop_sigkill_restart_sigterm(tiny_model: Path) -> None:
    d = short_dir()
    ep = f"ipc://{d}/d.sock"
    sock, pidf = d / "d.sock", d / "d.sock.pid"
    state = d / "state"
    try:
        # --detach: returns once the daemon answers; logs under $XDG_STATE_HOME/dsv4/
        r = dsv4("serve", "--detach", "--model", str(tiny_model), "--socket", ep, timeout=120,
                 env=env_for(XDG_STATE_HOME=str(state)))
        assert r.returncode == 0, r.stderr
        m = re.search(r"pid (\d+), endpoint (\S+), log (\S+)", r.stdout)
        assert m and m.group(2).rstrip(",") == ep, r.stdout
        pid = int(m.group(1))
        assert (state / "dsv4" / "dsv4.log").is_file()
        assert dsv4("run", "--max-tokens", "3", "hi", endpoint=ep).returncode == 0
        assert sock.stat().st_mode & 0o777 == 0o600

        # stop: returns once the daemon is gone and its files are removed
        r = dsv4("stop", endpoint=ep)
        assert r.returncode == 0, r.stderr
        assert not sock.exists() and not pidf.exists() and daemon_pid(ep) is None
        assert wait_until(lambda: not _alive(pid), timeout=10)

        # SIGKILL leaves stale files; run says so at once; the next serve cleans them up
        first = Daemon(tiny_model, directory=d).wait_ready()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        assert sock.exists() and pidf.exists()
        t = time.monotonic()
        r = dsv4("run", "hi", endpoint=ep)
        assert r.returncode == 69 and "not running" in r.stderr and time.monotonic() - t < 5

        second = Daemon(tiny_model, directory=d).wait_ready()
        assert "removed stale socket" in second.log.read_text()
        assert dsv4("run", "--max-tokens", "3", "hi", endpoint=ep).returncode == 0

        # SIGTERM with a request in flight: its client is told, the daemon exits 0 and cleans up
        p = spawn("run", "--max-tokens", "900", "--ignore-eos", "--raw", "Words", endpoint=ep)
        assert p.stdout is not None and p.stdout.read(1)
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(20) == 0
        _, err = p.communicate(timeout=20)
        assert p.returncode == 1 and "shutting down" in err, err
        assert not sock.exists() and not pidf.exists()
    finally:
        for proc in [v.proc for v in locals().values() if isinstance(v, Daemon)]:
            if proc.poll() is None:
                proc.kill()
        pid = daemon_pid(ep)
        if pid and pid > 0:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_concurrent_detached_serves_start_one_daemon_and_both_exit_0(tiny_model: Path) -> None:
    """Two `serve --detach` at once on one socket (issue 21): one daemon starts, the other
    waits for it while it loads (no 'exit 1' for a daemon still starting) and reports it."""
    import subprocess

    from tests.e2e.util import CMD

    d = short_dir()
    ep = f"ipc://{d}/d.sock"
    env = env_for(XDG_STATE_HOME=str(d / "state"))
    try:
        procs = [subprocess.Popen([*CMD, "serve", "--detach", "--model", str(tiny_model), "--socket", ep],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for _ in range(2)]
        outs = [p.communicate(timeout=180) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        started = [o for o, _ in outs if o.startswith("dsv4 daemon started: pid ")]
        assert len(started) == 1, outs
        pid = int(re.search(r"pid (\d+)", started[0]).group(1))
        reports = [e for o, e in outs if not o]
        assert len(reports) == 1 and all(f"dsv4 daemon already running (pid {pid}" in e for e in reports), outs
        assert status(ep)["pid"] == pid
    finally:
        dsv4("stop", endpoint=ep)
        shutil.rmtree(d, ignore_errors=True)
