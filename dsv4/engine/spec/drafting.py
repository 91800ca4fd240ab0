"""Choosing the MTP's drafts from its logits (docs/serving.md section 3, decode step).

`propose` turns one MTP dispatch's logits into one draft per request. Greedy requests take
the argmax after the request's logit_bias and penalties; sampled requests draw from the
MTP's own distribution q after the request's full processing (`sampling.logits_to_probs`):
unseeded ones from the global RNG (or `generator`), keeping q for rejection sampling
(`sampling.verify_sampled`); seeded ones with the keyed noise of the draft's position
(`sampling.keyed_sample`), so their output never depends on the drafts. A row whose logits
hold NaN, +inf or no finite value is drafted deterministically (the argmax of its finite
logits, else token 0) with a one-hot q: it can lower acceptance, never change the output
distribution. Details: docs/serving.md, 'dsv4/engine/spec/drafting.py'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from dsv4.engine.sampling import adjust_logits, keyed_sample, logits_to_probs, params_tensors

if TYPE_CHECKING:
    from dsv4.engine.request import Request


def finite_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax of each row of `logits` [N, V] over its finite entries (0 for a row with none)."""
    x = logits.float()
    return torch.where(torch.isfinite(x), x, torch.full_like(x, float("-inf"))).argmax(dim=-1)


def propose(
    logits: torch.Tensor,  # [N, V] the MTP's logits, one row per request
    reqs: Sequence["Request"],  # N requests
    outputs: Sequence[Sequence[int]],  # N token lists: the output before each draft, earlier drafts included
    positions: Sequence[int],  # N sequence positions the drafts are proposed for
    generator: torch.Generator | None = None,  # unseeded draws (None: the global RNG); on logits' device
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft per row -> (tokens, q): q[i] is the draft distribution [V] of an unseeded
    sampled request (one-hot for a row drafted deterministically), None for greedy and
    seeded requests (their verification does not read q)."""
    n = logits.shape[0]
    if len(reqs) != n or len(outputs) != n or len(positions) != n:
        raise ValueError(f"{n} logits rows for {len(reqs)} requests, {len(outputs)} outputs, "
                         f"{len(positions)} positions")
    tokens = logits.argmax(dim=-1).tolist() if n else []  # greedy rows without penalties
    qs: list[torch.Tensor | None] = [None] * n
    pen = [i for i, r in enumerate(reqs) if r.params.greedy and r.params.adjusted]
    if pen:  # greedy with logit_bias or penalties: the argmax the target's processing would take
        x = adjust_logits(logits[pen].float(), [reqs[i].params for i in pen], [reqs[i].prompt_ids for i in pen],
                          [outputs[i] for i in pen])
        for i, tok in zip(pen, finite_argmax(x).tolist()):
            tokens[i] = int(tok)
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if not sampled:
        return tokens, qs
    x = logits[sampled].float()
    ok = (~torch.isnan(x).any(dim=-1) & ~(x == float("inf")).any(dim=-1) & torch.isfinite(x).any(dim=-1)).tolist()
    fallback = finite_argmax(x).tolist()
    ps = [reqs[i].params for i in sampled]
    x = adjust_logits(x, ps, [reqs[i].prompt_ids for i in sampled], [outputs[i] for i in sampled])
    q = logits_to_probs(x, *params_tensors(ps, x.device))
    good = torch.tensor(ok, device=q.device) & torch.isfinite(q).all(dim=-1) & (q.sum(dim=-1) > 0)
    one_hot = torch.zeros_like(q).scatter_(-1, torch.tensor(fallback, device=q.device)[:, None], 1.0)
    q = torch.where(good[:, None], q / q.sum(dim=-1, keepdim=True).clamp_min(1e-30), one_hot)
    free = [j for j, p in enumerate(ps) if p.seed is None]
    if free:
        drawn = torch.multinomial(q[free], 1, generator=generator).squeeze(-1).tolist()
        for j, tok in zip(free, drawn):
            tokens[sampled[j]] = int(tok)
            qs[sampled[j]] = q[j]
    for j, p in enumerate(ps):
        if p.seed is not None:
            i = sampled[j]
            tokens[i] = keyed_sample(q[j:j + 1], p.seed, [positions[i]])[0]
    return tokens, qs
