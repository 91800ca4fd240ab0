"""Tensor and expert parallelism: the process group and every collective the model runs
(one grep for `parallel.` finds them all). Which slice each rank holds is `sharding.py`;
the engine's per-step messages between ranks are `dsv4/engine/parallel/step_plan.py`.

The collectives of DeepSeek's reference layout (docs/distributed-layout.md): `all_reduce`
(fp32 sum: after `wo_b`, after the MoE, of the indexer's scores, of the embedding),
`all_reduce_max` (int8 token and row amax), `all_gather` (the head's logits) and
`broadcast_object` (rank 0's object on every rank). At world size 1 every collective
returns its input unchanged; per-request state is replicated on every rank.

The rendezvous store (rank 0's `TCPStore`, unauthenticated) listens on the master address
only, on a socket bound before the store takes it; on gloo it is closed once every rank has
joined, on NCCL and HCCL it stays up until `close`. Details: docs/distributed.md,
'dsv4/model/parallel.py'.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist

_GROUP: dist.ProcessGroup | None = None
_SERVER: dist.TCPStore | None = None  # rank 0's store server, kept only where the backend needs it after init
STATS: dict[str, list] = {}  # collective -> [calls, seconds] on this rank (benchmarks/parallel.py)


def count(name: str, t0: float) -> None:
    """Add one call of `name` that started at perf_counter() `t0` to `STATS`."""
    c = STATS.setdefault(name, [0, 0.0])
    c[0] += 1
    c[1] += time.perf_counter() - t0


# ------------------------------------------------------------------ the group
def listen(addr: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `addr`:`port` and nowhere else (port 0: one the kernel picks),
    for rank 0's store: `init` hands its descriptor over, so the port stays bound from the
    moment it is chosen. `OSError` when `addr` is not an address of this host or the port is taken."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed --master-port reusable at once
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(sockaddr)
        s.listen(128)
    except BaseException:
        s.close()
        raise
    return s


def init(rank: int, world: int, master_addr: str, master_port: int, *, backend: str = "gloo",
         timeout_s: float = 60.0, rendezvous_s: float | None = None, serve_store: bool | None = None,
         listener: socket.socket | None = None) -> None:
    """Join the group of `world` ranks rendezvousing at master_addr:master_port (TCP store,
    served by rank 0, or by torchrun's agent: `serve_store` False on every rank).
    The serving rank's store listens on `listener` (from `listen`; taken over) or else on
    a socket `listen(master_addr, master_port)` binds here. `rendezvous_s` (default
    `timeout_s`) bounds the wait for the others; `timeout_s` bounds every collective (a
    dead peer cannot hang a rank)."""
    global _GROUP, _SERVER
    timeout = datetime.timedelta(seconds=timeout_s)
    wait = rendezvous_s if rendezvous_s is not None else timeout_s
    meet = datetime.timedelta(seconds=wait)
    is_master = rank == 0 if serve_store is None else serve_store
    server = None
    if is_master:
        sock = listener if listener is not None else listen(master_addr, master_port)
        master_port = sock.getsockname()[1]
        server = dist.TCPStore(master_addr, master_port, world, is_master=True, timeout=meet,
                               wait_for_workers=False, master_listen_fd=sock.detach())
    else:
        _wait_for_master(master_addr, master_port, wait)
    # a client of its own even on the serving rank: the group keeps this one, and the server can go
    store = dist.TCPStore(master_addr, master_port, world, is_master=False, timeout=meet)
    # forming the group (gloo's full mesh of connections, read from the store) may take as
    # long as the rendezvous on a loaded machine; the collectives get `timeout` once it stands
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # private in torch 2.13
    forming = max(timeout, meet) if set_timeout is not None else timeout
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=forming)
    _GROUP = dist.group.WORLD
    if backend == "gloo":
        dist.barrier()  # every rank is through the rendezvous: nobody reads the store again
        server = None  # the listener closes with it
    if forming != timeout:
        set_timeout(timeout)
    _SERVER = server


def _wait_for_master(addr: str, port: int, timeout_s: float) -> None:
    """Until rank 0's store accepts a connection; `TimeoutError` after `timeout_s` (checked
    here, so an absent master is one clean error rather than c10d's retry log)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens at {addr}:{port}") from None
            time.sleep(0.2)


def close() -> None:
    """Leave the group (a no-op when none was joined)."""
    global _GROUP, _SERVER
    if _GROUP is not None:
        dist.destroy_process_group()
        _GROUP = None
    _SERVER = None


def meet(timeout_s: float) -> None:
    """Wait until every rank reaches this point, for up to `timeout_s` (rather than the
    group's collective timeout): the start's phases (loading a shard, building compiled
    steps) may take the ranks minutes apart. On gloo every rank sends rank 0 a word and
    waits for its answer, each wait bounded by `timeout_s` (`monitored_barrier` bounds only
    rank 0's: its other ranks' sends fail after the group's timeout when rank 0 is late).
    Other backends wait as long as their group timeout (`dist.barrier`)."""
    if _GROUP is None:
        return
    if dist.get_backend() != "gloo":
        dist.barrier()
        return
    limit, word = datetime.timedelta(seconds=timeout_s), torch.zeros(1)
    peers = range(1, world_size()) if rank() == 0 else [0]
    # rank 0 hears every other rank, then answers them all; the others speak, then listen
    for op in (dist.irecv, dist.isend) if rank() == 0 else (dist.isend, dist.irecv):
        works = [op(word.clone(), p) for p in peers]
        for w in works:
            w.wait(limit)


def world_size() -> int:
    return dist.get_world_size() if _GROUP is not None else 1


def rank() -> int:
    return dist.get_rank() if _GROUP is not None else 0


# ------------------------------------------------------------------ the collectives
# Inside a compiled step (torch.compiler.is_compiling()) they are traced as functional
# collectives, and the gather as a sum of zero-padded slices: inductor's C++ wrapper has
# C shims for all_reduce only (torch 2.13: "arg type Any is not yet supported by
# custom_op_wrapper" for all_gather_into_tensor). Adding zeros is exact, so it gives the
# eager gather's values (a -0 becomes +0). No timing counters there: a graph has no clock.
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, reduced in float32 (gloo has no bf16 sum), in x's dtype."""
    if _GROUP is None:
        return x
    if torch.compiler.is_compiling():
        return _traced_reduce(x.float(), "sum").to(x.dtype)
    t0 = time.perf_counter()
    y = x.float() if x.dtype != torch.float32 else x.contiguous()
    dist.all_reduce(y)
    count("all_reduce", t0)
    return y.to(x.dtype)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of x over the ranks (float32): the token amax of a row-parallel
    int8 linear's input, and a row-parallel weight's row amax when quantised at load."""
    if _GROUP is None:
        return x
    if torch.compiler.is_compiling():
        return _traced_reduce(x.float(), "max")
    t0 = time.perf_counter()
    y = x.float().contiguous()
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    count("all_reduce_max", t0)
    return y


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """The ranks' x [..., n] concatenated along the last dim, in rank order: [..., T * n]."""
    if _GROUP is None:
        return x
    if torch.compiler.is_compiling():
        n, T = x.shape[-1], world_size()
        padded = x.new_zeros(*x.shape[:-1], T * n)
        padded[..., rank() * n:(rank() + 1) * n] = x
        return _traced_reduce(padded, "sum")
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    count("all_gather", t0)
    return torch.cat(parts, dim=-1)


def _traced_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    """A functional all-reduce (what a compiled graph can hold)."""
    from torch.distributed import _functional_collectives as fc

    return fc.wait_tensor(fc.all_reduce(x.contiguous(), op, _GROUP))


def broadcast_object(obj: object = None) -> object:
    """Rank 0's `obj` on every rank, pickled through the group (`broadcast_object_list`)."""
    if _GROUP is None:
        return obj
    t0 = time.perf_counter()
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    count("broadcast_object", t0)
    return box[0]
