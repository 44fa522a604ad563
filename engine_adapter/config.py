"""Adapter configuration, parsed from vLLM's ``kv_connector_extra_config``.

Every key is optional; unknown keys are refused so that a typo does not
silently fall back to a default. See docs/adapter.md for the full table.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class AdapterConfigError(ValueError):
    """The extra config cannot be used; the message names the key and the fix."""


@dataclass(frozen=True)
class AdapterConfig:
    # host:port of the broker's gRPC endpoint. Empty disables the broker: the
    # engine serves normally and never pulls or holds.
    broker_address: str = "127.0.0.1:50051"
    # Unique name of this engine in the broker; generated when empty.
    engine_id: str = ""
    # Free-form role label (prefill, decode, both) shown by `kvbroker engines`.
    role: str = "both"
    # Base URL of this engine's OpenAI server, published as a label for routers.
    url: str = ""
    # Pull only when the remote prefix beyond the local hit has at least this
    # many tokens; shorter ones are cheaper to recompute.
    kv_recompute_threshold: int = 64
    # Session TTL: how long the broker keeps our leases after it last heard from us.
    session_ttl_ms: int = 5000
    # TTL of a hold (blocks kept for a reader that has not claimed them yet).
    hold_ttl_ms: int = 30000
    # TTL of a read lease (from claim to release).
    lease_ttl_ms: int = 10000
    # Keep a live copy of the broker's index for this layout (the Mirror stream),
    # so that the scheduler decides pull-or-recompute in the step it sees a
    # request, without a round trip; the lease still comes from the broker.
    index_mirror: bool = True
    # How long a new request may wait for the broker's answer before it is
    # scheduled without a remote hit (recompute).
    resolve_wait_ms: int = 500
    # How long a claimed load may wait for the broker to grant the lease. Both waits
    # count only time the scheduler runs (a gap over 0.25 s between checks counts 0.25 s).
    acquire_wait_ms: int = 2000
    # D side: hold a finished request's blocks (prompt + answer) so that the
    # next turn's prefill, wherever it runs, can pull them.
    multi_turn: bool = False
    # Slots (blocks) of the CPU offload tier, per rank (0 = off). Finished
    # requests' full blocks are copied there and announced as tier CPU.
    cpu_tier_blocks: int = 0
    # Tenant added to the namespace (with the request's cache_salt).
    tenant: str = ""
    # Optional file the scheduler side rewrites with its counters (JSON), for
    # tests and operators, from a background thread (engine_adapter/stats.py);
    # empty = off.
    stats_path: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> AdapterConfig:
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise AdapterConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; known keys: {sorted(fields)}"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = fields[name].default
            values[name] = _coerce(name, value, type(default))
        config = cls(**values)
        if not config.engine_id:
            config = dataclasses.replace(config, engine_id=f"engine-{uuid.uuid4().hex[:12]}")
        config.validate()
        return config

    def validate(self) -> None:
        for name in ("session_ttl_ms", "hold_ttl_ms", "lease_ttl_ms"):
            if getattr(self, name) <= 0:
                raise AdapterConfigError(f"{name} must be > 0 (got {getattr(self, name)})")
        for name in ("kv_recompute_threshold", "resolve_wait_ms", "acquire_wait_ms", "cpu_tier_blocks"):
            if getattr(self, name) < 0:
                raise AdapterConfigError(f"{name} must be >= 0 (got {getattr(self, name)})")

    @property
    def broker_enabled(self) -> bool:
        return bool(self.broker_address)


def _coerce(name: str, value: Any, kind: type) -> Any:
    """Accept JSON-ish values (\"64\", \"true\") as well as typed ones."""
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off", ""):
                    return False
                raise ValueError(value)
            return bool(value)
        if kind is int:
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        return str(value)
    except (TypeError, ValueError):
        raise AdapterConfigError(
            f"kv_connector_extra_config[{name!r}] = {value!r} is not a valid {kind.__name__}"
        ) from None
