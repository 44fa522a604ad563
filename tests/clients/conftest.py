"""Fixtures for client tests: a real in-process broker on a free port, engine builders, recorders."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvbroker.clients.session import EngineSession
from kvbroker.v1 import broker_pb2 as pb


def make_engine_info(engine_id: str, **layout: Any) -> pb.EngineInfo:
    fields: dict[str, Any] = dict(
        model="tiny-llama",
        dtype="float32",
        block_size=32,
        num_layers=2,
        num_kv_heads=2,
        head_size=16,
        tp_size=1,
        pp_size=1,
        hash_algo="sha256",
    )
    fields.update(layout)
    fp = pb.LayoutFingerprint(**fields)
    rank = pb.RankInfo(
        pp_rank=0,
        tp_rank=0,
        agent_name=f"{engine_id}-agent",
        agent_metadata=b"nixl-metadata",
        start_layer=0,
        end_layer=fp.num_layers,
        tiers=[pb.TierInfo(tier=pb.TIER_GPU, mem_type="DRAM", num_blocks=64)],
    )
    return pb.EngineInfo(engine_id=engine_id, layout=fp, ranks=[rank], labels={"role": "test"})


class Recorder:
    """Collects session callbacks so a test can wait for one."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self._changed = asyncio.Event()

    def callback(self, kind: str) -> Callable[[Any], None]:
        def record(message: Any) -> None:
            self.events.append((kind, message))
            self._changed.set()

        return record

    def callbacks(self) -> dict[str, Callable[[Any], None]]:
        kinds = ("revoked", "lease_ended", "drain", "connected", "disconnected")
        return {f"on_{kind}": self.callback(kind) for kind in kinds}

    def of(self, kind: str) -> list[Any]:
        return [m for k, m in self.events if k == kind]

    async def wait_for(self, kind: str, count: int = 1, timeout: float = 5.0) -> list[Any]:
        async def until() -> list[Any]:
            while len(self.of(kind)) < count:
                self._changed.clear()
                await self._changed.wait()
            return self.of(kind)

        return await asyncio.wait_for(until(), timeout)


@pytest.fixture
def engine_info() -> Callable[..., pb.EngineInfo]:
    return make_engine_info


@pytest.fixture
def recorder() -> Callable[[], Recorder]:
    return Recorder


@pytest.fixture
async def broker() -> AsyncIterator[Any]:
    """A real broker (grpc.aio server) in this process on a free port."""
    server_module = pytest.importorskip("kvbroker.broker.server")
    from kvbroker.broker.config import BrokerConfig

    config = BrokerConfig(
        address="127.0.0.1:0",
        session_ttl_ms=2_000,
        session_ttl_min_ms=100,
        lease_ttl_ms=5_000,
        pin_timeout_ms=1_000,
        shutdown_grace_s=0.2,
    )
    server = await server_module.start_server(config)
    try:
        yield server
    finally:
        await server.stop(0.2)


@pytest.fixture
async def sessions(
    broker: Any, engine_info: Callable[..., pb.EngineInfo]
) -> AsyncIterator[Callable[..., Any]]:
    """Factory of started, registered EngineSessions; all closed at the end."""
    opened: list[EngineSession] = []

    async def open_session(engine_id: str, ttl_ms: int = 2_000, **kwargs: Any) -> EngineSession:
        session = EngineSession(broker.address, engine_info(engine_id), ttl_ms=ttl_ms, **kwargs)
        opened.append(session)
        await session.start(wait_connected_s=5.0)
        return session

    yield open_session
    for session in opened:
        await session.close()


async def until(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
