"""Proto <-> domain conversion. No decisions here: only shapes."""

from __future__ import annotations

from typing import Any

from kvbroker.broker.events import WatchEvent
from kvbroker.broker.leases import Lease
from kvbroker.broker.registry import EngineRecord
from kvbroker.broker.results import ResolveResult, ScoreResult, Stats
from kvbroker.common.model import Namespace
from kvbroker.common.scoring import HolderMatch
from kvbroker.v1 import broker_pb2 as pb


def namespace(msg: pb.Namespace) -> Namespace:
    return Namespace(msg.layout_id, msg.tenant)


def resolve_options(req: pb.ResolveRequest) -> dict[str, Any]:
    """A ResolveRequest's options, as BrokerCore.resolve takes them (the same on the stream and unary)."""
    return {
        "acquire": req.acquire,
        "lease_ttl_ms": req.lease_ttl_ms,
        "min_blocks": req.min_blocks,
        "request_id": req.request_id,
        "require_exact": req.require_exact,
    }


def lease_pb(lease: Lease, now: float) -> pb.Lease:
    return pb.Lease(
        lease_id=lease.lease_id,
        holder_engine_id=lease.holder,
        reader_engine_id=lease.reader,
        namespace=pb.Namespace(layout_id=lease.namespace.layout_id, tenant=lease.namespace.tenant),
        tier=int(lease.tier),  # type: ignore[arg-type]
        block_hashes=lease.block_hashes,
        block_ids=lease.block_ids,
        state=int(lease.state),  # type: ignore[arg-type]
        ttl_ms=lease.remaining_ms(now),
        epoch=lease.epoch,
        cause=int(lease.cause),  # type: ignore[arg-type]
        request_id=lease.request_id,
    )


def engine_pb(rec: EngineRecord, blocks: dict, leases_held: int = 0, leases_read: int = 0) -> pb.EngineInfo:
    info = rec.snapshot()
    info.blocks_gpu = blocks.get(1, 0)
    info.blocks_cpu = blocks.get(2, 0)
    info.active_leases_held = leases_held
    info.active_leases_read = leases_read
    return info


def match_pb(m: HolderMatch) -> pb.HolderMatch:
    return pb.HolderMatch(
        engine_id=m.engine_id,
        tier=int(m.tier),  # type: ignore[arg-type]
        matched_blocks=m.matched,
        hold_lease_id=m.hold_lease_id,
        load=m.load,
        reads_in_flight=m.reads,
        exactness=m.exactness,  # type: ignore[arg-type]
    )


def resolve_pb(result: ResolveResult, now: float) -> pb.ResolveResponse:
    out = pb.ResolveResponse(
        matches=[match_pb(m) for m in result.matches], skipped_reason=result.skipped_reason
    )
    lease = result.lease
    if lease is not None and lease.state.live and not result.pending:
        out.lease.CopyFrom(lease_pb(lease, now))
        if result.holder is not None:
            out.holder.CopyFrom(result.holder.snapshot())
    return out


def score_pb(result: ScoreResult) -> pb.ScoreResponse:
    return pb.ScoreResponse(
        scores=[
            pb.EngineScore(
                engine_id=s.engine_id,
                gpu_blocks=s.gpu_blocks,
                cpu_blocks=s.cpu_blocks,
                load=s.load,
                draining=s.draining,
                exactness=s.exactness,  # type: ignore[arg-type]
            )
            for s in result.scores
        ],
        total_blocks=result.total_blocks,
        block_size=result.block_size,
    )


def stats_pb(stats: Stats) -> pb.StatsResponse:
    return pb.StatsResponse(
        engines=stats.engines,
        sessions=stats.sessions,
        blocks_indexed=stats.blocks_indexed,
        leases_by_state=stats.leases_by_state,
        revocations_by_cause=stats.revocations_by_cause,
        namespaces=stats.namespaces,
    )


def watch_event_pb(event: WatchEvent, now: float, unix_time: float) -> pb.WatchEvent:
    out = pb.WatchEvent(
        kind=event.kind,
        engine_id=event.engine_id,
        blocks=event.blocks,
        tier=int(event.tier or 0),  # type: ignore[arg-type]
        detail=event.detail,
        time_unix=unix_time,
    )
    if event.lease is not None:
        out.lease.CopyFrom(lease_pb(event.lease, now))
    return out
