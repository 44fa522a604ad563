"""``ThreadedEngineSession``: an ``EngineSession`` on its own thread, for synchronous callers.

vLLM's scheduler is synchronous and must never wait on the broker. This
wrapper hosts the session on a background thread's event loop: announce calls
return at once, and resolve/hold/acquire/renew/release return
``concurrent.futures.Future`` objects; a future that is not done is simply
"not ready yet", so the caller never waits on the broker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from opentelemetry import context as otel_context

from kvbroker.clients import errors
from kvbroker.clients.aio import DEFAULT_ADDRESS
from kvbroker.clients.clock import SessionClock
from kvbroker.clients.engine_session import EngineSession, LeaseCommand
from kvbroker.clients.inventory import NamespaceLike, namespace_key
from kvbroker.v1 import broker_pb2 as pb


class ThreadedEngineSession:
    """An ``EngineSession`` on its own thread and event loop, for synchronous callers.

    Every method returns at once: announce calls queue their change;
    resolve/hold/acquire/renew/release return ``concurrent.futures.Future``.
    Callbacks run on the session thread; hand work to your own thread-safe
    structures there. ``on_pin`` may return a ``concurrent.futures.Future``
    that the caller's thread completes later.

    ``options`` are ``EngineSession``'s. ``clock`` is the session's clock (see
    ``EngineSession``); a ``ManualClock`` may be moved from any thread.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        engine: pb.EngineInfo | None = None,
        *,
        clock: SessionClock | None = None,
        **options: Any,
    ):
        if engine is None or not engine.engine_id:
            raise ValueError("ThreadedEngineSession needs an EngineInfo with an engine_id")
        self.address = address
        self._engine = engine
        self._clock = clock
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

    @property
    def session_id(self) -> str:
        """The session id of the last registration ("" before the first); see EngineSession."""
        registered = self._session.registered if self._session else None
        return registered.session_id if registered is not None else ""

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
        session = EngineSession(self.address, self._engine, clock=self._clock, **self._options)
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

    def give_up_pin(self, lease_id: str, reason: str) -> None:
        self._call_soon(self.session.give_up_pin, lease_id, reason)

    def add_rank(self, rank: pb.RankInfo) -> None:
        self._call_soon(self.session.add_rank, rank)

    def mirror_resolve(
        self, namespace: NamespaceLike, block_hashes: Sequence[int]
    ) -> list[pb.HolderMatch] | None:
        """The holders the index mirror names (the broker's ranking, this engine left out),
        at once, from the caller's thread; None without a synced mirror, or one that has heard
        nothing from the broker for too long (IndexMirror.fresh): "ask the broker"."""
        session = self._session
        mirror = session.mirror if session is not None else None
        if mirror is None or not mirror.fresh:
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

    # Lease commands: the future is settled on the session thread as the reply is read,
    # before any later message of the stream (EngineSession.send_lease_command).
    def hold(
        self,
        namespace: NamespaceLike,
        tier: int,
        block_hashes: Iterable[int],
        block_ids: Iterable[int],
        ttl_ms: int,
        **kwargs: Any,
    ) -> concurrent.futures.Future[pb.Lease]:
        hashes, ids = list(block_hashes), list(block_ids)
        return self._lease(lambda s: s.hold_command(namespace, tier, hashes, ids, ttl_ms, **kwargs))

    def acquire(self, lease_id: str, ttl_ms: int = 0) -> concurrent.futures.Future[pb.LeaseResponse]:
        return self._lease(lambda s: s.acquire_command(lease_id, ttl_ms))

    def renew(self, lease_id: str, ttl_ms: int = 0) -> concurrent.futures.Future[pb.Lease]:
        return self._lease(lambda s: s.renew_command(lease_id, ttl_ms))

    def release(
        self, lease_id: str, epoch: int = 0, read: tuple[int, int] | None = None
    ) -> concurrent.futures.Future[pb.Lease]:
        """``read``: (blocks, bytes) read under the lease (EngineSession.release_command)."""
        return self._lease(lambda s: s.release_command(lease_id, epoch, read))

    def decline(
        self, holder_engine_id: str, request_id: str, reason: str = ""
    ) -> concurrent.futures.Future[pb.DeclineResponse]:
        return self._lease(lambda s: s.decline_command(holder_engine_id, request_id, reason))

    def _lease(self, build: Callable[[EngineSession], LeaseCommand]) -> concurrent.futures.Future[Any]:
        session = self.session
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        caller = otel_context.get_current()  # the broker's span continues the caller's

        def send() -> None:
            token = otel_context.attach(caller)
            try:
                session.send_lease_command(build(session), future)
            except Exception as exc:  # a bad argument: fail the future, never the loop
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_exception(exc)
            finally:
                otel_context.detach(token)

        loop = self._loop
        try:
            if loop is None or loop.is_closed():
                raise RuntimeError("closed")
            loop.call_soon_threadsafe(send)
        except RuntimeError:
            # After close() a call fails through its future; it never raises into the caller's thread.
            future.set_exception(errors.Unavailable(f"session of {self.engine_id} is closed"))
        return future

    def applied_async(self, timeout: float | None = None) -> concurrent.futures.Future[None]:
        """A future that completes once the broker has applied everything this session was told
        before the call (``EngineSession.applied``); changes announced from this thread before
        the call are included."""
        return self._submit(self.session.applied(timeout))

    def applied(self, timeout: float | None = None) -> None:
        """Block until the broker has applied everything this session was told before the call.

        For set-up code and tests: the scheduler must never wait on the broker
        (use ``applied_async`` there). Raises as ``EngineSession.applied``.
        """
        limit = self.session.resolve_timeout_s if timeout is None else timeout
        future = self.applied_async(limit)
        try:
            future.result(limit + 1.0)  # the session answers within limit unless its loop is stuck
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise errors.DeadlineExceeded(
                f"session of {self.engine_id} did not answer within {limit:g} s"
            ) from None


async def _with_trace_context(ctx: otel_context.Context, coroutine: Awaitable[Any]) -> Any:
    """Await ``coroutine`` with ``ctx`` as the current OpenTelemetry context."""
    token = otel_context.attach(ctx)
    try:
        return await coroutine
    finally:
        otel_context.detach(token)
