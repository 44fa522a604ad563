"""A connector engine's silence told to index mirrors (broker/silence.py), with a fake clock: the
broker judges it when it answers; mirrors and watchers hear it when it starts and when it ends."""

from __future__ import annotations

from kvbroker.broker.silence import CHECK_S
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from tests.broker.helpers import make_core


def test_a_silent_engine_reaches_the_mirrors_as_degraded_and_comes_back_when_it_speaks() -> None:
    core, clock, notes = make_core()
    p = core.register(engine_info("P"), 3000)  # silent past two thirds of the TTL: 2 s
    core.register(engine_info("D"), 3000)
    sub = core.mirrors.subscribe(p.layout_id, lambda: None)

    def mirrored() -> list[tuple[str, int, str]]:
        return [
            (c.engine.engine_id, int(c.engine.exactness), c.engine.exactness_reason)
            for update in sub.take()
            for c in update.engines
        ]

    def told() -> list[tuple[str, str]]:
        return [(e.engine_id, e.detail) for e in notes.events if e.kind == "engine_exactness"]

    clock.advance(1.9)
    core.heartbeat(core.registry.get("D"), 0.0)  # D speaks, P does not
    core.expire()
    assert mirrored() == [] and told() == []  # 1.9 s: not yet
    clock.advance(0.2)
    core.expire()
    assert mirrored() == [("P", pb.INDEX_DEGRADED, "silent for 2.1 s (session TTL 3.0 s)")]
    assert told() == [("P", "degraded: silent for 2.1 s (session TTL 3.0 s)")]
    # A mirror that subscribes now starts from the same picture.
    assert {e.engine_id: e.exactness for e in core.mirror_engines(p.layout_id)} == {
        "P": pb.INDEX_DEGRADED,
        "D": pb.INDEX_EXACT,
    }
    clock.advance(CHECK_S)
    core.expire()
    assert mirrored() == [], "told twice"
    core.heartbeat(p, 0.0)  # P speaks again
    clock.advance(CHECK_S)
    core.expire()
    assert mirrored() == [("P", pb.INDEX_EXACT, "")]
    assert told()[-1] == ("P", "exact")
    assert [e.exactness for e in core.mirror_engines(p.layout_id)] == [pb.INDEX_EXACT] * 2
