"""One engine replica's process (--data-parallel-size): an `Engine` pinned to its cores,
stepping on its own, fed and drained by the daemon's `EnginePool` over a pipe.

    pool -> replica   ("add", request id, prompt ids, SamplingParams, add_request keywords, grammar spec | None)
                      ("abort", request id)          ("stop",)
    replica -> pool   ("ready", facts)               once loaded; ("failed", one line) if it could not start
                      ("out", [RequestOutput], status | None)
                           after every step with output, and at least every BEAT_S (then with
                           its status, as when a request finished): the beat by which the pool
                           tells a frozen replica from a busy one
                      ("crashed", one line)          a step raised; the process then exits 1

The loop never waits while it has work: it takes what the pipe holds, steps, sends the outputs.
A structured request's grammar compiles in this engine's own worker processes
(`Engine.submit_grammar`); the request joins the engine once it is built (or finishes with the
compile's error), so a slow grammar holds up nobody. A request the engine refuses finishes at
once with finish_reason "error" and the one-line reason.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from concurrent.futures import Future
from typing import Any

BEAT_S = 0.5  # the most a live replica stays silent
IDLE_WAIT_S = 0.25  # how long an idle replica blocks on the pipe between beats


def replica_main(index: int, config: Any, cores: list[int], conn: Any) -> None:
    """Entry point of replica `index` (spawned): pin to `cores`, load, serve the pipe until "stop"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the daemon stops us in order
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError):
        pass
    try:
        from dsv4.engine.engine import Engine

        engine = Engine(config)
    except Exception as e:  # noqa: BLE001  (the pool reports it as this replica's start failure)
        conn.send(("failed", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
        return
    conn.send(("ready", {"pid": os.getpid(), "cores": cores, "weight_bytes": engine.weight_bytes,
                         "quant_note": engine.quant_note, "compile_note": engine.compile_note,
                         "calibration_note": engine.calibration_note}))
    try:
        _serve(engine, conn)
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the pool is gone
    except Exception as e:  # noqa: BLE001
        if os.environ.get("DSV4_DEBUG"):
            traceback.print_exc()
        try:
            conn.send(("crashed", f"{type(e).__name__}: {e}"))
        except (OSError, ValueError):
            pass
        raise SystemExit(1)
    finally:
        engine.close()


def _serve(engine: Any, conn: Any) -> None:
    compiling: dict[str, tuple[Future, list[int], Any, dict[str, Any]]] = {}
    last_beat = 0.0
    while True:
        outs: list[Any] = []
        wait = 0.0 if engine.has_unfinished() else (0.01 if compiling else IDLE_WAIT_S)
        while conn.poll(wait):
            wait = 0.0
            msg = conn.recv()
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
            outs.extend(_failed(rid, error) if error is not None else _add(engine, rid, ids, params, kw, fut.result()))
        if engine.has_unfinished():
            outs.extend(engine.step())
        now = time.monotonic()
        beat = now - last_beat >= BEAT_S or any(o.finished for o in outs)  # the status fresh once one ends
        if outs or beat:
            conn.send(("out", outs, engine.status() if beat else None))
            if beat:
                last_beat = now


def _add(engine: Any, rid: str, ids: list[int], params: Any, kw: dict[str, Any], grammar: Any) -> list[Any]:
    """Queue one request; its refusal as a finished output."""
    try:
        engine.add_request(ids, params, request_id=rid, grammar=grammar, **kw)
        return []
    except Exception as e:  # noqa: BLE001  (RequestError: this request only)
        return _failed(rid, e)


def _failed(rid: str, error: BaseException) -> list[Any]:
    from dsv4.engine.request import FINISH_ERROR, RequestOutput

    return [RequestOutput(rid, finished=True, finish_reason=FINISH_ERROR, error=str(error) or type(error).__name__)]
