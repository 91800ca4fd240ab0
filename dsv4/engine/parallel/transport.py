"""How rank 0's per-step messages (the plan, then the sampled results) reach the other ranks.

Two transports behind `plan.broadcast`: "object" (`torch.distributed.broadcast_object_list`,
pickle through the group; works across hosts) and "shm" (`ShmChannel`, one host only: rank 0
pickles the message into a shared-memory buffer and broadcasts only an int64 header
[sequence number, byte count]; the other ranks copy the bytes out and acknowledge, and rank
0 writes the next message only once every rank acknowledged the previous one). A message
larger than the buffer goes through the group; a header out of sequence or bytes that do
not unpickle raise `TransportError`. The buffer's /dev/shm file is unlinked as soon as
every rank has mapped it. `benchmarks/parallel.py --transports object,shm` measures both
(BENCHMARKS.md). Details: docs/distributed.md, 'dsv4/engine/parallel/transport.py'.
"""

from __future__ import annotations

import mmap
import os
import pickle
import secrets
import struct
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

TRANSPORTS = ("auto", "shm", "object")
DEFAULT_CAPACITY = 1 << 20  # bytes: a plan with about 100K new prompt tokens; larger ones use the group
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


def collective_timeout_s() -> float:
    """How long a rank waits for its peers in one collective (or rank 0 for the others'
    acknowledgement) before it calls the group broken: $DSV4_COLLECTIVE_TIMEOUT seconds,
    60 by default. Rank 0 keeps an idle group inside it (`Ranks` sends keepalives)."""
    raw = os.environ.get("DSV4_COLLECTIVE_TIMEOUT", "60")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"DSV4_COLLECTIVE_TIMEOUT={raw!r}: a number of seconds above 0 (default 60)")
    return value


class TransportError(RuntimeError):
    """A plan message that cannot be delivered or decoded (one line)."""


def _header_device() -> torch.device:
    """Where the header tensor lives: the group's backend decides (NCCL/HCCL need device tensors)."""
    backend = dist.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


class ShmChannel:
    """Rank 0 -> every rank of one host, through a shared buffer; created by every rank at
    once (a collective) after the group is joined."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if SHM_DIR is None:
            raise TransportError("no /dev/shm on this host: use the object transport")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.capacity = capacity
        self.data_at = 8 * self.world  # acks: one int64 per rank (rank 0's unused), then the data
        self.seq = 0
        self.check: Callable[[], None] | None = None  # rank 0: raises when a rank died (`Ranks.check`)
        self.device = _header_device()
        path = None
        try:
            if self.rank == 0:
                path = os.path.join(SHM_DIR, f"dsv4-plan-{os.getpid()}-{secrets.token_hex(6)}")
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.ftruncate(fd, self.data_at + capacity)
            box = [path]
            dist.broadcast_object_list(box, src=0)
            if self.rank != 0:
                fd = os.open(box[0], os.O_RDWR)
            try:
                self.buf = mmap.mmap(fd, self.data_at + capacity)
            finally:
                os.close(fd)
            dist.barrier()  # every rank has mapped it: the name can go
        finally:
            if path is not None:
                os.unlink(path)

    # ------------------------------------------------------------------ one message
    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.rank == 0:
            self.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            return obj
        return self.receive()

    def send(self, data: bytes) -> None:
        """Rank 0: deliver `data` (pickled bytes) as the next message."""
        seq = self.seq + 1
        self._wait_acks(seq - 1)
        n = len(data)
        fits = n <= self.capacity
        if fits:
            self.buf[self.data_at:self.data_at + n] = data
        dist.broadcast(torch.tensor([seq, n if fits else -n], dtype=torch.int64, device=self.device), src=0)
        if not fits:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), src=0)
        self.seq = seq

    def receive(self) -> Any:
        """Another rank: the next message of rank 0."""
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        seq, n = (int(v) for v in header.tolist())
        if seq != self.seq + 1:
            raise TransportError(f"plan message {seq} arrived on rank {self.rank}, {self.seq + 1} was expected")
        if n > self.capacity:
            raise TransportError(f"plan message {seq} claims {n} bytes; the shared buffer holds {self.capacity}")
        if n >= 0:
            data = bytes(self.buf[self.data_at:self.data_at + n])
        else:
            t = torch.empty(-n, dtype=torch.uint8, device=self.device)
            dist.broadcast(t, src=0)
            data = t.cpu().numpy().tobytes()
        struct.pack_into("<q", self.buf, 8 * self.rank, seq)  # read: rank 0 may reuse the buffer
        self.seq = seq
        try:
            return pickle.loads(data)
        except Exception as e:  # noqa: BLE001  (any unpickling failure)
            raise TransportError(f"plan message {seq} ({abs(n)} bytes) on rank {self.rank} does not decode: "
                                 f"{type(e).__name__}: {e}") from None

    def _wait_acks(self, seq: int) -> None:
        """Until every other rank has read message `seq` (at once, nearly always: a step's
        collectives come between two messages); `check` every 0.1 s meanwhile, so a rank
        that died while the others waited fails the step within moments."""
        deadline = checked = None
        spins, wait_s = 0, collective_timeout_s()
        while min(struct.unpack_from(f"<{self.world - 1}q", self.buf, 8)) < seq:
            spins += 1
            if spins <= 100:
                continue
            time.sleep(0.0001)
            now = time.monotonic()
            if deadline is None:
                deadline, checked = now + wait_s, now
            if self.check is not None and now - checked >= 0.1:
                checked = now
                self.check()
            if now > deadline:
                raise TransportError(f"plan message {seq} was not read by every rank within {wait_s:g} s")

    def close(self) -> None:
        self.buf.close()
