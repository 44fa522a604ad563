"""Asyncio client for the broker: one method per RPC.

Each unary method takes either a ready request message or the request's
fields as keyword arguments (handed to the message constructor), and returns
the response message::

    async with AsyncBrokerClient("127.0.0.1:50051") as client:
        lease = (await client.hold(holder_engine_id="p0", namespace=ns, ...)).lease
        await client.release(lease_id=lease.lease_id, reader_engine_id="d0")

Failures raise ``kvbroker.clients.errors.BrokerError`` subclasses. When OpenTelemetry
has a current span, its W3C trace context travels in the call's metadata so
broker spans join the caller's trace.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvbroker.clients import errors
from kvbroker.clients.credentials import ClientSecurity, FileStamp, aio_channel, replica_options
from kvbroker.clients.endpoints import Endpoints, split_addresses
from kvbroker.clients.watch import DEFAULT_HEARTBEAT_S, WatchFollower
from kvbroker.common import keepalive
from kvbroker.common.metadata import ENGINE_ID_METADATA, SESSION_ID_METADATA
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Keepalive pings find a dead broker on an otherwise quiet stream (Watch,
# Mirror). The interval is paired with what the broker accepts in
# kvbroker.common.keepalive; a client may ping faster (``options``), down to
# the broker's --keepalive-min-ping-interval-ms. Sessions do not depend on
# this: their own heartbeats detect a dead broker.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    *keepalive.client_options(),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly after a broker restart instead of gRPC's default 1 s..120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)

_PROPAGATOR = TraceContextTextMapPropagator()

RequestT = TypeVar("RequestT", bound=Message)

# Calls that only read: with several replicas, one that did not answer in its share of the
# caller's deadline is tried on the next replica (a Resolve that acquires is not a read).
READS = frozenset({"Score", "Resolve", "ListEngines", "ListLeases", "Stats"})
# Writes whose repeat changes nothing: a Decline sent again (its first try took effect but the
# answer was lost) finds the hold ended, or claimed by its reader, and only leaves a note that
# expires unused. So a router's Decline reaches a live replica when its own is frozen.
REPEATABLE = frozenset({"Decline"})
# What a replica that is away, frozen or cut off answers: the next call goes to another one.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def retries_elsewhere(method: str, request: Message) -> bool:
    """Whether ``method`` may be sent again to another replica after no answer came."""
    return method in REPEATABLE or (method in READS and not getattr(request, "acquire", False))


def channel_options(extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """Default channel options with ``extra`` overriding by name."""
    merged = dict(CHANNEL_OPTIONS)
    merged.update(dict(extra))
    return list(merged.items())


def trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """``traceparent``/``tracestate`` metadata for the current span, or None without one."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return tuple(carrier.items()) or None


def build_request(cls: type[RequestT], request: RequestT | None, fields: dict[str, Any]) -> RequestT:
    """The request message: ``request`` as given, or one built from keyword fields."""
    if request is not None:
        if fields:
            raise TypeError("pass either a request message or keyword fields, not both")
        if not isinstance(request, cls):
            raise TypeError(f"expected {cls.DESCRIPTOR.full_name}, got {type(request).__name__}")
        return request
    try:
        return cls(**fields)
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgument(f"bad {cls.DESCRIPTOR.name} fields: {exc}") from None


def namespace(layout_id: str, tenant: str = "") -> pb.Namespace:
    """Shorthand for ``pb.Namespace(layout_id=..., tenant=...)``."""
    return pb.Namespace(layout_id=layout_id, tenant=tenant)


class AsyncBrokerClient:
    """grpc.aio client. Create inside a running event loop; close with ``await close()``."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
        channel: grpc.aio.Channel | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        """`security`: TLS, mutual TLS or a token (default: from the KVBROKER_TLS_* variables).

        When the certificate files change, later calls and streams (a session's
        reconnect) go over a new channel made from them; calls in flight finish
        on the old one."""
        self.address = address
        self.timeout = timeout
        self._owns_channel = channel is None
        self._security = security if security is not None else ClientSecurity.from_env()
        self._options = channel_options(options)
        self._endpoints: Endpoints[grpc.aio.Channel] = (
            Endpoints(split_addresses(address), self._make_channel)
            if channel is None
            else Endpoints([address], lambda _: channel)
        )
        self._files = FileStamp(self._security) if channel is None and self._security.tls else None
        self._retired: list[grpc.aio.Channel] = []
        self._stubs: dict[int, broker_pb2_grpc.KVBrokerStub] = {}
        self._endpoints.channel()  # the first one now: bad credentials are refused at construction

    def _make_channel(self, address: str) -> grpc.aio.Channel:
        return aio_channel(
            address, self._security, [*self._options, *replica_options(self.address, self._security)]
        )

    @property
    def endpoints(self) -> Endpoints[grpc.aio.Channel]:
        """The replicas' addresses, the current one, and ``fail_over``."""
        return self._endpoints

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel to the current replica."""
        return self.stub_for()[1]

    @property
    def stub(self) -> broker_pb2_grpc.KVBrokerStub:
        """The stub over the current replica's channel."""
        return self.stub_for()[0]

    def stub_for(self, address: str | None = None) -> tuple[broker_pb2_grpc.KVBrokerStub, grpc.aio.Channel]:
        """The stub and channel to ``address`` (default: the current replica)."""
        if self._files is not None and self._files.changed():
            self._retired += self._endpoints.take_all()  # calls in flight finish on the old channels
            self._stubs.clear()
        channel = self._endpoints.channel(address)
        stub = self._stubs.get(id(channel))
        if stub is None:
            stub = self._stubs[id(channel)] = broker_pb2_grpc.KVBrokerStub(channel)
        return stub, channel

    async def __aenter__(self) -> AsyncBrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_channel:
            for old in [*self._retired, *self._endpoints.take_all()]:
                await old.close()
            self._retired.clear()

    async def wait_ready(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Wait until a replica's channel is connected (it becomes current); Unavailable if
        none is within ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        endpoints = self._endpoints
        for tries_left in range(len(endpoints), 0, -1):
            address = endpoints.current
            try:
                # asyncio.timeout, not wait_for (Python 3.11's can lose a cancellation).
                async with asyncio.timeout((deadline - loop.time()) / tries_left):
                    await self.stub_for(address)[1].channel_ready()
                return
            except TimeoutError:
                endpoints.fail_over(address)
        raise errors.Unavailable(f"broker at {self.address} not reachable within {timeout:g} s")

    async def _unary(
        self, method: str, request: Message, timeout: float | None, engine_id: str = "", session_id: str = ""
    ) -> Any:
        metadata = trace_metadata()
        if engine_id:
            metadata = (*(metadata or ()), (ENGINE_ID_METADATA, engine_id))
        if session_id:  # proves the call comes from that engine's session (acts as the engine)
            metadata = (*(metadata or ()), (SESSION_ID_METADATA, session_id))
        endpoints = self._endpoints
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if timeout is None else timeout)
        tries = len(endpoints) if retries_elsewhere(method, request) else 1
        for tries_left in range(tries, 0, -1):
            address = endpoints.current
            call = getattr(self.stub_for(address)[0], method)
            try:
                # A read gets its share of the deadline here, the rest on the next replica.
                return await call(
                    request, timeout=max(0.0, deadline - loop.time()) / tries_left, metadata=metadata
                )
            except grpc.RpcError as err:
                if err.code() not in FAILOVER_CODES or len(endpoints) < 2:
                    raise errors.from_rpc_error(err) from None
                endpoints.fail_over(address)  # later calls go elsewhere, whatever this one does
                if tries_left == 1 or deadline <= loop.time():
                    raise errors.from_rpc_error(err) from None
        raise AssertionError("unreachable")  # the loop returns or raises

    # Engine side.
    async def register_rank(
        self,
        request: pb.RegisterRankRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.RegisterRankResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return await self._unary(
            "RegisterRank",
            build_request(pb.RegisterRankRequest, request, fields),
            timeout,
            session_id=session_id,
        )

    async def hold(
        self,
        request: pb.HoldRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.LeaseResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return await self._unary(
            "Hold", build_request(pb.HoldRequest, request, fields), timeout, session_id=session_id
        )

    async def acquire(
        self,
        request: pb.AcquireRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.LeaseResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return await self._unary(
            "Acquire", build_request(pb.AcquireRequest, request, fields), timeout, session_id=session_id
        )

    async def renew(
        self,
        request: pb.RenewRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.LeaseResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return await self._unary(
            "Renew", build_request(pb.RenewRequest, request, fields), timeout, session_id=session_id
        )

    async def release(
        self,
        request: pb.ReleaseRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.LeaseResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return await self._unary(
            "Release", build_request(pb.ReleaseRequest, request, fields), timeout, session_id=session_id
        )

    async def resolve(
        self,
        request: pb.ResolveRequest | None = None,
        *,
        timeout: float | None = None,
        engine_id: str = "",
        session_id: str = "",
        **fields: Any,
    ) -> pb.ResolveResponse:
        """Unary resolve. ``engine_id`` names the asking engine (needed for ``acquire``).

        Engines should resolve over their session instead (``EngineSession.resolve``): it is cheaper.
        """
        return await self._unary(
            "Resolve",
            build_request(pb.ResolveRequest, request, fields),
            timeout,
            engine_id=engine_id,
            session_id=session_id,
        )

    # Routers.
    async def score(
        self, request: pb.ScoreRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.ScoreResponse:
        return await self._unary("Score", build_request(pb.ScoreRequest, request, fields), timeout)

    async def retain(
        self, request: pb.RetainRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.RetainResponse:
        """Keep a prompt's prefix on its holder for ttl_ms (docs/clients.md, "Retention"); answered once
        the holder pinned it. Not retried on another replica: a second try would make a second lease."""
        return await self._unary("Retain", build_request(pb.RetainRequest, request, fields), timeout)

    async def unretain(
        self, request: pb.UnretainRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.LeaseResponse:
        """End a retention now (lease_id): its holder unpins the blocks."""
        return await self._unary("Unretain", build_request(pb.UnretainRequest, request, fields), timeout)

    # Operators.
    async def list_engines(
        self, request: pb.ListEnginesRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.ListEnginesResponse:
        """Every engine (all pages), or the one page asked for when page_size or page_token is set."""
        req = build_request(pb.ListEnginesRequest, request, fields)
        out: pb.ListEnginesResponse = await self._unary("ListEngines", req, timeout)
        every = not (req.page_size or req.page_token)
        while out.next_page_token and every:
            req.page_token = out.next_page_token
            page = await self._unary("ListEngines", req, timeout)
            out.engines.extend(page.engines)
            out.next_page_token = page.next_page_token
        return out

    async def list_leases(
        self, request: pb.ListLeasesRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.ListLeasesResponse:
        """Every lease (all pages), or the one page asked for when page_size or page_token is set."""
        req = build_request(pb.ListLeasesRequest, request, fields)
        out: pb.ListLeasesResponse = await self._unary("ListLeases", req, timeout)
        every = not (req.page_size or req.page_token)
        while out.next_page_token and every:
            req.page_token = out.next_page_token
            page = await self._unary("ListLeases", req, timeout)
            out.leases.extend(page.leases)
            out.next_page_token = page.next_page_token
        return out

    async def stats(self, *, timeout: float | None = None) -> pb.StatsResponse:
        return await self._unary("Stats", pb.StatsRequest(), timeout)

    async def decline(
        self, request: pb.DeclineRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.DeclineResponse:
        """Nobody will read this hold (holder_engine_id, request_id): the holder frees it now."""
        return await self._unary("Decline", build_request(pb.DeclineRequest, request, fields), timeout)

    async def revoke(
        self, request: pb.RevokeRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.LeaseResponse:
        return await self._unary("Revoke", build_request(pb.RevokeRequest, request, fields), timeout)

    async def drain(
        self, request: pb.DrainRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.DrainResponse:
        return await self._unary("Drain", build_request(pb.DrainRequest, request, fields), timeout)

    async def watch(
        self, request: pb.WatchRequest | None = None, *, heartbeat_s: float | None = None, **fields: Any
    ) -> AsyncIterator[pb.WatchEvent]:
        """Events until the caller stops iterating or the broker ends the stream.

        With several replicas (or ``heartbeat_s`` given) the Watch follows the fleet: a replica
        silent for a few heartbeats (``heartbeat_s``, default 0.5 s) or unreachable is left for
        the next, which resumes the stream where it was (``kvbroker.clients.watch``)."""
        req = build_request(pb.WatchRequest, request, fields)
        if heartbeat_s is not None or len(self._endpoints) > 1:
            follower = WatchFollower(
                self, req, heartbeat_s=heartbeat_s or DEFAULT_HEARTBEAT_S, metadata=trace_metadata()
            )
            async for event in follower.events():
                yield event
            return
        call = self.stub.Watch(req, metadata=trace_metadata())
        try:
            async for event in call:
                yield event
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        finally:
            call.cancel()
