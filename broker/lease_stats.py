"""What ended leases tell operators: how long they lived, and what each engine pair moved.

Fed by the observed lease table (observed.py) as leases start and end; read by
the metrics collector at scrape time (metrics.py). Nothing here touches the
core's decisions.

- Hold durations: from a lease's creation (a hold, or a reader's pin) to its
  end, by outcome: ``released`` or the revoke cause (``ttl_expired``,
  ``reader_gone``, ...), as histogram buckets.
- Pairs: for every released lease (the reader committed its read), the reads,
  blocks and bytes per (holder, reader, tier), as the reader reports them on
  its release (``ReleaseRequest.read_blocks`` / ``read_bytes``): a reader reads
  the part of a hold beyond its own local hit, often much less than the lease
  covers. A reader that does not report (an older one) is counted as before:
  the whole lease, at the layout's block size in memory (K and V of every
  layer and KV head at its dtype, as the fingerprint describes it); such
  reads are counted in ``unreported`` too. Engines count their own bytes
  (``vllm:kvbroker_pulled_bytes_total``); with reporting readers the two agree.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbroker.broker.leases import Lease
from kvbroker.common.model import Tier
from kvbroker.v1 import broker_pb2 as pb

DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "float8": 1}
MAX_OPEN = 1_000_000  # start times kept; beyond it (leases that never end?) the oldest are forgotten


def block_bytes(fp: pb.LayoutFingerprint | None) -> int:
    """Bytes of one block in memory: K and V x layers x KV heads x head size x block size x dtype."""
    if fp is None:
        return 0
    dtype = DTYPE_BYTES.get(fp.dtype.lower().removeprefix("torch."), 2)
    return 2 * fp.num_layers * fp.num_kv_heads * fp.head_size * fp.block_size * dtype


@dataclass
class DurationHistogram:
    buckets: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.total += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip([*map(str, DURATION_BUCKETS), "+Inf"], self.buckets, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


@dataclass(frozen=True)
class ReadReport:
    """What a reader says it read under a lease (None: it did not say that part)."""

    blocks: int | None = None
    nbytes: int | None = None


@dataclass
class PairTotals:
    reads: int = 0
    blocks: int = 0
    bytes: int = 0
    unreported: int = 0  # reads whose reader did not report what it read (counted as the whole lease)


class LeaseStats:
    def __init__(
        self, now: Callable[[], float], fingerprint: Callable[[str], pb.LayoutFingerprint | None]
    ) -> None:
        self._now = now
        self._fingerprint = fingerprint
        self._born: dict[str, float] = {}
        self.durations: dict[str, DurationHistogram] = {}
        self.pairs: dict[tuple[str, str, Tier], PairTotals] = {}

    def started(self, lease: Lease) -> None:
        if len(self._born) >= MAX_OPEN:
            self._born.pop(next(iter(self._born)))
        self._born.setdefault(lease.lease_id, self._now())

    def ended(self, lease: Lease, outcome: str, read: ReadReport | None = None) -> None:
        born = self._born.pop(lease.lease_id, None)
        if born is not None:
            self.durations.setdefault(outcome, DurationHistogram()).observe(max(0.0, self._now() - born))
        if outcome == "released" and lease.reader:
            totals = self.pairs.setdefault((lease.holder, lease.reader, lease.tier), PairTotals())
            totals.reads += 1
            blocks = len(lease.block_hashes)
            if read is None or read.blocks is None:
                totals.unreported += read is None
            else:
                blocks = min(read.blocks, blocks)  # a reader cannot read more than the lease holds
            totals.blocks += blocks
            if read is not None and read.nbytes is not None:
                totals.bytes += read.nbytes
            else:
                totals.bytes += blocks * block_bytes(self._fingerprint(lease.namespace.layout_id))
