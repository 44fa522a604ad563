"""The fleet benchmark's own small routers, for the setups users run today (a benchmark peer, not a product).

    python -m bench.fleet.router --policy rr --engine ID=URL ... [--port N]
    python -m bench.fleet.router --policy prefix --engine ID=URL ... --broker HOST:PORT
    python -m bench.fleet.router --policy nixl-pd --prefill URL --decode URL

Policies, all on `/v1/completions` with token-id prompts (what bench.fleet sends):

- `rr`: round robin over the engines, the balancer in front of data-parallel vLLM;
- `prefix`: precise prefix-cache-aware routing from vLLM's KV events (what llm-d's
  precise prefix-cache scorer and Dynamo's KV router do): the engines publish their KV
  cache events to our broker (`--kv-events`), and for each request the router asks the
  broker's Score API which engine holds the longest prefix of the prompt (namespace:
  the engines' layout, tenant = the request's cache_salt, as the broker files salted
  events); ties (no engine holds anything, or several the same) go to the engine with
  the fewest requests in flight at the router, then round robin. No load term beyond
  the tie-break: a hot prefix stays on its holder however busy it is;
- `nixl-pd`: vLLM's NixlConnector P/D (bench/harness/baselines.py), routed as
  bench.chats.nixl_proxy routes chats: P gets the prompt with `max_tokens 1` and
  `do_remote_decode`, D gets it with P's `kv_transfer_params` and streams the answer.
  D streams, so D's params are not returned and P never reads a history back from D:
  P's own prefix cache holds each session's earlier prompts, D reads each prompt's
  KV from P.

`GET /stats` answers what it routed where and how many Score answers named a holder.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
from collections import Counter
from typing import Any

from aiohttp import (
    ClientOSError,
    ClientResponse,
    ClientSession,
    ClientTimeout,
    ServerDisconnectedError,
    TCPConnector,
    web,
)

from bench.harness.baselines import decode_request, prefill_request

POLICIES = ("rr", "prefix", "nixl-pd")
HTTP: web.AppKey[ClientSession] = web.AppKey("http", ClientSession)


class Picker:
    """Which engine gets a request, by policy."""

    def __init__(self, engines: dict[str, str], policy: str, broker: str = "") -> None:
        self.engines = engines
        self.policy = policy
        self.broker_address = broker
        self.order = itertools.cycle(sorted(engines))
        self.in_flight: Counter[str] = Counter()
        self.routed: Counter[str] = Counter()
        self.scored_hits = 0
        self.score_errors = 0
        self.score_calls = 0
        self.score_s = 0.0  # time spent waiting for Score answers, all calls
        self.client: Any = None
        self.layout_id = ""

    async def start(self) -> None:
        if self.policy != "prefix":
            return
        from kvbroker.clients.aio import AsyncBrokerClient

        self.client = AsyncBrokerClient(self.broker_address)

    async def _layout(self) -> str:
        if not self.layout_id:
            listed = await self.client.list_engines()
            layouts = {e.layout_id for e in listed.engines if e.engine_id in self.engines}
            if len(layouts) == 1:
                self.layout_id = layouts.pop()
        return self.layout_id

    async def pick(self, body: dict[str, Any]) -> str:
        if self.policy == "prefix" and isinstance(body.get("prompt"), list):
            from kvbroker.v1 import broker_pb2 as pb

            try:
                layout = await self._layout()
                if layout:
                    ns = pb.Namespace(layout_id=layout, tenant=str(body.get("cache_salt") or ""))
                    asked = time.perf_counter()
                    answer = await self.client.score(namespace=ns, token_ids=body["prompt"], timeout=2.0)
                    self.score_calls += 1
                    self.score_s += time.perf_counter() - asked
                    held = {s.engine_id: s.gpu_blocks + s.cpu_blocks for s in answer.scores}
                    best = max(held.values(), default=0)
                    if best > 0:
                        self.scored_hits += 1
                        holders = [e for e in sorted(self.engines) if held.get(e, 0) == best]
                        return min(holders, key=lambda e: self.in_flight[e])
            except Exception:  # a Score that fails routes like no holder (counted)
                self.score_errors += 1
            least = min(self.in_flight[e] for e in self.engines)
            for _ in range(len(self.engines)):
                name = next(self.order)
                if self.in_flight[name] == least:
                    return name
        return next(self.order)


def build_app(picker: Picker, prefill: str = "", decode: str = "") -> web.Application:
    timeout = ClientTimeout(total=None, sock_read=600)

    async def on_startup(app: web.Application) -> None:
        # Idle connections close before vLLM's server closes them (5 s), as the proxy's do.
        app[HTTP] = ClientSession(timeout=timeout, connector=TCPConnector(limit=0, keepalive_timeout=4.0))
        await picker.start()

    async def on_cleanup(app: web.Application) -> None:
        await app[HTTP].close()
        if picker.client is not None:
            await picker.client.close()

    async def post(http: ClientSession, url: str, body: dict[str, Any]) -> ClientResponse:
        """POST, sent again (twice at most) when the connection fails before an answer started: a
        pooled keep-alive connection the engine's server was closing as it was reused (uvicorn's
        idle timeout races the next request) resets, and a router users run retries that; without
        it, that race failed a request of this baseline that the engine never saw."""
        for _ in range(2):
            with contextlib.suppress(ClientOSError, ServerDisconnectedError):
                return await http.post(url, json=body)
        return await http.post(url, json=body)

    async def relay(request: web.Request, url: str, body: dict[str, Any]) -> web.StreamResponse:
        http = request.app[HTTP]
        async with await post(http, f"{url}/v1/completions", body) as resp:
            out = web.StreamResponse(
                status=resp.status, headers={"Content-Type": resp.headers.get("Content-Type", "text/plain")}
            )
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if picker.policy == "nixl-pd":
            http = request.app[HTTP]
            async with await post(
                http, f"{prefill}/v1/completions", prefill_request(body, {"do_remote_decode": True})
            ) as resp:
                p_answer = await resp.json()
                if resp.status != 200:
                    return web.json_response(p_answer, status=resp.status)
            params = p_answer.get("kv_transfer_params")
            if not params:
                return web.json_response(
                    {"error": {"message": "P returned no kv_transfer_params"}}, status=502
                )
            picker.routed["P+D"] += 1
            return await relay(request, decode, decode_request(body, params, bool(body.get("stream"))))
        name = await picker.pick(body)
        picker.routed[name] += 1
        picker.in_flight[name] += 1
        try:
            return await relay(request, picker.engines[name], body)
        finally:
            picker.in_flight[name] -= 1

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "policy": picker.policy,
                "routed": dict(picker.routed),
                "scored_hits": picker.scored_hits,
                "score_errors": picker.score_errors,
                "score_calls": picker.score_calls,
                "score_ms_total": round(picker.score_s * 1000, 1),
            }
        )

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/stats", stats)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.fleet.router", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--policy", choices=POLICIES, required=True)
    ap.add_argument("--engine", action="append", default=[], metavar="ID=URL", help="an engine (rr, prefix)")
    ap.add_argument("--broker", default="", help="the broker following the engines' KV events (prefix)")
    ap.add_argument("--prefill", default="", help="P's URL (nixl-pd)")
    ap.add_argument("--decode", default="", help="D's URL (nixl-pd)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    args = ap.parse_args(argv)
    engines = dict(e.split("=", 1) for e in args.engine)
    if args.policy == "nixl-pd" and not (args.prefill and args.decode):
        ap.error("nixl-pd needs --prefill and --decode")
    if args.policy != "nixl-pd" and not engines:
        ap.error(f"{args.policy} needs --engine ID=URL (repeatable)")
    if args.policy == "prefix" and not args.broker:
        ap.error("prefix needs --broker")
    web.run_app(
        build_app(Picker(engines, args.policy, args.broker), args.prefill, args.decode),
        host=args.host,
        port=args.port,
        print=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
