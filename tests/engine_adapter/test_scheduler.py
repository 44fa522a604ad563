"""Scheduler-side decisions and the lease protocol, against a fake broker link."""

from __future__ import annotations

import pytest

from kvbroker.clients import errors
from kvbroker.engine_adapter.broker_link import NewGeneration
from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.metadata import ReadOutcomes
from kvbroker.v1 import broker_pb2 as pb
from tests.engine_adapter.fakes import FakeRequest, holder_info, wire
from tests.engine_adapter.scheduler_util import lease_for, make, match, pull_to_reading, resolved


def test_not_ready_until_the_broker_answers_then_pulls_full_blocks() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)  # 4 full blocks + 12 tokens
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(link.named("resolve")) == 1, "the lookup is submitted once per request"
    assert link.named("resolve")[0].args["hashes"] == [wire(i) for i in range(4)]
    resolved(link, match(4))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)


def test_below_threshold_recomputes() -> None:
    sched, link, _ = make(threshold=64)
    req = FakeRequest("r1", num_tokens=140)
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(1))  # 32 tokens remote
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.stats.skips["below_threshold"] == 1


def test_threshold_counts_only_beyond_the_local_hit() -> None:
    sched, link, _ = make(threshold=64)
    req = FakeRequest("r1", num_tokens=200)
    sched.get_num_new_matched_tokens(req, 64)
    resolved(link, match(4))  # 128 remote, 64 local -> 64 new: pull
    assert sched.get_num_new_matched_tokens(req, 64) == (64, True)
    req2 = FakeRequest("r2", num_tokens=200)
    sched.get_num_new_matched_tokens(req2, 96)
    resolved(link, match(4))  # 32 new < 64
    assert sched.get_num_new_matched_tokens(req2, 96) == (0, False)


def test_partial_coverage_pulls_what_exists() -> None:
    sched, link, _ = make(threshold=32)
    req = FakeRequest("r1", num_tokens=256)
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(3))
    assert sched.get_num_new_matched_tokens(req, 0) == (96, True)


def test_never_the_final_prompt_token() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=128)  # exactly 4 blocks, all held remotely
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4))
    assert sched.get_num_new_matched_tokens(req, 0) == (127, True)
    sched.update_state_after_alloc(req, [10, 11, 12, 13], 127)
    load = sched.loads.active["r1"]
    assert load.plan.num_blocks == 4 and load.local_block_ids == (10, 11, 12, 13)


def test_own_blocks_and_unknown_holders_are_no_hit() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4, engine="reader"))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.stats.skips["no_holder"] == 1


def test_resolve_wait_budget_then_no_remote_hit() -> None:
    sched, _link, clock = make()
    req = FakeRequest("r1", num_tokens=140)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.advance(0.25)  # resolve_wait_ms is 0.5 s, counted while the scheduler asks
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.advance(0.2)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.advance(0.1)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.stats.skips["broker_timeout"] == 1


def test_broker_down_or_malformed_params_recompute_without_asking() -> None:
    sched, link, _ = make()
    link.connected = False
    assert sched.get_num_new_matched_tokens(FakeRequest("r1", num_tokens=140), 0) == (0, False)
    link.connected = True
    bad = FakeRequest("r2", num_tokens=140, kv_transfer_params={"do_remote_prefill": "yes"})
    assert sched.get_num_new_matched_tokens(bad, 0) == (0, False)
    bad2 = FakeRequest("r3", num_tokens=140, kv_transfer_params={"kvbroker": "garbage"})
    assert sched.get_num_new_matched_tokens(bad2, 0) == (0, False)
    assert link.named("resolve") == []
    assert sched.stats.skips["malformed_kv_transfer_params"] == 2


def test_resolve_error_recomputes() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)
    sched.get_num_new_matched_tokens(req, 0)
    link.named("resolve")[0].future.set_exception(errors.Unavailable("gone"))  # type: ignore[union-attr]
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_hinted_holder_is_asked_again_until_its_hold_arrives() -> None:
    sched, link, clock = make()
    params = {"do_remote_prefill": True, "kvbroker": {"holder_engine_id": "p"}}
    req = FakeRequest("r1", num_tokens=140, kv_transfer_params=params)
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link)  # P's hold not indexed yet
    clock.advance(0.05)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(link.named("resolve")) == 2
    resolved(link, match(4, engine="p"))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)


def test_hinted_holder_that_never_appears_uses_what_the_broker_knows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched, link, clock = make()
    params = {"do_remote_prefill": True, "kvbroker": {"holder_engine_id": "ghost", "lease_id": "nope"}}
    req = FakeRequest("r1", num_tokens=140, kv_transfer_params=params)
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4, engine="other"))
    for _ in range(5):
        clock.advance(0.05)
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        if not link.named("resolve")[-1].future.done():  # type: ignore[union-attr]
            resolved(link, match(4, engine="other"))
    clock.advance(0.25)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.advance(0.25)
    with caplog.at_level("WARNING", logger="vllm.kvbroker.scheduler"):
        assert sched.get_num_new_matched_tokens(req, 0) == (128, True)
    assert "ghost (lease nope)" in caplog.text


def test_lease_read_release_commit() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)
    meta = pull_to_reading(sched, link, req, holder_info())
    assert len(meta.loads) == 1
    spec = meta.loads[0]
    assert spec.remote_block_ids == (100, 101, 102, 103)
    assert spec.local_block_ids == (7, 8, 9, 10)
    assert [r.agent_name for r in spec.holder_ranks] == ["holder-pp0-tp0"]
    sched.update_connector_output(
        worker_meta=ReadOutcomes(done={"r1": 1}), finished_sending=None, finished_recving=None
    )
    release = link.named("release")
    assert [(c.args["lease_id"], c.args["epoch"]) for c in release] == [("hold-1", 3)]
    assert sched.build_connector_meta().commits == [], "not committed before the release answers"
    release[0].future.set_result(pb.Lease(lease_id="hold-1", state=pb.LEASE_RELEASED))  # type: ignore[union-attr]
    commits = sched.build_connector_meta().commits
    assert [(c.request_id, c.ok) for c in commits] == [("r1", True)]
    assert sched.stats.counters["pulled_blocks"] == 4


def test_release_failure_means_load_errors() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)
    pull_to_reading(sched, link, req, holder_info())
    sched.update_connector_output(
        worker_meta=ReadOutcomes(done={"r1": 1}), finished_sending=None, finished_recving=None
    )
    link.named("release")[0].future.set_exception(  # type: ignore[union-attr]
        errors.FailedPrecondition("lease hold-1 was revoked (REVOKE_TTL_EXPIRED)")
    )
    commits = sched.build_connector_meta().commits
    assert [(c.request_id, c.ok, c.local_block_ids) for c in commits] == [("r1", False, (7, 8, 9, 10))]
    assert sched.stats.counters["pulls_failed"] == 1


def test_failed_read_is_not_committed_and_ends_the_lease() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)
    pull_to_reading(sched, link, req, holder_info())
    sched.update_connector_output(
        worker_meta=ReadOutcomes(done={"r1": 1}, failed={"r1": "peer gone"}),
        finished_sending=None,
        finished_recving=None,
    )
    commits = sched.build_connector_meta().commits
    assert [(c.ok) for c in commits] == [False]
    assert [c.args["lease_id"] for c in link.named("release")] == ["hold-1"], (
        "the lease is ended for the holder"
    )


def test_incompatible_holder_is_refused() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)
    meta = pull_to_reading(sched, link, req, holder_info(tp=2))
    assert meta.loads == []
    assert [(c.ok, "tensor-parallel" in c.reason) for c in meta.commits] == [(False, True)]


def test_refused_or_slow_lease_recomputes() -> None:
    sched, link, clock = make()
    req = FakeRequest("r1", num_tokens=140)
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [1, 2, 3, 4, 5], 128)
    link.named("acquire")[0].future.set_exception(errors.NotFound("unknown lease hold-1"))  # type: ignore[union-attr]
    assert [c.ok for c in sched.build_connector_meta().commits] == [False]

    req2 = FakeRequest("r2", num_tokens=140)
    sched.get_num_new_matched_tokens(req2, 0)
    resolved(link, match(4))
    sched.get_num_new_matched_tokens(req2, 0)
    sched.update_state_after_alloc(req2, [1, 2, 3, 4, 5], 128)
    for _ in range(8):  # acquire_wait_ms is 2 s, counted while the scheduler steps
        clock.advance(0.25)
        assert sched.build_connector_meta().commits == []
    clock.advance(0.1)
    assert [c.ok for c in sched.build_connector_meta().commits] == [False]
    # A grant that arrives after we gave up is released at once.
    link.named("acquire")[1].future.set_result(pb.LeaseResponse(lease=lease_for(req2, 4, "late")))  # type: ignore[union-attr]
    assert [c.args["lease_id"] for c in link.named("release")] == ["late"]


def test_lease_that_does_not_cover_the_blocks_is_refused() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [1, 2, 3, 4, 5], 128)
    link.named("acquire")[0].future.set_result(  # type: ignore[union-attr]
        pb.LeaseResponse(lease=lease_for(req, 2), holder=holder_info())
    )
    commits = sched.build_connector_meta().commits
    assert [(c.ok, "does not cover" in c.reason) for c in commits] == [(False, True)]


def test_aborted_while_loading_completes_the_protocol() -> None:
    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)
    pull_to_reading(sched, link, req, holder_info())
    assert sched.request_finished(req, [7, 8, 9, 10, 11]) == (False, None)
    sched.update_connector_output(
        worker_meta=ReadOutcomes(done={"r1": 1}), finished_sending=None, finished_recving=None
    )
    link.named("release")[0].future.set_result(pb.Lease(lease_id="hold-1"))  # type: ignore[union-attr]
    assert [c.request_id for c in sched.build_connector_meta().commits] == ["r1"]


def test_config_refuses_unknown_keys_and_coerces() -> None:
    config = AdapterConfig.from_extra_config({"kv_recompute_threshold": "32", "multi_turn": "true"})
    assert config.kv_recompute_threshold == 32 and config.multi_turn is True
    assert config.engine_id.startswith("engine-")
    with pytest.raises(ValueError, match="unknown"):
        AdapterConfig.from_extra_config({"kv_recompute_treshold": 3})
    with pytest.raises(ValueError, match="valid int"):
        AdapterConfig.from_extra_config({"hold_ttl_ms": "soon"})


def test_spans_continue_the_callers_trace_and_carry_transfer_attributes() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvbroker.engine_adapter import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer(provider.get_tracer("test"))
    try:
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        params = {"trace_context": {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}}
        sched, link, _ = make()
        req = FakeRequest("r1", num_tokens=140, kv_transfer_params=params)
        sched.get_num_new_matched_tokens(req, 0)
        resolved(link, match(4))
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, [7, 8, 9, 10, 11], 128)
        link.named("acquire")[0].future.set_result(  # type: ignore[union-attr]
            pb.LeaseResponse(lease=lease_for(req, 4), holder=holder_info())
        )
        sched.build_connector_meta()
        sched.update_connector_output(
            worker_meta=ReadOutcomes(done={"r1": 1}, bytes_read={"r1": 4096}, read_s={"r1": 0.0025}),
            finished_sending=None,
            finished_recving=None,
        )
        link.named("release")[0].future.set_result(pb.Lease(lease_id="hold-1"))  # type: ignore[union-attr]
        sched.build_connector_meta()
        no_output = {"worker_meta": None, "finished_sending": None}
        sched.update_connector_output(**no_output, finished_recving={"r1"})  # vLLM saw the load finish
        assert [s.name for s in exporter.get_finished_spans()] == ["kvbroker.resolve"], (
            "open until the first token"
        )
        sched.build_connector_meta([("r1", 12, 96)])  # the remainder's prefill is scheduled
        sched.update_connector_output(**no_output, finished_recving=None)  # ... and its step ended
    finally:
        tracing.set_tracer(None)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"kvbroker.resolve", "kvbroker.pull"}
    # Decision to first token, step by step, on the pull's span.
    events = [e.name for e in spans["kvbroker.pull"].events]
    assert events == [
        "kvbroker.lease_granted",
        "kvbroker.read_done",
        "kvbroker.committed",
        "kvbroker.load_finished",
        "kvbroker.prefill_scheduled",
        "kvbroker.first_token",
    ]
    timeline = spans["kvbroker.pull"].attributes or {}
    for phase in ("lookup", "allocate", "lease", "read", "release", "notice", "schedule", "prefill"):
        assert timeline[f"kvbroker.timeline.{phase}_ms"] >= 0, phase
    # The lease was answered before the allocation's step was built: granted in that step.
    assert timeline["kvbroker.timeline.lookup_steps"] == 0 and timeline["kvbroker.timeline.lease_steps"] == 0
    assert (
        timeline["kvbroker.timeline.schedule_steps"] == 1 and timeline["kvbroker.timeline.prefill_steps"] == 0
    )
    assert timeline["kvbroker.timeline.worker_read_ms"] == 2.5
    assert (
        "kvbroker.timeline.lease_answer_ms" in timeline and "kvbroker.timeline.release_answer_ms" in timeline
    )
    for span in spans.values():
        assert f"{span.context.trace_id:032x}" == trace_id
    pull = spans["kvbroker.pull"].attributes or {}
    assert pull["kvbroker.lease_id"] == "hold-1" and pull["kvbroker.bytes"] == 4096
    assert (
        pull["kvbroker.source_engine_id"] == "holder" and pull["kvbroker.destination_engine_id"] == "reader"
    )
    assert pull["kvbroker.committed"] is True and pull["kvbroker.tier"] == "TIER_GPU"
    assert str(pull["kvbroker.source_ranks"]).startswith("pp0/tp0:[")
    assert pull["kvbroker.destination_ranks"] == 1


# -- the index mirror ----------------------------------------------------------------


def mirror_match(blocks: int, engine: str = "holder") -> pb.HolderMatch:
    return pb.HolderMatch(engine_id=engine, tier=pb.TIER_GPU, matched_blocks=blocks)


def test_mirror_answers_in_the_first_step_and_the_lease_still_comes_from_the_broker() -> None:
    sched, link, _ = make()
    link.mirror_matches = [mirror_match(4)]
    req = FakeRequest("r1", num_tokens=140)
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True), "no step waits for the broker"
    assert link.named("resolve") == [], "the decision took no round trip"
    assert sched.stats.counters["mirror_answers"] == 1
    sched.update_state_after_alloc(req, [7, 8, 9, 10, 11], 128)
    (claim,) = link.named("resolve")
    assert claim.args["acquire"] and claim.args["min_blocks"] == 4, "the broker grants (or refuses) the lease"


def test_mirror_without_a_holder_recomputes_at_once() -> None:
    sched, link, _ = make()
    link.mirror_matches = [mirror_match(1)]  # 32 tokens: below the threshold
    assert sched.get_num_new_matched_tokens(FakeRequest("r1", num_tokens=140), 0) == (0, False)
    link.mirror_matches = []
    assert sched.get_num_new_matched_tokens(FakeRequest("r2", num_tokens=140), 0) == (0, False)
    assert link.named("resolve") == []
    assert sched.stats.skips["below_threshold"] == 1


def test_unsynced_mirror_falls_back_to_the_broker() -> None:
    sched, link, _ = make()
    link.mirror_matches = None
    req = FakeRequest("r1", num_tokens=140)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    resolved(link, match(4))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)
    assert sched.stats.counters["mirror_answers"] == 0


def test_hinted_holder_asks_the_broker_for_its_hold_lease() -> None:
    sched, link, _ = make()
    link.mirror_matches = [mirror_match(4, engine="p")]
    params = {"do_remote_prefill": True, "kvbroker": {"holder_engine_id": "p"}}
    req = FakeRequest("r1", num_tokens=140, kv_transfer_params=params)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    resolved(link, match(4, engine="p", hold="hold-p"))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)
    sched.update_state_after_alloc(req, [7, 8, 9, 10, 11], 128)
    assert [c.args["lease_id"] for c in link.named("acquire")] == ["hold-p"]


def test_mirror_can_be_turned_off() -> None:
    sched, link, _ = make(index_mirror=False)
    link.mirror_matches = [mirror_match(4)]
    assert sched.get_num_new_matched_tokens(FakeRequest("r1", num_tokens=140), 0) == (None, False)
    assert len(link.named("resolve")) == 1


def test_a_stalled_process_does_not_use_up_the_broker_budgets() -> None:
    """The whole host stalls for 9 s (seen in CI: every process, the broker too): the
    broker's answers wait unread, so that gap is not counted against resolve or acquire."""
    sched, link, clock = make()
    req = FakeRequest("r1", num_tokens=140)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.advance(9.0)  # resolve_wait_ms is 0.5 s
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    resolved(link, match(4))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)
    sched.update_state_after_alloc(req, [7, 8, 9, 10, 11], 128)
    clock.advance(9.0)  # acquire_wait_ms is 2 s
    assert sched.build_connector_meta().commits == []
    link.named("acquire")[0].future.set_result(  # type: ignore[union-attr]
        pb.LeaseResponse(lease=lease_for(req, 4), holder=holder_info())
    )
    assert len(sched.build_connector_meta().loads) == 1
    # Time the scheduler does run still counts: a broker that stays silent is given up on.
    req2 = FakeRequest("r2", num_tokens=140, block_hashes=[bytes([9]) * 32] * 4)
    sched.get_num_new_matched_tokens(req2, 0)
    for _ in range(6):
        clock.advance(0.1)
        decision = sched.get_num_new_matched_tokens(req2, 0)
    assert decision == (0, False)


def test_an_empty_step_waits_for_the_broker_answer_its_requests_need(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM steps without pause while a request waits on us; such a step yields (GIL released) to
    the session thread for up to IDLE_WAIT_S, on the answers awaited, and only then."""
    from kvbroker.engine_adapter import scheduler as scheduler_module

    waits: list[tuple[set[object], float]] = []
    monkeypatch.setattr(
        scheduler_module, "futures_wait", lambda fs, timeout, return_when: waits.append((set(fs), timeout))
    )
    sched, link, _ = make()
    sched.build_connector_meta([])
    assert waits == [], "nothing awaited: an idle step does not wait"
    req = FakeRequest("r1", num_tokens=140)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    sched.build_connector_meta([("other", 16, 0)])
    assert waits == [], "a step that computed something does not wait"
    sched.build_connector_meta([])
    assert waits == [({link.named("resolve")[0].future}, scheduler_module.IDLE_WAIT_S)]
    resolved(link, match(4))
    sched.build_connector_meta([])
    assert len(waits) == 1, "the answer came: nothing left to wait for"


def test_an_empty_step_waits_at_most_its_bound_and_takes_an_answer_from_another_thread() -> None:
    import threading
    import time

    from kvbroker.engine_adapter import scheduler as scheduler_module

    sched, link, _ = make()
    req = FakeRequest("r1", num_tokens=140)
    sched.get_num_new_matched_tokens(req, 0)
    started = time.monotonic()
    sched.build_connector_meta([])
    assert time.monotonic() - started >= scheduler_module.IDLE_WAIT_S * 0.9  # waited its bound
    answer = threading.Timer(0.0005, lambda: resolved(link, match(4)))
    answer.start()
    sched.build_connector_meta([])  # returns when the answer is set (or at the bound)
    answer.join(10)  # a loaded machine may run the other thread only after the bound
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)


def test_an_empty_step_sleeps_while_its_only_work_is_reads_on_the_workers() -> None:
    """vLLM steps again at once while a request waits for its blocks. With nothing computed and
    no broker answer awaited, such a step sleeps IDLE_READ_WAIT_S (GIL released) instead of
    spinning the engine core and its workers: on a shared host that spin once starved the
    holder whose progress a new reader's connection needs, until the read timed out."""
    from kvbroker.engine_adapter import scheduler as scheduler_module

    sched, link, _ = make()
    sleeps: list[float] = []
    sched._sleep = sleeps.append  # type: ignore[method-assign]
    sched.build_connector_meta([])
    req = FakeRequest("r1", num_tokens=140)
    sched.get_num_new_matched_tokens(req, 0)
    sched.build_connector_meta([])
    assert sleeps == [], "no read runs (idle, then a broker answer awaited): no sleep"
    assert len(pull_to_reading(sched, link, req, holder_info()).loads) == 1
    sched.build_connector_meta([("other", 16, 0)])
    assert sleeps == [], "a step that computes something does not sleep"
    sched.build_connector_meta([])
    assert sleeps == [scheduler_module.IDLE_READ_WAIT_S]
    sched.update_connector_output(
        worker_meta=ReadOutcomes(done={"r1": 1}), finished_sending=None, finished_recving=None
    )
    sched.build_connector_meta([])
    assert len(sleeps) == 1, "the read ended: the release is awaited, not slept on"


def test_an_engine_registered_anew_reaches_the_workers_with_the_next_step_once() -> None:
    """SessionDown.engine_generation, queued by the link, goes out in the next step's metadata
    (the workers drop the old agent before that step's reads), and only in that one; an idle
    engine is woken for that step."""
    sched, link, _ = make()
    woken: list[int] = []
    sched.gpu.wake = lambda: woken.append(1)
    link.generations.append(NewGeneration("holder", 12))
    assert sched.build_connector_meta().generations == [NewGeneration("holder", 12)]
    assert sched.build_connector_meta().generations == [] and woken == []  # a step was running
    link.generations.append(NewGeneration("holder", 13))
    sched.on_link_event()  # the session thread, the engine idle
    assert woken == [1] and sched.has_pool_returns(), "the idle engine was not asked to step"
    link.generations.append(NewGeneration("other", 2))
    assert sched.build_connector_meta().generations == [
        NewGeneration("holder", 13),
        NewGeneration("other", 2),
    ]
    assert not sched.has_pool_returns()
