"""Captured decode dispatches (`--compile`): the model itself, compiled per bucket.

`CompiledSteps(model, state, max_tokens, with_mtp)` compiles the model's own `forward_batch`
/ `mtp_forward` (fullgraph) on a static decode dispatch (`Batch.static_step`) for every
bucket of token counts 1, 2, 4, ... up to `max_tokens` at startup (`capture(progress=...)`);
there is no second implementation of any layer. Then `main(batch)` / `mtp(batch, hidden)`
run a batch padded up to its bucket, or return None when it does not qualify (a long row,
too many tokens, a failed bucket): the caller then runs the eager model, the reference.
Padding tokens write into a scratch slot (the state's last, owned by no request); the
state's bookkeeping is done for the real rows only. Compiled code lives in the private
cache (`compile_env`); on the CPU a bucket is first looked up as an AOTInductor package
(`artifacts`), a missing one built and saved, and one that fails to export or build is
compiled with torch.compile. Details: docs/compile.md, 'dsv4/engine/compile/compiled.py'.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from dsv4.model import parallel
from dsv4.model.attention import ROW_MIN
from dsv4.model.model import DeepseekV4
from dsv4.model.state import Batch, ModelState
from dsv4.engine.compile import artifacts
from dsv4.engine.compile.env import CompileUnavailable, buckets, compiler_settings, quiet_capture, recheck_cache_dir

log = logging.getLogger("dsv4.compile")

class CompiledSteps:
    """Compiled main/MTP decode dispatches by bucket over `state` (its last slot is scratch)."""

    def __init__(self, model: DeepseekV4, state: ModelState, max_tokens: int, with_mtp: bool = True,
                 mode: str | None = None, cache_dir: Path | None = None, use_artifacts: bool = True):
        self.cache_dir = cache_dir  # from private_cache_dir(): checked again before each bucket's compile
        self.model, self.state, self.device = model, state, model.embed.weight.device
        for rope in (model.rope_main, model.rope_compress):  # grown now: the graph reads them as they are
            rope.ensure(state.static_len + 1)
        self.scratch = state.max_slots - 1
        self.buckets = buckets(max_tokens)
        self.ready: dict[tuple[str, int], bool] = {}  # (main | mtp, bucket) -> captured
        self.failed: list[str] = []  # one line per bucket whose capture failed
        self.calls = {"main": 0, "mtp": 0}  # dispatches that ran captured
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # bucket -> ids, pos, slots
        self._hidden: dict[int, torch.Tensor] = {}  # MTP bucket -> hidden [n, hc, D]
        self._no_hidden = torch.zeros(0, model.cfg.hc_mult, model.cfg.hidden_size, device=self.device,
                                      dtype=model.embed.weight.dtype)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(self.buckets) + 8)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 64 * len(self.buckets))
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"  # the buckets replay as CUDA graphs (UNTESTED here: no GPU was lent)
        # a CUDA graph's outputs are overwritten by its next replay: the caller gets copies (the
        # MTP's carried hidden state outlives the step that made it)
        self.copy_out = mode == "reduce-overhead"
        if mode == "reduce-overhead":  # CUDA graphs replay fixed addresses: the state tensors are static
            for t in state.tensors():  # the layers' tensors and the block table
                torch._dynamo.mark_static_address(t)
        # mode: torch.compile's ("reduce-overhead" replays CUDA graphs; benchmarks/step_costs.py
        # measures it on a GPU, the engine uses the default); on the CPU, CPU_OPTIONS instead
        # (not torch.compile's options=: it leaves freezing off; capture() patches the config)
        self.cpu_options = mode is None and self.device.type == "cpu"
        # AOTInductor packages (CPU, one process: a rank that fell back to torch.compile would
        # run its capture's collectives alone)
        self.use_artifacts = use_artifacts and cache_dir is not None and self.cpu_options and parallel.world_size() == 1
        self.aot: dict[tuple[str, int], artifacts.Loaded] = {}  # (kind, bucket) -> loaded package
        self.aot_built: list[tuple[str, int]] = []  # buckets whose package this start built (else loaded)
        self._state_tensors = state.tensors()  # a package's trailing inputs
        self.time_buckets = True  # keep a bucket only where it beats eager (bucket_check); off in a builder
        self.slower: set[tuple[str, int]] = set()  # buckets left eager because compiled was slower
        self._main = torch.compile(self._main_step, fullgraph=True, dynamic=False, mode=mode)
        self._mtp = (torch.compile(self._mtp_step, fullgraph=True, dynamic=False, mode=mode)
                     if model.has_mtp and with_mtp else None)

    @classmethod
    def for_config(cls, model: DeepseekV4, state: ModelState, config, cache_dir: Path | None) -> "CompiledSteps":
        """The buckets an engine with `config` (an `EngineConfig`) decodes in: max_num_seqs rows of 1 + K."""
        K = config.num_speculative_tokens
        return cls(model, state, config.max_num_seqs * (1 + K), with_mtp=K > 0, cache_dir=cache_dir)

    def _main_step(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """What each main bucket compiles: ids, pos, slots [n] -> (hidden [n, hc, D], logits [n, V])."""
        return self.model.forward_batch(Batch.static_step(ids, pos, slots, self.state.static_len), self.state)

    def _mtp_step(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """What each MTP bucket compiles: (ids, pos, slots [n], hidden [n, hc, D]) -> (z, logits)."""
        batch = Batch.static_step(ids, pos, slots, self.state.static_len)
        return self.model.mtp_forward(batch, hidden, self.state)

    @torch.inference_mode()
    def capture(self, only: set[tuple[str, int]] | None = None,
                progress: Callable[[int, int], None] | None = None, build: bool = True) -> float:
        """Compile every bucket once (dispatches of scratch-slot tokens only), or those in
        `only` ((main | mtp, tokens) pairs); `progress(done, total)` after each bucket (and
        (0, total) first). With `build` False only cached packages load (no compiling: the
        others stay eager until `refresh` finds them). Returns seconds."""
        t0 = time.perf_counter()
        todo = [(kind, fn, n) for kind, fn in (("main", self._main), ("mtp", self._mtp)) if fn is not None
                for n in self.buckets if only is None or (kind, n) in only]
        log.info("--compile: %s %d decode buckets", "capturing (minutes on a small CPU when the cache is cold)"
                 if build else "loading the cached of", len(todo))
        if progress is not None:
            progress(0, len(todo))
        for i, (kind, fn, n) in enumerate(todo, 1):
            try:  # the compile writes code there that this process then loads
                if self.cache_dir is not None:
                    recheck_cache_dir(self.cache_dir)
            except CompileUnavailable as e:
                self.failed.append(f"{e}: the capture stopped; {len(todo) - i + 1} bucket(s) run eager")
                log.warning(self.failed[-1])
                break
            if (self.use_artifacts and self._from_artifact(kind, n, build)) or not build:
                self.ready[(kind, n)] = (kind, n) in self.aot and self._wins(kind, n)
                if progress is not None:
                    progress(i, len(todo))
                continue
            ids, pos, slots = self._padded(None, n)
            try:
                with compiler_settings(self.cpu_options), quiet_capture():
                    if kind == "main":
                        fn(ids, pos, slots)
                    else:
                        fn(ids, pos, slots, self._hidden_in(self._no_hidden, n))
                self.ready[(kind, n)] = self._wins(kind, n)
            except Exception as e:  # noqa: BLE001 (any compile failure: that bucket stays eager)
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self.failed.append(f"capture of the {kind} bucket of {n} tokens failed "
                                   f"({type(e).__name__}: {msg[:200]}); it runs eager")
                log.warning(self.failed[-1])
            if progress is not None:
                progress(i, len(todo))
        return time.perf_counter() - t0

    def _wins(self, kind: str, n: int) -> bool:
        """Whether the bucket's compiled program is faster than eager on a scratch dispatch
        (`bucket_check`); a slower one is left eager (in `slower`, with one log line)."""
        if not self.time_buckets or self.device.type != "cpu" or parallel.world_size() > 1:
            return True
        from dsv4.engine.compile.bucket_check import compare

        ids, pos, slots = self._padded(None, n)
        hidden = self._hidden_in(self._no_hidden, n)
        extra = (hidden,) if kind == "mtp" else ()
        if (kind, n) in self.aot:
            compiled = lambda: self.aot[(kind, n)](ids, pos, slots, *extra, *self._state_tensors)  # noqa: E731
        else:
            fn = self._main if kind == "main" else self._mtp
            compiled = lambda: fn(ids, pos, slots, *extra)  # noqa: E731
        batch = lambda: Batch.static_step(ids, pos, slots, self.state.static_len)  # noqa: E731
        eager = ((lambda: self.model.forward_batch(batch(), self.state)) if kind == "main"
                 else (lambda: self.model.mtp_forward(batch(), hidden, self.state)))
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            keep, tc, te = compare(eager, compiled)
        if not keep:
            self.slower.add((kind, n))
            self.aot.pop((kind, n), None)
            log.warning("--compile: the %s bucket of %d tokens runs eager: compiled %.1f ms a step, eager %.1f ms",
                        kind, n, 1e3 * tc, 1e3 * te)
        return keep

    def missing(self) -> list[tuple[str, int]]:
        """The (kind, bucket) pairs that do not run compiled (yet)."""
        kinds = ["main"] + (["mtp"] if self._mtp is not None else [])
        return [(k, n) for k in kinds for n in self.buckets if not self.ready.get((k, n)) and (k, n) not in self.slower]

    def refresh(self) -> list[tuple[str, int]]:
        """Load the packages that appeared in the cache since (a background build's) for the
        buckets still eager; returns those that now run compiled (cheap when none did)."""
        if not self.use_artifacts:
            return []
        new = []
        for kind, n in self.missing():
            if not artifacts.present(self.model, self.state, kind, n, self.cache_dir):  # missing(): not slower
                continue
            if self._from_artifact(kind, n, build=False) and self._wins(kind, n):
                self.ready[(kind, n)] = True
                new.append((kind, n))
        return new

    def _from_artifact(self, kind: str, n: int, build: bool = True) -> bool:
        """Load the bucket's package, building it first when there is none usable (unless not
        `build`); False (one warning line) when that fails: the bucket then compiles with
        torch.compile, or without `build` stays eager."""
        try:
            with quiet_capture():
                got = artifacts.obtain(self.model, self.state, kind, n, self.scratch, self.cache_dir, build)
            if got is None:
                return False
            self.aot[(kind, n)], built = got
            if built:
                self.aot_built.append((kind, n))
            return True
        except Exception as e:  # noqa: BLE001 (export and inductor raise many types: torch.compile then)
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            log.warning("--compile: no AOTInductor package for the %s bucket of %d tokens (%s: %s); "
                        "compiling it with torch.compile", kind, n, type(e).__name__, msg)
            return False

    def in_use(self) -> dict[str, list[int]]:
        """The captured buckets that run compiled, by kind: {"main": [1, 2, 4], "mtp": [...]}."""
        out: dict[str, list[int]] = {"main": [], "mtp": []}
        for (kind, n), ok in sorted(self.ready.items()):
            if ok:
                out[kind].append(n)
        return out

    def _bucket(self, kind: str, batch: Batch) -> int | None:
        T = batch.input_ids.shape[0]
        if (T == 0 or T > self.buckets[-1] or any(n >= ROW_MIN for _, _, n in batch.rows)
                or batch.top() >= self.state.static_len):  # a context past the captured span: eager
            return None
        n = next(b for b in self.buckets if b >= T)
        return n if self.ready.get((kind, n)) else None

    def _padded(self, batch: Batch | None, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bucket's own input buffers (ids, pos, slots [n]) holding the batch's T tokens,
        then scratch tokens up to n (ids 0 at position 0 of the scratch slot); batch None:
        scratch tokens only. Refilled in place each call: no allocation per step, and on a
        GPU the captured graph reads fixed addresses."""
        if n not in self._inputs:
            z = lambda: torch.zeros(n, dtype=torch.long, device=self.device)  # noqa: E731 (distinct tensors:
            self._inputs[n] = (z(), z(), z())  # dynamo guards aliasing)
        ids, pos, slots = self._inputs[n]
        T = 0 if batch is None else batch.input_ids.shape[0]
        if T:
            ids[:T].copy_(batch.input_ids)
            pos[:T].copy_(batch.positions)
            slots[:T].copy_(batch.slots)
        if T < n:
            ids[T:].zero_()
            pos[T:].zero_()
            slots[T:].fill_(self.scratch)
        return ids, pos, slots

    def _hidden_in(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        """The MTP bucket's hidden-state buffer [n, hc, D]: the T real rows, zeros after."""
        buf = self._hidden.get(n)
        if buf is None:
            hc, D = self.model.cfg.hc_mult, self.model.cfg.hidden_size
            buf = self._hidden[n] = torch.zeros(n, hc, D, device=self.device, dtype=self.model.embed.weight.dtype)
        T = hidden.shape[0]
        buf[:T].copy_(hidden)
        buf[T:].zero_()
        return buf

    def main(self, batch: Batch, logits_index: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`forward_batch(batch, state, logits_index)` through the captured bucket, or None."""
        n = self._bucket("main", batch)
        if n is None:
            return None
        out = self._run("main", n, batch, self._main, *self._padded(batch, n))
        return self._unpad(out, batch, logits_index, self.copy_out)

    def mtp(self, batch: Batch, hidden: torch.Tensor, logits_index: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`mtp_forward(batch, hidden, state, logits_index)` through the captured bucket, or None."""
        if self._mtp is None:
            return None
        n = self._bucket("mtp", batch)
        if n is None:
            return None
        out = self._run("mtp", n, batch, self._mtp, *self._padded(batch, n), self._hidden_in(hidden, n))
        return self._unpad(out, batch, logits_index, self.copy_out)

    @staticmethod
    def _unpad(out: tuple[torch.Tensor, torch.Tensor] | None, batch: Batch, logits_index: torch.Tensor | None,
               copy: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A bucket's (hidden [n, ...], logits [n, V]) cut back to the batch's T real tokens
        (the logits to `logits_index` when given; copies when `copy`); None passes through
        (the bucket refused)."""
        if out is None:
            return None
        T = batch.input_ids.shape[0]
        h, logits = out
        h = h[:T].clone() if copy else h[:T]
        if logits_index is not None:
            return h, logits.index_select(0, logits_index)  # a new tensor either way
        return h, (logits[:T].clone() if copy else logits[:T])

    def _run(self, kind: str, n: int, batch: Batch, fn, *args):
        """Begin the state's rows, then run the captured bucket without evaluating its guards
        (every call has the captured shapes). Should it refuse anyway (it would have to
        recompile), the rows are un-begun, the bucket marked failed and None returned, so the
        caller runs eager."""
        lengths = self.state.mtp_lengths if kind == "mtp" else self.state.lengths
        saved = [(slot, lengths[slot]) for slot, _, _ in batch.rows]
        self.state.begin(batch, mtp=kind == "mtp")
        try:
            if (kind, n) in self.aot:  # the package: the state's tensors are inputs it writes
                out = self.aot[(kind, n)](*args, *self._state_tensors)
            else:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    out = fn(*args)
            self.calls[kind] += 1
            return out
        except Exception as e:  # noqa: BLE001 (a guard failure: from now on this bucket runs eager)
            for slot, length in saved:
                lengths[slot] = length
            self.ready[(kind, n)] = False
            self.aot.pop((kind, n), None)
            log.warning("--compile: the %s bucket of %d tokens failed (%s: %s); it runs eager from now on",
                        kind, n, type(e).__name__, str(e).strip().splitlines()[0][:200] if str(e).strip() else "")
            return None
