"""``EngineSession``: an engine's session with the broker, kept alive and resynchronised by itself.

On top of the stream (``kvbroker.clients.session_stream``: registration,
heartbeats, reconnects, the broker's commands) it

- records ``announce_stored`` / ``announce_removed`` in an ``InventoryMirror``
  (``kvbroker.clients.inventory``) and coalesces them over a few milliseconds
  (or until N hashes are pending) into few ``InventoryUpdate`` messages;
- after every registration (a broken stream, a broker restart) re-announces
  the whole inventory from that mirror, so the broker's soft state comes back
  without the engine doing anything;
- resolves over the stream (replies matched by sequence number), which costs
  far less than a unary call, and sends the lease commands (hold, acquire,
  renew, release, decline) on it too, answered in stream order: a holder
  hears its Hold's answer before the end of that lease;
- with ``mirror_index``, keeps a live copy of the layout's index
  (``kvbroker.clients.mirror``);
- sends a ``set_load`` figure early, in a heartbeat of its own, when it moved
  materially since the last one reported (at most every ``LOAD_REPORT_S``),
  so readers weigh a holder's current load, not one a heartbeat interval old.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvbroker.clients import errors
from kvbroker.clients.aio import DEFAULT_ADDRESS, AsyncBrokerClient, trace_metadata
from kvbroker.clients.clock import Backoff, SessionClock
from kvbroker.clients.credentials import ClientSecurity
from kvbroker.clients.inventory import (
    DEFAULT_MAX_HASHES_PER_UPDATE,
    InventoryKey,
    InventoryMirror,
    NamespaceLike,
    namespace_key,
)
from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.clients.session_stream import DEFAULT_SESSION_TTL_MS, SessionStream
from kvbroker.common.scoring import load_changed
from kvbroker.v1 import broker_pb2 as pb

DEFAULT_RESOLVE_TIMEOUT_S = 2.0
# Least time between two load reports of set_load (early heartbeats): a request that
# comes and goes within it leaves readers seeing this engine busy for up to this long.
# The broker republishes a load to mirrors at most every 0.15 s (half of this, for
# jitter), so none of these reports is held back there.
LOAD_REPORT_S = 0.3


@dataclass(frozen=True, slots=True)
class LeaseCommand:
    """A lease command for the stream: its name, the message, and what of the reply to return."""

    what: str
    message: pb.SessionUp
    pick: Callable[[Any], Any]


def _lease_of(reply: pb.LeaseResponse) -> pb.Lease:
    return reply.lease


def _same(reply: Any) -> Any:
    return reply


def _carry_trace(message: pb.SessionUp) -> None:
    """The current span's trace context, for the broker's span of this command."""
    for key, value in trace_metadata() or ():
        message.trace_context[key] = value


# One shared default (Backoff is frozen), as a default argument would be.
DEFAULT_BACKOFF = Backoff()


class EngineSession(SessionStream):
    """One engine's session stream, kept alive and resynchronised by itself.

    Create it inside a running event loop, ``await start()``, and ``await
    close()`` at the end. Callbacks may be plain functions or coroutines;
    they run on the session's loop and must not block it. An exception in a
    callback is logged and never ends the session.

    ``on_pin(PinCommand)`` returns a ``PinResult`` (or an awaitable or a
    ``concurrent.futures.Future`` of one); without an ``on_pin`` every pin is
    refused.

    ``on_engine_generation(EngineGeneration)``: another engine of the layout
    registered a new session (a restart under the same engine id); NIXL agent
    metadata of it cached under an older generation is stale.

    ``clock`` (a ``kvbroker.clients.clock.SessionClock``; monotonic time by
    default) decides heartbeats, the silence limit, stall forgiveness and the
    reconnect back-off: a test passes a ``ManualClock`` and moves it.
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
        on_engine_generation: Callable[[pb.EngineGeneration], Any] | None = None,
        on_connected: Callable[[pb.Registered], Any] | None = None,
        on_disconnected: Callable[[errors.BrokerError | None], Any] | None = None,
        load: Callable[[], float] | None = None,
        backoff: Backoff = DEFAULT_BACKOFF,
        flush_interval_s: float = 0.005,
        flush_max_hashes: int = 1024,
        max_hashes_per_update: int = DEFAULT_MAX_HASHES_PER_UPDATE,
        register_timeout_s: float = 5.0,
        resolve_timeout_s: float = DEFAULT_RESOLVE_TIMEOUT_S,
        lease_call_timeout_s: float | None = None,
        mirror_index: bool = False,
        clock: SessionClock | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        if engine is None or not engine.engine_id:
            raise ValueError("EngineSession needs an EngineInfo with an engine_id")
        owns_client = client is None
        client = client or AsyncBrokerClient(address, security=security)
        super().__init__(
            address,
            engine,
            ttl_ms=ttl_ms,
            expected_ranks=expected_ranks,
            client=client,
            on_revoked=on_revoked,
            on_lease_ended=on_lease_ended,
            on_pin=on_pin,
            on_drain=on_drain,
            on_connected=on_connected,
            on_disconnected=on_disconnected,
            load=load,
            backoff=backoff,
            register_timeout_s=register_timeout_s,
            clock=clock,
        )
        self._owns_client = owns_client
        # Another engine of the layout registered anew (SessionDown.engine_generation): agents
        # of it loaded under an older generation are gone.
        self.on_engine_generation = on_engine_generation
        self.flush_interval_s = flush_interval_s
        self.flush_max_hashes = flush_max_hashes
        self.max_hashes_per_update = max_hashes_per_update
        self.resolve_timeout_s = resolve_timeout_s
        # Deadline of hold/acquire/renew/release/decline calls (None: the client's own). An
        # engine sets it to its lease TTL: on a loaded host a release answered late but within
        # the lease still commits the read, where a short deadline would throw the read away.
        self.lease_call_timeout_s = lease_call_timeout_s
        # With mirror_index, a live copy of the layout's index (clients.mirror), kept
        # from the first registration on, over the session's channel.
        self.mirror_index = mirror_index
        self.mirror: IndexMirror | None = None
        self._mirror_follow: tuple[str, asyncio.Task[None]] | None = None  # (replica, task)

        self.inventory = InventoryMirror()
        self._flush_handle: asyncio.TimerHandle | None = None
        # The load last sent by _report_load (or registered), when, and whether a later send waits.
        self._reported_load = engine.load
        self._load_reported_at = float("-inf")
        self._load_report_waits = False

    def _dispatch(self, message: pb.SessionDown) -> None:
        if message.HasField("engine_generation"):
            self._callback(self.on_engine_generation, message.engine_generation)
        else:
            super()._dispatch(message)

    # -- load ------------------------------------------------------------------

    def set_load(self, load: float) -> None:
        """This engine's load (>= 0): sent now when it changed materially, else with the next
        heartbeat; a (re)registration carries it too. Call it on the session's loop."""
        super().set_load(load)
        self.engine.load = self._load_value
        if not self._load_report_waits:
            self._report_load()

    def _report_load(self) -> None:
        if not self.connected or not load_changed(self._reported_load, self._load_value):
            return
        wait_s = self._load_reported_at + LOAD_REPORT_S - self.clock.now()
        if wait_s > 0:
            self._load_report_waits = True
            self._spawn(self._report_load_after(wait_s))
            return
        self._reported_load, self._load_reported_at = self._load_value, self.clock.now()
        self._send(pb.SessionUp(heartbeat=pb.Heartbeat(load=self._load_value)))

    async def _report_load_after(self, wait_s: float) -> None:
        try:
            await self.clock.sleep(wait_s)
        finally:
            self._load_report_waits = False
        self._report_load()

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

    def give_up_pin(self, lease_id: str, reason: str) -> None:
        """This holder gave back the blocks it pinned for `lease_id` (a retention whose GPU memory vLLM
        needed): the broker ends the lease as memory_pressure. Never blocks; lost with a broken stream
        (the lease then ends at its TTL or with the session)."""
        self._send(
            pb.SessionUp(pin_result=pb.PinResult(lease_id=lease_id, ok=False, given_up=True, error=reason))
        )

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
        self._live_outbox()  # Unavailable at once when not connected
        layout_id, tenant = namespace_key(namespace)
        request = pb.SessionUp(
            resolve=pb.ResolveRequest(
                namespace=pb.Namespace(layout_id=layout_id or self.layout_id, tenant=tenant),
                block_hashes=list(block_hashes),
                acquire=acquire,
                lease_ttl_ms=lease_ttl_ms,
                min_blocks=min_blocks,
                request_id=request_id,
            ),
        )
        limit = self.resolve_timeout_s if timeout is None else timeout
        response: pb.ResolveResponse = await self._request(request, limit, "resolve")
        return response

    async def applied(self, timeout: float | None = None) -> None:
        """Return once the broker has applied everything this session was told before the call.

        Pending inventory changes go out now (as ``flush()``), then a heartbeat;
        the broker handles one session's stream in order and acknowledges the
        heartbeat after all of it, so when this returns every earlier
        ``announce_*`` / ``clear_tier`` (and pin result) is in the broker's
        index, and any resolve or score that starts afterwards, from any
        client, sees it. A change the broker refused counts as handled (it is
        logged, as always).

        Raises Unavailable at once when the session is not connected (the
        changes stay in the mirror and the next registration sends them all:
        wait for ``on_connected`` and call again), or when the stream breaks
        before the acknowledgement; DeadlineExceeded after ``timeout``
        (default ``resolve_timeout_s``).
        """
        self._live_outbox()  # Unavailable at once when not connected
        self.flush()
        await self._barrier(self.resolve_timeout_s if timeout is None else timeout)

    # -- lease commands, on the stream --------------------------------------
    # Each is built as a LeaseCommand, then sent on the stream and answered in
    # stream order (SessionStream._start_request). The broker takes this
    # engine's identity from the session, so the requests leave it empty.

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
        return await self._lease_call(
            self.hold_command(
                namespace,
                tier,
                block_hashes,
                block_ids,
                ttl_ms,
                reader_engine_id=reader_engine_id,
                request_id=request_id,
            )
        )

    async def acquire(self, lease_id: str, ttl_ms: int = 0) -> pb.LeaseResponse:
        """Claim a hold lease as its reader; the response carries the holder's transfer details."""
        return await self._lease_call(self.acquire_command(lease_id, ttl_ms))

    async def renew(self, lease_id: str, ttl_ms: int = 0) -> pb.Lease:
        return await self._lease_call(self.renew_command(lease_id, ttl_ms))

    async def decline(self, holder_engine_id: str, request_id: str, reason: str = "") -> pb.DeclineResponse:
        """This engine will not read the named hold: its holder frees the blocks now."""
        return await self._lease_call(self.decline_command(holder_engine_id, request_id, reason))

    async def release(self, lease_id: str, epoch: int = 0, read: tuple[int, int] | None = None) -> pb.Lease:
        """Commit a read. FailedPrecondition means the lease ended first: discard what was read."""
        return await self._lease_call(self.release_command(lease_id, epoch, read))

    def hold_command(
        self,
        namespace: NamespaceLike,
        tier: int,
        block_hashes: Iterable[int],
        block_ids: Iterable[int],
        ttl_ms: int,
        *,
        reader_engine_id: str = "",
        request_id: str = "",
    ) -> LeaseCommand:
        layout_id, tenant = namespace_key(namespace)
        request = pb.HoldRequest(
            namespace=pb.Namespace(layout_id=layout_id or self.layout_id, tenant=tenant),
            tier=tier,  # type: ignore[arg-type]
            block_hashes=list(block_hashes),
            block_ids=list(block_ids),
            ttl_ms=ttl_ms,
            reader_engine_id=reader_engine_id,
            request_id=request_id,
        )
        return LeaseCommand("hold", pb.SessionUp(hold=request), _lease_of)

    def acquire_command(self, lease_id: str, ttl_ms: int = 0) -> LeaseCommand:
        request = pb.AcquireRequest(lease_id=lease_id, ttl_ms=ttl_ms)
        return LeaseCommand("acquire", pb.SessionUp(acquire=request), _same)

    def renew_command(self, lease_id: str, ttl_ms: int = 0) -> LeaseCommand:
        request = pb.RenewRequest(lease_id=lease_id, ttl_ms=ttl_ms)
        return LeaseCommand("renew", pb.SessionUp(renew=request), _lease_of)

    def release_command(
        self, lease_id: str, epoch: int = 0, read: tuple[int, int] | None = None
    ) -> LeaseCommand:
        """``read``: (blocks, bytes) this engine read under the lease; the broker's per-pair
        counters count it (without it, the whole lease)."""
        request = pb.ReleaseRequest(lease_id=lease_id, epoch=epoch)
        if read is not None:
            request.read_blocks, request.read_bytes = read
        return LeaseCommand("release", pb.SessionUp(release=request), _lease_of)

    def decline_command(self, holder_engine_id: str, request_id: str, reason: str = "") -> LeaseCommand:
        request = pb.DeclineRequest(holder_engine_id=holder_engine_id, request_id=request_id, reason=reason)
        return LeaseCommand("decline", pb.SessionUp(decline=request), _same)

    @property
    def lease_timeout_s(self) -> float:
        """Deadline of a lease command: ``lease_call_timeout_s``, else the client's."""
        if self.lease_call_timeout_s is not None:
            return self.lease_call_timeout_s
        return self.client.timeout

    async def _lease_call(self, command: LeaseCommand) -> Any:
        _carry_trace(command.message)
        reply = await self._request(command.message, self.lease_timeout_s, command.what)
        return command.pick(reply)

    def send_lease_command(
        self, command: LeaseCommand, future: concurrent.futures.Future[Any] | None = None
    ) -> concurrent.futures.Future[Any]:
        """Send ``command`` (on the session's loop); a future of its answer.

        The future is settled synchronously when the reply is read, before any
        later message of the stream is dispatched: a holder's Hold future is
        done before the ``on_lease_ended`` / ``on_revoked`` of that lease runs,
        and callbacks added to it run on the session thread first. It fails
        with Unavailable at once when the session is not connected (or when the
        stream breaks before the answer), DeadlineExceeded after
        ``lease_timeout_s``, or the broker's error.
        """
        out: concurrent.futures.Future[Any] = future if future is not None else concurrent.futures.Future()

        def settle(reply: Any, error: errors.BrokerError | None) -> None:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by its caller
                if error is not None:
                    out.set_exception(error)
                else:
                    out.set_result(command.pick(reply))

        _carry_trace(command.message)
        try:
            self._start_request(command.message, self.lease_timeout_s, command.what, settle)
        except errors.BrokerError as err:
            settle(None, err)
        return out

    # -- hooks into the stream ------------------------------------------------

    def _resync(self, registered: pb.Registered, outbox: asyncio.Queue[pb.SessionUp]) -> None:
        # Changes announced before the first registration named no layout yet.
        self.inventory.adopt_layout(registered.layout_id)
        # The broker's view is rebuilt from the mirror before anything else is sent.
        # A resumed session (another replica of a shared-state fleet) kept its blocks and leases:
        # re-announce without clearing, as a clear would revoke the leases on our blocks.
        clear = not registered.resumed
        for update in self.inventory.full_sync_updates(self.max_hashes_per_update, clear=clear):
            outbox.put_nowait(pb.SessionUp(inventory=update))

    def _on_serving(self, registered: pb.Registered) -> None:
        self._reported_load = self.engine.load  # the registration carried it
        if self.mirror_index and self.mirror is None:
            self.mirror = IndexMirror(registered.layout_id)
        address = self.client.endpoints.current
        if self.mirror is not None and (self._mirror_follow is None or self._mirror_follow[0] != address):
            # On the session's replica: a silent one's Mirror stream breaks nothing either.
            if self._mirror_follow is not None:
                self._mirror_follow[1].cancel()
            task = asyncio.ensure_future(follow(self.mirror, self.client.channel))
            self._mirror_follow = (address, task)
            self._background.add(task)
            task.add_done_callback(self._background_done)

    def _cancel_flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
