"""Scheduler side, holder role: holds keep blocks for readers until their lease ends, then free them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvbroker.clients import errors
from kvbroker.engine_adapter.broker_link import LeaseEndNotice
from kvbroker.v1 import broker_pb2 as pb
from tests.engine_adapter.fakes import FakeLink, FakeRequest, Status, wire
from tests.engine_adapter.scheduler_util import BS, make, match, resolved


def test_remote_decode_holds_until_the_lease_ends_then_frees() -> None:
    sched, link, _ = make()
    req = FakeRequest(
        "p1", num_tokens=141, num_computed_tokens=140, kv_transfer_params={"do_remote_decode": True}
    )
    delay, params = sched.request_finished(req, [5, 6, 7, 8, 9])
    assert delay is True
    assert params is not None and params["do_remote_prefill"] is True
    assert params["kvbroker"]["holder_engine_id"] == "reader"
    hold = link.named("hold")[0]
    assert hold.args["block_ids"] == [5, 6, 7, 8] and hold.args["hashes"] == [wire(i) for i in range(4)]
    hold.future.set_result(pb.Lease(lease_id="h1", state=pb.LEASE_HELD))  # type: ignore[union-attr]
    assert sched.build_connector_meta().frees == []
    assert link.stored == [wire(i) for i in range(4)]
    assert sched.stats_snapshot()["held_blocks"] == 4
    link.ends.append(LeaseEndNotice("h1", "REVOKE_READER_GONE"))
    assert sched.build_connector_meta().frees == ["p1"]
    assert link.removed == [wire(i) for i in range(4)]
    sched.update_connector_output(worker_meta=None, finished_sending={"p1"}, finished_recving=None)
    assert sched.stats_snapshot()["held_requests"] == 0


def test_plain_request_is_not_held_but_multi_turn_is() -> None:
    sched, _link, _ = make()
    req = FakeRequest("a", num_tokens=141, num_computed_tokens=140)
    assert sched.request_finished(req, [1, 2, 3, 4, 5]) == (False, None)
    multi, _link2, _ = make(multi_turn=True)
    delay, params = multi.request_finished(req, [1, 2, 3, 4, 5])
    assert delay is True and params is None
    aborted = dataclasses.replace(req, request_id="b", status=Status("FINISHED_ABORTED"))
    assert multi.request_finished(aborted, [1, 2, 3, 4, 5]) == (False, None)


def test_hold_refused_frees_at_once() -> None:
    sched, link, _ = make(multi_turn=True)
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), [1, 2, 3, 4, 5])
    sched.request_finished(FakeRequest("b", num_tokens=141, num_computed_tokens=140), [6, 7, 8, 9, 10])
    sched.build_connector_meta()
    holds = link.named("hold")
    holds[0].future.set_exception(errors.ResourceExhausted("lease limit"))  # type: ignore[union-attr]
    assert sched.build_connector_meta().frees == ["a"]
    # A broker that answers UNAVAILABLE itself (its shared store is away) made no hold either.
    holds[1].future.set_exception(errors.Unavailable("store away", cause="state_unavailable"))  # type: ignore[union-attr]
    assert sched.build_connector_meta().frees == ["b"]


def _two_holds(sched: Any, link: FakeLink) -> None:
    """Holds a and b, both granted (h-a, h-b)."""
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), [1, 2, 3, 4, 5])
    sched.request_finished(FakeRequest("b", num_tokens=141, num_computed_tokens=140), [6, 7, 8, 9, 10])
    for call, lease_id in zip(link.named("hold"), ("h-a", "h-b"), strict=True):
        call.future.set_result(pb.Lease(lease_id=lease_id))  # type: ignore[union-attr]
    assert sched.build_connector_meta().frees == []


def test_holds_stay_through_a_session_a_replica_resumes() -> None:
    """A broker fleet over shared state resumes the session elsewhere with its leases: a reader
    may still claim them, so the blocks must stay."""
    sched, link, clock = make(multi_turn=True)
    _two_holds(sched, link)
    link.connected = False
    link.listener()
    assert sched.build_connector_meta().frees == []
    clock.advance(0.2)
    link.reconnect(resumed=True)
    assert sched.build_connector_meta().frees == []
    assert sched.stats_snapshot()["held_blocks"] == 8
    link.end_lease("h-a", "released")
    assert sched.build_connector_meta().frees == ["a"]


def test_holds_end_with_a_session_registered_anew() -> None:
    sched, link, _ = make(multi_turn=True)
    _two_holds(sched, link)
    link.connected = False
    assert sched.build_connector_meta().frees == []
    link.reconnect(resumed=False)  # the old session, and its leases, ended
    assert sorted(sched.build_connector_meta().frees) == ["a", "b"]


def test_holds_end_when_the_broker_stays_away_for_two_session_ttls() -> None:
    sched, link, clock = make(multi_turn=True, session_ttl_ms=1000)
    _two_holds(sched, link)
    link.connected = False
    assert sched.build_connector_meta().frees == []
    clock.advance(1.9)
    assert sched.build_connector_meta().frees == []
    clock.advance(0.2)  # the broker has expired the session by now
    assert sorted(sched.build_connector_meta().frees) == ["a", "b"]


def test_a_hold_whose_answer_was_lost_keeps_its_blocks_until_its_lease_ends() -> None:
    """The replica died after its store made the hold, before the answer: a reader may claim it."""
    sched, link, clock = make(multi_turn=True)
    timers: list[tuple[float, Any]] = []
    sched.holds.call_later = lambda delay, callback: timers.append((delay, callback))
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), [1, 2, 3, 4, 5])
    sched.request_finished(FakeRequest("b", num_tokens=141, num_computed_tokens=140), [6, 7, 8, 9, 10])
    holds = link.named("hold")
    holds[0].future.set_exception(errors.Unavailable("broker session lost before the answer came"))  # type: ignore[union-attr]
    holds[1].future.set_exception(errors.DeadlineExceeded("no answer"))  # type: ignore[union-attr]
    assert sched.build_connector_meta().frees == []
    backstop_s = (sched._ctx.config.hold_ttl_ms + 2 * sched._ctx.config.session_ttl_ms) / 1000
    # One timer for the earliest backstop of all holds (both started at once).
    assert [round(delay, 1) for delay, _ in timers] == [round(backstop_s + 0.1, 1)]
    assert link.stored == []  # not announced: we do not know its lease
    link.end_lease("another", "released", request_id="x")  # not ours
    link.end_lease("h-a", "REVOKE_TTL_EXPIRED", request_id="a")  # its lease ended: known by its request id
    assert sched.build_connector_meta().frees == ["a"]
    # The other is freed by the backstop (hold TTL + 2 session TTLs) if no notice comes, even on
    # an idle engine: the timer looks again then.
    clock.advance(backstop_s + 0.1)
    timers[0][1]()
    assert sched.stats_snapshot()["holds_freed"] == 2
    assert sched.build_connector_meta().frees == ["b"]


def test_a_hold_whose_lease_end_notice_was_lost_is_freed_at_the_backstop_on_an_idle_engine() -> None:
    """Notices are at most once (a replica can die with one in flight): an engine that runs no
    step still frees the hold once hold TTL + 2 session TTLs have passed, and one timer serves all."""
    sched, link, clock = make(multi_turn=True)
    timers: list[tuple[float, Any]] = []
    sched.holds.call_later = lambda delay, callback: timers.append((delay, callback))
    backstop_s = (sched._ctx.config.hold_ttl_ms + 2 * sched._ctx.config.session_ttl_ms) / 1000
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), [1, 2, 3, 4, 5])
    link.named("hold")[0].future.set_result(pb.Lease(lease_id="ha"))  # type: ignore[union-attr]
    clock.advance(1.0)
    sched.request_finished(FakeRequest("b", num_tokens=141, num_computed_tokens=140), [6, 7, 8, 9, 10])
    link.named("hold")[1].future.set_result(pb.Lease(lease_id="hb"))  # type: ignore[union-attr]
    assert len(timers) == 1, "a later backstop waits for the earlier timer"
    clock.advance(backstop_s)  # a's backstop has passed (by 0.1 s at the timer), b's not yet
    timers[0][1]()
    assert sched.build_connector_meta().frees == ["a"]
    assert len(timers) == 2 and 0.0 < timers[1][0] <= 1.2, timers  # then one for b
    clock.advance(1.0)
    timers[1][1]()
    assert sched.build_connector_meta().frees == ["b"]
    assert sched.stats_snapshot()["holds_freed"] == 2


def test_lease_end_right_after_hold_reply_frees_while_idle() -> None:
    # The session thread's order (the stream's): the Hold's answer, then that lease's end.
    sched, link, _ = make(multi_turn=True)
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), [1, 2, 3, 4, 5])
    link.named("hold")[0].future.set_result(pb.Lease(lease_id="ha"))  # type: ignore[union-attr]
    assert link.stored == [wire(i) for i in range(4)]  # settled by the answer itself
    link.end_lease("ha", "REVOKE_TTL_EXPIRED")
    assert link.removed == [wire(i) for i in range(4)]  # freed before the scheduler steps
    assert sched.build_connector_meta().frees == ["a"]


def test_hold_answered_and_ended_before_the_scheduler_sees_the_answer_still_frees() -> None:
    # The session thread may answer the Hold, and read its lease's end, while the
    # scheduler thread is still inside request_finished (before it watches the future).
    sched, link, _ = make(multi_turn=True)
    plain_hold = link.hold

    def hold_answered_at_once(*args: Any, **kwargs: Any) -> Any:
        future = plain_hold(*args, **kwargs)
        future.set_result(pb.Lease(lease_id="ha"))
        link.ends.append(LeaseEndNotice("ha", "released"))  # its listener waits for the scheduler's lock
        return future

    link.hold = hold_answered_at_once  # type: ignore[method-assign]
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), [1, 2, 3, 4, 5])
    assert link.removed == [wire(i) for i in range(4)]
    assert sched.build_connector_meta().frees == ["a"]


def test_shared_blocks_are_announced_removed_only_when_the_last_hold_ends() -> None:
    sched, link, _ = make(multi_turn=True)
    for name in ("a", "b"):
        sched.request_finished(FakeRequest(name, num_tokens=141, num_computed_tokens=140), [1, 2, 3, 4, 5])
    for i, call in enumerate(link.named("hold")):
        call.future.set_result(pb.Lease(lease_id=f"h{i}"))  # type: ignore[union-attr]
    sched.build_connector_meta()
    assert link.stored == [wire(i) for i in range(4)]
    link.ends.append(LeaseEndNotice("h0", "released"))
    sched.build_connector_meta()
    assert link.removed == []
    link.ends.append(LeaseEndNotice("h1", "released"))
    sched.build_connector_meta()
    assert link.removed == [wire(i) for i in range(4)]


# -- holds keep their blocks with a reference in vLLM's own block pool ---------


def _pool_with_request_blocks(num_blocks: int, request_blocks: int):  # type: ignore[no-untyped-def]
    """vLLM's real BlockPool, with one request's blocks allocated as vLLM allocates them."""
    block_pool = pytest.importorskip("vllm.v1.core.block_pool")
    pool = block_pool.BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BS)
    blocks = pool.get_new_blocks(request_blocks)
    return pool, [b.block_id for b in blocks]


def test_a_hold_takes_a_pool_reference_so_vllm_frees_the_request_at_once() -> None:
    sched, link, _ = make(multi_turn=True)
    pool, ids = _pool_with_request_blocks(16, 5)
    sched.bind_block_pool(pool)
    free_before = pool.get_num_free_blocks()
    req = FakeRequest("a", num_tokens=141, num_computed_tokens=140)
    delay, _ = sched.request_finished(req, ids)
    # vLLM need not keep the request (it would count it as work and never sleep) ...
    assert delay is False
    pool.free_blocks([pool.blocks[i] for i in reversed(ids)])  # ... so vLLM frees it now
    # ... but the 4 full blocks under the hold stay out of the free pool; the partial 5th is free.
    assert pool.get_num_free_blocks() == free_before + 1
    assert [pool.blocks[i].ref_cnt for i in ids[:4]] == [1, 1, 1, 1]
    link.named("hold")[0].future.set_result(pb.Lease(lease_id="h1"))  # type: ignore[union-attr]
    assert link.stored == [wire(i) for i in range(4)]  # settled on the session thread, no step needed
    assert sched.stats_snapshot()["held_blocks"] == 4


def test_a_lease_end_settles_on_the_session_thread_and_the_pool_gets_the_blocks_back() -> None:
    sched, link, _ = make(multi_turn=True)
    pool, ids = _pool_with_request_blocks(16, 5)
    sched.bind_block_pool(pool)
    free_before = pool.get_num_free_blocks()
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), ids)
    pool.free_blocks([pool.blocks[i] for i in reversed(ids)])
    link.named("hold")[0].future.set_result(pb.Lease(lease_id="h1"))  # type: ignore[union-attr]
    # The reader is gone while vLLM is idle: no scheduler hook runs, the session thread settles it.
    link.end_lease("h1", "REVOKE_READER_GONE")
    snapshot = sched.stats_snapshot()
    assert snapshot["held_blocks"] == 0 and snapshot["holds_returned"] == 1
    assert link.removed == [wire(i) for i in range(4)]
    # The pool itself is touched only from the scheduler thread, at its next hook.
    assert pool.get_num_free_blocks() == free_before + 1
    assert sched.build_connector_meta().frees == []  # nothing for the worker: vLLM freed the request
    assert pool.get_num_free_blocks() == free_before + 5
    assert all(pool.blocks[i].ref_cnt == 0 for i in ids)
    assert sched.return_held_blocks() is False  # given back exactly once


def test_ended_holds_give_their_blocks_back_before_vllm_would_preempt() -> None:
    sched, link, _ = make(multi_turn=True)
    pool, ids = _pool_with_request_blocks(8, 5)
    sched.bind_block_pool(pool)
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), ids)
    pool.free_blocks([pool.blocks[i] for i in reversed(ids)])
    link.named("hold")[0].future.set_result(pb.Lease(lease_id="h1"))  # type: ignore[union-attr]
    assert sched.return_held_blocks() is False  # the hold is live: nothing to give back
    link.end_lease("h1", "released")
    assert sched.has_pool_returns() is True  # vLLM's has_pending_push_work: step once more
    assert sched.return_held_blocks() is True  # vLLM's has_pending_block_frees: retry, do not preempt
    assert sched.has_pool_returns() is False
    assert pool.get_num_free_blocks() == 7


def test_a_session_registered_anew_frees_pool_holds_without_a_step() -> None:
    sched, link, _ = make(multi_turn=True)
    pool, ids = _pool_with_request_blocks(16, 5)
    sched.bind_block_pool(pool)
    sched.build_connector_meta()  # the scheduler has seen the session up
    sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), ids)
    link.named("hold")[0].future.set_result(pb.Lease(lease_id="h1"))  # type: ignore[union-attr]
    link.connected = False
    link.listener()  # the session thread reports the stream lost: the session may resume
    assert sched.stats_snapshot().get("holds_freed", 0) == 0
    link.reconnect(resumed=False)
    link.listener()  # registered anew: the old session's leases are gone
    assert sched.stats_snapshot()["holds_freed"] == 1


def test_a_cpu_tier_copy_keeps_the_request_until_copied_even_when_the_hold_uses_the_pool() -> None:
    sched, _link, _ = make(multi_turn=True, cpu_tier_blocks=8)
    pool, ids = _pool_with_request_blocks(16, 5)
    sched.bind_block_pool(pool)
    delay, _ = sched.request_finished(FakeRequest("a", num_tokens=141, num_computed_tokens=140), ids)
    assert delay is True  # the copy needs the blocks until the worker reports it done
    meta = sched.build_connector_meta()
    assert meta.frees == ["a"] and len(meta.stores) == 1


# -- a reader that will not read the hold the router named declines it ---------

NAMED = {"do_remote_prefill": True, "kvbroker": {"holder_engine_id": "p", "hold_request_id": "p-req"}}


def _declines(link: FakeLink) -> list[tuple[str, str]]:
    return [(c.args["holder"], c.args["request_id"]) for c in link.named("decline")]


def test_a_reader_whose_local_hit_covers_the_hold_declines_it() -> None:
    sched, link, _ = make()
    req = FakeRequest("d1", num_tokens=140, kv_transfer_params=NAMED)
    sched.get_num_new_matched_tokens(req, 128)
    resolved(link, match(4, engine="p", hold="hold-p"))
    assert sched.get_num_new_matched_tokens(req, 128) == (0, False)
    assert _declines(link) == []  # vLLM has not settled the request yet
    sched.update_state_after_alloc(req, [7, 8, 9, 10, 11], 0)
    assert _declines(link) == [("p", "p-req")]
    assert "local_hit_covers_remote" in link.named("decline")[0].args["reason"]
    assert sched.stats_snapshot()["holds_declined"] == 1


def test_a_reader_that_pulls_from_the_named_hold_does_not_decline_it() -> None:
    sched, link, _ = make()
    req = FakeRequest("d1", num_tokens=140, kv_transfer_params=NAMED)
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4, engine="p", hold="hold-p"))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)
    sched.update_state_after_alloc(req, [7, 8, 9, 10, 11], 128)
    sched.request_finished(req, [7, 8, 9, 10, 11])
    assert _declines(link) == [] and [c.args["lease_id"] for c in link.named("acquire")] == ["hold-p"]


def test_a_request_refused_or_aborted_before_it_is_scheduled_declines_the_hold() -> None:
    sched, link, _ = make()
    tp_mismatch = {"do_remote_prefill": True, "kvbroker": {**NAMED["kvbroker"], "tp_size": 2}}
    refused = FakeRequest("d1", num_tokens=140, kv_transfer_params=tp_mismatch)
    assert sched.get_num_new_matched_tokens(refused, 0) == (0, False)
    sched.update_state_after_alloc(refused, [1, 2, 3, 4, 5], 0)
    aborted = FakeRequest("d2", num_tokens=140, kv_transfer_params=NAMED, status=Status("FINISHED_ABORTED"))
    assert sched.get_num_new_matched_tokens(aborted, 0) == (None, False)
    sched.request_finished(aborted, [])
    assert _declines(link) == [("p", "p-req"), ("p", "p-req")]


def test_a_holder_hands_its_timed_prefill_to_the_reader() -> None:
    """P's requests finish in the step that computes them; that step is timed all the same,
    and once P's model is ready its kv_transfer_params carry the fit (cost_model.py)."""
    from kvbroker.engine_adapter.decisions import parse_transfer_params

    sched, _link, clock = make()
    req = FakeRequest(
        "p0", num_tokens=141, num_computed_tokens=140, kv_transfer_params={"do_remote_decode": True}
    )
    _, cold = sched.request_finished(req, [5, 6, 7, 8, 9])
    assert cold is not None and "prefill_model" not in cold["kvbroker"]
    for i, tokens in enumerate((300, 900, 2000, 600)):
        sched.build_connector_meta([(f"p{i + 1}", tokens, 0)])
        clock.advance(0.01 + tokens * 2e-5)
        sched.request_finished(FakeRequest(f"p{i + 1}", num_tokens=tokens), [])  # done in its step
        sched.update_connector_output(worker_meta=None, finished_sending=None, finished_recving=None)
    snap = sched.stats_snapshot()["cost_model"]
    assert snap["prefill_ready"] is True and snap["prefill_steps"] == 4 and snap["prefill_source"] == "own"
    req = FakeRequest(
        "p9", num_tokens=141, num_computed_tokens=140, kv_transfer_params={"do_remote_decode": True}
    )
    _, params = sched.request_finished(req, [1, 2, 3, 4, 5])
    assert params is not None
    seed = parse_transfer_params(params).holder_prefill
    assert seed is not None and seed[1] == pytest.approx(0.02, rel=0.05)
