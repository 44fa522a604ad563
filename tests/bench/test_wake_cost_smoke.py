"""Smoke test of `python -m bench.scale.wake_cost` on a tiny run: it measures its pipe and store round
trips, prints each row with the load average and writes well-formed JSON. It never asserts on the
figures: at this size they mean nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from testkit.redis_server import missing_reason
from tests.bench.run import run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_wake_cost_tiny(tmp_path: Path) -> None:
    args = ["--trips", "50", "--rounds", "1", "--out-dir", str(tmp_path), "--name", "tiny"]
    proc = run_module("bench.scale.wake_cost", *args, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "load average" in proc.stdout, proc.stdout
    doc = json.loads((tmp_path / "tiny.json").read_text())
    rows = doc["rows"]
    assert "pipe, one core, both sleep" in rows and doc["load"]
    if len(os.sched_getaffinity(0)) > 1:
        assert "pipe, two cores, nobody sleeps" in rows
    if not missing_reason():
        assert "store script, 1 ms asleep before each" in rows
    assert all(row["cpu_us"] >= 0 and row["wall_us"] > 0 for row in rows.values())
