"""Where this process stands in a tensor-parallel group, resolved with the engine config:
torchrun's environment (`Launch`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), the tensor-parallel size it implies, and the plan transport
(`engine.transport`). Each check raises `EngineConfigError` naming the flag or variable.
The functions take the flags' values and return the resolved ones; `EngineConfig` (the
only importer among them) sets its own fields from what they return.

Under torchrun, explicit flags that would place the ranks differently are errors rather
than overrides: `--tensor-parallel-size` other than WORLD_SIZE, and any of `--nnodes`,
`--node-rank`, `--master-addr`, `--master-port` (torchrun's rendezvous already placed
every rank; two sources of truth would silently disagree on some host).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dsv4.engine.checks import EngineConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """This process's place in a group that `torchrun` started (its environment variables):
    every process is already one rank; nothing is spawned."""

    rank: int
    world: int
    local_rank: int
    local_world: int  # ranks on this host (LOCAL_WORLD_SIZE; WORLD_SIZE when unset)
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent serves the rendezvous store (TORCHELASTIC_USE_AGENT_STORE)


def torchrun_launch(env: Any = None) -> Launch | None:
    """`Launch` from torchrun's variables when RANK or WORLD_SIZE is set, else None;
    `EngineConfigError` naming the variable when one is missing or not a number."""
    env = os.environ if env is None else env
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    for var in TORCHRUN_VARS:
        if not env.get(var):
            raise EngineConfigError(f"{var} is not set, but RANK/WORLD_SIZE are: a torchrun launch sets all of "
                                    f"{', '.join(TORCHRUN_VARS)}")
    nums = {}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        raw = env.get(var, env["WORLD_SIZE"] if var == "LOCAL_WORLD_SIZE" else "")
        if not raw.isdigit():
            raise EngineConfigError(f"{var} must be a non-negative integer, got {raw!r}")
        nums[var] = int(raw)
    world, local_world = nums["WORLD_SIZE"], nums["LOCAL_WORLD_SIZE"]
    if world < 1 or nums["RANK"] >= world:
        raise EngineConfigError(f"RANK {nums['RANK']} is out of range for WORLD_SIZE {world}")
    if local_world < 1 or world % local_world or nums["LOCAL_RANK"] >= local_world:
        raise EngineConfigError(f"LOCAL_RANK {nums['LOCAL_RANK']} / LOCAL_WORLD_SIZE {local_world} do not fit "
                                f"WORLD_SIZE {world} (each host runs the same number of ranks)")
    return Launch(nums["RANK"], world, nums["LOCAL_RANK"], local_world, env["MASTER_ADDR"], nums["MASTER_PORT"],
                  env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def resolve_tensor_parallel(T: Any, launch: Launch | None, *, nnodes: Any = 1, node_rank: Any = 0,
                            master_addr: str | None = None, master_port: Any = None) -> Any:
    """--tensor-parallel-size `T`: WORLD_SIZE under torchrun (a different value given is an
    error, and so is any of --nnodes/--node-rank/--master-addr/--master-port: torchrun
    placed the ranks), else 1 unless given."""
    if launch is None:
        return 1 if T is None else T
    if T is not None and T != launch.world:
        raise EngineConfigError(f"--tensor-parallel-size {T} conflicts with WORLD_SIZE {launch.world} set by torchrun "
                                f"(drop the flag: under torchrun every process is one rank)")
    given = [(f, v) for f, v, default in (("--nnodes", nnodes, 1), ("--node-rank", node_rank, 0),
                                          ("--master-addr", master_addr, None), ("--master-port", master_port, None))
             if v != default]
    if given:
        flag, value = given[0]
        raise EngineConfigError(f"{flag} {value} cannot be combined with torchrun (RANK, WORLD_SIZE, MASTER_ADDR and "
                                f"MASTER_PORT are set; its rendezvous places the ranks): drop {flag}")
    return launch.world


def resolve_transport(transport: str, *, hosts: int, tensor_parallel_size: int) -> str:
    """How rank 0 sends each step's plan (`engine.transport`): "auto" = shared memory when
    every rank is on this host (measured faster, BENCHMARKS.md), the group's object
    broadcast across hosts."""
    from dsv4.engine.parallel.transport import SHM_DIR, TRANSPORTS

    if transport not in TRANSPORTS:
        raise EngineConfigError(f"plan_transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    one_host = hosts == 1
    if transport == "shm" and not one_host:
        raise EngineConfigError("plan_transport shm needs every rank on one host; use object (or auto)")
    if transport == "shm" and SHM_DIR is None:
        raise EngineConfigError("plan_transport shm needs /dev/shm, which this host lacks; use object (or auto)")
    if transport == "auto":
        return "shm" if one_host and SHM_DIR is not None and tensor_parallel_size > 1 else "object"
    return transport
