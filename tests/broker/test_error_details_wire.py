"""A foreign client's view of the broker's errors: gRPC's rich error model, read with plain protobuf.

Nothing from kvbroker is imported on the client side here: the first test
builds its messages from server reflection, as a client in any language
would, and every test decodes the `grpc-status-details-bin` trailer as a
google.rpc.Status holding a google.rpc.ErrorInfo.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.rpc import error_details_pb2, status_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvbroker.broker.server import RunningServer
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from tests.broker.session_util import RawSession

DETAILS = "grpc-status-details-bin"


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The one ErrorInfo of the call's google.rpc.Status, which repeats the call's code and message."""
    (raw,) = [value for key, value in err.trailing_metadata() or () if key == DETAILS]
    status = status_pb2.Status.FromString(raw)
    assert status.code == err.code().value[0] and status.message == err.details()
    (detail,) = status.details
    assert detail.type_url == "type.googleapis.com/google.rpc.ErrorInfo"
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    assert info.domain == "kvbroker.v1"
    return info


async def test_a_client_built_from_reflection_reads_the_cause(
    broker: RunningServer, channel: grpc.aio.Channel
) -> None:
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = reflection.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvbroker.v1.KVBroker"))
    answer = await call.read()
    await call.done_writing()
    pool = descriptor_pool.DescriptorPool()
    for raw in answer.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
    renew_request = message_factory.GetMessageClass(pool.FindMessageTypeByName("kvbroker.v1.RenewRequest"))
    lease_response = message_factory.GetMessageClass(pool.FindMessageTypeByName("kvbroker.v1.LeaseResponse"))
    renew = channel.unary_unary(
        "/kvbroker.v1.KVBroker/Renew",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=lease_response.FromString,
    )
    try:
        await renew(renew_request(lease_id="no-such-lease", engine_id="E"))
        raise AssertionError("renew of an unknown lease succeeded")
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND and "no-such-lease" in (err.details() or "")
        info = error_info(err)
    assert info.reason == "unknown_lease" and dict(info.metadata) == {"lease_id": "no-such-lease"}


async def test_undecodable_bytes_are_a_bad_request_with_details(channel: grpc.aio.Channel) -> None:
    hold = channel.unary_unary("/kvbroker.v1.KVBroker/Hold")  # bytes in, bytes out
    try:
        await hold(b"\xff\xff\xff")
        raise AssertionError("garbage was accepted")
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(err).reason == "bad_request"


async def test_a_lease_end_cause_with_its_ids(stub: broker_pb2_grpc.KVBrokerStub) -> None:
    holder, reader = RawSession(stub), RawSession(stub)
    reg = await holder.register(engine_info("P"))
    await reader.register(engine_info("D"))
    ns = pb.Namespace(layout_id=reg.layout_id)
    held = await stub.Hold(
        pb.HoldRequest(
            holder_engine_id="P", namespace=ns, tier=pb.TIER_GPU, block_hashes=[1, 2], block_ids=[3, 4]
        )
    )
    lease_id = held.lease.lease_id
    await stub.Acquire(pb.AcquireRequest(lease_id=lease_id, reader_engine_id="D"))
    await stub.Revoke(pb.RevokeRequest(lease_id=lease_id, reason="test"))
    try:
        await stub.Release(pb.ReleaseRequest(lease_id=lease_id, reader_engine_id="D"))
        raise AssertionError("release of a revoked lease succeeded")
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        info = error_info(err)
    assert info.reason == "operator"
    assert dict(info.metadata) == {"lease_id": lease_id, "state": "revoked"}


async def test_a_stream_the_broker_ends_carries_the_cause(stub: broker_pb2_grpc.KVBrokerStub) -> None:
    old, new = RawSession(stub), RawSession(stub)
    await old.register(engine_info("E"))
    await new.register(engine_info("E"))  # the same engine id again: the old session ends
    down = await old.read_kind("error")
    assert down.seq == 0 and down.error.cause == "session_superseded"  # in band first
    assert dict(down.error.metadata) == {"engine_id": "E"}
    try:
        await old.read()
        raise AssertionError("the superseded stream went on")
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.ABORTED and err.details() == down.error.message
        info = error_info(err)
    assert info.reason == "session_superseded" and dict(info.metadata) == {"engine_id": "E"}


async def test_a_session_message_error_carries_the_cause_in_band(stub: broker_pb2_grpc.KVBrokerStub) -> None:
    session = RawSession(stub)
    await session.register(engine_info("E"))
    down = await session.resolve(pb.Namespace(layout_id="not-mine"), [1, 2])
    assert down.error.code == "FAILED_PRECONDITION" and down.error.cause == "layout_mismatch"
    down = await session.resolve(pb.Namespace(), [1, 2])
    assert down.error.code == "INVALID_ARGUMENT" and down.error.cause == "bad_request"
    seq = await session.send(pin_result=pb.PinResult(lease_id="no-such-lease", ok=True))
    down = await session.read_kind("error")
    assert down.seq == seq and down.error.cause == "unknown_lease"
    assert dict(down.error.metadata) == {"lease_id": "no-such-lease"}
    await session.close()
