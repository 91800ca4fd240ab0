"""`--num-speculative-tokens auto`: which K (0..max) the next step drafts; pure Python.

Speculation pays when the tokens a step emits grow faster than the step's cost. For a
batch of B decoding requests drafting K tokens each, with per-depth acceptance
probabilities a_1..a_K (a_i: draft i is accepted given drafts 1..i-1 were),

    tokens per step   E_K = B * (1 + a_1 + a_1 a_2 + ... + a_1 ... a_K)
    cost per step     C_K = verify(B * (1 + K)) + draft(B, K) + overhead
    throughput        E_K / C_K

`verify(T)` is the measured cost of a main-model dispatch of T decode tokens,
`draft(B, K)` that of the MTP dispatches (one over about B * E_K / B accepted rows, then
K - 1 over B rows), `overhead` the rest of an engine step. Costs start from a
calibration at startup and follow the running steps (exponential moving averages keyed by
token count, linearly interpolated in between); acceptance follows the verified drafts.
`choose(B)` returns the K with the highest throughput, keeping the current K unless
another is better by `hysteresis`, so noise does not make it flap.

While K = 0 nothing measures acceptance, so after `probe_interval` steps at K = 0 the
policy drafts with K = 1 for `probe_steps` steps (the cost of finding out that
speculation started to pay, about 1% of steps).

Nothing here changes outputs: greedy tokens do not depend on K, and rejection sampling
keeps the sampled distribution for any K.
"""

from __future__ import annotations

from bisect import bisect_left

ACCEPTANCE_PRIOR = (0.6, 0.5, 0.45)  # the embedded model's card; any prior is refined by data


class CostTable:
    """Seconds by token (or row) count: moving averages at measured counts, linear in between."""

    def __init__(self, alpha: float = 0.1):
        self.alpha = alpha
        self.points: dict[int, float] = {}

    def observe(self, n: int, seconds: float) -> None:
        old = self.points.get(n)
        self.points[n] = seconds if old is None else old + self.alpha * (seconds - old)

    def __call__(self, n: float) -> float:
        """Estimated cost at count `n` (0 at n <= 0; extrapolated along the last segment)."""
        if n <= 0 or not self.points:
            return 0.0
        xs = sorted(self.points)
        if len(xs) == 1:
            return self.points[xs[0]] * n / xs[0]
        i = min(max(bisect_left(xs, n), 1), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = self.points[x0], self.points[x1]
        return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


class SpecPolicy:
    """Chooses K per step from step costs and the running acceptance (see module docstring)."""

    def __init__(self, max_k: int, *, prior: tuple[float, ...] = ACCEPTANCE_PRIOR, prior_weight: float = 20.0,
                 decay: float = 0.995, hysteresis: float = 0.03, probe_interval: int = 256, probe_steps: int = 8):
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        self.max_k = max_k
        self.verify = CostTable()  # main-model dispatch + sampling/verification, by decode tokens
        self.draft = CostTable()  # one MTP dispatch, by rows
        self.overhead = 0.0  # the rest of an engine step (scheduling, detokenizing), seconds
        p = [prior[min(i, len(prior) - 1)] for i in range(max_k)]
        self._tried = [prior_weight] * max_k  # decayed counts per depth
        self._accepted = [prior_weight * a for a in p]
        self.decay = decay
        self.hysteresis = hysteresis
        self.probe_interval, self.probe_steps = probe_interval, probe_steps
        self.k = 1 if max_k >= 1 else 0  # the K in use
        self._zero_run = 0  # consecutive steps at K = 0
        self._probe_left = 0

    # ---------------------------------------------------------------- observations
    def observe_verify(self, drafted: int, accepted: int) -> None:
        """One request verified `drafted` drafts and accepted the first `accepted`."""
        for i in range(min(drafted, self.max_k)):
            if i > accepted:  # depth i + 1 was not reached (an earlier draft was rejected)
                break
            self._tried[i] = self._tried[i] * self.decay + 1.0
            self._accepted[i] = self._accepted[i] * self.decay + (1.0 if i < accepted else 0.0)

    def observe_overhead(self, seconds: float) -> None:
        self.overhead += 0.1 * (seconds - self.overhead)

    @property
    def acceptance(self) -> list[float]:
        """Estimated a_1..a_max_k (conditional acceptance per depth)."""
        return [a / t if t > 0 else 0.0 for a, t in zip(self._accepted, self._tried)]

    # ---------------------------------------------------------------- the choice
    def expected_tokens(self, k: int) -> float:
        """Tokens one request emits per step with K = k: 1 + a_1 + a_1 a_2 + ..."""
        e, run = 1.0, 1.0
        for a in self.acceptance[:k]:
            run *= a
            e += run
        return e

    def step_cost(self, batch: int, k: int) -> float:
        """Estimated seconds of a decode step of `batch` requests drafting `k` tokens each."""
        cost = self.verify(batch * (1 + k)) + self.overhead
        if k > 0:
            cost += self.draft(batch * self.expected_tokens(k)) + (k - 1) * self.draft(batch)
        return cost

    def throughput(self, batch: int, k: int) -> float:
        """Estimated tokens per second at `batch` requests and K = k."""
        c = self.step_cost(batch, k)
        return batch * self.expected_tokens(k) / c if c > 0 else 0.0

    def choose(self, batch: int) -> int:
        """The K for the next step's drafts, for `batch` decoding requests."""
        if self.max_k == 0 or batch <= 0 or not self.verify.points:
            return self.k
        rates = [self.throughput(batch, k) for k in range(self.max_k + 1)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        if best != self.k and rates[best] < rates[self.k] * (1 + self.hysteresis):
            best = self.k  # not better by enough: keep the current K
        if best == 0:
            self._zero_run += 1
            if self._probe_left == 0 and self._zero_run >= self.probe_interval:
                self._probe_left, self._zero_run = self.probe_steps, 0
            if self._probe_left > 0:
                self._probe_left -= 1
                self.k = 0  # the K the policy believes in stays 0; this step probes
                return 1
        else:
            self._zero_run, self._probe_left = 0, 0
        self.k = best
        return best
