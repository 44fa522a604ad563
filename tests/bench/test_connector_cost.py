"""bench.fleet.connector_cost's parts without engines: the prompts, the streamed client's timings
(against a small stand-in server that streams as vLLM's completions endpoint does) and the ratios.
The program itself runs real vLLM engines (docs/bench.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from bench.fleet import connector_cost as cc
from testkit.http import serve_app


def test_prompts_share_a_system_prompt_per_class_and_differ_per_seed() -> None:
    batch = cc.prompts(7, 9)
    assert len(batch) == 9 and all(len(p) == cc.SYSTEM_TOKENS + cc.OWN_TOKENS for p in batch)
    system = cc.SYSTEM_TOKENS
    assert batch[0][:system] == batch[cc.CLASSES][:system] == batch[2 * cc.CLASSES][:system]
    assert batch[0][:system] != batch[1][:system]
    assert batch[0][system:] != batch[cc.CLASSES][system:], "each prompt has tokens of its own"
    assert cc.prompts(7, 9) == batch, "the same seed, the same prompts"
    assert cc.prompts(8, 9)[0][:system] != batch[0][:system], "a new seed, an empty prefix cache"


@pytest.fixture
async def streaming_server() -> AsyncIterator[tuple[str, list[dict[str, object]]]]:
    """Streams `max_tokens` chunks of one token id each (as vLLM does with `return_token_ids`),
    2 ms apart, after 20 ms; a prompt of one token gets a 500."""
    bodies: list[dict[str, object]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if len(body["prompt"]) == 1:
            return web.Response(status=500, text="no")
        response = web.StreamResponse()
        await response.prepare(request)
        await asyncio.sleep(0.02)
        for i in range(int(body["max_tokens"])):
            chunk = {"choices": [{"text": f"t{i}", "token_ids": [100 + i]}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.002)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner, url = await serve_app(app)
    try:
        yield url, bodies
    finally:
        await runner.cleanup()


async def test_serve_times_the_first_token_and_the_ones_after(
    streaming_server: tuple[str, list[dict[str, object]]],
) -> None:
    url, bodies = streaming_server
    run = await cc.serve(url, "m", cc.prompts(1, 6), concurrency=2)
    assert len(bodies) == 6
    assert all(b["max_tokens"] == cc.ANSWER_TOKENS and b["temperature"] == 0 and b["stream"] for b in bodies)
    assert all(b["return_token_ids"] for b in bodies), "tokens counted by id, as the fleet counts them"
    assert 20 <= run["ttft_ms_p50"] < 1000
    assert 2 <= run["tpot_ms_p50"] < 200
    assert run["wall_s"] >= 3 * 0.02, "two at a time: three waves at least"
    with pytest.raises(Exception, match="500"):
        await cc.serve(url, "m", [[1]], concurrency=1)


def test_ratios_are_medians_against_the_stock_engine() -> None:
    runs = {
        "stock": [{"cpu_s": 10.0}, {"cpu_s": 12.0}, {"cpu_s": 11.0}],
        "ours": [{"cpu_s": 12.1}, {"cpu_s": 99.0}, {"cpu_s": 11.0}],
    }
    got = cc.ratios(runs, "cpu_s")
    assert got["stock"] == 1.0
    assert got["ours"] == pytest.approx(12.1 / 11.0)
