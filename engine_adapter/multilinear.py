"""The verified-bytes digest ``multilinear32-v1``: a multilinear hash of a block's 32-bit words.

For the 32-bit little-endian words ``w_0 .. w_{n-1}`` of one (block, layer) (K then V
where a layer has two regions), with fixed odd 32-bit keys ``k_i``::

    h = (w_0 * k_0 + w_1 * k_1 + ... + w_{n-1} * k_{n-1}) mod 2**64
    digest = ((h * FOLD) mod 2**64) >> 32

Why this one: it costs one 32x32->64 bit multiply and one add per word, which
vectorizes (``vpmuludq``) and runs at memory speed, several times faster than
``zlib.crc32`` here (bench/data_path/verify.py), and a GPU computes it with plain
integer tensor ops (no custom kernel). What it guarantees:

- every word counts: each product ``w_i * k_i`` is below 2**64 and a key is odd,
  so any change confined to one word (any number of bit flips in it) changes
  ``h``; so does swapping two different words (``(a - b)(k_i - k_j)`` is nonzero
  and below 2**64 in size: the keys are distinct);
- the 64 -> 32 bit fold is a multiply by an odd constant (a bijection of ``h``)
  keeping the high half, and the keys are checked (tests/engine_adapter/
  test_multilinear.py) so that a single flipped bit anywhere in the first
  ``CHECKED_WORDS`` words always changes the 32-bit digest;
- other changes (several words at once) go unseen with a chance of about
  2**-32, like any 32-bit digest. It is a checksum against corruption, not a MAC:
  the keys are public, so it does not resist someone who crafts bytes on purpose.

Both sides must compute the same function: the holder names it in
``TierInfo.digest_table.algorithm`` and a reader checks only digests it knows
(``ALGORITHM``; ``crc32`` for holders from before the name was on the wire).

Three implementations of one function: ``digest_words`` (numpy, a reference for
tests and fault injection), ``digest_regions`` (numba, zero-copy over raw
addresses: DRAM; many blocks and layers in one call, no per-entry Python) and
``digest_tensors`` (torch on any device: VRAM). Bytes must be whole 8-byte words
per region and block.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

ALGORITHM = "multilinear32-v1"
FOLD = 0x9E3779B97F4A7C15  # odd: multiplying by it permutes 64-bit values
CHECKED_WORDS = 1 << 18  # single-bit detection is tested for entries up to 1 MiB
_SEED = 0x4B56_4231  # part of the algorithm's definition, like FOLD and the multipliers


def _permute31(i: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random permutation of 31-bit integers (odd multiplies and xorshifts)."""
    m = np.uint64((1 << 31) - 1)
    with np.errstate(over="ignore"):
        x = ((i ^ np.uint64(_SEED)) & m) * np.uint64(0x2545F491) & m
        x ^= x >> np.uint64(15)
        x = x * np.uint64(0x5851F42D) & m
        x ^= x >> np.uint64(13)
        x = x * np.uint64(0x6C8E9CF5) & m
        return x ^ (x >> np.uint64(16))


@lru_cache(maxsize=8)
def _keys(words: int) -> np.ndarray:
    """uint64 [words]: distinct odd 32-bit keys; key i is the same for any `words` > i."""
    if words > 1 << 31:
        raise ValueError(f"{ALGORITHM} has keys for entries up to 8 GiB, not {words} words")
    return (_permute31(np.arange(words, dtype=np.uint64)) << np.uint64(1)) | np.uint64(1)


def keys(words: int) -> np.ndarray:
    """The first `words` keys (one per 32-bit word), read-only."""
    k = _keys(_rounded(words))[:words]
    k.flags.writeable = False
    return k


def _rounded(words: int) -> int:
    return 1 << max(10, (max(words, 1) - 1).bit_length())  # few distinct sizes for the cache


def fold(h: np.ndarray) -> np.ndarray:
    """uint64 sums -> uint32 digests."""
    with np.errstate(over="ignore"):
        return ((h.astype(np.uint64) * np.uint64(FOLD)) >> np.uint64(32)).astype(np.uint32)


def digest_words(data: bytes | np.ndarray) -> int:
    """The digest of one entry's bytes (numpy; the reference the fast paths are tested against)."""
    w = np.frombuffer(bytes(data), dtype="<u4").astype(np.uint64)
    with np.errstate(over="ignore"):
        h = np.sum(w * keys(len(w)), dtype=np.uint64)
    return int(fold(np.array([h]))[0])


# ----------------------------------------------------------------------------- DRAM: numba


def _kernel() -> Any:
    """The compiled kernel (engine_adapter/multilinear_kernel.py): numba is imported on first use."""
    from kvbroker.engine_adapter.multilinear_kernel import sums

    return sums


def _pair_kernel() -> Any:
    """The compiled kernel of (block, layer) pairs (a sampled check)."""
    from kvbroker.engine_adapter.multilinear_kernel import pair_sums

    return pair_sums


def _sampled_check_kernel() -> Any:
    from kvbroker.engine_adapter.multilinear_kernel import sampled_check

    return sampled_check


class RegionDigester:
    """Digests of many (block, layer) entries of DRAM regions in one call, reading them in place.

    `pieces[l]` is layer l's list of (base_addr, block_stride, block_bytes): block b of the
    piece is at base_addr + b * block_stride (one piece per layer, two where K and V are apart)."""

    def __init__(self, pieces: Sequence[Sequence[tuple[int, int, int]]]) -> None:
        width = max((len(p) for p in pieces), default=0)
        self.bases = np.zeros((len(pieces), width), dtype=np.int64)
        self.strides = np.zeros_like(self.bases)
        self.words = np.zeros_like(self.bases)
        for j, layer in enumerate(pieces):
            for p, (base, stride, size) in enumerate(layer):
                if size % 8 or base % 8 or stride % 8:
                    raise ValueError(f"{ALGORITHM} digests whole 8-byte words; a piece is {size} bytes")
                self.bases[j, p], self.strides[j, p], self.words[j, p] = base, stride, size // 8
        self._picked: dict[tuple[int, ...] | None, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        k = keys(2 * int(self.words.sum(axis=1).max(initial=0)))
        self._k_lo, self._k_hi = np.ascontiguousarray(k[0::2]), np.ascontiguousarray(k[1::2])

    def sums(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> np.ndarray:
        """uint64 [len(block_ids), len(layers)] (layers: positions in `pieces`; default all)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        key = None if layers is None else tuple(layers)
        picked = self._picked.get(key)
        if picked is None:
            rows = slice(None) if key is None else np.asarray(key, dtype=np.int64)
            picked = self._picked[key] = (self.bases[rows], self.strides[rows], self.words[rows])
        bases, strides, words = picked
        out = np.empty((len(ids), bases.shape[0]), dtype=np.uint64)
        _kernel()(bases, strides, words, ids, self._k_lo, self._k_hi, out)
        return out

    def digests(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> np.ndarray:
        """uint32 [len(block_ids), len(layers)]."""
        return fold(self.sums(block_ids, layers))

    def pair_digests(self, block_ids: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """uint32 [n]: the digest of block block_ids[i] of layer layers[i] (positions in `pieces`),
        in one call however many layers the pairs name (a sampled check's)."""
        ids = np.ascontiguousarray(block_ids, dtype=np.int64)
        cols = np.ascontiguousarray(layers, dtype=np.int64)
        if ids.shape != cols.shape or ids.ndim != 1:
            raise ValueError(f"{ids.shape} block ids for {cols.shape} layers")
        if cols.size and not 0 <= int(cols.min()) <= int(cols.max()) < self.bases.shape[0]:
            raise ValueError(f"layer positions out of 0..{self.bases.shape[0] - 1}")
        out = np.empty(ids.shape[0], dtype=np.uint64)
        _pair_kernel()(self.bases, self.strides, self.words, ids, cols, self._k_lo, self._k_hi, out)
        return fold(out)

    def sampled_check(
        self,
        entries: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        expected: np.ndarray,
        offsets: np.ndarray,
        k: int,
        layers: np.ndarray,
    ) -> tuple[int, np.ndarray]:
        """A reader's sampled check in one compiled call, on a digest table's `entries` (uint64
        [blocks, columns], ``stamp | digest << 32``): block rows[i]'s entries in columns `cols`
        must be stamped expected[i] (uint32), and for its k drawn positions j (from offsets[i],
        ``digests.Sample``) the digest of its bytes of layer position layers[j] must be the
        entry's. Returns (blocks unstated, found): found[i] is -1 (unstated), 0 (as stated) or
        1 + the least drawn j that differs. No bytes are digested while a block is unstated."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if offsets.shape != rows.shape or cols.shape != layers.shape or not 0 < k <= len(cols):
            raise ValueError(
                f"a sample of {offsets.shape} offsets, k={k}, for {rows.shape} blocks x {cols.shape} layers"
            )
        if layers.size and not 0 <= int(layers.min()) <= int(layers.max()) < self.bases.shape[0]:
            raise ValueError(f"layer positions out of 0..{self.bases.shape[0] - 1}")
        found = np.empty(len(rows), dtype=np.int64)
        unstated = _sampled_check_kernel()(
            entries,
            rows,
            cols,
            expected,
            offsets,
            k,
            self.bases,
            self.strides,
            self.words,
            layers,
            self._k_lo,
            self._k_hi,
            found,
        )
        if unstated < 0:
            raise ValueError(f"block ids outside the table's {entries.shape[0]} blocks")
        return int(unstated), found


# ----------------------------------------------------------------------------- any device: torch


def tensor_sums(pieces: Sequence[Any], device_keys: dict[Any, Any] | None = None) -> Any:
    """The unfolded sums of entries given as torch tensors, on their device: `pieces[p]` is piece
    p of every entry, uint8 [entries, piece_bytes] (K then V as two pieces). int64 [entries].

    Integer tensor ops only (a few passes over the bytes, on the tensors' device): a GPU computes
    it without a custom kernel. int64 products and sums wrap around as uint64 ones do."""
    import torch

    total = None
    at = 0
    for piece in pieces:
        words = piece.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [entries, n], zero-extended
        n = words.shape[1]
        k = _device_keys(at + n, piece.device, device_keys)[at : at + n]
        part = (words * k).sum(dim=1, dtype=torch.int64)
        total = part if total is None else total + part
        at += n
    if total is None:
        raise ValueError("no pieces to digest")
    return total


def digest_tensors(pieces: Sequence[Any]) -> np.ndarray:
    """uint32 [entries]: `tensor_sums` folded, on the host."""
    return fold(tensor_sums(pieces).cpu().numpy().view(np.uint64))


def _device_keys(words: int, device: Any, cache: dict[Any, Any] | None) -> Any:
    import torch

    have = None if cache is None else cache.get(device)
    if have is None or have.shape[0] < words:
        have = torch.from_numpy(keys(_rounded(words)).astype(np.int64)).to(device)
        if cache is not None:
            cache[device] = have
    return have
