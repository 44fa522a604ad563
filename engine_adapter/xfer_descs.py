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
class Pieces:
    """Parallel arrays: piece i copies `length[i]` bytes from `remote[i]` to `local[i]`."""

    local: np.ndarray  # uint64 addresses
    remote: np.ndarray  # uint64 addresses
    length: np.ndarray  # uint64 byte counts
    local_dev: np.ndarray  # uint64 device ids
    remote_dev: np.ndarray  # uint64 device ids

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


def block_pieces(
    local_regions: Sequence[Region],
    remote_regions: Sequence[Region],
    local_ids: np.ndarray,
    remote_ids: np.ndarray,
) -> Pieces:
    """One piece per (region pair, block): remote block `remote_ids[i]` of `remote_regions[k]`
    lands in local block `local_ids[i]` of `local_regions[k]`. Regions are paired by position."""
    if len(local_regions) != len(remote_regions):
        raise ValueError(f"{len(local_regions)} local regions but {len(remote_regions)} remote regions")
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks but {len(remote_ids)} remote blocks")
    n, r = len(local_ids), len(local_regions)
    lids = np.asarray(local_ids, dtype=np.uint64)
    rids = np.asarray(remote_ids, dtype=np.uint64)

    def column(regions: Sequence[Region], attr: str) -> np.ndarray:
        return np.array([getattr(x, attr) for x in regions], dtype=np.uint64)[:, None]

    for a, b in zip(local_regions, remote_regions, strict=True):
        if a.block_bytes != b.block_bytes:
            raise ValueError(
                f"layer {a.layer}: {a.block_bytes} local bytes per block, {b.block_bytes} remote"
            )
    shape = (r, n)
    return Pieces(
        local=(
            column(local_regions, "base_addr") + lids[None, :] * column(local_regions, "block_stride")
        ).ravel(),
        remote=(
            column(remote_regions, "base_addr") + rids[None, :] * column(remote_regions, "block_stride")
        ).ravel(),
        length=np.broadcast_to(column(local_regions, "block_bytes"), shape).ravel().copy(),
        local_dev=np.broadcast_to(column(local_regions, "device_id"), shape).ravel().copy(),
        remote_dev=np.broadcast_to(column(remote_regions, "device_id"), shape).ravel().copy(),
    )


def coalesce(pieces: Pieces, local_spans: Sequence[Span], remote_spans: Sequence[Span]) -> Pieces:
    """Merge pieces that continue each other on both sides and share a span on each side.

    Pieces are ordered by local address first. `*_spans` are the registered
    [start, end) ranges per device (`registered_spans`); a piece outside every
    span is left alone (NIXL will refuse it with a precise error).
    """
    if len(pieces) <= 1:
        return pieces
    order = np.lexsort((pieces.local, pieces.local_dev))
    p = Pieces(*(getattr(pieces, f)[order] for f in ("local", "remote", "length", "local_dev", "remote_dev")))
    lspan = _span_ids(p.local, p.local_dev, local_spans)
    rspan = _span_ids(p.remote, p.remote_dev, remote_spans)
    follows = (
        (p.local[1:] == p.local[:-1] + p.length[:-1])
        & (p.remote[1:] == p.remote[:-1] + p.length[:-1])
        & (p.local_dev[1:] == p.local_dev[:-1])
        & (p.remote_dev[1:] == p.remote_dev[:-1])
        & (lspan[1:] == lspan[:-1])
        & (rspan[1:] == rspan[:-1])
        & (lspan[1:] >= 0)
        & (rspan[1:] >= 0)
    )
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return Pieces(
        local=p.local[starts],
        remote=p.remote[starts],
        length=np.add.reduceat(p.length, starts).astype(np.uint64),
        local_dev=p.local_dev[starts],
        remote_dev=p.remote_dev[starts],
    )


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
    """Index of the span holding each address (-1: none). Spans do not overlap per device."""
    out = np.full(len(addr), -1, dtype=np.int64)
    for i, (start, end, d) in enumerate(spans):
        inside = (dev == d) & (addr >= start) & (addr < end)
        out[inside] = i
    return out
