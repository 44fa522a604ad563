"""Wake vLLM's idle engine loop so that the scheduler side steps once more.

An idle vLLM engine core blocks on its input queue and runs no scheduler
hook until a request arrives. Work that only the scheduler thread may do
(touching the block pool: a reader's pin of cached blocks, the return of
an ended lease's blocks) then waits for the next request, and a pin that
waits past the broker's pin timeout is refused. vLLM's own shutdown path
wakes the loop with a ``WAKEUP`` message on that queue; after it, the loop
asks the scheduler whether it has work, which includes the connector's
``has_pending_push_work``.

No connector API hands out the queue: vLLM builds the scheduler, and with it
the connector, inside the engine core's constructor, so ``find_engine_wakeup``
looks for that engine core among the callers' frames. Where it finds none (an
in-process engine, another vLLM version) it returns None, and such work waits
for the engine's next step, as before.
"""

from __future__ import annotations

import functools
import logging
import queue
import sys
from collections.abc import Callable
from types import FrameType

logger = logging.getLogger("vllm.kvbroker.scheduler")

# Frames to look through: the connector is built a few calls below the engine core.
MAX_DEPTH = 40


def find_engine_wakeup() -> Callable[[], None] | None:
    """A callable that wakes the engine core whose constructor is on the stack, or None."""
    try:
        from vllm.v1.engine import EngineCoreRequestType
    except ImportError:
        return None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(MAX_DEPTH):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        inputs = getattr(owner, "input_queue", None)
        if isinstance(inputs, queue.Queue) and hasattr(owner, "_handle_client_request"):
            return functools.partial(inputs.put_nowait, (EngineCoreRequestType.WAKEUP, None))
        frame = frame.f_back
    logger.info("kvbroker: no engine core input queue found; pins of cached blocks wait for a step")
    return None
