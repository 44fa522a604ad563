"""How long a session waits before it tries the broker again."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Reconnect delays: exponential, capped, with random jitter.

    Attempt ``n`` (0-based) waits ``min(max_s, initial_s * multiplier**n)``
    shortened by up to ``jitter`` of itself at random, so that many engines
    that lost the same broker do not come back in lockstep.
    """

    initial_s: float = 0.1
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        base = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 64))
        return base * (1.0 - self.jitter * rand())
