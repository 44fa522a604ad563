"""Smoke test of bench/data_path/verify.py at a tiny size: it runs, every verified pull checks
all its blocks (the benchmark raises otherwise), and it writes its JSON. Never asserts on speed."""

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


def test_verify_bench_runs_and_writes_json(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    args = ["--models", "tiny", "--layouts", "cpu,kv_split", "--histories", "256", "--reps", "2"]
    args += ["--out-dir", str(tmp_path), "--name", "vb-smoke"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.data_path.verify", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reader extra" in proc.stdout
    doc = json.loads((tmp_path / "vb-smoke.json").read_text())
    assert [(r["layout"], r["blocks"]) for r in doc["results"]] == [("cpu", 8), ("kv_split", 8)]
    for row in doc["results"]:
        assert len(row["samples_ms"]["plain"]) == len(row["samples_ms"]["verified"]) == 2
        assert row["plain_ms"] > 0 and row["verified_ms"] > 0 and row["holder_state_ms"] > 0
        assert row["check_ms"] > 0
