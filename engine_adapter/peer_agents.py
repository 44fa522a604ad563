"""The holder agents a worker rank has loaded into NIXL, by registration generation.

An engine restarted under the same engine id comes back with the same NIXL
agent name (``<engine>-pp<p>-tp<t>``) and new metadata. The broker numbers
each registration (EngineInfo.generation, larger for every new session), and
every load names the generation its lease was granted under. For each agent
name this keeps the generation and metadata it loaded, and decides before a
read starts:

- a newer generation: the old agent is dropped (its reads in flight are
  abandoned, its descriptor lists released) and the new metadata loaded;
- the same generation: read (metadata that changed within one generation, a
  rank that re-registered its memory, is loaded again);
- an older generation: refuse. The load was planned against an engine that
  has since been replaced (a lease granted just before the restart, handed
  to the worker after the new agent was loaded); reading it would put the
  old agent back in place of the new one. Its blocks are recomputed.

The broker also says so unasked: when an engine id registers a new session,
every other session of the layout gets SessionDown.engine_generation, the
scheduler hands it to the workers with the next step's metadata
(AdapterMetadata.generations) and ``engine_replaced`` drops that engine's
agents loaded under an older generation at once, before any load of that
step; a later load under an older generation is refused even though nothing
of the engine is loaded any more. A reader that does not hear it (an older
broker, a notice lost between replicas) still learns from its next lease.

Generation 0 (a broker that predates the field) falls back to comparing the
metadata bytes, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvbroker.engine_adapter.broker_link import NewGeneration
    from kvbroker.engine_adapter.metadata import HolderRank, LoadSpec


class PeerLoader(Protocol):
    def add_peer(self, agent_name: str, metadata: bytes) -> Any: ...
    def remove_peer(self, agent_name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class LoadedAgent:
    engine_id: str
    generation: int
    metadata: bytes


class PeerAgents:
    """Which generation of each holder agent is loaded; counts replacements and refusals."""

    def __init__(self) -> None:
        self._loaded: dict[str, LoadedAgent] = {}
        # Per engine id, the newest generation the broker told of (engine_replaced): a load
        # under an older one is refused even when none of the engine's agents is loaded.
        self._newest: dict[str, int] = {}
        self.replaced = 0  # agents dropped for a newer generation
        self.refused = 0  # reads refused: their holder generation was older than the loaded one

    def generation(self, agent_name: str) -> int | None:
        known = self._loaded.get(agent_name)
        return None if known is None else known.generation

    def is_loaded(self, agent_name: str, metadata: bytes) -> bool:
        """Whether this very agent (same metadata) is loaded already (its first read sets up the link)."""
        known = self._loaded.get(agent_name)
        return known is not None and known.metadata == metadata

    def engine_replaced(self, mover: PeerLoader | None, engine_id: str, generation: int) -> int:
        """The broker says `engine_id` registered anew as `generation`: drop its agents loaded
        under an older generation now (their process is gone). Returns how many were dropped."""
        if generation <= self._newest.get(engine_id, 0):
            return 0
        self._newest[engine_id] = generation
        stale = [
            name
            for name, agent in self._loaded.items()
            if agent.engine_id == engine_id and agent.generation < generation
        ]
        for name in stale:
            del self._loaded[name]
            if mover is not None:
                mover.remove_peer(name)
        self.replaced += len(stale)
        return len(stale)

    def engines_replaced(self, mover: PeerLoader | None, news: Iterable[NewGeneration]) -> None:
        for new in news:
            self.engine_replaced(mover, new.engine_id, new.generation)

    def prepare(self, mover: PeerLoader, spec: LoadSpec, holder: HolderRank) -> str | None:
        """Make `holder`'s agent at the generation `spec` names the loaded agent; the reason not to
        read, or None.

        Raises what ``mover.add_peer`` raises (NIXL rejected the metadata)."""
        engine_id, generation = spec.holder_engine_id, spec.holder_generation
        agent_name, metadata = holder.agent_name, holder.agent_metadata
        newest = self._newest.get(engine_id, 0)
        if generation and newest > generation:
            self.refused += 1
            return (
                f"holder {engine_id} was replaced: the lease names generation {generation}, the "
                f"broker announced generation {newest} (the engine restarted); not reading the old agent"
            )
        known = self._loaded.get(agent_name)
        if known is not None and generation and known.generation > generation:
            self.refused += 1
            return (
                f"holder agent {agent_name} was replaced: the lease names generation {generation}, "
                f"generation {known.generation} is loaded (the engine restarted); not reading the old agent"
            )
        if known is not None and generation > known.generation:
            del self._loaded[agent_name]
            mover.remove_peer(agent_name)
            self.replaced += 1
            known = None
        if known is None or known.metadata != metadata:
            mover.add_peer(agent_name, metadata)
        self._loaded[agent_name] = LoadedAgent(
            engine_id, max(generation, known.generation if known else 0), metadata
        )
        return None
