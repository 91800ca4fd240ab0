"""Facts of this machine that several layers read (a leaf: no dsv4 imports)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# hidden width from which a decode step's parallel regions are long enough that OpenMP threads
# sleeping at each barrier cost little (the peer's V4 Flash slice, 4096: 0.89x of spinning
# threads' decode rate on an idle machine; the embedded model, whose regions are tiny: 0.42x)
LONG_STEP_HIDDEN = 2048


def passive_waiting() -> bool:
    """OpenMP's threads of this process sleep at once at a barrier (OMP_WAIT_POLICY=PASSIVE)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def choose_wait_policy(model: str | None) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE for a model whose steps are long (config.json's hidden_size
    >= LONG_STEP_HIDDEN), unless the environment sets a policy or torch (and with it OpenMP,
    which reads the policy once, when it loads) is imported already. Then the engine's default
    threads take every core (`engine.config.default_threads`): sleeping threads leave a core
    to whatever else runs, where spinning ones collapse beside it. Returns whether it set it."""
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules or not model:
        return False
    try:
        hidden = json.loads((Path(model).expanduser() / "config.json").read_text(encoding="utf-8"))["hidden_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(hidden, int) or hidden < LONG_STEP_HIDDEN:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


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
