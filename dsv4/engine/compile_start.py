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

from ..model import parallel
from .compiled import CompiledSteps, CompileUnavailable, check_backend, private_cache_dir

log = logging.getLogger("dsv4.compile")


def start_compiled(runner: Any, config: Any, progress: Callable[[int, int], None] | None = None) -> str:
    """Capture `runner`'s decode buckets and install them (`runner.compiled`); on a backend
    that cannot compile, one warning and the eager path. Returns the banner line."""
    reason = ""
    try:
        cache = private_cache_dir()
        check_backend(runner.device)
    except CompileUnavailable as e:
        reason = str(e)
    if parallel.world_size() > 1:  # all ranks compile, or none
        refused = parallel.all_reduce_max(torch.tensor([1.0 if reason else 0.0], device=runner.device))
        if refused.item() and not reason:
            reason = "another rank cannot compile (see its log)"
    if reason:
        log.warning("--compile: %s; running eager", reason)
        return f"compile: off ({reason})"
    K = config.num_speculative_tokens
    steps = CompiledSteps(runner.model, runner.state, config.max_num_seqs * (1 + K), with_mtp=K > 0,
                          cache_dir=cache)
    secs = steps.capture(progress=progress)
    ok = sorted({n for (_, n), r in steps.ready.items() if r})
    if ok:
        runner.compiled = steps
    for line in steps.failed:
        log.warning("--compile: %s", line)
    if not ok:
        return f"compile: off (every capture failed, {secs:.1f} s)"
    return f"compile: decode buckets {', '.join(map(str, ok))} tokens captured in {secs:.1f} s (cache {cache})"
