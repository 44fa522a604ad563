"""Per-pair transfer counters count what the reader says it read, not the whole lease."""

from __future__ import annotations

from kvbroker.broker.lease_calls import read_report
from kvbroker.broker.lease_stats import LeaseStats, ReadReport
from kvbroker.broker.leases import Lease
from kvbroker.common.model import LeaseState, Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb

FP = pb.LayoutFingerprint(num_layers=2, num_kv_heads=2, head_size=16, block_size=32, dtype="float32")
BLOCK = 2 * 2 * 2 * 16 * 32 * 4


def lease(lease_id: str, blocks: int) -> Lease:
    return Lease(
        lease_id=lease_id,
        holder="P",
        reader="D",
        namespace=Namespace("layout", ""),
        tier=Tier.GPU,
        block_hashes=tuple(range(blocks)),
        block_ids=tuple(range(blocks)),
        state=LeaseState.RELEASED,
        ttl_s=1.0,
        deadline=0.0,
    )


def test_a_reader_that_reports_is_counted_at_its_word_an_older_one_at_the_lease() -> None:
    stats = LeaseStats(lambda: 0.0, lambda _layout: FP)
    stats.ended(lease("a", 40), "released", ReadReport(blocks=3, nbytes=3 * BLOCK - 7))
    stats.ended(lease("b", 40), "released", ReadReport(blocks=0, nbytes=0))  # a failed read
    totals = stats.pairs[("P", "D", Tier.GPU)]
    assert (totals.reads, totals.blocks, totals.bytes, totals.unreported) == (2, 3, 3 * BLOCK - 7, 0)
    stats.ended(lease("c", 10), "released")  # an older reader: the whole lease, marked as such
    assert (totals.reads, totals.blocks, totals.bytes, totals.unreported) == (3, 13, 13 * BLOCK - 7, 1)
    stats.ended(lease("d", 10), "released", ReadReport(blocks=99))  # never more than the lease
    assert (totals.blocks, totals.bytes) == (23, 23 * BLOCK - 7)


def test_the_release_message_carries_the_report_only_when_sent() -> None:
    assert read_report(pb.ReleaseRequest(lease_id="x")) is None
    assert read_report(pb.ReleaseRequest(lease_id="x", read_blocks=0, read_bytes=0)) == ReadReport(0, 0)
    assert read_report(pb.ReleaseRequest(lease_id="x", read_blocks=4)) == ReadReport(4, None)
