"""Facts of this machine that several layers read (a leaf: no dsv4 imports)."""

from __future__ import annotations

import os


def passive_waiting() -> bool:
    """OpenMP's threads of this process sleep at once at a barrier (OMP_WAIT_POLICY=PASSIVE)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def installed_version() -> str:
    """dsv4's installed version, from the package metadata (`import dsv4` from below the
    top would close an import cycle: the package's top imports the engine lazily)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dsv4")
    except PackageNotFoundError:
        return "unknown"


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
