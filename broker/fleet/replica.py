"""One broker replica of a fleet that shares a Redis/Valkey: the fleet's parts, built in one place.

Each part gets what it works with when it is built, and nothing is wired
after that. The order follows what each one needs:

    SeenRecords         other replicas' engine records as read, and the replica serving each session
    RedisLeaseTable     the shared leases
    FleetNotifier       (seen, leases)      tells sessions here, publishes notices for the others
    FleetRegistry       (seen, notifier)    engines; tells the fleet of a resume, a change, a loss
    FleetMirrorHub      its layouts' mirror streams
    FleetDeclineBook    (this replica's declined_elsewhere)
    BrokerCore          (all of the above and the shared prefix index)
    FleetCounters       (the core's counts)

The notifier never calls the registry: what it needs of the registry's
reading (where a session is served) is in SeenRecords, and a drain notice
marks the record that the session's stream attached with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

from kvbroker.broker.clock import Clock
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import BrokerError
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.counters import FleetCounters, core_counts
from kvbroker.broker.fleet.declines import FleetDeclineBook
from kvbroker.broker.fleet.index import RedisPrefixIndex
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.fleet.mirror import FleetMirrorHub
from kvbroker.broker.fleet.notify import FleetNotifier
from kvbroker.broker.fleet.registry import FleetRegistry, SeenRecords
from kvbroker.broker.results import Stats

log = logging.getLogger("kvbroker")


class Replica:
    """A core whose registry, leases and index live in the shared store, as one replica of a fleet."""

    def __init__(self, config: BrokerConfig, clock: Clock, state: RedisState, name: str = "") -> None:
        self.name = name or secrets.token_hex(6)
        self.seen = SeenRecords()
        leases = RedisLeaseTable(state, config.ended_lease_history)
        self.notifier = FleetNotifier(clock, state, self.name, self.seen, leases)
        self.registry = FleetRegistry(state, self.name, self.seen, self.notifier)
        self.mirrors = FleetMirrorHub(state, self.name)
        self.declines = FleetDeclineBook(state, self.name, clock.now, self.declined_elsewhere)
        self.core = BrokerCore(
            config,
            clock=clock,
            notifier=self.notifier,
            index=RedisPrefixIndex(
                state,
                config.index_max_entries,
                config.index_memory_mib * 1024 * 1024,
                stream_keys=self.mirrors.streams.keys,
                stream_bytes=self.mirrors.streams.keep_bytes,
            ),
            leases=leases,
            registry=self.registry,
            mirrors=self.mirrors,
            declines=self.declines,
        )
        core = self.core
        self.counters = FleetCounters(
            state, self.name, core_counts(core.revocations, lambda: core.released_total)
        )
        log.info("broker replica %s", self.name)

    def stats(self) -> Stats:
        """The fleet's counts, not this replica's."""
        return self.counters.stats(self.core.stats())

    def declined_elsewhere(self, holder: str, request_id: str) -> None:
        """Another replica had an early decline: if the holder's stream is here, end a hold of it
        that arrived meanwhile (this replica's own sessions only: no store read)."""
        if self.registry.local(holder) is not None:
            with contextlib.suppress(BrokerError):  # claimed by its reader already, or the holder left
                self.core.decline(
                    holder, request_id, "declined (through another broker replica) before its hold"
                )

    def _catch_up(self) -> None:
        """The fleet's channel was (re)subscribed: generation notices sent while it was down are
        read from the engines' records instead (a store that does not answer: the next lease)."""
        try:
            told = self.notifier.catch_up_generations(self.registry.all())
        except BrokerError as err:
            log.warning("cannot read the engines' generations after the fleet channel came back: %s", err)
            return
        except Exception:  # never the end of the fleet's channel: its readers keep the lease rule
            log.exception("catching up engine generations after the fleet channel came back failed")
            return
        if told:
            log.info(
                "told this replica's sessions of %d engine generation(s) missed on the fleet channel", told
            )

    async def follow(self) -> None:
        """The fleet's notices (pub/sub), its watchers' record, the counters' flushes and the early
        declines until cancelled; then the mirror, watch and declines streams' readers stop too."""
        self.declines.follow()
        try:
            await asyncio.gather(
                self.notifier.follow(self._catch_up), self.notifier.watch.run(), self.counters.run()
            )
        finally:
            await self.mirrors.streams.stop()
            await self.notifier.watch.stop()
            await self.declines.stream.stop()
