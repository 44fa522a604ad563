"""Sending one request to the engines: prefill on P, decode on D, fall back to one engine.

The P/D protocol routers already speak with vLLM:

1. P gets the request with `max_tokens=1`, not streamed, and
   `kv_transfer_params = {"do_remote_decode": true}`; its adapter holds the
   prompt's blocks under a broker lease and answers with `kv_transfer_params`
   that name it as the holder.
2. D gets the original request with those `kv_transfer_params`; its adapter
   pulls the blocks (through the broker, over NIXL) instead of prefilling, and
   D's answer goes to the client.

Failures: an engine that cannot be reached, times out, answers 5xx or stays
silent past the first-byte budget and then fails a liveness check (liveness.py)
is marked failed and the next candidate is tried; if no P/D pair works, one engine
serves the whole request without kv_transfer_params (P recomputes nothing it
already has: its prefix cache still holds the prompt). A 4xx answer is the
request's fault and goes back to the client unchanged. Once D has started
streaming, a failure can no longer be hidden: the stream ends with an error event.
Whenever no D will read P's hold (D rejected the request, no D answered, the
client left), the proxy declines the hold, so P frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from kvbroker.clients.proxy.config import EngineSpec
from kvbroker.clients.proxy.declines import HoldDeclines
from kvbroker.clients.proxy.engines import EnginePool
from kvbroker.clients.proxy.liveness import EngineHung, FirstByteWatch
from kvbroker.clients.proxy.outcome import (
    HUNG,
    UNREACHABLE,
    EngineFailure,
    FailureHook,
    Outcome,
    RequestRejected,
    RetryHook,
    error_object,
    openai_error,
)
from kvbroker.clients.proxy.p_queue import PrefillQueues
from kvbroker.clients.proxy.pd_bodies import decode_body, prefill_body
from kvbroker.clients.proxy.placement_learner import PlacementLearner
from kvbroker.clients.proxy.routing import Route, dp_order, placed_backlog, pull_params
from kvbroker.clients.proxy.tracing import current_context_carrier, get_tracer

log = logging.getLogger("kvbroker.proxy")


class Forwarder:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        pool: EnginePool,
        *,
        max_attempts: int = 2,
        connect_timeout_s: float = 5.0,
        prefill_timeout_s: float = 300.0,
        read_timeout_s: float = 300.0,
        tracer: Tracer | None = None,
        broker: Any | None = None,
        first_byte_timeout_s: float = 5.0,
        probe_timeout_s: float = 2.0,
        on_failure: FailureHook | None = None,
        on_retry: RetryHook | None = None,
        placement: PlacementLearner | None = None,
        pull_as_placed: bool = True,
    ) -> None:
        # Without disaggregation: how one engine is picked (common/placement.py); None: the prefix order.
        self.placement = placement
        # A request placed to pull asks its engine to pull (routing.pull_params).
        self.pull_as_placed = pull_as_placed
        self._rotation = 0
        self.tracer = tracer or get_tracer()
        self.http = http
        self.pool = pool
        self.watch = FirstByteWatch(
            http, pool, budget_s=first_byte_timeout_s, probe_timeout_s=probe_timeout_s
        )
        self.on_failure = on_failure
        self.on_retry = on_retry
        # clients.aio.AsyncBrokerClient: to decline P's hold when no D will read it.
        self.broker = broker
        self.declines = HoldDeclines(broker)
        # P's prefill queues as this proxy sees them, and P's prefill timing (p_queue.py).
        self.queues = PrefillQueues()
        self.max_attempts = max_attempts
        self._prefill_timeout = aiohttp.ClientTimeout(total=prefill_timeout_s, sock_connect=connect_timeout_s)
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )

    async def serve(
        self,
        request: web.Request,
        endpoint: str,
        body: dict[str, Any],
        route: Route,
        outcome: Outcome,
        disaggregate: bool,
        local_prefill_tokens: int = 0,
    ) -> web.StreamResponse:
        headers = self._engine_headers(request, outcome.request_id)
        p_list, d_list = route.prefill, route.decode
        tried: list[EngineSpec] = []
        local = (
            self._choose_local(route, p_list, d_list, local_prefill_tokens, outcome)
            if disaggregate
            else False
        )
        if local:
            # D holds the conversation but for a few tokens: it computes them itself, no P hop.
            self._attempt(outcome)
            try:
                return await self._decode(request, d_list[0], endpoint, body, None, headers, outcome, "local")
            except EngineFailure as e:
                self._failed(e, outcome, tried)
                d_list = d_list[1:]
        if disaggregate and p_list and d_list:
            try:
                params, p = await self._prefill_any(
                    endpoint, body, headers, p_list, outcome, tried, d_list[0].engine_id, route
                )
            except RequestRejected as e:
                raise e.as_client_sent(prefill_body(body, {}, d_list[0].engine_id), body) from None
            if p is not None:
                outcome.prefill = p
                try:
                    for d in d_list[: self.max_attempts]:
                        self._attempt(outcome)
                        try:
                            return await self._decode(
                                request, d, endpoint, body, params, headers, outcome, "pd"
                            )
                        except EngineFailure as e:
                            self._failed(e, outcome, tried)
                except RequestRejected as e:
                    log.warning(
                        "request %s: decode engine rejected it (HTTP %d): %s",
                        outcome.request_id,
                        e.status,
                        e.body[:300].decode(errors="replace"),
                    )
                    self.declines.decline(params, f"the decode engine rejected the request (HTTP {e.status})")
                    raise e.as_client_sent(decode_body(body, params, {}), body) from None
                except asyncio.CancelledError:
                    self.declines.decline(params, "the client went away before decode")
                    raise
                self.declines.decline(params, "no decode engine answered")
                outcome.fallback_reason = "no decode engine answered"
                single = [p, *d_list, *p_list]
            else:
                outcome.fallback_reason = "no prefill engine answered"
                single = [*d_list, *p_list]
        elif not disaggregate and self.placement is not None:
            # A data-parallel fleet: every engine serves whole requests; the placement weighs
            # each one's load against the prefix it holds (and a pull of it from the holder).
            self._rotation += 1
            engines = _single_order([*d_list, *p_list], [])
            rule = self.placement.rule()
            order, placed = dp_order(route, engines, self.pool, rule, self._rotation)
            if placed is not None:  # why: on the span, in the metrics, in a response header
                outcome.route_reason, outcome.route_detail = placed.reason, placed.detail
                outcome.prefill_tokens = placed_backlog(order, placed)
            first = pull_params(placed, rule) if self.pull_as_placed else None
            sent = time.perf_counter()
            answer = await self._serve_single(request, endpoint, body, order, outcome, tried, "dp", first)
            ttft = outcome.first_byte_at - sent if outcome.first_byte_at is not None else None
            self.placement.served(placed, outcome.decode is order[0], bool(body.get("stream")), ttft)
            return answer
        else:
            if not disaggregate:
                outcome.fallback_reason = "disaggregation off"
            elif not p_list:
                outcome.fallback_reason = "no prefill engine"
            else:
                outcome.fallback_reason = "no decode engine"
            single = [*d_list, *p_list]
        # An engine that hung on this request will not answer a moment later: not tried again.
        hung = {f.url for f, kind in zip(tried, outcome.failure_kinds, strict=False) if kind == HUNG}
        order = [e for e in _single_order(single, tried) if e.url not in hung]
        return await self._serve_single(request, endpoint, body, order, outcome, tried)

    def _choose_local(
        self,
        route: Route,
        p_list: list[EngineSpec],
        d_list: list[EngineSpec],
        local_prefill_tokens: int,
        outcome: Outcome,
    ) -> bool:
        """D alone, or P then D: weighs P's queue (p_queue.py); the reason goes on the outcome."""
        if not d_list:
            return False
        if not p_list:
            return route.local_prefill(d_list[0], local_prefill_tokens) is not None
        d, p = d_list[0], p_list[0]
        choice = self.queues.choose(
            p_engine_id=p.engine_id,
            p_load=self.pool.load_of(p),
            num_tokens=route.num_tokens,
            held_on_d=route.held_tokens(d),
            held_on_p=route.held_tokens(p),
            local_limit=local_prefill_tokens,
            d_load=self.pool.load_of(d),
        )
        outcome.route_reason, outcome.route_detail = choice.reason, choice.detail
        return choice.local

    async def serve_whole(
        self, request: web.Request, endpoint: str, body: dict[str, Any], outcome: Outcome
    ) -> web.StreamResponse:
        """A request that one engine answers whole (/v1/responses, /tokenize, ...): no P/D, no score."""
        engines = _single_order(self.pool.candidates("decode") + self.pool.candidates("prefill"), [])
        return await self._serve_single(request, endpoint, body, engines, outcome, [])

    async def _serve_single(
        self,
        request: web.Request,
        endpoint: str,
        body: dict[str, Any],
        engines: list[EngineSpec],
        outcome: Outcome,
        tried: list[EngineSpec],
        mode: str = "single",
        first_params: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        """`first_params`: kv_transfer_params for the first engine only (a placed pull's)."""
        headers = self._engine_headers(request, outcome.request_id)
        for k, engine in enumerate(engines):
            self._attempt(outcome)
            params = first_params if k == 0 else None
            try:
                return await self._decode(request, engine, endpoint, body, params, headers, outcome, mode)
            except EngineFailure as e:
                self._failed(e, outcome, tried)
        outcome.mode = "none"
        if not outcome.failures:
            return openai_error(
                503, "no engine could serve the request: no engines known", "service_unavailable"
            )
        detail = "; ".join(outcome.failures)
        if all(kind == HUNG for kind in outcome.failure_kinds):
            return openai_error(
                504, f"no engine answered in time (every engine tried is hung): {detail}", "timeout"
            )
        return openai_error(503, f"no engine could serve the request: {detail}", "service_unavailable")

    def _failed(self, e: EngineFailure, outcome: Outcome, tried: list[EngineSpec], step: str = "") -> None:
        log.warning("request %s: %s", outcome.request_id, e)
        outcome.failures.append(str(e))
        outcome.failure_kinds.append(e.kind)
        tried.append(e.engine)
        self.pool.mark_failed(e.engine, f"{e.kind}: {e.reason}"[:300])
        step = step or ("decode" if outcome.prefill is not None else "single")
        outcome.unretried = (e.engine, step)
        if self.on_failure is not None:
            self.on_failure(e.engine, step, e.kind)

    def _attempt(self, outcome: Outcome) -> None:
        """Another engine is being tried: the last failure, if any, is being retried."""
        if outcome.unretried is not None and self.on_retry is not None:
            self.on_retry(*outcome.unretried)
        outcome.unretried = None

    @staticmethod
    def _engine_headers(request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        return headers

    async def _prefill_any(
        self,
        endpoint: str,
        body: dict[str, Any],
        headers: dict[str, str],
        candidates: list[EngineSpec],
        outcome: Outcome,
        tried: list[EngineSpec],
        reader_engine_id: str,
        route: Route | None = None,
    ) -> tuple[dict[str, Any] | None, EngineSpec | None]:
        for p in candidates[: self.max_attempts]:
            self._attempt(outcome)
            held = route.held_tokens(p) if route is not None else 0
            total = route.num_tokens if route is not None and route.num_tokens is not None else held
            self.queues.started(p.engine_id, outcome.request_id, total - held, held)
            try:
                params = await self._prefill(p, endpoint, body, headers, reader_engine_id)
                self.queues.learn(p.engine_id, params)
                return params, p
            except EngineFailure as e:
                self._failed(e, outcome, tried, "prefill")
            finally:
                self.queues.finished(p.engine_id, outcome.request_id)
        return None, None

    async def _prefill(
        self,
        engine: EngineSpec,
        endpoint: str,
        body: dict[str, Any],
        headers: dict[str, str],
        reader_engine_id: str,
    ) -> dict[str, Any] | None:
        with self.tracer.start_as_current_span(
            "proxy.prefill",
            kind=SpanKind.CLIENT,
            attributes={"kvbroker.engine": engine.label, "server.address": engine.url},
        ) as span:
            carrier = current_context_carrier()
            payload = prefill_body(body, carrier, reader_engine_id)
            try:
                async with (
                    self.watch.guard(engine),
                    self.http.post(
                        f"{engine.url}{endpoint}",
                        json=payload,
                        headers={**headers, **carrier},
                        timeout=self._prefill_timeout,
                    ) as resp,
                ):
                    raw = await resp.read()
                span.set_attribute("http.response.status_code", resp.status)
                await _raise_for_status(engine, resp, raw)
            except EngineHung as e:
                span.set_status(Status(StatusCode.ERROR, str(e)))
                raise EngineFailure(engine, f"prefill abandoned: {e}", HUNG) from None
            except (aiohttp.ClientError, TimeoutError) as e:
                span.set_status(Status(StatusCode.ERROR, str(e) or type(e).__name__))
                raise EngineFailure(engine, f"prefill failed: {type(e).__name__}: {e}", UNREACHABLE) from None
            except EngineFailure as e:
                span.set_status(Status(StatusCode.ERROR, e.reason))
                raise
            try:
                data = json.loads(raw)
            except ValueError:
                raise EngineFailure(engine, "prefill answer is not JSON") from None
            self.pool.mark_ok(engine)
            params = data.get("kv_transfer_params") if isinstance(data, dict) else None
            span.set_attribute("kvbroker.kv_transfer_params", bool(params))
            return params if isinstance(params, dict) else None

    async def _decode(
        self,
        request: web.Request,
        engine: EngineSpec,
        endpoint: str,
        body: dict[str, Any],
        params: dict[str, Any] | None,
        headers: dict[str, str],
        outcome: Outcome,
        mode: str,
    ) -> web.StreamResponse:
        """Send the request to `engine` and relay its answer; EngineFailure before anything was relayed."""
        attributes = {"kvbroker.engine": engine.label, "server.address": engine.url, "kvbroker.mode": mode}
        with (
            # In flight (and its prompt as backlog until the first byte), for the placement.
            self.pool.serving(engine, outcome.prefill_tokens.get(engine.url, 0.0)) as outcome.serving,
            self.tracer.start_as_current_span(
                "proxy.decode" if mode == "pd" else "proxy.single",
                kind=SpanKind.CLIENT,
                attributes=attributes,
            ) as span,
        ):
            carrier = current_context_carrier()
            payload = decode_body(body, params, carrier)
            try:
                async with self.watch.guard(engine):
                    resp = await self.http.post(
                        f"{engine.url}{endpoint}",
                        json=payload,
                        headers={**headers, **carrier},
                        timeout=self._decode_timeout,
                    )
            except EngineHung as e:
                span.set_status(Status(StatusCode.ERROR, str(e)))
                raise EngineFailure(engine, f"{mode} request abandoned: {e}", HUNG) from None
            except (aiohttp.ClientError, TimeoutError) as e:
                span.set_status(Status(StatusCode.ERROR, str(e) or type(e).__name__))
                raise EngineFailure(
                    engine, f"{mode} request failed: {type(e).__name__}: {e}", UNREACHABLE
                ) from None
            try:
                span.set_attribute("http.response.status_code", resp.status)
                outcome.mode, outcome.decode = mode, engine
                if not body.get("stream"):
                    try:
                        async with self.watch.guard(engine):
                            raw = await resp.read()
                    except EngineHung as e:
                        raise EngineFailure(engine, f"{mode} answer abandoned: {e}", HUNG) from None
                    except (aiohttp.ClientError, TimeoutError) as e:
                        raise EngineFailure(
                            engine, f"{mode} answer cut off: {type(e).__name__}: {e}", UNREACHABLE
                        ) from None
                    await _raise_for_status(engine, resp, raw)
                    self.pool.mark_ok(engine)
                    outcome.first_byte()  # the whole answer is its first byte
                    return web.Response(
                        body=raw,
                        status=resp.status,
                        content_type="application/json",
                        headers=outcome.headers(),
                    )
                if resp.status != 200:
                    await _raise_for_status(engine, resp, await resp.read())
                return await self._relay_stream(request, engine, resp, outcome, span)
            except EngineFailure as e:
                outcome.mode, outcome.decode = "", None
                span.set_status(Status(StatusCode.ERROR, e.reason))
                raise
            finally:
                resp.release()

    async def _relay_stream(
        self,
        request: web.Request,
        engine: EngineSpec,
        resp: aiohttp.ClientResponse,
        outcome: Outcome,
        span: Any,
    ) -> web.StreamResponse:
        # After an early first token (early_token.py) the rest goes out on the stream it began.
        out, splice = outcome.early_response, outcome.splice
        if out is None:
            out = web.StreamResponse(status=200, headers=outcome.headers())
            out.content_type = resp.content_type or "text/event-stream"
            out.charset = resp.charset or "utf-8"  # server-sent events are UTF-8; say so
        first = True
        try:
            async with self.watch.guard(engine) as progress:
                async for chunk in resp.content.iter_any():
                    progress.tick()
                    try:
                        if first:
                            # Headers go out with the first byte: until then a retry is still invisible.
                            if not out.prepared:
                                await out.prepare(request)
                            first = False
                            outcome.first_byte()
                        data = chunk if splice is None else splice.feed(chunk)
                        if data:
                            await out.write(data)
                        outcome.streamed(chunk)
                    except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
                        # The client left: not the engine's fault. Closing our side aborts its request.
                        log.info(
                            "request %s: the client left during %s's stream", outcome.request_id, engine.label
                        )
                        resp.close()
                        return out
        except (aiohttp.ClientError, TimeoutError, asyncio.IncompleteReadError, EngineHung) as e:
            kind = HUNG if isinstance(e, EngineHung) else UNREACHABLE
            why = str(e) if isinstance(e, EngineHung) else f"{type(e).__name__}: {e}"
            if first:
                raise EngineFailure(engine, f"stream failed before the first byte: {why}", kind) from None
            log.warning("request %s: %s failed mid-stream: %s", outcome.request_id, engine.label, why)
            self.pool.mark_failed(engine, f"{kind}: failed mid-stream: {why}"[:300])
            if self.on_failure is not None:
                self.on_failure(engine, "stream", kind)
            span.set_status(Status(StatusCode.ERROR, f"engine failed mid-stream: {why}"))
            error = error_object(
                504 if kind == HUNG else 502,
                f"engine {engine.label} failed mid-stream: {why}",
                "engine_failure",
            )
            await out.write(f"data: {json.dumps(error)}\n\n".encode())
            await out.write_eof()
            return out
        if first:
            raise EngineFailure(engine, "stream ended without a byte")
        self.pool.mark_ok(engine)
        with contextlib.suppress(ConnectionResetError):  # the client left after the last byte
            if splice is not None and (rest := splice.flush()):
                await out.write(rest)
            await out.write_eof()
        return out


async def _raise_for_status(engine: EngineSpec, resp: aiohttp.ClientResponse, raw: bytes) -> None:
    if resp.status < 400:
        return
    if resp.status < 500:
        raise RequestRejected(resp.status, raw, resp.content_type or "application/json")
    text = raw[:300].decode(errors="replace")
    raise EngineFailure(engine, f"HTTP {resp.status}: {text}")


def _single_order(engines: list[EngineSpec], tried: list[EngineSpec]) -> list[EngineSpec]:
    """Distinct engines, those that did not just fail first."""
    seen: list[EngineSpec] = []
    for e in engines:
        if all(e.url != s.url for s in seen):
            seen.append(e)
    failed_urls = {t.url for t in tried}
    return [e for e in seen if e.url not in failed_urls] + [e for e in seen if e.url in failed_urls]
