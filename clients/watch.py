"""A Watch that outlives its replica: heartbeats show a silent one, the next resumes the stream.

gRPC alone notices a frozen or cut-off replica only when a keepalive ping
times out (about 40 s): a stopped process's kernel keeps the connection open
and a blackholed link sends nothing. So the Watch asks the broker for a
``heartbeat`` whenever it had nothing else to send (``heartbeat_ms``), and a
stream that brought neither an event nor a heartbeat for ``silence_s`` is
given up: the next address becomes current and the Watch is opened there
with ``resume_after`` set to the cursor of the last event or heartbeat heard.
That replica gives back the events after it from the fleet's watch stream,
then live ones, so the caller sees every event once, in order, or an
``events_missed`` where some could not be given back. The same happens when
the replica's connection breaks (UNAVAILABLE) or it was killed.

Heartbeats are consumed here; the caller sees only events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
import grpc.aio

from kvbroker.clients import errors
from kvbroker.clients.endpoints import Endpoints
from kvbroker.common.watch import EVENTS_MISSED, HEARTBEAT
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc

log = logging.getLogger("kvbroker.clients")

DEFAULT_HEARTBEAT_S = 0.5
# Heartbeats that may go missing before the replica counts as gone: 2 s by default, well inside
# a session TTL, and wide enough for a loaded machine's scheduling delays (a move too many
# costs a reconnect, nothing else).
SILENT_BEATS = 4
# Failover codes: what a replica that is away, frozen or cut off answers.
MOVE_ON = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class _Client(Protocol):
    @property
    def endpoints(self) -> Endpoints[grpc.aio.Channel]: ...

    def stub_for(
        self, address: str | None = None
    ) -> tuple[broker_pb2_grpc.KVBrokerStub, grpc.aio.Channel]: ...


def backoff(rounds: int) -> float:
    """Seconds before another round over every replica."""
    return min(2.0, 0.1 * 2**rounds)


class WatchFollower:
    """One resumable Watch over a client's replicas; iterate ``events()``."""

    def __init__(
        self,
        client: _Client,
        request: pb.WatchRequest,
        *,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        silence_s: float | None = None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self._client = client
        self._request = request
        self._heartbeat_s = heartbeat_s
        self.silence_s = SILENT_BEATS * heartbeat_s if silence_s is None else silence_s
        self._metadata = metadata
        self.cursor = request.resume_after  # of the last event or heartbeat heard
        self.moves = 0  # how often the Watch went to another replica (or reconnected)
        self.connected = asyncio.Event()  # set at the first word of each stream, cleared when it moves

    def _opened(self, address: str) -> grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchEvent]:
        request = pb.WatchRequest()
        request.CopyFrom(self._request)
        request.heartbeat_ms = max(1, round(self._heartbeat_s * 1000))
        request.resume_after = self.cursor
        stub = self._client.stub_for(address)[0]
        return stub.Watch(request, metadata=self._metadata)

    async def events(self) -> AsyncIterator[pb.WatchEvent]:
        """Events (never heartbeats) until the caller stops, the broker ends the stream, or no
        replica answers for a few rounds (``errors.Unavailable``)."""
        endpoints = self._client.endpoints
        failures = 0
        heard = False  # anything came on some stream: a restart without a cursor may miss events
        while True:
            address = endpoints.current
            call = self._opened(address)
            why = ""
            try:
                while True:
                    try:
                        async with asyncio.timeout(self.silence_s):
                            event = await call.read()
                    except TimeoutError:
                        why = f"nothing heard for {self.silence_s:g} s"
                        break
                    if event is grpc.aio.EOF:
                        return
                    assert isinstance(event, pb.WatchEvent)
                    if failures and not event.cursor and heard and not self.cursor:
                        # Resumed with nothing to resume from (a broker without a shared store).
                        yield pb.WatchEvent(kind=EVENTS_MISSED, detail="the Watch reconnected")
                    failures, heard = 0, True
                    self.connected.set()
                    if event.cursor:
                        self.cursor = event.cursor
                    if event.kind != HEARTBEAT:
                        yield event
            except grpc.RpcError as err:
                if err.code() not in MOVE_ON:
                    raise errors.from_rpc_error(err) from None
                why = f"{err.code().name}: {err.details()}"
            finally:
                call.cancel()
            self.connected.clear()
            failures += 1
            if failures > 2 * len(endpoints):
                raise errors.Unavailable(f"no broker replica answered the Watch ({why})")
            endpoints.fail_over(address)
            self.moves += 1
            log.warning("Watch on %s given up (%s); resuming on %s", address, why, endpoints.current)
            await asyncio.sleep(endpoints.retry_delay(failures, backoff))
