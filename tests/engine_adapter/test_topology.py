"""A holder's answer states its TP/PP sizes; a reader split for another TP size
refuses at once (no broker round trip), one with another PP size still asks."""

from __future__ import annotations

import pytest

from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.decisions import BadTransferParams, parse_transfer_params
from kvbroker.engine_adapter.scheduler import AdapterScheduler
from testkit.clock import FakeClock
from tests.engine_adapter.fakes import FakeLink, FakeRequest

BS = 32


def make(engine_id: str, tp: int = 1, pp: int = 1) -> tuple[AdapterScheduler, FakeLink]:
    link = FakeLink()
    sched = AdapterScheduler(
        config=AdapterConfig(engine_id=engine_id),
        link=link,
        block_size=BS,
        tp_size=tp,
        pp_size=pp,
        clock=FakeClock(),
    )
    return sched, link


def holder_answer(tp: int, pp: int) -> dict[str, object]:
    """The kv_transfer_params a holder with these sizes returns for do_remote_decode."""
    holder, _ = make("P", tp=tp, pp=pp)
    req = FakeRequest(
        "p1", num_tokens=141, num_computed_tokens=140, kv_transfer_params={"do_remote_decode": True}
    )
    _, params = holder.request_finished(req, [5, 6, 7, 8, 9])
    assert params is not None
    return params


def test_holder_states_its_parallel_sizes() -> None:
    params = holder_answer(tp=2, pp=2)
    assert params["kvbroker"] == {
        "holder_engine_id": "P",
        "num_blocks": 4,
        "tp_size": 2,
        "pp_size": 2,
        "hold_request_id": "p1",
    }
    parsed = parse_transfer_params(params)
    assert (parsed.holder_tp_size, parsed.holder_pp_size) == (2, 2)


@pytest.mark.parametrize(("holder_tp", "reader_tp"), [(2, 1), (1, 2), (4, 2)])
def test_reader_with_another_tp_size_refuses_without_asking(holder_tp: int, reader_tp: int) -> None:
    reader, link = make("D", tp=reader_tp)
    req = FakeRequest("d1", num_tokens=141, kv_transfer_params=holder_answer(tp=holder_tp, pp=1))
    assert reader.get_num_new_matched_tokens(req, 0) == (0, False)
    assert link.named("resolve") == []
    assert reader.stats.skips["incompatible_holder"] == 1


@pytest.mark.parametrize(("holder_pp", "reader_pp"), [(2, 1), (1, 2), (2, 2)])
def test_reader_with_equal_tp_asks_whatever_the_pp_sizes(holder_pp: int, reader_pp: int) -> None:
    reader, link = make("D", tp=2, pp=reader_pp)
    req = FakeRequest("d1", num_tokens=141, kv_transfer_params=holder_answer(tp=2, pp=holder_pp))
    assert reader.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(link.named("resolve")) == 1


def test_answers_without_sizes_still_ask_the_broker() -> None:
    reader, link = make("D", tp=2)
    params = {"do_remote_prefill": True, "kvbroker": {"holder_engine_id": "P"}}
    assert reader.get_num_new_matched_tokens(
        FakeRequest("d1", num_tokens=141, kv_transfer_params=params), 0
    ) == (
        None,
        False,
    )
    assert len(link.named("resolve")) == 1


@pytest.mark.parametrize("value", ["2", -1, True, 1.5])
def test_malformed_sizes_are_refused(value: object) -> None:
    with pytest.raises(BadTransferParams, match="tp_size"):
        parse_transfer_params({"do_remote_prefill": True, "kvbroker": {"tp_size": value}})
