"""Builds the compiled decode buckets a `serve` lacks, in a separate process, while it serves.

`serve` compiles by default (`--compile` auto): it loads the buckets whose packages are
cached (`compile_start`) and starts answering at once; for the others the engine spawns
this module (`spawn(config)`), which loads the same model, builds each missing bucket's
AOTInductor package into the private cache (`artifacts`), one at a time, and exits. The
engine polls the cache between steps (`Engine.poll_compiled`, a few stat calls a second)
and switches each bucket to compiled as its package appears. A process, not a thread:
the build holds the GIL for minutes and dynamo's state is process-global.

The builder runs at lower priority (nice 10, or DSV4_COMPILE_NICE: 0..19) with one thread, so
that serving keeps the other cores; it exits when the daemon does (its stdin, a pipe from the daemon, closes) and
writes its log lines to the daemon's stderr. The configuration travels pickled over that
pipe (parent to its own child: nothing untrusted is unpickled).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
from typing import Any

log = logging.getLogger("dsv4.compile")


def spawn(config: Any) -> subprocess.Popen:
    """Start the builder for `config` (an `EngineConfig`); the returned process's stdin stays
    open for as long as the builder should live."""
    proc = subprocess.Popen([sys.executable, "-m", "dsv4.engine.compile.builder"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdin is not None
    data = pickle.dumps(config)
    proc.stdin.write(len(data).to_bytes(8, "little") + data)
    proc.stdin.flush()  # kept open: its end tells the builder to stop
    return proc


def stop(proc: subprocess.Popen | None) -> None:
    """End a builder (closing its pipe, then terminating what is left)."""
    if proc is None:
        return
    try:
        if proc.stdin is not None:
            proc.stdin.close()
    except OSError:
        pass
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_exactly(n: int) -> bytes:
    """n bytes from descriptor 0 (raw reads: no buffered-reader lock that a process forked
    by the compiler, e.g. its workers, would inherit held)."""
    out = b""
    while len(out) < n:
        chunk = os.read(0, n - len(out))
        if not chunk:
            raise SystemExit(0)  # the daemon went away before we started
        out += chunk
    return out


def _exit_when_parent_closes() -> None:
    """The daemon is gone (or stopped us) when our stdin reaches its end."""
    while os.read(0, 65536):
        pass
    os._exit(0)


def build_niceness(value: str | None) -> int:
    """The builder's niceness: DSV4_COMPILE_NICE's value (0..19), else 10. An idle machine
    (or a test suite that waits for the build) may want 0; a bad value says so and keeps 10."""
    if value is None or value == "":
        return 10
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= 19:
        log.warning("DSV4_COMPILE_NICE=%r is not a niceness from 0 to 19: the build runs at nice 10", value)
        return 10
    return n


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="dsv4 compile builder: %(message)s", stream=sys.stderr)
    config = pickle.loads(_read_exactly(int.from_bytes(_read_exactly(8), "little")))
    threading.Thread(target=_exit_when_parent_closes, daemon=True).start()
    try:
        os.nice(build_niceness(os.environ.get("DSV4_COMPILE_NICE")))
    except OSError:
        pass
    import torch

    from dsv4.model.loader import load_model
    from dsv4.engine.compile.env import private_cache_dir
    from dsv4.engine.compile.compiled import CompiledSteps
    from dsv4.engine.runner import Runner

    torch.set_num_threads(1)
    model = load_model(config.model, device=config.device, dtype=config.torch_dtype,
                       quantization=config.quantization, draft_vocab=config.draft_vocab_ids)
    # the same state shapes as the engine's runner: a package is keyed by them
    runner = Runner.for_config(model, config, torch.device(config.device), scratch_slot=True)
    steps = CompiledSteps.for_config(model, runner.state, config, private_cache_dir())
    steps.time_buckets = False  # the engine times what it loads
    steps.capture(build=False)  # what is there already
    todo = set(steps.missing())
    log.info("building %d decode bucket(s) in the background", len(todo))
    steps.capture(only=todo)
    for line in steps.failed:
        log.warning("%s", line)
    return 1 if steps.failed else 0


if __name__ == "__main__":
    sys.exit(main())
