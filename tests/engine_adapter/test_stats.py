"""The stats file: written off vLLM's scheduler thread, promptly, at a bounded rate, and on shutdown."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.scheduler import AdapterScheduler
from kvbroker.engine_adapter.stats import StatsWriter
from testkit.clock import FakeClock
from testkit.engines import read_stats
from testkit.waiting import wait_for
from tests.engine_adapter.fakes import FakeLink, FakeRequest

BS = 32


def eventually(predicate: Any) -> bool:
    return wait_for(predicate, timeout=5.0, interval=0.005)


def make(path: Path) -> AdapterScheduler:
    config = AdapterConfig(engine_id="reader", stats_path=str(path))
    return AdapterScheduler(config=config, link=FakeLink(), block_size=BS, clock=FakeClock())


def test_the_scheduler_thread_never_writes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writers: list[str] = []
    original = StatsWriter._write

    def recording(self: StatsWriter, snapshot: dict[str, Any]) -> None:
        writers.append(threading.current_thread().name)
        original(self, snapshot)

    monkeypatch.setattr(StatsWriter, "_write", recording)
    path = tmp_path / "stats.json"
    sched = make(path)
    sched.get_num_new_matched_tokens(FakeRequest("r1", num_tokens=20), 0)  # shorter than a block
    sched.get_num_new_matched_tokens(FakeRequest("r2", num_tokens=140, kv_transfer_params=[1]), 0)
    sched.build_connector_meta()
    assert eventually(lambda: read_stats(path).get("skips") == {"malformed_kv_transfer_params": 1})
    snapshot = read_stats(path)
    assert snapshot["held_requests"] == 0 and snapshot["held_blocks"] == 0
    assert writers and threading.current_thread().name not in writers
    sched.shutdown()


def test_a_change_after_a_quiet_spell_is_written_at_once(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    sched = make(path)
    sched.build_connector_meta()
    assert eventually(lambda: path.exists())
    time.sleep(0.3)  # longer than the write interval: quiet
    sched.get_num_new_matched_tokens(FakeRequest("r1", num_tokens=140, kv_transfer_params=[1]), 0)
    started = time.monotonic()
    sched.build_connector_meta()
    assert eventually(lambda: read_stats(path).get("skips", {}).get("malformed_kv_transfer_params") == 1)
    # Not held back by the interval (generous bound: this machine is shared).
    assert time.monotonic() - started < 2.0
    sched.shutdown()


def test_a_burst_is_written_at_most_once_per_interval_the_latest_winning(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    writer = StatsWriter(str(path), min_interval_s=30.0)
    writer.submit({"n": 1})
    assert eventually(lambda: read_stats(path) == {"n": 1})
    for n in range(2, 50):
        writer.submit({"n": n})
    time.sleep(0.3)
    assert read_stats(path) == {"n": 1}  # within the interval: not written yet
    writer.close()  # shutdown writes what is pending at once
    assert read_stats(path) == {"n": 49}
    writer.submit({"n": 50})  # after close: ignored
    time.sleep(0.05)
    assert read_stats(path) == {"n": 49}


def test_shutdown_writes_the_final_counts(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    sched = make(path)
    sched.build_connector_meta()
    assert eventually(lambda: path.exists())
    # A change that no hook publishes before shutdown is still in the file afterwards.
    sched.stats.count("pulls_failed")
    sched.shutdown()
    assert read_stats(path)["pulls_failed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]  # no temporary file left


def test_an_unwritable_path_is_logged_and_the_writer_keeps_going(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "missing-dir" / "stats.json"
    writer = StatsWriter(str(path), min_interval_s=0.0)
    with caplog.at_level("WARNING", logger="vllm.kvbroker.scheduler"):
        writer.submit({"n": 1})
        assert eventually(lambda: "cannot write stats" in caplog.text)
    path.parent.mkdir()
    writer.submit({"n": 2})
    assert eventually(lambda: read_stats(path) == {"n": 2})
    writer.close()


def test_a_restarted_engine_replaces_the_previous_runs_file_at_start(tmp_path: Path) -> None:
    """The file a dead engine left (its counters) is reset when the connector starts, not at the
    first request: a reader never takes the old run's counts for the new engine's."""
    path = tmp_path / "stats.json"
    path.write_text('{"pulled_blocks": 41, "skips": {"no_hold": 3}, "held_requests": 2}')
    sched = make(path)  # no request, no scheduler step
    assert eventually(lambda: "pulled_blocks" not in read_stats(path))
    snapshot = read_stats(path)
    assert snapshot["skips"] == {} and snapshot["held_requests"] == 0 and snapshot["held_blocks"] == 0
    sched.shutdown()
