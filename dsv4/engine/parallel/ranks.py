"""Ranks 1..T-1 of one host under tensor parallelism, and what they run.

Rank 0 (the daemon, `run --local`, `LLM`) owns the scheduler. `Ranks.start(config)` spawns
the other ranks (`torch.multiprocessing` spawn; rank r on device r, or T CPU processes over
gloo) and joins the group itself. Every step rank 0 broadcasts the plan (`Runner.execute`);
each other rank rebuilds it on shadow requests and runs the same dispatches on its shard
(`plan.follow`), sending nothing but collectives. Joining installs the plan channel
(`plan.use_channel`); leaving closes it, then the group. With auto K only rank 0 chooses.
Several hosts (`--nnodes`, `--node-rank`, ...) and `torchrun` (every process already one
rank; RANK 0 runs the engine, the others `serve_node`) form the same group differently.
Failure: a dead rank makes the next collective fail on the others; rank 0 also checks the
workers' liveness before each step (`check`), and a worker exits when its pipe from rank 0
closes. `close` sends the stop message, then terminates what is left.
Details: docs/distributed.md, 'dsv4/engine/parallel/ranks.py'.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import traceback
from typing import Any

import torch

from dsv4.engine.checks import usable_cpus
from dsv4.engine.errors import EngineFailed
from dsv4.model import parallel
from dsv4.engine.parallel import step_plan as plan

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
START_TIMEOUT_S = 3600.0  # how far apart the ranks may finish a start phase (a shard's load, a compile)


class RankError(EngineFailed):
    """A rank of the tensor-parallel group died or could not start (one line)."""


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r / npu:r for an accelerator, cpu otherwise."""
    kind = device.partition(":")[0]
    return kind if kind == "cpu" else f"{kind}:{rank}"


def gather_weight_bytes(model: torch.nn.Module) -> list[int]:
    """Every rank's resident weight bytes, in rank order (a collective: all ranks call it once after loading)."""
    parallel.meet(START_TIMEOUT_S)  # the ranks finish loading minutes apart on a big model
    tensors = list(model.state_dict().values())
    extra = (getattr(model, "draft_head", None) or {}).values()  # the MTP's own head (int8 copy, draft vocabulary)
    mine = sum(t.numel() * t.element_size() for t in [*tensors, *extra])
    dev = tensors[0].device
    return [int(b) for b in parallel.all_gather(torch.tensor([mine], dtype=torch.float64, device=dev)).tolist()]


def _exit_when_closed(pipe: Any) -> None:
    """Block on the pipe from rank 0; when it closes (rank 0 gone), leave at once."""
    try:
        pipe.recv()
    except (EOFError, OSError):
        pass
    os._exit(3)


def _local_device(config: Any, rank: int) -> str:
    """Rank `rank`'s device on its host (device index = its place among the host's ranks,
    LOCAL_RANK under torchrun); made current, or on CPU the host's cores shared among its ranks."""
    launch = config.launch
    per_host = config.ranks_per_host
    dev = rank_device(config.device, rank % per_host if launch is None else launch.local_rank)
    if dev != "cpu":
        getattr(torch, dev.partition(":")[0]).set_device(dev)
    else:  # the CPUs this process may use (a replica's share, a taskset), not the machine's
        torch.set_num_threads(max(1, usable_cpus() // per_host))
    return dev


def _join(rank: int, config: Any, addr: str, port: int, dev: str, listener: socket.socket | None = None) -> None:
    agent = config.launch is not None and config.launch.agent_store  # torchrun's agent serves the store
    from dsv4.engine.parallel.transport import collective_timeout_s

    parallel.init(rank, config.tensor_parallel_size, addr, port, backend=BACKENDS[dev.partition(":")[0]],
                  timeout_s=collective_timeout_s(), rendezvous_s=config.rendezvous_timeout,
                  serve_store=False if agent else None, listener=listener)
    if config.plan_transport == "shm":  # resolved: "shm" on one host, else "object"
        from dsv4.engine.parallel.transport import ShmChannel

        plan.use_channel(ShmChannel())


def _leave() -> None:
    """Close the plan channel, then leave the group."""
    plan.close_channel()
    parallel.close()


def _follow_rank(rank: int, config: Any, dev: str) -> None:
    """Load rank `rank`'s shard (the group joined) and run rank 0's steps until it stops."""
    from dsv4.model.loader import load_model
    from dsv4.engine.spec.calibration import calibrate
    from dsv4.engine.runner import Runner
    from dsv4.engine.spec.policy import SpecPolicy

    model = load_model(config.model, device=dev, dtype=config.torch_dtype, quantization=config.quantization,
                       rank=rank, world=config.tensor_parallel_size, draft_vocab=config.draft_vocab_ids)
    gather_weight_bytes(model)
    # auto K: a policy of its own only so that this runner takes the same code paths as rank 0's
    # (fewer drafts than a row's tokens; the calibration's dispatches, collectives included);
    # its choices are never used: every plan carries rank 0's K
    policy = SpecPolicy(config.num_speculative_tokens) if config.speculative_auto else None
    agree_pool(config)
    runner = Runner.for_config(model, config, torch.device(dev), policy, scratch_slot=bool(config.compile))
    if config.compile:  # as rank 0 does, at the same point: a capture runs collectives
        from dsv4.engine.compile.start import start_compiled

        start_compiled(runner, config)
        parallel.meet(START_TIMEOUT_S)  # with rank 0's, after its compile
    if policy is not None:
        parallel.meet(START_TIMEOUT_S)  # rank 0 looks its calibration up first (cost_cache.calibrated)
        if not parallel.broadcast_object(None):  # rank 0 found none cached
            calibrate(runner)  # the dispatches only: rank 0 samples
    parallel.meet(START_TIMEOUT_S)  # with rank 0's start_keepalive, once its engine is built
    plan.follow(runner)


def agree_pool(config: Any) -> None:
    """Every rank sizes its block pool as rank 0 did: a --kv-cache-memory fraction is resolved
    by each process against its own free memory, and rank 0 hands out the block ids. A
    collective: rank 0 and every follower call it at the same point, before their runner."""
    if parallel.world_size() > 1:
        blocks = parallel.broadcast_object(config.kv_cache_blocks if parallel.rank() == 0 else None)
        object.__setattr__(config, "kv_cache_blocks", blocks)  # frozen: rank 0's value, resolved


def worker_main(rank: int, config: Any, addr: str, port: int, pipe: Any) -> None:
    """Entry point of a spawned rank: join the group, load its shard, follow rank 0."""
    threading.Thread(target=_exit_when_closed, args=(pipe,), daemon=True).start()
    try:
        dev = _local_device(config, rank)
        _join(rank, config, addr, port, dev)
        _follow_rank(rank, config, dev)
        _leave()
    except BaseException:
        if os.environ.get("DSV4_DEBUG"):
            traceback.print_exc()
        os._exit(1)
    os._exit(0)


def serve_node(config: Any) -> int:
    """`dsv4 serve --node-rank R` (R > 0), or any command's RANK > 0 under torchrun: this
    host's ranks join rank 0's group and run its steps until rank 0 stops (exit 0) or the
    group fails (`RankError`). Binds no socket."""
    ranks = Ranks(config)
    try:
        _follow_rank(ranks.first, config, ranks.device)
    except Exception as e:
        raise ranks.failure(e) from None
    finally:
        ranks.close()
    return 0


class Ranks:
    """A host's handle on its other ranks: this process is the host's first rank (rank 0
    on node 0) and spawns the rest (`--nnodes` hosts run T / nnodes ranks each). Under
    torchrun this process is rank RANK and spawns nothing (torchrun started the others)."""

    def __init__(self, config: Any):
        T, N, launch = config.tensor_parallel_size, config.nnodes, config.launch
        self.lock = threading.Lock()  # held by whoever sends through the group: a step, a keepalive, close
        self._stopping = threading.Event()
        self._keepalive: threading.Thread | None = None
        self._keepalive_error: BaseException | None = None
        per_host = T // N if launch is None else 1  # the ranks this process starts, itself included
        self.first = config.node_rank * per_host if launch is None else launch.rank
        addr = config.master_addr or "127.0.0.1" if launch is None else launch.master_addr
        port = config.master_port or 0 if launch is None else launch.master_port
        listener = None  # rank 0's store socket, bound before any rank is told the port (no re-bind race)
        if launch is None and self.first == 0:
            try:
                listener = parallel.listen(addr, port)
            except OSError as e:
                where = (f"--master-addr {addr} --master-port {port}" if N > 1 or config.master_addr
                         or config.master_port else f"--tensor-parallel-size {T}")
                raise RankError(f"{where}: rank 0 cannot listen for the other ranks at {addr}:{port} "
                                f"({e.strerror or e})") from None
            port = listener.getsockname()[1]
        self.store = (addr, port)  # where the ranks meet (rank 0 stops listening there once all joined, on gloo)
        ctx = mp.get_context("spawn")
        self.procs, self.pipes = [], []
        for r in range(self.first + 1, self.first + per_host):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(r, config, addr, port, child), daemon=True,
                            name=f"dsv4-rank{r}")
            p.start()
            child.close()
            self.procs.append(p)
            self.pipes.append(parent)
        self.device = _local_device(config, self.first)
        try:
            _join(self.first, config, addr, port, self.device, listener)
        except Exception as e:
            self.close()
            if launch is not None:
                raise RankError(f"torchrun: RANK {self.first} of WORLD_SIZE {T} could not join the group at "
                                f"MASTER_ADDR {addr} MASTER_PORT {port} within {config.rendezvous_timeout:g} s "
                                f"({type(e).__name__})") from None
            if self.first > 0:
                raise RankError(f"--nnodes {N}: rank 0 did not answer at --master-addr {addr} --master-port {port} "
                                f"within {config.rendezvous_timeout:g} s ({type(e).__name__})") from None
            raise RankError(f"--tensor-parallel-size {T}: the other ranks did not join within "
                            f"{config.rendezvous_timeout:g} s ({type(e).__name__})") from None
        if plan.channel() is not None and self.procs:  # waiting for a dead rank's ack fails at once
            plan.channel().check = self.check

    def start_keepalive(self) -> None:
        """Rank 0, once started (met by the other ranks, who then wait for plans): while no step goes out for a quarter of the collective
        timeout, send the other ranks a keepalive, so an idle engine's ranks never time out
        waiting for its next plan (a frozen rank 0 still fails them within the timeout).
        Steps hold `lock`; a keepalive that fails is raised by the next `check`."""
        if self.first != 0 or self._keepalive is not None:
            return
        from dsv4.engine.parallel.transport import collective_timeout_s

        parallel.meet(START_TIMEOUT_S)  # the others wait for the end of rank 0's start here, then for plans

        every = collective_timeout_s() / 4
        self._keepalive = threading.Thread(target=self._keep_alive, args=(every,), name="dsv4-keepalive",
                                           daemon=True)
        self._keepalive.start()

    def _keep_alive(self, every: float) -> None:
        while not self._stopping.wait(min(every, max(0.05, every - plan.idle_s()))):
            with self.lock:
                if self._stopping.is_set() or plan.idle_s() < every:
                    continue
                try:
                    plan.broadcast(plan.KEEPALIVE)
                except BaseException as e:  # noqa: BLE001  (the group is broken: the next step says so)
                    self._keepalive_error = e
                    return

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        """Raise `RankError` if a worker has exited, or a keepalive found the group broken."""
        for r, p in enumerate(self.procs, start=self.first + 1):
            if not p.is_alive():
                raise RankError(f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}")
        if self._keepalive_error is not None:
            raise self.failure(self._keepalive_error)

    def failure(self, e: BaseException, during: str = "step") -> RankError:
        """The one-line error for a step (or the `during` "start") that raised `e`: the rank
        that died (waiting up to 2 s for its sentinel), or the collective's own first line."""
        from multiprocessing.connection import wait

        ready = set(wait([p.sentinel for p in self.procs], timeout=2.0))
        for r, p in enumerate(self.procs, start=self.first + 1):
            # the sentinel (its pipe) closes a moment before the process can be reaped
            if p.sentinel in ready or not p.is_alive():
                p.join(5)
                return RankError(f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}")
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return RankError(f"tensor-parallel {during} failed: {type(e).__name__}: {line}")

    def close(self) -> None:
        """Stop the workers: the stop message while all live, then terminate, then kill."""
        self._stopping.set()
        if self._keepalive is not None:
            self._keepalive.join()
        try:
            if parallel.world_size() > 1 and parallel.rank() == 0 and all(p.is_alive() for p in self.procs):
                with self.lock:
                    plan.broadcast(None)
        except Exception:  # noqa: BLE001  (a peer died meanwhile)
            pass
        for p in self.procs:
            p.join(10)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for pipe in self.pipes:
            pipe.close()
        try:
            _leave()
        except Exception:  # noqa: BLE001
            pass
