"""Process management for `dsv4 serve`: pid lock, stale files, loading, detaching, clean exit.

Foreground (`run_daemon`):
    take the pid lock next to the socket   -> if held: report the running daemon, exit 0
    remove a stale socket file             (the lock was free, so its daemon is dead)
    load the engine (progress bar on stderr when it is a terminal), log the banner
    bind, serve until SIGTERM / SIGINT / `dsv4 stop`
    cancel what is in flight, tell the clients, remove the socket and the pid file

Detached (`spawn_detached`): the foreground daemon as a new session, output appended to the
log file, waited for until it answers a ping (or dies: reported by the last error it logged,
in one line). The child runs in safe-path mode (`-P`) from `/`, so no `./dsv4/` package is
imported; its key travels in the environment. Details: docs/daemon.md, 'dsv4/daemon/process.py'.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Collection

from dsv4 import __version__
from dsv4.daemon.contract import FrontEnd, FrontEndError
from dsv4.daemon.paths import PidLock, daemon_pid, log_file, open_log, pid_file, read_pid, remove_stale

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


STARTING_WAIT_S = 600.0  # how long a second `serve` waits for a daemon still loading to answer


def report_running(endpoint: str, settings: dict[str, Any] | None = None,
                   api_key: str | None = None, wait_s: float = STARTING_WAIT_S) -> tuple[bool, str]:
    """(same settings, one line) about the daemon that holds the lock of `endpoint`.

    A daemon still starting (loading the model) is waited for, up to `wait_s`, so that
    concurrent `serve`s on one endpoint all report the one that won (exit 0) instead of
    failing; one that exits before answering is reported as such. With `settings`
    (`EngineConfig.settings()` of the daemon asked for), the running daemon's own
    settings are compared and the differences named."""
    from dsv4.daemon.client import Client, DaemonError, DaemonUnreachable

    pid = read_pid(pid_file(endpoint))
    deadline, told = time.monotonic() + wait_s, False
    while True:
        with Client(endpoint, api_key=api_key) as c:
            try:
                pong = c.connect(timeout_s=2.0)
                break
            except DaemonError:
                return settings is None, f"dsv4 daemon already starting (pid {pid}) on {endpoint}"
            except DaemonUnreachable:
                pass
        if daemon_pid(endpoint) is None:
            return False, (f"the dsv4 daemon (pid {pid}) that was starting on {endpoint} exited before answering; "
                           f"see its log, or start it again")
        if time.monotonic() >= deadline:
            return settings is None, (f"dsv4 daemon already starting (pid {pid}) on {endpoint}; it did not answer "
                                      f"within {wait_s:g} s")
        if not told:
            print(f"dsv4 daemon already starting (pid {pid}) on {endpoint}: waiting for it to answer", file=sys.stderr)
            told = True
        time.sleep(0.2)
    line = f"dsv4 daemon already running (pid {pong.get('pid', pid)}, model {pong.get('model')}) on {endpoint}"
    running = pong.get("settings")
    if settings is None or not isinstance(running, dict):
        return True, line
    diff = [f"{flag} {settings[k]} (running: {running.get(k)})" for k, flag in SETTING_FLAGS.items()
            if k in settings and settings[k] != running.get(k)]
    if not diff:
        return True, line
    return False, (f"a dsv4 daemon (pid {pong.get('pid', pid)}) already runs on {endpoint} with other settings: "
                   f"{', '.join(diff)}; stop it first with 'dsv4 stop'")


# EngineConfig field -> the flag that sets it (the settings a running daemon is compared on)
SETTING_FLAGS = {
    "model": "--model", "device": "--device", "dtype": "--dtype", "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len", "max_num_batched_tokens": "--max-num-batched-tokens",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "enable_chunked_prefill": "--enable-chunked-prefill", "num_speculative_tokens": "--num-speculative-tokens",
    "seed": "--seed", "quantization": "--quantization", "tensor_parallel_size": "--tensor-parallel-size",
    "data_parallel_size": "--data-parallel-size", "compile": "--compile", "kv_cache_memory": "--kv-cache-memory",
    "enable_prefix_caching": "--enable-prefix-caching", "draft_vocab": "--draft-vocab",
}


def engine_settings(config: Any, given: Collection[str] | None = None) -> dict[str, Any]:
    """The resolved values of the settings `serve` compares with a running daemon's: all of
    them, or only those in `given` (the flags the user gave, and the model) -- a `serve`
    that leaves a setting at its default asks for nothing in particular there."""
    return {k: getattr(config, k) for k in SETTING_FLAGS if given is None or k in given}


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft descriptor limit to the hard one (more connections before refusing); (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft, hard


class ProgressBar:
    """`bar(done, total)`: a transient rich progress bar on a terminal, nothing otherwise
    (weight loading, `dsv4 bench`). With several labels, one bar per stage: a stage's bar
    goes once done == total, and the next call starts the next label's (loading the
    weights, then --compile's capture), so no finished bar lingers while later work runs."""

    def __init__(self, label: str, *later: str) -> None:
        self._labels = [label, *later]
        self._bar: Any = None
        self._task: Any = None
        self._started = False
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._bar = Progress("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=True)

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            return
        if self._task is None:
            if total and done >= total:  # a repeated final report of a stage that is over
                return
            if not self._started:
                self._bar.start()
                self._started = True
            label = self._labels.pop(0) if len(self._labels) > 1 else self._labels[0]
            self._task = self._bar.add_task(label, total=total)
        self._bar.update(self._task, completed=done, total=total)
        if total and done >= total:  # this stage is over: its bar goes
            self._bar.remove_task(self._task)
            self._task = None

    @property
    def labels(self) -> list[str]:
        """The labels of the bars shown now."""
        return [t.description for t in self._bar.tasks] if self._bar is not None else []

    def close(self) -> None:
        if self._bar is not None and self._started:
            self._bar.stop()
            self._started = False


def load_engine(config: Any, api_key: str | None = None) -> Any:
    """Build the engine (loads the weights) with a progress bar on a terminal; `api_key`:
    the secret replicas of other hosts prove when they join (--data-parallel-address)."""
    from dsv4.engine.engine import Engine

    if config.data_parallel_size > 1:  # the replicas load in their own processes, side by side
        from dsv4.engine.replicas.pool import EnginePool

        log.info("starting %d engine replicas (--data-parallel-size), %d thread(s) each", config.data_parallel_size,
                 config.threads)
        return EnginePool(config, key=api_key)
    progress = ProgressBar("loading weights", "capturing decode buckets (--compile)")
    try:
        return Engine(config, progress=progress)
    finally:
        progress.close()


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def exit_now(code: int) -> None:
    """Exit with `code` once logs and output are flushed, without C++ static destructors: a
    library thread (gloo's, or one an engine left) still joinable at interpreter exit aborts
    them ("terminate called without an active exception", exit -6; seen in fresh-clone suite
    runs of the two-host, torchrun and replica-host tests). For processes whose work is done:
    a node's ranks, a joining replica, a torchrun follower."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_daemon(config: Any, endpoint: str, http: FrontEnd | None = None, api_key: str | None = None,
               given: Collection[str] | None = None) -> int:
    """Serve in the foreground until stopped; returns the exit status. `http`: an unbound
    front end (`dsv4.http.server.HttpServer` for --http), or None; `given`: the engine
    settings given on the command line (compared with a daemon already running; None = all)."""
    from dsv4.daemon.intake import connection_limit
    from dsv4.daemon.server import RANK_FAILURE, Server

    setup_logging()
    if getattr(config, "data_parallel_rank", 0) > 0:  # a replica of another host's daemon: binds nothing
        from dsv4.engine.replicas.remote import join

        exit_now(join(config, api_key or ""))  # logs once it is welcomed: a refusal is its one line
    if getattr(config, "node_rank", 0) > 0:  # another host's ranks: no socket, until rank 0 stops
        from dsv4.engine.parallel.ranks import serve_node

        log.info("node %d of %d: joining rank 0 at %s:%s", config.node_rank, config.nnodes, config.master_addr,
                 config.master_port)
        exit_now(serve_node(config))  # the group is left and its ranks are gone: nothing else to tear down
    os.umask(0o077)  # the socket file is private from the moment it is bound
    lock = PidLock(pid_file(endpoint))
    if not lock.acquire():
        same, line = report_running(endpoint, engine_settings(config, given), api_key)
        print(line, file=sys.stderr)
        return EXIT_OK if same else EXIT_ERROR
    if http is not None:
        try:
            http.bind()  # a port in use fails now, before the weights load
        except FrontEndError as e:
            log.error("%s", e)
            lock.release()
            return EXIT_ERROR
    server = engine = None
    ctx = None  # with --http: the ZeroMQ context the ROUTER and the HTTP front end share (inproc)
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)  # a stop while loading exits cleanly
    try:
        for path in remove_stale(endpoint):
            log.info("removed stale socket %s left by a daemon that died", path)
        soft, hard = raise_fd_limit()  # before HTTP takes its share of descriptors
        # the connection guard and the step watch are threads that must act within a few ms of
        # waking (libzmq accepts a flood meanwhile) while the HTTP thread runs Python: a thread
        # waiting for the GIL gets it after 1 ms instead of the default 5 (the engine's work is
        # torch's, which releases the GIL, so the extra switches cost nothing measurable)
        sys.setswitchinterval(0.001)
        if http is not None:  # answers /health with 503 (and requests with 503) while the model loads
            import zmq

            ctx = zmq.Context()
            http.start(ctx, config)
        t0 = time.monotonic()
        engine = load_engine(config, api_key)
        model_name = config.served_model_name
        log.info("dsv4 %s: model %s loaded in %.1f s", __version__, config.model, time.monotonic() - t0)
        for line in config.banner_lines():
            log.info("%s", line)
        log.info("weights: %s resident (%s)", human_bytes(engine.weight_bytes), config.quantization)
        if engine.quant_note:
            log.info("%s", engine.quant_note)
        if len(engine.rank_weight_bytes) > 1:
            log.info("weights per rank: %s", ", ".join(f"rank {r} {human_bytes(b)}"
                                                        for r, b in enumerate(engine.rank_weight_bytes)))
        log.info("request state: %s reserved for %d sequences", human_bytes(engine.status()["state_bytes"]),
                 config.max_num_seqs)
        if engine.compile_note:
            log.info("%s", engine.compile_note)
        building = engine.build_in_background()
        if building:
            log.info("%s", building)
        if engine.calibration_note:
            log.info("%s", engine.calibration_note)
        also = (http.endpoint,) if http is not None else ()
        server = Server(engine, endpoint, model_name=model_name, also_bind=also, context=ctx, api_key=api_key,
                        settings=engine_settings(config),
                        max_connections=connection_limit(reserved=http.descriptors_reserved() if http else 0))
        try:
            server.bind()
        except Exception as e:  # noqa: BLE001  (zmq.ZMQError: address in use, permission denied)
            log.error("cannot bind %s: %s", endpoint, e)
            server = None
            return EXIT_ERROR
        server.install_signal_handlers()
        log.info("listening on %s (pid %d); descriptor limit %d (hard %d), at most %d connections", endpoint,
                 os.getpid(), soft, hard, server.max_connections)
        reason = server.serve_forever()
        if reason == RANK_FAILURE:
            return EXIT_ERROR
        return EXIT_INTERRUPTED if reason == "SIGINT" else EXIT_OK
    except KeyboardInterrupt as e:
        log.info("interrupted (%s) before serving", e.args[0] if e.args else "SIGINT")
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if http is not None:
            http.stop()  # before the shared context ends: the HTTP front end's socket lives there
        if server is not None:
            server.close()  # terminates ctx too
        elif ctx is not None:
            ctx.term()
        if engine is not None:  # on every path once loaded (a failed bind too): its ranks and replicas stop
            engine.close()  # flushes --profile traces
        lock.release()
        log.info("stopped; socket and pid file removed")


def spawn_detached(argv: list[str], endpoint: str, *, timeout_s: float = 600.0,
                   api_key: str | None = None) -> tuple[int, Path]:
    """Start `dsv4 serve ARGV` (foreground mode) in the background; wait until it answers.

    ARGV must hold absolute paths (the child runs in `/`). Returns (pid, log file).
    Raises RuntimeError with a one-line reason when it exits first.
    """
    from dsv4.daemon.client import Client, DaemonUnreachable

    logf = log_file()
    fd = open_log(logf)  # its directory checked; a FIFO or symlink there refused, never waited on
    start = os.fstat(fd).st_size  # where this daemon's lines begin
    env = dict(os.environ)
    if api_key:
        env["DSV4_API_KEY"] = api_key
    with os.fdopen(fd, "ab") as out:
        safe = "-P" if sys.version_info >= (3, 11) else "-I"  # 3.10 has no -P: isolated mode instead
        proc = subprocess.Popen([sys.executable, safe, "-m", "dsv4.cli.main", "serve", *argv],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                close_fds=True, cwd="/", env=env)
    deadline = time.monotonic() + timeout_s
    while True:
        rc = proc.poll()
        if rc == EXIT_OK:  # it found a daemon that won the race with the same settings: report that one
            raise AlreadyRunning(startup_report(logf, start) or f"dsv4 daemon already running on {endpoint}")
        if rc is not None:
            why = startup_error(logf, start)
            raise RuntimeError(f"the daemon did not start: {why} (log: {logf})" if why else
                               f"the daemon exited with status {rc} while starting; see {logf}")
        if daemon_pid(endpoint) == proc.pid:
            with Client(endpoint, api_key=api_key) as c:
                try:
                    c.connect(timeout_s=0.5)
                    return proc.pid, logf
                except DaemonUnreachable:
                    pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon (pid {proc.pid}) did not answer within {timeout_s:g} s; see {logf}")
        time.sleep(0.1)


class AlreadyRunning(RuntimeError):
    """`serve --detach` found, through its child, a daemon already running with the same settings (exit 0)."""


def _log_lines(logf: Path, start: int) -> list[str] | None:
    """The lines of the log from byte `start` on (at most 1 MiB of them); None if unreadable."""
    try:
        with open(logf, "rb") as f:
            f.seek(start)
            return f.read(1 << 20).decode("utf-8", "replace").splitlines()
    except OSError:
        return None


def startup_report(logf: Path, start: int) -> str | None:
    """The last 'dsv4 daemon already running ...' line in the log from byte `start` on."""
    lines = _log_lines(logf, start)
    if lines is None:
        return None
    return next((line for line in reversed(lines) if line.startswith("dsv4 daemon already running")), None)


def startup_error(logf: Path, start: int) -> str | None:
    """The last error a daemon wrote to its log from byte `start` on: a logged ERROR
    record's message, or the CLI's own one-line 'dsv4: ...' message; None if there is none."""
    lines = _log_lines(logf, start)
    if lines is None:
        return None
    for line in reversed(lines):
        _, sep, message = line.partition(" ERROR ")
        if sep and message.strip():
            return message.strip()
        if line.startswith("dsv4: "):
            return line[len("dsv4: "):].strip()
    return None
