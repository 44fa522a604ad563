"""Every block in vLLM's prefix cache is announced, evictions too, and readers pin cached
blocks that no hold covers: the scheduler side over vLLM's real BlockPool and a fake link.
(The real-engine counterpart: tests/e2e/test_gpu_inventory_e2e.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvbroker.v1 import broker_pb2 as pb
from tests.engine_adapter.fakes import FakeRequest, wire
from tests.engine_adapter.scheduler_util import BS, make

block_pool = pytest.importorskip("vllm.v1.core.block_pool")


@dataclass
class CachingRequest(FakeRequest):
    """What vLLM's BlockPool.cache_full_blocks reads of a request (with events on)."""

    all_token_ids: list[int] = field(default_factory=list)
    lora_request: Any = None
    session_id: Any = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None

    def __post_init__(self) -> None:
        # Unlike FakeRequest's, every byte differs (vLLM's events may carry the low 64 bits).
        self.block_hashes = [
            (i + 1).to_bytes(8, "big") + (i + 1).to_bytes(24, "big") for i in range(self.num_tokens // BS)
        ]
        self.all_token_ids = list(range(self.num_tokens))


def _cached_request(pool: Any, req_id: str, num_tokens: int) -> tuple[CachingRequest, list[int]]:
    """Allocate and cache a request's full blocks as vLLM's scheduler does."""
    req = CachingRequest(req_id, num_tokens=num_tokens, num_computed_tokens=num_tokens - 1)
    n = len(req.block_hashes)
    blocks = pool.get_new_blocks(n + 1)
    pool.cache_full_blocks(req, blocks, 0, n, BS, 0)
    return req, [b.block_id for b in blocks]


def _bound(num_blocks: int = 16, **config: Any):  # type: ignore[no-untyped-def]
    sched, link, _ = make(**config)
    pool = block_pool.BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BS)
    wakes: list[int] = []
    sched.bind_block_pool(pool, wake=lambda: wakes.append(1))
    sched.build_connector_meta()  # the scheduler has seen the session up
    return sched, link, pool, wakes


def _finish(sched: Any, pool: Any, req: Any, ids: list[int]) -> None:
    sched.request_finished(req, ids)
    pool.free_blocks([pool.blocks[i] for i in reversed(ids)])  # vLLM frees the request


def test_a_finished_request_without_hold_is_announced_and_its_eviction_too() -> None:
    sched, link, pool, _ = _bound(num_blocks=8)
    req, ids = _cached_request(pool, "a", 4 * BS + 5)
    _finish(sched, pool, req, ids)
    assert link.named("hold") == []  # no multi_turn, no do_remote_decode: nothing held ...
    assert link.stored == [wire(i) for i in range(4)]  # ... but vLLM caches it: announced
    # Another request needs every block: vLLM evicts the cached ones.
    pool.get_new_blocks(pool.get_num_free_blocks())
    sched.read_cache_events()  # where vLLM's scheduler is about to drain its events
    assert sorted(link.removed) == [wire(i) for i in range(4)]
    assert sched.stats_snapshot()["gpu_evicted_blocks"] == 4


def test_a_prefix_hit_is_announced_once_and_a_hold_ending_does_not_remove_cached_blocks() -> None:
    sched, link, pool, _ = _bound(multi_turn=True)
    req, ids = _cached_request(pool, "a", 4 * BS + 5)
    _finish(sched, pool, req, ids)
    again = CachingRequest("b", num_tokens=req.num_tokens, num_computed_tokens=req.num_computed_tokens)
    pool.touch([pool.blocks[i] for i in ids])
    _finish(sched, pool, again, ids)  # the same prompt again (a prefix hit): nothing new
    assert link.stored == [wire(i) for i in range(4)]
    for i, call in enumerate(link.named("hold")):
        call.future.set_result(pb.Lease(lease_id=f"h{i}"))  # type: ignore[union-attr]
        link.end_lease(f"h{i}", "REVOKE_EXPIRED")  # the holds' TTL ran out
    sched.build_connector_meta()
    assert sched.stats_snapshot()["holds_freed"] == 2
    assert link.removed == []  # still in vLLM's prefix cache: still named


def test_a_hash_that_another_block_still_caches_stays_announced() -> None:
    sched, link, pool, _ = _bound()
    req, ids = _cached_request(pool, "a", 2 * BS + 1)
    twin, twin_ids = _cached_request(pool, "b", 2 * BS + 1)  # the same hashes in other blocks
    assert set(twin_ids).isdisjoint(ids)
    _finish(sched, pool, req, ids)
    _finish(sched, pool, twin, twin_ids)
    pool._maybe_evict_cached_block(pool.blocks[ids[0]])  # vLLM evicts the first copy of block 0
    sched.read_cache_events()
    assert link.removed == []
    pool._maybe_evict_cached_block(pool.blocks[twin_ids[0]])  # ... and then the last one
    sched.read_cache_events()
    assert link.removed == [wire(0)]


def test_a_reader_pins_cached_blocks_on_the_next_step_and_the_lease_end_frees_them() -> None:
    sched, link, pool, wakes = _bound()
    req, ids = _cached_request(pool, "a", 3 * BS + 1)
    _finish(sched, pool, req, ids)
    ns = pb.Namespace(layout_id=link.layout_id, tenant="")
    lease = pb.Lease(
        lease_id="L1",
        tier=pb.TIER_GPU,
        namespace=ns,
        block_hashes=[wire(0), wire(1)],
        reader_engine_id="r",
    )
    answer = sched.pin_blocks(pb.PinCommand(lease=lease))
    assert (
        not isinstance(answer, pb.PinResult) and not answer.done()
    )  # the session thread does not touch the pool
    assert wakes and sched.has_pool_returns()  # vLLM is woken to step
    sched.build_connector_meta()
    result = answer.result(0)
    assert result.ok and list(result.block_ids) == ids[:2]
    assert [pool.blocks[i].ref_cnt for i in ids[:3]] == [1, 1, 0]
    # Pinned blocks survive vLLM needing every free block.
    pool.get_new_blocks(pool.get_num_free_blocks())
    sched.read_cache_events()
    assert wire(0) not in link.removed and wire(2) in link.removed
    sched.unpin_blocks("L1")  # the lease ended (session thread)
    assert sched.has_pool_returns()
    sched.build_connector_meta()
    assert [pool.blocks[i].ref_cnt for i in ids[:2]] == [0, 0]
    assert not sched.has_pool_returns()


def test_a_pin_of_evicted_blocks_is_refused() -> None:
    sched, link, pool, _ = _bound(num_blocks=8)
    req, ids = _cached_request(pool, "a", 2 * BS + 1)
    _finish(sched, pool, req, ids)
    pool.get_new_blocks(pool.get_num_free_blocks())
    lease = pb.Lease(
        lease_id="L2",
        tier=pb.TIER_GPU,
        namespace=pb.Namespace(layout_id=link.layout_id),
        block_hashes=[wire(0)],
    )
    answer = sched.pin_blocks(pb.PinCommand(lease=lease))
    sched.build_connector_meta()
    result = answer.result(0)  # type: ignore[union-attr]
    assert not result.ok and "no longer cached" in result.error
    assert sched.stats_snapshot()["gpu_pins_refused"] == 1


def test_a_lost_stream_refuses_waiting_pins_and_a_new_session_frees_pinned_blocks() -> None:
    sched, link, pool, _ = _bound()
    req, ids = _cached_request(pool, "a", 2 * BS + 1)
    _finish(sched, pool, req, ids)
    ns = pb.Namespace(layout_id=link.layout_id)
    first = sched.pin_blocks(
        pb.PinCommand(lease=pb.Lease(lease_id="L1", tier=pb.TIER_GPU, namespace=ns, block_hashes=[wire(0)]))
    )
    sched.build_connector_meta()
    assert first.result(0).ok  # type: ignore[union-attr]
    waiting = sched.pin_blocks(
        pb.PinCommand(lease=pb.Lease(lease_id="L2", tier=pb.TIER_GPU, namespace=ns, block_hashes=[wire(1)]))
    )
    link.connected = False
    link.listener()  # the session thread reports the stream lost
    assert not waiting.result(0).ok  # type: ignore[union-attr]
    sched.build_connector_meta()
    assert pool.blocks[ids[0]].ref_cnt == 1  # kept: the session may resume with L1
    link.reconnect(resumed=False)
    link.listener()  # registered anew: L1 ended with the old session
    assert pool.blocks[ids[0]].ref_cnt == 1  # the pool is touched on the scheduler thread only
    sched.build_connector_meta()
    assert pool.blocks[ids[0]].ref_cnt == 0


def test_retentions_pin_at_most_their_share_of_the_pool_and_give_it_back() -> None:
    sched, link, pool, _ = _bound(num_blocks=16, retain_gpu_fraction=0.25)  # 4 blocks for retentions
    req, ids = _cached_request(pool, "a", 6 * BS + 1)
    _finish(sched, pool, req, ids)
    ns = pb.Namespace(layout_id=link.layout_id)

    def pin(lease_id: str, n: int, reader: str = "") -> pb.PinResult:
        hashes = [wire(i) for i in range(n)]
        lease = pb.Lease(
            lease_id=lease_id, tier=pb.TIER_GPU, namespace=ns, block_hashes=hashes, reader_engine_id=reader
        )
        answer = sched.pin_blocks(pb.PinCommand(lease=lease))
        sched.build_connector_meta()
        return answer.result(0)  # type: ignore[union-attr]

    assert pin("R1", 3).ok  # a retention (no reader): 3 of 4
    refused = pin("R2", 2)
    assert not refused.ok and "retain_gpu_fraction 0.25 (4 blocks)" in refused.error
    assert pin("L1", 6, reader="d").ok  # a reader's pin is not a retention: not bounded by it
    sched.unpin_blocks("R1")  # the retention ended: its share is free again
    sched.build_connector_meta()
    assert pin("R3", 4).ok


def test_with_verify_bytes_a_pin_of_cached_blocks_has_their_digests_stated_in_its_step() -> None:
    sched, link, pool, _ = _bound(verify_bytes=True)
    req, ids = _cached_request(pool, "a", 3 * BS + 1)
    _finish(sched, pool, req, ids)
    ns = pb.Namespace(layout_id=link.layout_id, tenant="")
    lease = pb.Lease(lease_id="L1", tier=pb.TIER_GPU, namespace=ns, block_hashes=[wire(0), wire(1)])
    answer = sched.pin_blocks(pb.PinCommand(lease=lease))
    meta = sched.build_connector_meta()
    assert not isinstance(answer, pb.PinResult) and answer.result(0).ok
    assert [(d.tier, d.block_ids, d.block_hashes) for d in meta.digests] == [
        (pb.TIER_GPU, tuple(ids[:2]), (wire(0), wire(1)))
    ]
