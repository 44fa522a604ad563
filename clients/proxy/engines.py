"""The engines the proxy can use: from flags, from the broker's engine list, or both.

The broker knows each engine's id, layout (needed to hash a prompt the way the
engines do) and labels (role, url). The pool re-reads that list in the
background; requests never wait on it. An engine that just failed goes to the
back of every candidate list for a cool-down period instead of being dropped,
so a lone engine that had a hiccup is still tried.

Liveness the proxy can trust comes from two places: the broker's sessions (an
engine the broker listed and no longer lists has lost its session: it stopped
heartbeating, like a frozen or dead engine, and is not routed to) and the
forwarder's first-byte budget (forward.py), which marks an engine that stayed
silent and failed a liveness probe. `unhealthy_reason` says why an engine is
not used, for /health.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvbroker.clients.proxy.config import ROLES, EngineSpec, normalize_url
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker.proxy")


@dataclass(frozen=True)
class EngineLayout:
    """What the proxy needs to hash a prompt like the engine does."""

    layout_id: str
    block_size: int
    hash_algo: str


class Serving:
    """One request in flight on an engine; its predicted prompt tokens are backlog until it has prefilled."""

    def __init__(self, pool: EnginePool, url: str, tokens: float) -> None:
        self._pool, self._url, self.tokens = pool, url, tokens
        self._done = False

    def prefilled(self) -> None:
        """The engine answered the first byte: its prompt is computed (idempotent)."""
        if not self._done:
            self._done = True
            self._pool.add_backlog(self._url, -self.tokens)


class EnginePool:
    def __init__(
        self,
        static: Sequence[EngineSpec],
        *,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._static = list(static)
        self._engines: list[EngineSpec] = list(static)
        self._layouts: dict[str, EngineLayout] = {}
        self._load: dict[str, float] = {}
        self._inflight: dict[str, int] = {}  # url -> requests this proxy has sent there and not seen end
        # url -> prompt tokens the placement predicted those requests compute there, until each one's
        # first byte (data-parallel placement: a prefill queued ahead delays a new request token for token)
        self._backlog: dict[str, float] = {}
        self._draining: set[str] = set()
        self._failed_until: dict[str, float] = {}
        self._failure: dict[str, str] = {}  # url -> why it last failed (shown while cooling down)
        self._listed_once: set[str] = set()  # engine ids the broker has listed at some point
        self._session_gone: set[str] = set()  # urls of engines the broker listed once but no longer does
        self._learned_ids: dict[str, str] = {}  # url -> engine id learned from the broker's labels
        self._listed: set[str] = set()  # engine ids in the broker's latest list
        self._listed_at: float | None = None  # when that list was read
        self.stale_after_s = 10.0  # older than this, the broker's list says nothing about liveness
        # After the broker was unreachable (restarting), engines take a while to register
        # with the new one: one missing from its list meanwhile has not lost its session.
        self.restart_grace_s = 10.0
        self._grace_until = 0.0
        self._cooldown_s = cooldown_s
        self._clock = clock
        self.broker_seen = False  # the broker's engine list was read at least once

    @property
    def engines(self) -> list[EngineSpec]:
        return list(self._engines)

    def layout_of(self, engine: EngineSpec) -> EngineLayout | None:
        return self._layouts.get(engine.engine_id) if engine.engine_id else None

    def load_of(self, engine: EngineSpec) -> float:
        return self._load.get(engine.engine_id, 0.0)

    def started(self, engine: EngineSpec) -> None:
        """This proxy sent `engine` a request (counted until `ended`)."""
        self._inflight[engine.url] = self._inflight.get(engine.url, 0) + 1

    def ended(self, engine: EngineSpec) -> None:
        left = self._inflight.get(engine.url, 0) - 1
        if left > 0:
            self._inflight[engine.url] = left
        else:
            self._inflight.pop(engine.url, None)

    @contextlib.contextmanager
    def serving(self, engine: EngineSpec, prefill_tokens: float = 0.0) -> Iterator[Serving]:
        """Counts a request to `engine` as in flight for as long as the block runs, and its
        `prefill_tokens` as that engine's backlog until `Serving.prefilled` (or the block's end)."""
        self.started(engine)
        slot = Serving(self, engine.url, max(0.0, prefill_tokens))
        self.add_backlog(engine.url, slot.tokens)
        try:
            yield slot
        finally:
            slot.prefilled()
            self.ended(engine)

    def in_flight(self, engine: EngineSpec) -> int:
        return self._inflight.get(engine.url, 0)

    def add_backlog(self, url: str, tokens: float) -> None:
        """Change the engine's backlog by `tokens` (its entry goes once nothing is left)."""
        left = self._backlog.get(url, 0.0) + tokens
        if left > 1e-9:
            self._backlog[url] = left
        else:
            self._backlog.pop(url, None)

    def backlog_of(self, engine: EngineSpec) -> float:
        """Prompt tokens this proxy's requests on `engine` are predicted to compute before their first byte."""
        return self._backlog.get(engine.url, 0.0)

    def busy_of(self, engine: EngineSpec) -> float:
        """Requests on `engine`: what this proxy has in flight there or, when larger, the load the
        engine last heartbeat to the broker (which also counts other proxies' requests)."""
        return max(float(self.in_flight(engine)), self.load_of(engine))

    def is_draining(self, engine: EngineSpec) -> bool:
        return engine.engine_id in self._draining

    def is_cooling_down(self, engine: EngineSpec) -> bool:
        return self._failed_until.get(engine.url, 0.0) > self._clock()

    def session_gone(self, engine: EngineSpec) -> bool:
        """The broker listed this engine once and no longer does: its session ended or expired."""
        return engine.url in self._session_gone

    def broker_vouches_for(self, engine: EngineSpec) -> bool:
        """The broker's fresh list has this engine: its session is live (heartbeats arrive).

        Sessions survive a starved host (the broker and the engines discount their own
        stalls), so this outweighs a /health probe that timed out on a loaded machine."""
        fresh = self._listed_at is not None and self._clock() - self._listed_at <= self.stale_after_s
        return fresh and bool(engine.engine_id) and engine.engine_id in self._listed

    def unhealthy_reason(self, engine: EngineSpec) -> str:
        """Why the engine is not routed to now ("" when it is healthy)."""
        if self.session_gone(engine):
            return "its broker session ended (the broker no longer lists it: stopped, frozen or dead)"
        if self.is_cooling_down(engine):
            left = self._failed_until[engine.url] - self._clock()
            what = self._failure.get(engine.url) or "failed"
            return f"{what}; tried after the others for {left:.1f} s more"
        return ""

    def candidates(self, role: str) -> list[EngineSpec]:
        """Engines that can take `role`: healthy first, then those cooling down after a failure.

        Engines whose broker session ended are left out, unless every engine the
        proxy knows lost its session at once: that is the broker restarting (or
        losing its state), not every engine dying, so they are all still tried.
        """
        able = [e for e in self._engines if e.serves(role)]
        if not self._everyone_gone():
            able = [e for e in able if not self.session_gone(e)]
        return [e for e in able if not self.is_cooling_down(e)] + [e for e in able if self.is_cooling_down(e)]

    def serving_count(self) -> int:
        """Healthy engines that answer requests (decode or both): what admission's limit scales with."""
        return sum(1 for e in self.candidates("decode") if not self.is_cooling_down(e))

    def _everyone_gone(self) -> bool:
        return bool(self._engines) and all(self.session_gone(e) for e in self._engines)

    def mark_failed(self, engine: EngineSpec, reason: str = "") -> None:
        self._failed_until[engine.url] = self._clock() + self._cooldown_s
        self._failure[engine.url] = reason

    def mark_ok(self, engine: EngineSpec) -> None:
        self._failed_until.pop(engine.url, None)
        self._failure.pop(engine.url, None)

    def apply_broker_engines(self, infos: Sequence[pb.EngineInfo]) -> None:
        """Learn ids, layouts and loads from the broker's engine list.

        With engines from flags, the list only names them (matched by their
        `url` label). Without, it is the engine list: every engine with a
        `url` label, in the role of its `role` label (default both).
        """
        self.broker_seen = True
        by_url: dict[str, pb.EngineInfo] = {}
        for info in infos:
            self._layouts[info.engine_id] = EngineLayout(
                info.layout_id, info.layout.block_size, info.layout.hash_algo or "sha256"
            )
            self._load[info.engine_id] = info.load
            url = info.labels.get("url", "")
            if url:
                by_url[normalize_url(url)] = info
        self._draining = {i.engine_id for i in infos if i.draining}
        listed = {i.engine_id for i in infos}
        self._listed_once |= listed
        self._listed, self._listed_at = listed, self._clock()
        if self._static:
            engines = []
            for spec in self._static:
                known = by_url.get(spec.url)
                if known is not None:
                    self._learned_ids[spec.url] = known.engine_id
                engine_id = spec.engine_id or self._learned_ids.get(spec.url, "")
                engines.append(EngineSpec(spec.url, spec.role, engine_id))
        else:
            engines = []
            for url, info in by_url.items():
                role = info.labels.get("role", "both")
                engines.append(EngineSpec(url, role if role in ROLES else "both", info.engine_id))
        gone = {e.url for e in engines if e.engine_id in self._listed_once and e.engine_id not in listed}
        if self._clock() < self._grace_until:
            gone &= self._session_gone  # only those already gone before the broker went away
        for e in engines:
            if (e.url in gone) != (e.url in self._session_gone):
                if e.url in gone:
                    log.warning("engine %s (%s): its broker session ended; not routing to it", e.label, e.url)
                else:
                    log.info("engine %s (%s) has a broker session again", e.label, e.url)
        self._session_gone = gone
        if [e.label for e in engines] != [e.label for e in self._engines]:
            log.info("engines: %s", ", ".join(f"{e.label} ({e.role}) {e.url}" for e in engines) or "none")
        self._engines = engines

    async def refresh(self, broker) -> bool:  # broker: clients.aio.AsyncBrokerClient
        from kvbroker.clients.errors import BrokerError

        try:
            response = await broker.list_engines(timeout=2.0)
        except BrokerError as e:
            log.debug("broker engine list unavailable: %s", e)
            self._grace_until = self._clock() + self.restart_grace_s
            return False
        self.apply_broker_engines(list(response.engines))
        return True

    async def refresh_forever(self, broker, interval_s: float) -> None:
        was_ok = True
        while True:
            ok = await self.refresh(broker)
            if ok != was_ok:
                log.warning("broker %s", "reachable again" if ok else "unreachable: routing without scores")
                was_ok = ok
            await asyncio.sleep(interval_s)
