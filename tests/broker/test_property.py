"""Property test: random and malformed requests against a running in-process broker.

After every batch the broker must still serve, and what it reports must hang
together: stats agree with the lists, no live lease without a live holder
(and reader) session, and no request ever got INTERNAL or UNKNOWN.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import RunningServer, running_broker
from testkit.builders import engine_info
from tests.broker.session_util import RawSession

T = TypeVar("T")
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}
ENGINES = ["e0", "e1", "e2", "e3"]
MAX_HASHES = 256


class Harness:
    """A broker, a client channel and open sessions on one event loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sessions: dict[str, RawSession] = {}
        self.layout_id = ""
        self.lease_ids: list[str] = []
        # An index mirror that follows everything the random requests do.
        self.mirror: IndexMirror | None = None
        self.mirror_task: asyncio.Task[None] | None = None
        self.run(self._start())

    def run(self, coro: Awaitable[T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    async def _start(self) -> None:
        self._broker = running_broker(
            max_hashes=MAX_HASHES,
            max_message_bytes=64 * 1024,
            session_ttl_min_ms=100,
            lease_ttl_min_ms=50,
            pin_timeout_ms=200,
            expiry_interval_ms=10,
            stop_grace=0.2,
        )
        self.server: RunningServer = await self._broker.__aenter__()
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = broker_pb2_grpc.KVBrokerStub(self.channel)

    async def _stop(self) -> None:
        if self.mirror_task is not None:
            self.mirror_task.cancel()
            await asyncio.gather(self.mirror_task, return_exceptions=True)
        for s in self.sessions.values():
            await s.close()
        await self.channel.close()
        await self._broker.__aexit__(None, None, None)

    def close(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


hashes = st.lists(st.integers(0, 2**64 - 1), max_size=MAX_HASHES + 8) | st.lists(
    st.integers(0, 20), min_size=1, max_size=20
)
ttl = st.sampled_from([0, 1, 50, 1000, 60_000, 2**63]) | st.integers(0, 2**64 - 1)
tier = st.sampled_from([0, 1, 2, 7])
engine_id = st.sampled_from([*ENGINES, "", "ghost"]) | st.text(max_size=8)
junk_bytes = st.binary(max_size=64)


@st.composite
def namespace(draw: st.DrawFn) -> tuple[str, str]:
    kind = draw(st.sampled_from(["good", "empty", "random"]))
    tenant = draw(st.sampled_from(["", "t1"]))
    return (kind, tenant)


@st.composite
def action(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    name = draw(
        st.sampled_from(
            [
                "register",
                "bad_first",
                "close",
                "announce",
                "stream_resolve",
                "hold",
                "acquire",
                "renew",
                "release",
                "revoke",
                "resolve",
                "score",
                "drain",
                "register_rank",
                "raw_bytes",
                "huge",
                "mirror",
                "retain",
                "unretain",
            ]
        )
    )
    args = {
        "engine": draw(st.sampled_from(ENGINES)),
        "other": draw(engine_id),
        "ns": draw(namespace()),
        "tier": draw(tier),
        "hashes": draw(hashes),
        "ids": draw(st.lists(st.integers(0, 2**32 - 1), max_size=20)),
        "ttl": draw(ttl),
        "lease": draw(st.integers(0, 50)),
        "flag": draw(st.booleans()),
        "bytes": draw(junk_bytes),
        "tokens": draw(st.lists(st.integers(0, 2**32 - 1), max_size=200)),
        "text": draw(st.text(max_size=20)),
    }
    return name, args


async def apply(h: Harness, name: str, a: dict[str, Any]) -> grpc.StatusCode:
    stub = h.stub
    kind, tenant = a["ns"]
    ns = pb.Namespace(
        layout_id={"good": h.layout_id, "empty": "", "random": a["text"]}[kind],
        tenant=tenant,
    )
    lease_id = h.lease_ids[a["lease"] % len(h.lease_ids)] if h.lease_ids and a["lease"] < 45 else a["text"]
    clamp: Callable[[int], int] = lambda v: v % 2**64  # noqa: E731
    try:
        if name == "register":
            old = h.sessions.pop(a["engine"], None)
            s = RawSession(stub)
            reg = await s.register(engine_info(a["engine"], ranks=a["flag"]), 5000)
            h.layout_id = reg.layout_id
            h.sessions[a["engine"]] = s
            if old is not None:
                await old.close()
        elif name == "bad_first":
            s = RawSession(stub)
            await s.send(heartbeat=pb.Heartbeat())
            await s.read()
        elif name == "close":
            s = h.sessions.pop(a["engine"], None)
            if s is not None:
                await s.close()
        elif name in ("announce", "stream_resolve"):
            s = h.sessions.get(a["engine"])
            if s is None:
                return grpc.StatusCode.OK
            if name == "announce":
                await s.send(
                    inventory=pb.InventoryUpdate(
                        namespace=ns,
                        tier=a["tier"],
                        stored=a["hashes"] if a["lease"] % 3 else [],
                        removed=a["hashes"][:3] if a["lease"] % 3 else a["hashes"],
                        clear_all=a["flag"] and a["lease"] < 5,
                    )
                )
            else:
                seq = await s.send(
                    resolve=pb.ResolveRequest(
                        namespace=ns,
                        block_hashes=a["hashes"],
                        acquire=a["flag"],
                        lease_ttl_ms=clamp(a["ttl"]),
                    )
                )
                # A pin may be pending on another session; do not wait for it here.
                del seq
        elif name == "hold":
            resp = await stub.Hold(
                pb.HoldRequest(
                    holder_engine_id=a["engine"],
                    namespace=ns,
                    tier=a["tier"],
                    block_hashes=a["hashes"],
                    block_ids=a["ids"] if not a["flag"] else list(range(len(a["hashes"]))),
                    ttl_ms=clamp(a["ttl"]),
                    reader_engine_id=a["other"] if a["lease"] % 2 else "",
                )
            )
            h.lease_ids.append(resp.lease.lease_id)
        elif name == "acquire":
            await stub.Acquire(
                pb.AcquireRequest(lease_id=lease_id, reader_engine_id=a["other"], ttl_ms=clamp(a["ttl"]))
            )
        elif name == "renew":
            await stub.Renew(pb.RenewRequest(lease_id=lease_id, engine_id=a["other"], ttl_ms=clamp(a["ttl"])))
        elif name == "release":
            await stub.Release(
                pb.ReleaseRequest(lease_id=lease_id, reader_engine_id=a["other"], epoch=a["lease"] % 3)
            )
        elif name == "revoke":
            await stub.Revoke(pb.RevokeRequest(lease_id=lease_id, reason=a["text"]))
        elif name == "resolve":
            await stub.Resolve(pb.ResolveRequest(namespace=ns, block_hashes=a["hashes"]))
        elif name == "score":
            await stub.Score(
                pb.ScoreRequest(
                    namespace=ns,
                    token_ids=a["tokens"] if a["flag"] else [],
                    block_hashes=[] if a["flag"] else a["hashes"],
                    candidates=[a["other"]] if a["lease"] < 10 else [],
                )
            )
        elif name == "drain":
            await stub.Drain(pb.DrainRequest(engine_id=a["other"], reason=a["text"]))
        elif name == "register_rank":
            await stub.RegisterRank(
                pb.RegisterRankRequest(
                    engine_id=a["other"],
                    rank=pb.RankInfo(
                        pp_rank=a["lease"] % 3,
                        tp_rank=a["lease"] % 2,
                        start_layer=a["lease"] % 4,
                        end_layer=a["lease"] % 5,
                    ),
                )
            )
        elif name == "raw_bytes":
            # Arbitrary bytes as a request: they either parse (unknown fields are fine) or gRPC rejects them.
            method = h.channel.unary_unary("/kvbroker.v1.KVBroker/Hold")
            await method(a["bytes"])
        elif name == "mirror":
            call = stub.Mirror(pb.MirrorRequest(layout_id=ns.layout_id))
            try:
                first = await asyncio.wait_for(call.read(), 5)
                assert first.reset, first
            finally:
                call.cancel()
        elif name == "retain":
            # No session answers pins here: a new retention ends at the pin timeout (holder_refused).
            resp = await stub.Retain(
                pb.RetainRequest(
                    namespace=ns,
                    block_hashes=[] if a["flag"] else a["hashes"],
                    token_ids=a["tokens"] if a["flag"] else [],
                    ttl_ms=clamp(a["ttl"]),
                    engine_id=a["other"] if a["lease"] % 2 else "",
                    tier=a["tier"],
                    lease_id=lease_id if a["lease"] % 5 == 0 else "",
                    replaces_lease_id=lease_id if a["lease"] % 7 == 0 else "",
                ),
                timeout=20,
            )
            h.lease_ids.append(resp.lease.lease_id)
        elif name == "unretain":
            await stub.Unretain(pb.UnretainRequest(lease_id=lease_id))
        elif name == "huge":
            await stub.Resolve(pb.ResolveRequest(namespace=ns, block_hashes=list(range(20_000))))
    except grpc.aio.AioRpcError as err:
        return err.code()
    except TimeoutError:
        return grpc.StatusCode.OK  # a bad_first stream read may be slow to fail; not a broker answer
    return grpc.StatusCode.OK


async def check_consistent(h: Harness) -> None:
    health = health_pb2_grpc.HealthStub(h.channel)
    assert (
        await health.Check(health_pb2.HealthCheckRequest())
    ).status == health_pb2.HealthCheckResponse.SERVING
    # Session messages and expiries land between calls: take the lists between two
    # equal Stats answers so they describe one state.
    for _ in range(50):
        stats = await h.stub.Stats(pb.StatsRequest())
        engines = (await h.stub.ListEngines(pb.ListEnginesRequest())).engines
        leases = (await h.stub.ListLeases(pb.ListLeasesRequest())).leases
        if await h.stub.Stats(pb.StatsRequest()) == stats:
            break
        await asyncio.sleep(0.02)
    names = {e.engine_id for e in engines}
    assert stats.engines == len(engines) == stats.sessions
    assert stats.blocks_indexed == sum(e.blocks_gpu + e.blocks_cpu for e in engines)
    live = sum(stats.leases_by_state[s] for s in ("pending", "held", "active"))
    assert live == len(leases)
    for lease in leases:
        assert lease.state in (pb.LEASE_PENDING, pb.LEASE_HELD, pb.LEASE_ACTIVE)
        assert lease.holder_engine_id in names, lease
        assert not lease.reader_engine_id or lease.reader_engine_id in names, lease
        assert len(lease.block_ids) in (0, len(lease.block_hashes))
    assert stats.leases_by_state["revoked"] == sum(stats.revocations_by_cause.values())
    await check_mirror(h, stats.blocks_indexed)


async def check_mirror(h: Harness, blocks_indexed: int) -> None:
    """The mirror of the engines' layout catches up with the broker's index."""
    if h.mirror is None:
        if not h.layout_id:
            return
        h.mirror = IndexMirror(h.layout_id)
        h.mirror_task = asyncio.create_task(follow(h.mirror, h.channel, backoff_s=lambda n: 0.02))
    mirror = h.mirror
    for _ in range(200):
        if mirror.synced and mirror.total_blocks() == blocks_indexed:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(
        f"mirror holds {mirror.total_blocks()} blocks (synced={mirror.synced}), broker {blocks_indexed}"
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(actions=st.lists(action(), min_size=1, max_size=12))
def test_random_requests_keep_the_broker_serving_and_consistent(harness: Harness, actions: list) -> None:
    async def scenario() -> None:
        if not harness.sessions:
            await apply(harness, "register", {"engine": "e0", "flag": True, "ns": ("good", "")} | _defaults())
        for name, args in actions:
            code = await apply(harness, name, args)
            assert code in ALLOWED, (name, code)
        await asyncio.sleep(0.01)  # let session messages land
        await check_consistent(harness)

    harness.run(scenario())


def _defaults() -> dict[str, Any]:
    return {
        "other": "",
        "tier": 1,
        "hashes": [],
        "ids": [],
        "ttl": 0,
        "lease": 0,
        "bytes": b"",
        "tokens": [],
        "text": "",
    }
