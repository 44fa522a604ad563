"""The LeaseTable on Redis/Valkey: every transition is one atomic Lua script (fleet/lease_scripts.py).

Shared by every broker replica of a fleet. Each lease is a hash; the live
leases sit in a sorted set by deadline (the fleet's expiry queue) and in a set
per holder and per reader. All keys share one hash tag, so the scripts run on
one Redis Cluster slot.

The epoch is the fencing token: every transition bumps it inside the script,
and a release that names an epoch commits only at that epoch, so a reader that
lost a race with a revoke (on any replica) cannot commit a stale read.

A lease that Redis no longer has (it was lost with an unreplicated write, or
ended long ago) reads as unknown, never as live: its release fails and the
reader recomputes.

Deadlines are seconds of the core's clock, which for a shared store must be
the same on every replica (the broker uses wall-clock time in this mode).

Expiry: `expire_if_due` answers from this replica's copy, without a round trip,
unless that copy is live and due; claim, renew and release check the deadline
again inside their scripts, so a lease another replica shortened (a claim) and
that is now due ends there and then, and the next `revoke_expired` reports it
so its parties are told.

The limit of live leases per engine is counted inside the create and claim
scripts, so it holds exactly across replicas, and a create answers nothing a
caller needs to read back. A claim by the reader the hold named is one script;
one by another reader answers the lease first so the core can vet the pair.

Lease objects are cached per replica (weakly) and refreshed in place from each
script's answer, so a caller holding a Lease sees its new state, as with the
in-memory table.
"""

from __future__ import annotations

import math
import secrets
import struct
import sys
import time
import weakref
from array import array
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

from kvbroker.broker.errors import BrokerError, FailedPrecondition, NotFound, PermissionDenied, shown
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.lease_scripts import CREATE, DRAIN, EXPIRE_DUE, NUDGE, TRANSITION
from kvbroker.broker.leases import (
    BLOCK_ID_CODE,
    HASH_CODE,
    Lease,
    Vet,
    about,
    ended_cause,
    packed_block_ids,
    packed_hashes,
    too_many_held,
    too_many_read,
)
from kvbroker.common.causes import Cause
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier

# How long a replica may go without an expiry pass against the store when nothing it knows of is
# due: a deadline another replica set since this one's last pass is that replica's to meet; if it
# died meanwhile, this one meets it within this long.
PASS_AT_LEAST_EVERY_S = 0.25
# How long lease-end notices wait in a holder's inbox that nobody takes (its engine gone).
INBOX_KEEP_MS = 60_000
# How long after a notice went into a holder's inbox its replica is nudged to take it, if no hold
# of the holder took it first; checked at each expiry pass (every 50 ms by default).
NUDGE_AFTER_S = 0.02

_STATES = {str(int(s)).encode(): s for s in LeaseState}  # a lease hash's `st` field
_CAUSES = {str(int(c)).encode(): c for c in RevokeCause}  # its `c` field
# The fields the scripts answer, in the order of their `fields` (HMGET); a read by name (HGETALL) is
# put in this order too.
_FIELDS = (
    b"id",
    b"h",
    b"r",
    b"lay",
    b"ten",
    b"tier",
    b"bh",
    b"bi",
    b"st",
    b"ttl",
    b"dl",
    b"ep",
    b"c",
    b"d",
    b"q",
)


def _pack(values: Sequence[int], code: str) -> bytes:
    """Big-endian, one struct call for all of them (`code`: Q for hashes, I for block ids)."""
    return struct.pack(f">{len(values)}{code}", *values)


def _unpack(raw: bytes, code: str) -> array[int]:
    """Big-endian packed values (as _pack wrote them) as a packed array, no Python int per value."""
    values = array(code)
    values.frombytes(raw)
    if sys.byteorder == "little":
        values.byteswap()
    return values


class _WeakLeases:
    """Lease objects by id, held weakly: plain weak references in a dict (WeakValueDictionary's
    Python layers per get and set, and its callback per entry, cost more than the lookup itself),
    the dead ones dropped whenever the dict has doubled since the last sweep."""

    def __init__(self) -> None:
        self._refs: dict[str, weakref.ref[Lease]] = {}
        self._sweep_at = 1024

    def get(self, lease_id: str) -> Lease | None:
        ref = self._refs.get(lease_id)
        return ref() if ref is not None else None

    def __setitem__(self, lease_id: str, lease: Lease) -> None:
        refs = self._refs
        refs[lease_id] = weakref.ref(lease)
        if len(refs) >= self._sweep_at:
            for dead in [k for k, ref in refs.items() if ref() is None]:
                del refs[dead]
            self._sweep_at = max(1024, 2 * len(refs))

    def __len__(self) -> int:
        return len(self._refs)


class RedisLeaseTable:
    """LeaseTable over a shared Redis; `history` ended leases stay answerable for `history_s`."""

    def __init__(self, state: RedisState, history: int = 10_000, history_s: float = 600.0) -> None:
        self._state = state
        self._r: Any = state.client  # redis-py's return types are unions of every reply shape
        self._p = f"{state.prefix}:{{leases}}:"
        # Scripts name their keys from the prefix; this key (same hash tag) routes them to its slot.
        self._route = [self._p + "exp"]
        self._history = history
        self._keep_ms = int(history_s * 1000)
        self._transition = state.script(TRANSITION)
        self._create = state.script(CREATE)
        self._expire_due = state.script(EXPIRE_DUE)
        self._drain = state.script(DRAIN)
        # Holders' inboxes of lease-end notices (see broker/fleet/notify.py): the engines whose
        # sessions this replica serves (a hold of theirs takes their inbox in its script), and who
        # gets what a hold took (the holder's engine id, the notices).
        self.inbox_holders: Container[str] = frozenset()
        self.on_ends: Callable[[str, list[bytes]], None] | None = None
        self._nudges: dict[str, tuple[float, str, str]] = {}  # holder -> first push, channel, message
        self._cache = _WeakLeases()
        self._expired_here: list[Lease] = []  # expired by a transition's script, reported by revoke_expired
        # The earliest deadline in the store at the last pass, or set here since (see revoke_expired).
        self._next_due = -math.inf
        self._passed = -math.inf  # the `now` of that pass
        # Unique across replicas and restarts without a round trip: a random part per process.
        self._prefix = secrets.token_hex(6)
        self._ids = 0

    # -- from Redis to Lease objects -------------------------------------------

    def _lease(self, values: Sequence[bytes | None]) -> Lease:
        """A Lease from a script's answer: its fields in _FIELDS' order (no names to match)."""
        lid_raw, holder, reader, lay, ten, tier, bh, bi, st, ttl, dl, ep, c, d, q = values
        lid = lid_raw.decode()  # type: ignore[union-attr]
        state = _STATES[st]  # type: ignore[index]
        lease = self._cache.get(lid)
        if lease is None:
            lease = Lease(
                lease_id=lid,
                holder=holder.decode(),  # type: ignore[union-attr]
                reader="",
                namespace=Namespace(lay.decode(), ten.decode()),  # type: ignore[union-attr]
                tier=Tier(int(tier)),  # type: ignore[arg-type]
                block_hashes=_unpack(bh, HASH_CODE),  # type: ignore[arg-type]
                block_ids=array(BLOCK_ID_CODE),
                state=state,
                ttl_s=0.0,
                deadline=0.0,
                request_id=q.decode() if q else "",
            )
            self._cache[lid] = lease
        lease.reader = reader.decode()  # type: ignore[union-attr]
        lease.block_ids = _unpack(bi, BLOCK_ID_CODE)  # type: ignore[arg-type]
        lease.state = state
        lease.ttl_s = float(ttl)  # type: ignore[arg-type]
        lease.deadline = float(dl)  # type: ignore[arg-type]
        lease.epoch = int(ep)  # type: ignore[arg-type]
        lease.cause = _CAUSES[c] if c else RevokeCause.NONE
        lease.detail = d.decode() if d else ""
        if state.live and lease.deadline < self._next_due:
            self._next_due = lease.deadline  # set here (a claim, an activation, a renewal)
        return lease

    def _named(self, f: dict[Any, Any]) -> Lease:
        """A Lease from its hash as read by name (HGETALL: a dict, or a flat list of names and values)."""
        if not isinstance(f, dict):
            f = dict(zip(f[::2], f[1::2], strict=True))
        return self._lease([f.get(name) for name in _FIELDS])

    def _run(self, op: str, lease_id: str, *args: Any) -> list[Any]:
        argv = [self._p, op, lease_id, self._history, self._keep_ms, *args]
        answer: list[Any] = self._state.run(self._transition, self._route, argv)
        return answer

    def _done(self, op: str, lease_id: str, *args: Any) -> Lease:
        return self._answer(op, lease_id, self._run(op, lease_id, *args), args)

    def _answer(self, op: str, lease_id: str, answer: list[Any], args: tuple[Any, ...]) -> Lease:
        if answer[0] == b"ok":
            return self._lease(answer[1:])
        if answer[0] == b"X":  # its deadline had passed: the script expired it (told at the next pass)
            lease = self._lease(answer[1:])
            self._expired_here.append(lease)
            raise _refusal(op, "ended", lease, str(args[0]), args)
        if answer[0] == b"L":  # a claim by a reader already at the limit of live leases
            raise too_many_read(args[0], int(answer[1]), int(args[4]))
        code = answer[1].decode()
        if code == "unknown":
            raise _unknown(lease_id)
        lease = self._lease(answer[2:])
        raise _refusal(op, code, lease, str(args[0]) if args else "", args)

    # -- LeaseTable --------------------------------------------------------------

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
        self._ids += 1
        lid = f"{self._prefix}-{self._ids:x}"
        hashes, ids = packed_hashes(block_hashes), packed_block_ids(block_ids)
        argv = [self._p, lid, holder, reader, max_leases, repr(deadline)]
        argv += ["id", lid, "h", holder, "r", reader, "lay", namespace.layout_id, "ten", namespace.tenant]
        argv += ["tier", int(tier), "bh", _pack(hashes, "Q"), "bi", _pack(ids, "I"), "st", int(state)]
        argv += ["ttl", repr(ttl_s), "ttlshown", f"{ttl_s:g}", "dl", repr(deadline), "ep", 1, "c", 0]
        argv += ["d", "", "q", request_id]
        keys = self._route
        if holder in self.inbox_holders:
            keys = [keys[0], self.inbox(holder)]
        refused = self._state.run(self._create, keys, argv)
        ends: list[bytes] = []
        if refused and refused[0] == b"ends":
            ends, refused = refused[1:], None
        if refused:
            count = int(refused[1])
            if refused[0] == b"held":
                raise too_many_held(holder, count, max_leases)
            raise too_many_read(reader, count, max_leases)
        # The script wrote exactly these fields: the lease is known without reading it back.
        lease = Lease(
            lid,
            holder,
            reader,
            namespace,
            tier,
            hashes,
            ids,
            state,
            ttl_s,
            deadline,
        )
        lease.request_id = request_id
        self._cache[lid] = lease
        self._next_due = min(self._next_due, deadline)
        if ends and self.on_ends is not None:
            self.on_ends(holder, ends)
        return lease

    # -- holders' inboxes of lease-end notices ------------------------------------

    def inbox(self, holder: str) -> str:
        return self._p + "n:" + holder

    def push_end(self, holder: str, notice: bytes, nudge: tuple[str, str] | None = None) -> None:
        """Into the holder's inbox, without waiting for the store's answer. `nudge`: a channel and
        a message to publish there if the inbox still holds notices NUDGE_AFTER_S later (the
        holder made no hold to take them), sent by an expiry pass (`revoke_expired`)."""
        key = self.inbox(holder)
        self._state.send_unwaited(("RPUSH", key, notice), ("PEXPIRE", key, INBOX_KEEP_MS))
        if nudge is not None:
            since = self._nudges.get(holder)
            self._nudges[holder] = (since[0] if since else time.monotonic(), *nudge)

    def _nudge_due(self) -> None:
        due = time.monotonic() - NUDGE_AFTER_S
        holders = [h for h, (since, _, _) in self._nudges.items() if since <= due]
        if not holders:
            return
        try:
            self.nudge(holders, [self._nudges[h][1:] for h in holders])
        except BrokerError:
            return  # the store is away: the next pass tries again
        for h in holders:
            del self._nudges[h]

    def take_ends(self, holder: str) -> list[bytes]:
        """The notices waiting in the holder's inbox, taken from it."""
        answer = self._state.run(self._drain, [self.inbox(holder)], [])
        return list(answer[1:]) if answer else []

    def nudge(self, holders: Sequence[str], messages: Sequence[tuple[str, str]]) -> None:
        """Publish each (channel, message) whose holder's inbox still holds notices, unwaited."""
        argv = [x for pair in messages for x in pair]
        keys = [self.inbox(h) for h in holders]
        self._state.send_unwaited(("EVAL", NUDGE, len(keys), *keys, *argv))

    def get(self, lease_id: str) -> Lease:
        flat = self._state.command("HGETALL", self._p + "l:" + lease_id)
        if not flat:
            raise _unknown(lease_id)
        return self._named(flat)

    def claim(
        self,
        lease_id: str,
        reader: str,
        ttl_s: float,
        now: float,
        max_leases: int = 0,
        vet: Vet | None = None,
    ) -> Lease:
        args = (reader, repr(now), repr(ttl_s), f"{ttl_s:g}", max_leases)
        if vet is not None:
            # One round trip when the hold named this reader (vetted as it was made); otherwise the
            # script answers the lease unchanged, the caller vets it, and the claim runs unvetted.
            answer = self._run("claim", lease_id, *args, 1)
            if answer[0] != b"V":
                return self._answer("claim", lease_id, answer, args)
            vet(self._lease(answer[1:]))
        return self._done("claim", lease_id, *args, 0)

    def activate(self, lease_id: str, holder: str, block_ids: Sequence[int], now: float) -> Lease:
        return self._done("activate", lease_id, holder, repr(now), _pack(block_ids, "I"))

    def renew(self, lease_id: str, engine_id: str, ttl_s: float, now: float) -> Lease:
        return self._done("renew", lease_id, engine_id, repr(now), repr(ttl_s))

    def release(self, lease_id: str, reader: str, epoch: int, now: float) -> Lease:
        return self._done("release", lease_id, reader, repr(now), int(epoch))

    def revoke(self, lease_id: str, cause: RevokeCause, detail: str) -> Lease | None:
        answer = self._run("revoke", lease_id, int(cause), detail)
        if not answer:
            return None
        self._state.durable()  # its parties are told next: the end must outlive a store failover
        return self._lease(answer[1:])

    def expire_if_due(self, lease_id: str, now: float) -> Lease | None:
        cached = self._cache.get(lease_id)
        if cached is None or not cached.state.live or cached.deadline > now:
            # Not due as far as this replica knows (or not known here): no round trip. Claim,
            # renew and release check the deadline again in their scripts (another replica may
            # have shortened it); what they expire, revoke_expired reports at the next pass.
            return None
        answer = self._run("expire_if_due", lease_id, repr(now))
        if not answer:
            return None
        self._state.durable()
        return self._lease(answer[1:])

    def revoke_expired(self, now: float, limit: int) -> list[Lease]:
        """The leases due by `now` (at most `limit`), expired in the store, plus those a transition's
        script expired here since. The store is asked only when something this replica knows of is
        due (the earliest deadline the store had at the last pass, or one set here since) or
        PASS_AT_LEAST_EVERY_S has passed: an idle fleet costs the store a few calls a second, not 20
        per replica."""
        if self._nudges:
            self._nudge_due()
        ended, self._expired_here = self._expired_here, []
        if self._passed <= now < min(self._next_due, self._passed + PASS_AT_LEAST_EVERY_S):
            if ended:
                self._state.durable()
            return ended
        argv = [self._p, repr(now), limit, self._history, self._keep_ms]
        first, *expired = self._state.run(self._expire_due, self._route, argv)
        self._passed = now
        self._next_due = float(first) if first else math.inf
        ended += [self._lease(flat) for flat in expired]
        if ended:
            self._state.durable()
        return ended

    def _many(self, ids: Iterable[bytes | str]) -> list[Lease]:
        pipe = self._r.pipeline(transaction=False)
        for lid in ids:
            pipe.hgetall(self._p + "l:" + (lid.decode() if isinstance(lid, bytes) else lid))
        found = self._state.call(pipe.execute)
        return [self._named(h) for h in found if h]

    def by_holder(self, engine_id: str) -> list[Lease]:
        ids = self._state.command("SMEMBERS", self._p + "h:" + engine_id)
        return [lease for lease in self._many(ids) if lease.state.live] if ids else []

    def by_reader(self, engine_id: str) -> list[Lease]:
        ids = self._state.command("SMEMBERS", self._p + "r:" + engine_id)
        return [lease for lease in self._many(ids) if lease.state.live] if ids else []

    def count_by_holder(self, engine_id: str) -> int:
        n: int = self._state.call(self._r.scard, self._p + "h:" + engine_id)
        return n

    def count_by_reader(self, engine_id: str) -> int:
        n: int = self._state.call(self._r.scard, self._p + "r:" + engine_id)
        return n

    def live(self) -> Iterable[Lease]:
        ids = self._state.call(self._r.zrange, self._p + "exp", 0, -1)
        return [lease for lease in self._many(ids) if lease.state.live]

    def recently_ended(self) -> Iterable[Lease]:
        return self._many(self._state.call(self._r.zrange, self._p + "ended", 0, -1))

    def live_counts(self) -> dict[LeaseState, int]:
        counts = {LeaseState.PENDING: 0, LeaseState.HELD: 0, LeaseState.ACTIVE: 0}
        for lease in self.live():
            counts[lease.state] += 1
        return counts


def _unknown(lease_id: str) -> NotFound:
    return NotFound(
        f"unknown lease {shown(lease_id)} (never existed, ended long ago, or lost by the shared "
        "state store): discard anything read under it and recompute",
        Cause.UNKNOWN_LEASE,
        {"lease_id": lease_id},
    )


def _refusal(op: str, code: str, lease: Lease, who: str, args: tuple[Any, ...]) -> Exception:
    """The same errors, word for word, as the in-memory table's."""
    lid = lease.lease_id
    if code == "ended":
        if lease.state is LeaseState.RELEASED:
            return FailedPrecondition(f"lease {lid} was already released", Cause.RELEASED, about(lease))
        detail = f": {lease.detail}" if lease.detail else ""
        return FailedPrecondition(
            f"lease {lid} was revoked ({lease.cause.label}){detail}; discard anything read under it "
            "and recompute",
            ended_cause(lease),
            about(lease),
        )
    if code == "reader" and op == "claim":
        return PermissionDenied(
            f"lease {lid} is held for reader {shown(lease.reader)}, not {shown(who)}",
            metadata=about(lease, engine_id=who),
        )
    if code == "reader":
        return PermissionDenied(
            f"lease {lid} is read by {shown(lease.reader)}, not {shown(who)}",
            metadata=about(lease, engine_id=who),
        )
    if code == "holder":
        return PermissionDenied(
            f"lease {lid} belongs to holder {shown(lease.holder)}, not {shown(who)}",
            metadata=about(lease, engine_id=who),
        )
    if code == "party":
        return PermissionDenied(
            f"engine {shown(who)} is neither holder nor reader of lease {lid}",
            metadata=about(lease, engine_id=who),
        )
    if code == "pending":
        return FailedPrecondition(
            f"lease {lid} is pending a pin; renew it once it is active", Cause.WRONG_LEASE_STATE, about(lease)
        )
    if code == "epoch":
        return FailedPrecondition(
            f"lease {lid} is at epoch {lease.epoch}, release named epoch {args[2]}",
            Cause.STALE_EPOCH,
            about(lease, epoch=str(lease.epoch)),
        )
    wanted = {"claim": "only a held lease can be acquired", "release": "only an active lease can be released"}
    if op == "activate":
        return FailedPrecondition(
            f"lease {lid} is {lease.state.label}, not pending a pin", Cause.WRONG_LEASE_STATE, about(lease)
        )
    return FailedPrecondition(
        f"lease {lid} is {lease.state.label}; {wanted.get(op, 'wrong state')}",
        Cause.WRONG_LEASE_STATE,
        about(lease),
    )
