"""The adapter's counters as series of vLLM's own /metrics, through its connector stats interface.

Each step vLLM's scheduler asks the connector for its stats
(``get_kv_connector_stats``); ours are the counts since the last step
(``SchedulerStats.take_delta``): counters, skip reasons and a few gauges. vLLM
carries them to its API server process (only while it logs stats, its
default), where ``BrokerPromMetrics`` (made by the connector's
``build_prom_metrics``) adds them to Prometheus series:

=========================================  ============================================
``vllm:kvbroker_pulls_total``              pulls whose release committed the read
``vllm:kvbroker_pulled_blocks_total``      blocks those pulls read
``vllm:kvbroker_pulled_bytes_total``       bytes those pulls read
``vllm:kvbroker_pull_failures_total``      pulls that failed and were recomputed
``vllm:kvbroker_verify_mismatches_total``  pulls whose bytes failed verification (recomputed)
``vllm:kvbroker_skips_total{reason}``      prompts recomputed instead of pulled, by reason
``vllm:kvbroker_events_total{event}``      every other counter of the adapter, by name
``vllm:kvbroker_held_blocks``              blocks held for readers now (gauge)
``vllm:kvbroker_held_requests``            requests whose blocks are held now (gauge)
=========================================  ============================================

Every series carries vLLM's own labels (``model_name``, ``engine``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# Adapter counter -> (series, help) of a dedicated counter; the rest go to kvbroker_events.
DEDICATED = {
    "pulls": ("vllm:kvbroker_pulls", "Pulls whose lease release committed the read."),
    "pulled_blocks": ("vllm:kvbroker_pulled_blocks", "KV blocks read by committed pulls."),
    "pulled_bytes": ("vllm:kvbroker_pulled_bytes", "Bytes read by committed pulls."),
    "pulls_failed": ("vllm:kvbroker_pull_failures", "Pulls that failed; their blocks were recomputed."),
    "verify_mismatches": (
        "vllm:kvbroker_verify_mismatches",
        "Pulls whose bytes differed from the holder's digests (verify_bytes); they were recomputed.",
    ),
}
GAUGES = {
    "held_blocks": ("vllm:kvbroker_held_blocks", "KV blocks this engine holds for readers now."),
    "held_requests": (
        "vllm:kvbroker_held_requests",
        "Finished requests whose blocks are held for readers now.",
    ),
}


class BrokerConnectorStats(KVConnectorStats):
    """``data``: {"counters": {name: n}, "skips": {reason: n}, "gauges": {name: value}}, counts since the last."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "skips": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine, theirs = self.data, other.data
        for part in ("counters", "skips"):
            summed = Counter(mine.get(part, {}))
            summed.update(theirs.get(part, {}))
            mine[part] = dict(summed)
        mine["gauges"] = {**mine.get("gauges", {}), **theirs.get("gauges", {})}  # the latest wins
        return self

    def reduce(self) -> dict[str, int | float]:
        data = self.data
        reduced: dict[str, int | float] = dict(data.get("counters", {}))
        reduced.update({f"skips_{reason}": n for reason, n in data.get("skips", {}).items()})
        reduced.update(data.get("gauges", {}))
        return reduced

    def is_empty(self) -> bool:
        data = self.data
        return not (data.get("counters") or data.get("skips") or data.get("gauges"))


class BrokerPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM may hand other classes than prometheus_client's (Ray's): typed as vLLM's union.
        counter, gauge = cast(Any, self._counter_cls), cast(Any, self._gauge_cls)
        self._dedicated: dict[str, Any] = {
            name: counter(name=series, documentation=doc, labelnames=labelnames)
            for name, (series, doc) in DEDICATED.items()
        }
        self._gauges: dict[str, Any] = {
            name: gauge(name=series, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
            for name, (series, doc) in GAUGES.items()
        }
        self._skips = counter(
            name="vllm:kvbroker_skips",
            documentation="Prompts the adapter recomputed instead of pulling, by reason.",
            labelnames=[*labelnames, "reason"],
        )
        self._events = counter(
            name="vllm:kvbroker_events",
            documentation="The adapter's other counters (holds, pins, announcements, CPU tier), by name.",
            labelnames=[*labelnames, "event"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for name, n in transfer_stats_data.get("counters", {}).items():
            if n <= 0:
                continue
            metric = self._dedicated.get(name)
            if metric is not None:
                metric.labels(*labels).inc(n)
            else:
                self._events.labels(*labels, name).inc(n)
        for reason, n in transfer_stats_data.get("skips", {}).items():
            if n > 0:
                self._skips.labels(*labels, reason).inc(n)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            gauge = self._gauges.get(name)
            if gauge is not None:
                gauge.labels(*labels).set(value)
