"""An engine's session with the broker: liveness, inventory, resolve and lease commands.

``EngineSession`` (asyncio) keeps one bidirectional ``Session`` stream open:

- registers the engine, then heartbeats every third of the session TTL (or
  the interval the broker asks for), and gives the stream up by the silence
  rules of ``kvbroker.clients.liveness``: with one broker address only after
  ``SILENCE_TTLS`` TTLs without a word (the broker decides whether the session
  lives); with several replicas (``KVBROKER_ADDR=a,b``) after a heartbeat went
  unanswered for a quarter of the TTL, moving to the next replica, which
  resumes the session before its TTL ends (a frozen replica or a dark link
  costs no session and no lease). Time this process itself did not run (a
  timer firing late) is not counted as the broker's silence;
- reconnects with exponential back-off and jitter; after a reconnect (a
  broken stream, a broker restart) it registers again and re-announces its
  whole inventory from a local mirror, so the broker's soft state comes back
  without the engine doing anything;
- coalesces ``announce_stored`` / ``announce_removed`` over a few
  milliseconds (or until N hashes are pending) into few ``InventoryUpdate``
  messages;
- resolves over the stream (replies matched by sequence number), which costs
  far less than a unary call;
- ``await applied()`` returns once the broker has applied everything the
  session was told before the call (a heartbeat's acknowledgement, which the
  broker sends only after handling every earlier message of the stream);
- hands ``PinCommand`` to ``on_pin`` and sends back its ``PinResult``, and
  reports ``LeaseRevoked`` / ``LeaseEnded`` / ``DrainCommand`` to callbacks.

``ThreadedEngineSession`` hosts the same on a background thread's event loop
for synchronous callers such as vLLM's scheduler: announce calls return at
once, and resolve/hold/acquire/renew/release return
``concurrent.futures.Future`` objects; a future that is not done is simply
"not ready yet", so the caller never waits on the broker.

Both take ``clock=`` (monotonic by default) for heartbeats, the silence
limit, stall forgiveness and back-off.

This module gathers the public names; the code lives in

- ``kvbroker.clients.session_stream``: the stream itself (registration,
  heartbeats, silence and stall handling, reconnects with ``Backoff``, the
  broker's commands and callbacks, replies matched by seq, the barrier);
- ``kvbroker.clients.clock``: the clock those timing decisions go by
  (``MonotonicClock``; ``ManualClock`` for tests);
- ``kvbroker.clients.inventory``: ``InventoryMirror``, what the engine holds
  and the changes not yet sent;
- ``kvbroker.clients.engine_session``: ``EngineSession``, the stream plus
  inventory, resolves, lease calls and the index mirror hookup;
- ``kvbroker.clients.threaded_session``: ``ThreadedEngineSession``.
"""

from __future__ import annotations

from kvbroker.clients.backoff import Backoff
from kvbroker.clients.engine_session import DEFAULT_RESOLVE_TIMEOUT_S, EngineSession
from kvbroker.clients.inventory import (
    DEFAULT_MAX_HASHES_PER_UPDATE,
    InventoryKey,
    InventoryMirror,
    NamespaceLike,
    namespace_key,
)
from kvbroker.clients.liveness import SILENCE_TTLS, STALL_S
from kvbroker.clients.session_stream import DEFAULT_SESSION_TTL_MS, PinReply
from kvbroker.clients.threaded_session import ThreadedEngineSession

__all__ = [
    "DEFAULT_MAX_HASHES_PER_UPDATE",
    "DEFAULT_RESOLVE_TIMEOUT_S",
    "DEFAULT_SESSION_TTL_MS",
    "SILENCE_TTLS",
    "STALL_S",
    "Backoff",
    "EngineSession",
    "InventoryKey",
    "InventoryMirror",
    "NamespaceLike",
    "PinReply",
    "ThreadedEngineSession",
    "namespace_key",
]
