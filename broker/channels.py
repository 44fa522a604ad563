"""The transport side of the Notifier: per-session outbound queues, pin waiters, watchers.

Core calls arrive synchronously; each becomes a SessionDown message on the
session's asyncio queue (written to the stream by that session's writer) or a
WatchEvent on each interested watcher's bounded queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvbroker.broker import codec
from kvbroker.broker.clock import Clock
from kvbroker.broker.events import Notifier, WatchEvent
from kvbroker.broker.leases import Lease
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.causes import Cause
from kvbroker.v1 import broker_pb2 as pb

PinWaiter = Callable[[Lease], None]


@dataclass(slots=True, frozen=True)
class Close:
    """Queue sentinel: write a SessionError with this code, then end the stream."""

    code: str
    message: str
    cause: Cause | None = None


# The core ends a session for exactly these reasons, one status code each
# (BrokerCore.register: a new session of the same engine id; BrokerCore.expire:
# no heartbeat within the TTL); the server's shutdown names its own cause.
SESSION_END_CAUSES: dict[str, Cause] = {
    "ABORTED": Cause.SESSION_SUPERSEDED,
    "DEADLINE_EXCEEDED": Cause.SESSION_EXPIRED,
}


@dataclass(slots=True)
class SessionChannel:
    """A session's outbound queue, bounded in bytes: an engine that sends commands but does
    not read the answers is ended (RESOURCE_EXHAUSTED) instead of growing the broker."""

    session_id: str
    queue: asyncio.Queue[pb.SessionDown | Close] = field(default_factory=asyncio.Queue)
    closed: Close | None = None
    max_bytes: int = 64 * 1024 * 1024
    pending_bytes: int = 0
    record: EngineRecord | None = None  # the session's engine (a fleet's drain notice marks it)
    # Register.lease_ends_on_answers: the engine reads lease ends attached to answers. Ends held
    # back (a fleet replica's, taken from the store with a hold: broker/fleet/notify.py) ride on
    # the next lease answer then; otherwise, or with no answer in this step, each goes on its own.
    ends_on_answers: bool = False
    held_ends: list[pb.LeaseEnded] = field(default_factory=list)

    def hold_ends(self, ends: list[pb.LeaseEnded]) -> None:
        """Send `ends` with the answer put in this step (`put_answer`), else on their own."""
        if not self.held_ends:
            try:
                asyncio.get_running_loop().call_soon(self.flush_ends)
            except RuntimeError:  # no loop (a synchronous caller): nothing will answer in this step
                self.held_ends.extend(ends)
                self.flush_ends()
                return
        self.held_ends.extend(ends)

    def flush_ends(self) -> None:
        ends, self.held_ends = self.held_ends, []
        for ended in ends:
            self.put(pb.SessionDown(lease_ended=ended))

    def put_answer(self, reply: pb.SessionDown) -> None:
        """A lease command's answer, with the ends held back before it."""
        if self.held_ends:
            if self.ends_on_answers:
                reply.lease_ends.extend(self.held_ends)
                self.held_ends = []
            else:
                self.flush_ends()
        self.put(reply)

    def put(self, msg: pb.SessionDown) -> None:
        if self.closed is not None:
            return
        size = msg.ByteSize()
        if self.pending_bytes + size > self.max_bytes:
            self.closed = Close(
                "RESOURCE_EXHAUSTED",
                f"the session's answers waiting to be read passed {self.max_bytes} bytes "
                "(--session-buffer-bytes): read the stream",
                Cause.LIMIT_REACHED,
            )
            self.queue.put_nowait(self.closed)
            return
        self.pending_bytes += size
        self.queue.put_nowait(msg)

    def taken(self, item: pb.SessionDown | Close) -> None:
        """The stream's writer took `item` off the queue."""
        if isinstance(item, pb.SessionDown):
            self.pending_bytes -= item.ByteSize()


@dataclass(slots=True, eq=False)  # identity-hashed: kept in a set
class Watcher:
    """One Watch stream's queue, bounded in events and in bytes (a lease event carries its hashes)."""

    categories: frozenset[str]
    queue: asyncio.Queue[pb.WatchEvent | Close]
    max_bytes: int = 16 * 1024 * 1024
    pending_bytes: int = 0
    overflowed: bool = False

    def taken(self, item: pb.WatchEvent | Close) -> None:
        """The stream's writer took `item` off the queue."""
        if isinstance(item, pb.WatchEvent):
            self.pending_bytes -= item.ByteSize()


class SessionNotifier(Notifier, Protocol):
    """The Notifier the servicer's streams attach to (one test body runs over every implementation:
    tests/broker/test_notifier_contract.py)."""

    def attach(
        self, session_id: str, max_bytes: int = 64 * 1024 * 1024, record: EngineRecord | None = None
    ) -> SessionChannel:
        """The session's outbound queue, from now until `detach`."""
        ...

    def detach(self, session_id: str, channel: SessionChannel | None = None) -> bool:
        """Stop sending to the session (given `channel`: only while it is still the session's);
        whether it was detached. False: a newer stream of the same session took over here."""
        ...

    def close_session(self, session_id: str, code: str, message: str, cause: Cause | None = None) -> None: ...

    def close_all(self, code: str, message: str, cause: Cause | None = None) -> None:
        """End every session stream and Watch (the broker shuts down)."""
        ...

    def wait_pin(self, lease_id: str, waiter: PinWaiter) -> None:
        """Call `waiter` once the PENDING lease settles (pin_settled)."""
        ...

    def add_watcher(self, categories: frozenset[str], max_bytes: int = 16 * 1024 * 1024) -> Watcher: ...

    def remove_watcher(self, watcher: Watcher) -> None: ...

    def watcher_count(self) -> int: ...

    def watch_position(self) -> str:
        """The cursor a Watch heartbeat carries: every event before it was handed to the watchers
        registered then ("" where events have no cursor)."""
        ...

    def watch_since(self, after: str, categories: frozenset[str]) -> tuple[list[pb.WatchEvent], bool]:
        """The events of `categories` after cursor `after`, and whether they are all of them."""
        ...


def revoked_down(lease: Lease, now: float) -> pb.SessionDown:
    """To a reader: its lease ended without a committed read."""
    return pb.SessionDown(
        revoked=pb.LeaseRevoked(
            lease=codec.lease_pb(lease, now),
            cause=int(lease.cause),  # type: ignore[arg-type]
            detail=lease.detail,
        )
    )


def ended_down(lease: Lease, now: float) -> pb.SessionDown:
    """To a holder: a lease on its blocks ended."""
    return pb.SessionDown(lease_ended=pb.LeaseEnded(lease=codec.lease_pb(lease, now)))


def generation_down(engine_id: str, generation: int) -> pb.SessionDown:
    """To a possible reader: `engine_id` registered anew as `generation`; drop older agents of it."""
    return pb.SessionDown(engine_generation=pb.EngineGeneration(engine_id=engine_id, generation=generation))


class StreamNotifier:
    """The in-memory SessionNotifier: every session's stream is on this broker."""

    def __init__(self, clock: Clock, watch_queue: int = 10_000) -> None:
        self._clock = clock
        self._channels: dict[str, SessionChannel] = {}
        self._pin_waiters: dict[str, list[PinWaiter]] = {}
        self._watchers: set[Watcher] = set()
        self._watching: dict[str, int] = {}
        self._watch_queue = watch_queue

    # -- sessions ---------------------------------------------------------------

    def attach(
        self, session_id: str, max_bytes: int = 64 * 1024 * 1024, record: EngineRecord | None = None
    ) -> SessionChannel:
        channel = SessionChannel(session_id, max_bytes=max_bytes, record=record)
        self._channels[session_id] = channel
        return channel

    def detach(self, session_id: str, channel: SessionChannel | None = None) -> bool:
        if channel is not None and self._channels.get(session_id) is not channel:
            return False
        self._channels.pop(session_id, None)
        return True

    def _send(self, session_id: str, msg: pb.SessionDown) -> None:
        channel = self._channels.get(session_id)
        if channel is not None:
            channel.put(msg)

    def lease_revoked(self, session_id: str, lease: Lease) -> None:
        self._send(session_id, revoked_down(lease, self._clock.now()))

    def lease_ended(self, session_id: str, lease: Lease) -> None:
        self._send(session_id, ended_down(lease, self._clock.now()))

    def pin(self, session_id: str, lease: Lease) -> None:
        self._send(
            session_id, pb.SessionDown(pin=pb.PinCommand(lease=codec.lease_pb(lease, self._clock.now())))
        )

    def drain(self, session_id: str, reason: str) -> None:
        self._send(session_id, pb.SessionDown(drain=pb.DrainCommand(reason=reason)))

    def engine_generation(self, engine_id: str, generation: int, layout_id: str) -> None:
        msg = generation_down(engine_id, generation)
        for channel in self._channels.values():
            rec = channel.record
            # Only engines of the layout can have loaded its agents; never the engine itself.
            if rec is None or (rec.layout_id == layout_id and rec.engine_id != engine_id):
                channel.put(msg)

    def close_session(self, session_id: str, code: str, message: str, cause: Cause | None = None) -> None:
        channel = self._channels.get(session_id)
        if channel is not None and channel.closed is None:
            channel.closed = Close(code, message, cause or SESSION_END_CAUSES.get(code))
            channel.queue.put_nowait(channel.closed)

    def close_all(self, code: str, message: str, cause: Cause | None = None) -> None:
        for session_id in list(self._channels):
            self.close_session(session_id, code, message, cause)
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(Close(code, message, cause))

    # -- pins ------------------------------------------------------------------

    def wait_pin(self, lease_id: str, waiter: PinWaiter) -> None:
        self._pin_waiters.setdefault(lease_id, []).append(waiter)

    def pin_settled(self, lease: Lease) -> None:
        for waiter in self._pin_waiters.pop(lease.lease_id, ()):
            waiter(lease)

    # -- watchers ----------------------------------------------------------------

    def add_watcher(self, categories: frozenset[str], max_bytes: int = 16 * 1024 * 1024) -> Watcher:
        watcher = Watcher(categories, asyncio.Queue(self._watch_queue + 1), max_bytes)
        self._watchers.add(watcher)
        for c in categories:
            self._watching[c] = self._watching.get(c, 0) + 1
        return watcher

    def remove_watcher(self, watcher: Watcher) -> None:
        if watcher in self._watchers:
            self._watchers.discard(watcher)
            for c in watcher.categories:
                self._watching[c] -= 1

    def watcher_count(self) -> int:
        return len(self._watchers)

    def watching(self, category: str) -> bool:
        return self._watching.get(category, 0) > 0

    def watch_position(self) -> str:
        return ""  # one broker: a Watch that reconnects starts over (nothing to resume from)

    def watch_since(self, after: str, categories: frozenset[str]) -> tuple[list[pb.WatchEvent], bool]:
        return [], False  # no shared stream keeps past events

    def event(self, event: WatchEvent) -> None:
        if any(event.category in w.categories for w in self._watchers):
            self.offer(event.category, codec.watch_event_pb(event, self._clock.now(), time.time()))

    def offer(self, category: str | None, msg: pb.WatchEvent) -> None:
        """Queue an encoded event for each watcher of `category` (None: for every watcher)."""
        size = msg.ByteSize()
        for watcher in self._watchers:
            if (category is not None and category not in watcher.categories) or watcher.overflowed:
                continue
            behind = ""
            if watcher.queue.qsize() >= self._watch_queue:
                behind = f"{self._watch_queue} events"
            elif watcher.pending_bytes + size > watcher.max_bytes:
                behind = (
                    f"{watcher.pending_bytes + size} bytes (limit {watcher.max_bytes}, --watch-buffer-bytes)"
                )
            if behind:
                # A watcher that cannot keep up is cut off, never silently skipped.
                watcher.overflowed = True
                watcher.queue.put_nowait(
                    Close(
                        "RESOURCE_EXHAUSTED",
                        f"watcher fell {behind} behind; reconnect",
                        Cause.WATCHER_BEHIND,
                    )
                )
            else:
                watcher.pending_bytes += size
                watcher.queue.put_nowait(msg)
