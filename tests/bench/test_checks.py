"""The benchmarks' consistency checks (bench.harness.checks): a wrong timer or a wrong count
must be caught and reported as INVALID with a reason; correct figures must pass.

Fast and self-contained: no servers, no vLLM.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.control_plane.report import targets, targets_table
from bench.harness.checks import (
    bandwidth_reason,
    check_gbps,
    cores_reason,
    exit_code,
    is_invalid,
    little_law_reason,
    memcpy_gb_per_s,
    report_invalid,
    validate_results,
)
from bench.harness.loops import RunResult, aggregate, closed_loop_async, closed_loop_threads
from bench.harness.output import fmt_spread


def _run(clients: int, per_client: int, latency_s: float, wall_s: float) -> RunResult:
    return RunResult([latency_s] * (clients * per_client), wall_s, clients=clients)


def test_little_law_passes_a_consistent_run() -> None:
    # 16 clients x 80 ops of 23.7 us, run back to back: at least 80 x 23.7 us of wall time.
    r = _run(16, 80, 23.7e-6, 80 * 23.7e-6 * 1.02)
    assert r.invalid_reason() is None
    assert not is_invalid(aggregate([r]))


def test_little_law_catches_the_issue_figure() -> None:
    # The issue's row: 1,280 resolves of 23.7 us each "done" in 45.6 us -> 28M ops/s.
    r = _run(16, 80, 23.7e-6, 1280 / 28_089_271)
    why = r.invalid_reason()
    assert why is not None and "Little's law" in why
    fig = aggregate([_run(16, 80, 23.7e-6, 80 * 23.7e-6), r])
    assert is_invalid(fig)
    cell = fmt_spread(fig, "ops_per_s")
    assert cell.startswith("INVALID") and "Little's law" in cell
    # Latency cells stay plain: only the throughput is wrong.
    assert not fmt_spread(fig, "p50_us").startswith("INVALID")


def test_little_law_reason_edges() -> None:
    assert little_law_reason(float("nan"), 4, 1e-3) is None
    assert little_law_reason(0.0, 4, 1e-3) is None
    assert little_law_reason(4000.0, 4, 1e-3) is None  # exactly c / L
    assert little_law_reason(4300.0, 4, 1e-3) is None  # within the tolerance
    assert little_law_reason(5000.0, 4, 1e-3) is not None
    assert little_law_reason(100.0, 4, 0.0) is not None  # work that took no time


def test_cores_check() -> None:
    assert cores_reason(70_000, 16, 40_000, cores=2) is None
    assert cores_reason(28_089_271, 16, 40_466, cores=2) is not None
    assert cores_reason(200_000, 16, 40_000, cores=2) is not None
    assert cores_reason(200_000, 16, 40_000, cores=16) is None


def test_bandwidth_checks() -> None:
    bw = memcpy_gb_per_s(1 << 20)
    assert bw > 0
    assert bandwidth_reason(bw, bw) is None
    assert bandwidth_reason(bw * 10, bw) is not None
    fig: dict[str, Any] = {"gbps_median": bw / 2, "samples_gbps": [bw / 2, bw * 10]}
    lines = check_gbps(fig, 1 << 20, "1024 KiB adapter")
    assert lines and is_invalid(fig) and "memcpy" in lines[0]
    assert check_gbps({"gbps_median": bw / 2, "samples_gbps": [bw / 2]}, 1 << 20, "ok") == []


def _figure(rate_runs: list[float], clients: int, mean_us: float, in_process: bool = True) -> dict[str, Any]:
    runs = [RunResult([mean_us * 1e-6] * 10, 10 / v, clients=clients) for v in rate_runs]
    return aggregate(runs, in_process=in_process)


def test_validate_results_cores_and_memcpy() -> None:
    # 16 threads at 3x the 1-client rate in one process on 2 cores: impossible,
    # even though each run alone satisfies Little's law (16 / 20 us = 800k ops/s).
    results = {
        "broker": {
            "available": True,
            "resolve_mirror": {
                "c1": _figure([40_000, 41_000], 1, 24.0),
                "c16": _figure([120_000, 130_000], 16, 20.0),
            },
            "inventory": {
                "c1": {"blocks_per_s": {"median": 1e12, "min": 1e12, "max": 1e12}, "bytes_per_block": 8}
            },
        }
    }
    lines = validate_results(results, memcpy=10.0)
    assert any("resolve_mirror.c16" in x and "core" in x for x in lines), lines
    assert any("inventory.c1" in x and "memcpy" in x for x in lines), lines
    assert not is_invalid(results["broker"]["resolve_mirror"]["c1"])
    assert exit_code(lines) != 0
    assert report_invalid(lines).startswith("INVALID")
    assert exit_code([]) == 0
    assert "passed" in report_invalid([])


def test_cores_check_uses_the_one_client_latency_when_its_rate_was_slowed() -> None:
    # A busy machine paused the 1-client run (9k ops/s measured) although each resolve
    # took 22 us: 4 threads at 28k ops/s on 2 cores is possible (2 / 22 us = 90k).
    slow_one = aggregate([RunResult([22e-6] * 30, 30 / 9_000, clients=1)], in_process=True)
    four = aggregate([RunResult([100e-6] * 20, 20 / 28_000, clients=4)], in_process=True)
    results = {"resolve_mirror": {"c1": slow_one, "c4": four}}
    assert validate_results(results, memcpy=10.0) == []


def test_targets_from_an_invalid_figure_say_invalid_never_met() -> None:
    good_peer = aggregate([_run(16, 80, 2e-3, 80 * 2e-3)])
    bogus = aggregate([_run(16, 80, 23.7e-6, 1280 / 28_089_271)], in_process=True)
    one = aggregate([_run(1, 600, 24e-6, 600 * 24e-6)], in_process=True)
    results = {
        "broker": {"available": True, "resolve_mirror": {"c1": one, "c16": bogus}},
        "mooncake": {"available": True, "batch_is_exist": {"c1": good_peer, "c16": good_peer}},
    }
    validate_results(results, memcpy=10.0)
    rows = {t["target"]: t for t in targets(results, hi_c=16)}
    thr = rows["resolves/s (engine-local mirror) with 16 clients >= Mooncake's"]
    assert thr["met"] is None and thr["verdict"] == "invalid" and thr["invalid"]
    assert rows["resolve p50 (engine-local mirror) <= Mooncake batch_is_exist p50"]["met"] is True
    table = targets_table(list(rows.values()))
    line = next(x for x in table.splitlines() if x.startswith("resolves/s (engine-local"))
    assert "invalid (" in line and " met" not in line


def _late_clock_loop(ops_per_client: int, clients: int, op: Any) -> RunResult:
    """The threaded loop as it was before the fix: the caller reads the clock after
    the barrier, and here it is deliberately late (as it was when the clients held the
    GIL), so the clients finish before the clock starts."""
    barrier = threading.Barrier(clients + 1)
    lat: list[float] = []

    def client() -> None:
        barrier.wait()
        for i in range(ops_per_client):
            t = time.perf_counter()
            op(i)
            lat.append(time.perf_counter() - t)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    time.sleep(ops_per_client * 0.002)  # the late read: every client is done by now
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return RunResult(lat, time.perf_counter() - t0, clients=clients)


def test_a_late_clock_is_caught() -> None:
    bad = _late_clock_loop(20, 4, lambda _: time.sleep(0.0005))
    why = bad.invalid_reason()
    assert why is not None and "Little's law" in why, (bad.ops_per_s(), bad.mean_latency_s())
    assert is_invalid(aggregate([bad]))


def test_the_threaded_loop_counts_all_work() -> None:
    """The fixed loop: wall time covers every client's measured operations."""
    lock = threading.Lock()

    def op(_: int) -> int:
        with lock:  # in-process, serialised work like IndexMirror.resolve
            return sum(range(300))

    for _ in range(5):
        r = closed_loop_threads([op] * 16, 40, 5, server_pid=None)
        assert r.invalid_reason() is None, (r.ops_per_s(), r.mean_latency_s())
        # Serialised work: 16 clients cannot beat the sum of their latencies / 16 by much.
        assert r.wall_s >= sum(r.latencies_s) / 16 * 0.9


def test_the_async_loop_counts_all_work() -> None:
    import asyncio

    async def op(_: int) -> None:
        await asyncio.sleep(0.0005)

    r = asyncio.run(closed_loop_async([op] * 8, 20, 2))
    assert r.clients == 8
    assert r.invalid_reason() is None
    assert r.wall_s >= 20 * 0.0005
