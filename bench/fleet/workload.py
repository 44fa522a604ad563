"""The fleet benchmark's workload: concurrent multi-turn sessions that share system prompts.

Pure and seeded (no I/O, no clock): a ``Workload`` lists sessions, each with
its agent class (whose system prompt every session of the class shares), its
arrival time, its turns' new user messages (token ids) and the think time
before each next turn. Classes are picked with a Zipf-like skew (class k with
weight 1 / (k + 1)), so a few system prompts are hot; arrivals come in bursts
(``burst`` sessions at once, bursts spaced so the mean rate is ``rate`` sessions
per second). ``ideal_reused`` is the prefix reuse an oracle would get: the
leading full blocks of a prompt that some earlier finished request already
computed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def tokens(length: int, seed: int) -> list[int]:
    """Deterministic token ids inside the tiny model's vocabulary (avoids special ids)."""
    rng = random.Random(seed)
    return [10 + rng.randrange(400) for _ in range(length)]


@dataclass(frozen=True)
class WorkloadSpec:
    sessions: int = 12
    turns: int = 3
    classes: int = 3
    system_tokens: int = 768
    user_tokens: int = 48
    answer_tokens: int = 16
    think_s: float = 0.5  # mean think time between a session's turns (exponential)
    rate: float = 1.0  # sessions arriving per second, on average
    burst: int = 2  # sessions arriving together
    seed: int = 1


@dataclass(frozen=True)
class Session:
    index: int
    agent_class: int
    arrival_s: float
    user_turns: tuple[tuple[int, ...], ...]
    think_s: tuple[float, ...]  # before turn 2, 3, ...


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    system_prompts: tuple[tuple[int, ...], ...]
    sessions: tuple[Session, ...]


def build(spec: WorkloadSpec) -> Workload:
    rng = random.Random(spec.seed)
    systems = tuple(tuple(tokens(spec.system_tokens, 1000 + k)) for k in range(spec.classes))
    weights = [1.0 / (k + 1) for k in range(spec.classes)]
    sessions = []
    for i in range(spec.sessions):
        burst_index = i // max(1, spec.burst)
        arrival = burst_index * max(1, spec.burst) / spec.rate if spec.rate > 0 else 0.0
        users = tuple(tuple(tokens(spec.user_tokens, 10_000 * (i + 1) + t)) for t in range(spec.turns))
        thinks = tuple(rng.expovariate(1.0 / spec.think_s) if spec.think_s > 0 else 0.0 for _ in users[1:])
        agent = rng.choices(range(spec.classes), weights)[0]
        sessions.append(Session(i, agent, arrival, users, thinks))
    return Workload(spec, systems, tuple(sessions))


def full_block_prefixes(ids: Sequence[int], block: int) -> Iterable[tuple[int, ...]]:
    for end in range(block, len(ids) + 1, block):
        yield tuple(ids[:end])


class IdealCache:
    """Every full-block prefix that a finished request computed (its prompt and its answer)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self._seen: set[int] = set()

    def reused(self, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` an oracle router would not recompute."""
        best = 0
        for prefix in full_block_prefixes(prompt, self.block):
            if hash(prefix) not in self._seen:
                break
            best = len(prefix)
        return best

    def add(self, ids: Sequence[int]) -> None:
        for prefix in full_block_prefixes(ids, self.block):
            self._seen.add(hash(prefix))
