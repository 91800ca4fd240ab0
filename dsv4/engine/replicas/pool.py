"""`serve --data-parallel-size N`: N engine replicas behind the one daemon, as one `ServedEngine`.

    pool = EnginePool(config)              # spawns N replica processes (worker.py), waits until all loaded
    pool.add_request(ids, params, ...)     # routed (router.py): longest prefix held, else least loaded
    outs = pool.step()                     # what the replicas streamed meanwhile (waits up to STEP_WAIT_S)

The daemon's loop drives the pool as it drives one engine, but the replicas step on their own,
each a process pinned to its share of the cores (NUMA node by node), so N steps run at once.
The daemon's side tokenizes (`RequestFront`) and refuses what no replica could run, so a bad
request is still refused before it is queued.

Faults: a replica that dies, or stays silent for DSV4_REPLICA_TIMEOUT seconds (default 60; a
live one beats every 0.5 s, even idle) while the pool waits on it, is killed; its requests that
have streamed nothing yet go to another replica (nothing is lost), the others finish with
finish_reason "error" and a line naming the replica; it is started again, at most MAX_RESTARTS
times. `status()` lists every replica: pid, cores, state, restarts, load, prefix hits, routing.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from typing import Any

from dsv4.engine.config import EngineConfig
from dsv4.engine.front import RequestFront
from dsv4.engine.metrics import EngineMetrics, RequestMetrics
from dsv4.engine.replicas.router import PIECE_TOKENS, Router
from dsv4.engine.replicas.worker import replica_main
from dsv4.engine.errors import RequestBusy
from dsv4.engine.request import FINISH_ERROR, RequestError, RequestOutput
from dsv4.engine.scheduler import check_prompt

log = logging.getLogger("dsv4.replicas")

STEP_WAIT_S = 0.02  # the longest `step()` waits for a replica's output
MAX_RESTARTS = 3  # per replica
SUM_KEYS = ("running", "waiting", "preemptions", "blocks", "free_blocks", "cached_blocks", "prefix_cache_queries",
            "prefix_cache_hits", "state_bytes")


class ReplicaError(RuntimeError):
    """The replicas could not start (one line)."""


def replica_timeout_s() -> float:
    """$DSV4_REPLICA_TIMEOUT: seconds of silence after which a replica counts as frozen."""
    text = os.environ.get("DSV4_REPLICA_TIMEOUT", "").strip()
    return float(text) if text else 60.0


def cores_of(n: int) -> list[list[int]]:
    """This process's CPUs in `n` disjoint groups, NUMA node by node (a group stays on one node
    when the nodes divide evenly), in order."""
    mine = set(os.sched_getaffinity(0))
    ordered: list[int] = []
    nodes = sorted(p for p in os.listdir("/sys/devices/system/node") if p.startswith("node")) \
        if os.path.isdir("/sys/devices/system/node") else []
    for node in nodes:
        try:
            with open(f"/sys/devices/system/node/{node}/cpulist") as f:
                ordered += [c for c in _cpulist(f.read()) if c in mine and c not in ordered]
        except OSError:
            continue
    ordered += sorted(mine - set(ordered))
    per = len(ordered) // n
    return [ordered[i * per:(i + 1) * per] for i in range(n)]


def _cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


@dataclass
class _Replica:
    index: int
    cores: list[int]
    proc: Any = None
    conn: Any = None
    state: str = "starting"  # starting, serving, dead (restarts used up), stopped
    restarts: int = 0
    heard: float = 0.0  # when it last spoke (time.monotonic)
    requests: set[str] = field(default_factory=set)
    status: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why it last died


@dataclass
class _Sent:
    replica: int
    add: tuple  # the message that queued it, kept to send it elsewhere if its replica dies
    streamed: bool = False


class _Spec:
    """A structured request's grammar spec, compiled by the replica it goes to."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec


class EnginePool(RequestFront):
    """N replicas of the engine `config` describes (config.data_parallel_size)."""

    ranks = None  # no tensor-parallel ranks (each replica is one process)
    policy = None  # auto K is each replica's own
    compile_note = ""

    def __init__(self, config: EngineConfig, *, progress: Any = None) -> None:
        self._init_front(config)
        self.started = time.time()
        n = config.data_parallel_size
        self.timeout_s = replica_timeout_s()
        self._ctx = mp.get_context("spawn")
        self.replicas = [_Replica(i, cores) for i, cores in enumerate(cores_of(n))]
        positions = config.kv_cache_blocks * config.block_size
        root = hashlib.blake2b(f"{config.model}|{config.dtype}|{config.quantization}".encode(), digest_size=16)
        try:
            self.router = Router(n, [positions // PIECE_TOKENS] * n, root.digest(), slack=config.max_num_seqs,
                                 mode=os.environ.get("DSV4_ROUTING", "prefix").strip() or "prefix")
        except ValueError as e:
            raise ReplicaError(f"DSV4_ROUTING: {e}") from None
        self.sent: dict[str, _Sent] = {}
        self.metrics = EngineMetrics()  # over the requests the replicas finished, as they stream
        self._done: list[RequestOutput] = []  # outputs made here (failures), given by the next step
        self._up = False  # every replica started once: from then on a lost one starts again
        for r in self.replicas:
            self._spawn(r)
        try:
            self._await_start()
        except BaseException:
            self.close()
            raise
        self._up = True
        first = self.replicas[0].facts
        self.weight_bytes = first["weight_bytes"]
        self.rank_weight_bytes = [self.weight_bytes]
        self.quant_note = first["quant_note"]
        self.calibration_note = first["calibration_note"]

    # ------------------------------------------------------------------ replicas
    def _config_of(self, r: _Replica) -> EngineConfig:
        """Replica r's engine: one of them, its own seed (unseeded sampling differs between replicas)."""
        return replace(self.config, data_parallel_size=1, seed=self.config.seed + r.index)

    def _spawn(self, r: _Replica) -> None:
        ours, theirs = self._ctx.Pipe()
        r.proc = self._ctx.Process(target=replica_main, args=(r.index, self._config_of(r), r.cores, theirs),
                                   name=f"dsv4-replica-{r.index}")  # not daemonic: it may spawn its ranks
        r.proc.start()
        theirs.close()
        r.conn, r.state, r.heard, r.status = ours, "starting", time.monotonic(), {}

    def _await_start(self) -> None:
        """Until every replica has loaded; the first that fails fails the start."""
        while any(r.state == "starting" for r in self.replicas):
            self._pump(1.0)
            for r in self.replicas:
                if r.state != "serving" and r.state != "starting":
                    raise ReplicaError(f"--data-parallel-size {len(self.replicas)}: engine replica {r.index} "
                                       f"could not start: {r.error}")

    def _pump(self, timeout: float) -> None:
        """Take what the replicas sent (waiting up to `timeout`), notice deaths and silences."""
        live = [r for r in self.replicas if r.state in ("starting", "serving")]
        waits = {r.conn: r for r in live} | {r.proc.sentinel: r for r in live}
        for ready in wait(list(waits), timeout) if waits else []:
            r = waits[ready]
            if r.state in ("starting", "serving"):
                self._drain(r)
        now = time.monotonic()
        for r in live:
            if r.state == "serving" and now - r.heard > self.timeout_s:
                r.proc.kill()
                r.proc.join(5)
                self._lost(r, f"stopped answering for {now - r.heard:.0f} s (DSV4_REPLICA_TIMEOUT) and was killed")

    def _drain(self, r: _Replica) -> None:
        try:
            while r.conn.poll():
                self._take(r, r.conn.recv())
        except (EOFError, OSError):
            r.proc.join(5)
            self._lost(r, r.error or f"exited with code {r.proc.exitcode}")

    def _take(self, r: _Replica, msg: tuple) -> None:
        r.heard = time.monotonic()
        kind = msg[0]
        if kind == "out":
            _, outs, status = msg
            if status is not None:
                r.status = status
            for out in outs:
                sent = self.sent.get(out.request_id)
                if sent is None or sent.replica != r.index:
                    continue  # aborted meanwhile
                sent.streamed = sent.streamed or bool(out.token_ids or out.text)
                self.metrics.on_output(0, len(out.token_ids), r.heard)
                if out.finished:
                    self.sent.pop(out.request_id)
                    r.requests.discard(out.request_id)
                    if out.metrics is not None:  # finished in its engine (not failed here)
                        m = RequestMetrics.from_dict(out.metrics, r.heard)
                        self.metrics.add(m, streamed=True)
                        self.metrics.prompt_tokens += m.prompt_tokens
                self._done.append(out)
        elif kind == "ready":
            r.state, r.facts = "serving", msg[1]
            log.info("engine replica %d serving (pid %d, cores %s)", r.index, r.proc.pid, _span(r.cores))
        elif kind in ("failed", "crashed"):
            r.error = msg[1]

    def _lost(self, r: _Replica, why: str) -> None:
        """Replica r is gone: its requests go elsewhere or fail; it starts again if it may."""
        if r.state not in ("starting", "serving"):
            return
        r.error, r.state = why, "dead"
        r.conn.close()
        self.router.forget(r.index)
        pid = r.proc.pid
        log.error("engine replica %d (pid %d) %s", r.index, pid, why)
        orphans = sorted(r.requests)
        r.requests.clear()
        if self._up and r.restarts < MAX_RESTARTS:
            r.restarts += 1
            log.info("starting engine replica %d again (restart %d of %d)", r.index, r.restarts, MAX_RESTARTS)
            self._spawn(r)
        for rid in orphans:
            sent = self.sent.pop(rid)
            if not sent.streamed and self._loads() != [None] * len(self.replicas):
                self._send(rid, sent.add)  # nothing streamed yet: another replica runs it from the start
            else:
                self._done.append(RequestOutput(rid, finished=True, finish_reason=FINISH_ERROR, error=(
                    f"engine replica {r.index} (pid {pid}) {why}; this request failed with it, the other "
                    f"replicas go on serving")))

    def _loads(self) -> list[int | None]:
        return [len(r.requests) if r.state == "serving" else None for r in self.replicas]

    def _send(self, rid: str, add: tuple, follows: str | None = None) -> None:
        """Route one request (`add`: its message to a replica) and send it."""
        _, _, ids, params, _, _ = add
        leader = self.sent.get(follows) if follows else None
        loads = self._loads()
        if leader is not None and loads[leader.replica] is not None:
            i = leader.replica  # a sibling sample: where its prompt is being prefilled
        else:
            i = self.router.route(ids, params.cache_salt, loads)[0]
        r = self.replicas[i]
        self.sent[rid] = _Sent(i, add)
        r.requests.add(rid)
        try:
            r.conn.send(add)
        except (OSError, ValueError):
            pass  # it died: the next pump finds out and routes the request again

    # ------------------------------------------------------------------ ServedEngine
    def submit_grammar(self, spec: dict[str, Any]) -> Future:
        """The spec itself: the replica the request goes to compiles it, off every loop."""
        fut: Future = Future()
        fut.set_result(_Spec(spec))
        return fut

    def add_request(self, prompt: str | list[int], params: Any = None, *, request_id: str | None = None,
                    prompt_mode: str = "auto", system: str | None = None, thinking: bool = False,
                    client: Any = None, tools: list[Any] | None = None, grammar: Any = None,
                    follows: str | None = None) -> str:
        """Check and route one request (raises `RequestError` for this request alone)."""
        params = params or replace(self.default_params)
        ids = self.prompt_ids(prompt, params, prompt_mode=prompt_mode, system=system, thinking=thinking, tools=tools)
        rid = str(request_id) if request_id is not None else f"req-{len(self.sent)}-{time.monotonic_ns()}"
        check_prompt(ids, params, self.config.model_config.vocab_size, self.config.max_model_len,
                     self.config.kv_cache_blocks * self.config.block_size)
        if all(n is None for n in self._loads()):
            if any(r.state == "starting" for r in self.replicas):
                raise RequestBusy("no engine replica is serving: they are starting again; try again shortly")
            raise RequestError("every engine replica failed and used up its restarts ('dsv4 status' says why); "
                               "restart the daemon")
        spec = grammar.spec if isinstance(grammar, _Spec) else params.structured
        self._send(rid, ("add", rid, ids, params, {"client": client}, spec), follows)
        return rid

    def abort(self, request_id: str) -> bool:
        sent = self.sent.pop(str(request_id), None)
        if sent is None:
            return False
        r = self.replicas[sent.replica]
        r.requests.discard(str(request_id))
        try:
            r.conn.send(("abort", str(request_id)))
        except (OSError, ValueError):
            pass
        return True

    def has_unfinished(self) -> bool:
        return bool(self.sent or self._done)

    def step(self) -> list[RequestOutput]:
        self._pump(0.0 if self._done else STEP_WAIT_S)
        outs, self._done = self._done, []
        return outs

    def build_in_background(self) -> str:
        return ""  # each replica loads the compiled buckets cached; none builds more

    def poll_compiled(self) -> None:
        """While the daemon idles: take the replicas' beats, notice deaths, restarts."""
        self._pump(0.0)

    def status(self) -> dict[str, Any]:
        serving = [r for r in self.replicas if r.status]
        out = dict(serving[0].status) if serving else {}
        for k in SUM_KEYS:
            out[k] = sum(r.status.get(k) or 0 for r in serving)
        q, h = out.get("prefix_cache_queries", 0), out.get("prefix_cache_hits", 0)
        out["prefix_cache_hit_rate"] = h / q if q else 0.0
        out["totals"] = self._totals(serving)
        out["uptime_s"] = time.time() - self.started
        out["data_parallel_size"] = len(self.replicas)
        out["routing"] = dict(self.router.decisions)
        out["replicas"] = [{
            "index": r.index, "pid": r.proc.pid if r.proc is not None else None, "cores": r.cores,
            "state": r.state, "restarts": r.restarts, "error": r.error or None, "in_flight": len(r.requests),
            "running": r.status.get("running", 0), "waiting": r.status.get("waiting", 0),
            "prefix_cache_queries": r.status.get("prefix_cache_queries", 0),
            "prefix_cache_hits": r.status.get("prefix_cache_hits", 0),
            "prefix_cache_hit_rate": r.status.get("prefix_cache_hit_rate", 0.0),
            "routed": dict(self.router.per_replica[r.index]),
            "output_tokens": ((r.status.get("totals") or {}).get("usage") or {}).get("completion_tokens", 0),
        } for r in self.replicas]
        return out

    def _totals(self, serving: list[_Replica]) -> dict[str, Any]:
        """The totals over every request the pool saw finish; steps from the replicas' own
        counts (since each last started), busy time the busiest one's (they step at once)."""
        totals = [r.status.get("totals") or {} for r in serving]
        m = self.metrics
        m.busy_s = max(((t.get("throughput") or {}).get("busy_s") or 0.0 for t in totals), default=0.0)
        steps = [t.get("steps") or {} for t in totals]
        m.num_steps = sum(s.get("count", 0) for s in steps)
        m.num_prefill_tokens = sum(s.get("prefill_tokens", 0) for s in steps)
        m.num_decode_tokens = sum(s.get("decode_tokens", 0) for s in steps)
        return m.to_dict()

    def close(self) -> None:
        """Stop every replica: the stop message, then terminate, then kill."""
        for r in self.replicas:
            if r.state in ("starting", "serving"):
                try:
                    r.conn.send(("stop",))
                except (OSError, ValueError):
                    pass
            r.state = "stopped"
        for r in self.replicas:
            if r.proc is None:
                continue
            r.proc.join(10)
            if r.proc.is_alive():
                r.proc.terminate()
                r.proc.join(5)
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join()


def _span(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)) \
        else ",".join(map(str, cores))
