"""Index mirrors: per-subscriber buffers of index changes, for the Mirror stream.

An engine (or router) that keeps a mirror of a layout's index answers "who
holds this prefix?" in process, in microseconds, instead of a round trip
per request. The core reports every change here synchronously, in the order
it applies them; each subscriber buffers the changes of its layout until its
stream writer takes them, merged into as few messages as possible.

Consistency: a subscription starts buffering the moment it is made; the
writer then sends a snapshot (taken over several loop turns) and then the
buffer. Every change is a set operation (add, remove, drop), so applying the
snapshot and then the changes, in order, ends at the broker's state even
when the snapshot saw some of those changes already.

Keepalive: the live part of a stream carries an empty MirrorUpdate every
``--mirror-keepalive-ms`` (``live_updates``), idle or busy, so a mirror that
hears nothing for several of them knows its picture may be stale (a frozen
broker, a cut link) and says so (clients/mirror.py). Busy too: a tenant's
filtered stream may see none of the changes, and an update on a clock tells
it nothing of other tenants' activity.

A subscriber that falls too far behind is not cut off: its buffer is dropped
and it is sent a fresh snapshot (the `reset` flag tells the mirror). "Too far"
is counted in bytes (8 a hash, an engine's whole serialized EngineInfo), so a
subscriber that never reads costs at most its byte limit, whatever changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb

# Buffered bytes after which a subscriber is resynced.
DEFAULT_MAX_PENDING_BYTES = 64 * 1024 * 1024
CHANGE_OVERHEAD_BYTES = 64  # a MirrorBlocks' fields and framing, roughly


def mirror_engine_info(info: pb.EngineInfo) -> pb.EngineInfo:
    """What a mirror needs of an engine: layout, ranks' layer ranges, labels; no NIXL blobs."""
    out = pb.EngineInfo()
    out.CopyFrom(info)
    for rank in out.ranks:
        rank.ClearField("agent_metadata")
        for tier in rank.tiers:
            tier.ClearField("regions")
            tier.ClearField("digest_regions")
            tier.ClearField("digest_table")
    return out


@dataclass(eq=False)  # identity-hashed: kept in a set
class MirrorSubscriber:
    """One Mirror stream's buffer. Order matters (an engine can go and come back with
    new blocks), so changes are kept in segments: a message applies its engines, then
    its blocks; an engine change after buffered blocks starts a new segment."""

    layout_id: str
    wake: Callable[[], None]
    max_pending: int = DEFAULT_MAX_PENDING_BYTES
    segments: list[tuple[list[pb.MirrorEngine], list[pb.MirrorBlocks]]] = field(default_factory=list)
    pending: int = 0
    overflowed: bool = False
    closed: str = ""  # why the broker ends this stream (shutdown)
    since: float = 0.0  # monotonic time of the oldest change not yet taken (0: none); for /metrics

    def take(self) -> list[pb.MirrorUpdate]:
        """Everything buffered, in order, in as few messages as order allows."""
        out = [pb.MirrorUpdate(engines=e, blocks=b) for e, b in self.segments]
        self.segments, self.pending, self.since = [], 0, 0.0
        return out

    def restart(self) -> None:
        """Drop the buffer: a new snapshot is about to be taken."""
        self.segments, self.pending, self.since = [], 0, 0.0
        self.overflowed = False

    def _add_blocks(self, change: pb.MirrorBlocks, size: int) -> None:
        if self.overflowed:
            return
        if not self.since:
            self.since = time.monotonic()
        self.pending += size
        if self.pending > self.max_pending:
            self.overflowed = True  # the writer resyncs with a fresh snapshot
            self.segments = []
        elif self.segments:
            self.segments[-1][1].append(change)
        else:
            self.segments.append(([], [change]))
        self.wake()

    def _add_engine(self, change: pb.MirrorEngine, size: int) -> None:
        if self.overflowed:
            return
        if not self.since:
            self.since = time.monotonic()
        self.pending += size
        if self.pending > self.max_pending:
            self.overflowed = True
            self.segments = []
        elif not self.segments or self.segments[-1][1]:
            self.segments.append(([change], []))
        else:
            self.segments[-1][0].append(change)
        self.wake()


class Mirrors(Protocol):
    """The core's side of the mirrors (one test body runs over every implementation:
    tests/broker/test_mirror_hub_contract.py)."""

    def subscribe(
        self, layout_id: str, wake: Callable[[], None], max_pending: int = DEFAULT_MAX_PENDING_BYTES
    ) -> MirrorSubscriber:
        """A new Mirror stream's buffer: it holds every change of the layout from now on."""
        ...

    def unsubscribe(self, sub: MirrorSubscriber) -> None: ...

    def close_all(self, why: str) -> None:
        """End every Mirror stream (the broker shuts down)."""
        ...

    def lag(self) -> tuple[float, int]:
        """The age in seconds of the oldest change no stream has sent yet, and the bytes waiting."""
        ...

    def subscriber_count(self) -> int: ...

    def watching(self, layout_id: str) -> bool:
        """Cheap check so the core builds a change only when a mirror may want it."""
        ...

    def blocks(
        self,
        engine_id: str,
        namespace: Namespace,
        tier: Tier,
        stored: Sequence[int] = (),
        removed: Sequence[int] = (),
        forgotten: bool = False,
    ) -> None:
        """A change of an engine's blocks; `forgotten`: the removals are what the index forgot."""
        ...

    def clear_tier(self, engine_id: str, layout_id: str, tier: Tier) -> None: ...

    def engine(self, layout_id: str, info: pb.EngineInfo | None, engine_id: str = "") -> None:
        """An engine became ready or changed (info), or is gone (info None, engine_id given)."""
        ...


class MirrorHub:
    """The in-memory Mirrors: fan each index change out to the layout's subscribers."""

    def __init__(self) -> None:
        self._by_layout: dict[str, set[MirrorSubscriber]] = {}

    def subscribe(
        self, layout_id: str, wake: Callable[[], None], max_pending: int = DEFAULT_MAX_PENDING_BYTES
    ) -> MirrorSubscriber:
        sub = MirrorSubscriber(layout_id, wake, max_pending)
        self._by_layout.setdefault(layout_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: MirrorSubscriber) -> None:
        subs = self._by_layout.get(sub.layout_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._by_layout[sub.layout_id]

    def close_all(self, why: str) -> None:
        for subs in self._by_layout.values():
            for sub in subs:
                sub.closed = why
                sub.wake()

    def lag(self) -> tuple[float, int]:
        """The age in seconds of the oldest change no stream has sent yet, and the bytes waiting."""
        now = time.monotonic()
        subs = [sub for subs in self._by_layout.values() for sub in subs]
        oldest = max((now - sub.since for sub in subs if sub.since), default=0.0)
        return oldest, sum(sub.pending for sub in subs)

    def subscriber_count(self) -> int:
        return sum(len(s) for s in self._by_layout.values())

    def watching(self, layout_id: str) -> bool:
        return layout_id in self._by_layout

    def blocks(
        self,
        engine_id: str,
        namespace: Namespace,
        tier: Tier,
        stored: Sequence[int] = (),
        removed: Sequence[int] = (),
        forgotten: bool = False,
    ) -> None:
        subs = self._by_layout.get(namespace.layout_id)
        if not subs:
            return
        change = pb.MirrorBlocks(
            engine_id=engine_id,
            tenant=namespace.tenant,
            tier=pb.Tier.ValueType(tier),
            stored=stored,
            removed=removed,
            forgotten=forgotten,
        )
        size = 8 * (len(stored) + len(removed)) + CHANGE_OVERHEAD_BYTES
        for sub in subs:
            sub._add_blocks(change, size)

    def clear_tier(self, engine_id: str, layout_id: str, tier: Tier) -> None:
        subs = self._by_layout.get(layout_id)
        if not subs:
            return
        change = pb.MirrorBlocks(engine_id=engine_id, tier=pb.Tier.ValueType(tier), clear_tier=True)
        for sub in subs:
            sub._add_blocks(change, CHANGE_OVERHEAD_BYTES)

    def engine(self, layout_id: str, info: pb.EngineInfo | None, engine_id: str = "") -> None:
        """An engine became ready or changed (info), or is gone (info None, engine_id given)."""
        subs = self._by_layout.get(layout_id)
        if not subs:
            return
        if info is None:
            msg = pb.MirrorEngine(engine=pb.EngineInfo(engine_id=engine_id), gone=True)
        else:
            msg = pb.MirrorEngine(engine=mirror_engine_info(info))
        size = msg.ByteSize() + CHANGE_OVERHEAD_BYTES
        for sub in subs:
            sub._add_engine(msg, size)


async def live_updates(
    sub: MirrorSubscriber, ready: asyncio.Event, keepalive_s: float
) -> AsyncIterator[pb.MirrorUpdate]:
    """The buffered changes as `ready` says they arrive, and an empty update every `keepalive_s`
    (see the module doc), until the subscriber overflows or is closed."""
    loop = asyncio.get_running_loop()
    alive_at = loop.time() + keepalive_s
    while not sub.overflowed and not sub.closed:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation that lands as
        # `ready` is set, and this loop would then outlive its stream.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, alive_at - loop.time())):
                await ready.wait()
        if loop.time() >= alive_at:
            alive_at = loop.time() + keepalive_s
            yield pb.MirrorUpdate()
        ready.clear()
        for update in sub.take():
            yield update
