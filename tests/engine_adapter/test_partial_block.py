"""P hands D the prompt's last, partial block too, so D computes one token, not up to a block."""

from __future__ import annotations

import pytest

from kvbroker.engine_adapter.decisions import prompt_tail, tail_hash
from kvbroker.v1 import broker_pb2 as pb
from tests.engine_adapter.fakes import FakeRequest, holder_info, wire
from tests.engine_adapter.scheduler_util import BS, make, match, resolved

TOKENS = list(range(1000, 1141))  # a 140-token prompt and one sampled token
NAMED = {"do_remote_prefill": True, "kvbroker": {"holder_engine_id": "p", "hold_request_id": "p-req"}}


def _tail_of(num_tokens: int) -> int:
    full = num_tokens // BS
    return tail_hash(wire(full - 1).to_bytes(8, "big") + b"\x00" * 24, TOKENS[full * BS : num_tokens])


def test_the_tail_hash_is_the_parent_and_exactly_the_tail_tokens() -> None:
    parent = b"\x01" * 32
    assert tail_hash(parent, [1, 2, 3]) == tail_hash(bytes(parent), (1, 2, 3))
    assert tail_hash(parent, [1, 2, 3]) != tail_hash(parent, [1, 2])
    assert tail_hash(parent, [1, 2, 3]) != tail_hash(parent, [1, 2, 4])
    assert tail_hash(parent, [1, 2, 3]) != tail_hash(b"\x02" * 32, [1, 2, 3])
    assert 0 <= tail_hash(parent, [7]) < 2**64


@pytest.mark.parametrize(
    ("num_tokens", "extra", "why"),
    [
        (128, {}, "ends on a block boundary"),
        (20, {}, "no full block to chain from"),
        (140, {"all_token_ids": None}, "tokens not readable"),
        (140, {"mm_features": ["image"]}, "multi-modal keys may fall in the tail"),
    ],
)
def test_no_tail_when_it_cannot_be_named_safely(num_tokens: int, extra: dict, why: str) -> None:
    req = FakeRequest("r", num_tokens=141, all_token_ids=TOKENS)
    for key, value in extra.items():
        setattr(req, key, value)
    assert prompt_tail(req, num_tokens, BS) is None, why


def test_p_holds_the_partial_block_under_its_tail_hash() -> None:
    sched, link, _ = make()
    req = FakeRequest(
        "p1",
        num_tokens=141,
        num_computed_tokens=140,
        kv_transfer_params={"do_remote_decode": True},
        all_token_ids=TOKENS,
    )
    delay, params = sched.request_finished(req, [5, 6, 7, 8, 9])
    assert delay is True and params is not None and params["kvbroker"]["num_blocks"] == 5
    hold = link.named("hold")[0]
    assert hold.args["block_ids"] == [5, 6, 7, 8, 9]
    assert hold.args["hashes"] == [wire(i) for i in range(4)] + [_tail_of(140)]
    hold.future.set_result(pb.Lease(lease_id="h1", state=pb.LEASE_HELD))  # type: ignore[union-attr]
    sched.build_connector_meta()
    assert link.stored[-1] == _tail_of(140)


def test_a_multi_turn_hold_keeps_only_full_blocks() -> None:
    # D's finished turn: its tail ends on a sampled token nobody's prompt ends with.
    sched, link, _ = make(multi_turn=True)
    req = FakeRequest("d1", num_tokens=141, num_computed_tokens=140, all_token_ids=TOKENS)
    sched.request_finished(req, [5, 6, 7, 8, 9])
    assert link.named("hold")[0].args["hashes"] == [wire(i) for i in range(4)]


def test_d_reads_the_tail_and_leaves_vllm_one_token_to_compute() -> None:
    sched, link, _ = make()
    req = FakeRequest("d1", num_tokens=140, kv_transfer_params=NAMED, all_token_ids=TOKENS[:140])
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    asked = link.named("resolve")[0].args["hashes"]
    assert asked == [wire(i) for i in range(4)] + [_tail_of(140)]
    resolved(link, match(5, engine="p", hold="hold-p"))
    assert sched.get_num_new_matched_tokens(req, 0) == (139, True)  # vLLM computes token 140 only
    sched.update_state_after_alloc(req, [7, 8, 9, 10, 11], 139)
    acquire = link.named("acquire")[0]
    lease = pb.Lease(
        lease_id="hold-p",
        holder_engine_id="p",
        tier=pb.TIER_GPU,
        block_hashes=asked,
        block_ids=[100, 101, 102, 103, 104],
        state=pb.LEASE_ACTIVE,
        epoch=1,
    )
    acquire.future.set_result(pb.LeaseResponse(lease=lease, holder=holder_info("p")))  # type: ignore[union-attr]
    (load,) = sched.build_connector_meta().loads
    assert load.remote_block_ids == (100, 101, 102, 103, 104)
    assert load.local_block_ids == (7, 8, 9, 10, 11)


def test_d_without_a_named_holder_asks_for_full_blocks_only() -> None:
    sched, link, _ = make()
    req = FakeRequest("d1", num_tokens=140, all_token_ids=TOKENS[:140])
    sched.get_num_new_matched_tokens(req, 0)
    assert link.named("resolve")[0].args["hashes"] == [wire(i) for i in range(4)]


def test_a_holder_without_the_tail_is_still_read_for_its_full_blocks() -> None:
    # A holder of an older version holds full blocks only: D recomputes the tail, as before.
    sched, link, _ = make()
    req = FakeRequest("d1", num_tokens=140, kv_transfer_params=NAMED, all_token_ids=TOKENS[:140])
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4, engine="p", hold="hold-p"))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)


def test_d_waits_for_the_named_hold_not_just_the_holder() -> None:
    # P's cached full blocks reach the index before P's hold reaches the broker: a reader
    # that took that first answer would pull without the partial block and compute it.
    sched, link, clock = make()
    req = FakeRequest("d1", num_tokens=140, kv_transfer_params=NAMED, all_token_ids=TOKENS[:140])
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4, engine="p", hold=""))
    clock.advance(0.05)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(link.named("resolve")) == 2, "asked again"
    resolved(link, match(5, engine="p", hold="hold-p"))
    assert sched.get_num_new_matched_tokens(req, 0) == (139, True)
