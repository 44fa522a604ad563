"""What the parts of the scheduler side share: configuration, broker link, clock, counters.

``AdapterScheduler`` (engine_adapter/scheduler.py) owns one ``SchedulerContext``
and hands it to each part: lookups (lookups.py), loads (loads.py), holds
(holds.py) and CPU-tier stores (cpu_stores.py). The parts never call each
other's hooks; the scheduler composes them. All of it runs under the
scheduler's lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbroker.engine_adapter.broker_link import BrokerLink
from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.cost_model import CostModel
from kvbroker.engine_adapter.cpu_directory import CpuDirectory
from kvbroker.engine_adapter.metadata import DigestSpec
from kvbroker.engine_adapter.own_load import OwnLoad
from kvbroker.engine_adapter.stats import SchedulerStats
from kvbroker.v1 import broker_pb2 as pb


@dataclass
class SchedulerContext:
    config: AdapterConfig
    link: BrokerLink | None
    block_size: int
    tp_size: int
    pp_size: int
    clock: Callable[[], float]
    stats: SchedulerStats
    # The CPU offload tier's slot directory (cpu_tier_blocks > 0), else None.
    cpu: CpuDirectory | None
    # What prefills and pulls cost here (cost_model.py): read by lookups, fed by steps and loads.
    costs: CostModel = field(default_factory=CostModel)
    # Requests the worker is to report freed in the next step: ended delay_free
    # holds (holds.py) and finished CPU-tier copies (cpu_stores.py).
    pending_frees: list[str] = field(default_factory=list)
    # verify_bytes: blocks now held or pinned for a reader, whose digests the workers state next step.
    pending_digests: list[DigestSpec] = field(default_factory=list)
    # Scheduler steps so far (build_connector_meta calls): pull timelines count steps with it.
    step: int = 0
    # Loads under way per holder engine (loads.py): they share its bandwidth (pull_policy.py).
    pulls_in_flight: Counter[str] = field(default_factory=Counter)
    # This engine's load (own_load.py): reported to the broker, and its running requests are
    # those a recompute here delays (pull_policy.py).
    own_load: OwnLoad = field(default_factory=OwnLoad)

    @property
    def scheduling_step(self) -> int:
        """The step vLLM's hooks before build_connector_meta (lookups, allocation) belong to."""
        return self.step + 1

    @property
    def expected_ranks(self) -> int:
        """Worker ranks that each report a read or a copy before it counts as done."""
        return self.tp_size * self.pp_size

    def state_digests(self, tier: int, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """verify_bytes: have the workers state these blocks' digests (no-op when off)."""
        if self.config.verify_bytes and block_ids:
            self.pending_digests.append(
                DigestSpec(tier, tuple(block_ids), tuple(int(h) for h in block_hashes))
            )

    def take_digests(self) -> list[DigestSpec]:
        digests, self.pending_digests = self.pending_digests, []
        return digests

    def take_frees(self) -> list[str]:
        frees, self.pending_frees = self.pending_frees, []
        return frees

    def namespace(self, request: Any) -> pb.Namespace:
        salt = getattr(request, "cache_salt", None) or ""
        tenant = f"{self.config.tenant}/{salt}" if self.config.tenant else salt
        assert self.link is not None
        return pb.Namespace(layout_id=self.link.layout_id, tenant=tenant)


def tier_name(tier: int) -> str:
    return pb.Tier.Name(tier)  # type: ignore[arg-type]


def finished_normally(request: Any) -> bool:
    status = getattr(request, "status", None)
    name = getattr(status, "name", str(status))
    return name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
