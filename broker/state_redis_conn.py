"""The connection to the shared state store (Redis or Valkey) behind `kvbroker serve --state`.

One blocking client per replica: the core is synchronous, and each call is
one round trip on a local network (a Lua script, a pipeline), well under the
few milliseconds a request may hold the event loop. A store that does not
answer turns into `Unavailable` (gRPC UNAVAILABLE, cause `state_unavailable`):
the broker refuses what it cannot record instead of guessing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from kvbroker.broker.errors import InvalidArgument, Unavailable

T = TypeVar("T")

SCHEMES = ("redis://", "rediss://", "unix://")


class RedisState:
    """A Redis client, the fleet's key prefix, and the one place Redis errors become broker errors."""

    def __init__(self, url: str, prefix: str = "kvb", timeout_s: float = 2.0) -> None:
        if not url.startswith(SCHEMES):
            raise InvalidArgument(
                f"--state {url!r} is not a Redis URL: use redis://HOST:PORT[/DB] or rediss://HOST:PORT "
                "(TLS), or leave it empty for the in-memory broker"
            )
        self.url = url
        self.prefix = prefix
        self.client: redis.Redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=10
        )

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as err:
            raise Unavailable(f"the shared state store {self.url} does not answer: {err}") from None
        except redis.ResponseError as err:
            if "READONLY" in str(err) or "LOADING" in str(err) or "MASTERDOWN" in str(err):
                raise Unavailable(
                    f"the shared state store {self.url} cannot take writes now: {err}"
                ) from None
            raise

    def now(self) -> float:
        """Seconds of wall-clock time: deadlines in the store must mean the same on every replica."""
        return time.time()

    def ping(self) -> None:
        self.call(self.client.ping)

    def close(self) -> None:
        self.client.close()
