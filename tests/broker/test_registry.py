"""Registration generations and exactness in the registry (broker/registry.py) beyond the
contract suite (test_registry_contract.py): two replicas on one store, the core, real gRPC."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.fleet.notify import FleetNotifier
from kvbroker.broker.fleet.registry import FleetRegistry, SeenRecords
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from testkit.clock import FakeClock
from tests.broker.helpers import make_core, redis_state
from tests.broker.session_util import RawSession

Stub = broker_pb2_grpc.KVBrokerStub
H = list(range(8100, 8108))


class Floor:
    """A settable wall clock in microseconds."""

    def __init__(self, us: int) -> None:
        self.us = us

    def __call__(self) -> int:
        return self.us


def _replicas(request: pytest.FixtureRequest, floor: Floor) -> tuple[FleetRegistry, FleetRegistry]:
    """Two replicas on one real redis-server, each with its own cache of the other's records."""
    state = redis_state(request.getfixturevalue("redis_server"))
    out = []
    for name in ("r1", "r2"):
        seen = SeenRecords()
        news = FleetNotifier(FakeClock(), state, name, seen, RedisLeaseTable(state, history=4))
        registry = FleetRegistry(state, name, seen, news)
        registry._generation_floor = floor  # the same fake wall clock on every replica
        out.append(registry)
    return out[0], out[1]


def test_fleet_replicas_share_one_generation_counter(request: pytest.FixtureRequest) -> None:
    a, b = _replicas(request, Floor(0))
    on_a = a.add(engine_info("P"), 5.0, 1, now=0.0)
    a.remove(on_a)
    on_b = b.add(engine_info("P"), 5.0, 1, now=0.0)  # the engine restarted and reached replica b
    assert on_b.generation > on_a.generation
    seen = a.find("P")
    assert seen is not None and seen.generation == on_b.generation, "other replicas read it from the store"


def test_a_replica_judges_the_silence_of_its_own_sessions_only(request: pytest.FixtureRequest) -> None:
    """`own_sessions()`: the sessions whose streams are on this replica (broker/silence.py looks at those)."""
    a, b = _replicas(request, Floor(0))
    a.add(engine_info("P"), 5.0, 1, now=0.0)
    b.add(engine_info("D"), 5.0, 1, now=0.0)
    assert [r.engine_id for r in a.own_sessions()] == ["P"] and [r.engine_id for r in b.own_sessions()] == [
        "D"
    ]
    assert {r.engine_id for r in a.all()} == {"P", "D"}


def test_a_replica_that_records_an_engines_exactness_tells_the_others(request: pytest.FixtureRequest) -> None:
    """A KV-event feed runs on one replica; every replica must answer with its state."""
    a, b = _replicas(request, Floor(0))
    rec = a.add(engine_info("ev"), 5.0, 1, now=0.0)
    a.set_exactness(rec, 3, "KV event batches 4..6 were lost")
    b._seen.changed("ev")  # what the fleet's channel does on the other replicas
    seen = b.find("ev")
    assert seen is not None and (seen.exactness, seen.exactness_reason) == (
        3,
        "KV event batches 4..6 were lost",
    )
    a.set_exactness(rec, 1, "")
    b._seen.changed("ev")
    seen = b.find("ev")
    assert seen is not None and (seen.exactness, seen.exactness_reason) == (1, "")


def test_core_reregistration_is_a_new_generation() -> None:
    core, _clock, _notes = make_core()
    p = core.register(engine_info("P"), 3000)
    p2 = core.register(engine_info("P"), 3000)
    assert p2.generation > p.generation
    assert [e.generation for e in core.mirror_engines(p2.layout_id)] == [p2.generation]


async def test_the_holder_details_a_reader_gets_name_the_holders_generation(stub: Stub) -> None:
    """Real gRPC, on every backend: a restarted holder is a new generation in ListEngines and in
    the transfer details of a lease on its blocks."""
    p, d = RawSession(stub), RawSession(stub)
    reg = await p.register(engine_info("P"), 5000)
    await d.register(engine_info("D"), 5000)
    ns = pb.Namespace(layout_id=reg.layout_id)
    old = {e.engine_id: e.generation for e in (await stub.ListEngines(pb.ListEnginesRequest())).engines}
    assert old["P"] > 0 and old["D"] > 0
    # P restarts under the same engine id: a new session supersedes the old one.
    restarted = RawSession(stub)
    await restarted.register(engine_info("P", agent_metadata=b"new agent"), 5000)
    now = {e.engine_id: e.generation for e in (await stub.ListEngines(pb.ListEnginesRequest())).engines}
    assert now["P"] > old["P"] and now["D"] == old["D"]
    held = await stub.Hold(
        pb.HoldRequest(
            holder_engine_id="P",
            namespace=ns,
            tier=pb.TIER_GPU,
            block_hashes=H[:2],
            block_ids=[1, 2],
            reader_engine_id="D",
        )
    )
    acq = await stub.Acquire(pb.AcquireRequest(lease_id=held.lease.lease_id, reader_engine_id="D"))
    assert acq.holder.generation == now["P"]
    assert acq.holder.ranks[0].agent_metadata == b"new agent"
    for s in (p, d, restarted):
        await s.close()


async def test_a_restarted_engine_is_announced_to_the_other_sessions_of_its_layout(stub: Stub) -> None:
    """Real gRPC, on every backend: when P registers anew, D (same layout) hears P's new
    generation on its session stream unasked (SessionDown.engine_generation), before any lease;
    an engine of another layout hears nothing of it, and P's new session not its own news."""
    d, other, p = RawSession(stub), RawSession(stub), RawSession(stub)
    await d.register(engine_info("D"), 5000)
    await other.register(engine_info("X", block_size=16), 5000)
    await p.register(engine_info("P"), 5000)
    first = await d.read_kind("engine_generation")
    restarted = RawSession(stub)
    await restarted.register(engine_info("P", agent_metadata=b"new agent"), 5000)
    news = await d.read_kind("engine_generation")
    engines = {e.engine_id: e for e in (await stub.ListEngines(pb.ListEnginesRequest())).engines}
    assert news.engine_generation.engine_id == "P" and first.engine_generation.engine_id == "P"
    assert news.engine_generation.generation == engines["P"].generation > first.engine_generation.generation
    # A session's notices come in order: the first X and the new P hear is of a later engine.
    later_a, later_b = RawSession(stub), RawSession(stub)
    await later_a.register(engine_info("D2"), 5000)
    await later_b.register(engine_info("Y", block_size=16), 5000)
    assert (await restarted.read_kind("engine_generation")).engine_generation.engine_id == "D2"
    assert (await other.read_kind("engine_generation")).engine_generation.engine_id == "Y"
    for s in (p, d, other, restarted, later_a, later_b):
        await s.close()


async def test_a_stream_left_for_a_newer_one_of_its_session_on_the_same_replica_ends_nothing(
    stub: Stub, request: pytest.FixtureRequest
) -> None:
    """Real gRPC over shared state: an engine that left its replica's stream as silent and resumed
    its session on a new stream of the same replica (the other replica was the dead one) then
    cancels the old stream; the session and its new stream go on. (Before, the old stream's end
    ended the session it had just resumed, and the engine had to register anew.)"""
    if request.node.callspec.params["broker"] == "in-memory":
        pytest.skip("one broker owns every session there: a session is never resumed")
    old = RawSession(stub)
    registered = await old.register(engine_info("P"), 5000)
    new = RawSession(stub)
    resume = pb.Register(
        engine=engine_info("P"), session_ttl_ms=5000, resume_session_id=registered.session_id
    )
    await new.send(register=resume)
    answer = (await new.read()).registered
    assert answer.resumed and answer.session_id == registered.session_id
    await old.close()
    await asyncio.sleep(0.5)  # the broker has seen the old stream end
    await new.applied()  # a heartbeat on the new stream is still answered
    engines = (await stub.ListEngines(pb.ListEnginesRequest())).engines
    assert [e.engine_id for e in engines] == ["P"]
    await new.close()
