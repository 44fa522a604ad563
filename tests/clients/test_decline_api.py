"""Declining a hold nobody will read, against a real broker: by a client, early, and by the P/D proxy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvbroker.clients import errors
from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.proxy import EngineSpec, ProxyConfig, build_app
from kvbroker.v1 import broker_pb2 as pb
from testkit.waiting import until
from tests.clients.proxy.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)


async def test_a_declined_hold_ends_at_once_and_its_holder_is_told(
    broker: Any, sessions: Any, recorder: Any
) -> None:
    seen = recorder()
    p = await sessions("P", **seen.callbacks())
    lease = await p.hold((p.layout_id, ""), pb.TIER_GPU, [11, 12], [1, 2], 30_000, request_id="req-1")
    async with AsyncBrokerClient(broker.address) as client:
        started = time.monotonic()
        answer = await client.decline(holder_engine_id="P", request_id="req-1", reason="D recomputed")
        ended = (await seen.wait_for("lease_ended"))[0].lease
        took = time.monotonic() - started
        assert answer.lease.lease_id == lease.lease_id == ended.lease_id
        assert ended.state == pb.LEASE_REVOKED and ended.cause == pb.REVOKE_DECLINED
        assert took < 5.0  # at once, not at the hold's 30 s TTL (loose: CI machines are loaded)
        # Again: nothing live to end, not an error.
        assert not (await client.decline(holder_engine_id="P", request_id="req-1")).HasField("lease")
        with pytest.raises(errors.InvalidArgument, match="holder_engine_id and the request_id"):
            await client.decline(holder_engine_id="P")


async def test_a_hold_declined_before_it_arrives_is_refused(broker: Any, sessions: Any) -> None:
    p = await sessions("P")
    async with AsyncBrokerClient(broker.address) as client:
        await client.decline(holder_engine_id="P", request_id="req-early", reason="decode failed")
    with pytest.raises(errors.FailedPrecondition, match="declined before its hold arrived"):
        await p.hold((p.layout_id, ""), pb.TIER_GPU, [11], [1], 30_000, request_id="req-early")


async def _p_d_behind_a_proxy(
    broker: Any, sessions: Any, recorder: Any, request_id: str, decode_mode: str
) -> tuple[Any, FakeEngine, FakeEngine, TestServer]:
    """P's broker session holding `request_id`'s blocks, fake engines P (answering with that hold)
    and D (`decode_mode`), and an in-process proxy over them that can decline through the broker."""
    seen = recorder()
    p_session = await sessions("P", **seen.callbacks())
    await p_session.hold((p_session.layout_id, ""), pb.TIER_GPU, [21], [3], 30_000, request_id=request_id)
    p = await FakeEngine("P", hold_request_id=request_id).start()
    d = await FakeEngine("D", mode=decode_mode).start()
    config = ProxyConfig(
        engines=(EngineSpec(p.url, "prefill"), EngineSpec(d.url, "decode")), connect_timeout_s=1.0
    )
    server = TestServer(build_app(config, broker=AsyncBrokerClient(broker.address)))
    await server.start_server()
    return seen, p, d, server


@pytest.mark.parametrize("decode_mode", ["reject400", "error500"])
async def test_the_proxy_declines_p_s_hold_when_no_decode_engine_will_read_it(
    broker: Any, sessions: Any, recorder: Any, decode_mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="kvbroker.proxy")
    seen, p, d, server = await _p_d_behind_a_proxy(broker, sessions, recorder, "p-req-7", decode_mode)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "hello " * 40, "max_tokens": 4}
            started = time.monotonic()
            async with http.post(str(server.make_url("/v1/completions")), json=body) as resp:
                status = resp.status
                json.loads(await resp.read())
        ended = (await seen.wait_for("lease_ended"))[0].lease
        assert time.monotonic() - started < 5.0  # declined, not left to the hold's 30 s TTL
        assert ended.cause == pb.REVOKE_DECLINED and ended.request_id == "p-req-7"
        await until(lambda: "declined P's hold of request p-req-7" in caplog.text)  # the proxy's log line
        # D's rejection goes back to the client; a broken D falls back to P alone.
        assert status == (400 if decode_mode == "reject400" else 200)
    finally:
        await server.close()
        await p.stop()
        await d.stop()


async def test_a_client_that_leaves_during_decode_cancels_d_and_p_s_hold_is_declined(
    broker: Any, sessions: Any, recorder: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The client gives up while D works (a user's stop, a benchmark's timeout): the proxy's request
    to D is closed, as vLLM needs to abort it and free its blocks, and P's hold is declined at once.
    (aiohttp's test server always cancels the handler of a client that left; the proxy's own
    process does since RUNNER_OPTIONS: tests/clients/proxy/test_proxy_process.py.)"""
    caplog.set_level("INFO", logger="kvbroker.proxy")
    seen, p, d, server = await _p_d_behind_a_proxy(broker, sessions, recorder, "p-req-9", "hang")
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "hello " * 40, "max_tokens": 4}
            request = asyncio.ensure_future(http.post(str(server.make_url("/v1/completions")), json=body))
            await until(lambda: len(d.completions()) == 1)  # D has the request and works on it
            left = time.monotonic()
            request.cancel()  # the client leaves
            with contextlib.suppress(asyncio.CancelledError):
                await request
        await until(lambda: d.cancelled == 1)
        ended = (await seen.wait_for("lease_ended"))[0].lease
        assert time.monotonic() - left < 5.0  # declined, not left to the hold's 30 s TTL
        assert ended.cause == pb.REVOKE_DECLINED and ended.request_id == "p-req-9"
        await until(lambda: "the client went away before decode" in caplog.text)
    finally:
        await server.close()
        await p.stop()
        await d.stop()
