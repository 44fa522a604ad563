"""Telling index mirrors when a connector engine falls silent, and when it speaks again.

The broker judges an engine's silence when it answers (broker/exactness.py: no message for two
heartbeat intervals is degraded) and records nothing. Mirrors hold an engine as it was last
published, so without this they would name a frozen holder as exact until its session ends.
`SilenceWatch.check`, run by every expiry pass and at most every CHECK_S, looks at the sessions
on this broker (with shared state, each replica at its own: the one serving a session judges its
silence) and publishes each engine whose state changed: its EngineInfo with INDEX_DEGRADED and
"silent for X s" (EngineRecord.silence), or, once it speaks again, with its recorded state, and a
Watch event `engine_exactness` either way. An engine whose recorded state is not exact (a KV-event
feed's lag or loss) is told by that state, as the broker answers it.
"""

from __future__ import annotations

from kvbroker.broker.exactness import Exactness, exactness_of
from kvbroker.broker.observed import ObservedRegistry

# How often the sessions are looked at (seconds of the broker's clock): a tenth of the shortest
# silence that counts (two thirds of a 3 s TTL) is well within it, and a pass over a few thousand
# records costs well under a millisecond.
CHECK_S = 0.2


class SilenceWatch:
    def __init__(self, registry: ObservedRegistry) -> None:
        self._registry = registry
        self._next = float("-inf")

    def check(self, now: float) -> int:
        """Tell mirrors of the engines that fell silent or spoke again since the last look;
        how many were told."""
        if now < self._next:
            return 0
        self._next = now + CHECK_S
        told = 0
        for rec in self._registry.own_sessions():
            state, why = exactness_of(rec, now)
            silent = rec.exactness == Exactness.EXACT and state is Exactness.DEGRADED
            if silent != bool(rec.silence):
                self._registry.silence_changed(rec, why if silent else "")
                told += 1
        return told
