"""The adapter's counters through vLLM's connector stats interface: deltas per step,
aggregation, and the Prometheus series vLLM's API server shows. (With a real engine's
/metrics: tests/e2e/test_gpu_inventory_e2e.py.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvbroker.engine_adapter.connector import BrokerConnector
from kvbroker.engine_adapter.stats import SchedulerStats
from kvbroker.engine_adapter.vllm_metrics import BrokerConnectorStats, BrokerPromMetrics
from tests.engine_adapter.scheduler_util import make


def test_each_step_hands_vllm_only_what_changed() -> None:
    stats = SchedulerStats()
    stats.count("pulls")
    stats.count("pulled_bytes", 4096)
    stats.skip("below_threshold")
    assert stats.take_delta({"held_blocks": 3}) == {
        "counters": {"pulls": 1, "pulled_bytes": 4096},
        "skips": {"below_threshold": 1},
        "gauges": {"held_blocks": 3},
    }
    assert stats.take_delta({"held_blocks": 3}) is None  # nothing new: vLLM gets no stats object
    stats.count("pulls")
    assert stats.take_delta({})["counters"] == {"pulls": 1}  # type: ignore[index]


def test_the_scheduler_delta_includes_the_held_gauges() -> None:
    sched, _link, _ = make()
    sched.stats.count("holds_requested")
    delta = sched.take_stats_delta()
    assert delta is not None and delta["gauges"] == {"held_requests": 0, "held_blocks": 0}


def test_stats_aggregate_across_steps_and_ranks() -> None:
    a = BrokerConnector.build_kv_connector_stats(
        {"counters": {"pulls": 1}, "skips": {}, "gauges": {"held_blocks": 2}}
    )
    b = BrokerConnectorStats(
        data={"counters": {"pulls": 2, "pulls_failed": 1}, "skips": {"x": 1}, "gauges": {}}
    )
    assert isinstance(a, BrokerConnectorStats)
    merged = a.aggregate(b)
    assert merged.data["counters"] == {"pulls": 3, "pulls_failed": 1}
    assert merged.reduce() == {"pulls": 3, "pulls_failed": 1, "skips_x": 1, "held_blocks": 2}
    assert BrokerConnectorStats().is_empty() and not merged.is_empty()


def _types(registry: CollectorRegistry) -> dict[type, Any]:
    """Prometheus classes bound to a private registry (vLLM passes its own classes the same way)."""

    def bound(cls: type) -> type:
        return type(
            cls.__name__,
            (cls,),
            {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=registry, **k)},
        )

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def test_prometheus_series_carry_vllms_labels_and_ours() -> None:
    registry = CollectorRegistry()
    metrics = BrokerConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]  # only this is read
        _types(registry),
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    assert isinstance(metrics, BrokerPromMetrics)
    metrics.observe(
        {
            "counters": {
                "pulls": 2,
                "pulled_blocks": 18,
                "pulled_bytes": 589824,
                "pulls_failed": 1,
                "gpu_pins": 1,
            },
            "skips": {"below_threshold": 3},
            "gauges": {"held_blocks": 5, "held_requests": 1},
        },
        engine_idx=0,
    )
    text = generate_latest(registry).decode()
    labels = 'engine="0",model_name="tiny"'
    for line in (
        f"vllm:kvbroker_pulls_total{{{labels}}} 2.0",
        f"vllm:kvbroker_pulled_blocks_total{{{labels}}} 18.0",
        f"vllm:kvbroker_pulled_bytes_total{{{labels}}} 589824.0",
        f"vllm:kvbroker_pull_failures_total{{{labels}}} 1.0",
        'vllm:kvbroker_skips_total{engine="0",model_name="tiny",reason="below_threshold"} 3.0',
        'vllm:kvbroker_events_total{engine="0",event="gpu_pins",model_name="tiny"} 1.0',
        f"vllm:kvbroker_held_blocks{{{labels}}} 5.0",
    ):
        assert line in text, line
