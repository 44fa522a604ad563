"""The session stream under ``EngineSession``: registration, heartbeats, reconnects, the broker's messages.

``SessionStream`` keeps one bidirectional ``Session`` stream open for an engine:

- registers the engine, heartbeats every third of the session TTL (or as the
  broker asks) and gives the stream up by ``kvbroker.clients.liveness``'s
  silence rules; reconnects with back-off and jitter (``Backoff``), asking to
  resume the session; with several replicas, moves to the next at once
  (``kvbroker.clients.endpoints``), cancelling a silent one's stream only once
  the next answered (a replica that was only slow then has no session to end);
  one injected clock (``kvbroker.clients.clock``) times all of it;
- matches replies to requests by sequence number (``_request``), and offers
  a barrier (``_barrier``): the broker handles one session's stream in order,
  so the acknowledgement of a heartbeat proves every earlier message handled;
- hands ``PinCommand`` to ``on_pin`` and sends back its ``PinResult``, and
  reports ``LeaseRevoked`` / ``LeaseEnded`` / ``DrainCommand`` to callbacks.

What goes over the stream (inventory, resolves) is ``EngineSession``'s
(``kvbroker.clients.engine_session``); it hooks in at registration through
``_resync`` and ``_on_serving``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import grpc
import grpc.aio

from kvbroker.clients import errors
from kvbroker.clients.aio import AsyncBrokerClient, trace_metadata
from kvbroker.clients.clock import AsyncioClock, Backoff, SessionClock
from kvbroker.clients.liveness import STALL_S, GaveUp, Liveness, Silent, register_timeout_s
from kvbroker.clients.pins import pin_result
from kvbroker.v1 import broker_pb2 as pb

# One logger for the whole session, named as before the session module was split.
log = logging.getLogger("kvbroker.clients.session")

PinReply: TypeAlias = "pb.PinResult | Awaitable[pb.PinResult] | concurrent.futures.Future[pb.PinResult]"
# Settles one request on the stream: (reply, None) or (None, error); see _start_request.
Settle: TypeAlias = Callable[[Any, "errors.BrokerError | None"], None]

DEFAULT_SESSION_TTL_MS = 10_000


class SessionStream:
    """One engine's session stream, kept alive by itself; the transport under ``EngineSession``.

    Callbacks may be plain functions or coroutines, run on the session's loop (never
    block it); one that raises is logged and never ends the session.
    """

    def __init__(
        self,
        address: str,
        engine: pb.EngineInfo,
        *,
        ttl_ms: int,
        expected_ranks: int,
        client: AsyncBrokerClient | None,
        on_revoked: Callable[[pb.LeaseRevoked], Any] | None,
        on_lease_ended: Callable[[pb.LeaseEnded], Any] | None,
        on_pin: Callable[[pb.PinCommand], Any] | None,
        on_drain: Callable[[pb.DrainCommand], Any] | None,
        on_connected: Callable[[pb.Registered], Any] | None,
        on_disconnected: Callable[[errors.BrokerError | None], Any] | None,
        load: Callable[[], float] | None,
        backoff: Backoff,
        register_timeout_s: float,
        clock: SessionClock | None,
    ) -> None:
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
        self.register_timeout_s = register_timeout_s
        # Heartbeats, the silence limit, stall forgiveness and back-off all go by this clock.
        self.clock: SessionClock = clock if clock is not None else AsyncioClock()

        self.registered: pb.Registered | None = None
        self.registrations = 0  # successful registrations so far (1 + reconnects)
        self.last_error: errors.BrokerError | None = None
        self.fatal_error: errors.BrokerError | None = None

        self._seq = 0
        self._outbox: asyncio.Queue[pb.SessionUp] | None = None
        # Requests on the stream waiting for the reply with their seq (resolves, barriers,
        # lease commands): how each is settled, and its deadline's timer.
        self._replies: dict[int, tuple[Settle, asyncio.TimerHandle]] = {}
        self._connected = asyncio.Event()
        self._run_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.liveness = Liveness()
        # A silent replica's stream, cancelled once the next replica has registered the session.
        self._abandoned: Any = None
        self.moves = 0  # how often the session moved to another replica on silence

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
    def several(self) -> bool:
        """Whether the client names several replicas (a move resumes the session)."""
        return len(self.client.endpoints) > 1

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
        self._cancel_flush()
        if self._run_task is not None:
            self._run_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._run_task
        for task in list(self._background):
            task.cancel()
        self._drop_abandoned()
        if self._owns_client:
            await self.client.close()

    # -- what every registration and heartbeat carries -----------------------

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
            await self.client.register_rank(engine_id=self.engine_id, rank=rank)  # the session's own host
        except errors.BrokerError as err:
            log.warning("register_rank pp=%d tp=%d failed: %s", rank.pp_rank, rank.tp_rank, err)

    # -- hooks for what goes over the stream (EngineSession) -----------------------

    def _resync(self, registered: pb.Registered, outbox: asyncio.Queue[pb.SessionUp]) -> None:
        """Just registered, not yet connected: queue what must reach the broker before anything else."""

    def _on_serving(self, registered: pb.Registered) -> None:
        """Registered and connected; the stream's loops start next."""

    def _cancel_flush(self) -> None:
        """The session closes or lost its stream: stop any timer that would send on it."""

    # -- the connection loop -------------------------------------------------

    async def _run(self) -> None:
        attempt = 0
        while not self._closing:
            error: errors.BrokerError | None = None
            address = self.client.endpoints.current
            try:
                await self._connect_and_serve(address)
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
            self.client.endpoints.fail_over(address)  # the next replica, if there are several
            attempt += 1
            await self.clock.sleep(self.client.endpoints.retry_delay(attempt, self.backoff.delay))

    def _drop_abandoned(self) -> None:
        if self._abandoned is not None:
            self._abandoned.cancel()
            self._abandoned = None

    def _mark_disconnected(self) -> bool:
        was_connected = self.connected
        self._connected.clear()
        self._outbox = None
        self._cancel_flush()
        for seq in list(self._replies):
            self._settle(seq, error=errors.Unavailable("broker session lost before the answer came"))
        return was_connected

    async def _connect_and_serve(self, address: str) -> None:
        call = self.client.stub_for(address)[0].Session(metadata=trace_metadata())
        silent = False
        try:
            try:
                registered = await self._register(call)
            finally:
                self._drop_abandoned()  # this replica owns the session now (or refused it)
            outbox: asyncio.Queue[pb.SessionUp] = asyncio.Queue()
            self._outbox = outbox
            self.registered = registered
            self.registrations += 1
            self.liveness.connected(self.clock.now())
            self._resync(registered, outbox)
            self._connected.set()
            log.info(
                "engine %s registered: session %s..., layout %s, ttl %d ms",
                self.engine_id,
                registered.session_id[:8],  # the whole id is a secret: it proves calls are this engine's
                registered.layout_id,
                registered.session_ttl_ms,
            )
            self._callback(self.on_connected, registered)
            self._on_serving(registered)
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
                if isinstance(exc, Silent):
                    silent = True
                    self.moves += 1
                    log.warning(
                        "session of %s: replica %s silent: %s; moving on", self.engine_id, address, exc
                    )
                if isinstance(exc, GaveUp):
                    raise errors.Unavailable(str(exc))
                if exc is not None:
                    raise exc
        finally:
            if silent:
                self._abandoned = call  # cancelled once the next replica took the session over
            else:
                call.cancel()

    async def _register(self, call: Any) -> pb.Registered:
        self._seq += 1
        register = pb.Register(
            engine=self.engine, session_ttl_ms=self.ttl_ms, expected_ranks=self.expected_ranks
        )
        register.lease_ends_on_answers = True  # read in _dispatch
        register.resume_session_id = self.registered.session_id if self.registered else ""  # shared state
        timeout_s = register_timeout_s(self.register_timeout_s, self.session_ttl_s, self.several)
        try:
            await call.write(pb.SessionUp(seq=self._seq, register=register))
            async with asyncio.timeout(timeout_s):  # not wait_for (Python 3.11's can lose a cancel)
                reply = await call.read()
        except TimeoutError:
            raise errors.Unavailable(
                f"broker did not answer the registration within {timeout_s:g} s"
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
            self.liveness.heard(self.clock.now())
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
        clock = self.clock
        last_sent = clock.now()
        while True:
            ttl_s = self.session_ttl_s
            interval_s = self.heartbeat_interval_s
            nap_s = max(0.02, min(interval_s, ttl_s / 10.0))
            before = clock.now()
            await clock.sleep(nap_s)
            now = clock.now()
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
                self.liveness.stalled(now, stalled)
                # Due now whatever the interval (now - (now - interval) may round below it).
                last_sent = -math.inf
            await self.liveness.check_after_reads(now, clock.now, ttl_s, self.several)
            if now - last_sent >= interval_s:
                self._seq += 1
                outbox.put_nowait(
                    pb.SessionUp(seq=self._seq, heartbeat=pb.Heartbeat(load=self._current_load()))
                )
                last_sent = now
                self.liveness.asked(now)

    def _current_load(self) -> float:
        return self._load() if self._load is not None else self._load_value

    def _send(self, message: pb.SessionUp) -> None:
        if self._outbox is not None:
            self._seq += 1
            message.seq = self._seq
            self._outbox.put_nowait(message)

    def _live_outbox(self) -> asyncio.Queue[pb.SessionUp]:
        """The stream's outbox; Unavailable when the session is not connected."""
        if not self.connected or self._outbox is None:
            raise errors.Unavailable(f"engine {self.engine_id} has no live broker session")
        return self._outbox

    def _start_request(self, message: pb.SessionUp, timeout: float, what: str, settle: Settle) -> int:
        """Send ``message`` behind everything queued so far; its seq.

        ``settle(reply, error)`` is called once, on the session's loop: by
        ``_dispatch`` when the reply with that seq is read (synchronously, so
        before any later message of the stream is dispatched), with Unavailable
        when the stream breaks first, or with DeadlineExceeded after ``timeout``.
        Raises Unavailable at once when not connected.
        """
        outbox = self._live_outbox()
        self._seq += 1
        seq = message.seq = self._seq
        late = errors.DeadlineExceeded(f"{what} got no answer within {timeout:g} s")
        timer = asyncio.get_running_loop().call_later(timeout, lambda: self._settle(seq, error=late))
        self._replies[seq] = (settle, timer)
        self.liveness.asked(self.clock.now())
        outbox.put_nowait(message)
        return seq

    async def _request(self, message: pb.SessionUp, timeout: float, what: str) -> Any:
        """``_start_request``, awaited: the broker's reply, or its error raised."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def settle(reply: Any, error: errors.BrokerError | None) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(reply)

        seq = self._start_request(message, timeout, what, settle)
        try:
            return await future
        finally:
            if (pending := self._replies.pop(seq, None)) is not None:
                pending[1].cancel()  # the caller was cancelled

    async def _barrier(self, timeout: float) -> None:
        """Return once the broker has handled every message sent on this stream before the call:
        it reads one session's stream in order and acks a heartbeat (same seq) only after handling
        it, so the ack proves that everything queued before the heartbeat was handled too."""
        heartbeat = pb.SessionUp(heartbeat=pb.Heartbeat(load=self._current_load()))
        await self._request(heartbeat, timeout, "the barrier heartbeat")

    # -- messages from the broker -------------------------------------------

    def _dispatch(self, message: pb.SessionDown) -> None:
        for ended in message.lease_ends:  # they came before the message they ride on
            self._callback(self.on_lease_ended, ended)
        kind = message.WhichOneof("msg")
        if kind in ("resolve", "lease", "decline"):
            self._settle(message.seq, result=getattr(message, kind))
        elif kind == "heartbeat_ack":
            # Answers a barrier (_barrier); any other heartbeat's ack only proves the broker alive.
            self._settle(message.seq, result=message.heartbeat_ack)
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
        # A repeated registered only proves the broker is alive.

    def _settle(self, seq: int, result: Any = None, error: errors.BrokerError | None = None) -> bool:
        pending = self._replies.pop(seq, None)
        if pending is None:
            return False
        settle, timer = pending
        timer.cancel()
        try:
            settle(result, error)
        except Exception:
            log.exception("settling the answer of message %d failed", seq)
        return True

    async def _answer_pin(self, command: pb.PinCommand) -> None:
        self._send(pb.SessionUp(pin_result=await pin_result(self.on_pin, command)))

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
