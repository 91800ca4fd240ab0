"""Process management for `dsv4 serve`: pid lock, stale files, loading, detaching, clean exit.

Foreground (`run_daemon`):
    take the pid lock next to the socket   -> if held: report the running daemon, exit 0
    remove a stale socket file             (the lock was free, so its daemon is dead)
    load the engine (progress bar on stderr when it is a terminal), log the banner
    bind, serve until SIGTERM / SIGINT / `dsv4 stop`
    cancel what is in flight, tell the clients, remove the socket and the pid file

Detached (`spawn_detached`): start the foreground daemon as a new session with its
output appended to the log file, wait until it answers a ping (or dies), report.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dsv4 import __version__
from dsv4.daemon.paths import PidLock, daemon_pid, log_file, pid_file, read_pid, remove_stale

log = logging.getLogger("dsv4.daemon")

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 130


def setup_logging() -> None:
    """Daemon logs: one line each on stderr (the log file when detached)."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s dsv4[%(process)d] %(levelname)s %(message)s", force=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def report_running(endpoint: str) -> str:
    """One line about the daemon that holds the lock of `endpoint`."""
    from dsv4.daemon.client import Client, DaemonUnreachable

    pid = read_pid(pid_file(endpoint))
    with Client(endpoint) as c:
        try:
            pong = c.connect(timeout_s=2.0)
            return f"dsv4 daemon already running (pid {pong.get('pid', pid)}, model {pong.get('model')}) on {endpoint}"
        except DaemonUnreachable:
            return f"dsv4 daemon already starting (pid {pid}) on {endpoint}"


class ProgressBar:
    """`bar(done, total)`: a transient rich progress bar on a terminal, nothing otherwise
    (weight loading, `dsv4 bench`)."""

    def __init__(self, label: str) -> None:
        self._bar = None
        self._task = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._bar = Progress(label, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=True)

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            return
        if self._task is None:
            self._bar.start()
            self._task = self._bar.add_task("load", total=total)
        self._bar.update(self._task, completed=done, total=total)

    def close(self) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.stop()


def load_engine(config: Any) -> Any:
    """Build the engine (loads the weights) with a progress bar on a terminal."""
    from dsv4.engine.engine import Engine

    progress = ProgressBar("loading weights")
    try:
        return Engine(config, progress=progress)
    finally:
        progress.close()


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_daemon(config: Any, endpoint: str) -> int:
    """Serve in the foreground until stopped; returns the exit status."""
    from dsv4.daemon.server import Server

    setup_logging()
    lock = PidLock(pid_file(endpoint))
    if not lock.acquire():
        print(report_running(endpoint), file=sys.stderr)
        return EXIT_OK
    server = None
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)  # a stop while loading exits cleanly
    try:
        for path in remove_stale(endpoint):
            log.info("removed stale socket %s left by a daemon that died", path)
        t0 = time.monotonic()
        engine = load_engine(config)
        model_name = Path(config.model).name
        log.info("dsv4 %s: model %s loaded in %.1f s", __version__, config.model, time.monotonic() - t0)
        for line in config.banner_lines():
            log.info("%s", line)
        log.info("request state: %s reserved for %d sequences", human_bytes(engine.status()["state_bytes"]),
                 config.max_num_seqs)
        if engine.policy is not None:
            log.info("auto K: decode step costs timed in %.1f s", engine.calibration_s)
        server = Server(engine, endpoint, model_name=model_name)
        try:
            server.bind()
        except Exception as e:  # noqa: BLE001  (zmq.ZMQError: address in use, permission denied)
            log.error("cannot bind %s: %s", endpoint, e)
            server = None
            return EXIT_ERROR
        server.install_signal_handlers()
        log.info("listening on %s (pid %d)", endpoint, os.getpid())
        try:
            reason = server.serve_forever()
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()  # flushes --profile traces
        return EXIT_INTERRUPTED if reason == "SIGINT" else EXIT_OK
    except KeyboardInterrupt as e:
        log.info("interrupted (%s) before serving", e.args[0] if e.args else "SIGINT")
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if server is not None:
            server.close()
        lock.release()
        log.info("stopped; socket and pid file removed")


def spawn_detached(argv: list[str], endpoint: str, *, timeout_s: float = 600.0) -> tuple[int, Path]:
    """Start `dsv4 serve ARGV` (foreground mode) in the background; wait until it answers.

    Returns (pid, log file). Raises RuntimeError with a one-line reason when it exits first.
    """
    from dsv4.daemon.client import Client, DaemonUnreachable

    logf = log_file()
    logf.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(logf, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli.main", "serve", *argv], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout_s
    while True:
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(f"the daemon exited with status {rc} while starting; see {logf}")
        if daemon_pid(endpoint) == proc.pid:
            with Client(endpoint) as c:
                try:
                    c.connect(timeout_s=0.5)
                    return proc.pid, logf
                except DaemonUnreachable:
                    pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon (pid {proc.pid}) did not answer within {timeout_s:g} s; see {logf}")
        time.sleep(0.1)
