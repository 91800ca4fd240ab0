"""The engine loop: requests in, streamed outputs out.

    step():  plan = scheduler.schedule()        # pure Python: who runs, how many tokens
             results = runner.execute(plan)     # one batched dispatch + sampling + MTP drafts
             for each request: scheduler takes the tokens (cuts at EOS/stop ids/limits),
                               the detokenizer and stop strings turn them into text,
                               metrics record times and acceptance

The daemon and the offline `LLM` API both drive this same loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dsv4.model import fp4_kernel, int8pack, parallel
from dsv4.model.w8a8 import INT8_MODES
from dsv4.model.loader import load_model
from dsv4.engine.checks import EngineConfigError
from dsv4.engine.config import EngineConfig, load_threads
from dsv4.engine.front import RequestFront
from dsv4.engine.kvcache import BlockManager
from dsv4.engine.metrics import EngineMetrics, RequestMetrics, step_profiler
from dsv4.engine.logprobs import TokenTexts
from dsv4.engine.parallel.ranks import START_TIMEOUT_S, RankError, Ranks, agree_pool, gather_weight_bytes
from dsv4.engine.request import Request, RequestOutput
from dsv4.engine.runner import Runner
from dsv4.engine.spec.verify import StepResult
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.scheduler import Scheduler
from dsv4.engine.spec import cost_cache
from dsv4.engine.spec.policy import SpecPolicy
from dsv4.engine.stop import StopChecker
from dsv4.engine.grammar.masks import Grammars
from dsv4.engine.tokenizer import THINK_END_TOKEN, THINK_START_TOKEN, IncrementalDetokenizer

log = logging.getLogger("dsv4.engine")


@dataclass
class _Track:
    """Engine-side companions of a request: text, stop strings, metrics."""

    request: Request
    detok: IncrementalDetokenizer | None
    stop: StopChecker
    metrics: RequestMetrics


class Engine(RequestFront):
    """DeepSeek V4 with chunked prefill and MTP speculative decoding, for many requests."""

    def __init__(self, config: EngineConfig, *, progress: Callable[[int, int], None] | None = None):
        if config.data_parallel_size > 1:
            raise EngineConfigError(f"--data-parallel-size {config.data_parallel_size}: replicas run behind "
                                    f"'dsv4 serve' (replicas.pool.EnginePool); one Engine is one replica")
        self._init_front(config)  # default sampling, tokenizer, text limit (front.py)
        self.device = torch.device(config.device)
        torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)  # unseeded sampling draws from the global RNG
        T = config.tensor_parallel_size
        if config.node_rank > 0:
            raise RankError(f"--node-rank {config.node_rank}: the ranks of another host run under "
                            f"'dsv4 serve' (ranks.serve_node); only node 0 has an engine")
        if config.launch is not None and config.launch.rank > 0:
            raise RankError(f"RANK {config.launch.rank} (torchrun): only rank 0 has an engine; the other ranks "
                            f"run dsv4.engine.parallel.ranks.serve_node(config) (the dsv4 commands do this themselves)")
        self.ranks = Ranks(config) if T > 1 else None  # ranks 1..T-1, spawned; this process is rank 0
        try:
            # w8a8 on one CPU: int8 weights prepacked for oneDNN (int8pack), unless --compile
            # asks for compiled steps, which read plain weights. Loading runs on every core.
            torch.set_num_threads(load_threads(config.threads, T // max(1, config.nnodes)))
            self.model = load_model(config.model, device=self.device, dtype=config.torch_dtype,
                                    quantization=config.quantization, progress=progress, world=T,
                                    pack=config.compile is not True, draft_vocab=config.draft_vocab_ids)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        finally:
            torch.set_num_threads(config.threads)
        self.metrics = EngineMetrics()
        self.profiler = step_profiler(config)
        self._builder: Any = None  # the background build of missing compiled buckets (serve), a process
        self._builder_poll = 0.0
        self._tracks: dict[str, _Track] = {}
        self._ids = itertools.count()
        self.token_texts = TokenTexts(self.tokenizer)  # names the tokens of logprobs
        try:
            self._start(config, progress)
            if self.ranks is not None:  # started: an idle engine's ranks hear from it within the timeout
                self.ranks.start_keepalive()  # (the other ranks meet it there first)
        except Exception as e:
            if self.ranks is None:
                raise
            broken = type(e) is RuntimeError or isinstance(e, torch.distributed.DistError)  # a collective's
            err = self.ranks.failure(e, "start") if broken else e
            self.ranks.close()
            raise err from None
        self.started = time.time()

    def _start(self, config: EngineConfig, progress: Any) -> None:
        """Everything after loading that the ranks do together: their weight bytes, the state
        pool, the runner and scheduler, compiled steps, auto K's calibration."""
        self.rank_weight_bytes = gather_weight_bytes(self.model)  # [this one] at T = 1
        self.quant_note = self._quant_note(config)
        self.weight_bytes = self.rank_weight_bytes[0]
        if self.ranks is not None:
            agree_pool(config)  # with the followers' agree_pool (ranks.py), at the same point
        # auto K: the policy picks 0..num_speculative_tokens per step, from costs timed now and while serving
        self.policy = SpecPolicy(config.num_speculative_tokens) if config.speculative_auto else None
        self.runner = Runner.for_config(self.model, config, self.device, self.policy,
                                        scratch_slot=config.compile is not False)
        self.scheduler = Scheduler.from_config(config, kv=BlockManager.for_config(config, self.runner.state),
                                               policy=self.policy)
        self.compile_note = ""  # the banner's line
        if config.compile:
            from dsv4.engine.compile.start import start_compiled

            self.compile_note = start_compiled(self.runner, config, progress)
            if self.ranks is not None:
                parallel.meet(START_TIMEOUT_S)  # with the followers' (ranks.py), after every rank's compile
        self.calibration_s, self.calibration_note = 0.0, ""
        if self.policy is not None:  # timed, or loaded from the calibration cache
            self.calibration_s, self.calibration_note = cost_cache.calibrated(
                self.runner, config, self.default_params, ranks=self.ranks is not None)
        tok = self.tokenizer  # structured outputs: llguidance over this vocabulary, built at the first use
        self.grammars = Grammars(tok, config.model_config.vocab_size, self.scheduler.eos_token_id,  # what ends it
                                 think_start=tok.token_to_id(THINK_START_TOKEN) if tok is not None else None,
                                 think_end=tok.token_to_id(THINK_END_TOKEN) if tok is not None else None,
                                 budget_s=config.grammar_compile_timeout)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, prompt_mode: str = "auto", system: str | None = None,
                    thinking: bool = False, client: Any = None, tools: list[Any] | None = None,
                    grammar: Any = None, follows: str | None = None) -> str:
        """Queue a request; raises `RequestError` (for this request alone) when it cannot run.
        Without `params`, the model's defaults (`make_params({})`) apply. `client` (any
        hashable) names who asked: the scheduler shares slots fairly between clients.
        `grammar`: the compiled grammar of `params.structured` (`submit_grammar`); without it
        the grammar is compiled here, waiting (the offline API; the daemon never does).
        `follows`: a live request with the same prompt (a sibling sample): this one starts once
        that one's prompt is prefilled, so the prefix cache gives it the whole blocks."""
        params = params or dataclasses.replace(self.default_params)
        ids = self.prompt_ids(prompt, params, prompt_mode=prompt_mode, system=system, thinking=thinking, tools=tools)
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, params, client=client)
        leader = self._tracks.get(str(follows)) if follows is not None else None
        if leader is not None and leader.request.prompt_ids == req.prompt_ids:
            req.after = leader.request
        if params.structured is not None:  # compiled (or refused) before it queues
            if self.scheduler.vocab_size is not None:  # a bad token id is refused before a compile, not after
                params.check_vocab(self.scheduler.vocab_size)
            compiled = grammar if grammar is not None else self.grammars.compile(params.structured)
            req.grammar = self.grammars.state(compiled, ids)
        self.scheduler.add(req)  # the prompt and the vocabulary checked; raises RequestError
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        self._tracks[rid] = _Track(req, detok, StopChecker(list(params.stop), params.include_stop_str_in_output),
                                   RequestMetrics(arrival=req.arrival_time, prompt_tokens=len(ids)))
        return rid

    def submit_grammar(self, spec: dict[str, Any]) -> Future:
        """A Future of a structured-output spec's compiled grammar, for `add_request(grammar=)`:
        compiled in a worker process within --grammar-compile-timeout (`Grammars.submit`), so
        the caller's thread (the daemon's loop) never waits; cancelling it drops the compile."""
        return self.grammars.submit(spec)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its slot is free at once. False if it is not live."""
        track = self._tracks.pop(str(request_id), None)
        if track is None:
            return False
        self.scheduler.abort(track.request.request_id)
        track.metrics.on_finish()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the loop
    def build_in_background(self) -> str:
        """`--compile` auto (`serve`'s default): build the decode buckets the cache lacks in a
        separate process (`compile_builder`), each switched to compiled as it appears
        (`poll_compiled`). Returns the log line ("" when there is nothing to build)."""
        steps = self.runner.compiled
        if self.config.compile != "auto" or steps is None or not steps.missing() or self._builder is not None:
            return ""
        from dsv4.machine import available_memory
        from dsv4.engine.compile.builder import spawn

        free = available_memory()
        if free is not None and free < 2 * self.weight_bytes:  # the builder loads its own copy of the weights
            return (f"compile: not building the {len(steps.missing())} missing decode bucket(s) in the background: "
                    f"it needs a second copy of the weights ({self.weight_bytes / 2**30:.1f} GiB) and "
                    f"{free / 2**30:.1f} GiB are available; build them with --compile")
        self._builder = spawn(self.config)
        return (f"compile: building {len(steps.missing())} decode bucket(s) in the background "
                f"(pid {self._builder.pid}); each runs compiled once built")

    def poll_compiled(self, every_s: float = 1.0) -> None:
        """Install the buckets a background build finished (at most every `every_s` seconds)."""
        if self._builder is None or time.monotonic() - self._builder_poll < every_s:
            return
        self._builder_poll = time.monotonic()
        done = self._builder.poll() is not None
        new = self.runner.compiled.refresh()
        if new:
            log.info("compile: %s now run%s compiled", ", ".join(f"{k} bucket {n}" for k, n in new),
                     "s" if len(new) == 1 else "")
        if done:
            left = self.runner.compiled.missing()
            log.log(logging.WARNING if left else logging.INFO, "compile: the background build ended (exit %s); %s",
                    self._builder.returncode, f"{len(left)} bucket(s) stay eager" if left else "every decode "
                    "bucket runs compiled")
            self._builder = None

    def step(self) -> list[RequestOutput]:
        self.poll_compiled()
        t0 = time.monotonic()
        t_step = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        if self.ranks is None:
            results = self.runner.execute(plan)
        else:
            self.ranks.check()
            try:
                with self.ranks.lock:  # no keepalive between a step's messages
                    results = self.runner.execute(plan)
            except Exception as e:
                raise self.ranks.failure(e) from None  # the group is broken: name the rank that died
        if self.profiler is not None:
            self.profiler.step()
        now = time.monotonic()
        self.metrics.on_step(sum(n for _, _, n in plan.prefills), sum(n for _, n in plan.decodes), now - t0)
        outs: list[RequestOutput] = []
        for req, start, n in plan.prefills:
            res = results.get(req.slot) if start + n == req.num_prefill_tokens else None
            if res is not None and req.request_id in self._tracks:
                self._tracks[req.request_id].metrics.cached_tokens = req.prompt_cached_tokens
            toks = self.scheduler.on_prefill_done(req, n, res.tokens[0] if res else None)
            if res is not None:
                outs.append(self._emit(req, toks, res, now))
        for req, n in plan.decodes:
            res = results[req.slot]
            if self.policy is not None and res.num_drafted:
                self.policy.observe_verify(res.num_drafted, res.num_accepted, not req.params.greedy)
            toks = self.scheduler.on_decode_done(req, res.tokens)
            if res.num_drafted:  # drafts cut at EOS/limits do not count
                self._tracks[req.request_id].metrics.on_verify(res.num_drafted, min(res.num_accepted, len(toks) - 1))
            outs.append(self._emit(req, toks, res, now))
        # status counts tokens as they stream (not when their requests end)
        self.metrics.on_output(sum(n for _, _, n in plan.prefills), sum(len(o.token_ids) for o in outs if o), now)
        if self.policy is not None:
            if not plan.prefills:
                timed = self.runner.timed
                self.policy.observe_overhead(time.perf_counter() - t_step - timed["verify"] - timed["draft"])
        return [o for o in outs if o is not None]

    def _emit(self, req: Request, toks: list[int], res: StepResult, now: float) -> RequestOutput | None:
        track = self._tracks.get(req.request_id)
        if track is None:  # aborted meanwhile
            return None
        text = []
        if track.detok is not None:  # token by token, so a stop string cuts the tokens too
            for i, t in enumerate(toks):
                piece = "" if self.scheduler.is_stop_token(req, t) else track.detok.push(t)
                if req.is_finished and i == len(toks) - 1:
                    piece += track.detok.flush()
                emit, stopped = track.stop.feed(piece)
                text.append(emit)
                if stopped:
                    self.scheduler.stop_at(req, len(req.output_ids) - len(toks) + i + 1)
                    toks = toks[: i + 1]
                    break
            else:
                if req.is_finished:
                    text.append(track.stop.flush())
        track.metrics.on_tokens(len(toks), now)
        out = RequestOutput(req.request_id, "".join(text), list(toks), list(res.sources[: len(toks)]))
        if res.logprobs is not None:  # cut where the tokens were cut
            out.logprobs = self.token_texts.entries(res.logprobs[: len(toks)])
        if res.prompt_logprobs is not None:
            out.prompt_logprobs = self.token_texts.entries(res.prompt_logprobs)
        if req.is_finished:
            track.metrics.on_finish(now)
            self.metrics.add(track.metrics, streamed=True)
            out.finished, out.finish_reason = True, req.finish_reason
            out.metrics = track.metrics.to_dict()
            # the K in use when it finished (auto: the latest choice; fixed: the configured K)
            out.metrics["spec"].update(num_speculative_tokens=self.runner.num_drafts if req.num_spec else 0,
                                       speculative_auto=self.policy is not None and req.num_spec > 0)
            buckets = self.compiled_buckets()  # what ran compiled (a bucket whose capture failed runs eager)
            out.metrics.update(compiled=bool(buckets["main"] or buckets["mtp"]), compiled_buckets=buckets)
            del self._tracks[req.request_id]
        return out

    # ------------------------------------------------------------------ status
    def compiled_buckets(self) -> dict[str, list[int]]:
        """The decode buckets that run compiled now ({"main": [], "mtp": []} when eager)."""
        steps = self.runner.compiled
        return steps.in_use() if steps is not None else {"main": [], "mtp": []}

    def _quant_note(self, config: EngineConfig) -> str:
        """The banner's weight-kernel lines: the int8 packing (or split products) and the FP4
        GEMM's path (C++ and its instruction set, or the torch fallback and why)."""
        if self.device.type != "cpu":
            return ""
        notes = [int8pack.describe(self.model) if config.quantization in INT8_MODES else ""]
        if config.quantization.endswith("mxfp4"):
            notes.append(fp4_kernel.backend())
        return "; ".join(n for n in notes if n)

    def status(self) -> dict[str, Any]:
        buckets = self.compiled_buckets()
        return {
            "compiled": bool(buckets["main"] or buckets["mtp"]),
            "compiled_buckets": buckets,
            "compile_building": self._builder is not None,  # a background build is still running
            "model": self.config.model,
            "model_id": self.config.model_id,  # the hub model ORG/NAME, or None for a directory
            "revision": self.config.revision,  # its commit
            "device": str(self.device),
            "dtype": self.config.dtype,
            "quantization": self.config.quantization,
            "kernels": self.quant_note,  # the quantised GEMMs' kernels and instruction sets ("" for none)
            "weight_bytes": self.weight_bytes,  # this rank's (each rank holds its own slices)
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "rank_weight_bytes": self.rank_weight_bytes,
            "num_speculative_tokens": self.runner.num_drafts,  # the K in use (auto: the latest choice)
            "speculative_auto": self.policy is not None,
            "max_speculative_tokens": self.config.num_speculative_tokens,
            "vocab_size": self.config.model_config.vocab_size,
            "uptime_s": time.time() - self.started,
            "state_bytes": (self.runner.state.ring_bytes_per_slot() * self.config.max_num_seqs
                            + self.config.kv_cache_memory),
            "max_model_len": self.config.max_model_len,
            "grammars": self.grammars.status(),
            **self._queue(),
            "totals": self.metrics.to_dict(),
        }

    def _queue(self) -> dict[str, Any]:
        """The queue, the block pool and the prefix cache, now."""
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "preemptions": s.num_preemptions,
                **s.kv.stats()}

    def counters(self) -> dict[str, Any]:
        """What changes step by step, cheaply (no sorting; safe to read from another thread
        while a step runs): `_queue`, steps and tokens (a replica's beat)."""
        m = self.metrics
        return {**self._queue(), "steps": m.num_steps, "prefill_tokens": m.num_prefill_tokens,
                "decode_tokens": m.num_decode_tokens, "busy_s": m.busy_s, "completion_tokens": m.completion_tokens}

    def close(self) -> None:
        """Flush the profiler (if --profile is on); stop the other ranks, a background build and
        the grammar workers."""
        self.grammars.close()
        if self._builder is not None:
            from dsv4.engine.compile.builder import stop

            stop(self._builder)
            self._builder = None
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
