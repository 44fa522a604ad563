"""Leases: the record, the LeaseTable interface and its in-memory implementation.

A lease is a holder's promise to keep blocks unchanged for a reader until the
lease ends. Life cycle:

    HELD ──claim──▶ ACTIVE ──release──▶ RELEASED
    PENDING ──pin ok──▶ ACTIVE
    any live state ──revoke / TTL / pin timeout──▶ REVOKED(cause)

The table only keeps the books; telling the engines is the core's job, so
every method returns the leases it changed.
"""

from __future__ import annotations

import itertools
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvbroker.broker.errors import FailedPrecondition, NotFound, PermissionDenied, ResourceExhausted, shown
from kvbroker.broker.expiry import ExpiryQueue
from kvbroker.common.causes import Cause
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier

# A lease's hashes are most of its memory: packed, 8 bytes a hash and 4 a block id (Python ints
# in a tuple cost about 96 bytes a block). bench/control_plane/lease_memory.py measures both.
HASH_CODE = "Q"  # fixed64 on the wire
BLOCK_ID_CODE = "I"  # uint32 on the wire
BYTES_PER_BLOCK = array(HASH_CODE).itemsize + array(BLOCK_ID_CODE).itemsize
# A lease's own cost besides its blocks (the record, its ids, its entries in the table's maps
# and expiry queue), rounded up from bench/control_plane/lease_memory.py.
BYTES_PER_LEASE = 1_024


def packed_hashes(values: Iterable[int]) -> array[int]:
    return values if isinstance(values, array) and values.typecode == HASH_CODE else array(HASH_CODE, values)


def packed_block_ids(values: Iterable[int]) -> array[int]:
    if isinstance(values, array) and values.typecode == BLOCK_ID_CODE:
        return values
    return array(BLOCK_ID_CODE, values)


@dataclass(slots=True, weakref_slot=True)  # weakly cached by the Redis table
class Lease:
    lease_id: str
    holder: str
    reader: str  # "" while HELD without a named reader
    namespace: Namespace
    tier: Tier
    block_hashes: array[int]  # packed (packed_hashes)
    block_ids: array[int]  # packed (packed_block_ids), parallel to block_hashes; empty while PENDING
    state: LeaseState
    ttl_s: float  # granted TTL, used when a PENDING/HELD lease becomes ACTIVE
    deadline: float  # monotonic seconds; PENDING: the pin deadline
    epoch: int = 1
    cause: RevokeCause = RevokeCause.NONE
    detail: str = ""
    request_id: str = ""

    def remaining_ms(self, now: float) -> int:
        if not self.state.live:
            return 0
        return max(0, int((self.deadline - now) * 1000))


Vet = Callable[[Lease], None]


class LeaseTable(Protocol):
    """The books of all live leases plus a bounded history of ended ones."""

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
        """A new live lease. With `max_leases`, refused (RESOURCE_EXHAUSTED) when the holder, or
        the named reader, already has that many live leases: checked and created in one step."""
        ...

    def get(self, lease_id: str) -> Lease:
        """A live or recently ended lease; NotFound otherwise."""
        ...

    def claim(
        self,
        lease_id: str,
        reader: str,
        ttl_s: float,
        now: float,
        max_leases: int = 0,
        vet: Vet | None = None,
    ) -> Lease:
        """HELD -> ACTIVE for `reader`. `vet` sees the lease first (any state) and raises to refuse;
        a table may skip it for a lease that named this reader when it was held (the hold checked
        that pair). With `max_leases`, a reader the lease did not name yet must read fewer."""
        ...

    def activate(self, lease_id: str, holder: str, block_ids: Sequence[int], now: float) -> Lease: ...
    def renew(self, lease_id: str, engine_id: str, ttl_s: float, now: float) -> Lease: ...
    def release(self, lease_id: str, reader: str, epoch: int, now: float) -> Lease: ...
    def revoke(self, lease_id: str, cause: RevokeCause, detail: str) -> Lease | None: ...
    def expire_if_due(self, lease_id: str, now: float) -> Lease | None: ...
    def revoke_expired(self, now: float, limit: int) -> list[Lease]: ...
    def by_holder(self, engine_id: str) -> list[Lease]: ...
    def by_reader(self, engine_id: str) -> list[Lease]: ...
    def count_by_holder(self, engine_id: str) -> int: ...
    def count_by_reader(self, engine_id: str) -> int: ...
    def live(self) -> Iterable[Lease]: ...
    def recently_ended(self) -> Iterable[Lease]: ...
    def live_counts(self) -> dict[LeaseState, int]: ...


def ended_cause(lease: Lease) -> Cause:
    """Why an ended lease ended: "released", or its revoke cause."""
    return Cause.RELEASED if lease.state is LeaseState.RELEASED else Cause(lease.cause.label)


def about(lease: Lease, **more: str) -> dict[str, str]:
    """An error's metadata: the lease, its state, and `more` ids."""
    return {"lease_id": lease.lease_id, "state": lease.state.label, **more}


def too_many_held(holder: str, held: int, limit: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"engine {shown(holder)} holds {held} live leases, the limit (--max-leases-per-engine); "
        "free or release some first",
        metadata={"engine_id": holder, "limit": str(limit)},
    )


def too_many_read(reader: str, read: int, limit: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"engine {shown(reader)} reads {read} live leases, the limit (--max-leases-per-engine); "
        "release some first",
        metadata={"engine_id": reader, "limit": str(limit)},
    )


def _ended_error(lease: Lease) -> FailedPrecondition:
    if lease.state is LeaseState.RELEASED:
        return FailedPrecondition(
            f"lease {lease.lease_id} was already released", Cause.RELEASED, about(lease)
        )
    detail = f": {lease.detail}" if lease.detail else ""
    return FailedPrecondition(
        f"lease {lease.lease_id} was revoked ({lease.cause.label}){detail}; "
        "discard anything read under it and recompute",
        ended_cause(lease),
        about(lease),
    )


class InMemoryLeaseTable:
    def __init__(self, history: int = 10_000, history_blocks: int = 1_000_000) -> None:
        self._live: dict[str, Lease] = {}
        self._ended: OrderedDict[str, Lease] = OrderedDict()
        # Bounded in leases and in blocks: a lease's hashes are most of its cost.
        self._history = history
        self._history_blocks = history_blocks
        self._ended_blocks = 0
        self._by_holder: dict[str, set[str]] = {}
        self._by_reader: dict[str, set[str]] = {}
        self._expiry = ExpiryQueue()
        # Ids are unique across broker restarts, so a lease id from a previous
        # broker never names a lease of this one.
        self._prefix = secrets.token_hex(4)
        self._ids = itertools.count(1)

    # -- creation and lookup -------------------------------------------------

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
        if max_leases:
            if (held := len(self._by_holder.get(holder, ()))) >= max_leases:
                raise too_many_held(holder, held, max_leases)
            if reader and (read := len(self._by_reader.get(reader, ()))) >= max_leases:
                raise too_many_read(reader, read, max_leases)
        lease = Lease(
            lease_id=f"{self._prefix}-{next(self._ids):x}",
            holder=holder,
            reader=reader,
            namespace=namespace,
            tier=tier,
            block_hashes=packed_hashes(block_hashes),
            block_ids=packed_block_ids(block_ids),
            state=state,
            ttl_s=ttl_s,
            deadline=deadline,
            request_id=request_id,
        )
        self._live[lease.lease_id] = lease
        self._by_holder.setdefault(holder, set()).add(lease.lease_id)
        if reader:
            self._by_reader.setdefault(reader, set()).add(lease.lease_id)
        self._expiry.schedule(lease.lease_id, deadline)
        return lease

    def get(self, lease_id: str) -> Lease:
        lease = self._live.get(lease_id) or self._ended.get(lease_id)
        if lease is None:
            raise NotFound(
                f"unknown lease {shown(lease_id)} (never existed, or ended long ago)",
                Cause.UNKNOWN_LEASE,
                {"lease_id": lease_id},
            )
        return lease

    def _get_live(self, lease_id: str) -> Lease:
        lease = self.get(lease_id)
        if not lease.state.live:
            raise _ended_error(lease)
        return lease

    # -- transitions ---------------------------------------------------------

    def claim(
        self,
        lease_id: str,
        reader: str,
        ttl_s: float,
        now: float,
        max_leases: int = 0,
        vet: Vet | None = None,
    ) -> Lease:
        if vet is not None or max_leases:
            lease = self.get(lease_id)
            if vet is not None:
                vet(lease)
            read = len(self._by_reader.get(reader, ()))
            if max_leases and lease.reader != reader and read >= max_leases:
                raise too_many_read(reader, read, max_leases)
        lease = self._get_live(lease_id)
        if lease.state is not LeaseState.HELD:
            raise FailedPrecondition(
                f"lease {lease_id} is {lease.state.label}; only a held lease can be acquired",
                Cause.WRONG_LEASE_STATE,
                about(lease),
            )
        if lease.reader and lease.reader != reader:
            raise PermissionDenied(
                f"lease {lease_id} is held for reader {shown(lease.reader)}, not {shown(reader)}",
                metadata=about(lease, engine_id=reader),
            )
        if not lease.reader:
            lease.reader = reader
            self._by_reader.setdefault(reader, set()).add(lease_id)
        lease.state = LeaseState.ACTIVE
        lease.epoch += 1
        lease.ttl_s = ttl_s
        lease.deadline = now + ttl_s  # claiming may shorten a hold: the reader sets the pace
        self._expiry.schedule(lease_id, lease.deadline)
        return lease

    def activate(self, lease_id: str, holder: str, block_ids: Sequence[int], now: float) -> Lease:
        lease = self._get_live(lease_id)
        if lease.holder != holder:
            raise PermissionDenied(
                f"lease {lease_id} belongs to holder {shown(lease.holder)}, not {shown(holder)}",
                metadata=about(lease, engine_id=holder),
            )
        if lease.state is not LeaseState.PENDING:
            raise FailedPrecondition(
                f"lease {lease_id} is {lease.state.label}, not pending a pin",
                Cause.WRONG_LEASE_STATE,
                about(lease),
            )
        lease.block_ids = packed_block_ids(block_ids)
        lease.state = LeaseState.ACTIVE
        lease.epoch += 1
        lease.deadline = now + lease.ttl_s
        self._expiry.schedule(lease_id, lease.deadline)
        return lease

    def renew(self, lease_id: str, engine_id: str, ttl_s: float, now: float) -> Lease:
        lease = self._get_live(lease_id)
        if engine_id not in (lease.holder, lease.reader):
            raise PermissionDenied(
                f"engine {shown(engine_id)} is neither holder nor reader of lease {lease_id}",
                metadata=about(lease, engine_id=engine_id),
            )
        if lease.state is LeaseState.PENDING:
            raise FailedPrecondition(
                f"lease {lease_id} is pending a pin; renew it once it is active",
                Cause.WRONG_LEASE_STATE,
                about(lease),
            )
        # Renew only extends: a shorter TTL never cuts a promise already made.
        if now + ttl_s > lease.deadline:
            lease.deadline = now + ttl_s
        lease.epoch += 1
        return lease

    def release(self, lease_id: str, reader: str, epoch: int, now: float) -> Lease:
        lease = self._get_live(lease_id)
        if lease.state is not LeaseState.ACTIVE:
            raise FailedPrecondition(
                f"lease {lease_id} is {lease.state.label}; only an active lease can be released",
                Cause.WRONG_LEASE_STATE,
                about(lease),
            )
        if reader != lease.reader:
            raise PermissionDenied(
                f"lease {lease_id} is read by {shown(lease.reader)}, not {shown(reader)}",
                metadata=about(lease, engine_id=reader),
            )
        if epoch and epoch != lease.epoch:
            raise FailedPrecondition(
                f"lease {lease_id} is at epoch {lease.epoch}, release named epoch {epoch}",
                Cause.STALE_EPOCH,
                about(lease, epoch=str(lease.epoch)),
            )
        lease.state = LeaseState.RELEASED
        lease.epoch += 1
        self._end(lease)
        return lease

    def revoke(self, lease_id: str, cause: RevokeCause, detail: str) -> Lease | None:
        lease = self._live.get(lease_id)
        if lease is None:
            return None
        lease.state = LeaseState.REVOKED
        lease.cause = cause
        lease.detail = detail
        lease.epoch += 1
        self._end(lease)
        return lease

    def expire_if_due(self, lease_id: str, now: float) -> Lease | None:
        lease = self._live.get(lease_id)
        if lease is None or lease.deadline > now:
            return None
        return self._expire(lease)

    def _expire(self, lease: Lease) -> Lease | None:
        if lease.state is LeaseState.PENDING:
            return self.revoke(
                lease.lease_id, RevokeCause.HOLDER_REFUSED, "holder did not answer the pin in time"
            )
        return self.revoke(lease.lease_id, RevokeCause.TTL_EXPIRED, f"not renewed within {lease.ttl_s:g} s")

    def revoke_expired(self, now: float, limit: int) -> list[Lease]:
        ended: list[Lease] = []
        for lease_id in self._expiry.pop_due(now, limit):
            lease = self._live.get(lease_id)
            if lease is None:
                continue
            if lease.deadline > now:  # renewed since it was scheduled
                self._expiry.schedule(lease_id, lease.deadline)
                continue
            done = self._expire(lease)
            if done is not None:
                ended.append(done)
        return ended

    def _end(self, lease: Lease) -> None:
        lid = lease.lease_id
        del self._live[lid]
        self._expiry.remove(lid)
        self._discard(self._by_holder, lease.holder, lid)
        if lease.reader:
            self._discard(self._by_reader, lease.reader, lid)
        self._ended[lid] = lease
        self._ended_blocks += len(lease.block_hashes)
        while self._ended and (len(self._ended) > self._history or self._ended_blocks > self._history_blocks):
            _, old = self._ended.popitem(last=False)
            self._ended_blocks -= len(old.block_hashes)

    @staticmethod
    def _discard(index: dict[str, set[str]], key: str, lid: str) -> None:
        ids = index.get(key)
        if ids is not None:
            ids.discard(lid)
            if not ids:
                del index[key]

    # -- lookups ---------------------------------------------------------------

    def by_holder(self, engine_id: str) -> list[Lease]:
        return [self._live[i] for i in self._by_holder.get(engine_id, ())]

    def by_reader(self, engine_id: str) -> list[Lease]:
        return [self._live[i] for i in self._by_reader.get(engine_id, ())]

    def count_by_holder(self, engine_id: str) -> int:
        return len(self._by_holder.get(engine_id, ()))

    def count_by_reader(self, engine_id: str) -> int:
        return len(self._by_reader.get(engine_id, ()))

    def live(self) -> Iterable[Lease]:
        return list(self._live.values())

    def recently_ended(self) -> Iterable[Lease]:
        return list(self._ended.values())

    def live_counts(self) -> dict[LeaseState, int]:
        counts = {LeaseState.PENDING: 0, LeaseState.HELD: 0, LeaseState.ACTIVE: 0}
        for lease in self._live.values():
            counts[lease.state] += 1
        return counts
