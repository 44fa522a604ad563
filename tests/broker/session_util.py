"""A bare-bones engine session over the raw generated stub, for API tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc

from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import running_broker

Replica = tuple[Any, broker_pb2_grpc.KVBrokerStub]  # a running broker and a stub on it


class RawSession:
    def __init__(self, stub: broker_pb2_grpc.KVBrokerStub) -> None:
        self.call = stub.Session()
        self.seq = 0
        self.registered: pb.Registered | None = None

    async def register(
        self, info: pb.EngineInfo, ttl_ms: int = 5000, ends_on_answers: bool = False
    ) -> pb.Registered:
        register = pb.Register(engine=info, session_ttl_ms=ttl_ms, lease_ends_on_answers=ends_on_answers)
        await self.send(register=register)
        down = await self.read()
        assert down.WhichOneof("msg") == "registered", down
        self.registered = down.registered
        return down.registered

    async def send(self, **msg: object) -> int:
        self.seq += 1
        await self.call.write(pb.SessionUp(seq=self.seq, **msg))  # type: ignore[arg-type]
        return self.seq

    async def read(self, timeout: float = 5.0) -> pb.SessionDown:
        return await asyncio.wait_for(self.call.read(), timeout)

    async def read_kind(self, kind: str, timeout: float = 5.0) -> pb.SessionDown:
        """Next message of `kind`, skipping others."""
        while True:
            down = await self.read(timeout)
            if down.WhichOneof("msg") == kind:
                return down

    async def announce(self, ns: pb.Namespace, tier: int, stored: list[int]) -> None:
        await self.send(inventory=pb.InventoryUpdate(namespace=ns, tier=tier, stored=stored))  # type: ignore[arg-type]

    async def applied(self) -> None:
        """Wait until the broker has applied everything sent so far (the stream is ordered;
        another session's calls are not ordered with this one's)."""
        await self.send(heartbeat=pb.Heartbeat())
        await self.read_kind("heartbeat_ack")

    async def resolve(self, ns: pb.Namespace, hashes: list[int], **kw: object) -> pb.SessionDown:
        seq = await self.send(resolve=pb.ResolveRequest(namespace=ns, block_hashes=hashes, **kw))  # type: ignore[arg-type]
        while True:
            down = await self.read()
            if down.seq == seq:
                return down

    async def close(self) -> None:
        self.call.cancel()


def hold_request(ns: pb.Namespace, hashes: list[int], request_id: str) -> pb.HoldRequest:
    """P's hold of the first four of `hashes` (block ids 1-4) for `request_id`."""
    return pb.HoldRequest(
        holder_engine_id="P",
        namespace=ns,
        tier=pb.TIER_GPU,
        block_hashes=hashes[:4],
        block_ids=[1, 2, 3, 4],
        request_id=request_id,
    )


async def p_holding(
    stub: broker_pb2_grpc.KVBrokerStub, info: pb.EngineInfo, hashes: list[int]
) -> tuple[RawSession, pb.Namespace, pb.HoldResponse]:
    """Engine P registered (`info`), `hashes` announced on its GPU tier and one lease held of them:
    the start of every store-outage test."""
    p = RawSession(stub)
    reg = await p.register(info, 60_000)
    ns = pb.Namespace(layout_id=reg.layout_id)
    await p.announce(ns, pb.TIER_GPU, hashes)
    await p.applied()
    held = await stub.Hold(hold_request(ns, hashes, "before"))
    assert held.lease.state == pb.LEASE_HELD
    return p, ns, held


@asynccontextmanager
async def two_replicas(state_url: str, prefix: str) -> AsyncIterator[tuple[Replica, Replica]]:
    """Two brokers in this process over the store at `state_url` (keys under `prefix`), each with a
    stub on its own channel."""
    fleet = {"state": state_url, "state_prefix": prefix}
    async with (
        running_broker(**fleet) as a,
        running_broker(**fleet) as b,
        grpc.aio.insecure_channel(a.address) as to_a,
        grpc.aio.insecure_channel(b.address) as to_b,
    ):
        yield (a, broker_pb2_grpc.KVBrokerStub(to_a)), (b, broker_pb2_grpc.KVBrokerStub(to_b))
