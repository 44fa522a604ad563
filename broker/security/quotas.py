"""Per-tenant and per-identity quotas: request rate, streams, sessions, leases, indexed blocks.

Each check raises ResourceExhausted (cause quota_exceeded) with the limit and
its flag in the message, so one tenant or identity using up its share gets
told, while every other one keeps its own: nothing here is shared between
tenants. The counts come from the broker's own state (live sessions, leases,
index) where it has them, so they cannot drift; only the rate buckets and
open streams are kept here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvbroker.broker.errors import QuotaExceeded
from kvbroker.broker.security.config import SecurityConfig
from kvbroker.broker.security.identity import Identity


class _Bucket:
    __slots__ = ("stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


def _take(buckets: dict[Any, _Bucket], key: Any, rate: float, burst: float, now: float, calls: int) -> bool:
    """Take `calls` tokens from `key`'s bucket (refilled at `rate`, holding up to `burst`); False if short."""
    bucket = buckets.get(key)
    if bucket is None:
        bucket = buckets[key] = _Bucket(burst, now)
    bucket.tokens = min(burst, bucket.tokens + (now - bucket.stamp) * rate)
    bucket.stamp = now
    if bucket.tokens < calls:
        return False
    bucket.tokens -= calls
    return True


class Quotas:
    def __init__(
        self,
        config: SecurityConfig,
        clock: Callable[[], float] = time.monotonic,
        stream_slots: Mapping[str, int] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self._buckets: dict[Identity, _Bucket] = {}
        self._tenant_buckets: dict[str, _Bucket] = {}
        self._streams: dict[Identity, int] = {}
        # The broker's slots per stream method ({"Mirror": --max-mirrors, "Watch": --max-watchers})
        # and how many of each every tenant holds: a tenant takes at most its share.
        self.stream_slots = dict(stream_slots or {})
        self._tenant_streams: dict[tuple[str, str], int] = {}

    # -- per identity ---------------------------------------------------------------

    def spend(self, who: Identity, calls: int = 1, *, tenant: bool = True) -> None:
        """One call (or session message) of `who`: refused beyond --quota-rate (with --quota-burst)
        for the identity, or (`tenant`) beyond --quota-tenant-rate for its whole tenant."""
        now = self.clock()
        rate = self.config.quota_rate
        burst = float(max(1, self.config.quota_burst))
        if rate > 0 and not _take(self._buckets, who, rate, burst, now, calls):
            raise QuotaExceeded(
                f"{who} made more than {rate:g} calls per second (quota --quota-rate {rate:g}, "
                f"--quota-burst {int(burst)}); slow down",
                metadata={"identity": who.uri, "limit": f"{rate:g}/s"},
            )
        tenant_rate = self.config.quota_tenant_rate if tenant else 0.0
        if tenant_rate > 0 and not _take(
            self._tenant_buckets, who.tenant, tenant_rate, tenant_rate, now, calls
        ):
            raise QuotaExceeded(
                f"tenant {who.tenant!r} made more than {tenant_rate:g} calls per second, all its identities "
                f"together (quota --quota-tenant-rate {tenant_rate:g}); {who} must wait",
                metadata={"tenant": who.tenant, "limit": f"{tenant_rate:g}/s"},
            )

    def open_stream(self, who: Identity, method: str) -> None:
        limit = self.config.quota_streams
        count = self._streams.get(who, 0)
        if limit and count >= limit:
            raise QuotaExceeded(
                f"{who} has {count} Watch/Mirror streams open, its quota (--quota-streams {limit}); "
                f"close one before opening a {method}",
                metadata={"identity": who.uri, "limit": str(limit)},
            )
        share = self.tenant_slots(method)
        held = self._tenant_streams.get((who.tenant, method), 0)
        if share and held >= share:
            raise QuotaExceeded(
                f"tenant {who.tenant!r} holds {held} of the broker's {self.stream_slots[method]} {method} "
                f"slots, its share (--quota-tenant-slots {self.config.quota_tenant_slots:g}); {who} must "
                f"close one first, so that other tenants keep theirs",
                metadata={"tenant": who.tenant, "limit": str(share)},
            )
        self._streams[who] = count + 1
        self._tenant_streams[(who.tenant, method)] = held + 1

    def tenant_slots(self, method: str) -> int:
        """Most `method` streams one tenant may hold (0: no limit)."""
        slots = self.stream_slots.get(method, 0)
        share = self.config.quota_tenant_slots
        if not slots or share <= 0:
            return 0
        return max(1, math.floor(slots * share))

    def close_stream(self, who: Identity, method: str = "") -> None:
        count = self._streams.get(who, 0) - 1
        if count > 0:
            self._streams[who] = count
        else:
            self._streams.pop(who, None)
        key = (who.tenant, method)
        held = self._tenant_streams.get(key, 0) - 1
        if held > 0:
            self._tenant_streams[key] = held
        else:
            self._tenant_streams.pop(key, None)

    # -- per tenant -----------------------------------------------------------------

    def check_sessions(self, who: Identity, live_in_tenant: int) -> None:
        limit = self.config.quota_sessions
        if limit and live_in_tenant >= limit:
            raise QuotaExceeded(
                f"tenant {who.tenant!r} has {live_in_tenant} live sessions, its quota "
                f"(--quota-sessions {limit}); {who} cannot open another",
                metadata={"tenant": who.tenant, "limit": str(limit)},
            )

    def check_leases(self, who: Identity, live_in_tenant: int) -> None:
        limit = self.config.quota_leases
        if limit and live_in_tenant >= limit:
            raise QuotaExceeded(
                f"tenant {who.tenant!r} has {live_in_tenant} live leases, its quota "
                f"(--quota-leases {limit}); release or let some end before holding more",
                metadata={"tenant": who.tenant, "limit": str(limit)},
            )

    def check_blocks(self, who: Identity, indexed_in_tenant: int, adding: int) -> None:
        limit = self.config.quota_blocks
        if limit and adding and indexed_in_tenant + adding > limit:
            raise QuotaExceeded(
                f"tenant {who.tenant!r} has {indexed_in_tenant} indexed blocks; {adding} more would pass "
                f"its quota (--quota-blocks {limit}); announce removals first",
                metadata={"tenant": who.tenant, "limit": str(limit)},
            )
