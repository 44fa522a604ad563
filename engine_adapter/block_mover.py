"""Moves KV blocks between engine ranks with NIXL READs.

One `BlockMover` per rank owns one NIXL agent (UCX backend, NIXL's progress thread off). Local
memory is registered per tier (the KV cache as tier GPU, the offload buffer as tier CPU). A read
of N blocks x L layers is a single NIXL transfer whose descriptors are coalesced first
(xfer_descs.py): runs of blocks that are adjacent on both sides, and in block-outermost layouts
the layers of one block, travel as one descriptor each.

Small reads take a shorter way: building and coalescing descriptors costs a fixed ~0.2 ms per
read, more than reading a history of a few hundred KB. A read of at most `_PREPPED_MAX_DESCS`
(region, block) pieces is made from two index arrays (`make_prepped_xfer`) into lists prepared
once per local tier and per peer tier, one descriptor per region and block. Large reads keep
coalescing, except into a tier of tiny pieces (a digest table's 8-byte entries): coalescing
thousands costs more than their read, and NIXL merges consecutive descriptors. What a read
shares with the previous ones (layer matching, index offsets, the lists) is kept in a `ReadPlan`
per peer (read_plan.py), and a read that UCX finishes inside `transfer()` is released there: the
per-read Python is a few numpy operations around NIXL's own calls.

Failure model: anything that goes wrong with a peer (unknown, disconnected, killed with -9, a
transfer in an error state, a read that outlives its timeout) becomes a failed handle reported
by `poll()`; it never raises to the caller. Caller mistakes (unknown local tier, block ids out
of range, layer or block geometry that does not match) raise ValueError from `start_read`.

Threading: NIXL calls are serialised by one process-wide lock. Without NIXL's progress thread a
side makes progress only while it calls into its agent, and a holder must answer the UCX
connection handshake of a new reader even when its engine is idle, so a ticker thread polls for
notifications: every `progress_interval_s` (5 ms) while reads are in flight or anything happened
in the last second, every `idle_progress_interval_s` (25 ms) otherwise. It spins nothing: an
idle engine's ticker costs well under 1% of a core, and the first read of a new reader waits at
most one idle tick for the holder's handshake.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import numpy as np

from kvbroker.engine_adapter.kv_regions import Region
from kvbroker.engine_adapter.nixl_agent import NIXL_LOCK, NixlApi, create_agent, real_nixl
from kvbroker.engine_adapter.read_plan import ReadPlan, block_ids, match_layers, peer_table
from kvbroker.engine_adapter.xfer_descs import (
    PreppedIndices,
    RegionTable,
    Span,
    block_pieces,
    block_rows,
    coalesce,
    registered_spans,
)

log = logging.getLogger(__name__)

# The ticker polls fast for this long after the last read, peer or notification.
_BUSY_AFTER_ACTIVITY_S = 1.0
# Reads of at most this many (region, block) pieces use prepared descriptor lists.
_PREPPED_MAX_DESCS = 1024
# A tier of pieces this small (digest entries) reads from prepared lists at any size (above).
_TINY_PIECE_BYTES = 64
# Prepared lists are built only for tiers of at most this many (region, block)
# descriptors (a list costs about 24 bytes per descriptor in NIXL), and at most
# this many per peer (a peer re-registering often falls back to coalescing).
_PREPPED_MAX_ROWS = 1 << 18
_PREPPED_PER_PEER = 8
_PLANS_PER_PEER = 64  # read plans kept per peer (see read_plan.py); more and they start over
_LOCAL = "NIXL_INIT_AGENT"  # NIXL's name for this agent in a descriptor list


@dataclass
class _LocalTier:
    mem_type: str
    regions: list[Region]
    num_blocks: int
    reg_descs: Any  # what register_memory returned, for deregister_memory
    spans: list[Span]  # the registered [start, end) ranges
    table: RegionTable  # the regions as columns, for a read's descriptor math
    regions_of_layer: dict[int, list[int]]
    dlist: Any = None  # prepared list, index = region * num_blocks + block (built on first use)
    tiny: bool = False  # pieces of at most _TINY_PIECE_BYTES


@dataclass
class _Peer:
    metadata: bytes
    # The peer's regions as columns with what it registered, per (regions, blocks they cover).
    tables: dict[tuple[tuple[Region, ...], int], RegionTable] = field(default_factory=dict)
    # Prepared descriptor lists of the peer's tiers, per (regions, blocks, memory type).
    dlists: dict[tuple[tuple[Region, ...], int, str], Any] = field(default_factory=dict)
    plans: dict[tuple[Any, ...], ReadPlan] = field(default_factory=dict)
    dead_reason: str | None = None


@dataclass
class _Read:
    peer: str
    tier: int
    xfer: Any
    started: float


class BlockMover:
    """One rank's NIXL agent: register tiers, know peers, read blocks, poll for results."""

    def __init__(
        self,
        agent_name: str,
        backend: str = "UCX",
        nixl: NixlApi | None = None,
        *,
        progress_interval_s: float | None = 0.005,
        idle_progress_interval_s: float = 0.025,
        read_timeout_s: float | None = 60.0,
        clock: Any = time.monotonic,
    ) -> None:
        self.agent_name = agent_name
        self._api = nixl if nixl is not None else real_nixl()
        self._agent = create_agent(self._api, agent_name, backend)
        self._lock = NIXL_LOCK  # one lock for every agent in the process (see nixl_agent.py)
        self._tiers: dict[int, _LocalTier] = {}
        self._peers: dict[str, _Peer] = {}
        self._reads: dict[int, _Read] = {}
        self._early_done: list[int] = []
        self._early_failed: dict[int, str] = {}
        self._notifs: list[tuple[str, bytes]] = []
        self._handles = count(1)
        self._read_timeout_s = read_timeout_s
        self._clock = clock
        self._closed = False
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._last_activity = clock()
        if progress_interval_s is not None:
            self._ticker = threading.Thread(
                target=self._tick,
                args=(progress_interval_s, max(progress_interval_s, idle_progress_interval_s)),
                name=f"nixl-progress-{agent_name}",
                daemon=True,
            )
            self._ticker.start()

    # ---------------------------------------------------------------- memory

    def register_tier(self, tier: int, mem_type: str, regions: list[Region], num_blocks: int) -> None:
        """Register a tier's memory with NIXL and prepare its local descriptor list.

        Registering a tier again replaces it (the old memory is deregistered).
        """
        if num_blocks <= 0 or not regions:
            raise ValueError(f"tier {tier}: need at least one region and one block")
        spans = registered_spans(regions, num_blocks)
        with self._lock:
            self._drop_tier(tier)
            reg = self._agent.register_memory([(s, e - s, dev, "") for s, e, dev in spans], mem_type)
            by_layer: dict[int, list[int]] = {}
            for i, r in enumerate(regions):
                by_layer.setdefault(r.layer, []).append(i)
            table = RegionTable.of(regions, spans)
            tiny = max(r.block_bytes for r in regions) <= _TINY_PIECE_BYTES
            self._tiers[tier] = _LocalTier(
                mem_type, list(regions), num_blocks, reg, spans, table, by_layer, tiny=tiny
            )

    def agent_metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info and registered memory) for peers."""
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    # ----------------------------------------------------------------- peers

    def add_peer(self, agent_name: str, metadata: bytes) -> None:
        """Load a peer's metadata; idempotent. New metadata under a known name replaces the old."""
        with self._lock:
            known = self._peers.get(agent_name)
            if known is not None and known.metadata == metadata and known.dead_reason is None:
                return
            if known is not None:
                self._forget_peer(agent_name, "peer re-added with new metadata")
            try:
                loaded = self._agent.add_remote_agent(metadata)
            except self._api.errors as exc:
                raise ValueError(f"NIXL rejected the metadata of peer {agent_name!r}: {exc}") from exc
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded_name != agent_name:
                self._invalidate(loaded_name)
                raise ValueError(f"metadata announced as {agent_name!r} belongs to agent {loaded_name!r}")
            self._peers[agent_name] = _Peer(metadata=metadata)
            self._last_activity = self._clock()

    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer (e.g. dead): its reads in flight fail, its descriptor lists are released."""
        with self._lock:
            if agent_name in self._peers:
                self._forget_peer(agent_name, "peer removed")

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    # ----------------------------------------------------------------- reads

    def start_read(
        self,
        peer_agent: str,
        peer_regions: list[Region],
        remote_block_ids: Sequence[int],
        local_tier: int,
        local_block_ids: Sequence[int],
        layers: range | None = None,
        notif: bytes | None = None,
        *,
        peer_num_blocks: int | None = None,
        peer_mem_type: str | None = None,
    ) -> int:
        """Start one NIXL READ of remote blocks into local blocks; returns a handle for `poll()`.

        For each layer in `layers` (default: every local layer of the tier),
        remote block `remote_block_ids[i]` of the peer's regions of that layer
        lands in local block `local_block_ids[i]` of the local regions of the
        same layer. Pass the peer's TierInfo: `peer_num_blocks` lets the
        peer descriptor list be prepared once at full size, and
        `peer_mem_type` ("DRAM"/"VRAM") is needed when it differs from the
        local tier's (e.g. peer VRAM into the local CPU tier).
        """
        with self._lock:
            if self._closed:
                raise ValueError("BlockMover is closed")
            tier = self._tiers.get(local_tier)
            if tier is None:
                raise ValueError(f"local tier {local_tier} is not registered (have {sorted(self._tiers)})")
            ids = block_ids(local_block_ids, remote_block_ids, tier.num_blocks, peer_num_blocks)
            peer = self._peers.get(peer_agent)
            peer_mem = peer_mem_type or tier.mem_type
            plan = self._plan(tier, local_tier, peer, peer_regions, peer_num_blocks, peer_mem, layers)
            handle = next(self._handles)
            if not ids.shape[1] or not plan.local_rows:
                self._early_done.append(handle)
                return handle
            if peer is None:
                self._early_failed[handle] = f"unknown peer {peer_agent!r}: add_peer() it first"
                return handle
            if peer.dead_reason is not None:
                self._early_failed[handle] = f"peer {peer_agent!r} is unreachable ({peer.dead_reason})"
                return handle
            try:
                xfer = self._make_xfer(
                    tier, plan, peer_agent, peer, peer_regions, peer_num_blocks, peer_mem, ids, notif
                )
            except self._api.errors as exc:
                self._fail_early(handle, peer_agent, "could not prepare the read", exc)
                return handle
            try:
                state = self._agent.transfer(xfer)
            except self._api.errors as exc:
                self._release(xfer)
                self._fail_early(handle, peer_agent, "could not post the read", exc)
                return handle
            if state == "ERR":
                self._release(xfer)
                self._early_failed[handle] = f"NIXL refused to post the read from {peer_agent!r}"
                return handle
            if state == "DONE":
                # Finished inside transfer() (UCX's copy between processes on one host does
                # that): release now, as poll() would after check_xfer_state said DONE.
                self._release(xfer)
                self._early_done.append(handle)
                return handle
            self._reads[handle] = _Read(peer_agent, local_tier, xfer, self._clock())
            return handle

    def poll(self) -> tuple[list[int], dict[int, str]]:
        """Drive progress; return (finished handles, {failed handle: reason}). Never raises for peers."""
        with self._lock:
            done, self._early_done = self._early_done, []
            failed, self._early_failed = self._early_failed, {}
            if not self._reads:
                return done, failed
            now = self._clock()
            for handle, read in list(self._reads.items()):
                try:
                    state = self._agent.check_xfer_state(read.xfer)
                except self._api.errors as exc:
                    failed[handle] = self._describe_failure(read.peer, "read failed", exc)
                    self._finish(handle)
                    continue
                if state == "DONE":
                    done.append(handle)
                    self._finish(handle)
                elif state == "ERR":
                    failed[handle] = f"NIXL reported an error state for the read from {read.peer!r}"
                    self._finish(handle)
                elif self._read_timeout_s is not None and now - read.started > self._read_timeout_s:
                    failed[handle] = f"read from {read.peer!r} timed out after {self._read_timeout_s:g}s"
                    self._finish(handle)
            # Notifications are collected by the ticker and take_notifications(),
            # not here: a hot poll loop should only check its own transfers.
            return done, failed

    def in_flight(self) -> int:
        with self._lock:
            return len(self._reads)

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """Notifications peers attached to reads of our memory: [(peer agent, message)]."""
        with self._lock:
            self._collect_notifs()
            out, self._notifs = self._notifs, []
            return out

    def close(self) -> None:
        """Stop the ticker, cancel reads, release every NIXL resource. Idempotent."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for name in list(self._peers):
                self._forget_peer(name, "BlockMover closed")
            for tier in list(self._tiers):
                self._drop_tier(tier)

    def __enter__(self) -> BlockMover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- internals

    def _tick(self, busy_s: float, idle_s: float) -> None:
        interval = busy_s
        while not self._stop.wait(interval):
            with self._lock:
                if self._closed:
                    return
                if self._collect_notifs() or self._reads:
                    self._last_activity = self._clock()
                recent = self._clock() - self._last_activity < _BUSY_AFTER_ACTIVITY_S
            interval = busy_s if recent else idle_s

    def _collect_notifs(self) -> bool:
        """Take NIXL's new notifications; True if there were any."""
        try:
            new = self._agent.get_new_notifs()
        except self._api.errors as exc:
            log.debug("NIXL notification poll failed: %s", exc)
            return False
        for peer, messages in new.items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            self._notifs.extend((name, bytes(m)) for m in messages)
        # Unbounded growth only if nobody ever reads them; keep the newest.
        if len(self._notifs) > 10_000:
            del self._notifs[:-10_000]
        return bool(new)

    def _plan(
        self,
        tier: _LocalTier,
        tier_id: int,
        peer: _Peer | None,
        peer_regions: list[Region],
        peer_num_blocks: int | None,
        peer_mem: str,
        layers: range | None,
    ) -> ReadPlan:
        """This read's plan: cached with the peer, made (and its layers checked) on first use."""
        # Layers as given when hashable (a range), else once as a tuple (an iterator is read once).
        wanted = layers if layers is None or isinstance(layers, range) else tuple(layers)
        key = (tier_id, tuple(peer_regions), peer_num_blocks, peer_mem, wanted)
        plans = peer.plans if peer is not None else {}
        plan = plans.get(key)
        if plan is not None and plan.tier is tier:  # a re-registered tier gets new plans
            return plan
        want = list(wanted) if wanted is not None else sorted(tier.regions_of_layer)
        plan = ReadPlan(tier, *match_layers(tier.regions, tier.regions_of_layer, peer_regions, want))
        if len(plans) >= _PLANS_PER_PEER:
            plans.clear()
        plans[key] = plan
        return plan

    def _make_xfer(
        self,
        tier: _LocalTier,
        plan: ReadPlan,
        peer_agent: str,
        peer: _Peer,
        peer_regions: list[Region],
        peer_num_blocks: int | None,
        peer_mem: str,
        ids: np.ndarray,  # (2, n): local block ids, remote block ids (read_plan.block_ids)
        notif: bytes | None,
    ) -> Any:
        """A READ request: from prepared lists for a small read, from coalesced descriptors otherwise."""
        most = _PREPPED_MAX_ROWS if tier.tiny else _PREPPED_MAX_DESCS
        if peer_num_blocks is not None and len(plan.local_rows) * ids.shape[1] <= most:
            if not plan.prepped_tried:
                plan.prepped = self._prepped(
                    tier, plan, peer_agent, peer, peer_regions, peer_num_blocks, peer_mem
                )
                plan.prepped_tried = True
            if plan.prepped is not None:
                local_dl, remote_dl, indices = plan.prepped
                # block_ids gives uint32 (a view suffices: these ids are below the list sizes).
                local_idx, remote_idx = indices(
                    ids.view(np.int32) if ids.itemsize == 4 else ids.astype(np.int32)
                )
                return self._agent.make_prepped_xfer(
                    "READ", local_dl, local_idx, remote_dl, remote_idx, notif or b""
                )
        theirs = peer_table(peer.tables, peer_regions, peer_num_blocks or int(ids[1].max()) + 1)
        pieces = coalesce(
            block_pieces(tier.table.take(plan.local_rows), theirs.take(plan.peer_rows), ids[0], ids[1])
        )
        local_dl = self._agent.get_xfer_descs(pieces.local_descs(), tier.mem_type)
        remote_dl = self._agent.get_xfer_descs(pieces.remote_descs(), peer_mem)
        return self._agent.initialize_xfer("READ", local_dl, remote_dl, peer_agent, notif or b"")

    def _prepped(
        self,
        tier: _LocalTier,
        plan: ReadPlan,
        peer_agent: str,
        peer: _Peer,
        peer_regions: list[Region],
        peer_num_blocks: int,
        peer_mem: str,
    ) -> tuple[Any, Any, PreppedIndices] | None:
        """The local tier's and the peer tier's prepared lists, built on first use, with the
        plan's index maps into them; None where a list would be too large (or the peer has
        too many): coalesce instead."""
        if tier.dlist is None:
            if len(tier.regions) * tier.num_blocks > _PREPPED_MAX_ROWS:
                return None
            tier.dlist = self._agent.prep_xfer_dlist(
                _LOCAL, block_rows(tier.table, tier.num_blocks), tier.mem_type
            )
        key = (tuple(peer_regions), peer_num_blocks, peer_mem)
        table = peer_table(peer.tables, peer_regions, peer_num_blocks)
        if key not in peer.dlists:
            if (
                len(peer_regions) * peer_num_blocks > _PREPPED_MAX_ROWS
                or len(peer.dlists) >= _PREPPED_PER_PEER
            ):
                return None
            peer.dlists[key] = self._agent.prep_xfer_dlist(
                peer_agent, block_rows(table, peer_num_blocks), peer_mem
            )
        indices = PreppedIndices.of(
            (tier.table, tier.num_blocks, plan.local_rows),
            (table, peer_num_blocks, plan.peer_rows),
            block_major=not tier.table.dense,
        )
        return tier.dlist, peer.dlists[key], indices

    def _release_dlist(self, dlist: Any) -> None:
        try:
            self._agent.release_dlist_handle(dlist)
        except self._api.errors as exc:
            log.debug("could not release a NIXL descriptor list: %s", exc)

    def _fail_early(self, handle: int, peer: str, what: str, exc: BaseException) -> None:
        self._early_failed[handle] = self._describe_failure(peer, what, exc)

    def _describe_failure(self, peer: str, what: str, exc: BaseException) -> str:
        if self._api.is_disconnect(exc):
            known = self._peers.get(peer)
            if known is not None:
                known.dead_reason = f"disconnected: {exc}"
            return f"{what}: peer {peer!r} disconnected ({type(exc).__name__}: {exc})"
        return f"{what} from {peer!r}: {type(exc).__name__}: {exc}"

    def _finish(self, handle: int) -> None:
        read = self._reads.pop(handle)
        self._release(read.xfer)

    def _release(self, xfer: Any) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except self._api.errors as exc:
            # A transfer that cannot be cancelled (peer gone mid-flight) keeps
            # its handle; NIXL's wrapper retries the release at agent teardown.
            log.debug("could not release NIXL transfer handle: %s", exc)

    def _forget_peer(self, name: str, reason: str) -> None:
        peer = self._peers.pop(name)
        for handle, read in list(self._reads.items()):
            if read.peer == name:
                self._early_failed[handle] = f"read from {name!r} abandoned: {reason}"
                self._finish(handle)
        for dlist in peer.dlists.values():
            self._release_dlist(dlist)  # before the peer goes: NIXL lists refer to its metadata
        self._invalidate(name)

    def _invalidate(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except self._api.errors as exc:
            log.debug("could not remove NIXL peer %s: %s", name, exc)

    def _drop_tier(self, tier: int) -> None:
        old = self._tiers.pop(tier, None)
        if old is None:
            return
        for handle, read in list(self._reads.items()):
            if read.tier == tier:
                self._early_failed[handle] = f"local tier {tier} was re-registered or closed"
                self._finish(handle)
        if old.dlist is not None:
            self._release_dlist(old.dlist)
        try:
            self._agent.deregister_memory(old.reg_descs)
        except self._api.errors as exc:
            log.debug("could not deregister tier %s: %s", tier, exc)
