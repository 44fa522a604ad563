"""BrokerConfig: every knob of the broker, with its flag and environment variable.

Each field maps to a `--flag` (underscores become dashes) and an environment
variable KVBROKER_<FIELD in upper case>; the flag wins over the variable,
the variable over the default (kvbroker.common.settings, the idiom every
configuration uses). Each field's help is the --help text and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.broker.errors import InvalidArgument
from kvbroker.common.settings import setting


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    address: str = setting("[::]:50051", "host:port to listen on ([::]:0 picks a free port)")
    session_ttl_ms: int = setting(
        10_000, "session TTL granted when an engine asks for 0; heartbeats come every TTL/3"
    )
    session_ttl_min_ms: int = setting(
        300, "smallest session TTL an engine may ask for (smaller: OUT_OF_RANGE)"
    )
    session_ttl_max_ms: int = setting(
        300_000, "largest session TTL an engine may ask for (larger: OUT_OF_RANGE)"
    )
    lease_ttl_ms: int = setting(30_000, "lease TTL when a request asks for 0")
    lease_ttl_min_ms: int = setting(100, "smallest lease TTL a request may ask for")
    lease_ttl_max_ms: int = setting(3_600_000, "largest lease TTL a request may ask for")
    pin_timeout_ms: int = setting(
        2_000, "how long a holder has to answer a PinCommand before the lease is revoked"
    )
    max_hashes: int = setting(
        16_384, "most block hashes in one request (hold, resolve, score, inventory lists)"
    )
    max_message_bytes: int = setting(
        16 * 1024 * 1024, "largest gRPC message accepted or sent (RESOURCE_EXHAUSTED beyond)"
    )
    max_watchers: int = setting(64, "most concurrent Watch streams")
    max_mirrors: int = setting(
        256, "most concurrent Mirror streams (each costs a copy of every index change of its layout)"
    )
    mirror_chunk: int = setting(
        8_192, "index entries per snapshot step of a new Mirror stream (smaller: shorter pauses)"
    )
    ended_lease_history: int = setting(
        10_000, "ended leases kept for ListLeases(include_ended) and precise release errors"
    )
    expiry_interval_ms: int = setting(50, "how often the expiry loop looks for expired leases and sessions")
    expiry_batch: int = setting(1_000, "most leases or sessions ended per expiry pass (rate limit)")
    metrics_port: int = setting(
        9400, "Prometheus /metrics port (0 = off; a port already taken turns metrics off with a warning)"
    )
    metrics_host: str = setting("0.0.0.0", "Prometheus listen host")
    otlp_endpoint: str = setting(
        "", "OTLP gRPC endpoint for traces (default: $OTEL_EXPORTER_OTLP_ENDPOINT; empty = off)"
    )
    shutdown_grace_s: float = setting(5.0, "seconds in-flight calls get to finish on SIGINT/SIGTERM")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")

    def validate(self) -> None:
        if not 0 < self.session_ttl_min_ms <= self.session_ttl_ms <= self.session_ttl_max_ms:
            raise InvalidArgument("need 0 < session_ttl_min_ms <= session_ttl_ms <= session_ttl_max_ms")
        if not 0 < self.lease_ttl_min_ms <= self.lease_ttl_ms <= self.lease_ttl_max_ms:
            raise InvalidArgument("need 0 < lease_ttl_min_ms <= lease_ttl_ms <= lease_ttl_max_ms")
        for name in (
            "pin_timeout_ms",
            "max_hashes",
            "max_message_bytes",
            "expiry_interval_ms",
            "expiry_batch",
            "mirror_chunk",
        ):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0")


ENV_PREFIX = "KVBROKER_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()
