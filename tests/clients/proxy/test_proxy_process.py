"""The proxy as users run it (`python -m kvbroker.clients.proxy`, a real process) when its client
leaves: the request to the engine is closed at once, as vLLM needs to abort it and free its KV
blocks. aiohttp's in-process test server cancels a handler whose client left whatever the
application asks; its production server does not unless told (RUNNER_OPTIONS), so only a proxy
process shows the difference."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from testkit.processes import ProxyProcess
from testkit.waiting import until
from tests.clients.proxy.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def hung_engine_behind_a_proxy(tmp_path: Path) -> AsyncIterator[tuple[FakeEngine, ProxyProcess]]:
    engine = await FakeEngine("E", mode="hang").start()
    proxy = ProxyProcess(tmp_path / "proxy.log", engines={"E": engine.url})
    try:
        await asyncio.to_thread(proxy.start)
        yield engine, proxy
    finally:
        proxy.stop()
        await engine.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_closes_the_engine_request(
    hung_engine_behind_a_proxy: tuple[FakeEngine, ProxyProcess], stream: bool
) -> None:
    """The engine works on the request (hang: no byte yet, as in a long prefill); the client leaves.
    Before, the proxy kept its request to the engine open until the engine answered: a
    non-streamed request was computed to its end for nobody, a streamed one until its first
    write."""
    engine, proxy = hung_engine_behind_a_proxy
    body = {"model": "tiny", "prompt": "hello " * 40, "max_tokens": 512, "stream": stream}
    async with aiohttp.ClientSession() as http:
        request = asyncio.ensure_future(http.post(proxy.url + "/v1/completions", json=body))
        await until(lambda: len(engine.completions()) == 1)
        assert engine.cancelled == 0
        request.cancel()  # the client leaves
        with contextlib.suppress(asyncio.CancelledError):
            await request
    await until(lambda: engine.cancelled == 1, timeout=10)
    assert proxy.alive()
