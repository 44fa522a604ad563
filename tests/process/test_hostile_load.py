"""A hostile client against a real `kvbroker serve` process: requests that cost the broker.

Each test replays what a client did to an earlier broker to hurt everyone
else (a Mirror request that held the event loop for seconds, subscribers and
watchers that never read, leases without caps) and checks the broker now
bounds it: other engines' heartbeats stay fast, memory stays within the
configured byte limits, and listings answer in pages.
"""

from __future__ import annotations

import asyncio
import random
import resource
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from foreign_client import ForeignClient, dual_stack_broker, rss_bytes, status_of

from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from testkit.processes import LOW_SOFT_OPEN_FILES, BrokerProcess, soft_open_files, with_low_soft_limit
from tests.broker.session_util import RawSession

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

GPU = pb.TIER_GPU
MiB = 1 << 20


@pytest.fixture
async def channel_to(request: pytest.FixtureRequest) -> AsyncIterator[object]:
    channels: list[grpc.aio.Channel] = []

    def make(address: str) -> grpc.aio.Channel:
        ch = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 * MiB)])
        channels.append(ch)
        return ch

    yield make
    for ch in channels:
        await ch.close()


async def announce_many(session: RawSession, ns: pb.Namespace, blocks: int, batch: int = 16_384) -> None:
    rng = random.Random(7)
    for start in range(0, blocks, batch):
        await session.announce(ns, GPU, [rng.getrandbits(64) for _ in range(min(batch, blocks - start))])
    await session.applied()


async def test_mirror_requests_do_not_stall_other_engines(tmp_path: Path, channel_to: object) -> None:
    """With 1M blocks indexed, Mirror requests for an empty layout (and one full snapshot) run while
    another engine's heartbeats keep answering fast (an earlier broker stalled them for seconds)."""
    broker = dual_stack_broker(tmp_path)
    try:
        stub = broker_pb2_grpc.KVBrokerStub(channel_to(broker.address))  # type: ignore[operator]
        big = RawSession(stub)
        reg = await big.register(engine_info("big"), 60_000)
        ns = pb.Namespace(layout_id=reg.layout_id)
        await announce_many(big, ns, 1_000_000)
        beating = RawSession(stub)
        await beating.register(engine_info("beating"), 60_000)
        rtts: list[float] = []
        done = asyncio.Event()

        async def heartbeats() -> None:
            while not done.is_set():
                t = time.monotonic()
                await beating.send(heartbeat=pb.Heartbeat(load=1))
                await beating.read_kind("heartbeat_ack", timeout=30)
                rtts.append(time.monotonic() - t)
                await asyncio.sleep(0.02)

        async def mirror(layout_id: str) -> int:
            hashes = 0
            async for update in stub.Mirror(pb.MirrorRequest(layout_id=layout_id)):
                hashes += sum(len(b.stored) for b in update.blocks)
                if update.synced:
                    return hashes
            raise AssertionError("the mirror ended before its snapshot was complete")

        beat = asyncio.create_task(heartbeats())
        await asyncio.sleep(0.2)
        empty = [mirror("f" * 16) for _ in range(10)]
        counts = await asyncio.wait_for(asyncio.gather(mirror(reg.layout_id), *empty), 60)
        await asyncio.sleep(0.2)
        done.set()
        await beat
        assert counts == [1_000_000] + [0] * 10
        print(f"heartbeat RTT while mirroring: max {max(rtts) * 1000:.1f} ms over {len(rtts)} beats")
        assert max(rtts) < 1.0, f"a heartbeat waited {max(rtts):.2f} s"
        await big.close()
        await beating.close()
    finally:
        broker.stop()


async def test_a_mirror_that_never_reads_costs_bounded_bytes(tmp_path: Path, channel_to: object) -> None:
    """40 changes of an engine with 3 MiB of labels, to a Mirror stream nobody reads: the buffer is
    bounded in bytes (an earlier broker counted each full copy as one item and grew 120+ MiB)."""
    broker = dual_stack_broker(
        tmp_path, "--max-labels-bytes", str(4 * MiB), "--mirror-buffer-bytes", str(8 * MiB)
    )
    try:
        stub = broker_pb2_grpc.KVBrokerStub(channel_to(f"[::1]:{broker.port}"))  # type: ignore[operator]
        fat = RawSession(stub)
        reg = await fat.register(engine_info("fat", labels={"blob": "x" * (3 * MiB)}), 60_000)
        stalled = stub.Mirror(pb.MirrorRequest(layout_id=reg.layout_id))  # never read
        await asyncio.sleep(0.5)
        before = rss_bytes(broker.pid)
        rank = engine_info("fat").ranks[0]
        for _ in range(40):
            await stub.RegisterRank(pb.RegisterRankRequest(engine_id="fat", rank=rank))
        await asyncio.sleep(0.5)
        grown = rss_bytes(broker.pid) - before
        print(f"broker RSS grew {grown / MiB:.1f} MiB over 40 engine changes of 3 MiB each")
        assert grown < 48 * MiB
        # The subscriber is resynced (a fresh snapshot), not left with a hole.
        first = await asyncio.wait_for(stalled.read(), 10)
        assert first.reset
        stalled.cancel()
        await fat.close()
    finally:
        broker.stop()


async def test_leases_are_capped_and_listed_in_pages(tmp_path: Path, channel_to: object) -> None:
    """Per-lease and per-engine lease caps, a watcher cut off by bytes, a bounded ended history,
    and ListLeases in pages below the message limit (an earlier broker failed it)."""
    broker = dual_stack_broker(
        tmp_path,
        "--max-message-bytes", str(MiB),
        "--max-lease-blocks", "4096",
        "--max-leases-per-engine", "120",
        "--ended-lease-history-blocks", str(10 * 4096),
        "--watch-buffer-bytes", str(256 * 1024),
    )  # fmt: skip
    try:
        channel = channel_to(f"[::1]:{broker.port}")  # type: ignore[operator]
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        foreign = await ForeignClient(channel).load()
        holder = RawSession(stub)
        reg = await holder.register(engine_info("holder"), 60_000)
        ns = pb.Namespace(layout_id=reg.layout_id)
        watch = stub.Watch(pb.WatchRequest(lease_events=True))  # read only at the end

        def hold(n: int, start: int = 0) -> object:
            hashes = list(range(start, start + n))
            return stub.Hold(
                pb.HoldRequest(
                    holder_engine_id="holder", namespace=ns, tier=GPU, block_hashes=hashes, block_ids=hashes
                )
            )

        err = await status_of(hold(4097))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-lease-blocks" in (
            err.details() or ""
        )
        for i in range(120):
            await hold(4096, i)
        err = await status_of(hold(1))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-leases-per-engine" in (
            err.details() or ""
        )
        # 120 leases of 4096 hashes are ~4 MiB of Lease messages: more than one answer may carry.
        page = await foreign.call("ListLeases")
        assert 0 < len(page.leases) < 120 and page.next_page_token
        async with AsyncBrokerClient(f"[::1]:{broker.port}") as client:
            every = await client.list_leases()
            assert len({lease.lease_id for lease in every.leases}) == 120
            await client.drain(engine_id="holder")  # revokes the 120 unclaimed holds
            ended = await client.list_leases(include_ended=True)
            assert len(ended.leases) <= 10, "the ended history is bounded in blocks"
        # The watcher that did not read was cut off by bytes, not left to grow.
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            async for _ in watch:
                pass
        assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "bytes" in (cut.value.details() or "")
        await holder.close()
    finally:
        broker.stop()


async def test_an_engine_that_never_reads_its_session_is_ended(tmp_path: Path) -> None:
    """Lease commands whose answers are never read: the session's queue is bounded in bytes and
    the session ends with RESOURCE_EXHAUSTED (an earlier broker queued every answer)."""
    broker = dual_stack_broker(tmp_path, "--session-buffer-bytes", str(MiB))
    # A client whose transport does not read ahead much either (no BDP window growth).
    channel = grpc.aio.insecure_channel(broker.address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        greedy = RawSession(stub)
        reg = await greedy.register(engine_info("greedy"), 60_000)
        hashes = list(range(8192))
        await greedy.send(
            hold=pb.HoldRequest(
                namespace=pb.Namespace(layout_id=reg.layout_id),
                tier=GPU,
                block_hashes=hashes,
                block_ids=hashes,
            )
        )
        lease = (await greedy.read_kind("lease")).lease.lease
        for _ in range(400):  # each answer carries the 8192-block lease: ~60 KB, not read yet
            await greedy.send(renew=pb.RenewRequest(lease_id=lease.lease_id))
        answers = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while True:
                last = await greedy.read(timeout=30)
                answers += 1
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--session-buffer-bytes" in (ended.value.details() or "")
        assert last.error.cause == "limit_reached" and answers < 400
        print(f"{answers} messages came before the end")
    finally:
        await channel.close()
        broker.stop()


async def test_many_connections_do_not_lock_out_a_newcomer(tmp_path: Path) -> None:
    """600 connections, each with a call, then one more client: all answered. Started with a soft
    limit of 256 open files, an earlier broker stopped accepting at about 200 connections ("File
    descriptor limit reached" in its log) and every later client, an engine too, timed out; the
    broker now raises its soft limit to the hard one at start."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1_024:
        pytest.skip(f"this machine's hard limit of open files is {hard}")
    broker = BrokerProcess(tmp_path, command=with_low_soft_limit("kvbroker.broker")).start()
    channels = [
        grpc.aio.insecure_channel(broker.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(600)
    ]
    try:
        assert soft_open_files(broker.pid) > LOW_SOFT_OPEN_FILES

        async def stats(channel: grpc.aio.Channel) -> str:
            try:
                await broker_pb2_grpc.KVBrokerStub(channel).Stats(pb.StatsRequest(), timeout=20)
            except grpc.aio.AioRpcError as err:
                return err.code().name
            return "OK"

        outcomes = await asyncio.gather(*(stats(ch) for ch in channels))
        assert outcomes.count("OK") == len(channels), {o: outcomes.count(o) for o in set(outcomes)}
        async with grpc.aio.insecure_channel(broker.address) as newcomer:
            assert await stats(newcomer) == "OK"
    finally:
        for ch in channels:
            await ch.close()
        broker.stop()
    assert "descriptor limit" not in broker.log_tail(200)
