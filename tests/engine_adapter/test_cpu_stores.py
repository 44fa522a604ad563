"""CPU offload tier: the slot directory, and the scheduler's stores, announces and pins (fakes)."""

from __future__ import annotations

from typing import Any

from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.cpu_directory import CpuDirectory
from kvbroker.engine_adapter.metadata import AdapterMetadata, LoadSpec, ReadOutcomes, RegionSpec, StoreSpec
from kvbroker.engine_adapter.scheduler import AdapterScheduler
from kvbroker.engine_adapter.worker import AdapterWorker
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from tests.engine_adapter.fakes import FakeLink, FakeMover, FakeRequest, Status, wire

BS = 32


def key(i: int, tenant: str = "") -> tuple[str, str, int]:
    return ("layout-a", tenant, i)


# ---------------------------------------------------------------- directory


def test_directory_allocates_skips_present_and_evicts_lru() -> None:
    d = CpuDirectory(3)
    a = d.allocate([key(1), key(2)])
    assert [s for _, s in a.assigned] == [0, 1] and a.evicted == []
    assert d.mark_ready([0, 1]) == [key(1), key(2)]
    again = d.allocate([key(1), key(2), key(3)])
    assert again.skipped_present == 2 and [k for k, _ in again.assigned] == [key(3)]
    d.mark_ready([2])
    d.allocate([key(1)])  # touch 1: now 2 is the least recently used
    full = d.allocate([key(4)])
    assert full.evicted == [key(2)] and full.assigned == [(key(4), 1)]
    assert d.slot_of(key(2)) is None and d.slot_of(key(4)) == 1
    assert not d.is_ready(key(4)), "not ready (not announced, not pinnable) until its copy is done"


def test_directory_pins_block_eviction_until_unpinned() -> None:
    d = CpuDirectory(2)
    d.allocate([key(1), key(2)])
    d.mark_ready([0, 1])
    assert d.pin("lease-a", [key(1), key(2)]) == [0, 1]
    blocked = d.allocate([key(3)])
    assert blocked.assigned == [] and blocked.no_room == 1 and blocked.evicted == []
    assert d.pinned_slots() == 2
    assert d.unpin("lease-a") is True
    assert d.unpin("lease-a") is False, "a lease unpins once"
    freed = d.allocate([key(3)])
    assert freed.evicted == [key(1)] and freed.assigned == [(key(3), 0)]


def test_directory_refuses_pins_of_missing_or_unfinished_blocks_and_storing_slots_are_not_evicted() -> None:
    d = CpuDirectory(2)
    d.allocate([key(1), key(2)])
    d.mark_ready([0])
    assert d.pin("l1", [key(1), key(2)]) is None, "key 2 is still being copied"
    assert d.pin("l1", [key(1), key(9)]) is None
    assert d.pinned_slots() == 0, "a refused pin pins nothing"
    assert d.allocate([key(3)]).evicted == [key(1)], "only the ready slot may be evicted"
    assert d.allocate([key(4)]).no_room == 1, "the storing slot is never reused"
    d.discard([1])
    assert d.slot_of(key(2)) is None and d.allocate([key(4)]).assigned == [(key(4), 1)]


def test_directory_pins_nest_and_unpin_all_on_session_loss() -> None:
    d = CpuDirectory(2)
    d.allocate([key(1), key(2)])
    d.mark_ready([0, 1])
    d.pin("a", [key(1)])
    d.pin("b", [key(1), key(2)])
    d.unpin("a")
    assert d.allocate([key(3)]).no_room == 1, "slot 0 is still pinned by b"
    assert d.unpin_all() == 1
    assert d.pinned_slots() == 0 and len(d.allocate([key(3)]).evicted) == 1


def test_namespaces_are_separate_keys() -> None:
    d = CpuDirectory(2)
    a = d.allocate([key(1, "t1"), key(1, "t2")])
    assert len(a.assigned) == 2


# ---------------------------------------------------------------- scheduler


def make(slots: int = 8, **overrides: Any) -> tuple[AdapterScheduler, FakeLink]:
    config = AdapterConfig(engine_id="holder", cpu_tier_blocks=slots, **overrides)
    link = FakeLink()
    sched = AdapterScheduler(config=config, link=link, block_size=BS, clock=FakeClock())
    return sched, link


def finished(req_id: str, blocks: int, **kwargs: Any) -> FakeRequest:
    tokens = blocks * BS + 5
    return FakeRequest(req_id, num_tokens=tokens, num_computed_tokens=tokens - 1, **kwargs)


def store_done(sched: AdapterScheduler, store_id: int, failed: str = "") -> None:
    outcomes = ReadOutcomes(stores_done={store_id: 1})
    if failed:
        outcomes.stores_failed[store_id] = failed
    sched.update_connector_output(worker_meta=outcomes, finished_sending=None, finished_recving=None)


def test_off_by_default_nothing_stored_and_pins_refused() -> None:
    config = AdapterConfig(engine_id="holder")
    link = FakeLink()
    sched = AdapterScheduler(config=config, link=link, block_size=BS, clock=FakeClock())
    assert sched.request_finished(finished("a", 3), [1, 2, 3, 4]) == (False, None)
    assert sched.build_connector_meta().stores == []
    for tier in (pb.TIER_CPU, pb.TIER_GPU):  # no CPU tier, no bound block pool: nothing to pin
        lease = pb.Lease(lease_id="L", tier=tier, block_hashes=[1])
        assert link.pin_handler(pb.PinCommand(lease=lease)).ok is False


def test_finished_request_is_copied_then_announced_as_cpu_and_freed_by_the_worker() -> None:
    sched, link = make()
    delay, params = sched.request_finished(finished("a", 3), [11, 12, 13, 14])
    assert delay is True and params is None, "vLLM keeps the blocks until the copy is done"
    meta = sched.build_connector_meta()
    assert meta.stores == [StoreSpec(1, "a", (11, 12, 13), (0, 1, 2))]
    assert meta.frees == ["a"], "the worker frees it once its copy finished"
    assert link.cpu_stored == [], "not announced before the bytes are there"
    store_done(sched, 1)
    assert link.cpu_stored == [wire(0), wire(1), wire(2)]
    assert link.stored == [], "nothing announced on the GPU tier"
    # A second request with the same prefix copies only the new block.
    sched.request_finished(finished("b", 4), [21, 22, 23, 24, 25])
    assert sched.build_connector_meta().stores == [StoreSpec(2, "b", (24,), (3,))]
    assert sched.stats_snapshot()["cpu_store_skipped_present"] == 3


def test_failed_copy_is_discarded_never_announced() -> None:
    sched, link = make()
    sched.request_finished(finished("a", 2), [1, 2, 3])
    sched.build_connector_meta()
    store_done(sched, 1, failed="boom")
    assert link.cpu_stored == []
    assert sched.cpu is not None and sched.cpu.used_slots() == 0


def test_eviction_is_announced_removed_and_aborted_requests_are_not_stored() -> None:
    sched, link = make(slots=2)
    sched.request_finished(finished("a", 2), [1, 2, 3])
    sched.build_connector_meta()
    store_done(sched, 1)
    other = FakeRequest("b", num_tokens=2 * BS + 1, num_computed_tokens=2 * BS)
    other.block_hashes = [bytes([0, 0, 0, 0, 0, 0, 0, 50 + i]) + b"\x00" * 24 for i in range(2)]
    sched.request_finished(other, [4, 5, 6])
    assert link.cpu_removed == [wire(0), wire(1)]
    aborted = finished("c", 2, status=Status("FINISHED_ABORTED"))
    assert sched.request_finished(aborted, [7, 8, 9]) == (False, None)


def test_remote_decode_request_is_held_and_stored_freed_only_when_the_hold_ends() -> None:
    sched, _link = make()
    req = finished("p", 2, kv_transfer_params={"do_remote_decode": True})
    delay, params = sched.request_finished(req, [1, 2, 3])
    assert delay is True and params is not None
    meta = sched.build_connector_meta()
    assert len(meta.stores) == 1 and meta.stores[0].gpu_block_ids == (1, 2)
    assert meta.frees == [], "held: the hold's end frees it, not the copy"


def pin_command(lease_id: str, hashes: list[int], tier: int = pb.TIER_CPU) -> pb.PinCommand:
    return pb.PinCommand(
        lease=pb.Lease(
            lease_id=lease_id,
            holder_engine_id="holder",
            reader_engine_id="reader",
            namespace=pb.Namespace(layout_id="layout-a", tenant=""),
            tier=tier,  # type: ignore[arg-type]
            block_hashes=hashes,
        )
    )


def test_pins_of_cpu_blocks_are_granted_with_slot_ids_and_unpinned_on_lease_end() -> None:
    sched, link = make(slots=3)
    assert link.pin_handler is not None and link.unpin_handler is not None
    sched.request_finished(finished("a", 3), [1, 2, 3, 4])
    sched.build_connector_meta()
    assert link.pin_handler(pin_command("early", [wire(0)])).ok is False, "copy not done yet"
    store_done(sched, 1)
    result = link.pin_handler(pin_command("l1", [wire(0), wire(1)]))
    assert result.ok and list(result.block_ids) == [0, 1] and result.lease_id == "l1"
    gpu = link.pin_handler(pin_command("l2", [wire(0)], tier=pb.TIER_GPU))
    assert not gpu.ok and "GPU" in gpu.error
    missing = link.pin_handler(pin_command("l3", [wire(0), 999]))
    assert not missing.ok and "CPU tier" in missing.error
    # While pinned, a new request cannot evict the pinned slots (only slot 2 is evictable).
    other = FakeRequest("b", num_tokens=2 * BS + 1, num_computed_tokens=2 * BS)
    other.block_hashes = [bytes([0, 0, 0, 0, 0, 0, 0, 50 + i]) + b"\x00" * 24 for i in range(2)]
    sched.request_finished(other, [5, 6, 7])
    assert link.cpu_removed == [wire(2)]
    assert sched.stats_snapshot()["cpu_tier_pinned_slots"] == 2
    link.unpin_handler("l1")
    assert sched.stats_snapshot()["cpu_tier_pinned_slots"] == 0
    assert sched.stats_snapshot()["cpu_pins"] == 1


def test_a_session_registered_anew_unpins_everything() -> None:
    sched, link = make()
    sched.request_finished(finished("a", 2), [1, 2, 3])
    sched.build_connector_meta()
    store_done(sched, 1)
    assert link.pin_handler(pin_command("l1", [wire(0)])).ok
    link.connected = False
    sched.build_connector_meta()
    assert sched.stats_snapshot()["cpu_tier_pinned_slots"] == 1  # the session may resume elsewhere
    link.reconnect(resumed=False)
    sched.build_connector_meta()
    assert sched.stats_snapshot()["cpu_tier_pinned_slots"] == 0


# ---------------------------------------------------------------- worker


class FakeCpuTier:
    mem_type = "DRAM"

    def __init__(self, regions: list[Any], num_slots: int) -> None:
        self.num_slots = num_slots
        self._regions = regions
        self.stores: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.loads: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.done: list[int] = []
        self.closed = False

    def regions(self) -> list[Any]:
        return [RegionSpec(r.layer, 10_000 + r.layer * 4096, 64, 64) for r in self._regions]

    def start_store(self, kv_caches: Any, gpu_block_ids: Any, slot_ids: Any) -> int:
        self.stores.append((tuple(gpu_block_ids), tuple(slot_ids)))
        return len(self.stores) + len(self.loads)

    def start_load(self, slot_ids: Any, kv_caches: Any, gpu_block_ids: Any) -> int:
        self.loads.append((tuple(slot_ids), tuple(gpu_block_ids)))
        return len(self.stores) + len(self.loads)

    def poll(self) -> list[int]:
        done, self.done = self.done, []
        return done

    def take_failed(self) -> dict[int, str]:
        return {}

    def close(self) -> None:
        self.closed = True


def test_worker_registers_the_cpu_tier_and_frees_a_request_only_after_its_copy() -> None:
    tiers: list[FakeCpuTier] = []

    def factory(regions: list[Any], slots: int) -> FakeCpuTier:
        tiers.append(FakeCpuTier(regions, slots))
        return tiers[-1]

    movers: list[FakeMover] = []
    worker = AdapterWorker(
        engine_id="e",
        pp_rank=0,
        tp_rank=0,
        mover_factory=lambda name: movers.append(FakeMover(name)) or movers[-1],  # type: ignore[func-returns-value]
        region_factory=lambda spec: spec,
        cpu_tier_slots=16,
        cpu_tier_factory=factory,
    )
    regions = [RegionSpec(layer, 4096 * layer, 64, 64) for layer in range(2)]
    worker.register_memory(regions, 100, "DRAM", kv_caches={"fake": None})
    assert movers[0].tiers == [(pb.TIER_GPU, "DRAM", 100), (pb.TIER_CPU, "DRAM", 16)]
    assert worker.rank_info is not None
    assert [t.tier for t in worker.rank_info.tiers] == [pb.TIER_GPU, pb.TIER_CPU]
    worker.start_load_kv(AdapterMetadata(stores=[StoreSpec(7, "a", (3, 4), (0, 1))], frees=["a"]))
    assert tiers[0].stores == [((3, 4), (0, 1))]
    assert worker.get_finished({"a"}) == (None, None), "copy in flight: blocks stay allocated"
    tiers[0].done.append(1)
    assert worker.get_finished(set()) == ({"a"}, None)
    outcomes = worker.take_outcomes()
    assert outcomes is not None and outcomes.stores_done == {7: 1} and outcomes.stores_failed == {}
    worker.shutdown()
    assert tiers[0].closed


# ---------------------------------------------------------------- restoring from our own CPU tier


def stored_chain(sched: AdapterScheduler, blocks: int) -> None:
    """A finished request's `blocks` full blocks are on this engine's CPU tier (slots 0..)."""
    sched.request_finished(finished("old", blocks), list(range(1, blocks + 2)))
    sched.build_connector_meta()
    store_done(sched, 1)


def test_own_cpu_tier_restores_a_prefix_without_the_broker_or_a_lease() -> None:
    sched, link = make(slots=8)
    stored_chain(sched, 4)
    link.mirror_matches = []  # nobody else holds it
    req = FakeRequest("new", num_tokens=4 * BS + 10)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True), "decided in the first step"
    sched.update_state_after_alloc(req, [40, 41, 42, 43, 44], 4 * BS)
    assert link.named("resolve") == [] and link.named("acquire") == [], "no broker round trip, no lease"
    meta = sched.build_connector_meta()
    (load,) = meta.loads
    assert load.holder_engine_id == "holder" and load.tier == pb.TIER_CPU
    assert load.remote_block_ids == (0, 1, 2, 3) and load.local_block_ids == (40, 41, 42, 43)
    assert sched.stats_snapshot()["cpu_tier_pinned_slots"] == 4, "the slots cannot be evicted mid-copy"
    finished = sched.update_connector_output(
        worker_meta=ReadOutcomes(done={"new": 1}, bytes_read={"new": 512}),
        finished_sending=None,
        finished_recving=None,
    )
    assert finished == {"new"}, "vLLM is told in the copy's own output: no commit through the worker"
    assert sched.build_connector_meta().commits == []
    stats = sched.stats_snapshot()
    assert stats["cpu_restored_blocks"] == 4 and stats["cpu_tier_pinned_slots"] == 0
    assert stats.get("pulls", 0) == 0


def test_a_longer_remote_prefix_wins_over_our_cpu_tier() -> None:
    sched, link = make(slots=8)
    stored_chain(sched, 2)
    link.mirror_matches = [pb.HolderMatch(engine_id="other", tier=pb.TIER_GPU, matched_blocks=4)]
    req = FakeRequest("new", num_tokens=4 * BS + 10)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    sched.update_state_after_alloc(req, [40, 41, 42, 43, 44], 4 * BS)
    assert link.named("resolve")[-1].args["acquire"], "the remote holder's blocks need a lease"


def test_failed_copy_back_recomputes_and_unpins() -> None:
    sched, link = make(slots=8)
    stored_chain(sched, 3)
    link.mirror_matches = []
    req = FakeRequest("new", num_tokens=3 * BS + 10)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [40, 41, 42, 43], 3 * BS)
    sched.build_connector_meta()
    sched.update_connector_output(
        worker_meta=ReadOutcomes(done={"new": 1}, failed={"new": "copy broke"}),
        finished_sending=None,
        finished_recving=None,
    )
    meta = sched.build_connector_meta()
    assert [(c.request_id, c.ok) for c in meta.commits] == [("new", False)]
    assert sched.stats_snapshot()["cpu_tier_pinned_slots"] == 0
    # vLLM reschedules the request to recompute and asks again: no second try.
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.build_connector_meta().loads == []
    sched.request_finished(req, [40, 41, 42, 43])


def test_own_cpu_tier_serves_while_the_broker_is_away_and_keeps_its_pin_on_session_loss() -> None:
    sched, link = make(slots=8)
    stored_chain(sched, 3)
    link.connected = False
    req = FakeRequest("new", num_tokens=3 * BS + 10)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    sched.update_state_after_alloc(req, [40, 41, 42, 43], 3 * BS)
    meta = sched.build_connector_meta()  # also notices the lost session: lease pins go, ours stays
    assert len(meta.loads) == 1
    assert sched.stats_snapshot()["cpu_tier_pinned_slots"] == 3
    other = FakeRequest("other", num_tokens=3 * BS + 10)
    other.block_hashes = [bytes([0, 0, 0, 0, 0, 0, 0, 90 + i]) + b"\x00" * 24 for i in range(3)]
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False), "nothing anywhere: recompute"


def test_worker_copies_back_from_its_cpu_tier() -> None:
    tiers: list[FakeCpuTier] = []

    def factory(regions: list[Any], slots: int) -> FakeCpuTier:
        tiers.append(FakeCpuTier(regions, slots))
        return tiers[-1]

    worker = AdapterWorker(
        engine_id="e",
        pp_rank=0,
        tp_rank=0,
        mover_factory=FakeMover,
        region_factory=lambda spec: spec,
        cpu_tier_slots=16,
        cpu_tier_factory=factory,
    )
    worker.register_memory([RegionSpec(layer, 4096 * layer, 64, 64) for layer in range(2)], 100, "DRAM", {})
    spec = LoadSpec("r", "local:r", "e", pb.TIER_CPU, (5, 6), (30, 31), ())
    worker.start_load_kv(AdapterMetadata(loads=[spec]))
    assert tiers[0].loads == [((5, 6), (30, 31))]
    worker.poll()
    assert worker.take_outcomes() is None, "still copying"
    tiers[0].done.append(1)
    worker.poll()
    outcomes = worker.take_outcomes()
    assert outcomes is not None and outcomes.done == {"r": 1} and outcomes.failed == {}
    assert outcomes.bytes_read == {"r": 2 * 64 * 2}
