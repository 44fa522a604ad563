"""Index changes for Mirror streams across broker replicas: one Redis Stream per layout, and the
fleet's mirror hub (FleetMirrorHub) that appends to and reads from them.

A mirror must not miss a change, so these do not go over pub/sub (at most
once). Each replica applies its own changes to its local mirrors and appends
them to the layout's stream (XADD, trimmed to the last minute of changes with
MINID; each entry numbered by a counter in the same script). A replica reads
the streams of the layouts it has Mirror streams for (XREAD BLOCK, which is
also its wake-up), from the stream's end at the moment its first mirror of
that layout subscribed (before that mirror's snapshot, so nothing falls in
between), and applies the other replicas' changes to its mirrors.

A replica that lost its connection to Redis reads on from its last entry when
it is back, so the changes appended meanwhile still reach its mirrors. If they
were trimmed away first, or the store restarted empty, or a replica could not
append one of its own, the numbers jump and the layout's mirrors are resynced
with a fresh snapshot from the shared index instead.

Every key of a layout's stream shares one hash tag, so on a Redis Cluster the
layouts' streams spread over the primaries.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import MovedError

from kvbroker.broker.errors import BrokerError
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.mirror import DEFAULT_MAX_PENDING_BYTES, MirrorHub, MirrorSubscriber, mirror_engine_info
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker")

# How long a stream keeps a change: a replica away from Redis for longer resyncs its mirrors.
# Kept by age rather than count, so its memory is bounded by the fleet's inventory rate.
KEEP_MS = 60_000

# KEYS: the stream, its counter.  ARGV: keep_ms, replica, kind, body, step (2 after a change this
# replica could not append: the readers see the jump and resync), cap (the most entries kept under
# an index bytes budget, approximately: whole nodes go; 0: trimmed by age only).
_APPEND = """
local n = redis.call('INCRBY', KEYS[2], ARGV[5])
local t = redis.call('TIME')
local oldest = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[1])
redis.call('XADD', KEYS[1], 'MINID', '~', oldest, '*', 'n', n, 'rep', ARGV[2], 't', ARGV[3], 'b', ARGV[4])
if tonumber(ARGV[6]) > 0 then
  redis.call('XTRIM', KEYS[1], 'MAXLEN', '~', ARGV[6])
end
return n
"""

# What a stream entry costs the store, from its body's length: the fields beside it and the stream
# node's share (MEMORY USAGE over 3,000 entries on Redis 7: 160 bytes for a 100-byte body, 660 for
# 520, 2,750 for 2,000, 10,570 for 8,300: a large entry fills a node of its own, which the allocator
# rounds up). Averaged over about the last ENTRY_BYTES_SPAN appends, rising over ENTRY_BYTES_RISE.
ENTRY_BYTES_SPAN = 256
ENTRY_BYTES_RISE = 16


def entry_bytes(body_len: int) -> float:
    return 64 + 1.3 * body_len


Apply = Callable[[str, str, bytes], None]  # layout id, kind ("blocks" or "engine"), serialized change


@dataclass(eq=False)
class LayoutReader:
    layout_id: str
    key: str
    last_id: bytes  # the last entry read
    last_n: int  # its number (-1: unknown, the next entry resyncs)
    task: asyncio.Task[None] | None = None
    reconnects: int = 0


class MirrorStreams:
    """The per-layout mirror streams; the fleet's Watch and early-declines streams (fleet/watch.py,
    fleet/declines.py) are two more, with their own keys and readers' names."""

    reader_name = "kvbroker-mirror"  # readers' Redis client names: `<reader_name>-<replica>`
    apply_own = False  # mirrors apply their own replica's changes at once, not from the stream
    apply_after_gap = False  # a mirror's resync snapshot has the entry after a gap; a Watch has none

    def __init__(
        self,
        state: RedisState,
        replica: str,
        apply: Apply,
        resync: Callable[[str], None],
        block_ms: int = 1000,
    ) -> None:
        self._state = state
        self._replica = replica
        self._apply = apply
        self._resync = resync
        self._block_ms = block_ms
        self._append = state.script(_APPEND)
        self._failed: set[str] = set()  # layouts whose last append failed
        self.cap = 0  # the most entries a stream keeps (an index bytes budget's share; 0: by age only)
        self._keep_bytes = 0  # that share in bytes, which `cap` follows
        self._entry_bytes = 0.0  # what an entry appended here costs the store, a moving average
        self.readers: dict[str, LayoutReader] = {}
        self._ending: set[asyncio.Task[None]] = set()  # cancelled readers closing their connection

    def keys(self, layout_id: str) -> list[str]:
        tag = hashlib.blake2b(layout_id.encode(), digest_size=8, person=b"kvbroker-mir").hexdigest()
        base = f"{self._state.prefix}:{{mirror-{tag}}}:"
        return [base + "s", base + "n"]

    def keep_bytes(self, budget: int) -> None:
        """Keep each layout's stream to about `budget` bytes (an index bytes budget's share for it):
        a cap in entries, at what the entries appended lately cost (`entry_bytes`)."""
        self._keep_bytes = max(0, budget)
        self._follow_cap()

    def _follow_cap(self) -> None:
        if self._keep_bytes and self._entry_bytes:
            self.cap = max(1, int(self._keep_bytes / self._entry_bytes))

    def append(self, layout_id: str, kind: str, body: bytes) -> None:
        step = 2 if layout_id in self._failed else 1
        if self._keep_bytes:
            cost = entry_bytes(len(body))
            if not self._entry_bytes:
                self._entry_bytes = cost
            else:  # up quickly, down slowly: a change in what entries cost errs on keeping fewer
                span = ENTRY_BYTES_RISE if cost > self._entry_bytes else ENTRY_BYTES_SPAN
                self._entry_bytes += (cost - self._entry_bytes) / span
            self._follow_cap()
        try:
            self._state.call(
                self._append,
                keys=self.keys(layout_id),
                args=[KEEP_MS, self._replica, kind, body, step, self.cap],
            )
            self._failed.discard(layout_id)
        except BrokerError as err:
            # The other replicas' mirrors miss this change: the next append skips a number, so
            # that they see the gap and resync from the shared index.
            self._failed.add(layout_id)
            log.warning("cannot send an index change to the other replicas' mirrors: %s", err)

    # -- reading ------------------------------------------------------------------------

    def follow(self, layout_id: str) -> None:
        """Read the layout's stream from its end now (called before the first mirror's snapshot)."""
        if layout_id in self.readers:
            return
        key, counter = self.keys(layout_id)
        r = self._state.client
        try:
            last = self._state.call(r.xrevrange, key, "+", "-", count=1)
            if last:
                last_id, last_n = last[0][0], int(last[0][1][b"n"])
            else:
                last_id, last_n = b"0-0", int(self._state.call(r.get, counter) or 0)
        except BrokerError:
            last_id, last_n = b"0-0", -1  # the store is away: resync at the first entry read
        reader = LayoutReader(layout_id, key, last_id, last_n)
        reader.task = asyncio.get_running_loop().create_task(
            self._read(reader), name=f"{self.reader_name}-{key}"
        )
        self.readers[layout_id] = reader

    def unfollow(self, layout_id: str) -> None:
        """Stop reading the layout (at once, so that a mirror subscribing next starts a new reader)."""
        reader = self.readers.pop(layout_id, None)
        if reader is not None and reader.task is not None:
            reader.task.cancel()
            self._ending.add(reader.task)
            reader.task.add_done_callback(self._ending.discard)

    async def stop(self) -> None:
        for layout_id in list(self.readers):
            self.unfollow(layout_id)
        if self._ending:  # bounded: a reader stops within one read (block_ms) even if its cancel is lost
            await asyncio.wait(set(self._ending), timeout=self._block_ms / 1000 + 5.0)

    def _deliver(self, reader: LayoutReader, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        n = int(fields[b"n"])
        gap = n != reader.last_n + 1
        reader.last_id, reader.last_n = entry_id, n
        if gap:
            self._resync(reader.layout_id)  # (a mirror's fresh snapshot has this change too)
        if gap and not self.apply_after_gap:
            return
        if self.apply_own or fields[b"rep"].decode() != self._replica:
            self._apply(reader.layout_id, fields[b"t"].decode(), fields[b"b"])

    def _following(self, reader: LayoutReader) -> bool:
        return self.readers.get(reader.layout_id) is reader

    async def _read(self, reader: LayoutReader) -> None:
        node: tuple[str, int] | None = None
        name = f"{self.reader_name}-{self._replica}"
        # Checked as well as cancelled: a cancellation that lands as the client's read times out can
        # come out of it as a timeout error, and the reader must still stop.
        while self._following(reader):
            client = self._state.stream_reader(reader.key, self._block_ms, node, name)
            try:
                while self._following(reader):
                    answer: Any = await client.xread(
                        {reader.key: reader.last_id}, count=512, block=self._block_ms
                    )
                    for _, entries in answer or ():
                        for entry_id, fields in entries:
                            self._deliver(reader, entry_id, fields)
            except MovedError as err:  # the stream's slot moved to another Cluster primary
                node = (err.host, err.port)
            except (redis.RedisError, OSError) as err:
                node = None
                reader.reconnects += 1
                log.warning(
                    "%s stream lost (%s); reading on from %s", self.reader_name, err, reader.last_id.decode()
                )
                await asyncio.sleep(0.5)
            finally:
                await client.aclose()


class FleetMirrorHub(MirrorHub):
    """Mirrors that follow every replica's index changes, not only this one's: each change made here
    is appended to its layout's stream, and the layouts this replica has mirrors of are read back."""

    def __init__(self, state: RedisState, replica: str) -> None:
        super().__init__()
        self.streams = MirrorStreams(state, replica, self._apply, self._missed)

    def _publish(self, layout_id: str, change: pb.MirrorBlocks | pb.MirrorEngine) -> None:
        kind = "blocks" if isinstance(change, pb.MirrorBlocks) else "engine"
        self.streams.append(layout_id, kind, change.SerializeToString())

    def _apply(self, layout_id: str, kind: str, body: bytes) -> None:
        if kind == "blocks":
            self.apply_blocks(layout_id, pb.MirrorBlocks.FromString(body))
        else:
            self.apply_engine(layout_id, pb.MirrorEngine.FromString(body))

    def _missed(self, layout_id: str) -> None:
        log.warning("index changes of layout %s were missed: resyncing its mirrors", layout_id[:12])
        self.resync(layout_id)

    def watching(self, layout_id: str) -> bool:
        return True  # a mirror on another replica may be watching

    def subscribe(
        self, layout_id: str, wake: Callable[[], None], max_pending: int = DEFAULT_MAX_PENDING_BYTES
    ) -> MirrorSubscriber:
        sub = super().subscribe(layout_id, wake, max_pending)
        self.streams.follow(layout_id)  # from the stream's end now, before the snapshot
        return sub

    def unsubscribe(self, sub: MirrorSubscriber) -> None:
        super().unsubscribe(sub)
        if sub.layout_id not in self._by_layout:  # its last mirror here: stop reading the layout
            self.streams.unfollow(sub.layout_id)

    def blocks(
        self,
        engine_id: str,
        namespace: Namespace,
        tier: Tier,
        stored: Sequence[int] = (),
        removed: Sequence[int] = (),
        forgotten: bool = False,
    ) -> None:
        super().blocks(engine_id, namespace, tier, stored, removed, forgotten)
        change = pb.MirrorBlocks(
            engine_id=engine_id,
            tenant=namespace.tenant,
            tier=pb.Tier.ValueType(tier),
            stored=stored,
            removed=removed,
            forgotten=forgotten,
        )
        self._publish(namespace.layout_id, change)

    def clear_tier(self, engine_id: str, layout_id: str, tier: Tier) -> None:
        super().clear_tier(engine_id, layout_id, tier)
        change = pb.MirrorBlocks(engine_id=engine_id, tier=pb.Tier.ValueType(tier), clear_tier=True)
        self._publish(layout_id, change)

    def engine(self, layout_id: str, info: pb.EngineInfo | None, engine_id: str = "") -> None:
        super().engine(layout_id, info, engine_id)
        if info is None:
            change = pb.MirrorEngine(engine=pb.EngineInfo(engine_id=engine_id), gone=True)
        else:
            change = pb.MirrorEngine(engine=mirror_engine_info(info))
        self._publish(layout_id, change)

    # -- another replica's changes: to the local mirrors only -----------------------

    def resync(self, layout_id: str) -> None:
        """Changes were missed: the layout's local mirrors start over from a fresh snapshot."""
        for sub in self._by_layout.get(layout_id, ()):
            sub.overflowed, sub.segments, sub.pending = True, [], 0
            sub.wake()

    def apply_blocks(self, layout_id: str, change: pb.MirrorBlocks) -> None:
        if change.clear_tier:
            super().clear_tier(change.engine_id, layout_id, Tier(change.tier))
        else:
            ns = Namespace(layout_id, change.tenant)
            stored, removed = list(change.stored), list(change.removed)
            super().blocks(change.engine_id, ns, Tier(change.tier), stored, removed, change.forgotten)

    def apply_engine(self, layout_id: str, change: pb.MirrorEngine) -> None:
        if change.gone:
            super().engine(layout_id, None, change.engine.engine_id)
        else:
            super().engine(layout_id, change.engine)
