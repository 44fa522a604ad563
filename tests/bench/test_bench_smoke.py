"""Smoke test of the control-plane benchmark programs on tiny sizes.

It proves the programs start what they need, run, print their tables and write
well-formed JSON. It never asserts on speed: figures at these sizes mean nothing.
A peer that cannot run on this machine (no redis-server, no Mooncake) must be
reported with a reason, which the test checks instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench.run import run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def run_bench(module: str, result: str, out_dir: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    """Run `module` in tiny mode; its JSON is `result`-tiny.json (the result keeps its name)."""
    proc = run_module(module, "--tiny", "--no-plot", "--out-dir", str(out_dir), *extra, timeout=100)
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    doc = json.loads((out_dir / f"{result}-tiny.json").read_text())
    assert_checked(proc.stdout, doc)
    return proc.stdout, doc


def assert_checked(out: str, doc: dict[str, Any]) -> None:
    """Every figure went through bench.harness.checks: the run says so, and passed."""
    assert "Consistency checks (Little's law, cores, memcpy)" in out, out[-3000:]
    checks = doc["checks"]
    assert checks["passed"] and checks["invalid"] == [], checks
    assert checks["memcpy_gb_per_s"] > 0
    assert "INVALID" not in out
    assert all(t.get("verdict") != "invalid" for t in doc.get("targets", []))


def assert_figure(fig: dict[str, Any]) -> None:
    for key in ("p50_us", "p99_us", "mean_us", "ops_per_s"):
        assert fig[key]["median"] > 0, (key, fig)
        assert fig[key]["min"] <= fig[key]["median"] <= fig[key]["max"]
    # What the Little's-law check needs is recorded beside the figure, and it passed.
    assert fig["clients"] >= 1 and "invalid" not in fig, fig


def assert_peer_measured_or_explained(res: dict[str, Any], figure: str) -> None:
    if res["available"]:
        for fig in res[figure].values():
            assert_figure(fig)
    else:
        assert res["reason"], res


def test_control_plane_tiny(tmp_path: Path) -> None:
    out, doc = run_bench("bench.control_plane.compare", "control_plane", tmp_path)
    assert "lookup of a 64-block chain" in out
    assert "share its" in out  # the shared-cores note
    results = doc["results"]
    assert doc["machine"]["cpu_count"] >= 1
    # The grpc floors and the broker need nothing outside this repository: they must run.
    assert results["grpc"]["available"], results["grpc"]
    for fig in (*results["grpc"]["unary"].values(), *results["grpc"]["stream"].values()):
        assert_figure(fig)
    broker = results["broker"]
    assert broker["available"], broker
    assert set(broker["resolve_session"]) == {"c1", "c4"}
    for fig in (*broker["resolve_session"].values(), *broker["resolve_unary"].values()):
        assert_figure(fig)
    assert broker["inventory"]["c1"]["blocks_per_s"]["median"] > 0
    # The engine-local index mirror: synced, answering, and following changes.
    assert set(broker["resolve_mirror"]) == {"c1", "c4"}
    for fig in broker["resolve_mirror"].values():
        assert_figure(fig)
        assert fig["in_process"]  # so the cores check applies to it
    assert broker["inventory"]["c4"]["bytes_per_block"] > 0  # so the memcpy check applies
    assert broker["mirror_sync"]["blocks"] > 0
    assert 0 < broker["mirror_lag"]["p50_us"] <= broker["mirror_lag"]["p99_us"]
    assert broker["inventory_with_mirror"]["c1"]["blocks_per_s"]["median"] > 0
    assert broker["inventory_engine_session"]["c4"]["blocks_per_s"]["median"] > 0
    points = broker["memory"]["points"]
    assert [p["blocks_indexed"] >= 5_000 for p in points] == [True, True]
    assert points[-1]["blocks_indexed"] >= 20_000
    assert_peer_measured_or_explained(results["redis"], "mget")
    assert_peer_measured_or_explained(results["mooncake"], "batch_is_exist")
    if results["redis"]["available"] and results["mooncake"]["available"]:
        names = {t["target"].split(" ")[0] for t in doc["targets"]}
        assert {"resolve", "inventory", "memory"} <= names


def test_broker_bench_tiny(tmp_path: Path) -> None:
    out, doc = run_bench(
        "bench.control_plane.broker", "broker_bench", tmp_path, "--skip", "redis", "--skip", "mooncake"
    )
    assert "resolve over session stream: p50 us" in out
    assert "resolve on the engine-local index mirror: p50 us" in out
    results = doc["results"]
    assert results["broker"]["available"], results["broker"]
    assert results["broker"]["engines"]["registered"] == 20
    inproc = results["index_inprocess"]
    assert inproc["available"], inproc
    assert [p["blocks"] for p in inproc["points"]] == [5_000, 20_000]
    assert inproc["lookup_64_p50_us"] > 0


def test_tls_bench_quick(tmp_path: Path) -> None:
    """bench/control_plane/tls.py runs its three transports and writes every figure for each."""
    out = tmp_path / "tls.json"
    proc = run_module("bench.control_plane.tls", "--quick", "--rounds", "1", "--out", str(out), timeout=100)
    assert proc.returncode == 0, f"bench.control_plane.tls failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"plaintext", "tls", "mtls"}
    for figures in doc["results"].values():
        assert figures["session_inventory_blocks_per_s"]["median"] > 0
        assert figures["mirror_resolve_p50_us"]["median"] > 0
    assert "mutual TLS" in proc.stdout and set(doc["targets"]) == {
        "mirror_resolve_p50_us",
        "session_inventory_cpu_us_per_1k_blocks",
    }
