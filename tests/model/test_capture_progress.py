"""--compile shows its capture: `CompiledSteps.capture` reports each bucket to the progress
callback, keeps torch's TypedStorage deprecation warning out of the terminal, and the CLI's
progress bar ends the weights' bar before the capture's starts (no stale "loading weights
367/367" for minutes). The uncompiled programs stand in for the compiled ones (no compile
time), as in test_compiled.test_failed_capture_names_its_bucket_and_runs_eager."""

from __future__ import annotations

import os
import pty
import sys
import warnings
from typing import Any, Callable

import pytest

from dsv4.daemon.process import ProgressBar
from dsv4.engine.compile.compiled import CompiledSteps
from dsv4.model.model import DeepseekV4, init_random
from tests.model.tiny import tiny_config

SMALL = dict(num_hidden_layers=2, compress_ratios=[0, 4, 0], hc_sinkhorn_iters=2, index_topk=3)


def _noisy(program: Callable[..., Any]) -> Callable[..., Any]:
    """`program`, warning as inductor's freezing does, plus one warning that must still show."""
    def run(*args: Any) -> Any:
        warnings.warn("TypedStorage is deprecated. It will be removed in the future and UntypedStorage will be "
                      "the only storage class.", UserWarning)
        warnings.warn("a warning of ours", UserWarning)
        return program(*args)
    return run


def test_capture_reports_each_bucket_and_quiets_typedstorage() -> None:
    model = init_random(DeepseekV4(tiny_config(**SMALL)), seed=0).eval().fuse_projections()
    state = model.new_state(3, 64, max_chunk=8, max_spec=2)
    steps = CompiledSteps(model, state, 4, with_mtp=True)  # buckets 1, 2, 4 for main and MTP
    steps.time_buckets = False  # the stand-ins are no faster than eager
    steps._main, steps._mtp = _noisy(steps._main_step), _noisy(steps._mtp_step)
    seen: list[tuple[int, int]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps.capture(progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 6) for i in range(7)]
    assert len(steps.ready) == 6 and not steps.failed
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "TypedStorage" in m]
    assert messages.count("a warning of ours") == 6


def test_the_weights_bar_ends_before_the_capture_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    master, slave = pty.openpty()  # the bar draws only on a terminal
    term = os.fdopen(slave, "w")
    monkeypatch.setattr(sys, "stderr", term)  # here, not in a fixture: pytest's capture resets it after those
    bar = ProgressBar("loading weights", "capturing decode buckets (--compile)")
    try:
        bar(0, 367)
        bar(200, 367)
        assert bar.labels == ["loading weights"]
        bar(367, 367)
        assert bar.labels == []  # the weights are in: their bar goes
        bar(367, 367)  # a repeated final report starts nothing
        assert bar.labels == []
        bar(0, 6)
        bar(3, 6)
        assert bar.labels == ["capturing decode buckets (--compile)"]
        bar(6, 6)
        assert bar.labels == []
    finally:
        bar.close()
        monkeypatch.undo()
        term.close()
        os.close(master)
