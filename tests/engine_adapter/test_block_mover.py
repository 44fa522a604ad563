"""BlockMover against the fake NIXL: reads, layer subsets, slow and failing peers, bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvbroker.engine_adapter import block_mover
from kvbroker.engine_adapter.block_mover import BlockMover
from kvbroker.engine_adapter.kv_regions import Region, regions_from_kv_caches
from testkit.clock import FakeClock
from tests.engine_adapter.fake_nixl import FakeFabric
from tests.engine_adapter.kv_fixtures import LAYER_NAME, cpu_backend_kv_caches, legacy_split_kv_caches

GPU, CPU = 1, 2


class Pair:
    """A holder with random KV and a reader with zeroed KV, both on one fake fabric."""

    def __init__(self, fabric: FakeFabric, clock: FakeClock, split: bool = False) -> None:
        make = legacy_split_kv_caches if split else cpu_backend_kv_caches
        self.holder_kv = make(seed=1)
        self.reader_kv = make(seed=None)
        self.holder = BlockMover("holder", nixl=fabric.api(), progress_interval_s=None, clock=clock)
        self.reader = BlockMover("reader", nixl=fabric.api(), progress_interval_s=None, clock=clock)
        self.holder_regions, self.num_blocks, mem = regions_from_kv_caches(self.holder_kv)
        reader_regions, _, _ = regions_from_kv_caches(self.reader_kv)
        self.holder.register_tier(GPU, mem, self.holder_regions, self.num_blocks)
        self.reader.register_tier(GPU, mem, reader_regions, self.num_blocks)
        self.reader.add_peer("holder", self.holder.agent_metadata())

    def read(self, remote: list[int], local: list[int], **kw: object) -> int:
        return self.reader.start_read("holder", self.holder_regions, remote, GPU, local, **kw)  # type: ignore[arg-type]

    def layer(self, kv: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
        return kv[LAYER_NAME.format(layer)]


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=0.0)


@pytest.fixture
def pair(fabric: FakeFabric, clock: FakeClock) -> Iterator[Pair]:
    p = Pair(fabric, clock)
    yield p
    p.reader.close()
    p.holder.close()


@pytest.fixture
def coalescing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read builds coalesced descriptors (none is small enough for prepared lists)."""
    monkeypatch.setattr(block_mover, "_PREPPED_MAX_DESCS", 0)


def poll_until_settled(mover: BlockMover, max_polls: int = 100) -> tuple[list[int], dict[int, str]]:
    done: list[int] = []
    failed: dict[int, str] = {}
    for _ in range(max_polls):
        d, f = mover.poll()
        done += d
        failed |= f
        if mover.in_flight() == 0 and (done or failed):
            break
    return done, failed


def test_read_moves_the_right_blocks_of_every_layer(pair: Pair, fabric: FakeFabric, coalescing: None) -> None:
    h = pair.read([3, 7, 8, 9], [0, 12, 5, 6])
    done, failed = poll_until_settled(pair.reader)
    assert (done, failed) == ([h], {})
    for layer in range(3):
        src, dst = pair.layer(pair.holder_kv, layer), pair.layer(pair.reader_kv, layer)
        for r, loc in [(3, 0), (7, 12), (8, 5), (9, 6)]:
            assert torch.equal(dst[loc], src[r])
        assert not dst[1].any()  # untouched blocks stay untouched
    # 4 blocks x 3 layers in ONE transfer; blocks 8, 9 -> 5, 6 are adjacent on both sides: one descriptor
    assert fabric.transfers_posted == 1 and fabric.descs_per_transfer == [3 * 3]


def test_layer_subset_touches_only_those_layers(pair: Pair) -> None:
    h = pair.read([1, 2], [1, 2], layers=range(1, 3))
    assert poll_until_settled(pair.reader) == ([h], {})
    assert not pair.layer(pair.reader_kv, 0).any()
    for layer in (1, 2):
        assert torch.equal(pair.layer(pair.reader_kv, layer)[1:3], pair.layer(pair.holder_kv, layer)[1:3])


def test_split_kv_layout_moves_k_and_v(fabric: FakeFabric, clock: FakeClock, coalescing: None) -> None:
    p = Pair(fabric, clock, split=True)
    h = p.read([4, 5], [0, 9])
    assert poll_until_settled(p.reader) == ([h], {})
    for layer in range(2):
        src, dst = p.layer(p.holder_kv, layer), p.layer(p.reader_kv, layer)
        assert torch.equal(dst[:, 0], src[:, 4]) and torch.equal(dst[:, 9], src[:, 5])
    assert fabric.descs_per_transfer == [2 * 2 * 2]  # blocks x (K, V) x layers


def test_completes_only_after_n_polls(pair: Pair, fabric: FakeFabric) -> None:
    fabric.polls_to_complete = 3
    h = pair.read([0], [0])
    for _ in range(2):
        assert pair.reader.poll() == ([], {})
    d, _ = pair.reader.poll()
    d2, _ = pair.reader.poll()
    assert d + d2 == [h]
    assert pair.reader.in_flight() == 0


def test_many_concurrent_reads_finish_independently(pair: Pair, fabric: FakeFabric) -> None:
    fabric.polls_to_complete = 2
    handles = [pair.read([i], [i]) for i in range(10)]
    done, failed = poll_until_settled(pair.reader)
    assert sorted(done) == handles and failed == {}
    assert fabric.live_xfers == 0  # every transfer handle released


def test_dead_peer_fails_reads_without_raising(pair: Pair, fabric: FakeFabric) -> None:
    fabric.polls_to_complete = 5
    in_flight = pair.read([0, 1], [0, 1])
    fabric.kill("holder")
    _, failed = pair.reader.poll()
    assert "disconnected" in failed[in_flight]
    later = pair.read([2], [2])  # known dead: fails fast, still no exception
    _, failed = pair.reader.poll()
    assert "unreachable" in failed[later]
    assert not pair.layer(pair.reader_kv, 0)[:3].any()


def test_peer_that_dies_before_posting(pair: Pair, fabric: FakeFabric) -> None:
    fabric.kill("holder")
    h = pair.read([0], [0])
    _, failed = pair.reader.poll()
    assert "disconnected" in failed[h]


def test_error_state_is_a_failure(pair: Pair, fabric: FakeFabric) -> None:
    fabric.polls_to_complete = 1
    fabric.error_state("holder")
    h = pair.read([0], [0])
    _, failed = poll_until_settled(pair.reader)
    assert "error state" in failed[h]
    assert fabric.live_xfers == 0


def test_read_times_out(fabric: FakeFabric, clock: FakeClock) -> None:
    p = Pair(fabric, clock)
    p.reader._read_timeout_s = 10.0
    fabric.polls_to_complete = 10**9
    h = p.read([0], [0])
    clock.advance(5.0)  # to 5.0
    assert p.reader.poll() == ([], {})
    clock.advance(5.5)  # to 10.5
    _, failed = p.reader.poll()
    assert "timed out" in failed[h]


def test_unknown_peer_and_removed_peer(pair: Pair, fabric: FakeFabric) -> None:
    h = pair.reader.start_read("nobody", pair.holder_regions, [0], GPU, [0])
    _, failed = pair.reader.poll()
    assert "unknown peer" in failed[h]

    fabric.polls_to_complete = 100
    h2 = pair.read([1], [1])
    pair.reader.remove_peer("holder")
    _, failed = pair.reader.poll()
    assert "abandoned" in failed[h2]
    assert fabric.live_xfers == 0
    assert pair.reader.peers() == []
    assert "holder" not in fabric.agents["reader"].remote


def test_add_peer_is_idempotent_and_replaces_new_metadata(pair: Pair, fabric: FakeFabric) -> None:
    md = pair.holder.agent_metadata()
    pair.reader.add_peer("holder", md)
    pair.reader.add_peer("holder", md)
    assert pair.reader.peers() == ["holder"]
    with pytest.raises(ValueError, match="belongs to agent"):
        pair.reader.add_peer("someone-else", md)
    with pytest.raises(ValueError, match="rejected"):
        pair.reader.add_peer("holder2", b"garbage")


def test_readd_after_death_recovers(pair: Pair, fabric: FakeFabric) -> None:
    fabric.kill("holder")
    h = pair.read([0], [0])
    assert h in pair.reader.poll()[1]
    fabric.dead.clear()  # the peer came back (a new process would bring new metadata)
    pair.reader.add_peer("holder", pair.holder.agent_metadata())
    h2 = pair.read([0], [0])
    assert poll_until_settled(pair.reader) == ([h2], {})


def test_caller_mistakes_raise_value_error(pair: Pair) -> None:
    with pytest.raises(ValueError, match="not registered"):
        pair.reader.start_read("holder", pair.holder_regions, [0], CPU, [0])
    with pytest.raises(ValueError, match="remote blocks but"):
        pair.read([0, 1], [0])
    with pytest.raises(ValueError, match="tier size"):
        pair.read([0], [pair.num_blocks])
    with pytest.raises(ValueError, match="negative"):
        pair.read([-1], [0])
    with pytest.raises(ValueError, match="layer 7"):
        pair.read([0], [0], layers=range(7, 8))
    bigger = [Region(r.layer, r.base_addr, r.block_stride, r.block_bytes * 2) for r in pair.holder_regions]
    with pytest.raises(ValueError, match="layouts differ"):
        pair.reader.start_read("holder", bigger, [0], GPU, [0])


def test_empty_read_finishes_at_once(pair: Pair, fabric: FakeFabric) -> None:
    h = pair.read([], [])
    assert pair.reader.poll() == ([h], {})
    assert fabric.transfers_posted == 0


def test_adjacent_blocks_travel_as_one_descriptor(pair: Pair, fabric: FakeFabric, coalescing: None) -> None:
    h = pair.read([4, 5, 6, 7], [10, 11, 12, 13], peer_num_blocks=pair.num_blocks)
    assert poll_until_settled(pair.reader) == ([h], {})
    assert fabric.descs_per_transfer == [3]  # one per layer
    for layer in range(3):
        assert torch.equal(pair.layer(pair.reader_kv, layer)[10:14], pair.layer(pair.holder_kv, layer)[4:8])


def test_a_layers_last_block_merges_with_the_next_layers_first(
    pair: Pair, fabric: FakeFabric, coalescing: None
) -> None:
    """Layer-compact layout in one allocation: block 23 of layer l ends where block 0 of layer l+1 starts."""
    last = pair.num_blocks - 1
    h = pair.read([last, 0], [last, 0], peer_num_blocks=pair.num_blocks)
    assert poll_until_settled(pair.reader) == ([h], {})
    assert fabric.descs_per_transfer == [4]  # L0b0, L0b23+L1b0, L1b23+L2b0, L2b23
    for layer in range(3):
        for b in (0, last):
            assert torch.equal(pair.layer(pair.reader_kv, layer)[b], pair.layer(pair.holder_kv, layer)[b])


def test_read_beyond_the_first_without_known_size(pair: Pair) -> None:
    h1 = pair.read([1], [1])
    h2 = pair.read([20], [2])  # beyond the first list's reach
    done, failed = poll_until_settled(pair.reader)
    assert sorted(done) == [h1, h2] and failed == {}
    assert torch.equal(pair.layer(pair.reader_kv, 0)[2], pair.layer(pair.holder_kv, 0)[20])


def test_notifications_reach_the_holder(pair: Pair) -> None:
    pair.read([0], [0], notif=b"lease-42")
    poll_until_settled(pair.reader)
    assert pair.holder.take_notifications() == [("reader", b"lease-42")]
    assert pair.holder.take_notifications() == []


def test_reading_into_cpu_tier_from_peer_cpu_tier(fabric: FakeFabric, clock: FakeClock) -> None:
    """Any local tier can receive; any peer tier can be the source."""
    holder = BlockMover("h", nixl=fabric.api(), progress_interval_s=None, clock=clock)
    reader = BlockMover("r", nixl=fabric.api(), progress_interval_s=None, clock=clock)
    src = torch.arange(4 * 8 * 64, dtype=torch.uint8).view(4, 8, 64)  # 4 layers, 8 slots, 64 B
    dst = torch.zeros_like(src)
    regions = [Region(layer, src[layer].data_ptr(), 64, 64) for layer in range(4)]
    holder.register_tier(CPU, "DRAM", regions, 8)
    reader.register_tier(CPU, "DRAM", [Region(layer, dst[layer].data_ptr(), 64, 64) for layer in range(4)], 8)
    reader.add_peer("h", holder.agent_metadata())
    h = reader.start_read("h", regions, [7, 6], CPU, [0, 1], layers=range(2, 4))
    assert poll_until_settled(reader) == ([h], {})
    assert torch.equal(dst[2:, 0], src[2:, 7]) and torch.equal(dst[2:, 1], src[2:, 6])
    assert not dst[:2].any()


def test_close_releases_everything(fabric: FakeFabric, clock: FakeClock) -> None:
    p = Pair(fabric, clock)
    fabric.polls_to_complete = 100
    p.read([0], [0])
    p.reader.close()
    p.reader.close()
    p.holder.close()
    assert fabric.live_xfers == 0 and fabric.live_dlists == 0
    assert fabric.agents["reader"].registered == [] and fabric.agents["holder"].registered == []
    with pytest.raises(ValueError, match="closed"):
        p.read([0], [0])


def test_reregistering_a_tier_fails_its_reads(pair: Pair, fabric: FakeFabric) -> None:
    fabric.polls_to_complete = 100
    h = pair.read([0], [0])
    regions, n, mem = regions_from_kv_caches(pair.reader_kv)
    pair.reader.register_tier(GPU, mem, regions, n)
    _, failed = pair.reader.poll()
    assert "re-registered" in failed[h]


def test_ticker_collects_notifications_in_background(fabric: FakeFabric) -> None:
    holder = BlockMover("h2", nixl=fabric.api(), progress_interval_s=0.001)
    try:
        fabric.agents["h2"].notifs["x"] = [b"hello"]
        for _ in range(1000):
            if not fabric.agents["h2"].notifs:
                break
            time.sleep(0.001)
        assert holder.take_notifications() == [("x", b"hello")]
    finally:
        holder.close()


def test_peer_memory_type_can_differ_from_local(fabric: FakeFabric, clock: FakeClock) -> None:
    """Peer VRAM into the local (DRAM) CPU tier: the peer descriptors carry the peer's type."""
    holder = BlockMover("hv", nixl=fabric.api(), progress_interval_s=None, clock=clock)
    reader = BlockMover("rv", nixl=fabric.api(), progress_interval_s=None, clock=clock)
    src = torch.arange(2 * 4 * 32, dtype=torch.uint8).view(2, 4, 32)
    dst = torch.zeros_like(src)
    regions = [Region(layer, src[layer].data_ptr(), 32, 32) for layer in range(2)]
    holder.register_tier(GPU, "VRAM", regions, 4)  # the fake does not care where the bytes really are
    reader.register_tier(CPU, "DRAM", [Region(layer, dst[layer].data_ptr(), 32, 32) for layer in range(2)], 4)
    reader.add_peer("hv", holder.agent_metadata())
    wrong = reader.start_read("hv", regions, [1], CPU, [1])
    _, failed = reader.poll()
    assert "could not prepare" in failed[wrong]
    h = reader.start_read("hv", regions, [3], CPU, [0], peer_mem_type="VRAM", peer_num_blocks=4)
    assert poll_until_settled(reader) == ([h], {})
    assert torch.equal(dst[:, 0], src[:, 3])


def test_a_small_read_of_a_known_size_uses_prepared_lists(pair: Pair, fabric: FakeFabric) -> None:
    """One descriptor per (layer, block) from lists prepared once; the same bytes arrive."""
    h1 = pair.read([4, 5, 9], [10, 11, 2], peer_num_blocks=pair.num_blocks)
    h2 = pair.read([last := pair.num_blocks - 1], [0], peer_num_blocks=pair.num_blocks)
    assert sorted(poll_until_settled(pair.reader)[0]) == [h1, h2]
    assert fabric.prepped_transfers == 2 and fabric.descs_per_transfer == [3 * 3, 3]
    assert fabric.live_dlists == 2  # the local tier's and the peer tier's, kept for the next read
    for layer in range(3):
        src, dst = pair.layer(pair.holder_kv, layer), pair.layer(pair.reader_kv, layer)
        for r, loc in [(4, 10), (5, 11), (9, 2), (last, 0)]:
            assert torch.equal(dst[loc], src[r])
    pair.reader.remove_peer("holder")
    assert fabric.live_dlists == 1  # the peer's list went with the peer


def test_large_reads_and_unknown_sizes_coalesce(
    pair: Pair, fabric: FakeFabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(block_mover, "_PREPPED_MAX_DESCS", 3 * 3)
    h1 = pair.read([0, 1, 2, 3], [4, 5, 6, 7], peer_num_blocks=pair.num_blocks)  # 12 pieces > 9
    h2 = pair.read([8], [8])  # the peer's tier size is not known: no list can be prepared
    assert sorted(poll_until_settled(pair.reader)[0]) == [h1, h2]
    assert fabric.prepped_transfers == 0 and fabric.descs_per_transfer == [3, 3]
    monkeypatch.setattr(block_mover, "_PREPPED_MAX_ROWS", 3 * pair.num_blocks - 1)  # the tier is too big
    h3 = pair.read([9], [9], peer_num_blocks=pair.num_blocks)
    assert poll_until_settled(pair.reader)[0] == [h3]
    assert fabric.prepped_transfers == 0 and fabric.live_dlists == 0
    assert torch.equal(pair.layer(pair.reader_kv, 2)[4:10], pair.layer(pair.holder_kv, 2)[[0, 1, 2, 3, 8, 9]])


def test_a_tier_of_tiny_pieces_reads_from_prepared_lists_at_any_size(
    pair: Pair, fabric: FakeFabric, coalescing: None
) -> None:
    """A digest table (8 bytes per block and layer) reads from prepared lists even where a read of
    KV that large coalesces: NIXL merges its consecutive descriptors, numpy would cost more."""
    blocks, layers = 40, 3
    theirs = np.arange(blocks * layers, dtype=np.uint64).reshape(blocks, layers) + 1
    ours = np.zeros_like(theirs)

    def table(t: np.ndarray) -> list[Region]:
        return [Region(j, t.ctypes.data + 8 * j, 8 * layers, 8) for j in range(layers)]

    pair.holder.register_tier(7, "DRAM", table(theirs), blocks)
    pair.reader.register_tier(7, "DRAM", table(ours), blocks)
    pair.reader.add_peer("holder", pair.holder.agent_metadata())
    remote, local = list(range(5, 35)), list(range(2, 32))
    h = pair.reader.start_read("holder", table(theirs), remote, 7, local, peer_num_blocks=blocks)
    assert poll_until_settled(pair.reader)[0] == [h]
    assert np.array_equal(ours[2:32], theirs[5:35]) and not ours[32:].any() and not ours[:2].any()
    assert fabric.prepped_transfers == 1, "90 pieces, where KV coalesces any read (the fixture)"
    pair.read([1], [1])  # the KV tier still coalesces
    assert fabric.prepped_transfers == 1


def test_a_read_finished_inside_transfer_holds_no_handle(pair: Pair, fabric: FakeFabric) -> None:
    """The fake, like UCX between processes on one host, can finish a read inside transfer()."""
    h = pair.read([3, 4], [5, 6], peer_num_blocks=pair.num_blocks)
    assert fabric.live_xfers == 0 and pair.reader.in_flight() == 0  # released at once
    assert pair.reader.poll() == ([h], {})
    assert pair.reader.poll() == ([], {})
    assert torch.equal(pair.layer(pair.reader_kv, 1)[5:7], pair.layer(pair.holder_kv, 1)[3:5])


def test_reads_share_a_plan_per_peer_regions_and_layers(pair: Pair, fabric: FakeFabric) -> None:
    """Equal regions rebuilt per read (as the worker does) find the same plan; new layers, a new one."""
    peer = pair.reader._peers["holder"]
    for remote, local in [([1], [2]), ([7, 8], [9, 10]), ([0], [0])]:
        copies = [Region(r.layer, r.base_addr, r.block_stride, r.block_bytes) for r in pair.holder_regions]
        pair.reader.start_read("holder", copies, remote, GPU, local, peer_num_blocks=pair.num_blocks)
    assert len(peer.plans) == 1 and fabric.prepped_transfers == 3
    h = pair.read([5], [5], layers=range(1, 2), peer_num_blocks=pair.num_blocks)
    assert len(peer.plans) == 2 and pair.reader.poll()[0][-1] == h
    assert not pair.layer(pair.reader_kv, 0)[5].any()
    assert torch.equal(pair.layer(pair.reader_kv, 1)[5], pair.layer(pair.holder_kv, 1)[5])
    assert torch.equal(pair.layer(pair.reader_kv, 2)[9:11], pair.layer(pair.holder_kv, 2)[7:9])


def test_a_reregistered_tier_gets_a_new_plan(pair: Pair, fabric: FakeFabric) -> None:
    first = pair.read([1], [1], peer_num_blocks=pair.num_blocks)
    assert pair.reader.poll() == ([first], {})
    moved = cpu_backend_kv_caches(seed=None)  # the reader's KV cache at new addresses
    regions, n, mem = regions_from_kv_caches(moved)
    pair.reader.register_tier(GPU, mem, regions, n)
    assert fabric.live_dlists == 1  # the old tier's list went with it; the peer's stays
    h = pair.read([6, 2], [3, 4], peer_num_blocks=pair.num_blocks)
    assert poll_until_settled(pair.reader) == ([h], {})
    for layer in range(3):
        assert torch.equal(moved[LAYER_NAME.format(layer)][3], pair.layer(pair.holder_kv, layer)[6])
        assert torch.equal(moved[LAYER_NAME.format(layer)][4], pair.layer(pair.holder_kv, layer)[2])
    assert not pair.layer(pair.reader_kv, 0)[3].any()  # nothing went to the old memory
    assert fabric.live_dlists == 2


@pytest.mark.parametrize(
    ("remote", "local", "match"),
    [
        ((0, -1), (0, 1), "negative"),
        ([0, 1], [np.int64(-1), 1], "negative"),
        (np.array([0]), np.array([-2]), "negative"),
        ([2**40], [0], "tier size"),
        ([0], [2**40], "tier size"),
        ([0, 1], (0, 1, 2), "remote blocks but"),
        (np.array([0, 1]), [0], "remote blocks but"),
    ],
)
def test_block_ids_of_any_sequence_are_checked(pair: Pair, remote: object, local: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pair.read(remote, local, peer_num_blocks=pair.num_blocks)  # type: ignore[arg-type]
    assert pair.reader.in_flight() == 0 and pair.reader.poll() == ([], {})


def test_block_ids_of_any_sequence_are_read(pair: Pair) -> None:
    """Tuples, numpy arrays and numpy integers in lists read like lists."""
    handles = [
        pair.read((1, 2), (3, 4), peer_num_blocks=pair.num_blocks),
        pair.read(np.array([5]), np.array([6]), peer_num_blocks=pair.num_blocks),
        pair.read([np.int64(7)], (8,)),
    ]
    assert sorted(poll_until_settled(pair.reader)[0]) == handles
    for remote, local in [(1, 3), (2, 4), (5, 6), (7, 8)]:
        assert torch.equal(pair.layer(pair.reader_kv, 2)[local], pair.layer(pair.holder_kv, 2)[remote])


def test_layers_may_be_any_iterable(pair: Pair) -> None:
    """An iterator of layers is read once: the plan and its key see the same layers."""
    h = pair.read([3], [4], layers=iter([0, 2]), peer_num_blocks=pair.num_blocks)  # type: ignore[arg-type]
    assert pair.reader.poll() == ([h], {})
    assert torch.equal(pair.layer(pair.reader_kv, 0)[4], pair.layer(pair.holder_kv, 0)[3])
    assert torch.equal(pair.layer(pair.reader_kv, 2)[4], pair.layer(pair.holder_kv, 2)[3])
    assert not pair.layer(pair.reader_kv, 1)[4].any()
