"""scripts/gpu_check.sh and bench/data_path/gpu_check.py: the GPU check's dry run on DRAM, so it cannot rot.

The dry run goes through the same script a lent GPU machine runs: it installs
a carried wheel into a target folder, then two processes move real bytes with
real NIXL (UCX) through our BlockMover and CpuTierBuffer at both models' real
layouts, every byte is compared, and the CUDA tests run (and skip). Nothing
here asserts on speed: DRAM figures at these sizes mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.data_path.gpu_check import table, verdict_of
from bench.data_path.gpu_check_holder import Plan, seed_of
from bench.data_path.gpu_check_parts import CaseMemory, HistoryParts, Row, guarded
from bench.data_path.kv_layouts import MODELS, kv_caches
from kvbroker.engine_adapter.nixl_agent import nixl_available

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel, standing in for the carried ones."""
    folder.mkdir()
    path = folder / "gpucheck_probe-1.0-py3-none-any.whl"
    info = "gpucheck_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("gpucheck_probe.py", "CARRIED = True\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: gpucheck-probe\nVersion: 1.0\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(
            f"{info}/RECORD", f"gpucheck_probe.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n"
        )
    return path


def script(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ) | {"PYTHON": sys.executable} | env
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_dry_run_installs_the_carry_moves_real_bytes_and_writes_json(tmp_path: Path) -> None:
    probe_wheel(tmp_path / "wheels")
    site, out = tmp_path / "site", tmp_path / "out"
    env = {"KVBROKER_WHEELS": str(tmp_path / "wheels"), "KVBROKER_SITE": str(site), "OUT": str(out)}
    proc = script(["--quick", "--dram"], env, timeout=280)  # 15-30 s; minutes under heavy load
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (site / "gpucheck_probe.py").exists(), "the carried wheel was not installed into the target"
    assert "every byte identical" in proc.stdout and "DRAM dry run" in proc.stdout
    doc = json.loads((out / "gpu_check_dram.json").read_text())
    assert doc["settings"]["mem_type"] == "DRAM" and doc["exit_status"] == 0
    rows = doc["results"]
    transfers = [r for r in rows if r["part"] != "CUDA tests"]
    cases = {r["case"] for r in transfers}
    assert cases == {f"{m} {lay} 64" for m in MODELS for lay in ("cpu", "kv_split")}
    parts = {r["part"] for r in transfers}
    assert parts == {
        "CPU tier -> DRAM (local load)",
        "DRAM -> CPU tier (local store)",
        "DRAM -> DRAM (peer)",
        "CPU tier (peer) -> DRAM",
        "DRAM (peer) -> CPU tier",
    }
    for r in transfers:
        assert r["error"] is None, r
        assert r["bytes_ok"] is True and r["gbps"] > 0 and r["ref_gbps"] > 0, r
    (tests,) = [r for r in rows if r["part"] == "CUDA tests"]
    # Without CUDA the five CUDA tests skip cleanly; with it they pass.
    assert tests["extra"]["failed"] == 0 and tests["extra"]["passed"] + tests["extra"]["skipped"] == 5


def test_size_check_says_whether_the_carry_fits(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fits = script(["size"], {"KVBROKER_WHEELS": str(wheels)}, timeout=60)
    assert fits.returncode == 0 and "fits" in fits.stdout, fits.stdout + fits.stderr
    with open(wheels / "big.whl", "wb") as f:
        f.truncate(70 * 2**20)  # sparse: its size counts, its bytes are not written
    too_big = script(["size"], {"KVBROKER_WHEELS": str(wheels)}, timeout=60)
    assert too_big.returncode == 1 and "DOES NOT FIT" in too_big.stdout


def test_a_changed_byte_is_caught() -> None:
    plan = Plan(("tiny",), ("kv_split",), (64,), "cpu")
    shape, pool = MODELS["tiny"], plan.pool("tiny")
    want = kv_caches(shape, "kv_split", pool, seed_of("tiny", "kv_split"))
    kv = kv_caches(shape, "kv_split", pool, seed_of("tiny", "kv_split"))
    mem = CaseMemory("tiny", "kv_split", kv, want, None, 1, 2, {})
    parts = HistoryParts(SimpleNamespace(plan=plan, sync=lambda: None), mem, 64)
    assert parts._kv_is(parts.local)
    last = kv["model.layers.1.self_attn.attn"]
    last[1, parts.local[-1]].reshape(-1).view(torch.uint8)[-1] ^= 1  # V of the last block: its last byte
    assert not parts._kv_is(parts.local)


def test_exit_status_and_verdicts() -> None:
    good = Row("DRAM -> DRAM (peer)", "c", 1, "contiguous NIXL", 0.9, gbps=9.5, ref_gbps=10.0, bytes_ok=True)
    slow = Row("DRAM -> DRAM (peer)", "c", 1, "contiguous NIXL", 0.9, gbps=5.0, ref_gbps=10.0, bytes_ok=True)
    wrong = Row("CPU tier (peer) -> DRAM", "c", 1, "torch H2D", 0.8, gbps=9.0, ref_gbps=10.0, bytes_ok=False)
    broken = Row("DRAM (peer) -> CPU tier", "c", error="RuntimeError: peer gone")
    tests_failed = Row("CUDA tests", "t", extra={"passed": 4, "skipped": 0, "failed": 1})
    assert (good.verdict, slow.verdict, wrong.verdict, broken.verdict) == (
        "PASS",
        "FAIL",
        "WRONG BYTES",
        "ERROR",
    )
    assert verdict_of([good, slow], "cuda") == ("targets: 1 PASS, 1 FAIL; every byte identical", 0)
    assert verdict_of([good, broken], "cuda")[1] == 2
    line, status = verdict_of([good, wrong, broken], "cuda")
    assert status == 1 and "WRONG: CPU tier (peer) -> DRAM c" in line
    assert verdict_of([good, tests_failed], "cuda")[1] == 1


def test_a_failing_part_is_recorded_and_the_check_goes_on() -> None:
    def broken(row: Row) -> None:
        raise RuntimeError("peer gone")

    def fine(row: Row) -> None:
        row.bytes_ok, row.gbps, row.ref_gbps = True, 1.0, 1.0

    far, spent = time.monotonic() + 60, time.monotonic() - 1
    rows = [guarded(Row("a", "c"), broken, far), guarded(Row("b", "c"), fine, far)]
    assert rows[0].error == "RuntimeError: peer gone" and rows[0].verdict == "ERROR"
    assert rows[1].error is None and rows[1].verdict == "info"
    late = guarded(Row("c", "c"), fine, spent)
    assert late.error is not None and "budget" in late.error and late.gbps is None
    assert "RuntimeError: peer gone" in table(rows, "test")
