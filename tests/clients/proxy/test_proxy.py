"""The P/D proxy against fake HTTP engines: protocol, streaming, retries, fallback, errors, traces."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvbroker.clients.proxy import EngineSpec, ProxyConfig, build_app
from kvbroker.tools.launch import free_port
from testkit.http import serve_app
from tests.clients.proxy.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


class Proxy:
    def __init__(self, server: TestServer, http: aiohttp.ClientSession) -> None:
        self.server = server
        self.http = http

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, CIMultiDict[str], bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(
            self.url + path, data=data, headers={"Content-Type": "application/json", **kw}
        ) as resp:
            return resp.status, CIMultiDict(resp.headers), await resp.read()


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeEngine] = []

    async def make(name: str, **kw: Any) -> FakeEngine:
        engine = await FakeEngine(name, **kw).start()
        started.append(engine)
        return engine

    yield make
    for e in started:
        await e.stop()


@pytest.fixture
async def proxy() -> AsyncIterator[Callable[..., Any]]:
    servers: list[TestServer] = []
    http = aiohttp.ClientSession()

    async def make(
        prefill: list[str], decode: list[str], broker: Any = None, provider: Any = None, **config: Any
    ) -> Proxy:
        specs = tuple(EngineSpec(u, "prefill") for u in prefill) + tuple(
            EngineSpec(u, "decode") for u in decode
        )
        cfg = ProxyConfig(engines=specs, connect_timeout_s=1.0, cooldown_s=60.0, **config)
        server = TestServer(build_app(cfg, broker=broker, tracer_provider=provider))
        await server.start_server()
        servers.append(server)
        return Proxy(server, http)

    yield make
    for s in servers:
        await s.close()
    await http.close()


COMPLETION = {"model": "tiny", "prompt": "tell me about the cache " * 4, "max_tokens": 8, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there " * 4}], "max_tokens": 8}


async def test_prefill_then_decode_with_returned_params(engines: Any, proxy: Any) -> None:
    p, d = await engines("P"), await engines("D")
    px = await proxy([p.url], [d.url])
    status, headers, raw = await px.post("/v1/completions", COMPLETION, **{"X-Request-Id": "req-1"})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["text"].startswith("D pulled")
    (pre,) = p.completions()
    assert pre.body["max_tokens"] == 1 and pre.body["stream"] is False
    assert pre.body["kv_transfer_params"]["do_remote_decode"] is True
    assert "kvbroker" not in pre.body["kv_transfer_params"]  # D's broker id is not known here
    assert pre.body["prompt"] == COMPLETION["prompt"]
    (dec,) = d.completions()
    assert dec.body["max_tokens"] == 8
    # P's answer, passed on unchanged (its hold named, so a failed decode can decline it).
    assert dec.body["kv_transfer_params"]["kvbroker"] == {
        "holder_engine_id": "P",
        "num_blocks": 2,
        "hold_request_id": "P-req-1",
    }
    assert dec.body["kv_transfer_params"]["do_remote_prefill"] is True
    # One request id end to end, so engine logs and broker leases line up.
    assert pre.headers["X-Request-Id"] == dec.headers["X-Request-Id"] == headers["X-Request-Id"] == "req-1"
    assert headers["X-KVBroker-Mode"] == "pd"
    assert headers["X-KVBroker-Prefill"] == p.url and headers["X-KVBroker-Decode"] == d.url


async def test_chat_streaming_relays_decode_chunks(engines: Any, proxy: Any) -> None:
    p, d = await engines("P"), await engines("D")
    px = await proxy([p.url], [d.url])
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 8}
    status, headers, raw = await px.post("/v1/chat/completions", body)
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
    assert text.startswith("D pulled w0")
    (pre,) = p.completions()
    assert pre.body["stream"] is False and "stream_options" not in pre.body
    assert pre.body["max_completion_tokens"] == 1
    (dec,) = d.completions()
    assert dec.body["stream"] is True and dec.body["stream_options"] == {"include_usage": True}


async def test_dead_prefill_is_skipped_for_the_next_one(engines: Any, proxy: Any) -> None:
    p2, d = await engines("P2"), await engines("D")
    px = await proxy([dead_url(), p2.url], [d.url])
    status, headers, _ = await px.post("/v1/completions", COMPLETION)
    assert status == 200
    assert headers["X-KVBroker-Mode"] == "pd" and headers["X-KVBroker-Prefill"] == p2.url
    # The dead engine now cools down: the next request goes to P2 first, without a failed try.
    status, headers, _ = await px.post("/v1/completions", COMPLETION)
    assert status == 200 and len(p2.completions()) == 2


async def test_no_prefill_left_falls_back_to_decode_alone(engines: Any, proxy: Any) -> None:
    bad = await engines("P", mode="error500")
    d = await engines("D")
    px = await proxy([bad.url, dead_url()], [d.url])
    status, headers, raw = await px.post("/v1/completions", COMPLETION)
    assert status == 200
    assert json.loads(raw)["choices"][0]["text"].startswith("D computed")
    assert headers["X-KVBroker-Mode"] == "single"
    assert headers["X-KVBroker-Fallback"] == "no prefill engine answered"
    assert "kv_transfer_params" not in d.completions()[0].body


async def test_failed_decode_retries_another_decode(engines: Any, proxy: Any) -> None:
    p = await engines("P")
    bad, d2 = await engines("D1", mode="error500"), await engines("D2")
    px = await proxy([p.url], [bad.url, d2.url])
    status, headers, raw = await px.post("/v1/completions", COMPLETION)
    assert status == 200
    assert json.loads(raw)["choices"][0]["text"].startswith("D2 pulled")
    assert headers["X-KVBroker-Decode"] == d2.url


async def test_no_decode_left_falls_back_to_the_prefill_engine(engines: Any, proxy: Any) -> None:
    p = await engines("P")
    px = await proxy([p.url], [dead_url()])
    status, headers, raw = await px.post("/v1/chat/completions", CHAT)
    assert status == 200
    assert json.loads(raw)["choices"][0]["message"]["content"].startswith("P computed")
    assert headers["X-KVBroker-Mode"] == "single" and headers["X-KVBroker-Decode"] == p.url
    assert [s.body.get("kv_transfer_params") is None for s in p.completions()] == [False, True]


async def test_decode_dying_mid_stream_ends_with_an_error_event(engines: Any, proxy: Any) -> None:
    p, d = await engines("P"), await engines("D", mode="die_mid_stream")
    px = await proxy([p.url], [d.url])
    status, _, raw = await px.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200  # headers went out with the first chunk
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "D "
    assert "failed mid-stream" in json.loads(events[-1])["error"]["message"]


@pytest.mark.parametrize("leaves", ["mid-stream", "after [DONE]"])
async def test_a_client_that_leaves_does_not_fail_the_engine(engines: Any, leaves: str) -> None:
    # Served as `python -m kvbroker.clients.proxy` serves it (aiohttp does not cancel the
    # handler when its client leaves; its next write fails instead).
    p, d = await engines("P"), await engines("D", mode="trickle", delay_s=0.2, words=3)
    specs = (EngineSpec(p.url, "prefill"), EngineSpec(d.url, "decode"))
    runner, url = await serve_app(
        build_app(ProxyConfig(engines=specs, connect_timeout_s=1.0, cooldown_s=60.0))
    )
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
                assert resp.status == 200
                line = await resp.content.readline()
                while leaves == "after [DONE]" and not line.startswith(b"data: [DONE]"):
                    line = await resp.content.readline()
            await asyncio.sleep(1.0)  # D's next bytes (or its end) meet the closed connection
            async with http.get(url + "/health") as resp:
                (decode,) = [e for e in (await resp.json())["engines"] if e["role"] == "decode"]
            async with http.get(url + "/metrics") as resp:
                metrics = await resp.text()
        assert decode["healthy"] is True, decode
        assert 'status="500"' not in metrics
    finally:
        await runner.cleanup()


async def test_client_error_is_passed_through_without_retry(engines: Any, proxy: Any) -> None:
    p = await engines("P", mode="reject400")
    d = await engines("D")
    px = await proxy([p.url], [d.url])
    status, _, raw = await px.post("/v1/completions", COMPLETION)
    assert status == 400
    assert json.loads(raw)["error"]["message"] == "max_tokens too large"
    assert d.completions() == []


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": -1},
        {"max_tokens": 0},
        {"max_tokens": "8"},
        {"max_completion_tokens": -5},
        {"n": 0},
        {"temperature": -0.5},
        {"top_p": 1.5},
        {"stream": "yes"},
    ],
)
async def test_an_invalid_request_is_refused_before_p_prefills_it(
    engines: Any, proxy: Any, bad: dict[str, Any]
) -> None:
    p, d = await engines("P"), await engines("D")
    px = await proxy([p.url], [d.url])
    status, _, raw = await px.post("/v1/completions", {**COMPLETION, **bad})
    assert status == 400
    error = json.loads(raw)["error"]
    (field,) = bad
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"
    assert p.completions() == [] and d.completions() == []  # no prefill, no hold to decline


@pytest.mark.parametrize("rejecting", ["P", "D"])
async def test_an_engines_rejection_describes_the_clients_body_not_ours(
    engines: Any, proxy: Any, rejecting: str
) -> None:
    p = await engines("P", mode="reject400_like_vllm" if rejecting == "P" else "ok")
    d = await engines("D", mode="reject400_like_vllm" if rejecting == "D" else "ok")
    px = await proxy([p.url], [d.url])
    client = {"model": "tiny", "prompt": "two keys and a third " * 4}
    status, _, raw = await px.post("/v1/completions", client)
    assert status == 400
    message = json.loads(raw)["error"]["message"]
    assert "<dict of 2 items>" in message, message


async def test_nothing_can_serve_gives_a_clean_503(proxy: Any) -> None:
    px = await proxy([dead_url()], [dead_url()])
    status, _, raw = await px.post("/v1/completions", COMPLETION)
    assert status == 503
    error = json.loads(raw)["error"]
    assert error["type"] == "service_unavailable"
    assert "no engine could serve the request" in error["message"]
    assert "ClientConnectorError" in error["message"]


async def test_bad_json_is_rejected(engines: Any, proxy: Any) -> None:
    d = await engines("D")
    px = await proxy([], [d.url])
    status, _, raw = await px.post("/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]
    status, _, raw = await px.post("/v1/completions", [1, 2])
    assert status == 400 and "JSON object" in json.loads(raw)["error"]["message"]
    assert d.completions() == []


async def test_single_engine_mode_without_prefill_engines(engines: Any, proxy: Any) -> None:
    d = await engines("D")
    px = await proxy([], [d.url])
    status, headers, _ = await px.post("/v1/completions", COMPLETION)
    assert status == 200 and headers["X-KVBroker-Mode"] == "single"
    assert headers["X-KVBroker-Fallback"] == "no prefill engine"


async def test_health_and_models(engines: Any, proxy: Any) -> None:
    d = await engines("D")
    px = await proxy([dead_url()], [d.url])
    async with px.http.get(px.url + "/health") as resp:
        assert resp.status == 200
        health = await resp.json()
    assert [e["role"] for e in health["engines"]] == ["prefill", "decode"]
    async with px.http.get(px.url + "/v1/models") as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["owned_by"] == "D"
    nobody = await proxy([dead_url()], [])
    await nobody.post("/v1/completions", COMPLETION)  # marks the only engine failed
    async with px.http.get(nobody.url + "/health") as resp:
        assert resp.status == 503


async def test_trace_context_reaches_engines_in_headers_and_kv_transfer_params(
    engines: Any, proxy: Any
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    p, d = await engines("P"), await engines("D")
    px = await proxy([p.url], [d.url], provider=provider)
    client_trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    status, _, _ = await px.post("/v1/completions", COMPLETION, traceparent=client_trace)
    assert status == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    server, pre, dec = spans["POST /v1/completions"], spans["proxy.prefill"], spans["proxy.decode"]
    # The proxy continues the client's trace, and P and D continue the proxy's.
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {
        "0af7651916cd43dd8448eb211c80319c"
    }
    assert pre.parent is not None and pre.parent.span_id == server.context.span_id
    assert dec.parent is not None and dec.parent.span_id == server.context.span_id
    p_req, d_req = p.completions()[0], d.completions()[0]
    assert p_req.headers["traceparent"] == f"00-{pre.context.trace_id:032x}-{pre.context.span_id:016x}-01"
    assert p_req.body["kv_transfer_params"]["trace_context"]["traceparent"] == p_req.headers["traceparent"]
    assert d_req.body["kv_transfer_params"]["trace_context"]["traceparent"] == (
        f"00-{dec.context.trace_id:032x}-{dec.context.span_id:016x}-01"
    )
    assert server.attributes is not None and server.attributes["kvbroker.mode"] == "pd"


def test_help_explains_every_flag() -> None:
    from kvbroker.clients.proxy.config import build_parser

    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 15, action.option_strings


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbroker.clients.proxy.config import build_parser, config_from_args

    monkeypatch.setenv("KVBROKER_PROXY_DECODE", "d1=http://h1:8001/, h2:8002")
    monkeypatch.setenv("KVBROKER_PROXY_PORT", "9001")
    args = build_parser().parse_args(["--prefill", "p1=http://h0:8000", "--broker", "b:50051"])
    config = config_from_args(args)
    assert config.port == 9001 and config.broker == "b:50051"
    assert config.engines == (
        EngineSpec("http://h0:8000", "prefill", "p1"),
        EngineSpec("http://h1:8001", "decode", "d1"),
        EngineSpec("http://h2:8002", "decode", ""),
    )
    monkeypatch.delenv("KVBROKER_PROXY_DECODE")
    monkeypatch.delenv("KVBROKER_ADDR", raising=False)
    with pytest.raises(SystemExit, match="give engines"):
        config_from_args(build_parser().parse_args([]))
