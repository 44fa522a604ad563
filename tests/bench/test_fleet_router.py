"""bench.fleet.router, the baselines' router: a request is sent again when the engine's server resets
a pooled connection before answering (uvicorn closing an idle keep-alive connection as the router
reuses it), as routers users run do, instead of failing a request the engine never saw."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

from aiohttp import ClientSession

from bench.fleet.router import Picker, build_app
from testkit.http import serve_app

ANSWER = b'{"choices": [{"text": "ok"}]}'


async def _engine(resets: int) -> tuple[asyncio.Server, list[str]]:
    """An HTTP engine stand-in whose first `resets` connections are reset (RST, no answer) once a
    request arrives on them; later ones answer."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        )
        await reader.readexactly(length)
        if len(seen) < resets:
            seen.append("reset")
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        seen.append("answered")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(ANSWER)}\r\n\r\n".encode()
            + ANSWER
        )
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


async def _through_router(resets: int) -> tuple[int, bytes, list[str]]:
    engine, seen = await _engine(resets)
    port = engine.sockets[0].getsockname()[1]
    runner, url = await serve_app(build_app(Picker({"e0": f"http://127.0.0.1:{port}"}, "rr")))
    try:
        async with ClientSession() as http:
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}
            async with http.post(f"{url}/v1/completions", data=json.dumps(body)) as r:
                return r.status, await r.read(), seen
    finally:
        await runner.cleanup()
        engine.close()
        await engine.wait_closed()


def test_a_reset_before_the_answer_is_sent_again() -> None:
    status, body, seen = asyncio.run(_through_router(resets=2))
    assert (status, body) == (200, ANSWER)
    assert seen == ["reset", "reset", "answered"]


def test_an_engine_that_keeps_resetting_fails_the_request_after_three_tries() -> None:
    status, _, seen = asyncio.run(_through_router(resets=5))
    assert status == 500 and seen == ["reset"] * 3
