"""`--compile` plumbing without compiling: the config field, the flag a detached daemon is
started with, the buckets, the settings a running daemon is compared on, the background
build's niceness (DSV4_COMPILE_NICE)."""

from __future__ import annotations

import pytest

import dsv4
from dsv4.cli.options import engine_argv, engine_kwargs
from dsv4.daemon.process import SETTING_FLAGS
from dsv4.engine.compile.builder import build_niceness
from dsv4.engine.compile.env import buckets
from dsv4.engine.config import EngineConfig, EngineConfigError


def test_config_field():
    assert EngineConfig.create(str(dsv4.DEFAULT_MODEL)).compile is False
    assert EngineConfig.create(str(dsv4.DEFAULT_MODEL), compile=True).compile is True
    with pytest.raises(EngineConfigError, match="--compile"):
        EngineConfig.create(str(dsv4.DEFAULT_MODEL), compile="yes")


def test_detached_argv():
    on, off, none = (engine_argv(engine_kwargs(**kw)) for kw in ({"compile": True}, {"compile": False}, {}))
    assert "--compile" in on and "--no-compile" not in on
    assert "--no-compile" in off and "--compile" not in off
    assert not {"--compile", "--no-compile"} & set(none)
    assert SETTING_FLAGS["compile"] == "--compile"


@pytest.mark.parametrize("n,want", [(1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16])])
def test_buckets(n, want):
    assert buckets(n) == want


def test_build_niceness(caplog):
    assert build_niceness(None) == build_niceness("") == 10
    assert build_niceness("0") == 0 and build_niceness("19") == 19
    for bad in ("-5", "20", "high"):
        assert build_niceness(bad) == 10
        assert f"DSV4_COMPILE_NICE={bad!r} is not a niceness from 0 to 19" in caplog.text
