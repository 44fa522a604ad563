"""Digest tables of verified bytes: a digest per (block, layer), the table's entries, the reader's check.

The digest function itself: test_multilinear.py."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvbroker.engine_adapter.digests import (
    CRC32,
    ENTRY_BYTES,
    BlockBytes,
    DigestTable,
    Sample,
    check,
    draw_sample,
    stamp_of,
)
from kvbroker.engine_adapter.kv_regions import regions_from_kv_caches
from kvbroker.engine_adapter.multilinear import digest_words
from tests.engine_adapter.kv_fixtures import LAYER_NAME, cpu_backend_kv_caches, legacy_split_kv_caches

HASHES = [0x1234_5678_9ABC_DEF0, 7, 2**64 - 1]


def block_bytes_of(kv: dict[str, torch.Tensor]) -> BlockBytes:
    regions, num_blocks, _ = regions_from_kv_caches(kv)
    return BlockBytes(regions, num_blocks)


def test_digest_is_that_of_the_layers_block_bytes_k_then_v() -> None:
    kv = cpu_backend_kv_caches(seed=3)
    source = block_bytes_of(kv)
    assert source.layers == [0, 1, 2]
    page = kv[LAYER_NAME.format(1)][5].contiguous().view(torch.uint8).numpy().tobytes()
    assert source.digests([5], [1])[0, 0] == digest_words(page)
    assert source.digests([5], [1], CRC32)[0, 0] == source.crc(5, 1) == zlib.crc32(page)
    split = legacy_split_kv_caches(seed=4)
    t = split[LAYER_NAME.format(0)]
    k, v = (t[i, 3].contiguous().view(torch.uint8).numpy().tobytes() for i in (0, 1))
    assert block_bytes_of(split).digests([3], [0])[0, 0] == digest_words(k + v)
    assert block_bytes_of(split).crc(3, 0) == zlib.crc32(v, zlib.crc32(k))


def test_many_blocks_and_layers_in_one_call_match_one_at_a_time() -> None:
    kv = cpu_backend_kv_caches(seed=5)
    source = block_bytes_of(kv)
    ids = [7, 0, 23, 7]
    together = source.digests(ids, [2, 0])
    one_by_one = [[source.digests([b], [layer])[0, 0] for layer in (2, 0)] for b in ids]
    assert together.tolist() == one_by_one and together.dtype == np.uint32
    assert source.digests([], [0, 1]).shape == (0, 2)


def test_stamps_are_32_bits_and_never_zero() -> None:
    assert all(0 < stamp_of(h) < 2**32 for h in HASHES)
    assert stamp_of(0) == 1 and stamp_of(2**32 + 1) == 1, "halves that cancel out still stamp"


def test_table_regions_address_each_entry() -> None:
    table = DigestTable(10, [4, 5, 6])
    regions = table.regions()
    assert [r.layer for r in regions] == [4, 5, 6]
    base = table.entries.ctypes.data
    for j, r in enumerate(regions):
        assert r.block_bytes == ENTRY_BYTES and r.block_stride == 3 * ENTRY_BYTES
        assert r.block_addr(7) == base + (7 * 3 + j) * ENTRY_BYTES


def test_stated_digests_check_out_and_a_flipped_byte_is_found() -> None:
    inbox, reader, local = _read_pair()
    found = check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2])
    assert found.ok and found.blocks == 3
    reader[LAYER_NAME.format(2)][11].view(torch.uint8).view(-1)[100] ^= 0x01  # one bit
    found = check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2])
    assert found.mismatched == {1} and found.first_mismatch == (1, 2) and not found.unstated
    # Only the layers this rank read are compared.
    assert check(inbox, local, [10, 11, 12], HASHES, [0, 1]).ok


def test_entries_of_other_content_or_never_stated_are_unstated_not_mismatched() -> None:
    holder = cpu_backend_kv_caches(seed=1)
    table = DigestTable(24, [0, 1, 2])
    source = block_bytes_of(holder)
    table.state(source, [2, 3], HASHES[:2])
    other_hash = [HASHES[0] + 1, HASHES[1]]
    found = check(table, source, [2, 3], other_hash, [0, 1, 2])
    assert found.unstated == {0} and not found.mismatched
    found = check(table, source, [4], [HASHES[2]], [0, 1, 2])
    assert found.unstated == {0}, "a zero entry was never stated"
    # A stated entry is one 8-byte word: stamp low, digest high.
    entry = int(table.entries[2, 1])
    assert entry & 0xFFFFFFFF == stamp_of(HASHES[0]) and entry >> 32 == source.digests([2], [1])[0, 0]


def test_each_layer_is_checked_with_the_algorithm_its_holder_named() -> None:
    """An older holder's CRC32 entries check out against CRC32 of the bytes, never against ours."""
    holder = cpu_backend_kv_caches(seed=1)
    source = block_bytes_of(holder)
    table = DigestTable(24, [0, 1, 2])
    table.state(source, [2, 3], HASHES[:2])
    crcs = source.digests([2, 3], [1], CRC32).astype(np.uint64)
    table.entries[[2, 3], 1] = (table.entries[[2, 3], 1] & np.uint64(0xFFFFFFFF)) | (
        crcs[:, 0] << np.uint64(32)
    )
    assert check(
        table, source, [2, 3], HASHES[:2], {0: "multilinear32-v1", 1: CRC32, 2: "multilinear32-v1"}
    ).ok
    found = check(table, source, [2, 3], HASHES[:2], [0, 1, 2])
    assert found.mismatched == {0, 1} and found.first_mismatch == (0, 1)


def test_mismatched_lengths_are_refused() -> None:
    table = DigestTable(4, [0])
    source = block_bytes_of(cpu_backend_kv_caches(num_layers=1, num_blocks=4, seed=1))
    with pytest.raises(ValueError, match="2 block ids for 1 hashes"):
        table.state(source, [0, 1], [5])
    with pytest.raises(ValueError, match="1 block ids for 2 hashes"):
        check(table, source, [0], [5, 6], [0])
    assert check(table, source, [], [], [0]).ok
    assert np.all(table.entries == 0)


def _mask(blocks: int, layers: int, share: float, rng: np.random.Generator) -> np.ndarray | None:
    drawn = draw_sample(blocks, layers, share, rng)
    return None if drawn is None else drawn.mask()


def test_a_sample_draws_its_share_of_each_block_s_layers_afresh_each_time() -> None:
    rng = np.random.default_rng(7)
    assert draw_sample(64, 30, 1.0, rng) is None and draw_sample(0, 30, 0.5, rng) is None
    first = _mask(64, 30, 0.125, rng)
    assert first is not None and first.shape == (64, 30) and first.dtype == bool
    assert (first.sum(axis=1) == 4).all(), "ceil(0.125 * 30) layers of every block"
    second = _mask(64, 30, 0.125, rng)
    assert second is not None and (first != second).any(), "drawn afresh"
    one = _mask(5, 3, 0.01, rng)
    assert one is not None and (one.sum(axis=1) == 1).all(), "at least one layer per block"
    # Every layer is drawn about as often (a fixed seed: the same counts every run).
    counts = sum(m for m in (_mask(64, 30, 0.125, rng) for _ in range(200)) if m is not None)
    per_layer = counts.sum(axis=0) / (200 * 64)
    assert per_layer.min() > 0.10 and per_layer.max() < 0.17
    spread = Sample(np.array([0, 29]), 4, 30).mask()
    assert np.flatnonzero(spread[0]).tolist() == [0, 7, 15, 22]
    assert np.flatnonzero(spread[1]).tolist() == [6, 14, 21, 29], "from the offset, wrapping around"


def _read_pair() -> tuple[DigestTable, dict[str, torch.Tensor], BlockBytes]:
    """Holder blocks 2, 3, 9 stated and read into the reader's 10, 11, 12; the reader's inbox
    holds the entries at its own ids, as a NIXL read puts them."""
    holder = cpu_backend_kv_caches(seed=1)
    reader = cpu_backend_kv_caches(seed=None)
    table = DigestTable(24, [0, 1, 2])
    table.state(block_bytes_of(holder), [2, 3, 9], HASHES)
    inbox = DigestTable(24, [0, 1, 2])
    inbox.entries[[10, 11, 12]] = table.entries[[2, 3, 9]]
    for name in holder:
        reader[name][[10, 11, 12]] = holder[name][[2, 3, 9]]
    return inbox, reader, block_bytes_of(reader)


@pytest.mark.parametrize("path", ["in place", "pairs"])
def test_a_sampled_check_digests_only_the_drawn_entries_and_finds_a_flip_there(path: str) -> None:
    """On DRAM the whole check is one compiled call (``in_place_check``); elsewhere (VRAM, read
    here through the tensors) the drawn entries are digested as pairs, in one call."""
    inbox, reader, local = _read_pair()
    if path == "pairs":
        regions, n, _ = regions_from_kv_caches(reader)
        local = BlockBytes(regions, n, "VRAM", reader.values())
    digested: list[list[tuple[int, int]]] = []
    real = local.pair_digests

    def counting(block_ids: np.ndarray, layers: list[int], algorithm: str = "multilinear32-v1") -> np.ndarray:
        digested.append(sorted(zip(block_ids.tolist(), layers, strict=True)))
        return real(block_ids, layers, algorithm)

    local.pair_digests = counting  # type: ignore[method-assign]
    mask = Sample(np.array([0, 2, 1]), 1, 3)  # block 10: layer 0, 11: layer 2, 12: layer 1
    assert check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2], sample=mask).ok
    if path == "pairs":
        assert digested == [[(10, 0), (11, 2), (12, 1)]], "the drawn entries only, in one call"
    else:
        assert digested == [], "no pairs: one call does the stamps, the digests and the comparison"
    # A flipped bit where the sample looks is found; where it does not, it is not.
    reader[LAYER_NAME.format(2)][11].view(torch.uint8).view(-1)[100] ^= 0x01
    found = check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2], sample=mask)
    assert found.mismatched == {1} and found.first_mismatch == (1, 2)
    other = Sample(np.array([0, 0, 1]), 1, 3)
    assert check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2], sample=other).ok
    # Stamps are checked for every entry, drawn or not; then no bytes are digested.
    kept, inbox.entries[12, 2] = inbox.entries[12, 2], 0
    digested.clear()
    assert check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2], sample=other).unstated == {2}
    assert digested == []
    inbox.entries[12, 2] = kept
    # Two blocks wrong: both found, the first one named.
    reader[LAYER_NAME.format(0)][10].view(torch.uint8).view(-1)[8] ^= 0x80
    found = check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2], sample=mask)
    assert found.mismatched == {0, 1} and found.first_mismatch == (0, 0)
    with pytest.raises(ValueError, match="a sample of 2 blocks x 3 layers for 3 blocks x 3 layers"):
        check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2], sample=Sample(np.array([0, 2]), 1, 3))


def test_the_one_call_check_finds_what_the_pairs_find() -> None:
    """Random draws and random flips: the compiled check and the pairs agree on every outcome."""
    inbox, reader, local = _read_pair()
    regions, n, _ = regions_from_kv_caches(reader)
    pairs = BlockBytes(regions, n, "VRAM", reader.values())
    rng = np.random.default_rng(11)
    names = sorted(reader)
    caught = 0
    for _ in range(40):
        block, name = int(rng.integers(10, 13)), names[int(rng.integers(0, len(names)))]
        flat = reader[name][block].view(torch.uint8).view(-1)
        at, bit = int(rng.integers(0, flat.numel())), 1 << int(rng.integers(0, 8))
        flat[at] ^= bit
        mask = draw_sample(3, 3, 0.34, rng)
        fused, paired = (
            check(inbox, b, [10, 11, 12], HASHES, [0, 1, 2], sample=mask) for b in (local, pairs)
        )
        assert (fused.mismatched, fused.first_mismatch) == (paired.mismatched, paired.first_mismatch)
        caught += bool(fused.mismatched)
        flat[at] ^= bit
    assert 5 < caught < 35, "a one-layer flip is found about a third of the time at a share of 1/3"
    assert check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2], sample=mask).ok


def test_a_wrong_block_is_caught_by_every_sampled_check() -> None:
    """Another block's bytes (a stale occupant, a wrong block id, a wrong layout) differ in every
    layer, so any draw finds them."""
    inbox, reader, local = _read_pair()
    for name in reader:
        reader[name][11] = reader[name][12]
    rng = np.random.default_rng(3)
    for _ in range(20):
        found = check(inbox, local, [10, 11, 12], HASHES, [0, 1, 2], sample=draw_sample(3, 3, 0.3, rng))
        assert found.mismatched == {1}


def test_pairs_digest_as_the_grid_does_on_every_path() -> None:
    for kv in (cpu_backend_kv_caches(seed=5), legacy_split_kv_caches(seed=6)):
        source = block_bytes_of(kv)
        first, last = source.layers[0], source.layers[-1]
        grid = source.digests([1, 4, 7], [first, last])
        ids, layers = np.array([7, 1, 4, 7]), [first, last, last, last]
        assert source.pair_digests(ids, layers).tolist() == [grid[2, 0], grid[0, 1], grid[1, 1], grid[2, 1]]
        regions, n, _ = regions_from_kv_caches(kv)
        through_tensors = BlockBytes(regions, n, "VRAM", kv.values())  # the torch path, on CPU tensors
        assert through_tensors.pair_digests(ids, layers).tolist() == source.pair_digests(ids, layers).tolist()
        crcs = source.digests([1, 7], [first, last], CRC32)
        assert source.pair_digests(np.array([7, 1]), [last, first], CRC32).tolist() == [
            crcs[1, 1],
            crcs[0, 0],
        ]
    assert source._in_place is not None
    with pytest.raises(ValueError, match="layer positions out of"):
        source._in_place.pair_digests(np.array([1]), np.array([5]))
