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


def _sums(bases, strides, words, block_ids, k_lo, k_hi, out):  # type: ignore[no-untyped-def]
    """out[i, j] = the unfolded sum of block block_ids[i] of layer j (pieces of layer j: row j)."""
    # Layer-major, so that consecutive blocks of a layer are consecutive in memory.
    n_blocks, n_layers, n_pieces = block_ids.shape[0], bases.shape[0], bases.shape[1]
    for j in range(n_layers):
        for i in range(n_blocks):
            acc = np.uint64(0)
            at = 0
            for p in range(n_pieces):
                n = words[j, p]
                if n == 0:
                    continue
                w = numba.carray(_words_at(np.uint64(bases[j, p] + block_ids[i] * strides[j, p])), (n,))
                kl, kh = k_lo[at : at + n], k_hi[at : at + n]  # slices: indices known >= 0, it vectorizes
                for x in range(n):
                    v = w[x]
                    # The keys are below 2**32: masking them says so, and 32x32->64 multiplies it is.
                    acc += (v & _LO32) * (kl[x] & _LO32) + (v >> _S32) * (kh[x] & _LO32)
                at += n
            out[i, j] = acc


try:
    sums = numba.njit(nogil=True, cache=True)(_sums)
except RuntimeError:  # no writable place for numba's cache: compile in each process instead
    sums = numba.njit(nogil=True)(_sums)
