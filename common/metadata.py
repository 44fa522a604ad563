"""The call metadata keys the broker and its clients share (defined once, here).

- ``kvbroker-engine-id``: a unary Resolve asks as this engine (the broker
  checks that the caller is that engine: broker/security/engine_identity.py).
- ``kvbroker-session-id``: the session id the broker gave an engine at
  registration, the proof that a unary call comes from that engine when the
  broker has no identities.
"""

from __future__ import annotations

ENGINE_ID_METADATA = "kvbroker-engine-id"
SESSION_ID_METADATA = "kvbroker-session-id"
