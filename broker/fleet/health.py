"""Whether the shared store answers: a hung store must not freeze the replica.

The replica's core is synchronous and calls the store from the event loop, so
a store that stops answering without closing its connections (a paused or
overloaded Redis, a partition) would hold the loop for every call's socket
timeout, and every caller, heartbeat and stream of the replica with it.
``StoreHealth`` bounds that to one call's timeout per outage:

- a call that times out or finds the store's connection broken marks the
  store *away* (``failed``); from then on every call fails at once with
  Unavailable (``check``), without touching a socket, so the loop keeps
  serving what needs no store: heartbeats, session bookkeeping, streams;
- a probe thread, off the loop, pings the store every ``PROBE_EVERY_S`` on a
  connection of its own (each ping bounded by the call timeout) and marks it
  *back* at the first answer;
- ``back_for()`` says how long the store has been back, so that the session
  sweep can wait until every owner has pushed its sessions' deadlines again
  (their copies in the store went stale while nobody could write them; a
  sweep right after the store's return would end every live session of the
  fleet).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from kvbroker.broker.errors import Unavailable

log = logging.getLogger("kvbroker.broker.fleet")

PROBE_EVERY_S = 0.05


class StoreHealth:
    """Away or back, and since when (monotonic seconds); thread-safe."""

    def __init__(
        self, shown: str, probe: Callable[[], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.shown = shown
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self.away_since: float | None = None
        self.back_at = -math.inf
        self.cause = ""
        self.outages = 0
        self._closed = threading.Event()

    @property
    def away(self) -> bool:
        return self.away_since is not None

    def check(self) -> None:
        """Unavailable at once while the store is away."""
        since = self.away_since
        if since is not None:
            raise Unavailable(
                f"the shared state store {self.shown} has not answered for {self._clock() - since:.1f} s"
                f" ({self.cause}); failing fast until it does"
            )

    def failed(self, cause: str) -> None:
        """A call timed out or lost its connection: away until a probe gets an answer."""
        with self._lock:
            if self.away_since is not None or self._closed.is_set():
                return
            self.away_since = self._clock()
            self.cause = cause
            self.outages += 1
        log.warning("shared state store %s away (%s): failing fast, probing off the loop", self.shown, cause)
        threading.Thread(target=self._probe_until_back, name="kvbroker-store-probe", daemon=True).start()

    def back_for(self) -> float:
        """Seconds since the store came back from its last outage (inf if it never was away)."""
        if self.away_since is not None:
            return 0.0
        return self._clock() - self.back_at

    def close(self) -> None:
        self._closed.set()

    def _probe_until_back(self) -> None:
        while not self._closed.wait(PROBE_EVERY_S):
            try:
                self._probe()
            except Exception:  # any failure means "not yet"; the next probe tries again
                continue
            with self._lock:
                away_for = self._clock() - (self.away_since or self._clock())
                self.away_since = None
                self.back_at = self._clock()
            log.warning("shared state store %s back after %.2f s", self.shown, away_for)
            return
