"""Verified bytes between two workers: real BlockMovers on the fake NIXL fabric, real KV bytes.

The holder states digests (DigestSpec), the reader reads blocks and digests and checks them;
a corrupted holder block, digests never stated, or a holder that states none fail the read,
which the scheduler then recomputes (and counts, and puts on the pull's span).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvbroker.engine_adapter.block_mover import BlockMover
from kvbroker.engine_adapter.config import AdapterConfig, AdapterConfigError
from kvbroker.engine_adapter.digests import ALGORITHM, CRC32
from kvbroker.engine_adapter.kv_regions import Region, regions_from_kv_caches
from kvbroker.engine_adapter.lease_reads import holder_ranks
from kvbroker.engine_adapter.metadata import (
    AdapterMetadata,
    DigestSpec,
    LoadSpec,
    ReadOutcomes,
    RegionSpec,
)
from kvbroker.engine_adapter.verify import VERIFY_RETRY_S, VERIFY_WAIT_S, VerifyUnsupportedError
from kvbroker.engine_adapter.worker import AdapterWorker
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from tests.engine_adapter.fake_nixl import FakeFabric
from tests.engine_adapter.fakes import FakeMover, FakeRequest, holder_info, wire
from tests.engine_adapter.kv_fixtures import LAYER_NAME, cpu_backend_kv_caches
from tests.engine_adapter.scheduler_util import make, pull_to_reading

HASHES = (0xAAAA_0001, 0xBBBB_0002, 0xCCCC_0003)
REMOTE, LOCAL = (3, 4, 9), (10, 11, 12)


def _region(spec: RegionSpec) -> Region:
    return Region(spec.layer, spec.base_addr, spec.block_stride, spec.block_bytes, spec.device_id)


@dataclass
class Pair:
    holder: AdapterWorker
    reader: AdapterWorker
    holder_kv: dict[str, torch.Tensor]
    reader_kv: dict[str, torch.Tensor]
    clock: FakeClock

    def load(self) -> LoadSpec:
        assert self.holder.rank_info is not None
        ranks, reason = holder_ranks(pb.EngineInfo(ranks=[self.holder.rank_info]), pb.TIER_GPU)
        assert reason is None
        return LoadSpec("r1", "lease-1", "h", pb.TIER_GPU, REMOTE, LOCAL, tuple(ranks), block_hashes=HASHES)

    def state(self) -> ReadOutcomes:
        """The holder states the blocks' digests (on its stater thread: wait for it)."""
        self.holder.start_load_kv(AdapterMetadata(digests=[DigestSpec(pb.TIER_GPU, REMOTE, HASHES)]))
        for _ in range(500):
            stated = self.holder.take_outcomes()
            if stated is not None:
                return stated
            time.sleep(0.01)
        raise AssertionError("the holder never stated the digests")

    def outcomes(self, polls: int = 3) -> ReadOutcomes:
        for _ in range(polls):  # a re-read of the digests is copied when started, seen next poll
            self.reader.poll()
            self.clock.advance(VERIFY_RETRY_S)
            outcomes = self.reader.take_outcomes()
            if outcomes is not None:
                return outcomes
        raise AssertionError(f"no outcome in {polls} polls")


def _worker(
    name: str,
    fabric: FakeFabric,
    clock: FakeClock,
    kv: dict[str, torch.Tensor],
    verify: bool,
    sample: float = 1.0,
) -> AdapterWorker:
    worker = AdapterWorker(
        engine_id=name,
        pp_rank=0,
        tp_rank=0,
        mover_factory=lambda agent: BlockMover(
            agent, nixl=fabric.api(), progress_interval_s=None, clock=clock
        ),
        region_factory=_region,
        clock=clock,
        verify_bytes=verify,
        verify_sample=sample,
    )
    regions, num_blocks, mem_type = regions_from_kv_caches(kv)
    worker.register_memory(regions, num_blocks, mem_type, kv)
    return worker


def _pair(holder_verifies: bool = True, sample: float = 1.0) -> Pair:
    fabric, clock = FakeFabric(), FakeClock(start=0.0)
    holder_kv, reader_kv = cpu_backend_kv_caches(seed=1), cpu_backend_kv_caches(seed=None)
    return Pair(
        _worker("h", fabric, clock, holder_kv, holder_verifies),
        _worker("d", fabric, clock, reader_kv, True, sample),
        holder_kv,
        reader_kv,
        clock,
    )


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = _pair()
    yield p
    p.reader.shutdown()
    p.holder.shutdown()


def test_the_holder_publishes_its_digest_table_with_the_tier(pair: Pair) -> None:
    assert pair.holder.rank_info is not None
    (gpu,) = pair.holder.rank_info.tiers
    assert gpu.digest_table.algorithm == ALGORITHM == "multilinear32-v1"
    assert [r.layer for r in gpu.digest_table.regions] == [0, 1, 2]
    assert all(r.block_bytes == 8 and r.block_stride == 24 for r in gpu.digest_table.regions)
    assert not gpu.digest_regions, "left empty: older readers know only CRC32 there"


def test_verified_read_reports_every_block_checked(pair: Pair) -> None:
    assert pair.state().blocks_digested == 3
    pair.reader.start_load_kv(AdapterMetadata(loads=[pair.load()]))
    outcomes = pair.outcomes()
    assert outcomes.failed == {} and outcomes.done == {"r1": 1} and outcomes.verified == {"r1": 3}
    for name in pair.holder_kv:
        assert torch.equal(pair.reader_kv[name][list(LOCAL)], pair.holder_kv[name][list(REMOTE)])


def test_holder_bytes_corrupted_after_stating_fail_the_read(pair: Pair) -> None:
    pair.state()
    pair.holder_kv[LAYER_NAME.format(1)][4].view(torch.uint8).view(-1)[7] ^= 0xFF
    pair.reader.start_load_kv(AdapterMetadata(loads=[pair.load()]))
    outcomes = pair.outcomes()
    assert outcomes.mismatched == {"r1": 1} and outcomes.verified == {}
    assert (
        "1 of 3 blocks read differ from the holder's digests (first: holder block 4, layer 1)"
        in (outcomes.failed["r1"])
    )


def test_a_sampled_pull_is_verified_and_a_wrong_block_always_fails_it() -> None:
    """verify_sample 0.34 of 3 layers: one layer per block, drawn afresh for each pull."""
    p = _pair(sample=0.34)
    try:
        assert p.reader.verifier is not None and p.reader.verifier.sample == 0.34
        p.state()
        p.reader.start_load_kv(AdapterMetadata(loads=[p.load()]))
        assert p.outcomes().verified == {"r1": 3}
        for name in p.holder_kv:  # holder block 4 now holds block 9's bytes in every layer
            p.holder_kv[name][4] = p.holder_kv[name][9]
        for _ in range(5):
            p.reader.start_load_kv(AdapterMetadata(loads=[p.load()]))
            outcomes = p.outcomes()
            assert outcomes.mismatched == {"r1": 1} and "first: holder block 4" in outcomes.failed["r1"]
    finally:
        p.reader.shutdown()
        p.holder.shutdown()


def test_a_sample_outside_0_to_1_is_refused() -> None:
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(AdapterConfigError, match=r"verify_sample must be in \(0, 1\]"):
            AdapterConfig.from_extra_config({"verify_bytes": True, "verify_sample": bad})
    assert AdapterConfig.from_extra_config({"verify_sample": 0.125}).verify_sample == 0.125


def test_digests_stated_late_are_read_again_until_they_come(pair: Pair) -> None:
    pair.reader.start_load_kv(AdapterMetadata(loads=[pair.load()]))
    pair.reader.poll()
    assert pair.reader.take_outcomes() is None, "waits for the holder's digests"
    pair.state()
    outcomes = pair.outcomes()
    assert outcomes.failed == {} and outcomes.verified == {"r1": 3}


def test_digests_never_stated_fail_the_read_at_the_deadline(pair: Pair) -> None:
    pair.reader.start_load_kv(AdapterMetadata(loads=[pair.load()]))
    pair.reader.poll()
    assert pair.reader.take_outcomes() is None
    pair.clock.advance(VERIFY_WAIT_S + 0.1)
    outcomes = pair.outcomes()
    assert "the holder stated no digests for 3 of 3 blocks" in outcomes.failed["r1"]


def test_a_holder_that_states_no_digests_is_not_read_as_verified() -> None:
    p = _pair(holder_verifies=False)
    p.reader.start_load_kv(AdapterMetadata(loads=[p.load()]))
    assert "holder rank h-pp0-tp0 states no digests" in p.outcomes().failed["r1"]


def test_a_holder_naming_another_digest_is_recomputed_never_reported_corrupt(pair: Pair) -> None:
    pair.state()
    assert pair.holder.rank_info is not None
    pair.holder.rank_info.tiers[0].digest_table.algorithm = "xxh3-64"
    pair.reader.start_load_kv(AdapterMetadata(loads=[pair.load()]))
    outcomes = pair.outcomes()
    assert (
        "holder rank h-pp0-tp0 states xxh3-64 digests, which this rank cannot compute"
        in (outcomes.failed["r1"])
    )
    assert outcomes.mismatched == {} and outcomes.verified == {}


def test_an_older_holder_stating_crc32_is_still_verified(pair: Pair) -> None:
    """Adapters before TierInfo.digest_table stated CRC32s in TierInfo.digest_regions."""
    pair.state()
    info = pair.holder.rank_info
    assert info is not None and pair.holder.verifier is not None
    tier = info.tiers[0]
    tier.digest_regions.extend(tier.digest_table.regions)
    tier.ClearField("digest_table")
    table = pair.holder.verifier._tables[pb.TIER_GPU]
    crcs = pair.holder.verifier._sources[pb.TIER_GPU].digests(REMOTE, [0, 1, 2], CRC32).astype(np.uint64)
    table.entries[list(REMOTE)] = (table.entries[list(REMOTE)] & np.uint64(0xFFFFFFFF)) | (
        crcs << np.uint64(32)
    )
    pair.reader.start_load_kv(AdapterMetadata(loads=[pair.load()]))
    outcomes = pair.outcomes()
    assert outcomes.failed == {} and outcomes.verified == {"r1": 3}


def test_memory_it_cannot_digest_is_refused_with_the_reason() -> None:
    worker = AdapterWorker(
        engine_id="g",
        pp_rank=0,
        tp_rank=0,
        mover_factory=FakeMover,
        region_factory=_region,
        verify_bytes=True,
    )
    with pytest.raises(VerifyUnsupportedError, match=r"VRAM through its KV tensors.*no tensors were given"):
        worker.register_memory([Region(0, 4096, 64, 64)], 4, "VRAM")


# --- scheduler side: the hashes go to the reader, a mismatch is recomputed, counted and traced


@pytest.mark.parametrize("sample", [1.0, 0.25])
def test_a_mismatch_fails_the_pull_counts_it_and_marks_its_span(sample: float) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvbroker.engine_adapter import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer(provider.get_tracer("test"))
    try:
        sched, link, _ = make(verify_bytes=True, verify_sample=sample)
        info = holder_info()
        info.ranks[0].tiers[0].digest_regions.add(layer=0, base_addr=1 << 20, block_stride=16, block_bytes=8)
        info.ranks[0].tiers[0].digest_regions.add(
            layer=1, base_addr=(1 << 20) + 8, block_stride=16, block_bytes=8
        )
        req = FakeRequest("r1", num_tokens=140)
        meta = pull_to_reading(sched, link, req, info)
        (spec,) = meta.loads
        assert spec.block_hashes == tuple(wire(i) for i in range(4)), "the lease's hashes, to check stamps"
        assert [r.layer for r in spec.holder_ranks[0].digest_regions] == [0, 1]
        assert spec.holder_ranks[0].digest_algorithm == CRC32, "the older field holds CRC32s"
        sched.update_connector_output(
            worker_meta=ReadOutcomes(
                done={"r1": 1}, failed={"r1": "verify_bytes: 1 of 4 blocks read differ"}, mismatched={"r1": 1}
            ),
            finished_sending=None,
            finished_recving=None,
        )
        commits = sched.build_connector_meta().commits
    finally:
        tracing.set_tracer(None)
    assert [(c.ok, c.local_block_ids) for c in commits] == [(False, (7, 8, 9, 10))], "recomputed"
    assert sched.stats.counters["verify_mismatches"] == 1
    assert sched.stats.counters["verify_mismatched_blocks"] == 1
    assert sched.stats.counters["pulls_failed"] == 1
    (pull,) = [s for s in exporter.get_finished_spans() if s.name == "kvbroker.pull"]
    assert pull.attributes is not None and pull.attributes["kvbroker.verify.mismatched_blocks"] == 1
    # A sampled check says so on the span: the share of each block's layers it checked.
    assert pull.attributes.get("kvbroker.verify.sample") == (None if sample == 1.0 else sample)
    assert pull.status.description is not None and "differ" in pull.status.description


def test_holds_and_pins_state_their_digests_only_when_verifying() -> None:
    sched, _, _ = make(verify_bytes=True)
    sched._ctx.state_digests(pb.TIER_GPU, [1, 2], [11, 12])
    assert sched.build_connector_meta().digests == [DigestSpec(pb.TIER_GPU, (1, 2), (11, 12))]
    assert sched.build_connector_meta().digests == [], "stated once"
    off, _, _ = make()
    off._ctx.state_digests(pb.TIER_GPU, [1, 2], [11, 12])
    assert off.build_connector_meta().digests == []


def test_a_hold_has_its_blocks_digests_stated_at_the_next_step() -> None:
    sched, _, _ = make(multi_turn=True, verify_bytes=True)
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), [1, 2, 3, 4, 5])
    # Work for a step: a woken idle engine asks this (has_pending_push_work) before it steps.
    assert sched.has_pool_returns()
    assert sched.build_connector_meta().digests == [
        DigestSpec(pb.TIER_GPU, (1, 2, 3, 4), tuple(wire(i) for i in range(4)))
    ]
    assert not sched.has_pool_returns()


def test_a_pin_of_cpu_tier_slots_has_their_digests_stated_at_the_next_step() -> None:
    sched, link, _ = make(verify_bytes=True, cpu_tier_blocks=4)
    sched.request_finished(
        FakeRequest("a", num_tokens=3 * 32 + 5, num_computed_tokens=3 * 32 + 4), [1, 2, 3, 4]
    )
    assert [s.slot_ids for s in sched.build_connector_meta().stores] == [(0, 1, 2)]
    sched.update_connector_output(
        worker_meta=ReadOutcomes(stores_done={1: 1}), finished_sending=None, finished_recving=None
    )
    ns = pb.Namespace(layout_id=link.layout_id, tenant="")
    lease = pb.Lease(lease_id="l1", tier=pb.TIER_CPU, namespace=ns, block_hashes=[wire(0), wire(1)])
    assert link.pin_handler is not None
    result = link.pin_handler(pb.PinCommand(lease=lease))
    assert isinstance(result, pb.PinResult) and result.ok
    assert sched.build_connector_meta().digests == [DigestSpec(pb.TIER_CPU, (0, 1), (wire(0), wire(1)))]


def test_a_spec_that_cannot_be_stated_is_logged_and_counts_nothing(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    pair.holder.start_load_kv(AdapterMetadata(digests=[DigestSpec(pb.TIER_CPU, (1,), (5,))]))  # no CPU tier
    assert pair.holder.verifier is not None
    pair.holder.verifier.close()  # waits for the stater thread
    assert pair.holder.take_outcomes() is None
    assert "cannot state digests: no digest table for tier 2" in caplog.text
