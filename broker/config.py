"""BrokerConfig: every knob of the broker, with its flag and environment variable.

Each field maps to a `--flag` (underscores become dashes) and an environment
variable KVBROKER_<FIELD in upper case>; the flag wins over the variable,
the variable over the default. `FIELD_HELP` is the --help text and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvbroker.broker.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    address: str = "[::]:50051"
    session_ttl_ms: int = 10_000
    session_ttl_min_ms: int = 300
    session_ttl_max_ms: int = 300_000
    lease_ttl_ms: int = 30_000
    lease_ttl_min_ms: int = 100
    lease_ttl_max_ms: int = 3_600_000
    pin_timeout_ms: int = 2_000
    max_hashes: int = 16_384
    max_message_bytes: int = 16 * 1024 * 1024
    max_watchers: int = 64
    max_mirrors: int = 256
    mirror_chunk: int = 8_192
    ended_lease_history: int = 10_000
    expiry_interval_ms: int = 50
    expiry_batch: int = 1_000
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    otlp_endpoint: str = ""
    shutdown_grace_s: float = 5.0
    log_level: str = "INFO"

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


FIELD_HELP: dict[str, str] = {
    "address": "host:port to listen on ([::]:0 picks a free port)",
    "session_ttl_ms": "session TTL granted when an engine asks for 0; heartbeats come every TTL/3",
    "session_ttl_min_ms": "smallest session TTL an engine may ask for (smaller: OUT_OF_RANGE)",
    "session_ttl_max_ms": "largest session TTL an engine may ask for (larger: OUT_OF_RANGE)",
    "lease_ttl_ms": "lease TTL when a request asks for 0",
    "lease_ttl_min_ms": "smallest lease TTL a request may ask for",
    "lease_ttl_max_ms": "largest lease TTL a request may ask for",
    "pin_timeout_ms": "how long a holder has to answer a PinCommand before the lease is revoked",
    "max_hashes": "most block hashes in one request (hold, resolve, score, inventory lists)",
    "max_message_bytes": "largest gRPC message accepted or sent (RESOURCE_EXHAUSTED beyond)",
    "max_watchers": "most concurrent Watch streams",
    "max_mirrors": "most concurrent Mirror streams (each costs a copy of every index change of its layout)",
    "mirror_chunk": "index entries per snapshot step of a new Mirror stream (smaller: shorter pauses)",
    "ended_lease_history": "ended leases kept for ListLeases(include_ended) and precise release errors",
    "expiry_interval_ms": "how often the expiry loop looks for expired leases and sessions",
    "expiry_batch": "most leases or sessions ended per expiry pass (rate limit)",
    "metrics_port": "Prometheus /metrics port (0 = off)",
    "metrics_host": "Prometheus listen host",
    "otlp_endpoint": "OTLP gRPC endpoint for traces (default: $OTEL_EXPORTER_OTLP_ENDPOINT; empty = off)",
    "shutdown_grace_s": "seconds in-flight calls get to finish on SIGINT/SIGTERM",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
}

ENV_PREFIX = "KVBROKER_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def field_names() -> list[str]:
    return [f.name for f in fields(BrokerConfig)]
