"""The compiled DRAM kernel of ``multilinear32-v1`` (engine_adapter/multilinear.py explains the digest).

Imported only when a rank digests DRAM (numba is heavy to import). Module level, so that
numba's on-disk cache finds the same function in every process and compiles it once.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from kvbroker.engine_adapter.multilinear import FOLD

_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_FOLD = np.uint64(FOLD)


@intrinsic  # type: ignore[misc]
def _words_at(typingctx: Any, addr: Any) -> Any:
    """A uint64 pointer to an address (the regions' memory, read in place)."""
    sig = types.CPointer(types.uint64)(addr)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint64)))

    return sig, codegen


def _term(v, lo, hi):  # type: ignore[no-untyped-def]
    """One 64-bit word's term of the sum: its two 32-bit halves times their keys (keys below
    2**32: masking them says so, and 32x32->64 multiplies it is, which vectorize)."""
    return (v & _LO32) * (lo & _LO32) + (v >> _S32) * (hi & _LO32)


def _stream(bases, strides, js, bs, t, p, n):  # type: ignore[no-untyped-def]
    """The n words of piece p of block bs[t] of layer js[t], read in place."""
    return numba.carray(_words_at(np.uint64(bases[js[t], p] + bs[t] * strides[js[t], p])), (n,))


def _entry(bases, strides, words, j, block, k_lo, k_hi):  # type: ignore[no-untyped-def]
    """The unfolded sum of block `block` of layer j (its pieces: row j)."""
    acc = np.uint64(0)
    at = 0
    for p in range(bases.shape[1]):
        n = words[j, p]
        if n == 0:
            continue
        w = numba.carray(_words_at(np.uint64(bases[j, p] + block * strides[j, p])), (n,))
        kl, kh = k_lo[at : at + n], k_hi[at : at + n]  # slices: indices known >= 0, it vectorizes
        for x in range(n):
            acc += term(w[x], kl[x], kh[x])
        at += n
    return acc


def _eight(bases, strides, words, js, bs, k_lo, k_hi, out, o):  # type: ignore[no-untyped-def]
    """out[o + t] = the unfolded sum of block bs[t] of layer js[t], t < 8, whose layers' pieces
    are the sizes of row js[0]'s. Eight streams from memory at once: one entry at a time leaves
    the memory idle between its misses (a pull's check reads bytes no cache holds); eight read
    it two to three times as fast here. Eight named accumulators, not an array: they stay in
    registers."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.uint64(0)
    at = 0
    for p in range(bases.shape[1]):
        n = words[js[0], p]
        if n == 0:
            continue
        w0, w1 = stream(bases, strides, js, bs, 0, p, n), stream(bases, strides, js, bs, 1, p, n)
        w2, w3 = stream(bases, strides, js, bs, 2, p, n), stream(bases, strides, js, bs, 3, p, n)
        w4, w5 = stream(bases, strides, js, bs, 4, p, n), stream(bases, strides, js, bs, 5, p, n)
        w6, w7 = stream(bases, strides, js, bs, 6, p, n), stream(bases, strides, js, bs, 7, p, n)
        kl, kh = k_lo[at : at + n], k_hi[at : at + n]
        for x in range(n):
            lo, hi = kl[x], kh[x]
            a0, a1 = a0 + term(w0[x], lo, hi), a1 + term(w1[x], lo, hi)
            a2, a3 = a2 + term(w2[x], lo, hi), a3 + term(w3[x], lo, hi)
            a4, a5 = a4 + term(w4[x], lo, hi), a5 + term(w5[x], lo, hi)
            a6, a7 = a6 + term(w6[x], lo, hi), a7 + term(w7[x], lo, hi)
        at += n
    out[o], out[o + 1], out[o + 2], out[o + 3] = a0, a1, a2, a3
    out[o + 4], out[o + 5], out[o + 6], out[o + 7] = a4, a5, a6, a7


def _alike(words, a, b):  # type: ignore[no-untyped-def]
    """Layers a and b have pieces of the same sizes (``eight`` can read them together)."""
    for p in range(words.shape[1]):  # noqa: SIM110 (a loop numba compiles, not a generator)
        if words[a, p] != words[b, p]:
            return False
    return True


def _sums(bases, strides, words, block_ids, k_lo, k_hi, out):  # type: ignore[no-untyped-def]
    """out[i, j] = the unfolded sum of block block_ids[i] of layer j (pieces of layer j: row j)."""
    # Layer-major, so that consecutive blocks of a layer are consecutive in memory.
    n = block_ids.shape[0]
    column = np.empty(n, dtype=np.uint64)
    for j in range(bases.shape[0]):
        js = np.full(8, j, dtype=np.int64)
        i = 0
        while i + 7 < n:
            eight(bases, strides, words, js, block_ids[i : i + 8], k_lo, k_hi, column, i)
            i += 8
        for r in range(i, n):
            column[r] = entry(bases, strides, words, j, block_ids[r], k_lo, k_hi)
        out[:, j] = column


def _pair_sums(bases, strides, words, block_ids, layers, k_lo, k_hi, out):  # type: ignore[no-untyped-def]
    """out[i] = the unfolded sum of block block_ids[i] of layer layers[i] (a sampled check's),
    eight at a time where their layers are alike."""
    n = block_ids.shape[0]
    i = 0
    while i + 7 < n:
        js = layers[i : i + 8]
        same = True
        for t in range(1, 8):
            same = same and alike(words, js[0], js[t])
        if same:
            eight(bases, strides, words, js, block_ids[i : i + 8], k_lo, k_hi, out, i)
            i += 8
        else:
            out[i] = entry(bases, strides, words, js[0], block_ids[i], k_lo, k_hi)
            i += 1
    for r in range(i, n):
        out[r] = entry(bases, strides, words, layers[r], block_ids[r], k_lo, k_hi)


def _sampled_check(
    entries, rows, cols, expected, offsets, k, bases, strides, words, dcols, k_lo, k_hi, found
):  # type: ignore[no-untyped-def]
    """A sampled check in one pass (engine_adapter/digests.py, ``check``). For block rows[i]:
    found[i] = -1 if an entry entries[rows[i], cols[j]] of any layer j is not stamped
    expected[i]; else 1 + the least drawn layer j whose bytes' digest (digester row dcols[j])
    differs from the entry's, drawn: j = (offsets[i] + t * L // k) % L for t < k, L layers;
    else 0. While any block is unstated no bytes are digested. Returns the blocks unstated,
    or -1 for a row outside `entries`."""
    n, layers = rows.shape[0], cols.shape[0]
    unstated = 0
    for i in range(n):
        b = rows[i]
        if b < 0 or b >= entries.shape[0]:
            return -1
        found[i] = 0
        for j in range(layers):
            if entries[b, cols[j]] & _LO32 != expected[i]:
                found[i] = -1
                unstated += 1
                break
    if unstated:
        return unstated
    drawn = np.empty(n * k, dtype=np.int64)  # positions j in the check's layers
    blocks = np.empty(n * k, dtype=np.int64)
    for i in range(n):
        for t in range(k):
            drawn[i * k + t] = (offsets[i] + (t * layers) // k) % layers
            blocks[i * k + t] = rows[i]
    sums = np.empty(n * k, dtype=np.uint64)
    pair_sums(bases, strides, words, blocks, dcols[drawn], k_lo, k_hi, sums)
    for q in range(n * k):
        i, j = q // k, drawn[q]
        if (sums[q] * _FOLD) >> _S32 != entries[rows[i], cols[j]] >> _S32 and (
            found[i] == 0 or j + 1 < found[i]
        ):
            found[i] = j + 1
    return 0


def _compile(f: Any, **kw: Any) -> Any:
    try:
        return numba.njit(nogil=True, cache=True, **kw)(f)
    except RuntimeError:  # no writable place for numba's cache: compile in each process instead
        return numba.njit(nogil=True, **kw)(f)


term = _compile(_term, inline="always")
stream = _compile(_stream, inline="always")
entry = _compile(_entry, inline="always")
eight = _compile(_eight, inline="always")
alike = _compile(_alike, inline="always")
sums = _compile(_sums)
pair_sums = _compile(_pair_sums)
sampled_check = _compile(_sampled_check)
