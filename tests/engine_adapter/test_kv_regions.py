"""regions_from_kv_caches: every (layer, block) maps to exactly the bytes of that block."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvbroker.engine_adapter.kv_regions import (
    Region,
    layer_index_from_name,
    regions_from_kv_caches,
    regions_from_proto,
    regions_to_proto,
)
from tests.engine_adapter.kv_fixtures import cpu_backend_kv_caches, legacy_split_kv_caches


def region_bytes(region: Region, block: int) -> bytes:
    return ctypes.string_at(region.block_addr(block), region.block_bytes)


def block_bytes_in_memory_order(t: torch.Tensor) -> bytes:
    """The block's bytes as they sit in memory (a strided view may permute its axes)."""
    order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
    return t.permute(order).contiguous().view(torch.uint8).numpy().tobytes()


def test_cpu_backend_layout_is_one_region_per_layer() -> None:
    caches = cpu_backend_kv_caches(num_layers=3, num_blocks=10)
    regions, num_blocks, mem_type = regions_from_kv_caches(caches)
    assert (num_blocks, mem_type) == (10, "DRAM")
    assert [r.layer for r in regions] == [0, 1, 2]
    for r in regions:
        t = caches[f"model.layers.{r.layer}.self_attn.attn"]
        assert r.block_bytes == r.block_stride == t[0].nbytes
        for b in (0, 3, 9):
            assert region_bytes(r, b) == t[b].contiguous().view(torch.uint8).numpy().tobytes()


def test_legacy_split_layout_gives_k_then_v_per_layer() -> None:
    caches = legacy_split_kv_caches(num_layers=2, num_blocks=8)
    regions, num_blocks, _ = regions_from_kv_caches(caches)
    assert num_blocks == 8
    assert [r.layer for r in regions] == [0, 0, 1, 1]
    for i, r in enumerate(regions):
        t = caches[f"model.layers.{r.layer}.self_attn.attn"]
        kv = t[i % 2]
        for b in (0, 5, 7):
            assert region_bytes(r, b) == kv[b].contiguous().numpy().tobytes()


def test_layer_names_sorted_by_index_not_text() -> None:
    caches = cpu_backend_kv_caches(num_layers=12, num_blocks=2, seed=None)
    regions, _, _ = regions_from_kv_caches(caches)
    assert [r.layer for r in regions] == list(range(12))


def test_custom_layer_index_function() -> None:
    caches = {"decoder.attn_a": torch.zeros(4, 2, 32, 8), "decoder.attn_b": torch.zeros(4, 2, 32, 8)}
    with pytest.raises(ValueError, match="layer_index_of"):
        regions_from_kv_caches(caches)
    regions, _, _ = regions_from_kv_caches(caches, layer_index_of=lambda n: {"a": 5, "b": 6}[n[-1]])
    assert [r.layer for r in regions] == [5, 6]


def test_refuses_flat_and_mismatched_caches() -> None:
    with pytest.raises(ValueError, match="no block axis"):
        regions_from_kv_caches({"model.layers.0.attn": torch.zeros(1024)})
    with pytest.raises(ValueError, match="blocks"):
        regions_from_kv_caches(
            {"model.layers.0.attn": torch.zeros(4, 2, 32, 8), "model.layers.1.attn": torch.zeros(5, 2, 32, 8)}
        )
    with pytest.raises(ValueError, match="no KV cache"):
        regions_from_kv_caches({})


def test_layer_index_from_name() -> None:
    assert layer_index_from_name("model.layers.17.self_attn.attn") == 17
    assert layer_index_from_name("language_model.model.layers.3.self_attn.attn") == 3
    with pytest.raises(ValueError):
        layer_index_from_name("model.layers.1.experts.2.attn")


def test_proto_round_trip() -> None:
    regions = [Region(3, 2**40 + 17, 4096, 2048, 1), Region(4, 12, 8, 8, 0)]
    assert regions_from_proto(regions_to_proto(regions)) == regions


VLLM_LAYOUTS = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]


@pytest.mark.parametrize("layout_name", VLLM_LAYOUTS)
def test_matches_vllm_allocator_views(layout_name: str) -> None:
    """The views vLLM 0.32 itself builds (create_kv_cache_views), in layer- and block-outermost layouts."""
    kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = kv_iface.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32)
    num_blocks, num_layers, page = 6, 3, spec.page_size_bytes
    if layout.is_layer_compact:
        strides = {"layer_stride": num_blocks * page, "block_stride": page}
    else:
        strides = {"layer_stride": page, "block_stride": num_layers * page}
    tensor = kv_iface.KVCacheTensor(
        size=num_layers * num_blocks * page,
        layers=[f"model.layers.{i}.attn" for i in range(num_layers)],
        **strides,
    )
    buf = torch.randint(-128, 127, (tensor.size,), dtype=torch.int8)
    views = kv_iface.create_kv_cache_views(buf, spec, num_blocks, layout, tensor)
    caches = dict(zip(tensor.layers, views, strict=True))
    regions, n, _ = regions_from_kv_caches(caches)
    assert n == num_blocks and len(regions) == num_layers
    for r in regions:
        view = caches[f"model.layers.{r.layer}.attn"]
        assert r.block_bytes == page
        for b in range(num_blocks):
            assert region_bytes(r, b) == block_bytes_in_memory_order(view[b])
