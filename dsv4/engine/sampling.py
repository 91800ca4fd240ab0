"""Sampling parameters, logits -> probabilities, seeded sampling and speculative verification.

* `SamplingParams` (`params.py`, re-exported): what a request asks for, validated.
* `adjust_logits`: `logit_bias`, then the penalties (`apply_penalties`), as vLLM orders them.
* `logits_to_probs`: temperature, top-k, top-p and min-p for a batch of rows at once
  (temperature 0: one-hot at the argmax); `processed_logprobs`: the log of that distribution.
* `keyed_sample`: a seeded request's token at position n is drawn with noise keyed by
  (seed, n) alone, so its output depends on prompt, parameters and seed only: not on the
  batch, the chunking, K or the tensor-parallel size. `sample`: unseeded rows, global RNG.
* `verify_greedy` / `verify_sampled`: speculative verification of K drafts against the
  target's K+1 rows (docs/serving.md section 3); `verify_sampled` is standard rejection
  sampling, exact whenever each d_i was drawn from q_i (a row of q that cannot have produced
  its draft is read as one-hot at it). Details: docs/serving.md, 'dsv4/engine/sampling.py'.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsv4.engine.params import (  # noqa: F401  (re-exported: the parameters and their limits)
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MIN_TEMPERATURE,
    SamplingParams,
)

__all__ = ["MAX_BIAS", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_REPETITION_PENALTY", "MAX_STOP_STRING_LEN",
           "MAX_STOP_STRINGS", "MIN_TEMPERATURE", "SamplingParams", "adjust_logits", "apply_penalties", "draw_key",
           "keyed_sample", "logits_to_probs", "processed_logprobs", "sample", "verify_greedy", "verify_sampled"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al.): a bijective 64-bit mix, so distinct inputs
    give distinct, well-spread outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, position: int) -> int:
    """The 63-bit generator seed of the draw for sequence position `position` of a request
    seeded `seed` (distinct positions of one seed never share a key)."""
    return _splitmix64(_splitmix64(seed) ^ position) >> 1


def keyed_sample(probs: torch.Tensor, seed: int, positions: Sequence[int]) -> list[int]:
    """Row i of `probs` [N, V] sampled for sequence position positions[i] of a request seeded
    `seed` -> N token ids.

    Exponential race: with E_v ~ Exp(1) independent, argmax_v p_v / E_v is distributed as p
    (the Gumbel-max trick in another form). The E_v of a row come from a CPU generator seeded
    by `draw_key(seed, position)`, in float64 (an E_v of 0 has probability 2^-53), so the token depends only on the
    row's probabilities and its key: the same on every device, batch and speculation depth.
    """
    if len(positions) != probs.shape[0]:
        raise ValueError(f"{len(positions)} positions for {probs.shape[0]} rows")
    n, v = probs.shape
    e = torch.empty(n, v, dtype=torch.float64)
    g = torch.Generator()
    for i, pos in enumerate(positions):
        g.manual_seed(draw_key(seed, int(pos)))
        e[i].uniform_(generator=g)
    e = -torch.log1p(-e)  # [N, V] Exp(1) from uniforms in [0, 1)
    p = probs.double()
    score = torch.where(p > 0, p / e.to(p.device), torch.full_like(p, -1.0))
    return score.argmax(dim=-1).tolist()


# ------------------------------------------------------------------ penalties
def apply_penalties(
    logits: torch.Tensor,  # [N, V]
    prompts: Sequence[Sequence[int]],  # N token lists: the prompt of each row's request
    outputs: Sequence[Sequence[int]],  # N token lists: the output before each row (drafts included)
    repetition: Sequence[float],  # [N], 1 = off
    presence: Sequence[float],  # [N], 0 = off
    frequency: Sequence[float],  # [N], 0 = off
) -> torch.Tensor:  # [N, V] float32, a new tensor
    """vLLM's (and OpenAI's) penalties, on raw logits before temperature:

    * repetition (CTRL): every token seen in the prompt or the output has its logit divided
      by the penalty when positive, multiplied by it when negative;
    * frequency: minus `frequency * count` for a token output `count` times so far;
    * presence: minus `presence` for a token output at least once.

    Row i's history is prompts[i] + outputs[i]: under speculative verification the row
    after draft j counts drafts 1..j, so the target distribution at every position is the
    one a run without drafts would use.
    """
    x = logits.float().clone()
    n, v = x.shape
    dev = x.device
    counts = torch.zeros(n, v, device=dev)
    seen = torch.zeros(n, v, dtype=torch.bool, device=dev)
    for i in range(n):
        if outputs[i]:
            counts[i].index_add_(0, torch.tensor(list(outputs[i]), device=dev), torch.ones(len(outputs[i]), device=dev))
        if prompts[i]:
            seen[i, torch.tensor(list(prompts[i]), device=dev)] = True
    seen |= counts > 0
    rep = torch.tensor(list(repetition), dtype=torch.float32, device=dev)[:, None]  # [N, 1]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= torch.tensor(list(frequency), dtype=torch.float32, device=dev)[:, None] * counts
    x -= torch.tensor(list(presence), dtype=torch.float32, device=dev)[:, None] * (counts > 0).float()
    return x


def adjust_logits(
    logits: torch.Tensor,  # [N, V]
    params: Sequence[SamplingParams],  # N: each row's request
    prompts: Sequence[Sequence[int]],  # N token lists: each row's prompt
    outputs: Sequence[Sequence[int]],  # N token lists: the output before each row (drafts included)
) -> torch.Tensor:  # [N, V] float32; `logits` itself when no row needs anything
    """The raw logits as the request's processing sees them before temperature: `logit_bias`
    added, then the penalties (`apply_penalties`), in vLLM's order."""
    if not any(p.adjusted for p in params):
        return logits
    x = logits.float().clone()
    biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if biased:
        rows = [i for i, b in biased for _ in b]
        cols = [int(t) for _, b in biased for t in b]
        vals = [float(v) for _, b in biased for v in b.values()]
        dev = x.device
        x.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                     torch.tensor(vals, device=dev), accumulate=True)
    pen = [i for i, p in enumerate(params) if p.penalized]  # rows without penalties are left as they are
    if pen:
        x[pen] = apply_penalties(x[pen], [prompts[i] for i in pen], [outputs[i] for i in pen],
                                 [params[i].repetition_penalty for i in pen], [params[i].presence_penalty for i in pen],
                                 [params[i].frequency_penalty for i in pen])
    return x


def params_tensors(params: Sequence[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) tensors of N rows, as `logits_to_probs` takes them."""
    t = lambda vals, dt: torch.tensor(vals, dtype=dt, device=device)  # noqa: E731
    return (t([p.temperature for p in params], torch.float32), t([p.top_k for p in params], torch.long),
            t([p.top_p for p in params], torch.float32), t([p.min_p for p in params], torch.float32))


# ------------------------------------------------------------------ logits -> probs
# Candidates a row's processing looks at before it sorts the whole vocabulary: when its top-k
# is at most this, or its top-p nucleus lies within its top this-many tokens, the rest can
# never be kept. A fixed count (not the batch's largest top-k), so that which way a row goes,
# and so its result, depends on that row alone. Sorting V4's 129280 logits takes 7.8 ms a row
# on a 2-core CPU, its top 256 0.3 ms (the embedded model's 4096: 149 against ~20 us).
CANDIDATES = 256


def _masked_sorted(
    x: torch.Tensor,  # [N, C] float32, each row sorted descending (its top C of V logits, / T)
    k: torch.Tensor,  # [N] top-k in 1..V
    top_p: torch.Tensor,  # [N], 1 = off
    min_p: torch.Tensor,  # [N], 0 = off
    lse: torch.Tensor,  # [N] logsumexp of each whole row: the normaliser of a row whose top-k exceeds C
) -> torch.Tensor:
    """x with the removed tokens at -inf [N, C]: top-k, then the top-p nucleus (the tokens
    with less than top_p of the mass above them), then p >= min_p * p_max. Each row's kept
    tokens must lie within its C (`_kept` makes sure).

    min-p compares each probability with the largest one; the ratio does not change when
    other tokens are removed, so its place in the order does not matter."""
    n, c = x.shape
    pos = torch.arange(c, device=x.device)[None, :]  # [1, C]
    x = x.masked_fill(pos >= k[:, None], float("-inf"))
    z = torch.where(k <= c, x.logsumexp(dim=-1), lse)  # the normaliser after top-k
    p = (x - z[:, None]).exp()  # [N, C]
    before = p.cumsum(dim=-1) - p  # mass strictly above each token
    drop = (before > top_p[:, None]) & (top_p < 1)[:, None]
    drop[:, 0] = False  # the most likely token always stays
    x = x.masked_fill(drop, float("-inf"))
    return x.masked_fill(x < x[:, :1] + _log_min_p(min_p)[:, None], float("-inf"))


def _log_min_p(min_p: torch.Tensor) -> torch.Tensor:
    return torch.where(min_p > 0, min_p.clamp_min(1e-30).log(), torch.full_like(min_p, float("-inf")))


def _kept(
    x: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N] int, <= 0 = off
    top_p: torch.Tensor,  # [N], 1 = off
    min_p: torch.Tensor,  # [N], 0 = off
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / T with every token the processing removes at -inf [N, V], greedy rows [N] bool):
    temperature, then top-k, then top-p, then min-p (`_masked_sorted`). A row is processed over
    its top `CANDIDATES` tokens when its kept set lies among them (a top-k within them, or a
    top-p nucleus inside their share of the mass: the next token has that share above it),
    without any order when it truncates by min-p at most, and over the whole sorted row
    otherwise. Greedy rows take the cheapest way: their result is the argmax."""
    n, v = x.shape
    dev = x.device
    temperature = temperature.to(dev, torch.float32)
    greedy = temperature <= 0  # [N]
    x = x / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    k = top_k.to(dev, torch.long)
    k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
    top_p, min_p = top_p.to(dev, torch.float32), min_p.to(dev, torch.float32)
    untruncated = (k == v) & (top_p >= 1)  # min-p at most: no order needed
    if bool((untruncated | greedy).all()):
        return x.masked_fill(x < x.amax(dim=-1, keepdim=True) + _log_min_p(min_p)[:, None], float("-inf")), greedy
    c = min(CANDIDATES, v)
    vals, order = x.topk(c, dim=-1)  # [N, C], sorted
    lse = x.logsumexp(dim=-1)  # [N]
    near = greedy | (k <= c) | ((k == v) & (top_p < 1) & ((vals - lse[:, None]).exp().sum(dim=-1) > top_p))
    near = near & ~untruncated if c < v else ~untruncated
    out = torch.full_like(x, float("-inf"))
    far = ~near & ~untruncated
    for mask, way in ((near, "candidates"), (untruncated, "min-p"), (far, "sort")):
        if not bool(mask.any()):
            continue
        r = slice(None) if bool(mask.all()) else mask.nonzero().squeeze(-1)  # one way for all: no copies
        if way == "candidates":
            got = out[r].scatter_(-1, order[r], _masked_sorted(vals[r], k[r], top_p[r], min_p[r], lse[r]))
        elif way == "min-p":
            xr = x[r]
            got = xr.masked_fill(xr < xr.amax(dim=-1, keepdim=True) + _log_min_p(min_p[r])[:, None], float("-inf"))
        else:  # kept tokens may lie beyond the candidates: sort the whole row
            full, o = x[r].sort(dim=-1, descending=True)
            got = out[r].scatter_(-1, o, _masked_sorted(full, k[r], top_p[r], min_p[r], lse[r]))
        if isinstance(r, slice):
            out = got
        else:
            out[r] = got
    return out, greedy


def logits_to_probs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N] int, <= 0 = off
    top_p: torch.Tensor,  # [N], 1 = off
    min_p: torch.Tensor,  # [N], 0 = off
) -> torch.Tensor:  # [N, V] float32, rows sum to 1
    """Apply temperature, then keep top-k, then the top-p nucleus, then p >= min_p * p_max
    (`_kept`). Rows with temperature 0, or that overflow, are one-hot at the argmax."""
    x = logits.float()
    kept, greedy = _kept(x, temperature, top_k, top_p, min_p)
    probs = kept.softmax(dim=-1)
    greedy = greedy | ~torch.isfinite(probs).all(dim=-1)  # a row that overflowed falls back to argmax
    if bool(greedy.any()):
        safe = torch.nan_to_num(logits.float(), nan=float("-inf"))
        one_hot = torch.zeros_like(x).scatter_(-1, safe.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def processed_logprobs(
    logits: torch.Tensor,  # [N, V] adjusted logits (`adjust_logits`)
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N] int
    top_p: torch.Tensor,  # [N]
    min_p: torch.Tensor,  # [N]
) -> torch.Tensor:  # [N, V] float32, -inf where a token was removed
    """The log of `logits_to_probs`' distribution, computed as a log-softmax (no underflow
    to log 0 for unlikely tokens). Greedy rows (temperature 0) report the log-softmax of
    their adjusted logits at temperature 1, unmasked: the model's distribution after
    logit_bias and penalties, of which greedy takes the argmax."""
    x = logits.float()
    if bool((temperature <= 0).all()):  # greedy rows only: no sort
        return x.log_softmax(dim=-1)
    kept, greedy = _kept(x, temperature, top_k, top_p, min_p)
    lp = kept.log_softmax(dim=-1)
    greedy = greedy | ~torch.isfinite(lp.amax(dim=-1))
    if bool(greedy.any()):
        lp = torch.where(greedy[:, None], x.log_softmax(dim=-1), lp)
    return lp


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [N, V] from the global RNG (requests without a seed)
    -> LongTensor [N]."""
    return torch.multinomial(probs, 1).squeeze(-1)


# ------------------------------------------------------------------ speculative verification
def verify_greedy(target_argmax: Sequence[int], drafts: Sequence[int]) -> tuple[int, list[int]]:
    """Accept the longest prefix of `drafts` equal to the target's argmax, then one target token.

    `target_argmax` has K+1 entries: the target's choice after x_last and after each draft.
    Returns (number accepted, tokens to emit) with 1 + accepted tokens: the accepted drafts
    then the correction (first mismatch) or the bonus token (all matched).
    """
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(f"need K+1 = {len(drafts) + 1} target tokens, got {len(target_argmax)}")
    a = 0
    while a < len(drafts) and int(drafts[a]) == int(target_argmax[a]):
        a += 1
    return a, [int(d) for d in drafts[:a]] + [int(target_argmax[a])]


def verify_sampled(
    p: torch.Tensor,  # [K+1, V] target probabilities (after temperature/top-k/top-p/min-p)
    drafts: Sequence[int],  # K drafts
    q: torch.Tensor | None,  # [K, V] draft probabilities; None = deterministic drafter (one-hot q)
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """Rejection sampling of K drafts; returns (number accepted, tokens to emit).

    The generator must live on `p`'s device. It draws K uniforms, then one token (the
    correction or the bonus), so its use per step depends only on K.
    """
    k = len(drafts)
    if p.shape[0] != k + 1 or (q is not None and q.shape[0] != k):
        raise ValueError(f"need p [K+1, V] and q [K, V] for K = {k}, got p {tuple(p.shape)}, "
                         f"q {None if q is None else tuple(q.shape)}")
    p = p.float()
    if k:
        d = torch.tensor([int(t) for t in drafts], device=p.device)
        rows = torch.arange(k, device=p.device)
        u = torch.rand(k, generator=generator, device=p.device)
        p_d = p[rows, d]
        if q is not None:
            q = q.float()
            q_d = q[rows, d]
            # A row of q that is not a distribution, or has no mass at its draft (which then
            # cannot have been drawn from it), is read as a deterministic proposal: one-hot q.
            bad = ~(torch.isfinite(q).all(dim=-1) & (q >= 0).all(dim=-1) & (q_d > 0))
            if bool(bad.any()):
                one_hot = torch.zeros_like(q).scatter_(-1, d[:, None], 1.0)
                q = torch.where(bad[:, None], one_hot, q)
                q_d = torch.where(bad, torch.ones_like(q_d), q_d)
        else:
            q_d = torch.ones_like(p_d)
        # accept with prob min(1, p/q): u < p/q  <=>  u * q < p  (no division; q_d > 0 here)
        accept = (u * q_d < p_d).tolist()
        for i, ok in enumerate(accept):
            if ok:
                continue
            residual = p[i].clone()
            if q is None:
                residual[int(drafts[i])] = 0.0
            else:
                residual = (residual - q[i]).clamp_min(0.0)
            if float(residual.sum()) <= 0:  # p <= q everywhere: only reachable through rounding
                residual = p[i]
            tok = int(torch.multinomial(residual, 1, generator=generator))
            return i, [int(t) for t in drafts[:i]] + [tok]
    bonus = int(torch.multinomial(p[k], 1, generator=generator))
    return k, [int(t) for t in drafts] + [bonus]
