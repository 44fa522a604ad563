"""A pull in the fewest scheduler steps: leased and read in its allocation's step, released and
reported finished in that step's output, its prefill scheduled in the next (``step_wait_ms``).

The broker's answers come from another thread while the scheduler waits for them, as the
session thread delivers them in an engine. Waits are generous: they end when the answer
arrives, so the tests take no longer on a loaded machine, only the bound is wide.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.metadata import ReadOutcomes
from kvbroker.engine_adapter.scheduler import AdapterScheduler
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from tests.engine_adapter.fakes import FakeLink, FakeRequest, holder_info
from tests.engine_adapter.scheduler_util import BS, lease_for, make, match, resolved

WAIT_MS = 30_000  # a bound only: every wait below ends when its answer arrives
NO_OUTPUT: dict[str, Any] = {"worker_meta": None, "finished_sending": None, "finished_recving": None}


class AnsweringLink(FakeLink):
    """Answers each release from another thread, as the broker session's thread would;
    ``release_answer`` None: never answered."""

    def __init__(self) -> None:
        super().__init__()
        self.release_answer: Any = pb.Lease(lease_id="hold-1", state=pb.LEASE_RELEASED)

    def release(self, lease_id, epoch, read=None):  # type: ignore[no-untyped-def]
        future = super().release(lease_id, epoch, read)
        if self.release_answer is not None:
            answer_soon(future, self.release_answer)
        return future


def answer_soon(future: Future[Any] | None, answer: Any) -> None:
    """Answer from another thread, after the scheduler began to wait (or before: no matter)."""
    assert future is not None
    done = future.set_exception if isinstance(answer, Exception) else future.set_result
    threading.Timer(0.05, done, args=(answer,)).start()


def make_answering(step_wait_ms: int) -> tuple[AdapterScheduler, AnsweringLink]:
    config = AdapterConfig(engine_id="reader", kv_recompute_threshold=64, step_wait_ms=step_wait_ms)
    link = AnsweringLink()
    return AdapterScheduler(config=config, link=link, block_size=BS, clock=FakeClock()), link


def allocate(sched: Any, link: Any, req: FakeRequest) -> None:
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)
    sched.update_state_after_alloc(req, [7, 8, 9, 10, 11], 128)


def grant(link: FakeLink, req: FakeRequest, *, soon: bool) -> None:
    response = pb.LeaseResponse(lease=lease_for(req, 4), holder=holder_info())
    future = link.named("acquire")[0].future
    if soon:
        answer_soon(future, response)
    else:
        assert future is not None
        future.set_result(response)


def read_done(sched: Any, req_id: str) -> set[str]:
    outcomes = ReadOutcomes(done={req_id: 1}, bytes_read={req_id: 4096})
    finished: set[str] = sched.update_connector_output(
        worker_meta=outcomes, finished_sending=None, finished_recving=None
    )
    return finished


def test_a_pull_is_leased_read_released_and_finished_in_its_allocation_step() -> None:
    sched, link = make_answering(WAIT_MS)
    req = FakeRequest("r1", num_tokens=140)
    allocate(sched, link, req)
    grant(link, req, soon=True)
    meta = sched.build_connector_meta()  # step N waits for the lease: the read starts in N
    assert [spec.request_id for spec in meta.loads] == ["r1"]
    # N's output: the read is done, the release is sent, waited for, and vLLM is told.
    assert read_done(sched, "r1") == {"r1"}, "reported finished in the read's own output"
    meta = sched.build_connector_meta([("r1", 12, 128)])  # step N+1 schedules the prefill
    assert meta.commits == [], "no commit through the worker: vLLM already knows"
    sched.update_connector_output(**NO_OUTPUT)
    stats = sched.stats_snapshot()
    assert stats["pulls"] == 1 and stats["pulled_blocks"] == 4
    assert stats["loads_ready"] == 1 and stats["figures"]["last_load_ready_steps"] == 1


def test_without_waiting_each_answer_costs_a_step() -> None:
    sched, link, _ = make(step_wait_ms=0)
    req = FakeRequest("r1", num_tokens=140)
    allocate(sched, link, req)
    assert sched.build_connector_meta().loads == [], "step N: the lease is not there yet"
    grant(link, req, soon=False)
    assert len(sched.build_connector_meta().loads) == 1  # N+1: read
    assert read_done(sched, "r1") == set(), "the release is not answered yet"
    link.named("release")[0].future.set_result(pb.Lease(lease_id="hold-1"))  # type: ignore[union-attr]
    commits = sched.build_connector_meta().commits  # N+2: commit, through the worker
    assert [(c.request_id, c.ok) for c in commits] == [("r1", True)]
    sched.update_connector_output(**{**NO_OUTPUT, "finished_recving": {"r1"}})
    sched.build_connector_meta([("r1", 12, 128)])  # N+3: the prefill
    assert sched.stats_snapshot()["figures"]["last_load_ready_steps"] == 3


def test_a_release_answered_after_the_wait_commits_through_the_worker() -> None:
    sched, link, _ = make(step_wait_ms=1)
    req = FakeRequest("r1", num_tokens=140)
    allocate(sched, link, req)
    grant(link, req, soon=False)
    assert len(sched.build_connector_meta().loads) == 1
    assert read_done(sched, "r1") == set(), "not answered within step_wait_ms"
    link.named("release")[0].future.set_result(pb.Lease(lease_id="hold-1"))  # type: ignore[union-attr]
    # Seen by the next step: the commit goes to the worker, which reports the load finished.
    assert [(c.request_id, c.ok) for c in sched.build_connector_meta().commits] == [("r1", True)]
    assert sched.update_connector_output(**NO_OUTPUT) == set(), "vLLM hears of it once, from the worker"


def test_a_failed_release_goes_to_the_worker_as_load_errors() -> None:
    sched, link = make_answering(WAIT_MS)
    link.release_answer = RuntimeError("lease hold-1 was revoked (REVOKE_TTL_EXPIRED)")
    req = FakeRequest("r1", num_tokens=140)
    allocate(sched, link, req)
    grant(link, req, soon=False)
    sched.build_connector_meta()
    assert read_done(sched, "r1") == set(), "a failed commit is never reported finished here"
    commits = sched.build_connector_meta().commits
    assert [(c.request_id, c.ok, c.local_block_ids) for c in commits] == [("r1", False, (7, 8, 9, 10))]


def test_a_load_aborted_while_reading_keeps_the_worker_path() -> None:
    sched, link = make_answering(WAIT_MS)
    req = FakeRequest("r1", num_tokens=140)
    allocate(sched, link, req)
    grant(link, req, soon=False)
    sched.build_connector_meta()
    assert sched.request_finished(req, [7, 8, 9, 10, 11]) == (False, None)
    assert read_done(sched, "r1") == set()
    assert [c.request_id for c in sched.build_connector_meta().commits] == ["r1"]
