"""Our pure-Python block hashes must equal what the installed vLLM computes."""

from __future__ import annotations

import random

import pytest

from kvbroker.common import hashing

vllm_kv = pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vLLM is not installed")
vllm_hashing = pytest.importorskip("vllm.utils.hashing")
vllm_request = pytest.importorskip("vllm.v1.request")
vllm_sampling = pytest.importorskip("vllm.sampling_params")
vllm_lora = pytest.importorskip("vllm.lora.request")

BLOCK_SIZE = 16
LENGTHS = [0, 1, 15, 16, 17, 32, 33, 100, 160]


def _vllm_block_hashes(
    tokens: list[int], hash_algo: str, cache_salt: str | None, lora: tuple[str, str] | None = None
) -> list[bytes]:
    """Hashes as vLLM's scheduler computes them for a real Request."""
    hash_fn = vllm_hashing.get_hash_fn_by_name(hash_algo)
    vllm_kv.init_none_hash(hash_fn)
    lora_request = vllm_lora.LoRARequest(lora[0], 1, lora[1]) if lora else None
    request = vllm_request.Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=vllm_sampling.SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=cache_salt,
        lora_request=lora_request,
        block_hasher=vllm_kv.get_request_block_hasher(BLOCK_SIZE, hash_fn),
    )
    return list(request.block_hashes)


@pytest.fixture(autouse=True)
def _unset_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.mark.parametrize("hash_algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("cache_salt", [None, "", "tenant-a"])
@pytest.mark.parametrize("length", LENGTHS)
def test_chain_matches_vllm(hash_algo: str, cache_salt: str | None, length: int) -> None:
    tokens = [random.Random(length).randrange(0, 50_000) for _ in range(length)]
    ours = hashing.chain_hashes(tokens, BLOCK_SIZE, hash_algo, cache_salt=cache_salt)
    theirs = _vllm_block_hashes(tokens, hash_algo, cache_salt)
    assert len(ours) == length // BLOCK_SIZE
    assert ours == theirs


@pytest.mark.parametrize("hash_algo", ["sha256", "sha256_cbor"])
def test_lora_and_salt_match_vllm(hash_algo: str) -> None:
    tokens = list(range(3 * BLOCK_SIZE + 5))
    lora = ("adapter", "/adapters/a")
    ours = hashing.chain_hashes(tokens, BLOCK_SIZE, hash_algo, cache_salt="s", lora=lora)
    assert ours == _vllm_block_hashes(tokens, hash_algo, "s", lora=lora)


def test_pythonhashseed_changes_the_chain_like_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = list(range(2 * BLOCK_SIZE))
    default = hashing.chain_hashes(tokens, BLOCK_SIZE)
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    seeded = hashing.chain_hashes(tokens, BLOCK_SIZE)
    assert seeded == _vllm_block_hashes(tokens, "sha256", None)
    assert seeded != default
    # An explicit seed wins over the environment.
    assert hashing.chain_hashes(tokens, BLOCK_SIZE, seed=hashing.DEFAULT_NONE_HASH_SEED) == default
    assert hashing.chain_hashes(tokens, BLOCK_SIZE, seed="1234") == seeded


def test_salt_and_algo_isolate_chains() -> None:
    tokens = list(range(2 * BLOCK_SIZE))
    plain = hashing.chain_hashes(tokens, BLOCK_SIZE)
    assert hashing.chain_hashes(tokens, BLOCK_SIZE, cache_salt="x")[0] != plain[0]
    assert hashing.chain_hashes(tokens, BLOCK_SIZE, hash_algo="sha256_cbor")[0] != plain[0]
    # A shared prefix gives a shared chain: block 0 of a longer prompt is the same.
    assert hashing.chain_hashes(tokens + [7] * BLOCK_SIZE, BLOCK_SIZE)[:2] == plain


def test_wire_form() -> None:
    digest = bytes(range(32))
    assert hashing.to_wire(digest) == 0x0001020304050607
    assert hashing.to_wire(b"\xff" * 32) == 2**64 - 1
    tokens = list(range(40))
    assert hashing.wire_chain(tokens, BLOCK_SIZE) == [
        int.from_bytes(h[:8], "big") for h in hashing.chain_hashes(tokens, BLOCK_SIZE)
    ]
    with pytest.raises(ValueError):
        hashing.to_wire(b"short")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unsupported hash_algo"):
        hashing.chain_hashes([1, 2], 1, hash_algo="xxhash")
    with pytest.raises(ValueError, match="block_size"):
        hashing.chain_hashes([1, 2], 0)
