"""The fleet benchmark's workload: concurrent multi-turn agent sessions, as token ids.

What users run on a fleet, reduced to what matters for KV reuse and routing:

- agent classes, each with its own shared system prompt (`system_tokens` long); a
  session's class is drawn with a Zipf skew (`class_skew`), so one system prompt is hot;
- sessions, each a chain of turns: turn k's prompt is the system prompt, then every
  earlier user message and the model's answer to it, then the new user message
  (`user_tokens`), so a session's history grows each turn by what the model said;
- hot sessions: a `hot_fraction` of sessions runs `hot_turns` turns with a short think
  time, the others `cold_turns` turns (the skew that makes some prefixes hot);
- think time between a turn's answer and the next turn: exponential, mean `think_s`
  (`think_s / 4` for hot sessions);
- bursty arrivals: bursts come as a Poisson process, each brings 1 + Poisson(`burst_mean` - 1)
  sessions within `burst_spread_s`;
- greedy decoding with `ignore_eos` and a fixed `answer_tokens`, so every setup sees the
  same prompt lengths and the ideal reuse below is exact; a fixed seed.

A plan is drawn once per seed at unit rate and then scaled: `Plan.at_rate(r)` gives the
same sessions with arrival times such that the offered load is about `r` requests per
second (think time is the users' and does not scale). So every setup and every rate runs
the same sessions with the same messages.

`ideal_cached_tokens` is what a perfect fleet-wide prefix cache could serve of each
request (block-aligned, as vLLM caches whole blocks, and never the prompt's last token):
the previous turn's prompt and answer for a later turn, the system prompt for a first
turn of a class already seen. Pure and deterministic: tests/bench/test_fleet_agent_sessions.py.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

TOKEN_BASE = 10  # ids below are left alone (special tokens of the tiny model's vocabulary)


@dataclass(frozen=True)
class WorkloadSpec:
    """What the generator draws; every field is a knob of `python -m bench.fleet.fleet`."""

    sessions: int = 32
    classes: int = 4  # agent classes, each with its own system prompt
    class_skew: float = 1.2  # Zipf exponent of the class draw (0: uniform)
    system_tokens: int = 512
    user_tokens: int = 48
    answer_tokens: int = 24
    hot_fraction: float = 0.25
    hot_turns: int = 6
    cold_turns: int = 2
    think_s: float = 2.0
    burst_mean: float = 3.0  # sessions per burst, on average
    burst_spread_s: float = 0.2
    block_size: int = 32
    vocab_span: int = 400  # token ids are drawn from [TOKEN_BASE, TOKEN_BASE + vocab_span)
    seed: int = 26

    def mean_turns(self) -> float:
        return self.hot_fraction * self.hot_turns + (1 - self.hot_fraction) * self.cold_turns


@dataclass(frozen=True)
class Session:
    sid: str
    agent_class: int
    hot: bool
    start_s: float  # arrival of its first turn
    user_messages: tuple[tuple[int, ...], ...]  # one per turn
    think_s: tuple[float, ...]  # before turns 2..n

    @property
    def turns(self) -> int:
        return len(self.user_messages)


@dataclass(frozen=True)
class Plan:
    spec: WorkloadSpec
    system_prompts: tuple[tuple[int, ...], ...]
    sessions: tuple[Session, ...]
    rate: float = 1.0  # requests per second offered (about)

    @property
    def requests(self) -> int:
        return sum(s.turns for s in self.sessions)

    def at_rate(self, rate: float) -> Plan:
        """The same sessions, arrivals compressed so the offered load is about `rate` requests/s."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        scale = self.rate / rate
        sessions = tuple(replace(s, start_s=s.start_s * scale) for s in self.sessions)
        return replace(self, sessions=sessions, rate=rate)

    def prompt(self, session: Session, turn: int, answers: list[list[int]]) -> list[int]:
        """Turn `turn`'s (0-based) prompt from the answers of the turns before it."""
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
        out = list(self.system_prompts[session.agent_class])
        for k in range(turn):
            out += session.user_messages[k]
            out += answers[k]
        out += session.user_messages[turn]
        return out

    def prompt_tokens(self, session: Session, turn: int) -> int:
        s = self.spec
        return s.system_tokens + (turn + 1) * s.user_tokens + turn * s.answer_tokens

    def ideal_cached_tokens(self) -> dict[tuple[str, int], int]:
        """Per (session id, turn): tokens a perfect fleet-wide prefix cache serves (see module doc)."""
        s, b = self.spec, self.spec.block_size
        seen: set[int] = set()
        out: dict[tuple[str, int], int] = {}
        for session in sorted(self.sessions, key=lambda x: (x.start_s, x.sid)):
            for turn in range(session.turns):
                limit = (self.prompt_tokens(session, turn) - 1) // b * b
                if turn == 0:
                    cached = s.system_tokens // b * b if session.agent_class in seen else 0
                else:
                    held = self.prompt_tokens(session, turn - 1) + s.answer_tokens - 1
                    cached = held // b * b
                out[(session.sid, turn)] = min(cached, limit)
            seen.add(session.agent_class)
        return out

    def min_wall_s(self, turn_s: float) -> float:
        """The shortest a run of this plan can take when every turn takes `turn_s`: its sessions'
        turns follow one another (a turn is sent after the last one's answer and the think time),
        so the run lasts at least until the latest session's last answer."""
        return max((s.start_s + s.turns * turn_s + sum(s.think_s) for s in self.sessions), default=0.0)

    def ideal_reuse(self) -> float:
        """Ideal cached tokens over prompt tokens, the whole plan."""
        ideal = self.ideal_cached_tokens()
        total = sum(self.prompt_tokens(s, t) for s in self.sessions for t in range(s.turns))
        return sum(ideal.values()) / total if total else 0.0


@dataclass
class _Draw:
    rng: random.Random
    spec: WorkloadSpec
    weights: list[float] = field(default_factory=list)

    def tokens(self, n: int) -> tuple[int, ...]:
        return tuple(TOKEN_BASE + self.rng.randrange(self.spec.vocab_span) for _ in range(n))

    def poisson(self, mean: float) -> int:
        # Knuth's method: fine for the small means used here.
        limit, k, p = math.exp(-mean), 0, 1.0
        while True:
            p *= self.rng.random()
            if p <= limit:
                return k
            k += 1


def burst_arrivals(spec: WorkloadSpec, rng: random.Random, session_rate: float) -> list[float]:
    """`spec.sessions` arrival times: Poisson bursts of 1 + Poisson(burst_mean - 1) sessions."""
    draw = _Draw(rng, spec)
    burst_rate = session_rate / max(spec.burst_mean, 1.0)
    out: list[float] = []
    t = 0.0
    while len(out) < spec.sessions:
        t += rng.expovariate(burst_rate)
        size = 1 + draw.poisson(max(spec.burst_mean - 1.0, 0.0))
        out += sorted(t + rng.uniform(0, spec.burst_spread_s) for _ in range(size))
    return sorted(out[: spec.sessions])


def generate(spec: WorkloadSpec) -> Plan:
    """The plan at about 1 request/s offered; `Plan.at_rate` rescales it."""
    if spec.sessions < 1 or spec.classes < 1 or min(spec.hot_turns, spec.cold_turns) < 1:
        raise ValueError("sessions, classes and turns must be >= 1")
    rng = random.Random(spec.seed)
    draw = _Draw(rng, spec)
    systems = tuple(draw.tokens(spec.system_tokens) for _ in range(spec.classes))
    weights = [1.0 / (k + 1) ** spec.class_skew for k in range(spec.classes)]
    # 1 request/s offered: sessions arrive at 1 / mean turns per second.
    starts = burst_arrivals(spec, rng, 1.0 / spec.mean_turns())
    sessions = []
    for i, start in enumerate(starts):
        hot = rng.random() < spec.hot_fraction
        turns = spec.hot_turns if hot else spec.cold_turns
        mean_think = spec.think_s / 4 if hot else spec.think_s
        sessions.append(
            Session(
                sid=f"s{i:03d}",
                agent_class=rng.choices(range(spec.classes), weights=weights)[0],
                hot=hot,
                start_s=start,
                user_messages=tuple(draw.tokens(spec.user_tokens) for _ in range(turns)),
                think_s=tuple(
                    rng.expovariate(1 / mean_think) if mean_think > 0 else 0.0 for _ in range(turns - 1)
                ),
            )
        )
    return Plan(spec, systems, tuple(sessions))
