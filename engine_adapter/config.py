"""Adapter configuration, parsed from vLLM's ``kv_connector_extra_config``.

Every key is optional; unknown keys are refused so that a typo does not
silently fall back to a default. The fields follow kvbroker.common.settings,
the idiom every configuration uses; docs/adapter.md has the full table.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbroker.clients.credentials import ClientSecurity
from kvbroker.common import settings
from kvbroker.common.settings import setting


class AdapterConfigError(settings.SettingError):
    """The extra config cannot be used; the message names the key and the fix."""


@dataclass(frozen=True)
class AdapterConfig:
    broker_address: str = setting(
        "127.0.0.1:50051",
        "host:port of the broker's gRPC endpoint. Empty disables the broker: the engine serves normally and never pulls or holds.",
    )
    engine_id: str = setting("", "Unique name of this engine in the broker; generated when empty.")
    role: str = setting("both", "Free-form role label (prefill, decode, both) shown by `kvbroker engines`.")
    url: str = setting("", "Base URL of this engine's OpenAI server, published as a label for routers.")
    pull_policy: str = setting(
        "adaptive",
        "How to choose between pulling a remote prefix and recomputing it: adaptive (compare the predicted times, "
        "learned from this engine's own steps and pulls) or threshold (pull when the remote part has at least "
        "kv_recompute_threshold tokens). Setting kv_recompute_threshold without pull_policy selects threshold.",
        choices=("adaptive", "threshold"),
    )
    recompute_neighbour_cost: float = setting(
        1.0,
        "The adaptive policy counts what computing costs the requests already running on this engine: each "
        "second of prefill here also costs this many seconds per running request (they wait while it "
        "computes; a pull's wait does not stop them). 0 = the request's own first token only.",
    )
    kv_recompute_threshold: int = setting(
        64,
        "The fixed rule: pull only when the remote prefix beyond the local hit has at least this many tokens. "
        "The adaptive policy uses it until it has observed enough of this engine's steps.",
    )
    session_ttl_ms: int = setting(
        5000, "Session TTL: how long the broker keeps our leases after it last heard from us."
    )
    hold_ttl_ms: int = setting(
        30000, "TTL of a hold (blocks kept for a reader that has not claimed them yet)."
    )
    lease_ttl_ms: int = setting(10000, "TTL of a read lease (from claim to release).")
    read_timeout_ms: int = setting(
        60000, "A NIXL read not finished in this long fails, and its tokens are recomputed."
    )
    index_mirror: bool = setting(
        True,
        "Keep a live copy of the broker's index for this layout (the Mirror stream), so that the scheduler decides pull-or-recompute in the step it sees a request, without a round trip; the lease still comes from the broker.",
    )
    resolve_wait_ms: int = setting(
        500,
        "How long a new request may wait for the broker's answer before it is scheduled without a remote hit (recompute).",
    )
    acquire_wait_ms: int = setting(
        2000,
        "How long a claimed load may wait for the broker to grant the lease. Both waits count only time the scheduler runs (a gap over 0.25 s between checks counts 0.25 s).",
    )
    step_wait_ms: int = setting(
        20,
        "Longest a scheduler step waits for the broker's answer a pull needs now: the lease of a pull "
        "allocated in this step (its read then starts in this step) and the release of a read finished in "
        "this step's output (vLLM then schedules the prefill in the next step). Past it the answer is taken "
        "at a later step. 0: never wait (each answer costs a step).",
    )
    multi_turn: bool = setting(
        False,
        "D side: hold a finished request's blocks (prompt + answer) so that the next turn's prefill, wherever it runs, can pull them.",
    )
    cpu_tier_blocks: int = setting(
        0,
        "Slots (blocks) of the CPU offload tier, per rank (0 = off). Finished requests' full blocks are copied there and announced as tier CPU.",
    )
    verify_bytes: bool = setting(
        False,
        "Verified bytes: as a holder, state a digest (multilinear32-v1) per block and layer of what it "
        "holds for readers; as a reader, check every pulled block against it before the release commits, "
        "and recompute on a mismatch or when the holder states none. DRAM or VRAM KV memory; costs one "
        "pass over the bytes on both sides (docs/data_path.md).",
    )
    verify_sample: float = setting(
        1.0,
        "With verify_bytes, the share of each pulled block's layers the reader digests and checks, drawn "
        "at random for every pull and every block (at least one layer per block). 1.0: every byte. Below "
        "1 a wrong block is still always caught and a fault in one layer of one block with about this "
        "probability per pull, for less of the check's cost (0.0625: +2-7% of a read here, docs/data_path.md).",
    )
    retain_gpu_fraction: float = setting(
        0.5,
        "Most of the GPU KV cache that retentions (the broker's Retain: blocks kept with no reader) may pin "
        "at once; a retention beyond it is refused (holder_refused) so that vLLM keeps room to run. 0: none.",
    )
    retain_gpu_low_water: float = setting(
        0.05,
        "GPU retention pins are given up (least recently retained first; the broker ends each as "
        "memory_pressure) when vLLM's free KV blocks fall below this share of the cache at a step, or "
        "below what a waiting request's prompt needs plus this share. 0: only for waiting requests.",
    )
    tenant: str = setting("", "Tenant added to the namespace (with the request's cache_salt).")
    tls_ca: str = setting(
        "",
        "PEM file of the CA that signed the broker's certificate: TLS to the broker (default: $KVBROKER_TLS_CA).",
    )
    tls_cert: str = setting(
        "",
        "PEM file of this engine's client certificate for mutual TLS, URI SAN kvbroker://TENANT/engine/ENGINE_ID "
        "(default: $KVBROKER_TLS_CERT).",
    )
    tls_key: str = setting("", "PEM file of the private key of tls_cert (default: $KVBROKER_TLS_KEY).")
    tls_server_name: str = setting(
        "",
        "Name to expect in the broker's certificate, if not the address's host ($KVBROKER_TLS_SERVER_NAME).",
    )
    token_file: str = setting(
        "", "File holding this engine's bearer token, instead of a client certificate ($KVBROKER_TOKEN_FILE)."
    )
    stats_path: str = setting(
        "",
        "Optional file the scheduler side rewrites with its counters (JSON), for tests and operators, "
        "from a background thread (engine_adapter/stats.py); empty = off.",
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> AdapterConfig:
        try:
            config: AdapterConfig = settings.from_mapping(cls, extra, "kv_connector_extra_config")
        except settings.SettingError as exc:
            raise AdapterConfigError(str(exc)) from None
        if extra and "kv_recompute_threshold" in extra and "pull_policy" not in extra:
            # A fixed threshold asked for by name is an override: keep the fixed rule.
            config = dataclasses.replace(config, pull_policy="threshold")
        if not config.engine_id:
            config = dataclasses.replace(config, engine_id=f"engine-{uuid.uuid4().hex[:12]}")
        config.validate()
        return config

    def validate(self) -> None:
        if self.pull_policy not in ("adaptive", "threshold"):
            raise AdapterConfigError(f"pull_policy must be adaptive or threshold (got {self.pull_policy!r})")
        for name in ("session_ttl_ms", "hold_ttl_ms", "lease_ttl_ms"):
            if getattr(self, name) <= 0:
                raise AdapterConfigError(f"{name} must be > 0 (got {getattr(self, name)})")
        if not self.recompute_neighbour_cost >= 0:  # NaN too
            raise AdapterConfigError(
                f"recompute_neighbour_cost must be >= 0 (got {self.recompute_neighbour_cost})"
            )
        for name in (
            "kv_recompute_threshold",
            "resolve_wait_ms",
            "acquire_wait_ms",
            "step_wait_ms",
            "cpu_tier_blocks",
        ):
            if getattr(self, name) < 0:
                raise AdapterConfigError(f"{name} must be >= 0 (got {getattr(self, name)})")

        if not 0.0 <= self.retain_gpu_low_water < 1.0:
            raise AdapterConfigError(
                f"retain_gpu_low_water must be in [0, 1) (got {self.retain_gpu_low_water})"
            )
        if not 0.0 < self.verify_sample <= 1.0:  # NaN too
            raise AdapterConfigError(
                f"verify_sample must be in (0, 1] (got {self.verify_sample}): the share of each "
                "block's layers a verified pull checks, 1.0 for all"
            )
        if not 0.0 <= self.retain_gpu_fraction <= 1.0:
            raise AdapterConfigError(
                f"retain_gpu_fraction must be in [0, 1] (got {self.retain_gpu_fraction})"
            )

    @property
    def broker_enabled(self) -> bool:
        return bool(self.broker_address)

    def security(self) -> ClientSecurity:
        """The broker credentials: the keys given here, the rest from the KVBROKER_* variables."""
        return ClientSecurity.from_mapping(
            {
                name: getattr(self, name)
                for name in ("tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file")
            }
        )
