"""A broker in this process: `async with running_broker(**config) as broker:` (address, port, core)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kvbroker.broker.clock import Clock
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.server import RunningServer, start_server

__all__ = ["RunningServer", "running_broker"]


@contextlib.asynccontextmanager
async def running_broker(
    *,
    stop_grace: float | None = 0.2,
    clock: Clock | None = None,
    tracer_provider: Any = None,
    security: Any = None,
    **config: Any,
) -> AsyncIterator[RunningServer]:
    """A real broker (grpc.aio server) on this event loop; `config` is BrokerConfig's fields.

    `security`: a SecurityConfig (default: plaintext, loopback only). The
    address defaults to a free port on 127.0.0.1. Stopped on the way out
    with `stop_grace` seconds for in-flight calls (None: the config's own)."""
    config.setdefault("address", "127.0.0.1:0")
    server = await start_server(
        BrokerConfig(**config), clock, tracer_provider=tracer_provider, security=security
    )
    try:
        yield server
    finally:
        await server.stop(stop_grace)
