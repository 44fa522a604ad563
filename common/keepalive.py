"""Keepalive pings, paired: how often our clients ping and what the broker accepts.

A gRPC server counts a ping that comes sooner than its allowed interval after
the last one (with no data in between) as a strike; after two strikes it
closes the connection with ``GOAWAY ENHANCE_YOUR_CALM "too_many_pings"``, and
every stream on it ends. gRPC's server default allows one ping per 5 minutes,
so a client pinging every 30 s on a quiet ``Watch`` or ``Mirror`` stream was
cut off after a few minutes. The two sides are set here, together:

- clients ping every ``CLIENT_PING_INTERVAL_MS`` while a call is open, also
  when no data flows (``max_pings_without_data`` 0: gRPC's default stops
  after two), so a dead broker is found on an idle stream too;
- the broker accepts pings down to ``SERVER_MIN_PING_INTERVAL_MS`` apart, a
  third of the client's interval, which leaves room for timer jitter and
  for clients configured to ping faster.
"""

from __future__ import annotations

from typing import Any

CLIENT_PING_INTERVAL_MS = 30_000
CLIENT_PING_TIMEOUT_MS = 10_000
SERVER_MIN_PING_INTERVAL_MS = 10_000
# Strikes before the broker sends GOAWAY (gRPC's default): a client pinging
# faster than allowed is told so soon, instead of being tolerated silently.
SERVER_MAX_PING_STRIKES = 2

# The debug text and status detail gRPC gives a client the broker cut off for pinging too often.
TOO_MANY_PINGS_MARKERS = ("too many pings", "too_many_pings")


def client_options(
    interval_ms: int = CLIENT_PING_INTERVAL_MS, timeout_ms: int = CLIENT_PING_TIMEOUT_MS
) -> list[tuple[str, Any]]:
    """Channel options for a client that pings every `interval_ms` while a call is open."""
    return [
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(min_interval_ms: int = SERVER_MIN_PING_INTERVAL_MS) -> list[tuple[str, Any]]:
    """Server options that accept a client's pings `min_interval_ms` apart, calls open or not."""
    return [
        ("grpc.http2.min_ping_interval_without_data_ms", min_interval_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", SERVER_MAX_PING_STRIKES),
    ]


def is_too_many_pings(message: str) -> bool:
    """Whether a gRPC error's details say the server closed the connection for too many pings."""
    lowered = message.lower()
    return any(marker in lowered for marker in TOO_MANY_PINGS_MARKERS)
