"""Fixtures for the process-level tests (the processes themselves: process_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from process_harness import BrokerProcess, EngineProcess, free_port


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(
        free_port(), tmp_path / "broker.log", "--session-ttl-min-ms", "100", "--expiry-interval-ms", "20"
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
