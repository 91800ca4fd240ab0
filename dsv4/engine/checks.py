"""The checks `EngineConfig` runs on its fields before any weight is read, and the one
error they raise: `EngineConfigError`, whose one-line message names the flag to change.

Each `check_*` validates one flag (or a group: the hosts, the tensor-parallel size
against the model and the devices); each `resolve_*` also turns "auto"/None into the
concrete value. They read the checkpoint's config.json and safetensors headers only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dsv4.config import ModelConfig
from dsv4.machine import available_memory

DTYPES = ("float32", "bfloat16", "float16")


class EngineConfigError(ValueError):
    """An engine configuration that cannot run; the message names the CLI flag to change."""


def check_hosts(tensor_parallel_size: int, nnodes: Any, node_rank: Any, master_addr: str | None,
                master_port: Any, rendezvous_timeout: Any) -> None:
    """--nnodes / --node-rank / --master-addr / --master-port / --rendezvous-timeout."""
    check_int("--nnodes", nnodes, minimum=1)
    check_int("--node-rank", node_rank, minimum=0)
    if node_rank >= nnodes:
        raise EngineConfigError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes} "
                                f"(use 0..{nnodes - 1})")
    if tensor_parallel_size % nnodes:
        raise EngineConfigError(f"--tensor-parallel-size {tensor_parallel_size} is not a multiple of "
                                f"--nnodes {nnodes} (each host runs the same number of ranks)")
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise EngineConfigError(f"--nnodes {nnodes} needs --master-addr and --master-port "
                                f"(the host of node rank 0 and a free port there)")
    if master_port is not None:
        check_int("--master-port", master_port, minimum=1)
        if master_port > 65535:
            raise EngineConfigError(f"--master-port {master_port} is not a TCP port (1..65535)")
    if not isinstance(rendezvous_timeout, (int, float)) or rendezvous_timeout <= 0:
        raise EngineConfigError(f"--rendezvous-timeout must be a positive number of seconds, "
                                f"got {rendezvous_timeout!r}")
    if tensor_parallel_size > 1:
        from dsv4.engine.parallel.transport import collective_timeout_s

        try:
            collective_timeout_s()
        except ValueError as e:
            raise EngineConfigError(str(e)) from None


def check_tensor_parallel(T: Any, mc: ModelConfig, device: str, nnodes: Any = 1,
                           flag: str = "--tensor-parallel-size") -> None:
    """--tensor-parallel-size (or torchrun's WORLD_SIZE): divides every split dimension; one
    device per rank of a host."""
    from dsv4.model.sharding import ParallelError, check_sizes

    check_int(flag, T, minimum=1)
    try:
        check_sizes(mc, T, flag)
    except ParallelError as e:
        raise EngineConfigError(str(e)) from None
    kind, sep, _ = device.partition(":")
    if T > 1 and sep:
        raise EngineConfigError(f"{flag} {T} gives rank r device {kind}:r; "
                                f"use --device {kind} (not {device})")
    if T > 1 and kind in ("cuda", "npu"):
        import torch

        n = getattr(torch, kind).device_count()
        local = T // nnodes if isinstance(nnodes, int) and nnodes >= 1 and T % nnodes == 0 else T
        if local > n:
            raise EngineConfigError(f"{flag} {T} over {nnodes} host(s) needs {local} {kind} "
                                    f"devices on each host; {n} are visible")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's limit counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_data_parallel(n: Any, threads: Any, planning: bool = False, flag: str = "--data-parallel-size") -> None:
    """`flag` (the engines on this host): at least one core per engine, and --threads (per
    engine) times the engines within the cores (not checked when `planning` for another machine)."""
    check_int(flag, n, minimum=1)
    if planning:
        return
    cpus = usable_cpus()
    if n > cpus:
        raise EngineConfigError(f"{flag} {n} needs a core per engine; this process may run on "
                                f"{cpus} CPUs; use {flag} {cpus} or less")
    if n > 1 and isinstance(threads, int) and not isinstance(threads, bool) and threads * n > cpus:
        raise EngineConfigError(f"{flag} {n} x --threads {threads} (per engine) = {threads * n} "
                                f"threads over {cpus} CPUs; use --threads {max(1, cpus // n)} or fewer engines")


def check_data_parallel_hosts(n: Any, local: Any, address: Any, port: Any, rank: Any) -> int:
    """--data-parallel-size-local / -address / -rpc-port / -rank (replicas on other hosts,
    `replicas/remote.py`); returns the replicas this process runs (or, joining, is)."""
    check_int("--data-parallel-size", n, minimum=1)
    check_int("--data-parallel-rank", rank, minimum=0)
    if local is not None:
        check_int("--data-parallel-size-local", local, minimum=1)
    if address is None:
        for flag, given in (("--data-parallel-rpc-port", port is not None), ("--data-parallel-rank", rank > 0),
                            ("--data-parallel-size-local", local is not None and local != n)):
            if given:
                raise EngineConfigError(f"{flag} needs --data-parallel-address (node 0's address, where replicas "
                                        f"of other hosts join)")
        return n
    if not isinstance(address, str) or not address.strip():
        raise EngineConfigError(f"--data-parallel-address must be a host name or address, got {address!r}")
    if n < 2:
        raise EngineConfigError(f"--data-parallel-address with --data-parallel-size {n}: no replica can join; "
                                f"give the total number of replicas over every host")
    if port is None:
        raise EngineConfigError("--data-parallel-address needs --data-parallel-rpc-port (a free port on node 0)")
    check_int("--data-parallel-rpc-port", port, minimum=1)
    if port > 65535:
        raise EngineConfigError(f"--data-parallel-rpc-port {port} is not a TCP port (1..65535)")
    if rank >= n:
        raise EngineConfigError(f"--data-parallel-rank {rank} is out of range for --data-parallel-size {n} "
                                f"(use 1..{n - 1} on a joining host)")
    if rank > 0:
        if local is not None and local != 1:
            raise EngineConfigError(f"--data-parallel-size-local {local} with --data-parallel-rank {rank}: a "
                                    f"joining process is one replica; start one per replica (ranks {rank}, "
                                    f"{rank + 1}, ...)")
        return 1
    local = 1 if local is None else local
    if local >= n:
        raise EngineConfigError(f"--data-parallel-size-local {local} of --data-parallel-size {n}: no replica "
                                f"joins; leave out --data-parallel-address, or run fewer here")
    return local


def check_replicas(n: int, device: str, hosts: int, torchrun: bool, master_port: Any = None) -> None:
    """--data-parallel-size with the ranks: replicas run on this host's CPU cores, a replica's
    --tensor-parallel-size ranks on its share of them (one host's; not on an accelerator, not
    under torchrun yet)."""
    if n == 1:
        return
    if device != "cpu":
        raise EngineConfigError(f"--data-parallel-size {n} runs engine replicas on this host's CPU cores; "
                                f"on --device {device} it is not supported yet: use one engine")
    if torchrun:
        raise EngineConfigError(f"--data-parallel-size {n} under torchrun is not supported yet: torchrun places "
                                f"one engine's ranks; run 'dsv4 serve --data-parallel-size {n}' itself")
    if hosts > 1:
        raise EngineConfigError(f"--data-parallel-size {n} with ranks on {hosts} hosts is not supported yet: "
                                f"each replica's --tensor-parallel-size ranks run on this host")
    if master_port:
        raise EngineConfigError(f"--data-parallel-size {n} with --master-port: each replica's ranks meet on a port "
                                f"of their own; leave --master-port out")


def check_int(flag: str, value: Any, minimum: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        extra = f" ({hint})" if hint else ""
        raise EngineConfigError(f"{flag} must be {what}{extra}, got {value!r}")


def check_model_dir(model: Any, revision: Any = None) -> tuple[str, Any]:
    """--model (and --revision) -> (the checkpoint directory, the `dsv4.hub.cache.Snapshot` it
    is when it names a hub model, else None). A directory that exists wins; else ORG/NAME is
    looked up in the hub cache, without the network (the CLI pulls a missing model first)."""
    from dsv4.hub.cache import HubError, resolve_model

    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise EngineConfigError(f"--model must be a checkpoint directory or a hub model ORG/NAME, got {model!r}")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise EngineConfigError(f"--revision must be a branch, tag or commit of the hub model, got {revision!r}")
    try:
        p, snap = resolve_model(str(model), revision)
    except HubError as e:
        raise EngineConfigError(str(e)) from None
    if not p.is_dir():
        raise EngineConfigError(f"--model {p} is not a directory; pass the checkpoint directory")
    if not (p / "config.json").is_file():
        raise EngineConfigError(f"--model {p}: no config.json; is this a DeepSeek V4 checkpoint directory?")
    return str(p), snap


def check_device(device: Any) -> str:
    if not isinstance(device, str):
        raise EngineConfigError(f"--device must be a string such as cpu, cuda, cuda:0 or npu, got {device!r}")
    kind, sep, idx = device.partition(":")
    if kind not in ("cpu", "cuda", "npu") or (sep and not idx.isdigit()) or (kind == "cpu" and sep):
        raise EngineConfigError(f"--device {device!r} is not supported; use cpu, cuda, cuda:N or npu")
    if kind == "cpu":
        return device
    import torch

    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except Exception as e:  # ImportError, or a broken CANN install
            raise EngineConfigError(f"--device {device} needs the torch_npu package, which failed to import "
                                    f"({type(e).__name__}: {e}); install torch_npu or use --device cpu") from None
        backend = getattr(torch, "npu", None)
    else:
        backend = torch.cuda
    if backend is None or not backend.is_available():
        raise EngineConfigError(f"--device {device}: torch {torch.__version__} sees no {kind} device; "
                                f"use --device cpu")
    if sep and int(idx) >= backend.device_count():
        raise EngineConfigError(f"--device {device}: only {backend.device_count()} {kind} device(s) are visible; "
                                f"use --device {kind}:0")
    return device


def resolve_dtype(dtype: Any, device: str) -> str:
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise EngineConfigError(f"--dtype {dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
    return dtype


def resolve_quantization(value: Any, model_dir: str, device: str, check_files: bool = True) -> str:
    """--quantization (None = as stored) against the checkpoint's config.json, its routed experts'
    format (the mxfp4 modes keep them as stored: FP4; `check_files`) and the device's kernels."""
    from dsv4.model.checkpoint import QUANTIZATION_KEY, Checkpoint, CheckpointError
    from dsv4.model.loader import check_mxfp4, resolve_quantization
    from dsv4.model.w8a8 import INT8_MODES, QUANTIZATIONS

    if value is not None and not isinstance(value, str):
        raise EngineConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {value!r}")
    try:
        stored = json.loads((Path(model_dir) / "config.json").read_text()).get(QUANTIZATION_KEY, "none")
        q = resolve_quantization(value, str(stored), model_dir)
        if check_files and q.endswith("mxfp4"):
            check_mxfp4(Checkpoint(model_dir), q)
    except (OSError, ValueError, AttributeError) as e:
        raise EngineConfigError(f"--model {model_dir}: cannot read config.json ({e})") from None
    except CheckpointError as e:
        raise EngineConfigError(str(e)) from None
    if q in INT8_MODES:
        from dsv4.model.kernels import W8A8Error, check_kernel

        try:
            check_kernel(device)
        except W8A8Error as e:
            raise EngineConfigError(str(e)) from None
    return q


def check_profile_dir(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise EngineConfigError(f"--profile must be a directory path, got {path!r}")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise EngineConfigError(f"--profile {p}: not a directory; create it first")
    if not os.access(p, os.W_OK | os.X_OK):
        raise EngineConfigError(f"--profile {p}: directory is not writable")
    return str(p)


def weight_names(model_dir: Path) -> set[str]:
    """Tensor names of a checkpoint, from the index or the safetensors headers only."""
    from dsv4.model.checkpoint import CheckpointError, tensor_names

    try:
        return tensor_names(model_dir)
    except CheckpointError as e:
        raise EngineConfigError(f"--model {model_dir}: {e}") from None


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def machine_memory(device: str) -> int:
    """Bytes of memory of the device the state lives on (CPU: the machine's physical memory)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_memory(device: str) -> int:
    """Bytes of memory free now on the device the state lives on (CPU: MemAvailable, else the
    free pages)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    free = available_memory()
    return free if free is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def parse_memory(value: Any, device: str) -> int:
    """--kv-cache-memory: bytes (an integer, or a number with a unit: 512M, 2GiB) or a fraction
    0 < f <= 1 of `free_memory` now -> bytes."""
    import re

    text = str(value).strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", text)
    if m is None or m.group(2) not in _UNITS:
        raise EngineConfigError(f"--kv-cache-memory must be bytes (e.g. 2GiB, 512M, 1000000) or a fraction of "
                                f"memory (e.g. 0.2), got {value!r}")
    number = float(m.group(1))
    if not m.group(2) and 0 < number <= 1 and "." in m.group(1):
        return int(number * free_memory(device))
    n = int(number * _UNITS[m.group(2)])
    if n < 1:
        raise EngineConfigError(f"--kv-cache-memory must be positive, got {value!r}")
    return n
