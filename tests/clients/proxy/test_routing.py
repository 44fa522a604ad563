"""Engine choice: the proxy asks a real in-process broker which engine holds the prompt's prefix."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvbroker.clients.proxy import EngineSpec, ProxyConfig, build_app
from kvbroker.clients.proxy.engines import EngineLayout, EnginePool
from kvbroker.clients.proxy.routing import (
    PrefixMatch,
    Route,
    namespace_tenant,
    order_engines,
    tokenize_body,
)
from kvbroker.common.hashing import wire_chain
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders
from testkit.broker import RunningServer, running_broker
from tests.clients.proxy.fake_engine import FakeEngine, chat_text, fake_tokens

pytestmark = pytest.mark.timeout(30)
BLOCK = 32


def engine_info(engine_id: str, role: str, url: str) -> pb.EngineInfo:
    return builders.engine_info(
        engine_id,
        ranks=1,
        agent_name="{engine_id}-agent",
        num_blocks=64,
        labels={"role": role, "url": url},
        model="tiny",
        block_size=BLOCK,
        head_size=32,
    )


@pytest.fixture
async def broker() -> AsyncIterator[RunningServer]:
    async with running_broker(session_ttl_ms=2_000, session_ttl_min_ms=100, shutdown_grace_s=0.2) as server:
        yield server


@pytest.fixture
async def stack(broker: RunningServer) -> AsyncIterator[dict[str, Any]]:
    """Fake engines P, D1, D2 registered with the real broker (labels role, url); a proxy that discovers
    them and always prefills on P (see `local_stack` for the default, which may skip P)."""
    async with _stack(broker, local_prefill_tokens=0) as s:
        yield s


@pytest.fixture
async def local_stack(broker: RunningServer) -> AsyncIterator[dict[str, Any]]:
    """The same with the proxy's default --local-prefill-tokens."""
    async with _stack(broker) as s:
        yield s


@contextlib.asynccontextmanager
async def _stack(broker: RunningServer, **config: Any) -> AsyncIterator[dict[str, Any]]:
    roles = {"P": "prefill", "D1": "decode", "D2": "decode"}
    async with proxy_stack(broker, roles, **config) as s:
        yield s


@contextlib.asynccontextmanager
async def proxy_stack(
    broker: RunningServer,
    roles: dict[str, str],
    *,
    ttl_ms: int = 2_000,
    on_pin: Any = None,
    tracer_provider: Any = None,
    **config: Any,
) -> AsyncIterator[dict[str, Any]]:
    """Fake engines (name -> role) registered with the real broker (labels role, url) and a proxy
    that discovers them (ProxyConfig: refresh every 0.2 s, connect timeout 1 s, then `config`).
    Yields fakes, sessions, url, http and the proxy's app."""
    from kvbroker.clients.aio import AsyncBrokerClient
    from kvbroker.clients.engine_session import EngineSession

    fakes = {name: await FakeEngine(name).start() for name in roles}
    sessions = {}
    for name, fake in fakes.items():
        info = engine_info(name, roles[name], fake.url)
        session = EngineSession(broker.address, info, ttl_ms=ttl_ms, on_pin=on_pin)
        await session.start(wait_connected_s=5)
        sessions[name] = session
    settings: dict[str, Any] = {"refresh_interval_s": 0.2, "connect_timeout_s": 1.0, **config}
    app = build_app(
        ProxyConfig(broker=broker.address, **settings),
        broker=AsyncBrokerClient(broker.address),
        tracer_provider=tracer_provider,
    )
    server = TestServer(app)
    await server.start_server()
    http = aiohttp.ClientSession()
    try:
        yield {
            "fakes": fakes,
            "sessions": sessions,
            "url": str(server.make_url("")).rstrip("/"),
            "http": http,
            "app": app,
        }
    finally:
        await http.close()
        await server.close()
        for s in sessions.values():
            await s.close()
        for f in fakes.values():
            await f.stop()


async def chat(stack: dict[str, Any], messages: list[dict[str, str]]) -> tuple[str, str, str]:
    prefill, decode, answer, _ = await chat_mode(stack, messages)
    return prefill, decode, answer


async def chat_mode(stack: dict[str, Any], messages: list[dict[str, str]]) -> tuple[str, str, str, str]:
    """(prefill engine, decode engine, answer, X-KVBroker-Mode) of one chat request through the proxy."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 4}
    async with stack["http"].post(stack["url"] + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = json.loads(await resp.read())["choices"][0]["message"]["content"]
        h = resp.headers
        return h.get("X-KVBroker-Prefill", ""), h["X-KVBroker-Decode"], answer, h["X-KVBroker-Mode"]


async def announce(stack: dict[str, Any], holder: str, messages: list[dict[str, str]], tier: int) -> None:
    session = stack["sessions"][holder]
    hashes = wire_chain(fake_tokens(chat_text(messages)), BLOCK)
    assert len(hashes) >= 2
    session.announce_stored(pb.Namespace(layout_id=session.layout_id, tenant=""), tier, hashes)
    session.flush()
    await session.applied()  # the broker has applied it: the proxy's next Score sees it


async def test_engines_are_discovered_from_the_broker(stack: dict[str, Any]) -> None:
    prefill, decode, answer = await chat(stack, [{"role": "user", "content": "a fresh question " * 3}])
    assert prefill == "P" and decode in ("D1", "D2")
    assert answer.startswith(f"{decode} pulled")


async def test_next_turn_goes_to_the_engine_holding_the_history(stack: dict[str, Any]) -> None:
    turn1 = [{"role": "user", "content": "what is a kv cache broker? " * 3}]
    await announce(
        stack, "D2", [*turn1, {"role": "assistant", "content": "an index of blocks " * 3}], pb.TIER_GPU
    )
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "an index of blocks " * 3},
        {"role": "user", "content": "more"},
    ]
    # Whatever the rotation, D2 wins every time: it holds the longest prefix.
    for _ in range(3):
        _, decode, _ = await chat(stack, turn2)
        assert decode == "D2"
    # P's hold names the chosen decoder as its reader.
    params = stack["fakes"]["P"].completions()[-1].body["kv_transfer_params"]
    assert params["kvbroker"] == {"reader_engine_id": "D2"}
    # A different conversation held by D1 on its CPU tier only goes to D1.
    other = [{"role": "user", "content": "tell me a different story please " * 3}]
    await announce(stack, "D1", other, pb.TIER_CPU)
    _, decode, _ = await chat(stack, [*other, {"role": "assistant", "content": "ok"}])
    assert decode == "D1"


async def test_a_decode_engine_holding_all_but_a_few_tokens_serves_the_turn_alone(
    local_stack: dict[str, Any],
) -> None:
    stack = local_stack
    turn1 = [{"role": "user", "content": "what is a kv cache broker? " * 3}]
    history = [*turn1, {"role": "assistant", "content": "an index of blocks " * 3}]
    await announce(stack, "D2", history, pb.TIER_GPU)
    p_calls = len(stack["fakes"]["P"].completions())
    prefill, decode, _, mode = await chat_mode(stack, [*history, {"role": "user", "content": "more"}])
    assert (prefill, decode, mode) == ("", "D2", "local")
    assert len(stack["fakes"]["P"].completions()) == p_calls  # no prefill hop
    assert "kv_transfer_params" not in stack["fakes"]["D2"].completions()[-1].body
    # A long new message is more than D2 should compute while it decodes: P prefills it.
    long_turn = [*history, {"role": "user", "content": "a much longer follow-up question " * 60}]
    prefill, decode, _, mode = await chat_mode(stack, long_turn)
    assert (prefill, decode, mode) == ("P", "D2", "pd")
    # A fresh conversation nobody holds goes P then D however short it is.
    prefill, _, _, mode = await chat_mode(stack, [{"role": "user", "content": "a fresh one " * 3}])
    assert (prefill, mode) == ("P", "pd")


def test_local_prefill_counts_the_tokens_the_decode_engine_lacks() -> None:
    d = EngineSpec("http://d", "decode", "D")
    route = Route(
        [], [d], num_tokens=200, matches={"D": PrefixMatch(gpu_blocks=5)}, scored=True, block_size=32
    )
    assert route.local_prefill(d, 40) == 40 and route.local_prefill(d, 39) is None
    assert route.local_prefill(d, 0) is None  # off
    route.matches["D"] = PrefixMatch(cpu_blocks=6)
    assert route.local_prefill(d, 8) == 8  # its CPU tier counts: it restores from it locally
    route.matches["D"] = PrefixMatch()
    assert route.local_prefill(d, 1000) is None  # holds nothing: not its conversation
    assert route.local_prefill(EngineSpec("http://x", "decode", "X"), 1000) is None


async def test_requests_spread_when_nobody_holds_the_prompt(stack: dict[str, Any]) -> None:
    chosen = {(await chat(stack, [{"role": "user", "content": f"question {i} " * 8}]))[1] for i in range(4)}
    assert chosen == {"D1", "D2"}


async def test_broker_down_still_serves(stack: dict[str, Any], broker: Any) -> None:
    await broker.stop(0.1)
    _, decode, answer = await chat(stack, [{"role": "user", "content": "no broker now " * 4}])
    assert answer.startswith(f"{decode} pulled")


def _score(engine_id: str, gpu: int = 0, cpu: int = 0, draining: bool = False) -> pb.EngineScore:
    return pb.EngineScore(engine_id=engine_id, gpu_blocks=gpu, cpu_blocks=cpu, draining=draining)


def test_order_engines_puts_holders_first_in_broker_order() -> None:
    a, b, c, d = (EngineSpec(f"http://{n}", "decode", n) for n in "abcd")
    pool = EnginePool([a, b, c, d])
    # The broker's order: c (longest, CPU), b (shorter, GPU); a and d hold nothing.
    scores = [_score("c", cpu=4), _score("b", gpu=2), _score("a"), _score("d")]
    assert order_engines([a, b, c, d], scores, pool, rotation=0)[:2] == [c, b]
    rest = {tuple(order_engines([a, b, c, d], scores, pool, rotation=r)[2:]) for r in range(4)}
    assert rest == {(a, d), (d, a)}  # rotated among the engines holding nothing
    pool.mark_failed(c)
    assert order_engines([a, b, c, d], scores, pool, rotation=0)[0] == b
    assert order_engines([a, b, c, d], scores, pool, rotation=0)[-1] == c
    draining = [_score("c", gpu=9, draining=True)]
    assert order_engines([a, c], draining, EnginePool([a, c]), rotation=0)[0] == a


def test_static_engines_learn_their_ids_from_the_broker() -> None:
    pool = EnginePool([EngineSpec("http://h:1", "prefill"), EngineSpec("http://h:2", "decode", "mine")])
    info = engine_info("p-7", "prefill", "h:1/")
    pool.apply_broker_engines([info])
    assert [e.engine_id for e in pool.engines] == ["p-7", "mine"]
    assert pool.layout_of(pool.engines[0]) == EngineLayout(info.layout_id, BLOCK, "sha256")


def test_tokenize_request_and_tenant() -> None:
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    assert tokenize_body("/v1/chat/completions", chat_body) == {
        "model": "m",
        "messages": chat_body["messages"],
        "add_generation_prompt": True,
    }
    assert tokenize_body("/v1/completions", {"prompt": ["a", "b"]}) is None
    assert namespace_tenant("", "salt") == "salt" and namespace_tenant("t", None) == "t/"


async def test_a_router_that_requires_exact_stops_following_a_silent_holder(broker: RunningServer) -> None:
    """--require-exact-index: D3 holds the history, then goes silent (its evictions would not
    arrive either): the broker calls it degraded, and the proxy no longer counts its prefix."""
    import grpc

    from kvbroker.v1 import broker_pb2_grpc
    from tests.broker.session_util import RawSession

    async with _stack(broker, local_prefill_tokens=0, require_exact_index=True) as s:
        d3 = await FakeEngine("D3").start()
        try:
            async with grpc.aio.insecure_channel(broker.address) as channel:
                stub = broker_pb2_grpc.KVBrokerStub(channel)
                silent = RawSession(stub)  # registers and announces, then never speaks again
                reg = await silent.register(engine_info("D3", "decode", d3.url), 6_000)
                turn1 = [{"role": "user", "content": "a conversation only D3 holds " * 3}]
                history = [*turn1, {"role": "assistant", "content": "held by D3 " * 3}]
                hashes = wire_chain(fake_tokens(chat_text(history)), BLOCK)
                await silent.announce(pb.Namespace(layout_id=reg.layout_id), pb.TIER_GPU, hashes)
                await silent.applied()
                turn2 = [*history, {"role": "user", "content": "more"}]
                seen: set[str] = set()

                async def routed_to_d3() -> bool:
                    _, decode, _ = await chat(s, turn2)
                    seen.add(decode)
                    return decode == "D3"

                # Once the proxy has discovered D3 (it re-reads the engine list every 0.2 s), the
                # exact holder of the longest prefix wins.
                found_by = asyncio.get_running_loop().time() + 3.0
                while not await routed_to_d3():
                    assert asyncio.get_running_loop().time() < found_by, f"D3 never won: {seen}"
                    await asyncio.sleep(0.2)
                deadline = asyncio.get_running_loop().time() + 5.5  # degraded after 4 s, gone at 6 s
                while await routed_to_d3():
                    assert asyncio.get_running_loop().time() < deadline, "the silent D3 kept winning"
                    await asyncio.sleep(0.2)
                engines = {e.engine_id: e for e in (await stub.ListEngines(pb.ListEnginesRequest())).engines}
                assert engines["D3"].exactness == pb.INDEX_DEGRADED, "D3 lost for being degraded, not gone"
                assert seen - {"D3"} <= {"D1", "D2"}
                await silent.close()
        finally:
            await d3.stop()


async def test_a_turn_held_on_d_does_not_wait_behind_another_chats_prefill(stack: dict[str, Any]) -> None:
    """With --local-prefill-tokens 0 every turn is prefilled on P, unless P is busy with another
    conversation's prefill: then D, which holds the history, computes the new part itself."""
    import asyncio

    turn1 = [{"role": "user", "content": "what is a kv cache broker? " * 3}]
    history = [*turn1, {"role": "assistant", "content": "an index of blocks " * 3}]
    await announce(stack, "D2", history, pb.TIER_GPU)
    turn2 = [*history, {"role": "user", "content": "more"}]
    assert (await chat_mode(stack, turn2))[3] == "pd", "P idle: it prefills"
    p = stack["fakes"]["P"]
    p.mode, p.delay_s = "slow", 2.0
    other = asyncio.create_task(chat(stack, [{"role": "user", "content": "another long conversation " * 20}]))
    while not any("another long" in str(c.body) for c in p.completions()):
        await asyncio.sleep(0.01)
    prefill, decode, _, mode = await chat_mode(stack, turn2)
    assert (prefill, decode, mode) == ("", "D2", "local"), "P busy: D serves the turn it holds"
    await other
    async with stack["http"].get(stack["url"] + "/metrics") as resp:
        metrics = await resp.text()
    assert 'kvbroker_proxy_route_choices_total{reason="local_p_busy"} 1.0' in metrics
    assert 'kvbroker_proxy_route_choices_total{reason="pd_p_idle"}' in metrics
