"""Map vLLM's per-layer KV cache tensors to byte regions NIXL can address.

A `Region` says where block `b` of one layer lives: `base_addr + b *
block_stride`, `block_bytes` long. A layer may need several regions when one
block is not a single dense run of bytes, e.g. the legacy CUDA flash-attn
layout `[2, num_blocks, block_size, heads, head_size]` stores K and V apart,
so it gives two regions per layer (K first, then V).

Layouts seen in vLLM 0.32 (`allocate_kv_cache`): each layer is a 4-D view
`[num_blocks, heads, block_size, 2 * head_size]` (K and V packed in the last
axis) over one shared int8 allocation. With the CPU backend's layout (LBHNC)
a block is one dense page and blocks of a layer are adjacent; with
block-outermost layouts (BLHNC, BLNHC) the pages of all layers interleave, so
`block_stride > block_bytes`. All of these map to regions without copying.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any

from kvbroker.v1 import broker_pb2 as pb

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Region:
    """Block `b` of `layer` is the `block_bytes` bytes at `base_addr + b * block_stride`."""

    layer: int
    base_addr: int
    block_stride: int
    block_bytes: int
    device_id: int = 0

    def block_addr(self, block_id: int) -> int:
        return self.base_addr + block_id * self.block_stride

    def span(self, num_blocks: int) -> tuple[int, int]:
        """[start, end) of the bytes that `num_blocks` blocks of this region touch."""
        if num_blocks <= 0:
            return (self.base_addr, self.base_addr)
        return (self.base_addr, self.block_addr(num_blocks - 1) + self.block_bytes)

    def to_proto(self) -> pb.MemoryRegion:
        return pb.MemoryRegion(
            layer=self.layer,
            base_addr=self.base_addr,
            block_stride=self.block_stride,
            block_bytes=self.block_bytes,
            device_id=self.device_id,
        )

    @classmethod
    def from_proto(cls, msg: pb.MemoryRegion) -> Region:
        return cls(
            layer=msg.layer,
            base_addr=msg.base_addr,
            block_stride=msg.block_stride,
            block_bytes=msg.block_bytes,
            device_id=msg.device_id,
        )


def regions_to_proto(regions: list[Region]) -> list[pb.MemoryRegion]:
    return [r.to_proto() for r in regions]


def regions_from_proto(msgs: Iterable[pb.MemoryRegion]) -> list[Region]:
    return [Region.from_proto(m) for m in msgs]


_INT_COMPONENT = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index_from_name(layer_name: str) -> int:
    """vLLM names attention layers like `model.layers.7.self_attn.attn`: the one integer part."""
    found = _INT_COMPONENT.findall(layer_name)
    if len(found) != 1:
        raise ValueError(
            f"cannot tell the layer index of KV cache {layer_name!r} "
            f"(expected exactly one integer component, found {found}); pass layer_index_of"
        )
    return int(found[0])


def regions_from_kv_caches(
    kv_caches: dict[str, torch.Tensor],
    layer_index_of: Callable[[str], int] | None = None,
) -> tuple[list[Region], int, str]:
    """Regions for every layer's KV cache, the number of blocks, and the NIXL memory type.

    Regions come sorted by layer, and within a layer in memory order (K
    before V for split layouts), so two engines with the same layout produce
    matching lists. Raises ValueError for layouts that cannot be addressed
    block by block (a clear refusal beats a silent wrong read).
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors to register")
    index_of = layer_index_of or layer_index_from_name
    regions: list[Region] = []
    num_blocks: int | None = None
    mem_types: set[str] = set()
    for name, tensor in kv_caches.items():
        layer = index_of(name)
        block_dim = _block_dim(tensor, name)
        n = int(tensor.shape[block_dim])
        if num_blocks is not None and n != num_blocks:
            raise ValueError(
                f"KV cache {name!r} has {n} blocks but other layers have {num_blocks}; "
                "layers with different block counts (hybrid models) are not supported"
            )
        num_blocks = n
        mem_types.add("VRAM" if tensor.device.type == "cuda" else "DRAM")
        regions.extend(_layer_regions(tensor, layer, block_dim, name))
    if len(mem_types) != 1:
        raise ValueError(f"KV caches span several memory types {sorted(mem_types)}")
    regions.sort(key=lambda r: (r.layer, r.base_addr))
    assert num_blocks is not None
    return regions, num_blocks, mem_types.pop()


def _block_dim(tensor: torch.Tensor, name: str) -> int:
    # vLLM 0.32 per-layer views are [blocks, heads, tokens, 2*head]. The legacy
    # K/V-split layout [2, blocks, tokens, heads, head] is recognised by its
    # leading 2 (a one-dimensional flat view has no block axis at all).
    if tensor.dim() == 5 and tensor.shape[0] == 2 and tensor.shape[1] != 2:
        return 1
    if tensor.dim() >= 3:
        return 0
    raise ValueError(
        f"KV cache {name!r} has shape {tuple(tensor.shape)}: no block axis; "
        "flat or shared-buffer caches (hybrid/mamba models) are not supported"
    )


def _layer_regions(tensor: torch.Tensor, layer: int, block_dim: int, name: str) -> Iterator[Region]:
    """Split one block of `tensor` into its dense byte runs; each run is a region.

    Dims of the block are ordered by stride (outermost first); the longest
    innermost suffix that is densely packed is one run, and every index of
    the remaining outer dims starts another run.
    """
    elem = tensor.element_size()
    block_stride = tensor.stride(block_dim) * elem
    dims = [(tensor.shape[d], tensor.stride(d)) for d in range(tensor.dim()) if d != block_dim]
    dims = [(size, stride) for size, stride in dims if size != 1]
    dims.sort(key=lambda ds: ds[1], reverse=True)
    dense_from = len(dims)
    expected_stride = 1
    for i in range(len(dims) - 1, -1, -1):
        size, stride = dims[i]
        if stride != expected_stride:
            break
        expected_stride *= size
        dense_from = i
    run_bytes = expected_stride * elem
    outer = dims[:dense_from]
    if len(outer) > 2:
        raise ValueError(
            f"KV cache {name!r} (shape {tuple(tensor.shape)}, strides {tensor.stride()}) "
            "scatters a block over too many pieces to transfer efficiently"
        )
    if block_stride < run_bytes and tensor.shape[block_dim] > 1:
        raise ValueError(f"KV cache {name!r}: blocks overlap (stride {block_stride} < {run_bytes} bytes)")
    device_id = max(tensor.get_device(), 0)
    base = tensor.data_ptr()
    for idx in product(*(range(size) for size, _ in outer)):
        offset = sum(i * stride for i, (_, stride) in zip(idx, outer, strict=True)) * elem
        yield Region(
            layer=layer,
            base_addr=base + offset,
            block_stride=block_stride,
            block_bytes=run_bytes,
            device_id=device_id,
        )


def tier_info(tier: pb.Tier.ValueType, mem_type: str, num_blocks: int, regions: Sequence[Any]) -> pb.TierInfo:
    """One tier of a rank's memory as the broker learns it (RegisterRank)."""
    return pb.TierInfo(
        tier=tier,
        mem_type=mem_type,
        num_blocks=num_blocks,
        regions=[
            pb.MemoryRegion(
                layer=r.layer,
                base_addr=r.base_addr,
                block_stride=r.block_stride,
                block_bytes=r.block_bytes,
                device_id=r.device_id,
            )
            for r in regions
        ],
    )
