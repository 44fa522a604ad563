"""Descriptor math of a read (engine_adapter/xfer_descs.py): pieces, coalescing, spans."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvbroker.engine_adapter.kv_regions import Region
from kvbroker.engine_adapter.xfer_descs import (
    Pieces,
    PreppedIndices,
    RegionTable,
    Span,
    block_pieces,
    block_rows,
    coalesce,
    registered_spans,
)

PAGE = 64
LAYERS = 4
BLOCKS = 16


def lbhnc(base: int) -> list[Region]:
    """Layer-compact (vLLM 0.32 CPU): a layer's blocks are adjacent pages, layers one after another."""
    return [Region(layer, base + layer * BLOCKS * PAGE, PAGE, PAGE) for layer in range(LAYERS)]


def blhnc(base: int) -> list[Region]:
    """Block-outermost: a block's layers are adjacent pages."""
    return [Region(layer, base + layer * PAGE, LAYERS * PAGE, PAGE) for layer in range(LAYERS)]


def kv_split(bases: list[int]) -> list[Region]:
    """K and V apart, one allocation per layer ([2, blocks, ...]): two regions per layer."""
    return [
        Region(layer, bases[layer] + kv * BLOCKS * PAGE // 2, PAGE // 2, PAGE // 2)
        for layer in range(LAYERS)
        for kv in (0, 1)
    ]


def table(regions: list[Region], spans: list[Span] | None = None) -> RegionTable:
    return RegionTable.of(regions, registered_spans(regions, BLOCKS) if spans is None else spans)


def pieces(
    local: list[Region],
    remote: list[Region],
    local_ids: list[int],
    remote_ids: list[int],
    local_spans: list[Span] | None = None,
    remote_spans: list[Span] | None = None,
) -> Pieces:
    mine, theirs = table(local, local_spans), table(remote, remote_spans)
    return block_pieces(mine, theirs, np.array(local_ids), np.array(remote_ids))


def merged(regions: list[Region], local_ids: list[int], remote_ids: list[int], local_base: int = 0) -> Pieces:
    mine = [Region(r.layer, r.base_addr + local_base, r.block_stride, r.block_bytes) for r in regions]
    return coalesce(pieces(mine, regions, local_ids, remote_ids))


def test_a_piece_per_region_and_block() -> None:
    p = pieces(lbhnc(0), lbhnc(1 << 20), [3, 4], [7, 9])
    assert len(p) == LAYERS * 2 and p.nbytes == LAYERS * 2 * PAGE
    assert p.local[:2].tolist() == [3 * PAGE, 4 * PAGE]
    assert p.remote[:2].tolist() == [(1 << 20) + 7 * PAGE, (1 << 20) + 9 * PAGE]


def test_sequential_blocks_are_one_piece_per_layer_in_a_layer_compact_layout() -> None:
    p = merged(lbhnc(0), list(range(5, 9)), list(range(2, 6)), local_base=1 << 20)
    assert len(p) == LAYERS
    assert p.length.tolist() == [4 * PAGE] * LAYERS


def test_sequential_blocks_are_one_piece_in_a_block_outermost_layout() -> None:
    p = merged(blhnc(0), list(range(5, 9)), list(range(2, 6)), local_base=1 << 20)
    assert len(p) == 1 and p.nbytes == 4 * LAYERS * PAGE


def test_k_and_v_apart_merge_within_each_region_only() -> None:
    bases = [i << 16 for i in range(LAYERS)]  # separate allocations
    p = merged(kv_split(bases), [1, 2, 3], [4, 5, 6], local_base=1 << 24)
    assert len(p) == 2 * LAYERS and p.length.tolist() == [3 * PAGE // 2] * (2 * LAYERS)


def test_runs_break_where_either_side_jumps() -> None:
    # local 0,1,2,3 but remote 0,1,5,6: two runs per layer
    p = merged(lbhnc(0), [0, 1, 2, 3], [0, 1, 5, 6], local_base=1 << 20)
    assert len(p) == 2 * LAYERS
    # scattered: nothing merges
    assert len(merged(lbhnc(0), [9, 1, 5], [0, 7, 3], local_base=1 << 20)) == 3 * LAYERS


def test_no_merge_across_registered_spans() -> None:
    """Adjacent bytes in two registrations stay two descriptors (NIXL checks each against one)."""
    regions = lbhnc(0)
    ids = [BLOCKS - 1, 0]
    one_span = registered_spans(regions, BLOCKS)
    assert len(one_span) == 1
    per_layer = [(*r.span(BLOCKS), 0) for r in regions]
    both = coalesce(pieces(regions, regions, ids, ids, local_spans=one_span, remote_spans=one_span))
    assert len(both) == LAYERS + 1  # last block of l + first of l+1
    assert (
        len(coalesce(pieces(regions, regions, ids, ids, local_spans=per_layer, remote_spans=one_span)))
        == 2 * LAYERS
    )
    assert (
        len(coalesce(pieces(regions, regions, ids, ids, local_spans=one_span, remote_spans=per_layer)))
        == 2 * LAYERS
    )
    # A piece in no known span never merges either.
    assert (
        len(coalesce(pieces(regions, regions, ids, ids, local_spans=[], remote_spans=one_span))) == 2 * LAYERS
    )


def test_devices_never_merge() -> None:
    a = Region(0, 0, PAGE, PAGE, device_id=0)
    b = Region(1, BLOCKS * PAGE, PAGE, PAGE, device_id=1)
    assert len(registered_spans([a, b], BLOCKS)) == 2
    assert len(coalesce(pieces([a, b], [a, b], [BLOCKS - 1, 0], [BLOCKS - 1, 0]))) == 4


def test_registered_spans_join_touching_and_overlapping_regions() -> None:
    assert registered_spans(lbhnc(100), BLOCKS) == [(100, 100 + LAYERS * BLOCKS * PAGE, 0)]
    assert registered_spans(blhnc(100), BLOCKS) == [(100, 100 + LAYERS * BLOCKS * PAGE, 0)]
    bases = [i << 16 for i in range(LAYERS)]
    assert len(registered_spans(kv_split(bases), BLOCKS)) == LAYERS


def test_mismatched_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="regions"):
        pieces(lbhnc(0), lbhnc(0)[:2], [0], [0])
    with pytest.raises(ValueError, match="blocks"):
        pieces(lbhnc(0), lbhnc(0), [0, 1], [0])
    other = [Region(r.layer, r.base_addr, r.block_stride, PAGE // 2) for r in lbhnc(0)]
    with pytest.raises(ValueError, match="bytes per block"):
        pieces(lbhnc(0), other, [0], [0])


@pytest.mark.parametrize("layout", ["lbhnc", "blhnc", "kv_split"])
def test_coalesced_pieces_move_exactly_the_same_bytes(layout: str) -> None:
    """Random block sets, really copied: the merged pieces give what one piece per block gives."""
    rng = np.random.default_rng(3)
    size = LAYERS * BLOCKS * PAGE
    src = np.frombuffer(rng.bytes(size), dtype=np.uint8).copy()
    for trial in range(40):
        n = int(rng.integers(1, BLOCKS + 1))
        if trial % 2:  # runs, like a fresh engine's allocations
            local = list(range(int(rng.integers(0, BLOCKS - n + 1)), BLOCKS))[:n]
            remote = list(range(int(rng.integers(0, BLOCKS - n + 1)), BLOCKS))[:n]
        else:
            local = rng.choice(BLOCKS, n, replace=False).tolist()
            remote = rng.choice(BLOCKS, n, replace=False).tolist()
        want = np.zeros(size, dtype=np.uint8)
        got = np.zeros(size, dtype=np.uint8)
        s, w, g = (arr.ctypes.data for arr in (src, want, got))

        def regions(base: int) -> list[Region]:
            if layout == "lbhnc":
                return lbhnc(base)
            if layout == "blhnc":
                return blhnc(base)
            return kv_split([base + i * BLOCKS * PAGE for i in range(LAYERS)])

        plain = pieces(regions(w), regions(s), local, remote)
        coalesced = coalesce(pieces(regions(g), regions(s), local, remote))
        assert len(coalesced) <= len(plain) and coalesced.nbytes == plain.nbytes
        for p in (plain, coalesced):
            for la, ra, n_bytes in zip(p.local.tolist(), p.remote.tolist(), p.length.tolist(), strict=True):
                ctypes.memmove(la, ra, n_bytes)
        assert want.any() and np.array_equal(want, got)


@pytest.mark.parametrize(
    ("local_layout", "remote_layout"),
    [
        ("lbhnc", "lbhnc"),
        ("blhnc", "blhnc"),
        ("kv_split", "kv_split"),
        ("blhnc", "lbhnc"),
        ("lbhnc", "blhnc"),
    ],
)
def test_prepped_indices_name_the_rows_of_the_blocks_read(local_layout: str, remote_layout: str) -> None:
    """Row i of each side's prepared list is the same piece as block_pieces' i-th, in the same order."""

    def regions(layout: str, base: int) -> list[Region]:
        if layout == "lbhnc":
            return lbhnc(base)
        if layout == "blhnc":
            return blhnc(base)
        return kv_split([base + i * BLOCKS * PAGE for i in range(LAYERS)])

    mine, theirs = table(regions(local_layout, 1 << 20)), table(regions(remote_layout, 1 << 30))
    rows = list(range(len(mine.base)))[1:]  # a subset of layers, as a layer range reads
    block_major = not mine.dense
    indices = PreppedIndices.of((mine, BLOCKS, rows), (theirs, BLOCKS, rows), block_major)
    local_ids, remote_ids = np.array([3, 7, 0, 15]), np.array([9, 1, 11, 2])  # nothing adjacent on both
    local_idx, remote_idx = indices(np.stack((local_ids, remote_ids)).astype(np.int32))
    assert local_idx.dtype == np.int32 and remote_idx.dtype == np.int32
    want = block_pieces(mine.take(rows), theirs.take(rows), local_ids, remote_ids)  # region-major
    order = np.arange(len(want)).reshape(len(rows), len(local_ids))
    order = (order.T if block_major else order).ravel()
    local_rows, remote_rows = block_rows(mine, BLOCKS)[local_idx], block_rows(theirs, BLOCKS)[remote_idx]
    assert local_rows[:, 0].tolist() == want.local[order].tolist()
    assert remote_rows[:, 0].tolist() == want.remote[order].tolist()
    assert local_rows[:, 1].tolist() == want.length[order].tolist() == remote_rows[:, 1].tolist()
