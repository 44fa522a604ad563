"""Real NIXL (UCX) between two processes: bytes read exactly, dead peers fail cleanly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvbroker.engine_adapter.nixl_agent import nixl_available
from tests.engine_adapter.nixl_peer import CPU, GPU, Peer, PeerSpec, Reader

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]


SPEC = PeerSpec(agent_name="holder-a", seed=11)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer(SPEC)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def reader(peer: Peer) -> Iterator[Reader]:
    r = Reader("reader-a", SPEC)
    r.mover.add_peer(SPEC.agent_name, peer.info["metadata"])
    yield r
    r.close()


@pytest.fixture(autouse=True)
def _zero_reader(request: pytest.FixtureRequest) -> None:
    if "reader" in request.fixturenames:
        for t in request.getfixturevalue("reader").kv.values():
            t.zero_()


def read_gpu(reader: Reader, peer: Peer, remote: list[int], local: list[int], **kw: Any) -> int:
    return reader.mover.start_read(
        peer.spec.agent_name,
        peer.info["gpu_regions"],
        remote,
        GPU,
        local,
        peer_num_blocks=peer.info["num_blocks"],
        **kw,
    )


@pytest.mark.parametrize(
    ("remote", "local"),
    [
        ([0], [0]),
        ([5, 6, 7, 8], [0, 1, 2, 3]),  # a run: one coalesced descriptor per layer
        ([22, 23, 0, 1], [22, 23, 0, 1]),  # runs joined across layers: layer l's end, layer l+1's start
        (list(range(24)), list(range(24))),  # the whole cache: one descriptor for every layer
        ([23, 1, 12, 4], [2, 20, 9, 17]),  # scattered
        (list(range(24)), list(reversed(range(24)))),  # every block, permuted
    ],
)
def test_read_all_layers_exact_bytes(reader: Reader, peer: Peer, remote: list[int], local: list[int]) -> None:
    h = read_gpu(reader, peer, remote, local)
    assert reader.wait([h]) == ([h], {})
    for layer in range(SPEC.num_layers):
        got, want = reader.layer(layer), peer.layer(layer)
        for r, loc in zip(remote, local, strict=True):
            assert torch.equal(got[loc], want[r]), f"layer {layer} block {r}->{loc}"
        untouched = sorted(set(range(SPEC.num_blocks)) - set(local))
        assert not got[untouched].any()


def test_read_subset_of_layers(reader: Reader, peer: Peer) -> None:
    h = read_gpu(reader, peer, [2, 3], [10, 11], layers=range(1, 3))
    assert reader.wait([h]) == ([h], {})
    assert not reader.layer(0).any()
    for layer in (1, 2):
        assert torch.equal(reader.layer(layer)[10:12], peer.layer(layer)[2:4])


def test_read_from_peer_cpu_tier(reader: Reader, peer: Peer) -> None:
    """The holder's GPU copy may be gone: its CPU tier slots are read straight into our KV blocks."""
    slot_of = SPEC.slot_of_block()
    blocks = [23, 20, 17]
    h = reader.mover.start_read(
        SPEC.agent_name,
        peer.info["cpu_regions"],
        [slot_of[b] for b in blocks],
        GPU,
        [0, 1, 2],
        peer_num_blocks=peer.info["num_slots"],
    )
    assert reader.wait([h]) == ([h], {})
    for layer in range(SPEC.num_layers):
        for i, b in enumerate(blocks):
            assert torch.equal(reader.layer(layer)[i], peer.layer(layer)[b])


def test_read_into_local_cpu_tier(reader: Reader, peer: Peer) -> None:
    h = reader.mover.start_read(
        SPEC.agent_name, peer.info["gpu_regions"], [9, 4], CPU, [3, 6], peer_num_blocks=SPEC.num_blocks
    )
    assert reader.wait([h]) == ([h], {})
    for i in range(SPEC.num_layers):
        want = peer.layer(i)
        assert reader.tier.slot_bytes(i, 3).numpy().tobytes() == want[9].numpy().tobytes()
        assert reader.tier.slot_bytes(i, 6).numpy().tobytes() == want[4].numpy().tobytes()


def test_many_concurrent_reads(reader: Reader, peer: Peer) -> None:
    handles = [
        read_gpu(reader, peer, [i], [SPEC.num_blocks - 1 - i], layers=range(i % 3, 3)) for i in range(16)
    ]
    done, failed = reader.wait(handles)
    assert failed == {} and sorted(done) == handles
    for i in range(16):
        for layer in range(i % 3, 3):
            assert torch.equal(reader.layer(layer)[SPEC.num_blocks - 1 - i], peer.layer(layer)[i])


def test_notification_reaches_holder(reader: Reader, peer: Peer) -> None:
    h = read_gpu(reader, peer, [1], [1], notif=b"lease-7:done")
    assert reader.wait([h]) == ([h], {})
    deadline = time.monotonic() + 5
    got: list[tuple[str, bytes]] = []
    while time.monotonic() < deadline and not got:
        peer.conn.send("notifications")
        got = peer.conn.recv()
        time.sleep(0.01)
    assert ("reader-a", b"lease-7:done") in got


def test_killed_peer_becomes_failed_handles_not_a_hang() -> None:
    spec = PeerSpec(agent_name="holder-doomed", seed=3, num_blocks=256, block_size=64, head_size=64)
    peer = Peer(spec)
    reader = Reader("reader-doomed", spec)
    try:
        reader.mover.add_peer(spec.agent_name, peer.info["metadata"])
        first = reader.mover.start_read(
            spec.agent_name, peer.info["gpu_regions"], [0, 1], GPU, [0, 1], peer_num_blocks=spec.num_blocks
        )
        assert reader.wait([first]) == ([first], {})

        everything = list(range(spec.num_blocks))
        in_flight = [
            reader.mover.start_read(
                spec.agent_name,
                peer.info["gpu_regions"],
                everything,
                GPU,
                everything,
                peer_num_blocks=spec.num_blocks,
            )
            for _ in range(4)
        ]
        peer.kill9()
        # In-flight reads end either way (they may have finished before the kill landed)...
        started = time.monotonic()
        ended = reader.wait(in_flight, timeout=30)
        print(f"in flight at the kill: done {ended[0]}, failed {ended[1]}")
        # ...and every read after the death fails, reported by poll(), never raised.
        after = reader.mover.start_read(
            spec.agent_name, peer.info["gpu_regions"], [2], GPU, [2], peer_num_blocks=spec.num_blocks
        )
        done, failed = reader.wait([after], timeout=30)
        print(f"dead peer detected in {time.monotonic() - started:.2f}s: {failed}")
        assert done == [] and after in failed
        reader.mover.remove_peer(spec.agent_name)
        assert spec.agent_name not in reader.mover.peers()
    finally:
        reader.close()
        peer.stop()


def test_peer_killed_before_first_read_fails_cleanly() -> None:
    """The broker named a holder that died before we ever connected to it."""
    spec = PeerSpec(agent_name="holder-gone", seed=4)
    peer = Peer(spec)
    reader = Reader("reader-gone", spec)
    try:
        reader.mover.add_peer(spec.agent_name, peer.info["metadata"])
        peer.kill9()
        started = time.monotonic()
        h = reader.mover.start_read(
            spec.agent_name, peer.info["gpu_regions"], [0], GPU, [0], peer_num_blocks=spec.num_blocks
        )
        done, failed = reader.wait([h], timeout=40)
        print(f"unreachable peer reported after {time.monotonic() - started:.2f}s: {failed}")
        assert done == [] and h in failed
        assert not reader.layer(0).any()
    finally:
        reader.close()
        peer.stop()
