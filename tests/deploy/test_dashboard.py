"""The Grafana dashboard queries only series our code exports, in PromQL the picture's renderer draws.

Exported means: found in a real scrape of the broker's /metrics (metrics and
--kv-events on), in the proxy's registry, in the series our connector adds to
vLLM's /metrics (BrokerPromMetrics bound to a registry, as vLLM binds it), or in
vLLM's own metric definitions (vllm:time_to_first_token_seconds).
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bench.fleet.dashboard import load_panels
from bench.fleet.promql import Samples, Unsupported, evaluate, metric_names, parse
from kvbroker.broker.config import BrokerConfig
from testkit.broker import running_broker
from testkit.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _families(text: str) -> set[str]:
    """Family names in an exposition (some prometheus_client versions write a counter's with _total)."""
    return {_family(name) for name in re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)}


def dashboard_metrics() -> set[str]:
    return {
        name for panel in load_panels() for expr, _ in panel.targets for name in metric_names(parse(expr))
    }


def test_the_dashboard_is_grafana_json_with_unique_ids() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "kvbroker.json").read_text())
    assert dash["uid"] == "kvbroker" and dash["panels"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "prometheus" and panel["targets"], panel["title"]
    datasource = (ROOT / "deploy" / "grafana" / "datasource.yml").read_text()
    assert "uid: prometheus" in datasource


async def test_every_queried_metric_is_exported_by_our_code() -> None:
    pytest.importorskip("zmq")
    vllm = pytest.importorskip("vllm")
    exported: set[str] = set()
    # The broker: a real scrape (families are listed even before they have samples).
    config = {
        "metrics_port": free_port(),
        "metrics_host": "127.0.0.1",
        "kv_events": "e=tcp://127.0.0.1:1?model=m&block_size=32",
    }
    async with running_broker(**config) as running:
        url = f"http://127.0.0.1:{running.metrics_port}/metrics"
        exported |= _families(urllib.request.urlopen(url, timeout=5).read().decode())
    # The proxy's registry.
    from kvbroker.clients.proxy.metrics import ProxyMetrics

    exported |= _families(generate_latest(ProxyMetrics(access_log_on=False).registry).decode())
    # Our connector's series on vLLM's /metrics, bound to a registry as vLLM binds them.
    from kvbroker.engine_adapter.connector import BrokerConnector
    from tests.engine_adapter.test_vllm_metrics import _types

    registry = CollectorRegistry()
    BrokerConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        _types(registry),
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    exported |= _families(generate_latest(registry).decode())
    # vLLM's own series the dashboard reads.
    loggers = (Path(vllm.__file__).parent / "v1" / "metrics" / "loggers.py").read_text()
    exported |= set(re.findall(r'name="(vllm:time_to_first_token_seconds)"', loggers))
    missing = {name for name in dashboard_metrics() if _family(name) not in exported}
    assert not missing, f"the dashboard queries series nobody exports: {sorted(missing)}"


def test_the_renderer_evaluates_the_dashboards_query_shapes() -> None:
    s = Samples()
    for t, (pulls, b1, b2, binf) in enumerate([(0, 0, 0, 0), (10, 4, 8, 10), (30, 10, 16, 20)]):
        s.add(t * 10.0, "vllm:kvbroker_pulls_total", {"job": "prefill"}, pulls)
        for le, n in (("0.1", b1), ("1.0", b2), ("+Inf", binf)):
            s.add(t * 10.0, "kvbroker_lease_duration_seconds_bucket", {"le": le, "outcome": "released"}, n)
        s.add(t * 10.0, "kvbroker_leases", {"state": "held", "job": "broker"}, t)
    assert evaluate(parse("sum(rate(vllm:kvbroker_pulls_total[1m]))"), s, 20.0) == {frozenset(): 1.5}
    scaled = evaluate(parse("sum by (job) (rate(vllm:kvbroker_pulls_total[1m])) / 1e9"), s, 20.0)
    assert scaled == {frozenset({("job", "prefill")}): pytest.approx(1.5e-9)}
    quantile = (
        "histogram_quantile(0.5, sum by (le, outcome) (rate(kvbroker_lease_duration_seconds_bucket[5m])))"
    )
    # 20 leases ended, 10 within 0.1 s: the median is the bucket's upper bound.
    assert evaluate(parse(quantile), s, 20.0) == {frozenset({("outcome", "released")}): 0.1}
    assert evaluate(parse('kvbroker_leases{state="held"}'), s, 10.0) == {
        frozenset({("state", "held"), ("job", "broker")}): 1.0
    }
    for bad in ("topk(3, kvbroker_leases)", "kvbroker_leases offset 5m", "sum(kvbroker_leases) + 1"):
        with pytest.raises(Unsupported):
            parse(bad)


def test_compose_provisions_prometheus_and_grafana_with_the_dashboard() -> None:
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    mounts = " ".join(services["grafana"]["volumes"])
    assert "./deploy/grafana/kvbroker.json:" in mounts and "provisioning/datasources" in mounts
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["static_configs"][0]["targets"][0] for job in prometheus["scrape_configs"]}
    assert jobs == {
        "broker": "broker:9400",
        "prefill": "prefill:8000",
        "decode": "decode:8000",
        "proxy": "proxy:8000",
    }
    assert services["broker"]["environment"]["KVBROKER_METRICS_PORT"] == "9400"
    assert BrokerConfig().metrics_port == 9400


def test_the_readme_picture_redraws_from_its_run_samples(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench.fleet.dashboard import main

    samples = ROOT / "bench" / "results" / "dashboard_samples.json"
    saved = json.loads(samples.read_text())
    # The run's samples hold every series the panels read, from each scraped job.
    assert {name for name, _, _ in saved["series"]} <= dashboard_metrics()
    # (The event-fed engine runs with vLLM's stats off: the broker counts its events.)
    jobs = {labels["job"] for _, labels, _ in saved["series"]}
    assert jobs == {"broker", "prefill", "decode", "proxy"}
    out = tmp_path / "dashboard.png"
    assert main(["--from-samples", str(samples), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ROOT / "docs" / "dashboard.png").is_file()
