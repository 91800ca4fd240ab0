"""Which cores each engine replica runs on: this process's CPUs (its affinity), NUMA node by
node, in disjoint groups (pure Python: /sys and sched_getaffinity)."""

from __future__ import annotations

import os

NODES = "/sys/devices/system/node"


def cores_of(n: int) -> list[list[int]]:
    """This process's CPUs in `n` disjoint groups of equal size, in NUMA node order (a group
    stays on one node when the nodes divide evenly)."""
    mine = set(os.sched_getaffinity(0))
    ordered: list[int] = []
    nodes = sorted(p for p in os.listdir(NODES) if p.startswith("node")) if os.path.isdir(NODES) else []
    for node in nodes:
        try:
            with open(f"{NODES}/{node}/cpulist") as f:
                ordered += [c for c in cpulist(f.read()) if c in mine and c not in ordered]
        except OSError:
            continue
    ordered += sorted(mine - set(ordered))
    per = len(ordered) // n
    return [ordered[i * per:(i + 1) * per] for i in range(n)]


def cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


def span(cores: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; [0, 2] -> '0,2'."""
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))
