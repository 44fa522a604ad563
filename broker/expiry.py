"""Expiry queue: a heap of (deadline, key) plus a map of each key's scheduled deadline.

Renewals do not touch the heap: the owner keeps the true deadline on its
record, and when an entry comes due the owner checks the record and
reschedules if it was extended. Entries for removed or rescheduled keys are
stale and skipped lazily when they reach the top.
"""

from __future__ import annotations

import heapq


class ExpiryQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._scheduled: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._scheduled)

    def schedule(self, key: str, deadline: float) -> None:
        self._scheduled[key] = deadline
        heapq.heappush(self._heap, (deadline, key))

    def remove(self, key: str) -> None:
        self._scheduled.pop(key, None)

    def pop_due(self, now: float, limit: int) -> list[str]:
        """Keys whose scheduled deadline is <= now, at most `limit`, removed from the queue."""
        due: list[str] = []
        heap = self._heap
        while heap and len(due) < limit and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            if self._scheduled.get(key) == deadline:
                del self._scheduled[key]
                due.append(key)
        return due
