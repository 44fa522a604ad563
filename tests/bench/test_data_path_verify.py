"""Smoke test of bench/data_path/verify.py at a tiny size: it runs, every verified pull checks
all its blocks (the benchmark raises otherwise), and it writes its JSON. Never asserts on speed.

With 16 KiB groups the verified pulls take the overlapped path (groups read and digested as they
land) over real NIXL between two processes; the "after" pulls check after one whole read, the
"sampled" ones a share of each block's layers (verify_sample), each reporting every block checked."""

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


def test_verify_bench_runs_and_writes_json(tmp_path: Path) -> None:
    args = ["--models", "tiny", "--layouts", "cpu,kv_split", "--histories", "256", "--reps", "2"]
    args += ["--min-group-kb", "16"]
    args += ["--out-dir", str(tmp_path), "--name", "vb-smoke"]
    proc = run_module("bench.data_path.verify", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reader extra" in proc.stdout
    doc = json.loads((tmp_path / "vb-smoke.json").read_text())
    assert [(r["layout"], r["blocks"]) for r in doc["results"]] == [("cpu", 8), ("kv_split", 8)]
    for row in doc["results"]:
        assert len(row["samples_ms"]["plain"]) == len(row["samples_ms"]["verified"]) == 2
        assert len(row["samples_ms"]["after"]) == 2 and row["after_ms"] > 0
        assert row["groups"] == 4, "8 blocks of 16 KiB: halves down to 16 KiB groups (4, 2, 1, 1)"
        assert all(c > 0 for c in row["cores_for_two_threads"]), "below 1.0 on a loaded machine"
        assert row["plain_ms"] > 0 and row["verified_ms"] > 0 and row["holder_state_ms"] > 0
        assert row["check_ms"] > 0 and row["one_pass_ms"] > 0
        assert len(row["samples_ms"]["sampled"]) == 2 and row["sampled_ms"] > 0
    assert doc["settings"]["sample"] == 0.0625 and "verdict" in doc["target"]["sampled"]
    assert doc["target"]["per_model"] == {}, "no history at the target size (2,048 tokens) here"
