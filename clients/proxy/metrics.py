"""The proxy's /metrics and access log: one aiohttp middleware sees every request.

For each request the middleware records, once it is answered (a streamed
answer: once the stream ended):

- ``kvbroker_proxy_requests_total{path, status, mode}`` and
  ``kvbroker_proxy_request_seconds{path}``; ``mode`` is ``pd`` (P then D),
  ``local`` (D alone: it held all but ``--local-prefill-tokens`` of the prompt),
  ``dp`` (one engine of a data-parallel fleet, ``--no-disaggregate``, placed by load and prefix),
  ``single`` (one engine, a fallback) or empty for
  requests that reach no engine (/health, /metrics, a refused body);
- ``kvbroker_proxy_ttft_seconds{turn}``: a chat answer's time to its first byte at the
  proxy, by turn (the request's user messages, 1 to 4, then ``5+``);
- ``kvbroker_proxy_fallbacks_total{reason}``: P/D requests served by one engine;
- ``kvbroker_proxy_route_choices_total{reason}``: local on D or P then pull, and why
  (``local_few_tokens``, ``local_p_busy``, ``pd_p_idle``, ``pd_p_quicker``, ...; p_queue.py);
  on a data-parallel fleet, why the engine was placed first (``dp_holder``,
  ``dp_pull_busy_holder``, ``dp_balance_short_prefix``, ...; common/placement.py);
- ``kvbroker_proxy_engine_failures_total{engine, step, kind}``: a step (prefill,
  decode, single, stream) that failed on an engine; ``kind`` is ``hung`` (no first
  byte within the budget, liveness check failed: a timeout), ``unreachable`` or
  ``error`` (5xx);
- ``kvbroker_proxy_engine_retries_total{engine, step}``: steps that failed on
  that engine and were then tried on another one;
- ``kvbroker_proxy_engine_healthy{engine, role, url}``: 1 when the engine is
  routed to normally, 0 while its broker session is gone or it is cooling down
  after a failure (read at scrape time; /health says why);
- ``kvbroker_proxy_admission_wait_seconds{order}`` (admission on, ``--admit-per-engine``): how
  long a request waited at the proxy for a place, and which rule let it go (admission.py);
  ``kvbroker_proxy_requests_running`` and ``kvbroker_proxy_requests_waiting``: now;
  ``kvbroker_proxy_admission_limit`` (how many may run at once now) and
  ``kvbroker_proxy_admission_pace_seconds`` (the answers' pace it follows);
  ``kvbroker_proxy_early_first_tokens_total{result}``: requests that could no longer meet the
  first-token goal while waiting and got their first token early (``sent``; ``answered``: that
  was the whole answer; ``failed``: the one-token request failed, the request went whole;
  early_token.py);
- one access-log line (logger ``kvbroker.proxy.access``, INFO): method, path,
  status, duration, mode, the prefill and decode engines, the request id,
  why P/D fell back to one engine, if it did, and a data-parallel placement's reason.

/metrics also carries the process collector (CPU, memory, file descriptors)
and ``kvbroker_proxy_build_info``. The registry is the proxy's own, so several
proxies in one process (tests) do not collide.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections.abc import Awaitable, Callable
from importlib import metadata

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from kvbroker.clients.proxy.admission import Admission
from kvbroker.clients.proxy.config import EngineSpec
from kvbroker.clients.proxy.engines import EnginePool
from kvbroker.clients.proxy.outcome import Outcome
from kvbroker.clients.proxy.placement_learner import PlacementLearner

access_log = logging.getLogger("kvbroker.proxy.access")

OUTCOME_KEY: web.RequestKey[Outcome] = web.RequestKey("kvbroker_outcome", Outcome)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Paths outside these are counted under one label, so that scanners cannot grow the series.
KNOWN_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/version",
        "/health",
        "/metrics",
    }
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProxyMetrics:
    def __init__(self, *, access_log_on: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.access_log_on = access_log_on
        self.requests = Counter(
            "kvbroker_proxy_requests",
            "Requests answered, by path, HTTP status and mode (pd, local, dp, single, or empty)",
            ["path", "status", "mode"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "kvbroker_proxy_request_seconds",
            "From a request's arrival to the end of its answer (streams included), by path",
            ["path"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvbroker_proxy_ttft_seconds",
            "Chat completions answered 200: from arrival to the answer's first byte (a stream's first "
            "chunk), by turn (the request's user messages: 1, 2, 3, 4, 5+)",
            ["turn"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "kvbroker_proxy_fallbacks",
            "Requests that P/D could not serve and one engine served whole, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.route_choices = Counter(
            "kvbroker_proxy_route_choices",
            "Requests by the proxy's routing choice and why: local on D or P then pull (p_queue.py), or the "
            "engine a data-parallel placement put first (dp_*, common/placement.py)",
            ["reason"],
            registry=self.registry,
        )
        self.early_first_tokens = Counter(
            "kvbroker_proxy_early_first_tokens",
            "Waiting requests that could no longer meet the first-token goal and were sent their first "
            "token early, by result (sent, answered, failed; early_token.py)",
            ["result"],
            registry=self.registry,
        )
        self.engine_failures = Counter(
            "kvbroker_proxy_engine_failures",
            "Steps that failed on an engine, by engine, step (prefill, decode, single, stream) and kind "
            "(hung: no first byte within the budget and not live; unreachable; error: 5xx)",
            ["engine", "step", "kind"],
            registry=self.registry,
        )
        self.engine_retries = Counter(
            "kvbroker_proxy_engine_retries",
            "Steps that failed on this engine and were tried on another one, by engine and step",
            ["engine", "step"],
            registry=self.registry,
        )
        self.engine_healthy = Gauge(
            "kvbroker_proxy_engine_healthy",
            "1 when the engine is routed to normally; 0 while its broker session is gone or it cools "
            "down after a failure (see /health for why)",
            ["engine", "role", "url"],
            registry=self.registry,
        )
        self.admission_wait = Histogram(
            "kvbroker_proxy_admission_wait_seconds",
            "With admission on (--admit-per-engine): how long a request waited at the proxy for a place, "
            "by order (at_once, in_time: it could still meet the first-token goal, rest_in_time: its first "
            "token went out early and the rest could still keep the pace, late: every waiting request was "
            "past it, overdue: it had waited --admit-max-wait-s, drain: past the limit, no one could meet "
            "a goal, first_come: no goal set)",
            ["order"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.pool: EnginePool | None = None
        ProcessCollector(registry=self.registry)
        try:
            version = metadata.version("kvbroker")
        except metadata.PackageNotFoundError:
            version = "unknown"
        info = Gauge(
            "kvbroker_proxy_build_info",
            "The proxy's version and Python (always 1)",
            ["version", "python"],
            registry=self.registry,
        )
        info.labels(version, platform.python_version()).set(1)

    def placement_weights(self, learner: PlacementLearner) -> None:
        """Gauges of the weights the data-parallel placement uses now (learned or as set)."""
        weight = Gauge(
            "kvbroker_proxy_placement_weight",
            "The data-parallel placement's weights in use: busy_tokens, pull_token_cost and "
            "pull_fixed_tokens, fitted to first-token times (the default), or as set with "
            "--no-placement-learn (placement_learner.py)",
            ["weight"],
            registry=self.registry,
        )
        weight.labels("busy_tokens").set_function(lambda: learner.rule().busy_tokens)
        weight.labels("pull_token_cost").set_function(lambda: learner.rule().pull_token_cost)
        weight.labels("pull_fixed_tokens").set_function(lambda: learner.rule().pull_fixed_tokens)
        samples = Gauge(
            "kvbroker_proxy_placement_samples",
            "Streamed answers the placement's fit has learned from",
            registry=self.registry,
        )
        samples.set_function(lambda: learner.samples)

    def admission_gauges(self, admission: Admission) -> None:
        """Gauges of the requests admission runs and holds now (admission.py)."""
        for name, what, read in (
            ("requests_running", "Requests the proxy runs on engines now", lambda: admission.running),
            (
                "requests_waiting",
                "Requests waiting at the proxy for a place (admission)",
                lambda: admission.waiting,
            ),
            (
                "admission_limit",
                "Requests admission lets run at once now (0: admission off)",
                lambda: admission.limit if admission.on else 0,
            ),
            (
                "admission_pace_seconds",
                "Moving average of streamed answers' time per token that admission follows (0: not measured)",
                lambda: admission.pace_s,
            ),
        ):
            gauge = Gauge(f"kvbroker_proxy_{name}", what, registry=self.registry)
            gauge.set_function(read)

    def engine_failed(self, engine: EngineSpec, step: str, kind: str) -> None:
        self.engine_failures.labels(engine.label, step, kind).inc()

    def engine_retried(self, engine: EngineSpec, step: str) -> None:
        self.engine_retries.labels(engine.label, step).inc()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client left and the server cancelled the handler (nginx's code)
            raise
        finally:
            self._record(request, status, started)

    def _record(self, request: web.Request, status: int, started: float) -> None:
        seconds = time.perf_counter() - started
        path = request.path if request.path in KNOWN_PATHS else "other"
        outcome = request.get(OUTCOME_KEY)
        mode = outcome.mode if outcome is not None else ""
        self.requests.labels(path, str(status), mode).inc()
        self.seconds.labels(path).observe(seconds)
        if outcome is not None and outcome.turn and outcome.first_byte_at is not None and status == 200:
            self.ttft.labels(outcome.turn).observe(max(0.0, outcome.first_byte_at - started))
        if outcome is not None and outcome.admission:
            self.admission_wait.labels(outcome.admission).observe(outcome.admission_wait_s)
        if outcome is not None and outcome.early:
            self.early_first_tokens.labels(outcome.early).inc()
        if outcome is not None and outcome.route_reason:
            self.route_choices.labels(outcome.route_reason).inc()
        if outcome is not None and outcome.fallback_reason:
            self.fallbacks.labels(_reason_label(outcome.fallback_reason)).inc()
        if self.access_log_on:
            access_log.info(
                "%s %s %d %.1fms mode=%s prefill=%s decode=%s id=%s%s%s",
                request.method,
                request.path,
                status,
                seconds * 1000.0,
                mode or "-",
                outcome.prefill.label if outcome is not None and outcome.prefill else "-",
                outcome.decode.label if outcome is not None and outcome.decode else "-",
                outcome.request_id if outcome is not None else request.headers.get("X-Request-Id", "-"),
                f" fallback={outcome.fallback_reason!r}"
                if outcome is not None and outcome.fallback_reason
                else "",
                f" route={outcome.route_reason}" if outcome is not None and outcome.mode == "dp" else "",
            )

    async def handle_metrics(self, request: web.Request) -> web.Response:
        if self.pool is not None:
            self.engine_healthy.clear()
            for e in self.pool.engines:
                healthy = not self.pool.unhealthy_reason(e)
                self.engine_healthy.labels(e.label, e.role, e.url).set(1 if healthy else 0)
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _reason_label(reason: str) -> str:
    """A fallback reason without its per-request details (engine names, messages)."""
    return reason.split(":", 1)[0].strip()[:60] or "unknown"
