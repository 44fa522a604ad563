"""Verified bytes: a CRC32 per (block, layer), stated by the holder, checked by the reader.

The holder's worker keeps a **digest table** per tier: one 8-byte entry per
(block, local layer), ``stamp | crc << 32``. It fills a block's entries when
the block starts being held or pinned for a reader (``DigestSpec``): the CRC32
of the layer's bytes of that block (K then V where a layer has two regions),
and a stamp derived from the block's hash. The table is registered with NIXL
like a tier (``digest_tier``), one 8-byte "region" per layer, so a reader reads
a block's entries with the same ``BlockMover.start_read`` that reads the block,
into an **inbox** table of its own at its local block ids; the holder's
``TierInfo.digest_regions`` says where the table is.

The stamp ties an entry to the content it was computed for: an entry whose
stamp is not the lease's block's is from the block id's previous occupant, or
not stated yet (a reader may read before the holder's next step states it), and
is never taken as a digest of these bytes. A reader that sees such an entry
reads the entries again until its deadline; a matching stamp with another CRC is
a mismatch. Each entry is written with one aligned 8-byte store, so a reader
never sees a new stamp beside an old CRC.

Bytes are read through zero-copy views of the regions' addresses, so this
works on memory the CPU can address (DRAM). ``zlib.crc32`` is the digest: it
is in the standard library, detects every error burst up to 32 bits, and runs
at about 2 GB/s on one core here (bench/data_path/verify.py measures it
against the read).
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbroker.engine_adapter.kv_regions import Region

ENTRY_BYTES = 8
# A tier's digest table is registered with the BlockMover as tier `tier + DIGEST_TIER_OFFSET`;
# the reader's inbox (entries read from holders, at local block ids) as INBOX_TIER.
DIGEST_TIER_OFFSET = 1000
INBOX_TIER = 999


def digest_tier(tier: int) -> int:
    return tier + DIGEST_TIER_OFFSET


def stamp_of(block_hash: int) -> int:
    """32 bits of a block's wire hash, never 0 (a table's never-stated entries are 0)."""
    h = int(block_hash) & 0xFFFFFFFFFFFFFFFF
    return ((h ^ (h >> 32)) & 0xFFFFFFFF) or 1


class BlockBytes:
    """Zero-copy views of a tier's regions (DRAM): the CRC32 of a block's bytes, per layer."""

    def __init__(self, regions: Sequence[Region], num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._pieces: dict[int, list[tuple[memoryview, int, int]]] = {}
        for r in regions:
            start, end = r.span(num_blocks)
            view = memoryview((ctypes.c_uint8 * (end - start)).from_address(start)).cast("B")
            self._pieces.setdefault(r.layer, []).append((view, r.block_stride, r.block_bytes))
        self.layers = sorted(self._pieces)

    def crc(self, block_id: int, layer: int) -> int:
        crc = 0
        for view, stride, size in self._pieces[layer]:
            at = block_id * stride
            crc = zlib.crc32(view[at : at + size], crc)
        return crc

    def crcs(self, block_ids: Sequence[int], layers: Sequence[int]) -> np.ndarray:
        """uint32 [len(block_ids), len(layers)]."""
        out = np.empty((len(block_ids), len(layers)), dtype=np.uint32)
        for j, layer in enumerate(layers):
            for i, b in enumerate(block_ids):
                out[i, j] = self.crc(b, layer)
        return out


class DigestTable:
    """One 8-byte entry per (block, layer): ``stamp | crc << 32`` (0: never stated)."""

    def __init__(self, num_blocks: int, layers: Sequence[int]) -> None:
        self.layers = list(layers)
        self._column = {layer: j for j, layer in enumerate(self.layers)}
        self.entries = np.zeros((num_blocks, len(self.layers)), dtype=np.uint64)

    @property
    def num_blocks(self) -> int:
        return int(self.entries.shape[0])

    def regions(self) -> list[Region]:
        """The table as regions, one per layer, for NIXL: block b of layer l is its entry."""
        base = int(self.entries.ctypes.data)
        stride = ENTRY_BYTES * len(self.layers)
        return [
            Region(layer, base + ENTRY_BYTES * j, stride, ENTRY_BYTES) for j, layer in enumerate(self.layers)
        ]

    def state(self, source: BlockBytes, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Holder: compute and publish the entries of `block_ids` (whose hashes these are)."""
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids for {len(block_hashes)} hashes")
        layers = [layer for layer in self.layers if layer in source.layers]
        crcs = source.crcs(block_ids, layers).astype(np.uint64)
        stamps = np.array([stamp_of(h) for h in block_hashes], dtype=np.uint64)
        cols = [self._column[layer] for layer in layers]
        for i, b in enumerate(block_ids):
            # One 8-byte store per entry: a reader sees the old entry or the new one, never half.
            self.entries[b, cols] = stamps[i] | (crcs[i] << np.uint64(32))

    def entries_of(self, block_ids: Sequence[int], layers: Sequence[int]) -> np.ndarray:
        return self.entries[np.ix_(list(block_ids), [self._column[layer] for layer in layers])]


@dataclass
class Check:
    """What the reader found comparing the bytes it read with the holder's entries."""

    blocks: int = 0
    # Positions (in the read's block list) whose entries were not (yet) stated for this content.
    unstated: set[int] = field(default_factory=set)
    # Positions whose entry was stated for this content and whose bytes differ: corrupt.
    mismatched: set[int] = field(default_factory=set)
    first_mismatch: tuple[int, int] | None = None  # (position, layer)

    @property
    def ok(self) -> bool:
        return not self.unstated and not self.mismatched


def check(
    inbox: DigestTable,
    local: BlockBytes,
    block_ids: Sequence[int],
    block_hashes: Sequence[int],
    layers: Iterable[int],
) -> Check:
    """Reader: compare the entries read into `inbox` at `block_ids` with the CRC32 of the bytes
    those blocks now hold, for every layer in `layers`. While any entry is unstated, only the
    stamps are looked at (the bytes are digested once, when all are stated)."""
    layers = list(layers)
    result = Check(blocks=len(block_ids))
    if not block_ids or not layers:
        return result
    if len(block_ids) != len(block_hashes):
        raise ValueError(f"{len(block_ids)} block ids for {len(block_hashes)} hashes")
    entries = inbox.entries_of(block_ids, layers)
    stamps = (entries & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    stated = (entries >> np.uint64(32)).astype(np.uint32)
    expected = np.array([stamp_of(h) for h in block_hashes], dtype=np.uint32)[:, None]
    fresh = stamps == expected
    result.unstated = {int(i) for i in np.nonzero(~fresh.all(axis=1))[0]}
    if result.unstated:
        return result
    actual = local.crcs(block_ids, layers)
    bad = fresh & (stated != actual)
    for i, j in zip(*np.nonzero(bad), strict=True):
        result.mismatched.add(int(i))
        if result.first_mismatch is None:
            result.first_mismatch = (int(i), layers[int(j)])
    return result
