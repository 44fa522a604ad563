"""Who may act as an engine on a unary call: the engine's own session, until identities arrive.

An engine id belongs to the live session that registered it. A unary call
that acts as an engine (Hold as its holder, Acquire or Release as its reader,
Renew as a party, RegisterRank for one of its ranks, Resolve with the engine
as the asker) must show that it comes from that engine, one of two ways:

- the session id the broker gave the engine at registration, in the
  ``kvbroker-session-id`` metadata (a secret only that session has), or
- a connection from the same host as the engine's Session stream (the
  engine's worker processes register their ranks this way).

Anything else is PERMISSION_DENIED (cause not_session_owner). Naming an engine
in a field or in ``kvbroker-engine-id`` metadata proves nothing by itself.
"""

from __future__ import annotations

import grpc

from kvbroker.broker.errors import PermissionDenied, shown
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.causes import Cause

SESSION_ID_METADATA = "kvbroker-session-id"
ENGINE_ID_METADATA = "kvbroker-engine-id"


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string ("ipv4:127.0.0.1:5000" -> "ipv4:127.0.0.1")."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer  # unix sockets and the like: the whole string


def call_metadata(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode(errors="replace")
    return ""


def check_owner(rec: EngineRecord, context: grpc.aio.ServicerContext, what: str) -> None:
    """Raise PermissionDenied unless this call comes from `rec`'s session (see the module docstring)."""
    if call_metadata(context, SESSION_ID_METADATA) == rec.session_id:
        return
    host = peer_host(context.peer() or "")
    if rec.peer_host and host == rec.peer_host:
        return
    raise PermissionDenied(
        f"{what} acts as engine {shown(rec.engine_id)}, but this call does not come from its session: "
        f"send its session id in the {SESSION_ID_METADATA} metadata, call from the host of its "
        "Session stream, or use that stream",
        Cause.NOT_SESSION_OWNER,
        {"engine_id": rec.engine_id},
    )


class SessionCallers:
    """The rule above as the collaborator the servicer is given (broker/server.py passes it in)."""

    session_id_metadata = SESSION_ID_METADATA
    engine_id_metadata = ENGINE_ID_METADATA
    peer_host = staticmethod(peer_host)
    call_metadata = staticmethod(call_metadata)
    check_owner = staticmethod(check_owner)
