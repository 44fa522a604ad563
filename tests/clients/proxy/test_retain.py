"""X-KV-Retain-Seconds (clients/proxy/retain.py): after the turn, the proxy retains the prompt's
prefix on the engine that holds it, through a real in-process broker, with fake engines whose
broker sessions pin what the broker asks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvbroker.clients.proxy.server import STATE_KEY
from kvbroker.common.hashing import wire_chain
from kvbroker.v1 import broker_pb2 as pb
from testkit.broker import running_broker
from tests.clients.proxy.fake_engine import chat_text, fake_tokens
from tests.clients.proxy.test_routing import BLOCK, proxy_stack

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def stack() -> AsyncIterator[dict[str, Any]]:

    async with running_broker(session_ttl_ms=5_000, session_ttl_min_ms=100, shutdown_grace_s=0.2) as broker:
        pins: list[pb.Lease] = []

        def pin(command: pb.PinCommand) -> pb.PinResult:  # as an engine pins its cached blocks
            pins.append(command.lease)
            return pb.PinResult(
                lease_id=command.lease.lease_id, ok=True, block_ids=range(len(command.lease.block_hashes))
            )

        roles = {"P": "prefill", "D": "decode"}
        async with proxy_stack(broker, roles, ttl_ms=5_000, on_pin=pin, local_prefill_tokens=0) as s:
            yield {**s, "broker": broker, "pins": pins, "retainer": s["app"][STATE_KEY].retainer}


async def turn(
    s: dict[str, Any], messages: list[dict[str, str]], headers: dict[str, str]
) -> aiohttp.ClientResponse:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4}
    async with s["http"].post(s["url"] + "/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp


async def d_caches(s: dict[str, Any], messages: list[dict[str, str]]) -> None:
    """D announces the turn's prompt as cached, as the adapter does once vLLM finished it."""
    session = s["sessions"]["D"]
    hashes = wire_chain(fake_tokens(chat_text(messages)), BLOCK)
    session.announce_stored(pb.Namespace(layout_id=session.layout_id, tenant=""), pb.TIER_GPU, hashes)
    session.flush()
    await session.applied()


async def retentions(s: dict[str, Any]) -> list[pb.Lease]:
    core = s["broker"].core
    return [lease for lease in core.leases.by_holder("D") if lease.request_id.startswith("retain:")]


async def test_a_turn_with_the_header_is_retained_on_its_decode_engine_and_the_next_turn_replaces_it() -> (
    None
):
    async with stack() as s:
        messages = [{"role": "user", "content": "a question about retention " * 4}]
        resp = await turn(s, messages, {"X-KV-Retain-Seconds": "600", "X-KV-Retain-Key": "conv-1"})
        assert resp.status == 200 and resp.headers["X-KVBroker-Decode"] == "D"
        await d_caches(s, messages)  # announced after the answer: the proxy waits for it
        await s["retainer"].drain()
        [first] = await retentions(s)
        assert (first.reader, first.request_id, first.ttl_s) == ("", "retain:conv-1", 600)
        assert len(first.block_hashes) == len(fake_tokens(chat_text(messages))) // BLOCK
        assert s["pins"][-1].lease_id == first.lease_id  # D pinned it
        # The next turn of the conversation: retained again, the first retention ended.
        messages += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}]
        await turn(s, messages, {"X-KV-Retain-Seconds": "600", "X-KV-Retain-Key": "conv-1"})
        # D announces late: until then it holds the first turn's prefix, and the retain must not
        # keep just that (the clean-clone CI once had it retain before this announce).
        await asyncio.sleep(0.5)
        assert s["retainer"].counts["retained"] == 1
        await d_caches(s, messages)
        await s["retainer"].drain()
        [second] = await retentions(s)
        assert second.lease_id != first.lease_id and len(second.block_hashes) > len(first.block_hashes)
        assert s["broker"].core.leases.get(first.lease_id).state.label == "released"
        assert s["retainer"].counts["retained"] == 2 and s["retainer"].counts["replaced"] == 1
        # Without the header nothing is retained.
        await turn(s, [{"role": "user", "content": "no retention asked " * 4}], {})
        await s["retainer"].drain()
        assert s["retainer"].counts["retained"] == 2


async def test_an_engine_that_never_holds_the_whole_prompt_gets_its_prefix_retained_after_the_wait() -> None:
    """D announces only the first two blocks of the prompt (its chain differs from the proxy's
    past them, say): the retain waits out announce_wait_s, asking the broker a few times with
    growing pauses, then retains the two blocks D holds."""
    async with stack() as s:
        retainer = s["retainer"]
        retainer.announce_wait_s = 1.0
        scores = 0
        score = retainer.broker.score

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal scores
            scores += 1
            return await score(*args, **kwargs)

        retainer.broker.score = counted
        messages = [{"role": "user", "content": "a long question that is half announced " * 4}]
        session = s["sessions"]["D"]
        hashes = wire_chain(fake_tokens(chat_text(messages)), BLOCK)
        assert len(hashes) > 2
        session.announce_stored(pb.Namespace(layout_id=session.layout_id, tenant=""), pb.TIER_GPU, hashes[:2])
        session.flush()
        await session.applied()
        await turn(s, messages, {"X-KV-Retain-Seconds": "60"})
        await retainer.drain()
        [lease] = await retentions(s)
        assert list(lease.block_hashes) == hashes[:2]
        assert 3 <= scores <= 7, scores  # pauses 0.1, 0.15, 0.225, ... s: not one call per 0.1 s


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf"])
async def test_a_bad_retain_header_is_refused_before_any_engine_works(value: str) -> None:
    async with stack() as s:
        resp = await turn(s, [{"role": "user", "content": "hello " * 10}], {"X-KV-Retain-Seconds": value})
        assert resp.status == 400
        async with s["http"].post(
            s["url"] + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
            headers={"X-KV-Retain-Seconds": value},
        ) as again:
            error = (await again.json())["error"]
        assert error["param"] == "X-KV-Retain-Seconds" and "positive number of seconds" in error["message"]
        assert s["retainer"].counts == {}
