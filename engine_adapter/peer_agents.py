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

Generation 0 (a broker that predates the field) falls back to comparing the
metadata bytes, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class PeerLoader(Protocol):
    def add_peer(self, agent_name: str, metadata: bytes) -> Any: ...
    def remove_peer(self, agent_name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class LoadedAgent:
    generation: int
    metadata: bytes


class PeerAgents:
    """Which generation of each holder agent is loaded; counts replacements and refusals."""

    def __init__(self) -> None:
        self._loaded: dict[str, LoadedAgent] = {}
        self.replaced = 0  # agents dropped for a newer generation
        self.refused = 0  # reads refused: their holder generation was older than the loaded one

    def generation(self, agent_name: str) -> int | None:
        known = self._loaded.get(agent_name)
        return None if known is None else known.generation

    def is_loaded(self, agent_name: str, metadata: bytes) -> bool:
        """Whether this very agent (same metadata) is loaded already (its first read sets up the link)."""
        known = self._loaded.get(agent_name)
        return known is not None and known.metadata == metadata

    def prepare(self, mover: PeerLoader, agent_name: str, generation: int, metadata: bytes) -> str | None:
        """Make `agent_name` at `generation` the loaded agent; the reason not to read, or None.

        Raises what ``mover.add_peer`` raises (NIXL rejected the metadata)."""
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
        self._loaded[agent_name] = LoadedAgent(max(generation, known.generation if known else 0), metadata)
        return None
