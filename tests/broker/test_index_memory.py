"""--index-memory-mib on a real `kvbroker serve` process, and --index-max-entries on one whose
index lives in a real redis-server (--state): two engines announce ten times what the bound
holds; the broker forgets instead of growing (and says so in /metrics), every answer names only
an engine that announced the prefix, and a lease on forgotten blocks still reads and releases. A mirror that follows the broker over gRPC is told what was forgotten
and answers what the broker answers."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc.aio
import pytest

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import InvalidArgument
from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.common.index_budget import shard_cap
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders
from testkit.metrics import scrape
from testkit.ports import free_port
from testkit.processes import SERVE, BrokerProcess
from testkit.waiting import until

pytestmark = pytest.mark.timeout(180)

GPU = pb.TIER_GPU
CAP = shard_cap(1024 * 1024, 256) * 256  # what --index-memory-mib 1 holds: 9,728 blocks
STORE_CAP = 4096  # --index-max-entries: less store work on a loaded machine, rounds still half of it
CHAIN = 64


def _metrics(port: int) -> dict[str, float]:
    return scrape(port, "kvbroker_index_", timeout=10)


@pytest.fixture(params=["in-memory", "store"])
async def broker(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[BrokerProcess, int, int]]:
    """The broker, its metrics port and how many blocks its index keeps."""
    port = free_port()
    if request.param == "store":  # bounded in the store
        store = request.getfixturevalue("store")
        bound, cap = ["--state", store.url, "--index-max-entries", str(STORE_CAP)], STORE_CAP
    else:
        bound, cap = ["--index-memory-mib", "1"], CAP
    process = BrokerProcess(
        tmp_path, [*bound, "--metrics-port", str(port)], command=SERVE, log_level="warning"
    )
    process.start()
    try:
        yield process, port, cap
    finally:
        process.stop()


async def test_a_bounded_index_forgets_and_stays_correct(broker: tuple[BrokerProcess, int, int]) -> None:
    process, port, cap = broker
    rng = random.Random(11)
    a = EngineSession(process.address, builders.engine_info("a", ranks=1))
    b = EngineSession(process.address, builders.engine_info("b", ranks=1))
    reader = EngineSession(
        process.address, builders.engine_info("r", ranks=1)
    )  # resolve leaves out the caller
    for session in (a, b, reader):
        await session.start(wait_connected_s=20.0)
    channel = grpc.aio.insecure_channel(process.address)
    mirror = IndexMirror(a.layout_id)
    following = asyncio.create_task(follow(mirror, channel))
    try:
        ns = (a.layout_id, "")
        leased = [rng.getrandbits(64) for _ in range(8)]
        a.announce_stored(ns, GPU, leased)
        await a.applied(timeout=30.0)
        lease = await a.hold(ns, GPU, leased, list(range(8)), ttl_ms=120_000, reader_engine_id="r")
        hot = [rng.getrandbits(64) for _ in range(CHAIN)]
        a.announce_stored(ns, GPU, hot)
        chains: dict[str, list[list[int]]] = {"a": [], "b": []}
        midway = 0.0
        for round_ in range(10 * cap // (2 * 16 * CHAIN) + 1):  # ten times the bound, both engines
            for engine_id, session in (("a", a), ("b", b)):
                for _ in range(16):
                    chain = [rng.getrandbits(64) for _ in range(CHAIN)]
                    chains[engine_id].append(chain)
                    session.announce_stored(ns, GPU, chain)
                await session.applied(timeout=60.0)
            # The hot prefix, matched after every round (2,048 new blocks, a fifth or half of the bound), stays.
            answer = await reader.resolve(ns, hot, timeout=30.0)
            assert [(m.engine_id, m.matched_blocks) for m in answer.matches] == [("a", CHAIN)], round_
            if round_ == 10:  # past the cap: forgetting has begun
                midway = _metrics(port)["kvbroker_index_forgotten_total"]
                assert midway > 0
        # The mirror was told what the broker forgot: it holds what the index holds, no more.
        entries = _metrics(port)["kvbroker_index_entries"]
        await until(lambda: mirror.synced and mirror.total_blocks() == entries, timeout=60)
        assert mirror.stats.forgotten > 0
        seen = await _check_answers(reader, ns, chains, rng, mirror)
        assert seen["a"] > 0 and seen["b"] > 0  # the latest chains are still known
        assert seen["miss"] > 0  # and the oldest forgotten
        answer = await reader.resolve(ns, hot, timeout=30.0)
        assert [(m.engine_id, m.matched_blocks) for m in answer.matches] == [("a", CHAIN)]

        metrics = _metrics(port)
        assert metrics["kvbroker_index_forgotten_total"] >= max(10 * cap * 0.8, midway + 4 * cap)
        assert 0 < metrics["kvbroker_index_entries"] <= cap == metrics["kvbroker_index_entry_cap"]
        if "kvbroker_index_memory_estimated_bytes" in metrics:  # the in-memory index measures its bytes
            assert metrics["kvbroker_index_memory_budget_bytes"] == 1024 * 1024
            assert metrics["kvbroker_index_memory_estimated_bytes"] <= 1024 * 1024

        # The leased blocks are long forgotten by the index; the lease is untouched.
        assert not (await reader.resolve(ns, leased, timeout=30.0)).matches
        claimed = await reader.acquire(lease.lease_id)
        assert list(claimed.lease.block_hashes) == leased
        released = await reader.release(lease.lease_id, claimed.lease.epoch)
        assert released.state == pb.LEASE_RELEASED
    finally:
        following.cancel()
        await channel.close()
        for session in (a, b, reader):
            await session.close()


async def _check_answers(
    reader: EngineSession,
    ns: tuple[str, str],
    chains: dict[str, list[list[int]]],
    rng: random.Random,
    mirror: IndexMirror,
) -> dict[str, int]:
    """Resolve a sample of every engine's chains: only their announcer may be named, and the
    mirror names what the broker names."""
    seen = {"a": 0, "b": 0, "miss": 0}
    for owner, owned in chains.items():
        sample = owned[:20] + owned[-20:] + rng.sample(owned, 40)
        for chain in sample:
            answer = await reader.resolve(ns, chain, timeout=30.0)
            mirrored = mirror.resolve(ns[1], chain)
            assert mirrored is not None
            assert [(m.engine_id, m.matched_blocks) for m in mirrored] == [
                (m.engine_id, m.matched_blocks) for m in answer.matches
            ]
            for match in answer.matches:
                assert match.engine_id == owner, (owner, match)
                assert 0 < match.matched_blocks <= CHAIN
            seen[owner if answer.matches else "miss"] += 1
    return seen


def test_the_budget_flag_is_checked_and_reaches_the_index() -> None:
    with pytest.raises(InvalidArgument, match="index_memory_mib must be >= 0"):
        BrokerConfig(index_memory_mib=-1).validate()
    # With --state it is the store's bytes budget (broker/fleet/index_bytes.py), not with an entry bound too.
    BrokerConfig(index_memory_mib=64, state="redis://127.0.0.1:6379").validate()
    with pytest.raises(InvalidArgument, match="set one"):
        BrokerConfig(index_memory_mib=64, index_max_entries=1000, state="redis://127.0.0.1:6379").validate()
    with pytest.raises(InvalidArgument, match="index_max_entries must be >= 0"):
        BrokerConfig(index_max_entries=-1, state="redis://127.0.0.1:6379").validate()
    with pytest.raises(InvalidArgument, match="store's index only"):
        BrokerConfig(index_max_entries=1000).validate()
    memory = BrokerCore(BrokerConfig(index_memory_mib=3)).index.memory()
    assert (
        memory.budget_bytes == 3 * 1024 * 1024 and memory.entry_cap == shard_cap(3 * 1024 * 1024, 256) * 256
    )
    assert BrokerCore(BrokerConfig()).index.memory().budget_bytes == 0  # unbounded by default
