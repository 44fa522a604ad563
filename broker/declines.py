"""Declines that came before their hold: remembered briefly so the hold is refused.

A router gets P's answer (and passes it on to D) before P's hold reaches the
broker, so "nobody will read this hold" can arrive first. The book keeps such
early declines for ``keep_s`` seconds, at most ``capacity`` of them (the
oldest go first), so a hostile caller can cost memory but never unbounded.
"""

from __future__ import annotations

from collections import OrderedDict


class DeclineBook:
    def __init__(self, *, keep_s: float = 60.0, capacity: int = 65_536) -> None:
        self._keep_s = keep_s
        self._capacity = capacity
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def add(self, holder: str, request_id: str, now: float) -> None:
        self._forget_old(now)
        key = (holder, request_id)
        self._until.pop(key, None)
        self._until[key] = now + self._keep_s
        while len(self._until) > self._capacity:
            self._until.popitem(last=False)

    def take(self, holder: str, request_id: str, now: float) -> bool:
        """True (once) if this hold was declined before it arrived."""
        self._forget_old(now)
        return self._until.pop((holder, request_id), None) is not None

    def _forget_old(self, now: float) -> None:
        # Entries are in insertion order and all keep the same time, so the old ones lead.
        while self._until:
            key, until = next(iter(self._until.items()))
            if until > now:
                return
            del self._until[key]
