"""broker/fleet/health.py: a store that did not answer fails every call at once until a probe,
off the caller's thread, gets an answer; how long it has been back gates the session sweep."""

from __future__ import annotations

import math
import threading

import pytest

from kvbroker.broker.errors import Unavailable
from kvbroker.broker.fleet.health import StoreHealth
from testkit.clock import FakeClock
from testkit.waiting import wait_for


def test_away_fails_fast_until_a_probe_answers_then_counts_time_back() -> None:
    clock = FakeClock()
    answering = threading.Event()
    probes: list[str] = []

    def probe() -> None:
        probes.append(threading.current_thread().name)
        if not answering.is_set():
            raise ConnectionError("still paused")

    health = StoreHealth("redis://store", probe, clock=clock.now)
    try:
        health.check()  # never away: nothing raised
        assert health.back_for() == math.inf
        health.failed("TimeoutError: read timed out")
        health.failed("TimeoutError: another caller")  # one outage, one probe thread
        assert health.outages == 1
        clock.advance(3.0)
        with pytest.raises(Unavailable, match=r"not answered for 3.0 s \(TimeoutError: read timed out\)"):
            health.check()
        assert health.back_for() == 0.0
        assert wait_for(lambda: len(probes) >= 2, 5.0), "the probe did not retry"
        assert set(probes) == {"kvbroker-store-probe"}  # never on the caller's thread
        answering.set()
        assert wait_for(lambda: not health.away, 5.0)
        health.check()
        clock.advance(0.4)
        assert health.back_for() == pytest.approx(0.4)
    finally:
        health.close()


def test_closed_health_starts_no_probe() -> None:
    health = StoreHealth("redis://store", lambda: None)
    health.close()
    health.failed("ConnectionError")
    assert not health.away
