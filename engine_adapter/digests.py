"""Verified bytes: a digest per (block, layer), stated by the holder, checked by the reader.

The holder's worker keeps a **digest table** per tier: one 8-byte entry per
(block, local layer), ``stamp | digest << 32``. It fills a block's entries when
the block starts being held or pinned for a reader (``DigestSpec``): the digest
of the layer's bytes of that block (K then V where a layer has two regions),
and a stamp derived from the block's hash. The table is registered with NIXL
like a tier (``digest_tier``), one 8-byte "region" per layer, so a reader reads
a block's entries with the same ``BlockMover.start_read`` that reads the block,
into an **inbox** table of its own at its local block ids; the holder's
``TierInfo.digest_table`` says where the table is and which digest it holds.

The stamp ties an entry to the content it was computed for: an entry whose
stamp is not the lease's block's is from the block id's previous occupant, or
not stated yet (a reader may read before the holder's next step states it), and
is never taken as a digest of these bytes. A reader that sees such an entry
reads the entries again until its deadline; a matching stamp with another digest
is a mismatch. Each entry is written with one aligned 8-byte store, so a reader
never sees a new stamp beside an old digest.

The digest is ``multilinear32-v1`` (engine_adapter/multilinear.py): on DRAM one
compiled call digests every (block, layer) of a spec in place; on VRAM torch
integer ops on the tier's own tensors do it on the GPU. ``crc32`` (``zlib``, DRAM
only) is still computed for holders from before the digest was named on the wire.
"""

from __future__ import annotations

import ctypes
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbroker.engine_adapter import multilinear
from kvbroker.engine_adapter.kv_regions import Region

ENTRY_BYTES = 8
# A tier's digest table is registered with the BlockMover as tier `tier + DIGEST_TIER_OFFSET`;
# the reader's inbox (entries read from holders, at local block ids) as INBOX_TIER.
DIGEST_TIER_OFFSET = 1000
INBOX_TIER = 999
ALGORITHM = multilinear.ALGORITHM  # what this adapter states
CRC32 = "crc32"  # what adapters stated before TierInfo.digest_table (TierInfo.digest_regions)


def digest_tier(tier: int) -> int:
    return tier + DIGEST_TIER_OFFSET


def stamp_of(block_hash: int) -> int:
    """32 bits of a block's wire hash, never 0 (a table's never-stated entries are 0)."""
    h = int(block_hash) & 0xFFFFFFFFFFFFFFFF
    return ((h ^ (h >> 32)) & 0xFFFFFFFF) or 1


def stamps_of(block_hashes: Sequence[int]) -> np.ndarray:
    """uint32 [n]: ``stamp_of`` of each hash, in one numpy pass."""
    try:  # hashes as vLLM makes them (64-bit, not negative): one conversion
        h = np.array(block_hashes, dtype=np.uint64)
    except OverflowError:
        h = np.array([int(x) & 0xFFFFFFFFFFFFFFFF for x in block_hashes], dtype=np.uint64)
    s = ((h ^ (h >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    s[s == 0] = 1
    return s


class BlockBytes:
    """A tier's block bytes, per layer, read in place: their digests for many blocks at once.

    DRAM is read through its addresses; VRAM (and any memory, given `tensors`) through views
    of the tensors whose storage holds the regions, on their device."""

    def __init__(
        self, regions: Sequence[Region], num_blocks: int, mem_type: str = "DRAM", tensors: Iterable[Any] = ()
    ) -> None:
        self.num_blocks = num_blocks
        self.mem_type = mem_type
        pieces: dict[int, list[Region]] = {}
        for r in regions:
            pieces.setdefault(r.layer, []).append(r)
        self.layers = sorted(pieces)
        self._column = {layer: j for j, layer in enumerate(self.layers)}
        self._pieces = [pieces[layer] for layer in self.layers]
        self._crc_views: list[list[tuple[memoryview, int, int]]] | None = None
        self._in_place: multilinear.RegionDigester | None = None
        self._tensor_views: list[list[Any]] | None = None
        self._device_keys: dict[Any, Any] = {}
        # in_place_check's columns, per (inbox, layers): the inbox's and the digester's
        self._check_cols: dict[tuple[DigestTable, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}
        if mem_type == "DRAM":
            self._in_place = multilinear.RegionDigester(
                [[(r.base_addr, r.block_stride, r.block_bytes) for r in layer] for layer in self._pieces]
            )
        else:
            self._tensor_views = [
                [_block_view(r, num_blocks, list(tensors)) for r in p] for p in self._pieces
            ]

    def supports(self, algorithm: str) -> bool:
        return algorithm == ALGORITHM or (algorithm == CRC32 and self.mem_type == "DRAM")

    def digests(
        self, block_ids: Sequence[int], layers: Sequence[int], algorithm: str = ALGORITHM
    ) -> np.ndarray:
        """uint32 [len(block_ids), len(layers)]: the digests of those blocks' bytes, per layer."""
        if not self.supports(algorithm):
            raise ValueError(f"cannot compute {algorithm} digests of {self.mem_type}")
        cols = [self._column[layer] for layer in layers]
        if algorithm == CRC32:
            return self._crcs(block_ids, cols)
        if self._in_place is not None:
            return self._in_place.digests(block_ids, cols)
        return self._on_device(block_ids, cols)

    def pair_digests(
        self, block_ids: np.ndarray, layers: Sequence[int], algorithm: str = ALGORITHM
    ) -> np.ndarray:
        """uint32 [len(block_ids)]: the digest of block block_ids[i] of layer layers[i]."""
        if self._in_place is not None and algorithm == ALGORITHM:  # one compiled call
            return self._in_place.pair_digests(block_ids, np.array([self._column[x] for x in layers]))
        out = np.empty(len(block_ids), dtype=np.uint32)
        by_layer: dict[int, list[int]] = {}
        for i, layer in enumerate(layers):
            by_layer.setdefault(int(layer), []).append(i)
        for layer, rows in by_layer.items():  # one call per layer drawn (VRAM, CRC32)
            out[rows] = self.digests([int(block_ids[r]) for r in rows], [layer], algorithm)[:, 0]
        return out

    def in_place_check(
        self,
        inbox: DigestTable,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        layers: Sequence[int],
        sample: Sample,
    ) -> Check | None:
        """``check`` of a sample of ALGORITHM digests in one compiled call over DRAM and the
        inbox (no per-entry numpy: a pull's check runs with caches its read just emptied);
        None where that cannot be (VRAM, a table larger than the tier)."""
        if self._in_place is None or inbox.num_blocks > self.num_blocks:
            return None
        key = (inbox, tuple(layers))
        cols = self._check_cols.get(key)
        if cols is None:
            if len(self._check_cols) > 64:
                self._check_cols.clear()
            cols = self._check_cols[key] = (
                np.array([inbox.column(layer) for layer in layers], dtype=np.int64),
                np.array([self._column[layer] for layer in layers], dtype=np.int64),
            )
        _fits(sample, len(block_ids), len(layers))
        unstated, found = self._in_place.sampled_check(
            inbox.entries,
            np.asarray(block_ids, dtype=np.int64),
            cols[0],
            stamps_of(block_hashes).astype(np.uint64),
            sample.offsets,
            sample.k,
            cols[1],
        )
        result = Check(blocks=len(found))
        if unstated:
            result.unstated = {int(i) for i in np.flatnonzero(found < 0)}
            return result
        bad = np.flatnonzero(found > 0)
        result.mismatched = {int(i) for i in bad}
        if len(bad):
            result.first_mismatch = (int(bad[0]), layers[int(found[bad[0]]) - 1])
        return result

    def crc(self, block_id: int, layer: int) -> int:
        return int(self._crcs([block_id], [self._column[layer]])[0, 0])

    def _crcs(self, block_ids: Sequence[int], cols: Sequence[int]) -> np.ndarray:
        if self._crc_views is None:
            self._crc_views = [
                [(_bytes_at(r, self.num_blocks), r.block_stride, r.block_bytes) for r in p]
                for p in self._pieces
            ]
        out = np.empty((len(block_ids), len(cols)), dtype=np.uint32)
        for j, col in enumerate(cols):
            for i, b in enumerate(block_ids):
                crc = 0
                for view, stride, size in self._crc_views[col]:
                    crc = zlib.crc32(view[b * stride : b * stride + size], crc)
                out[i, j] = crc
        return out

    def _on_device(self, block_ids: Sequence[int], cols: Sequence[int]) -> np.ndarray:
        import torch

        assert self._tensor_views is not None
        sums = []
        ids: dict[Any, Any] = {}  # per device, copied there once
        for col in cols:
            views = self._tensor_views[col]
            at = ids.get(views[0].device)
            if at is None:
                at = ids[views[0].device] = torch.as_tensor(list(block_ids), dtype=torch.long).to(
                    views[0].device
                )
            sums.append(multilinear.tensor_sums([v[at] for v in views], self._device_keys))
        if not sums:
            return np.zeros((len(block_ids), 0), dtype=np.uint32)
        h = torch.stack(sums, dim=1).cpu().numpy().view(np.uint64)  # one device -> host copy
        return multilinear.fold(h)


def _bytes_at(r: Region, num_blocks: int) -> memoryview:
    start, end = r.span(num_blocks)
    return memoryview((ctypes.c_uint8 * (end - start)).from_address(start)).cast("B")


def _block_view(r: Region, num_blocks: int, tensors: list[Any]) -> Any:
    """uint8 [num_blocks, block_bytes] over the storage of the tensor that holds region `r`."""
    import torch

    if r.block_bytes % 8 or r.block_stride % 8:  # the same rule as on DRAM: both sides must digest it
        raise ValueError(f"{ALGORITHM} digests whole 8-byte words; a piece is {r.block_bytes} bytes")
    start, end = r.span(num_blocks)
    for t in tensors:
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if base <= start and end <= base + storage.nbytes():
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            return flat.as_strided((num_blocks, r.block_bytes), (r.block_stride, 1), start - base)
    raise ValueError(
        f"no KV tensor holds layer {r.layer}'s region at {start:#x}: {ALGORITHM} needs the tensors for "
        "memory the CPU cannot address"
    )


class DigestTable:
    """One 8-byte entry per (block, layer): ``stamp | digest << 32`` (0: never stated)."""

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
        digests = source.digests(block_ids, layers).astype(np.uint64)
        stamps = stamps_of(block_hashes).astype(np.uint64)
        cols = [self._column[layer] for layer in layers]
        for i, b in enumerate(block_ids):
            # One 8-byte store per entry: a reader sees the old entry or the new one, never half.
            self.entries[b, cols] = stamps[i] | (digests[i] << np.uint64(32))

    def column(self, layer: int) -> int:
        return self._column[layer]

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


@dataclass(frozen=True)
class Sample:
    """The entries a sampled check digests: of `layers` layers (positions in the check's list),
    block i's k, evenly spread from offsets[i]: ``(offsets[i] + t * layers // k) % layers``."""

    offsets: np.ndarray  # int64 [blocks], each in [0, layers)
    k: int
    layers: int

    def mask(self) -> np.ndarray:
        """bool [blocks, layers]: True where an entry is drawn."""
        spread = (np.arange(self.k) * self.layers) // self.k  # k distinct positions
        picked = (self.offsets[:, None] + spread) % self.layers
        mask = np.zeros((len(self.offsets), self.layers), dtype=bool)
        np.put_along_axis(mask, picked, True, axis=1)
        return mask


def draw_sample(blocks: int, layers: int, share: float, rng: np.random.Generator) -> Sample | None:
    """Which (block, layer) entries a sampled check digests; None: all.

    Each block gets k = ceil(share * layers) of its layers (at least one), evenly spread from an
    offset drawn afresh for each call and each block, so every layer of every block is drawn
    with probability k / layers, independently per block: a whole block that is wrong (another
    block's bytes, a stale occupant, a wrong layout) is always caught, and a fault in one layer of
    many blocks almost surely (in one layer of one block: with probability k / layers per pull)."""
    k = max(1, math.ceil(share * layers - 1e-9))
    if k >= layers or blocks == 0:
        return None
    return Sample(rng.integers(0, layers, size=blocks, dtype=np.int64), k, layers)


def check(
    inbox: DigestTable,
    local: BlockBytes,
    block_ids: Sequence[int],
    block_hashes: Sequence[int],
    layers: Iterable[int] | Mapping[int, str],
    actual: Callable[[], np.ndarray] | None = None,
    sample: Sample | None = None,
) -> Check:
    """Reader: compare the entries read into `inbox` at `block_ids` with the digests of the bytes
    those blocks now hold, for every layer in `layers` (a mapping: each layer's algorithm, as its
    holder stated it; default ALGORITHM). While any entry is unstated, only the stamps are looked
    at (the bytes are digested once, when all are stated). `actual`: those digests, computed
    already (uint32 [blocks, layers], layers in `layers`' order; engine_adapter/verify_overlap.py).
    `sample` (``draw_sample``): digest and compare only those entries (every stamp is still
    checked; on DRAM all in one compiled call)."""
    algorithm_of = dict(layers) if isinstance(layers, Mapping) else dict.fromkeys(layers, ALGORITHM)
    layers = list(algorithm_of)
    result = Check(blocks=len(block_ids))
    if not block_ids or not layers:
        return result
    if len(block_ids) != len(block_hashes):
        raise ValueError(f"{len(block_ids)} block ids for {len(block_hashes)} hashes")
    if sample is not None and set(algorithm_of.values()) == {ALGORITHM}:
        in_place = local.in_place_check(inbox, block_ids, block_hashes, layers, sample)
        if in_place is not None:
            return in_place
    entries = inbox.entries_of(block_ids, layers)
    stamps = (entries & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    stated = (entries >> np.uint64(32)).astype(np.uint32)
    expected = stamps_of(block_hashes)[:, None]
    fresh = stamps == expected
    result.unstated = {int(i) for i in np.nonzero(~fresh.all(axis=1))[0]}
    if result.unstated:
        return result
    algorithms = set(algorithm_of.values())
    if sample is not None:
        _fits(sample, *stated.shape)
        mask = sample.mask()
        actual_digests = _sampled(local, block_ids, layers, algorithm_of, mask, stated)
        fresh &= mask
    elif actual is not None:
        actual_digests = actual()
    elif len(algorithms) == 1:  # the usual case: one call for every block and layer
        actual_digests = local.digests(block_ids, layers, algorithms.pop())
    else:
        actual_digests = np.empty_like(stated)
        for algorithm in sorted(algorithms):
            cols = [j for j, layer in enumerate(layers) if algorithm_of[layer] == algorithm]
            actual_digests[:, cols] = local.digests(block_ids, [layers[j] for j in cols], algorithm)
    bad = fresh & (stated != actual_digests)
    for i, j in zip(*np.nonzero(bad), strict=True):
        result.mismatched.add(int(i))
        if result.first_mismatch is None:
            result.first_mismatch = (int(i), layers[int(j)])
    return result


def _fits(sample: Sample, blocks: int, layers: int) -> None:
    """A sample drawn for this check's blocks and layers (either path's check of it)."""
    if (len(sample.offsets), sample.layers) != (blocks, layers):
        raise ValueError(
            f"a sample of {len(sample.offsets)} blocks x {sample.layers} layers for "
            f"{blocks} blocks x {layers} layers"
        )


def _sampled(
    local: BlockBytes,
    block_ids: Sequence[int],
    layers: Sequence[int],
    algorithm_of: Mapping[int, str],
    mask: np.ndarray,
    stated: np.ndarray,
) -> np.ndarray:
    """The digests of the sampled entries (one call per algorithm); the rest hold the stated
    value, compared with nothing (``check`` masks them out)."""
    out = stated.copy()
    rows, cols = np.nonzero(mask)
    ids = np.asarray(block_ids, dtype=np.int64)[rows]
    for algorithm in sorted(set(algorithm_of.values())):
        at = np.array([algorithm_of[layers[c]] == algorithm for c in cols], dtype=bool)
        if at.any():
            drawn = [layers[c] for c in cols[at]]
            out[rows[at], cols[at]] = local.pair_digests(ids[at], drawn, algorithm)
    return out
