"""Worker side of the connector: register this rank's KV memory with NIXL and
the broker, read holder blocks into freshly allocated local blocks, and report
finished and failed loads to vLLM.

The worker never talks to the broker about leases: the scheduler side owns
them. It reads when told (``LoadSpec``), reports when its reads are done
(``ReadOutcomes``), and reports a request loaded only when the scheduler says
the lease was released in time (``Commit``). A failed commit turns the
request's blocks into load errors, which vLLM recomputes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvbroker.engine_adapter.kv_regions import tier_info
from kvbroker.engine_adapter.metadata import (
    VERSION,
    AdapterMetadata,
    Commit,
    LoadSpec,
    ReadOutcomes,
    RegionSpec,
    StoreSpec,
)
from kvbroker.engine_adapter.peer_agents import PeerAgents
from kvbroker.engine_adapter.topology import LayerRead, TopologyError, plan_layer_reads
from kvbroker.engine_adapter.verify import VERIFY_WAIT_S, ByteVerifier, PendingCheck
from kvbroker.v1 import broker_pb2 as pb

logger = logging.getLogger("vllm.kvbroker.worker")

# How often a rank re-registers with the broker, so that a restarted broker
# learns our NIXL details again without an engine restart.
RANK_REFRESH_S = 5.0
RANK_RETRY_S = 0.5
# Between two polls of a read the step waits for (get_finished, step_wait_s).
STEP_POLL_S = 0.0005


class MoverLike(Protocol):
    def register_tier(self, tier: int, mem_type: str, regions: list[Any], num_blocks: int) -> None: ...
    def agent_metadata(self) -> bytes: ...
    def add_peer(self, agent_name: str, metadata: bytes) -> Any: ...
    def remove_peer(self, agent_name: str) -> None: ...
    def start_read(
        self,
        peer_agent: str,
        peer_regions: list[Any],
        remote_block_ids: Sequence[int],
        local_tier: int,
        local_block_ids: Sequence[int],
        layers: range | None = None,
        notif: bytes | None = None,
        *,
        peer_num_blocks: int | None = None,
        peer_mem_type: str | None = None,
    ) -> int: ...
    def poll(self) -> tuple[list[int], dict[int, str]]: ...
    def close(self) -> None: ...


class CpuTierLike(Protocol):
    num_slots: int
    mem_type: str

    def regions(self) -> list[Any]: ...
    def start_store(self, kv_caches: Any, gpu_block_ids: Sequence[int], slot_ids: Sequence[int]) -> int: ...
    def start_load(self, slot_ids: Sequence[int], kv_caches: Any, gpu_block_ids: Sequence[int]) -> int: ...
    def poll(self) -> list[int]: ...
    def take_failed(self) -> dict[int, str]: ...
    def close(self) -> None: ...


@dataclass
class _Reading:
    spec: LoadSpec
    handles: set[int] = field(default_factory=set)
    failure: str = ""
    bytes_total: int = 0
    started: float = 0.0
    # The first read from a peer: its time includes NIXL's connection set-up, so it is no bandwidth.
    first_from_peer: bool = False
    # verify_bytes: the holder's digests of these blocks are read too, and checked once all is done.
    check: PendingCheck | None = None


FIRST_READ_NOTE = "first read from this peer: includes the connection set-up"


def read_rate(first_from_peer: bool, gbps: float) -> str:
    """How a finished read's log line states its rate: GB/s, except for a peer's first read."""
    return FIRST_READ_NOTE if first_from_peer else f"{gbps:.4f} GB/s"


class AdapterWorker:
    def __init__(
        self,
        *,
        engine_id: str,
        pp_rank: int,
        tp_rank: int,
        mover_factory: Callable[[str], MoverLike],
        region_factory: Callable[[RegionSpec], Any],
        rank_registrar: Callable[[pb.RankInfo], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cpu_tier_slots: int = 0,
        cpu_tier_factory: Callable[[list[Any], int], CpuTierLike] | None = None,
        verify_bytes: bool = False,
        verify_sample: float = 1.0,
        step_wait_s: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.engine_id = engine_id
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank
        self.agent_name = f"{engine_id}-pp{pp_rank}-tp{tp_rank}"
        self._mover_factory = mover_factory
        self._region_factory = region_factory
        self._rank_registrar = rank_registrar
        self._clock = clock
        self.mover: MoverLike | None = None
        self.local_layers = range(0)
        self.block_bytes_per_layer: dict[int, int] = {}
        self._reading: dict[str, _Reading] = {}
        self._handle_owner: dict[int, str] = {}
        self._commits: dict[str, Commit] = {}
        self._outcomes = ReadOutcomes()
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._frees: set[str] = set()
        self._seen_finished: set[str] = set()
        self._peers = PeerAgents()  # holder agents loaded into NIXL, by registration generation
        self._stop = threading.Event()
        self._registrar_thread: threading.Thread | None = None
        self.rank_info: pb.RankInfo | None = None
        # CPU offload tier (cpu_tier_slots > 0).
        self._cpu_tier_slots = cpu_tier_slots
        self._cpu_tier_factory = cpu_tier_factory
        self.cpu_tier: CpuTierLike | None = None
        self._kv_caches: Any = None
        self._store_of_handle: dict[int, tuple[int, str]] = {}  # copy handle -> (store id, request id)
        self._restore_of_handle: dict[int, str] = {}  # copy handle (CPU tier -> KV) -> request id
        self._storing: dict[str, int] = {}  # request id -> copies in flight (its blocks stay allocated)
        # verify_bytes: digest tables as holder, digest checks as reader (engine_adapter/verify.py).
        self.verifier = ByteVerifier(region_factory, verify_sample) if verify_bytes else None
        # Reads started in this step are polled to their end before the step's output, up to
        # this long (step_wait_ms): reported in this step, the scheduler can release and finish
        # the load in it. UCX's same-host copy usually ends inside the post (block_mover.py).
        self._step_wait_s = step_wait_s
        self._sleep = sleep
        self._step_reads: set[str] = set()

    # ------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------

    def register_memory(
        self, regions: Sequence[Any], num_blocks: int, mem_type: str, kv_caches: Any = None
    ) -> None:
        """Register this rank's KV cache (and CPU tier) with NIXL and publish them to the broker."""
        self.mover = self._mover_factory(self.agent_name)
        self.mover.register_tier(pb.TIER_GPU, mem_type, list(regions), num_blocks)
        tiers = [tier_info(pb.TIER_GPU, mem_type, num_blocks, regions)]
        if self.verifier is not None:
            table = self.verifier.register(self.mover, pb.TIER_GPU, mem_type, regions, num_blocks, kv_caches)
            tiers[0].digest_table.CopyFrom(table)
        if self._cpu_tier_slots > 0 and self._cpu_tier_factory is not None:
            self._kv_caches = kv_caches
            self.cpu_tier = self._cpu_tier_factory(list(regions), self._cpu_tier_slots)
            cpu_regions = self.cpu_tier.regions()
            self.mover.register_tier(
                pb.TIER_CPU, self.cpu_tier.mem_type, cpu_regions, self.cpu_tier.num_slots
            )
            tiers.append(tier_info(pb.TIER_CPU, self.cpu_tier.mem_type, self.cpu_tier.num_slots, cpu_regions))
            if self.verifier is not None:
                tiers[-1].digest_table.CopyFrom(
                    self.verifier.register(
                        self.mover, pb.TIER_CPU, self.cpu_tier.mem_type, cpu_regions, self.cpu_tier.num_slots
                    )
                )
            logger.info(
                "kvbroker: rank pp=%d tp=%d CPU tier: %d slots (%s) registered with NIXL",
                self.pp_rank,
                self.tp_rank,
                self.cpu_tier.num_slots,
                self.cpu_tier.mem_type,
            )
        layers = sorted(r.layer for r in regions)
        self.local_layers = range(layers[0], layers[-1] + 1) if layers else range(0)
        self.block_bytes_per_layer = {}
        for r in regions:  # a layer may have several regions (K and V apart)
            self.block_bytes_per_layer[r.layer] = self.block_bytes_per_layer.get(r.layer, 0) + r.block_bytes
        self.rank_info = pb.RankInfo(
            pp_rank=self.pp_rank,
            tp_rank=self.tp_rank,
            agent_name=self.agent_name,
            agent_metadata=self.mover.agent_metadata(),
            start_layer=self.local_layers.start,
            end_layer=self.local_layers.stop,
            tiers=tiers,
        )
        if self._rank_registrar is not None:
            self._registrar_thread = threading.Thread(
                target=self._register_rank_loop, name="kvbroker-rank", daemon=True
            )
            self._registrar_thread.start()
        logger.info(
            "kvbroker: rank pp=%d tp=%d registered %d layers [%d, %d), %d blocks (%s) as NIXL agent %s",
            self.pp_rank,
            self.tp_rank,
            len(regions),
            self.local_layers.start,
            self.local_layers.stop,
            num_blocks,
            mem_type,
            self.agent_name,
        )

    def _register_rank_loop(self) -> None:
        assert self._rank_registrar is not None and self.rank_info is not None
        announced = False
        while not self._stop.is_set():
            try:
                self._rank_registrar(self.rank_info)
            except Exception as e:  # any broker or network failure: retry, never crash the worker
                if announced:
                    logger.info("kvbroker: rank registration lost (%s); retrying", e)
                announced = False
                self._stop.wait(RANK_RETRY_S)
                continue
            if not announced:
                logger.info("kvbroker: rank pp=%d tp=%d known to the broker", self.pp_rank, self.tp_rank)
            announced = True
            self._stop.wait(RANK_REFRESH_S)

    # ------------------------------------------------------------------
    # per step
    # ------------------------------------------------------------------

    def start_load_kv(self, meta: AdapterMetadata) -> None:
        if meta.version != VERSION:
            # Scheduler and worker come from the same install; a mismatch is a deployment bug.
            raise RuntimeError(f"kvbroker metadata version {meta.version} != worker version {VERSION}")
        self._frees.update(meta.frees)
        for commit in meta.commits:
            self._commits[commit.request_id] = commit
        self._peers.engines_replaced(self.mover, meta.generations)  # before any of this step's reads
        for spec in meta.loads:
            self._start(spec)
            self._step_reads.add(spec.request_id)
        for store in meta.stores:
            self._start_store(store)
        for digest in meta.digests:
            self._state_digests(digest)
        self._settle_commits()

    def _state_digests(self, spec: Any) -> None:
        """Holder: blocks now held or pinned for a reader get their digests (verify_bytes), off the step."""
        if self.verifier is not None:
            self.verifier.submit(spec)

    def _start_store(self, spec: StoreSpec) -> None:
        if self.cpu_tier is None or self._kv_caches is None:
            self._outcomes.stores_failed[spec.store_id] = "no CPU tier on this rank"
            self._outcomes.stores_done[spec.store_id] = self._outcomes.stores_done.get(spec.store_id, 0) + 1
            return
        try:
            handle = self.cpu_tier.start_store(self._kv_caches, spec.gpu_block_ids, spec.slot_ids)
        except Exception as e:  # a bad copy must not take the engine down; the slots are discarded
            self._outcomes.stores_failed[spec.store_id] = f"cannot start the CPU tier copy: {e}"
            self._outcomes.stores_done[spec.store_id] = self._outcomes.stores_done.get(spec.store_id, 0) + 1
            return
        self._store_of_handle[handle] = (spec.store_id, spec.request_id)
        self._storing[spec.request_id] = self._storing.get(spec.request_id, 0) + 1

    def _poll_cpu_tier(self) -> None:
        if self.cpu_tier is None or not (self._store_of_handle or self._restore_of_handle):
            return
        failed = self.cpu_tier.take_failed()
        finished = self.cpu_tier.poll()
        failed.update(self.cpu_tier.take_failed())
        for handle in [*finished, *failed]:
            if handle in self._restore_of_handle:
                self._handle_done(handle, failed.get(handle, ""), self._restore_of_handle)
                continue
            owner = self._store_of_handle.pop(handle, None)
            if owner is None:
                continue
            store_id, req_id = owner
            if handle in failed:
                self._outcomes.stores_failed[store_id] = failed[handle]
            self._outcomes.stores_done[store_id] = self._outcomes.stores_done.get(store_id, 0) + 1
            left = self._storing.get(req_id, 0) - 1
            if left > 0:
                self._storing[req_id] = left
            else:
                self._storing.pop(req_id, None)

    def _start(self, spec: LoadSpec) -> None:
        reading = _Reading(spec, started=self._clock())
        self._reading[spec.request_id] = reading
        if spec.holder_engine_id == self.engine_id and spec.tier == pb.TIER_CPU:
            self._start_restore(spec, reading)
            return
        if self.mover is None:
            reading.failure = "KV memory not registered with NIXL"
            return
        try:
            reads = plan_layer_reads(
                tp_rank=self.tp_rank, local_layers=self.local_layers, holder_ranks=spec.holder_ranks
            )
        except TopologyError as e:
            reading.failure = f"unmappable holder layout: {e}"
            return
        if self.verifier is not None and (why := self.verifier.unverifiable(spec, reads)):
            reading.failure = why
            return
        for read in reads:
            holder = read.holder
            try:
                reading.first_from_peer = not self._peers.is_loaded(holder.agent_name, holder.agent_metadata)
                reading.failure = self._peers.prepare(self.mover, spec, holder) or ""
            except Exception as e:  # a NIXL error on one request must not take the engine down
                reading.failure = f"cannot start NIXL read from {holder.agent_name}: {e}"
            if reading.failure:
                return
        per_block = sum(self.block_bytes_per_layer.get(layer, 0) for read in reads for layer in read.layers)
        reading.bytes_total = per_block * len(spec.local_block_ids)
        digests = self.verifier.overlapped(spec, reads, per_block) if self.verifier else None
        if self.verifier is not None:
            reading.check = PendingCheck(list(reads), self._clock() + VERIFY_WAIT_S, digests=digests)
            if not self._start_digest_reads(reading, reads):  # the holder's entries first: small
                return
        for group, blocks in enumerate(digests.groups if digests else [range(len(spec.local_block_ids))]):
            for read in reads:
                try:
                    handle = self.mover.start_read(
                        read.holder.agent_name,
                        [self._region_factory(r) for r in read.holder.regions if r.layer in read.layers],
                        spec.remote_block_ids[blocks.start : blocks.stop],
                        pb.TIER_GPU,
                        spec.local_block_ids[blocks.start : blocks.stop],
                        layers=read.layers,
                        peer_num_blocks=read.holder.num_blocks or None,
                        peer_mem_type=read.holder.mem_type or None,
                    )
                except Exception as e:  # a NIXL error on one request must not take the engine down
                    reading.failure = f"cannot start NIXL read from {read.holder.agent_name}: {e}"
                    return  # the groups read so far end as usual; the load fails
                reading.handles.add(handle)
                self._handle_owner[handle] = spec.request_id
                if digests is not None:
                    digests.add_read(group, handle)
            if digests is not None:
                self._collect_reads()  # a group that landed is digested while the next is read

    def _start_digest_reads(self, reading: _Reading, reads: Sequence[LayerRead]) -> bool:
        assert self.verifier is not None and self.mover is not None
        try:
            handles = self.verifier.start_reads(self.mover, reading.spec, reads)
        except Exception as e:  # as for the block reads: the load fails, the engine serves on
            reading.failure = f"cannot start the read of the holder's digests: {e}"
            return False
        for handle in handles:
            reading.handles.add(handle)
            self._handle_owner[handle] = reading.spec.request_id
        return True

    def _start_restore(self, spec: LoadSpec, reading: _Reading) -> None:
        """Our own CPU tier's slots (spec.remote_block_ids) back into KV blocks: a local copy."""
        if self.cpu_tier is None or self._kv_caches is None:
            reading.failure = "no CPU tier on this rank"
            return
        try:
            handle = self.cpu_tier.start_load(spec.remote_block_ids, self._kv_caches, spec.local_block_ids)
        except Exception as e:  # a bad copy must not take the engine down; the blocks are recomputed
            reading.failure = f"cannot start the copy from the CPU tier: {e}"
            return
        reading.handles.add(handle)
        self._restore_of_handle[handle] = spec.request_id
        reading.bytes_total = sum(self.block_bytes_per_layer.values()) * len(spec.local_block_ids)

    def poll(self) -> None:
        """Collect finished NIXL reads and CPU tier copies; report each request's outcome once."""
        self._poll_cpu_tier()
        self._collect_reads()
        for req_id, reading in list(self._reading.items()):
            if reading.handles:
                continue
            if self.verifier is not None and not self.verifier.settle(
                reading, self._outcomes, self._clock(), self._start_digest_reads
            ):
                continue  # the holder's digests are read again: not stated yet
            if reading.failure:
                self._outcomes.failed[req_id] = reading.failure
            else:
                elapsed = self._clock() - reading.started
                gbps = reading.bytes_total / elapsed / 1e9 if elapsed > 0 else 0.0
                logger.info(
                    "kvbroker: request %s: read %d blocks (%d bytes) from %s in %.1f ms (%s)",
                    req_id,
                    len(reading.spec.local_block_ids),
                    reading.bytes_total,
                    reading.spec.holder_engine_id,
                    elapsed * 1000.0,
                    read_rate(reading.first_from_peer, gbps),
                )
            self._outcomes.done[req_id] = self._outcomes.done.get(req_id, 0) + 1
            self._outcomes.bytes_read[req_id] = reading.bytes_total
            self._outcomes.read_s[req_id] = self._clock() - reading.started
            del self._reading[req_id]
        self._settle_commits()

    def _collect_reads(self) -> None:
        if self.mover is not None and self._handle_owner:
            finished, failed = self.mover.poll()
            for handle in finished:
                self._handle_done(handle, "")
            for handle, reason in failed.items():
                self._handle_done(handle, reason or "NIXL transfer failed")

    def _handle_done(self, handle: int, failure: str, owners: dict[int, str] | None = None) -> None:
        """One read (NIXL, or a copy back from the CPU tier: `owners`) of a request ended."""
        req_id = (self._handle_owner if owners is None else owners).pop(handle, None)
        reading = self._reading.get(req_id) if req_id else None
        if reading is None:
            return
        reading.handles.discard(handle)
        if reading.check is not None:
            reading.check.read_ended(handle, ok=not failure)
        if failure and not reading.failure:
            reading.failure = failure

    def _settle_commits(self) -> None:
        """Report committed loads, but never while our own reads still write their blocks."""
        for req_id, commit in list(self._commits.items()):
            reading = self._reading.get(req_id)
            if reading is not None and reading.handles:
                continue
            if reading is not None:
                del self._reading[req_id]
            del self._commits[req_id]
            self._finished_recving.add(req_id)
            if not commit.ok:
                self._load_errors.update(commit.local_block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._seen_finished.update(finished_req_ids)
        self.poll()
        self._finish_step_reads()
        # vLLM accepts a finished send only for a request it told us has finished;
        # a request whose blocks are still being copied to the CPU tier waits.
        sending = {r for r in self._frees & self._seen_finished if r not in self._storing}
        self._frees -= sending
        self._seen_finished -= sending
        recving = self._finished_recving
        self._finished_recving = set()
        return (sending or None), (recving or None)

    def _finish_step_reads(self) -> None:
        """Poll the reads this step started until they end, up to ``step_wait_s`` (NIXL's progress
        thread is off: a read moves while its owner polls it)."""
        started, self._step_reads = self._step_reads, set()
        deadline = self._clock() + self._step_wait_s
        while any(self._reading.get(r) is not None for r in started) and self._clock() < deadline:
            self._sleep(STEP_POLL_S)
            self.poll()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_outcomes(self) -> ReadOutcomes | None:
        if self.verifier is not None:
            self._outcomes.blocks_digested += self.verifier.take_stated()
        o = self._outcomes
        # Replacements go with the step's outcomes; one on the broker's word alone, with no read,
        # is an outcome of its own.
        o.stale_refused, o.peers_replaced = self._peers.refused, self._peers.replaced
        if not (
            o.done or o.failed or o.stores_done or o.stores_failed or o.blocks_digested or o.peers_replaced
        ):
            return None
        outcomes, self._outcomes = self._outcomes, ReadOutcomes()
        self._peers.refused = self._peers.replaced = 0
        return outcomes

    def shutdown(self) -> None:
        self._stop.set()
        if self.verifier is not None:
            self.verifier.close()  # its thread reads the tiers' memory: done before they go
        if self.cpu_tier is not None:
            self.cpu_tier.close()
        if self.mover is not None:
            self.mover.close()
            self.mover = None
