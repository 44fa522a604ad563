"""What every read between one local tier and one peer's regions shares, worked out once.

A read names the peer's regions, a local tier and the layers to move. Which
local region receives which peer region, and where each block's descriptor
sits in the prepared NIXL lists, are the same from one read to the next of a
conversation. `BlockMover` keeps a `ReadPlan` per (local tier, peer regions,
peer tier size, memory type, layers), so a read converts its block ids once
and adds them to precomputed offsets: a handful of numpy operations instead
of the Python loops that made up a third of a 1 MB read.

Caller mistakes raise ValueError here, with the same messages whether or not
a plan was cached: a plan is stored only after its layers matched.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbroker.engine_adapter.kv_regions import Region
from kvbroker.engine_adapter.xfer_descs import PreppedIndices, RegionTable, registered_spans


@dataclass
class ReadPlan:
    """The fixed part of the reads from one peer region list into one local tier."""

    tier: Any  # the BlockMover's local tier record the plan was made for (identity is checked)
    local_rows: list[int]  # local region rows, layer by layer
    peer_rows: list[int]  # the peer's matching region rows, same order
    # Prepared lists and where the plan's blocks sit in them (local list, peer list, indices),
    # made on the first small read; None where no list can be prepared (too large).
    prepped: tuple[Any, Any, PreppedIndices] | None = None
    prepped_tried: bool = False


def match_layers(
    local_regions: Sequence[Region],
    regions_of_layer: dict[int, list[int]],
    peer_regions: Sequence[Region],
    layers: Iterable[int],
) -> tuple[list[int], list[int]]:
    """(local rows, peer rows) of `layers`, paired region by region; ValueError where they differ."""
    peer_by_layer: dict[int, list[int]] = {}
    for i, r in enumerate(peer_regions):
        peer_by_layer.setdefault(r.layer, []).append(i)
    local_idx: list[int] = []
    peer_idx: list[int] = []
    for layer in layers:
        mine = regions_of_layer.get(layer)
        theirs = peer_by_layer.get(layer)
        if mine is None:
            raise ValueError(f"layer {layer} is not in the local tier (have {sorted(regions_of_layer)})")
        if theirs is None:
            raise ValueError(f"layer {layer} is not in the peer's regions (have {sorted(peer_by_layer)})")
        if len(mine) != len(theirs):
            raise ValueError(f"layer {layer}: {len(mine)} local regions but {len(theirs)} peer regions")
        for a, b in zip(mine, theirs, strict=True):
            if local_regions[a].block_bytes != peer_regions[b].block_bytes:
                raise ValueError(
                    f"layer {layer}: local blocks are {local_regions[a].block_bytes} bytes, "
                    f"peer blocks {peer_regions[b].block_bytes} bytes (layouts differ)"
                )
        local_idx.extend(mine)
        peer_idx.extend(theirs)
    return local_idx, peer_idx


def block_ids(
    local: Sequence[int], remote: Sequence[int], local_blocks: int, peer_blocks: int | None
) -> np.ndarray:
    """The ids of a read as one (2, n) array, local then remote, checked against the tier sizes.

    This runs on every read, just after the previous read's copy has emptied the CPU's caches,
    where each numpy call costs several microseconds. So the usual case (two lists or two tuples
    of ints) is one C-level conversion to unsigned 32-bit ints, which refuses negative, huge and
    non-integer ids by itself, and the builtin max of each side. Anything else, and every
    mistake, goes the careful way, which words the error."""
    if (
        _U32
        and type(local) is type(remote)
        and type(local) in (list, tuple)
        and len(local) == len(remote)
        and len(local)
    ):
        try:
            buf = array.array(_U32, local + remote)  # type: ignore[operator]
        except (OverflowError, TypeError):
            pass
        else:
            if max(local) < local_blocks and (peer_blocks is None or max(remote) < peer_blocks):
                return np.frombuffer(buf, dtype=np.uint32).reshape(2, -1)
    return _checked_ids(local, remote, local_blocks, peer_blocks)


# array.array's type code for 32-bit unsigned ints ("" where the platform has none).
_U32 = next((code for code in "IL" if array.array(code).itemsize == 4), "")


def _checked_ids(
    local: Sequence[int], remote: Sequence[int], local_blocks: int, peer_blocks: int | None
) -> np.ndarray:
    """`block_ids` for any input, as int64; ValueError that says what is wrong."""
    lids, rids = _as_ids(local, "local_block_ids"), _as_ids(remote, "remote_block_ids")
    if len(lids) != len(rids):
        raise ValueError(f"{len(rids)} remote blocks but {len(lids)} local blocks")
    if len(lids) and int(lids.max()) >= local_blocks:
        raise ValueError(f"local block {int(lids.max())} >= tier size {local_blocks}")
    if peer_blocks is not None and len(rids) and int(rids.max()) >= peer_blocks:
        raise ValueError(f"remote block {int(rids.max())} >= peer tier size {peer_blocks}")
    return np.stack((lids, rids))


def _as_ids(ids: Sequence[int], what: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(arr) and int(arr.min()) < 0:
        raise ValueError(f"{what} contains a negative block id")
    return arr


def peer_table(cache: dict[Any, RegionTable], regions: Sequence[Region], num_blocks: int) -> RegionTable:
    """A peer's regions as columns, with what it registered (a BlockMover registers exactly
    `registered_spans`); kept in `cache` per region list."""
    key = (tuple(regions), num_blocks)
    table = cache.get(key)
    if table is None:
        if len(cache) > 64:  # a peer re-registered often: keep the cache small
            cache.clear()
        table = cache[key] = RegionTable.of(regions, registered_spans(regions, num_blocks))
    return table
