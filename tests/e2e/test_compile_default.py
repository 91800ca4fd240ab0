"""`serve` compiles by default: with a cold cache it answers at once, eagerly, while a
separate process builds the decode buckets, switching to each as it appears; a restart
loads them (no build, compiled from the first request); `--no-compile` opts out; output
is the eager output. One AOTInductor build of one bucket (1 sequence, K = 0) on the 1-layer
model of tests/model/test_compiled.py, about half a minute on a small CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dsv4.engine.compile.env import CompileUnavailable, check_backend
from tests.checkpoints import write_tiny_checkpoint
from tests.e2e.util import Daemon, dsv4, env_for, status_now, wait_until
from tests.model.test_compiled import SMALL

ARGS = ("--max-num-seqs", "1", "--num-speculative-tokens", "0", "--max-model-len", "64")
RUN = ("run", "--json", "--max-tokens", "8", "--ignore-eos", "--temperature", "0", "To be")


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    try:
        check_backend(torch.device("cpu"))
    except CompileUnavailable as e:
        pytest.skip(f"inductor cannot compile on this machine: {e}")
    d = tmp_path_factory.mktemp("small")
    write_tiny_checkpoint(d, **SMALL)
    return d


def _run(d: Daemon) -> dict:
    r = dsv4(*RUN, endpoint=d.endpoint)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _status(d: Daemon) -> dict:
    r = dsv4("status", "--json", endpoint=d.endpoint)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_serve_builds_in_the_background_then_starts_warm(small, tmp_path):
    # the build at the daemon's priority: at nice 10 beside the suite's other runs it took
    # five minutes of this run's time, waiting for idle cycles (the priority is not tested)
    env = env_for(XDG_CACHE_HOME=str(tmp_path / "cache"), DSV4_COMPILE_NICE="0")
    env.pop("DSV4_COMPILE")  # the default
    eager = Daemon(small, *ARGS, "--no-compile", env=env).wait_ready()
    try:
        ref = _run(eager)
        assert ref["compiled"] is False and not _status(eager)["compile_building"]
    finally:
        eager.cleanup()
    assert not (tmp_path / "cache" / "dsv4" / "inductor" / "aoti").exists()  # --no-compile: nothing built

    cold = Daemon(small, *ARGS, env=env).wait_ready()
    try:
        first = _run(cold)  # served at once, eagerly, while the bucket builds
        assert first["token_ids"] == ref["token_ids"]
        assert wait_until(lambda: status_now(cold.endpoint)["compiled_buckets"] == {"main": [1], "mtp": []},
                          timeout=300, every=1.0), cold.log.read_text()
        later = _run(cold)
        assert later["compiled"] is True and later["token_ids"] == ref["token_ids"]
        assert wait_until(lambda: not status_now(cold.endpoint)["compile_building"], timeout=30), cold.log.read_text()
        log = cold.log.read_text()
        assert "building 1 decode bucket(s) in the background" in log and "main bucket 1 now runs compiled" in log
    finally:
        cold.cleanup()
    packages = list((tmp_path / "cache" / "dsv4" / "inductor" / "aoti").glob("*.pt2"))
    assert len(packages) == 1

    warm = Daemon(small, *ARGS, env=env).wait_ready()
    try:
        st = _status(warm)
        assert st["compiled"] is True and not st["compile_building"]  # loaded, nothing to build
        assert _run(warm)["token_ids"] == ref["token_ids"]
        assert "in the background" not in warm.log.read_text()
    finally:
        warm.cleanup()
    assert os.listdir(tmp_path / "cache" / "dsv4" / "inductor" / "aoti")  # kept for the next start
