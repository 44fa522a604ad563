"""Verified bytes overlapped with the read: a load read in groups, each digested as it lands.

Real BlockMovers on the fake NIXL fabric (which copies at ``transfer()`` like UCX on one host,
or after some polls), real KV bytes; groups of one block each, so that a 3-block load has a
middle group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

import pytest
import torch

from kvbroker.engine_adapter.metadata import AdapterMetadata
from kvbroker.engine_adapter.verify_overlap import OverlapPolicy
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from tests.engine_adapter.fake_nixl import FakeFabric
from tests.engine_adapter.kv_fixtures import LAYER_NAME, cpu_backend_kv_caches
from tests.engine_adapter.test_verify import LOCAL, REMOTE, Pair, _worker

ONE_BLOCK_GROUPS = OverlapPolicy(min_group_bytes=1, max_groups=8)


class InlineExecutor(Executor):
    """Runs each digest when submitted, noting what the reader's blocks held at that moment."""

    def __init__(self, probe: Callable[[], Any]) -> None:
        self.probes: list[Any] = []
        self._probe = probe

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.probes.append(self._probe())
        future: Future[Any] = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def _overlapped_pair(polls_to_complete: int = 0) -> tuple[Pair, FakeFabric]:
    fabric, clock = FakeFabric(polls_to_complete), FakeClock(start=0.0)
    holder_kv, reader_kv = cpu_backend_kv_caches(seed=1), cpu_backend_kv_caches(seed=None)
    pair = Pair(
        _worker("h", fabric, clock, holder_kv, True),
        _worker("d", fabric, clock, reader_kv, True),
        holder_kv,
        reader_kv,
        clock,
    )
    assert pair.reader.verifier is not None
    pair.reader.verifier.overlap = ONE_BLOCK_GROUPS
    return pair, fabric


@pytest.fixture
def pair() -> Iterator[Pair]:
    p, _ = _overlapped_pair()
    yield p
    p.reader.shutdown()
    p.holder.shutdown()


def _landed(pair: Pair) -> list[bool]:
    """Which of the load's local blocks hold bytes already (the reader's KV starts zeroed)."""
    kv = pair.reader_kv[LAYER_NAME.format(0)]
    return [bool(kv[b].abs().sum() > 0) for b in LOCAL]


def test_groups_halve_what_is_left_down_to_the_smallest_group() -> None:
    policy = OverlapPolicy(min_group_bytes=4 << 20, max_groups=8)
    mb = 1 << 20
    assert policy.groups(128, 737_280) == [
        range(0, 64),
        range(64, 96),
        range(96, 112),
        range(112, 120),
        range(120, 128),
    ]
    assert policy.groups(128, 16_384) == [range(0, 128)], "2 MB: read whole, checked after"
    assert policy.groups(4, 2 * mb) == [range(0, 2), range(2, 4)]
    assert len(OverlapPolicy(min_group_bytes=1, max_groups=3).groups(100, 1)) == 3
    assert OverlapPolicy(min_group_bytes=1).groups(1, mb) == [range(0, 1)]
    assert OverlapPolicy(min_group_bytes=1).groups(0, mb) == [range(0, 0)]
    for blocks in range(1, 40):
        groups = OverlapPolicy(min_group_bytes=1, max_groups=5).groups(blocks, 1)
        assert [i for g in groups for i in g] == list(range(blocks)) and all(groups)


def test_each_group_is_digested_before_the_next_is_read(pair: Pair) -> None:
    assert pair.reader.verifier is not None
    inline = InlineExecutor(lambda: _landed(pair))
    pair.reader.verifier.checker = inline
    pair.state()
    pair.reader.start_load_kv(AdapterMetadata(loads=[pair.load()]))
    assert inline.probes == [[True, False, False], [True, True, False], [True, True, True]]
    outcomes = pair.outcomes()
    assert outcomes.failed == {} and outcomes.verified == {"r1": 3}
    for name in pair.holder_kv:
        assert torch.equal(pair.reader_kv[name][list(LOCAL)], pair.holder_kv[name][list(REMOTE)])


def test_a_corrupted_block_in_a_middle_group_fails_the_load_naming_it(pair: Pair) -> None:
    pair.state()
    pair.holder_kv[LAYER_NAME.format(1)][REMOTE[1]].view(torch.uint8).view(-1)[7] ^= 0xFF
    pair.reader.start_load_kv(AdapterMetadata(loads=[pair.load()]))
    outcomes = pair.outcomes()
    assert outcomes.mismatched == {"r1": 1} and outcomes.verified == {}
    assert (
        "1 of 3 blocks read differ from the holder's digests (first: holder block 4, layer 1)"
        in outcomes.failed["r1"]
    )
    assert outcomes.done == {"r1": 1}, "reported once, as failed: the scheduler recomputes it"


def test_groups_that_land_over_several_polls_are_digested_as_each_lands() -> None:
    p, fabric = _overlapped_pair(polls_to_complete=2)
    try:
        p.state()
        p.reader.start_load_kv(AdapterMetadata(loads=[p.load()]))
        outcomes = p.outcomes(polls=10)
        assert outcomes.failed == {} and outcomes.verified == {"r1": 3}
        assert fabric.transfers_posted >= 4, "one read per group, and the holder's entries"
    finally:
        p.reader.shutdown()
        p.holder.shutdown()


def test_a_group_whose_read_fails_fails_the_load_and_digests_nothing_more() -> None:
    p, fabric = _overlapped_pair(polls_to_complete=1)
    try:
        assert p.reader.verifier is not None
        inline = InlineExecutor(lambda: None)
        p.reader.verifier.checker = inline
        p.state()
        fabric.error_state("h-pp0-tp0")
        p.reader.start_load_kv(AdapterMetadata(loads=[p.load()]))
        outcomes = p.outcomes(polls=5)
        assert "r1" in outcomes.failed and outcomes.verified == {} and outcomes.mismatched == {}
        assert inline.probes == [], "no group landed: none was digested"
    finally:
        p.reader.shutdown()
        p.holder.shutdown()


def test_a_digest_that_raises_is_no_verification_the_load_is_recomputed(pair: Pair) -> None:
    assert pair.reader.verifier is not None
    source = pair.reader.verifier._sources[pb.TIER_GPU]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("digest kernel failed")

    source.digests = broken  # type: ignore[method-assign]
    pair.state()
    pair.reader.start_load_kv(AdapterMetadata(loads=[pair.load()]))
    outcomes = pair.outcomes()
    assert "verify_bytes: cannot check the digests: digest kernel failed" in outcomes.failed["r1"]
    assert outcomes.verified == {}


def test_small_loads_are_read_whole_and_checked_after() -> None:
    p, fabric = _overlapped_pair()
    try:
        assert p.reader.verifier is not None
        p.reader.verifier.overlap = OverlapPolicy()  # the default: 4 MB groups; these are KBs
        p.state()
        before = fabric.transfers_posted
        p.reader.start_load_kv(AdapterMetadata(loads=[p.load()]))
        assert fabric.transfers_posted - before == 2, "the blocks and the holder's entries"
        assert p.outcomes().verified == {"r1": 3}
        assert p.reader.verifier.checker is None, "no digest thread for a load checked after"
    finally:
        p.reader.shutdown()
        p.holder.shutdown()
