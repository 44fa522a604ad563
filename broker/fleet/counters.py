"""The fleet's counters: what Stats counts (leases released, revocations by cause), summed over
every broker replica in the shared store.

Each replica counts in memory as the in-memory broker does (its own Prometheus
series stay its own) and, every FLUSH_S, adds what it counted since its last
flush to one hash in the store (`{fleet}:counters`), in one script. Stats on
any replica answers the store's totals plus that replica's part not flushed
yet, so a replica's own counts show at once and the others' within FLUSH_S.

A flush is numbered, and the script remembers the last number it applied for
each replica (`{fleet}:counted:<replica>`, kept for a day), so a flush whose
answer was lost is retried without counting twice. What a replica counted in
its last FLUSH_S before a kill -9 is missing from the fleet's totals; a
graceful stop flushes first. A store restarted empty starts the totals over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

from kvbroker.broker.errors import BrokerError
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.results import Stats
from kvbroker.common.model import LeaseState

log = logging.getLogger("kvbroker")

FLUSH_S = 0.5
RELEASED = "released"
REVOKED = "revoked:"  # + the cause's label

# KEYS: the totals, this replica's last applied flush.  ARGV: flush number, then field, amount pairs.
_ADD = """
local seq = tonumber(ARGV[1])
if tonumber(redis.call('GET', KEYS[2]) or '0') >= seq then return 0 end
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('SET', KEYS[2], seq, 'EX', 86400)
return 1
"""


class FleetCounters:
    def __init__(self, state: RedisState, replica: str, counted: Callable[[], dict[str, int]]) -> None:
        """`counted`: this replica's counts since it started (field -> count), as they stand now."""
        self._state = state
        self._counted = counted
        self._keys = [f"{state.prefix}:{{fleet}}:counters", f"{state.prefix}:{{fleet}}:counted:{replica}"]
        self._add = state.script(_ADD)
        self._flushed: dict[str, int] = {}  # what this replica has handed to a flush
        self._seq = 0
        self._batch: dict[str, int] = {}  # the flush in flight (sent, not acknowledged)

    def flush(self) -> None:
        """Add this replica's new counts to the fleet's (BrokerError: the store is away; retry later)."""
        if not self._batch:
            now = self._counted()
            delta = {k: n - self._flushed.get(k, 0) for k, n in now.items() if n != self._flushed.get(k, 0)}
            if not delta:
                return
            self._seq += 1
            self._batch, self._flushed = delta, now
        args: list[str | int] = [self._seq]
        for field, n in self._batch.items():
            args += [field, n]
        self._state.call(self._add, keys=self._keys, args=args)
        self._batch = {}

    def totals(self) -> dict[str, int]:
        """The fleet's counts: the store's, plus what this replica has not flushed yet."""
        stored = self._state.call(self._state.client.hgetall, self._keys[0])
        out = {k.decode(): int(v) for k, v in stored.items()}
        for field, n in self._counted().items():
            out[field] = out.get(field, 0) + n - self._flushed.get(field, 0)
        for field, n in self._batch.items():
            out[field] = out.get(field, 0) + n
        return out

    def stats(self, local: Stats) -> Stats:
        """`local` (this replica's Stats) with the fleet's released and revoked counts."""
        totals = self.totals()
        causes = {cause: totals.get(REVOKED + cause, 0) for cause in local.revocations_by_cause}
        causes.update({k.removeprefix(REVOKED): n for k, n in totals.items() if k.startswith(REVOKED)})
        by_state = dict(local.leases_by_state)
        by_state[LeaseState.RELEASED.label] = totals.get(RELEASED, 0)
        by_state[LeaseState.REVOKED.label] = sum(causes.values())
        return replace(local, leases_by_state=by_state, revocations_by_cause=causes)

    async def run(self) -> None:
        """Flush every FLUSH_S until cancelled, then once more."""
        try:
            while True:
                await asyncio.sleep(FLUSH_S)
                try:
                    self.flush()
                except BrokerError as err:
                    log.debug("counters not flushed: %s", err)
        finally:
            try:
                self.flush()
            except BrokerError as err:
                log.warning("this replica's last counts did not reach the fleet's totals: %s", err)


def core_counts(revocations: dict[str, int], released: Callable[[], int]) -> Callable[[], dict[str, int]]:
    """A core's counts as the store's fields (it keeps them in its `revocations` and `released_total`)."""

    def counted() -> dict[str, int]:
        out = {REVOKED + cause: n for cause, n in revocations.items()}
        out[RELEASED] = released()
        return out

    return counted
