"""What a prefill and a pull cost on this engine, learned from what it observes.

Two small online models, both cheap enough for vLLM's scheduler loop (every
update and prediction is O(1); nothing blocks, nothing does I/O):

- ``PrefillModel``: seconds of one engine step as
  ``a + b * new_tokens + c * attention`` where ``attention`` is the sum over the
  step's requests of ``new * (context + new / 2)`` (the token pairs attention
  touches). Fitted by least squares over the engine's own steps, older steps
  weighing less (half-life ``STEP_HALF_LIFE_S``). A step's time is the gap
  between its ``build_connector_meta`` (the end of the schedule) and the
  ``update_connector_output`` of its output (``StepTimer``): the forward pass
  and sampling, never idle time, whatever the engine's role. A prefill-only
  engine (P, whose requests finish in the step that computes them) learns from
  every prefill; a decode-only engine (D) learns ``a`` and ``c`` from its decode
  steps and, until it has timed a prefill of its own, predicts with the
  coefficients the holder of the prompt timed on its prefills, handed over in
  the holder's kv_transfer_params (``CostModel.seed_prefill``).
- ``PullModel``: seconds of a pull as ``fixed + bytes / bandwidth``, per holder
  and tier, from this engine's own completed pulls (request allocated ->
  blocks received). The fit is pulled towards a prior (the tier-wide fit, and
  for that the constants below) with the weight of ``PRIOR_WEIGHT``
  observations, and observations fade (half-life ``PULL_HALF_LIFE_S``), so a
  holder that turned slow is tried again once its slow spell is old: the
  estimate drifts back to the tier's and a pull measures it afresh.
- A holder's load (``HolderMatch.load``: the requests its scheduler works on,
  engine_adapter/own_load.py) stretches a pull from it:
  ``seconds = idle estimate * (1 + slope * load)``. The slope is learned per
  holder and tier from pulls made at a load above 0 (each gives the ratio of
  its time to the idle estimate), pulled towards the tier's slope and that
  towards ``PRIOR_LOAD_SLOPE``, and fades like the pull fits; a pull's time
  divided by its factor is what the idle fit learns. The load of a pull is
  the one its decision weighed (``CostModel.pull_started``). Unlike a slow
  spell, a busy spell needs no fading to end: when the holder reports itself
  idle again, its estimate is the idle one at once.

``ready`` says whether the prefill model has seen enough to be trusted (or a
holder's timings seed it); until then the policy (pull_policy.py) falls back to
the fixed ``kv_recompute_threshold`` and says so (``decided_by``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvbroker.common.linalg import solve
from kvbroker.v1 import broker_pb2 as pb

# A pull that was never observed is assumed to cost this much plus its bytes at
# PRIOR_BANDWIDTH (one lease acquire and release on the broker and two engine
# steps, which is what a pull of a few blocks costs on the CPU build).
PRIOR_PULL_FIXED_S = 0.025
PRIOR_BANDWIDTH_BPS = 2e9
PRIOR_WEIGHT = 1.0
# The prior enters the pull fit as pseudo-observations of an empty pull and of
# one of this size, so that it holds the slope as firmly as real pulls do.
PRIOR_REF_MB = 16.0
PULL_HALF_LIFE_S = 60.0
# Until pulls from a busy holder are observed, each request it works on adds this
# fraction to a pull's time (a holder running 10 requests: twice the idle time).
PRIOR_LOAD_SLOPE = 0.1
# The prior enters the slope fit as a pseudo-observation at this load, of weight PRIOR_WEIGHT.
PRIOR_LOAD_REF = 4.0
STEP_HALF_LIFE_S = 300.0
# The prefill model is trusted once it has timed one prefill of at least
# PREFILL_MIN_TOKENS tokens (decode steps alone say nothing of b and c): a
# prefill-only engine times one step per request, and the reader it hands its
# fit to decides on the first turn. Until MIN_STEPS steps are timed the fit is
# proportional (b alone); from then on all three terms.
MIN_STEPS = 4
PREFILL_MIN_TOKENS = 16
# Feature scales keep the normal equations well conditioned.
_TOKENS = 1e3
_PAIRS = 1e6
_MB = 1e6
_RIDGE = 1e-6
# No pull is taken to move more than 100 GB/s: a fit whose slope is lost in the
# noise of the fixed part (small blocks) would otherwise claim any bandwidth.
_MIN_S_PER_MB = 1e-5


def _decay(half_life_s: float, dt: float) -> float:
    return 0.5 ** (max(0.0, dt) / half_life_s)


def attention_pairs(new_tokens: int, context_tokens: int) -> float:
    return new_tokens * (context_tokens + new_tokens / 2.0)


@dataclass
class PrefillModel:
    """Step seconds ~ a + b * tokens + c * attention pairs (decayed least squares)."""

    steps: int = 0
    # Steps of at least PREFILL_MIN_TOKENS tokens: those that teach b and c (decode steps do not).
    prefill_steps: int = 0
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 3)
    _last: float | None = None
    _coef: tuple[float, float, float] | None = None

    def observe(self, now: float, seconds: float, work: Iterable[tuple[int, int]]) -> None:
        """One step that took ``seconds`` and computed ``(new_tokens, context_tokens)`` per request."""
        tokens = 0
        pairs = 0.0
        for new, context in work:
            tokens += new
            pairs += attention_pairs(new, context)
        if tokens <= 0 or seconds <= 0:
            return
        if self._last is not None:
            f = _decay(STEP_HALF_LIFE_S, now - self._last)
            self._xtx = [[x * f for x in row] for row in self._xtx]
            self._xty = [x * f for x in self._xty]
        self._last = now
        x = (1.0, tokens / _TOKENS, pairs / _PAIRS)
        for i in range(3):
            self._xty[i] += x[i] * seconds
            for j in range(3):
                self._xtx[i][j] += x[i] * x[j]
        self.steps += 1
        if tokens >= PREFILL_MIN_TOKENS:
            self.prefill_steps += 1
        self._coef = None

    @property
    def ready(self) -> bool:
        return self.prefill_steps >= 1

    def coefficients(self) -> tuple[float, float, float]:
        """(a seconds, b seconds per 1k tokens, c seconds per 1M pairs), each >= 0."""
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> tuple[float, float, float]:
        # Fit all three; a negative term (too few kinds of step to tell them
        # apart) is dropped and the rest refitted, so predictions never shrink
        # as a prompt grows.
        for keep in ((0, 1, 2), (0, 1), (1,)) if self.steps >= MIN_STEPS else ((1,),):
            m = [[self._xtx[i][j] + (_RIDGE if i == j else 0.0) for j in keep] for i in keep]
            sol = solve(m, [self._xty[i] for i in keep])
            if sol is not None and all(s >= 0 for s in sol):
                coef = [0.0, 0.0, 0.0]
                for i, s in zip(keep, sol, strict=True):
                    coef[i] = s
                return coef[0], coef[1], coef[2]
        return 0.0, 0.0, 0.0

    def predict(self, new_tokens: int, context_tokens: int, chunk_tokens: int = 0) -> float:
        """Seconds to compute ``new_tokens`` after ``context_tokens``, in chunks of ``chunk_tokens``."""
        return predict_with(self.coefficients(), new_tokens, context_tokens, chunk_tokens)


def predict_with(
    coef: tuple[float, float, float], new_tokens: int, context_tokens: int, chunk_tokens: int = 0
) -> float:
    """One step per chunk; the chunks' attention pairs add up to those of one
    step over all the new tokens, so this is O(1) however many chunks."""
    if new_tokens <= 0:
        return 0.0
    a, b, c = coef
    chunks = -(-new_tokens // chunk_tokens) if chunk_tokens > 0 else 1
    return chunks * a + b * new_tokens / _TOKENS + c * attention_pairs(new_tokens, context_tokens) / _PAIRS


@dataclass
class _PullFit:
    """seconds ~ fixed + per_mb * megabytes; decayed sums, fitted against a prior."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    last: float | None = None
    observations: int = 0

    def add(self, now: float, megabytes: float, seconds: float) -> None:
        self.fade(now)
        self.w += 1.0
        self.sx += megabytes
        self.sy += seconds
        self.sxx += megabytes * megabytes
        self.sxy += megabytes * seconds
        self.observations += 1

    def fade(self, now: float) -> None:
        if self.last is not None:
            f = _decay(PULL_HALF_LIFE_S, now - self.last)
            self.w, self.sx, self.sy, self.sxx, self.sxy = (
                self.w * f,
                self.sx * f,
                self.sy * f,
                self.sxx * f,
                self.sxy * f,
            )
        self.last = now

    def weight(self, now: float) -> float:
        return self.w * (_decay(PULL_HALF_LIFE_S, now - self.last) if self.last is not None else 1.0)

    def fit(self, now: float, prior: tuple[float, float]) -> tuple[float, float]:
        """(fixed s, s per MB): least squares over the faded observations and the prior's
        pseudo-observations (weight PRIOR_WEIGHT / 2 each at 0 and PRIOR_REF_MB)."""
        f = _decay(PULL_HALF_LIFE_S, now - self.last) if self.last is not None else 1.0
        p0, p1 = prior
        h, x1 = PRIOR_WEIGHT / 2.0, PRIOR_REF_MB
        y1 = p0 + p1 * x1
        m = [[self.w * f + 2 * h, self.sx * f + h * x1], [self.sx * f + h * x1, self.sxx * f + h * x1 * x1]]
        v = [self.sy * f + h * (p0 + y1), self.sxy * f + h * x1 * y1]
        sol = solve(m, v)
        if sol is None:
            return prior
        return max(0.0, sol[0]), max(_MIN_S_PER_MB, sol[1])


@dataclass
class _LoadFit:
    """How load stretches pulls: ratio - 1 ~ slope * load (least squares through 0, faded)."""

    sll: float = 0.0  # sum of load^2
    slr: float = 0.0  # sum of load * (ratio - 1)
    last: float | None = None
    observations: int = 0

    def add(self, now: float, load: float, ratio: float) -> None:
        if self.last is not None:
            f = _decay(PULL_HALF_LIFE_S, now - self.last)
            self.sll, self.slr = self.sll * f, self.slr * f
        self.last = now
        self.sll += load * load
        self.slr += load * (ratio - 1.0)
        self.observations += 1

    def slope(self, now: float, prior: float) -> float:
        f = _decay(PULL_HALF_LIFE_S, now - self.last) if self.last is not None else 1.0
        h = PRIOR_WEIGHT * PRIOR_LOAD_REF * PRIOR_LOAD_REF
        return max(0.0, (self.slr * f + h * prior) / (self.sll * f + h))


@dataclass(frozen=True)
class PullEstimate:
    seconds: float  # at the holder's load (fixed_s and the bytes' part, both times load_factor)
    fixed_s: float
    bandwidth_bps: float  # the idle fit's; at the holder's load a pull moves bytes load_factor times slower
    observations: int  # of this holder and tier (0: the tier's or the prior's figures)
    load_factor: float = 1.0  # 1 + slope * the holder's load


class PullModel:
    """Per (holder, tier) fits, each pulled towards its tier's fit, that towards the constants;
    the same for the load slope."""

    def __init__(self) -> None:
        self._tiers: dict[int, _PullFit] = {}
        self._holders: dict[tuple[str, int], _PullFit] = {}
        self._tier_loads: dict[int, _LoadFit] = {}
        self._holder_loads: dict[tuple[str, int], _LoadFit] = {}

    def observe(
        self, now: float, holder: str, tier: int, nbytes: int, seconds: float, load: float = 0.0
    ) -> None:
        """A pull of ``nbytes`` that took ``seconds`` from a holder at ``load``."""
        if seconds <= 0 or nbytes < 0:
            return
        mb = nbytes / _MB
        idle = self.estimate(now, holder, tier, nbytes).seconds if load > 0 else 0.0
        if idle > 0:
            ratio = seconds / idle
            self._tier_loads.setdefault(tier, _LoadFit()).add(now, load, ratio)
            self._holder_loads.setdefault((holder, tier), _LoadFit()).add(now, load, ratio)
            seconds /= 1.0 + self.load_slope(now, holder, tier) * load  # what it would take idle
        self._tiers.setdefault(tier, _PullFit()).add(now, mb, seconds)
        self._holders.setdefault((holder, tier), _PullFit()).add(now, mb, seconds)

    def load_slope(self, now: float, holder: str, tier: int) -> float:
        prior = PRIOR_LOAD_SLOPE
        tier_fit = self._tier_loads.get(tier)
        if tier_fit is not None:
            prior = tier_fit.slope(now, prior)
        fit = self._holder_loads.get((holder, tier))
        return fit.slope(now, prior) if fit is not None else prior

    def estimate(self, now: float, holder: str, tier: int, nbytes: int, load: float = 0.0) -> PullEstimate:
        prior = (PRIOR_PULL_FIXED_S, _MB / PRIOR_BANDWIDTH_BPS)
        tier_fit = self._tiers.get(tier)
        if tier_fit is not None:
            prior = tier_fit.fit(now, prior)
        fit = self._holders.get((holder, tier))
        fixed, per_mb = fit.fit(now, prior) if fit is not None else prior
        factor = 1.0 + self.load_slope(now, holder, tier) * load if load > 0 else 1.0
        return PullEstimate(
            seconds=(fixed + per_mb * nbytes / _MB) * factor,
            fixed_s=fixed * factor,
            bandwidth_bps=_MB / per_mb,
            observations=fit.observations if fit is not None else 0,
            load_factor=factor,
        )

    def holders(self, now: float) -> dict[str, dict[str, float]]:
        """Current figures per holder and tier, for the stats."""
        out: dict[str, dict[str, float]] = {}
        for (holder, tier), fit in self._holders.items():
            est = self.estimate(now, holder, tier, 0)
            out[f"{holder}/{pb.Tier.Name(tier)}"] = {  # type: ignore[arg-type]
                "fixed_ms": round(est.fixed_s * 1000.0, 3),
                "bandwidth_gbps": round(est.bandwidth_bps / 1e9, 3),
                "weight": round(fit.weight(now), 3),
                "observations": fit.observations,
                "load_slope": round(self.load_slope(now, holder, tier), 4),
            }
        return out


class StepTimer:
    """Times engine steps from the scheduler side: from a step's build_connector_meta (its
    schedule is done) to the update_connector_output of its output (its forward pass and
    sampling are done).

    vLLM calls the two in that order for every step that ran the model, so the
    gap holds the step's compute and no idle time, whether the step's requests
    finished in it (a prefill-only engine) or not. Steps are matched first in,
    first out (with async scheduling the next step is scheduled before the
    previous one's output arrives); at most ``MAX_PENDING`` wait, so a step
    whose output never came (vLLM skips the call when a step had nothing for
    the connector) is dropped, never timed against a later output."""

    MAX_PENDING = 2

    def __init__(self, model: PrefillModel) -> None:
        self._model = model
        # (scheduled at, (new, context) per request, request ids) per step awaiting its output.
        self._pending: deque[tuple[float, list[tuple[int, int]], set[str]]] = deque()
        self._timed_early = False  # the output under way was timed at a request's finish

    def on_step(self, now: float, scheduled: Iterable[tuple[str, int, int]]) -> None:
        """A step is scheduled: ``(request id, new tokens, context tokens)`` per request."""
        scheduled = [(req, new, ctx) for req, new, ctx in scheduled if new > 0]
        if not scheduled:
            return
        if len(self._pending) >= self.MAX_PENDING:
            self._pending.popleft()
        work = [(new, ctx) for _, new, ctx in scheduled]
        self._pending.append((now, work, {req for req, _, _ in scheduled}))

    def on_finished(self, now: float, req_id: str) -> None:
        """A request finished while vLLM handles a step's output: if it was in the oldest
        pending step, that step's forward pass is done, and it is timed now, before the
        request's kv_transfer_params are built (holds.py hands the fit to the reader)."""
        if self._pending and not self._timed_early and req_id in self._pending[0][2]:
            self._observe(now)
            self._timed_early = True

    def on_output(self, now: float) -> None:
        """The output of the oldest pending step arrived (unless on_finished timed it already)."""
        if self._timed_early:
            self._timed_early = False
        elif self._pending:
            self._observe(now)

    def _observe(self, now: float) -> None:
        started, work, _ = self._pending.popleft()
        self._model.observe(now, now - started, work)


class CostModel:
    """The engine's cost figures: prefill (from its steps) and pulls (from its loads)."""

    def __init__(self, *, block_bytes: int = 0, chunk_tokens: int = 0) -> None:
        self.prefill = PrefillModel()
        self.pulls = PullModel()
        self.steps = StepTimer(self.prefill)
        # Bytes one block moves on a pull (all layers, all ranks): from the layout, then from pulls.
        self.block_bytes = block_bytes
        self.chunk_tokens = chunk_tokens  # vLLM's max_num_batched_tokens (0: one chunk)
        # Per holder, the load the last pull decided from it weighed (pull_started).
        self._pull_loads: dict[str, float] = {}
        # A holder's prefill coefficients (seed_prefill), used until this engine's own are ready.
        self._seed: tuple[float, float, float] | None = None
        self.seed_source = ""

    @property
    def ready(self) -> bool:
        return self.prefill.ready or self._seed is not None

    @property
    def prefill_source(self) -> str:
        """Whose timings predict prefills: "own", "holder:<engine id>", or "" (none yet)."""
        if self.prefill.ready:
            return "own"
        return f"holder:{self.seed_source}" if self._seed is not None else ""

    def seed_prefill(self, holder: str, coef: tuple[float, float, float]) -> None:
        """A holder's fitted (a s, b s per 1k tokens, c s per 1M pairs), from its kv_transfer_params.

        The holder runs the same model (a reader refuses another layout) and timed
        the prefills this engine would otherwise recompute; a decode-only engine
        never times one of its own. The latest holder's figures win; this
        engine's own fit wins as soon as it is ready."""
        if all(math.isfinite(x) and x >= 0 for x in coef) and any(x > 0 for x in coef):
            self._seed = coef
            self.seed_source = holder

    def prefill_coefficients(self) -> tuple[float, float, float] | None:
        """This engine's own fit once ready, else a holder's seed, else None."""
        if self.prefill.ready:
            return self.prefill.coefficients()
        return self._seed

    def pull_started(self, holder: str, load: float) -> None:
        """A pull from ``holder`` starts, decided at this holder load: its observation is made at it.
        (Pulls from one holder that overlap take the latest one's load.)"""
        self._pull_loads[holder] = load

    def observe_pull(
        self, now: float, holder: str, tier: int, blocks: int, nbytes: int, seconds: float
    ) -> None:
        if blocks > 0 and nbytes > 0:
            self.block_bytes = math.ceil(nbytes / blocks)  # what a pull really moves wins
        self.pulls.observe(now, holder, tier, nbytes, seconds, self._pull_loads.get(holder, 0.0))

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        coef = self.prefill_coefficients()
        if coef is None:
            return self.prefill.predict(new_tokens, context_tokens, self.chunk_tokens)
        return predict_with(coef, new_tokens, context_tokens, self.chunk_tokens)

    def pull(self, now: float, holder: str, tier: int, blocks: int, load: float = 0.0) -> PullEstimate:
        return self.pulls.estimate(now, holder, tier, blocks * self.block_bytes, load)

    def snapshot(self, now: float) -> dict[str, object]:
        a, b, c = self.prefill_coefficients() or self.prefill.coefficients()
        return {
            "prefill_ready": self.ready,
            "prefill_source": self.prefill_source,
            "prefill_steps": self.prefill.prefill_steps,
            "steps": self.prefill.steps,
            "step_ms": round(a * 1000.0, 3),
            "ms_per_1k_tokens": round(b * 1000.0, 3),
            "ms_per_1m_pairs": round(c * 1000.0, 3),
            "block_bytes": self.block_bytes,
            "holders": self.pulls.holders(now),
        }
