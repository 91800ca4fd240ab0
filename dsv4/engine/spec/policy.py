"""`--num-speculative-tokens auto`: which K (0..max) the next step drafts; pure Python.

For B decoding requests drafting K each, with per-depth acceptance a_i: tokens per step
E_K = B * (1 + a_1 + a_1 a_2 + ... + a_1 ... a_K), cost per step C_K = verify(B(1+K)) +
verify_host(B(1+K)) + draft(B, K) + overhead. Each cost is a `CostTable`: a shape from the
startup calibration (`calibration.py`) times a level that every timed step moves.
`choose(B)` returns the K with the highest E_K / C_K, keeping the current K unless another
is better by `hysteresis`; the rates are computed again when what they depend on moves
(the batch, a verified draft, the backlog's size, a cost table's shape) or every
`refresh` steps. Restarting
drafts after K = 0 costs the MTP's catch-up over its backlog, spread over `horizon` steps.
Probes (K - 1 or K + 1 for `probe_steps` steps after `probe_interval`) keep acceptance and
the cost shape measured; while probes keep finding the probed K below `far` of the best
(judged once each probe's steps are timed), the wait doubles (up to `max_backoff`
doublings; a new K starts again at `probe_interval`). Acceptance starts from priors weighed as
`prior_weight` drafts per depth.

Nothing here changes outputs: greedy tokens do not depend on K, and rejection sampling keeps
the sampled distribution for any K. Details: docs/serving.md, 'dsv4/engine/spec/policy.py'.
"""

from __future__ import annotations

from bisect import bisect_left

# conditional acceptance per depth of the embedded model's MTP at K = 3 on held-out text (8 256-token
# Shakespeare prompts x 2, 64 tokens each, ~400 drafts a depth): greedy (argmax) drafts, and drafts sampled
# from the MTP's distribution under the model's default sampling, which are accepted more often and
# more evenly across depths; any prior is refined by data
ACCEPTANCE_PRIOR = (0.64, 0.54, 0.58)
SAMPLED_ACCEPTANCE_PRIOR = (0.69, 0.67, 0.69)


class CostTable:
    """Seconds by token (or row) count: `level` times a shape, linear between the counts known.

    `calibrate(n, s)` sets the shape at n (the startup measurement). `observe(n, s)` takes a
    running one. When a different count was observed among the last `contrast`
    observations (a K switch or a probe: the level is today's), it corrects the shape at n
    (how the costs of two counts compare while serving, which calibration cannot replay
    exactly); otherwise it moves the level (a moving average of measured / shape, so one
    count's timings move every estimate and the counts not in use do not go stale). A
    count observed first joins the shape as measured."""

    def __init__(self, alpha: float = 0.1, contrast: int = 4):
        self.alpha, self.contrast = alpha, contrast
        self.shape: dict[int, float] = {}
        self.level = 1.0
        self.observed = 0  # observations that moved the level
        self._recent: list[int] = []  # the counts of the last `contrast` observations
        self._contrasts: dict[int, int] = {}  # shape corrections by count
        self._xs: list[int] = []  # the counts known, sorted (choose() reads the table ~10 times a step)
        self.version = 0  # moves when the shape moves (set, a count joins, a contrast), not the level

    def calibrate(self, n: int, seconds: float) -> None:
        self.shape[n] = seconds
        self._xs = sorted(self.shape)
        self.version += 1

    def observe(self, n: int, seconds: float) -> None:
        if n not in self.shape:
            self.shape[n] = seconds / self.level
            self._xs = sorted(self.shape)
            self.version += 1
        elif any(m != n for m in self._recent):  # a contrast: the shape (the calibration weighs as one)
            c = self._contrasts[n] = self._contrasts.get(n, 0) + 1
            self.shape[n] += max(self.alpha, 1.0 / (c + 1)) * (seconds / self.level - self.shape[n])
            self.version += 1
        else:  # the level: its first observations average plainly, then a moving average
            self.observed += 1
            self.level += max(self.alpha, 1.0 / self.observed) * (seconds / self.shape[n] - self.level)
        self._recent = (self._recent + [n])[-self.contrast:]

    @property
    def points(self) -> dict[int, float]:
        """The current estimates at the counts known."""
        return {n: s * self.level for n, s in self.shape.items()}

    def __call__(self, n: float) -> float:
        """Estimated cost at count `n` (0 at n <= 0; extrapolated along the last segment)."""
        return _interp(self.shape, self._xs, n) * self.level


def _interp(points: dict[int, float], xs: list[int], n: float) -> float:
    """`points` at `n`, linear between its counts `xs` (sorted)."""
    if n <= 0 or not xs:
        return 0.0
    if len(xs) == 1:
        return points[xs[0]] * n / xs[0]
    i = min(max(bisect_left(xs, n), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def _moved(average: float, seconds: float, alpha: float = 0.1) -> float:
    """A moving average of seconds, one observation on."""
    return average + alpha * (seconds - average)


class SpecPolicy:
    """Chooses K per step from step costs and the running acceptance (see module docstring)."""

    def __init__(self, max_k: int, *, prior: tuple[float, ...] = ACCEPTANCE_PRIOR,
                 sampled_prior: tuple[float, ...] = SAMPLED_ACCEPTANCE_PRIOR, prior_weight: float = 16.0,
                 decay: float = 0.995, hysteresis: float = 0.03, probe_interval: int = 256, probe_steps: int = 4,
                 first_probe: int = 64, horizon: int = 32, refresh: int = 16, far: float = 0.85,
                 max_backoff: int = 3):
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        self.max_k = max_k
        self.verify = CostTable()  # main-model dispatch, by decode tokens
        self.verify_host = CostTable()  # choosing the tokens of a decode step's rows (sampling, verification)
        self.draft = CostTable()  # one MTP dispatch, by rows
        self.draft_host = CostTable()  # proposing one draft per row after an MTP dispatch
        self.overhead = 0.0  # the rest of an engine step (scheduling, detokenizing), seconds
        self.draft_extra = 0.0  # a drafting step's MTP work outside its dispatches (bookkeeping), seconds
        self.backlog_rows = 0  # pairs the MTP skipped at K = 0 and runs before drafting again (the runner's)
        self.horizon = horizon  # steps a K > 0 chosen after K = 0 is expected to last (amortises the catch-up)
        per_depth = lambda pr: [pr[min(i, len(pr) - 1)] for i in range(max_k)]  # noqa: E731
        # decayed counts per depth, of greedy drafts (argmax) and of sampled ones (drawn from q):
        # their acceptance differs, and a request mix of one kind says little about the other
        self._tried, self._accepted = [prior_weight] * max_k, [prior_weight * a for a in per_depth(prior)]
        self._tried_s, self._accepted_s = [prior_weight] * max_k, [prior_weight * a for a in per_depth(sampled_prior)]
        self.sampled_share = 0.0  # of the decoding requests, as the last `choose` was told
        self.decay = decay
        self.hysteresis = hysteresis
        self.probe_interval, self.probe_steps = probe_interval, probe_steps
        self.far, self.max_backoff = far, max_backoff
        self._far_streak = 0  # probes in a row that found the probed K below `far` of the best
        self._judge = False  # the last probe step was returned: the next choice judges the probe
        self._next_probe = first_probe  # steps at one K before the next probe (the first comes early)
        self.refresh = refresh
        self._verified = 0  # verified requests so far: a new one can move the acceptance
        self._rates: list[float] = []  # tokens/s by K, as last computed, for `_rates_key`
        self._rates_key: tuple[int, ...] | None = None
        self._rates_age = 0  # choices that reused `_rates`
        self.k = 1 if max_k >= 1 else 0  # the K in use
        self._run = 0  # consecutive steps at this K
        self._probe_left = self._probe_k = self._probes = 0  # probe steps left, at K = _probe_k; probes so far

    # ---------------------------------------------------------------- observations
    def observe_verify(self, drafted: int, accepted: int, sampled: bool = False) -> None:
        """One request verified `drafted` drafts and accepted the first `accepted` (`sampled`:
        its drafts were drawn from the MTP's distribution, not its argmax)."""
        tried, acc = self._counts(sampled)
        self._verified += 1
        for i in range(min(drafted, self.max_k)):
            if i > accepted:  # depth i + 1 was not reached (an earlier draft was rejected)
                break
            tried[i] = tried[i] * self.decay + 1.0
            acc[i] = acc[i] * self.decay + (1.0 if i < accepted else 0.0)

    def observe_overhead(self, seconds: float) -> None:
        self.overhead = _moved(self.overhead, seconds)

    def observe_draft_extra(self, seconds: float) -> None:
        self.draft_extra = _moved(self.draft_extra, seconds)

    def _counts(self, sampled: bool) -> tuple[list[float], list[float]]:
        """(tried, accepted) per depth of sampled or greedy drafts."""
        return (self._tried_s, self._accepted_s) if sampled else (self._tried, self._accepted)

    def acceptance_of(self, sampled: bool) -> list[float]:
        """Estimated a_1..a_max_k (conditional acceptance per depth) of greedy or sampled drafts."""
        tried, acc = self._counts(sampled)
        return [a / t if t > 0 else 0.0 for a, t in zip(acc, tried)]

    @property
    def acceptance(self) -> list[float]:
        """a_1..a_max_k of the current request mix (`sampled_share`), per depth."""
        return self._mix(self.acceptance_of(False), self.acceptance_of(True))

    def _mix(self, greedy: list[float], sampled: list[float]) -> list[float]:
        """Per-kind figures averaged over the request mix (`sampled_share` of them sampled)."""
        w = self.sampled_share
        return [(1 - w) * a + w * b for a, b in zip(greedy, sampled)] if w else greedy

    # ---------------------------------------------------------------- the choice
    def expected_tokens_all(self) -> list[float]:
        """Tokens one request emits per step with K = 0..max_k, 1 + a_1 + a_1 a_2 + ...,
        averaged over the request mix (greedy and sampled drafts each with their own acceptance)."""
        def one(acceptance: list[float]) -> list[float]:
            out, run = [1.0], 1.0
            for a in acceptance:
                run *= a
                out.append(out[-1] + run)
            return out
        return self._mix(one(self.acceptance_of(False)), one(self.acceptance_of(True)))

    def expected_tokens(self, k: int) -> float:
        """Tokens one request emits per step with K = k (`expected_tokens_all`)."""
        return self.expected_tokens_all()[k]

    def step_cost(self, batch: int, k: int, expected: float | None = None) -> float:
        """Estimated seconds of a decode step of `batch` requests drafting `k` tokens each
        (`expected`: `expected_tokens(k)`, when the caller has it)."""
        cost = self.verify(batch * (1 + k)) + self.verify_host(batch * (1 + k)) + self.overhead
        if k > 0:
            e = self.expected_tokens(k) if expected is None else expected
            cost += (self.draft(batch * e) + (k - 1) * self.draft(batch)
                     + k * self.draft_host(batch) + self.draft_extra)
        return cost

    def throughput(self, batch: int, k: int, expected: float | None = None) -> float:
        """Estimated tokens per second at `batch` requests and K = k (a K > 0 after K = 0 pays
        the MTP's catch-up over `backlog_rows`, spread over `horizon` steps)."""
        e = self.expected_tokens(k) if expected is None else expected
        c = self.step_cost(batch, k, e)
        if k > 0 and self.backlog_rows > 0:
            c += self.draft(self.backlog_rows) / self.horizon
        return batch * e / c if c > 0 else 0.0

    def _current_rates(self, batch: int, sampled: int) -> list[float]:
        """Tokens/s by K (`throughput`), computed again only when the batch, the verified
        drafts, the backlog's size or a cost table's shape moved, or `refresh` choices on: at
        a steady K = 0 (every window of the backlog full) only the cost tables' levels move,
        and slowly (moving averages)."""
        key = (batch, sampled, self._verified, self.backlog_rows, self.verify.version,
               self.verify_host.version, self.draft.version, self.draft_host.version)
        if key != self._rates_key or self._rates_age >= self.refresh:
            self._rates = [self.throughput(batch, k, e) for k, e in enumerate(self.expected_tokens_all())]
            self._rates_key, self._rates_age = key, 0
        self._rates_age += 1
        return self._rates

    def choose(self, batch: int, sampled: int = 0) -> int:
        """The K for the next step's drafts, for `batch` decoding requests of which `sampled`
        draw their drafts."""
        if self.max_k == 0 or batch <= 0 or not self.verify.shape:
            return self.k
        self.sampled_share = min(max(sampled, 0), batch) / batch
        rates = self._current_rates(batch, sampled)
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        if best != self.k and rates[best] < rates[self.k] * (1 + self.hysteresis):
            best = self.k  # not better by enough: keep the current K
        if best != self.k:  # a new K: its neighbours are probed at the usual interval
            self._run, self._far_streak = 1, 0
            self._next_probe = min(self._next_probe, self.probe_interval)
        else:
            self._run += 1
        if self._judge:  # the probe's steps are timed now: what it found sets the wait for the next
            self._judge = False
            far = rates[self._probe_k] < self.far * rates[best]
            self._far_streak = self._far_streak + 1 if far else 0
            # two far findings in a row (not one: noise) double the wait, and so on
            self._next_probe = self.probe_interval << min(max(self._far_streak - 1, 0), self.max_backoff)
        if self._probe_left == 0 and self._run >= self._next_probe:
            down = best == self.max_k or (best > 0 and self._probes % 2 == 0)  # K - 1 and K + 1 in turn
            self._probe_k, self._probes = best - 1 if down else best + 1, self._probes + 1
            self._probe_left, self._run, self._next_probe = self.probe_steps, 0, self.probe_interval
        self.k = best
        if self._probe_left > 0:  # the K the policy believes in stays; this step probes
            self._probe_left -= 1
            self._judge = self._probe_left == 0
            return self._probe_k
        return best
