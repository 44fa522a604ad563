"""Retention pins are given up when vLLM needs the GPU memory (engine_adapter/retention_pressure.py):
the scheduler side over vLLM's real BlockPool and a fake link, with a waiting request (the
scheduler state vLLM shows the connector) and the pool's free blocks as the signals. The
broker's side of it: tests/broker/test_retention.py; with a real vLLM engine:
tests/e2e/test_gpu_inventory_e2e.py."""

from __future__ import annotations

from typing import Any

import pytest

from kvbroker.engine_adapter.retention_pressure import blocks_to_compute
from kvbroker.v1 import broker_pb2 as pb
from tests.engine_adapter.fakes import FakeRequest
from tests.engine_adapter.scheduler_util import BS, make
from tests.engine_adapter.test_gpu_inventory import CachingRequest

block_pool = pytest.importorskip("vllm.v1.core.block_pool")

POOL_BLOCKS = 32  # 31 usable: vLLM keeps block 0 as its null block


def _conversation(pool: Any, sched: Any, first: int, blocks: int) -> list[int]:
    """A finished request of `blocks` full blocks, cached by vLLM and announced; its wire hashes."""
    req = CachingRequest(f"conv-{first}", num_tokens=blocks * BS + 1, num_computed_tokens=blocks * BS)
    req.block_hashes = [(first + i).to_bytes(8, "big") + b"\x01" * 24 for i in range(blocks)]
    new = pool.get_new_blocks(blocks + 1)
    pool.cache_full_blocks(req, new, 0, blocks, BS, 0)
    ids = [b.block_id for b in new]
    sched.request_finished(req, ids)
    pool.free_blocks([pool.blocks[i] for i in reversed(ids)])
    return [first + i for i in range(blocks)]


def _setup(**config: Any):  # type: ignore[no-untyped-def]
    sched, link, _ = make(retain_gpu_fraction=0.75, **config)
    pool = block_pool.BlockPool(num_gpu_blocks=POOL_BLOCKS, enable_caching=True, hash_block_size=BS)
    sched.bind_block_pool(pool, wake=lambda: None)
    sched.build_connector_meta()
    return sched, link, pool


def _pin(sched: Any, link: Any, lease_id: str, hashes: list[int], reader: str = "") -> list[int]:
    lease = pb.Lease(
        lease_id=lease_id,
        tier=pb.TIER_GPU,
        namespace=pb.Namespace(layout_id=link.layout_id),
        block_hashes=hashes,
        reader_engine_id=reader,
    )
    answer = sched.pin_blocks(pb.PinCommand(lease=lease))
    sched.build_connector_meta()
    result = answer.result(0)
    assert result.ok, result.error
    return list(result.block_ids)


def _refs(pool: Any, ids: list[int]) -> list[int]:
    return [pool.blocks[i].ref_cnt for i in ids]


def test_a_waiting_request_that_needs_the_memory_takes_it_from_the_oldest_retentions_first() -> None:
    sched, link, pool = _setup(retain_gpu_low_water=0.1)  # 4 blocks of 32
    convs = [_conversation(pool, sched, first, 4) for first in (100, 200, 300)]
    pinned = [_pin(sched, link, f"R{n}", hashes) for n, hashes in enumerate(convs, 1)]
    assert pool.get_num_free_blocks() == 31 - 12
    # A request that fits beside the pins (15 blocks + the low water 4 = 19 free): nothing given up.
    sched.get_num_new_matched_tokens(FakeRequest("fits", num_tokens=15 * BS), 0)
    assert link.given_up == []
    # One that needs 17 blocks (+4): the oldest retention goes, and only it.
    sched.get_num_new_matched_tokens(FakeRequest("big", num_tokens=17 * BS), 0)
    assert [lease_id for lease_id, _ in link.given_up] == ["R1"]
    assert "waiting request big needs 21 GPU blocks" in link.given_up[0][1]
    assert _refs(pool, pinned[0]) == [0, 0, 0, 0] and _refs(pool, pinned[1]) == [1, 1, 1, 1]
    assert pool.get_num_free_blocks() == 23
    # Given back, not erased: the blocks stay cached (no removal announced) until vLLM needs them.
    assert link.removed == []
    snapshot = sched.stats_snapshot()
    assert (snapshot["gpu_retentions_given_up"], snapshot["gpu_retained_blocks_given_up"]) == (1, 4)
    # Its local prefix hit counts as computed: a request resuming R2's conversation needs less.
    assert blocks_to_compute(FakeRequest("again", num_tokens=6 * BS + 3), 4 * BS, BS) == 3


def test_free_blocks_under_the_low_water_mark_give_retentions_up_at_a_step_but_never_a_readers_pin() -> None:
    sched, link, pool = _setup(retain_gpu_low_water=0.1)
    first, second = _conversation(pool, sched, 100, 4), _conversation(pool, sched, 200, 4)
    _pin(sched, link, "R1", first)
    reader_pin = _pin(sched, link, "L1", second, reader="d")  # a reader's pin: it is reading
    running = pool.get_new_blocks(pool.get_num_free_blocks() - 2)  # running requests take the rest
    sched.build_connector_meta()
    assert [lease_id for lease_id, _ in link.given_up] == ["R1"]
    assert "low-water mark 0.1" in link.given_up[0][1]
    pool.get_new_blocks(pool.get_num_free_blocks())
    sched.build_connector_meta()
    assert [lease_id for lease_id, _ in link.given_up] == ["R1"]  # nothing left to give up
    assert _refs(pool, reader_pin) == [1, 1, 1, 1]
    pool.free_blocks(running)
    # The broker's end of a lease the engine gave up already is harmless: nothing is freed twice.
    sched.unpin_blocks("R1")
    sched.build_connector_meta()
    assert _refs(pool, reader_pin) == [1, 1, 1, 1]


def test_without_a_low_water_mark_only_waiting_requests_give_retentions_up() -> None:
    sched, link, pool = _setup(retain_gpu_low_water=0.0)
    _pin(sched, link, "R1", _conversation(pool, sched, 100, 4))
    pool.get_new_blocks(pool.get_num_free_blocks())  # not a free block left
    sched.build_connector_meta()
    assert link.given_up == []
    sched.get_num_new_matched_tokens(FakeRequest("waits", num_tokens=2 * BS), 0)
    assert [lease_id for lease_id, _ in link.given_up] == ["R1"]
