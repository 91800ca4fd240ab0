"""The model runner: the only engine code that builds tensors.

`execute(plan)` runs one scheduler step: (1) one batched dispatch of the main model over
every prefill chunk and decode row `[x_last, d_1..d_k]`; (2) first tokens, verification of
drafts and logprobs (`verify.py`), then rollback of the rejected positions; (3) the MTP
drafter over the newly completed pairs (h_t, x_{t+1}), then K-1 recurrent dispatches for
deeper drafts (`drafting.propose`). The plan's `num_drafts` (auto K) says how many; at 0 the
MTP is skipped and its pairs wait in a backlog it later catches up over; so do a prompt's
pairs, of which the window-only MTP needs only the last `sliding_window`. With `--compile`
short dispatches run through `compiled.CompiledSteps`; with a `BlockManager` the step's
`KVPlan` sets block tables and loads or saves rings.

The runner owns the model's `ModelState` plus, per slot, the pending hidden row, the current
drafts, the MTP backlog, and the saved rings by key. The scheduler owns lengths, token lists
and block ids. Details: docs/serving.md, 'dsv4/engine/runner.py'.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch
from torch.profiler import record_function

from dsv4.model import parallel
from dsv4.model.model import DeepseekV4
from dsv4.model.state import Batch
from dsv4.engine.spec.drafting import propose
from dsv4.engine.grammar.masks import draft_masks
from dsv4.engine.kvcache import SavedRings
from dsv4.engine.parallel.step_plan import broadcast, plan_message
from dsv4.engine.request import Request
from dsv4.engine.scheduler import SchedulerOutput
from dsv4.engine.logprobs import TokenLogprob
from dsv4.engine.spec.policy import SpecPolicy
from dsv4.engine.spec.verify import StepResult, prompt_logprobs, sample_verify

if TYPE_CHECKING:
    from dsv4.engine.compile.compiled import CompiledSteps


class Runner:
    """Runs planned steps on a `DeepseekV4` with slot state for `max_num_seqs` requests."""

    def __init__(self, model: DeepseekV4, *, max_num_seqs: int, max_model_len: int, max_chunk: int,
                 num_spec: int, device: torch.device, policy: SpecPolicy | None = None,
                 scratch_slot: bool = False, num_blocks: int | None = None, block_size: int | None = None):
        self.model, self.device, self.num_spec = model, device, num_spec
        self.max_num_seqs = max_num_seqs
        self.compiled: CompiledSteps | None = None  # --compile: captured decode dispatches (engine.py)
        self.policy = policy  # auto K: times the dispatches for it
        self.num_drafts = num_spec  # drafts to make this step: the plan's (`SchedulerOutput.num_drafts`)
        self.backlog: dict[int, tuple[int, list[torch.Tensor], list[int]]] = {}  # slot -> (t0, h rows, x_{t+1})
        self.timed = {"verify": 0.0, "draft": 0.0}  # seconds spent in this step's dispatches (auto)
        self.modelled = 0.0  # of which this step's MTP dispatches and catch-ups (auto)
        # scratch_slot: one more slot, owned by no request, that compiled buckets pad into
        # num_blocks: entries in a pool whose block ids the engine's BlockManager hands out (None:
        # each slot's max_len up front)
        self.state = model.new_state(max_num_seqs + int(scratch_slot), max_model_len + num_spec + 1,
                                     max_chunk=max(max_chunk, num_spec) + 1, max_spec=num_spec + 1,
                                     num_blocks=num_blocks, block_size=block_size)
        # +1: the MTP dispatch of a last prefill chunk also takes the pending row
        self.saved = SavedRings()  # prefix cache: key -> (rings, pending row, MTP backlog)
        self.pending: dict[int, torch.Tensor] = {}  # slot -> h of the last prefilled row [hc, D]
        self.drafts: dict[int, list[int]] = {}  # slot -> drafts for the next decode step
        self.draft_q: dict[int, torch.Tensor] = {}  # slot -> their distributions [k, V] (unseeded sampled only)
        self.prompt_lp: dict[int, list] = {}  # slot -> prompt logprobs of its earlier chunks (rank 0)
        self.sync_drafts = False  # this step: rank 0 sends each depth's drafts (tensor parallel, sampled rows)
        # Tests may replace the drafter: (request, output tokens so far including this
        # step's, the MTP's drafts) -> drafts
        self.draft_override: Callable[[Request, list[int], list[int]], list[int]] | None = None

    @classmethod
    def for_config(cls, model: DeepseekV4, config, device: torch.device, policy: SpecPolicy | None = None,
                   scratch_slot: bool = False) -> "Runner":
        """The runner an `EngineConfig` describes (every rank's, and the compile builder's: a
        compiled package is keyed by the state's shapes)."""
        return cls(model, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                   max_chunk=config.effective_chunk_size, num_spec=config.num_speculative_tokens, device=device,
                   policy=policy, scratch_slot=scratch_slot, num_blocks=config.kv_cache_blocks,
                   block_size=config.block_size)

    def reset_slot(self, slot: int) -> None:
        """Forget what `slot` held (a new request's first chunk, or a hit's rings to come)."""
        self.state.free(slot)
        self.pending.pop(slot, None)
        self.drafts.pop(slot, None)
        self.draft_q.pop(slot, None)
        self.backlog.pop(slot, None)
        self.prompt_lp.pop(slot, None)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> dict[int, StepResult]:
        """Run one step's plan (its prefill chunks, decode rows, block plan and K); returns
        results keyed by slot (prefill chunks that are not the last have none). Under tensor
        parallelism rank 0 first sends the plan (`parallel/step_plan.py`)."""
        prefills, decodes, kv = plan.prefills, plan.decodes, plan.kv
        self.num_drafts = plan.num_drafts
        if parallel.world_size() > 1 and parallel.rank() == 0:
            # drafts other than the plain argmax (sampled, biased, penalised): rank 0's are sent
            self.sync_drafts = self.num_spec > 1 and any(not r.params.greedy or r.params.adjusted
                                                         or r.grammar is not None for r, *_ in prefills + decodes)
            broadcast(plan_message(plan, self.drafts, self.sync_drafts))
        if kv is not None:
            self.saved.apply(self, kv)
        results = self._execute(prefills, decodes)
        if kv is not None:
            self.saved.save(self, kv)
        return results

    def _execute(self, prefills: list[tuple[Request, int, int]],
                 decodes: list[tuple[Request, int]]) -> dict[int, StepResult]:
        rows, want = [], []  # want: (kind, request, start position, first packed index, n)
        idx, samples = [], []  # packed rows for the head; (request, first logits row, rows, drafts or None)
        pidx, prompt_rows = [], []  # prompt logprobs: their packed rows (after idx's); (request, start, rows)
        off = 0
        for req, start, n in prefills:
            if start == 0:
                self.reset_slot(req.slot)
            rows.append((req.slot, start, req.prefill_ids[start:start + n]))
            want.append(("prefill", req, start, off, n))
            m = min(n, req.num_prompt_tokens - 1 - start)  # rows followed by a prompt token
            if req.wants_prompt_logprobs and m > 0:
                prompt_rows.append((req, start, m))
                pidx.extend(range(off, off + m))
            if start + n == req.num_prefill_tokens:  # the last chunk samples the first (next) token
                samples.append((req, len(idx), 1, None))
                idx.append(off + n - 1)
            off += n
        for req, n in decodes:
            toks = [req.last_token_id] + self.drafts.get(req.slot, [])[: n - 1]
            if len(toks) != n and not (self.policy is not None and 1 <= len(toks) < n):
                # auto K: a request skipped by the last steps holds drafts of an earlier, smaller K
                raise RuntimeError(f"{req!r}: {n} tokens scheduled, {len(toks) - 1} drafts available")
            n = len(toks)
            rows.append((req.slot, req.num_computed_tokens, toks))
            want.append(("decode", req, req.num_computed_tokens, off, n))
            samples.append((req, len(idx), n, toks[1:]))
            idx.extend(range(off, off + n))
            off += n
        if not rows:
            return {}
        t = time.perf_counter()
        batch = Batch.build(rows, self.device)
        logit_idx = torch.tensor(idx + pidx, dtype=torch.long, device=self.device)
        with record_function("dsv4.dispatch"):
            hidden, logits = self._forward(batch, logit_idx, decode=not prefills)
        t_host = self._clock(wait=not prefills)  # only a pure decode step's split is used
        with record_function("dsv4.sample_verify"):
            # rank 0 samples; under tensor parallelism the other ranks take its choices
            results = broadcast(self._choose(samples, logits, prompt_rows, len(idx))
                                if parallel.rank() == 0 else None)
            for req, _, _, drafts in samples:  # rejected drafts leave the state
                if drafts is not None:
                    self.state.rollback(req.slot, req.num_computed_tokens + 1 + results[req.slot].num_accepted)
        t_draft, self.modelled = time.perf_counter(), 0.0
        with record_function("dsv4.mtp"):
            self._draft(want, hidden, results, timed=self.policy is not None and not prefills)
        if self.policy is not None:
            self.timed = {"verify": t_draft - t, "draft": time.perf_counter() - t_draft}
            if not prefills:  # a pure decode step: its costs by token count; the MTP's outside its dispatches
                self.policy.verify.observe(off, t_host - t)
                self.policy.verify_host.observe(off, t_draft - t_host)
                if self.modelled:
                    self.policy.observe_draft_extra(self.timed["draft"] - self.modelled)
            self.policy.backlog_rows = sum(len(self.backlog[r.slot][2]) for r, *_ in prefills + decodes
                                           if r.slot in self.backlog)  # what restarting drafts catches up
        return results

    def _choose(self, samples, logits: torch.Tensor, prompt_rows, n_sample: int) -> dict[int, StepResult]:
        """`verify.sample_verify` over the first `n_sample` rows of `logits`; the rows after them
        are prompt rows (`prompt_rows`), whose logprobs gather per slot until the last chunk's
        result takes them."""
        results = sample_verify(samples, logits[:n_sample], self.draft_q)
        head = lambda req: [TokenLogprob(req.prompt_ids[0], None, [])]  # noqa: E731 (the first has no logprob)
        for (req, _, _), got in zip(prompt_rows, prompt_logprobs(prompt_rows, logits[n_sample:])):
            if req.slot not in self.prompt_lp:
                self.prompt_lp[req.slot] = head(req)
            self.prompt_lp[req.slot].extend(got)
        for req, _, _, drafts in samples:
            if drafts is None and req.wants_prompt_logprobs:
                results[req.slot].prompt_logprobs = self.prompt_lp.pop(req.slot, None) or head(req)
        return results

    def _clock(self, wait: bool) -> float:
        """Now, for auto K's split of a dispatch from the host work after it: off the CPU the
        device finishes first when the split is used (`wait`; without auto K nothing waits)."""
        if wait and self.policy is not None and self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        return time.perf_counter()

    def _forward(self, batch: Batch, logit_idx: torch.Tensor | None, decode: bool):
        """The main model's dispatch: a captured bucket for a decode step under --compile, else eager."""
        if decode and self.compiled is not None:
            out = self.compiled.main(batch, logit_idx)
            if out is not None:
                return out
        return self.model.forward_batch(batch, self.state, logit_idx)

    def _mtp_forward(self, batch: Batch, hid: torch.Tensor, head_idx: torch.Tensor | None):
        """The MTP's dispatch: a captured bucket when its rows are short under --compile, else eager."""
        if self.compiled is not None:
            out = self.compiled.mtp(batch, hid, head_idx)
            if out is not None:
                return out
        return self.model.mtp_forward(batch, hid, self.state, head_idx)

    # ------------------------------------------------------------------ MTP
    def _depth(self, req: Request) -> int:
        """Drafts `req` makes this step."""
        return min(req.num_spec, self.num_drafts)

    def _mtp(self, batch: Batch, hid: torch.Tensor, head_idx: torch.Tensor | None, timed: bool,
             heads: list[Request], drafts: dict[int, list[int]], results: dict[int, StepResult]):
        """One MTP dispatch -> (z [T, hc, D], one draft per head row, its q or None); timed
        for auto K. Draft j of a request is proposed for position num_tokens + j after this
        step's tokens, with the drafts before it counted as output (`drafting.propose`)."""
        t = time.perf_counter()
        z, logits = self._mtp_forward(batch, hid, head_idx)
        t_host = self._clock(wait=timed)
        if any(r.grammar is not None for r in heads):  # structured outputs: drafts the grammar allows
            logits = self._outside_vocab(draft_masks(logits, heads, drafts), z, head_idx, heads, drafts)
        outs = [[] if r.params.greedy and not r.params.penalized else r.output_ids + results[r.slot].tokens + drafts.get(r.slot, [])
                for r in heads]  # greedy drafts read neither history nor position
        pos = [r.num_prompt_tokens + len(o) for r, o in zip(heads, outs)]
        top, qs = propose(logits, heads, outs, pos)
        if timed and self.policy is not None:
            self.policy.draft.observe(len(batch.input_ids), t_host - t)
            self.policy.draft_host.observe(len(heads), dt := time.perf_counter() - t_host)
            self.modelled += t_host - t + dt
        return z, top, qs

    def _outside_vocab(self, logits: torch.Tensor, z: torch.Tensor, head_idx: torch.Tensor | None,
                       heads: list[Request], drafts: dict[int, list[int]]) -> torch.Tensor:
        """Masked draft logits [N, V] where a grammar allows no token of the draft vocabulary
        (a draft vocabulary's rows are -inf outside it): those rows again through the whole
        head, masked. Tensor parallel ranks keep them (the head's all-gather would need every
        rank): such a row drafts a token its grammar refuses, which verification rejects."""
        if self.model.draft_vocab_size is None or parallel.world_size() > 1:
            return logits
        empty = [i for i, r in enumerate(heads) if r.grammar is not None]
        empty = [i for i, ok in zip(empty, torch.isfinite(logits[empty]).any(dim=-1).tolist()) if not ok]
        if not empty:
            return logits
        rows = (z if head_idx is None else z[head_idx])[empty]  # [E, hc, D]
        full = draft_masks(self.model.mtp_logits(rows, draft=False), [heads[i] for i in empty], drafts)
        logits = logits.clone()
        logits[empty] = full
        return logits

    def _defer(self, slot: int, t0: int, hs: list[torch.Tensor], nxt: list[int]) -> None:
        """Keep pairs (h_t, x_{t+1}) from t0 on for a later catch-up instead of running the MTP;
        only the last `sliding_window` pairs are kept (older ones are never read again)."""
        entry = self.backlog.get(slot)  # the lists given become the backlog's (`_draft` builds them per step)
        if entry is not None:  # grown in place: a decode step adds one pair to a window's worth
            b0, bh, bt = entry
            assert b0 + len(bt) == t0, "the MTP backlog must be contiguous"
            bh.extend(hs)
            bt.extend(nxt)
            t0, hs, nxt = b0, bh, bt
        excess = len(nxt) - self.model.cfg.sliding_window
        if excess > 0:
            t0 += excess
            del nxt[:excess]
            while excess > 0:
                if len(hs[0]) <= excess:
                    excess -= len(hs.pop(0))
                else:
                    hs[0], excess = hs[0][excess:], 0
        self.backlog[slot] = (t0, hs, nxt)

    def _catch_up(self, slot: int, t0: int) -> None:
        """Run the MTP over the backlog of `slot`, so that its cache holds every pair before t0."""
        b0, hs, toks = self.backlog.pop(slot)
        assert b0 + len(toks) == t0, "the MTP backlog must end where this step's pairs start"
        t = time.perf_counter()
        if b0 < self.state.mtp_lengths[slot]:
            self.state.rollback(slot, self.state.lengths[slot], mtp_length=b0)
        else:
            self.state.skip_mtp(slot, b0)  # the pairs before b0 are out of every later window
        h = torch.cat(hs)
        step = self.state.max_chunk
        for lo in range(0, len(toks), step):
            piece = toks[lo:lo + step]
            self.model.mtp_forward(Batch.build([(slot, b0 + lo, piece)], self.device), h[lo:lo + len(piece)],
                                   self.state, torch.zeros(0, dtype=torch.long, device=self.device))
        self.modelled += time.perf_counter() - t  # auto K: the catch-up's cost is the policy's backlog_rows

    def _draft(self, want, hidden: torch.Tensor, results: dict[int, StepResult], timed: bool = False) -> None:
        """Run the MTP over the pairs this step completed and propose the next drafts."""
        if self.num_spec == 0 or not self.model.has_mtp:
            return
        rows, hs, heads = [], [], []  # heads: (request, packed index of the row that yields a draft)
        off = 0
        for kind, req, start, o, n in want:
            if req.num_spec == 0:
                continue
            slot = req.slot
            res = results.get(slot)
            if kind == "prefill":
                ids = req.prefill_ids
                pairs_h = [hidden[o:o + n - 1]]
                nxt = ids[start + 1:start + n]
                t0 = start
                if start > 0:  # the pending row of the previous chunk (or of the saved rings: a hit)
                    pairs_h.insert(0, self.pending.pop(slot).unsqueeze(0))
                    nxt = [ids[start]] + nxt
                    t0 = start - 1
                self.pending[slot] = hidden[o + n - 1].clone()
                if res is not None:  # the last chunk: the first token completes the pending row
                    pairs_h.append(self.pending.pop(slot).unsqueeze(0))
                    nxt = nxt + [res.tokens[0]]
            else:
                acc = res.num_accepted
                t0 = start
                pairs_h = [hidden[o:o + acc + 1]]
                nxt = res.tokens[: acc + 1]
            if not nxt:
                continue
            # the window-only MTP reads the last `sliding_window` pairs of a prompt, never the rest:
            # a prompt's pairs wait in the backlog (cut to the window), and its last chunk catches up
            # over them before its draft row (alone, when the chunk is longer than the window)
            drafting = self._depth(req) > 0
            if kind == "prefill" and res is not None and drafting and len(nxt) > self.model.cfg.sliding_window:
                head_h = pairs_h.pop()  # [1, hc, D]: the pair of the first token, the draft's row
                self._defer(slot, t0, pairs_h, nxt[:-1])
                t0, pairs_h, nxt = t0 + len(nxt) - 1, [head_h], nxt[-1:]
            if not drafting or res is None:  # no draft this step (or a non-final chunk): the MTP waits
                self._defer(slot, t0, pairs_h, nxt)
                if res is not None:
                    self.drafts[slot] = []
                    self.draft_q.pop(slot, None)
                continue
            if slot in self.backlog:
                self._catch_up(slot, t0)
            self.state.rollback(slot, self.state.lengths[slot], mtp_length=t0)
            rows.append((slot, t0, nxt))
            hs.extend(pairs_h)
            if res is not None:
                heads.append((req, off + len(nxt) - 1))
            off += len(nxt)
        if not rows:
            return
        batch = Batch.build(rows, self.device)
        hid = torch.cat(hs)
        head_idx = torch.tensor([i for _, i in heads], dtype=torch.long, device=self.device)
        drafts: dict[int, list[int]] = {}
        z, top, qs = self._mtp(batch, hid, head_idx, timed, [r for r, _ in heads], drafts, results)
        drafts.update({req.slot: [int(t)] for (req, _), t in zip(heads, top)})
        q_rows = {req.slot: [q] for (req, _), q in zip(heads, qs)}
        z_last = z[head_idx]  # [R, hc, D]
        committed = {req.slot: self.state.mtp_lengths[req.slot] for req, _ in heads}
        for depth in range(1, self.num_spec):
            deeper = [(i, req) for i, (req, _) in enumerate(heads) if self._depth(req) > depth]
            if not deeper:
                break
            if self.sync_drafts and parallel.world_size() > 1:  # the deeper inputs are rank 0's draws
                drafts = broadcast(drafts if parallel.rank() == 0 else None)
            rows = [(req.slot, self.state.mtp_lengths[req.slot], [drafts[req.slot][-1]]) for _, req in deeper]
            sel = torch.tensor([i for i, _ in deeper], dtype=torch.long, device=self.device)
            z_next, top, qs = self._mtp(Batch.build(rows, self.device), z_last[sel], None, timed,
                                        [req for _, req in deeper], drafts, results)
            for (i, req), t, q in zip(deeper, top, qs):
                drafts[req.slot].append(int(t))
                q_rows[req.slot].append(q)
            z_last[sel] = z_next
        for req, _ in heads:  # speculative rows beyond the committed pairs are forgotten
            self.state.rollback(req.slot, self.state.lengths[req.slot], mtp_length=committed[req.slot])
            d = mtp_d = drafts[req.slot]
            if self.draft_override is not None:
                d = self.draft_override(req, req.output_ids + results[req.slot].tokens, d)
            self.drafts[req.slot] = d
            qs = q_rows[req.slot]
            if d == mtp_d and all(q is not None for q in qs):  # overridden drafts: one-hot q
                self.draft_q[req.slot] = torch.stack(qs)
            else:
                self.draft_q.pop(req.slot, None)
