"""Prometheus metrics of the engines followed by their vLLM KV events (kv_events.py), read at
scrape time; broker/server.py hands the collector to broker/metrics.py's /metrics server."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvbroker.broker.indexer.kv_events import KvEventsFeed


class KvEventsCollector(Collector):
    """Engines followed by their vLLM KV events (kv_events.py): connection, batches, blocks by outcome."""

    def __init__(self, feeds: Mapping[str, KvEventsFeed]) -> None:
        self._feeds = feeds

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "kvbroker_kv_events_connected",
            "1 while the broker is connected to the engine's publisher",
            labels=["engine"],
        )
        batches = CounterMetricFamily(
            "kvbroker_kv_events_batches", "KV event batches received", labels=["engine"]
        )
        gaps = CounterMetricFamily(
            "kvbroker_kv_events_seq_gaps",
            "Gaps in the publisher's sequence numbers (missed batches)",
            labels=["engine"],
        )
        replayed = CounterMetricFamily(
            "kvbroker_kv_events_replayed",
            "Batches filled in from the publisher's replay socket",
            labels=["engine"],
        )
        blocks = CounterMetricFamily(
            "kvbroker_kv_events_blocks",
            "Blocks in KV events by outcome (stored, removed, unknown_parent, mismatched, unsupported, unowned_salt)",
            labels=["engine", "outcome"],
        )
        for engine_id, feed in list(self._feeds.items()):
            up.add_metric([engine_id], 1 if feed.record is not None else 0)
            batches.add_metric([engine_id], feed.batches)
            gaps.add_metric([engine_id], feed.seq_gaps)
            replayed.add_metric([engine_id], feed.replayed)
            for outcome, n in feed.stats.as_dict().items():
                if outcome != "cleared":
                    blocks.add_metric([engine_id, outcome], n)
        yield from (up, batches, gaps, replayed, blocks)
