"""Local on D, or P then pull: weighs P's queue, so a turn whose history is on D does not wait
behind another conversation's prefill on a busy P.

The proxy knows what it has sent each P and not yet had answered (its own
prefills in flight, with their token counts: it tokenized them to route), and
the broker reports every engine's load (the requests its scheduler works on,
engine_adapter/own_load.py), which counts other proxies' prefills too. What a
prefill costs comes from P itself: once P's cost model is ready, P's
kv_transfer_params carry its fitted prefill (``kvbroker.prefill_model``,
engine_adapter/holds.py); the proxy keeps the latest per P.

A request D holds a prefix of (``Route.matches``) is served by D alone when:

- at most ``--local-prefill-tokens`` of it are left to compute (as before), or
- P is busy, and D computing what it lacks is predicted to be quicker than
  waiting for P's queue and then P's prefill of this request; D's compute is
  weighed times (1 + D's load), since every request D decodes waits for it
  too. With no timing from P yet: when P is busy and D holds at least half
  of the prompt.

Otherwise P prefills and D pulls. The choice's reason goes on the request's
span (``kvbroker.route_reason``) and into ``kvbroker_proxy_route_choices_total``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Reasons (their first word is the metric's label).
LOCAL_FEW_TOKENS = "local_few_tokens"
LOCAL_P_BUSY = "local_p_busy"
PD_D_HOLDS_NOTHING = "pd_d_holds_nothing"
PD_P_IDLE = "pd_p_idle"
PD_P_QUICKER = "pd_p_quicker"
PD_NOT_SCORED = "pd_not_scored"

_KEYS = ("step_ms", "ms_per_1k_tokens", "ms_per_1m_pairs")


@dataclass(frozen=True)
class RouteChoice:
    local: bool
    reason: str
    detail: str = ""
    p_wait_ms: float = 0.0  # predicted wait for P's queue (0: idle or unknown)


def _prefill_s(coef: tuple[float, float, float], new: int, context: int) -> float:
    """The engines' prefill model (engine_adapter/cost_model.py): a + b * tokens + c * pairs, in seconds."""
    if new <= 0:
        return 0.0
    a, b, c = coef
    return a + b * new / 1e3 + c * new * (context + new / 2.0) / 1e6


class PrefillQueues:
    """Per P engine: the prefills this proxy has in flight there, and P's own prefill timing."""

    def __init__(self) -> None:
        self._inflight: dict[str, dict[str, tuple[int, int]]] = {}
        self._coef: dict[str, tuple[float, float, float]] = {}

    def started(self, engine_id: str, request_id: str, new_tokens: int, context_tokens: int) -> None:
        self._inflight.setdefault(engine_id, {})[request_id] = (max(0, new_tokens), max(0, context_tokens))

    def finished(self, engine_id: str, request_id: str) -> None:
        self._inflight.get(engine_id, {}).pop(request_id, None)

    def in_flight(self, engine_id: str) -> int:
        return len(self._inflight.get(engine_id, {}))

    def learn(self, engine_id: str, params: Mapping[str, Any] | None) -> None:
        """P's answer: its kv_transfer_params may carry its fitted prefill (ms figures)."""
        part = params.get("kvbroker") if isinstance(params, Mapping) else None
        model = part.get("prefill_model") if isinstance(part, Mapping) else None
        if not isinstance(model, Mapping):
            return
        values = [model.get(k) for k in _KEYS]
        if all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values):
            a, b, c = (float(v) / 1000.0 for v in values)  # type: ignore[arg-type]
            self._coef[engine_id] = (a, b, c)

    def coefficients(self, engine_id: str) -> tuple[float, float, float] | None:
        return self._coef.get(engine_id) or next(iter(self._coef.values()), None)

    def wait_s(self, engine_id: str, reported_load: float) -> float | None:
        """Predicted seconds until P starts a new prefill: what this proxy has in flight there, and
        the broker's load beyond it at the mean of those (None: no timing)."""
        coef = self.coefficients(engine_id)
        if coef is None:
            return None
        mine = list(self._inflight.get(engine_id, {}).values())
        total = sum(_prefill_s(coef, new, ctx) for new, ctx in mine)
        others = max(0.0, reported_load - len(mine))
        if others and mine:
            total += others * total / len(mine)
        return total

    def choose(
        self,
        *,
        p_engine_id: str,
        p_load: float,
        num_tokens: int | None,
        held_on_d: int,
        held_on_p: int,
        local_limit: int,
        d_load: float = 0.0,
    ) -> RouteChoice:
        """Local on D or P then pull, for a request of ``num_tokens`` of which D holds ``held_on_d``."""
        if num_tokens is None:
            return RouteChoice(False, PD_NOT_SCORED, "the prompt was not scored")
        held_on_d = min(held_on_d, num_tokens)
        if held_on_d <= 0:
            return RouteChoice(False, PD_D_HOLDS_NOTHING, "D holds no prefix of the prompt")
        left = num_tokens - held_on_d
        if left <= local_limit:
            return RouteChoice(True, LOCAL_FEW_TOKENS, f"D holds all but {left} tokens (<= {local_limit})")
        mine = self.in_flight(p_engine_id)
        queued = max(float(mine), p_load)
        if queued <= 0:
            return RouteChoice(False, PD_P_IDLE, f"P is idle; D would compute {left} tokens")
        coef = self.coefficients(p_engine_id)
        wait = self.wait_s(p_engine_id, p_load)
        if coef is None or wait is None:
            if held_on_d * 2 >= num_tokens:
                return RouteChoice(
                    True,
                    LOCAL_P_BUSY,
                    f"P works on {queued:g} requests (no timing yet); D holds {held_on_d} of {num_tokens} tokens",
                )
            return RouteChoice(False, PD_P_QUICKER, f"P busy ({queued:g}), but D holds under half the prompt")
        local_s = _prefill_s(coef, left, held_on_d) * (1.0 + max(0.0, d_load))
        p_s = wait + _prefill_s(coef, num_tokens - min(held_on_p, num_tokens), held_on_p)
        detail = (
            f"D (load {d_load:g}) computes {left} tokens in {local_s * 1e3:.0f} ms; P's queue ({queued:g}) "
            f"{wait * 1e3:.0f} ms + its prefill {(p_s - wait) * 1e3:.0f} ms (predicted)"
        )
        if local_s < p_s:
            return RouteChoice(True, LOCAL_P_BUSY, detail, wait * 1e3)
        return RouteChoice(False, PD_P_QUICKER, detail, wait * 1e3)
