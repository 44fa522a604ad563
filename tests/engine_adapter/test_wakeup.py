"""Waking vLLM's idle engine loop: the connector, built inside the engine core's
constructor, finds its input queue among the callers' frames. (With a real idle
engine: tests/e2e/test_gpu_inventory_e2e.py, where D pins while idle.)"""

from __future__ import annotations

import queue
from typing import Any

import pytest

from kvbroker.engine_adapter.wakeup import find_engine_wakeup

engine = pytest.importorskip("vllm.v1.engine")


class EngineCoreLike:
    """What vLLM's EngineCoreProc has when it builds the scheduler (and the connector)."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.wake = self._build_scheduler()

    def _build_scheduler(self) -> Any:
        return (lambda: find_engine_wakeup())()  # a few calls below, as in vLLM

    def _handle_client_request(self, request_type: Any, request: Any) -> None: ...


def test_the_wakeup_puts_vllms_wakeup_message_on_the_engine_cores_queue() -> None:
    core = EngineCoreLike()
    assert core.wake is not None
    core.wake()
    assert core.input_queue.get_nowait() == (engine.EngineCoreRequestType.WAKEUP, None)


def test_no_engine_core_on_the_stack_means_no_wakeup() -> None:
    assert find_engine_wakeup() is None
