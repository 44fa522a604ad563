"""The proxy on a data-parallel fleet (--no-disaggregate): fake engines registered with a real
in-process broker; the placement (common/placement.py) weighs each engine's load against its prefix."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvbroker.v1 import broker_pb2 as pb
from testkit.broker import RunningServer, running_broker
from tests.clients.proxy.test_routing import announce, proxy_stack

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def broker() -> AsyncIterator[RunningServer]:
    async with running_broker(session_ttl_ms=2_000, session_ttl_min_ms=100, shutdown_grace_s=0.2) as server:
        yield server


@pytest.fixture
async def fleet(broker: RunningServer, request: pytest.FixtureRequest) -> AsyncIterator[dict[str, Any]]:
    """Fake engines E1 and E2 (role both) and a proxy that serves them as a data-parallel fleet
    (more ProxyConfig settings by indirect parametrization)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = {"refresh_interval_s": 0.1, "disaggregate": False, **getattr(request, "param", {})}
    async with proxy_stack(broker, {"E1": "both", "E2": "both"}, tracer_provider=provider, **settings) as s:
        yield {**s, "spans": exporter}


async def chat(fleet: dict[str, Any], messages: list[dict[str, str]]) -> dict[str, str]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4}
    async with fleet["http"].post(fleet["url"] + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return dict(resp.headers)


async def proxy_load(fleet: dict[str, Any], engine: str) -> float:
    async with fleet["http"].get(fleet["url"] + "/health") as resp:
        data = json.loads(await resp.read())
    return float(next(e["load"] for e in data["engines"] if e["engine_id"] == engine))


async def wait_load(fleet: dict[str, Any], engine: str, at_least: float) -> None:
    for _ in range(200):  # the proxy re-reads the broker's engine list every 0.1 s
        if await proxy_load(fleet, engine) >= at_least:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the proxy never saw {engine}'s load reach {at_least}")


async def route_choices(fleet: dict[str, Any]) -> dict[str, float]:
    async with fleet["http"].get(fleet["url"] + "/metrics") as resp:
        text = (await resp.read()).decode()
    found = re.findall(r'kvbroker_proxy_route_choices_total\{reason="([^"]+)"\} ([\d.]+)', text)
    return {reason: float(v) for reason, v in found}


HISTORY = [
    {"role": "user", "content": "what is a kv cache broker? " * 12},
    {"role": "assistant", "content": "an index of blocks and leases over them " * 12},
]
TURN2 = [*HISTORY, {"role": "user", "content": "more"}]


async def test_an_idle_holder_serves_its_conversation_whole(fleet: dict[str, Any]) -> None:
    await announce(fleet, "E2", HISTORY, pb.TIER_GPU)
    for _ in range(3):  # whatever the rotation
        h = await chat(fleet, TURN2)
        assert (h["X-KVBroker-Decode"], h["X-KVBroker-Mode"], h["X-KVBroker-Route"]) == (
            "E2",
            "dp",
            "dp_holder",
        )
        assert "X-KVBroker-Prefill" not in h and "X-KVBroker-Fallback" not in h
    # A whole request: no P/D hand-over in its body.
    assert "kv_transfer_params" not in fleet["fakes"]["E2"].completions()[-1].body
    assert not fleet["fakes"]["E1"].completions()


async def test_a_busy_holder_sends_the_turn_to_a_free_engine_and_says_why(fleet: dict[str, Any]) -> None:
    await announce(fleet, "E2", HISTORY, pb.TIER_GPU)
    fleet["sessions"]["E2"].set_load(4)  # its heartbeat: 4 requests in its scheduler
    await wait_load(fleet, "E2", 4)
    before = await route_choices(fleet)
    h = await chat(fleet, TURN2)
    assert (h["X-KVBroker-Decode"], h["X-KVBroker-Route"]) == ("E1", "dp_pull_busy_holder")
    assert (await route_choices(fleet)).get("dp_pull_busy_holder", 0) == before.get(
        "dp_pull_busy_holder", 0
    ) + 1
    server = next(s for s in fleet["spans"].get_finished_spans() if s.name == "POST /v1/chat/completions")
    assert server.attributes["kvbroker.route_reason"] == "dp_pull_busy_holder"
    assert "pulls" in server.attributes["kvbroker.route_detail"]
    assert "from E2" in server.attributes["kvbroker.route_detail"]
    # E1 is asked to pull, as the placement priced it, at least the part a pull is worth there
    # (pull_fixed_tokens / (1 - pull_token_cost), the defaults: 160 / 0.9).
    sent = fleet["fakes"]["E1"].completions()[-1].body
    assert sent["kv_transfer_params"]["kvbroker"] == {"kv_recompute_threshold": 178}
    # Idle again: the holder gets its conversation back.
    fleet["sessions"]["E2"].set_load(0)
    for _ in range(200):
        if await proxy_load(fleet, "E2") == 0:
            break
        await asyncio.sleep(0.05)
    assert (await chat(fleet, TURN2))["X-KVBroker-Decode"] == "E2"


@pytest.mark.parametrize("fleet", [{"dp_pull_as_placed": False}], indirect=True)
async def test_without_pull_as_placed_the_engine_decides_for_itself(fleet: dict[str, Any]) -> None:
    await announce(fleet, "E2", HISTORY, pb.TIER_GPU)
    fleet["sessions"]["E2"].set_load(4)
    await wait_load(fleet, "E2", 4)
    h = await chat(fleet, TURN2)
    assert (h["X-KVBroker-Decode"], h["X-KVBroker-Route"]) == ("E1", "dp_pull_busy_holder")
    assert "kv_transfer_params" not in fleet["fakes"]["E1"].completions()[-1].body


async def test_short_prompts_nobody_holds_are_balanced(fleet: dict[str, Any]) -> None:
    chosen = []
    for i in range(4):
        h = await chat(fleet, [{"role": "user", "content": f"question {i} " * 8}])
        assert h["X-KVBroker-Route"] == "dp_balance_short_prefix"
        chosen.append(h["X-KVBroker-Decode"])
    assert set(chosen) == {"E1", "E2"}


async def test_a_request_is_backlog_on_its_engine_until_its_first_byte(fleet: dict[str, Any]) -> None:
    """The placement's predicted prompt tokens count on the chosen engine until it answers."""
    e1, e2 = fleet["fakes"]["E1"], fleet["fakes"]["E2"]
    for fake in (e1, e2):
        fake.mode, fake.delay_s = "slow", 4.0
    first = asyncio.create_task(chat(fleet, TURN2))  # nobody holds it: the whole prompt is backlog
    for _ in range(200):
        engines = await health_engines(fleet)
        busy = [e for e in engines if e["backlog_tokens"] > 0]
        if busy:
            break
        await asyncio.sleep(0.05)
    assert len(busy) == 1 and busy[0]["backlog_tokens"] >= 64, engines
    await first
    assert all(e["backlog_tokens"] == 0 for e in await health_engines(fleet))


async def health_engines(fleet: dict[str, Any]) -> list[dict[str, Any]]:
    async with fleet["http"].get(fleet["url"] + "/health") as resp:
        return list(json.loads(await resp.read())["engines"])


def test_backlog_is_counted_until_the_first_byte_or_the_end() -> None:
    from kvbroker.clients.proxy import EngineSpec
    from kvbroker.clients.proxy.engines import EnginePool

    a = EngineSpec("http://a", "both", "A")
    pool = EnginePool([a])
    with pool.serving(a, 300) as one, pool.serving(a, 200):
        assert pool.backlog_of(a) == 500 and pool.in_flight(a) == 2
        one.prefilled()
        one.prefilled()  # once only
        assert pool.backlog_of(a) == 200
    assert pool.backlog_of(a) == 0 and pool.in_flight(a) == 0  # the end of the other one


async def test_requests_in_flight_at_the_proxy_count_as_load(fleet: dict[str, Any]) -> None:
    """Without any heartbeat, what the proxy itself has sent an engine spreads the next requests."""
    await announce(fleet, "E2", HISTORY, pb.TIER_GPU)
    e2 = fleet["fakes"]["E2"]
    e2.mode, e2.delay_s = "slow", 4.0  # a slow answer: the proxy has it in flight meanwhile
    first = asyncio.create_task(chat(fleet, TURN2))
    await wait_load(fleet, "E2", 1)
    # One request in flight on E2 costs 256 tokens of waiting; a pull of its prefix costs less.
    h = await chat(fleet, TURN2)
    assert (h["X-KVBroker-Decode"], h["X-KVBroker-Route"]) == ("E1", "dp_pull_busy_holder")
    assert (await first)["X-KVBroker-Decode"] == "E2"
    assert await proxy_load(fleet, "E2") == 0  # counted until its answer ended


def test_an_engines_load_is_its_score_load_or_the_proxys_in_flight_count_whichever_is_larger() -> None:
    from kvbroker.clients.proxy import EngineSpec
    from kvbroker.clients.proxy.engines import EnginePool
    from kvbroker.clients.proxy.routing import Route

    a = EngineSpec("http://a", "both", "A")
    pool = EnginePool([a])
    route = Route([a], [a], loads={"A": 2.0})
    assert route.load_of(a, pool) == 2.0  # the load the engine heartbeat, as Score answered it
    for _ in range(3):
        pool.started(a)
    assert route.load_of(a, pool) == 3.0  # the proxy's own requests there, not yet reported
    assert Route([a], [a]).load_of(a, pool) == 3.0  # unscored: the engine list's load (0 here)
    for _ in range(3):
        pool.ended(a)
    pool.ended(a)  # one end too many does not go negative
    assert pool.in_flight(a) == 0 and route.load_of(a, pool) == 2.0
