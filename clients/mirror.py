"""A live local copy of one layout's prefix index, fed by the broker's Mirror stream.

With a mirror, "who holds the longest prefix of this prompt?" is answered in
process, in microseconds and without a round trip: the vLLM scheduler can
decide pull-or-recompute in the same step it sees the request, and a router
can score engines without asking the broker. Leases still go to the broker
(only it can promise that blocks stay put), so a mirror's answer is advice:
the broker's answer to the acquire is what counts.

The mirror is the broker's own index structure (`CompactPrefixIndex`) fed the
same set operations in the same order, and it filters and ranks holders with
the broker's own rules, so a synced mirror gives the broker's answer, late by
the stream's delivery time (about a millisecond on one host; see
`bench/control_plane/compare.py`). Before the first snapshot completes, and while the
stream is broken, `resolve` answers None ("ask the broker").

How exact it is: each holder's state is the one the broker published
(EngineInfo.exactness: a KV-event feed's gaps, or a connector engine silent
past two heartbeats, broker/silence.py), and the mirror judges one silence
itself, its own stream's. The broker sends an idle Mirror stream an
empty update every ``--mirror-keepalive-ms`` (1 s); a mirror that has heard
nothing at all for ``silence_s`` (5 s by default) cannot tell a quiet index
from a frozen broker or a cut link, so it marks every holder's picture
INDEX_DEGRADED ("mirror silent for ..."), and ``fresh`` turns False so that
an engine asks the broker instead, until the next message arrives.

Thread-safety: updates come from the stream's event loop and lookups from any
thread (the vLLM scheduler); one lock serialises them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvbroker.common.index import CompactPrefixIndex
from kvbroker.common.layout import check_topology
from kvbroker.common.model import Namespace, Tier, is_event_fed
from kvbroker.common.scoring import EngineScore, HolderMatch, rank_holders, score_engines
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc

log = logging.getLogger("kvbroker.mirror")

# Index entries swept per applied message (the broker's own clean-up, done locally).
_MAINTAIN_BUDGET = 5_000

# Silent this long, the mirror's picture is degraded: five of the broker's keepalives
# (--mirror-keepalive-ms, 1 s) missed in a row. Not less: the process itself may not run for a
# while on a loaded host (a starved session thread reads the keepalives late), and a mirror
# judged silent sends every lookup to the broker, correct but slower.
DEFAULT_SILENCE_S = 5.0
EXACT, DEGRADED = 1, 3  # IndexExactness values (the wire's enum)


@dataclass
class MirrorStats:
    updates: int = 0  # messages applied
    resets: int = 0  # snapshots started (1 + reconnects + resyncs)
    syncs: int = 0  # snapshots completed
    # Blocks removed because the broker's bounded index forgot them (MirrorBlocks.forgotten), not
    # because their engine dropped them: the broker no longer names those holders, nor does this.
    forgotten: int = 0
    last_update_monotonic: float = 0.0
    errors: list[str] = field(default_factory=list)


class IndexMirror:
    """The index of one layout as the broker has it, for lookups in process."""

    def __init__(
        self,
        layout_id: str,
        *,
        silence_s: float = DEFAULT_SILENCE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`silence_s`: heard nothing for longer, the picture is degraded (see the module doc);
        `clock`: seconds, monotonic (a test passes a fake)."""
        if not layout_id:
            raise ValueError("IndexMirror needs a layout_id (the one the broker gave at registration)")
        if silence_s <= 0:
            raise ValueError("silence_s must be > 0")
        self.layout_id = layout_id
        self.silence_s = silence_s
        self._clock = clock
        self._heard_at = clock()
        self.stats = MirrorStats()
        self._lock = threading.Lock()
        self._index = CompactPrefixIndex()
        self._engines: dict[str, pb.EngineInfo] = {}
        self._synced = False
        # check_topology answers for the last asker (an engine asks with the same
        # EngineInfo every time); forgotten whenever an engine changes.
        self._compat_asker: pb.EngineInfo | None = None
        self._compat: dict[str, bool] = {}

    @property
    def synced(self) -> bool:
        """True while the mirror holds a complete snapshot plus every change since."""
        return self._synced

    def mark_unsynced(self) -> None:
        """The stream broke: answers may be stale from now on, so give none until resynced."""
        self._synced = False

    def silent_for(self) -> float:
        """Seconds since the stream last delivered anything (an update or a keepalive)."""
        return max(0.0, self._clock() - self._heard_at)

    @property
    def fresh(self) -> bool:
        """Synced, and heard from within `silence_s`: its answers may stand in for the broker's."""
        return self._synced and self.silent_for() <= self.silence_s

    def exactness(self, engine_id: str) -> tuple[int, str]:
        """How exact this mirror's picture of `engine_id` is (IndexExactness), and why not exact."""
        silent = self.silent_for()
        if silent > self.silence_s:
            return DEGRADED, f"mirror silent for {silent:.1f} s (limit {self.silence_s:.1f} s)"
        info = self._engines.get(engine_id)
        if info is None or not info.exactness:
            return EXACT, ""  # unknown, or a broker that predates the field
        return int(info.exactness), info.exactness_reason

    # -- applying the stream ------------------------------------------------------

    def apply(self, update: pb.MirrorUpdate) -> None:
        """One message of the stream; an empty one is the broker's keepalive (nothing changed)."""
        with self._lock:
            self._heard_at = self._clock()
            if update.reset:
                self._index = CompactPrefixIndex()
                self._engines.clear()
                self._synced = False
                self.stats.resets += 1
            if update.reset or update.engines:
                self._compat.clear()
            for change in update.engines:
                engine_id = change.engine.engine_id
                if change.gone:
                    self._engines.pop(engine_id, None)
                    self._index.drop_holder(engine_id)
                else:
                    self._engines[engine_id] = change.engine
            for blocks in update.blocks:
                self._apply_blocks(blocks)
            if update.synced:
                self._synced = True
                self.stats.syncs += 1
            self._index.maintain(_MAINTAIN_BUDGET)
            self.stats.updates += 1
            self.stats.last_update_monotonic = self._heard_at

    def _apply_blocks(self, blocks: pb.MirrorBlocks) -> None:
        tier = Tier(blocks.tier)
        if blocks.clear_tier:
            self._index.drop_holder(blocks.engine_id, tier)
        ns = Namespace(self.layout_id, blocks.tenant)
        if blocks.removed:
            self._index.remove(blocks.engine_id, tier, ns, blocks.removed)
            if blocks.forgotten:
                self.stats.forgotten += len(blocks.removed)
        if blocks.stored:
            self._index.add(blocks.engine_id, tier, ns, blocks.stored)

    # -- lookups ------------------------------------------------------------------

    def resolve(
        self, tenant: str, hashes: Sequence[int], asker: pb.EngineInfo | None = None
    ) -> list[pb.HolderMatch] | None:
        """Holders of the longest prefix per (engine, tier), best first, as the broker's
        Resolve ranks them (its `matches`, without hold lease ids; each holder's load as
        the broker last republished it, see docs/broker.md). None: not synced.

        With `asker`, the asker itself and holders whose topology it cannot read
        are left out, as the broker does for a session resolve."""
        if not self._synced:
            return None
        with self._lock:
            found = self._index.longest_prefixes(Namespace(self.layout_id, tenant), hashes)
            if asker is not None and asker is not self._compat_asker:
                self._compat_asker, self._compat = asker, {}
            matches: list[HolderMatch] = []
            for engine_id, tier, n in found:
                info = self._engines.get(engine_id)
                if info is None or info.draining or is_event_fed(info.labels):
                    continue  # an event-fed engine is scored, never pulled from
                if asker is not None and (engine_id == asker.engine_id or not self._readable(asker, info)):
                    continue
                matches.append(
                    HolderMatch(engine_id, tier, n, info.load, exactness=self.exactness(engine_id)[0])
                )
        return [
            pb.HolderMatch(
                engine_id=m.engine_id,
                tier=pb.Tier.ValueType(m.tier),
                matched_blocks=m.matched,
                load=m.load,
                exactness=pb.IndexExactness.ValueType(m.exactness),
            )
            for m in rank_holders(matches)
        ]

    def _readable(self, asker: pb.EngineInfo, holder: pb.EngineInfo) -> bool:
        ok = self._compat.get(holder.engine_id)
        if ok is None:
            ok = self._compat[holder.engine_id] = check_topology(asker, holder) is None
        return ok

    def score(
        self, tenant: str, hashes: Sequence[int], candidates: Sequence[str] = ()
    ) -> list[EngineScore] | None:
        """Like the broker's Score for block hashes: matched prefix per tier per engine."""
        if not self._synced:
            return None
        with self._lock:
            found = self._index.longest_prefixes(Namespace(self.layout_id, tenant), hashes)
            wanted = candidates or list(self._engines)
            engines = {
                e: (self._engines[e].load, self._engines[e].draining) for e in wanted if e in self._engines
            }
            scores = score_engines(found, engines)
            for s in scores:
                s.exactness = self.exactness(s.engine_id)[0]
        return scores

    def engines(self) -> list[pb.EngineInfo]:
        with self._lock:
            return list(self._engines.values())

    def total_blocks(self) -> int:
        with self._lock:
            return self._index.total_blocks()


async def follow(
    mirror: IndexMirror,
    channel: grpc.aio.Channel,
    *,
    backoff_s: Callable[[int], float] = lambda n: min(5.0, 0.1 * 2**n),
) -> None:
    """Keep `mirror` in step with the broker until cancelled: subscribe, apply every
    message, and after a broken stream mark it unsynced and subscribe again (each new
    stream starts with a reset and a full snapshot). Run it as a task; cancel to stop."""
    stub = broker_pb2_grpc.KVBrokerStub(channel)
    attempt = 0
    while True:
        call = stub.Mirror(pb.MirrorRequest(layout_id=mirror.layout_id))
        try:
            async for update in call:
                mirror.apply(update)
                attempt = 0
        except grpc.aio.AioRpcError as err:
            mirror.stats.errors.append(f"{err.code().name}: {err.details()}")
            del mirror.stats.errors[:-10]
            if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED):
                log.error("index mirror of %s refused: %s; not retrying", mirror.layout_id, err.details())
                return
            log.info(
                "index mirror of %s: stream ended (%s); resubscribing", mirror.layout_id, err.code().name
            )
        finally:
            mirror.mark_unsynced()
            call.cancel()
        await asyncio.sleep(backoff_s(attempt))
        attempt += 1
