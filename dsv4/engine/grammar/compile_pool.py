"""Structured-output grammars compiled off the engine loop, in worker processes, within a budget.

    pool = CompilePool(tokenizer_info, budget_s=10.0)
    fut = pool.submit(spec)    # any thread: a concurrent.futures.Future of a `Compiled` grammar
    fut.cancel()               # the client went away: the compile is dropped (its worker killed)

One dispatcher thread owns the cache, the jobs and the lanes; `submit` and a cancel only put
an event on its inbox, so no caller waits on a compile. Each worker is a process
(`grammar_worker`), killed when over the budget. Two lanes: small, light specs never wait
behind a schema that compiles for seconds in the large lane (`large_workers` processes).
Each lane holds at most MAX_QUEUED jobs (then `RequestBusy`); identical specs in flight
share one job; compiled grammars are cached (LRU of CACHE_SIZE).
Details: docs/serving.md, 'dsv4/engine/grammar/compile_pool.py'.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from dsv4.engine.errors import RequestBusy, RequestError

log = logging.getLogger("dsv4.engine")

SMALL_SPEC_BYTES = 4 << 10
SMALL_SLICE_S = 1.0
MAX_QUEUED = 64
CACHE_SIZE = 32
START_TIMEOUT_S = 120.0  # a worker's start (llguidance's tokenizer of 129k ids) on a loaded machine


@dataclass(frozen=True)
class Compiled:
    """A grammar that built within the budget: llguidance's grammar text and a matcher of it
    in its initial state, built on a pool thread; each request's matcher is a copy of it."""

    grammar: str
    matcher: Any


def default_workers() -> int:
    """Large-lane workers: half the usable cores (one on a 2-core machine), 1..4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // 2))


@dataclass
class _Job:
    key: str
    spec: dict[str, Any]
    waiters: list[Future] = field(default_factory=list)
    lane: str = "small"
    worker: "_Worker | None" = None

    @property
    def what(self) -> str:
        return f"structured {next(iter(self.spec))}"


class CompilePool:
    """Grammar compiles in worker processes (module docstring). `tokenizer_info` is a function
    returning (the workers' vocabulary message, a Future of llguidance's tokenizer), called
    once, on the dispatcher thread."""

    def __init__(self, tokenizer_info: Any, *, budget_s: float = 10.0, large_workers: int | None = None) -> None:
        self.budget_s = budget_s
        self._info_fn = tokenizer_info
        self._info: Any = None  # (vocabulary message, Future of the LLTokenizer) once built
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._jobs: dict[str, _Job] = {}
        self._queued = {"small": deque(), "large": deque()}
        self._workers = {"small": [_Worker(self, "small")],
                         "large": [_Worker(self, "large") for _ in range(large_workers or default_workers())]}
        self.stats = {"compiled": 0, "cached": 0, "timeouts": 0, "refused": 0, "moved": 0, "dropped": 0}
        self._closed = False
        self._thread = threading.Thread(target=self._dispatch, name="dsv4-grammar", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def submit(self, spec: dict[str, Any]) -> Future:
        """A Future of the compiled grammar of a checked spec; it fails with `RequestError`
        (one line) for a grammar that does not compile, is over budget, or `RequestBusy`."""
        fut: Future = Future()
        self._inbox.put(("submit", spec, fut))
        return fut

    def compile(self, spec: dict[str, Any]) -> Any:
        """`submit(spec).result()`: blocking, for callers without a loop (the offline LLM)."""
        return self.submit(spec).result()

    def status(self) -> dict[str, Any]:
        return {**self.stats, "queued": sum(len(q) for q in self._queued.values()), "budget_s": self.budget_s,
                "workers": sum(w.alive for ws in self._workers.values() for w in ws)}

    def close(self) -> None:
        self._closed = True
        self._inbox.put(("close",))
        for ws in self._workers.values():
            for w in ws:
                w.stop()

    # ------------------------------------------------------------------ the dispatcher thread
    def _dispatch(self) -> None:
        while True:
            ev = self._inbox.get()
            try:
                if ev[0] == "close":
                    for job in list(self._jobs.values()):
                        self._finish(job, RequestError("the engine is shutting down"))
                    return
                getattr(self, "_on_" + ev[0])(*ev[1:])
                self._schedule()
            except Exception:  # noqa: BLE001  (a bug here must not stop every later compile)
                log.exception("grammar dispatcher: %s failed", ev[0])

    def _on_submit(self, spec: dict[str, Any], fut: Future) -> None:
        if self._closed:
            fut.set_exception(RequestError("the engine is shutting down"))
            return
        key = json.dumps(spec, sort_keys=True, ensure_ascii=False)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.stats["cached"] += 1
            _resolve(fut, hit)
            return
        job = self._jobs.get(key)
        if job is None:
            if self._info is None and not self._build_info(fut):
                return
            lane = "small" if len(key.encode()) <= SMALL_SPEC_BYTES else "large"
            if len(self._queued[lane]) >= MAX_QUEUED:
                self.stats["refused"] += 1
                fut.set_exception(RequestBusy(f"the grammar compiler is busy: {MAX_QUEUED} grammars are waiting; "
                                              f"try again later"))
                return
            job = self._jobs[key] = _Job(key, spec, lane=lane)
            self._queued[lane].append(job)
        job.waiters.append(fut)
        fut.add_done_callback(lambda f: f.cancelled() and self._inbox.put(("cancel", key)))

    def _build_info(self, fut: Future) -> bool:
        try:
            self._info = self._info_fn()
            return True
        except RequestError as e:  # llguidance missing, no tokenizer
            fut.set_exception(e)
            return False

    def _on_cancel(self, key: str) -> None:
        job = self._jobs.get(key)
        if job is None:
            return
        job.waiters = [f for f in job.waiters if not f.cancelled()]
        if job.waiters:
            return
        self.stats["dropped"] += 1
        del self._jobs[key]
        if job.worker is not None:
            job.worker.kill()  # its report ("killed") finds no job and is ignored
        else:
            self._queued[job.lane].remove(job)

    def _on_done(self, worker: "_Worker", job: _Job, outcome: str, value: Any) -> None:
        worker.idle, job.worker = True, None  # here, not on its thread: a late cancel of `job` cannot kill the next
        if self._jobs.get(job.key) is not job:
            return  # dropped meanwhile
        if outcome == "ok":
            self.stats["compiled"] += 1
            self._cache[job.key] = value
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            self._finish(job, value)
        elif outcome in ("slice", "heavy"):  # a small-lane job past its slice, or not light: to the large lane
            self.stats["moved"] += 1
            job.lane = "large"
            self._queued["large"].append(job)
        elif outcome == "timeout":
            self.stats["timeouts"] += 1
            self._finish(job, RequestError(f"{job.what}: the grammar did not compile within {self.budget_s:g} s "
                                           f"(--grammar-compile-timeout); send a simpler grammar"))
        else:  # "err" (a one-line refusal) or "crashed"
            self._finish(job, RequestError(str(value)))

    def _finish(self, job: _Job, value: Any) -> None:
        self._jobs.pop(job.key, None)
        for fut in job.waiters:
            if isinstance(value, BaseException):
                if not fut.cancelled():
                    fut.set_exception(value)
            else:
                _resolve(fut, value)

    def _schedule(self) -> None:
        for lane, jobs in self._queued.items():
            for w in self._workers[lane]:
                if not jobs:
                    break
                if w.idle:
                    job = jobs.popleft()
                    job.worker = w
                    w.assign(job, SMALL_SLICE_S if lane == "small" else self.budget_s)


def _resolve(fut: Future, value: Any) -> None:
    if not fut.cancelled():
        try:
            fut.set_result(value)
        except Exception:  # noqa: BLE001  (cancelled between the check and the set)
            pass


class _Worker:
    """One compile process and the thread that drives it (started when first needed)."""

    def __init__(self, pool: CompilePool, lane: str) -> None:
        self.pool, self.lane = pool, lane
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._kill = threading.Event()
        self.idle = True
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def assign(self, job: _Job, slice_s: float) -> None:
        self.idle = False
        self._kill.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"dsv4-grammar-{self.lane}", daemon=True)
            self._thread.start()
        self._tasks.put((job, slice_s))

    def kill(self) -> None:
        self._kill.set()

    def stop(self) -> None:
        self._stopped = True
        self._tasks.put(None)
        self._terminate()

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            job, slice_s = task
            outcome, value = self._compile(job, slice_s)
            self.pool._inbox.put(("done", self, job, outcome, value))
            if not self.alive and not self._stopped:  # killed (over its slice or budget, or dropped): its successor starts now
                try:
                    self._start()
                except (EOFError, OSError, TimeoutError) as e:
                    self._terminate()
                    if not self._stopped:
                        log.warning("grammar worker did not start: %s: %s", type(e).__name__, e)

    def _compile(self, job: _Job, slice_s: float) -> tuple[str, Any]:
        try:
            if not self.alive:
                self._start()
            conn = self._conn  # `stop` (another thread) may clear it: this one's calls then fail as closed
            if conn is None:
                raise OSError("the grammar worker was stopped")
            conn.send(("compile", job.spec, self.lane == "small"))
            deadline = time.monotonic() + slice_s
            while not conn.poll(0.05):
                if self._kill.is_set():
                    self._terminate()
                    return "killed", None
                if time.monotonic() > deadline:
                    self._terminate()
                    return ("slice" if self.lane == "small" else "timeout"), None
            status, payload = conn.recv()
        except (EOFError, OSError, TimeoutError) as e:
            self._terminate()
            if not self._stopped:
                log.warning("grammar worker failed: %s: %s", type(e).__name__, e)
            return "crashed", f"{job.what}: the grammar compiler failed ({type(e).__name__}); see the daemon's log"
        if status != "ok":
            return status, payload  # "err" (one line) or "heavy"
        import llguidance as llg

        tok = self.pool._info[1].result()  # this pool thread waits for it, never the engine's loop
        return "ok", Compiled(payload, llg.LLMatcher(tok, payload, log_level=0))

    def _start(self) -> None:
        """A fresh worker process with the vocabulary; waits until it is ready."""
        ours, theirs = socket.socketpair()
        try:
            root = str(Path(__file__).resolve().parents[3])  # where this dsv4 lives, first on the worker's path
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
            self._proc = subprocess.Popen([sys.executable, "-m", "dsv4.engine.grammar.worker", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        conn = self._conn = Connection(ours.detach())  # ours: `stop` may clear self._conn meanwhile
        conn.send(self.pool._info[0])
        if not conn.poll(START_TIMEOUT_S) or conn.recv() != "ready":
            raise TimeoutError(f"no answer from the grammar worker within {START_TIMEOUT_S:.0f} s")

    def _terminate(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if conn is not None:
            conn.close()
