"""Smoke run of bench.scale.index_budget at a tiny size: it starts a broker, announces past the
budget, prints its table and writes its JSON. No assertion on memory: at 1 MiB the broker's own
noise is as large as the budget (the recorded run is in bench/results/index_budget.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.run import run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_index_budget_tiny(tmp_path: Path) -> None:
    tiny = ["--quick", "--budgets", "1", "--factor", "3", "--no-reference", "--repetitions", "1"]
    proc = run_module("bench.scale.index_budget", *tiny, "--out-dir", str(tmp_path), timeout=100)
    assert proc.returncode == 0, f"failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "growth/budget" in proc.stdout and "target: RSS growth within 10% of the budget" in proc.stdout
    assert "index alone (in process)" in proc.stdout
    doc = json.loads((tmp_path / "index_budget-quick.json").read_text())
    assert doc["in_process"]["bounded"]["add_blocks_per_s"] > 0
    (run,) = doc["results"]
    assert run["budget_mib"] == 1 and run["blocks_announced"] >= 3 * run["entry_cap"]
    assert (
        0 < run["entries"] <= run["entry_cap"]
        and run["forgotten"] >= run["blocks_announced"] - run["entry_cap"]
    )
