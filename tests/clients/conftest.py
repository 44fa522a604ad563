"""Fixtures for client tests: a real in-process broker on a free port, engine builders, recorders."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvbroker.clients.session import EngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders
from testkit.broker import RunningServer, running_broker

# Every client takes its credentials (test_credentials.py): the security tests' certificates and TLS brokers.
from tests.broker.security.conftest import mtls_broker, pki, token_broker  # noqa: F401


def make_engine_info(engine_id: str, **layout: Any) -> pb.EngineInfo:
    """The client tests' engine: one rank named `<id>-agent` (whatever tp_size says), 64 GPU blocks."""
    return builders.engine_info(
        engine_id,
        ranks=1,
        agent_name="{engine_id}-agent",
        agent_metadata=b"nixl-metadata",
        num_blocks=64,
        **layout,
    )


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
async def broker() -> AsyncIterator[RunningServer]:
    """A real broker (grpc.aio server) in this process on a free port."""
    async with running_broker(
        session_ttl_ms=2_000,
        session_ttl_min_ms=100,
        lease_ttl_ms=5_000,
        pin_timeout_ms=1_000,
        shutdown_grace_s=0.2,
    ) as server:
        yield server


@pytest.fixture
async def sessions(
    broker: RunningServer, engine_info: Callable[..., pb.EngineInfo]
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
