"""Digest tables of verified bytes: a digest per (block, layer), the table's entries, the reader's check.

The digest function itself: test_multilinear.py."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvbroker.engine_adapter.digests import CRC32, ENTRY_BYTES, BlockBytes, DigestTable, check, stamp_of
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
    holder = cpu_backend_kv_caches(seed=1)
    reader = cpu_backend_kv_caches(seed=None)
    table = DigestTable(24, [0, 1, 2])
    table.state(block_bytes_of(holder), [2, 3, 9], HASHES)
    # The reader's inbox gets the entries at its own ids, as a NIXL read puts them.
    inbox = DigestTable(24, [0, 1, 2])
    inbox.entries[[10, 11, 12]] = table.entries[[2, 3, 9]]
    for name in holder:
        reader[name][[10, 11, 12]] = holder[name][[2, 3, 9]]
    local = block_bytes_of(reader)
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
