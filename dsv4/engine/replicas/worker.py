"""One engine replica's process (--data-parallel-size): an `Engine` pinned to its cores,
stepping on its own, fed and drained by the daemon's `EnginePool` over a pipe.

    pool -> replica   ("add", request id, prompt ids, SamplingParams, add_request keywords, grammar spec | None)
                      ("abort", request id)          ("stop",)
    replica -> pool   ("ready", facts)               once loaded; ("failed", one line) if it could not start
                      ("out", [RequestOutput])       after every step with output
                      ("beat", counters)             every BEAT_S, from a thread: also during a long step
                      ("crashed", one line)          a step raised; the process then exits 1

Three threads: a reader takes everything the pool sends as it comes (so the pool's sends
never wait for a step to end; the pipe closing means the daemon is gone: the process exits),
a beat reports `Engine.counters()` twice a second whatever the loop is doing (so a long step
is not silence: only a process that stopped altogether, or hangs holding the interpreter,
goes quiet), and the loop steps whenever it has work. A structured request's grammar
compiles in this engine's own worker processes (`Engine.submit_grammar`); the request joins
the engine once built, so a slow grammar holds up nobody. A request the engine refuses
comes back as a finished output carrying the refusal (the daemon answers it as admission does).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any

BEAT_S = 0.5  # the most a live replica stays silent
IDLE_WAIT_S = 0.25  # how long an idle loop blocks on its inbox


class _Link:
    """The replica's end of the pipe: one lock over its sends, a reader thread filling `inbox`.
    Another host's replica told to stop before it serves (while it loads) exits 0 at once:
    node 0 is going, and no one will read what it loads for."""

    def __init__(self, conn: Any, gone: str | None = None) -> None:
        self.conn, self.lock, self.inbox, self.gone = conn, threading.Lock(), queue.Queue(), gone
        self.serving = threading.Event()  # set once "ready" is sent
        threading.Thread(target=self._read, name="dsv4-replica-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                self.inbox.put(msg)
                if msg[0] == "stop":
                    if self.gone and not self.serving.is_set():
                        print(f"{self.gone} stopped it while it loaded", file=sys.stderr, flush=True)
                        os._exit(0)
                    return
        except (EOFError, OSError):
            if self.gone:
                print(f"{self.gone} went away", file=sys.stderr, flush=True)
            os._exit(3)  # the daemon is gone

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send(msg)


def replica_config(config: Any, index: int) -> Any:
    """Replica `index`'s engine config: one engine of the group, its own seed (unseeded
    sampling differs between replicas), no place of its own among the hosts."""
    from dataclasses import replace

    return replace(config, data_parallel_size=1, data_parallel_size_local=None, data_parallel_address=None,
                   data_parallel_rpc_port=None, data_parallel_rank=0, seed=config.seed + index)


def replica_main(index: int, config: Any, cores: list[int], conn: Any, gone: str | None = None) -> int:
    """Entry point of replica `index` (spawned, or a host joining: `remote.join`): pin to
    `cores`, load, serve until "stop" (0; 1 when it could not start). `gone` (another host's
    replica): how its lines name the daemon, "... went away" when the daemon's end closes (the
    process then exits 3)."""
    if gone is None:  # spawned: Ctrl-C reaches the whole group, and the daemon stops us in order
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError):
        pass
    link = _Link(conn, gone)
    try:
        from dsv4.engine.engine import Engine

        engine = Engine(config)
    except Exception as e:  # noqa: BLE001  (the pool reports it as this replica's start failure)
        lines = str(e).strip().splitlines()
        line = f"{type(e).__name__}: {lines[0] if lines else ''}"
        if gone:  # another host's: said here too
            print(f"dsv4: engine replica {index} could not start: {line}", file=sys.stderr)
        link.send(("failed", line))
        return 1
    try:
        link.send(("ready", {"weight_bytes": engine.weight_bytes, "quant_note": engine.quant_note,
                             "compile_note": engine.compile_note, "calibration_note": engine.calibration_note,
                             "status": engine.status()}))
        link.serving.set()
        stop = threading.Event()
        threading.Thread(target=_beat, args=(engine, link, stop), name="dsv4-replica-beat", daemon=True).start()
        _serve(engine, link)
        stop.set()
    except Exception as e:  # noqa: BLE001
        if os.environ.get("DSV4_DEBUG"):
            traceback.print_exc()
        if gone:
            print(f"dsv4: engine replica {index} failed: {type(e).__name__}: {e}", file=sys.stderr)
        try:
            link.send(("crashed", f"{type(e).__name__}: {e}"))
        except (OSError, ValueError):
            pass
        raise SystemExit(1)
    finally:
        engine.close()
    return 0


def _beat(engine: Any, link: _Link, stop: threading.Event) -> None:
    try:
        while not stop.wait(BEAT_S):
            link.send(("beat", engine.counters()))
    except (OSError, ValueError):
        pass  # the daemon is gone (the reader ends the process)


def _serve(engine: Any, link: _Link) -> None:
    compiling: dict[str, tuple[Future, list[int], Any, dict[str, Any]]] = {}
    while True:
        outs: list[Any] = []
        wait = 0.0 if engine.has_unfinished() else (0.01 if compiling else IDLE_WAIT_S)
        while True:
            try:
                msg = link.inbox.get(timeout=wait) if wait else link.inbox.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            if msg[0] == "stop":
                return
            if msg[0] == "abort":
                job = compiling.pop(msg[1], None)
                if job is not None:
                    job[0].cancel()
                else:
                    engine.abort(msg[1])
            elif msg[0] == "add":
                _, rid, ids, params, kw, spec = msg
                if spec is None:
                    outs.extend(_add(engine, rid, ids, params, kw, None))
                else:
                    compiling[rid] = (engine.submit_grammar(spec), ids, params, kw)
        for rid in [r for r, job in compiling.items() if job[0].done()]:
            fut, ids, params, kw = compiling.pop(rid)
            error = fut.exception()
            outs.extend(_refused(rid, error) if error is not None else _add(engine, rid, ids, params, kw, fut.result()))
        if engine.has_unfinished():
            outs.extend(engine.step())
        if outs:
            link.send(("out", outs))


def _add(engine: Any, rid: str, ids: list[int], params: Any, kw: dict[str, Any], grammar: Any) -> list[Any]:
    """Queue one request; its refusal as a finished output."""
    try:
        engine.add_request(ids, params, request_id=rid, grammar=grammar, **kw)
        return []
    except Exception as e:  # noqa: BLE001  (RequestError: this request only)
        return _refused(rid, e)


def _refused(rid: str, error: BaseException) -> list[Any]:
    from dsv4.engine.request import FINISH_ERROR, RequestError, RequestOutput

    refused = isinstance(error, RequestError)  # else a bug: the request fails as "error" (HTTP 500)
    if not refused:
        traceback.print_exception(error)
    return [RequestOutput(rid, finished=True, finish_reason=FINISH_ERROR, error=str(error) or type(error).__name__,
                          refusal=error if refused else None)]
