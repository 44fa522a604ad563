"""Blocking client for the broker: the same methods as ``kvbroker.clients.aio.AsyncBrokerClient``.

For scripts, the CLI and routers without an event loop. Do not call it from
vLLM's scheduler thread: use ``kvbroker.clients.threaded_session.ThreadedEngineSession`` there,
whose calls return futures instead of blocking.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from kvbroker.clients import errors
from kvbroker.clients.aio import (
    DEFAULT_ADDRESS,
    DEFAULT_TIMEOUT_S,
    FAILOVER_CODES,
    build_request,
    channel_options,
    retries_elsewhere,
    trace_metadata,
)
from kvbroker.clients.credentials import ClientSecurity, FileStamp, replica_options, sync_channel
from kvbroker.clients.endpoints import Endpoints, split_addresses
from kvbroker.clients.watch import DEFAULT_HEARTBEAT_S
from kvbroker.clients.watch_sync import BlockingWatchFollower
from kvbroker.common.metadata import ENGINE_ID_METADATA, SESSION_ID_METADATA
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc


class BrokerClient:
    """Blocking gRPC client. Use as a context manager or call ``close()``."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
        channel: grpc.Channel | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        """`security`: TLS, mutual TLS or a token (default: from the KVBROKER_TLS_* variables).

        When the certificate files change, later calls go over a new channel
        made from them; calls in flight finish on the old one."""
        self.address = address
        self.timeout = timeout
        self._owns_channel = channel is None
        self._security = security if security is not None else ClientSecurity.from_env()
        self._options = channel_options(options)
        self._endpoints: Endpoints[grpc.Channel] = (
            Endpoints(split_addresses(address), self._make_channel)
            if channel is None
            else Endpoints([address], lambda _: channel)
        )
        self._files = FileStamp(self._security) if channel is None and self._security.tls else None
        self._retired: list[grpc.Channel] = []
        self._stubs: dict[int, broker_pb2_grpc.KVBrokerStub] = {}
        self._endpoints.channel()  # the first one now: bad credentials are refused at construction

    def _make_channel(self, address: str) -> grpc.Channel:
        return sync_channel(
            address, self._security, [*self._options, *replica_options(self.address, self._security)]
        )

    @property
    def endpoints(self) -> Endpoints[grpc.Channel]:
        """The replicas' addresses, the current one, and ``fail_over``."""
        return self._endpoints

    @property
    def channel(self) -> grpc.Channel:
        """The channel to the current replica."""
        return self.stub_for()[1]

    @property
    def stub(self) -> broker_pb2_grpc.KVBrokerStub:
        """The stub over the current replica's channel."""
        return self.stub_for()[0]

    def stub_for(self, address: str | None = None) -> tuple[broker_pb2_grpc.KVBrokerStub, grpc.Channel]:
        """The stub and channel to ``address`` (default: the current replica)."""
        if self._files is not None and self._files.changed():
            self._retired += self._endpoints.take_all()  # calls in flight finish on the old channels
            self._stubs.clear()
        channel = self._endpoints.channel(address)
        stub = self._stubs.get(id(channel))
        if stub is None:
            stub = self._stubs[id(channel)] = broker_pb2_grpc.KVBrokerStub(channel)
        return stub, channel

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_channel:
            for old in [*self._retired, *self._endpoints.take_all()]:
                old.close()
            self._retired.clear()

    def wait_ready(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until a replica's channel is connected (it becomes current); Unavailable if
        none is within ``timeout``."""
        deadline = time.monotonic() + timeout
        endpoints = self._endpoints
        for tries_left in range(len(endpoints), 0, -1):
            address = endpoints.current
            try:
                share = max(0.0, deadline - time.monotonic()) / tries_left
                grpc.channel_ready_future(self.stub_for(address)[1]).result(timeout=share)
                return
            except grpc.FutureTimeoutError:
                endpoints.fail_over(address)
        raise errors.Unavailable(f"broker at {self.address} not reachable within {timeout:g} s")

    def _unary(
        self, method: str, request: Message, timeout: float | None, engine_id: str = "", session_id: str = ""
    ) -> Any:
        metadata = trace_metadata()
        if engine_id:
            metadata = (*(metadata or ()), (ENGINE_ID_METADATA, engine_id))
        if session_id:  # proves the call comes from that engine's session (acts as the engine)
            metadata = (*(metadata or ()), (SESSION_ID_METADATA, session_id))
        endpoints = self._endpoints
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        tries = len(endpoints) if retries_elsewhere(method, request) else 1
        for tries_left in range(tries, 0, -1):
            address = endpoints.current
            call = getattr(self.stub_for(address)[0], method)
            try:
                # A read gets its share of the deadline here, the rest on the next replica.
                share = max(0.0, deadline - time.monotonic()) / tries_left
                return call(request, timeout=share, metadata=metadata)
            except grpc.RpcError as err:
                code = err.code()  # type: ignore[attr-defined]
                if code not in FAILOVER_CODES or len(endpoints) < 2:
                    raise errors.from_rpc_error(err) from None
                endpoints.fail_over(address)  # later calls go elsewhere, whatever this one does
                if tries_left == 1 or deadline <= time.monotonic():
                    raise errors.from_rpc_error(err) from None
        raise AssertionError("unreachable")  # the loop returns or raises

    # Engine side.
    def register_rank(
        self,
        request: pb.RegisterRankRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.RegisterRankResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return self._unary(
            "RegisterRank",
            build_request(pb.RegisterRankRequest, request, fields),
            timeout,
            session_id=session_id,
        )

    def hold(
        self,
        request: pb.HoldRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.LeaseResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return self._unary(
            "Hold", build_request(pb.HoldRequest, request, fields), timeout, session_id=session_id
        )

    def acquire(
        self,
        request: pb.AcquireRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.LeaseResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return self._unary(
            "Acquire", build_request(pb.AcquireRequest, request, fields), timeout, session_id=session_id
        )

    def renew(
        self,
        request: pb.RenewRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.LeaseResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return self._unary(
            "Renew", build_request(pb.RenewRequest, request, fields), timeout, session_id=session_id
        )

    def release(
        self,
        request: pb.ReleaseRequest | None = None,
        *,
        timeout: float | None = None,
        session_id: str = "",
        **fields: Any,
    ) -> pb.LeaseResponse:
        """``session_id``: the acting engine's session id, for a call made outside its session's host."""
        return self._unary(
            "Release", build_request(pb.ReleaseRequest, request, fields), timeout, session_id=session_id
        )

    def resolve(
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
        return self._unary(
            "Resolve",
            build_request(pb.ResolveRequest, request, fields),
            timeout,
            engine_id=engine_id,
            session_id=session_id,
        )

    # Routers.
    def score(
        self, request: pb.ScoreRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.ScoreResponse:
        return self._unary("Score", build_request(pb.ScoreRequest, request, fields), timeout)

    def retain(
        self, request: pb.RetainRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.RetainResponse:
        """Keep a prompt's prefix on its holder for ttl_ms (docs/clients.md, "Retention"); answered once
        the holder pinned it. Not retried on another replica: a second try would make a second lease."""
        return self._unary("Retain", build_request(pb.RetainRequest, request, fields), timeout)

    def unretain(
        self, request: pb.UnretainRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.LeaseResponse:
        """End a retention now (lease_id): its holder unpins the blocks."""
        return self._unary("Unretain", build_request(pb.UnretainRequest, request, fields), timeout)

    # Operators.
    def list_engines(
        self, request: pb.ListEnginesRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.ListEnginesResponse:
        """Every engine (all pages), or the one page asked for when page_size or page_token is set."""
        req = build_request(pb.ListEnginesRequest, request, fields)
        out: pb.ListEnginesResponse = self._unary("ListEngines", req, timeout)
        every = not (req.page_size or req.page_token)
        while out.next_page_token and every:
            req.page_token = out.next_page_token
            page = self._unary("ListEngines", req, timeout)
            out.engines.extend(page.engines)
            out.next_page_token = page.next_page_token
        return out

    def list_leases(
        self, request: pb.ListLeasesRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.ListLeasesResponse:
        """Every lease (all pages), or the one page asked for when page_size or page_token is set."""
        req = build_request(pb.ListLeasesRequest, request, fields)
        out: pb.ListLeasesResponse = self._unary("ListLeases", req, timeout)
        every = not (req.page_size or req.page_token)
        while out.next_page_token and every:
            req.page_token = out.next_page_token
            page = self._unary("ListLeases", req, timeout)
            out.leases.extend(page.leases)
            out.next_page_token = page.next_page_token
        return out

    def stats(self, *, timeout: float | None = None) -> pb.StatsResponse:
        return self._unary("Stats", pb.StatsRequest(), timeout)

    def decline(
        self, request: pb.DeclineRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.DeclineResponse:
        """Nobody will read this hold (holder_engine_id, request_id): the holder frees it now."""
        return self._unary("Decline", build_request(pb.DeclineRequest, request, fields), timeout)

    def revoke(
        self, request: pb.RevokeRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.LeaseResponse:
        return self._unary("Revoke", build_request(pb.RevokeRequest, request, fields), timeout)

    def drain(
        self, request: pb.DrainRequest | None = None, *, timeout: float | None = None, **fields: Any
    ) -> pb.DrainResponse:
        return self._unary("Drain", build_request(pb.DrainRequest, request, fields), timeout)

    def watch(
        self, request: pb.WatchRequest | None = None, *, heartbeat_s: float | None = None, **fields: Any
    ) -> Iterator[pb.WatchEvent]:
        """Events until the caller stops iterating or the broker ends the stream; with several
        replicas (or ``heartbeat_s``) it follows the fleet as the async client's does."""
        req = build_request(pb.WatchRequest, request, fields)
        if heartbeat_s is not None or len(self._endpoints) > 1:
            follower = BlockingWatchFollower(
                self, req, heartbeat_s=heartbeat_s or DEFAULT_HEARTBEAT_S, metadata=trace_metadata()
            )
            yield from follower.events()
            return
        call = self.stub.Watch(req, metadata=trace_metadata())
        try:
            yield from call
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        finally:
            call.cancel()
