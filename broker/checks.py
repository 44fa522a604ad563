"""The checks a request passes before the core changes anything: TTL ranges and
per-request limits from the config, sizes of strings and registrations, loads,
tiers, namespaces and layouts."""

from __future__ import annotations

import math

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.errors import FailedPrecondition, InvalidArgument, OutOfRange, ResourceExhausted, shown
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.causes import Cause
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb


class Checks:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        # An engine must fit in one ListEngines page (half a message), whatever the flags say.
        self.engine_bytes = min(config.max_engine_info_bytes, config.max_message_bytes // 2)

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

    def ident(self, value: str, what: str) -> None:
        """An id (engine, lease, request, tenant...) no longer than --max-id-bytes."""
        limit = self.config.max_id_bytes
        size = len(value.encode())
        if size > limit:
            raise InvalidArgument(
                f"{what} {shown(value)} is {size} bytes; the limit is {limit} (--max-id-bytes)"
            )

    def text(self, value: str) -> str:
        """Free-form text (a reason, a holder's error), cut to --max-text-bytes."""
        limit = self.config.max_text_bytes
        if len(value) <= limit:
            return value
        return value[:limit] + f"... ({len(value)} chars)"

    @staticmethod
    def load(load: float, what: str) -> None:
        if not math.isfinite(load) or load < 0:
            raise InvalidArgument(f"{what} is {load}; a load must be a finite number >= 0")

    def namespace(self, ns: Namespace) -> None:
        if not ns.layout_id:
            raise InvalidArgument(
                "namespace.layout_id is empty; use the layout_id the broker returned at registration"
            )
        self.ident(ns.layout_id, "namespace.layout_id")
        self.ident(ns.tenant, "namespace.tenant")

    def engine(self, info: pb.EngineInfo) -> None:
        """A registration's sizes: its id, labels, fingerprint strings, ranks and the whole of it."""
        c = self.config
        self.ident(info.engine_id, "engine.engine_id")
        self.load(info.load, "engine.load")
        labels = sum(len(k.encode()) + len(v.encode()) for k, v in info.labels.items())
        if labels > c.max_labels_bytes:
            raise InvalidArgument(
                f"engine.labels are {labels} bytes; the limit is {c.max_labels_bytes} (--max-labels-bytes)"
            )
        fp = info.layout
        for name in ("model", "dtype", "hash_algo", "kv_layout", "engine_version"):
            size = len(getattr(fp, name).encode())
            if size > c.max_text_bytes:
                raise InvalidArgument(
                    f"engine.layout.{name} is {size} bytes; the limit is {c.max_text_bytes} (--max-text-bytes)"
                )
        for rank in info.ranks:
            self.rank(rank)
        size = info.ByteSize()
        if size > self.engine_bytes:
            raise InvalidArgument(
                f"the registration of engine {shown(info.engine_id)} is {size} bytes; the limit is "
                f"{self.engine_bytes} (--max-engine-info-bytes, at most half of --max-message-bytes)"
            )

    def rank(self, rank: pb.RankInfo) -> None:
        self.ident(rank.agent_name, "rank.agent_name")
        size = rank.ByteSize()
        if size > self.engine_bytes:
            raise InvalidArgument(
                f"rank (pp_rank={rank.pp_rank}, tp_rank={rank.tp_rank}) is {size} bytes; the limit "
                f"for a whole engine is {self.engine_bytes} (--max-engine-info-bytes)"
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
                f"namespace layout_id {shown(ns.layout_id)} does not match engine {shown(rec.engine_id)}'s "
                f"layout {rec.layout_id!r}; blocks never cross layouts",
                Cause.LAYOUT_MISMATCH,
            )

    def rank_fits(self, rec: EngineRecord, rank: pb.RankInfo) -> None:
        """The engine's registration with `rank` added (or replaced) stays within its size limit."""
        key = (rank.pp_rank, rank.tp_rank)
        others = sum(r.ByteSize() for k, r in rec.ranks.items() if k != key)
        size = rec.info.ByteSize() + others + rank.ByteSize()
        limit = self.engine_bytes
        if size > limit:
            raise InvalidArgument(
                f"with this rank, engine {shown(rec.engine_id)}'s registration would be {size} bytes; "
                f"the limit is {limit} (--max-engine-info-bytes)"
            )

    @staticmethod
    def readable(incompatibility: str | None, reader_id: str, holder_id: str) -> None:
        """FAILED_PRECONDITION when the reader cannot read the holder's blocks (the reason given)."""
        if incompatibility is not None:
            raise FailedPrecondition(
                f"reader {shown(reader_id)} cannot read holder {shown(holder_id)}: {incompatibility}",
                Cause.INCOMPATIBLE,
            )

    def lease_blocks(self, blocks: int) -> None:
        """A new lease of `blocks` fits the per-lease limit (RESOURCE_EXHAUSTED if not). The limit of
        live leases per engine is checked by the lease table as it creates or claims one."""
        c = self.config
        if blocks > c.max_lease_blocks:
            raise ResourceExhausted(
                f"a lease of {blocks} blocks is over the limit of {c.max_lease_blocks} (--max-lease-blocks); "
                "hold or read fewer blocks",
                metadata={"limit": str(c.max_lease_blocks)},
            )
