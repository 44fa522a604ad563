"""A lease's memory: hashes packed, and the per-engine cap derived from a memory budget.

bench/control_plane/lease_memory.py prints the numbers; here, the rules: a large lease costs about
12 bytes a block (Python ints cost about 84), and --lease-memory-mib sets the cap."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from kvbroker.broker.config import BrokerConfig, derived_leases_per_engine
from kvbroker.broker.errors import ResourceExhausted
from kvbroker.broker.leases import BYTES_PER_BLOCK, BYTES_PER_LEASE, InMemoryLeaseTable
from kvbroker.common.model import LeaseState, Namespace, Tier
from testkit.builders import engine_info
from tests.broker.helpers import make_core


def test_a_lease_keeps_its_hashes_packed() -> None:
    rng = random.Random(5)
    table = InMemoryLeaseTable()
    blocks, leases = 8_192, 8
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for i in range(leases):
            # As a decoded request gives them: fresh 64-bit ints (most are int objects of their own).
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            ids = [rng.randrange(1, 200_000) for _ in range(blocks)]
            table.create(
                holder="P",
                reader="D",
                namespace=Namespace("layout", "acme"),
                tier=Tier.GPU,
                block_hashes=hashes,
                block_ids=ids,
                state=LeaseState.HELD,
                ttl_s=30.0,
                deadline=30.0,
                request_id=f"r{i}",
            )
            del hashes, ids
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_block = (after - before) / (blocks * leases)
    assert per_block <= BYTES_PER_BLOCK + 1, f"{per_block:.1f} bytes a block"  # was about 84
    assert {type(lease.block_hashes).__name__ for lease in table.live()} == {"array"}


def test_the_per_engine_cap_comes_from_the_memory_budget() -> None:
    config = BrokerConfig()
    assert config.max_leases_per_engine == 0  # derived by default
    assert config.leases_per_engine == derived_leases_per_engine(256, 8_192)
    assert config.leases_per_engine * (8_192 * BYTES_PER_BLOCK + BYTES_PER_LEASE) <= 256 * 2**20
    core, _clock, _ = make_core(lease_memory_mib=1, max_lease_blocks=8_192)
    cap = 2**20 // (8_192 * BYTES_PER_BLOCK + BYTES_PER_LEASE)
    assert core.config.leases_per_engine == cap == 10
    p = core.register(engine_info("P"), 3000)
    ns = Namespace(p.layout_id, "")
    for i in range(cap):
        core.hold("P", ns, Tier.GPU, [i + 1], [i + 1])
    with pytest.raises(ResourceExhausted, match="--max-leases-per-engine"):
        core.hold("P", ns, Tier.GPU, [999], [999])
    # An explicit cap wins over the budget.
    assert BrokerConfig(lease_memory_mib=1, max_leases_per_engine=50).leases_per_engine == 50
