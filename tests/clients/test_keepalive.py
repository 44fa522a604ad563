"""Keepalive pings on a quiet stream: the broker accepts what clients send, and says so when not.

gRPC's keepalive timers run inside its C core and cannot follow a fake clock,
so "minutes of idleness" are played fast: both sides are configured with short
intervals (the broker's --keepalive-min-ping-interval-ms, the client's
keepalive option), and a quiet stream lives through many ping intervals. With
gRPC's server defaults the broker cut a client pinging every 30 s off after a
few pings; the second test shows that a mismatched pair still does, so the
first test can fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvbroker.broker.config import BrokerConfig
from kvbroker.clients import errors
from kvbroker.clients.aio import CHANNEL_OPTIONS, AsyncBrokerClient
from kvbroker.clients.engine_session import EngineSession
from kvbroker.common import keepalive
from kvbroker.v1 import broker_pb2 as pb
from testkit.broker import running_broker

# gRPC's client sends at most about one ping a second whatever it is told, and
# a broker with gRPC's default policy cut such a client off after about 4 s.
PING_MS = 1_000
QUIET_S = 8.0


def test_the_defaults_are_paired() -> None:
    """Clients ping at least twice as far apart as the broker requires, and on quiet streams too."""
    assert keepalive.CLIENT_PING_INTERVAL_MS >= 2 * keepalive.SERVER_MIN_PING_INTERVAL_MS
    assert BrokerConfig().keepalive_min_ping_interval_ms == keepalive.SERVER_MIN_PING_INTERVAL_MS
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.keepalive_time_ms"] == keepalive.CLIENT_PING_INTERVAL_MS
    assert options["grpc.http2.max_pings_without_data"] == 0  # keep pinging while nothing flows


async def _first_engine_event(
    client: AsyncBrokerClient, quiet_s: float, register: Callable[[], object]
) -> str:
    """Open a Watch, stay quiet for `quiet_s`, then register an engine; the event's engine id."""
    events = client.watch(pb.WatchRequest(engine_events=True))
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(quiet_s)
    assert not first.done(), f"the quiet stream ended: {first.exception() if first.done() else ''}"
    session = await register()  # type: ignore[misc]
    try:
        event = await asyncio.wait_for(first, 5.0)
    finally:
        await session.close()
        await events.aclose()
    return event.engine_id


async def test_a_quiet_watch_lives_through_many_pings(engine_info: Callable[..., pb.EngineInfo]) -> None:
    async with running_broker(keepalive_min_ping_interval_ms=PING_MS // 2) as broker:

        async def register() -> EngineSession:
            session = EngineSession(broker.address, engine_info("late"))
            await session.start(wait_connected_s=5.0)
            return session

        options = keepalive.client_options(PING_MS, timeout_ms=2_000)
        async with AsyncBrokerClient(broker.address, options=options) as client:
            assert await _first_engine_event(client, QUIET_S, register) == "late"


async def test_a_client_pinging_faster_than_allowed_is_told_too_many_pings() -> None:
    async with (
        running_broker() as broker,  # the default: pings at least 10 s apart
        AsyncBrokerClient(broker.address, options=keepalive.client_options(PING_MS)) as client,
    ):
        with pytest.raises(errors.Unavailable) as caught:
            await asyncio.wait_for(anext(client.watch(pb.WatchRequest(engine_events=True))), 10.0)
    assert keepalive.is_too_many_pings(caught.value.message), caught.value.message
