"""Declines that came before their hold, remembered by every broker replica.

A router passes P's answer on to D before P's hold reaches the broker, so D's
decline can come first, and through another replica than the hold. Each
replica keeps its book of early declines in memory (declines.py; a hold looks
only there, so holds cost the store nothing more) and appends each early
decline it receives to the fleet's declines stream (the mirror streams'
machinery, fleet/mirror.py's MirrorStreams: kept a minute, read on from the
last entry after a lost connection). Every replica reads that stream and
puts the other replicas' early declines in its own book, so a hold arriving
after that is refused wherever it arrives. The replica that serves the
holder's session also looks for a hold that arrived in the moment between
the decline and its reading it, and ends it as declined.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from kvbroker.broker.declines import DeclineBook
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.mirror import MirrorStreams

log = logging.getLogger("kvbroker")

FLEET = "fleet"  # the one "layout" of the declines stream


class DeclineStreams(MirrorStreams):
    """The fleet's early declines: one stream (and counter) under the `{declines}` hash tag."""

    reader_name = "kvbroker-declines"
    apply_after_gap = True  # a gap loses the declines missed, not the one that showed it

    def keys(self, layout_id: str) -> list[str]:
        base = f"{self._state.prefix}:{{declines}}:"
        return [base + "s", base + "n"]


class FleetDeclineBook(DeclineBook):
    def __init__(
        self, state: RedisState, replica: str, now: Callable[[], float], heard: Callable[[str, str], None]
    ) -> None:
        """`heard(holder, request_id)`: another replica's early decline, heard here; the holder's
        replica ends a hold of it that arrived meanwhile (BrokerCore.decline)."""
        super().__init__()
        self._now = now
        self._adding_heard = False  # adding what another replica said: do not send it back
        self._on_heard = heard
        self.stream = DeclineStreams(state, replica, self._apply, self._missed)

    def add(self, holder: str, request_id: str, now: float) -> None:
        super().add(holder, request_id, now)
        if not self._adding_heard:
            self.stream.append(FLEET, "decline", json.dumps([holder, request_id]).encode())

    def follow(self) -> None:
        """Read the other replicas' early declines from now on (on the running event loop)."""
        self.stream.follow(FLEET)

    def _apply(self, layout_id: str, kind: str, body: bytes) -> None:
        holder, request_id = (str(part) for part in json.loads(body))
        self._adding_heard = True
        try:
            super().add(holder, request_id, self._now())
            self._on_heard(holder, request_id)
        finally:
            self._adding_heard = False

    def _missed(self, layout_id: str) -> None:
        log.warning(
            "early declines of other broker replicas were missed: their holds, if they come here, "
            "end by their TTL"
        )
