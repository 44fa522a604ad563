"""The proxy's aiohttp application: OpenAI endpoints, /health, /v1/models, /metrics (metrics.py).

/v1/completions and /v1/chat/completions go P then D (forward.py). Requests
one engine answers whole (/v1/responses, /tokenize, /detokenize) go to the
first live engine, with the same failover; /v1/models and /version are read
from one. Every error the proxy itself answers, unknown paths and wrong
methods included, is OpenAI-shaped JSON (errors.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvbroker.clients.proxy.admission import Admission, Admitted, Ticket
from kvbroker.clients.proxy.config import ProxyConfig
from kvbroker.clients.proxy.early_token import EarlyToken, continuation_body, eligible
from kvbroker.clients.proxy.engines import EnginePool
from kvbroker.clients.proxy.errors import json_errors
from kvbroker.clients.proxy.forward import Forwarder
from kvbroker.clients.proxy.metrics import OUTCOME_KEY, ProxyMetrics
from kvbroker.clients.proxy.outcome import EngineFailure, Outcome, RequestRejected, openai_error
from kvbroker.clients.proxy.placement_learner import PlacementLearner
from kvbroker.clients.proxy.retain import Retainer, retain_request
from kvbroker.clients.proxy.routing import Route, Router
from kvbroker.clients.proxy.tenants import ApiKeys, TenantRefused
from kvbroker.clients.proxy.tracing import get_tracer
from kvbroker.clients.proxy.validate import InvalidRequest, check_sampling
from kvbroker.common.placement import PlacementRule

log = logging.getLogger("kvbroker.proxy")

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# Answered whole by one engine: no P/D split, no prefix score.
WHOLE = ("/v1/responses", "/tokenize", "/detokenize")
# Of those, the ones whose prompt is cached under a tenant's cache_salt.
SALTED = ("/v1/responses",)
MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass
class ProxyState:
    config: ProxyConfig
    pool: EnginePool
    http: aiohttp.ClientSession
    router: Router
    forwarder: Forwarder
    broker: Any | None  # clients.aio.AsyncBrokerClient
    tracer: trace.Tracer
    api_keys: ApiKeys | None = None
    retainer: Retainer | None = None  # X-KV-Retain-Seconds (retain.py); None without a broker
    admission: Admission = field(default_factory=lambda: Admission(0))  # admission.py
    # One-token requests of early first tokens in flight at once (early_token.py); None: off.
    early_slots: asyncio.Semaphore | None = None
    refresh_task: asyncio.Task[None] | None = None


STATE_KEY: web.AppKey[ProxyState] = web.AppKey("proxy_state", ProxyState)


def chat_turn(body: dict[str, Any]) -> str:
    """A chat request's turn, for metrics: how many user messages it carries (1-4, then 5+)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    users = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "user")
    return "" if users == 0 else str(users) if users < 5 else "5+"


def _route_attributes(route: Route) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "kvbroker.scored": route.scored,
        "kvbroker.prompt_blocks": route.num_blocks,
        "kvbroker.prefill_candidates": [e.label for e in route.prefill],
        "kvbroker.decode_candidates": [e.label for e in route.decode],
    }
    if route.num_tokens is not None:
        attrs["kvbroker.prompt_tokens"] = route.num_tokens
    if route.note:
        attrs["kvbroker.score_note"] = route.note
    return attrs


async def _read_body(request: web.Request, salted: bool) -> dict[str, Any] | web.Response:
    """The request's JSON object, its tenant applied; or the error to answer."""
    state = request.app[STATE_KEY]
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        return openai_error(400, f"request body is not valid JSON: {e}", "invalid_request_error")
    except RecursionError:  # thousands of nested [ or {: Python's parser gives up, not a 500
        return openai_error(400, "request body nests too deeply to parse", "invalid_request_error")
    if not isinstance(body, dict):
        return openai_error(400, "request body must be a JSON object", "invalid_request_error")
    if state.api_keys is not None:
        try:
            if salted:
                state.api_keys.apply(request.headers.get("Authorization"), body)
            else:
                state.api_keys.tenant_of(request.headers.get("Authorization"))
        except TenantRefused as e:
            kind = "authentication_error" if e.status == 401 else "permission_error"
            return openai_error(e.status, e.message, "invalid_request_error" if e.status == 400 else kind)
    return body


async def _completion(request: web.Request, endpoint: str) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    body = await _read_body(request, salted=True)
    if isinstance(body, web.Response):
        return body
    try:
        check_sampling(body)  # before P prefills it (validate.py)
        retain = retain_request(request.headers)  # X-KV-Retain-Seconds (retain.py)
    except InvalidRequest as e:
        return openai_error(400, str(e), "invalid_request_error", param=e.param)
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    outcome = Outcome(request_id, turn=chat_turn(body) if endpoint == "/v1/chat/completions" else "")
    request[OUTCOME_KEY] = outcome  # for the metrics and the access log
    tracer = state.tracer
    with tracer.start_as_current_span(
        f"POST {endpoint}",
        context=extract(dict(request.headers)),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": "POST", "url.path": endpoint, "kvbroker.request_id": request_id},
    ) as span:
        early = None
        if state.early_slots is not None and eligible(endpoint, body):

            async def serve_one(one: dict[str, Any], its: Outcome) -> web.StreamResponse:
                return await _route_and_serve(request, state, endpoint, one, its, span, None)

            early = EarlyToken(request, body, outcome, serve_one, state.early_slots)
        if not await _admit(state, outcome, span, early):
            assert early is not None and early.done is not None
            return early.done  # the whole answer was its early first token: no place taken
        dispatched = time.perf_counter()
        try:
            if early is None or early.first is None:
                return await _route_and_serve(request, state, endpoint, body, outcome, span, retain)
            if early.client_gone():
                assert early.response is not None  # the first token went out on it
                return early.response
            body = continuation_body(body, early.first)
            answer = await _route_and_serve(request, state, endpoint, body, outcome, span, retain)
            return await early.finish(answer)
        finally:
            if outcome.first_byte_at is not None:
                state.admission.observed_ttft(outcome.first_byte_at - dispatched)
            tpot = outcome.tpot_s()
            if tpot is not None:
                state.admission.observed_tpot(tpot)
            state.admission.leave(outcome.admission)


async def _admit(state: ProxyState, outcome: Outcome, span: trace.Span, early: EarlyToken | None) -> bool:
    """Wait for a place when admission is on (admission.py); how long and why go on the span.
    False: no place was taken, the whole answer went out as an early first token."""
    admission = state.admission
    if admission.on:
        admission.set_engines(state.pool.serving_count())
    late_in = admission.late_in() if early is not None else None
    if early is None or late_in is None:
        admitted: Admitted | None = await admission.enter()  # at once when off
    else:
        admitted = await _enter_sending_early(admission, late_in, early)
        outcome.early = early.result
        if early.result:
            span.set_attribute("kvbroker.early_first_token", early.result)
    if admitted is None or not admission.on:
        return admitted is not None
    outcome.admission, outcome.admission_wait_s = admitted.order, admitted.waited_s
    span.set_attribute("kvbroker.admission", admitted.order)
    span.set_attribute("kvbroker.admission_wait_ms", round(admitted.waited_s * 1000.0, 1))
    return True


async def _enter_sending_early(admission: Admission, late_in: float, early: EarlyToken) -> Admitted | None:
    """Wait for a place; once the request can no longer meet the first-token goal, send its
    first token early (early_token.py). None: the whole answer went out then, no place taken."""
    ticket = Ticket()
    entering = asyncio.ensure_future(admission.enter(ticket))

    def abandon() -> None:
        if not entering.cancel() and not entering.cancelled() and entering.exception() is None:
            admission.leave(entering.result().order)  # it had its place already: give it back

    try:
        await asyncio.wait({entering}, timeout=late_in)
        if not entering.done():
            await early.while_waiting(entering)
            if early.done is not None:
                abandon()
                return None
            if early.first is not None:  # the rest now has a pace to keep (admission.py)
                admission.first_token_out(ticket, early.body["max_tokens"] - 1)
        return await entering
    except BaseException:
        abandon()
        raise


async def _route_and_serve(
    request: web.Request,
    state: ProxyState,
    endpoint: str,
    body: dict[str, Any],
    outcome: Outcome,
    span: trace.Span,
    retain: tuple[float, str] | None,
) -> web.StreamResponse:
    request_id = outcome.request_id
    tracer = state.tracer
    with tracer.start_as_current_span("proxy.route") as route_span:
        route = await state.router.route(endpoint, body, {"X-Request-Id": request_id})
        route_span.set_attributes(_route_attributes(route))
    try:
        response = await state.forwarder.serve(
            request,
            endpoint,
            body,
            route,
            outcome,
            state.config.disaggregate,
            state.config.local_prefill_tokens,
        )
    except RequestRejected as e:
        span.set_attribute("http.response.status_code", e.status)
        return web.Response(
            body=e.body,
            status=e.status,
            content_type=e.content_type,
            headers={"X-Request-Id": request_id},
        )
    span.set_attribute("http.response.status_code", response.status)
    if retain is not None and response.status < 400 and state.retainer is not None:
        engine = outcome.decode or outcome.prefill  # the engine that now holds the conversation
        state.retainer.after_turn(engine, route.namespace, route.hashes, *retain)
    span.set_attribute("kvbroker.mode", outcome.mode)
    if outcome.prefill is not None:
        span.set_attribute("kvbroker.prefill_engine", outcome.prefill.label)
    if outcome.decode is not None:
        span.set_attribute("kvbroker.decode_engine", outcome.decode.label)
    if outcome.fallback_reason:
        span.set_attribute("kvbroker.fallback_reason", outcome.fallback_reason)
    if outcome.route_reason:
        # Local on D or P then pull (p_queue.py), or a data-parallel placement (common/placement.py), and why.
        span.set_attribute("kvbroker.route_reason", outcome.route_reason)
        span.set_attribute("kvbroker.route_detail", outcome.route_detail)
    if response.status >= 500:
        span.set_status(Status(StatusCode.ERROR, "; ".join(outcome.failures)[:500]))
    return response


async def whole(request: web.Request) -> web.StreamResponse:
    """A request one engine answers whole; the first live engine, others on failure."""
    state = request.app[STATE_KEY]
    body = await _read_body(request, salted=request.path in SALTED)
    if isinstance(body, web.Response):
        return body
    outcome = Outcome(request.headers.get("X-Request-Id") or uuid.uuid4().hex)
    request[OUTCOME_KEY] = outcome
    with state.tracer.start_as_current_span(
        f"POST {request.path}",
        context=extract(dict(request.headers)),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": "POST", "url.path": request.path},
    ) as span:
        try:
            response = await state.forwarder.serve_whole(request, request.path, body, outcome)
        except RequestRejected as e:
            span.set_attribute("http.response.status_code", e.status)
            return web.Response(
                body=e.body, status=e.status, content_type=e.content_type, headers=outcome.headers()
            )
        span.set_attribute("http.response.status_code", response.status)
        return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, CHAT_COMPLETIONS)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    engines = state.pool.engines
    reasons = {e.url: state.pool.unhealthy_reason(e) for e in engines}
    usable = [e for e in engines if not reasons[e.url]]
    status = 200 if usable else 503
    return web.json_response(
        {
            "status": "ok" if usable else "no usable engine",
            "engines": [
                {
                    "url": e.url,
                    "role": e.role,
                    "engine_id": e.engine_id,
                    "healthy": not reasons[e.url],
                    "reason": reasons[e.url] or None,
                    "broker_session": None
                    if not state.pool.broker_seen or not e.engine_id
                    else not state.pool.session_gone(e),
                    "cooling_down": state.pool.is_cooling_down(e),
                    # Requests on it: this proxy's in flight, or the load it heartbeats if larger.
                    "load": state.pool.busy_of(e),
                    # Prompt tokens this proxy's requests there have yet to compute (placement's backlog).
                    "backlog_tokens": state.pool.backlog_of(e),
                }
                for e in engines
            ],
            "broker": state.config.broker or None,
            "broker_seen": state.pool.broker_seen,
        },
        status=status,
    )


async def models(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    for engine in state.pool.candidates("decode") + state.pool.candidates("prefill"):
        try:
            async with state.http.get(
                f"{engine.url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                if resp.status == 200:
                    return web.Response(body=await resp.read(), content_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as e:
            log.debug("/v1/models on %s: %s", engine.label, e)
    return openai_error(503, "no engine answered /v1/models", "service_unavailable")


async def version(request: web.Request) -> web.Response:
    """The engines' vLLM version (from the first that answers) and the proxy's own."""
    state = request.app[STATE_KEY]
    out: dict[str, Any] = {"version": None, "kvbroker": version_of_kvbroker()}
    for engine in state.pool.candidates("decode") + state.pool.candidates("prefill"):
        try:
            async with state.http.get(
                f"{engine.url}/version", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                if resp.status == 200:
                    data = await resp.json()
                    if isinstance(data, dict):
                        out["version"] = data.get("version")
                        break
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.debug("/version on %s: %s", engine.label, e)
    return web.json_response(out)


def version_of_kvbroker() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvbroker")
    except metadata.PackageNotFoundError:
        return "unknown"


async def _on_startup(app: web.Application) -> None:
    state = app[STATE_KEY]
    if state.broker is not None:
        # First read before serving, so the first request can already be scored.
        await state.pool.refresh(state.broker)
        state.refresh_task = asyncio.create_task(
            state.pool.refresh_forever(state.broker, state.config.refresh_interval_s),
            name="proxy-engine-refresh",
        )


async def _on_cleanup(app: web.Application) -> None:
    state = app[STATE_KEY]
    if state.refresh_task is not None:
        state.refresh_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await state.refresh_task
    if state.retainer is not None:
        await state.retainer.close()
    await state.http.close()
    if state.broker is not None:
        await state.broker.close()


def placement_rule(config: ProxyConfig) -> PlacementLearner | None:
    """How one engine is picked without disaggregation (None: the longest prefix first)."""
    if config.placement == "prefix":
        return None
    rule = PlacementRule(
        busy_tokens=config.dp_busy_tokens,
        pull_token_cost=config.dp_pull_token_cost,
        pull_fixed_tokens=config.dp_pull_fixed_tokens,
        neighbour_cost=config.dp_neighbour_cost,
        min_prefix_tokens=config.dp_min_prefix_tokens,
        pull=config.dp_pull,
        round_robin=config.placement == "round_robin",
    )
    return PlacementLearner(rule, learn=config.placement_learn and config.placement == "load")


# How the proxy's aiohttp server runs (`python -m kvbroker.clients.proxy`, and anyone embedding
# build_app; aiohttp's TestServer ignores them and always cancels).
# handler_cancellation: a client that leaves cancels its request's handler, which closes the
# proxy's own request to the engine, so vLLM aborts it and frees its KV blocks, as it does for a
# client of its own; P's hold is declined (forward.py), the request counted 499 (metrics.py).
# aiohttp's default since 3.9 lets the handler run on: a non-streamed request was computed to
# its end for nobody, and a streamed one until its first write.
RUNNER_OPTIONS: dict[str, Any] = {"access_log": None, "handler_cancellation": True}


def build_app(
    config: ProxyConfig, *, broker: Any | None = None, tracer_provider: trace.TracerProvider | None = None
) -> web.Application:
    """The proxy application. Create it inside a running event loop.

    `broker`: an AsyncBrokerClient to use; by default one is made for
    `config.broker` (none when that is empty). `tracer_provider`: where spans
    go; default the global provider (see tracing.setup_tracing).
    """
    tracer = get_tracer(tracer_provider)
    if broker is None and config.broker:
        from kvbroker.clients.aio import AsyncBrokerClient

        broker = AsyncBrokerClient(config.broker, security=config.security)
    pool = EnginePool(config.engines, cooldown_s=config.cooldown_s)
    # Missed refreshes make the broker's list too old to vouch for an engine's liveness.
    pool.stale_after_s = max(3 * config.refresh_interval_s, 5.0)
    # Idle connections close before the engines close them (uvicorn: 5 s), so none is reused as the
    # engine closes it: aiohttp does not send a POST again on a connection that reset.
    http = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=config.engine_keepalive_s),
        json_serialize=json.dumps,
    )
    metrics = ProxyMetrics(access_log_on=config.access_log) if (config.metrics or config.access_log) else None
    if metrics is not None:
        metrics.pool = pool
    state = ProxyState(
        config=config,
        pool=pool,
        http=http,
        router=Router(
            pool,
            broker,
            http,
            tenant=config.tenant,
            score_timeout_s=config.score_timeout_s,
            require_exact=config.require_exact_index,
        ),
        forwarder=Forwarder(
            http,
            pool,
            max_attempts=config.max_attempts,
            connect_timeout_s=config.connect_timeout_s,
            prefill_timeout_s=config.prefill_timeout_s,
            read_timeout_s=config.read_timeout_s,
            tracer=tracer,
            broker=broker,
            first_byte_timeout_s=config.first_byte_timeout_s,
            probe_timeout_s=config.probe_timeout_s,
            on_failure=metrics.engine_failed if metrics is not None else None,
            on_retry=metrics.engine_retried if metrics is not None else None,
            placement=placement_rule(config),
            pull_as_placed=config.dp_pull_as_placed,
        ),
        broker=broker,
        tracer=tracer,
        api_keys=ApiKeys(config.api_keys_file) if config.api_keys_file else None,
        retainer=Retainer(broker) if broker is not None else None,
        admission=Admission(
            config.admit_per_engine,
            config.admit_ttft_goal_ms / 1000.0,
            config.admit_max_wait_s,
            config.admit_tpot_goal_ms / 1000.0,
        ),
        early_slots=(
            asyncio.Semaphore(max(1, len(config.engines)))
            if config.admit_early_token and config.admit_per_engine > 0 and config.admit_ttft_goal_ms > 0
            else None
        ),
    )
    middlewares = []
    if metrics is not None:
        middlewares.append(metrics.middleware)
    middlewares.append(json_errors)  # inside the metrics: a 404 is counted and logged as answered
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[STATE_KEY] = state
    if metrics is not None and config.metrics:
        app.router.add_get("/metrics", metrics.handle_metrics)
        if state.forwarder.placement is not None:
            metrics.placement_weights(state.forwarder.placement)
        metrics.admission_gauges(state.admission)
    app.router.add_post(COMPLETIONS, completions)
    app.router.add_post(CHAT_COMPLETIONS, chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    for path in WHOLE:
        app.router.add_post(path, whole)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    return app


__all__ = ["EngineFailure", "ProxyState", "build_app"]
