"""Running the broker: `start_server` (in-process, for tests) and `serve_main` (the command).

`python -m kvbroker.broker` and `kvbroker serve` both land in `serve_main`. Every
flag has an environment variable (KVBROKER_<NAME>); see broker/config.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from kvbroker.broker.channels import SessionNotifier, StreamNotifier
from kvbroker.broker.clock import Clock, MonotonicClock, WallClock
from kvbroker.broker.config import ENV_PREFIX, BrokerConfig
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import InvalidArgument, Unavailable
from kvbroker.broker.health_service import HealthService
from kvbroker.broker.indexer.feed_metrics import KvEventsCollector
from kvbroker.broker.indexer.http import IndexerHttp
from kvbroker.broker.indexer.kv_events import KvEventsFeed, parse_sources
from kvbroker.broker.metrics import MetricsInterceptor, SessionStreamMetrics, start_metrics_http
from kvbroker.broker.security.auth import AuthInterceptor
from kvbroker.broker.security.config import SecurityConfig, is_loopback, require_safe_listener
from kvbroker.broker.security.credentials import CertificateFiles, server_credentials
from kvbroker.broker.security.decode_guard import DecodeGuardInterceptor
from kvbroker.broker.security.engine_identity import EngineIdentity
from kvbroker.broker.security.http_gate import IndexerGate
from kvbroker.broker.security.identity import Authenticator, TokenTable
from kvbroker.broker.security.metrics_http import TokensCollector, serve_metrics
from kvbroker.broker.security.quotas import Quotas
from kvbroker.broker.security.tenancy import TenantGuard
from kvbroker.broker.servicer import BrokerServicer
from kvbroker.broker.tracing import TracingInterceptor, make_tracer_provider
from kvbroker.common import keepalive, settings
from kvbroker.common.causes import Cause
from kvbroker.common.open_files import raise_open_files_limit
from kvbroker.common.telemetry import TelemetryError
from kvbroker.common.version import version
from kvbroker.v1 import broker_pb2, broker_pb2_grpc

if TYPE_CHECKING:
    from kvbroker.broker.fleet.conn import RedisState
    from kvbroker.broker.fleet.replica import Replica

log = logging.getLogger("kvbroker")

SERVICE_NAME = broker_pb2.DESCRIPTOR.services_by_name["KVBroker"].full_name


@dataclass
class RunningServer:
    server: grpc.aio.Server
    core: BrokerCore
    servicer: BrokerServicer
    notifier: SessionNotifier
    health: health.aio.HealthServicer
    port: int
    address: str
    metrics_port: int = 0
    indexer_port: int = 0  # the KV-indexer HTTP API's port (0: off)
    feeds: dict[str, KvEventsFeed] = field(default_factory=dict)  # engines followed by KV events
    security: SecurityConfig = field(default_factory=SecurityConfig)
    certificates: CertificateFiles | None = None  # the TLS files it follows (None: plaintext)
    guard: TenantGuard | None = None  # identities' engines and tenants (None: no authentication)
    _expiry_task: asyncio.Task[None] | None = None
    _extras: list[Any] = field(default_factory=list)  # metrics http server, tracer provider
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)  # the fleet channel (shared state)
    _indexer: IndexerHttp | None = None

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting, close sessions (engines re-register elsewhere), finish in-flight calls.

        Leases are soft state: shutting down revokes nothing and tells no
        engine to free anything; a new broker learns it all again.
        """
        grace = self.core.config.shutdown_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        self.servicer.shutting_down = True
        self.notifier.close_all(
            "UNAVAILABLE", "broker is shutting down; reconnect and register again", Cause.SHUTTING_DOWN
        )
        self.core.mirrors.close_all("broker is shutting down; reconnect for a fresh snapshot")
        if self._indexer is not None:
            await self._indexer.stop()
        for feed in list(self.feeds.values()):
            await feed.stop()
        for task in [self._expiry_task, *self._tasks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.server.stop(grace)
        for extra in self._extras:
            extra.shutdown()


# A wake-up later than this past its time means the broker itself did not run.
STALL_S = 0.25


async def _expiry_loop(core: BrokerCore) -> None:
    interval = core.config.expiry_interval_ms / 1000
    warned = float("-inf")
    while True:
        before = core.clock.now()
        await asyncio.sleep(interval)
        stalled = core.clock.now() - before - interval
        if stalled > STALL_S:
            log.warning(
                "broker did not run for %.2f s (a starved or paused host): sessions get that time back",
                stalled,
            )
            core.forgive_stall(stalled)
        try:
            core.expire()
        except Unavailable as err:
            # The shared store is away: nothing can expire meanwhile; the pass after it is back does it.
            now = core.clock.now()
            if now - warned >= 5.0:
                log.warning("expiry pass skipped: %s", err.message)
                warned = now


def _public_address(address: str, port: int) -> str:
    host = address.rsplit(":", 1)[0]
    if host in ("", "[::]", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def _tokens(security: SecurityConfig) -> TokenTable | None:
    """The tokens file, read once for every surface (gRPC, the indexer API, /metrics)."""
    if not security.tokens_file:
        return None
    try:
        return TokenTable(security.tokens_file)
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"cannot use --tokens-file: {err}") from None


def _auth_interceptor(
    core: BrokerCore, security: SecurityConfig, engines: EngineIdentity, tokens: TokenTable | None
) -> AuthInterceptor | None:
    if not security.authenticates:
        return None
    slots = {"Mirror": core.config.max_mirrors, "Watch": core.config.max_watchers}
    quotas = Quotas(security, stream_slots=slots)
    return AuthInterceptor(Authenticator(tokens, security.mutual), TenantGuard(core, quotas, engines), quotas)


def _listen(
    server: grpc.aio.Server, address: str, security: SecurityConfig
) -> tuple[int, CertificateFiles | None]:
    if not security.tls:
        if security.insecure and not is_loopback(address):
            log.warning(
                "serving PLAINTEXT without credentials on %s (--insecure): anyone who reaches it can "
                "read every engine's NIXL metadata and act for any engine",
                address,
            )
        return server.add_insecure_port(address), None
    if not security.authenticates and not is_loopback(address):
        log.warning(
            "serving TLS without client identities on %s (--insecure): any client that reaches it may "
            "act for any engine; add --tls-ca (mutual TLS) or --tokens-file",
            address,
        )
    try:
        creds, files = server_credentials(security)
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"cannot load the TLS certificate, key or CA: {err}") from None
    return server.add_secure_port(address, creds), files


def _check_side_listeners(config: BrokerConfig, security: SecurityConfig) -> None:
    """/metrics, the indexer API and KV-event binds follow the gRPC rule: a non-loopback address
    needs TLS or --insecure (checked before anything listens)."""
    if config.metrics_port:
        address = f"{config.metrics_host}:{config.metrics_port}"
        require_safe_listener(security, address, "/metrics (--metrics-host)", tls=security.tls)
    if config.indexer_http:
        require_safe_listener(
            security, config.indexer_http, "the indexer API (--indexer-http)", tls=security.tls
        )
    for source in parse_sources(config.kv_events):
        if source.binds and source.endpoint.startswith("tcp://"):
            what = f"a KV-event feed bound to {source.endpoint} ({source.engine_id})"
            require_safe_listener(security, source.endpoint, what, tls=False)


def _shared_state(config: BrokerConfig) -> RedisState | None:
    """The Redis/Valkey store of `--state`, checked to answer (None: state in this process)."""
    if not config.state:
        return None
    try:
        from kvbroker.broker.fleet.conn import RedisState
    except ImportError:
        raise InvalidArgument(
            "--state needs the redis client library: pip install 'kvbroker[redis]'"
        ) from None
    try:
        state = RedisState(config.state, config.state_prefix)
        state.ping()
    except Unavailable as err:
        raise InvalidArgument(f"--state: {err.message}") from None
    log.info("state in %s (key prefix %r)", config.state.split("@")[-1], config.state_prefix)
    return state


async def start_server(
    config: BrokerConfig,
    clock: Clock | None = None,
    *,
    tracer_provider: TracerProvider | None = None,
    security: SecurityConfig | None = None,
) -> RunningServer:
    """Start a broker on the running event loop (use address host:0 for a free port).

    `tracer_provider` overrides the OTLP set-up (tests pass one with an in-memory exporter).
    `security`: TLS, mutual TLS or tokens, and quotas (default: plaintext, loopback only).
    """
    config.validate()
    security = security or SecurityConfig()
    security.validate(config.address)
    _check_side_listeners(config, security)
    shared = _shared_state(config)
    clock = clock or (WallClock() if shared is not None else MonotonicClock())
    tasks: list[asyncio.Task[None]] = []
    replica: Replica | None = None
    if shared is None:
        notifier = StreamNotifier(clock)
        core = BrokerCore(config, clock=clock, notifier=notifier)
    else:
        from kvbroker.broker.fleet.replica import Replica

        replica = Replica(config, clock, shared)
        core, notifier = replica.core, replica.notifier
        tasks.append(asyncio.create_task(replica.follow(), name="kvbroker-fleet-channel"))
    feeds: dict[str, KvEventsFeed] = {}  # filled by _start_indexer; /metrics reads it at scrape time

    def feed_tenant(engine_id: str) -> str | None:
        feed = feeds.get(engine_id)
        return feed.source.tenant if feed is not None else None

    engines = EngineIdentity(core.registry, feed_tenant)

    # Outermost first: metrics and spans see the INVALID_ARGUMENT of a malformed request too.
    interceptors: list[grpc.aio.ServerInterceptor] = []
    extras: list[Any] = []
    metrics_registry: CollectorRegistry | None = None
    if config.metrics_port:
        metrics_registry = CollectorRegistry()
        interceptors.append(MetricsInterceptor(metrics_registry))
    provider = tracer_provider or make_tracer_provider(config.otlp_endpoint)
    if provider is not None:
        interceptors.append(TracingInterceptor(provider))
        extras.append(provider)
    tokens = _tokens(security)
    auth = _auth_interceptor(core, security, engines, tokens)
    if auth is not None:
        # Before the decode guard: a caller without rights learns nothing, not even "malformed".
        interceptors.append(auth)
    interceptors.append(DecodeGuardInterceptor())

    metrics_port = 0
    if metrics_registry is not None:
        http = start_metrics_http(
            core,
            metrics_registry,
            config.metrics_host,
            config.metrics_port,
            [KvEventsCollector(feeds), *([TokensCollector(tokens)] if tokens is not None else [])],
            replica.counters.stats if replica is not None else None,
            functools.partial(serve_metrics, security=security, tokens=tokens),
        )
        if http is not None:
            extras.append(http)
            metrics_port = http.server_port
        else:  # the port is taken: count nothing nobody can read
            metrics_registry = None
    servicer = BrokerServicer(
        core,
        notifier,
        engines,
        stats=replica.stats if replica is not None else None,
        stream_observer=SessionStreamMetrics(metrics_registry) if metrics_registry is not None else None,
        tracer=provider.get_tracer("kvbroker.server") if provider is not None else None,
        session_guard=auth.session_guard if auth is not None else None,
    )

    limit = config.max_message_bytes
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            # gRPC's own defaults (1,000 waiting calls, then dropping at random up to 3,000) refuse
            # a router's burst with a bare CANCELLED: wait for the handlers instead, up to a bound.
            ("grpc.server.max_pending_requests", config.max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", config.max_pending_calls),
            # Accept the keepalive pings clients send on quiet Watch and Mirror streams.
            *keepalive.server_options(config.keepalive_min_ping_interval_ms),
        ],
    )
    broker_pb2_grpc.add_KVBrokerServicer_to_server(servicer, server)
    health_servicer = HealthService(config.max_health_watchers, config.max_id_bytes)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    try:
        port, certificates = _listen(server, config.address, security)
        if port == 0:
            raise InvalidArgument(f"cannot listen on {config.address!r} (address in use or invalid)")
    except BaseException:
        for task in tasks:
            task.cancel()
        for extra in extras:
            extra.shutdown()
        raise
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    running = RunningServer(
        server=server,
        core=core,
        servicer=servicer,
        notifier=notifier,
        health=health_servicer,
        port=port,
        address=_public_address(config.address, port),
        metrics_port=metrics_port,
        security=security,
        certificates=certificates,
        guard=auth.guard if auth is not None else None,
        feeds=feeds,
        _expiry_task=asyncio.create_task(_expiry_loop(core), name="kvbroker-expiry"),
        _extras=extras,
        _tasks=tasks,
    )
    try:
        await _start_indexer(running, config, security, auth.guard if auth is not None else None, tokens)
    except BaseException:
        await running.stop(0)
        raise
    return running


async def _start_indexer(
    running: RunningServer,
    config: BrokerConfig,
    security: SecurityConfig,
    guard: TenantGuard | None,
    tokens: TokenTable | None,
) -> None:
    """The engines followed by KV events (--kv-events) and the indexer HTTP API (--indexer-http)."""
    for source in parse_sources(config.kv_events):
        feed = KvEventsFeed(running.core, source, bare_salts=not security.authenticates)
        running.feeds[source.engine_id] = feed
        feed.start()
    if config.indexer_http:
        tenant_of = guard.tenant_of_engine if guard is not None else None
        indexer = IndexerHttp(running.core, IndexerGate(security, tokens), running.feeds, tenant_of)
        try:
            running.indexer_port = await indexer.start(config.indexer_http)
        except OSError as err:
            raise InvalidArgument(f"cannot serve --indexer-http {config.indexer_http!r}: {err}") from None
        running._indexer = indexer


# -- command line ---------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per BrokerConfig field; defaults come from KVBROKER_* variables."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    group = parser.add_argument_group("broker", "each flag can also be set by the environment variable shown")
    settings.add_arguments(group, BrokerConfig, ENV_PREFIX, error=parser.error)
    secure = parser.add_argument_group(
        "security", "TLS, mutual TLS, bearer tokens and quotas (docs/security.md); each flag has its variable"
    )
    settings.add_arguments(secure, SecurityConfig, ENV_PREFIX, error=parser.error)


def config_from_args(args: argparse.Namespace) -> BrokerConfig:
    config: BrokerConfig = settings.from_args(BrokerConfig, args)
    return config


def security_from_args(args: argparse.Namespace) -> SecurityConfig:
    security: SecurityConfig = settings.from_args(SecurityConfig, args)
    return security


def _describe(security: SecurityConfig) -> str:
    if security.mutual:
        return "mutual TLS" + (" and bearer tokens" if security.tokens_file else "")
    if security.tokens_file:
        return "TLS and bearer tokens"
    return "TLS, no client identities" if security.tls else "plaintext, no client identities"


async def _serve(config: BrokerConfig, security: SecurityConfig) -> None:
    running = await start_server(config, security=security)
    log.info(
        "kvbroker listening on %s (port %d), %s%s",
        config.address,
        running.port,
        _describe(security),
        f", metrics on :{running.metrics_port}" if running.metrics_port else "",
    )
    if running.indexer_port:
        scheme = "https" if security.tls else "http"
        host = config.indexer_http.rsplit(":", 1)[0]
        print(f"kvbroker indexer API on {scheme}://{host}:{running.indexer_port}", flush=True)
    print(f"kvbroker listening on {running.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down (grace %.1f s)", config.shutdown_grace_s)
    await running.stop()


def serve_main(args: argparse.Namespace) -> int:
    """Run the broker until SIGINT/SIGTERM; returns the process exit code."""
    try:
        config = config_from_args(args)
        config.validate()
        security = security_from_args(args)
        security.validate(config.address)
    except InvalidArgument as err:
        print(f"kvbroker: invalid configuration: {err.message}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    raise_open_files_limit()  # one descriptor per connection: the fleet's, and a hostile client's
    import uvloop

    try:
        uvloop.run(_serve(config, security))
    except TelemetryError as err:
        print(f"kvbroker: invalid configuration: {err}", file=sys.stderr)
        return 2
    except InvalidArgument as err:
        print(f"kvbroker: {err.message}", file=sys.stderr)
        return 1
    return 0
