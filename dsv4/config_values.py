"""Typed, range-checked reading of config.json values (`dsv4.config`): every number is
finite and within its key's range, or a `ConfigError` whose one-line message names the key."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A config.json that dsv4 cannot run; the message names the key."""


class Getter:
    """Typed access to required/optional keys with errors that name the key."""

    def __init__(self, d: dict[str, Any]):
        self.d = d

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        v = self.d.get(key, default)
        if v is None:
            raise ConfigError(f"config.json is missing required key {key!r}")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{key!r} must be an integer, got {shown(v)}")
        if v < minimum:
            raise ConfigError(f"{key!r} must be >= {minimum}, got {shown(v)}")
        return v

    def float(self, key: str, default: float | None = None, *, above: float | None = None,
              at_least: float | None = None) -> float:
        v = self.d.get(key, default)
        if v is None:
            raise ConfigError(f"config.json is missing required key {key!r}")
        return real(key, v, above=above, at_least=at_least)


def real(key: str, v: Any, *, above: float | None = None, at_least: float | None = None) -> float:
    """`v` as a finite float within its range (> `above`, >= `at_least`); ConfigError naming `key`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key!r} must be a number, got {shown(v)}")
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise ConfigError(f"{key!r} must be a finite number, got {shown(v)}")
    if above is not None and not x > above:
        raise ConfigError(f"{key!r} must be > {above:g}, got {shown(v)}")
    if at_least is not None and not x >= at_least:
        raise ConfigError(f"{key!r} must be >= {at_least:g}, got {shown(v)}")
    return x


def integer(key: str, v: Any, minimum: int = 0) -> int:
    """`v` as an integer >= `minimum` (a float with an integral value too); ConfigError naming `key`."""
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key!r} must be an integer, got {shown(v)}")
    if v < minimum:
        raise ConfigError(f"{key!r} must be >= {minimum}, got {shown(v)}")
    return v


def shown(v: Any, limit: int = 60) -> str:
    """`repr(v)` cut to `limit` characters (an integer of 10^5 digits has no repr at all)."""
    try:
        r = repr(v)
    except ValueError:
        return "an integer too large to print"
    return r if len(r) <= limit else r[:limit - 3] + "..."
