"""Small value types shared by the domain modules.

Enum values equal the proto's, so the codec converts by number.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Tier(enum.IntEnum):
    GPU = 1
    CPU = 2


class LeaseState(enum.IntEnum):
    PENDING = 1
    HELD = 2
    ACTIVE = 3
    RELEASED = 4
    REVOKED = 5

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def live(self) -> bool:
        return self in (LeaseState.PENDING, LeaseState.HELD, LeaseState.ACTIVE)


class RevokeCause(enum.IntEnum):
    NONE = 0
    TTL_EXPIRED = 1
    READER_GONE = 2
    HOLDER_GONE = 3
    OPERATOR = 4
    HOLDER_REFUSED = 5
    DRAIN = 6
    SUPERSEDED = 7
    DECLINED = 8
    MEMORY_PRESSURE = 9

    @property
    def label(self) -> str:
        return self.name.lower()


class Namespace(NamedTuple):
    layout_id: str
    tenant: str


# An engine the broker learns of from vLLM's KV cache events instead of our connector: its
# EngineInfo carries this label. Routers may score it; nobody may pull from it (no leases).
SOURCE_LABEL = "kvbroker.source"
EVENT_FED = "kv-events"


def is_event_fed(labels: object) -> bool:
    """Whether an engine's labels (a mapping) mark it as fed by KV events."""
    get = getattr(labels, "get", None)
    return get is not None and get(SOURCE_LABEL) == EVENT_FED
