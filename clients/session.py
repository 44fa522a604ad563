"""An engine's session with the broker: liveness, inventory, resolve and lease commands.

``EngineSession`` (asyncio) keeps one bidirectional ``Session`` stream open:

- registers the engine, then heartbeats every third of the session TTL (or
  the interval the broker asks for). The broker decides whether the session
  lives; this side gives the stream up only when nothing at all came back for
  ``SILENCE_TTLS`` TTLs (a dead broker breaks the stream, and a frozen one
  fails the channel's keepalive pings, long before that). A reconnect
  supersedes the old session and ends its leases, so waiting out a broker that
  was only starved is the cheaper mistake. Time this process itself did not
  run (a timer firing late) is not counted as the broker's silence;
- reconnects with exponential back-off and jitter; after a reconnect (a
  broken stream, a broker restart) it registers again and re-announces its
  whole inventory from a local mirror, so the broker's soft state comes back
  without the engine doing anything;
- coalesces ``announce_stored`` / ``announce_removed`` over a few
  milliseconds (or until N hashes are pending) into few ``InventoryUpdate``
  messages;
- resolves over the stream (replies matched by sequence number), which costs
  far less than a unary call;
- hands ``PinCommand`` to ``on_pin`` and sends back its ``PinResult``, and
  reports ``LeaseRevoked`` / ``LeaseEnded`` / ``DrainCommand`` to callbacks.

``ThreadedEngineSession`` hosts the same on a background thread's event loop
for synchronous callers such as vLLM's scheduler: announce calls return at
once, and resolve/hold/acquire/renew/release return
``concurrent.futures.Future`` objects; a future that is not done is simply
"not ready yet", so the caller never waits on the broker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeAlias

import grpc
import grpc.aio
from opentelemetry import context as otel_context

from kvbroker.clients import errors
from kvbroker.clients.aio import DEFAULT_ADDRESS, AsyncBrokerClient, trace_metadata
from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger(__name__)

NamespaceLike: TypeAlias = pb.Namespace | tuple[str, str]
# (layout_id, tenant, tier)
InventoryKey: TypeAlias = tuple[str, str, int]
PinReply: TypeAlias = "pb.PinResult | Awaitable[pb.PinResult] | concurrent.futures.Future[pb.PinResult]"

DEFAULT_SESSION_TTL_MS = 10_000
DEFAULT_RESOLVE_TIMEOUT_S = 2.0
# Larger than any sane flush, smaller than any sane broker limit on hash lists.
DEFAULT_MAX_HASHES_PER_UPDATE = 4096
# A timer firing later than this past its time means this process did not run.
STALL_S = 0.25
# Give the stream up after this many session TTLs without a word from the broker.
SILENCE_TTLS = 3


def namespace_key(namespace: NamespaceLike) -> tuple[str, str]:
    if isinstance(namespace, pb.Namespace):
        return (namespace.layout_id, namespace.tenant)
    layout_id, tenant = namespace
    return (layout_id, tenant)


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Reconnect delays: exponential, capped, with random jitter.

    Attempt ``n`` (0-based) waits ``min(max_s, initial_s * multiplier**n)``
    shortened by up to ``jitter`` of itself at random, so that many engines
    that lost the same broker do not come back in lockstep.
    """

    initial_s: float = 0.1
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        base = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 64))
        return base * (1.0 - self.jitter * rand())


@dataclasses.dataclass
class _PendingChanges:
    stored: set[int] = dataclasses.field(default_factory=set)
    removed: set[int] = dataclasses.field(default_factory=set)

    def size(self) -> int:
        return len(self.stored) + len(self.removed)


class InventoryMirror:
    """What this engine holds per (layout_id, tenant, tier), and the changes not yet sent.

    The mirror is the engine's own truth; the broker's copy is rebuilt from it
    after every (re)registration. The broker applies an update's ``clear_all``
    first (to the whole tier, every namespace), then removed, then stored;
    pending stored and removed sets stay disjoint.
    """

    def __init__(self) -> None:
        self._held: dict[InventoryKey, set[int]] = {}
        self._pending: dict[InventoryKey, _PendingChanges] = {}
        # tier -> a namespace to carry the tier's pending clear_all in
        self._tier_clears: dict[int, tuple[str, str]] = {}

    @property
    def pending_count(self) -> int:
        """Pending hashes, plus one per pending tier clear."""
        return sum(c.size() for c in self._pending.values()) + len(self._tier_clears)

    def _changes(self, key: InventoryKey) -> _PendingChanges:
        changes = self._pending.get(key)
        if changes is None:
            changes = self._pending[key] = _PendingChanges()
        return changes

    # Invariant: the broker's copy of a key is (held - pending.stored) | pending.removed
    # (counting from an empty tier when the tier has a pending clear), so every
    # change sends exactly the net difference, and nothing when it is undone
    # before the flush.

    def stored(self, key: InventoryKey, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(key, set())
        changes = self._changes(key)
        for h in hashes:
            if h in held:
                continue  # already announced or about to be
            held.add(h)
            if h in changes.removed:
                changes.removed.discard(h)  # the broker never heard it was gone
            else:
                changes.stored.add(h)

    def removed(self, key: InventoryKey, hashes: Iterable[int]) -> None:
        held = self._held.get(key)
        if not held:
            return
        changes = self._changes(key)
        for h in hashes:
            if h not in held:
                continue  # never announced: nothing to take back
            held.discard(h)
            if h in changes.stored:
                changes.stored.discard(h)  # the broker never heard of it
            else:
                changes.removed.add(h)

    def clear(self, key: InventoryKey) -> None:
        """Forget one namespace on one tier (sent as removals: a clear_all would hit the whole tier)."""
        self.removed(key, list(self._held.get(key, ())))

    def clear_tier(self, tier: int) -> None:
        """Forget everything on ``tier``, in every namespace (sent as one clear_all)."""
        keys = self.keys(tier=tier)
        if not keys:
            return
        for key in keys:
            self._held.pop(key, None)
            self._pending.pop(key, None)
        self._tier_clears[tier] = (keys[0][0], keys[0][1])

    def adopt_layout(self, layout_id: str) -> None:
        """File what was recorded before registration (with an empty layout id) under ``layout_id``.

        Nothing under an empty layout id was ever sent, so its held set is the
        whole story.
        """
        for key in [k for k in self.keys() if not k[0]]:
            held = self._held.pop(key, set())
            self._pending.pop(key, None)
            self.stored((layout_id, key[1], key[2]), held)
        for tier, (clear_layout, tenant) in list(self._tier_clears.items()):
            if not clear_layout:
                self._tier_clears[tier] = (layout_id, tenant)

    def keys(self, tier: int | None = None) -> list[InventoryKey]:
        keys = set(self._held) | set(self._pending)
        return sorted(k for k in keys if tier is None or k[2] == tier)

    def held(self, key: InventoryKey) -> frozenset[int]:
        return frozenset(self._held.get(key, ()))

    def total_held(self) -> int:
        return sum(len(s) for s in self._held.values())

    def take_updates(self, max_hashes: int = DEFAULT_MAX_HASHES_PER_UPDATE) -> list[pb.InventoryUpdate]:
        """The pending changes as messages (at most ``max_hashes`` hashes each); clears them."""
        updates = [_clear_update(ns, tier) for tier, ns in sorted(self._tier_clears.items())]
        for key, changes in sorted(self._pending.items()):
            updates.extend(_chunked_updates(key, changes, max_hashes))
        self._pending.clear()
        self._tier_clears.clear()
        return updates

    def full_sync_updates(self, max_hashes: int = DEFAULT_MAX_HASHES_PER_UPDATE) -> list[pb.InventoryUpdate]:
        """Messages that replace the broker's view with the whole mirror; clears pending changes.

        Each tier starts with a clear_all, so a broker that kept old state for
        this engine drops it first.
        """
        keys = [k for k in self.keys() if self._held.get(k)]
        tiers: dict[int, tuple[str, str]] = {}
        for layout_id, tenant, tier in keys:
            tiers.setdefault(tier, (layout_id, tenant))
        updates = [_clear_update(ns, tier) for tier, ns in sorted(tiers.items())]
        for key in keys:
            updates.extend(_chunked_updates(key, _PendingChanges(stored=set(self._held[key])), max_hashes))
        self._pending.clear()
        self._tier_clears.clear()
        return updates


def _clear_update(namespace: tuple[str, str], tier: int) -> pb.InventoryUpdate:
    return pb.InventoryUpdate(
        namespace=pb.Namespace(layout_id=namespace[0], tenant=namespace[1]),
        tier=pb.Tier.ValueType(tier),
        clear_all=True,
    )


def _chunked_updates(
    key: InventoryKey, changes: _PendingChanges, max_hashes: int
) -> list[pb.InventoryUpdate]:
    layout_id, tenant, tier = key
    namespace = pb.Namespace(layout_id=layout_id, tenant=tenant)
    stored = sorted(changes.stored)
    removed = sorted(changes.removed)
    updates: list[pb.InventoryUpdate] = []
    while stored or removed:
        take_stored, stored = stored[:max_hashes], stored[max_hashes:]
        room = max_hashes - len(take_stored)
        take_removed, removed = removed[:room], removed[room:]
        updates.append(
            pb.InventoryUpdate(
                namespace=namespace, tier=pb.Tier.ValueType(tier), stored=take_stored, removed=take_removed
            )
        )
    return updates


class _GaveUp(Exception):
    """The broker answered nothing for SILENCE_TTLS session TTLs."""


class EngineSession:
    """One engine's session stream, kept alive and resynchronised by itself.

    Create it inside a running event loop, ``await start()``, and ``await
    close()`` at the end. Callbacks may be plain functions or coroutines;
    they run on the session's loop and must not block it. An exception in a
    callback is logged and never ends the session.

    ``on_pin(PinCommand)`` returns a ``PinResult`` (or an awaitable or a
    ``concurrent.futures.Future`` of one); without an ``on_pin`` every pin is
    refused.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        engine: pb.EngineInfo | None = None,
        *,
        ttl_ms: int = DEFAULT_SESSION_TTL_MS,
        expected_ranks: int = 0,
        client: AsyncBrokerClient | None = None,
        on_revoked: Callable[[pb.LeaseRevoked], Any] | None = None,
        on_lease_ended: Callable[[pb.LeaseEnded], Any] | None = None,
        on_pin: Callable[[pb.PinCommand], Any] | None = None,
        on_drain: Callable[[pb.DrainCommand], Any] | None = None,
        on_connected: Callable[[pb.Registered], Any] | None = None,
        on_disconnected: Callable[[errors.BrokerError | None], Any] | None = None,
        load: Callable[[], float] | None = None,
        backoff: Backoff = Backoff(),
        flush_interval_s: float = 0.005,
        flush_max_hashes: int = 1024,
        max_hashes_per_update: int = DEFAULT_MAX_HASHES_PER_UPDATE,
        register_timeout_s: float = 5.0,
        resolve_timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S,
        lease_call_timeout_s: float | None = None,
        mirror_index: bool = False,
    ) -> None:
        if engine is None or not engine.engine_id:
            raise ValueError("EngineSession needs an EngineInfo with an engine_id")
        self.engine = pb.EngineInfo()
        self.engine.CopyFrom(engine)
        self.ttl_ms = ttl_ms
        self.expected_ranks = expected_ranks
        self._owns_client = client is None
        self.client = client or AsyncBrokerClient(address)
        self.on_revoked = on_revoked
        self.on_lease_ended = on_lease_ended
        self.on_pin = on_pin
        self.on_drain = on_drain
        self.on_connected = on_connected
        self.on_disconnected = on_disconnected
        self._load = load
        self._load_value = 0.0
        self.backoff = backoff
        self.flush_interval_s = flush_interval_s
        self.flush_max_hashes = flush_max_hashes
        self.max_hashes_per_update = max_hashes_per_update
        self.register_timeout_s = register_timeout_s
        self.resolve_timeout_s = resolve_timeout_s
        # Deadline of hold/acquire/renew/release/decline calls (None: the client's own). An
        # engine sets it to its lease TTL: on a loaded host a release answered late but within
        # the lease still commits the read, where a short deadline would throw the read away.
        self.lease_call_timeout_s = lease_call_timeout_s
        # With mirror_index, a live copy of the layout's index (clients.mirror), kept
        # from the first registration on, over the session's channel.
        self.mirror_index = mirror_index
        self.mirror: IndexMirror | None = None

        self.inventory = InventoryMirror()
        self.registered: pb.Registered | None = None
        self.registrations = 0  # successful registrations so far (1 + reconnects)
        self.last_error: errors.BrokerError | None = None
        self.fatal_error: errors.BrokerError | None = None

        self._seq = 0
        self._outbox: asyncio.Queue[pb.SessionUp] | None = None
        self._resolves: dict[int, asyncio.Future[pb.ResolveResponse]] = {}
        self._connected = asyncio.Event()
        self._flush_handle: asyncio.TimerHandle | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._last_heard = 0.0

    # -- lifecycle ---------------------------------------------------------

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def layout_id(self) -> str:
        return self.registered.layout_id if self.registered else ""

    @property
    def session_ttl_s(self) -> float:
        ttl_ms = self.registered.session_ttl_ms if self.registered and self.registered.session_ttl_ms else 0
        return (ttl_ms or self.ttl_ms or DEFAULT_SESSION_TTL_MS) / 1000.0

    @property
    def heartbeat_interval_s(self) -> float:
        if self.registered and self.registered.heartbeat_interval_ms:
            return self.registered.heartbeat_interval_ms / 1000.0
        return self.session_ttl_s / 3.0

    async def start(self, wait_connected_s: float | None = None) -> None:
        """Start connecting in the background; optionally wait for the first registration."""
        if self._run_task is None:
            self._run_task = asyncio.get_running_loop().create_task(
                self._run(), name=f"kvbroker-session-{self.engine_id}"
            )
        if wait_connected_s is not None:
            await self.wait_connected(wait_connected_s)

    async def wait_connected(self, timeout: float) -> pb.Registered:
        """Wait until registered; raises the fatal error, or Unavailable after ``timeout``."""
        waiter = asyncio.ensure_future(self._connected.wait())
        run = self._run_task
        waitables: set[asyncio.Future[Any]] = {waiter} | ({run} if run else set())
        try:
            await asyncio.wait(waitables, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self.fatal_error is not None:
            raise self.fatal_error
        if not self.connected or self.registered is None:
            reason = f": {self.last_error}" if self.last_error else ""
            raise errors.Unavailable(f"session not registered with the broker within {timeout:g} s{reason}")
        return self.registered

    async def close(self) -> None:
        """End the session (the broker revokes its leases at once) and stop reconnecting."""
        self._closing = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        if self._run_task is not None:
            self._run_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._run_task
        for task in list(self._background):
            task.cancel()
        if self._owns_client:
            await self.client.close()

    # -- inventory -----------------------------------------------------------

    def _key(self, namespace: NamespaceLike, tier: int) -> InventoryKey:
        layout_id, tenant = namespace_key(namespace)
        return (layout_id or self.layout_id, tenant, int(tier))

    def announce_stored(self, namespace: NamespaceLike, tier: int, block_hashes: Iterable[int]) -> None:
        """Record blocks this engine now holds; sent within ``flush_interval_s``. Never blocks."""
        self.inventory.stored(self._key(namespace, tier), block_hashes)
        self._schedule_flush()

    def announce_removed(self, namespace: NamespaceLike, tier: int, block_hashes: Iterable[int]) -> None:
        """Record blocks this engine no longer holds. Never blocks."""
        self.inventory.removed(self._key(namespace, tier), block_hashes)
        self._schedule_flush()

    def clear_tier(self, tier: int, namespace: NamespaceLike | None = None) -> None:
        """Forget everything on ``tier`` (in one namespace, or in all of them)."""
        if namespace is None:
            self.inventory.clear_tier(int(tier))
        else:
            self.inventory.clear(self._key(namespace, tier))
        self._schedule_flush()

    def set_load(self, load: float) -> None:
        """Load figure sent with the next heartbeat (used when no ``load`` callable was given)."""
        self._load_value = float(load)

    def add_rank(self, rank: pb.RankInfo) -> None:
        """Add or replace a rank in the registration sent on every (re)connect."""
        for existing in self.engine.ranks:
            if existing.pp_rank == rank.pp_rank and existing.tp_rank == rank.tp_rank:
                existing.CopyFrom(rank)
                break
        else:
            self.engine.ranks.add().CopyFrom(rank)
        if self.connected:
            self._spawn(self._register_rank(rank))

    async def _register_rank(self, rank: pb.RankInfo) -> None:
        try:
            await self.client.register_rank(engine_id=self.engine_id, rank=rank)
        except errors.BrokerError as err:
            log.warning("register_rank pp=%d tp=%d failed: %s", rank.pp_rank, rank.tp_rank, err)

    def flush(self) -> None:
        """Send pending inventory changes now (if connected)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self.connected or self._outbox is None:
            return  # the mirror keeps them; the next registration sends everything
        for update in self.inventory.take_updates(self.max_hashes_per_update):
            self._send(pb.SessionUp(inventory=update))

    def _schedule_flush(self) -> None:
        if self.inventory.pending_count >= self.flush_max_hashes:
            self.flush()
        elif self._flush_handle is None and self.connected:
            self._flush_handle = asyncio.get_running_loop().call_later(self.flush_interval_s, self.flush)

    # -- resolve and lease calls -------------------------------------------

    async def resolve(
        self,
        namespace: NamespaceLike,
        block_hashes: Iterable[int],
        *,
        acquire: bool = False,
        lease_ttl_ms: int = 0,
        min_blocks: int = 0,
        request_id: str = "",
        timeout: float | None = None,
    ) -> pb.ResolveResponse:
        """Who holds the longest prefix of ``block_hashes`` (and, with ``acquire``, a lease on it).

        Raises Unavailable at once when the session is not connected.
        """
        if not self.connected or self._outbox is None:
            raise errors.Unavailable(f"engine {self.engine_id} has no live broker session")
        layout_id, tenant = namespace_key(namespace)
        self._seq += 1
        seq = self._seq
        future: asyncio.Future[pb.ResolveResponse] = asyncio.get_running_loop().create_future()
        self._resolves[seq] = future
        self._outbox.put_nowait(
            pb.SessionUp(
                seq=seq,
                resolve=pb.ResolveRequest(
                    namespace=pb.Namespace(layout_id=layout_id or self.layout_id, tenant=tenant),
                    block_hashes=list(block_hashes),
                    acquire=acquire,
                    lease_ttl_ms=lease_ttl_ms,
                    min_blocks=min_blocks,
                    request_id=request_id,
                ),
            )
        )
        limit = self.resolve_timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(future, limit)
        except TimeoutError:
            raise errors.DeadlineExceeded(f"resolve got no answer within {limit:g} s") from None
        finally:
            self._resolves.pop(seq, None)

    async def hold(
        self,
        namespace: NamespaceLike,
        tier: int,
        block_hashes: Iterable[int],
        block_ids: Iterable[int],
        ttl_ms: int,
        *,
        reader_engine_id: str = "",
        request_id: str = "",
    ) -> pb.Lease:
        """Promise to keep blocks for a reader (this engine is the holder)."""
        layout_id, tenant = namespace_key(namespace)
        response = await self.client.hold(
            holder_engine_id=self.engine_id,
            namespace=pb.Namespace(layout_id=layout_id or self.layout_id, tenant=tenant),
            tier=tier,
            block_hashes=list(block_hashes),
            block_ids=list(block_ids),
            ttl_ms=ttl_ms,
            reader_engine_id=reader_engine_id,
            request_id=request_id,
            timeout=self.lease_call_timeout_s,
        )
        return response.lease

    async def acquire(self, lease_id: str, ttl_ms: int = 0) -> pb.LeaseResponse:
        """Claim a hold lease as its reader; the response carries the holder's transfer details."""
        return await self.client.acquire(
            lease_id=lease_id,
            reader_engine_id=self.engine_id,
            ttl_ms=ttl_ms,
            timeout=self.lease_call_timeout_s,
        )

    async def renew(self, lease_id: str, ttl_ms: int = 0) -> pb.Lease:
        return (
            await self.client.renew(
                lease_id=lease_id, engine_id=self.engine_id, ttl_ms=ttl_ms, timeout=self.lease_call_timeout_s
            )
        ).lease

    async def decline(self, holder_engine_id: str, request_id: str, reason: str = "") -> pb.DeclineResponse:
        """This engine will not read the named hold: its holder frees the blocks now."""
        return await self.client.decline(
            holder_engine_id=holder_engine_id,
            request_id=request_id,
            reason=reason,
            timeout=self.lease_call_timeout_s,
        )

    async def release(self, lease_id: str, epoch: int = 0) -> pb.Lease:
        """Commit a read. FailedPrecondition means the lease ended first: discard what was read."""
        return (
            await self.client.release(
                lease_id=lease_id,
                reader_engine_id=self.engine_id,
                epoch=epoch,
                timeout=self.lease_call_timeout_s,
            )
        ).lease

    # -- the connection loop -------------------------------------------------

    async def _run(self) -> None:
        attempt = 0
        while not self._closing:
            error: errors.BrokerError | None = None
            try:
                await self._connect_and_serve()
            except errors.BrokerError as err:
                error = err
            except grpc.RpcError as err:
                error = errors.from_rpc_error(err)
            except Exception as exc:  # a bug here must not stop an engine from rejoining
                log.exception("session loop of %s failed", self.engine_id)
                error = errors.Internal(f"session loop failed: {exc!r}")
            finally:
                was_connected = self._mark_disconnected()
            if self._closing:
                return
            self.last_error = error
            if was_connected:
                attempt = 0
                log.warning("session of %s lost: %s; reconnecting", self.engine_id, error or "stream ended")
                self._callback(self.on_disconnected, error)
            if error is not None and not error.retryable:
                if self.registrations == 0:
                    # Refused at the first registration: bad engine info; retrying cannot help.
                    self.fatal_error = error
                    log.error("broker refused engine %s: %s", self.engine_id, error)
                    return
                log.warning("session of %s: %s", self.engine_id, error)
            delay = self.backoff.delay(attempt)
            attempt += 1
            await asyncio.sleep(delay)

    def _mark_disconnected(self) -> bool:
        was_connected = self.connected
        self._connected.clear()
        self._outbox = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        for future in self._resolves.values():
            if not future.done():
                future.set_exception(errors.Unavailable("broker session lost before the answer came"))
        self._resolves.clear()
        return was_connected

    async def _connect_and_serve(self) -> None:
        call = self.client.stub.Session(metadata=trace_metadata())
        try:
            registered = await self._register(call)
            outbox: asyncio.Queue[pb.SessionUp] = asyncio.Queue()
            self._outbox = outbox
            self.registered = registered
            self.registrations += 1
            self._last_heard = time.monotonic()
            # Changes announced before the first registration named no layout yet.
            self.inventory.adopt_layout(registered.layout_id)
            # The broker's view is rebuilt from the mirror before anything else is sent.
            for update in self.inventory.full_sync_updates(self.max_hashes_per_update):
                outbox.put_nowait(pb.SessionUp(inventory=update))
            self._connected.set()
            log.info(
                "engine %s registered: session %s, layout %s, ttl %d ms",
                self.engine_id,
                registered.session_id,
                registered.layout_id,
                registered.session_ttl_ms,
            )
            self._callback(self.on_connected, registered)
            if self.mirror_index and self.mirror is None:
                self.mirror = IndexMirror(registered.layout_id)
                self._spawn(follow(self.mirror, self.client.channel))
            tasks = [
                asyncio.ensure_future(self._read_loop(call)),
                asyncio.ensure_future(self._write_loop(call, outbox)),
                asyncio.ensure_future(self._heartbeat_loop(outbox)),
            ]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in done:
                exc = task.exception()
                if isinstance(exc, _GaveUp):
                    raise errors.Unavailable(str(exc))
                if exc is not None:
                    raise exc
        finally:
            call.cancel()

    async def _register(self, call: Any) -> pb.Registered:
        self._seq += 1
        register = pb.Register(
            engine=self.engine, session_ttl_ms=self.ttl_ms, expected_ranks=self.expected_ranks
        )
        try:
            await call.write(pb.SessionUp(seq=self._seq, register=register))
            reply = await asyncio.wait_for(call.read(), self.register_timeout_s)
        except TimeoutError:
            raise errors.Unavailable(
                f"broker did not answer the registration within {self.register_timeout_s:g} s"
            ) from None
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        if reply is grpc.aio.EOF:
            raise errors.Unavailable("broker closed the session stream during registration")
        kind = reply.WhichOneof("msg")
        if kind == "error":
            raise errors.from_session_error(reply.error)
        if kind != "registered":
            raise errors.Internal(f"broker answered the registration with {kind!r}")
        return reply.registered

    async def _read_loop(self, call: Any) -> None:
        while True:
            try:
                message = await call.read()
            except grpc.RpcError as err:
                raise errors.from_rpc_error(err) from None
            if message is grpc.aio.EOF:
                raise errors.Unavailable("broker ended the session stream")
            self._last_heard = time.monotonic()
            self._dispatch(message)

    async def _write_loop(self, call: Any, outbox: asyncio.Queue[pb.SessionUp]) -> None:
        while True:
            message = await outbox.get()
            try:
                await call.write(message)
            except grpc.RpcError as err:
                raise errors.from_rpc_error(err) from None
            except asyncio.InvalidStateError:
                raise errors.Unavailable("session stream closed while sending") from None

    async def _heartbeat_loop(self, outbox: asyncio.Queue[pb.SessionUp]) -> None:
        last_sent = time.monotonic()
        while True:
            ttl_s = self.session_ttl_s
            interval_s = self.heartbeat_interval_s
            nap_s = max(0.02, min(interval_s, ttl_s / 10.0))
            before = time.monotonic()
            await asyncio.sleep(nap_s)
            now = time.monotonic()
            stalled = now - before - nap_s
            if stalled > STALL_S:
                # This process did not run (a starved or paused host): the broker's answers
                # may be waiting unread in the socket, so the silence is ours, not the
                # broker's. Do not count it; send a heartbeat now instead.
                log.warning(
                    "session of %s: this process did not run for %.2f s; heartbeating now",
                    self.engine_id,
                    stalled,
                )
                self._last_heard = min(now, self._last_heard + stalled)
                last_sent = now - interval_s
            if now - self._last_heard > SILENCE_TTLS * ttl_s:
                raise _GaveUp(
                    f"broker answered nothing for {SILENCE_TTLS * ttl_s:g} s ({SILENCE_TTLS} session TTLs)"
                )
            if now - last_sent >= interval_s:
                self._seq += 1
                load = self._load() if self._load is not None else self._load_value
                outbox.put_nowait(pb.SessionUp(seq=self._seq, heartbeat=pb.Heartbeat(load=load)))
                last_sent = now

    def _send(self, message: pb.SessionUp) -> None:
        if self._outbox is not None:
            self._seq += 1
            message.seq = self._seq
            self._outbox.put_nowait(message)

    # -- messages from the broker -------------------------------------------

    def _dispatch(self, message: pb.SessionDown) -> None:
        kind = message.WhichOneof("msg")
        if kind == "resolve":
            self._settle(message.seq, result=message.resolve)
        elif kind == "error":
            error = errors.from_session_error(message.error)
            if not self._settle(message.seq, error=error):
                log.warning("broker reported on session of %s: %s", self.engine_id, error)
        elif kind == "revoked":
            self._callback(self.on_revoked, message.revoked)
        elif kind == "lease_ended":
            self._callback(self.on_lease_ended, message.lease_ended)
        elif kind == "pin":
            self._spawn(self._answer_pin(message.pin))
        elif kind == "drain":
            log.warning("broker drains engine %s: %s", self.engine_id, message.drain.reason)
            self._callback(self.on_drain, message.drain)
        # heartbeat_ack and a repeated registered only prove the broker is alive.

    def _settle(
        self,
        seq: int,
        result: pb.ResolveResponse | None = None,
        error: errors.BrokerError | None = None,
    ) -> bool:
        future = self._resolves.get(seq)
        if future is None or future.done():
            return False
        if error is not None:
            future.set_exception(error)
        elif result is not None:
            future.set_result(result)
        return True

    async def _answer_pin(self, command: pb.PinCommand) -> None:
        lease_id = command.lease.lease_id
        if self.on_pin is None:
            result = pb.PinResult(lease_id=lease_id, ok=False, error="engine has no pin handler")
        else:
            try:
                reply = self.on_pin(command)
                if isinstance(reply, concurrent.futures.Future):
                    reply = await asyncio.wrap_future(reply)
                elif inspect.isawaitable(reply):
                    reply = await reply
                result = reply
                if not isinstance(result, pb.PinResult):
                    raise TypeError(f"on_pin returned {type(result).__name__}, not PinResult")
                if not result.lease_id:
                    result.lease_id = lease_id
            except Exception as exc:
                log.exception("pin handler failed for lease %s", lease_id)
                result = pb.PinResult(lease_id=lease_id, ok=False, error=f"pin handler failed: {exc}")
        self._send(pb.SessionUp(pin_result=result))

    def _callback(self, callback: Callable[[Any], Any] | None, argument: Any) -> None:
        if callback is None:
            return
        try:
            outcome = callback(argument)
        except Exception:
            log.exception("session callback %r failed", callback)
            return
        if inspect.isawaitable(outcome):
            self._spawn(outcome)

    def _spawn(self, awaitable: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(awaitable)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("session background task failed", exc_info=task.exception())


class ThreadedEngineSession:
    """An ``EngineSession`` on its own thread and event loop, for synchronous callers.

    Every method returns at once: announce calls queue their change;
    resolve/hold/acquire/renew/release return ``concurrent.futures.Future``.
    Callbacks run on the session thread; hand work to your own thread-safe
    structures there. ``on_pin`` may return a ``concurrent.futures.Future``
    that the caller's thread completes later.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, engine: pb.EngineInfo | None = None, **options: Any):
        if engine is None or not engine.engine_id:
            raise ValueError("ThreadedEngineSession needs an EngineInfo with an engine_id")
        self.address = address
        self._engine = engine
        self._options = options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: EngineSession | None = None

    @property
    def session(self) -> EngineSession:
        if self._session is None:
            raise RuntimeError("ThreadedEngineSession.start() was not called")
        return self._session

    @property
    def engine_id(self) -> str:
        return self._engine.engine_id

    @property
    def connected(self) -> bool:
        return self._session is not None and self._session.connected

    @property
    def layout_id(self) -> str:
        return self._session.layout_id if self._session else ""

    def start(self, wait_connected_s: float | None = None) -> None:
        """Start the thread; with ``wait_connected_s``, block until registered (for set-up code only)."""
        if self._thread is not None:
            return
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                self._session = loop.run_until_complete(self._make_session())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=main, name=f"kvbroker-session-{self.engine_id}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        if wait_connected_s is not None:
            self._submit(self.session.wait_connected(wait_connected_s)).result()

    async def _make_session(self) -> EngineSession:
        session = EngineSession(self.address, self._engine, **self._options)
        await session.start()
        return session

    def close(self, timeout: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self._submit(self.session.close()).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def _submit(self, coroutine: Awaitable[Any]) -> concurrent.futures.Future[Any]:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            # Carry the caller's OpenTelemetry context (its current span) onto the loop
            # thread, so the broker call's traceparent names the caller's span.
            wrapped = _with_trace_context(otel_context.get_current(), coroutine)
            try:
                return asyncio.run_coroutine_threadsafe(wrapped, loop)
            except RuntimeError:
                wrapped.close()  # the loop closed meanwhile
        # After close() a call fails through its future; it never raises into the caller's thread.
        if inspect.iscoroutine(coroutine):
            coroutine.close()
        failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
        failed.set_exception(errors.Unavailable(f"session of {self.engine_id} is closed"))
        return failed

    def _call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        if self._loop is None:
            raise RuntimeError("ThreadedEngineSession.start() was not called")
        with contextlib.suppress(RuntimeError):  # closed: the change has nowhere to go
            self._loop.call_soon_threadsafe(function, *args)

    # Never-blocking calls for the caller's thread.
    def announce_stored(self, namespace: NamespaceLike, tier: int, block_hashes: Iterable[int]) -> None:
        self._call_soon(self.session.announce_stored, namespace, tier, list(block_hashes))

    def announce_removed(self, namespace: NamespaceLike, tier: int, block_hashes: Iterable[int]) -> None:
        self._call_soon(self.session.announce_removed, namespace, tier, list(block_hashes))

    def clear_tier(self, tier: int, namespace: NamespaceLike | None = None) -> None:
        self._call_soon(self.session.clear_tier, tier, namespace)

    def set_load(self, load: float) -> None:
        self._call_soon(self.session.set_load, load)

    def add_rank(self, rank: pb.RankInfo) -> None:
        self._call_soon(self.session.add_rank, rank)

    def mirror_resolve(
        self, namespace: NamespaceLike, block_hashes: Sequence[int]
    ) -> list[pb.HolderMatch] | None:
        """The holders the index mirror names (the broker's ranking, this engine left out),
        at once, from the caller's thread; None without a synced mirror ("ask the broker")."""
        session = self._session
        mirror = session.mirror if session is not None else None
        if mirror is None or not mirror.synced:
            return None
        layout_id, tenant = namespace_key(namespace)
        if layout_id != mirror.layout_id:
            return None
        return mirror.resolve(tenant, block_hashes, asker=self._engine)

    def resolve_async(
        self, namespace: NamespaceLike, block_hashes: Iterable[int], **kwargs: Any
    ) -> concurrent.futures.Future[pb.ResolveResponse]:
        """A future of the resolve; not done yet means "not ready", never wait on it in the scheduler."""
        return self._submit(self.session.resolve(namespace, list(block_hashes), **kwargs))

    def hold(
        self,
        namespace: NamespaceLike,
        tier: int,
        block_hashes: Iterable[int],
        block_ids: Iterable[int],
        ttl_ms: int,
        **kwargs: Any,
    ) -> concurrent.futures.Future[pb.Lease]:
        return self._submit(
            self.session.hold(namespace, tier, list(block_hashes), list(block_ids), ttl_ms, **kwargs)
        )

    def acquire(self, lease_id: str, ttl_ms: int = 0) -> concurrent.futures.Future[pb.LeaseResponse]:
        return self._submit(self.session.acquire(lease_id, ttl_ms))

    def renew(self, lease_id: str, ttl_ms: int = 0) -> concurrent.futures.Future[pb.Lease]:
        return self._submit(self.session.renew(lease_id, ttl_ms))

    def release(self, lease_id: str, epoch: int = 0) -> concurrent.futures.Future[pb.Lease]:
        return self._submit(self.session.release(lease_id, epoch))

    def decline(
        self, holder_engine_id: str, request_id: str, reason: str = ""
    ) -> concurrent.futures.Future[pb.DeclineResponse]:
        return self._submit(self.session.decline(holder_engine_id, request_id, reason))


async def _with_trace_context(ctx: otel_context.Context, coroutine: Awaitable[Any]) -> Any:
    """Await ``coroutine`` with ``ctx`` as the current OpenTelemetry context."""
    token = otel_context.attach(ctx)
    try:
        return await coroutine
    finally:
        otel_context.detach(token)
