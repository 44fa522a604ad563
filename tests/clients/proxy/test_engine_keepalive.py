"""The proxy never sends a request on a connection its engine is closing: vLLM's server (uvicorn)
closes a connection idle for 5 s, aiohttp kept idle connections 15 s and sends no POST again on one
that reset, so a turn that came 5-15 s after the last one to that engine failed and put the engine
in cooldown. `--engine-keepalive-s` (4 s) closes them first. Here the engine's closing is played by
a relay in front of a fake engine that resets (RST, no answer) a request arriving on a connection
idle for longer than its keep-alive."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvbroker.clients.proxy import EngineSpec, ProxyConfig, build_app
from kvbroker.clients.proxy.server import STATE_KEY
from tests.clients.proxy.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)

ENGINE_KEEPALIVE_S = 0.6  # the engine's idle close (uvicorn: 5 s), shortened for the test


class IdleResetRelay:
    """Relays to `target`; data from the client on a connection idle for more than `idle_s` is not
    relayed: the connection is reset, as a request racing the server's idle close is."""

    def __init__(self, target_port: int, idle_s: float) -> None:
        self.target_port = target_port
        self.idle_s = idle_s
        self.resets = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> IdleResetRelay:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return self

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        last = [time.monotonic()]

        async def down() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                last[0] = time.monotonic()
            writer.close()

        relay_down = asyncio.create_task(down())
        try:
            while data := await reader.read(65536):
                if time.monotonic() - last[0] > self.idle_s:
                    self.resets += 1
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                up_writer.write(data)
                last[0] = time.monotonic()
        finally:
            relay_down.cancel()
            up_writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, IdleResetRelay]]:
    fake = await FakeEngine("E").start()
    assert fake.server is not None and fake.server.port is not None
    relay = await IdleResetRelay(fake.server.port, ENGINE_KEEPALIVE_S).start()
    yield fake, relay
    await relay.stop()
    await fake.stop()


async def _two_turns(relay: IdleResetRelay, **config: Any) -> tuple[list[int], list[str]]:
    """Two requests through a one-engine proxy, the second after the engine's keep-alive ran out;
    their statuses and the engine's failures as the proxy's pool knows them."""
    cfg = ProxyConfig(engines=(EngineSpec(relay.url, "decode"),), cooldown_s=60.0, **config)
    app = build_app(cfg)
    server = TestServer(app)
    await server.start_server()
    statuses = []
    try:
        async with aiohttp.ClientSession() as http:
            for pause in (0.0, 2 * ENGINE_KEEPALIVE_S):
                await asyncio.sleep(pause)
                body = {"model": "tiny", "prompt": "hello " * 8, "max_tokens": 4}
                async with http.post(str(server.make_url("/v1/completions")), json=body) as resp:
                    await resp.read()
                    statuses.append(resp.status)
        failures = list(app[STATE_KEY].pool._failure.values())
    finally:
        await server.close()
    return statuses, failures


async def test_a_connection_the_engine_is_closing_is_never_reused(
    engine: tuple[FakeEngine, IdleResetRelay],
) -> None:
    fake, relay = engine
    statuses, failures = await _two_turns(relay, engine_keepalive_s=ENGINE_KEEPALIVE_S / 2)
    assert statuses == [200, 200] and relay.resets == 0 and not failures
    assert len(fake.completions()) == 2


async def test_without_it_the_race_fails_a_request(engine: tuple[FakeEngine, IdleResetRelay]) -> None:
    """What the setting prevents: aiohttp's own 15 s keep-alive reuses the closing connection."""
    fake, relay = engine
    statuses, _ = await _two_turns(relay, engine_keepalive_s=15.0)
    assert relay.resets == 1 and statuses[0] == 200 and statuses[1] != 200
    assert len(fake.completions()) == 1
