"""The scheduler side's view of the broker: non-blocking calls and lease events.

``BrokerLink`` is what the scheduler uses; ``SessionBrokerLink`` implements it
on the client library's ThreadedEngineSession (a background thread with the
session stream). Every call returns at once with a Future: the vLLM scheduler
never waits on the broker. Lease-end notices arrive on the session thread and
are queued here until the scheduler's next step takes them. Hold replies and
lease ends ride the one session stream in the broker's order, and the session
thread settles a Hold's future (running its callbacks) before it reads the
next message, so a lease's end is never queued before its Hold's answer.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from kvbroker.v1 import broker_pb2 as pb

# Answers a PinCommand at once, or with a Future that another thread settles.
PinHandler = Callable[[pb.PinCommand], "pb.PinResult | Future[pb.PinResult]"]

if TYPE_CHECKING:
    from kvbroker.clients.credentials import ClientSecurity


@dataclass(frozen=True)
class LeaseEndNotice:
    lease_id: str
    cause: str  # "released", or the RevokeCause name
    # The request id of a lease this engine holds ("" otherwise): a holder whose Hold answer
    # was lost knows its hold by that alone.
    request_id: str = ""


@dataclass(frozen=True)
class NewGeneration:
    """The broker said `engine_id` registered anew as `generation` (SessionDown.engine_generation):
    the workers drop its agents loaded under an older generation and read it only under this
    one or later (engine_adapter/peer_agents.py). Travels to them in AdapterMetadata.generations."""

    engine_id: str
    generation: int


class BrokerLink(Protocol):
    @property
    def connected(self) -> bool: ...

    @property
    def layout_id(self) -> str: ...

    @property
    def session_id(self) -> str:
        """The broker session this engine registered last ("" before the first). It stays the same
        when a shared-state fleet resumes the session on another replica (leases kept), and
        changes when the engine had to register anew (the old session's leases ended with it)."""
        ...

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

    def mirror_resolve(self, namespace: pb.Namespace, hashes: list[int]) -> list[pb.HolderMatch] | None:
        """Holders named by the local index mirror, at once; None means "ask the broker"."""
        ...

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

    def release(self, lease_id: str, epoch: int, read: tuple[int, int] | None = None) -> Future[pb.Lease]:
        """Commit a read; ``read``: (blocks, bytes) this reader read under the lease, for the
        broker's per-pair counters (None: not said; the broker counts the whole lease)."""
        ...

    def decline(self, holder_engine_id: str, request_id: str, reason: str) -> Future[pb.DeclineResponse]:
        """This engine will not read that hold: the holder frees it now."""
        ...

    def announce_stored(
        self, namespace: pb.Namespace, hashes: list[int], tier: int = pb.TIER_GPU
    ) -> None: ...

    def announce_removed(
        self, namespace: pb.Namespace, hashes: list[int], tier: int = pb.TIER_GPU
    ) -> None: ...

    def give_up_pin(self, lease_id: str, reason: str) -> None:
        """The blocks pinned for `lease_id` (a retention) were given back to vLLM: the broker ends it."""
        ...

    def take_lease_ends(self) -> list[LeaseEndNotice]: ...

    def take_generations(self) -> list[NewGeneration]:
        """Engines the broker said registered anew (SessionDown.engine_generation) since the last take."""
        ...

    def set_load(self, load: float) -> None:
        """This engine's load figure (engine_adapter/own_load.py), for the broker's readers."""
        ...

    def set_event_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the session thread) after a lease-end notice or an engine's new
        generation is queued or the connection changes, so holds settle (and old agents go)
        while vLLM's scheduler is idle."""
        ...

    def set_pin_handlers(self, pin: PinHandler, unpin: Callable[[str], None]) -> None:
        """``pin`` answers at once, or with a Future the scheduler thread settles."""
        ...

    def close(self) -> None: ...


T = TypeVar("T")


class HandOver(Generic[T]):
    """Thread-safe hand-over of notices from the session thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: deque[T] = deque()

    def put(self, notice: T) -> None:
        with self._lock:
            self._items.append(notice)

    def take_all(self) -> list[T]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items


class SessionBrokerLink:
    """BrokerLink on clients.threaded_session.ThreadedEngineSession (the real broker)."""

    def __init__(
        self,
        address: str,
        engine: pb.EngineInfo,
        *,
        session_ttl_ms: int,
        expected_ranks: int,
        index_mirror: bool = False,
        resolve_timeout_s: float = 2.0,
        lease_call_timeout_s: float | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        from kvbroker.clients.threaded_session import ThreadedEngineSession

        self._ends: HandOver[LeaseEndNotice] = HandOver()
        self._generations: HandOver[NewGeneration] = HandOver()
        self._engine_id = engine.engine_id
        self._pin: PinHandler | None = None
        self._listener: Callable[[], None] | None = None
        self._unpin: Callable[[str], None] | None = None
        self._session = ThreadedEngineSession(
            address,
            engine,
            ttl_ms=session_ttl_ms,
            expected_ranks=expected_ranks,
            on_revoked=self._on_revoked,
            on_lease_ended=self._on_lease_ended,
            on_pin=self._on_pin,
            on_engine_generation=self._on_engine_generation,
            on_connected=lambda _registered: self._notify(),
            on_disconnected=lambda _error: self._notify(),
            mirror_index=index_mirror,
            # The scheduler keeps its own budgets (resolve_wait_ms, acquire_wait_ms);
            # the session must not give up on an answer before they run out.
            resolve_timeout_s=resolve_timeout_s,
            lease_call_timeout_s=lease_call_timeout_s,
            security=security,
        )
        self._session.start()

    @property
    def connected(self) -> bool:
        return self._session.connected

    @property
    def layout_id(self) -> str:
        return self._session.layout_id

    @property
    def session_id(self) -> str:
        return self._session.session_id

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

    def mirror_resolve(self, namespace: pb.Namespace, hashes: list[int]) -> list[pb.HolderMatch] | None:
        return self._session.mirror_resolve(namespace, hashes)

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

    def release(self, lease_id: str, epoch: int, read: tuple[int, int] | None = None) -> Future[pb.Lease]:
        return self._session.release(lease_id, epoch, read)

    def decline(self, holder_engine_id: str, request_id: str, reason: str) -> Future[pb.DeclineResponse]:
        return self._session.decline(holder_engine_id, request_id, reason)

    def announce_stored(self, namespace: pb.Namespace, hashes: list[int], tier: int = pb.TIER_GPU) -> None:
        self._session.announce_stored(namespace, tier, hashes)

    def announce_removed(self, namespace: pb.Namespace, hashes: list[int], tier: int = pb.TIER_GPU) -> None:
        self._session.announce_removed(namespace, tier, hashes)

    def give_up_pin(self, lease_id: str, reason: str) -> None:
        self._session.give_up_pin(lease_id, reason)

    def set_pin_handlers(self, pin: PinHandler, unpin: Callable[[str], None]) -> None:
        """Pins arrive on the session thread; a Future answer is sent when it settles."""
        self._pin, self._unpin = pin, unpin

    def take_lease_ends(self) -> list[LeaseEndNotice]:
        return self._ends.take_all()

    def take_generations(self) -> list[NewGeneration]:
        return self._generations.take_all()

    def set_load(self, load: float) -> None:
        self._session.set_load(load)  # sent early when it changed materially (EngineSession)

    def set_event_listener(self, listener: Callable[[], None]) -> None:
        self._listener = listener

    def _notify(self) -> None:
        if self._listener is not None:
            self._listener()

    def close(self) -> None:
        self._session.close()

    def _held_as(self, lease: pb.Lease) -> str:
        return lease.request_id if lease.holder_engine_id == self._engine_id else ""

    # Session-thread callbacks: queue, never touch scheduler state here.
    def _on_revoked(self, message: pb.LeaseRevoked) -> None:
        if self._unpin is not None:
            self._unpin(message.lease.lease_id)
        lease = message.lease
        self._ends.put(
            LeaseEndNotice(lease.lease_id, pb.RevokeCause.Name(message.cause), self._held_as(lease))
        )
        self._notify()

    def _on_lease_ended(self, message: pb.LeaseEnded) -> None:
        lease = message.lease
        if self._unpin is not None:
            self._unpin(lease.lease_id)
        cause = "released" if lease.state == pb.LEASE_RELEASED else pb.RevokeCause.Name(lease.cause)
        self._ends.put(LeaseEndNotice(lease.lease_id, cause, self._held_as(lease)))
        self._notify()

    def _on_engine_generation(self, message: pb.EngineGeneration) -> None:
        # The scheduler wakes an idle engine: its workers drop the old agent in that step.
        self._generations.put(NewGeneration(message.engine_id, message.generation))
        self._notify()

    def _on_pin(self, command: pb.PinCommand) -> pb.PinResult | Future[pb.PinResult]:
        if self._pin is not None:
            return self._pin(command)
        # Without a CPU tier this engine offers only blocks under a hold lease,
        # which need no pin; anything else is refused so the reader recomputes.
        return pb.PinResult(
            lease_id=command.lease.lease_id, ok=False, error="pinning unheld blocks is not supported"
        )
