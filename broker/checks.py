"""The checks a request passes before the core changes anything: TTL ranges and
per-request limits from the config, tiers, namespaces and layouts."""

from __future__ import annotations

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.errors import FailedPrecondition, InvalidArgument, OutOfRange
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.causes import Cause
from kvbroker.common.model import Namespace, Tier


class Checks:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config

    @staticmethod
    def _ttl_s(ttl_ms: int, default: int, lo: int, hi: int, what: str) -> float:
        if ttl_ms == 0:
            return default / 1000
        if not lo <= ttl_ms <= hi:
            raise OutOfRange(f"{what} {ttl_ms} ms is outside the allowed range [{lo}, {hi}] ms")
        return ttl_ms / 1000

    def session_ttl_s(self, ttl_ms: int) -> float:
        c = self.config
        return self._ttl_s(
            ttl_ms, c.session_ttl_ms, c.session_ttl_min_ms, c.session_ttl_max_ms, "session_ttl_ms"
        )

    def lease_ttl_s(self, ttl_ms: int) -> float:
        c = self.config
        return self._ttl_s(ttl_ms, c.lease_ttl_ms, c.lease_ttl_min_ms, c.lease_ttl_max_ms, "lease ttl_ms")

    def hashes(self, n: int, what: str) -> None:
        if n > self.config.max_hashes:
            raise InvalidArgument(
                f"{what} has {n} entries; the limit is {self.config.max_hashes} per request "
                "(--max-hashes); split the request"
            )

    @staticmethod
    def namespace(ns: Namespace) -> None:
        if not ns.layout_id:
            raise InvalidArgument(
                "namespace.layout_id is empty; use the layout_id the broker returned at registration"
            )

    @staticmethod
    def tier(tier: int) -> Tier:
        if tier not in (Tier.GPU, Tier.CPU):
            raise InvalidArgument(f"tier {tier} is not TIER_GPU (1) or TIER_CPU (2)")
        return Tier(tier)

    @staticmethod
    def layout(rec: EngineRecord, ns: Namespace) -> None:
        if ns.layout_id != rec.layout_id:
            raise FailedPrecondition(
                f"namespace layout_id {ns.layout_id!r} does not match engine {rec.engine_id!r}'s "
                f"layout {rec.layout_id!r}; blocks never cross layouts",
                Cause.LAYOUT_MISMATCH,
            )
