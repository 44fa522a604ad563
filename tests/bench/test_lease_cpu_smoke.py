"""Smoke test of `python -m bench.scale.lease_cpu` on a tiny run: it starts its in-memory broker,
two replicas and a redis-server, runs lease cycles on both setups, prints the ratio with the load
average and writes well-formed JSON. It never asserts on the figures: at this size they mean
nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.redis_server import missing_reason
from tests.bench.run import run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_lease_cpu_tiny(tmp_path: Path) -> None:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    args = ["--cycles", "100", "--rounds", "2", "--warmup", "5", "--pairs", "2"]
    args += ["--out-dir", str(tmp_path), "--name", "tiny"]
    proc = run_module("bench.scale.lease_cpu", *args, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "broker CPU per lease cycle" in proc.stdout and "load average" in proc.stdout, proc.stdout
    assert "2 P/D pairs at once" in proc.stdout, proc.stdout
    doc = json.loads((tmp_path / "tiny.json").read_text())
    assert len(doc["in_memory_us_per_cycle"]) == 2 and len(doc["two_replicas_us_per_cycle"]) == 2
    assert doc["ratio"] > 0 and doc["load"] and doc["settings"]["pairs"] == 2
    assert [len(v) for v in doc["main_thread_us_per_cycle"].values()] == [1, 2]  # each broker's event loop
