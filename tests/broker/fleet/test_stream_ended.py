"""A session whose stream ends while the shared store does not answer: the broker cannot end it
then (BrokerCore.stream_ended raises Unavailable), and ends it at the first expiry pass after the
store is back, not at the session's TTL, whose passing nobody would be waiting for."""

from __future__ import annotations

import secrets

import pytest

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.errors import Unavailable
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.replica import Replica
from testkit.builders import engine_info
from testkit.clock import FakeClock
from testkit.processes import stopped
from testkit.redis_server import RedisServer
from testkit.waiting import wait_for


def test_a_stream_that_ends_while_the_store_is_paused_ends_its_session_once_it_is_back(
    own_redis: RedisServer,
) -> None:
    store = own_redis  # this test pauses it
    state = RedisState(store.url, prefix=f"t{secrets.token_hex(4)}")
    try:
        clock = FakeClock()  # stands still: the session's 60 s TTL never passes here
        core = Replica(BrokerConfig(), clock, state).core
        rec = core.register(engine_info("P"), 60_000)
        other = core.register(engine_info("Q"), 60_000)
        assert store.proc is not None
        with stopped(store.proc.pid), pytest.raises(Unavailable):
            core.stream_ended(rec)
        assert rec.stream_lost and core.registry.find("P") is rec  # not ended yet, not forgotten

        def swept() -> bool:
            try:
                core.expire()
            except Unavailable:  # failing fast until the store's probe hears it again
                return False
            return core.registry.find("P") is None

        assert wait_for(swept, 10.0), "the session whose stream ended was not ended after the store came back"
        assert core.registry.find("Q") is other  # a session with its stream open is left alone
        assert not state.call(state.client.exists, f"{state.prefix}:{{fleet}}:e:P")  # nor in the store
    finally:
        state.close()
