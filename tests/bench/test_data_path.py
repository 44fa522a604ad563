"""Smoke test of bench/data_path/reads.py at a tiny size: it runs, verifies bytes, writes its JSON.

Never asserts on speed: figures at this size mean nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbroker.engine_adapter.nixl_agent import nixl_available
from tests.bench.run import run_module

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]


def test_bench_runs_and_writes_json(tmp_path: Path) -> None:
    args = ["--models", "tiny", "--layouts", "cpu,blhnc", "--histories", "256", "--reps", "2"]
    args += ["--out-dir", str(tmp_path), "--name", "dp-smoke"]
    proc = run_module("bench.data_path.reads", *args, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ad/contig" in proc.stdout
    doc = json.loads((tmp_path / "dp-smoke.json").read_text())
    cases = [(r["layout"], r["pattern"], r["history_tokens"]) for r in doc["results"]]
    assert cases == [(lay, pat, 256) for lay in ("cpu", "blhnc") for pat in ("runs", "scattered")]
    for row in doc["results"]:
        # One allocation per side holds the whole history in these layouts: the read inside the
        # KV caches is measured too, and the target is judged against it.
        for method in ("adapter", "raw_nixl", "contiguous", "contiguous_kv", "memcpy"):
            assert len(row[method]["samples_gbps"]) == 2 and row[method]["gbps_median"] > 0
        assert row["adapter_vs_contiguous"] > 0 and row["bytes"] == 8 * 32 * 1024
        assert row["adapter_vs_contiguous_kv"] > 0
        assert row["descriptors_adapter"] <= row["descriptors_per_block_and_region"]
    runs = {r["layout"]: r["descriptors_adapter"] for r in doc["results"] if r["pattern"] == "runs"}
    assert runs == {"cpu": 2, "blhnc": 1}  # one per layer; block-outermost: one for the whole history
    # Every GB/s figure was checked against memcpy of the same bytes, and passed.
    assert "Consistency checks (Little's law, cores, memcpy)" in proc.stdout
    assert doc["checks"] == {"invalid": [], "passed": True}
