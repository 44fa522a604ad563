"""The scheduler side's view of the broker: non-blocking calls and lease events.

``BrokerLink`` is what the scheduler uses; ``SessionBrokerLink`` implements it
on the client library's ThreadedEngineSession (a background thread with the
session stream). Every call returns at once with a Future: the vLLM scheduler
never waits on the broker. Lease-end notices arrive on the session thread and
are queued here until the scheduler's next step takes them.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from kvbroker.v1 import broker_pb2 as pb


@dataclass(frozen=True)
class LeaseEndNotice:
    lease_id: str
    cause: str  # "released", or the RevokeCause name


class BrokerLink(Protocol):
    @property
    def connected(self) -> bool: ...

    @property
    def layout_id(self) -> str: ...

    def resolve(
        self,
        namespace: pb.Namespace,
        hashes: list[int],
        *,
        acquire: bool,
        lease_ttl_ms: int,
        min_blocks: int,
        request_id: str,
    ) -> Future[pb.ResolveResponse]: ...

    def acquire(self, lease_id: str, ttl_ms: int) -> Future[pb.LeaseResponse]: ...

    def hold(
        self,
        namespace: pb.Namespace,
        hashes: list[int],
        block_ids: list[int],
        *,
        ttl_ms: int,
        request_id: str,
        reader_engine_id: str = "",
    ) -> Future[pb.Lease]: ...

    def release(self, lease_id: str, epoch: int) -> Future[pb.Lease]: ...

    def announce_stored(self, namespace: pb.Namespace, hashes: list[int]) -> None: ...

    def announce_removed(self, namespace: pb.Namespace, hashes: list[int]) -> None: ...

    def take_lease_ends(self) -> list[LeaseEndNotice]: ...

    def close(self) -> None: ...


class LeaseEndQueue:
    """Thread-safe hand-over of lease-end notices from the session thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: deque[LeaseEndNotice] = deque()

    def put(self, notice: LeaseEndNotice) -> None:
        with self._lock:
            self._items.append(notice)

    def take_all(self) -> list[LeaseEndNotice]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items


class SessionBrokerLink:
    """BrokerLink on clients.session.ThreadedEngineSession (the real broker)."""

    def __init__(
        self, address: str, engine: pb.EngineInfo, *, session_ttl_ms: int, expected_ranks: int
    ) -> None:
        from clients.session import ThreadedEngineSession

        self._ends = LeaseEndQueue()
        self._session = ThreadedEngineSession(
            address,
            engine,
            ttl_ms=session_ttl_ms,
            expected_ranks=expected_ranks,
            on_revoked=self._on_revoked,
            on_lease_ended=self._on_lease_ended,
            on_pin=self._on_pin,
        )
        self._session.start()

    @property
    def connected(self) -> bool:
        return self._session.connected

    @property
    def layout_id(self) -> str:
        return self._session.layout_id

    def resolve(
        self,
        namespace: pb.Namespace,
        hashes: list[int],
        *,
        acquire: bool,
        lease_ttl_ms: int,
        min_blocks: int,
        request_id: str,
    ) -> Future[pb.ResolveResponse]:
        return self._session.resolve_async(
            namespace,
            hashes,
            acquire=acquire,
            lease_ttl_ms=lease_ttl_ms,
            min_blocks=min_blocks,
            request_id=request_id,
        )

    def acquire(self, lease_id: str, ttl_ms: int) -> Future[pb.LeaseResponse]:
        return self._session.acquire(lease_id, ttl_ms)

    def hold(
        self,
        namespace: pb.Namespace,
        hashes: list[int],
        block_ids: list[int],
        *,
        ttl_ms: int,
        request_id: str,
        reader_engine_id: str = "",
    ) -> Future[pb.Lease]:
        return self._session.hold(
            namespace,
            pb.TIER_GPU,
            hashes,
            block_ids,
            ttl_ms,
            request_id=request_id,
            reader_engine_id=reader_engine_id,
        )

    def release(self, lease_id: str, epoch: int) -> Future[pb.Lease]:
        return self._session.release(lease_id, epoch)

    def announce_stored(self, namespace: pb.Namespace, hashes: list[int]) -> None:
        self._session.announce_stored(namespace, pb.TIER_GPU, hashes)

    def announce_removed(self, namespace: pb.Namespace, hashes: list[int]) -> None:
        self._session.announce_removed(namespace, pb.TIER_GPU, hashes)

    def take_lease_ends(self) -> list[LeaseEndNotice]:
        return self._ends.take_all()

    def close(self) -> None:
        self._session.close()

    # Session-thread callbacks: queue, never touch scheduler state here.
    def _on_revoked(self, message: pb.LeaseRevoked) -> None:
        self._ends.put(LeaseEndNotice(message.lease.lease_id, pb.RevokeCause.Name(message.cause)))

    def _on_lease_ended(self, message: pb.LeaseEnded) -> None:
        lease = message.lease
        cause = "released" if lease.state == pb.LEASE_RELEASED else pb.RevokeCause.Name(lease.cause)
        self._ends.put(LeaseEndNotice(lease.lease_id, cause))

    def _on_pin(self, command: pb.PinCommand) -> pb.PinResult:
        # This version offers only blocks it holds under a hold lease, which
        # need no pin; anything else is refused so the reader recomputes.
        return pb.PinResult(
            lease_id=command.lease.lease_id, ok=False, error="pinning unheld blocks is not supported"
        )
