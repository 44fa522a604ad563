"""One fake clock for every injected clock in kvbroker.

The product takes time three ways: the broker core reads ``clock.now()``
(``kvbroker.broker.clock.Clock``), an engine session also sleeps on it
(``kvbroker.clients.clock.SessionClock``), and the engine adapter's scheduler
side and block mover call ``clock()`` for seconds. ``FakeClock`` is all three:
``ManualClock`` (``now``, ``sleep``, ``advance``, ``waiting``) that can also be
called.
"""

from __future__ import annotations

from kvbroker.clients.clock import ManualClock


class FakeClock(ManualClock):
    """Stands still until a test calls ``advance(seconds)``; ``clock()`` is ``clock.now()``."""

    def __call__(self) -> float:
        return self.now()
