"""Why the broker refused or ended something: the one vocabulary its server and its clients share.

Every error the broker reports names one ``Cause``: on the wire it is the
``reason`` of a ``google.rpc.ErrorInfo`` (domain ``kvbroker.v1``) in the call's
``grpc-status-details-bin`` trailer (see ``kvbroker.common.error_details``),
or the ``cause`` field of an in-band ``SessionError``. ``ResolveResponse.skipped_reason``
uses the same words for why a resolve leased nothing.

Values are stable: clients compare them exactly, so a value is never renamed
or reused for another meaning (a new cause gets a new value). They are the
lowercase words the broker already uses elsewhere on the wire: the lease-end
causes equal ``RevokeCause`` labels, ``Lease.cause`` names and the
``revocations_by_cause`` keys of ``Stats``.

``CAUSES`` says, per cause, the gRPC status it comes with, what it means and
what a caller should do; docs/clients.md and docs/broker.md show the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Cause(StrEnum):
    # A lease ended: it is gone, and anything read under it must be discarded.
    # The revoke causes (equal to RevokeCause labels):
    TTL_EXPIRED = "ttl_expired"
    READER_GONE = "reader_gone"
    HOLDER_GONE = "holder_gone"
    OPERATOR = "operator"
    HOLDER_REFUSED = "holder_refused"
    DRAIN = "drain"
    SUPERSEDED = "superseded"
    DECLINED = "declined"
    MEMORY_PRESSURE = "memory_pressure"
    # ... and the one good ending:
    RELEASED = "released"

    # A live lease that does not allow the call.
    STALE_EPOCH = "stale_epoch"
    WRONG_LEASE_STATE = "wrong_lease_state"
    NOT_PARTY = "not_party"
    NOT_HOLDER = "not_holder"

    # Engines, layouts, names.
    UNKNOWN_ENGINE = "unknown_engine"
    UNKNOWN_LEASE = "unknown_lease"
    UNKNOWN_LAYOUT = "unknown_layout"
    LAYOUT_MISMATCH = "layout_mismatch"
    INCOMPATIBLE = "incompatible"
    DRAINING = "draining"
    NOT_CACHED = "not_cached"

    # Malformed requests (the message names the field and the limit).
    BAD_REQUEST = "bad_request"
    OUT_OF_RANGE = "out_of_range"

    # The broker ends a stream.
    SESSION_SUPERSEDED = "session_superseded"
    SESSION_EXPIRED = "session_expired"
    SHUTTING_DOWN = "shutting_down"
    STATE_UNAVAILABLE = "state_unavailable"
    TOO_MANY_WATCHERS = "too_many_watchers"
    WATCHER_BEHIND = "watcher_behind"
    TOO_MANY_MIRRORS = "too_many_mirrors"
    LIMIT_REACHED = "limit_reached"
    REGISTER_TIMEOUT = "register_timeout"
    # Retired: "not_session_owner" (0.1) and, for a lease command naming another engine on the
    # Session stream, "not_party": both are "not_yours" now, the one answer to "you are not that engine".

    # Who is calling (transport security, identities, roles, tenants, quotas).
    UNAUTHENTICATED = "unauthenticated"
    ROLE_DENIED = "role_denied"
    OTHER_TENANT = "other_tenant"
    NOT_YOURS = "not_yours"
    SESSION_OWNED = "session_owned"
    QUOTA_EXCEEDED = "quota_exceeded"

    # Resolve leased nothing (ResolveResponse.skipped_reason, not an error).
    NO_HOLDER = "no_holder"
    BELOW_MIN = "below_min"


@dataclass(frozen=True, slots=True)
class CauseInfo:
    code: str  # the gRPC status name it comes with ("" when it is no error)
    meaning: str
    action: str


_DISCARD = "discard anything read under the lease and recompute (or resolve again)"

CAUSES: dict[Cause, CauseInfo] = {
    Cause.TTL_EXPIRED: CauseInfo(
        "FAILED_PRECONDITION",
        "the lease ended: it was not renewed within its TTL",
        _DISCARD + "; renew sooner or ask for a longer TTL",
    ),
    Cause.READER_GONE: CauseInfo(
        "FAILED_PRECONDITION", "the lease ended: its reader's session ended", _DISCARD
    ),
    Cause.HOLDER_GONE: CauseInfo(
        "FAILED_PRECONDITION", "the lease ended: its holder's session ended", _DISCARD
    ),
    Cause.OPERATOR: CauseInfo("FAILED_PRECONDITION", "the lease ended: an operator revoked it", _DISCARD),
    Cause.HOLDER_REFUSED: CauseInfo(
        "FAILED_PRECONDITION",
        "the lease ended: its holder could not pin the blocks, or did not answer the pin in time",
        _DISCARD,
    ),
    Cause.DRAIN: CauseInfo(
        "FAILED_PRECONDITION", "the lease ended: its holder is draining (an unclaimed hold)", _DISCARD
    ),
    Cause.SUPERSEDED: CauseInfo(
        "FAILED_PRECONDITION", "the lease ended: its holder dropped or replaced the leased blocks", _DISCARD
    ),
    Cause.DECLINED: CauseInfo(
        "FAILED_PRECONDITION",
        "nobody will read this hold: it was declined (also refusing a hold whose request was "
        "declined before the hold arrived)",
        "a holder frees the blocks; a reader recomputes",
    ),
    Cause.MEMORY_PRESSURE: CauseInfo(
        "FAILED_PRECONDITION",
        "the retention ended: its holder (an engine without a CPU tier) gave up the GPU pin because "
        "vLLM needed the memory (free blocks below what waiting requests need, or its low-water mark)",
        "retain again after the next turn, or give the engine a CPU tier (cpu_tier_blocks) whose pin "
        "survives GPU pressure; the next turn may recompute",
    ),
    Cause.RELEASED: CauseInfo(
        "FAILED_PRECONDITION",
        "the lease ended: its reader already released it (the read was committed)",
        "nothing: it is done (a repeated release after a lost answer lands here)",
    ),
    Cause.STALE_EPOCH: CauseInfo(
        "FAILED_PRECONDITION",
        "the release named an epoch the lease has moved past",
        "treat the read as failed: discard and recompute",
    ),
    Cause.WRONG_LEASE_STATE: CauseInfo(
        "FAILED_PRECONDITION",
        "the lease is live but its state does not allow the call (acquire of a claimed lease, "
        "renew while pending a pin, release before active, decline of a claimed hold)",
        "a caller bug or a race; the message names the state",
    ),
    Cause.NOT_PARTY: CauseInfo(
        "PERMISSION_DENIED",
        "the engine is neither the lease's holder nor its reader (or not the one the call needs)",
        "act on the lease with the engine that holds or reads it",
    ),
    Cause.NOT_HOLDER: CauseInfo(
        "FAILED_PRECONDITION",
        "a pin result for a lease the engine does not hold",
        "a caller bug; the engine answers only its own pin commands",
    ),
    Cause.UNKNOWN_ENGINE: CauseInfo(
        "NOT_FOUND",
        "no engine of that id has a live session",
        "register it first; it may have gone (its session ended)",
    ),
    Cause.UNKNOWN_LEASE: CauseInfo(
        "NOT_FOUND",
        "no such lease: it never existed, or ended longer ago than the broker's history keeps",
        "treat the lease as ended: discard and recompute",
    ),
    Cause.NOT_CACHED: CauseInfo(
        "NOT_FOUND",
        "retain found no engine (or not the engine it named) holding the prompt's first block in its namespace",
        "retain after the turn finished, on the engine that ran it, in the same namespace (tenant, cache_salt)",
    ),
    Cause.UNKNOWN_LAYOUT: CauseInfo(
        "NOT_FOUND",
        "no live engine has registered this layout id (Score by token ids needs its block size)",
        "send block hashes, or wait until an engine of the layout registers",
    ),
    Cause.LAYOUT_MISMATCH: CauseInfo(
        "FAILED_PRECONDITION",
        "the namespace's layout id is not the engine's own layout",
        "use the layout_id the broker returned at the engine's registration",
    ),
    Cause.INCOMPATIBLE: CauseInfo(
        "FAILED_PRECONDITION",
        "the reader cannot read the holder's blocks (different layout or parallel topology)",
        "pair engines with equal layouts and compatible TP/PP; recompute",
    ),
    Cause.DRAINING: CauseInfo(
        "FAILED_PRECONDITION",
        "the engine is draining and takes no new holds",
        "do not hold on it; free the blocks, route elsewhere",
    ),
    Cause.BAD_REQUEST: CauseInfo(
        "INVALID_ARGUMENT",
        "a malformed request: a missing or bad field, lists not parallel, too many hashes, "
        "a stream message out of order, undecodable bytes",
        "fix the caller; the message names the field and the limit",
    ),
    Cause.OUT_OF_RANGE: CauseInfo(
        "OUT_OF_RANGE",
        "a session or lease TTL outside the broker's [min, max]",
        "ask within the limits the message states (0 = the broker's default)",
    ),
    Cause.SESSION_SUPERSEDED: CauseInfo(
        "ABORTED",
        "the engine id registered a new session; this older one ended with its leases",
        "nothing if the new session is yours; two processes must not share an engine id",
    ),
    Cause.SESSION_EXPIRED: CauseInfo(
        "DEADLINE_EXCEEDED",
        "no message within the session TTL; the session ended with its leases",
        "register again (clients do); heartbeat more often or ask for a longer TTL",
    ),
    Cause.SHUTTING_DOWN: CauseInfo(
        "UNAVAILABLE",
        "the broker is stopping; the stream ends",
        "reconnect (to it when it is back, or to another broker) and register or subscribe again",
    ),
    Cause.STATE_UNAVAILABLE: CauseInfo(
        "UNAVAILABLE",
        "the broker's shared state store (Redis/Valkey, --state) does not answer; nothing was changed",
        "retry, on this broker or another replica (clients do); engines recompute meanwhile",
    ),
    Cause.TOO_MANY_WATCHERS: CauseInfo(
        "RESOURCE_EXHAUSTED",
        "the broker has as many Watch streams as --max-watchers allows",
        "retry later, or raise the limit",
    ),
    Cause.WATCHER_BEHIND: CauseInfo(
        "RESOURCE_EXHAUSTED",
        "the Watch stream fell too far behind and was cut off (events were not skipped silently)",
        "watch again, and read faster or watch fewer categories",
    ),
    Cause.TOO_MANY_MIRRORS: CauseInfo(
        "RESOURCE_EXHAUSTED",
        "the broker has as many Mirror streams as --max-mirrors allows",
        "retry later, resolve over the session instead, or raise the limit",
    ),
    Cause.UNAUTHENTICATED: CauseInfo(
        "UNAUTHENTICATED",
        "the broker requires a credential and the call had none it accepts (no bearer token, an "
        "unknown token, or a client certificate without a kvbroker:// identity)",
        "send a token from the broker's token file, or use a client certificate with a "
        "kvbroker://TENANT/ROLE/NAME URI SAN",
    ),
    Cause.ROLE_DENIED: CauseInfo(
        "PERMISSION_DENIED",
        "the caller's role may not make this call (the message names the identity and the rule)",
        "make the call with an identity of a role that may (engine, router or operator)",
    ),
    Cause.OTHER_TENANT: CauseInfo(
        "PERMISSION_DENIED",
        "the request names a namespace, lease or engine of another tenant than the caller's",
        "name your own tenant (TENANT or TENANT/SALT); tenants never share prefixes, leases or engines",
    ),
    Cause.NOT_YOURS: CauseInfo(
        "PERMISSION_DENIED",
        "the call acts as an engine the caller is not (rank, hold, acquire, renew, release or "
        "resolve as it): with identities, not the identity that registered that engine id; "
        "without, neither its session id (kvbroker-session-id metadata) nor its session's host; "
        "on a Session stream, a lease command naming another engine than the session's",
        "act only as your own engine: over its Session stream (leave the engine id empty), or a "
        "unary call with its identity (or its session id)",
    ),
    Cause.SESSION_OWNED: CauseInfo(
        "PERMISSION_DENIED",
        "a live session of another identity (without identities: from another host) holds this engine id",
        "use a unique engine id, or wait for that session to end (stop or drain that engine); the "
        "same identity (or host) may replace its own session",
    ),
    Cause.QUOTA_EXCEEDED: CauseInfo(
        "RESOURCE_EXHAUSTED",
        "a per-tenant or per-identity quota is used up (the message names the limit)",
        "wait for the use to drop (end sessions, release leases, slow down), or raise the quota",
    ),
    Cause.LIMIT_REACHED: CauseInfo(
        "RESOURCE_EXHAUSTED",
        "a per-engine or per-request limit of the broker (live leases, blocks per lease, "
        "buffered bytes of a stream); the message names the limit and its flag",
        "end leases you no longer need, split the request, read the stream faster, or raise the limit",
    ),
    Cause.REGISTER_TIMEOUT: CauseInfo(
        "DEADLINE_EXCEEDED",
        "a Session stream sent no 'register' within --register-timeout-ms",
        "send the register message first, at once",
    ),
    Cause.NO_HOLDER: CauseInfo(
        "", "resolve found no engine holding a prefix the asker can read", "recompute"
    ),
    Cause.BELOW_MIN: CauseInfo(
        "", "the best holder's prefix is shorter than min_blocks, so nothing was leased", "recompute"
    ),
}

# The causes that say a lease ended (RevokeCause labels, then "released").
LEASE_ENDED: tuple[Cause, ...] = (
    Cause.TTL_EXPIRED,
    Cause.READER_GONE,
    Cause.HOLDER_GONE,
    Cause.OPERATOR,
    Cause.HOLDER_REFUSED,
    Cause.DRAIN,
    Cause.SUPERSEDED,
    Cause.DECLINED,
    Cause.MEMORY_PRESSURE,
    Cause.RELEASED,
)
