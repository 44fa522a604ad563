"""What a granted lease names for the reader: the holder's block ids of a pull, and its ranks.

Pure functions over the broker's answer (loads.py calls them when a lease is
granted): which holder block each planned chain position is, and each holder
rank's transfer details on the lease's tier (its regions, and with
verify_bytes its digest table, engine_adapter/digests.py).
"""

from __future__ import annotations

from kvbroker.engine_adapter.decisions import PullPlan
from kvbroker.engine_adapter.digests import CRC32
from kvbroker.engine_adapter.metadata import HolderRank, RegionSpec
from kvbroker.engine_adapter.scheduler_context import tier_name
from kvbroker.v1 import broker_pb2 as pb


def remote_block_ids(lease: pb.Lease, hashes: list[int], plan: PullPlan) -> tuple[list[int], str | None]:
    """Holder block ids for the planned chain positions, matched by hash."""
    if len(lease.block_ids) != len(lease.block_hashes):
        return [], f"lease has {len(lease.block_hashes)} hashes but {len(lease.block_ids)} block ids"
    by_hash = dict(zip(lease.block_hashes, lease.block_ids, strict=True))
    ids: list[int] = []
    for pos in range(plan.first_block, plan.first_block + plan.num_blocks):
        block_id = by_hash.get(hashes[pos]) if pos < len(hashes) else None
        if block_id is None:
            return [], f"the lease does not cover block {pos} of the prompt"
        ids.append(block_id)
    return ids, None


def stated_digests(tiers: list[pb.TierInfo]) -> tuple[str, list[RegionSpec]]:
    """A holder tier's digest table (verified bytes): its algorithm and regions. The named table
    (TierInfo.digest_table) if any, else the CRC32 table of older adapters (digest_regions)."""
    for t in tiers:
        if t.HasField("digest_table") and t.digest_table.regions:
            return t.digest_table.algorithm, [_spec(r) for r in t.digest_table.regions]
    return CRC32, [_spec(r) for t in tiers for r in t.digest_regions]


def _spec(r: pb.MemoryRegion) -> RegionSpec:
    return RegionSpec(r.layer, r.base_addr, r.block_stride, r.block_bytes, r.device_id)


def holder_ranks(holder: pb.EngineInfo, tier: int) -> tuple[list[HolderRank], str | None]:
    ranks: list[HolderRank] = []
    for rank in holder.ranks:
        capacity = max((int(t.num_blocks) for t in rank.tiers if t.tier == tier), default=0)
        regions = [
            RegionSpec(r.layer, r.base_addr, r.block_stride, r.block_bytes, r.device_id)
            for t in rank.tiers
            if t.tier == tier
            for r in t.regions
        ]
        if not rank.agent_name or not regions:
            continue
        mem_type = next((t.mem_type for t in rank.tiers if t.tier == tier), "")
        algorithm, digests = stated_digests([t for t in rank.tiers if t.tier == tier])
        ranks.append(
            HolderRank(
                pp_rank=rank.pp_rank,
                tp_rank=rank.tp_rank,
                agent_name=rank.agent_name,
                agent_metadata=bytes(rank.agent_metadata),
                start_layer=rank.start_layer,
                end_layer=rank.end_layer,
                regions=tuple(regions),
                num_blocks=capacity,
                mem_type=mem_type,
                digest_regions=tuple(digests),
                digest_algorithm=algorithm,
            )
        )
    if not ranks:
        return [], f"the holder has registered no rank with memory on tier {tier_name(tier)}"
    return ranks, None
