"""Fixtures for the process-level tests: a real `kvbroker serve` (testkit.processes) and
engine client processes (process_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from process_harness import EngineProcess, child_env

from testkit.processes import SERVE, BrokerProcess


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[BrokerProcess]:
    # `kvbroker serve` as a user runs it: default log level and priority.
    broker = BrokerProcess(
        tmp_path,
        ["--session-ttl-min-ms", "100", "--expiry-interval-ms", "20"],
        command=SERVE,
        log_level=None,
        priority=None,
        env=child_env(),
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def engine_processes() -> Iterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    yield started
    for engine in started:
        engine.close()
