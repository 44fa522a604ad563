"""Watch and mirror events, published by the state they describe.

The core changes the prefix index, the lease table and the engine registry only
through these thin wrappers, and emits nothing itself. Each wrapper publishes what
it changed right after the change, so events come in the order the core makes
changes: a WatchEvent to the Notifier (built only when someone watches that
category) and, for index and engine changes, the change to the layout's mirrors.

Two engine transitions have consequences that are published first: draining an
engine revokes its unclaimed holds, and ending a session revokes every lease of the
engine. They are context managers (`draining`, `removing`): the engine's state
changes on entry, the core carries out the consequences inside the block, and the
engine event is published on exit, after the `lease_revoked` events it caused.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from kvbroker.broker.events import ENGINE, INDEX, LEASE, Notifier, WatchEvent
from kvbroker.broker.lease_stats import LeaseStats, ReadReport
from kvbroker.broker.leases import Lease, LeaseTable, Vet
from kvbroker.broker.mirror import Mirrors
from kvbroker.broker.registry import EngineRecord, Registry
from kvbroker.common.index import PrefixIndex
from kvbroker.common.index_budget import IndexMemory
from kvbroker.common.model import EVENT_FED, LeaseState, Namespace, RevokeCause, Tier, is_event_fed
from kvbroker.common.scoring import load_changed
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger(__name__)

# An engine's load reaches its layout's mirrors at most this often (broker clock): heartbeats
# of many engines, or a client that heartbeats in a loop, must not flood every mirror.
LOAD_REPUBLISH_S = 0.15


class Publisher:
    """Where the wrappers publish: watchers through the Notifier, mirrors through the hub."""

    def __init__(self, notifier: Notifier, mirrors: Mirrors) -> None:
        self.notifier = notifier
        self.mirrors = mirrors

    def watch(
        self,
        category: str,
        kind: str,
        *,
        engine_id: str = "",
        lease: Lease | None = None,
        blocks: int = 0,
        tier: Tier | None = None,
        detail: str = "",
    ) -> None:
        if self.notifier.watching(category):
            self.notifier.event(
                WatchEvent(
                    category, kind, engine_id=engine_id, lease=lease, blocks=blocks, tier=tier, detail=detail
                )
            )

    def lease(self, kind: str, lease: Lease, detail: str = "") -> None:
        self.watch(LEASE, kind, engine_id=lease.holder, lease=lease, detail=detail)

    def mirror_engine(self, rec: EngineRecord) -> None:
        """Tell the layout's mirrors about a ready engine (built only when one listens)."""
        rec.mirrored_load = rec.load  # whatever the cause, the snapshot carries the load
        if rec.ready and self.mirrors.watching(rec.layout_id):
            self.mirrors.engine(rec.layout_id, rec.snapshot())


class ObservedIndex:
    """The prefix index; each change of an engine's blocks goes to watchers and mirrors."""

    def __init__(self, index: PrefixIndex, publish: Publisher) -> None:
        self._index = index
        self._publish = publish

    def add(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Sequence[int]) -> int:
        n = self._index.add(engine_id, tier, namespace, hashes)
        self._publish.mirrors.blocks(engine_id, namespace, tier, stored=hashes)
        self._publish.watch(INDEX, "blocks_stored", engine_id=engine_id, blocks=n, tier=tier)
        self._tell_forgotten()  # after what was stored: a block stored and forgotten at once ends gone
        return n

    def _tell_forgotten(self) -> None:
        """What a bounded index forgot reaches the mirrors as removals marked `forgotten`."""
        for engine_id, tier, namespace, hashes in self._index.take_forgotten():
            self._publish.mirrors.blocks(engine_id, namespace, tier, removed=hashes, forgotten=True)

    def remove(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Sequence[int]) -> int:
        n = self._index.remove(engine_id, tier, namespace, hashes)
        self._publish.mirrors.blocks(engine_id, namespace, tier, removed=hashes)
        self._publish.watch(INDEX, "blocks_removed", engine_id=engine_id, blocks=n, tier=tier)
        return n

    def clear_tier(self, engine_id: str, layout_id: str, tier: Tier) -> int:
        """Drop every block the engine holds in one tier (all namespaces of its layout)."""
        n = self._index.drop_holder(engine_id, tier)
        self._publish.mirrors.clear_tier(engine_id, layout_id, tier)
        self._publish.watch(INDEX, "tier_cleared", engine_id=engine_id, blocks=n, tier=tier)
        return n

    def drop_holder(self, engine_id: str) -> int:
        """Drop all of a departing engine's blocks. Published by its going: mirrors drop the
        engine with its blocks (ObservedRegistry.removing) and watchers see `engine_gone`."""
        return self._index.drop_holder(engine_id)

    def longest_prefixes(self, namespace: Namespace, hashes: Iterable[int]) -> list[tuple[str, Tier, int]]:
        return self._index.longest_prefixes(namespace, hashes)

    def export(self, layout_id: str, chunk: int) -> Iterator[list[tuple[str, Tier, Namespace, list[int]]]]:
        return self._index.export(layout_id, chunk)

    def blocks_of(self, engine_id: str) -> dict[Tier, int]:
        return self._index.blocks_of(engine_id)

    def total_blocks(self) -> int:
        return self._index.total_blocks()

    def namespace_count(self) -> int:
        return self._index.namespace_count()

    def maintain(self, budget: int) -> None:
        self._index.maintain(budget)
        self._tell_forgotten()  # the store's index keeps to its bound here too

    def memory(self) -> IndexMemory:
        return self._index.memory()


class ObservedLeaseTable:
    """A LeaseTable whose every change of a lease's state goes to the watchers."""

    def __init__(self, table: LeaseTable, publish: Publisher) -> None:
        self._table = table
        self._publish = publish
        self.stats: LeaseStats | None = None  # durations and pair totals, for /metrics

    def create(
        self,
        *,
        holder: str,
        reader: str,
        namespace: Namespace,
        tier: Tier,
        block_hashes: Sequence[int],
        block_ids: Sequence[int],
        state: LeaseState,
        ttl_s: float,
        deadline: float,
        request_id: str,
        max_leases: int = 0,
    ) -> Lease:
        lease = self._table.create(
            holder=holder,
            reader=reader,
            namespace=namespace,
            tier=tier,
            block_hashes=block_hashes,
            block_ids=block_ids,
            state=state,
            ttl_s=ttl_s,
            deadline=deadline,
            request_id=request_id,
            max_leases=max_leases,
        )
        self._publish.lease("lease_pending" if state is LeaseState.PENDING else "lease_held", lease)
        if self.stats is not None:
            self.stats.started(lease)
        return lease

    def claim(
        self,
        lease_id: str,
        reader: str,
        ttl_s: float,
        now: float,
        max_leases: int = 0,
        vet: Vet | None = None,
    ) -> Lease:
        lease = self._table.claim(lease_id, reader, ttl_s, now, max_leases, vet)
        self._publish.lease("lease_active", lease)
        return lease

    def activate(self, lease_id: str, holder: str, block_ids: Sequence[int], now: float) -> Lease:
        lease = self._table.activate(lease_id, holder, block_ids, now)
        self._publish.lease("lease_active", lease)
        return lease

    def release(
        self, lease_id: str, reader: str, epoch: int, now: float, read: ReadReport | None = None
    ) -> Lease:
        lease = self._table.release(lease_id, reader, epoch, now)
        self._publish.lease("lease_released", lease)
        if self.stats is not None:
            self.stats.ended(lease, "released", read)
        return lease

    def revoke(self, lease_id: str, cause: RevokeCause, detail: str) -> Lease | None:
        return self._revoked(self._table.revoke(lease_id, cause, detail))

    def expire_if_due(self, lease_id: str, now: float) -> Lease | None:
        return self._revoked(self._table.expire_if_due(lease_id, now))

    def revoke_expired(self, now: float, limit: int) -> list[Lease]:
        ended = self._table.revoke_expired(now, limit)
        for lease in ended:
            self._revoked(lease)
        return ended

    def _revoked(self, lease: Lease | None) -> Lease | None:
        if lease is not None:
            self._publish.lease("lease_revoked", lease, detail=lease.cause.label)
            if self.stats is not None:
                self.stats.ended(lease, lease.cause.label)
        return lease

    def renew(self, lease_id: str, engine_id: str, ttl_s: float, now: float) -> Lease:
        return self._table.renew(lease_id, engine_id, ttl_s, now)

    def get(self, lease_id: str) -> Lease:
        return self._table.get(lease_id)

    def by_holder(self, engine_id: str) -> list[Lease]:
        return self._table.by_holder(engine_id)

    def by_reader(self, engine_id: str) -> list[Lease]:
        return self._table.by_reader(engine_id)

    def count_by_holder(self, engine_id: str) -> int:
        return self._table.count_by_holder(engine_id)

    def count_by_reader(self, engine_id: str) -> int:
        return self._table.count_by_reader(engine_id)

    def live(self) -> Iterable[Lease]:
        return self._table.live()

    def recently_ended(self) -> Iterable[Lease]:
        return self._table.recently_ended()

    def live_counts(self) -> dict[LeaseState, int]:
        return self._table.live_counts()


class ObservedRegistry:
    """The engine registry; engines coming, changing, draining and going reach watchers and mirrors."""

    def __init__(self, registry: Registry, publish: Publisher) -> None:
        self._registry = registry
        self._publish = publish

    def add(self, info: pb.EngineInfo, ttl_s: float, expected_ranks: int, now: float) -> EngineRecord:
        rec = self._registry.add(info, ttl_s, expected_ranks, now)
        # An engine known from its KV events only says so: routers may send it requests, not pull from it.
        detail = f"{rec.layout_id} ({EVENT_FED})" if is_event_fed(rec.info.labels) else rec.layout_id
        self._publish.watch(ENGINE, "engine_registered", engine_id=rec.engine_id, detail=detail)
        self._publish.mirror_engine(rec)
        return rec

    def add_rank(self, engine_id: str, rank: pb.RankInfo) -> EngineRecord:
        rec = self._registry.add_rank(engine_id, rank)
        self._publish.mirror_engine(rec)
        return rec

    def set_load(self, rec: EngineRecord, load: float, now: float) -> None:
        """A heartbeat's load. Resolve answers read it at once; mirrors hear of it when it
        moved materially (common.scoring.load_changed) since they last did, at most every
        LOAD_REPUBLISH_S. A change held back goes out with a later heartbeat."""
        rec.load = load
        if load_changed(rec.mirrored_load, load) and now - rec.mirrored_at >= LOAD_REPUBLISH_S:
            rec.mirrored_at = now
            self._publish.mirror_engine(rec)

    @contextmanager
    def removing(self, rec: EngineRecord, why: str) -> Iterator[None]:
        """Remove the engine; its mirrors drop it now, watchers hear `engine_gone` after the block."""
        log.info("engine %s (session %s) removed: %s", rec.engine_id, rec.session_id, why)
        self._registry.remove(rec)
        self._publish.mirrors.engine(rec.layout_id, None, rec.engine_id)
        yield
        self._publish.watch(ENGINE, "engine_gone", engine_id=rec.engine_id, detail=why)

    @contextmanager
    def draining(self, rec: EngineRecord, why: str) -> Iterator[None]:
        """Mark the engine draining; watchers and mirrors hear of it after the block."""
        rec.draining = True
        yield
        self._publish.watch(ENGINE, "engine_draining", engine_id=rec.engine_id, detail=why)
        self._publish.mirror_engine(rec)

    def set_exactness(self, rec: EngineRecord, exactness: int, reason: str) -> None:
        """How exact the engine's entries are (broker/exactness.py); watchers and mirrors hear of a change."""
        if (rec.exactness, rec.exactness_reason) == (exactness, reason):
            return
        self._registry.set_exactness(rec, exactness, reason)
        label = {1: "exact", 2: "lagging", 3: "degraded"}.get(exactness, str(exactness))
        detail = f"{label}: {reason}" if reason else label
        self._publish.watch(ENGINE, "engine_exactness", engine_id=rec.engine_id, detail=detail)
        self._publish.mirror_engine(rec)

    def __len__(self) -> int:
        return len(self._registry)

    def get(self, engine_id: str) -> EngineRecord:
        return self._registry.get(engine_id)

    def find(self, engine_id: str) -> EngineRecord | None:
        return self._registry.find(engine_id)

    def by_session(self, session_id: str) -> EngineRecord:
        return self._registry.by_session(session_id)

    def all(self) -> list[EngineRecord]:
        return self._registry.all()

    def own_sessions(self) -> list[EngineRecord]:
        return self._registry.own_sessions()

    def silence_changed(self, rec: EngineRecord, silence: str) -> None:
        """The engine fell silent (`silence` says how long) or spoke again (""): watchers and
        mirrors hear it (broker/silence.py)."""
        rec.silence = silence
        detail = f"degraded: {silence}" if silence else "exact"
        self._publish.watch(ENGINE, "engine_exactness", engine_id=rec.engine_id, detail=detail)
        self._publish.mirror_engine(rec)

    def find_fingerprint(self, lid: str) -> pb.LayoutFingerprint | None:
        return self._registry.find_fingerprint(lid)

    def expired(self, now: float, limit: int) -> list[EngineRecord]:
        return self._registry.expired(now, limit)

    def expire_at(self, rec: EngineRecord, when: float) -> None:
        self._registry.expire_at(rec, when)

    def resume(
        self, info: pb.EngineInfo, session_id: str, ttl_s: float, expected_ranks: int, now: float
    ) -> EngineRecord | None:
        rec = self._registry.resume(info, session_id, ttl_s, expected_ranks, now)
        if rec is not None:
            self._publish.watch(ENGINE, "engine_resumed", engine_id=rec.engine_id, detail=rec.layout_id)
        return rec

    def owns(self, rec: EngineRecord) -> bool:
        return self._registry.owns(rec)

    def forget(self, rec: EngineRecord) -> None:
        self._registry.forget(rec)

    def extend_sessions(self, seconds: float) -> None:
        self._registry.extend_sessions(seconds)

    def incompatibility(self, reader: EngineRecord, holder: EngineRecord) -> str | None:
        return self._registry.incompatibility(reader, holder)
