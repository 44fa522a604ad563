"""The verified-bytes digest multilinear32-v1: what it detects, and its three implementations agree.

numpy (``digest_words``, the reference), numba over raw DRAM addresses (``RegionDigester``, what
a DRAM tier uses) and torch (``tensor_sums``, what a VRAM tier uses; run here on CPU tensors, and
on a GPU where there is one) must give the same digest for the same bytes in every layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.data_path.kv_layouts import LAYOUTS, MODELS, kv_caches
from kvbroker.engine_adapter import multilinear as ml
from kvbroker.engine_adapter.digests import BlockBytes
from kvbroker.engine_adapter.kv_regions import Region, regions_from_kv_caches

BLOCK = 1024  # bytes of the entry the exhaustive tests vary


def _copies(block: np.ndarray, n: int) -> tuple[np.ndarray, ml.RegionDigester]:
    """n copies of one entry's bytes, back to back, and a digester over them (one piece each)."""
    buf = np.tile(block, (n, 1))
    return buf, ml.RegionDigester([[(buf.ctypes.data, buf.shape[1], buf.shape[1])]])


def _entry(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def test_keys_are_distinct_odd_32_bit_and_the_same_for_any_length() -> None:
    k = ml.keys(ml.CHECKED_WORDS)
    assert k.dtype == np.uint64 and bool((k & np.uint64(1)).all()) and int(k.max()) < 2**32
    assert len(np.unique(k)) == len(k), "distinct keys: a swap of two different words always shows"
    assert np.array_equal(ml.keys(1000), k[:1000])


def test_no_single_bit_flip_in_the_first_checked_words_can_leave_the_digest_unchanged() -> None:
    """A flip of bit j of word i adds +-2**j * k_i to the 64-bit sum, i.e. +-D to (sum * FOLD);
    the top 32 bits then change unless D's top half is all zeros or all ones."""
    k = ml.keys(ml.CHECKED_WORDS)
    with np.errstate(over="ignore"):
        for j in range(32):
            d = (k << np.uint64(j)) * np.uint64(ml.FOLD)
            for delta in (d, np.uint64(0) - d):
                top = delta >> np.uint64(32)
                assert not np.any((top == 0) | (top == 0xFFFFFFFF)), f"bit {j}"


def test_every_flipped_bit_of_an_entry_changes_its_digest() -> None:
    block = _entry()
    bits = BLOCK * 8
    buf, digester = _copies(block, bits + 1)
    rows = np.arange(bits)
    buf[rows, rows // 8] ^= (1 << (rows % 8)).astype(np.uint8)  # row r: bit r flipped; last row intact
    got = digester.digests(range(bits + 1))[:, 0]
    original = got[-1]
    assert original == ml.digest_words(block.tobytes())
    assert not np.any(got[:-1] == original)


def test_swapped_words_and_swapped_halves_change_the_digest() -> None:
    block = _entry(2)
    rng = np.random.default_rng(3)
    pairs = [tuple(p) for p in rng.choice(BLOCK // 4, size=(300, 2), replace=True) if p[0] != p[1]]
    buf, digester = _copies(block, len(pairs) + 2)
    words = buf.view(np.uint32)
    for row, (a, b) in enumerate(pairs):
        words[row, [a, b]] = words[row, [b, a]]
    half = BLOCK // 2
    buf[len(pairs)] = np.concatenate([block[half:], block[:half]])  # V before K
    got = digester.digests(range(len(pairs) + 2))[:, 0]
    same = [row for row, (a, b) in enumerate(pairs) if words[row, a] == words[row, b]]
    assert same == [], "the random entry has no equal words to swap"
    assert not np.any(got[:-1] == got[-1])


def test_a_wrong_block_differs_and_equal_bytes_digest_equal_at_any_block_id() -> None:
    kv = kv_caches(MODELS["tiny"], "cpu", 12, seed=4)
    regions, n, mem_type = regions_from_kv_caches(kv)
    got = BlockBytes(regions, n, mem_type).digests(range(12), [0, 1])
    assert len(np.unique(got)) == got.size, "every (block, layer) of distinct bytes differs"
    for t in kv.values():
        t[9] = t[2]
    again = BlockBytes(regions, n, mem_type).digests([2, 9], [0, 1])
    assert np.array_equal(again[0], again[1]), "position-free: a reader checks at its own block ids"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_numba_and_torch_agree_in_every_layout(layout: str) -> None:
    shape = MODELS["tiny"]
    kv = kv_caches(shape, layout, 10, seed=7)
    regions, n, mem_type = regions_from_kv_caches(kv)
    ids, layers = [9, 0, 4], [1, 0]
    in_place = BlockBytes(regions, n, mem_type).digests(ids, layers)
    through_tensors = BlockBytes(regions, n, "VRAM", kv.values()).digests(ids, layers)  # torch path
    reference = np.array(
        [[ml.digest_words(_layer_block(kv, layout, layer, b)) for layer in layers] for b in ids]
    )
    assert np.array_equal(in_place, reference) and np.array_equal(through_tensors, reference)


def _layer_block(kv: dict[str, torch.Tensor], layout: str, layer: int, block: int) -> bytes:
    t = kv[f"model.layers.{layer}.self_attn.attn"]
    parts = [t[0, block], t[1, block]] if layout == "kv_split" else [t[block]]  # K then V
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


def test_entries_read_eight_at_once_equal_one_at_a_time_for_any_count_and_unlike_layers() -> None:
    """The kernel reads eight entries together where their layers' pieces are alike, one at a time
    elsewhere: every count of blocks, and pairs that mix layers of other sizes, give the
    reference digests."""
    rng = np.random.default_rng(5)
    blocks = 11
    sizes = [[64], [96, 32], [64], [200 * 8]]  # bytes per piece, per layer: 0 and 2 are alike
    bufs = [[rng.integers(0, 256, (blocks, n), dtype=np.uint8) for n in layer] for layer in sizes]
    digester = ml.RegionDigester([[(b.ctypes.data, b.shape[1], b.shape[1]) for b in layer] for layer in bufs])

    def reference(block: int, layer: int) -> int:
        return ml.digest_words(b"".join(b[block].tobytes() for b in bufs[layer]))

    for count in range(1, 18):
        ids = rng.integers(0, blocks, count)
        want = np.array([[reference(int(b), j) for j in range(len(sizes))] for b in ids])
        assert np.array_equal(digester.digests(ids), want), f"{count} blocks"
    ids = rng.integers(0, blocks, 41)
    for layers in (rng.integers(0, 4, 41), np.array([0, 2] * 20 + [1]), np.array([0] * 7 + [1] + [2] * 33)):
        want = [reference(int(b), int(j)) for b, j in zip(ids, layers, strict=True)]
        assert digester.pair_digests(ids, layers).tolist() == want


def test_pieces_that_are_not_whole_words_are_refused() -> None:
    with pytest.raises(ValueError, match="whole 8-byte words; a piece is 12 bytes"):
        ml.RegionDigester([[(4096, 12, 12)]])
    t = torch.zeros(24, dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole 8-byte words; a piece is 12 bytes"):  # on a GPU too
        BlockBytes([Region(0, t.data_ptr(), 12, 12)], 2, "VRAM", [t])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vram_digests_on_the_gpu_equal_those_of_the_same_bytes_in_dram(layout: str) -> None:
    shape = MODELS["tiny"]
    on_gpu = kv_caches(shape, layout, 10, seed=8, device="cuda")
    in_dram = {name: t.cpu() for name, t in on_gpu.items()}
    regions, n, mem_type = regions_from_kv_caches(on_gpu)
    assert mem_type == "VRAM"
    gpu = BlockBytes(regions, n, mem_type, on_gpu.values()).digests([3, 8, 0], [0, 1])
    cpu_regions, _, _ = regions_from_kv_caches(in_dram)
    assert np.array_equal(gpu, BlockBytes(cpu_regions, n, "DRAM").digests([3, 8, 0], [0, 1]))
