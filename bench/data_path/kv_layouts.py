"""KV cache layouts of real engines, for the data-path benchmark.

Each layout builds per-layer tensors the way an engine does, so the adapter's
own `regions_from_kv_caches` maps them to regions exactly as it would inside
vLLM:

- ``cpu``: vLLM 0.32's CPU backend (layout LBHNC). One allocation viewed per
  layer as ``[blocks, kv_heads, block_size, 2 * head_size]``: K and V share a
  page, a layer's blocks are adjacent, layers follow one another.
- ``kv_split``: K and V apart, one allocation per layer,
  ``[2, blocks, block_size, kv_heads, head_size]`` (the CUDA flash-attn layout
  of vLLM before 0.32): two regions per layer.
- ``blhnc``: block-outermost (vLLM 0.32's BLHNC, which GPU backends such as
  FlashInfer may use): one allocation, a block's layers adjacent.

Contents are a cheap deterministic function of the byte position and a seed,
so the reader can compute what it should have received without a copy of the
holder's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("cpu", "kv_split", "blhnc")
LAYER_NAME = "model.layers.{}.self_attn.attn"


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    block_size: int = 32
    dtype: torch.dtype = torch.float32

    @property
    def elem(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """One layer's K and V of one block."""
        return self.kv_heads * self.block_size * 2 * self.head_size * self.elem

    @property
    def block_bytes(self) -> int:
        """One block, every layer."""
        return self.layers * self.page_bytes


MODELS = {
    # tools/tiny_model.py defaults: the model the tests and the demo serve.
    "tiny": ModelShape("tiny", layers=2, kv_heads=2, head_size=32),
    # HuggingFaceTB/SmolLM2-135M-Instruct: 30 layers, 3 KV heads, head dim 64.
    "smollm2-135m": ModelShape("smollm2-135m", layers=30, kv_heads=3, head_size=64),
}


def fill(buf: torch.Tensor, seed: int) -> None:
    """Deterministic contents: every 4-byte word differs, and differs per seed."""
    words = buf.view(torch.int32)
    idx = torch.arange(words.numel(), dtype=torch.int64, device=buf.device)
    words.copy_(((idx * 2654435761 + seed * 40503) & 0x7FFFFFFF).to(torch.int32))


def kv_caches(
    shape: ModelShape, layout: str, num_blocks: int, seed: int | None, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors of `layout` (filled from `seed`, zeros when None), as an engine views them.

    `device` "cuda" puts them in VRAM, as a GPU engine has them (bench/data_path/gpu_check.py)."""
    m = shape
    if layout == "kv_split":
        caches = {}
        for layer in range(m.layers):
            raw = torch.zeros(num_blocks * m.page_bytes, dtype=torch.uint8, device=device)  # K then V
            if seed is not None:
                fill(raw, seed * 1000 + layer)
            caches[LAYER_NAME.format(layer)] = raw.view(m.dtype).view(
                2, num_blocks, m.block_size, m.kv_heads, m.head_size
            )
        return caches
    raw = torch.zeros(m.layers * num_blocks * m.page_bytes, dtype=torch.uint8, device=device)
    if seed is not None:
        fill(raw, seed)
    view = raw.view(m.dtype)
    page = m.page_bytes // m.elem
    inner = (m.kv_heads, m.block_size, 2 * m.head_size)
    inner_strides = (m.block_size * 2 * m.head_size, 2 * m.head_size, 1)
    if layout == "cpu":
        layer_stride, block_stride = num_blocks * page, page
    elif layout == "blhnc":
        layer_stride, block_stride = page, m.layers * page
    else:
        raise ValueError(f"unknown layout {layout!r} (have {LAYOUTS})")
    return {
        LAYER_NAME.format(layer): torch.as_strided(
            view, (num_blocks, *inner), (block_stride, *inner_strides), layer * layer_stride
        )
        for layer in range(m.layers)
    }


def blocks_of(caches: dict[str, torch.Tensor], layout: str, block_ids: list[int]) -> list[torch.Tensor]:
    """The bytes of `block_ids` in every layer (K and V), for comparing a read with its source.

    As int32: the float words of `fill` include NaN patterns, which never compare equal."""
    out = []
    for layer in sorted(caches, key=lambda n: int(n.split(".")[2])):
        t = caches[layer]
        picked = t[:, block_ids] if layout == "kv_split" else t[block_ids]
        out.append(picked.contiguous().view(torch.int32))
    return out
