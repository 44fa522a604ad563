"""How exact the index is per engine (broker/exactness.py): a silent connector engine is
degraded, Resolve and Score carry the state and leave such engines out on `require_exact`;
over real gRPC on every backend."""

from __future__ import annotations

import asyncio

from kvbroker.broker.exactness import Exactness, census
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from tests.broker.helpers import make_core
from tests.broker.session_util import RawSession

H = list(range(9100, 9108))
Stub = broker_pb2_grpc.KVBrokerStub


def test_a_silent_engine_is_degraded_until_it_speaks_and_require_exact_leaves_it_out() -> None:
    core, clock, _notes = make_core()
    p = core.register(engine_info("P"), 3000)
    d = core.register(engine_info("D"), 3000)
    ns = Namespace(p.layout_id, "")
    core.update_inventory(p, ns, Tier.GPU, H[:4], [])
    (match,) = core.resolve(d, ns, H).matches
    assert match.exactness == Exactness.EXACT
    clock.advance(1.0)  # one heartbeat interval: not silent yet
    assert core.resolve(d, ns, H, require_exact=True).matches
    clock.advance(1.1)  # over two thirds of the TTL without a word from P
    core.heartbeat(d, 0.0)
    (match,) = core.resolve(d, ns, H).matches
    assert match.exactness == Exactness.DEGRADED
    assert core.resolve(d, ns, H, require_exact=True).matches == []
    scores = {s.engine_id: s for s in core.score(ns, H, (), (), require_exact=True).scores}
    assert scores["P"].exactness == Exactness.DEGRADED and scores["P"].gpu_blocks == 0
    assert core.score(ns, H, (), ()).scores[0].gpu_blocks == 4, "without require_exact it still counts"
    assert census(core.registry.all(), clock.now()) == {"exact": 1, "lagging": 0, "degraded": 1}
    core.heartbeat(p, 0.0)
    assert core.resolve(d, ns, H, require_exact=True).matches[0].exactness == Exactness.EXACT


def test_a_recorded_state_is_announced_once_and_carried_by_score() -> None:
    core, _clock, notes = make_core()
    p = core.register(engine_info("P"), 3000)
    ns = Namespace(p.layout_id, "")
    core.update_inventory(p, ns, Tier.GPU, H[:2], [])
    core.registry.set_exactness(p, Exactness.LAGGING, "replaying")
    core.registry.set_exactness(p, Exactness.LAGGING, "replaying")
    (score,) = core.score(ns, H, (), ()).scores
    assert (score.exactness, score.gpu_blocks) == (Exactness.LAGGING, 2)
    assert core.score(ns, H, (), (), require_exact=True).scores[0].gpu_blocks == 0
    events = [e.detail for e in notes.events if e.kind == "engine_exactness"]
    assert events == ["lagging: replaying"]
    core.registry.set_exactness(p, Exactness.EXACT, "")
    assert [e.detail for e in notes.events if e.kind == "engine_exactness"][-1] == "exact"


async def test_over_grpc_resolve_score_and_list_engines_carry_exactness(stub: Stub) -> None:
    """Real gRPC on every backend (in-memory, redis-server, Redis Cluster)."""
    p, d = RawSession(stub), RawSession(stub)
    # A 6 s TTL: P is degraded after 4 s of silence and expires at 6 s, which leaves the checks
    # below 2 s of a degraded P on a loaded host (with 3 s, a Cluster's answers once took all of 1 s).
    reg = await p.register(engine_info("P"), 6000)
    await d.register(engine_info("D"), 6000)
    ns = pb.Namespace(layout_id=reg.layout_id)
    await p.announce(ns, pb.TIER_GPU, H[:4])
    await p.applied()
    (match,) = (await d.resolve(ns, H, require_exact=True)).resolve.matches
    assert match.exactness == pb.INDEX_EXACT
    # P says nothing for over two thirds of its TTL (4 s; it expires at 6 s); D's session speaks.
    loop = asyncio.get_running_loop()
    silent_since = loop.time()
    while True:
        matches = (await d.resolve(ns, H)).resolve.matches
        assert matches, f"P expired before it read as degraded ({loop.time() - silent_since:.1f} s silent)"
        match = matches[0]
        # A starved host moves both marks later (the broker gives sessions the time it did not
        # run: "broker did not run for X s"), so the bound is P's expiry, not the clock.
        if match.exactness != pb.INDEX_EXACT or loop.time() - silent_since > 20.0:
            break
        await asyncio.sleep(0.1)
    assert match.exactness == pb.INDEX_DEGRADED
    assert loop.time() - silent_since >= 3.0, "degraded before two heartbeat intervals passed"
    assert not (await d.resolve(ns, H, require_exact=True)).resolve.matches
    engines = {e.engine_id: e for e in (await stub.ListEngines(pb.ListEnginesRequest())).engines}
    assert engines["P"].exactness == pb.INDEX_DEGRADED and "silent" in engines["P"].exactness_reason
    assert engines["D"].exactness == pb.INDEX_EXACT
    scores = {
        s.engine_id: s for s in (await stub.Score(pb.ScoreRequest(namespace=ns, block_hashes=H))).scores
    }
    assert (scores["P"].exactness, scores["P"].gpu_blocks) == (pb.INDEX_DEGRADED, 4)
    exact_only = await stub.Score(pb.ScoreRequest(namespace=ns, block_hashes=H, require_exact=True))
    assert {s.engine_id: s.gpu_blocks for s in exact_only.scores}["P"] == 0
    await p.applied()  # P speaks again: exact
    (match,) = (await d.resolve(ns, H, require_exact=True)).resolve.matches
    assert match.exactness == pb.INDEX_EXACT
    await p.close()
    await d.close()
