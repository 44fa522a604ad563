"""Poll a condition until it holds or a deadline passes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> bool:
    """Whether `predicate()` came true within `timeout` seconds (checked once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


# What `until` waits by default: a condition that holds in milliseconds on a quiet machine may
# take seconds on a loaded 2-core CI host; a test that waits for something that never comes
# fails all the same, only later.
UNTIL_TIMEOUT_S = 20.0


async def until(
    predicate: Callable[[], Any | Awaitable[Any]],
    timeout: float = UNTIL_TIMEOUT_S,
    interval: float = 0.01,
    message: str = "condition not met in time",
) -> None:
    """Return once `predicate()` (a plain or an async function) is true; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(message)
        await asyncio.sleep(interval)
