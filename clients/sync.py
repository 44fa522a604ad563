"""Blocking client for the broker: the same methods as ``kvbroker.clients.aio.AsyncBrokerClient``.

For scripts, the CLI and routers without an event loop. Do not call it from
vLLM's scheduler thread: use ``kvbroker.clients.session.ThreadedEngineSession`` there,
whose calls return futures instead of blocking.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from kvbroker.clients import errors
from kvbroker.clients.aio import (
    DEFAULT_ADDRESS,
    DEFAULT_TIMEOUT_S,
    build_request,
    channel_options,
    trace_metadata,
)
from kvbroker.clients.credentials import ClientSecurity, FileStamp, sync_channel
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
        self.channel = channel or sync_channel(address, self._security, self._options)
        self._files = FileStamp(self._security) if channel is None and self._security.tls else None
        self._retired: list[grpc.Channel] = []
        self._stub = broker_pb2_grpc.KVBrokerStub(self.channel)

    @property
    def stub(self) -> broker_pb2_grpc.KVBrokerStub:
        if self._files is not None and self._files.changed():
            self._retired.append(self.channel)
            self.channel = sync_channel(self.address, self._security, self._options)
            self._stub = broker_pb2_grpc.KVBrokerStub(self.channel)
        return self._stub

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_channel:
            for old in self._retired:
                old.close()
            self.channel.close()

    def wait_ready(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until the channel is connected; Unavailable if not within ``timeout``."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.Unavailable(f"broker at {self.address} not reachable within {timeout:g} s") from None

    def _unary(
        self, method: str, request: Message, timeout: float | None, engine_id: str = "", session_id: str = ""
    ) -> Any:
        call = getattr(self.stub, method)
        metadata = trace_metadata()
        if engine_id:
            metadata = (*(metadata or ()), (ENGINE_ID_METADATA, engine_id))
        if session_id:  # proves the call comes from that engine's session (acts as the engine)
            metadata = (*(metadata or ()), (SESSION_ID_METADATA, session_id))
        try:
            return call(request, timeout=self.timeout if timeout is None else timeout, metadata=metadata)
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None

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

    def watch(self, request: pb.WatchRequest | None = None, **fields: Any) -> Iterator[pb.WatchEvent]:
        """Events until the caller stops iterating or the broker ends the stream."""
        call = self.stub.Watch(build_request(pb.WatchRequest, request, fields), metadata=trace_metadata())
        try:
            yield from call
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        finally:
            call.cancel()
