"""Shared set-up of the scheduler-side tests: a scheduler over a fake broker link and a fake clock."""

from __future__ import annotations

from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.scheduler import AdapterScheduler
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from tests.engine_adapter.fakes import FakeLink, FakeRequest, wire

BS = 32


def make(threshold: int = 64, **overrides):  # type: ignore[no-untyped-def]
    config = AdapterConfig(
        engine_id="reader", kv_recompute_threshold=threshold, resolve_wait_ms=500, **overrides
    )
    link = FakeLink()
    clock = FakeClock()
    sched = AdapterScheduler(config=config, link=link, block_size=BS, clock=clock)
    return sched, link, clock


def resolved(link: FakeLink, *matches: pb.HolderMatch) -> None:
    call = link.named("resolve")[-1]
    assert call.future is not None
    call.future.set_result(pb.ResolveResponse(matches=list(matches)))


def match(blocks: int, engine: str = "holder", hold: str = "hold-1") -> pb.HolderMatch:
    return pb.HolderMatch(engine_id=engine, tier=pb.TIER_GPU, matched_blocks=blocks, hold_lease_id=hold)


def lease_for(req: FakeRequest, blocks: int, lease_id: str = "hold-1", holder: str = "holder") -> pb.Lease:
    return pb.Lease(
        lease_id=lease_id,
        holder_engine_id=holder,
        tier=pb.TIER_GPU,
        block_hashes=[wire(i) for i in range(blocks)],
        block_ids=[100 + i for i in range(blocks)],
        state=pb.LEASE_ACTIVE,
        epoch=3,
    )


def pull_to_reading(sched: AdapterScheduler, link: FakeLink, req: FakeRequest, holder: pb.EngineInfo):  # type: ignore[no-untyped-def]
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)
    sched.update_state_after_alloc(req, [7, 8, 9, 10, 11], 128)
    acquire = link.named("acquire")
    assert [c.args["lease_id"] for c in acquire] == ["hold-1"]
    meta = sched.build_connector_meta()
    assert meta.loads == [] and meta.commits == [], "nothing to read before the lease is granted"
    acquire[0].future.set_result(pb.LeaseResponse(lease=lease_for(req, 4), holder=holder))  # type: ignore[union-attr]
    return sched.build_connector_meta()
