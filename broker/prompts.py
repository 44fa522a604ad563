"""A prompt as the broker names it: its chain of block hashes, given as hashes or as token ids.

Score and Retain take either; token ids are hashed here the way the engines of
the namespace's layout hash them (their registered block size and hash
algorithm, the tenant as vLLM's cache_salt), so the chain agrees with theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbroker.broker.checks import Checks
from kvbroker.broker.errors import InvalidArgument, NotFound, shown
from kvbroker.broker.observed import ObservedRegistry
from kvbroker.common.causes import Cause
from kvbroker.common.model import Namespace


def prompt_chain(
    registry: ObservedRegistry, check: Checks, ns: Namespace, hashes: Sequence[int], token_ids: Sequence[int]
) -> Sequence[int]:
    """`hashes`, or the chain of the full blocks of `token_ids` (not both); checked against --max-hashes."""
    if hashes and token_ids:
        raise InvalidArgument("give either block_hashes or token_ids, not both")
    check.hashes(len(hashes), "block_hashes")
    if not token_ids:
        return hashes
    fp = registry.find_fingerprint(ns.layout_id)
    if fp is None:
        raise NotFound(
            f"no engine has registered layout_id {shown(ns.layout_id)}; cannot hash token ids",
            Cause.UNKNOWN_LAYOUT,
        )
    check.hashes(len(token_ids) // fp.block_size, "token_ids (in blocks)")
    from kvbroker.common.hashing import wire_chain  # imported late: written by the clients area

    return wire_chain(token_ids, fp.block_size, fp.hash_algo or "sha256", ns.tenant or None)
