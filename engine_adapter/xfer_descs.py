"""Descriptor math of a read: which bytes go where, in as few pieces as possible.

A read of N blocks x R regions is N x R (local address, remote address,
length) pieces. Pieces that continue each other on both sides (the next
block of a layer, or, in block-outermost layouts, the next layer of the same
block) are one piece to UCX, which pays a fixed cost per piece. `coalesce`
merges them, but never across the end of a registered span on either side:
NIXL checks every descriptor against one registration.

Pure numpy, no NIXL: the block mover builds its NIXL descriptor lists from
what these functions return, and unit tests check the arithmetic directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker.engine_adapter.kv_regions import Region

Span = tuple[int, int, int]  # [start, end) bytes on device


@dataclass(frozen=True)
class RegionTable:
    """Regions as columns (one row per region), with the registered span each lies in.

    Built once per local tier and per peer's region list, so a read costs a
    few array operations, not a Python loop over regions.
    """

    base: np.ndarray  # uint64
    stride: np.ndarray  # uint64
    nbytes: np.ndarray  # uint64
    dev: np.ndarray  # uint64
    span: np.ndarray  # int64: index into the spans given to `of` (-1: in none)
    dense: bool  # every region's blocks are back to back (block_stride == block_bytes)

    @classmethod
    def of(cls, regions: Sequence[Region], spans: Sequence[Span]) -> RegionTable:
        def col(attr: str) -> np.ndarray:
            return np.array([getattr(r, attr) for r in regions], dtype=np.uint64)

        base, dev, stride, nbytes = (
            col("base_addr"),
            col("device_id"),
            col("block_stride"),
            col("block_bytes"),
        )
        dense = bool(np.array_equal(stride, nbytes))
        return cls(base, stride, nbytes, dev, _span_ids(base, dev, spans), dense)

    def take(self, rows: Sequence[int]) -> RegionTable:
        idx = np.asarray(rows, dtype=np.int64)
        return RegionTable(
            self.base[idx], self.stride[idx], self.nbytes[idx], self.dev[idx], self.span[idx], self.dense
        )


@dataclass(frozen=True)
class Pieces:
    """Parallel arrays: piece i copies `length[i]` bytes from `remote[i]` to `local[i]`."""

    local: np.ndarray  # uint64 addresses
    remote: np.ndarray  # uint64 addresses
    length: np.ndarray  # uint64 byte counts
    local_dev: np.ndarray  # uint64 device ids
    remote_dev: np.ndarray  # uint64 device ids
    local_span: np.ndarray  # int64 registered span of the local side (-1: none known)
    remote_span: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def local_descs(self) -> np.ndarray:
        """NIXL's Nx3 (address, length, device) array for the local side."""
        return np.stack([self.local, self.length, self.local_dev], axis=1)

    def remote_descs(self) -> np.ndarray:
        return np.stack([self.remote, self.length, self.remote_dev], axis=1)

    def take(self, idx: np.ndarray) -> Pieces:
        return Pieces(*(getattr(self, f)[idx] for f in _FIELDS))


_FIELDS = ("local", "remote", "length", "local_dev", "remote_dev", "local_span", "remote_span")


def block_pieces(
    local: RegionTable, remote: RegionTable, local_ids: np.ndarray, remote_ids: np.ndarray
) -> Pieces:
    """Pieces region-major: remote block `remote_ids[i]` of remote region k lands in local
    block `local_ids[i]` of local region k. One piece per (region, block), or per (region,
    run of ids adjacent on both sides) when every region on both sides is dense."""
    if len(local.base) != len(remote.base):
        raise ValueError(f"{len(local.base)} local regions but {len(remote.base)} remote regions")
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks but {len(remote_ids)} remote blocks")
    if not np.array_equal(local.nbytes, remote.nbytes):
        raise ValueError(
            f"bytes per block differ: local {local.nbytes.tolist()}, remote {remote.nbytes.tolist()}"
        )
    lids = np.asarray(local_ids, dtype=np.int64)
    rids = np.asarray(remote_ids, dtype=np.int64)
    counts = np.ones(len(lids), dtype=np.uint64)
    if local.dense and remote.dense and len(lids) > 1:
        # Dense regions: a run of ids adjacent on both sides is one piece per region already.
        breaks = np.flatnonzero((np.diff(lids) != 1) | (np.diff(rids) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        counts = np.diff(np.append(starts, len(lids))).astype(np.uint64)
        lids, rids = lids[starts], rids[starts]
    n = len(lids)

    def each(column: np.ndarray) -> np.ndarray:
        return np.repeat(column, n)

    return Pieces(
        local=(local.base[:, None] + lids.astype(np.uint64)[None, :] * local.stride[:, None]).ravel(),
        remote=(remote.base[:, None] + rids.astype(np.uint64)[None, :] * remote.stride[:, None]).ravel(),
        length=(local.nbytes[:, None] * counts[None, :]).ravel(),
        local_dev=each(local.dev),
        remote_dev=each(remote.dev),
        local_span=each(local.span),
        remote_span=each(remote.span),
    )


def coalesce(pieces: Pieces) -> Pieces:
    """Merge pieces that continue each other on both sides within one registered span per side.

    Pieces come out ordered by local address (they usually are already).
    Pieces outside every known span (span -1) are left alone: NIXL refuses
    them with a precise error.
    """
    if len(pieces) <= 1:
        return pieces
    p = pieces
    if not bool(np.all(p.local[1:] >= p.local[:-1])):
        # Spans differ by device where addresses may repeat: span first, then address.
        p = p.take(np.lexsort((p.local, p.local_span)))
    follows = (
        (p.local[1:] == p.local[:-1] + p.length[:-1])
        & (p.remote[1:] == p.remote[:-1] + p.length[:-1])
        & (p.local_span[1:] == p.local_span[:-1])
        & (p.remote_span[1:] == p.remote_span[:-1])
        & (p.local_span[1:] >= 0)
        & (p.remote_span[1:] >= 0)
    )
    if not bool(follows.any()):
        return p
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    merged = p.take(starts)
    return Pieces(
        merged.local,
        merged.remote,
        np.add.reduceat(p.length, starts).astype(np.uint64),
        merged.local_dev,
        merged.remote_dev,
        merged.local_span,
        merged.remote_span,
    )


def block_rows(table: RegionTable, num_blocks: int) -> np.ndarray:
    """One (address, length, device) row per region and block, in memory order: region-major
    where each region's blocks are back to back, block-major in block-outermost layouts."""
    blocks = np.arange(num_blocks, dtype=np.uint64)
    addr = table.base[:, None] + blocks[None, :] * table.stride[:, None]
    length = np.broadcast_to(table.nbytes[:, None], addr.shape)
    dev = np.broadcast_to(table.dev[:, None], addr.shape)
    rows = np.stack([addr, length, dev], axis=2)  # region x block x 3
    return (rows if table.dense else rows.transpose(1, 0, 2)).reshape(-1, 3)


@dataclass(frozen=True)
class PreppedIndices:
    """Where the blocks of a read's regions sit in the prepared lists of both sides (each side's
    `block_rows(table, num_blocks)`), worked out once per (local tier, peer regions, layers) so
    that a read only adds its block ids: block `b` of the k-th region of side `s` (0 local,
    1 remote) is row `b * per_block[s] + offsets[s, k]`.

    Rows come out block-major or region-major, the same on both sides. NIXL merges descriptors
    that continue each other when their indices are consecutive, so the lists are laid out,
    and read in, memory order. Both sides are one numpy operation: a read's Python runs with
    caches the previous read's copy just emptied, where each call costs microseconds."""

    offsets: np.ndarray  # int32: (2, R, 1) region-major, (2, 1, R) block-major
    per_block: np.ndarray | None  # int32 (2, 1, 1); None where both sides are dense (1 and 1)
    block_major: bool

    @classmethod
    def of(cls, local: Side, remote: Side, block_major: bool) -> PreppedIndices:
        """`local` and `remote` are (table, blocks in its list, region rows read, in order)."""
        offsets, per_block = [], []
        for table, num_blocks, rows in (local, remote):
            r = np.asarray(rows, dtype=np.int64)
            offsets.append(r * num_blocks if table.dense else r)
            per_block.append(1 if table.dense else len(table.base))
        off = np.stack(offsets).astype(np.int32)
        mult = None if per_block == [1, 1] else np.array(per_block, dtype=np.int32).reshape(2, 1, 1)
        return cls(off[:, None, :] if block_major else off[:, :, None], mult, block_major)

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int32 rows of the blocks `ids` ((2, n) int32: local ids, remote ids) in every region:
        (local rows, remote rows). A prepared list stays below 2^31 rows."""
        b = ids[:, :, None] if self.block_major else ids[:, None, :]
        idx = (b if self.per_block is None else b * self.per_block) + self.offsets
        return idx[0].ravel(), idx[1].ravel()


Side = tuple[RegionTable, int, Sequence[int]]


def registered_spans(regions: Sequence[Region], num_blocks: int) -> list[Span]:
    """The [start, end) ranges a BlockMover registers for `regions` of `num_blocks` blocks:
    the union per device, so touching or overlapping regions register as one."""
    merged: list[Span] = []
    for start, end, dev in sorted(
        ((*r.span(num_blocks), r.device_id) for r in regions), key=lambda s: (s[2], s[0])
    ):
        if merged and merged[-1][2] == dev and start <= merged[-1][1]:
            prev = merged[-1]
            merged[-1] = (prev[0], max(prev[1], end), dev)
        else:
            merged.append((start, end, dev))
    return merged


def _span_ids(addr: np.ndarray, dev: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """Index of the span holding each address (-1: none)."""
    out = np.full(len(addr), -1, dtype=np.int64)
    for i, (start, end, d) in enumerate(spans):
        out[(dev == np.uint64(d)) & (addr >= np.uint64(start)) & (addr < np.uint64(end))] = i
    return out
