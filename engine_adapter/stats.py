"""Counters of the scheduler side, and the thread that writes them to ``stats_path``.

vLLM gets them through its connector stats interface: ``take_delta`` hands
what changed since the last call to ``get_kv_connector_stats`` each step, and
engine_adapter/vllm_metrics.py turns it into series of vLLM's own /metrics.

vLLM's scheduler loop does no file I/O: when the counters changed, the
scheduler copies them into a plain dict on its own thread (``as_dict``, cheap)
and hands it to ``StatsWriter``, whose daemon thread writes it. A change after
a quiet spell is written at once (readers such as bench/fleet/reclaim.py poll the
file every 10 ms and time what they see, and the e2e tests read it as soon as
a request's answer arrives); changes that come while a write is under way are
coalesced, the latest snapshot winning, so the file trails the counters by
one write at most. ``min_interval_s`` (default 0) can space writes out.
``close`` writes what is still pending, once more, on shutdown.

The file is one JSON object, replaced atomically (written beside it, then
renamed), so a reader never sees half of it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Under "vllm." so that vLLM's logging configuration prints our lines.
logger = logging.getLogger("vllm.kvbroker.scheduler")

# At most one write per this many seconds while the counters keep changing. 0:
# write as soon as the thread runs. The scheduler hands over at most one
# snapshot per step, and only when something changed, so this stays cheap; a
# 0.1 s spacing made the file trail finished requests (an e2e test read the
# counters of the request before).
WRITE_INTERVAL_S = 0.0


@dataclass
class SchedulerStats:
    """The scheduler side's counters; ``dirty`` until their latest state went to the writer."""

    counters: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)
    # Latest values (not counts), e.g. the last pull-or-recompute decision's predictions.
    figures: dict[str, float | str] = field(default_factory=dict)
    dirty: bool = True
    # What vLLM's connector stats have been handed so far (take_delta).
    _reported: Counter[str] = field(default_factory=Counter)
    _reported_skips: Counter[str] = field(default_factory=Counter)
    _unreported: bool = True

    def count(self, name: str, n: int = 1) -> None:
        if not n:
            return  # nothing happened: the counters (and the stats file) stay as they are
        self.counters[name] += n
        self.dirty = self._unreported = True

    def skip(self, reason: str) -> None:
        self.skips[reason] += 1
        self.dirty = self._unreported = True

    def take_delta(self, gauges: dict[str, int]) -> dict[str, Any] | None:
        """The counts since the last call, and the gauges' values; None if nothing was counted."""
        if not self._unreported:
            return None
        self._unreported = False
        counters, skips = self.counters - self._reported, self.skips - self._reported_skips
        self._reported, self._reported_skips = Counter(self.counters), Counter(self.skips)
        return {"counters": dict(counters), "skips": dict(skips), "gauges": dict(gauges)}

    def figure(self, name: str, value: float | str) -> None:
        self.figures[name] = value
        self.dirty = True

    def as_dict(self, held_requests: int, held_blocks: int) -> dict[str, Any]:
        return {
            **dict(self.counters),
            "skips": dict(self.skips),
            "figures": dict(self.figures),
            "held_requests": held_requests,
            "held_blocks": held_blocks,
        }


class StatsWriter:
    """Writes the snapshots it is handed to ``path`` on its own daemon thread."""

    def __init__(self, path: str, *, min_interval_s: float = WRITE_INTERVAL_S) -> None:
        self.path = path
        self.min_interval_s = min_interval_s
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvbroker-stats-writer", daemon=True)
        self._thread.start()

    def submit(self, snapshot: dict[str, Any]) -> None:
        """Write this snapshot soon (any thread; never blocks on the file). The caller gives it up."""
        with self._cond:
            if self._closed:
                return
            self._pending = snapshot
            self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is pending now, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        last_write = -float("inf")
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                # Wait out the interval (the latest snapshot wins), unless closing.
                while not self._closed:
                    wait_s = last_write + self.min_interval_s - time.monotonic()
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                snapshot, self._pending = self._pending, None
            if snapshot is None:
                return  # closed, nothing left to write
            self._write(snapshot)
            last_write = time.monotonic()

    def _write(self, snapshot: dict[str, Any]) -> None:
        directory = os.path.dirname(self.path) or "."
        try:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".stats-")
            with os.fdopen(fd, "w") as f:
                json.dump(snapshot, f)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("kvbroker: cannot write stats to %s: %s", self.path, e)
        except Exception:  # a dead writer thread would stop every later update
            logger.exception("kvbroker: cannot write stats to %s", self.path)
