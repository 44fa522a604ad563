"""This engine's load, as it reports it to the broker for the engines that pull from it.

The figure is the number of requests this engine's scheduler has taken up and
not finished: those vLLM allocated blocks for (running, preempted, or waiting
for a pull) plus those it has asked us about and not yet allocated (waiting at
the head of its queue, or on a lookup). Requests further back in vLLM's waiting
queue are not counted: no connector hook sees them.

Why this figure: a pull from a busy holder takes longer (on the CPU build its
NIXL agent makes progress only between model steps, and the steps of a busy
engine are long; a pin of cached blocks is answered on its next step), and
readers that pull from an engine take memory bandwidth from its own requests.
Readers scale their predicted pull time by it (cost_model.py, pull_policy.py).

It costs a set insert or remove per request and a comparison per step; the
figure goes to the broker only when it changed (the session sends it early
when it changed materially, clients/engine_session.py).
"""

from __future__ import annotations


class OwnLoad:
    """Requests this engine's scheduler works on: allocated ones plus those asked about."""

    def __init__(self) -> None:
        self._allocated: set[str] = set()
        self.reported = 0.0  # the figure last handed to the broker link (registration: 0)

    def allocated(self, req_id: str) -> None:
        """vLLM allocated blocks for the request (its first schedule, or a resume)."""
        self._allocated.add(req_id)

    def finished(self, req_id: str) -> None:
        self._allocated.discard(req_id)

    @property
    def running(self) -> int:
        """Requests allocated and not finished: those a prefill here delays."""
        return len(self._allocated)

    def value(self, asked: int) -> float:
        """The load with ``asked`` requests vLLM asked about and has not allocated yet."""
        return float(len(self._allocated) + asked)

    def changed(self, asked: int) -> float | None:
        """The figure if it differs from the one last reported (and is now the reported one)."""
        value = self.value(asked)
        if value == self.reported:
            return None
        self.reported = value
        return value
