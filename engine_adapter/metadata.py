"""What the scheduler side tells the workers each step, and what they answer.

Both travel inside one engine (scheduler process -> worker processes, by
pickle), so they are plain dataclasses. ``VERSION`` names the format; a worker
refuses metadata of another version instead of misreading it.

The load protocol, per request:
1. ``LoadSpec`` (scheduler -> workers): the lease is active; read the holder's
   blocks into these freshly allocated local blocks.
2. ``ReadOutcomes`` (workers -> scheduler): this rank finished its reads, or
   failed them.
3. ``Commit`` (scheduler -> workers): the lease was released (ok=True: the
   bytes are valid, report the request loaded) or could not be (ok=False:
   report the blocks as load errors, vLLM recomputes them). A load that never
   started (lease refused) gets a failing Commit directly.

The CPU tier (``cpu_tier_blocks`` > 0): ``StoreSpec`` (scheduler -> workers)
copies a finished request's blocks into CPU-tier slots; the workers answer in
``ReadOutcomes.stores_done`` / ``stores_failed``. A request with a store in
flight is not reported freed to vLLM until its copy is done.

Verified bytes (``verify_bytes``, engine_adapter/digests.py): ``DigestSpec``
(scheduler -> workers) states the digests of blocks a reader may now read;
``LoadSpec.block_hashes`` lets the reader check them; ``ReadOutcomes.verified``
/ ``mismatched`` say what it found.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvbroker.engine_adapter.broker_link import NewGeneration

# The format's history. A worker refuses metadata of another version (both
# sides of one engine load the same package, so a mismatch means a mixed
# install, not a peer of another release).
#   1: LoadSpec / Commit / ReadOutcomes: lease-committed pulls; `frees` for
#      held requests whose lease ended.
#   2: the CPU tier: StoreSpec, ReadOutcomes.stores_done / stores_failed and
#      HolderRank.mem_type. (HolderRank.num_blocks came later with a default:
#      both sides are one install, so an added defaulted field needs no bump.)
#   3: LoadSpec.holder_generation. Later, defaulted: DigestSpec, LoadSpec.block_hashes,
#      HolderRank.digest_regions / digest_algorithm, ReadOutcomes.verified / mismatched /
#      blocks_digested, AdapterMetadata.generations.
VERSION = 3


@dataclass(frozen=True)
class RegionSpec:
    """One layer's memory region of a holder rank (mirrors pb.MemoryRegion)."""

    layer: int
    base_addr: int
    block_stride: int
    block_bytes: int
    device_id: int = 0


@dataclass(frozen=True)
class HolderRank:
    """Transfer details of one holder rank, from the broker's EngineInfo."""

    pp_rank: int
    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    start_layer: int
    end_layer: int
    regions: tuple[RegionSpec, ...]
    num_blocks: int = 0  # capacity of the holder's tier (0 = unknown)
    mem_type: str = ""  # NIXL memory type of the holder's tier ("" = same as ours)
    # The holder rank's digest table of this tier (TierInfo.digest_table, or the older
    # TierInfo.digest_regions: "crc32"); () = states none.
    digest_regions: tuple[RegionSpec, ...] = ()
    digest_algorithm: str = ""


@dataclass(frozen=True)
class LoadSpec:
    request_id: str
    lease_id: str
    holder_engine_id: str
    tier: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    holder_ranks: tuple[HolderRank, ...]
    # EngineInfo.generation of the holder the lease was granted on (0: unknown). A worker never
    # reads under a generation older than one it has loaded the agent of (docs/engine_adapter.md).
    holder_generation: int = 0
    # The lease's hashes of remote_block_ids (verify_bytes: they stamp the holder's digests).
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class StoreSpec:
    """Copy KV blocks `gpu_block_ids[i]` into CPU-tier slots `slot_ids[i]` (asynchronously)."""

    store_id: int
    request_id: str
    gpu_block_ids: tuple[int, ...]
    slot_ids: tuple[int, ...]


@dataclass(frozen=True)
class DigestSpec:
    """State the digests of `block_ids` of `tier` (blocks whose hashes these are): a reader may read them."""

    tier: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class Commit:
    request_id: str
    ok: bool
    local_block_ids: tuple[int, ...]
    reason: str = ""


@dataclass
class AdapterMetadata(KVConnectorMetadata):
    version: int = VERSION
    loads: list[LoadSpec] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    # Held requests whose lease ended: their blocks go back to vLLM now.
    frees: list[str] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    digests: list[DigestSpec] = field(default_factory=list)
    generations: list[NewGeneration] = field(default_factory=list)


@dataclass
class ReadOutcomes(KVConnectorWorkerMetadata):
    """Per request: how many ranks finished their reads, how many failed, why."""

    done: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    bytes_read: dict[str, int] = field(default_factory=dict)
    # CPU tier: per store id, ranks whose copy finished / why a copy failed.
    stores_done: dict[int, int] = field(default_factory=dict)
    stores_failed: dict[int, str] = field(default_factory=dict)
    # Per request: seconds this rank's reads took, as the worker timed them (the slowest rank wins).
    read_s: dict[str, float] = field(default_factory=dict)
    # Reads refused because their holder was replaced (an older generation than the one loaded),
    # and peers whose cached agent was dropped for a newer generation, on every rank together.
    stale_refused: int = 0
    peers_replaced: int = 0
    # verify_bytes, per request: blocks whose bytes matched the holder's digests (every layer this
    # rank read), and blocks whose bytes did not; blocks whose digests this rank stated as holder.
    verified: dict[str, int] = field(default_factory=dict)
    mismatched: dict[str, int] = field(default_factory=dict)
    blocks_digested: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ReadOutcomes)
        merged = ReadOutcomes(
            dict(self.done),
            dict(self.failed),
            dict(self.bytes_read),
            dict(self.stores_done),
            dict(self.stores_failed),
            dict(self.read_s),
            self.stale_refused + other.stale_refused,
            self.peers_replaced + other.peers_replaced,
            dict(self.verified),
            dict(self.mismatched),
            self.blocks_digested + other.blocks_digested,
        )
        for req_id, count in other.done.items():
            merged.done[req_id] = merged.done.get(req_id, 0) + count
        for req_id, reason in other.failed.items():
            merged.failed.setdefault(req_id, reason)
        for req_id, nbytes in other.bytes_read.items():
            merged.bytes_read[req_id] = merged.bytes_read.get(req_id, 0) + nbytes
        for store_id, count in other.stores_done.items():
            merged.stores_done[store_id] = merged.stores_done.get(store_id, 0) + count
        for store_id, reason in other.stores_failed.items():
            merged.stores_failed.setdefault(store_id, reason)
        for counts, more in ((merged.verified, other.verified), (merged.mismatched, other.mismatched)):
            for req_id, n in more.items():
                counts[req_id] = counts.get(req_id, 0) + n
        for req_id, seconds in other.read_s.items():
            merged.read_s[req_id] = max(seconds, merged.read_s.get(req_id, 0.0))
        return merged
