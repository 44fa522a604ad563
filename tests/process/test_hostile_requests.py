"""A hostile client against a real `kvbroker serve` process: isolation, integrity and bad bytes.

Each test replays an attack a foreign client (messages built from server
reflection, or raw bytes) made against an earlier broker, and checks the
broker now refuses it precisely and stays healthy. The broker listens on [::];
the engines' sessions come from ::1, the attacker from 127.0.0.1: two hosts
as far as the broker can tell.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from foreign_client import ForeignClient, dual_stack_broker, status_of

from kvbroker.common.index import namespace_salt
from kvbroker.common.model import Namespace
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from testkit.processes import BrokerProcess
from tests.broker.session_util import RawSession

pytestmark = pytest.mark.timeout(60)

GPU = pb.TIER_GPU


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    proc = dual_stack_broker(
        tmp_path_factory.mktemp("hostile"), "--register-timeout-ms", "500", "--log-level", "info"
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def engine_stub(broker: BrokerProcess) -> AsyncIterator[broker_pb2_grpc.KVBrokerStub]:
    """The honest engines' channel: from ::1."""
    async with grpc.aio.insecure_channel(f"[::1]:{broker.port}") as channel:
        yield broker_pb2_grpc.KVBrokerStub(channel)


@pytest.fixture
async def attacker(broker: BrokerProcess) -> AsyncIterator[ForeignClient]:
    """The hostile client: from 127.0.0.1, knowing only what reflection says."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as channel:
        yield await ForeignClient(channel).load()


async def register(stub: broker_pb2_grpc.KVBrokerStub, engine_id: str, **kw: object) -> RawSession:
    session = RawSession(stub)
    await session.register(engine_info(engine_id, **kw))  # type: ignore[arg-type]
    return session


async def test_a_crafted_hash_never_matches_in_another_tenant(
    engine_stub: broker_pb2_grpc.KVBrokerStub, attacker: ForeignClient
) -> None:
    """Announcing h ^ salt(A) ^ salt(B) in B (the public, unkeyed salt) must not name a holder of h in A."""
    evil = await register(engine_stub, "evil-b")
    victim = await register(engine_stub, "victim-a")
    layout = evil.registered.layout_id  # type: ignore[union-attr]
    ns_a, ns_b = Namespace(layout, "tenant-a"), Namespace(layout, "tenant-b")
    mix = namespace_salt(ns_a) ^ namespace_salt(ns_b)
    wanted = [0x1111_0000 + i for i in range(8)]
    await evil.announce(pb.Namespace(layout_id=layout, tenant="tenant-b"), GPU, [h ^ mix for h in wanted])
    await evil.applied()
    down = await victim.resolve(pb.Namespace(layout_id=layout, tenant="tenant-a"), wanted, acquire=True)
    assert not down.resolve.matches and not down.resolve.lease.lease_id
    assert down.resolve.skipped_reason == "no_holder"
    # The other direction: A holds a prefix; a prober in B learns nothing of it.
    await victim.announce(pb.Namespace(layout_id=layout, tenant="tenant-a"), GPU, wanted)
    await victim.applied()
    probe = await attacker.call(
        "Score",
        namespace=attacker.message("Namespace", layout_id=layout, tenant="tenant-b"),
        block_hashes=[h ^ mix for h in wanted],
    )
    # B's own engine holds those hashes in B; A's victim is not named for them.
    assert {s.engine_id: s.gpu_blocks for s in probe.scores} == {"evil-b": 8, "victim-a": 0}
    same = await attacker.call(
        "Resolve",
        namespace=attacker.message("Namespace", layout_id=layout, tenant="tenant-a"),
        block_hashes=wanted,
    )
    assert [(m.engine_id, m.matched_blocks) for m in same.matches] == [("victim-a", 8)]
    await evil.close()
    await victim.close()


async def test_nobody_holds_or_registers_ranks_for_another_engine(
    broker: BrokerProcess, engine_stub: broker_pb2_grpc.KVBrokerStub, attacker: ForeignClient
) -> None:
    holder = await register(engine_stub, "holder-p")
    reader = await register(engine_stub, "reader-d")
    layout = holder.registered.layout_id  # type: ignore[union-attr]
    ns = attacker.message("Namespace", layout_id=layout)
    await holder.announce(pb.Namespace(layout_id=layout), GPU, [1, 2, 3])
    await holder.applied()
    # A forged hold in the holder's name, with arbitrary block ids, for the real reader.
    err = await status_of(
        attacker.call(
            "Hold",
            holder_engine_id="holder-p",
            namespace=ns,
            tier=GPU,
            block_hashes=[1, 2, 3],
            block_ids=[7, 7, 7],
            reader_engine_id="reader-d",
        )
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "holder-p" in (err.details() or "")
    assert "kvbroker-session-id" in (err.details() or "")
    down = await reader.resolve(pb.Namespace(layout_id=layout), [1, 2, 3])
    assert not any(m.hold_lease_id for m in down.resolve.matches), "no hold may exist"
    # Another engine's NIXL agent metadata stays its own.
    rank = attacker.message(
        "RankInfo",
        pp_rank=0,
        tp_rank=0,
        agent_name="evil",
        agent_metadata=b"evil",
        start_layer=0,
        end_layer=2,
    )
    err = await status_of(attacker.call("RegisterRank", engine_id="holder-p", rank=rank))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    listed = await attacker.call("ListEngines")
    (info,) = [e for e in listed.engines if e.engine_id == "holder-p"]
    assert [r.agent_metadata for r in info.ranks] == [b"meta"]
    # kvbroker-engine-id metadata names nobody: no lease in the reader's name.
    err = await status_of(
        attacker.call(
            "Resolve",
            metadata=[("kvbroker-engine-id", "reader-d")],
            namespace=ns,
            block_hashes=[1, 2, 3],
            acquire=True,
        )
    )
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (await attacker.call("Stats")).leases_by_state["active"] == 0
    # The session id is the proof: with it, the same calls from anywhere act as the engine.
    assert holder.registered is not None and reader.registered is not None
    held = await attacker.call(
        "Hold",
        metadata=[("kvbroker-session-id", holder.registered.session_id)],
        holder_engine_id="holder-p",
        namespace=ns,
        tier=GPU,
        block_hashes=[1, 2, 3],
        block_ids=[4, 5, 6],
    )
    assert held.lease.lease_id
    # And the engine's own host (its worker processes) may register its ranks.
    await engine_stub.RegisterRank(
        pb.RegisterRankRequest(engine_id="holder-p", rank=engine_info("holder-p").ranks[0])
    )
    await holder.close()
    await reader.close()


async def test_watch_and_mirror_answer_garbage_with_invalid_argument(
    broker: BrokerProcess, attacker: ForeignClient
) -> None:
    for method in ("Watch", "Mirror"):
        call = attacker.raw_stream(method, b"\xff\xff\xff")
        err = await status_of(call.read())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err)
        assert "not a valid message" in (err.details() or "")
    assert "Traceback" not in broker.log_tail(400)
    assert (await attacker.call("Stats")) is not None  # still serving


async def test_oversized_strings_and_echoes(
    engine_stub: broker_pb2_grpc.KVBrokerStub, attacker: ForeignClient
) -> None:
    big = "x" * (1 << 20)
    bad = RawSession(engine_stub)
    await bad.send(register=pb.Register(engine=engine_info(big)))
    err = await status_of(bad.read())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-id-bytes" in (err.details() or "")
    labels = RawSession(engine_stub)
    await labels.send(register=pb.Register(engine=engine_info("labelled", labels={"k": "v" * 100_000})))
    err = await status_of(labels.read())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-labels-bytes" in (err.details() or "")
    # A 64 KiB unknown id is NOT_FOUND, its echo cut short.
    for method, fields in (
        ("Drain", {"engine_id": "y" * 65536}),
        ("Revoke", {"lease_id": "z" * 65536}),
    ):
        err = await status_of(attacker.call(method, **fields))
        assert err.code() == grpc.StatusCode.NOT_FOUND, (method, err.code())
        assert len(err.details() or "") < 1024 and "65536 chars" in (err.details() or "")


async def test_a_session_that_never_registers_is_closed(engine_stub: broker_pb2_grpc.KVBrokerStub) -> None:
    call = engine_stub.Session()
    loop = asyncio.get_running_loop()
    start = loop.time()
    err = await status_of(asyncio.wait_for(call.read(), 10))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "register" in (err.details() or "")
    assert loop.time() - start < 5


@pytest.mark.parametrize("load", [math.nan, math.inf, -1.0])
async def test_bad_loads_are_refused(engine_stub: broker_pb2_grpc.KVBrokerStub, load: float) -> None:
    info = engine_info(f"load-{load}")
    info.load = load
    refused = RawSession(engine_stub)
    await refused.send(register=pb.Register(engine=info))
    err = await status_of(refused.read())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "load" in (err.details() or "")
    session = await register(engine_stub, f"beat-{load}")
    seq = await session.send(heartbeat=pb.Heartbeat(load=load))
    down = await session.read()
    assert down.seq == seq and down.error.code == "INVALID_ARGUMENT", down
    await session.close()


async def test_a_burst_of_calls_is_answered_not_refused(broker: BrokerProcess) -> None:
    """4,000 calls sent at once (a router's burst). gRPC's own server defaults let 1,000 wait for a
    handler, then drop calls at random up to 3,000, with a bare CANCELLED that names no cause: an
    earlier broker refused 40% of such a burst. Now each call is answered (--max-pending-calls)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as channel:
        stub = broker_pb2_grpc.KVBrokerStub(channel)

        async def one() -> str:
            try:
                await stub.Stats(pb.StatsRequest(), timeout=50)
            except grpc.aio.AioRpcError as err:
                return err.code().name
            return "OK"

        outcomes = await asyncio.gather(*(one() for _ in range(4_000)))
    assert outcomes.count("OK") == len(outcomes), {o: outcomes.count(o) for o in set(outcomes)}


async def test_a_burst_of_sessions_that_never_register_each_gets_the_precise_status(
    broker: BrokerProcess,
) -> None:
    """1,500 Session streams opened at once that never send: each ends with DEADLINE_EXCEEDED naming
    the register message, none with gRPC's bare CANCELLED."""

    async def silent() -> AsyncIterator[pb.SessionUp]:
        await asyncio.sleep(3600)
        yield pb.SessionUp()

    async def ending(call: object) -> str:
        try:
            async for _ in call:  # type: ignore[attr-defined]
                pass
        except grpc.aio.AioRpcError as err:
            return f"{err.code().name}: {'register' in (err.details() or '')}"
        return "OK"

    async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as channel:
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        calls = [stub.Session(silent()) for _ in range(1_500)]
        outcomes = await asyncio.wait_for(asyncio.gather(*(ending(c) for c in calls)), 50)
    assert set(outcomes) == {"DEADLINE_EXCEEDED: True"}, {o: outcomes.count(o) for o in set(outcomes)}


def test_the_broker_survived(broker: BrokerProcess, tmp_path: Path) -> None:
    assert broker.alive(), broker.log_tail()
