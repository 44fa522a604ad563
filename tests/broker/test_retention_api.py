"""Retain and Unretain over real gRPC, on every state backend (in memory, Redis, Redis Cluster:
the `broker` fixture), with an engine session that answers pins as an engine does.
The domain rules themselves: tests/broker/test_retention.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvbroker.common.error_details import error_info
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from tests.broker.session_util import RawSession

H = list(range(7000, 7012))
Stub = broker_pb2_grpc.KVBrokerStub


async def holder(stub: Stub) -> tuple[RawSession, pb.Namespace]:
    p = RawSession(stub)
    reg = await p.register(engine_info("P"), 5000)
    ns = pb.Namespace(layout_id=reg.layout_id, tenant="acme")
    await p.announce(ns, pb.TIER_GPU, H[:8])
    await p.applied()
    return p, ns


async def retained(stub: Stub, p: RawSession, request: pb.RetainRequest) -> pb.RetainResponse:
    """Retain, with P pinning what the broker asks it to."""
    call = asyncio.ensure_future(stub.Retain(request, timeout=20))
    pin = (await p.read_kind("pin", timeout=20)).pin.lease
    assert pin.reader_engine_id == "" and pin.state == pb.LEASE_PENDING
    await p.send(
        pin_result=pb.PinResult(lease_id=pin.lease_id, ok=True, block_ids=range(len(pin.block_hashes)))
    )
    return await call


async def refused(coro: object) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await coro  # type: ignore[misc]
    info = error_info(exc.value.trailing_metadata())
    return exc.value.code(), info.cause if info is not None else "", exc.value.details() or ""


async def test_retain_pins_on_the_holder_and_unretain_unpins(stub: Stub) -> None:
    p, ns = await holder(stub)
    out = await retained(stub, p, pb.RetainRequest(namespace=ns, block_hashes=H, ttl_ms=60_000, key="chat-1"))
    lease = out.lease
    assert out.requested_blocks == 12 and list(lease.block_hashes) == H[:8]
    assert (lease.state, lease.holder_engine_id, lease.reader_engine_id) == (pb.LEASE_ACTIVE, "P", "")
    assert lease.request_id == "retain:chat-1" and 50_000 < lease.ttl_ms <= 60_000
    renewed = await stub.Retain(pb.RetainRequest(lease_id=lease.lease_id, ttl_ms=120_000), timeout=20)
    assert renewed.lease.ttl_ms > 60_000
    ended = await stub.Unretain(pb.UnretainRequest(lease_id=lease.lease_id), timeout=20)
    assert ended.lease.state == pb.LEASE_RELEASED
    notice = await p.read_kind("lease_ended", timeout=20)  # the holder unpins
    assert notice.lease_ended.lease.lease_id == lease.lease_id
    await p.close()


async def test_a_dead_holder_loses_the_pin_and_a_later_retain_says_so(stub: Stub) -> None:
    p, ns = await holder(stub)
    lease = (await retained(stub, p, pb.RetainRequest(namespace=ns, block_hashes=H, ttl_ms=60_000))).lease
    await p.close()  # the holder's stream breaks: its session ends
    renew = pb.RetainRequest(lease_id=lease.lease_id, ttl_ms=60_000)
    for _ in range(400):  # the broker notices the broken stream within moments; generous on a loaded machine
        try:
            await stub.Retain(renew, timeout=20)
        except grpc.aio.AioRpcError as err:
            info = error_info(err.trailing_metadata())
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
            assert info is not None and info.cause == "holder_gone"
            assert "pin is lost" in (err.details() or "")
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the retention outlived its holder's session")


async def test_a_holder_that_cannot_pin_is_an_error_not_a_promise(stub: Stub) -> None:
    p, ns = await holder(stub)
    call = asyncio.ensure_future(
        stub.Retain(pb.RetainRequest(namespace=ns, block_hashes=H, ttl_ms=1000), timeout=20)
    )
    pin = (await p.read_kind("pin", timeout=20)).pin.lease
    await p.send(pin_result=pb.PinResult(lease_id=pin.lease_id, ok=False, error="evicted meanwhile"))
    code, cause, message = await refused(call)
    assert (code, cause) == (grpc.StatusCode.FAILED_PRECONDITION, "holder_refused")
    assert "evicted meanwhile" in message
    await p.close()


async def test_a_pin_given_up_for_memory_ends_it_on_watch_and_renewal_says_memory_pressure(
    stub: Stub,
) -> None:
    p, ns = await holder(stub)
    watch = stub.Watch(pb.WatchRequest(), timeout=30)
    lease = (
        await retained(stub, p, pb.RetainRequest(namespace=ns, block_hashes=H, ttl_ms=60_000, key="s3"))
    ).lease
    await p.send(
        pin_result=pb.PinResult(
            lease_id=lease.lease_id, ok=False, given_up=True, error="free blocks below 5%"
        )
    )
    async for event in watch:
        if event.kind == "lease_revoked" and event.lease.lease_id == lease.lease_id:
            assert event.lease.request_id == "retain:s3" and event.lease.cause == pb.REVOKE_MEMORY_PRESSURE
            break
    watch.cancel()
    code, cause, message = await refused(
        stub.Retain(pb.RetainRequest(lease_id=lease.lease_id, ttl_ms=60_000), timeout=20)
    )
    assert (code, cause) == (grpc.StatusCode.FAILED_PRECONDITION, "memory_pressure")
    assert "free blocks below 5%" in message
    await p.close()


@pytest.mark.parametrize(
    ("fields", "code", "cause"),
    [
        ({"ttl_ms": 0}, grpc.StatusCode.INVALID_ARGUMENT, "bad_request"),
        ({"ttl_ms": 10**10}, grpc.StatusCode.OUT_OF_RANGE, "out_of_range"),
        ({"engine_id": "nobody"}, grpc.StatusCode.NOT_FOUND, "unknown_engine"),
        ({"block_hashes": [1, 2]}, grpc.StatusCode.NOT_FOUND, "not_cached"),
        ({"lease_id": "no-such-lease"}, grpc.StatusCode.NOT_FOUND, "unknown_lease"),
    ],
    ids=["ttl-0", "ttl-absurd", "unknown-engine", "no-blocks", "unknown-lease"],
)
async def test_bad_input_gets_a_precise_status(
    stub: Stub, fields: dict[str, object], code: grpc.StatusCode, cause: str
) -> None:
    p, ns = await holder(stub)
    request = pb.RetainRequest(namespace=ns, block_hashes=H, ttl_ms=60_000)
    for name, value in fields.items():
        if name == "block_hashes":
            del request.block_hashes[:]
            request.block_hashes.extend(value)  # type: ignore[arg-type]
        else:
            setattr(request, name, value)
    got_code, got_cause, message = await refused(stub.Retain(request, timeout=20))
    assert (got_code, got_cause) == (code, cause), message
    assert message  # a sentence a person can act on
    code_u, cause_u, _ = await refused(
        stub.Unretain(pb.UnretainRequest(lease_id="no-such-lease"), timeout=20)
    )
    assert (code_u, cause_u) == (grpc.StatusCode.NOT_FOUND, "unknown_lease")
    await p.close()
