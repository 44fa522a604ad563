"""Verified bytes, overlapped with the read: a large verified load is read in groups of blocks,
and each group is digested on a thread of its own as soon as it has landed, while the next is read.

A check after the whole read costs at least one more pass over the bytes (a third of the read
on a CPU host, docs/data_path.md "Its cost"). Here the reader's worker issues the NIXL read of
group k+1 while a digest thread reads group k, so what the check adds to the pull is about the
last group's digest plus a NIXL transfer per extra group, not the digest of everything.

Without NIXL's progress thread a transfer moves only while its owner calls into its agent; on
one host UCX copies inside ``transfer()`` (cma), on the worker's thread, so the overlap needs the
digest to run on another thread without the GIL: the DRAM digest is compiled ``nogil``, the
VRAM digest is torch ops, which release it too. Groups are digested in order on one thread.

The digests are of the reader's own blocks after the group's reads ended; nothing else writes
those blocks until the load is reported, so they equal what a check after the whole read would
compute. The comparison with the holder's entries is unchanged (``digests.check``, given the
digests): a mismatch in any group fails the load, which the scheduler then recomputes, and the
lease is never committed on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import numpy as np

from kvbroker.engine_adapter.digests import BlockBytes

# The last group is the first below this many bytes (its digest is what stays exposed); a load
# smaller than twice this is read whole and checked after. Each group is a NIXL transfer of its
# own (about 0.15 ms here): too many and the transfers cost what the overlap saves.
MIN_GROUP_BYTES = 4 << 20
MAX_GROUPS = 8
# How long a check waits for the digests of groups that have all landed (one group's digest).
DIGEST_WAIT_S = 30.0


@dataclass(frozen=True)
class OverlapPolicy:
    """How a verified load is cut into groups (tests make groups of a few blocks).

    Each group is half of what is left: the first digest (half the load) has the whole second
    half's read to finish in, a digest pass being about twice as fast as the read here; the last
    group, whose digest follows the read, is small."""

    min_group_bytes: int = MIN_GROUP_BYTES
    max_groups: int = MAX_GROUPS

    def groups(self, blocks: int, bytes_per_block: int) -> list[range]:
        """Consecutive groups of block positions; one group: no overlap (check after the read)."""
        bounds = [0]
        left = blocks
        while (
            left > 1 and left * bytes_per_block >= 2 * self.min_group_bytes and len(bounds) < self.max_groups
        ):
            bounds.append(bounds[-1] + left // 2)
            left -= left // 2
        bounds.append(blocks)
        return [range(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


@dataclass
class GroupDigests:
    """One load's local digests, group by group: a group is digested once all its reads ended."""

    source: BlockBytes
    local_block_ids: Sequence[int]
    layers: list[int]
    groups: list[range]
    executor: Executor
    _left: list[int] = field(default_factory=list)  # reads of each group not ended yet
    _group_of: dict[int, int] = field(default_factory=dict)  # read handle -> group
    _futures: dict[int, Future[np.ndarray]] = field(default_factory=dict)
    failed: bool = False

    def __post_init__(self) -> None:
        self._left = [0] * len(self.groups)

    def add_read(self, group: int, handle: int) -> None:
        self._left[group] += 1
        self._group_of[handle] = group

    def read_ended(self, handle: int, ok: bool) -> None:
        """A read of this load ended; when its group's last one did, the group's digest starts."""
        group = self._group_of.pop(handle, None)
        if group is None:
            return
        if not ok:
            self.cancel()
            return
        self._left[group] -= 1
        if self._left[group] == 0 and not self.failed:
            ids = [self.local_block_ids[i] for i in self.groups[group]]
            self._futures[group] = self.executor.submit(self.source.digests, ids, self.layers)

    def result(self, timeout: float = DIGEST_WAIT_S) -> np.ndarray:
        """uint32 [blocks, layers]: every group's digests, in block order (waits for the last)."""
        if self.failed or len(self._futures) != len(self.groups):
            raise ValueError("not every group of the load was read")
        parts = [self._futures[g].result(timeout) for g in range(len(self.groups))]
        return np.concatenate(parts, axis=0) if parts else np.zeros((0, len(self.layers)), np.uint32)

    def cancel(self) -> None:
        """The load failed: digests not started are dropped (their results would not be used)."""
        self.failed = True
        for f in self._futures.values():
            f.cancel()

    def pending(self) -> int:
        """Groups whose digest is still queued or running."""
        return sum(1 for f in self._futures.values() if not f.done())
