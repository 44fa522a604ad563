"""Smoke test of `python -m bench.fleet.fleet --quick` on its smallest settings: one rate, four
sessions, the three cheapest setups (round robin, prefix-affinity routing and our proxy's
placement share one pair of stock engines).

It proves the program starts the engines, broker and routers, drives the sessions, and writes
the JSON every setup and rate is read from, with 0 failed requests. Never asserts on speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.run import run_module

pytest.importorskip("vllm")
pytest.importorskip("zmq")


pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

RUN_KEYS = {
    "rate_offered_rps",
    "goodput_rps",
    "throughput_rps",
    "ttft_ms",
    "prefix_reuse",
    "ideal_reuse",
    "recomputed_tokens",
    "pulled_tokens",
    "pulled_bytes",
    "failed",
    "not_sent",
}


def test_quick_mode_smallest(tmp_path: Path) -> None:
    argv = ["--quick", "--setups", "rr,prefix,ours-dp-stock", "--rates", "4", "--sessions", "4", "--no-plot"]
    argv += ["--name", "fleet-smoke", "--out-dir", str(tmp_path)]
    proc = run_module("bench.fleet.fleet", *argv, timeout=840)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    doc = json.loads((tmp_path / "fleet-smoke.json").read_text())
    assert doc["slo"]["ttft_ms"] > 0 and doc["rates"] == [4.0]
    assert 0 < doc["workload"]["ideal_reuse"] < 1
    assert set(doc["setups"]) == {"rr", "prefix", "ours-dp-stock"}
    for name, entry in doc["setups"].items():
        (run,) = entry["runs"]
        assert set(run) >= RUN_KEYS, (name, sorted(run))
        assert run["failed"] == 0 and run["not_sent"] == 0, (name, run["errors"])
        assert run["completed"] == run["requests_sent"] == doc["workload"]["requests"]
        assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"] <= run["ttft_ms"]["p99"]
        assert 0 <= run["prefix_reuse"] <= 1
        # Each engine's share, from its own counters: together they finished every request.
        engines = run["per_engine"]
        assert len(engines) == 2 and sum(e["requests"] for e in engines.values()) == run["completed"]
        assert all(e["tpot_ms_mean"] is None or e["tpot_ms_mean"] > 0 for e in engines.values())
    # Round robin alternates: its two engines finished the same number of requests, give or take one.
    rr = [e["requests"] for e in doc["setups"]["rr"]["runs"][0]["per_engine"].values()]
    assert abs(rr[0] - rr[1]) <= 1, rr
    # The prefix router asked the broker, which follows the engines' KV events, and it named holders.
    assert doc["setups"]["prefix"]["runs"][0]["router"]["scored_hits"] > 0
    # Our proxy placed every request over the same engines, and said why.
    reasons = doc["setups"]["ours-dp-stock"]["runs"][0]["router"]["route_reasons"]
    assert sum(reasons.values()) == doc["workload"]["requests"], reasons
    assert "rr" in proc.stdout and "prefix" in proc.stdout
