"""API tests against an in-process broker on port 0, using the raw generated stubs."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import RunningServer, running_broker
from testkit.builders import engine_info
from testkit.ports import free_port
from testkit.waiting import until
from tests.broker.session_util import RawSession

H = list(range(5000, 5064))
Stub = broker_pb2_grpc.KVBrokerStub


async def pair(stub: Stub, ttl_ms: int = 5000) -> tuple[RawSession, RawSession, pb.Namespace]:
    p, d = RawSession(stub), RawSession(stub)
    reg = await p.register(engine_info("P"), ttl_ms)
    await d.register(engine_info("D"), ttl_ms)
    return p, d, pb.Namespace(layout_id=reg.layout_id)


async def code_of(coro: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await coro  # type: ignore[misc]
    return exc.value.code(), exc.value.details() or ""


async def test_health_and_reflection(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvbroker.v1.KVBroker"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = refl.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    resp = await call.read()
    names = {s.name for s in resp.list_services_response.service}
    assert "kvbroker.v1.KVBroker" in names and "grpc.health.v1.Health" in names
    await call.done_writing()


async def test_registered_and_first_message_must_be_register(stub: Stub) -> None:
    s = RawSession(stub)
    reg = await s.register(engine_info("E"), 3000)
    assert reg.session_ttl_ms == 3000 and reg.heartbeat_interval_ms == 1000 and len(reg.layout_id) == 16
    bad = RawSession(stub)
    await bad.send(heartbeat=pb.Heartbeat(load=1))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await bad.read()
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "register" in (exc.value.details() or "")
    out_of_range = RawSession(stub)
    await out_of_range.send(register=pb.Register(engine=engine_info("F"), session_ttl_ms=10))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await out_of_range.read()
    assert exc.value.code() == grpc.StatusCode.OUT_OF_RANGE and "100" in (exc.value.details() or "")
    await s.close()


async def test_stream_resolve_heartbeat_and_errors_keep_the_session(stub: Stub) -> None:
    p, d, ns = await pair(stub)
    await p.announce(ns, pb.TIER_GPU, H[:40])
    await p.announce(ns, pb.TIER_CPU, H)
    await p.applied()
    down = await d.resolve(ns, H)
    got = [(m.engine_id, m.tier, m.matched_blocks) for m in down.resolve.matches]
    assert got == [("P", pb.TIER_CPU, 64), ("P", pb.TIER_GPU, 40)]
    seq = await d.send(heartbeat=pb.Heartbeat(load=3.5))
    ack = await d.read()
    assert ack.seq == seq and ack.WhichOneof("msg") == "heartbeat_ack"
    # A bad request gets a SessionError with its seq; the session goes on.
    err = await d.resolve(pb.Namespace(), H)
    assert err.error.code == "INVALID_ARGUMENT" and "layout_id" in err.error.message
    err = await d.resolve(ns, list(range(2000)))
    assert err.error.code == "INVALID_ARGUMENT" and "1024" in err.error.message
    assert (await d.resolve(ns, H[:3])).resolve.matches[0].matched_blocks == 3
    engines = await stub.ListEngines(pb.ListEnginesRequest())
    by_id = {e.engine_id: e for e in engines.engines}
    assert by_id["P"].blocks_gpu == 40 and by_id["P"].blocks_cpu == 64 and by_id["D"].load == 3.5


async def test_hold_acquire_release_and_holder_told(stub: Stub) -> None:
    p, d, ns = await pair(stub)
    await p.announce(ns, pb.TIER_GPU, H[:4])
    held = await stub.Hold(
        pb.HoldRequest(
            holder_engine_id="P",
            namespace=ns,
            tier=pb.TIER_GPU,
            block_hashes=H[:4],
            block_ids=[9, 8, 7, 6],
            reader_engine_id="D",
        )
    )
    assert held.lease.state == pb.LEASE_HELD and held.lease.ttl_ms > 0
    # Resolve names the hold; Acquire claims it with transfer details.
    down = await d.resolve(ns, H)
    assert down.resolve.matches[0].hold_lease_id == held.lease.lease_id
    assert down.resolve.matches[0].reads_in_flight == 0
    acq = await stub.Acquire(pb.AcquireRequest(lease_id=held.lease.lease_id, reader_engine_id="D"))
    assert acq.lease.state == pb.LEASE_ACTIVE and acq.holder.engine_id == "P"
    # While D reads, every Resolve naming P counts that read (a reader weighs sharing P's bandwidth).
    (reading,) = (await d.resolve(ns, H)).resolve.matches
    assert (reading.engine_id, reading.reads_in_flight) == ("P", 1)
    assert acq.holder.ranks[0].agent_name == "P-tp0"
    renewed = await stub.Renew(pb.RenewRequest(lease_id=held.lease.lease_id, engine_id="D", ttl_ms=60_000))
    rel = await stub.Release(
        pb.ReleaseRequest(lease_id=held.lease.lease_id, reader_engine_id="D", epoch=renewed.lease.epoch)
    )
    assert rel.lease.state == pb.LEASE_RELEASED
    assert [m.reads_in_flight for m in (await d.resolve(ns, H)).resolve.matches] == [0]
    ended = await p.read_kind("lease_ended")
    assert ended.lease_ended.lease.lease_id == held.lease.lease_id
    code, msg = await code_of(
        stub.Release(pb.ReleaseRequest(lease_id=held.lease.lease_id, reader_engine_id="D"))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "released" in msg


async def test_resolve_acquire_pin_flow_over_the_stream(stub: Stub) -> None:
    p, d, ns = await pair(stub)
    await p.announce(ns, pb.TIER_GPU, H[:16])
    await p.applied()
    seq = await d.send(
        resolve=pb.ResolveRequest(namespace=ns, block_hashes=H, acquire=True, request_id="req-1")
    )
    pin = await p.read_kind("pin")
    lease = pin.pin.lease
    assert (
        lease.state == pb.LEASE_PENDING
        and list(lease.block_hashes) == H[:16]
        and lease.reader_engine_id == "D"
    )
    await p.send(pin_result=pb.PinResult(lease_id=lease.lease_id, ok=True, block_ids=list(range(16))))
    down = await d.read()
    assert down.seq == seq
    assert down.resolve.lease.state == pb.LEASE_ACTIVE and list(down.resolve.lease.block_ids) == list(
        range(16)
    )
    assert down.resolve.holder.engine_id == "P"
    # A refusal answers the resolve with the reason and no lease.
    seq = await d.send(resolve=pb.ResolveRequest(namespace=ns, block_hashes=H, acquire=True))
    pin = await p.read_kind("pin")
    await p.send(pin_result=pb.PinResult(lease_id=pin.pin.lease.lease_id, ok=False, error="full"))
    down = await d.read()
    assert (
        down.seq == seq
        and not down.resolve.HasField("lease")
        and down.resolve.skipped_reason == "holder_refused"
    )


async def test_reader_death_tells_holder_and_holder_death_tells_reader(stub: Stub) -> None:
    p, d, ns = await pair(stub)
    lease = (
        await stub.Hold(
            pb.HoldRequest(
                holder_engine_id="P",
                namespace=ns,
                tier=pb.TIER_GPU,
                block_hashes=H[:2],
                block_ids=[1, 2],
                reader_engine_id="D",
            )
        )
    ).lease
    await d.close()  # stream broken
    ended = await p.read_kind("lease_ended")
    assert ended.lease_ended.lease.lease_id == lease.lease_id
    assert ended.lease_ended.lease.cause == pb.REVOKE_READER_GONE
    # Now the other way round: the holder's stream breaks while a reader holds an active lease.
    d2 = RawSession(stub)
    await d2.register(engine_info("D2"))
    lease2 = (
        await stub.Hold(
            pb.HoldRequest(
                holder_engine_id="P", namespace=ns, tier=pb.TIER_GPU, block_hashes=H[:2], block_ids=[1, 2]
            )
        )
    ).lease
    await stub.Acquire(pb.AcquireRequest(lease_id=lease2.lease_id, reader_engine_id="D2"))
    await p.close()
    revoked = await d2.read_kind("revoked")
    assert (
        revoked.revoked.cause == pb.REVOKE_HOLDER_GONE and revoked.revoked.lease.lease_id == lease2.lease_id
    )
    code, msg = await code_of(
        stub.Release(pb.ReleaseRequest(lease_id=lease2.lease_id, reader_engine_id="D2"))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "holder_gone" in msg


async def test_missed_ttl_ends_the_session(stub: Stub) -> None:
    _p, d, ns = await pair(stub, ttl_ms=5000)
    short = RawSession(stub)
    await short.register(engine_info("S"), 1000)
    lease = (
        await stub.Hold(
            pb.HoldRequest(
                holder_engine_id="S",
                namespace=ns,
                tier=pb.TIER_GPU,
                block_hashes=H[:1],
                block_ids=[1],
                reader_engine_id="D",
            )
        )
    ).lease
    await stub.Acquire(pb.AcquireRequest(lease_id=lease.lease_id, reader_engine_id="D"))
    closing = await short.read_kind("error", timeout=3)
    assert closing.error.code == "DEADLINE_EXCEEDED"
    revoked = await d.read_kind("revoked", timeout=3)
    assert revoked.revoked.cause == pb.REVOKE_HOLDER_GONE
    code, _ = await code_of(stub.Drain(pb.DrainRequest(engine_id="S")))
    assert code == grpc.StatusCode.NOT_FOUND


async def test_reregister_closes_the_old_stream(stub: Stub) -> None:
    old = RawSession(stub)
    await old.register(engine_info("E"))
    new = RawSession(stub)
    await new.register(engine_info("E"))
    err = await old.read_kind("error")
    assert err.error.code == "ABORTED"
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await old.read()
    assert exc.value.code() == grpc.StatusCode.ABORTED
    stats = await stub.Stats(pb.StatsRequest())
    assert stats.engines == 1


async def test_drain_and_operator_revoke(stub: Stub) -> None:
    p, d, ns = await pair(stub)
    await p.announce(ns, pb.TIER_GPU, H)
    hold = (
        await stub.Hold(
            pb.HoldRequest(
                holder_engine_id="P", namespace=ns, tier=pb.TIER_GPU, block_hashes=H[:1], block_ids=[1]
            )
        )
    ).lease
    drained = await stub.Drain(pb.DrainRequest(engine_id="P", reason="upgrade"))
    assert drained.leases_revoked == 1
    assert (await p.read_kind("drain")).drain.reason == "upgrade"
    assert list((await d.resolve(ns, H)).resolve.matches) == []
    code, msg = await code_of(stub.Revoke(pb.RevokeRequest(lease_id=hold.lease_id)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "drain" in msg
    listed = await stub.ListLeases(pb.ListLeasesRequest(engine_id="P", include_ended=True))
    assert [(lease.lease_id, lease.cause) for lease in listed.leases] == [(hold.lease_id, pb.REVOKE_DRAIN)]


async def test_bad_input_status_codes(stub: Stub) -> None:
    _p, _d, ns = await pair(stub)
    cases = [
        (
            stub.Acquire(pb.AcquireRequest(lease_id="nope", reader_engine_id="D")),
            grpc.StatusCode.NOT_FOUND,
            "nope",
        ),
        (stub.RegisterRank(pb.RegisterRankRequest(engine_id="ghost")), grpc.StatusCode.NOT_FOUND, "ghost"),
        (
            stub.Hold(
                pb.HoldRequest(
                    holder_engine_id="P",
                    namespace=ns,
                    tier=pb.TIER_GPU,
                    block_hashes=H[:2],
                    block_ids=[1, 2],
                    ttl_ms=1,
                )
            ),
            grpc.StatusCode.OUT_OF_RANGE,
            "[100,",
        ),
        (
            stub.Hold(
                pb.HoldRequest(
                    holder_engine_id="P",
                    namespace=pb.Namespace(),
                    tier=pb.TIER_GPU,
                    block_hashes=H[:1],
                    block_ids=[1],
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "layout_id",
        ),
        (
            stub.Hold(
                pb.HoldRequest(
                    holder_engine_id="P",
                    namespace=pb.Namespace(layout_id="zzz"),
                    tier=pb.TIER_GPU,
                    block_hashes=H[:1],
                    block_ids=[1],
                )
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "layout",
        ),
        (
            stub.Resolve(pb.ResolveRequest(namespace=ns, block_hashes=list(range(1025)))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "1024",
        ),
        (
            stub.Resolve(pb.ResolveRequest(namespace=ns, block_hashes=H, acquire=True)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "reader",
        ),
        (
            stub.Score(pb.ScoreRequest(namespace=ns, block_hashes=H, candidates=["ghost"])),
            grpc.StatusCode.NOT_FOUND,
            "ghost",
        ),
        (stub.Drain(pb.DrainRequest(engine_id="")), grpc.StatusCode.NOT_FOUND, "unknown engine"),
        # Over the message size limit: gRPC itself answers, naming both sizes.
        (
            stub.Resolve(pb.ResolveRequest(namespace=ns, request_id="x" * (2 << 20))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
    ]
    for coro, want, fragment in cases:
        code, msg = await code_of(coro)
        assert (code, fragment in msg) == (want, True), (code, msg)
    assert (await stub.Stats(pb.StatsRequest())).engines == 2  # still serving


async def test_unary_resolve_with_engine_metadata_acquires(stub: Stub) -> None:
    p, _d, ns = await pair(stub)
    await p.announce(ns, pb.TIER_GPU, H[:8])
    await p.send(heartbeat=pb.Heartbeat())
    await p.read_kind("heartbeat_ack")  # the announce has been applied
    plain = await stub.Resolve(pb.ResolveRequest(namespace=ns, block_hashes=H))
    assert plain.matches[0].matched_blocks == 8
    call = stub.Resolve(
        pb.ResolveRequest(namespace=ns, block_hashes=H, acquire=True), metadata=(("kvbroker-engine-id", "D"),)
    )
    pin = await p.read_kind("pin")
    await p.send(pin_result=pb.PinResult(lease_id=pin.pin.lease.lease_id, ok=True, block_ids=list(range(8))))
    resp = await call
    assert resp.lease.state == pb.LEASE_ACTIVE and resp.lease.reader_engine_id == "D"


async def test_watch_stream(stub: Stub, broker: RunningServer) -> None:
    watch = stub.Watch(pb.WatchRequest(engine_events=True, lease_events=True))
    for _ in range(500):  # wait until the watcher is attached
        if broker.notifier.watcher_count():
            break
        await asyncio.sleep(0.01)
    _p, _d, ns = await pair(stub)
    await stub.Hold(
        pb.HoldRequest(
            holder_engine_id="P", namespace=ns, tier=pb.TIER_GPU, block_hashes=H[:1], block_ids=[1]
        )
    )
    kinds = []
    while len(kinds) < 3:
        ev = await asyncio.wait_for(watch.read(), 5)
        kinds.append(ev.kind)
    assert kinds == ["engine_registered", "engine_registered", "lease_held"]
    watch.cancel()


async def test_graceful_stop_revokes_nothing() -> None:
    async with running_broker() as running, grpc.aio.insecure_channel(running.address) as ch:
        stub = Stub(ch)
        p, _d, ns = await pair(stub)
        lease = (
            await stub.Hold(
                pb.HoldRequest(
                    holder_engine_id="P",
                    namespace=ns,
                    tier=pb.TIER_GPU,
                    block_hashes=H[:1],
                    block_ids=[1],
                    reader_engine_id="D",
                )
            )
        ).lease
        await running.stop(1.0)
        err = await p.read_kind("error")
        assert err.error.code == "UNAVAILABLE"
        assert running.core.leases.get(lease.lease_id).state.live  # no revocation sent on shutdown
        assert running.core.stats().leases_by_state["revoked"] == 0


async def test_metrics_and_tracing() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with running_broker(
        metrics_port=free_port(), metrics_host="127.0.0.1", tracer_provider=provider, stop_grace=0.5
    ) as running:
        async with grpc.aio.insecure_channel(running.address) as ch:
            stub = Stub(ch)
            trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
            await stub.Stats(
                pb.StatsRequest(), metadata=(("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),)
            )
            await code_of(stub.Drain(pb.DrainRequest(engine_id="ghost")))
        # The server ends a call's span after the answer went out: the client may read it first.
        await until(lambda: any(s.name.endswith("/Drain") for s in exporter.get_finished_spans()))
        spans = exporter.get_finished_spans()
        stats_span = next(s for s in spans if s.name.endswith("/Stats"))
        assert f"{stats_span.context.trace_id:032x}" == trace_id
        drain_span = next(s for s in spans if s.name.endswith("/Drain"))
        assert drain_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
        assert stats_span.attributes["rpc.grpc.status_code"] == 0  # an int, on success too
        url = f"http://127.0.0.1:{running.metrics_port}/metrics"
        body = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()
        assert 'kvbroker_rpc_seconds_count{code="OK",method="Stats"} 1.0' in body
        assert 'kvbroker_rpc_seconds_count{code="NOT_FOUND",method="Drain"} 1.0' in body
        assert (
            "kvbroker_engines 0.0" in body
            and "kvbroker_own_sessions 0.0" in body
            and "kvbroker_mirrors 0.0" in body
            and 'kvbroker_revocations_total{cause="ttl_expired"} 0.0' in body
        )


async def test_score_by_token_ids_uses_vllm_hashes(stub: Stub) -> None:
    from kvbroker.common.hashing import wire_chain

    p, _d, ns = await pair(stub)
    tokens = list(range(100, 100 + 32 * 5 + 7))  # 5 full blocks and a partial one
    salted = pb.Namespace(layout_id=ns.layout_id, tenant="alice")
    await p.announce(salted, pb.TIER_GPU, wire_chain(tokens, 32, "sha256", cache_salt="alice")[:3])
    await p.send(heartbeat=pb.Heartbeat(load=1.0))
    await p.read_kind("heartbeat_ack")
    resp = await stub.Score(pb.ScoreRequest(namespace=salted, token_ids=tokens))
    assert (resp.total_blocks, resp.block_size) == (5, 32)
    assert [(s.engine_id, s.gpu_blocks) for s in resp.scores] == [("P", 3), ("D", 0)]
    # The same tokens without the salt are another namespace and another chain.
    plain = await stub.Score(pb.ScoreRequest(namespace=ns, token_ids=tokens))
    assert all(s.gpu_blocks == 0 for s in plain.scores)


async def test_undecodable_bytes_get_invalid_argument(
    channel: grpc.aio.Channel, broker: RunningServer
) -> None:
    raw_hold = channel.unary_unary("/kvbroker.v1.KVBroker/Hold")
    code, msg = await code_of(raw_hold(b"\xff\xff\xff"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid message" in msg
    raw_session = channel.stream_stream(
        "/kvbroker.v1.KVBroker/Session", response_deserializer=pb.SessionDown.FromString
    )
    call = raw_session()
    await call.write(pb.SessionUp(seq=1, register=pb.Register(engine=engine_info("E"))).SerializeToString())
    assert (await call.read()).WhichOneof("msg") == "registered"
    await call.write(b"\xff\xff\xff")
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call.read()
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for _ in range(200):  # the broken session ends like any other
        if broker.core.stats().engines == 0:
            break
        await asyncio.sleep(0.01)
    assert broker.core.stats().engines == 0
