"""What the fault-injection tests measure: callers that must be answered within their deadline,
and the service an engine session lost.

``Callers`` keeps a router's calls going against the fleet while a fault is on: an
asyncio client (``AsyncBrokerClient``) and a blocking one (``BrokerClient``, in a
thread), each naming every replica, each call with its own deadline. Every call
is recorded with how long it took and what came back (an answer, or the error's
code: UNAVAILABLE is an answer too); ``late()`` lists those that overran their
deadline by more than the scheduling slack.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

from kvbroker.clients import errors
from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.sync import BrokerClient
from kvbroker.v1 import broker_pb2 as pb

# A call may end this much after its deadline (timers and this busy machine's scheduling).
SLACK_S = 0.5


@dataclass(frozen=True)
class Call:
    client: str
    started: float
    took_s: float
    outcome: str  # "ok" or the error's code name


class Callers:
    """Resolve calls from an async and a sync router client, every ``interval_s``, until stopped."""

    def __init__(self, addresses: str, layout_id: str, hashes: list[int], deadline_s: float = 1.0) -> None:
        self.addresses = addresses
        self.request = pb.ResolveRequest(namespace=pb.Namespace(layout_id=layout_id), block_hashes=hashes)
        self.deadline_s = deadline_s
        self.calls: list[Call] = []
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    async def __aenter__(self) -> Callers:
        self._task = asyncio.ensure_future(self._run_async())
        self._thread = threading.Thread(target=self._run_sync, daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    def _record(self, client: str, started: float, outcome: str) -> None:
        self.calls.append(Call(client, started, time.monotonic() - started, outcome))

    async def _run_async(self) -> None:
        async with AsyncBrokerClient(self.addresses, timeout=self.deadline_s) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    await client.resolve(self.request)
                    self._record("aio", started, "ok")
                except errors.BrokerError as err:
                    self._record("aio", started, err.code.name)
                await asyncio.sleep(0.05)

    def _run_sync(self) -> None:
        with BrokerClient(self.addresses, timeout=self.deadline_s) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    client.resolve(self.request)
                    self._record("sync", started, "ok")
                except errors.BrokerError as err:
                    self._record("sync", started, err.code.name)
                self._stop.wait(0.05)

    def late(self) -> list[Call]:
        """Calls that ended more than SLACK_S after their deadline."""
        return [call for call in self.calls if call.took_s > self.deadline_s + SLACK_S]

    def answered_after(self, when: float) -> dict[str, int]:
        """Answers ("ok") per client among calls started after ``when``."""
        out = {"aio": 0, "sync": 0}
        for call in self.calls:
            if call.started >= when and call.outcome == "ok":
                out[call.client] += 1
        return out


def freeze(pid: int) -> float:
    """SIGSTOP process ``pid`` (a broker replica, a redis-server); the monotonic time it was sent."""
    os.kill(pid, signal.SIGSTOP)
    return time.monotonic()


def thaw(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
