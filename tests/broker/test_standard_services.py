"""The standard services beside the broker's own (grpc.health.v1, server reflection), as a foreign
client that enumerates them by reflection and sends them anything: a precise status, never UNKNOWN,
and no stream kept without bound."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvbroker.common.error_details import error_info
from testkit.broker import running_broker

pytestmark = pytest.mark.timeout(60)

GARBAGE = [b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xc3\x28"]  # bad tag, short string, bad UTF-8


async def _status(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call  # type: ignore[misc]
    return exc.value


async def test_undecodable_requests_to_every_standard_method_are_invalid_argument() -> None:
    """Health/Watch (a coroutine writing with context.write) and reflection (an async generator) were
    left to grpc, which answered bad bytes with UNKNOWN and a traceback in the log."""
    async with running_broker() as running, grpc.aio.insecure_channel(running.address) as ch:
        for data in GARBAGE:
            for method in ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/List"):
                if method.endswith("List") and data == GARBAGE[2]:
                    continue  # HealthListRequest has no field 1: unknown bytes, a valid request
                err = await _status(ch.unary_unary(method)(data, timeout=5))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, data, err)
            watch = ch.unary_stream("/grpc.health.v1.Health/Watch")(data, timeout=5)
            err = await _status(watch.read())
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (data, err)
            assert "not a valid message" in (err.details() or "")
            info = error_info(err.trailing_metadata())
            assert info is not None and info.cause == "bad_request"
            reflect = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(
                timeout=5
            )
            await reflect.write(data)
            err = await _status(reflect.read())
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (data, err)
        # A good reflection request after a bad stream still answers.
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        assert (await call.read()).list_services_response.service
        await call.done_writing()


async def test_health_list_and_check_answer() -> None:
    async with running_broker() as running, grpc.aio.insecure_channel(running.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        listed = await health.List(health_pb2.HealthListRequest())
        serving = health_pb2.HealthCheckResponse.SERVING
        assert {n: s.status for n, s in listed.statuses.items()} == {
            "": serving,
            "kvbroker.v1.KVBroker": serving,
        }
        err = await _status(health.Check(health_pb2.HealthCheckRequest(service="nope")))
        assert err.code() == grpc.StatusCode.NOT_FOUND


async def test_health_watch_streams_are_bounded() -> None:
    """200 Watch streams with 1 MB service names grew an earlier broker by 900 MB, kept as long as the
    client left them open."""
    async with (
        running_broker(max_health_watchers=3) as running,
        grpc.aio.insecure_channel(running.address, options=[("grpc.max_send_message_length", 4 << 20)]) as ch,
    ):
        health = health_pb2_grpc.HealthStub(ch)
        err = await _status(health.Watch(health_pb2.HealthCheckRequest(service="x" * (1 << 20))).read())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-id-bytes" in (err.details() or "")
        err = await _status(health.Check(health_pb2.HealthCheckRequest(service="x" * (1 << 20))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.details() or "") < 1024
        watches = [health.Watch(health_pb2.HealthCheckRequest(service=name)) for name in ("", "a", "b")]
        for w in watches:
            await w.read()
        over = health.Watch(health_pb2.HealthCheckRequest())
        err = await _status(over.read())
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-health-watchers" in (
            err.details() or ""
        )
        info = error_info(err.trailing_metadata())
        assert info is not None and info.cause == "limit_reached" and info.metadata["limit"] == "3"
        watches[0].cancel()
        for _ in range(100):  # the slot comes back once the server sees the cancel
            again = health.Watch(health_pb2.HealthCheckRequest())
            try:
                assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("a cancelled Watch kept its slot")
        again.cancel()
        for w in watches[1:]:
            w.cancel()


async def test_a_reflection_client_gone_with_answers_unsent_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Requests sent in a burst and never read, then the client leaves: each such stream logged
    grpc's ExecuteBatchError traceback (an error in the broker's log for a client's choice)."""
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvbroker.v1.KVBroker")
    async with running_broker() as running:
        with caplog.at_level(logging.ERROR):
            async with grpc.aio.insecure_channel(running.address) as ch:
                calls = []
                for _ in range(3):
                    call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo()
                    with contextlib.suppress(asyncio.TimeoutError):
                        for _ in range(20_000):  # until flow control holds the writes back
                            await asyncio.wait_for(call.write(request), 0.2)
                    calls.append(call)
                for call in calls:
                    call.cancel()
            await asyncio.sleep(0.5)
            health = health_pb2_grpc.HealthStub(ch2 := grpc.aio.insecure_channel(running.address))
            assert (
                await health.Check(health_pb2.HealthCheckRequest())
            ).status == health_pb2.HealthCheckResponse.SERVING
            await ch2.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[:2000]
