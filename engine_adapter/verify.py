"""One rank's verified bytes (``verify_bytes``): its digest tables as a holder, its checks as a reader.

As a holder, each registered tier gets a digest table (engine_adapter/digests.py)
registered with NIXL beside it; ``submit`` fills it for a ``DigestSpec`` (blocks
now held or pinned for a reader) on a thread of its own, in order, so that
vLLM's step does not wait for the digests (the compiled digest releases the GIL).
A reader that comes first finds the entries unstated and reads them again. As a
reader, every NIXL read of a load is paired with a read of the holder rank's
entries for the same blocks and layers into this rank's inbox; when both are
done, ``check`` compares them with the digests of the bytes that landed, with the
algorithm the holder named. Entries not stated yet are read again until
``VERIFY_WAIT_S`` has passed; a block whose bytes differ fails the load, which
the scheduler then recomputes (the pull-failed path). A holder naming a digest
this rank cannot compute is not read at all (recomputed), never reported corrupt.
A large load is read in groups of blocks, each digested on a thread of its own as it
lands while the next is read (engine_adapter/verify_overlap.py); ``check`` then compares
those digests. With ``verify_sample`` below 1 a check digests only that share of each block's
layers, drawn afresh per check (``digests.draw_sample``), read whole and checked after.

DRAM is digested in place on the CPU; VRAM on its GPU, through the KV tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbroker.engine_adapter.digests import (
    ALGORITHM,
    CRC32,
    INBOX_TIER,
    BlockBytes,
    Check,
    DigestTable,
    Sample,
    check,
    digest_tier,
    draw_sample,
)
from kvbroker.engine_adapter.metadata import DigestSpec, LoadSpec, ReadOutcomes, RegionSpec
from kvbroker.engine_adapter.topology import LayerRead
from kvbroker.engine_adapter.verify_overlap import GroupDigests, OverlapPolicy
from kvbroker.v1 import broker_pb2 as pb

logger = logging.getLogger("vllm.kvbroker.worker")

# How long a reader waits for a holder to state the digests of blocks it read (the holder states
# them at its next scheduler step after the hold or pin; an idle engine is woken for it).
VERIFY_WAIT_S = 5.0
# How often a reader reads entries not stated yet again (it steps every few ms while it waits).
VERIFY_RETRY_S = 0.01


class VerifyUnsupportedError(ValueError):
    """verify_bytes cannot digest this memory (a memory type it does not know, VRAM without its tensors)."""


@dataclass
class PendingCheck:
    """A load whose digest entries are (being) read; checked when its reads are all done."""

    reads: list[LayerRead]
    deadline: float
    tries: int = 1
    next_try: float = 0.0
    # A large load is read in groups, each digested as it lands (engine_adapter/verify_overlap.py).
    digests: GroupDigests | None = None

    def read_ended(self, handle: int, ok: bool) -> None:
        if self.digests is not None:
            self.digests.read_ended(handle, ok)


class ByteVerifier:
    def __init__(self, region_factory: Callable[[RegionSpec], Any], sample: float = 1.0) -> None:
        """`sample` (verify_sample): the share of each read block's layers a check digests, drawn
        afresh per check (1.0: every byte; see ``digests.draw_sample``)."""
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"verify_sample must be in (0, 1] (got {sample})")
        self.sample = sample
        self._rng = np.random.default_rng()  # seeded from the OS: a holder cannot know the draw
        self._region_factory = region_factory
        self._sources: dict[int, BlockBytes] = {}
        self._tables: dict[int, DigestTable] = {}
        self._inbox: DigestTable | None = None
        self._stater: ThreadPoolExecutor | None = None  # one thread: specs are stated in order
        self._stating: list[Future[int]] = []
        self.overlap = OverlapPolicy()  # how large loads are cut into groups digested as they land
        # One thread: a load's groups in order (any Executor will do: tests run them inline).
        self.checker: Executor | None = None

    def register(
        self,
        mover: Any,
        tier: int,
        mem_type: str,
        regions: Sequence[Any],
        num_blocks: int,
        tensors: Iterable[Any] | Mapping[str, Any] | None = None,
    ) -> pb.DigestTable:
        """A tier's digest table (and, for the KV cache, the inbox), registered with NIXL.
        VRAM is digested through `tensors` (the KV caches). Returns TierInfo.digest_table."""
        if mem_type not in ("DRAM", "VRAM") or (mem_type == "VRAM" and not tensors):
            raise VerifyUnsupportedError(
                f"verify_bytes digests DRAM, or VRAM through its KV tensors; this rank's tier "
                f"{pb.Tier.Name(tier)} (type {tier}) is {mem_type or 'of no type'}"  # type: ignore[arg-type]
                + (" and no tensors were given" if mem_type == "VRAM" else "")
            )
        given = list(tensors.values() if isinstance(tensors, Mapping) else tensors or ())
        try:
            source = BlockBytes(regions, num_blocks, mem_type, given)
            source.digests([], source.layers)  # compiles (or loads) the digest now, not on a pull
            if self.sample < 1.0:
                source.pair_digests(np.zeros(0, dtype=np.int64), [])  # and the sampled check's
                one = source.layers[:1]  # an unstated entry: compiles the one-call check, digests nothing
                source.in_place_check(DigestTable(1, one), [0], [1], one, Sample(np.zeros(1, np.int64), 1, 1))
        except ValueError as e:
            raise VerifyUnsupportedError(f"verify_bytes cannot digest tier {pb.Tier.Name(tier)}: {e}") from e  # type: ignore[arg-type]
        table = DigestTable(num_blocks, source.layers)
        mover.register_tier(digest_tier(tier), "DRAM", table.regions(), num_blocks)
        self._sources[tier], self._tables[tier] = source, table
        if tier == pb.TIER_GPU:
            self._inbox = DigestTable(num_blocks, source.layers)
            mover.register_tier(INBOX_TIER, "DRAM", self._inbox.regions(), num_blocks)
        return pb.DigestTable(algorithm=ALGORITHM, regions=[r.to_proto() for r in table.regions()])

    # ------------------------------------------------------------------
    # holder
    # ------------------------------------------------------------------

    def submit(self, spec: DigestSpec) -> None:
        """State a DigestSpec's entries on the stater thread (``take_stated`` counts them)."""
        if self._stater is None:
            self._stater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbroker-digests")
        self._stating.append(self._stater.submit(self.state, spec))

    def take_stated(self) -> int:
        """Blocks stated since the last call. A spec that failed is logged: its readers recompute."""
        done: list[Future[int]] = []
        pending: list[Future[int]] = []
        for f in self._stating:
            (done if f.done() else pending).append(f)
        self._stating = pending
        blocks = 0
        for f in done:
            error = f.exception()
            if error is None:
                blocks += f.result()
            else:
                logger.warning("kvbroker: cannot state digests: %s", error)
        return blocks

    def close(self) -> None:
        for pool in (self._stater, self.checker):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def state(self, spec: DigestSpec) -> int:
        """Compute and publish the entries of a DigestSpec's blocks; returns how many blocks."""
        table, source = self._tables.get(spec.tier), self._sources.get(spec.tier)
        if table is None or source is None:
            raise ValueError(f"no digest table for tier {spec.tier} on this rank")
        table.state(source, spec.block_ids, spec.block_hashes)
        return len(spec.block_ids)

    # ------------------------------------------------------------------
    # reader
    # ------------------------------------------------------------------

    def unverifiable(self, spec: LoadSpec, reads: Sequence[LayerRead]) -> str:
        """Why this load cannot be verified ("" if it can)."""
        if self._inbox is None:
            return "verify_bytes: this rank has no digest inbox"
        if len(spec.block_hashes) != len(spec.remote_block_ids):
            return "verify_bytes: the load names no block hashes to check the holder's digests against"
        local = self._sources[pb.TIER_GPU]
        for read in reads:
            if not read.holder.digest_regions:
                return (
                    f"verify_bytes: holder rank {read.holder.agent_name} states no digests "
                    "(verify_bytes off there, or an adapter too old to name them)"
                )
            if not local.supports(algorithm := read.holder.digest_algorithm or CRC32):
                return (
                    f"verify_bytes: holder rank {read.holder.agent_name} states {algorithm} digests, "
                    f"which this rank cannot compute on its {local.mem_type} (it computes {ALGORITHM})"
                )
        return ""

    def start_reads(self, mover: Any, spec: LoadSpec, reads: Sequence[LayerRead]) -> list[int]:
        """Read the holder ranks' entries of the load's blocks into the inbox at its local ids."""
        handles = []
        for read in reads:
            holder = read.holder
            handles.append(
                mover.start_read(
                    holder.agent_name,
                    [self._region_factory(r) for r in holder.digest_regions if r.layer in read.layers],
                    spec.remote_block_ids,
                    INBOX_TIER,
                    spec.local_block_ids,
                    layers=read.layers,
                    peer_num_blocks=holder.num_blocks or None,
                    peer_mem_type="DRAM",
                )
            )
        return handles

    def overlapped(
        self, spec: LoadSpec, reads: Sequence[LayerRead], bytes_per_block: int
    ) -> GroupDigests | None:
        """The groups a load is read in, each digested as it lands; None: read whole, check after
        (a small load, or a holder stating another digest)."""
        layers = _layers(reads)
        if set(layers.values()) != {ALGORITHM} or self.sample < 1.0:
            return None  # a sampled check digests a few layers per block: after the read
        groups = self.overlap.groups(len(spec.local_block_ids), bytes_per_block)
        if len(groups) < 2:
            return None
        if self.checker is None:
            self.checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbroker-check")
        source = self._sources[pb.TIER_GPU]
        return GroupDigests(source, spec.local_block_ids, list(layers), groups, self.checker)

    def settle(
        self,
        reading: Any,
        outcomes: ReadOutcomes,
        now: float,
        reread: Callable[[Any, list[LayerRead]], object],
    ) -> bool:
        """Compare a load whose reads all ended (`reading`: the worker's) with the holder's digests,
        noting what was found in `reading.failure` and `outcomes`. False: entries the holder has
        not stated yet are read again (`reread(reading, reads)`), so check again later."""
        pending: PendingCheck | None = reading.check
        if pending is None or reading.failure:
            return True
        spec, req_id = reading.spec, reading.spec.request_id
        try:
            found = self.check(spec, pending.reads, pending.digests)
        except Exception as e:  # a check that cannot run is no verification: recompute
            reading.failure = f"verify_bytes: cannot check the digests: {e}"
            return True
        if found.mismatched:
            outcomes.mismatched[req_id] = len(found.mismatched)
            reading.failure = mismatch_reason(found, spec)
        elif found.unstated and now < pending.deadline:
            # The holder states them at its next step: read its entries again, now and then.
            if now >= pending.next_try:
                pending.tries += 1
                pending.next_try = now + VERIFY_RETRY_S
                reread(reading, pending.reads)
            return bool(reading.failure)
        elif found.unstated:
            reading.failure = (
                f"verify_bytes: the holder stated no digests for {len(found.unstated)} of "
                f"{found.blocks} blocks within {VERIFY_WAIT_S:.0f} s ({pending.tries} reads)"
            )
        else:
            outcomes.verified[req_id] = found.blocks
        return True

    def check(self, spec: LoadSpec, reads: Sequence[LayerRead], digests: GroupDigests | None = None) -> Check:
        """Compare the inbox's entries with the landed blocks' digests (`digests`: computed already)."""
        assert self._inbox is not None
        source = self._sources[pb.TIER_GPU]
        actual = None if digests is None else digests.result
        layers = _layers(reads)
        sample = None
        if self.sample < 1.0:
            sample = draw_sample(len(spec.local_block_ids), len(layers), self.sample, self._rng)
        return check(self._inbox, source, spec.local_block_ids, spec.block_hashes, layers, actual, sample)


def _layers(reads: Sequence[LayerRead]) -> dict[int, str]:
    """Each layer read, with the digest its holder states (in the order the check lists them)."""
    return {layer: read.holder.digest_algorithm or CRC32 for read in reads for layer in read.layers}


def mismatch_reason(found: Check, spec: LoadSpec) -> str:
    first = ""
    if found.first_mismatch is not None:
        pos, layer = found.first_mismatch
        first = f" (first: holder block {spec.remote_block_ids[pos]}, layer {layer})"
    return (
        f"verify_bytes: {len(found.mismatched)} of {found.blocks} blocks read differ from the "
        f"holder's digests{first}"
    )


def record_verification(ctx: Any, outcomes: ReadOutcomes, span_of: Callable[[str], Any]) -> None:
    """Scheduler side (`ctx`: its stats and config): count what the ranks' checks found, and put
    it on each pull's span (with verify_sample below 1, as `kvbroker.verify.sample`, the share of
    layers checked). A mismatched pull also fails (its reason names the mismatch), so vLLM
    recomputes it."""
    stats, sample = ctx.stats, ctx.config.verify_sample
    stats.count("blocks_digested", outcomes.blocks_digested)
    for key, counts in (("verified", outcomes.verified), ("mismatched", outcomes.mismatched)):
        for req_id, blocks in counts.items():
            if key == "mismatched":
                stats.count("verify_mismatches")  # pulls; kvbroker_verify_mismatches_total
            stats.count(f"verify_{key}_blocks", blocks)
            span = span_of(req_id)
            if span is not None:
                span.set_attribute(f"kvbroker.verify.{key}_blocks", blocks)
                if sample < 1.0:
                    span.set_attribute("kvbroker.verify.sample", sample)
