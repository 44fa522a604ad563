"""Index changes an engine announces while the shared store does not answer (a real redis-server
paused with SIGSTOP) are kept by the replica, in order, and applied once the store answers again:
blocks stored meanwhile are found, blocks removed meanwhile name no holder afterwards."""

from __future__ import annotations

import contextlib
import secrets

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.errors import Unavailable
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.replica import Replica
from kvbroker.common.model import Namespace
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.clock import FakeClock
from testkit.processes import stopped
from testkit.redis_server import RedisServer
from testkit.waiting import wait_for

OLD, NEW, LATER = [0xA1, 0xA2, 0xA3], [0xB1, 0xB2], [0xB3]


def test_changes_announced_while_the_store_is_paused_are_applied_in_order_once_it_is_back(
    own_redis: RedisServer,
) -> None:
    store = own_redis  # this test pauses it
    state = RedisState(store.url, prefix=f"t{secrets.token_hex(4)}")
    try:
        core = Replica(BrokerConfig(), FakeClock(), state).core
        rec = core.register(engine_info("P"), 60_000)
        ns = Namespace(rec.layout_id, "")
        core.update_inventory(rec, ns, pb.TIER_GPU, OLD, [])
        assert core.resolve(None, ns, OLD).matches
        assert store.proc is not None
        with stopped(store.proc.pid):
            # The engine evicts OLD and stores NEW, then LATER: no error, nothing lost.
            core.update_inventory(rec, ns, pb.TIER_GPU, NEW, OLD)
            core.update_inventory(rec, ns, pb.TIER_GPU, LATER, [])
            assert len(core.backlog) == 2
            with contextlib.suppress(Unavailable):
                core.expire()  # a pass while the store is away keeps them
            assert len(core.backlog) == 2

        def applied() -> bool:
            try:
                core.expire()
            except Unavailable:  # failing fast until the store's probe hears it again
                return False
            return len(core.backlog) == 0

        assert wait_for(applied, 10.0), "the changes kept during the pause were not applied after it"
        found = core.resolve(None, ns, [*NEW, *LATER]).matches
        assert [(m.engine_id, m.matched) for m in found] == [("P", 3)]
        stale = core.resolve(None, ns, OLD)
        assert not stale.matches and stale.skipped_reason == "no_holder"
        # Straight from the store too, as every other replica reads it.
        assert state.call(state.client.exists, f"{state.prefix}:{{fleet}}:e:P")
        assert core.index.longest_prefixes(ns, OLD) == []
    finally:
        state.close()
