"""The first-byte budget: how the proxy tells a hung engine from a busy one.

An engine that takes longer than the budget to send its first byte (a
prefill's answer, a non-streamed answer's headers, a stream's next chunk) is
checked. Its broker session is what the proxy trusts most: an engine the
broker no longer lists is not live; one the broker's fresh list still has is
live even when its ``/health`` is slow (a starved host keeps its session, see
the broker's starvation rules, but may miss a 2 s probe). Engines the broker
does not know are live when their ``/health`` answers within the probe timeout. A live engine keeps the request
(a long prompt or a long non-streamed answer legitimately takes longer than a
few seconds on a CPU) and is checked again after each further budget; an
engine that fails the check is abandoned, so the forwarder retries the step on
another engine. A frozen engine (SIGSTOP) is thus left at the first check
after the broker dropped its session (its TTL, 5 s by default), or after the
budget plus one probe when the broker does not know it, instead of after the
read timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvbroker.clients.proxy.config import EngineSpec
from kvbroker.clients.proxy.engines import EnginePool


class EngineHung(Exception):
    """No first byte within the budget, and the engine failed the liveness check."""

    def __init__(self, engine: EngineSpec, waited_s: float, why: str) -> None:
        super().__init__(f"no first byte within {waited_s:.1f} s and {why}")
        self.engine = engine
        self.waited_s = waited_s
        self.why = why


@dataclass
class Progress:
    """What a guarded step tells its guard: each chunk it read."""

    chunks: int = 0
    last: float = field(default_factory=time.monotonic)
    hung: EngineHung | None = None  # set when the guard gave up on the engine

    def tick(self) -> None:
        self.chunks += 1
        self.last = time.monotonic()


class FirstByteWatch:
    def __init__(
        self, http: aiohttp.ClientSession, pool: EnginePool, *, budget_s: float, probe_timeout_s: float
    ) -> None:
        self.http = http
        self.pool = pool
        self.budget_s = budget_s
        self.probe_timeout_s = probe_timeout_s

    async def why_not_live(self, engine: EngineSpec) -> str:
        """ "" when the engine looks live; otherwise what failed."""
        if self.pool.session_gone(engine):
            return "its broker session ended"
        why = await self._probe(engine)
        if why and self.pool.broker_vouches_for(engine):
            return ""  # slow, not dead: its session is live
        return why

    async def _probe(self, engine: EngineSpec) -> str:
        try:
            async with self.http.get(
                f"{engine.url}/health", timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)
            ) as resp:
                if resp.status == 200:
                    return ""
                return f"its /health answered HTTP {resp.status}"
        except TimeoutError:
            return f"its /health did not answer within {self.probe_timeout_s:.1f} s"
        except aiohttp.ClientError as e:
            return f"its /health failed: {type(e).__name__}: {e}"

    @contextlib.asynccontextmanager
    async def guard(self, engine: EngineSpec) -> AsyncIterator[Progress]:
        """Run a step (in the caller's task) under the budget; raises EngineHung when given up on.

        A task beside the step checks the engine after each budget without progress
        (the step calls `progress.tick()` for each chunk it reads); when the engine is
        not live, the step is cancelled at its next await, like a timeout, and
        EngineHung comes out of the `async with`. A task beside the step, not one per
        read: a read that runs at once keeps what the engine sent just before it died.
        A budget of 0 turns the guard off: the step runs under its own timeouts only.
        """
        progress = Progress()
        if self.budget_s <= 0:
            yield progress
            return
        try:
            async with asyncio.timeout(None) as deadline:
                checker = asyncio.ensure_future(self._check(engine, progress, deadline))
                try:
                    yield progress
                finally:
                    checker.cancel()
                    checker.add_done_callback(_consume)
        except TimeoutError:
            if progress.hung is not None:
                raise progress.hung from None
            raise

    async def _check(self, engine: EngineSpec, progress: Progress, deadline: asyncio.Timeout) -> None:
        while True:
            seen = progress.chunks
            await asyncio.sleep(self.budget_s)
            if progress.chunks != seen:
                continue
            why = await self.why_not_live(engine)
            if why and progress.chunks == seen:
                progress.hung = EngineHung(engine, time.monotonic() - progress.last, why)
                deadline.reschedule(asyncio.get_running_loop().time())  # cancel the step now
                return


def _consume(task: asyncio.Future[Any]) -> None:
    """Read a cancelled checker's outcome, so asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()
