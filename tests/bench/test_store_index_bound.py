"""Smoke run of bench.scale.store_index_bound at a tiny size: it starts a redis-server and a
broker over it with --index-max-entries, announces past the bound, prints its table and writes
its JSON (the recorded run is in bench/results/store_index_bound.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.redis_server import missing_reason
from tests.bench.run import run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_store_index_bound_tiny(tmp_path: Path) -> None:
    if reason := missing_reason():
        pytest.skip(reason)
    tiny = ["--quick", "--bound", "2000", "--factor", "3", "--no-reference"]
    proc = run_module("bench.scale.store_index_bound", *tiny, "--out-dir", str(tmp_path), timeout=100)
    assert proc.returncode == 0, f"failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "peak/at bound" in proc.stdout and "target: past the bound the index's memory" in proc.stdout
    (run,) = json.loads((tmp_path / "store_index_bound-quick.json").read_text())["results"]
    assert run["bound_entries"] == 2000 and run["blocks_announced"] >= 3 * 2000
    assert 0 < run["entries"] <= 2000 and run["forgotten"] >= run["blocks_announced"] - 2000
    assert run["index_bytes"] > 0 and run["index_bytes_at_bound"] > 0
