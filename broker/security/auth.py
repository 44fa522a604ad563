"""The authorization interceptor: every KVBroker call runs as an identity, within its role's rights.

For each call it finds the caller's identity (kvbroker.broker.security.identity: the
client certificate's URI SAN, else the bearer token), refuses it without one
(UNAUTHENTICATED), checks the role table below (PERMISSION_DENIED naming the
identity and the rule), spends the identity's request-rate quota, and hands
request and answer to the TenantGuard (kvbroker.broker.security.tenancy), which keeps
each tenant to itself. The identity is also set in `CURRENT`
(broker/security/engine_identity.py) for the call, so the servicer checks who
acts as which engine with it, and its session loop checks each stream message
through `session_guard`.

Health checks and server reflection stay open (they tell nothing about the
fleet), so load balancers and tools work without credentials.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from kvbroker.broker.errors import BrokerError, PermissionDenied
from kvbroker.broker.registry import EngineRecord
from kvbroker.broker.security.engine_identity import CURRENT
from kvbroker.broker.security.identity import Authenticator, Identity, Role, Unidentified
from kvbroker.broker.security.quotas import Quotas
from kvbroker.broker.security.tenancy import TenantGuard
from kvbroker.broker.status import abort, status_of
from kvbroker.common.causes import Cause
from kvbroker.v1 import broker_pb2 as pb

SERVICE_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["KVBroker"].full_name + "/"

ENG, RTR, OPS = Role.ENGINE, Role.ROUTER, Role.OPERATOR
# Who may call what. Engines act for themselves; routers read (Score, Resolve,
# Mirror, engines without NIXL metadata) and decline holds nobody will read;
# operators list, watch, revoke and drain.
ROLES_OF_METHOD: dict[str, frozenset[Role]] = {
    "Session": frozenset({ENG}),
    "RegisterRank": frozenset({ENG}),
    "Hold": frozenset({ENG}),
    "Acquire": frozenset({ENG}),
    "Renew": frozenset({ENG}),
    "Release": frozenset({ENG}),
    "Decline": frozenset({ENG, RTR}),
    "Resolve": frozenset({ENG, RTR, OPS}),
    "Mirror": frozenset({ENG, RTR, OPS}),
    "Score": frozenset({RTR, OPS}),
    "ListEngines": frozenset({RTR, OPS}),
    "ListLeases": frozenset({OPS}),
    "Stats": frozenset({OPS}),
    "Revoke": frozenset({OPS}),
    "Drain": frozenset({OPS}),
    "Watch": frozenset({OPS}),
    "Retain": frozenset({RTR, OPS}),
    "Unretain": frozenset({RTR, OPS}),
}
STREAMS = ("Watch", "Mirror")
# An engine's unary housekeeping: never refused by a rate quota (a refused release or renew
# would end a lease its reader still uses).
HOUSEKEEPING_CALLS = frozenset({"Renew", "Release", "Decline", "RegisterRank"})


async def _refuse(context: grpc.aio.ServicerContext, err: BrokerError) -> None:
    await abort(context, status_of(err), err.message, err.cause, err.metadata)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticator: Authenticator, guard: TenantGuard, quotas: Quotas) -> None:
        self.authenticator = authenticator
        self.guard = guard
        self.quotas = quotas

    def session_guard(self, rec: EngineRecord, msg: pb.SessionUp) -> None:
        """The servicer's hook for each message on a Session stream (raises BrokerError)."""
        who = CURRENT.get()
        if who is not None:
            self.guard.session_message(who, msg)

    async def _admit(self, method: str, context: grpc.aio.ServicerContext) -> Identity:
        try:
            who = self.authenticator.identify(context)
        except Unidentified as err:
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, f"{method}: {err}", Cause.UNAUTHENTICATED)
            raise AssertionError("abort returned") from None
        roles = ROLES_OF_METHOD.get(method, frozenset())
        try:
            if who.role not in roles:
                allowed = ", ".join(sorted(roles)) or "nobody"
                raise PermissionDenied(
                    f"{who} may not call {method}: rule '{method} is for {allowed}' (role {who.role})",
                    Cause.ROLE_DENIED,
                    {"identity": who.uri, "method": method},
                )
            if who.role != Role.ENGINE:
                self.quotas.spend(who)
            elif method not in HOUSEKEEPING_CALLS:
                self.quotas.spend(
                    who, tenant=False
                )  # an engine's own rate; its tenant's routers never starve it
        except BrokerError as err:
            await _refuse(context, err)
        return who

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or not full.startswith(SERVICE_PREFIX):
            return handler  # health and reflection: open
        method = full[len(SERVICE_PREFIX) :]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._server_stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None and inspect.iscoroutinefunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(
                self._session(method, handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _unary(self, method: str, inner: Any) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            who = await self._admit(method, context)
            token = CURRENT.set(who)
            try:
                if isinstance(request, Message):
                    try:
                        self.guard.before(method, who, request)
                    except BrokerError as err:
                        await _refuse(context, err)
                response = await inner(request, context)
                return self.guard.response(who, response)
            finally:
                CURRENT.reset(token)

        return call

    def _server_stream(self, method: str, inner: Any) -> Callable[..., AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            who = await self._admit(method, context)
            try:
                self.quotas.open_stream(who, method)
            except BrokerError as err:
                await _refuse(context, err)
            try:
                async for item in inner(request, context):
                    out = self.guard.stream_item(who, item)
                    if out is not None:
                        yield out
            finally:
                self.quotas.close_stream(who, method)

        return stream

    def _session(self, method: str, inner: Any) -> Callable[..., Awaitable[Any]]:
        async def session(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            who = await self._admit(method, context)

            async def checked() -> AsyncIterator[Any]:
                first = True
                async for msg in request_iterator:
                    if first and isinstance(msg, pb.SessionUp) and msg.WhichOneof("msg") == "register":
                        try:
                            self.guard.admit_session(who, msg.register.engine.engine_id)
                        except BrokerError as err:
                            await _refuse(context, err)
                    first = False
                    yield msg

            CURRENT.set(who)  # this call's own context: the session's reader task copies it
            return await inner(checked(), context)

        return session
