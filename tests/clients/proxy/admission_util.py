"""What the admission tests share: a clock the test moves, streamed answers at a pace, and
letting the event loop run the waiters that a change let in."""

from __future__ import annotations

import asyncio

from kvbroker.clients.proxy.admission import Admission


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def answers(adm: Admission, seconds: float, n: int) -> None:
    """`n` streamed answers at `seconds` a token, as the proxy reports them."""
    for _ in range(n):
        adm.observed_tpot(seconds)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)
