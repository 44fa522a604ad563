"""An engine acts only as itself: the one check, for every path that acts as an engine.

Whatever acts as an engine (opens its Session, adds a rank, holds as its
holder, acquires, renews or releases as its reader or party, resolves with
itself as the asker) goes through `EngineIdentity`, keyed by the identity
that registered the engine id (or, without identities, by the engine's live
session), never by the name alone. One refusal: PERMISSION_DENIED, cause
``not_yours``.

Who counts as the engine, by path:

- **its Session stream**: the session is the engine; a lease command naming
  another engine id is refused (leave the id empty).
- **a unary call, with identities** (mutual TLS or tokens): an engine
  identity whose name is the engine id, AND the very identity that registered
  the live session (so ``kvbroker://B/engine/X`` never acts as tenant A's
  engine ``X``, from any host).
- **a unary call, without identities**: the engine's session id in the
  ``kvbroker-session-id`` metadata, or a connection from the host of its
  Session stream (its worker processes register their ranks this way).

Engine ids do not collide across tenants: a live engine id belongs to the
identity that registered it, and another identity's registration of it is
refused (``session_owned``) until that session ends. Without identities, a
registration of a live engine id from another host is refused the same way
(the same host replaces it: a restarted engine), so nobody takes over an
engine's leases or NIXL metadata by naming it.

Engines followed by KV events (broker/indexer/kv_events.py) have no identity:
their tenant is their feed's, and nobody acts as them over gRPC.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from kvbroker.broker.errors import PermissionDenied, shown
from kvbroker.broker.registry import EngineRecord
from kvbroker.broker.security.identity import ALL_TENANTS, Identity, Role
from kvbroker.common.causes import Cause
from kvbroker.common.metadata import SESSION_ID_METADATA

# The identity of the call being served (set by broker/security/auth.py; None: no identities).
CURRENT: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("kvbroker_identity", default=None)


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


class Engines(Protocol):
    """What the check reads of the engine registry (any of its wrappers)."""

    def find(self, engine_id: str) -> EngineRecord | None: ...


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a call that acts as an engine."""

    identity: Identity | None = None
    session_id: str = ""  # the kvbroker-session-id metadata of a unary call
    host: str = ""  # the host of the call's connection
    session: EngineRecord | None = None  # the Session stream the call came on

    @classmethod
    def of_call(cls, context: grpc.aio.ServicerContext) -> Caller:
        return cls(
            CURRENT.get(), call_metadata(context, SESSION_ID_METADATA), peer_host(context.peer() or "")
        )


@dataclass(frozen=True, slots=True)
class Owner:
    """Who registered an engine id: its tenant, and its identity (None: no identities, or a KV-event feed)."""

    tenant: str
    identity: Identity | None


def _refuse(message: str, engine_id: str, caller: Caller) -> PermissionDenied:
    metadata = {"engine_id": engine_id[:128]}
    if caller.identity is not None:
        metadata["identity"] = caller.identity.uri
    return PermissionDenied(message, Cause.NOT_YOURS, metadata)


def _named_by(who: Identity, engine_id: str, what: str, caller: Caller) -> None:
    if who.role != Role.ENGINE or not engine_id or who.name != engine_id:
        raise _refuse(
            f"{who} may not act as engine {shown(engine_id)} ({what}): rule 'an engine acts only as the "
            "engine id its identity names'"
            + (f" ({who.name!r})" if who.role == Role.ENGINE else ", and only an engine identity does"),
            engine_id,
            caller,
        )


class EngineIdentity:
    """Who registered each engine id, and the one check that a caller is the engine it acts as."""

    def __init__(self, registry: Engines, feed_tenant: Callable[[str], str | None] | None = None) -> None:
        self.registry = registry
        self.feed_tenant = feed_tenant  # engine id -> its KV-event feed's tenant (None: not a feed)
        self.owners: dict[str, Owner] = {}

    # -- tenants ------------------------------------------------------------------------

    def tenant_of(self, engine_id: str) -> str | None:
        owner = self.owners.get(engine_id)
        if owner is not None:
            return owner.tenant
        return self.feed_tenant(engine_id) if self.feed_tenant is not None else None

    def sees(self, who: Identity, engine_id: str) -> bool:
        """Whether `who` may see engine `engine_id` (its own tenant's; tenant ``*`` sees all)."""
        return who.tenant == ALL_TENANTS or self.tenant_of(engine_id) == who.tenant

    def engines_of(self, tenant: str) -> list[str]:
        return [e for e, owner in self.owners.items() if owner.tenant == tenant]

    # -- the check ------------------------------------------------------------------------

    def acting_as(self, caller: Caller, engine_id: str, what: str) -> EngineRecord | None:
        """Raise PermissionDenied (not_yours) unless `caller` is engine `engine_id`; its live record, if any.

        An empty or unknown engine id passes (the core refuses it precisely:
        unknown_engine); on a Session stream an empty id is the session's.
        """
        if caller.session is not None:
            own = caller.session.engine_id
            if engine_id and engine_id != own:
                raise _refuse(
                    f"{what} names engine {shown(engine_id)}, but this session is engine {shown(own)}: "
                    "rule 'an engine acts only as itself'; leave the engine id empty",
                    engine_id,
                    caller,
                )
            return caller.session
        who = caller.identity
        if who is not None:
            _named_by(who, engine_id, what, caller)
        rec = self.registry.find(engine_id) if engine_id else None
        if rec is None:
            return None
        owner = self.owners.get(engine_id)
        if who is not None and owner is not None:
            if owner.identity != who:
                raise _refuse(
                    f"{who} may not act as engine {shown(engine_id)} ({what}): its live session was "
                    f"registered by {owner.identity or 'a KV-event feed'} (rule 'an engine is the identity "
                    "that registered it, not its name')",
                    engine_id,
                    caller,
                )
            return rec
        # No identities (or the session lives on another replica): the session's own proof.
        if caller.session_id and caller.session_id == rec.session_id:
            return rec
        if rec.peer_host and caller.host == rec.peer_host:
            return rec
        raise _refuse(
            f"{what} acts as engine {shown(engine_id)}, but this call does not come from its session: "
            f"send its session id in the {SESSION_ID_METADATA} metadata, call from the host of its "
            "Session stream, or use that stream",
            engine_id,
            caller,
        )

    # -- registration -----------------------------------------------------------------------

    def admit(self, caller: Caller, engine_id: str, resume_session_id: str = "") -> None:
        """May `caller` open a Session as `engine_id`? Raises PermissionDenied (not_yours, session_owned)."""
        who = caller.identity
        if who is not None:
            _named_by(who, engine_id, "register", caller)
        live = self.registry.find(engine_id) if engine_id else None
        if live is None:
            return
        owner = self.owners.get(engine_id)
        if who is not None:
            if owner is not None and owner.identity != who:
                raise PermissionDenied(
                    f"{who} may not take over engine {shown(engine_id)}: a live session of "
                    f"{owner.identity or 'a KV-event feed'} holds it (rule 'only the same identity replaces "
                    "a live session'); use another engine id, or wait for that session to end",
                    Cause.SESSION_OWNED,
                    {"identity": who.uri, "engine_id": engine_id},
                )
            return
        if resume_session_id and resume_session_id == live.session_id:
            return  # its own session id: the proof
        if live.peer_host and caller.host != live.peer_host:
            raise PermissionDenied(
                f"engine {shown(engine_id)} has a live session from {live.peer_host}; a registration from "
                f"{caller.host or 'another host'} does not replace it (rule 'only the engine's own host "
                "replaces a live session'). To replace the engine deliberately, stop it (its session ends "
                "with its stream, or after its session TTL if its host froze), or drain it first "
                "(kvbroker drain ENGINE_ID) and let it exit; or register under another engine id",
                Cause.SESSION_OWNED,
                {"engine_id": engine_id, "host": live.peer_host},
            )

    def registered(self, rec: EngineRecord, caller: Caller) -> None:
        """`caller` opened the session `rec`: it owns the engine id until another registration."""
        rec.peer_host = caller.host
        tenant = caller.identity.tenant if caller.identity is not None else ""
        self.owners[rec.engine_id] = Owner(tenant, caller.identity)
