"""`serve --data-parallel-size N`: N engine replicas behind the one daemon, as one `ServedEngine`.

    pool = EnginePool(config, key)         # spawns the replicas (worker.py), waits until all loaded
    pool.add_request(ids, params, ...)     # routed (router.py): longest prefix held, else least loaded
    outs = pool.step()                     # what the replicas streamed meanwhile (waits up to STEP_WAIT_S)

The daemon's loop drives the pool as it drives one engine, but the replicas step on their own,
each a process pinned to its share of the cores (cores.py), so N steps run at once. The
daemon's side tokenizes (`RequestFront`) and refuses what no replica could run, so a bad
request is still refused before it is queued. Nothing the pool sends waits for a replica:
each has a sender thread (and reads its pipe on a thread of its own), so a replica busy in a
long step, or frozen, never holds up the daemon or the others.

Faults: a replica that dies, or whose beats stop for DSV4_REPLICA_TIMEOUT seconds (default 60;
a live one beats every 0.5 s, also during a long step), is killed and started again, at most
MAX_RESTARTS times. Killed or frozen: its requests that have streamed nothing run on another
replica (once); crashed (a step raised): its requests fail, as one engine's would. A request
that fails finishes with finish_reason "error" and a line naming the replica. With no replica
left, `step()` raises `ReplicaError` and the daemon exits non-zero. Replicas of other hosts
(--data-parallel-address, remote.py) join at the pool's desk instead of being spawned; one
that is lost is not restarted from here: its place waits until it joins again.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import time
from concurrent.futures import Future
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any

from dsv4.engine.config import EngineConfig
from dsv4.engine.errors import EngineFailed, RequestBusy
from dsv4.engine.front import RequestFront
from dsv4.engine.metrics import EngineMetrics, RequestMetrics
from dsv4.engine.replicas.cores import cores_of, span
from dsv4.engine.replicas.remote import JoinDesk, differs, identity
from dsv4.engine.replicas.router import PIECE_TOKENS, Router
from dsv4.engine.replicas.slot import Replica, Sent, Unreadable
from dsv4.engine.replicas.worker import replica_config, replica_main
from dsv4.engine.request import FINISH_ERROR, RequestOutput
from dsv4.engine.scheduler import check_prompt

log = logging.getLogger("dsv4.replicas")

STEP_WAIT_S = 0.02  # the longest `step()` waits for a replica's output
MAX_RESTARTS = 3  # per replica
STOP_WAIT_S = 10.0  # how long `close` lets the replicas stop before terminating them
SUM_KEYS = ("running", "waiting", "preemptions", "blocks", "free_blocks", "cached_blocks", "prefix_cache_queries",
            "prefix_cache_hits")


class ReplicaError(EngineFailed):
    """The replicas could not start, or none is left (one line)."""


def replica_timeout_s() -> float:
    """$DSV4_REPLICA_TIMEOUT: seconds without a beat after which a replica counts as frozen."""
    text = os.environ.get("DSV4_REPLICA_TIMEOUT", "").strip()
    return float(text) if text else 60.0


class _Spec:
    """A structured request's grammar spec, compiled by the replica it goes to."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec


class EnginePool(RequestFront):
    """N replicas of the engine `config` describes (config.data_parallel_size)."""

    ranks = None  # no tensor-parallel ranks of its own (a replica may have some)

    def __init__(self, config: EngineConfig, key: str | None = None) -> None:
        self._init_front(config)
        self.started = time.time()
        n, here = config.data_parallel_size, config.replicas_here
        self.timeout_s = replica_timeout_s()
        self._ctx = mp.get_context("spawn")
        self.replicas = [Replica(i, cores) for i, cores in enumerate(cores_of(here))]
        self.replicas += [Replica(i, [], remote=True, state="away") for i in range(here, n)]
        self.desk: JoinDesk | None = None
        if here < n:  # the others join from their hosts: listen before anything loads
            try:
                self.desk = JoinDesk(config.data_parallel_address, config.data_parallel_rpc_port, key or "")
            except OSError as e:
                raise ReplicaError(str(e)) from None
            self.identity = identity(config)
            log.info("waiting for engine replicas %s to join at %s", span(list(range(here, n))), self.desk.where)
        self.positions = config.kv_cache_blocks * config.block_size  # what one replica's pool holds
        root = hashlib.blake2b(f"{config.model}|{config.dtype}|{config.quantization}".encode(), digest_size=16)
        try:
            self.router = Router(n, [self.positions // PIECE_TOKENS] * n, root.digest(), slack=config.max_num_seqs,
                                 mode=os.environ.get("DSV4_ROUTING", "prefix").strip() or "prefix")
        except ValueError as e:
            raise ReplicaError(f"DSV4_ROUTING: {e}") from None
        self.sent: dict[str, Sent] = {}
        self.metrics = EngineMetrics()  # over the requests the replicas finished, as they stream
        self._done: list[RequestOutput] = []  # outputs made here (failures), given by the next step
        self._up = self._closing = False  # _up: every replica started once; from then on a lost one restarts
        self._ids = 0
        for r in self.replicas:
            if not r.remote:
                self._spawn(r)
        try:
            self._await_start()
        except BaseException:
            self.close()
            raise
        self._up = True
        first = self.replicas[0].facts
        self.weight_bytes = first["weight_bytes"]
        self.rank_weight_bytes = list(first["status"].get("rank_weight_bytes") or [self.weight_bytes])
        self.quant_note, self.compile_note = first["quant_note"], first["compile_note"]
        self.calibration_note = first["calibration_note"]

    # ------------------------------------------------------------------ replicas
    def _spawn(self, r: Replica) -> None:
        ours, theirs = self._ctx.Pipe()
        r.proc = self._ctx.Process(target=replica_main, args=(r.index, replica_config(self.config, r.index), r.cores, theirs),
                                   name=f"dsv4-replica-{r.index}")  # not daemonic: it may spawn its ranks
        r.proc.start()
        theirs.close()
        r.pid = r.proc.pid
        r.attach(ours)

    def _admit(self) -> None:
        """Take the replicas of other hosts that proved the key at the desk: welcome each into
        its free place, or refuse it (another model or setting, a place taken) with one line."""
        while self.desk is not None:
            try:
                conn, (_, index, theirs, facts), peer = self.desk.joined.get_nowait()
            except queue.Empty:
                return
            r = self.replicas[index] if isinstance(index, int) and 0 <= index < len(self.replicas) else None
            if r is None or not r.remote:
                why = (f"--data-parallel-rank {index} is not a place for another host's replica (this daemon "
                       f"runs replicas {span([x.index for x in self.replicas if not x.remote])} itself)")
            else:  # what it is first: the place may free up, its model will not change
                why = differs(self.identity, theirs) or (
                    f"replica {index} is already {r.state} (from {r.host})" if r.state != "away" else "")
            try:
                conn.send(("refused", why) if why else ("welcome",))
            except (OSError, ValueError):
                why = why or "its connection broke"
            if why:
                log.warning("engine replica %s from %s refused: %s", index, peer, why)
                conn.close()
                continue
            if r.error:  # joined again after it was lost
                r.restarts += 1
            facts = facts if isinstance(facts, dict) else {}
            r.host, r.pid, r.cores = peer, facts.get("pid"), list(facts.get("cores") or [])
            r.attach(conn)
            log.info("engine replica %d joined from %s (pid %s); loading", index, peer, r.pid)

    def _await_start(self) -> None:
        """Until every replica has loaded (those of other hosts joined within --rendezvous-timeout);
        the first that fails fails the start."""
        deadline = time.monotonic() + self.config.rendezvous_timeout
        while any(r.state != "serving" for r in self.replicas):
            self._pump(1.0)
            for r in self.replicas:
                if r.state not in ("serving", "starting", "away") or r.error:
                    raise ReplicaError(f"--data-parallel-size {len(self.replicas)}: engine replica {r.index} "
                                       f"could not start: {r.error}")
                if r.state == "away" and time.monotonic() > deadline:
                    raise ReplicaError(f"engine replica {r.index} did not join at {self.desk.where} within "
                                       f"--rendezvous-timeout {self.config.rendezvous_timeout:g} s (start it there with "
                                       f"'dsv4 serve --data-parallel-rank {r.index}' and the same flags)")

    def _pump(self, timeout: float) -> None:
        """Take what the replicas sent (waiting up to `timeout`), notice deaths and silences."""
        self._admit()
        live = [r for r in self.replicas if r.state in ("starting", "serving")]
        waits = {r.waitable: r for r in live} | {r.proc.sentinel: r for r in live if not r.remote}
        for ready in wait(list(waits), timeout) if waits else []:
            r = waits[ready]
            if r.state in ("starting", "serving"):
                self._drain(r)
        now = time.monotonic()
        for r in live:
            if r.state == "serving" and now - r.heard > self.timeout_s:
                if not r.remote:
                    r.proc.kill()
                    r.proc.join(5)
                self._lost(r, f"stopped answering for {now - r.heard:.0f} s (DSV4_REPLICA_TIMEOUT) and was "
                              f"{'cut off' if r.remote else 'killed'}", resend=True)

    def _drain(self, r: Replica) -> None:
        try:
            while r.state in ("starting", "serving"):
                try:
                    msg = r.message()
                except Unreadable as e:  # only another host's can send that
                    self._lost(r, f"on {r.host} sent what this daemon cannot read ({e})", resend=True)
                    return
                if msg is None:
                    return
                self._take(r, msg)
        except (EOFError, OSError):
            if r.remote:  # its process ended, or its host is unreachable: it may join again
                self._lost(r, r.crash or f"on {r.host}: its connection closed", resend=not r.crash)
                return
            r.proc.join(5)
            code = r.proc.exitcode
            killed = code is not None and code < 0 and not r.crash  # a signal (the OOM killer, kill -9)
            self._lost(r, r.crash or f"exited with code {code}", resend=killed)

    def _take(self, r: Replica, msg: tuple) -> None:
        r.heard = time.monotonic()
        kind = msg[0]
        if kind == "beat":
            r.counters = msg[1]
        elif kind == "out":
            for out in msg[1]:
                self._output(r, out)
        elif kind == "ready":
            r.state, r.facts = "serving", msg[1]
            log.info("engine replica %d serving (%spid %s, cores %s)", r.index, f"{r.host}, " if r.remote else "",
                     r.pid, span(r.cores))
        elif kind in ("failed", "crashed"):
            r.crash = msg[1]
            if r.remote:  # its process may take a while to end: it is gone for us now
                self._lost(r, r.crash, resend=False)

    def _output(self, r: Replica, out: RequestOutput) -> None:
        sent = self.sent.get(out.request_id)
        if sent is None or sent.replica != r.index:
            return  # aborted meanwhile
        sent.streamed = sent.streamed or bool(out.token_ids or out.text)
        self.metrics.on_output(0, len(out.token_ids), r.heard)
        if out.finished:
            self.sent.pop(out.request_id)
            r.requests.discard(out.request_id)
            if out.metrics is not None:  # finished in its engine (not failed or refused)
                m = RequestMetrics.from_dict(out.metrics, r.heard)
                self.metrics.add(m, streamed=True)
                self.metrics.prompt_tokens += m.prompt_tokens
        self._done.append(out)

    def _lost(self, r: Replica, why: str, resend: bool) -> None:
        """Replica r is gone: its requests go elsewhere (`resend`, those that streamed nothing
        and were not sent again already) or fail; it starts again if it may."""
        if r.state not in ("starting", "serving"):
            return
        r.error, r.state, r.counters = why, "away" if r.remote else "dead", {}
        r.cut()
        self.router.forget(r.index)
        pid = r.pid
        log.error("engine replica %d (pid %s) %s%s", r.index, pid, why,
                  "; it may join again" if r.remote else "")
        orphans = sorted(r.requests)
        r.requests.clear()
        if not r.remote and self._up and not self._closing and r.restarts < MAX_RESTARTS:
            r.restarts += 1
            log.info("starting engine replica %d again (restart %d of %d)", r.index, r.restarts, MAX_RESTARTS)
            self._spawn(r)
        for rid in orphans:
            sent = self.sent.pop(rid)
            if resend and not sent.streamed and not sent.resent and self._serving():
                self._send(rid, sent.add, resent=True)  # nothing streamed yet: another replica runs it
            else:
                self._done.append(RequestOutput(rid, finished=True, finish_reason=FINISH_ERROR, error=(
                    f"engine replica {r.index} (pid {pid}) {why}; this request failed with it, the other "
                    f"replicas go on serving")))

    def _serving(self) -> bool:
        return any(r.state == "serving" for r in self.replicas)

    def _loads(self) -> list[int | None]:
        return [len(r.requests) if r.state == "serving" else None for r in self.replicas]

    def _send(self, rid: str, add: tuple, follows: str | None = None, resent: bool = False) -> None:
        """Route one request (`add`: its message to a replica) and queue it for that replica."""
        _, _, ids, params, kw, _ = add
        leader = self.sent.get(follows) if follows else None
        loads = self._loads()
        sibling = leader is not None and loads[leader.replica] is not None  # after its leader's prefill, there
        message = add[:4] + ({**kw, "follows": follows},) + add[5:] if sibling else add
        data = pickle.dumps(message)  # here: a message that cannot go fails add_request, before any bookkeeping
        i = leader.replica if sibling else self.router.route(ids, params.cache_salt, loads)[0]
        self.sent[rid] = Sent(i, add, resent=resent)
        self.replicas[i].requests.add(rid)
        self.replicas[i].outbox.put(data)

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
        self._ids += 1
        rid = str(request_id) if request_id is not None else f"req-{self._ids}"
        check_prompt(ids, params, self.config.model_config.vocab_size, self.config.max_model_len, self.positions)
        if not self._serving():
            raise RequestBusy("no engine replica is serving now (starting again, or waiting for another host's "
                              "to join); try again shortly")
        spec = grammar.spec if isinstance(grammar, _Spec) else params.structured
        self._send(rid, ("add", rid, ids, params, {"client": client}, spec), follows)
        return rid

    def abort(self, request_id: str) -> bool:
        sent = self.sent.pop(str(request_id), None)
        if sent is None:
            return False
        r = self.replicas[sent.replica]
        r.requests.discard(str(request_id))
        r.outbox.put(pickle.dumps(("abort", str(request_id))))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.sent or self._done) or self._none_left()

    def _none_left(self) -> bool:
        """No replica serves or may: every local one used up its restarts (another host's may join again)."""
        return self._up and all(r.state not in ("starting", "serving", "away") for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        self._pump(0.0 if self._done else STEP_WAIT_S)
        outs, self._done = self._done, []
        if self._none_left():
            self._done = outs  # failed with the group by the daemon
            raise ReplicaError("every engine replica failed and used up its restarts: "
                               + "; ".join(f"replica {r.index}: {r.error}" for r in self.replicas))
        return outs

    def build_in_background(self) -> str:
        return ""  # each replica loads the compiled buckets cached; none builds more

    def poll_compiled(self) -> None:
        """While the daemon idles: take the replicas' beats, notice deaths, restarts."""
        self._pump(0.0)

    def status(self) -> dict[str, Any]:
        serving = [r for r in self.replicas if r.state == "serving"]
        out = dict(self.replicas[0].facts.get("status") or {})  # what does not change: model, dtype, ...
        out.pop("totals", None)
        for k in SUM_KEYS:
            out[k] = sum(r.counters.get(k) or 0 for r in serving)
        q, h = out["prefix_cache_queries"], out["prefix_cache_hits"]
        out["prefix_cache_hit_rate"] = h / q if q else 0.0
        out["state_bytes"] = out.get("state_bytes", 0) * len(self.replicas)
        out["totals"] = self._totals(serving)
        out["uptime_s"] = time.time() - self.started
        out["data_parallel_size"] = len(self.replicas)
        out["routing"] = dict(self.router.decisions)
        out["replicas"] = [r.row(self.router.per_replica[r.index]) for r in self.replicas]
        return out

    def _totals(self, serving: list[Replica]) -> dict[str, Any]:
        """The totals over every request the pool saw finish; steps from the replicas' own
        counts (since each last started), busy time the busiest one's (they step at once)."""
        m, counts = self.metrics, [r.counters for r in serving]
        m.busy_s = max((c.get("busy_s") or 0.0 for c in counts), default=0.0)
        m.num_steps = sum(c.get("steps", 0) for c in counts)
        m.num_prefill_tokens = sum(c.get("prefill_tokens", 0) for c in counts)
        m.num_decode_tokens = sum(c.get("decode_tokens", 0) for c in counts)
        return m.to_dict()

    def close(self) -> None:
        """Stop every replica: the stop message, then (all within STOP_WAIT_S) terminate, then kill."""
        self._closing = True
        if self.desk is not None:
            self.desk.close()
        for r in self.replicas:
            if r.state in ("starting", "serving"):
                r.outbox.put(pickle.dumps(("stop",)))
                r.outbox.put(None)
            r.state = "stopped"
            r.close_wake()
        for r in self.replicas:  # another host's: its stop is sent before we go
            if r.remote and r.sender is not None:
                r.sender.join(STOP_WAIT_S)
        procs = [r.proc for r in self.replicas if r.proc is not None]
        deadline = time.monotonic() + STOP_WAIT_S
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            wait([p.sentinel for p in procs if p.is_alive()], deadline - time.monotonic())
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
