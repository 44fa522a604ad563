"""The blocking client's Watch that outlives its replica (``BrokerClient.watch`` with several
addresses): the same rule as ``kvbroker.clients.watch`` (heartbeats asked for, a stream silent for
``silence_s`` left for the next address, resumed there after the last cursor heard), with a
watchdog thread in place of the event loop's timeout: it cancels a silent stream's call. Time the
caller spends between two events is not counted as silence.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Protocol

import grpc

from kvbroker.clients import errors
from kvbroker.clients.endpoints import Endpoints
from kvbroker.clients.watch import DEFAULT_HEARTBEAT_S, MOVE_ON, SILENT_BEATS, backoff
from kvbroker.common.watch import EVENTS_MISSED, HEARTBEAT
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc

log = logging.getLogger("kvbroker.clients")


class _Client(Protocol):
    @property
    def endpoints(self) -> Endpoints[grpc.Channel]: ...

    def stub_for(self, address: str | None = None) -> tuple[broker_pb2_grpc.KVBrokerStub, grpc.Channel]: ...


class _Watchdog:
    """Cancels `call` once nothing was heard for `silence_s` (not counting paused time)."""

    def __init__(self, call: grpc.Future, silence_s: float) -> None:
        self._call = call
        self._silence_s = silence_s
        self._last = time.monotonic()
        self.paused = False
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbroker-watch-watchdog", daemon=True)
        self._thread.start()

    def heard(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        while not self._done.wait(min(0.1, self._silence_s / 4)):
            if self.paused:
                self._last = time.monotonic()
            elif time.monotonic() - self._last > self._silence_s:
                self.fired = True
                self._call.cancel()
                return

    def stop(self) -> None:
        self._done.set()


class BlockingWatchFollower:
    """One resumable Watch over a blocking client's replicas; iterate ``events()``."""

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
        self.cursor = request.resume_after
        self.moves = 0
        self.connected = threading.Event()  # set at the first word of each stream, cleared when it moves

    def events(self) -> Iterator[pb.WatchEvent]:
        """Events (never heartbeats) until the caller stops, the broker ends the stream, or no
        replica answers for a few rounds (``errors.Unavailable``)."""
        endpoints = self._client.endpoints
        failures, heard = 0, False
        while True:
            address = endpoints.current
            request = pb.WatchRequest()
            request.CopyFrom(self._request)
            request.heartbeat_ms = max(1, round(self._heartbeat_s * 1000))
            request.resume_after = self.cursor
            call = self._client.stub_for(address)[0].Watch(request, metadata=self._metadata)
            dog = _Watchdog(call, self.silence_s)
            why = ""
            try:
                for event in call:
                    dog.heard()
                    if failures and not event.cursor and heard and not self.cursor:
                        yield pb.WatchEvent(kind=EVENTS_MISSED, detail="the Watch reconnected")
                    failures, heard = 0, True
                    self.connected.set()
                    if event.cursor:
                        self.cursor = event.cursor
                    if event.kind != HEARTBEAT:
                        dog.paused = True  # the caller's time with the event is not silence
                        yield event
                        dog.paused = False
                        dog.heard()
                return
            except grpc.RpcError as err:
                code = err.code()  # type: ignore[attr-defined]
                if dog.fired:
                    why = f"nothing heard for {self.silence_s:g} s"
                elif code in MOVE_ON:
                    why = f"{code.name}: {err.details()}"  # type: ignore[attr-defined]
                else:
                    raise errors.from_rpc_error(err) from None
            finally:
                dog.stop()
                call.cancel()
            self.connected.clear()
            failures += 1
            if failures > 2 * len(endpoints):
                raise errors.Unavailable(f"no broker replica answered the Watch ({why})")
            endpoints.fail_over(address)
            self.moves += 1
            log.warning("Watch on %s given up (%s); resuming on %s", address, why, endpoints.current)
            time.sleep(endpoints.retry_delay(failures, backoff))
