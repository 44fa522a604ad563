"""Where a pull's time goes, from the decision to pull to its first token.

A pull crosses several scheduler steps: the lookup, vLLM allocating blocks,
the lease, the NIXL read, the release that commits it, vLLM noticing the
finished load, and the prefill of the prompt's remainder. ``PullTimeline``
records the moment (and the scheduler step) each of these happened, adds an
event per mark to the pull's trace span, and turns the marks into phases:

===============  ===========================================================
phase            from -> to
===============  ===========================================================
lookup           lookup started -> pull decided (index mirror or broker)
allocate         decided -> vLLM allocated the blocks (update_state_after_alloc)
lease            allocated -> the scheduler saw the lease granted
read             LoadSpec sent -> the scheduler saw every rank's read done
release          read done -> the scheduler saw the release answered (commit)
notice           commit -> vLLM reported the load finished (finished_recving)
schedule         finished -> vLLM scheduled the remainder's prefill
prefill          prefill scheduled -> its step ended (the first token)
===============  ===========================================================

Every phase but ``read`` and ``prefill`` is waiting: ``waiting_ms`` is their
sum. ``lease_answer`` and ``release_answer`` (when the broker's answer
arrived, on the session thread) and ``worker_read`` (the read as the worker
timed it) show how much of a phase was the broker or NIXL and how much the
scheduler's step cadence.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

# (phase, start mark, end mark), in order.
PHASES = (
    ("lookup", "lookup_started", "decided"),
    ("allocate", "decided", "allocated"),
    ("lease", "allocated", "lease_granted"),
    ("read", "lease_granted", "read_done"),
    ("release", "read_done", "committed"),
    ("notice", "committed", "load_finished"),
    ("schedule", "load_finished", "prefill_scheduled"),
    ("prefill", "prefill_scheduled", "first_token"),
)
WORK_PHASES = ("read", "prefill")


@dataclass
class PullTimeline:
    marks: dict[str, tuple[float, int]] = field(default_factory=dict)  # name -> (monotonic s, step)
    extra_ms: dict[str, float] = field(default_factory=dict)  # broker answers, the worker's read

    def mark(self, name: str, now: float, step: int, span: Any = None) -> None:
        if name in self.marks:
            return
        self.marks[name] = (now, step)
        if span is not None:
            span.add_event(f"kvbroker.{name}", {"kvbroker.step": step})

    def since(self, name: str, start: str, now: float) -> None:
        """A duration measured off the scheduler's steps (e.g. the broker's answer arrived)."""
        if start in self.marks:
            self.extra_ms[name] = round((now - self.marks[start][0]) * 1000.0, 3)

    def time_answer(
        self, future: Future[Any] | None, name: str, since: str, clock: Callable[[], float]
    ) -> None:
        """When a broker answer arrives (session thread), apart from when a step sees it."""
        if future is not None:
            future.add_done_callback(lambda _f: self.since(name, since, clock()))

    def count_ready_steps(self, stats: Any) -> None:
        """At the prefill's scheduling: the scheduler steps since vLLM allocated the blocks, as the
        counters ``loads_ready`` / ``load_ready_steps`` and the figure ``last_load_ready_steps``.
        1 is the least: lease, read and release all in the allocation's step (docs/adapter.md)."""
        steps = self.marks["prefill_scheduled"][1] - self.marks["allocated"][1]
        stats.count("loads_ready", 1)
        stats.count("load_ready_steps", steps)
        stats.figure("last_load_ready_steps", steps)

    def phases(self) -> dict[str, tuple[float, int]]:
        """phase -> (ms, scheduler steps), for every phase whose two marks exist."""
        out = {}
        for phase, a, b in PHASES:
            if a in self.marks and b in self.marks:
                (ta, sa), (tb, sb) = self.marks[a], self.marks[b]
                out[phase] = (round((tb - ta) * 1000.0, 3), sb - sa)
        return out

    def waiting_ms(self) -> float:
        return round(sum(ms for p, (ms, _) in self.phases().items() if p not in WORK_PHASES), 3)

    def attributes(self) -> dict[str, float | int]:
        """Span attributes: kvbroker.timeline.<phase>_ms / _steps, waiting_ms, and the extras."""
        attrs: dict[str, float | int] = {}
        for phase, (ms, steps) in self.phases().items():
            attrs[f"kvbroker.timeline.{phase}_ms"] = ms
            attrs[f"kvbroker.timeline.{phase}_steps"] = steps
        attrs["kvbroker.timeline.waiting_ms"] = self.waiting_ms()
        for name, ms in self.extra_ms.items():
            attrs[f"kvbroker.timeline.{name}_ms"] = ms
        return attrs

    def describe(self) -> str:
        """One log line's worth: 'lookup 0.1 ms/0 steps, lease 1.2 ms/1 step, ..., waiting 3.4 ms'."""
        parts = [
            f"{p} {ms:.1f} ms/{steps} step{'s' if steps != 1 else ''}"
            for p, (ms, steps) in self.phases().items()
        ]
        parts += [f"{name} {ms:.1f} ms" for name, ms in self.extra_ms.items()]
        parts.append(f"waiting {self.waiting_ms():.1f} ms")
        return ", ".join(parts)
