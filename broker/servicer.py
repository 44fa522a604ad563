"""The gRPC servicer: decode, call the domain core, encode. Nothing else.

Domain errors become gRPC statuses through the one table in broker/status.py,
their cause (kvbroker.common.causes) riding along as a google.rpc.ErrorInfo in
the grpc-status-details-bin trailer, or in SessionError.cause on the Session
stream; any other exception is a bug and is left to gRPC (UNKNOWN), never dressed up.
The Session stream is the engines' fast path: a reader loop answers resolves
directly (one write per reply); a writer loop drains the session's queue of
notifications. Both write under one lock, since a stream takes one write at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc
from opentelemetry.trace import Tracer

from kvbroker.broker import codec, lease_calls, listing, placement_order, watch_stream
from kvbroker.broker import events as ev
from kvbroker.broker.channels import Close, SessionChannel, SessionNotifier
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import BrokerError, InvalidArgument, Unavailable
from kvbroker.broker.leases import Lease
from kvbroker.broker.mirror import live_updates, mirror_engine_info
from kvbroker.broker.registry import EngineRecord
from kvbroker.broker.results import ResolveResult, Stats
from kvbroker.broker.retention_calls import RetentionCalls
from kvbroker.broker.servicer_parts import EngineCheck, StreamObserver
from kvbroker.broker.status import abort, answer, status_of, trailers
from kvbroker.broker.tracing import command_span
from kvbroker.common.causes import Cause
from kvbroker.common.metadata import ENGINE_ID_METADATA
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc

log = logging.getLogger("kvbroker.servicer")


async def _abort(context: grpc.aio.ServicerContext, err: BrokerError) -> NoReturn:
    await abort(context, status_of(err), err.message, err.cause, err.metadata)


def _session_error(seq: int, err: BrokerError) -> pb.SessionDown:
    return pb.SessionDown(
        seq=seq,
        error=pb.SessionError(
            code=status_of(err).name, message=err.message, cause=err.cause, metadata=err.metadata
        ),
    )


class BrokerServicer(
    RetentionCalls, broker_pb2_grpc.KVBrokerServicer
):  # Retain, Unretain: retention_calls.py
    def __init__(
        self,
        core: BrokerCore,
        notifier: SessionNotifier,
        engines: EngineCheck,
        *,
        stats: Callable[[], Stats] | None = None,
        stream_observer: StreamObserver | None = None,
        tracer: Tracer | None = None,
        session_guard: Callable[[EngineRecord, pb.SessionUp], None] | None = None,
    ) -> None:
        self.core = core
        self.notifier = notifier
        # Who may act as which engine: every path that acts as one asks it (one rule, one cause).
        self.engines = engines
        self.shutting_down = False
        self.stats: Callable[[], Stats] = stats or core.stats  # a fleet replica: the fleet's counts
        # Session-stream metrics (None: off); the unary calls are timed by an interceptor.
        self.stream_observer = stream_observer
        # Spans for the lease commands on Session streams (None: tracing is off).
        self.tracer = tracer
        # Checks each Session message as the caller's identity (broker.auth; None: no authentication).
        self.session_guard = session_guard

    # -- Session stream ------------------------------------------------------------

    async def Session(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.SessionUp], context: grpc.aio.ServicerContext
    ) -> None:
        timeout_ms = self.core.config.register_timeout_ms
        try:
            async with asyncio.timeout(timeout_ms / 1000):  # not wait_for: see broker/mirror.py
                first = await anext(aiter(request_iterator), None)
        except TimeoutError:
            await abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no 'register' message within {timeout_ms} ms of opening the Session stream "
                "(--register-timeout-ms); send it first",
                Cause.REGISTER_TIMEOUT,
            )
        if first is None:
            return
        if first.WhichOneof("msg") != "register":
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the first Session message must be 'register', got {first.WhichOneof('msg') or 'nothing'}",
                Cause.BAD_REQUEST,
            )
        reg = first.register
        caller = self.engines.caller_of(context)
        try:
            self.engines.admit(caller, reg.engine.engine_id, reg.resume_session_id)
            rec = self.core.register(
                reg.engine, reg.session_ttl_ms, reg.expected_ranks, reg.resume_session_id
            )
        except BrokerError as err:
            await _abort(context, err)
            return
        self.engines.registered(rec, caller)
        channel = self.notifier.attach(rec.session_id, self.core.config.session_buffer_bytes, rec)
        channel.ends_on_answers = reg.lease_ends_on_answers
        lock = asyncio.Lock()
        ttl_ms = int(rec.ttl_s * 1000)
        await context.write(
            pb.SessionDown(
                seq=first.seq,
                registered=pb.Registered(
                    session_id=rec.session_id,
                    layout_id=rec.layout_id,
                    session_ttl_ms=ttl_ms,
                    heartbeat_interval_ms=max(1, ttl_ms // 3),
                    resumed=bool(reg.resume_session_id) and rec.session_id == reg.resume_session_id,
                ),
            )
        )
        reader = asyncio.create_task(self._read_session(request_iterator, context, rec, channel, lock))
        reader.add_done_callback(lambda _t: channel.queue.put_nowait(Close("", "")))
        try:
            while True:
                item = await channel.queue.get()
                channel.taken(item)
                if isinstance(item, Close):
                    if item.code:  # the broker ended the session
                        code = grpc.StatusCode[item.code]
                        about = {"engine_id": rec.engine_id}
                        error = pb.SessionError(code=item.code, message=item.message)
                        if item.cause:
                            error.cause = item.cause
                            error.metadata.update(about)
                            context.set_trailing_metadata(trailers(code, item.message, item.cause, about))
                        async with lock:
                            await context.write(pb.SessionDown(error=error))
                        context.set_code(code)
                        context.set_details(item.message)
                    break
                async with lock:
                    await context.write(item)
        finally:
            reader.cancel()
            # A newer stream of this session resumed here (its engine left this one as silent and
            # came back): only this stream went, the session goes on.
            mine = self.notifier.detach(rec.session_id, channel)
            if mine and not self.shutting_down:
                # Stream broken or ended: the session ends and its leases with it.
                try:
                    self.core.stream_ended(rec)
                except Unavailable as err:
                    log.warning("session of %s ends once the store is back: %s", rec.engine_id, err.message)
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            raise reader.exception()  # type: ignore[misc]

    async def _read_session(
        self,
        request_iterator: AsyncIterator[pb.SessionUp],
        context: grpc.aio.ServicerContext,
        rec: EngineRecord,
        channel: SessionChannel,
        lock: asyncio.Lock,
    ) -> None:
        core = self.core
        clock = core.clock
        observer = self.stream_observer
        async for msg in request_iterator:
            if channel.closed is not None:
                return
            started = time.perf_counter() if observer is not None else 0.0
            code = "OK"
            rec.deadline = clock.now() + rec.ttl_s  # any message proves liveness
            kind = msg.WhichOneof("msg")
            seq = msg.seq
            reply: pb.SessionDown | None = None
            try:
                if self.session_guard is not None:
                    self.session_guard(rec, msg)
                if kind in lease_calls.SESSION_COMMANDS:
                    self.engines.acting_as(
                        self.engines.session_caller(rec), lease_calls.acting_engine(msg), kind
                    )
                    with command_span(self.tracer, kind.capitalize(), msg.trace_context):
                        reply = lease_calls.session_command(core, rec, msg)
                elif kind == "resolve":
                    reply = self._session_resolve(rec, seq, msg.resolve, channel)
                elif kind == "heartbeat":
                    core.heartbeat(rec, msg.heartbeat.load)
                    reply = pb.SessionDown(seq=seq, heartbeat_ack=msg.heartbeat)
                elif kind == "inventory":
                    inv = msg.inventory
                    core.update_inventory(
                        rec, codec.namespace(inv.namespace), inv.tier, inv.stored, inv.removed, inv.clear_all
                    )
                elif kind == "pin_result":
                    pr = msg.pin_result
                    core.pin_result(rec, pr.lease_id, pr.ok, pr.block_ids, pr.error, pr.given_up)
                elif kind == "register":
                    raise InvalidArgument(
                        "this stream already registered; open a new stream to register again"
                    )
                else:
                    raise InvalidArgument("empty SessionUp message: set one of the msg fields")
            except BrokerError as err:
                reply = _session_error(seq, err)
                code = reply.error.code
            if observer is not None:
                observer.message(kind or "empty", code, time.perf_counter() - started)
            if reply is None:
                continue
            if kind in lease_calls.SESSION_COMMANDS:
                # A lease command's answer takes the notifications' queue, in the same
                # synchronous step as the core call: whatever the command causes later
                # (the LeaseEnded of this hold, say) is queued behind it, and the writer
                # writes the queue in order, so the engine reads this answer first. Ends of
                # earlier leases that the command's store call took go with it (put_answer).
                channel.put_answer(reply)
            else:
                async with lock:
                    await context.write(reply)

    def _session_resolve(
        self, rec: EngineRecord, seq: int, req: pb.ResolveRequest, channel: SessionChannel
    ) -> pb.SessionDown | None:
        core = self.core
        result = core.resolve(
            rec, codec.namespace(req.namespace), req.block_hashes, **codec.resolve_options(req)
        )
        if result.pending and result.lease is not None:
            observer = self.stream_observer
            asked = time.perf_counter()

            def answer(lease: Lease) -> None:
                if observer is not None:
                    outcome = "pinned" if lease.state.live else lease.cause.label
                    observer.pin(outcome, time.perf_counter() - asked)
                channel.put(pb.SessionDown(seq=seq, resolve=self._settled(result, lease)))

            self.notifier.wait_pin(result.lease.lease_id, answer)
            return None
        return pb.SessionDown(seq=seq, resolve=codec.resolve_pb(result, core.clock.now()))

    def _settled(self, result: ResolveResult, lease: Lease) -> pb.ResolveResponse:
        result.pending = False
        result.lease = lease
        if not lease.state.live:
            result.skipped_reason = lease.cause.label  # holder_refused, holder_gone, ...
        return codec.resolve_pb(result, self.core.clock.now())

    # -- unary: engine side ---------------------------------------------------------

    def _acting_as(self, engine_id: str, context: grpc.aio.ServicerContext, what: str) -> None:
        """A unary call acting as `engine_id` must come from that engine (broker/security/engine_identity.py)."""
        self.engines.acting_as(self.engines.caller_of(context), engine_id, what)

    def _asker(self, context: grpc.aio.ServicerContext) -> EngineRecord | None:
        """The engine a unary Resolve asks as (its engine id in the metadata, or its session id); None for
        a router. The caller must be that engine, as for every call that acts as one."""
        caller = self.engines.caller_of(context)
        engine_id = self.engines.call_metadata(context, ENGINE_ID_METADATA)
        if not engine_id and caller.session_id:
            engine_id = self.core.registry.by_session(caller.session_id).engine_id
        if not engine_id:
            return None
        rec = self.engines.acting_as(caller, engine_id, f"Resolve with {ENGINE_ID_METADATA}")
        return rec if rec is not None else self.core.registry.get(engine_id)

    async def RegisterRank(
        self, request: pb.RegisterRankRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterRankResponse:
        try:
            self._acting_as(request.engine_id, context, "RegisterRank")
            self.core.register_rank(request.engine_id, request.rank)
        except BrokerError as err:
            await _abort(context, err)
        return pb.RegisterRankResponse()

    async def Hold(self, request: pb.HoldRequest, context: grpc.aio.ServicerContext) -> pb.LeaseResponse:
        try:
            self._acting_as(request.holder_engine_id, context, "Hold (holder_engine_id)")
            return lease_calls.hold(self.core, request)
        except BrokerError as err:
            await _abort(context, err)

    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaseResponse:
        try:
            self._acting_as(request.reader_engine_id, context, "Acquire (reader_engine_id)")
            return lease_calls.acquire(self.core, request)
        except BrokerError as err:
            await _abort(context, err)

    async def Renew(self, request: pb.RenewRequest, context: grpc.aio.ServicerContext) -> pb.LeaseResponse:
        try:
            self._acting_as(request.engine_id, context, "Renew (engine_id)")
            return lease_calls.renew(self.core, request)
        except BrokerError as err:
            await _abort(context, err)

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaseResponse:
        try:
            self._acting_as(request.reader_engine_id, context, "Release (reader_engine_id)")
            return lease_calls.release(self.core, request)
        except BrokerError as err:
            await _abort(context, err)

    async def Decline(
        self, request: pb.DeclineRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeclineResponse:
        try:
            return lease_calls.decline(self.core, request)
        except BrokerError as err:
            await _abort(context, err)

    async def Resolve(
        self, request: pb.ResolveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResolveResponse:
        core = self.core
        try:
            asker = self._asker(context)
            options = codec.resolve_options(request)
            result = core.resolve(asker, codec.namespace(request.namespace), request.block_hashes, **options)
        except BrokerError as err:
            await _abort(context, err)
        if result.pending and result.lease is not None:
            settled: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()

            def wake(lease: Lease) -> None:
                if not settled.done():
                    settled.set_result(lease)

            self.notifier.wait_pin(result.lease.lease_id, wake)
            # The pin timeout bounds this wait: the expiry loop settles the lease.
            return self._settled(result, await settled)
        return codec.resolve_pb(result, core.clock.now())

    # -- unary: routers and operators -----------------------------------------------

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        try:
            result = self.core.score(
                codec.namespace(request.namespace),
                request.block_hashes,
                request.token_ids,
                request.candidates,
                request.require_exact,
            )
            return placement_order.score_answer(result, request)  # prefix order unless asked otherwise
        except BrokerError as err:
            await _abort(context, err)

    async def ListEngines(
        self, request: pb.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEnginesResponse:
        sees = self.engines.visible_engines()
        return await answer(context, lambda: listing.list_engines(self.core, request, sees))

    async def ListLeases(
        self, request: pb.ListLeasesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLeasesResponse:
        owns = self.engines.owned_tenants()
        return await answer(context, lambda: listing.list_leases(self.core, request, owns))

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return await answer(context, lambda: codec.stats_pb(self.stats()))

    async def Revoke(self, request: pb.RevokeRequest, context: grpc.aio.ServicerContext) -> pb.LeaseResponse:
        try:
            lease = self.core.revoke(request.lease_id, request.reason)
        except BrokerError as err:
            await _abort(context, err)
        return lease_calls.lease_response(self.core, lease)

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        try:
            revoked = self.core.drain(request.engine_id, request.reason)
        except BrokerError as err:
            await _abort(context, err)
        return pb.DrainResponse(leases_revoked=revoked)

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEvent]:
        wanted = {
            c
            for c, on in (
                (ev.INDEX, request.index_events),
                (ev.LEASE, request.lease_events),
                (ev.ENGINE, request.engine_events),
            )
            if on
        } or {ev.INDEX, ev.LEASE, ev.ENGINE}  # nothing chosen means everything
        limit = self.core.config.max_watchers
        if self.notifier.watcher_count() >= limit:
            await abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{limit} watchers are connected, the limit (--max-watchers)",
                Cause.TOO_MANY_WATCHERS,
                {"limit": str(limit)},
            )
        watcher = self.notifier.add_watcher(frozenset(wanted), self.core.config.watch_buffer_bytes)
        try:
            async for item in watch_stream.watch_items(self.notifier, watcher, request):
                if isinstance(item, Close):
                    code = grpc.StatusCode[item.code]
                    if item.cause:
                        await abort(context, code, item.message, item.cause)
                    await context.abort(code, item.message)
                else:
                    yield item
        except BrokerError as err:  # a bad resume_after, or the store away while reading it back
            await _abort(context, err)
        finally:
            self.notifier.remove_watcher(watcher)

    # -- Mirror stream -------------------------------------------------------------

    def _mirror_engines(self, layout_id: str) -> list[pb.MirrorUpdate]:
        """The snapshot's first messages: reset, then the layout's engines, below the message limit."""
        budget = self.core.config.max_message_bytes // 2
        batches = _engine_batches(self.core.mirror_engines(layout_id), budget)
        out = [pb.MirrorUpdate(reset=True, engines=batches[0])]
        out.extend(pb.MirrorUpdate(engines=batch) for batch in batches[1:])
        return out

    async def Mirror(
        self, request: pb.MirrorRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.MirrorUpdate]:
        if not request.layout_id:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "layout_id is empty; mirror the layout_id an engine got at registration",
                Cause.BAD_REQUEST,
            )
        try:
            self.core.check.ident(request.layout_id, "layout_id")
        except BrokerError as err:
            await _abort(context, err)
        hub = self.core.mirrors
        limit = self.core.config.max_mirrors
        if hub.subscriber_count() >= limit:
            await abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{limit} mirrors are connected, the limit (--max-mirrors)",
                Cause.TOO_MANY_MIRRORS,
                {"limit": str(limit)},
            )
        ready = asyncio.Event()
        sub = hub.subscribe(request.layout_id, ready.set, self.core.config.mirror_buffer_bytes)
        try:
            while not sub.closed:
                # (Re)sync: changes buffer from this instant; the snapshot follows, then them.
                sub.restart()
                for update in self._mirror_engines(sub.layout_id):
                    yield update
                for chunk in self.core.index.export(sub.layout_id, self.core.config.mirror_chunk):
                    if chunk:
                        yield pb.MirrorUpdate(blocks=[_mirror_blocks(*held) for held in chunk])
                    else:
                        await asyncio.sleep(0)  # a step that found nothing still lets others run
                    if sub.overflowed or sub.closed:
                        break
                else:
                    yield pb.MirrorUpdate(synced=True)
                async for update in live_updates(sub, ready, self.core.config.mirror_keepalive_ms / 1000):
                    yield update
                if sub.overflowed:
                    log.warning("mirror of layout %s fell behind; sending a fresh snapshot", sub.layout_id)
            # Only the broker's shutdown closes a mirror (MirrorHub.close_all).
            await abort(context, grpc.StatusCode.UNAVAILABLE, sub.closed, Cause.SHUTTING_DOWN)
        finally:
            hub.unsubscribe(sub)


def _engine_batches(engines: list[pb.EngineInfo], budget: int) -> list[list[pb.MirrorEngine]]:
    """The snapshot's engines in messages of at most `budget` bytes (one engine per message at least)."""
    batches: list[list[pb.MirrorEngine]] = [[]]
    size = 0
    for info in engines:
        msg = pb.MirrorEngine(engine=mirror_engine_info(info))
        n = msg.ByteSize() + 8
        if batches[-1] and size + n > budget:
            batches.append([])
            size = 0
        batches[-1].append(msg)
        size += n
    return batches


def _mirror_blocks(engine_id: str, tier: Tier, ns: Namespace, hashes: list[int]) -> pb.MirrorBlocks:
    return pb.MirrorBlocks(engine_id=engine_id, tenant=ns.tenant, tier=pb.Tier.ValueType(tier), stored=hashes)
