"""`--compile` at startup: decide, capture the buckets, and say what runs compiled.

`start_compiled(runner, config, progress)` is called by rank 0 (`Engine`) and, under
tensor parallelism, by every other rank (`ranks._follow_rank`) at the same point of the
start: a bucket's capture runs its dispatch, collectives included, so every rank captures
the same buckets in the same order. The ranks first agree on whether to compile at all
(a rank without a C++ compiler, or with an unsafe cache directory, makes all of them run
eager: an all-reduce of the refusals). A capture that fails on some ranks but not others
leaves the others waiting in a collective; the group's timeout then fails the start with
the rank's error (inductor's failures are deterministic: the ranks run the same code on
same-shaped shards, so this has not been seen).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from dsv4.model import int8pack, parallel
from dsv4.engine.compile.env import CompileUnavailable, check_backend, private_cache_dir
from dsv4.engine.compile.compiled import CompiledSteps

log = logging.getLogger("dsv4.compile")


def start_compiled(runner: Any, config: Any, progress: Callable[[int, int], None] | None = None) -> str:
    """Capture `runner`'s decode buckets and install them (`runner.compiled`); on a backend
    that cannot compile, one warning and the eager path. Returns the banner line.

    `config.compile` True: build what the cache lacks now (minutes when cold). "auto" (the
    CLI's default): load what the cache holds and leave the rest eager, on a CPU with one
    rank (a background build, `Engine.build_in_background`, may add them later)."""
    if config.compile == "auto":
        if runner.device.type != "cpu" or parallel.world_size() > 1:
            return "compile: off (by default only a CPU with one rank loads compiled buckets; --compile builds them)"
        if int8pack.packed_bytes(runner.model):
            return ("compile: off (the int8 weights are prepacked for oneDNN's int8 matmul, which compiled "
                    "steps cannot read; --compile loads them plain and builds the buckets)")
        return _load_cached(runner, config, progress)
    cache, reason = _cache_or_refusal(runner)
    if parallel.world_size() > 1:  # all ranks compile, or none
        refused = parallel.all_reduce_max(torch.tensor([1.0 if reason else 0.0], device=runner.device))
        if refused.item() and not reason:
            reason = "another rank cannot compile (see its log)"
    if reason:
        log.warning("--compile: %s; running eager", reason)
        return f"compile: off ({reason})"
    steps = CompiledSteps.for_config(runner.model, runner.state, config, cache)
    secs = steps.capture(progress=progress)
    ok = sorted({n for (_, n), r in steps.ready.items() if r})
    if ok:
        runner.compiled = steps
    for line in steps.failed:
        log.warning("--compile: %s", line)
    if not ok:
        return f"compile: off (every capture failed, {secs:.1f} s)"
    return f"compile: decode buckets {', '.join(map(str, ok))} tokens captured in {secs:.1f} s (cache {cache})"


def _load_cached(runner: Any, config: Any, progress: Callable[[int, int], None] | None) -> str:
    """--compile auto: install the buckets whose packages are cached; silent when it cannot."""
    cache, reason = _cache_or_refusal(runner)
    if reason:
        return f"compile: off ({reason})"
    steps = CompiledSteps.for_config(runner.model, runner.state, config, cache)
    if not steps.use_artifacts:
        return "compile: off (no compiled packages for this configuration)"
    steps.capture(progress=progress, build=False)
    runner.compiled = steps  # also when nothing loaded: `refresh` installs later builds
    have, missing = steps.in_use(), steps.missing()
    loaded = sorted(set(have["main"]) | set(have["mtp"]))
    if not missing:
        return f"compile: decode buckets {', '.join(map(str, loaded))} tokens loaded from the cache ({cache})"
    return (f"compile: {len(loaded)} of {len(loaded) + len(missing)} decode buckets cached"
            + (f" ({', '.join(map(str, loaded))} tokens)" if loaded else "") + "; the others run eager")


def _cache_or_refusal(runner: Any) -> tuple[Any, str]:
    """(the checked private cache dir, "") or (None, why this process cannot compile)."""
    try:
        cache = private_cache_dir()
        check_backend(runner.device)
        return cache, ""
    except CompileUnavailable as e:
        return None, str(e)
