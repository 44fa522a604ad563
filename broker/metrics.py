"""Prometheus metrics, added from outside the core.

- `BrokerCollector` reads the core's state at scrape time (engines, sessions,
  blocks indexed, leases by state, revocations by cause): nothing is counted
  on the hot path. A replica of a fleet (`--state`) counts its own ended
  leases and revocations, and adds the fleet's totals from the store
  (`kvbroker_fleet_*` gauges).
- `MetricsInterceptor` times every unary RPC (histogram by method and code)
  and counts Session/Watch streams opened.
- `SessionStreamMetrics` counts and times what the engines' Session streams
  carry (resolves, lease commands, inventory, pin results, heartbeats), and
  how long a reader's pin waited for the holder; the servicer calls it once per
  message (a few microseconds).
- The process collector (CPU, memory, file descriptors) and
  `kvbroker_build_info`.
"""

from __future__ import annotations

import errno
import logging
import platform
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from importlib import metadata
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import BrokerError
from kvbroker.broker.exactness import census
from kvbroker.broker.results import Stats
from kvbroker.broker.retention import Retention

log = logging.getLogger("kvbroker.metrics")

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Session-stream messages are handled in tens of microseconds.
STREAM_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class BrokerCollector(Collector):
    def __init__(self, core: BrokerCore, fleet: Callable[[Stats], Stats] | None = None) -> None:
        self._core = core
        self._fleet = fleet  # a replica of a fleet: this replica's Stats -> the fleet's

    def collect(self) -> Iterator[Metric]:
        stats = self._core.stats()
        yield GaugeMetricFamily("kvbroker_engines", "Registered engines (live sessions)", value=stats.engines)
        yield GaugeMetricFamily("kvbroker_sessions", "Live engine sessions", value=stats.sessions)
        yield GaugeMetricFamily(
            "kvbroker_own_sessions",
            "Engine sessions whose stream this broker serves (with --state: this replica's; "
            "kvbroker_sessions counts the fleet's)",
            value=len(self._core.registry.own_sessions()),
        )
        yield GaugeMetricFamily(
            "kvbroker_blocks_indexed", "Blocks in the prefix index (per holder)", value=stats.blocks_indexed
        )
        yield GaugeMetricFamily(
            "kvbroker_namespaces", "Namespaces with indexed blocks", value=stats.namespaces
        )
        yield GaugeMetricFamily(
            "kvbroker_mirrors", "Connected Mirror streams", value=self._core.mirrors.subscriber_count()
        )
        yield from self._index_memory()
        exactness = GaugeMetricFamily(
            "kvbroker_engines_by_exactness",
            "Engines by how exact the index's picture of their blocks is (exact, lagging, degraded)",
            labels=["exactness"],
        )
        for state, n in census(self._core.registry.all(), self._core.clock.now()).items():
            exactness.add_metric([state], n)
        yield exactness
        live = GaugeMetricFamily("kvbroker_leases", "Live leases by state", labels=["state"])
        ended = CounterMetricFamily("kvbroker_leases_ended", "Ended leases by final state", labels=["state"])
        for state, n in stats.leases_by_state.items():
            (ended if state in ("released", "revoked") else live).add_metric([state], n)
        yield live
        yield ended
        retained = GaugeMetricFamily(
            "kvbroker_retentions", "Live retentions (Retain: leases with no reader) by tier", labels=["tier"]
        )
        for tier, n in Retention(self._core).live_by_tier().items():
            retained.add_metric([tier.name.lower()], n)
        yield retained
        revoked = CounterMetricFamily("kvbroker_revocations", "Lease revocations by cause", labels=["cause"])
        for cause, n in stats.revocations_by_cause.items():
            revoked.add_metric([cause], n)
        yield revoked
        if self._fleet is not None:
            yield from self._fleet_totals(stats)
        yield from self._lease_stats()
        lag, pending = self._core.mirrors.lag()
        yield GaugeMetricFamily(
            "kvbroker_mirror_lag_seconds",
            "Age of the oldest index change a Mirror stream has not been sent yet (0: all caught up)",
            value=lag,
        )
        yield GaugeMetricFamily(
            "kvbroker_mirror_pending_bytes",
            "Bytes of index changes waiting for Mirror streams",
            value=pending,
        )

    def _index_memory(self) -> Iterator[Metric]:
        """The index's memory budget (--index-memory-mib) and what it forgot to keep to it."""
        memory = self._core.index.memory()
        yield GaugeMetricFamily(
            "kvbroker_index_memory_budget_bytes",
            "Memory budget of the prefix index (--index-memory-mib; 0 = unbounded)",
            value=memory.budget_bytes,
        )
        yield CounterMetricFamily(
            "kvbroker_index_forgotten",
            "Index entries (blocks) this broker forgot to stay within --index-memory-mib (or, with "
            "--state, --index-max-entries)",
            value=memory.forgotten,
        )
        if self._fleet is None or memory.budget_bytes:  # the store's: only under a bytes budget
            yield GaugeMetricFamily(
                "kvbroker_index_memory_estimated_bytes",
                "Estimated memory of the prefix index: in memory, its tables plus 48 bytes a key; with "
                "--state, its entries at the store's measured bytes per entry plus the mirror change streams",
                value=memory.estimated_bytes,
            )
        if self._fleet is None or memory.entry_cap:
            yield GaugeMetricFamily(
                "kvbroker_index_entries",
                "Distinct blocks in the prefix index (with --state and a bound: the fleet's, from the store)",
                value=memory.entries,
            )
            yield GaugeMetricFamily(
                "kvbroker_index_entry_cap",
                "Most distinct blocks --index-memory-mib (or, with --state, --index-max-entries) allows "
                "(0 = unbounded)",
                value=memory.entry_cap,
            )

    def _fleet_totals(self, local: Stats) -> Iterator[Metric]:
        """Every replica's counts summed, read from the shared store now. Gauges: each replica shows
        the same totals, so take any one of them (max by ...), never their sum; the per-replica
        series above are the ones to sum or rate."""
        assert self._fleet is not None
        try:
            fleet = self._fleet(local)
        except BrokerError as err:  # the store is away: this replica's own series still answer
            log.debug("fleet totals not read: %s", err)
            return
        ended = GaugeMetricFamily(
            "kvbroker_fleet_leases_ended",
            "Ended leases by final state, all broker replicas together (from the shared store)",
            labels=["state"],
        )
        for state in ("released", "revoked"):
            ended.add_metric([state], fleet.leases_by_state.get(state, 0))
        revoked = GaugeMetricFamily(
            "kvbroker_fleet_revocations",
            "Lease revocations by cause, all broker replicas together (from the shared store)",
            labels=["cause"],
        )
        for cause, n in fleet.revocations_by_cause.items():
            revoked.add_metric([cause], n)
        yield from (ended, revoked)

    def _lease_stats(self) -> Iterator[Metric]:
        stats = self._core.leases.stats
        if stats is None:
            return
        held = HistogramMetricFamily(
            "kvbroker_lease_duration_seconds",
            "How long leases lived, from hold or pin to their end, by outcome (released or the revoke cause)",
            labels=["outcome"],
        )
        for outcome, hist in stats.durations.items():
            held.add_metric([outcome], hist.cumulative(), hist.total)
        yield held
        labels = ["holder", "reader", "tier"]
        reads = CounterMetricFamily(
            "kvbroker_pair_reads", "Committed reads (released leases) per engine pair", labels=labels
        )
        blocks = CounterMetricFamily(
            "kvbroker_pair_blocks", "Blocks of committed reads per engine pair", labels=labels
        )
        moved = CounterMetricFamily(
            "kvbroker_pair_bytes",
            "Bytes of committed reads per engine pair, as the reader reports them (else the lease's)",
            labels=labels,
        )
        unreported = CounterMetricFamily(
            "kvbroker_pair_unreported_reads",
            "Committed reads whose reader did not report what it read: counted as the whole lease",
            labels=labels,
        )
        for (holder, reader, tier), totals in list(stats.pairs.items()):
            values = [holder, reader, tier.name.lower()]
            reads.add_metric(values, totals.reads)
            blocks.add_metric(values, totals.blocks)
            moved.add_metric(values, totals.bytes)
            unreported.add_metric(values, totals.unreported)
        yield from (reads, blocks, moved, unreported)


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram(
            "kvbroker_rpc_seconds",
            "Unary RPC latency",
            ["method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.streams = Counter(
            "kvbroker_streams_opened", "Streaming RPCs opened", ["method"], registry=registry
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]  # type: ignore[attr-defined]
        if handler is None:
            return handler
        if handler.unary_unary is None:
            self.streams.labels(method).inc()
            return handler
        inner = handler.unary_unary
        latency = self.latency

        async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            code = "OK"
            try:
                return await inner(request, context)
            except BaseException:
                code = context.code().name if context.code() is not None else "UNKNOWN"  # type: ignore[union-attr]
                raise
            finally:
                latency.labels(method, code).observe(time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(
            timed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class SessionStreamMetrics:
    """The servicer's StreamObserver: Session-stream messages and pin waits."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.messages = Counter(
            "kvbroker_session_messages",
            "Session-stream messages handled, by kind (resolve, hold, acquire, release, inventory, ...) and code",
            ["kind", "code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "kvbroker_session_message_seconds",
            "Time the broker spent on one Session-stream message, by kind",
            ["kind"],
            buckets=STREAM_BUCKETS,
            registry=registry,
        )
        self.pins = Histogram(
            "kvbroker_pin_wait_seconds",
            "From a reader's resolve that needs a pin to the holder's answer, by outcome",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def message(self, kind: str, code: str, seconds: float) -> None:
        self.messages.labels(kind, code).inc()
        self.seconds.labels(kind).observe(seconds)

    def pin(self, outcome: str, seconds: float) -> None:
        self.pins.labels(outcome).observe(seconds)


def build_info(registry: CollectorRegistry) -> None:
    """``kvbroker_build_info{version, python, grpc} 1``."""
    try:
        version = metadata.version("kvbroker")
    except metadata.PackageNotFoundError:
        version = "unknown"
    info = Gauge(
        "kvbroker_build_info",
        "The broker's version, Python and grpcio (always 1)",
        ["version", "python", "grpc"],
        registry=registry,
    )
    info.labels(version, platform.python_version(), grpc.__version__).set(1)


def start_metrics_http(
    core: BrokerCore,
    registry: CollectorRegistry,
    host: str,
    port: int,
    collectors: Sequence[Collector] = (),
    fleet: Callable[[Stats], Stats] | None = None,
    serve: Callable[[CollectorRegistry, str, int], Any] | None = None,
) -> Any:
    """Serve /metrics on a background thread; returns the server (call .shutdown() to stop),
    or None when the port is taken: the broker then runs without metrics, and says so.
    `collectors`: more, from the broker's wings (the KV-event feeds': indexer/feed_metrics.py).
    `serve(registry, host, port)`: the HTTP server (the security wing's: security/metrics_http.py,
    who may read it and over what); default: prometheus_client's plain HTTP."""
    registry.register(BrokerCollector(core, fleet))
    for collector in collectors:
        registry.register(collector)
    ProcessCollector(registry=registry)
    build_info(registry)
    try:
        if serve is not None:
            server = serve(registry, host, port)
        else:
            server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        log.warning("metrics off: port %d on %s is taken (set --metrics-port, or 0 for off)", port, host)
        return None
    return server
