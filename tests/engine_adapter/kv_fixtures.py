"""KV cache tensors shaped like vLLM 0.32's, filled with seeded random data.

vLLM 0.32 allocates one int8 buffer and views it per layer as
[num_blocks, kv_heads, block_size, 2 * head_size] (the CPU backend's LBHNC
layout: a layer's blocks are adjacent dense pages). These helpers build the
same shapes without importing vLLM, so both processes of a NIXL test can
rebuild identical contents from a seed.
"""

from __future__ import annotations

import torch

LAYER_NAME = "model.layers.{}.self_attn.attn"


def cpu_backend_kv_caches(
    num_layers: int = 3,
    num_blocks: int = 24,
    kv_heads: int = 2,
    block_size: int = 32,
    head_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Per-layer views over one shared allocation, like vLLM's allocate_kv_cache (layer-compact)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    page = kv_heads * block_size * 2 * head_size * elem
    buf = torch.zeros(num_layers * num_blocks * page, dtype=torch.int8, device=device)
    shape = (num_blocks, kv_heads, block_size, 2 * head_size)
    caches = {}
    for layer in range(num_layers):
        raw = buf[layer * num_blocks * page : (layer + 1) * num_blocks * page]
        caches[LAYER_NAME.format(layer)] = raw.view(dtype).view(shape)
    if seed is not None:
        fill_random(caches, seed)
    return caches


def legacy_split_kv_caches(
    num_layers: int = 2,
    num_blocks: int = 16,
    block_size: int = 16,
    kv_heads: int = 2,
    head_size: int = 8,
    seed: int | None = 0,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """The pre-0.32 CUDA flash-attn layout [2, num_blocks, block_size, heads, head_size] (K, V apart)."""
    caches = {
        LAYER_NAME.format(layer): torch.zeros(2, num_blocks, block_size, kv_heads, head_size, device=device)
        for layer in range(num_layers)
    }
    if seed is not None:
        fill_random(caches, seed)
    return caches


def fill_random(caches: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(caches):
        t = caches[name]
        t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device))
