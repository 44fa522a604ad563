"""Smoke test of bench/data_path.py at a tiny size: it runs, verifies bytes, writes its JSON.

Never asserts on speed: figures at this size mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbroker.engine_adapter.nixl_agent import nixl_available

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]


def test_bench_runs_and_writes_json(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "proto"), env.get("PYTHONPATH", "")])
    args = ["--sizes", "16,64", "--mib", "2", "--reps", "2", "--out-dir", str(tmp_path), "--name", "dp-smoke"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.data_path", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "adapter/raw" in proc.stdout
    doc = json.loads((tmp_path / "dp-smoke.json").read_text())
    assert [r["block_bytes"] for r in doc["results"]] == [16384, 65536]
    for row in doc["results"]:
        for method in ("adapter", "raw_nixl", "memcpy"):
            assert len(row[method]["samples_gbps"]) == 2 and row[method]["gbps_median"] > 0
        assert row["adapter_vs_raw"] > 0
    # Every GB/s figure was checked against memcpy of the same bytes, and passed.
    assert "Consistency checks (Little's law, cores, memcpy)" in proc.stdout
    assert doc["checks"] == {"invalid": [], "passed": True}
