"""Descriptor math of a read (engine_adapter/xfer_descs.py): pieces, coalescing, spans."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvbroker.engine_adapter.kv_regions import Region
from kvbroker.engine_adapter.xfer_descs import Pieces, block_pieces, coalesce, registered_spans

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


def merged(regions: list[Region], local_ids: list[int], remote_ids: list[int], local_base: int = 0) -> Pieces:
    mine = [Region(r.layer, r.base_addr + local_base, r.block_stride, r.block_bytes) for r in regions]
    spans = registered_spans(regions, BLOCKS)
    local_spans = registered_spans(mine, BLOCKS)
    return coalesce(
        block_pieces(mine, regions, np.array(local_ids), np.array(remote_ids)), local_spans, spans
    )


def test_a_piece_per_region_and_block() -> None:
    p = block_pieces(lbhnc(0), lbhnc(1 << 20), np.array([3, 4]), np.array([7, 9]))
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
    pieces = block_pieces(regions, regions, np.array([BLOCKS - 1, 0]), np.array([BLOCKS - 1, 0]))
    one_span = registered_spans(regions, BLOCKS)
    assert len(one_span) == 1
    per_layer = [(*r.span(BLOCKS), 0) for r in regions]
    assert len(coalesce(pieces, one_span, one_span)) == LAYERS + 1  # last block of l + first of l+1
    assert len(coalesce(pieces, per_layer, one_span)) == 2 * LAYERS
    assert len(coalesce(pieces, one_span, per_layer)) == 2 * LAYERS


def test_devices_never_merge() -> None:
    a = Region(0, 0, PAGE, PAGE, device_id=0)
    b = Region(1, BLOCKS * PAGE, PAGE, PAGE, device_id=1)
    spans = registered_spans([a, b], BLOCKS)
    assert len(spans) == 2
    pieces = block_pieces([a, b], [a, b], np.array([BLOCKS - 1, 0]), np.array([BLOCKS - 1, 0]))
    assert len(coalesce(pieces, spans, spans)) == 4


def test_registered_spans_join_touching_and_overlapping_regions() -> None:
    assert registered_spans(lbhnc(100), BLOCKS) == [(100, 100 + LAYERS * BLOCKS * PAGE, 0)]
    assert registered_spans(blhnc(100), BLOCKS) == [(100, 100 + LAYERS * BLOCKS * PAGE, 0)]
    bases = [i << 16 for i in range(LAYERS)]
    assert len(registered_spans(kv_split(bases), BLOCKS)) == LAYERS


def test_mismatched_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="regions"):
        block_pieces(lbhnc(0), lbhnc(0)[:2], np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="blocks"):
        block_pieces(lbhnc(0), lbhnc(0), np.array([0, 1]), np.array([0]))
    other = [Region(r.layer, r.base_addr, r.block_stride, PAGE // 2) for r in lbhnc(0)]
    with pytest.raises(ValueError, match="bytes per block"):
        block_pieces(lbhnc(0), other, np.array([0]), np.array([0]))


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

        plain = block_pieces(regions(w), regions(s), np.array(local), np.array(remote))
        coalesced = coalesce(
            block_pieces(regions(g), regions(s), np.array(local), np.array(remote)),
            registered_spans(regions(g), BLOCKS),
            registered_spans(regions(s), BLOCKS),
        )
        assert len(coalesced) <= len(plain) and coalesced.nbytes == plain.nbytes
        for p in (plain, coalesced):
            for la, ra, n_bytes in zip(p.local.tolist(), p.remote.tolist(), p.length.tolist(), strict=True):
                ctypes.memmove(la, ra, n_bytes)
        assert want.any() and np.array_equal(want, got)
