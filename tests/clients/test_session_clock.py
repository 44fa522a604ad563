"""The session's liveness timing on an injected clock: heartbeats, silence, stalls, back-off.

A ManualClock stands still until the test moves it, so these tests assert the
exact moment on the session's clock, and nothing waits on wall-clock windows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc.aio
import pytest

from kvbroker.clients import errors
from kvbroker.clients.clock import AsyncioClock, Backoff
from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.liveness import SILENCE_TTLS
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.clock import ManualClock
from testkit.waiting import until

TTL_S = 0.4
INTERVAL_S = 0.13
NAP_S = 0.04  # the heartbeat loop's nap: a tenth of the TTL (under the interval)
EPS = 1e-9


class _QuietBroker(broker_pb2_grpc.KVBrokerServicer):
    """Registers engines (TTL 0.4 s, heartbeats every 0.13 s), records what they send, answers nothing more."""

    def __init__(self) -> None:
        self.registrations = 0
        self.received: list[pb.SessionUp] = []

    async def Session(self, request_iterator: Any, context: Any) -> Any:
        async for message in request_iterator:
            self.received.append(message)
            if message.WhichOneof("msg") == "register":
                self.registrations += 1
                yield pb.SessionDown(
                    seq=message.seq,
                    registered=pb.Registered(
                        session_id="s",
                        layout_id="L",
                        session_ttl_ms=int(TTL_S * 1000),
                        heartbeat_interval_ms=int(INTERVAL_S * 1000),
                    ),
                )

    def heartbeats(self) -> int:
        return sum(1 for m in self.received if m.WhichOneof("msg") == "heartbeat")


@pytest.fixture
async def quiet() -> AsyncIterator[tuple[str, _QuietBroker]]:
    server = grpc.aio.server()
    broker = _QuietBroker()
    broker_pb2_grpc.add_KVBrokerServicer_to_server(broker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", broker
    finally:
        await server.stop(0)


async def next_wake(clock: ManualClock) -> float:
    """Wait (on this loop, not on the clock) until the session sleeps on the clock; its wake-up time."""

    async def poll() -> float:
        while not clock.waiting():
            await asyncio.sleep(0.001)
        return clock.waiting()[0]

    return await asyncio.wait_for(poll(), 5.0)


async def step(clock: ManualClock, late: float = 0.0) -> None:
    """Move the clock to the session's next wake-up (``late`` seconds past it: a stall)."""
    wake = await next_wake(clock)
    clock.advance(wake - clock.now() + late)


async def step_until_disconnected(clock: ManualClock, events: Any) -> float:
    """Move the clock from one wake-up of the session to the next until it gives the stream up.

    Returns the time on the clock at which it gave up.
    """
    while True:
        wake = await next_wake(clock)
        if events.of("disconnected"):  # the sleeper is the reconnect back-off now
            return clock.now()
        clock.advance(wake - clock.now())


async def test_the_session_gives_up_after_three_silent_ttls_on_its_clock_and_backs_off_on_it(
    quiet: tuple[str, _QuietBroker], engine_info: Callable[..., pb.EngineInfo], recorder: Callable[[], Any]
) -> None:
    address, broker = quiet
    clock = ManualClock()
    events = recorder()
    session = EngineSession(
        address,
        engine_info("p0"),
        clock=clock,
        backoff=Backoff(initial_s=0.01, max_s=0.05, jitter=0.0),
        **events.callbacks(),
    )
    try:
        await session.start(wait_connected_s=5.0)
        registered_at = clock.now()
        gave_up_at = await step_until_disconnected(clock, events)
        (error,) = events.of("disconnected")
        assert isinstance(error, errors.Unavailable) and "answered nothing" in error.message
        # At the first wake-up past SILENCE_TTLS TTLs of silence, not one nap earlier.
        limit = SILENCE_TTLS * TTL_S
        assert limit - EPS < gave_up_at - registered_at <= limit + NAP_S + EPS
        # The reconnect waits on the same clock: attempt 0 of the back-off, 0.01 s.
        (wake,) = clock.waiting()
        assert wake - clock.now() == pytest.approx(0.01)
        assert broker.registrations == 1
        clock.advance(0.01)
        await events.wait_for("connected", count=2)
        assert broker.registrations == 2 and session.registrations == 2
    finally:
        await session.close()
    assert clock.waiting() == []  # closing let go of the clock


async def test_a_stall_of_this_process_is_not_counted_as_the_brokers_silence(
    quiet: tuple[str, _QuietBroker],
    engine_info: Callable[..., pb.EngineInfo],
    recorder: Callable[[], Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    address, broker = quiet
    clock = ManualClock()
    events = recorder()
    session = EngineSession(address, engine_info("p0"), clock=clock, **events.callbacks())
    try:
        await session.start(wait_connected_s=5.0)
        registered_at = clock.now()
        while clock.now() - registered_at < 1.0 - EPS:  # a second of silence, nap by nap
            await step(clock)
        await until(lambda: broker.heartbeats() == 6)  # every four naps: 0.16 s >= the 0.13 s interval
        await step(clock, late=1.0)  # this process did not run for a second
        await until(lambda: broker.heartbeats() == 7)  # so it heartbeats at once
        assert "did not run for 1.00 s" in caplog.text
        gave_up_at = await step_until_disconnected(clock, events)
        # The second of the stall is not the broker's silence: SILENCE_TTLS TTLs are counted without it.
        limit = SILENCE_TTLS * TTL_S
        assert limit - EPS < gave_up_at - registered_at - 1.0 <= limit + NAP_S + EPS
    finally:
        await session.close()


async def test_the_threaded_session_heartbeats_on_its_clock(
    quiet: tuple[str, _QuietBroker], engine_info: Callable[..., pb.EngineInfo]
) -> None:
    address, broker = quiet
    clock = ManualClock()
    session = ThreadedEngineSession(address, engine_info("p0"), clock=clock)
    await asyncio.to_thread(session.start, 5.0)
    try:
        assert session.session.clock is clock
        for _ in range(12):  # 0.48 s in naps, from the test's thread to the session's
            wake = await next_wake(clock)
            clock.advance(wake - clock.now())
        await until(lambda: broker.heartbeats() == 3)  # at 0.16, 0.32 and 0.48 s
        assert session.connected
    finally:
        await asyncio.to_thread(session.close)
    assert broker.heartbeats() == 3


async def test_the_default_clock_is_monotonic(engine_info: Callable[..., pb.EngineInfo]) -> None:
    session = EngineSession("127.0.0.1:1", engine_info("p0"))
    try:
        assert isinstance(session.clock, AsyncioClock)
    finally:
        await session.close()


async def test_a_manual_clock_wakes_sleepers_in_order_when_moved() -> None:
    clock = ManualClock(start=0.0)
    woke: list[float] = []

    async def sleeper(seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(clock.now())

    tasks = [asyncio.ensure_future(sleeper(s)) for s in (0.3, 0.1, 0.2)]
    await until(lambda: len(clock.waiting()) == 3)
    assert clock.waiting() == [0.1, 0.2, 0.3]
    clock.advance(0.15)
    await until(lambda: woke == [0.15])
    assert clock.waiting() == [0.2, 0.3]
    clock.advance(1.0)
    await asyncio.gather(*tasks)
    assert woke == [0.15, pytest.approx(1.15), pytest.approx(1.15)]
    with pytest.raises(ValueError):
        clock.advance(-1.0)
