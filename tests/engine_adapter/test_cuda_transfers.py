"""VRAM registration and GPU transfers over real NIXL; skipped cleanly without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvbroker.engine_adapter.kv_regions import regions_from_kv_caches
from kvbroker.engine_adapter.nixl_agent import nixl_available
from tests.engine_adapter.kv_fixtures import cpu_backend_kv_caches
from tests.engine_adapter.nixl_peer import CPU, GPU, Peer, PeerSpec, Reader

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.nixl,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

SPEC = PeerSpec(agent_name="gpu-holder", seed=21, num_blocks=32, device="cuda")


def test_vram_caches_map_to_vram_regions() -> None:
    kv = cpu_backend_kv_caches(num_blocks=8, device="cuda", seed=1)
    regions, n, mem_type = regions_from_kv_caches(kv)
    assert (n, mem_type) == (8, "VRAM")
    assert all(r.device_id == torch.cuda.current_device() for r in regions)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer(SPEC)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def reader(peer: Peer) -> Iterator[Reader]:
    r = Reader("gpu-reader", SPEC)
    r.mover.add_peer(SPEC.agent_name, peer.info["metadata"])
    yield r
    r.close()


def test_gpu_to_gpu_read(reader: Reader, peer: Peer) -> None:
    for t in reader.kv.values():
        t.zero_()
    h = reader.mover.start_read(
        SPEC.agent_name, peer.info["gpu_regions"], [3, 4, 30], GPU, [0, 1, 2], peer_num_blocks=SPEC.num_blocks
    )
    assert reader.wait([h]) == ([h], {})
    torch.cuda.synchronize()
    for layer in range(SPEC.num_layers):
        got = reader.layer(layer).cpu()
        want = peer.layer(layer)
        assert torch.equal(got[0:2], want[3:5]) and torch.equal(got[2], want[30])


def test_gpu_to_local_pinned_cpu_tier(reader: Reader, peer: Peer) -> None:
    assert reader.tier.pinned
    h = reader.mover.start_read(
        SPEC.agent_name,
        peer.info["gpu_regions"],
        [7, 8],
        CPU,
        [5, 6],
        peer_num_blocks=SPEC.num_blocks,
        peer_mem_type="VRAM",
    )
    assert reader.wait([h]) == ([h], {})
    for layer in range(SPEC.num_layers):
        want = peer.layer(layer)
        assert reader.tier.slot_bytes(layer, 5).numpy().tobytes() == want[7].numpy().tobytes()
        assert reader.tier.slot_bytes(layer, 6).numpy().tobytes() == want[8].numpy().tobytes()


def test_peer_pinned_cpu_tier_into_vram(reader: Reader, peer: Peer) -> None:
    slot_of = SPEC.slot_of_block()
    h = reader.mover.start_read(
        SPEC.agent_name,
        peer.info["cpu_regions"],
        [slot_of[31]],
        GPU,
        [9],
        peer_num_blocks=SPEC.num_slots,
        peer_mem_type="DRAM",
    )
    assert reader.wait([h]) == ([h], {})
    torch.cuda.synchronize()
    for layer in range(SPEC.num_layers):
        assert torch.equal(reader.layer(layer)[9].cpu(), peer.layer(layer)[31])
