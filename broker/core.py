"""BrokerCore: the synchronous domain core composing registry, index and lease table.

Every public method is one step of the protocol; it validates, changes state,
and tells the affected engines through the injected Notifier. Watchers and
index mirrors are fed by the wrappers the state is changed through
(observed.py), not from here. Time comes from the injected Clock; nothing here
awaits or touches the network.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbroker.broker.checks import Checks
from kvbroker.broker.clock import Clock, MonotonicClock
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.declines import DeclineBook
from kvbroker.broker.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable, shown
from kvbroker.broker.events import Notifier, NullNotifier
from kvbroker.broker.exactness import exact_only, score_candidates
from kvbroker.broker.holders import find_holders
from kvbroker.broker.inventory_backlog import IndexChange, InventoryBacklog
from kvbroker.broker.lease_stats import LeaseStats, ReadReport
from kvbroker.broker.leases import InMemoryLeaseTable, Lease, LeaseTable, ended_cause
from kvbroker.broker.mirror import MirrorHub, Mirrors
from kvbroker.broker.observed import ObservedIndex, ObservedLeaseTable, ObservedRegistry, Publisher
from kvbroker.broker.prompts import prompt_chain
from kvbroker.broker.registry import EngineRecord, EngineRegistry, Registry
from kvbroker.broker.results import ResolveResult, ScoreResult, Stats
from kvbroker.broker.silence import SilenceWatch
from kvbroker.common.causes import Cause
from kvbroker.common.index import CompactPrefixIndex, PrefixIndex
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier
from kvbroker.common.scoring import score_engines
from kvbroker.v1 import broker_pb2 as pb

CAUSE_LABELS = [c.label for c in RevokeCause if c is not RevokeCause.NONE]


class BrokerCore:
    def __init__(
        self,
        config: BrokerConfig | None = None,
        *,
        clock: Clock | None = None,
        notifier: Notifier | None = None,
        index: PrefixIndex | None = None,
        leases: LeaseTable | None = None,
        registry: Registry | None = None,
        mirrors: Mirrors | None = None,
        declines: DeclineBook | None = None,
    ) -> None:
        self.config = config or BrokerConfig()
        self.check = Checks(self.config)
        self.clock = clock or MonotonicClock()
        self.notifier: Notifier = notifier or NullNotifier()
        self.mirrors: Mirrors = mirrors or MirrorHub()
        # Watch and mirror events come from these wrappers as they change (see observed.py).
        publish = Publisher(self.notifier, self.mirrors)
        self.index = ObservedIndex(index or CompactPrefixIndex(self.config.index_memory_bytes), publish)
        history = (self.config.ended_lease_history, self.config.ended_lease_history_blocks)
        self.leases = ObservedLeaseTable(leases or InMemoryLeaseTable(*history), publish)
        self.registry = ObservedRegistry(EngineRegistry() if registry is None else registry, publish)
        self.leases.stats = LeaseStats(self.clock.now, self.registry.find_fingerprint)  # for /metrics
        self.revocations: dict[str, int] = dict.fromkeys(CAUSE_LABELS, 0)
        self.released_total, self.stalls_forgiven, self.stalled_s_forgiven = 0, 0, 0.0
        self.declines = DeclineBook() if declines is None else declines
        self.backlog = InventoryBacklog(self.index, self._supersede, self.registry, self.notifier)
        self.silence = SilenceWatch(self.registry)  # mirrors hear of silent engines (silence.py)

    # -- sessions ------------------------------------------------------------------

    def register(
        self, info: pb.EngineInfo, session_ttl_ms: int, expected_ranks: int = 0, resume_session_id: str = ""
    ) -> EngineRecord:
        """Open a session; an engine id whose old session is alive ends that session first. With
        shared state, a resume_session_id naming the engine's live session resumes it (leases kept)."""
        ttl_s = self.check.session_ttl_s(session_ttl_ms)
        self.check.engine(info)
        if resume_session_id:
            self.check.ident(resume_session_id, "resume_session_id")
            if rec := self.registry.resume(info, resume_session_id, ttl_s, expected_ranks, self.clock.now()):
                return rec
        old = self.registry.find(info.engine_id) if info.engine_id else None
        if old is not None:
            EngineRegistry.validate(info)  # a bad registration must not end a good session
            self.end_session(old.session_id, "ABORTED", "superseded: the engine registered a new session")
        rec = self.registry.add(info, ttl_s, expected_ranks, self.clock.now())
        # Readers that loaded an older generation's agents drop them now, not at their next lease.
        self.notifier.engine_generation(rec.engine_id, rec.generation, rec.layout_id)
        return rec

    def end_session(self, session_id: str, code: str = "", message: str = "") -> None:
        """End a session: drop its blocks from the index, revoke every lease it holds or reads.

        `code` non-empty means the broker ends it (the stream is closed with that
        code); empty means the stream already broke.
        """
        try:
            rec = self.registry.by_session(session_id)
        except NotFound:
            return
        if not code and not self.registry.owns(rec):
            self.registry.forget(rec)  # shared state: it moved to another replica; only our stream went
            return
        with self.registry.removing(rec, message or "session ended"):
            self.index.drop_holder(rec.engine_id)
            self.backlog.drop(session_id)  # a session that moved keeps its changes (inventory_backlog.py)
            for lease in self.leases.by_holder(rec.engine_id):
                self._revoke(lease, RevokeCause.HOLDER_GONE, f"holder {rec.engine_id!r} session ended")
            for lease in self.leases.by_reader(rec.engine_id):
                self._revoke(lease, RevokeCause.READER_GONE, f"reader {rec.engine_id!r} session ended")
            if code:
                self.notifier.close_session(session_id, code, message)

    def stream_ended(self, rec: EngineRecord) -> None:
        """The session's stream broke or ended: end the session. With the store away (Unavailable,
        raised), the first expiry pass after it is back ends it, not the session's TTL."""
        try:
            self.end_session(rec.session_id)
        except Unavailable:
            rec.stream_lost = True
            self.registry.expire_at(rec, self.clock.now())  # a record already gone is skipped there
            raise

    def heartbeat(self, rec: EngineRecord, load: float) -> None:
        rec.deadline = self.clock.now() + rec.ttl_s
        self.check.load(load, "heartbeat.load")
        self.registry.set_load(rec, load, self.clock.now())

    def register_rank(self, engine_id: str, rank: pb.RankInfo) -> EngineRecord:
        self.check.ident(engine_id, "engine_id")
        self.check.rank(rank)
        rec = self.registry.get(engine_id)
        self.check.rank_fits(rec, rank)
        return self.registry.add_rank(engine_id, rank)

    # -- inventory -----------------------------------------------------------------

    def update_inventory(
        self,
        rec: EngineRecord,
        ns: Namespace,
        tier: int,
        stored: Sequence[int],
        removed: Sequence[int],
        clear_all: bool = False,
    ) -> None:
        t = self.check.tier(tier)
        self.check.namespace(ns)
        self.check.layout(rec, ns)
        self.check.hashes(len(stored), "inventory.stored")
        self.check.hashes(len(removed), "inventory.removed")
        self.backlog.update(rec, IndexChange(ns, t, stored, removed, clear_all))

    def _supersede(
        self, rec: EngineRecord, ns: Namespace | None, tier: Tier, removed: Sequence[int] | None
    ) -> None:
        """A holder that drops blocks under a live lease broke its promise: the reader must not use them."""
        held = self.leases.by_holder(rec.engine_id)
        if not held:
            return
        gone = set(removed) if removed is not None else None
        for lease in held:
            if lease.tier != tier or (ns is not None and lease.namespace != ns):
                continue
            if gone is None or not gone.isdisjoint(lease.block_hashes):
                self._revoke(lease, RevokeCause.SUPERSEDED, f"holder {rec.engine_id!r} dropped leased blocks")

    # -- resolve ---------------------------------------------------------------------

    def resolve(
        self,
        asker: EngineRecord | None,
        ns: Namespace,
        hashes: Sequence[int],
        *,
        acquire: bool = False,
        lease_ttl_ms: int = 0,
        min_blocks: int = 0,
        request_id: str = "",
        require_exact: bool = False,
    ) -> ResolveResult:
        self.check.namespace(ns)
        self.check.hashes(len(hashes), "block_hashes")
        self.check.ident(request_id, "request_id")
        if asker is not None:
            self.check.layout(asker, ns)
        elif acquire:
            raise InvalidArgument(
                "acquire needs a reader: resolve over the engine's Session stream, or set the "
                "kvbroker-engine-id metadata on the unary call"
            )
        ttl_s = self.check.lease_ttl_s(lease_ttl_ms) if acquire else 0.0
        now = self.clock.now()
        matches = find_holders(self.index, self.registry, self.leases, asker, ns, hashes, now, require_exact)
        if not matches:
            return ResolveResult(matches, skipped_reason="no_holder")
        if not acquire:
            return ResolveResult(matches)
        assert asker is not None
        best = matches[0]
        if best.matched < max(min_blocks, 1):
            return ResolveResult(matches, skipped_reason="below_min")
        holder = self.registry.get(best.engine_id)
        most = self.config.leases_per_engine
        if best.hold_lease_id:
            lease = self.leases.claim(best.hold_lease_id, asker.engine_id, ttl_s, self.clock.now(), most)
            return ResolveResult(matches, lease=lease, holder=holder)
        self.check.lease_blocks(best.matched)
        now = self.clock.now()
        lease = self.leases.create(
            holder=holder.engine_id,
            reader=asker.engine_id,
            namespace=ns,
            tier=best.tier,
            block_hashes=hashes[: best.matched],
            block_ids=(),
            state=LeaseState.PENDING,
            ttl_s=ttl_s,
            deadline=now + self.config.pin_timeout_ms / 1000,
            request_id=request_id,
            max_leases=most,
        )
        self.notifier.pin(holder.session_id, lease)
        return ResolveResult(matches, lease=lease, holder=holder, pending=True)

    def pin_result(
        self,
        rec: EngineRecord,
        lease_id: str,
        ok: bool,
        block_ids: Sequence[int],
        error: str,
        given_up: bool = False,
    ) -> Lease:
        """The holder's answer to a PinCommand; with `given_up`, a pin it made and gave back since
        (a retention's GPU blocks that vLLM needed): the lease ends as memory_pressure."""
        lease = self.leases.get(lease_id)
        if lease.holder != rec.engine_id:
            raise FailedPrecondition(f"lease {lease_id} is not held by {rec.engine_id!r}", Cause.NOT_HOLDER)
        if not lease.state.live:
            return lease  # too late (pin timeout or a session ended); already settled
        if not ok:
            why = self.check.text(error) or (
                "GPU memory was needed" if given_up else "holder refused the pin"
            )
            cause = RevokeCause.MEMORY_PRESSURE if given_up else RevokeCause.HOLDER_REFUSED
            done = self.leases.revoke(lease_id, cause, why)
            if done is not None:
                self._after_revoke(done, tell_holder=False)  # it refused or gave up: nothing pinned
            return lease
        if len(block_ids) != len(lease.block_hashes):
            raise InvalidArgument(
                f"pin_result for lease {lease_id} has {len(block_ids)} block_ids for "
                f"{len(lease.block_hashes)} hashes; they must be parallel"
            )
        lease = self.leases.activate(lease_id, rec.engine_id, block_ids, self.clock.now())
        self.notifier.pin_settled(lease)
        return lease

    # -- leases ----------------------------------------------------------------------

    def hold(
        self,
        holder_id: str,
        ns: Namespace,
        tier: int,
        hashes: Sequence[int],
        block_ids: Sequence[int],
        ttl_ms: int = 0,
        reader_id: str = "",
        request_id: str = "",
    ) -> Lease:
        self.check.namespace(ns)
        t = self.check.tier(tier)
        if not hashes:
            raise InvalidArgument("block_hashes is empty; a hold needs at least one block")
        self.check.hashes(len(hashes), "block_hashes")
        self.check.ident(holder_id, "holder_engine_id")
        self.check.ident(reader_id, "reader_engine_id")
        self.check.ident(request_id, "request_id")
        if len(block_ids) != len(hashes):
            raise InvalidArgument(
                f"block_ids has {len(block_ids)} entries for {len(hashes)} block_hashes; they must be parallel"
            )
        ttl_s = self.check.lease_ttl_s(ttl_ms)
        holder = self.registry.get(holder_id)
        self.check.layout(holder, ns)
        if holder.draining:
            raise FailedPrecondition(
                f"engine {shown(holder_id)} is draining and takes no new holds", Cause.DRAINING
            )
        if reader_id:
            if reader_id == holder_id:
                raise InvalidArgument(
                    "reader_engine_id equals holder_engine_id; an engine does not lease to itself"
                )
            reader = self.registry.get(reader_id)
            self.check.readable(self.registry.incompatibility(reader, holder), reader_id, holder_id)
        self.check.lease_blocks(len(hashes))
        now = self.clock.now()
        if request_id and self.declines.take(holder_id, request_id, now):
            raise FailedPrecondition(
                f"request {shown(request_id)} of {shown(holder_id)} was declined before its hold arrived: "
                "nobody will read it; free the blocks",
                cause=RevokeCause.DECLINED.label,
            )
        return self.leases.create(
            holder=holder_id,
            reader=reader_id,
            namespace=ns,
            tier=t,
            block_hashes=hashes,
            block_ids=block_ids,
            state=LeaseState.HELD,
            ttl_s=ttl_s,
            deadline=now + ttl_s,
            request_id=request_id,
            max_leases=self.config.leases_per_engine,
        )

    def _expire_now(self, lease_id: str) -> None:
        """Settle a lease whose deadline passed before the expiry loop got to it."""
        lease = self.leases.expire_if_due(lease_id, self.clock.now())
        if lease is not None:
            self._after_revoke(lease)

    def acquire(self, lease_id: str, reader_id: str, ttl_ms: int = 0) -> tuple[Lease, EngineRecord]:
        ttl_s = self.check.lease_ttl_s(ttl_ms)
        if not reader_id:
            raise InvalidArgument("reader_engine_id is empty")
        reader = self.registry.get(reader_id)
        self._expire_now(lease_id)

        def vet(lease: Lease) -> None:  # a hold that named this reader was vetted as it was made
            holder = self.registry.find(lease.holder)
            if holder is not None and lease.state.live:
                self.check.readable(self.registry.incompatibility(reader, holder), reader_id, lease.holder)
            if lease.holder == reader_id:
                raise InvalidArgument("an engine cannot acquire its own hold")

        most = self.config.leases_per_engine
        lease = self.leases.claim(lease_id, reader_id, ttl_s, self.clock.now(), most, vet)
        holder = self.registry.find(lease.holder)
        assert holder is not None  # a live lease always has a live holder
        return lease, holder

    def renew(self, lease_id: str, engine_id: str, ttl_ms: int = 0) -> Lease:
        ttl_s = self.check.lease_ttl_s(ttl_ms)
        self._expire_now(lease_id)
        return self.leases.renew(lease_id, engine_id, ttl_s, self.clock.now())

    def release(self, lease_id: str, reader_id: str, epoch: int = 0, read: ReadReport | None = None) -> Lease:
        """Commit the read: succeeds only while the lease is ACTIVE, by its reader.
        ``read``: what the reader says it read (lease_stats.py counts it)."""
        self._expire_now(lease_id)
        lease = self.leases.release(lease_id, reader_id, epoch, self.clock.now(), read)
        self.released_total += 1
        holder = self.registry.find(lease.holder)
        if holder is not None:
            self.notifier.lease_ended(holder.session_id, lease)
        return lease

    def decline(self, holder_id: str, request_id: str, reason: str = "") -> Lease | None:
        """Nobody will read the holder's unclaimed hold of ``request_id``: end it now.

        Returns the lease it ended, or None when no such hold is live: it may
        not have arrived yet, and is then refused when it does (or it ended
        already, and the note expires unused). A claimed (ACTIVE) lease is a
        reader's and is not ended here.
        """
        if not holder_id or not request_id:
            raise InvalidArgument("a decline names the holder_engine_id and the request_id of the hold")
        self.check.ident(holder_id, "holder_engine_id")
        self.check.ident(request_id, "request_id")
        reason = self.check.text(reason)
        leases = [lease for lease in self.leases.by_holder(holder_id) if lease.request_id == request_id]
        if not leases:
            self.declines.add(holder_id, request_id, self.clock.now())
            return None
        claimed = [lease for lease in leases if lease.state is not LeaseState.HELD]
        if claimed:
            raise FailedPrecondition(
                f"the hold of request {shown(request_id)} on {shown(holder_id)} is {claimed[0].state.label} "
                f"(lease {claimed[0].lease_id}, reader {shown(claimed[0].reader)}); only its reader ends it",
                cause=Cause.WRONG_LEASE_STATE,
            )
        for lease in leases:
            self._revoke(lease, RevokeCause.DECLINED, reason or "declined: nobody will read it")
        return leases[0]

    def revoke(self, lease_id: str, reason: str = "") -> Lease:
        """Operator revoke."""
        lease = self.leases.get(lease_id)
        if not lease.state.live:
            how = lease.state.label
            if lease.cause is not RevokeCause.NONE:
                how += f", cause {lease.cause.label}"
            raise FailedPrecondition(f"lease {lease_id} already ended ({how})", cause=ended_cause(lease))
        self._revoke(lease, RevokeCause.OPERATOR, self.check.text(reason) or "revoked by an operator")
        return lease

    def _revoke(self, lease: Lease, cause: RevokeCause, detail: str) -> None:
        done = self.leases.revoke(lease.lease_id, cause, detail)
        if done is not None:
            self._after_revoke(done)

    def _after_revoke(self, lease: Lease, tell_holder: bool = True) -> None:
        """Tell both sides of a revoked lease (each only if its session is still alive)."""
        self.revocations[lease.cause.label] += 1
        pending = not lease.block_ids  # a PENDING lease never got block ids
        if pending:
            self.notifier.pin_settled(lease)
        else:
            reader = self.registry.find(lease.reader) if lease.reader else None
            if reader is not None:
                self.notifier.lease_revoked(reader.session_id, lease)
        if tell_holder:
            holder = self.registry.find(lease.holder)
            if holder is not None:
                self.notifier.lease_ended(holder.session_id, lease)

    # -- routers and operators ---------------------------------------------------------

    def score(
        self,
        ns: Namespace,
        hashes: Sequence[int],
        token_ids: Sequence[int],
        candidates: Sequence[str],
        require_exact: bool = False,
    ) -> ScoreResult:
        self.check.namespace(ns)
        hashes = prompt_chain(self.registry, self.check, ns, hashes, token_ids)
        fp = self.registry.find_fingerprint(ns.layout_id)
        block_size = fp.block_size if fp is not None else 0
        if candidates:
            self.check.hashes(len(candidates), "candidates")
            records = [self.registry.get(engine_id) for engine_id in candidates]
        else:
            records = [rec for rec in self.registry.all() if rec.layout_id == ns.layout_id]
        engines, states = score_candidates(records, self.clock.now())
        prefixes = exact_only(self.index.longest_prefixes(ns, hashes), states, require_exact)
        scores = score_engines(prefixes, engines)  # type: ignore[arg-type]
        for s in scores:
            s.exactness = int(states[s.engine_id])
        return ScoreResult(scores, len(hashes), block_size)

    def drain(self, engine_id: str, reason: str = "") -> int:
        """Stop naming the engine, tell it, revoke its unclaimed holds. Active reads finish."""
        rec = self.registry.get(engine_id)
        reason = self.check.text(reason)
        revoked = 0
        with self.registry.draining(rec, reason):
            self.notifier.drain(rec.session_id, reason or "drained by an operator")
            for lease in self.leases.by_holder(engine_id):
                if lease.state is LeaseState.HELD:
                    self._revoke(lease, RevokeCause.DRAIN, reason or "holder is draining")
                    revoked += 1
        return revoked

    def mirror_engines(self, layout_id: str) -> list[pb.EngineInfo]:
        """The engines a new mirror of `layout_id` starts from (ready ones; as resolve names them)."""
        return [rec.snapshot() for rec in self.registry.all() if rec.layout_id == layout_id and rec.ready]

    def engine_blocks(self, rec: EngineRecord) -> dict[Tier, int]:
        return self.index.blocks_of(rec.engine_id)

    def stats(self) -> Stats:
        counts = self.leases.live_counts()
        by_state = {
            s.label: counts.get(s, 0) for s in (LeaseState.PENDING, LeaseState.HELD, LeaseState.ACTIVE)
        }
        by_state[LeaseState.RELEASED.label] = self.released_total
        by_state[LeaseState.REVOKED.label] = sum(self.revocations.values())
        n = len(self.registry)
        return Stats(
            engines=n,
            sessions=n,
            blocks_indexed=self.index.total_blocks(),
            namespaces=self.index.namespace_count(),
            leases_by_state=by_state,
            revocations_by_cause=dict(self.revocations),
        )

    # -- expiry ----------------------------------------------------------------------------

    def forgive_stall(self, stalled_s: float) -> None:
        """The broker itself did not run for ``stalled_s`` seconds (a starved or paused host).

        Heartbeats sent meanwhile are still unread in its sockets, so silence
        that long is the broker's, not the engines': every session gets that
        time back before the next expiry pass. A peer that is really frozen
        still misses its TTL counted over time the broker was running.
        """
        self.registry.extend_sessions(stalled_s)
        self.stalls_forgiven += 1
        self.stalled_s_forgiven += stalled_s

    def expire(self, budget: int | None = None) -> int:
        """One rate-limited pass: end expired sessions and leases, then tidy the index."""
        limit = budget or self.config.expiry_batch
        now = self.clock.now()
        ended = 0
        self.backlog.flush()  # index changes the store could not take before, in their order
        for rec in self.registry.expired(now, limit):
            if rec.stream_lost:  # see stream_ended
                self.end_session(rec.session_id, message="session stream ended")
            else:
                why = f"session TTL of {rec.ttl_s * 1000:.0f} ms passed without a heartbeat"
                self.end_session(rec.session_id, "DEADLINE_EXCEEDED", why)
            ended += 1
        for lease in self.leases.revoke_expired(now, limit):
            self._after_revoke(lease)
            ended += 1
        self.silence.check(now)
        self.index.maintain(limit * 8)  # a few ms of sweep per pass: it shares the loop
        return ended
