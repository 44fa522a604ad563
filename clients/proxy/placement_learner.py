"""The placement's weights, fitted to the first-token times this proxy sees (on unless ``--no-placement-learn``).

The data-parallel rule (``common/placement.py``) prices a request on engine
``e`` in prompt-token equivalents: ``computed + pull_fixed_tokens +
pull_token_cost * pulled + busy_tokens * load`` (the pull terms only where it
pulls). Its three weights are ratios of times: what one request in flight
costs, what a pull waits whatever its size, and what one pulled token costs,
each against computing one prompt token. Every streamed answer that the
placed engine served tells the proxy one more point of

    ttft = s_token * computed + s_pull * pulled + s_fixed * (pulled > 0) + s_request * load + base

(the terms as the placement saw them, the time from sending the request to
its first byte). ``PlacementLearner`` keeps a least-squares fit of that line,
recent answers weighing more (half-life ``half_life`` answers), and, once it
has ``min_samples`` answers and a positive ``s_token``, uses
``busy_tokens = s_request / s_token`` (after ``min_pulls`` answers placed on
a busy engine), ``pull_token_cost = s_pull / s_token`` (after ``min_pulls``
answers that pulled) and ``pull_fixed_tokens = s_fixed / s_token`` (after
as many that pulled and as many that did not): a term never seen varying is
not learned. The fixed term is the lease, the holder's and the reader's
steps: where engines share cores it is hundreds of milliseconds, and the
setting, made for engines on cores of their own, keeps moving turns whose
pull then waits longer than the holder's queue would have. Each learned
weight stays within ``clamp`` times the configured one either way, so a
noisy fit cannot turn the rule upside down; until then the configured
weights hold.
Non-streamed answers are not used: their first byte is their last.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kvbroker.common.linalg import solve
from kvbroker.common.placement import Placement, PlacementRule

# Features are scaled so the normal equations stay well conditioned: tokens in thousands.
_TOKENS = 1000.0
# Features: computed (thousands of tokens), pulled (thousands), pulled at all (0 or 1), load, 1.
_N = 5
# A whisper of ridge: a feature that never varied (no pulls yet) does not make the system singular.
_RIDGE = 1e-6


@dataclasses.dataclass
class PlacementLearner:
    base: PlacementRule
    learn: bool = True
    half_life: float = 200.0  # answers
    min_samples: int = 30
    min_pulls: int = 5
    clamp: float = 8.0
    samples: int = 0
    pulls: int = 0
    loaded: int = 0  # answers placed on an engine with requests in flight
    _xtx: list[list[float]] = dataclasses.field(default_factory=lambda: [[0.0] * _N for _ in range(_N)])
    _xty: list[float] = dataclasses.field(default_factory=lambda: [0.0] * _N)
    _rule: PlacementRule | None = None

    def rule(self) -> PlacementRule:
        """The rule to place the next request with: learned weights where the fit allows."""
        return self._rule or self.base

    def served(
        self, placed: Placement | None, served_first: bool, streamed: bool, seconds: float | None
    ) -> None:
        """A request placed by ``placed`` was answered: learn from it if it says anything."""
        if not self.learn or placed is None or not placed.terms or not placed.order:
            return
        if not (served_first and streamed) or seconds is None or not math.isfinite(seconds) or seconds < 0:
            return
        computed, pulled, load = placed.terms[placed.order[0]]
        self.observe(computed, pulled, load, seconds)

    def observe(self, computed: int, pulled: int, load: float, seconds: float) -> None:
        x = [computed / _TOKENS, pulled / _TOKENS, 1.0 if pulled > 0 else 0.0, load, 1.0]
        keep = 0.5 ** (1.0 / self.half_life)
        for i in range(_N):
            self._xty[i] = keep * self._xty[i] + x[i] * seconds
            for j in range(_N):
                self._xtx[i][j] = keep * self._xtx[i][j] + x[i] * x[j]
        self.samples += 1
        self.pulls += pulled > 0
        self.loaded += load > 0
        self._rule = self._fit()

    def coefficients(self) -> Sequence[float] | None:
        """(s_token, s_pull, s_fixed, s_request, base): seconds per computed or pulled token, per pull,
        per request in flight, and the rest; None before a fit."""
        m = [[v + (_RIDGE if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._xtx)]
        solved = solve(m, self._xty)
        if solved is None:
            return None
        return (solved[0] / _TOKENS, solved[1] / _TOKENS, solved[2], solved[3], solved[4])

    def _fit(self) -> PlacementRule | None:
        if self.samples < self.min_samples:
            return None
        fit = self.coefficients()
        if fit is None or fit[0] <= 0:
            return None
        s_token, s_pull, s_fixed, s_request, _ = fit
        base = self.base
        busy, pull, fixed = base.busy_tokens, base.pull_token_cost, base.pull_fixed_tokens
        if self.loaded >= self.min_pulls:
            busy = self._bounded(s_request / s_token, base.busy_tokens)
        if self.pulls >= self.min_pulls:
            pull = self._bounded(s_pull / s_token, base.pull_token_cost)
            if self.samples - self.pulls >= self.min_pulls:  # the indicator varied: both values seen
                fixed = self._bounded(s_fixed / s_token, base.pull_fixed_tokens)
        return dataclasses.replace(base, busy_tokens=busy, pull_token_cost=pull, pull_fixed_tokens=fixed)

    def _bounded(self, value: float, configured: float) -> float:
        low, high = configured / self.clamp, configured * self.clamp
        return min(high, max(low, value)) if math.isfinite(value) else configured
