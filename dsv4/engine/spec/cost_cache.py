"""Auto K's calibration kept between starts: the cost tables' shapes, keyed by what they depend on.

A start that finds the entry for its key loads the shapes instead of timing them again
(1-2 s on the embedded model, about 20 s on a V4 Flash-shaped slice); serving moves each
table's level from the first steps on, as after a timed calibration. The key (`key`) names
what a dispatch's cost depends on: the checkpoint's config.json and tensor headers (not its
path, not its values), the engine settings that shape a step, the default sampling, the CPU
and the kernels it may use, torch and dsv4. Entries are JSON files in
$XDG_CACHE_HOME/dsv4/calibration or $DSV4_CALIBRATION_DIR (private: the compile cache's
checks), written atomically; one that does not parse is timed again and rewritten.
`DSV4_CALIBRATION=fresh` times anyway (the tests keep one directory per pytest session).
Nothing here changes outputs: K never changes greedy tokens or the sampled distribution.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dsv4.machine import installed_version
from dsv4.private_paths import PathError, cache_home, ensure_private_cache
from dsv4.safetensors_header import tensor_listing

TABLES = ("verify", "verify_host", "draft", "draft_host")  # the SpecPolicy cost tables calibration fills
METHOD = 2  # how calibration.py times (2: the shapes take turns); entries of another are timed again
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
CONFIG_FIELDS = ("device", "dtype", "quantization", "threads", "tensor_parallel_size", "nnodes", "max_num_seqs",
                 "num_speculative_tokens", "compile", "max_model_len", "block_size", "draft_vocab_ids")


def cache_dir() -> Path | None:
    """$DSV4_CALIBRATION_DIR, else $XDG_CACHE_HOME/dsv4/calibration (else ~/.cache/...),
    created 0700; None where it is not private (then every start times its costs)."""
    own = os.environ.get("DSV4_CALIBRATION_DIR", "")
    d = Path(own) if own and os.path.isabs(own) else cache_home() / "dsv4" / "calibration"
    try:
        return ensure_private_cache(d, what="calibration cache", parent=not (own and os.path.isabs(own)))
    except (OSError, PathError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def key(config: Any, params: Any) -> str:
    """The cache key of a calibration under `config` (an EngineConfig) with default sampling `params`."""
    model = Path(config.model)
    parts: dict[str, Any] = {
        "dsv4": installed_version(), "method": METHOD, "torch": torch.__version__, "cpu": _cpu_name(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "env": {k: os.environ.get(k) for k in KERNEL_ENV},
        "config": {f: repr(getattr(config, f, None)) for f in CONFIG_FIELDS},
        "params": repr(params),
        "model_config": hashlib.sha256((model / "config.json").read_bytes()).hexdigest(),
        "tensors": tensor_listing(model),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load(policy: Any, k: str) -> dict[str, Any] | None:
    """Fill `policy`'s tables from the entry for key `k`; its record ("timed_s", "when"), or
    None when there is none (or `DSV4_CALIBRATION=fresh`, or it does not parse)."""
    d = cache_dir()
    if d is None or os.environ.get("DSV4_CALIBRATION") == "fresh":
        return None
    try:
        entry = json.loads((d / f"{k}.json").read_text())
        tables = {name: {int(n): float(s) for n, s in entry["tables"][name].items()} for name in TABLES}
        record = {"timed_s": float(entry["timed_s"]), "when": float(entry["when"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    for name, shape in tables.items():
        for n, s in sorted(shape.items()):
            getattr(policy, name).calibrate(n, s)
    return record


def save(policy: Any, k: str, timed_s: float) -> None:
    """Keep `policy`'s calibrated tables under key `k` (best effort: a cache that cannot be written is skipped)."""
    d = cache_dir()
    if d is None:
        return
    entry = {"timed_s": timed_s, "when": time.time(),
             "tables": {name: {str(n): s for n, s in getattr(policy, name).shape.items()} for name in TABLES}}
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, d / f"{k}.json")
    except OSError:
        pass


def calibrated(runner: Any, config: Any, params: Any, ranks: bool = False) -> tuple[float, str]:
    """Fill `runner.policy`'s tables: loaded from the cache, else timed (`calibration.calibrate`)
    and kept. `ranks`: rank 0 of a group, whose other ranks time alongside it or not at all
    (told here; they call `calibrate` when `parallel.broadcast_object(None)` is False).
    Returns (seconds spent, the banner's line)."""
    from dsv4.engine.spec.calibration import calibrate
    from dsv4.model import parallel

    t = time.perf_counter()
    k = key(config, params)
    record = load(runner.policy, k)
    if ranks:
        from dsv4.engine.parallel.ranks import START_TIMEOUT_S

        parallel.meet(START_TIMEOUT_S)  # the others wait here however long the lookup took
        parallel.broadcast_object(record is not None)
    if record is None:
        calibrate(runner, params)
    seconds = time.perf_counter() - t
    if record is None:
        save(runner.policy, k, seconds)
    return seconds, note(record, seconds)


def note(record: dict[str, Any] | None, seconds: float) -> str:
    """The banner's line for a calibration timed in `seconds`, or loaded (`record`)."""
    if record is None:
        return f"auto K: decode step costs timed in {seconds:.1f} s"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record["when"]))
    return (f"auto K: decode step costs from the calibration cache ({when}, timed in {record['timed_s']:.1f} s "
            f"then; DSV4_CALIBRATION=fresh times them again)")
