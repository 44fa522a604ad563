"""Smoke run of bench.scale.store_index_bound at a tiny size: it starts a redis-server and a
broker over it with --index-max-entries (or --index-memory-mib), announces past the bound, prints
its table and writes its JSON (the recorded runs are in bench/results/store_index_bound.json and
store_index_bytes.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.redis_server import missing_reason
from tests.bench.run import run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _quick_run(tmp_path: Path, *options: str) -> str:
    """The benchmark's quick run with `options` on a redis-server of its own; its printout."""
    if reason := missing_reason():
        pytest.skip(reason)
    tiny = ["--quick", *options, "--no-reference", "--out-dir", str(tmp_path)]
    proc = run_module("bench.scale.store_index_bound", *tiny, timeout=100)
    assert proc.returncode == 0, f"failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_store_index_bound_tiny(tmp_path: Path) -> None:
    stdout = _quick_run(tmp_path, "--bound", "2000", "--factor", "3")
    assert "peak/at bound" in stdout and "target: the index keys' peak MEMORY USAGE" in stdout
    (run,) = json.loads((tmp_path / "store_index_bound-quick.json").read_text())["results"]
    assert run["bound_entries"] == 2000 and run["blocks_announced"] >= 3 * 2000
    assert 0 < run["entries"] <= 2000 and run["forgotten"] >= run["blocks_announced"] - 2000
    assert run["index_bytes"] > 0 and run["index_bytes_at_bound"] > 0


def test_store_index_bytes_tiny(tmp_path: Path) -> None:
    stdout = _quick_run(tmp_path, "--memory-mib", "1", "--factor", "2")
    assert "peak over budget" in stdout and "x the budget (--index-memory-mib)" in stdout
    (run,) = json.loads((tmp_path / "store_index_bytes-quick.json").read_text())["results"]
    assert run["budget_bytes"] == 1024 * 1024 and run["blocks_announced"] >= 2 * (1024 * 1024 // 163)
    assert 0 < run["entries"] <= run["entry_cap"] and run["forgotten"] > 0
    assert run["index_bytes_peak"] > 0 and run["peak_over_budget"] is not None
    assert run["store_used_growth_peak_over_budget"] > 0  # the whole store's growth, the streams' share in it
