"""BrokerConfig: every knob of the broker, with its flag and environment variable.

Each field maps to a `--flag` (underscores become dashes) and an environment
variable KVBROKER_<FIELD in upper case> (the listen address: KVBROKER_LISTEN);
the flag wins over the variable, the variable over the default
(kvbroker.common.settings, the idiom every configuration uses). Each field's help is the --help text and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.broker.errors import InvalidArgument
from kvbroker.broker.leases import BYTES_PER_BLOCK, BYTES_PER_LEASE
from kvbroker.common import keepalive, settings
from kvbroker.common.settings import setting


def derived_leases_per_engine(memory_mib: int, max_lease_blocks: int) -> int:
    """How many of the largest leases fit one engine's lease memory budget (at least 1)."""
    return max(1, memory_mib * 1024 * 1024 // (max_lease_blocks * BYTES_PER_BLOCK + BYTES_PER_LEASE))


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    # KVBROKER_LISTEN, not KVBROKER_ADDRESS: one letter from KVBROKER_ADDR, the clients' broker address.
    address: str = setting(
        "127.0.0.1:50051",
        "host:port to listen on (port 0 picks a free one); on a non-loopback address such as [::]:50051 "
        "the broker needs TLS (--tls-cert) or --insecure",
        env="KVBROKER_LISTEN",
    )
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
    max_pending_calls: int = setting(
        10_000,
        "most calls that have arrived and wait for the broker to take them up (a burst); beyond, gRPC "
        "refuses a call with CANCELLED (each waiting call costs about 10 KiB)",
    )
    max_health_watchers: int = setting(
        1_024, "most concurrent grpc.health.v1 Watch streams (beyond: RESOURCE_EXHAUSTED)"
    )
    mirror_chunk: int = setting(
        8_192, "index entries per snapshot step of a new Mirror stream (smaller: shorter pauses)"
    )
    mirror_keepalive_ms: int = setting(
        1_000,
        "an idle Mirror stream gets an empty update this often, so a mirror can tell a quiet "
        "index from a silent broker",
    )
    ended_lease_history: int = setting(
        10_000, "ended leases kept for ListLeases(include_ended) and precise release errors"
    )
    max_lease_blocks: int = setting(8_192, "most blocks in one lease (a hold or a resolve's acquire)")
    lease_memory_mib: int = setting(
        256,
        "memory budget, in MiB, for the live leases one engine holds (and, apart, for those it reads): "
        "--max-leases-per-engine 0 derives its cap from it, budget / (--max-lease-blocks x "
        f"{BYTES_PER_BLOCK} bytes + {BYTES_PER_LEASE} bytes), measured by bench/control_plane/lease_memory.py; "
        f"{derived_leases_per_engine(256, 8_192)} leases at the defaults",
    )
    index_memory_mib: int = setting(
        0,
        "memory budget, in MiB, for the in-memory prefix index (0 = unbounded); past it the least recently "
        "matched or announced blocks are forgotten (a miss, never a wrong holder), those of the engine "
        "holding the most first; counted in kvbroker_index_forgotten_total (docs/broker.md#index-memory). "
        "With --state: the store's index keys and mirror change streams as Redis's MEMORY USAGE counts "
        "them (the streams an eighth, trimmed at every write), kept as an entry bound derived from the "
        "store's bytes per entry (docs/scale.md#bounding-the-stores-index); not with --index-max-entries",
    )
    index_max_entries: int = setting(
        0,
        "most distinct blocks the --state store's prefix index keeps, fleet-wide (0 = unbounded); past it "
        "the least recently matched or announced blocks are forgotten (a miss, never a wrong holder), "
        "those of the engine with the most blocks in the namespace first, at most 1,024 per call; counted "
        "in kvbroker_index_forgotten_total (docs/scale.md#bounding-the-stores-index). --state only: the "
        "in-memory index takes --index-memory-mib",
    )
    max_retentions_per_tenant: int = setting(
        1_024,
        "most live retentions (Retain: a conversation's prefix kept with no reader) per tenant "
        "(RESOURCE_EXHAUSTED, cause quota_exceeded, beyond; 0 = no limit); each is also a lease of its holder",
    )
    max_leases_per_engine: int = setting(
        0,
        "most live leases an engine may hold, and most it may read (RESOURCE_EXHAUSTED beyond); "
        "0 = derived from --lease-memory-mib",
    )
    ended_lease_history_blocks: int = setting(
        1_000_000, "most block hashes kept in the ended-lease history, over all its leases"
    )
    list_page_size: int = setting(
        1_000, "most leases or engines in one ListLeases/ListEngines answer (page_size 0 or larger)"
    )
    max_id_bytes: int = setting(
        256, "longest id accepted: engine, lease, request and agent ids, namespace layout and tenant"
    )
    max_labels_bytes: int = setting(16_384, "most bytes of an engine's labels (keys and values together)")
    max_engine_info_bytes: int = setting(
        4 * 1024 * 1024,
        "largest engine registration, all ranks' NIXL agent metadata included (at most half of --max-message-bytes)",
    )
    max_text_bytes: int = setting(
        1_024, "longest free-form text kept (reasons, pin errors, fingerprint fields); longer: cut"
    )
    register_timeout_ms: int = setting(
        10_000, "a Session stream that sends no 'register' within this is closed (DEADLINE_EXCEEDED)"
    )
    watch_buffer_bytes: int = setting(
        16 * 1024 * 1024, "most bytes of events buffered for one Watch stream; beyond it is cut off"
    )
    session_buffer_bytes: int = setting(
        64 * 1024 * 1024,
        "most bytes of answers and notices waiting for an engine to read its Session stream; beyond: ended",
    )
    mirror_buffer_bytes: int = setting(
        64 * 1024 * 1024,
        "most bytes of changes buffered for one Mirror stream; beyond it gets a fresh snapshot",
    )
    expiry_interval_ms: int = setting(50, "how often the expiry loop looks for expired leases and sessions")
    expiry_batch: int = setting(1_000, "most leases or sessions ended per expiry pass (rate limit)")
    keepalive_min_ping_interval_ms: int = setting(
        keepalive.SERVER_MIN_PING_INTERVAL_MS,
        "shortest interval between a client's keepalive pings the broker accepts on a quiet connection "
        f"(kvbroker clients ping every {keepalive.CLIENT_PING_INTERVAL_MS // 1000} s); a client pinging "
        "faster gets GOAWAY too_many_pings",
    )
    metrics_port: int = setting(
        9400, "Prometheus /metrics port (0 = off; a port already taken turns metrics off with a warning)"
    )
    metrics_host: str = setting(
        "127.0.0.1",
        "Prometheus /metrics listen host; any other than loopback serves HTTPS with the broker's "
        "certificate (operators of tenant '*' only, when the broker has identities), or needs --insecure "
        "for plain HTTP (docs/security.md)",
    )
    indexer_http: str = setting(
        "",
        "HOST:PORT to serve the KV-indexer HTTP API on (Mooncake Conductor's /query, /query_by_hash, "
        "/register as Dynamo speaks it; docs/indexer.md); empty = off; a non-loopback host needs TLS or "
        "--insecure",
    )
    kv_events: str = setting(
        "",
        "vLLM engines without our connector to follow by their KV cache events, comma-separated "
        "ENGINE_ID=tcp://HOST:PORT?model=NAME&block_size=N (docs/indexer.md); needs pyzmq and msgspec",
    )
    kv_events_max_frame_bytes: int = setting(
        16 * 1024 * 1024,
        "largest KV-event frame a --kv-events feed reads; a publisher sending a larger one is disconnected "
        "(ZMQ_MAXMSGSIZE) before it is read into memory",
    )
    otlp_endpoint: str = setting(
        "",
        "OTLP endpoint for traces (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, then "
        "$OTEL_EXPORTER_OTLP_ENDPOINT; empty = no OTLP export); protocol, exporter and service name "
        "follow OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_TRACES_EXPORTER and OTEL_SERVICE_NAME",
    )
    state: str = setting(
        "",
        "where the broker keeps its state: empty = in this process (the default); redis://HOST:PORT[/DB] "
        "or rediss://HOST:PORT (TLS) = a shared Redis or Valkey; redis+cluster://HOST:PORT[,HOST:PORT...] "
        "(rediss+cluster:// for TLS) = a Redis or Valkey Cluster by its seed nodes; "
        "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE (rediss+sentinel:// for TLS) = a Sentinel-managed "
        "primary: leases and the prefix "
        "index live there (docs/scale.md)",
    )
    state_prefix: str = setting("kvb", "key prefix in the --state store (brokers of one fleet share it)")
    shutdown_grace_s: float = setting(5.0, "seconds in-flight calls get to finish on SIGINT/SIGTERM")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")

    @property
    def leases_per_engine(self) -> int:
        """The cap on live leases per engine: --max-leases-per-engine, else derived from the budget."""
        return self.max_leases_per_engine or derived_leases_per_engine(
            self.lease_memory_mib, self.max_lease_blocks
        )

    @property
    def index_memory_bytes(self) -> int:
        return self.index_memory_mib * 1024 * 1024

    def validate(self) -> None:
        if self.index_memory_mib < 0:
            raise InvalidArgument("index_memory_mib must be >= 0 (0: unbounded)")
        if self.index_memory_mib and self.index_max_entries:
            raise InvalidArgument(
                "index_memory_mib and index_max_entries both bound the --state store's index: set one "
                "(bytes, or entries)"
            )
        if self.index_max_entries < 0:
            raise InvalidArgument("index_max_entries must be >= 0 (0: unbounded)")
        if self.index_max_entries and not self.state:
            raise InvalidArgument(
                "index_max_entries bounds the --state store's index only; bound the in-memory index with "
                "index_memory_mib"
            )
        if self.max_leases_per_engine < 0:
            raise InvalidArgument("max_leases_per_engine must be >= 0 (0: derived from lease_memory_mib)")
        if not 0 < self.session_ttl_min_ms <= self.session_ttl_ms <= self.session_ttl_max_ms:
            raise InvalidArgument("need 0 < session_ttl_min_ms <= session_ttl_ms <= session_ttl_max_ms")
        if not 0 < self.lease_ttl_min_ms <= self.lease_ttl_ms <= self.lease_ttl_max_ms:
            raise InvalidArgument("need 0 < lease_ttl_min_ms <= lease_ttl_ms <= lease_ttl_max_ms")
        for name in (
            "pin_timeout_ms",
            "max_hashes",
            "max_message_bytes",
            "max_pending_calls",
            "expiry_interval_ms",
            "expiry_batch",
            "mirror_chunk",
            "mirror_keepalive_ms",
            "keepalive_min_ping_interval_ms",
            "max_lease_blocks",
            "lease_memory_mib",
            "list_page_size",
            "max_id_bytes",
            "max_labels_bytes",
            "max_engine_info_bytes",
            "max_text_bytes",
            "register_timeout_ms",
            "watch_buffer_bytes",
            "mirror_buffer_bytes",
            "session_buffer_bytes",
            "kv_events_max_frame_bytes",
        ):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0")


ENV_PREFIX = "KVBROKER_"


def env_name(field_name: str) -> str:
    """The environment variable that sets `field_name`."""
    field = BrokerConfig.__dataclass_fields__[field_name]
    return settings.env_name(field, ENV_PREFIX)
