"""vLLM's chained prefix-cache block hashes, computed without importing vLLM.

The broker names a KV block by the same hash vLLM's prefix cache uses, so the
index agrees with every engine byte for byte. This module reproduces what
vLLM 0.32 computes (``vllm/v1/core/kv_cache_utils.py`` and
``vllm/utils/hashing.py``) so that routers, the CLI and the broker can hash
token ids on machines without vLLM.

How vLLM hashes a prompt (facts this module mirrors):

- Only FULL blocks of ``block_size`` tokens are hashed; a trailing partial
  block has no hash.
- Block ``i`` hashes the tuple ``(parent, tokens, extra_keys)``, where
  ``parent`` is block ``i-1``'s digest (``NONE_HASH`` for block 0),
  ``tokens`` is the block's token ids as a tuple of ints and ``extra_keys`` is
  ``None`` or a tuple of tagged keys.
- ``sha256`` hashes ``pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)``;
  ``sha256_cbor`` hashes ``cbor2.dumps(obj, canonical=True)``.
- ``NONE_HASH = hash_fn(seed)`` where ``seed`` is the string in the
  ``PYTHONHASHSEED`` environment variable when it is set, else the fixed
  string ``"vllm-none-hash"`` (for the cryptographic algorithms we support).
  So engines, routers and the broker agree without configuration, unless
  somebody sets ``PYTHONHASHSEED``: then every process that hashes for the
  same cluster must set the same value, or pass it here as ``seed``.
- ``cache_salt`` enters only block 0, as the extra key ``("cache_salt",
  salt)``; an empty salt is the same as no salt. A LoRA adapter enters every
  block as ``("lora", name, path)``, before the salt.
  Multi-modal and prompt-embeds keys are not supported here.

On the wire a hash is the first 8 bytes of the digest read as a big-endian
unsigned integer (``to_wire``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

# vLLM's fallback seed for NONE_HASH when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

SUPPORTED_HASH_ALGOS = ("sha256", "sha256_cbor")


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
}


def hash_function(hash_algo: str) -> Callable[[Any], bytes]:
    """The digest function vLLM uses for ``--prefix-caching-hash-algo``."""
    try:
        return _HASH_FUNCTIONS[hash_algo]
    except KeyError:
        raise ValueError(
            f"unsupported hash_algo {hash_algo!r}; supported: {', '.join(SUPPORTED_HASH_ALGOS)} "
            "(xxhash variants use a random per-process seed and cannot be shared)"
        ) from None


def default_none_hash_seed() -> str:
    """The seed vLLM in this process's environment would use: PYTHONHASHSEED, else the fixed default."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def none_hash(hash_algo: str = "sha256", seed: str | None = None) -> bytes:
    """vLLM's NONE_HASH: the parent of block 0."""
    return hash_function(hash_algo)(default_none_hash_seed() if seed is None else seed)


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    hash_algo: str = "sha256",
    cache_salt: str | None = None,
    seed: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[bytes]:
    """Chained digests of the full blocks of ``token_ids``, as vLLM computes them.

    ``seed`` is the NONE_HASH seed; None means what vLLM would use in this
    process (``PYTHONHASHSEED`` if set, else ``"vllm-none-hash"``).
    ``lora`` is ``(lora_name, lora_path)`` of the request's LoRA adapter.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    digest = hash_function(hash_algo)
    parent = digest(default_none_hash_seed() if seed is None else seed)
    lora_keys: list[tuple[str, ...]] = [("lora", lora[0], lora[1])] if lora else []
    salt_keys: list[tuple[str, ...]] = [("cache_salt", cache_salt)] if cache_salt else []
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys = lora_keys + salt_keys if start == 0 else lora_keys
        extra_keys = tuple(keys) if keys else None
        block = tuple(int(t) for t in token_ids[start : start + block_size])
        parent = digest((parent, block, extra_keys))
        hashes.append(parent)
    return hashes


def hash_block(
    hash_algo: str, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> bytes:
    """One block's digest from its parent's (None: block 0) as vLLM chains them.

    ``extra_keys`` are the tagged keys (e.g. ``(("cache_salt", "s"),)``), None when there are none.
    For a consumer that sees blocks one event at a time (vLLM's KV events) rather than whole prompts.
    """
    digest = hash_function(hash_algo)
    if parent is None:
        parent = digest(default_none_hash_seed())
    return digest((parent, tuple(int(t) for t in tokens), extra_keys))


def to_wire(h: bytes) -> int:
    """The wire form of a digest: its first 8 bytes as a big-endian unsigned int."""
    if len(h) < 8:
        raise ValueError(f"a block hash needs at least 8 bytes, got {len(h)}")
    return int.from_bytes(h[:8], "big")


def wire_chain(
    token_ids: Sequence[int],
    block_size: int,
    hash_algo: str = "sha256",
    cache_salt: str | None = None,
    seed: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[int]:
    """``chain_hashes`` in wire form (fixed64 each)."""
    return [
        to_wire(h)
        for h in chain_hashes(token_ids, block_size, hash_algo, cache_salt=cache_salt, seed=seed, lora=lora)
    ]
