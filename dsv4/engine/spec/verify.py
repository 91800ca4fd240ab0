"""One step's token choices from the main model's logits: first tokens of finished prefills,
verification of drafts, and the logprobs of what was chosen (for requests that ask).

`sample_verify(samples, logits, draft_q)` takes the step's sample rows (a finished prefill's
last row; a decode's 1 + K verify rows) and returns a `StepResult` per slot. Every row's
target distribution is the request's processing of its logits (`sampling.adjust_logits`,
penalties counting the drafts before the row; then temperature, top-k, top-p, min-p), so
verification accepts exactly what a run without drafts would emit: greedy and seeded rows
accept the drafts equal to the target's own choice (argmax or keyed draw), unseeded sampled
rows use rejection sampling (`verify_sampled`). Rows with a grammar are masked first
(`grammar/masks.py`), so a draft it forbids is rejected. Token j's logprob comes from row j.
Details: docs/serving.md, 'dsv4/engine/spec/verify.py'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from dsv4.engine.grammar.masks import apply_masks, new_bitmask
from dsv4.engine.logprobs import TokenLogprob, gather
from dsv4.engine.sampling import adjust_logits, keyed_sample, logits_to_probs, params_tensors, processed_logprobs, sample, \
    verify_greedy, verify_sampled

if TYPE_CHECKING:
    from dsv4.engine.request import Request

# (request, first logits row, rows, drafts or None for a finished prefill)
Sample = tuple["Request", int, int, "list[int] | None"]


@dataclass
class StepResult:
    """What one step produced for one request, before the scheduler cuts it."""

    tokens: list[int]
    num_drafted: int = 0
    num_accepted: int = 0
    sources: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks
    prompt_logprobs: list[TokenLogprob] | None = None  # the whole prompt's (the first without logprob)


def target_rows(logits: torch.Tensor, samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `logits` [R, V] -> (adjusted logits [R, V], probabilities [R, V]); when every
    row is greedy the probabilities are the adjusted logits themselves (argmax is all greedy needs)."""
    reqs = [r for r, _, n, _ in samples for _ in range(n)]
    if not reqs:
        return logits, logits
    ps = [r.params for r in reqs]
    if any(p.adjusted for p in ps):
        # row j of a decode comes after drafts 1..j: they count as output for its penalties
        outs = ([r.output_ids + (drafts or [])[:j] for r, _, n, drafts in samples for j in range(n)]
                if any(p.penalized for p in ps) else [[]] * len(ps))  # only penalties read the outputs
        logits = adjust_logits(logits, ps, [r.prompt_ids for r in reqs], outs)
    if all(p.greedy for p in ps):
        return logits, logits
    return logits, logits_to_probs(logits, *params_tensors(ps, logits.device))


def sample_verify(samples: Sequence[Sample], logits: torch.Tensor,
                  draft_q: dict[int, torch.Tensor]) -> dict[int, StepResult]:
    """The step's results by slot (module docstring); `draft_q`: slot -> the draft
    distributions [k, V] of an unseeded sampled request."""
    results: dict[int, StepResult] = {}
    constrained = [s for s in samples if s[0].grammar is not None]
    if constrained:
        logits = grammar_rows(logits, constrained)
    adjusted, probs = target_rows(logits, samples)
    top = probs.argmax(dim=-1).tolist() if probs.numel() else []  # what greedy rows take
    for req, lo, n, drafts in samples:
        p, seed = probs[lo:lo + n], req.params.seed
        # row j predicts the token at sequence position `first + j`
        first = req.num_tokens if drafts is None else req.num_computed_tokens + 1  # a recompute: after its outputs
        if req.params.greedy:
            target = top[lo:lo + n]
        elif seed is not None:  # keyed draws: the same tokens whatever K, batch or chunking
            target = keyed_sample(p, seed, range(first, first + n))
        elif drafts is None:
            target = sample(p).tolist()
        else:
            q = draft_q.get(req.slot)
            q = q[:len(drafts)] if q is not None and len(q) >= len(drafts) else None
            acc, toks = verify_sampled(p, drafts, q, None)
            results[req.slot] = StepResult(toks, len(drafts), acc, ["draft"] * acc + ["target"])
            continue
        if drafts is None:
            results[req.slot] = StepResult([target[0]], sources=["target"])
            continue
        acc, toks = verify_greedy(target, drafts)
        results[req.slot] = StepResult(toks, len(drafts), acc, ["draft"] * acc + ["target"])
    for req, *_ in constrained:
        req.grammar.commit(results[req.slot].tokens)
    attach_logprobs(samples, adjusted, results)
    return results


def grammar_rows(logits: torch.Tensor, samples: Sequence[Sample]) -> torch.Tensor:
    """`logits` with each constrained row masked by its request's grammar (module docstring)."""
    rows: list[int] = []
    bm = new_bitmask(logits.shape[0], logits.shape[-1])
    for req, lo, n, drafts in samples:
        live = req.grammar.masks(drafts or [], bm, lo)
        rows.extend(lo + j for j in range(n) if live[j])
    return apply_masks(logits, rows, bm)


def attach_logprobs(samples: Sequence[Sample], adjusted: torch.Tensor, results: dict[int, StepResult]) -> None:
    """Each result of a request asking for logprobs gets one `TokenLogprob` per token: row j
    of its rows of `adjusted` [R, V], processed (`sampling.processed_logprobs`), at token j."""
    want = [(req, lo) for req, lo, _, _ in samples if req.params.logprobs is not None]
    if not want:
        return
    rows, toks, ps = [], [], []
    for req, lo in want:
        res = results[req.slot]
        rows.extend(range(lo, lo + len(res.tokens)))
        toks.extend(res.tokens)
        ps.extend([req.params] * len(res.tokens))
    x = adjusted[torch.tensor(rows, dtype=torch.long, device=adjusted.device)]  # [W, V]
    got = gather(processed_logprobs(x, *params_tensors(ps, x.device)), toks, [p.logprobs for p in ps])
    i = 0
    for req, _ in want:
        res = results[req.slot]
        res.logprobs, i = got[i:i + len(res.tokens)], i + len(res.tokens)


def prompt_logprobs(rows: Sequence[tuple["Request", int, int]], logits: torch.Tensor
                    ) -> list[list[TokenLogprob]]:
    """The logprobs of prompt tokens start+1 .. start+m of each (request, start, m) in `rows`,
    from the raw logits [sum m, V] of positions start .. start+m-1 (their log-softmax)."""
    if not rows:
        return []
    targets = [t for req, start, m in rows for t in req.prompt_ids[start + 1:start + 1 + m]]
    ns = [req.params.prompt_logprobs for req, _, m in rows for _ in range(m)]
    got = gather(logits.float().log_softmax(dim=-1), targets, ns)
    out, i = [], 0
    for _, _, m in rows:
        out.append(got[i:i + m])
        i += m
    return out
