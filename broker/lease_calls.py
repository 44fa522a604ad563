"""The lease commands (hold, acquire, renew, release, decline): one implementation for both transports.

The unary RPCs and the Session stream call the same functions here: decode
the request, call the core, encode the answer. A domain error propagates as
``BrokerError``; the unary handler turns it into a failed call, the stream
into an in-band SessionError of the command's seq.

On the stream the session names the engine: an engine id left empty is
filled with the session's. Whether the caller is the engine it names, on the
stream and on the unary calls alike, is broker/security/engine_identity.py's
one check, made by the servicer before these run.
"""

from __future__ import annotations

from kvbroker.broker import codec
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import InvalidArgument
from kvbroker.broker.leases import Lease
from kvbroker.broker.registry import EngineRecord
from kvbroker.v1 import broker_pb2 as pb

# SessionUp's lease commands, and the request field that names the acting engine
# (None: decline names the hold's holder, usually another engine).
SESSION_COMMANDS: dict[str, str | None] = {
    "hold": "holder_engine_id",
    "acquire": "reader_engine_id",
    "renew": "engine_id",
    "release": "reader_engine_id",
    "decline": None,
}


def lease_response(core: BrokerCore, lease: Lease, holder: EngineRecord | None = None) -> pb.LeaseResponse:
    out = pb.LeaseResponse(lease=codec.lease_pb(lease, core.clock.now()))
    if holder is not None:
        out.holder.CopyFrom(holder.snapshot())
    return out


def hold(core: BrokerCore, request: pb.HoldRequest) -> pb.LeaseResponse:
    lease = core.hold(
        request.holder_engine_id,
        codec.namespace(request.namespace),
        request.tier,
        request.block_hashes,
        request.block_ids,
        request.ttl_ms,
        request.reader_engine_id,
        request.request_id,
    )
    return lease_response(core, lease)


def acquire(core: BrokerCore, request: pb.AcquireRequest) -> pb.LeaseResponse:
    lease, holder = core.acquire(request.lease_id, request.reader_engine_id, request.ttl_ms)
    return lease_response(core, lease, holder)


def renew(core: BrokerCore, request: pb.RenewRequest) -> pb.LeaseResponse:
    return lease_response(core, core.renew(request.lease_id, request.engine_id, request.ttl_ms))


def release(core: BrokerCore, request: pb.ReleaseRequest) -> pb.LeaseResponse:
    return lease_response(core, core.release(request.lease_id, request.reader_engine_id, request.epoch))


def decline(core: BrokerCore, request: pb.DeclineRequest) -> pb.DeclineResponse:
    lease = core.decline(request.holder_engine_id, request.request_id, request.reason)
    if lease is None:
        return pb.DeclineResponse()
    return pb.DeclineResponse(lease=codec.lease_pb(lease, core.clock.now()))


def acting_engine(msg: pb.SessionUp) -> str:
    """The engine id a session lease command acts as ("" for decline, which names the hold's holder)."""
    kind = msg.WhichOneof("msg")
    field = SESSION_COMMANDS.get(kind or "")
    return getattr(getattr(msg, kind), field) if kind and field else ""


def session_command(core: BrokerCore, rec: EngineRecord, msg: pb.SessionUp) -> pb.SessionDown:
    """Run the lease command of ``msg`` as the session's engine; its reply, of the same seq.

    Raises BrokerError. The caller was checked to be the engine it names (the servicer).
    """
    kind = msg.WhichOneof("msg")
    if kind not in SESSION_COMMANDS:
        raise InvalidArgument(f"{kind!r} is not a lease command")
    request = getattr(msg, kind)
    field = SESSION_COMMANDS[kind] or "holder_engine_id"
    named = getattr(request, field)
    if not named:
        setattr(request, field, rec.engine_id)
    if kind == "decline":
        return pb.SessionDown(seq=msg.seq, decline=decline(core, msg.decline))
    if kind == "hold":
        answer = hold(core, msg.hold)
    elif kind == "acquire":
        answer = acquire(core, msg.acquire)
    elif kind == "renew":
        answer = renew(core, msg.renew)
    else:
        answer = release(core, msg.release)
    return pb.SessionDown(seq=msg.seq, lease=answer)
