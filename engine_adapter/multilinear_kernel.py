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

_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


@intrinsic  # type: ignore[misc]
def _words_at(typingctx: Any, addr: Any) -> Any:
    """A uint64 pointer to an address (the regions' memory, read in place)."""
    sig = types.CPointer(types.uint64)(addr)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint64)))

    return sig, codegen


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
            v = w[x]
            # The keys are below 2**32: masking them says so, and 32x32->64 multiplies it is.
            acc += (v & _LO32) * (kl[x] & _LO32) + (v >> _S32) * (kh[x] & _LO32)
        at += n
    return acc


def _sums(bases, strides, words, block_ids, k_lo, k_hi, out):  # type: ignore[no-untyped-def]
    """out[i, j] = the unfolded sum of block block_ids[i] of layer j (pieces of layer j: row j)."""
    # Layer-major, so that consecutive blocks of a layer are consecutive in memory.
    for j in range(bases.shape[0]):
        for i in range(block_ids.shape[0]):
            out[i, j] = entry(bases, strides, words, j, block_ids[i], k_lo, k_hi)


def _pair_sums(bases, strides, words, block_ids, layers, k_lo, k_hi, out):  # type: ignore[no-untyped-def]
    """out[i] = the unfolded sum of block block_ids[i] of layer layers[i] (a sampled check's)."""
    for i in range(block_ids.shape[0]):
        out[i] = entry(bases, strides, words, layers[i], block_ids[i], k_lo, k_hi)


def _compile(f: Any, **kw: Any) -> Any:
    try:
        return numba.njit(nogil=True, cache=True, **kw)(f)
    except RuntimeError:  # no writable place for numba's cache: compile in each process instead
        return numba.njit(nogil=True, **kw)(f)


entry = _compile(_entry, inline="always")
sums = _compile(_sums)
pair_sums = _compile(_pair_sums)
