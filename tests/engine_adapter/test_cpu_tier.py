"""CpuTierBuffer: asynchronous store/load between the KV cache and host slots."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from kvbroker.engine_adapter.cpu_tier import CpuTierBuffer
from kvbroker.engine_adapter.kv_regions import regions_from_kv_caches
from tests.engine_adapter.kv_fixtures import LAYER_NAME, cpu_backend_kv_caches, legacy_split_kv_caches


def wait_done(tier: CpuTierBuffer, handle: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle in tier.poll():
            return
        time.sleep(0.001)
    raise AssertionError(f"copy {handle} did not finish")


def test_store_then_load_round_trip() -> None:
    kv = cpu_backend_kv_caches(num_layers=3, num_blocks=16, seed=5)
    original = {k: v.clone() for k, v in kv.items()}
    regions, _, _ = regions_from_kv_caches(kv)
    tier = CpuTierBuffer(regions, num_slots=8, pin_memory=False)
    try:
        h = tier.start_store(kv, [2, 3, 4, 10], [0, 1, 2, 7])
        wait_done(tier, h)
        for i, r in enumerate(regions):
            src = kv[LAYER_NAME.format(r.layer)]
            for block, slot in [(2, 0), (3, 1), (4, 2), (10, 7)]:
                assert tier.slot_bytes(i, slot).numpy().tobytes() == src[block].numpy().tobytes()
        for v in kv.values():
            v.zero_()
        h = tier.start_load([7, 0], kv, [1, 15])
        wait_done(tier, h)
        for name, v in kv.items():
            assert torch.equal(v[1], original[name][10]) and torch.equal(v[15], original[name][2])
            assert not v[0].any()
        assert tier.take_failed() == {}
    finally:
        tier.close()


def test_regions_describe_the_slots_for_nixl() -> None:
    kv = cpu_backend_kv_caches(num_layers=2, num_blocks=4, seed=1)
    regions, _, _ = regions_from_kv_caches(kv)
    tier = CpuTierBuffer(regions, num_slots=3, pin_memory=False)
    try:
        wait_done(tier, tier.start_store(kv, [3], [2]))
        out = tier.regions()
        assert [r.layer for r in out] == [0, 1]
        assert all(r.block_stride == r.block_bytes == regions[0].block_bytes for r in out)
        for r in out:
            got = ctypes.string_at(r.block_addr(2), r.block_bytes)
            assert got == kv[LAYER_NAME.format(r.layer)][3].numpy().tobytes()
        assert tier.nbytes == 2 * 3 * regions[0].block_bytes
        assert tier.mem_type == "DRAM"
    finally:
        tier.close()


def test_split_kv_layout_round_trip() -> None:
    kv = legacy_split_kv_caches(num_layers=2, num_blocks=6, seed=3)
    original = {k: v.clone() for k, v in kv.items()}
    regions, _, _ = regions_from_kv_caches(kv)
    tier = CpuTierBuffer(regions, num_slots=4, pin_memory=False)
    try:
        wait_done(tier, tier.start_store(kv, [5, 1], [0, 3]))
        for v in kv.values():
            v.zero_()
        wait_done(tier, tier.start_load([0, 3], kv, [2, 4]))
        for name, v in kv.items():
            assert torch.equal(v[:, 2], original[name][:, 5]) and torch.equal(v[:, 4], original[name][:, 1])
    finally:
        tier.close()


def test_copies_do_not_block_the_caller_and_finish_in_order() -> None:
    kv = cpu_backend_kv_caches(num_layers=2, num_blocks=64, seed=2)
    regions, _, _ = regions_from_kv_caches(kv)
    tier = CpuTierBuffer(regions, num_slots=64, pin_memory=False)
    try:
        handles = [tier.start_store(kv, [i], [63 - i]) for i in range(64)]
        finished: list[int] = []
        deadline = time.monotonic() + 10
        while len(finished) < 64 and time.monotonic() < deadline:
            finished += tier.poll()
            time.sleep(0.001)
        assert sorted(finished) == handles
    finally:
        tier.close()


def test_bad_ids_raise_before_anything_is_queued() -> None:
    kv = cpu_backend_kv_caches(num_layers=1, num_blocks=4, seed=None)
    regions, _, _ = regions_from_kv_caches(kv)
    tier = CpuTierBuffer(regions, num_slots=2, pin_memory=False)
    try:
        with pytest.raises(ValueError, match="slot 2"):
            tier.start_store(kv, [0], [2])
        with pytest.raises(ValueError, match="KV block 4"):
            tier.start_load([0], kv, [4])
        with pytest.raises(ValueError, match="slots"):
            tier.start_store(kv, [0, 1], [0])
        other = cpu_backend_kv_caches(num_layers=1, num_blocks=4, seed=None)
        with pytest.raises(ValueError, match="not in the given KV caches"):
            tier.start_store(other, [0], [0])
        with pytest.raises(ValueError):
            CpuTierBuffer(regions, num_slots=0)
    finally:
        tier.close()


@pytest.mark.cuda
def test_gpu_store_and_load_through_pinned_buffer() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kv = cpu_backend_kv_caches(num_layers=2, num_blocks=32, seed=4, device="cuda")
    original = {k: v.clone() for k, v in kv.items()}
    regions, _, mem_type = regions_from_kv_caches(kv)
    assert mem_type == "VRAM"
    tier = CpuTierBuffer(regions, num_slots=8)
    assert tier.pinned
    h = tier.start_store(kv, [30, 31, 5], [0, 1, 7])
    wait_done(tier, h)
    for v in kv.values():
        v.zero_()
    wait_done(tier, tier.start_load([7, 0, 1], kv, [0, 1, 2]))
    torch.cuda.synchronize()
    for name, v in kv.items():
        assert torch.equal(v[0], original[name][5])
        assert torch.equal(v[1:3], original[name][30:32])


def test_load_into_a_kv_cache_made_of_inference_tensors() -> None:
    """vLLM allocates its KV cache, and calls the connector, in inference mode; the copies
    run on another thread, which is not."""
    with torch.inference_mode():
        kv = cpu_backend_kv_caches(num_layers=2, num_blocks=8, seed=9)
        original = {k: v.clone() for k, v in kv.items()}
    assert all(v.is_inference() for v in kv.values())
    regions, _, _ = regions_from_kv_caches(kv)
    tier = CpuTierBuffer(regions, num_slots=4, pin_memory=False)
    try:
        with torch.inference_mode():
            stored = tier.start_store(kv, [5, 6], [0, 1])
        wait_done(tier, stored)
        with torch.inference_mode():
            loaded = tier.start_load([1, 0], kv, [2, 3])
        wait_done(tier, loaded)
        assert tier.take_failed() == {}
        for name, v in kv.items():
            assert torch.equal(v[2], original[name][6]) and torch.equal(v[3], original[name][5])
    finally:
        tier.close()
